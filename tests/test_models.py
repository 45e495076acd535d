"""Spin model checking of the tables (issue 5): generated models, properties, planted bugs,
and counterexamples replayed against Lifecycle machines.

Invariants checked through the models: INV-GROUP-COMPLETE, INV-GROUP-ATOMIC,
INV-ROLLBACK-COMPLETE, INV-QUIESCE-AFTER-DRAIN, INV-REJECT-BEFORE-OPEN, INV-NO-UNMAP-PINNED,
INV-RELEASE-QUIESCENT, INV-OP-PINS, INV-DRAIN-NO-NEW (safety) and INV-DRAIN-QUIESCES
(liveness, weak fairness).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from support.errors import raises

from kvstate.core.errors import ConfigInvalid, TransitionError
from kvstate.core.reasons import ConfigReason, TransitionReason
from kvstate.harness import modelcheck

from kvstate.derive import promela as models
from kvstate.core.spec import load_spec
from support.model_harness import build
from support.spin import require_spin
from support.variants import ROOT, variant
from support.reuse import REUSE_ON

PLANTED = sorted((ROOT / "tests" / "planted").glob("spec_*.toml"))


# -- generation (no Spin needed; freshness is tests/test_generate.py) ------------------


@pytest.mark.unit
def test_unknown_guard_is_a_clear_error(tmp_path: Path) -> None:
    spec = load_spec(variant(tmp_path, extra=(
        ("group.toml", 'guards = ["all_parts_imported", "parts_compatible"]',
         'guards = ["all_parts_imported", "parts_compatible", "moon_is_full"]'),
        ("group.toml", "[effects]", 'moon_is_full = "An unknown guard."\n\n[effects]'))))
    with raises(ConfigInvalid, ConfigReason.MODEL) as info:
        models.generate(spec, models.PER_RANK, 2)
    assert info.value.entry == "guards.moon_is_full" and info.value.source.endswith("group.toml")
    assert "REGISTRY" in info.value.problem


@pytest.mark.unit
def test_unknown_effect_is_a_clear_error(tmp_path: Path) -> None:
    spec = load_spec(variant(tmp_path, extra=(
        ("op.toml", 'effects = ["pin_regions"]', 'effects = ["pin_regions", "warp_drive"]'),
        ("op.toml", 'unpin_regions = "Drop the op\'s pins."',
         'unpin_regions = "Drop the op\'s pins."\nwarp_drive = "Unknown."'))))
    with raises(ConfigInvalid, ConfigReason.MODEL, match="warp_drive"):
        models.generate(spec, models.COUNTING)


# -- the real tables pass -------------------------------------------------------------


@pytest.mark.parametrize(("model", "tp"), [(models.PER_RANK, 2),
                                           pytest.param(models.PER_RANK, 3, marks=pytest.mark.slow),
                                           (models.COUNTING, 8), (models.COUNTING, 32)])
def test_safety_holds_on_the_real_tables(model: str, tp: int) -> None:
    """Every state invariant, every transition monitor, and no invalid end state. The
    per-rank model has a bank per rank (tp=3: about 4 million states)."""
    require_spin()
    result = modelcheck.check(model, tp)
    assert result.ok, result.report()
    assert result.states_stored > 1000 and result.depth > 100


def test_a_search_stopped_by_the_memory_bound_fails() -> None:
    """Pan stopped at -DMEMLIM before its first state (`kvstate check --memlim 1` reported
    OK, exit 0, on 0 states): an incomplete search is never a pass."""
    require_spin()
    result = modelcheck.check(models.COUNTING, 8, memlim_mb=1)
    assert not result.ok and result.incomplete and result.trace is None, result.report()
    assert result.problem == "pan: reached -DMEMLIM bound" and "INCOMPLETE" in result.report()


def test_drain_quiesces_under_weak_fairness() -> None:
    """INV-DRAIN-QUIESCES: after a drain the bank reaches quiescent (pan -a -f)."""
    require_spin()
    result = modelcheck.check(models.PER_RANK, 2, liveness=True)
    assert result.ok, result.report()


# -- planted bugs: each checker must fail on them -------------------------------------


@pytest.mark.parametrize("patch", PLANTED, ids=lambda p: p.stem)
def test_planted_bug_yields_a_counterexample(patch: Path, tmp_path: Path) -> None:
    require_spin()
    meta = tomllib.loads(patch.read_text())
    spec = load_spec(variant(tmp_path, patch))
    for model in meta["models"]:
        tp = 2 if model == models.PER_RANK else 8
        result = modelcheck.check(model, tp, liveness=meta.get("liveness", False), spec=spec)
        assert not result.ok, f"{patch.name}: Spin found no counterexample in {model}"
        assert result.trace is not None and result.trace.events
        if meta["expect"] == "acceptance cycle":
            assert "acceptance cycle" in (result.problem or "")
            assert result.trace.cycle_start is not None
        else:
            assert meta["expect"] in result.trace.violated, result.report()


# -- trace to test ----------------------------------------------------------------------


def test_counterexample_replays_against_lifecycle_machines(tmp_path: Path) -> None:
    """INV-GROUP-COMPLETE: the trail Spin finds on the broken table, replayed against
    Lifecycle machines bound to that table, reproduces the violation in Python; the
    same trail against the real table is refused at the step the bug allowed."""
    require_spin()
    broken = load_spec(variant(tmp_path, ROOT / "tests" / "planted" / "spec_ready_missing_part.toml"))
    result = modelcheck.check(models.PER_RANK, 2, spec=broken)
    assert result.trace is not None and "INV-GROUP-COMPLETE" in result.trace.violated

    world = build(broken, 2, dict(result.trace.world))
    assert world.violations() == []
    applied = modelcheck.replay(result.trace, world.objects)
    assert len(applied) == len(result.trace.events)
    assert "INV-GROUP-COMPLETE" in world.violations()

    fixed = build(load_spec(), 2, dict(result.trace.world))
    with raises(TransitionError, TransitionReason.GUARD) as info:
        modelcheck.replay(result.trace, fixed.objects)
    assert info.value.machine == "group" and info.value.event == "complete"
    assert "all_parts_imported" in info.value.failed


@pytest.mark.models
@pytest.mark.native
def test_counterexample_replays_against_the_real_exporter_and_importer(tmp_path: Path) -> None:
    """Trace to test on the real implementation. The real Bank, Group and Part classes,
    bound to the broken table (`Lifecycle.bound_to`), follow Spin's trail step by step up
    to `complete`; there the real `parts_compatible` guard, which also requires every part
    to be mapped, refuses it: defence in depth that the model abstracts away (the Python
    harness test above reproduces the violation itself). With the real tables the same
    trail is refused by `all_parts_imported` (INV-GROUP-COMPLETE)."""
    from kvstate.share.bank import Bank
    from kvstate.share.exporter import Exporter
    from kvstate.share.export_config import ExportConfig
    from kvstate.share.importer import Group, ImportConfig, Importer, Part
    from kvstate.transport.host import HostTransport
    from kvstate.core.validate import validate_group
    from support.descriptors import DEPLOYMENT, GEOMETRY, expectation, group as descriptors

    require_spin()
    broken = load_spec(variant(tmp_path, ROOT / "tests" / "planted" / "spec_ready_missing_part.toml"))
    trace = modelcheck.check(models.PER_RANK, 2, spec=broken).trace
    assert trace is not None and "INV-GROUP-COMPLETE" in trace.violated

    transport = HostTransport(granularity=4096)
    importer = Importer(ImportConfig(DEPLOYMENT, reuse=REUSE_ON), transport)
    banks: list[Bank] = []

    def real_objects(group_cls: type[Group]) -> dict[str, object]:
        exporter = Exporter(ExportConfig(DEPLOYMENT, tmp_path / "sock", bytes(16), 2), transport)
        ranks = [exporter.add_bank(r, GEOMETRY) for r in range(2)]  # a bank per rank, as the model has
        banks.extend(ranks)
        group = group_cls(importer, "replayed", ())
        group.validated = validate_group(descriptors(2, "/nonexistent/export.sock"), expectation(check_socket=False))
        group.parts = [Part(group, d) for d in group.validated.parts]
        return {"group[0]": group, "part[0]": group.parts[0], "part[1]": group.parts[1],
                "bank[0]": ranks[0], "bank[1]": ranks[1]}

    try:
        with raises(TransitionError, TransitionReason.GUARD) as info:
            modelcheck.replay(trace, real_objects(Group.bound_to(broken["group"])))  # type: ignore[arg-type]
        assert (info.value.machine, info.value.event, info.value.failed) == ("group", "complete", ("parts_compatible",))

        with raises(TransitionError, TransitionReason.GUARD) as info:
            modelcheck.replay(trace, real_objects(Group))  # type: ignore[arg-type]
        assert info.value.machine == "group" and "all_parts_imported" in info.value.failed
    finally:
        importer.close()
        for bank in banks:
            if bank.may("drain"):
                bank.fire("drain")
            if bank.state == "draining":
                bank.fire("quiesce")
            if not bank.is_terminal:
                bank.fire("release")
