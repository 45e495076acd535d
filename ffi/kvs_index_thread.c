/* The decode index's serving thread (kvs_index.h): it never takes the GIL, so a prefill
 * scheduler's lookup is answered while the decode engine's Python is busy.
 *
 * One epoll set: the listening socket (bound by Python's kvstate.channel.Server, which
 * keeps it), every connection, and an eventfd that stop() writes. A connection is taken
 * only from the allowed uid (SO_PEERCRED, as kvstate.channel.conn). Each packet is checked
 * as kvstate.channel.framing.unpack checks it; a bad frame, or silence past the deadline
 * (the first request's, then the idle one's, as DecodeIndex._serve_client), closes the
 * connection. A request kvs_index_answer leaves to Python hands the whole connection
 * over (kvs_index_next_handoff): a decode rank's hello and everything after it. A rank's
 * report link (kvs_index_link) stays here, with no deadline: its `stored` reports are
 * taken in as they come (kvs_index_take_report); while Python's queue of them is full, the
 * link is not read (its rank's op engine then finds the socket full and the rank reports
 * on its main link). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kvs.h"
#include "kvs_index_state.h"
#include "kvs_serve.h"

#define HEADER KVS_FRAME_HEADER
#define TAG_LISTEN 1ull
#define TAG_CMD 2ull
#define TAG_CONN 16ull /* + the connection's index */
#define TICK_MS 250    /* deadlines, stop and paused report links are looked at this often */
#define NO_DEADLINE INT64_MAX

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int send_frame(int fd, const char *payload, uint32_t len) {
    char header[HEADER];
    kvs_frame_header(header, len, 0);
    struct iovec iov[2] = {{header, HEADER}, {(void *)payload, len}};
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = 2};
    ssize_t w;
    do w = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL); /* a reader that stops reading loses its connection */
    while (w < 0 && errno == EINTR);
    return w == (ssize_t)(HEADER + len) ? 0 : -1;
}

static void drop(struct kvs_index *x, int k, int close_fd) {
    epoll_ctl(x->epoll_fd, EPOLL_CTL_DEL, x->conns[k].fd, NULL);
    if (close_fd) close(x->conns[k].fd);
    x->conns[k].fd = -1;
    x->nconns--;
}

/* A report link is paused (out of the epoll set, where a hang-up would still wake us each
 * time round) while Python's queue of reports is full, and read again once it has room:
 * what its peer sent, even before it hung up, is all taken in. */
static void pause_link(struct kvs_index *x, int k) {
    if (epoll_ctl(x->epoll_fd, EPOLL_CTL_DEL, x->conns[k].fd, NULL) == 0) x->conns[k].paused = 1;
}

static void resume(struct kvs_index *x, int k) {
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = TAG_CONN + (uint64_t)k};
    if (epoll_ctl(x->epoll_fd, EPOLL_CTL_ADD, x->conns[k].fd, &ev) == 0) x->conns[k].paused = 0;
}

static void accept_one(struct kvs_index *x) {
    struct ucred cred;
    int fd = kvs_accept_same_uid(x->listen_fd, x->uid, &cred);
    if (fd < 0) return;
    int k = 0;
    while (k < x->max_connections && x->conns[k].fd >= 0) k++;
    if (k == x->max_connections) { /* the refusal kvstate.channel.Server sends; IndexClient reads "busy" */
        char busy[160];
        send_frame(fd, busy, (uint32_t)kvs_connection_limit(busy, sizeof busy, x->max_connections));
        shutdown(fd, SHUT_WR);
        close(fd);
        return;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = TAG_CONN + (uint64_t)k};
    if (epoll_ctl(x->epoll_fd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        close(fd);
        return;
    }
    x->conns[k].fd = fd;
    x->conns[k].until_ns = now_ns() + __atomic_load_n(&x->first_ns, __ATOMIC_RELAXED);
    x->conns[k].pid = cred.pid;
    x->conns[k].rank = -1;
    x->conns[k].paused = 0;
    x->nconns++;
}

static void serve_packet(struct kvs_index *x, int k, char *buf, uint32_t cap, char *reply, uint32_t rcap) {
    int fd = x->conns[k].fd;
    if (x->conns[k].rank >= 0 && !kvs_index_report_room(x)) { /* read it once Python caught up */
        pause_link(x, k);
        return;
    }
    union {
        char b[CMSG_SPACE(16 * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {buf, cap};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b, .msg_controllen = sizeof ctl.b};
    ssize_t got = recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) return;
    int nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int n = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int j = 0; j < n; j++) close(((int *)CMSG_DATA(c))[j]); /* no index message carries fds */
            nfds += n;
        }
    uint32_t len = 0;
    if (got <= 0 || nfds || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || got < HEADER ||
        memcmp(buf, KVS_FRAME_MAGIC, 4) != 0 || (memcpy(&len, buf + 4, 4), len != (uint32_t)(got - HEADER)) ||
        buf[8] || buf[9]) {
        drop(x, k, 1); /* closed by the peer, or a frame Python's recv refuses (FRAME): the handler ended */
        return;
    }
    uint32_t rlen = 0;
    if (x->conns[k].rank >= 0) {
        if (kvs_index_take_report(x, x->conns[k].rank, x->conns[k].pid, buf + HEADER, len) < 0) drop(x, k, 1);
        return;
    }
    int32_t rank = kvs_index_link(x, buf + HEADER, len, x->conns[k].pid, reply, rcap, &rlen);
    if (rank == -1 || (rank >= 0 && send_frame(fd, reply, rlen) < 0)) {
        drop(x, k, 1);
        return;
    }
    if (rank >= 0) {
        x->conns[k].rank = rank;
        x->conns[k].until_ns = NO_DEADLINE;
        return;
    }
    int rc = kvs_index_answer(x, buf + HEADER, len, reply, rcap, &rlen);
    if (rc == KVS_OK) {
        if (send_frame(fd, reply, rlen) < 0) drop(x, k, 1);
        else x->conns[k].until_ns = now_ns() + __atomic_load_n(&x->idle_ns, __ATOMIC_RELAXED);
    } else {
        drop(x, k, 0); /* Python's from here, with this request (closed when Python cannot take it) */
        if (kvs_index_hand_over(x, fd, buf + HEADER, len) < 0) close(fd);
    }
}

static void *run(void *arg) {
    pthread_setname_np(pthread_self(), "kvs-index"); /* seen in top -H, py-spy, /proc/<pid>/task */
    struct kvs_index *x = arg;
    uint32_t cap = (uint32_t)x->max_payload + HEADER + 1, rcap = (uint32_t)x->max_payload;
    char *buf = malloc(cap), *reply = malloc(rcap);
    while (buf && reply) {
        struct epoll_event evs[32];
        int n = epoll_wait(x->epoll_fd, evs, 32, TICK_MS);
        if (__atomic_load_n(&x->stopping, __ATOMIC_ACQUIRE)) break;
        for (int e = 0; e < n; e++) {
            uint64_t tag = evs[e].data.u64;
            if (tag == TAG_LISTEN) accept_one(x);
            else if (tag >= TAG_CONN && x->conns[tag - TAG_CONN].fd >= 0)
                serve_packet(x, (int)(tag - TAG_CONN), buf, cap, reply, rcap);
        }
        int64_t now = now_ns();
        int room = kvs_index_report_room(x);
        for (int k = 0; k < x->max_connections; k++) {
            if (x->conns[k].fd >= 0 && x->conns[k].until_ns < now) drop(x, k, 1);
            else if (x->conns[k].fd >= 0 && x->conns[k].paused && room) resume(x, k);
        }
    }
    free(buf);
    free(reply);
    return NULL;
}

int kvs_index_serve(kvs_index *x, int32_t listen_fd) {
    if (!x || listen_fd < 0) return KVS_E_INVAL;
    if (x->running) return KVS_E_BUSY;
    x->stopping = 0;
    x->listen_fd = listen_fd;
    x->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    x->cmd_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    int hfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    pthread_mutex_lock(&x->mu);
    x->handoff_fd = hfd;
    pthread_mutex_unlock(&x->mu);
    struct epoll_event l = {.events = EPOLLIN, .data.u64 = TAG_LISTEN}, c = {.events = EPOLLIN, .data.u64 = TAG_CMD};
    if (x->epoll_fd < 0 || x->cmd_fd < 0 || hfd < 0 || epoll_ctl(x->epoll_fd, EPOLL_CTL_ADD, listen_fd, &l) < 0 ||
        epoll_ctl(x->epoll_fd, EPOLL_CTL_ADD, x->cmd_fd, &c) < 0 || pthread_create(&x->thread, NULL, run, x) != 0) {
        if (x->epoll_fd >= 0) close(x->epoll_fd);
        if (x->cmd_fd >= 0) close(x->cmd_fd);
        pthread_mutex_lock(&x->mu);
        if (hfd >= 0) close(hfd);
        x->epoll_fd = x->cmd_fd = x->handoff_fd = -1;
        pthread_mutex_unlock(&x->mu);
        return KVS_E_SYS;
    }
    x->running = 1;
    return KVS_OK;
}

int kvs_index_stop(kvs_index *x) {
    if (!x) return KVS_E_INVAL;
    if (!x->running) return KVS_OK;
    __atomic_store_n(&x->stopping, 1, __ATOMIC_RELEASE);
    uint64_t one = 1;
    if (write(x->cmd_fd, &one, sizeof one) < 0) { /* the thread looks at `stopping` each tick anyway */ }
    pthread_join(x->thread, NULL);
    x->running = 0;
    for (int k = 0; k < x->max_connections; k++)
        if (x->conns[k].fd >= 0) drop(x, k, 1);
    close(x->epoll_fd);
    close(x->cmd_fd);
    x->epoll_fd = x->cmd_fd = -1;
    pthread_mutex_lock(&x->mu); /* connections still waiting for Python close with it */
    kvs_index_queue_clear(&x->handoffs);
    close(x->handoff_fd);
    x->handoff_fd = -1;
    pthread_mutex_unlock(&x->mu);
    return KVS_OK;
}

int32_t kvs_index_connections(kvs_index *x) { return x ? x->nconns : KVS_E_INVAL; }
