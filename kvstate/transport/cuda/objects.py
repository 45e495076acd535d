"""The objects the CUDA backend hands out. Each names an object of the C layer by its id;
their state (mappings, pins, ops) lives there, not here."""

from __future__ import annotations

import attrs

from kvstate.core.handles import HandleKind


@attrs.frozen
class CudaHandle:
    """A shareable handle: for POSIX_FD the fd (exported: owned by the allocation;
    received: owned by the receiver) and its identity; otherwise 64 bytes and no fd."""

    kind: HandleKind
    identity: bytes
    fd: int | None = None


@attrs.frozen
class CudaAllocation:
    id: int
    size: int
    kind: HandleKind
    imported: bool


@attrs.frozen
class CudaReservation:
    id: int
    addr: int   # 0 for a legacy IPC transport's placeholder
    size: int


@attrs.frozen
class CudaMapping:
    region: int
    addr: int
    size: int
    allocation: CudaAllocation
    reservation: CudaReservation


@attrs.frozen
class DeviceBuffer:
    """Device memory as an end of a gather: a buffer of ``CudaTransport.alloc_buffer``, or
    memory the caller owns (e.g. a KV-cache tensor's ``data_ptr()``). An op pins a buffer
    of ``alloc_buffer`` for its life (``free_buffer`` refuses with Busy, reason pinned, until the
    device is done with it); the caller's own memory kvstate cannot pin: keep it alive
    until every op that uses it was reaped."""

    ptr: int
    nbytes: int
