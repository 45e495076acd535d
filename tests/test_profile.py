"""Capability publication (INV-CAPS-ALL-OR-NOTHING) and deployment-profile admission.

The last test plants a broken admission rule table and asserts the rule check fails on it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from support.errors import raises
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kvstate.core.errors import ConfigInvalid
from kvstate.core.reasons import ConfigReason
from kvstate.reuse import profile
from kvstate.core.descriptor import VERSION
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.handles import HandleKind
from kvstate.reuse.profile import (
    PROTOCOL_VERSION,
    Admitted,
    DeploymentProfile,
    FabricTrial,
    PublishedCapabilities,
    Refused,
    Rule,
    TransportCapabilities,
    admit,
    parse_capabilities,
)
from kvstate.core.capabilities import Capabilities, MemoryKind, Scope


def transport(name: str, kinds: set[HandleKind], memory: set[MemoryKind], scopes: set[Scope]) -> TransportCapabilities:
    return TransportCapabilities(name, Capabilities(frozenset(kinds), frozenset(memory), frozenset(scopes)))


GEOMETRY = Geometry.uniform(layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype=DType.BF16,
                    layout=Layout.BLOCK_MAJOR, num_blocks=1024)

HOST = transport("host", {HandleKind.MEMFD}, {MemoryKind.HOST}, {Scope.SAME_NODE})
CUDA = transport("cuda", {HandleKind.POSIX_FD, HandleKind.FABRIC}, {MemoryKind.DEVICE}, {Scope.SAME_NODE})
NIXL = transport("nixl", {HandleKind.NIXL}, {MemoryKind.HOST, MemoryKind.DEVICE}, {Scope.CROSS_NODE})


def caps(*transports: TransportCapabilities, trial: FabricTrial = FabricTrial.PASSED,
         version: int = PROTOCOL_VERSION, kinds: set[HandleKind] | None = None) -> PublishedCapabilities:
    carried = {k for t in transports for k in t.capabilities.handle_kinds}
    if trial is not FabricTrial.PASSED:
        carried.discard(HandleKind.FABRIC)
    return PublishedCapabilities(device_uuids=(b"\x11" * 16, b"\x22" * 16),
                                 handle_kinds=frozenset(carried if kinds is None else kinds), fabric_trial=trial,
                                 transports=tuple(transports), geometry_fingerprint=GEOMETRY.fingerprint(),
                                 protocol_version=version)


FULL = caps(HOST, CUDA, NIXL)


def test_one_protocol_version() -> None:
    assert PROTOCOL_VERSION == VERSION  # defined once, by the descriptor wire format


def test_wire_round_trip() -> None:
    wire = json.loads(json.dumps(FULL.to_wire()))
    assert parse_capabilities(wire) == FULL


@pytest.mark.parametrize("field", profile.FIELDS)
def test_a_partial_set_is_refused_naming_what_is_missing(field: str) -> None:
    wire = FULL.to_wire()
    del wire[field]
    with raises(ConfigInvalid, ConfigReason.CAPABILITIES_INCOMPLETE) as info:
        parse_capabilities(wire)
    assert info.value.missing == (field,)


def test_every_missing_field_is_named() -> None:
    with raises(ConfigInvalid, ConfigReason.CAPABILITIES_INCOMPLETE) as info:
        parse_capabilities({"device_uuids": []})
    assert set(info.value.missing) == set(profile.FIELDS) - {"device_uuids"}
    wire = FULL.to_wire()
    del wire["transports"][1]["scopes"]
    with raises(ConfigInvalid, ConfigReason.CAPABILITIES_INCOMPLETE) as info:
        parse_capabilities(wire)
    assert info.value.missing == ("transports[1].scopes",)


@pytest.mark.parametrize("change", [
    lambda w: w.update(extra=1),
    lambda w: w.update(device_uuids=[]),
    lambda w: w.update(device_uuids=["00" * 15]),
    lambda w: w.update(device_uuids=["zz" * 16]),
    lambda w: w.update(device_uuids=[w["device_uuids"][0]] * 2),
    lambda w: w.update(handle_kinds=[]),
    lambda w: w.update(handle_kinds=["floppy"]),
    lambda w: w.update(handle_kinds=["cuda_ipc"]),  # no transport carries it
    lambda w: w.update(fabric_trial="failed"),  # fabric is published, trial did not pass
    lambda w: w.update(fabric_trial="maybe"),
    lambda w: w.update(transports=[]),
    lambda w: w.update(transports={"host": 1}),
    lambda w: w["transports"][0].update(memory_kinds=[]),
    lambda w: w["transports"][0].update(colour="blue"),
    lambda w: w["transports"].append(dict(w["transports"][0])),
    lambda w: w.update(geometry_fingerprint=""),
    lambda w: w.update(geometry_fingerprint="00" * 32),
    lambda w: w.update(protocol_version=0),
    lambda w: w.update(protocol_version=True),
    lambda w: w.update(protocol_version="1"),
])
def test_malformed_or_inconsistent_sets_are_refused(change: Any) -> None:
    wire = FULL.to_wire()
    change(wire)
    with raises(ConfigInvalid, ConfigReason.CAPABILITIES_INVALID):
        parse_capabilities(wire)


def test_direct_construction_is_checked_too() -> None:
    with raises(ConfigInvalid, (ConfigReason.CAPABILITIES_INCOMPLETE, ConfigReason.CAPABILITIES_INVALID)):
        caps(HOST, kinds={HandleKind.NIXL})
    with raises(ConfigInvalid, (ConfigReason.CAPABILITIES_INCOMPLETE, ConfigReason.CAPABILITIES_INVALID)):
        PublishedCapabilities(device_uuids=[b"\x11" * 16], handle_kinds=frozenset({HandleKind.MEMFD}),  # type: ignore[arg-type]
                              fabric_trial=FabricTrial.NOT_RUN, transports=(HOST,),
                              geometry_fingerprint=b"x", protocol_version=1)


@pytest.mark.parametrize("declared, published, gpu", [
    (DeploymentProfile.HOST_LOCAL, caps(HOST), False),
    (DeploymentProfile.GPU_SINGLE_NODE, caps(CUDA, trial=FabricTrial.NOT_RUN), True),
    (DeploymentProfile.GPU_FABRIC, caps(CUDA), True),
    (DeploymentProfile.CROSS_NODE_NIXL, caps(NIXL), True),
    (DeploymentProfile.CROSS_NODE_NIXL, caps(transport("nixl", {HandleKind.NIXL}, {MemoryKind.HOST},
                                                       {Scope.CROSS_NODE})), False),
])
def test_admitted(declared: DeploymentProfile, published: PublishedCapabilities, gpu: bool) -> None:
    outcome = admit(declared, published)
    assert isinstance(outcome, Admitted) and outcome.admitted
    assert outcome.gpu_reuse_allowed is gpu


@pytest.mark.parametrize("declared, published, rules", [
    (DeploymentProfile.HOST_LOCAL, caps(CUDA), {Rule.HOST_MEMFD_TRANSPORT}),
    (DeploymentProfile.GPU_SINGLE_NODE, caps(HOST), {Rule.DEVICE_SAME_NODE_TRANSPORT}),
    (DeploymentProfile.GPU_SINGLE_NODE, caps(NIXL), {Rule.DEVICE_SAME_NODE_TRANSPORT}),
    (DeploymentProfile.GPU_FABRIC, caps(CUDA, trial=FabricTrial.FAILED),
     {Rule.DEVICE_FABRIC_TRANSPORT, Rule.FABRIC_TRIAL_PASSED}),
    (DeploymentProfile.GPU_FABRIC, caps(HOST, version=PROTOCOL_VERSION + 1),
     {Rule.PROTOCOL_VERSION, Rule.DEVICE_FABRIC_TRANSPORT}),
    (DeploymentProfile.CROSS_NODE_NIXL, caps(HOST, CUDA), {Rule.CROSS_NODE_NIXL_TRANSPORT}),
])
def test_refused_with_every_reason(declared: DeploymentProfile, published: PublishedCapabilities,
                                   rules: set[Rule]) -> None:
    outcome = admit(declared, published)
    assert isinstance(outcome, Refused) and not outcome.admitted
    assert outcome.rules == rules and all(r.detail for r in outcome.reasons)


def test_profiles_parse_strictly() -> None:
    assert DeploymentProfile.parse("gpu-fabric") is DeploymentProfile.GPU_FABRIC
    with raises(ConfigInvalid, ConfigReason.UNKNOWN_PROFILE):
        DeploymentProfile.parse("gpu_fabric")
    with raises(ConfigInvalid, ConfigReason.UNKNOWN_PROFILE):
        admit("host-local", FULL)  # type: ignore[arg-type]


# -- a property check of admission, and its planted-bug self-test ---------------------


transports_st = st.lists(st.builds(
    transport, st.sampled_from(["t0", "t1", "t2"]),
    st.sets(st.sampled_from(list(HandleKind)), min_size=1),
    st.sets(st.sampled_from(list(MemoryKind)), min_size=1),
    st.sets(st.sampled_from(list(Scope)), min_size=1)), min_size=1, max_size=3, unique_by=lambda t: t.name)


def _maybe_caps(ts: list[TransportCapabilities], trial: FabricTrial, version: int) -> PublishedCapabilities | None:
    try:
        return caps(*ts, trial=trial, version=version)
    except ConfigInvalid as exc:
        if exc.reason not in (ConfigReason.CAPABILITIES_INCOMPLETE, ConfigReason.CAPABILITIES_INVALID):
            raise
        return None  # e.g. only fabric handles and no passed trial: nothing publishable


caps_st = st.builds(_maybe_caps, transports_st, st.sampled_from(list(FabricTrial)),
                    st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION + 1])).filter(lambda c: c is not None)


def _needs(declared: DeploymentProfile, c: PublishedCapabilities) -> bool:
    """The admission rules restated independently, from the module docstring's table."""
    if c.protocol_version != PROTOCOL_VERSION:
        return False
    def has(kinds: set[HandleKind], memory: MemoryKind | None, scope: Scope) -> bool:
        return any(t.capabilities.handle_kinds & kinds & c.handle_kinds
                   and (memory is None or memory in t.capabilities.memory_kinds)
                   and scope in t.capabilities.scopes for t in c.transports)
    if declared is DeploymentProfile.HOST_LOCAL:
        return has({HandleKind.MEMFD}, MemoryKind.HOST, Scope.SAME_NODE)
    if declared is DeploymentProfile.GPU_SINGLE_NODE:
        return has({HandleKind.POSIX_FD, HandleKind.CUDA_IPC}, MemoryKind.DEVICE, Scope.SAME_NODE)
    if declared is DeploymentProfile.GPU_FABRIC:
        return c.fabric_trial is FabricTrial.PASSED and (
            has({HandleKind.FABRIC}, MemoryKind.DEVICE, Scope.SAME_NODE)
            or has({HandleKind.FABRIC}, MemoryKind.DEVICE, Scope.CROSS_NODE))
    return has({HandleKind.NIXL}, None, Scope.CROSS_NODE)


def check_admission(admit_fn: Any, declared: DeploymentProfile, c: PublishedCapabilities) -> None:
    outcome = admit_fn(declared, c)
    assert isinstance(outcome, Admitted) == _needs(declared, c), (declared, c, outcome)
    if isinstance(outcome, Admitted) and outcome.gpu_reuse_allowed:
        assert declared is not DeploymentProfile.HOST_LOCAL


@given(st.sampled_from(list(DeploymentProfile)), caps_st)
def test_admission_matches_the_rules(declared: DeploymentProfile, c: PublishedCapabilities) -> None:
    check_admission(admit, declared, c)


def test_admission_check_catches_a_planted_rule_bug() -> None:
    """Self-test: an admit that forgets the same-node rule of gpu-single-node must fail the same check."""
    from planted import profile_bugs

    @settings(max_examples=500, derandomize=True, database=None, phases=[Phase.generate])
    @given(st.sampled_from(list(DeploymentProfile)), caps_st)
    def prop(declared: DeploymentProfile, c: PublishedCapabilities) -> None:
        check_admission(profile_bugs.admit, declared, c)

    with pytest.raises(AssertionError):
        prop()
