/* The decode index's lookup table and its answers (kvs_index.h). The answers are the
 * bytes Python's DecodeIndex._answer sends (tests/native/test_index_differential.py
 * holds them equal); only a well-formed `lookup` or `descriptors` under this engine's
 * compatibility key is answered here, anything else goes to Python. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvs.h"
#include "kvs_index_state.h"

static uint32_t home(const struct kvs_index *x, const uint8_t *h) {
    uint64_t v = 0; /* block hashes are digests: their first bytes spread well */
    memcpy(&v, h, x->hash_bytes < 8 ? x->hash_bytes : 8);
    v ^= v >> 33;
    v *= UINT64_C(0xff51afd7ed558ccd);
    v ^= v >> 33;
    return (uint32_t)v & x->mask;
}

/* The position in `index` of `h`, or of the empty entry where it would go. */
static uint32_t probe(const struct kvs_index *x, const uint8_t *h) {
    uint32_t i = home(x, h);
    while (x->index[i] && memcmp(x->hashes + (size_t)(x->index[i] - 1) * x->hash_bytes, h, x->hash_bytes) != 0)
        i = (i + 1) & x->mask;
    return i;
}

int kvs_index_new(const char *compat, uint32_t compat_len, const char *not_ready, uint32_t not_ready_len,
                  uint32_t hash_bytes, uint32_t capacity, uint32_t max_blocks, int32_t max_payload,
                  uint32_t allowed_uid, int32_t max_connections, int64_t first_ns, int64_t idle_ns,
                  kvs_index **out) {
    if (!out || !compat || !not_ready || !hash_bytes || hash_bytes > 64 || !capacity || capacity > (1u << 28) ||
        !max_blocks || max_payload < 4096 || max_connections < 1 || first_ns <= 0 || idle_ns <= 0)
        return KVS_E_INVAL;
    struct kvs_index *x = calloc(1, sizeof *x);
    if (!x) return KVS_E_NOMEM;
    uint32_t size = 4;
    while (size < capacity * 2u) size <<= 1; /* under half full: short probes */
    x->compat = malloc(compat_len + 1);
    x->not_ready = malloc(not_ready_len + 1);
    x->hashes = calloc(capacity, hash_bytes);
    x->live = calloc(capacity, 1);
    x->keys = calloc(capacity, sizeof *x->keys);
    x->index = calloc(size, sizeof *x->index);
    x->by_key = calloc(size, sizeof *x->by_key);
    x->ranks = calloc(capacity, sizeof *x->ranks);
    x->report_keys = calloc(max_blocks, sizeof *x->report_keys);
    x->touched = calloc(KVS_INDEX_TOUCHED, sizeof *x->touched);
    x->conns = calloc((size_t)max_connections, sizeof *x->conns);
    if (!x->compat || !x->not_ready || !x->hashes || !x->live || !x->keys || !x->index || !x->touched || !x->conns ||
        !x->by_key || !x->ranks || !x->report_keys) {
        kvs_index_free(x);
        return KVS_E_NOMEM;
    }
    pthread_mutex_init(&x->mu, NULL);
    memcpy(x->compat, compat, compat_len);
    memcpy(x->not_ready, not_ready, not_ready_len);
    x->compat_len = compat_len;
    x->not_ready_len = not_ready_len;
    x->hash_bytes = hash_bytes;
    x->capacity = capacity;
    x->max_blocks = max_blocks;
    x->max_payload = max_payload;
    x->max_connections = max_connections;
    x->uid = allowed_uid;
    x->first_ns = first_ns;
    x->idle_ns = idle_ns;
    x->mask = size - 1;
    for (int k = 0; k < max_connections; k++) x->conns[k].fd = -1;
    x->handoffs = (struct kvs_index_queue){.at = x->handoff_at, .size = KVS_INDEX_HANDOFFS};
    x->reports = (struct kvs_index_queue){.at = x->report_at, .size = KVS_INDEX_REPORTS};
    x->listen_fd = x->epoll_fd = x->cmd_fd = x->handoff_fd = -1;
    *out = x;
    return KVS_OK;
}

void kvs_index_free(kvs_index *x) {
    if (!x) return;
    kvs_index_queue_clear(&x->handoffs);
    kvs_index_queue_clear(&x->reports);
    if (x->handoff_fd >= 0) close(x->handoff_fd);
    free(x->compat);
    free(x->not_ready);
    free(x->hashes);
    free(x->live);
    free(x->keys);
    free(x->index);
    free(x->by_key);
    free(x->ranks);
    free(x->report_keys);
    free(x->touched);
    free(x->conns);
    free(x->descriptor_set);
    free(x->epochs);
    if (x->mask) pthread_mutex_destroy(&x->mu);
    free(x);
}

int kvs_index_deadlines(kvs_index *x, int64_t first_ns, int64_t idle_ns) {
    if (!x || first_ns <= 0 || idle_ns <= 0) return KVS_E_INVAL;
    __atomic_store_n(&x->first_ns, first_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&x->idle_ns, idle_ns, __ATOMIC_RELAXED);
    return KVS_OK;
}

/* The position in `by_key` of `key`, or of the empty entry where it would go. */
static uint32_t home_key(const struct kvs_index *x, uint64_t v) {
    v ^= v >> 33; /* keys are digests too, but mix anyway: a test may use small numbers */
    v *= UINT64_C(0xc4ceb9fe1a85ec53);
    v ^= v >> 33;
    return (uint32_t)v & x->mask;
}

static uint32_t probe_key(const struct kvs_index *x, uint64_t key) {
    uint32_t i = home_key(x, key);
    while (x->by_key[i] && x->keys[x->by_key[i] - 1] != key) i = (i + 1) & x->mask;
    return i;
}

/* Remove the entry at `i` of `index` (or of `by_key`), moving later entries of its run back
 * (no tombstones). */
static void unlink_at(struct kvs_index *x, uint32_t *table, uint32_t i) {
    table[i] = 0;
    for (uint32_t j = (i + 1) & x->mask; table[j]; j = (j + 1) & x->mask) {
        uint32_t slot = table[j] - 1;
        uint32_t k = table == x->by_key ? home_key(x, x->keys[slot])
                                        : home(x, x->hashes + (size_t)slot * x->hash_bytes);
        /* the entry at j stays when its home lies cyclically in (i, j] */
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        table[i] = table[j];
        table[j] = 0;
        i = j;
    }
}

/* Under `mu`: bank block `slot` (its hash and key set) becomes advertised at `index[i]`. */
static void publish(struct kvs_index *x, uint32_t slot, uint32_t i) {
    x->live[slot] = KVS_SLOT_ADVERTISED;
    x->index[i] = slot + 1;
    x->nlive++;
}

/* Under `mu`: an expected block leaves `by_key` (its slot is then free, or published). */
static void unexpect(struct kvs_index *x, uint32_t slot) {
    unlink_at(x, x->by_key, probe_key(x, x->keys[slot]));
    x->live[slot] = KVS_SLOT_FREE;
}

int kvs_index_advertise(kvs_index *x, const uint8_t *hash, uint32_t slot, uint64_t key) {
    if (!x || !hash) return KVS_E_INVAL;
    if (slot >= x->capacity) return KVS_E_RANGE;
    pthread_mutex_lock(&x->mu);
    int rc = KVS_OK;
    uint32_t i = probe(x, hash);
    const uint8_t *held = x->hashes + (size_t)slot * x->hash_bytes;
    int same = x->keys[slot] == key && memcmp(held, hash, x->hash_bytes) == 0;
    if (x->live[slot] == KVS_SLOT_ADVERTISED && x->index[i] == slot + 1 && same) {
        /* the thread advertised it from the ranks' reports before Python's table heard of them */
    } else if (x->live[slot] == KVS_SLOT_EXPECTED && same && !x->index[i]) {
        unexpect(x, slot); /* Python's table heard of every rank's store first (a rank's own report) */
        publish(x, slot, i);
    } else if (x->index[i] || x->live[slot]) {
        rc = KVS_E_BUSY; /* the hash, or the bank block, is advertised (or expected) already */
    } else {
        memcpy(x->hashes + (size_t)slot * x->hash_bytes, hash, x->hash_bytes);
        x->keys[slot] = key;
        publish(x, slot, i);
    }
    pthread_mutex_unlock(&x->mu);
    return rc;
}

int kvs_index_expect(kvs_index *x, const uint8_t *hash, uint32_t slot, uint64_t key, uint32_t tp) {
    if (!x || !hash || !tp || tp > KVS_INDEX_MAX_TP) return KVS_E_INVAL;
    if (slot >= x->capacity) return KVS_E_RANGE;
    pthread_mutex_lock(&x->mu);
    int rc = KVS_OK;
    uint32_t j = probe_key(x, key);
    if (x->live[slot] || x->by_key[j]) {
        rc = KVS_E_BUSY;
    } else {
        memcpy(x->hashes + (size_t)slot * x->hash_bytes, hash, x->hash_bytes);
        x->keys[slot] = key;
        x->ranks[slot] = 0;
        x->live[slot] = KVS_SLOT_EXPECTED;
        x->by_key[j] = slot + 1;
        x->store_tp = tp;
    }
    pthread_mutex_unlock(&x->mu);
    return rc;
}

int kvs_index_settle(kvs_index *x, uint32_t slot, uint64_t key) {
    if (!x) return KVS_E_INVAL;
    if (slot >= x->capacity) return KVS_E_RANGE;
    pthread_mutex_lock(&x->mu);
    int rc = KVS_E_NOENT;
    if (x->live[slot] == KVS_SLOT_EXPECTED && x->keys[slot] == key) {
        unexpect(x, slot);
        rc = KVS_OK;
    }
    pthread_mutex_unlock(&x->mu);
    return rc;
}

int kvs_index_rank(kvs_index *x, uint32_t rank, int32_t pid) {
    if (!x || rank >= KVS_INDEX_MAX_TP || pid < 0) return KVS_E_INVAL;
    pthread_mutex_lock(&x->mu);
    x->rank_pid[rank] = pid;
    pthread_mutex_unlock(&x->mu);
    return KVS_OK;
}

int64_t kvs_index_advertised_here(kvs_index *x) {
    if (!x) return KVS_E_INVAL;
    pthread_mutex_lock(&x->mu);
    int64_t n = x->advertised_here;
    pthread_mutex_unlock(&x->mu);
    return n;
}

int kvs_index_withdraw(kvs_index *x, const uint8_t *hash) {
    if (!x || !hash) return KVS_E_INVAL;
    pthread_mutex_lock(&x->mu);
    uint32_t i = probe(x, hash);
    int rc = KVS_E_NOENT;
    if (x->index[i]) {
        x->live[x->index[i] - 1] = KVS_SLOT_FREE;
        x->nlive--;
        unlink_at(x, x->index, i);
        rc = KVS_OK;
    }
    pthread_mutex_unlock(&x->mu);
    return rc;
}

int32_t kvs_index_advertised(kvs_index *x) {
    if (!x) return KVS_E_INVAL;
    pthread_mutex_lock(&x->mu);
    int32_t n = (int32_t)x->nlive;
    pthread_mutex_unlock(&x->mu);
    return n;
}

int kvs_index_ready(kvs_index *x, const char *descriptor_set, uint32_t len, const uint64_t *epochs, uint32_t tp,
                    uint64_t generation) {
    if (!x || !descriptor_set || !epochs || !tp || tp > 4096) return KVS_E_INVAL;
    char *d = malloc(len ? len : 1);
    uint64_t *e = malloc(tp * sizeof *e);
    if (!d || !e) {
        free(d);
        free(e);
        return KVS_E_NOMEM;
    }
    memcpy(d, descriptor_set, len);
    memcpy(e, epochs, tp * sizeof *e);
    pthread_mutex_lock(&x->mu);
    free(x->descriptor_set);
    free(x->epochs);
    x->descriptor_set = d;
    x->descriptor_set_len = len;
    x->epochs = e;
    x->tp = tp;
    x->generation = generation;
    x->ready = 1;
    pthread_mutex_unlock(&x->mu);
    return KVS_OK;
}

int kvs_index_unready(kvs_index *x) {
    if (!x) return KVS_E_INVAL;
    pthread_mutex_lock(&x->mu);
    x->ready = 0;
    pthread_mutex_unlock(&x->mu);
    return KVS_OK;
}

static int b64val(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Strict base64 (whole quanta, padding only at the end) into `out`: its length, or -1. */
static int64_t unbase64(const char *s, uint32_t n, uint8_t *out, uint64_t cap) {
    if (n % 4) return -1;
    uint64_t w = 0;
    for (uint32_t i = 0; i < n; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            if (s[i + k] == '=' && i + 4 == n && k >= 2) {
                v[k] = 0;
                pad++;
            } else {
                if (pad) return -1; /* "=" then a letter */
                v[k] = b64val((unsigned char)s[i + k]);
                if (v[k] < 0) return -1;
            }
        }
        uint32_t q = (uint32_t)(v[0] << 18 | v[1] << 12 | v[2] << 6 | v[3]);
        uint8_t b[3] = {(uint8_t)(q >> 16), (uint8_t)(q >> 8), (uint8_t)q};
        int k = 3 - pad;
        if (w + (uint64_t)k > cap) return -1;
        memcpy(out + w, b, (size_t)k);
        w += (uint64_t)k;
    }
    return (int64_t)w;
}

struct out {
    char *p;
    uint32_t n, cap;
    int full;
};

static void put(struct out *o, const char *s, size_t n) {
    if (o->full || n > o->cap - o->n) {
        o->full = 1;
        return;
    }
    memcpy(o->p + o->n, s, n);
    o->n += (uint32_t)n;
}

static void puts_(struct out *o, const char *s) { put(o, s, strlen(s)); }

static void putu(struct out *o, uint64_t v) {
    char b[24];
    int n = snprintf(b, sizeof b, "%llu", (unsigned long long)v);
    put(o, b, (size_t)n);
}

static int field_is(const struct kj_field *f, const char *s) {
    return f && f->type == KJ_STR && f->slen == strlen(s) && memcmp(f->s, s, f->slen) == 0;
}

/* `found`, as wire.encode writes it (sorted keys, no spaces). Called with `mu` held. */
static int found(struct kvs_index *x, const uint8_t *h, uint32_t n, struct out *o) {
    uint32_t held = 0;
    while (held < n) {
        uint32_t i = probe(x, h + (size_t)held * x->hash_bytes);
        if (!x->index[i]) break; /* the longest prefix stored on every rank */
        held++;
    }
    x->lookups++;
    puts_(o, "{\"blocks\":");
    putu(o, held);
    puts_(o, ",\"epochs\":[");
    for (uint32_t r = 0; r < x->tp; r++) {
        if (r) puts_(o, ",");
        putu(o, x->epochs[r]);
    }
    puts_(o, "],\"generation\":");
    putu(o, x->generation);
    for (int pass = 0; pass < 2; pass++) {
        puts_(o, pass ? "],\"kind\":\"found\",\"slots\":[" : ",\"keys\":[");
        for (uint32_t k = 0; k < held; k++) {
            uint32_t slot = x->index[probe(x, h + (size_t)k * x->hash_bytes)] - 1;
            if (k) puts_(o, ",");
            putu(o, pass ? slot : x->keys[slot]);
            if (pass) { /* each find counts as used, oldest first */
                x->touched[(x->touched_head + x->touched_n) % KVS_INDEX_TOUCHED] = slot;
                if (x->touched_n < KVS_INDEX_TOUCHED) x->touched_n++;
                else x->touched_head = (x->touched_head + 1) % KVS_INDEX_TOUCHED;
            }
        }
    }
    puts_(o, "]}");
    return o->full ? KVS_INDEX_PYTHON : KVS_OK;
}

int kvs_index_answer(kvs_index *x, const char *req, uint32_t len, char *out, uint32_t cap, uint32_t *outlen) {
    if (!x || !req || !out || !outlen) return KVS_E_INVAL;
    pthread_mutex_lock(&x->mu);
    int rc = KVS_INDEX_PYTHON;
    uint8_t *hashes = NULL;
    struct out o = {out, 0, cap, 0};
    struct kj_req *q = &x->req;
    if (kj_parse(req, len, q) != 0 || q->nitems >= 0) goto done;
    const struct kj_field *kind = kj_get(&q->top, "kind"), *compat = kj_get(&q->top, "compat");
    int lookup = field_is(kind, "lookup");
    if (!(lookup || field_is(kind, "descriptors")) || q->top.n != (lookup ? 3 : 2)) goto done;
    /* another key (or this one written otherwise) is Python's: it names the mismatch */
    if (!compat || compat->type != KJ_OBJ || compat->slen != x->compat_len ||
        memcmp(compat->s, x->compat, x->compat_len) != 0)
        goto done;
    uint32_t n = 0;
    if (lookup) {
        const struct kj_field *hf = kj_get(&q->top, "hashes");
        struct kj_obj b64;
        if (!hf || hf->type != KJ_OBJ || kj_object(hf->s, hf->slen, &b64) != 0 || b64.n != 1) goto done;
        const struct kj_field *text = kj_get(&b64, "$b64");
        if (!text || text->type != KJ_STR) goto done;
        uint64_t most = (uint64_t)x->max_blocks * x->hash_bytes;
        hashes = malloc(most ? most : 1);
        if (!hashes) goto done;
        int64_t got = unbase64(text->s, text->slen, hashes, most);
        /* not whole hashes, or too many: Python refuses it (protocol) */
        if (got < 0 || (uint64_t)got % x->hash_bytes) goto done;
        n = (uint32_t)((uint64_t)got / x->hash_bytes);
    }
    if (!x->ready) {
        put(&o, x->not_ready, x->not_ready_len);
        rc = o.full ? KVS_INDEX_PYTHON : KVS_OK;
    } else if (!lookup) {
        put(&o, x->descriptor_set, x->descriptor_set_len);
        rc = o.full ? KVS_INDEX_PYTHON : KVS_OK;
    } else {
        rc = found(x, hashes, n, &o);
    }
done:
    pthread_mutex_unlock(&x->mu);
    free(hashes);
    *outlen = rc == KVS_OK ? o.n : 0;
    return rc;
}

int32_t kvs_index_touched(kvs_index *x, uint32_t *slots, int32_t cap) {
    if (!x || !slots || cap < 0) return KVS_E_INVAL;
    pthread_mutex_lock(&x->mu);
    int32_t n = 0;
    while (n < cap && x->touched_n) {
        slots[n++] = x->touched[x->touched_head];
        x->touched_head = (x->touched_head + 1) % KVS_INDEX_TOUCHED;
        x->touched_n--;
    }
    pthread_mutex_unlock(&x->mu);
    return n;
}

int64_t kvs_index_lookups(kvs_index *x) {
    if (!x) return KVS_E_INVAL;
    pthread_mutex_lock(&x->mu);
    int64_t n = x->lookups;
    pthread_mutex_unlock(&x->mu);
    return n;
}

/* -- what waits for Python ----------------------------------------------------------------- */

/* Under `mu`: append (0), or -1 when `q` is full. */
static int queue_push(struct kvs_index_queue *q, int fd, char *buf, uint32_t len) {
    if (q->n == q->size) return -1;
    q->at[(q->head + q->n++) % q->size] = (struct kvs_index_msg){fd, buf, len};
    return 0;
}

/* Under `mu`: the oldest into `buf` (1, with its fd), 0 when `q` is empty, KVS_E_RANGE when
 * it does not fit `cap`. */
static int32_t queue_pop(struct kvs_index_queue *q, int32_t *fd, char *buf, uint32_t cap, uint32_t *len) {
    if (!q->n) return 0;
    struct kvs_index_msg *m = &q->at[q->head];
    if (m->len > cap) return KVS_E_RANGE;
    *fd = m->fd;
    memcpy(buf, m->buf, m->len);
    *len = m->len;
    free(m->buf);
    q->head = (q->head + 1) % q->size;
    q->n--;
    return 1;
}

void kvs_index_queue_clear(struct kvs_index_queue *q) {
    for (; q->n; q->n--, q->head = (q->head + 1) % q->size) {
        if (q->at[q->head].fd >= 0) close(q->at[q->head].fd);
        free(q->at[q->head].buf);
    }
}

/* Under `mu`: Python has something to take (it also looks without the wake-up). */
static void wake_python(struct kvs_index *x) {
    uint64_t one = 1;
    if (write(x->handoff_fd, &one, sizeof one) < 0) { /* it looks each time round anyway */ }
}

int kvs_index_hand_over(struct kvs_index *x, int fd, const char *req, uint32_t len) {
    char *copy = malloc(len ? len : 1);
    if (!copy) return -1;
    memcpy(copy, req, len);
    pthread_mutex_lock(&x->mu);
    int ok = x->handoff_fd >= 0 && queue_push(&x->handoffs, fd, copy, len) == 0;
    if (ok) wake_python(x);
    pthread_mutex_unlock(&x->mu);
    if (!ok) free(copy);
    return ok ? 0 : -1;
}

int32_t kvs_index_handoff_fd(kvs_index *x) { return x ? x->handoff_fd : KVS_E_INVAL; }

int32_t kvs_index_next_handoff(kvs_index *x, int32_t *fd, char *buf, uint32_t cap, uint32_t *len) {
    if (!x || !fd || !buf || !len) return KVS_E_INVAL;
    pthread_mutex_lock(&x->mu);
    int32_t rc = queue_pop(&x->handoffs, fd, buf, cap, len);
    pthread_mutex_unlock(&x->mu);
    return rc;
}

/* -- the ranks' report links ---------------------------------------------------------------- */

int kvs_index_link(struct kvs_index *x, const char *req, uint32_t len, int32_t pid, char *out, uint32_t cap,
                   uint32_t *outlen) {
    pthread_mutex_lock(&x->mu);
    int rc = -2;
    struct kj_req *q = &x->req;
    if (kj_parse(req, len, q) == 0 && q->nitems < 0 && field_is(kj_get(&q->top, "kind"), "report_link")) {
        const struct kj_field *r = kj_get(&q->top, "rank");
        rc = -1; /* a report link, refused unless from the process Python named for that rank */
        if (q->top.n == 2 && r && r->type == KJ_INT && !r->big && r->i >= 0 && r->i < KVS_INDEX_MAX_TP &&
            pid > 0 && x->rank_pid[r->i] == pid) {
            struct out o = {out, 0, cap, 0};
            puts_(&o, "{\"kind\":\"linked\",\"rank\":");
            putu(&o, (uint64_t)r->i);
            puts_(&o, "}");
            if (!o.full) {
                *outlen = o.n;
                rc = (int)r->i;
            }
        }
    }
    pthread_mutex_unlock(&x->mu);
    return rc;
}

/* Under `mu`: `rank` stored the block of `key`; advertise it once every rank has. */
static void count_store(struct kvs_index *x, int32_t rank, uint64_t key) {
    uint32_t j = probe_key(x, key);
    if (!x->by_key[j] || (uint32_t)rank >= x->store_tp) return; /* not expected (Python settled it), or no such rank */
    uint32_t slot = x->by_key[j] - 1;
    x->ranks[slot] |= UINT64_C(1) << rank;
    if ((uint32_t)__builtin_popcountll(x->ranks[slot]) < x->store_tp) return;
    uint32_t i = probe(x, x->hashes + (size_t)slot * x->hash_bytes);
    if (x->index[i]) return; /* its hash is advertised in another block: Python's table decides */
    unlink_at(x, x->by_key, j);
    publish(x, slot, i);
    x->advertised_here++;
}

int kvs_index_take_report(struct kvs_index *x, int32_t rank, int32_t pid, const char *msg, uint32_t len) {
    char *copy = malloc(len ? len : 1);
    pthread_mutex_lock(&x->mu);
    uint64_t *keys = x->report_keys;
    int rc = -1;
    struct kj_req *q = &x->req;
    const struct kj_field *r, *k, *f;
    uint32_t n = 0, nf = 0;
    /* as wire.decode(msg, "stored") takes it, from the rank this link is, still in its process */
    if (!copy || x->rank_pid[rank] != pid || x->reports.n == x->reports.size || x->handoff_fd < 0 ||
        kj_parse(msg, len, q) != 0 || q->nitems >= 0 || q->top.n != 4 ||
        !field_is(kj_get(&q->top, "kind"), "stored") || !(r = kj_get(&q->top, "rank")) || r->type != KJ_INT ||
        r->big || r->i != rank || !(k = kj_get(&q->top, "keys")) || k->type != KJ_LIST ||
        !(f = kj_get(&q->top, "failed")) || f->type != KJ_LIST ||
        kj_u64s(k->s, k->slen, keys, x->max_blocks, &n) != 0 || n > x->max_blocks ||
        kj_u64s(f->s, f->slen, NULL, 0, &nf) != 0 || nf > x->max_blocks)
        goto done;
    for (uint32_t i = 0; i < n; i++) count_store(x, rank, keys[i]);
    memcpy(copy, msg, len);
    queue_push(&x->reports, -1, copy, len); /* room was checked above */
    copy = NULL;
    wake_python(x);
    rc = 0;
done:
    pthread_mutex_unlock(&x->mu);
    free(copy);
    return rc;
}

int kvs_index_report_room(struct kvs_index *x) {
    pthread_mutex_lock(&x->mu);
    int room = x->reports.n < x->reports.size;
    pthread_mutex_unlock(&x->mu);
    return room;
}

int32_t kvs_index_next_report(kvs_index *x, char *buf, uint32_t cap, uint32_t *len) {
    if (!x || !buf || !len) return KVS_E_INVAL;
    int32_t fd;
    pthread_mutex_lock(&x->mu);
    int32_t rc = queue_pop(&x->reports, &fd, buf, cap, len);
    pthread_mutex_unlock(&x->mu);
    return rc;
}
