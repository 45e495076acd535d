/* The decode index's lookup table, mirrored in C and served by a thread that never takes
 * the GIL (kvs_index.c: the table and its answers; kvs_index_thread.c: the thread).
 *
 * The decode engine's scheduler process (vLLM's EngineCore) owns the index
 * (kvstate/integrations/vllm/index.py) and busy-polls holding its GIL, so a prefill
 * scheduler's `lookup` and `descriptors` are answered here, from a mirror that Python
 * keeps up to date off the request path: a block is advertised once every decode rank
 * reported it stored and withdrawn when eviction picks it; the ranks' descriptors,
 * epochs and generation are set whenever every rank is connected at one generation.
 * Anything else on the socket (a decode rank's `hello`, a question under another
 * compatibility key, a malformed message) is handed to Python with its connection, and
 * Python's DecodeIndex, the reference, serves that connection from then on.
 *
 * Stores, too, are taken in here: Python names each block it assigns (kvs_index_expect)
 * and each rank's process (kvs_index_rank); a rank opens a second connection, its report
 * link (`report_link`, answered `linked`), on which its op engine sends each `stored`
 * report. The thread counts the ranks that stored each expected block and advertises it
 * once all have, then queues the report for Python's table (kvs_index_next_report), which
 * keeps its own account: so the index's Python is off the path from a store's end to the
 * lookups that find it. */
#ifndef KVS_INDEX_H
#define KVS_INDEX_H

#include <stdint.h>

typedef struct kvs_index kvs_index;

#define KVS_INDEX_PYTHON 1 /* kvs_index_answer: Python answers this request */

/* `compat`: the JSON text of this engine's compatibility key as the wire encodes it;
 * `not_ready`: the whole `refused` (decode_not_ready) reply; `capacity`: bank blocks;
 * `first_ns`: how long a new connection may stay silent, `idle_ns` one that was answered. */
int kvs_index_new(const char *compat, uint32_t compat_len, const char *not_ready, uint32_t not_ready_len,
                  uint32_t hash_bytes, uint32_t capacity, uint32_t max_blocks, int32_t max_payload,
                  uint32_t allowed_uid, int32_t max_connections, int64_t first_ns, int64_t idle_ns,
                  kvs_index **out);
void kvs_index_free(kvs_index *x); /* after kvs_index_stop */
/* New deadlines (as kvs_index_new's), for the connections' next requests. */
int kvs_index_deadlines(kvs_index *x, int64_t first_ns, int64_t idle_ns);
/* Bank block `slot` holds the block `hash` (hash_bytes) under inventory key `key`, on every
 * rank. The same again is KVS_OK; an expected block of that hash, slot and key becomes advertised. */
int kvs_index_advertise(kvs_index *x, const uint8_t *hash, uint32_t slot, uint64_t key);
/* Bank block `slot` will hold `hash` under `key` once each of `tp` ranks (at most 64)
 * reported it stored: KVS_E_BUSY when the block is advertised or expected already. */
int kvs_index_expect(kvs_index *x, const uint8_t *hash, uint32_t slot, uint64_t key, uint32_t tp);
/* No longer expected (a store failed, or Python's table completed it): KVS_E_NOENT when it was not. */
int kvs_index_settle(kvs_index *x, uint32_t slot, uint64_t key);
/* Rank `rank` runs in process `pid` (0: no process; its report link closes at its next report). */
int kvs_index_rank(kvs_index *x, uint32_t rank, int32_t pid);
/* The next `stored` report the thread took (1, `len` bytes in `buf`), or 0. */
int32_t kvs_index_next_report(kvs_index *x, char *buf, uint32_t cap, uint32_t *len);
int64_t kvs_index_advertised_here(kvs_index *x); /* blocks the thread advertised from reports */
/* No longer advertised (KVS_E_NOENT: it was not). */
int kvs_index_withdraw(kvs_index *x, const uint8_t *hash);
int32_t kvs_index_advertised(kvs_index *x); /* how many blocks are */
/* Every rank connected at one generation: the whole `descriptor_set` reply, each rank's epoch. */
int kvs_index_ready(kvs_index *x, const char *descriptor_set, uint32_t len, const uint64_t *epochs, uint32_t tp,
                    uint64_t generation);
int kvs_index_unready(kvs_index *x);
/* The reply to one request payload (KVS_OK, *outlen bytes in `out`), or KVS_INDEX_PYTHON. */
int kvs_index_answer(kvs_index *x, const char *req, uint32_t len, char *out, uint32_t cap, uint32_t *outlen);
/* The bank blocks lookups found since the last call, oldest first (for the LRU order). */
int32_t kvs_index_touched(kvs_index *x, uint32_t *slots, int32_t cap);
int64_t kvs_index_lookups(kvs_index *x); /* lookups answered here while ready */
/* Serve the listening socket (bound by Python's kvstate.channel.Server, which keeps it). */
int kvs_index_serve(kvs_index *x, int32_t listen_fd);
int kvs_index_stop(kvs_index *x); /* stop and join the thread; its connections close */
int32_t kvs_index_connections(kvs_index *x);
int32_t kvs_index_handoff_fd(kvs_index *x); /* an eventfd, readable when a connection waits for Python */
/* The next connection for Python (1, its fd now Python's, with the request it sent), or 0. */
int32_t kvs_index_next_handoff(kvs_index *x, int32_t *fd, char *buf, uint32_t cap, uint32_t *len);

#endif /* KVS_INDEX_H */
