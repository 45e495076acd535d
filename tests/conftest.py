"""Shared test configuration: Hypothesis profiles.

``ci`` (derandomized) is the default when CI is set, ``dev`` otherwise; ``fuzz`` is the
long random run behind ``make fuzz``. Select one with HYPOTHESIS_PROFILE.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, max_examples=100, deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("fuzz", max_examples=20_000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


# -- leak detection -----------------------------------------------------------------------
# Every native and multi-process test (by path, or marked ``leakcheck``) must give back
# every fd, memfd mapping, child process, thread and native object it took.

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from support import leaks as _leaks  # noqa: E402

LEAK_CHECKED_DIRS = ("native", "lifecycle", "soak", "trust", "fuzz", "bounds", "cuda", "cudashim")
LEAK_CHECKED_FILES = ("test_nixl_transport.py", "test_cuda_cpu.py")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "leakcheck: check fds, memfd maps, children, threads and native objects")
    config.addinivalue_line("markers", "no_leakcheck: opt a test in a leak-checked directory out (say why)")


def _leak_checked(item: pytest.Item) -> bool:
    if item.get_closest_marker("no_leakcheck"):
        return False
    if item.get_closest_marker("leakcheck"):
        return True
    rel = Path(str(item.path)).resolve().relative_to(Path(__file__).resolve().parent)
    return (len(rel.parts) > 1 and rel.parts[0] in LEAK_CHECKED_DIRS) or rel.name in LEAK_CHECKED_FILES


@pytest.fixture(autouse=True)
def leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a leak-checked test that leaves anything behind (see tests/support/leaks.py)."""
    if not _leak_checked(request.node):
        yield
        return
    before = _leaks.snapshot()
    yield
    found = _leaks.settled_leaks(before)
    if found:
        pytest.fail("leaked: " + "; ".join(found), pytrace=False)
