/* The inventory's groups, blocks and block leases for the lease server (kvs_inventory.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvs.h"
#include "kvs_inventory.h"
#include "kvs_json.h"

static uint32_t mix(uint64_t h) { /* block hashes are digests already; fold and spread */
    h ^= h >> 33;
    h *= UINT64_C(0xff51afd7ed558ccd);
    h ^= h >> 33;
    return (uint32_t)h;
}

static struct kvs_inv_slot *lookup(const struct kvs_inv_group *g, uint64_t h) {
    if (!g->cap) return NULL;
    for (uint32_t i = mix(h) & (g->cap - 1), k = 0; k < g->cap; i = (i + 1) & (g->cap - 1), k++) {
        struct kvs_inv_slot *s = &g->t[i];
        if (s->used == 0) return NULL;
        if (s->used == 1 && s->hash == h) return s;
    }
    return NULL;
}

/* Room for `more` blocks: the table stays under 3/4 full, tombstones included. */
static int reserve(struct kvs_inv_group *g, uint32_t more) {
    uint64_t want = (uint64_t)g->n + g->tombs + more;
    if (g->cap && want * 4 < (uint64_t)g->cap * 3) return KVS_OK;
    uint64_t cap = 16;
    while (cap * 3 <= ((uint64_t)g->n + more) * 4) cap *= 2;
    if (cap > (UINT64_C(1) << 31)) return KVS_E_NOMEM;
    struct kvs_inv_slot *t = calloc(cap, sizeof *t);
    if (!t) return KVS_E_NOMEM;
    for (uint32_t i = 0; i < g->cap; i++) {
        if (g->t[i].used != 1) continue;
        uint32_t j = mix(g->t[i].hash) & (uint32_t)(cap - 1);
        while (t[j].used) j = (j + 1) & (uint32_t)(cap - 1);
        t[j] = g->t[i];
    }
    free(g->t);
    g->t = t;
    g->cap = (uint32_t)cap;
    g->tombs = 0;
    return KVS_OK;
}

int kvs_inv_find(const struct kvs_inv *inv, const char *name, uint32_t nlen) {
    for (int k = 0; k < inv->ng; k++)
        if (inv->g[k].nlen == nlen && memcmp(inv->g[k].name, name, nlen) == 0) return k;
    return -1;
}

static int busy(const struct kvs_inv_group *g) {
    for (uint32_t i = 0; i < g->cap; i++)
        if (g->t[i].used == 1 && g->t[i].leases) return 1;
    return 0;
}

int kvs_inv_epoch(struct kvs_inv *inv, const char *name, uint32_t nlen, int64_t epoch) {
    int k = kvs_inv_find(inv, name, nlen);
    if (k < 0) {
        if (inv->ng == inv->capg) {
            int cap = inv->capg ? 2 * inv->capg : 4;
            struct kvs_inv_group *g = realloc(inv->g, (size_t)cap * sizeof *g);
            if (!g) return KVS_E_NOMEM;
            inv->g = g;
            inv->capg = cap;
        }
        char *copy = malloc(nlen ? nlen : 1);
        if (!copy) return KVS_E_NOMEM;
        memcpy(copy, name, nlen);
        inv->g[inv->ng++] = (struct kvs_inv_group){copy, nlen, epoch, NULL, 0, 0, 0};
        return KVS_OK;
    }
    struct kvs_inv_group *g = &inv->g[k];
    if (busy(g)) return KVS_E_BUSY;
    if (g->cap) memset(g->t, 0, (size_t)g->cap * sizeof *g->t);
    g->n = g->tombs = 0;
    g->epoch = epoch;
    return KVS_OK;
}

int kvs_inv_add(struct kvs_inv *inv, const char *name, uint32_t nlen, const uint64_t *h, uint32_t n) {
    int k = kvs_inv_find(inv, name, nlen);
    if (k < 0) return KVS_E_NOENT;
    struct kvs_inv_group *g = &inv->g[k];
    int rc = reserve(g, n);
    if (rc) return rc;
    for (uint32_t m = 0; m < n; m++) {
        if (lookup(g, h[m])) continue;
        uint32_t i = mix(h[m]) & (g->cap - 1);
        while (g->t[i].used == 1) i = (i + 1) & (g->cap - 1);
        if (g->t[i].used == 2) g->tombs--;
        g->t[i] = (struct kvs_inv_slot){h[m], 0, 1};
        g->n++;
    }
    return KVS_OK;
}

int kvs_inv_remove(struct kvs_inv *inv, const char *name, uint32_t nlen, const uint64_t *h, uint32_t n) {
    int k = kvs_inv_find(inv, name, nlen);
    if (k < 0) return KVS_OK;
    struct kvs_inv_group *g = &inv->g[k];
    for (uint32_t m = 0; m < n; m++) {
        struct kvs_inv_slot *s = lookup(g, h[m]);
        if (s && s->leases) return KVS_E_BUSY;
    }
    for (uint32_t m = 0; m < n; m++) {
        struct kvs_inv_slot *s = lookup(g, h[m]);
        if (!s) continue;
        s->used = 2;
        g->n--;
        g->tombs++;
    }
    return KVS_OK;
}

uint32_t kvs_inv_leases(const struct kvs_inv *inv, const char *name, uint32_t nlen, uint64_t h) {
    int k = kvs_inv_find(inv, name, nlen);
    const struct kvs_inv_slot *s = k < 0 ? NULL : lookup(&inv->g[k], h);
    return s ? s->leases : 0;
}

uint32_t kvs_inv_missing(const struct kvs_inv *inv, int g, const uint64_t *h, uint32_t n) {
    uint32_t missing = 0;
    for (uint32_t m = 0; m < n; m++) missing += lookup(&inv->g[g], h[m]) == NULL;
    return missing;
}

void kvs_inv_pin(struct kvs_inv *inv, int g, const uint64_t *h, uint32_t n, int delta) {
    for (uint32_t m = 0; m < n; m++) {
        struct kvs_inv_slot *s = lookup(&inv->g[g], h[m]);
        if (s) s->leases = (uint32_t)((int64_t)s->leases + delta);
    }
}

void kvs_inv_free(struct kvs_inv *inv) {
    for (int k = 0; k < inv->ng; k++) {
        free(inv->g[k].name);
        free(inv->g[k].t);
    }
    free(inv->g);
    *inv = (struct kvs_inv){0};
}

static int by_value(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

const char *kvs_inv_want_read(const struct kvs_inv *inv, const struct kj_field *blocks, struct kvs_inv_want *w,
                              char *detail, size_t cap) {
    *w = (struct kvs_inv_want){-1, 0, NULL};
    if (!inv->on) {
        snprintf(detail, cap, "this exporter keeps no retained inventory");
        return "no_inventory";
    }
    struct kj_obj q;
    const struct kj_field *group = NULL, *epoch = NULL, *hashes = NULL;
    if (blocks->type == KJ_OBJ && kj_object(blocks->s, blocks->slen, &q) == 0) {
        group = kj_get(&q, "group");
        epoch = kj_get(&q, "epoch");
        hashes = kj_get(&q, "hashes");
    }
    if (!group || !epoch || !hashes) {
        snprintf(detail, cap, "blocks: must be an object of group, epoch and hashes");
        return "bad_request";
    }
    if (group->type != KJ_STR || group->slen == 0) {
        snprintf(detail, cap, "blocks: group must be a non-empty string, got <%s>", kj_type_name(group->type));
        return "bad_request";
    }
    uint32_t n = 0;
    int rc = hashes->type == KJ_LIST ? kj_u64s(hashes->s, hashes->slen, NULL, 0, &n) : -1;
    if (rc != 0 || n == 0) {
        snprintf(detail, cap, "blocks: hashes must be a non-empty list of unsigned 64-bit integers");
        return "bad_request";
    }
    if (epoch->type != KJ_INT || (epoch->big ? epoch->s[0] == '-' : epoch->i < 0)) {
        snprintf(detail, cap, "blocks: epoch must be a non-negative integer, got <%s>", kj_type_name(epoch->type));
        return "bad_request";
    }
    uint64_t *h = malloc((size_t)n * sizeof *h), *sorted = malloc((size_t)n * sizeof *h);
    if (!h || !sorted) {
        free(h);
        free(sorted);
        snprintf(detail, cap, "no memory for %u block hashes", n);
        return "nomem";
    }
    kj_u64s(hashes->s, hashes->slen, h, n, &n);
    memcpy(sorted, h, (size_t)n * sizeof *h);
    qsort(sorted, n, sizeof *sorted, by_value);
    int repeated = 0;
    for (uint32_t k = 1; k < n && !repeated; k++) repeated = sorted[k] == sorted[k - 1];
    free(sorted);
    if (repeated) {
        free(h);
        snprintf(detail, cap, "blocks: repeated block hash in one request");
        return "bad_request";
    }
    int g = kvs_inv_find(inv, group->s, group->slen);
    uint32_t missing = g < 0 ? 0 : kvs_inv_missing(inv, g, h, n);
    if (g < 0 || epoch->big || epoch->i != inv->g[g].epoch || missing) {
        free(h);
        const char *why = g < 0 ? "unknown_group" : missing && !(epoch->big || epoch->i != inv->g[g].epoch)
                                                        ? "missing_blocks" : "epoch";
        if (g < 0) snprintf(detail, cap, "%s (epoch None, 0 block(s) gone): recompute", why);
        else snprintf(detail, cap, "%s (epoch %lld, %u block(s) gone): recompute", why,
                      (long long)inv->g[g].epoch, why[0] == 'm' ? missing : 0);
        return "stale_inventory";
    }
    *w = (struct kvs_inv_want){g, n, h};
    return NULL;
}
