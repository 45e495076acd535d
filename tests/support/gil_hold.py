"""A process holding its GIL: one C call, ``read()`` on a pipe, made through
``ctypes.PyDLL`` (which keeps the GIL for the whole call), until another process writes
its word. A Python ticker thread counts while the GIL is free, so the count before and
after the hold says whether any Python of this process ran during it. The GIL-hostile
tests (tests/support/gil_hostile.py, index_gil_hostile.py) hold so while other processes
need this one's services: if a service needed this process's Python, they would time out
instead of writing their word."""

from __future__ import annotations

import ctypes
import json
import sys
import threading


def say(**what: object) -> None:
    print(json.dumps(what), flush=True)


def hold_gil(pipe_r: int, **holding: object) -> tuple[str, int]:
    """Says ``event="holding"`` with ``holding``, then holds the GIL until the pipe's word
    arrives: returns the word and the ticks counted during the hold."""
    ticks = [0]
    stop = threading.Event()

    def ticker() -> None:  # runs only while this process's GIL is free
        while not stop.wait(0.0005):
            ticks[0] += 1

    threading.Thread(target=ticker, daemon=True).start()
    while ticks[0] < 3:  # the ticker runs before the hold
        stop.wait(0.001)
    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held for the whole call
    libc.read.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    libc.read.restype = ctypes.c_ssize_t
    buf = ctypes.create_string_buffer(256)
    say(event="holding", **holding)
    # A long switch interval keeps the edges of the call nearly free of GIL switches; a
    # switch the ticker had already asked for can still land there (one tick each side).
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    before = ticks[0]
    n = libc.read(pipe_r, buf, 255)  # returns once the other process wrote its word
    during = ticks[0] - before
    sys.setswitchinterval(interval)
    stop.set()
    return buf.raw[:max(n, 0)].decode(errors="replace"), during
