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

from kvstate.channel.conn import Channel, PeerCred
from kvstate.channel.framing import DEFAULT_TIMEOUT, HEADER, MAGIC, Limits, Message, check_timeout, remaining_ms
from kvstate.core.errors import ChannelError
from kvstate.core.reasons import ChannelReason
from kvstate.core.identity import Deployment, Purpose, digest

log = logging.getLogger(__name__)

SCHEME = "tcp://"
_NONCE = 32
#: The most a frame that has begun may take past the receive's own timeout: its first byte
#: may come at the very end of the wait, and a lost segment is resent after 200 ms or more.
FRAME_GRACE_S = 1.0


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
        if not p.poll(remaining_ms(deadline)):
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


def _handshake_server(ch: TcpChannel, deployment: Deployment, timeout: float) -> None:
    nonce_s = os.urandom(_NONCE)
    ch.send(nonce_s, timeout=timeout)
    with ch.recv(timeout) as msg:
        nonce_c, mac = msg.payload[:_NONCE], msg.payload[_NONCE:]
    if len(nonce_c) != _NONCE or not hmac.compare_digest(mac, _mac(deployment, b"client", nonce_s, nonce_c)):
        raise ChannelError(ChannelReason.UNAUTHENTICATED,
                           f"{ch.address}: the client does not hold this deployment's key")
    ch.send(_mac(deployment, b"server", nonce_c, nonce_s), timeout=timeout)


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


class TcpServer:
    """A listening TCP socket; each accepted peer is authenticated, then handed to the
    handler on its own thread (at most ``max_connections`` at once)."""

    def __init__(self, host: str, port: int, deployment: Deployment, *, limits: Limits = Limits(),
                 max_connections: int = 128, handshake_timeout: float = 5.0) -> None:
        self.deployment = deployment
        self.limits = limits
        self.handshake_timeout = handshake_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        try:
            self._sock = socket.create_server((host, port), reuse_port=False)
        except (OSError, OverflowError, TypeError, ValueError) as exc:  # in use, no such host, bad port
            raise ChannelError(ChannelReason.FAILED,
                               f"cannot listen on {host!r:.60} port {port!r:.10}: {exc}") from None
        self._sock.setblocking(False)
        bound = self._sock.getsockname()
        self.address = f"{SCHEME}{bound[0]}:{bound[1]}"
        self._closed = False
        self._thread: threading.Thread | None = None

    def serve_in_thread(self, handler: Callable[[Channel], None], *, name: str = "kvstate-tcp-accept") -> None:
        def run_one(ch: TcpChannel) -> None:
            try:
                _handshake_server(ch, self.deployment, self.handshake_timeout)
            except Exception as exc:  # whatever the peer did, its slot comes back
                log.warning("refused a tcp peer %s: %s", ch.address, exc)
                ch.close()
                self._slots.release()
                return
            try:
                handler(ch)
            except Exception:
                log.exception("channel handler failed for %r", ch)
                ch.close()
            finally:
                self._slots.release()

        def loop() -> None:
            while not self._closed:
                p = select.poll()
                try:
                    p.register(self._sock, select.POLLIN)
                except ValueError:
                    return  # closed
                if not p.poll(100):
                    continue
                try:
                    conn, _ = self._sock.accept()
                except (BlockingIOError, OSError):
                    continue
                if not self._slots.acquire(blocking=False):
                    conn.close()
                    continue
                # A peer that reset before the accept (ENOTCONN), or no thread to serve it:
                # that peer is refused, its slot freed, and this loop goes on accepting.
                try:
                    ch = TcpChannel(conn, limits=self.limits)
                except OSError as exc:
                    log.info("a tcp peer left before it was served: %s", exc)
                    self._slots.release()
                    continue
                try:
                    threading.Thread(target=run_one, args=(ch,), name=f"{name}-{ch.address[1]}", daemon=True).start()
                except RuntimeError as exc:
                    log.warning("cannot serve tcp peer %s: %s", ch.address, exc)
                    ch.close()
                    self._slots.release()

        self._thread = threading.Thread(target=loop, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close()
        if self._thread is not None:
            self._thread.join(2.0)
