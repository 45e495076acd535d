"""cffi builder of ``kvstate._native``: API mode, out of line, abi3.

``pip install`` runs this through ``setup.py``'s ``cffi_modules``. The declarations below
are compiled against the real header (``kvs.h``), so a declaration that disagrees with
it (a field's type or order, an argument's width) fails the build instead of corrupting
memory at run time. The build needs only cffi and a C compiler.

``builder(module, defines)`` also serves the planted-bug self-test, which compiles a
separate test-only module with ``KVS_PLANT_RELEASE_IGNORES_PINS``; the installed module is
always built by the module-level ``ffibuilder`` without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SOURCES = ("kvs_host.c", "kvs_ops.c")
DEPENDS = ("kvs.h", "kvs_internal.h", "kvs_op_table.h", *SOURCES)

CDEF = r"""
#define KVS_OK ...
#define KVS_E_INVAL ...
#define KVS_E_SYS ...
#define KVS_E_NOENT ...
#define KVS_E_PINNED ...
#define KVS_E_MAPPED ...
#define KVS_E_ACCESS ...
#define KVS_E_RANGE ...
#define KVS_E_OVERLAP ...
#define KVS_E_SIZE ...
#define KVS_E_SEALS ...
#define KVS_E_NOTMEMFD ...
#define KVS_E_ILLEGAL ...
#define KVS_E_TIMEOUT ...
#define KVS_E_BUSY ...
#define KVS_E_NOMEM ...
#define KVS_E_INJECTED ...

#define KVS_ACCESS_NONE ...
#define KVS_ACCESS_READ ...
#define KVS_ACCESS_READ_WRITE ...
#define KVS_OPF_FAIL ...

typedef struct kvs_block {
    uint64_t src_off;
    uint64_t dst_off;
    uint64_t len;
} kvs_block;

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
    uint64_t pins;
    uint64_t explicit_pins;
    uint64_t inflight;
    uint64_t completed;
    uint64_t failed;
    uint64_t bytes;
} kvs_region_info;

typedef struct kvs_global_info {
    uint64_t allocations;
    uint64_t reservations;
    uint64_t regions;
    uint64_t pins;
    uint64_t ops_live;
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
    int32_t state;
    int32_t error;
    uint64_t bytes;
    uint64_t nblocks;
} kvs_op_info;

uint64_t kvs_page_size(void);
int kvs_create(uint64_t size, uint64_t *allocation);
int kvs_export_fd(uint64_t allocation, int32_t *fd);
int kvs_import_fd(int32_t fd, uint64_t size, uint64_t *allocation);
int kvs_allocation_size(uint64_t allocation, uint64_t *size);
int kvs_release(uint64_t allocation);
int kvs_reserve(uint64_t size, uint64_t align, uint64_t *reservation, uint64_t *addr);
int kvs_free_reservation(uint64_t reservation);
int kvs_map(uint64_t reservation, uint64_t offset, uint64_t allocation, uint64_t *region,
            uint64_t *addr);
int kvs_set_access(uint64_t region, int32_t access);
int kvs_unmap(uint64_t region);

int kvs_region_pin(uint64_t region);
int kvs_region_unpin(uint64_t region);
int kvs_region_info_get(uint64_t region, kvs_region_info *out);
void kvs_global_info_get(kvs_global_info *out);

int kvs_engine_configure(uint32_t workers);
int kvs_engine_pause(int32_t paused);
int kvs_submit(const kvs_endpoint *src, const kvs_endpoint *dst, const kvs_block *blocks,
               uint64_t nblocks, uint32_t flags, int64_t *op);
int kvs_submit_copy(uint64_t src_region, uint64_t src_addr, uint64_t src_size, uint64_t src_off,
                    uint64_t dst_region, uint64_t dst_addr, uint64_t dst_size, uint64_t dst_off,
                    uint64_t len, uint32_t flags, int64_t *op);
int kvs_cancel(int64_t op);
int kvs_op_notify(int64_t op, int32_t fd);
int kvs_op_info_get(int64_t op, kvs_op_info *out);
int kvs_wait(int64_t op, int64_t timeout_ns);
int kvs_reap(int64_t op, kvs_op_info *out);

int32_t kvs_op_nstates(void);
const char *kvs_op_table_digest(void);
int32_t kvs_op_nevents(void);
const char *kvs_op_state_name(int32_t state);
const char *kvs_op_event_name(int32_t event);
int32_t kvs_op_collectable(int32_t state);
int32_t kvs_planted_bug(void);
const char *kvs_strerror(int32_t code);
"""


def builder(module: str = "kvstate._native", defines: Sequence[tuple[str, str | None]] = (),
            src_dir: Path | None = None) -> FFI:
    ffi = FFI()
    ffi.cdef(CDEF)
    # setuptools wants source paths relative to the project (pip runs this from there);
    # a test-only variant build passes the absolute directory of its copied sources.
    root = src_dir if src_dir is not None else Path("ffi") if Path("ffi/kvs.h").is_file() else HERE
    ffi.set_source(
        module,
        '#include "kvs.h"\n',
        sources=[str(root / s) for s in SOURCES],
        include_dirs=[str(root)],
        depends=[str(root / d) for d in DEPENDS],
        define_macros=list(defines),
        extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"],
        libraries=["pthread"],
        py_limited_api=True,
    )
    return ffi


ffibuilder = builder()

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
