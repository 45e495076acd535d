"""The thread switch interval of an engine process that runs kvstate's threads.

Why it was set: loads timed out in the vLLM suite, and the guess was that kvstate's
threads waited for the GIL of vLLM's busy-polling worker (up to the interval for every
blocking call). Measured since (issue 28, item 6), the loads that timed out waited for
CPU, not for the GIL: kvstate's threads inherited the core vLLM binds the worker to, and
another engine's worker spinning on ``os.sched_yield`` on that core kept them from running
for 10 s (:mod:`.affinity` frees them). With them free, Python's 5 ms interval and no
sleep per step, the failing files passed (leases 0.2-7 ms); the whole suite without both
workarounds passed once and failed twice in 3 runs, each time in its tp=2 file (a decode
rank left a lease request unanswered until its phase timed out; connector's
``YIELD_S``). The interval alone was not tried without the sleep, so both stay.
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
