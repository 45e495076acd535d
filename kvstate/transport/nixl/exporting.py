"""Banks on host memory, exported to other nodes through NIXL, under the bank machine.

:class:`NixlExportingHost` is the host transport (memfd banks, mapped, pinned and released
by the native layer exactly as for a local bank) whose ``export`` registers the bank's
mapping with this process's NIXL agent and returns a NIXL handle (kind ``nixl``, the
handle bytes of :mod:`kvstate.transport.nixl.handle`, no fd) instead of a memfd. So an
:class:`~kvstate.share.exporter.Exporter` built on it runs the same ``spec/bank.toml``:
``register`` exports, ``advertise`` signs a descriptor carrying the NIXL handle, leases are
granted over the control channel (TCP across nodes, :mod:`kvstate.channel.tcp`), and the
bank becomes quiescent and is released only when no lease is live. NIXL deregistration
does not stop a peer's READ, which is why the lease, not NIXL, decides when the memory
may go: ``unmap`` deregisters first, and the bank reaches it only from ``quiescent``.

Importers read such a bank with :class:`kvstate.share.remote_part.RemotePart`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kvstate.core.capabilities import Access, Capabilities, MemoryKind, Scope
from kvstate.core.errors import ArgumentInvalid, BackendUnavailable
from kvstate.core.reasons import ArgumentReason, BackendReason
from kvstate.core.handles import HandleKind
from kvstate.transport.host import HostAllocation, HostMapping, HostReservation, HostTransport
from kvstate.transport.nixl.transport import NixlAllocation, NixlTransport
from kvstate.transport.protocol import Block, MappedTransport, PendingOp, RegionStats

if TYPE_CHECKING:
    from kvstate.transport.host import HostEndpoint


@attrs.frozen
class NixlExportHandle:
    """A bank exported through NIXL: the handle bytes a descriptor carries, no fd."""

    identity: bytes
    kind: HandleKind = HandleKind.NIXL
    fd: int | None = None


class NixlExportingHost:
    """The host transport, exporting through NIXL; see the module docstring."""

    name = "host+nixl"

    def __init__(self, host: HostTransport, nixl: NixlTransport) -> None:
        self.host = host
        self.nixl = nixl
        self._mapping_of: dict[int, HostMapping] = {}          # allocation id -> the bank's own mapping
        self._registered: dict[int, NixlAllocation] = {}        # allocation id -> its NIXL registration

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(handle_kinds=frozenset({HandleKind.NIXL}), memory_kinds=frozenset({MemoryKind.HOST}),
                            scopes=frozenset({Scope.SAME_NODE, Scope.CROSS_NODE}))

    def granularity(self) -> int:
        return self.host.granularity()

    def device_uuid(self) -> bytes:
        return self.host.device_uuid()

    # -- the exporting half -------------------------------------------------------------

    def create(self, size: int) -> HostAllocation:
        return self.host.create(size)

    def export(self, allocation: HostAllocation, kind: HandleKind) -> NixlExportHandle:
        """Register the bank's mapping with NIXL and return its handle bytes."""
        if kind is not HandleKind.NIXL:
            raise ArgumentInvalid.of("kind", ArgumentReason.RANGE,
                                     f"{self.name} exports banks as {HandleKind.NIXL.value!r} handles, "
                                     f"not {kind.value!r}")
        mapping = self._mapping_of.get(allocation.id)
        if mapping is None:
            raise BackendUnavailable(BackendReason.UNSUPPORTED,
                                     "a bank is exported through NIXL from its mapping: map it first")
        registered = self._registered.get(allocation.id)
        if registered is None:
            registered = self.nixl.register(mapping.addr, mapping.size, MemoryKind.HOST)
            self._registered[allocation.id] = registered
        return NixlExportHandle(self.nixl.export(registered, HandleKind.NIXL))

    def release(self, allocation: HostAllocation) -> None:
        self._deregister(allocation.id)
        self.host.release(allocation)

    def _deregister(self, allocation_id: int) -> None:
        registered = self._registered.pop(allocation_id, None)
        if registered is not None:
            self.nixl.release(registered)

    # -- everything else is the host's ---------------------------------------------------

    def receive_handle(self, kind: HandleKind, data: bytes, fds: Sequence[int]) -> NixlExportHandle:
        raise BackendUnavailable(BackendReason.UNSUPPORTED,
                                 f"{self.name} exports only; import NIXL banks with RemotePart")

    def import_(self, handle: NixlExportHandle, size: int) -> HostAllocation:
        raise BackendUnavailable(BackendReason.UNSUPPORTED,
                                 f"{self.name} exports only; import NIXL banks with RemotePart")

    def reserve(self, size: int) -> HostReservation:
        return self.host.reserve(size)

    def free(self, reservation: HostReservation) -> None:
        self.host.free(reservation)

    def map(self, reservation: HostReservation, offset: int, allocation: HostAllocation) -> HostMapping:
        mapping = self.host.map(reservation, offset, allocation)
        self._mapping_of[allocation.id] = mapping
        return mapping

    def set_access(self, mapping: HostMapping, access: Access) -> None:
        self.host.set_access(mapping, access)

    def unmap(self, mapping: HostMapping) -> None:
        """Deregister from NIXL before the memory goes (a peer's READ must find nothing)."""
        if self._mapping_of.get(mapping.allocation.id) is mapping:
            self._deregister(mapping.allocation.id)
            del self._mapping_of[mapping.allocation.id]
        self.host.unmap(mapping)

    def pin(self, mapping: HostMapping) -> None:
        self.host.pin(mapping)

    def unpin(self, mapping: HostMapping) -> None:
        self.host.unpin(mapping)

    def own(self, mapping: HostMapping, owner: int) -> None:
        self.host.own(mapping, owner)

    def disown(self, mapping: HostMapping, owner: int) -> None:
        self.host.disown(mapping, owner)

    def stats(self, mapping: HostMapping) -> RegionStats:
        return self.host.stats(mapping)

    def view(self, mapping: HostMapping) -> memoryview:
        return self.host.view(mapping)

    def submit_gather(self, src: HostEndpoint, dst: HostEndpoint, blocks: Sequence[Block]) -> PendingOp:
        return self.host.submit_gather(src, dst, blocks)


def _conformance(t: NixlExportingHost) -> None:
    """Checked by mypy, never called: an Exporter accepts it."""
    mapped: MappedTransport[NixlExportHandle, HostAllocation, HostReservation, HostMapping, HostEndpoint] = t
    del mapped
