"""Hypothesis stateful test: the group machine, built from spec/group.toml, against a
plain Python model of the same lifecycle written by hand.

The system under test is the real runtime machine (kvstate.core.machine) bound to simple real
state: a set of imported ranks, a pin count, failing effects. The model is written
independently of the table. A guided rule draws events legal in the model's current
state; an illegal-event rule draws the others. Invariants are named by id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from support.errors import raises
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from kvstate.core.errors import NativeError
from kvstate.core.reasons import NativeReason
from kvstate.core.errors import TransitionError
from kvstate.core.reasons import TransitionReason
from kvstate.core.machine import Lifecycle, effect, guard
from kvstate.core.spec import MachineSpec, load_machine, parse_machine

GROUP = load_machine("group")
PART = load_machine("part")
EVENTS = GROUP.event_names
FAULTS = sorted(e.name for e in GROUP.events if e.fault and e.name != "part_failed")  # part_failed: importing only


class Injected(RuntimeError):
    pass


class PartUnderTest(Lifecycle):
    """A rank part on the real part table, over its group's simple state: importing it
    adds its rank to the group's imported set, closing it removes it."""

    table = PART

    def __init__(self, group: GroupUnderTest, rank: int) -> None:
        super().__init__(label=f"{group.label}/part[{rank}]")
        self.group, self.rank = group, rank

    @guard("group_importing")
    def _importing(self, **kw: Any) -> bool:
        return self.group.state == "importing"

    @guard("group_admitted")
    def _admitted(self, **kw: Any) -> bool:
        return self.group.state == "importing" and all(p.state in ("leased", "imported") for p in self.group.parts)

    @guard("group_releasing")
    def _releasing(self, **kw: Any) -> bool:
        return self.group.state not in ("ready", "draining")

    @guard("part_unpinned")
    def _unpinned(self, **kw: Any) -> bool:
        return self.group.pins == 0

    @effect("native_lease")
    def _lease(self, **kw: Any) -> None:
        return None

    @effect("native_import")
    def _import(self, **kw: Any) -> None:
        self.group.imported.add(self.rank)

    @effect("return_lease")
    def _return(self, **kw: Any) -> None:
        return None

    @effect("unmap_close")
    def _close(self, **kw: Any) -> None:
        self.group.imported.discard(self.rank)


class GroupUnderTest(Lifecycle):
    """The group machine over simple real state."""

    table = GROUP

    def __init__(self, tp: int) -> None:
        super().__init__(label=f"group-tp{tp}")
        self.tp = tp
        self.validated = False
        self.imported: set[int] = set()
        self.pins = 0
        self.loads = 0  # submitted and not yet collected
        self.failing: str | None = None
        self.parts = [PartUnderTest(self, r) for r in range(tp)]

    def close_parts(self) -> None:
        for p in self.parts:
            if p.may("close"):
                p.fire("close")

    def _maybe_fail(self, name: str) -> None:
        if self.failing == name:
            raise Injected(name)

    @guard("group_validated")
    def _validated(self, **kw: Any) -> bool:
        return self.validated

    @guard("all_parts_imported")
    def _all_imported(self, **kw: Any) -> bool:
        return self.imported == set(range(self.tp))

    @guard("parts_compatible")
    def _compatible(self, **kw: Any) -> bool:
        return True

    @guard("native_quiescent")
    def _quiescent(self, **kw: Any) -> bool:
        return self.pins == 0 and self.loads == 0

    @effect("collect_load")
    def _collect(self, **kw: Any) -> None:
        self._maybe_fail("collect_load")
        self.loads = max(0, self.loads - 1)

    @effect("rollback_parts")
    def _rollback(self, **kw: Any) -> None:
        self._maybe_fail("rollback_parts")
        self.close_parts()

    @effect("submit_load")
    def _submit(self, **kw: Any) -> Any:
        self.pins += 1
        self.loads += 1
        try:
            self._maybe_fail("submit_load")
        except Injected:
            self.pins -= 1  # an effect that raises leaves nothing half done
            self.loads -= 1
            raise

        def undo() -> None:
            self.pins -= 1
            self.loads -= 1
        return undo

    @effect("unmap_parts")
    def _unmap(self, **kw: Any) -> None:
        assert self.pins == 0, "INV-NO-UNMAP-PINNED: unmap under pins"
        self._maybe_fail("unmap_parts")
        self.close_parts()


class GroupModel:
    """The lifecycle as plain Python, independent of the table: the oracle."""

    def __init__(self, tp: int) -> None:
        self.tp, self.state, self.validated = tp, "advertised", False
        self.imported: set[int] = set()
        self.pins = 0
        self.loads = 0

    def outcome(self, event: str) -> str | None:
        """The next state, "refused" (guard), or None (not declared here)."""
        s = self.state
        fault = event in ("part_failed", "peer_died", "incarnation_changed", "expired")
        if s == "advertised":
            if event == "begin_import":
                return "importing" if self.validated else "refused"
            if event == "reject" or (fault and event != "part_failed"):
                return "rejected"
            return "closed" if event == "close" else None
        if s == "importing":
            if event == "complete":
                return "ready" if self.imported == set(range(self.tp)) else "refused"
            return "failed" if fault or event == "drain" else None
        if s == "ready":
            if event in ("load", "loaded"):
                return "ready"
            return "draining" if event == "drain" or (fault and event != "part_failed") else None
        if s == "draining":
            if event == "quiesce":
                return "quiescent" if self.pins == 0 and self.loads == 0 else "refused"
            return "draining" if event in ("drain", "loaded") or (fault and event != "part_failed") else None
        if s == "quiescent":
            if event == "close":
                return "closed"
            return "quiescent" if fault and event != "part_failed" else None
        return None  # terminal

    def apply(self, event: str, dest: str) -> None:
        if event == "load":
            self.pins += 1
            self.loads += 1
        if event == "loaded":
            self.loads = max(0, self.loads - 1)
        if dest == "failed" or event == "close":
            self.imported.clear()
        self.state = dest


def group_machine(table: MachineSpec) -> type[RuleBasedStateMachine]:
    Sut = GroupUnderTest.bound_to(table)

    class GroupStateful(RuleBasedStateMachine):
        @initialize(tp=st.integers(1, 4))
        def start(self, tp: int) -> None:
            self.sut = Sut(tp)
            self.model = GroupModel(tp)

        @rule()
        def validation_passes(self) -> None:
            self.sut.validated = self.model.validated = True

        @precondition(lambda self: self.model.state == "importing")
        @rule(data=st.data())
        def part_step(self, data: st.DataObject) -> None:
            """One rank takes its next import step through the part table: validate, lease
            (phase 1), open (phase 2, only once every rank holds a lease)."""
            part = self.sut.parts[data.draw(st.integers(0, self.model.tp - 1))]
            step = {"received": "validate", "validated": "lease", "leased": "open"}.get(part.state)
            if step is None:
                return
            try:
                part.fire(step)
            except TransitionError as exc:
                if exc.reason is not TransitionReason.GUARD:
                    raise
                assert step == "open" and not all(p.state in ("leased", "imported") for p in self.sut.parts)
            if part.state == "imported":
                self.model.imported.add(part.rank)

        @precondition(lambda self: self.model.state in ("ready", "draining"))
        @rule(data=st.data())
        def part_event_on_live_group(self, data: st.DataObject) -> None:
            """Issue 14, class 5: any part event on any part of a ready or draining group is
            refused and changes nothing: a ready group keeps every part imported."""
            part = data.draw(st.sampled_from(self.sut.parts))
            event = data.draw(st.sampled_from(sorted(PART.event_names)))
            before = (self.sut.state, part.state, set(self.sut.imported))
            with raises(TransitionError, (TransitionReason.ILLEGAL, TransitionReason.GUARD)):
                part.fire(event)
            assert (self.sut.state, part.state, set(self.sut.imported)) == before

        @precondition(lambda self: self.model.pins > 0)
        @rule()
        def native_op_completes(self) -> None:
            self.sut.pins -= 1
            self.model.pins -= 1

        @precondition(lambda self: self.model.state in ("advertised", "importing"))
        @rule()
        def straight_to_ready(self) -> None:
            """The whole import in one step: validation, begin_import, every rank, complete,
            each event checked against the model. Event by event, runs rarely got past
            importing (about one in ten), so rows of ready, draining and quiescent could
            change unnoticed (make mutants); with this step most runs reach them."""
            self.sut.validated = self.model.validated = True
            if self.model.state == "advertised":
                self.fire_as_model("begin_import")
            for step in ("validate", "lease", "open"):  # phase 1 on every rank, then phase 2
                for part in self.sut.parts:
                    if part.may(step):
                        part.fire(step)
            assert self.sut.imported == set(range(self.model.tp))
            self.model.imported |= self.sut.imported
            self.fire_as_model("complete")

        @precondition(lambda self: self.model.state in ("ready", "draining", "quiescent"))
        @rule(data=st.data())
        def fault_on_live_group(self, data: st.DataObject) -> None:
            """A fault (a peer died, an exporter restarted, a lease expired) on a group that
            was ready: it drains, never stays ready or closes, as the model says."""
            self.fire_as_model(data.draw(st.sampled_from(FAULTS)))

        def fire_as_model(self, event: str) -> None:
            expected = self.model.outcome(event)
            got = self.sut.fire(event)
            assert got == expected, f"{event}: machine gave {got}, model {expected}"
            self.model.apply(event, got)

        @rule(data=st.data())
        def legal_event(self, data: st.DataObject) -> None:
            """Guided: an event the model declares in its current state."""
            legal = [e for e in EVENTS if self.model.outcome(e) is not None]
            if not legal:
                return
            event = data.draw(st.sampled_from(legal))
            fail = data.draw(st.sampled_from([None, *table.effects]))
            expected = self.model.outcome(event)
            source = self.sut.state
            self.sut.failing = fail
            try:
                got = self.sut.fire(event)
            except TransitionError as exc:
                if exc.reason is not TransitionReason.GUARD:
                    raise
                got = "refused"
            except NativeError as exc:  # the untyped failure, rolled back and typed
                if exc.reason is not NativeReason.EFFECT:
                    raise
                assert isinstance(exc.cause, Injected)
                got = "injected"
            finally:
                self.sut.failing = None
            self.spec_invariants()
            if got == "injected":
                assert self.sut.state == source, "INV-EFFECT-ATOMIC: state moved on a failing effect"
                return
            assert got == expected, f"{event} in {source}: machine gave {got}, model {expected}"
            if got != "refused":
                self.model.apply(event, got)
            assert self.sut.pins == self.model.pins

        @rule(data=st.data())
        def illegal_event(self, data: st.DataObject) -> None:
            """INV-EVENT-DECLARED: an event the model does not declare changes nothing."""
            illegal = [e for e in EVENTS if self.model.outcome(e) is None] + ["no_such_event"]
            event = data.draw(st.sampled_from(illegal))
            before = self.sut.state
            with raises(TransitionError, TransitionReason.ILLEGAL):
                self.sut.fire(event)
            assert self.sut.state == before

        def spec_invariants(self) -> None:
            if self.sut.state == "ready":
                assert self.sut.imported == set(range(self.sut.tp)), "INV-GROUP-COMPLETE: partial group is ready"
            if self.sut.state == "failed":
                assert not self.sut.imported, "INV-ROLLBACK-COMPLETE: failed group holds parts"

        @invariant()
        def matches_model(self) -> None:
            self.spec_invariants()
            assert self.sut.state == self.model.state

    return GroupStateful


TestGroupStateful = group_machine(GROUP).TestCase
TestGroupStateful.settings = settings(TestGroupStateful.settings, stateful_step_count=40)


def broken_group_table() -> MachineSpec:
    """The group table with the completeness guard removed from `complete`."""
    raw = (Path(__file__).resolve().parents[1] / "spec" / "group.toml").read_text(encoding="utf-8")
    broken = raw.replace('guards = ["all_parts_imported", "parts_compatible"]', 'guards = ["parts_compatible"]')
    broken = broken.replace('all_parts_imported = "Every rank 0..tp-1 has a part in state imported."\n', "")
    assert broken.count("all_parts_imported") == 0
    return parse_machine(broken, "planted/group-without-completeness.toml")


@pytest.mark.slow
def test_self_test_stateful_catches_missing_completeness_guard() -> None:
    """The planted bug (no all_parts_imported guard) must be found and named by id."""

    machine = group_machine(broken_group_table())
    with pytest.raises(AssertionError, match="INV-GROUP-COMPLETE"):
        run_state_machine_as_test(machine, settings=settings(max_examples=200, stateful_step_count=40,
                                                             derandomize=True, database=None))
