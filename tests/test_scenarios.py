"""Step-by-step scenarios over the tables (in the style of h11's state tests): each line is
one event and the state it must produce. The harness controls guards and effects."""

from __future__ import annotations

import pytest

from kvstate.core.errors import GuardRejected, IllegalTransition
from kvstate.core.spec import load_spec
from support.harness import EffectFailed, HarnessBase, harness_class

SPEC = load_spec()


def run(obj: HarnessBase, steps: list[tuple[str, dict[str, bool], str]]) -> None:
    for event, guards, expected in steps:
        obj.guard_values = guards
        if expected == "IllegalTransition":
            before = obj.state
            with pytest.raises(IllegalTransition):
                obj.fire(event)
            assert obj.state == before
        elif expected == "GuardRejected":
            before = obj.state
            with pytest.raises(GuardRejected):
                obj.fire(event)
            assert obj.state == before
        else:
            assert obj.fire(event) == expected, f"{event}"


def test_bank_full_life() -> None:
    """INV-RELEASE-QUIESCENT and INV-DRAIN-NO-NEW at table level."""
    bank = harness_class(SPEC["bank"])()
    run(bank, [
        ("release_lease", {}, "IllegalTransition"),
        ("register", {}, "registered"),
        ("advertise", {}, "advertised"),
        ("grant_lease", {"accepting_leases": True}, "importing"),
        ("grant_lease", {"accepting_leases": True}, "importing"),
        ("lease_mapped", {}, "ready"),
        ("release", {}, "IllegalTransition"),             # never from ready
        ("peer_died", {"last_lease": False}, "ready"),      # one lease left
        ("drain", {}, "draining"),
        ("grant_lease", {"accepting_leases": True}, "IllegalTransition"),  # no new leases
        ("release", {}, "IllegalTransition"),             # never from draining
        ("quiesce", {"native_quiescent": False}, "GuardRejected"),
        ("lease_expired", {}, "draining"),
        ("quiesce", {"native_quiescent": True}, "quiescent"),
        ("release", {}, "released"),
        ("drain", {}, "IllegalTransition"),
    ])
    assert bank.is_terminal


def test_bank_registration_failure_preserves_state() -> None:
    """INV-REGISTER-ATOMIC: a failing registration leaves the bank allocated, retryable."""
    bank = harness_class(SPEC["bank"])()
    bank.failing = {"native_register"}
    with pytest.raises(EffectFailed):
        bank.fire("register")
    assert bank.state == "allocated"
    assert bank.fire("register_failed") == "allocated"
    bank.failing = set()
    assert bank.fire("register") == "registered"


def test_group_ready_then_peer_death_drains() -> None:
    group = harness_class(SPEC["group"])()
    run(group, [
        ("complete", {}, "IllegalTransition"),
        ("begin_import", {"group_validated": False}, "GuardRejected"),
        ("begin_import", {"group_validated": True}, "importing"),
        ("complete", {"all_parts_imported": False, "parts_compatible": True}, "GuardRejected"),
        ("load", {}, "IllegalTransition"),
        ("complete", {"all_parts_imported": True, "parts_compatible": True}, "ready"),
        ("load", {}, "ready"),
        ("peer_died", {}, "draining"),
        ("load", {}, "IllegalTransition"),               # INV-DRAIN-NO-NEW for loads
        ("quiesce", {"native_quiescent": False}, "GuardRejected"),
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
    run(part, [("open", {}, "IllegalTransition"), ("reject", {}, "rejected"), ("open", {}, "IllegalTransition")])
    part = harness_class(SPEC["part"])()
    run(part, [
        ("validate", {}, "validated"),
        ("open", {}, "IllegalTransition"),                     # INV-LEASE-BEFORE-OPEN: no lease yet
        ("lease", {"group_importing": False}, "GuardRejected"),
        ("lease", {"group_importing": True}, "leased"),
        ("open", {"group_admitted": False}, "GuardRejected"),   # another rank holds no lease yet
        ("open", {"group_admitted": True}, "imported"),
        ("close", {"part_unpinned": False, "group_releasing": True}, "GuardRejected"),   # INV-NO-UNMAP-PINNED
        ("close", {"part_unpinned": True, "group_releasing": False}, "GuardRejected"),   # its group is ready
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
