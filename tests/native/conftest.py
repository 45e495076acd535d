"""Every native test runs under the leak check: no new fds in /proc/self/fd and no new
memfd mappings in /proc/self/maps after the test (checked after its fixtures close)."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest

from native.helpers import leaks, snapshot


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    before = snapshot()
    yield
    found: list[str] = []
    for _ in range(50):  # closing threads (watchers, handlers) may still be letting go
        gc.collect()
        found = leaks(before)
        if not found:
            return
        time.sleep(0.02)
    pytest.fail("leaked after the test: " + "; ".join(found))
