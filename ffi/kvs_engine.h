/* The op engine's face for backends whose ops run elsewhere than its worker pool (the CUDA
 * backend: copies on a stream). Not public.
 *
 * Such an op lives in the engine's own table, so kvs_wait, kvs_reap, kvs_cancel,
 * kvs_op_info_get and the counters of kvs_global_info_get serve it exactly as a host op,
 * and its state changes only through kvs_op_step() on the generated table: the backend
 * fires the events (submit, start, then finish or fail) and tells the engine what it fired
 * (kvs_op_stepped) so counters, region accounting, notify fds and waiters follow.
 * Everything here runs under kvs_g.mu (kvs_engine_lock). */
#ifndef KVS_ENGINE_H
#define KVS_ENGINE_H

#include "kvs_slots.h"

struct kvs_op;

KVS_HIDDEN void kvs_engine_lock(void);
KVS_HIDDEN void kvs_engine_unlock(void);

/* A new op in state `created`, in the engine's table (its id in *id); nothing is pinned. */
KVS_HIDDEN int kvs_op_external(uint64_t src_region, uint64_t dst_region, uint64_t bytes,
                               uint64_t nblocks, uint32_t flags, struct kvs_op **op, int64_t *id);
/* Forget an op still in state `created` (its submit was refused). */
KVS_HIDDEN void kvs_op_drop(struct kvs_op *op);
/* Fire `event` on the op through the generated table; nothing changes unless KVS_OK. */
KVS_HIDDEN int kvs_op_step(struct kvs_op *op, int event);
/* The bookkeeping after a step the backend fired: counters; for finish and fail, the
 * result (error: KVS_E_*, result: the backend's own code, a CUresult), per-region
 * accounting and a wakeup of kvs_wait. */
KVS_HIDDEN void kvs_op_stepped(struct kvs_op *op, int event, int32_t error, int32_t result);

/* Completion reports (kvs_reports.c) and the ops they count (kvs_ops.c), under the lock. */
struct kvs_report;
/* One of the report's ops became collectable (failed: it did not finish); the last sends. */
KVS_HIDDEN void kvs_report_count_down(struct kvs_report *r, int failed);
/* Op `id` counts down in `r`: KVS_E_NOENT (no such op), KVS_E_INVAL (it has a report). */
KVS_HIDDEN int kvs_op_claim_report(int64_t id, struct kvs_report *r);
KVS_HIDDEN void kvs_op_unclaim_report(int64_t id, struct kvs_report *r);
/* Counts op `id` down at once if it is collectable already. */
KVS_HIDDEN void kvs_op_settle_report(int64_t id);

#endif /* KVS_ENGINE_H */
