/* The shape of a generated lifecycle table, shared by the generator's output
 * (kvs_bank_table.h, kvs_part_table.h: one per machine of spec/ that runs natively) and the
 * one executor of every such table (kvs_machine.c). Nothing here is written by hand per
 * machine: the rows, their order and every name come from spec/ through `kvstate generate`.
 *
 * Dispatch mirrors kvstate.core.machine.Lifecycle: the rows of one (state, event) pair are
 * listed in table order in `order`, from `first[state * nevents + event]` (-1: the pair is
 * undeclared) for `count` entries; the first row whose guards hold and whose `unless`
 * guards do not fires. Guards and effects are small ids, kept in the row's own order so a
 * refusal names its guards in the order Python names them.
 */
#ifndef KVS_MACHINE_H
#define KVS_MACHINE_H

#include <stdint.h>

/* The most guards, unless guards or effects one row may name (the generator checks). */
#define KVS_MROW_MAX 8

struct kvs_mrow {
    int16_t dest;
    uint8_t nguards, nunless, neffects;
    int8_t guards[KVS_MROW_MAX];  /* guard ids that must hold, in table order */
    int8_t unless[KVS_MROW_MAX];  /* guard ids that must not hold, in table order */
    int8_t effects[KVS_MROW_MAX]; /* effect ids, run in this order */
};

struct kvs_mtable {
    const char *name;
    const char *digest; /* kvstate.derive.header.table_digest() of the table */
    int32_t nstates, nevents, nguards, neffects, nrows, initial;
    int32_t max_refused; /* the longest refusal any (state, event) pair can report */
    const int16_t *first; /* [state * nevents + event] -> index into order, or -1 */
    const uint8_t *count; /* [state * nevents + event] -> rows to try */
    const int16_t *order; /* row indices, grouped by (state, event), table order within */
    const struct kvs_mrow *rows;
    const uint8_t *terminal;
    const char *const *state_names, *const *event_names, *const *guard_names, *const *effect_names;
};

#endif /* KVS_MACHINE_H */
