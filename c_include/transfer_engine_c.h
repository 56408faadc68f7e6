/*
 * transfer_engine_c.h - Mooncake's own transfer engine C API (as of Mooncake 0.3.x),
 * implemented by libmooncake over the same Rust engine as mooncake.h.
 *
 * Names, types, constants, struct layouts and signatures match upstream's header, so
 * C, Go (cgo) and Rust bindings written against upstream compile and link against
 * libmooncake unchanged. New code should prefer mooncake.h: it reports errors
 * uniformly and exposes every engine setting. Both headers may be used in one program,
 * but an engine made by one API cannot be passed to the other.
 *
 * Link exactly as for mooncake.h (-lmooncake, or libmooncake.a plus the libraries in
 * mooncake.pc). Usable from C99 and C++.
 *
 * Return conventions (as upstream)
 *   - Functions returning int give 0 on success and a negative ERR_* code (below) on
 *     failure; the reason is logged to stderr (RUST_LOG filters, default "warn").
 *   - Exceptions: submitTransfer, submitTransferWithNotify, getTransferStatus and
 *     freeBatchID return a *status code*: 0 on success, else a positive number, the
 *     negation of the matching ERR_* code (1 invalid argument, 2 too many requests,
 *     3 address not registered, 4 batch busy, 6, 7, 101..104, 200..202, 300, 302),
 *     except "not implemented", which is 999 there.
 *   - openSegment and openSegmentNoCache give a segment id >= 0, or -1.
 *   - allocateBatchID gives INVALID_BATCH, createTransferEngine and installTransport
 *     NULL, getNotifsFromEngine NULL with *size 0, on failure.
 *   - A NULL engine or a NULL required pointer is an invalid argument; nothing panics
 *     or aborts across this interface.
 *   - String arguments are copied as needed; none is used after the call returns, so
 *     the caller may free them at once.
 *
 * Thread safety
 *   - An engine may be used from any number of threads at once, except that
 *     destroyTransferEngine must not run concurrently with (or before the end of) any
 *     other call on it.
 *   - An engine belongs to the process that created it. In a child forked after that,
 *     every call on it fails: ERR_CONTEXT, 202 from the status-code functions, NULL,
 *     INVALID_BATCH or -1 where those are the failure values (enableGracefulShutdown
 *     does nothing); destroyTransferEngine only releases the handle, leaving the
 *     parent's engine, connections and published segment alone.
 *
 * Memory lifetime
 *   - Registered memory must stay valid until unregistered (or the engine destroyed);
 *     peers may read and write it at any time in between.
 *   - The source buffer of each submitted request must stay valid and untouched until
 *     its task reports a final status (CANCELED, COMPLETED, TIMEOUT, FAILED). The
 *     request array may be reused as soon as the submit call returns.
 */
#ifndef TRANSFER_ENGINE_C
#define TRANSFER_ENGINE_C

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- types */

typedef int32_t segment_id_t;     /* a segment opened by openSegment */
typedef int32_t segment_handle_t; /* the same thing, upstream's older name */
typedef uint64_t batch_id_t;      /* a batch from allocateBatchID */

/* The id of this engine's own segment: transfers to it are local copies. */
#define LOCAL_SEGMENT (0)
/* What allocateBatchID returns on failure. */
#define INVALID_BATCH UINT64_MAX

#define OPCODE_READ (0)  /* remote -> local (source) */
#define OPCODE_WRITE (1) /* local (source) -> remote */

/* Task states, in transfer_status.status. */
#define STATUS_WAITING (0)
#define STATUS_PENDING (1)
#define STATUS_INVALID (2)
#define STATUS_CANCELED (3)
#define STATUS_COMPLETED (4)
#define STATUS_TIMEOUT (5)
#define STATUS_FAILED (6)

/* Error codes (upstream keeps them in its error.h, with these exact spellings, so
 * including both is harmless). */
#define ERR_INVALID_ARGUMENT (-1)         /* bad argument, unknown id, NULL pointer */
#define ERR_TOO_MANY_REQUESTS (-2)        /* more tasks than the batch holds */
#define ERR_ADDRESS_NOT_REGISTERED (-3)   /* range not inside one registered buffer */
#define ERR_BATCH_BUSY (-4)               /* the batch has unfinished tasks */
#define ERR_DEVICE_NOT_FOUND (-6)         /* transport library or device missing */
#define ERR_ADDRESS_OVERLAPPED (-7)       /* range overlaps a registered buffer */
#define ERR_NOT_LOCAL_SEGMENT_OR_SHM (-8) /* (upstream only; not returned here) */
#define ERR_DNS (-101)                    /* a host name did not resolve */
#define ERR_SOCKET (-102)                 /* connection, i/o or network timeout */
#define ERR_MALFORMED_JSON (-103)         /* a peer sent a malformed message */
#define ERR_REJECT_HANDSHAKE (-104)       /* a peer refused us (version mismatch) */
#define ERR_METADATA (-200)               /* metadata service, or segment unknown */
#define ERR_ENDPOINT (-201)               /* a transfer failed */
#define ERR_CONTEXT (-202)                /* engine state error, or an internal error */
#define ERR_NUMA (-300)                   /* (not returned here) */
#define ERR_CLOCK (-301)                  /* (not returned here) */
#define ERR_MEMORY (-302)                 /* out of memory */
#define ERR_NOT_IMPLEMENTED (-303)        /* not available in this implementation */

/* One transfer of length bytes between source (local memory) and target_offset in
 * segment target_id. As upstream, target_offset is the absolute address in the peer's
 * address space (the addr a peer registered, plus an offset), not an offset from the
 * start of a buffer. 40 bytes on 64-bit targets. */
struct transfer_request {
    int opcode;                 /* OPCODE_READ or OPCODE_WRITE */
    void *source;               /* local buffer */
    segment_id_t target_id;     /* from openSegment, or LOCAL_SEGMENT */
    uint64_t target_offset;     /* absolute remote address */
    uint64_t length;            /* bytes, > 0 */
};
typedef struct transfer_request transfer_request_t;

/* A message between engines: name is chosen by the sender (not necessarily its
 * segment name), msg is its text. */
struct notify_msg {
    char *name;
    char *msg;
};
typedef struct notify_msg notify_msg_t;

struct transfer_status {
    int status;                 /* one of STATUS_* */
    uint64_t transferred_bytes; /* bytes moved so far (a lower bound while pending) */
};
typedef struct transfer_status transfer_status_t;

/* Upstream declares this (RDMA and NVMe-oF segment descriptions) but no function of
 * the C API takes it; kept for source compatibility only. */
struct segment_desc {
    int type;
    union {
        struct {
            void *addr;
            uint64_t size;
            const char *location;
        } rdma;
        struct {
            const char *file_path;
            const char *subsystem_name;
            const char *proto;
            const char *ip;
            uint64_t port;
        } nvmeof;
    } desc_;
};
typedef struct segment_desc segment_desc_t;

struct buffer_entry {
    void *addr;
    size_t length;
};
typedef struct buffer_entry buffer_entry_t;

typedef void *transfer_engine_t;
typedef void *transport_t;

/* ---------------------------------------------------------------- engine */

/*
 * Creates an engine; NULL on failure (the reason is logged).
 *
 *   metadata_conn_string  "P2PHANDSHAKE" (no server: a segment's name is its
 *                         "ip:port"), "http://host:port/metadata", or "embedded"
 *                         (in-process). Settings of mooncake.h's mc_config may follow,
 *                         each as ";key=value", e.g.
 *                         "P2PHANDSHAKE;workers=4;slice_size=1M;protocol=rdma"; the keys
 *                         metadata, local_server_name, bind_address and rpc_port are
 *                         refused there (they have their own arguments).
 *   local_server_name     The segment name to publish (metadata server only; NULL or
 *                         "" means "ip:port"). Ignored with P2PHANDSHAKE, where the
 *                         name is always "ip:port".
 *   ip_or_host_name       The address the engine binds to and advertises, and nothing
 *                         else: an IP address, or a host name resolved once here
 *                         ("localhost" is 127.0.0.1). NULL or "" means 127.0.0.1, which
 *                         peers on other hosts cannot reach. 0.0.0.0 and :: are refused.
 *   rpc_port              The handshake/RPC port, 0 for one chosen by the OS.
 *   auto_discover         Nonzero: the engine starts now, using RDMA when libibverbs
 *                         finds NICs (falling back, with a warning, to "auto" if RDMA
 *                         does not start) and "auto" otherwise (shared memory to
 *                         same-host peers, TCP to the rest), unless a ";protocol=..."
 *                         setting names one. Zero: see installTransport.
 */
transfer_engine_t createTransferEngine(const char *metadata_conn_string,
                                       const char *local_server_name,
                                       const char *ip_or_host_name, uint64_t rpc_port,
                                       int auto_discover);

/* Writes "ip:port" of the engine's RPC server (what P2PHANDSHAKE peers pass to
 * openSegment) into buf_out, NUL-terminated. ERR_INVALID_ARGUMENT (and "" when
 * buf_len > 0) if it does not fit. */
int getLocalIpAndPort(transfer_engine_t engine, char *buf_out, size_t buf_len);

/*
 * Transports. This engine chooses its transports when it starts, so:
 *   - With auto_discover 0 the engine starts at the first installTransport, with that
 *     protocol: "tcp", "rdma" (args may be NULL, or args[0] a NIC priority matrix as a
 *     JSON string, or NULL), "efa" (libfabric; args[0] as for rdma), or "shm" (same
 *     host only). A missing library or device makes the engine run over TCP
 *     instead, with one warning logged (MC_STRICT_PROTOCOL=1 in the environment: the
 *     call fails, NULL). TCP started this way, asked for or fallen back to, also
 *     reaches same-host peers of this library through shared memory, unless
 *     MC_SAME_HOST_SHM=0 or the connection string set ";protocol=". If any other
 *     call comes first, the engine starts then with ";protocol=" or "auto".
 *   - Once the engine runs, installTransport succeeds for its own protocol and for
 *     "tcp" (every engine serves peers over TCP) and fails for any other.
 * The result is an opaque handle, only to be compared with NULL. "nvlink", "cxl",
 * "ascend", ... have no backend in this build: they start the engine over TCP as a
 * missing library does; an unknown name fails (NULL).
 */
transport_t installTransport(transfer_engine_t engine, const char *proto, void **args);

/* Releases an installed transport's handle: 0, or ERR_INVALID_ARGUMENT if proto is not
 * installed. The transport itself keeps serving peers until destroyTransferEngine. */
int uninstallTransport(transfer_engine_t engine, const char *proto);

/* Stops, unpublishes and frees the engine; NULL is ignored. Registered memory is no
 * longer accessed once this returns. */
void destroyTransferEngine(transfer_engine_t engine);

/* ---------------------------------------------------------------- segments */

/* Resolves a segment by name (cached) and returns its id (>= 0), or -1. The engine's
 * own segment name gives LOCAL_SEGMENT. Opening a name again gives the same id. Ids
 * belong to this engine. */
segment_id_t openSegment(transfer_engine_t engine, const char *segment_name);

/* As openSegment, refetching the segment's description first (after the peer
 * registered new memory). */
segment_id_t openSegmentNoCache(transfer_engine_t engine, const char *segment_name);

/* Forgets a segment id (ERR_INVALID_ARGUMENT if unknown); requests naming it fail
 * afterwards until the name is opened again. Closing LOCAL_SEGMENT does nothing. */
int closeSegment(transfer_engine_t engine, segment_id_t segment_id);

/* Removes a segment's records from the metadata server (nothing to do, 0, with
 * P2PHANDSHAKE). */
int removeLocalSegment(transfer_engine_t engine, const char *segment_name);

/* Refetches the description of every opened segment. */
int syncSegmentCache(transfer_engine_t engine);

/* ---------------------------------------------------------------- memory */

/* Registers [addr, addr+length) so peers can read and write it. location: "cpu:N"
 * (NULL or "" mean "cpu:0"), "cuda:N", "hip:N", "npu:N", or "*" to ask the CUDA and
 * HIP drivers where addr lives. remote_accessible is accepted for compatibility:
 * registered memory is always published to peers here. */
int registerLocalMemory(transfer_engine_t engine, void *addr, size_t length,
                        const char *location, int remote_accessible);

/* Unregisters the buffer registered at addr (ERR_ADDRESS_NOT_REGISTERED if none). */
int unregisterLocalMemory(transfer_engine_t engine, void *addr);

/* Registers buffer_len buffers with one location; on failure the ones already
 * registered by this call are unregistered again and the first error is returned. */
int registerLocalMemoryBatch(transfer_engine_t engine, buffer_entry_t *buffer_list,
                             size_t buffer_len, const char *location);

/* Unregisters addr_len buffers; tries all of them and returns the first error. */
int unregisterLocalMemoryBatch(transfer_engine_t engine, void **addr_list,
                               size_t addr_len);

/* ---------------------------------------------------------------- transfers */

/* A batch that can hold batch_size tasks (1..1048576) in total; INVALID_BATCH on
 * failure. */
batch_id_t allocateBatchID(transfer_engine_t engine, size_t batch_size);

/* Submits count requests as the next tasks of the batch (task ids continue from
 * earlier submits, starting at 0). All are checked first: on error none is submitted.
 * Returns a status code (see the top of this file). */
int submitTransfer(transfer_engine_t engine, batch_id_t batch_id,
                   struct transfer_request *entries, size_t count);

/* As submitTransfer; in addition, notify_msg (copied) is sent to the segment of
 * entries[0] once the batch is complete: by the getTransferStatus call that first sees
 * every task of the batch COMPLETED, or else by freeBatchID. It is dropped if a task
 * ends in another state. */
int submitTransferWithNotify(transfer_engine_t engine, batch_id_t batch_id,
                             struct transfer_request *entries, size_t count,
                             notify_msg_t notify_msg);

/* Takes every notification received so far: an array of *size entries allocated with
 * malloc, to be released with freeNotifsMsgBuf; NULL with *size 0 when there is none
 * (or on error). */
notify_msg_t *getNotifsFromEngine(transfer_engine_t engine, int *size);

/* Frees what getNotifsFromEngine returned (NULL is ignored). */
int freeNotifsMsgBuf(notify_msg_t *msg, int size);

/* Sends notify_msg to the engine of an opened segment (target_id from openSegment) and
 * waits for its acknowledgement. notify_msg.name NULL sends this engine's segment
 * name. */
int genNotifyInEngine(transfer_engine_t engine, uint64_t target_id,
                      notify_msg_t notify_msg);

/* Writes the state of task task_id of a batch into *status. Returns a status code. */
int getTransferStatus(transfer_engine_t engine, batch_id_t batch_id, size_t task_id,
                      struct transfer_status *status);

/* Frees a batch. Returns a status code: 4 (batch busy) while any task is unfinished,
 * and the batch stays usable. */
int freeBatchID(transfer_engine_t engine, batch_id_t batch_id);

/* ---------------------------------------------------------------- diagnostics */

/* Looks for RDMA NICs and logs the NIC priority matrix the engine would use: 0, or
 * ERR_DEVICE_NOT_FOUND when libibverbs or a NIC is missing. */
int discoverTopology(transfer_engine_t engine);

/* Makes destroyTransferEngine first wait (up to the transfer timeout) for the tasks of
 * batches that were allocated and not yet freed. */
void enableGracefulShutdown(transfer_engine_t engine);

/* Writes the engine's links (its protocol and the segments it opened) into buf_out,
 * NUL-terminated: text lines, or one JSON object when json is nonzero.
 * ERR_INVALID_ARGUMENT (and "" when buf_len > 0) if it does not fit. */
int showLinks(transfer_engine_t engine, char *buf_out, size_t buf_len, int json);

/* Not in upstream's C header (upstream offers it in C++ only): per-NIC load as JSON.
 * This engine does not track per-NIC load, so it returns ERR_NOT_IMPLEMENTED. */
int getNicLoadStats(transfer_engine_t engine, char *buf_out, size_t buf_len);

#ifdef __cplusplus
}
#endif

#endif /* TRANSFER_ENGINE_C */
