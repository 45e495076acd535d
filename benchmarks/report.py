"""Reports of a bench run: terminal table, Markdown table, JSON rows and PNG plot."""

from __future__ import annotations

import datetime as dt
import importlib
import os
import platform
from importlib import metadata
from pathlib import Path

from typing import Any

from benchmarks.framework import Comparison, Row, SuiteResult


def _time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    load = os.getloadavg()[0]
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, 1-min load average {load:.1f} at the end of the run, "
            f"Linux {platform.release()}, "
            f"Python {platform.python_version()}, numpy {_version('numpy')}, nixl-cu12 {_version('nixl-cu12')}, "
            f"torch {_version('torch')}")


def _cells(result: SuiteResult, row: Row) -> list[str]:
    if row.figure is None:
        return [row.name, "FAILED" if row.failed else "skipped", "", "", "", row.skipped or ""]
    f = row.figure
    ratio = result.ratio(row)
    return [row.name, _time(f.median), _time(f.best), f"{f.gbps:.2f}" if f.gbps is not None else "",
            f"{ratio:.3f}" if ratio is not None else "", f.note]


HEADER = ["row", "median", "best", "GB/s", "ratio", "note"]


def _reference_line(result: SuiteResult) -> str:
    ref, declared = result.reference()
    if ref is None:
        return "ratio: no row was measured"
    if any(r.reference is not None for r in result.rows):
        return (f"ratio = time of the row's reference (the floor at its tp; else '{ref.name}') / time of the row "
                "(higher is faster)")
    if declared:
        return f"ratio = time of '{ref.name}' / time of the row (higher is faster)"
    return (f"ratio = time of '{ref.name}' / time of the row; the declared reference "
            f"'{result.suite.reference}' was skipped, so the fastest measured row stands in")


def _comparison_cells(result: SuiteResult, c: Comparison) -> list[str]:
    x = result.multiple(c)
    if x is None:
        return [c.numerator, c.denominator, "-", "" if c.goal is None else f"<= {c.goal:.3g}", "not measured"]
    verdict = "" if c.goal is None else ("met" if x <= c.goal else "MISSED")
    return [c.numerator, c.denominator, f"{x:.2f}x", "" if c.goal is None else f"<= {c.goal:.3g}x", verdict]


COMPARISON_HEADER = ["row", "as a multiple of", "times", "goal", "verdict"]


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def terminal(results: list[SuiteResult]) -> str:
    out = []
    for res in results:
        out.append(f"\n{res.suite.key}: {res.suite.title}   (goal: {res.suite.goal})")
        out += _table([HEADER, *(_cells(res, r) for r in res.rows)])
        out.append("  " + _reference_line(res))
        if res.suite.comparisons:
            out.append("")
            out += _table([COMPARISON_HEADER, *(_comparison_cells(res, c) for c in res.suite.comparisons)])
    return "\n".join(out)


def rows_json(results: list[SuiteResult], *, when: dt.datetime, command: str) -> dict[str, Any]:
    """Every row of the run (suite, name, median, p10, p90, ratio; seconds) and every
    comparison, for comparing runs over time. A row that did not run has null figures."""
    rows: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []
    for res in results:
        for r in res.rows:
            f = r.figure
            rows.append({"suite": r.suite, "name": r.name, "kvstate": r.kvstate,
                         "median": None if f is None else f.median, "p10": None if f is None else f.p10,
                         "p90": None if f is None else f.p90, "ratio": res.ratio(r),
                         "reference": r.reference or (res.reference()[0] or r).name,
                         "samples": None if f is None else len(f.samples),
                         "skipped": r.skipped, "failed": r.failed})
        for c in res.suite.comparisons:
            x = res.multiple(c)
            comparisons.append({"suite": res.suite.key, "row": c.numerator, "of": c.denominator, "times": x,
                                "goal": c.goal, "met": None if x is None or c.goal is None else x <= c.goal})
    return {"when": when.isoformat(), "command": command, "machine": machine(), "rows": rows,
            "comparisons": comparisons}


def markdown(results: list[SuiteResult], *, when: dt.datetime, command: str) -> str:
    out = [f"Measured {when:%Y-%m-%d %H:%M} UTC with `{command}` on: {machine()}.", ""]
    for res in results:
        out += [f"**{res.suite.key}: {res.suite.title}** (goal: {res.suite.goal}; {_reference_line(res)})", "",
                "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(res, r)) + " |" for r in res.rows]
        out.append("")
        if res.suite.comparisons:
            out += ["| " + " | ".join(COMPARISON_HEADER) + " |", "|" + "---|" * len(COMPARISON_HEADER)]
            out += ["| " + " | ".join(_comparison_cells(res, c)) + " |" for c in res.suite.comparisons]
            out.append("")
    return "\n".join(out)


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend, or why not (a str) when matplotlib is
    not installed (the bench extra); any other import error propagates."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        return "matplotlib is not installed (pip install -e '.[bench]')"
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def plot(results: list[SuiteResult], path: Path) -> str | None:
    """Write a PNG of the run; return why not when matplotlib is absent."""
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.2 + 3.0 * len(results)), squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        names = [r.name for r in res.rows]
        values = [r.figure.median if r.figure else 0.0 for r in res.rows]
        colors = ["tab:green" if r.kvstate else "tab:blue" for r in res.rows]
        ax.barh(names, values, color=colors)
        ax.invert_yaxis()
        measured = [v for v in values if v]
        if measured:  # log scale, from a third of the fastest row, with room for the labels
            ax.set_xscale("log")
            ax.set_xlim(min(measured) / 3, max(measured) * 30)
        for i, r in enumerate(res.rows):
            ratio = res.ratio(r)
            label = "skipped: " + (r.skipped or "") if r.figure is None else \
                f"{_time(r.figure.median)}" + (f"  (ratio {ratio:.3f})" if ratio is not None else "")
            x = r.figure.median if r.figure else (min(measured) / 3 if measured else 0.0)
            ax.text(x, i, " " + label, va="center", fontsize=8)
        ax.set_title(f"{res.suite.key}: {res.suite.title}", fontsize=10)
        ax.set_xlabel("seconds per operation (median; green = kvstate, blue = peer)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
