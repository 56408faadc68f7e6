//! The seam between the engine and the wires. A `Transport` is one way of moving bytes
//! (in-process memcpy, same-host process_vm, TCP; later RDMA verbs, libfabric, device
//! memory). The engine slices requests, picks a transport per slice, and gives each of
//! its worker threads one `TransportWorker` per transport, which it polls.

pub mod fabric;
pub mod local;
pub mod rdma;
pub mod shm;
pub mod tcp;

use crate::util::sync::UnpoisonedRw;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use crate::device::MemoryKind;
use crate::error::Result;
use crate::metadata::SegmentDesc;
use crate::registry::Region;
use crate::util::crc32c::crc32c_append_copying;

/// The monotonic clock at tick resolution (a few ms), for ages that need no more: a
/// read costs a fraction of a precise one, which matters on a per-operation path.
pub(crate) fn coarse_now() -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill; the clock id is constant.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Transfer direction, seen from the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Remote → local.
    Read,
    /// Local → remote.
    Write,
}

/// Transports in order of preference: the engine tries the first one that reaches a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// The peer is this engine: memcpy.
    Local,
    /// Same host, another process: memcpy through a shared mapping or process_vm.
    Shm,
    /// RDMA verbs (InfiniBand, RoCE) through runtime-loaded libibverbs.
    Rdma,
    /// libfabric RMA (AWS EFA in the field) through runtime-loaded libfabric.
    Fabric,
    /// TCP through the peer's data server.
    Tcp,
}

impl Kind {
    /// How many kinds there are (for per-kind tables).
    pub const COUNT: usize = 5;

    /// The kind's short name, as logs and statistics print it.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Local => "local",
            Kind::Shm => "shm",
            Kind::Rdma => "rdma",
            Kind::Fabric => "fabric",
            Kind::Tcp => "tcp",
        }
    }

    fn bit(self) -> u32 {
        1 << (self as u32)
    }
}

/// Settings of the runtime-loaded hardware transports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendConfig {
    /// Address the transport's endpoints bind to (and advertise).
    pub bind: Option<std::net::IpAddr>,
    /// Mooncake's `device_name`: a comma-separated NIC list, or a NIC priority matrix
    /// as JSON; empty means every device found.
    pub devices: String,
    /// libfabric provider, e.g. `efa`, `tcp;ofi_rxm`, `shm`, `sockets`; empty picks one.
    pub fabric_provider: String,
    /// Authenticates the handshakes a transport starts over the engine RPC.
    pub cluster_secret: Option<crate::auth::ClusterSecret>,
}

/// Per-device memory keys a transport obtained when a buffer was registered; published
/// in the buffer's descriptor (`lkey`/`rkey`, indexed like `devices`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegionKeys {
    /// Local keys, one per device.
    pub lkey: Vec<u32>,
    /// Remote keys, one per device.
    pub rkey: Vec<u32>,
    /// For device memory: the IPC export same-host peers map it through.
    pub ipc: Option<crate::device::IpcExport>,
}

/// Where a peer's servers listen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoints {
    /// Its TCP data server.
    pub data: SocketAddr,
    /// Its handshake RPC (`host:port`), for notifications, probes and QP exchanges.
    pub rpc: String,
}

/// A resolved remote segment as transports see it.
pub struct Peer {
    /// The engine's handle for the peer.
    pub id: u64,
    /// The peer's segment name.
    pub name: String,
    desc: RwLock<Arc<SegmentDesc>>,
    endpoints: RwLock<Endpoints>,
    /// Transports that failed permanently for this peer (e.g. process_vm not permitted).
    disabled: AtomicU32,
}

impl Peer {
    /// A peer with handle `id`, descriptor `desc`, reached at `endpoints`.
    pub fn new(id: u64, desc: SegmentDesc, endpoints: Endpoints) -> Peer {
        Peer {
            id,
            name: desc.name.clone(),
            desc: RwLock::new(Arc::new(desc)),
            endpoints: RwLock::new(endpoints),
            disabled: AtomicU32::new(0),
        }
    }

    /// The current descriptor.
    pub fn desc(&self) -> Arc<SegmentDesc> {
        self.desc.read_locked().clone()
    }

    /// Address of the peer's TCP data server.
    pub fn data_addr(&self) -> SocketAddr {
        self.endpoints.read_locked().data
    }

    /// Address of the peer's handshake RPC server.
    pub fn rpc_addr(&self) -> String {
        self.endpoints.read_locked().rpc.clone()
    }

    /// Replaces the descriptor and endpoints after a resync.
    pub fn update(&self, desc: SegmentDesc, endpoints: Endpoints) {
        *self.desc.write_locked() = Arc::new(desc);
        *self.endpoints.write_locked() = endpoints;
    }

    /// Stops using transport `kind` for this peer.
    pub fn disable(&self, kind: Kind) {
        self.disabled.fetch_or(kind.bit(), Ordering::Relaxed);
    }

    /// True when transport `kind` was disabled for this peer.
    pub fn is_disabled(&self, kind: Kind) -> bool {
        self.disabled.load(Ordering::Relaxed) & kind.bit() != 0
    }
}

/// One piece of a transfer request, small enough to move as a unit.
#[derive(Clone)]
pub struct Slice {
    /// The engine's handle for this slice; echoed back in `Finished`.
    pub id: u64,
    /// Read or write.
    pub op: Op,
    /// Local address.
    pub local: u64,
    /// What `local` points at: host memory, or registered device memory that only a
    /// transport whose `carries` accepts the slice may touch (others get it staged).
    pub local_kind: MemoryKind,
    /// Absolute address in the peer segment.
    pub remote: u64,
    /// Bytes to move.
    pub len: u64,
    /// The peer segment.
    pub peer: Arc<Peer>,
    /// When the slice must have completed.
    pub deadline: Instant,
    /// A read whose CRC32C the caller wants (host memory only): a transport that
    /// copies may fold the bytes while it moves them and say so in `Finished::crc`;
    /// otherwise the engine checksums them once they landed.
    pub checksum: bool,
}

/// How a slice ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every byte moved.
    Done,
    /// The peer refused the range (not inside one registered buffer): final.
    Rejected(String),
    /// This path broke (connection lost, permission denied): retry elsewhere.
    PathFailed(String),
    /// The cached descriptor is out of date: resync, revalidate, retry.
    Stale,
    /// No answer in time.
    TimedOut,
}

/// A finished slice, reported back to the engine.
pub struct Finished {
    /// The slice's id.
    pub id: u64,
    /// How it ended.
    pub outcome: Outcome,
    /// The CRC32C of the bytes moved, when the slice asked for it and the transport
    /// computed it on the way.
    pub crc: Option<u32>,
}

impl Finished {
    /// A slice that ended with `outcome`, with no checksum taken on the way.
    pub fn new(id: u64, outcome: Outcome) -> Finished {
        Finished {
            id,
            outcome,
            crc: None,
        }
    }
}

/// Copies `len` host bytes of an `op` from `src` to `dst`. A checksummed read whose
/// two ends do not overlap is folded into its CRC32C in the same pass, returned.
///
/// # Safety
/// `src` must be readable and `dst` writable for `len` bytes.
pub(crate) unsafe fn copy_host(
    op: Op,
    len: u64,
    checksum: bool,
    src: *const u8,
    dst: *mut u8,
) -> Option<u32> {
    let len = len as usize;
    if checksum && op == Op::Read && (src as usize).abs_diff(dst as usize) >= len {
        // SAFETY: the caller's contract, and the ranges are apart.
        return Some(unsafe {
            crc32c_append_copying(0, std::slice::from_raw_parts(src, len), dst)
        });
    }
    // SAFETY: the caller's contract; `copy` tolerates overlapping ends.
    unsafe { std::ptr::copy(src, dst, len) };
    None
}

/// One way of moving bytes, shared by all engine workers.
pub trait Transport: Send + Sync {
    /// Which transport this is.
    fn kind(&self) -> Kind;

    /// Called for each newly registered buffer; returns keys to publish.
    fn register(&self, _region: &Region) -> Result<RegionKeys> {
        Ok(RegionKeys::default())
    }

    /// Called when a buffer is being unregistered, before the engine waits for
    /// in-flight local accesses; must return only once no peer can still reach it
    /// through this transport.
    fn unregister(&self, _region: &Region) {}

    /// Adds what peers need to reach us (ports, devices, host identity).
    fn describe(&self, desc: &mut SegmentDesc);

    /// Whether this transport can move bytes to and from `peer`.
    fn reaches(&self, peer: &SegmentDesc) -> bool;

    /// Whether this transport can move `slice` as it is, in particular when its local
    /// side is device memory (`slice.local_kind`) or the peer's buffer is. The engine
    /// stages a device-memory local side through host memory for transports that say
    /// no, and skips them for a slice when no staging would help.
    fn carries(&self, slice: &Slice) -> bool {
        slice.local_kind.is_host()
    }

    /// Largest slice worth handing over at once.
    fn slice_size(&self) -> u64;

    /// State for one engine worker thread.
    fn new_worker(&self) -> Result<Box<dyn TransportWorker>>;

    /// System calls (or posted work requests) that put requests on the wire since
    /// the transport started: how well small slices are coalesced. 0 where nothing
    /// is sent (memcpy transports).
    fn sends(&self) -> u64 {
        0
    }

    /// Answers a peer's Connection RPC (queue-pair exchange, JSON in and out);
    /// `None` when this transport takes no part in it.
    fn handshake(&self, _request: &str) -> Option<String> {
        None
    }
}

/// The per-worker-thread half of a transport. Never blocks. The defaults fit a
/// synchronous transport, whose `post` always finishes the slice at once.
pub trait TransportWorker: Send {
    /// Starts a slice; may finish it at once by pushing to `done`.
    fn post(&mut self, slice: Slice, done: &mut Vec<Finished>);

    /// Advances in-flight slices; returns whether anything moved.
    fn progress(&mut self, _now: Instant, _done: &mut Vec<Finished>) -> bool {
        false
    }

    /// Slices submitted and not yet finished.
    fn in_flight(&self) -> usize {
        0
    }

    /// Bytes still to move for in-flight slices.
    fn in_flight_bytes(&self) -> u64 {
        0
    }

    /// A descriptor that becomes readable when `progress` has work, for parking.
    fn wait_fd(&self) -> Option<RawFd> {
        None
    }
}
