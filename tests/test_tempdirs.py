"""The session's temp root and the check that no test leaves kvs* folders in the system
temp dir (tests/support/tempdirs.py, wired in tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from support.tempdirs import EscapeWatch, TempRoot


def test_scratch_folders_land_in_the_sessions_root_in_this_process_and_its_children(temp_root: Path) -> None:
    d = Path(tempfile.mkdtemp(prefix="kvs-life-"))
    assert d.parent == temp_root and temp_root.name.startswith("kvt-")
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp(prefix='kvs-c-'))"],
                           capture_output=True, text=True, check=True)
    assert Path(child.stdout.strip()).parent == temp_root
    # short enough that socket paths which fit under /tmp still fit sun_path (108 bytes)
    assert len(str(temp_root)) <= len(str(temp_root.parent)) + len("/kvt-XXXXXXXX")


def test_the_root_goes_with_everything_in_it(tmp_path: Path) -> None:
    saved = tempfile.tempdir
    root = TempRoot(tmp_path)
    try:
        assert tempfile.gettempdir() == str(root.path) and os.environ["TMPDIR"] == str(root.path)
        (Path(tempfile.mkdtemp(prefix="kvs-dp-")) / "sock").mkdir()
    finally:
        root.close()
    assert not root.path.exists() and tempfile.tempdir == saved


def test_the_watch_reports_a_kvs_folder_left_in_the_system_temp_dir_and_who_made_it(tmp_path: Path) -> None:
    system = tmp_path / "tmp"
    system.mkdir()
    watch = EscapeWatch(system, lambda: "tests/x.py::test_leaky")
    try:
        left = Path(tempfile.mkdtemp(prefix="kvs-fuzz-", dir=system))
        gone = Path(tempfile.mkdtemp(prefix="kvs-coord-", dir=system))
        (system / "other").mkdir()                     # not ours by name
        (left / "kvs-inner").mkdir()                   # not directly in the system dir
        os.mkdir(os.fsencode(system / "kvstate-soak-b"))  # bytes paths too
        gone.rmdir()
    finally:
        watch.stop()
    assert watch.left() == [f"{left} (made by tests/x.py::test_leaky)",
                            f"{system / 'kvstate-soak-b'} (made by tests/x.py::test_leaky)"]
    Path(tempfile.mkdtemp(prefix="kvs-after-", dir=system))  # disarmed: not recorded
    assert len(watch.left()) == 2
