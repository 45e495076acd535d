/* The lease thread's TCP side (kvs.h, kvs_lease_listen_tcp): importers on other nodes
 * served without the GIL, as the unix socket's are.
 *
 * Why native: a lease over TCP used to be served by a Python thread, which waited for the
 * GIL of an exporter whose engine held it (vLLM's worker does, for whole steps), so leases
 * and renewals timed out although both processes lived. Now the thread that serves the
 * unix socket also:
 *
 * - accepts on the TCP socket Python bound (kvstate.channel.tcp.TcpServer keeps the
 *   address and its checks) and runs the server's side of the mutual challenge of
 *   kvstate.channel.tcp (nonce_s; nonce_c + MAC "client"; MAC "server"), non-blocking, at
 *   most max_handshakes at once (past that the oldest goes) and each within handshake_ns,
 *   so unauthenticated peers hold no served slot and no thread;
 * - serves an authenticated peer as a connection of the lease table: its byte stream is
 *   cut into frames here (the 12-byte header of kvstate.channel.framing, no fds), each
 *   answered by kvs_lease_answer_frame, the unix socket's path. A header that is wrong
 *   closes the connection (the stream is out of step). An answer the socket does not take
 *   whole waits here, and the connection's next request is read only once it is sent, so
 *   the thread never blocks on a peer that stops reading;
 * - ends a connection's leases when the peer closes, resets, or stops answering
 *   keepalive probes (there is no pidfd across nodes).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvs_lease.h"

#define NONCE 32
#define MAC 32
#define PROOF (KVS_LEASE_HEADER + NONCE + MAC) /* the client's: header, nonce_c, MAC */

static const char MAGIC[4] = {'K', 'V', 'S', 1};

static void header(char *h, uint32_t len) {
    memcpy(h, MAGIC, 4);
    memcpy(h + 4, &len, 4); /* little endian, as struct "<4sIH2x" (x86_64, aarch64) */
    memset(h + 8, 0, 4);
}

/* MAC(key, role | first | second), as kvstate.channel.tcp._mac. */
static void mac(struct kvs_lease_server *s, const char *role, const uint8_t *first, const uint8_t *second,
                uint8_t *out) {
    uint8_t msg[6 + 2 * NONCE];
    memcpy(msg, role, 6);
    memcpy(msg + 6, first, NONCE);
    memcpy(msg + 6 + NONCE, second, NONCE);
    kvs_blake2b(out, MAC, s->key, s->keylen, s->person, s->personlen, msg, sizeof msg);
}

static int equal(const uint8_t *a, const uint8_t *b, size_t n) { /* in constant time */
    uint8_t d = 0;
    for (size_t i = 0; i < n; i++) d |= a[i] ^ b[i];
    return d == 0;
}

/* A message sent whole into the socket's buffer, or not at all (the peer is dropped). */
static int send_whole(int fd, const void *p, size_t n) {
    ssize_t w;
    do w = send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    while (w < 0 && errno == EINTR);
    return w == (ssize_t)n ? 0 : -1;
}

int kvs_lease_listen_tcp(kvs_lease_server *s, int32_t listen_fd, const uint8_t *key, uint32_t keylen,
                         const uint8_t *person, uint32_t personlen, int32_t max_handshakes, int64_t handshake_ns,
                         int32_t keepalive_idle_s, int32_t keepalive_interval_s, int32_t keepalive_probes) {
    if (!s || listen_fd < 0 || !key || keylen < 1 || keylen > sizeof s->key || (personlen && !person) ||
        personlen > sizeof s->person || max_handshakes < 1 || handshake_ns <= 0 || keepalive_idle_s < 1 ||
        keepalive_interval_s < 1 || keepalive_probes < 1)
        return KVS_E_INVAL;
    if (s->running) return KVS_E_BUSY; /* the thread watches it from its start */
    struct kvs_handshake *hs = calloc((size_t)max_handshakes, sizeof *hs);
    if (!hs) return KVS_E_NOMEM;
    pthread_mutex_lock(&s->hs_mu);
    free(s->hs);
    s->hs = hs;
    s->nhs = 0;
    s->tcp_fd = listen_fd;
    memcpy(s->key, key, keylen);
    s->keylen = keylen;
    memcpy(s->person, person, personlen);
    s->personlen = personlen;
    s->max_handshakes = max_handshakes;
    s->handshake_ns = handshake_ns;
    s->keepalive[0] = keepalive_idle_s;
    s->keepalive[1] = keepalive_interval_s;
    s->keepalive[2] = keepalive_probes;
    pthread_mutex_unlock(&s->hs_mu);
    return KVS_OK;
}

int32_t kvs_lease_handshakes(kvs_lease_server *s) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->hs_mu);
    int32_t n = s->nhs;
    pthread_mutex_unlock(&s->hs_mu);
    return n;
}

/* -- handshakes ------------------------------------------------------------------- */

static void drop_handshake(struct kvs_lease_server *s, int k, int close_fd) {
    if (close_fd) close(s->hs[k].fd); /* closing takes it out of the epoll set */
    memmove(&s->hs[k], &s->hs[k + 1], (size_t)(s->nhs - k - 1) * sizeof *s->hs);
    s->nhs--;
}

static void keepalive(struct kvs_lease_server *s, int fd) {
    /* A peer lost with its link sends no FIN: probes find it within idle + interval *
     * probes seconds; data sent into a dead link is bounded the same way (user timeout). */
    int one = 1, user_ms = (s->keepalive[0] + s->keepalive[1] * s->keepalive[2]) * 1000;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &s->keepalive[0], sizeof(int));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &s->keepalive[1], sizeof(int));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &s->keepalive[2], sizeof(int));
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_ms, sizeof user_ms);
}

void kvs_tcp_accept(struct kvs_lease_server *s) {
    for (;;) {
        int fd = accept4(s->tcp_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) return; /* EAGAIN, or a peer that reset before the accept */
        pthread_mutex_lock(&s->hs_mu);
        if (s->nhs == s->max_handshakes) drop_handshake(s, 0, 1); /* the oldest goes */
        struct kvs_handshake *h = &s->hs[s->nhs];
        memset(h, 0, sizeof *h);
        h->fd = fd;
        h->serial = ++s->next_hs;
        h->deadline_ns = kvs_lease_now() + s->handshake_ns;
        char hello[KVS_LEASE_HEADER + NONCE];
        header(hello, NONCE);
        int ok = getrandom(h->nonce, NONCE, 0) == NONCE;
        memcpy(hello + KVS_LEASE_HEADER, h->nonce, NONCE);
        if (ok) keepalive(s, fd);
        if (ok && send_whole(fd, hello, sizeof hello) == 0 &&
            kvs_lease_watch(s, fd, KVS_LEASE_HS_TAG(h->serial), EPOLLIN) == 0)
            s->nhs++;
        else
            close(fd);
        pthread_mutex_unlock(&s->hs_mu);
    }
}

void kvs_tcp_handshake(struct kvs_lease_server *s, uint64_t serial) {
    pthread_mutex_lock(&s->hs_mu);
    int k = 0;
    while (k < s->nhs && s->hs[k].serial != serial) k++;
    if (k == s->nhs) { /* dropped earlier in this round */
        pthread_mutex_unlock(&s->hs_mu);
        return;
    }
    struct kvs_handshake *h = &s->hs[k];
    /* Exactly the proof: a request sent right behind it stays in the socket for later. */
    ssize_t got = recv(h->fd, h->got + h->ngot, PROOF - h->ngot, MSG_DONTWAIT);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) {
        pthread_mutex_unlock(&s->hs_mu);
        return;
    }
    if (got <= 0) { /* closed or reset during the handshake */
        drop_handshake(s, k, 1);
        pthread_mutex_unlock(&s->hs_mu);
        return;
    }
    h->ngot += (uint32_t)got;
    if (h->ngot < PROOF) {
        pthread_mutex_unlock(&s->hs_mu);
        return;
    }
    uint32_t len;
    memcpy(&len, h->got + 4, 4);
    uint8_t want[MAC];
    const uint8_t *nonce_c = h->got + KVS_LEASE_HEADER;
    mac(s, "client", h->nonce, nonce_c, want);
    int fd = h->fd;
    if (memcmp(h->got, MAGIC, 4) != 0 || len != NONCE + MAC || h->got[8] || h->got[9] ||
        !equal(want, nonce_c + NONCE, MAC)) { /* not this deployment's key */
        drop_handshake(s, k, 1);
        pthread_mutex_unlock(&s->hs_mu);
        return;
    }
    char answer[KVS_LEASE_HEADER + MAC];
    header(answer, MAC);
    mac(s, "server", nonce_c, h->nonce, (uint8_t *)answer + KVS_LEASE_HEADER);
    drop_handshake(s, k, 0);
    epoll_ctl(s->epoll_fd, EPOLL_CTL_DEL, fd, NULL);
    pthread_mutex_unlock(&s->hs_mu);
    /* Served from here: a connection of the lease table. Every served slot taken: closed
     * unanswered, so its handshake ends in EOF. */
    pthread_mutex_lock(&s->mu);
    uint64_t id = kvs_lease_conn_add(s, fd, -1, -1);
    if (!id) {
        close(fd);
        pthread_mutex_unlock(&s->mu);
        return;
    }
    struct kvs_conn *cn = kvs_lease_conn(s, id);
    cn->tcp = 1;
    if (send_whole(fd, answer, sizeof answer) < 0 ||
        kvs_lease_watch(s, fd, KVS_LEASE_CONN_TAG(id), EPOLLIN) < 0)
        kvs_lease_conn_end(s, id, 1, KVS_LWHY_CLOSED); /* it left meanwhile: nothing was leased */
    pthread_mutex_unlock(&s->mu);
}

int64_t kvs_tcp_expire_handshakes(struct kvs_lease_server *s) {
    pthread_mutex_lock(&s->hs_mu);
    int64_t now = kvs_lease_now(), next = 0;
    for (int k = 0; k < s->nhs;) {
        if (s->hs[k].deadline_ns <= now) {
            drop_handshake(s, k, 1);
            continue;
        }
        if (!next || s->hs[k].deadline_ns < next) next = s->hs[k].deadline_ns;
        k++;
    }
    pthread_mutex_unlock(&s->hs_mu);
    return next;
}

void kvs_tcp_close_handshakes(struct kvs_lease_server *s) {
    pthread_mutex_lock(&s->hs_mu);
    while (s->nhs) drop_handshake(s, s->nhs - 1, 1);
    pthread_mutex_unlock(&s->hs_mu);
}

/* -- served connections ------------------------------------------------------------ */

void kvs_tcp_conn_free(struct kvs_conn *cn) {
    free(cn->in);
    free(cn->out);
    cn->in = cn->out = NULL;
    cn->nin = cn->nout = cn->sent = 0;
}

static void want(struct kvs_lease_server *s, struct kvs_conn *cn, uint32_t events) {
    struct epoll_event ev = {.events = events, .data.u64 = KVS_LEASE_CONN_TAG(cn->id)};
    epoll_ctl(s->epoll_fd, EPOLL_CTL_MOD, cn->fd, &ev);
}

int kvs_tcp_send(struct kvs_lease_server *s, struct kvs_conn *cn, const char *head, const char *payload,
                 uint32_t len) {
    uint32_t whole = KVS_LEASE_HEADER + len, cap = 2 * (KVS_LEASE_HEADER + (uint32_t)s->max_payload);
    ssize_t w = 0;
    if (!cn->nout) { /* nothing queued: straight into the socket, as much as it takes */
        struct iovec iov[2] = {{(void *)head, KVS_LEASE_HEADER}, {(void *)payload, len}};
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = 2};
        do w = sendmsg(cn->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        while (w < 0 && errno == EINTR);
        if (w < 0 && errno != EAGAIN) return KVS_E_SYS;
        if (w < 0) w = 0;
        if ((uint32_t)w == whole) return KVS_OK;
    }
    /* The rest waits for EPOLLOUT (bounded: a peer that reads nothing loses its connection). */
    if (cn->nout - cn->sent + whole - (uint32_t)w > cap) return KVS_E_SYS;
    if (!cn->out && !(cn->out = malloc(cap))) return KVS_E_NOMEM;
    if (cn->sent) {
        memmove(cn->out, cn->out + cn->sent, cn->nout - cn->sent);
        cn->nout -= cn->sent;
        cn->sent = 0;
    }
    for (uint32_t i = (uint32_t)w; i < whole; i++) /* bytes i.. of header then payload */
        cn->out[cn->nout++] = i < KVS_LEASE_HEADER ? head[i] : payload[i - KVS_LEASE_HEADER];
    want(s, cn, EPOLLOUT);
    return KVS_OK;
}

/* Answer every whole frame received (until an answer waits for the socket). */
static void frames(struct kvs_lease_server *s, struct kvs_conn *cn, char *reply, uint32_t rcap) {
    uint64_t id = cn->id;
    uint32_t at = 0;
    while (cn->nin - at >= KVS_LEASE_HEADER && !cn->nout) {
        const char *h = cn->in + at;
        uint32_t len;
        memcpy(&len, h + 4, 4);
        if (memcmp(h, MAGIC, 4) != 0 || h[8] || h[9] || len > (uint32_t)s->max_payload) {
            kvs_lease_conn_end(s, id, 0, KVS_LWHY_STOPPED); /* out of step: Python's recv raised FRAME */
            return;
        }
        if (cn->nin - at - KVS_LEASE_HEADER < len) break;
        at += KVS_LEASE_HEADER + len;
        kvs_lease_answer_frame(s, cn, h + KVS_LEASE_HEADER, len, reply, rcap);
        if (!(cn = kvs_lease_conn(s, id))) return; /* a failed send ended it */
    }
    memmove(cn->in, cn->in + at, cn->nin - at);
    cn->nin -= at;
}

void kvs_tcp_ready(struct kvs_lease_server *s, struct kvs_conn *cn, uint32_t events, char *reply, uint32_t rcap) {
    uint64_t id = cn->id;
    if (cn->nout) { /* an answer is waiting: send it before reading more */
        ssize_t w;
        do w = send(cn->fd, cn->out + cn->sent, cn->nout - cn->sent, MSG_DONTWAIT | MSG_NOSIGNAL);
        while (w < 0 && errno == EINTR);
        if (w < 0 && errno == EAGAIN) return;
        if (w <= 0) {
            kvs_lease_conn_end(s, id, 1, KVS_LWHY_CLOSED);
            return;
        }
        cn->sent += (uint32_t)w;
        if (cn->sent < cn->nout) return;
        cn->nout = cn->sent = 0;
        want(s, cn, EPOLLIN);
        frames(s, cn, reply, rcap); /* requests that arrived meanwhile */
        return;
    }
    if (!(events & (EPOLLIN | EPOLLHUP | EPOLLERR))) return;
    uint32_t cap = KVS_LEASE_HEADER + (uint32_t)s->max_payload;
    if (!cn->in && !(cn->in = malloc(cap))) {
        kvs_lease_conn_end(s, id, 0, KVS_LWHY_STOPPED);
        return;
    }
    ssize_t got;
    do got = recv(cn->fd, cn->in + cn->nin, cap - cn->nin, MSG_DONTWAIT);
    while (got < 0 && errno == EINTR);
    if (got < 0 && errno == EAGAIN) return;
    if (got <= 0) { /* EOF, reset, or keepalive/user timeout (ETIMEDOUT): the importer is gone */
        kvs_lease_conn_end(s, id, 1, KVS_LWHY_CLOSED);
        return;
    }
    cn->nin += (uint32_t)got;
    frames(s, cn, reply, rcap);
}
