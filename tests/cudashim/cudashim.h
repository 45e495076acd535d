/* The CUDA driver shim's internals, shared by its two files. See cudashim_api.c. */
#ifndef CUDASHIM_H
#define CUDASHIM_H

#include <pthread.h>
#include <stdint.h>

#include "kvs_cuda_driver.h"

#define SHIM_EXPORT __attribute__((visibility("default")))
#define SHIM_MAX_DEVICES 8
#define SHIM_IPC_OPENERS 32
#define SHIM_HEADER 4096 /* legacy allocations: a header page before the memory */

/* A context; one primary context per device. */
struct shim_ctx {
    int device;
    int refs;
};

/* Device memory the copies may touch: a VMM mapping, a cuMemAlloc allocation or an IPC
 * open. access: 0 none, 1 read, 3 read-write (the CUmemAccess_flags values). */
enum shim_kind { SHIM_VMM_MAP, SHIM_LEGACY, SHIM_IPC_OPEN };

struct shim_range {
    enum shim_kind kind;
    uint64_t addr, size;
    unsigned access;
    int fd;                    /* legacy and IPC: the memfd (header page + memory) */
    uint64_t handle;           /* VMM: the allocation's handle */
    void *header;              /* legacy and IPC: the mapped header page */
    int slot;                  /* IPC open: this process's opener slot */
    struct shim_range *next;
};

/* The header page of a legacy allocation, shared by every process that opened it. */
struct shim_ipc_header {
    char magic[8];
    int32_t owner;
    int32_t openers[SHIM_IPC_OPENERS]; /* pids of processes that have it open (0: free) */
};

struct shim_stream {
    unsigned error;            /* a fault on the stream, reported by its next event */
    int pending;               /* work items queued on it */
    int destroyed;
};

enum shim_event_state { EV_IDLE, EV_PENDING, EV_DONE };

struct shim_event {
    enum shim_event_state state;
    unsigned result;
    int pending;
    int destroyed;
};

enum shim_work_kind { W_COPY, W_EVENT };

struct shim_work {
    enum shim_work_kind kind;
    struct shim_stream *stream;
    struct shim_event *event;
    uint64_t dst, src, width, height, dpitch, spitch;
    struct shim_work *next;
};

struct shim_state {
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    int initialized, configured;
    int devices, version, fabric, vmm;
    uint64_t granularity, min_granularity;
    int64_t max_pitch;
    long delay_us;
    struct shim_ctx ctx[SHIM_MAX_DEVICES];
    struct shim_range *ranges;
    struct shim_work *head, *tail;
    int stalled, thread_started;
    long streams, events, vmm_allocs, reservations;
};

extern struct shim_state S;

/* Journal, failure injection and violations (cudashim_core.c). */
void shim_log(const char *call, unsigned rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* The injected result for this call of `call`, or KCU_SUCCESS. Under S.mu. */
unsigned shim_injected(const char *call);
void shim_violation(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void shim_configure(void);   /* read the environment, once */
int shim_has_context(void);  /* a retained context is current on this thread */
void shim_count(const char *call);

/* Device memory and work (cudashim_core.c), under S.mu. */
struct shim_range *shim_range_at(uint64_t addr, uint64_t size, int exact);
/* The device memory [addr, addr+size) is inside one range with `need` access (0: any). */
int shim_reachable(uint64_t addr, uint64_t size, unsigned need);
/* Copies queued or running that touch [lo, hi). */
int shim_pending_touching(uint64_t lo, uint64_t hi);
void shim_enqueue(struct shim_work *w);
void shim_start_device(void);
/* Wait until pred(arg) is false, releasing S.mu meanwhile. */
void shim_wait(int (*pred)(const void *), const void *arg);

#endif /* CUDASHIM_H */
