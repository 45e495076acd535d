/* The strict reader of flat JSON requests (kvs_json.h). */
#include <string.h>

#include "kvs_json.h"

#define KJ_DEPTH 32 /* nesting a skipped value may have */

struct cur {
    const char *p, *end;
};

static void ws(struct cur *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) c->p++;
}

static int lit(struct cur *c, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, word, n) != 0) return -1;
    c->p += n;
    return 0;
}

/* A string without escapes or non-ASCII bytes: [*s, *s + *len). */
static int str(struct cur *c, const char **s, uint32_t *len) {
    if (c->p >= c->end || *c->p != '"') return -1;
    const char *start = ++c->p;
    while (c->p < c->end && *c->p != '"') {
        unsigned char ch = (unsigned char)*c->p;
        if (ch < 0x20 || ch >= 0x80 || ch == '\\') return -1;
        c->p++;
    }
    if (c->p >= c->end) return -1;
    *s = start;
    *len = (uint32_t)(c->p - start);
    c->p++;
    return 0;
}

/* A JSON number: KJ_INT (with *v, or *big past int64) or KJ_FLOAT. */
static int num(struct cur *c, int64_t *v, int *big) {
    const char *p = c->p;
    int neg = 0, isfloat = 0;
    uint64_t acc = 0;
    *big = 0;
    if (p < c->end && *p == '-') { neg = 1; p++; }
    if (p >= c->end || *p < '0' || *p > '9') return -1;
    if (*p == '0' && p + 1 < c->end && p[1] >= '0' && p[1] <= '9') return -1; /* no leading zeros */
    while (p < c->end && *p >= '0' && *p <= '9') {
        unsigned d = (unsigned)(*p++ - '0');
        if (acc > (UINT64_MAX - d) / 10) *big = 1;
        else acc = acc * 10 + d;
    }
    if (p < c->end && *p == '.') {
        isfloat = 1;
        p++;
        if (p >= c->end || *p < '0' || *p > '9') return -1;
        while (p < c->end && *p >= '0' && *p <= '9') p++;
    }
    if (p < c->end && (*p == 'e' || *p == 'E')) {
        isfloat = 1;
        p++;
        if (p < c->end && (*p == '+' || *p == '-')) p++;
        if (p >= c->end || *p < '0' || *p > '9') return -1;
        while (p < c->end && *p >= '0' && *p <= '9') p++;
    }
    c->p = p;
    if (isfloat) return KJ_FLOAT;
    if (!*big && acc > (uint64_t)INT64_MAX + (uint64_t)neg) *big = 1;
    *v = *big ? 0 : neg ? (int64_t)(0 - acc) : (int64_t)acc;
    return KJ_INT;
}

static int value(struct cur *c, struct kj_field *f, int depth);

/* An object or array that is only skipped (its type is all that is kept). */
static int skip(struct cur *c, int depth) {
    if (depth > KJ_DEPTH) return -1;
    char close = *c->p == '{' ? '}' : ']';
    int obj = close == '}';
    c->p++;
    ws(c);
    if (c->p < c->end && *c->p == close) { c->p++; return 0; }
    for (;;) {
        struct kj_field f;
        ws(c);
        if (obj) {
            if (str(c, &f.key, &f.klen) < 0) return -1;
            ws(c);
            if (c->p >= c->end || *c->p != ':') return -1;
            c->p++;
            ws(c);
        }
        if (value(c, &f, depth + 1) < 0) return -1;
        ws(c);
        if (c->p < c->end && *c->p == ',') { c->p++; continue; }
        if (c->p < c->end && *c->p == close) { c->p++; return 0; }
        return -1;
    }
}

static int scalar_or_nested(struct cur *c, struct kj_field *f, int depth) {
    switch (*c->p) {
    case 't': f->type = KJ_BOOL; return lit(c, "true");
    case 'f': f->type = KJ_BOOL; return lit(c, "false");
    case 'n': f->type = KJ_NULL; return lit(c, "null");
    case '{': f->type = KJ_OBJ; return skip(c, depth);
    case '[': f->type = KJ_LIST; return skip(c, depth);
    default: {
        int t = num(c, &f->i, &f->big);
        if (t < 0) return -1;
        f->type = t;
        return 0;
    }
    }
}

static int value(struct cur *c, struct kj_field *f, int depth) {
    f->s = NULL;
    f->slen = 0;
    f->i = 0;
    f->big = 0;
    if (c->p >= c->end) return -1;
    if (*c->p == '"') {
        f->type = KJ_STR;
        return str(c, &f->s, &f->slen);
    }
    const char *start = c->p; /* any other value keeps its text (a nested one is read again) */
    if (scalar_or_nested(c, f, depth) < 0) return -1;
    f->s = start;
    f->slen = (uint32_t)(c->p - start);
    return 0;
}

/* One object's fields into `o`; `items` (top level only) into r->items. */
static int object(struct cur *c, struct kj_obj *o, struct kj_req *r) {
    o->is_obj = 1;
    o->n = 0;
    if (c->p >= c->end || *c->p != '{') return -1;
    c->p++;
    ws(c);
    if (c->p < c->end && *c->p == '}') { c->p++; return 0; }
    for (;;) {
        if (o->n >= KJ_MAXF) return -1;
        struct kj_field *f = &o->f[o->n];
        ws(c);
        if (str(c, &f->key, &f->klen) < 0) return -1;
        for (int k = 0; k < o->n; k++) /* framing refuses duplicate keys */
            if (o->f[k].klen == f->klen && memcmp(o->f[k].key, f->key, f->klen) == 0) return -1;
        ws(c);
        if (c->p >= c->end || *c->p != ':') return -1;
        c->p++;
        ws(c);
        if (r && f->klen == 5 && memcmp(f->key, "items", 5) == 0 && c->p < c->end && *c->p == '[') {
            f->type = KJ_LIST;
            f->s = NULL;
            f->slen = 0;
            f->big = 0;
            c->p++;
            r->nitems = 0;
            ws(c);
            if (c->p < c->end && *c->p == ']') c->p++;
            else for (;;) {
                if (r->nitems >= KJ_MAXITEMS) return -1;
                struct kj_obj *it = &r->items[r->nitems++];
                ws(c);
                if (c->p < c->end && *c->p == '{') {
                    if (object(c, it, NULL) < 0) return -1;
                } else {
                    struct kj_field skipped;
                    it->is_obj = 0;
                    it->n = 0;
                    if (value(c, &skipped, 1) < 0) return -1;
                }
                ws(c);
                if (c->p < c->end && *c->p == ',') { c->p++; continue; }
                if (c->p < c->end && *c->p == ']') { c->p++; break; }
                return -1;
            }
        } else if (value(c, f, 1) < 0) {
            return -1;
        }
        o->n++;
        ws(c);
        if (c->p < c->end && *c->p == ',') { c->p++; continue; }
        if (c->p < c->end && *c->p == '}') { c->p++; return 0; }
        return -1;
    }
}

int kj_parse(const char *p, size_t n, struct kj_req *out) {
    struct cur c = {p, p + n};
    out->nitems = -1;
    ws(&c);
    if (object(&c, &out->top, out) < 0) return -1;
    ws(&c);
    return c.p == c.end ? 0 : -1;
}

const struct kj_field *kj_get(const struct kj_obj *o, const char *key) {
    size_t n = strlen(key);
    for (int k = 0; k < o->n; k++)
        if (o->f[k].klen == n && memcmp(o->f[k].key, key, n) == 0) return &o->f[k];
    return NULL;
}

const char *kj_type_name(int type) {
    static const char *const names[] = {"?", "str", "int", "float", "bool", "NoneType", "dict", "list"};
    return type >= KJ_STR && type <= KJ_LIST ? names[type] : "?";
}

int kj_object(const char *p, size_t n, struct kj_obj *out) {
    struct cur c = {p, p + n};
    ws(&c);
    if (object(&c, out, NULL) < 0) return -1;
    ws(&c);
    return c.p == c.end ? 0 : -1;
}

int kj_u64s(const char *p, size_t n, uint64_t *out, uint32_t cap, uint32_t *count) {
    struct cur c = {p, p + n};
    *count = 0;
    ws(&c);
    if (c.p >= c.end || *c.p != '[') return -1;
    c.p++;
    ws(&c);
    if (c.p < c.end && *c.p == ']') return 0;
    int bad = 0;
    for (;;) {
        ws(&c);
        if (c.p >= c.end) return -1;
        const char *start = c.p;
        struct kj_field f;
        if (value(&c, &f, 1) < 0) return -1;
        uint64_t v = 0;
        if (f.type != KJ_INT) {
            bad = 1;
        } else if (*start == '-') { /* only -0 is an unsigned value (0) */
            for (const char *q = start + 1; q < c.p; q++) bad |= *q != '0';
        } else { /* the digits again: num() keeps no value past int64 */
            for (const char *q = start; q < c.p; q++) {
                unsigned d = (unsigned)(*q - '0');
                if (v > (UINT64_MAX - d) / 10) { bad = 1; break; }
                v = v * 10 + d;
            }
        }
        if (out && *count < cap) out[*count] = v;
        (*count)++;
        ws(&c);
        if (c.p < c.end && *c.p == ',') { c.p++; continue; }
        if (c.p < c.end && *c.p == ']') { c.p++; break; }
        return -1;
    }
    ws(&c);
    if (c.p != c.end) return -1;
    return bad ? 1 : 0;
}
