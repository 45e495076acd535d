/* Completion reports (kvs_report_open): one message sent on a socket once the last of a
 * set of ops is collectable, by the thread that made it so (a worker, or the caller of a
 * cancel), so a decode rank's "stored" reaches the index without anyone's Python. Reports
 * live in a list until closed. The op engine (kvs_ops.c) counts an op down in its report
 * when the op becomes collectable; everything here runs under kvs_g.mu (kvs_engine_lock).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvs_engine.h"

struct kvs_report {
    uint64_t id;
    int32_t sock;             /* our own dup of the caller's socket; -1 once sent or given up */
    int32_t status;           /* KVS_REPORT_* */
    uint32_t left;            /* ops not yet collectable */
    int32_t failed;           /* an op failed or was cancelled */
    int32_t closed;           /* the caller closed it while ops were left: free it when done */
    uint64_t ok_len, failed_len;
    char *ok, *bad;
    uint64_t *epochs;         /* a bank's block epoch page, or NULL (kvstate.share.epochs) */
    int64_t *eblocks;         /* its blocks this store made odd ... */
    uint64_t *eodd;           /* ... and the odd epoch each holds while the store may write it */
    uint32_t neblocks;
    struct kvs_report *next;
};

static struct {
    struct kvs_report *head;
    uint64_t next_id;
} R = {NULL, 1};

static void report_free(struct kvs_report *r) {
    struct kvs_report **p = &R.head;
    while (*p && *p != r) p = &(*p)->next;
    if (*p) *p = r->next;
    if (r->sock >= 0) close(r->sock);
    free(r->ok);
    free(r->bad);
    free(r->eblocks);
    free(r->eodd);
    free(r);
}

/* Under the lock: no op of the store writes any more; each block it made odd goes even
 * (unless something else moved it on), before anyone hears the store ended. */
static void epochs_end(struct kvs_report *r) {
    for (uint32_t i = 0; i < r->neblocks; i++) {
        uint64_t odd = r->eodd[i];
        __atomic_compare_exchange_n(&r->epochs[r->eblocks[i]], &odd, odd + 1, 0, __ATOMIC_RELEASE,
                                    __ATOMIC_RELAXED);
    }
}

/* Under the lock: the report's last op is collectable; send its message (non-blocking: a
 * full socket leaves it to the caller, who learns so from kvs_report_close). */
static void report_send(struct kvs_report *r) {
    if (r->closed) { /* nobody wants it any more (nor its epoch page: the bank may be gone) */
        report_free(r);
        return;
    }
    epochs_end(r);
    if (r->sock < 0) { /* epochs only */
        r->status = KVS_REPORT_QUIET;
        return;
    }
    const char *msg = r->failed ? r->bad : r->ok;
    uint64_t len = r->failed ? r->failed_len : r->ok_len;
    ssize_t n = send(r->sock, msg, len, MSG_DONTWAIT | MSG_NOSIGNAL);
    r->status = n == (ssize_t)len ? (r->failed ? KVS_REPORT_SENT_FAILED : KVS_REPORT_SENT_OK) : KVS_REPORT_UNSENT;
    close(r->sock);
    r->sock = -1;
    if (r->closed) report_free(r);
}

/* Under the lock: one of the report's ops became collectable (failed: it did not finish). */
void kvs_report_count_down(struct kvs_report *r, int failed) {
    if (failed) r->failed = 1;
    if (--r->left == 0) report_send(r);
}

int kvs_report_open(int32_t sock, const char *ok, uint64_t ok_len, const char *failed, uint64_t failed_len,
                    const int64_t *ops, uint32_t nops, uint64_t *epochs, const int64_t *blocks,
                    const uint64_t *odd, uint32_t nblocks, int64_t *out) {
    int message = sock >= 0;
    if (!ops || !out || nops == 0 || nops > KVS_REPORT_MAX_OPS || nblocks > KVS_REPORT_MAX_BLOCKS ||
        (nblocks && (!epochs || !blocks || !odd)) || (!message && (sock != -1 || !nblocks)) ||
        (message && (!ok || !failed || ok_len == 0 || failed_len == 0 || ok_len > KVS_REPORT_MAX_BYTES ||
                     failed_len > KVS_REPORT_MAX_BYTES)))
        return KVS_E_INVAL;
    for (uint32_t i = 0; i < nblocks; i++)
        if (blocks[i] < 0 || !(odd[i] & 1)) return KVS_E_INVAL;
    struct kvs_report *r = calloc(1, sizeof *r);
    if (!r) return KVS_E_NOMEM;
    r->sock = -1;
    if (nblocks) {
        r->eblocks = malloc(nblocks * sizeof *r->eblocks);
        r->eodd = malloc(nblocks * sizeof *r->eodd);
        if (!r->eblocks || !r->eodd) {
            report_free(r);
            return KVS_E_NOMEM;
        }
        memcpy(r->eblocks, blocks, nblocks * sizeof *r->eblocks);
        memcpy(r->eodd, odd, nblocks * sizeof *r->eodd);
        r->epochs = epochs;
        r->neblocks = nblocks;
    }
    if (message) {
        r->ok = malloc(ok_len);
        r->bad = malloc(failed_len);
        if (!r->ok || !r->bad) {
            report_free(r);
            return KVS_E_NOMEM;
        }
        memcpy(r->ok, ok, ok_len);
        memcpy(r->bad, failed, failed_len);
        r->ok_len = ok_len;
        r->failed_len = failed_len;
        /* Our own descriptor: the caller may close or reuse its number before the ops end. */
        r->sock = fcntl(sock, F_DUPFD_CLOEXEC, 3);
        if (r->sock < 0) {
            int e = errno;
            report_free(r);
            errno = e;
            return e == EBADF ? KVS_E_INVAL : KVS_E_SYS;
        }
    }
    kvs_engine_lock();
    int rc = KVS_OK;
    for (uint32_t i = 0; rc == KVS_OK && i < nops; i++)
        rc = kvs_op_claim_report(ops[i], r); /* undone below if a later op refuses */
    if (rc != KVS_OK) {
        for (uint32_t i = 0; i < nops; i++) kvs_op_unclaim_report(ops[i], r);
        kvs_engine_unlock();
        report_free(r);
        return rc;
    }
    r->id = R.next_id++;
    r->status = KVS_REPORT_PENDING;
    r->left = nops;
    r->next = R.head;
    R.head = r;
    for (uint32_t i = 0; i < nops; i++) kvs_op_settle_report(ops[i]);
    *out = (int64_t)r->id;
    kvs_engine_unlock();
    return KVS_OK;
}

int kvs_report_close(int64_t id, int32_t *status) {
    kvs_engine_lock();
    struct kvs_report *r = R.head;
    while (r && (int64_t)r->id != id) r = r->next;
    if (!r || r->closed) {
        kvs_engine_unlock();
        return KVS_E_NOENT;
    }
    if (status) *status = r->status;
    if (r->status == KVS_REPORT_PENDING) {
        r->closed = 1; /* its ops still count it down; the last one frees it, unsent */
        if (r->sock >= 0) close(r->sock);
        r->sock = -1;
    } else {
        report_free(r);
    }
    kvs_engine_unlock();
    return KVS_OK;
}
