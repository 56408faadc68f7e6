/*
 * C99 client of the mooncake C ABI, driven by tests/capi.rs.
 *
 *   transfer target SIZE
 *       Serves a SIZE-byte registered buffer holding pattern 1. Prints
 *       "ready <segment_name> <buffer_addr>" and waits for stdin to reach EOF; then
 *       prints "notified <from> <msg>" for each notification received and exits 0.
 *   transfer client NAME ADDR SIZE
 *       Reads the target's buffer, checks pattern 1, writes pattern 2 over its first
 *       half and reads it back, checks error paths, notifies the target; exits 0.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mooncake.h"

static const char *role = "?";

static void die(const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "transfer.c %s: ", role);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(1);
}

/* Fails unless `got` equals `want`. */
static void expect(int got, int want, const char *what) {
    if (got != want) {
        die("%s: got %d (%s), want %d (%s)", what, got, mc_error_string(got), want,
            mc_error_string(want));
    }
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

static mc_engine *start_engine(void) {
    mc_config *cfg = mc_config_new();
    mc_engine *engine = NULL;
    if (cfg == NULL) die("mc_config_new returned NULL");
    expect(mc_config_set(cfg, "metadata", "P2PHANDSHAKE"), MC_OK, "set metadata");
    expect(mc_config_set(cfg, "protocol", "tcp"), MC_OK, "set protocol");
    expect(mc_config_set(cfg, "bind_address", "127.0.0.1"), MC_OK, "set bind_address");
    expect(mc_config_set(cfg, "no_such_key", "1"), MC_ERR_INVALID_PARAMS, "unknown key");
    expect(mc_config_set(cfg, "workers", "many"), MC_ERR_INVALID_PARAMS, "bad value");
    expect(mc_config_set(cfg, NULL, "1"), MC_ERR_INVALID_PARAMS, "NULL key");
    expect(mc_engine_new(cfg, &engine), MC_OK, "mc_engine_new");
    mc_config_free(cfg);
    if (engine == NULL) die("mc_engine_new gave no engine");
    return engine;
}

static int target(uint64_t size) {
    mc_engine *engine = start_engine();
    char name[256];
    char from[256];
    char msg[1024];
    char tiny[1];
    unsigned char *buf = (unsigned char *)malloc((size_t)size);
    int rc;
    if (buf == NULL) die("out of memory");
    fill(buf, size, 1);
    expect(mc_register_memory(engine, buf, (size_t)size, NULL), MC_OK, "register");
    expect(mc_register_memory(engine, buf + 1, 1, "cpu:0"), MC_ERR_ADDRESS_OVERLAP,
           "overlapping register");
    expect(mc_engine_segment_name(engine, name, sizeof name), MC_OK, "segment name");
    printf("ready %s %" PRIu64 "\n", name, (uint64_t)(uintptr_t)buf);
    fflush(stdout);

    while (getchar() != EOF) {
    }

    /* A too-small buffer keeps the notification queued. */
    expect(mc_take_notification(engine, tiny, sizeof tiny, msg, sizeof msg),
           MC_ERR_BUFFER_OVERFLOW, "take into a tiny buffer");
    while ((rc = mc_take_notification(engine, from, sizeof from, msg, sizeof msg)) == 1) {
        printf("notified %s %s\n", from, msg);
    }
    expect(rc, 0, "take notification");
    fflush(stdout);

    expect(mc_unregister_memory(engine, buf), MC_OK, "unregister");
    mc_engine_free(engine);
    free(buf);
    return 0;
}

static void run(mc_engine *engine, uint64_t batch, const mc_request *req, size_t task,
                const char *what) {
    mc_task_status_t st;
    expect(mc_submit(engine, batch, req, 1), MC_OK, what);
    expect(mc_batch_wait(engine, batch, 60000), MC_OK, what);
    expect(mc_task_status(engine, batch, task, &st), MC_OK, what);
    expect(st.state, MC_TASK_COMPLETED, what);
    if (st.bytes != req->len) die("%s: moved %" PRIu64 " bytes of %" PRIu64, what, st.bytes, req->len);
}

static int client(const char *name, uint64_t addr, uint64_t size) {
    mc_engine *engine = start_engine();
    unsigned char *local = (unsigned char *)malloc((size_t)size);
    uint64_t half = size / 2;
    uint64_t seg = 0;
    uint64_t batch = 0;
    mc_request req;
    int code;

    if (local == NULL) die("out of memory");
    if (mc_abi_version() != MC_ABI_VERSION) die("abi version %u", (unsigned)mc_abi_version());
    if (mc_version() == NULL || strcmp(mc_version(), MC_VERSION_STRING) != 0) die("version");
    if (sizeof(void *) == 8 && (sizeof(mc_request) != 40 || sizeof(mc_task_status_t) != 16)) {
        die("struct sizes %u %u", (unsigned)sizeof(mc_request), (unsigned)sizeof(mc_task_status_t));
    }
    for (code = -1300; code <= 0; code++) {
        if (mc_error_string(code) == NULL) die("mc_error_string(%d) is NULL", code);
    }
    if (strcmp(mc_error_string(12345), "unknown error") != 0) die("unknown code text");
    if (strcmp(mc_error_string(MC_ERR_INVALID_PARAMS), "unknown error") == 0) die("known code");

    memset(local, 0, (size_t)size);
    expect(mc_register_memory(engine, local, (size_t)size, "cpu:0"), MC_OK, "register local");
    expect(mc_open_segment(engine, name, &seg), MC_OK, "open segment");
    expect(mc_probe(engine, seg), MC_OK, "probe");
    expect(mc_batch_new(engine, 8, &batch), MC_OK, "batch");

    req.op = MC_OP_READ;
    req.local = local;
    req.segment = seg;
    req.remote_addr = addr;
    req.len = size;
    run(engine, batch, &req, 0, "read all");
    check(local, size, 1, "read all");

    fill(local, half, 2);
    req.op = MC_OP_WRITE;
    req.len = half;
    run(engine, batch, &req, 1, "write half");

    memset(local, 0, (size_t)size);
    req.op = MC_OP_READ;
    run(engine, batch, &req, 2, "read back");
    check(local, half, 2, "read back");

    req.len = 0;
    expect(mc_submit(engine, batch, &req, 1), MC_ERR_INVALID_PARAMS, "zero length");
    req.len = 1;
    req.remote_addr = addr + size;
    expect(mc_submit(engine, batch, &req, 1), MC_ERR_ADDRESS_NOT_REGISTERED, "outside");
    req.remote_addr = addr;
    req.op = 7;
    expect(mc_submit(engine, batch, &req, 1), MC_ERR_INVALID_PARAMS, "bad op");
    expect(mc_batch_free(engine, batch + 1000), MC_ERR_BATCH_NOT_FOUND, "unknown batch");
    expect(mc_batch_free(engine, batch), MC_OK, "free batch");

    expect(mc_notify(engine, seg, "hello from C"), MC_OK, "notify");
    expect(mc_unregister_memory(engine, local), MC_OK, "unregister local");
    mc_engine_free(engine);
    free(local);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "target") == 0) {
        role = "target";
        return target(parse_u64(argv[2], "SIZE"));
    }
    if (argc == 5 && strcmp(argv[1], "client") == 0) {
        role = "client";
        return client(argv[2], parse_u64(argv[3], "ADDR"), parse_u64(argv[4], "SIZE"));
    }
    fprintf(stderr, "usage: %s target SIZE | client NAME ADDR SIZE\n", argv[0]);
    return 2;
}
