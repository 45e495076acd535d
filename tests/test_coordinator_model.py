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

from kvstate.core.errors import ArgumentInvalid, ConfigInvalid
from kvstate.core.reasons import ArgumentReason, ConfigReason
from kvstate.core.spec import load_spec
from kvstate.derive import coord_symmetry, coord_world, promela_coord
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
    """At the smallest tp that shows it (``tp``, 2 unless said): tp 2 in the concrete model,
    above in the symmetric one."""
    require_spin()
    meta = tomllib.loads(patch.read_text())
    spec = load_spec(variant(tmp_path, patch))
    result = modelcheck.check(MODEL, meta.get("tp", 2), liveness=meta.get("liveness", False), spec=spec,
                              memlim_mb=4096, registry=registry(patch, coord_world.REGISTRY))
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


# -- the symmetric model (tp 3 and 4) ------------------------------------------------

THREE_RANKS = ROOT / "tests" / "planted" / "coord_two_acks_are_all.toml"
#: the planted safety bugs that tp=2 shows (the three-rank bug has its own test below)
SAFETY_PLANTED = [p for p in PLANTED if p != THREE_RANKS and not tomllib.loads(p.read_text()).get("liveness", False)]


@pytest.mark.slow
@pytest.mark.parametrize("tp", coord_world.SYMMETRIC_TPS)
def test_safety_holds_at_tp_3_and_4(tp: int) -> None:
    """The symmetric model of the real tables: every safety property, no deadlock."""
    require_spin()
    result = modelcheck.check(MODEL, tp, memlim_mb=4096)
    assert result.ok and result.model == modelcheck.COORD_SYMMETRIC, result.report()
    assert result.states_stored > 10_000


@pytest.mark.parametrize("patch", SAFETY_PLANTED, ids=lambda p: p.stem)
def test_symmetric_and_concrete_models_agree_at_tp_2(patch: Path, tmp_path: Path) -> None:
    """Evidence for the reduction beyond its argument: on each planted safety bug the
    symmetric model at tp=2 gives the concrete model's verdict and names the same invariant."""
    require_spin()
    spec = load_spec(variant(tmp_path, patch))
    found = {}
    for symmetric in (False, True):
        result = modelcheck.check(MODEL, 2, spec=spec, memlim_mb=4096, symmetric=symmetric,
                                  registry=registry(patch, coord_world.REGISTRY))
        found[symmetric] = None if result.ok else (result.trace.violated if result.trace else ())
    assert found[False] == found[True], found


def test_symmetric_model_holds_at_tp_2() -> None:
    """Negative control of the agreement: the real tables pass in both forms at tp=2."""
    require_spin()
    assert modelcheck.check(MODEL, 2, memlim_mb=4096, symmetric=True).ok


@pytest.mark.slow
def test_a_bug_of_three_ranks_is_caught_at_tp_3_and_4_and_missed_at_tp_2(tmp_path: Path) -> None:
    """A commit that takes two acknowledgements for all: a correct quorum at tp=2 (both
    models pass), a partial group declared ready at tp=3 and tp=4."""
    require_spin()
    planted = registry(THREE_RANKS, coord_world.REGISTRY)
    for symmetric in (False, True):
        assert modelcheck.check(MODEL, 2, registry=planted, symmetric=symmetric, memlim_mb=4096).ok
    for tp in coord_world.SYMMETRIC_TPS:
        result = modelcheck.check(MODEL, tp, registry=planted, memlim_mb=4096)
        assert not result.ok and result.trace is not None, result.report()
        assert "INV-COORD-READY-COMPLETE" in result.trace.violated, result.report()
        assert any(e.event == "complete" and e.dest == "ready" for e in result.trace.events), result.report()


def test_the_symmetric_model_sorts_every_slot_and_kills_any_rank() -> None:
    """The reduction is sound only if a sort moves everything of a rank and the world may
    act on any rank: every [TP] array is swapped, every slot can die, no process ends."""
    text = promela_coord.generate(load_spec(), 3, symmetric=True)
    arrays = coord_symmetry.slot_arrays(text)
    assert {"rank", "cmdq", "repq", "leases", "mapped", "dead"} <= set(arrays)
    swap = next(line for line in text.splitlines() if line.startswith("inline swap_slots"))
    assert all(f"{a}[i] = {a}[j]" in swap for a in arrays)
    assert all(f"process worker{q} died" in text and f"process exporter{q} died" in text for q in range(3))
    assert "-> break" not in text and "chan " not in text


def test_liveness_of_the_symmetric_model_is_refused() -> None:
    with raises(ArgumentInvalid, ArgumentReason.RANGE, match="weak fairness is per process"):
        modelcheck.check(MODEL, 3, liveness=True)


def test_forgetting_what_a_property_reads_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """FORGET may reset only what nothing reads: a property that reads it is refused."""
    monkeypatch.setattr(coord_world, "STATE", (*coord_world.STATE, ("INV-COORD-LEASES", "all: !gone[{q}] || TP")))
    with raises(ConfigInvalid, ConfigReason.MODEL, match="gone is forgotten"):
        promela_coord.generate(load_spec(), 3, symmetric=True)


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
