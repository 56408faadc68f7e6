//! libfabric transport (AWS EFA in the field; `tcp;ofi_rxm`, `sockets` and `shm` work on
//! any Linux box): reliable-datagram endpoints with RMA, memory registered per domain,
//! `fi_readmsg`/`fi_writemsg` from the engine workers, completions polled by them.
//! A WRITE asks for `FI_DELIVERY_COMPLETE` where the provider offers it (its completion
//! must mean the bytes are in the target's memory); a READ asks for nothing, as its
//! completion already means the bytes arrived.
//!
//! What peers learn from our descriptor: one `devices` entry per opened domain, named
//! `provider/domain`, whose `gid` is the hex of the serving endpoint's address (what
//! Mooncake publishes as `efa_addr`) and whose `lid` carries the domain's `mr_mode` bits
//! (`FI_MR_VIRT_ADDR` decides whether remote addresses are absolute or offsets). Each
//! buffer's `rkey`/`lkey` holds its key per device. Keys are requested by us from a
//! counter, so they fit the descriptor's 32-bit fields; providers that insist on
//! choosing keys (`FI_MR_PROV_KEY`) must hand out keys below 2^32.
//!
//! Threads: domains are opened `FI_THREAD_SAFE`; each engine worker gets its own
//! endpoint, CQ and AV per domain. The serving endpoint of a manual-progress provider
//! (`tcp;ofi_rxm`, `shm`) is driven by a progress thread, so a READ from a peer
//! completes while this engine is otherwise idle: it sleeps on the CQ's wait
//! descriptor, or (`shm`, which has none) polls on a timer that is short while WRITEs
//! arrive and backs off when idle. Workers poll their CQs while small operations are in
//! flight, yielding the core to software providers, and park on the descriptors when
//! nothing moves.
//!
//! Known provider limits (libfabric 1.17): `shm`'s single-copy (CMA) path checks neither
//! keys nor ranges, so with `shm` only the engine's descriptor check guards remote
//! accesses; `tcp;ofi_rxm` drops the connection after a refused access (the worker
//! replaces its endpoint and reconnects).

mod nic;
mod regions;
mod worker;

use std::ffi::{c_int, CString};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use super::{BackendConfig, Kind, RegionKeys, Transport, TransportWorker};
use crate::error::{Code, Error, Result};
use crate::ffi::fabric::{self as fi, FabricLib};
use crate::json::Value;
use crate::metadata::{DeviceDesc, SegmentDesc};
use crate::registry::{LocalMemory, Region};
use nic::{Device, Nic};
use regions::Registrations;

/// Providers tried in order when none is configured. `shm` is left out: it reaches
/// only this host.
const DEFAULT_PROVIDERS: &[&str] = &["efa", "verbs;ofi_rxm", "tcp;ofi_rxm", "sockets"];
/// Provider override when the engine config names none (e.g. for `mooncake target`).
const PROVIDER_VAR: &str = "MC_FABRIC_PROVIDER";
/// `1` asks providers for FI_HMEM (device memory), `0` never; unset: when a CUDA
/// driver is present.
const HMEM_VAR: &str = "MC_FABRIC_HMEM";
/// Largest slice the engine hands over at once.
const SLICE_SIZE: u64 = 1 << 20;

const BASE_CAPS: u64 =
    fi::FI_RMA | fi::FI_READ | fi::FI_WRITE | fi::FI_REMOTE_READ | fi::FI_REMOTE_WRITE;

/// libfabric RMA transport (AWS EFA and other RMA providers).
pub struct FabricTransport {
    /// The engine's buffers, registered on every NIC (shared with the workers).
    regions: Arc<Registrations>,
    nics: Vec<Arc<Nic>>,
    /// Requested keys (shared with workers for temporary local registrations).
    keys: Arc<AtomicU64>,
    slice_size: u64,
    next_worker: AtomicUsize,
    /// `provider/`, the prefix of our devices' names.
    prefix: String,
}

impl FabricTransport {
    /// Opens the configured NICs and starts the transport.
    pub fn start(config: &BackendConfig, _memory: Arc<LocalMemory>) -> Result<FabricTransport> {
        let lib = fi::library()?;
        let infos = discover(&lib, config)?;
        let mut nics = Vec::with_capacity(infos.len());
        let mut infos = infos.into_iter();
        while let Some(info) = infos.next() {
            // SAFETY: each info is a single fi_dupinfo copy handed over to the Nic.
            match unsafe { Nic::open(lib.clone(), info) } {
                Ok(n) => nics.push(n),
                Err(e) => {
                    for rest in infos {
                        // SAFETY: unopened copies are ours to free.
                        unsafe { (lib.freeinfo)(rest) };
                    }
                    return Err(e);
                }
            }
        }
        let provider = nics.first().map(|n| n.provider.clone()).unwrap_or_default();
        let slice_size = nics
            .iter()
            .map(|n| n.max_msg)
            .min()
            .unwrap_or(SLICE_SIZE)
            .min(SLICE_SIZE);
        log::info!(
            "libfabric {} from {}: {}",
            lib.version_string(),
            lib.library,
            nics.iter()
                .map(|n| n.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        if provider == "sockets" {
            // Seen here with libfabric 1.17: a few hundred RMA operations posted at once
            // to a busy peer, and some never complete (the provider's threads idle).
            log::warn!(
                "libfabric's sockets provider is deprecated upstream and can stall under \
                 load with many operations in flight; prefer tcp;ofi_rxm"
            );
        }
        Ok(FabricTransport {
            regions: Arc::default(),
            nics,
            keys: Arc::new(AtomicU64::new(1)),
            slice_size,
            next_worker: AtomicUsize::new(0),
            prefix: format!("{provider}/"),
        })
    }

    /// The opened domains, as `provider/domain`.
    pub fn devices(&self) -> Vec<String> {
        self.nics.iter().map(|n| n.name.clone()).collect()
    }
}

impl Transport for FabricTransport {
    fn kind(&self) -> Kind {
        Kind::Fabric
    }

    fn register(&self, region: &Region) -> Result<RegionKeys> {
        let device = Device::of_location(&region.location)?;
        let key = self.keys.fetch_add(1, Ordering::Relaxed);
        let mut mrs = Vec::with_capacity(self.nics.len());
        let mut keys = RegionKeys::default();
        // The provider enforces what peers may do (`Access`).
        let mut access = fi::FI_READ | fi::FI_WRITE;
        if region.access.allows_peer(false) {
            access |= fi::FI_REMOTE_READ;
        }
        if region.access.allows_peer(true) {
            access |= fi::FI_REMOTE_WRITE;
        }
        for nic in &self.nics {
            let mr = nic.register(region.addr, region.len, access, key, device)?;
            let k = u32::try_from(mr.key).map_err(|_| {
                Error::new(
                    Code::NotSupported,
                    format!(
                        "{} chose memory key {:#x}, which does not fit the descriptor's 32-bit rkey",
                        nic.name, mr.key
                    ),
                )
            })?;
            keys.rkey.push(k);
            keys.lkey.push(k);
            mrs.push(mr);
        }
        self.regions.insert(region.addr, region.len, mrs);
        Ok(keys)
    }

    fn unregister(&self, region: &Region) {
        // Closing the registrations makes the provider refuse the keys from now on.
        self.regions.remove(region.addr);
    }

    /// Device memory goes through the NICs when its buffer was registered with them
    /// (FI_HMEM; registration refuses device memory a domain cannot take).
    fn carries(&self, slice: &crate::transport::Slice) -> bool {
        slice.local_kind.is_host() || self.regions.view().covers(slice.local, slice.len)
    }

    fn describe(&self, desc: &mut SegmentDesc) {
        desc.protocol = "efa".to_owned();
        for nic in &self.nics {
            desc.devices.push(DeviceDesc {
                name: nic.name.clone(),
                lid: (nic.mr_mode & 0xffff) as u16,
                gid: crate::util::hex::encode(&nic.address),
            });
        }
    }

    fn reaches(&self, peer: &SegmentDesc) -> bool {
        peer.devices
            .iter()
            .any(|d| d.name.starts_with(&self.prefix) && !d.gid.is_empty())
    }

    fn slice_size(&self) -> u64 {
        self.slice_size
    }

    /// Mooncake's EFA variant of the Connection RPC: the caller learns our endpoint
    /// address (`efa_addr`, hex) for the NIC it names. Requests without `efa_addr`
    /// (RDMA queue-pair exchanges) are left to others.
    fn handshake(&self, request: &str) -> Option<String> {
        let req = crate::json::parse(request).ok()?;
        req.get("efa_addr")?;
        let field = |k: &str| req.get(k).cloned().unwrap_or(Value::Null);
        let ours = req
            .get("peer_nic_path")
            .and_then(Value::as_str)
            .unwrap_or("");
        let wanted = ours.rsplit_once('@').map_or("", |(_, nic)| nic);
        let nic = self
            .nics
            .iter()
            .find(|n| n.name == wanted || n.name.split_once('/').is_some_and(|(_, d)| d == wanted))
            .or(self.nics.first())?;
        let addr = crate::util::hex::encode(&nic.address);
        Some(
            Value::object([
                ("local_nic_path", field("peer_nic_path")),
                ("local_lid", Value::from(0u64)),
                ("local_gid", Value::from("")),
                ("peer_nic_path", field("local_nic_path")),
                ("qp_num", Value::Array(Vec::new())),
                ("ready_ack", Value::from(true)),
                ("reply_msg", Value::from("")),
                ("efa_addr", Value::from(addr.as_str())),
            ])
            .to_string(),
        )
    }

    fn new_worker(&self) -> Result<Box<dyn TransportWorker>> {
        let first = self.next_worker.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(worker::FabricWorker::new(
            &self.nics,
            first,
            self.prefix.clone(),
            self.keys.clone(),
            self.regions.clone(),
        )?))
    }
}

fn providers(config: &BackendConfig) -> Vec<String> {
    let configured = if config.fabric_provider.is_empty() {
        std::env::var(PROVIDER_VAR).unwrap_or_default()
    } else {
        config.fabric_provider.clone()
    };
    if configured.trim().is_empty() {
        DEFAULT_PROVIDERS.iter().map(|p| p.to_string()).collect()
    } else {
        vec![configured.trim().to_owned()]
    }
}

fn want_hmem() -> bool {
    match std::env::var(HMEM_VAR).as_deref() {
        Ok("1") | Ok("true") | Ok("yes") => true,
        Ok("0") | Ok("false") | Ok("no") => false,
        _ => crate::ffi::loader::open_first(&["libcuda.so.1"]).is_ok(),
    }
}

/// NIC names from `device_name`: a comma list or a priority matrix (every name in it).
fn device_filter(devices: &str) -> Vec<String> {
    let t = devices.trim();
    if t.starts_with('{') {
        let mut names = Vec::new();
        if let Ok(v) = crate::json::parse(t) {
            collect_strings(&v, &mut names);
        }
        names
    } else {
        t.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    }
}

fn collect_strings(v: &crate::json::Value, out: &mut Vec<String>) {
    if let Some(s) = v.as_str() {
        if !out.iter().any(|o| o == s) {
            out.push(s.to_owned());
        }
    } else if let Some(a) = v.as_array() {
        a.iter().for_each(|x| collect_strings(x, out));
    } else if let Some(o) = v.as_object() {
        o.iter().for_each(|(_, x)| collect_strings(x, out));
    }
}

/// One `fi_getinfo` query.
struct Query<'a> {
    provider: &'a str,
    caps: u64,
    mr_mode: c_int,
    op_flags: u64,
    node: Option<&'a CString>,
}

/// Runs a query; returns the answer list (to be freed) or the error code.
fn getinfo(lib: &FabricLib, q: &Query) -> std::result::Result<*mut fi::fi_info, c_int> {
    let hints = lib.allocinfo();
    if hints.is_null() {
        return Err(-libc::ENOMEM);
    }
    let prov = CString::new(q.provider).map_err(|_| -libc::EINVAL)?;
    // SAFETY: `hints` is a fresh info with all attribute structs allocated; the
    // provider name is strdup'ed because fi_freeinfo frees it.
    unsafe {
        (*hints).caps = q.caps;
        (*hints).mode = fi::FI_CONTEXT | fi::FI_CONTEXT2;
        (*(*hints).ep_attr).type_ = fi::FI_EP_RDM;
        (*(*hints).tx_attr).op_flags = q.op_flags;
        let da = (*hints).domain_attr;
        (*da).mr_mode = q.mr_mode;
        (*da).threading = fi::FI_THREAD_SAFE;
        (*(*hints).fabric_attr).prov_name = libc::strdup(prov.as_ptr());
    }
    let mut list: *mut fi::fi_info = std::ptr::null_mut();
    let (node, flags) = match q.node {
        Some(n) => (n.as_ptr(), fi::FI_SOURCE),
        None => (std::ptr::null(), 0),
    };
    // SAFETY: valid hints, node string and out-pointer.
    let rc = unsafe {
        (lib.getinfo)(
            lib.api_version(),
            node,
            std::ptr::null(),
            flags,
            hints,
            &mut list,
        )
    };
    // SAFETY: hints are ours and not used again.
    unsafe { (lib.freeinfo)(hints) };
    if rc != 0 {
        return Err(rc);
    }
    Ok(list)
}

/// Picks one info per domain (first wins), restricted to `filter` when non-empty;
/// returns single-entry copies the caller owns.
fn pick(lib: &FabricLib, list: *mut fi::fi_info, filter: &[String]) -> Vec<*mut fi::fi_info> {
    let mut seen: Vec<String> = Vec::new();
    let mut out = Vec::new();
    let mut p = list;
    while !p.is_null() {
        // SAFETY: `p` walks a list from fi_getinfo.
        let s = unsafe { fi::summarize(p) };
        let wanted = filter.is_empty() || filter.iter().any(|f| f == &s.domain);
        if wanted && !seen.contains(&s.domain) {
            // SAFETY: fi_dupinfo copies one entry (its `next` is NULL).
            let copy = unsafe { (lib.dupinfo)(p) };
            if !copy.is_null() {
                seen.push(s.domain);
                out.push(copy);
            }
        }
        // SAFETY: `p` is non-null (loop condition) and still an entry of the fi_getinfo list, which
        // the caller frees only after `pick` returns.
        p = unsafe { (*p).next };
    }
    out
}

/// Finds the domains to open: the configured (or first working default) provider,
/// asked with the least demanding registration mode it accepts.
fn discover(lib: &FabricLib, config: &BackendConfig) -> Result<Vec<*mut fi::fi_info>> {
    let filter = device_filter(&config.devices);
    let node = config
        .bind
        .filter(|ip| !ip.is_unspecified() && filter.is_empty())
        .and_then(|ip| CString::new(ip.to_string()).ok());
    let hmem = want_hmem();
    let base_modes = [
        fi::FI_MR_VIRT_ADDR | fi::FI_MR_ALLOCATED,
        fi::FI_MR_VIRT_ADDR | fi::FI_MR_ALLOCATED | fi::FI_MR_LOCAL,
        fi::FI_MR_VIRT_ADDR | fi::FI_MR_ALLOCATED | fi::FI_MR_LOCAL | fi::FI_MR_PROV_KEY,
    ];
    let mut tried = Vec::new();
    for provider in providers(config) {
        // shm names endpoints after the node: never give it one.
        let nodes: Vec<Option<&CString>> = if provider.starts_with("shm") || node.is_none() {
            vec![None]
        } else {
            vec![node.as_ref(), None]
        };
        let caps_list: Vec<u64> = if hmem {
            vec![BASE_CAPS | fi::FI_HMEM, BASE_CAPS]
        } else {
            vec![BASE_CAPS]
        };
        let mut last = fi::FI_ENODATA;
        for caps in caps_list {
            for mode in base_modes {
                let mr_mode = if caps & fi::FI_HMEM != 0 {
                    mode | fi::FI_MR_HMEM
                } else {
                    mode
                };
                for op_flags in [fi::FI_DELIVERY_COMPLETE, 0] {
                    for n in &nodes {
                        let q = Query {
                            provider: &provider,
                            caps,
                            mr_mode,
                            op_flags,
                            node: *n,
                        };
                        match getinfo(lib, &q) {
                            Ok(list) => {
                                let picked = pick(lib, list, &filter);
                                // SAFETY: the list is ours; picked entries are copies.
                                unsafe { (lib.freeinfo)(list) };
                                if !picked.is_empty() {
                                    if op_flags == 0 {
                                        log::warn!(
                                            "libfabric {provider}: no FI_DELIVERY_COMPLETE; \
                                             a WRITE may complete before the target sees it"
                                        );
                                    }
                                    return Ok(picked);
                                }
                            }
                            Err(rc) => last = -rc,
                        }
                    }
                }
            }
        }
        tried.push(format!("{provider} ({})", lib.strerror(last as i64)));
    }
    Err(Error::new(
        Code::BackendUnavailable,
        format!(
            "no libfabric provider offers RMA on reliable-datagram endpoints{}{}: tried {} \
             (libfabric {} from {}; set fabric_provider or {PROVIDER_VAR})",
            if filter.is_empty() { "" } else { " on " },
            filter.join(","),
            tried.join(", "),
            lib.version_string(),
            lib.library
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_filters() {
        assert_eq!(device_filter(" lo , eth0,"), vec!["lo", "eth0"]);
        assert_eq!(
            device_filter(r#"{"cpu:0": [["efa0", "efa1"], ["efa2"]], "cuda:0": [["efa0"], []]}"#),
            vec!["efa0", "efa1", "efa2"]
        );
        assert!(device_filter("").is_empty());
    }

    #[test]
    fn device_locations() {
        assert_eq!(Device::of_location("cpu:0"), Ok(None));
        assert_eq!(Device::of_location("*"), Ok(None));
        assert_eq!(
            Device::of_location("cuda:3"),
            Ok(Some(Device {
                iface: fi::FI_HMEM_CUDA,
                id: 3
            }))
        );
        assert!(Device::of_location("cuda:x").is_err());
        assert!(Device::of_location("npu:0").is_err());
    }
}
