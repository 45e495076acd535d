"""Step-by-step scenarios over the tables (in the style of h11's state tests): each line is
one event and the state it must produce. The harness controls guards and effects."""

from __future__ import annotations

import pytest

from support.errors import raises

from kvstate.core.errors import NativeError, TransitionError
from kvstate.core.reasons import NativeReason, TransitionReason
from kvstate.core.spec import load_spec
from support.harness import HarnessBase, harness_class

SPEC = load_spec()


def run(obj: HarnessBase, steps: list[tuple[str, dict[str, bool], str]]) -> None:
    for event, guards, expected in steps:
        obj.guard_values = guards
        if expected == "illegal":
            before = obj.state
            with raises(TransitionError, TransitionReason.ILLEGAL):
                obj.fire(event)
            assert obj.state == before
        elif expected == "guard":
            before = obj.state
            with raises(TransitionError, TransitionReason.GUARD):
                obj.fire(event)
            assert obj.state == before
        else:
            assert obj.fire(event) == expected, f"{event}"


def test_bank_full_life() -> None:
    """INV-RELEASE-QUIESCENT and INV-DRAIN-NO-NEW at table level."""
    bank = harness_class(SPEC["bank"])()
    run(bank, [
        ("release_lease", {}, "illegal"),
        ("register", {}, "registered"),
        ("advertise", {}, "advertised"),
        ("grant_lease", {"accepting_leases": True}, "importing"),
        ("grant_lease", {"accepting_leases": True}, "importing"),
        ("lease_mapped", {}, "ready"),
        ("release", {}, "illegal"),             # never from ready
        ("peer_died", {"last_lease": False}, "ready"),      # one lease left
        ("drain", {}, "draining"),
        ("grant_lease", {"accepting_leases": True}, "illegal"),  # no new leases
        ("release", {}, "illegal"),             # never from draining
        ("quiesce", {"native_quiescent": False}, "guard"),
        ("lease_expired", {}, "draining"),
        ("quiesce", {"native_quiescent": True}, "quiescent"),
        ("release", {}, "released"),
        ("drain", {}, "illegal"),
    ])
    assert bank.is_terminal


def test_bank_registration_failure_preserves_state() -> None:
    """INV-REGISTER-ATOMIC: a failing registration leaves the bank allocated, retryable."""
    bank = harness_class(SPEC["bank"])()
    bank.failing = {"native_register"}
    with raises(NativeError, NativeReason.EFFECT):
        bank.fire("register")
    assert bank.state == "allocated"
    assert bank.fire("register_failed") == "allocated"
    bank.failing = set()
    assert bank.fire("register") == "registered"


def test_group_ready_then_peer_death_drains() -> None:
    group = harness_class(SPEC["group"])()
    run(group, [
        ("complete", {}, "illegal"),
        ("begin_import", {"group_validated": False}, "guard"),
        ("begin_import", {"group_validated": True}, "importing"),
        ("complete", {"all_parts_imported": False, "parts_compatible": True}, "guard"),
        ("load", {}, "illegal"),
        ("complete", {"all_parts_imported": True, "parts_compatible": True}, "ready"),
        ("load", {}, "ready"),
        ("peer_died", {}, "draining"),
        ("load", {}, "illegal"),               # INV-DRAIN-NO-NEW for loads
        ("quiesce", {"native_quiescent": False}, "guard"),
        ("quiesce", {"native_quiescent": True}, "quiescent"),
        ("close", {}, "closed"),
    ])


@pytest.mark.parametrize("fault", ["part_failed", "peer_died", "incarnation_changed", "expired", "drain"])
def test_group_fault_during_import_fails_and_rolls_back(fault: str) -> None:
    group = harness_class(SPEC["group"])()
    run(group, [("begin_import", {"group_validated": True}, "importing"), (fault, {}, "failed")])
    assert group.log == ["rollback_parts"]


def test_part_opens_only_after_group_admission() -> None:
    """INV-REJECT-BEFORE-OPEN and INV-GROUP-ATOMIC at table level: a rejected part can never
    be opened, and a validated part is opened only when its group is admitted."""
    part = harness_class(SPEC["part"])()
    run(part, [("open", {}, "illegal"), ("reject", {}, "rejected"), ("open", {}, "illegal")])
    part = harness_class(SPEC["part"])()
    run(part, [
        ("validate", {}, "validated"),
        ("open", {}, "illegal"),                     # INV-LEASE-BEFORE-OPEN: no lease yet
        ("lease", {"group_importing": False}, "guard"),
        ("lease", {"group_importing": True}, "leased"),
        ("open", {"group_admitted": False}, "guard"),   # another rank holds no lease yet
        ("open", {"group_admitted": True}, "imported"),
        ("close", {"part_unpinned": False, "group_releasing": True}, "guard"),   # INV-NO-UNMAP-PINNED
        ("close", {"part_unpinned": True, "group_releasing": False}, "guard"),   # its group is ready
        ("close", {"part_unpinned": True, "group_releasing": True}, "closed"),
    ])
    assert part.log == ["native_lease", "native_import", "unmap_close"]


def test_op_pins_exactly_while_queued_or_running() -> None:
    """INV-OP-PINS: pins taken on submit, dropped on leaving queued/running."""
    for ending in (["start", "finish"], ["start", "fail"], ["cancel"]):
        op = harness_class(SPEC["op"])()
        op.fire("submit")
        for event in ending:
            op.fire(event)
        assert op.log == ["pin_regions", "unpin_regions"]
        assert op.fire("reap") == "reaped"
