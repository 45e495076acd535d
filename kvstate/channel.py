"""The control channel: AF_UNIX SOCK_SEQPACKET between the workers of one node.

Theory of operation
-------------------

Exporter and importer talk over one connected ``SOCK_SEQPACKET`` socket per importer.
Each message is one packet: a 12-byte header (magic, payload length, fd count), then the
payload bytes, with any file descriptors attached by SCM_RIGHTS. The kernel keeps packet
boundaries, so a frame is never split or merged; a packet larger than the receiver's
cap arrives truncated (MSG_TRUNC) and is refused as a :class:`FrameError`, with every fd
that came with it closed. Payloads are bytes; :func:`encode` / :func:`decode` are a
small strict JSON codec for them (no pickle, no eval).

Trust is checked, not assumed:

- the socket directory must be owned by the expected uid with mode 0700, and neither the
  directory path nor the socket path may contain a symlink (:func:`check_socket_dir`).
  In a 0700 directory only its owner (or root) can swap the entries we check;
- both ends read the peer's credentials (SO_PEERCRED) and refuse a uid outside
  ``allowed_uids`` (default: our own uid) with :class:`PeerRejected`;
- each end opens a pidfd for the peer's pid at connect time, so a peer that dies is
  noticed even when a child it forked still holds the socket open (:class:`PeerDied`).

Every blocking step (connect, accept, send, recv) takes a timeout and raises
:class:`ChannelTimeout` when it passes; there is no unbounded wait. Sockets are
non-blocking and timeouts are enforced with ``poll``, so one thread may ``recv`` while
another ``send``\\ s on the same channel.

A lease is bound to its connection: :class:`Watcher` runs one thread that polls many
channels for hang-up (POLLHUP/POLLRDHUP on the socket, readiness of the peer's pidfd)
without consuming their messages, and calls ``on_close(channel)`` exactly once per
closed channel, so the exporter can end that connection's leases.

Received fds belong to the receiver: close them (``Message.close()``) once imported.
"""

from __future__ import annotations

import base64
import collections
import errno
import json
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvstate.errors import (
    ChannelClosed,
    ChannelError,
    ChannelTimeout,
    ConnectionLimit,
    FrameError,
    PeerDied,
    PeerRejected,
    UnsafeSocketPath,
)

log = logging.getLogger(__name__)

MAGIC = b"KVS\x01"
HEADER = struct.Struct("<4sIH2x")
DEFAULT_MAX_PAYLOAD = 64 * 1024
HARD_MAX_PAYLOAD = 1 << 20
DEFAULT_MAX_FDS = 16
HARD_MAX_FDS = 253  # SCM_MAX_FD
DEFAULT_TIMEOUT = 5.0
DEFAULT_MAX_CONNECTIONS = 128
_REFUSAL_LINGER_S = 1.0
_MAX_LINGERING = 64
_SUN_PATH_MAX = 107
_PEERCRED = struct.Struct("3i")


# -- values -------------------------------------------------------------------------


@attrs.frozen
class PeerCred:
    """The peer's credentials at connect time (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


@attrs.frozen
class Message:
    """One received message. The fds are owned by the receiver: close them when done."""

    payload: bytes
    fds: tuple[int, ...] = ()

    def close(self) -> None:
        for fd in self.fds:
            _close_quietly(fd)

    def __enter__(self) -> Message:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@attrs.frozen
class Limits:
    """Size caps of one channel. Both ends should agree; each enforces its own."""

    max_payload: int = DEFAULT_MAX_PAYLOAD
    max_fds: int = DEFAULT_MAX_FDS

    def __attrs_post_init__(self) -> None:
        if not 0 < self.max_payload <= HARD_MAX_PAYLOAD:
            raise ValueError(f"max_payload must be in 1..{HARD_MAX_PAYLOAD}")
        if not 0 <= self.max_fds <= HARD_MAX_FDS:
            raise ValueError(f"max_fds must be in 0..{HARD_MAX_FDS}")


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _check_timeout(timeout: float) -> float:
    if not (timeout >= 0 and timeout != float("inf")):
        raise ValueError(f"timeout must be finite and >= 0, not {timeout!r}")
    return timeout


def _remaining_ms(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000 + 0.999))


# -- the JSON codec -------------------------------------------------------------------


def encode(obj: Mapping[str, Any]) -> bytes:
    """A JSON object as bytes. ``bytes`` values travel as ``{"$b64": "..."}``."""

    def default(value: Any) -> Any:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return {"$b64": base64.b64encode(bytes(value)).decode("ascii")}
        raise TypeError(f"cannot encode {type(value).__name__}")

    if not isinstance(obj, Mapping):
        raise FrameError("a message must be a JSON object")
    try:
        return json.dumps(obj, default=default, separators=(",", ":"), sort_keys=True,
                          allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise FrameError(f"cannot encode message: {exc}") from None


def decode(data: bytes) -> dict[str, Any]:
    """The inverse of :func:`encode`. Refuses duplicate keys, NaN/Infinity and non-objects."""

    def pairs(items: list[tuple[str, Any]]) -> Any:
        obj = dict(items)
        if len(obj) != len(items):
            raise FrameError("duplicate key in message")
        if set(obj) == {"$b64"}:
            try:
                return base64.b64decode(obj["$b64"], validate=True)
            except (TypeError, ValueError):
                raise FrameError("malformed $b64 value") from None
        return obj

    def bad_constant(name: str) -> Any:
        raise FrameError(f"non-finite number {name} in message")

    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=pairs, parse_constant=bad_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: also an int of >4300 digits
        raise FrameError(f"malformed message: {exc}") from None
    if not isinstance(value, dict):
        raise FrameError("a message must be a JSON object")
    return value


# -- paths ----------------------------------------------------------------------------


def _no_symlinks(path: Path) -> None:
    if not path.is_absolute():
        raise UnsafeSocketPath(str(path), "the path must be absolute")
    if os.path.normpath(path) != str(path):
        raise UnsafeSocketPath(str(path), "the path must be normalised (no '.', '..' or '//')")
    current = Path("/")
    for part in path.parts[1:]:
        current = current / part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return
        except OSError as exc:  # e.g. EACCES: a directory on the way is not ours to search
            raise UnsafeSocketPath(str(path), f"cannot inspect {current}: {exc.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeSocketPath(str(path), f"{current} is a symlink")


def check_socket_dir(directory: str | os.PathLike[str], uid: int | None = None) -> Path:
    """Refuse a socket directory that is not ours alone: a symlink anywhere in its path, not
    a directory, not owned by ``uid`` (default: ours) or not mode 0700."""
    path = Path(directory)
    uid = os.getuid() if uid is None else uid
    _no_symlinks(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafeSocketPath(str(path), "the directory does not exist") from None
    except OSError as exc:
        raise UnsafeSocketPath(str(path), f"cannot inspect the directory: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketPath(str(path), "not a directory")
    if st.st_uid != uid:
        raise UnsafeSocketPath(str(path), f"owned by uid {st.st_uid}, expected {uid}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise UnsafeSocketPath(str(path), f"mode {stat.S_IMODE(st.st_mode):o}, expected 700")
    return path


def make_socket_dir(directory: str | os.PathLike[str]) -> Path:
    """Create (if needed) a private socket directory with mode 0700, and check it."""
    path = Path(directory)
    _no_symlinks(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    return check_socket_dir(path)


def _check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise UnsafeSocketPath(str(path), f"longer than {_SUN_PATH_MAX} bytes")
    check_socket_dir(path.parent)
    _no_symlinks(path)


# -- a connected channel --------------------------------------------------------------


def _peercred(sock: socket.socket) -> PeerCred:
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return PeerCred(pid, uid, gid)


class Channel:
    """One connected SOCK_SEQPACKET socket. Thread-safe for one sender and one receiver."""

    def __init__(self, sock: socket.socket, *, limits: Limits = Limits(),
                 allowed_uids: Iterable[int] | None = None) -> None:
        self._sock = sock
        self.limits = limits
        self._closed = False
        self._close_lock = threading.Lock()
        try:
            sock.setblocking(False)
            self.peer = _peercred(sock)
        except BaseException:
            sock.close()
            raise
        allowed = frozenset(allowed_uids) if allowed_uids is not None else frozenset({os.getuid()})
        if self.peer.uid not in allowed:
            sock.close()
            raise PeerRejected(self.peer.pid, self.peer.uid, allowed)
        try:
            self._pidfd: int | None = os.pidfd_open(self.peer.pid)
        except ProcessLookupError:
            self._pidfd = None  # already gone: the socket reports EOF, and peer_alive says so

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
        return not select.select([self._pidfd], [], [], 0)[0]

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._sock.close()
            if self._pidfd is not None:
                _close_quietly(self._pidfd)

    def _live(self) -> None:
        if self._closed:
            raise ChannelClosed("the channel was closed here")

    def send(self, payload: bytes, fds: Sequence[int] = (), *, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Send one message with ``fds`` attached (they are duplicated; the caller keeps its own)."""
        self._live()
        _check_timeout(timeout)
        if len(payload) > self.limits.max_payload:
            raise FrameError(f"payload of {len(payload)} bytes exceeds the cap of {self.limits.max_payload}")
        if len(fds) > self.limits.max_fds:
            raise FrameError(f"{len(fds)} fds exceed the cap of {self.limits.max_fds}")
        frame = HEADER.pack(MAGIC, len(payload), len(fds)) + payload
        deadline = time.monotonic() + timeout
        while True:
            try:
                if fds:
                    socket.send_fds(self._sock, [frame], list(fds))
                else:
                    self._sock.send(frame)
                return
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                raise ChannelClosed("the peer closed the connection") from None
            except OSError as exc:
                if exc.errno == errno.EBADF and self._closed:
                    raise ChannelClosed("the channel was closed here") from None
                raise
            p = select.poll()
            p.register(self._sock, select.POLLOUT)
            if not p.poll(_remaining_ms(deadline)):
                raise ChannelTimeout(f"send did not complete within {timeout} s")

    def recv(self, timeout: float = DEFAULT_TIMEOUT) -> Message:
        """The next message. Raises ChannelClosed on EOF, PeerDied when the peer process is
        gone and nothing is left to read, ChannelTimeout, or FrameError (fds closed)."""
        self._live()
        _check_timeout(timeout)
        deadline = time.monotonic() + timeout
        cap = HEADER.size + self.limits.max_payload
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(self._sock, cap, max(1, self.limits.max_fds),
                                                      socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                pass
            except ConnectionResetError:
                raise ChannelClosed("the peer reset the connection") from None
            except OSError as exc:
                if exc.errno == errno.EBADF and self._closed:
                    raise ChannelClosed("the channel was closed here") from None
                raise
            else:
                return self._frame(data, fds, flags)
            p = select.poll()
            p.register(self._sock, select.POLLIN)
            if self._pidfd is not None:
                p.register(self._pidfd, select.POLLIN)
            ready = dict(p.poll(_remaining_ms(deadline)))
            if not ready:
                raise ChannelTimeout(f"no message within {timeout} s")
            if self._sock.fileno() not in ready and self._pidfd is not None and self._pidfd in ready:
                raise PeerDied(f"peer process {self.peer.pid} exited")

    def _frame(self, data: bytes, fds: list[int], flags: int) -> Message:
        def refuse(why: str) -> FrameError:
            for fd in fds:
                _close_quietly(fd)
            return FrameError(why)

        if not data and not fds:
            raise ChannelClosed("the peer closed the connection")
        if flags & socket.MSG_TRUNC:
            raise refuse(f"message larger than the cap of {self.limits.max_payload} bytes")
        if flags & socket.MSG_CTRUNC:
            raise refuse(f"more fds than the cap of {self.limits.max_fds}")
        if len(data) < HEADER.size:
            raise refuse(f"frame of {len(data)} bytes is shorter than its header")
        magic, length, nfds = HEADER.unpack_from(data)
        if magic != MAGIC:
            raise refuse(f"bad magic {magic!r}")
        if length != len(data) - HEADER.size:
            raise refuse(f"header says {length} payload bytes, frame carries {len(data) - HEADER.size}")
        if nfds != len(fds) or nfds > self.limits.max_fds:
            raise refuse(f"header says {nfds} fds, {len(fds)} arrived")
        return Message(data[HEADER.size:], tuple(fds))


# -- client and server ----------------------------------------------------------------


def connect(path: str | os.PathLike[str], *, timeout: float = DEFAULT_TIMEOUT,
            allowed_uids: Iterable[int] | None = None, limits: Limits = Limits()) -> Channel:
    """Connect to a server's socket after checking its directory and the server's uid."""
    _check_timeout(timeout)
    p = Path(path)
    _check_socket_path(p)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        sock.connect(str(p))
    except TimeoutError:
        sock.close()
        raise ChannelTimeout(f"connect to {p} did not complete within {timeout} s") from None
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        raise ChannelClosed(f"no server at {p}: {exc.strerror}") from None
    except OSError as exc:  # e.g. EACCES on the socket itself
        sock.close()
        raise ChannelError(f"cannot connect to {p}: {exc.strerror}") from None
    except BaseException:
        sock.close()
        raise
    return Channel(sock, limits=limits, allowed_uids=allowed_uids)


class Server:
    """A listening socket in a private directory. Accept from any thread; close to stop."""

    def __init__(self, path: str | os.PathLike[str], *, allowed_uids: Iterable[int] | None = None,
                 limits: Limits = Limits(), backlog: int = 64,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.path = Path(path)
        self.limits = limits
        self.max_connections = max_connections
        self.allowed_uids = frozenset(allowed_uids) if allowed_uids is not None else frozenset({os.getuid()})
        _check_socket_path(self.path)
        self._remove_stale()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(str(self.path))
            self._sock.listen(backlog)
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise
        self._closed = False

    def _remove_stale(self) -> None:
        """A socket left by a dead server is removed; a live one, or anything else, is refused."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise UnsafeSocketPath(str(self.path), "exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            probe.settimeout(1.0)
            probe.connect(str(self.path))
        except ConnectionRefusedError:
            os.unlink(self.path)
            return
        except OSError as exc:
            raise ChannelError(f"{self.path}: cannot probe the existing socket: {exc}") from None
        finally:
            probe.close()
        raise ChannelError(f"{self.path}: another server is listening there")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def accept(self, timeout: float = DEFAULT_TIMEOUT) -> Channel:
        """The next connection from an allowed uid; PeerRejected (connection closed) otherwise."""
        if self._closed:
            raise ChannelClosed("the server was closed")
        _check_timeout(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                pass
            except OSError as exc:
                if self._closed:
                    raise ChannelClosed("the server was closed") from None
                raise ChannelError(f"accept failed: {exc}") from None
            else:
                return Channel(conn, limits=self.limits, allowed_uids=self.allowed_uids)
            p = select.poll()
            try:
                p.register(self._sock, select.POLLIN)
            except ValueError:  # closed by another thread since the accept above
                raise ChannelClosed("the server was closed") from None
            if not p.poll(_remaining_ms(deadline)):
                if self._closed:
                    raise ChannelClosed("the server was closed")
                raise ChannelTimeout(f"no connection within {timeout} s")

    def serve_in_thread(self, handler: Callable[[Channel], None], *, poll_interval: float = 0.1,
                        name: str = "kvstate-accept") -> threading.Thread:
        """Accept until closed, running ``handler(channel)`` in a thread per connection.
        Rejected peers are logged and skipped. The handler owns (and closes) the channel.

        At most ``max_connections`` handlers run at once: a connection beyond that gets
        one refusal frame (``{"ok": false, "code": "ConnectionLimit", ...}``, the shape of
        every refusal on this channel) and is closed, so a flood of connections costs a
        bounded number of threads."""
        slots = threading.BoundedSemaphore(self.max_connections)
        # Refused channels linger half-closed for a moment, so the refusal is read before a
        # close with the peer's request unread turns into a reset. Bounded: oldest first.
        lingering: collections.deque[tuple[float, Channel]] = collections.deque()

        def run_one(ch: Channel) -> None:
            try:
                handler(ch)
            except Exception:
                log.exception("channel handler failed for %r", ch)
                ch.close()
            finally:
                slots.release()

        def refuse(ch: Channel) -> None:
            exc = ConnectionLimit(self.max_connections)
            log.warning("%s (peer pid %d)", exc, ch.peer.pid)
            try:
                ch.send(encode({"ok": False, "code": "ConnectionLimit", "detail": str(exc)}), timeout=0)
                ch._sock.shutdown(socket.SHUT_WR)
            except (ChannelError, OSError):
                ch.close()  # best effort: the close tells the peer anyway
                return
            lingering.append((time.monotonic() + _REFUSAL_LINGER_S, ch))
            while len(lingering) > _MAX_LINGERING:
                lingering.popleft()[1].close()

        def close_lingering(everything: bool) -> None:
            while lingering and (everything or lingering[0][0] <= time.monotonic()):
                lingering.popleft()[1].close()

        def loop() -> None:
            try:
                accept_loop()
            finally:
                close_lingering(everything=True)

        def accept_loop() -> None:
            while not self._closed:
                close_lingering(everything=False)
                try:
                    ch = self.accept(poll_interval)
                except ChannelTimeout:
                    continue
                except PeerRejected as exc:
                    log.warning("%s", exc)
                    continue
                except ChannelClosed:
                    return
                if not slots.acquire(blocking=False):
                    refuse(ch)
                    continue
                try:
                    threading.Thread(target=run_one, args=(ch,), name=f"{name}-{ch.peer.pid}", daemon=True).start()
                except RuntimeError:  # the interpreter cannot start another thread
                    slots.release()
                    refuse(ch)

        t = threading.Thread(target=loop, name=name, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# -- connection watcher ---------------------------------------------------------------


class Watcher:
    """One thread that tells when watched channels close, so their leases can end.

    ``watch(channel, on_close)`` arms it; ``on_close(channel)`` runs once, on the watcher
    thread, when the peer hangs up or its process exits (the channel itself is not closed
    or read: its pending messages stay readable). :meth:`close` stops the thread.
    """

    def __init__(self, *, name: str = "kvstate-watcher") -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[Channel, Callable[[Channel], None]]] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, channel: Channel, on_close: Callable[[Channel], None]) -> None:
        with self._lock:
            self._watched[id(channel)] = (channel, on_close)
        self._wake()

    def unwatch(self, channel: Channel) -> None:
        with self._lock:
            self._watched.pop(id(channel), None)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    return
                watched = list(self._watched.values())
            p = select.poll()
            p.register(self._wake_r, select.POLLIN)
            owners: dict[int, tuple[Channel, Callable[[Channel], None]]] = {}
            for ch, cb in watched:
                fd = ch.fileno()
                if ch.closed or fd < 0:  # closed here: that ends its leases too
                    owners[-1 - len(owners)] = (ch, cb)
                    continue
                p.register(fd, select.POLLRDHUP)
                owners[fd] = (ch, cb)
                if ch.pidfd is not None:
                    p.register(ch.pidfd, select.POLLIN)
                    owners[ch.pidfd] = (ch, cb)
            # Bounded even here: a missed wake-up costs at most a second.
            ready = [fd for fd, _ in p.poll(0 if any(k < 0 for k in owners) else 1000)]
            if self._wake_r in ready:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            fired = {id(owners[fd][0]): owners[fd] for fd in ready if fd in owners}
            fired.update({id(v[0]): v for k, v in owners.items() if k < 0})
            for key, (ch, cb) in fired.items():
                with self._lock:
                    if self._watched.pop(key, None) is None:
                        continue
                try:
                    cb(ch)
                except Exception:
                    log.exception("on_close callback failed for %r", ch)

    def close(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        with self._lock:
            self._stop = True
        self._wake()
        self._thread.join(_check_timeout(timeout))
        if not self._thread.is_alive():
            _close_quietly(self._wake_r)
            _close_quietly(self._wake_w)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
