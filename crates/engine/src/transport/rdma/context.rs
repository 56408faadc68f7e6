//! State shared by the transport and its workers: NICs, registered regions, rail
//! health, and the passive side of the Connection handshake.

use crate::util::sync::{Unpoisoned, UnpoisonedRw};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Mutex, RwLock};
use std::time::Instant;

use super::nic::{Nic, RegionMrs};
use super::topology::Topology;
use super::verbs::QueuePair;
use super::{MAX_PASSIVE_QPS, RAIL_ERRORS, RAIL_PAUSE, RAIL_WINDOW};
use crate::error::{Code, Error, Result};
use crate::ffi::ibverbs::{self as ibv, Verbs};
use crate::json::{self, Value};

#[derive(Default)]
struct RailHealth {
    errors: VecDeque<Instant>,
    paused_until: Option<Instant>,
}

/// QPs created to answer one peer handshake.
struct PassiveEndpoint {
    qps: Vec<QueuePair>,
}

pub(super) struct RdmaContext {
    pub(super) verbs: &'static Verbs,
    pub(super) nics: Vec<Nic>,
    pub(super) topology: Topology,
    /// The matrix published in the descriptor.
    pub(super) matrix: Value,
    /// Our segment name, learnt from `describe` (the engine names it before publishing).
    pub(super) server_name: RwLock<String>,
    pub(super) regions: RwLock<BTreeMap<u64, RegionMrs>>,
    /// (peer segment, local NIC, remote NIC) → health.
    health: Mutex<HashMap<(String, usize, usize), RailHealth>>,
    passive: Mutex<VecDeque<PassiveEndpoint>>,
}

fn nic_of_path(path: &str) -> &str {
    path.rsplit_once('@').map_or(path, |(_, nic)| nic)
}

impl RdmaContext {
    /// Shared state for opened NICs, with no regions, rail history or passive QPs yet.
    pub(super) fn new(
        verbs: &'static Verbs,
        nics: Vec<Nic>,
        topology: Topology,
        matrix: Value,
    ) -> RdmaContext {
        RdmaContext {
            verbs,
            nics,
            topology,
            matrix,
            server_name: RwLock::default(),
            regions: RwLock::default(),
            health: Mutex::default(),
            passive: Mutex::default(),
        }
    }

    pub(super) fn server_name(&self) -> String {
        self.server_name.read_locked().clone()
    }

    /// Answers a peer's Connection request: creates, connects and keeps QPs paired
    /// with the ones it listed.
    pub(super) fn answer(&self, request: &str) -> String {
        let req = match json::parse(request) {
            Ok(v) => v,
            Err(e) => return refusal(&Value::Null, &format!("bad handshake JSON: {e}")),
        };
        match self.accept(&req) {
            Ok(reply) => reply,
            Err(why) => {
                log::warn!("rdma: refusing handshake: {why}");
                refusal(&req, why.context())
            }
        }
    }

    fn accept(&self, req: &Value) -> Result<String> {
        let field = |k: &str| req.get(k).and_then(Value::as_str).unwrap_or("");
        let peer_path = field("local_nic_path");
        let our_path = field("peer_nic_path");
        let nic_name = nic_of_path(our_path);
        let (index, nic) = self
            .nics
            .iter()
            .enumerate()
            .find(|(_, n)| n.name == nic_name)
            .ok_or_else(|| {
                Error::new(
                    Code::SegmentNotFound,
                    format!("no RDMA device {nic_name:?} here"),
                )
            })?;
        let gid = ibv::parse_gid(field("local_gid"))
            .ok_or_else(|| Error::protocol(format!("bad local_gid {:?}", field("local_gid"))))?;
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
            return Err(Error::protocol(format!(
                "bad qp_num list ({} entries)",
                qpns.len()
            )));
        }
        if !nic.port_active() {
            return Err(Error::new(
                Code::BackendUnavailable,
                format!("port {} of {} is not active", nic.port, nic.name),
            ));
        }
        // On a failure the QPs made so far are dropped, and so destroyed.
        let mut qps = Vec::new();
        for &remote in &qpns {
            let qp = nic.create_qp(&nic.passive_cq)?;
            nic.connect(&qp, remote, gid, lid)?;
            qps.push(qp);
        }
        let ours: Vec<u32> = qps.iter().map(QueuePair::qp_num).collect();
        let mut passive = self.passive.locked();
        passive.push_back(PassiveEndpoint { qps });
        let mut total: usize = passive.iter().map(|p| p.qps.len()).sum();
        while total > MAX_PASSIVE_QPS {
            let Some(old) = passive.pop_front() else {
                break;
            };
            total -= old.qps.len();
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

    pub(super) fn rail_usable(&self, peer: &str, l: usize, r: usize, now: Instant) -> bool {
        let health = self.health.locked();
        match health.get(&(peer.to_owned(), l, r)) {
            Some(h) => h.paused_until.is_none_or(|t| t <= now),
            None => true,
        }
    }

    pub(super) fn rail_failed(&self, peer: &str, l: usize, r: usize, why: &str) {
        let now = Instant::now();
        let mut health = self.health.locked();
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

    pub(super) fn rail_ok(&self, peer: &str, l: usize, r: usize) {
        let mut health = self.health.locked();
        if let Some(h) = health.get_mut(&(peer.to_owned(), l, r)) {
            if h.paused_until.is_some() {
                log::info!("rdma: rail {}->{peer}@{r} works again", self.nics[l].name);
            }
            h.paused_until = None;
            h.errors.clear();
        }
    }

    /// The local region holding `[addr, addr+len)`: its location and per-NIC lkeys.
    pub(super) fn local_keys(&self, addr: u64, len: u64) -> Option<(String, Vec<u32>)> {
        let regions = self.regions.read_locked();
        let (start, r) = regions.range(..=addr).next_back()?;
        let end = addr.checked_add(len)?;
        if end > start + r.len {
            return None;
        }
        let keys = r.mrs.iter().map(|mr| mr.lkey()).collect();
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
