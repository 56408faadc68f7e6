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
//!   the configured one); afterwards only compatible installs succeed. Its `tcp` is
//!   upstream's, "no RDMA": it also reaches same-host peers through shared memory
//!   (`EngineConfig::same_host_shm`, unless `MC_SAME_HOST_SHM=0` or `;protocol=`).
//! - Upstream errors are its own numbers: [`te_error_code`] maps our [`Code`]s to them,
//!   and [`te_status_code`] to the positive codes of its status-returning calls.
//! - Notifications carry a sender-chosen name, so they are sent here with the RPC
//!   directly rather than through [`Engine::notify`], which always sends our segment
//!   name.
//!
//! This file holds the handle and its bridging; `exports` the C functions.

#![allow(non_snake_case)]

mod exports;
pub use exports::*;

use crate::util::sync::Unpoisoned;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use super::args::{array, c_str, copy_out, non_null, opt_str};
use super::process_bound::ProcessBound;
use super::{guard_value, init_logging};
use crate::engine::config::same_host_shm_from_env;
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

/// `transfer_engine_t`: a [`TeCore`] tied to the process that made it.
pub struct TeEngine(ProcessBound<TeCore>);

/// Settings, the engine once started, and upstream's ids.
pub struct TeCore {
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
    shareable::<TeCore>();
};

/// Borrows the engine behind a handle.
///
/// # Safety
/// `e` must be NULL or a live pointer from `createTransferEngine` that is not destroyed
/// during `'a`.
unsafe fn handle<'a>(e: *mut TeEngine) -> Result<&'a TeCore> {
    non_null(e, "engine")?;
    // SAFETY: `e` is non-null (checked by `non_null`) and the caller guarantees a live handle from
    // createTransferEngine not destroyed during `'a` (transfer_engine_c.h); only shared access is
    // made, which `TeCore: Sync` allows from many threads.
    unsafe { &(*e).0 }.get("transfer engine")
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
        protocol_set |= matches!(key, "protocol" | "upstream_protocol");
    }
    cfg.set("metadata", connection)?;
    cfg.bind_address = bind_address(ip_or_host_name)?;
    cfg.rpc_port = u16::try_from(rpc_port)
        .map_err(|_| Error::invalid(format!("rpc_port {rpc_port} is not a port number")))?;
    cfg.local_server_name = local_server_name.map(str::to_owned);
    Ok((cfg, protocol_set))
}

impl TeEngine {
    fn new(core: TeCore) -> TeEngine {
        TeEngine(ProcessBound::new(core))
    }
}

impl TeCore {
    fn new(config: EngineConfig, protocol_set: bool) -> Result<TeCore> {
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
        Ok(TeCore {
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

impl Drop for TeCore {
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
