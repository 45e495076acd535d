"""The cuda backend: CUDA VMM through ``cuda.bindings`` with the host backend's semantics.

==============  =====================================================================
create(size)    ``cuMemCreate`` of pinned device memory, exportable as the transport's
                kind (POSIX fd by default, FABRIC after a passing trial); legacy
                ``cuMemAlloc`` when the transport was built for ``CUDA_IPC``
export(a, k)    a :class:`CudaHandle`: POSIX fd (owned by the allocation, sent by
                SCM_RIGHTS) with its (dev, ino) identity bytes; or the 64 FABRIC /
                legacy IPC handle bytes and no fd
receive_handle  (kind, bytes, received fds) -> CudaHandle, after exact kind, size and
                fd-count checks and the fd identity check; nothing is opened
import_(h, n)   ``cuMemImportFromShareableHandle`` (VMM) or ``cuIpcOpenMemHandle``
reserve(n)      ``cuMemAddressReserve`` aligned to the granularity
map(r, off, a)  ``cuMemMap``; no access until set_access, exactly as the host backend
set_access      ``cuMemSetAccess`` for this device; lowering refused while pinned
unmap, release  refuse with RegionPinned while ops or leases pin the mapping; release
                refuses while mapped; release order unmap -> free -> release
granularity()   ``cuMemGetAllocationGranularity`` (recommended) for the allocation type
device_uuid()   ``cuDeviceGetUuid``: devices are chosen and named by UUID, never ordinal
==============  =====================================================================

Pins and ops. The C op engine counts pins only on mappings it made itself (host memfds),
so this backend keeps a Python-side pin table with the same observation shape
(:class:`kvstate.transport.protocol.RegionStats`): explicit pins for leases, one pin per
in-flight gather on every mapping it touches. Its ops step through ``spec/op.toml`` with
:class:`kvstate.transport.optable.OpStepper`, this backend implementing the table's guard
(``regions_mapped``) and effects (``pin_regions``, ``unpin_regions``), so no op state is
written here. A gather is a list of ``cuMemcpyDtoDAsync`` and (for extents at a constant
stride, as in a layer-major bank) ``cuMemcpy2DAsync`` on the transport's stream, followed
by an event; the op's pins drop, and its bytes count, only when ``cuEventQuery`` reports
the event complete (or failed). Completion is observed
whenever anyone looks (``stats``, ``pins``, ``wait``), so a drain that polls
``stats().pins`` sees zero only after the device finished, as on the host backend.
Python callbacks from the driver's host-function thread are avoided on purpose: they
would take the GIL inside the driver and can deadlock with a thread blocked in a call.

Legacy IPC (``cuIpc*``), only when ``legacy_ipc=True`` and the transport's kind is
``CUDA_IPC``: only ``cuMemAlloc`` memory is exported; a process never opens a handle it
exported itself (refused before the driver is asked); the exporter frees its memory only
at bank release, which the bank's ``native_quiescent`` guard admits only after every
lease ended, and an importer returns its lease only after ``cuIpcCloseMemHandle``.

Constructing a :class:`CudaTransport` loads cuda-python and the driver; importing this
module loads neither. Without cuda-python, or without a driver or device, construction
raises :class:`kvstate.core.errors.BackendUnavailable`; any other import error propagates.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import attrs

from kvstate.core import errors
from kvstate.core.errors import (
    BackendUnavailable,
    FabricUnavailable,
    FdIdentityMismatch,
    HandleRefused,
    LegacyIpcRefused,
    OutOfRange,
    RegionPinned,
    StillMapped,
    UnknownNativeObject,
)
from kvstate.core.handles import CUDA_HANDLE_BYTES, HandleKind
from kvstate.transport.protocol import RegionStats
from kvstate.core.optional import require
from kvstate.core.capabilities import FabricTrial
from kvstate.transport.cuda import rules
from kvstate.transport.cuda.objects import (
    ACCESS_LEVEL,
    CudaAllocation,
    CudaHandle,
    CudaMapping,
    CudaOp,
    CudaReservation,
    DeviceBuffer,
)
from kvstate.transport.cuda.ops import CudaOps
from kvstate.transport.cuda.driver import (
    access_desc,
    allocation_prop,
    check,
    device_at,
    load_driver,
    struct_bytes,
    struct_from,
    uuid_of,
    visible_devices,
)
from kvstate.core.capabilities import Access, Capabilities, MemoryKind, Scope
from kvstate.transport.host import fd_identity_of

if TYPE_CHECKING:
    from kvstate.transport.protocol import ExportingTransport, MappedTransport


#: Legacy IPC handle bytes this process exported: opening one here is refused.
_EXPORTED_IPC: set[bytes] = set()
_EXPORTED_IPC_LOCK = threading.Lock()


# -- the transport -----------------------------------------------------------------------


class CudaTransport:
    """CUDA device memory with VMM semantics on the device named ``device`` (UUID bytes or
    ``GPU-…`` text). See the module docstring.

    ``kind`` is what this transport's allocations are exported as: ``POSIX_FD`` (default),
    ``FABRIC`` (only if ``fabric=True`` and the trial passes, else FabricUnavailable), or
    ``CUDA_IPC`` (only with ``legacy_ipc=True``). ``fabric=True`` runs the trial even when
    ``kind`` is POSIX_FD, to publish the result (``fabric_trial``).
    """

    name = "cuda"

    def __init__(self, device: bytes | str, *, kind: HandleKind = HandleKind.POSIX_FD, fabric: bool = False,
                 legacy_ipc: bool = False) -> None:
        want = rules.parse_uuid(device)
        if kind not in rules.CUDA_KINDS:
            raise HandleRefused(f"the cuda backend does not export {kind.value} handles")
        if kind is HandleKind.CUDA_IPC and not legacy_ipc:
            raise LegacyIpcRefused("CUDA_IPC handles need legacy_ipc=True (legacy IPC is only on request)")
        self._d = driver = load_driver()
        (err, n) = driver.cuDeviceGetCount()
        check(driver, "cuDeviceGetCount", err)
        for i in range(n):
            dev = device_at(driver, i)
            if uuid_of(driver, dev) == want:
                break
        else:
            raise errors.CudaDeviceNotFound(f"no visible device has UUID {rules.format_uuid(want)} "
                                            f"({n} device(s) visible)")
        self._dev = dev
        self._ordinal = int(dev)
        self._uuid = want
        err, self._ctx = driver.cuDevicePrimaryCtxRetain(dev)
        check(driver, "cuDevicePrimaryCtxRetain", err)
        try:
            self._setup(kind, legacy_ipc, fabric)
        except BaseException:
            if getattr(self, "_stream", None) is not None:
                driver.cuStreamDestroy(self._stream)
            driver.cuDevicePrimaryCtxRelease(dev)  # nothing else was kept
            raise

    def _setup(self, kind: HandleKind, legacy_ipc: bool, fabric: bool) -> None:
        driver, dev = self._d, self._dev
        self._enter()
        self._kind = kind
        self._legacy = legacy_ipc
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._mappings: dict[int, CudaMapping] = {}
        err, self._stream = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value)
        check(driver, "cuStreamCreate", err)
        max_pitch = int(self._call("cuDeviceGetAttribute",
                                   driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH, dev))
        self._engine = CudaOps(driver, self._stream, max_pitch, self._lock, call=self._call, enter=self._enter,
                               live=self._live)
        vmm_kind = HandleKind.POSIX_FD if kind is HandleKind.CUDA_IPC else kind
        if kind is not HandleKind.CUDA_IPC:
            self._require_attribute("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", "VMM")
            self._require_attribute("HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", "POSIX fd handles")
        self.fabric_decision = self._fabric_trial() if (fabric or kind is HandleKind.FABRIC) else \
            rules.fabric_decision(requested=False, attribute=False, export_result=None, import_result=None)
        if kind is HandleKind.FABRIC and self.fabric_decision.trial is not FabricTrial.PASSED:
            raise FabricUnavailable(f"FABRIC handles were asked for: {self.fabric_decision.why}")
        self._prop = allocation_prop(driver, rules.allocation_fields(self._ordinal, [vmm_kind]))
        err, self._granularity = driver.cuMemGetAllocationGranularity(
            self._prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        check(driver, "cuMemGetAllocationGranularity", err)
        err, self.min_granularity = driver.cuMemGetAllocationGranularity(
            self._prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        check(driver, "cuMemGetAllocationGranularity", err)

    # -- plumbing ------------------------------------------------------------------------

    @property
    def driver(self) -> ModuleType:
        return self._d

    @property
    def device(self) -> Any:
        """The driver's CUdevice of the device found by UUID."""
        return self._dev

    @property
    def device_ordinal(self) -> int:
        """The driver's ordinal of the device found by UUID (for CUmemLocation only)."""
        return self._ordinal

    @property
    def kind(self) -> HandleKind:
        return self._kind

    @property
    def fabric_trial(self) -> FabricTrial:
        return self.fabric_decision.trial

    def _enter(self) -> None:
        """Make this device's primary context current on the calling thread."""
        (err,) = self._d.cuCtxSetCurrent(self._ctx)
        check(self._d, "cuCtxSetCurrent", err)

    def _call(self, call: str, *args: Any, detail: str = "") -> Any:
        res = getattr(self._d, call)(*args)
        check(self._d, call, res[0], detail)
        return res[1] if len(res) == 2 else res[1:] or None

    def _require_attribute(self, attribute: str, what: str) -> None:
        attr = getattr(self._d.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{attribute}")
        if not self._call("cuDeviceGetAttribute", attr, self._dev):
            raise errors.CudaNotSupported("cuDeviceGetAttribute", rules.CUDA_ERROR_NOT_SUPPORTED,
                                          "CUDA_ERROR_NOT_SUPPORTED", f"device has no {what} support")

    def _fabric_trial(self) -> rules.FabricDecision:
        """Create, export as FABRIC, import and release one granule. Only a trial that
        succeeds end to end lets FABRIC be published (the attribute alone is unreliable)."""
        d = self._d
        attr = d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED
        err, supported = d.cuDeviceGetAttribute(attr, self._dev)
        if int(err) != 0 or not supported:
            return rules.fabric_decision(requested=True, attribute=False, export_result=None, import_result=None)
        prop = allocation_prop(d, rules.allocation_fields(self._ordinal, [HandleKind.FABRIC]))
        err, gran = d.cuMemGetAllocationGranularity(
            prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        if int(err) != 0:
            return rules.fabric_decision(requested=True, attribute=True, export_result=int(err), import_result=None)
        err, handle = d.cuMemCreate(gran, prop, 0)
        if int(err) != 0:
            return rules.fabric_decision(requested=True, attribute=True, export_result=int(err), import_result=None)
        try:
            err, shared = d.cuMemExportToShareableHandle(
                handle, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC, 0)
            if int(err) != 0:
                return rules.fabric_decision(requested=True, attribute=True, export_result=int(err),
                                             import_result=None)
            fh = struct_from(d.CUmemFabricHandle, struct_bytes(shared, CUDA_HANDLE_BYTES))
            ierr, imported = d.cuMemImportFromShareableHandle(
                int(fh.getPtr()), d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
            if int(ierr) == 0:
                d.cuMemRelease(imported)
            return rules.fabric_decision(requested=True, attribute=True, export_result=0, import_result=int(ierr))
        finally:
            d.cuMemRelease(handle)

    # -- the Transport interface ---------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        # One handle type per transport: its allocations are created exportable as that kind.
        kinds = frozenset({self._kind})
        scopes = {Scope.SAME_NODE} | ({Scope.CROSS_NODE} if self._kind is HandleKind.FABRIC else set())
        return Capabilities(handle_kinds=kinds, memory_kinds=frozenset({MemoryKind.DEVICE}),
                            scopes=frozenset(scopes))

    def granularity(self) -> int:
        return int(self._granularity)

    def device_uuid(self) -> bytes:
        return self._uuid

    def _sized(self, what: str, size: int) -> None:
        if size <= 0 or size % self._granularity:
            raise errors.NativeInvalidArgument(what, -1, f"size {size} is not a positive multiple of the "
                                               f"granularity {self._granularity}")

    def create(self, size: int) -> CudaAllocation:
        self._sized("create", size)
        self._enter()
        aid = next(self._ids)
        if self._kind is HandleKind.CUDA_IPC:
            ptr = self._call("cuMemAlloc", size, detail=f"{size} bytes")
            return CudaAllocation(aid, size, self._kind, imported=False, ptr=int(ptr))
        handle = self._call("cuMemCreate", size, self._prop, 0, detail=f"{size} bytes")
        return CudaAllocation(aid, size, self._kind, imported=False, handle=handle)

    def export(self, allocation: CudaAllocation, kind: HandleKind) -> CudaHandle:
        if allocation.imported or allocation.released:
            raise HandleRefused(f"allocation {allocation.id} is {'released' if allocation.released else 'imported'}"
                                "; only own live allocations are exported")
        if kind is not allocation.kind:
            if kind is HandleKind.CUDA_IPC:
                raise LegacyIpcRefused("legacy IPC exports only cuMemAlloc memory; this is VMM memory")
            raise HandleRefused(f"allocation {allocation.id} was created for {allocation.kind.value} "
                                f"handles, not {kind.value}")
        self._enter()
        d = self._d
        if kind is HandleKind.POSIX_FD:
            if allocation.export_fd is None:
                fd = self._call("cuMemExportToShareableHandle", allocation.handle,
                                d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
                allocation.export_fd = int(fd)
            return CudaHandle(kind, fd_identity_of(allocation.export_fd), allocation.export_fd)
        if kind is HandleKind.FABRIC:
            shared = self._call("cuMemExportToShareableHandle", allocation.handle,
                                d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC, 0)
            return CudaHandle(kind, struct_bytes(shared, CUDA_HANDLE_BYTES))
        capable = self._call("cuPointerGetAttribute",
                             d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                             d.CUdeviceptr(allocation.ptr))
        if not capable:
            raise LegacyIpcRefused(f"allocation {allocation.id} is not legacy-IPC capable memory")
        data = struct_bytes(self._call("cuIpcGetMemHandle", d.CUdeviceptr(allocation.ptr)), CUDA_HANDLE_BYTES)
        with _EXPORTED_IPC_LOCK:
            _EXPORTED_IPC.add(data)
        return CudaHandle(kind, data)

    def receive_handle(self, kind: HandleKind, data: bytes, fds: Sequence[int]) -> CudaHandle:
        """The handle a descriptor and its received fds describe, checked before any open."""
        rules.check_received(kind, data, len(fds))
        if kind is not self._kind:
            raise HandleRefused(f"this cuda transport imports {self._kind.value} handles, not {kind.value}")
        if fds:
            if fd_identity_of(fds[0]) != data:
                raise FdIdentityMismatch("import", -1, f"fd {fds[0]} is not the file its descriptor names")
            return CudaHandle(kind, data, fds[0])
        return CudaHandle(kind, data)

    def import_(self, handle: CudaHandle, size: int) -> CudaAllocation:
        """Open a received handle. The caller keeps (and closes) a received fd: the driver
        holds its own reference once the import returns."""
        self._sized("import", size)
        rules.check_received(handle.kind, handle.identity, 0 if handle.fd is None else 1)
        if handle.kind is not self._kind:
            raise HandleRefused(f"this cuda transport imports {self._kind.value} handles, not {handle.kind.value}")
        self._enter()
        d = self._d
        aid = next(self._ids)
        if handle.kind is HandleKind.POSIX_FD:
            assert handle.fd is not None
            if fd_identity_of(handle.fd) != handle.identity:
                raise FdIdentityMismatch("import", -1, f"fd {handle.fd} is not the file its descriptor names")
            h = self._call("cuMemImportFromShareableHandle", handle.fd,
                           d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            return CudaAllocation(aid, size, handle.kind, imported=True, handle=h)
        if handle.kind is HandleKind.FABRIC:
            if self.fabric_trial is not FabricTrial.PASSED:
                raise FabricUnavailable(f"FABRIC import refused: {self.fabric_decision.why}")
            fh = struct_from(d.CUmemFabricHandle, handle.identity)
            h = self._call("cuMemImportFromShareableHandle", int(fh.getPtr()),
                           d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
            return CudaAllocation(aid, size, handle.kind, imported=True, handle=h)
        with _EXPORTED_IPC_LOCK:
            own = handle.identity in _EXPORTED_IPC
        if own:
            raise LegacyIpcRefused("a process may not open a legacy IPC handle it exported itself")
        ih = struct_from(d.CUipcMemHandle, handle.identity)
        ptr = self._call("cuIpcOpenMemHandle", ih, d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.value)
        return CudaAllocation(aid, size, handle.kind, imported=True, ptr=int(ptr))

    def reserve(self, size: int) -> CudaReservation:
        self._sized("reserve", size)
        if self._kind is HandleKind.CUDA_IPC:
            return CudaReservation(next(self._ids), 0, size)  # legacy memory maps where it opens
        self._enter()
        addr = self._call("cuMemAddressReserve", size, self._granularity, self._d.CUdeviceptr(0), 0)
        return CudaReservation(next(self._ids), int(addr), size)

    def free(self, reservation: CudaReservation) -> None:
        """Return a reservation's address space (cuMemAddressFree); refused while mapped."""
        if reservation.freed:
            raise UnknownNativeObject("cuMemAddressFree", -1, f"reservation {reservation.id} is already freed")
        if reservation.mappings:
            raise StillMapped("cuMemAddressFree", -1, f"reservation {reservation.id} has "
                              f"{reservation.mappings} mapping(s)")
        if reservation.addr:
            self._enter()
            self._call("cuMemAddressFree", self._d.CUdeviceptr(reservation.addr), reservation.size)
        reservation.freed = True

    def map(self, reservation: CudaReservation, offset: int, allocation: CudaAllocation) -> CudaMapping:
        if offset < 0 or offset % self._granularity:
            raise errors.NativeInvalidArgument("map", -1, f"offset {offset} is not a multiple of the "
                                               f"granularity {self._granularity}")
        if reservation.freed or allocation.released:
            raise UnknownNativeObject("map", -1, "the reservation or allocation is gone")
        if offset + allocation.size > reservation.size:
            raise OutOfRange("map", -1, f"{allocation.size} bytes at {offset} exceed the reservation of "
                             f"{reservation.size}")
        if allocation.kind is HandleKind.CUDA_IPC:
            if offset or reservation.mappings or allocation.mappings:
                raise LegacyIpcRefused("legacy IPC memory has one mapping, where it was allocated or opened")
            addr = allocation.ptr
        else:
            self._enter()
            addr = reservation.addr + offset
            self._call("cuMemMap", self._d.CUdeviceptr(addr), allocation.size, 0, allocation.handle, 0)
        with self._lock:
            m = CudaMapping(next(self._ids), addr, allocation.size, allocation, reservation)
            self._mappings[m.region] = m
            allocation.mappings += 1
            reservation.mappings += 1
        return m

    def set_access(self, mapping: CudaMapping, access: Access) -> None:
        """Grant this device ``access``. Legacy IPC memory is always read-write at the driver
        level; its level is recorded so ops see the same rules."""
        with self._lock:
            self._live(mapping, "set_access")
            self._engine.observe_locked()
            if ACCESS_LEVEL[access] < ACCESS_LEVEL[mapping.access] and mapping.pins:
                raise RegionPinned("set_access", -1, f"region {mapping.region} has {mapping.pins} pin(s)")
        if mapping.allocation.kind is not HandleKind.CUDA_IPC:
            if access is Access.NONE:
                raise errors.NativeInvalidArgument("set_access", -1, "CUDA cannot revoke access; unmap instead")
            self._enter()
            self._call("cuMemSetAccess", self._d.CUdeviceptr(mapping.addr), mapping.size,
                       [access_desc(self._d, self._ordinal, access)], 1)
        mapping.access = access

    def unmap(self, mapping: CudaMapping) -> None:
        with self._lock:
            self._live(mapping, "unmap")
            self._engine.observe_locked()
            if mapping.pins:
                raise RegionPinned("cuMemUnmap", -1, f"region {mapping.region} has {mapping.pins} pin(s) "
                                   f"({mapping.inflight} op(s) in flight)")
            if mapping.allocation.kind is not HandleKind.CUDA_IPC:
                self._enter()
                self._call("cuMemUnmap", self._d.CUdeviceptr(mapping.addr), mapping.size)
            mapping.unmapped = True
            mapping.allocation.mappings -= 1
            mapping.reservation.mappings -= 1
            del self._mappings[mapping.region]

    def release(self, allocation: CudaAllocation) -> None:
        if allocation.released:
            raise UnknownNativeObject("cuMemRelease", -1, f"allocation {allocation.id} is already released")
        if allocation.mappings:
            raise StillMapped("cuMemRelease", -1, f"allocation {allocation.id} has {allocation.mappings} mapping(s)")
        self._enter()
        if allocation.kind is HandleKind.CUDA_IPC:
            if allocation.imported:
                self._call("cuIpcCloseMemHandle", self._d.CUdeviceptr(allocation.ptr))
            else:
                self._call("cuMemFree", self._d.CUdeviceptr(allocation.ptr))
        else:
            self._call("cuMemRelease", allocation.handle)
            if allocation.export_fd is not None:
                os.close(allocation.export_fd)
                allocation.export_fd = None
        allocation.released = True

    # -- pins and observation (same shape as the host backend) ---------------------------

    def _live(self, mapping: CudaMapping, call: str) -> None:
        if mapping.unmapped or self._mappings.get(mapping.region) is not mapping:
            raise UnknownNativeObject(call, -1, f"region {mapping.region} is not mapped")

    def pin(self, mapping: CudaMapping) -> None:
        with self._lock:
            self._live(mapping, "pin")
            mapping.explicit_pins += 1

    def unpin(self, mapping: CudaMapping) -> None:
        with self._lock:
            self._live(mapping, "unpin")
            if not mapping.explicit_pins:
                raise errors.NativeInvalidArgument("unpin", -1, f"region {mapping.region} holds no explicit pin")
            mapping.explicit_pins -= 1

    def stats(self, mapping: CudaMapping) -> RegionStats:
        with self._lock:
            self._live(mapping, "stats")
            self._engine.observe_locked()
            m = mapping
            return RegionStats(m.region, m.addr, m.size, m.allocation.id, m.reservation.id,
                               ACCESS_LEVEL[m.access], m.pins, m.explicit_pins, m.inflight,
                               m.completed, m.failed, m.bytes)

    # -- gather (the op engine is kvstate.transport.cuda.ops) ------------------------------

    def submit_gather(self, src: CudaMapping | DeviceBuffer, dst: CudaMapping | DeviceBuffer,
                      blocks: Sequence[tuple[int, int, int]]) -> CudaOp:
        """Copy each (src_off, dst_off, len) block device to device on this transport's
        stream; pins every mapping it touches until its event completes."""
        return self._engine.submit_gather(src, dst, blocks)

    def submit_copy(self, src: CudaMapping | DeviceBuffer, dst: CudaMapping | DeviceBuffer, length: int, *,
                    src_off: int = 0, dst_off: int = 0) -> CudaOp:
        return self.submit_gather(src, dst, [(src_off, dst_off, length)])

    # -- device buffers (for engines without their own allocator, and the GPU check) -----

    def alloc_buffer(self, nbytes: int) -> DeviceBuffer:
        self._enter()
        return DeviceBuffer(int(self._call("cuMemAlloc", nbytes)), nbytes)

    def free_buffer(self, buf: DeviceBuffer) -> None:
        self._enter()
        self._call("cuMemFree", self._d.CUdeviceptr(buf.ptr))

    def write(self, target: CudaMapping | DeviceBuffer, data: bytes, offset: int = 0) -> None:
        """Synchronous host-to-device copy (tests and checks)."""
        addr, size = (target.addr, target.size) if isinstance(target, CudaMapping) else (target.ptr, target.nbytes)
        if offset < 0 or offset + len(data) > size:
            raise OutOfRange("write", -1, f"{len(data)} bytes at {offset} exceed {size}")
        buf = ctypes.create_string_buffer(data, len(data))
        self._enter()
        self._call("cuMemcpyHtoD", self._d.CUdeviceptr(addr + offset), ctypes.addressof(buf), len(data))

    def read(self, source: CudaMapping | DeviceBuffer, nbytes: int, offset: int = 0) -> bytes:
        """Synchronous device-to-host copy (tests and checks)."""
        addr, size = (source.addr, source.size) if isinstance(source, CudaMapping) else (source.ptr, source.nbytes)
        if offset < 0 or offset + nbytes > size:
            raise OutOfRange("read", -1, f"{nbytes} bytes at {offset} exceed {size}")
        buf = ctypes.create_string_buffer(nbytes)
        self._enter()
        self._call("cuMemcpyDtoH", ctypes.addressof(buf), self._d.CUdeviceptr(addr + offset), nbytes)
        return buf.raw

    def close(self) -> None:
        """Destroy the stream and drop this transport's hold on the primary context.
        Refused while ops are in flight; allocations must have been released."""
        with self._lock:
            self._engine.close()
            self._enter()
            self._call("cuStreamDestroy", self._stream)
            self._call("cuDevicePrimaryCtxRelease", self._dev)


def _conformance(t: CudaTransport) -> None:
    """Checked by mypy, never called: the cuda backend implements these protocols."""
    mapped: MappedTransport[CudaHandle, CudaAllocation, CudaReservation, CudaMapping, DeviceBuffer] = t
    exporting: ExportingTransport[CudaHandle, CudaAllocation] = t
    del mapped, exporting
