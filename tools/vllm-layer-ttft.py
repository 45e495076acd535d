"""TTFT of kvstate reuse with asynchronous loads against per-layer loads (``layer_loads``),
at 1,024 and 4,096 prompt tokens: a decode engine and two prefill engines on the tiny Llama
with seeded weights, 2 layers deep or ``layers``. Run with the vLLM venv:
``PYTHONPATH=tests .venv-vllm/bin/python tools/vllm-layer-ttft.py [repeats [layers]]``."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from support.engines import ttft


def main() -> int:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvstate-layer-ttft-") as d:
        rows = ttft.measure_layers(Path(d), repeats=repeats, layers=layers,
                                   progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(ttft.layers_table(rows))
    print(f"\n(tiny {layers}-layer Llama on CPU, bf16, block 32, median of {repeats}; "
          f"{time.monotonic() - t0:.0f} s in all)")
    return 0 if all(r.identical and not r.failed_loads for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
