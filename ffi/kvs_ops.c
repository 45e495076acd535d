/* The op engine: a pthread pool copying between regions and caller buffers.
 *
 * Every change of an op's state goes through kvs_op_step() (kvs_op_table.c), which fires
 * only the rows of the table generated from spec/op.toml.
 *
 * One mutex (kvs_g.mu) guards the tables, the queue and every op's state; workers copy
 * with it released. A large op is split into parts that several workers copy at once:
 * the first part taken fires `start`, the last part finished fires `finish` or `fail`.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvs_copy.h"
#include "kvs_op.h"

#define KVS_DEFAULT_WORKERS 2
#define KVS_PART_MIN (UINT64_C(1) << 20) /* split ops of at least 1 MiB across workers */

static struct {
    pthread_once_t once;
    pthread_cond_t work_cv, done_cv;
    pthread_t threads[KVS_MAX_WORKERS];
    uint32_t nthreads, want, idle;
    int stopping, paused, reconfiguring;
    uint32_t allow; /* while paused: queued ops workers may still start (kvs_engine_allow) */
    struct kvs_op *qhead, *qtail;
    struct kvs_slots ops;
    uint64_t queued, running, submitted, completed, failed, cancelled, bytes;
} E = {.once = PTHREAD_ONCE_INIT, .want = KVS_DEFAULT_WORKERS};

static void init_once(void) {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&E.work_cv, &ca);
    pthread_cond_init(&E.done_cv, &ca);
    pthread_condattr_destroy(&ca);
}

static void lock(void) {
    pthread_once(&E.once, init_once);
    pthread_mutex_lock(&kvs_g.mu);
}

static void unlock(void) { pthread_mutex_unlock(&kvs_g.mu); }

/* Under the lock, at the step that makes the op collectable (or later: both parts are
 * idempotent). Tell its notify fd (an eventfd the caller keeps open until it has reaped
 * the op, so the number cannot be reused under us); an eventfd write of 1 cannot block; a
 * failure is not reportable here, and waiters still see the state through kvs_wait. Then
 * count the op down in its report, which sends its message when this was the last op. */
static void notify(struct kvs_op *op) {
    if (op->notify_fd > 0) {
        uint64_t one = 1;
        ssize_t n = write(op->notify_fd, &one, sizeof one);
        (void)n;
        op->notify_fd = 0;
    }
    struct kvs_report *r = op->report;
    if (r && kvs_op_collectable(op->state)) {
        op->report = NULL;
        kvs_report_count_down(r, op->state != KVS_OP_DONE);
    }
}

/* -- workers -------------------------------------------------------------------------- */

static int run_part(const struct kvs_op *op, uint32_t part) {
    if (op->flags & KVS_OPF_FAIL) return KVS_E_INJECTED;
    uint64_t lo = op->nblocks * part / op->nparts, hi = op->nblocks * (part + 1) / op->nparts;
    for (uint64_t i = lo; i < hi; i++) {
        const kvs_block *b = &op->blocks[i];
        if (i + 1 < hi) kvs_copy_prefetch((const char *)(uintptr_t)(op->src_base + op->blocks[i + 1].src_off));
        kvs_copy_block((char *)(uintptr_t)(op->dst_base + b->dst_off),
                   (const char *)(uintptr_t)(op->src_base + b->src_off), b->len);
    }
    kvs_copy_fence(); /* streaming stores are visible before the op is reported finished */
    return KVS_OK;
}

static void account(struct kvs_op *op) {
    uint64_t ids[2] = {op->src_region, op->dst_region == op->src_region ? 0 : op->dst_region};
    for (int i = 0; i < 2; i++) {
        struct kvs_region *g = kvs_region_find(ids[i]);
        if (!g) continue;
        if (op->state == KVS_OP_DONE) {
            g->completed++;
            g->bytes += op->bytes;
        } else {
            g->failed++;
        }
    }
    if (op->state == KVS_OP_DONE) {
        E.completed++;
        E.bytes += op->bytes;
    } else {
        E.failed++;
    }
}

/* A worker may take a part of the queue's head: not paused, or paused with the head
 * allowed (a new op while the allowance lasts, or the rest of an allowed op). */
static int may_take(void) {
    struct kvs_op *h = E.qhead;
    if (!h) return 0;
    if (!E.paused) return 1;
    return h->next_part == 0 ? E.allow > 0 : h->allowed;
}

static void *worker(void *arg) {
    pthread_setname_np(pthread_self(), "kvs-ops"); /* seen in top -H, py-spy, /proc/<pid>/task */
    (void)arg;
    lock();
    for (;;) {
        while (!E.stopping && !may_take()) {
            E.idle++;
            pthread_cond_wait(&E.work_cv, &kvs_g.mu);
            E.idle--;
        }
        if (E.stopping) break;
        struct kvs_op *op = E.qhead;
        if (op->next_part == 0) {
            if (E.paused) {
                E.allow--;
                op->allowed = 1;
            }
            if (kvs_op_step(op, KVS_OP_EV_START) != KVS_OK) abort(); /* queued -> running */
            E.queued--;
            E.running++;
        }
        uint32_t part = op->next_part++;
        if (op->next_part == op->nparts) {
            E.qhead = op->qnext;
            if (!E.qhead) E.qtail = NULL;
            op->qnext = NULL;
        }
        unlock();
        int rc = run_part(op, part);
        lock();
        if (rc != KVS_OK) op->part_error = rc;
        if (++op->parts_done == op->nparts) {
            int ev = op->part_error ? KVS_OP_EV_FAIL : KVS_OP_EV_FINISH;
            if (kvs_op_step(op, ev) != KVS_OK) abort(); /* the table must allow it */
            op->error = op->part_error;
            E.running--;
            account(op);
            notify(op);
            pthread_cond_broadcast(&E.done_cv);
        }
    }
    unlock();
    return NULL;
}

/* Start the pool if it is not running; under the lock. */
static int ensure_workers(void) {
    while (E.nthreads < E.want) {
        if (pthread_create(&E.threads[E.nthreads], NULL, worker, NULL) != 0)
            return E.nthreads ? KVS_OK : KVS_E_SYS;
        E.nthreads++;
    }
    return KVS_OK;
}

int kvs_engine_configure(uint32_t workers) {
    if (workers < 1 || workers > KVS_MAX_WORKERS) return KVS_E_INVAL;
    lock();
    if (E.queued || E.running || E.reconfiguring) {
        unlock();
        return KVS_E_BUSY;
    }
    E.reconfiguring = 1;
    E.stopping = 1;
    pthread_cond_broadcast(&E.work_cv);
    uint32_t n = E.nthreads;
    unlock();
    for (uint32_t i = 0; i < n; i++) pthread_join(E.threads[i], NULL);
    lock();
    E.nthreads = 0;
    E.stopping = 0;
    E.want = workers;
    E.reconfiguring = 0;
    unlock();
    return KVS_OK;
}

int kvs_engine_pause(int32_t paused) {
    lock();
    E.paused = paused != 0;
    E.allow = 0;
    pthread_cond_broadcast(&E.work_cv);
    unlock();
    return KVS_OK;
}

int kvs_engine_allow(uint32_t ops) {
    lock();
    if (!E.paused) {
        unlock();
        return KVS_E_INVAL;
    }
    E.allow = ops;
    pthread_cond_broadcast(&E.work_cv);
    unlock();
    return KVS_OK;
}

/* -- submit, cancel, wait, reap ------------------------------------------------------- */

static int resolve(const kvs_endpoint *ep, uint64_t *base, uint64_t *size) {
    if (ep->region) {
        struct kvs_region *g = kvs_region_find(ep->region);
        if (!g) return KVS_E_NOENT;
        *base = g->addr;
        *size = g->size;
    } else {
        if (!ep->addr) return KVS_E_INVAL;
        *base = ep->addr;
        *size = ep->size;
    }
    return KVS_OK;
}

static int within(uint64_t off, uint64_t len, uint64_t size) { return off <= size && len <= size - off; }

static void free_op(struct kvs_op *op) {
    if (op->blocks != op->inline_blocks) free(op->blocks);
    free(op);
}

int kvs_submit(const kvs_endpoint *src, const kvs_endpoint *dst, const kvs_block *blocks,
               uint64_t nblocks, uint32_t flags, int64_t *out) {
    if (!src || !dst || !blocks || nblocks == 0 || (flags & ~KVS_OPF_FAIL) ||
        nblocks > (UINT64_MAX >> 8) / sizeof(kvs_block))
        return KVS_E_INVAL;
    if (!kvs_op_table_usable()) return KVS_E_ILLEGAL;
    struct kvs_op *op = calloc(1, sizeof *op);
    if (!op) return KVS_E_NOMEM;
    op->state = KVS_OP_INITIAL;
    op->flags = flags;
    op->src_region = src->region;
    op->dst_region = dst->region;
    lock();
    uint64_t ssize = 0, dsize = 0, bytes = 0;
    int rc = resolve(src, &op->src_base, &ssize);
    if (rc == KVS_OK) rc = resolve(dst, &op->dst_base, &dsize);
    for (uint64_t i = 0; rc == KVS_OK && i < nblocks; i++) {
        const kvs_block *b = &blocks[i];
        if (!within(b->src_off, b->len, ssize) || !within(b->dst_off, b->len, dsize) ||
            bytes + b->len < bytes)
            rc = KVS_E_RANGE;
        bytes += b->len;
    }
    if (rc != KVS_OK) goto fail;
    op->bytes = bytes;
    uint32_t workers = E.want;
    /* One big block is cut into one piece per worker, so a contiguous copy runs wide too. */
    uint64_t pieces = (nblocks == 1 && workers > 1 && bytes >= KVS_PART_MIN) ? workers : 1;
    op->nblocks = nblocks * pieces;
    if (op->nblocks <= KVS_MAX_WORKERS) {
        op->blocks = op->inline_blocks;
    } else if (!(op->blocks = malloc(op->nblocks * sizeof(kvs_block)))) {
        rc = KVS_E_NOMEM;
        goto fail;
    }
    if (pieces > 1) {
        uint64_t step = (bytes / pieces + 4095) & ~UINT64_C(4095), off = 0;
        for (uint64_t p = 0; p < pieces; p++) {
            uint64_t len = off >= bytes ? 0 : (bytes - off < step ? bytes - off : step);
            op->blocks[p] = (kvs_block){blocks[0].src_off + off, blocks[0].dst_off + off, len};
            off += len;
        }
    } else {
        memcpy(op->blocks, blocks, nblocks * sizeof(kvs_block));
    }
    op->nparts = (bytes >= KVS_PART_MIN && workers > 1)
                     ? (uint32_t)(op->nblocks < workers ? op->nblocks : workers)
                     : 1;
    uint64_t id;
    if ((rc = kvs_slots_put(&E.ops, op, &id)) != KVS_OK) goto fail;
    if ((rc = kvs_op_step(op, KVS_OP_EV_SUBMIT)) != KVS_OK) { /* created -> queued */
        kvs_slots_del(&E.ops, id);
        goto fail;
    }
    if ((rc = ensure_workers()) != KVS_OK) {
        /* no worker could start: cancel it so its pins drop, and report the failure */
        kvs_op_step(op, KVS_OP_EV_CANCEL);
        kvs_slots_del(&E.ops, id);
        goto fail;
    }
    if (E.qtail) E.qtail->qnext = op;
    else E.qhead = op;
    E.qtail = op;
    E.queued++;
    E.submitted++;
    /* Wake workers only when one is idle and may run it: a futex wake per submit to a
     * paused or busy pool is the largest part of submit cost otherwise. */
    int wake = E.idle && (!E.paused || E.allow) ? (op->nparts > 1 ? 2 : 1) : 0;
    unlock();
    if (wake == 1) pthread_cond_signal(&E.work_cv);
    if (wake == 2) pthread_cond_broadcast(&E.work_cv);
    *out = (int64_t)id;
    return KVS_OK;
fail:
    unlock();
    free_op(op);
    return rc;
}

int kvs_submit_copy(uint64_t src_region, uint64_t src_addr, uint64_t src_size, uint64_t src_off,
                    uint64_t dst_region, uint64_t dst_addr, uint64_t dst_size, uint64_t dst_off,
                    uint64_t len, uint32_t flags, int64_t *op) {
    kvs_endpoint s = {src_region, src_addr, src_size}, d = {dst_region, dst_addr, dst_size};
    kvs_block b = {src_off, dst_off, len};
    return kvs_submit(&s, &d, &b, 1, flags, op);
}

static struct kvs_op *find(int64_t id) {
    return id > 0 ? kvs_slots_get(&E.ops, (uint64_t)id) : NULL;
}

int kvs_cancel(int64_t id) {
    lock();
    struct kvs_op *op = find(id);
    int rc = !op ? KVS_E_NOENT
             /* whatever a table allows, a worker that took part of the op is never cut
              * short: dropping its pins mid-copy would let its memory be freed under it */
             : op->next_part > 0 ? KVS_E_ILLEGAL
             : kvs_op_step(op, KVS_OP_EV_CANCEL);
    if (rc == KVS_OK) {
        struct kvs_op **p = &E.qhead, *prev = NULL;
        while (*p && *p != op) {
            prev = *p;
            p = &(*p)->qnext;
        }
        if (*p) {
            *p = op->qnext;
            if (E.qtail == op) E.qtail = prev;
        }
        op->qnext = NULL;
        E.queued--;
        E.cancelled++;
        notify(op);
        pthread_cond_broadcast(&E.done_cv);
    }
    unlock();
    return rc;
}

int kvs_op_notify(int64_t id, int32_t fd) {
    if (fd <= 0) return KVS_E_INVAL;
    lock();
    struct kvs_op *op = find(id);
    int rc = KVS_OK;
    if (!op) {
        rc = KVS_E_NOENT;
    } else if (op->notify_fd > 0) {
        rc = KVS_E_INVAL; /* one notify fd per op */
    } else {
        op->notify_fd = fd;
        if (kvs_op_collectable(op->state)) notify(op); /* it finished before we were asked */
    }
    unlock();
    return rc;
}

/* -- the ops' side of completion reports (kvs_reports.c) ------------------------------- */

int kvs_op_claim_report(int64_t id, struct kvs_report *r) {
    struct kvs_op *op = find(id);
    if (!op) return KVS_E_NOENT;     /* reaped, or never ours */
    if (op->report) return KVS_E_INVAL; /* one report per op (also: an op named twice) */
    op->report = r;
    return KVS_OK;
}

void kvs_op_unclaim_report(int64_t id, struct kvs_report *r) {
    struct kvs_op *op = find(id);
    if (op && op->report == r) op->report = NULL;
}

void kvs_op_settle_report(int64_t id) {
    struct kvs_op *op = find(id);
    if (op && kvs_op_collectable(op->state)) notify(op); /* it finished before the report was made */
}

static void info(const struct kvs_op *op, kvs_op_info *out) {
    *out = (kvs_op_info){.state = op->state, .error = op->error, .result = op->result,
                         .bytes = op->bytes, .nblocks = op->nblocks};
}

int kvs_op_info_get(int64_t id, kvs_op_info *out) {
    lock();
    struct kvs_op *op = find(id);
    if (op) info(op, out);
    unlock();
    return op ? KVS_OK : KVS_E_NOENT;
}

int32_t kvs_op_collectable(int32_t state) {
    return state >= 0 && state < KVS_OP_NSTATES && kvs_op_first[state][KVS_OP_EV_REAP] >= 0;
}

int kvs_wait(int64_t id, int64_t timeout_ns) {
    if (timeout_ns < 0) return KVS_E_INVAL; /* no unbounded waits */
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += timeout_ns / 1000000000;
    deadline.tv_nsec += timeout_ns % 1000000000;
    if (deadline.tv_nsec >= 1000000000) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000;
    }
    lock();
    int rc;
    for (;;) {
        struct kvs_op *op = find(id); /* looked up again: another thread may have reaped it */
        if (!op) {
            rc = KVS_E_NOENT;
            break;
        }
        if (kvs_op_collectable(op->state)) {
            rc = KVS_OK;
            break;
        }
        if (timeout_ns == 0 || pthread_cond_timedwait(&E.done_cv, &kvs_g.mu, &deadline) == ETIMEDOUT) {
            op = find(id);
            rc = !op ? KVS_E_NOENT : kvs_op_collectable(op->state) ? KVS_OK : KVS_E_TIMEOUT;
            break;
        }
    }
    unlock();
    return rc;
}

int kvs_reap(int64_t id, kvs_op_info *out) {
    lock();
    struct kvs_op *op = find(id);
    kvs_op_info before = {0};
    if (op) info(op, &before); /* the caller learns how it ended: done, failed, cancelled */
    int rc = op ? kvs_op_step(op, KVS_OP_EV_REAP) : KVS_E_NOENT;
    if (rc == KVS_OK) {
        if (out) *out = before;
        kvs_slots_del(&E.ops, (uint64_t)id);
        free_op(op);
    }
    unlock();
    return rc;
}

/* -- ops of other backends (kvs_engine.h) --------------------------------------------- */

void kvs_engine_lock(void) { lock(); }
void kvs_engine_unlock(void) { unlock(); }

int kvs_op_external(uint64_t src_region, uint64_t dst_region, uint64_t bytes, uint64_t nblocks,
                    uint32_t flags, struct kvs_op **out, int64_t *id) {
    if (!kvs_op_table_usable()) return KVS_E_ILLEGAL;
    struct kvs_op *op = calloc(1, sizeof *op);
    if (!op) return KVS_E_NOMEM;
    op->state = KVS_OP_INITIAL;
    op->flags = flags;
    op->src_region = src_region;
    op->dst_region = dst_region;
    op->bytes = bytes;
    op->nblocks = nblocks;
    op->nparts = 1; /* a worker never takes it; kvs_cancel sees none taken */
    op->blocks = op->inline_blocks;
    uint64_t slot;
    int rc = kvs_slots_put(&E.ops, op, &slot);
    if (rc != KVS_OK) {
        free(op);
        return rc;
    }
    *out = op;
    *id = (int64_t)slot;
    return KVS_OK;
}

void kvs_op_drop(struct kvs_op *op) {
    kvs_slots_del(&E.ops, op->id);
    free_op(op);
}

void kvs_op_stepped(struct kvs_op *op, int event, int32_t error, int32_t result) {
    switch (event) {
    case KVS_OP_EV_SUBMIT:
        E.queued++;
        E.submitted++;
        break;
    case KVS_OP_EV_START:
        E.queued--;
        E.running++;
        break;
    case KVS_OP_EV_FINISH:
    case KVS_OP_EV_FAIL:
        op->error = error;
        op->result = result;
        E.running--;
        account(op);
        notify(op);
        pthread_cond_broadcast(&E.done_cv);
        break;
    default:
        break;
    }
}

/* -- observation ---------------------------------------------------------------------- */

void kvs_global_info_get(kvs_global_info *out) {
    lock();
    memset(out, 0, sizeof *out);
    kvs_slots_global(out);
    out->ops_live = E.ops.live;
    out->ops_queued = E.queued;
    out->ops_running = E.running;
    out->submitted = E.submitted;
    out->completed = E.completed;
    out->failed = E.failed;
    out->cancelled = E.cancelled;
    out->bytes = E.bytes;
    out->workers = E.want;
    out->paused = E.paused;
    unlock();
}
