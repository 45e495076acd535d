/* Host backend with CUDA-VMM semantics: sealed memfds, PROT_NONE reservations,
 * MAP_FIXED mappings with no access until mprotect, and the pin table that makes unmap
 * and release refuse under in-flight ops. See kvs.h for the theory of operation. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvs_slots.h"

/* A memfd is exported only after these seals, and imported only if it carries them: the
 * size can never change under a mapping, and nobody can lift the seals. */
#define KVS_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

/* The planted-bug self-test builds a separate, test-only module with this macro defined
 * (tests/native/planted.py); it makes unmap and release ignore pins, and the stateful
 * test must catch it. The installed kvstate._native is never built with it. */
#ifdef KVS_PLANT_RELEASE_IGNORES_PINS
#define KVS_CHECK_PINS 0
#else
#define KVS_CHECK_PINS 1
#endif

/* -- helpers -------------------------------------------------------------------------- */

static uint64_t page_size(void) {
    static uint64_t ps;
    if (!ps) ps = (uint64_t)sysconf(_SC_PAGESIZE);
    return ps;
}

uint64_t kvs_page_size(void) { return page_size(); }

static int aligned(uint64_t v, uint64_t to) { return to && v % to == 0; }

static int sys_err(void) { return KVS_E_SYS; }

/* Re-cover [addr, addr+size) with inaccessible anonymous memory, so the address space
 * stays reserved after an unmap, exactly as cuMemUnmap leaves the VA reserved. */
static int rereserve(uint64_t addr, uint64_t size) {
    void *p = mmap((void *)(uintptr_t)addr, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    return p == MAP_FAILED ? sys_err() : KVS_OK;
}

/* -- allocations ---------------------------------------------------------------------- */

/* The memory side's own items in kvs_g.allocs and kvs_g.resvs; regions are shared
 * (kvs_slots.h) because ops pin them. */
struct kvs_alloc {
    uint64_t id;
    int fd;
    uint64_t size;
    uint64_t maps;
};

struct kvs_resv {
    uint64_t id;
    uint64_t addr;
    uint64_t size;
    uint64_t maps;
};

static int add_alloc(int fd, uint64_t size, uint64_t *allocation) {
    struct kvs_alloc *a = calloc(1, sizeof *a);
    if (!a) return KVS_E_NOMEM;
    a->fd = fd;
    a->size = size;
    int rc = kvs_slots_put(&kvs_g.allocs, a, allocation);
    if (rc) free(a);
    return rc;
}

int kvs_create(uint64_t size, uint64_t *allocation) {
    if (size == 0 || !aligned(size, page_size()) || size > (uint64_t)INT64_MAX) return KVS_E_INVAL;
    int fd = memfd_create("kvstate", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return sys_err();
    int t;
    do t = ftruncate(fd, (off_t)size); /* restartable: a signal's EINTR is no failure */
    while (t != 0 && errno == EINTR);
    if (t != 0 || fcntl(fd, F_ADD_SEALS, KVS_SEALS) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return sys_err();
    }
    pthread_mutex_lock(&kvs_g.mu);
    int rc = add_alloc(fd, size, allocation);
    pthread_mutex_unlock(&kvs_g.mu);
    if (rc) close(fd);
    return rc;
}

int kvs_export_fd(uint64_t allocation, int32_t *fd) {
    pthread_mutex_lock(&kvs_g.mu);
    struct kvs_alloc *a = kvs_slots_get(&kvs_g.allocs, allocation);
    if (a) *fd = a->fd;
    pthread_mutex_unlock(&kvs_g.mu);
    return a ? KVS_OK : KVS_E_NOENT;
}

/* The device every memfd of this kernel lives on: its one internal shmem mount, learned
 * once from a memfd of our own (0: none could be made; /proc/self/fd is read instead). */
static dev_t memfd_dev;
static pthread_once_t memfd_dev_once = PTHREAD_ONCE_INIT;

static void learn_memfd_dev(void) {
    int fd = memfd_create("kvstate-probe", MFD_CLOEXEC);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0) memfd_dev = st.st_dev;
    if (fd >= 0) close(fd);
}

/* The fd (whose fstat is `st`) names a memfd. Its device is the memfds' mount: one
 * fstat, where reading the /proc/self/fd/N link ("/memfd:NAME (deleted)") took about 5 µs
 * per part of every import. Other files of that mount (SysV segments, shared anonymous
 * memory) carry F_SEAL_SEAL from birth, so the seal check that follows refuses them. */
static int is_memfd(int fd, const struct stat *st) {
    pthread_once(&memfd_dev_once, learn_memfd_dev);
    if (memfd_dev) return st->st_dev == memfd_dev;
    char path[64], target[PATH_MAX];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n < 0) return -1;
    target[n] = '\0';
    return strncmp(target, "/memfd:", 7) == 0;
}

/* Check before mapping anything: a memfd, a regular file of exactly `size` bytes, sealed
 * against resizing and against lifting the seals. */
int kvs_import_fd(int32_t fd, uint64_t size, uint64_t *allocation) {
    if (fd < 0 || size == 0 || !aligned(size, page_size())) return KVS_E_INVAL;
    struct stat st;
    if (fstat(fd, &st) != 0) return sys_err();
    int memfd = is_memfd(fd, &st);
    if (memfd < 0) return sys_err();
    if (!memfd || !S_ISREG(st.st_mode)) return KVS_E_NOTMEMFD;
    if ((uint64_t)st.st_size != size) return KVS_E_SIZE;
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || (seals & KVS_SEALS) != KVS_SEALS) return KVS_E_SEALS;
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) return sys_err();
    pthread_mutex_lock(&kvs_g.mu);
    int rc = add_alloc(own, size, allocation);
    pthread_mutex_unlock(&kvs_g.mu);
    if (rc) close(own);
    return rc;
}

static int alloc_pinned(uint64_t allocation) {
    for (uint32_t s = 0; s < kvs_g.regions.used; s++) {
        struct kvs_region *r = kvs_slots_at(&kvs_g.regions, s);
        if (r && r->alloc == allocation && r->pins) return 1;
    }
    return 0;
}

int kvs_release(uint64_t allocation) {
    pthread_mutex_lock(&kvs_g.mu);
    int rc = KVS_OK;
    struct kvs_alloc *a = kvs_slots_get(&kvs_g.allocs, allocation);
    if (!a) {
        rc = KVS_E_NOENT;
    } else if (KVS_CHECK_PINS && alloc_pinned(allocation)) {
        rc = KVS_E_PINNED;
    } else if (a->maps) {
        rc = KVS_E_MAPPED;
    } else {
        kvs_slots_del(&kvs_g.allocs, allocation);
        close(a->fd);
        free(a);
    }
    pthread_mutex_unlock(&kvs_g.mu);
    return rc;
}

/* -- reservations --------------------------------------------------------------------- */

int kvs_reserve(uint64_t size, uint64_t align, uint64_t *reservation, uint64_t *addr) {
    uint64_t ps = page_size();
    if (size == 0 || !aligned(size, ps) || align < ps || !aligned(align, ps) || (align & (align - 1)) ||
        size > (uint64_t)INT64_MAX / 2 || align > (uint64_t)INT64_MAX / 2)
        return KVS_E_INVAL;
    /* Over-reserve by align and trim both ends so the start is aligned. */
    uint64_t span = size + align - ps;
    void *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return sys_err();
    uint64_t base = (uint64_t)(uintptr_t)p;
    uint64_t start = (base + align - 1) & ~(align - 1);
    if (start > base) munmap(p, start - base);
    if (base + span > start + size) munmap((void *)(uintptr_t)(start + size), base + span - start - size);

    struct kvs_resv *r = calloc(1, sizeof *r);
    if (!r) {
        munmap((void *)(uintptr_t)start, size);
        return KVS_E_NOMEM;
    }
    r->addr = start;
    r->size = size;
    pthread_mutex_lock(&kvs_g.mu);
    int rc = kvs_slots_put(&kvs_g.resvs, r, reservation);
    pthread_mutex_unlock(&kvs_g.mu);
    if (rc) {
        munmap((void *)(uintptr_t)start, size);
        free(r);
        return rc;
    }
    *addr = start;
    return KVS_OK;
}

int kvs_free_reservation(uint64_t reservation) {
    pthread_mutex_lock(&kvs_g.mu);
    int rc = KVS_OK;
    struct kvs_resv *r = kvs_slots_get(&kvs_g.resvs, reservation);
    if (!r) {
        rc = KVS_E_NOENT;
    } else if (r->maps) {
        rc = KVS_E_MAPPED;
    } else if (munmap((void *)(uintptr_t)r->addr, r->size) != 0) {
        rc = sys_err();
    } else {
        kvs_slots_del(&kvs_g.resvs, reservation);
        free(r);
    }
    pthread_mutex_unlock(&kvs_g.mu);
    return rc;
}

/* -- regions (mappings) --------------------------------------------------------------- */

/* A region this backend mapped: a CUDA region's address is device memory, never mprotected
 * or re-reserved here. */
static struct kvs_region *host_region(uint64_t id) {
    struct kvs_region *g = kvs_region_find(id);
    return g && g->backend == KVS_BACKEND_HOST ? g : NULL;
}

int kvs_map(uint64_t reservation, uint64_t offset, uint64_t allocation, uint64_t *region,
            uint64_t *addr) {
    pthread_mutex_lock(&kvs_g.mu);
    int rc = KVS_OK;
    struct kvs_resv *rv = kvs_slots_get(&kvs_g.resvs, reservation);
    struct kvs_alloc *a = kvs_slots_get(&kvs_g.allocs, allocation);
    struct kvs_region *g = NULL;
    if (!rv || !a) {
        rc = KVS_E_NOENT;
        goto out;
    }
    if (!aligned(offset, page_size())) {
        rc = KVS_E_INVAL;
        goto out;
    }
    if (offset > rv->size || a->size > rv->size - offset) {
        rc = KVS_E_RANGE;
        goto out;
    }
    uint64_t lo = rv->addr + offset, hi = lo + a->size;
    for (uint32_t s = 0; s < kvs_g.regions.used; s++) {
        struct kvs_region *o = kvs_slots_at(&kvs_g.regions, s);
        if (o && o->resv == reservation && lo < o->addr + o->size && o->addr < hi) {
            rc = KVS_E_OVERLAP;
            goto out;
        }
    }
    g = calloc(1, sizeof *g);
    if (!g) {
        rc = KVS_E_NOMEM;
        goto out;
    }
    void *p = mmap((void *)(uintptr_t)lo, a->size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, 0);
    if (p == MAP_FAILED) {
        rc = sys_err();
        free(g);
        goto out;
    }
    g->addr = lo;
    g->size = a->size;
    g->alloc = allocation;
    g->resv = reservation;
    g->access = KVS_ACCESS_NONE;
    rc = kvs_slots_put(&kvs_g.regions, g, region);
    if (rc) {
        rereserve(lo, a->size);
        free(g);
        goto out;
    }
    a->maps++;
    rv->maps++;
    *addr = lo;
out:
    pthread_mutex_unlock(&kvs_g.mu);
    return rc;
}

int kvs_set_access(uint64_t region, int32_t access) {
    int prot;
    switch (access) {
    case KVS_ACCESS_NONE: prot = PROT_NONE; break;
    case KVS_ACCESS_READ: prot = PROT_READ; break;
    case KVS_ACCESS_READ_WRITE: prot = PROT_READ | PROT_WRITE; break;
    default: return KVS_E_INVAL;
    }
    pthread_mutex_lock(&kvs_g.mu);
    int rc = KVS_OK;
    struct kvs_region *g = host_region(region);
    if (!g) {
        rc = KVS_E_NOENT;
    } else if (g->owner) {
        rc = KVS_E_OWNED;
    } else if (access < g->access && g->pins) {
        rc = KVS_E_PINNED; /* revoking access under an in-flight op would fault it */
    } else if (mprotect((void *)(uintptr_t)g->addr, g->size, prot) != 0) {
        rc = sys_err();
    } else {
        g->access = access;
    }
    pthread_mutex_unlock(&kvs_g.mu);
    return rc;
}

int kvs_unmap(uint64_t region) {
    pthread_mutex_lock(&kvs_g.mu);
    int rc = KVS_OK;
    struct kvs_region *g = host_region(region);
    if (!g) {
        rc = KVS_E_NOENT;
    } else if (g->owner) {
        rc = KVS_E_OWNED;
    } else if (KVS_CHECK_PINS && g->pins) {
        rc = KVS_E_PINNED;
    } else if ((rc = rereserve(g->addr, g->size)) == KVS_OK) {
        struct kvs_alloc *a = kvs_slots_get(&kvs_g.allocs, g->alloc);
        struct kvs_resv *rv = kvs_slots_get(&kvs_g.resvs, g->resv);
        if (a) a->maps--;
        if (rv) rv->maps--;
        kvs_slots_del(&kvs_g.regions, region);
        free(g);
    }
    pthread_mutex_unlock(&kvs_g.mu);
    return rc;
}

#ifdef KVS_PLANT_CUDA_EARLY_UNPIN
#define KVS_PLANTED_CUDA 1
#else
#define KVS_PLANTED_CUDA 0
#endif

int32_t kvs_planted_bug(void) { return !KVS_CHECK_PINS || KVS_PLANTED_CUDA; }

const char *kvs_strerror(int32_t code) {
    switch (code) {
    case KVS_OK: return "ok";
    case KVS_E_INVAL: return "invalid argument";
    case KVS_E_SYS: return "system call failed";
    case KVS_E_NOENT: return "no such object";
    case KVS_E_PINNED: return "region is pinned";
    case KVS_E_MAPPED: return "still mapped";
    case KVS_E_ACCESS: return "region not mapped with the access this op needs";
    case KVS_E_RANGE: return "offset or length out of range";
    case KVS_E_OVERLAP: return "mapping overlaps another";
    case KVS_E_SIZE: return "fd has the wrong size";
    case KVS_E_SEALS: return "fd lacks the required seals";
    case KVS_E_NOTMEMFD: return "fd is not a memfd";
    case KVS_E_ILLEGAL: return "event not declared for the op's state";
    case KVS_E_TIMEOUT: return "timed out";
    case KVS_E_BUSY: return "engine has live ops";
    case KVS_E_NOMEM: return "out of memory";
    case KVS_E_INJECTED: return "injected failure";
    case KVS_E_GUARD: return "no row's guards admit the event";
    case KVS_E_EFFECT: return "an effect failed; the transition was rolled back";
    case KVS_E_REENTRANT: return "event fired from inside a transition of the same machine";
    case KVS_E_IDENTITY: return "fd is not the file its descriptor names";
    case KVS_E_OWNED: return "the mapping belongs to an owner (a part or a bank): close that instead";
    default: return "unknown error";
    }
}
