/* Loading the CUDA driver at run time, the error of the last failed call, and discovery.
 *
 * kvs_cuda_load() dlopen()s the library it is given (RTLD_LOCAL, so nothing of it leaks
 * into the process's namespace), finds cuInit and cuGetProcAddress_v2 with dlsym, and
 * every other call through cuGetProcAddress_v2 at the CUDA version kvs_cuda_driver.h
 * declares for it. A required call that is missing refuses the whole load: the module
 * never runs half a driver. See kvs.h. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "kvs_cuda.h"

struct kcu_driver kcu;

static struct {
    pthread_mutex_t mu;
    int loaded;
    char path[4096];
    char error[512];
    void *lib;
} L = {.mu = PTHREAD_MUTEX_INITIALIZER};

static _Thread_local const char *last_call = "";
static _Thread_local int32_t last_result;

int kcu_ready(void) { return __atomic_load_n(&L.loaded, __ATOMIC_ACQUIRE) ? KVS_OK : KVS_E_NODRIVER; }

int kcu_check(const char *call, kcu_result result) {
    if (result == KCU_SUCCESS) return KVS_OK;
    last_call = call;
    last_result = (int32_t)result;
    return KVS_E_CUDA;
}

const char *kvs_cuda_last_call(void) { return last_call; }
int32_t kvs_cuda_last_result(void) { return last_result; }

/* The table of calls: name, version, whether required, and where its pointer goes. */
static const struct {
    const char *name;
    int version;
    int required;
    size_t offset;
} calls[] = {
#define KCU_ENTRY(name, version, required, params) {#name, version, required, offsetof(struct kcu_driver, name)},
    KCU_CALLS(KCU_ENTRY)
#undef KCU_ENTRY
};

#define NCALLS ((int32_t)(sizeof calls / sizeof calls[0]))

const char *kvs_cuda_call_name(int32_t index) {
    /* cuInit and cuGetProcAddress first: they are called too, found by dlsym */
    if (index == 0) return "cuInit";
    if (index == 1) return "cuGetProcAddress";
    return index >= 2 && index - 2 < NCALLS ? calls[index - 2].name : NULL;
}

static int refuse(const char *fmt, const char *a, const char *b) {
    snprintf(L.error, sizeof L.error, fmt, a, b ? b : "");
    return KVS_E_NODRIVER;
}

/* Under L.mu: open and resolve. Leaves nothing loaded unless it returns KVS_OK. */
static int load(const char *path) {
    dlerror();
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) return refuse("cannot load %s: %s", path, dlerror());
    kcu_pfn_cuInit init = (kcu_pfn_cuInit)dlsym(lib, "cuInit");
    kcu_pfn_cuGetProcAddress gpa = (kcu_pfn_cuGetProcAddress)dlsym(lib, "cuGetProcAddress_v2");
    if (!init || !gpa) {
        dlclose(lib);
        return refuse("%s has no %s (a CUDA 12.0 driver or newer is needed)", path,
                      init ? "cuGetProcAddress_v2" : "cuInit");
    }
    struct kcu_driver found;
    memset(&found, 0, sizeof found);
    for (int32_t i = 0; i < NCALLS; i++) {
        void *fn = NULL;
        kcu_proc_status status = KCU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        kcu_result r = gpa(calls[i].name, &fn, calls[i].version, KCU_GET_PROC_ADDRESS_DEFAULT, &status);
        if (r != KCU_SUCCESS || status != KCU_GET_PROC_ADDRESS_SUCCESS || !fn) {
            if (!calls[i].required) continue;
            dlclose(lib);
            return refuse("%s lacks %s (a CUDA 12.0 driver or newer is needed)", path, calls[i].name);
        }
        memcpy((char *)&found + calls[i].offset, &fn, sizeof fn);
    }
    int rc = kcu_check("cuInit", init(0));
    if (rc != KVS_OK) {
        snprintf(L.error, sizeof L.error, "cuInit failed with CUresult %d", (int)last_result);
        dlclose(lib);
        return rc;
    }
    kcu = found;
    L.lib = lib;
    snprintf(L.path, sizeof L.path, "%s", path);
    __atomic_store_n(&L.loaded, 1, __ATOMIC_RELEASE);
    return KVS_OK;
}

int kvs_cuda_load(const char *path) {
    if (!path || !*path || strlen(path) >= sizeof L.path) return KVS_E_INVAL;
    pthread_mutex_lock(&L.mu);
    int rc = L.loaded ? (strcmp(L.path, path) == 0 ? KVS_OK : KVS_E_BUSY) : load(path);
    pthread_mutex_unlock(&L.mu);
    return rc;
}

const char *kvs_cuda_load_error(void) { return L.error; }

const char *kvs_cuda_result_name(int32_t result) {
    const char *name = NULL;
    if (kcu_ready() != KVS_OK || kcu.cuGetErrorName((kcu_result)result, &name) != KCU_SUCCESS) return NULL;
    return name;
}

int kvs_cuda_driver_info_get(kvs_cuda_driver_info *out) {
    int rc = kcu_ready();
    if (rc != KVS_OK) return rc;
    int version = 0, count = 0;
    if ((rc = KCU(cuDriverGetVersion, &version)) != KVS_OK) return rc;
    if ((rc = KCU(cuDeviceGetCount, &count)) != KVS_OK) return rc;
    /* the batched copy only from 12.8 on, whatever a lookup said */
    *out = (kvs_cuda_driver_info){.version = version, .devices = count,
                                  .batch = kcu.cuMemcpyBatchAsync != NULL && version >= 12080};
    return KVS_OK;
}

static int attribute(kcu_device dev, kcu_device_attribute attr, int *value) {
    return KCU(cuDeviceGetAttribute, value, attr, dev);
}

int kvs_cuda_device_info_get(int32_t ordinal, kvs_cuda_device_info *out) {
    int rc = kcu_ready();
    if (rc != KVS_OK) return rc;
    if (ordinal < 0) return KVS_E_INVAL;
    kcu_device dev;
    kcu_uuid uuid;
    int vmm = 0, posix = 0, fabric = 0, pitch = 0;
    memset(out, 0, sizeof *out);
    if ((rc = KCU(cuDeviceGet, &dev, ordinal)) != KVS_OK ||
        (rc = KCU(cuDeviceGetUuid, &uuid, dev)) != KVS_OK ||
        (rc = KCU(cuDeviceGetName, out->name, (int)sizeof out->name - 1, dev)) != KVS_OK ||
        (rc = attribute(dev, KCU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, &vmm)) != KVS_OK ||
        (rc = attribute(dev, KCU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, &posix)) != KVS_OK ||
        (rc = attribute(dev, KCU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, &fabric)) != KVS_OK ||
        (rc = attribute(dev, KCU_DEVICE_ATTRIBUTE_MAX_PITCH, &pitch)) != KVS_OK)
        return rc;
    memcpy(out->uuid, uuid.bytes, sizeof out->uuid);
    out->vmm = vmm != 0;
    out->posix_fd = posix != 0;
    out->fabric = fabric != 0;
    out->max_pitch = pitch;
    return KVS_OK;
}
