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
 * Processes
 *   - An mc_engine, mc_store or mc_pg belongs to the process that made it. A child
 *     forked after that inherits the pointer but not the threads behind it, and shares
 *     its connections with the parent, so in the child every call on it fails with
 *     MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS and its _free only releases the handle,
 *     leaving the parent's segment, connections and peers untouched. A child makes
 *     its own handles (or is started with exec, e.g. Python's 'spawn').
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

/* Revision within MC_ABI_VERSION; bumped whenever functions are added (additions never
 * change an existing function or struct). Revision 2 added the functions marked
 * "(revision 2)", revision 3 those marked "(revision 3)", revision 4 Mooncake PG
 * (mc_pg_*) and the store keys ssd_path and ssd_size, revision 5 mc_pg_set_memory
 * (device buffers for Mooncake PG), revision 6 mc_pg_agree_max, revision 7
 * mc_pg_refresh and the store calls marked "(revision 7)", revision 8
 * mc_store_batch_get_alloc, revision 9 mc_host_memory_alloc and mc_host_memory_free,
 * revision 10 mc_store_key_array, revision 11 mc_engine_stats and the engine key
 * upstream_protocol, revision 12 mc_store_batch_get_into_packed and the engine stats
 * key own_copies, revision 13 mc_python_function.
 * A program loading the library at run time checks
 * mc_abi_revision() >= the revision it needs. */
#define MC_ABI_REVISION 13

/* The ABI version the loaded library implements; compare with MC_ABI_VERSION. */
uint32_t mc_abi_version(void);

/* The ABI revision the loaded library implements (revision 11). */
uint32_t mc_abi_revision(void);

/* The release this header ships with (semantic versioning; the ABI is versioned
 * separately above). Compare with mc_version() to see which library was loaded. */
#define MC_VERSION_MAJOR 0
#define MC_VERSION_MINOR 1
#define MC_VERSION_PATCH 0
#define MC_VERSION_STRING "0.1.0"

/* The loaded library's release, "MAJOR.MINOR.PATCH" (a static string, never NULL).
 * (revision 2) */
const char *mc_version(void);

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
 *                       otherwise), "tcp", "shm", "rdma" or "efa" (libfabric). A
 *                       hardware protocol whose library or device is missing here
 *                       (and "nvlink", "cxl", "ascend", ..., which have no backend in
 *                       this build) runs over TCP instead: mc_engine_new logs one
 *                       warning saying what was asked, why it is unavailable and that
 *                       TCP is used (device_name is then ignored), and the engine's own
 *                       descriptor (mc_segment_describe, segment 0) says "protocol":
 *                       "tcp". With the environment variable MC_STRICT_PROTOCOL=1 (read
 *                       by mc_config_new) mc_engine_new fails with
 *                       MC_ERR_BACKEND_UNAVAILABLE instead.
 *   upstream_protocol   A protocol as Mooncake's own API names it (what the Python
 *                       package passes; installTransport does the same): as
 *                       "protocol", and TCP, asked for, forced by MC_FORCE_TCP or
 *                       fallen back to, also reaches same-host peers of ours through
 *                       shared memory, as "auto" does (Mooncake's "tcp" means "no
 *                       RDMA"; other hosts, other network or PID namespaces and
 *                       Mooncake's own engines stay on TCP). The engine still says it
 *                       runs "tcp"; mc_engine_stats tells "same_host_shm". The
 *                       environment variable MC_SAME_HOST_SHM=0, read when this key is
 *                       set, keeps TCP on sockets. (revision 11)
 *   workers             Transfer worker threads, 1..64. Default 1.
 *   spin_budget         Idle poll iterations before a worker sleeps. Default 256.
 *   lanes_per_peer      TCP connections per peer per worker, 1..64. Default: one per
 *                       two CPU cores, 1..4.
 *   slice_size          Bytes per transfer slice, at least 4096. Default 4194304 (4 MiB).
 *   socket_buffer       SO_SNDBUF/SO_RCVBUF in bytes; 0 (default) keeps kernel tuning.
 *   transfer_timeout_ms Deadline of each task after submit, in ms. Default 30000.
 *   max_retries         Extra attempts per slice after a path failure. Default 2.
 *   cluster_id          Namespace for metadata keys. Default "" (none).
 *   device_name         RDMA/EFA devices to use: a comma-separated list ("mlx5_0,mlx5_1")
 *                       or a NIC priority matrix as JSON; "" (default) uses all found.
 *   fabric_provider     libfabric provider for protocol "efa" ("efa", "tcp;ofi_rxm",
 *                       "shm", "sockets"); "" (default) picks the first with RMA.
 *   cluster_secret      The secret every member of the cluster shares: with it, every
 *                       connection to or from this engine (data, handshake RPC, master
 *                       RPC) authenticates first, and HTTP metadata writes are signed;
 *                       peers without it are refused (docs/security.md). "" turns it
 *                       off. Default: the environment variable MC_CLUSTER_SECRET, else
 *                       off (every wire exactly as Mooncake's).
 *   cluster_secret_file As cluster_secret, read from this file (one trailing newline
 *                       is not part of it).
 */

/* A config holding the defaults (NULL only on an internal error). Free it with
 * mc_config_free. */
mc_config *mc_config_new(void);

/* Sets one key. The value is checked at once: an unknown key or bad value gives
 * MC_ERR_INVALID_PARAMS and leaves the config unchanged. */
int mc_config_set(mc_config *cfg, const char *key, const char *value);

/* Frees a config; NULL is ignored. */
void mc_config_free(mc_config *cfg);

/* ---------------------------------------------------------------- engine */

typedef struct mc_engine mc_engine;

/* Starts an engine (listening sockets, worker threads, metadata publication).
 * cfg NULL uses the defaults. On success *out is the engine; on failure *out is NULL. */
int mc_engine_new(const mc_config *cfg, mc_engine **out);

/* Stops the engine, unpublishes it and frees it; NULL is ignored. Registered memory
 * is no longer accessed once this returns (unless a store set up with
 * mc_store_new_with_engine still shares the engine: then once that store is freed). */
void mc_engine_free(mc_engine *engine);

/* Copies the engine's segment name (what peers pass to mc_open_segment) into buf as a
 * NUL-terminated string. MC_ERR_BUFFER_OVERFLOW if len is too small (buf is then
 * set to "" when len > 0). */
int mc_engine_segment_name(mc_engine *engine, char *buf, size_t len);

/* Publishes [addr, addr+len) so that peers can read and write it. location names
 * the memory's placement, e.g. "cpu:0" (the default when NULL); "cuda:N", "hip:N"
 * and "npu:N" declare device memory, checked with the runtime-loaded driver (the CPU
 * never touches it: transports copy it with the driver, map it through CUDA/HIP IPC
 * for same-host peers, or stage it through pinned host buffers). See "Memory
 * lifetime". */
int mc_register_memory(mc_engine *engine, void *addr, size_t len, const char *location);

/* What peers may do with a registered buffer; the engine's own transfers may always
 * read and write it. (revision 3) */
#define MC_ACCESS_READ_WRITE 0 /* peers read and write it (mc_register_memory) */
#define MC_ACCESS_READ_ONLY 1  /* peers read it; their writes are refused */
#define MC_ACCESS_LOCAL 2      /* peers can neither read nor write it */

/* As mc_register_memory, with access one of MC_ACCESS_* (anything else is
 * MC_ERR_INVALID_PARAMS). The engine's TCP server and NIC registrations enforce it;
 * same-host peers of this library honour it, but a process of the same user can
 * always reach this process's memory (docs/security.md). (revision 3) */
int mc_register_memory_with_access(mc_engine *engine, void *addr, size_t len,
                                   const char *location, uint32_t access);

/* Withdraws the buffer registered at addr; returns once no transfer can touch it. */
int mc_unregister_memory(mc_engine *engine, void *addr);

/* Allocates len zeroed bytes of registered memory owned by the engine and gives its
 * address in *out. location as for mc_register_memory: host memory is a shared
 * mapping same-host peers copy with a plain memcpy (the fastest path); a device
 * location allocates from that device's driver. Release it with mc_free_buffer (or
 * mc_engine_free). */
int mc_allocate_buffer(mc_engine *engine, size_t len, const char *location, void **out);

/* Unregisters and releases memory from mc_allocate_buffer. MC_ERR_INVALID_PARAMS if
 * addr did not come from mc_allocate_buffer of this engine. */
int mc_free_buffer(mc_engine *engine, void *addr);

/* A plain allocator pair for callers that take allocation callbacks by address (the
 * Python package's get_alloc_func_addr / get_free_func_addr): len zeroed, page-aligned
 * bytes of host memory (huge pages advised, not registered with any engine), or NULL
 * for len 0 or on failure. (revision 9) */
void *mc_host_memory_alloc(size_t len);

/* Releases memory from mc_host_memory_alloc. NULL, and an address that did not come
 * from it, are ignored. (revision 9) */
void mc_host_memory_free(void *addr);

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

/* Moves n requests and returns once every one is final (each bounded by the engine's
 * transfer_timeout_ms): 0 when all completed, MC_ERR_TRANSFER_FAIL when any failed or
 * timed out, or a submit error (nothing moved). The batch calls in one; the local
 * buffers need only stay valid during the call. (revision 2) */
int mc_transfer_sync(mc_engine *engine, const mc_request *reqs, size_t n);

/* ---------------------------------------------------------------- messages */

/* Sends a short text message to an opened segment's engine (waits for its ack).
 * MC_ERR_NO_AVAILABLE_HANDLE when the receiver had no room for it: an engine queues at
 * most 64 KiB per message (sender name plus text), 4 MiB per sender and 64 MiB in all
 * until they are taken; what does not fit is dropped and counted. */
int mc_notify(mc_engine *engine, uint64_t segment, const char *msg);

/* Takes the oldest received notification: copies the sender's segment name into
 * from and the message into msg (both NUL-terminated). Returns 1 if one was taken,
 * 0 if none is queued, MC_ERR_BUFFER_OVERFLOW (the notification stays queued) if
 * either buffer is too small, or another negative error. */
int mc_take_notification(mc_engine *engine, char *from, size_t from_len, char *msg,
                         size_t msg_len);

/* Asks an opened segment's engine whether it is alive: 0 if it answered. */
int mc_probe(mc_engine *engine, uint64_t segment);

/* As mc_notify, with the sender name the receiver sees set to name instead of this
 * engine's segment name (as Mooncake's notify messages carry an application-given
 * name). (revision 2) */
int mc_notify_as(mc_engine *engine, uint64_t segment, const char *name, const char *msg);

/* ---------------------------------------------------------------- introspection */

/* The port of the engine's handshake/RPC server (what P2PHANDSHAKE peers dial), or a
 * negative error. (revision 2) */
int mc_engine_rpc_port(mc_engine *engine);

/* Copies a segment descriptor as Mooncake's JSON (name, protocol, devices,
 * priority_matrix, buffers: [{name, addr, length, ...}], ...) into buf, NUL-terminated.
 * segment 0 describes this engine's own segment (as published, including its NIC
 * priority matrix); any other value is a handle from mc_open_segment (the cached
 * descriptor; mc_resync_segment refreshes it). *needed_out (may be NULL) receives the
 * bytes needed including the NUL, also on MC_ERR_BUFFER_OVERFLOW (buf is then set to ""
 * when len > 0). (revision 2) */
int mc_segment_describe(mc_engine *engine, uint64_t segment, char *buf, size_t len,
                        size_t *needed_out);

/* Copies the engine's counters as one JSON object into buf, NUL-terminated: bytes moved
 * per transport ("local_bytes", "shm_bytes", "rdma_bytes", "fabric_bytes",
 * "tcp_bytes"), "retries", "failed_slices", "worker_handoffs", "worker_wakeups",
 * "inline_transfers" (synchronous transfers the caller ran itself), "own_copies" (of
 * those, the ones within the engine's own memory, copied with no slice planned;
 * revision 12),
 * "protocol_fallbacks", "tcp_sends", and "protocol", the protocol it runs. needed_out
 * and overflow as for mc_segment_describe. (revision 11) */
int mc_engine_stats(mc_engine *engine, char *buf, size_t len, size_t *needed_out);

/* ---------------------------------------------------------------- store */

/*
 * A client of Mooncake Store: puts and gets immutable objects by key, moving the bytes
 * itself, peer to peer, while the master only hands out places and leases. With a
 * global segment it also lends that much of its own memory to the pool (a "node").
 *
 * Store configuration keys for mc_config_set, on the same mc_config as the engine keys
 * (values are strings; checked at once like the engine keys):
 *
 *   master_address      host:port of the master's RPC. Default "127.0.0.1:50051".
 *   local_hostname      This client's segment name, host:port; the same setting as the
 *                       engine's local_server_name (see there for the default).
 *   global_segment_size Bytes of memory lent to the pool; suffixes K, M, G, T (binary)
 *                       allowed, e.g. "64M". Default 0: a pure client that lends none.
 *   local_buffer_size   Staging buffer for transports that need registered memory;
 *                       same suffixes. Default 16M. TCP and shared memory need none.
 *   verify_checksum     "1" (default): check each object's CRC32C on read (a mismatch
 *                       gives MC_ERR_CHECKSUM_MISMATCH); "0": skip the check.
 *   prefault_segment    "1" (default, unless the environment has MC_STORE_PREFAULT=0):
 *                       from its allocation on, a thread at idle priority commits the
 *                       global segment's memory, front to back, while another CPU
 *                       would stay idle beside it, so puts do not wait for the kernel
 *                       to allocate and zero each fresh page; it stops where the
 *                       machine or the process's memory cgroup would keep less than an
 *                       eighth of its limit (256 MiB to 2 GiB), and the rest is
 *                       committed on first use. "0": all of it on first use. Also
 *                       "true"/"false", "on"/"off".
 *   ssd_path            With a global segment: a directory for this node's disk tier,
 *                       where objects evicted from its memory go and are read back from
 *                       (kept across restarts). Default none.
 *   ssd_size            Bytes the disk tier may use; suffixes as above. Default four
 *                       times global_segment_size, at least 1G.
 *
 * The engine keys apply to the store's own transfer engine, with one difference:
 *
 *   metadata            Default for a store: the metadata server the master reports
 *                       (its embedded one, on whatever port it uses; a master too old
 *                       to say gives "http://<host of master_address>:8080/metadata",
 *                       one running none makes mc_store_new fail). Setting the key
 *                       (even to "P2PHANDSHAKE") overrides that.
 *   protocol            As for the engine; "auto" by default.
 *
 * Keys
 *   A key is a NUL-terminated UTF-8 string of 1 to MC_STORE_MAX_KEY_LEN bytes; an
 *   empty, longer or non-UTF-8 key gives MC_ERR_INVALID_KEY (a NULL key pointer gives
 *   MC_ERR_INVALID_PARAMS). Values are at least 1 byte (a zero length gives
 *   MC_ERR_INVALID_PARAMS) and immutable: putting a key that exists succeeds and leaves
 *   the stored value unchanged.
 *
 * Leases
 *   Reading an object (mc_store_get_into, mc_store_batch_get_into, mc_store_size)
 *   leases it for a while (the master's lease TTL, 10 s by default); removing a leased
 *   object gives MC_ERR_OBJECT_HAS_LEASE unless forced. Existence checks take no lease.
 *
 * Routine codes
 *   MC_ERR_OBJECT_NOT_FOUND (-704) no object under the key; MC_ERR_OBJECT_HAS_LEASE
 *   (-706) see Leases; MC_ERR_NO_AVAILABLE_HANDLE (-200) the pool is full even after
 *   eviction (back-pressure: retry later); MC_ERR_BUFFER_OVERFLOW (-10) a read buffer is
 *   smaller than the object (mc_store_size tells its size).
 *
 * Batches
 *   The batch functions take arrays of n elements (NULL allowed only when n is 0) and
 *   return 0 when the batch was processed, the outcome of each key then being in
 *   results[i]; a negative return is a failure of the whole call (a NULL store or
 *   array, a bad mc_replicate_config) and leaves results untouched. A NULL key or
 *   buffer element fails only its own key (MC_ERR_INVALID_PARAMS).
 *
 * Thread safety and lifetime
 *   - An mc_store may be used from any number of threads at once, except that
 *     mc_store_free must not run concurrently with (or before the end of) any other call
 *     on the same store. mc_store_new copies the config.
 *   - Buffers passed to put and get calls are used only during the call: it returns
 *     once the bytes have moved. A get buffer must not be touched by the program during
 *     the call.
 *   - Memory passed to mc_store_register_buffer must stay valid until
 *     mc_store_unregister_buffer on it returns (or the store is freed).
 */

/* The longest key, in bytes. */
#define MC_STORE_MAX_KEY_LEN 4096

typedef struct mc_store mc_store;

/* How an object is stored. Fill with mc_replicate_config_init, then change fields; a
 * NULL mc_replicate_config pointer means the defaults. */
typedef struct {
    uint32_t replica_num;                  /* copies on distinct segments, >= 1 (default
                                              1); best effort: fewer when space lacks */
    int hard_pin;                          /* nonzero: never evicted (default 0) */
    int soft_pin;                          /* nonzero: evicted only after every unpinned
                                              object, until soft_pin_ttl_ms passes */
    uint64_t soft_pin_ttl_ms;              /* default 1800000 (30 min); capped at 24 h */
    const char *const *preferred_segments; /* segment names to try first, in order */
    size_t preferred_segments_count;       /* entries in preferred_segments (default 0) */
    int prefer_same_node;                  /* nonzero: the writer's own segment, when
                                              it has one, is tried right after
                                              preferred_segments (default 0) */
} mc_replicate_config;

/* Fills *cfg with the defaults: 1 replica, no pins, soft-pin TTL 30 min, no
 * preferences. NULL is ignored. */
void mc_replicate_config_init(mc_replicate_config *cfg);

/* Connects to the master (and, with a global_segment_size, mounts that much memory
 * into the pool). cfg NULL uses the defaults. On success *out is the store; on failure
 * *out is NULL. */
int mc_store_new(const mc_config *cfg, mc_store **out);

/* As mc_store_new, but the store moves bytes with engine instead of starting its own
 * (Mooncake's setup(..., engine=)): its segment name is the engine's, memory the engine
 * registered serves zero-copy calls, and the engine keys of cfg are not used. The
 * engine keeps running until both mc_engine_free and mc_store_free of every store
 * sharing it have been called. (revision 2) */
int mc_store_new_with_engine(const mc_config *cfg, mc_engine *engine, mc_store **out);

/* Unmounts the store's segment (objects whose only replica was there are lost),
 * disconnects and frees the store; NULL is ignored. */
void mc_store_free(mc_store *store);

/* Stores len bytes at buf under key. cfg NULL: defaults. */
int mc_store_put(mc_store *store, const char *key, const void *buf, size_t len,
                 const mc_replicate_config *cfg);

/* As mc_store_put, for a buffer registered with mc_store_register_buffer: transports
 * that move bytes from registered memory only (RDMA) need that. With TCP and shared
 * memory (this build) any buffer works. */
int mc_store_put_from(mc_store *store, const char *key, const void *buf, size_t len,
                      const mc_replicate_config *cfg);

/* Reads the object under key into buf (cap bytes) and gives its size in *len_out
 * (len_out may be NULL). MC_ERR_BUFFER_OVERFLOW if cap is smaller than the object. */
int mc_store_get_into(mc_store *store, const char *key, void *buf, size_t cap,
                      uint64_t *len_out);

/* 1 if an object is stored under key, 0 if not, or a negative error. Takes no lease. */
int mc_store_exists(mc_store *store, const char *key);

/* The size in bytes of the object under key, in *size_out. Leases the object. */
int mc_store_size(mc_store *store, const char *key, uint64_t *size_out);

/* Removes the object under key. A leased object only when force is nonzero (else
 * MC_ERR_OBJECT_HAS_LEASE). */
int mc_store_remove(mc_store *store, const char *key, int force);

/* Removes every object, skipping leased ones unless force is nonzero; the number
 * removed in *removed_out (removed_out may be NULL). */
int mc_store_remove_all(mc_store *store, int force, uint64_t *removed_out);

/* As mc_store_remove_all, for the keys matching the regular expression pattern
 * (anywhere in the key unless anchored with ^ and $). A bad pattern gives
 * MC_ERR_INVALID_PARAMS. */
int mc_store_remove_by_regex(mc_store *store, const char *pattern, int force,
                             uint64_t *removed_out);

/* Registers [addr, addr+len) for zero-copy puts and gets (see mc_store_put_from).
 * See "Thread safety and lifetime". */
int mc_store_register_buffer(mc_store *store, void *addr, size_t len);

/* Withdraws the buffer registered at addr. */
int mc_store_unregister_buffer(mc_store *store, void *addr);

/* Copies the store's segment name (host:port) into buf as a NUL-terminated string.
 * MC_ERR_BUFFER_OVERFLOW if len is too small (buf is then set to "" when len > 0). */
int mc_store_hostname(mc_store *store, char *buf, size_t len);

/* Puts n keys, key i from lens[i] bytes at bufs[i], in one round trip to the master;
 * results[i] is 0 or a negative error. See "Batches". */
int mc_store_batch_put_from(mc_store *store, const char *const *keys,
                            const void *const *bufs, const size_t *lens, size_t n,
                            const mc_replicate_config *cfg, int *results);

/* Reads n keys, key i into bufs[i] (caps[i] bytes); results[i] is the number of bytes
 * read (the object's size) or a negative error. See "Batches". */
int mc_store_batch_get_into(mc_store *store, const char *const *keys, void *const *bufs,
                            const size_t *caps, size_t n, int64_t *results);

/* Existence of n keys: results[i] is 1, 0 or a negative error. See "Batches". */
int mc_store_batch_exists(mc_store *store, const char *const *keys, size_t n,
                          int *results);

/* A key array for the batch calls from n keys packed end to end in packed[0..len],
 * each followed by one NUL (so packed[len - 1] is NUL): out[i] points at key i inside
 * packed. MC_OK, or nothing written and a negative code: MC_ERR_INVALID_PARAMS when
 * packed holds another number of strings (a key with a NUL inside, say) or does not end
 * in NUL, MC_ERR_INVALID_KEY when a key is empty, longer than MC_STORE_MAX_KEY_LEN or
 * not UTF-8; which of the two a packing with both faults gives is unspecified. For
 * bindings, whose own loop over the keys costs more than the call. (revision 10) */
int mc_store_key_array(const char *packed, size_t len, size_t n, const char **out);

/* mc_store_batch_get_into for a batch whose keys come packed as for mc_store_key_array,
 * when the batch is regular: every key one the store takes, and every buffer (bufs[i],
 * caps[i] bytes) inside one of the n_allowed [start, end) ranges given as 2 * n_allowed
 * uint64_t at allowed (a binding passes the memory its user registered). Then as
 * mc_store_batch_get_into: MC_OK, results[i] the bytes read or a negative error (the
 * buffers must not overlap one another).
 * Otherwise nothing is read or written, no warning is logged, and the code says why:
 * mc_store_key_array's codes for the packing, MC_ERR_ADDRESS_NOT_REGISTERED for a
 * buffer outside the ranges (or NULL); a binding then answers the batch key by key. For
 * bindings, whose own per-key conversions cost more than the call. (revision 12) */
int mc_store_batch_get_into_packed(mc_store *store, const char *packed, size_t len,
                                   size_t n, void *const *bufs, const size_t *caps,
                                   const uint64_t *allowed, size_t n_allowed,
                                   int64_t *results);

/* For the Python package only: the definition (a PyMethodDef, which the package makes
 * a function object of with PyCFunction_NewEx) of the built-in function `name` this
 * library implements in CPython's own calling convention, where a ctypes call costs
 * more than the work. At present "batch_get_into": as mc_store_batch_get_into_packed,
 * read from the Python lists themselves, the GIL given up during the read; None when
 * the batch is not regular. NULL when there is no such function or the process is not
 * a CPython interpreter whose C API the library finds. (revision 13) */
const void *mc_python_function(const char *name);

/* ------------------------------------------------ store, revision 2 */

/* Extra settings of a put beyond mc_replicate_config. Fill with mc_put_options_init. */
typedef struct {
    const char *const *group_ids; /* groups (objects sharing lease and eviction fate)
                                     that every key of the call joins, NULL when
                                     group_ids_count is 0. Upstream's Python API gives
                                     one id per key instead: split such a batch by id
                                     (the Python package does) */
    size_t group_ids_count;
    int upsert;                   /* nonzero: replace an existing value (refused with
                                     MC_ERR_OBJECT_HAS_LEASE while a reader holds its
                                     lease) instead of keeping it */
} mc_put_options;

/* Fills *opts with the defaults: no group, no upsert. NULL is ignored. (revision 2) */
void mc_put_options_init(mc_put_options *opts);

/* Puts n keys, each from one or more buffers whose bytes concatenate to the value: key
 * i takes the next counts[i] entries of bufs/lens (so bufs and lens hold the sum of
 * counts entries; a key with counts[i] == 0 fails with MC_ERR_INVALID_PARAMS). One round
 * trip to the master. results[i] is 0 or a negative error. opts NULL: defaults. See
 * "Batches". (revision 2) */
int mc_store_batch_put_parts(mc_store *store, const char *const *keys, size_t n,
                             const void *const *bufs, const size_t *lens,
                             const size_t *counts, const mc_replicate_config *cfg,
                             const mc_put_options *opts, int *results);

/* Reads n keys, each into one or more buffers filled in order: key i takes the next
 * counts[i] entries of bufs/caps. results[i] is the object's size (bytes read) or a
 * negative error (MC_ERR_BUFFER_OVERFLOW when the buffers together are smaller than the
 * object). See "Batches". (revision 2) */
int mc_store_batch_get_parts(mc_store *store, const char *const *keys, size_t n,
                             void *const *bufs, const size_t *caps, const size_t *counts,
                             int64_t *results);

/* Reads byte ranges of n objects: key i takes the next counts[i] ranges, range j copying
 * the object's bytes [offsets[j], offsets[j] + lens[j]) into bufs[j]. A range past the
 * object's end fails the key with MC_ERR_INVALID_PARAMS. results[i] is the bytes read for
 * key i (the sum of its ranges) or a negative error. Checksums cover whole objects, so
 * ranges are not checked against them. See "Batches". (revision 2) */
int mc_store_batch_get_ranges(mc_store *store, const char *const *keys, size_t n,
                              void *const *bufs, const uint64_t *offsets,
                              const uint64_t *lens, const size_t *counts,
                              int64_t *results);

/* Removes n keys (leased ones only when force is nonzero); results[i] is 0 or a
 * negative error (MC_ERR_OBJECT_NOT_FOUND, MC_ERR_OBJECT_HAS_LEASE, ...). See "Batches".
 * (revision 2) */
int mc_store_batch_remove(mc_store *store, const char *const *keys, size_t n, int force,
                          int *results);

/* Drops replicas of n keys: with segment NULL or "" every replica (the object is
 * removed), else only the replica on that segment (the object is removed when it was
 * the last one). Leased and unfinished objects are left alone. results[i] is 1 if
 * something was dropped, 0 if not (not found, leased, no replica there), or a negative
 * error. See "Batches". (revision 2) */
int mc_store_batch_replica_clear(mc_store *store, const char *const *keys, size_t n,
                                 const char *segment, int *results);

/* Copies where the object under key lives as JSON into buf, NUL-terminated:
 * {"size": N, "replicas": [{"kind": "memory", "status": "complete",
 *   "pieces": [{"segment": S, "addr": A, "len": L}, ...]}, ...]}
 * (pieces concatenate to the value; more than one when the object is striped), then,
 * when a node's disk tier holds a copy, {"kind": "local_disk", "status": "complete",
 * "segment": S, "object_size": N} (an object only on disk has that replica alone).
 * Leases the memory replicas like a read; reads nothing back from disk.
 * *needed_out as for mc_segment_describe. (revision 2) */
int mc_store_replica_desc(mc_store *store, const char *key, char *buf, size_t len,
                          size_t *needed_out);

/* Reads the object under key into memory the library allocates (one round trip, for
 * callers that do not know its size): the address into *buf_out, the size into
 * *len_out. Release it with mc_store_buffer_free(*buf_out, *len_out). (revision 2) */
int mc_store_get_buffer(mc_store *store, const char *key, void **buf_out,
                        uint64_t *len_out);

/* Releases memory from mc_store_get_buffer; NULL is ignored. (revision 2) */
void mc_store_buffer_free(void *buf, uint64_t len);

/* Memory for key index of a batch read: size writable bytes, kept until the read
 * returns, or NULL for none. Called on the reading thread; must not call the store.
 * (revision 8) */
typedef void *(*mc_alloc_fn)(void *ctx, size_t index, uint64_t size);

/* Reads n keys, each into the memory alloc(ctx, i, size) gives once its size is known,
 * in one round trip to the master for all: results[i] is the size read or a negative
 * error (MC_ERR_INVALID_PARAMS where alloc gave NULL). alloc is called at most twice
 * per key: a key whose kept replica descriptor failed is looked up and placed again,
 * and its last memory gets the bytes. A NULL alloc fails the call. See "Batches".
 * (revision 8) */
int mc_store_batch_get_alloc(mc_store *store, const char *const *keys, size_t n,
                             mc_alloc_fn alloc, void *ctx, int64_t *results);

/* 0 when the master answers, else a negative error (MC_ERR_RPC_FAIL, ...). (revision 2) */
int mc_store_health(mc_store *store);

/* ---------------------------------------------------------------------------------
 * Store sessions, extra segments, disk tier and tasks (revision 7).
 *
 * Put sessions: mc_store_put_session_start reserves each key for sizes[i] bytes (one
 * master round trip; MC_ERR_INVALID_PARAMS for a key that has a session already, the
 * master's code otherwise, e.g. MC_ERR_OBJECT_ALREADY_EXISTS); the object stays
 * invisible to readers. mc_store_put_session_write then writes byte ranges into it with
 * no master round trip: key i takes the next counts[i] entries of bufs/offsets/lens,
 * writing lens[j] bytes from bufs[j] at object offset offsets[j]; results[i] is the
 * bytes written, or a negative code (MC_ERR_INVALID_PARAMS for no open session or a
 * range past the object's end). mc_store_put_session_end makes the objects readable
 * (with the CRC32C of what was written: folded from the ranges when they cover the
 * object exactly once, else read back once) and ends the sessions;
 * mc_store_put_session_revoke drops the objects and ends the sessions (an object the
 * master no longer has counts as dropped). Both first stop new range writes and wait
 * for those in flight; a key whose end or revoke fails keeps its session.
 *
 * Get sessions: mc_store_get_session_start looks each key up once and keeps its
 * descriptor with the read lease that came with it; mc_store_get_session_read reads
 * byte ranges (as mc_store_batch_get_ranges) from it with no master round trip;
 * results[i] is the bytes read or a negative code (MC_ERR_INVALID_PARAMS for no
 * session, MC_ERR_LEASE_EXPIRED once its lease is over, which ends the session).
 * mc_store_get_session_end ends sessions.
 *
 * Extra segments: memory lent to the pool besides the global segment, mounted under an
 * id the call writes into id_buf ("<client>-<n>", at most 42 bytes with the NUL;
 * MC_ERR_BUFFER_OVERFLOW, and nothing stays mounted, if id_len is smaller). Peers reach
 * it under the store's segment name, which names all its segments for placement
 * (preferred segments, copy and move targets). An unmount with grace_ms > 0 stops new
 * placements at once and unmounts (freeing or unmapping the memory) that much later;
 * objects there stay readable meanwhile and are gone after. MC_ERR_SEGMENT_NOT_FOUND
 * for an id this store did not mount that way. mc_store_free unmounts every one.
 *
 * Tasks: a copy adds a replica of key on each target segment (a target holding one is
 * left as it is); a move takes the replica on source to target. Creating one checks
 * the request with the master at once, which places the new replicas and leases the
 * object: MC_ERR_INVALID_PARAMS (no target, one named twice or not mounted, a source
 * holding no replica or equal to the target), MC_ERR_OBJECT_NOT_FOUND,
 * MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS (a target taking no new objects). The store's
 * task thread then copies the bytes through a staging buffer, in creation order. The
 * id is two u64s; only the store that created a task knows it. */

/* Reserves n keys of sizes[i] bytes for put sessions. cfg and opts as for
 * mc_store_batch_put_parts (opts->upsert must be 0). results[i]: 0 or a negative code.
 * See "Batches". (revision 7) */
int mc_store_put_session_start(mc_store *store, const char *const *keys, size_t n,
                               const uint64_t *sizes, const mc_replicate_config *cfg,
                               const mc_put_options *opts, int *results);

/* Writes byte ranges into objects of open put sessions; results[i]: bytes written or a
 * negative code. Each buffer must be readable for its length during the call.
 * (revision 7) */
int mc_store_put_session_write(mc_store *store, const char *const *keys, size_t n,
                               const void *const *bufs, const uint64_t *offsets,
                               const uint64_t *lens, const size_t *counts,
                               int64_t *results);

/* Makes the objects of put sessions readable and ends the sessions; results[i]: 0 or a
 * negative code. (revision 7) */
int mc_store_put_session_end(mc_store *store, const char *const *keys, size_t n,
                             int *results);

/* Drops the objects of put sessions and ends the sessions; results[i]: 0 or a negative
 * code. (revision 7) */
int mc_store_put_session_revoke(mc_store *store, const char *const *keys, size_t n,
                                int *results);

/* Opens get sessions; results[i]: 0 or a negative code (MC_ERR_OBJECT_NOT_FOUND, ...).
 * A key with a session gets a fresh one. (revision 7) */
int mc_store_get_session_start(mc_store *store, const char *const *keys, size_t n,
                               int *results);

/* Reads byte ranges of objects with get sessions, as mc_store_batch_get_ranges;
 * results[i]: bytes read or a negative code. (revision 7) */
int mc_store_get_session_read(mc_store *store, const char *const *keys, size_t n,
                              void *const *bufs, const uint64_t *offsets,
                              const uint64_t *lens, const size_t *counts,
                              int64_t *results);

/* Ends the get sessions of n keys (NULL keys and keys without one are skipped).
 * (revision 7) */
int mc_store_get_session_end(mc_store *store, const char *const *keys, size_t n);

/* Allocates size bytes (rounded up to a multiple of 4 MiB) at location (NULL or "" host
 * memory, "cpu:N", "cuda:N", ... as for mc_allocate_buffer) and lends them to the pool
 * as an extra segment: its id into id_buf, the bytes allocated into *allocated_out.
 * (revision 7) */
int mc_store_allocate_segment(mc_store *store, uint64_t size, const char *location,
                              char *id_buf, size_t id_len, uint64_t *allocated_out);

/* Maps size bytes of the file at path from offset (a multiple of the page size; the
 * range must lie inside the file) shared, and lends them to the pool as an extra
 * segment: its id into id_buf. Objects stored there are written to the file.
 * MC_ERR_FILE_NOT_FOUND / MC_ERR_FILE_OPEN_FAIL when the file cannot be opened read-write
 * or mapped, MC_ERR_INVALID_PARAMS for a bad range. (revision 7) */
int mc_store_mount_file_segment(mc_store *store, const char *path, uint64_t offset,
                                uint64_t size, const char *location, char *id_buf,
                                size_t id_len);

/* Unmounts a segment of mc_store_mount_file_segment after grace_ms (0: now) and unmaps
 * it. (revision 7) */
int mc_store_unmount_file_segment(mc_store *store, const char *id, uint64_t grace_ms);

/* Unmounts a segment of mc_store_allocate_segment after grace_ms (0: now) and frees its
 * memory. (revision 7) */
int mc_store_unmount_allocated_segment(mc_store *store, const char *id, uint64_t grace_ms);

/* Gives up the store's disk tier (ssd_path): nothing new is offloaded there at once;
 * after grace_ms (the call waits it out) every copy in it is deleted, so objects kept
 * only there are gone. 0, or 1 when the store has no disk tier (nothing done).
 * (revision 7) */
int mc_store_drain_disk_tier(mc_store *store, uint64_t grace_ms);

/* Starts a task copying key onto the n segments named in targets; its id into
 * id_out[0..2]. See "Tasks". (revision 7) */
int mc_store_create_copy_task(mc_store *store, const char *key, const char *const *targets,
                              size_t n, uint64_t *id_out);

/* Starts a task moving key's replica on segment source to segment target; its id into
 * id_out[0..2]. See "Tasks". (revision 7) */
int mc_store_create_move_task(mc_store *store, const char *key, const char *source,
                              const char *target, uint64_t *id_out);

/* Task (id_hi, id_lo) of this store as JSON into buf (NUL-terminated):
 *   {"id": [hi, lo], "type": "copy"|"move",
 *    "status": "pending"|"processing"|"failed"|"success", "created_at_ms": N,
 *    "updated_at_ms": N, "assigned_client": [hi, lo], "message": "..."}
 * (times in ms since the Unix epoch). Returns 0, or 1 when the store knows no such
 * task (buf untouched); *needed_out as for mc_segment_describe. (revision 7) */
int mc_store_query_task(mc_store *store, uint64_t id_hi, uint64_t id_lo, char *buf,
                        size_t len, size_t *needed_out);

/* How many reads got an object the master staged from a disk tier for them (counted
 * while descriptors are kept, as they are by default), into *count_out. (revision 7) */
int mc_store_disk_read_count(mc_store *store, uint64_t *count_out);

/* ===================================================================== Mooncake PG
 * Fault-tolerant collectives (revision 4). One mc_pg is one rank of a group of
 * world_size ranks, each running its own engine and one registered buffer that peers
 * write into. Ranks find each other through a rendezvous the caller runs: each rank
 * publishes mc_pg_address() and passes everyone's to mc_pg_connect() ("" or NULL for a
 * rank not running yet).
 *
 * Failure model: an operation that does not hear from a rank within timeout_ms fails
 * with MC_ERR_TIMEOUT; mc_pg_failed_ranks() names the ranks it missed. With
 * auto_sync_on_failure (default) the next call first reconciles membership: the
 * survivors agree on a new epoch without the failed ranks, which become holes (rank
 * numbers never change; collectives skip inactive ranks). A replacement started with
 * is_extension=1 calls mc_pg_join(); a member activates it with mc_pg_propose().
 * Messages carry their epoch and a CRC: nothing from an older epoch or half-written is
 * ever used. An operation on a rank that is not active fails with
 * MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS.
 *
 * Threads: one operation at a time per mc_pg (calls serialize). Every call returns 0
 * or a negative mc_error. Buffers are host memory unless mc_pg_set_memory says
 * otherwise; sizes in bytes unless "count" (elements of dtype). Per-rank arrays (sizes,
 * counts) have world_size entries. */

typedef struct mc_pg mc_pg;

enum mc_pg_dtype {
    MC_PG_F32 = 0, MC_PG_F64 = 1, MC_PG_F16 = 2, MC_PG_BF16 = 3,
    MC_PG_I32 = 4, MC_PG_I64 = 5, MC_PG_U8 = 6
};

/* MC_PG_AVG divides the sum by the number of active ranks (integers: truncated). */
enum mc_pg_reduce_op {
    MC_PG_SUM = 0, MC_PG_MIN = 1, MC_PG_MAX = 2, MC_PG_PRODUCT = 3, MC_PG_AVG = 4
};

/* mc_pg_propose's *status (upstream's ProposalStatus). */
enum mc_pg_proposal_status {
    MC_PG_PROPOSAL_REJECTED = 0,
    MC_PG_PROPOSAL_APPLIED = 1,
    MC_PG_PROPOSAL_APPLIED_WITH_DROPPED_RANKS = 2
};

/* mc_pg_sync_after_failure's *status (upstream's SyncAfterFailureStatus). */
enum mc_pg_sync_status {
    MC_PG_SYNC_RECONCILED = 0, MC_PG_SYNC_NO_PENDING = 1, MC_PG_SYNC_REJECTED = 2
};

/* One point-to-point send or receive. */
typedef struct mc_pg_message {
    int32_t peer;
    void *buf;
    size_t len;
} mc_pg_message;

/* Starts rank `rank` of `world_size` (at most 256). options: NULL or "key=value;..."
 * with timeout_ms (5000), is_extension (0), auto_deactivate_on_failure (1),
 * auto_sync_on_failure (1), active_ranks ("1101": one digit per rank), cells_per_peer
 * (4), cell_bytes (1048576; every rank must agree on these two), max_group_size
 * (accepted; capacity is world_size), staging_keep_bytes (268435456: pinned staging
 * of device collectives, and all_reduce scratch, kept between operations),
 * agree_on_new_view (0; 1: a collective that enters a new view at its own start runs
 * nothing in it and fails with MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS while this rank
 * stays a member, so the caller runs its agreement round, mc_pg_agree_max, first, as
 * ranks that reconciled explicitly do; the Python backend sets it), and any
 * mc_config_set key for the rank's engine (bind_address, protocol, workers, ...). */
int mc_pg_new(int rank, int world_size, const char *options, mc_pg **out);
/* Stops the rank (its last messages land first); NULL is ignored. */
void mc_pg_free(mc_pg *pg);
/* This rank's rendezvous address, NUL-terminated; *needed_out as mc_segment_describe. */
int mc_pg_address(mc_pg *pg, char *buf, size_t len, size_t *needed_out);
int mc_pg_connect(mc_pg *pg, const char *const *addresses, size_t count);
/* Claims this rank (extension or deactivated) and blocks until a member activates it,
 * at most timeout_ms (MC_ERR_TIMEOUT). */
int mc_pg_join(mc_pg *pg, uint32_t timeout_ms);
/* Where the buffers of this handle's later operations live (revision 5): "cpu:0" or
 * NULL for host memory (the default), "cuda:N", "hip:N" or "npu:N" for memory of that
 * device; the size and rank arguments stay host memory. A device location is checked
 * now (its runtime loads, the device exists); an unknown or unusable one fails with
 * MC_ERR_INVALID_PARAMS and leaves the setting as it was. The setting is the handle's,
 * shared by every thread that uses it, not the calling thread's: a program passing
 * buffers of several memories from several threads must not let one thread's
 * mc_pg_set_memory fall between another's set_memory and the calls meant for its
 * memory (hold one lock per handle across both). As a safety net, once a handle has had
 * a CUDA or HIP location, its host-memory calls refuse (MC_ERR_INVALID_PARAMS, nothing
 * done) a buffer that driver reports as device memory; a handle never set to a device
 * makes no driver call. With device memory, each operation checks its buffers with the
 * driver, copies each into host memory (pinned where the driver allows) once, runs as
 * on host memory, and copies each output back once, only if it succeeded: a failed
 * operation leaves device memory as it was, except that a driver error during the copy
 * back itself can leave the outputs copied before it written (the call still fails).
 * Inputs are never written. The device is done with when the call returns; the CPU
 * never reads device memory directly; the calling thread's current device (CUDA
 * context, HIP device) is the same afterwards. */
int mc_pg_set_memory(mc_pg *pg, const char *location);

/* Size arrays (sizes, counts, send_sizes, recv_sizes) hold world_size entries. An
 * operation's input and output may overlap (the in-place forms: an output that is a
 * block of the input, or the reverse); the input is then copied first. */
/* A failed all_reduce leaves buf as it was (a retry over the survivors can take it as
 * it is); above 64 KiB that takes scratch as large as buf, kept for the next operation
 * when not over staging_keep_bytes. */
int mc_pg_all_reduce(mc_pg *pg, void *buf, size_t count, int dtype, int op);
int mc_pg_reduce(mc_pg *pg, void *buf, size_t count, int dtype, int op, int root);
int mc_pg_broadcast(mc_pg *pg, void *buf, size_t len, int root);
/* output: the blocks of every rank (sizes[r] bytes each) in rank order; blocks of
 * inactive ranks are left as they were. */
int mc_pg_all_gather(mc_pg *pg, const void *input, void *output, const size_t *sizes);
/* input: counts[r] elements per rank block; output: this rank's reduced block. */
int mc_pg_reduce_scatter(mc_pg *pg, const void *input, void *output, const size_t *counts,
                         int dtype, int op);
int mc_pg_all_to_all(mc_pg *pg, const void *input, const size_t *send_sizes, void *output,
                     const size_t *recv_sizes);
/* mc_pg_all_to_all waiting at most timeout_us (> 0) for peers instead of timeout_ms
 * (expert-parallel dispatch/combine); reconciling after a failure uses timeout_ms. */
int mc_pg_all_to_all_timeout(mc_pg *pg, const void *input, const size_t *send_sizes,
                             void *output, const size_t *recv_sizes, uint64_t timeout_us);
/* output (gather) / input (scatter) is only used on root; NULL elsewhere is fine. */
int mc_pg_gather(mc_pg *pg, const void *input, void *output, const size_t *sizes, int root);
int mc_pg_scatter(mc_pg *pg, const void *input, void *output, const size_t *sizes, int root);
int mc_pg_barrier(mc_pg *pg);
/* Sends and receives done together (at most one of each per peer), so two ranks
 * exchanging large messages cannot wait on each other; a receive's len must equal
 * what the peer sends. A send is done once its receiver has taken it (it waits for
 * the matching receive; a send to a rank that is gone fails). A failed peer fails only
 * the messages with it: the others complete, and MC_ERR_TIMEOUT then comes with
 * mc_pg_failed_ranks naming exactly the peers whose messages were not done. */
int mc_pg_send_recv(mc_pg *pg, const mc_pg_message *sends, size_t nsends,
                    const mc_pg_message *recvs, size_t nrecvs);

/* Ranks the last failed operation missed: up to cap into ranks, the count in *count.
 * Once a reconciliation (mc_pg_sync_after_failure) adopts a view, only those it left out:
 * a missed rank still a member answered there (it was slow, not failed). */
int mc_pg_failed_ranks(mc_pg *pg, int32_t *ranks, size_t cap, size_t *count);
/* *max = the largest of the active ranks' value: an agreement round of its own kind,
 * which never pairs with another collective (a rank running one where the others agree
 * fails with a mismatch). After a membership change, ranks use it to compare how far
 * each got before it, e.g. so that a rank whose operation failed while a peer's
 * completed does not run it again against that peer's next one. (revision 6) */
int mc_pg_agree_max(mc_pg *pg, uint64_t value, uint64_t *max);
/* mask[r] = 1 for each active rank; len must be world_size. */
int mc_pg_active_ranks(mc_pg *pg, uint8_t *mask, size_t len);
/* Membership epoch: 1 at start, +1 per change, 0 for an extension not yet admitted. */
int mc_pg_epoch(mc_pg *pg, uint64_t *epoch);
/* Adopts a view published for this rank while it was between operations (a member that
 * deactivated only itself publishes one), unless an operation holds the rank now, so
 * mc_pg_active_ranks and mc_pg_epoch show it; a pending change is left to the next
 * operation. (revision 7) */
int mc_pg_refresh(mc_pg *pg);
/* states[i] = 1 when ranks[i] is active or has claimed its rank (mc_pg_join). */
int mc_pg_peer_state(mc_pg *pg, const int32_t *ranks, size_t n, uint8_t *states);
/* Activates (activate = 1) or deactivates ranks. Every active member takes part in the
 * change at its next operation or proposal within timeout_ms; members that do not are
 * left out (AppliedWithDroppedRanks). A rank deactivating only itself (nothing else
 * pending) leaves alone: it publishes the view without it to the members, who adopt it
 * at their next call or mc_pg_refresh. Outputs may be NULL; reason gets why a proposal
 * was rejected. */
int mc_pg_propose(mc_pg *pg, int activate, const int32_t *ranks, size_t n, int *status,
                  uint64_t *new_epoch, int32_t *dropped, size_t dropped_cap,
                  size_t *dropped_count, char *reason, size_t reason_len);
int mc_pg_sync_after_failure(mc_pg *pg, int *status);
/* =================================================================== end Mooncake PG */

#ifdef __cplusplus
}
#endif

#endif /* MOONCAKE_H */
