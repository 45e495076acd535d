/* How the op engine's workers (kvs_ops.c) move bytes: one block, a prefetch of the next
 * block's head, and the fence that makes streaming stores visible before an op is reported
 * finished. Not public. */
#ifndef KVS_COPY_H
#define KVS_COPY_H

#include <stdint.h>

void kvs_copy_block(char *dst, const char *src, uint64_t len);
void kvs_copy_prefetch(const char *src);
void kvs_copy_fence(void);

#endif /* KVS_COPY_H */
