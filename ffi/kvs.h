/* kvstate native layer: host memory with CUDA-VMM semantics, a pin table, an op engine.
 *
 * Theory of operation
 * -------------------
 * Four kinds of object live in process-global tables behind one mutex, each named by a
 * 64-bit id (never 0, never reused while the process lives):
 *
 *   allocation   a sealed memfd (created here, or imported from a received fd after its
 *                size, seals and memfd-ness were checked). Like a CUmemGenericAllocationHandle.
 *   reservation  PROT_NONE anonymous address space, aligned. Like cuMemAddressReserve.
 *   region       one allocation mapped MAP_SHARED|MAP_FIXED inside a reservation, with no
 *                access until kvs_set_access() (mprotect). Like cuMemMap + cuMemSetAccess:
 *                touching a region before access is granted faults.
 *   op           a copy or gather between regions and caller buffers, run by a pthread
 *                pool. Its lifecycle is the table generated from spec/op.toml
 *                (kvs_op_table.h); every state change goes through kvs_op_step().
 *
 * Ownership: a submitted op takes one pin on every region it touches and drops it when it
 * leaves queued/running (spec effects pin_regions/unpin_regions). Unmap, release and any
 * lowering of access refuse with KVS_E_PINNED while pins are held, so no memory is freed
 * or revoked under an in-flight copy. Release refuses while the allocation is mapped.
 * Holders other than ops (leases) may take explicit pins with kvs_region_pin().
 *
 * CUDA. The same tables hold CUDA device memory (kvs_cuda_*): VMM allocations exported
 * as POSIX fds (or FABRIC handles) and legacy cuMemAlloc memory exported as IPC handles,
 * reserved, mapped and given access with the host backend's semantics; their regions are
 * pinned by CUDA ops, which are ops of the same engine stepped through the same generated
 * table: submit pins, the copies go on a stream of their own with an event behind them,
 * and finish or fail (which unpin) fire only once that event reports completion, so unmap
 * and release refuse until the device is done. libcuda is never linked: kvs_cuda_load()
 * opens the library it is given at run time, and every kvs_cuda_* call refuses with
 * KVS_E_NODRIVER until it did.
 *
 * Files: kvs_slots.c holds the slot tables, the lock, regions and their pins (shared);
 * kvs_host.c the memory objects (allocations, reservations, mapping and unmapping);
 * kvs_ops.c the op engine. The last two build on kvs_slots.h and on nothing of each
 * other. kvs_cuda_load.c loads the driver (kvs_cuda_driver.h declares the calls it
 * uses), kvs_cuda_mem.c keeps the device memory objects and kvs_cuda_ops.c runs CUDA ops
 * on the engine's face for other backends (kvs_engine.h). Python declares this header
 * to cffi by deriving from it (ffi/build_host.py).
 *
 * Every function returns KVS_OK (0) or a negative KVS_E_* code; on KVS_E_SYS, errno is
 * left set by the failing system call. Every wait takes a timeout. Types across the
 * boundary are exact: uint64_t addresses, sizes and ids, int64_t op ids and nanoseconds.
 */
#ifndef KVS_H
#define KVS_H

#include <stdint.h>

#include "kvs_op_table.h"

/* Error codes. Python maps each one to a typed error in kvstate.core.errors. */
#define KVS_OK 0
#define KVS_E_INVAL (-1)      /* malformed argument (alignment, zero size, bad flag) */
#define KVS_E_SYS (-2)        /* a system call failed; errno says which way */
#define KVS_E_NOENT (-3)      /* no object with that id */
#define KVS_E_PINNED (-4)     /* the region (or a region of the allocation) holds pins */
#define KVS_E_MAPPED (-5)     /* the allocation or reservation still has mappings */
#define KVS_E_ACCESS (-6)     /* guard regions_mapped refused: no access for this use */
#define KVS_E_RANGE (-7)      /* an offset or length falls outside its region or buffer */
#define KVS_E_OVERLAP (-8)    /* the mapping would overlap another in the reservation */
#define KVS_E_SIZE (-9)       /* a received fd has the wrong size */
#define KVS_E_SEALS (-10)     /* a received fd lacks the required seals */
#define KVS_E_NOTMEMFD (-11)  /* a received fd is not a memfd */
#define KVS_E_ILLEGAL (-12)   /* the op table declares no such (state, event) pair */
#define KVS_E_TIMEOUT (-13)   /* the wait ended before the op finished */
#define KVS_E_BUSY (-14)      /* the engine has live ops (reconfigure) */
#define KVS_E_NOMEM (-15)     /* allocation of bookkeeping memory failed */
#define KVS_E_INJECTED (-16)  /* the op failed because KVS_OPF_FAIL asked it to */
#define KVS_E_NODRIVER (-17)  /* no CUDA driver library, or one without a call kvstate needs */
#define KVS_E_CUDA (-18)      /* a driver call failed: kvs_cuda_last_call/_result say which */
#define KVS_E_OWNIPC (-19)    /* a legacy IPC handle this process exported itself */
#define KVS_E_GUARD (-20)     /* a machine's event is declared, but no row's guards admit it */
#define KVS_E_EFFECT (-21)    /* an effect of the row failed; earlier ones were undone */
#define KVS_E_REENTRANT (-22) /* an effect fired an event on its own machine */
#define KVS_E_OWNED (-24)     /* the region has an owner (kvs_region_own): only it may unmap it or change its access */

/* Access rights, ordered: each includes the previous. */
#define KVS_ACCESS_NONE 0
#define KVS_ACCESS_READ 1
#define KVS_ACCESS_READ_WRITE 2

/* Op flags. */
#define KVS_OPF_FAIL 1u   /* fault injection: the worker fails the op instead of copying */

/* One block of a gather: copy len bytes from src+src_off to dst+dst_off. */
typedef struct kvs_block {
    uint64_t src_off;
    uint64_t dst_off;
    uint64_t len;
} kvs_block;

/* One end of a copy: a region (region != 0; addr and size are ignored) or a caller
 * buffer (region == 0) that the caller keeps alive until the op is collectable. */
typedef struct kvs_endpoint {
    uint64_t region;
    uint64_t addr;
    uint64_t size;
} kvs_endpoint;

typedef struct kvs_region_info {
    uint64_t addr;
    uint64_t size;
    uint64_t allocation;
    uint64_t reservation;
    int32_t access;
    uint64_t pins;        /* all pins: ops in flight plus explicit (lease) pins */
    uint64_t explicit_pins;
    uint64_t inflight;    /* ops queued or running that touch the region */
    uint64_t completed;   /* ops that finished touching the region */
    uint64_t failed;      /* ops that failed touching the region */
    uint64_t bytes;       /* bytes moved by completed ops touching the region */
} kvs_region_info;

typedef struct kvs_global_info {
    uint64_t allocations;
    uint64_t reservations;
    uint64_t regions;
    uint64_t pins;        /* sum of pins over every region */
    uint64_t ops_live;    /* ops not yet reaped */
    uint64_t ops_queued;
    uint64_t ops_running;
    uint64_t submitted;
    uint64_t completed;
    uint64_t failed;
    uint64_t cancelled;
    uint64_t bytes;
    uint64_t workers;
    int32_t paused;
} kvs_global_info;

typedef struct kvs_op_info {
    int32_t state;        /* enum kvs_op_state */
    int32_t error;        /* KVS_OK or the reason the op failed */
    int32_t result;       /* with KVS_E_CUDA: the CUresult the device reported */
    uint64_t bytes;       /* bytes the op moves */
    uint64_t nblocks;
} kvs_op_info;

/* -- host backend ------------------------------------------------------------------- */

uint64_t kvs_page_size(void);
int kvs_create(uint64_t size, uint64_t *allocation);
int kvs_export_fd(uint64_t allocation, int32_t *fd);        /* borrowed: do not close */
int kvs_import_fd(int32_t fd, uint64_t size, uint64_t *allocation); /* dups fd */
int kvs_release(uint64_t allocation);
int kvs_reserve(uint64_t size, uint64_t align, uint64_t *reservation, uint64_t *addr);
int kvs_free_reservation(uint64_t reservation);
int kvs_map(uint64_t reservation, uint64_t offset, uint64_t allocation, uint64_t *region,
            uint64_t *addr);
int kvs_set_access(uint64_t region, int32_t access);
int kvs_unmap(uint64_t region);

/* -- pins and observation ----------------------------------------------------------- */

int kvs_region_pin(uint64_t region);
int kvs_region_unpin(uint64_t region);
/* An owner (a part or a bank: a nonzero token of its own) claims its mapping: from then on
 * unmap and set_access refuse (KVS_E_OWNED) until the owner disowns it, so nobody else
 * ends or changes an idle mapping that the owner still counts on. KVS_E_OWNED: another
 * owner holds it. Disowning a region nobody owns is a no-op. */
int kvs_region_own(uint64_t region, uint64_t owner);
int kvs_region_disown(uint64_t region, uint64_t owner);
int kvs_region_info_get(uint64_t region, kvs_region_info *out);
void kvs_global_info_get(kvs_global_info *out);

/* -- op engine ---------------------------------------------------------------------- */

int kvs_engine_configure(uint32_t workers); /* refuses with KVS_E_BUSY while ops are live */
int kvs_engine_pause(int32_t paused);       /* paused workers take no new op; clears the allowance */
/* While paused, workers may start the next `ops` queued ops (queue order) and finish them;
 * the rest stay queued. Deterministic holds for tests (an op provably not started).
 * KVS_E_INVAL when not paused. */
int kvs_engine_allow(uint32_t ops);
int kvs_submit(const kvs_endpoint *src, const kvs_endpoint *dst, const kvs_block *blocks,
               uint64_t nblocks, uint32_t flags, int64_t *op);
/* One contiguous copy, without building endpoint structs (the cheap path). */
int kvs_submit_copy(uint64_t src_region, uint64_t src_addr, uint64_t src_size, uint64_t src_off,
                    uint64_t dst_region, uint64_t dst_addr, uint64_t dst_size, uint64_t dst_off,
                    uint64_t len, uint32_t flags, int64_t *op);
int kvs_cancel(int64_t op);
/* Write 8 bytes (the value 1) to fd, an eventfd the caller keeps open until it reaped the
 * op, once the op becomes collectable (done, failed or cancelled); at once if it already
 * is. One fd per op; KVS_E_INVAL if it already has one or fd <= 0. */
int kvs_op_notify(int64_t op, int32_t fd);
/* A completion report: once every op of ops[0..nops) is collectable, the engine sends one
 * message on the socket sock (a SOCK_SEQPACKET or datagram socket; the engine keeps its own
 * dup, so the caller may close its fd at any time): the bytes ok[0..ok_len) when every op
 * is done, failed[0..failed_len) when any failed or was cancelled. It is sent from the
 * thread that made the last op collectable (a worker of the pool, a backend's thread),
 * without waiting for the caller, non-blocking: a full socket leaves it unsent. An op
 * may be in one report; KVS_E_NOENT if an op is unknown (reaped), KVS_E_INVAL if one is
 * already in a report, nops is 0 or over KVS_REPORT_MAX_OPS, or a message is empty or
 * over KVS_REPORT_MAX_BYTES. *report: its id for kvs_report_close.
 * A store's report also ends its block epochs (kvstate.share.epochs): epochs is the bank's
 * epoch page, and once the last op is collectable, before any message goes out, each
 * epochs[blocks[i]] that still holds odd[i] becomes odd[i] + 1 (compare-and-swap, release),
 * so nobody hears of the store while its blocks still read as being written. With sock -1
 * there is no message (then nblocks > 0). A closed report moves no epoch. */
#define KVS_REPORT_MAX_OPS 4096
#define KVS_REPORT_MAX_BYTES 65536
#define KVS_REPORT_MAX_BLOCKS (1 << 20)
#define KVS_REPORT_PENDING 0      /* an op is not collectable yet */
#define KVS_REPORT_SENT_OK 1      /* every op done: ok went out */
#define KVS_REPORT_SENT_FAILED 2  /* an op failed or was cancelled: failed went out */
#define KVS_REPORT_UNSENT 3       /* the send failed (full socket, peer gone): nothing went out */
#define KVS_REPORT_QUIET 4        /* every op collectable; epochs only, no message */
int kvs_report_open(int32_t sock, const char *ok, uint64_t ok_len, const char *failed,
                    uint64_t failed_len, const int64_t *ops, uint32_t nops, uint64_t *epochs,
                    const int64_t *blocks, const uint64_t *odd, uint32_t nblocks, int64_t *report);
/* Forget a report; *status (may be NULL): KVS_REPORT_*. Closed while pending, it is never
 * sent. KVS_E_NOENT for an unknown or closed report. */
int kvs_report_close(int64_t report, int32_t *status);
int kvs_op_info_get(int64_t op, kvs_op_info *out);
int kvs_wait(int64_t op, int64_t timeout_ns); /* 0 polls; KVS_E_TIMEOUT if not finished */
int kvs_reap(int64_t op, kvs_op_info *out); /* out: the state it ended in */

/* -- cuda backend ------------------------------------------------------------------- */

/* Handle types of an allocation, as the driver numbers the VMM ones. */
#define KVS_CUDA_LEGACY_IPC 0u  /* cuMemAlloc memory, shared by cuIpcGetMemHandle */
#define KVS_CUDA_POSIX_FD 1u    /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
#define KVS_CUDA_FABRIC 8u      /* CU_MEM_HANDLE_TYPE_FABRIC */
#define KVS_CUDA_HANDLE_BYTES 64

typedef struct kvs_cuda_driver_info {
    int32_t version;      /* cuDriverGetVersion */
    int32_t devices;      /* cuDeviceGetCount */
    int32_t batch;        /* the driver has cuMemcpyBatchAsync (CUDA 12.8) */
} kvs_cuda_driver_info;

typedef struct kvs_cuda_device_info {
    char uuid[16];
    char name[96];
    int32_t vmm;          /* virtual memory management supported */
    int32_t posix_fd;     /* POSIX fd handles supported */
    int32_t fabric;       /* FABRIC handles reported supported (a trial decides) */
    int64_t max_pitch;
} kvs_cuda_device_info;

/* Open the driver library at `path` (dlopen; "libcuda.so.1" normally), resolve every call
 * kvs_cuda_driver.h lists and cuInit(0). Once per process: again with the same path is
 * KVS_OK, with another KVS_E_BUSY. KVS_E_NODRIVER: no such library or a call is missing
 * (kvs_cuda_load_error() says which); KVS_E_CUDA: cuInit failed (no device, ...). */
int kvs_cuda_load(const char *path);
const char *kvs_cuda_load_error(void);
/* After KVS_E_CUDA on this thread: the driver call that failed and its CUresult. */
const char *kvs_cuda_last_call(void);
int32_t kvs_cuda_last_result(void);
const char *kvs_cuda_result_name(int32_t result); /* cuGetErrorName, or NULL */
const char *kvs_cuda_call_name(int32_t index);    /* the driver calls used, NULL past the end */
int kvs_cuda_driver_info_get(kvs_cuda_driver_info *out);
int kvs_cuda_device_info_get(int32_t ordinal, kvs_cuda_device_info *out);

/* A device, found by its 16 UUID bytes, whose allocations are of `handle_type`: its
 * primary context is retained until kvs_cuda_close (refused with KVS_E_BUSY while it has
 * memory objects or ops in flight). KVS_E_NOENT: no visible device has that UUID. */
int kvs_cuda_open(const char *uuid, uint32_t handle_type, uint64_t *device);
int kvs_cuda_close(uint64_t device);
int kvs_cuda_granularity(uint64_t device, uint32_t handle_type, int32_t minimum, uint64_t *out);
int kvs_cuda_create(uint64_t device, uint64_t size, uint32_t handle_type, uint64_t *allocation);
/* POSIX_FD: *fd (owned by the allocation, closed at release: do not close it); FABRIC and
 * LEGACY_IPC: KVS_CUDA_HANDLE_BYTES bytes at `handle`. */
int kvs_cuda_export(uint64_t allocation, uint32_t handle_type, int32_t *fd, char *handle);
/* POSIX_FD: `fd` (the caller keeps and closes it); otherwise the handle bytes. A legacy
 * IPC handle this process exported is refused (KVS_E_OWNIPC) before the driver is asked. */
int kvs_cuda_import(uint64_t device, uint32_t handle_type, int32_t fd, const char *handle,
                    uint64_t size, uint64_t *allocation);
int kvs_cuda_release(uint64_t allocation); /* KVS_E_PINNED, KVS_E_MAPPED as kvs_release */
/* Address space aligned to the granularity; for a legacy IPC device a placeholder (legacy
 * memory is mapped where it was allocated or opened). */
int kvs_cuda_reserve(uint64_t device, uint64_t size, uint64_t *reservation, uint64_t *addr);
int kvs_cuda_free_reservation(uint64_t reservation);
int kvs_cuda_map(uint64_t reservation, uint64_t offset, uint64_t allocation, uint64_t *region,
                 uint64_t *addr);
int kvs_cuda_set_access(uint64_t region, int32_t access);
int kvs_cuda_unmap(uint64_t region);
/* Device memory the caller owns (cuMemAlloc), for op endpoints; not pinned by ops. */
int kvs_cuda_buffer_alloc(uint64_t device, uint64_t size, uint64_t *addr);
int kvs_cuda_buffer_free(uint64_t device, uint64_t addr);
/* Synchronous copies outside the op engine: host to device, device to host, and device to
 * device on the device's own stream (the plain cudaMemcpy that ops are measured against). */
int kvs_cuda_write(uint64_t device, uint64_t dst, const char *src, uint64_t len);
int kvs_cuda_read(uint64_t device, char *dst, uint64_t src, uint64_t len);
int kvs_cuda_memcpy(uint64_t device, uint64_t dst, uint64_t src, uint64_t len);
/* A gather on the device: each end a region of this device or device memory by address.
 * The op is reaped with kvs_wait/kvs_reap like a host op; it cannot be cancelled once
 * submitted (it is running as soon as its copies are on the stream). */
int kvs_cuda_submit(uint64_t device, const kvs_endpoint *src, const kvs_endpoint *dst,
                    const kvs_block *blocks, uint64_t nblocks, uint32_t flags, int64_t *op);

/* -- lifecycle machines executed natively (kvs_machine.c) --------------------------- */

/* The tables of spec/ generated into kvs_<name>_table.h (bank, part), by id. One
 * executor runs them all with kvstate.core.machine.Lifecycle's rules: the event must be
 * declared in the state (else KVS_E_ILLEGAL); the pair's rows are tried in table order
 * and the first whose guards all hold and whose `unless` guards all do not fires (else
 * KVS_E_GUARD, out->refused naming every refusing guard as Python names them); its
 * effects run in row order through `fx`, and when one fails (returns non-zero) the earlier
 * ones are undone in reverse and KVS_E_EFFECT says which; the state is committed last. A
 * refusal changes nothing. No lock but the instance's own is taken, and no Python. */
#define KVS_MACHINE_BANK 0
#define KVS_MACHINE_PART 1

/* What kvs_machine_name() names. */
#define KVS_MNAME_MACHINE 0
#define KVS_MNAME_STATE 1
#define KVS_MNAME_EVENT 2
#define KVS_MNAME_GUARD 3
#define KVS_MNAME_EFFECT 4

/* One instance of a machine: its state, and the thread firing on it (0: none). A fire
 * from another thread waits for the one in progress; one from the firing thread (an
 * effect firing on its own machine) is refused with KVS_E_REENTRANT. */
typedef struct kvs_machine_inst {
    int32_t machine;
    int32_t state;
    uint32_t owner;
    uint32_t reserved;
} kvs_machine_inst;

/* An effect (undo == 0) or the undo of one that succeeded (undo == 1). An effect returns 0
 * or its own non-zero error; what an undo returns is counted, never acted on. */
typedef int32_t (*kvs_effect_fn)(void *ctx, int32_t effect, int32_t undo);

typedef struct kvs_fire_result {
    int32_t source;       /* the state the event found */
    int32_t dest;         /* the state after the call (== source unless KVS_OK) */
    int32_t row;          /* the table row that fired or whose effect failed, else -1 */
    int32_t effect;       /* with KVS_E_EFFECT: the effect id that failed, else -1 */
    int32_t error;        /* with KVS_E_EFFECT: what that effect returned */
    int32_t undone;       /* undos run after a failed effect */
    int32_t undo_failed;  /* of those, how many returned non-zero */
    int32_t nrefused;     /* with KVS_E_GUARD: entries of refused */
    int32_t refused[16];  /* guard id g: g did not hold; -1 - g: `unless` guard g held */
} kvs_fire_result;

int32_t kvs_machine_count(void);
const char *kvs_machine_digest(int32_t machine);   /* NULL for an unknown machine */
int32_t kvs_machine_size(int32_t machine, int32_t kind); /* how many of KVS_MNAME_*; -1 */
const char *kvs_machine_name(int32_t machine, int32_t kind, int32_t index); /* NULL past the end */
int32_t kvs_machine_terminal(int32_t machine, int32_t state); /* 1, 0, or -1 (no such state) */
int32_t kvs_machine_may(int32_t machine, int32_t state, int32_t event); /* declared: 1, 0, -1 */
int kvs_machine_init(kvs_machine_inst *m, int32_t machine); /* the initial state */
/* Fire `event`; `holds` has bit g set when guard g holds. `fx` may be NULL only when the
 * row that fires has no effects (else KVS_E_INVAL, nothing changed). `out` may be NULL. */
int kvs_machine_fire(kvs_machine_inst *m, int32_t event, uint64_t holds, kvs_effect_fn fx, void *ctx,
                     kvs_fire_result *out);
/* kvs_machine_fire with a planned effect callback, for callers without one of their own
 * (Python: the differential test, replays): effect g fails with KVS_E_INJECTED when bit g
 * of fail_effects is set, and its undo when bit g of fail_undos is; an effect whose bit is
 * set in reenter_effects fires the same event on the same instance (once per call) and
 * fails with what that returns (KVS_E_REENTRANT). Each call is logged, an effect as its id and an undo as
 * -1 - id, into log (logcap >= 16 entries; *nlog set). */
int kvs_machine_fire_planned(kvs_machine_inst *m, int32_t event, uint64_t holds, uint64_t fail_effects,
                             uint64_t fail_undos, uint64_t reenter_effects, int32_t *log, int32_t logcap,
                             int32_t *nlog, kvs_fire_result *out);

/* -- native attach, importer side (kvs_attach.c) ----------------------------------- */

/* Phase 2 of a group import on the host backend, one call per exporter batch: every part
 * fires the part table's `open` row (kvs_machine_fire, the generated kvs_part_table.h),
 * whose native_import effect checks the received fd (identity, then memfd, size and seals),
 * adopts a duplicate, reserves, maps and sets access. When any part fails, every part of
 * the batch already opened fires `close` (its unmap_close effect undoes the native half),
 * so the batch leaves nothing behind; leases stay with the caller. Python's Part machine
 * is fed the outcome afterwards. The GIL is not held (a plain cffi call). */
#define KVS_ATTACH_ROW 0      /* the part table refused `open` (illegal, or a guard) */
#define KVS_ATTACH_IDENTITY 1 /* fstat of the fd, its (dev, ino) against the descriptor's */
#define KVS_ATTACH_IMPORT 2   /* memfd, exact size, seals; its duplicate (kvs_import_fd) */
#define KVS_ATTACH_RESERVE 3  /* address space (kvs_reserve) */
#define KVS_ATTACH_MAP 4      /* MAP_FIXED inside it (kvs_map) */
#define KVS_ATTACH_ACCESS 5   /* mprotect (kvs_set_access) */
#define KVS_E_IDENTITY (-23)  /* a received fd is not the file its descriptor names */
#define KVS_ATTACH_MAX_PARTS 1024 /* the most parts of one call (kvstate.core.validate.MAX_TP) */

typedef struct kvs_attach_part {
    int32_t fd;           /* in: the received memfd (borrowed: the caller closes it) */
    int32_t state;        /* in: the part's state id in the part table; out: its state after */
    uint64_t holds;       /* in: the part table's guard bits the caller evaluated */
    uint64_t dev, ino;    /* in: the identity the descriptor's handle bytes name */
    uint64_t size;        /* in: the descriptor's size */
    uint64_t allocation, reservation, region, addr; /* out: what was made (0: nothing) */
    int32_t step;         /* out, for the part that failed: KVS_ATTACH_* that failed, else -1 */
    int32_t code;         /* out: that step's KVS_E_* code (KVS_OK when it did not fail) */
    int32_t err;          /* out: errno with KVS_E_SYS */
    int32_t nrefused;     /* out, with KVS_ATTACH_ROW and KVS_E_GUARD: refusing guard ids */
    int32_t refused[16];
    int32_t left;         /* out: 1 when rolling this part back left objects (ids above) */
} kvs_attach_part;

/* Attach parts[0..n) with `access` (KVS_ACCESS_*), reservations aligned to `align`.
 * KVS_OK: every part is in `imported` with its objects. Otherwise the failing part's code,
 * *failed its index, and every part back in its state with nothing made (unless `left`). */
int kvs_attach(kvs_attach_part *parts, int32_t n, uint64_t align, int32_t access, int32_t *failed);

/* -- the exporter's lease server (kvs_lease.c, kvs_lease_thread.c, kvs_lease_tcp.c) -- */

/* One per exporter: every bank's instance of the bank table (its state has no other
 * home), the lease table, and a thread serving importers on the exporter's listening
 * SOCK_SEQPACKET socket without the GIL (epoll: the socket, each connection and its
 * peer's pidfd, a timerfd at the next lease expiry, an eventfd for commands). Lease
 * events fire through kvs_machine_fire with C effects; Python fires the bank's other
 * events through kvs_lease_fire with its own effects, serialised with the thread by the
 * server's lock. Each committed transition is queued for Python (kvs_lease_next_event);
 * the one request not served natively (status) is queued for Python too
 * (kvs_lease_next_request), which answers with kvs_lease_answer. */
typedef struct kvs_lease_server kvs_lease_server;

#define KVS_LEASE_PYTHON 1    /* kvs_lease_handle: a request Python serves */
#define KVS_LEASE_MAX_RANKS 256

/* Why a lease event fired (kvs_lease_event.why). */
#define KVS_LWHY_NONE 0
#define KVS_LWHY_CLOSED 1     /* the importer's connection closed */
#define KVS_LWHY_EXITED 2     /* the importer's process exited */
#define KVS_LWHY_STOPPED 3    /* this side closed the connection (stop, failed send) */
#define KVS_LWHY_EXPIRED 4    /* not renewed within the lease timeout */

typedef struct kvs_lease_event {
    int32_t rank, event, source, dest;
    int64_t lease;            /* the lease the event named, else 0 */
    int64_t t_ns;             /* CLOCK_MONOTONIC */
    int32_t why;              /* KVS_LWHY_* */
    int32_t dropped;          /* events lost before this one (the queue was full) */
} kvs_lease_event;

typedef struct kvs_lease_info {
    int64_t id;
    uint64_t conn;
    int64_t expires_in_ns;    /* negative once past */
    int32_t expired;
    int32_t pid;              /* the importer's pid at connect time */
    uint32_t nblocks;         /* inventory blocks it pins */
} kvs_lease_info;

typedef struct kvs_hold_info {
    int64_t id;
    uint64_t conn;
    int32_t conn_open;        /* 0: the connection is gone (this side closed it) */
    int32_t has_pidfd;
} kvs_hold_info;

int kvs_lease_server_new(int64_t lease_timeout_ns, int32_t max_leases, uint32_t allowed_uid, int32_t max_payload,
                         int32_t max_fds, int32_t max_connections, kvs_lease_server **out);
void kvs_lease_server_free(kvs_lease_server *s); /* after kvs_lease_stop; holds are unpinned */
/* A bank for `rank`: `uncounted` keeps a hold (a pin on `region`) per lease. */
int kvs_lease_bank_add(kvs_lease_server *s, int32_t rank, int32_t uncounted);
/* At advertise: what a lease answer needs (the fd stays the caller's). */
int kvs_lease_bank_publish(kvs_lease_server *s, int32_t rank, int64_t generation, const char *incarnation,
                           int64_t descriptor_expires_ns, int32_t fd, uint64_t region, const char *report);
/* The bank's epoch page (kvstate.share.epochs), sent on `block_epochs` to a connection holding a
 * lease on it (the fd stays the caller's); -1: none. */
int kvs_lease_bank_epochs(kvs_lease_server *s, int32_t rank, int32_t fd, int64_t num_blocks);
int kvs_lease_bank_descriptor(kvs_lease_server *s, int32_t rank, int64_t descriptor_expires_ns); /* 0: withdrawn */
int kvs_lease_bank_uncounted(kvs_lease_server *s, int32_t rank, int32_t uncounted); /* holds from the next grant */
int32_t kvs_lease_bank_state(kvs_lease_server *s, int32_t rank); /* a state id, or KVS_E_NOENT */
/* Fire one of the bank's non-lease events (Python's); `py_holds`: the guard bits only
 * Python knows (native_quiescent's stores and pins); lease effects are refused. */
int kvs_lease_fire(kvs_lease_server *s, int32_t rank, int32_t event, uint64_t py_holds, kvs_effect_fn fx, void *ctx,
                   kvs_fire_result *out);
int32_t kvs_lease_leases(kvs_lease_server *s, int32_t rank, kvs_lease_info *out, int32_t cap);
int32_t kvs_lease_holds(kvs_lease_server *s, int32_t rank, kvs_hold_info *out, int32_t cap);
int32_t kvs_lease_drop_exited_holds(kvs_lease_server *s, int32_t rank); /* how many went */
/* A connection Python serves itself (TCP): its requests go through kvs_lease_handle. */
int kvs_lease_conn_open(kvs_lease_server *s, int32_t pid, uint64_t *conn);
int kvs_lease_conn_close(kvs_lease_server *s, uint64_t conn, int32_t importer_closed);
/* Serve one request of `conn`: KVS_OK with *answer 1 when `reply` (and `fds`) go back,
 * KVS_LEASE_PYTHON when Python serves it, else an error. */
int kvs_lease_handle(kvs_lease_server *s, uint64_t conn, const char *payload, uint32_t len, char *reply,
                     uint32_t cap, uint32_t *reply_len, int32_t *fds, int32_t fdcap, int32_t *nfds,
                     int32_t *answer);
/* One expiry round: the leases whose expiry is `ahead_ns` from now or earlier run out
 * (the thread passes 0; a test looks ahead). How many expired. */
int32_t kvs_lease_expire(kvs_lease_server *s, int64_t ahead_ns);
int kvs_lease_serve(kvs_lease_server *s, int32_t listen_fd); /* start the thread */
/* Serve importers on another node too (call before kvs_lease_serve; kvs_lease_tcp.c): the
 * thread accepts on the listening TCP socket (bound and kept by Python), answers each
 * peer's mutual challenge with the deployment `key` itself (the handshake of
 * kvstate.channel.tcp, MAC kvs_blake2b personalised `person`), at most max_handshakes
 * at once (past that the oldest goes), each within handshake_ns, then serves its frames
 * (a stream: reassembled here, answered without fds) exactly as a unix socket's. Its
 * leases end at EOF, reset or keepalive timeout (keepalive_s: idle, interval, probes). */
int kvs_lease_listen_tcp(kvs_lease_server *s, int32_t listen_fd, const uint8_t *key, uint32_t keylen,
                         const uint8_t *person, uint32_t personlen, int32_t max_handshakes, int64_t handshake_ns,
                         int32_t keepalive_idle_s, int32_t keepalive_interval_s, int32_t keepalive_probes);
int32_t kvs_lease_handshakes(kvs_lease_server *s); /* TCP handshakes under way */
/* BLAKE2b (RFC 7693; kvs_blake2b.c), keyed and personalised as Python's hashlib.blake2b. */
int kvs_blake2b(uint8_t *out, uint32_t outlen, const uint8_t *key, uint32_t keylen, const uint8_t *person,
                uint32_t personlen, const uint8_t *data, uint32_t datalen);
int kvs_lease_stop(kvs_lease_server *s); /* stop and join it; its connections close */
int32_t kvs_lease_connections(kvs_lease_server *s);
int64_t kvs_lease_lease_requests(kvs_lease_server *s); /* `lease` and `leases` requests handled */
int32_t kvs_lease_events_fd(kvs_lease_server *s);
int32_t kvs_lease_next_event(kvs_lease_server *s, kvs_lease_event *out); /* 1, or 0: none */
int32_t kvs_lease_requests_fd(kvs_lease_server *s);
/* The next request for Python: 1 (with its connection), 0 none, KVS_E_RANGE: cap too small. */
int32_t kvs_lease_next_request(kvs_lease_server *s, uint64_t *conn, char *buf, uint32_t cap, uint32_t *len);
int kvs_lease_answer(kvs_lease_server *s, uint64_t conn, const char *payload, uint32_t len, const int32_t *fds,
                     int32_t nfds);
/* The exporter's retained inventory as leases naming blocks need it (kvs_inventory.h):
 * Python's Inventory keeps it up to date, under its own lock, as blocks are stored,
 * removed, evicted and cleared; a lease naming blocks is re-validated and pins them here,
 * on the thread, without Python. KVS_E_BUSY: a lease pins a block (nothing changed). */
int kvs_lease_inv_on(kvs_lease_server *s);  /* this exporter keeps an inventory */
int kvs_lease_inv_epoch(kvs_lease_server *s, const char *group, uint32_t glen, int64_t epoch); /* new or cleared */
int kvs_lease_inv_add(kvs_lease_server *s, const char *group, uint32_t glen, const uint64_t *hashes, uint32_t n);
int kvs_lease_inv_remove(kvs_lease_server *s, const char *group, uint32_t glen, const uint64_t *hashes,
                         uint32_t n);
int64_t kvs_lease_inv_leases(kvs_lease_server *s, const char *group, uint32_t glen, uint64_t hash);

/* -- the generated op table, for the Python side's consistency check ---------------- */

int32_t kvs_op_nstates(void);
const char *kvs_op_table_digest(void); /* codegen.table_digest() of the table built in */
int32_t kvs_op_nevents(void);
const char *kvs_op_state_name(int32_t state);
const char *kvs_op_event_name(int32_t event);
int32_t kvs_op_collectable(int32_t state);  /* the table lets the caller reap it (kvs_wait) */
int32_t kvs_planted_bug(void);  /* 1 only in the test build with a planted bug */
const char *kvs_strerror(int32_t code);

/* -- request links and lease renewal, importer side (kvs_link.c, kvs_renew.c) ------------
 *
 * A request link drives one connected SOCK_SEQPACKET control socket of an importer (a
 * PeerLink): frames as kvstate.channel.framing (12-byte header <4sIH2x, magic "KVS\x01",
 * payload, fds by SCM_RIGHTS), one request and its answer at a time under the link's
 * mutex, so a Python request (cffi drops the GIL while it waits) and the renewal thread
 * never interleave on one connection. The link holds its own duplicates of the socket
 * and of the peer's pidfd. kvs_link_close shuts the socket down at once (the exporter
 * sees the hang-up and ends every lease on it) and closes the duplicates as soon as no
 * call is inside; the memory goes with the last reference. */
typedef struct kvs_link kvs_link;

/* Refusals of a link call (each also leaves the link as Python's Channel does). */
#define KVS_E_LINK_CLOSED (-40)    /* the peer closed the connection, or it was closed here */
#define KVS_E_LINK_PEER_DIED (-41) /* the peer process exited and nothing is left to read */
#define KVS_E_LINK_TIMEOUT (-42)   /* no answer (or no room to send) before the deadline */
#define KVS_E_LINK_SYS (-43)       /* a system call failed: kvs_frame.err is its errno */
#define KVS_E_LINK_CAP (-44)       /* sending: payload or fd count over the link's caps */
#define KVS_E_LINK_TOOBIG (-45)    /* sending: EMSGSIZE, the message exceeds the send buffer */
#define KVS_E_LINK_SHORT_SEND (-46) /* sending: part of a message went out; the link is closed */
#define KVS_E_LINK_TRUNC (-47)     /* received: larger than the payload cap (MSG_TRUNC) */
#define KVS_E_LINK_CTRUNC (-48)    /* received: fds dropped (MSG_CTRUNC) */
#define KVS_E_LINK_SHORT (-49)     /* received: shorter than the header */
#define KVS_E_LINK_MAGIC (-50)     /* received: bad magic */
#define KVS_E_LINK_LENGTH (-51)    /* received: the header's length disagrees with the frame */
#define KVS_E_LINK_FDS (-52)       /* received: the header's fd count disagrees, or over the cap */
#define KVS_LINK_HEADER 12
#define KVS_LINK_MAX_FDS 253

/* One received frame, or what a refused one claimed. The caller sets buf and cap (at
 * least the link's payload cap); a received frame's fds belong to the caller. */
typedef struct kvs_frame {
    uint8_t *buf;
    uint32_t cap;
    uint32_t len;          /* payload bytes (received), or bytes of the whole packet (refused) */
    uint32_t nfds;
    uint32_t said_len;     /* the header's payload length and fd count (refusals) */
    uint32_t said_fds;
    uint8_t magic[4];
    int32_t err;           /* errno with KVS_E_LINK_SYS */
    int32_t fds[253];      /* KVS_LINK_MAX_FDS */
} kvs_frame;

/* NULL with errno set when dup or allocation fails. pidfd may be -1 (peer already gone). */
kvs_link *kvs_link_open(int32_t fd, int32_t pidfd, uint32_t max_payload, uint32_t max_fds);
/* A link over a connected TCP stream (kvstate.channel.tcp, authenticated already): the same
 * frames without fds, written and read in pieces within the deadline; a frame cut short
 * or a bad header shuts it (the stream is out of step). No pidfd: EOF, reset and the
 * socket's keepalive say the peer is gone. */
kvs_link *kvs_link_open_stream(int32_t fd, uint32_t max_payload);
void kvs_link_unref(kvs_link *l);
void kvs_link_close(kvs_link *l);
int32_t kvs_link_closed(kvs_link *l);
/* How long a wait for an answer polls before it sleeps (0, the default: it sleeps at
 * once; at most 1 s). A sleeping CPU's wake-up can cost more than the exporter takes to
 * answer. The poll ends early once another thread ran on its CPU. */
void kvs_link_set_spin(kvs_link *l, int64_t spin_ns);
/* How many waits on the link took their answer while they polled. */
uint64_t kvs_link_caught(kvs_link *l);
/* Hold the link across several calls (a pipelined exchange): send and recv need it held. */
void kvs_link_lock(kvs_link *l);
void kvs_link_unlock(kvs_link *l);
int kvs_link_send(kvs_link *l, const uint8_t *payload, uint32_t len, const int32_t *fds, uint32_t nfds,
                  int64_t timeout_ns, int32_t *err);
int kvs_link_recv(kvs_link *l, kvs_frame *f, int64_t timeout_ns);
/* lock, send, receive the answer, unlock; any failure closes the link: a late answer
 * would be read as the next request's. */
int kvs_link_request(kvs_link *l, const uint8_t *payload, uint32_t len, kvs_frame *f, int64_t timeout_ns);

/* A renewal thread: it owns (link, rank, lease id, term, renewed_at) of every registered
 * lease and renews each once min(term/2, interval) has passed since its grant or last
 * renewal, sending {"lease":N,"op":"renew","rank":R} on the link and reading the answer.
 * A refusal or a failed request is queued as an outcome and signals kvs_renewer_fd (an
 * eventfd); that lease is renewed no more. It never calls into Python. */
typedef struct kvs_renewer kvs_renewer;
#define KVS_RENEW_REFUSED 1     /* the answer was not {"ok":true,"expires_in_s":x}: reply holds it */
#define KVS_RENEW_REPLY_MAX 2048

typedef struct kvs_renew_outcome {
    uint64_t key;
    int32_t code;          /* KVS_RENEW_REFUSED, or a KVS_E_LINK_* of the request */
    int32_t err;           /* errno with KVS_E_LINK_SYS */
    uint32_t len;          /* reply bytes kept (the reply may have been longer) */
    uint8_t reply[2048];   /* KVS_RENEW_REPLY_MAX */
} kvs_renew_outcome;

typedef struct kvs_renew_state {
    int64_t renewed_at_ns; /* CLOCK_MONOTONIC of the grant or last renewal */
    int64_t expires_at_ns; /* CLOCK_MONOTONIC of the lease's end as last answered */
    uint64_t renewals;     /* renewals the exporter granted */
    int32_t failed;        /* 1 once an outcome was queued */
    int64_t generation;    /* the bank's generation as the last renewal said it; -1: none said yet */
} kvs_renew_state;

/* NULL with errno set (eventfd, timerfd, thread). */
kvs_renewer *kvs_renewer_start(int64_t interval_ns, int64_t timeout_ns);
void kvs_renewer_stop(kvs_renewer *r);  /* joins the thread, drops its links, frees */
int32_t kvs_renewer_fd(kvs_renewer *r);
/* KVS_E_INVAL for a key in use or a bad term; KVS_E_NOMEM. */
int kvs_renewer_add(kvs_renewer *r, kvs_link *l, uint64_t key, uint32_t rank, int64_t lease, int64_t term_ns,
                    int64_t renewed_at_ns);
int kvs_renewer_remove(kvs_renewer *r, uint64_t key);  /* KVS_E_NOENT if not registered */
int kvs_renewer_state(kvs_renewer *r, uint64_t key, kvs_renew_state *out);
int32_t kvs_renewer_take(kvs_renewer *r, kvs_renew_outcome *out, int32_t max); /* how many; drains the fd */
uint64_t kvs_renewer_dropped(kvs_renewer *r); /* outcomes lost to a full queue */

/* -- native import, importer side (kvs_import.c) ----------------------------------- */

/* Phase 1 of a group import on the host backend for one exporter batch, and phase 2 when
 * the batch is the whole group, in one call: the lease request is sent on the link and the
 * answer read (kvs_link_request); each part fires the part table's `lease` row, whose
 * native_lease effect checks the exporter's report against the descriptor, the received
 * fd (identity, memfd seals) and registers the lease with the renewal thread; only when
 * every part passed does kvs_attach open them all (the caller passes a batch only when it
 * is the whole group, so that every rank is leased and checked before any open). It takes only answers it can accept whole: anything else (a refusal, an
 * answer it does not read, a mismatch, a bad fd) comes back as KVS_IMPORT_DEFER with the
 * answer and its fds in the frame and nothing registered, for Python's reference path to
 * decide (and return the leases). The GIL is not held (a plain cffi call). */
#define KVS_IMPORT_DEFER 1        /* the answer is in the frame, its fds the caller's; nothing else done */
#define KVS_IMPORT_ATTACH 2       /* phase 2 failed: parts[*failed].attach says why; everything undone */
#define KVS_IMPORT_WHY_REPORT 1   /* the exporter's report disagrees with the descriptor */
#define KVS_IMPORT_WHY_FD 2       /* the received fd is not the named, sealed memfd */
#define KVS_IMPORT_WHY_RENEWAL 3  /* the renewal thread refused the registration */
#define KVS_IMPORT_HEX 72         /* room for a hex id and its NUL */

typedef struct kvs_import_part {
    kvs_attach_part attach;  /* in: state, dev, ino, size; out: the received fd (borrowed), what opened */
    uint64_t lease_holds;    /* in: the part table's guard bits for `lease` (group_importing) */
    int64_t rank, generation, num_blocks; /* in: what the descriptor says, for the report */
    char incarnation[72];    /* in: hex, NUL-terminated (KVS_IMPORT_HEX) */
    char geometry[72];
    char device_uuid[72];
    uint64_t renew_key;      /* in: the key the renewal thread knows the lease by (0: Python renews) */
    int64_t lease;           /* out: the granted lease id */
    int64_t expires_ns;      /* out: the grant's term */
    int32_t why;             /* out: KVS_IMPORT_WHY_* of the part that stopped phase 1 */
    int32_t registered;      /* out: 1 while the renewal thread holds the lease */
} kvs_import_part;

/* KVS_OK: every part `imported`, the received fds closed (f->nfds 0), each lease
 * registered for renewal under its key; a KVS_E_LINK_* of the request (the link closed);
 * KVS_IMPORT_DEFER; KVS_IMPORT_ATTACH; KVS_E_INVAL for a malformed call (nothing sent). */
int kvs_import(kvs_link *l, const uint8_t *req, uint32_t len, kvs_frame *f, int64_t timeout_ns,
               kvs_import_part *parts, int32_t n, kvs_renewer *r, int64_t renewed_at_ns, uint64_t align, int32_t access, int32_t *failed);
/* Phase 1 only, for a batch that is not the whole group (a rank worker's own part, whose
 * open waits for its coordinator): as kvs_import, but KVS_OK leaves every part `leased`
 * with its received fd in parts[i].attach.fd, the caller's now (f->nfds 0). */
int kvs_import_lease(kvs_link *l, const uint8_t *req, uint32_t len, kvs_frame *f, int64_t timeout_ns,
                     kvs_import_part *parts, int32_t n, kvs_renewer *r, int64_t renewed_at_ns, int32_t *failed);

#endif /* KVS_H */
