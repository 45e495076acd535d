/* The exporter's lease rules: one home for them (kvs.h, "the exporter's lease server").
 *
 * Every request of an importer, from the native thread (kvs_lease_thread.c) or from
 * Python's TCP server, goes through kvs_lease_handle. It answers as the Python exporter
 * did (the reference kept in tests/support/lease_reference.py): `lease`, `leases` (a
 * batch, all or nothing), `renew`, `release`, `mapped` (single or batch, never answered),
 * with the same refusal codes. Every change of a bank's state is a kvs_machine_fire of
 * the generated bank table on the bank's one instance; the guards are evaluated here
 * from the lease table just before the fire, and the lease effects (grant, renew,
 * expire, end) are the C functions below, each with its undo. Nothing here decides a
 * transition itself, and nothing takes the GIL.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kvs_bank_table.h"
#include "kvs_lease.h"

int64_t kvs_lease_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void signal_fd(int fd) {
    uint64_t one = 1;
    if (fd >= 0 && write(fd, &one, sizeof one) < 0) { /* a full counter is still readable */ }
}

/* -- the server and its banks ------------------------------------------------------ */

int kvs_lease_server_new(int64_t lease_timeout_ns, int32_t max_leases, uint32_t allowed_uid, int32_t max_payload,
                         int32_t max_fds, int32_t max_connections, kvs_lease_server **out) {
    if (!out || lease_timeout_ns <= 0 || max_leases < 1 || max_payload < 1 || max_fds < 0 || max_connections < 1)
        return KVS_E_INVAL;
    struct kvs_lease_server *s = calloc(1, sizeof *s);
    if (!s) return KVS_E_NOMEM;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&s->mu, &a);
    pthread_mutexattr_destroy(&a);
    pthread_mutex_init(&s->hs_mu, NULL);
    s->lease_timeout_ns = lease_timeout_ns;
    s->max_leases = max_leases;
    s->max_payload = max_payload;
    s->max_fds = max_fds;
    s->max_connections = max_connections;
    s->uid = allowed_uid;
    s->next_lease = 1;
    s->next_conn = 1;
    s->listen_fd = s->epoll_fd = s->timer_fd = s->cmd_fd = s->tcp_fd = -1;
    s->events_fd = s->requests_fd = -1; /* made by kvs_lease_serve: no fd before serving */
    s->conns = calloc((size_t)max_connections, sizeof *s->conns);
    if (!s->conns) {
        free(s);
        return KVS_E_NOMEM;
    }
    *out = s;
    return KVS_OK;
}

static void drop_hold_at(struct kvs_bank *b, int k) {
    if (b->holds[k].pidfd >= 0) close(b->holds[k].pidfd);
    if (b->region) kvs_region_unpin(b->region);
    b->holds[k] = b->holds[--b->nholds];
}

void kvs_lease_server_free(kvs_lease_server *s) {
    if (!s) return;
    kvs_lease_stop(s);
    for (int r = 0; r < KVS_LEASE_MAX_RANKS; r++) {
        struct kvs_bank *b = &s->banks[r];
        if (!b->live) continue;
        while (b->nholds) drop_hold_at(b, 0);
        for (int k = 0; k < b->nleases; k++) free(b->leases[k].hashes);
        free(b->leases);
        free(b->holds);
        free(b->report);
    }
    for (int k = 0; k < s->pyq_n; k++) free(s->pyq[(s->pyq_head + k) % 64].buf);
    free(s->conns);
    free(s->hs);
    kvs_inv_free(&s->inv);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->hs_mu);
    free(s);
}

static struct kvs_bank *bank_of(struct kvs_lease_server *s, int64_t rank) {
    return rank >= 0 && rank < KVS_LEASE_MAX_RANKS && s->banks[rank].live ? &s->banks[rank] : NULL;
}

int kvs_lease_bank_add(kvs_lease_server *s, int32_t rank, int32_t uncounted) {
    if (!s || rank < 0 || rank >= KVS_LEASE_MAX_RANKS) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    struct kvs_bank *b = &s->banks[rank];
    int rc = KVS_OK;
    if (b->live && b->m.state == KVS_BANK_S_RELEASED && !b->nleases && !b->nholds) { /* the rank is free again */
        free(b->leases);
        free(b->holds);
        free(b->report);
        memset(b, 0, sizeof *b);
        s->nbanks--;
    }
    if (b->live) rc = KVS_E_INVAL;
    else if (!(b->leases = calloc((size_t)s->max_leases, sizeof *b->leases))) rc = KVS_E_NOMEM;
    else {
        kvs_machine_init(&b->m, KVS_MACHINE_BANK);
        b->uncounted = uncounted != 0;
        b->fd = -1;
        b->live = 1;
        s->nbanks++;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int kvs_lease_bank_publish(kvs_lease_server *s, int32_t rank, int64_t generation, const char *incarnation,
                           int64_t descriptor_expires_ns, int32_t fd, uint64_t region, const char *report) {
    if (!s || !incarnation || !report || strlen(incarnation) >= sizeof s->banks[0].incarnation) return KVS_E_INVAL;
    char *copy = strdup(report);
    if (!copy) return KVS_E_NOMEM;
    pthread_mutex_lock(&s->mu);
    struct kvs_bank *b = bank_of(s, rank);
    if (!b || (b->region && region != b->region && b->nholds)) { /* holds pin the region they took */
        pthread_mutex_unlock(&s->mu);
        free(copy);
        return b ? KVS_E_PINNED : KVS_E_NOENT;
    }
    b->generation = generation;
    strcpy(b->incarnation, incarnation);
    b->descriptor_expires_ns = descriptor_expires_ns;
    b->fd = fd;
    b->region = region;
    free(b->report);
    b->report = copy;
    pthread_mutex_unlock(&s->mu);
    return KVS_OK;
}

int kvs_lease_bank_descriptor(kvs_lease_server *s, int32_t rank, int64_t descriptor_expires_ns) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    struct kvs_bank *b = bank_of(s, rank);
    if (b) b->descriptor_expires_ns = descriptor_expires_ns;
    pthread_mutex_unlock(&s->mu);
    return b ? KVS_OK : KVS_E_NOENT;
}

int kvs_lease_bank_uncounted(kvs_lease_server *s, int32_t rank, int32_t uncounted) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    struct kvs_bank *b = bank_of(s, rank);
    if (b) b->uncounted = uncounted != 0;
    pthread_mutex_unlock(&s->mu);
    return b ? KVS_OK : KVS_E_NOENT;
}

int32_t kvs_lease_bank_state(kvs_lease_server *s, int32_t rank) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    struct kvs_bank *b = bank_of(s, rank);
    int32_t state = b ? b->m.state : KVS_E_NOENT;
    pthread_mutex_unlock(&s->mu);
    return state;
}

/* -- the queue of committed transitions -------------------------------------------- */

static void committed(struct kvs_lease_server *s, int32_t rank, int32_t event, const kvs_fire_result *out,
                      int64_t lease, int32_t why) {
    if (s->tail - s->head >= KVS_LEASE_RING) {
        s->dropped++;
        return;
    }
    kvs_lease_event *e = &s->ring[s->tail++ % KVS_LEASE_RING];
    *e = (kvs_lease_event){rank, event, out->source, out->dest, lease, kvs_lease_now(), why, s->dropped};
    s->dropped = 0;
    signal_fd(s->events_fd);
}

int32_t kvs_lease_events_fd(kvs_lease_server *s) { return s ? s->events_fd : KVS_E_INVAL; }
int32_t kvs_lease_requests_fd(kvs_lease_server *s) { return s ? s->requests_fd : KVS_E_INVAL; }

int32_t kvs_lease_next_event(kvs_lease_server *s, kvs_lease_event *out) {
    if (!s || !out) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int got = s->head != s->tail;
    if (got) *out = s->ring[s->head++ % KVS_LEASE_RING];
    pthread_mutex_unlock(&s->mu);
    return got;
}

/* -- guards and lease effects ------------------------------------------------------ */

static struct kvs_lease *find_lease(struct kvs_bank *b, int64_t id) {
    for (int k = 0; k < b->nleases; k++)
        if (b->leases[k].id == id) return &b->leases[k];
    return NULL;
}

static int find_hold(struct kvs_bank *b, int64_t id) {
    for (int k = 0; k < b->nholds; k++)
        if (b->holds[k].id == id) return k;
    return -1;
}

/* The guard bits of the bank table, from the lease table, for an event naming `lease`. */
static uint64_t guards(struct kvs_lease_server *s, struct kvs_bank *b, int64_t lease) {
    uint64_t holds = 0;
    if (b->nleases < s->max_leases && b->descriptor_expires_ns && wall_now() < b->descriptor_expires_ns)
        holds |= 1ull << KVS_BANK_G_ACCEPTING_LEASES;
    if (b->nleases == 1 && b->leases[0].id == lease) holds |= 1ull << KVS_BANK_G_LAST_LEASE;
    struct kvs_lease *l = find_lease(b, lease);
    if (l && !l->expired) holds |= 1ull << KVS_BANK_G_LEASE_LIVE;
    return holds;
}

struct fx_ctx {
    struct kvs_lease_server *s;
    struct kvs_bank *b;
    int64_t lease;
    uint64_t conn;
    int pid, still_open;
    struct kvs_inv_want want; /* the blocks a grant pins (group -1: none) */
    int ended;                /* END_LEASE ran: `saved` holds the ended lease */
    struct kvs_lease saved; /* for an undo */
    int64_t saved_expires;
    kvs_effect_fn py; /* Python's effects (kvs_lease_fire) */
    void *py_ctx;
};

static int32_t lease_fx(void *ctx, int32_t effect, int32_t undo) {
    struct fx_ctx *c = ctx;
    struct kvs_bank *b = c->b;
    struct kvs_lease *l = find_lease(b, c->lease);
    switch (effect) {
    case KVS_BANK_FX_GRANT_LEASE:
        if (undo) {
            if (l && l->hashes) kvs_inv_pin(&c->s->inv, l->inv_group, l->hashes, l->nhashes, -1);
            if (l) *l = b->leases[--b->nleases];
            int k = find_hold(b, c->lease);
            if (k >= 0) drop_hold_at(b, k);
            return KVS_OK;
        }
        if (b->nleases >= c->s->max_leases) return KVS_E_NOMEM;
        if (b->uncounted) { /* the hold: unmap and release refuse from here */
            if (b->nholds == b->capholds) {
                int cap = b->capholds ? 2 * b->capholds : 8;
                struct kvs_hold *h = realloc(b->holds, (size_t)cap * sizeof *h);
                if (!h) return KVS_E_NOMEM;
                b->holds = h;
                b->capholds = cap;
            }
            if (b->region) {
                int rc = kvs_region_pin(b->region);
                if (rc) return rc;
            }
            struct kvs_conn *cn = kvs_lease_conn(c->s, c->conn);
            int pidfd = cn && cn->pidfd >= 0 ? fcntl(cn->pidfd, F_DUPFD_CLOEXEC, 0) : -1;
            b->holds[b->nholds++] = (struct kvs_hold){c->lease, c->conn, 1, pidfd};
        }
        b->leases[b->nleases++] = (struct kvs_lease){c->lease, c->conn, kvs_lease_now() + c->s->lease_timeout_ns,
                                                     0, c->pid, c->want.group, c->want.n, c->want.h};
        if (c->want.h) kvs_inv_pin(&c->s->inv, c->want.group, c->want.h, c->want.n, 1); /* pinned with the lease */
        return KVS_OK;
    case KVS_BANK_FX_RENEW_LEASE:
        if (!l) return KVS_E_NOENT;
        if (undo) l->expires_ns = c->saved_expires;
        else {
            c->saved_expires = l->expires_ns;
            l->expires_ns = kvs_lease_now() + c->s->lease_timeout_ns;
        }
        return KVS_OK;
    case KVS_BANK_FX_EXPIRE_LEASE: /* kept, not ended: the importer may still map the bank */
        if (!l) return KVS_E_NOENT;
        l->expired = !undo;
        return KVS_OK;
    case KVS_BANK_FX_END_LEASE:
        if (undo) {
            if (b->nleases < c->s->max_leases) b->leases[b->nleases++] = c->saved;
            if (c->saved.hashes) kvs_inv_pin(&c->s->inv, c->saved.inv_group, c->saved.hashes, c->saved.nhashes, 1);
            c->ended = 0;
            return KVS_OK;
        }
        if (!l) return KVS_E_NOENT;
        c->saved = *l;
        c->ended = 1;
        if (l->hashes) kvs_inv_pin(&c->s->inv, l->inv_group, l->hashes, l->nhashes, -1); /* its blocks may go */
        *l = b->leases[--b->nleases];
        if (!c->still_open) { /* the importer closed the bank: its hold goes */
            int k = find_hold(b, c->lease);
            if (k >= 0) drop_hold_at(b, k);
        }
        return KVS_OK;
    default:
        return c->py ? c->py(c->py_ctx, effect, undo) : KVS_E_INVAL;
    }
}

/* Fire a lease event on `b` for `c->lease`, with the guards as they are now. */
static int fire_lease(struct kvs_lease_server *s, int32_t rank, int32_t event, struct fx_ctx *c, int32_t why,
                      kvs_fire_result *out) {
    struct kvs_bank *b = &s->banks[rank];
    c->ended = 0;
    int rc = kvs_machine_fire(&b->m, event, guards(s, b, c->lease), lease_fx, c, out);
    if (rc == KVS_OK) committed(s, rank, event, out, c->lease, why);
    if (rc == KVS_OK && c->ended) free(c->saved.hashes); /* the lease is gone for good */
    return rc;
}

static int lease_event(int32_t event) {
    return event == KVS_BANK_EV_GRANT_LEASE || event == KVS_BANK_EV_LEASE_MAPPED ||
           event == KVS_BANK_EV_RELEASE_LEASE || event == KVS_BANK_EV_PEER_DIED ||
           event == KVS_BANK_EV_LEASE_EXPIRED || event == KVS_BANK_EV_RENEW_LEASE;
}

int kvs_lease_fire(kvs_lease_server *s, int32_t rank, int32_t event, uint64_t py_holds, kvs_effect_fn fx, void *ctx,
                   kvs_fire_result *out) {
    kvs_fire_result scratch;
    if (!out) out = &scratch;
    memset(out, 0, sizeof *out);
    out->row = out->effect = -1;
    if (!s || lease_event(event)) return KVS_E_INVAL; /* lease events are the server's own */
    pthread_mutex_lock(&s->mu);
    int64_t locked_at = kvs_lease_now();
    struct kvs_bank *b = bank_of(s, rank);
    int rc = KVS_E_NOENT;
    if (b) {
        uint64_t holds = guards(s, b, 0) & (1ull << KVS_BANK_G_ACCEPTING_LEASES);
        if ((py_holds >> KVS_BANK_G_NATIVE_QUIESCENT & 1) && b->nleases == 0)
            holds |= 1ull << KVS_BANK_G_NATIVE_QUIESCENT;
        struct fx_ctx c = {.s = s, .b = b, .py = fx, .py_ctx = ctx};
        rc = kvs_machine_fire(&b->m, event, holds, lease_fx, &c, out);
        if (rc == KVS_OK) committed(s, rank, event, out, 0, KVS_LWHY_NONE);
    }
    int64_t held = kvs_lease_now() - locked_at;
    pthread_mutex_unlock(&s->mu);
    /* Python's effects run under the lock, and each needs the GIL: the lease thread waits
     * meanwhile. Said when it is long enough to fail an importer's request. */
    if (held > 1000000000LL)
        fprintf(stderr, "kvstate: the lease server's lock was held %.3f s by bank event %d of rank %d (its "
                "effects waited for Python); the lease thread waited too\n", held / 1e9, event, rank);
    return rc;
}

/* -- snapshots --------------------------------------------------------------------- */

int32_t kvs_lease_leases(kvs_lease_server *s, int32_t rank, kvs_lease_info *out, int32_t cap) {
    if (!s || (cap && !out)) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    struct kvs_bank *b = bank_of(s, rank);
    int32_t n = b ? b->nleases : KVS_E_NOENT;
    int64_t now = kvs_lease_now();
    for (int k = 0; b && k < b->nleases && k < cap; k++)
        out[k] = (kvs_lease_info){b->leases[k].id, b->leases[k].conn, b->leases[k].expires_ns - now,
                                  b->leases[k].expired, b->leases[k].pid, b->leases[k].nhashes};
    pthread_mutex_unlock(&s->mu);
    return n;
}

int32_t kvs_lease_holds(kvs_lease_server *s, int32_t rank, kvs_hold_info *out, int32_t cap) {
    if (!s || (cap && !out)) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    struct kvs_bank *b = bank_of(s, rank);
    int32_t n = b ? b->nholds : KVS_E_NOENT;
    for (int k = 0; b && k < b->nholds && k < cap; k++)
        out[k] = (kvs_hold_info){b->holds[k].id, b->holds[k].conn, b->holds[k].conn_open, b->holds[k].pidfd >= 0};
    pthread_mutex_unlock(&s->mu);
    return n;
}

int32_t kvs_lease_drop_exited_holds(kvs_lease_server *s, int32_t rank) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    struct kvs_bank *b = bank_of(s, rank);
    int32_t n = 0;
    for (int k = 0; b && k < b->nholds;) {
        struct kvs_hold *h = &b->holds[k];
        struct pollfd p = {h->pidfd, POLLIN, 0};
        if (!h->conn_open && (h->pidfd < 0 || poll(&p, 1, 0) > 0)) { /* the driver closed a dead process's opens */
            drop_hold_at(b, k);
            n++;
        } else {
            k++;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return b ? n : KVS_E_NOENT;
}

/* -- connections ------------------------------------------------------------------- */

struct kvs_conn *kvs_lease_conn(struct kvs_lease_server *s, uint64_t id) {
    for (int k = 0; k < s->nconns; k++)
        if (s->conns[k].id == id) return &s->conns[k];
    return NULL;
}

uint64_t kvs_lease_conn_add(struct kvs_lease_server *s, int fd, int pidfd, int pid) {
    if (s->nconns >= s->max_connections) return 0;
    uint64_t id = s->next_conn++;
    s->conns[s->nconns++] = (struct kvs_conn){.id = id, .fd = fd, .pidfd = pidfd, .pid = pid};
    return id;
}

int32_t kvs_lease_connections(kvs_lease_server *s) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int32_t n = s->nconns; /* the thread's and Python's (TCP) */
    pthread_mutex_unlock(&s->mu);
    return n;
}

int64_t kvs_lease_lease_requests(kvs_lease_server *s) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int64_t n = s->lease_requests;
    pthread_mutex_unlock(&s->mu);
    return n;
}

void kvs_lease_conn_end(struct kvs_lease_server *s, uint64_t conn, int importer_closed, int why) {
    for (int r = 0; r < KVS_LEASE_MAX_RANKS; r++) {
        struct kvs_bank *b = &s->banks[r];
        if (!b->live) continue;
        for (int k = 0; k < b->nleases;) {
            if (b->leases[k].conn != conn) { k++; continue; }
            struct fx_ctx c = {.s = s, .b = b, .lease = b->leases[k].id, .still_open = !importer_closed};
            kvs_fire_result out;
            if (fire_lease(s, r, KVS_BANK_EV_PEER_DIED, &c, why, &out) != KVS_OK) k++; /* kept: tried again never */
        }
        for (int k = 0; k < b->nholds;) {
            if (b->holds[k].conn != conn) { k++; continue; }
            if (importer_closed) drop_hold_at(b, k);
            else b->holds[k++].conn_open = 0; /* its process exiting lets go (drop_exited_holds) */
        }
    }
    struct kvs_conn *cn = kvs_lease_conn(s, conn);
    if (cn) {
        if (cn->fd >= 0) close(cn->fd);
        if (cn->pidfd >= 0) close(cn->pidfd);
        kvs_tcp_conn_free(cn);
        *cn = s->conns[--s->nconns];
    }
}

int kvs_lease_conn_open(kvs_lease_server *s, int32_t pid, uint64_t *conn) {
    if (!s || !conn) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    *conn = kvs_lease_conn_add(s, -1, -1, pid);
    pthread_mutex_unlock(&s->mu);
    return *conn ? KVS_OK : KVS_E_BUSY;
}

int kvs_lease_conn_close(kvs_lease_server *s, uint64_t conn, int32_t importer_closed) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int found = kvs_lease_conn(s, conn) != NULL;
    if (found) kvs_lease_conn_end(s, conn, importer_closed, importer_closed ? KVS_LWHY_CLOSED : KVS_LWHY_STOPPED);
    pthread_mutex_unlock(&s->mu);
    return found ? KVS_OK : KVS_E_NOENT;
}

/* -- expiry ------------------------------------------------------------------------ */

int64_t kvs_lease_next_expiry(struct kvs_lease_server *s) {
    int64_t next = 0;
    for (int r = 0; r < KVS_LEASE_MAX_RANKS; r++) {
        struct kvs_bank *b = &s->banks[r];
        for (int k = 0; b->live && k < b->nleases; k++)
            if (!b->leases[k].expired && (!next || b->leases[k].expires_ns < next)) next = b->leases[k].expires_ns;
    }
    return next;
}

int32_t kvs_lease_expire(kvs_lease_server *s, int64_t ahead_ns) {
    if (!s || ahead_ns < 0) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int64_t now = kvs_lease_now() + ahead_ns;
    int32_t n = 0;
    for (int r = 0; r < KVS_LEASE_MAX_RANKS; r++) {
        struct kvs_bank *b = &s->banks[r];
        for (int k = 0; b->live && k < b->nleases; k++) {
            struct kvs_lease *l = &b->leases[k];
            if (l->expired || l->expires_ns > now) continue;
            struct fx_ctx c = {.s = s, .b = b, .lease = l->id, .still_open = 1};
            kvs_fire_result out;
            n += fire_lease(s, r, KVS_BANK_EV_LEASE_EXPIRED, &c, KVS_LWHY_EXPIRED, &out) == KVS_OK;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

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
    struct kvs_bank *b = bank_of(s, rank);
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
        int rc = fire_lease(s, (int32_t)rank, KVS_BANK_EV_GRANT_LEASE, &c, KVS_LWHY_NONE, &out);
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
        struct kvs_lease *l = find_lease(b, c.lease);
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
    struct kvs_lease *held = find_lease(b, id);
    int hold = find_hold(b, id);
    o->n = 0;
    o->nfds = 0;
    if (!held && strcmp(op, "release") == 0 && hold >= 0 && b->holds[hold].conn == conn) {
        drop_hold_at(b, hold); /* an expired lease's importer closed the bank after all */
        put(o, "{\"ok\":true}");
        return 0;
    }
    if (!held || held->conn != conn) {
        refuse(o, "unknown_lease", 0, 0, "no live lease %s on this connection", shown(flease, buf, sizeof buf));
        return 0;
    }
    struct fx_ctx c = {.s = s, .b = b, .lease = id, .conn = conn};
    if (strcmp(op, "mapped") == 0) {
        int rc = fire_lease(s, (int32_t)rank, KVS_BANK_EV_LEASE_MAPPED, &c, KVS_LWHY_NONE, &out);
        char why[256];
        if (rc != KVS_OK) refuse(o, rc == KVS_E_ILLEGAL ? "illegal" : "guard", 0, 0, "%s",
                                 refusal_text(why, sizeof why, rc, KVS_BANK_EV_LEASE_MAPPED, &out));
        else put(o, "{\"ok\":true}");
        return 0;
    }
    if (strcmp(op, "release") == 0) {
        int rc = fire_lease(s, (int32_t)rank, KVS_BANK_EV_RELEASE_LEASE, &c, KVS_LWHY_NONE, &out);
        char why[256];
        if (rc != KVS_OK) refuse(o, rc == KVS_E_ILLEGAL ? "illegal" : "guard", 0, 0, "%s",
                                 refusal_text(why, sizeof why, rc, KVS_BANK_EV_RELEASE_LEASE, &out));
        else put(o, "{\"ok\":true}");
        return 0;
    }
    if (strcmp(op, "renew") == 0) {
        int expired = held->expired;
        int rc = fire_lease(s, (int32_t)rank, KVS_BANK_EV_RENEW_LEASE, &c, KVS_LWHY_NONE, &out);
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
        put(o, "{\"expires_in_s\":%.9f,\"ok\":true}", seconds_left(find_lease(b, id)->expires_ns));
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
        fire_lease(s, (int32_t)ranks[k], KVS_BANK_EV_RELEASE_LEASE, &c, KVS_LWHY_NONE, &out);
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

/* -- the inventory, kept up to date by Python ---------------------------------------- */

int kvs_lease_inv_on(kvs_lease_server *s) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    s->inv.on = 1;
    pthread_mutex_unlock(&s->mu);
    return KVS_OK;
}

int kvs_lease_inv_epoch(kvs_lease_server *s, const char *group, uint32_t glen, int64_t epoch) {
    if (!s || !group) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int rc = kvs_inv_epoch(&s->inv, group, glen, epoch);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int kvs_lease_inv_add(kvs_lease_server *s, const char *group, uint32_t glen, const uint64_t *hashes, uint32_t n) {
    if (!s || !group || (n && !hashes)) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int rc = kvs_inv_add(&s->inv, group, glen, hashes, n);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int kvs_lease_inv_remove(kvs_lease_server *s, const char *group, uint32_t glen, const uint64_t *hashes, uint32_t n) {
    if (!s || !group || (n && !hashes)) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int rc = kvs_inv_remove(&s->inv, group, glen, hashes, n);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int64_t kvs_lease_inv_leases(kvs_lease_server *s, const char *group, uint32_t glen, uint64_t hash) {
    if (!s || !group) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int64_t n = kvs_inv_leases(&s->inv, group, glen, hash);
    pthread_mutex_unlock(&s->mu);
    return n;
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
                        strcmp(opname, "mapped")) {
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

/* -- requests for Python ----------------------------------------------------------- */

/* Queue a request Python serves; 0, or -1 when the queue is full (the caller refuses it). */
int kvs_lease_queue_python(struct kvs_lease_server *s, uint64_t conn, const char *payload, uint32_t len) {
    if (s->pyq_n >= 64) return -1;
    char *copy = malloc(len ? len : 1);
    if (!copy) return -1;
    memcpy(copy, payload, len);
    s->pyq[(s->pyq_head + s->pyq_n++) % 64] = (struct pyreq){conn, copy, len};
    signal_fd(s->requests_fd);
    return 0;
}

int32_t kvs_lease_next_request(kvs_lease_server *s, uint64_t *conn, char *buf, uint32_t cap, uint32_t *len) {
    if (!s || !conn || !buf || !len) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int32_t rc = 0;
    if (s->pyq_n) {
        struct pyreq *q = &s->pyq[s->pyq_head];
        if (q->len > cap) {
            rc = KVS_E_RANGE;
        } else {
            memcpy(buf, q->buf, q->len);
            *len = q->len;
            *conn = q->conn;
            free(q->buf);
            s->pyq_head = (s->pyq_head + 1) % 64;
            s->pyq_n--;
            rc = 1;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int kvs_lease_send(struct kvs_lease_server *s, struct kvs_conn *cn, const char *payload, uint32_t len,
                   const int32_t *fds, int32_t nfds);

int kvs_lease_answer(kvs_lease_server *s, uint64_t conn, const char *payload, uint32_t len, const int32_t *fds,
                     int32_t nfds) {
    if (!s || (!payload && len) || nfds < 0 || (nfds && !fds)) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    struct kvs_conn *cn = kvs_lease_conn(s, conn);
    int rc = !cn || cn->fd < 0 ? KVS_E_NOENT : kvs_lease_send(s, cn, payload, len, fds, nfds);
    if (cn && cn->fd >= 0 && rc != KVS_OK) kvs_lease_conn_end(s, conn, 0, KVS_LWHY_STOPPED);
    pthread_mutex_unlock(&s->mu);
    return rc;
}
