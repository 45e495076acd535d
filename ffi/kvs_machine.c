/* The executor of every generated lifecycle table (kvs_machine.h): kvs_machine_fire().
 *
 * It has the rules of kvstate.core.machine.Lifecycle.fire, which stays the reference (a
 * differential test holds the two to the same states and refusals):
 *
 *   1. an event undeclared in the state is KVS_E_ILLEGAL and nothing runs;
 *   2. the pair's rows are tried in table order; the first whose guards all hold and
 *      whose `unless` guards all do not fires. If none does, KVS_E_GUARD, and the refusal
 *      lists, row by row, each guard that did not hold and each `unless` guard that did;
 *   3. the row's effects run in order; when one fails, the ones before it are undone in
 *      reverse order and KVS_E_EFFECT names it, the state unchanged;
 *   4. only then is the state committed.
 *
 * Guards are bits the caller evaluated (`holds`), so they cannot fail half way. Each
 * instance serialises its own fires with a word holding the firing thread's id: another
 * thread waits (in the native control plane an instance has one owner thread, so it does
 * not), and the firing thread itself, firing again from an effect, is refused with
 * KVS_E_REENTRANT instead of deadlocking, as Python's TransitionError (reentrant). Nothing here
 * takes kvstate's global lock or touches Python.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stddef.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kvs.h"
#include "kvs_machines.h"

static _Thread_local uint32_t my_tid;

static uint32_t self_id(void) {
    if (!my_tid) my_tid = (uint32_t)syscall(SYS_gettid);
    return my_tid;
}

int kvs_machine_init(kvs_machine_inst *m, int32_t machine) {
    const struct kvs_mtable *t = kvs_mtable_get(machine);
    if (!m || !t) return KVS_E_INVAL;
    m->machine = machine;
    m->state = t->initial;
    __atomic_store_n(&m->owner, 0, __ATOMIC_RELEASE);
    m->reserved = 0;
    return KVS_OK;
}

/* Take the instance for this thread: KVS_OK, or KVS_E_REENTRANT when it already has it. */
static int take(kvs_machine_inst *m) {
    uint32_t me = self_id();
    for (;;) {
        uint32_t free_ = 0;
        if (__atomic_compare_exchange_n(&m->owner, &free_, me, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
            return KVS_OK;
        if (free_ == me) return KVS_E_REENTRANT;
        sched_yield();
    }
}

static void give(kvs_machine_inst *m) { __atomic_store_n(&m->owner, 0, __ATOMIC_RELEASE); }

static int admits(const struct kvs_mrow *row, uint64_t holds) {
    for (int k = 0; k < row->nguards; k++)
        if (!(holds >> row->guards[k] & 1)) return 0;
    for (int k = 0; k < row->nunless; k++)
        if (holds >> row->unless[k] & 1) return 0;
    return 1;
}

/* Every refusing guard of every row, in Python's order (Lifecycle._refusing_guards). */
static void refusal(const struct kvs_mtable *t, int first, int count, uint64_t holds, kvs_fire_result *out) {
    int n = 0;
    for (int i = first; i < first + count; i++) {
        const struct kvs_mrow *row = &t->rows[t->order[i]];
        for (int k = 0; k < row->nguards && n < 16; k++)
            if (!(holds >> row->guards[k] & 1)) out->refused[n++] = row->guards[k];
        for (int k = 0; k < row->nunless && n < 16; k++)
            if (holds >> row->unless[k] & 1) out->refused[n++] = -1 - row->unless[k];
    }
    out->nrefused = n;
}

static int fire_locked(const struct kvs_mtable *t, kvs_machine_inst *m, int32_t event, uint64_t holds,
                       kvs_effect_fn fx, void *ctx, kvs_fire_result *out) {
    int32_t state = m->state;
    out->source = out->dest = state;
    if (state < 0 || state >= t->nstates || event < 0 || event >= t->nevents) return KVS_E_ILLEGAL;
    int first = t->first[state * t->nevents + event];
    if (first < 0) return KVS_E_ILLEGAL;
    int count = t->count[state * t->nevents + event];
    for (int i = first; i < first + count; i++) {
        const struct kvs_mrow *row = &t->rows[t->order[i]];
        if (!admits(row, holds)) continue;
        if (row->neffects && !fx) return KVS_E_INVAL;
        out->row = t->order[i];
        for (int k = 0; k < row->neffects; k++) {
            int32_t rc = fx(ctx, row->effects[k], 0);
            if (rc != 0) {
                out->effect = row->effects[k];
                out->error = rc;
                while (k-- > 0) {
                    out->undone++;
                    if (fx(ctx, row->effects[k], 1) != 0) out->undo_failed++;
                }
                return KVS_E_EFFECT;
            }
        }
        m->state = out->dest = row->dest;
        return KVS_OK;
    }
    refusal(t, first, count, holds, out);
    return KVS_E_GUARD;
}

/* `out` belongs to the caller of this fire alone: it is written before the instance is
 * taken, so two threads firing on one instance must not share one. */
int kvs_machine_fire(kvs_machine_inst *m, int32_t event, uint64_t holds, kvs_effect_fn fx, void *ctx,
                     kvs_fire_result *out) {
    kvs_fire_result scratch;
    if (!out) out = &scratch;
    memset(out, 0, sizeof *out);
    out->row = out->effect = -1;
    const struct kvs_mtable *t = m ? kvs_mtable_get(m->machine) : NULL;
    if (!t) return KVS_E_INVAL;
    int rc = take(m);
    if (rc != KVS_OK) {
        out->source = out->dest = m->state; /* read by the thread that is firing: its own state */
        return rc;
    }
    rc = fire_locked(t, m, event, holds, fx, ctx, out);
    give(m);
    return rc;
}

/* -- a planned effect callback, for callers without one of their own ------------------ */

struct plan {
    kvs_machine_inst *m;
    int32_t event;
    uint64_t holds, fail_effects, fail_undos, reenter_effects;
    int32_t *log;
    int32_t cap, n;
    int32_t reentered; /* once per planned fire: an executor that let it in must not recurse */
};

static int32_t planned(void *ctx, int32_t effect, int32_t undo) {
    struct plan *p = ctx;
    if (p->n < p->cap) p->log[p->n++] = undo ? -1 - effect : effect;
    if (!undo && (p->reenter_effects >> effect & 1) && !p->reentered) { /* the same event, from inside */
        p->reentered = 1;
        return kvs_machine_fire(p->m, p->event, p->holds, planned, p, NULL);
    }
    uint64_t fails = undo ? p->fail_undos : p->fail_effects;
    return (fails >> effect & 1) ? KVS_E_INJECTED : KVS_OK;
}

int kvs_machine_fire_planned(kvs_machine_inst *m, int32_t event, uint64_t holds, uint64_t fail_effects,
                             uint64_t fail_undos, uint64_t reenter_effects, int32_t *log, int32_t logcap,
                             int32_t *nlog, kvs_fire_result *out) {
    if (!log || !nlog || logcap < 2 * KVS_MROW_MAX) return KVS_E_INVAL;
    struct plan p = {m, event, holds, fail_effects, fail_undos, reenter_effects, log, logcap, 0, 0};
    *nlog = 0;
    int rc = kvs_machine_fire(m, event, holds, planned, &p, out);
    *nlog = p.n;
    return rc;
}
