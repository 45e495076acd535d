/* The registry of generated lifecycle tables (kvs_machines.c), for the executor. */
#ifndef KVS_MACHINES_H
#define KVS_MACHINES_H

#include <stdint.h>

#include "kvs_machine.h"

/* The table of machine id `machine` (KVS_MACHINE_*), or NULL. */
const struct kvs_mtable *kvs_mtable_get(int32_t machine);

#endif /* KVS_MACHINES_H */
