/* The part of the CUDA driver API the cuda backend calls, declared here rather than taken
 * from cuda.h: the module builds and imports where CUDA is absent, and resolves every call
 * at run time (kvs_cuda_load) from the library it is given, libcuda.so.1 or the CPU shim
 * under tests/cudashim, which implements exactly these declarations.
 *
 * ABI. Every value, struct layout and function type below is the driver's (cuda.h, CUDA
 * 12.0 ABI, and 12.8 for the batched copy). The compiler gives an enum with no negative
 * value the type unsigned int, so each enum-typed value is a typedef of unsigned int under
 * its own name; tests/native/test_cuda_abi.py compiles this header against an installed
 * cuda.h (where there is one), maps each kcu_ name to the cuda.h type it stands for, and
 * checks every size, offset, constant and function type exactly.
 *
 * Calls are resolved with cuGetProcAddress_v2 at the CUDA version given in KCU_CALLS, so
 * "cuMemAlloc" at 12000 is the 64-bit cuMemAlloc_v2 that cuda.h's macros name, and
 * cuMemcpyBatchAsync at 12080 is the form with failIdx (CUDA 13 renamed that one). */
#ifndef KVS_CUDA_DRIVER_H
#define KVS_CUDA_DRIVER_H

#include <stddef.h>
#include <stdint.h>

typedef unsigned int kcu_result;            /* CUresult */
typedef int kcu_device;                     /* CUdevice */
typedef unsigned long long kcu_deviceptr;   /* CUdeviceptr */
typedef unsigned long long kcu_mem_handle;  /* CUmemGenericAllocationHandle */
typedef unsigned long long kcu_flags;       /* the "unsigned long long flags" of VMM calls */
typedef struct kcu_ctx_st *kcu_context;     /* CUcontext */
typedef struct kcu_stream_st *kcu_stream;   /* CUstream */
typedef struct kcu_event_st *kcu_event;     /* CUevent */
typedef unsigned int kcu_device_attribute;  /* CUdevice_attribute */
typedef unsigned int kcu_pointer_attribute; /* CUpointer_attribute */
typedef unsigned int kcu_handle_type;       /* CUmemAllocationHandleType */
typedef unsigned int kcu_granularity_flags; /* CUmemAllocationGranularity_flags */
typedef unsigned int kcu_access_flags;      /* CUmemAccess_flags */
typedef unsigned int kcu_location_type;     /* CUmemLocationType */
typedef unsigned int kcu_allocation_type;   /* CUmemAllocationType */
typedef unsigned int kcu_memory_type;       /* CUmemorytype */
typedef unsigned int kcu_access_order;      /* CUmemcpySrcAccessOrder */
typedef unsigned int kcu_proc_status;       /* CUdriverProcAddressQueryResult */
typedef struct kcu_array_st *kcu_array;     /* CUarray */

typedef struct kcu_uuid {                   /* CUuuid */
    char bytes[16];
} kcu_uuid;

#define KCU_IPC_HANDLE_SIZE 64

typedef struct kcu_ipc_mem_handle {         /* CUipcMemHandle */
    char reserved[KCU_IPC_HANDLE_SIZE];
} kcu_ipc_mem_handle;

typedef struct kcu_fabric_handle {          /* CUmemFabricHandle */
    unsigned char data[KCU_IPC_HANDLE_SIZE];
} kcu_fabric_handle;

typedef struct kcu_mem_location {           /* CUmemLocation */
    kcu_location_type type;
    int id;
} kcu_mem_location;

typedef struct kcu_allocation_prop {        /* CUmemAllocationProp */
    kcu_allocation_type type;
    kcu_handle_type requested_handle_types;
    kcu_mem_location location;
    void *win32_handle_meta_data;
    struct {
        unsigned char compression_type;
        unsigned char gpu_direct_rdma_capable;
        unsigned short usage;
        unsigned char reserved[4];
    } alloc_flags;
} kcu_allocation_prop;

typedef struct kcu_access_desc {            /* CUmemAccessDesc */
    kcu_mem_location location;
    kcu_access_flags flags;
} kcu_access_desc;

typedef struct kcu_memcpy2d {               /* CUDA_MEMCPY2D */
    size_t src_x_in_bytes;
    size_t src_y;
    kcu_memory_type src_memory_type;
    const void *src_host;
    kcu_deviceptr src_device;
    kcu_array src_array;
    size_t src_pitch;
    size_t dst_x_in_bytes;
    size_t dst_y;
    kcu_memory_type dst_memory_type;
    void *dst_host;
    kcu_deviceptr dst_device;
    kcu_array dst_array;
    size_t dst_pitch;
    size_t width_in_bytes;
    size_t height;
} kcu_memcpy2d;

typedef struct kcu_memcpy_attributes {      /* CUmemcpyAttributes */
    kcu_access_order src_access_order;
    kcu_mem_location src_loc_hint;
    kcu_mem_location dst_loc_hint;
    unsigned int flags;
} kcu_memcpy_attributes;

/* Values of cuda.h's enums and defines that the backend (and the shim) use. */
#define KCU_SUCCESS 0u
#define KCU_ERROR_INVALID_VALUE 1u
#define KCU_ERROR_OUT_OF_MEMORY 2u
#define KCU_ERROR_NOT_INITIALIZED 3u
#define KCU_ERROR_NO_DEVICE 100u
#define KCU_ERROR_INVALID_DEVICE 101u
#define KCU_ERROR_INVALID_CONTEXT 201u
#define KCU_ERROR_ALREADY_MAPPED 208u
#define KCU_ERROR_INVALID_HANDLE 400u
#define KCU_ERROR_NOT_FOUND 500u
#define KCU_ERROR_NOT_READY 600u
#define KCU_ERROR_ILLEGAL_ADDRESS 700u
#define KCU_ERROR_NOT_PERMITTED 800u
#define KCU_ERROR_NOT_SUPPORTED 801u
#define KCU_ERROR_UNKNOWN 999u

#define KCU_DEVICE_ATTRIBUTE_MAX_PITCH 11u
#define KCU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 102u
#define KCU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED 103u
#define KCU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED 128u
#define KCU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE 10u
#define KCU_MEM_HANDLE_TYPE_NONE 0u
#define KCU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1u
#define KCU_MEM_HANDLE_TYPE_FABRIC 8u
#define KCU_MEM_ALLOCATION_TYPE_PINNED 1u
#define KCU_MEM_LOCATION_TYPE_DEVICE 1u
#define KCU_MEM_ALLOC_GRANULARITY_MINIMUM 0u
#define KCU_MEM_ALLOC_GRANULARITY_RECOMMENDED 1u
#define KCU_MEM_ACCESS_FLAGS_PROT_NONE 0u
#define KCU_MEM_ACCESS_FLAGS_PROT_READ 1u
#define KCU_MEM_ACCESS_FLAGS_PROT_READWRITE 3u
#define KCU_MEMORYTYPE_DEVICE 2u
#define KCU_MEMCPY_SRC_ACCESS_ORDER_STREAM 1u
#define KCU_STREAM_NON_BLOCKING 1u
#define KCU_EVENT_BLOCKING_SYNC 1u
#define KCU_EVENT_DISABLE_TIMING 2u
#define KCU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 1u
#define KCU_GET_PROC_ADDRESS_DEFAULT 0u
#define KCU_GET_PROC_ADDRESS_SUCCESS 0u
#define KCU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND 1u
#define KCU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT 2u

/* The two calls found with dlsym; every other one through cuGetProcAddress_v2. */
typedef kcu_result (*kcu_pfn_cuInit)(unsigned int flags);
typedef kcu_result (*kcu_pfn_cuGetProcAddress)(const char *symbol, void **pfn, int cuda_version,
                                               uint64_t flags, kcu_proc_status *status);

/* X(name, CUDA version asked for, required, (parameters)): the calls the backend makes. An
 * optional call (required 0) may be missing; the backend then does without it. */
#define KCU_CALLS(X)                                                                              \
    X(cuDriverGetVersion, 12000, 1, (int *version))                                               \
    X(cuGetErrorName, 12000, 1, (kcu_result error, const char **name))                            \
    X(cuDeviceGetCount, 12000, 1, (int *count))                                                   \
    X(cuDeviceGet, 12000, 1, (kcu_device *device, int ordinal))                                   \
    X(cuDeviceGetUuid, 12000, 1, (kcu_uuid *uuid, kcu_device dev))                                \
    X(cuDeviceGetName, 12000, 1, (char *name, int len, kcu_device dev))                           \
    X(cuDeviceGetAttribute, 12000, 1, (int *value, kcu_device_attribute attrib, kcu_device dev))  \
    X(cuMemGetAllocationGranularity, 12000, 1,                                                    \
      (size_t *granularity, const kcu_allocation_prop *prop, kcu_granularity_flags option))       \
    X(cuDevicePrimaryCtxRetain, 12000, 1, (kcu_context *ctx, kcu_device dev))                     \
    X(cuDevicePrimaryCtxRelease, 12000, 1, (kcu_device dev))                                      \
    X(cuCtxSetCurrent, 12000, 1, (kcu_context ctx))                                               \
    X(cuStreamCreate, 12000, 1, (kcu_stream *stream, unsigned int flags))                         \
    X(cuStreamDestroy, 12000, 1, (kcu_stream stream))                                             \
    X(cuStreamSynchronize, 12000, 1, (kcu_stream stream))                                         \
    X(cuEventCreate, 12000, 1, (kcu_event *event, unsigned int flags))                            \
    X(cuEventRecord, 12000, 1, (kcu_event event, kcu_stream stream))                              \
    X(cuEventQuery, 12000, 1, (kcu_event event))                                                  \
    X(cuEventSynchronize, 12000, 1, (kcu_event event))                                            \
    X(cuEventDestroy, 12000, 1, (kcu_event event))                                                \
    X(cuMemCreate, 12000, 1,                                                                      \
      (kcu_mem_handle *handle, size_t size, const kcu_allocation_prop *prop, kcu_flags flags))      \
    X(cuMemRelease, 12000, 1, (kcu_mem_handle handle))                                            \
    X(cuMemExportToShareableHandle, 12000, 1,                                                     \
      (void *shareable, kcu_mem_handle handle, kcu_handle_type type, kcu_flags flags))              \
    X(cuMemImportFromShareableHandle, 12000, 1,                                                   \
      (kcu_mem_handle *handle, void *os_handle, kcu_handle_type type))                            \
    X(cuMemAddressReserve, 12000, 1,                                                              \
      (kcu_deviceptr *ptr, size_t size, size_t alignment, kcu_deviceptr addr, kcu_flags flags))     \
    X(cuMemAddressFree, 12000, 1, (kcu_deviceptr ptr, size_t size))                               \
    X(cuMemMap, 12000, 1,                                                                         \
      (kcu_deviceptr ptr, size_t size, size_t offset, kcu_mem_handle handle, kcu_flags flags))      \
    X(cuMemUnmap, 12000, 1, (kcu_deviceptr ptr, size_t size))                                     \
    X(cuMemSetAccess, 12000, 1,                                                                   \
      (kcu_deviceptr ptr, size_t size, const kcu_access_desc *desc, size_t count))                \
    X(cuMemAlloc, 12000, 1, (kcu_deviceptr *dptr, size_t size))                                   \
    X(cuMemFree, 12000, 1, (kcu_deviceptr dptr))                                                  \
    X(cuPointerGetAttribute, 12000, 1,                                                            \
      (void *data, kcu_pointer_attribute attribute, kcu_deviceptr ptr))                           \
    X(cuIpcGetMemHandle, 12000, 1, (kcu_ipc_mem_handle *handle, kcu_deviceptr dptr))              \
    X(cuIpcOpenMemHandle, 12000, 1,                                                               \
      (kcu_deviceptr *dptr, kcu_ipc_mem_handle handle, unsigned int flags))                       \
    X(cuIpcCloseMemHandle, 12000, 1, (kcu_deviceptr dptr))                                        \
    X(cuMemGetAddressRange, 12000, 1, (kcu_deviceptr *base, size_t *size, kcu_deviceptr dptr))    \
    X(cuMemcpyAsync, 12000, 1,                                                                    \
      (kcu_deviceptr dst, kcu_deviceptr src, size_t size, kcu_stream stream))                     \
    X(cuMemcpy2DAsync, 12000, 1, (const kcu_memcpy2d *copy, kcu_stream stream))                   \
    X(cuMemcpyBatchAsync, 12080, 0,                                                               \
      (kcu_deviceptr *dsts, kcu_deviceptr *srcs, size_t *sizes, size_t count,                     \
       kcu_memcpy_attributes *attrs, size_t *attr_idxs, size_t num_attrs, size_t *fail_idx,       \
       kcu_stream stream))                                                                        \
    X(cuMemcpyHtoD, 12000, 1, (kcu_deviceptr dst, const void *src, size_t size))                  \
    X(cuMemcpyDtoH, 12000, 1, (void *dst, kcu_deviceptr src, size_t size))

#define KCU_TYPEDEF(name, version, required, params) typedef kcu_result (*kcu_pfn_##name) params;
KCU_CALLS(KCU_TYPEDEF)
#undef KCU_TYPEDEF

#endif /* KVS_CUDA_DRIVER_H */
