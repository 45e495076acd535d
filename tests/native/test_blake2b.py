"""The lease thread's BLAKE2b (ffi/kvs_blake2b.c, RFC 7693) against Python's hashlib: the
TCP handshake's MAC is computed by one on each side, so they must agree on every length
around the 128-byte block edges, keyed and not, personalised and not."""

from __future__ import annotations

import hashlib

import pytest

from kvstate.core.identity import Purpose

pytestmark = pytest.mark.native


@pytest.mark.parametrize("keylen", [0, 1, 32, 64])
@pytest.mark.parametrize("datalen", [0, 1, 70, 127, 128, 129, 255, 256, 257, 1000])
@pytest.mark.parametrize("person", [b"", Purpose.CHANNEL_AUTH.value, b"short"])
@pytest.mark.parametrize("size", [1, 32, 64])
def test_kvs_blake2b_is_hashlibs(keylen: int, datalen: int, person: bytes, size: int) -> None:
    from kvstate._native import ffi, lib

    key = bytes((7 * i + keylen) % 256 for i in range(keylen))
    data = bytes((13 * i + datalen) % 256 for i in range(datalen))
    out = ffi.new("uint8_t[]", size)
    assert lib.kvs_blake2b(out, size, key, keylen, person, len(person), data, datalen) == lib.KVS_OK
    want = hashlib.blake2b(data, digest_size=size, key=key, person=person).digest()
    assert bytes(out) == want


def test_kvs_blake2b_refuses_what_blake2b_cannot_be() -> None:
    from kvstate._native import ffi, lib

    out = ffi.new("uint8_t[]", 65)
    assert lib.kvs_blake2b(out, 65, b"", 0, b"", 0, b"", 0) == lib.KVS_E_INVAL  # digest over 64 bytes
    assert lib.kvs_blake2b(out, 32, bytes(65), 65, b"", 0, b"", 0) == lib.KVS_E_INVAL  # key over 64 bytes
    assert lib.kvs_blake2b(out, 32, b"", 0, bytes(17), 17, b"", 0) == lib.KVS_E_INVAL  # person over 16
