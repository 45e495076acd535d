"""The C objects kvstate reads or passes, as Protocols of what Python does with them:
each pointer that a function of ``ffi/kvs.h`` takes or returns. :mod:`kvstate.transport.libkvs`
declares the functions with these types (and re-exports them), and
``tests/native/test_libkvs.py`` maps each C pointer type to its Protocol here."""

from __future__ import annotations

from typing import Protocol

__all__ = [
    "UInt64Ptr",
    "Int32Ptr",
    "Int64Ptr",
    "CharPtr",
    "CBuffer",
    "BlockArray",
    "EndpointPtr",
    "RegionInfoPtr",
    "GlobalInfoPtr",
    "OpInfoPtr",
    "CudaDriverInfoPtr",
    "CudaDeviceInfoPtr",
    "LinkPtr",
    "FramePtr",
    "RenewerPtr",
    "RenewOutcomePtr",
    "RenewStatePtr",
    "MachineInstPtr",
    "Int32Array",
    "FireResultPtr",
    "AttachPartArray",
    "AttachPart",
    "ImportPart",
    "ImportPartArray",
    "EffectFn",
    "VoidPtr",
    "LeaseServerPtr",
    "LeaseServerOut",
    "UInt32Ptr",
    "LeaseInfo",
    "LeaseInfoArray",
    "HoldInfo",
    "HoldInfoArray",
    "LeaseEventPtr",
    "IndexPtr",
    "IndexOut",
    "VFactsArray",
    "VExpectArray",
]


# -- what Python reads from the C objects it allocates or receives ----------------------


class UInt64Ptr(Protocol):
    """``uint64_t *`` from ``ffi.new``: one out parameter."""

    def __getitem__(self, index: int) -> int: ...


class Int32Ptr(Protocol):
    """``int32_t *`` from ``ffi.new``: one out parameter (or an array of them)."""

    def __getitem__(self, index: int) -> int: ...
    def __setitem__(self, index: int, value: int) -> None: ...


class Int64Ptr(Protocol):
    """``int64_t *`` from ``ffi.new``: one out parameter."""

    def __getitem__(self, index: int) -> int: ...


class CharPtr(Protocol):
    """``char *``: a C string (read with ``ffi.string``) or an address (``ffi.buffer``)."""


class CBuffer(Protocol):
    """``ffi.from_buffer(obj)``: a caller buffer, kept alive while this object lives."""

    def __len__(self) -> int: ...


class BlockArray(Protocol):
    """``kvs_block[]`` (``kvs_block *`` in a signature): gather blocks."""

    def __len__(self) -> int: ...


class EndpointPtr(Protocol):
    """``kvs_endpoint *``: one end of a gather."""


class RegionInfoPtr(Protocol):
    """``kvs_region_info *``."""

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


class GlobalInfoPtr(Protocol):
    """``kvs_global_info *``."""

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
    paused: int


class OpInfoPtr(Protocol):
    """``kvs_op_info *``."""

    state: int
    error: int
    result: int
    bytes: int
    nblocks: int


class CudaDriverInfoPtr(Protocol):
    """``kvs_cuda_driver_info *``."""

    version: int
    devices: int
    batch: int


class CudaDeviceInfoPtr(Protocol):
    """``kvs_cuda_device_info *``: ``uuid`` (16 bytes) and ``name`` are char arrays."""

    uuid: CharPtr
    name: CharPtr
    vmm: int
    posix_fd: int
    fabric: int
    max_pitch: int


class LinkPtr(Protocol):
    """``kvs_link *``: one request link (opaque; ``kvs_link_unref`` frees it)."""


class FramePtr(Protocol):
    """``kvs_frame *``: one received frame, or what a refused one claimed."""

    buf: CharPtr
    cap: int
    len: int
    nfds: int
    said_len: int
    said_fds: int
    magic: CharPtr
    err: int
    fds: Int32Ptr


class RenewerPtr(Protocol):
    """``kvs_renewer *``: one renewal thread (opaque; ``kvs_renewer_stop`` frees it)."""


class RenewOutcomePtr(Protocol):
    """``kvs_renew_outcome *`` (also an array of them): a lease renewal that failed."""

    key: int
    code: int
    err: int
    len: int
    reply: CharPtr

    def __getitem__(self, index: int) -> RenewOutcomePtr: ...


class RenewStatePtr(Protocol):
    """``kvs_renew_state *``."""

    renewed_at_ns: int
    expires_at_ns: int
    renewals: int
    failed: int
    generation: int


class MachineInstPtr(Protocol):
    """``kvs_machine_inst *``: one instance of a natively executed lifecycle machine."""

    machine: int
    state: int
    owner: int
    reserved: int


class Int32Array(Protocol):
    """``int32_t[]`` (a field of a struct, or ``int32_t *`` from ``ffi.new("int32_t[]")``)."""

    def __getitem__(self, index: int) -> int: ...


class FireResultPtr(Protocol):
    """``kvs_fire_result *``: what one ``kvs_machine_fire`` did or why it refused."""

    source: int
    dest: int
    row: int
    effect: int
    error: int
    undone: int
    undo_failed: int
    nrefused: int
    refused: Int32Array


class AttachPartArray(Protocol):
    """``kvs_attach_part[]``: one exporter batch of the native attach (``kvs_attach``)."""

    def __getitem__(self, index: int) -> AttachPart: ...


class AttachPart(Protocol):
    """One ``kvs_attach_part``: a part's fd, state and guards in; what was made, or why
    it failed, out."""

    fd: int
    state: int
    holds: int
    dev: int
    ino: int
    size: int
    allocation: int
    reservation: int
    region: int
    addr: int
    step: int
    code: int
    err: int
    nrefused: int
    refused: Int32Array
    left: int


class ImportPart(Protocol):
    """One ``kvs_import_part``: the descriptor's fields the exporter's report must match,
    the lease's guard bits and renewal key in; the grant and the attach half out."""

    attach: AttachPart
    lease_holds: int
    rank: int
    generation: int
    num_blocks: int
    incarnation: CharPtr
    geometry: CharPtr
    device_uuid: CharPtr
    renew_key: int
    lease: int
    expires_ns: int
    why: int
    registered: int


class ImportPartArray(Protocol):
    """``kvs_import_part[]``: one exporter batch of the native import (``kvs_import``)."""

    def __getitem__(self, index: int) -> ImportPart: ...


class EffectFn(Protocol):
    """``kvs_effect_fn``: a C function pointer (Python passes ``ffi.NULL`` or a C callback)."""


class VoidPtr(Protocol):
    """``void *``: a callback's context, opaque here."""


# -- the exporter's lease server (kvstate.share.lease_server) ------------------------------


class LeaseServerPtr(Protocol):
    """``kvs_lease_server *``: opaque; made by ``kvs_lease_server_new``."""


class LeaseServerOut(Protocol):
    """``kvs_lease_server **`` from ``ffi.new``: where ``kvs_lease_server_new`` puts it."""

    def __getitem__(self, index: int) -> LeaseServerPtr: ...


class UInt32Ptr(Protocol):
    """``uint32_t *`` from ``ffi.new``: one out parameter."""

    def __getitem__(self, index: int) -> int: ...


class LeaseInfo(Protocol):
    """One ``kvs_lease_info``: a lease of the native table."""

    id: int
    conn: int
    expires_in_ns: int
    expired: int
    pid: int
    nblocks: int


class LeaseInfoArray(Protocol):
    """``kvs_lease_info[]`` from ``ffi.new``."""

    def __getitem__(self, index: int) -> LeaseInfo: ...


class HoldInfo(Protocol):
    """One ``kvs_hold_info``: a hold of the native table."""

    id: int
    conn: int
    conn_open: int
    has_pidfd: int


class HoldInfoArray(Protocol):
    """``kvs_hold_info[]`` from ``ffi.new``."""

    def __getitem__(self, index: int) -> HoldInfo: ...


class LeaseEventPtr(Protocol):
    """``kvs_lease_event *``: one committed transition of the lease server."""

    rank: int
    event: int
    source: int
    dest: int
    lease: int
    t_ns: int
    why: int
    dropped: int


# -- the decode index's lookups (ffi/kvs_index.h; kvstate.integrations.vllm.index_mirror) --


class IndexPtr(Protocol):
    """``kvs_index *``: opaque; made by ``kvs_index_new``."""


class IndexOut(Protocol):
    """``kvs_index **`` from ``ffi.new``: where ``kvs_index_new`` puts it."""

    def __getitem__(self, index: int) -> IndexPtr: ...


# -- the descriptor rules (ffi/kvs_validate.h, generated from spec/rules.toml) -------------


class VFactsArray(Protocol):
    """``kvs_vfacts[]``: descriptors as the declared rules read them."""


class VExpectArray(Protocol):
    """``kvs_vexpect[]``: what the importer accepts, one per descriptor."""
