/* CUDA device memory with the host backend's semantics: devices (a retained primary
 * context each), allocations (VMM or legacy cuMemAlloc), reservations, mappings as regions
 * of the shared table, device buffers and synchronous copies. See kvs.h.
 *
 * Locking: the tables and counts are under kvs_g.mu. A call that must decide and act as
 * one step (unmap while nobody pins, release while nothing maps) makes its driver call
 * under that lock; calls that only add an object (open, create, import, buffers) make
 * theirs outside it, after counting the object against its device so the device cannot
 * be closed under them. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvs_cuda.h"

static struct kvs_slots devs; /* struct kcu_dev, under kvs_g.mu */

struct kcu_dev *kcu_dev_find(uint64_t id) { return kvs_slots_get(&devs, id); }

int kcu_enter(const struct kcu_dev *d) { return KCU(cuCtxSetCurrent, d->ctx); }

static void lock(void) { pthread_mutex_lock(&kvs_g.mu); }
static void unlock(void) { pthread_mutex_unlock(&kvs_g.mu); }

static int aligned(uint64_t v, uint64_t to) { return to && v % to == 0; }

static int vmm_type(uint32_t t) { return t == KVS_CUDA_POSIX_FD || t == KVS_CUDA_FABRIC; }

static kcu_allocation_prop prop_for(kcu_device dev, uint32_t type) {
    kcu_allocation_prop p;
    memset(&p, 0, sizeof p);
    p.type = KCU_MEM_ALLOCATION_TYPE_PINNED;
    p.requested_handle_types = vmm_type(type) ? type : KCU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location.type = KCU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    return p;
}

/* Look up a device and count one more object against it, so close refuses meanwhile; the
 * caller makes its driver calls outside the lock with the copy in *out. */
static int hold_device(uint64_t device, struct kcu_dev *out) {
    int rc = kcu_ready();
    if (rc != KVS_OK) return rc;
    lock();
    struct kcu_dev *d = kcu_dev_find(device);
    if (d) {
        d->objects++;
        *out = *d;
    }
    unlock();
    return d ? KVS_OK : KVS_E_NOENT;
}

static void unhold_device(uint64_t device) {
    lock();
    struct kcu_dev *d = kcu_dev_find(device);
    if (d) d->objects--;
    unlock();
}

/* -- devices -------------------------------------------------------------------------- */

static int find_device(const char *uuid, kcu_device *out) {
    int n = 0, rc = KCU(cuDeviceGetCount, &n);
    for (int i = 0; rc == KVS_OK && i < n; i++) {
        kcu_device dev;
        kcu_uuid u;
        if ((rc = KCU(cuDeviceGet, &dev, i)) != KVS_OK || (rc = KCU(cuDeviceGetUuid, &u, dev)) != KVS_OK)
            return rc;
        if (memcmp(u.bytes, uuid, sizeof u.bytes) == 0) {
            *out = dev;
            return KVS_OK;
        }
    }
    return rc != KVS_OK ? rc : KVS_E_NOENT;
}

/* A device that lacks what the transport needs is refused as the driver would refuse it. */
static int require(kcu_device dev, kcu_device_attribute attr) {
    int v = 0, rc = KCU(cuDeviceGetAttribute, &v, attr, dev);
    if (rc == KVS_OK && !v) rc = kcu_check("cuDeviceGetAttribute", KCU_ERROR_NOT_SUPPORTED);
    return rc;
}

static int setup(struct kcu_dev *d) {
    int rc, pitch = 0;
    size_t gran = 0;
    kcu_allocation_prop p = prop_for(d->dev, d->kind);
    if ((rc = kcu_enter(d)) != KVS_OK) return rc;
    if (vmm_type(d->kind)) {
        if ((rc = require(d->dev, KCU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)) != KVS_OK) return rc;
        if (d->kind == KVS_CUDA_POSIX_FD &&
            (rc = require(d->dev, KCU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)) != KVS_OK)
            return rc;
    }
    if ((rc = KCU(cuMemGetAllocationGranularity, &gran, &p, KCU_MEM_ALLOC_GRANULARITY_RECOMMENDED)) != KVS_OK ||
        (rc = KCU(cuDeviceGetAttribute, &pitch, KCU_DEVICE_ATTRIBUTE_MAX_PITCH, d->dev)) != KVS_OK ||
        (rc = KCU(cuStreamCreate, &d->sync, KCU_STREAM_NON_BLOCKING)) != KVS_OK)
        return rc;
    if (!gran) return kcu_check("cuMemGetAllocationGranularity", KCU_ERROR_INVALID_VALUE);
    d->granularity = gran;
    d->max_pitch = pitch > 0 ? (uint64_t)pitch : 0;
    return KVS_OK;
}

int kvs_cuda_open(const char *uuid, uint32_t handle_type, uint64_t *device) {
    int rc = kcu_ready();
    if (rc != KVS_OK) return rc;
    if (!uuid || (handle_type != KVS_CUDA_LEGACY_IPC && !vmm_type(handle_type))) return KVS_E_INVAL;
    struct kcu_dev *d = calloc(1, sizeof *d);
    if (!d) return KVS_E_NOMEM;
    memcpy(d->uuid, uuid, sizeof d->uuid);
    d->kind = handle_type;
    if ((rc = find_device(uuid, &d->dev)) != KVS_OK || (rc = KCU(cuDevicePrimaryCtxRetain, &d->ctx, d->dev)) != KVS_OK) {
        free(d);
        return rc;
    }
    if ((rc = setup(d)) == KVS_OK) {
        lock();
        rc = kvs_slots_put(&devs, d, device);
        unlock();
    }
    if (rc != KVS_OK) {
        if (d->sync) kcu.cuStreamDestroy(d->sync);
        kcu.cuDevicePrimaryCtxRelease(d->dev); /* the failure to report is the first one */
        free(d);
    }
    return rc;
}

int kvs_cuda_close(uint64_t device) {
    int rc = kcu_ready();
    if (rc != KVS_OK) return rc;
    lock();
    struct kcu_dev *d = kcu_dev_find(device);
    rc = !d ? KVS_E_NOENT : (d->objects || d->inflight) ? KVS_E_BUSY : KVS_OK;
    if (rc == KVS_OK) kvs_slots_del(&devs, device);
    unlock();
    if (rc != KVS_OK) return rc;
    /* The device is gone from the table either way; report the first failure. */
    rc = kcu_enter(d);
    int r2 = kcu_lanes_destroy(d);
    int r3 = KCU(cuStreamDestroy, d->sync);
    int r4 = KCU(cuDevicePrimaryCtxRelease, d->dev);
    free(d->buffers);
    free(d);
    return rc != KVS_OK ? rc : r2 != KVS_OK ? r2 : r3 != KVS_OK ? r3 : r4;
}

int kvs_cuda_granularity(uint64_t device, uint32_t handle_type, int32_t minimum, uint64_t *out) {
    struct kcu_dev d;
    int rc = hold_device(device, &d);
    if (rc != KVS_OK) return rc;
    size_t gran = 0;
    kcu_allocation_prop p = prop_for(d.dev, handle_type);
    if ((rc = kcu_enter(&d)) == KVS_OK)
        rc = KCU(cuMemGetAllocationGranularity, &gran, &p,
                 minimum ? KCU_MEM_ALLOC_GRANULARITY_MINIMUM : KCU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    unhold_device(device);
    if (rc == KVS_OK) *out = gran;
    return rc;
}

/* -- allocations ---------------------------------------------------------------------- */

/* Add an allocation made outside the lock; the device hold becomes the allocation's. */
static int add_alloc(struct kcu_alloc *a, uint64_t *allocation) {
    lock();
    int rc = kvs_slots_put(&kvs_g.cu_allocs, a, allocation);
    unlock();
    return rc;
}

static void undo_alloc(const struct kcu_alloc *a) {
    if (a->export_fd >= 0) close(a->export_fd);
    if (!vmm_type(a->type)) {
        if (a->imported) kcu.cuIpcCloseMemHandle(a->ptr);
        else kcu.cuMemFree(a->ptr);
    } else {
        kcu.cuMemRelease(a->handle);
    }
}

int kvs_cuda_create(uint64_t device, uint64_t size, uint32_t handle_type, uint64_t *allocation) {
    if (size == 0 || (handle_type != KVS_CUDA_LEGACY_IPC && !vmm_type(handle_type))) return KVS_E_INVAL;
    struct kcu_dev d;
    int rc = hold_device(device, &d);
    if (rc != KVS_OK) return rc;
    struct kcu_alloc *a = calloc(1, sizeof *a);
    if (!a) rc = KVS_E_NOMEM;
    else if (!aligned(size, d.granularity)) rc = KVS_E_INVAL;
    else rc = kcu_enter(&d);
    if (rc == KVS_OK) {
        *a = (struct kcu_alloc){.device = device, .size = size, .type = handle_type, .export_fd = -1};
        kcu_allocation_prop p = prop_for(d.dev, handle_type);
        rc = vmm_type(handle_type) ? KCU(cuMemCreate, &a->handle, size, &p, 0) : KCU(cuMemAlloc, &a->ptr, size);
        if (rc == KVS_OK && (rc = add_alloc(a, allocation)) != KVS_OK) undo_alloc(a);
    }
    if (rc != KVS_OK) {
        free(a);
        unhold_device(device);
    }
    return rc;
}

int kvs_cuda_export(uint64_t allocation, uint32_t handle_type, int32_t *fd, char *handle) {
    int rc = kcu_ready();
    if (rc != KVS_OK) return rc;
    lock();
    struct kcu_alloc *a = kvs_slots_get(&kvs_g.cu_allocs, allocation);
    struct kcu_dev *d = a ? kcu_dev_find(a->device) : NULL;
    if (!a || !d) rc = KVS_E_NOENT;
    else if (a->imported || handle_type != a->type)
        rc = KVS_E_INVAL; /* only own allocations, as the handle type they were created for */
    else if ((handle_type == KVS_CUDA_POSIX_FD && !fd) || (handle_type != KVS_CUDA_POSIX_FD && !handle))
        rc = KVS_E_INVAL;
    else rc = kcu_enter(d);
    if (rc == KVS_OK && handle_type == KVS_CUDA_POSIX_FD) {
        if (a->export_fd < 0) {
            int out = -1;
            rc = KCU(cuMemExportToShareableHandle, &out, a->handle, KCU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
            if (rc == KVS_OK) a->export_fd = out;
        }
        if (rc == KVS_OK) *fd = a->export_fd;
    } else if (rc == KVS_OK && handle_type == KVS_CUDA_FABRIC) {
        kcu_fabric_handle fh;
        rc = KCU(cuMemExportToShareableHandle, &fh, a->handle, KCU_MEM_HANDLE_TYPE_FABRIC, 0);
        if (rc == KVS_OK) memcpy(handle, fh.data, KVS_CUDA_HANDLE_BYTES);
    } else if (rc == KVS_OK) {
        int capable = 0;
        rc = KCU(cuPointerGetAttribute, &capable, KCU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, a->ptr);
        if (rc == KVS_OK && !capable) rc = kcu_check("cuPointerGetAttribute", KCU_ERROR_NOT_SUPPORTED);
        if (rc == KVS_OK && (rc = KCU(cuIpcGetMemHandle, &a->ipc, a->ptr)) == KVS_OK) {
            a->exported_ipc = 1;
            memcpy(handle, a->ipc.reserved, KVS_CUDA_HANDLE_BYTES);
        }
    }
    unlock();
    return rc;
}

/* Under the lock: this process exported these legacy IPC handle bytes. */
static int own_ipc(const char *handle) {
    for (uint32_t s = 0; s < kvs_g.cu_allocs.used; s++) {
        struct kcu_alloc *a = kvs_slots_at(&kvs_g.cu_allocs, s);
        if (a && a->exported_ipc && memcmp(a->ipc.reserved, handle, KVS_CUDA_HANDLE_BYTES) == 0) return 1;
    }
    return 0;
}

int kvs_cuda_import(uint64_t device, uint32_t handle_type, int32_t fd, const char *handle, uint64_t size,
                    uint64_t *allocation) {
    if (size == 0 || (handle_type == KVS_CUDA_POSIX_FD ? fd < 0 : !handle) ||
        (handle_type != KVS_CUDA_LEGACY_IPC && !vmm_type(handle_type)))
        return KVS_E_INVAL;
    struct kcu_dev d;
    int rc = hold_device(device, &d);
    if (rc != KVS_OK) return rc;
    if (handle_type == KVS_CUDA_LEGACY_IPC) {
        lock();
        rc = own_ipc(handle) ? KVS_E_OWNIPC : KVS_OK;
        unlock();
    }
    struct kcu_alloc *a = rc == KVS_OK ? calloc(1, sizeof *a) : NULL;
    if (rc == KVS_OK && !a) rc = KVS_E_NOMEM;
    if (rc == KVS_OK && !aligned(size, d.granularity)) rc = KVS_E_INVAL;
    if (rc == KVS_OK) rc = kcu_enter(&d);
    if (rc == KVS_OK) {
        *a = (struct kcu_alloc){.device = device, .size = size, .type = handle_type, .imported = 1, .export_fd = -1};
        if (handle_type == KVS_CUDA_POSIX_FD) {
            rc = KCU(cuMemImportFromShareableHandle, &a->handle, (void *)(uintptr_t)fd,
                     KCU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        } else if (handle_type == KVS_CUDA_FABRIC) {
            kcu_fabric_handle fh;
            memcpy(fh.data, handle, sizeof fh.data);
            rc = KCU(cuMemImportFromShareableHandle, &a->handle, &fh, KCU_MEM_HANDLE_TYPE_FABRIC);
        } else {
            kcu_ipc_mem_handle ih;
            memcpy(ih.reserved, handle, sizeof ih.reserved);
            rc = KCU(cuIpcOpenMemHandle, &a->ptr, ih, KCU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
            if (rc == KVS_OK) {
                /* The size is the caller's claim: the opened allocation must hold it, or the
                   ops this mapping allows would reach past the memory (a GPU would fault or
                   read a neighbour's). VMM imports need no such check: cuMemMap refuses. */
                kcu_deviceptr base = 0;
                size_t have = 0;
                rc = KCU(cuMemGetAddressRange, &base, &have, a->ptr);
                if (rc == KVS_OK && (base != a->ptr || have < size)) rc = KVS_E_RANGE;
                if (rc != KVS_OK) kcu.cuIpcCloseMemHandle(a->ptr);
            }
        }
        if (rc == KVS_OK && (rc = add_alloc(a, allocation)) != KVS_OK) undo_alloc(a);
    }
    if (rc != KVS_OK) {
        free(a);
        unhold_device(device);
    }
    return rc;
}

static int alloc_pinned(uint64_t allocation) {
    for (uint32_t s = 0; s < kvs_g.regions.used; s++) {
        struct kvs_region *r = kvs_slots_at(&kvs_g.regions, s);
        if (r && r->alloc == allocation && r->pins) return 1;
    }
    return 0;
}

int kvs_cuda_release(uint64_t allocation) {
    int rc = kcu_ready();
    if (rc != KVS_OK) return rc;
    lock();
    struct kcu_alloc *a = kvs_slots_get(&kvs_g.cu_allocs, allocation);
    struct kcu_dev *d = a ? kcu_dev_find(a->device) : NULL;
    if (!a || !d) rc = KVS_E_NOENT;
    else if (alloc_pinned(allocation)) rc = KVS_E_PINNED;
    else if (a->maps) rc = KVS_E_MAPPED;
    else rc = kcu_enter(d);
    if (rc == KVS_OK) {
        if (vmm_type(a->type)) rc = KCU(cuMemRelease, a->handle);
        else if (a->imported) rc = KCU(cuIpcCloseMemHandle, a->ptr);
        else rc = KCU(cuMemFree, a->ptr);
    }
    if (rc == KVS_OK) {
        if (a->export_fd >= 0) close(a->export_fd);
        kvs_slots_del(&kvs_g.cu_allocs, allocation);
        d->objects--;
        free(a);
    }
    unlock();
    return rc;
}

/* -- reservations --------------------------------------------------------------------- */

int kvs_cuda_reserve(uint64_t device, uint64_t size, uint64_t *reservation, uint64_t *addr) {
    struct kcu_dev d;
    int rc = hold_device(device, &d);
    if (rc != KVS_OK) return rc;
    struct kcu_resv *r = calloc(1, sizeof *r);
    if (!r) rc = KVS_E_NOMEM;
    else if (size == 0 || !aligned(size, d.granularity)) rc = KVS_E_INVAL;
    else if (d.kind != KVS_CUDA_LEGACY_IPC && (rc = kcu_enter(&d)) == KVS_OK)
        rc = KCU(cuMemAddressReserve, &r->addr, size, d.granularity, 0, 0);
    if (rc == KVS_OK) {
        r->device = device;
        r->size = size;
        lock();
        rc = kvs_slots_put(&kvs_g.cu_resvs, r, reservation);
        unlock();
        if (rc != KVS_OK && r->addr) kcu.cuMemAddressFree(r->addr, size);
    }
    if (rc != KVS_OK) {
        free(r);
        unhold_device(device);
        return rc;
    }
    *addr = r->addr;
    return KVS_OK;
}

int kvs_cuda_free_reservation(uint64_t reservation) {
    int rc = kcu_ready();
    if (rc != KVS_OK) return rc;
    lock();
    struct kcu_resv *r = kvs_slots_get(&kvs_g.cu_resvs, reservation);
    struct kcu_dev *d = r ? kcu_dev_find(r->device) : NULL;
    if (!r || !d) rc = KVS_E_NOENT;
    else if (r->maps) rc = KVS_E_MAPPED;
    else if (r->addr && (rc = kcu_enter(d)) == KVS_OK) rc = KCU(cuMemAddressFree, r->addr, r->size);
    if (rc == KVS_OK) {
        kvs_slots_del(&kvs_g.cu_resvs, reservation);
        d->objects--;
        free(r);
    }
    unlock();
    return rc;
}

/* -- regions (mappings) --------------------------------------------------------------- */

static struct kvs_region *cuda_region(uint64_t id) {
    struct kvs_region *g = kvs_region_find(id);
    return g && g->backend == KVS_BACKEND_CUDA ? g : NULL;
}

int kvs_cuda_map(uint64_t reservation, uint64_t offset, uint64_t allocation, uint64_t *region, uint64_t *addr) {
    int rc = kcu_ready();
    if (rc != KVS_OK) return rc;
    lock();
    struct kcu_resv *rv = kvs_slots_get(&kvs_g.cu_resvs, reservation);
    struct kcu_alloc *a = kvs_slots_get(&kvs_g.cu_allocs, allocation);
    struct kcu_dev *d = rv ? kcu_dev_find(rv->device) : NULL;
    struct kvs_region *g = NULL;
    uint64_t lo = 0;
    if (!rv || !a || !d || a->device != rv->device) {
        rc = KVS_E_NOENT;
    } else if (!aligned(offset, d->granularity)) {
        rc = KVS_E_INVAL;
    } else if (offset > rv->size || a->size > rv->size - offset) {
        rc = KVS_E_RANGE;
    } else if (!vmm_type(a->type)) {
        /* legacy memory has one mapping, where it was allocated or opened */
        rc = offset || rv->maps || a->maps ? KVS_E_OVERLAP : KVS_OK;
        lo = a->ptr;
    } else if (!rv->addr) {
        rc = KVS_E_INVAL; /* a legacy placeholder cannot hold VMM memory */
    } else {
        lo = rv->addr + offset;
        for (uint32_t s = 0; rc == KVS_OK && s < kvs_g.regions.used; s++) {
            struct kvs_region *o = kvs_slots_at(&kvs_g.regions, s);
            if (o && o->resv == reservation && lo < o->addr + o->size && o->addr < lo + a->size) rc = KVS_E_OVERLAP;
        }
    }
    if (rc == KVS_OK && !(g = calloc(1, sizeof *g))) rc = KVS_E_NOMEM;
    if (rc == KVS_OK && vmm_type(a->type) && (rc = kcu_enter(d)) == KVS_OK) rc = KCU(cuMemMap, lo, a->size, 0, a->handle, 0);
    if (rc == KVS_OK) {
        *g = (struct kvs_region){.backend = KVS_BACKEND_CUDA, .addr = lo, .size = a->size, .alloc = allocation,
                                 .resv = reservation, .access = KVS_ACCESS_NONE};
        if ((rc = kvs_slots_put(&kvs_g.regions, g, region)) != KVS_OK && vmm_type(a->type)) kcu.cuMemUnmap(lo, a->size);
    }
    if (rc == KVS_OK) {
        a->maps++;
        rv->maps++;
        *addr = lo;
    } else {
        free(g);
    }
    unlock();
    return rc;
}

int kvs_cuda_set_access(uint64_t region, int32_t access) {
    int rc = kcu_ready();
    if (rc != KVS_OK) return rc;
    if (access < KVS_ACCESS_NONE || access > KVS_ACCESS_READ_WRITE) return KVS_E_INVAL;
    lock();
    struct kvs_region *g = cuda_region(region);
    struct kcu_alloc *a = g ? kvs_slots_get(&kvs_g.cu_allocs, g->alloc) : NULL;
    struct kcu_dev *d = a ? kcu_dev_find(a->device) : NULL;
    if (!g || !a || !d) rc = KVS_E_NOENT;
    else if (g->owner) rc = KVS_E_OWNED;
    else if (access < g->access && g->pins) rc = KVS_E_PINNED; /* revoking under an op would fault it */
    else if (vmm_type(a->type) && access == KVS_ACCESS_NONE) rc = KVS_E_INVAL; /* CUDA cannot revoke: unmap */
    if (rc == KVS_OK && vmm_type(a->type)) {
        /* legacy memory is read-write for the driver; its level is kept for the op guard */
        kcu_access_desc desc = {.location = {.type = KCU_MEM_LOCATION_TYPE_DEVICE, .id = d->dev},
                                .flags = access == KVS_ACCESS_READ ? KCU_MEM_ACCESS_FLAGS_PROT_READ
                                                                   : KCU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        if ((rc = kcu_enter(d)) == KVS_OK) rc = KCU(cuMemSetAccess, g->addr, g->size, &desc, 1);
    }
    if (rc == KVS_OK) g->access = access;
    unlock();
    return rc;
}

int kvs_cuda_unmap(uint64_t region) {
    int rc = kcu_ready();
    if (rc != KVS_OK) return rc;
    lock();
    struct kvs_region *g = cuda_region(region);
    struct kcu_alloc *a = g ? kvs_slots_get(&kvs_g.cu_allocs, g->alloc) : NULL;
    struct kcu_resv *rv = g ? kvs_slots_get(&kvs_g.cu_resvs, g->resv) : NULL;
    struct kcu_dev *d = a ? kcu_dev_find(a->device) : NULL;
    if (!g || !a || !rv || !d) rc = KVS_E_NOENT;
    else if (g->owner) rc = KVS_E_OWNED;
    else if (g->pins) rc = KVS_E_PINNED; /* an op's pins drop only when its event completed */
    else if (vmm_type(a->type) && (rc = kcu_enter(d)) == KVS_OK) rc = KCU(cuMemUnmap, g->addr, g->size);
    if (rc == KVS_OK) {
        a->maps--;
        rv->maps--;
        kvs_slots_del(&kvs_g.regions, region);
        free(g);
    }
    unlock();
    return rc;
}

/* -- device buffers and synchronous copies -------------------------------------------- */

int kvs_cuda_buffer_alloc(uint64_t device, uint64_t size, uint64_t *addr) {
    if (size == 0) return KVS_E_INVAL;
    struct kcu_dev d;
    int rc = hold_device(device, &d);
    if (rc != KVS_OK) return rc;
    kcu_deviceptr p = 0;
    struct kvs_region *g = calloc(1, sizeof *g);
    if (!g) rc = KVS_E_NOMEM;
    if (rc == KVS_OK && (rc = kcu_enter(&d)) == KVS_OK) rc = KCU(cuMemAlloc, &p, size);
    int allocated = rc == KVS_OK;
    if (rc == KVS_OK) {
        lock();
        struct kcu_dev *live = kcu_dev_find(device); /* held: still there */
        if (live->nbuffers == live->buffers_cap) {
            uint32_t cap = live->buffers_cap ? 2 * live->buffers_cap : 16;
            uint64_t *b = realloc(live->buffers, cap * sizeof *b);
            if (b) {
                live->buffers = b;
                live->buffers_cap = cap;
            } else {
                rc = KVS_E_NOMEM;
            }
        }
        uint64_t region = 0;
        if (rc == KVS_OK) {
            *g = (struct kvs_region){.backend = KVS_BACKEND_CUDA_BUFFER, .addr = p, .size = size, .alloc = device,
                                     .access = KVS_ACCESS_READ_WRITE};
            rc = kvs_slots_put(&kvs_g.regions, g, &region);
        }
        if (rc == KVS_OK) live->buffers[live->nbuffers++] = region;
        unlock();
    }
    if (rc != KVS_OK) {
        if (allocated) kcu.cuMemFree(p);
        free(g);
        unhold_device(device);
    } else {
        *addr = p;
    }
    return rc;
}

/* Under the lock: the index in d->buffers of the buffer region at addr, or nbuffers. */
static uint32_t buffer_at(const struct kcu_dev *d, uint64_t addr) {
    uint32_t i = 0;
    while (i < d->nbuffers && kvs_region_find(d->buffers[i])->addr != addr) i++;
    return i;
}

int kvs_cuda_buffer_free(uint64_t device, uint64_t addr) {
    int rc = kcu_ready();
    if (rc != KVS_OK) return rc;
    lock();
    struct kcu_dev *d = kcu_dev_find(device);
    uint32_t i = d ? buffer_at(d, addr) : 0;
    struct kvs_region *g = d && i < d->nbuffers ? kvs_region_find(d->buffers[i]) : NULL;
    if (!g) rc = KVS_E_NOENT; /* only buffers of kvs_cuda_buffer_alloc */
    else if (g->pins) rc = KVS_E_PINNED; /* an op in flight reads or writes it */
    else if ((rc = kcu_enter(d)) == KVS_OK) rc = KCU(cuMemFree, addr);
    if (rc == KVS_OK) {
        kvs_slots_del(&kvs_g.regions, g->id);
        free(g);
        d->buffers[i] = d->buffers[--d->nbuffers];
        d->objects--;
    }
    unlock();
    return rc;
}

uint64_t kcu_buffer_region(uint64_t device, uint64_t base, uint64_t size) {
    struct kcu_dev *d = kcu_dev_find(device);
    for (uint32_t i = 0; d && i < d->nbuffers; i++) {
        struct kvs_region *g = kvs_region_find(d->buffers[i]);
        if (base >= g->addr && size <= g->size && base - g->addr <= g->size - size) return g->id;
    }
    return 0;
}

static int with_device(uint64_t device, struct kcu_dev *d) {
    int rc = hold_device(device, d);
    if (rc == KVS_OK && (rc = kcu_enter(d)) != KVS_OK) unhold_device(device);
    return rc;
}

int kvs_cuda_write(uint64_t device, uint64_t dst, const char *src, uint64_t len) {
    struct kcu_dev d;
    int rc = !src || !len ? KVS_E_INVAL : with_device(device, &d);
    if (rc != KVS_OK) return rc;
    rc = KCU(cuMemcpyHtoD, dst, src, len);
    unhold_device(device);
    return rc;
}

int kvs_cuda_read(uint64_t device, char *dst, uint64_t src, uint64_t len) {
    struct kcu_dev d;
    int rc = !dst || !len ? KVS_E_INVAL : with_device(device, &d);
    if (rc != KVS_OK) return rc;
    rc = KCU(cuMemcpyDtoH, dst, src, len);
    unhold_device(device);
    return rc;
}

int kvs_cuda_memcpy(uint64_t device, uint64_t dst, uint64_t src, uint64_t len) {
    struct kcu_dev d;
    int rc = !len ? KVS_E_INVAL : with_device(device, &d);
    if (rc != KVS_OK) return rc;
    /* the caller's memory is free again only once the copy ran: a failed wait is retried */
    if ((rc = KCU(cuMemcpyAsync, dst, src, len, d.sync)) == KVS_OK)
        rc = kcu_check("cuStreamSynchronize", kcu_wait(d.ctx, d.sync, NULL));
    unhold_device(device);
    return rc;
}
