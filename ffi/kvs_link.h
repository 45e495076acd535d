/* Internal face of a request link (kvs_link.c) for the other C files that drive one
 * (kvs_renew.c). Python sees only the functions declared in kvs.h. */
#ifndef KVS_LINK_H
#define KVS_LINK_H

#include <poll.h>
#include <stdint.h>

#include "kvs.h"

/* One more holder of the link; kvs_link_unref drops it (the last one frees). */
void kvs_link_ref(kvs_link *l);

/* The link's payload cap (what a receive buffer must hold). */
uint32_t kvs_link_max_payload(const kvs_link *l);

/* kvs_link_request in two steps, so that one thread keeps several links' exchanges in
 * flight (the renewal thread: a peer that stops answering must not hold up the others).
 *
 * kvs_link_begin takes the link without waiting and sends, waiting at most `send_ns` for
 * room: KVS_OK (the link stays held until kvs_link_finish; a peer that closed first may
 * have left its answer), KVS_LINK_BUSY (another exchange holds it: nothing sent, try
 * later), or a send's failure (the link is shut and released). */
#define KVS_LINK_BUSY 1
int kvs_link_begin(kvs_link *l, const uint8_t *payload, uint32_t len, int64_t send_ns, int32_t *err);
/* The fds a begun exchange waits on, for poll: the socket (POLLIN), then the peer's pidfd
 * if the link has one. Returns how many it filled (1 or 2). */
int kvs_link_pollfds(const kvs_link *l, struct pollfd *p);
/* Ends a begun exchange and releases the link: `code` 0 reads the answer poll saw (a
 * stream's rest until `deadline_ns`); otherwise the exchange fails with `code`
 * (KVS_E_LINK_TIMEOUT, KVS_E_LINK_PEER_DIED). The link is shut on any failure, as
 * kvs_link_request shuts it. The answer's wait never polls (nothing waits for it). */
int kvs_link_finish(kvs_link *l, kvs_frame *f, int code, int64_t deadline_ns);

#endif
