/* The exporter's inventory as its lease server mirrors it (kvs_inventory.c): Python keeps
 * it up to date with every store and eviction; a grant that names blocks re-validates and
 * pins them (kvs_lease_answer.c), all under the server's lock. */
#include "kvs_lease.h"

int kvs_lease_inv_on(kvs_lease_server *s) {
    if (!s) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    s->inv.on = 1;
    pthread_mutex_unlock(&s->mu);
    return KVS_OK;
}

int kvs_lease_inv_epoch(kvs_lease_server *s, const char *group, uint32_t glen, int64_t epoch) {
    if (!s || !group) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int rc = kvs_inv_epoch(&s->inv, group, glen, epoch);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int kvs_lease_inv_add(kvs_lease_server *s, const char *group, uint32_t glen, const uint64_t *hashes, uint32_t n) {
    if (!s || !group || (n && !hashes)) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int rc = kvs_inv_add(&s->inv, group, glen, hashes, n);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int kvs_lease_inv_remove(kvs_lease_server *s, const char *group, uint32_t glen, const uint64_t *hashes, uint32_t n) {
    if (!s || !group || (n && !hashes)) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int rc = kvs_inv_remove(&s->inv, group, glen, hashes, n);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int64_t kvs_lease_inv_leases(kvs_lease_server *s, const char *group, uint32_t glen, uint64_t hash) {
    if (!s || !group) return KVS_E_INVAL;
    pthread_mutex_lock(&s->mu);
    int64_t n = kvs_inv_leases(&s->inv, group, glen, hash);
    pthread_mutex_unlock(&s->mu);
    return n;
}
