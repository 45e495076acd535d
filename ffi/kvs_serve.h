/* What kvstate's native servers share: the exporter's lease thread (kvs_lease_thread.c)
 * and the decode index's (kvs_index_thread.c). One home for the frame header of
 * kvstate.channel.framing, for accepting only peers of this process's uid (as
 * kvstate.channel.conn does), and for the words of the refusal past the connection cap
 * (kvstate.core.errors.Busy.connections). Its includer defines _GNU_SOURCE first (struct ucred). */
#ifndef KVS_SERVE_H
#define KVS_SERVE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#define KVS_FRAME_HEADER 12
#define KVS_FRAME_MAGIC "KVS\x01"

/* The header of a frame of `len` payload bytes and `nfds` fds: struct "<4sIH2x". */
void kvs_frame_header(char out[KVS_FRAME_HEADER], uint32_t len, uint16_t nfds);
/* A connection from `listen_fd` (nonblocking, close-on-exec) whose peer runs as `uid`, with
 * its credentials in *peer; -1 when none is waiting, or the peer was another uid (closed). */
int kvs_accept_same_uid(int listen_fd, uint32_t uid, struct ucred *peer);
/* The ConnectionLimit refusal's JSON payload in buf; its length. */
int kvs_connection_limit(char *buf, size_t cap, int max_connections);

#endif /* KVS_SERVE_H */
