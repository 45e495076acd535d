"""The leak check itself catches a planted leak: an fd left open, a memfd left mapped."""

from __future__ import annotations

import mmap
import os

from native.helpers import leaks, snapshot


def test_leak_check_catches_an_open_fd() -> None:
    before = snapshot()
    r, w = os.pipe()
    try:
        found = leaks(before)
        assert any(f"fd {r} " in f for f in found) and any(f"fd {w} " in f for f in found)
    finally:
        os.close(r)
        os.close(w)
    assert leaks(before) == []


def test_leak_check_catches_a_memfd_mapping() -> None:
    before = snapshot()
    fd = os.memfd_create("kvstate-leak", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    os.close(fd)
    try:
        assert any("memfd:kvstate-leak" in f for f in leaks(before))
    finally:
        m.close()
    assert leaks(before) == []
