"""The thread switch interval of an engine process that runs kvstate's threads
(``gil_switch_interval_s``): off by default, and no longer needed.

It was lowered to 0.5 ms, with a 1 ms sleep per worker step, because loads timed out in
the vLLM suite; the guess was that kvstate's threads waited for the GIL of vLLM's
busy-polling worker. Measured (issue 28, item 6), that was not the cause: the threads
kvstate started from a worker's hooks inherited the core vLLM binds the worker to, and
another worker spinning on ``os.sched_yield`` on that core kept them from running at all
(:mod:`.affinity`). With them free to use every CPU, and Python's 5 ms interval, the
vLLM suite's leases took 0.2-7 ms and its loads ended 30-40 ms after their order. The
setting stays so that configs that set it still parse, and still lowers the interval.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger(__name__)


def share_the_gil(interval_s: float | None) -> bool:
    """Lower this process's thread switch interval to ``interval_s``; never raise it, and
    leave it when ``interval_s`` is None. Returns whether it changed."""
    if interval_s is None or interval_s >= sys.getswitchinterval():
        return False
    sys.setswitchinterval(interval_s)
    log.info("kvstate: thread switch interval lowered to %s s (gil_switch_interval_s)", interval_s)
    return True
