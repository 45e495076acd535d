"""The summary picture of a bench run, for people who look rather than read.

One panel per ratio: B1's whole-group import against NIXL and against ``shared_memory``,
and its per-rank import against the raw floor, per tp; B4's ``Group.load`` against the
memcpy limit and each peer; and vLLM's prefill TTFT with kvstate reuse against recompute
and against the ExampleConnector, per prompt length. Every bar is kvstate's time as a
multiple of the other row's (lower is better), with the measured value written on it and
its goal drawn as a dashed line labelled with the goal.

The figures are the ``comparisons`` of the JSON documents that ``kvstate bench`` writes
(``bench.json``; ``bench-vllm.json`` for the vLLM suite), the same results the tables are
printed from: this module computes no ratio and holds no goal of its own. A panel whose
suite has no rows says so in place of the bars.

    python -m benchmarks.summary [--bench benchmarks/out/bench.json]
                                 [--vllm benchmarks/out/bench-vllm.json] [-o PNG]
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import b5_vllm, suites
from benchmarks.report import pyplot

OUT = Path("benchmarks/out")


@dataclass(frozen=True)
class Bar:
    label: str  # its place along the panel's axis: "tp=8", a peer's name, "2048 tokens"
    times: float | None  # kvstate's time as a multiple of the other row's; None: not measured
    goal: float | None  # at most this many times; None: the suite sets no goal here
    why: str = ""  # why there is no figure

    @property
    def met(self) -> bool | None:
        return None if self.times is None or self.goal is None else self.times <= self.goal


@dataclass(frozen=True)
class Panel:
    title: str
    bars: tuple[Bar, ...]
    absent: str | None = None  # why the panel has no bars (its suite's rows are absent)


def _bars(doc: dict[str, Any], suite: str, wanted: list[tuple[str, str, str]]) -> tuple[Bar, ...]:
    """A bar for each (label, row, of) of ``wanted``, from the document's comparisons."""
    found = {(c["row"], c["of"]): c for c in doc["comparisons"] if c["suite"] == suite}
    rows = {r["name"]: r for r in doc["rows"] if r["suite"] == suite}
    bars = []
    for label, row, of in wanted:
        c = found.get((row, of))
        if c is not None and c["times"] is not None:
            bars.append(Bar(label, c["times"], c["goal"]))
            continue
        why = next((rows[n]["skipped"] for n in (row, of) if n in rows and rows[n]["skipped"]), None)
        bars.append(Bar(label, None, None if c is None else c["goal"], why or "not measured"))
    return tuple(bars)


def _has_rows(doc: dict[str, Any] | None, suite: str) -> bool:
    return doc is not None and any(r["suite"] == suite for r in doc["rows"])


def _absent(doc: dict[str, Any] | None, suite: str, how: str) -> str:
    if doc is None:
        return f"no {suite} rows: no result file (run {how})"
    return f"no {suite} rows in the run of {doc['when'][:16]} UTC (`{doc['command']}`): run {how}"


def panels(bench: dict[str, Any] | None, vllm: dict[str, Any] | None) -> list[Panel]:
    """The panels of the picture, from a ``bench.json`` and a ``bench-vllm.json`` document
    (None: that file does not exist)."""
    out: list[Panel] = []
    b1 = [
        ("B1 whole-group import / NIXL (register + metadata load)", "group", "nixl"),
        ("B1 whole-group import / shared_memory attach", "group", "shm"),
        ("B1 per-rank import / raw floor (SCM_RIGHTS + mmap)", "rank", "floor_rank"),
    ]
    if _has_rows(bench, "B1"):
        assert bench is not None
        names = {r["name"] for r in bench["rows"]}
        tps = [tp for tp in suites.IMPORT_TP if suites.b1_rows(tp)["group"] in names]
        for title, row, of in b1:
            wanted = [(f"tp={tp}", suites.b1_rows(tp)[row], suites.b1_rows(tp)[of]) for tp in tps]
            out.append(Panel(title, _bars(bench, "B1", wanted)))
    else:
        out += [Panel(title, (), _absent(bench, "B1", "kvstate bench --suite B1")) for title, _, _ in b1]
    title = "B4 Group.load (paged scatter) / memcpy limit and each peer"
    if _has_rows(bench, "B4"):
        assert bench is not None
        wanted = [(of, suites.B4_LOAD, of) for of in (suites.B4_MEMCPY, *suites.B4_PEERS)]
        out.append(Panel(title, _bars(bench, "B4", wanted)))
    else:
        out.append(Panel(title, (), _absent(bench, "B4", "kvstate bench --suite B4")))
    vl = [("vLLM TTFT: kvstate reuse / recompute", "recompute"),
          ("vLLM TTFT: kvstate reuse / ExampleConnector (disk)", "example")]
    if _has_rows(vllm, "vllm"):
        assert vllm is not None
        for title, of in vl:
            wanted = [(f"{n} tokens", b5_vllm.row_name("reuse", n), b5_vllm.row_name(of, n))
                      for n in b5_vllm.lengths(vllm)]
            out.append(Panel(title, _bars(vllm, "vllm", wanted)))
    else:
        out += [Panel(title, (), _absent(vllm, "vLLM TTFT", "make bench-vllm")) for title, _ in vl]
    return out


def _value(x: float) -> str:
    """The value written on a bar; below 1x also as a speed-up, which people read faster."""
    text = f"{x:.2g}x" if x < 10 else f"{x:.0f}x"
    if x >= 1:
        return text
    faster = 1 / x
    return text + (f"\n({faster:.3g}x faster)" if faster < 2 else f"\n({faster:.2g}x faster)")


def _draw(ax: Any, panel: Panel) -> None:
    ax.set_title("\n".join(textwrap.wrap(panel.title, 32 if len(panel.bars) < 4 else 80)), fontsize=9.5)
    if panel.absent is not None:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.text(0.5, 0.5, "\n".join(textwrap.wrap(panel.absent, 36)), ha="center", va="center", fontsize=9,
                color="tab:red", transform=ax.transAxes, gid="absent")
        return
    values = [b.times for b in panel.bars if b.times is not None] + [b.goal for b in panel.bars if b.goal]
    lo, hi = (min(values) / 3, max(values) * 4) if values else (0.1, 10.0)
    ticker = importlib.import_module("matplotlib.ticker")
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    colors = {True: "tab:green", False: "tab:red", None: "tab:gray"}
    for i, b in enumerate(panel.bars):
        if b.times is None:
            ax.text(i, lo * 1.2, "\n".join(textwrap.wrap(b.why, 14)[:3]), ha="center", va="bottom", fontsize=7,
                    color="tab:gray")
        else:
            ax.bar(i, b.times - lo, bottom=lo, width=0.6, color=colors[b.met])
            # Above the bar, unless the goal line sits just above it and the bar has room inside
            # (for the first line only: the bar is too narrow for the speed-up).
            crowded = b.goal is not None and b.times * 0.9 <= b.goal <= b.times * 3.2 and b.times / lo >= 3
            value = _value(b.times)
            ax.text(i, b.times / 1.06 if crowded else b.times * 1.06, value.split("\n")[0] if crowded else value,
                    ha="center", va="top" if crowded else "bottom", fontsize=8.5, fontweight="bold",
                    color="white" if crowded else "black")
        if b.goal is not None:
            ax.plot([i - 0.5, i + 0.5], [b.goal, b.goal], "--", color="black", lw=1.3, gid="goal")
            if i == 0 or panel.bars[i - 1].goal != b.goal:  # one label per run of equal goals
                ax.text(i - 0.48, b.goal * 1.04, f"goal ≤ {b.goal:.3g}x", ha="left", va="bottom", fontsize=7.5,
                        bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none",
                              "alpha": 0.8})
    ax.set_xticks(range(len(panel.bars)))
    long = max((len(b.label) for b in panel.bars), default=0) > 10
    ax.set_xticklabels(["\n".join(textwrap.wrap(b.label, 16)) for b in panel.bars], fontsize=8 if long else 9)
    ax.set_xlim(-0.6, len(panel.bars) - 0.4)
    ax.tick_params(axis="y", labelsize=8)


def _caption(docs: list[dict[str, Any]]) -> str:
    lines = [f"{d['when'][:16].replace('T', ' ')} UTC, `{d['command']}`: {d['machine']}" for d in docs]
    return "\n".join(textwrap.fill(line, 125) for line in lines)


def figure(panes: list[Panel], docs: list[dict[str, Any]]) -> Any:
    """The matplotlib figure of the panels (B1's three, then B4, then vLLM's two)."""
    plt = importlib.import_module("matplotlib.pyplot")
    fig = plt.figure(figsize=(10, 10))
    grid = fig.add_gridspec(3, 6, hspace=0.7, wspace=0.9, left=0.09, right=0.98, top=0.91, bottom=0.13)
    slots = [grid[0, 0:2], grid[0, 2:4], grid[0, 4:6], grid[1, :], grid[2, 0:3], grid[2, 3:6]]
    for i, (slot, panel) in enumerate(zip(slots, panes)):
        ax = fig.add_subplot(slot)
        _draw(ax, panel)
        if i in (0, 3, 4) and panel.absent is None:  # the first panel of each row
            ax.set_ylabel("kvstate time / other's\n(log; lower is better)", fontsize=8)
    fig.suptitle("kvstate against its peers: green meets the dashed goal, red misses it, grey has no goal",
                 fontsize=11)
    fig.text(0.01, 0.01, _caption(docs) or "no result files", fontsize=8, va="bottom", ha="left")
    return fig


def write(bench: dict[str, Any] | None, vllm: dict[str, Any] | None, path: Path) -> str | None:
    """Write the picture to ``path``; return why not when matplotlib is absent."""
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    fig = figure(panels(bench, vllm), [d for d in (bench, vllm) if d is not None])
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    # A palette of 128 colours keeps the README's copy small (a third of the RGBA size);
    # Pillow comes with matplotlib.
    image = importlib.import_module("PIL.Image").open(buffer)
    image.convert("RGB").quantize(colors=128).save(path, optimize=True)
    return None


def load(path: Path) -> dict[str, Any] | None:
    """A result document, or None when the file does not exist."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    doc: dict[str, Any] = json.loads(text)
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", type=Path, default=OUT / "bench.json", help="bench.json of a B1/B4 run")
    parser.add_argument("--vllm", type=Path, default=OUT / "bench-vllm.json", help="bench-vllm.json of a vLLM run")
    parser.add_argument("-o", "--out", type=Path, default=OUT / "summary.png", help="the PNG to write")
    args = parser.parse_args(argv)
    why = write(load(args.bench), load(args.vllm), args.out)
    if why is not None:
        print(f"summary skipped: {why}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
