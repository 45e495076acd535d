/* The importer's renewal thread (kvs.h): leases renewed without the GIL.
 *
 * Why: engines hold the GIL for long stretches. A renewal that needs Python waits for
 * it, and a lease whose term passes unrenewed is expired by its exporter although the
 * importer lives. This thread renews every registered lease by itself, on the lease's
 * request link (kvs_link.c, whose mutex keeps it apart from Python's requests), and
 * only reports to Python: a refused or failed renewal is queued as an outcome and
 * signalled on an eventfd. Python's group machine then faults the group ("expired"),
 * as it did when Python renewed.
 *
 * The thread sleeps on a timerfd armed at the earliest due time (a lease is due once
 * min(term/2, interval) has passed since its grant or last renewal), on a command
 * eventfd that stop writes, and on the links whose renewals are in flight (see "the
 * thread" below: side by side, so a silent exporter holds up only its own leases). The
 * timer is armed under the mutex, by the thread and by an add whose lease is due sooner
 * than the armed time, so an import never wakes the thread (strace: it used to be woken
 * once per part, in the middle of each import). The table is guarded by one mutex that
 * is never held across a request: a request runs on a copy of its entry (with a
 * reference on the link), and its result is applied only if the same key is still
 * registered.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include "kvs.h"
#include "kvs_link.h"

_Static_assert(KVS_RENEW_REPLY_MAX == sizeof(((kvs_renew_outcome *)0)->reply), "kvs_renew_outcome.reply");

#define QUEUE_CAP 128

struct entry {
    uint64_t key;
    kvs_link *link;  /* one reference per entry */
    uint32_t rank;
    int64_t lease, term_ns, renewed_at_ns, expires_at_ns;
    uint64_t renewals;
    int failed;
    int flying; /* its renewal is asked and not yet answered (run) */
    int64_t generation; /* the bank's, as the last renewal said; -1: not said */
};

struct kvs_renewer {
    pthread_mutex_t mu;
    pthread_t thread;
    int cmd_fd, out_fd, timer_fd;
    int64_t armed_ns; /* what timer_fd rings at; 0: disarmed */
    int64_t interval_ns, timeout_ns;
    struct entry *entries;
    size_t n, cap;
    kvs_renew_outcome queue[QUEUE_CAP];
    size_t head, count;
    uint64_t dropped;
    int stop;
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void poke(int fd) {
    uint64_t one = 1;
    while (write(fd, &one, sizeof one) < 0 && errno == EINTR) {}
    /* EAGAIN: the counter is already non-zero, so the reader wakes anyway. */
}

static void drain_fd(int fd) {
    uint64_t v;
    while (read(fd, &v, sizeof v) < 0 && errno == EINTR) {}
}

static struct entry *find(kvs_renewer *r, uint64_t key) {
    for (size_t i = 0; i < r->n; i++)
        if (r->entries[i].key == key) return &r->entries[i];
    return NULL;
}

static int64_t due_at(const kvs_renewer *r, const struct entry *e) {
    int64_t every = e->term_ns / 2 < r->interval_ns ? e->term_ns / 2 : r->interval_ns;
    return e->renewed_at_ns + every;
}

/* Ring at `at` (0: disarm). The caller holds the mutex. */
static void arm(kvs_renewer *r, int64_t at) {
    struct itimerspec when = {{0, 0}, {at / 1000000000, at % 1000000000}};
    timerfd_settime(r->timer_fd, TFD_TIMER_ABSTIME, &when, NULL);
    r->armed_ns = at;
}

/* -- the answer: {"ok":true,"expires_in_s":x} ----------------------------------------
 * A strict reader of one flat JSON object: the two keys it needs, every other value
 * skipped whole (strings with escapes, nested arrays and objects), a duplicate key or
 * trailing bytes refused. Anything it refuses goes to Python as a refusal, whose codec
 * (kvstate.channel.framing.decode) then names what was wrong. */

struct cursor { const uint8_t *p, *end; };

static void ws(struct cursor *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) c->p++;
}

static int skip_string(struct cursor *c, const uint8_t **start, size_t *len) {
    if (c->p >= c->end || *c->p != '"') return 0;
    const uint8_t *s = ++c->p;
    while (c->p < c->end && *c->p != '"') {
        if (*c->p < 0x20) return 0;
        if (*c->p == '\\') c->p++;
        c->p++;
    }
    if (c->p >= c->end) return 0;
    if (start) *start = s;
    if (len) *len = (size_t)(c->p - s);
    c->p++;
    return 1;
}

static int skip_value(struct cursor *c, int depth) {
    ws(c);
    if (c->p >= c->end || depth > 32) return 0;
    uint8_t ch = *c->p;
    if (ch == '"') return skip_string(c, NULL, NULL);
    if (ch == '{' || ch == '[') {
        uint8_t close = ch == '{' ? '}' : ']';
        c->p++;
        ws(c);
        if (c->p < c->end && *c->p == close) { c->p++; return 1; }
        for (;;) {
            if (ch == '{') {
                ws(c);
                if (!skip_string(c, NULL, NULL)) return 0;
                ws(c);
                if (c->p >= c->end || *c->p++ != ':') return 0;
            }
            if (!skip_value(c, depth + 1)) return 0;
            ws(c);
            if (c->p >= c->end) return 0;
            if (*c->p == ',') { c->p++; continue; }
            if (*c->p == close) { c->p++; return 1; }
            return 0;
        }
    }
    const uint8_t *s = c->p;
    while (c->p < c->end && (strchr("+-.0123456789eE", *c->p) || (*c->p >= 'a' && *c->p <= 'z'))) c->p++;
    size_t n = (size_t)(c->p - s);
    if (n == 0) return 0;
    if ((n == 4 && !memcmp(s, "true", 4)) || (n == 5 && !memcmp(s, "false", 5)) || (n == 4 && !memcmp(s, "null", 4)))
        return 1;
    return (*s == '-' || (*s >= '0' && *s <= '9'));
}

static int read_number(struct cursor *c, double *out) {
    ws(c);
    const uint8_t *s = c->p;
    while (c->p < c->end && strchr("+-.0123456789eE", *c->p)) c->p++;
    size_t n = (size_t)(c->p - s);
    if (n == 0 || n > 63 || !(*s == '-' || (*s >= '0' && *s <= '9'))) return 0;
    char buf[64];
    memcpy(buf, s, n);
    buf[n] = 0;
    char *endp;
    *out = strtod(buf, &endp);
    return endp == buf + n && isfinite(*out);
}

/* 1 with *expires_s (and *generation, when the answer names an integer one; else it is left
 * alone) when the answer grants the renewal; 0 for anything else. */
static int granted(const uint8_t *data, size_t len, double *expires_s, int64_t *generation) {
    struct cursor c = {data, data + len};
    int ok = 0, seen_ok = 0, seen_expires = 0, seen_generation = 0;
    ws(&c);
    if (c.p >= c.end || *c.p++ != '{') return 0;
    ws(&c);
    if (c.p < c.end && *c.p == '}') return 0;
    for (;;) {
        const uint8_t *key;
        size_t klen;
        ws(&c);
        if (!skip_string(&c, &key, &klen)) return 0;
        ws(&c);
        if (c.p >= c.end || *c.p++ != ':') return 0;
        ws(&c);
        if (klen == 2 && !memcmp(key, "ok", 2)) {
            if (seen_ok++) return 0;
            if (c.end - c.p >= 4 && !memcmp(c.p, "true", 4)) { ok = 1; c.p += 4; }
            else if (!skip_value(&c, 0)) return 0;
        } else if (klen == 12 && !memcmp(key, "expires_in_s", 12)) {
            if (seen_expires++ || !read_number(&c, expires_s)) return 0;
        } else if (klen == 10 && !memcmp(key, "generation", 10)) {
            double g;
            if (seen_generation++ || !read_number(&c, &g)) return 0;
            if (g >= 0 && g < 9e15 && g == (double)(int64_t)g) *generation = (int64_t)g;
        } else if (!skip_value(&c, 0)) {
            return 0;
        }
        ws(&c);
        if (c.p >= c.end) return 0;
        if (*c.p == ',') { c.p++; continue; }
        if (*c.p++ != '}') return 0;
        break;
    }
    ws(&c);
    return c.p == c.end && ok && seen_expires && *expires_s >= 0 && *expires_s < 1e9;
}

/* -- the thread ------------------------------------------------------------------------ */

static void push(kvs_renewer *r, uint64_t key, int32_t code, int32_t err, const uint8_t *reply, size_t len) {
    if (r->count == QUEUE_CAP) {
        r->dropped++;  /* the entry stays failed: Python sees its expiry pass */
        return;
    }
    kvs_renew_outcome *o = &r->queue[(r->head + r->count++) % QUEUE_CAP];
    o->key = key;
    o->code = code;
    o->err = err;
    o->len = (uint32_t)(len < KVS_RENEW_REPLY_MAX ? len : KVS_RENEW_REPLY_MAX);
    if (o->len) memcpy(o->reply, reply, o->len);
    poke(r->out_fd);
}

/* The result `rc` (with the answer in `f` when KVS_OK) of the renewal of the copy `e`,
 * asked at `at`, applied to its entry if that is still there. */
static void settle(kvs_renewer *r, const struct entry *e, int64_t at, int rc, kvs_frame *f) {
    double expires_s = 0;
    int64_t generation = -1;
    int ok = rc == KVS_OK && f->nfds == 0 && granted(f->buf, f->len, &expires_s, &generation);
    if (rc == KVS_OK)
        for (uint32_t i = 0; i < f->nfds; i++) close(f->fds[i]);
    pthread_mutex_lock(&r->mu);
    struct entry *live = find(r, e->key);
    if (live) live->flying = 0;
    if (live && !live->failed) {
        if (ok) {
            live->renewed_at_ns = at;
            live->expires_at_ns = at + (int64_t)(expires_s * 1e9);
            live->renewals++;
            if (generation >= 0) live->generation = generation;
        } else {
            live->failed = 1;
            push(r, e->key, rc == KVS_OK ? KVS_RENEW_REFUSED : rc, f->err, f->buf, rc == KVS_OK ? f->len : 0);
        }
    }
    pthread_mutex_unlock(&r->mu);
}

/* -- the thread: renewals in flight side by side ---------------------------------------
 * Every due renewal is asked at once and each answer applied as it comes, while the
 * renewals that fall due meanwhile are asked too: an exporter that stops answering (a
 * stopped process) holds up only its own leases, until request_timeout_s fails them, and
 * never another exporter's (they were renewed one after another before, each waiting for
 * its answer, and one hung exporter let every other lease run out). A link carries one
 * exchange at a time, so two leases on one link go one after the other. */

struct flight {
    struct entry e;              /* a copy, with a reference on its link */
    int asked;                   /* sent, its answer awaited (the link held) */
    int64_t asked_at, deadline;  /* the new term counts from asked_at; SETTLED: done */
};
#define SETTLED (-1)

/* While another exchange (Python's request) holds a link, its renewals are tried again
 * after 1 ms, then twice as long each time up to this: the old blocking lock renewed right
 * at the unlock; this renews within BUSY_RETRY_MAX_MS of it, without a busy loop. */
#define BUSY_RETRY_MAX_MS 50
/* How long a renewal waits for room to send: an exporter that reads nothing (its socket
 * full) fails its own renewal after this instead of holding up every other one for
 * request_timeout_s. A renewal is a hundred bytes: only a peer that stopped reading long
 * ago has no room for it. */
#define SEND_WAIT_NS 100000000LL

static int among(kvs_link *const *links, size_t n, const kvs_link *l) {
    for (size_t i = 0; i < n; i++)
        if (links[i] == l) return 1;
    return 0;
}

/* Ask every flight not yet asked whose link is free; a failed send settles it at once.
 * Returns whether one found its link held by another exchange: its flights wait, and a
 * held link costs one try per pass, not one per lease on it. `taken` has room for n. */
static int ask(kvs_renewer *r, struct flight *fl, size_t n, kvs_link **taken, kvs_frame *f) {
    int busy = 0;
    size_t nt = 0; /* links with an exchange in flight, or held by another: one entry each */
    for (size_t i = 0; i < n; i++)
        if (fl[i].asked && !among(taken, nt, fl[i].e.link)) taken[nt++] = fl[i].e.link;
    for (size_t i = 0; i < n; i++) {
        if (fl[i].asked || fl[i].asked_at < 0 || among(taken, nt, fl[i].e.link)) continue;
        char payload[96];
        int len = snprintf(payload, sizeof payload, "{\"lease\":%lld,\"op\":\"renew\",\"rank\":%u}",
                           (long long)fl[i].e.lease, fl[i].e.rank);
        /* Asked before the exporter's own term starts: the importer's view of a lease
         * never outlasts the exporter's (kvstate.transport.nixl.transport.LeaseGate). */
        int64_t at = now_ns();
        int64_t send_ns = r->timeout_ns < SEND_WAIT_NS ? r->timeout_ns : SEND_WAIT_NS;
        int rc = kvs_link_begin(fl[i].e.link, (const uint8_t *)payload, (uint32_t)len, send_ns, &f->err);
        if (rc == KVS_LINK_BUSY) {
            busy = 1;
            taken[nt++] = fl[i].e.link;
        } else if (rc != KVS_OK) {
            f->nfds = f->len = 0;
            settle(r, &fl[i].e, at, rc, f);
            fl[i].asked_at = SETTLED;
        } else {
            fl[i].asked = 1;
            fl[i].asked_at = at;
            fl[i].deadline = at + r->timeout_ns;
            taken[nt++] = fl[i].e.link;
        }
    }
    return busy;
}

/* Room for one more flight (and its poll entries): 0 when none could be had. */
static int grow(struct flight **fl, struct pollfd **p, size_t **who, kvs_link ***taken, size_t n, size_t *cap) {
    if (n < *cap) return 1;
    size_t c = *cap ? 2 * *cap : 16;
    struct flight *f2 = realloc(*fl, c * sizeof **fl);
    if (!f2) return 0;
    *fl = f2;
    kvs_link **t2 = realloc(*taken, c * sizeof **taken);
    if (!t2) return 0;
    *taken = t2;
    struct pollfd *p2 = realloc(*p, (2 * c + 2) * sizeof **p);
    if (!p2) return 0;
    *p = p2;
    size_t *w2 = realloc(*who, (2 * c + 2) * sizeof **who);
    if (!w2) return 0;
    *who = w2;
    *cap = c;
    return 1;
}

static void *run(void *arg) {
    pthread_setname_np(pthread_self(), "kvs-renew"); /* seen in top -H, py-spy, /proc/<pid>/task */
    kvs_renewer *r = arg;
    kvs_frame *f = calloc(1, sizeof *f);
    uint8_t *buf = malloc(1u << 20);  /* the largest payload cap a link may have */
    struct flight *fl = NULL;
    struct pollfd *p = NULL;
    kvs_link **taken = NULL;
    size_t *who = NULL, n = 0, cap = 0;
    int64_t busy_ms = 1;
    if (!f || !buf || !grow(&fl, &p, &who, &taken, 0, &cap))
        goto out; /* every lease then runs out unrenewed, which Python sees */
    f->buf = buf;
    f->cap = 1u << 20;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        /* Take what fell due; arm the timer at the next one not in flight. */
        int stopping = r->stop;
        int64_t now = now_ns(), next = 0;
        for (size_t i = 0; i < r->n && !stopping; i++) {
            struct entry *e = &r->entries[i];
            if (e->failed || e->flying) continue;
            int64_t at = due_at(r, e);
            if (at > now) {
                if (!next || at < next) next = at;
            } else if (grow(&fl, &p, &who, &taken, n, &cap)) {
                fl[n++] = (struct flight){.e = *e};
                e->flying = 1;
                kvs_link_ref(e->link);
            } /* else: no memory, it waits for a later turn */
        }
        arm(r, next);
        pthread_mutex_unlock(&r->mu);
        if (stopping) /* what was not asked yet never will be; what was asked is answered first */
            for (size_t i = 0; i < n; i++)
                if (!fl[i].asked) fl[i].asked_at = SETTLED;
        int busy = stopping ? 0 : ask(r, fl, n, taken, f);
        /* Wait for an answer, a deadline, the timer or a command. */
        size_t np = 2;
        int64_t wake = INT64_MAX;
        p[0] = (struct pollfd){r->cmd_fd, POLLIN, 0};
        p[1] = (struct pollfd){r->timer_fd, POLLIN, 0};
        for (size_t i = 0; i < n; i++) {
            if (!fl[i].asked) continue;
            int k = kvs_link_pollfds(fl[i].e.link, &p[np]);
            for (int j = 0; j < k; j++) who[np + j] = i;
            np += (size_t)k;
            if (fl[i].deadline < wake) wake = fl[i].deadline;
        }
        int64_t ms = wake == INT64_MAX ? -1 : (wake - now_ns() + 999999) / 1000000;
        if (wake != INT64_MAX && ms < 0) ms = 0;
        if (busy && (ms < 0 || ms > busy_ms)) ms = busy_ms;
        busy_ms = busy ? (2 * busy_ms < BUSY_RETRY_MAX_MS ? 2 * busy_ms : BUSY_RETRY_MAX_MS) : 1;
        if (stopping && np == 2) ms = 0; /* nothing left to wait for */
        /* EINTR, or a failure: each exchange still ends by its deadline */
        if (poll(p, np, ms > INT_MAX ? INT_MAX : (int)ms) > 0) {
            if (p[0].revents & POLLIN) drain_fd(r->cmd_fd);
            if (p[1].revents & POLLIN) drain_fd(r->timer_fd);
        }
        now = now_ns();
        for (size_t k = 2; k < np; k++) {
            size_t i = who[k];
            int socket = k == 2 || who[k - 1] != i, last = k + 1 == np || who[k + 1] != i;
            if (!fl[i].asked) continue;
            int code;
            if (socket && p[k].revents) code = 0;                            /* the answer, or a hang-up */
            else if (!socket && (p[k].revents & POLLIN)) code = KVS_E_LINK_PEER_DIED;
            else if (last && now >= fl[i].deadline) code = KVS_E_LINK_TIMEOUT;
            else continue;
            int rc = kvs_link_finish(fl[i].e.link, f, code, fl[i].deadline);
            settle(r, &fl[i].e, fl[i].asked_at, rc, f);
            fl[i].asked = 0;
            fl[i].asked_at = SETTLED;
        }
        /* Drop the settled (and, when stopping, the never asked) flights. */
        pthread_mutex_lock(&r->mu);
        size_t kept = 0;
        for (size_t i = 0; i < n; i++) {
            if (fl[i].asked_at != SETTLED) {
                fl[kept++] = fl[i];
                continue;
            }
            struct entry *live = find(r, fl[i].e.key);
            if (live) live->flying = 0; /* settle cleared it already, unless never asked */
            kvs_link_unref(fl[i].e.link);
        }
        n = kept;
        if (stopping && !n) {
            pthread_mutex_unlock(&r->mu);
            break;
        }
    }
out:
    free(taken);
    free(who);
    free(p);
    free(fl);
    free(buf);
    free(f);
    return NULL;
}

/* -- what Python calls ----------------------------------------------------------------- */

kvs_renewer *kvs_renewer_start(int64_t interval_ns, int64_t timeout_ns) {
    if (interval_ns <= 0 || timeout_ns < 0) {
        errno = EINVAL;
        return NULL;
    }
    kvs_renewer *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->interval_ns = interval_ns;
    r->timeout_ns = timeout_ns;
    r->cmd_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    r->out_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    r->timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
    int e = errno;
    if (r->cmd_fd >= 0 && r->out_fd >= 0 && r->timer_fd >= 0) {
        pthread_mutex_init(&r->mu, NULL);
        e = pthread_create(&r->thread, NULL, run, r);
        if (!e) return r;
        pthread_mutex_destroy(&r->mu);
    }
    if (r->cmd_fd >= 0) close(r->cmd_fd);
    if (r->out_fd >= 0) close(r->out_fd);
    if (r->timer_fd >= 0) close(r->timer_fd);
    free(r);
    errno = e;
    return NULL;
}

void kvs_renewer_stop(kvs_renewer *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_mutex_unlock(&r->mu);
    poke(r->cmd_fd);
    pthread_join(r->thread, NULL);
    for (size_t i = 0; i < r->n; i++) kvs_link_unref(r->entries[i].link);
    free(r->entries);
    close(r->cmd_fd);
    close(r->out_fd);
    close(r->timer_fd);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

int32_t kvs_renewer_fd(kvs_renewer *r) { return r->out_fd; }

int kvs_renewer_add(kvs_renewer *r, kvs_link *l, uint64_t key, uint32_t rank, int64_t lease, int64_t term_ns,
                    int64_t renewed_at_ns) {
    if (!l || term_ns <= 0) return KVS_E_INVAL;
    pthread_mutex_lock(&r->mu);
    int rc = KVS_OK;
    if (find(r, key)) {
        rc = KVS_E_INVAL;
    } else if (r->n == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 16;
        struct entry *grown = realloc(r->entries, cap * sizeof *grown);
        if (!grown) rc = KVS_E_NOMEM;
        else {
            r->entries = grown;
            r->cap = cap;
        }
    }
    if (rc == KVS_OK) {
        kvs_link_ref(l);
        struct entry *e = &r->entries[r->n++];
        *e = (struct entry){.key = key, .link = l, .rank = rank, .lease = lease, .term_ns = term_ns,
                            .renewed_at_ns = renewed_at_ns, .expires_at_ns = renewed_at_ns + term_ns,
                            .generation = -1};
        int64_t due = due_at(r, e);
        if (!r->armed_ns || due < r->armed_ns) arm(r, due > 0 ? due : 1); /* 0 would disarm */
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int kvs_renewer_remove(kvs_renewer *r, uint64_t key) {
    pthread_mutex_lock(&r->mu);
    struct entry *e = find(r, key);
    kvs_link *l = NULL;
    if (e) {
        l = e->link;
        *e = r->entries[--r->n];
    }
    pthread_mutex_unlock(&r->mu);
    if (!l) return KVS_E_NOENT;
    kvs_link_unref(l);
    return KVS_OK;
}

int kvs_renewer_state(kvs_renewer *r, uint64_t key, kvs_renew_state *out) {
    pthread_mutex_lock(&r->mu);
    struct entry *e = find(r, key);
    if (e) *out = (kvs_renew_state){e->renewed_at_ns, e->expires_at_ns, e->renewals, e->failed, e->generation};
    pthread_mutex_unlock(&r->mu);
    return e ? KVS_OK : KVS_E_NOENT;
}

int32_t kvs_renewer_take(kvs_renewer *r, kvs_renew_outcome *out, int32_t max) {
    pthread_mutex_lock(&r->mu);
    drain_fd(r->out_fd);
    int32_t n = 0;
    while (n < max && r->count) {
        out[n++] = r->queue[r->head];
        r->head = (r->head + 1) % QUEUE_CAP;
        r->count--;
    }
    if (r->count) poke(r->out_fd);  /* more than the caller took: still readable */
    pthread_mutex_unlock(&r->mu);
    return n;
}

uint64_t kvs_renewer_dropped(kvs_renewer *r) {
    pthread_mutex_lock(&r->mu);
    uint64_t n = r->dropped;
    pthread_mutex_unlock(&r->mu);
    return n;
}
