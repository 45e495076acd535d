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

# Every thread's stack to the engine's log on SIGUSR2: what a test samples when a wait
# in an engine runs long (which thread holds it up).
import faulthandler  # noqa: E402
import signal  # noqa: E402

faulthandler.register(signal.SIGUSR2, all_threads=True)
logging.getLogger("kvstate.channel.tcp").setLevel(logging.DEBUG)
