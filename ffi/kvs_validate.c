/* The descriptor rules for native callers: kvs_validate_descriptor() runs the rules that
 * `kvstate generate` writes from spec/rules.toml into kvs_validate_rules.h, with the
 * semantics the declaration states (the same ones kvstate/core/rules.py evaluates in
 * Python). Pure computation: no allocation, no I/O, no locks; safe from any thread.
 */
#include <string.h>

#include "kvs_validate.h"

/* A kind column at an unknown kind reads 0: no kind bit, no fd, no handle size. */
static inline uint64_t kvs_vkind(const uint64_t *column, uint64_t kind)
{
    return kind < KVS_VKINDS ? column[kind] : 0;
}

/* x % 0 is x, so a declared `%` is defined on every input (C's is not). */
static inline uint64_t kvs_vmod(uint64_t a, uint64_t b)
{
    return b ? a % b : a;
}

static inline int kvs_vid_eq(const uint8_t *a, const uint8_t *b)
{
    return memcmp(a, b, KVS_VID_BYTES) == 0;
}

static inline int kvs_vid_in(const uint8_t *id, const uint8_t *set, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (kvs_vid_eq(id, set + i * KVS_VID_BYTES))
            return 1;
    return 0;
}

/* The generated rules: kvs_vrules() and KVS_VALIDATE_DIGEST. */
#include "kvs_validate_rules.h"

uint32_t kvs_validate_descriptor(const struct kvs_vfacts *d, const struct kvs_vexpect *e,
                                 uint8_t *rule_reasons)
{
    uint8_t out[KVS_VRULES];
    kvs_vrules(d, e, out);
    if (rule_reasons != NULL)
        memcpy(rule_reasons, out, sizeof out);
    for (int r = 0; r < KVS_VRULES; r++)
        if (out[r] != KVS_REJECT_OK)
            return out[r];
    return KVS_REJECT_OK;
}

void kvs_validate_batch(uint64_t n, const struct kvs_vfacts *d, const struct kvs_vexpect *e,
                        uint32_t *first, uint8_t *rule_reasons)
{
    for (uint64_t i = 0; i < n; i++)
        first[i] = kvs_validate_descriptor(&d[i], &e[i],
                                           rule_reasons != NULL ? rule_reasons + i * KVS_VRULES : NULL);
}

uint32_t kvs_validate_digest(void)
{
    return KVS_VALIDATE_DIGEST;
}
