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


def test_a_session_that_leaves_a_kvs_folder_in_the_system_temp_dir_fails_naming_the_test(temp_root: Path) -> None:
    """tests/planted/temp_folders.py in a child pytest, whose system temp dir is this
    session's root (it inherits TMPDIR): every test passes, yet the session fails, naming
    the one folder left there and the test that made it; the child's own root is gone."""
    tests = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-m", "pytest", str(tests / "planted" / "temp_folders.py"), "-q",
                           "-p", "no:cacheprovider"], capture_output=True, text=True, timeout=120, cwd=tests.parent)
    out = done.stdout
    assert done.returncode == 1 and "3 passed" in out, out + done.stderr
    left = [line.strip() for line in out.splitlines() if "(made by " in line]
    assert len(left) == 1 and left[0].endswith("(made by tests/planted/temp_folders.py::"
                                               "test_leaves_a_folder_in_the_system_temp_dir)"), out
    folder = Path(left[0].split(" (made by ")[0])
    assert folder.parent == temp_root and folder.is_dir()
    assert [p.name for p in temp_root.iterdir() if p.name.startswith("kvs-planted-")] == [folder.name]
    assert not [p for p in temp_root.iterdir() if p.name.startswith("kvt-")], "the child's root was not removed"
    folder.rmdir()
