"""Waiting for something another thread or process does: the tests' one polling loop."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped.

    ``kill`` returns before that: the kernel wakes one thread to begin the group stop,
    and until that thread gets a CPU the others run on. Measured (issue 28, run M): a
    decode worker's native lease server granted a lease 11 ms after the SIGSTOP, on a
    2-core machine busy with engines. A test that means "this process cannot answer"
    waits here first."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue  # a thread that exited meanwhile
        return all(s in ("T", "t") for s in states)  # t: stopped under a tracer

    if not wait_until(stopped, timeout):
        raise AssertionError(f"process {pid} did not stop within {timeout} s")
