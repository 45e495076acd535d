/* The CUDA driver shim's machinery: configuration, the journal of calls, failure
 * injection, the record of violations, device memory ranges and the "device": one thread
 * that runs the copies and event records queued on streams, in order. See cudashim_api.c
 * for what the shim is and how tests drive it (the cudashim_* control functions are here). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cudashim.h"

struct shim_state S = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .work_cv = PTHREAD_COND_INITIALIZER,
    .done_cv = PTHREAD_COND_INITIALIZER,
};

/* -- configuration -------------------------------------------------------------------- */

static long env_long(const char *name, long fallback) {
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char *end;
    long n = strtol(v, &end, 0);
    return *end ? fallback : n;
}

/* -- failure injection ---------------------------------------------------------------- */

#define MAX_RULES 64
#define MAX_COUNTS 128

static struct {
    char call[48];
    long countdown;   /* fail when it reaches 1 */
    unsigned result;
} rules[MAX_RULES];
static int nrules;

static struct {
    char call[48];
    long n;
} counts[MAX_COUNTS];
static int ncounts;

static unsigned default_result(const char *call) {
    if (strcmp(call, "async") == 0) return KCU_ERROR_ILLEGAL_ADDRESS;
    if (strcmp(call, "cuInit") == 0) return KCU_ERROR_NO_DEVICE;
    return KCU_ERROR_OUT_OF_MEMORY;
}

static int add_rule(const char *call, long nth, unsigned result) {
    if (nrules == MAX_RULES || nth < 1 || strlen(call) >= sizeof rules[0].call) return -1;
    snprintf(rules[nrules].call, sizeof rules[nrules].call, "%s", call);
    rules[nrules].countdown = nth;
    rules[nrules].result = result ? result : default_result(call);
    nrules++;
    return 0;
}

/* KVSTATE_CUDASHIM_FAIL="call[:nth[:result]],..." */
static void rules_from_env(void) {
    const char *v = getenv("KVSTATE_CUDASHIM_FAIL");
    if (!v) return;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", v);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *nth = strchr(tok, ':'), *res = NULL;
        if (nth) {
            *nth++ = '\0';
            res = strchr(nth, ':');
            if (res) *res++ = '\0';
        }
        add_rule(tok, nth ? strtol(nth, NULL, 0) : 1, res ? (unsigned)strtoul(res, NULL, 0) : 0);
    }
}

void shim_count(const char *call) {
    for (int i = 0; i < ncounts; i++)
        if (strcmp(counts[i].call, call) == 0) {
            counts[i].n++;
            return;
        }
    if (ncounts < MAX_COUNTS) {
        snprintf(counts[ncounts].call, sizeof counts[ncounts].call, "%s", call);
        counts[ncounts++].n = 1;
    }
}

unsigned shim_injected(const char *call) {
    for (int i = 0; i < nrules; i++) {
        if (strcmp(rules[i].call, call) != 0) continue;
        if (--rules[i].countdown > 0) return KCU_SUCCESS;
        unsigned r = rules[i].result;
        rules[i] = rules[--nrules];
        return r;
    }
    return KCU_SUCCESS;
}

void shim_configure(void) {
    if (S.configured) return;
    S.configured = 1;
    S.devices = (int)env_long("KVSTATE_CUDASHIM_DEVICES", 1);
    if (S.devices < 0 || S.devices > SHIM_MAX_DEVICES) S.devices = 1;
    S.version = (int)env_long("KVSTATE_CUDASHIM_VERSION", 12080);
    S.fabric = (int)env_long("KVSTATE_CUDASHIM_FABRIC", 0);
    S.vmm = (int)env_long("KVSTATE_CUDASHIM_VMM", 1);
    S.granularity = (uint64_t)env_long("KVSTATE_CUDASHIM_GRANULARITY", 2L << 20);
    S.min_granularity = (uint64_t)env_long("KVSTATE_CUDASHIM_MIN_GRANULARITY", (long)S.granularity);
    S.max_pitch = env_long("KVSTATE_CUDASHIM_MAX_PITCH", 2147483647L);
    S.delay_us = env_long("KVSTATE_CUDASHIM_DELAY_US", 0);
    for (int i = 0; i < SHIM_MAX_DEVICES; i++) S.ctx[i].device = i;
    rules_from_env();
}

/* -- the journal ---------------------------------------------------------------------- */

#define JOURNAL_LINES 8192
#define LINE 112

static char journal[JOURNAL_LINES][LINE];
static long journal_next;
static long nviolations;
static char violations[64][LINE * 2];

static void append_file(const char *line) {
    const char *path = getenv("KVSTATE_CUDASHIM_JOURNAL");
    if (!path || !*path) return;
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (fd < 0) return;
    char buf[LINE * 2 + 32];
    int n = snprintf(buf, sizeof buf, "%d %s\n", (int)getpid(), line);
    ssize_t w = write(fd, buf, (size_t)n); /* one write: lines of several processes never interleave */
    (void)w;
    close(fd);
}

void shim_log(const char *call, unsigned rc, const char *fmt, ...) {
    char *line = journal[journal_next++ % JOURNAL_LINES];
    int n = snprintf(line, LINE, "%s -> %u", call, rc);
    if (fmt && n < LINE) {
        va_list ap;
        va_start(ap, fmt);
        line[n++] = ' ';
        vsnprintf(line + n, (size_t)(LINE - n), fmt, ap);
        va_end(ap);
    }
    append_file(line);
}

void shim_violation(const char *fmt, ...) {
    char *v = violations[nviolations % 64];
    int n = snprintf(v, LINE * 2, "VIOLATION ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(v + n, (size_t)(LINE * 2 - n), fmt, ap);
    va_end(ap);
    nviolations++;
    append_file(v);
}

/* -- device memory -------------------------------------------------------------------- */

struct shim_range *shim_range_at(uint64_t addr, uint64_t size, int exact) {
    for (struct shim_range *r = S.ranges; r; r = r->next) {
        if (exact ? (r->addr == addr && (size == 0 || r->size == size))
                  : (addr >= r->addr && size <= r->size && addr - r->addr <= r->size - size))
            return r;
    }
    return NULL;
}

int shim_reachable(uint64_t addr, uint64_t size, unsigned need) {
    struct shim_range *r = shim_range_at(addr, size, 0);
    return r && (r->access & need) == need;
}

static int touches(const struct shim_work *w, uint64_t lo, uint64_t hi) {
    for (uint64_t i = 0; i < w->height; i++) {
        uint64_t s = w->src + i * w->spitch, d = w->dst + i * w->dpitch;
        if ((s < hi && lo < s + w->width) || (d < hi && lo < d + w->width)) return 1;
    }
    return 0;
}

int shim_pending_touching(uint64_t lo, uint64_t hi) {
    int n = 0;
    for (struct shim_work *w = S.head; w; w = w->next) n += w->kind == W_COPY && touches(w, lo, hi);
    return n;
}

/* -- the device thread ---------------------------------------------------------------- */

static void run_copy(struct shim_work *w) {
    unsigned fault = shim_injected("async");
    if (fault) {
        shim_log("device", fault, "injected fault in copy of %llu bytes", (unsigned long long)(w->width * w->height));
        w->stream->error = fault;
        return;
    }
    for (uint64_t i = 0; i < w->height; i++) {
        uint64_t s = w->src + i * w->spitch, d = w->dst + i * w->dpitch;
        if (!shim_reachable(s, w->width, 1) || !shim_reachable(d, w->width, 3)) {
            /* memory unmapped, freed or without access by the time the copy ran */
            shim_violation("copy of %llu bytes from 0x%llx to 0x%llx touches memory that is not device memory "
                           "with access when it runs", (unsigned long long)w->width, (unsigned long long)s,
                           (unsigned long long)d);
            w->stream->error = KCU_ERROR_ILLEGAL_ADDRESS;
            return;
        }
        memmove((void *)(uintptr_t)d, (const void *)(uintptr_t)s, w->width);
    }
}

static void *device_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&S.mu);
    for (;;) {
        while (S.stalled || !S.head) pthread_cond_wait(&S.work_cv, &S.mu);
        struct shim_work *w = S.head; /* stays queued (pending) while it runs */
        if (w->kind == W_COPY) {
            if (S.delay_us > 0) {
                pthread_mutex_unlock(&S.mu);
                struct timespec ts = {S.delay_us / 1000000, (S.delay_us % 1000000) * 1000};
                nanosleep(&ts, NULL);
                pthread_mutex_lock(&S.mu);
            }
            run_copy(w);
        } else {
            w->event->state = EV_DONE;
            w->event->result = w->stream->error;
            w->stream->error = KCU_SUCCESS;
            w->event->pending--;
        }
        S.head = w->next;
        if (!S.head) S.tail = NULL;
        w->stream->pending--;
        free(w);
        pthread_cond_broadcast(&S.done_cv);
    }
    return NULL;
}

void shim_start_device(void) {
    if (S.thread_started) return;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, device_main, NULL) == 0) S.thread_started = 1;
    pthread_attr_destroy(&attr);
}

void shim_enqueue(struct shim_work *w) {
    w->next = NULL;
    w->stream->pending++;
    if (w->event) w->event->pending++;
    if (S.tail) S.tail->next = w;
    else S.head = w;
    S.tail = w;
    pthread_cond_signal(&S.work_cv);
}

void shim_wait(int (*pred)(const void *), const void *arg) {
    while (pred(arg)) pthread_cond_wait(&S.done_cv, &S.mu);
}

/* -- controls for tests (exported) ---------------------------------------------------- */

/* Make the nth next call of `call` (or, for "async", the nth next copy the device runs)
 * fail with `result` (0: a default for that call). */
SHIM_EXPORT int cudashim_fail(const char *call, int nth, int result) {
    pthread_mutex_lock(&S.mu);
    int rc = add_rule(call, nth, (unsigned)result);
    pthread_mutex_unlock(&S.mu);
    return rc;
}

/* Forget failure rules, the journal, violations and call counts (objects stay). */
SHIM_EXPORT void cudashim_reset(void) {
    pthread_mutex_lock(&S.mu);
    nrules = 0;
    ncounts = 0;
    journal_next = 0;
    nviolations = 0;
    S.stalled = 0;
    pthread_cond_broadcast(&S.work_cv);
    pthread_mutex_unlock(&S.mu);
}

/* How often `call` was made since the last reset. */
SHIM_EXPORT long cudashim_calls(const char *call) {
    pthread_mutex_lock(&S.mu);
    long n = 0;
    for (int i = 0; i < ncounts; i++)
        if (strcmp(counts[i].call, call) == 0) n = counts[i].n;
    pthread_mutex_unlock(&S.mu);
    return n;
}

/* The journal since the last reset, oldest first, one call a line; returns its length. */
SHIM_EXPORT long cudashim_journal(char *buf, long len) {
    pthread_mutex_lock(&S.mu);
    long first = journal_next > JOURNAL_LINES ? journal_next - JOURNAL_LINES : 0, used = 0;
    for (long i = first; i < journal_next; i++) {
        const char *line = journal[i % JOURNAL_LINES];
        long n = (long)strlen(line);
        if (buf && used + n + 1 < len) {
            memcpy(buf + used, line, (size_t)n);
            buf[used + n] = '\n';
        }
        used += n + 1;
    }
    if (buf && len > 0) buf[used < len ? used : len - 1] = '\0';
    pthread_mutex_unlock(&S.mu);
    return used;
}

/* The number of violations since the last reset; their text (the last 64) into buf. */
SHIM_EXPORT long cudashim_violations(char *buf, long len) {
    pthread_mutex_lock(&S.mu);
    long used = 0, first = nviolations > 64 ? nviolations - 64 : 0;
    if (buf && len > 0) buf[0] = '\0';
    for (long i = first; buf && i < nviolations; i++) {
        int n = snprintf(buf + used, used < len ? (size_t)(len - used) : 0, "%s\n", violations[i % 64]);
        used += n;
    }
    long count = nviolations;
    pthread_mutex_unlock(&S.mu);
    return count;
}

/* Stop (1) or resume (0) the device: queued work waits, as on a busy GPU. */
SHIM_EXPORT void cudashim_stall(int on) {
    pthread_mutex_lock(&S.mu);
    S.stalled = on != 0;
    pthread_cond_broadcast(&S.work_cv);
    pthread_mutex_unlock(&S.mu);
}

/* Live objects: [0] primary context holds, [1] VMM allocations, [2] reservations, [3] VMM
 * mappings, [4] cuMemAlloc allocations, [5] IPC opens, [6] streams, [7] events, [8] queued
 * work items. Returns how many it wrote. */
SHIM_EXPORT int cudashim_live(long *out, int n) {
    long v[9] = {0};
    pthread_mutex_lock(&S.mu);
    for (int i = 0; i < SHIM_MAX_DEVICES; i++) v[0] += S.ctx[i].refs;
    v[1] = S.vmm_allocs;
    v[2] = S.reservations;
    for (struct shim_range *r = S.ranges; r; r = r->next) v[r->kind == SHIM_VMM_MAP ? 3 : r->kind == SHIM_LEGACY ? 4 : 5]++;
    v[6] = S.streams;
    v[7] = S.events;
    for (struct shim_work *w = S.head; w; w = w->next) v[8]++;
    pthread_mutex_unlock(&S.mu);
    int k = n < 9 ? n : 9;
    for (int i = 0; i < k; i++) out[i] = v[i];
    return k;
}
