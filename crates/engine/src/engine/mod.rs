//! The transfer engine: a local segment of registered buffers, remote segments,
//! batches of read/write requests, and the worker threads that move them.

pub mod batch;
pub mod config;
pub mod fallback;
pub mod inbox;
mod own_copy;
mod rpc;
pub mod segments;
mod worker;

use crate::util::sync::{Unpoisoned, UnpoisonedRw};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

pub use crate::registry::Access;
pub use batch::{TaskState, TaskStatus};
pub use config::{EngineConfig, Protocol};
pub use fallback::ProtocolFallback;
pub use inbox::{Inbox, Notification};

use crate::error::{Code, Error, Result};
use crate::memfd::{SharedMemory, Sharing};
use crate::metadata::{self, BufferDesc, RpcMeta, SegmentDesc};
use crate::net::ConnServer;
use crate::registry::LocalMemory;
use crate::transport::local::LocalTransport;
use crate::transport::shm::ShmTransport;
use crate::transport::tcp::TcpTransport;
use crate::transport::{Kind, Op, RegionKeys, Slice, Transport};
use crate::wire::rpc::RpcType;
use batch::Batch;
use segments::{Published, Segments};
use worker::{Counters, WorkItem, Worker, WorkerConfig, WorkerHandle};

/// Handle of an opened segment.
pub type SegmentId = u64;
/// Handle of an allocated batch.
pub type BatchId = u64;

/// One transfer: `len` bytes between `local` and `remote` (an absolute address
/// published by the peer segment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Read from or write to the peer.
    pub op: Op,
    /// Address of the local buffer.
    pub local: u64,
    /// The peer segment, from `open_segment`.
    pub segment: SegmentId,
    /// Absolute address in the peer segment.
    pub remote: u64,
    /// Bytes to move.
    pub len: u64,
}

const RPC_TIMEOUT: Duration = Duration::from_secs(5);
/// Synchronous transfers of at most this many bytes run on the calling thread: a
/// hand-off to a worker and back costs more than moving them. Larger ones go to the
/// workers when there are several to spread their slices over (see `runs_inline`).
const INLINE_MAX_BYTES: u64 = 1 << 20;
/// Calling threads that may run transfers at once, each with its own transport state
/// (TCP connections to each peer it reached); more concurrent callers use the workers.
const MAX_INLINE_RUNNERS: usize = 8;
/// Most tasks one batch may hold.
const MAX_BATCH_TASKS: usize = 1 << 20;

/// A transfer engine: registered memory, peer segments, transports and workers.
pub struct Engine {
    config: EngineConfig,
    /// The protocol the engine runs: `config.protocol`, or TCP after a fallback.
    protocol: Protocol,
    /// Why `protocol` is not the one asked for, when it is not.
    fallback: Option<ProtocolFallback>,
    name: String,
    memory: Arc<LocalMemory>,
    segments: Arc<Segments>,
    transports: Vec<Arc<dyn Transport>>,
    batches: RwLock<HashMap<BatchId, Arc<Batch>>>,
    next_batch: AtomicU64,
    workers: Vec<Arc<WorkerHandle>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    next_worker: AtomicUsize,
    /// The transports that carry this engine's own requests, in order of preference.
    own_transports: Vec<Arc<dyn Transport>>,
    /// Idle poll loops for calling threads that run their transfers themselves, and
    /// how many were made (at most `MAX_INLINE_RUNNERS`).
    inline_runners: Mutex<Vec<Worker>>,
    inline_made: AtomicUsize,
    /// Serializes registration changes so descriptor publishes happen in order.
    registry: Mutex<()>,
    rpc_server: Mutex<Option<ConnServer>>,
    counters: Arc<Counters>,
    /// Per-device memory keys of each registered buffer, as published.
    keys: Mutex<HashMap<u64, RegionKeys>>,
    /// Buffers from `allocate_buffer`, by address.
    owned: Mutex<HashMap<u64, OwnedBuffer>>,
    /// The records this engine published, once it has: only those are removed when
    /// it stops (an engine that failed to start must not unpublish a live namesake).
    published: Option<RpcMeta>,
}

/// Bytes moved per transport and failure counts since the engine started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes moved in-process by the local transport.
    pub local_bytes: u64,
    /// Bytes moved through shared memory to same-host peers.
    pub shm_bytes: u64,
    /// Bytes moved over RDMA verbs.
    pub rdma_bytes: u64,
    /// Bytes moved over libfabric.
    pub fabric_bytes: u64,
    /// Bytes moved over TCP.
    pub tcp_bytes: u64,
    /// Slices re-sent after a path failure or a stale descriptor.
    pub retries: u64,
    /// Slices that ended FAILED or TIMEOUT.
    pub failed_slices: u64,
    /// Submissions handed to a worker thread.
    pub worker_handoffs: u64,
    /// Of those, the ones that had to wake a parked worker.
    pub worker_wakeups: u64,
    /// Synchronous transfers the calling thread ran itself, with no hand-off.
    pub inline_transfers: u64,
    /// Of those, the ones wholly within this engine's own host memory: copied with no
    /// slice planned, posted or polled.
    pub own_copies: u64,
    /// 1 when the engine started over TCP in place of an unavailable hardware
    /// protocol (`protocol_fallback` says which and why), else 0: summed over
    /// engines, how many fell back.
    pub protocol_fallbacks: u64,
    /// System calls that put TCP requests on the wire (each carries one request or a
    /// gathered run of many).
    pub tcp_sends: u64,
}

impl Stats {
    /// The counters as JSON fields, one per counter under its own name.
    fn json_fields(&self) -> impl Iterator<Item = (&'static str, crate::json::Value)> {
        let fields = [
            ("local_bytes", self.local_bytes),
            ("shm_bytes", self.shm_bytes),
            ("rdma_bytes", self.rdma_bytes),
            ("fabric_bytes", self.fabric_bytes),
            ("tcp_bytes", self.tcp_bytes),
            ("retries", self.retries),
            ("failed_slices", self.failed_slices),
            ("worker_handoffs", self.worker_handoffs),
            ("worker_wakeups", self.worker_wakeups),
            ("inline_transfers", self.inline_transfers),
            ("own_copies", self.own_copies),
            ("protocol_fallbacks", self.protocol_fallbacks),
            ("tcp_sends", self.tcp_sends),
        ];
        fields.into_iter().map(|(k, v)| (k, v.into()))
    }
}

impl Engine {
    /// Starts an engine: binds its servers, publishes its segment and spawns workers.
    pub fn new(config: EngineConfig) -> Result<Engine> {
        crate::sys::ignore_sigpipe();
        crate::auth::check_env()?;
        let secret = config.cluster_secret.clone();
        let directory = metadata::open(&config.metadata, &config.cluster_id, secret.as_ref())?;
        let published = Arc::new(Published {
            desc: RwLock::new(SegmentDesc::new("")),
            inbox: Inbox::default(),
        });
        let handshakers = rpc::Handshakers::default();
        let rpc_server = rpc::start(
            SocketAddr::new(config.bind_address, config.rpc_port),
            published.clone(),
            handshakers.clone(),
            secret.clone(),
        )
        .map_err(|e| {
            Error::io(
                format!(
                    "binding rpc port {}:{}",
                    config.bind_address, config.rpc_port
                ),
                e,
            )
        })?;
        let rpc_port = rpc_server.local_addr().port();
        let host = advertised_host(
            config.bind_address,
            config.local_server_name.as_deref(),
            crate::net::default_route_source,
        )?;
        let name = match &config.local_server_name {
            Some(n)
                if directory.is_p2p()
                    && n.rsplit_once(':')
                        .is_none_or(|(_, p)| p.parse::<u16>() != Ok(rpc_port)) =>
            {
                // P2P names are the RPC address itself; a mismatching name would be unreachable.
                let host = segments::host_of(n);
                metadata::directory::join_host_port(host, rpc_port)
            }
            Some(n) => n.clone(),
            None => metadata::directory::join_host_port(&host, rpc_port),
        };
        let memory = Arc::new(LocalMemory::new());
        let data_bind = SocketAddr::new(config.bind_address, 0);
        let mut transports: Vec<Arc<dyn Transport>> =
            vec![Arc::new(LocalTransport::new(memory.clone(), &name))];
        // Both serving transports are always offered to peers; `protocol` only limits
        // which ones this engine's own requests use (see `spawn_workers`).
        match ShmTransport::new() {
            Ok(t) => transports.push(Arc::new(t)),
            Err(e) if config.protocol == Protocol::Shm => return Err(e),
            Err(e) => log::info!("same-host shared memory unavailable: {e}"),
        }
        // A requested hardware backend starts, or the engine runs over TCP saying why
        // (or, when strict, start-up fails saying why).
        let backend = crate::transport::BackendConfig {
            bind: Some(config.bind_address),
            cluster_secret: secret.clone(),
            ..config.backend.clone()
        };
        let asked = if config.force_tcp && config.protocol.is_hardware() {
            log::info!(
                "engine {name}: protocol {} asked, tcp used ({} is set)",
                config.protocol.name(),
                config::FORCE_TCP_VAR
            );
            Protocol::Tcp
        } else {
            config.protocol
        };
        let (protocol, fallback) = match fallback::start_hardware(asked, &backend, &memory) {
            Ok(hardware) => {
                transports.extend(hardware);
                (asked, None)
            }
            Err(e) => {
                let f = fallback::fall_back(
                    config.protocol,
                    e,
                    &config.backend.devices,
                    config.strict_protocol,
                )?;
                log::warn!("engine {name}: {f}");
                (f.used, Some(f))
            }
        };
        let tcp = TcpTransport::start(data_bind, memory.clone(), config.tcp.clone(), secret)?;
        transports.push(Arc::new(tcp));
        let _ = handshakers.set(transports.clone());
        let segments = Arc::new(Segments::new(directory, published));
        let mut engine = Engine {
            protocol,
            fallback,
            name,
            memory,
            segments,
            transports,
            batches: RwLock::default(),
            next_batch: AtomicU64::new(1),
            workers: Vec::new(),
            threads: Mutex::new(Vec::new()),
            next_worker: AtomicUsize::new(0),
            own_transports: Vec::new(),
            inline_runners: Mutex::default(),
            inline_made: AtomicUsize::new(0),
            registry: Mutex::new(()),
            rpc_server: Mutex::new(Some(rpc_server)),
            counters: Arc::default(),
            owned: Mutex::default(),
            keys: Mutex::default(),
            published: None,
            config,
        };
        let desc = engine.build_desc();
        *engine.segments.own.desc.write_locked() = desc.clone();
        let meta = RpcMeta {
            ip_or_host_name: host,
            rpc_port,
        };
        engine.segments.directory.publish(&desc, &meta)?;
        engine.published = Some(meta);
        engine.spawn_workers()?;
        log::info!(
            "engine {} up: rpc {}:{}, tcp data port {}, transports [{}]",
            engine.name,
            engine.config.bind_address,
            rpc_port,
            desc.tcp_data_port,
            engine
                .transports
                .iter()
                .map(|t| t.kind().name())
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(engine)
    }

    fn spawn_workers(&mut self) -> Result<()> {
        self.own_transports = self
            .transports
            .iter()
            .filter(|t| self.carries_own_requests(t.kind()))
            .cloned()
            .collect();
        for i in 0..self.config.workers.max(1) {
            let (handle, worker) = self.new_poll_loop()?;
            let thread = std::thread::Builder::new()
                .name(format!("mc-worker-{i}"))
                .spawn(move || worker.run())
                .map_err(|e| Error::io("spawning worker", e))?;
            self.workers.push(handle);
            self.threads.locked().push(thread);
        }
        Ok(())
    }

    /// A poll loop over this engine's own transports, for a worker thread or a
    /// calling thread.
    fn new_poll_loop(&self) -> Result<(Arc<WorkerHandle>, Worker)> {
        let handle = Arc::new(WorkerHandle::new().map_err(|e| Error::io("creating eventfd", e))?);
        let worker = Worker::new(
            handle.clone(),
            self.own_transports.clone(),
            self.segments.clone(),
            WorkerConfig {
                spin_budget: self.config.spin_budget,
                max_retries: self.config.max_retries,
                counters: self.counters.clone(),
            },
        )?;
        Ok((handle, worker))
    }

    /// Whether a synchronous transfer of `requests` runs on the calling thread (when
    /// a poll loop is free): not when it goes over a hardware protocol (whose
    /// per-thread state is costly), nor when it is large and several workers could
    /// share it. One worker would only do it while the caller sleeps: the caller does
    /// it instead (two wake-ups saved, no idle worker spinning afterwards on a core the
    /// caller wants back), and the bytes land in its host buffer from its own core. A
    /// worker on another core finds the cache lines the caller last read of that
    /// buffer in the caller's core and pays for each: a 4 MiB get over TCP into a
    /// buffer the program had just read took 1.5 ms instead of 0.95 (bench/NOTEBOOK.md).
    /// Each calling thread that runs one keeps its own connections to the peer (up to
    /// `lanes_per_peer`, for at most `MAX_INLINE_RUNNERS` threads at once).
    pub fn runs_inline(&self, requests: &[Request]) -> bool {
        let software = !self.protocol.is_hardware();
        let bytes: u64 = requests.iter().map(|r| r.len).sum();
        software
            && (bytes <= INLINE_MAX_BYTES
                || (self.workers.len() <= 1
                    && (self.host_only(requests) || self.copies_only(requests))))
    }

    /// Whether every request's local side is host memory: device memory over a
    /// network transport is staged through bounce buffers, which each poll loop keeps
    /// its own of, so calling threads leave those to the one worker's.
    fn host_only(&self, requests: &[Request]) -> bool {
        requests
            .iter()
            .all(|r| self.memory.device_of(r.local, r.len).is_host())
    }

    /// A poll loop the calling thread may run `requests` on, or `None` when the
    /// workers should take them (see [`runs_inline`](Self::runs_inline)) or every
    /// runner is busy.
    fn take_inline_runner(&self, requests: &[Request]) -> Option<Worker> {
        if !self.runs_inline(requests) {
            return None;
        }
        let pooled = self.inline_runners.locked().pop();
        if pooled.is_some() {
            return pooled;
        }
        let made = self
            .inline_made
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < MAX_INLINE_RUNNERS).then_some(n + 1)
            });
        if made.is_err() {
            return None;
        }
        match self.new_poll_loop() {
            Ok((_, runner)) => Some(runner),
            Err(e) => {
                self.inline_made.fetch_sub(1, Ordering::Relaxed);
                log::debug!("no poll loop for a calling thread ({e}); the workers take it");
                None
            }
        }
    }

    fn build_desc(&self) -> SegmentDesc {
        let mut desc = SegmentDesc::new(&self.name);
        desc.protocol = "tcp".to_owned();
        desc.timestamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs().to_string())
            .unwrap_or_default();
        for t in &self.transports {
            t.describe(&mut desc);
        }
        let keys = self.keys.locked();
        desc.buffers = self
            .memory
            .snapshot()
            .iter()
            .map(|r| {
                let k = keys.get(&r.addr).cloned().unwrap_or_default();
                // A local buffer is listed (so a peer's error can say why) but with
                // nothing a peer could reach it through.
                let open = r.access != Access::LocalOnly;
                BufferDesc {
                    name: r.location.clone(),
                    addr: r.addr,
                    length: r.len,
                    rkey: if open { k.rkey } else { Vec::new() },
                    lkey: k.lkey,
                    shm_fd: r.shared_fd.filter(|_| open),
                    ipc: k.ipc.filter(|_| open),
                    access: r.access,
                }
            })
            .collect();
        desc
    }

    fn republish(&self) -> Result<()> {
        let desc = self.build_desc();
        *self.segments.own.desc.write_locked() = desc.clone();
        self.segments.directory.republish(&desc)
    }

    /// Publishes this engine's records again (RPC address and descriptor), for a
    /// metadata server that lost them: a restarted master's embedded one starts empty.
    /// Does nothing for an engine that published nothing (P2P, or not started).
    pub fn restore_publication(&self) -> Result<()> {
        let Some(meta) = &self.published else {
            return Ok(());
        };
        // Registration changes republish in order; this one must not interleave.
        let _serial = self.registry.locked();
        let desc = self.build_desc();
        self.segments.directory.publish(&desc, meta)
    }

    /// This engine's segment name (for P2P: `host:rpc_port`).
    pub fn segment_name(&self) -> &str {
        &self.name
    }

    /// The configuration the engine was started with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The protocol the engine runs: the configured one, or TCP when that was a
    /// hardware protocol whose backend is unavailable here (see `protocol_fallback`).
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// [`stats`](Self::stats) as one JSON object, with `protocol` (what the engine
    /// runs) and `same_host_shm` (as [`same_host_shm`](Self::same_host_shm) says).
    pub fn stats_json(&self) -> crate::json::Value {
        use crate::json::Value;
        let state = [
            ("protocol", Value::from(self.protocol.name())),
            ("same_host_shm", Value::Bool(self.same_host_shm())),
        ];
        Value::object(self.stats().json_fields().chain(state))
    }

    /// Whether this engine's own requests reach same-host peers through shared memory
    /// (`auto`, `shm`, or `tcp` with [`EngineConfig::same_host_shm`]).
    pub fn same_host_shm(&self) -> bool {
        self.own_transports.iter().any(|t| t.kind() == Kind::Shm)
    }

    /// Why the engine runs another protocol than the configured one, if it does.
    pub fn protocol_fallback(&self) -> Option<&ProtocolFallback> {
        self.fallback.as_ref()
    }

    /// The port of the handshake/RPC server (what P2PHANDSHAKE peers dial).
    pub fn rpc_port(&self) -> Option<u16> {
        let server = self.rpc_server.locked();
        server.as_ref().map(|s| s.local_addr().port())
    }

    /// Bytes moved per transport and failure counts so far.
    pub fn stats(&self) -> Stats {
        let c = &self.counters;
        let bytes = |k: Kind| c.bytes[k as usize].load(Ordering::Relaxed);
        Stats {
            local_bytes: bytes(Kind::Local),
            shm_bytes: bytes(Kind::Shm),
            rdma_bytes: bytes(Kind::Rdma),
            fabric_bytes: bytes(Kind::Fabric),
            tcp_bytes: bytes(Kind::Tcp),
            retries: c.retries.load(Ordering::Relaxed),
            failed_slices: c.failed_slices.load(Ordering::Relaxed),
            worker_handoffs: c.handoffs.load(Ordering::Relaxed),
            worker_wakeups: c.wakeups.load(Ordering::Relaxed),
            inline_transfers: c.inline_runs.load(Ordering::Relaxed),
            own_copies: c.own_copies.load(Ordering::Relaxed),
            protocol_fallbacks: u64::from(self.fallback.is_some()),
            tcp_sends: self
                .transports
                .iter()
                .filter(|t| t.kind() == Kind::Tcp)
                .map(|t| t.sends())
                .sum(),
        }
    }

    /// The current published descriptor.
    pub fn descriptor(&self) -> SegmentDesc {
        self.segments.own_desc()
    }

    /// Publishes `[addr, addr+len)` so peers can read and write it.
    ///
    /// # Safety
    /// The memory must stay valid, and may be read and written by peers at any time,
    /// until `unregister_memory(addr)` returns.
    pub unsafe fn register_memory(&self, addr: *mut u8, len: usize, location: &str) -> Result<()> {
        self.register_region(addr as u64, len as u64, location, None, Access::ReadWrite)
    }

    /// As [`register_memory`](Self::register_memory), saying what peers may do with
    /// the buffer: [`Access::ReadOnly`] refuses their writes, [`Access::LocalOnly`]
    /// serves only this engine's own transfers. This engine's servers (TCP) and NIC
    /// registrations (RDMA, EFA) enforce it; same-host peers honour it from the
    /// descriptor, but a process of the same user can reach any memory of ours (see
    /// `docs/security.md`).
    ///
    /// # Safety
    /// As `register_memory` (peers' access limited to what `access` allows).
    pub unsafe fn register_memory_with_access(
        &self,
        addr: *mut u8,
        len: usize,
        location: &str,
        access: Access,
    ) -> Result<()> {
        self.register_region(addr as u64, len as u64, location, None, access)
    }

    fn register_region(
        &self,
        addr: u64,
        len: u64,
        location: &str,
        shared_fd: Option<RawFd>,
        access: Access,
    ) -> Result<()> {
        let _serial = self.registry.locked();
        let region = self
            .memory
            .register_with(addr, len, location, shared_fd, access)?;
        let mut keys = RegionKeys::default();
        for (i, t) in self.transports.iter().enumerate() {
            match t.register(&region) {
                Ok(k) => {
                    keys.lkey.extend(k.lkey);
                    keys.rkey.extend(k.rkey);
                    keys.ipc = keys.ipc.or(k.ipc);
                }
                Err(e) => {
                    // Undo what succeeded, so a failed registration leaves nothing behind.
                    drop(self.memory.unregister(region.addr));
                    for done in &self.transports[..i] {
                        done.unregister(&region);
                    }
                    return Err(e);
                }
            }
        }
        self.keys.locked().insert(addr, keys);
        self.republish()
    }

    /// Withdraws a buffer; returns once no transfer, local or from a peer, can touch it.
    pub fn unregister_memory(&self, addr: *mut u8) -> Result<()> {
        let _serial = self.registry.locked();
        let region = self.memory.unregister(addr as u64)?;
        for t in &self.transports {
            t.unregister(&region);
        }
        self.keys.locked().remove(&region.addr);
        self.republish()
    }

    /// Allocates `len` bytes of zeroed, registered memory owned by the engine; free it
    /// with `free_buffer`. Host memory (`cpu:N`) is a shared mapping same-host peers
    /// copy with plain memcpy, the fastest path there is; a device location (`cuda:N`,
    /// `hip:N`, `npu:N`) allocates from that device's driver.
    pub fn allocate_buffer(&self, len: usize, location: &str) -> Result<*mut u8> {
        if len == 0 {
            return Err(Error::invalid("cannot allocate a zero-length buffer"));
        }
        let kind = crate::device::MemoryKind::parse_location(location)?;
        let (buffer, shared_fd) = if kind.is_host() {
            let mem = SharedMemory::create("mooncake-buffer", len, Sharing::PeersWrite)
                .map_err(|e| Error::io(format!("allocating {len} shared bytes"), e))?;
            let fd = mem.fd();
            (OwnedBuffer::Shared(mem), Some(fd))
        } else {
            (
                OwnedBuffer::Device(kind, crate::device::alloc(kind, len)?),
                None,
            )
        };
        let addr = buffer.addr();
        self.register_region(addr, len as u64, location, shared_fd, Access::ReadWrite)?;
        self.owned.locked().insert(addr, buffer);
        Ok(addr as *mut u8)
    }

    /// Unregisters and releases a buffer from `allocate_buffer`.
    pub fn free_buffer(&self, addr: *mut u8) -> Result<()> {
        if !self.owned.locked().contains_key(&(addr as u64)) {
            return Err(Error::invalid(format!(
                "{addr:p} was not allocated by this engine"
            )));
        }
        match self.unregister_memory(addr) {
            Err(e) if e.code() != Code::AddressNotRegistered => return Err(e),
            _ => {}
        }
        self.owned.locked().remove(&(addr as u64));
        Ok(())
    }

    /// Resolves a segment by name (cached after the first call).
    pub fn open_segment(&self, name: &str) -> Result<SegmentId> {
        if name.is_empty() {
            return Err(Error::invalid("empty segment name"));
        }
        Ok(self.segments.open(name)?.id)
    }

    /// The cached descriptor of an opened segment (its buffers, ports, ...).
    pub fn segment_descriptor(&self, segment: SegmentId) -> Result<SegmentDesc> {
        Ok((*self.segments.get(segment)?.desc()).clone())
    }

    /// Refetches a segment's descriptor (after its buffers changed).
    pub fn resync_segment(&self, segment: SegmentId) -> Result<()> {
        let peer = self.segments.get(segment)?;
        self.segments.resync(&peer)
    }

    /// Allocates a batch with room for `capacity` tasks.
    pub fn allocate_batch(&self, capacity: usize) -> Result<BatchId> {
        if capacity == 0 || capacity > MAX_BATCH_TASKS {
            return Err(Error::invalid(format!(
                "batch capacity {capacity} (must be 1..=1048576)"
            )));
        }
        let id = self.next_batch.fetch_add(1, Ordering::Relaxed);
        self.batches
            .write_locked()
            .insert(id, Arc::new(Batch::new(capacity)));
        Ok(id)
    }

    fn batch(&self, id: BatchId) -> Result<Arc<Batch>> {
        self.batches
            .read_locked()
            .get(&id)
            .cloned()
            .ok_or_else(|| Error::new(Code::BatchNotFound, format!("batch {id}")))
    }

    /// Frees a batch; refused while any of its tasks is unfinished.
    pub fn free_batch(&self, id: BatchId) -> Result<()> {
        let mut batches = self.batches.write_locked();
        let batch = batches
            .get(&id)
            .ok_or_else(|| Error::new(Code::BatchNotFound, format!("batch {id}")))?;
        if batch.unfinished() > 0 {
            return Err(Error::new(
                Code::BatchBusy,
                format!("batch {id} has {} unfinished tasks", batch.unfinished()),
            ));
        }
        batches.remove(&id);
        Ok(())
    }

    /// Checks one request and returns its peer; refreshes the peer's descriptor once
    /// when the remote range is unknown (the peer may have registered it since).
    fn validate(&self, r: &Request) -> Result<(Arc<crate::transport::Peer>, Arc<SegmentDesc>)> {
        if r.len == 0 {
            return Err(Error::invalid("zero-length request"));
        }
        if r.local == 0 || r.local.checked_add(r.len).is_none() {
            return Err(Error::invalid(format!(
                "bad local range {:#x}+{}",
                r.local, r.len
            )));
        }
        let peer = self.segments.get(r.segment)?;
        let mut desc = peer.desc();
        if desc.buffer_for(r.remote, r.len).is_none() {
            self.segments.resync(&peer)?;
            desc = peer.desc();
        }
        let Some(buf) = desc.buffer_for(r.remote, r.len) else {
            return Err(Error::new(
                Code::AddressNotRegistered,
                format!(
                    "[{:#x}, +{}) is not inside one registered buffer of {}",
                    r.remote, r.len, peer.name
                ),
            ));
        };
        self.check_access(&peer, buf, r)?;
        Ok((peer, desc))
    }

    /// Refuses, before anything moves, a request the peer's descriptor says it will
    /// refuse (its servers enforce it anyway). Our own segment is not limited.
    fn check_access(
        &self,
        peer: &crate::transport::Peer,
        buf: &BufferDesc,
        r: &Request,
    ) -> Result<()> {
        if peer.name == self.name {
            return Ok(());
        }
        match buf.access.peer_refusal(r.op == Op::Write) {
            None => Ok(()),
            Some((code, what)) => Err(Error::new(
                code,
                format!("{}: buffer at {:#x} {what}", peer.name, buf.addr),
            )),
        }
    }

    /// Every transport serves peers; which ones carry our own requests depends on the
    /// protocol the engine runs (a hardware protocol means that path only).
    fn carries_own_requests(&self, kind: Kind) -> bool {
        match (self.protocol, kind) {
            (_, Kind::Local) => true,
            (Protocol::Auto, k) => matches!(k, Kind::Shm | Kind::Tcp),
            (Protocol::Tcp, k) => k == Kind::Tcp || (k == Kind::Shm && self.config.same_host_shm),
            (Protocol::Shm, k) => k == Kind::Shm,
            (Protocol::Rdma, k) => k == Kind::Rdma,
            (Protocol::Fabric, k) => k == Kind::Fabric,
            // Never the protocol an engine runs (it falls back or does not start).
            (Protocol::NoBackend(_), _) => false,
        }
    }

    fn slice_size_for(&self, peer: &crate::transport::Peer, desc: &SegmentDesc) -> u64 {
        self.first_transport(peer, desc)
            .map_or(self.config.tcp.slice_size, |t| t.slice_size())
            .max(4096)
    }

    /// The transport a slice to `peer` tries first.
    fn first_transport(
        &self,
        peer: &crate::transport::Peer,
        desc: &SegmentDesc,
    ) -> Option<&Arc<dyn Transport>> {
        self.own_transports
            .iter()
            .find(|t| !peer.is_disabled(t.kind()) && t.reaches(desc))
    }

    /// Whether every request goes first to a transport that copies in its `post`
    /// (shared memory, this engine's own segment): nothing to wait for but the copy.
    pub fn copies_only(&self, requests: &[Request]) -> bool {
        requests.iter().all(|r| {
            self.validate(r).is_ok_and(|(peer, desc)| {
                self.first_transport(&peer, &desc)
                    .is_some_and(|t| matches!(t.kind(), Kind::Shm | Kind::Local))
            })
        })
    }

    /// Submits requests to a batch. All are validated first: on error nothing is
    /// submitted.
    ///
    /// # Safety
    /// Each `local..local+len` must stay valid until its task is final; READs write it.
    pub unsafe fn submit(&self, batch: BatchId, requests: &[Request]) -> Result<()> {
        let b = self.batch(batch)?;
        let items = self.plan(&b, requests, std::time::Instant::now())?;
        self.hand_to_workers(items);
        Ok(())
    }

    /// Validates `requests`, reserves their tasks in `batch` and cuts them into
    /// slices due `transfer_timeout` after `now`. On error nothing is reserved.
    fn plan(
        &self,
        batch: &Arc<Batch>,
        requests: &[Request],
        now: std::time::Instant,
    ) -> Result<Vec<WorkItem>> {
        let checksum = batch.wants_checksums();
        let deadline = now + self.config.transfer_timeout;
        // Slices are made as each request is checked, numbered by request until the
        // batch gives the tasks their places (nothing is reserved for a refused one).
        let mut items = Vec::with_capacity(requests.len());
        let mut counts = Vec::with_capacity(requests.len());
        for (i, r) in requests.iter().enumerate() {
            let (peer, desc) = self.validate(r)?;
            let mut size = self.slice_size_for(&peer, &desc);
            // Device memory on the local side (registered as cuda:/hip:/npu:) goes to a
            // transport that moves it natively, or else the worker stages it through
            // host bounce buffers, a bounce per slice. Host memory: one atomic load.
            let local_kind = self.memory.device_of(r.local, r.len);
            if checksum && r.op != Op::Read {
                return Err(Error::invalid("a checksummed transfer only reads"));
            }
            if !local_kind.is_host() {
                size = size.min(crate::device::BOUNCE_SIZE as u64);
            }
            let count = r.len.div_ceil(size);
            let count = u32::try_from(count).map_err(|_| Error::invalid("request too large"))?;
            counts.push(count);
            for off in (0..r.len).step_by(size as usize) {
                items.push(WorkItem {
                    batch: batch.clone(),
                    task: i,
                    slice: Slice {
                        id: 0,
                        op: r.op,
                        local: r.local + off,
                        local_kind,
                        remote: r.remote + off,
                        len: size.min(r.len - off),
                        peer: peer.clone(),
                        deadline,
                        checksum,
                    },
                });
            }
        }
        let bytes = requests.iter().map(|r| r.len).sum();
        let first = batch.reserve(&counts, bytes)?;
        for item in &mut items {
            item.task += first;
        }
        Ok(items)
    }

    /// Deals slices round-robin over the worker threads, one queue push per worker.
    fn hand_to_workers(&self, items: Vec<WorkItem>) {
        let n = self.workers.len();
        let mut per_worker: Vec<Vec<WorkItem>> = (0..n).map(|_| Vec::new()).collect();
        let next = self.next_worker.fetch_add(1, Ordering::Relaxed);
        for (i, item) in items.into_iter().enumerate() {
            per_worker[(next + i) % n].push(item);
        }
        for (w, items) in self.workers.iter().zip(per_worker) {
            if !items.is_empty() {
                self.counters.handoffs.fetch_add(1, Ordering::Relaxed);
                if w.push(items) {
                    self.counters.wakeups.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// The state and bytes of task `task` of `batch`.
    pub fn task_status(&self, batch: BatchId, task: usize) -> Result<TaskStatus> {
        self.batch(batch)?.task_status(task)
    }

    /// Moves `requests` in one batch and returns once each is final: `Ok` when all
    /// completed, else `TRANSFER_FAIL` naming the first task that did not. A small
    /// transfer runs on the calling thread (posted and polled here, no worker woken),
    /// and so does a large one when there is a single worker (see `runs_inline`);
    /// other large ones are handed to the workers and waited for.
    ///
    /// # Safety
    /// As `submit`; the call returns only when no task can touch a local buffer.
    pub unsafe fn transfer_sync(&self, requests: &[Request]) -> Result<()> {
        // SAFETY: this fn's contract is `run_sync`'s.
        let batch = unsafe { self.run_sync(Batch::new(requests.len()), requests) }?;
        for t in 0..requests.len() {
            let state = batch.task_state(t);
            if state != TaskState::Completed {
                return Err(Error::new(
                    Code::TransferFail,
                    format!("task {t} ended {state:?}"),
                ));
            }
        }
        Ok(())
    }

    /// As [`transfer_sync`](Self::transfer_sync), telling each request's final
    /// state (for callers that answer per request, as a store batch does). `Err` only
    /// when nothing was moved: a request was refused before any slice started.
    ///
    /// # Safety
    /// As `submit`; the call returns only when no task can touch a local buffer.
    pub unsafe fn transfer_sync_states(&self, requests: &[Request]) -> Result<Vec<TaskState>> {
        // SAFETY: this fn's contract is `run_sync`'s.
        let batch = unsafe { self.run_sync(Batch::new(requests.len()), requests) }?;
        Ok((0..requests.len()).map(|t| batch.task_state(t)).collect())
    }

    /// Reads `requests` as [`transfer_sync_states`] does, and tells with each completed
    /// one the CRC32C of the bytes it read: computed per slice as the bytes move (a
    /// same-host copy folds them in the same pass; other transports' slices are
    /// checksummed by the worker that finished them, while in its cache), then joined
    /// in order. `None` for a request whose bytes went into device memory without
    /// passing through host memory (no host can read them to checksum). `Err` as for
    /// `transfer_sync_states`, and for a write.
    ///
    /// [`transfer_sync_states`]: Self::transfer_sync_states
    ///
    /// # Safety
    /// As `submit`; the call returns only when no task can touch a local buffer.
    pub unsafe fn read_checksummed(
        &self,
        requests: &[Request],
    ) -> Result<Vec<(TaskState, Option<u32>)>> {
        if requests.len() <= MAX_BATCH_TASKS {
            let mut copied = Vec::with_capacity(requests.len());
            let landed = |_, crc| copied.push((TaskState::Completed, crc));
            // SAFETY: this fn's contract is `copy_own`'s.
            if unsafe { self.copy_own(requests, true, landed) } {
                return Ok(copied);
            }
        }
        // SAFETY: this fn's contract is `run_sync`'s.
        let batch = unsafe { self.run_sync(Batch::checksummed(requests.len()), requests) }?;
        Ok((0..requests.len())
            .map(|t| {
                let state = batch.task_state(t);
                (state, batch.task_checksum(t))
            })
            .collect())
    }

    /// Moves `requests` in `batch` (a batch of their own) and returns it once every
    /// task is final: on this thread when `runs_inline` says so, else through the
    /// workers.
    ///
    /// # Safety
    /// As `submit`; the call returns only when no task can touch a local buffer.
    unsafe fn run_sync(&self, batch: Batch, requests: &[Request]) -> Result<Arc<Batch>> {
        if requests.len() > MAX_BATCH_TASKS {
            return Err(Error::invalid(format!(
                "{} requests in one transfer (at most {MAX_BATCH_TASKS})",
                requests.len()
            )));
        }
        // Never listed: nobody else can ask for it.
        let batch = Arc::new(batch);
        if requests.is_empty() {
            return Ok(batch);
        }
        // (A checksummed batch's caller tried the direct copy already.)
        // SAFETY: this fn's contract.
        if !batch.wants_checksums() && unsafe { self.copy_own(requests, false, |_, _| {}) } {
            return own_copy::mark_copied(&batch, requests).map(|()| batch);
        }
        // One clock read serves the deadlines and the inline poll loop.
        let now = std::time::Instant::now();
        let items = self.plan(&batch, requests, now)?;
        match self.take_inline_runner(requests) {
            Some(mut runner) => {
                runner.run_inline(items, &batch, now);
                self.counters.inline_runs.fetch_add(1, Ordering::Relaxed);
                self.inline_runners.locked().push(runner);
            }
            None => {
                self.hand_to_workers(items);
                // Unbounded: every task has its own deadline (`transfer_timeout_ms`);
                // failures are told per task below.
                let _ = batch.wait(None);
            }
        }
        Ok(batch)
    }

    /// Waits for every submitted task of the batch (None: no limit).
    pub fn wait_batch(&self, batch: BatchId, timeout: Option<Duration>) -> Result<()> {
        self.batch(batch)?.wait(timeout)
    }

    /// Sends a short message to a segment's engine, signed with this engine's name.
    pub fn notify(&self, segment: SegmentId, message: &str) -> Result<()> {
        self.notify_as(segment, &self.name, message)
    }

    /// Sends a short message to a segment's engine under a sender name of the caller's
    /// choosing (Mooncake's notify carries whatever name the application gives).
    pub fn notify_as(&self, segment: SegmentId, name: &str, message: &str) -> Result<()> {
        let peer = self.segments.get(segment)?;
        let body = crate::json::Value::object([
            ("name", crate::json::Value::from(name)),
            ("notify_msg", message.into()),
        ]);
        let reply = crate::wire::rpc::call(
            &peer.rpc_addr(),
            RpcType::Notify,
            &body.to_string(),
            RPC_TIMEOUT,
            self.config.cluster_secret.as_ref(),
        )?;
        // Mooncake peers answer anything; ours say when their inbox had no room.
        if reply.contains("\"dropped") {
            return Err(Error::new(
                Code::NoAvailableHandle,
                format!("{} dropped the notification: its inbox is full", peer.name),
            ));
        }
        Ok(())
    }

    /// Withdraws this engine's records from the metadata service (peers can no longer
    /// find it by name); they are never published again by this engine.
    pub fn unpublish(&self) -> Result<()> {
        match &self.published {
            Some(meta) => self.segments.directory.unpublish(&self.name, meta),
            None => Ok(()),
        }
    }

    /// Notifications dropped because they did not fit the inbox's limits (64 KiB a
    /// message, 4 MiB queued per sender, 64 MiB in all) since the engine started.
    pub fn dropped_notifications(&self) -> u64 {
        self.segments.own.inbox.dropped()
    }

    /// Takes every notification received so far.
    pub fn take_notifications(&self) -> Vec<Notification> {
        self.segments.own.inbox.take_all()
    }

    /// Shows the oldest notification to `f` and removes it only if `f` returns `Ok`
    /// (atomically: concurrent takers never see the same one). `None` when none is queued.
    pub fn take_notification_with<T>(
        &self,
        f: impl FnOnce(&Notification) -> Result<T>,
    ) -> Option<Result<T>> {
        self.segments.own.inbox.take_with(f)
    }

    /// Asks a segment's engine whether it is alive.
    pub fn probe(&self, segment: SegmentId) -> Result<()> {
        let peer = self.segments.get(segment)?;
        let reply = crate::wire::rpc::call(
            &peer.rpc_addr(),
            RpcType::Probe,
            "{}",
            RPC_TIMEOUT,
            self.config.cluster_secret.as_ref(),
        )?;
        if reply.contains("success") {
            Ok(())
        } else {
            Err(Error::new(
                Code::RpcFail,
                format!("probe of {} answered {reply}", peer.name),
            ))
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        for w in &self.workers {
            w.stop();
        }
        for t in self.threads.locked().drain(..) {
            let _ = t.join();
        }
        if let Some(meta) = &self.published {
            if let Err(e) = self.segments.directory.unpublish(&self.name, meta) {
                log::warn!("unpublishing {}: {e}", self.name);
            }
        }
        if let Some(mut s) = self.rpc_server.locked().take() {
            s.shutdown();
        }
        // Engine-owned memory is unmapped only once nothing can reach it any more.
        let owned: Vec<u64> = self.owned.locked().keys().copied().collect();
        for addr in owned {
            if let Err(e) = self.free_buffer(addr as *mut u8) {
                log::warn!("freeing engine buffer {addr:#x}: {e}");
            }
        }
    }
}

/// Memory `allocate_buffer` made; released when dropped (after unregistration).
enum OwnedBuffer {
    Shared(SharedMemory),
    Device(crate::device::MemoryKind, u64),
}

impl OwnedBuffer {
    fn addr(&self) -> u64 {
        match self {
            OwnedBuffer::Shared(m) => m.ptr() as u64,
            OwnedBuffer::Device(_, addr) => *addr,
        }
    }
}

impl Drop for OwnedBuffer {
    fn drop(&mut self) {
        if let OwnedBuffer::Device(kind, addr) = *self {
            // SAFETY: allocated by `device::alloc` and unregistered before the engine
            // drops its record, so nothing reaches it any more.
            if let Err(e) = unsafe { crate::device::free(kind, addr) } {
                log::warn!("freeing device buffer {addr:#x}: {e}");
            }
        }
    }
}

/// The host this engine tells peers to reach it at: the address it binds; for a
/// wildcard bind (0.0.0.0, ::), the host of its configured name, else `route_source`'s
/// answer (this host's address on its default route), else an error asking for a name.
/// A wildcard is never published: no peer can reach it.
fn advertised_host(
    bind: IpAddr,
    name: Option<&str>,
    route_source: impl FnOnce(IpAddr) -> Option<IpAddr>,
) -> Result<String> {
    if !bind.is_unspecified() {
        return Ok(bind.to_string());
    }
    if let Some(n) = name {
        let host = segments::host_of(n);
        if host.parse::<IpAddr>().is_ok_and(|ip| ip.is_unspecified()) {
            return Err(Error::invalid(format!(
                "local_server_name {n:?}: {host} is not an address peers can reach"
            )));
        }
        return Ok(host.to_owned());
    }
    match crate::net::reachable_address(bind, route_source) {
        Some(ip) => Ok(ip.to_string()),
        None => Err(Error::invalid(format!(
            "bind_address {bind} is not an address peers can reach, and this host has no \
             default route to take one from; give a name (local_server_name, `--name HOST:PORT`) \
             or bind a specific address"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wildcard_bind_is_never_published() {
        let any = IpAddr::from([0, 0, 0, 0]);
        let lo = IpAddr::from([127, 0, 0, 1]);
        // A specific address is published as it is; the route is not asked.
        let host = advertised_host(lo, None, |_| panic!("not asked")).unwrap();
        assert_eq!(host, "127.0.0.1");
        // A wildcard takes the name's host, else the default route's address.
        let host = advertised_host(any, Some("127.0.0.7:1234"), |_| None).unwrap();
        assert_eq!(host, "127.0.0.7");
        let host = advertised_host(any, None, |w| {
            assert!(w.is_unspecified());
            Some(IpAddr::from([192, 0, 2, 9]))
        })
        .unwrap();
        assert_eq!(host, "192.0.2.9");
        // A loopback route source is no address for other hosts either.
        assert!(advertised_host(any, None, |_| Some(IpAddr::from([127, 0, 0, 9]))).is_err());
        // No route: refused, naming the way out.
        let e = advertised_host(any, None, |_| None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("0.0.0.0") && e.contains("--name"), "{e}");
        let e = advertised_host(any, None, |_| Some(any)).unwrap_err();
        assert_eq!(e.code(), Code::InvalidParams);
        assert!(advertised_host("::".parse().unwrap(), Some("0.0.0.0:5"), |_| None).is_err());
    }
}
