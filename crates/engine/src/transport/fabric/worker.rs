//! The per-engine-worker half of the libfabric transport: one endpoint (with its own CQ
//! and AV) per NIC, peers inserted into the AV on first use, slices posted as
//! `fi_readmsg`/`fi_writemsg` round-robin over the NICs, completions read in `progress`.

use std::collections::{HashMap, VecDeque};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::nic::{Endpoint, Mr, Nic};
use super::regions::Registrations;
use crate::error::{Error, Result};
use crate::ffi::fabric as fi;
use crate::metadata::SegmentDesc;
use crate::sys::{Epoll, EventFd, READABLE};
use crate::transport::{Finished, Op, Outcome, Slice, TransportWorker};

/// How often in-flight slices are checked against their deadlines.
const DEADLINE_TICK: Duration = Duration::from_millis(5);
/// While operations are in flight, the engine worker keeps polling our CQs until this
/// long passes without a completion; then it parks on their descriptors.
const SPIN_WINDOW: Duration = Duration::from_millis(1);
/// Bulk in flight: the engine worker parks on the descriptors soon, as the engine does
/// for bulk (the bytes move at the kernel's or NIC's pace).
const SPIN_MAX_BYTES: u64 = 256 << 10;
/// With nothing in flight, how long after the last operation the descriptors are armed.
const ARM_DELAY: Duration = Duration::from_micros(50);

struct Lane {
    // Declared first so the endpoint closes before its Nic can.
    ep: Endpoint,
    nic: Arc<Nic>,
    /// The NIC's index in the transport's list (and in each buffer's registrations).
    nic_index: usize,
    /// Peer id → (published address in hex, AV handle).
    peers: HashMap<u64, (String, u64)>,
    /// A connection-level error happened: replace the endpoint before the next post.
    broken: bool,
    /// `fi_trywait` succeeded and the CQ was not read since: until its descriptor turns
    /// readable nothing can complete, so polls with nothing in flight look at the
    /// descriptor alone.
    armed: bool,
    /// Operations posted on `ep` whose completions are not read yet (at most
    /// `room()`).
    posted: usize,
}

impl Lane {
    /// How many operations may be outstanding at once: what the CQ holds, and no more
    /// than the provider sized its transmit queue for (`sockets` accepts posts past
    /// its 256 and does not push back).
    fn room(&self) -> usize {
        match self.nic.tx_depth {
            0 => self.ep.cq_entries,
            depth => self.ep.cq_entries.min(depth),
        }
    }
}

/// Everything one posted operation needs until its completion is read.
struct PostedOp {
    /// The provider's scratch space (FI_CONTEXT/FI_CONTEXT2); its address is the
    /// operation's identity in CQ entries.
    ctx: Box<fi::fi_context2>,
    slice: u64,
    lane: usize,
    /// A temporary registration of the local buffer (FI_MR_LOCAL providers).
    _local_mr: Option<Mr>,
}

/// One operation waiting for room in the provider's transmit queue.
struct Queued {
    slice: u64,
    lane: usize,
    op: Op,
    local: u64,
    len: u64,
    peer: u64,
    remote: u64,
    key: u64,
}

struct SliceState {
    lane: usize,
    ops_left: u32,
    len: u64,
    deadline: Instant,
    /// The first failure among its operations.
    failure: Option<Outcome>,
}

pub(super) struct FabricWorker {
    lanes: Vec<Lane>,
    next_lane: usize,
    /// `provider/`: how our devices start in peer descriptors.
    prefix: String,
    keys: Arc<AtomicU64>,
    regions: Arc<Registrations>,
    ops: HashMap<usize, PostedOp>,
    /// Contexts of completed operations, for reuse (boxed: a context's address is the
    /// operation's identity while it is in flight).
    #[allow(clippy::vec_box)]
    contexts: Vec<Box<fi::fi_context2>>,
    slices: HashMap<u64, SliceState>,
    queued: VecDeque<Queued>,
    /// Slices finished inside calls that have no `done` vector at hand.
    done: Vec<Finished>,
    bytes_in_flight: u64,
    next_deadline_check: Instant,
    /// What the engine worker parks on: the lanes' CQ descriptors, plus `spin`.
    epoll: Epoll,
    /// Ready tokens from `epoll`, kept to reuse the allocation.
    ready: Vec<u64>,
    /// Kept readable while the engine worker should poll rather than park (see
    /// `should_spin`), and whether it is.
    spin: (EventFd, bool),
    /// The last `should_spin`.
    spinning: bool,
    /// When an operation was last posted or completed.
    last_moved: Instant,
}

impl FabricWorker {
    pub fn new(
        nics: &[Arc<Nic>],
        first: usize,
        prefix: String,
        keys: Arc<AtomicU64>,
        regions: Arc<Registrations>,
    ) -> Result<FabricWorker> {
        let mut lanes = Vec::with_capacity(nics.len());
        for i in 0..nics.len() {
            let nic_index = (first + i) % nics.len();
            let nic = nics[nic_index].clone();
            lanes.push(Lane {
                ep: Endpoint::open(&nic)?,
                nic,
                nic_index,
                peers: HashMap::new(),
                broken: false,
                armed: false,
                posted: 0,
            });
        }
        // The engine parks on one descriptor that stays the same when a lane's CQ is
        // replaced, so the lanes' descriptors are joined in an epoll of our own.
        let io = |what: &str, e| crate::Error::io(what.to_owned(), e);
        let epoll = Epoll::new().map_err(|e| io("epoll for fabric lanes", e))?;
        for (i, l) in lanes.iter().enumerate() {
            if let Some(fd) = l.ep.fd {
                epoll
                    .add(fd, READABLE, i as u64)
                    .map_err(|e| io("epoll add", e))?;
            }
        }
        let spin = EventFd::new().map_err(|e| io("eventfd", e))?;
        epoll
            .add(spin.raw_fd(), READABLE, u64::MAX)
            .map_err(|e| io("epoll add", e))?;
        Ok(FabricWorker {
            lanes,
            next_lane: 0,
            prefix,
            keys,
            regions,
            ops: HashMap::new(),
            contexts: Vec::new(),
            slices: HashMap::new(),
            queued: VecDeque::new(),
            done: Vec::new(),
            bytes_in_flight: 0,
            next_deadline_check: Instant::now(),
            epoll,
            ready: Vec::new(),
            spin: (spin, false),
            spinning: false,
            last_moved: Instant::now(),
        })
    }

    /// Picks the peer's device for `lane`: the one with our NIC's name if the peer has
    /// it (same layout), else by index among the peer's devices of our provider.
    fn device_for<'a>(&self, desc: &'a SegmentDesc, lane: usize) -> Option<(usize, &'a str, u16)> {
        // Called per slice: walks the devices without collecting them.
        let ours = || {
            desc.devices
                .iter()
                .enumerate()
                .filter(|(_, d)| d.name.starts_with(&self.prefix) && !d.gid.is_empty())
        };
        let name = &self.lanes[lane].nic.name;
        let (i, d) = match ours().find(|(_, d)| &d.name == name) {
            Some(found) => found,
            None => {
                let count = ours().count();
                if count == 0 {
                    return None;
                }
                ours().nth(lane % count)?
            }
        };
        Some((i, d.gid.as_str(), d.lid))
    }

    /// The AV handle of `peer`'s endpoint `gid` on `lane`, inserting it on first use.
    fn peer_address(&mut self, lane: usize, peer: u64, gid: &str) -> Result<u64> {
        let l = &mut self.lanes[lane];
        if let Some((known, addr)) = l.peers.get(&peer) {
            if known == gid {
                return Ok(*addr);
            }
        }
        let bytes = crate::util::hex::decode(gid)
            .ok_or_else(|| Error::protocol(format!("bad endpoint address {gid:?}")))?;
        let mut addr = 0u64;
        // SAFETY: live AV; `bytes` holds one address in the provider's format (a
        // malformed one is refused by the provider).
        let rc = unsafe { fi::fi_av_insert(l.ep.av, bytes.as_ptr().cast(), &mut addr) };
        if rc != 1 {
            // It inserts the one address or fails; any other count is an invalid address.
            let code = if rc < 0 { rc } else { -libc::EINVAL };
            return Err(Error::backend(l.nic.lib.error("fi_av_insert", code))
                .prefixed(format_args!("endpoint {gid} on {}", l.nic.name)));
        }
        l.peers.insert(peer, (gid.to_owned(), addr));
        Ok(addr)
    }

    fn start(&mut self, slice: &Slice) -> std::result::Result<(), Outcome> {
        let lane = self.next_lane % self.lanes.len();
        self.next_lane = self.next_lane.wrapping_add(1);
        if self.lanes[lane].broken {
            self.reset(lane);
        }
        let desc = slice.peer.desc();
        let (dev, gid, flags) = self.device_for(&desc, lane).ok_or_else(|| {
            Outcome::PathFailed(format!(
                "{} publishes no {}* endpoint",
                slice.peer.name, self.prefix
            ))
        })?;
        let buf = desc
            .buffer_for(slice.remote, slice.len)
            .ok_or(Outcome::Stale)?;
        let key = buf
            .rkey
            .get(dev)
            .or(buf.rkey.first())
            .copied()
            .ok_or_else(|| {
                Outcome::PathFailed(format!(
                    "buffer {:#x} of {} has no fabric key",
                    buf.addr, slice.peer.name
                ))
            })?;
        // The peer's `lid` carries its mr_mode: offsets unless it uses virtual addresses.
        let remote = if flags as i32 & fi::FI_MR_VIRT_ADDR != 0 {
            slice.remote
        } else {
            slice.remote - buf.addr
        };
        let peer = self
            .peer_address(lane, slice.peer.id, gid)
            .map_err(|e| Outcome::PathFailed(e.to_string()))?;
        let max = self.lanes[lane].nic.max_msg;
        let count = slice.len.div_ceil(max).max(1);
        let count =
            u32::try_from(count).map_err(|_| Outcome::Rejected("slice too large".into()))?;
        self.slices.insert(
            slice.id,
            SliceState {
                lane,
                ops_left: count,
                len: slice.len,
                deadline: slice.deadline,
                failure: None,
            },
        );
        self.bytes_in_flight += slice.len;
        let mut off = 0;
        while off < slice.len {
            let len = max.min(slice.len - off);
            self.queued.push_back(Queued {
                slice: slice.id,
                lane,
                op: slice.op,
                local: slice.local + off,
                len,
                peer,
                remote: remote + off,
                key: key as u64,
            });
            off += len;
        }
        Ok(())
    }

    /// Posts queued operations until the provider pushes back or a lane's CQ could
    /// not hold one more completion.
    fn post_queued(&mut self) -> bool {
        let mut moved = false;
        while let Some(q) = self.queued.pop_front() {
            if !self.slices.contains_key(&q.slice) {
                continue; // timed out or failed meanwhile
            }
            let lane = &self.lanes[q.lane];
            if lane.posted >= lane.room() {
                self.queued.push_front(q);
                break;
            }
            match self.post_one(&q) {
                Ok(true) => moved = true,
                Ok(false) => {
                    self.queued.push_front(q);
                    break;
                }
                Err(outcome) => {
                    moved = true;
                    self.op_finished(q.slice, Some(outcome));
                }
            }
        }
        moved
    }

    /// One `fi_readmsg`/`fi_writemsg`; Ok(false) when the transmit queue is full.
    fn post_one(&mut self, q: &Queued) -> std::result::Result<bool, Outcome> {
        let lane = &self.lanes[q.lane];
        let nic = &lane.nic;
        if lane.ep.ep.is_null() {
            return Err(Outcome::PathFailed(format!(
                "no endpoint open on {}",
                nic.name
            )));
        }
        // The buffer's own registration when the engine registered it (held open by
        // `regions` until this returns); else a temporary one where the provider
        // wants local memory registered (staging buffers, unregistered memory).
        let regions = self.regions.clone();
        let regions = regions.view();
        let registered = regions.desc(q.local, q.len, lane.nic_index);
        let local_mr = if registered.is_none() && nic.needs_local_mr() {
            let key = self.keys.fetch_add(1, Ordering::Relaxed);
            Some(
                nic.register(q.local, q.len, fi::FI_READ | fi::FI_WRITE, key, None)
                    .map_err(|e| Outcome::PathFailed(e.to_string()))?,
            )
        } else {
            None
        };
        let mut desc = registered
            .or(local_mr.as_ref().map(|m| m.desc))
            .unwrap_or(std::ptr::null_mut());
        let mut ctx = self.contexts.pop().unwrap_or_else(|| {
            // SAFETY: fi_context2 is plain pointers; all-zero is its initial state.
            Box::new(unsafe { std::mem::zeroed() })
        });
        let ctx_ptr: *mut fi::fi_context2 = &mut *ctx;
        let iov = libc::iovec {
            iov_base: q.local as *mut _,
            iov_len: q.len as usize,
        };
        let rma = fi::fi_rma_iov {
            addr: q.remote,
            len: q.len as usize,
            key: q.key,
        };
        let msg = fi::fi_msg_rma {
            msg_iov: &iov,
            desc: &mut desc,
            iov_count: 1,
            addr: q.peer,
            rma_iov: &rma,
            rma_iov_count: 1,
            context: ctx_ptr.cast(),
            data: 0,
        };
        // SAFETY: live endpoint; the local range is the caller's buffer (valid until
        // the slice is final, per `Engine::submit`); the context box lives in `ops`
        // until its completion is read or the endpoint is closed; `msg` and what it
        // points at outlive the call (providers copy what they keep).
        let rc = unsafe {
            match q.op {
                // A read's completion already means its data is here: no completion
                // semantics to ask for (with shm this lets the provider copy directly).
                Op::Read => fi::fi_readmsg(lane.ep.ep, &msg, fi::FI_COMPLETION),
                Op::Write => fi::fi_writemsg(lane.ep.ep, &msg, nic.write_flags()),
            }
        };
        if rc == -(fi::FI_EAGAIN as isize) {
            self.contexts.push(ctx);
            return Ok(false);
        }
        if rc != 0 {
            self.contexts.push(ctx);
            return Err(Outcome::PathFailed(format!(
                "posting to {} failed: {}",
                nic.name,
                nic.lib.strerror(rc as i64)
            )));
        }
        // Posting may leave work only progress finishes (a partly sent request).
        self.lanes[q.lane].armed = false;
        self.lanes[q.lane].posted += 1;
        self.ops.insert(
            ctx_ptr as usize,
            PostedOp {
                ctx,
                slice: q.slice,
                lane: q.lane,
                _local_mr: local_mr,
            },
        );
        Ok(true)
    }

    /// Removes the posted operation whose context is at `ctx`, if it is ours.
    fn take_op(&mut self, ctx: usize) -> Option<PostedOp> {
        let op = self.ops.remove(&ctx)?;
        let lane = &mut self.lanes[op.lane];
        lane.posted = lane.posted.saturating_sub(1);
        Some(op)
    }

    /// Accounts one finished operation of `slice` (`failure` None: success).
    fn op_finished(&mut self, slice: u64, failure: Option<Outcome>) {
        let Some(s) = self.slices.get_mut(&slice) else {
            return; // the slice already ended (deadline); a late completion
        };
        if s.failure.is_none() {
            s.failure = failure;
        }
        s.ops_left = s.ops_left.saturating_sub(1);
        if s.ops_left == 0 {
            if let Some(s) = self.slices.remove(&slice) {
                self.bytes_in_flight -= s.len;
                self.done
                    .push(Finished::new(slice, s.failure.unwrap_or(Outcome::Done)));
            }
        }
    }

    /// Reads one lane's CQ dry; returns whether anything completed.
    fn poll_lane(&mut self, lane: usize) -> bool {
        let cq = self.lanes[lane].ep.cq;
        if cq.is_null() {
            return false; // a failed reset; retried on the next post
        }
        let mut entries = [fi::fi_cq_entry {
            op_context: std::ptr::null_mut(),
        }; 32];
        let mut moved = false;
        loop {
            // SAFETY: live CQ opened with the context format.
            let n = unsafe { fi::fi_cq_read(cq, &mut entries) };
            if n > 0 {
                moved = true;
                for e in &entries[..n as usize] {
                    if let Some(op) = self.take_op(e.op_context as usize) {
                        self.op_finished(op.slice, None);
                        self.contexts.push(op.ctx);
                    }
                }
                if (n as usize) < entries.len() {
                    break;
                }
            } else if n == -(fi::FI_EAVAIL as isize) {
                moved = true;
                self.read_error(lane);
            } else {
                break;
            }
        }
        moved
    }

    fn read_error(&mut self, lane: usize) {
        let l = &mut self.lanes[lane];
        // SAFETY: a zeroed error entry is a valid out-buffer.
        let mut err: fi::fi_cq_err_entry = unsafe { std::mem::zeroed() };
        // SAFETY: live CQ.
        let n = unsafe { fi::fi_cq_readerr(l.ep.cq, &mut err) };
        if n <= 0 {
            return;
        }
        // SAFETY: the entry was just read from this CQ.
        let detail = unsafe { fi::fi_cq_strerror(l.ep.cq, &err) }.unwrap_or_default();
        let why = format!(
            "RMA on {} failed: {} (provider error {}{}{})",
            l.nic.name,
            l.nic.lib.strerror(err.err as i64),
            err.prov_errno,
            if detail.is_empty() { "" } else { ": " },
            detail
        );
        // Software providers tear the connection down after a refused access, so the
        // endpoint is replaced before it is used again.
        l.broken = true;
        let outcome = classify(err.err, why);
        if let Some(op) = self.take_op(err.op_context as usize) {
            self.op_finished(op.slice, Some(outcome));
            self.contexts.push(op.ctx);
        }
    }

    /// Replaces a broken lane's endpoint; everything still posted on it fails.
    fn reset(&mut self, lane: usize) {
        let l = &mut self.lanes[lane];
        l.broken = false;
        l.armed = false;
        l.peers.clear();
        if let Some(fd) = l.ep.fd {
            let _ = self.epoll.delete(fd);
        }
        if let Err(e) = l.ep.reset(&l.nic) {
            log::warn!("fabric: reopening an endpoint on {}: {e}", l.nic.name);
            l.broken = true;
        }
        if let Some(fd) = l.ep.fd {
            if let Err(e) = self.epoll.add(fd, READABLE, lane as u64) {
                log::warn!("fabric: watching a new CQ on {}: {e}", l.nic.name);
            }
        }
        let lost: Vec<usize> = self
            .ops
            .iter()
            .filter(|(_, op)| op.lane == lane)
            .map(|(k, _)| *k)
            .collect();
        for k in lost {
            if let Some(op) = self.take_op(k) {
                self.op_finished(
                    op.slice,
                    Some(Outcome::PathFailed("fabric endpoint was reset".into())),
                );
            }
        }
        let (dead, keep): (Vec<Queued>, Vec<Queued>) =
            self.queued.drain(..).partition(|q| q.lane == lane);
        self.queued.extend(keep);
        for q in dead {
            self.op_finished(
                q.slice,
                Some(Outcome::PathFailed("fabric endpoint was reset".into())),
            );
        }
    }

    /// One round: completions, deadlines, endpoint resets, queued posts; then arms the
    /// lanes' descriptors when nothing moved. Whether anything moved.
    fn poll(&mut self, now: Instant) -> bool {
        let mut moved = false;
        // With operations in flight every CQ is read each round: for bulk, the reads
        // carry manual-progress transfers along as the bytes trickle in. Idle, one
        // non-blocking look at the armed lanes' descriptors replaces reading (and
        // re-arming) their CQs while the engine worker spins down.
        let busy = !self.slices.is_empty();
        if !busy && self.lanes.iter().any(|l| l.armed) {
            if self.epoll.wait(&mut self.ready, 0).is_err() {
                self.ready.clear();
                self.lanes.iter_mut().for_each(|l| l.armed = false);
            }
            for token in self.ready.drain(..) {
                if let Some(l) = self.lanes.get_mut(token as usize) {
                    l.armed = false;
                }
            }
        }
        for lane in 0..self.lanes.len() {
            if busy || !self.lanes[lane].armed {
                self.lanes[lane].armed = false;
                moved |= self.poll_lane(lane);
            }
        }
        self.check_deadlines(now);
        for lane in 0..self.lanes.len() {
            if self.lanes[lane].broken {
                self.reset(lane);
            }
        }
        moved |= self.post_queued();
        moved |= !self.done.is_empty();
        if moved {
            self.last_moved = now;
        }
        self.spinning = self.should_spin(now);
        // Before the engine worker may park: lower `spin`, arm the wait descriptors.
        // With nothing in flight not straight away, as the next operation usually
        // follows at once, and each switch costs system calls (ours, and the
        // provider's when the next completion arrives).
        let settle = !self.spinning
            && (!self.slices.is_empty()
                || now.saturating_duration_since(self.last_moved) >= ARM_DELAY);
        let (fd, raised) = &mut self.spin;
        if self.spinning && !*raised {
            fd.notify();
            *raised = true;
        } else if settle && *raised {
            fd.drain();
            *raised = false;
        }
        if !moved && settle {
            for l in &mut self.lanes {
                if l.armed || l.ep.fd.is_none() || l.ep.cq.is_null() {
                    continue;
                }
                match l.nic.trywait(l.ep.cq) {
                    // With auto progress, keep reading the CQ and re-arming each round:
                    // `sockets` got 15% slower when only the armed descriptor was watched.
                    0 => l.armed = l.nic.manual,
                    rc if rc == -fi::FI_EAGAIN => moved = true,
                    _ => {}
                }
            }
        }
        moved
    }

    /// Whether the engine worker should keep polling rather than park on our CQ
    /// descriptors: while small operations of a manual-progress provider are in flight
    /// and completing (our CQ reads move them; arming a descriptor costs the provider
    /// system calls on both ends of every operation), and always while a lane has no
    /// descriptor (the engine would otherwise look only every few milliseconds). An
    /// auto-progress provider's own threads do the work, and polling would only take
    /// their core (`sockets`: forty times slower).
    fn should_spin(&self, now: Instant) -> bool {
        if self.slices.is_empty() {
            return false;
        }
        // A post refused for room (FI_EAGAIN) is retried after progress that need not
        // signal any descriptor, so parking could hold it for a whole engine tick.
        if !self.queued.is_empty() {
            return true;
        }
        self.lanes.iter().any(|l| l.ep.fd.is_none())
            || (self.lanes.iter().all(|l| l.nic.manual)
                && self.bytes_in_flight <= SPIN_MAX_BYTES
                && now.saturating_duration_since(self.last_moved) < SPIN_WINDOW)
    }

    fn check_deadlines(&mut self, now: Instant) {
        if now < self.next_deadline_check {
            return;
        }
        self.next_deadline_check = now + DEADLINE_TICK;
        let late: Vec<u64> = self
            .slices
            .iter()
            .filter(|(_, s)| now >= s.deadline)
            .map(|(id, _)| *id)
            .collect();
        if late.is_empty() {
            return;
        }
        // The engine may reuse a finished slice's id: nothing of it may stay queued.
        self.queued.retain(|q| !late.contains(&q.slice));
        for id in late {
            if let Some(s) = self.slices.remove(&id) {
                self.bytes_in_flight -= s.len;
                self.done.push(Finished::new(id, Outcome::TimedOut));
                // Operations the provider still holds keep their contexts; replacing
                // the endpoint releases them and drops whatever state made them stall.
                if self.ops.values().any(|op| op.slice == id) {
                    self.lanes[s.lane].broken = true;
                }
            }
        }
    }
}

/// Maps a completion error to what the engine should do: refused accesses mean the
/// descriptor we used may be out of date (resync, then fail if the range is gone).
fn classify(err: i32, why: String) -> Outcome {
    match err {
        libc::EACCES | libc::EPERM | libc::EINVAL | libc::EFAULT | fi::FI_ENOKEY => {
            log::debug!("{why}");
            Outcome::Stale
        }
        // tcp;ofi_rxm reports a refused key as a canceled operation on a dropped
        // connection.
        fi::FI_ECANCELED => {
            log::debug!("{why}");
            Outcome::Stale
        }
        _ => Outcome::PathFailed(why),
    }
}

impl TransportWorker for FabricWorker {
    fn post(&mut self, slice: Slice, done: &mut Vec<Finished>) {
        self.last_moved = Instant::now();
        if let Err(outcome) = self.start(&slice) {
            done.push(Finished::new(slice.id, outcome));
            return;
        }
        self.post_queued();
        done.append(&mut self.done);
    }

    fn progress(&mut self, now: Instant, done: &mut Vec<Finished>) -> bool {
        let moved = self.poll(now);
        if !moved && self.spinning && self.lanes.iter().all(|l| l.nic.software) {
            // Polling for a completion that host CPUs produce (the kernel's TCP stack,
            // a peer process on this host) must not keep them from the core.
            std::thread::yield_now();
        }
        done.append(&mut self.done);
        moved
    }

    fn in_flight(&self) -> usize {
        self.slices.len()
    }

    fn in_flight_bytes(&self) -> u64 {
        self.bytes_in_flight
    }

    fn wait_fd(&self) -> Option<RawFd> {
        Some(self.epoll.raw_fd())
    }
}
