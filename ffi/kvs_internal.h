/* Shared by kvs_host.c and kvs_ops.c: the object tables and the one lock. Not public. */
#ifndef KVS_INTERNAL_H
#define KVS_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "kvs.h"

#define KVS_HIDDEN __attribute__((visibility("hidden")))

/* A slot table: ids are (sequence << 24 | slot), so a stale id never names a new object.
 * Every item starts with its uint64_t id. */
#define KVS_SLOT_BITS 24
#define KVS_SLOT_MASK ((UINT64_C(1) << KVS_SLOT_BITS) - 1)

struct kvs_slots {
    void **items;
    uint32_t cap;
    uint32_t *free;
    uint32_t nfree;
    uint32_t used;   /* slots ever handed out */
    uint64_t seq;
    uint64_t live;
};

struct kvs_alloc {
    uint64_t id;
    int fd;
    uint64_t size;
    uint64_t maps;
};

struct kvs_resv {
    uint64_t id;
    uint64_t addr;
    uint64_t size;
    uint64_t maps;
};

struct kvs_region {
    uint64_t id;
    uint64_t addr;
    uint64_t size;
    uint64_t alloc;
    uint64_t resv;
    int32_t access;
    uint64_t pins;
    uint64_t explicit_pins;
    uint64_t inflight;
    uint64_t completed;
    uint64_t failed;
    uint64_t bytes;
};

struct kvs_state {
    pthread_mutex_t mu;
    struct kvs_slots allocs, resvs, regions;
};

KVS_HIDDEN extern struct kvs_state kvs_g;

KVS_HIDDEN int kvs_slots_put(struct kvs_slots *t, void *item, uint64_t *id);
KVS_HIDDEN void *kvs_slots_get(const struct kvs_slots *t, uint64_t id);
KVS_HIDDEN void kvs_slots_del(struct kvs_slots *t, uint64_t id);
KVS_HIDDEN void *kvs_slots_at(const struct kvs_slots *t, uint32_t slot); /* iteration */

/* kvs_ops.c: per-region view of the engine, under kvs_g.mu. */
KVS_HIDDEN void kvs_ops_global(kvs_global_info *out);

#endif /* KVS_INTERNAL_H */
