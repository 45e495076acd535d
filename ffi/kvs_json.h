/* A tiny strict reader of the flat JSON requests importers send the lease server
 * (kvs_lease.c): one object whose values are strings, integers or anything else (typed
 * and skipped), and one level of `items`, an array of such objects. It reads no more than
 * that: it allocates nothing, points into the caller's buffer, and refuses (-1) what
 * kvstate.channel.framing.decode refuses (not an object, bad JSON, a duplicate key,
 * NaN or Infinity), and also any string with an escape or a non-ASCII byte, which no
 * importer sends. */
#ifndef KVS_JSON_H
#define KVS_JSON_H

#include <stddef.h>
#include <stdint.h>

/* Value types, as Python's type() names them (the refusal says "must be int, not str"). */
enum kj_type { KJ_STR = 1, KJ_INT, KJ_FLOAT, KJ_BOOL, KJ_NULL, KJ_OBJ, KJ_LIST };

#define KJ_MAXF 16      /* fields of one object that are kept (more: refused) */
#define KJ_MAXITEMS 256 /* entries of `items` that are kept (more: refused) */

struct kj_field {
    const char *key, *s; /* s: a string's bytes (not terminated); any other value's JSON text */
    uint32_t klen, slen;
    int type;
    int big;   /* an integer beyond int64: it equals no rank, lease or generation */
    int64_t i; /* an integer's value */
};

struct kj_obj {
    int is_obj; /* an `items` entry that is not an object has 0 and no fields */
    int n;
    struct kj_field f[KJ_MAXF];
};

struct kj_req {
    struct kj_obj top;
    int nitems;   /* entries of `items` when it is an array, else -1 */
    struct kj_obj items[KJ_MAXITEMS];
};

/* 0, or -1 when `p` is not one JSON object the reader takes. */
int kj_parse(const char *p, size_t n, struct kj_req *out);
/* The field `key` of `o`, or NULL. */
const struct kj_field *kj_get(const struct kj_obj *o, const char *key);
/* The fields of the object JSON text `p` (one a nested field keeps): 0, or -1. */
int kj_object(const char *p, size_t n, struct kj_obj *out);
/* The JSON array text `p` as unsigned 64-bit integers: *count entries (the first `cap`
 * stored in `out`, which may be NULL to count). 0 when every entry is one, 1 when any is
 * not (a float, a bool, a negative or too big number, anything else), -1 when `p` is not
 * an array. */
int kj_u64s(const char *p, size_t n, uint64_t *out, uint32_t cap, uint32_t *count);
/* Python's name of a value type ("str", "int", ...). */
const char *kj_type_name(int type);

#endif /* KVS_JSON_H */
