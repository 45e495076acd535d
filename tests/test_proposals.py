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
                                 nfair=8, memlim_mb=1024, timeout_s=600.0)  # 8 processes, init among them


def test_the_lease_per_link_keeps_memory_and_content_safe() -> None:
    """No read or write of a freed bank, no read unmapped, the bank freed only with no
    mapping and no store left, and every block an import accepts is the version the index
    named, untorn."""
    result = _check(LEASE_PER_LINK)
    assert result.ok, result.report()
    assert result.states_stored > 100_000 and result.depth > 50  # the whole space, not a stub


def test_a_drained_bank_is_freed_under_weak_fairness() -> None:
    """Although every importer would import forever: a refused renewal ends its imports."""
    result = _check(LEASE_PER_LINK, liveness=True)
    assert result.ok, result.report()


@pytest.mark.parametrize(("plant", "violated"), [
    ("EPOCH_AFTER_THE_BYTES", "c1==(want/2)"),        # the exporter marks a store only once it is done
    ("NO_SECOND_EPOCH_READ", "c1==(want/2)"),         # the importer trusts the epoch it read first
    ("ODD_EPOCH_TRUSTED", "c1==(want/2)"),            # an index's answer naming a block mid-store
    ("TWO_STORES_ONE_BLOCK", "c1==(want/2)"),         # a second store ends the first one's odd epoch
    ("EXPIRY_DROPS_THE_LEASE", "!(mapped[0])"),       # an expired lease ends before its unmap
    ("RETURN_BEFORE_UNMAP", "!(mapped[0])"),          # the importer returns its lease, then unmaps
    ("LINK_SHUT_WHILE_MAPPED", "!(mapped[0])"),       # a link closed (a timeout, a forked child) under a mapping
])
def test_each_planted_safety_bug_is_caught(plant: str, violated: str) -> None:
    result = _check(LEASE_PER_LINK, plant)
    assert not result.ok and "assertion violated" in (result.problem or ""), result.report()
    assert violated in (result.problem or ""), result.problem


@pytest.mark.parametrize("plant", ["LEASE_NEVER_RETURNED", "REFUSAL_IGNORED"])
def test_each_planted_liveness_bug_is_caught(plant: str) -> None:
    """A lease kept after the unmap, or imports that go on after a refused renewal: the
    drained bank is never freed."""
    result = _check(LEASE_PER_LINK, plant, liveness=True)
    assert not result.ok and "acceptance cycle" in (result.problem or ""), result.report()
