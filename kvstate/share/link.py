"""The C side of an importer's persistent channel (``ffi/kvs_link.c``), seen from Python.

Why C: the importer's renewal thread (:mod:`kvstate.share.renewal`) sends on the same
connection as Python's requests, and must do so while Python holds the GIL for seconds.
So the frame I/O of a :class:`~kvstate.share.peers.PeerLink` and its one lock live in
C: a request, a notification, a pipelined exchange (:meth:`NativeLink.lock` around
:meth:`send` and :meth:`recv`) and the renewal thread each hold the link's mutex, and
cffi drops the GIL while a call waits for it or for the peer.

The frames and refusals are :mod:`kvstate.channel.framing`'s (it stays the code of
every other channel: exporter, coordinator, TCP); :func:`link_error` gives each C code
the :class:`ChannelError` reason and message :class:`~kvstate.channel.Channel` would.
The :class:`~kvstate.channel.Channel` the link was made from keeps its socket for the
credential checks and the watcher; the link holds duplicates of that socket and of the
peer's pidfd, and closing either one shuts the connection for both.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvstate import channel as chan
from kvstate.channel.framing import check_timeout
from kvstate.core.errors import ChannelError
from kvstate.core.reasons import ChannelReason
from kvstate.transport import libkvs


def _ns(seconds: float) -> int:
    """A checked timeout in int64 nanoseconds (a longer one waits 126 years)."""
    return int(min(seconds, 4e9) * 1e9)


def link_error(code: int, *, err: int = 0, frame: libkvs.FramePtr | None = None, pid: int = 0,
               timeout: float = 0.0, sending: bool = False, limits: chan.Limits = chan.Limits(),
               size: int = 0, nfds: int = 0) -> ChannelError:
    """The ChannelError of a refused link call, worded as :class:`~kvstate.channel.Channel`
    and :func:`kvstate.channel.framing.unpack` word it."""
    ffi, lib = libkvs.load()
    frame_error = {
        lib.KVS_E_LINK_TRUNC: lambda: f"message larger than the cap of {limits.max_payload} bytes",
        lib.KVS_E_LINK_CTRUNC: lambda: (f"fds dropped (MSG_CTRUNC): more than the cap of {limits.max_fds}, or this "
                                        f"process is out of fds"),
        lib.KVS_E_LINK_SHORT: lambda: f"frame of {frame.len if frame else 0} bytes is shorter than its header",
        lib.KVS_E_LINK_MAGIC: lambda: f"bad magic {bytes(ffi.buffer(frame.magic, 4)) if frame else b''!r}",
        lib.KVS_E_LINK_LENGTH: lambda: (f"header says {frame.said_len if frame else 0} payload bytes, frame carries "
                                        f"{(frame.len if frame else 0) - lib.KVS_LINK_HEADER}"),
        lib.KVS_E_LINK_FDS: lambda: (f"header says {frame.said_fds if frame else 0} fds, "
                                     f"{frame.nfds if frame else 0} arrived"),
        lib.KVS_E_LINK_CAP: lambda: (f"payload of {size} bytes exceeds the cap of {limits.max_payload}"
                                     if size > limits.max_payload else f"{nfds} fds exceed the cap of {limits.max_fds}"),
        lib.KVS_E_LINK_TOOBIG: lambda: (f"a {size + lib.KVS_LINK_HEADER}-byte message is larger than this socket "
                                        f"sends at once (its send buffer; see net.core.wmem_default)"),
        lib.KVS_E_LINK_SHORT_SEND: lambda: (f"send sent {err} of {size + lib.KVS_LINK_HEADER} bytes; the channel is "
                                            f"closed"),
    }
    if code in frame_error:
        return ChannelError(ChannelReason.FRAME, frame_error[code]())
    if code == lib.KVS_E_LINK_CLOSED:
        return ChannelError(ChannelReason.CLOSED, "the peer closed the connection")
    if code == lib.KVS_E_LINK_PEER_DIED:
        return ChannelError(ChannelReason.PEER_DIED, f"peer process {pid} exited")
    if code == lib.KVS_E_LINK_TIMEOUT:
        return ChannelError(ChannelReason.TIMEOUT, f"send did not complete within {timeout} s" if sending
                            else f"no message within {timeout} s")
    if code == lib.KVS_E_LINK_SYS:
        return ChannelError(ChannelReason.FAILED, f"{'send' if sending else 'recv'} failed: {os.strerror(err)}")
    return ChannelError(ChannelReason.FAILED, f"link call failed with code {code}")


class NativeLink:
    """A request link over the connected socket of ``channel``: one exchange at a time."""

    def __init__(self, channel: chan.Channel, limits: chan.Limits, *, stream: bool = False,
                 spin_s: float = 0.0) -> None:
        """``stream``: ``channel`` is a TCP stream (:mod:`kvstate.channel.tcp`, its handshake
        done): frames without fds, read and written in pieces. ``spin_s``: a wait for an
        answer polls this long before it sleeps (``ImportConfig.answer_spin_s``)."""
        ffi, lib = libkvs.load()
        self._ffi, self._lib = ffi, lib
        self.limits = limits
        self.pid = channel.peer.pid
        pidfd = channel.pidfd
        if stream:
            ptr = lib.kvs_link_open_stream(channel.fileno(), limits.max_payload)
        else:
            ptr = lib.kvs_link_open(channel.fileno(), -1 if pidfd is None else pidfd, limits.max_payload,
                                    limits.max_fds)
        if ptr == ffi.NULL:
            raise ChannelError(ChannelReason.FAILED, f"cannot set up the request link: {os.strerror(ffi.errno)}")
        self.ptr = ffi.gc(ptr, lib.kvs_link_unref)
        self.spin_s = spin_s
        lib.kvs_link_set_spin(self.ptr, _ns(spin_s))
        channel.on_close = self.close  # closing either end closes the connection for both

    @property
    def caught(self) -> int:
        """How many waits took their answer while they polled (the spin paid)."""
        return int(self._lib.kvs_link_caught(self.ptr))

    @property
    def closed(self) -> bool:
        return bool(self._lib.kvs_link_closed(self.ptr))

    def close(self) -> None:
        """Shut the connection down now (the exporter ends its leases on it)."""
        self._lib.kvs_link_close(self.ptr)

    def lock(self) -> None:
        """Hold the link (waits, without the GIL, for a request in progress)."""
        self._lib.kvs_link_lock(self.ptr)

    def unlock(self) -> None:
        self._lib.kvs_link_unlock(self.ptr)

    def _message(self, f: libkvs.FramePtr, buf: libkvs.CharPtr) -> chan.Message:
        return chan.Message(bytes(self._ffi.buffer(buf, f.len)), tuple(f.fds[i] for i in range(f.nfds)))

    def send(self, payload: bytes, fds: Sequence[int] = (), *, timeout: float = chan.DEFAULT_TIMEOUT) -> None:
        """Send one frame; the caller holds the link (:meth:`lock`)."""
        check_timeout(timeout)
        err = self._ffi.new("int32_t *")
        arr = self._ffi.new("int32_t[]", max(1, len(fds)))
        for i, fd in enumerate(fds):
            arr[i] = fd
        rc = self._lib.kvs_link_send(self.ptr, payload, len(payload), arr, len(fds), _ns(timeout), err)
        if rc:
            raise link_error(rc, err=err[0], pid=self.pid, timeout=timeout, sending=True, limits=self.limits,
                             size=len(payload), nfds=len(fds))

    def recv(self, timeout: float = chan.DEFAULT_TIMEOUT) -> chan.Message:
        """The next frame (its fds are the caller's); the caller holds the link."""
        check_timeout(timeout)
        f = self._ffi.new("kvs_frame *")
        buf = self._ffi.new("uint8_t[]", self.limits.max_payload)
        f.buf, f.cap = buf, self.limits.max_payload
        rc = self._lib.kvs_link_recv(self.ptr, f, _ns(timeout))
        if rc:
            raise link_error(rc, err=f.err, frame=f, pid=self.pid, timeout=timeout, limits=self.limits)
        return self._message(f, buf)

    def request(self, payload: bytes, timeout: float) -> chan.Message:
        """Send ``payload`` and return the answer, under the link's lock. Any failure
        closes the link: a late answer would be read as the next request's."""
        check_timeout(timeout)
        f = self._ffi.new("kvs_frame *")
        buf = self._ffi.new("uint8_t[]", self.limits.max_payload)
        f.buf, f.cap = buf, self.limits.max_payload
        rc = self._lib.kvs_link_request(self.ptr, payload, len(payload), f, _ns(timeout))
        if rc:
            sending = rc in (self._lib.KVS_E_LINK_CAP, self._lib.KVS_E_LINK_TOOBIG, self._lib.KVS_E_LINK_SHORT_SEND)
            raise link_error(rc, err=f.err, frame=f, pid=self.pid, timeout=timeout, limits=self.limits,
                             size=len(payload), sending=sending)
        return self._message(f, buf)
