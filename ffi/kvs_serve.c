/* What kvstate's native servers share (kvs_serve.h). */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kvs_serve.h"

void kvs_frame_header(char out[KVS_FRAME_HEADER], uint32_t len, uint16_t nfds) {
    memcpy(out, KVS_FRAME_MAGIC, 4);
    memcpy(out + 4, &len, 4); /* little endian, as struct "<4sIH2x" (x86_64, aarch64) */
    memcpy(out + 8, &nfds, 2);
    out[10] = out[11] = 0;
}

int kvs_accept_same_uid(int listen_fd, uint32_t uid, struct ucred *peer) {
    int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return -1;
    socklen_t clen = sizeof *peer;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, peer, &clen) < 0 || peer->uid != uid) {
        close(fd); /* another uid: refused, as kvstate.channel.conn refuses it */
        return -1;
    }
    return fd;
}

int kvs_connection_limit(char *buf, size_t cap, int max_connections) {
    int n = snprintf(buf, cap, "{\"code\":\"ConnectionLimit\",\"detail\":\"connection refused: %d "
                     "connection handler(s) already running\",\"ok\":false}", max_connections);
    return n < 0 ? 0 : (size_t)n < cap ? n : (int)cap - 1;
}
