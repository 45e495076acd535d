/* The CUDA driver shim's streams, events and copies, and cuGetProcAddress_v2, which hands
 * out every entry point by name (see cudashim_api.c). */
#define _GNU_SOURCE
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "cudashim.h"

#define BEGIN(name)                                                                            \
    const char *call_ = #name;                                                                 \
    pthread_mutex_lock(&S.mu);                                                                 \
    shim_count(call_);                                                                         \
    unsigned rc = shim_injected(call_);                                                        \
    if (rc == KCU_SUCCESS && !S.initialized) rc = KCU_ERROR_NOT_INITIALIZED;                   \
    if (rc == KCU_SUCCESS && !shim_has_context()) rc = KCU_ERROR_INVALID_CONTEXT;              \
    if (rc != KCU_SUCCESS) return finish(call_, rc)

#define END return finish(call_, rc)

static unsigned finish(const char *call, unsigned rc) {
    shim_log(call, rc, NULL);
    pthread_mutex_unlock(&S.mu);
    return rc;
}

/* -- streams -------------------------------------------------------------------------- */

SHIM_EXPORT kcu_result cuStreamCreate(kcu_stream *stream, unsigned int flags) {
    BEGIN(cuStreamCreate);
    struct shim_stream *s = NULL;
    if (!stream || flags > KCU_STREAM_NON_BLOCKING) rc = KCU_ERROR_INVALID_VALUE;
    else if (!(s = calloc(1, sizeof *s))) rc = KCU_ERROR_OUT_OF_MEMORY;
    if (rc == KCU_SUCCESS) {
        S.streams++;
        *stream = (kcu_stream)(void *)s;
    }
    END;
}

static int stream_busy(const void *s) { return ((const struct shim_stream *)s)->pending > 0; }

SHIM_EXPORT kcu_result cuStreamDestroy(kcu_stream stream) {
    BEGIN(cuStreamDestroy);
    struct shim_stream *s = (struct shim_stream *)(void *)stream;
    if (!s || s->destroyed) {
        rc = KCU_ERROR_INVALID_HANDLE;
    } else {
        s->destroyed = 1;
        shim_wait(stream_busy, s); /* queued work still completes, as on a GPU */
        free(s);
        S.streams--;
    }
    END;
}

SHIM_EXPORT kcu_result cuStreamSynchronize(kcu_stream stream) {
    BEGIN(cuStreamSynchronize);
    struct shim_stream *s = (struct shim_stream *)(void *)stream;
    if (!s || s->destroyed) {
        rc = KCU_ERROR_INVALID_HANDLE;
    } else {
        shim_wait(stream_busy, s);
        rc = s->error;
        s->error = KCU_SUCCESS;
    }
    END;
}

/* -- events --------------------------------------------------------------------------- */

SHIM_EXPORT kcu_result cuEventCreate(kcu_event *event, unsigned int flags) {
    BEGIN(cuEventCreate);
    struct shim_event *e = NULL;
    if (!event || flags & ~(KCU_EVENT_BLOCKING_SYNC | KCU_EVENT_DISABLE_TIMING)) rc = KCU_ERROR_INVALID_VALUE;
    else if (!(e = calloc(1, sizeof *e))) rc = KCU_ERROR_OUT_OF_MEMORY;
    if (rc == KCU_SUCCESS) {
        S.events++;
        *event = (kcu_event)(void *)e;
    }
    END;
}

static struct shim_work *work(enum shim_work_kind kind, struct shim_stream *s) {
    struct shim_work *w = calloc(1, sizeof *w);
    if (w) {
        w->kind = kind;
        w->stream = s;
        w->height = 1;
    }
    return w;
}

SHIM_EXPORT kcu_result cuEventRecord(kcu_event event, kcu_stream stream) {
    BEGIN(cuEventRecord);
    struct shim_event *e = (struct shim_event *)(void *)event;
    struct shim_stream *s = (struct shim_stream *)(void *)stream;
    struct shim_work *w = NULL;
    if (!e || e->destroyed || !s || s->destroyed) rc = KCU_ERROR_INVALID_HANDLE;
    else if (!(w = work(W_EVENT, s))) rc = KCU_ERROR_OUT_OF_MEMORY;
    if (rc == KCU_SUCCESS) {
        w->event = e;
        e->state = EV_PENDING;
        shim_start_device();
        shim_enqueue(w);
    }
    END;
}

SHIM_EXPORT kcu_result cuEventQuery(kcu_event event) {
    BEGIN(cuEventQuery);
    struct shim_event *e = (struct shim_event *)(void *)event;
    if (!e || e->destroyed) rc = KCU_ERROR_INVALID_HANDLE;
    else if (e->state == EV_PENDING) rc = KCU_ERROR_NOT_READY;
    else if (e->state == EV_DONE) rc = e->result;
    END;
}

static int event_pending(const void *e) { return ((const struct shim_event *)e)->state == EV_PENDING; }

SHIM_EXPORT kcu_result cuEventSynchronize(kcu_event event) {
    BEGIN(cuEventSynchronize);
    struct shim_event *e = (struct shim_event *)(void *)event;
    if (!e || e->destroyed) {
        rc = KCU_ERROR_INVALID_HANDLE;
    } else {
        shim_wait(event_pending, e);
        rc = e->state == EV_DONE ? e->result : KCU_SUCCESS;
    }
    END;
}

static int event_queued(const void *e) { return ((const struct shim_event *)e)->pending > 0; }

SHIM_EXPORT kcu_result cuEventDestroy(kcu_event event) {
    BEGIN(cuEventDestroy);
    struct shim_event *e = (struct shim_event *)(void *)event;
    if (!e || e->destroyed) {
        rc = KCU_ERROR_INVALID_HANDLE;
    } else {
        e->destroyed = 1;
        shim_wait(event_queued, e); /* a queued record still runs; the event goes after it */
        free(e);
        S.events--;
    }
    END;
}

/* -- copies --------------------------------------------------------------------------- */

/* Queue one (possibly 2D) copy. The driver checks the pointers when the copy is enqueued;
 * whether the memory is still there, with access, when it runs is the device's concern. */
static unsigned enqueue_copy(struct shim_stream *s, uint64_t dst, uint64_t src, uint64_t width, uint64_t height,
                             uint64_t dpitch, uint64_t spitch) {
    if (!s || s->destroyed) return KCU_ERROR_INVALID_HANDLE;
    if (width == 0 || height == 0) return KCU_SUCCESS;
    for (uint64_t i = 0; i < height; i++)
        if (!shim_reachable(src + i * spitch, width, 0) || !shim_reachable(dst + i * dpitch, width, 0))
            return KCU_ERROR_INVALID_VALUE;
    struct shim_work *w = work(W_COPY, s);
    if (!w) return KCU_ERROR_OUT_OF_MEMORY;
    w->dst = dst;
    w->src = src;
    w->width = width;
    w->height = height;
    w->dpitch = dpitch;
    w->spitch = spitch;
    shim_start_device();
    shim_enqueue(w);
    return KCU_SUCCESS;
}

SHIM_EXPORT kcu_result cuMemcpyAsync(kcu_deviceptr dst, kcu_deviceptr src, size_t size, kcu_stream stream) {
    BEGIN(cuMemcpyAsync);
    rc = enqueue_copy((struct shim_stream *)(void *)stream, dst, src, size, 1, 0, 0);
    END;
}

SHIM_EXPORT kcu_result cuMemcpy2DAsync(const kcu_memcpy2d *c, kcu_stream stream) {
    BEGIN(cuMemcpy2DAsync);
    if (!c || c->src_memory_type != KCU_MEMORYTYPE_DEVICE || c->dst_memory_type != KCU_MEMORYTYPE_DEVICE ||
        c->src_x_in_bytes || c->src_y || c->dst_x_in_bytes || c->dst_y || c->src_pitch < c->width_in_bytes ||
        c->dst_pitch < c->width_in_bytes || (int64_t)c->src_pitch > S.max_pitch || (int64_t)c->dst_pitch > S.max_pitch)
        rc = KCU_ERROR_INVALID_VALUE;
    else
        rc = enqueue_copy((struct shim_stream *)(void *)stream, c->dst_device, c->src_device, c->width_in_bytes,
                          c->height, c->dst_pitch, c->src_pitch);
    END;
}

SHIM_EXPORT kcu_result cuMemcpyBatchAsync(kcu_deviceptr *dsts, kcu_deviceptr *srcs, size_t *sizes, size_t count,
                                          kcu_memcpy_attributes *attrs, size_t *attr_idxs, size_t num_attrs,
                                          size_t *fail_idx, kcu_stream stream) {
    BEGIN(cuMemcpyBatchAsync);
    struct shim_stream *s = (struct shim_stream *)(void *)stream;
    if (!s || !dsts || !srcs || !sizes || !count || !attrs || !attr_idxs || !num_attrs || attr_idxs[0] != 0) {
        rc = KCU_ERROR_INVALID_VALUE; /* the legacy default stream (NULL) is refused too */
    } else {
        for (size_t i = 0; i < num_attrs && rc == KCU_SUCCESS; i++)
            if (attrs[i].src_access_order == 0 || attrs[i].src_access_order > 3) rc = KCU_ERROR_INVALID_VALUE;
        for (size_t i = 0; i < count && rc == KCU_SUCCESS; i++) {
            rc = enqueue_copy(s, dsts[i], srcs[i], sizes[i], 1, 0, 0);
            if (rc != KCU_SUCCESS && fail_idx) *fail_idx = i;
        }
    }
    END;
}

SHIM_EXPORT kcu_result cuMemcpyHtoD(kcu_deviceptr dst, const void *src, size_t size) {
    BEGIN(cuMemcpyHtoD);
    if (!src || !shim_reachable(dst, size, KCU_MEM_ACCESS_FLAGS_PROT_READWRITE)) rc = KCU_ERROR_INVALID_VALUE;
    else memcpy((void *)(uintptr_t)dst, src, size);
    END;
}

SHIM_EXPORT kcu_result cuMemcpyDtoH(void *dst, kcu_deviceptr src, size_t size) {
    BEGIN(cuMemcpyDtoH);
    if (!dst || !shim_reachable(src, size, KCU_MEM_ACCESS_FLAGS_PROT_READ)) rc = KCU_ERROR_INVALID_VALUE;
    else memcpy(dst, (const void *)(uintptr_t)src, size);
    END;
}

/* -- cuGetProcAddress ----------------------------------------------------------------- */

/* Each entry point, type-checked against the engine's declaration of it. */
#define SHIM_DECLARE(name, version, required, params) SHIM_EXPORT kcu_result name params;
KCU_CALLS(SHIM_DECLARE)
#undef SHIM_DECLARE

static const struct {
#define SHIM_MEMBER(name, version, required, params) kcu_pfn_##name name;
    KCU_CALLS(SHIM_MEMBER)
#undef SHIM_MEMBER
} table = {
#define SHIM_INIT(name, version, required, params) .name = name,
    KCU_CALLS(SHIM_INIT)
#undef SHIM_INIT
};

static const struct {
    const char *name;
    int version;
    size_t offset;
} entries[] = {
#define SHIM_ENTRY(name, version, required, params) {#name, version, offsetof(__typeof__(table), name)},
    KCU_CALLS(SHIM_ENTRY)
#undef SHIM_ENTRY
};

/* Hidden calls (KVSTATE_CUDASHIM_HIDE="a,b"): a driver that lacks them. */
static int hidden(const char *symbol) {
    const char *v = getenv("KVSTATE_CUDASHIM_HIDE");
    size_t n = strlen(symbol);
    for (const char *p = v; p && *p;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == n && strncmp(p, symbol, n) == 0) return 1;
        p = end ? end + 1 : NULL;
    }
    return 0;
}

SHIM_EXPORT kcu_result cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version, uint64_t flags,
                                           kcu_proc_status *status) {
    pthread_mutex_lock(&S.mu);
    shim_configure(); /* the engine looks calls up before cuInit */
    shim_count("cuGetProcAddress");
    unsigned rc = shim_injected("cuGetProcAddress");
    kcu_proc_status st = KCU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    int driver_version = S.version;
    *pfn = NULL;
    if (rc == KCU_SUCCESS && (!symbol || flags > 2)) rc = KCU_ERROR_INVALID_VALUE;
    for (size_t i = 0; rc == KCU_SUCCESS && i < sizeof entries / sizeof entries[0]; i++) {
        if (strcmp(entries[i].name, symbol) != 0 || hidden(symbol)) continue;
        if (cuda_version < entries[i].version || driver_version < entries[i].version) {
            st = KCU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        } else {
            memcpy(pfn, (const char *)&table + entries[i].offset, sizeof *pfn);
            st = KCU_GET_PROC_ADDRESS_SUCCESS;
        }
        break;
    }
    if (rc == KCU_SUCCESS && st != KCU_GET_PROC_ADDRESS_SUCCESS) rc = KCU_ERROR_NOT_FOUND;
    if (status) *status = st;
    shim_log("cuGetProcAddress", rc, "%s", symbol ? symbol : "(null)");
    pthread_mutex_unlock(&S.mu);
    return rc;
}
