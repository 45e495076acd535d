/* The shared slot-and-pin table: id-named slot tables, the one lock, and the regions
 * (mappings) with the pins that ops and leases hold on them. Not public.
 *
 * kvs_host.c (memory objects) and kvs_ops.c (the op engine) both build on this file and
 * on nothing of each other: the host side creates and removes regions, the op engine
 * pins them, and both read the pin counts here. A later backend (CUDA) adds its regions
 * to the same table, so unmap and release refuse under its ops too. */
#ifndef KVS_SLOTS_H
#define KVS_SLOTS_H

#include <pthread.h>
#include <stdint.h>

#include "kvs.h"

#define KVS_HIDDEN __attribute__((visibility("hidden")))

/* A slot table: ids are (sequence << 24 | slot), so a stale id never names a new object.
 * The sequence is shared by every table, so no two objects of any kind (a host and a CUDA
 * allocation, say) ever have the same id. Every item starts with its uint64_t id. */
#define KVS_SLOT_BITS 24
#define KVS_SLOT_MASK ((UINT64_C(1) << KVS_SLOT_BITS) - 1)

struct kvs_slots {
    void **items;
    uint32_t cap;
    uint32_t *free;
    uint32_t nfree;
    uint32_t used;   /* slots ever handed out */
    uint64_t live;
};

KVS_HIDDEN int kvs_slots_put(struct kvs_slots *t, void *item, uint64_t *id);
KVS_HIDDEN void *kvs_slots_get(const struct kvs_slots *t, uint64_t id);
KVS_HIDDEN void kvs_slots_del(struct kvs_slots *t, uint64_t id);
KVS_HIDDEN void *kvs_slots_at(const struct kvs_slots *t, uint32_t slot); /* iteration */

/* Which backend made a region: only that backend's unmap and set_access act on it. */
#define KVS_BACKEND_HOST 0
#define KVS_BACKEND_CUDA 1
/* Device memory of kvs_cuda_buffer_alloc: a region only so that ops pin it (the one pin
 * rule); no unmap or set_access acts on it, and its free refuses while it is pinned. */
#define KVS_BACKEND_CUDA_BUFFER 2

/* One mapping of memory that ops may touch. pins = explicit (lease) pins + in-flight ops. */
struct kvs_region {
    uint64_t id;
    int32_t backend; /* KVS_BACKEND_*; calloc makes a host region */
    uint64_t addr;
    uint64_t size;
    uint64_t alloc;
    uint64_t resv;
    int32_t access;
    uint64_t owner; /* kvs_region_own's token; 0: none */
    uint64_t pins;
    uint64_t explicit_pins;
    uint64_t inflight;
    uint64_t completed;
    uint64_t failed;
    uint64_t bytes;
};

/* Process-global state behind one mutex. allocs and resvs hold the host memory side's own
 * items, cu_allocs and cu_resvs the CUDA side's (opaque here); regions holds struct
 * kvs_region of both, since ops of both pin them. */
struct kvs_state {
    pthread_mutex_t mu;
    uint64_t seq;
    struct kvs_slots allocs, resvs, regions, cu_allocs, cu_resvs;
};

KVS_HIDDEN extern struct kvs_state kvs_g;

/* The region named by id, or NULL (id 0 names none). Under kvs_g.mu. */
KVS_HIDDEN struct kvs_region *kvs_region_find(uint64_t id);

/* Object counts and the sum of pins, for kvs_global_info_get. Under kvs_g.mu. */
KVS_HIDDEN void kvs_slots_global(kvs_global_info *out);

#endif /* KVS_SLOTS_H */
