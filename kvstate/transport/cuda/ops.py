"""The cuda backend's op engine: gathers on the transport's stream, stepped through
``spec/op.toml``.

The C op engine counts pins only on regions it made itself (host memfds), so until the
CUDA ops move into it, this engine keeps the cuda backend's ops: each is a
:class:`~kvstate.transport.cuda.objects.CudaOp` stepped by an
:class:`~kvstate.transport.optable.OpStepper` with this backend's implementation of the
table's guard (``regions_mapped``) and effects (``pin_regions``, ``unpin_regions``), so
no op state is written here. ``submit`` pins every mapping the op touches, ``start``
follows at once (work on a stream may run as soon as it is enqueued), and ``finish`` or
``fail`` are fired when ``cuEventQuery`` reports the op's event complete. Completion is
observed whenever anyone looks (``stats``, ``wait``, ``unmap``), under the transport's
lock, which also guards the mappings' pin counts.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from kvstate.core import errors
from kvstate.core.capabilities import Access
from kvstate.transport.cuda import rules
from kvstate.transport.cuda.objects import ACCESS_LEVEL, CudaMapping, CudaOp, DeviceBuffer
from kvstate.transport.optable import FAIL, FINISH, OPS, START, SUBMIT, OpStepper

class CudaOps:
    """The ops of one ``CudaTransport``, on its stream.

    From the transport it takes the driver module, the lock that also guards the mappings'
    pin counts, and three calls: ``call(name, *args)`` (a driver call whose error becomes a
    typed CudaError), ``enter()`` (make the device's context current) and
    ``live(mapping, what)`` (refuse a mapping that is gone)."""

    def __init__(self, driver: ModuleType, stream: Any, max_pitch: int, lock: threading.RLock, *,
                 call: Callable[..., Any], enter: Callable[[], None],
                 live: Callable[[CudaMapping, str], None]) -> None:
        self._d = driver
        self._lock = lock
        self._call = call
        self._enter = enter
        self._live = live
        self._stream = stream
        self._max_pitch = max_pitch
        self._ids = itertools.count(1)
        self._live_ops: dict[int, CudaOp] = {}
        self._steps = OpStepper[CudaOp](guards={"regions_mapped": self._regions_mapped},
                                        effects={"pin_regions": self._pin_regions,
                                                 "unpin_regions": self._unpin_regions})

    def observe(self) -> None:
        with self._lock:
            self.observe_locked()

    def observe_locked(self) -> None:
        """Step every started op whose event completed (or failed) with ``finish`` or
        ``fail``, which drops its pins: the native observation the drain waits for."""
        if not self._live_ops:
            return
        self._enter()
        for op in [o for o in self._live_ops.values() if OPS.may(o.state, FINISH)]:
            (err,) = self._d.cuEventQuery(op.event)
            code = int(err)
            if code != rules.CUDA_ERROR_NOT_READY:
                self._end(op, code)

    def _end(self, op: CudaOp, code: int) -> None:
        """``finish`` (code 0) or ``fail`` a started op, and count it on its mappings."""
        self._steps.step(op, FINISH if code == 0 else FAIL)
        op.error = code
        for m in op.regions:
            if code == 0:
                m.completed += 1
                m.bytes += op.nbytes
            else:
                m.failed += 1

    def step(self, op: CudaOp, event: str) -> None:
        with self._lock:
            self._steps.step(op, event)

    def destroy(self, op: CudaOp) -> None:
        with self._lock:
            self._live_ops.pop(op.id, None)
        self._d.cuEventDestroy(op.event)

    # -- the op table's guard and effects for this backend's ops ---------------------------

    @staticmethod
    def _regions_mapped(op: CudaOp) -> bool:
        return ((op.src is None or ACCESS_LEVEL[op.src.access] >= ACCESS_LEVEL[Access.READ])
                and (op.dst is None or ACCESS_LEVEL[op.dst.access] >= ACCESS_LEVEL[Access.READ_WRITE]))

    @staticmethod
    def _pin_regions(op: CudaOp) -> None:
        for m in op.regions:
            m.inflight += 1

    @staticmethod
    def _unpin_regions(op: CudaOp) -> None:
        for m in op.regions:
            m.inflight -= 1

    def _endpoint(self, ep: CudaMapping | DeviceBuffer) -> tuple[int, int, CudaMapping | None]:
        if isinstance(ep, CudaMapping):
            self._live(ep, "gather")
            return ep.addr, ep.size, ep
        if isinstance(ep, DeviceBuffer):
            return ep.ptr, ep.nbytes, None
        raise errors.NativeInvalidArgument("gather", -1, f"{ep!r} is neither a CudaMapping nor a DeviceBuffer")

    def submit_gather(self, src: CudaMapping | DeviceBuffer, dst: CudaMapping | DeviceBuffer,
                      blocks: Sequence[tuple[int, int, int]]) -> CudaOp:
        """Copy each (src_off, dst_off, len) block device to device on this transport's
        stream. The op steps through the op table: ``submit`` (guard regions_mapped; pins
        every mapping it touches), ``start`` once enqueued, ``finish`` or ``fail`` when its
        event completes."""
        with self._lock:
            s_addr, s_size, s_map = self._endpoint(src)
            d_addr, d_size, d_map = self._endpoint(dst)
            plan = rules.plan_copies(rules.coalesce(blocks, s_size, d_size), self._max_pitch)
            self._enter()
            d = self._d
            event = self._call("cuEventCreate", d.CUevent_flags.CU_EVENT_DISABLE_TIMING.value)
            op = CudaOp(self, next(self._ids), event, s_map, d_map, sum(c.width * c.height for c in plan),
                        len(blocks))
            try:
                self._steps.step(op, SUBMIT)
            except BaseException:
                d.cuEventDestroy(event)
                raise
            self._live_ops[op.id] = op
            self._steps.step(op, START)  # on a stream, the device may run it at once
            try:
                for c in plan:
                    if c.height == 1:
                        self._call("cuMemcpyDtoDAsync", d.CUdeviceptr(d_addr + c.dst),
                                   d.CUdeviceptr(s_addr + c.src), c.width, self._stream)
                    else:
                        self._call("cuMemcpy2DAsync", self._copy2d(s_addr, d_addr, c), self._stream)
            finally:
                # Pins drop only when the device says so, even when enqueueing failed midway.
                (err,) = d.cuEventRecord(event, self._stream)
                if int(err) != 0:
                    d.cuStreamSynchronize(self._stream)
                    self._end(op, int(err))
        return op

    def _copy2d(self, s_addr: int, d_addr: int, c: rules.Copy) -> Any:
        d = self._d
        p = d.CUDA_MEMCPY2D()
        p.srcMemoryType = p.dstMemoryType = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
        p.srcDevice, p.srcPitch = d.CUdeviceptr(s_addr + c.src), c.src_pitch
        p.dstDevice, p.dstPitch = d.CUdeviceptr(d_addr + c.dst), c.dst_pitch
        p.WidthInBytes, p.Height = c.width, c.height
        return p


    def close(self) -> None:
        """Destroy every op's event; refused (EngineBusy) while any op is in flight."""
        with self._lock:
            self.observe_locked()
            if not all(OPS.collectable(o.state) for o in self._live_ops.values()):
                raise errors.EngineBusy("close", -1, "ops are still in flight")
            for op in list(self._live_ops.values()):
                self.destroy(op)
