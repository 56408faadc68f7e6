/* Device memory for the fake GPU drivers (fake_cuda.c, fake_hip.c), over host memory.
 *
 * Each fake device owns a reserved address range handed out as "device" addresses,
 * mapped PROT_NONE so any CPU access faults as it would on a real GPU, and a second
 * reserved range of the same size (the shadow) where the driver really copies. Every
 * allocation is its own memfd mapped at the same offset into both ranges, which is
 * what makes the cross-process features real:
 *   - an IPC handle names the exporting process, the allocation's fd in it and its
 *     size; another process opens /proc/<pid>/fd/<fd> and maps the same pages into its
 *     own device range (same process: refused, as CUDA does);
 *   - a dma-buf export is a dup of the allocation's memfd (offset 0 = allocation base).
 * It also holds what both fakes share besides: one-time initialization and "pinned"
 * host memory (heap memory that pointer queries report as host memory).
 * Both take allocation bases only, like the real drivers' handles name allocations;
 * callers find the base with the address-range query. */
#ifndef FAKE_GPU_MEM_H
#define FAKE_GPU_MEM_H

#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define NDEV 2
#define DEV_BYTES ((size_t)256 << 20)
#define MAX_ALLOCS 4096
#define MAX_PINNED 1024

struct gpu_alloc {
    uint64_t base; /* 0: free slot */
    size_t len;
    int dev;
    int fd;        /* the allocation's memfd; -1 for an imported mapping */
};

static int gpu_initialized;
static struct { uint8_t *p; size_t len; } pinned[MAX_PINNED];
static uint8_t *dev_view[NDEV];
static uint8_t *dev_shadow[NDEV];
static size_t dev_used[NDEV];
static struct gpu_alloc allocs[MAX_ALLOCS];
static int alloc_lock;

static void lock_allocs(void) { while (__atomic_exchange_n(&alloc_lock, 1, __ATOMIC_ACQUIRE)) {} }
static void unlock_allocs(void) { __atomic_store_n(&alloc_lock, 0, __ATOMIC_RELEASE); }

static int gpu_mem_init(void);

/* Initializes the fake devices once, whichever thread asks first; 0 on success. */
static int gpu_init_once(void) {
    static int busy;
    int rc = 0;
    if (__atomic_load_n(&gpu_initialized, __ATOMIC_ACQUIRE)) return 0;
    while (__atomic_exchange_n(&busy, 1, __ATOMIC_ACQUIRE)) {}
    if (!gpu_initialized) {
        rc = gpu_mem_init();
        if (rc == 0) __atomic_store_n(&gpu_initialized, 1, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&busy, 0, __ATOMIC_RELEASE);
    return rc;
}

static int gpu_ready(void) { return __atomic_load_n(&gpu_initialized, __ATOMIC_ACQUIRE); }

/* "Pinned" host memory: heap memory the pointer queries report as host memory. */
static void *pinned_alloc(size_t n) {
    void *p = malloc(n);
    if (!p) return NULL;
    for (int i = 0; i < MAX_PINNED; i++) {
        uint8_t *expected = NULL;
        if (__atomic_compare_exchange_n(&pinned[i].p, &expected, (uint8_t *)p, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            pinned[i].len = n;
            return p;
        }
    }
    free(p);
    return NULL;
}

static int pinned_free(void *p) {
    for (int i = 0; i < MAX_PINNED; i++)
        if (p && pinned[i].p == p) {
            pinned[i].len = 0;
            __atomic_store_n(&pinned[i].p, NULL, __ATOMIC_SEQ_CST);
            free(p);
            return 0;
        }
    return -1;
}

static int is_pinned(uint64_t p) {
    for (int i = 0; i < MAX_PINNED; i++)
        if (pinned[i].p && p >= (uint64_t)(uintptr_t)pinned[i].p &&
            p < (uint64_t)(uintptr_t)pinned[i].p + pinned[i].len)
            return 1;
    return 0;
}

static int gpu_mem_init(void) {
    for (int d = 0; d < NDEV; d++) {
        int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
        dev_view[d] = mmap(NULL, DEV_BYTES, PROT_NONE, flags, -1, 0);
        dev_shadow[d] = mmap(NULL, DEV_BYTES, PROT_NONE, flags, -1, 0);
        if (dev_view[d] == MAP_FAILED || dev_shadow[d] == MAP_FAILED) return -1;
        dev_used[d] = 4096; /* never hand out the base: keeps 0 offsets obviously wrong */
    }
    return 0;
}

/* The allocation holding all of [p, p+len), or NULL. Caller holds the lock. */
static struct gpu_alloc *find_alloc(uint64_t p, size_t len) {
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct gpu_alloc *a = &allocs[i];
        if (a->base && p >= a->base && p < a->base + a->len && len <= a->base + a->len - p) return a;
    }
    return NULL;
}

/* The device whose memory holds all of [p, p+len), or -1. */
static int dev_of(uint64_t p, size_t len) {
    lock_allocs();
    struct gpu_alloc *a = find_alloc(p, len ? len : 1);
    int d = a ? a->dev : -1;
    unlock_allocs();
    return d;
}

/* Where the driver really reads and writes device address p (p must be device memory). */
static uint8_t *shadow(uint64_t p) {
    for (int d = 0; d < NDEV; d++) {
        uint64_t base = (uint64_t)(uintptr_t)dev_view[d];
        if (p >= base && p < base + DEV_BYTES) return dev_shadow[d] + (p - base);
    }
    return NULL;
}

/* Maps fd (len bytes) at a fresh spot of device dev's ranges; returns the device address. */
static uint64_t map_into(int dev, int fd, size_t len, int own_fd) {
    size_t rounded = (len + 4095) & ~(size_t)4095;
    size_t off = __atomic_fetch_add(&dev_used[dev], rounded, __ATOMIC_SEQ_CST);
    if (off + rounded > DEV_BYTES) return 0;
    void *v = mmap(dev_view[dev] + off, rounded, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, 0);
    void *s = mmap(dev_shadow[dev] + off, rounded, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
    if (v == MAP_FAILED || s == MAP_FAILED) return 0;
    uint64_t p = (uint64_t)(uintptr_t)(dev_view[dev] + off);
    lock_allocs();
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (!allocs[i].base) {
            allocs[i] = (struct gpu_alloc){p, len, dev, own_fd};
            unlock_allocs();
            return p;
        }
    unlock_allocs();
    return 0;
}

/* Unmaps an allocation or import by base; the address range stays reserved. */
static int unmap_base(uint64_t p, int imported) {
    lock_allocs();
    struct gpu_alloc *a = find_alloc(p, 1);
    if (!a || a->base != p || (a->fd < 0) != imported) {
        unlock_allocs();
        return -1;
    }
    struct gpu_alloc gone = *a;
    a->base = 0;
    unlock_allocs();
    size_t rounded = (gone.len + 4095) & ~(size_t)4095;
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED;
    mmap((void *)(uintptr_t)p, rounded, PROT_NONE, flags, -1, 0);
    mmap(shadow(p), rounded, PROT_NONE, flags, -1, 0);
    if (gone.fd >= 0) close(gone.fd);
    return 0;
}

static uint64_t gpu_alloc(int dev, size_t n) {
    if (n == 0) return 0;
    int fd = memfd_create("fake-gpu-allocation", MFD_CLOEXEC);
    if (fd < 0) return 0;
    if (ftruncate(fd, (off_t)((n + 4095) & ~(size_t)4095)) != 0) {
        close(fd);
        return 0;
    }
    uint64_t p = map_into(dev, fd, n, fd);
    if (!p) close(fd);
    return p;
}

static int gpu_free(uint64_t p) { return unmap_base(p, 0); }

static int gpu_range(uint64_t p, uint64_t *base, size_t *len) {
    lock_allocs();
    struct gpu_alloc *a = find_alloc(p, 1);
    if (a) {
        *base = a->base;
        *len = a->len;
    }
    unlock_allocs();
    return a ? 0 : -1;
}

/* IPC handle layout (64 bytes): magic[8], pid u32, fd i32, len u64. */
static int gpu_ipc_export(uint64_t p, char handle[64], const char magic[8]) {
    lock_allocs();
    struct gpu_alloc *a = find_alloc(p, 1);
    int ok = a && a->base == p && a->fd >= 0;
    if (ok) {
        uint32_t pid = (uint32_t)getpid();
        uint64_t len = a->len;
        memset(handle, 0, 64);
        memcpy(handle, magic, 8);
        memcpy(handle + 8, &pid, 4);
        memcpy(handle + 12, &a->fd, 4);
        memcpy(handle + 16, &len, 8);
    }
    unlock_allocs();
    return ok ? 0 : -1;
}

/* Maps a handle exported by another process into device dev; 0 on failure. */
static uint64_t gpu_ipc_open(int dev, const char handle[64], const char magic[8]) {
    uint32_t pid;
    int fd;
    uint64_t len;
    if (memcmp(handle, magic, 8) != 0) return 0;
    memcpy(&pid, handle + 8, 4);
    memcpy(&fd, handle + 12, 4);
    memcpy(&len, handle + 16, 8);
    if (pid == (uint32_t)getpid() || len == 0) return 0;
    char path[64];
    snprintf(path, sizeof path, "/proc/%u/fd/%d", pid, fd);
    int mine = open(path, O_RDWR | O_CLOEXEC);
    if (mine < 0) return 0;
    struct stat st;
    uint64_t p = 0;
    if (fstat(mine, &st) == 0 && (uint64_t)st.st_size >= len) p = map_into(dev, mine, len, -1);
    close(mine);
    return p;
}

static int gpu_ipc_close(uint64_t p) { return unmap_base(p, 1); }

/* A dma-buf for [p, p+n): a dup of the allocation's memfd, so p must be its base. */
__attribute__((unused)) static int gpu_dma_buf(uint64_t p, size_t n) {
    lock_allocs();
    struct gpu_alloc *a = find_alloc(p, n);
    int fd = a && a->base == p && a->fd >= 0 ? fcntl(a->fd, F_DUPFD_CLOEXEC, 0) : -1;
    unlock_allocs();
    return fd;
}

#endif
