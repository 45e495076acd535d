/* The shared slot-and-pin table (kvs_slots.h): slot tables, the lock, regions and their
 * pins, and the public calls that read or take pins. See kvs.h for the theory of
 * operation. */
#include <stdlib.h>

#include "kvs_slots.h"

struct kvs_state kvs_g = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* -- slot tables ---------------------------------------------------------------------- */

int kvs_slots_put(struct kvs_slots *t, void *item, uint64_t *id) {
    uint32_t slot;
    if (t->nfree > 0) {
        slot = t->free[--t->nfree];
    } else {
        if (t->used == t->cap) {
            uint32_t cap = t->cap ? t->cap * 2 : 64;
            if (cap > KVS_SLOT_MASK) return KVS_E_NOMEM;
            void **items = realloc(t->items, cap * sizeof *items);
            if (!items) return KVS_E_NOMEM;
            t->items = items;
            uint32_t *fr = realloc(t->free, cap * sizeof *fr);
            if (!fr) return KVS_E_NOMEM;
            t->free = fr;
            t->cap = cap;
        }
        slot = t->used++;
    }
    *id = (++kvs_g.seq << KVS_SLOT_BITS) | slot;
    *(uint64_t *)item = *id;
    t->items[slot] = item;
    t->live++;
    return KVS_OK;
}

void *kvs_slots_get(const struct kvs_slots *t, uint64_t id) {
    uint64_t slot = id & KVS_SLOT_MASK;
    if (id == 0 || slot >= t->used) return NULL;
    void *item = t->items[slot];
    if (!item || *(uint64_t *)item != id) return NULL;
    return item;
}

void kvs_slots_del(struct kvs_slots *t, uint64_t id) {
    uint32_t slot = (uint32_t)(id & KVS_SLOT_MASK);
    t->items[slot] = NULL;
    t->free[t->nfree++] = slot;
    t->live--;
}

void *kvs_slots_at(const struct kvs_slots *t, uint32_t slot) {
    return slot < t->used ? t->items[slot] : NULL;
}

/* -- regions and pins ----------------------------------------------------------------- */

struct kvs_region *kvs_region_find(uint64_t id) { return id ? kvs_slots_get(&kvs_g.regions, id) : NULL; }

int kvs_region_pin(uint64_t region) {
    pthread_mutex_lock(&kvs_g.mu);
    struct kvs_region *g = kvs_region_find(region);
    if (g) {
        g->pins++;
        g->explicit_pins++;
    }
    pthread_mutex_unlock(&kvs_g.mu);
    return g ? KVS_OK : KVS_E_NOENT;
}

int kvs_region_unpin(uint64_t region) {
    pthread_mutex_lock(&kvs_g.mu);
    int rc = KVS_OK;
    struct kvs_region *g = kvs_region_find(region);
    if (!g) {
        rc = KVS_E_NOENT;
    } else if (!g->explicit_pins) {
        rc = KVS_E_INVAL; /* only explicit pins may be dropped by hand */
    } else {
        g->pins--;
        g->explicit_pins--;
    }
    pthread_mutex_unlock(&kvs_g.mu);
    return rc;
}

static int own(uint64_t region, uint64_t from, uint64_t to) {
    pthread_mutex_lock(&kvs_g.mu);
    int rc = KVS_OK;
    struct kvs_region *g = kvs_region_find(region);
    if (!g) rc = KVS_E_NOENT;
    else if (g->owner != from && g->owner != to) rc = KVS_E_OWNED;
    else g->owner = to;
    pthread_mutex_unlock(&kvs_g.mu);
    return rc;
}

int kvs_region_own(uint64_t region, uint64_t owner) { return owner ? own(region, 0, owner) : KVS_E_INVAL; }

int kvs_region_disown(uint64_t region, uint64_t owner) { return owner ? own(region, owner, 0) : KVS_E_INVAL; }

int kvs_region_info_get(uint64_t region, kvs_region_info *out) {
    pthread_mutex_lock(&kvs_g.mu);
    struct kvs_region *g = kvs_region_find(region);
    if (g) {
        *out = (kvs_region_info){
            .addr = g->addr, .size = g->size, .allocation = g->alloc, .reservation = g->resv,
            .access = g->access, .pins = g->pins, .explicit_pins = g->explicit_pins,
            .inflight = g->inflight, .completed = g->completed, .failed = g->failed,
            .bytes = g->bytes,
        };
    }
    pthread_mutex_unlock(&kvs_g.mu);
    return g ? KVS_OK : KVS_E_NOENT;
}

void kvs_slots_global(kvs_global_info *out) {
    out->allocations = kvs_g.allocs.live + kvs_g.cu_allocs.live;
    out->reservations = kvs_g.resvs.live + kvs_g.cu_resvs.live;
    out->regions = kvs_g.regions.live;
    out->pins = 0;
    for (uint32_t s = 0; s < kvs_g.regions.used; s++) {
        struct kvs_region *g = kvs_slots_at(&kvs_g.regions, s);
        if (g) out->pins += g->pins;
    }
}
