"""`kvstate demo` as a user runs it: a subprocess, its exit code and its output."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

SMALL = ["--tp", "2", "--layers", "2", "--blocks", "32", "--prefix-blocks", "8"]
DEMO = [sys.executable, "-m", "kvstate", "demo", *SMALL]
ROOT = Path(__file__).resolve().parents[2]


def console_script(folder: Path) -> Path:
    """A stand-in for the installed ``kvstate`` script: its own folder, not the current
    one, is first on its ``sys.path`` (``python -m`` would put the current folder there)."""
    folder.mkdir()
    script = folder / "kvstate_cli.py"
    script.write_text("import sys\nfrom kvstate.commands.cli import main\n"
                      "if __name__ == '__main__':\n    sys.exit(main())\n")
    return script


def with_path(*folders: Path) -> dict[str, str]:
    """This environment with ``folders`` and the checkout under test first on PYTHONPATH."""
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, folders), str(ROOT), *old])}


def test_demo_verifies_reuse_and_prints_a_summary() -> None:
    out = subprocess.run(DEMO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"checksums +2/2 ranks loaded and verified", out.stdout) and "per-rank-process" in out.stdout
    assert "OK: reuse verified, nothing partial, nothing leaked" in out.stdout
    # Timings are measured inside the workers and say what they measure; none has process spawn.
    assert "time, import: validate, check, lease, map, ready (coordinator)" in out.stdout
    assert "time, total: the four phases above (no process spawn, no engine start)" in out.stdout


def test_demo_json_reports_the_topology_per_rank() -> None:
    """Each rank is its own process, leases sum to tp, the group's history is the table's."""
    out = subprocess.run([*DEMO, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["topology"] == "per-rank-process" and report["ok"] is True
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    assert all(r["import_s"] > 0 for r in ranks) and sum(r["leases"] for r in ranks) == 2
    states = [h[0] for h in report["coordinator"]["history"]]
    assert [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]] == [
        "advertised", "checking", "importing", "ready", "draining", "quiescent", "closed"]
    assert report["time_to_ready_s"] > 0
    # `kvstate status` before and after draining: what the servers held, then released.
    before, after = (report["status"][w]["endpoints"] for w in ("before draining", "after draining"))
    banks = lambda eps: [b for e in eps if e["kind"] == "exporter" for b in e["banks"]]  # noqa: E731
    assert [(b["rank"], b["state"], b["lease_count"]) for b in banks(before)] == [(0, "ready", 1), (1, "ready", 1)]
    assert {lease["pid"] for b in banks(before) for lease in b["leases"]} == {r["pid"] for r in ranks}
    assert [(b["state"], b["lease_count"]) for b in banks(after)] == [("released", 0)] * 2
    coord = [e for e in before if e["kind"] == "coordinator"]
    assert len(coord) == 1 and [g["state"] for g in coord[0]["groups"]] == ["ready"]
    timings = report["timings_s"]
    assert all("spawn" not in k for k in timings if not k.startswith("total"))
    total = next(v for k, v in timings.items() if k.startswith("total"))
    assert total == pytest.approx(sum(v for k, v in timings.items() if not k.startswith("total")))


def test_demo_with_a_kill_shows_clean_failure_and_json() -> None:
    out = subprocess.run([*DEMO, "--kill", "exporter:advertised", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["kill"] == "exporter:advertised" and report["group"]["state"] == "failed"
    assert report["worker_final"] == ["failed", "failed"] and report["ok"] is True
    assert report["outcome"].startswith("failed cleanly, prefix recomputed: 0/2 ranks loaded")


def test_a_kill_during_the_load_is_not_reported_as_ok() -> None:
    """Killing one worker while loading leaves 1 of 2 ranks loaded: the group's load is
    unusable, and the demo says so instead of "OK"."""
    out = subprocess.run([*DEMO, "--kill", "worker:loading"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "failed cleanly, prefix recomputed: 1/2 ranks loaded" in out.stdout
    assert "OK" not in out.stdout.split("verdict", 1)[1]


@pytest.mark.parametrize(("args", "message"), [
    (["--kill", "exporter"], "expected ROLE:PHASE"),
    (["--kill", "decoder:ready"], "expected ROLE:PHASE"),
    (["--kill", "importer:ready"], "expected ROLE:PHASE"),
    (["--tp", "0"], "must be between 1 and 16"),
    (["--tp", "four"], "is not an integer"),
    (["--prefix-blocks", "64"], "exceeds --blocks"),
])
def test_bad_options_get_a_clear_error(args: list[str], message: str) -> None:
    out = subprocess.run([*DEMO, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr


def without(folder: Path, *modules: str) -> Path:
    """A folder whose sitecustomize makes ``modules`` missing in every process that has
    the folder on its path (the demo's children inherit it from the forkserver)."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import sys

        class Missing:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {modules!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, Missing())
    """))
    return folder


def test_the_demo_needs_only_the_base_dependencies(tmp_path: Path) -> None:
    """Every process of the demo without numpy and torch (a lean install has neither):
    it still verifies reuse. Its workers used to load into numpy arrays."""
    script = console_script(tmp_path / "bin")
    out = subprocess.run([sys.executable, str(script), "demo", *SMALL], cwd=tmp_path,
                         env=with_path(without(tmp_path / "lean", "numpy", "torch")),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK: reuse verified" in out.stdout


def test_children_import_the_parents_kvstate_whatever_the_current_folder(tmp_path: Path) -> None:
    """Run from a folder that holds another kvstate (a source checkout, say), no process of
    the demo imports that one. The forkserver used to put the current folder first on its
    path and preload from it: the children then failed with ModuleNotFoundError."""
    marker = tmp_path / "imported"
    (tmp_path / "kvstate").mkdir()
    (tmp_path / "kvstate" / "__init__.py").write_text(
        f"open({str(marker)!r}, 'a').write('imported by pid %d\\n' % __import__('os').getpid())\n"
        "raise ImportError('not the kvstate under test')\n")
    script = console_script(tmp_path / "bin")
    out = subprocess.run([sys.executable, str(script), "demo", *SMALL], cwd=tmp_path, env=with_path(),
                         capture_output=True, text=True, timeout=120)
    assert not marker.exists(), marker.read_text()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK: reuse verified" in out.stdout


def test_a_worker_that_dies_at_start_is_one_line_naming_it(tmp_path: Path) -> None:
    """Every process of the demo without cffi's backend (issue 27's plain install): each
    exporter dies at start. The user reads one line naming the process, its exit status and
    its last stderr lines, and a non-zero exit; no EOFError, no multiprocessing traceback."""
    script = console_script(tmp_path / "bin")
    out = subprocess.run([sys.executable, str(script), "demo", *SMALL], cwd=tmp_path,
                         env=with_path(without(tmp_path / "broken", "_cffi_backend")),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1, out.stderr
    assert re.fullmatch(r"kvstate demo: error: exporter \d \(pid \d+\) exited with status 1 before it answered; "
                        r"last lines of its stderr: .*BackendUnavailable.*_cffi_backend.*", errors[0]), errors[0]
    assert "Traceback" not in out.stdout + out.stderr and "EOFError" not in out.stdout + out.stderr


@pytest.mark.parametrize("case", [None, "exporter:ready", "coordinator:importing", "worker:loading", "broken"])
def test_a_demo_run_leaves_nothing_on_the_node(tmp_path: Path, case: str | None) -> None:
    """With or without a SIGKILL, or failing at start, every folder, socket, owner mark and
    stderr log of the run is gone after it, and nothing its processes had in /dev/shm
    (attributed by pid: the victim's just before its SIGKILL, the others' before they exit)."""
    broken = case == "broken"
    env = with_path(without(tmp_path / "broken", "_cffi_backend")) if broken else with_path()
    kill = ["--kill", case] if case and not broken else []
    json_out = [] if broken else ["--json"]
    with tempfile.TemporaryDirectory(prefix="kvs-") as short:  # socket paths must stay under 108 bytes
        out = subprocess.run([*DEMO, *kill, *json_out], capture_output=True, text=True, timeout=120,
                             env={**env, "TMPDIR": short})
        assert out.returncode == (1 if broken else 0), out.stdout + out.stderr
        assert [p.name for p in Path(short).iterdir()] == []
    if not broken:
        report = json.loads(out.stdout)
        assert report["shm_left_at_exit"] == [] and report["shm_after_next_start"] == [], report
