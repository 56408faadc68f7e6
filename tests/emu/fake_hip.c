/* A fake HIP runtime (libamdhip64) for tests: the subset mooncake calls, over host
 * memory. Device memory, IPC and dma-buf follow fake_gpu_mem.h, as in fake_cuda.c;
 * pointer queries tell device from host by allocation (ROCm 5 numbering: Host 0,
 * Device 1); copies check their kind; copies are counted (fake_hip_copies). The
 * current device is per thread, default 0, as in HIP. */
#include "fake_gpu_mem.h"
#include <stdlib.h>

typedef int hipError_t;
enum { hipSuccess = 0, hipErrorInvalidValue = 1, hipErrorOutOfMemory = 2, hipErrorNotInitialized = 3,
       hipErrorInvalidDevice = 101 };
enum { hipMemcpyHostToHost = 0, hipMemcpyHostToDevice = 1, hipMemcpyDeviceToHost = 2,
       hipMemcpyDeviceToDevice = 3, hipMemcpyDefault = 4 };

typedef struct {
    int memoryType;
    int device;
    void *devicePointer;
    void *hostPointer;
    int isManaged;
    unsigned allocationFlags;
} hipPointerAttribute_t;
typedef struct { char reserved[64]; } hipIpcMemHandle_t;

static unsigned long copies;
static __thread int current;

unsigned long fake_hip_copies(void) { return __atomic_load_n(&copies, __ATOMIC_SEQ_CST); }

hipError_t hipInit(unsigned flags) {
    if (flags) return hipErrorInvalidValue;
    return gpu_init_once() == 0 ? hipSuccess : hipErrorOutOfMemory;
}
#define NEED_INIT() do { if (!gpu_ready()) return hipErrorNotInitialized; } while (0)

hipError_t hipRuntimeGetVersion(int *v) { *v = 50221153; return hipSuccess; }
hipError_t hipGetDeviceCount(int *n) { NEED_INIT(); *n = NDEV; return hipSuccess; }
hipError_t hipDeviceGetName(char *name, int len, int d) {
    NEED_INIT();
    if (d < 0 || d >= NDEV) return hipErrorInvalidDevice;
    snprintf(name, (size_t)len, "Fake HIP Device %d", d);
    return hipSuccess;
}
/* Fake devices sit at PCI 0000:2N:00.0. */
hipError_t hipDeviceGetPCIBusId(char *id, int len, int d) {
    NEED_INIT();
    if (d < 0 || d >= NDEV) return hipErrorInvalidDevice;
    snprintf(id, (size_t)len, "0000:2%d:00.0", d);
    return hipSuccess;
}
hipError_t hipSetDevice(int d) {
    NEED_INIT();
    if (d < 0 || d >= NDEV) return hipErrorInvalidDevice;
    current = d;
    return hipSuccess;
}
hipError_t hipGetDevice(int *d) { NEED_INIT(); *d = current; return hipSuccess; }
hipError_t hipDeviceSynchronize(void) { NEED_INIT(); return hipSuccess; }

hipError_t hipPointerGetAttributes(hipPointerAttribute_t *a, const void *ptr) {
    NEED_INIT();
    uint64_t p = (uint64_t)(uintptr_t)ptr;
    int d = dev_of(p, 1);
    if (d < 0 && !is_pinned(p)) return hipErrorInvalidValue;
    memset(a, 0, sizeof *a);
    a->memoryType = d >= 0 ? 1 : 0;
    a->device = d >= 0 ? d : current;
    a->devicePointer = d >= 0 ? (void *)ptr : NULL;
    a->hostPointer = d >= 0 ? NULL : (void *)ptr;
    return hipSuccess;
}

hipError_t hipMemcpy(void *dst, const void *src, size_t n, int kind) {
    NEED_INIT();
    uint64_t d = (uint64_t)(uintptr_t)dst, s = (uint64_t)(uintptr_t)src;
    int dd = dev_of(d, n) >= 0, sd = dev_of(s, n) >= 0;
    switch (kind) {
    case hipMemcpyHostToDevice: if (!dd || dev_of(s, 1) >= 0) return hipErrorInvalidValue; memcpy(shadow(d), src, n); break;
    case hipMemcpyDeviceToHost: if (!sd || dev_of(d, 1) >= 0) return hipErrorInvalidValue; memcpy(dst, shadow(s), n); break;
    case hipMemcpyDeviceToDevice: if (!dd || !sd) return hipErrorInvalidValue; memmove(shadow(d), shadow(s), n); break;
    default: return hipErrorInvalidValue;
    }
    __atomic_add_fetch(&copies, 1, __ATOMIC_SEQ_CST);
    return hipSuccess;
}

hipError_t hipHostMalloc(void **pp, size_t n, unsigned flags) {
    (void)flags;
    NEED_INIT();
    *pp = pinned_alloc(n);
    return *pp ? hipSuccess : hipErrorOutOfMemory;
}
hipError_t hipHostFree(void *p) { return pinned_free(p) == 0 ? hipSuccess : hipErrorInvalidValue; }
hipError_t hipMalloc(void **p, size_t n) {
    NEED_INIT();
    *p = (void *)(uintptr_t)gpu_alloc(current, n);
    return *p ? hipSuccess : hipErrorOutOfMemory;
}
hipError_t hipFree(void *p) { return gpu_free((uintptr_t)p) == 0 ? hipSuccess : hipErrorInvalidValue; }
hipError_t hipMemGetAddressRange(void **base, size_t *size, void *p) {
    NEED_INIT();
    uint64_t b;
    size_t n;
    if (gpu_range((uintptr_t)p, &b, &n) != 0) return hipErrorInvalidValue;
    if (base) *base = (void *)(uintptr_t)b;
    if (size) *size = n;
    return hipSuccess;
}

hipError_t hipIpcGetMemHandle(hipIpcMemHandle_t *h, void *p) {
    NEED_INIT();
    return gpu_ipc_export((uintptr_t)p, h->reserved, "FAKE_HIP") == 0 ? hipSuccess : hipErrorInvalidValue;
}
hipError_t hipIpcOpenMemHandle(void **p, hipIpcMemHandle_t h, unsigned flags) {
    (void)flags;
    NEED_INIT();
    *p = (void *)(uintptr_t)gpu_ipc_open(current, h.reserved, "FAKE_HIP");
    return *p ? hipSuccess : hipErrorInvalidValue;
}
hipError_t hipIpcCloseMemHandle(void *p) {
    return gpu_ipc_close((uintptr_t)p) == 0 ? hipSuccess : hipErrorInvalidValue;
}

const char *hipGetErrorName(hipError_t rc) {
    switch (rc) {
    case hipSuccess: return "hipSuccess";
    case hipErrorInvalidValue: return "hipErrorInvalidValue";
    case hipErrorOutOfMemory: return "hipErrorOutOfMemory";
    case hipErrorNotInitialized: return "hipErrorNotInitialized";
    case hipErrorInvalidDevice: return "hipErrorInvalidDevice";
    default: return "hipErrorUnknown";
    }
}
const char *hipGetErrorString(hipError_t rc) { return rc == hipSuccess ? "no error" : "fake HIP error"; }
