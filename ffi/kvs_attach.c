/* The importer's native attach (kvs.h, "native attach"): phase 2 of a group import on the
 * host backend for one exporter batch, in one call that never touches Python.
 *
 * No transition is decided here: each part fires `open` through kvs_machine_fire() on the
 * generated part table, and only the effects are written here, as the table names them:
 * native_import (fd checks, adopt, reserve, map, set_access) and, for the rollback of the
 * parts opened before a failure, unmap_close (its native half; the lease is the caller's).
 * Each effect undoes its own partial work before it reports a failure, so a part that
 * fails leaves nothing, and the batch is all or nothing.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/stat.h>

#include "kvs.h"
#include "kvs_machines.h"
#include "kvs_part_table.h"

struct attach_ctx {
    kvs_attach_part *p;
    uint64_t align;
    int32_t access;
};

/* Record the failing step of `p` (errno as the failing call left it) and return its code. */
static int32_t failed_at(kvs_attach_part *p, int32_t step, int32_t code) {
    p->err = code == KVS_E_SYS ? errno : 0;
    p->step = step;
    p->code = code;
    return code;
}

/* Undo what the part holds, newest first; each id is cleared only once its object is gone,
 * so what could not be undone stays named for the caller. */
static int32_t undo_part(kvs_attach_part *p) {
    int32_t rc = KVS_OK;
    if (p->region && (rc = kvs_unmap(p->region)) == KVS_OK) p->region = p->addr = 0;
    if (!p->region && p->reservation && (rc = kvs_free_reservation(p->reservation)) == KVS_OK)
        p->reservation = 0;
    if (!p->region && p->allocation && (rc = kvs_release(p->allocation)) == KVS_OK) p->allocation = 0;
    return p->region || p->reservation || p->allocation ? (rc ? rc : KVS_E_BUSY) : KVS_OK;
}

static int32_t native_import(kvs_attach_part *p, uint64_t align, int32_t access) {
    struct stat st;
    int rc;
    if (fstat(p->fd, &st) != 0) return failed_at(p, KVS_ATTACH_IDENTITY, KVS_E_SYS);
    if ((uint64_t)st.st_dev != p->dev || (uint64_t)st.st_ino != p->ino)
        return failed_at(p, KVS_ATTACH_IDENTITY, KVS_E_IDENTITY);
    if ((rc = kvs_import_fd(p->fd, p->size, &p->allocation)) != KVS_OK) {
        p->allocation = 0;
        return failed_at(p, KVS_ATTACH_IMPORT, rc);
    }
    int32_t step = KVS_ATTACH_RESERVE;
    if ((rc = kvs_reserve(p->size, align, &p->reservation, &p->addr)) != KVS_OK) {
        p->reservation = p->addr = 0;
    } else if (step = KVS_ATTACH_MAP, (rc = kvs_map(p->reservation, 0, p->allocation, &p->region, &p->addr)) != KVS_OK) {
        p->region = 0;
    } else if (step = KVS_ATTACH_ACCESS, (rc = kvs_set_access(p->region, access)) != KVS_OK) {
        /* rolled back below */
    } else {
        return KVS_OK;
    }
    failed_at(p, step, rc);
    int e = errno;
    if (undo_part(p) != KVS_OK) p->left = 1;
    errno = e;
    return rc;
}

static int32_t attach_effect(void *ctx, int32_t effect, int32_t undo) {
    struct attach_ctx *c = ctx;
    switch (effect) {
    case KVS_PART_FX_NATIVE_IMPORT:
        return undo ? undo_part(c->p) : native_import(c->p, c->align, c->access);
    case KVS_PART_FX_UNMAP_CLOSE:
        return undo ? KVS_E_ILLEGAL : undo_part(c->p); /* the lease is returned by the caller */
    default:
        return KVS_E_ILLEGAL; /* leasing and returning leases are the caller's, not this call's */
    }
}

/* Guard bits of the rollback's `close` of an opened part: the batch's owner is releasing
 * it, and the native layer reports whether anything pins the mapping. */
static uint64_t close_holds(const kvs_attach_part *p) {
    uint64_t holds = 0;
    holds |= 1ull << KVS_PART_G_GROUP_RELEASING;
    kvs_region_info info;
    if (kvs_region_info_get(p->region, &info) == KVS_OK && info.pins == 0)
        holds |= 1ull << KVS_PART_G_PART_UNPINNED;
    return holds;
}

/* Roll back parts[0..k): each fires `close` (imported -> closed, unmap_close). The caller's
 * Python machines never saw them open, so each is reported in the state it started in. */
static void roll_back(kvs_attach_part *parts, int32_t k, const int32_t *start) {
    for (int32_t i = k - 1; i >= 0; i--) {
        kvs_attach_part *p = &parts[i];
        kvs_machine_inst m;
        kvs_machine_init(&m, KVS_MACHINE_PART);
        m.state = p->state;
        struct attach_ctx c = {p, 0, 0};
        if (kvs_machine_fire(&m, KVS_PART_EV_CLOSE, close_holds(p), attach_effect, &c, NULL) != KVS_OK &&
            undo_part(p) != KVS_OK) /* refused (pinned): what can go, goes; the rest stays named */
            p->left = 1;
        p->state = start[i];
    }
}

int kvs_attach(kvs_attach_part *parts, int32_t n, uint64_t align, int32_t access, int32_t *failed) {
    if (!parts || !failed || n <= 0 || n > KVS_ATTACH_MAX_PARTS) return KVS_E_INVAL;
    int32_t start[KVS_ATTACH_MAX_PARTS];
    *failed = -1;
    for (int32_t i = 0; i < n; i++) { /* nothing is touched before every part is well formed */
        kvs_attach_part *p = &parts[i];
        if (p->fd < 0 || p->state < 0 || p->state >= KVS_PART_NSTATES) {
            *failed = i;
            return KVS_E_INVAL;
        }
        start[i] = p->state;
        p->allocation = p->reservation = p->region = p->addr = 0;
        p->step = -1;
        p->code = p->err = p->nrefused = p->left = 0;
    }
    for (int32_t i = 0; i < n; i++) {
        kvs_attach_part *p = &parts[i];
        kvs_machine_inst m;
        kvs_machine_init(&m, KVS_MACHINE_PART);
        m.state = p->state;
        struct attach_ctx c = {p, align, access};
        kvs_fire_result out;
        int rc = kvs_machine_fire(&m, KVS_PART_EV_OPEN, p->holds, attach_effect, &c, &out);
        if (rc == KVS_OK) {
            p->state = m.state;
            continue;
        }
        if (rc == KVS_E_EFFECT) {
            rc = p->code; /* the effect recorded its step, code and errno */
        } else {
            p->step = KVS_ATTACH_ROW;
            p->code = rc;
            p->nrefused = out.nrefused;
            memcpy(p->refused, out.refused, sizeof p->refused);
        }
        int e = errno;
        roll_back(parts, i, start);
        errno = e;
        *failed = i;
        return rc;
    }
    return KVS_OK;
}
