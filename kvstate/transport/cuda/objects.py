"""The objects the CUDA backend hands out: handles, allocations, reservations, mappings
(with the pin counts the native layer's observation reports) and ops on a stream."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import attrs

from kvstate.core.capabilities import Access
from kvstate.core.errors import OpFailed, OpWaitTimeout
from kvstate.core.handles import HandleKind
from kvstate.transport.optable import CANCEL, OPS, REAP
from kvstate.transport.protocol import OpInfo

if TYPE_CHECKING:
    from kvstate.transport.cuda.ops import CudaOps

#: Access levels, ordered as the C layer numbers them: each includes the previous.
ACCESS_LEVEL = {Access.NONE: 0, Access.READ: 1, Access.READ_WRITE: 2}


@attrs.frozen
class CudaHandle:
    """A shareable handle: for POSIX_FD the fd (exported: owned by the allocation;
    received: owned by the receiver) and its identity; otherwise 64 bytes and no fd."""

    kind: HandleKind
    identity: bytes
    fd: int | None = None


@attrs.define(eq=False)
class CudaAllocation:
    id: int
    size: int
    kind: HandleKind
    imported: bool
    handle: Any = None             # CUmemGenericAllocationHandle (VMM)
    ptr: int = 0                   # legacy: cuMemAlloc or cuIpcOpenMemHandle address
    export_fd: int | None = None   # VMM POSIX export, closed at release
    mappings: int = 0
    released: bool = False


@attrs.define(eq=False)
class CudaReservation:
    id: int
    addr: int
    size: int
    mappings: int = 0
    freed: bool = False


@attrs.define(eq=False)
class CudaMapping:
    region: int
    addr: int
    size: int
    allocation: CudaAllocation
    reservation: CudaReservation
    access: Access = Access.NONE
    explicit_pins: int = 0
    inflight: int = 0
    completed: int = 0
    failed: int = 0
    bytes: int = 0
    unmapped: bool = False

    @property
    def pins(self) -> int:
        return self.explicit_pins + self.inflight


@attrs.frozen
class DeviceBuffer:
    """A destination or source in device memory the caller owns (e.g. a KV-cache tensor's
    ``data_ptr()``, or ``CudaTransport.alloc_buffer``)."""

    ptr: int
    nbytes: int


class CudaOp:
    """One gather on the transport's stream, stepped through ``spec/op.toml`` by its
    engine (:class:`kvstate.transport.cuda.ops.CudaOps`). Same shape as
    :class:`kvstate.transport.native.Op`."""

    def __init__(self, engine: CudaOps, op_id: int, event: Any, src: CudaMapping | None,
                 dst: CudaMapping | None, nbytes: int, nblocks: int) -> None:
        self._t = engine
        self.id = op_id
        self.event = event
        self.src = src
        self.dst = dst
        # Each mapping the op touches, once (the C engine pins a region once per op, too).
        self.regions = tuple(m for i, m in enumerate((src, dst)) if m is not None and (i == 0 or m is not src))
        self.nbytes = nbytes
        self.nblocks = nblocks
        self.state = OPS.initial
        self.error = 0

    def __repr__(self) -> str:
        return f"<CudaOp {self.id} {self.state}>"

    def info(self) -> OpInfo:
        self._t.observe()
        return OpInfo(self.id, self.state, self.error, self.nbytes, self.nblocks)

    def poll(self) -> bool:
        self._t.observe()
        return OPS.collectable(self.state)

    def wait(self, timeout: float) -> bool:
        """Poll the event until it completes or ``timeout`` s pass (cuEventSynchronize has
        no timeout, so it is not used)."""
        deadline = time.monotonic() + timeout
        delay = 20e-6
        while not self.poll():
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        return True

    def cancel(self) -> None:
        """Work on a stream cannot be withdrawn: an enqueued op has already started, and
        the table declares no cancel there (IllegalTransition)."""
        self._t.step(self, CANCEL)

    def reap(self) -> OpInfo:
        """Collect a finished op (IllegalTransition while it runs) and destroy its event."""
        info = self.info()
        self._t.step(self, REAP)
        self._t.destroy(self)
        return info

    def result(self, timeout: float) -> OpInfo:
        if not self.wait(timeout):
            raise OpWaitTimeout("cuEventQuery", -13, f"op {self.id} still running after {timeout} s")
        info = self.reap()
        if OPS.faulted(info.state):
            raise OpFailed("cuEventQuery", info.error, f"op {self.id} {info.state} with CUresult {info.error}",
                           self.id)
        return info
