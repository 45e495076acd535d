/* The registry of lifecycle tables the native executor runs: the headers generated from
 * spec/ (`kvstate generate`), by id (KVS_MACHINE_* in kvs.h, the order of
 * kvstate.derive.header.NATIVE_MACHINES), and what Python reads to check them against
 * the tables it loads (names, sizes, digests). Nothing here decides a transition.
 */
#include <stddef.h>

#include "kvs.h"
#include "kvs_machines.h"
#include "kvs_bank_table.h"
#include "kvs_part_table.h"

static const struct kvs_mtable *const tables[] = {
    [KVS_MACHINE_BANK] = &kvs_bank_table,
    [KVS_MACHINE_PART] = &kvs_part_table,
};
#define NTABLES ((int32_t)(sizeof tables / sizeof tables[0]))

_Static_assert(KVS_BANK_NGUARDS <= 64 && KVS_PART_NGUARDS <= 64, "guards are a 64-bit mask");

const struct kvs_mtable *kvs_mtable_get(int32_t machine) {
    return machine >= 0 && machine < NTABLES ? tables[machine] : NULL;
}

int32_t kvs_machine_count(void) { return NTABLES; }

const char *kvs_machine_digest(int32_t machine) {
    const struct kvs_mtable *t = kvs_mtable_get(machine);
    return t ? t->digest : NULL;
}

int32_t kvs_machine_size(int32_t machine, int32_t kind) {
    const struct kvs_mtable *t = kvs_mtable_get(machine);
    if (!t) return -1;
    switch (kind) {
    case KVS_MNAME_MACHINE: return 1;
    case KVS_MNAME_STATE: return t->nstates;
    case KVS_MNAME_EVENT: return t->nevents;
    case KVS_MNAME_GUARD: return t->nguards;
    case KVS_MNAME_EFFECT: return t->neffects;
    default: return -1;
    }
}

const char *kvs_machine_name(int32_t machine, int32_t kind, int32_t index) {
    const struct kvs_mtable *t = kvs_mtable_get(machine);
    if (!t || index < 0 || index >= kvs_machine_size(machine, kind)) return NULL;
    switch (kind) {
    case KVS_MNAME_MACHINE: return t->name;
    case KVS_MNAME_STATE: return t->state_names[index];
    case KVS_MNAME_EVENT: return t->event_names[index];
    case KVS_MNAME_GUARD: return t->guard_names[index];
    default: return t->effect_names[index];
    }
}

int32_t kvs_machine_terminal(int32_t machine, int32_t state) {
    const struct kvs_mtable *t = kvs_mtable_get(machine);
    if (!t || state < 0 || state >= t->nstates) return -1;
    return t->terminal[state];
}

int32_t kvs_machine_may(int32_t machine, int32_t state, int32_t event) {
    const struct kvs_mtable *t = kvs_mtable_get(machine);
    if (!t || state < 0 || state >= t->nstates || event < 0 || event >= t->nevents) return -1;
    return t->first[state * t->nevents + event] >= 0;
}
