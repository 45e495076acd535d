"""Prints how many cases each fuzz target ran (the figure ``make fuzz`` reports)."""

from __future__ import annotations

from typing import Any


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from fuzz import targets

    if targets.CASES:
        total = sum(targets.CASES.values())
        parts = ", ".join(f"{k} {v}" for k, v in sorted(targets.CASES.items()))
        terminalreporter.write_line(f"fuzz cases: {total} ({parts})")
