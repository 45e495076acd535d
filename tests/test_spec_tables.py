"""Properties of the tables themselves, checked on the runtime machines built from them."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from support.errors import raises

from kvstate.core.errors import NativeError, TransitionError
from kvstate.core.reasons import NativeReason, TransitionReason
from kvstate.core.spec import MACHINE_NAMES, load_spec
from support.harness import PlantedFailure, drive_to, harness_class, paths_to_states

SPEC = load_spec()
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_every_state_is_reachable(name: str) -> None:
    m = SPEC[name]
    assert set(paths_to_states(m)) == set(m.state_names)


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_no_dead_ends_except_terminals(name: str) -> None:
    m = SPEC[name]
    for state in m.state_names:
        leaves = any(t.source == state and t.dest != state for t in m.transitions)
        assert leaves or state in m.terminal, f"{name}: {state} is a dead end"
        if state in m.terminal:
            assert not any(t.source == state for t in m.transitions)


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_terminal_states_reach_from_every_state(name: str) -> None:
    """From every state some terminal state is reachable: nothing can get stuck for good."""
    m = SPEC[name]
    can_finish = set(m.terminal)
    changed = True
    while changed:
        changed = False
        for t in m.transitions:
            if t.dest in can_finish and t.source not in can_finish:
                can_finish.add(t.source)
                changed = True
    assert can_finish == set(m.state_names)


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_every_state_event_pair_is_declared_or_illegal(name: str) -> None:
    """INV-EVENT-DECLARED: undeclared pairs raise TransitionError (ILLEGAL) and change nothing."""
    m = SPEC[name]
    cls = harness_class(m)
    for state, path in paths_to_states(m).items():
        for event in m.event_names:
            obj = drive_to(cls, path)
            rows = m.rows(event, state)
            if not rows:
                with raises(TransitionError, TransitionReason.ILLEGAL) as info:
                    obj.fire(event)
                assert (info.value.machine, info.value.state, info.value.event) == (name, state, event)
                assert obj.state == state and obj.log == []
                continue
            for row in rows:
                obj = drive_to(cls, path)
                obj.admit(row)
                assert obj.fire(event) == row.dest
                assert obj.log == list(row.effects)


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_guards_pick_the_first_admitted_row_or_refuse(name: str) -> None:
    """For every guarded (event, state) and every assignment of its guards, the first row
    whose guards hold fires; when none holds, TransitionError (GUARD) names guards and nothing changes."""
    m = SPEC[name]
    cls = harness_class(m)
    paths = paths_to_states(m)
    for trigger, source in sorted({(t.trigger, t.source) for t in m.transitions if t.guarded}):
        rows = m.rows(trigger, source)
        names = sorted({g for r in rows for g in (*r.guards, *r.unless)})
        for bits in itertools.product([False, True], repeat=len(names)):
            values = dict(zip(names, bits))
            admitted = [r for r in rows if all(values[g] for g in r.guards)
                        and not any(values[g] for g in r.unless)]
            obj = drive_to(cls, paths[source])
            obj.guard_values = values
            if admitted:
                assert obj.fire(trigger) == admitted[0].dest
                assert obj.log == list(admitted[0].effects)
            else:
                with raises(TransitionError, TransitionReason.GUARD) as info:
                    obj.fire(trigger)
                assert info.value.failed and obj.state == source and obj.log == []


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_failing_effect_leaves_state_and_rolls_back(name: str) -> None:
    """INV-EFFECT-ATOMIC on every row with effects: each effect in turn fails with an
    untyped exception; the earlier ones are undone in reverse, the later ones never run,
    and the failure leaves as NativeError (EFFECT) naming the effect."""
    m = SPEC[name]
    cls = harness_class(m)
    paths = paths_to_states(m)
    for row in m.transitions:
        for k, failing in enumerate(row.effects):
            obj = drive_to(cls, paths[row.source])
            obj.admit(row)
            obj.failing = {failing}
            with raises(NativeError, NativeReason.EFFECT) as info:
                obj.fire(row.trigger)
            assert isinstance(info.value.cause, PlantedFailure) and info.value.step == f"effect {failing}"
            assert obj.state == row.source
            done = list(row.effects[:k])
            assert obj.log == done + [f"undo {e}" for e in reversed(done)]


def test_fault_events_declared() -> None:
    faults = {(n, e.name) for n, m in SPEC.machines.items() for e in m.events if e.fault}
    for needed in [("bank", "register_failed"), ("part", "import_failed"), ("group", "part_failed"),
                   ("group", "peer_died"), ("group", "incarnation_changed"), ("group", "expired"),
                   ("bank", "peer_died"), ("bank", "lease_expired")]:
        assert needed in faults
    # drain during import is declared for the group
    assert SPEC["group"].rows("drain", "importing")


def test_core_states_in_bank_and_group() -> None:
    for name in ("bank", "group"):
        assert {"advertised", "importing", "ready", "draining", "quiescent"} <= set(SPEC[name].state_names)


def test_invariant_ids_are_known_and_checked() -> None:
    """Every INV id named in tests or models exists in spec; every spec invariant is checked somewhere."""
    def named(*dirs: str) -> set[str]:
        files = [p for d in dirs if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*")
                 if p.suffix in (".py", ".pml") and p.name != Path(__file__).name]
        return {m for p in files for m in re.findall(r"INV-[A-Z][A-Z0-9-]*[A-Z0-9]", p.read_text(encoding="utf-8"))}

    assert named("tests", "models", "kvstate") - set(SPEC.invariants) == set(), "unknown invariant ids"
    assert set(SPEC.invariants) - named("tests", "models") == NOT_YET_CHECKED, "update NOT_YET_CHECKED"


#: Invariants whose checker has not landed yet. Must shrink to empty; the test above fails
#: both when an invariant goes unchecked and when one here gains a checker.
NOT_YET_CHECKED: set[str] = set()
