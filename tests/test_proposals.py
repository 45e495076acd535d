"""Spin on the proposals' models (docs/proposals/): each holds its properties, and each of
its planted bugs is caught, so a proposal reaches review with a checker that is known to
bite. A proposal's model is hand-written; once taken, its rows move into spec/ and it
gives way to generated models (tests/test_models.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.harness import modelcheck
from support.spin import require_spin
from support.variants import ROOT

LEASE_PER_LINK = ROOT / "docs" / "proposals" / "lease_per_link.pml"


def _check(model: Path, plant: str | None = None, *, liveness: bool = False) -> modelcheck.CheckResult:
    require_spin()
    text = model.read_text(encoding="utf-8")
    if plant is not None:
        assert f"PLANT_{plant}" in text, f"{model.name} plants no {plant}"
        text = f"#define PLANT_{plant}\n{text}"
    return modelcheck.check_text(text, model=model.stem, tp=2, liveness=liveness, claim="drain_frees",
                                 memlim_mb=1024, timeout_s=300.0)


def test_the_lease_per_link_keeps_memory_and_content_safe() -> None:
    """No read of an unmapped or freed bank, the bank freed only with no mapping left, and
    every block an import accepts is the version the index named, untorn."""
    result = _check(LEASE_PER_LINK)
    assert result.ok, result.report()
    assert result.states_stored > 100_000 and result.depth > 50  # the whole space, not a stub


def test_a_drained_bank_is_freed_under_weak_fairness() -> None:
    result = _check(LEASE_PER_LINK, liveness=True)
    assert result.ok, result.report()


@pytest.mark.parametrize(("plant", "violated"), [
    ("EPOCH_AFTER_THE_BYTES", "c1==(want/2)"),        # the exporter marks a store only once it is done
    ("NO_SECOND_EPOCH_READ", "c1==(want/2)"),         # the importer trusts the epoch it read first
    ("ODD_EPOCH_TRUSTED", "c1==(want/2)"),            # an index's answer naming a block mid-store
    ("EXPIRY_DROPS_THE_LEASE", "!(mapped[0])"),       # an expired lease ends before its unmap
    ("RETURN_BEFORE_UNMAP", "!(mapped[0])"),          # the importer returns its lease, then unmaps
])
def test_each_planted_safety_bug_is_caught(plant: str, violated: str) -> None:
    result = _check(LEASE_PER_LINK, plant)
    assert not result.ok and "assertion violated" in (result.problem or ""), result.report()
    assert violated in (result.problem or ""), result.problem


def test_a_lease_never_returned_keeps_the_bank_from_being_freed() -> None:
    result = _check(LEASE_PER_LINK, "LEASE_NEVER_RETURNED", liveness=True)
    assert not result.ok and "acceptance cycle" in (result.problem or ""), result.report()
