/* The decode index mirror's own data, shared by its table (kvs_index.c) and its thread
 * (kvs_index_thread.c). Everything here is guarded by `mu`, except what only the thread
 * touches (the connections). */
#ifndef KVS_INDEX_STATE_H
#define KVS_INDEX_STATE_H

#include <pthread.h>
#include <stdint.h>

#include "kvs_index.h"
#include "kvs_json.h"

#define KVS_INDEX_TOUCHED 65536 /* lookups' finds kept for the LRU order (more: the oldest go) */
#define KVS_INDEX_HANDOFFS 64   /* connections waiting for Python (more: closed) */

struct kvs_index_conn {
    int fd;          /* -1: free */
    int64_t until_ns; /* CLOCK_MONOTONIC: closed when silent past it */
};

struct kvs_index {
    pthread_mutex_t mu;
    /* fixed at kvs_index_new */
    char *compat, *not_ready;
    uint32_t compat_len, not_ready_len, hash_bytes, capacity, max_blocks;
    int32_t max_payload, max_connections;
    uint32_t uid;
    int64_t first_ns, idle_ns;
    /* the table: per bank block its hash and key; `index` maps a hash to its block + 1 */
    uint8_t *hashes, *live;
    uint64_t *keys;
    uint32_t *index, mask, nlive;
    /* the ranks, while ready */
    int ready;
    char *descriptor_set;
    uint32_t descriptor_set_len, tp;
    uint64_t *epochs, generation;
    int64_t lookups;
    uint32_t *touched, touched_head, touched_n;
    struct kj_req req; /* scratch of kvs_index_answer */
    /* connections for Python */
    struct { int fd; char *buf; uint32_t len; } handoff[KVS_INDEX_HANDOFFS];
    int handoff_head, handoff_n, handoff_fd;
    /* the thread */
    struct kvs_index_conn *conns;
    int nconns;
    int listen_fd, epoll_fd, cmd_fd, running, stopping;
    pthread_t thread;
};

/* kvs_index.c, for the thread: queue `fd` (now Python's) with the request it sent; -1 when full. */
int kvs_index_hand_over(struct kvs_index *x, int fd, const char *req, uint32_t len);

#endif /* KVS_INDEX_STATE_H */
