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
#define KVS_INDEX_REPORTS 4096  /* stored reports waiting for Python (more: the links wait) */
#define KVS_INDEX_MAX_TP 64     /* ranks whose stores the thread counts (a bit each) */

/* What a bank block is in the mirror (`live`). */
#define KVS_SLOT_FREE 0
#define KVS_SLOT_ADVERTISED 1 /* in `index`: lookups find it */
#define KVS_SLOT_EXPECTED 2   /* in `by_key`: advertised once every rank reported it stored */

/* A message waiting for Python: a connection handed over (its fd, the request it sent),
 * or a rank's `stored` report (fd -1). */
struct kvs_index_msg {
    int fd;
    char *buf;
    uint32_t len;
};

/* A first-in first-out ring of them, over storage of `size` entries. */
struct kvs_index_queue {
    struct kvs_index_msg *at;
    int size, head, n;
};

struct kvs_index_conn {
    int fd;          /* -1: free */
    int64_t until_ns; /* CLOCK_MONOTONIC: closed when silent past it */
    int32_t pid;     /* the peer's, from SO_PEERCRED */
    int32_t rank;    /* >= 0: a rank's report link (kvs_index_link) */
    int paused;      /* a report link not read while Python's queue of reports is full */
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
    /* expected blocks (a store in flight on some rank): `by_key` maps a key to its block + 1,
     * `ranks` holds a bit per rank that reported it stored; `store_tp` ranks make it whole */
    uint32_t *by_key;
    uint64_t *ranks;
    uint32_t store_tp;
    int32_t rank_pid[KVS_INDEX_MAX_TP]; /* each rank's process (0: none), set by Python */
    int64_t advertised_here;            /* blocks the thread advertised from the ranks' reports */
    /* stored reports for Python's table, in the order they came */
    struct kvs_index_msg report_at[KVS_INDEX_REPORTS];
    struct kvs_index_queue reports;
    uint64_t *report_keys; /* scratch of kvs_index_take_report: one report's keys (max_blocks) */
    /* the ranks, while ready */
    int ready;
    char *descriptor_set;
    uint32_t descriptor_set_len, tp;
    uint64_t *epochs, generation;
    int64_t lookups;
    uint32_t *touched, touched_head, touched_n;
    struct kj_req req; /* scratch of kvs_index_answer */
    /* connections for Python */
    struct kvs_index_msg handoff_at[KVS_INDEX_HANDOFFS];
    struct kvs_index_queue handoffs;
    int handoff_fd; /* an eventfd Python waits on, for both queues */
    /* the thread */
    struct kvs_index_conn *conns;
    int nconns;
    int listen_fd, epoll_fd, cmd_fd, running, stopping;
    pthread_t thread;
};

/* kvs_index.c: close and free what `q` still holds (under `mu`). */
void kvs_index_queue_clear(struct kvs_index_queue *q);
/* kvs_index.c, for the thread: queue `fd` (now Python's) with the request it sent; -1 when full. */
int kvs_index_hand_over(struct kvs_index *x, int fd, const char *req, uint32_t len);
/* kvs_index.c, for the thread: the rank whose report link `req` (a `report_link`) opens from
 * process `pid` (>= 0, its `linked` reply in `out`), -1 when refused (not that rank's
 * process), -2 when `req` is no `report_link` (the usual answers take it). */
int kvs_index_link(struct kvs_index *x, const char *req, uint32_t len, int32_t pid, char *out, uint32_t cap,
                   uint32_t *outlen);
/* kvs_index.c, for the thread: apply one `stored` report of `rank` from process `pid` and
 * queue it for Python; -1 when the link must close (not that rank's any more, or malformed;
 * a full queue too, which the thread never meets: it looks for room before it reads). */
int kvs_index_take_report(struct kvs_index *x, int32_t rank, int32_t pid, const char *msg, uint32_t len);
/* kvs_index.c, for the thread: whether Python's report queue has room (else a link waits). */
int kvs_index_report_room(struct kvs_index *x);

#endif /* KVS_INDEX_STATE_H */
