"""Shared test configuration: Hypothesis profiles, test tiers, the leak check.

``ci`` (derandomized) is the default Hypothesis profile when CI is set, ``dev``
otherwise; ``fuzz`` is the long random run behind ``make fuzz``. Select one with
HYPOTHESIS_PROFILE.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kvstate.harness import leaks
from support import tiers

settings.register_profile("ci", derandomize=True, max_examples=100, deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("fuzz", max_examples=20_000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))

TESTS = Path(__file__).resolve().parent

# tests/vllm needs vLLM, which lives in its own venv (.venv-vllm, ~3.5 GiB): `make test-vllm`
# runs it. The main suite never collects it, so it is neither passed nor skipped there.
# Naming the folder on the command line still runs it (pytest collects explicit paths).
collect_ignore = ["vllm"]


# -- tiers (tests/support/tiers.py) -----------------------------------------------------


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    untiered = []
    for item in items:
        rel = Path(str(item.path)).resolve().relative_to(TESTS).as_posix()
        try:
            found = tiers.tiers(rel, {m.name for m in item.iter_markers()})
        except tiers.Untiered as exc:
            untiered.append(str(exc))
            continue
        for name in sorted(found):
            if item.get_closest_marker(name) is None:
                item.add_marker(name)
    if untiered:
        raise pytest.UsageError("tests without a tier:\n  " + "\n  ".join(sorted(set(untiered))))


# -- leak check (kvstate/harness/leaks.py) ---------------------------------------------
# Every native and multi-process test must give back every fd, memfd mapping, child
# process, thread and native object it took, checked after its own fixtures close.
# KVSTATE_LEAK_GRACE_S bounds the wait for asynchronous teardown (the self-test shortens it).


@pytest.fixture(autouse=True)
def leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    node = request.node
    checked = (node.get_closest_marker("native") or node.get_closest_marker("multiproc")) \
        and not node.get_closest_marker("no_leakcheck")
    if not checked:
        yield
        return
    before = leaks.snapshot()
    yield
    found = leaks.settled_leaks(before, float(os.environ.get("KVSTATE_LEAK_GRACE_S", "5")))
    if found:
        pytest.fail("leaked: " + "; ".join(found), pytrace=False)
