"""Shared test configuration: Hypothesis profiles, test tiers, the leak check, the
session's temp root.

``ci`` (derandomized) is the default Hypothesis profile when CI is set, ``dev``
otherwise; ``fuzz`` is the long random run behind ``make fuzz``. Select one with
HYPOTHESIS_PROFILE.
"""

from __future__ import annotations

import multiprocessing.util
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from kvstate.harness import leaks
from support import tempdirs, tiers

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


@pytest.fixture
def cpus() -> list[int]:
    """The CPUs this process may use, when there are two or more (else the test is
    skipped): a test that binds a thread to one of them tells it from a free one."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs 2 CPUs to tell a bound thread from a free one; this process may use {allowed}")
    return allowed


@pytest.fixture
def short_sockets() -> Iterator[Path]:
    """A private (0700) directory with a short path for control sockets (AF_UNIX paths
    hold 107 bytes; pytest's temp paths are long), removed with what it holds."""
    d = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    os.chmod(d, 0o700)
    try:
        yield d
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


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


# -- temp root (tests/support/tempdirs.py) ---------------------------------------------
# Every mkdtemp of the session (children too, through TMPDIR) lands in one short root that
# is removed at the end; a kvs* folder this process still makes directly in the system
# temp dir, and leaves there, fails the session.

SYSTEM_TMP = Path(tempfile.gettempdir())
_watch = pytest.StashKey[tempdirs.EscapeWatch]()
_left = pytest.StashKey[list[str]]()
_running = "(collection)"


def _current() -> str:
    return _running


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_watch] = tempdirs.EscapeWatch(SYSTEM_TMP, _current)


def pytest_runtest_logstart(nodeid: str) -> None:
    global _running
    _running = nodeid


@pytest.fixture(scope="session", autouse=True)
def temp_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    tmp_path_factory.getbasetemp()  # pytest's own tmp_path stays where pytest keeps it
    # multiprocessing's own temp dir (the forkserver's socket) is removed at interpreter
    # exit, after the root: it is made first, where it always was.
    multiprocessing.util.get_temp_dir()
    root = tempdirs.TempRoot(SYSTEM_TMP)
    yield root.path
    root.close()


@pytest.hookimpl(tryfirst=True)  # before the terminal reporter's summary, which reads the status
def pytest_sessionfinish(session: pytest.Session) -> None:
    watch = session.config.stash.get(_watch, None)
    if watch is None:
        return
    watch.stop()
    left = session.config.stash[_left] = watch.left()
    if left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    left = config.stash.get(_left, [])
    if left:
        terminalreporter.section("folders left in the system temp dir", red=True)
        terminalreporter.write_line("make them under tempfile.gettempdir() (the session's root):")
        for line in left:
            terminalreporter.write_line("  " + line)
