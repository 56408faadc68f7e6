/*
 * C99 client of transfer_engine_c.h (Mooncake's own C API), driven by
 * tests/te_compat.rs. Written against that header only.
 *
 *   te_compat NAME ADDR SIZE PID
 *       NAME, ADDR, SIZE: segment name, buffer address and size of a running
 *       `mooncake target`; PID: its process id (stopped and continued here to hold a
 *       transfer in flight). Writes pattern 1 over the whole target buffer, reads it
 *       back, checks error returns, runs notifications between two engines of this
 *       process, prints "ok" and exits 0; on any failure says why on stderr and
 *       exits 1.
 */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <inttypes.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#include "transfer_engine_c.h"

/* Seconds any wait may take before the test fails (loaded CI machines are slow). */
#define LIMIT_S 60.0

static void die(const char *fmt, ...) {
    va_list ap;
    fputs("te_compat.c: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

static void expect(long long got, long long want, const char *what) {
    if (got != want) die("%s: got %lld, want %lld", what, got, want);
}

static double now(void) {
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) die("clock_gettime failed");
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static unsigned char pattern(int seed, uint64_t i) {
    return (unsigned char)((i * 131u + (uint64_t)seed * 71u + (i >> 9)) & 0xffu);
}

static void fill(unsigned char *p, uint64_t len, int seed) {
    uint64_t i;
    for (i = 0; i < len; i++) p[i] = pattern(seed, i);
}

static void check(const unsigned char *p, uint64_t len, int seed, const char *what) {
    uint64_t i;
    for (i = 0; i < len; i++) {
        if (p[i] != pattern(seed, i)) {
            die("%s: byte %" PRIu64 " is %u, want %u", what, i, p[i], pattern(seed, i));
        }
    }
}

static uint64_t parse_u64(const char *s, const char *what) {
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (*s == '\0' || *end != '\0') die("bad %s %s", what, s);
    return (uint64_t)v;
}

static void *zalloc(size_t len) {
    void *p = calloc(1, len);
    if (p == NULL) die("out of memory for %zu bytes", len);
    return p;
}

static int is_final(int status) {
    return status == STATUS_COMPLETED || status == STATUS_FAILED ||
           status == STATUS_TIMEOUT || status == STATUS_CANCELED;
}

/* Polls a task until it is final (or fails the test after LIMIT_S). */
static struct transfer_status wait_task(transfer_engine_t e, batch_id_t batch, size_t task) {
    double deadline = now() + LIMIT_S;
    struct transfer_status st;
    for (;;) {
        expect(getTransferStatus(e, batch, task, &st), 0, "getTransferStatus");
        if (is_final(st.status)) return st;
        if (now() > deadline) die("task %zu still in state %d after %.0f s", task, st.status, LIMIT_S);
        sched_yield();
    }
}

static void expect_completed(transfer_engine_t e, batch_id_t batch, size_t task, uint64_t len) {
    struct transfer_status st = wait_task(e, batch, task);
    expect(st.status, STATUS_COMPLETED, "task state");
    expect((long long)st.transferred_bytes, (long long)len, "transferred_bytes");
}

/* 1 when every thread of process pid is stopped, 0 when one is not yet. */
static int all_stopped(pid_t pid) {
    char path[64];
    struct dirent *d;
    DIR *dir;
    int threads = 0, stopped = 0;
    snprintf(path, sizeof path, "/proc/%ld/task", (long)pid);
    dir = opendir(path);
    if (dir == NULL) die("cannot open %s", path);
    while ((d = readdir(dir)) != NULL) {
        char stat_path[512], buf[512];
        const char *paren;
        FILE *f;
        size_t n;
        if (d->d_name[0] == '.') continue;
        snprintf(stat_path, sizeof stat_path, "%s/%s/stat", path, d->d_name);
        f = fopen(stat_path, "r");
        if (f == NULL) continue; /* the thread just exited */
        n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = '\0';
        /* "tid (comm) S ...": the state follows the last ')'. */
        paren = strrchr(buf, ')');
        threads++;
        if (paren != NULL && (paren[2] == 'T' || paren[2] == 't')) stopped++;
    }
    closedir(dir);
    return threads > 0 && stopped == threads;
}

static void stop_process(pid_t pid) {
    double deadline = now() + LIMIT_S;
    if (kill(pid, SIGSTOP) != 0) die("kill(%ld, SIGSTOP) failed", (long)pid);
    while (!all_stopped(pid)) {
        if (now() > deadline) die("process %ld did not stop", (long)pid);
        sched_yield();
    }
}

static transfer_engine_t new_engine(const char *metadata, const char *host, int auto_discover) {
    transfer_engine_t e = createTransferEngine(metadata, "not-used-with-p2p", host, 0, auto_discover);
    if (e == NULL) die("createTransferEngine(%s, %s) failed", metadata, host);
    return e;
}

static struct transfer_request request(int opcode, void *source, segment_id_t target,
                                       uint64_t addr, uint64_t len) {
    struct transfer_request r;
    memset(&r, 0, sizeof r);
    r.opcode = opcode;
    r.source = source;
    r.target_id = target;
    r.target_offset = addr;
    r.length = len;
    return r;
}

int main(int argc, char **argv) {
    const char *peer;
    uint64_t remote, size, half;
    pid_t pid;
    transfer_engine_t a, b;
    transport_t tcp;
    char a_name[128], b_name[128], text[4096];
    unsigned char *wbuf, *rbuf, *spare, *bbuf;
    size_t blen = 64 * 1024;
    segment_id_t seg, seg_b;
    batch_id_t batch;
    struct transfer_request reqs[2];
    struct buffer_entry entries[2];
    void *addrs[2];
    notify_msg_t note, *notes;
    char note_name[] = "te-client", note_msg[] = "hello", kv_name[] = "kv",
         kv_msg[] = "layer-0 ready";
    int n, rc;

    if (argc != 5) die("usage: te_compat NAME ADDR SIZE PID");
    peer = argv[1];
    remote = parse_u64(argv[2], "ADDR");
    size = parse_u64(argv[3], "SIZE");
    pid = (pid_t)parse_u64(argv[4], "PID");
    half = size / 2 + 1;
    if (sizeof(struct transfer_request) != 40 && sizeof(void *) == 8) die("transfer_request is not 40 bytes");

    /* ---- creation: bad arguments give NULL */
    if (createTransferEngine(NULL, NULL, "127.0.0.1", 0, 0) != NULL) die("NULL metadata accepted");
    if (createTransferEngine("zookeeper://127.0.0.1:2181", NULL, "127.0.0.1", 0, 0) != NULL) die("unknown metadata scheme accepted");
    if (createTransferEngine("P2PHANDSHAKE;no_such_key=1", NULL, "127.0.0.1", 0, 0) != NULL) die("bad key accepted");
    if (createTransferEngine("P2PHANDSHAKE", NULL, "127.0.0.1", 70000, 0) != NULL) die("port 70000 accepted");
    if (createTransferEngine("P2PHANDSHAKE", NULL, "0.0.0.0", 0, 0) != NULL) die("0.0.0.0 accepted");

    /* ---- engine A: started by installTransport("tcp") */
    a = new_engine("P2PHANDSHAKE", "localhost", 0);
    if (installTransport(a, "carrier-pigeon", NULL) != NULL) die("unknown protocol installed");
    tcp = installTransport(a, "tcp", NULL);
    if (tcp == NULL) die("installTransport(tcp) failed");
    if (installTransport(a, "tcp", NULL) != tcp) die("second installTransport(tcp) differs");
    if (installTransport(a, "rdma", NULL) != NULL) die("rdma installed on a running tcp engine");
    expect(getLocalIpAndPort(a, a_name, sizeof a_name), 0, "getLocalIpAndPort");
    if (strncmp(a_name, "127.0.0.1:", 10) != 0) die("engine A advertises %s", a_name);
    expect(getLocalIpAndPort(a, text, 4), ERR_INVALID_ARGUMENT, "getLocalIpAndPort, 4 bytes");
    expect(text[0], 0, "buffer emptied");

    /* ---- engine B: started at once by auto_discover */
    b = new_engine("P2PHANDSHAKE;workers=2", "127.0.0.1", 1);
    if (installTransport(b, "tcp", NULL) == NULL) die("installTransport(tcp) on B failed");
    expect(uninstallTransport(b, "tcp"), 0, "uninstallTransport");
    expect(uninstallTransport(b, "tcp"), ERR_INVALID_ARGUMENT, "uninstallTransport twice");
    expect(getLocalIpAndPort(b, b_name, sizeof b_name), 0, "getLocalIpAndPort B");
    if (strncmp(b_name, "127.0.0.1:", 10) != 0) die("engine B advertises %s", b_name);

    /* ---- memory registration */
    wbuf = zalloc(size);
    rbuf = zalloc(size);
    spare = zalloc(4096);
    fill(wbuf, size, 1);
    expect(registerLocalMemory(a, wbuf, size, "cpu:0", 1), 0, "registerLocalMemory");
    expect(registerLocalMemory(a, wbuf + 8, 16, "cpu:0", 1), ERR_ADDRESS_OVERLAPPED, "overlap");
    expect(registerLocalMemory(a, NULL, 16, "cpu:0", 1), ERR_INVALID_ARGUMENT, "NULL addr");
    entries[0].addr = spare;
    entries[0].length = 4096;
    entries[1].addr = wbuf + 64; /* overlaps: the whole batch is undone */
    entries[1].length = 64;
    expect(registerLocalMemoryBatch(a, entries, 2, "*"), ERR_ADDRESS_OVERLAPPED, "batch overlap");
    expect(unregisterLocalMemory(a, spare), ERR_ADDRESS_NOT_REGISTERED, "batch undone");
    entries[1].addr = rbuf;
    entries[1].length = size;
    expect(registerLocalMemoryBatch(a, entries, 2, "*"), 0, "registerLocalMemoryBatch");
    expect(unregisterLocalMemory(a, &n), ERR_ADDRESS_NOT_REGISTERED, "unregister unknown");

    /* ---- segments */
    seg = openSegment(a, peer);
    if (seg <= 0) die("openSegment(%s) gave %d", peer, seg);
    expect(openSegment(a, peer), seg, "openSegment again");
    expect(openSegment(a, a_name), LOCAL_SEGMENT, "own segment");
    expect(openSegment(a, "127.0.0.1:1"), -1, "nobody at port 1");
    expect(openSegment(a, NULL), -1, "NULL name");

    /* ---- write pattern 1 over the target buffer in two tasks, read it back */
    batch = allocateBatchID(a, 2);
    if (batch == INVALID_BATCH) die("allocateBatchID failed");
    reqs[0] = request(OPCODE_WRITE, wbuf, seg, remote, half);
    reqs[1] = request(OPCODE_WRITE, wbuf + half, seg, remote + half, size - half);
    expect(submitTransfer(a, batch, reqs, 2), 0, "submit writes");
    expect_completed(a, batch, 0, half);
    expect_completed(a, batch, 1, size - half);
    expect(freeBatchID(a, batch), 0, "freeBatchID");
    expect(freeBatchID(a, batch), -ERR_INVALID_ARGUMENT, "freeBatchID twice");

    batch = allocateBatchID(a, 1);
    if (batch == INVALID_BATCH) die("allocateBatchID failed");
    reqs[0] = request(OPCODE_READ, rbuf, seg, remote, size);
    expect(submitTransfer(a, batch, reqs, 1), 0, "submit read");
    expect_completed(a, batch, 0, size);
    check(rbuf, size, 1, "read back");
    expect(freeBatchID(a, batch), 0, "freeBatchID read");

    /* ---- error returns: status codes are the negated ERR_* values */
    batch = allocateBatchID(a, 1);
    if (batch == INVALID_BATCH) die("allocateBatchID failed");
    reqs[0] = request(7, rbuf, seg, remote, 16);
    expect(submitTransfer(a, batch, reqs, 1), -ERR_INVALID_ARGUMENT, "opcode 7");
    reqs[0] = request(OPCODE_READ, rbuf, 4242, remote, 16);
    expect(submitTransfer(a, batch, reqs, 1), -ERR_INVALID_ARGUMENT, "unknown segment");
    reqs[0] = request(OPCODE_READ, rbuf, seg, remote + size, 16);
    expect(submitTransfer(a, batch, reqs, 1), -ERR_ADDRESS_NOT_REGISTERED, "unregistered remote range");
    reqs[0] = request(OPCODE_READ, rbuf, seg, remote, 16);
    reqs[1] = request(OPCODE_READ, rbuf + 16, seg, remote + 16, 16);
    expect(submitTransfer(a, batch, reqs, 2), -ERR_TOO_MANY_REQUESTS, "2 tasks in a batch of 1");
    {
        struct transfer_status st;
        expect(getTransferStatus(a, batch, 0, &st), -ERR_INVALID_ARGUMENT, "unsubmitted task");
        expect(getTransferStatus(a, batch + 1000, 0, &st), -ERR_INVALID_ARGUMENT, "unknown batch");
        expect(getTransferStatus(a, batch, 0, NULL), -ERR_INVALID_ARGUMENT, "NULL status");
        expect(getTransferStatus(NULL, batch, 0, &st), -ERR_INVALID_ARGUMENT, "NULL engine");
    }
    expect(freeBatchID(a, batch), 0, "free the unused batch");
    if (allocateBatchID(a, 0) != INVALID_BATCH) die("batch of 0 allocated");
    if (allocateBatchID(NULL, 1) != INVALID_BATCH) die("batch from a NULL engine");

    /* ---- freeBatchID refuses while a task is in flight: the target is stopped, so
     * the read below cannot finish until it continues. */
    memset(rbuf, 0, size);
    stop_process(pid);
    batch = allocateBatchID(a, 1);
    if (batch == INVALID_BATCH) die("allocateBatchID failed");
    reqs[0] = request(OPCODE_READ, rbuf, seg, remote, size);
    rc = submitTransfer(a, batch, reqs, 1);
    if (rc != 0) {
        kill(pid, SIGCONT);
        die("submit to the stopped target: %d", rc);
    }
    rc = freeBatchID(a, batch);
    {
        struct transfer_status st;
        int src = getTransferStatus(a, batch, 0, &st);
        if (kill(pid, SIGCONT) != 0) die("kill(SIGCONT) failed");
        expect(rc, -ERR_BATCH_BUSY, "freeBatchID while busy");
        expect(src, 0, "status while busy");
        if (st.status != STATUS_WAITING && st.status != STATUS_PENDING) die("task state %d while the target is stopped", st.status);
    }
    expect_completed(a, batch, 0, size);
    check(rbuf, size, 1, "read after continuing");
    expect(freeBatchID(a, batch), 0, "freeBatchID after completion");

    /* ---- notifications between A and B */
    seg_b = openSegment(a, b_name);
    if (seg_b <= 0 || seg_b == seg) die("openSegment(B) gave %d", seg_b);
    note.name = note_name;
    note.msg = note_msg;
    expect(genNotifyInEngine(a, (uint64_t)seg_b, note), 0, "genNotifyInEngine");
    note.name = NULL; /* the sender's segment name */
    expect(genNotifyInEngine(a, (uint64_t)seg_b, note), 0, "genNotifyInEngine, no name");
    expect(genNotifyInEngine(a, 4242, note), ERR_INVALID_ARGUMENT, "notify unknown segment");
    notes = getNotifsFromEngine(b, &n);
    expect(n, 2, "notifications at B");
    if (notes == NULL) die("no notification array");
    if (strcmp(notes[0].name, "te-client") != 0 || strcmp(notes[0].msg, "hello") != 0) die("got %s/%s", notes[0].name, notes[0].msg);
    if (strcmp(notes[1].name, a_name) != 0 || strcmp(notes[1].msg, "hello") != 0) die("got %s/%s", notes[1].name, notes[1].msg);
    expect(freeNotifsMsgBuf(notes, n), 0, "freeNotifsMsgBuf");
    n = -1;
    if (getNotifsFromEngine(b, &n) != NULL) die("notifications left at B");
    expect(n, 0, "none left");
    expect(freeNotifsMsgBuf(NULL, 0), 0, "freeNotifsMsgBuf(NULL)");

    /* A write into B with a notification that arrives once the batch is complete. */
    bbuf = zalloc(blen);
    expect(registerLocalMemory(b, bbuf, blen, NULL, 1), 0, "register at B");
    expect(openSegmentNoCache(a, b_name), seg_b, "openSegmentNoCache(B)");
    batch = allocateBatchID(a, 2);
    if (batch == INVALID_BATCH) die("allocateBatchID failed");
    reqs[0] = request(OPCODE_WRITE, wbuf, seg_b, (uint64_t)(uintptr_t)bbuf, blen / 2);
    reqs[1] = request(OPCODE_WRITE, wbuf + blen / 2, seg_b, (uint64_t)(uintptr_t)bbuf + blen / 2, blen / 2);
    note.name = kv_name;
    note.msg = kv_msg;
    expect(submitTransferWithNotify(a, batch, reqs, 2, note), 0, "submitTransferWithNotify");
    expect_completed(a, batch, 0, blen / 2);
    expect_completed(a, batch, 1, blen / 2);
    check(bbuf, blen, 1, "B's buffer");
    notes = getNotifsFromEngine(b, &n);
    expect(n, 1, "completion notification at B");
    if (notes == NULL || strcmp(notes[0].name, "kv") != 0 || strcmp(notes[0].msg, "layer-0 ready") != 0) die("bad completion notification");
    expect(freeNotifsMsgBuf(notes, n), 0, "freeNotifsMsgBuf");
    expect(freeBatchID(a, batch), 0, "freeBatchID notify batch");
    if (getNotifsFromEngine(b, &n) != NULL || n != 0) die("notification sent twice");

    /* ---- closing segments */
    expect(closeSegment(a, seg_b), 0, "closeSegment");
    expect(closeSegment(a, seg_b), ERR_INVALID_ARGUMENT, "closeSegment twice");
    expect(closeSegment(a, LOCAL_SEGMENT), 0, "closeSegment(LOCAL_SEGMENT)");
    batch = allocateBatchID(a, 1);
    if (batch == INVALID_BATCH) die("allocateBatchID failed");
    reqs[0] = request(OPCODE_WRITE, wbuf, seg_b, (uint64_t)(uintptr_t)bbuf, 16);
    expect(submitTransfer(a, batch, reqs, 1), -ERR_INVALID_ARGUMENT, "closed segment");
    /* A local copy through LOCAL_SEGMENT: rbuf is registered at A. */
    memset(rbuf, 0, 4096);
    reqs[0] = request(OPCODE_WRITE, wbuf, LOCAL_SEGMENT, (uint64_t)(uintptr_t)rbuf, 4096);
    expect(submitTransfer(a, batch, reqs, 1), 0, "local copy");
    expect_completed(a, batch, 0, 4096);
    check(rbuf, 4096, 1, "local copy");
    expect(freeBatchID(a, batch), 0, "freeBatchID local");

    /* ---- diagnostics */
    expect(syncSegmentCache(a), 0, "syncSegmentCache");
    expect(openSegmentNoCache(a, peer), seg, "openSegmentNoCache(peer)");
    expect(showLinks(a, text, sizeof text, 1), 0, "showLinks json");
    if (strstr(text, peer) == NULL || text[0] != '{') die("showLinks: %s", text);
    expect(showLinks(a, text, sizeof text, 0), 0, "showLinks text");
    if (strstr(text, peer) == NULL) die("showLinks: %s", text);
    expect(showLinks(a, text, 4, 0), ERR_INVALID_ARGUMENT, "showLinks, 4 bytes");
    expect(getNicLoadStats(a, text, sizeof text), ERR_NOT_IMPLEMENTED, "getNicLoadStats");
    rc = discoverTopology(a);
    if (rc != 0 && rc != ERR_DEVICE_NOT_FOUND) die("discoverTopology: %d", rc);
    expect(removeLocalSegment(a, "nobody"), ERR_INVALID_ARGUMENT,
           "removeLocalSegment of another engine's name");

    /* ---- unregistration */
    addrs[0] = spare;
    addrs[1] = rbuf;
    expect(unregisterLocalMemoryBatch(a, addrs, 2), 0, "unregisterLocalMemoryBatch");
    expect(unregisterLocalMemoryBatch(a, addrs, 2), ERR_ADDRESS_NOT_REGISTERED, "twice");
    expect(unregisterLocalMemory(a, wbuf), 0, "unregisterLocalMemory");
    expect(unregisterLocalMemory(a, wbuf), ERR_ADDRESS_NOT_REGISTERED, "twice");
    expect(unregisterLocalMemory(b, bbuf), 0, "unregister at B");

    enableGracefulShutdown(a);
    destroyTransferEngine(a);
    destroyTransferEngine(b);
    destroyTransferEngine(NULL);
    free(wbuf);
    free(rbuf);
    free(spare);
    free(bbuf);
    puts("ok");
    return 0;
}
