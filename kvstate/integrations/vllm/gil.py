"""The thread switch interval of an engine process that runs kvstate's threads.

Why: vLLM's EngineCore and workers busy-poll their message queues with
``os.sched_yield``, which drops the GIL and takes it straight back. A kvstate thread in
the same process (the coordinator in the EngineCore; leases, imports and store
completions in a worker) then gets the GIL only when its wait outlasts the switch
interval (Python's default 5 ms) and it forces a hand-over, once for every blocking call
it makes. Measured with tests/vllm/test_vllm_kvstate_tp2.py (two tp=2 float32 engines on
2 cores): its 6 loads took 64.9 s in all (``load_ms``) at 5 ms, and 52 ms at 0.5 ms.
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
