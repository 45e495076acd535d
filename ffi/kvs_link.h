/* Internal face of a request link (kvs_link.c) for the other C files that drive one
 * (kvs_renew.c). Python sees only the functions declared in kvs.h. */
#ifndef KVS_LINK_H
#define KVS_LINK_H

#include <stdint.h>

#include "kvs.h"

/* One more holder of the link; kvs_link_unref drops it (the last one frees). */
void kvs_link_ref(kvs_link *l);

/* The link's payload cap (what a receive buffer must hold). */
uint32_t kvs_link_max_payload(const kvs_link *l);

/* kvs_link_request, its answer waited for asleep whatever the link's spin (the renewal
 * thread: nothing waits for a renewal's answer). */
int kvs_link_request_asleep(kvs_link *l, const uint8_t *payload, uint32_t len, kvs_frame *f, int64_t timeout_ns);

#endif
