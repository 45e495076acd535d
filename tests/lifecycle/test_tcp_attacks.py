"""Attacks on the exporter's native TCP lease server (ffi/kvs_lease_tcp.c, issue 30): what
another node can send is parsed by C in the lease thread, so arbitrary bytes before the
handshake, wrong answers to the challenge, and, once authenticated, frames with any
header, any length and any payload (malformed and deeply nested JSON, huge numbers, cut
short) must each end at most that connection. After every example the same server still
answers a well-behaved importer, and holds no connection or handshake of the attacker.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstate import channel as chan
from kvstate.channel.framing import DEFAULT_MAX_PAYLOAD as MAX_PAYLOAD, HEADER, MAGIC
from kvstate.channel.tcp import connect_tcp, parse_address
from kvstate.core.errors import ChannelError
from kvstate.core.handles import HandleKind
from kvstate.core.identity import Deployment
from kvstate.share import status
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.transport.host import HostTransport

pytestmark = [pytest.mark.native]

KEY = Deployment("tcp-attacks", bytes(range(32)))
EXAMPLES = int(os.environ.get("KVSTATE_TCP_ATTACK_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def exporter() -> Iterator[Exporter]:  # type: ignore[type-arg]
    d = Path(tempfile.mkdtemp(prefix="kvs-tcpatk-"))
    d.chmod(0o700)
    ex = Exporter(ExportConfig(KEY, d, os.urandom(16), 1, tcp_listen=("127.0.0.1", 0), handle_kind=HandleKind.NIXL),
                  HostTransport(granularity=64 * 1024), name="attacked")
    ex.start()
    yield ex
    ex.stop()
    shutil.rmtree(d, ignore_errors=True)


def _still_serves(ex: Exporter) -> None:  # type: ignore[type-arg]
    """A well-behaved importer is answered, and nothing of the attacker stays."""
    with connect_tcp(ex.lease_address, KEY, timeout=10.0) as ch:
        ch.send(chan.encode(status.REQUEST), timeout=10.0)
        with ch.recv(timeout=10.0) as msg:
            assert chan.decode(msg.payload)["kind"] == "exporter"
    deadline = time.monotonic() + 10.0
    while (ex.connections(), ex.lease_server.handshakes()) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (ex.connections(), ex.lease_server.handshakes()) == (0, 0)


def _raw(ex: Exporter) -> socket.socket:  # type: ignore[type-arg]
    host, port = parse_address(ex.lease_address)
    s = socket.create_connection((host, port), timeout=10.0)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _send_in_pieces(s: socket.socket, data: bytes, cuts: list[int]) -> None:
    """``data`` in segments cut at ``cuts``; the server may close on us at any point."""
    at = 0
    try:
        for c in sorted(set(x % (len(data) + 1) for x in cuts)) + [len(data)]:
            if c > at:
                s.sendall(data[at:c])
                at = c
    except OSError:
        pass  # reset or closed by the server: what the attack may well earn


def _drain(s: socket.socket) -> bytes:
    """What the server says until it closes, or stops talking for a moment."""
    s.settimeout(0.2)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except OSError:
        pass
    return got


def _json_junk() -> st.SearchStrategy[bytes]:
    # Nesting inside a request object, up to a whole 64 KiB frame of it.
    nested = st.integers(1, 65_000).map(lambda n: b'{"op":' + b"[" * n)
    deep_obj = st.integers(1, 13_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n)
    numbers = st.sampled_from([b'{"op":"lease","rank":1e400}', b'{"op":"renew","rank":0,"lease":-1}',
                               b'{"op":"renew","rank":0,"lease":18446744073709551616}',
                               b'{"op":"status","x":"\\ud800"}', b'{"op":"\x00"}', b'{"op":"lease"', b"null",
                               b'{"op":"lease","rank":0,"incarnation":"' + b"A" * 60000 + b'"}'])
    return st.one_of(st.binary(max_size=4096), nested, deep_obj, numbers)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(max_size=2048), cuts=st.lists(st.integers(0, 4096), max_size=6), read_challenge=st.booleans())
def test_bytes_before_the_handshake_end_only_that_connection(exporter: Exporter, junk: bytes,  # type: ignore[type-arg]
                                                             cuts: list[int], read_challenge: bool) -> None:
    s = _raw(exporter)
    try:
        if read_challenge:
            s.recv(HEADER.size + 32)
        _send_in_pieces(s, junk, cuts)
        _drain(s)
    finally:
        s.close()
    _still_serves(exporter)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(magic_ok=st.booleans(), length=st.one_of(st.integers(0, 70_000), st.integers(0, 2**32 - 1)),
       nfds=st.integers(0, 2**16 - 1), payload=_json_junk(), cuts=st.lists(st.integers(0, 300_000), max_size=6),
       then_valid=st.booleans())
@example(magic_ok=True, length=65_000, nfds=0, payload=b'{"op":' + b"[" * (65_000 - 6), cuts=[],
         then_valid=True)  # the deepest nesting one frame can carry, sent whole
@example(magic_ok=True, length=1000, nfds=0, payload=b'{"op":"st', cuts=[3], then_valid=False)  # the rest never comes
def test_any_frame_after_the_handshake_ends_at_most_that_connection(
        exporter: Exporter, magic_ok: bool, length: int, nfds: int,  # type: ignore[type-arg]
        payload: bytes, cuts: list[int], then_valid: bool) -> None:
    """The header says ``length`` (true or not); the payload follows, whole or cut; a
    valid request may follow on the same connection: it is answered or the connection
    was closed, never a crash or a hang of the server. A frame not yet whole is never
    answered: the server waits for the rest."""
    ch = connect_tcp(exporter.lease_address, KEY, timeout=10.0)
    try:
        header = HEADER.pack(MAGIC if magic_ok else b"XXXX", length, nfds)
        _send_in_pieces(ch._sock, header + payload, cuts)
        if then_valid:
            req = chan.encode(status.REQUEST)
            _send_in_pieces(ch._sock, HEADER.pack(MAGIC, len(req), 0) + req, [])
        said = _drain(ch._sock)
        if not then_valid and magic_ok and nfds == 0 and length <= MAX_PAYLOAD and len(payload) < length:
            assert said == b"", f"answered a frame of {length} bytes after {len(payload)}: {said[:80]!r}"
    except ChannelError:
        pass
    finally:
        ch.close()
    _still_serves(exporter)


def test_the_attacks_reach_the_native_parser(exporter: Exporter) -> None:  # type: ignore[type-arg]
    """The checker is live: a malformed request on an authenticated connection is
    answered by the native server (refused, with a reason), not silently dropped."""
    with connect_tcp(exporter.lease_address, KEY, timeout=10.0) as ch:
        bad = b'{"op":"renew","rank":0,"lease":1}'
        ch._sock.sendall(HEADER.pack(MAGIC, len(bad), 0) + bad)
        with ch.recv(timeout=10.0) as msg:
            answer = chan.decode(msg.payload)
        assert answer["ok"] is False and answer.get("code") == "unknown_rank", answer
