"""A non-editable wheel carries the tables (as kvstate.tables) and py.typed."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_installed_wheel_loads_its_own_tables(tmp_path: Path) -> None:
    dist, site = tmp_path / "dist", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(ROOT)], check=True, capture_output=True)
    (wheel,) = dist.glob("kvstate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"kvstate/py.typed", "kvstate/tables/group.toml", "kvstate/tables/invariants.toml"} <= set(names)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    code = ("import kvstate, kvstate.core.spec as s; from importlib import resources;"
            "print(kvstate.__file__); print(resources.files('kvstate.tables'));"
            "print(sorted(s.load_spec().machines))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}).stdout.splitlines()
    assert out[0].startswith(str(site)) and out[1].startswith(str(site))
    assert out[2] == "['bank', 'coordinator', 'group', 'op', 'part', 'rank']"
