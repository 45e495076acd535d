"""Imported at start-up by every engine process (tests/vllm is on their PYTHONPATH, not on
pytest's): kvstate's log records at INFO go to the engine's log, which vLLM's logging
setup would otherwise drop, so that a failed engine test shows what the connector did."""

import logging
import os
import sys

_handler = logging.StreamHandler(sys.stderr)
_handler.setFormatter(logging.Formatter(f"(kvstate pid={os.getpid()}) %(asctime)s %(levelname)s %(name)s: %(message)s"))
_log = logging.getLogger("kvstate")
_log.setLevel(logging.INFO)
_log.addHandler(_handler)
_log.propagate = False

# KVSTATE_TRACE_DIR=<dir>: diagnosis of slow hand-offs (issue 28). kvstate logs at DEBUG
# (the t=<monotonic> lines of a load's every hand-off), and faulthandler's own C thread,
# which needs no GIL, dumps every thread's stack to <dir>/stacks-<pid>.txt each
# KVSTATE_TRACE_EVERY_S seconds: where each thread stands while one waits.
_trace = os.environ.get("KVSTATE_TRACE_DIR")
if _trace:
    import faulthandler

    _log.setLevel(logging.DEBUG)
    os.makedirs(_trace, exist_ok=True)
    _stacks = open(os.path.join(_trace, f"stacks-{os.getpid()}.txt"), "w")  # open for the process's life
    faulthandler.dump_traceback_later(float(os.environ.get("KVSTATE_TRACE_EVERY_S", "1.0")), repeat=True,
                                      file=_stacks)
