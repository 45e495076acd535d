"""Every test has a tier (tests/support/tiers.py): the table covers every test file and
names no file that is gone, and a test without a kind is refused (planted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import tiers

TESTS = Path(__file__).resolve().parent


def test_every_test_file_has_a_tier_and_the_table_names_only_real_paths() -> None:
    files = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))
    uncovered = []
    for rel in files:
        try:
            tiers.defaults(rel)
        except tiers.Untiered:
            uncovered.append(rel)
    assert uncovered == []
    assert [k for k in tiers.DEFAULTS if not (TESTS / k).exists()] == []


def test_a_file_outside_the_table_is_untiered() -> None:
    with pytest.raises(tiers.Untiered, match="tests/newdir/test_new.py has no tier"):
        tiers.tiers("newdir/test_new.py", set())


def test_a_test_without_a_kind_is_untiered() -> None:
    """planted/ has no default kind: each test there must declare one; ``slow`` alone is not one."""
    with pytest.raises(tiers.Untiered, match="no kind marker"):
        tiers.tiers("planted/leaky_tests.py", {"slow", "parametrize"})
    assert tiers.tiers("planted/leaky_tests.py", {"native", "parametrize"}) == {"native"}


def test_declared_kinds_replace_the_default_and_slow_adds() -> None:
    assert tiers.tiers("test_models.py", set()) == {"models"}
    assert tiers.tiers("test_models.py", {"unit"}) == {"unit"}
    assert tiers.tiers("native/test_channel.py", {"multiproc", "native"}) == {"multiproc", "native"}
    assert tiers.tiers("lifecycle/test_processes.py", set()) == {"multiproc", "slow"}
    assert tiers.tiers("test_group_stateful.py", {"slow"}) == {"stateful", "slow"}


@pytest.mark.multiproc
@pytest.mark.slow  # a child pytest: make test runs it, the edit loop need not
def test_no_collected_test_is_without_a_kind() -> None:
    """The conftest hook applied the tiers: selecting everything that has no kind finds nothing."""
    no_kind = " and ".join(f"not {k}" for k in tiers.KINDS)
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", no_kind, str(TESTS)], capture_output=True, text=True, timeout=300, cwd=TESTS.parent)
    assert done.returncode == 5, done.stdout[-3000:] + done.stderr  # 5: no test selected
    assert " deselected" in done.stdout
