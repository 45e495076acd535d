"""The summary picture (benchmarks/summary.py) built from a small fixed set of result rows:
no benchmark runs. Its bars are the comparisons of the JSON the tables are printed from,
each with its goal from the suite, and a suite without rows is said to be absent."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import b5_vllm, report, suites, summary
from benchmarks.framework import Figure, Row, SuiteResult

WHEN = dt.datetime(2026, 12, 4, 12, 0, tzinfo=dt.timezone.utc)


def _result(suite: Any, medians: dict[str, float]) -> SuiteResult:
    """The suite's rows with fixed figures (seconds); a case left out is skipped."""
    rows = tuple(Row(suite.key, c.name, c.kvstate, Figure((medians[c.name],)) if c.name in medians else None,
                     None if c.name in medians else "peer not installed", reference=c.reference)
                 for c in suite.cases)
    return SuiteResult(suite, rows)


def _b1_b4_doc() -> dict[str, Any]:
    b1 = suites.b1_suite(quick=True, repeats=1)  # tp 1 and 8
    times = {}
    for tp, scale in ((1, 1.0), (8, 2.0)):
        n = suites.b1_rows(tp)
        times.update({n["group"]: 400e-6 * scale, n["nixl"]: 100e-6 * scale, n["shm"]: 200e-6 * scale,
                      n["rank"]: 150e-6, n["floor_rank"]: 100e-6, n["floor_group"]: 60e-6,
                      n["bound_group"]: 150e-6, n["bound_rank"]: 120e-6})
    b4 = next(s for s in suites.suites(quick=True, repeats=1) if s.key == "B4")
    b4_times = {suites.B4_LOAD: 20e-3, suites.B4_MEMCPY: 25e-3, "numpy fancy assignment": 40e-3,
                "NIXL READ (UCX same-node defaults)": 200e-3, "torch index_copy_": 10e-3}  # torch index_put_: skipped
    doc = report.rows_json([_result(b1, times), _result(b4, b4_times)], when=WHEN, command="kvstate bench")
    return json.loads(json.dumps(doc))  # as read back from bench.json


def _vllm_doc() -> dict[str, Any]:
    rows = [SimpleNamespace(length=512, reuse_s=[0.06, 0.07], recompute_s=[0.05, 0.05], example_s=[0.2]),
            SimpleNamespace(length=4096, reuse_s=[0.08], recompute_s=[1.0, 1.2], example_s=[])]
    doc = report.rows_json([b5_vllm.result(rows, repeats=2)], when=WHEN, command=b5_vllm.COMMAND)
    return json.loads(json.dumps(doc))


def _by_title(panes: list[summary.Panel]) -> dict[str, summary.Panel]:
    return {p.title: p for p in panes}


def test_b1_and_b4_bars_are_the_runs_comparisons_with_their_goals() -> None:
    panes = _by_title(summary.panels(_b1_b4_doc(), None))
    nixl = panes["B1 whole-group import / NIXL (register + metadata load)"]
    assert [(b.label, b.goal) for b in nixl.bars] == [("tp=1", None), ("tp=8", 1.0)]
    assert [b.times for b in nixl.bars] == pytest.approx([4.0, 4.0]) and nixl.bars[1].met is False
    shm = panes["B1 whole-group import / shared_memory attach"]
    assert [(b.label, b.goal, b.met) for b in shm.bars] == [("tp=1", None, None), ("tp=8", 3.0, True)]
    assert [b.times for b in shm.bars] == pytest.approx([2.0, 2.0])
    rank = panes["B1 per-rank import / raw floor (SCM_RIGHTS + mmap)"]
    assert [(b.goal, b.met) for b in rank.bars] == [(2.0, True)] * 2
    assert [b.times for b in rank.bars] == pytest.approx([1.5, 1.5])
    b4 = panes["B4 Group.load (paged scatter) / memcpy limit and each peer"].bars
    assert [b.label for b in b4] == [suites.B4_MEMCPY, *suites.B4_PEERS]
    assert [b.goal for b in b4] == [pytest.approx(1 / 0.9), 1.0, 1.0, 1.0, 1.0]
    assert [b.times for b in b4[:4]] == pytest.approx([0.8, 0.5, 0.1, 2.0])
    assert [b.met for b in b4[:4]] == [True, True, True, False]
    assert b4[4].times is None and b4[4].why == "peer not installed"  # a skipped peer: no number


def test_vllm_bars_per_prompt_length_and_absent_suites_are_said() -> None:
    panes = _by_title(summary.panels(_b1_b4_doc(), _vllm_doc()))
    recompute = panes["vLLM TTFT: kvstate reuse / recompute"].bars
    assert [(b.label, b.goal) for b in recompute] == [("512 tokens", 1.0), ("4096 tokens", 1.0)]
    assert recompute[0].times == pytest.approx(0.065 / 0.05) and recompute[0].met is False
    assert recompute[1].times == pytest.approx(0.08 / 1.1) and recompute[1].met is True
    example = panes["vLLM TTFT: kvstate reuse / ExampleConnector (disk)"].bars
    assert example[0].times == pytest.approx(0.065 / 0.2) and (example[1].times, example[1].why) == (None,
                                                                                                     "not measured")
    # Without the vLLM file, its panels say so; with only a vLLM run, B1's and B4's do.
    absent = summary.panels(_b1_b4_doc(), None)
    assert [p.absent for p in absent[4:]] == ["no vLLM TTFT rows: no result file (run make bench-vllm)"] * 2
    only_vllm = summary.panels(None, _vllm_doc())
    assert all(p.absent and "no result file" in p.absent and not p.bars for p in only_vllm[:4])
    b3_only = report.rows_json([_result(next(s for s in suites.suites(quick=True) if s.key == "B3"), {})],
                               when=WHEN, command="kvstate bench --suite B3")
    assert summary.panels(b3_only, None)[3].absent == (
        "no B4 rows in the run of 2026-12-04T12:00 UTC (`kvstate bench --suite B3`): run kvstate bench --suite B4")


def test_the_figure_draws_a_goal_line_per_ratio_and_notes_absent_suites(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed")
    import matplotlib
    matplotlib.use("Agg")
    bench = _b1_b4_doc()
    panes = summary.panels(bench, None)
    fig = summary.figure(panes, [bench])
    axes = fig.get_axes()
    assert len(axes) == len(panes) == 6
    for ax, pane in zip(axes, panes):
        goals = [line.get_ydata()[0] for line in ax.get_lines() if line.get_gid() == "goal"]
        assert goals == [b.goal for b in pane.bars if b.goal is not None]
        texts = [t.get_text() for t in ax.texts]
        for b in pane.bars:  # the measured value is written on its bar
            assert b.times is None or summary._value(b.times).split("\n")[0] in [t.split("\n")[0] for t in texts]
        if pane.absent:
            assert [t.get_gid() for t in ax.texts] == ["absent"] and "make bench-vllm" in texts[0].replace("\n", " ")
    # B1 against NIXL: the suite sets a goal at tp=8 only, so one line, at 1x.
    assert [line.get_ydata()[0] for line in axes[0].get_lines() if line.get_gid() == "goal"] == [1.0]
    png = tmp_path / "summary.png"
    assert summary.write(bench, _vllm_doc(), png) is None
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_the_readme_shows_the_committed_picture_of_real_runs() -> None:
    """docs/img/bench-summary.png (`make bench-summary`) is small, opens the README's Benchmarks
    section, and its result files hold every panel's rows, with the caption naming their runs."""
    root = Path(__file__).resolve().parents[1]
    png = (root / "docs/img/bench-summary.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) < 150_000
    section = (root / "README.md").read_text(encoding="utf-8").split("\n## Benchmarks (`kvstate bench`)\n", 1)[1]
    assert section.lstrip().startswith("![") and "(docs/img/bench-summary.png)" in section.split("\n\n", 2)[0]
    caption = " ".join(section.split("\n\n", 2)[1].split())
    bench = summary.load(root / "docs/img/bench-summary.json")
    vllm = summary.load(root / "docs/img/bench-summary-vllm.json")
    assert bench is not None and vllm is not None
    assert all(p.absent is None and p.bars for p in summary.panels(bench, vllm))
    for doc in (bench, vllm):
        assert f"`{doc['command']}`" in caption and doc["when"][:10] in caption and "load average" in doc["machine"]


def test_the_engine_cost_rows_compare_decode_per_token_with_the_97_percent_goal() -> None:
    """Issue 28's engine cost: kvstate's decode tokens/s at least 97% of a plain engine's,
    as seconds per token (kvstate's at most 1/0.97 of the plain engine's), per model; a
    model not measured is a row without a number."""
    rows = [SimpleNamespace(length=512, reuse_s=[0.06], recompute_s=[0.05], example_s=[])]
    cost = SimpleNamespace(kvstate_s=[0.0102, 0.0100, 0.0101], plain_s=[0.0100, 0.0099])
    res = b5_vllm.result(rows, repeats=3, costs={"small": cost})
    by_name = {r.name: r for r in res.rows}
    kv_name, plain_name = b5_vllm.cost_rows("small")
    kv, plain = by_name[kv_name], by_name[plain_name]
    assert kv.kvstate and not plain.kvstate and kv.reference == plain_name
    assert kv.figure is not None and kv.figure.samples == (0.0102, 0.0100, 0.0101)
    (goal,) = [c for c in res.suite.comparisons if c.numerator == kv_name]
    assert goal.denominator == plain_name and goal.goal == pytest.approx(1 / 0.97)
    tiny = by_name[b5_vllm.cost_rows("tiny")[0]]
    assert tiny.figure is None and tiny.skipped == "not measured"  # measured for one model only
    assert len({b5_vllm.cost_rows(m) for m in b5_vllm.COST_MODELS}) == len(b5_vllm.COST_MODELS)
    from support.engines import decode_cost
    assert tuple(b5_vllm.COST_MODELS) == decode_cost.MODELS  # a row, named, for every model the bench runs
    missing = {r.name: r for r in b5_vllm.result(rows, repeats=3).rows}
    assert missing[kv_name].figure is None and missing[kv_name].skipped == "not measured"
    assert b5_vllm.lengths(report.rows_json([res], when=WHEN, command=b5_vllm.COMMAND)) == [512]
