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
