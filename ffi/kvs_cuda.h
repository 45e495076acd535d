/* What the CUDA backend's files share: the resolved driver, the error of the last failed
 * call on this thread, and the device and memory objects. Not public. See kvs.h. */
#ifndef KVS_CUDA_H
#define KVS_CUDA_H

#include "kvs_cuda_driver.h"
#include "kvs_slots.h"

/* The driver's calls, resolved by kvs_cuda_load (a NULL optional call is absent). */
struct kcu_driver {
#define KCU_MEMBER(name, version, required, params) kcu_pfn_##name name;
    KCU_CALLS(KCU_MEMBER)
#undef KCU_MEMBER
};

KVS_HIDDEN extern struct kcu_driver kcu;

/* KVS_E_NODRIVER until kvs_cuda_load succeeded. */
KVS_HIDDEN int kcu_ready(void);

/* Record a failed driver call for kvs_cuda_last_call/_result and return KVS_E_CUDA; or
 * KVS_OK for KCU_SUCCESS. */
KVS_HIDDEN int kcu_check(const char *call, kcu_result result);
#define KCU(name, ...) kcu_check(#name, kcu.name(__VA_ARGS__))

/* One opened device: its primary context, and the streams its ops run on. A lane is a
 * stream with the event recorded behind an op's copies; one op holds a lane at a time. */
struct kcu_lane {
    kcu_stream stream;
    kcu_event event;
};

struct kcu_dev {
    uint64_t id;
    kcu_device dev;
    kcu_context ctx;
    char uuid[16];
    uint32_t kind;          /* KVS_CUDA_* of the transport's allocations */
    uint64_t granularity;   /* recommended, for `kind` (POSIX fd props for legacy) */
    uint64_t max_pitch;
    uint64_t objects;       /* live allocations, reservations and buffers of this device */
    uint64_t inflight;      /* ops whose event has not been seen complete */
    struct kcu_lane *lanes; /* free lanes */
    uint32_t nlanes, cap, made;
    kcu_stream sync;        /* the stream of kvs_cuda_memcpy */
    uint64_t *buffers;      /* regions (KVS_BACKEND_CUDA_BUFFER) of live kvs_cuda_buffer_alloc memory */
    uint32_t nbuffers, buffers_cap;
};

/* Under kvs_g.mu: the region of the kvs_cuda_buffer_alloc buffer of `device` that holds
 * [base, base + size), or 0 when that memory is the caller's own (not kvstate's to pin). */
KVS_HIDDEN uint64_t kcu_buffer_region(uint64_t device, uint64_t base, uint64_t size);

/* Allocations (kvs_g.cu_allocs) and reservations (kvs_g.cu_resvs). */
struct kcu_alloc {
    uint64_t id;
    uint64_t device;
    uint64_t size;
    uint32_t type;          /* KVS_CUDA_* */
    int imported;
    kcu_mem_handle handle;  /* VMM */
    kcu_deviceptr ptr;      /* legacy: cuMemAlloc or cuIpcOpenMemHandle */
    int export_fd;          /* POSIX fd export, closed at release; -1 none */
    int exported_ipc;       /* ipc holds the bytes of this process's export */
    kcu_ipc_mem_handle ipc;
    uint64_t maps;
};

struct kcu_resv {
    uint64_t id;
    uint64_t device;
    kcu_deviceptr addr;     /* 0: a legacy device's placeholder */
    uint64_t size;
    uint64_t maps;
};

/* Under kvs_g.mu: the device named by id, or NULL. */
KVS_HIDDEN struct kcu_dev *kcu_dev_find(uint64_t id);
/* Make the device's context current on this thread. */
KVS_HIDDEN int kcu_enter(const struct kcu_dev *d);
/* Under kvs_g.mu: a lane of the device (made on first need), or KVS_E_CUDA. */
KVS_HIDDEN int kcu_lane_take(struct kcu_dev *d, struct kcu_lane *out);
KVS_HIDDEN void kcu_lane_give(struct kcu_dev *d, struct kcu_lane lane);
/* Wait, without kvs_g.mu, until the device finished the work before `event` (or, with a
 * NULL event, everything on `stream`). A failed wait is not taken for the end of the work
 * while the event still reports it running: it is waited for again. Returns the first
 * failure seen (the work's or a wait's), KCU_SUCCESS if none. */
KVS_HIDDEN kcu_result kcu_wait(kcu_context ctx, kcu_stream stream, kcu_event event);
/* Destroy the device's lanes (kvs_cuda_close); the first failure, after trying them all. */
KVS_HIDDEN int kcu_lanes_destroy(struct kcu_dev *d);

#endif /* KVS_CUDA_H */
