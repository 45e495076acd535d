/* The exporter's retained inventory as its lease server needs it: for every group, its
 * epoch and the blocks it holds, with the leases each block carries. Python's Inventory
 * (kvstate/reuse/inventory.py) keeps it up to date as blocks are stored, removed,
 * evicted and cleared (off the request path); the lease thread re-validates and pins the
 * blocks a lease names here, without Python, and a block a lease pins is never removed.
 * No lock of its own: the lease server's `mu` guards it. */
#ifndef KVS_INVENTORY_H
#define KVS_INVENTORY_H

#include <stddef.h>
#include <stdint.h>

struct kvs_inv_slot {
    uint64_t hash;
    uint32_t leases;
    uint8_t used; /* 0 empty, 1 held, 2 removed (a tombstone keeps probes going) */
};

struct kvs_inv_group {
    char *name;
    uint32_t nlen;
    int64_t epoch;
    struct kvs_inv_slot *t; /* open addressing, a power of two slots */
    uint32_t cap, n, tombs;
};

struct kvs_inv {
    int on; /* the exporter keeps an inventory (else a lease naming blocks is refused) */
    struct kvs_inv_group *g;
    int ng, capg;
};

/* The group `name`, or -1. */
int kvs_inv_find(const struct kvs_inv *inv, const char *name, uint32_t nlen);
/* Start epoch `epoch` of group `name` (made if new) with no blocks: KVS_E_BUSY, changing
 * nothing, when a lease pins one of its blocks. */
int kvs_inv_epoch(struct kvs_inv *inv, const char *name, uint32_t nlen, int64_t epoch);
/* Add blocks to group `name` (KVS_E_NOENT: no such group); those held stay as they are. */
int kvs_inv_add(struct kvs_inv *inv, const char *name, uint32_t nlen, const uint64_t *h, uint32_t n);
/* Remove blocks from group `name` (unknown ones ignored): KVS_E_BUSY, removing nothing,
 * when a lease pins any of them. */
int kvs_inv_remove(struct kvs_inv *inv, const char *name, uint32_t nlen, const uint64_t *h, uint32_t n);
/* The leases on one block (0 when not held). */
uint32_t kvs_inv_leases(const struct kvs_inv *inv, const char *name, uint32_t nlen, uint64_t h);
/* How many of `h` group `g` does not hold. */
uint32_t kvs_inv_missing(const struct kvs_inv *inv, int g, const uint64_t *h, uint32_t n);
/* One more (delta 1) or one less (-1) lease on every block of `h`, all held. */
void kvs_inv_pin(struct kvs_inv *inv, int g, const uint64_t *h, uint32_t n, int delta);
void kvs_inv_free(struct kvs_inv *inv);

/* The blocks one lease request names, re-validated: a group, and hashes (malloc'd; the
 * lease that pins them owns them from its grant on). */
struct kvs_inv_want {
    int32_t group; /* -1: the request names none */
    uint32_t n;
    uint64_t *h;
};

/* Read and re-validate a request's `blocks` field (a JSON object: group, epoch, hashes)
 * as Python's Inventory.lease does, atomically under the server's lock: NULL with `w`
 * filled when every block is held in that group and epoch, else the refusal's code
 * ("no_inventory", "bad_request", "stale_inventory") with its detail in `detail`. */
struct kj_field;
const char *kvs_inv_want_read(const struct kvs_inv *inv, const struct kj_field *blocks, struct kvs_inv_want *w,
                              char *detail, size_t cap);

#endif /* KVS_INVENTORY_H */
