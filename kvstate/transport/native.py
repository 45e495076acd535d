"""Typed wrapper over the cffi module ``kvstate._native`` (sources in ``ffi/``).

The C layer keeps allocations (sealed memfds), reservations (PROT_NONE address space),
regions (mappings) and ops in process-global tables named by 64-bit ids; ``ffi/kvs.h``
has the theory of operation. This module turns each C error code into a typed error from
:mod:`kvstate.core.errors`, converts seconds to nanoseconds, keeps caller buffers alive until
the op that uses them is reaped, and checks at load time that the op table compiled into
the module is the one in ``spec/op.toml``.

Nothing here loads native code at import: :func:`default` loads ``kvstate._native`` on
first use. Calls into the module release the GIL (cffi's API mode does so for every
call), so a blocking :meth:`Native.wait` does not stall other Python threads.

Typical use, an importer gathering blocks out of a mapped region into a local buffer::

    nat = native.default()
    op = nat.submit_gather(region, buf, blocks)        # pins `region` until it finishes
    op.result(timeout=5.0)                             # waits, reaps, raises OpFailed
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final

import attrs

from kvstate.core import errors
from kvstate.derive.header import table_digest
from kvstate.core.errors import (
    BackendUnavailable,
    GuardRejected,
    IllegalTransition,
    NativeError,
    SpecError,
)
from kvstate.core.optional import is_missing, require
from kvstate.core.spec import load_machine

#: Access levels as the C layer numbers them.
ACCESS_NONE: Final = 0
ACCESS_READ: Final = 1
ACCESS_READ_WRITE: Final = 2


#: One end of an op: a region id (int), or a caller buffer supporting the buffer protocol
#: (bytearray, memoryview, mmap, numpy array); a destination buffer must be writable.
Endpoint = Any

#: One gather block: (source offset, destination offset, length) in bytes.
Block = tuple[int, int, int]


@attrs.frozen(eq=False)
class RawBuffer:
    """Caller memory named by address, for memory that has no buffer protocol (a torch
    tensor, a DLPack capsule): ops read or write ``[addr, addr + size)``. Whoever makes one
    keeps that memory alive until every op using it is reaped; ``owner`` is carried along
    for that purpose and is never touched here."""

    addr: int
    size: int
    owner: Any = None


@attrs.frozen
class RegionStats:
    """What the native layer reports about one region. ``quiescent`` means no pins."""

    region: int
    addr: int
    size: int
    allocation: int
    reservation: int
    access: int
    pins: int
    explicit_pins: int
    inflight: int
    completed: int
    failed: int
    bytes: int

    @property
    def quiescent(self) -> bool:
        return self.pins == 0


@attrs.frozen
class EngineStats:
    """Global counters of the native layer."""

    allocations: int
    reservations: int
    regions: int
    pins: int
    ops_live: int
    ops_queued: int
    ops_running: int
    submitted: int
    completed: int
    failed: int
    cancelled: int
    bytes: int
    workers: int
    paused: bool


@attrs.frozen
class OpInfo:
    op: int
    state: str
    error: int
    bytes: int
    nblocks: int


class Op:
    """A submitted native op. Wait for it, then :meth:`reap` (or :meth:`result`) it once."""

    __slots__ = ("_native", "id")

    def __init__(self, native: Native, op_id: int) -> None:
        self._native = native
        self.id = op_id

    def __repr__(self) -> str:
        return f"<Op {self.id}>"

    def info(self) -> OpInfo:
        return self._native.op_info(self.id)

    def poll(self) -> bool:
        """True when the op finished (done, failed or cancelled) and may be reaped."""
        return self._native.wait(self.id, 0.0)

    def wait(self, timeout: float) -> bool:
        return self._native.wait(self.id, timeout)

    def cancel(self) -> None:
        self._native.cancel(self.id)

    def notify(self, fd: int) -> None:
        """Add 1 to eventfd ``fd`` once the op is collectable (see :meth:`Native.notify`)."""
        self._native.notify(self.id, fd)

    def reap(self) -> OpInfo:
        return self._native.reap(self.id)

    def result(self, timeout: float) -> OpInfo:
        """Wait up to ``timeout`` s, reap, and raise :class:`OpFailed` if the op failed."""
        if not self.wait(timeout):
            raise errors.OpWaitTimeout("kvs_wait", int(self._native.lib.KVS_E_TIMEOUT),
                                       f"op {self.id} still running after {timeout} s")
        info = self.reap()
        if info.state == "failed":
            raise errors.OpFailed("kvs_reap", info.error, f"op {self.id} failed: "
                                  f"{self._native.strerror(info.error)}", self.id)
        return info


class Native:
    """The native layer behind one cffi module (normally ``kvstate._native``)."""

    def __init__(self, ffi: Any, lib: Any, *, check_table: bool = True) -> None:
        """``check_table=False`` is for tests that build a module from another table on purpose."""
        self.ffi = ffi
        self.lib = lib
        if check_table:
            self._check_table()
        self.op_states: tuple[str, ...] = tuple(
            ffi.string(lib.kvs_op_state_name(i)).decode() for i in range(lib.kvs_op_nstates()))
        self._errors = self._error_map()
        # Caller buffers an op reads or writes stay referenced until the op is reaped.
        self._keep: dict[int, tuple[Any, ...]] = {}
        self.page_size: int = int(lib.kvs_page_size())
        # Bound once: the submit path is measured in microseconds.
        self._from_buffer = ffi.from_buffer
        self._cast = ffi.cast
        self._new = ffi.new
        self._submit_copy = lib.kvs_submit_copy
        self._fail_flag = int(lib.KVS_OPF_FAIL)

    # -- plumbing ----------------------------------------------------------------------

    def _check_table(self) -> None:
        """The op table compiled into the module must be spec/op.toml's."""
        m = load_machine("op")
        lib, ffi = self.lib, self.ffi
        states = tuple(ffi.string(lib.kvs_op_state_name(i)).decode() for i in range(lib.kvs_op_nstates()))
        events = tuple(ffi.string(lib.kvs_op_event_name(i)).decode() for i in range(lib.kvs_op_nevents()))
        built = ffi.string(lib.kvs_op_table_digest()).decode()
        if states != m.state_names or events != m.event_names or built != table_digest(m):
            raise SpecError("ffi/kvs_op_table.h", "op table",
                            f"the native module was built from another op table (digest {built}, "
                            f"states {states}, events {events}); run `python -m kvstate.derive.header` "
                            "and rebuild (`make`)")

    def _error_map(self) -> dict[int, type[NativeError]]:
        lib = self.lib
        return {
            lib.KVS_E_INVAL: errors.NativeInvalidArgument,
            lib.KVS_E_NOENT: errors.UnknownNativeObject,
            lib.KVS_E_PINNED: errors.RegionPinned,
            lib.KVS_E_MAPPED: errors.StillMapped,
            lib.KVS_E_RANGE: errors.OutOfRange,
            lib.KVS_E_OVERLAP: errors.MappingOverlap,
            lib.KVS_E_SIZE: errors.FdWrongSize,
            lib.KVS_E_SEALS: errors.FdUnsealed,
            lib.KVS_E_NOTMEMFD: errors.FdNotMemfd,
            lib.KVS_E_TIMEOUT: errors.OpWaitTimeout,
            lib.KVS_E_BUSY: errors.EngineBusy,
            lib.KVS_E_NOMEM: errors.NativeNoMemory,
        }

    def strerror(self, code: int) -> str:
        return str(self.ffi.string(self.lib.kvs_strerror(code)).decode())

    def _raise(self, call: str, rc: int, what: str, state: str = "", event: str = "") -> None:
        detail = f"{what}: {self.strerror(rc)}"
        if rc == self.lib.KVS_E_SYS:
            err = self.ffi.errno
            raise errors.NativeOSError(call, rc, f"{detail} (errno {err})", err)
        if rc == self.lib.KVS_E_ILLEGAL:
            raise IllegalTransition("op", state or "?", event or call)
        if rc == self.lib.KVS_E_ACCESS:
            raise GuardRejected("op", "created", "submit", ["regions_mapped"])
        raise self._errors.get(rc, NativeError)(call, rc, detail)

    @staticmethod
    def _ns(timeout: float) -> int:
        if not math.isfinite(timeout) or timeout < 0:
            raise errors.NativeInvalidArgument("timeout", -1, f"timeout must be finite and >= 0, not {timeout!r}")
        return int(timeout * 1e9)

    # -- host backend ------------------------------------------------------------------

    def create(self, size: int) -> int:
        """A new sealed memfd of ``size`` bytes (a multiple of the page size)."""
        out = self.ffi.new("uint64_t *")
        rc = self.lib.kvs_create(size, out)
        if rc:
            self._raise("kvs_create", rc, f"size {size}")
        return int(out[0])

    def export_fd(self, allocation: int) -> int:
        """The allocation's fd, borrowed: send it (SCM_RIGHTS dups it), never close it."""
        out = self.ffi.new("int32_t *")
        rc = self.lib.kvs_export_fd(allocation, out)
        if rc:
            self._raise("kvs_export_fd", rc, f"allocation {allocation}")
        return int(out[0])

    def import_fd(self, fd: int, size: int) -> int:
        """Check ``fd`` (memfd, exact ``size``, sealed) and adopt a duplicate of it.

        The caller keeps ownership of ``fd`` and closes it.
        """
        out = self.ffi.new("uint64_t *")
        rc = self.lib.kvs_import_fd(fd, size, out)
        if rc:
            self._raise("kvs_import_fd", rc, f"fd {fd}, expected size {size}")
        return int(out[0])

    def allocation_size(self, allocation: int) -> int:
        out = self.ffi.new("uint64_t *")
        rc = self.lib.kvs_allocation_size(allocation, out)
        if rc:
            self._raise("kvs_allocation_size", rc, f"allocation {allocation}")
        return int(out[0])

    def release(self, allocation: int) -> None:
        rc = self.lib.kvs_release(allocation)
        if rc:
            self._raise("kvs_release", rc, f"allocation {allocation}")

    def reserve(self, size: int, align: int) -> tuple[int, int]:
        """Reserve ``size`` bytes of inaccessible address space; returns (reservation, addr)."""
        res, addr = self.ffi.new("uint64_t *"), self.ffi.new("uint64_t *")
        rc = self.lib.kvs_reserve(size, align, res, addr)
        if rc:
            self._raise("kvs_reserve", rc, f"size {size}, align {align}")
        return int(res[0]), int(addr[0])

    def free_reservation(self, reservation: int) -> None:
        rc = self.lib.kvs_free_reservation(reservation)
        if rc:
            self._raise("kvs_free_reservation", rc, f"reservation {reservation}")

    def map(self, reservation: int, offset: int, allocation: int) -> tuple[int, int]:
        """Map the allocation at ``offset`` in the reservation, with no access; (region, addr)."""
        region, addr = self.ffi.new("uint64_t *"), self.ffi.new("uint64_t *")
        rc = self.lib.kvs_map(reservation, offset, allocation, region, addr)
        if rc:
            self._raise("kvs_map", rc, f"allocation {allocation} at offset {offset} of reservation {reservation}")
        return int(region[0]), int(addr[0])

    def set_access(self, region: int, access: int) -> None:
        rc = self.lib.kvs_set_access(region, access)
        if rc:
            self._raise("kvs_set_access", rc, f"region {region}, access {access}")

    def unmap(self, region: int) -> None:
        rc = self.lib.kvs_unmap(region)
        if rc:
            self._raise("kvs_unmap", rc, f"region {region}")

    def view(self, region: int) -> memoryview:
        """A memoryview over a region's bytes. Touching it without access faults, by design."""
        st = self.region_stats(region)
        return memoryview(self.ffi.buffer(self.ffi.cast("char *", st.addr), st.size))

    # -- pins and observation ----------------------------------------------------------

    def pin(self, region: int) -> None:
        """Take an explicit pin (for a lease); unmap and release refuse until :meth:`unpin`."""
        rc = self.lib.kvs_region_pin(region)
        if rc:
            self._raise("kvs_region_pin", rc, f"region {region}")

    def unpin(self, region: int) -> None:
        rc = self.lib.kvs_region_unpin(region)
        if rc:
            self._raise("kvs_region_unpin", rc, f"region {region} (explicit pins only)")

    def region_stats(self, region: int) -> RegionStats:
        out = self.ffi.new("kvs_region_info *")
        rc = self.lib.kvs_region_info_get(region, out)
        if rc:
            self._raise("kvs_region_info_get", rc, f"region {region}")
        return RegionStats(region, out.addr, out.size, out.allocation, out.reservation, out.access,
                           out.pins, out.explicit_pins, out.inflight, out.completed, out.failed, out.bytes)

    def stats(self) -> EngineStats:
        out = self.ffi.new("kvs_global_info *")
        self.lib.kvs_global_info_get(out)
        return EngineStats(out.allocations, out.reservations, out.regions, out.pins, out.ops_live,
                           out.ops_queued, out.ops_running, out.submitted, out.completed,
                           out.failed, out.cancelled, out.bytes, out.workers, bool(out.paused))

    # -- op engine ---------------------------------------------------------------------

    def configure(self, workers: int) -> None:
        """Set the worker count (default 2). Refused with EngineBusy while ops run."""
        rc = self.lib.kvs_engine_configure(workers)
        if rc:
            self._raise("kvs_engine_configure", rc, f"workers {workers}")

    def pause(self, paused: bool) -> None:
        """Paused workers take no new op; submitted ops stay queued (and pinned)."""
        self.lib.kvs_engine_pause(1 if paused else 0)

    def _endpoint(self, ep: Endpoint, writable: bool) -> tuple[int, int, int, Any]:
        """(region, addr, size, keepalive) for a region id, a :class:`RawBuffer` or a caller
        buffer. A buffer's export (``ffi.from_buffer``) is the keepalive: whoever gets it
        releases it (:meth:`_release`) on every path, so no export outlives its op."""
        if ep.__class__ is int:
            return ep, 0, 0, None
        if isinstance(ep, int):
            return int(ep), 0, 0, None
        if isinstance(ep, RawBuffer):
            return 0, ep.addr, ep.size, None  # its owner keeps the memory alive
        try:
            cbuf = self._from_buffer(ep, require_writable=writable)
        except (TypeError, BufferError) as exc:
            raise errors.NativeInvalidArgument("kvs_submit", -1, f"not a usable buffer: {exc}") from None
        return 0, int(self._cast("uintptr_t", cbuf)), len(cbuf), cbuf

    def _release(self, *kept: Any) -> None:
        """Give back buffer exports now rather than at some later garbage collection: an
        export left behind pins the exporter (a memoryview cannot be released) and, once
        its owner goes, points at freed memory."""
        for k in kept:
            if k is not None:
                self.ffi.release(k)

    def submit_copy(self, src: Endpoint, dst: Endpoint, length: int, *, src_off: int = 0,
                    dst_off: int = 0, fail: bool = False) -> Op:
        """Copy ``length`` bytes; each end is a region id or a buffer. ``fail`` injects a fault.

        This is the hot path (one call per small op), so it is kept flat."""
        # Region ids (the common case) skip the buffer plumbing entirely.
        sk = dk = None
        try:
            if src.__class__ is int:
                sr, sa, ss = src, 0, 0
            else:
                sr, sa, ss, sk = self._endpoint(src, False)
            if dst.__class__ is int:
                dr, da, ds = dst, 0, 0
            else:
                dr, da, ds, dk = self._endpoint(dst, True)
            out = self._new("int64_t *")
            rc = self._submit_copy(sr, sa, ss, src_off, dr, da, ds, dst_off, length,
                                   self._fail_flag if fail else 0, out)
            if rc:
                self._raise("kvs_submit_copy", rc, f"copy of {length} bytes", "created", "submit")
        except BaseException:
            self._release(sk, dk)
            raise
        op_id = int(out[0])
        if sk is not None or dk is not None:
            self._keep[op_id] = (sk, dk)  # a dict store is atomic under the GIL
        return Op(self, op_id)

    def submit_gather(self, src: Endpoint, dst: Endpoint, blocks: Sequence[Block] | Any, *,
                      fail: bool = False, notify_fd: int | None = None) -> Op:
        """Copy each (src_off, dst_off, len) block. ``blocks`` is a sequence of triples or a
        buffer of native-endian uint64 triples (e.g. a numpy ``uint64`` array of shape (n, 3)
        or an ``array.array('Q')``); the engine copies the list at submit. ``notify_fd``: an
        eventfd that gets 1 added once the op is collectable (see :meth:`notify`)."""
        ffi = self.ffi
        if notify_fd is not None and (type(notify_fd) is not int or notify_fd <= 0):
            raise errors.NativeInvalidArgument("kvs_op_notify", -1, f"notify_fd must be a positive fd, not {notify_fd!r}")
        sk = dk = cblocks = None
        try:
            sr, sa, ss, sk = self._endpoint(src, False)
            dr, da, ds, dk = self._endpoint(dst, True)
            if isinstance(blocks, (list, tuple)):
                try:
                    cblocks = ffi.new("kvs_block[]", [tuple(b) for b in blocks])
                except (TypeError, OverflowError, ValueError) as exc:
                    raise errors.NativeInvalidArgument("kvs_submit", -1, f"blocks: {exc}") from None
                n = len(blocks)
            else:
                try:
                    cblocks = ffi.from_buffer("kvs_block[]", blocks)
                except (TypeError, BufferError, ValueError) as exc:
                    raise errors.NativeInvalidArgument("kvs_submit", -1, f"blocks: {exc}") from None
                n = len(cblocks)
            s = ffi.new("kvs_endpoint *", (sr, sa, ss))
            d = ffi.new("kvs_endpoint *", (dr, da, ds))
            out = ffi.new("int64_t *")
            rc = self.lib.kvs_submit(s, d, cblocks, n, self._fail_flag if fail else 0, out)
            if rc:
                self._raise("kvs_submit", rc, f"gather of {n} blocks", "created", "submit")
        except BaseException:
            self._release(sk, dk)
            raise
        finally:
            self._release(cblocks)  # the engine copied the list
        op_id = int(out[0])
        if sk is not None or dk is not None:
            self._keep[op_id] = (sk, dk)
        op = Op(self, op_id)
        if notify_fd is not None:
            self.notify(op_id, notify_fd)  # cannot fail: a fresh op, a positive fd, checked above
        return op

    def notify(self, op: int, fd: int) -> None:
        """Have the engine add 1 to the eventfd ``fd`` once ``op`` is collectable (done,
        failed or cancelled), at once if it already is. ``fd`` must stay open until the
        op is reaped: the engine writes to that number."""
        rc = self.lib.kvs_op_notify(op, fd)
        if rc:
            self._raise("kvs_op_notify", rc, f"op {op}, fd {fd}")

    def op_info(self, op: int) -> OpInfo:
        out = self.ffi.new("kvs_op_info *")
        rc = self.lib.kvs_op_info_get(op, out)
        if rc:
            self._raise("kvs_op_info_get", rc, f"op {op}")
        return OpInfo(op, self.op_states[out.state], out.error, out.bytes, out.nblocks)

    def wait(self, op: int, timeout: float) -> bool:
        """Block up to ``timeout`` s (0 polls) without the GIL; True once the op finished."""
        rc = self.lib.kvs_wait(op, self._ns(timeout))
        if rc == self.lib.KVS_E_TIMEOUT:
            return False
        if rc:
            self._raise("kvs_wait", rc, f"op {op}")
        return True

    def cancel(self, op: int) -> None:
        """Cancel a queued op (its pins drop). A running or finished op is IllegalTransition."""
        rc = self.lib.kvs_cancel(op)
        if rc:
            self._raise("kvs_cancel", rc, f"op {op}", self._state_or_unknown(op), "cancel")

    def reap(self, op: int) -> OpInfo:
        """Collect a finished op and free its slot; the op's buffers are released here."""
        out = self.ffi.new("kvs_op_info *")
        rc = self.lib.kvs_reap(op, out)
        if rc:
            self._raise("kvs_reap", rc, f"op {op}", self._state_or_unknown(op), "reap")
        self._release(*self._keep.pop(op, ()))
        return OpInfo(op, self.op_states[out.state], out.error, out.bytes, out.nblocks)

    def _state_or_unknown(self, op: int) -> str:
        out = self.ffi.new("kvs_op_info *")
        return self.op_states[out.state] if self.lib.kvs_op_info_get(op, out) == 0 else "?"

    @property
    def planted_bug(self) -> bool:
        """True only for the test-only module built with a planted bug."""
        return bool(self.lib.kvs_planted_bug())

    def wait_all(self, ops: Iterable[Op], timeout: float) -> bool:
        """Wait for every op within one overall ``timeout``; True when all finished."""
        deadline = time.monotonic() + self._ns(timeout) / 1e9
        for op in ops:
            if not self.wait(op.id, max(0.0, deadline - time.monotonic())):
                return False
        return True


_default: Native | None = None
_default_lock = threading.Lock()


def default() -> Native:
    """The process's native layer, loading ``kvstate._native`` on first use."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                require("_cffi_backend", "host", hint="install 'kvstate[native]'")
                try:
                    from kvstate import _native  # type: ignore[attr-defined]
                except ModuleNotFoundError as exc:
                    if not is_missing(exc, "kvstate._native"):
                        raise
                    raise BackendUnavailable("host", "the native module kvstate._native was not "
                                             "built; reinstall kvstate where a C compiler is "
                                             "available") from None
                _default = Native(_native.ffi, _native.lib)
    return _default
