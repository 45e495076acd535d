/* CUDA ops: gathers on a device, ops of the one op engine stepped through the generated
 * table (kvs_engine.h).
 *
 * kvs_cuda_submit checks everything first (endpoints, ranges), then under the lock fires
 * submit (guard regions_mapped; effect pin_regions) and start at once: work on a stream may
 * run as soon as it is enqueued, and cannot be withdrawn, so the table's cancel (queued
 * only) never applies. The copies then go on the op's own stream (a lane: a stream and an
 * event, reused by later ops once this one is done) as one cuMemcpyBatchAsync where the
 * driver has it, else as cuMemcpy2DAsync for runs at a constant stride and cuMemcpyAsync
 * for the rest, and the lane's event is recorded behind them.
 *
 * The completer thread waits (cuEventSynchronize, a blocking-sync event: it sleeps) on the
 * oldest op's event, then polls every other one, and fires finish, or fail with the
 * CUresult, for each that the driver reports complete. Only then do the op's pins drop, so
 * a region is never unmapped or released before the device finished with it, and the
 * pins and counters the engine reports are the device's own word (quiescence is what this
 * layer reports).
 *
 * A failure while enqueueing cannot take back what is already on the stream: submit waits
 * until the device is done with what got there (the op's event, or its whole stream if
 * the event could not be recorded), fails and reaps the op, and only then reports the
 * failure (KVS_E_CUDA), so a failed submit leaves nothing in flight, not even on the
 * caller's own device memory. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvs_cuda.h"
#include "kvs_engine.h"

struct cu_op {
    struct kvs_op *op;
    int64_t id;
    uint64_t device;
    kcu_context ctx;
    struct kcu_lane lane;
    uint32_t flags;
    kcu_result failed;  /* an enqueue failure, reported when it is settled */
    struct cu_op *next;
};

static struct {
    pthread_cond_t cv;
    int started;
    struct cu_op *head, *tail;
    int batch; /* 1 the driver has the batched copy, 0 not, -1 not asked yet */
} Q = {.cv = PTHREAD_COND_INITIALIZER, .batch = -1};

/* -- lanes ---------------------------------------------------------------------------- */

int kcu_lane_take(struct kcu_dev *d, struct kcu_lane *out) {
    if (d->nlanes) {
        *out = d->lanes[--d->nlanes];
        return KVS_OK;
    }
    if (d->made == d->cap) { /* room for every lane ever made, so giving one back never fails */
        uint32_t cap = d->cap ? 2 * d->cap : 8;
        struct kcu_lane *l = realloc(d->lanes, cap * sizeof *l);
        if (!l) return KVS_E_NOMEM;
        d->lanes = l;
        d->cap = cap;
    }
    struct kcu_lane lane = {0};
    int rc = KCU(cuStreamCreate, &lane.stream, KCU_STREAM_NON_BLOCKING);
    if (rc == KVS_OK && (rc = KCU(cuEventCreate, &lane.event, KCU_EVENT_DISABLE_TIMING | KCU_EVENT_BLOCKING_SYNC)) != KVS_OK)
        kcu.cuStreamDestroy(lane.stream);
    if (rc == KVS_OK) {
        d->made++;
        *out = lane;
    }
    return rc;
}

void kcu_lane_give(struct kcu_dev *d, struct kcu_lane lane) { d->lanes[d->nlanes++] = lane; }

int kcu_lanes_destroy(struct kcu_dev *d) {
    int first = KVS_OK;
    for (uint32_t i = 0; i < d->nlanes; i++) {
        int r1 = KCU(cuEventDestroy, d->lanes[i].event);
        int r2 = KCU(cuStreamDestroy, d->lanes[i].stream);
        if (first == KVS_OK) first = r1 != KVS_OK ? r1 : r2;
    }
    free(d->lanes);
    d->lanes = NULL;
    d->nlanes = d->cap = d->made = 0;
    return first;
}

/* -- completion ----------------------------------------------------------------------- */

/* Under the lock: finish or fail the op with what its event reported. */
static void settle(struct cu_op *c, kcu_result r) {
    kcu_result result = r != KCU_SUCCESS ? r : c->failed;
    int32_t error = result != KCU_SUCCESS ? KVS_E_CUDA : (c->flags & KVS_OPF_FAIL) ? KVS_E_INJECTED : KVS_OK;
    int ev = error ? KVS_OP_EV_FAIL : KVS_OP_EV_FINISH;
    if (kvs_op_step(c->op, ev) != KVS_OK) abort(); /* the table must allow it (kvs_op_external) */
    kvs_op_stepped(c->op, ev, error, (int32_t)result);
    struct kcu_dev *d = kcu_dev_find(c->device); /* open: it has an op in flight */
    kcu_lane_give(d, c->lane);
    d->inflight--;
}

static void nap(void) {
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
}

/* 1 while the event's work still runs (as far as a second look can tell), else 0. */
static int still_running(kcu_context ctx, kcu_event event) {
    return kcu.cuCtxSetCurrent(ctx) == KCU_SUCCESS && kcu.cuEventQuery(event) == KCU_ERROR_NOT_READY;
}

kcu_result kcu_wait(kcu_context ctx, kcu_stream stream, kcu_event event) {
    kcu_result first = KCU_SUCCESS;
    for (int tries = 0; tries < 100000; tries++) {
        kcu_result r = kcu.cuCtxSetCurrent(ctx);
        if (r == KCU_SUCCESS) r = event ? kcu.cuEventSynchronize(event) : kcu.cuStreamSynchronize(stream);
        if (r == KCU_SUCCESS) return first;
        if (first == KCU_SUCCESS) first = r;
        /* a stream cannot be asked again without waiting: a few more tries, then report */
        if (event ? !still_running(ctx, event) : tries >= 3) return first;
        nap();
    }
    return first;
}

static void *completer(void *arg) {
    pthread_setname_np(pthread_self(), "kvs-cuda-done"); /* seen in top -H, py-spy, /proc/<pid>/task */
    (void)arg;
    kvs_engine_lock();
    for (;;) {
        while (!Q.head) pthread_cond_wait(&Q.cv, &kvs_g.mu);
        struct cu_op *oldest = Q.head;
        kcu_context ctx = oldest->ctx;
        struct kcu_lane lane = oldest->lane;
        kvs_engine_unlock();
        kcu_result r = kcu_wait(ctx, lane.stream, lane.event); /* no lock held: it blocks */
        kvs_engine_lock();
        int settled = 0;
        for (struct cu_op **p = &Q.head, *prev = NULL; *p;) {
            struct cu_op *c = *p;
            kcu_result q = r;
            if (c != oldest) {
                q = kcu.cuCtxSetCurrent(c->ctx);
                if (q == KCU_SUCCESS) q = kcu.cuEventQuery(c->lane.event);
                if (q != KCU_SUCCESS && q != KCU_ERROR_NOT_READY && still_running(c->ctx, c->lane.event)) {
                    if (c->failed == KCU_SUCCESS) c->failed = q; /* reported once it is done */
                    q = KCU_ERROR_NOT_READY;
                }
            }
            if (q == KCU_ERROR_NOT_READY) {
                prev = c;
                p = &c->next;
                continue;
            }
            *p = c->next;
            if (Q.tail == c) Q.tail = prev;
            settle(c, q);
            settled++;
            free(c);
        }
        if (!settled) { /* a driver that returned before the event completed: do not spin */
            kvs_engine_unlock();
            nap();
            kvs_engine_lock();
        }
    }
    return NULL;
}

/* Under the lock: queue a submitted op for the completer, starting it on first use. */
static int watch(struct cu_op *c) {
    if (!Q.started) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int err = pthread_create(&t, &attr, completer, NULL);
        pthread_attr_destroy(&attr);
        if (err) return KVS_E_SYS;
        Q.started = 1;
    }
    if (Q.tail) Q.tail->next = c;
    else Q.head = c;
    Q.tail = c;
    pthread_cond_signal(&Q.cv);
    return KVS_OK;
}

/* -- copies --------------------------------------------------------------------------- */

struct run {
    uint64_t src, dst, len;
};

/* Check every block against both extents, merging neighbours contiguous on both sides. */
static int plan_runs(const kvs_block *blocks, uint64_t n, uint64_t ssize, uint64_t dsize, struct run *runs,
                     uint64_t *nruns, uint64_t *bytes) {
    uint64_t k = 0, total = 0;
    for (uint64_t i = 0; i < n; i++) {
        const kvs_block *b = &blocks[i];
        if (b->len == 0 || b->src_off > ssize || b->len > ssize - b->src_off || b->dst_off > dsize ||
            b->len > dsize - b->dst_off || total + b->len < total)
            return KVS_E_RANGE;
        total += b->len;
        if (k && runs[k - 1].src + runs[k - 1].len == b->src_off && runs[k - 1].dst + runs[k - 1].len == b->dst_off)
            runs[k - 1].len += b->len;
        else
            runs[k++] = (struct run){b->src_off, b->dst_off, b->len};
    }
    *nruns = k;
    *bytes = total;
    return KVS_OK;
}

static int batch_available(void) {
    if (Q.batch < 0) {
        int version = 0;
        Q.batch = kcu.cuMemcpyBatchAsync && kcu.cuDriverGetVersion(&version) == KCU_SUCCESS && version >= 12080;
    }
    return Q.batch;
}

/* One cuMemcpyBatchAsync for the whole gather. */
static int enqueue_batch(const struct kcu_dev *d, kcu_stream s, uint64_t sbase, uint64_t dbase,
                         const struct run *runs, uint64_t n) {
    kcu_deviceptr *dsts = malloc(n * sizeof *dsts), *srcs = malloc(n * sizeof *srcs);
    size_t *sizes = malloc(n * sizeof *sizes);
    int rc = KVS_E_NOMEM;
    if (dsts && srcs && sizes) {
        for (uint64_t i = 0; i < n; i++) {
            dsts[i] = dbase + runs[i].dst;
            srcs[i] = sbase + runs[i].src;
            sizes[i] = runs[i].len;
        }
        kcu_memcpy_attributes attr = {.src_access_order = KCU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                                      .src_loc_hint = {KCU_MEM_LOCATION_TYPE_DEVICE, d->dev},
                                      .dst_loc_hint = {KCU_MEM_LOCATION_TYPE_DEVICE, d->dev}};
        size_t idx = 0, fail = 0;
        rc = KCU(cuMemcpyBatchAsync, dsts, srcs, sizes, n, &attr, &idx, 1, &fail, s);
    }
    free(dsts);
    free(srcs);
    free(sizes);
    return rc;
}

/* Runs of equal length at constant strides on both sides become one 2D copy each (a
 * layer-major bank stores a block as one extent per layer, a layer apart), the rest one
 * cuMemcpyAsync each: the number of driver calls does not grow with the layer count. */
static int enqueue_each(const struct kcu_dev *d, kcu_stream s, uint64_t sbase, uint64_t dbase,
                        const struct run *runs, uint64_t n) {
    for (uint64_t i = 0; i < n;) {
        uint64_t h = 1, len = runs[i].len;
        if (i + 1 < n && runs[i + 1].len == len && runs[i + 1].src > runs[i].src && runs[i + 1].dst > runs[i].dst) {
            uint64_t sp = runs[i + 1].src - runs[i].src, dp = runs[i + 1].dst - runs[i].dst;
            if (sp >= len && dp >= len && sp <= d->max_pitch && dp <= d->max_pitch) {
                while (i + h < n && runs[i + h].len == len && runs[i + h].src == runs[i].src + h * sp &&
                       runs[i + h].dst == runs[i].dst + h * dp)
                    h++;
                kcu_memcpy2d c;
                memset(&c, 0, sizeof c);
                c.src_memory_type = c.dst_memory_type = KCU_MEMORYTYPE_DEVICE;
                c.src_device = sbase + runs[i].src;
                c.dst_device = dbase + runs[i].dst;
                c.src_pitch = sp;
                c.dst_pitch = dp;
                c.width_in_bytes = len;
                c.height = h;
                int rc = KCU(cuMemcpy2DAsync, &c, s);
                if (rc != KVS_OK) return rc;
                i += h;
                continue;
            }
        }
        int rc = KCU(cuMemcpyAsync, dbase + runs[i].dst, sbase + runs[i].src, len, s);
        if (rc != KVS_OK) return rc;
        i++;
    }
    return KVS_OK;
}

/* -- submit --------------------------------------------------------------------------- */

/* Under the lock: (region, base, size) of an endpoint on this device. */
static int resolve(uint64_t device, const kvs_endpoint *ep, uint64_t *base, uint64_t *size) {
    if (!ep->region) {
        if (!ep->addr || !ep->size) return KVS_E_INVAL;
        *base = ep->addr;
        *size = ep->size;
        return KVS_OK;
    }
    struct kvs_region *g = kvs_region_find(ep->region);
    struct kcu_alloc *a = g && g->backend == KVS_BACKEND_CUDA ? kvs_slots_get(&kvs_g.cu_allocs, g->alloc) : NULL;
    if (!a || a->device != device) return KVS_E_NOENT;
    *base = g->addr;
    *size = g->size;
    return KVS_OK;
}

int kvs_cuda_submit(uint64_t device, const kvs_endpoint *src, const kvs_endpoint *dst, const kvs_block *blocks,
                    uint64_t nblocks, uint32_t flags, int64_t *out) {
    if (!src || !dst || !blocks || !out || nblocks == 0 || (flags & ~KVS_OPF_FAIL) ||
        nblocks > (UINT64_MAX >> 8) / sizeof(struct run))
        return KVS_E_INVAL;
    int rc = kcu_ready();
    if (rc != KVS_OK) return rc;
    struct run *runs = malloc(nblocks * sizeof *runs);
    struct cu_op *c = calloc(1, sizeof *c);
    if (!runs || !c) {
        free(runs);
        free(c);
        return KVS_E_NOMEM;
    }
    uint64_t sbase = 0, ssize = 0, dbase = 0, dsize = 0, nruns = 0, bytes = 0;
    kvs_engine_lock();
    struct kcu_dev *d = kcu_dev_find(device);
    struct kcu_dev dev;
    if (!d) rc = KVS_E_NOENT;
    if (rc == KVS_OK) rc = resolve(device, src, &sbase, &ssize);
    if (rc == KVS_OK) rc = resolve(device, dst, &dbase, &dsize);
    if (rc == KVS_OK) rc = plan_runs(blocks, nblocks, ssize, dsize, runs, &nruns, &bytes);
    if (rc == KVS_OK) rc = kcu_enter(d);
    if (rc == KVS_OK) rc = kcu_lane_take(d, &c->lane);
    if (rc == KVS_OK) {
        /* A buffer kvstate allocated is pinned like a mapping (the one pin rule): the op
         * names its region, so its free refuses until the device is done with it. */
        uint64_t sreg = src->region ? src->region : kcu_buffer_region(device, sbase, ssize);
        uint64_t dreg = dst->region ? dst->region : kcu_buffer_region(device, dbase, dsize);
        rc = kvs_op_external(sreg, dreg, bytes, nblocks, flags, &c->op, &c->id);
        if (rc == KVS_OK && (rc = kvs_op_step(c->op, KVS_OP_EV_SUBMIT)) != KVS_OK) /* created -> queued: pins */
            kvs_op_drop(c->op);
        if (rc != KVS_OK) kcu_lane_give(d, c->lane);
    }
    if (rc != KVS_OK) {
        kvs_engine_unlock();
        free(runs);
        free(c);
        return rc;
    }
    kvs_op_stepped(c->op, KVS_OP_EV_SUBMIT, 0, 0);
    if (kvs_op_step(c->op, KVS_OP_EV_START) != KVS_OK) abort(); /* queued -> running: unguarded */
    kvs_op_stepped(c->op, KVS_OP_EV_START, 0, 0);
    d->inflight++;
    dev = *d;
    c->device = device;
    c->ctx = d->ctx;
    c->flags = flags;
    int batch = nruns > 1 && batch_available();
    kvs_engine_unlock();

    /* The op is running and its regions pinned: enqueue without the lock. */
    rc = batch ? enqueue_batch(&dev, c->lane.stream, sbase, dbase, runs, nruns)
               : enqueue_each(&dev, c->lane.stream, sbase, dbase, runs, nruns);
    free(runs);
    if (rc == KVS_E_NOMEM) rc = kcu_check("cuMemcpyBatchAsync", KCU_ERROR_OUT_OF_MEMORY);
    int recorded = KCU(cuEventRecord, c->lane.event, c->lane.stream);
    int64_t id = c->id;
    if (rc == KVS_OK && recorded != KVS_OK) rc = recorded;
    if (rc != KVS_OK) {
        /* Part of the gather may be on the stream already, reading and writing the caller's
         * memory too: wait until the device is done with it (its event, or the whole stream
         * where the event could not be recorded), then fail the op and forget it, so that
         * a failed submit leaves nothing behind. The direct calls keep this thread's error. */
        c->failed = (kcu_result)kvs_cuda_last_result();
        kcu_wait(dev.ctx, c->lane.stream, recorded == KVS_OK ? c->lane.event : NULL);
        kvs_engine_lock();
        settle(c, KCU_SUCCESS);
        kvs_engine_unlock();
        kvs_reap(id, NULL);
        free(c);
        return rc;
    }
    kvs_engine_lock();
#ifdef KVS_PLANT_CUDA_EARLY_UNPIN
    /* The planted-bug self-test only (tests/cudashim): the op "finishes" once enqueued, so
     * its pins drop before the device ran its copies. Never in the installed module. */
    settle(c, KCU_SUCCESS);
    kvs_engine_unlock();
    free(c);
    *out = id;
    return KVS_OK;
#endif
    if (watch(c) != KVS_OK) {
        kvs_engine_unlock();
        kcu_result r = kcu_wait(dev.ctx, c->lane.stream, c->lane.event); /* no completer: wait here */
        kvs_engine_lock();
        settle(c, r);
    }
    kvs_engine_unlock();
    *out = id;
    return KVS_OK;
}
