//! RDMA verbs transport: RC queue pairs over runtime-loaded libibverbs.
//!
//! - Start-up opens every device (or those named by `device_name`: a comma list or a
//!   NIC priority matrix as JSON), allocates a PD per device and publishes the devices
//!   `{name, lid, gid}` in the segment descriptor, in NIC-index order.
//! - Every registered buffer is registered on every NIC (in parallel for large ones);
//!   the per-NIC `lkey`/`rkey` arrays go into the descriptor.
//! - A *rail* is (local NIC, remote NIC). Each engine worker keeps an endpoint cache
//!   (one RC QP per peer and rail, least recently used evicted past a cap) and one CQ
//!   per local NIC, polled in `progress`. A QP is connected with Mooncake's Connection
//!   handshake over the peer's RPC port; the passive side is [`RdmaTransport::handshake`].
//! - One RDMA READ/WRITE per slice. The first attempt takes the next rail of the
//!   preferred NICs (round-robin over preferred local × preferred remote, paired); a
//!   retry of the same slice skips every rail it already failed on and walks
//!   preferred, then other NICs. Rail health is shared by all workers: 5 failures in
//!   5 s pause a rail for 30 s, after which the next slice probes it.
//! - Completion errors map to outcomes: transport errors (retry exceeded, flush, a
//!   downed port) → `PathFailed` (the engine retries, here on another rail); a remote
//!   access error → `Stale` once (the engine refreshes the descriptor: keys may have
//!   changed), then `Rejected`; a local protection error → `Rejected`.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::{BackendConfig, Kind, Outcome, Peer, RegionKeys, Slice, Transport, TransportWorker};
use super::{Finished, Op};
use crate::error::{Code, Error, Result};
use crate::ffi::ibverbs::{self as ibv, Verbs};
use crate::json::{self, Value};
use crate::memory::{LocalMemory, Region};
use crate::metadata::descriptor::DeviceDesc;
use crate::metadata::SegmentDesc;
use crate::wire::rpc::{self, RpcType};

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
/// Rail pausing (wire.md): this many failures within the window pause it this long.
const RAIL_ERRORS: usize = 5;
const RAIL_WINDOW: Duration = Duration::from_secs(5);
const RAIL_PAUSE: Duration = Duration::from_secs(30);

const ACCESS: c_int =
    ibv::IBV_ACCESS_LOCAL_WRITE | ibv::IBV_ACCESS_REMOTE_READ | ibv::IBV_ACCESS_REMOTE_WRITE;

fn unavailable(what: impl Into<String>) -> Error {
    Error::new(Code::BackendUnavailable, what)
}

/// One opened HCA port.
struct Nic {
    name: String,
    ctx: *mut ibv::ibv_context,
    pd: *mut ibv::ibv_pd,
    port: u8,
    gid_index: u8,
    lid: u16,
    gid: ibv::ibv_gid,
    mtu: u32,
    /// CQ shared by the QPs created for peers' handshakes (they never post).
    passive_cq: *mut ibv::ibv_cq,
    bytes: AtomicU64,
}

/// A buffer registered on every NIC.
struct RegionMrs {
    len: u64,
    location: String,
    mrs: Vec<*mut ibv::ibv_mr>,
}

/// Where to prefer which NICs: location → (preferred, other) NIC indices.
#[derive(Clone, Debug, Default)]
struct Topology {
    by_location: HashMap<String, (Vec<usize>, Vec<usize>)>,
}

impl Topology {
    /// Parses a priority matrix against a NIC list (names not in it are ignored).
    fn parse(matrix: &Value, nics: &[String]) -> Topology {
        let index = |v: &Value| v.as_str().and_then(|n| nics.iter().position(|x| x == n));
        let mut by_location = HashMap::new();
        for (loc, lists) in matrix.as_object().unwrap_or(&[]) {
            let list = |i: usize| -> Vec<usize> {
                lists
                    .as_array()
                    .and_then(|a| a.get(i))
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(index).collect())
                    .unwrap_or_default()
            };
            by_location.insert(loc.clone(), (list(0), list(1)));
        }
        Topology { by_location }
    }

    /// NICs for a buffer at `location`: its preferred list (else `*`'s, else all)
    /// and the other usable ones.
    fn nics_for(&self, location: &str, count: usize) -> (Vec<usize>, Vec<usize>) {
        let entry = self
            .by_location
            .get(location)
            .or_else(|| self.by_location.get("*"))
            .filter(|(p, _)| !p.is_empty());
        match entry {
            Some((p, o)) => {
                let mut other: Vec<usize> = o.clone();
                // Every NIC stays usable as a last resort.
                other.extend((0..count).filter(|i| !p.contains(i) && !o.contains(i)));
                (p.clone(), other)
            }
            None => ((0..count).collect(), Vec::new()),
        }
    }

    fn to_json(nics: &[String]) -> Value {
        let all: Vec<Value> = nics.iter().map(|n| Value::from(n.as_str())).collect();
        Value::object([(
            "cpu:0",
            Value::Array(vec![Value::Array(all), Value::Array(Vec::new())]),
        )])
    }
}

#[derive(Default)]
struct RailHealth {
    errors: VecDeque<Instant>,
    paused_until: Option<Instant>,
}

/// QPs created to answer one peer handshake.
struct PassiveEndpoint {
    qps: Vec<*mut ibv::ibv_qp>,
}

struct Shared {
    verbs: &'static Verbs,
    nics: Vec<Nic>,
    topology: Topology,
    /// The matrix published in the descriptor.
    matrix: Value,
    /// Our segment name, learnt from `describe` (the engine names it before publishing).
    server_name: RwLock<String>,
    regions: RwLock<BTreeMap<u64, RegionMrs>>,
    /// (peer segment, local NIC, remote NIC) → health.
    health: Mutex<HashMap<(String, usize, usize), RailHealth>>,
    passive: Mutex<VecDeque<PassiveEndpoint>>,
}

// SAFETY: verbs objects may be used from any thread; the raw pointers are owned by
// `Shared` and freed only in its Drop.
unsafe impl Send for Nic {}
unsafe impl Sync for Nic {}
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Drop for Shared {
    fn drop(&mut self) {
        let v = self.verbs;
        // SAFETY: everything here was created by this transport and is freed once.
        unsafe {
            for p in self
                .passive
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .drain(..)
            {
                for qp in p.qps {
                    (v.destroy_qp)(qp);
                }
            }
            for (_, r) in std::mem::take(self.regions.get_mut().unwrap_or_else(|e| e.into_inner()))
            {
                for mr in r.mrs {
                    (v.dereg_mr)(mr);
                }
            }
            for nic in &self.nics {
                (v.destroy_cq)(nic.passive_cq);
                (v.dealloc_pd)(nic.pd);
                (v.close_device)(nic.ctx);
            }
        }
    }
}

pub struct RdmaTransport {
    shared: Arc<Shared>,
}

impl RdmaTransport {
    /// Loads libibverbs (`MC_IBVERBS_LIB` overrides), opens the devices and
    /// allocates their protection domains.
    pub fn start(config: &BackendConfig, _memory: Arc<LocalMemory>) -> Result<RdmaTransport> {
        let verbs = ibv::verbs().map_err(unavailable)?;
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
        let matrix = matrix.unwrap_or_else(|| Topology::to_json(&names));
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
            shared: Arc::new(Shared {
                verbs,
                nics,
                topology,
                matrix,
                server_name: RwLock::default(),
                regions: RwLock::default(),
                health: Mutex::default(),
                passive: Mutex::default(),
            }),
        })
    }

    /// Names of the NICs in use, in descriptor order.
    pub fn nic_names(&self) -> Vec<String> {
        self.shared.nics.iter().map(|n| n.name.clone()).collect()
    }

    /// Bytes this engine moved through each NIC as the requester.
    pub fn nic_bytes(&self) -> Vec<(String, u64)> {
        self.shared
            .nics
            .iter()
            .map(|n| (n.name.clone(), n.bytes.load(Ordering::Relaxed)))
            .collect()
    }
}

fn open_nics(verbs: &'static Verbs, wanted: &[String]) -> Result<Vec<Nic>> {
    let mut count: c_int = 0;
    // SAFETY: verbs calls in their documented order; every object made here is either
    // returned inside a Nic or released before an error returns.
    unsafe {
        let list = (verbs.get_device_list)(&mut count);
        if list.is_null() {
            return Err(unavailable(format!(
                "{} loaded but found no RDMA devices (ibv_get_device_list: {}; \
                 no InfiniBand/RoCE NIC or kernel driver)",
                verbs.library,
                std::io::Error::last_os_error()
            )));
        }
        let mut found: Vec<(String, *mut ibv::ibv_device)> = (0..count.max(0) as usize)
            .map(|i| {
                let d = *list.add(i);
                (ibv::device_name(verbs, d), d)
            })
            .collect();
        let result = (|| {
            if !wanted.is_empty() {
                let mut ordered = Vec::new();
                for w in wanted {
                    match found.iter().find(|(n, _)| n == w) {
                        Some(x) => ordered.push(x.clone()),
                        None => {
                            return Err(unavailable(format!(
                                "RDMA device {w} not found (present: [{}])",
                                found
                                    .iter()
                                    .map(|x| x.0.as_str())
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            )))
                        }
                    }
                }
                found = ordered;
            }
            if found.is_empty() {
                return Err(unavailable(format!(
                    "{} loaded but found no RDMA devices (no InfiniBand/RoCE NIC or driver)",
                    verbs.library
                )));
            }
            let mut nics: Vec<Nic> = Vec::new();
            for (name, dev) in &found {
                match open_nic(verbs, name, *dev) {
                    Ok(n) => nics.push(n),
                    Err(e) if wanted.is_empty() => log::warn!("rdma: skipping {name}: {e}"),
                    Err(e) => {
                        close_nics(verbs, nics);
                        return Err(e);
                    }
                }
            }
            if nics.is_empty() {
                return Err(unavailable("no RDMA device could be opened"));
            }
            Ok(nics)
        })();
        (verbs.free_device_list)(list);
        result
    }
}

unsafe fn close_nics(verbs: &Verbs, nics: Vec<Nic>) {
    for n in nics {
        (verbs.destroy_cq)(n.passive_cq);
        (verbs.dealloc_pd)(n.pd);
        (verbs.close_device)(n.ctx);
    }
}

unsafe fn open_nic(verbs: &Verbs, name: &str, dev: *mut ibv::ibv_device) -> Result<Nic> {
    let os = || std::io::Error::last_os_error();
    let ctx = (verbs.open_device)(dev);
    if ctx.is_null() {
        return Err(unavailable(format!("ibv_open_device({name}): {}", os())));
    }
    let port = 1u8;
    let attr = match verbs.query_port(ctx, port) {
        Ok(a) => a,
        Err(rc) => {
            (verbs.close_device)(ctx);
            return Err(unavailable(format!("ibv_query_port({name}): error {rc}")));
        }
    };
    let gid_index = 0u8;
    let mut gid = ibv::ibv_gid::default();
    if (verbs.query_gid)(ctx, port, c_int::from(gid_index), &mut gid) != 0 {
        (verbs.close_device)(ctx);
        return Err(unavailable(format!("ibv_query_gid({name})")));
    }
    let pd = (verbs.alloc_pd)(ctx);
    if pd.is_null() {
        let e = os();
        (verbs.close_device)(ctx);
        return Err(unavailable(format!("ibv_alloc_pd({name}): {e}")));
    }
    let cq = (verbs.create_cq)(ctx, 16, std::ptr::null_mut(), std::ptr::null_mut(), 0);
    if cq.is_null() {
        let e = os();
        (verbs.dealloc_pd)(pd);
        (verbs.close_device)(ctx);
        return Err(unavailable(format!("ibv_create_cq({name}): {e}")));
    }
    Ok(Nic {
        name: name.to_owned(),
        ctx,
        pd,
        port,
        gid_index,
        lid: attr.lid,
        gid,
        mtu: attr.active_mtu.clamp(ibv::IBV_MTU_1024, ibv::IBV_MTU_4096),
        passive_cq: cq,
        bytes: AtomicU64::new(0),
    })
}

/// Moves a fresh QP through INIT → RTR → RTS towards `remote_qpn` at `gid`/`lid`.
unsafe fn connect_qp(
    verbs: &Verbs,
    nic: &Nic,
    qp: *mut ibv::ibv_qp,
    remote_qpn: u32,
    gid: ibv::ibv_gid,
    lid: u16,
) -> std::result::Result<(), String> {
    let mut a = ibv::ibv_qp_attr {
        qp_state: ibv::IBV_QPS_INIT,
        pkey_index: 0,
        port_num: nic.port,
        qp_access_flags: ACCESS as u32,
        ..Default::default()
    };
    let mask =
        ibv::IBV_QP_STATE | ibv::IBV_QP_PKEY_INDEX | ibv::IBV_QP_PORT | ibv::IBV_QP_ACCESS_FLAGS;
    let rc = (verbs.modify_qp)(qp, &mut a, mask);
    if rc != 0 {
        return Err(format!("modify QP to INIT: error {rc}"));
    }
    let mut a = ibv::ibv_qp_attr {
        qp_state: ibv::IBV_QPS_RTR,
        path_mtu: nic.mtu,
        dest_qp_num: remote_qpn,
        rq_psn: 0,
        max_dest_rd_atomic: 16,
        min_rnr_timer: 12,
        ..Default::default()
    };
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = gid;
    a.ah_attr.grh.hop_limit = 16;
    a.ah_attr.grh.sgid_index = nic.gid_index;
    a.ah_attr.dlid = lid;
    a.ah_attr.port_num = nic.port;
    let mask = ibv::IBV_QP_STATE
        | ibv::IBV_QP_AV
        | ibv::IBV_QP_PATH_MTU
        | ibv::IBV_QP_DEST_QPN
        | ibv::IBV_QP_RQ_PSN
        | ibv::IBV_QP_MAX_DEST_RD_ATOMIC
        | ibv::IBV_QP_MIN_RNR_TIMER;
    let rc = (verbs.modify_qp)(qp, &mut a, mask);
    if rc != 0 {
        return Err(format!("modify QP to RTR: error {rc}"));
    }
    let mut a = ibv::ibv_qp_attr {
        qp_state: ibv::IBV_QPS_RTS,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        sq_psn: 0,
        max_rd_atomic: 16,
        ..Default::default()
    };
    let mask = ibv::IBV_QP_STATE
        | ibv::IBV_QP_TIMEOUT
        | ibv::IBV_QP_RETRY_CNT
        | ibv::IBV_QP_RNR_RETRY
        | ibv::IBV_QP_SQ_PSN
        | ibv::IBV_QP_MAX_QP_RD_ATOMIC;
    let rc = (verbs.modify_qp)(qp, &mut a, mask);
    if rc != 0 {
        return Err(format!("modify QP to RTS: error {rc}"));
    }
    Ok(())
}

unsafe fn create_qp(
    verbs: &Verbs,
    nic: &Nic,
    cq: *mut ibv::ibv_cq,
) -> std::result::Result<*mut ibv::ibv_qp, String> {
    let mut init = ibv::ibv_qp_init_attr {
        qp_context: std::ptr::null_mut(),
        send_cq: cq,
        recv_cq: cq,
        srq: std::ptr::null_mut(),
        cap: ibv::ibv_qp_cap {
            max_send_wr: MAX_WR,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        qp_type: ibv::IBV_QPT_RC,
        sq_sig_all: 0,
    };
    let qp = (verbs.create_qp)(nic.pd, &mut init);
    if qp.is_null() {
        return Err(format!(
            "ibv_create_qp on {}: {}",
            nic.name,
            std::io::Error::last_os_error()
        ));
    }
    Ok(qp)
}

fn port_active(shared: &Shared, nic: &Nic) -> bool {
    // SAFETY: the context is open for the transport's lifetime.
    matches!(unsafe { shared.verbs.query_port(nic.ctx, nic.port) }, Ok(a) if a.state == ibv::IBV_PORT_ACTIVE)
}

fn nic_of_path(path: &str) -> &str {
    path.rsplit_once('@').map_or(path, |(_, nic)| nic)
}

impl Shared {
    fn server_name(&self) -> String {
        self.server_name
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Answers a peer's Connection request: creates, connects and keeps QPs paired
    /// with the ones it listed.
    fn answer(&self, request: &str) -> String {
        let req = match json::parse(request) {
            Ok(v) => v,
            Err(e) => return refusal(&Value::Null, &format!("bad handshake JSON: {e}")),
        };
        match self.accept(&req) {
            Ok(reply) => reply,
            Err(why) => {
                log::warn!("rdma: refusing handshake: {why}");
                refusal(&req, &why)
            }
        }
    }

    fn accept(&self, req: &Value) -> std::result::Result<String, String> {
        let field = |k: &str| req.get(k).and_then(Value::as_str).unwrap_or("");
        let peer_path = field("local_nic_path");
        let our_path = field("peer_nic_path");
        let nic_name = nic_of_path(our_path);
        let (index, nic) = self
            .nics
            .iter()
            .enumerate()
            .find(|(_, n)| n.name == nic_name)
            .ok_or_else(|| format!("no RDMA device {nic_name:?} here"))?;
        let gid = ibv::parse_gid(field("local_gid"))
            .ok_or_else(|| format!("bad local_gid {:?}", field("local_gid")))?;
        let lid = req.get("local_lid").and_then(Value::as_u64).unwrap_or(0) as u16;
        let qpns: Vec<u32> = req
            .get("qp_num")
            .and_then(Value::as_array)
            .unwrap_or(&[])
            .iter()
            .filter_map(Value::as_u64)
            .map(|n| n as u32)
            .collect();
        if qpns.is_empty() || qpns.len() > 64 {
            return Err(format!("bad qp_num list ({} entries)", qpns.len()));
        }
        if !port_active(self, nic) {
            return Err(format!("port {} of {} is not active", nic.port, nic.name));
        }
        let v = self.verbs;
        let mut qps = Vec::new();
        let mut ours = Vec::new();
        for &remote in &qpns {
            // SAFETY: QPs are created on our PD and CQ; on failure all made so far go.
            let made = unsafe {
                create_qp(v, nic, nic.passive_cq).and_then(|qp| {
                    qps.push(qp);
                    connect_qp(v, nic, qp, remote, gid, lid).map(|()| (*qp).qp_num)
                })
            };
            match made {
                Ok(n) => ours.push(n),
                Err(e) => {
                    for qp in qps {
                        // SAFETY: created just above, never shared.
                        unsafe { (v.destroy_qp)(qp) };
                    }
                    return Err(e);
                }
            }
        }
        let mut passive = self.passive.lock().unwrap_or_else(|e| e.into_inner());
        passive.push_back(PassiveEndpoint { qps });
        let mut total: usize = passive.iter().map(|p| p.qps.len()).sum();
        while total > MAX_PASSIVE_QPS {
            let Some(old) = passive.pop_front() else {
                break;
            };
            total -= old.qps.len();
            for qp in old.qps {
                // SAFETY: evicted from the table, so nothing else refers to it.
                unsafe { (v.destroy_qp)(qp) };
            }
        }
        drop(passive);
        log::debug!(
            "rdma: {peer_path} connected to {} ({index}) with QPs {ours:?}",
            nic.name
        );
        Ok(Value::object([
            (
                "local_nic_path",
                Value::from(format!("{}@{}", self.server_name(), nic.name)),
            ),
            ("local_lid", Value::from(nic.lid)),
            ("local_gid", Value::from(ibv::gid_hex(&nic.gid))),
            ("peer_nic_path", Value::from(peer_path)),
            (
                "qp_num",
                Value::Array(ours.into_iter().map(Value::from).collect()),
            ),
            ("ready_ack", Value::Bool(false)),
            ("reply_msg", Value::from("")),
        ])
        .to_string())
    }

    fn rail_usable(&self, peer: &str, l: usize, r: usize, now: Instant) -> bool {
        let health = self.health.lock().unwrap_or_else(|e| e.into_inner());
        match health.get(&(peer.to_owned(), l, r)) {
            Some(h) => h.paused_until.is_none_or(|t| t <= now),
            None => true,
        }
    }

    fn rail_failed(&self, peer: &str, l: usize, r: usize, why: &str) {
        let now = Instant::now();
        let mut health = self.health.lock().unwrap_or_else(|e| e.into_inner());
        let h = health.entry((peer.to_owned(), l, r)).or_default();
        h.errors.push_back(now);
        while h
            .errors
            .front()
            .is_some_and(|t| now.duration_since(*t) > RAIL_WINDOW)
        {
            h.errors.pop_front();
        }
        if h.errors.len() >= RAIL_ERRORS {
            h.errors.clear();
            h.paused_until = Some(now + RAIL_PAUSE);
            log::warn!(
                "rdma: pausing rail {}->{}@{} for {:?} after {RAIL_ERRORS} failures: {why}",
                self.nics[l].name,
                peer,
                r,
                RAIL_PAUSE
            );
        }
    }

    fn rail_ok(&self, peer: &str, l: usize, r: usize) {
        let mut health = self.health.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = health.get_mut(&(peer.to_owned(), l, r)) {
            if h.paused_until.is_some() {
                log::info!("rdma: rail {}->{peer}@{r} works again", self.nics[l].name);
            }
            h.paused_until = None;
            h.errors.clear();
        }
    }

    /// The local region holding `[addr, addr+len)`: its location and per-NIC lkeys.
    fn local_keys(&self, addr: u64, len: u64) -> Option<(String, Vec<u32>)> {
        let regions = self.regions.read().unwrap_or_else(|e| e.into_inner());
        let (start, r) = regions.range(..=addr).next_back()?;
        let end = addr.checked_add(len)?;
        if end > start + r.len {
            return None;
        }
        // SAFETY: the MRs live while they are in the table (we hold its read lock).
        let keys = r.mrs.iter().map(|mr| unsafe { (**mr).lkey }).collect();
        Some((r.location.clone(), keys))
    }
}

fn refusal(req: &Value, why: &str) -> String {
    let field = |k: &str| req.get(k).cloned().unwrap_or(Value::from(""));
    Value::object([
        ("local_nic_path", field("peer_nic_path")),
        ("local_lid", Value::from(0u16)),
        ("local_gid", Value::from("")),
        ("peer_nic_path", field("local_nic_path")),
        ("qp_num", Value::Array(Vec::new())),
        ("ready_ack", Value::Bool(false)),
        ("reply_msg", Value::from(why)),
    ])
    .to_string()
}

struct MrPtr(*mut ibv::ibv_mr);
// SAFETY: an MR handle may be used from any thread.
unsafe impl Send for MrPtr {}

impl Transport for RdmaTransport {
    fn kind(&self) -> Kind {
        Kind::Rdma
    }

    fn register(&self, region: &Region) -> Result<RegionKeys> {
        let s = &self.shared;
        let v = s.verbs;
        let reg = |nic: &Nic| -> std::result::Result<MrPtr, String> {
            // SAFETY: the engine guarantees the range stays valid until unregister.
            let mr =
                unsafe { (v.reg_mr)(nic.pd, region.addr as *mut _, region.len as usize, ACCESS) };
            if mr.is_null() {
                Err(format!(
                    "ibv_reg_mr({:#x}, {} bytes) on {}: {}",
                    region.addr,
                    region.len,
                    nic.name,
                    std::io::Error::last_os_error()
                ))
            } else {
                Ok(MrPtr(mr))
            }
        };
        let results: Vec<std::result::Result<MrPtr, String>> = if region.len >= PARALLEL_REG_BYTES
            && s.nics.len() > 1
        {
            std::thread::scope(|scope| {
                let handles: Vec<_> = s.nics.iter().map(|n| scope.spawn(move || reg(n))).collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err("registration thread panicked".into()))
                    })
                    .collect()
            })
        } else {
            s.nics.iter().map(reg).collect()
        };
        if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
            let e = e.clone();
            for mr in results.into_iter().flatten() {
                // SAFETY: registered just above, not published.
                unsafe { (v.dereg_mr)(mr.0) };
            }
            return Err(Error::new(Code::BackendUnavailable, e));
        }
        let mrs: Vec<*mut ibv::ibv_mr> = results.into_iter().flatten().map(|m| m.0).collect();
        // SAFETY: live MRs.
        let keys = unsafe {
            RegionKeys {
                lkey: mrs.iter().map(|m| (**m).lkey).collect(),
                rkey: mrs.iter().map(|m| (**m).rkey).collect(),
            }
        };
        let old = s.regions.write().unwrap_or_else(|e| e.into_inner()).insert(
            region.addr,
            RegionMrs {
                len: region.len,
                location: region.location.clone(),
                mrs,
            },
        );
        if let Some(old) = old {
            for mr in old.mrs {
                // SAFETY: replaced in the table, so no longer reachable.
                unsafe { (v.dereg_mr)(mr) };
            }
        }
        Ok(keys)
    }

    fn unregister(&self, region: &Region) {
        let s = &self.shared;
        let old = s
            .regions
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&region.addr);
        for mr in old.map(|r| r.mrs).unwrap_or_default() {
            // SAFETY: removed from the table; once deregistered no peer can use its rkey.
            let rc = unsafe { (s.verbs.dereg_mr)(mr) };
            if rc != 0 {
                log::warn!("rdma: ibv_dereg_mr({:#x}): error {rc}", region.addr);
            }
        }
    }

    fn describe(&self, desc: &mut SegmentDesc) {
        let s = &self.shared;
        *s.server_name.write().unwrap_or_else(|e| e.into_inner()) = desc.name.clone();
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

    fn slice_size(&self) -> u64 {
        SLICE_SIZE
    }

    fn new_worker(&self) -> Result<Box<dyn TransportWorker>> {
        let s = &self.shared;
        let mut cqs = Vec::new();
        for nic in &s.nics {
            // SAFETY: plain CQ creation on an open context.
            let cq = unsafe {
                (s.verbs.create_cq)(
                    nic.ctx,
                    CQ_DEPTH,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    0,
                )
            };
            if cq.is_null() {
                let e = std::io::Error::last_os_error();
                for cq in cqs {
                    // SAFETY: created just above.
                    unsafe { (s.verbs.destroy_cq)(cq) };
                }
                return Err(unavailable(format!("ibv_create_cq on {}: {e}", nic.name)));
            }
            cqs.push(cq);
        }
        Ok(Box::new(RdmaWorker {
            shared: s.clone(),
            cqs,
            endpoints: HashMap::new(),
            graveyard: Vec::new(),
            pending: HashMap::new(),
            tried: HashMap::new(),
            stale: HashMap::new(),
            backlog: VecDeque::new(),
            peer_topology: HashMap::new(),
            next_wr: 1,
            rr: 0,
            in_flight_bytes: 0,
            polls: 0,
        }))
    }

    fn handshake(&self, request: &str) -> Option<String> {
        Some(self.shared.answer(request))
    }
}

type RailKey = (u64, usize, usize);

struct Endpoint {
    qp: *mut ibv::ibv_qp,
    outstanding: u32,
    last_used: Instant,
}

struct Pending {
    slice: u64,
    local: u64,
    remote: u64,
    len: u64,
    rail: RailKey,
    peer: Arc<Peer>,
    deadline: Instant,
    detail: String,
}

/// Which rails a slice already failed on (keyed by slice id; the addresses guard
/// against a reused id).
struct Tried {
    local: u64,
    remote: u64,
    rails: Vec<(usize, usize)>,
}

struct RdmaWorker {
    shared: Arc<Shared>,
    /// One CQ per local NIC.
    cqs: Vec<*mut ibv::ibv_cq>,
    endpoints: HashMap<RailKey, Endpoint>,
    /// Endpoints taken out of service; destroyed once nothing is outstanding on them.
    graveyard: Vec<(Endpoint, Instant)>,
    pending: HashMap<u64, Pending>,
    tried: HashMap<u64, Tried>,
    /// Slices that got a remote access error once (answered `Stale`): id → addresses.
    stale: HashMap<u64, (u64, u64)>,
    /// Slices waiting for send-queue room.
    backlog: VecDeque<Slice>,
    /// Each peer's parsed priority matrix, for the descriptor it was parsed from.
    peer_topology: HashMap<u64, (Arc<SegmentDesc>, Topology)>,
    next_wr: u64,
    rr: usize,
    in_flight_bytes: u64,
    polls: u32,
}

// SAFETY: the worker is moved to its thread once; verbs objects are thread-safe.
unsafe impl Send for RdmaWorker {}

enum PostError {
    /// Finish the slice with this outcome.
    Finish(Outcome),
    /// Every usable rail is busy: keep it for later.
    Busy,
}

impl RdmaWorker {
    fn drop_endpoint(&mut self, key: RailKey) {
        if let Some(ep) = self.endpoints.remove(&key) {
            self.graveyard.push((ep, Instant::now()));
        }
    }

    fn reap(&mut self, now: Instant) {
        let v = self.shared.verbs;
        self.graveyard.retain(|(ep, since)| {
            if ep.outstanding == 0 || now.duration_since(*since) > Duration::from_secs(60) {
                // SAFETY: out of service and drained (or given up on).
                unsafe { (v.destroy_qp)(ep.qp) };
                false
            } else {
                true
            }
        });
    }

    /// Connects a QP for (peer, l, r) with the Connection handshake.
    fn connect(
        &mut self,
        peer: &Peer,
        l: usize,
        r: usize,
    ) -> std::result::Result<*mut ibv::ibv_qp, String> {
        let s = self.shared.clone();
        let nic = &s.nics[l];
        if !port_active(&s, nic) {
            return Err(format!(
                "local port {} of {} is not active",
                nic.port, nic.name
            ));
        }
        let desc = peer.desc();
        let dev = desc
            .devices
            .get(r)
            .ok_or_else(|| format!("peer has no device #{r}"))?;
        let v = s.verbs;
        // SAFETY: QP on our PD and this worker's CQ for the NIC.
        let qp = unsafe { create_qp(v, nic, self.cqs[l])? };
        let result = (|| {
            // SAFETY: a fresh QP.
            let qpn = unsafe { (*qp).qp_num };
            let request = Value::object([
                (
                    "local_nic_path",
                    Value::from(format!("{}@{}", s.server_name(), nic.name)),
                ),
                ("local_lid", Value::from(nic.lid)),
                ("local_gid", Value::from(ibv::gid_hex(&nic.gid))),
                (
                    "peer_nic_path",
                    Value::from(format!("{}@{}", peer.name, dev.name)),
                ),
                ("qp_num", Value::Array(vec![Value::from(qpn)])),
                ("ready_ack", Value::Bool(false)),
                ("reply_msg", Value::from("")),
            ])
            .to_string();
            let addr = peer.rpc_addr();
            let reply = rpc::call(&addr, RpcType::Connection, &request, HANDSHAKE_TIMEOUT)
                .map_err(|e| format!("handshake with {addr}: {e}"))?;
            let reply =
                json::parse(&reply).map_err(|e| format!("handshake reply from {addr}: {e}"))?;
            let msg = reply.get("reply_msg").and_then(Value::as_str).unwrap_or("");
            if !msg.is_empty() {
                return Err(format!("{} refused the connection: {msg}", peer.name));
            }
            let remote_qpn = reply
                .get("qp_num")
                .and_then(Value::as_array)
                .and_then(|a| a.first())
                .and_then(Value::as_u64)
                .ok_or_else(|| format!("handshake reply from {addr} has no qp_num"))?;
            let gid_text = reply
                .get("local_gid")
                .and_then(Value::as_str)
                .unwrap_or(&dev.gid);
            let gid =
                ibv::parse_gid(gid_text).ok_or_else(|| format!("bad peer gid {gid_text:?}"))?;
            let lid = reply
                .get("local_lid")
                .and_then(Value::as_u64)
                .map_or(dev.lid, |l| l as u16);
            // SAFETY: our QP, connected once.
            unsafe { connect_qp(v, nic, qp, remote_qpn as u32, gid, lid) }
        })();
        match result {
            Ok(()) => Ok(qp),
            Err(e) => {
                // SAFETY: never used.
                unsafe { (v.destroy_qp)(qp) };
                Err(e)
            }
        }
    }

    /// Makes room in the endpoint cache: evicts the least recently used idle endpoint.
    fn evict(&mut self) {
        if self.endpoints.len() < MAX_ENDPOINTS {
            return;
        }
        let victim = self
            .endpoints
            .iter()
            .filter(|(_, e)| e.outstanding == 0)
            .min_by_key(|(_, e)| e.last_used)
            .map(|(k, _)| *k);
        if let Some(k) = victim {
            self.drop_endpoint(k);
        }
    }

    /// Rails for a slice, best first, skipping failed and paused ones.
    fn rails(
        &mut self,
        slice: &Slice,
        location: &str,
        remote_loc: &str,
        nremote: usize,
    ) -> Vec<(usize, usize)> {
        let s = self.shared.clone();
        let nl = s.nics.len();
        let (lp, lo) = s.topology.nics_for(location, nl);
        let desc = slice.peer.desc();
        let cached = self
            .peer_topology
            .get(&slice.peer.id)
            .filter(|(d, _)| Arc::ptr_eq(d, &desc));
        let (rp, ro) = match cached {
            Some((_, t)) => t.nics_for(remote_loc, nremote),
            None => {
                let names: Vec<String> = desc.devices.iter().map(|d| d.name.clone()).collect();
                let t = Topology::parse(&desc.priority_matrix, &names);
                let r = t.nics_for(remote_loc, nremote);
                self.peer_topology.insert(slice.peer.id, (desc.clone(), t));
                r
            }
        };
        let rr = self.rr;
        self.rr = self.rr.wrapping_add(1);
        let mut order = Vec::new();
        let k = lp.len().max(rp.len());
        for i in 0..k {
            order.push((lp[(rr + i) % lp.len()], rp[(rr + i) % rp.len()]));
        }
        let lall: Vec<usize> = lp.iter().chain(&lo).copied().collect();
        let rall: Vec<usize> = rp.iter().chain(&ro).copied().collect();
        for (i, l) in lall.iter().enumerate() {
            for j in 0..rall.len() {
                order.push((*l, rall[(i + j + rr) % rall.len()]));
            }
        }
        let tried = self
            .tried
            .get(&slice.id)
            .filter(|t| t.local == slice.local && t.remote == slice.remote);
        let now = Instant::now();
        let mut seen = Vec::new();
        order.retain(|rail| {
            let keep = !seen.contains(rail)
                && rail.1 < nremote
                && !tried.is_some_and(|t| t.rails.contains(rail))
                && s.rail_usable(&slice.peer.name, rail.0, rail.1, now);
            seen.push(*rail);
            keep
        });
        order
    }

    fn note_tried(&mut self, id: u64, local: u64, remote: u64, rail: (usize, usize)) {
        let t = self.tried.entry(id).or_insert(Tried {
            local,
            remote,
            rails: Vec::new(),
        });
        if t.local != local || t.remote != remote {
            *t = Tried {
                local,
                remote,
                rails: Vec::new(),
            };
        }
        t.rails.push(rail);
    }

    fn try_post(&mut self, slice: &Slice) -> std::result::Result<(), PostError> {
        let finish = |o| Err(PostError::Finish(o));
        let Some((location, lkeys)) = self.shared.local_keys(slice.local, slice.len) else {
            return finish(Outcome::Rejected(format!(
                "local range {:#x}+{} is not inside a buffer registered with the engine \
                 (RDMA needs registered local memory)",
                slice.local, slice.len
            )));
        };
        let desc = slice.peer.desc();
        let Some(buffer) = desc.buffer_for(slice.remote, slice.len) else {
            return finish(Outcome::Stale);
        };
        let nremote = desc.devices.len().min(buffer.rkey.len());
        if nremote == 0 {
            return finish(Outcome::Rejected(format!(
                "{} publishes no RDMA keys for the buffer at {:#x}",
                slice.peer.name, buffer.addr
            )));
        }
        let remote_loc = buffer.name.clone();
        let rkeys = buffer.rkey.clone();
        drop(desc);
        let rails = self.rails(slice, &location, &remote_loc, nremote);
        if rails.is_empty() {
            return finish(Outcome::PathFailed(format!(
                "no usable RDMA rail to {} (all failed for this slice or paused)",
                slice.peer.name
            )));
        }
        let mut busy = false;
        let mut last_error = String::new();
        for (l, r) in rails {
            let key = (slice.peer.id, l, r);
            if !self.endpoints.contains_key(&key) {
                self.evict();
                match self.connect(&slice.peer, l, r) {
                    Ok(qp) => {
                        self.endpoints.insert(
                            key,
                            Endpoint {
                                qp,
                                outstanding: 0,
                                last_used: Instant::now(),
                            },
                        );
                    }
                    Err(e) => {
                        log::debug!("rdma: connecting rail {l}->{}@{r}: {e}", slice.peer.name);
                        self.shared.rail_failed(&slice.peer.name, l, r, &e);
                        self.note_tried(slice.id, slice.local, slice.remote, (l, r));
                        last_error = e;
                        continue;
                    }
                }
            }
            let ep = self.endpoints.get_mut(&key).expect("endpoint present");
            if ep.outstanding >= MAX_WR {
                busy = true;
                continue;
            }
            let wr_id = self.next_wr;
            self.next_wr += 1;
            let mut sge = ibv::ibv_sge {
                addr: slice.local,
                length: slice.len as u32,
                lkey: lkeys[l],
            };
            let mut wr = ibv::ibv_send_wr {
                wr_id,
                sg_list: &mut sge,
                num_sge: 1,
                opcode: match slice.op {
                    Op::Read => ibv::IBV_WR_RDMA_READ,
                    Op::Write => ibv::IBV_WR_RDMA_WRITE,
                },
                send_flags: ibv::IBV_SEND_SIGNALED,
                ..Default::default()
            };
            wr.rdma.remote_addr = slice.remote;
            wr.rdma.rkey = rkeys[r];
            let mut bad = std::ptr::null_mut();
            // SAFETY: a live, connected QP; `wr` and `sge` outlive the call (the
            // provider copies them into its send queue).
            let rc = unsafe { ibv::post_send(ep.qp, &mut wr, &mut bad) };
            if rc != 0 {
                let e = format!("ibv_post_send on {}: error {rc}", self.shared.nics[l].name);
                self.shared.rail_failed(&slice.peer.name, l, r, &e);
                self.drop_endpoint(key);
                self.note_tried(slice.id, slice.local, slice.remote, (l, r));
                last_error = e;
                continue;
            }
            ep.outstanding += 1;
            ep.last_used = Instant::now();
            self.in_flight_bytes += slice.len;
            self.pending.insert(
                wr_id,
                Pending {
                    slice: slice.id,
                    local: slice.local,
                    remote: slice.remote,
                    len: slice.len,
                    rail: key,
                    peer: slice.peer.clone(),
                    deadline: slice.deadline,
                    detail: format!(
                        "{:?} {:#x}+{} rkey {:#x} via {}->{}#{r}",
                        slice.op,
                        slice.remote,
                        slice.len,
                        rkeys[r],
                        self.shared.nics[l].name,
                        slice.peer.name
                    ),
                },
            );
            return Ok(());
        }
        if busy {
            return Err(PostError::Busy);
        }
        finish(Outcome::PathFailed(format!(
            "no RDMA rail to {} worked: {last_error}",
            slice.peer.name
        )))
    }

    fn complete(&mut self, wc: &ibv::ibv_wc, done: &mut Vec<Finished>) {
        let Some(p) = self.pending.remove(&wc.wr_id) else {
            return; // timed out earlier
        };
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(p.len);
        let (_, l, r) = p.rail;
        if let Some(ep) = self.endpoints.get_mut(&p.rail) {
            ep.outstanding = ep.outstanding.saturating_sub(1);
        } else if let Some((ep, _)) = self.graveyard.iter_mut().find(|(e, _)| {
            // SAFETY: graveyard QPs are alive until reaped.
            unsafe { (*e.qp).qp_num == wc.qp_num }
        }) {
            ep.outstanding = ep.outstanding.saturating_sub(1);
        }
        let s = self.shared.clone();
        let outcome = match wc.status {
            ibv::IBV_WC_SUCCESS => {
                s.nics[l].bytes.fetch_add(p.len, Ordering::Relaxed);
                s.rail_ok(&p.peer.name, l, r);
                self.tried.remove(&p.slice);
                self.stale.remove(&p.slice);
                Outcome::Done
            }
            ibv::IBV_WC_REM_ACCESS_ERR | ibv::IBV_WC_REM_INV_REQ_ERR => {
                self.drop_endpoint(p.rail);
                let why = format!(
                    "{} refused the access ({}): {}",
                    p.peer.name,
                    ibv::wc_status_name(wc.status),
                    p.detail
                );
                // First time: the keys may have changed; let the engine refresh them.
                if self.stale.insert(p.slice, (p.local, p.remote)) != Some((p.local, p.remote)) {
                    log::debug!("rdma: {why}; refreshing the descriptor");
                    Outcome::Stale
                } else {
                    self.stale.remove(&p.slice);
                    self.tried.remove(&p.slice);
                    Outcome::Rejected(why)
                }
            }
            ibv::IBV_WC_LOC_PROT_ERR | ibv::IBV_WC_LOC_LEN_ERR => {
                self.drop_endpoint(p.rail);
                self.tried.remove(&p.slice);
                Outcome::Rejected(format!(
                    "local protection error ({}): {}",
                    ibv::wc_status_name(wc.status),
                    p.detail
                ))
            }
            status => {
                self.drop_endpoint(p.rail);
                let why = format!("{} ({status}): {}", ibv::wc_status_name(status), p.detail);
                // A flushed request only follows the failure that broke the QP.
                if status != ibv::IBV_WC_WR_FLUSH_ERR {
                    s.rail_failed(&p.peer.name, l, r, &why);
                }
                self.note_tried(p.slice, p.local, p.remote, (l, r));
                Outcome::PathFailed(why)
            }
        };
        done.push(Finished {
            id: p.slice,
            outcome,
        });
    }
}

impl TransportWorker for RdmaWorker {
    fn post(&mut self, slice: Slice, done: &mut Vec<Finished>) {
        if slice.len == 0 || slice.len > u32::MAX as u64 {
            done.push(Finished {
                id: slice.id,
                outcome: Outcome::Rejected(format!("slice of {} bytes", slice.len)),
            });
            return;
        }
        if !self.backlog.is_empty() {
            self.backlog.push_back(slice);
            return;
        }
        match self.try_post(&slice) {
            Ok(()) => {}
            Err(PostError::Busy) => self.backlog.push_back(slice),
            Err(PostError::Finish(outcome)) => {
                if outcome != Outcome::Stale {
                    self.tried.remove(&slice.id);
                }
                done.push(Finished {
                    id: slice.id,
                    outcome,
                });
            }
        }
    }

    fn progress(&mut self, now: Instant, done: &mut Vec<Finished>) -> bool {
        let mut moved = false;
        let mut wcs = [ibv::ibv_wc::default(); 64];
        for i in 0..self.cqs.len() {
            loop {
                // SAFETY: our CQ; `wcs` has room for 64 entries.
                let n = unsafe { ibv::poll_cq(self.cqs[i], wcs.len() as c_int, wcs.as_mut_ptr()) };
                if n < 0 {
                    log::error!(
                        "rdma: ibv_poll_cq on {}: error {n}",
                        self.shared.nics[i].name
                    );
                    break;
                }
                for wc in &wcs[..n as usize] {
                    self.complete(wc, done);
                }
                moved |= n > 0;
                if (n as usize) < wcs.len() {
                    break;
                }
            }
        }
        // Slices that waited for send-queue room.
        while let Some(slice) = self.backlog.pop_front() {
            match self.try_post(&slice) {
                Ok(()) => moved = true,
                Err(PostError::Busy) => {
                    self.backlog.push_front(slice);
                    break;
                }
                Err(PostError::Finish(outcome)) => {
                    moved = true;
                    done.push(Finished {
                        id: slice.id,
                        outcome,
                    });
                }
            }
        }
        self.polls = self.polls.wrapping_add(1);
        if !moved && self.polls % 64 == 0 {
            let expired: Vec<u64> = self
                .pending
                .iter()
                .filter(|(_, p)| p.deadline <= now)
                .map(|(id, _)| *id)
                .collect();
            for id in expired {
                if let Some(p) = self.pending.remove(&id) {
                    self.in_flight_bytes = self.in_flight_bytes.saturating_sub(p.len);
                    self.drop_endpoint(p.rail);
                    done.push(Finished {
                        id: p.slice,
                        outcome: Outcome::TimedOut,
                    });
                    moved = true;
                }
            }
            let expired: Vec<usize> = (0..self.backlog.len())
                .filter(|i| self.backlog[*i].deadline <= now)
                .collect();
            for i in expired.into_iter().rev() {
                if let Some(s) = self.backlog.remove(i) {
                    done.push(Finished {
                        id: s.id,
                        outcome: Outcome::TimedOut,
                    });
                }
            }
            self.reap(now);
        }
        moved
    }

    fn in_flight(&self) -> usize {
        self.pending.len() + self.backlog.len()
    }

    fn in_flight_bytes(&self) -> u64 {
        self.in_flight_bytes + self.backlog.iter().map(|s| s.len).sum::<u64>()
    }
}

impl Drop for RdmaWorker {
    fn drop(&mut self) {
        let v = self.shared.verbs;
        // SAFETY: the worker owns its QPs and CQs; QPs go before the CQs they use.
        unsafe {
            for (_, ep) in self.endpoints.drain() {
                (v.destroy_qp)(ep.qp);
            }
            for (ep, _) in self.graveyard.drain(..) {
                (v.destroy_qp)(ep.qp);
            }
            for cq in self.cqs.drain(..) {
                (v.destroy_cq)(cq);
            }
        }
    }
}
