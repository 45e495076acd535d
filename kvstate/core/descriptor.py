"""Descriptors: the complete, versioned, authenticated record of one rank part. Pure.

Wire format (all lengths checked before anything is parsed)::

    b"KVSD" | version: u8 | body length: u32 LE | body | MAC: 32 bytes

``body`` is canonical JSON (sorted keys, no whitespace, ASCII with the shortest escapes,
integers only, bytes as lower-case hex, no duplicate keys, no lone surrogates): decoding
accepts a body only if it is byte for byte the re-encoding of what it decodes to. The geometry travels as its canonical text (:mod:`kvstate.core.geometry`),
which must parse and re-encode to itself. Version 2 replaced version 1's single block
shape (seven keys) by that text; version 1 descriptors are refused (VERSION). The MAC is keyed BLAKE2b (purpose ``DESCRIPTOR_MAC``) with the
deployment key over everything before it, so a descriptor from another deployment or a
tampered one fails authentication, and it is checked *before* the body is parsed.
Decoding is strict: exact key set, exact types, bounded sizes; every refusal is a
:class:`~kvstate.core.errors.DescriptorRejected` with a :class:`~kvstate.core.validate.RejectReason`.
"""

from __future__ import annotations

import functools
import hmac
import json
import struct
from collections.abc import Sequence
from typing import Any

import attrs

from kvstate.core.errors import DescriptorRejected, ConfigInvalid
from kvstate.core.geometry import MAX_CANONICAL, Geometry
from kvstate.core.handles import HandleKind
from kvstate.core.identity import UUID_BYTES, Deployment, FabricDomain, FabricKind, Purpose, digest
from kvstate.core.paths import MAX_SOCKET_PATH
from kvstate.core.reasons import RejectReason, ConfigReason

MAGIC = b"KVSD"
VERSION = 2
MAC_BYTES = 32
_HEAD = struct.Struct("<4sBI")

#: Hard cap on an encoded descriptor. The largest legitimate one carries a NIXL handle of
#: at most 64 KiB, hex-encoded in the body (128 KiB), a geometry of at most 128 KiB of
#: canonical text, and a few hundred bytes of fields.
MAX_DESCRIPTOR_BYTES = 288 * 1024

U64_MAX = (1 << 64) - 1


@attrs.frozen
class Descriptor:
    """One rank part of a group, as the exporter advertises it."""

    deployment_id: bytes        # the domain: which deployment's key authenticates it
    source_id: bytes            # the logical KV source (the exporting engine's group)
    fabric: FabricDomain
    host_boot_id: bytes
    device_uuid: bytes
    incarnation: bytes
    pid: int                    # the exporter process, for pidfd liveness on one node
    rank: int
    tp: int
    geometry: Geometry
    handle_kind: HandleKind
    handle: bytes
    size: int
    granularity: int
    generation: int
    expires_at_ns: int          # CLOCK_REALTIME, nanoseconds
    socket_path: str
    inventory_epoch: int
    version: int = VERSION

    def body(self) -> dict[str, Any]:
        return {
            "deployment_id": self.deployment_id.hex(), "source_id": self.source_id.hex(),
            "fabric_kind": self.fabric.kind.value, "fabric_name": self.fabric.name,
            "host_boot_id": self.host_boot_id.hex(), "device_uuid": self.device_uuid.hex(),
            "incarnation": self.incarnation.hex(), "pid": self.pid,
            "rank": self.rank, "tp": self.tp,
            "geometry": self.geometry.canonical(),
            "handle_kind": self.handle_kind.value, "handle": self.handle.hex(),
            "size": self.size, "granularity": self.granularity, "generation": self.generation,
            "expires_at_ns": self.expires_at_ns, "socket_path": self.socket_path,
            "inventory_epoch": self.inventory_epoch,
        }


def _canonical(body: dict[str, Any]) -> bytes:
    """The one byte form of a body: sorted keys, no whitespace, ASCII with JSON's
    shortest escapes. Strings must be valid Unicode (no lone surrogates)."""
    for key, value in body.items():
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise DescriptorRejected(RejectReason.MALFORMED, f"{key} holds a lone surrogate") from None
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def encode(desc: Descriptor, deployment: Deployment) -> bytes:
    if not isinstance(desc, Descriptor) or not isinstance(deployment, Deployment):
        raise DescriptorRejected(RejectReason.MALFORMED, f"encode takes a Descriptor and a Deployment, not "
                                 f"{type(desc).__name__} and {type(deployment).__name__}")
    body = _canonical(desc.body())
    signed = _HEAD.pack(MAGIC, desc.version, len(body)) + body
    out = signed + digest(Purpose.DESCRIPTOR_MAC, signed, key=deployment.key, size=MAC_BYTES)
    if len(out) > MAX_DESCRIPTOR_BYTES:
        raise DescriptorRejected(RejectReason.OVERSIZE, f"{len(out)} bytes > cap {MAX_DESCRIPTOR_BYTES}", desc.rank)
    return out


def decode(data: bytes, deployment: Deployment) -> Descriptor:
    """Authenticate, then parse strictly. Raises DescriptorRejected with one reason.

    The MAC is checked before a byte of the body is parsed. A body that authenticates is
    accepted only in its canonical form: the wire must equal the re-encoding of what it
    decodes to, byte for byte, so duplicate keys, whitespace, other escapes or key orders
    and lone surrogates are refused (MALFORMED), and one descriptor has one wire form."""
    if not isinstance(deployment, Deployment):
        raise DescriptorRejected(RejectReason.MALFORMED, f"decode needs a Deployment, not {type(deployment).__name__}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DescriptorRejected(RejectReason.MALFORMED, f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_DESCRIPTOR_BYTES:
        raise DescriptorRejected(RejectReason.OVERSIZE, f"{len(data)} bytes > cap {MAX_DESCRIPTOR_BYTES}")
    if len(data) < _HEAD.size + MAC_BYTES:
        raise DescriptorRejected(RejectReason.MALFORMED, f"{len(data)} bytes is shorter than any descriptor")
    magic, version, length = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise DescriptorRejected(RejectReason.MALFORMED, "bad magic")
    if version != VERSION:
        raise DescriptorRejected(RejectReason.VERSION, f"version {version}, this build speaks {VERSION}")
    if _HEAD.size + length + MAC_BYTES != len(data):
        raise DescriptorRejected(RejectReason.MALFORMED, "body length does not match the frame")
    signed, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
    expected = digest(Purpose.DESCRIPTOR_MAC, signed, key=deployment.key, size=MAC_BYTES)
    if not hmac.compare_digest(mac, expected):
        raise DescriptorRejected(RejectReason.AUTHENTICATION, "MAC does not verify with this deployment's key")
    raw = signed[_HEAD.size:]
    try:
        body = json.loads(raw.decode("ascii"), parse_constant=_no_constants, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: deep nesting
        raise DescriptorRejected(RejectReason.MALFORMED, f"body is not canonical JSON: {exc}") from None
    desc = _from_body(body)
    if _canonical(desc.body()) != raw:
        raise DescriptorRejected(RejectReason.MALFORMED, "body is not in canonical form (sorted keys, no "
                                 "whitespace, shortest escapes): one descriptor has one wire form", desc.rank)
    if desc.deployment_id != deployment.id:
        raise DescriptorRejected(RejectReason.DOMAIN, "descriptor names another deployment", desc.rank)
    return desc


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:40]!r}")  # JSON's last-one-wins would hide a field
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"non-finite constant {name}")


_FIELDS = {
    "deployment_id": "hex16", "source_id": "hex16", "fabric_kind": "str", "fabric_name": "str",
    "host_boot_id": "hex16", "device_uuid": "hex16", "incarnation": "hex16", "pid": "u32",
    "rank": "u32", "tp": "u32", "geometry": "geometry",
    "handle_kind": "str", "handle": "hex", "size": "u64", "granularity": "u64",
    "generation": "u64", "expires_at_ns": "u64", "socket_path": "str", "inventory_epoch": "u64",
}


def _field(body: dict[str, Any], key: str) -> Any:
    kind = _FIELDS[key]
    value = body[key]
    if kind in ("u32", "u64"):
        limit = (1 << 32) - 1 if kind == "u32" else U64_MAX
        if type(value) is not int or not 0 <= value <= limit:
            raise DescriptorRejected(RejectReason.MALFORMED, f"{key} must be an integer in 0..{limit}")
        return value
    if not isinstance(value, str):
        raise DescriptorRejected(RejectReason.MALFORMED, f"{key} must be a string")
    if kind == "geometry":
        if len(value) > MAX_CANONICAL:
            raise DescriptorRejected(RejectReason.OVERSIZE, f"geometry is longer than {MAX_CANONICAL} characters")
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise DescriptorRejected(RejectReason.MALFORMED, f"{key} holds a lone surrogate") from None
    if kind == "str":
        if len(value) > 4096:
            raise DescriptorRejected(RejectReason.OVERSIZE, f"{key} is longer than 4096 characters")
        return value
    if len(value) % 2 or value != value.lower():
        raise DescriptorRejected(RejectReason.MALFORMED, f"{key} must be lower-case hex")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise DescriptorRejected(RejectReason.MALFORMED, f"{key} must be lower-case hex") from None
    if kind == "hex16" and len(raw) != UUID_BYTES:
        raise DescriptorRejected(RejectReason.MALFORMED, f"{key} must be {UUID_BYTES} bytes")
    return raw


def _enum(cls: Any, key: str, value: str, reason: RejectReason) -> Any:
    try:
        return cls(value)
    except ValueError:
        raise DescriptorRejected(reason, f"unknown {key} {value!r}") from None


def _from_body(body: Any) -> Descriptor:
    if not isinstance(body, dict):
        raise DescriptorRejected(RejectReason.MALFORMED, "body must be a JSON object")
    if set(body) != set(_FIELDS):
        extra, missing = sorted(set(body) - set(_FIELDS)), sorted(set(_FIELDS) - set(body))
        raise DescriptorRejected(RejectReason.MALFORMED, f"unknown keys {extra}, missing keys {missing}")
    f = {key: _field(body, key) for key in _FIELDS}
    if len(f["socket_path"].encode()) > MAX_SOCKET_PATH:
        raise DescriptorRejected(RejectReason.OVERSIZE, "socket_path does not fit sun_path")
    try:
        geometry = Geometry.parse(f["geometry"])
    except ConfigInvalid as exc:
        if exc.reason is not ConfigReason.GEOMETRY:
            raise
        raise DescriptorRejected(RejectReason.MALFORMED, str(exc)) from None
    try:
        fabric = FabricDomain(_enum(FabricKind, "fabric_kind", f["fabric_kind"], RejectReason.MALFORMED),
                              f["fabric_name"])
    except ValueError as exc:  # attrs validators
        raise DescriptorRejected(RejectReason.MALFORMED, str(exc)) from None
    return Descriptor(
        deployment_id=f["deployment_id"], source_id=f["source_id"], fabric=fabric,
        host_boot_id=f["host_boot_id"], device_uuid=f["device_uuid"], incarnation=f["incarnation"],
        pid=f["pid"], rank=f["rank"], tp=f["tp"], geometry=geometry,
        handle_kind=_enum(HandleKind, "handle_kind", f["handle_kind"], RejectReason.HANDLE_KIND),
        handle=f["handle"], size=f["size"], granularity=f["granularity"], generation=f["generation"],
        expires_at_ns=f["expires_at_ns"], socket_path=f["socket_path"], inventory_epoch=f["inventory_epoch"],
    )


@functools.lru_cache(maxsize=1024)
def _decode_bytes(data: bytes, deployment: Deployment) -> Descriptor:
    return decode(data, deployment)


def decode_cached(data: bytes, deployment: Deployment) -> Descriptor:
    """:func:`decode`, remembering what it accepted: the same wire bytes under the same
    deployment (name and key) always decode to the same frozen Descriptor, so an importer
    that sees one group's descriptors again skips the MAC and the parse. Nothing is
    skipped that depends on time or on the importer: validation (expiry, generation,
    socket path, ...) runs on every import. Refusals are not remembered."""
    if type(data) is bytes:
        return _decode_bytes(data, deployment)
    return decode(data, deployment)


def decode_group(wire: Sequence[bytes], deployment: Deployment) -> tuple[list[Descriptor], list[DescriptorRejected]]:
    """Decode one group's descriptors, rank by rank, keeping every refusal (each names its
    rank: the wire position when the body could not say) so a group is refused whole."""
    descriptors: list[Descriptor] = []
    problems: list[DescriptorRejected] = []
    for i, data in enumerate(wire):
        try:
            descriptors.append(decode_cached(data, deployment))
        except DescriptorRejected as exc:
            exc.rank = i if exc.rank is None else exc.rank
            problems.append(exc)
    return descriptors, problems
