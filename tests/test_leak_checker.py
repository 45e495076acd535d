"""The leak checker catches each kind of leak it claims to (planted leaks), and stays quiet
when everything is given back."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading

from support.leaks import settled_leaks, snapshot


def test_clean_code_reports_nothing() -> None:
    before = snapshot()
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    assert settled_leaks(before, grace_s=0.5) == []


def test_catches_a_leaked_fd_and_memfd_mapping() -> None:
    before = snapshot()
    fd = os.memfd_create("planted-leak")
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    try:
        found = settled_leaks(before, grace_s=0.2)
        assert any("/memfd:planted-leak" in line for line in found), found
        assert any("memfd mapping" in line for line in found), found
    finally:
        m.close()
        os.close(fd)
    assert settled_leaks(before, grace_s=0.5) == []


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
