"""One connected control channel, and the client side that opens it.

Both ends read the peer's credentials (SO_PEERCRED) and refuse a uid outside
``allowed_uids`` (default: our own) with :class:`ChannelError` (REJECTED). Each end opens a pidfd
for the peer's pid at connect time, so a peer that dies is noticed even when a child it
forked still holds the socket open (:class:`ChannelError` (PEER_DIED)). Sockets are non-blocking and
every blocking step polls with a timeout, so one thread may ``recv`` while another
``send``\\ s on the same channel.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import attrs

from kvstate.channel.framing import (
    DEFAULT_TIMEOUT,
    HEADER,
    Limits,
    Message,
    check_timeout,
    close_quietly,
    pack,
    remaining_ms,
    unpack,
)
from kvstate.channel.paths import as_path, check_socket_path
from kvstate.core.errors import ChannelError
from kvstate.core.reasons import ChannelReason

_PEERCRED = struct.Struct("3i")
_RECV_FLAGS = int(socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)  # an int: enum arithmetic per recv is slow


@attrs.frozen
class PeerCred:
    """The peer's credentials at connect time (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


def _peercred(sock: socket.socket) -> PeerCred:
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return PeerCred(pid, uid, gid)


class Channel:
    """One connected SOCK_SEQPACKET socket. Thread-safe for one sender and one receiver."""

    #: Called once by :meth:`close`, before the socket closes: whoever holds another
    #: descriptor of this connection (an importer's request link) shuts it down too.
    on_close: Callable[[], None] | None = None

    def __init__(self, sock: socket.socket, *, limits: Limits = Limits(),
                 allowed_uids: Iterable[int] | None = None) -> None:
        self._sock = sock
        self.limits = limits
        self._closed = False
        self._close_lock = threading.Lock()
        try:
            sock.setblocking(False)
            self.peer = _peercred(sock)
        except OSError as exc:
            sock.close()
            raise ChannelError(ChannelReason.FAILED, f"cannot set up the connection: {exc.strerror or exc}") from None
        except BaseException:
            sock.close()
            raise
        allowed = frozenset(allowed_uids) if allowed_uids is not None else frozenset({os.getuid()})
        if self.peer.uid not in allowed:
            sock.close()
            raise ChannelError.peer_rejected(self.peer.pid, self.peer.uid, allowed)
        try:
            self._pidfd: int | None = os.pidfd_open(self.peer.pid)
        except ProcessLookupError:
            self._pidfd = None  # already gone: the socket reports EOF, and peer_alive says so
        except OSError as exc:  # EMFILE, ENFILE, ENOMEM: no channel without a watch on its peer
            sock.close()
            raise ChannelError(ChannelReason.FAILED,
                               f"cannot open a pidfd of peer {self.peer.pid}: {exc.strerror or exc}") from None

    def __repr__(self) -> str:
        return f"<Channel peer pid={self.peer.pid} uid={self.peer.uid}{' closed' if self._closed else ''}>"

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def pidfd(self) -> int | None:
        """A pidfd of the peer process (readable once it exited), or None if it was gone."""
        return self._pidfd

    def peer_alive(self) -> bool:
        """Whether the peer process still runs (pidfd not readable)."""
        if self._pidfd is None:
            return False
        p = select.poll()  # not select(): it refuses fds past FD_SETSIZE (1,024), common in engines
        p.register(self._pidfd, select.POLLIN)
        return not p.poll(0)

    def hung_up(self) -> bool:
        """Whether the peer closed its end (or this end is closed), even with messages it
        sent before still unread."""
        return self._poll_now(select.POLLRDHUP)

    def pending(self) -> bool:
        """Whether something waits to be read: a message, or the peer's close."""
        return self._poll_now(select.POLLIN)

    def _poll_now(self, events: int) -> bool:
        # Under the close lock: a close between the check and the poll would free the fd's
        # number for another file, whose poll would answer for this channel.
        with self._close_lock:
            if self._closed:
                return True
            p = select.poll()
            try:
                p.register(self._sock.fileno(), events)
                return bool(p.poll(0))
            except (ValueError, OSError):  # a refused poll: say yes, the next recv tells
                return True

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            if self.on_close is not None:
                self.on_close()
            self._sock.close()
            if self._pidfd is not None:
                close_quietly(self._pidfd)

    def _live(self) -> None:
        if self._closed:
            raise ChannelError(ChannelReason.CLOSED, "the channel was closed here")

    def _register(self, p: select.poll, events: int, pidfd: int | None = None) -> None:
        """Register the socket (and the peer's pidfd) under the close lock, so a close by
        another thread is seen as ChannelError (CLOSED), never as a poll of a dead or reused fd."""
        with self._close_lock:
            if self._closed:
                raise ChannelError(ChannelReason.CLOSED, "the channel was closed here")
            p.register(self._sock, events)
            if pidfd is not None:
                p.register(pidfd, select.POLLIN)

    def send(self, payload: bytes, fds: Sequence[int] = (), *, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Send one message with ``fds`` attached (they are duplicated; the caller keeps its own)."""
        self._live()
        check_timeout(timeout)
        frame = pack(payload, len(fds), self.limits)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if fds:
                    sent = socket.send_fds(self._sock, [frame], list(fds))
                else:
                    sent = self._sock.send(frame)
                if sent != len(frame):
                    # SOCK_SEQPACKET sends a message whole; part of one went out, and the
                    # peer refuses what it got: the channel is unusable from here on.
                    self.close()
                    raise ChannelError(ChannelReason.FRAME, f"send sent {sent} of {len(frame)} bytes; the channel is closed")
                return
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                raise ChannelError(ChannelReason.CLOSED, "the peer closed the connection") from None
            except OSError as exc:
                if exc.errno == errno.EBADF and self._closed:
                    raise ChannelError(ChannelReason.CLOSED, "the channel was closed here") from None
                if exc.errno == errno.EMSGSIZE:  # SOCK_SEQPACKET: one message must fit the send buffer
                    raise ChannelError(ChannelReason.FRAME,
                                       f"a {len(frame)}-byte message is larger than this socket sends at once "
                                       f"(its send buffer; see net.core.wmem_default)") from None
                raise ChannelError(ChannelReason.FAILED, f"send failed: {exc.strerror or exc}") from exc
            p = select.poll()
            self._register(p, select.POLLOUT)
            if not poll_until(p, deadline):
                raise ChannelError(ChannelReason.TIMEOUT, f"send did not complete within {timeout} s")
            self._live()

    def recv(self, timeout: float = DEFAULT_TIMEOUT) -> Message:
        """The next message. Raises ChannelError (CLOSED) on EOF, ChannelError (PEER_DIED) when the peer process is
        gone and nothing is left to read, ChannelError (TIMEOUT), or ChannelError (FRAME) (fds closed)."""
        self._live()
        check_timeout(timeout)
        deadline = time.monotonic() + timeout
        cap = HEADER.size + self.limits.max_payload
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(self._sock, cap, max(1, self.limits.max_fds), _RECV_FLAGS)
            except BlockingIOError:
                pass
            except ConnectionResetError:
                raise ChannelError(ChannelReason.CLOSED, "the peer reset the connection") from None
            except OSError as exc:
                if exc.errno == errno.EBADF and self._closed:
                    raise ChannelError(ChannelReason.CLOSED, "the channel was closed here") from None
                raise ChannelError(ChannelReason.FAILED, f"recv failed: {exc.strerror or exc}") from None
            else:
                return unpack(data, fds, flags, self.limits)
            p = select.poll()
            pidfd = self._pidfd
            self._register(p, select.POLLIN, pidfd)
            ready = dict(poll_until(p, deadline))
            self._live()  # closed by another thread while this one waited
            if not ready:
                raise ChannelError(ChannelReason.TIMEOUT, f"no message within {timeout} s")
            if self._sock.fileno() not in ready and self._pidfd is not None and self._pidfd in ready:
                raise ChannelError(ChannelReason.PEER_DIED, f"peer process {self.peer.pid} exited")


def poll_until(p: select.poll, deadline: float) -> list[tuple[int, int]]:
    """``p.poll`` until the deadline; a refused poll (ENOMEM) is a ChannelError (EINTR
    is retried by Python itself)."""
    try:
        return p.poll(remaining_ms(deadline))
    except OSError as exc:
        raise ChannelError(ChannelReason.FAILED, f"poll failed: {exc.strerror or exc}") from None


def check_uids(allowed_uids: object) -> None:
    """``allowed_uids`` is None or a collection of ints (checked before any socket exists)."""
    if allowed_uids is not None and (not isinstance(allowed_uids, (list, tuple, set, frozenset)) or not all(
            type(u) is int and u >= 0 for u in allowed_uids)):
        raise ChannelError(ChannelReason.SETUP, f"allowed_uids must be a collection of uids, not {allowed_uids!r:.40}")


def connect(path: str | os.PathLike[str], *, timeout: float = DEFAULT_TIMEOUT,
            allowed_uids: Iterable[int] | None = None, limits: Limits = Limits()) -> Channel:
    """Connect to a server's socket after checking its directory and the server's uid."""
    check_timeout(timeout)
    if not isinstance(limits, Limits):
        raise ChannelError(ChannelReason.SETUP, f"limits must be Limits, not {type(limits).__name__}")
    check_uids(allowed_uids)
    p = as_path(path)
    check_socket_path(p, must_exist=False)  # a missing socket is "no server" (ChannelError (CLOSED))
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM
        raise ChannelError(ChannelReason.FAILED,
                           f"cannot make a socket to connect to {p}: {exc.strerror or exc}") from None
    try:
        sock.settimeout(timeout)
        sock.connect(str(p))
    except TimeoutError:
        sock.close()
        raise ChannelError(ChannelReason.TIMEOUT, f"connect to {p} did not complete within {timeout} s") from None
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        raise ChannelError(ChannelReason.CLOSED, f"no server at {p}: {exc.strerror}") from None
    except OSError as exc:  # e.g. EACCES on the socket itself
        sock.close()
        raise ChannelError(ChannelReason.FAILED, f"cannot connect to {p}: {exc.strerror}") from None
    except BaseException:
        sock.close()
        raise
    return Channel(sock, limits=limits, allowed_uids=allowed_uids)
