"""An exclusive-time probe: where the wall time of a code path goes, by category.

:class:`Probe` wraps named functions (module or class attributes) in place. Each wrapped
call pushes its category on a per-thread stack; time is charged to the innermost category
only, so the categories of one thread add up to that thread's wall time (nothing is
counted twice). Wrapping costs about a microsecond per call, which the report shows as its
own line (``probe overhead``, measured by timing empty wrapped calls).

It is a measuring tool for :mod:`benchmarks.import_profile`; nothing else
imports it.
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class _Stack(threading.local):
    def __init__(self) -> None:
        self.frames: list[list[Any]] = []  # [category, last charge time]


class Probe:
    """Exclusive time per category, summed over every thread that ran wrapped code."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack = _Stack()
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []

    def _charge(self, category: str, seconds: float) -> None:
        with self._lock:
            self.totals[category] += seconds

    def wrap_callable(self, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        probe = self

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            frames = probe._stack.frames
            now = time.perf_counter()
            if frames:
                top = frames[-1]
                probe._charge(top[0], now - top[1])
            frames.append([category, now])
            with probe._lock:
                probe.calls[category] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                cat, since = frames.pop()
                probe._charge(cat, end - since)
                if frames:
                    frames[-1][1] = end
        return wrapped

    def wrap(self, target: str, category: str) -> bool:
        """Wrap ``module:attr`` or ``module:Class.attr``; False when it does not exist (a
        path the code under test no longer has)."""
        module_name, _, path = target.partition(":")
        try:
            owner: Any = importlib.import_module(module_name)
        except ModuleNotFoundError:
            return False
        *parents, attr = path.split(".")
        for p in parents:
            owner = getattr(owner, p, None)
            if owner is None:
                return False
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if raw is None:
            return False
        if isinstance(raw, (staticmethod, classmethod)):
            kind = type(raw)
            new: Any = kind(self.wrap_callable(raw.__func__, category))
        else:
            new = self.wrap_callable(raw, category)
        setattr(owner, attr, new)
        self._undo.append(lambda: setattr(owner, attr, raw))
        return True

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    @contextmanager
    def section(self, category: str) -> Iterator[None]:
        """Charge the enclosed block's own time (outside wrapped calls) to ``category``."""
        frames = self._stack.frames
        now = time.perf_counter()
        if frames:
            self._charge(frames[-1][0], now - frames[-1][1])
        frames.append([category, now])
        try:
            yield
        finally:
            end = time.perf_counter()
            cat, since = frames.pop()
            self._charge(cat, end - since)
            if frames:
                frames[-1][1] = end

    def reset(self) -> None:
        with self._lock:
            self.totals.clear()
            self.calls.clear()

    def overhead_per_call(self, n: int = 20000) -> float:
        """Seconds one wrapped call adds (measured on an empty function)."""
        def nothing() -> None:
            return None
        wrapped = self.wrap_callable(nothing, "_overhead")
        t0 = time.perf_counter()
        for _ in range(n):
            nothing()
        bare = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n):
            wrapped()
        spent = time.perf_counter() - t0
        with self._lock:
            self.totals.pop("_overhead", None)
            self.calls.pop("_overhead", None)
        return max(0.0, (spent - bare) / n)
