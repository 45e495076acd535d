"""The control channel across nodes (kvstate.channel.tcp), on loopback: frames, the mutual
deployment handshake, and the end of a connection seen as the end of its peer."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.errors import raises

from kvstate import channel as chan
from kvstate.core.reasons import ChannelReason
from kvstate.channel.framing import HEADER, MAGIC
from kvstate.channel.tcp import FRAME_GRACE_S, TcpServer, connect_tcp, parse_address
from kvstate.core.errors import ChannelError, ConfigInvalid
from kvstate.core.handles import HandleKind
from kvstate.core.identity import Deployment
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.transport.host import HostTransport

KEY = Deployment("tcp-tests", bytes(range(32)))
OTHER = Deployment("tcp-tests", bytes(range(1, 33)))


class Echo:
    """A server that answers each frame with the same payload reversed."""

    def __init__(self, deployment: Deployment = KEY) -> None:
        self.server = TcpServer("127.0.0.1", 0, deployment, handshake_timeout=2.0)
        self.served = 0
        self.done = threading.Event()
        self.server.serve_in_thread(self.handle)

    def handle(self, ch: chan.Channel) -> None:
        self.served += 1
        try:
            while True:
                with ch.recv(timeout=5.0) as msg:
                    ch.send(msg.payload[::-1], timeout=5.0)
        except ChannelError:
            pass
        finally:
            ch.close()
            self.done.set()


@pytest.fixture
def echo() -> Iterator[Echo]:
    e = Echo()
    yield e
    e.server.close()


def test_frames_cross_both_ways_whole(echo: Echo) -> None:
    ch = connect_tcp(echo.server.address, KEY, timeout=5.0)
    try:
        for payload in (b"x", b"lease" * 1000, bytes(range(256)) * 200):
            ch.send(payload, timeout=5.0)
            with ch.recv(timeout=5.0) as msg:
                assert msg.payload == payload[::-1] and msg.fds == ()
        with raises(ChannelError, ChannelReason.FRAME, match="cannot cross nodes"):
            ch.send(b"fd", [0], timeout=1.0)
        with raises(ChannelError, ChannelReason.FRAME, match="exceeds the cap"):
            ch.send(bytes(chan.DEFAULT_MAX_PAYLOAD + 1), timeout=1.0)
    finally:
        ch.close()
    assert echo.done.wait(5.0) and echo.served == 1


def test_a_client_without_the_key_is_refused_before_any_frame(echo: Echo) -> None:
    with raises(ChannelError, (ChannelReason.UNAUTHENTICATED, ChannelReason.CLOSED)):
        connect_tcp(echo.server.address, OTHER, timeout=5.0)
    time.sleep(0.1)
    assert echo.served == 0  # the handler never saw it


def test_a_server_without_the_key_is_refused_by_the_client() -> None:
    impostor = Echo(OTHER)
    try:
        with raises(ChannelError, (ChannelReason.UNAUTHENTICATED, ChannelReason.CLOSED)):
            connect_tcp(impostor.server.address, KEY, timeout=5.0)
        assert impostor.served == 0
    finally:
        impostor.server.close()


def test_the_peers_end_is_eof_and_the_watcher_sees_it() -> None:
    """Leases are bound to their connection across nodes too: the importer's side sees the
    exporter's end of the connection (no pidfd across nodes: the socket's hang-up)."""
    def answer_once_then_hang_up(ch: chan.Channel) -> None:
        with ch.recv(timeout=5.0) as msg:
            ch.send(msg.payload, timeout=5.0)
        ch.close()

    server = TcpServer("127.0.0.1", 0, KEY)
    server.serve_in_thread(answer_once_then_hang_up)
    ch = connect_tcp(server.address, KEY, timeout=5.0)
    seen = threading.Event()
    try:
        with chan.Watcher(name="tcp-test-watch") as watcher:
            watcher.watch(ch, lambda c: seen.set())
            ch.send(b"bye", timeout=5.0)
            with ch.recv(timeout=5.0) as msg:
                assert msg.payload == b"bye"
            assert seen.wait(5.0) and not ch.closed  # seen from the peer's side, not ours
            with raises(ChannelError, ChannelReason.CLOSED):
                ch.recv(timeout=5.0)
    finally:
        ch.close()
        server.close()


def test_eof_mid_conversation_is_channel_closed() -> None:
    server = TcpServer("127.0.0.1", 0, KEY)
    server.serve_in_thread(lambda ch: ch.close())  # hangs up right after the handshake
    try:
        ch = connect_tcp(server.address, KEY, timeout=5.0)
        with raises(ChannelError, ChannelReason.CLOSED):
            ch.recv(timeout=5.0)
        ch.close()
    finally:
        server.close()


@pytest.mark.parametrize("address", ["unix:///tmp/x", "tcp://", "tcp://host", "tcp://host:0", "tcp://host:99999",
                                     "tcp://:80", "tcp://host:8o", "tcp://host:\u00b2", "tcp://host:\u0663"])
def test_malformed_addresses_are_refused(address: str) -> None:
    with pytest.raises(ChannelError):
        parse_address(address)
    assert parse_address("tcp://127.0.0.1:4000") == ("127.0.0.1", 4000)


# -- hostile and unlucky peers (an adversarial review, stop 25) ----------------------------


def test_a_peer_that_resets_before_the_accept_leaves_the_server_accepting() -> None:
    """No key needed: a connect then a reset (SO_LINGER 0) before the accept made
    getpeername() fail in the accept loop, which died; the server never accepted again."""
    server = TcpServer("127.0.0.1", 0, KEY, handshake_timeout=1.0, max_connections=4)
    server.serve_in_thread(lambda ch: ch.close())
    host, port = parse_address(server.address)
    try:
        for _ in range(100):
            s = socket.create_connection((host, port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        time.sleep(0.3)
        assert server._thread is not None and server._thread.is_alive(), "the accept loop died"
        for _ in range(5):  # more than max_connections: every refused peer's slot came back
            connect_tcp(server.address, KEY, timeout=2.0).close()
    finally:
        server.close()


def _serve_one(handler: object) -> tuple[socket.socket, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))
    t = threading.Thread(target=handler, args=(listener,), daemon=True)
    t.start()
    return listener, t


def test_a_dripping_server_cannot_stretch_the_callers_timeout() -> None:
    """A frame that has begun gets FRAME_GRACE_S past the caller's timeout, not 5 s."""
    stop = threading.Event()

    def drip(listener: socket.socket) -> None:
        c, _ = listener.accept()
        with c:
            for b in HEADER.pack(MAGIC, 32, 0) + os.urandom(32):  # a challenge, a byte at a time
                if stop.wait(0.3):
                    return
                c.send(bytes([b]))

    listener, t = _serve_one(drip)
    started = time.monotonic()
    try:
        with pytest.raises(ChannelError):
            connect_tcp(f"tcp://127.0.0.1:{listener.getsockname()[1]}", KEY, timeout=1.0)
        assert time.monotonic() - started < 1.0 + FRAME_GRACE_S + 0.5
    finally:
        stop.set()
        t.join(5)
        listener.close()


def test_a_frame_cut_short_by_a_timeout_closes_the_channel() -> None:
    """The rest of a half-read frame must never be read as a frame of its own: a receive
    that times out mid-frame closes the channel, as a bad header does."""
    got: list[object] = []
    done = threading.Event()

    def handler(ch: chan.Channel) -> None:
        try:
            for _ in range(3):
                try:
                    with ch.recv(timeout=0.2) as msg:
                        got.append(msg.payload)
                except ChannelError as exc:
                    got.append(exc.reason.value)
                    if ch.closed:
                        return
        finally:
            ch.close()
            done.set()

    server = TcpServer("127.0.0.1", 0, KEY)
    server.serve_in_thread(handler)
    ch = connect_tcp(server.address, KEY, timeout=2.0)
    try:
        inner = HEADER.pack(MAGIC, 8, 0) + b"smuggled"
        ch._sock.sendall(HEADER.pack(MAGIC, 4 + len(inner), 0) + b"PAD!")  # a frame begun ...
        time.sleep(0.2 + FRAME_GRACE_S + 0.5)  # ... past the server's bound
        try:
            ch._sock.sendall(inner)  # its rest: itself a well-formed frame
        except OSError:
            pass  # the server closed already
        assert done.wait(5.0)
        assert got == ["timeout"], got  # not the whole frame late, nor its tail as a frame
    finally:
        ch.close()
        server.close()


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvs-tcp-"))
    d.chmod(0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _config(d: Path, listen: object, **kw: object) -> ExportConfig:
    return ExportConfig(KEY, d, os.urandom(16), 1, tcp_listen=listen, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("listen", "kind", "problem"), [
    (("127.0.0.1", 99999), HandleKind.NIXL, "port must be"),
    (("127.0.0.1", "0"), HandleKind.NIXL, "port must be"),
    (("127.0.0.1", True), HandleKind.NIXL, "port must be"),
    (("127.0.0.1",), HandleKind.NIXL, "tuple"),
    (["127.0.0.1", 0], HandleKind.NIXL, "tuple"),
    ((b"127.0.0.1", 0), HandleKind.NIXL, "host must be"),
    (("h\u00f6st", 0), HandleKind.NIXL, "host must be"),
    (("0.0.0.0", 0), HandleKind.NIXL, "binds every interface"),
    (("::", 0), HandleKind.NIXL, "binds every interface"),
    (("127.0.0.1", 0), HandleKind.MEMFD, "cannot cross nodes"),     # fds travel over AF_UNIX only
    (("127.0.0.1", 0), HandleKind.POSIX_FD, "cannot cross nodes"),
])
def test_tcp_listen_is_checked_where_it_is_made(socket_dir: Path, listen: object, kind: HandleKind,
                                                problem: str) -> None:
    with pytest.raises(ConfigInvalid, match=problem):
        _config(socket_dir, listen, handle_kind=kind)


def test_a_tcp_port_in_use_is_a_typed_error(socket_dir: Path) -> None:
    busy = socket.create_server(("127.0.0.1", 0))
    try:
        config = _config(socket_dir, ("127.0.0.1", busy.getsockname()[1]), handle_kind=HandleKind.NIXL)
        with pytest.raises(ChannelError, match="cannot listen"):
            Exporter(config, HostTransport(granularity=64 * 1024), name="busy")
    finally:
        busy.close()


def test_the_exporters_connection_limit_holds_over_tcp_too(socket_dir: Path) -> None:
    config = _config(socket_dir, ("127.0.0.1", 0), handle_kind=HandleKind.NIXL, max_connections=2)
    ex = Exporter(config, HostTransport(granularity=64 * 1024), name="limited")
    ex.start()
    chans: list[chan.Channel] = []
    try:
        chans += [connect_tcp(ex.lease_address, KEY, timeout=2.0) for _ in range(2)]
        with pytest.raises(ChannelError):  # refused: closed before the handshake
            chans.append(connect_tcp(ex.lease_address, KEY, timeout=2.0))
    finally:
        for c in chans:
            c.close()
        ex.stop()


FLOOD = """
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
socks = []
for i in range(n):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    socks.append(s)
print("connected", flush=True)
end = time.monotonic() + 30
while time.monotonic() < end and sys.stdin.readable():
    for s in socks[::2]:  # half of them drip a byte now and then; the others stay idle
        try:
            s.send(b"K")
        except OSError:
            pass
    time.sleep(0.2)
"""


@pytest.mark.parametrize("server", ["exporter", "tcp_server"])
def test_unauthenticated_peers_cannot_hold_the_servers_slots(socket_dir: Path, server: str) -> None:
    """1,000 idle or slow connections that never authenticate: they hold no thread and no
    served slot (their handshakes have a budget of their own), and a real peer is still
    served, again and again, while they stay connected. ``exporter``: the lease thread's
    native handshakes (ffi/kvs_lease_tcp.c), asked for its status; ``tcp_server``: the
    Python :class:`TcpServer` (the decode index's), an echo."""
    import subprocess
    import sys

    from kvstate.share import status

    ex = echo = None
    if server == "exporter":
        config = _config(socket_dir, ("127.0.0.1", 0), handle_kind=HandleKind.NIXL, max_connections=8)
        ex = Exporter(config, HostTransport(granularity=64 * 1024), name="flooded")
        ex.start()
        address = ex.lease_address
    else:
        echo = Echo()
        address = echo.server.address
    threads = threading.active_count()
    _, port = parse_address(address)
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(port), "1000"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout is not None and flood.stdout.readline() == "connected\n"
        for _ in range(10):
            with connect_tcp(address, KEY, timeout=5.0) as ch:  # never refused for the flood
                if ex is not None:
                    ch.send(chan.encode(status.REQUEST), timeout=5.0)
                    with ch.recv(timeout=5.0) as msg:
                        assert chan.decode(msg.payload)["kind"] == "exporter"
                else:
                    ch.send(b"abc", timeout=5.0)
                    with ch.recv(timeout=5.0) as msg:
                        assert msg.payload == b"cba"
        assert flood.poll() is None  # the flood was still connected throughout
        assert threading.active_count() <= threads + 2  # no thread per unauthenticated peer
    finally:
        flood.kill()
        flood.wait(10)
        assert flood.stdout is not None and flood.stdin is not None
        flood.stdout.close()
        flood.stdin.close()
        if ex is not None:
            ex.stop()
        if echo is not None:
            echo.server.close()


def test_both_ends_probe_a_silent_peer_within_seconds(echo: Echo) -> None:
    """A peer lost with its link sends no FIN: keepalive (and, with data unacknowledged,
    the user timeout) must find it in seconds (the kernel's defaults wait two hours, or
    ~15 minutes of retransmissions), at both ends of a connection."""
    from kvstate.channel.tcp import KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES, KEEPALIVE_S

    seen: list[tuple[int, int, int, int, int]] = []

    def handle(ch: chan.Channel) -> None:
        s = ch._sock  # type: ignore[attr-defined]
        seen.append((s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                     s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                     s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                     s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                     s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)))
        ch.close()

    server = TcpServer("127.0.0.1", 0, KEY, handshake_timeout=2.0)
    server.serve_in_thread(handle)
    try:
        with connect_tcp(server.address, KEY, timeout=5.0) as ch:
            s = ch._sock
            mine = (s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                    s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                    s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                    s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                    s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT))
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        server.close()
    want = (1, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES, KEEPALIVE_S * 1000)
    assert mine == want and seen == [want]
    assert KEEPALIVE_S <= 15


def _served_exporter(d: Path) -> Exporter:  # type: ignore[type-arg]
    ex = Exporter(_config(d, ("127.0.0.1", 0), handle_kind=HandleKind.NIXL), HostTransport(granularity=64 * 1024),
                  name="stream")
    ex.start()
    return ex


def test_the_native_server_reassembles_frames_from_any_cut_of_the_stream(socket_dir: Path) -> None:
    """The lease thread cuts a TCP stream into frames itself (ffi/kvs_lease_tcp.c): a
    request dripped a byte at a time, and two requests in one segment, are each answered
    whole and in order."""
    from kvstate.share import status

    ex = _served_exporter(socket_dir)
    try:
        with connect_tcp(ex.lease_address, KEY, timeout=5.0) as ch:
            frame = HEADER.pack(MAGIC, len(chan.encode(status.REQUEST)), 0) + chan.encode(status.REQUEST)
            for i in range(len(frame)):  # one byte per segment (TCP_NODELAY)
                ch._sock.send(frame[i:i + 1])
                time.sleep(0.001)
            with ch.recv(timeout=5.0) as msg:
                assert chan.decode(msg.payload)["kind"] == "exporter"
            bad = chan.encode({"op": "renew", "rank": 0, "lease": 1})  # no such bank: refused, answered
            ch._sock.send(HEADER.pack(MAGIC, len(bad), 0) + bad + frame)
            with ch.recv(timeout=5.0) as msg:
                assert chan.decode(msg.payload)["ok"] is False
            with ch.recv(timeout=5.0) as msg:
                assert chan.decode(msg.payload)["kind"] == "exporter"
    finally:
        ex.stop()


def test_a_bad_header_on_the_stream_closes_the_connection(socket_dir: Path) -> None:
    ex = _served_exporter(socket_dir)
    try:
        with connect_tcp(ex.lease_address, KEY, timeout=5.0) as ch:
            assert ex.connections() == 1
            ch._sock.send(b"XXXX" + bytes(8))  # out of step: nothing after it can be trusted
            with raises(ChannelError, reason=ChannelReason.CLOSED):
                ch.recv(timeout=5.0)
        assert ex.connections() == 0
    finally:
        ex.stop()


def test_handshakes_never_take_a_served_slot(socket_dir: Path) -> None:
    """Unauthenticated peers wait in the native thread's handshake table; once they are
    gone (or timed out) nothing of them stays."""
    ex = _served_exporter(socket_dir)
    _, port = parse_address(ex.lease_address)
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5.0) for _ in range(5)]
    try:
        for s in socks:  # the challenge came: the thread holds their handshakes
            assert len(s.recv(HEADER.size + 32)) > 0
        assert ex.lease_server.handshakes() == 5 and ex.connections() == 0
        with connect_tcp(ex.lease_address, KEY, timeout=5.0):
            assert ex.connections() == 1
    finally:
        for s in socks:
            s.close()
        ex.stop()
    assert ex.lease_server.handshakes() == 0
