"""Capability publication and deployment-profile admission.

A worker publishes what it can do as one :class:`PublishedCapabilities`: the device UUIDs
it serves, the handle kinds it exports, the result of its FABRIC trial export/import, its
registered transports (each with :class:`kvstate.transport.protocol.Capabilities`), the
fingerprint of its KV geometry and the kvstate protocol version. Publication is **all or
nothing** (INV-CAPS-ALL-OR-NOTHING): :func:`parse_capabilities` refuses a partial or
inconsistent set with a typed error naming every missing field, and the class itself has
no defaults, so a partial set cannot be built either.

A deployment declares one profile. :func:`admit` checks the capabilities against that
profile's rules and returns :class:`Admitted`, or :class:`Refused` with every failed rule:

===================  ================================================================
host-local           a same-node transport over host memory with memfd handles
gpu-single-node      a same-node transport over device memory with POSIX-fd (VMM) or
                     legacy CUDA IPC handles
gpu-fabric           a transport over device memory with FABRIC handles, and a FABRIC
                     trial that passed
cross-node-nixl      a cross-node transport with NIXL handles
===================  ================================================================

Every profile also requires this module's :data:`PROTOCOL_VERSION` and published handle
kinds that some transport actually carries. GPU reuse requires a declared and admitted
profile that allows it (INV-POLICY-GPU-GATED): ``Admitted.gpu_reuse_allowed`` is what
:func:`kvstate.reuse.policy.choose_transfer_source` reads.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from kvstate.core.descriptor import VERSION as PROTOCOL_VERSION
from kvstate.core.errors import ConfigInvalid
from kvstate.core.reasons import ConfigReason
from kvstate.core.handles import HandleKind
from kvstate.core.identity import UUID_BYTES as DEVICE_UUID_BYTES
from kvstate.core.capabilities import Capabilities, FabricTrial, MemoryKind, Scope

__all__ = ["PROTOCOL_VERSION", "Admitted", "DeploymentProfile", "FabricTrial", "PublishedCapabilities",
           "Refusal", "Refused", "Rule", "TransportCapabilities", "admit", "parse_capabilities"]

#: The kvstate wire protocol version is defined once, by kvstate.core.descriptor (the version
#: of the descriptor wire format); capability publication carries the same number.

#: ``kvstate.core.geometry.Geometry.fingerprint()`` is 16 bytes.
GEOMETRY_FINGERPRINT_BYTES = 16


class DeploymentProfile(enum.Enum):
    HOST_LOCAL = "host-local"
    GPU_SINGLE_NODE = "gpu-single-node"
    GPU_FABRIC = "gpu-fabric"
    CROSS_NODE_NIXL = "cross-node-nixl"

    @classmethod
    def parse(cls, name: str) -> DeploymentProfile:
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(p.value for p in cls)
            raise ConfigInvalid(ConfigReason.UNKNOWN_PROFILE,
                                f"unknown deployment profile {name!r}; known: {known}") from None


# -- publication ---------------------------------------------------------------------


@attrs.frozen
class TransportCapabilities:
    """One registered transport as published: its name and its capabilities."""

    name: str
    capabilities: Capabilities


def _nonempty(field: str, value: Any) -> None:
    if not value:
        raise ConfigInvalid.capabilities_invalid(field, "must not be empty")


def _check(inst: PublishedCapabilities) -> None:
    for name, kind in (("device_uuids", tuple), ("handle_kinds", frozenset), ("transports", tuple)):
        if not isinstance(getattr(inst, name), kind):
            raise ConfigInvalid.capabilities_invalid(name, f"must be a {kind.__name__}")
    _nonempty("device_uuids", inst.device_uuids)
    for uuid in inst.device_uuids:
        if not isinstance(uuid, bytes) or len(uuid) != DEVICE_UUID_BYTES:
            raise ConfigInvalid.capabilities_invalid("device_uuids",
                                                     f"each must be {DEVICE_UUID_BYTES} bytes, got {uuid!r}")
    if len(set(inst.device_uuids)) != len(inst.device_uuids):
        raise ConfigInvalid.capabilities_invalid("device_uuids", "repeated device UUID")
    _nonempty("handle_kinds", inst.handle_kinds)
    if not all(isinstance(k, HandleKind) for k in inst.handle_kinds):
        raise ConfigInvalid.capabilities_invalid("handle_kinds", "must be HandleKind values")
    if not isinstance(inst.fabric_trial, FabricTrial):
        raise ConfigInvalid.capabilities_invalid("fabric_trial", "must be a FabricTrial")
    _nonempty("transports", inst.transports)
    names = [t.name for t in inst.transports]
    if len(set(names)) != len(names):
        raise ConfigInvalid.capabilities_invalid("transports", "repeated transport name")
    for t in inst.transports:
        if not isinstance(t, TransportCapabilities) or not t.name:
            raise ConfigInvalid.capabilities_invalid("transports", f"malformed transport entry {t!r}")
        c = t.capabilities
        if not (c.handle_kinds and c.memory_kinds and c.scopes):
            raise ConfigInvalid.capabilities_invalid("transports",
                                                     f"transport {t.name!r} publishes an empty capability")
    carried = frozenset(k for t in inst.transports for k in t.capabilities.handle_kinds)
    if not inst.handle_kinds <= carried:
        extra = sorted(k.value for k in inst.handle_kinds - carried)
        raise ConfigInvalid.capabilities_invalid("handle_kinds", f"no transport carries {', '.join(extra)}")
    if HandleKind.FABRIC in inst.handle_kinds and inst.fabric_trial is not FabricTrial.PASSED:
        raise ConfigInvalid.capabilities_invalid("handle_kinds",
                                                 "fabric is published but the FABRIC trial did not pass")
    if not isinstance(inst.geometry_fingerprint, bytes) or len(inst.geometry_fingerprint) != GEOMETRY_FINGERPRINT_BYTES:
        raise ConfigInvalid.capabilities_invalid("geometry_fingerprint", f"must be {GEOMETRY_FINGERPRINT_BYTES} bytes")
    if isinstance(inst.protocol_version, bool) or not isinstance(inst.protocol_version, int) \
            or inst.protocol_version < 1:
        raise ConfigInvalid.capabilities_invalid("protocol_version", "must be a positive integer")


@attrs.frozen
class PublishedCapabilities:
    """Everything a worker publishes about itself. Every field is required and checked."""

    device_uuids: tuple[bytes, ...]
    handle_kinds: frozenset[HandleKind]
    fabric_trial: FabricTrial
    transports: tuple[TransportCapabilities, ...]
    geometry_fingerprint: bytes
    protocol_version: int

    def __attrs_post_init__(self) -> None:
        _check(self)

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready mapping that :func:`parse_capabilities` reads back."""
        return {
            "device_uuids": [u.hex() for u in self.device_uuids],
            "handle_kinds": sorted(k.value for k in self.handle_kinds),
            "fabric_trial": self.fabric_trial.value,
            "transports": [{
                "name": t.name,
                "handle_kinds": sorted(k.value for k in t.capabilities.handle_kinds),
                "memory_kinds": sorted(k.value for k in t.capabilities.memory_kinds),
                "scopes": sorted(s.value for s in t.capabilities.scopes),
            } for t in self.transports],
            "geometry_fingerprint": self.geometry_fingerprint.hex(),
            "protocol_version": self.protocol_version,
        }


FIELDS: tuple[str, ...] = tuple(a.name for a in attrs.fields(PublishedCapabilities))
#: Size caps of a published capability set (far above any real node).
MAX_DEVICES = 1024
MAX_TRANSPORTS = 64
MAX_CAPABILITIES_BYTES = 1 << 20
_TRANSPORT_FIELDS = ("name", "handle_kinds", "memory_kinds", "scopes")

_E = Any  # an enum class


def _enum_list(field: str, raw: Any, kind: _E) -> frozenset[Any]:
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise ConfigInvalid.capabilities_invalid(field, "must be a list of names")
    try:
        return frozenset(kind(v) for v in raw)
    except ValueError as exc:
        raise ConfigInvalid.capabilities_invalid(field, str(exc)) from None


def _hex(field: str, raw: Any) -> bytes:
    if not isinstance(raw, str):
        raise ConfigInvalid.capabilities_invalid(field, "must be hex text")
    try:
        return bytes.fromhex(raw)
    except ValueError:
        raise ConfigInvalid.capabilities_invalid(field, f"not hex: {raw!r}") from None


def parse_capabilities(wire: Mapping[str, Any]) -> PublishedCapabilities:
    """Accept a published capability set whole, or refuse it with a typed error.

    Missing fields raise :class:`ConfigInvalid` (CAPABILITIES_INCOMPLETE) naming all of them; an unknown,
    malformed or inconsistent field raises :class:`ConfigInvalid` (CAPABILITIES_INVALID).
    """
    if not isinstance(wire, Mapping):
        raise ConfigInvalid.capabilities_invalid("capabilities", "must be a mapping")
    missing = [f for f in FIELDS if f not in wire]
    if missing:
        raise ConfigInvalid.capabilities_incomplete(missing)
    unknown = sorted(set(wire) - set(FIELDS))
    if unknown:
        raise ConfigInvalid.capabilities_invalid(str(unknown[0]), "unknown capability field")
    if not isinstance(wire["device_uuids"], list):
        raise ConfigInvalid.capabilities_invalid("device_uuids", "must be a list of hex UUIDs")
    if len(wire["device_uuids"]) > MAX_DEVICES:
        raise ConfigInvalid.capabilities_invalid("device_uuids", f"more than {MAX_DEVICES} devices")
    if not isinstance(wire["transports"], list):
        raise ConfigInvalid.capabilities_invalid("transports", "must be a list")
    if len(wire["transports"]) > MAX_TRANSPORTS:
        raise ConfigInvalid.capabilities_invalid("transports", f"more than {MAX_TRANSPORTS} transports")
    transports = []
    for i, raw in enumerate(wire["transports"]):
        where = f"transports[{i}]"
        if not isinstance(raw, Mapping):
            raise ConfigInvalid.capabilities_invalid(where, "must be a mapping")
        t_missing = [f"{where}.{f}" for f in _TRANSPORT_FIELDS if f not in raw]
        if t_missing:
            raise ConfigInvalid.capabilities_incomplete(t_missing)
        t_unknown = sorted(set(raw) - set(_TRANSPORT_FIELDS))
        if t_unknown:
            raise ConfigInvalid.capabilities_invalid(f"{where}.{t_unknown[0]}", "unknown transport field")
        if not isinstance(raw["name"], str):
            raise ConfigInvalid.capabilities_invalid(f"{where}.name", "must be text")
        transports.append(TransportCapabilities(raw["name"], Capabilities(
            handle_kinds=_enum_list(f"{where}.handle_kinds", raw["handle_kinds"], HandleKind),
            memory_kinds=_enum_list(f"{where}.memory_kinds", raw["memory_kinds"], MemoryKind),
            scopes=_enum_list(f"{where}.scopes", raw["scopes"], Scope),
        )))
    if not isinstance(wire["fabric_trial"], str):
        raise ConfigInvalid.capabilities_invalid("fabric_trial", "must be text")
    try:
        trial = FabricTrial(wire["fabric_trial"])
    except ValueError:
        raise ConfigInvalid.capabilities_invalid("fabric_trial", f"unknown outcome {wire['fabric_trial']!r}") from None
    return PublishedCapabilities(
        device_uuids=tuple(_hex("device_uuids", u) for u in wire["device_uuids"]),
        handle_kinds=_enum_list("handle_kinds", wire["handle_kinds"], HandleKind),
        fabric_trial=trial,
        transports=tuple(transports),
        geometry_fingerprint=_hex("geometry_fingerprint", wire["geometry_fingerprint"]),
        protocol_version=wire["protocol_version"],
    )


# -- admission -----------------------------------------------------------------------


class Rule(enum.Enum):
    """The admission rules; a refusal names the ones that failed."""

    PROTOCOL_VERSION = "protocol_version"
    HOST_MEMFD_TRANSPORT = "host_memfd_transport"
    DEVICE_SAME_NODE_TRANSPORT = "device_same_node_transport"
    DEVICE_FABRIC_TRANSPORT = "device_fabric_transport"
    FABRIC_TRIAL_PASSED = "fabric_trial_passed"
    CROSS_NODE_NIXL_TRANSPORT = "cross_node_nixl_transport"


@attrs.frozen
class Refusal:
    rule: Rule
    detail: str


@attrs.frozen
class Admitted:
    """The declared profile admitted these capabilities."""

    profile: DeploymentProfile
    capabilities: PublishedCapabilities
    #: whether GPU-resident sources may be used under this profile
    gpu_reuse_allowed: bool

    admitted = True


@attrs.frozen
class Refused:
    profile: DeploymentProfile
    reasons: tuple[Refusal, ...]

    admitted = False

    @property
    def rules(self) -> frozenset[Rule]:
        return frozenset(r.rule for r in self.reasons)


def _carries(caps: PublishedCapabilities, kinds: frozenset[HandleKind], memory: MemoryKind,
             scope: Scope | None) -> bool:
    """Some transport carries one of ``kinds`` that is also published, over ``memory``."""
    for t in caps.transports:
        c = t.capabilities
        if (c.handle_kinds & kinds & caps.handle_kinds and memory in c.memory_kinds
                and (scope is None or scope in c.scopes)):
            return True
    return False


def _rules(profile: DeploymentProfile, caps: PublishedCapabilities) -> list[tuple[Rule, bool, str]]:
    """(rule, holds, what it requires) for every rule of ``profile``."""
    rules = [(Rule.PROTOCOL_VERSION, caps.protocol_version == PROTOCOL_VERSION,
              f"protocol version {PROTOCOL_VERSION}, published {caps.protocol_version}")]
    if profile is DeploymentProfile.HOST_LOCAL:
        rules.append((Rule.HOST_MEMFD_TRANSPORT,
                      _carries(caps, frozenset({HandleKind.MEMFD}), MemoryKind.HOST, Scope.SAME_NODE),
                      "a same-node host-memory transport with memfd handles"))
    elif profile is DeploymentProfile.GPU_SINGLE_NODE:
        rules.append((Rule.DEVICE_SAME_NODE_TRANSPORT,
                      _carries(caps, frozenset({HandleKind.POSIX_FD, HandleKind.CUDA_IPC}), MemoryKind.DEVICE,
                               Scope.SAME_NODE),
                      "a same-node device-memory transport with posix_fd or cuda_ipc handles"))
    elif profile is DeploymentProfile.GPU_FABRIC:
        rules.append((Rule.DEVICE_FABRIC_TRANSPORT,
                      _carries(caps, frozenset({HandleKind.FABRIC}), MemoryKind.DEVICE, None),
                      "a device-memory transport with fabric handles"))
        rules.append((Rule.FABRIC_TRIAL_PASSED, caps.fabric_trial is FabricTrial.PASSED,
                      f"a FABRIC trial that passed, published {caps.fabric_trial.value}"))
    else:
        rules.append((Rule.CROSS_NODE_NIXL_TRANSPORT,
                      any(HandleKind.NIXL in t.capabilities.handle_kinds and Scope.CROSS_NODE in t.capabilities.scopes
                          for t in caps.transports) and HandleKind.NIXL in caps.handle_kinds,
                      "a cross-node transport with nixl handles"))
    return rules


def _gpu_allowed(profile: DeploymentProfile, caps: PublishedCapabilities) -> bool:
    if profile in (DeploymentProfile.GPU_SINGLE_NODE, DeploymentProfile.GPU_FABRIC):
        return True
    if profile is DeploymentProfile.CROSS_NODE_NIXL:
        return _carries(caps, frozenset({HandleKind.NIXL}), MemoryKind.DEVICE, Scope.CROSS_NODE)
    return False


def admit(profile: DeploymentProfile, capabilities: PublishedCapabilities) -> Admitted | Refused:
    """Check ``capabilities`` against every rule of ``profile``; all failures are listed."""
    if not isinstance(profile, DeploymentProfile):
        raise ConfigInvalid(ConfigReason.UNKNOWN_PROFILE, f"not a deployment profile: {profile!r}")
    if not isinstance(capabilities, PublishedCapabilities):
        raise ConfigInvalid.capabilities_invalid("capabilities",
                                                 "must be PublishedCapabilities (see parse_capabilities)")
    failed = tuple(Refusal(rule, f"requires {what}") for rule, holds, what in _rules(profile, capabilities)
                   if not holds)
    if failed:
        return Refused(profile, failed)
    return Admitted(profile, capabilities, _gpu_allowed(profile, capabilities))
