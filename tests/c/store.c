/*
 * store.c - a C99 client of Mooncake Store through mooncake.h.
 *
 *   store MASTER METADATA   puts 20 keys into a running cluster (as a pure client),
 *                           reads them back in one batch, checks existence, sizes and
 *                           removal, and prints "ok".
 *   store layout            prints the size and field offsets of mc_replicate_config.
 *
 * Exit status 0 on success; on failure the reason is printed to stderr.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mooncake.h"

#define N_KEYS 20

static int fail(const char *what, int rc) {
    fprintf(stderr, "store.c: %s: %d (%s)\n", what, rc, mc_error_string(rc));
    exit(1);
}

static void check(const char *what, int rc, int want) {
    if (rc != want) {
        fprintf(stderr, "store.c: %s: got %d (%s), want %d\n", what, rc, mc_error_string(rc),
                want);
        exit(1);
    }
}

static size_t value_len(int i) { return 1000 + (size_t)i * 4099; }

static unsigned char pattern(int i, size_t j) { return (unsigned char)((size_t)i * 131 + j * 7 + j / 251); }

static void fill(unsigned char *buf, int i) {
    size_t j, n = value_len(i);
    for (j = 0; j < n; j++) buf[j] = pattern(i, j);
}

static int layout(void) {
    printf("layout %zu %zu %zu %zu %zu %zu %zu %zu\n", sizeof(mc_replicate_config),
           offsetof(mc_replicate_config, replica_num), offsetof(mc_replicate_config, hard_pin),
           offsetof(mc_replicate_config, soft_pin),
           offsetof(mc_replicate_config, soft_pin_ttl_ms),
           offsetof(mc_replicate_config, preferred_segments),
           offsetof(mc_replicate_config, preferred_segments_count),
           offsetof(mc_replicate_config, prefer_same_node));
    return 0;
}

int main(int argc, char **argv) {
    mc_config *cfg;
    mc_store *store = NULL;
    mc_replicate_config rc_cfg;
    char names[N_KEYS][32];
    const char *keys[N_KEYS];
    unsigned char *values[N_KEYS];
    unsigned char *reads[N_KEYS];
    size_t lens[N_KEYS], caps[N_KEYS];
    const void *put_bufs[10];
    void *get_bufs[N_KEYS];
    int put_results[10], exist_results[3];
    int64_t get_results[N_KEYS];
    const char *probe[3];
    char host[256];
    uint64_t n = 0, size = 0, len = 0;
    unsigned char small[16];
    int i, rc;

    if (argc == 2 && strcmp(argv[1], "layout") == 0) return layout();
    if (argc != 3) {
        fprintf(stderr, "usage: %s MASTER METADATA | %s layout\n", argv[0], argv[0]);
        return 2;
    }

    cfg = mc_config_new();
    if (!cfg) return fail("mc_config_new", MC_ERR_INTERNAL);
    check("set master_address", mc_config_set(cfg, "master_address", argv[1]), MC_OK);
    check("set metadata", mc_config_set(cfg, "metadata", argv[2]), MC_OK);
    check("set protocol", mc_config_set(cfg, "protocol", "tcp"), MC_OK);
    check("set global_segment_size", mc_config_set(cfg, "global_segment_size", "0"), MC_OK);
    check("set verify_checksum", mc_config_set(cfg, "verify_checksum", "1"), MC_OK);
    check("bad global_segment_size", mc_config_set(cfg, "global_segment_size", "lots"),
          MC_ERR_INVALID_PARAMS);
    rc = mc_store_new(cfg, &store);
    mc_config_free(cfg);
    if (rc != MC_OK || !store) return fail("mc_store_new", rc);
    check("hostname", mc_store_hostname(store, host, sizeof host), MC_OK);

    for (i = 0; i < N_KEYS; i++) {
        sprintf(names[i], "capi-store-%02d", i);
        keys[i] = names[i];
        lens[i] = value_len(i);
        values[i] = malloc(lens[i]);
        caps[i] = lens[i] + 100;
        reads[i] = calloc(1, caps[i]);
        get_bufs[i] = reads[i];
        if (!values[i] || !reads[i]) return fail("malloc", MC_ERR_INTERNAL);
        fill(values[i], i);
    }

    /* Keys 0..9 one by one (odd ones from a registered buffer), 10..19 in a batch. */
    mc_replicate_config_init(&rc_cfg);
    if (rc_cfg.replica_num != 1 || rc_cfg.soft_pin_ttl_ms != 1800000u ||
        rc_cfg.preferred_segments_count != 0)
        return fail("mc_replicate_config_init defaults", MC_ERR_INTERNAL);
    for (i = 0; i < 10; i++) {
        if (i % 2 == 0) {
            check("put", mc_store_put(store, keys[i], values[i], lens[i], &rc_cfg), MC_OK);
        } else {
            check("register", mc_store_register_buffer(store, values[i], lens[i]), MC_OK);
            check("put_from", mc_store_put_from(store, keys[i], values[i], lens[i], NULL), MC_OK);
            check("unregister", mc_store_unregister_buffer(store, values[i]), MC_OK);
        }
    }
    for (i = 0; i < 10; i++) put_bufs[i] = values[10 + i];
    check("batch_put_from",
          mc_store_batch_put_from(store, keys + 10, put_bufs, lens + 10, 10, &rc_cfg, put_results),
          MC_OK);
    for (i = 0; i < 10; i++) check("batch_put_from result", put_results[i], MC_OK);

    /* Everything back in one batch. */
    check("batch_get_into",
          mc_store_batch_get_into(store, keys, get_bufs, caps, N_KEYS, get_results), MC_OK);
    for (i = 0; i < N_KEYS; i++) {
        if (get_results[i] != (int64_t)lens[i]) {
            fprintf(stderr, "store.c: key %d: read %lld bytes, want %zu\n", i,
                    (long long)get_results[i], lens[i]);
            return 1;
        }
        if (memcmp(reads[i], values[i], lens[i]) != 0) {
            fprintf(stderr, "store.c: key %d: bytes differ\n", i);
            return 1;
        }
    }

    /* Single reads, sizes, existence. */
    memset(reads[3], 0, caps[3]);
    check("get_into", mc_store_get_into(store, keys[3], reads[3], caps[3], &len), MC_OK);
    if (len != lens[3] || memcmp(reads[3], values[3], lens[3]) != 0)
        return fail("get_into bytes", MC_ERR_INTERNAL);
    check("get_into small", mc_store_get_into(store, keys[3], small, sizeof small, &len),
          MC_ERR_BUFFER_OVERFLOW);
    check("size", mc_store_size(store, keys[19], &size), MC_OK);
    if (size != lens[19]) return fail("size value", MC_ERR_INTERNAL);
    check("exists", mc_store_exists(store, keys[0]), 1);
    check("exists missing", mc_store_exists(store, "capi-store-missing"), 0);
    check("get missing", mc_store_get_into(store, "capi-store-missing", small, sizeof small, NULL),
          MC_ERR_OBJECT_NOT_FOUND);
    probe[0] = keys[5];
    probe[1] = "capi-store-missing";
    probe[2] = keys[15];
    check("batch_exists", mc_store_batch_exists(store, probe, 3, exist_results), MC_OK);
    if (exist_results[0] != 1 || exist_results[1] != 0 || exist_results[2] != 1)
        return fail("batch_exists results", MC_ERR_INTERNAL);

    /* Removal: key 0 was just read, so it is leased. */
    check("remove leased", mc_store_remove(store, keys[0], 0), MC_ERR_OBJECT_HAS_LEASE);
    check("remove forced", mc_store_remove(store, keys[0], 1), MC_OK);
    check("exists removed", mc_store_exists(store, keys[0]), 0);
    check("remove again", mc_store_remove(store, keys[0], 1), MC_ERR_OBJECT_NOT_FOUND);
    check("remove_by_regex", mc_store_remove_by_regex(store, "^capi-store-1[0-9]$", 1, &n), MC_OK);
    if (n != 10) return fail("remove_by_regex count", (int)n);
    check("remove_all", mc_store_remove_all(store, 1, &n), MC_OK);
    if (n != 9) return fail("remove_all count", (int)n);
    for (i = 0; i < N_KEYS; i++) check("exists after remove_all", mc_store_exists(store, keys[i]), 0);

    mc_store_free(store);
    for (i = 0; i < N_KEYS; i++) {
        free(values[i]);
        free(reads[i]);
    }
    printf("hostname %s\nok\n", host);
    return 0;
}
