"""Hang-up detection for many channels on one thread, so leases end with their peers.

A lease is bound to its connection. :class:`Watcher` polls many channels for hang-up
(POLLRDHUP on the socket, readiness of the peer's pidfd) without consuming their
messages, and calls ``on_close(channel)`` exactly once per closed channel.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable

from kvstate.channel.conn import Channel
from kvstate.channel.framing import DEFAULT_TIMEOUT, check_timeout, close_quietly
from kvstate.core.errors import ChannelError
from kvstate.core.reasons import ChannelReason

log = logging.getLogger(__name__)

#: The pause after a failed poll, so a persistent failure does not spin a core.
_RETRY_S = 0.05


class Watcher:
    """One thread that tells when watched channels close, so their leases can end.

    ``watch(channel, on_close)`` arms it; ``on_close(channel)`` runs once, on the watcher
    thread, when the peer hangs up or its process exits (the channel itself is not closed
    or read: its pending messages stay readable). :meth:`close` stops the thread.
    """

    def __init__(self, *, name: str = "kvstate-watcher") -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[Channel, Callable[[Channel], None]]] = {}
        try:
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:  # EMFILE, ENFILE
            raise ChannelError(ChannelReason.FAILED,
                               f"cannot make the watcher's wake-up pipe: {exc.strerror or exc}") from None
        self._stop = False
        self._wake_closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        try:
            self._thread.start()
        except RuntimeError as exc:  # the interpreter cannot start another thread
            close_quietly(self._wake_r)
            close_quietly(self._wake_w)
            raise ChannelError(ChannelReason.FAILED, f"cannot start the watcher thread: {exc}") from None

    def watch(self, channel: Channel, on_close: Callable[[Channel], None]) -> None:
        if not isinstance(channel, Channel) or not callable(on_close):
            raise ChannelError(ChannelReason.SETUP,
                               f"watch takes a Channel and a callable, not {type(channel).__name__} and "
                               f"{type(on_close).__name__}")
        with self._lock:
            if self._stop:
                raise ChannelError(ChannelReason.CLOSED,
                                   "this watcher is closed: nothing would tell when the channel closes")
            self._watched[id(channel)] = (channel, on_close)
        self._wake()

    def unwatch(self, channel: Channel) -> None:
        with self._lock:
            self._watched.pop(id(channel), None)
        self._wake()

    def _wake(self) -> None:
        # Under the lock, and never after close: the wake-up fds are closed then, and a
        # write to a closed fd number could land in whatever file reused it.
        with self._lock:
            if self._wake_closed:
                return
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
            try:
                ready = [fd for fd, _ in p.poll(0 if any(k < 0 for k in owners) else 1000)]
            except OSError as exc:  # ENOMEM on a busy host: this thread ends leases, so it stays
                log.warning("watcher poll failed (%s); polling again", exc.strerror or exc)
                time.sleep(_RETRY_S)
                continue
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
        self._thread.join(check_timeout(timeout))
        if not self._thread.is_alive():
            with self._lock:
                if not self._wake_closed:
                    self._wake_closed = True
                    close_quietly(self._wake_r)
                    close_quietly(self._wake_w)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
