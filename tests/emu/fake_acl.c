/* A fake Ascend runtime (libascendcl) for tests: the subset mooncake calls, over host
 * memory. Same model as fake_cuda.c: device memory is a memfd mapped PROT_NONE at the
 * addresses handed out (CPU access faults) and read-write where this library copies;
 * aclrtMemcpy checks its kind against the address ranges and destMax; copies need a
 * device set on the calling thread (aclrtSetDevice), as the real runtime needs a
 * context; copies are counted (fake_acl_copies). aclrtGetDevice fails on a thread with
 * no device set, as the real one does; aclrtPointerGetAttributes knows device memory
 * only (anything else is "unregistered", pinned host memory included). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int aclError;
enum { ACL_SUCCESS = 0, ACL_ERROR_INVALID_PARAM = 100000, ACL_ERROR_UNINITIALIZE = 100001,
       ACL_ERROR_REPEAT_INITIALIZE = 100002, ACL_ERROR_INVALID_DEVICE = 107001,
       ACL_ERROR_CONTEXT_NULL = 107002, ACL_ERROR_BAD_ALLOC = 200000 };
enum { ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST,
       ACL_MEMCPY_DEVICE_TO_DEVICE };

#define NDEV 2
#define DEV_BYTES ((size_t)256 << 20)

static int initialized;
static uint8_t *dev_view[NDEV];
static uint8_t *dev_shadow[NDEV];
static size_t dev_used[NDEV];
static unsigned long copies;
static __thread int current = -1;
static __thread char last_error[128];

unsigned long fake_acl_copies(void) { return __atomic_load_n(&copies, __ATOMIC_SEQ_CST); }

static aclError fail(aclError rc, const char *why) {
    snprintf(last_error, sizeof last_error, "EE%d: %s", rc, why);
    return rc;
}
static int dev_of(uint64_t p, size_t len) {
    for (int d = 0; d < NDEV; d++) {
        uint64_t base = (uint64_t)(uintptr_t)dev_view[d];
        if (base && p >= base && p < base + DEV_BYTES && len <= base + DEV_BYTES - p) return d;
    }
    return -1;
}
static void *shadow(uint64_t p) {
    int d = dev_of(p, 1);
    return dev_shadow[d] + (p - (uint64_t)(uintptr_t)dev_view[d]);
}

aclError aclInit(const char *config) {
    (void)config;
    if (initialized) return ACL_ERROR_REPEAT_INITIALIZE;
    for (int d = 0; d < NDEV; d++) {
        int fd = memfd_create("fake-acl-device", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, DEV_BYTES) != 0) return fail(ACL_ERROR_BAD_ALLOC, "memfd");
        dev_view[d] = mmap(NULL, DEV_BYTES, PROT_NONE, MAP_SHARED, fd, 0);
        dev_shadow[d] = mmap(NULL, DEV_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (dev_view[d] == MAP_FAILED || dev_shadow[d] == MAP_FAILED) return fail(ACL_ERROR_BAD_ALLOC, "mmap");
        dev_used[d] = 4096;
    }
    initialized = 1;
    return ACL_SUCCESS;
}
#define NEED_INIT() do { if (!initialized) return fail(ACL_ERROR_UNINITIALIZE, "aclInit not called"); } while (0)
#define NEED_DEV() do { NEED_INIT(); if (current < 0) return fail(ACL_ERROR_CONTEXT_NULL, "no device set on this thread"); } while (0)

aclError aclrtGetVersion(int32_t *a, int32_t *b, int32_t *c) { *a = 1; *b = 0; *c = 0; return ACL_SUCCESS; }
aclError aclrtGetDeviceCount(uint32_t *n) { NEED_INIT(); *n = NDEV; return ACL_SUCCESS; }
aclError aclrtSetDevice(int32_t d) {
    NEED_INIT();
    if (d < 0 || d >= NDEV) return fail(ACL_ERROR_INVALID_DEVICE, "bad device");
    current = d;
    return ACL_SUCCESS;
}
aclError aclrtGetDevice(int32_t *d) {
    NEED_DEV();
    *d = current;
    return ACL_SUCCESS;
}
/* aclrtPtrAttributes: location {uint32_t id; int type}, pageSize, rsv[4]. */
typedef struct { uint32_t id; int type; uint32_t page_size; uint32_t rsv[4]; } aclrtPtrAttributes;
enum { ACL_MEM_LOCATION_TYPE_DEVICE = 1, ACL_MEM_LOCATION_TYPE_UNREGISTERED = 2 };
aclError aclrtPointerGetAttributes(const void *p, aclrtPtrAttributes *a) {
    NEED_INIT();
    if (!a) return fail(ACL_ERROR_INVALID_PARAM, "attributes NULL");
    int d = dev_of((uint64_t)(uintptr_t)p, 1);
    memset(a, 0, sizeof *a);
    a->type = d >= 0 ? ACL_MEM_LOCATION_TYPE_DEVICE : ACL_MEM_LOCATION_TYPE_UNREGISTERED;
    a->id = d >= 0 ? (uint32_t)d : 0;
    a->page_size = 4096;
    return ACL_SUCCESS;
}
aclError aclrtMemcpy(void *dst, size_t dst_max, const void *src, size_t n, int kind) {
    NEED_DEV();
    uint64_t d = (uint64_t)(uintptr_t)dst, s = (uint64_t)(uintptr_t)src;
    if (n > dst_max) return fail(ACL_ERROR_INVALID_PARAM, "count > destMax");
    int dd = dev_of(d, n) >= 0, sd = dev_of(s, n) >= 0;
    switch (kind) {
    case ACL_MEMCPY_HOST_TO_DEVICE: if (!dd || dev_of(s, 1) >= 0) return fail(ACL_ERROR_INVALID_PARAM, "HtoD"); memcpy(shadow(d), src, n); break;
    case ACL_MEMCPY_DEVICE_TO_HOST: if (!sd || dev_of(d, 1) >= 0) return fail(ACL_ERROR_INVALID_PARAM, "DtoH"); memcpy(dst, shadow(s), n); break;
    case ACL_MEMCPY_DEVICE_TO_DEVICE: if (!dd || !sd) return fail(ACL_ERROR_INVALID_PARAM, "DtoD"); memmove(shadow(d), shadow(s), n); break;
    default: return fail(ACL_ERROR_INVALID_PARAM, "kind");
    }
    __atomic_add_fetch(&copies, 1, __ATOMIC_SEQ_CST);
    return ACL_SUCCESS;
}
aclError aclrtMallocHost(void **p, size_t n) {
    NEED_DEV();
    *p = malloc(n);
    return *p ? ACL_SUCCESS : fail(ACL_ERROR_BAD_ALLOC, "malloc");
}
aclError aclrtFreeHost(void *p) { free(p); return ACL_SUCCESS; }
aclError aclrtMalloc(void **p, size_t n, int policy) {
    (void)policy;
    NEED_DEV();
    size_t rounded = (n + 4095) & ~(size_t)4095;
    size_t off = __atomic_fetch_add(&dev_used[current], rounded, __ATOMIC_SEQ_CST);
    if (off + rounded > DEV_BYTES) return fail(ACL_ERROR_BAD_ALLOC, "device full");
    *p = dev_view[current] + off;
    return ACL_SUCCESS;
}
aclError aclrtFree(void *p) { return dev_of((uintptr_t)p, 1) >= 0 ? ACL_SUCCESS : fail(ACL_ERROR_INVALID_PARAM, "free"); }
const char *aclGetRecentErrMsg(void) { return last_error[0] ? last_error : NULL; }
