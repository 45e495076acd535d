/* A CPU stand-in for libcuda: the subset of the driver API kvstate's C engine calls
 * (ffi/kvs_cuda_driver.h), backed by host memory, so the engine's real CUDA code path runs
 * in CI without a GPU. Select it with KVSTATE_LIBCUDA=/path/to/libcudashim.so; the test
 * suite builds it (tests/cudashim/build.py).
 *
 * Model. "Device memory" is host memory at the same address: a VMM allocation is a memfd
 * (exported as a dup of it for POSIX-fd handles), reserved address space is PROT_NONE, a
 * mapping is that memfd mapped over it with no access until cuMemSetAccess (mprotect);
 * cuMemAlloc memory is a memfd too, with a header page in front. Copies are queued on
 * streams and run in order by one "device" thread, so an event completes later than its
 * record; tests can stall the device (cudashim_stall) or slow it (KVSTATE_CUDASHIM_DELAY_US).
 *
 * Sharing between processes. POSIX-fd handles are memfds, sent with SCM_RIGHTS like any
 * fd. A legacy IPC handle (and a FABRIC handle) is 64 bytes naming the exporter's pid, the
 * memfd's fd number there and its inode: the importer opens /proc/<pid>/fd/<fd> (same
 * user, as CUDA IPC needs anyway) and checks the inode, so a dead exporter's handle cannot
 * be opened. The header page of a cuMemAlloc allocation lists the pids that have it open,
 * so the exporter's cuMemFree sees an importer that still has it open.
 *
 * What it checks. Every call is journalled (cudashim_journal, and the file named by
 * KVSTATE_CUDASHIM_JOURNAL across processes) and counted. What would be undefined on a GPU
 * is recorded as a violation (cudashim_violations) instead of crashing: unmapping, freeing
 * or closing memory with copies still queued on it, a copy that touches memory without
 * access, cuMemFree while another live process has the allocation open. Calls that need a
 * context refuse without a current one. Any call can be made to fail: cudashim_fail(call,
 * nth, result) or KVSTATE_CUDASHIM_FAIL="call:nth:result,..." ("async": a copy faults on
 * the device, reported by the next event on its stream).
 *
 * Configuration (read at cuInit): KVSTATE_CUDASHIM_DEVICES (1), _VERSION (12080; below
 * that cuMemcpyBatchAsync is not offered), _GRANULARITY (2 MiB), _MIN_GRANULARITY, _VMM (1),
 * _FABRIC (0), _MAX_PITCH, _DELAY_US (0). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cudashim.h"

struct shim_alloc {
    uint64_t handle;
    int fd;
    uint64_t size;
    unsigned types;
    int released, maps;
    struct shim_alloc *next;
};

struct shim_resv {
    uint64_t addr, size;
    struct shim_resv *next;
};

static struct shim_alloc *allocs;
static struct shim_resv *resvs;
static uint64_t next_handle = 1;
static _Thread_local struct shim_ctx *current;

static const char IPC_MAGIC[8] = {'K', 'V', 'S', 'H', 'I', 'M', 'I', 'P'};
static const char FAB_MAGIC[8] = {'K', 'V', 'S', 'H', 'I', 'M', 'F', 'B'};

/* What a legacy IPC or FABRIC handle carries. */
struct shim_handle {
    char magic[8];
    int32_t pid;
    int32_t fd;
    uint64_t ino;
    uint64_t size;
};

static unsigned done(const char *call, unsigned rc) {
    shim_log(call, rc, NULL);
    pthread_mutex_unlock(&S.mu);
    return rc;
}

static int ctx_ok(void) { return current && current->refs > 0; }

int shim_has_context(void) { return ctx_ok(); }

/* Every entry point: count, take an injected failure, refuse before cuInit or without a
 * current context where the driver would. */
#define BEGIN(name, need_ctx)                                                                  \
    const char *call_ = #name;                                                                 \
    pthread_mutex_lock(&S.mu);                                                                 \
    shim_count(call_);                                                                         \
    unsigned rc = shim_injected(call_);                                                        \
    if (rc == KCU_SUCCESS && !S.initialized) rc = KCU_ERROR_NOT_INITIALIZED;                   \
    if (rc == KCU_SUCCESS && (need_ctx) && !ctx_ok()) rc = KCU_ERROR_INVALID_CONTEXT;          \
    if (rc != KCU_SUCCESS) return done(call_, rc)

#define END return done(call_, rc)

static int valid_device(int dev) { return dev >= 0 && dev < S.devices; }

static int memfd(uint64_t size) {
    int fd = memfd_create("cudashim", MFD_CLOEXEC);
    if (fd >= 0 && ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

static struct shim_alloc *alloc_of(uint64_t handle) {
    for (struct shim_alloc *a = allocs; a; a = a->next)
        if (a->handle == handle) return a;
    return NULL;
}

static void drop_alloc(struct shim_alloc *a) {
    for (struct shim_alloc **p = &allocs; *p; p = &(*p)->next)
        if (*p == a) {
            *p = a->next;
            break;
        }
    close(a->fd);
    free(a);
    S.vmm_allocs--;
}

static void add_range(struct shim_range *r) {
    r->next = S.ranges;
    S.ranges = r;
}

static void drop_range(struct shim_range *r) {
    for (struct shim_range **p = &S.ranges; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            break;
        }
    free(r);
}

/* -- init, versions, errors ---------------------------------------------------------- */

SHIM_EXPORT kcu_result cuInit(unsigned int flags) {
    pthread_mutex_lock(&S.mu);
    shim_configure();
    shim_count("cuInit");
    unsigned rc = shim_injected("cuInit");
    if (rc == KCU_SUCCESS && flags) rc = KCU_ERROR_INVALID_VALUE;
    if (rc == KCU_SUCCESS && S.devices == 0) rc = KCU_ERROR_NO_DEVICE;
    if (rc == KCU_SUCCESS) S.initialized = 1;
    return done("cuInit", rc);
}

SHIM_EXPORT kcu_result cuDriverGetVersion(int *version) {
    pthread_mutex_lock(&S.mu);
    shim_count("cuDriverGetVersion");
    unsigned rc = shim_injected("cuDriverGetVersion");
    if (rc == KCU_SUCCESS && !version) rc = KCU_ERROR_INVALID_VALUE;
    if (rc == KCU_SUCCESS) {
        shim_configure();
        *version = S.version;
    }
    return done("cuDriverGetVersion", rc);
}

static const struct {
    unsigned code;
    const char *name;
} names[] = {
    {KCU_SUCCESS, "CUDA_SUCCESS"}, {KCU_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
    {KCU_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"}, {KCU_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
    {KCU_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE"}, {KCU_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
    {KCU_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"}, {KCU_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED"},
    {KCU_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"}, {KCU_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"},
    {KCU_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY"}, {KCU_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"},
    {KCU_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED"}, {KCU_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"},
    {KCU_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN"},
};

SHIM_EXPORT kcu_result cuGetErrorName(kcu_result error, const char **name) {
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (names[i].code == error) {
            *name = names[i].name;
            return KCU_SUCCESS;
        }
    *name = NULL;
    return KCU_ERROR_INVALID_VALUE;
}

/* -- devices and contexts ------------------------------------------------------------ */

SHIM_EXPORT kcu_result cuDeviceGetCount(int *count) {
    BEGIN(cuDeviceGetCount, 0);
    *count = S.devices;
    END;
}

SHIM_EXPORT kcu_result cuDeviceGet(kcu_device *device, int ordinal) {
    BEGIN(cuDeviceGet, 0);
    if (!valid_device(ordinal)) rc = KCU_ERROR_INVALID_DEVICE;
    else *device = ordinal;
    END;
}

SHIM_EXPORT kcu_result cuDeviceGetUuid(kcu_uuid *uuid, kcu_device dev) {
    BEGIN(cuDeviceGetUuid, 0);
    if (!valid_device(dev)) {
        rc = KCU_ERROR_INVALID_DEVICE;
    } else {
        memcpy(uuid->bytes, "KVSCUDASHIM-dev", 15);
        uuid->bytes[15] = (char)('0' + dev);
    }
    END;
}

SHIM_EXPORT kcu_result cuDeviceGetName(char *name, int len, kcu_device dev) {
    BEGIN(cuDeviceGetName, 0);
    if (!valid_device(dev) || len <= 0) rc = KCU_ERROR_INVALID_VALUE;
    else snprintf(name, (size_t)len, "kvstate CUDA shim %d", dev);
    END;
}

SHIM_EXPORT kcu_result cuDeviceGetAttribute(int *value, kcu_device_attribute attrib, kcu_device dev) {
    BEGIN(cuDeviceGetAttribute, 0);
    if (!valid_device(dev)) rc = KCU_ERROR_INVALID_DEVICE;
    else if (attrib == KCU_DEVICE_ATTRIBUTE_MAX_PITCH) *value = (int)S.max_pitch;
    else if (attrib == KCU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) *value = S.vmm;
    else if (attrib == KCU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) *value = S.vmm;
    else if (attrib == KCU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED) *value = S.fabric;
    else *value = 0;
    END;
}

SHIM_EXPORT kcu_result cuDevicePrimaryCtxRetain(kcu_context *ctx, kcu_device dev) {
    BEGIN(cuDevicePrimaryCtxRetain, 0);
    if (!valid_device(dev)) {
        rc = KCU_ERROR_INVALID_DEVICE;
    } else {
        S.ctx[dev].refs++;
        *ctx = (kcu_context)(void *)&S.ctx[dev];
    }
    END;
}

SHIM_EXPORT kcu_result cuDevicePrimaryCtxRelease(kcu_device dev) {
    BEGIN(cuDevicePrimaryCtxRelease, 0);
    if (!valid_device(dev)) rc = KCU_ERROR_INVALID_DEVICE;
    else if (S.ctx[dev].refs == 0) rc = KCU_ERROR_INVALID_CONTEXT;
    else S.ctx[dev].refs--;
    END;
}

SHIM_EXPORT kcu_result cuCtxSetCurrent(kcu_context ctx) {
    BEGIN(cuCtxSetCurrent, 0);
    struct shim_ctx *c = (struct shim_ctx *)(void *)ctx;
    if (c && (c < S.ctx || c >= S.ctx + SHIM_MAX_DEVICES || c->refs == 0)) rc = KCU_ERROR_INVALID_CONTEXT;
    else current = c;
    END;
}

/* -- VMM ------------------------------------------------------------------------------ */

static int prop_ok(const kcu_allocation_prop *p) {
    return p && p->type == KCU_MEM_ALLOCATION_TYPE_PINNED && p->location.type == KCU_MEM_LOCATION_TYPE_DEVICE &&
           valid_device(p->location.id) &&
           !(p->requested_handle_types & ~(KCU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | KCU_MEM_HANDLE_TYPE_FABRIC));
}

SHIM_EXPORT kcu_result cuMemGetAllocationGranularity(size_t *granularity, const kcu_allocation_prop *prop,
                                                     kcu_granularity_flags option) {
    BEGIN(cuMemGetAllocationGranularity, 0);
    if (!prop_ok(prop) || option > KCU_MEM_ALLOC_GRANULARITY_RECOMMENDED) rc = KCU_ERROR_INVALID_VALUE;
    else *granularity = option == KCU_MEM_ALLOC_GRANULARITY_MINIMUM ? S.min_granularity : S.granularity;
    END;
}

SHIM_EXPORT kcu_result cuMemCreate(kcu_mem_handle *handle, size_t size, const kcu_allocation_prop *prop,
                                   kcu_flags flags) {
    BEGIN(cuMemCreate, 1);
    struct shim_alloc *a = NULL;
    if (!prop_ok(prop) || flags || size == 0 || size % S.min_granularity) rc = KCU_ERROR_INVALID_VALUE;
    else if (!S.vmm || ((prop->requested_handle_types & KCU_MEM_HANDLE_TYPE_FABRIC) && !S.fabric))
        rc = KCU_ERROR_NOT_SUPPORTED;
    else if (!(a = calloc(1, sizeof *a)) || (a->fd = memfd(size)) < 0) rc = KCU_ERROR_OUT_OF_MEMORY;
    if (rc == KCU_SUCCESS) {
        a->handle = next_handle++;
        a->size = size;
        a->types = prop->requested_handle_types;
        a->next = allocs;
        allocs = a;
        S.vmm_allocs++;
        *handle = a->handle;
    } else {
        free(a);
    }
    END;
}

SHIM_EXPORT kcu_result cuMemRelease(kcu_mem_handle handle) {
    BEGIN(cuMemRelease, 1);
    struct shim_alloc *a = alloc_of(handle);
    if (!a || a->released) rc = KCU_ERROR_INVALID_VALUE;
    else if (a->maps) a->released = 1; /* the memory lives until its last mapping goes */
    else drop_alloc(a);
    END;
}

SHIM_EXPORT kcu_result cuMemExportToShareableHandle(void *shareable, kcu_mem_handle handle, kcu_handle_type type,
                                                    kcu_flags flags) {
    BEGIN(cuMemExportToShareableHandle, 1);
    struct shim_alloc *a = alloc_of(handle);
    struct stat st;
    if (!a || a->released || flags || !shareable) {
        rc = KCU_ERROR_INVALID_VALUE;
    } else if (!(a->types & type) || (type != KCU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && type != KCU_MEM_HANDLE_TYPE_FABRIC)) {
        rc = KCU_ERROR_NOT_PERMITTED; /* not requested at cuMemCreate */
    } else if (type == KCU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0); /* the caller owns the new fd */
        if (fd < 0) rc = KCU_ERROR_OUT_OF_MEMORY;
        else *(int *)shareable = fd;
    } else if (fstat(a->fd, &st) != 0) {
        rc = KCU_ERROR_OUT_OF_MEMORY;
    } else {
        struct shim_handle h = {.pid = getpid(), .fd = a->fd, .ino = st.st_ino, .size = a->size};
        memcpy(h.magic, FAB_MAGIC, sizeof h.magic);
        memset(shareable, 0, KCU_IPC_HANDLE_SIZE);
        memcpy(shareable, &h, sizeof h);
    }
    END;
}

/* Open another process's memfd named by a handle, checking that it is the same file. */
static int open_named(const struct shim_handle *h, const char magic[8]) {
    if (memcmp(h->magic, magic, 8) != 0) return -1;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)h->pid, (int)h->fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && (fstat(fd, &st) != 0 || (uint64_t)st.st_ino != h->ino)) {
        close(fd);
        fd = -1;
    }
    return fd;
}

SHIM_EXPORT kcu_result cuMemImportFromShareableHandle(kcu_mem_handle *handle, void *os_handle, kcu_handle_type type) {
    BEGIN(cuMemImportFromShareableHandle, 1);
    int fd = -1;
    struct stat st;
    if (type == KCU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        fd = fcntl((int)(intptr_t)os_handle, F_DUPFD_CLOEXEC, 0);
    } else if (type == KCU_MEM_HANDLE_TYPE_FABRIC && S.fabric) {
        struct shim_handle h;
        memcpy(&h, os_handle, sizeof h);
        fd = open_named(&h, FAB_MAGIC);
    } else {
        rc = KCU_ERROR_NOT_SUPPORTED;
    }
    struct shim_alloc *a = NULL;
    if (rc == KCU_SUCCESS && (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0))
        rc = KCU_ERROR_INVALID_HANDLE;
    else if (rc == KCU_SUCCESS && !(a = calloc(1, sizeof *a))) rc = KCU_ERROR_OUT_OF_MEMORY;
    if (rc == KCU_SUCCESS) {
        *a = (struct shim_alloc){.handle = next_handle++, .fd = fd, .size = (uint64_t)st.st_size, .types = type,
                                 .next = allocs};
        allocs = a;
        S.vmm_allocs++;
        *handle = a->handle;
    } else if (fd >= 0) {
        close(fd);
    }
    END;
}

SHIM_EXPORT kcu_result cuMemAddressReserve(kcu_deviceptr *ptr, size_t size, size_t alignment, kcu_deviceptr addr,
                                           kcu_flags flags) {
    BEGIN(cuMemAddressReserve, 1);
    uint64_t align = alignment ? alignment : S.granularity;
    struct shim_resv *r = NULL;
    void *p = MAP_FAILED;
    if (!ptr || size == 0 || size % S.min_granularity || flags || addr || (align & (align - 1)))
        rc = KCU_ERROR_INVALID_VALUE;
    else if (!(r = calloc(1, sizeof *r)) ||
             (p = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)) == MAP_FAILED)
        rc = KCU_ERROR_OUT_OF_MEMORY;
    if (rc == KCU_SUCCESS) {
        uint64_t base = (uint64_t)(uintptr_t)p, start = (base + align - 1) & ~(align - 1);
        if (start > base) munmap(p, start - base);
        if (base + size + align > start + size) munmap((void *)(uintptr_t)(start + size), base + align - start);
        r->addr = start;
        r->size = size;
        r->next = resvs;
        resvs = r;
        S.reservations++;
        *ptr = start;
    } else {
        free(r);
    }
    END;
}

static int resv_has_maps(uint64_t lo, uint64_t hi) {
    for (struct shim_range *m = S.ranges; m; m = m->next)
        if (m->kind == SHIM_VMM_MAP && m->addr < hi && lo < m->addr + m->size) return 1;
    return 0;
}

SHIM_EXPORT kcu_result cuMemAddressFree(kcu_deviceptr ptr, size_t size) {
    BEGIN(cuMemAddressFree, 1);
    struct shim_resv **p = &resvs;
    while (*p && !((*p)->addr == ptr && (*p)->size == size)) p = &(*p)->next;
    if (!*p || resv_has_maps(ptr, ptr + size)) {
        rc = KCU_ERROR_INVALID_VALUE;
    } else {
        struct shim_resv *r = *p;
        *p = r->next;
        munmap((void *)(uintptr_t)r->addr, r->size);
        free(r);
        S.reservations--;
    }
    END;
}

static int in_reservation(uint64_t lo, uint64_t size) {
    for (struct shim_resv *r = resvs; r; r = r->next)
        if (lo >= r->addr && size <= r->size && lo - r->addr <= r->size - size) return 1;
    return 0;
}

SHIM_EXPORT kcu_result cuMemMap(kcu_deviceptr ptr, size_t size, size_t offset, kcu_mem_handle handle, kcu_flags flags) {
    BEGIN(cuMemMap, 1);
    struct shim_alloc *a = alloc_of(handle);
    struct shim_range *m = NULL;
    if (!a || a->released || offset || flags || size != a->size || !in_reservation(ptr, size)) rc = KCU_ERROR_INVALID_VALUE;
    else if (resv_has_maps(ptr, ptr + size)) rc = KCU_ERROR_ALREADY_MAPPED;
    else if (!(m = calloc(1, sizeof *m))) rc = KCU_ERROR_OUT_OF_MEMORY;
    else if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, 0) == MAP_FAILED)
        rc = KCU_ERROR_OUT_OF_MEMORY;
    if (rc == KCU_SUCCESS) {
        *m = (struct shim_range){.kind = SHIM_VMM_MAP, .addr = ptr, .size = size, .handle = handle, .fd = -1};
        add_range(m);
        a->maps++;
    } else {
        free(m);
    }
    END;
}

SHIM_EXPORT kcu_result cuMemSetAccess(kcu_deviceptr ptr, size_t size, const kcu_access_desc *desc, size_t count) {
    BEGIN(cuMemSetAccess, 1);
    struct shim_range *m = shim_range_at(ptr, size, 1);
    if (!m || m->kind != SHIM_VMM_MAP || !desc || count != 1 || desc->location.type != KCU_MEM_LOCATION_TYPE_DEVICE ||
        !valid_device(desc->location.id) ||
        (desc->flags != KCU_MEM_ACCESS_FLAGS_PROT_READ && desc->flags != KCU_MEM_ACCESS_FLAGS_PROT_READWRITE))
        rc = KCU_ERROR_INVALID_VALUE;
    else if (mprotect((void *)(uintptr_t)ptr, size,
                      desc->flags == KCU_MEM_ACCESS_FLAGS_PROT_READ ? PROT_READ : PROT_READ | PROT_WRITE) != 0)
        rc = KCU_ERROR_INVALID_VALUE;
    else m->access = desc->flags;
    END;
}

SHIM_EXPORT kcu_result cuMemUnmap(kcu_deviceptr ptr, size_t size) {
    BEGIN(cuMemUnmap, 1);
    struct shim_range *m = shim_range_at(ptr, size, 1);
    if (!m || m->kind != SHIM_VMM_MAP) {
        rc = KCU_ERROR_INVALID_VALUE;
    } else {
        int n = shim_pending_touching(ptr, ptr + size);
        if (n) shim_violation("cuMemUnmap of 0x%llx (%zu bytes) with %d copy(ies) still queued on it",
                              (unsigned long long)ptr, size, n);
        mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        struct shim_alloc *a = alloc_of(m->handle);
        drop_range(m);
        if (a && --a->maps == 0 && a->released) drop_alloc(a);
    }
    END;
}

/* -- legacy memory and IPC ------------------------------------------------------------ */

/* A cuMemAlloc allocation or IPC open: the memfd's header page and memory mapped. */
static struct shim_range *map_legacy(int fd, uint64_t size, enum shim_kind kind) {
    struct shim_range *r = calloc(1, sizeof *r);
    void *hdr = mmap(NULL, SHIM_HEADER, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    void *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, SHIM_HEADER);
    if (!r || hdr == MAP_FAILED || mem == MAP_FAILED) {
        if (hdr != MAP_FAILED) munmap(hdr, SHIM_HEADER);
        if (mem != MAP_FAILED) munmap(mem, size);
        free(r);
        return NULL;
    }
    *r = (struct shim_range){.kind = kind, .addr = (uint64_t)(uintptr_t)mem, .size = size,
                             .access = KCU_MEM_ACCESS_FLAGS_PROT_READWRITE, .fd = fd, .header = hdr, .slot = -1};
    return r;
}

static void unmap_legacy(struct shim_range *r) {
    munmap(r->header, SHIM_HEADER);
    munmap((void *)(uintptr_t)r->addr, r->size);
    close(r->fd);
    drop_range(r);
}

SHIM_EXPORT kcu_result cuMemAlloc(kcu_deviceptr *dptr, size_t size) {
    BEGIN(cuMemAlloc, 1);
    int fd = size ? memfd(SHIM_HEADER + size) : -1;
    struct shim_range *r = fd >= 0 ? map_legacy(fd, size, SHIM_LEGACY) : NULL;
    if (!size) {
        rc = KCU_ERROR_INVALID_VALUE;
    } else if (!r) {
        if (fd >= 0) close(fd);
        rc = KCU_ERROR_OUT_OF_MEMORY;
    } else {
        struct shim_ipc_header *h = r->header;
        memcpy(h->magic, IPC_MAGIC, sizeof h->magic);
        h->owner = getpid();
        add_range(r);
        *dptr = r->addr;
    }
    END;
}

static int alive(int32_t pid) { return pid > 0 && (kill(pid, 0) == 0 || errno == EPERM); }

SHIM_EXPORT kcu_result cuMemFree(kcu_deviceptr dptr) {
    BEGIN(cuMemFree, 1);
    struct shim_range *r = shim_range_at(dptr, 0, 1);
    if (!r || r->kind != SHIM_LEGACY) {
        rc = KCU_ERROR_INVALID_VALUE;
    } else {
        int n = shim_pending_touching(r->addr, r->addr + r->size);
        if (n) shim_violation("cuMemFree of 0x%llx with %d copy(ies) still queued on it", (unsigned long long)dptr, n);
        struct shim_ipc_header *h = r->header;
        for (int i = 0; i < SHIM_IPC_OPENERS; i++) {
            int32_t pid = __atomic_load_n(&h->openers[i], __ATOMIC_ACQUIRE);
            if (pid && alive(pid))
                shim_violation("cuMemFree of 0x%llx while process %d has it open by IPC", (unsigned long long)dptr,
                               (int)pid);
        }
        unmap_legacy(r);
    }
    END;
}

SHIM_EXPORT kcu_result cuPointerGetAttribute(void *data, kcu_pointer_attribute attribute, kcu_deviceptr ptr) {
    BEGIN(cuPointerGetAttribute, 1);
    struct shim_range *r = shim_range_at(ptr, 1, 0);
    if (!data || attribute != KCU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE || !r) rc = KCU_ERROR_INVALID_VALUE;
    else *(int *)data = r->kind == SHIM_LEGACY;
    END;
}

SHIM_EXPORT kcu_result cuIpcGetMemHandle(kcu_ipc_mem_handle *handle, kcu_deviceptr dptr) {
    BEGIN(cuIpcGetMemHandle, 1);
    struct shim_range *r = shim_range_at(dptr, 0, 1);
    struct stat st;
    if (!handle || !r || r->kind != SHIM_LEGACY || fstat(r->fd, &st) != 0) {
        rc = KCU_ERROR_INVALID_VALUE;
    } else {
        struct shim_handle h = {.pid = getpid(), .fd = r->fd, .ino = st.st_ino, .size = r->size};
        memcpy(h.magic, IPC_MAGIC, sizeof h.magic);
        memset(handle, 0, sizeof *handle);
        memcpy(handle->reserved, &h, sizeof h);
    }
    END;
}

SHIM_EXPORT kcu_result cuIpcOpenMemHandle(kcu_deviceptr *dptr, kcu_ipc_mem_handle handle, unsigned int flags) {
    BEGIN(cuIpcOpenMemHandle, 1);
    struct shim_handle h;
    memcpy(&h, handle.reserved, sizeof h);
    int fd = -1;
    struct shim_range *r = NULL;
    if (memcmp(h.magic, IPC_MAGIC, 8) != 0 || flags != KCU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) rc = KCU_ERROR_INVALID_VALUE;
    else if (h.pid == getpid()) rc = KCU_ERROR_INVALID_CONTEXT; /* the driver refuses a process's own handle */
    else if ((fd = open_named(&h, IPC_MAGIC)) < 0) rc = KCU_ERROR_INVALID_HANDLE;
    else if (!(r = map_legacy(fd, h.size, SHIM_IPC_OPEN))) rc = KCU_ERROR_OUT_OF_MEMORY;
    if (rc == KCU_SUCCESS) {
        struct shim_ipc_header *hdr = r->header;
        for (int i = 0; i < SHIM_IPC_OPENERS && r->slot < 0; i++) {
            int32_t none = 0;
            if (__atomic_compare_exchange_n(&hdr->openers[i], &none, (int32_t)getpid(), 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE))
                r->slot = i;
        }
        if (r->slot < 0) { /* more openers than the header has room for */
            munmap(r->header, SHIM_HEADER);
            munmap((void *)(uintptr_t)r->addr, r->size);
            free(r);
            close(fd);
            rc = KCU_ERROR_OUT_OF_MEMORY;
        } else {
            add_range(r);
            *dptr = r->addr;
        }
    } else if (fd >= 0) {
        close(fd);
    }
    END;
}

SHIM_EXPORT kcu_result cuMemGetAddressRange(kcu_deviceptr *base, size_t *size, kcu_deviceptr dptr) {
    BEGIN(cuMemGetAddressRange, 1);
    struct shim_range *r = shim_range_at(dptr, 1, 0);
    if (!r) {
        rc = KCU_ERROR_NOT_FOUND;
    } else {
        if (base) *base = r->addr;
        if (size) *size = (size_t)r->size;
    }
    END;
}

SHIM_EXPORT kcu_result cuIpcCloseMemHandle(kcu_deviceptr dptr) {
    BEGIN(cuIpcCloseMemHandle, 1);
    struct shim_range *r = shim_range_at(dptr, 0, 1);
    if (!r || r->kind != SHIM_IPC_OPEN) {
        rc = KCU_ERROR_INVALID_VALUE;
    } else {
        int n = shim_pending_touching(r->addr, r->addr + r->size);
        if (n) shim_violation("cuIpcCloseMemHandle of 0x%llx with %d copy(ies) still queued on it",
                              (unsigned long long)dptr, n);
        struct shim_ipc_header *hdr = r->header;
        __atomic_store_n(&hdr->openers[r->slot], 0, __ATOMIC_RELEASE);
        unmap_legacy(r);
    }
    END;
}
