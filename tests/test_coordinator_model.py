"""Spin on the coordinator protocol (spec/coordinator.toml with spec/rank.toml): the model
generated from the tables, its properties, and the planted bugs each property catches.

Invariants checked through the model: INV-COORD-READY-COMPLETE, INV-COORD-LOAD-AFTER-READY,
INV-COORD-VALIDATE-BEFORE-OPEN, INV-COORD-NO-ORPHAN-MAPPING, INV-COORD-LEASES and
INV-EVENT-DECLARED (safety), INV-COORD-UNMAP-AFTER-DEATH (liveness, weak fairness).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from support.errors import raises

from kvstate.core.errors import ConfigInvalid
from kvstate.core.reasons import ConfigReason
from kvstate.core.spec import load_spec
from kvstate.derive import coord_world, promela_coord
from kvstate.harness import modelcheck
from support.spin import require_spin
from support.variants import ROOT, registry, variant

PLANTED = sorted((ROOT / "tests" / "planted").glob("coord_*.toml"))
MODEL = promela_coord.COORD_MODEL


# -- generation (no Spin needed) ------------------------------------------------------


def test_the_model_follows_the_tables() -> None:
    """Every command the coordinator sends is received by a worker row, every report a
    worker sends by a coordinator row: the messages are the tables' events."""
    text = promela_coord.generate(load_spec(), 2)
    for cmd in ("check", "open", "ready", "drain", "close", "abort"):
        assert f"cmd[r]?CMD_{cmd};" in text and f"command(0, CMD_{cmd})" in text
    for state in ("validated", "rejected", "imported", "failed", "draining", "quiescent", "closed"):
        assert f"rep[1]?REP_{state};" in text
    assert "ltl unmapped_after_death" in text and "process coordinator died" in text


def test_a_report_the_coordinator_does_not_declare_is_a_clear_error(tmp_path: Path) -> None:
    spec = load_spec(variant(tmp_path, extra=(
        ("rank.toml", 'trigger = "ready"\nsource = "imported"\ndest = "ready"',
         'trigger = "ready"\nsource = "imported"\ndest = "ready"\neffects = ["report"]'),)))
    with raises(ConfigInvalid, ConfigReason.MODEL, match="part_ready"):
        promela_coord.generate(spec, 2)


def test_an_unknown_effect_is_a_clear_error(tmp_path: Path) -> None:
    base = dict(coord_world.REGISTRY)
    del base[("coordinator", "effect", "note_death")]
    with raises(ConfigInvalid, ConfigReason.MODEL) as info:
        promela_coord.generate(load_spec(), 2, base)
    assert info.value.entry == "effects.note_death" and "coord_world.REGISTRY" in info.value.problem


# -- the real tables pass -------------------------------------------------------------


@pytest.mark.slow
def test_safety_holds_on_the_real_tables() -> None:
    """Every state invariant and monitor, INV-EVENT-DECLARED on every message, no deadlock,
    with any single process (coordinator, worker, exporter) dying at any step."""
    require_spin()
    result = modelcheck.check(MODEL, 2, memlim_mb=4096)
    assert result.ok, result.report()
    assert result.states_stored > 100_000


@pytest.mark.slow
def test_every_part_is_unmapped_after_any_death() -> None:
    """INV-COORD-UNMAP-AFTER-DEATH under weak fairness (pan -a -f)."""
    require_spin()
    result = modelcheck.check(MODEL, 2, liveness=True, memlim_mb=4096)
    assert result.ok, result.report()


# -- planted bugs: each property must fail on them -----------------------------------


@pytest.mark.parametrize("patch", PLANTED, ids=lambda p: p.stem)
def test_planted_bug_yields_a_counterexample(patch: Path, tmp_path: Path) -> None:
    require_spin()
    meta = tomllib.loads(patch.read_text())
    spec = load_spec(variant(tmp_path, patch))
    result = modelcheck.check(MODEL, 2, liveness=meta.get("liveness", False), spec=spec, memlim_mb=4096,
                              registry=registry(patch, coord_world.REGISTRY))
    assert not result.ok, f"{patch.name}: Spin found no counterexample"
    assert result.trace is not None and result.trace.events
    if meta["expect"] == "acceptance cycle":
        assert "acceptance cycle" in (result.problem or "")
        assert any(e.machine == "process" and e.event == "died" for e in result.trace.events), result.report()
    else:
        assert meta["expect"] in result.trace.violated, result.report()


def test_counterexample_names_ranks_and_deaths(tmp_path: Path) -> None:
    """A trail reads back as table events with the reporting rank: the repeated report of
    one rank that the counting coordinator mistook for every rank."""
    require_spin()
    patch = ROOT / "tests" / "planted" / "coord_counts_reports.toml"
    result = modelcheck.check(MODEL, 2, registry=registry(patch, coord_world.REGISTRY), memlim_mb=4096)
    assert result.trace is not None
    imported = [e.rank for e in result.trace.events if e.machine == "coordinator" and e.event == "part_imported"]
    assert len(imported) == 2 and len(set(imported)) == 1, result.report()
    assert any(e.event == "complete" and e.dest == "ready" for e in result.trace.events)


# -- heterogeneous TP: the parts are head slices -------------------------------------

#: (worker process, exporter) of each part: decode tp=2 -> prefill tp=1 (one worker holds
#: both slices) and decode tp=1 -> prefill tp=2 (both workers lease the one bank)
MIXED = {"tp2_to_tp1": ((0, 0), (0, 1)), "tp1_to_tp2": ((0, 0), (1, 0))}
MIXED_PLANTED = sorted((ROOT / "tests" / "planted").glob("mixed_*.toml"))


def test_the_slices_follow_the_head_split() -> None:
    """The models' slices are those the coordinator runs (kvstate.core.heads.split)."""
    from kvstate.core import heads

    for name, (src, dst) in {"tp2_to_tp1": (2, 1), "tp1_to_tp2": (1, 2)}.items():
        assert tuple((s.dst_rank, s.src_rank) for s in heads.split(2, src, dst)) == MIXED[name]


def test_a_death_ends_every_part_of_its_process() -> None:
    text = promela_coord.generate(load_spec(), 2, slices=MIXED["tp2_to_tp1"])
    assert "w_alive[0] = 0; mapped[0] = 0; pins[0] = 0; leases[0] = 0; w_alive[1] = 0;" in text
    text = promela_coord.generate(load_spec(), 2, slices=MIXED["tp1_to_tp2"])
    assert "e_alive[0] = 0; leases[0] = 0; e_alive[1] = 0; leases[1] = 0;" in text


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MIXED))
def test_safety_holds_with_mixed_tp(name: str) -> None:
    """Every invariant of the real tables, with the parts as slices and any one process
    (the coordinator, a worker holding several slices, an exporter several slices lease)
    dying at any step."""
    require_spin()
    result = modelcheck.check(MODEL, 2, memlim_mb=4096, slices=MIXED[name])
    assert result.ok, result.report()
    assert result.states_stored > 100_000


@pytest.mark.parametrize("patch", MIXED_PLANTED, ids=lambda p: p.stem)
def test_planted_mixed_tp_bug_yields_a_counterexample(patch: Path) -> None:
    require_spin()
    meta = tomllib.loads(patch.read_text())
    result = modelcheck.check(MODEL, 2, memlim_mb=4096, registry=registry(patch, coord_world.REGISTRY),
                              slices=[tuple(s) for s in meta["slices"]])
    assert not result.ok, f"{patch.name}: Spin found no counterexample"
    assert result.trace is not None and meta["expect"] in result.trace.violated, result.report()
