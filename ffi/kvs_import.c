/* The importer's native phase 1 (kvs.h, "native import"): one exporter batch of a group
 * import on the host backend, leased, checked, registered for renewal and, when the batch
 * is the whole group, attached, in one call that never touches Python.
 *
 * No transition is decided here: each part fires `lease` (and then `open`) through
 * kvs_machine_fire() on the generated part table; only the effects are written here
 * (native_lease: the exporter's report and the fd checks, the renewal registration;
 * return_lease: its native half, the registration) and in kvs_attach.c (native_import).
 *
 * What this call accepts is a subset of what the Python reference (kvstate.share.peers
 * grants, Part._lease) accepts: any answer it does not take whole (a refusal, a malformed
 * or unexpected answer, a mismatched report, a bad fd, a failed registration) is handed
 * back untouched with KVS_IMPORT_DEFER, every registration undone, and Python's reference
 * path decides it with its own typed errors, returning the leases. So the two paths agree
 * on every refusal by construction; the differential tests hold them to it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvs.h"
#include "kvs_json.h"
#include "kvs_machines.h"
#include "kvs_part_table.h"

#define SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

struct lease_ctx {
    kvs_import_part *p;
    kvs_link *l;
    const struct kj_obj *grant;
    kvs_renewer *r;
    int64_t renewed_at_ns;
};

/* An int field equal to `want` (an int beyond int64 equals nothing). */
static int int_is(const struct kj_obj *o, const char *key, int64_t want) {
    const struct kj_field *f = kj_get(o, key);
    return f && f->type == KJ_INT && !f->big && f->i == want;
}

static int str_is(const struct kj_obj *o, const char *key, const char *want) {
    const struct kj_field *f = kj_get(o, key);
    size_t n = strlen(want);
    return f && f->type == KJ_STR && f->slen == n && memcmp(f->s, want, n) == 0;
}

/* The grant's seconds to expiry in ns: 0 <= x < 1e9 s, as Python's _grant requires. */
static int expires_ns(const struct kj_obj *o, int64_t *out) {
    const struct kj_field *f = kj_get(o, "expires_in_s");
    char text[64];
    if (!f || (f->type != KJ_INT && f->type != KJ_FLOAT) || f->big || f->slen == 0 || f->slen >= sizeof text)
        return 0;
    double x;
    if (f->type == KJ_INT) {
        x = (double)f->i;
    } else {
        memcpy(text, f->s, f->slen);
        text[f->slen] = 0;
        char *end;
        x = strtod(text, &end);
        if (*end) return 0;
    }
    if (!isfinite(x) || x < 0 || x >= 1e9) return 0;
    *out = (int64_t)(x * 1e9);
    return 1;
}

/* What the exporter reports about the bank it leased, against the descriptor (Python's
 * _check_report): absent or null says nothing; otherwise every named field matches. */
static int report_matches(const struct kj_obj *grant, const kvs_import_part *p) {
    const struct kj_field *f = kj_get(grant, "bank");
    if (!f || f->type == KJ_NULL) return 1;
    struct kj_obj bank;
    if (f->type != KJ_OBJ || kj_object(f->s, f->slen, &bank) != 0) return 0;
    return int_is(&bank, "rank", p->rank) && int_is(&bank, "generation", p->generation) &&
           int_is(&bank, "num_blocks", p->num_blocks) && int_is(&bank, "size", (int64_t)p->attach.size) &&
           str_is(&bank, "incarnation", p->incarnation) && str_is(&bank, "geometry", p->geometry) &&
           str_is(&bank, "device_uuid", p->device_uuid);
}

/* Phase 1's fd checks (HostTransport.receive_handle): the file the descriptor names, a
 * memfd sealed against shrinking, growing and resealing. */
static int fd_checks(const kvs_import_part *p) {
    struct stat st;
    if (fstat(p->attach.fd, &st) != 0) return 0;
    if ((uint64_t)st.st_dev != p->attach.dev || (uint64_t)st.st_ino != p->attach.ino) return 0;
    int seals = fcntl(p->attach.fd, F_GET_SEALS);
    return seals >= 0 && (seals & SEALS) == SEALS;
}

static int32_t native_lease(struct lease_ctx *c) {
    kvs_import_part *p = c->p;
    if (!report_matches(c->grant, p)) return p->why = KVS_IMPORT_WHY_REPORT, KVS_E_INVAL;
    if (!fd_checks(p)) return p->why = KVS_IMPORT_WHY_FD, KVS_E_INVAL;
    if (p->renew_key && c->r) {
        int rc = kvs_renewer_add(c->r, c->l, p->renew_key, (uint32_t)p->rank, p->lease, p->expires_ns,
                                 c->renewed_at_ns);
        if (rc != KVS_OK) return p->why = KVS_IMPORT_WHY_RENEWAL, rc;
        p->registered = 1;
    }
    return KVS_OK;
}

/* The native half of returning a lease: no renewal after this (the lease itself goes back
 * on Python's reference path, which takes the answer over). */
static int32_t return_lease(struct lease_ctx *c) {
    if (c->p->registered && c->r && kvs_renewer_remove(c->r, c->p->renew_key) == KVS_OK) c->p->registered = 0;
    return KVS_OK;
}

static int32_t lease_effect(void *ctx, int32_t effect, int32_t undo) {
    struct lease_ctx *c = ctx;
    switch (effect) {
    case KVS_PART_FX_NATIVE_LEASE:
        return undo ? return_lease(c) : native_lease(c);
    case KVS_PART_FX_RETURN_LEASE:
        return undo ? KVS_E_ILLEGAL : return_lease(c);
    default:
        return KVS_E_ILLEGAL; /* opening is kvs_attach's */
    }
}

/* Split the JSON array text `p` into its top-level elements (at most `cap`): 0, or -1. */
static int split_array(const char *p, size_t n, const char **at, uint32_t *len, int32_t cap, int32_t *count) {
    size_t i = 0;
    while (i < n && (p[i] == ' ' || p[i] == '\n' || p[i] == '\t' || p[i] == '\r')) i++;
    if (i >= n || p[i] != '[') return -1;
    int depth = 0, in_str = 0;
    size_t start = 0;
    *count = 0;
    for (; i < n; i++) {
        char ch = p[i];
        if (in_str) {
            if (ch == '\\') i++;
            else if (ch == '"') in_str = 0;
            continue;
        }
        if (ch == '"') {
            in_str = 1;
        } else if (ch == '[' || ch == '{') {
            if (depth++ == 0) start = i + 1;
        } else if (ch == ']' || ch == '}' || ch == ',') {
            if (depth == 1 && ch != '}') {
                size_t a = start, b = i;
                while (a < b && (p[a] == ' ' || p[a] == '\n' || p[a] == '\t' || p[a] == '\r')) a++;
                if (a < b) {
                    if (*count >= cap) return -1;
                    at[*count] = p + a;
                    len[*count] = (uint32_t)(b - a);
                    (*count)++;
                } else if (ch == ',' || *count > 0) {
                    return -1; /* an empty element */
                }
                start = i + 1;
            }
            if (ch != ',' && --depth == 0) return 0;
        }
    }
    return -1;
}

/* The answer's grants into grants[0..n) (see read_grants). */
static int read_answer(const kvs_frame *f, int32_t n, struct kj_req *req, struct kj_obj *grants) {
    if (kj_parse((const char *)f->buf, f->len, req) != 0) return -1;
    const struct kj_obj *top = &req->top;
    const struct kj_field *ok = kj_get(top, "ok");
    if (!ok || ok->type != KJ_BOOL || ok->slen != 4 || memcmp(ok->s, "true", 4) != 0) return -1;
    if ((int64_t)f->nfds != n) return -1; /* one memfd per part */
    if (n == 1) { /* the single form: the answer is the grant */
        grants[0] = *top;
        return 0;
    }
    const struct kj_field *g = kj_get(top, "grants");
    if (!g || g->type != KJ_LIST) return -1;
    const char *at[KVS_ATTACH_MAX_PARTS];
    uint32_t len[KVS_ATTACH_MAX_PARTS];
    int32_t count;
    if (split_array(g->s, g->slen, at, len, KVS_ATTACH_MAX_PARTS, &count) != 0 || count != n) return -1;
    for (int32_t i = 0; i < n; i++) {
        if (kj_object(at[i], len[i], &grants[i]) != 0) return -1;
        if (!int_is(&grants[i], "nfds", 1)) return -1;
    }
    return 0;
}

/* The grants of the answer, one object per part: 0, or -1 when it is not an answer this
 * call takes whole (Python's reference then reads it). */
static int read_grants(const kvs_frame *f, int32_t n, struct kj_obj *grants) {
    struct kj_req *req = malloc(sizeof *req); /* ~200 KiB: not on a caller's stack */
    if (!req) return -1;
    int rc = read_answer(f, n, req, grants);
    free(req);
    return rc;
}

/* Roll back parts[0..k): each fires `close` from `leased` (return_lease: its registration
 * goes), and is reported in the state it started in, as Python never saw it leased. */
static void roll_back(kvs_import_part *parts, int32_t k, const int32_t *start, kvs_renewer *r) {
    for (int32_t i = k - 1; i >= 0; i--) {
        kvs_machine_inst m;
        kvs_machine_init(&m, KVS_MACHINE_PART);
        m.state = parts[i].attach.state;
        struct lease_ctx c = {&parts[i], NULL, NULL, r, 0};
        if (kvs_machine_fire(&m, KVS_PART_EV_CLOSE, 1ull << KVS_PART_G_GROUP_RELEASING, lease_effect, &c, NULL) !=
            KVS_OK)
            return_lease(&c);
        parts[i].attach.state = start[i];
    }
}

/* Phase 1 of a batch: the request sent, the answer read, every part's `lease` fired.
 * KVS_OK: every part `leased`, its received fd in parts[i].attach.fd (still the frame's);
 * else what kvs_import returns for phase 1, everything undone. */
static int lease_batch(kvs_link *l, const uint8_t *req, uint32_t len, kvs_frame *f, int64_t timeout_ns,
                       kvs_import_part *parts, int32_t n, kvs_renewer *r, int64_t renewed_at_ns,
                       int32_t *failed, int32_t *start) {
    if (!l || !req || !f || !parts || !failed || n <= 0 || n > KVS_ATTACH_MAX_PARTS) return KVS_E_INVAL;
    *failed = -1;
    for (int32_t i = 0; i < n; i++) { /* nothing is sent before every part is well formed */
        kvs_import_part *p = &parts[i];
        if (p->attach.state < 0 || p->attach.state >= KVS_PART_NSTATES) {
            *failed = i;
            return KVS_E_INVAL;
        }
        start[i] = p->attach.state;
        p->lease = p->expires_ns = 0;
        p->why = p->registered = 0;
        p->attach.fd = -1;
    }
    int rc = kvs_link_request(l, req, len, f, timeout_ns);
    if (rc != KVS_OK) return rc; /* the link is closed; nothing was granted on it that stays */
    struct kj_obj *grants = malloc((size_t)n * sizeof *grants);
    if (!grants) return KVS_IMPORT_DEFER;
    if (read_grants(f, n, grants) != 0) {
        free(grants);
        return KVS_IMPORT_DEFER;
    }
    for (int32_t i = 0; i < n; i++) {
        kvs_import_part *p = &parts[i];
        const struct kj_field *lease = kj_get(&grants[i], "lease");
        if (!lease || lease->type != KJ_INT || lease->big || !expires_ns(&grants[i], &p->expires_ns)) {
            free(grants);
            return KVS_IMPORT_DEFER;
        }
        p->lease = lease->i;
        p->attach.fd = f->fds[i];
    }
    /* Every part fires `lease`; the first refusal undoes the batch and defers. */
    int32_t leased = 0;
    for (int32_t i = 0; i < n; i++) {
        kvs_import_part *p = &parts[i];
        kvs_machine_inst m;
        kvs_machine_init(&m, KVS_MACHINE_PART);
        m.state = p->attach.state;
        struct lease_ctx c = {p, l, &grants[i], r, renewed_at_ns};
        if (kvs_machine_fire(&m, KVS_PART_EV_LEASE, p->lease_holds, lease_effect, &c, NULL) != KVS_OK) {
            *failed = i;
            break;
        }
        p->attach.state = m.state;
        leased++;
    }
    free(grants);
    if (leased != n) {
        roll_back(parts, leased, start, r);
        return KVS_IMPORT_DEFER;
    }
    return KVS_OK;
}

int kvs_import_lease(kvs_link *l, const uint8_t *req, uint32_t len, kvs_frame *f, int64_t timeout_ns,
                     kvs_import_part *parts, int32_t n, kvs_renewer *r, int64_t renewed_at_ns, int32_t *failed) {
    int32_t start[KVS_ATTACH_MAX_PARTS];
    int rc = lease_batch(l, req, len, f, timeout_ns, parts, n, r, renewed_at_ns, failed, start);
    if (rc == KVS_OK) f->nfds = 0; /* each received fd is its part's now (parts[i].attach.fd) */
    return rc;
}

int kvs_import(kvs_link *l, const uint8_t *req, uint32_t len, kvs_frame *f, int64_t timeout_ns,
               kvs_import_part *parts, int32_t n, kvs_renewer *r, int64_t renewed_at_ns,
               uint64_t align, int32_t access, int32_t *failed) {
    int32_t start[KVS_ATTACH_MAX_PARTS];
    int rc = lease_batch(l, req, len, f, timeout_ns, parts, n, r, renewed_at_ns, failed, start);
    if (rc != KVS_OK) return rc;
    /* Phase 2, only now that every part of the group holds a checked lease (the caller
     * passes a batch only when it is the whole group). */
    kvs_attach_part *at = malloc((size_t)n * sizeof *at);
    if (!at) {
        roll_back(parts, n, start, r);
        return KVS_IMPORT_DEFER;
    }
    for (int32_t i = 0; i < n; i++) {
        at[i] = parts[i].attach;
        at[i].holds = 1ull << KVS_PART_G_GROUP_ADMITTED;
    }
    int32_t bad = -1;
    rc = kvs_attach(at, n, align, access, &bad);
    for (int32_t i = 0; i < n; i++) parts[i].attach = at[i];
    free(at);
    if (rc != KVS_OK) { /* kvs_attach undid its opens; the leases' registrations go too */
        *failed = bad;
        roll_back(parts, n, start, r);
        return KVS_IMPORT_ATTACH; /* parts[*failed].attach says why (Python: attach.error) */
    }
    /* Every part is open: the transport holds its own duplicate of each received fd. */
    for (int32_t i = 0; i < n; i++) {
        close(f->fds[i]);
        parts[i].attach.fd = -1;
    }
    f->nfds = 0;
    return KVS_OK;
}
