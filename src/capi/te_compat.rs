//! Mooncake's own transfer engine C API (`c_include/transfer_engine_c.h`, upstream's
//! `transfer_engine_c.h` of Mooncake 0.3.x) over the same [`Engine`] as `mooncake.h`,
//! so bindings written against upstream link against this library unchanged.
//!
//! What differs from the engine underneath, and how it is bridged:
//! - Upstream segment ids are `int32`, ours `u64`: each handle keeps a table from the
//!   ids it handed out to our [`SegmentId`]s (0 is always the engine's own segment).
//! - Upstream installs transports one by one on a running engine; ours chooses them
//!   when it starts. With `auto_discover` 0 the engine therefore starts at the first
//!   `installTransport`, with that protocol (or, if another call comes first, with
//!   the configured one); afterwards only compatible installs succeed.
//! - Upstream errors are its own numbers: [`te_error_code`] maps our [`Code`]s to them,
//!   and [`te_status_code`] to the positive codes of its status-returning calls.
//! - Notifications carry a sender-chosen name, so they are sent here with the RPC
//!   directly rather than through [`Engine::notify`], which always sends our segment
//!   name.

#![allow(non_snake_case)]

use crate::util::sync::Unpoisoned;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use super::args::{array, c_str, copy_out, non_null, opt_str};
use super::{guard_value, init_logging};
use crate::engine::{BatchId, Engine, EngineConfig, Protocol, Request, SegmentId, TaskState};
use crate::error::{Code, Error, Result};
use crate::json::Value;
use crate::metadata::Directory;
use crate::transport::Op;

/// `OPCODE_READ`: remote → local.
pub const OPCODE_READ: c_int = 0;
/// `OPCODE_WRITE`: local → remote.
pub const OPCODE_WRITE: c_int = 1;
/// `LOCAL_SEGMENT`: the id of the engine's own segment.
pub const LOCAL_SEGMENT: i32 = 0;
/// `INVALID_BATCH`: what `allocateBatchID` returns on failure.
pub const INVALID_BATCH: u64 = u64::MAX;

/// `STATUS_*`: task states, numbered as [`TaskState`].
pub const STATUS_WAITING: c_int = TaskState::Waiting as c_int;
/// Submitted, slices in flight.
pub const STATUS_PENDING: c_int = TaskState::Pending as c_int;
/// No such task.
pub const STATUS_INVALID: c_int = TaskState::Invalid as c_int;
/// Canceled before it finished.
pub const STATUS_CANCELED: c_int = TaskState::Canceled as c_int;
/// Every byte moved.
pub const STATUS_COMPLETED: c_int = TaskState::Completed as c_int;
/// Ran out of time.
pub const STATUS_TIMEOUT: c_int = TaskState::Timeout as c_int;
/// At least one slice failed.
pub const STATUS_FAILED: c_int = TaskState::Failed as c_int;

/// `ERR_*`: upstream's error codes.
pub const ERR_INVALID_ARGUMENT: c_int = -1;
/// The batch has no room for this many requests.
pub const ERR_TOO_MANY_REQUESTS: c_int = -2;
/// A local address is not inside registered memory.
pub const ERR_ADDRESS_NOT_REGISTERED: c_int = -3;
/// The batch still has unfinished tasks.
pub const ERR_BATCH_BUSY: c_int = -4;
/// No usable device was found.
pub const ERR_DEVICE_NOT_FOUND: c_int = -6;
/// The range overlaps one already registered.
pub const ERR_ADDRESS_OVERLAPPED: c_int = -7;
/// The segment is neither local nor reachable through shared memory.
pub const ERR_NOT_LOCAL_SEGMENT_OR_SHM: c_int = -8;
/// A host name did not resolve.
pub const ERR_DNS: c_int = -101;
/// A socket call failed.
pub const ERR_SOCKET: c_int = -102;
/// A descriptor or message was not valid JSON.
pub const ERR_MALFORMED_JSON: c_int = -103;
/// The peer refused the handshake.
pub const ERR_REJECT_HANDSHAKE: c_int = -104;
/// The metadata store failed.
pub const ERR_METADATA: c_int = -200;
/// An endpoint could not be set up.
pub const ERR_ENDPOINT: c_int = -201;
/// A device context could not be set up.
pub const ERR_CONTEXT: c_int = -202;
/// NUMA placement failed.
pub const ERR_NUMA: c_int = -300;
/// The clock could not be read.
pub const ERR_CLOCK: c_int = -301;
/// Out of memory.
pub const ERR_MEMORY: c_int = -302;
/// Not implemented.
pub const ERR_NOT_IMPLEMENTED: c_int = -303;

/// Upstream's status code for "not implemented" (its other status codes are the
/// negated `ERR_*` values).
pub const TE_STATUS_NOT_IMPLEMENTED: c_int = 999;

/// `struct transfer_request` (40 bytes on 64-bit targets).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct TransferRequest {
    /// `OPCODE_READ` or `OPCODE_WRITE`.
    pub opcode: c_int,
    /// The local buffer.
    pub source: *mut c_void,
    /// The peer segment's handle, from `openSegment`.
    pub target_id: i32,
    /// Absolute address in the peer segment.
    pub target_offset: u64,
    /// Bytes to move.
    pub length: u64,
}

/// `struct transfer_status`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferStatus {
    /// A `STATUS_*` value.
    pub status: c_int,
    /// Bytes moved so far.
    pub transferred_bytes: u64,
}

/// `struct notify_msg`: both strings NUL-terminated.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NotifyMsg {
    /// The sender's segment name (NUL-terminated, owned by the library).
    pub name: *mut c_char,
    /// The message text (NUL-terminated, owned by the library).
    pub msg: *mut c_char,
}

/// `struct buffer_entry`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BufferEntry {
    /// Start of the buffer.
    pub addr: *mut c_void,
    /// Its length in bytes.
    pub length: usize,
}

/// Upstream's (negative) code for an error of ours.
pub fn te_error_code(code: Code) -> c_int {
    match code {
        Code::InvalidParams
        | Code::BufferOverflow
        | Code::BatchNotFound
        | Code::InvalidKey
        | Code::IllegalClient
        | Code::ClientNotFound
        | Code::InvalidWrite
        | Code::InvalidRead
        | Code::InvalidReplica
        | Code::ReplicaIsNotReady
        | Code::ObjectNotFound
        | Code::ObjectAlreadyExists
        | Code::ObjectHasLease
        | Code::LeaseExpired
        | Code::FileNotFound
        | Code::FileOpenFail => ERR_INVALID_ARGUMENT,
        Code::BatchFull => ERR_TOO_MANY_REQUESTS,
        Code::AddressNotRegistered => ERR_ADDRESS_NOT_REGISTERED,
        Code::BatchBusy => ERR_BATCH_BUSY,
        Code::BackendUnavailable => ERR_DEVICE_NOT_FOUND,
        Code::AddressOverlap => ERR_ADDRESS_OVERLAPPED,
        Code::Io
        | Code::Timeout
        | Code::RpcFail
        | Code::RpcTimeout
        | Code::FileReadFail
        | Code::FileWriteFail => ERR_SOCKET,
        Code::Protocol => ERR_MALFORMED_JSON,
        Code::InvalidVersion => ERR_REJECT_HANDSHAKE,
        Code::Metadata
        | Code::SegmentNotFound
        | Code::SegmentAlreadyExists
        | Code::EtcdOperationError => ERR_METADATA,
        Code::TransferFail | Code::WriteFail | Code::ChecksumMismatch => ERR_ENDPOINT,
        Code::Internal | Code::UnavailableInCurrentStatus => ERR_CONTEXT,
        Code::NoAvailableHandle => ERR_MEMORY,
        Code::NotSupported => ERR_NOT_IMPLEMENTED,
    }
}

/// Upstream's (positive) status code for an error of ours, as returned by
/// `submitTransfer`, `getTransferStatus` and `freeBatchID`.
pub fn te_status_code(code: Code) -> c_int {
    match te_error_code(code) {
        ERR_NOT_IMPLEMENTED => TE_STATUS_NOT_IMPLEMENTED,
        e => -e,
    }
}

fn log_failure(what: &str, e: &Error) {
    match e.code() {
        Code::Timeout | Code::BatchBusy => log::debug!("{what}: {e}"),
        _ => log::warn!("{what}: {e}"),
    }
}

/// Runs an int-returning entry point: `Ok(v)` gives `v`, an error upstream's negative
/// code (logged), a panic `ERR_CONTEXT` (logged).
fn run(what: &str, body: impl FnOnce() -> Result<c_int>) -> c_int {
    guard_value(what, ERR_CONTEXT, || {
        body().unwrap_or_else(|e| {
            log_failure(what, &e);
            te_error_code(e.code())
        })
    })
}

/// Runs a status-returning entry point: 0 or upstream's positive status code.
fn run_status(what: &str, body: impl FnOnce() -> Result<()>) -> c_int {
    guard_value(what, -ERR_CONTEXT, || match body() {
        Ok(()) => 0,
        Err(e) => {
            log_failure(what, &e);
            te_status_code(e.code())
        }
    })
}

/// Runs an entry point that returns a value, `fallback` on error or panic.
fn run_value<T: Copy>(what: &str, fallback: T, body: impl FnOnce() -> Result<T>) -> T {
    guard_value(what, fallback, || {
        body().unwrap_or_else(|e| {
            log_failure(what, &e);
            fallback
        })
    })
}

/// An installed transport.
struct Installed {
    protocol: Protocol,
    active: bool,
}

/// The `transport_t` handed out for a protocol: an address that is never NULL and
/// never dereferenced.
fn transport_handle(protocol: Protocol) -> *mut c_void {
    static MARKS: [u8; 6] = [0; 6];
    let i = match protocol {
        Protocol::Auto => 0,
        Protocol::Tcp => 1,
        Protocol::Shm => 2,
        Protocol::Rdma => 3,
        Protocol::Fabric => 4,
        Protocol::NoBackend(_) => 5,
    };
    std::ptr::from_ref(&MARKS[i]).cast_mut().cast()
}

struct Opened {
    segment: SegmentId,
    name: String,
}

/// Upstream's segment ids and the segments they stand for.
#[derive(Default)]
struct SegmentTable {
    ids: HashMap<i32, Opened>,
    by_segment: HashMap<SegmentId, i32>,
    last: i32,
}

impl SegmentTable {
    /// The id of `segment` (opened under `name`), assigning the next one if new.
    fn id_for(&mut self, segment: SegmentId, name: &str, local: bool) -> Result<i32> {
        if let Some(&id) = self.by_segment.get(&segment) {
            return Ok(id);
        }
        let id = if local {
            LOCAL_SEGMENT
        } else {
            self.last = self
                .last
                .checked_add(1)
                .ok_or_else(|| Error::new(Code::NoAvailableHandle, "segment ids exhausted"))?;
            self.last
        };
        self.ids.insert(
            id,
            Opened {
                segment,
                name: name.to_owned(),
            },
        );
        self.by_segment.insert(segment, id);
        Ok(id)
    }
}

/// A notification to send once a batch is complete.
struct PendingNotify {
    target: i32,
    name: String,
    msg: String,
}

#[derive(Default)]
struct BatchInfo {
    submitted: usize,
    notify: Option<PendingNotify>,
}

/// `transfer_engine_t`: settings, the engine once started, and upstream's ids.
pub struct TeEngine {
    config: EngineConfig,
    /// Whether the `;protocol=` setting chose the protocol.
    protocol_set: bool,
    /// Our own view of the metadata service, for RPC addresses and removals.
    directory: Directory,
    engine: OnceLock<Engine>,
    starting: Mutex<()>,
    local_addr: OnceLock<String>,
    transports: Mutex<Vec<Installed>>,
    segments: Mutex<SegmentTable>,
    batches: Mutex<HashMap<BatchId, BatchInfo>>,
    /// Batches with a notification to send, so status polls skip the lock otherwise.
    pending_notifies: AtomicUsize,
    graceful: AtomicBool,
}

// The header promises that one engine may be used from many threads at once.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<TeEngine>();
};

/// Borrows the engine behind a handle.
///
/// # Safety
/// `e` must be NULL or a live pointer from `createTransferEngine` that is not destroyed
/// during `'a`.
unsafe fn handle<'a>(e: *mut TeEngine) -> Result<&'a TeEngine> {
    non_null(e, "engine")?;
    // SAFETY: `e` is non-null (checked by `non_null`) and the caller guarantees a live handle from
    // createTransferEngine not destroyed during `'a` (transfer_engine_c.h); only shared access is
    // made, which `TeEngine: Sync` allows from many threads.
    Ok(unsafe { &*e })
}

/// The address `ip_or_host_name` stands for: bound to and advertised, nothing else.
fn bind_address(ip_or_host_name: Option<&str>) -> Result<IpAddr> {
    let ip = match ip_or_host_name {
        None => {
            log::info!("createTransferEngine: no ip_or_host_name, binding 127.0.0.1");
            return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
        }
        Some(h) if h.eq_ignore_ascii_case("localhost") => IpAddr::V4(Ipv4Addr::LOCALHOST),
        Some(h) => match h.trim_matches(|c| c == '[' || c == ']').parse::<IpAddr>() {
            Ok(ip) => ip,
            Err(_) => {
                let addrs: Vec<IpAddr> = (h, 0)
                    .to_socket_addrs()
                    .map_err(|e| Error::new(Code::Metadata, format!("resolving {h:?}: {e}")))?
                    .map(|a| a.ip())
                    .collect();
                addrs
                    .iter()
                    .find(|a| a.is_ipv4())
                    .or_else(|| addrs.first())
                    .copied()
                    .ok_or_else(|| {
                        Error::new(Code::Metadata, format!("{h:?} resolves to no address"))
                    })?
            }
        },
    };
    if ip.is_unspecified() {
        return Err(Error::invalid(format!(
            "ip_or_host_name {ip} is not an address peers can reach; pass this host's IP"
        )));
    }
    Ok(ip)
}

/// The engine settings for `createTransferEngine`, and whether `;protocol=` was given.
fn create_config(
    metadata: &str,
    local_server_name: Option<&str>,
    ip_or_host_name: Option<&str>,
    rpc_port: u64,
) -> Result<(EngineConfig, bool)> {
    let mut cfg = EngineConfig::default();
    let mut parts = metadata.split(';');
    let connection = parts.next().unwrap_or("").trim();
    if connection.is_empty() {
        return Err(Error::invalid("metadata_conn_string is empty"));
    }
    let mut protocol_set = false;
    for setting in parts.map(str::trim).filter(|s| !s.is_empty()) {
        let (key, value) = setting.split_once('=').ok_or_else(|| {
            Error::invalid(format!(
                "metadata_conn_string setting {setting:?} is not key=value"
            ))
        })?;
        let key = key.trim();
        if matches!(
            key,
            "metadata" | "metadata_server" | "local_server_name" | "bind_address" | "rpc_port"
        ) {
            return Err(Error::invalid(format!(
                "metadata_conn_string setting {key:?}: it has its own argument"
            )));
        }
        cfg.set(key, value.trim())?;
        protocol_set |= key == "protocol";
    }
    cfg.set("metadata", connection)?;
    cfg.bind_address = bind_address(ip_or_host_name)?;
    cfg.rpc_port = u16::try_from(rpc_port)
        .map_err(|_| Error::invalid(format!("rpc_port {rpc_port} is not a port number")))?;
    cfg.local_server_name = local_server_name.map(str::to_owned);
    Ok((cfg, protocol_set))
}

impl TeEngine {
    fn new(config: EngineConfig, protocol_set: bool) -> Result<TeEngine> {
        let directory = crate::metadata::open(
            &config.metadata,
            &config.cluster_id,
            config.cluster_secret.as_ref(),
        )?;
        let mut config = config;
        if directory.is_p2p() {
            if let Some(n) = config.local_server_name.take() {
                log::debug!(
                    "createTransferEngine: P2PHANDSHAKE names segments ip:port; {n:?} is not used"
                );
            }
        }
        Ok(TeEngine {
            config,
            protocol_set,
            directory,
            engine: OnceLock::new(),
            starting: Mutex::new(()),
            local_addr: OnceLock::new(),
            transports: Mutex::default(),
            segments: Mutex::default(),
            batches: Mutex::default(),
            pending_notifies: AtomicUsize::new(0),
            graceful: AtomicBool::new(false),
        })
    }

    /// The running engine, started with `config` unless it already runs.
    fn start_with(&self, config: impl FnOnce() -> EngineConfig) -> Result<&Engine> {
        if let Some(e) = self.engine.get() {
            return Ok(e);
        }
        let _serial = self.starting.locked();
        if let Some(e) = self.engine.get() {
            return Ok(e);
        }
        let config = config();
        log::info!(
            "transfer_engine_c: starting the engine, protocol {}",
            config.protocol.name()
        );
        let engine = Engine::new(config)?;
        // Cannot be set already: every start holds `starting`.
        let _ = self.engine.set(engine);
        self.engine
            .get()
            .ok_or_else(|| Error::new(Code::Internal, "engine not stored"))
    }

    /// The running engine, started with the configured protocol if need be.
    fn engine(&self) -> Result<&Engine> {
        self.start_with(|| self.config.clone())
    }

    /// `auto_discover`: RDMA when NICs are found (unless `;protocol=` chose), else auto.
    fn start_discovered(&self) -> Result<&Engine> {
        if self.protocol_set {
            return self.engine();
        }
        let nics = crate::ffi::ibverbs::verbs()
            .map(|v| v.device_names())
            .unwrap_or_default();
        if !nics.is_empty() {
            // Strict: when RDMA does not start, discovery settles on auto (below), not
            // on the engine's TCP-only fallback.
            let rdma = self.start_with(|| EngineConfig {
                protocol: Protocol::Rdma,
                strict_protocol: true,
                ..self.config.clone()
            });
            match rdma {
                Ok(_) => return self.engine(),
                Err(e) => log::warn!(
                    "createTransferEngine: RDMA NICs {} found but RDMA did not start ({e}); \
                     using protocol auto",
                    nics.join(", ")
                ),
            }
        }
        self.start_with(|| EngineConfig {
            protocol: Protocol::Auto,
            ..self.config.clone()
        })
    }

    /// Our segment behind upstream id `id` (opening our own segment for id 0).
    fn segment(&self, engine: &Engine, id: i32) -> Result<SegmentId> {
        let mut table = self.segments.locked();
        if let Some(o) = table.ids.get(&id) {
            return Ok(o.segment);
        }
        if id == LOCAL_SEGMENT {
            let name = engine.segment_name();
            let segment = engine.open_segment(name)?;
            table.id_for(segment, name, true)?;
            return Ok(segment);
        }
        Err(Error::invalid(format!(
            "segment id {id} was not opened on this engine (or was closed)"
        )))
    }

    fn segment_name(&self, engine: &Engine, id: i32) -> Result<String> {
        self.segment(engine, id)?;
        self.segments
            .locked()
            .ids
            .get(&id)
            .map(|o| o.name.clone())
            .ok_or_else(|| Error::invalid(format!("segment id {id} was closed")))
    }

    fn open(&self, name: &str, refresh: bool) -> Result<i32> {
        let engine = self.engine()?;
        let segment = engine.open_segment(name)?;
        if refresh {
            engine.resync_segment(segment)?;
        }
        let local = name == engine.segment_name();
        self.segments.locked().id_for(segment, name, local)
    }

    /// Sends a notification with a sender-chosen name to segment `target`'s engine.
    fn send_notify(&self, engine: &Engine, target: i32, name: &str, msg: &str) -> Result<()> {
        let segment_name = self.segment_name(engine, target)?;
        let segment = engine.open_segment(&segment_name)?;
        engine.notify_as(segment, name, msg)
    }

    /// Sends (or drops) a batch's pending notification once all its tasks are final.
    /// Whether no notification is left pending for the batch afterwards (false: its
    /// tasks are still running, so it cannot be sent yet).
    fn settle_notify(&self, engine: &Engine, batch: BatchId) -> bool {
        let mut batches = self.batches.locked();
        let Some(info) = batches.get_mut(&batch) else {
            return true;
        };
        if info.notify.is_none() {
            return true;
        }
        let mut all_completed = true;
        for task in 0..info.submitted {
            match engine.task_status(batch, task).map(|s| s.state) {
                Ok(TaskState::Completed) => {}
                Ok(s) if s.is_final() => all_completed = false,
                _ => return false, // still running
            }
        }
        let Some(note) = info.notify.take() else {
            return true;
        };
        drop(batches);
        self.pending_notifies.fetch_sub(1, Ordering::Relaxed);
        if !all_completed {
            log::warn!(
                "batch {batch}: not every task completed; notification {:?} not sent",
                note.name
            );
            return true;
        }
        if let Err(e) = self.send_notify(engine, note.target, &note.name, &note.msg) {
            log::error!("batch {batch}: sending notification {:?}: {e}", note.name);
        }
        true
    }

    /// Our requests for upstream's.
    fn requests(&self, engine: &Engine, entries: &[TransferRequest]) -> Result<Vec<Request>> {
        entries
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let op = match r.opcode {
                    OPCODE_READ => Op::Read,
                    OPCODE_WRITE => Op::Write,
                    other => {
                        return Err(Error::invalid(format!(
                            "request {i}: opcode {other} (OPCODE_READ 0 or OPCODE_WRITE 1)"
                        )))
                    }
                };
                let segment = self
                    .segment(engine, r.target_id)
                    .map_err(|e| Error::new(e.code(), format!("request {i}: {}", e.context())))?;
                Ok(Request {
                    op,
                    local: r.source as u64,
                    segment,
                    remote: r.target_offset,
                    len: r.length,
                })
            })
            .collect()
    }

    /// Submits upstream's requests to a batch, remembering `notify` for its completion.
    ///
    /// # Safety
    /// Every request's `source` must stay valid, and untouched by the program, until
    /// its task is final (as `submitTransfer` requires of its caller).
    unsafe fn submit(
        &self,
        batch: BatchId,
        entries: &[TransferRequest],
        notify: Option<PendingNotify>,
    ) -> Result<()> {
        let engine = self.engine()?;
        let requests = self.requests(engine, entries)?;
        // SAFETY: this fn's contract: each source buffer stays valid until its task is final.
        unsafe { engine.submit(batch, &requests)? };
        let mut batches = self.batches.locked();
        let info = batches.entry(batch).or_default();
        info.submitted += entries.len();
        if let Some(n) = notify {
            if info.notify.replace(n).is_none() {
                self.pending_notifies.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }
}

impl Drop for TeEngine {
    fn drop(&mut self) {
        let Some(engine) = self.engine.get() else {
            return;
        };
        if !self.graceful.load(Ordering::Relaxed) {
            return;
        }
        let batches: Vec<BatchId> = self.batches.locked().keys().copied().collect();
        let limit = engine.config().transfer_timeout;
        for b in batches {
            if let Err(e) = engine.wait_batch(b, Some(limit)) {
                log::warn!("destroyTransferEngine: batch {b}: {e}");
            }
        }
    }
}

/// The location `registerLocalMemory` registers under: "*" asks the GPU drivers.
fn location_of(location: Option<&str>, addr: u64) -> String {
    match location {
        None => "cpu:0".to_owned(),
        Some("*") => {
            // Each runtime that loads is asked (a thread with no CUDA context borrows one
            // for the query); whatever neither claims is host memory.
            let cuda = crate::ffi::cuda::api().is_ok();
            let hip = crate::ffi::hip::api().is_ok();
            match crate::device::device_memory_at(addr, 1, cuda, hip) {
                Ok(Some(kind)) => kind.location(),
                _ => "cpu:0".to_owned(),
            }
        }
        Some(l) => l.to_owned(),
    }
}

/// Copies `s` into `buf[..len]`, or fails (leaving "" when `len > 0`).
///
/// # Safety
/// `buf` must be NULL or writable for `len` bytes.
unsafe fn write_out(s: &str, buf: *mut c_char, len: usize, what: &str) -> Result<c_int> {
    non_null(buf, "buf_out")?;
    // SAFETY: `buf` is writable for `len` bytes.
    if unsafe { copy_out(s, buf, len) } {
        return Ok(0);
    }
    if len > 0 {
        // SAFETY: `buf` holds at least one byte.
        unsafe { *buf = 0 };
    }
    Err(Error::invalid(format!(
        "{what} needs {} bytes, buf_len is {len}",
        s.len() + 1
    )))
}

// ---------------------------------------------------------------- engine

/// Creates an engine (started now when `auto_discover` is nonzero); NULL on failure.
///
/// # Safety
/// Each string must be NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn createTransferEngine(
    metadata_conn_string: *const c_char,
    local_server_name: *const c_char,
    ip_or_host_name: *const c_char,
    rpc_port: u64,
    auto_discover: c_int,
) -> *mut TeEngine {
    run_value("createTransferEngine", std::ptr::null_mut(), || {
        init_logging();
        // SAFETY: the caller guarantees each string is NULL or NUL-terminated and unchanged during
        // the call: the contracts of `c_str` (which rejects NULL) and `opt_str`.
        let (metadata, name, host) = unsafe {
            (
                c_str(metadata_conn_string, "metadata_conn_string")?,
                opt_str(local_server_name, "local_server_name")?,
                opt_str(ip_or_host_name, "ip_or_host_name")?,
            )
        };
        let (config, protocol_set) = create_config(metadata, name, host, rpc_port)?;
        let te = TeEngine::new(config, protocol_set)?;
        if auto_discover != 0 {
            te.start_discovered()?;
        }
        Ok(Box::into_raw(Box::new(te)))
    })
}

/// Stops and frees an engine; NULL is ignored.
///
/// # Safety
/// `engine` must be NULL or a pointer from `createTransferEngine` not yet destroyed,
/// with no other call on it in progress or to come.
#[no_mangle]
pub unsafe extern "C" fn destroyTransferEngine(engine: *mut TeEngine) {
    if engine.is_null() {
        return;
    }
    guard_value("destroyTransferEngine", (), || {
        // SAFETY: from `Box::into_raw` in `createTransferEngine`, freed once, no
        // longer shared.
        drop(unsafe { Box::from_raw(engine) });
    });
}

/// Writes "ip:port" of the engine's RPC server into `buf_out`.
///
/// # Safety
/// `engine` as for every call; `buf_out` NULL or writable for `buf_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn getLocalIpAndPort(
    engine: *mut TeEngine,
    buf_out: *mut c_char,
    buf_len: usize,
) -> c_int {
    run("getLocalIpAndPort", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let addr = match te.local_addr.get() {
            Some(a) => a,
            None => {
                let name = te.engine()?.segment_name().to_owned();
                let addr = te.directory.rpc_address(&name)?;
                te.local_addr.get_or_init(|| addr)
            }
        };
        // SAFETY: the caller guarantees `buf_out` is NULL or writable for `buf_len` bytes, which is
        // `write_out`'s contract (it rejects NULL).
        unsafe { write_out(addr, buf_out, buf_len, "the address") }
    })
}

/// Installs a transport (starting the engine with it if not yet started: an
/// unavailable hardware protocol then runs over TCP, see `Engine::protocol_fallback`);
/// NULL if the protocol is unknown, refused (`MC_STRICT_PROTOCOL=1`) or incompatible
/// with the running engine.
///
/// # Safety
/// `engine` as for every call; `proto` NULL or NUL-terminated; `args` NULL or pointing
/// to at least one pointer, which is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn installTransport(
    engine: *mut TeEngine,
    proto: *const c_char,
    args: *mut *mut c_void,
) -> *mut c_void {
    run_value("installTransport", std::ptr::null_mut(), || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: NULL (refused) or NUL-terminated.
        let name = unsafe { c_str(proto, "proto")? };
        let protocol = Protocol::parse(name)?;
        let hardware = protocol.is_hardware();
        let matrix = if hardware && !args.is_null() {
            // SAFETY: `args` is non-null (checked in the `if`) and the caller guarantees a non-null
            // `args` points to at least one readable pointer.
            let first = unsafe { *args };
            // SAFETY: the caller guarantees `args[0]` is NULL or a NUL-terminated string unchanged
            // during the call, which is `opt_str`'s contract.
            unsafe { opt_str(first.cast_const().cast(), "args[0]")? }.map(str::to_owned)
        } else {
            None
        };
        let running = te.start_with(|| {
            let mut cfg = te.config.clone();
            cfg.protocol = protocol;
            if let Some(m) = &matrix {
                cfg.backend.devices = m.clone();
            }
            cfg
        })?;
        // What the engine runs (a hardware protocol it fell back from runs as tcp); asking
        // again for what it was started with is no change.
        let current = running.protocol();
        let compatible = current == protocol
            || running.config().protocol == protocol
            || protocol == Protocol::Tcp
            || (current == Protocol::Auto && protocol == Protocol::Shm);
        if !compatible {
            return Err(Error::new(
                Code::NotSupported,
                format!(
                    "the engine already runs protocol {}; it chooses transports when it \
                     starts, so call installTransport({name:?}) first (auto_discover 0)",
                    current.name()
                ),
            ));
        }
        if let Some(m) = matrix {
            if m != running.config().backend.devices {
                log::warn!("installTransport({name:?}): the engine already runs; args[0] ignored");
            }
        }
        let mut installed = te.transports.locked();
        match installed.iter_mut().find(|t| t.protocol == protocol) {
            Some(t) => t.active = true,
            None => installed.push(Installed {
                protocol,
                active: true,
            }),
        }
        Ok(transport_handle(protocol))
    })
}

/// Releases an installed transport's handle.
///
/// # Safety
/// `engine` as for every call; `proto` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn uninstallTransport(engine: *mut TeEngine, proto: *const c_char) -> c_int {
    run("uninstallTransport", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: NULL (refused) or NUL-terminated.
        let name = unsafe { c_str(proto, "proto")? };
        let protocol = Protocol::parse(name)?;
        let mut installed = te.transports.locked();
        let t = installed
            .iter_mut()
            .find(|t| t.protocol == protocol && t.active)
            .ok_or_else(|| Error::invalid(format!("transport {name:?} is not installed")))?;
        t.active = false;
        log::info!("uninstallTransport({name:?}): it serves peers until destroyTransferEngine");
        Ok(0)
    })
}

// ---------------------------------------------------------------- segments

/// Opens a segment by name; its id, or -1.
///
/// # Safety
/// `engine` as for every call; `segment_name` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn openSegment(engine: *mut TeEngine, segment_name: *const c_char) -> i32 {
    run_value("openSegment", -1, || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: NULL (refused) or NUL-terminated.
        te.open(unsafe { c_str(segment_name, "segment_name")? }, false)
    })
}

/// As `openSegment`, refetching the segment's descriptor first.
///
/// # Safety
/// As `openSegment`.
#[no_mangle]
pub unsafe extern "C" fn openSegmentNoCache(
    engine: *mut TeEngine,
    segment_name: *const c_char,
) -> i32 {
    run_value("openSegmentNoCache", -1, || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: NULL (refused) or NUL-terminated.
        te.open(unsafe { c_str(segment_name, "segment_name")? }, true)
    })
}

/// Forgets a segment id.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn closeSegment(engine: *mut TeEngine, segment_id: i32) -> c_int {
    run("closeSegment", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        if segment_id == LOCAL_SEGMENT {
            return Ok(0);
        }
        let mut table = te.segments.locked();
        let opened = table
            .ids
            .remove(&segment_id)
            .ok_or_else(|| Error::invalid(format!("segment id {segment_id} is not open")))?;
        table.by_segment.remove(&opened.segment);
        Ok(0)
    })
}

/// Removes a segment's records from the metadata server.
///
/// # Safety
/// `engine` as for every call; `segment_name` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn removeLocalSegment(
    engine: *mut TeEngine,
    segment_name: *const c_char,
) -> c_int {
    run("removeLocalSegment", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: NULL (refused) or NUL-terminated.
        let name = unsafe { c_str(segment_name, "segment_name")? };
        // Only what this engine published may be removed by it.
        let engine = te.engine()?;
        if name != engine.segment_name() {
            return Err(Error::invalid(format!(
                "removeLocalSegment({name:?}): this engine is {:?}; another's records are not its to remove",
                engine.segment_name()
            )));
        }
        engine.unpublish()?;
        Ok(0)
    })
}

/// Refetches every opened segment's descriptor.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn syncSegmentCache(engine: *mut TeEngine) -> c_int {
    run("syncSegmentCache", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let eng = te.engine()?;
        let segments: Vec<SegmentId> = te
            .segments
            .locked()
            .ids
            .values()
            .map(|o| o.segment)
            .collect();
        let mut first = Ok(());
        for s in segments {
            if let Err(e) = eng.resync_segment(s) {
                log::warn!("syncSegmentCache: segment {s}: {e}");
                first = first.and(Err(e));
            }
        }
        first.map(|()| 0)
    })
}

// ---------------------------------------------------------------- memory

/// Registers `[addr, addr+length)`.
///
/// # Safety
/// `engine` as for every call; `location` NULL or NUL-terminated; the memory must stay
/// valid (and may be written by peers) until unregistered.
#[no_mangle]
pub unsafe extern "C" fn registerLocalMemory(
    engine: *mut TeEngine,
    addr: *mut c_void,
    length: usize,
    location: *const c_char,
    remote_accessible: c_int,
) -> c_int {
    run("registerLocalMemory", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        non_null(addr, "addr")?;
        // SAFETY: NULL or NUL-terminated.
        let location = location_of(unsafe { opt_str(location, "location")? }, addr as u64);
        if remote_accessible == 0 {
            log::debug!("registerLocalMemory: {addr:p} is published to peers all the same");
        }
        // SAFETY: the caller keeps the memory valid until it unregisters it.
        unsafe {
            te.engine()?
                .register_memory(addr.cast(), length, &location)?
        };
        Ok(0)
    })
}

/// Unregisters the buffer at `addr`.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn unregisterLocalMemory(engine: *mut TeEngine, addr: *mut c_void) -> c_int {
    run("unregisterLocalMemory", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        non_null(addr, "addr")?;
        te.engine()?.unregister_memory(addr.cast())?;
        Ok(0)
    })
}

/// Registers several buffers with one location; all or none.
///
/// # Safety
/// `engine` as for every call; `buffer_list` NULL (only with `buffer_len` 0) or
/// `buffer_len` readable entries; `location` as for `registerLocalMemory`.
#[no_mangle]
pub unsafe extern "C" fn registerLocalMemoryBatch(
    engine: *mut TeEngine,
    buffer_list: *mut BufferEntry,
    buffer_len: usize,
    location: *const c_char,
) -> c_int {
    run("registerLocalMemoryBatch", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: the caller guarantees `buffer_list` is NULL only with `buffer_len` 0 or
        // `buffer_len` readable entries, unchanged during the call, which is `c_array`'s contract.
        let list = unsafe { array(buffer_list.cast_const(), buffer_len, "buffer_list")? };
        // SAFETY: NULL or NUL-terminated.
        let location = unsafe { opt_str(location, "location")? };
        let eng = te.engine()?;
        for (i, b) in list.iter().enumerate() {
            let registered = non_null(b.addr, "addr").and_then(|()| {
                let loc = location_of(location, b.addr as u64);
                // SAFETY: the caller keeps the memory valid until it unregisters it.
                unsafe { eng.register_memory(b.addr.cast(), b.length, &loc) }
            });
            if let Err(e) = registered {
                for done in &list[..i] {
                    if let Err(undo) = eng.unregister_memory(done.addr.cast()) {
                        log::warn!("registerLocalMemoryBatch: undoing {:p}: {undo}", done.addr);
                    }
                }
                return Err(Error::new(e.code(), format!("buffer {i}: {}", e.context())));
            }
        }
        Ok(0)
    })
}

/// Unregisters several buffers; all are tried, the first error is returned.
///
/// # Safety
/// `engine` as for every call; `addr_list` NULL (only with `addr_len` 0) or `addr_len`
/// readable pointers.
#[no_mangle]
pub unsafe extern "C" fn unregisterLocalMemoryBatch(
    engine: *mut TeEngine,
    addr_list: *mut *mut c_void,
    addr_len: usize,
) -> c_int {
    run("unregisterLocalMemoryBatch", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: the caller guarantees `addr_list` is NULL only with `addr_len` 0 or `addr_len`
        // readable pointers, unchanged during the call, which is `c_array`'s contract.
        let list = unsafe { array(addr_list.cast_const(), addr_len, "addr_list")? };
        let eng = te.engine()?;
        let mut first = Ok(());
        for (i, &a) in list.iter().enumerate() {
            let done = non_null(a, "addr").and_then(|()| eng.unregister_memory(a.cast()));
            if let Err(e) = done {
                log::warn!("unregisterLocalMemoryBatch: buffer {i} ({a:p}): {e}");
                first = first.and(Err(e));
            }
        }
        first.map(|()| 0)
    })
}

// ---------------------------------------------------------------- transfers

/// Allocates a batch of `batch_size` tasks; `INVALID_BATCH` on failure.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn allocateBatchID(engine: *mut TeEngine, batch_size: usize) -> u64 {
    run_value("allocateBatchID", INVALID_BATCH, || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let id = te.engine()?.allocate_batch(batch_size)?;
        te.batches.locked().insert(id, BatchInfo::default());
        Ok(id)
    })
}

/// Submits `count` requests to a batch; a status code.
///
/// # Safety
/// `engine` as for every call; `entries` NULL (only with `count` 0) or `count`
/// readable requests; every source buffer must stay valid and untouched until its task
/// is final.
#[no_mangle]
pub unsafe extern "C" fn submitTransfer(
    engine: *mut TeEngine,
    batch_id: u64,
    entries: *mut TransferRequest,
    count: usize,
) -> c_int {
    run_status("submitTransfer", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: the caller guarantees `entries` is NULL only with `count` 0 or `count` readable
        // requests, unchanged during the call, which is `c_array`'s contract.
        let entries = unsafe { array(entries.cast_const(), count, "entries")? };
        // SAFETY: submitTransfer's contract (transfer_engine_c.h): the caller keeps every
        // source buffer valid and untouched until its task is final.
        unsafe { te.submit(batch_id, entries, None) }
    })
}

/// As `submitTransfer`, sending `notify_msg` to the first request's segment once the
/// batch is complete.
///
/// # Safety
/// As `submitTransfer`; both strings of `notify_msg` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn submitTransferWithNotify(
    engine: *mut TeEngine,
    batch_id: u64,
    entries: *mut TransferRequest,
    count: usize,
    notify_msg: NotifyMsg,
) -> c_int {
    run_status("submitTransferWithNotify", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: `notify_msg.name` and `.msg` are NULL or NUL-terminated strings unchanged during
        // the call, as the caller guarantees; that is what `opt_str` and `c_str` need (`c_str`
        // rejects NULL).
        let (name, msg) = unsafe {
            (
                opt_str(notify_msg.name, "notify_msg.name")?,
                c_str(notify_msg.msg, "notify_msg.msg")?,
            )
        };
        // SAFETY: the caller guarantees `entries` is NULL only with `count` 0 or `count` readable
        // requests, unchanged during the call, which is `c_array`'s contract.
        let entries = unsafe { array(entries.cast_const(), count, "entries")? };
        let target = entries
            .first()
            .ok_or_else(|| Error::invalid("no requests to notify about"))?
            .target_id;
        let name = match name {
            Some(n) => n.to_owned(),
            None => te.engine()?.segment_name().to_owned(),
        };
        let note = PendingNotify {
            target,
            name,
            msg: msg.to_owned(),
        };
        // SAFETY: submitTransfer's contract (transfer_engine_c.h): the caller keeps every
        // source buffer valid and untouched until its task is final.
        unsafe { te.submit(batch_id, entries, Some(note)) }
    })
}

/// Writes a task's state into `*status`; a status code.
///
/// # Safety
/// `engine` as for every call; `status` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn getTransferStatus(
    engine: *mut TeEngine,
    batch_id: u64,
    task_id: usize,
    status: *mut TransferStatus,
) -> c_int {
    run_status("getTransferStatus", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        non_null(status, "status")?;
        let eng = te.engine()?;
        let st = eng.task_status(batch_id, task_id)?;
        // SAFETY: `status` is non-null (checked above) and the caller guarantees a non-null
        // `status` is a writable transfer_status.
        unsafe {
            *status = TransferStatus {
                status: st.state as c_int,
                transferred_bytes: st.bytes,
            }
        };
        if st.state.is_final() && te.pending_notifies.load(Ordering::Relaxed) > 0 {
            te.settle_notify(eng, batch_id);
        }
        Ok(())
    })
}

/// Frees a batch whose tasks are all final; a status code (4 while busy).
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn freeBatchID(engine: *mut TeEngine, batch_id: u64) -> c_int {
    run_status("freeBatchID", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let eng = te.engine()?;
        // Sends the batch's notification if every task completed (and drops it if
        // every task is final but some did not). With tasks running the batch is busy,
        // and stays so even if they finish right after this look: freeing it then
        // would lose the notification.
        if te.pending_notifies.load(Ordering::Relaxed) > 0 && !te.settle_notify(eng, batch_id) {
            return Err(Error::new(
                Code::BatchBusy,
                format!("batch {batch_id} has unfinished tasks"),
            ));
        }
        eng.free_batch(batch_id)?;
        te.batches.locked().remove(&batch_id);
        Ok(())
    })
}

// ---------------------------------------------------------------- notifications

/// Duplicates `s` with `malloc`; NULL if out of memory.
fn malloc_str(s: &str) -> *mut c_char {
    // SAFETY: plain allocation; the result is checked before use.
    let p = unsafe { libc::malloc(s.len() + 1) }.cast::<c_char>();
    if !p.is_null() {
        // SAFETY: `p` holds `s.len() + 1` bytes, disjoint from `s`.
        unsafe {
            std::ptr::copy_nonoverlapping(s.as_ptr(), p.cast::<u8>(), s.len());
            *p.add(s.len()) = 0;
        }
    }
    p
}

/// Takes every received notification as a `malloc`ed array (NULL when none).
///
/// # Safety
/// `engine` as for every call; `size` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn getNotifsFromEngine(
    engine: *mut TeEngine,
    size: *mut c_int,
) -> *mut NotifyMsg {
    run_value("getNotifsFromEngine", std::ptr::null_mut(), || {
        non_null(size, "size")?;
        // SAFETY: `size` is non-null (checked just above) and the caller guarantees a non-null
        // `size` is a writable int.
        unsafe { *size = 0 };
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let notes = te.engine()?.take_notifications();
        if notes.is_empty() {
            return Ok(std::ptr::null_mut());
        }
        let n = c_int::try_from(notes.len())
            .map_err(|_| Error::new(Code::Internal, "too many notifications"))?;
        // SAFETY: plain allocation of `n` entries (no overflow: `n` is small); checked.
        let array = unsafe { libc::calloc(notes.len(), std::mem::size_of::<NotifyMsg>()) }
            .cast::<NotifyMsg>();
        if array.is_null() {
            return Err(Error::new(
                Code::NoAvailableHandle,
                format!("out of memory for {n} notifications (dropped)"),
            ));
        }
        for (i, note) in notes.iter().enumerate() {
            let entry = NotifyMsg {
                name: malloc_str(&note.from),
                msg: malloc_str(&note.message),
            };
            // SAFETY: `array` holds `notes.len()` zeroed entries; `i` is in range.
            unsafe { array.add(i).write(entry) };
            if entry.name.is_null() || entry.msg.is_null() {
                // SAFETY: the array and what is in it so far came from malloc/calloc.
                unsafe { freeNotifsMsgBuf(array, n) };
                return Err(Error::new(
                    Code::NoAvailableHandle,
                    format!("out of memory for {n} notifications (dropped)"),
                ));
            }
        }
        // SAFETY: `size` was checked non-null at the top of this closure and is a writable int, as
        // the caller guarantees.
        unsafe { *size = n };
        Ok(array)
    })
}

/// Frees what `getNotifsFromEngine` returned.
///
/// # Safety
/// `msg` must be NULL or an array from `getNotifsFromEngine` of `size` entries, not
/// freed before and not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn freeNotifsMsgBuf(msg: *mut NotifyMsg, size: c_int) -> c_int {
    run("freeNotifsMsgBuf", || {
        if msg.is_null() {
            return Ok(0);
        }
        let n = usize::try_from(size)
            .map_err(|_| Error::invalid(format!("size {size} is negative")))?;
        for i in 0..n {
            // SAFETY: `i < size` entries of a malloc'd array whose strings came from
            // malloc (or are NULL, which free ignores); each is freed once.
            unsafe {
                let e = msg.add(i).read();
                libc::free(e.name.cast());
                libc::free(e.msg.cast());
            }
        }
        // SAFETY: the array came from calloc and is freed once.
        unsafe { libc::free(msg.cast()) };
        Ok(0)
    })
}

/// Sends a notification to an opened segment's engine.
///
/// # Safety
/// `engine` as for every call; both strings of `notify_msg` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn genNotifyInEngine(
    engine: *mut TeEngine,
    target_id: u64,
    notify_msg: NotifyMsg,
) -> c_int {
    run("genNotifyInEngine", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: `notify_msg.name` and `.msg` are NULL or NUL-terminated strings unchanged during
        // the call, as the caller guarantees; that is what `opt_str` and `c_str` need (`c_str`
        // rejects NULL).
        let (name, msg) = unsafe {
            (
                opt_str(notify_msg.name, "notify_msg.name")?,
                c_str(notify_msg.msg, "notify_msg.msg")?,
            )
        };
        let target = i32::try_from(target_id)
            .map_err(|_| Error::invalid(format!("target_id {target_id} is not a segment id")))?;
        let eng = te.engine()?;
        let name = name.unwrap_or(eng.segment_name());
        te.send_notify(eng, target, name, msg)?;
        Ok(0)
    })
}

// ---------------------------------------------------------------- diagnostics

/// Looks for RDMA NICs and logs the priority matrix the engine would use.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn discoverTopology(engine: *mut TeEngine) -> c_int {
    run("discoverTopology", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        unsafe { handle(engine)? };
        let verbs = crate::ffi::ibverbs::verbs()?;
        let nics = verbs.device_names();
        if nics.is_empty() {
            return Err(Error::new(
                Code::BackendUnavailable,
                "libibverbs finds no RDMA NIC",
            ));
        }
        log::info!(
            "discoverTopology: NICs {}; priority matrix {}",
            nics.join(", "),
            crate::transport::rdma::discovered_matrix(&nics)
        );
        Ok(0)
    })
}

/// Makes `destroyTransferEngine` wait for unfinished batches first.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn enableGracefulShutdown(engine: *mut TeEngine) {
    run("enableGracefulShutdown", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        unsafe { handle(engine)? }
            .graceful
            .store(true, Ordering::Relaxed);
        Ok(0)
    });
}

/// Writes the engine's protocol and opened segments into `buf_out`.
///
/// # Safety
/// `engine` as for every call; `buf_out` NULL or writable for `buf_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn showLinks(
    engine: *mut TeEngine,
    buf_out: *mut c_char,
    buf_len: usize,
    json: c_int,
) -> c_int {
    run("showLinks", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let (own, protocol) = match te.engine.get() {
            Some(e) => (e.segment_name().to_owned(), e.protocol().name()),
            None => (String::new(), "(not started)"),
        };
        let mut opened: Vec<(i32, String)> = te
            .segments
            .locked()
            .ids
            .iter()
            .map(|(&id, o)| (id, o.name.clone()))
            .collect();
        opened.sort();
        let text = if json != 0 {
            Value::object([
                ("local_segment", Value::from(own)),
                ("protocol", Value::from(protocol)),
                (
                    "segments",
                    Value::Array(
                        opened
                            .into_iter()
                            .map(|(id, name)| {
                                Value::object([
                                    ("id", Value::from(i64::from(id))),
                                    ("name", Value::from(name)),
                                ])
                            })
                            .collect(),
                    ),
                ),
            ])
            .to_string()
        } else {
            let mut s = format!("local segment {own}, protocol {protocol}\n");
            for (id, name) in opened {
                s.push_str(&format!("segment {id} {name}\n"));
            }
            s
        };
        // SAFETY: the caller guarantees `buf_out` is NULL or writable for `buf_len` bytes, which is
        // `write_out`'s contract (it rejects NULL).
        unsafe { write_out(&text, buf_out, buf_len, "the links") }
    })
}

/// Per-NIC load: not tracked by this engine, so `ERR_NOT_IMPLEMENTED`.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn getNicLoadStats(
    engine: *mut TeEngine,
    _buf_out: *mut c_char,
    _buf_len: usize,
) -> c_int {
    run("getNicLoadStats", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let protocol = te.engine.get().map_or(te.config.protocol, Engine::protocol);
        Err(Error::new(
            Code::NotSupported,
            format!(
                "per-NIC load statistics are not tracked (protocol {}{})",
                protocol.name(),
                if matches!(protocol, Protocol::Rdma | Protocol::Fabric) {
                    ""
                } else {
                    ", no RDMA NICs in use"
                }
            ),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_maps_to_an_upstream_code() {
        let known = [
            ERR_INVALID_ARGUMENT,
            ERR_TOO_MANY_REQUESTS,
            ERR_ADDRESS_NOT_REGISTERED,
            ERR_BATCH_BUSY,
            ERR_DEVICE_NOT_FOUND,
            ERR_ADDRESS_OVERLAPPED,
            ERR_DNS,
            ERR_SOCKET,
            ERR_MALFORMED_JSON,
            ERR_REJECT_HANDSHAKE,
            ERR_METADATA,
            ERR_ENDPOINT,
            ERR_CONTEXT,
            ERR_MEMORY,
            ERR_NOT_IMPLEMENTED,
        ];
        for c in Code::ALL {
            let e = te_error_code(c);
            assert!(known.contains(&e), "{c:?} -> {e}");
            let s = te_status_code(c);
            assert!(
                s > 0 && (s == -e || s == TE_STATUS_NOT_IMPLEMENTED),
                "{c:?}"
            );
        }
    }

    #[test]
    fn create_settings_are_checked() {
        let ok = create_config("P2PHANDSHAKE;workers=3; protocol = tcp", None, None, 0);
        let (cfg, protocol_set) = ok.expect("valid settings");
        assert_eq!(cfg.workers, 3);
        assert_eq!(cfg.protocol, Protocol::Tcp);
        assert!(protocol_set);
        assert_eq!(cfg.bind_address, IpAddr::V4(Ipv4Addr::LOCALHOST));
        for bad in [
            "",
            ";workers=2",
            "P2PHANDSHAKE;workers",
            "P2PHANDSHAKE;rpc_port=1",
        ] {
            assert!(create_config(bad, None, None, 0).is_err(), "{bad:?}");
        }
        assert!(create_config("P2PHANDSHAKE", None, Some("0.0.0.0"), 0).is_err());
        assert!(create_config("P2PHANDSHAKE", None, None, 65536).is_err());
        let (cfg, _) = create_config("P2PHANDSHAKE", None, Some("localhost"), 7).expect("ok");
        assert_eq!(cfg.bind_address, IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert_eq!(cfg.rpc_port, 7);
    }
}
