"""Stalls explained: a process whose Python stops for too long leaves every thread's stack.

A :class:`Heartbeat` thread re-arms :func:`faulthandler.dump_traceback_later` every beat.
The watchdog that fires it is faulthandler's own C thread and needs no GIL, so when the
process's Python stops beating for ``limit_s`` (a C call holding the GIL, an interpreter
deadlock, a starved scheduler) the stack of every thread is written to the process's own
file, while the process is still stuck. :func:`collect` reads those files afterwards: the
soak and the churn test fail with them instead of with a bare timeout.
"""

from __future__ import annotations

import faulthandler
import os
import threading
from pathlib import Path
from typing import IO

BEAT_S = 0.1


class Heartbeat:
    """Beat until :meth:`stop`; a silence of ``limit_s`` dumps every thread to ``folder``."""

    def __init__(self, folder: Path, limit_s: float) -> None:
        self.limit_s = limit_s
        self._file: IO[str] = open(folder / f"stall-{os.getpid()}.txt", "w")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="kvstate-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            faulthandler.dump_traceback_later(self.limit_s, exit=False, file=self._file)
            self._stop.wait(BEAT_S)
        faulthandler.cancel_dump_traceback_later()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._file.close()


def collect(folder: Path) -> list[str]:
    """Every dump written under ``folder``: 'pid N: <stacks>' each; the files are removed."""
    found = []
    for path in sorted(folder.glob("stall-*.txt")):
        text = path.read_text(errors="replace").strip()
        path.unlink()
        if text:
            pid = path.stem.removeprefix("stall-")
            found.append(f"pid {pid}: Python stopped for a whole heartbeat limit; every thread:\n{text}")
    return found
