"""The NIXL handle bytes: strict, canonical, bounded. Pure: no NIXL needed.

INV-REJECT-BEFORE-OPEN: malformed bytes are refused by the decoder, before NIXL sees them.
INV-STALE-REJECTED: a record of an older generation is refused.
"""

from __future__ import annotations

import struct

import pytest

from support.errors import raises
from hypothesis import given
from hypothesis import strategies as st

from kvstate.core.errors import KvStateError, ImportFailed
from kvstate.core.reasons import ImportReason
from kvstate.core.handles import NIXL_HANDLE_MAX_BYTES
from kvstate.core.capabilities import MemoryKind
from kvstate.transport.nixl.handle import (
    HEADER_BYTES,
    MAX_AGENT_NAME,
    MAX_REGIONS,
    NixlHandle,
    HandleDefect,
    RemoteRegion,
    decode,
    encode,
)

GOOD = NixlHandle(agent_name="kvstate-12-ab", metadata=b"nixlSerDes|Agent...",
                  regions=(RemoteRegion(0x7F00_0000_0000, 1 << 26),), generation=5)


def _reason(data: bytes, **kw: int) -> HandleDefect:
    with raises(ImportFailed, ImportReason.HANDLE) as exc:
        decode(data, **kw)
    return exc.value.defect  # type: ignore[no-any-return]


names = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:@-",
                min_size=1, max_size=MAX_AGENT_NAME)


@st.composite
def handles(draw: st.DrawFn) -> NixlHandle:
    n = draw(st.integers(1, 6))
    addr = draw(st.integers(0, 1 << 40))
    regions = []
    for _ in range(n):
        addr += draw(st.integers(0, 1 << 20))
        length = draw(st.integers(1, 1 << 30))
        regions.append(RemoteRegion(addr, length, draw(st.integers(0, 7))))
        addr += length
    return NixlHandle(agent_name=draw(names), metadata=draw(st.binary(min_size=1, max_size=512)),
                      regions=tuple(regions), generation=draw(st.integers(0, (1 << 64) - 1)),
                      memory=draw(st.sampled_from(MemoryKind)))


@given(handles())
def test_round_trip_is_canonical(h: NixlHandle) -> None:
    data = encode(h)
    assert decode(data, generation=h.generation) == h
    assert encode(decode(data)) == data


@given(handles(), st.data())
def test_every_strict_prefix_and_any_suffix_is_rejected(h: NixlHandle, data: st.DataObject) -> None:
    raw = encode(h)
    cut = data.draw(st.integers(0, len(raw) - 1))
    assert _reason(raw[:cut]) is HandleDefect.TRUNCATED
    assert _reason(raw + data.draw(st.binary(min_size=1, max_size=16))) is HandleDefect.TRAILING


@given(handles(), st.data())
def test_mutations_are_rejected_or_decode_canonically(h: NixlHandle, data: st.DataObject) -> None:
    """A flipped byte either yields a typed rejection or another valid, canonical record."""
    raw = bytearray(encode(h))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    try:
        out = decode(bytes(raw))
    except ImportFailed as exc:
        if exc.reason is not ImportReason.HANDLE:
            raise
        return
    assert encode(out) == bytes(raw)


@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_crash(raw: bytes) -> None:
    try:
        decode(raw)
    except KvStateError:
        pass


def test_each_rule_has_its_reason() -> None:
    raw = encode(GOOD)
    header = list(struct.unpack_from("<4sBBHQHII", raw))

    def with_header(**changes: int | bytes) -> bytes:
        fields = dict(zip(["magic", "version", "memory", "flags", "gen", "name", "md", "n"], header))
        fields.update(changes)
        return struct.pack("<4sBBHQHII", *fields.values()) + raw[HEADER_BYTES:]

    assert _reason(with_header(magic=b"KVNY")) is HandleDefect.MAGIC
    assert _reason(with_header(version=2)) is HandleDefect.VERSION
    assert _reason(with_header(memory=2)) is HandleDefect.MEMORY_KIND
    assert _reason(with_header(flags=1)) is HandleDefect.FLAGS
    assert _reason(with_header(md=0)) is HandleDefect.METADATA
    assert _reason(with_header(n=0)) is HandleDefect.REGIONS
    assert _reason(with_header(n=MAX_REGIONS + 1)) is HandleDefect.REGIONS
    assert _reason(b"\0" * (NIXL_HANDLE_MAX_BYTES + 1)) is HandleDefect.TOO_LONG
    assert _reason(raw[:HEADER_BYTES - 1]) is HandleDefect.TRUNCATED
    assert _reason(raw, generation=4) is HandleDefect.GENERATION  # newer than its descriptor says
    with raises(ImportFailed, ImportReason.HANDLE, defect=HandleDefect.STALE_GENERATION):
        decode(raw, generation=6)  # a record older than the descriptor's generation


@pytest.mark.parametrize("handle", [
    NixlHandle("", b"m", (RemoteRegion(0, 1),), 0),
    NixlHandle("a b", b"m", (RemoteRegion(0, 1),), 0),
    NixlHandle("ü", b"m", (RemoteRegion(0, 1),), 0),
    NixlHandle("a" * (MAX_AGENT_NAME + 1), b"m", (RemoteRegion(0, 1),), 0),
    NixlHandle("a", b"", (RemoteRegion(0, 1),), 0),
    NixlHandle("a", b"m", (), 0),
    NixlHandle("a", b"m", (RemoteRegion(0, 0),), 0),
    NixlHandle("a", b"m", (RemoteRegion(100, 10), RemoteRegion(105, 10)), 0),  # overlap
    NixlHandle("a", b"m", (RemoteRegion(200, 10), RemoteRegion(100, 10)), 0),  # unsorted
    NixlHandle("a", b"m", ((RemoteRegion((1 << 64) - 4, 8)),), 0),  # wraps
    NixlHandle("a", b"m", (RemoteRegion(0, 1, 1 << 32),), 0),  # device id beyond u32
    NixlHandle("a", b"m", (RemoteRegion(0, 1),), -1),
    NixlHandle("a", b"m" * NIXL_HANDLE_MAX_BYTES, (RemoteRegion(0, 1),), 0),  # oversize record
])
def test_encode_refuses_what_decode_would_refuse(handle: NixlHandle) -> None:
    with raises(ImportFailed, ImportReason.HANDLE):
        encode(handle)


def test_region_rules_apply_to_decoded_bytes() -> None:
    """Overlapping regions smuggled past encode (packed by hand) are refused on decode."""
    raw = bytearray(encode(NixlHandle("a", b"m", (RemoteRegion(100, 10), RemoteRegion(200, 10)), 0)))
    struct.pack_into("<Q", raw, len(raw) - 20, 105)  # second region now starts inside the first
    assert _reason(bytes(raw)) is HandleDefect.REGIONS
