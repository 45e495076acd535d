/* The op lifecycle, executed: kvs_op_step() fires only the rows of the table generated
 * from spec/op.toml (kvs_op_table.h). An undeclared (state, event) pair is refused with
 * KVS_E_ILLEGAL, guards are evaluated by name, effects run in the row's order (undone in
 * reverse if one fails) and the state is committed last. Pins therefore follow the
 * table: pin_regions on submit, unpin_regions on finish, fail and cancel (INV-OP-PINS).
 * Called under kvs_g.mu by the op engine (kvs_ops.c) and the CUDA backend. */
#include "kvs_op.h"

static int guard_holds(const struct kvs_op *op, uint32_t guard) {
    switch (guard) {
    case KVS_OP_GUARD_REGIONS_MAPPED: {
        const struct kvs_region *s = kvs_region_find(op->src_region), *d = kvs_region_find(op->dst_region);
        if (op->src_region && (!s || s->access < KVS_ACCESS_READ)) return 0;
        if (op->dst_region && (!d || d->access < KVS_ACCESS_READ_WRITE)) return 0;
        return 1;
    }
    default:
        return 0; /* a guard this engine does not implement never holds */
    }
}

static int guard_error(uint32_t guard) {
    return guard == KVS_OP_GUARD_REGIONS_MAPPED ? KVS_E_ACCESS : KVS_E_ILLEGAL;
}

static void pin(struct kvs_op *op, int delta) {
    uint64_t ids[2] = {op->src_region, op->dst_region == op->src_region ? 0 : op->dst_region};
    for (int i = 0; i < 2; i++) {
        struct kvs_region *g = kvs_region_find(ids[i]);
        if (!g) continue;
        g->pins += (uint64_t)(int64_t)delta;
        g->inflight += (uint64_t)(int64_t)delta;
    }
}

/* Run (or, with undo, reverse) one effect. */
static int effect(struct kvs_op *op, uint32_t fx, int undo) {
    switch (fx) {
    case KVS_OP_FX_PIN_REGIONS: pin(op, undo ? -1 : 1); return KVS_OK;
    case KVS_OP_FX_UNPIN_REGIONS: pin(op, undo ? 1 : -1); return KVS_OK;
    default: return KVS_E_ILLEGAL; /* an effect this engine does not implement refuses */
    }
}

/* Fire `event` on `op`, under kvs_g.mu. Nothing changes unless KVS_OK is returned. */
int kvs_op_step(struct kvs_op *op, int event) {
    if (op->state < 0 || op->state >= KVS_OP_NSTATES || event < 0 || event >= KVS_OP_NEVENTS)
        return KVS_E_ILLEGAL;
    int first = kvs_op_first[op->state][event];
    if (first < 0) return KVS_E_ILLEGAL;
    int refused = KVS_E_ILLEGAL;
    for (int i = first; i < first + kvs_op_count[op->state][event]; i++) {
        const struct kvs_op_row *row = &kvs_op_rows[i];
        uint32_t failing = 0;
        for (uint32_t b = 0; b < 32; b++) {
            uint32_t g = UINT32_C(1) << b;
            if ((row->guards & g) && !guard_holds(op, g)) failing |= g;
            if ((row->unless & g) && guard_holds(op, g)) failing |= g;
        }
        if (failing) {
            refused = guard_error(failing & -failing);
            continue;
        }
        for (int k = 0; k < row->neffects; k++) {
            int rc = effect(op, row->effects[k], 0);
            if (rc != KVS_OK) {
                while (k-- > 0) effect(op, row->effects[k], 1);
                return rc;
            }
        }
        op->state = row->dest;
        return KVS_OK;
    }
    return refused;
}

/* The engine itself fires submit (created), start (queued), finish and fail (running) and
 * cannot take a refusal there once work has begun. A table that does not declare those
 * rows unguarded is unusable: every submit is refused rather than the engine aborting. */
static int row_unguarded(int state, int event) {
    int first = kvs_op_first[state][event];
    return first >= 0 && !kvs_op_rows[first].guards && !kvs_op_rows[first].unless;
}

int kvs_op_table_usable(void) {
    return kvs_op_first[KVS_OP_INITIAL][KVS_OP_EV_SUBMIT] >= 0 &&
           row_unguarded(KVS_OP_QUEUED, KVS_OP_EV_START) &&
           row_unguarded(KVS_OP_RUNNING, KVS_OP_EV_FINISH) &&
           row_unguarded(KVS_OP_RUNNING, KVS_OP_EV_FAIL);
}

/* -- the table's names (observation) ------------------------------------------------- */

int32_t kvs_op_nstates(void) { return KVS_OP_NSTATES; }
const char *kvs_op_table_digest(void) { return KVS_OP_TABLE_DIGEST; }
int32_t kvs_op_nevents(void) { return KVS_OP_NEVENTS; }

const char *kvs_op_state_name(int32_t state) {
    return state >= 0 && state < KVS_OP_NSTATES ? kvs_op_state_names[state] : NULL;
}

const char *kvs_op_event_name(int32_t event) {
    return event >= 0 && event < KVS_OP_NEVENTS ? kvs_op_event_names[event] : NULL;
}
