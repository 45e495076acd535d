/* The lease server's thread (kvs.h, "the exporter's lease server"): one per exporter,
 * never taking the GIL, so a process whose Python is stuck (a long C call holding the
 * GIL, a busy loop) still serves leases.
 *
 * One epoll set: the listening socket (bound by Python's kvstate.channel.Server, which
 * keeps its owner mark and sweeps), every connection and its peer's pidfd, a timerfd armed
 * at the nearest lease expiry, and an eventfd that stop() writes. A connection is
 * accepted only from the allowed uid (SO_PEERCRED, as kvstate.channel.conn); each packet
 * is checked as kvstate.channel.framing.unpack checks it (magic, lengths, no fds from
 * importers) and answered by kvs_lease_handle. The importer closing its end, or its
 * process exiting (the pidfd), ends its leases (peer_died) and its holds; a connection
 * this side closes keeps its holds until that process exits.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include "kvs_lease.h"
#include "kvs_serve.h"

#define HEADER KVS_FRAME_HEADER
#define TAG_LISTEN 1ull
#define TAG_TIMER 2ull
#define TAG_CMD 3ull
/* A connection's socket is tagged (id << 4) | 4 and its pidfd (id << 4) | 8; the fixed
 * fds above have neither bit, so no tag is taken twice. */
#define CONN_TAG(id, pid) (((id) << 4) | ((pid) ? 8u : 4u))

int kvs_lease_queue_python(struct kvs_lease_server *s, uint64_t conn, const char *payload, uint32_t len);

int kvs_lease_send(struct kvs_lease_server *s, struct kvs_conn *cn, const char *payload, uint32_t len,
                   const int32_t *fds, int32_t nfds) {
    if ((int64_t)len > s->max_payload || nfds > s->max_fds || nfds > 253 || (cn->tcp && nfds)) return KVS_E_RANGE;
    char header[HEADER];
    kvs_frame_header(header, len, (uint16_t)nfds);
    if (cn->tcp) return kvs_tcp_send(s, cn, header, payload, len);
    struct iovec iov[2] = {{header, HEADER}, {(void *)payload, len}};
    union {
        char buf[CMSG_SPACE(253 * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = 2};
    if (nfds) {
        msg.msg_control = ctl.buf;
        msg.msg_controllen = CMSG_SPACE((size_t)nfds * sizeof(int));
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN((size_t)nfds * sizeof(int));
        memcpy(CMSG_DATA(c), fds, (size_t)nfds * sizeof(int));
    }
    /* Never blocks the thread: an importer that stops reading its answers loses its connection. */
    ssize_t w;
    do w = sendmsg(cn->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    while (w < 0 && errno == EINTR);
    return w == (ssize_t)(HEADER + len) ? KVS_OK : KVS_E_SYS;
}

int kvs_lease_watch(struct kvs_lease_server *s, int fd, uint64_t tag, uint32_t events) {
    struct epoll_event ev = {.events = events, .data.u64 = tag};
    return epoll_ctl(s->epoll_fd, EPOLL_CTL_ADD, fd, &ev);
}

static int watch(struct kvs_lease_server *s, int fd, uint64_t tag) { return kvs_lease_watch(s, fd, tag, EPOLLIN); }

/* A stop never waits for a wake-up that may not come (a failed eventfd write): the
 * thread looks at `stopping` at least this often. */
#define STOP_CHECK_MS 500
#define LINGER_NS 1000000000LL

/* Close the refused connections whose moment is over (all of them with `everything`). */
static void close_lingering(struct kvs_lease_server *s, int everything) {
    int64_t now = kvs_lease_now();
    int kept = 0;
    for (int k = 0; k < s->nlingering; k++) {
        if (everything || s->lingering[k].until_ns <= now) close(s->lingering[k].fd);
        else s->lingering[kept++] = s->lingering[k];
    }
    s->nlingering = kept;
}

static void end_conn(struct kvs_lease_server *s, struct kvs_conn *cn, int importer_closed, int why) {
    epoll_ctl(s->epoll_fd, EPOLL_CTL_DEL, cn->fd, NULL);
    if (cn->pidfd >= 0) epoll_ctl(s->epoll_fd, EPOLL_CTL_DEL, cn->pidfd, NULL);
    kvs_lease_conn_end(s, cn->id, importer_closed, why);
}

void kvs_lease_end_conn(struct kvs_lease_server *s, struct kvs_conn *cn, int importer_closed, int why) {
    end_conn(s, cn, importer_closed, why);
}

static void accept_one(struct kvs_lease_server *s) {
    struct ucred cred;
    int fd = kvs_accept_same_uid(s->listen_fd, s->uid, &cred);
    if (fd < 0) return;
    int pidfd = (int)syscall(SYS_pidfd_open, cred.pid, 0);
    pthread_mutex_lock(&s->mu);
    uint64_t id = kvs_lease_conn_add(s, fd, pidfd, cred.pid);
    pthread_mutex_unlock(&s->mu);
    if (!id) { /* past max_connections: closed (the Python server sent a refusal frame first) */
        char busy[160];
        int n = kvs_connection_limit(busy, sizeof busy, s->max_connections);
        struct kvs_conn tmp = {.fd = fd, .pidfd = -1};
        if (pidfd >= 0) close(pidfd);
        if (kvs_lease_send(s, &tmp, busy, (uint32_t)n, NULL, 0) != KVS_OK || shutdown(fd, SHUT_WR) < 0) {
            close(fd);
            return;
        }
        if (s->nlingering == 64) { /* oldest first */
            close(s->lingering[0].fd);
            memmove(s->lingering, s->lingering + 1, 63 * sizeof s->lingering[0]);
            s->nlingering--;
        }
        s->lingering[s->nlingering].fd = fd;
        s->lingering[s->nlingering++].until_ns = kvs_lease_now() + LINGER_NS;
        return;
    }
    if (watch(s, fd, CONN_TAG(id, 0)) < 0 || (pidfd >= 0 && watch(s, pidfd, CONN_TAG(id, 1)) < 0)) {
        pthread_mutex_lock(&s->mu); /* unwatched, it would never be served nor ended: refused */
        struct kvs_conn *cn = kvs_lease_conn(s, id);
        if (cn) end_conn(s, cn, 1, KVS_LWHY_CLOSED);
        pthread_mutex_unlock(&s->mu);
    }
}

/* One packet of `cn`: checked as framing.unpack, answered as Exporter._serve did. */
static void serve_packet(struct kvs_lease_server *s, uint64_t id, char *buf, uint32_t cap, char *reply,
                         uint32_t rcap) {
    pthread_mutex_lock(&s->mu);
    struct kvs_conn *cn = kvs_lease_conn(s, id);
    if (!cn) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    union {
        char b[CMSG_SPACE(16 * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {buf, cap};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b, .msg_controllen = sizeof ctl.b};
    ssize_t got = recvmsg(cn->fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    int nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *fds = (int *)CMSG_DATA(c);
            for (int j = 0; j < k; j++) close(fds[j]); /* importers send no fds */
            nfds += k;
        }
    if (got <= 0 && nfds == 0) { /* the importer closed its end */
        end_conn(s, cn, 1, KVS_LWHY_CLOSED);
        pthread_mutex_unlock(&s->mu);
        return;
    }
    uint32_t len = 0;
    uint16_t hfds = 0;
    const char *why = NULL;
    if (msg.msg_flags & MSG_TRUNC) why = "message larger than the cap";
    else if (msg.msg_flags & MSG_CTRUNC) why = "fds dropped (MSG_CTRUNC)";
    else if (got < HEADER) why = "frame shorter than its header";
    else {
        memcpy(&len, buf + 4, 4);
        memcpy(&hfds, buf + 8, 2);
        if (memcmp(buf, KVS_FRAME_MAGIC, 4) != 0) why = "bad magic";
        else if (len != (uint32_t)(got - HEADER)) why = "header length disagrees with the frame";
        else if (hfds != nfds || nfds > s->max_fds) why = "header fd count disagrees with the fds that arrived";
    }
    if (why) { /* Python's recv raised FRAME here: the handler loop ended, as a failed send */
        end_conn(s, cn, 0, KVS_LWHY_STOPPED);
        pthread_mutex_unlock(&s->mu);
        return;
    }
    kvs_lease_answer_frame(s, cn, buf + HEADER, len, reply, rcap);
    pthread_mutex_unlock(&s->mu);
}

void kvs_lease_answer_frame(struct kvs_lease_server *s, struct kvs_conn *cn, const char *payload, uint32_t len,
                            char *reply, uint32_t rcap) {
    uint64_t id = cn->id;
    uint32_t rlen = 0;
    int32_t fds[253], nout = 0, answer = 0;
    s->hold_events = 1; /* the answer first, then Python's wake-up (kvs_lease_events_signal) */
    int rc = kvs_lease_handle(s, id, payload, len, reply, rcap, &rlen, fds, 253, &nout, &answer);
    if (rc == KVS_LEASE_PYTHON) {
        if (kvs_lease_queue_python(s, id, payload, len) < 0) {
            static const char busy[] = "{\"code\":\"busy\",\"detail\":\"too many requests waiting for Python\",\"ok\":false}";
            if (kvs_lease_send(s, cn, busy, sizeof busy - 1, NULL, 0) != KVS_OK) end_conn(s, cn, 0, KVS_LWHY_STOPPED);
        }
    } else if (rc == KVS_OK && answer && kvs_lease_send(s, cn, reply, rlen, fds, nout) != KVS_OK) {
        end_conn(s, cn, 0, KVS_LWHY_STOPPED); /* a failed send: its holds wait for its process */
    }
    s->hold_events = 0;
    if (s->events_due) {
        s->events_due = 0;
        kvs_lease_events_signal(s);
    }
}

static void arm_timer(struct kvs_lease_server *s) {
    pthread_mutex_lock(&s->mu);
    int64_t next = kvs_lease_next_expiry(s);
    pthread_mutex_unlock(&s->mu);
    struct itimerspec its = {0};
    if (next) {
        its.it_value.tv_sec = next / 1000000000;
        its.it_value.tv_nsec = next % 1000000000;
    }
    timerfd_settime(s->timer_fd, TFD_TIMER_ABSTIME, &its, NULL);
}

static void *run(void *arg) {
    pthread_setname_np(pthread_self(), "kvs-lease"); /* seen in top -H, py-spy, /proc/<pid>/task */
    struct kvs_lease_server *s = arg;
    uint32_t cap = (uint32_t)s->max_payload + HEADER + 1, rcap = (uint32_t)s->max_payload;
    char *buf = malloc(cap), *reply = malloc(rcap < 4096 ? 4096 : rcap);
    if (rcap < 4096) rcap = 4096;
    while (buf && reply) {
        arm_timer(s);
        struct epoll_event evs[32];
        close_lingering(s, 0);
        int wait_ms = STOP_CHECK_MS;
        int64_t hs_next = kvs_tcp_expire_handshakes(s);
        if (hs_next) {
            int64_t ms = (hs_next - kvs_lease_now()) / 1000000 + 1;
            if (ms < wait_ms) wait_ms = ms < 0 ? 0 : (int)ms;
        }
        int n = epoll_wait(s->epoll_fd, evs, 32, wait_ms);
        if (__atomic_load_n(&s->stopping, __ATOMIC_ACQUIRE)) break;
        if (n < 0) continue; /* EINTR, or ENOMEM for a moment: wait again */
        for (int k = 0; k < n; k++) {
            uint64_t tag = evs[k].data.u64;
            if (tag == TAG_LISTEN) {
                accept_one(s);
            } else if (tag == KVS_LEASE_TAG_TCP) {
                kvs_tcp_accept(s);
            } else if ((tag & 15) == 2 && tag != TAG_TIMER) {
                kvs_tcp_handshake(s, tag >> 4);
            } else if (tag == TAG_TIMER) {
                uint64_t ticks;
                if (read(s->timer_fd, &ticks, sizeof ticks) < 0) { /* re-armed below either way */ }
                kvs_lease_expire(s, 0);
            } else if (tag == TAG_CMD) {
                /* stop: seen above */
            } else if (tag & 8) { /* a pidfd: the importer's process exited */
                pthread_mutex_lock(&s->mu);
                struct kvs_conn *cn = kvs_lease_conn(s, tag >> 4);
                if (cn) end_conn(s, cn, 1, KVS_LWHY_EXITED);
                pthread_mutex_unlock(&s->mu);
            } else {
                pthread_mutex_lock(&s->mu);
                struct kvs_conn *cn = kvs_lease_conn(s, tag >> 4);
                int tcp = cn && cn->tcp;
                if (tcp) kvs_tcp_ready(s, cn, evs[k].events, reply, rcap);
                pthread_mutex_unlock(&s->mu);
                if (!tcp) serve_packet(s, tag >> 4, buf, cap, reply, rcap);
            }
        }
    }
    close_lingering(s, 1);
    free(buf);
    free(reply);
    return NULL;
}

int kvs_lease_serve(kvs_lease_server *s, int32_t listen_fd) {
    if (!s || listen_fd < 0) return KVS_E_INVAL;
    if (s->running) return KVS_E_BUSY;
    s->stopping = 0;
    s->listen_fd = listen_fd;
    s->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    s->timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
    s->cmd_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    s->events_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    s->requests_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->epoll_fd < 0 || s->timer_fd < 0 || s->cmd_fd < 0 || s->events_fd < 0 || s->requests_fd < 0) goto fail;
    if (watch(s, listen_fd, TAG_LISTEN) < 0 || watch(s, s->timer_fd, TAG_TIMER) < 0 ||
        watch(s, s->cmd_fd, TAG_CMD) < 0 || (s->tcp_fd >= 0 && watch(s, s->tcp_fd, KVS_LEASE_TAG_TCP) < 0))
        goto fail;
    if (pthread_create(&s->thread, NULL, run, s) != 0) goto fail;
    s->running = 1;
    return KVS_OK;
fail:
    if (s->epoll_fd >= 0) close(s->epoll_fd);
    if (s->timer_fd >= 0) close(s->timer_fd);
    if (s->cmd_fd >= 0) close(s->cmd_fd);
    if (s->events_fd >= 0) close(s->events_fd);
    if (s->requests_fd >= 0) close(s->requests_fd);
    s->epoll_fd = s->timer_fd = s->cmd_fd = s->events_fd = s->requests_fd = -1;
    return KVS_E_SYS;
}

int kvs_lease_stop(kvs_lease_server *s) {
    if (!s) return KVS_E_INVAL;
    __atomic_store_n(&s->stopping, 1, __ATOMIC_RELEASE);
    if (s->running) {
        uint64_t one = 1;
        if (write(s->cmd_fd, &one, sizeof one) < 0) { /* the counter is readable anyway */ }
        pthread_join(s->thread, NULL);
        s->running = 0;
        kvs_tcp_close_handshakes(s);
        close(s->epoll_fd);
        close(s->timer_fd);
        close(s->cmd_fd);
        s->epoll_fd = s->timer_fd = s->cmd_fd = -1;
    }
    pthread_mutex_lock(&s->mu); /* queued transitions stay: Python pumps them without the eventfd */
    if (s->events_fd >= 0) close(s->events_fd);
    if (s->requests_fd >= 0) close(s->requests_fd);
    s->events_fd = s->requests_fd = -1;
    pthread_mutex_unlock(&s->mu);
    /* This side closes every connection it served: their holds wait for their processes. */
    pthread_mutex_lock(&s->mu);
    for (int k = s->nconns; k-- > 0;)
        if (k < s->nconns && s->conns[k].fd >= 0) kvs_lease_conn_end(s, s->conns[k].id, 0, KVS_LWHY_STOPPED);
    pthread_mutex_unlock(&s->mu);
    return KVS_OK;
}
