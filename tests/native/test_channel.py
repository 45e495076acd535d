"""The control channel: framing and caps, fds, credentials, safe paths, timeouts, hang-up."""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.errors import raises

from kvstate import channel
from kvstate.core.reasons import ChannelReason
from kvstate.channel import HEADER, MAGIC, Channel, Limits, Server, Watcher, connect
from kvstate.core.errors import ChannelError


@pytest.fixture
def sock_dir(tmp_path: Path) -> Path:
    return channel.make_socket_dir(tmp_path / "s")


@pytest.fixture
def server(sock_dir: Path) -> Iterator[Server]:
    with Server(sock_dir / "x.sock") as s:
        yield s


@pytest.fixture
def pair(server: Server) -> Iterator[tuple[Channel, Channel]]:
    client = connect(server.path, timeout=5)
    srv = server.accept(timeout=5)
    yield client, srv
    client.close()
    srv.close()


def test_peer_alive_with_descriptors_past_fd_setsize(server: Server) -> None:
    """A process with more than 1,024 fds open (an engine's, with its tensors and sockets)
    still checks its peer: select() refuses fds past FD_SETSIZE, so liveness polls."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    fillers: list[int] = []
    try:
        while (fd := os.open(os.devnull, os.O_RDONLY)) < 1100:
            fillers.append(fd)
        fillers.append(fd)
        client = connect(server.path, timeout=5)
        srv = server.accept(timeout=5)
        try:
            assert client.pidfd is not None and client.pidfd > 1024
            assert client.peer_alive() and srv.peer_alive()
        finally:
            client.close()
            srv.close()
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_roundtrip_with_fds_and_credentials(pair: tuple[Channel, Channel]) -> None:
    client, srv = pair
    assert srv.peer.pid == os.getpid() and srv.peer.uid == os.getuid()
    assert client.peer.pid == os.getpid() and client.peer_alive()
    fd = os.memfd_create("kvstate-chan", os.MFD_CLOEXEC)
    try:
        client.send(channel.encode({"kind": "bank", "handle": b"\x00\x01"}), [fd])
        with srv.recv(timeout=5) as msg:
            assert channel.decode(msg.payload) == {"kind": "bank", "handle": b"\x00\x01"}
            assert len(msg.fds) == 1
            assert os.fstat(msg.fds[0]).st_ino == os.fstat(fd).st_ino
    finally:
        os.close(fd)
    srv.send(b"pong")
    assert client.recv(5).payload == b"pong"


def test_codec_is_strict() -> None:
    assert channel.decode(channel.encode({"b": b"\xff", "n": [1, 2.5, None]})) == {"b": b"\xff", "n": [1, 2.5, None]}
    for bad in (b'{"a":1,"a":2}', b'{"a":NaN}', b"[1]", b"\xff", b'{"a":{"$b64":"!!"}}', b"{"):
        with raises(ChannelError, ChannelReason.FRAME):
            channel.decode(bad)
    with raises(ChannelError, ChannelReason.FRAME):
        channel.encode({"x": object()})
    with raises(ChannelError, ChannelReason.FRAME):
        channel.encode({"x": float("nan")})


def test_codec_is_shared_safely_across_threads() -> None:
    """One encoder and one decoder serve every thread (built once, not per message): the
    exporter's handlers, the watcher's callbacks and the importer's threads all use them."""
    failures: list[str] = []

    def work(n: int) -> None:
        for i in range(2000):
            msg = {"op": "lease", "rank": n, "i": i, "b": bytes([n, i % 256]), "items": [{"k": i}] * (i % 3)}
            if channel.decode(channel.encode(msg)) != msg:
                failures.append(f"thread {n} message {i} did not round-trip")
            try:
                channel.decode(b'{"a":1,"a":%d}' % i)
                failures.append(f"thread {n} accepted a duplicate key")
            except ChannelError as exc:
                if exc.reason is not ChannelReason.FRAME:
                    raise
                pass

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert failures == [] and not any(t.is_alive() for t in threads)


def test_caps_refuse_big_messages_and_too_many_fds(server: Server) -> None:
    client = connect(server.path, timeout=5, limits=Limits(max_payload=1024, max_fds=1))
    srv = server.accept(timeout=5)
    try:
        with raises(ChannelError, ChannelReason.FRAME):
            client.send(b"x" * 1025)
        with raises(ChannelError, ChannelReason.FRAME):
            client.send(b"x", [0, 1])
        srv.send(b"y" * 2048)  # within the server's cap, beyond the client's
        with raises(ChannelError, ChannelReason.FRAME, match="larger than the cap"):
            client.recv(5)
        r, w = os.pipe()
        try:
            srv.send(b"two fds", [r, w])
            with raises(ChannelError, ChannelReason.FRAME, match="fds"):
                client.recv(5)  # the fds that came are closed (the leak check verifies)
        finally:
            os.close(r)
            os.close(w)
        srv.send(b"still fine")
        assert client.recv(5).payload == b"still fine"
    finally:
        client.close()
        srv.close()


@pytest.mark.parametrize("frame", [
    b"short",
    b"XXXX" + HEADER.pack(MAGIC, 0, 0)[4:],
    HEADER.pack(MAGIC, 5, 0) + b"abc",   # the header over-states its payload
    HEADER.pack(MAGIC, 2, 0) + b"abc",   # and under-states it: the tail would ride past the header
    HEADER.pack(MAGIC, 0, 1),
])
def test_malformed_frames_are_refused(frame: bytes) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ch = Channel(a)
    try:
        b.send(frame)
        with raises(ChannelError, ChannelReason.FRAME):
            ch.recv(5)
    finally:
        ch.close()
        b.close()


def test_every_blocking_step_times_out(server: Server, pair: tuple[Channel, Channel]) -> None:
    client, srv = pair
    start = time.monotonic()
    with raises(ChannelError, ChannelReason.TIMEOUT):
        client.recv(timeout=0.1)
    with raises(ChannelError, ChannelReason.TIMEOUT):
        server.accept(timeout=0.1)
    assert time.monotonic() - start < 3
    with raises(ChannelError, ChannelReason.TIMEOUT):
        for _ in range(100_000):  # fill the peer's receive queue; send must not block forever
            client.send(b"z" * 4096, timeout=0.05)
    for bad in (-1, float("inf"), float("nan"), None, "1", True):
        with pytest.raises(ChannelError):  # typed (issue 14, class 1), never a ValueError or TypeError
            client.recv(timeout=bad)  # type: ignore[arg-type]


def test_eof_and_local_close(pair: tuple[Channel, Channel]) -> None:
    client, srv = pair
    client.send(b"last words")
    client.close()
    assert srv.recv(5).payload == b"last words"  # pending messages survive the hang-up
    with raises(ChannelError, ChannelReason.CLOSED):
        srv.recv(5)
    with raises(ChannelError, ChannelReason.CLOSED):
        client.send(b"x")


def test_peer_credentials_are_checked_on_both_ends(sock_dir: Path) -> None:
    other = {os.getuid() + 1}
    with Server(sock_dir / "x.sock", allowed_uids=other) as s:
        c = connect(s.path, timeout=5)
        with raises(ChannelError, ChannelReason.REJECTED) as exc:
            s.accept(timeout=5)
        assert exc.value.uid == os.getuid() and exc.value.pid == os.getpid()
        with raises(ChannelError, ChannelReason.CLOSED):
            c.recv(5)  # the server closed the rejected connection
        c.close()
    with Server(sock_dir / "y.sock") as s:
        with raises(ChannelError, ChannelReason.REJECTED):
            connect(s.path, timeout=5, allowed_uids=other)
        s.accept(timeout=5).close()


def test_socket_dir_must_be_private_and_symlink_free(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="mode 755"):
        Server(open_dir / "x.sock")
    private = channel.make_socket_dir(tmp_path / "private")
    with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="owned by"):
        channel.check_socket_dir(private, uid=os.getuid() + 1)
    link = tmp_path / "link"
    link.symlink_to(private)
    with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="symlink"):
        Server(link / "x.sock")
    with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="absolute"):
        Server(Path("relative/x.sock"))
    with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="normalised"):
        channel.check_socket_dir(str(private) + "/../private")
    with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="longer"):
        Server(private / ("x" * 120))
    with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="does not exist"):
        channel.check_socket_dir(tmp_path / "nowhere")
    with Server(private / "real.sock") as s:
        (private / "alias.sock").symlink_to(s.path)
        with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="symlink"):
            connect(private / "alias.sock", timeout=5)
        with pytest.raises(ChannelError, match="another server"):
            Server(private / "real.sock")
    (private / "file").write_text("not a socket")
    with raises(ChannelError, ChannelReason.UNSAFE_PATH, match="not a socket"):
        Server(private / "file")


def test_stale_socket_of_a_dead_server_is_replaced(sock_dir: Path) -> None:
    path = sock_dir / "x.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(str(path))
    dead.close()  # bound, never listening, closed: the file stays behind
    with Server(path) as s:
        c = connect(path, timeout=5)
        s.accept(timeout=5).close()
        c.close()
    assert not path.exists()
    with raises(ChannelError, ChannelReason.CLOSED, match="no server"):
        connect(path, timeout=1)


def test_watcher_reports_each_closed_connection_once(server: Server) -> None:
    closed: list[Channel] = []
    event = threading.Event()

    def on_close(ch: Channel) -> None:
        closed.append(ch)
        event.set()

    with Watcher() as w:
        c1, c2 = connect(server.path, timeout=5), connect(server.path, timeout=5)
        s1, s2 = server.accept(timeout=5), server.accept(timeout=5)
        w.watch(s1, on_close)
        w.watch(s2, on_close)
        c2.send(b"pending")  # data waiting is not a hang-up
        time.sleep(0.05)
        assert not closed
        c1.close()
        assert event.wait(5) and closed == [s1]
        event.clear()
        w.unwatch(s2)
        c2.close()
        time.sleep(0.1)
        assert closed == [s1]
        assert s2.recv(5).payload == b"pending"
        s1.close()
        s2.close()


def test_serve_in_thread_runs_a_handler_per_connection(server: Server) -> None:
    def echo(ch: Channel) -> None:
        with ch:
            msg = ch.recv(5)
            ch.send(msg.payload.upper())

    t = server.serve_in_thread(echo, poll_interval=0.05)
    for word in (b"one", b"two"):
        with connect(server.path, timeout=5) as c:
            c.send(word)
            assert c.recv(5).payload == word.upper()
    server.close()
    t.join(5)
    assert not t.is_alive()
