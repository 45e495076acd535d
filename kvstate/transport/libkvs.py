"""The typed face of the cffi module ``kvstate._native``: the one place kvstate meets C.

cffi generates ``lib`` and ``ffi`` at build time and ships no types for them, so this
module declares them as Protocols: :class:`Lib` is ``ffi/kvs.h`` written in Python types
(integers of any C width are ``int``; each pointer the C functions take is a small
Protocol of what Python reads from it), and :class:`Ffi` is the part of cffi's ``FFI``
that kvstate uses, with the C declarations it passes spelled as literals so each call's
result has a precise type. Everything above this module is then checked by mypy strict.

``tests/native/test_libkvs.py`` holds the declarations to the compiled module: every
function and constant of the module is declared here, none that it lacks, and each
parameter and result has the type its C declaration maps to. ``kvs.h`` is the single
source of the C side (``ffi/build_host.py`` derives cffi's declarations from it), so a
change of the header that this file does not follow fails that test.

:func:`load` imports the module on first use; importing this module loads no native code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol, SupportsInt, overload

if TYPE_CHECKING:
    from typing_extensions import Buffer


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


# -- the module ----------------------------------------------------------------------------


class Lib(Protocol):
    """``ffi/kvs.h``: constants, then functions in the header's order."""

    KVS_OK: int
    KVS_E_INVAL: int
    KVS_E_SYS: int
    KVS_E_NOENT: int
    KVS_E_PINNED: int
    KVS_E_MAPPED: int
    KVS_E_ACCESS: int
    KVS_E_RANGE: int
    KVS_E_OVERLAP: int
    KVS_E_SIZE: int
    KVS_E_SEALS: int
    KVS_E_NOTMEMFD: int
    KVS_E_ILLEGAL: int
    KVS_E_TIMEOUT: int
    KVS_E_BUSY: int
    KVS_E_NOMEM: int
    KVS_E_INJECTED: int
    KVS_E_NODRIVER: int
    KVS_E_CUDA: int
    KVS_E_OWNIPC: int
    KVS_E_GUARD: int
    KVS_E_EFFECT: int
    KVS_E_REENTRANT: int
    KVS_ACCESS_NONE: int
    KVS_ACCESS_READ: int
    KVS_ACCESS_READ_WRITE: int
    KVS_OPF_FAIL: int
    KVS_REPORT_MAX_OPS: int
    KVS_REPORT_MAX_BYTES: int
    KVS_REPORT_PENDING: int
    KVS_REPORT_SENT_OK: int
    KVS_REPORT_SENT_FAILED: int
    KVS_REPORT_UNSENT: int
    KVS_CUDA_LEGACY_IPC: int
    KVS_CUDA_POSIX_FD: int
    KVS_CUDA_FABRIC: int
    KVS_CUDA_HANDLE_BYTES: int
    KVS_MACHINE_BANK: int
    KVS_LEASE_PYTHON: int
    KVS_LEASE_MAX_RANKS: int
    KVS_LWHY_NONE: int
    KVS_LWHY_CLOSED: int
    KVS_LWHY_EXITED: int
    KVS_LWHY_STOPPED: int
    KVS_LWHY_EXPIRED: int
    KVS_MACHINE_PART: int
    KVS_ATTACH_ROW: int
    KVS_ATTACH_IDENTITY: int
    KVS_ATTACH_IMPORT: int
    KVS_ATTACH_RESERVE: int
    KVS_ATTACH_MAP: int
    KVS_ATTACH_ACCESS: int
    KVS_E_IDENTITY: int
    KVS_ATTACH_MAX_PARTS: int
    KVS_IMPORT_DEFER: int
    KVS_IMPORT_ATTACH: int
    KVS_IMPORT_WHY_REPORT: int
    KVS_IMPORT_WHY_FD: int
    KVS_IMPORT_WHY_RENEWAL: int
    KVS_IMPORT_HEX: int
    KVS_MNAME_MACHINE: int
    KVS_MNAME_STATE: int
    KVS_MNAME_EVENT: int
    KVS_MNAME_GUARD: int
    KVS_MNAME_EFFECT: int
    KVS_E_LINK_CLOSED: int
    KVS_E_LINK_PEER_DIED: int
    KVS_E_LINK_TIMEOUT: int
    KVS_E_LINK_SYS: int
    KVS_E_LINK_CAP: int
    KVS_E_LINK_TOOBIG: int
    KVS_E_LINK_SHORT_SEND: int
    KVS_E_LINK_TRUNC: int
    KVS_E_LINK_CTRUNC: int
    KVS_E_LINK_SHORT: int
    KVS_E_LINK_MAGIC: int
    KVS_E_LINK_LENGTH: int
    KVS_E_LINK_FDS: int
    KVS_INDEX_PYTHON: int
    KVS_LINK_HEADER: int
    KVS_LINK_MAX_FDS: int
    KVS_RENEW_REFUSED: int
    KVS_RENEW_REPLY_MAX: int

    # host backend
    def kvs_page_size(self) -> int: ...
    def kvs_create(self, size: int, allocation: UInt64Ptr) -> int: ...
    def kvs_export_fd(self, allocation: int, fd: Int32Ptr) -> int: ...
    def kvs_import_fd(self, fd: int, size: int, allocation: UInt64Ptr) -> int: ...
    def kvs_release(self, allocation: int) -> int: ...
    def kvs_reserve(self, size: int, align: int, reservation: UInt64Ptr, addr: UInt64Ptr) -> int: ...
    def kvs_free_reservation(self, reservation: int) -> int: ...
    def kvs_map(self, reservation: int, offset: int, allocation: int, region: UInt64Ptr,
                addr: UInt64Ptr) -> int: ...
    def kvs_set_access(self, region: int, access: int) -> int: ...
    def kvs_unmap(self, region: int) -> int: ...

    # pins and observation
    def kvs_region_pin(self, region: int) -> int: ...
    def kvs_region_unpin(self, region: int) -> int: ...
    def kvs_region_info_get(self, region: int, out: RegionInfoPtr) -> int: ...
    def kvs_global_info_get(self, out: GlobalInfoPtr) -> None: ...

    # op engine
    def kvs_engine_configure(self, workers: int) -> int: ...
    def kvs_engine_pause(self, paused: int) -> int: ...
    def kvs_engine_allow(self, ops: int) -> int: ...
    def kvs_submit(self, src: EndpointPtr, dst: EndpointPtr, blocks: BlockArray, nblocks: int,
                   flags: int, op: Int64Ptr) -> int: ...
    def kvs_submit_copy(self, src_region: int, src_addr: int, src_size: int, src_off: int,
                        dst_region: int, dst_addr: int, dst_size: int, dst_off: int, len: int,
                        flags: int, op: Int64Ptr) -> int: ...
    def kvs_cancel(self, op: int) -> int: ...
    def kvs_op_notify(self, op: int, fd: int) -> int: ...
    def kvs_report_open(self, sock: int, ok: CharPtr, ok_len: int, failed: CharPtr, failed_len: int,
                        ops: Int64Ptr, nops: int, report: Int64Ptr) -> int: ...
    def kvs_report_close(self, report: int, status: Int32Ptr) -> int: ...
    def kvs_op_info_get(self, op: int, out: OpInfoPtr) -> int: ...
    def kvs_wait(self, op: int, timeout_ns: int) -> int: ...
    def kvs_reap(self, op: int, out: OpInfoPtr) -> int: ...

    # cuda backend
    def kvs_cuda_load(self, path: CharPtr) -> int: ...
    def kvs_cuda_load_error(self) -> CharPtr: ...
    def kvs_cuda_last_call(self) -> CharPtr: ...
    def kvs_cuda_last_result(self) -> int: ...
    def kvs_cuda_result_name(self, result: int) -> CharPtr: ...
    def kvs_cuda_call_name(self, index: int) -> CharPtr: ...
    def kvs_cuda_driver_info_get(self, out: CudaDriverInfoPtr) -> int: ...
    def kvs_cuda_device_info_get(self, ordinal: int, out: CudaDeviceInfoPtr) -> int: ...
    def kvs_cuda_open(self, uuid: CharPtr, handle_type: int, device: UInt64Ptr) -> int: ...
    def kvs_cuda_close(self, device: int) -> int: ...
    def kvs_cuda_granularity(self, device: int, handle_type: int, minimum: int, out: UInt64Ptr) -> int: ...
    def kvs_cuda_create(self, device: int, size: int, handle_type: int, allocation: UInt64Ptr) -> int: ...
    def kvs_cuda_export(self, allocation: int, handle_type: int, fd: Int32Ptr, handle: CharPtr) -> int: ...
    def kvs_cuda_import(self, device: int, handle_type: int, fd: int, handle: CharPtr, size: int,
                        allocation: UInt64Ptr) -> int: ...
    def kvs_cuda_release(self, allocation: int) -> int: ...
    def kvs_cuda_reserve(self, device: int, size: int, reservation: UInt64Ptr, addr: UInt64Ptr) -> int: ...
    def kvs_cuda_free_reservation(self, reservation: int) -> int: ...
    def kvs_cuda_map(self, reservation: int, offset: int, allocation: int, region: UInt64Ptr,
                     addr: UInt64Ptr) -> int: ...
    def kvs_cuda_set_access(self, region: int, access: int) -> int: ...
    def kvs_cuda_unmap(self, region: int) -> int: ...
    def kvs_cuda_buffer_alloc(self, device: int, size: int, addr: UInt64Ptr) -> int: ...
    def kvs_cuda_buffer_free(self, device: int, addr: int) -> int: ...
    def kvs_cuda_write(self, device: int, dst: int, src: CharPtr, len: int) -> int: ...
    def kvs_cuda_read(self, device: int, dst: CharPtr, src: int, len: int) -> int: ...
    def kvs_cuda_memcpy(self, device: int, dst: int, src: int, len: int) -> int: ...
    def kvs_cuda_submit(self, device: int, src: EndpointPtr, dst: EndpointPtr, blocks: BlockArray,
                        nblocks: int, flags: int, op: Int64Ptr) -> int: ...

    # lifecycle machines executed natively
    def kvs_machine_count(self) -> int: ...
    def kvs_machine_digest(self, machine: int) -> CharPtr: ...
    def kvs_machine_size(self, machine: int, kind: int) -> int: ...
    def kvs_machine_name(self, machine: int, kind: int, index: int) -> CharPtr: ...
    def kvs_machine_terminal(self, machine: int, state: int) -> int: ...
    def kvs_machine_may(self, machine: int, state: int, event: int) -> int: ...
    def kvs_machine_init(self, m: MachineInstPtr, machine: int) -> int: ...
    def kvs_machine_fire(self, m: MachineInstPtr, event: int, holds: int, fx: EffectFn, ctx: VoidPtr,
                         out: FireResultPtr) -> int: ...
    def kvs_machine_fire_planned(self, m: MachineInstPtr, event: int, holds: int, fail_effects: int,
                                 fail_undos: int, reenter_effects: int, log: Int32Ptr, logcap: int,
                                 nlog: Int32Ptr, out: FireResultPtr) -> int: ...

    # native attach (importer side)
    def kvs_attach(self, parts: AttachPartArray, n: int, align: int, access: int, failed: Int32Ptr) -> int: ...

    # request links and lease renewal (importer side)
    def kvs_link_open(self, fd: int, pidfd: int, max_payload: int, max_fds: int) -> LinkPtr: ...
    def kvs_link_open_stream(self, fd: int, max_payload: int) -> LinkPtr: ...
    def kvs_link_unref(self, l: LinkPtr) -> None: ...
    def kvs_link_close(self, l: LinkPtr) -> None: ...
    def kvs_link_closed(self, l: LinkPtr) -> int: ...
    def kvs_link_lock(self, l: LinkPtr) -> None: ...
    def kvs_link_unlock(self, l: LinkPtr) -> None: ...
    def kvs_link_send(self, l: LinkPtr, payload: bytes, len: int, fds: Int32Ptr, nfds: int,
                      timeout_ns: int, err: Int32Ptr) -> int: ...
    def kvs_link_recv(self, l: LinkPtr, f: FramePtr, timeout_ns: int) -> int: ...
    def kvs_link_request(self, l: LinkPtr, payload: bytes, len: int, f: FramePtr, timeout_ns: int) -> int: ...
    def kvs_renewer_start(self, interval_ns: int, timeout_ns: int) -> RenewerPtr: ...
    def kvs_renewer_stop(self, r: RenewerPtr) -> None: ...
    def kvs_renewer_fd(self, r: RenewerPtr) -> int: ...
    def kvs_renewer_add(self, r: RenewerPtr, l: LinkPtr, key: int, rank: int, lease: int, term_ns: int,
                        renewed_at_ns: int) -> int: ...
    def kvs_renewer_remove(self, r: RenewerPtr, key: int) -> int: ...
    def kvs_renewer_state(self, r: RenewerPtr, key: int, out: RenewStatePtr) -> int: ...
    def kvs_renewer_take(self, r: RenewerPtr, out: RenewOutcomePtr, max: int) -> int: ...
    def kvs_renewer_dropped(self, r: RenewerPtr) -> int: ...

    # the exporter's lease server
    # native import (importer side: phase 1 and the attach)
    def kvs_import(self, l: LinkPtr, req: bytes, len: int, f: FramePtr, timeout_ns: int, parts: ImportPartArray,
                   n: int, r: RenewerPtr, renewed_at_ns: int, align: int, access: int,
                   failed: Int32Ptr) -> int: ...

    def kvs_lease_server_new(self, lease_timeout_ns: int, max_leases: int, allowed_uid: int, max_payload: int,
                             max_fds: int, max_connections: int, out: LeaseServerOut) -> int: ...
    def kvs_lease_server_free(self, s: LeaseServerPtr) -> None: ...
    def kvs_lease_bank_add(self, s: LeaseServerPtr, rank: int, uncounted: int) -> int: ...
    def kvs_lease_bank_publish(self, s: LeaseServerPtr, rank: int, generation: int, incarnation: CharPtr,
                               descriptor_expires_ns: int, fd: int, region: int, report: CharPtr) -> int: ...
    def kvs_lease_bank_descriptor(self, s: LeaseServerPtr, rank: int, descriptor_expires_ns: int) -> int: ...
    def kvs_lease_bank_uncounted(self, s: LeaseServerPtr, rank: int, uncounted: int) -> int: ...
    def kvs_lease_bank_state(self, s: LeaseServerPtr, rank: int) -> int: ...
    def kvs_lease_fire(self, s: LeaseServerPtr, rank: int, event: int, py_holds: int, fx: EffectFn, ctx: VoidPtr,
                       out: FireResultPtr) -> int: ...
    def kvs_lease_leases(self, s: LeaseServerPtr, rank: int, out: LeaseInfoArray, cap: int) -> int: ...
    def kvs_lease_holds(self, s: LeaseServerPtr, rank: int, out: HoldInfoArray, cap: int) -> int: ...
    def kvs_lease_drop_exited_holds(self, s: LeaseServerPtr, rank: int) -> int: ...
    def kvs_lease_conn_open(self, s: LeaseServerPtr, pid: int, conn: UInt64Ptr) -> int: ...
    def kvs_lease_conn_close(self, s: LeaseServerPtr, conn: int, importer_closed: int) -> int: ...
    def kvs_lease_handle(self, s: LeaseServerPtr, conn: int, payload: CharPtr, len: int, reply: CharPtr, cap: int,
                         reply_len: UInt32Ptr, fds: Int32Ptr, fdcap: int, nfds: Int32Ptr, answer: Int32Ptr) -> int: ...
    def kvs_lease_expire(self, s: LeaseServerPtr, ahead_ns: int) -> int: ...
    def kvs_lease_serve(self, s: LeaseServerPtr, listen_fd: int) -> int: ...
    def kvs_lease_listen_tcp(self, s: LeaseServerPtr, listen_fd: int, key: bytes, keylen: int, person: bytes,
                             personlen: int, max_handshakes: int, handshake_ns: int, keepalive_idle_s: int,
                             keepalive_interval_s: int, keepalive_probes: int) -> int: ...
    def kvs_lease_handshakes(self, s: LeaseServerPtr) -> int: ...
    def kvs_blake2b(self, out: bytes, outlen: int, key: bytes, keylen: int, person: bytes, personlen: int,
                    data: bytes, datalen: int) -> int: ...
    def kvs_lease_stop(self, s: LeaseServerPtr) -> int: ...
    def kvs_lease_connections(self, s: LeaseServerPtr) -> int: ...
    def kvs_lease_lease_requests(self, s: LeaseServerPtr) -> int: ...
    def kvs_lease_events_fd(self, s: LeaseServerPtr) -> int: ...
    def kvs_lease_next_event(self, s: LeaseServerPtr, out: LeaseEventPtr) -> int: ...
    def kvs_lease_requests_fd(self, s: LeaseServerPtr) -> int: ...
    def kvs_lease_next_request(self, s: LeaseServerPtr, conn: UInt64Ptr, buf: CharPtr, cap: int,
                               len: UInt32Ptr) -> int: ...
    def kvs_lease_answer(self, s: LeaseServerPtr, conn: int, payload: CharPtr, len: int, fds: Int32Ptr,
                         nfds: int) -> int: ...
    def kvs_lease_inv_on(self, s: LeaseServerPtr) -> int: ...
    def kvs_lease_inv_epoch(self, s: LeaseServerPtr, group: CharPtr, glen: int, epoch: int) -> int: ...
    def kvs_lease_inv_add(self, s: LeaseServerPtr, group: CharPtr, glen: int, hashes: UInt64Ptr, n: int) -> int: ...
    def kvs_lease_inv_remove(self, s: LeaseServerPtr, group: CharPtr, glen: int, hashes: UInt64Ptr, n: int) -> int: ...
    def kvs_lease_inv_leases(self, s: LeaseServerPtr, group: CharPtr, glen: int, hash: int) -> int: ...

    # the decode index's lookups (ffi/kvs_index.h)
    def kvs_index_new(self, compat: CharPtr, compat_len: int, not_ready: CharPtr, not_ready_len: int, hash_bytes: int,
                      capacity: int, max_blocks: int, max_payload: int, allowed_uid: int, max_connections: int,
                      first_ns: int, idle_ns: int, out: IndexOut) -> int: ...
    def kvs_index_free(self, x: IndexPtr) -> None: ...
    def kvs_index_deadlines(self, x: IndexPtr, first_ns: int, idle_ns: int) -> int: ...
    def kvs_index_advertise(self, x: IndexPtr, hash: bytes, slot: int, key: int) -> int: ...
    def kvs_index_withdraw(self, x: IndexPtr, hash: bytes) -> int: ...
    def kvs_index_advertised(self, x: IndexPtr) -> int: ...
    def kvs_index_ready(self, x: IndexPtr, descriptor_set: CharPtr, len: int, epochs: UInt64Ptr, tp: int,
                        generation: int) -> int: ...
    def kvs_index_unready(self, x: IndexPtr) -> int: ...
    def kvs_index_answer(self, x: IndexPtr, req: CharPtr, len: int, out: CharPtr, cap: int, outlen: UInt32Ptr) -> int: ...
    def kvs_index_touched(self, x: IndexPtr, slots: UInt32Ptr, cap: int) -> int: ...
    def kvs_index_lookups(self, x: IndexPtr) -> int: ...
    def kvs_index_serve(self, x: IndexPtr, listen_fd: int) -> int: ...
    def kvs_index_stop(self, x: IndexPtr) -> int: ...
    def kvs_index_connections(self, x: IndexPtr) -> int: ...
    def kvs_index_handoff_fd(self, x: IndexPtr) -> int: ...
    def kvs_index_next_handoff(self, x: IndexPtr, fd: Int32Ptr, buf: CharPtr, cap: int, len: UInt32Ptr) -> int: ...

    # the generated op table
    def kvs_op_nstates(self) -> int: ...
    def kvs_op_table_digest(self) -> CharPtr: ...
    def kvs_op_nevents(self) -> int: ...
    def kvs_op_state_name(self, state: int) -> CharPtr: ...
    def kvs_op_event_name(self, event: int) -> CharPtr: ...
    def kvs_op_collectable(self, state: int) -> int: ...
    def kvs_planted_bug(self) -> int: ...

    # the descriptor rules (ffi/kvs_validate.h)
    def kvs_validate_descriptor(self, d: VFactsArray, e: VExpectArray, rule_reasons: bytes) -> int: ...
    def kvs_validate_batch(self, n: int, d: VFactsArray, e: VExpectArray, first: UInt32Ptr,
                           rule_reasons: bytes) -> None: ...
    def kvs_validate_digest(self) -> int: ...
    def kvs_strerror(self, code: int) -> CharPtr: ...


class Ffi(Protocol):
    """The part of cffi's ``FFI`` kvstate uses, one overload per C declaration it passes."""

    errno: int
    NULL: object

    @overload
    def new(self, cdecl: Literal["uint64_t *"]) -> UInt64Ptr: ...
    @overload
    def new(self, cdecl: Literal["int32_t *"]) -> Int32Ptr: ...
    @overload
    def new(self, cdecl: Literal["int64_t *"]) -> Int64Ptr: ...
    @overload
    def new(self, cdecl: Literal["kvs_region_info *"]) -> RegionInfoPtr: ...
    @overload
    def new(self, cdecl: Literal["kvs_global_info *"]) -> GlobalInfoPtr: ...
    @overload
    def new(self, cdecl: Literal["kvs_op_info *"]) -> OpInfoPtr: ...
    @overload
    def new(self, cdecl: Literal["kvs_endpoint *"], init: tuple[int, int, int]) -> EndpointPtr: ...
    @overload
    def new(self, cdecl: Literal["kvs_block[]"], init: Sequence[tuple[int, int, int]]) -> BlockArray: ...
    @overload
    def new(self, cdecl: Literal["kvs_cuda_driver_info *"]) -> CudaDriverInfoPtr: ...
    @overload
    def new(self, cdecl: Literal["kvs_cuda_device_info *"]) -> CudaDeviceInfoPtr: ...
    @overload
    def new(self, cdecl: Literal["char[]"], init: int | bytes) -> CharPtr: ...
    @overload
    def new(self, cdecl: Literal["int32_t[]"], init: int) -> Int32Ptr: ...
    @overload
    def new(self, cdecl: Literal["int64_t[]"], init: Sequence[int]) -> Int64Ptr: ...
    @overload
    def new(self, cdecl: Literal["kvs_machine_inst *"]) -> MachineInstPtr: ...
    @overload
    def new(self, cdecl: Literal["kvs_fire_result *"]) -> FireResultPtr: ...
    @overload
    def new(self, cdecl: Literal["kvs_attach_part[]"], init: int) -> AttachPartArray: ...
    @overload
    def new(self, cdecl: Literal["kvs_import_part[]"], init: int) -> ImportPartArray: ...
    @overload
    def new(self, cdecl: Literal["kvs_frame *"]) -> FramePtr: ...
    @overload
    def new(self, cdecl: Literal["uint8_t[]"], init: int) -> CharPtr: ...
    @overload
    def new(self, cdecl: Literal["kvs_renew_state *"]) -> RenewStatePtr: ...
    @overload
    def new(self, cdecl: Literal["kvs_renew_outcome[]"], init: int) -> RenewOutcomePtr: ...

    # cffi takes any object here and raises TypeError (or BufferError) for one without the
    # buffer protocol, so the parameter is honestly ``object``; callers catch those.
    @overload
    def from_buffer(self, python_buffer: object, require_writable: bool = ...) -> CBuffer: ...
    @overload
    def from_buffer(self, cdecl: Literal["kvs_block[]"], python_buffer: object,
                    require_writable: bool = ...) -> BlockArray: ...
    @overload
    def from_buffer(self, cdecl: Literal["char[]"], python_buffer: object,
                    require_writable: bool = ...) -> CharPtr: ...

    @overload
    def cast(self, cdecl: Literal["uintptr_t"], value: CBuffer) -> SupportsInt: ...
    @overload
    def cast(self, cdecl: Literal["char *"], value: int) -> CharPtr: ...

    def buffer(self, cdata: CharPtr, size: int) -> Buffer: ...

    def release(self, cdata: CBuffer | BlockArray) -> None: ...

    def string(self, cdata: CharPtr) -> bytes: ...

    def gc(self, cdata: LinkPtr, destructor: Callable[[LinkPtr], None]) -> LinkPtr: ...


MODULE = "kvstate._native"


def load() -> tuple[Ffi, Lib]:
    """Import the compiled module; ModuleNotFoundError (from importlib) when it was not built.

    The module has no type information, so its two objects are taken as the Protocols
    above here, at the boundary, and nowhere else."""
    module = importlib.import_module(MODULE)
    ffi: Ffi = module.ffi
    lib: Lib = module.lib
    return ffi, lib
