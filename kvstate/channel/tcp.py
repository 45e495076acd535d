"""The control channel across nodes: the same frames over TCP, authenticated per deployment.

A lease on a bank of another node cannot travel over AF_UNIX, so an exporter that exports
banks across nodes (NIXL) also listens on TCP, and its descriptors name the address as
``tcp://HOST:PORT``. Everything above the socket is the same: one frame per message (the
12-byte header, then the payload; no fds cross nodes), the same strict JSON codec, the same
timeouts, and a connection's end ends its leases (EOF or reset; there is no pidfd for a
peer on another node, so a silent peer is found by the lease's expiry).

Trust: SO_PEERCRED means nothing across nodes, so both ends prove they hold the
deployment's key before anything else is read, with a mutual challenge and response:

    server -> client   nonce_s (32 random bytes)
    client -> server   nonce_c, MAC(key, "client" | nonce_s | nonce_c)
    server -> client   MAC(key, "server" | nonce_c | nonce_s)

(MAC: BLAKE2b keyed with the deployment key, personalised ``kvstate/chanauth``.) A peer
that fails is refused with :class:`ChannelError` (UNAUTHENTICATED) and closed. The
messages themselves are not encrypted: what crosses is descriptors (signed), lease ids
and block hashes, never KV bytes (those go through NIXL).
"""

from __future__ import annotations

import hmac
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence

from kvstate.channel.conn import Channel, PeerCred, poll_until
from kvstate.channel.framing import DEFAULT_TIMEOUT, HEADER, MAGIC, Limits, Message, check_timeout
from kvstate.core.errors import ChannelError
from kvstate.core.reasons import ChannelReason
from kvstate.core.identity import Deployment, Purpose, digest

log = logging.getLogger(__name__)

SCHEME = "tcp://"
_NONCE = 32
#: The most a frame that has begun may take past the receive's own timeout: its first byte
#: may come at the very end of the wait, and a lost segment is resent after 200 ms or more.
FRAME_GRACE_S = 1.0
#: Keepalive: a silent connection is probed after KEEPALIVE_IDLE_S, then every
#: KEEPALIVE_INTERVAL_S; KEEPALIVE_PROBES unanswered probes end it (with ETIMEDOUT), so a
#: peer lost with its link is found within KEEPALIVE_S, not the kernel's two hours.
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_PROBES = 3
KEEPALIVE_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES


def parse_address(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port); ChannelError for anything else."""
    if not address.startswith(SCHEME):
        raise ChannelError(ChannelReason.SETUP, f"not a tcp address: {address!r:.80}")
    host, sep, port = address[len(SCHEME):].rpartition(":")
    # ASCII digits only: str.isdigit() also takes '²' (which int() refuses) and '٣' (a 3).
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ChannelError(ChannelReason.SETUP, f"malformed tcp address {address!r:.80}")
    return host.strip("[]"), int(port)


def _mac(deployment: Deployment, role: bytes, first: bytes, second: bytes) -> bytes:
    return digest(Purpose.CHANNEL_AUTH, role + first + second, key=deployment.key)


class TcpChannel(Channel):
    """One authenticated TCP connection carrying control frames (no fds)."""

    def __init__(self, sock: socket.socket, *, limits: Limits = Limits()) -> None:  # noqa: D107
        self._sock = sock
        self.limits = limits
        self._closed = False
        self._close_lock = threading.Lock()
        self._pidfd = None
        self._send_lock = threading.Lock()
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            # A peer whose node or link went away sends no FIN: keepalive probes find it
            # (KEEPALIVE_S), where the kernel's default would wait two hours.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
            # Probes are sent only while nothing is unacknowledged; data sent into a dead link
            # is retransmitted for ~15 minutes instead. This bounds that wait the same way.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, KEEPALIVE_S * 1000)
            # ENOTCONN when the peer reset before we got here: the caller's to handle.
            self.address = sock.getpeername()
        except BaseException:
            sock.close()
            raise
        self.peer = PeerCred(-1, -1, -1)  # unknown across nodes: the handshake is the check

    def __repr__(self) -> str:
        return f"<TcpChannel peer {self.address}{' closed' if self._closed else ''}>"

    def peer_alive(self) -> bool:
        return not self._closed

    def _wait(self, events: int, deadline: float, what: str) -> None:
        p = select.poll()
        self._register(p, events)
        if not poll_until(p, deadline):
            raise ChannelError(ChannelReason.TIMEOUT, f"{what} did not complete in time")
        self._live()

    def _send_all(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                n = self._sock.send(view)
                view = view[n:]
                continue
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                raise ChannelError(ChannelReason.CLOSED, "the peer closed the connection") from None
            except TimeoutError:  # ETIMEDOUT: retransmissions or keepalive probes went unanswered
                raise ChannelError(ChannelReason.CLOSED, "the peer stopped answering (keepalive)") from None
            except OSError:
                self._live()
                raise
            self._wait(select.POLLOUT, deadline, "send")

    def _recv_exact(self, n: int, deadline: float) -> bytes:
        chunks: list[bytes] = []
        left = n
        while left:
            try:
                chunk = self._sock.recv(left)
            except BlockingIOError:
                self._wait(select.POLLIN, deadline, "recv")
                continue
            except ConnectionResetError:
                raise ChannelError(ChannelReason.CLOSED, "the peer reset the connection") from None
            except TimeoutError:  # ETIMEDOUT: keepalive probes (or retransmissions) went unanswered
                raise ChannelError(ChannelReason.CLOSED, "the peer stopped answering (keepalive)") from None
            except OSError:
                self._live()
                raise
            if not chunk:
                raise ChannelError(ChannelReason.CLOSED, "the peer closed the connection")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def send(self, payload: bytes, fds: Sequence[int] = (), *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._live()
        if fds:
            raise ChannelError(ChannelReason.FRAME, "file descriptors cannot cross nodes")
        if len(payload) > self.limits.max_payload:
            raise ChannelError(ChannelReason.FRAME,
                               f"payload of {len(payload)} bytes exceeds the cap of {self.limits.max_payload}")
        deadline = time.monotonic() + check_timeout(timeout)
        with self._send_lock:  # a frame is written whole before the next one starts
            self._send_all(HEADER.pack(MAGIC, len(payload), 0) + payload, deadline)

    def recv(self, timeout: float = DEFAULT_TIMEOUT) -> Message:
        """The next frame. A stream has no packet boundaries: a header is read, checked,
        then exactly the payload it announces. Wait for the first byte up to ``timeout``;
        a frame that has begun must arrive whole by then too, with at most
        :data:`FRAME_GRACE_S` more (its first byte may come at the very end). A frame cut
        short (timeout, reset) or with a bad header closes the channel: the stream is out
        of step, and the rest of a half-read frame must never be read as a new one."""
        self._live()
        deadline = time.monotonic() + check_timeout(timeout)
        self._wait(select.POLLIN, deadline, "recv")
        whole_by = deadline + FRAME_GRACE_S
        try:
            magic, length, nfds = HEADER.unpack(self._recv_exact(HEADER.size, whole_by))
            if magic != MAGIC or nfds != 0 or length > self.limits.max_payload:
                raise ChannelError(ChannelReason.FRAME,
                                   f"bad frame header (magic {magic!r}, {length} bytes, {nfds} fds)")
            return Message(self._recv_exact(length, whole_by))
        except BaseException:
            self.close()
            raise


def _handshake_client(ch: TcpChannel, deployment: Deployment, timeout: float) -> None:
    with ch.recv(timeout) as msg:
        nonce_s = msg.payload
    if len(nonce_s) != _NONCE:
        raise ChannelError(ChannelReason.UNAUTHENTICATED, f"{ch.address}: malformed challenge")
    nonce_c = os.urandom(_NONCE)
    ch.send(nonce_c + _mac(deployment, b"client", nonce_s, nonce_c), timeout=timeout)
    with ch.recv(timeout) as msg:
        if not hmac.compare_digest(msg.payload, _mac(deployment, b"server", nonce_c, nonce_s)):
            raise ChannelError(ChannelReason.UNAUTHENTICATED,
                               f"{ch.address}: the server does not hold this deployment's key")


def connect_tcp(address: str, deployment: Deployment, *, timeout: float = DEFAULT_TIMEOUT,
                limits: Limits = Limits()) -> TcpChannel:
    """Connect to ``tcp://HOST:PORT`` and prove, both ways, that the peer holds the key."""
    host, port = parse_address(address)
    check_timeout(timeout)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        raise ChannelError(ChannelReason.TIMEOUT, f"connect to {address} did not complete within {timeout} s") from None
    except ConnectionRefusedError:
        raise ChannelError(ChannelReason.CLOSED, f"no server at {address}") from None
    except OSError as exc:
        raise ChannelError(ChannelReason.FAILED, f"cannot connect to {address}: {exc.strerror or exc}") from None
    ch = TcpChannel(sock, limits=limits)
    try:
        _handshake_client(ch, deployment, timeout)
    except BaseException:
        ch.close()
        raise
    return ch


#: Handshakes under way at once: an unauthenticated peer costs a socket and a few bytes
#: here, never a thread or a served connection's slot. Past this, the oldest is dropped.
MAX_HANDSHAKES = 256
#: The most a handshake may take, whatever the exporter's request timeout: a real
#: importer answers in one round trip.
HANDSHAKE_S = 2.0
_CLIENT_PROOF = HEADER.size + 2 * _NONCE  # header, nonce_c, MAC


class _Handshake:
    """One unauthenticated peer, stepped without blocking by the accept loop (the server's
    side of the challenge and response in the module docstring)."""

    def __init__(self, sock: socket.socket, deployment: Deployment, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.nonce = os.urandom(_NONCE)
        self.got = b""
        self._nonce_c = b""
        self._deployment = deployment
        sock.setblocking(False)
        _send_now(sock, HEADER.pack(MAGIC, _NONCE, 0) + self.nonce)

    def step(self) -> bool:
        """Read what has arrived; True once the peer proved it holds the key, False while
        more is due. ChannelError (UNAUTHENTICATED) or OSError: drop it."""
        try:
            chunk = self.sock.recv(_CLIENT_PROOF - len(self.got))
        except BlockingIOError:
            return False
        if not chunk:
            raise ChannelError(ChannelReason.UNAUTHENTICATED, "closed during the handshake")
        self.got += chunk
        if len(self.got) < _CLIENT_PROOF:
            return False
        magic, length, nfds = HEADER.unpack(self.got[:HEADER.size])
        nonce_c, mac = self.got[HEADER.size:HEADER.size + _NONCE], self.got[HEADER.size + _NONCE:]
        if magic != MAGIC or length != 2 * _NONCE or nfds != 0 or \
                not hmac.compare_digest(mac, _mac(self._deployment, b"client", self.nonce, nonce_c)):
            raise ChannelError(ChannelReason.UNAUTHENTICATED, "the client does not hold this deployment's key")
        self._nonce_c = nonce_c
        return True

    def answer(self) -> None:
        """Prove this server holds the key too: the handshake's last message."""
        proof = _mac(self._deployment, b"server", self._nonce_c, self.nonce)
        _send_now(self.sock, HEADER.pack(MAGIC, len(proof), 0) + proof)


def _send_now(sock: socket.socket, data: bytes) -> None:
    """A handshake message goes whole into a fresh socket's buffer, or the peer is dropped."""
    if sock.send(data) != len(data):
        raise ChannelError(ChannelReason.UNAUTHENTICATED, "the handshake did not fit the socket's buffer")


class TcpServer:
    """A listening TCP socket. Peers are authenticated by one thread that steps every
    handshake without blocking (at most :data:`MAX_HANDSHAKES` at once, each within
    :data:`HANDSHAKE_S`; past the cap the oldest goes), so idle or slow unauthenticated
    connections hold no thread and no slot of a served one. Each authenticated peer is
    handed to the handler on its own thread, at most ``max_connections`` at once."""

    def __init__(self, host: str, port: int, deployment: Deployment, *, limits: Limits = Limits(),
                 max_connections: int = 128, handshake_timeout: float = 5.0) -> None:
        self.deployment = deployment
        self.limits = limits
        # A handshake has HANDSHAKE_S at most whatever the caller asks: an unauthenticated
        # peer is given no more than a real importer needs (one round trip).
        self.handshake_timeout = min(handshake_timeout, HANDSHAKE_S)
        self._slots = threading.BoundedSemaphore(max_connections)
        try:
            self._sock = socket.create_server((host, port), reuse_port=False, backlog=1024)
        except (OSError, OverflowError, TypeError, ValueError) as exc:  # in use, no such host, bad port
            raise ChannelError(ChannelReason.FAILED,
                               f"cannot listen on {host!r:.60} port {port!r:.10}: {exc}") from None
        self._sock.setblocking(False)
        bound = self._sock.getsockname()
        self.address = f"{SCHEME}{bound[0]}:{bound[1]}"
        self._closed = False
        self._thread: threading.Thread | None = None

    def fileno(self) -> int:
        """The listening socket, for a native server that accepts on it itself (the
        exporter's lease thread, ``ffi/kvs_lease_tcp.c``, which runs this handshake in C
        with the same limits); it stays this object's to close."""
        return self._sock.fileno()

    def serve_in_thread(self, handler: Callable[[Channel], None], *, name: str = "kvstate-tcp-accept") -> None:
        pending: dict[int, _Handshake] = {}  # fd -> handshake, oldest first

        def drop(fd: int, why: object) -> None:
            hs = pending.pop(fd)
            log.info("refused a tcp peer: %s", why)
            hs.sock.close()

        def run_one(ch: TcpChannel) -> None:
            try:
                handler(ch)
            except Exception:
                log.exception("channel handler failed for %r", ch)
                ch.close()
            finally:
                self._slots.release()

        def serve(hs: _Handshake) -> None:
            """An authenticated peer: a served slot, the handshake's answer and a thread; or
            it is closed unanswered (every slot taken: its handshake ends in EOF)."""
            if not self._slots.acquire(blocking=False):
                hs.sock.close()
                return
            try:
                hs.answer()
                ch = TcpChannel(hs.sock, limits=self.limits)
            except (OSError, ChannelError) as exc:  # it left meanwhile (ENOTCONN, EPIPE)
                log.info("a tcp peer left before it was served: %s", exc)
                hs.sock.close()
                self._slots.release()
                return
            log.debug("tcp peer %s authenticated %.3f s after its accept", ch.address,
                      time.monotonic() - (hs.deadline - self.handshake_timeout))
            try:
                threading.Thread(target=run_one, args=(ch,), name=f"{name}-{ch.address[1]}", daemon=True).start()
            except RuntimeError as exc:
                log.warning("cannot serve tcp peer %s: %s", ch.address, exc)
                ch.close()
                self._slots.release()

        def accept_all() -> None:
            while True:
                try:
                    conn, _ = self._sock.accept()
                except (BlockingIOError, OSError):
                    return
                if len(pending) >= MAX_HANDSHAKES:
                    drop(next(iter(pending)), "too many handshakes at once: the oldest goes")
                try:
                    hs = _Handshake(conn, self.deployment, time.monotonic() + self.handshake_timeout)
                except (OSError, ChannelError) as exc:  # reset before the accept, and the like
                    log.info("refused a tcp peer at its accept: %s", exc)
                    conn.close()
                    continue
                pending[conn.fileno()] = hs

        def loop() -> None:
            try:
                while not self._closed:
                    p = select.poll()
                    try:
                        p.register(self._sock, select.POLLIN)
                    except ValueError:
                        return  # closed
                    for fd in pending:
                        p.register(fd, select.POLLIN)
                    now = time.monotonic()
                    wait = min([100, *(max(0, int((h.deadline - now) * 1000) + 1) for h in pending.values())])
                    for fd, _ in p.poll(wait):
                        if fd == self._sock.fileno():
                            accept_all()
                        elif fd in pending:
                            try:
                                done = pending[fd].step()
                            except (OSError, ChannelError) as exc:
                                drop(fd, exc)
                                continue
                            if done:
                                serve(pending.pop(fd))
                    now = time.monotonic()
                    for fd in [fd for fd, h in pending.items() if h.deadline <= now]:
                        drop(fd, f"no handshake within {self.handshake_timeout} s")
            finally:
                for fd in list(pending):
                    drop(fd, "the server closed")

        self._thread = threading.Thread(target=loop, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close()
        if self._thread is not None:
            self._thread.join(2.0)
