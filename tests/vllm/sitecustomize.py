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
# (the t=<monotonic> lines of a load's every hand-off, with each thread's native id), and
# SIGRTMIN+3 makes faulthandler dump every thread's stack to <dir>/stacks-<pid>.txt from the
# signal handler, which needs no GIL: where each thread stands while a load waits.
_trace = os.environ.get("KVSTATE_TRACE_DIR")
if _trace:
    import faulthandler
    import signal
    import threading

    class _Tid(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.tid = threading.get_native_id()  # matches /proc/<pid>/task/<tid>
            return True

    _log.setLevel(logging.DEBUG)
    _handler.addFilter(_Tid())
    _handler.setFormatter(logging.Formatter(f"(kvstate pid={os.getpid()}) %(asctime)s tid=%(tid)s "
                                            "%(threadName)s %(levelname)s %(name)s: %(message)s"))
    os.makedirs(_trace, exist_ok=True)
    _stacks = open(os.path.join(_trace, f"stacks-{os.getpid()}.txt"), "w")  # open for the process's life
    faulthandler.register(signal.SIGRTMIN + 3, file=_stacks, all_threads=True)
