"""Planted leaks for the leak check's own test (tests/test_leak_checker.py runs this file
in a child pytest; it is not collected by the normal run: its name is not test_*.py).

The check must fail exactly the native and multiproc tests that leave something behind,
and leave unit tests and ``no_leakcheck`` tests alone.
"""

from __future__ import annotations

import os
import threading

import pytest

_kept: list[object] = []


@pytest.mark.native
def test_native_leaks_an_fd() -> None:
    _kept.append(os.pipe())


@pytest.mark.multiproc
def test_multiproc_leaks_a_thread() -> None:
    stop = threading.Event()
    _kept.append(stop)
    threading.Thread(target=stop.wait, name="planted-leak-thread", daemon=True).start()


@pytest.mark.native
def test_native_gives_everything_back() -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)


@pytest.mark.unit
def test_unit_is_not_checked() -> None:
    _kept.append(os.pipe())


@pytest.mark.native
@pytest.mark.no_leakcheck
def test_opted_out_is_not_checked() -> None:
    _kept.append(os.pipe())
