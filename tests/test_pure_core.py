"""Identity, geometry, descriptors and validation: one test per rule, with real files."""

from __future__ import annotations

import os
import time

import attrs
import pytest

from support.errors import raises
from hypothesis import given
from hypothesis import strategies as st

from kvstate.core.errors import ArgumentInvalid
from kvstate.core.reasons import ArgumentReason
from kvstate.core.descriptor import MAX_DESCRIPTOR_BYTES, decode, encode
from kvstate.core.errors import DescriptorRejected, GroupRejected
from kvstate.core.geometry import DType, Geometry, Layout
from kvstate.core.handles import HandleKind
from kvstate.core.identity import Deployment, FabricDomain, FabricKind, Purpose, digest
from kvstate.core.reasons import RejectReason
from kvstate.core.validate import validate_group
from support.descriptors import DEPLOYMENT, GEOMETRY, descriptor, expectation, group, socket_dir


def test_digests_are_domain_separated_and_keyed() -> None:
    data = b"same bytes"
    assert digest(Purpose.GEOMETRY, data) != digest(Purpose.HOST, data)
    assert digest(Purpose.DESCRIPTOR_MAC, data, key=b"k1") != digest(Purpose.DESCRIPTOR_MAC, data, key=b"k2")


def test_every_purpose_has_its_own_personalisation() -> None:
    """Domain separation is unique: two purposes sharing a value would make one an alias
    of the other (an Enum folds equal values), so their digests would collide. Counted
    over every member name, aliases included, and every digest of the same bytes differs."""
    names = Purpose.__members__
    assert len({p.value for p in names.values()}) == len(names) == len(list(Purpose))
    assert all(0 < len(p.value) <= 16 for p in Purpose)  # BLAKE2b's personalisation limit
    data = b"same bytes"
    assert len({digest(p, data) for p in Purpose}) == len(names)


def test_deployment_repr_hides_key() -> None:
    assert DEPLOYMENT.key.hex() not in repr(DEPLOYMENT)


def _uniform(layout: Layout = Layout.BLOCK_MAJOR, *, layers: int = 2, head_dim: int = 8, num_blocks: int = 16,
             dtype: DType = DType.BF16) -> Geometry:
    return Geometry.uniform(layers=layers, kv_heads=2, head_dim=head_dim, block_tokens=4, dtype=dtype,
                            layout=layout, num_blocks=num_blocks)


def test_geometry_fingerprint_is_stable_and_covers_capacity() -> None:
    # The fingerprint covers every field, capacity included; the format fingerprint is
    # what a block holds, whatever the bank's capacity.
    other = _uniform(num_blocks=999)
    assert GEOMETRY.fingerprint() != other.fingerprint()
    assert GEOMETRY.format_fingerprint() == other.format_fingerprint()
    # Same itemsize, different dtype: incompatible either way.
    fp16 = _uniform(dtype=DType.FP16)
    assert GEOMETRY.fingerprint() != fp16.fingerprint()
    assert GEOMETRY.format_fingerprint() != fp16.format_fingerprint()
    # Pinned value: the canonical text is part of the wire contract and must not drift.
    assert GEOMETRY.canonical() == "kv,bf16,16x2x2x4x2x8,0,256x128x64x16x8x1,0"
    assert GEOMETRY.fingerprint().hex() == digest(Purpose.GEOMETRY, GEOMETRY.canonical().encode(), size=16).hex()


@pytest.mark.parametrize("layout", list(Layout))
def test_block_extents_tile_the_bank_exactly(layout: Layout) -> None:
    g = _uniform(layout)
    extents = sorted(e for b in range(g.num_blocks) for e in g.block_extents(b))
    pos = 0
    for off, length in extents:
        assert off == pos
        pos += length
    assert pos == g.nbytes
    with raises(ArgumentInvalid, ArgumentReason.RANGE):  # fix the call (was an IndexError)
        g.block_extents(g.num_blocks)


def test_geometry_rejects_zero_dimensions() -> None:
    with pytest.raises(ValueError):
        _uniform(layers=0)


def test_descriptor_roundtrip() -> None:
    d = descriptor()
    assert decode(encode(d, DEPLOYMENT), DEPLOYMENT) == d


@given(st.integers(0, 2**32 - 1), st.integers(1, 2**32 - 1), st.binary(min_size=0, max_size=64),
       st.integers(0, 2**64 - 1), st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=40))
def test_descriptor_roundtrip_any_values(rank: int, tp: int, handle: bytes, gen: int, fabric: str) -> None:
    d = descriptor(rank=rank, tp=tp, handle=handle, generation=gen, fabric=FabricDomain(FabricKind.NVLINK, fabric))
    assert decode(encode(d, DEPLOYMENT), DEPLOYMENT) == d


def test_tampered_descriptor_fails_authentication() -> None:
    wire = bytearray(encode(descriptor(), DEPLOYMENT))
    i = wire.index(b'"rank":0') + 7
    wire[i] = ord("1")
    with pytest.raises(DescriptorRejected) as info:
        decode(bytes(wire), DEPLOYMENT)
    assert info.value.reason is RejectReason.AUTHENTICATION


def test_other_deployment_fails_authentication() -> None:
    other = Deployment("test-deployment", bytes(32))
    with pytest.raises(DescriptorRejected) as info:
        decode(encode(descriptor(), DEPLOYMENT), other)
    assert info.value.reason is RejectReason.AUTHENTICATION


def test_right_key_but_foreign_domain_is_rejected() -> None:
    other = Deployment("another", DEPLOYMENT.key)
    with pytest.raises(DescriptorRejected) as info:
        decode(encode(descriptor(), DEPLOYMENT), other)
    assert info.value.reason is RejectReason.DOMAIN


@pytest.mark.parametrize(("wire", "reason"), [
    (b"", RejectReason.MALFORMED),
    (b"x" * (MAX_DESCRIPTOR_BYTES + 1), RejectReason.OVERSIZE),
    (b"NOPE" + bytes(40), RejectReason.MALFORMED),
])
def test_garbage_is_rejected_with_a_reason(wire: bytes, reason: RejectReason) -> None:
    with pytest.raises(DescriptorRejected) as info:
        decode(wire, DEPLOYMENT)
    assert info.value.reason is reason


def test_wrong_version_is_rejected() -> None:
    wire = bytearray(encode(descriptor(), DEPLOYMENT))
    wire[4] = 9
    with pytest.raises(DescriptorRejected) as info:
        decode(bytes(wire), DEPLOYMENT)
    assert info.value.reason is RejectReason.VERSION


@given(st.binary(max_size=512))
def test_decode_never_crashes_on_bytes(data: bytes) -> None:
    with pytest.raises(DescriptorRejected):
        decode(data, DEPLOYMENT)


# -- group validation: one test per rule --------------------------------------------------


@pytest.fixture(scope="module")
def sock() -> str:
    return socket_dir()[1]


def reasons(parts: list, **expect: object) -> frozenset[RejectReason]:  # type: ignore[type-arg]
    with pytest.raises(GroupRejected) as info:
        validate_group(parts, expectation(**expect))
    return info.value.reasons


def reasons_or_none(parts: list, **expect: object) -> frozenset[RejectReason]:  # type: ignore[type-arg]
    try:
        validate_group(parts, expectation(**expect))
    except GroupRejected as exc:
        return exc.reasons
    return frozenset()


def test_valid_group_is_accepted_sorted(sock: str) -> None:
    parts = group(4, sock)
    g = validate_group(list(reversed(parts)), expectation())
    assert [d.rank for d in g.parts] == [0, 1, 2, 3] and g.tp == 4


def test_rank_rules(sock: str) -> None:
    parts = group(4, sock)
    assert reasons(parts[:3]) == {RejectReason.MISSING_RANK}
    assert RejectReason.DUPLICATE_RANK in reasons([*parts, parts[1]])
    assert RejectReason.RANK_RANGE in reasons([*parts[:3], attrs.evolve(parts[3], rank=7)])
    assert RejectReason.RANK_RANGE in reasons([*parts[:3], attrs.evolve(parts[3], rank=4)])  # rank == tp
    assert RejectReason.TP_SIZE in reasons(group(4, sock), max_tp=2)
    assert RejectReason.TP_SIZE in reasons([*parts[:3], attrs.evolve(parts[3], tp=8)])
    assert reasons([]) == {RejectReason.MISSING_RANK}


def test_geometry_rules(sock: str) -> None:
    parts = group(2, sock)
    odd = attrs.evolve(parts[1], geometry=_uniform(head_dim=16))
    assert RejectReason.GEOMETRY in reasons([parts[0], odd])
    assert RejectReason.GEOMETRY in reasons(parts, geometry_fingerprint=bytes(16))
    assert RejectReason.GEOMETRY in reasons(parts, block_format=bytes(16))
    assert not reasons_or_none(parts, geometry_fingerprint=GEOMETRY.fingerprint(),
                               block_format=_uniform(num_blocks=3).format_fingerprint())


def test_a_geometry_mismatch_in_a_group_names_the_field(sock: str) -> None:
    parts = group(2, sock)
    with pytest.raises(GroupRejected) as info:
        validate_group([parts[0], attrs.evolve(parts[1], geometry=_uniform(dtype=DType.FP16))], expectation())
    assert "regions[0] 'kv'.dtype: bf16 != fp16" in str(info.value)


def test_identity_rules(sock: str) -> None:
    parts = group(2, sock)
    assert reasons(parts, device_uuids=frozenset({bytes(16)})) == {RejectReason.DEVICE_UUID}
    assert reasons(parts, incarnations={0: parts[0].incarnation, 1: bytes(16)}) == {RejectReason.INCARNATION}
    assert not reasons_or_none(parts, incarnations={0: parts[0].incarnation, 1: parts[1].incarnation})
    assert reasons(parts, host_boot_id=bytes(16)) == {RejectReason.HOST}
    # An fd handle comes over a Unix socket: same-node whatever fabric its descriptor claims.
    claimed = [attrs.evolve(p, fabric=FabricDomain(FabricKind.NETWORK, "rdma")) for p in parts]
    assert reasons(claimed, host_boot_id=bytes(16)) == {RejectReason.HOST}
    assert RejectReason.MIXED_GROUP in reasons([parts[0], attrs.evolve(parts[1], source_id=bytes(16))])
    assert reasons([attrs.evolve(p, deployment_id=bytes(16)) for p in parts]) == {RejectReason.DOMAIN}


def test_staleness_rules(sock: str) -> None:
    """INV-STALE-REJECTED: old generation and expiry."""
    parts = group(2, sock)
    assert reasons(parts, min_generation=4) == {RejectReason.GENERATION}
    assert reasons(parts, now_ns=time.time_ns() + 3600 * 10**9) == {RejectReason.EXPIRED}
    at = parts[0].expires_at_ns  # expired from that very nanosecond on, not one later
    same = [attrs.evolve(p, expires_at_ns=at) for p in parts]
    assert reasons(same, now_ns=at) == {RejectReason.EXPIRED}
    assert not reasons_or_none(same, now_ns=at - 1)
    assert RejectReason.GENERATION in reasons([parts[0], attrs.evolve(parts[1], generation=9)])


def test_handle_and_size_rules(sock: str) -> None:
    parts = group(1, sock)
    assert reasons([attrs.evolve(parts[0], handle=bytes(15))]) == {RejectReason.HANDLE_SIZE}
    assert reasons(parts, handle_kinds=frozenset({HandleKind.FABRIC})) == {RejectReason.HANDLE_KIND}
    assert reasons([attrs.evolve(parts[0], size=parts[0].size + 4096)]) == {RejectReason.TOTAL_SIZE}
    assert reasons([attrs.evolve(parts[0], granularity=3000)]) == {RejectReason.TOTAL_SIZE}


def test_socket_path_rules() -> None:
    d, path = socket_dir()
    link = d.parent / f"{d.name}-link"
    link.symlink_to(d)
    try:
        assert reasons(group(1, str(link / "export.sock"))) == {RejectReason.SOCKET_SYMLINK}
        assert reasons(group(1, str(d / "absent.sock"))) == {RejectReason.SOCKET_PATH}
        assert reasons(group(1, "relative/export.sock")) == {RejectReason.SOCKET_PATH}
        assert reasons(group(1, path), uid=os.getuid() + 1) == {RejectReason.SOCKET_DIR_OWNER}
        d.chmod(0o750)
        assert reasons(group(1, path)) == {RejectReason.SOCKET_DIR_MODE}
    finally:
        d.chmod(0o700)
        link.unlink()


def test_group_rejection_lists_every_problem(sock: str) -> None:
    """INV-GROUP-ATOMIC: one bad part rejects the whole group, and every problem is reported."""
    parts = group(3, sock)
    bad = [parts[0], attrs.evolve(parts[1], handle=b""), attrs.evolve(parts[2], generation=0)]
    with pytest.raises(GroupRejected) as info:
        validate_group(bad, expectation(min_generation=2))
    assert {(p.reason, p.rank) for p in info.value.problems} >= {(RejectReason.HANDLE_SIZE, 1), (RejectReason.GENERATION, 2)}
