"""The native layer behind ``kvstate._native``: its C error codes, op engine and observation.

The C layer keeps allocations (sealed memfds), reservations (PROT_NONE address space),
regions (mappings) and ops in process-global tables named by 64-bit ids; ``ffi/kvs.h``
has the theory of operation and :mod:`kvstate.transport.libkvs` its typed face.

:class:`Native` is the one home of what every caller of the C functions shares: it turns
each C error code into a typed error from :mod:`kvstate.core.errors` (:meth:`Native.error`),
checks at load time that the op table compiled into the module is ``spec/op.toml``'s,
and drives the op engine (submit, wait, cancel, reap), keeping caller buffers alive
until the op that uses them is reaped. The host backend
(:class:`kvstate.transport.host.HostTransport`) calls the memory functions of the typed
``lib`` itself, one call per operation, and raises ``native.error(..)`` on a refusal.

Nothing here loads native code at import: :func:`default` loads ``kvstate._native`` on
first use. Calls into the module release the GIL (cffi's API mode does so for every
call), so a blocking :meth:`Native.wait` does not stall other Python threads.

Typical use, gathering blocks out of a mapped region into a local buffer::

    nat = native.default()
    op = nat.submit_gather(region, buf, blocks)        # pins `region` until it finishes
    op.result(timeout=5.0)                             # waits, reaps, raises NativeError (OP_FAILED)
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, Union, cast

import attrs

from kvstate.core.reasons import ArgumentReason, BusyReason, ImportDefect, NativeReason
from kvstate.core.errors import (
    ArgumentInvalid, BackendUnavailable, Busy, ConfigInvalid, ImportFailed, KvStateError, NativeError, TimedOut,
    TransitionError,
)
from kvstate.core.optional import is_missing, require
from kvstate.derive.header import table_digest
from kvstate.transport import libkvs
from kvstate.transport.libkvs import BlockArray, CBuffer, Ffi, Int64Ptr, Lib, UInt64Ptr
from kvstate.transport.optable import CANCEL, OPS, REAP, SUBMIT
from kvstate.transport.protocol import Block, OpInfo, RegionStats


class ArrayInterface(Protocol):
    """A numpy array. It has the buffer protocol at run time, but numpy's stubs declare
    ``__buffer__`` only for Python 3.12 on, so for 3.11 it is known by this attribute."""

    @property
    def __array_interface__(self) -> Mapping[str, object]: ...


@attrs.frozen(eq=False)
class RawBuffer:
    """Caller memory named by address, for memory that has no buffer protocol (a torch
    tensor, a DLPack capsule): ops read or write ``[addr, addr + size)``. kvstate cannot pin
    memory it did not allocate, so an op of :class:`Native` holds the RawBuffer, and with it
    ``owner`` (the object that keeps the memory alive), until the op is reaped: a caller
    that drops its reference early does not free the memory under the op. ``owner`` is
    never touched otherwise."""

    addr: int
    size: int
    owner: object = None


if TYPE_CHECKING:
    from typing_extensions import Buffer

    #: Caller memory an op may read or write: anything with the buffer protocol
    #: (bytearray, memoryview, mmap, numpy array), or a RawBuffer; a destination must be
    #: writable.
    HostBuffer = Union[Buffer, ArrayInterface]
    #: One end of an op: a region id, caller memory by address, or a caller buffer.
    Endpoint = Union[int, RawBuffer, HostBuffer]

#: What an op holds of caller memory until it is reaped (see :meth:`Native._endpoint`).
Kept = Union[CBuffer, RawBuffer, None]


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
        """True when the op finished (its state is collectable) and may be reaped."""
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
        """Wait up to ``timeout`` s, reap, and raise NativeError (OP_FAILED) if the op failed."""
        if not self.wait(timeout):
            raise TimedOut.native("kvs_wait", self._native.lib.KVS_E_TIMEOUT,
                                  f"op {self.id} still running after {timeout} s")
        info = self.reap()
        if OPS.faulted(info.state):
            raise NativeError.native("kvs_reap", info.error, f"op {self.id} {info.state}: "
                                     f"{self._native.reason(info)}", NativeReason.OP_FAILED, op=self.id)
        return info


class Native:
    """The native layer behind one cffi module (normally ``kvstate._native``)."""

    def __init__(self, ffi: Ffi, lib: Lib, *, check_table: bool = True) -> None:
        """``check_table=False`` is for tests that build a module from another table on purpose."""
        self.ffi = ffi
        self.lib = lib
        if check_table:
            self._check_table()
        self.op_states: tuple[str, ...] = tuple(
            ffi.string(lib.kvs_op_state_name(i)).decode() for i in range(lib.kvs_op_nstates()))
        self._errors = self._error_map()
        # Caller memory an op reads or writes (a buffer's export, a RawBuffer and its owner)
        # stays referenced until the op is reaped.
        self._keep: dict[int, tuple[Kept, Kept]] = {}
        self.page_size: int = int(lib.kvs_page_size())
        # Bound once: the submit path is measured in microseconds.
        self._new = ffi.new
        self._submit_copy = lib.kvs_submit_copy
        self._fail_flag = int(lib.KVS_OPF_FAIL)

    # -- plumbing ----------------------------------------------------------------------

    def _check_table(self) -> None:
        """The op table compiled into the module must be spec/op.toml's."""
        m = OPS.spec
        lib, ffi = self.lib, self.ffi
        states = tuple(ffi.string(lib.kvs_op_state_name(i)).decode() for i in range(lib.kvs_op_nstates()))
        events = tuple(ffi.string(lib.kvs_op_event_name(i)).decode() for i in range(lib.kvs_op_nevents()))
        built = ffi.string(lib.kvs_op_table_digest()).decode()
        collectable = tuple(bool(lib.kvs_op_collectable(i)) for i in range(len(states)))
        if (states != m.state_names or events != m.event_names or built != table_digest(m)
                or collectable != tuple(OPS.collectable(s) for s in states)):
            raise ConfigInvalid.spec("ffi/kvs_op_table.h", "op table",
                                     f"the native module was built from another op table (digest {built}, "
                                     f"states {states}, events {events}); run `python -m kvstate.derive.header` "
                                     "and rebuild (`make`)")

    def _error_map(self) -> dict[int, Callable[[str, int, str], KvStateError]]:
        """C return code -> the typed error it stands for (what the caller does about it)."""
        lib = self.lib

        def arg(reason: ArgumentReason) -> Callable[[str, int, str], KvStateError]:
            return lambda call, rc, detail: ArgumentInvalid.native(call, rc, detail, reason)

        def busy(reason: BusyReason) -> Callable[[str, int, str], KvStateError]:
            return lambda call, rc, detail: Busy.native(reason, call, rc, detail)

        def fd(defect: ImportDefect) -> Callable[[str, int, str], KvStateError]:
            return lambda call, rc, detail: ImportFailed.handle(defect, detail, call=call, code=rc)

        def native(reason: NativeReason) -> Callable[[str, int, str], KvStateError]:
            return lambda call, rc, detail: NativeError.native(call, rc, detail, reason)

        return {
            lib.KVS_E_INVAL: arg(ArgumentReason.NATIVE),
            lib.KVS_E_NOENT: arg(ArgumentReason.UNKNOWN_OBJECT),
            lib.KVS_E_PINNED: busy(BusyReason.PINNED),
            lib.KVS_E_OWNED: busy(BusyReason.OWNED),
            lib.KVS_E_MAPPED: busy(BusyReason.MAPPED),
            lib.KVS_E_RANGE: arg(ArgumentReason.OUT_OF_RANGE),
            lib.KVS_E_OVERLAP: arg(ArgumentReason.OVERLAP),
            lib.KVS_E_SIZE: fd(ImportDefect.FD_SIZE),
            lib.KVS_E_SEALS: fd(ImportDefect.FD_UNSEALED),
            lib.KVS_E_NOTMEMFD: fd(ImportDefect.FD_NOT_MEMFD),
            lib.KVS_E_IDENTITY: fd(ImportDefect.FD_IDENTITY),
            lib.KVS_E_TIMEOUT: TimedOut.native,
            lib.KVS_E_BUSY: busy(BusyReason.ENGINE),
            lib.KVS_E_NOMEM: native(NativeReason.NO_MEMORY),
        }

    def strerror(self, code: int) -> str:
        return self.ffi.string(self.lib.kvs_strerror(code)).decode()

    def reason(self, info: OpInfo) -> str:
        """Why an op failed, with the CUresult the device reported for a CUDA op."""
        if info.error == self.lib.KVS_E_CUDA:
            return f"the device reported CUresult {info.result} ({self.cuda_result_name(info.result)})"
        return self.strerror(info.error)

    def cuda_result_name(self, result: int) -> str:
        """cuGetErrorName of a CUresult ("" before the driver is loaded, or if it has none)."""
        name = self.lib.kvs_cuda_result_name(result)
        return self.ffi.string(name).decode() if name != self.ffi.NULL else ""

    def error(self, rc: int, call: str, what: str, state: str = "", event: str = "") -> KvStateError:
        """The typed error for C return code ``rc`` of ``call`` (about ``what``); the caller
        raises it straight after the call, so errno is still the failing call's."""
        detail = f"{what}: {self.strerror(rc)}"
        if rc == self.lib.KVS_E_CUDA:
            from kvstate.transport.cuda.rules import cuda_error  # driver-free; imported here (no cycle)

            call_name = self.ffi.string(self.lib.kvs_cuda_last_call()).decode() or call
            result = self.lib.kvs_cuda_last_result()
            return cuda_error(call_name, result, self.cuda_result_name(result), what)
        if rc == self.lib.KVS_E_NODRIVER:
            return BackendUnavailable.missing("cuda", self.ffi.string(self.lib.kvs_cuda_load_error()).decode()
                                              or "the CUDA driver is not loaded")
        if rc == self.lib.KVS_E_OWNIPC:
            return ImportFailed.handle(ImportDefect.LEGACY_IPC, f"{call}: {what}: a process may not open a legacy "
                                       "IPC handle it exported itself")
        if rc == self.lib.KVS_E_SYS:
            err = self.ffi.errno
            return NativeError.native(call, rc, f"{detail} (errno {err})", NativeReason.OS, errno=err)
        if rc == self.lib.KVS_E_ILLEGAL:
            return TransitionError.illegal(OPS.name, state or "?", event or call)
        if rc == self.lib.KVS_E_ACCESS:  # the C engine's only guard, on the initial submit row
            row = OPS.spec.rows(SUBMIT, OPS.initial)[0]
            return TransitionError.guard(OPS.name, OPS.initial, SUBMIT, row.guards)
        make = self._errors.get(rc)
        return NativeError.native(call, rc, detail) if make is None else make(call, rc, detail)

    @staticmethod
    def _ns(timeout: float) -> int:
        if not math.isfinite(timeout) or timeout < 0:
            raise ArgumentInvalid.native("timeout", -1, f"timeout must be finite and >= 0, not {timeout!r}")
        return min(int(timeout * 1e9), (1 << 63) - 1)  # C takes int64 nanoseconds: longer is forever

    # -- observation -------------------------------------------------------------------

    def region_stats(self, region: int) -> RegionStats:
        out = self.ffi.new("kvs_region_info *")
        rc = self.lib.kvs_region_info_get(region, out)
        if rc:
            raise self.error(rc, "kvs_region_info_get", f"region {region}")
        return RegionStats(region, out.addr, out.size, out.allocation, out.reservation, out.access,
                           out.pins, out.explicit_pins, out.inflight, out.completed, out.failed, out.bytes)

    def stats(self) -> EngineStats:
        out = self.ffi.new("kvs_global_info *")
        self.lib.kvs_global_info_get(out)
        return EngineStats(out.allocations, out.reservations, out.regions, out.pins, out.ops_live,
                           out.ops_queued, out.ops_running, out.submitted, out.completed,
                           out.failed, out.cancelled, out.bytes, out.workers, bool(out.paused))

    @property
    def planted_bug(self) -> bool:
        """True only for the test-only module built with a planted bug."""
        return bool(self.lib.kvs_planted_bug())

    # -- op engine ---------------------------------------------------------------------

    def configure(self, workers: int) -> None:
        """Set the worker count (default 2). Refused with Busy (ENGINE) while ops run."""
        rc = self.lib.kvs_engine_configure(workers)
        if rc:
            raise self.error(rc, "kvs_engine_configure", f"workers {workers}")

    def pause(self, paused: bool) -> None:
        """Paused workers take no new op; submitted ops stay queued (and pinned)."""
        self.lib.kvs_engine_pause(1 if paused else 0)

    def allow(self, ops: int) -> None:
        """While paused, let workers start the next ``ops`` queued ops (in submit order) and
        finish them; the others stay queued. A test's deterministic hold: what is queued
        after them provably has not run. ArgumentInvalid when not paused."""
        if type(ops) is not int or not 0 <= ops < 2**32:
            raise ArgumentInvalid.of("ops", ArgumentReason.RANGE, f"{ops!r:.40} is not a count of ops")
        if self.lib.kvs_engine_allow(ops):
            raise ArgumentInvalid.of("ops", ArgumentReason.STATE, "the op engine is not paused")

    def _endpoint(self, ep: Endpoint, writable: bool) -> tuple[int, int, int, Kept]:
        """(region, addr, size, keepalive) for a region id, a :class:`RawBuffer` or a caller
        buffer. A buffer's export (``ffi.from_buffer``) is the keepalive: it is given back
        (:meth:`_release`) on every path, so no export outlives its op. A RawBuffer is its
        own keepalive (its owner holds the memory)."""
        if isinstance(ep, int):
            if isinstance(ep, bool) or not 0 < ep < 1 << 64:
                raise ArgumentInvalid.native("kvs_submit", -1, f"region id {ep!r} is not a positive u64")
            return int(ep), 0, 0, None
        if isinstance(ep, RawBuffer):
            return 0, ep.addr, ep.size, ep  # held until reaped: its owner keeps the memory alive
        try:
            cbuf = self.ffi.from_buffer(ep, require_writable=writable)
        except (TypeError, BufferError) as exc:
            raise ArgumentInvalid.native("kvs_submit", -1, f"not a usable buffer: {exc}") from None
        return 0, int(self.ffi.cast("uintptr_t", cbuf)), len(cbuf), cbuf

    def _submitted(self, op_id: int, keep_src: Kept, keep_dst: Kept) -> Op:
        if keep_src is not None or keep_dst is not None:
            self._keep[op_id] = (keep_src, keep_dst)  # a dict store is atomic under the GIL
        return Op(self, op_id)

    def _release(self, *kept: Kept | BlockArray) -> None:
        """Give back buffer exports now rather than at some later garbage collection: an
        export left behind (a traceback holding the frame is enough) pins the exporter (a
        memoryview can no longer be released) and, once its owner goes, names freed memory."""
        for k in kept:
            if k is not None and not isinstance(k, RawBuffer):  # a RawBuffer is only dropped
                self.ffi.release(k)

    def submit_copy(self, src: Endpoint, dst: Endpoint, length: int, *, src_off: int = 0,
                    dst_off: int = 0, fail: bool = False) -> Op:
        """Copy ``length`` bytes; each end is a region id or a buffer. ``fail`` injects a fault.

        This is the hot path (one call per small op), so it is kept flat."""
        # Region ids (the common case) skip the buffer plumbing entirely.
        sk = dk = None
        try:
            if type(src) is int:
                sr, sa, ss = src, 0, 0
            else:
                sr, sa, ss, sk = self._endpoint(src, False)
            if type(dst) is int:
                dr, da, ds = dst, 0, 0
            else:
                dr, da, ds, dk = self._endpoint(dst, True)
            out = self._new("int64_t *")
            rc = self._submit_copy(sr, sa, ss, src_off, dr, da, ds, dst_off, length,
                                   self._fail_flag if fail else 0, out)
            if rc:
                raise self.error(rc, "kvs_submit_copy", f"copy of {length} bytes", OPS.initial, SUBMIT)
        except BaseException:
            self._release(sk, dk)
            raise
        return self._submitted(int(out[0]), sk, dk)

    def submit_gather(self, src: Endpoint, dst: Endpoint, blocks: Sequence[Block] | HostBuffer, *,
                      fail: bool = False, notify_fd: int | None = None) -> Op:
        """Copy each (src_off, dst_off, len) block. ``blocks`` is a sequence of triples or a
        buffer of native-endian uint64 triples (e.g. a numpy ``uint64`` array of shape (n, 3)
        or an ``array.array('Q')``); the engine copies the list at submit. ``notify_fd``: an
        eventfd that gets 1 added once the op is collectable (see :meth:`notify`)."""
        if notify_fd is not None and (type(notify_fd) is not int or notify_fd <= 0):
            raise ArgumentInvalid.native("kvs_op_notify", -1, f"notify_fd must be a positive fd, not {notify_fd!r}")
        ffi = self.ffi
        sk = dk = None
        cblocks: BlockArray | None = None
        try:
            sr, sa, ss, sk = self._endpoint(src, False)
            dr, da, ds, dk = self._endpoint(dst, True)
            cblocks = self._blocks(blocks, "kvs_submit")
            n = len(cblocks)
            s = ffi.new("kvs_endpoint *", (sr, sa, ss))
            d = ffi.new("kvs_endpoint *", (dr, da, ds))
            out = ffi.new("int64_t *")
            rc = self.lib.kvs_submit(s, d, cblocks, n, self._fail_flag if fail else 0, out)
            if rc:
                raise self.error(rc, "kvs_submit", f"gather of {n} blocks", OPS.initial, SUBMIT)
        except BaseException:
            self._release(sk, dk)
            raise
        finally:
            self._release(cblocks)  # the engine copied the list
        op = self._submitted(int(out[0]), sk, dk)
        if notify_fd is not None:
            self.notify(op.id, notify_fd)  # cannot fail: a fresh op, a positive fd, checked above
        return op

    def _blocks(self, blocks: Sequence[Block] | HostBuffer, call: str) -> BlockArray:
        """The C array of a block list: triples, or a buffer of native-endian uint64 triples
        (exported: the caller releases it once the engine copied it)."""
        ffi = self.ffi
        if isinstance(blocks, (list, tuple)):
            try:
                return ffi.new("kvs_block[]", [tuple(b) for b in blocks])
            except (TypeError, OverflowError, ValueError) as exc:
                raise ArgumentInvalid.native(call, -1, f"blocks: {exc}") from None
        try:
            return ffi.from_buffer("kvs_block[]", blocks)
        except (TypeError, BufferError, ValueError) as exc:
            raise ArgumentInvalid.native(call, -1, f"blocks: {exc}") from None

    def notify(self, op: int, fd: int) -> None:
        """Have the engine add 1 to the eventfd ``fd`` once ``op`` is collectable (done,
        failed or cancelled), at once if it already is. ``fd`` must stay open until the
        op is reaped: the engine writes to that number."""
        rc = self.lib.kvs_op_notify(op, fd)
        if rc:
            raise self.error(rc, "kvs_op_notify", f"op {op}, fd {fd}")

    def report(self, sock: int | None, ok: bytes, failed: bytes, ops: Sequence[int], *,
               epochs: tuple[Any, Sequence[int], Sequence[int]] | None = None) -> int:
        """Have the engine send ``ok`` on socket ``sock`` once every op of ``ops`` is done, or
        ``failed`` once all are collectable and any failed or was cancelled, from the thread
        that ended the last one, never waiting for Python (``kvs_report_open``; the engine
        keeps its own dup of ``sock``). ``epochs`` (a store's: its bank's writable epoch
        page, the blocks it made odd and their odd epochs) end there too, first; with it,
        ``sock`` may be None (no message). Returns the report's id for :meth:`report_close`.
        NativeError (NOENT) when an op was already reaped: then nothing was set up."""
        lib, ffi = self.lib, self.ffi
        if sock is not None or epochs is None:
            if type(sock) is not int or sock < 0:
                raise ArgumentInvalid.native("kvs_report_open", -1, f"sock must be an fd, not {sock!r:.40}")
            for name, msg in (("ok", ok), ("the failure message", failed)):
                if not isinstance(msg, bytes) or not 0 < len(msg) <= lib.KVS_REPORT_MAX_BYTES:
                    raise ArgumentInvalid.native("kvs_report_open", -1, f"{name} must be 1 to "
                                                 f"{lib.KVS_REPORT_MAX_BYTES} bytes, not {type(msg).__name__} "
                                                 f"of {len(msg) if isinstance(msg, bytes) else '?'}")
        page = cast(UInt64Ptr, ffi.NULL)
        blocks = cast(Int64Ptr, ffi.NULL)
        odd = cast(UInt64Ptr, ffi.NULL)
        nblocks = 0
        if epochs is not None:
            buf, eids, odds = epochs
            if len(eids) != len(odds) or not 0 < len(eids) <= lib.KVS_REPORT_MAX_BLOCKS \
                    or any(type(b) is not int or not 0 <= b < len(buf) // 8 for b in eids) \
                    or any(type(o) is not int or o < 0 or not o & 1 for o in odds):
                raise ArgumentInvalid.native("kvs_report_open", -1, "epochs: one odd epoch per block of the page")
            page = ffi.from_buffer("uint64_t[]", buf, require_writable=True)
            blocks, odd, nblocks = ffi.new("int64_t[]", list(eids)), ffi.new("uint64_t[]", list(odds)), len(eids)
        if not isinstance(ops, (list, tuple)) or not 0 < len(ops) <= lib.KVS_REPORT_MAX_OPS \
                or any(type(o) is not int for o in ops):
            raise ArgumentInvalid.native("kvs_report_open", -1, f"ops must be 1 to "
                                         f"{lib.KVS_REPORT_MAX_OPS} op ids (int)")
        out = ffi.new("int64_t *")
        try:
            ids = ffi.new("int64_t[]", list(ops))
        except OverflowError:
            raise ArgumentInvalid.native("kvs_report_open", -1, "an op id is out of range") from None
        message = sock is not None
        none = ffi.NULL
        rc = self.lib.kvs_report_open(-1 if sock is None else sock, ffi.new("char[]", ok) if message else none,
                                      len(ok) if message else 0,
                                      ffi.new("char[]", failed) if message else none, len(failed) if message else 0,
                                      ids, len(ops), page, blocks, odd, nblocks, out)
        if rc:
            raise self.error(rc, "kvs_report_open", f"{len(ops)} op(s) on fd {sock}")
        return int(out[0])

    def report_close(self, report: int) -> int:
        """Forget report ``report``; returns its KVS_REPORT_* status (a pending one is never sent)."""
        status = self.ffi.new("int32_t *")
        rc = self.lib.kvs_report_close(report, status)
        if rc:
            raise self.error(rc, "kvs_report_close", f"report {report}")
        return int(status[0])

    def submit_cuda(self, device: int, src: tuple[int, int, int], dst: tuple[int, int, int],
                    blocks: Sequence[Block] | HostBuffer, *, fail: bool = False, notify_fd: int | None = None,
                    hold: tuple[RawBuffer | None, RawBuffer | None] = (None, None)) -> Op:
        """A gather on a CUDA device (``kvs_cuda_submit``): each end is ``(region, addr,
        size)``, a region of that device (addr and size 0) or device memory by address;
        ``blocks`` as :meth:`submit_gather`. ``hold``: the RawBuffers the ends came from,
        held (with their owners) until the op is reaped, as a host op holds them. The op
        is the engine's like any other: wait, reap, ``result`` or ``notify`` it here."""
        if notify_fd is not None and (type(notify_fd) is not int or notify_fd <= 0):
            raise ArgumentInvalid.native("kvs_op_notify", -1, f"notify_fd must be a positive fd, not {notify_fd!r}")
        ffi = self.ffi
        cblocks = self._blocks(blocks, "kvs_cuda_submit")
        try:
            n = len(cblocks)
            out = ffi.new("int64_t *")
            rc = self.lib.kvs_cuda_submit(device, ffi.new("kvs_endpoint *", src), ffi.new("kvs_endpoint *", dst),
                                          cblocks, n, self._fail_flag if fail else 0, out)
            if rc:
                raise self.error(rc, "kvs_cuda_submit", f"gather of {n} blocks", OPS.initial, SUBMIT)
        finally:
            self._release(cblocks)  # the engine copied the list
        op = self._submitted(int(out[0]), *hold)
        if notify_fd is not None:
            self.notify(op.id, notify_fd)  # cannot fail: a fresh op, a positive fd, checked above
        return op

    def op_info(self, op: int) -> OpInfo:
        out = self.ffi.new("kvs_op_info *")
        rc = self.lib.kvs_op_info_get(op, out)
        if rc:
            raise self.error(rc, "kvs_op_info_get", f"op {op}")
        return OpInfo(op, self.op_states[out.state], out.error, out.bytes, out.nblocks, out.result)

    def wait(self, op: int, timeout: float) -> bool:
        """Block up to ``timeout`` s (0 polls) without the GIL; True once the op finished."""
        rc = self.lib.kvs_wait(op, self._ns(timeout))
        if rc == self.lib.KVS_E_TIMEOUT:
            return False
        if rc:
            raise self.error(rc, "kvs_wait", f"op {op}")
        return True

    def cancel(self, op: int) -> None:
        """Cancel a queued op (its pins drop). A running or finished op is TransitionError (ILLEGAL)."""
        rc = self.lib.kvs_cancel(op)
        if rc:
            raise self.error(rc, "kvs_cancel", f"op {op}", self._state_or_unknown(op), CANCEL)

    def reap(self, op: int) -> OpInfo:
        """Collect a finished op and free its slot; the op's buffers are released here."""
        out = self.ffi.new("kvs_op_info *")
        rc = self.lib.kvs_reap(op, out)
        if rc:
            raise self.error(rc, "kvs_reap", f"op {op}", self._state_or_unknown(op), REAP)
        self._release(*self._keep.pop(op, ()))
        return OpInfo(op, self.op_states[out.state], out.error, out.bytes, out.nblocks, out.result)

    def _state_or_unknown(self, op: int) -> str:
        out = self.ffi.new("kvs_op_info *")
        return self.op_states[out.state] if self.lib.kvs_op_info_get(op, out) == 0 else "?"


_default: Native | None = None
_default_lock = threading.Lock()


def default() -> Native:
    """The process's native layer, loading ``kvstate._native`` on first use."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                require("_cffi_backend", "host", hint="cffi is a dependency of kvstate: pip install cffi")
                try:
                    ffi, lib = libkvs.load()
                except ModuleNotFoundError as exc:
                    if not is_missing(exc, libkvs.MODULE):
                        raise
                    raise BackendUnavailable.missing("host", "the native module kvstate._native was not "
                                                     "built; reinstall kvstate where a C compiler is "
                                                     "available") from None
                _default = Native(ffi, lib)
    return _default
