/* BLAKE2b (RFC 7693), keyed and personalised, for the TCP handshake the lease thread
 * answers without the GIL (kvs_lease_tcp.c). Python's side of the same MAC is
 * hashlib.blake2b(key=..., person=...); tests/native/test_blake2b.py holds the two equal.
 *
 * Written from the RFC's description: the state is eight 64-bit words started from the
 * SHA-512 IV xored with the parameter block (digest length, key length, fanout 1, depth 1;
 * the personalisation in words 6 and 7), a key is padded to one whole first block, and
 * each 128-byte block is mixed in twelve rounds of G over the message schedule SIGMA.
 */
#include <stdint.h>
#include <string.h>

#include "kvs.h"

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ull, 0xbb67ae8584caa73bull, 0x3c6ef372fe94f82bull, 0xa54ff53a5f1d36f1ull,
    0x510e527fade682d1ull, 0x9b05688c2b3e6c1full, 0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static uint64_t load64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i]; /* little endian whatever the host */
    return v;
}

struct b2 {
    uint64_t h[8];
    uint64_t t; /* bytes compressed so far (messages here are far below 2^64) */
    uint8_t buf[128];
    size_t n;
};

#define G(a, b, c, d, x, y)              \
    do {                                 \
        v[a] = v[a] + v[b] + (x);        \
        v[d] = rotr(v[d] ^ v[a], 32);    \
        v[c] = v[c] + v[d];              \
        v[b] = rotr(v[b] ^ v[c], 24);    \
        v[a] = v[a] + v[b] + (y);        \
        v[d] = rotr(v[d] ^ v[a], 16);    \
        v[c] = v[c] + v[d];              \
        v[b] = rotr(v[b] ^ v[c], 63);    \
    } while (0)

static void compress(struct b2 *s, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64(s->buf + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= s->t;
    if (last) v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *z = SIGMA[r];
        G(0, 4, 8, 12, m[z[0]], m[z[1]]);
        G(1, 5, 9, 13, m[z[2]], m[z[3]]);
        G(2, 6, 10, 14, m[z[4]], m[z[5]]);
        G(3, 7, 11, 15, m[z[6]], m[z[7]]);
        G(0, 5, 10, 15, m[z[8]], m[z[9]]);
        G(1, 6, 11, 12, m[z[10]], m[z[11]]);
        G(2, 7, 8, 13, m[z[12]], m[z[13]]);
        G(3, 4, 9, 14, m[z[14]], m[z[15]]);
    }
    for (int i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}

/* Feed bytes; a full buffer is compressed only once more bytes follow (the last block is
 * compressed by the final step, flagged as last). */
static void update(struct b2 *s, const uint8_t *p, size_t len) {
    while (len) {
        if (s->n == 128) {
            s->t += 128;
            compress(s, 0);
            s->n = 0;
        }
        size_t take = 128 - s->n < len ? 128 - s->n : len;
        memcpy(s->buf + s->n, p, take);
        s->n += take;
        p += take;
        len -= take;
    }
}

int kvs_blake2b(uint8_t *out, uint32_t outlen, const uint8_t *key, uint32_t keylen, const uint8_t *person,
                uint32_t personlen, const uint8_t *data, uint32_t datalen) {
    if (!out || outlen < 1 || outlen > 64 || keylen > 64 || (keylen && !key) || personlen > 16 ||
        (personlen && !person) || (datalen && !data))
        return KVS_E_INVAL;
    struct b2 s;
    memset(&s, 0, sizeof s);
    uint8_t param[64] = {0};
    param[0] = (uint8_t)outlen;
    param[1] = (uint8_t)keylen;
    param[2] = 1; /* fanout */
    param[3] = 1; /* depth */
    if (personlen) memcpy(param + 48, person, personlen); /* shorter: zero padded, as hashlib */
    for (int i = 0; i < 8; i++) s.h[i] = IV[i] ^ load64(param + 8 * i);
    if (keylen) {
        uint8_t block[128] = {0};
        memcpy(block, key, keylen);
        update(&s, block, 128);
        memset(block, 0, sizeof block);
    }
    update(&s, data, datalen);
    s.t += s.n;
    memset(s.buf + s.n, 0, 128 - s.n);
    compress(&s, 1);
    for (uint32_t i = 0; i < outlen; i++) out[i] = (uint8_t)(s.h[i / 8] >> (8 * (i % 8)));
    memset(&s, 0, sizeof s);
    return KVS_OK;
}
