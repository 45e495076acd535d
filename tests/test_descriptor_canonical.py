"""Issue 14, class 8: canonical signed descriptors.

The MAC is checked before a byte of the body is parsed, and a body that authenticates
is accepted only in its one canonical form. The property: every wire ``decode`` accepts
equals ``encode`` of what it decoded, byte for byte, whatever an exporter holding the
deployment key signs (key order, whitespace, escapes, duplicate keys, number spellings,
lone surrogates).
"""

from __future__ import annotations

import json
import random
import struct

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.core.descriptor import MAC_BYTES, MAGIC, VERSION, decode, encode
from kvstate.core.errors import DescriptorRejected
from kvstate.core.identity import Purpose, digest
from kvstate.core.reasons import RejectReason
from support.descriptors import DEPLOYMENT, descriptor

HEAD = struct.Struct("<4sBI")


def signed(body: bytes, key: bytes = DEPLOYMENT.key) -> bytes:
    """A wire whose MAC verifies: what any holder of the deployment key can produce."""
    head = HEAD.pack(MAGIC, VERSION, len(body)) + body
    return head + digest(Purpose.DESCRIPTOR_MAC, head, key=key, size=MAC_BYTES)


def body_text(**changes: object) -> dict[str, object]:
    return descriptor(**changes).body()


def escape_all(text: str) -> str:
    return "".join(f"\\u{ord(c):04x}" for c in text)


@st.composite
def spellings(draw: st.DrawFn) -> bytes:
    """A JSON spelling of a valid body, canonical or not."""
    body = body_text(socket_path=draw(st.sampled_from(["/run/kvs/export.sock", "/tmp/x y/\u00e9.sock"])))
    keys = list(body)
    rnd = random.Random(draw(st.integers(0, 2**32)))
    if draw(st.booleans()):
        rnd.shuffle(keys)
    else:
        keys.sort()
    sep_item = draw(st.sampled_from([",", ", ", " ,", ",\n"]))
    sep_key = draw(st.sampled_from([":", ": ", " :"]))
    items = []
    for k in keys:
        v = json.dumps(body[k], ensure_ascii=draw(st.booleans()))
        if isinstance(body[k], int) and draw(st.integers(0, 9)) == 0:
            v = draw(st.sampled_from([f"{body[k]}.0", f"{body[k]}e0", f"0{body[k]}" if body[k] else "-0"]))
        if isinstance(body[k], str) and draw(st.integers(0, 9)) == 0:
            v = draw(st.sampled_from(['"' + escape_all(body[k][:3]) + json.dumps(body[k])[4:], '"\\ud800"',
                                      json.dumps(body[k]).replace("/", "\\/")]))
        items.append(json.dumps(k) + sep_key + v)
    if draw(st.integers(0, 4)) == 0:  # a duplicate key, first or last
        k = draw(st.sampled_from(keys))
        dup = json.dumps(k) + sep_key + json.dumps(body[k])
        items.insert(draw(st.sampled_from([0, len(items)])), dup)
    text = draw(st.sampled_from(["", " ", "\n"])) + "{" + sep_item.join(items) + "}" + draw(st.sampled_from(["", " "]))
    return text.encode("utf-8", "surrogatepass")


@settings(max_examples=400, deadline=None)
@given(spellings())
def test_every_accepted_wire_is_its_own_reencoding(body: bytes) -> None:
    wire = signed(body)
    try:
        d = decode(wire, DEPLOYMENT)
    except DescriptorRejected as exc:
        assert exc.reason in (RejectReason.MALFORMED, RejectReason.OVERSIZE), exc
        return
    assert encode(d, DEPLOYMENT) == wire, f"accepted a non-canonical wire: {body[:200]!r}"


@settings(max_examples=100, deadline=None)
@given(rank=st.integers(0, 7), generation=st.integers(0, 2**64 - 1), epoch=st.integers(0, 2**64 - 1),
       path=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1,
                    max_size=40))
def test_valid_descriptors_round_trip_byte_for_byte(rank: int, generation: int, epoch: int, path: str) -> None:
    d = descriptor(rank=rank, tp=8, generation=generation, inventory_epoch=epoch, socket_path="/" + path)
    try:
        wire = encode(d, DEPLOYMENT)
    except DescriptorRejected:
        return  # too long for sun_path is refused on decode; nothing to round-trip
    assert encode(decode(wire, DEPLOYMENT), DEPLOYMENT) == wire


@pytest.mark.parametrize("name, body", [
    ("duplicate key, last wins", lambda b: b[:-1] + b',"rank":1}'),
    ("duplicate key, first", lambda b: b'{"rank":1,' + b[1:]),
    ("whitespace", lambda b: b.replace(b",", b", ", 1)),
    ("escaped letter", lambda b: b.replace(b'"deployment_id"', b'"\\u0064eployment_id"')),
    ("escaped slash", lambda b: b.replace(b'"/', b'"\\/', 1)),
    ("key order", lambda b: json.dumps(dict(reversed(list(json.loads(b).items()))), separators=(",", ":")).encode()),
    ("float for int", lambda b: b.replace(b'"rank":0', b'"rank":0.0')),
    ("lone surrogate", lambda b: b.replace(b'"fabric_name":"node-a"', b'"fabric_name":"\\ud800"')),
])
def test_each_non_canonical_spelling_is_refused(name: str, body: object) -> None:
    canonical = json.dumps(body_text(), sort_keys=True, separators=(",", ":")).encode()
    assert decode(signed(canonical), DEPLOYMENT) is not None
    spelt = body(canonical)  # type: ignore[operator]
    assert spelt != canonical
    with pytest.raises(DescriptorRejected) as info:
        decode(signed(spelt), DEPLOYMENT)
    assert info.value.reason is RejectReason.MALFORMED, name


def test_mac_is_checked_before_the_body_is_parsed() -> None:
    """A body that would break any parser (deep nesting, invalid UTF-8, not JSON) under a
    MAC of another key is refused as AUTHENTICATION: nothing of it was parsed."""
    for junk in (b"[" * 100_000, b"\xff\xfe", b"not json", b'{"rank":1,"rank":2}'):
        with pytest.raises(DescriptorRejected) as info:
            decode(signed(junk, key=bytes(32)), DEPLOYMENT)
        assert info.value.reason is RejectReason.AUTHENTICATION


def test_a_lone_surrogate_is_refused_when_encoding_too() -> None:
    with pytest.raises(DescriptorRejected) as info:
        encode(attrs.evolve(descriptor(), socket_path="/tmp/\ud800.sock"), DEPLOYMENT)
    assert info.value.reason is RejectReason.MALFORMED
    for bad in (None, "x", b"x"):
        with pytest.raises(DescriptorRejected):
            encode(bad, DEPLOYMENT)  # type: ignore[arg-type]
        with pytest.raises(DescriptorRejected):
            decode(b"x" * 64, bad)  # type: ignore[arg-type]
