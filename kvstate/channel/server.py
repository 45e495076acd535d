"""The listening side of the control channel: accept, bounded handler threads, refusal
frames past the connection limit, removal of a dead server's stale socket."""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from kvstate.channel import owner
from kvstate.channel.conn import Channel, check_uids, poll_until
from kvstate.channel.framing import DEFAULT_TIMEOUT, Limits, check_timeout, encode
from kvstate.channel.paths import check_socket_path
from kvstate.core.errors import ChannelError, Busy
from kvstate.core.reasons import ChannelReason

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 128
_REFUSAL_LINGER_S = 1.0
_MAX_LINGERING = 64


class Server:
    """A listening socket in a private directory. Accept from any thread; close to stop."""

    def __init__(self, path: str | os.PathLike[str], *, allowed_uids: Iterable[int] | None = None,
                 limits: Limits = Limits(), backlog: int = 64,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        if type(max_connections) is not int or max_connections < 1:
            raise ChannelError(ChannelReason.SETUP, f"max_connections must be an int >= 1, not {max_connections!r:.40}")
        if type(backlog) is not int or not 1 <= backlog <= 4096:
            raise ChannelError(ChannelReason.SETUP, f"backlog must be an int in 1..4096, not {backlog!r:.40}")
        if not isinstance(limits, Limits):
            raise ChannelError(ChannelReason.SETUP, f"limits must be Limits, not {type(limits).__name__}")
        check_uids(allowed_uids)
        self.path = Path(path)
        self.limits = limits
        self.max_connections = max_connections
        self.allowed_uids = frozenset(allowed_uids) if allowed_uids is not None else frozenset({os.getuid()})
        check_socket_path(self.path, must_exist=False)
        # One start at a time per directory: what dead servers left goes, then this
        # server's mark is taken before its socket exists (kvstate.channel.owner).
        try:
            with owner.directory_locked(self.path.parent):
                self._start(backlog)
        except OSError as exc:  # EMFILE, ENOSPC, EACCES, EADDRINUSE...: nothing of this start stays
            raise ChannelError(ChannelReason.FAILED, f"{self.path}: cannot listen: {exc.strerror or exc}") from None
        self._closed = False

    def _start(self, backlog: int) -> None:
        """Sweep, take the mark, bind and listen, with the directory locked; on any failure
        neither the socket file nor the mark stays."""
        swept = owner.sweep(self.path.parent)
        if swept:
            log.info("%s: removed what dead servers left: %s", self.path.parent, ", ".join(swept))
        self._remove_stale()
        self._mark = owner.OwnerMark(self.path)
        bound = False
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                self._sock.bind(str(self.path))
                bound = True
                self._ino = os.lstat(self.path).st_ino  # close() removes only this socket, never a successor's
                self._sock.listen(backlog)
                self._sock.setblocking(False)
            except BaseException:
                self._sock.close()
                raise
        except BaseException:
            if bound:
                os.unlink(self.path)
            self._mark.release()
            raise

    def _remove_stale(self) -> None:
        """A socket left by a dead server is removed; a live one, or anything else, is refused."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ChannelError.unsafe_path(str(self.path), "exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            probe.settimeout(1.0)
            probe.connect(str(self.path))
        except ConnectionRefusedError:
            os.unlink(self.path)
            return
        except OSError as exc:
            raise ChannelError(ChannelReason.FAILED, f"{self.path}: cannot probe the existing socket: {exc}") from None
        finally:
            probe.close()
        raise ChannelError(ChannelReason.FAILED, f"{self.path}: another server is listening there")

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        """The listening socket, for a server that serves it elsewhere (the exporter's
        native lease thread); it stays this object's to close."""
        return self._sock.fileno()

    def accept(self, timeout: float = DEFAULT_TIMEOUT) -> Channel:
        """The next connection from an allowed uid; ChannelError (REJECTED) (connection closed) otherwise."""
        if self._closed:
            raise ChannelError(ChannelReason.CLOSED, "the server was closed")
        check_timeout(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                pass
            except OSError as exc:
                if self._closed:
                    raise ChannelError(ChannelReason.CLOSED, "the server was closed") from None
                raise ChannelError(ChannelReason.FAILED, f"accept failed: {exc}") from None
            else:
                return Channel(conn, limits=self.limits, allowed_uids=self.allowed_uids)
            p = select.poll()
            try:
                p.register(self._sock, select.POLLIN)
            except ValueError:  # closed by another thread since the accept above
                raise ChannelError(ChannelReason.CLOSED, "the server was closed") from None
            if not poll_until(p, deadline):
                if self._closed:
                    raise ChannelError(ChannelReason.CLOSED, "the server was closed")
                raise ChannelError(ChannelReason.TIMEOUT, f"no connection within {timeout} s")

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
            exc = Busy.connections(self.max_connections)
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
                except ChannelError as exc:
                    if exc.reason in (ChannelReason.TIMEOUT, ChannelReason.REJECTED):
                        if exc.reason is ChannelReason.REJECTED:
                            log.warning("%s", exc)
                        continue
                    if exc.closed:
                        return
                    # EMFILE, ENOBUFS, ECONNABORTED...: the server goes on
                    log.warning("%s: %s", self.path, exc)
                    time.sleep(poll_interval)  # a connection left in the backlog must not spin a core
                    continue
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
            with owner.directory_locked(self.path.parent):  # no start binds this name meanwhile
                if os.lstat(self.path).st_ino == self._ino:
                    os.unlink(self.path)
        except OSError:
            pass  # gone already, or its directory with it
        self._mark.release()  # last: while it is held, no sweep judges this socket dead
