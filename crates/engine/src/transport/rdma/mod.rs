//! RDMA verbs transport: RC queue pairs over runtime-loaded libibverbs.
//!
//! - Start-up opens every device (or those named by `device_name`: a comma list or a
//!   NIC priority matrix as JSON), allocates a PD per device and publishes the devices
//!   `{name, lid, gid}` in the segment descriptor, in NIC-index order.
//! - Every registered buffer is registered on every NIC (in parallel for large ones);
//!   the per-NIC `lkey`/`rkey` arrays go into the descriptor. Device memory is
//!   registered for GPUDirect RDMA: through a dma-buf export of its allocation
//!   (`ibv_reg_dmabuf_mr`) where the GPU driver and libibverbs offer it, else plain
//!   `ibv_reg_mr` (peer-memory modules); if neither works registration fails, saying
//!   so. Registered device memory then moves NIC to GPU with no staging (`carries`).
//! - Without a `device_name` priority matrix, one is discovered from sysfs: per NUMA
//!   node its NICs first, per GPU the NICs nearest on the PCI tree (`topology.rs`).
//! - A *rail* is (local NIC, remote NIC). Each engine worker keeps an endpoint cache
//!   (one RC QP per peer and rail, least recently used evicted past a cap) and one CQ
//!   per local NIC, polled in `progress` and armed on a completion channel so a parked
//!   worker wakes when a completion arrives. A QP is connected with Mooncake's
//!   Connection handshake over the peer's RPC port, run on a connector thread so the
//!   worker never waits for a peer; the passive side is [`RdmaTransport::handshake`].
//! - One RDMA READ/WRITE per slice. The first attempt takes the next rail of the
//!   preferred NICs (round-robin over preferred local × preferred remote, paired); a
//!   retry of the same slice skips every rail it already failed on and walks
//!   preferred, then other NICs. Rail health is shared by all workers: 5 failures in
//!   5 s pause a rail for 30 s, after which the next slice probes it.
//! - Completion errors map to outcomes: transport errors (retry exceeded, flush, a
//!   downed port) → `PathFailed` (the engine retries, here on another rail); a remote
//!   access error → `Stale` once (the engine refreshes the descriptor: keys may have
//!   changed), then `Rejected`; a local protection error → `Rejected`.

mod context;
mod nic;
mod topology;
pub mod verbs;
mod worker;

use crate::util::sync::UnpoisonedRw;
use std::ffi::c_int;
use std::sync::Arc;
use std::time::Duration;

use super::{BackendConfig, Kind, RegionKeys, Transport, TransportWorker};
use crate::error::{Code, Error, Result};
use crate::ffi::ibverbs as ibv;
use crate::json::{self, Value};
use crate::metadata::descriptor::DeviceDesc;
use crate::metadata::SegmentDesc;
use crate::registry::{LocalMemory, Region};
use context::RdmaContext;
use nic::open_nics;
use topology::Topology;
use worker::RdmaWorker;

/// Mooncake's default slice size for RDMA.
pub const SLICE_SIZE: u64 = 64 << 10;
/// Send queue depth of one QP (outstanding work requests).
const MAX_WR: u32 = 256;
/// Completion queue depth per local NIC per worker.
const CQ_DEPTH: c_int = 4096;
/// Endpoints (QPs) one worker keeps; the least recently used idle one goes first.
const MAX_ENDPOINTS: usize = 256;
/// QPs the passive side keeps for peers before the oldest are destroyed.
const MAX_PASSIVE_QPS: usize = 4096;
/// Buffers at least this large are registered on all NICs in parallel.
const PARALLEL_REG_BYTES: u64 = 64 << 20;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);
/// Connection handshakes one worker runs at once (one connector thread each).
const MAX_HANDSHAKES: usize = 8;
/// Rail pausing (wire.md): this many failures within the window pause it this long.
const RAIL_ERRORS: usize = 5;
const RAIL_WINDOW: Duration = Duration::from_secs(5);
const RAIL_PAUSE: Duration = Duration::from_secs(30);

const ACCESS: c_int =
    ibv::IBV_ACCESS_LOCAL_WRITE | ibv::IBV_ACCESS_REMOTE_READ | ibv::IBV_ACCESS_REMOTE_WRITE;

fn unavailable(what: impl Into<String>) -> Error {
    Error::new(Code::BackendUnavailable, what)
}

/// The priority matrix an RDMA transport would discover for these NICs (for
/// `mooncake info`), as JSON.
pub fn discovered_matrix(nics: &[String]) -> String {
    topology::discover(nics).to_string()
}

/// RDMA verbs transport: one or more NICs, reliable-connected QPs to each peer.
pub struct RdmaTransport {
    shared: Arc<RdmaContext>,
    /// Authenticates the queue-pair exchanges this engine starts.
    secret: Option<crate::auth::ClusterSecret>,
}

impl RdmaTransport {
    /// Loads libibverbs (`MC_IBVERBS_LIB` overrides), opens the devices and
    /// allocates their protection domains.
    pub fn start(config: &BackendConfig, _memory: Arc<LocalMemory>) -> Result<RdmaTransport> {
        let verbs = ibv::verbs()?;
        let spec = config.devices.trim();
        let (wanted, matrix): (Vec<String>, Option<Value>) = if spec.starts_with('{') {
            let m = json::parse(spec)
                .map_err(|e| Error::invalid(format!("device_name priority matrix: {e}")))?;
            let mut names: Vec<String> = Vec::new();
            for (_, lists) in m.as_object().unwrap_or(&[]) {
                for list in lists.as_array().unwrap_or(&[]) {
                    for n in list
                        .as_array()
                        .unwrap_or(&[])
                        .iter()
                        .filter_map(Value::as_str)
                    {
                        if !names.iter().any(|x| x == n) {
                            names.push(n.to_owned());
                        }
                    }
                }
            }
            (names, Some(m))
        } else {
            let names = spec
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
            (names, None)
        };
        let nics = open_nics(verbs, &wanted)?;
        let names: Vec<String> = nics.iter().map(|n| n.name.clone()).collect();
        let matrix = matrix.unwrap_or_else(|| topology::discover(&names));
        let topology = Topology::parse(&matrix, &names);
        log::info!(
            "rdma: {} from {}: {}",
            if nics.len() == 1 {
                "1 device"
            } else {
                "devices"
            },
            verbs.library,
            nics.iter()
                .map(|n| format!("{} (lid {}, gid {})", n.name, n.lid, ibv::gid_hex(&n.gid)))
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(RdmaTransport {
            shared: Arc::new(RdmaContext::new(verbs, nics, topology, matrix)),
            secret: config.cluster_secret.clone(),
        })
    }
}

impl Transport for RdmaTransport {
    fn kind(&self) -> Kind {
        Kind::Rdma
    }

    fn register(&self, region: &Region) -> Result<RegionKeys> {
        nic::register(&self.shared, region)
    }

    fn unregister(&self, region: &Region) {
        nic::unregister(&self.shared, region)
    }

    fn describe(&self, desc: &mut SegmentDesc) {
        let s = &self.shared;
        *s.server_name.write_locked() = desc.name.clone();
        desc.protocol = "rdma".to_owned();
        desc.devices = s
            .nics
            .iter()
            .map(|n| DeviceDesc {
                name: n.name.clone(),
                lid: n.lid,
                gid: ibv::gid_hex(&n.gid),
            })
            .collect();
        desc.priority_matrix = s.matrix.clone();
    }

    fn reaches(&self, peer: &SegmentDesc) -> bool {
        !peer.devices.is_empty() && !self.shared.nics.is_empty()
    }

    /// Device memory registered with the NICs (GPUDirect) moves without staging;
    /// registration refuses device memory the NICs cannot reach.
    fn carries(&self, slice: &super::Slice) -> bool {
        slice.local_kind.is_host()
            || self
                .shared
                .local_keys(slice.local, slice.len)
                .is_some_and(|(_, keys)| !keys.is_empty())
    }

    fn slice_size(&self) -> u64 {
        SLICE_SIZE
    }

    fn new_worker(&self) -> Result<Box<dyn TransportWorker>> {
        Ok(Box::new(RdmaWorker::new(
            self.shared.clone(),
            self.secret.clone(),
        )?))
    }

    fn handshake(&self, request: &str) -> Option<String> {
        Some(self.shared.answer(request))
    }
}
