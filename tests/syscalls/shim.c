/* LD_PRELOAD shim: the libc calls kvstate's host and channel paths make, counted and
 * failed on request (the host-side sibling of tests/cudashim).
 *
 * Nothing is counted or failed until the process arms the shim (kvs_sys_arm(1), through
 * ctypes), so interpreter start-up and imports never see a failure. Armed, every call of
 * an interposed function (by any thread) adds one to its counter; the one rule, from
 *
 *     KVS_SYSFAIL="call:nth:errno[:short]"
 *
 * makes the nth armed call of `call` fail with `errno` (the real call is not made), or,
 * with `short`, a short transfer: sendmsg/send send half the bytes asked; recvmsg
 * receives, then drops the fds that came with the message and sets MSG_CTRUNC, as the
 * kernel does when the receiver is out of fds. EINTR is faithful too: a connect
 * interrupted by a signal still connects (the kernel finishes it in the background).
 *
 * mmap, munmap and mprotect are counted only when kvstate's native module calls them
 * (malloc and the interpreter's arenas map memory all the time), read and write only on
 * eventfds, fcntl only for the seal and dup commands, epoll_ctl only to add or modify.
 * A process that forks a child per case sets the child's rule with kvs_sys_rule(spec). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* The journal's names, in this order (kvs_sys_count, kvs_sys_name). */
enum {
    C_MEMFD_CREATE, C_FTRUNCATE, C_FCNTL_ADD_SEALS, C_FCNTL_GET_SEALS, C_FCNTL_DUPFD, C_MMAP, C_MUNMAP,
    C_MPROTECT, C_SOCKET, C_CONNECT, C_ACCEPT4, C_SENDMSG, C_SEND, C_RECVMSG, C_POLL, C_SELECT,
    C_PIDFD_OPEN, C_EVENTFD, C_EVENTFD_READ, C_EVENTFD_WRITE, C_READ, C_WRITE, C_EPOLL_CREATE1,
    C_EPOLL_CTL, C_EPOLL_WAIT, C_PIPE2, C_COUNT
};
static const char *const NAMES[C_COUNT] = {
    "memfd_create", "ftruncate", "fcntl_add_seals", "fcntl_get_seals", "fcntl_dupfd", "mmap", "munmap",
    "mprotect", "socket", "connect", "accept4", "sendmsg", "send", "recvmsg", "poll", "select",
    "pidfd_open", "eventfd", "eventfd_read", "eventfd_write", "read", "write", "epoll_create1",
    "epoll_ctl", "epoll_wait", "pipe2",
};

static atomic_int armed;
static atomic_long counts[C_COUNT];
static struct {
    int call; /* -1: no rule */
    long nth;
    int err;
    int shorten;
} rule = {-1, 0, 0, 0};
static atomic_int fired;

/* Parse "call:nth:errno[:short]" into the rule, and start counting afresh. */
static int set_rule(const char *s) {
    char name[64];
    long nth = 0;
    int err = 0, call = -1;
    char extra[16] = "";
    if (sscanf(s, "%63[^:]:%ld:%d:%15s", name, &nth, &err, extra) < 3 || nth < 1) return -1;
    for (int i = 0; i < C_COUNT; i++)
        if (strcmp(NAMES[i], name) == 0) call = i;
    if (call < 0) return -1;
    for (int i = 0; i < C_COUNT; i++) atomic_store(&counts[i], 0);
    atomic_store(&fired, 0);
    rule.call = call;
    rule.nth = nth;
    rule.err = err;
    rule.shorten = strcmp(extra, "short") == 0;
    return 0;
}

__attribute__((constructor)) static void rule_from_env(void) {
    const char *s = getenv("KVS_SYSFAIL");
    if (s && *s && set_rule(s) != 0) {
        fprintf(stderr, "syscall shim: bad KVS_SYSFAIL %s (call:nth:errno[:short])\n", s);
        abort();
    }
}

/* -- controls (ctypes) -------------------------------------------------------------- */

EXPORT void kvs_sys_arm(int on) { atomic_store(&armed, on); }
EXPORT long kvs_sys_count(int call) { return call >= 0 && call < C_COUNT ? atomic_load(&counts[call]) : -1; }
EXPORT const char *kvs_sys_name(int call) { return call >= 0 && call < C_COUNT ? NAMES[call] : NULL; }
EXPORT int kvs_sys_fired(void) { return atomic_load(&fired); }
/* A forked case sets its rule here (0, or -1 for a bad spec). */
EXPORT int kvs_sys_rule(const char *spec) { return set_rule(spec); }

/* -- the decision ------------------------------------------------------------------- */

enum { PASS, FAIL, SHORT };

/* Count an armed call and say what to do with it. */
static int decide(int call) {
    if (!atomic_load(&armed)) return PASS;
    long n = atomic_fetch_add(&counts[call], 1) + 1;
    if (call != rule.call || n != rule.nth) return PASS;
    atomic_store(&fired, 1);
    return rule.shorten ? SHORT : FAIL;
}

static void *real(const char *name) {
    void *p = dlsym(RTLD_NEXT, name);
    if (!p) {
        fprintf(stderr, "syscall shim: no %s in libc\n", name);
        abort();
    }
    return p;
}
#define REAL(type, name) static __typeof__(type) real_##name; if (!real_##name) real_##name = (type)real(#name)

/* Whether the caller (the return address) lies in kvstate's native module. */
static int from_native(void *ret) {
    Dl_info info;
    return dladdr(ret, &info) && info.dli_fname && strstr(info.dli_fname, "kvstate/_native") != NULL;
}

static int is_eventfd(int fd) {
    if (!atomic_load(&armed)) return 0;
    char path[64], target[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t n = syscall(SYS_readlinkat, AT_FDCWD, path, target, sizeof target - 1);
    if (n < 0) return 0;
    target[n] = '\0';
    return strcmp(target, "anon_inode:[eventfd]") == 0;
}

#define FAIL_WITH(ret) do { errno = rule.err; return ret; } while (0)

/* -- memory (kvs_host.c) ------------------------------------------------------------ */

EXPORT int memfd_create(const char *name, unsigned int flags) {
    REAL(int (*)(const char *, unsigned int), memfd_create);
    if (decide(C_MEMFD_CREATE) == FAIL) FAIL_WITH(-1);
    return real_memfd_create(name, flags);
}

static int do_ftruncate(int fd, off_t len) {
    REAL(int (*)(int, off_t), ftruncate);
    if (decide(C_FTRUNCATE) == FAIL) FAIL_WITH(-1);
    return real_ftruncate(fd, len);
}
EXPORT int ftruncate(int fd, off_t len) { return do_ftruncate(fd, len); }
EXPORT int ftruncate64(int fd, off_t len) { return do_ftruncate(fd, len); }

static int fcntl_call(int cmd) {
    switch (cmd) {
    case F_ADD_SEALS: return C_FCNTL_ADD_SEALS;
    case F_GET_SEALS: return C_FCNTL_GET_SEALS;
    case F_DUPFD_CLOEXEC: case F_DUPFD: return C_FCNTL_DUPFD;
    default: return -1;
    }
}

static int do_fcntl(const char *which, int fd, int cmd, void *arg) {
    static int (*f)(int, int, ...);
    static int (*f64)(int, int, ...);
    int call = fcntl_call(cmd);
    if (call >= 0 && decide(call) == FAIL) FAIL_WITH(-1);
    if (which[5] == '6') {
        if (!f64) f64 = (int (*)(int, int, ...))real("fcntl64");
        return f64(fd, cmd, arg);
    }
    if (!f) f = (int (*)(int, int, ...))real("fcntl");
    return f(fd, cmd, arg);
}
/* Every fcntl command takes at most one argument, an int or a pointer: pass it on as a word. */
EXPORT int fcntl(int fd, int cmd, ...) {
    va_list ap;
    va_start(ap, cmd);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    return do_fcntl("fcntl", fd, cmd, arg);
}
EXPORT int fcntl64(int fd, int cmd, ...) {
    va_list ap;
    va_start(ap, cmd);
    void *arg = va_arg(ap, void *);
    va_end(ap);
    return do_fcntl("fcntl64", fd, cmd, arg);
}

EXPORT void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    REAL(void *(*)(void *, size_t, int, int, int, off_t), mmap);
    if (from_native(__builtin_return_address(0)) && decide(C_MMAP) == FAIL) FAIL_WITH(MAP_FAILED);
    return real_mmap(addr, len, prot, flags, fd, off);
}
EXPORT void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    REAL(void *(*)(void *, size_t, int, int, int, off_t), mmap64);
    if (from_native(__builtin_return_address(0)) && decide(C_MMAP) == FAIL) FAIL_WITH(MAP_FAILED);
    return real_mmap64(addr, len, prot, flags, fd, off);
}

EXPORT int munmap(void *addr, size_t len) {
    REAL(int (*)(void *, size_t), munmap);
    if (from_native(__builtin_return_address(0)) && decide(C_MUNMAP) == FAIL) FAIL_WITH(-1);
    return real_munmap(addr, len);
}

EXPORT int mprotect(void *addr, size_t len, int prot) {
    REAL(int (*)(void *, size_t, int), mprotect);
    if (from_native(__builtin_return_address(0)) && decide(C_MPROTECT) == FAIL) FAIL_WITH(-1);
    return real_mprotect(addr, len, prot);
}

/* -- sockets (Python's socket module, for kvstate.channel) -------------------------- */

EXPORT int socket(int domain, int type, int protocol) {
    REAL(int (*)(int, int, int), socket);
    if (decide(C_SOCKET) == FAIL) FAIL_WITH(-1);
    return real_socket(domain, type, protocol);
}

EXPORT int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    REAL(int (*)(int, const struct sockaddr *, socklen_t), connect);
    if (decide(C_CONNECT) == FAIL) {
        if (rule.err == EINTR) {
            /* The kernel goes on connecting after a signal: connect now, report EINTR. */
            if (real_connect(fd, addr, len) != 0) return -1;
        }
        FAIL_WITH(-1);
    }
    return real_connect(fd, addr, len);
}

EXPORT int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
    REAL(int (*)(int, struct sockaddr *, socklen_t *, int), accept4);
    if (decide(C_ACCEPT4) == FAIL) FAIL_WITH(-1);
    return real_accept4(fd, addr, len, flags);
}

EXPORT ssize_t sendmsg(int fd, const struct msghdr *msg, int flags) {
    REAL(ssize_t (*)(int, const struct msghdr *, int), sendmsg);
    int what = decide(C_SENDMSG);
    if (what == FAIL) FAIL_WITH(-1);
    if (what == SHORT && msg->msg_iovlen >= 1 && msg->msg_iov[0].iov_len > 1) {
        /* Half of the first buffer only: fewer bytes than asked. */
        struct iovec iov = msg->msg_iov[0];
        iov.iov_len /= 2;
        struct msghdr m = *msg;
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        return real_sendmsg(fd, &m, flags);
    }
    return real_sendmsg(fd, msg, flags);
}

EXPORT ssize_t send(int fd, const void *buf, size_t len, int flags) {
    REAL(ssize_t (*)(int, const void *, size_t, int), send);
    int what = decide(C_SEND);
    if (what == FAIL) FAIL_WITH(-1);
    if (what == SHORT && len > 1) len /= 2;
    return real_send(fd, buf, len, flags);
}

EXPORT ssize_t recvmsg(int fd, struct msghdr *msg, int flags) {
    REAL(ssize_t (*)(int, struct msghdr *, int), recvmsg);
    int what = decide(C_RECVMSG);
    if (what == FAIL) FAIL_WITH(-1);
    ssize_t n = real_recvmsg(fd, msg, flags);
    if (what == SHORT && n >= 0) {
        /* The receiver was out of fds: the kernel drops them and says so. */
        for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                int *fds = (int *)CMSG_DATA(c);
                size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                for (size_t i = 0; i < k; i++) close(fds[i]);
            }
        }
        msg->msg_controllen = 0;
        msg->msg_flags |= MSG_CTRUNC;
    }
    return n;
}

/* -- waiting, pidfds, eventfds ------------------------------------------------------ */

EXPORT int poll(struct pollfd *fds, nfds_t n, int timeout) {
    REAL(int (*)(struct pollfd *, nfds_t, int), poll);
    if (decide(C_POLL) == FAIL) FAIL_WITH(-1);
    return real_poll(fds, n, timeout);
}

EXPORT int select(int n, fd_set *r, fd_set *w, fd_set *e, struct timeval *t) {
    REAL(int (*)(int, fd_set *, fd_set *, fd_set *, struct timeval *), select);
    if (decide(C_SELECT) == FAIL) FAIL_WITH(-1);
    return real_select(n, r, w, e, t);
}

/* CPython's os.pidfd_open is syscall(__NR_pidfd_open, pid, flags). */
EXPORT long syscall(long number, ...) {
    REAL(long (*)(long, ...), syscall);
    va_list ap;
    va_start(ap, number);
    long a[6];
    for (int i = 0; i < 6; i++) a[i] = va_arg(ap, long);
    va_end(ap);
    if (number == SYS_pidfd_open && decide(C_PIDFD_OPEN) == FAIL) FAIL_WITH(-1);
    return real_syscall(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}

EXPORT int eventfd(unsigned int initval, int flags) {
    REAL(int (*)(unsigned int, int), eventfd);
    if (decide(C_EVENTFD) == FAIL) FAIL_WITH(-1);
    return real_eventfd(initval, flags);
}

EXPORT int eventfd_read(int fd, eventfd_t *value) {
    REAL(int (*)(int, eventfd_t *), eventfd_read);
    if (decide(C_EVENTFD_READ) == FAIL) FAIL_WITH(-1);
    return real_eventfd_read(fd, value);
}

EXPORT int eventfd_write(int fd, eventfd_t value) {
    REAL(int (*)(int, eventfd_t), eventfd_write);
    if (decide(C_EVENTFD_WRITE) == FAIL) FAIL_WITH(-1);
    return real_eventfd_write(fd, value);
}

EXPORT ssize_t read(int fd, void *buf, size_t len) {
    REAL(ssize_t (*)(int, void *, size_t), read);
    if (is_eventfd(fd) && decide(C_READ) == FAIL) FAIL_WITH(-1);
    return real_read(fd, buf, len);
}

EXPORT ssize_t write(int fd, const void *buf, size_t len) {
    REAL(ssize_t (*)(int, const void *, size_t), write);
    if (is_eventfd(fd) && decide(C_WRITE) == FAIL) FAIL_WITH(-1);
    return real_write(fd, buf, len);
}

EXPORT int epoll_create1(int flags) {
    REAL(int (*)(int), epoll_create1);
    if (decide(C_EPOLL_CREATE1) == FAIL) FAIL_WITH(-1);
    return real_epoll_create1(flags);
}

EXPORT int epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev) {
    REAL(int (*)(int, int, int, struct epoll_event *), epoll_ctl);
    /* Only adding or changing a watch allocates (ENOMEM, ENOSPC); removing one cannot fail so. */
    if (op != EPOLL_CTL_DEL && decide(C_EPOLL_CTL) == FAIL) FAIL_WITH(-1);
    return real_epoll_ctl(epfd, op, fd, ev);
}

EXPORT int epoll_wait(int epfd, struct epoll_event *ev, int n, int timeout) {
    REAL(int (*)(int, struct epoll_event *, int, int), epoll_wait);
    if (decide(C_EPOLL_WAIT) == FAIL) FAIL_WITH(-1);
    return real_epoll_wait(epfd, ev, n, timeout);
}

/* The watchers' wake-up pipes (os.pipe2). */
EXPORT int pipe2(int fds[2], int flags) {
    REAL(int (*)(int *, int), pipe2);
    if (decide(C_PIPE2) == FAIL) FAIL_WITH(-1);
    return real_pipe2(fds, flags);
}
