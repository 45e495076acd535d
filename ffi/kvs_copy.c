/* How the op engine's workers move bytes (kvs_copy.h): large blocks with streaming stores
 * on x86-64, memcpy elsewhere. */
#include <string.h>

#include "kvs_copy.h"

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#define KVS_NT_MIN (UINT64_C(16) << 10)

/* Blocks of KV cache are copied once and not read again by this thread, so large ones are
 * written with streaming (non-temporal) stores: no read-for-ownership of the destination
 * and no cache pollution. glibc's memcpy does the same only above a threshold of several
 * MiB, so a gather of 64 KiB blocks would otherwise pay for the extra destination reads. */
void kvs_copy_block(char *dst, const char *src, uint64_t len) {
    if (len < KVS_NT_MIN) {
        memcpy(dst, src, len);
        return;
    }
    uint64_t head = (uint64_t)(-(uintptr_t)dst & 15);
    memcpy(dst, src, head);
    dst += head, src += head, len -= head;
    uint64_t n = len / 64;
    for (uint64_t i = 0; i < n; i++, dst += 64, src += 64) {
        _mm_prefetch(src + 1024, _MM_HINT_NTA);
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, len % 64);
}

void kvs_copy_fence(void) { _mm_sfence(); }

/* The next block starts elsewhere (gathers jump around): start fetching its head early. */
void kvs_copy_prefetch(const char *src) {
    for (int i = 0; i < 1024; i += 64) _mm_prefetch(src + i, _MM_HINT_NTA);
}
#else
void kvs_copy_prefetch(const char *src) { (void)src; }
void kvs_copy_block(char *dst, const char *src, uint64_t len) { memcpy(dst, src, len); }
void kvs_copy_fence(void) {}
#endif
