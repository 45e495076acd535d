/* Request links (kvs.h): one importer control connection driven from C.
 *
 * Why C: the renewal thread (kvs_renew.c) must send on the same connection as Python's
 * requests without taking the GIL, so the connection's frame I/O and its one lock live
 * here, and Python reaches both through cffi (which drops the GIL while a call waits).
 *
 * The rules are kvstate.channel.conn and .framing, which stay the reference for every
 * other channel: a frame is one packet (header, payload, SCM_RIGHTS fds); a received
 * packet is refused when truncated (MSG_TRUNC, MSG_CTRUNC), shorter than its header, of
 * bad magic, or when the header disagrees with what arrived, and every fd that came with
 * a refused packet is closed. Waits poll the socket (and the peer's pidfd) until the
 * deadline; EINTR is retried; a send that sent part of a message closes the link.
 *
 * An answer's wait may poll first (kvs_link_set_spin): an importer's thread that sleeps
 * as soon as it sent a request is woken by the answer, and on a virtual machine that
 * wake-up of an idle CPU (an interrupt to a halted vCPU) takes about as long as the
 * exporter's whole answer (B1; docs/native-control-plane.md, the request link). Polling
 * only pays on a CPU nothing else wants: there a thread that sleeps is woken ahead of a
 * busy one, and a poller that was put aside waits out the other's time slice. So the
 * poll never yields (a yield puts the poller behind a busy thread: a 2.5 ms round trip
 * instead of 65 us, measured) and it stops at the first sign that something else ran on
 * its CPU, a gap between two polls (SPIN_GAP_NS), and sleeps. The renewal thread never
 * polls: nothing waits for a renewal's answer.
 *
 * Lifetime: references (Python's, and one per renewal entry) keep the memory; the mutex
 * keeps one exchange at a time; `closed` is set once, by kvs_link_close, which shuts the
 * socket down without the mutex (so a call waiting in poll wakes at once) and closes the
 * fds when no call is inside (here, or at the unlock of the call that was).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kvs.h"
#include "kvs_link.h"

_Static_assert(KVS_LINK_MAX_FDS == sizeof(((kvs_frame *)0)->fds) / sizeof(int32_t), "kvs_frame.fds");

static const uint8_t MAGIC[4] = {'K', 'V', 'S', 1};

struct kvs_link {
    pthread_mutex_t mu;
    atomic_int refs;
    atomic_int closing; /* the one closer is chosen */
    atomic_int closed;  /* set after the shutdown: from here on the fds may be closed */
    int fd;        /* -1 once closed here */
    int pidfd;     /* -1: the peer was gone at open, or closed */
    int inside;    /* a call holds the mutex (guarded by mu) */
    uint32_t max_payload, max_fds;
    int stream; /* a TCP stream (kvs_link_open_stream): frames are read and written in pieces */
    _Atomic int64_t spin_ns; /* an answer's wait polls this long before it sleeps */
    _Atomic uint64_t caught;  /* waits whose answer came while they polled */
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int dup_cloexec(int fd) { return fd < 0 ? -1 : fcntl(fd, F_DUPFD_CLOEXEC, 0); }

kvs_link *kvs_link_open(int32_t fd, int32_t pidfd, uint32_t max_payload, uint32_t max_fds) {
    if (fd < 0 || max_payload == 0 || max_payload > (1u << 20) || max_fds > KVS_LINK_MAX_FDS) {
        errno = EINVAL;
        return NULL;
    }
    kvs_link *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    l->fd = dup_cloexec(fd);
    l->pidfd = l->fd < 0 || pidfd < 0 ? -1 : dup_cloexec(pidfd);
    if (l->fd < 0 || (pidfd >= 0 && l->pidfd < 0)) {
        int e = errno;
        if (l->fd >= 0) close(l->fd);
        if (l->pidfd >= 0) close(l->pidfd);
        free(l);
        errno = e;
        return NULL;
    }
    pthread_mutex_init(&l->mu, NULL);
    atomic_init(&l->refs, 1);
    atomic_init(&l->closing, 0);
    atomic_init(&l->closed, 0);
    l->max_payload = max_payload;
    l->max_fds = max_fds;
    return l;
}

kvs_link *kvs_link_open_stream(int32_t fd, uint32_t max_payload) {
    kvs_link *l = kvs_link_open(fd, -1, max_payload, 0);
    if (l) l->stream = 1;
    return l;
}

void kvs_link_ref(kvs_link *l) { atomic_fetch_add(&l->refs, 1); }

uint32_t kvs_link_max_payload(const kvs_link *l) { return l->max_payload; }

static void close_fds(kvs_link *l) { /* with mu held and nobody inside */
    if (l->fd >= 0) close(l->fd);
    if (l->pidfd >= 0) close(l->pidfd);
    l->fd = l->pidfd = -1;
}

void kvs_link_unref(kvs_link *l) {
    if (!l || atomic_fetch_sub(&l->refs, 1) != 1) return;
    close_fds(l);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

/* The fds are closed only once `closed` is set, and that happens after the shutdown, so
 * the one closer's fd is still ours. A call waiting in poll wakes with the hang-up. */
static void shut(kvs_link *l) {
    if (atomic_exchange(&l->closing, 1)) return;
    shutdown(l->fd, SHUT_RDWR);
    atomic_store(&l->closed, 1);
}

/* Without waiting for the mutex: its holder (maybe this very thread, between lock and
 * unlock of a pipelined exchange) closes the fds at its unlock. */
void kvs_link_close(kvs_link *l) {
    shut(l);
    if (pthread_mutex_trylock(&l->mu) == 0) {
        if (!l->inside) close_fds(l);
        pthread_mutex_unlock(&l->mu);
    }
}

int32_t kvs_link_closed(kvs_link *l) { return atomic_load(&l->closed); }

uint64_t kvs_link_caught(kvs_link *l) { return atomic_load(&l->caught); }

/* At most a second: a longer poll only burns a CPU (and now + spin must not overflow). */
void kvs_link_set_spin(kvs_link *l, int64_t spin_ns) {
    atomic_store(&l->spin_ns, spin_ns <= 0 ? 0 : spin_ns > 1000000000 ? 1000000000 : spin_ns);
}

void kvs_link_lock(kvs_link *l) {
    pthread_mutex_lock(&l->mu);
    l->inside = 1;
}

void kvs_link_unlock(kvs_link *l) {
    l->inside = 0;
    if (atomic_load(&l->closed)) close_fds(l);
    pthread_mutex_unlock(&l->mu);
}

/* Two polls further apart than this: the poller was put aside for another thread. */
#define SPIN_GAP_NS 20000

/* Poll fd for `events` (and the pidfd for its exit) until the deadline, first without
 * sleeping for up to `spin` ns (see the top). 1: fd ready; 0: timed out;
 * KVS_E_LINK_PEER_DIED; KVS_E_LINK_CLOSED (closed here meanwhile); SYS. */
static int wait_for(kvs_link *l, short events, int64_t deadline, int64_t spin, int32_t *err) {
    int64_t last = now_ns(), spin_until = spin > 0 ? last + spin : 0;
    for (;;) {
        if (atomic_load(&l->closed)) return KVS_E_LINK_CLOSED;
        int64_t now = now_ns(), left = deadline - now;
        if (left <= 0) return 0;
        if (now - last > SPIN_GAP_NS) spin_until = 0; /* something else runs here: sleep */
        last = now;
        struct pollfd p[2] = {{l->fd, events, 0}, {l->pidfd, POLLIN, 0}};
        int64_t ms = (left + 999999) / 1000000;
        int polling = now < spin_until;
        int n = poll(p, l->pidfd >= 0 ? 2 : 1, polling ? 0 : ms > INT_MAX ? INT_MAX : (int)ms);
        if (n == 0 && polling) continue;
        if (n > 0 && polling && p[0].revents) atomic_fetch_add(&l->caught, 1);
        if (n < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return KVS_E_LINK_SYS;
        }
        if (atomic_load(&l->closed)) return KVS_E_LINK_CLOSED;
        if (p[0].revents) return 1;  /* ready, or a hang-up the next call reports */
        if (n > 0 && (p[1].revents & POLLIN)) return KVS_E_LINK_PEER_DIED;
    }
}

int kvs_link_send(kvs_link *l, const uint8_t *payload, uint32_t len, const int32_t *fds, uint32_t nfds,
                  int64_t timeout_ns, int32_t *err) {
    *err = 0;
    if (atomic_load(&l->closed) || l->fd < 0) return KVS_E_LINK_CLOSED;
    if (len > l->max_payload || nfds > l->max_fds) return KVS_E_LINK_CAP;
    uint8_t header[KVS_LINK_HEADER] = {0};
    memcpy(header, MAGIC, 4);
    for (int i = 0; i < 4; i++) header[4 + i] = (uint8_t)(len >> (8 * i));
    header[8] = (uint8_t)nfds;
    header[9] = (uint8_t)(nfds >> 8);
    struct iovec iov[2] = {{header, sizeof header}, {(void *)payload, len}};
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int) * KVS_LINK_MAX_FDS)];
    } control;
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = len ? 2 : 1};
    if (nfds) {
        memset(&control, 0, sizeof control);
        m.msg_control = control.buf;
        m.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
        for (uint32_t i = 0; i < nfds; i++) {
            int fd = fds[i];
            memcpy(CMSG_DATA(c) + i * sizeof(int), &fd, sizeof fd);
        }
    }
    size_t total = sizeof header + len, done = 0;
    int64_t deadline = now_ns() + (timeout_ns > 0 ? timeout_ns : 0);
    for (;;) {
        ssize_t sent = sendmsg(l->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (sent >= 0 && l->stream) { /* a stream takes what fits: the rest when there is room */
            done += (size_t)sent;
            if (done == total) return KVS_OK;
            while (sent > 0) {
                size_t step = (size_t)sent < m.msg_iov[0].iov_len ? (size_t)sent : m.msg_iov[0].iov_len;
                m.msg_iov[0].iov_base = (char *)m.msg_iov[0].iov_base + step;
                m.msg_iov[0].iov_len -= step;
                sent -= (ssize_t)step;
                if (!m.msg_iov[0].iov_len) {
                    m.msg_iov++;
                    m.msg_iovlen--;
                }
            }
            int w = wait_for(l, POLLOUT, deadline, 0, err);
            if (w > 0 || w == KVS_E_LINK_PEER_DIED) continue;
            if (done) shut(l); /* a frame cut short: the stream is out of step */
            return w == 0 ? KVS_E_LINK_TIMEOUT : w;
        }
        if (sent >= 0) {
            if ((size_t)sent == total) return KVS_OK;
            /* SOCK_SEQPACKET sends a message whole; the peer refuses a part of one. */
            *err = (int32_t)sent;
            shut(l);
            return KVS_E_LINK_SHORT_SEND;
        }
        int e = errno;
        if (e == EINTR) continue;
        if (e == EPIPE || e == ECONNRESET || e == ENOTCONN) return KVS_E_LINK_CLOSED;
        if (e == EMSGSIZE) return KVS_E_LINK_TOOBIG;
        if (e == EBADF && atomic_load(&l->closed)) return KVS_E_LINK_CLOSED;
        if (e != EAGAIN && e != EWOULDBLOCK) {
            *err = e;
            return KVS_E_LINK_SYS;
        }
        int w = wait_for(l, POLLOUT, deadline, 0, err);
        if (done && (w == 0 || (w < 0 && w != KVS_E_LINK_PEER_DIED))) shut(l); /* a stream's frame cut short */
        if (w == 0) return KVS_E_LINK_TIMEOUT;
        if (w < 0 && w != KVS_E_LINK_PEER_DIED) return w;
        /* A dead peer with room to send: the send itself reports EPIPE or succeeds. */
    }
}

/* Close every fd of a refused packet; nfds stays, for the refusal's message. */
static int refuse(kvs_frame *f, int code) {
    for (uint32_t i = 0; i < f->nfds; i++) close(f->fds[i]);
    return code;
}

/* One recvmsg's packet into f, checked as framing.unpack checks it. */
static int take_packet(kvs_link *l, kvs_frame *f, int32_t *err) {
    uint8_t header[KVS_LINK_HEADER];
    struct iovec iov[2] = {{header, sizeof header}, {f->buf, f->cap < l->max_payload ? f->cap : l->max_payload}};
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int) * KVS_LINK_MAX_FDS)];
    } control;
    uint32_t room = l->max_fds ? l->max_fds : 1;
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2, .msg_control = control.buf,
                       .msg_controllen = CMSG_SPACE(sizeof(int) * room)};
    ssize_t got = recvmsg(l->fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (got < 0) {
        int e = errno;
        if (e == EINTR || e == EAGAIN || e == EWOULDBLOCK) return 1;  /* wait, then again */
        if (e == ECONNRESET) return KVS_E_LINK_CLOSED;
        if (e == EBADF && atomic_load(&l->closed)) return KVS_E_LINK_CLOSED;
        *err = e;
        return KVS_E_LINK_SYS;
    }
    f->nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            if (f->nfds < KVS_LINK_MAX_FDS) f->fds[f->nfds++] = fd;
            else close(fd);
        }
    }
    f->len = (uint32_t)got;
    if (got == 0 && f->nfds == 0) return KVS_E_LINK_CLOSED;
    if (m.msg_flags & MSG_TRUNC) return refuse(f, KVS_E_LINK_TRUNC);
    if (m.msg_flags & MSG_CTRUNC) return refuse(f, KVS_E_LINK_CTRUNC);
    if ((size_t)got < sizeof header) return refuse(f, KVS_E_LINK_SHORT);
    memcpy(f->magic, header, 4);
    f->said_len = (uint32_t)header[4] | (uint32_t)header[5] << 8 | (uint32_t)header[6] << 16 |
                  (uint32_t)header[7] << 24;
    f->said_fds = (uint32_t)header[8] | (uint32_t)header[9] << 8;
    if (memcmp(header, MAGIC, 4) != 0) return refuse(f, KVS_E_LINK_MAGIC);
    if (f->said_len != (uint32_t)got - sizeof header) return refuse(f, KVS_E_LINK_LENGTH);
    if (f->said_fds != f->nfds || f->said_fds > l->max_fds) return refuse(f, KVS_E_LINK_FDS);
    f->len = (uint32_t)got - sizeof header;
    return KVS_OK;
}

/* Exactly n bytes of a stream by the deadline; a frame cut short (`begun`) shuts the link. */
static int read_exact(kvs_link *l, uint8_t *p, size_t n, int64_t deadline, int begun, int32_t *err) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = recv(l->fd, p + got, n - got, MSG_DONTWAIT);
        if (r > 0) {
            got += (size_t)r;
            continue;
        }
        int e = r == 0 ? 0 : errno;
        if (r < 0 && e == EINTR) continue;
        if (r == 0 || e == ECONNRESET || e == ETIMEDOUT || (e == EBADF && atomic_load(&l->closed))) {
            shut(l);
            return KVS_E_LINK_CLOSED;
        }
        if (e != EAGAIN && e != EWOULDBLOCK) {
            *err = e;
            shut(l);
            return KVS_E_LINK_SYS;
        }
        int w = wait_for(l, POLLIN, deadline, 0, err); /* a stream's pieces: TCP links never poll */
        if (w > 0) continue;
        if (begun || got) shut(l);
        return w == 0 ? KVS_E_LINK_TIMEOUT : w;
    }
    return KVS_OK;
}

/* One frame of a stream: its header (checked as kvstate.channel.tcp checks it), then
 * exactly the payload it announces; a bad header shuts the link (out of step). */
static int take_stream(kvs_link *l, kvs_frame *f, int64_t deadline) {
    uint8_t header[KVS_LINK_HEADER];
    int rc = read_exact(l, header, sizeof header, deadline, 0, &f->err);
    if (rc) return rc;
    memcpy(f->magic, header, 4);
    f->said_len = (uint32_t)header[4] | (uint32_t)header[5] << 8 | (uint32_t)header[6] << 16 |
                  (uint32_t)header[7] << 24;
    f->said_fds = (uint32_t)header[8] | (uint32_t)header[9] << 8;
    f->len = sizeof header;
    int bad = memcmp(header, MAGIC, 4) != 0 ? KVS_E_LINK_MAGIC : f->said_fds ? KVS_E_LINK_FDS
            : f->said_len > l->max_payload || f->said_len > f->cap ? KVS_E_LINK_TRUNC : 0;
    if (bad) {
        shut(l);
        return bad;
    }
    rc = read_exact(l, f->buf, f->said_len, deadline, 1, &f->err);
    if (rc) return rc;
    f->len = f->said_len;
    return KVS_OK;
}

static int link_recv(kvs_link *l, kvs_frame *f, int64_t timeout_ns, int64_t spin) {
    f->err = 0;
    f->nfds = 0;
    f->len = 0;
    if (atomic_load(&l->closed) || l->fd < 0) return KVS_E_LINK_CLOSED;
    if (!f->buf || f->cap < l->max_payload) return KVS_E_INVAL;
    int64_t deadline = now_ns() + (timeout_ns > 0 ? timeout_ns : 0);
    if (l->stream) return take_stream(l, f, deadline);
    for (;;) {
        int rc = take_packet(l, f, &f->err);
        if (rc <= 0) return rc;
        int w = wait_for(l, POLLIN, deadline, spin, &f->err);
        if (w == 0) return KVS_E_LINK_TIMEOUT;
        if (w < 0) return w;
    }
}

int kvs_link_recv(kvs_link *l, kvs_frame *f, int64_t timeout_ns) {
    return link_recv(l, f, timeout_ns, atomic_load(&l->spin_ns));
}

static int link_request(kvs_link *l, const uint8_t *payload, uint32_t len, kvs_frame *f, int64_t timeout_ns,
                        int64_t spin) {
    kvs_link_lock(l);
    int rc = kvs_link_send(l, payload, len, NULL, 0, timeout_ns, &f->err);
    if (rc == KVS_OK) {
        rc = link_recv(l, f, timeout_ns, spin);
    } else if (rc == KVS_E_LINK_CLOSED && !atomic_load(&l->closed)) {
        /* The peer closed first, maybe after saying why (a server over its connection
         * limit refuses at accept, then closes): a frame it left is its answer. */
        if (kvs_link_recv(l, f, 0) == KVS_OK) {
            shut(l);
            kvs_link_unlock(l);
            return KVS_OK;
        }
        f->err = 0;
        rc = KVS_E_LINK_CLOSED;
    }
    if (rc != KVS_OK) shut(l);
    kvs_link_unlock(l);
    return rc;
}

int kvs_link_request(kvs_link *l, const uint8_t *payload, uint32_t len, kvs_frame *f, int64_t timeout_ns) {
    return link_request(l, payload, len, f, timeout_ns, atomic_load(&l->spin_ns));
}

/* -- an exchange in two steps (kvs_link.h), for the renewal thread -------------------- */

int kvs_link_begin(kvs_link *l, const uint8_t *payload, uint32_t len, int64_t send_ns, int32_t *err) {
    *err = 0;
    if (pthread_mutex_trylock(&l->mu) != 0) return KVS_LINK_BUSY;
    l->inside = 1;
    int rc = kvs_link_send(l, payload, len, NULL, 0, send_ns, err);
    if (rc == KVS_E_LINK_CLOSED && !atomic_load(&l->closed))
        return KVS_OK; /* the peer closed first: a frame it left is the answer kvs_link_finish reads */
    if (rc != KVS_OK) {
        shut(l);
        kvs_link_unlock(l);
    }
    return rc;
}

int kvs_link_pollfds(const kvs_link *l, struct pollfd *p) {
    p[0] = (struct pollfd){l->fd, POLLIN, 0};
    if (l->pidfd < 0) return 1;
    p[1] = (struct pollfd){l->pidfd, POLLIN, 0};
    return 2;
}

int kvs_link_finish(kvs_link *l, kvs_frame *f, int code, int64_t deadline_ns) {
    int rc = code;
    if (!rc) { /* a packet is there whole; a stream's frame may still be arriving */
        int64_t left = deadline_ns - now_ns();
        rc = link_recv(l, f, left > 0 ? left : 0, 0);
    } else {
        f->err = 0;
        f->nfds = f->len = 0;
    }
    if (rc != KVS_OK)
        shut(l); /* as kvs_link_request: a late answer would be read as the next exchange's */
    kvs_link_unlock(l);
    return rc;
}
