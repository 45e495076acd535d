"""``make demo-vllm``: kvstate's connector between two live vLLM engines, per prompt length.

Starts a decode engine (``kv_producer``), a prefill engine (``kv_consumer``, reuse on) and
a recompute engine (reuse off), all on a tiny Llama with seeded weights written here, and
prints one row per prompt length: TTFT with reuse and with recompute (median of 3), the
prompt tokens the prefill engine computed and reused, and whether 16 greedy tokens are
identical. Run with the vLLM venv (``make demo-vllm`` builds it).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from support.engines import ttft


def main() -> int:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvstate-demo-vllm-") as d:
        rows = ttft.measure(Path(d), example=False, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(ttft.demo_table(rows))
    print(f"\n(tiny 2-layer Llama on CPU, bf16, block 32; TTFT = generate(max_tokens=1) after a prefix-cache reset;"
          f" {time.monotonic() - t0:.0f} s in all)")
    return 0 if all(r.identical and r.reused > 0 and not r.failed_loads for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
