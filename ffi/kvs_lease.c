/* The exporter's lease server: its banks, the lease table, and the one place a bank's
 * state changes (kvs.h, "the exporter's lease server").
 *
 * Every change of a bank's state is a kvs_machine_fire of the generated bank table on the
 * bank's one instance (kvs_lease_fire_one, kvs_lease_fire); the guards are evaluated here
 * from the lease table just before the fire, and the lease effects (grant, renew, expire,
 * end) are the C functions below, each with its undo. Nothing here decides a transition
 * itself, and nothing takes the GIL. Here too: the queue of committed transitions Python
 * reads for its observers, connections and their end, expiry, and the requests queued
 * for Python. The answers to importers' requests are in kvs_lease_answer.c, the
 * inventory's mirror in kvs_lease_inventory.c.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
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

void kvs_lease_drop_hold(struct kvs_bank *b, int k) {
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
        while (b->nholds) kvs_lease_drop_hold(b, 0);
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

struct kvs_bank *kvs_lease_bank_of(struct kvs_lease_server *s, int64_t rank) {
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
        b->epoch_fd = -1;
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
    struct kvs_bank *b = kvs_lease_bank_of(s, rank);
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

int kvs_lease_bank_epochs(kvs_lease_server *s, int32_t rank, int32_t fd, int64_t num_blocks) {
    if (!s || fd < -1 || num_blocks < 0) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    struct kvs_bank *b = kvs_lease_bank_of(s, rank);
    if (b) {
        b->epoch_fd = fd;
        b->epoch_blocks = num_blocks;
    }
    pthread_mutex_unlock(&s->mu);
    return b ? KVS_OK : KVS_E_NOENT;
}

int kvs_lease_bank_descriptor(kvs_lease_server *s, int32_t rank, int64_t descriptor_expires_ns) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    struct kvs_bank *b = kvs_lease_bank_of(s, rank);
    if (b) b->descriptor_expires_ns = descriptor_expires_ns;
    pthread_mutex_unlock(&s->mu);
    return b ? KVS_OK : KVS_E_NOENT;
}

int kvs_lease_bank_uncounted(kvs_lease_server *s, int32_t rank, int32_t uncounted) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    struct kvs_bank *b = kvs_lease_bank_of(s, rank);
    if (b) b->uncounted = uncounted != 0;
    pthread_mutex_unlock(&s->mu);
    return b ? KVS_OK : KVS_E_NOENT;
}

int32_t kvs_lease_bank_state(kvs_lease_server *s, int32_t rank) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    struct kvs_bank *b = kvs_lease_bank_of(s, rank);
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
    kvs_lease_events_signal(s);
}

void kvs_lease_events_signal(struct kvs_lease_server *s) {
    if (s->hold_events) s->events_due = 1;
    else signal_fd(s->events_fd);
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

struct kvs_lease *kvs_lease_find(struct kvs_bank *b, int64_t id) {
    for (int k = 0; k < b->nleases; k++)
        if (b->leases[k].id == id) return &b->leases[k];
    return NULL;
}

int kvs_lease_find_hold(struct kvs_bank *b, int64_t id) {
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
    struct kvs_lease *l = kvs_lease_find(b, lease);
    if (l && !l->expired) holds |= 1ull << KVS_BANK_G_LEASE_LIVE;
    return holds;
}

static int32_t lease_fx(void *ctx, int32_t effect, int32_t undo) {
    struct fx_ctx *c = ctx;
    struct kvs_bank *b = c->b;
    struct kvs_lease *l = kvs_lease_find(b, c->lease);
    switch (effect) {
    case KVS_BANK_FX_GRANT_LEASE:
        if (undo) {
            if (l && l->hashes) kvs_inv_pin(&c->s->inv, l->inv_group, l->hashes, l->nhashes, -1);
            if (l) *l = b->leases[--b->nleases];
            int k = kvs_lease_find_hold(b, c->lease);
            if (k >= 0) kvs_lease_drop_hold(b, k);
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
            int k = kvs_lease_find_hold(b, c->lease);
            if (k >= 0) kvs_lease_drop_hold(b, k);
        }
        return KVS_OK;
    default:
        return c->py ? c->py(c->py_ctx, effect, undo) : KVS_E_INVAL;
    }
}

/* Fire a lease event on `b` for `c->lease`, with the guards as they are now. */
int kvs_lease_fire_one(struct kvs_lease_server *s, int32_t rank, int32_t event, struct fx_ctx *c, int32_t why,
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
    struct kvs_bank *b = kvs_lease_bank_of(s, rank);
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
    struct kvs_bank *b = kvs_lease_bank_of(s, rank);
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
    struct kvs_bank *b = kvs_lease_bank_of(s, rank);
    int32_t n = b ? b->nholds : KVS_E_NOENT;
    for (int k = 0; b && k < b->nholds && k < cap; k++)
        out[k] = (kvs_hold_info){b->holds[k].id, b->holds[k].conn, b->holds[k].conn_open, b->holds[k].pidfd >= 0};
    pthread_mutex_unlock(&s->mu);
    return n;
}

int32_t kvs_lease_drop_exited_holds(kvs_lease_server *s, int32_t rank) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    struct kvs_bank *b = kvs_lease_bank_of(s, rank);
    int32_t n = 0;
    for (int k = 0; b && k < b->nholds;) {
        struct kvs_hold *h = &b->holds[k];
        struct pollfd p = {h->pidfd, POLLIN, 0};
        if (!h->conn_open && (h->pidfd < 0 || poll(&p, 1, 0) > 0)) { /* the driver closed a dead process's opens */
            kvs_lease_drop_hold(b, k);
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
    /* The importer must see the hang-up before any lease of it ends here: once one ends,
     * the blocks it pinned may be stored into, and a load of the importer trusts its copies
     * only while its socket is not hung up (Part.lease_intact). close() alone would not hang
     * up a socket that a child of this process still holds. */
    struct kvs_conn *open = kvs_lease_conn(s, conn);
    if (open && open->fd >= 0) shutdown(open->fd, SHUT_RDWR);
    for (int r = 0; r < KVS_LEASE_MAX_RANKS; r++) {
        struct kvs_bank *b = &s->banks[r];
        if (!b->live) continue;
        for (int k = 0; k < b->nleases;) {
            if (b->leases[k].conn != conn) { k++; continue; }
            struct fx_ctx c = {.s = s, .b = b, .lease = b->leases[k].id, .still_open = !importer_closed};
            kvs_fire_result out;
            if (kvs_lease_fire_one(s, r, KVS_BANK_EV_PEER_DIED, &c, why, &out) != KVS_OK) k++; /* kept: tried again never */
        }
        for (int k = 0; k < b->nholds;) {
            if (b->holds[k].conn != conn) { k++; continue; }
            if (importer_closed) kvs_lease_drop_hold(b, k);
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
            n += kvs_lease_fire_one(s, r, KVS_BANK_EV_LEASE_EXPIRED, &c, KVS_LWHY_EXPIRED, &out) == KVS_OK;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return n;
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
