/* The op record the op engine (kvs_ops.c) keeps and the generated table
 * (kvs_op_table.c) steps. Engine-internal. */
#ifndef KVS_OP_H
#define KVS_OP_H

#include "kvs_engine.h"

#define KVS_MAX_WORKERS 64

struct kvs_op {
    uint64_t id; /* first: slot-table id; the public op id is this value as int64_t */
    int32_t state;
    int32_t error;
    int32_t result; /* an external backend's own code for a failure (a CUresult) */
    uint32_t flags;
    uint64_t src_region, dst_region; /* 0 for caller buffers */
    uint64_t src_base, dst_base;     /* resolved addresses */
    kvs_block *blocks;
    uint64_t nblocks;
    uint64_t bytes;
    uint32_t nparts, next_part, parts_done;
    int32_t part_error;
    int32_t notify_fd; /* written (8 bytes: 1) once the op is collectable; 0 = none */
    struct kvs_report *report; /* counted down once the op is collectable; NULL = none */
    struct kvs_op *qnext;
    int32_t allowed; /* started under kvs_engine_allow while paused: its parts may run */
    kvs_block inline_blocks[KVS_MAX_WORKERS]; /* small ops need no second malloc */
};

/* Whether the generated table declares the rows the engine fires and cannot take a
 * refusal of; every submit is refused otherwise (kvs_op_table.c). */
KVS_HIDDEN int kvs_op_table_usable(void);

#endif /* KVS_OP_H */
