"""The benchmark framework: suites of rows measured side by side in one run.

A :class:`Suite` is a list of :class:`Case` rows: kvstate's own row(s) and its peers.
Each row is one function ``fn(params) -> Figure`` that runs the thing (usually in
fresh processes) and returns measured seconds per operation; a row that cannot run
here raises :class:`Skipped` with the reason, which the report prints in place of a
number. Nothing is estimated: a figure is a median over ``repeats`` measured runs.

Ratios: each suite names a reference row (a row may name its own, e.g. the floor at
its tp). A row's ratio is reference time / row time, so 1.00 is "as fast as the
reference" and 0.50 "half as fast". If the suite's reference was skipped, the fastest
measured row of the suite is the reference, and the report says so. A suite may also
list :class:`Comparison` lines: the time of one row as a multiple of another's, with a
goal, measured side by side in the same run.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


class Skipped(Exception):
    """A row that cannot run in this environment; the message says why."""


@dataclass(frozen=True)
class Figure:
    """Measured seconds per operation for one row (``samples``: one per repeat)."""

    samples: tuple[float, ...]
    bytes_per_op: int = 0
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the samples (linear between the nearest ranks)."""
        xs = sorted(self.samples)
        pos = q * (len(xs) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    @property
    def p10(self) -> float:
        return self.quantile(0.10)

    @property
    def p90(self) -> float:
        return self.quantile(0.90)

    @property
    def gbps(self) -> float | None:
        return self.bytes_per_op / self.median / 1e9 if self.bytes_per_op else None


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[[dict[str, Any]], Figure]
    kvstate: bool = False  # kvstate's own row, as opposed to a peer
    reference: str | None = None  # the row this one's ratio is taken against (default: the suite's)


@dataclass(frozen=True)
class Comparison:
    """``numerator``'s time as a multiple of ``denominator``'s, and the goal it must meet
    (at most ``goal`` times; None: shown, no goal)."""

    numerator: str
    denominator: str
    goal: float | None = None
    what: str = ""


@dataclass(frozen=True)
class Suite:
    key: str  # "B1"
    title: str
    goal: str
    reference: str  # the name of the row ratios are taken against
    cases: tuple[Case, ...]
    params: dict[str, Any] = field(default_factory=dict)
    comparisons: tuple[Comparison, ...] = ()


@dataclass(frozen=True)
class Row:
    suite: str
    name: str
    kvstate: bool
    figure: Figure | None
    skipped: str | None  # why there is no figure
    failed: bool = False  # the row broke (a bug or a crash), as opposed to "cannot run here"
    reference: str | None = None  # its own reference row, if not the suite's


@dataclass(frozen=True)
class SuiteResult:
    suite: Suite
    rows: tuple[Row, ...]

    def reference(self) -> tuple[Row | None, bool]:
        """The row ratios are taken against, and whether it is the declared one."""
        for row in self.rows:
            if row.name == self.suite.reference and row.figure is not None:
                return row, True
        measured = [r for r in self.rows if r.figure is not None]
        if not measured:
            return None, False
        return min(measured, key=lambda r: r.figure.median if r.figure else float("inf")), False

    def row(self, name: str) -> Row | None:
        return next((r for r in self.rows if r.name == name), None)

    def ratio(self, row: Row) -> float | None:
        ref: Row | None
        if row.reference is not None:
            ref = self.row(row.reference)
        else:
            ref, _ = self.reference()
        if ref is None or ref.figure is None or row.figure is None:
            return None
        return ref.figure.median / row.figure.median

    def multiple(self, c: Comparison) -> float | None:
        """``c.numerator``'s median as a multiple of ``c.denominator``'s (None: one is missing)."""
        num, den = self.row(c.numerator), self.row(c.denominator)
        if num is None or den is None or num.figure is None or den.figure is None:
            return None
        return num.figure.median / den.figure.median


@contextmanager
def no_gc() -> Iterator[None]:
    """Collect, then keep the cyclic GC off while timing (as timeit does): a collection
    of objects made by an earlier row must not be billed to this one."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def timed(fn: Callable[[], Any], repeats: int, *, warmup: int = 1) -> tuple[float, ...]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed."""
    for _ in range(warmup):
        fn()
    out = []
    with no_gc():
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return tuple(out)


def run_suites(suites: Iterable[Suite], progress: Callable[[str], None] = print) -> list[SuiteResult]:
    results = []
    for suite in suites:
        rows = []
        for case in suite.cases:
            progress(f"{suite.key}: {case.name} ...")
            try:
                rows.append(Row(suite.key, case.name, case.kvstate, case.fn(suite.params), None,
                                reference=case.reference))
            except Skipped as exc:
                rows.append(Row(suite.key, case.name, case.kvstate, None, str(exc), reference=case.reference))
            except Exception as exc:  # report the row as broken and go on with the others
                rows.append(Row(suite.key, case.name, case.kvstate, None, f"FAILED: {type(exc).__name__}: {exc}", True,
                                reference=case.reference))
        results.append(SuiteResult(suite, tuple(rows)))
    return results
