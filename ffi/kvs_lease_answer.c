/* The lease server's answers (kvs.h, "the exporter's lease server").
 *
 * Every request of an importer, from the native thread (kvs_lease_thread.c, with
 * kvs_lease_tcp.c for TCP), goes through kvs_lease_handle. It answers as the Python
 * exporter did (the reference kept in tests/support/lease_reference.py): `lease`,
 * `leases` (a batch, all or nothing, also naming retained inventory blocks), `renew`,
 * `release`, `mapped` (single or batch, never answered), with the same refusal codes.
 * Each change of a bank's state is a kvs_lease_fire_one (kvs_lease.c), which fires the
 * generated bank table; nothing here decides a transition itself, and nothing takes the
 * GIL.
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvs_bank_table.h"
#include "kvs_lease.h"

/* -- answers ----------------------------------------------------------------------- */

struct out {
    char *p;
    uint32_t cap, n;
    int over;
    int32_t *fds;
    int32_t fdcap, nfds;
};

static void put(struct out *o, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(o->p + o->n, o->n < o->cap ? o->cap - o->n : 0, fmt, ap);
    va_end(ap);
    if (w < 0 || (uint32_t)w >= (o->n < o->cap ? o->cap - o->n : 0)) o->over = 1;
    else o->n += (uint32_t)w;
}

/* A JSON string of `s` (`n` bytes; n < 0: up to its NUL), escaped as json.dumps does for ASCII. */
static void put_str(struct out *o, const char *s, int n) {
    put(o, "\"");
    for (int k = 0; n < 0 ? s[k] != 0 : k < n; k++) {
        unsigned char ch = (unsigned char)s[k];
        if (ch == '"' || ch == '\\') put(o, "\\%c", ch);
        else if (ch < 0x20 || ch >= 0x7f) put(o, "\\u%04x", ch);
        else put(o, "%c", ch);
    }
    put(o, "\"");
}

/* {"code":..,"detail":..,"ok":false[,"rank":r]}: keys sorted, as framing.encode writes them. */
static void refuse(struct out *o, const char *code, int64_t rank, int with_rank, const char *fmt, ...) {
    char detail[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    o->n = 0;
    o->nfds = 0;
    put(o, "{\"code\":");
    put_str(o, code, -1);
    put(o, ",\"detail\":");
    put_str(o, detail, -1);
    put(o, ",\"ok\":false");
    if (with_rank) put(o, ",\"rank\":%lld", (long long)rank);
    put(o, "}");
}

static double seconds_left(int64_t expires_ns) {
    int64_t left = expires_ns - kvs_lease_now();
    return left > 0 ? (double)left / 1e9 : 0.0; /* importers refuse a negative term */
}

static int field_is(const struct kj_field *f, const char *s) {
    return f && f->type == KJ_STR && f->slen == strlen(s) && memcmp(f->s, s, f->slen) == 0;
}

/* What Python's repr() shows of a field in a refusal ('x', 3, None). */
static const char *shown(const struct kj_field *f, char *buf, size_t cap) {
    if (!f) return "None";
    if (f->type == KJ_STR) snprintf(buf, cap, "'%.*s'", (int)(f->slen > 60 ? 60 : f->slen), f->s);
    else if (f->type == KJ_INT && !f->big) snprintf(buf, cap, "%lld", (long long)f->i);
    else snprintf(buf, cap, "<%s>", kj_type_name(f->type));
    return buf;
}

/* The words of Python's TransitionError for a refused fire (kvstate.core.errors). */
static const char *refusal_text(char *buf, size_t cap, int rc, int32_t event, const kvs_fire_result *out) {
    const char *ev = kvs_bank_event_names[event], *st = kvs_bank_state_names[out->source];
    if (rc == KVS_E_ILLEGAL) {
        snprintf(buf, cap, "bank: event '%s' is not declared in state '%s'", ev, st);
    } else if (rc == KVS_E_GUARD) {
        int n = snprintf(buf, cap, "bank: event '%s' in state '%s' refused by guard(s) ", ev, st);
        for (int k = 0; k < out->nrefused && n > 0 && (size_t)n < cap; k++) {
            int g = out->refused[k];
            n += snprintf(buf + n, cap - (size_t)n, "%s%s%s", k ? ", " : "", g < 0 ? "not " : "",
                          kvs_bank_guard_names[g < 0 ? -1 - g : g]);
        }
    } else {
        snprintf(buf, cap, "bank: event '%s' in state '%s' failed (%d)", ev, st, rc);
    }
    return buf;
}

static const char *const request_fields[] = {"op", "rank", "lease", "generation", "incarnation"};
static const int request_types[] = {KJ_STR, KJ_INT, KJ_INT, KJ_INT, KJ_STR};

/* The FRAME refusal of a scalar field of the wrong type, or 0. `op` is given separately
 * for batch items (they carry none of their own). */
static int mistyped(struct out *o, const struct kj_obj *q) {
    for (int k = 0; k < 5; k++) {
        const struct kj_field *f = kj_get(q, request_fields[k]);
        if (f && f->type != request_types[k]) {
            refuse(o, "frame", 0, 0, "request field '%s' must be %s, not %s", request_fields[k],
                   kj_type_name(request_types[k]), kj_type_name(f->type));
            return 1;
        }
    }
    return 0;
}

/* A rank, lease or generation value: an int beyond int64 matches nothing. */
static int64_t int_or(const struct kj_field *f, int64_t none) {
    return f && f->type == KJ_INT && !f->big ? f->i : none;
}

/* One request (`op` given, the rest in `q`), as Python's Exporter._handle. Returns 0 with
 * the answer in `o`, or 1 when a grant was made (its id in *granted). A grant pins the
 * inventory blocks of `w` (if any), and its lease owns them from then on (w->h is NULL). */
static int handle_one(struct kvs_lease_server *s, uint64_t conn, int pid, const char *op, const struct kj_obj *q,
                      struct out *o, int64_t *granted, struct kvs_inv_want *w) {
    char buf[96];
    if (mistyped(o, q)) return 0;
    const struct kj_field *frank = kj_get(q, "rank");
    int64_t rank = int_or(frank, -1);
    struct kvs_bank *b = kvs_lease_bank_of(s, rank);
    if (!b) {
        refuse(o, "unknown_rank", 0, 0, "no bank for rank %s", shown(frank, buf, sizeof buf));
        return 0;
    }
    kvs_fire_result out;
    if (strcmp(op, "lease") == 0) {
        const struct kj_field *inc = kj_get(q, "incarnation");
        if (!field_is(inc, b->incarnation)) {
            refuse(o, "stale_incarnation", 0, 0, "this exporter restarted since that descriptor");
            return 0;
        }
        const struct kj_field *gen = kj_get(q, "generation");
        if (!gen || gen->big || gen->i != b->generation) {
            refuse(o, "stale_generation", 0, 0, "current generation is %lld", (long long)b->generation);
            return 0;
        }
        struct fx_ctx c = {.s = s, .b = b, .lease = s->next_lease++, .conn = conn, .pid = pid,
                           .want = w ? *w : (struct kvs_inv_want){-1, 0, NULL}};
        int rc = kvs_lease_fire_one(s, (int32_t)rank, KVS_BANK_EV_GRANT_LEASE, &c, KVS_LWHY_NONE, &out);
        if (rc == KVS_OK && w) w->h = NULL;
        if (rc == KVS_E_GUARD || rc == KVS_E_ILLEGAL) {
            char why[256];
            refuse(o, "not_leasing", 0, 0, "%s", refusal_text(why, sizeof why, rc, KVS_BANK_EV_GRANT_LEASE, &out));
            return 0;
        }
        if (rc != KVS_OK) {
            refuse(o, "effect", 0, 0, "bank: effect grant_lease failed (%d)", out.error);
            return 0;
        }
        struct kvs_lease *l = kvs_lease_find(b, c.lease);
        o->n = 0;
        put(o, "{\"bank\":%s,\"expires_in_s\":%.9f,\"lease\":%lld,\"ok\":true}", b->report ? b->report : "null",
            seconds_left(l->expires_ns), (long long)c.lease);
        o->nfds = 0;
        if (b->fd >= 0 && o->fdcap > 0) o->fds[o->nfds++] = b->fd; /* FABRIC and CUDA_IPC carry bytes only */
        *granted = c.lease;
        return 1;
    }
    const struct kj_field *flease = kj_get(q, "lease");
    int64_t id = int_or(flease, -1);
    struct kvs_lease *held = kvs_lease_find(b, id);
    int hold = kvs_lease_find_hold(b, id);
    o->n = 0;
    o->nfds = 0;
    if (!held && strcmp(op, "release") == 0 && hold >= 0 && b->holds[hold].conn == conn) {
        kvs_lease_drop_hold(b, hold); /* an expired lease's importer closed the bank after all */
        put(o, "{\"ok\":true}");
        return 0;
    }
    if (!held || held->conn != conn) {
        refuse(o, "unknown_lease", 0, 0, "no live lease %s on this connection", shown(flease, buf, sizeof buf));
        return 0;
    }
    if (strcmp(op, "block_epochs") == 0) { /* the page a lease holder's loads check (kvstate.share.epochs) */
        const struct kvs_conn *cn = kvs_lease_conn(s, conn);
        if (b->epoch_fd < 0 || o->fdcap < 1 || !cn || cn->tcp) { /* no fds across nodes */
            refuse(o, "no_epochs", 0, 0, "no epoch page for rank %lld on this connection", (long long)rank);
            return 0;
        }
        put(o, "{\"blocks\":%lld,\"entry_bytes\":8,\"ok\":true}", (long long)b->epoch_blocks);
        o->fds[o->nfds++] = b->epoch_fd;
        return 0;
    }
    struct fx_ctx c = {.s = s, .b = b, .lease = id, .conn = conn};
    if (strcmp(op, "mapped") == 0) {
        int rc = kvs_lease_fire_one(s, (int32_t)rank, KVS_BANK_EV_LEASE_MAPPED, &c, KVS_LWHY_NONE, &out);
        char why[256];
        if (rc != KVS_OK) refuse(o, rc == KVS_E_ILLEGAL ? "illegal" : "guard", 0, 0, "%s",
                                 refusal_text(why, sizeof why, rc, KVS_BANK_EV_LEASE_MAPPED, &out));
        else put(o, "{\"ok\":true}");
        return 0;
    }
    if (strcmp(op, "release") == 0) {
        int rc = kvs_lease_fire_one(s, (int32_t)rank, KVS_BANK_EV_RELEASE_LEASE, &c, KVS_LWHY_NONE, &out);
        char why[256];
        if (rc != KVS_OK) refuse(o, rc == KVS_E_ILLEGAL ? "illegal" : "guard", 0, 0, "%s",
                                 refusal_text(why, sizeof why, rc, KVS_BANK_EV_RELEASE_LEASE, &out));
        else put(o, "{\"ok\":true}");
        return 0;
    }
    if (strcmp(op, "renew") == 0) {
        int expired = held->expired;
        int rc = kvs_lease_fire_one(s, (int32_t)rank, KVS_BANK_EV_RENEW_LEASE, &c, KVS_LWHY_NONE, &out);
        if (rc == KVS_E_GUARD || rc == KVS_E_ILLEGAL) { /* expired, or the bank drains: unmap and return it */
            char why[256];
            refuse(o, "not_renewing", 0, 0, "%s: %s", expired ? "expired" : kvs_bank_state_names[out.source],
                   refusal_text(why, sizeof why, rc, KVS_BANK_EV_RENEW_LEASE, &out));
            return 0;
        }
        if (rc != KVS_OK) {
            refuse(o, "effect", 0, 0, "bank: effect renew_lease failed (%d)", out.error);
            return 0;
        }
        /* the bank's generation too: an importer holding a parked lease adopts it only for a
         * descriptor of that generation or newer (kvstate.share.parked) */
        put(o, "{\"expires_in_s\":%.9f,\"generation\":%lld,\"ok\":true}",
            seconds_left(kvs_lease_find(b, id)->expires_ns), (long long)b->generation);
        return 0;
    }
    refuse(o, "bad_request", 0, 0, "unknown op %.80s", op);
    return 0;
}

static void return_granted(struct kvs_lease_server *s, uint64_t conn, const int64_t *ranks, const int64_t *ids,
                           int n) {
    for (int k = 0; k < n; k++) {
        struct kvs_bank *b = &s->banks[ranks[k]];
        struct fx_ctx c = {.s = s, .b = b, .lease = ids[k], .conn = conn};
        kvs_fire_result out;
        kvs_lease_fire_one(s, (int32_t)ranks[k], KVS_BANK_EV_RELEASE_LEASE, &c, KVS_LWHY_NONE, &out);
    }
}

/* Whether the answer in `o` is one Python raised (a malformed field, a refused or failed
 * fire) rather than returned: its loops over items stopped there. */
static int raised(const struct out *o) {
    static const char *const codes[] = {"{\"code\":\"frame\"", "{\"code\":\"illegal\"",
                                        "{\"code\":\"guard\"", "{\"code\":\"effect\""};
    for (int k = 0; k < 4; k++)
        if (o->n >= strlen(codes[k]) && strncmp(o->p, codes[k], strlen(codes[k])) == 0) return 1;
    return 0;
}

/* `leases`: every item as a single lease; all or nothing; fds in item order. `w`: the
 * inventory blocks of each item (NULL: none), read before; then the top's other fields
 * do not count (Python served such a batch with only op and items). */
static void handle_batch(struct kvs_lease_server *s, uint64_t conn, int pid, const struct kj_req *r, struct out *o,
                         struct kvs_inv_want *w) {
    int n = r->nitems, ok = (w || r->top.n == 2) && kj_get(&r->top, "items") && n >= 1 && n <= s->nbanks;
    for (int k = 0; ok && k < n; k++) ok = r->items[k].is_obj && !kj_get(&r->items[k], "op");
    if (!ok) {
        refuse(o, "frame", 0, 0, "leases: items must be 1..%d lease requests (objects without 'op')", s->nbanks);
        return;
    }
    int64_t ranks[KJ_MAXITEMS], ids[KJ_MAXITEMS];
    for (int k = 0; k < n; k++) {
        const struct kj_field *f = kj_get(&r->items[k], "rank");
        ok = ok && f && f->type == KJ_INT;
        ranks[k] = int_or(f, -1 - k); /* a big int: distinct from every other rank */
        for (int j = 0; ok && j < k; j++) ok = !(ranks[j] == ranks[k] && !f->big);
    }
    if (!ok) {
        refuse(o, "frame", 0, 0, "leases: every item names a different int rank");
        return;
    }
    char *answers = malloc(o->cap);
    if (!answers) {
        refuse(o, "nomem", 0, 0, "no memory for the answer");
        return;
    }
    struct out all = {answers, o->cap, 0, 0, o->fds, o->fdcap, 0};
    put(&all, "{\"grants\":[");
    int granted = 0;
    for (int k = 0; k < n; k++) {
        int32_t fd1[1];
        struct out one = {o->p, o->cap, 0, 0, fd1, 1, 0};
        int64_t id = 0;
        if (!handle_one(s, conn, pid, "lease", &r->items[k], &one, &id, w ? &w[k] : NULL)) {
            return_granted(s, conn, ranks, ids, granted);
            /* the refusal, with the rank that was refused (a malformed item is the frame's) */
            if (!raised(&one) && one.n && o->p[one.n - 1] == '}') {
                one.n--;
                put(&one, ",\"rank\":%lld}", (long long)ranks[k]);
            }
            o->n = one.n;
            o->over = one.over;
            o->nfds = 0;
            free(answers);
            return;
        }
        ids[granted++] = id;
        /* the single answer with "nfds" added, keys still sorted: insert before "ok" */
        char *okp = strstr(o->p, ",\"ok\":true}");
        if (!okp) { all.over = 1; break; }
        put(&all, "%s%.*s,\"nfds\":%d,\"ok\":true}", k ? "," : "", (int)(okp - o->p), o->p, one.nfds);
        for (int j = 0; j < one.nfds; j++) {
            if (all.nfds < all.fdcap) all.fds[all.nfds++] = fd1[j];
            else all.over = 1;
        }
    }
    put(&all, "],\"ok\":true}");
    if (all.over) { /* too big to answer: nothing stays granted */
        return_granted(s, conn, ranks, ids, granted);
        refuse(o, "frame", 0, 0, "leases: the answer exceeds the payload or fd cap");
    } else {
        memcpy(o->p, answers, all.n);
        o->n = all.n;
        o->nfds = all.nfds;
    }
    free(answers);
}

/* `mapped` with items: each as a single `mapped`; nothing answered. */
static void handle_mapped(struct kvs_lease_server *s, uint64_t conn, int pid, const struct kj_req *r, struct out *o) {
    int n = r->nitems, ok = r->top.n == 2 && kj_get(&r->top, "items") && n >= 0 && n <= s->nbanks;
    for (int k = 0; ok && k < n; k++)
        ok = r->items[k].is_obj && r->items[k].n == 2 && kj_get(&r->items[k], "rank") && kj_get(&r->items[k], "lease");
    if (!ok) return;
    for (int k = 0; k < n; k++) {
        int64_t id = 0;
        handle_one(s, conn, pid, "mapped", &r->items[k], o, &id, NULL);
        if (raised(o)) return; /* Python's loop ended at the first item that raised */
    }
}

/* The refusal of reading a request's inventory blocks; with the item's rank (its JSON
 * text, null when absent) for a batch, as Python added it. */
static void refuse_blocks(struct out *o, const char *code, const char *detail, const struct kj_obj *item) {
    refuse(o, code, 0, 0, "%s", detail);
    if (!item || !o->n) return;
    const struct kj_field *rank = kj_get(item, "rank");
    o->n--; /* the closing brace */
    if (!rank) put(o, ",\"rank\":null}");
    else if (rank->type == KJ_STR) put(o, ",\"rank\":\"%.*s\"}", (int)rank->slen, rank->s);
    else put(o, ",\"rank\":%.*s}", (int)rank->slen, rank->s);
}

/* `lease` naming inventory blocks: re-validate them, then grant (which pins them). */
static void lease_with_blocks(struct kvs_lease_server *s, uint64_t conn, int pid, const struct kj_obj *q,
                              struct out *o) {
    char detail[256];
    struct kvs_inv_want w;
    const char *code = kvs_inv_want_read(&s->inv, kj_get(q, "blocks"), &w, detail, sizeof detail);
    if (code) {
        refuse_blocks(o, code, detail, NULL);
        return;
    }
    int64_t id = 0;
    handle_one(s, conn, pid, "lease", q, o, &id, &w);
    free(w.h); /* NULL once granted: the lease owns them */
}

/* `leases` where an item names inventory blocks: every item's blocks are re-validated
 * first (the first refusal answers, with its rank), then the batch is granted as one. */
static void leases_with_blocks(struct kvs_lease_server *s, uint64_t conn, int pid, const struct kj_req *r,
                               struct out *o) {
    for (int k = 0; k < r->nitems; k++)
        if (!r->items[k].is_obj) {
            refuse(o, "frame", 0, 0, "leases: items must be lease requests");
            return;
        }
    struct kvs_inv_want *w = calloc((size_t)(r->nitems ? r->nitems : 1), sizeof *w);
    if (!w) {
        refuse(o, "nomem", 0, 0, "no memory for the request");
        return;
    }
    int k = 0;
    for (; k < r->nitems; k++) {
        const struct kj_field *bl = kj_get(&r->items[k], "blocks");
        w[k] = (struct kvs_inv_want){-1, 0, NULL};
        if (!bl || bl->type == KJ_NULL) continue;
        char detail[256];
        const char *code = kvs_inv_want_read(&s->inv, bl, &w[k], detail, sizeof detail);
        if (code) {
            refuse_blocks(o, code, detail, &r->items[k]);
            break;
        }
    }
    if (k == r->nitems) handle_batch(s, conn, pid, r, o, w);
    for (int j = 0; j < r->nitems; j++) free(w[j].h);
    free(w);
}

int kvs_lease_handle(kvs_lease_server *s, uint64_t conn, const char *payload, uint32_t len, char *reply,
                     uint32_t cap, uint32_t *reply_len, int32_t *fds, int32_t fdcap, int32_t *nfds,
                     int32_t *answer) {
    if (!s || (!payload && len) || !reply || cap < 256 || !reply_len || (fdcap && !fds) || !nfds || !answer)
        return KVS_E_INVAL;
    struct out o = {reply, cap, 0, 0, fds, fdcap, 0};
    *answer = 1;
    pthread_mutex_lock(&s->mu);
    struct kvs_conn *cn = kvs_lease_conn(s, conn);
    int rc = KVS_OK, pid = cn ? cn->pid : 0;
    struct kj_req *r = &s->req;
    if (!cn) {
        rc = KVS_E_NOENT;
    } else if (kj_parse(payload, len, r) < 0) {
        refuse(&o, "frame", 0, 0, "malformed message");
    } else {
        const struct kj_field *op = kj_get(&r->top, "op");
        const struct kj_field *items = kj_get(&r->top, "items");
        int blocks = 0; /* a lease naming inventory blocks: they are re-validated and pinned first */
        const struct kj_field *bl = kj_get(&r->top, "blocks");
        blocks = bl && bl->type != KJ_NULL;
        for (int k = 0; k < r->nitems && !blocks; k++) {
            bl = r->items[k].is_obj ? kj_get(&r->items[k], "blocks") : NULL;
            blocks = bl && bl->type != KJ_NULL;
        }
        char opname[81];
        if (op && op->type == KJ_STR) snprintf(opname, sizeof opname, "%.*s", (int)op->slen, op->s);
        s->lease_requests += field_is(op, "lease") || field_is(op, "leases");
        if (field_is(op, "status") && r->top.n == 1) {
            rc = KVS_LEASE_PYTHON;
        } else if (field_is(op, "leases")) {
            if (blocks && r->nitems >= 0) leases_with_blocks(s, conn, pid, r, &o);
            else handle_batch(s, conn, pid, r, &o, NULL);
        } else if (field_is(op, "mapped") && items) {
            *answer = 0;
            handle_mapped(s, conn, pid, r, &o);
        } else if (field_is(op, "lease") && blocks) {
            if (!mistyped(&o, &r->top)) lease_with_blocks(s, conn, pid, &r->top, &o);
        } else {
            int64_t id = 0;
            *answer = !field_is(op, "mapped"); /* a notification: the importer waits for no answer */
            if (!mistyped(&o, &r->top)) {
                if (op) {
                    char q[96];
                    snprintf(q, sizeof q, "'%s'", opname);
                    if (strcmp(opname, "lease") && strcmp(opname, "renew") && strcmp(opname, "release") &&
                        strcmp(opname, "mapped") && strcmp(opname, "block_epochs")) {
                        /* handle_one refuses it after the rank and lease checks, as Python did */
                        handle_one(s, conn, pid, q, &r->top, &o, &id, NULL);
                    } else {
                        handle_one(s, conn, pid, opname, &r->top, &o, &id, NULL);
                    }
                } else {
                    handle_one(s, conn, pid, "None", &r->top, &o, &id, NULL);
                }
            }
        }
    }
    pthread_mutex_unlock(&s->mu);
    if (rc == KVS_OK && o.over) {
        o.n = 0;
        o.nfds = 0;
        refuse(&o, "frame", 0, 0, "the answer exceeds the cap of %u bytes", cap);
    }
    *reply_len = o.n;
    *nfds = o.nfds;
    if (rc != KVS_OK) *answer = 0;
    return rc;
}
