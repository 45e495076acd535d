"""The control channel across nodes (kvstate.channel.tcp), on loopback: frames, the mutual
deployment handshake, and the end of a connection seen as the end of its peer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvstate import channel as chan
from kvstate.channel.tcp import TcpServer, connect_tcp, parse_address
from kvstate.core.errors import ChannelClosed, ChannelError, FrameError, PeerUnauthenticated
from kvstate.core.identity import Deployment

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
        with pytest.raises(FrameError, match="cannot cross nodes"):
            ch.send(b"fd", [0], timeout=1.0)
        with pytest.raises(FrameError, match="exceeds the cap"):
            ch.send(bytes(chan.DEFAULT_MAX_PAYLOAD + 1), timeout=1.0)
    finally:
        ch.close()
    assert echo.done.wait(5.0) and echo.served == 1


def test_a_client_without_the_key_is_refused_before_any_frame(echo: Echo) -> None:
    with pytest.raises((PeerUnauthenticated, ChannelClosed)):
        connect_tcp(echo.server.address, OTHER, timeout=5.0)
    time.sleep(0.1)
    assert echo.served == 0  # the handler never saw it


def test_a_server_without_the_key_is_refused_by_the_client() -> None:
    impostor = Echo(OTHER)
    try:
        with pytest.raises((PeerUnauthenticated, ChannelClosed)):
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
            with pytest.raises(ChannelClosed):
                ch.recv(timeout=5.0)
    finally:
        ch.close()
        server.close()


def test_eof_mid_conversation_is_channel_closed() -> None:
    server = TcpServer("127.0.0.1", 0, KEY)
    server.serve_in_thread(lambda ch: ch.close())  # hangs up right after the handshake
    try:
        ch = connect_tcp(server.address, KEY, timeout=5.0)
        with pytest.raises(ChannelClosed):
            ch.recv(timeout=5.0)
        ch.close()
    finally:
        server.close()


@pytest.mark.parametrize("address", ["unix:///tmp/x", "tcp://", "tcp://host", "tcp://host:0", "tcp://host:99999",
                                     "tcp://:80", "tcp://host:8o"])
def test_malformed_addresses_are_refused(address: str) -> None:
    with pytest.raises(ChannelError):
        parse_address(address)
    assert parse_address("tcp://127.0.0.1:4000") == ("127.0.0.1", 4000)
