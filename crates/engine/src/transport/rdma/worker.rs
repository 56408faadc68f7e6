//! A per-thread worker: endpoint cache, completion queues and their event channels,
//! connection set-up off the worker thread, rail choice and retries.
//!
//! Parking: each local NIC's CQ reports to a completion channel of that NIC (a channel
//! serves the CQs of one device context only). The worker's `wait_fd` is an epoll set
//! over those channels and the eventfd the connector threads signal, so one descriptor
//! wakes a parked engine worker for either. A CQ is armed again once its event has
//! been read, and polled once more after arming: a completion that landed between the
//! last poll and the arm raises no event.
//!
//! Connecting: a rail without a QP gets one at once (a local call), and its Connection
//! RPC runs on a connector thread (at most `MAX_HANDSHAKES` per worker; more wait their
//! turn). Slices for the rail wait on it meanwhile; `progress` picks up the reply,
//! connects the QP and posts them, or on failure finishes them `PathFailed`, so the
//! engine retries them on another rail.

use std::collections::{HashMap, VecDeque};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::context::RdmaContext;
use super::nic::Nic;
use super::topology::Topology;
use super::verbs::{CompChannel, CompletionQueue, QueuePair};
use super::{unavailable, CQ_DEPTH, HANDSHAKE_TIMEOUT, MAX_ENDPOINTS, MAX_HANDSHAKES, MAX_WR};
use crate::auth::ClusterSecret;
use crate::error::{Code, Error, Result};
use crate::ffi::ibverbs as ibv;
use crate::json::{self, Value};
use crate::metadata::SegmentDesc;
use crate::sys::{Epoll, EventFd, READABLE};
use crate::transport::{Finished, Op, Outcome, Peer, Slice, TransportWorker};
use crate::wire::rpc::{self, RpcType};

type RailKey = (u64, usize, usize);

/// Token of the connector eventfd in the worker's epoll set (channels use their NIC index).
const CONNECTOR_TOKEN: u64 = u64::MAX;

struct Endpoint {
    qp: QueuePair,
    outstanding: u32,
    last_used: Instant,
}

/// A QP whose Connection handshake is under way, and the slices waiting for it.
struct Connecting {
    qp: QueuePair,
    peer: Arc<Peer>,
    /// The remote device's address from the descriptor, for a reply that omits it.
    gid: String,
    lid: u16,
    waiting: Vec<Slice>,
}

/// A Connection RPC for a connector thread to make.
struct Job {
    key: RailKey,
    addr: String,
    request: String,
}

/// A connector thread's answer: the peer's reply, or why there is none.
struct Reply {
    key: RailKey,
    reply: Result<String>,
}

/// Runs Connection RPCs on their own threads and hands the replies back. Threads still
/// running when the worker goes finish on their own (within HANDSHAKE_TIMEOUT): they
/// hold no verbs objects, only their request, a sender nobody reads any more and the
/// eventfd they share.
struct Connector {
    queue: VecDeque<Job>,
    running: usize,
    tx: mpsc::Sender<Reply>,
    rx: mpsc::Receiver<Reply>,
    /// Signalled after each reply; part of the worker's wait set. Shared with the
    /// threads so that one outliving the worker still writes to a live descriptor.
    wake: Arc<EventFd>,
    /// Authenticates each Connection RPC.
    secret: Option<ClusterSecret>,
}

/// One local NIC's completion queue, reporting to a channel of its own.
struct Cq {
    cq: Arc<CompletionQueue>,
    /// Armed, and its event not read yet.
    armed: bool,
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

/// Where a slice goes: its local keys per local NIC, the remote buffer's keys per
/// remote NIC, and the locations that pick the preferred NICs.
struct Target {
    location: String,
    lkeys: Vec<u32>,
    remote_loc: String,
    rkeys: Vec<u32>,
    nremote: usize,
}

pub(super) struct RdmaWorker {
    shared: Arc<RdmaContext>,
    /// One per local NIC.
    cqs: Vec<Cq>,
    /// The channels' descriptors and the connector's eventfd: what `wait_fd` shows.
    epoll: Epoll,
    endpoints: HashMap<RailKey, Endpoint>,
    /// Rails whose handshake is under way.
    connecting: HashMap<RailKey, Connecting>,
    connector: Connector,
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

enum PostError {
    /// Finish the slice with this outcome.
    Finish(Outcome),
    /// Every usable rail is busy: keep it for later.
    Busy,
}

/// Opens a completion channel (non-blocking) and a CQ reporting to it on `nic`.
fn open_cq(nic: &Nic) -> Result<Arc<CompletionQueue>> {
    let channel = CompChannel::new(&nic.ctx)
        .map_err(|e| unavailable(format!("ibv_create_comp_channel on {}: {e}", nic.name)))?;
    // Events are read in `progress`, which must never block.
    channel.set_nonblocking().map_err(|e| {
        Error::io(
            format!("making the completion channel of {} non-blocking", nic.name),
            e,
        )
    })?;
    CompletionQueue::new(&nic.ctx, CQ_DEPTH, Some(&channel))
        .map_err(|e| unavailable(format!("ibv_create_cq on {}: {e}", nic.name)))
}

impl RdmaWorker {
    /// Creates one CQ and completion channel per local NIC for a new worker.
    pub(super) fn new(s: Arc<RdmaContext>, secret: Option<ClusterSecret>) -> Result<RdmaWorker> {
        let epoll = Epoll::new().map_err(|e| Error::io("epoll for RDMA completions", e))?;
        let wake = EventFd::new().map_err(|e| Error::io("eventfd for RDMA handshakes", e))?;
        epoll
            .add(wake.raw_fd(), READABLE, CONNECTOR_TOKEN)
            .map_err(|e| Error::io("epoll add", e))?;
        let (tx, rx) = mpsc::channel();
        let mut w = RdmaWorker {
            shared: s.clone(),
            cqs: Vec::new(),
            epoll,
            endpoints: HashMap::new(),
            connecting: HashMap::new(),
            connector: Connector {
                queue: VecDeque::new(),
                running: 0,
                tx,
                rx,
                wake: Arc::new(wake),
                secret,
            },
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
        };
        for (i, nic) in s.nics.iter().enumerate() {
            let cq = open_cq(nic)?;
            if let Some(channel) = cq.channel() {
                w.epoll
                    .add(channel.fd(), READABLE, i as u64)
                    .map_err(|e| Error::io("epoll add", e))?;
            }
            w.cqs.push(Cq { cq, armed: false });
        }
        Ok(w)
    }

    fn drop_endpoint(&mut self, key: RailKey) {
        if let Some(ep) = self.endpoints.remove(&key) {
            self.graveyard.push((ep, Instant::now()));
        }
    }

    /// Destroys the endpoints out of service that are drained (or given up on).
    fn reap(&mut self, now: Instant) {
        self.graveyard.retain(|(ep, since)| {
            ep.outstanding != 0 && now.duration_since(*since) <= Duration::from_secs(60)
        });
    }

    /// Starts connecting a QP for `slice`'s peer on rail (l, r), with the slice waiting
    /// for it. Fails at once when the rail cannot work (local port down, no such remote
    /// device, no QP).
    fn start_connect(&mut self, slice: &Slice, l: usize, r: usize) -> Result<()> {
        let s = self.shared.clone();
        let nic = &s.nics[l];
        if !nic.port_active() {
            return Err(Error::new(
                Code::BackendUnavailable,
                format!("local port {} of {} is not active", nic.port, nic.name),
            ));
        }
        let desc = slice.peer.desc();
        let dev = desc
            .devices
            .get(r)
            .ok_or_else(|| Error::new(Code::SegmentNotFound, format!("peer has no device #{r}")))?;
        let qp = nic.create_qp(&self.cqs[l].cq)?;
        let qpn = qp.qp_num();
        let request = Value::object([
            (
                "local_nic_path",
                Value::from(format!("{}@{}", s.server_name(), nic.name)),
            ),
            ("local_lid", Value::from(nic.lid)),
            ("local_gid", Value::from(ibv::gid_hex(&nic.gid))),
            (
                "peer_nic_path",
                Value::from(format!("{}@{}", slice.peer.name, dev.name)),
            ),
            ("qp_num", Value::Array(vec![Value::from(qpn)])),
            ("ready_ack", Value::Bool(false)),
            ("reply_msg", Value::from("")),
        ])
        .to_string();
        let key = (slice.peer.id, l, r);
        self.connecting.insert(
            key,
            Connecting {
                qp,
                peer: slice.peer.clone(),
                gid: dev.gid.clone(),
                lid: dev.lid,
                waiting: vec![slice.clone()],
            },
        );
        self.connector.queue.push_back(Job {
            key,
            addr: slice.peer.rpc_addr(),
            request,
        });
        self.start_handshakes();
        Ok(())
    }

    /// Gives queued handshakes a connector thread each, up to the limit.
    fn start_handshakes(&mut self) {
        let c = &mut self.connector;
        while c.running < MAX_HANDSHAKES {
            let Some(job) = c.queue.pop_front() else {
                break;
            };
            let key = job.key;
            let (tx, wake, secret) = (c.tx.clone(), c.wake.clone(), c.secret.clone());
            let spawned = std::thread::Builder::new()
                .name("mc-rdma-connect".into())
                .spawn(move || {
                    let reply = rpc::call(
                        &job.addr,
                        RpcType::Connection,
                        &job.request,
                        HANDSHAKE_TIMEOUT,
                        secret.as_ref(),
                    )
                    .map_err(|e| e.prefixed(format!("handshake with {}", job.addr)));
                    // A worker that is gone no longer listens; nothing else to tidy.
                    let _ = tx.send(Reply { key, reply });
                    wake.notify();
                });
            if let Err(e) = spawned {
                let _ = c.tx.send(Reply {
                    key,
                    reply: Err(Error::io("spawning a handshake thread", e)),
                });
                c.wake.notify();
            }
            c.running += 1;
        }
    }

    /// Takes the connector threads' replies: connects their QPs and posts the slices
    /// that waited, or fails those. Returns whether any came.
    fn take_replies(&mut self, done: &mut Vec<Finished>) -> bool {
        // Drained before reading: a reply sent after the last read below signals anew.
        self.connector.wake.drain();
        let mut any = false;
        while let Ok(r) = self.connector.rx.try_recv() {
            self.connector.running -= 1;
            any = true;
            let Some(c) = self.connecting.remove(&r.key) else {
                continue;
            };
            let (_, l, rn) = r.key;
            match r.reply.and_then(|text| self.accept_reply(&c, l, &text)) {
                Ok(()) => {
                    self.endpoints.insert(
                        r.key,
                        Endpoint {
                            qp: c.qp,
                            outstanding: 0,
                            last_used: Instant::now(),
                        },
                    );
                    for slice in c.waiting {
                        self.post_connected(slice, r.key, done);
                    }
                }
                Err(e) => {
                    // Never posted on: destroyed now.
                    drop(c.qp);
                    let why = format!(
                        "connecting {}->{}#{rn}: {e}",
                        self.shared.nics[l].name, c.peer.name
                    );
                    log::debug!("rdma: {why}");
                    self.shared.rail_failed(&c.peer.name, l, rn, &e.to_string());
                    for slice in c.waiting {
                        self.note_tried(slice.id, slice.local, slice.remote, (l, rn));
                        done.push(Finished::new(slice.id, Outcome::PathFailed(why.clone())));
                    }
                }
            }
        }
        self.start_handshakes();
        any
    }

    /// Checks a Connection reply and connects our QP to the peer's.
    fn accept_reply(&self, c: &Connecting, l: usize, text: &str) -> Result<()> {
        let reply =
            json::parse(text).map_err(|e| Error::protocol(format!("handshake reply: {e}")))?;
        let msg = reply.get("reply_msg").and_then(Value::as_str).unwrap_or("");
        if !msg.is_empty() {
            return Err(Error::new(
                Code::TransferFail,
                format!("{} refused the connection: {msg}", c.peer.name),
            ));
        }
        let remote_qpn = reply
            .get("qp_num")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_u64)
            .ok_or_else(|| Error::protocol("handshake reply has no qp_num"))?;
        let gid_text = reply
            .get("local_gid")
            .and_then(Value::as_str)
            .unwrap_or(&c.gid);
        let gid = ibv::parse_gid(gid_text)
            .ok_or_else(|| Error::protocol(format!("bad peer gid {gid_text:?}")))?;
        let lid = reply
            .get("local_lid")
            .and_then(Value::as_u64)
            .map_or(c.lid, |l| l as u16);
        self.shared.nics[l].connect(&c.qp, remote_qpn as u32, gid, lid)
    }

    /// Posts a slice that waited for rail `key` to connect, on that rail.
    fn post_connected(&mut self, slice: Slice, key: RailKey, done: &mut Vec<Finished>) {
        if slice.deadline <= Instant::now() {
            return finish(&mut self.tried, slice.id, Outcome::TimedOut, done);
        }
        let (_, l, r) = key;
        match self.target(&slice) {
            Err(outcome) => finish(&mut self.tried, slice.id, outcome, done),
            Ok(t) if r < t.nremote => match self.post_on(&slice, key, t.lkeys[l], t.rkeys[r]) {
                Ok(()) => {}
                Err(None) => self.backlog.push_back(slice),
                Err(Some(e)) => {
                    done.push(Finished::new(slice.id, Outcome::PathFailed(e.to_string())))
                }
            },
            // The descriptor changed meanwhile: choose again.
            Ok(_) => self.post(slice, done),
        }
    }

    /// Makes room in the endpoint cache: evicts the least recently used idle endpoint.
    fn evict(&mut self) {
        if self.endpoints.len() + self.connecting.len() < MAX_ENDPOINTS {
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

    /// Where `slice` goes, or how it ends when it cannot go anywhere.
    fn target(&self, slice: &Slice) -> std::result::Result<Target, Outcome> {
        let Some((location, lkeys)) = self.shared.local_keys(slice.local, slice.len) else {
            return Err(Outcome::Rejected(format!(
                "local range {:#x}+{} is not inside a buffer registered with the engine \
                 (RDMA needs registered local memory)",
                slice.local, slice.len
            )));
        };
        let desc = slice.peer.desc();
        let Some(buffer) = desc.buffer_for(slice.remote, slice.len) else {
            return Err(Outcome::Stale);
        };
        let nremote = desc.devices.len().min(buffer.rkey.len());
        if nremote == 0 {
            return Err(Outcome::Rejected(format!(
                "{} publishes no RDMA keys for the buffer at {:#x}",
                slice.peer.name, buffer.addr
            )));
        }
        Ok(Target {
            location,
            lkeys,
            remote_loc: buffer.name.clone(),
            rkeys: buffer.rkey.clone(),
            nremote,
        })
    }

    /// Posts `slice` on the connected endpoint `key`. `Err(None)`: its send queue is
    /// full; `Err(Some(why))`: the rail broke (noted as tried for the slice).
    fn post_on(
        &mut self,
        slice: &Slice,
        key: RailKey,
        lkey: u32,
        rkey: u32,
    ) -> std::result::Result<(), Option<Error>> {
        let (_, l, r) = key;
        let Some(ep) = self.endpoints.get_mut(&key) else {
            return Err(Some(Error::new(
                Code::Internal,
                format!("no endpoint for rail {l}->#{r}"),
            )));
        };
        if ep.outstanding >= MAX_WR {
            return Err(None);
        }
        let wr_id = self.next_wr;
        self.next_wr += 1;
        let mut sge = ibv::ibv_sge {
            addr: slice.local,
            length: slice.len as u32,
            lkey,
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
        wr.rdma.rkey = rkey;
        // SAFETY: `wr` and `sge` outlive the call (the provider copies them into its send
        // queue); the local range lies in a registered region (`target` found its lkey)
        // that the engine keeps valid until the slice is finished.
        if let Err(rc) = unsafe { ep.qp.post_send(&mut wr) } {
            let e = Error::new(
                Code::TransferFail,
                format!("ibv_post_send on {}: error {rc}", self.shared.nics[l].name),
            );
            self.shared.rail_failed(&slice.peer.name, l, r, e.context());
            self.drop_endpoint(key);
            self.note_tried(slice.id, slice.local, slice.remote, (l, r));
            return Err(Some(e));
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
                    rkey,
                    self.shared.nics[l].name,
                    slice.peer.name
                ),
            },
        );
        Ok(())
    }

    /// Posts `slice` on the first rail that takes it, or leaves it waiting for a rail
    /// that is connecting.
    fn try_post(&mut self, slice: &Slice) -> std::result::Result<(), PostError> {
        let t = self.target(slice).map_err(PostError::Finish)?;
        let rails = self.rails(slice, &t.location, &t.remote_loc, t.nremote);
        if rails.is_empty() {
            return Err(PostError::Finish(Outcome::PathFailed(format!(
                "no usable RDMA rail to {} (all failed for this slice or paused)",
                slice.peer.name
            ))));
        }
        let mut busy = false;
        let mut last_error = String::new();
        for (l, r) in rails {
            let key = (slice.peer.id, l, r);
            if let Some(c) = self.connecting.get_mut(&key) {
                c.waiting.push(slice.clone());
                return Ok(());
            }
            if !self.endpoints.contains_key(&key) {
                self.evict();
                match self.start_connect(slice, l, r) {
                    Ok(()) => return Ok(()),
                    Err(e) => {
                        log::debug!("rdma: connecting rail {l}->{}@{r}: {e}", slice.peer.name);
                        self.shared
                            .rail_failed(&slice.peer.name, l, r, &e.to_string());
                        self.note_tried(slice.id, slice.local, slice.remote, (l, r));
                        last_error = e.to_string();
                        continue;
                    }
                }
            }
            match self.post_on(slice, key, t.lkeys[l], t.rkeys[r]) {
                Ok(()) => return Ok(()),
                Err(None) => busy = true,
                Err(Some(e)) => last_error = e.to_string(),
            }
        }
        if busy {
            return Err(PostError::Busy);
        }
        Err(PostError::Finish(Outcome::PathFailed(format!(
            "no RDMA rail to {} worked: {last_error}",
            slice.peer.name
        ))))
    }

    /// Reads the events of armed CQs that got a completion (without blocking).
    fn read_cq_events(&mut self) {
        for (i, c) in self.cqs.iter_mut().enumerate() {
            loop {
                match c.cq.read_event() {
                    Ok(true) => c.armed = false,
                    // Another CQ's event (acknowledged): each channel serves one CQ here.
                    Ok(false) => {}
                    Err(e) => {
                        if e.kind() != std::io::ErrorKind::WouldBlock {
                            log::warn!(
                                "rdma: ibv_get_cq_event on {}: {e}",
                                self.shared.nics[i].name
                            );
                        }
                        break;
                    }
                }
            }
        }
    }

    /// Takes every completion waiting on CQ `i`; returns whether there was any.
    fn poll(&mut self, i: usize, wcs: &mut [ibv::ibv_wc], done: &mut Vec<Finished>) -> bool {
        let mut any = false;
        loop {
            let n = match self.cqs[i].cq.poll(wcs) {
                Ok(n) => n,
                Err(rc) => {
                    log::error!(
                        "rdma: ibv_poll_cq on {}: error {rc}",
                        self.shared.nics[i].name
                    );
                    return any;
                }
            };
            for wc in &wcs[..n] {
                self.complete(wc, done);
            }
            any |= n > 0;
            if n < wcs.len() {
                return any;
            }
        }
    }

    fn complete(&mut self, wc: &ibv::ibv_wc, done: &mut Vec<Finished>) {
        let Some(p) = self.pending.remove(&wc.wr_id) else {
            return; // timed out earlier
        };
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(p.len);
        let (_, l, r) = p.rail;
        if let Some(ep) = self.endpoints.get_mut(&p.rail) {
            ep.outstanding = ep.outstanding.saturating_sub(1);
        } else if let Some((ep, _)) = self
            .graveyard
            .iter_mut()
            .find(|(e, _)| e.qp.qp_num() == wc.qp_num)
        {
            ep.outstanding = ep.outstanding.saturating_sub(1);
        }
        let s = self.shared.clone();
        let outcome = match wc.status {
            ibv::IBV_WC_SUCCESS => {
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
        done.push(Finished::new(p.slice, outcome));
    }
}

/// Finishes a slice with `outcome` (keeping its tried rails only for a `Stale` retry).
fn finish(tried: &mut HashMap<u64, Tried>, id: u64, outcome: Outcome, done: &mut Vec<Finished>) {
    if outcome != Outcome::Stale {
        tried.remove(&id);
    }
    done.push(Finished::new(id, outcome));
}

impl TransportWorker for RdmaWorker {
    fn post(&mut self, slice: Slice, done: &mut Vec<Finished>) {
        if slice.len == 0 || slice.len > u32::MAX as u64 {
            done.push(Finished::new(
                slice.id,
                Outcome::Rejected(format!("slice of {} bytes", slice.len)),
            ));
            return;
        }
        if !self.backlog.is_empty() {
            self.backlog.push_back(slice);
            return;
        }
        match self.try_post(&slice) {
            Ok(()) => {}
            Err(PostError::Busy) => self.backlog.push_back(slice),
            Err(PostError::Finish(outcome)) => finish(&mut self.tried, slice.id, outcome, done),
        }
    }

    fn progress(&mut self, now: Instant, done: &mut Vec<Finished>) -> bool {
        let mut moved = self.take_replies(done);
        self.read_cq_events();
        let mut wcs = [ibv::ibv_wc::default(); 64];
        for i in 0..self.cqs.len() {
            moved |= self.poll(i, &mut wcs, done);
            if !self.cqs[i].armed {
                if let Err(rc) = self.cqs[i].cq.arm() {
                    log::warn!(
                        "rdma: ibv_req_notify_cq on {}: error {rc}; a parked worker sees \
                         its completions on the engine's tick only",
                        self.shared.nics[i].name
                    );
                }
                // Not retried after a failure: that would only repeat the warning.
                self.cqs[i].armed = true;
                // A completion that arrived after the poll and before the arm raises
                // no event: look once more.
                moved |= self.poll(i, &mut wcs, done);
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
                    done.push(Finished::new(slice.id, outcome));
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
                    done.push(Finished::new(p.slice, Outcome::TimedOut));
                    moved = true;
                }
            }
            let expired: Vec<usize> = (0..self.backlog.len())
                .filter(|i| self.backlog[*i].deadline <= now)
                .collect();
            for i in expired.into_iter().rev() {
                if let Some(s) = self.backlog.remove(i) {
                    done.push(Finished::new(s.id, Outcome::TimedOut));
                }
            }
            // Slices waiting for a handshake; the handshake itself carries on.
            for c in self.connecting.values_mut() {
                c.waiting.retain(|s| {
                    if s.deadline > now {
                        return true;
                    }
                    done.push(Finished::new(s.id, Outcome::TimedOut));
                    false
                });
            }
            self.reap(now);
        }
        moved
    }

    fn in_flight(&self) -> usize {
        self.pending.len()
            + self.backlog.len()
            + self
                .connecting
                .values()
                .map(|c| c.waiting.len())
                .sum::<usize>()
    }

    fn in_flight_bytes(&self) -> u64 {
        self.in_flight_bytes
            + self.backlog.iter().map(|s| s.len).sum::<u64>()
            + self
                .connecting
                .values()
                .flat_map(|c| &c.waiting)
                .map(|s| s.len)
                .sum::<u64>()
    }

    fn wait_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.epoll.raw_fd())
    }
}
