//! Channels between ranks: one-sided writes of stamped cells (copied into a staging
//! cell when small, written straight from the caller's memory when large), credits, and
//! the exchange loop every collective is built from.

use std::time::{Duration, Instant};

use super::dtype::{finish_avg, reduce_into, DType, ReduceOp};
use super::layout::{
    encode_cell, encode_cell_header, read_cell_head, CellStamp, Layout, Mask, CELL_HEADER,
};
use super::seam::Recheck;
use super::{Group, GroupOptions};
use crate::engine::{BatchId, SegmentId, TaskState};
use crate::error::{Code, Error, Result};
use crate::transport::Op;
use crate::util::crc32c::{crc32c, crc32c_append_copying};
use crate::util::stream_copy::copy_bypassing_cache;
use crate::Request;

/// Where a peer's buffer is.
#[derive(Clone, Copy, Debug)]
pub(super) struct Peer {
    pub segment: SegmentId,
    pub base: u64,
    /// The join record's incarnation this entry came from (0: from the rendezvous).
    pub incarnation: u64,
}

/// Per-peer channel counters within the current epoch.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Channel {
    /// Messages (cells) sent to the peer.
    pub sent: u64,
    /// Cells received from the peer and consumed.
    pub consumed: u64,
    /// `consumed` as last written to the peer's credit word.
    pub credited: u64,
}

/// Everything that changes as a rank runs; guarded by the group's lock.
pub(super) struct State {
    pub epoch: u64,
    pub mask: Mask,
    pub peers: Vec<Option<Peer>>,
    pub channels: Vec<Channel>,
    /// Collective sequence number within the epoch (tags cells; all members agree).
    pub seq: u64,
    /// Writes posted and not yet reaped: the batch and, for each task, the peer whose
    /// failure it proves (`None` for credit words: a peer that has everything it needs
    /// from us may exit before our last credit reaches it).
    pub outstanding: Vec<(BatchId, Vec<Option<usize>>)>,
    pub last_failed: Vec<usize>,
    /// A failure was seen and membership has not been reconciled since.
    pub needs_sync: bool,
    /// This process's incarnation (for join records).
    pub incarnation: u64,
    /// The running operation's own wait bound, when the caller gave one (else the
    /// group's timeout).
    pub op_timeout: Option<Duration>,
    /// All-reduce's scratch for the caller's bytes it overwrites (see
    /// [`Group::all_reduce`]); kept between operations up to `staging_keep_bytes`.
    pub kept: Vec<u8>,
}

impl State {
    pub fn new(o: &GroupOptions, layout: Layout) -> State {
        let mask = match (&o.active_ranks, o.is_extension) {
            (Some(a), _) => {
                let mut m = Mask::default();
                for (r, _) in a.iter().enumerate().filter(|(_, on)| **on) {
                    m.set(r);
                }
                m
            }
            (None, false) => Mask::first(o.world_size),
            (None, true) => {
                let mut m = Mask::first(o.world_size);
                m.clear(o.rank);
                m
            }
        };
        State {
            // Epochs start at 1, so zeroed memory never passes for a current cell; an
            // extension is at 0 until a view admits it.
            epoch: if o.is_extension { 0 } else { 1 },
            mask,
            peers: vec![None; layout.ranks],
            channels: vec![Channel::default(); layout.ranks],
            seq: 0,
            outstanding: Vec::new(),
            op_timeout: None,
            kept: Vec::new(),
            last_failed: Vec::new(),
            needs_sync: false,
            incarnation: crate::sys::random_u64() | 1,
        }
    }

    pub fn set_peer(&mut self, r: usize, segment: SegmentId, base: u64, incarnation: u64) {
        self.peers[r] = Some(Peer {
            segment,
            base,
            incarnation,
        });
    }
}

/// What a receive does with the bytes.
pub(super) enum Sink<'a> {
    /// Store them.
    Copy(&'a mut [u8]),
    /// Combine them, as they arrive, into an accumulator that every receive of the
    /// exchange shares (so it is held by pointer; the exchange runs on one thread).
    Reduce(Accumulator<'a>),
}

/// `len` bytes at `ptr` that several receives of one exchange reduce into.
#[derive(Clone, Copy)]
pub(super) struct Accumulator<'a> {
    ptr: *mut u8,
    len: usize,
    dtype: DType,
    op: ReduceOp,
    /// Where finished regions are recorded, when the result is sent on afterwards.
    finished: Option<&'a std::cell::RefCell<FinishedRegions>>,
    _borrow: std::marker::PhantomData<&'a mut [u8]>,
}

impl<'a> Accumulator<'a> {
    pub fn new(
        acc: &'a mut [u8],
        dtype: DType,
        op: ReduceOp,
        finished: Option<&'a std::cell::RefCell<FinishedRegions>>,
    ) -> Self {
        Accumulator {
            ptr: acc.as_mut_ptr(),
            len: acc.len(),
            dtype,
            op,
            finished,
            _borrow: std::marker::PhantomData,
        }
    }
}

/// For a reduce-scatter whose result is sent on whole (all-reduce): counts, per
/// cell-sized region of the accumulator, the peers' parts folded in; once a region has
/// them all it is finished there and then (divided, for `Avg`) and its CRC taken while
/// it is still in cache, so sending it on does not read it again for the CRC.
pub(super) struct FinishedRegions {
    /// Payload bytes per cell: regions start at multiples of it, as every message is cut.
    cap: usize,
    /// The accumulator's length.
    len: usize,
    /// Parts each region waits for (the peers).
    parts: usize,
    /// Members, for `Avg`'s division.
    members: usize,
    folded: Vec<usize>,
    crcs: Vec<Option<u32>>,
    /// Each region's bytes as they were before its first part was folded in (at the
    /// same offsets), so that a failed operation leaves the accumulator as it found it.
    kept: Vec<u8>,
    /// Per region, whether its original is in `kept`; empty when nothing is kept.
    saved: Vec<bool>,
}

impl FinishedRegions {
    /// `kept` is scratch for the originals (grown to `len` if shorter; handed back by
    /// [`FinishedRegions::into_kept`], so a caller can keep one allocation); `None`
    /// when the accumulator need not be restored.
    pub fn new(
        len: usize,
        cap: usize,
        parts: usize,
        members: usize,
        kept: Option<Vec<u8>>,
    ) -> Self {
        let regions = len.div_ceil(cap.max(1));
        let keeping = kept.is_some();
        let mut kept = kept.unwrap_or_default();
        if keeping && kept.len() < len {
            kept.resize(len, 0);
        }
        FinishedRegions {
            cap,
            len,
            parts,
            members,
            folded: vec![0; regions],
            crcs: vec![None; regions],
            kept,
            saved: if keeping {
                vec![false; regions]
            } else {
                Vec::new()
            },
        }
    }

    /// `region` (at `offset` of the accumulator) is about to have a part folded in:
    /// saves its original the first time.
    fn keep_original(&mut self, region: &[u8], offset: usize) {
        let index = offset / self.cap.max(1);
        if let Some(saved @ false) = self.saved.get_mut(index) {
            copy_bypassing_cache(&mut self.kept[offset..offset + region.len()], region);
            *saved = true;
        }
    }

    /// Puts back every region a part was folded into (a failed operation's accumulator).
    pub fn restore(&self, acc: &mut [u8]) {
        for (index, _) in self.saved.iter().enumerate().filter(|(_, s)| **s) {
            let start = index * self.cap;
            let end = (start + self.cap).min(acc.len());
            acc[start..end].copy_from_slice(&self.kept[start..end]);
        }
    }

    /// The scratch past the regions' originals, for the caller's own (empty when
    /// nothing is kept).
    pub fn spare(&mut self) -> &mut [u8] {
        let start = self.len.min(self.kept.len());
        &mut self.kept[start..]
    }

    /// The scratch given to [`FinishedRegions::new`], for the next operation.
    pub fn into_kept(self) -> Vec<u8> {
        self.kept
    }

    fn finish(&mut self, region: &mut [u8], index: usize, dtype: DType, op: ReduceOp) {
        if op == ReduceOp::Avg {
            finish_avg(region, dtype, self.members);
        }
        self.crcs[index] = Some(crc32c(region));
    }

    /// `len` bytes at `offset` of `acc` just had one part folded in.
    fn folded(&mut self, acc: &mut [u8], offset: usize, dtype: DType, op: ReduceOp) {
        let index = offset / self.cap;
        let whole = offset % self.cap == 0
            && index < self.folded.len()
            && acc.len() == self.cap.min(self.len - offset);
        if !whole {
            return; // cannot happen (cells are cut at `cap`); `complete` finishes it
        }
        self.folded[index] += 1;
        if self.folded[index] == self.parts {
            self.finish(acc, index, dtype, op);
        }
    }

    /// Finishes the regions no part came for (no peers), and returns every region's
    /// payload CRC keyed as [`PayloadCrcs`] keys them.
    pub fn complete(&mut self, acc: &mut [u8], dtype: DType, op: ReduceOp) -> PayloadCrcs {
        let mut known = PayloadCrcs::default();
        for index in 0..self.crcs.len() {
            let start = index * self.cap;
            let end = (start + self.cap).min(acc.len());
            if self.crcs[index].is_none() {
                self.finish(&mut acc[start..end], index, dtype, op);
            }
            if let Some(crc) = self.crcs[index] {
                known
                    .0
                    .insert((acc[start..end].as_ptr() as usize, end - start), crc);
            }
        }
        known
    }
}

/// CRCs of payloads already computed, by (address, length): a payload sent to several
/// peers in one exchange is read once for its CRC. Entries are valid only while the
/// memory is borrowed unchanged (an exchange's messages are shared borrows).
#[derive(Default)]
pub(super) struct PayloadCrcs(std::collections::HashMap<(usize, usize), u32>);

impl PayloadCrcs {
    fn of(&mut self, payload: &[u8]) -> u32 {
        *self
            .0
            .entry((payload.as_ptr() as usize, payload.len()))
            .or_insert_with(|| crc32c(payload))
    }
}

impl Sink<'_> {
    fn len(&self) -> usize {
        match self {
            Sink::Copy(b) => b.len(),
            Sink::Reduce(a) => a.len,
        }
    }

    fn take(&mut self, offset: usize, payload: &[u8]) {
        match self {
            Sink::Copy(b) => b[offset..offset + payload.len()].copy_from_slice(payload),
            Sink::Reduce(a) => {
                // SAFETY: `offset + payload.len() <= a.len` (the caller clamps), the
                // accumulator outlives the exchange ('a), and receives run one at a
                // time on this thread, so this is the only live reference to it.
                let acc =
                    unsafe { std::slice::from_raw_parts_mut(a.ptr.add(offset), payload.len()) };
                if let Some(finished) = a.finished {
                    finished.borrow_mut().keep_original(acc, offset);
                }
                reduce_into(acc, payload, a.dtype, a.op);
                if let Some(finished) = a.finished {
                    finished.borrow_mut().folded(acc, offset, a.dtype, a.op);
                }
            }
        }
    }
}

/// One message to send in an exchange.
pub(super) struct Outgoing<'a> {
    pub peer: usize,
    pub data: &'a [u8],
    offset: usize,
    started: bool,
    /// For a point-to-point message, the channel's cell count once its last cell is
    /// written (0 until then, and for a collective's): the receiver has taken the
    /// whole message when its credit reaches it.
    through: u64,
}

impl<'a> Outgoing<'a> {
    pub fn new(peer: usize, data: &'a [u8]) -> Self {
        Outgoing {
            peer,
            data,
            offset: 0,
            started: false,
            through: 0,
        }
    }
    fn done(&self) -> bool {
        self.started && self.offset >= self.data.len()
    }
}

/// One message to receive in an exchange.
pub(super) struct Incoming<'a> {
    pub peer: usize,
    pub sink: Sink<'a>,
    offset: usize,
    started: bool,
    keep: Option<Kept<'a>>,
}

/// Where a [`Sink::Copy`] destination's bytes are saved just before they are first
/// overwritten, so that a failed operation can put them back.
struct Kept<'a> {
    original: &'a mut [u8],
    upto: usize,
}

impl Kept<'_> {
    fn save(&mut self, dst: &[u8], end: usize) {
        if end > self.upto {
            copy_bypassing_cache(&mut self.original[self.upto..end], &dst[self.upto..end]);
            self.upto = end;
        }
    }
}

impl<'a> Incoming<'a> {
    pub fn new(peer: usize, sink: Sink<'a>) -> Self {
        Incoming {
            peer,
            sink,
            offset: 0,
            started: false,
            keep: None,
        }
    }

    /// Saves what a copy overwrites into `original` (as long as the destination).
    pub fn keeping(mut self, original: &'a mut [u8]) -> Self {
        self.keep = Some(Kept { original, upto: 0 });
        self
    }

    /// Puts back what this message's copy overwrote (after a failed exchange).
    pub fn restore(&mut self) {
        if let (Sink::Copy(dst), Some(k)) = (&mut self.sink, &self.keep) {
            dst[..k.upto].copy_from_slice(&k.original[..k.upto]);
        }
    }
    fn done(&self) -> bool {
        self.started && self.offset >= self.sink.len()
    }
}

/// From this many payload bytes a cell's payload is written straight from the caller's
/// memory (its stamp from staging, as a second write of the same batch) instead of
/// being copied into a staging cell first; smaller cells go as one write, which costs
/// less per message than two.
///
/// The CRC over payload and stamp stays on these cells although the payload is posted
/// ahead of the stamp: the payload write carries no stamp of its own, so a late one (a
/// TCP write its sender gave up on, or a stopped sender's copy resumed two epoch changes
/// later, when the cell set is in use again) would otherwise pass for current data.
/// With the CRC such a cell is never consumed, whatever order the writes land in.
const DIRECT_MIN: usize = 16 << 10;

/// Operation kinds, in the low byte of a cell's tag.
pub(super) const KIND_P2P: u64 = 0xff;

/// Packs a credit word: the epoch (low 24 bits) and a count (40 bits).
fn credit_word(epoch: u64, consumed: u64) -> u64 {
    (epoch & 0xff_ffff) << 40 | (consumed & 0xff_ffff_ffff)
}

impl Group {
    /// Posts writes as one batch; the peers of failed writes are returned. Writes that
    /// only copy (a peer on this host) are made here, on the calling thread, as the
    /// engine does for a synchronous transfer: handing them to the engine's worker
    /// costs a wake-up per message, and the waiting rank has nothing else to do on
    /// this core meanwhile. Others are left in flight and reaped later.
    pub(super) fn post(
        &self,
        st: &mut State,
        reqs: Vec<Request>,
        peers: Vec<Option<usize>>,
    ) -> Vec<usize> {
        if reqs.is_empty() {
            return Vec::new();
        }
        // SAFETY: every local range is inside our buffer or the caller's, both valid
        // for the call, and the call returns once no copy can touch them.
        if let Some(states) = unsafe { self.transport.write_inline(&reqs) } {
            return match states {
                Ok(states) => {
                    let mut failed: Vec<usize> = Vec::new();
                    for (s, p) in states.iter().zip(&peers) {
                        if *s != TaskState::Completed {
                            failed.extend(p);
                        }
                    }
                    failed
                }
                Err(e) => {
                    log::debug!("group rank {}: write refused: {e}", self.rank());
                    peers.into_iter().flatten().collect()
                }
            };
        }
        // SAFETY: every local range is inside our buffer, which outlives the engine's
        // use of it (the engine owns and frees it last).
        let batch = match unsafe { self.transport.submit(&reqs) } {
            Ok(b) => b,
            Err(e) => {
                log::debug!("group rank {}: write refused: {e}", self.rank());
                return peers.into_iter().flatten().collect();
            }
        };
        st.outstanding.push((batch, peers));
        Vec::new()
    }

    /// Frees finished batches; returns the peers whose writes failed.
    pub(super) fn reap(&self, st: &mut State) -> Vec<usize> {
        let mut failed = Vec::new();
        st.outstanding.retain(|(batch, peers)| {
            let mut all_final = true;
            let mut bad: Vec<usize> = Vec::new();
            for (t, p) in peers.iter().enumerate() {
                match self.transport.task_state(*batch, t) {
                    Ok(TaskState::Completed) => {}
                    Ok(s) if s.is_final() => bad.extend(p),
                    Ok(_) => all_final = false,
                    Err(_) => bad.extend(p),
                }
            }
            if all_final {
                failed.extend(bad);
                self.transport.free_batch(*batch);
            }
            !all_final
        });
        failed
    }

    /// Waits (bounded by the timeout) until no posted write can still land, so a new
    /// epoch starts with no write of the old one in flight.
    pub(super) fn drain(&self, st: &mut State) {
        let deadline = self.clock.now() + self.options.timeout + Duration::from_secs(1);
        let mut idle = 0;
        while !st.outstanding.is_empty() && self.clock.now() < deadline {
            self.reap(st);
            idle += 1;
            self.clock.backoff(idle);
        }
        if !st.outstanding.is_empty() {
            log::warn!(
                "group rank {}: {} write batches still pending at epoch change",
                self.rank(),
                st.outstanding.len()
            );
        }
    }

    /// Stages `record` in our buffer and returns the write that puts it into slot
    /// `slot(me)` of peer `p`; `None` when `p` has no known address.
    pub(super) fn record_write(
        &self,
        st: &State,
        p: usize,
        slot: &impl Fn(&Layout, usize) -> usize,
        record: &[u8],
    ) -> Option<Request> {
        let peer = st.peers[p]?;
        let stage = self.layout.record_stage(p);
        // SAFETY: the staging slot (RECORD bytes) lies inside our buffer and `record` is
        // at most RECORD bytes (encoders guarantee it).
        unsafe { std::ptr::copy_nonoverlapping(record.as_ptr(), self.buf(stage), record.len()) };
        Some(Request {
            op: Op::Write,
            local: (self.base + stage) as u64,
            segment: peer.segment,
            remote: peer.base + slot(&self.layout, self.rank()) as u64,
            len: record.len() as u64,
        })
    }

    /// Writes `record` into slot `slot(me)` of each peer in `to`, in one batch, waiting
    /// up to `timeout`; returns the peers the write did not reach.
    pub(super) fn write_records(
        &self,
        st: &mut State,
        to: &[usize],
        slot: impl Fn(&Layout, usize) -> usize,
        record: &[u8],
        timeout: Duration,
    ) -> Vec<usize> {
        let mut reqs = Vec::new();
        let mut peers = Vec::new();
        let mut unreached = Vec::new();
        for &p in to {
            match self.record_write(st, p, &slot, record) {
                Some(req) => {
                    reqs.push(req);
                    peers.push(p);
                }
                None => unreached.push(p),
            }
        }
        if reqs.is_empty() {
            return unreached;
        }
        // SAFETY: local ranges are staging slots of our buffer (see `post`).
        let Ok(batch) = (unsafe { self.transport.submit(&reqs) }) else {
            unreached.extend(peers);
            return unreached;
        };
        self.transport.wait_batch(batch, timeout);
        for (t, &p) in peers.iter().enumerate() {
            match self.transport.task_state(batch, t) {
                Ok(TaskState::Completed) => {}
                _ => unreached.push(p),
            }
        }
        st.outstanding
            .push((batch, peers.into_iter().map(Some).collect()));
        self.reap(st);
        unreached
    }

    /// Cells consumed from `p` so far as `p` told us (0 when its word is from an older
    /// epoch).
    fn credit_seen(&self, st: &State, p: usize) -> u64 {
        // SAFETY: the credit word is inside our buffer; 8-byte aligned.
        let w = unsafe { std::ptr::read_volatile(self.buf(self.layout.credit(p)).cast::<u64>()) };
        if w >> 40 == st.epoch & 0xff_ffff {
            w & 0xff_ffff_ffff
        } else {
            0
        }
    }

    /// Runs one exchange: sends every `out`, receives every `inc`, until all are done
    /// or the timeout; at most one message each way per peer. On failure the ranks not
    /// heard from (or not reached) are recorded in `last_failed`. Returns only once
    /// every message written has landed or failed (bounded): no write still reads the
    /// callers' memory (large payloads are written from it), and a rank that exits
    /// right after an operation has delivered its part of it to every peer.
    pub(super) fn exchange(
        &self,
        st: &mut State,
        kind: u64,
        out: &mut [Outgoing<'_>],
        inc: &mut [Incoming<'_>],
    ) -> Result<()> {
        self.exchange_known(st, kind, out, inc, PayloadCrcs::default())
    }

    /// [`exchange`](Self::exchange) given CRCs already known of payloads it sends.
    pub(super) fn exchange_known(
        &self,
        st: &mut State,
        kind: u64,
        out: &mut [Outgoing<'_>],
        inc: &mut [Incoming<'_>],
        mut known: PayloadCrcs,
    ) -> Result<()> {
        let mut awaited = Vec::new();
        let result = self.exchange_cells(st, kind, out, inc, &mut awaited, &mut known);
        self.release(st, &awaited);
        result
    }

    /// Waits (bounded) until the batches in `awaited` are final and reaped.
    fn release(&self, st: &mut State, awaited: &[BatchId]) {
        let pending = |st: &State| st.outstanding.iter().any(|(b, _)| awaited.contains(b));
        // Past the engine's transfer timeout (the group's) every task is final.
        let deadline = self.clock.now() + self.options.timeout + Duration::from_secs(1);
        let mut idle = 0;
        while pending(st) && self.clock.now() < deadline {
            self.reap(st);
            idle += 1;
            self.clock.backoff(idle);
        }
        if pending(st) {
            log::warn!(
                "group rank {}: message writes still pending after the timeout",
                self.rank()
            );
        }
    }

    fn exchange_cells(
        &self,
        st: &mut State,
        kind: u64,
        out: &mut [Outgoing<'_>],
        inc: &mut [Incoming<'_>],
        awaited: &mut Vec<BatchId>,
        known: &mut PayloadCrcs,
    ) -> Result<()> {
        let p2p = kind == KIND_P2P;
        // Point-to-point traffic involves two ranks only, so it must not advance the
        // sequence all members share.
        let tag = if p2p {
            KIND_P2P
        } else {
            st.seq += 1;
            st.seq << 8 | kind
        };
        // A member this rank never reached (gone before it started: see
        // `Group::connect`) cannot be written to; waiting out the timeout for it would
        // only delay the same failure.
        let mut unreachable: Vec<usize> = out
            .iter()
            .map(|m| m.peer)
            .filter(|&p| st.peers[p].is_none())
            .collect();
        // Point-to-point messages are each between two ranks: a failed peer fails only
        // its own. The exchange gives up on it (unreachable, a write to it failed, or
        // announced as failed), finishes the others', and then fails naming every peer
        // with a message not delivered, so the caller knows which went through.
        let mut given_up = Mask::default();
        if p2p {
            given_up = Mask::of(&unreachable);
            unreachable.clear();
        }
        if !unreachable.is_empty() {
            unreachable.sort_unstable();
            unreachable.dedup();
            return Err(self.fail(
                st,
                unreachable,
                "never reached (gone before this rank started)",
            ));
        }
        // Measured from the last progress: a large exchange that keeps moving may take
        // longer than the timeout in all; a peer that stops moving may not.
        let timeout = st.op_timeout.unwrap_or(self.options.timeout);
        let mut deadline = self.clock.now() + timeout;
        let mut idle = 0u32;
        let mut recheck = Recheck::within(&*self.clock, timeout);
        // A cell's payload copied out before it is checked and used (see below).
        let mut checked: Vec<u8> = Vec::new();
        let mut delivered_before = 0;
        loop {
            let mut progressed = false;
            let mut reqs = Vec::new();
            let mut req_peers = Vec::new();
            // Receive first: consuming frees cells, and credits ride in the same batch.
            for m in inc
                .iter_mut()
                .filter(|m| !m.done() && !given_up.has(m.peer))
            {
                let p = m.peer;
                progressed |= self.take_cells(st, m, tag, &mut checked)?;
                self.credit_if_due(st, p, m.done(), &mut reqs, &mut req_peers);
            }
            for m in out
                .iter_mut()
                .filter(|m| !m.done() && !given_up.has(m.peer))
            {
                progressed |= self.fill_cells(st, m, tag, known, &mut reqs, &mut req_peers);
            }
            let posted_before = st.outstanding.len();
            let messages = req_peers.iter().any(Option::is_some);
            let mut failed = self.post(st, reqs, req_peers);
            // A point-to-point receive's last credit is its sender's proof of delivery:
            // it must land even if this rank exits right after.
            if (messages || p2p) && st.outstanding.len() > posted_before {
                // `post` appended this batch; `exchange` waits for it before returning.
                awaited.extend(st.outstanding.last().map(|(b, _)| *b));
            }
            failed.extend(self.reap(st));
            if !failed.is_empty() {
                failed.sort_unstable();
                failed.dedup();
                if !p2p {
                    return Err(self.fail(st, failed, "writes to them failed"));
                }
                given_up = given_up.union(&Mask::of(&failed));
            }
            if p2p {
                // A delivery seen is progress, as a cell taken is.
                let delivered = out.iter().filter(|m| self.delivered(st, m)).count();
                progressed |= delivered > delivered_before;
                delivered_before = delivered;
            }
            let settled = out
                .iter()
                .all(|m| self.delivered(st, m) || given_up.has(m.peer))
                && inc.iter().all(|m| m.done() || given_up.has(m.peer));
            if settled {
                let missing = self.undelivered(st, out, inc);
                if missing.is_empty() {
                    st.last_failed.clear();
                    return Ok(());
                }
                return Err(self.fail(st, missing, "gave up on them"));
            }
            if progressed {
                deadline = self.clock.now() + timeout;
                idle = 0;
                continue;
            }
            idle += 1;
            self.clock.backoff(idle);
            if recheck.due(&*self.clock, idle) {
                self.stop_if_announced_or_late(st, tag, out, inc, &mut given_up, deadline)?;
            }
        }
    }

    /// The exchange's slower checks: a membership change announced (a collective stops
    /// and fails naming the suspects; a point-to-point exchange gives up on them and
    /// finishes with the others) or the deadline passed, with what the cells held.
    fn stop_if_announced_or_late(
        &self,
        st: &mut State,
        tag: u64,
        out: &[Outgoing<'_>],
        inc: &[Incoming<'_>],
        given_up: &mut Mask,
        deadline: Instant,
    ) -> Result<()> {
        let cells = self.layout.cells as u64;
        let p2p = tag == KIND_P2P; // a collective's tag carries its sequence above
        let exchange = (!p2p).then_some(st.seq);
        match self.change_stops_operation(st, exchange) {
            // Messages with the suspects are given up; the others go on.
            Some(suspects) if p2p && !suspects.is_empty() && !suspects.has(self.rank()) => {
                *given_up = given_up.union(&suspects)
            }
            Some(suspects) => {
                // The announcer's evidence names the failed ranks; ranks we
                // were merely still waiting for may be waiting on those same
                // ranks. A point-to-point exchange names exactly the peers of
                // its messages not delivered.
                let missing = if suspects.is_empty() || p2p {
                    self.undelivered(st, out, inc)
                } else {
                    suspects.ranks()
                };
                return Err(self.fail(st, missing, "a membership change was announced"));
            }
            None => {}
        }
        if self.clock.now() >= deadline {
            let missing = self.undelivered(st, out, inc);
            for m in inc.iter().filter(|m| !m.done()) {
                let ch = st.channels[m.peer];
                let cell = self.buf(self.layout.recv_cell(
                    m.peer,
                    (ch.consumed % cells) as usize,
                    st.epoch,
                ));
                // SAFETY: a cell header inside our buffer.
                let word =
                    |at: usize| unsafe { std::ptr::read_volatile(cell.add(at).cast::<u64>()) };
                log::debug!(
                    "group rank {}: epoch {} tag {tag:#x}: from {} expecting message {}, cell holds epoch {} message {} tag {:#x}",
                    self.rank(), st.epoch, m.peer, ch.consumed + 1, word(8), word(16), word(24)
                );
            }
            for m in out.iter().filter(|m| !m.done()) {
                log::debug!(
                    "group rank {}: to {} sent {} credit {}",
                    self.rank(),
                    m.peer,
                    st.channels[m.peer].sent,
                    self.credit_seen(st, m.peer)
                );
            }
            return Err(self.fail(st, missing, "timed out"));
        }
        Ok(())
    }

    /// Takes the cells of message `m` that have landed whole, in order: copies and
    /// checks each (see below) into the caller's buffer or the reduction. Whether any
    /// was taken; an error when the sender runs another collective.
    fn take_cells(
        &self,
        st: &mut State,
        m: &mut Incoming<'_>,
        tag: u64,
        checked: &mut Vec<u8>,
    ) -> Result<bool> {
        let cells = self.layout.cells as u64;
        let cap = self.layout.payload();
        let p = m.peer;
        let mut progressed = false;
        while !m.done() {
            let ch = st.channels[p];
            let k = (ch.consumed % cells) as usize;
            let cell = self.buf(self.layout.recv_cell(p, k, st.epoch));
            // SAFETY: the cell lies inside our buffer with `cap` payload bytes.
            let Some(head) = (unsafe { read_cell_head(cell, cap, st.epoch, ch.consumed + 1) })
            else {
                break;
            };
            let stamp = head.stamp;
            // SAFETY: `stamp.len <= cap` payload bytes follow the stamp.
            let whole = unsafe { std::slice::from_raw_parts(cell.add(CELL_HEADER), stamp.len) };
            let remaining = m.sink.len() - m.offset;
            if stamp.tag != tag || stamp.total != m.sink.len() as u64 {
                if !head.payload_matches(whole) {
                    break; // still landing: the stamp is not to be believed yet
                }
                st.last_failed = vec![p];
                st.needs_sync = true;
                return Err(Error::new(
                    Code::InvalidParams,
                    format!(
                        "rank {p} sent operation {:#x} of {} bytes where this rank runs \
                         {tag:#x} expecting {}: ranks called different collectives",
                        stamp.tag,
                        stamp.total,
                        m.sink.len()
                    ),
                ));
            }
            let len = stamp.len.min(remaining);
            match &mut m.sink {
                // Copy and check in one pass: each word is checksummed as it
                // is stored, so the cell is read once and what was checked is
                // exactly what was taken. A cell still landing leaves a partial
                // copy that the retry overwrites.
                Sink::Copy(b) if stamp.len <= remaining => {
                    if let Some(k) = &mut m.keep {
                        k.save(b, m.offset + len);
                    }
                    let dst = &mut b[m.offset..m.offset + len];
                    // SAFETY: `dst` holds `len == whole.len()` bytes of the
                    // caller's buffer, which is not the receive cell.
                    let crc = unsafe { crc32c_append_copying(0, whole, dst.as_mut_ptr()) };
                    if !head.payload_crc_matches(crc) {
                        break;
                    }
                }
                // The same for a reduction: it uses the checked copy, never the
                // live cell, into which a stale write of an older epoch could
                // land between a check and a second read.
                _ => {
                    checked.clear();
                    checked.reserve(whole.len());
                    // SAFETY: `checked` has room for `whole.len()` bytes (reserved
                    // above), apart from the cell; they are all written before
                    // `set_len` counts them.
                    let crc = unsafe {
                        let crc = crc32c_append_copying(0, whole, checked.as_mut_ptr());
                        checked.set_len(whole.len());
                        crc
                    };
                    if !head.payload_crc_matches(crc) {
                        break;
                    }
                    if let (Sink::Copy(b), Some(k)) = (&m.sink, &mut m.keep) {
                        k.save(b, m.offset + len);
                    }
                    m.sink.take(m.offset, &checked[..len]);
                }
            }
            m.offset += len;
            m.started = true;
            st.channels[p].consumed += 1;
            progressed = true;
        }
        Ok(progressed)
    }

    /// Tells peer `p` which cells it may reuse, once half of them are taken (or the
    /// message is `done`): a credit word, written in the same batch as our cells.
    fn credit_if_due(
        &self,
        st: &mut State,
        p: usize,
        done: bool,
        reqs: &mut Vec<Request>,
        req_peers: &mut Vec<Option<usize>>,
    ) {
        let cells = self.layout.cells as u64;
        let ch = st.channels[p];
        if ch.consumed - ch.credited >= (cells / 2).max(1) || (done && ch.consumed > ch.credited) {
            if let Some(peer) = st.peers[p] {
                let stage = self.layout.credit_stage(p);
                // SAFETY: the credit staging word is inside our buffer, aligned.
                unsafe {
                    std::ptr::write_volatile(
                        self.buf(stage).cast::<u64>(),
                        credit_word(st.epoch, ch.consumed),
                    )
                };
                reqs.push(Request {
                    op: Op::Write,
                    local: (self.base + stage) as u64,
                    segment: peer.segment,
                    remote: peer.base + self.layout.credit(self.rank()) as u64,
                    len: 8,
                });
                req_peers.push(None);
                st.channels[p].credited = ch.consumed;
            }
        }
    }

    /// Stages and posts as many cells of message `m` as peer `p`'s credit allows (a
    /// large payload is written straight from the caller's buffer, its header after).
    /// Whether any was posted.
    fn fill_cells(
        &self,
        st: &mut State,
        m: &mut Outgoing<'_>,
        tag: u64,
        known: &mut PayloadCrcs,
        reqs: &mut Vec<Request>,
        req_peers: &mut Vec<Option<usize>>,
    ) -> bool {
        let cells = self.layout.cells as u64;
        let cap = self.layout.payload();
        let p2p = tag == KIND_P2P; // a collective's tag carries its sequence above
        let p = m.peer;
        let Some(peer) = st.peers[p] else {
            return false;
        };
        let mut progressed = false;
        while !m.done() && st.channels[p].sent.saturating_sub(self.credit_seen(st, p)) < cells {
            let sent = st.channels[p].sent;
            let k = (sent % cells) as usize;
            let len = (m.data.len() - m.offset).min(cap);
            let stage = self.layout.send_cell(p, k);
            let remote = peer.base + self.layout.recv_cell(self.rank(), k, st.epoch) as u64;
            let stamp = CellStamp {
                epoch: st.epoch,
                msg: sent + 1,
                tag,
                len,
                total: m.data.len() as u64,
            };
            let payload = &m.data[m.offset..m.offset + len];
            if len >= DIRECT_MIN {
                // The CRC covers the payload too, so the receiver takes the cell
                // only once both writes have landed, in whichever order.
                let mut header = [0u8; CELL_HEADER];
                encode_cell_header(&mut header, &stamp, known.of(payload));
                // SAFETY: the staging cell lies inside our buffer; its previous
                // write has landed (the peer consumed it: the credit says so).
                unsafe {
                    std::ptr::copy_nonoverlapping(header.as_ptr(), self.buf(stage), CELL_HEADER)
                };
                reqs.push(Request {
                    op: Op::Write,
                    local: payload.as_ptr() as u64,
                    segment: peer.segment,
                    remote: remote + CELL_HEADER as u64,
                    len: len as u64,
                });
                req_peers.push(Some(p));
                reqs.push(Request {
                    op: Op::Write,
                    local: (self.base + stage) as u64,
                    segment: peer.segment,
                    remote,
                    len: CELL_HEADER as u64,
                });
            } else {
                // SAFETY: as above, for the whole staging cell.
                let cell =
                    unsafe { std::slice::from_raw_parts_mut(self.buf(stage), CELL_HEADER + len) };
                encode_cell(cell, &stamp, payload);
                reqs.push(Request {
                    op: Op::Write,
                    local: (self.base + stage) as u64,
                    segment: peer.segment,
                    remote,
                    len: (CELL_HEADER + len) as u64,
                });
            }
            req_peers.push(Some(p));
            m.offset += len;
            m.started = true;
            st.channels[p].sent += 1;
            if p2p && m.done() {
                m.through = st.channels[p].sent;
            }
            progressed = true;
        }
        progressed
    }

    /// Whether `m` is through: written, and for a point-to-point message also taken
    /// by its receiver, so a send to a rank that is gone fails even where the write
    /// itself lands (a dead process's shared memory). A collective's peers prove
    /// delivery by answering in the same operation.
    fn delivered(&self, st: &State, m: &Outgoing<'_>) -> bool {
        m.done() && (m.through == 0 || self.credit_seen(st, m.peer) >= m.through)
    }

    /// The peers of the messages not through yet (see [`delivered`](Self::delivered)).
    fn undelivered(&self, st: &State, out: &[Outgoing<'_>], inc: &[Incoming<'_>]) -> Vec<usize> {
        let mut v: Vec<usize> = out
            .iter()
            .filter(|m| !self.delivered(st, m))
            .map(|m| m.peer)
            .chain(inc.iter().filter(|m| !m.done()).map(|m| m.peer))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Records a failed operation and, with auto-sync, tells the other members at once
    /// so they stop waiting and reconcile too.
    fn fail(&self, st: &mut State, missing: Vec<usize>, why: &str) -> Error {
        st.last_failed = missing.clone();
        st.needs_sync = true;
        if self.options.auto_sync_on_failure {
            let suspects = if self.options.auto_deactivate_on_failure {
                Mask::of(&missing)
            } else {
                Mask::default()
            };
            self.announce(st, suspects, Mask::default(), Mask::default());
        }
        Error::new(
            Code::Timeout,
            format!(
                "rank {}: collective failed at epoch {} ({why}); failed ranks {missing:?}",
                self.rank(),
                st.epoch
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn a_region_is_finished_and_its_crc_taken_only_once_every_part_is_in() {
        // Two regions of 8 bytes (two f32 each) and a short third; two parts each; avg
        // over three members.
        let mut acc = f32s(&[3.0, 6.0, 9.0, 12.0, 30.0]);
        let original = acc.clone();
        let mut regions = FinishedRegions::new(acc.len(), 8, 2, 3, Some(Vec::new()));
        let part = f32s(&[3.0, 3.0, 3.0, 3.0, 3.0]);
        for (offset, len) in [(0, 8), (8, 8), (0, 8)] {
            regions.keep_original(&acc[offset..offset + len], offset);
            reduce_into(
                &mut acc[offset..offset + len],
                &part[offset..offset + len],
                DType::F32,
                ReduceOp::Avg,
            );
            regions.folded(
                &mut acc[offset..offset + len],
                offset,
                DType::F32,
                ReduceOp::Avg,
            );
        }
        assert_eq!(
            &acc[..8],
            &f32s(&[3.0, 4.0])[..],
            "region 0: both parts, divided"
        );
        assert_eq!(
            &acc[8..16],
            &f32s(&[12.0, 15.0])[..],
            "region 1: one part, untouched"
        );
        assert_eq!(regions.crcs[0], Some(crc32c(&acc[..8])));
        assert_eq!(regions.crcs[1], None);
        // A failure now would put back the two regions folded into, not the third.
        let mut failed = acc.clone();
        failed[16..].copy_from_slice(&f32s(&[-1.0]));
        regions.restore(&mut failed);
        assert_eq!(failed[..16], original[..16]);
        assert_eq!(failed[16..], f32s(&[-1.0])[..]);
        let ptr = acc.as_ptr() as usize;
        // Completion (what an exchange that lost no part never needs) finishes the rest.
        let mut known = regions.complete(&mut acc, DType::F32, ReduceOp::Avg);
        assert_eq!(acc, f32s(&[3.0, 4.0, 4.0, 5.0, 10.0]));
        for (offset, len) in [(0, 8), (8, 8), (16, 4)] {
            let region = &acc[offset..offset + len];
            assert_eq!(known.0.get(&(ptr + offset, len)), Some(&crc32c(region)));
            assert_eq!(known.of(region), crc32c(region));
        }
        assert_eq!(
            known.0.len(),
            3,
            "looked up, not recomputed under another key"
        );
    }
}
