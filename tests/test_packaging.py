"""The built wheel: it carries the tables (as kvstate.tables), py.typed and the compiled
native module, and no harness code (issue 27: the benchmarks, the soak and the vLLM
engines kit live in the checkout, not in every engine's site-packages)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: kvstate/harness/ modules the wheel ships: what `kvstate demo`, `kvstate gpucheck` and
#: `kvstate check` run. Anything else under kvstate/harness/ is harness code left behind.
SHIPPED_HARNESS = {"__init__", "children", "cluster", "scenario", "prefill_procs", "leaks", "gpucheck", "modelcheck"}
#: folders that only the checkout's kits use: a wheel file under one is harness code
HARNESS_NAMES = {"bench", "benchmarks", "engines", "soak", "coord_bench", "support", "tests"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The wheel of the files git would commit (as tools/wheel-check.sh builds it): a stale
    build/ or in-place extension of the checkout cannot slip in."""
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(src)], check=True, capture_output=True)
    (built,) = dist.glob("kvstate-*.whl")
    yield built


def harness_in(names: list[str]) -> list[str]:
    """The files of a wheel that are harness code (empty when it ships none)."""
    found = []
    for name in names:
        parts = name.removesuffix(".py").split("/")
        if parts[0].endswith(".dist-info"):
            continue
        if parts[0] != "kvstate" or HARNESS_NAMES & set(parts[:-1]):
            found.append(name)
        elif parts[:2] == ["kvstate", "harness"] and (len(parts) != 3 or parts[2] not in SHIPPED_HARNESS):
            found.append(name)
    return found


def test_wheel_holds_no_harness_code(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert harness_in(names) == []
    assert {f"kvstate/harness/{m}.py" for m in SHIPPED_HARNESS} <= set(names)  # the demo's own stays
    # The compiled cffi extension is in it, so installing the wheel needs no compiler.
    assert [n for n in names if n.startswith("kvstate/_native") and n.endswith(".abi3.so")]
    assert "abi3" in wheel.name


def test_harness_check_catches_harness_files() -> None:
    """Negative control: the files the old wheel shipped are each reported."""
    old = ["kvstate/harness/cluster.py", "kvstate/harness/soak.py", "kvstate/harness/coord_bench.py",
           "kvstate/harness/bench/b1_import.py", "kvstate/harness/engines/runner.py", "benchmarks/suites.py",
           "support/engines/probe.py", "kvstate-0.1.0.dist-info/RECORD", "kvstate/core/spec.py"]
    assert harness_in(old) == ["kvstate/harness/soak.py", "kvstate/harness/coord_bench.py",
                               "kvstate/harness/bench/b1_import.py", "kvstate/harness/engines/runner.py",
                               "benchmarks/suites.py", "support/engines/probe.py"]


def test_installed_wheel_loads_its_own_tables_and_sends_bench_to_a_checkout(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    names = zipfile.ZipFile(wheel).namelist()
    assert {"kvstate/py.typed", "kvstate/tables/group.toml", "kvstate/tables/invariants.toml"} <= set(names)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    code = ("import kvstate, kvstate.core.spec as s; from importlib import resources;"
            "print(kvstate.__file__); print(resources.files('kvstate.tables'));"
            "print(sorted(s.load_spec().machines))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True,
                         env=env).stdout.splitlines()
    assert out[0].startswith(str(site)) and out[1].startswith(str(site))
    assert out[2] == "['bank', 'coordinator', 'group', 'op', 'part', 'rank']"
    # `kvstate bench` is a command of a checkout: from the wheel it says so, no traceback.
    bench = subprocess.run([sys.executable, "-c", "import sys; from kvstate.commands.cli import main; "
                            "sys.exit(main(['bench', '--quick']))"], cwd=tmp_path, capture_output=True, text=True,
                           env=env, timeout=60)
    assert bench.returncode == 2, bench.stdout + bench.stderr
    assert "make bench" in bench.stderr and "source checkout" in bench.stderr and "Traceback" not in bench.stderr
