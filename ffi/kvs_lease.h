/* The lease server's own data, shared by its rules (kvs_lease.c) and its thread
 * (kvs_lease_thread.c). Everything here is guarded by `mu` (recursive: Python's effects,
 * called from inside kvs_lease_fire, publish through it again). */
#ifndef KVS_LEASE_H
#define KVS_LEASE_H

#include <pthread.h>
#include <stdint.h>

#include "kvs.h"
#include "kvs_inventory.h"
#include "kvs_json.h"

struct kvs_lease {
    int64_t id;
    uint64_t conn;
    int64_t expires_ns; /* CLOCK_MONOTONIC; moved on by each renewal */
    int expired;        /* ran out unrenewed: kept until returned or disconnected */
    int pid;
    int32_t inv_group;  /* the inventory group whose blocks it pins, or -1 */
    uint32_t nhashes;
    uint64_t *hashes;   /* those blocks (owned) */
};

/* An importer that may have a bank of memory nobody counts open: one pin on the region. */
struct kvs_hold {
    int64_t id;
    uint64_t conn;
    int conn_open; /* 0: this side closed the connection; the pidfd says when it let go */
    int pidfd;     /* -1: the process was gone at the grant */
};

struct kvs_bank {
    int live;
    kvs_machine_inst m;
    int uncounted;
    int64_t generation;
    char incarnation[65];
    int64_t descriptor_expires_ns; /* CLOCK_REALTIME; 0: no descriptor */
    int fd;                        /* the exported fd sent with each grant, or -1 */
    int epoch_fd;                  /* the bank's epoch page, sent on `block_epochs`, or -1 (kvstate.share.epochs) */
    int64_t epoch_blocks;          /* its entries */
    uint64_t region;               /* pinned by holds */
    char *report;                  /* the `bank` object of a grant, rendered by Python */
    struct kvs_lease *leases;      /* max_leases slots */
    int nleases;
    struct kvs_hold *holds;
    int nholds, capholds;
};

struct kvs_conn {
    uint64_t id;
    int fd;    /* -1: served by Python (kvs_lease_handle) */
    int pidfd; /* -1: none (always so across nodes) */
    int pid;
    /* A TCP stream (kvs_lease_tcp.c): frames are reassembled in `in`; an answer the
     * socket did not take whole waits in `out`, and no request is read meanwhile. */
    int tcp;
    char *in, *out;
    uint32_t nin, nout, sent;
};

/* A TCP peer that has not yet proved it holds the deployment's key. */
struct kvs_handshake {
    int fd;
    uint64_t serial; /* its epoll tag: (serial << 4) | 2 */
    int64_t deadline_ns;
    uint8_t nonce[32];
    uint8_t got[76]; /* header, nonce_c, MAC */
    uint32_t ngot;
};

#define KVS_LEASE_RING 4096

struct kvs_lease_server {
    pthread_mutex_t mu;
    int64_t lease_timeout_ns;
    int32_t max_leases, max_payload, max_fds, max_connections;
    uint32_t uid;
    int64_t next_lease, lease_requests;
    uint64_t next_conn;
    int nbanks;
    struct kvs_bank banks[KVS_LEASE_MAX_RANKS];
    struct kvs_conn *conns;
    int nconns;
    struct kj_req req; /* scratch of kvs_lease_handle */
    struct kvs_inv inv; /* the retained inventory, for leases naming blocks */
    /* committed transitions, for Python */
    kvs_lease_event ring[KVS_LEASE_RING];
    uint32_t head, tail;
    int32_t dropped;
    int events_fd;
    /* While a request is answered, its transitions are signalled once, after the answer
     * went out (kvs_lease_answer_frame): Python's wake-up is never on the importer's path. */
    int hold_events, events_due;
    /* requests Python serves: a bounded FIFO of copies */
    struct pyreq { uint64_t conn; char *buf; uint32_t len; } pyq[64];
    int pyq_head, pyq_n;
    int requests_fd;
    /* the thread */
    int listen_fd, epoll_fd, timer_fd, cmd_fd;
    /* TCP (kvs_lease_tcp.c): its listening socket (Python's), the deployment key, and the
     * handshakes under way, oldest first, under their own lock `hs_mu` (never `mu`, which
     * Python's fires hold while their effects wait for the GIL) */
    pthread_mutex_t hs_mu;
    int tcp_fd;
    uint8_t key[64], person[16];
    uint32_t keylen, personlen;
    int32_t max_handshakes, keepalive[3];
    int64_t handshake_ns;
    struct kvs_handshake *hs;
    int nhs;
    uint64_t next_hs;
    int running, stopping;
    pthread_t thread;
    /* refused connections, half closed for a moment so the refusal is read before a close
     * with the peer's request unread turns into a reset (as kvstate.channel.Server does) */
    struct { int fd; int64_t until_ns; } lingering[64];
    int nlingering;
};

/* kvs_lease.c, for the thread: */
struct kvs_conn *kvs_lease_conn(struct kvs_lease_server *s, uint64_t id);
/* Add a connection (fd, pidfd owned from here); its id, or 0 when the table is full. */
uint64_t kvs_lease_conn_add(struct kvs_lease_server *s, int fd, int pidfd, int pid);
/* End `conn`'s leases (peer_died), drop its holds when the importer closed, close its fds. */
void kvs_lease_conn_end(struct kvs_lease_server *s, uint64_t conn, int importer_closed, int why);
/* The nearest expiry of a live lease (CLOCK_MONOTONIC ns), or 0. */
int64_t kvs_lease_next_expiry(struct kvs_lease_server *s);
int64_t kvs_lease_now(void);

/* kvs_lease.c, for the answers (kvs_lease_answer.c): */
struct kvs_bank *kvs_lease_bank_of(struct kvs_lease_server *s, int64_t rank); /* NULL: no such bank */
struct kvs_lease *kvs_lease_find(struct kvs_bank *b, int64_t id);
int kvs_lease_find_hold(struct kvs_bank *b, int64_t id); /* its index, or -1 */
void kvs_lease_drop_hold(struct kvs_bank *b, int k);
/* One fire of the bank table's lease event on `c->lease`, with the guards as they are now. */
struct fx_ctx { /* a lease fire: what its effects (kvs_lease.c) act on */
    struct kvs_lease_server *s;
    struct kvs_bank *b;
    int64_t lease;
    uint64_t conn;
    int pid, still_open;
    struct kvs_inv_want want; /* the blocks a grant pins (group -1: none) */
    int ended;                /* END_LEASE ran: `saved` holds the ended lease */
    struct kvs_lease saved; /* for an undo */
    int64_t saved_expires;
    kvs_effect_fn py; /* Python's effects (kvs_lease_fire) */
    void *py_ctx;
};
int kvs_lease_fire_one(struct kvs_lease_server *s, int32_t rank, int32_t event, struct fx_ctx *c, int32_t why,
                       kvs_fire_result *out);
/* kvs_lease.c, for kvs_lease_answer_frame: */
/* Signal events_fd now, unless a request's answer is being made (then once it is sent). */
void kvs_lease_events_signal(struct kvs_lease_server *s);

/* kvs_lease_thread.c, for kvs_lease_tcp.c: */
int kvs_lease_watch(struct kvs_lease_server *s, int fd, uint64_t tag, uint32_t events);
void kvs_lease_end_conn(struct kvs_lease_server *s, struct kvs_conn *cn, int importer_closed, int why);
/* Answer one request of `cn` (its frame checked): natively, or queued for Python. */
void kvs_lease_answer_frame(struct kvs_lease_server *s, struct kvs_conn *cn, const char *payload, uint32_t len,
                            char *reply, uint32_t rcap);
int kvs_lease_send(struct kvs_lease_server *s, struct kvs_conn *cn, const char *payload, uint32_t len,
                   const int32_t *fds, int32_t nfds);
#define KVS_LEASE_HEADER 12
#define KVS_LEASE_CONN_TAG(id) (((id) << 4) | 4u)
#define KVS_LEASE_HS_TAG(serial) (((serial) << 4) | 2u)
#define KVS_LEASE_TAG_TCP 5ull

/* kvs_lease_tcp.c, for the thread: served connections with `mu` held by the caller; handshakes take `hs_mu`. */
void kvs_tcp_accept(struct kvs_lease_server *s);
void kvs_tcp_handshake(struct kvs_lease_server *s, uint64_t serial);
int64_t kvs_tcp_expire_handshakes(struct kvs_lease_server *s); /* the next deadline, or 0 */
void kvs_tcp_ready(struct kvs_lease_server *s, struct kvs_conn *cn, uint32_t events, char *reply, uint32_t rcap);
int kvs_tcp_send(struct kvs_lease_server *s, struct kvs_conn *cn, const char *header, const char *payload,
                 uint32_t len);
void kvs_tcp_conn_free(struct kvs_conn *cn);
void kvs_tcp_close_handshakes(struct kvs_lease_server *s);

#endif /* KVS_LEASE_H */
