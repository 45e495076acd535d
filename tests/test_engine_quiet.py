"""The TTFT bench's wait for quiet engines (tests/support/engines/quiet.py, issue 30).

A timed request used to start while the engine that had just produced the prompt still
spun vLLM's one-second busy loop on the shared cores. ``settle`` must not return while a
watched process burns CPU, and must return once it stops: checked on a real process that
spins until told to stop, by the order of events (the stop mark is written before the
process goes idle), never by a duration.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from support.engines import quiet

#: A spinning process gets far more than 2% of a core even on this loaded machine.
SHARE = 0.02

SPINNER = """
import os, sys, time
stop, stopped = sys.argv[1], sys.argv[2]
while not os.path.exists(stop):
    for _ in range(200000):
        pass
open(stopped, "w").close()
time.sleep(600)
"""


def _burn(pid: int, seconds: float) -> None:
    """Wait (sleeping) until ``pid`` used ``seconds`` more CPU."""
    start = quiet.cpu_seconds([pid])
    while quiet.cpu_seconds([pid]) - start < seconds:
        time.sleep(0.02)


def _spinner(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
    stop, stopped = tmp_path / "stop", tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-c", SPINNER, str(stop), str(stopped)])
    return proc, stop, stopped


def test_settle_waits_for_a_spinning_process_to_stop(tmp_path: Path) -> None:
    proc, stop, stopped = _spinner(tmp_path)
    returned: list[bool] = []
    seen_stopped: list[bool] = []
    try:
        _burn(proc.pid, 0.2)  # it spins
        waiter = threading.Thread(target=lambda: (
            returned.append(quiet.settle(lambda: [proc.pid], share=SHARE, limit_s=120)),
            seen_stopped.append(stopped.exists())))
        waiter.start()
        _burn(proc.pid, 2 * quiet.WINDOW_S)  # more than one window's worth while settle watches
        assert not returned, "settle returned while the process was spinning"
        stop.touch()
        waiter.join(180)
        assert returned == [True]
        assert seen_stopped == [True], "settle returned before the process stopped spinning"
    finally:
        stop.touch()
        proc.kill()
        proc.wait()


def test_settle_gives_up_on_a_process_that_never_stops(tmp_path: Path) -> None:
    proc, stop, _ = _spinner(tmp_path)
    try:
        _burn(proc.pid, 0.1)
        assert quiet.settle(lambda: [proc.pid], share=SHARE, limit_s=0.0) is False
    finally:
        stop.touch()
        proc.kill()
        proc.wait()


def test_gone_processes_count_as_quiet() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert quiet.cpu_seconds([proc.pid]) == 0.0
    assert quiet.settle(lambda: [proc.pid], window_s=0.01) is True
