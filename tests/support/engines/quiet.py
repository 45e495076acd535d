"""Wait until engines stop burning CPU, before a timed request.

Why: after its last message, each of vLLM's processes (EngineCore and every worker)
busy-polls its shared-memory queue for one more second (``busy_loop_s`` of
``SpinCondition`` in vllm/distributed/device_communicators/shm_broadcast.py, a
``sched_yield`` loop). On this 2-core machine the decode engine that has just produced a
prompt spins that second on the cores the prefill engine needs: the prefill worker (its
ZMQ thread too) sat runnable and unscheduled ~0.95 s before it read the load order
(issue 30; docs/benchmarks.md, "vLLM: across network namespaces"). On two real hosts that spin
would be on the other host; on one machine the bench waits it out, for every row alike.

Quiet means: the engines' processes together used less than ``share`` of one core over a
``window_s`` window (utime + stime from /proc, all threads).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

WINDOW_S = 0.5
SHARE = 0.1
LIMIT_S = 10.0
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU time (user + system, every thread) the processes used so far; gone ones count 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / _TICK


def settle(pids: Callable[[], Iterable[int]], *, window_s: float = WINDOW_S, share: float = SHARE,
           limit_s: float = LIMIT_S) -> bool:
    """Return once the processes ``pids()`` names were quiet for one window: True, or
    False if they were still busy after ``limit_s`` (the caller goes on regardless)."""
    deadline = time.monotonic() + limit_s
    while True:
        watched = list(pids())
        before = cpu_seconds(watched)
        time.sleep(window_s)
        if cpu_seconds(watched) - before < share * window_s:
            return True
        if time.monotonic() > deadline:
            return False
