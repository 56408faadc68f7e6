/*
 * mooncake.h - stable C ABI of the Mooncake transfer engine (Rust implementation).
 *
 * Link with -lmooncake (shared, SONAME libmooncake.so.0) or with libmooncake.a plus
 * the libraries listed in mooncake.pc (Libs.private). Usable from C99 and C++.
 *
 * Conventions
 *   - Functions returning int give 0 (MC_OK) on success and a negative enum mc_error
 *     value on failure; mc_take_notification also returns 1. mc_error_string() turns a
 *     code into text. The detailed reason of each failure is logged to stderr: the
 *     first mc_config_new or mc_engine_new installs a logger (unless the process has
 *     one already) filtered by the environment variable RUST_LOG (default "warn";
 *     "debug" for more, "off" for silence).
 *   - A NULL pointer where one is required, a string that is not UTF-8, or an unknown
 *     op value gives MC_ERR_INVALID_PARAMS. Outputs are written only on success,
 *     except where a function says otherwise.
 *   - String arguments are copied; none is retained after a call returns.
 *
 * Thread safety
 *   - An mc_engine may be used from any number of threads at once, except that
 *     mc_engine_free must not run concurrently with (or before the end of) any other
 *     call on the same engine.
 *   - An mc_config is a plain value: do not use one from two threads at the same time.
 *     mc_engine_new copies it; the config may be changed or freed afterwards.
 *
 * Memory lifetime
 *   - Memory passed to mc_register_memory must stay valid until mc_unregister_memory on
 *     it returns (or the engine is freed). Peers may read and write it at any time in
 *     between, so treat it as shared with other processes.
 *   - The local buffer of every submitted request must stay valid, and must not be
 *     touched by the program (read requests write it), until that task is final:
 *     mc_batch_wait returned, or mc_task_status reported a final state (CANCELED,
 *     COMPLETED, TIMEOUT, FAILED). The mc_request array itself may be reused as soon
 *     as mc_submit returns.
 *   - A batch can be freed only once all its tasks are final (else MC_ERR_BATCH_BUSY).
 */
#ifndef MOONCAKE_H
#define MOONCAKE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Version of this ABI; bumped on any incompatible change. */
#define MC_ABI_VERSION 1

/* The ABI version the loaded library implements; compare with MC_ABI_VERSION. */
uint32_t mc_abi_version(void);

/* ---------------------------------------------------------------- errors */

/* One error space for the engine and the store. Codes that Mooncake Store also has
 * keep its numbers (engines branch on them: -200 means back-pressure, -704 and -706
 * are routine); engine-only codes live in the -1200 range. */

enum mc_error {
    MC_OK = 0,                               /* success */
    MC_ERR_INTERNAL = -1,                    /* internal error (a bug; details are logged) */
    MC_ERR_BUFFER_OVERFLOW = -10,            /* an output buffer is too small */
    MC_ERR_SEGMENT_NOT_FOUND = -101,         /* segment unknown or never opened */
    MC_ERR_SEGMENT_ALREADY_EXISTS = -102,    /* a segment with this name is already mounted */
    MC_ERR_CLIENT_NOT_FOUND = -103,          /* the master does not know this client */
    MC_ERR_NO_AVAILABLE_HANDLE = -200,       /* no space for the object, even after eviction (back-pressure) */
    MC_ERR_INVALID_VERSION = -300,           /* peer speaks an incompatible protocol version */
    MC_ERR_INVALID_KEY = -400,               /* key empty, too long or not UTF-8 */
    MC_ERR_WRITE_FAIL = -500,                /* writing a replica failed */
    MC_ERR_INVALID_PARAMS = -600,            /* bad argument: NULL, not UTF-8, out of range */
    MC_ERR_ILLEGAL_CLIENT = -601,            /* request from a client the master does not accept */
    MC_ERR_INVALID_WRITE = -700,             /* write to an object that is not being written */
    MC_ERR_INVALID_READ = -701,              /* read of an object that cannot be read */
    MC_ERR_INVALID_REPLICA = -702,           /* replica descriptor is not valid */
    MC_ERR_REPLICA_IS_NOT_READY = -703,      /* the object is still being written */
    MC_ERR_OBJECT_NOT_FOUND = -704,          /* no object under this key */
    MC_ERR_OBJECT_ALREADY_EXISTS = -705,     /* an object under this key exists */
    MC_ERR_OBJECT_HAS_LEASE = -706,          /* the object is leased to a reader; use force */
    MC_ERR_LEASE_EXPIRED = -707,             /* the read outlived its lease; bytes may have been reused */
    MC_ERR_TRANSFER_FAIL = -800,             /* at least one task failed or timed out */
    MC_ERR_CHECKSUM_MISMATCH = -801,         /* the bytes read do not match the object's CRC32C */
    MC_ERR_RPC_FAIL = -900,                  /* a peer's RPC answered with an error */
    MC_ERR_RPC_TIMEOUT = -901,               /* a peer's RPC did not answer in time */
    MC_ERR_ETCD_OPERATION_ERROR = -1000,     /* an etcd operation failed */
    MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS = -1010, /* not possible in the current state */
    MC_ERR_NOT_SUPPORTED = -1012,            /* operation not supported */
    MC_ERR_FILE_NOT_FOUND = -1100,           /* file not found */
    MC_ERR_FILE_OPEN_FAIL = -1101,           /* file open failed */
    MC_ERR_FILE_READ_FAIL = -1102,           /* file read failed */
    MC_ERR_FILE_WRITE_FAIL = -1103,          /* file write failed */
    MC_ERR_ADDRESS_OVERLAP = -1201,          /* range overlaps an already registered buffer */
    MC_ERR_ADDRESS_NOT_REGISTERED = -1202,   /* range is not inside one registered buffer */
    MC_ERR_BATCH_NOT_FOUND = -1203,          /* batch id unknown (never allocated or freed) */
    MC_ERR_BATCH_BUSY = -1204,               /* batch still has unfinished tasks */
    MC_ERR_BATCH_FULL = -1205,               /* more tasks than the batch capacity */
    MC_ERR_TIMEOUT = -1206,                  /* the wait ran out of time */
    MC_ERR_METADATA = -1207,                 /* metadata service or descriptor error */
    MC_ERR_PROTOCOL = -1208,                 /* malformed or unexpected message from a peer */
    MC_ERR_BACKEND_UNAVAILABLE = -1209,      /* the requested transport is not available */
    MC_ERR_IO = -1210                        /* operating-system or network i/o error */
};

/* A static, NUL-terminated description of a code; "unknown error" for unknown codes.
 * Never NULL; never free it. */
const char *mc_error_string(int code);

/* ---------------------------------------------------------------- configuration */

typedef struct mc_config mc_config;

/*
 * Configuration keys for mc_config_set (values are strings):
 *
 *   metadata            Metadata connection: "P2PHANDSHAKE" (peers are found by their
 *                       segment name, host:port; default), "http://host:port/metadata",
 *                       or "embedded" (in-process). Alias: metadata_server.
 *   local_server_name   This engine's segment name. Default "<bind_address>:<rpc_port>".
 *                       With P2PHANDSHAKE the port part is forced to the real RPC port.
 *   bind_address        IP address to listen on. Default "127.0.0.1".
 *   rpc_port            Handshake/RPC port; "0" (default) picks a free one.
 *   protocol            "auto" (default: shared memory to same-host peers, TCP
 *                       otherwise), "tcp" or "shm". "rdma", "efa", "nvlink", ... give
 *                       MC_ERR_BACKEND_UNAVAILABLE in this build.
 *   workers             Transfer worker threads, 1..64. Default 1.
 *   spin_budget         Idle poll iterations before a worker sleeps. Default 256.
 *   lanes_per_peer      TCP connections per peer per worker, 1..64. Default: one per
 *                       two CPU cores, 1..4.
 *   slice_size          Bytes per transfer slice, at least 4096. Default 4194304 (4 MiB).
 *   socket_buffer       SO_SNDBUF/SO_RCVBUF in bytes; 0 (default) keeps kernel tuning.
 *   transfer_timeout_ms Deadline of each task after submit, in ms. Default 30000.
 *   max_retries         Extra attempts per slice after a path failure. Default 2.
 *   cluster_id          Namespace for metadata keys. Default "" (none).
 */

/* A config holding the defaults (NULL only on an internal error). Free it with
 * mc_config_free. */
mc_config *mc_config_new(void);

/* Sets one key. The value is checked at once: an unknown key or bad value gives
 * MC_ERR_INVALID_PARAMS (or MC_ERR_BACKEND_UNAVAILABLE, see protocol) and leaves the
 * config unchanged. */
int mc_config_set(mc_config *cfg, const char *key, const char *value);

/* Frees a config; NULL is ignored. */
void mc_config_free(mc_config *cfg);

/* ---------------------------------------------------------------- engine */

typedef struct mc_engine mc_engine;

/* Starts an engine (listening sockets, worker threads, metadata publication).
 * cfg NULL uses the defaults. On success *out is the engine; on failure *out is NULL. */
int mc_engine_new(const mc_config *cfg, mc_engine **out);

/* Stops the engine, unpublishes it and frees it; NULL is ignored. Registered memory
 * is no longer accessed once this returns. */
void mc_engine_free(mc_engine *engine);

/* Copies the engine's segment name (what peers pass to mc_open_segment) into buf as a
 * NUL-terminated string. MC_ERR_BUFFER_OVERFLOW if len is too small (buf is then
 * set to "" when len > 0). */
int mc_engine_segment_name(mc_engine *engine, char *buf, size_t len);

/* Publishes [addr, addr+len) so that peers can read and write it. location names
 * the memory's placement, e.g. "cpu:0" (the default when NULL). See "Memory lifetime". */
int mc_register_memory(mc_engine *engine, void *addr, size_t len, const char *location);

/* Withdraws the buffer registered at addr; returns once no transfer can touch it. */
int mc_unregister_memory(mc_engine *engine, void *addr);

/* Allocates len zeroed bytes of registered memory owned by the engine and gives its
 * address in *out. Same-host peers copy to and from such memory with a plain memcpy
 * through a shared mapping (the fastest path); release it with mc_free_buffer (or
 * mc_engine_free). location as for mc_register_memory. */
int mc_allocate_buffer(mc_engine *engine, size_t len, const char *location, void **out);

/* Unregisters and releases memory from mc_allocate_buffer. MC_ERR_INVALID_PARAMS if
 * addr did not come from mc_allocate_buffer of this engine. */
int mc_free_buffer(mc_engine *engine, void *addr);

/* Resolves a peer segment by name (cached) and gives its handle in *segment_out. */
int mc_open_segment(mc_engine *engine, const char *name, uint64_t *segment_out);

/* Refetches an opened segment's descriptor (after the peer registered new memory). */
int mc_resync_segment(mc_engine *engine, uint64_t segment);

/* ---------------------------------------------------------------- transfers */

#define MC_OP_READ 0  /* remote -> local */
#define MC_OP_WRITE 1 /* local -> remote */

typedef struct {
    int op;               /* MC_OP_READ or MC_OP_WRITE */
    void *local;          /* local buffer (need not be registered for TCP/shm) */
    uint64_t segment;     /* from mc_open_segment */
    uint64_t remote_addr; /* absolute address inside one buffer the peer registered */
    uint64_t len;         /* bytes, > 0 */
} mc_request;

#define MC_TASK_WAITING 0
#define MC_TASK_PENDING 1
#define MC_TASK_INVALID 2
#define MC_TASK_CANCELED 3
#define MC_TASK_COMPLETED 4
#define MC_TASK_TIMEOUT 5
#define MC_TASK_FAILED 6

typedef struct {
    int state;      /* one of MC_TASK_* */
    uint64_t bytes; /* bytes moved so far (a lower bound while pending) */
} mc_task_status_t;

/* Allocates a batch that can hold capacity tasks (1..1048576) in total. */
int mc_batch_new(mc_engine *engine, size_t capacity, uint64_t *batch_out);

/* Submits n requests as the next n tasks of the batch (task indexes continue from
 * earlier submits, starting at 0). All are validated first: on error none is
 * submitted. See "Memory lifetime" for the local buffers. */
int mc_submit(mc_engine *engine, uint64_t batch, const mc_request *reqs, size_t n);

/* State and byte count of one submitted task. */
int mc_task_status(mc_engine *engine, uint64_t batch, size_t task, mc_task_status_t *out);

/* Waits until every submitted task of the batch is final. timeout_ms < 0 waits without
 * limit. 0 when all completed, MC_ERR_TRANSFER_FAIL when any failed or timed out,
 * MC_ERR_TIMEOUT when the wait ran out first (tasks keep running). */
int mc_batch_wait(mc_engine *engine, uint64_t batch, int64_t timeout_ms);

/* Frees a batch; MC_ERR_BATCH_BUSY while any task is unfinished. */
int mc_batch_free(mc_engine *engine, uint64_t batch);

/* ---------------------------------------------------------------- messages */

/* Sends a short text message to an opened segment's engine (waits for its ack). */
int mc_notify(mc_engine *engine, uint64_t segment, const char *msg);

/* Takes the oldest received notification: copies the sender's segment name into
 * from and the message into msg (both NUL-terminated). Returns 1 if one was taken,
 * 0 if none is queued, MC_ERR_BUFFER_OVERFLOW (the notification stays queued) if
 * either buffer is too small, or another negative error. */
int mc_take_notification(mc_engine *engine, char *from, size_t from_len, char *msg,
                         size_t msg_len);

/* Asks an opened segment's engine whether it is alive: 0 if it answered. */
int mc_probe(mc_engine *engine, uint64_t segment);

#ifdef __cplusplus
}
#endif

#endif /* MOONCAKE_H */
