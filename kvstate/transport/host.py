"""The host backend: sealed memfds with the semantics of CUDA VMM.

==============  =====================================================================
create(size)    a memfd of ``size`` bytes (a multiple of the granularity), sealed
                against shrinking, growing and further sealing
export(a, k)    a :class:`HostHandle`: the (borrowed) fd plus its identity bytes,
                ``handles.fd_identity(st_dev, st_ino)``; only ``HandleKind.MEMFD``
import_(h, n)   check the received fd before anything is mapped: its (dev, ino) must
                equal the handle bytes, it must be a memfd of exactly ``n`` bytes and
                carry the seals; the transport keeps its own duplicate of the fd
reserve(n)      PROT_NONE address space aligned to the granularity
map(r, off, a)  MAP_SHARED | MAP_FIXED inside the reservation, still PROT_NONE: a touch
                before set_access faults, exactly as on CUDA
set_access      mprotect to read or read-write (lowering is refused while pinned)
unmap, release  refuse with Busy (PINNED) while native ops (or leases) pin the region;
                release also refuses while the allocation is still mapped
pin, unpin      a lease's explicit pin on a mapping; stats(m) reports every pin
own, disown     an owner's claim on its mapping (a part's, a bank's token): unmap and
                set_access refuse with Busy (OWNED) until the owner gives it up
view(m)         the mapping's bytes (HostView); submit_gather: a gather on the C op
                engine between mappings and caller buffers
==============  =====================================================================

Constructing a :class:`HostTransport` loads the native module; importing this module
does not. The transport is registered explicitly (``Registry.register(HostTransport())``).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kvstate.core import handles, identity
from kvstate.core.reasons import ImportDefect, ArgumentReason
from kvstate.core.capabilities import Access, Capabilities, MemoryKind, Scope
from kvstate.core.errors import ArgumentInvalid, ImportFailed
from kvstate.core.args import need, need_bytes, need_int, need_items
from kvstate.core.handles import HandleKind
from kvstate.transport.native import Native, Op, RawBuffer, default
from kvstate.transport.protocol import MAX_SIZE, OWNER_MAX, Block, RegionStats

if TYPE_CHECKING:
    from typing import Union

    from kvstate.transport.native import HostBuffer
    from kvstate.transport.protocol import ExportingTransport, HostView, MappedTransport

DEFAULT_GRANULARITY = 2 << 20
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@attrs.frozen
class HostHandle:
    """A memfd handle: the fd (exported: borrowed from the allocation; received: owned by
    whoever received it) and its identity bytes as carried in a descriptor."""

    fd: int
    identity: bytes
    kind: HandleKind = HandleKind.MEMFD


@attrs.frozen
class HostAllocation:
    id: int
    size: int
    imported: bool


@attrs.frozen
class HostReservation:
    id: int
    addr: int
    size: int


@attrs.frozen
class HostMapping:
    region: int
    addr: int
    size: int
    allocation: HostAllocation
    reservation: HostReservation


if TYPE_CHECKING:
    #: What a host op reads or writes: a mapping or caller memory (the protocol's ``E``).
    HostEndpoint = Union[HostMapping, HostBuffer]


def fd_identity_of(fd: int) -> bytes:
    """The handle bytes of ``fd``: its (st_dev, st_ino) as :func:`handles.fd_identity`."""
    st = os.fstat(fd)
    return handles.fd_identity(st.st_dev, st.st_ino)


def host_device_uuid() -> bytes:
    """16 bytes naming host memory on this boot of this host (:mod:`kvstate.core.identity`).

    memfds are kernel objects: any two processes on one running kernel can share one over
    SCM_RIGHTS, whatever their namespaces, so the kernel's boot id is the whole identity."""
    return identity.host_device_uuid(identity.host_boot_id()).value


_CAPABILITIES = Capabilities(handle_kinds=frozenset({HandleKind.MEMFD}), memory_kinds=frozenset({MemoryKind.HOST}),
                             scopes=frozenset({Scope.SAME_NODE}))


class HostTransport:
    """Host memory with VMM semantics. See the module docstring.

    Each operation is one call of the typed C function (:mod:`kvstate.transport.libkvs`);
    a refusal is raised as ``native.error(..)``, the one mapping of C codes to errors."""

    name = "host"

    def __init__(self, *, granularity: int = DEFAULT_GRANULARITY, native: Native | None = None) -> None:
        need_int("granularity", granularity, 1, 1 << 40)
        if native is not None:
            need("native", native, Native)
        self._native = nat = native or default()
        self._lib, self._ffi = nat.lib, nat.ffi
        page = nat.page_size
        if granularity <= 0 or granularity % page or granularity & (granularity - 1):
            raise ArgumentInvalid.native("HostTransport", -1,
                                         f"granularity {granularity} must be a power of two multiple of {page}")
        self._granularity = granularity
        self._device_uuid: bytes | None = None
        lib = self._lib
        self._access = {Access.NONE: lib.KVS_ACCESS_NONE, Access.READ: lib.KVS_ACCESS_READ,
                        Access.READ_WRITE: lib.KVS_ACCESS_READ_WRITE}

    @property
    def native(self) -> Native:
        return self._native

    @property
    def capabilities(self) -> Capabilities:
        return _CAPABILITIES

    def granularity(self) -> int:
        return self._granularity

    def device_uuid(self) -> bytes:
        # The boot id cannot change while this process runs: read it once, not per lease.
        if self._device_uuid is None:
            self._device_uuid = host_device_uuid()
        return self._device_uuid

    def _sized(self, what: str, size: int) -> None:
        need_int("size", size, 1, MAX_SIZE)
        if size % self._granularity:
            raise ArgumentInvalid.native(what, -1, f"size {size} is not a positive multiple of the "
                                         f"granularity {self._granularity}")

    def create(self, size: int) -> HostAllocation:
        self._sized("create", size)
        out = self._ffi.new("uint64_t *")
        rc = self._lib.kvs_create(size, out)
        if rc:
            raise self._native.error(rc, "kvs_create", f"size {size}")
        return HostAllocation(out[0], size, imported=False)

    def export(self, allocation: HostAllocation, kind: HandleKind) -> HostHandle:
        """The allocation's fd, borrowed: send it (SCM_RIGHTS dups it), never close it."""
        need("allocation", allocation, HostAllocation)
        need("kind", kind, HandleKind)
        if kind is not HandleKind.MEMFD:
            raise ArgumentInvalid.of("kind", ArgumentReason.RANGE,
                                     f"the host backend exports only memfd handles, not {kind.value}")
        out = self._ffi.new("int32_t *")
        rc = self._lib.kvs_export_fd(allocation.id, out)
        if rc:
            raise self._native.error(rc, "kvs_export_fd", f"allocation {allocation.id}")
        return HostHandle(out[0], fd_identity_of(out[0]))

    def receive_handle(self, kind: HandleKind, data: bytes, fds: Sequence[int]) -> HostHandle:
        """The handle a descriptor names, with the one fd received with it (borrowed: the
        caller still closes it). Checked again, against the fd itself, by import_."""
        need("kind", kind, HandleKind)
        need_bytes("data", data, 64)
        fds = need_items("fds", fds, int, 16)
        if kind is not HandleKind.MEMFD:
            raise ImportFailed.handle(ImportDefect.KIND,
                                      f"the host backend imports only memfd handles, not {kind.value}")
        if len(fds) != 1:
            raise ImportFailed.handle(ImportDefect.FDS, f"expected one memfd, got {len(fds)} fd(s)")
        # Checked here already, so a group's phase 1 refuses a wrong fd before any rank opens.
        try:
            identity = fd_identity_of(fds[0])
            seals = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
        except OSError as exc:
            raise ImportFailed.handle(ImportDefect.FD_NOT_MEMFD, call="receive_handle", code=-1,
                                      detail=f"fd {fds[0]} is not a sealable memfd: {exc.strerror}") from None
        if identity != data:
            raise ImportFailed.handle(ImportDefect.FD_IDENTITY, call="receive_handle", code=-1,
                                      detail=f"fd {fds[0]} is not the file its descriptor names")
        if seals & _SEALS != _SEALS:
            raise ImportFailed.handle(ImportDefect.FD_UNSEALED, call="receive_handle", code=-1,
                                      detail=f"fd {fds[0]} lacks the shrink, grow and seal seals")
        return HostHandle(fds[0], data)

    def import_(self, handle: HostHandle, size: int) -> HostAllocation:
        """Check a received memfd and adopt a duplicate of it (C checks: a memfd, exactly
        ``size`` bytes, sealed). The caller still owns (and closes) ``handle.fd``."""
        need("handle", handle, HostHandle)
        if handle.kind is not HandleKind.MEMFD:
            raise ImportFailed.handle(ImportDefect.KIND,
                                      f"the host backend imports only memfd handles, not {handle.kind.value}")
        self._sized("import", size)
        if len(handle.identity) != handles.FD_IDENTITY_BYTES:
            raise ImportFailed.handle(ImportDefect.FD_IDENTITY,
                                      call="import", code=-1, detail=f"handle bytes are {len(handle.identity)} long, "
                                      f"expected {handles.FD_IDENTITY_BYTES}")
        try:
            identity = fd_identity_of(handle.fd)
        except OSError as exc:
            raise ImportFailed.handle(ImportDefect.FD, call="import", code=-1,
                                      detail=f"fd {handle.fd} cannot be examined: {exc.strerror}") from None
        if identity != handle.identity:
            raise ImportFailed.handle(ImportDefect.FD_IDENTITY, call="import", code=-1,
                                      detail=f"fd {handle.fd} is not the file its descriptor names")
        out = self._ffi.new("uint64_t *")
        rc = self._lib.kvs_import_fd(handle.fd, size, out)
        if rc:
            raise self._native.error(rc, "kvs_import_fd", f"fd {handle.fd}, expected size {size}")
        return HostAllocation(out[0], size, imported=True)

    def reserve(self, size: int) -> HostReservation:
        """Inaccessible address space, aligned to the granularity."""
        self._sized("reserve", size)
        res, addr = self._ffi.new("uint64_t *"), self._ffi.new("uint64_t *")
        rc = self._lib.kvs_reserve(size, self._granularity, res, addr)
        if rc:
            raise self._native.error(rc, "kvs_reserve", f"size {size}, align {self._granularity}")
        return HostReservation(res[0], addr[0], size)

    def free(self, reservation: HostReservation) -> None:
        """Return a reservation's address space (cuMemAddressFree); refused while mapped."""
        need("reservation", reservation, HostReservation)
        rc = self._lib.kvs_free_reservation(reservation.id)
        if rc:
            raise self._native.error(rc, "kvs_free_reservation", f"reservation {reservation.id}")

    def map(self, reservation: HostReservation, offset: int, allocation: HostAllocation) -> HostMapping:
        """Map the allocation at ``offset`` in the reservation, with no access."""
        need("reservation", reservation, HostReservation)
        need("allocation", allocation, HostAllocation)
        need_int("offset", offset, 0, MAX_SIZE)
        if offset < 0 or offset % self._granularity:
            raise ArgumentInvalid.native("map", -1, f"offset {offset} is not a multiple of the "
                                         f"granularity {self._granularity}")
        region, addr = self._ffi.new("uint64_t *"), self._ffi.new("uint64_t *")
        rc = self._lib.kvs_map(reservation.id, offset, allocation.id, region, addr)
        if rc:
            raise self._native.error(rc, "kvs_map", f"allocation {allocation.id} at offset {offset} "
                                     f"of reservation {reservation.id}")
        return HostMapping(region[0], addr[0], allocation.size, allocation, reservation)

    def set_access(self, mapping: HostMapping, access: Access) -> None:
        need("mapping", mapping, HostMapping)
        need("access", access, Access)
        rc = self._lib.kvs_set_access(mapping.region, self._access[access])
        if rc:
            raise self._native.error(rc, "kvs_set_access", f"region {mapping.region}, access {access.value}")

    def unmap(self, mapping: HostMapping) -> None:
        need("mapping", mapping, HostMapping)
        rc = self._lib.kvs_unmap(mapping.region)
        if rc:
            raise self._native.error(rc, "kvs_unmap", f"region {mapping.region}")

    def release(self, allocation: HostAllocation) -> None:
        need("allocation", allocation, HostAllocation)
        rc = self._lib.kvs_release(allocation.id)
        if rc:
            raise self._native.error(rc, "kvs_release", f"allocation {allocation.id}")

    # -- pins, observation and ops ---------------------------------------------------------

    def submit_blocks(self, src: HostEndpoint | RawBuffer, dst: HostEndpoint | RawBuffer,
                      blocks: Sequence[Block] | HostBuffer, *, notify_fd: int | None = None, fail: bool = False) -> Op:
        """A native copy of ``blocks`` (src_off, dst_off, len) between a mapping and caller
        memory (a :class:`~kvstate.transport.native.RawBuffer` or a buffer), either way; it
        pins the mappings it touches until done and then adds 1 to ``notify_fd``."""
        s = src.region if isinstance(src, HostMapping) else src
        d = dst.region if isinstance(dst, HostMapping) else dst
        return self._native.submit_gather(s, d, blocks, notify_fd=notify_fd, fail=fail)

    def pin(self, mapping: HostMapping) -> None:
        """An explicit pin (a lease's): unmap and release refuse until :meth:`unpin`."""
        need("mapping", mapping, HostMapping)
        rc = self._lib.kvs_region_pin(mapping.region)
        if rc:
            raise self._native.error(rc, "kvs_region_pin", f"region {mapping.region}")

    def unpin(self, mapping: HostMapping) -> None:
        need("mapping", mapping, HostMapping)
        rc = self._lib.kvs_region_unpin(mapping.region)
        if rc:
            raise self._native.error(rc, "kvs_region_unpin", f"region {mapping.region} (explicit pins only)")

    def own(self, mapping: HostMapping, owner: int) -> None:
        """Claim ``mapping`` for ``owner`` (a part's or a bank's nonzero token): unmap and
        set_access refuse (Busy, OWNED) until the owner disowns it."""
        need("mapping", mapping, HostMapping)
        need_int("owner", owner, 1, OWNER_MAX)
        rc = self._lib.kvs_region_own(mapping.region, owner)
        if rc:
            raise self._native.error(rc, "kvs_region_own", f"region {mapping.region}")

    def disown(self, mapping: HostMapping, owner: int) -> None:
        need("mapping", mapping, HostMapping)
        need_int("owner", owner, 1, OWNER_MAX)
        rc = self._lib.kvs_region_disown(mapping.region, owner)
        if rc:
            raise self._native.error(rc, "kvs_region_disown", f"region {mapping.region}")

    def stats(self, mapping: HostMapping) -> RegionStats:
        """Pins, ops in flight, completed and failed ops and bytes of one mapping."""
        need("mapping", mapping, HostMapping)
        return self._native.region_stats(mapping.region)

    def view(self, mapping: HostMapping) -> memoryview:
        """The mapping's bytes. Touching them before set_access faults (SIGSEGV)."""
        need("mapping", mapping, HostMapping)
        st = self._native.region_stats(mapping.region)  # refuses a mapping that is gone
        return memoryview(self._ffi.buffer(self._ffi.cast("char *", st.addr), st.size))

    def submit_gather(self, src: HostEndpoint, dst: HostEndpoint, blocks: Sequence[Block] | HostBuffer) -> Op:
        """A native gather between mappings and caller buffers; it pins the mappings it
        touches until it finishes."""
        return self._native.submit_gather(src.region if isinstance(src, HostMapping) else src,
                                          dst.region if isinstance(dst, HostMapping) else dst, blocks)


def _conformance(t: HostTransport) -> None:
    """Checked by mypy, never called: the host backend implements these protocols."""
    mapped: MappedTransport[HostHandle, HostAllocation, HostReservation, HostMapping, HostEndpoint] = t
    exporting: ExportingTransport[HostHandle, HostAllocation] = t
    viewable: HostView[HostMapping] = t
    del mapped, exporting, viewable
