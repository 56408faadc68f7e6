/* A fake CUDA driver (libcuda) for tests: the subset mooncake calls, over host memory.
 *
 * Device memory, IPC and dma-buf follow fake_gpu_mem.h (CPU access to device memory
 * faults; IPC works across processes). Pointer queries tell device from host by
 * allocation; copies check their direction against it; every copy is counted
 * (fake_cuda_copies) so tests can prove staging happened, or that none did. Copies,
 * allocations and freeing pinned memory need a current context, as the real driver does. */
#include "fake_gpu_mem.h"
#include <stdlib.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef struct { char reserved[64]; } CUipcMemHandle;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NOT_FOUND = 500,
};

static unsigned long copies, copied_bytes;
static __thread int current = -1;

static void count(size_t n) {
    __atomic_add_fetch(&copies, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&copied_bytes, n, __ATOMIC_SEQ_CST);
}

unsigned long fake_cuda_copies(void) { return __atomic_load_n(&copies, __ATOMIC_SEQ_CST); }
unsigned long fake_cuda_copied_bytes(void) { return __atomic_load_n(&copied_bytes, __ATOMIC_SEQ_CST); }

CUresult cuInit(unsigned flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    return gpu_init_once() == 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

#define NEED_INIT() do { if (!gpu_ready()) return CUDA_ERROR_NOT_INITIALIZED; } while (0)
#define NEED_CTX() do { NEED_INIT(); if (current < 0) return CUDA_ERROR_INVALID_CONTEXT; } while (0)

CUresult cuDriverGetVersion(int *v) { *v = 12040; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *n) { NEED_INIT(); *n = NDEV; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    NEED_INIT();
    if (ordinal < 0 || ordinal >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
    NEED_INIT();
    if (d < 0 || d >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "Fake CUDA Device %d", d);
    return CUDA_SUCCESS;
}
/* Fake devices sit at PCI 0000:1N:00.0 (see the topology tests' sysfs trees). */
CUresult cuDeviceGetPCIBusId(char *id, int len, CUdevice d) {
    NEED_INIT();
    if (d < 0 || d >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(id, (size_t)len, "0000:1%d:00.0", d);
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) {
    NEED_INIT();
    if (d < 0 || d >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
    *ctx = (CUcontext)(uintptr_t)(0x1000 + d);
    return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext ctx) {
    NEED_INIT();
    uintptr_t v = (uintptr_t)ctx;
    if (v == 0) { current = -1; return CUDA_SUCCESS; }
    if (v < 0x1000 || v >= 0x1000 + NDEV) return CUDA_ERROR_INVALID_CONTEXT;
    current = (int)(v - 0x1000);
    return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext *ctx) {
    NEED_INIT();
    *ctx = current < 0 ? NULL : (CUcontext)(uintptr_t)(0x1000 + current);
    return CUDA_SUCCESS;
}
/* Copies here are synchronous: only counted, so tests can see a wait was asked for. */
static unsigned long syncs;
unsigned long fake_cuda_syncs(void) { return __atomic_load_n(&syncs, __ATOMIC_SEQ_CST); }
CUresult cuCtxSynchronize(void) {
    NEED_CTX();
    __atomic_add_fetch(&syncs, 1, __ATOMIC_SEQ_CST);
    return CUDA_SUCCESS;
}

CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    NEED_INIT();
    int d = dev_of(p, 1);
    if (d < 0 && !is_pinned(p)) return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case 2: *(unsigned *)data = d >= 0 ? 2 /* DEVICE */ : 1 /* HOST */; return CUDA_SUCCESS;
    case 9: *(int *)data = d >= 0 ? d : 0; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    NEED_CTX();
    if (dev_of(src, n) < 0 || dev_of((uintptr_t)dst, 1) >= 0) return CUDA_ERROR_INVALID_VALUE;
    memcpy(dst, shadow(src), n);
    count(n);
    return CUDA_SUCCESS;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    NEED_CTX();
    if (dev_of(dst, n) < 0 || dev_of((uintptr_t)src, 1) >= 0) return CUDA_ERROR_INVALID_VALUE;
    memcpy(shadow(dst), src, n);
    count(n);
    return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    NEED_CTX();
    if (dev_of(dst, n) < 0 || dev_of(src, n) < 0) return CUDA_ERROR_INVALID_VALUE;
    memmove(shadow(dst), shadow(src), n);
    count(n);
    return CUDA_SUCCESS;
}

CUresult cuMemHostAlloc(void **pp, size_t n, unsigned flags) {
    (void)flags;
    NEED_CTX();
    *pp = pinned_alloc(n);
    return *pp ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
unsigned long fake_cuda_pinned_buffers(void) {
    unsigned long n = 0;
    for (int i = 0; i < MAX_PINNED; i++) n += __atomic_load_n(&pinned[i].p, __ATOMIC_SEQ_CST) != NULL;
    return n;
}
CUresult cuMemFreeHost(void *p) {
    NEED_CTX();
    return pinned_free(p) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    NEED_CTX();
    *p = gpu_alloc(current, n);
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    NEED_CTX();
    return gpu_free(p) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    NEED_CTX();
    uint64_t b;
    size_t n;
    if (gpu_range(p, &b, &n) != 0) return CUDA_ERROR_NOT_FOUND;
    if (base) *base = b;
    if (size) *size = n;
    return CUDA_SUCCESS;
}

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    NEED_CTX();
    return gpu_ipc_export(p, h->reserved, "FAKECUDA") == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
    (void)flags;
    NEED_CTX();
    *p = gpu_ipc_open(current, h.reserved, "FAKECUDA");
    return *p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    NEED_CTX();
    return gpu_ipc_close(p) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t n, int type, unsigned long long flags) {
    NEED_CTX();
    if (type != 1 || flags != 0 || (p & 4095) != 0) return CUDA_ERROR_INVALID_VALUE;
    *(int *)handle = gpu_dma_buf(p, n);
    return *(int *)handle >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult rc, const char **s) {
    switch (rc) {
    case CUDA_SUCCESS: *s = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "out of memory"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *s = "initialization error"; break;
    case CUDA_ERROR_INVALID_DEVICE: *s = "invalid device ordinal"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *s = "invalid device context"; break;
    case CUDA_ERROR_NOT_FOUND: *s = "named symbol not found"; break;
    default: *s = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}
