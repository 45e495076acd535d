"""The cuda backend: CUDA device memory with the host backend's semantics, on the C engine.

==============  =====================================================================
create(size)    ``cuMemCreate`` of pinned device memory, exportable as the transport's
                kind (POSIX fd by default, FABRIC after a passing trial); legacy
                ``cuMemAlloc`` when the transport was built for ``CUDA_IPC``
export(a, k)    a :class:`CudaHandle`: POSIX fd (owned by the allocation, sent by
                SCM_RIGHTS) with its (dev, ino) identity bytes; or the 64 FABRIC /
                legacy IPC handle bytes and no fd
receive_handle  (kind, bytes, received fds) -> CudaHandle, after exact kind, size and
                fd-count checks and the fd identity check; nothing is opened
import_(h, n)   ``cuMemImportFromShareableHandle`` (VMM) or ``cuIpcOpenMemHandle``, then
                ``cuMemGetAddressRange``: the opened memory must hold ``n`` bytes
reserve(n)      ``cuMemAddressReserve`` aligned to the granularity
map(r, off, a)  ``cuMemMap``; no access until set_access, exactly as the host backend
set_access      ``cuMemSetAccess`` for this device; lowering refused while pinned
unmap, release  refuse with Busy (PINNED) while ops or leases pin the mapping; release
                refuses while mapped
submit_gather   a gather on the C op engine, on a stream of its own (see below)
granularity()   ``cuMemGetAllocationGranularity`` (recommended) for the allocation type
device_uuid()   ``cuDeviceGetUuid``: devices are chosen and named by UUID, never ordinal
==============  =====================================================================

Every call above is one call of the C engine (``ffi/kvs_cuda_*.c``), which loads the
driver at run time and keeps the objects, the pins and the ops: a CUDA mapping is a region
of the same table as a host mapping, and a gather is an op of the same engine, stepped
through the same generated ``kvs_op_table.h``. Its copies go on a stream of its own, with
an event behind them; the op finishes (and its pins drop) only when the driver reports
that event complete, so ``stats().pins`` reaching zero is the device's word, and unmap
and release refuse until then. Nothing about an op's state is kept in Python.

Legacy IPC (``cuIpc*``), only when ``legacy_ipc=True`` and the transport's kind is
``CUDA_IPC``: only ``cuMemAlloc`` memory is exported, and a process never opens a handle it
exported itself (refused before the driver is asked). The driver keeps no count of other
processes' opens, so the exporter must not free the memory while an importer has it
open: the exporter holds a pin on the bank for every importer that may have it open
(:mod:`kvstate.share.exporter`), which makes unmap and release refuse.

Constructing a :class:`CudaTransport` loads the native module and the driver
(:mod:`kvstate.transport.cuda.driver`); importing this module loads neither. Without them,
or without a device, construction raises :class:`BackendUnavailable`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstate.core import errors
from kvstate.core.reasons import ArgumentReason, BackendReason, ImportDefect
from kvstate.core.args import FD_MAX, need, need_bytes, need_int, need_items
from kvstate.core.capabilities import Access, Capabilities, FabricTrial, MemoryKind, Scope
from kvstate.core.errors import ArgumentInvalid, BackendUnavailable, ImportFailed
from kvstate.core.handles import CUDA_HANDLE_BYTES, HandleKind
from kvstate.transport.cuda import rules
from kvstate.transport.cuda.driver import DeviceInfo, find_device, load_driver
from kvstate.transport.cuda.objects import CudaAllocation, CudaHandle, CudaMapping, CudaReservation, DeviceBuffer
from kvstate.transport.host import fd_identity_of
from kvstate.transport.native import Native, Op, RawBuffer
from kvstate.transport.protocol import MAX_SIZE, OWNER_MAX, Block, RegionStats

#: Ids, addresses and sizes cross the C boundary as uint64_t.
_U64 = (1 << 64) - 1


def _object(name: str, value: object, kind: type, *ids: str) -> None:
    """``value`` is a ``kind`` whose ``ids`` fields fit the C boundary (a public method's
    argument is checked before anything is called: a typed refusal, never a TypeError)."""
    need(name, value, kind)
    for field in ids:
        need_int(f"{name}.{field}", getattr(value, field), 0, _U64)


def _raw(ep: object) -> RawBuffer | None:
    """The end an op must hold until it is reaped: a RawBuffer (its owner keeps the memory)."""
    return ep if isinstance(ep, RawBuffer) else None


if TYPE_CHECKING:
    from typing import Union

    from kvstate.transport.native import HostBuffer
    from kvstate.transport.protocol import ExportingTransport, MappedTransport

    #: What a cuda op reads or writes: a mapping or device memory the caller owns.
    CudaEndpoint = Union[CudaMapping, DeviceBuffer]


class CudaTransport:
    """CUDA device memory with VMM semantics on the device named ``device`` (UUID bytes or
    ``GPU-…`` text). See the module docstring.

    ``kind`` is what this transport's allocations are exported as: ``POSIX_FD`` (default),
    ``FABRIC`` (only if the trial passes, else BackendUnavailable (FABRIC)), or ``CUDA_IPC`` (only
    with ``legacy_ipc=True``). ``fabric=True`` runs the trial even when ``kind`` is
    POSIX_FD, to publish the result (``fabric_decision``). ``native``: another build of the
    native module than the process's (tests of planted bugs).
    """

    name = "cuda"

    def __init__(self, device: bytes | str, *, kind: HandleKind = HandleKind.POSIX_FD, fabric: bool = False,
                 legacy_ipc: bool = False, native: Native | None = None) -> None:
        need("device", device, (bytes, str))
        need("kind", kind, HandleKind)
        need("fabric", fabric, bool)
        need("legacy_ipc", legacy_ipc, bool)
        want = rules.parse_uuid(device)
        # How the transport is made is the caller's to fix, not a handle to recompute around.
        if kind not in rules.CUDA_KINDS:
            raise ArgumentInvalid.of("kind", ArgumentReason.RANGE, f"the cuda backend does not export {kind.value} "
                                     "handles")
        if kind is HandleKind.CUDA_IPC and not legacy_ipc:
            raise ArgumentInvalid.of("legacy_ipc", ArgumentReason.STATE,
                                     "CUDA_IPC handles need legacy_ipc=True (legacy IPC is only on request)")
        self._native = nat = load_driver(native)
        self._lib, self._ffi = nat.lib, nat.ffi
        lib = self._lib
        self._types = {HandleKind.POSIX_FD: lib.KVS_CUDA_POSIX_FD, HandleKind.FABRIC: lib.KVS_CUDA_FABRIC,
                       HandleKind.CUDA_IPC: lib.KVS_CUDA_LEGACY_IPC}
        self._access = {Access.NONE: lib.KVS_ACCESS_NONE, Access.READ: lib.KVS_ACCESS_READ,
                        Access.READ_WRITE: lib.KVS_ACCESS_READ_WRITE}
        info = find_device(nat, want)
        if info is None:
            raise errors.BackendUnavailable(BackendReason.NO_DEVICE,
                                            f"no visible device has UUID {rules.format_uuid(want)}")
        self.info: DeviceInfo = info
        self._uuid = want
        self._kind = kind
        self._device = self._open(want, kind)
        try:
            self._granularity = self._gran(minimum=False)
            self.fabric_decision = self._fabric_trial() if (fabric or kind is HandleKind.FABRIC) else \
                rules.fabric_decision(requested=False, attribute=False, export_result=None, import_result=None)
            if kind is HandleKind.FABRIC and self.fabric_decision.trial is not FabricTrial.PASSED:
                raise BackendUnavailable(BackendReason.FABRIC,
                                         f"FABRIC handles were asked for: {self.fabric_decision.why}")
            self.min_granularity = self._gran(minimum=True)
        except BaseException:
            lib.kvs_cuda_close(self._device)  # nothing else was kept; the first failure propagates
            raise

    # -- plumbing ------------------------------------------------------------------------

    def _call(self, rc: int, call: str, what: str) -> None:
        if rc:
            raise self._native.error(rc, call, what)

    def _open(self, uuid: bytes, kind: HandleKind) -> int:
        out = self._ffi.new("uint64_t *")
        self._call(self._lib.kvs_cuda_open(self._ffi.from_buffer("char[]", uuid), self._types[kind], out),
                   "kvs_cuda_open", f"device {rules.format_uuid(uuid)} for {kind.value} handles")
        return out[0]

    def _gran(self, *, minimum: bool, kind: HandleKind | None = None) -> int:
        out = self._ffi.new("uint64_t *")
        self._call(self._lib.kvs_cuda_granularity(self._device, self._types[kind or self._kind], int(minimum), out),
                   "kvs_cuda_granularity", f"{'minimum' if minimum else 'recommended'} granularity")
        return out[0]

    def _driver_result(self, rc: int) -> int:
        """The CUresult of a C call that reached the driver (0 for success); other refusals raise."""
        if rc == self._lib.KVS_E_CUDA:
            return self._lib.kvs_cuda_last_result()
        self._call(rc, "fabric trial", "FABRIC handles")
        return 0

    def _fabric_trial(self) -> rules.FabricDecision:
        """Create, export as FABRIC, import and release one granule. Only a trial that
        succeeds end to end lets FABRIC be published (the attribute alone is unreliable)."""
        if not self.info.fabric:
            return rules.fabric_decision(requested=True, attribute=False, export_result=None, import_result=None)
        lib, ffi, fab = self._lib, self._ffi, self._types[HandleKind.FABRIC]
        gran, alloc = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        err = self._driver_result(lib.kvs_cuda_granularity(self._device, fab, 0, gran))
        size = max(gran[0], self._granularity)  # powers of two: a multiple of both
        if err == 0:
            err = self._driver_result(lib.kvs_cuda_create(self._device, size, fab, alloc))
        if err:
            return rules.fabric_decision(requested=True, attribute=True, export_result=err, import_result=None)
        made = {"the trial's allocation": alloc[0]}
        try:
            handle, fd, imported = ffi.new("char[]", CUDA_HANDLE_BYTES), ffi.new("int32_t *"), ffi.new("uint64_t *")
            err = self._driver_result(lib.kvs_cuda_export(alloc[0], fab, fd, handle))
            if err:
                return rules.fabric_decision(requested=True, attribute=True, export_result=err, import_result=None)
            ierr = self._driver_result(lib.kvs_cuda_import(self._device, fab, -1, handle, size, imported))
            if ierr == 0:
                made = {"the trial's import": imported[0], **made}  # released first
            return rules.fabric_decision(requested=True, attribute=True, export_result=0, import_result=ierr)
        finally:
            self._release_all(made)

    def _release_all(self, allocations: dict[str, int]) -> None:
        """Release every allocation (in order), each tried even when another failed and a
        failed one tried once more, so that a transient driver failure leaves nothing that
        would keep the device from closing; the first failure is raised."""
        failed = [(what, allocation, rc) for what, allocation in allocations.items()
                  if (rc := self._lib.kvs_cuda_release(allocation))]
        for _, allocation, _ in failed:
            self._lib.kvs_cuda_release(allocation)  # once more; gone already (NOENT) is fine
        if failed:  # the first failure says what went wrong, even where its retry worked
            what, _, rc = failed[0]
            self._call(rc, "kvs_cuda_release", what)

    @property
    def native(self) -> Native:
        return self._native

    @property
    def device(self) -> int:
        """The C layer's id of the opened device."""
        return self._device

    @property
    def kind(self) -> HandleKind:
        return self._kind

    @property
    def fabric_trial(self) -> FabricTrial:
        return self.fabric_decision.trial

    # -- the Transport interface ---------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        # One handle type per transport: its allocations are created exportable as that kind.
        scopes = {Scope.SAME_NODE} | ({Scope.CROSS_NODE} if self._kind is HandleKind.FABRIC else set())
        return Capabilities(handle_kinds=frozenset({self._kind}), memory_kinds=frozenset({MemoryKind.DEVICE}),
                            scopes=frozenset(scopes))

    def granularity(self) -> int:
        return self._granularity

    def device_uuid(self) -> bytes:
        return self._uuid

    def _sized(self, what: str, size: int) -> None:
        need_int("size", size, 1, MAX_SIZE)
        if size % self._granularity:
            raise errors.ArgumentInvalid.native(what, -1, f"size {size!r} is not a positive multiple of the "
                                                f"granularity {self._granularity}")

    def create(self, size: int) -> CudaAllocation:
        self._sized("create", size)
        out = self._ffi.new("uint64_t *")
        self._call(self._lib.kvs_cuda_create(self._device, size, self._types[self._kind], out),
                   "kvs_cuda_create", f"{size} bytes")
        return CudaAllocation(out[0], size, self._kind, imported=False)

    def export(self, allocation: CudaAllocation, kind: HandleKind) -> CudaHandle:
        _object("allocation", allocation, CudaAllocation, "id")
        need("kind", kind, HandleKind)
        # Exporting what cannot be exported is a wrong call (ArgumentInvalid on every backend).
        if allocation.imported:
            raise ArgumentInvalid.of("allocation", ArgumentReason.STATE,
                                     f"allocation {allocation.id} is imported; only own allocations are exported")
        if kind is not allocation.kind:
            if kind is HandleKind.CUDA_IPC:
                raise ArgumentInvalid.of("kind", ArgumentReason.RANGE,
                                         "legacy IPC exports only cuMemAlloc memory; this is VMM memory")
            raise ArgumentInvalid.of("kind", ArgumentReason.RANGE,
                                     f"allocation {allocation.id} was created for {allocation.kind.value} "
                                     f"handles, not {kind.value}")
        fd, handle = self._ffi.new("int32_t *"), self._ffi.new("char[]", CUDA_HANDLE_BYTES)
        self._call(self._lib.kvs_cuda_export(allocation.id, self._types[kind], fd, handle),
                   "kvs_cuda_export", f"allocation {allocation.id} as {kind.value}")
        if kind is HandleKind.POSIX_FD:
            return CudaHandle(kind, fd_identity_of(fd[0]), fd[0])
        return CudaHandle(kind, bytes(self._ffi.buffer(handle, CUDA_HANDLE_BYTES)))

    def receive_handle(self, kind: HandleKind, data: bytes, fds: Sequence[int]) -> CudaHandle:
        """The handle a descriptor and its received fds describe, checked before any open."""
        need("kind", kind, HandleKind)
        data = need_bytes("data", data, CUDA_HANDLE_BYTES)
        fds = need_items("fds", fds, int, 16)
        rules.check_received(kind, data, len(fds))
        if kind is not self._kind:
            raise ImportFailed.handle(ImportDefect.KIND,
                                      f"this cuda transport imports {self._kind.value} handles, not {kind.value}")
        if fds:
            self._check_fd(fds[0], data)
            return CudaHandle(kind, data, fds[0])
        return CudaHandle(kind, data)

    @staticmethod
    def _check_fd(fd: int, identity: bytes) -> None:
        try:
            same = fd_identity_of(fd) == identity
        except OSError as exc:
            raise ImportFailed.handle(ImportDefect.FD, call="import", code=-1,
                                      detail=f"fd {fd} cannot be examined: {exc.strerror}") from None
        if not same:
            raise ImportFailed.handle(ImportDefect.FD_IDENTITY,
                                      call="import", code=-1, detail=f"fd {fd} is not the file its descriptor names")

    def import_(self, handle: CudaHandle, size: int) -> CudaAllocation:
        """Open a received handle. The caller keeps (and closes) a received fd: the driver
        holds its own reference once the import returns."""
        _object("handle", handle, CudaHandle)
        need_bytes("handle.identity", handle.identity, CUDA_HANDLE_BYTES)
        if handle.fd is not None:
            need_int("handle.fd", handle.fd, 0, FD_MAX)
        self._sized("import", size)
        rules.check_received(handle.kind, handle.identity, 0 if handle.fd is None else 1)
        if handle.kind is not self._kind:
            raise ImportFailed.handle(ImportDefect.KIND,
                                      f"this cuda transport imports {self._kind.value} handles, not {handle.kind.value}")
        fd = -1
        if handle.fd is not None:
            self._check_fd(handle.fd, handle.identity)
            fd = handle.fd
        out = self._ffi.new("uint64_t *")
        self._call(self._lib.kvs_cuda_import(self._device, self._types[handle.kind], fd,
                                             self._ffi.from_buffer("char[]", handle.identity), size, out),
                   "kvs_cuda_import", f"{handle.kind.value} handle of {size} bytes")
        return CudaAllocation(out[0], size, handle.kind, imported=True)

    def reserve(self, size: int) -> CudaReservation:
        self._sized("reserve", size)
        res, addr = self._ffi.new("uint64_t *"), self._ffi.new("uint64_t *")
        self._call(self._lib.kvs_cuda_reserve(self._device, size, res, addr), "kvs_cuda_reserve", f"{size} bytes")
        return CudaReservation(res[0], addr[0], size)

    def free(self, reservation: CudaReservation) -> None:
        """Return a reservation's address space (cuMemAddressFree); refused while mapped."""
        _object("reservation", reservation, CudaReservation, "id")
        self._call(self._lib.kvs_cuda_free_reservation(reservation.id), "kvs_cuda_free_reservation",
                   f"reservation {reservation.id}")

    def map(self, reservation: CudaReservation, offset: int, allocation: CudaAllocation) -> CudaMapping:
        _object("reservation", reservation, CudaReservation, "id")
        _object("allocation", allocation, CudaAllocation, "id", "size")
        if type(offset) is not int or offset < 0 or offset % self._granularity:
            raise errors.ArgumentInvalid.native("map", -1, f"offset {offset!r} is not a multiple of the "
                                                f"granularity {self._granularity}")
        if allocation.kind is HandleKind.CUDA_IPC and offset:
            raise ImportFailed.handle(ImportDefect.LEGACY_IPC,
                                      "legacy IPC memory has one mapping, where it was allocated or opened")
        region, addr = self._ffi.new("uint64_t *"), self._ffi.new("uint64_t *")
        self._call(self._lib.kvs_cuda_map(reservation.id, offset, allocation.id, region, addr), "kvs_cuda_map",
                   f"allocation {allocation.id} at offset {offset} of reservation {reservation.id}")
        return CudaMapping(region[0], addr[0], allocation.size, allocation, reservation)

    def set_access(self, mapping: CudaMapping, access: Access) -> None:
        """Grant this device ``access``. CUDA cannot revoke access (unmap instead); legacy IPC
        memory is read-write at the driver level, its level recorded for the op guard."""
        _object("mapping", mapping, CudaMapping, "region")
        need("access", access, Access)
        self._call(self._lib.kvs_cuda_set_access(mapping.region, self._access[access]), "kvs_cuda_set_access",
                   f"region {mapping.region}, access {access.value}")

    def unmap(self, mapping: CudaMapping) -> None:
        _object("mapping", mapping, CudaMapping, "region")
        self._call(self._lib.kvs_cuda_unmap(mapping.region), "kvs_cuda_unmap", f"region {mapping.region}")

    def release(self, allocation: CudaAllocation) -> None:
        _object("allocation", allocation, CudaAllocation, "id")
        self._call(self._lib.kvs_cuda_release(allocation.id), "kvs_cuda_release", f"allocation {allocation.id}")

    # -- pins and observation (the shared table: same calls as the host backend) --------

    def pin(self, mapping: CudaMapping) -> None:
        """An explicit pin (a lease's): unmap and release refuse until :meth:`unpin`."""
        _object("mapping", mapping, CudaMapping, "region")
        self._call(self._lib.kvs_region_pin(mapping.region), "kvs_region_pin", f"region {mapping.region}")

    def unpin(self, mapping: CudaMapping) -> None:
        _object("mapping", mapping, CudaMapping, "region")
        self._call(self._lib.kvs_region_unpin(mapping.region), "kvs_region_unpin",
                   f"region {mapping.region} (explicit pins only)")

    def own(self, mapping: CudaMapping, owner: int) -> None:
        """Claim ``mapping`` for ``owner`` (a part's or a bank's nonzero token): unmap and
        set_access refuse (Busy, OWNED) until the owner disowns it."""
        _object("mapping", mapping, CudaMapping, "region")
        need_int("owner", owner, 1, OWNER_MAX)
        self._call(self._lib.kvs_region_own(mapping.region, owner), "kvs_region_own", f"region {mapping.region}")

    def disown(self, mapping: CudaMapping, owner: int) -> None:
        _object("mapping", mapping, CudaMapping, "region")
        need_int("owner", owner, 1, OWNER_MAX)
        self._call(self._lib.kvs_region_disown(mapping.region, owner), "kvs_region_disown", f"region {mapping.region}")

    def stats(self, mapping: CudaMapping) -> RegionStats:
        """Pins, ops in flight, completed and failed ops and bytes of one mapping, as the C
        layer counts them (an op's pins drop when the device reported its event)."""
        _object("mapping", mapping, CudaMapping, "region")
        return self._native.region_stats(mapping.region)

    # -- ops -------------------------------------------------------------------------------

    def _endpoint(self, ep: CudaEndpoint | RawBuffer) -> tuple[int, int, int]:
        if isinstance(ep, CudaMapping):
            return ep.region, 0, 0
        if isinstance(ep, DeviceBuffer):
            return 0, ep.ptr, ep.nbytes
        if isinstance(ep, RawBuffer):  # device memory by address: an engine's CUDA tensor
            return 0, ep.addr, ep.size
        raise errors.ArgumentInvalid.native("gather", -1, f"{ep!r} is neither a CudaMapping nor device memory")

    def submit_gather(self, src: CudaEndpoint, dst: CudaEndpoint, blocks: Sequence[Block]) -> Op:
        """Copy each (src_off, dst_off, len) block device to device: an op of the C engine,
        on a stream of its own; it pins every mapping it touches until its event completes."""
        return self._native.submit_cuda(self._device, self._endpoint(src), self._endpoint(dst), blocks,
                                        hold=(_raw(src), _raw(dst)))

    def submit_blocks(self, src: CudaEndpoint | RawBuffer, dst: CudaEndpoint | RawBuffer,
                      blocks: Sequence[Block] | HostBuffer, *, notify_fd: int | None = None, fail: bool = False) -> Op:
        """The data path's submit (:mod:`kvstate.share.plan`), as the host backend's: either
        end a mapping or device memory (a :class:`RawBuffer` names it by address); 1 is
        added to the eventfd ``notify_fd`` once the op is collectable."""
        return self._native.submit_cuda(self._device, self._endpoint(src), self._endpoint(dst), blocks,
                                        fail=fail, notify_fd=notify_fd, hold=(_raw(src), _raw(dst)))

    def submit_copy(self, src: CudaEndpoint, dst: CudaEndpoint, length: int, *, src_off: int = 0,
                    dst_off: int = 0) -> Op:
        return self.submit_gather(src, dst, [(src_off, dst_off, length)])

    # -- device buffers and synchronous copies (engines without an allocator, checks) -----

    def alloc_buffer(self, nbytes: int) -> DeviceBuffer:
        need_int("nbytes", nbytes, 1, MAX_SIZE)
        out = self._ffi.new("uint64_t *")
        self._call(self._lib.kvs_cuda_buffer_alloc(self._device, nbytes, out), "kvs_cuda_buffer_alloc",
                   f"{nbytes} bytes")
        return DeviceBuffer(out[0], nbytes)

    def free_buffer(self, buf: DeviceBuffer) -> None:
        _object("buf", buf, DeviceBuffer, "ptr")
        self._call(self._lib.kvs_cuda_buffer_free(self._device, buf.ptr), "kvs_cuda_buffer_free",
                   f"buffer at {buf.ptr:#x}")

    @staticmethod
    def _span(target: CudaEndpoint, nbytes: int, offset: int) -> int:
        addr, size = (target.addr, target.size) if isinstance(target, CudaMapping) else (target.ptr, target.nbytes)
        if offset < 0 or nbytes <= 0 or offset + nbytes > size:
            raise ArgumentInvalid.native("copy", -1, f"{nbytes} bytes at {offset} exceed {size}",
                                         ArgumentReason.OUT_OF_RANGE)
        return addr + offset

    def write(self, target: CudaEndpoint, data: bytes, offset: int = 0) -> None:
        """Synchronous host-to-device copy (tests and checks)."""
        dst = self._span(target, len(data), offset)
        self._call(self._lib.kvs_cuda_write(self._device, dst, self._ffi.from_buffer("char[]", data), len(data)),
                   "kvs_cuda_write", f"{len(data)} bytes to {dst:#x}")

    def read(self, source: CudaEndpoint, nbytes: int, offset: int = 0) -> bytes:
        """Synchronous device-to-host copy (tests and checks)."""
        src = self._span(source, nbytes, offset)
        buf = self._ffi.new("char[]", nbytes)
        self._call(self._lib.kvs_cuda_read(self._device, buf, src, nbytes), "kvs_cuda_read",
                   f"{nbytes} bytes from {src:#x}")
        return bytes(self._ffi.buffer(buf, nbytes))

    def memcpy(self, dst: CudaEndpoint, src: CudaEndpoint, nbytes: int) -> None:
        """A plain synchronous device-to-device copy outside the op engine (no pins, no op):
        what ``cudaMemcpy`` does, the baseline gathers are measured against."""
        d, s = self._span(dst, nbytes, 0), self._span(src, nbytes, 0)
        self._call(self._lib.kvs_cuda_memcpy(self._device, d, s, nbytes), "kvs_cuda_memcpy", f"{nbytes} bytes")

    def close(self) -> None:
        """Destroy the device's streams and drop its primary context. Refused (Busy (ENGINE))
        while it has ops in flight or memory objects left."""
        self._call(self._lib.kvs_cuda_close(self._device), "kvs_cuda_close", f"device {rules.format_uuid(self._uuid)}")


def _conformance(t: CudaTransport) -> None:
    """Checked by mypy, never called: the cuda backend implements these protocols."""
    mapped: MappedTransport[CudaHandle, CudaAllocation, CudaReservation, CudaMapping, CudaEndpoint] = t
    exporting: ExportingTransport[CudaHandle, CudaAllocation] = t
    del mapped, exporting
