"""A rank part on another node, read through NIXL, under the same part machine.

A :class:`RemotePart` is a :class:`~kvstate.share.importer.Part` (``spec/part.toml``, the
same rows, guards and effects by name) whose bank lives on another node, exported by
:class:`~kvstate.transport.nixl.exporting.NixlExportingHost`:

- leased (phase 1, ``native_lease``): asks the exporter for a lease over the control
  channel (TCP across nodes, :mod:`kvstate.channel.tcp`; the descriptor names the
  address) and checks its report; opened (phase 2, ``native_import``, once every rank of
  the group holds a lease): checks the NIXL handle bytes and loads the peer agent's
  metadata. Nothing is mapped: a
  NIXL part is read with one-sided READs, each under a :class:`LeaseGate` whose deadline
  the importer computes from the moment it asked, so it never outlives the exporter's;
- pinned: every READ in flight counts as a pin, so ``part_unpinned`` (and with it a
  drain, and ``close``) waits for the READs, as it waits for native ops on a mapping;
- drained and released: ``unmap_close`` ends the gate, retires the remote view, then
  returns the lease; the exporter's bank reaches ``quiescent`` and is released only when
  no lease is live (its ``native_quiescent``), the one thing that stops a peer's READ.

The exporter's death is seen on the lease channel (EOF or reset on TCP; pidfd too on one
node) through the importer's watcher, as for a local part.

Renewal without the GIL: once granted, a lease on a TCP channel is renewed by the
importer's native renewal thread (:mod:`kvstate.share.renewal`), as a local part's is, on
a stream link over the same socket (:class:`~kvstate.share.link.NativeLink`); every later
request of the part (``mapped``, ``release``) takes that link's lock, so the thread's
renewals and Python's requests never interleave on the stream. The READ gate follows the
thread's renewals (each counted from when it was asked). Before this, a prefill worker
whose engine held the GIL renewed late and its leases expired under it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

from kvstate import channel as chan
from kvstate.core.reasons import TransferFailReason
from kvstate.channel.tcp import SCHEME, TcpChannel, connect_tcp
from kvstate.core.descriptor import Descriptor
from kvstate.core.geometry import Geometry
from kvstate.core.errors import ChannelError, ImportFailed, TransferFailed
from kvstate.core.machine import effect, guard
from kvstate.share.link import NativeLink
from kvstate.share.part import Part, PartOwner, _check_report, _grant_fields, _release_quietly, lease_request
from kvstate.transport.nixl.transport import LeaseGate, NixlAllocation, NixlRemote, NixlTransport
from kvstate.transport.protocol import A, E, H, M, R

log = logging.getLogger(__name__)


def connect_lease_channel(address: str, part: Part[Any, Any, Any, Any, Any], timeout: float) -> chan.Channel:
    """The control channel a descriptor names: ``tcp://`` across nodes, a socket path on one."""
    if address.startswith(SCHEME):
        return connect_tcp(address, part.group.importer.config.deployment, timeout=timeout)
    return chan.connect(address, timeout=timeout)


class RemotePart(Part[H, A, R, M, E]):
    """One rank part on another node; see the module docstring."""

    def __init__(self, group: PartOwner[H, A, R, M, E], descriptor: Descriptor, nixl: NixlTransport) -> None:
        super().__init__(group, descriptor)
        self.nixl = nixl
        self.remote: NixlRemote | None = None
        self.gate: LeaseGate | None = None
        self.inflight = 0
        self._inflight_lock = threading.Lock()
        self._link: NativeLink | None = None  # the lease channel's stream link, while renewed natively

    def pins(self) -> int:
        """READs in flight: NIXL pins nothing, so the part counts its own."""
        return self.inflight

    @guard("part_unpinned")
    def _unpinned(self, **kw: Any) -> bool:
        return self.pins() == 0

    @effect("native_lease")
    def _lease(self, **kw: Any) -> Callable[[], None]:
        """Phase 1: the lease over the control channel and its checks; nothing is opened
        (NIXL has not seen the handle yet)."""
        d = self.descriptor
        timeout = self.group.importer.config.request_timeout_s
        asked_ns = time.monotonic_ns()
        with ExitStack() as undo:
            stage = "connect and handshake"
            try:
                ch = connect_lease_channel(d.socket_path, self, timeout)
                undo.callback(ch.close)
                stage = "lease request"
                ch.send(lease_request(d, self.group.blocks), timeout=timeout)
                stage = "lease answer"
                with ch.recv(timeout=timeout) as msg:
                    reply = chan.decode(msg.payload)
            except ChannelError as exc:  # which step, and when: a timeout's evidence
                log.warning("%s: lease from %s failed at its %s after %.3f s: %s", self.label, d.socket_path,
                            stage, (time.monotonic_ns() - asked_ns) / 1e9, exc)
                raise
            if not reply.get("ok"):
                raise ImportFailed.lease_refused(str(reply.get("code")), str(reply.get("detail")))
            log.debug("t=%.6f %s: lease granted (asked at t=%.6f)", time.monotonic(), self.label, asked_ns / 1e9)
            lease_id, expires_in_s = _grant_fields(reply, d.rank)
            undo.callback(_release_quietly, ch, d.rank, lease_id)
            _check_report(reply, d)
            gate = LeaseGate(self.label, requested_at_ns=asked_ns, duration_s=max(expires_in_s, 1e-3),
                             renewed=self._renewed_deadline)
            self.group.importer._watch(self, ch)  # raises if the importer is closing
            native = self._renew_natively(ch, d.rank, lease_id, expires_in_s, asked_ns / 1e9)
            link, key = native if native is not None else (None, None)
            undo.pop_all()
        self.channel, self.lease_id, self.gate = ch, lease_id, gate
        self._link, self.renewal_key = link, key
        self.lease_s = expires_in_s
        self.renewed_at = time.monotonic()
        self.lease_expires_at = self.renewed_at + expires_in_s
        return self._return_lease

    def _renew_natively(self, ch: chan.Channel, rank: int, lease_id: int, term_s: float,
                        asked_at: float) -> tuple[NativeLink, int] | None:
        """Hand the lease on ``ch`` (a TCP channel) to the importer's renewal thread: the
        stream link and the key, or None when renewal stays with Python (native renewal
        off, the importer closing, or a channel on this node)."""
        renewal = self.group.importer.renewal
        if renewal is None or not isinstance(ch, TcpChannel):
            return None
        link = NativeLink(ch, chan.Limits(), stream=True)
        key = renewal.add(self, link, rank, lease_id, term_s, asked_at)
        if key is None:
            link.close()
            return None
        return link, key

    def _renewed_deadline(self) -> int | None:
        """The lease's end as the renewal thread last had it granted (monotonic ns)."""
        native = self._renewed()
        return None if native is None else int(native[1] * 1e9)

    def _send_notice(self, payload: bytes, timeout: float) -> None:
        """A notification on the lease channel: under the stream link's lock while the
        renewal thread shares it, else under the part's."""
        link, ch = self._link, self.channel
        if link is not None:
            link.lock()
            try:
                link.send(payload, timeout=timeout)
            finally:
                link.unlock()
        elif ch is not None:
            with self._channel_lock:
                ch.send(payload, timeout=timeout)

    @effect("native_import")
    def _import(self, **kw: Any) -> None:
        """Phase 2: check the NIXL handle bytes and load the peer's metadata."""
        d = self.descriptor
        ch = self.channel
        if ch is None:
            raise ImportFailed.lease_refused("not_leased", f"{self.label} holds no lease to open")
        timeout = self.group.importer.config.request_timeout_s
        with ExitStack() as undo:
            # the handle bytes are checked, against the descriptor's generation too, before NIXL sees them
            remote = self.nixl.import_(d.handle, d.size, generation=d.generation)
            log.debug("t=%.6f %s: nixl metadata loaded", time.monotonic(), self.label)
            undo.callback(self.nixl.close_remote, remote, "import rolled back")
            self._send_notice(chan.encode({"op": "mapped", "rank": d.rank, "lease": self.lease_id}), timeout)
            undo.pop_all()
        self.remote = remote

    def renew(self) -> float:
        """Renew the lease, and with it the READ gate: its new deadline counts from the
        moment the renewal was asked, so it never outlives the exporter's."""
        asked_ns = time.monotonic_ns()
        expires_in_s = super().renew()
        if self.gate is not None and self.gate.live:
            self.gate = LeaseGate(self.label, requested_at_ns=asked_ns, duration_s=max(expires_in_s, 1e-3))
        return expires_in_s

    def _return_lease(self) -> None:
        """End the gate (no READ starts after this), then return the lease: on the stream
        link once the renewal thread let go of it (no renewal after the release)."""
        if self.gate is not None:
            self.gate.end("returned")
        self.gate = None
        link, self._link = self._link, None
        if link is None:
            super()._return_lease()
            return
        key, self.renewal_key = self.renewal_key, None
        renewal = self.group.importer.renewal
        if key is not None and renewal is not None:
            renewal.remove(key)
        ch, self.channel = self.channel, None
        if ch is not None:
            self.group.importer._unwatch(ch)
        try:
            with link.request(chan.encode({"op": "release", "rank": self.rank, "lease": self.lease_id}), 1.0) as msg:
                chan.decode(msg.payload)
        except (ChannelError, ImportFailed):  # gone, or the lease ended already: the close ends it too
            pass
        if ch is not None:
            ch.close()
        link.close()

    @effect("unmap_close")
    def _unmap_close(self, **kw: Any) -> None:
        """End the gate (no READ starts after this), retire the view, return the lease."""
        if self.gate is not None:
            self.gate.end("closed")
        if self.remote is not None:
            self.nixl.close_remote(self.remote, "closed")
        self.remote = None
        self._return_lease()

    # -- loads --------------------------------------------------------------------------

    def pin(self) -> Callable[[], None]:
        """Count one READ in flight; returns its undo (:meth:`unpin`)."""
        with self._inflight_lock:
            self.inflight += 1
        return self.unpin

    def unpin(self) -> None:
        """The READ ended (done, failed or never posted)."""
        with self._inflight_lock:
            self.inflight -= 1

    def read(self, blocks: Sequence[int], dst: NixlAllocation, *, timeout: float) -> int:
        """READ bank blocks ``blocks`` into blocks 0..n-1 of ``dst`` (registered with this
        process's agent), each block's regions back to back in the geometry's order; the
        caller pinned the part. Returns the bytes read."""
        chunks, chunk_bytes = block_chunks(self.descriptor.geometry, blocks, self.label)
        if self.remote is None or self.gate is None:
            raise TransferFailed(TransferFailReason.LOAD, f"{self.label}: not imported")
        self.nixl.load(self.remote, dst, chunks, block_bytes=chunk_bytes, lease=self.gate, timeout=timeout)
        return len(chunks) * chunk_bytes


def block_chunks(g: Geometry, blocks: Sequence[int], label: str) -> tuple[list[int], int]:
    """The READ units of ``blocks``: NIXL reads equal chunks numbered from the bank's
    start, so every region's block must be one run of the same size ``c`` starting at a
    multiple of ``c`` (a block-major bank: one chunk per block; a layer-major one, as
    vLLM's CPU layout is, one per region and block). Returns the chunk numbers, block by
    block and region by region within a block, and ``c``."""
    runs = {r.runs() for r in g.regions}
    sizes = {r.block_bytes for r in g.regions}
    if len(sizes) != 1 or any(len(rr) != 1 or rr[0][0] != 0 for rr in runs):
        raise TransferFailed(TransferFailReason.LOAD, f"{label}: NIXL parts read banks whose regions each hold a "
                             "block as one run of one common size")
    c = sizes.pop()
    out = []
    for b in blocks:
        for r in g.regions:
            start = r.offset + b * r.block_stride_bytes
            if start % c:
                raise TransferFailed(TransferFailReason.LOAD, f"{label}: region {r.name!r} block {b} starts at "
                                     f"{start}, not a multiple of its {c} bytes")
            out.append(start // c)
    return out, c
