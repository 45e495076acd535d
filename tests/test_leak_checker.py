"""The leak check catches each kind of leak it claims to (planted leaks), stays quiet when
everything is given back, and is wired to every native and multiproc test."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvstate.harness.leaks import leaks, settled_leaks, snapshot

TESTS = Path(__file__).resolve().parent


def test_clean_code_reports_nothing() -> None:
    before = snapshot()
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    assert settled_leaks(before, grace_s=0.5) == []


def test_catches_an_open_fd_by_number() -> None:
    before = snapshot()
    r, w = os.pipe()
    try:
        found = leaks(before, snapshot())
        assert any(f"fd {r} " in f for f in found) and any(f"fd {w} " in f for f in found), found
    finally:
        os.close(r)
        os.close(w)
    assert leaks(before, snapshot()) == []


def test_catches_a_leaked_fd_and_memfd_mapping() -> None:
    before = snapshot()
    fd = os.memfd_create("planted-leak")
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    try:
        found = settled_leaks(before, grace_s=0.2)
        assert any("/memfd:planted-leak" in line and line.startswith("fd ") for line in found), found
        assert any(line.startswith("memfd mapping") for line in found), found
    finally:
        m.close()
        os.close(fd)
    assert settled_leaks(before, grace_s=0.5) == []


def test_catches_a_memfd_mapping_whose_fd_is_closed() -> None:
    before = snapshot()
    fd = os.memfd_create("kvstate-leak", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    os.close(fd)
    try:
        assert any(line.startswith("memfd mapping") and "memfd:kvstate-leak" in line
                   for line in leaks(before, snapshot()))
    finally:
        m.close()
    assert leaks(before, snapshot()) == []


def test_catches_a_mapping_replaced_by_another() -> None:
    """One memfd unmapped and another mapped: the count is unchanged, the leak is not."""
    fds, maps = [], []
    for name in ("planted-old", "planted-new"):
        fds.append(os.memfd_create(name, os.MFD_CLOEXEC))
        os.ftruncate(fds[-1], 4096)
    maps.append(mmap.mmap(fds[0], 4096))
    before = snapshot()
    maps[0].close()
    maps.append(mmap.mmap(fds[1], 4096))
    try:
        after = snapshot()
        assert len(after.memfd_maps) == len(before.memfd_maps)
        assert any("memfd:planted-new" in line for line in leaks(before, after))
    finally:
        maps[1].close()
        for fd in fds:
            os.close(fd)


def test_catches_a_leaked_thread() -> None:
    stop = threading.Event()
    before = snapshot()
    t = threading.Thread(target=stop.wait, name="planted-leak", daemon=True)
    t.start()
    try:
        assert any("planted-leak" in line for line in settled_leaks(before, grace_s=0.2))
    finally:
        stop.set()
        t.join()
    assert settled_leaks(before, grace_s=0.5) == []


@pytest.mark.native
@pytest.mark.multiproc
def test_catches_a_leaked_child_process() -> None:
    before = snapshot()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        found = settled_leaks(before, grace_s=0.2)
        assert f"child process {child.pid}" in found, found
    finally:
        child.kill()
        child.wait()
    assert settled_leaks(before, grace_s=0.5) == []


def test_catches_a_leaked_native_allocation() -> None:
    from kvstate.transport.host import HostTransport

    t = HostTransport(granularity=64 * 1024)
    t.native.stats()  # load the library before the snapshot
    before = snapshot()
    allocation = t.create(64 * 1024)
    try:
        assert any(line.startswith("native allocations") for line in settled_leaks(before, grace_s=0.2))
    finally:
        t.release(allocation)
    assert settled_leaks(before, grace_s=0.5) == []


@pytest.mark.multiproc
@pytest.mark.slow  # a child pytest: make test runs it, the edit loop need not
def test_the_fixture_fails_exactly_the_checked_tests_that_leak() -> None:
    """tests/planted/leaky_tests.py in a child pytest: the native and multiproc tests that
    leak fail, naming what leaked; a clean one, a unit one and an opted-out one do not."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(TESTS / "planted" / "leaky_tests.py"), "-q", "-rA",
         "-p", "no:cacheprovider", "-p", "no:randomly"],
        capture_output=True, text=True, timeout=120, cwd=TESTS.parent,
        env={**os.environ, "KVSTATE_LEAK_GRACE_S": "0.2"})
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    def outcome(word: str) -> set[str]:
        return {line.split("::")[1].split()[0] for line in out.splitlines() if line.startswith(word + " ")}

    # the check runs in teardown, so a leak is reported as an error of the test
    assert outcome("ERROR") == {"test_native_leaks_an_fd", "test_multiproc_leaks_a_thread"}, out
    assert outcome("PASSED") == {"test_native_leaks_an_fd", "test_multiproc_leaks_a_thread",
                                 "test_native_gives_everything_back", "test_unit_is_not_checked",
                                 "test_opted_out_is_not_checked"}, out
    assert "leaked: fd " in out and "planted-leak-thread" in out, out
