"""The thread switch interval of an engine process that runs kvstate's threads
(``gil_switch_interval_s``; unset by default, Python's 5 ms stays).

Why it exists (issue 28): loads timed out in the vLLM suite, and the guess was that
kvstate's threads waited for the GIL of vLLM's busy-polling worker. The default was 0.5 ms,
beside a 1 ms sleep per worker step while kvstate had work. Measured since, the loads
waited for CPU, not for the GIL: first kvstate's threads, confined to the worker's core
(:mod:`.affinity` frees them); then the workers of an engine whose loads waited, spinning
through idle steps (the connector's ``get_finished`` now waits off the CPU on those). With
both fixed, the vLLM suite passes with Python's interval, no sleep and the default load
timeout (docs/benchmarks.md, "the suite without the sleep per step"). The setting stays for an engine
whose own threads hold the GIL long; it only lowers the interval.
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
