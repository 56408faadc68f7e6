//! The collectives, each a short sequence of exchanges among the active ranks.

#![forbid(unsafe_code)]

use std::cell::RefCell;

use super::channel::{Accumulator, FinishedRegions, Incoming, Outgoing, Sink, State, KIND_P2P};
use super::dtype::{finish_avg, reduce_into, DType, ReduceOp};
use super::Group;
use crate::error::{Error, Result};

const KIND_ALL_REDUCE: u64 = 1;
const KIND_REDUCE_SCATTER_PHASE: u64 = 2;
const KIND_ALL_GATHER_PHASE: u64 = 3;
const KIND_BROADCAST: u64 = 4;
const KIND_ALL_GATHER: u64 = 5;
const KIND_REDUCE_SCATTER: u64 = 6;
const KIND_ALL_TO_ALL: u64 = 7;
const KIND_BARRIER: u64 = 8;
const KIND_REDUCE: u64 = 9;
const KIND_GATHER: u64 = 10;
const KIND_SCATTER: u64 = 11;
/// An agreement round (`agree_max`): its own kind, so it can only ever pair with
/// another agreement round, never with a caller's collective.
const KIND_AGREE: u64 = 12;

/// Up to this size an all-reduce sends the whole buffer to every member in one round;
/// above it, a reduce-scatter then an all-gather move each byte fewer times.
const ONE_ROUND_MAX: usize = 64 << 10;

/// Cuts `buf` into consecutive blocks of `sizes` bytes.
fn split_mut<'a>(mut buf: &'a mut [u8], sizes: &[usize]) -> Vec<&'a mut [u8]> {
    let mut out = Vec::with_capacity(sizes.len());
    for &s in sizes {
        let (head, rest) = std::mem::take(&mut buf).split_at_mut(s);
        out.push(head);
        buf = rest;
    }
    out
}

fn offsets(sizes: &[usize]) -> Vec<usize> {
    sizes
        .iter()
        .scan(0, |acc, &s| {
            let o = *acc;
            *acc += s;
            Some(o)
        })
        .collect()
}

/// Reduces `parts` (in order) into `out`, then divides for `Avg`.
fn reduce_parts(out: &mut [u8], parts: &[&[u8]], dtype: DType, op: ReduceOp) {
    if let Some((first, rest)) = parts.split_first() {
        out.copy_from_slice(first);
        for p in rest {
            reduce_into(out, p, dtype, op);
        }
    }
    if op == ReduceOp::Avg {
        finish_avg(out, dtype, parts.len());
    }
}

impl Group {
    fn begin(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        let mut st = self.lock();
        self.begin_op(&mut st)?;
        Ok(st)
    }

    /// [`begin`](Self::begin) for a caller's collective: with `agree_on_new_view`, one
    /// that entered a new view here is refused before anything moves (see the option).
    fn begin_collective(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        let mut st = self.lock();
        let before = st.epoch;
        self.begin_op(&mut st)?;
        if self.options.agree_on_new_view && st.epoch != before {
            return Err(Error::new(
                crate::error::Code::UnavailableInCurrentStatus,
                format!(
                    "rank {}: entered epoch {} at the start of the operation: agree first",
                    self.rank(),
                    st.epoch
                ),
            ));
        }
        Ok(st)
    }

    fn others(&self, st: &State) -> Vec<usize> {
        st.mask
            .ranks()
            .into_iter()
            .filter(|&r| r != self.rank())
            .collect()
    }

    pub(super) fn check_sizes(&self, sizes: &[usize], what: &str) -> Result<usize> {
        if sizes.len() != self.size() {
            return Err(Error::invalid(format!(
                "{what}: {} sizes for world_size {}",
                sizes.len(),
                self.size()
            )));
        }
        sizes
            .iter()
            .try_fold(0usize, |a, &s| a.checked_add(s))
            .ok_or_else(|| Error::invalid(format!("{what}: sizes overflow")))
    }

    /// Sizes of a rooted collective (gather, scatter): this rank's own block is
    /// `sizes[rank]` bytes, and the root's whole buffer their sum. Checked before the
    /// operation begins, so a refusal leaves every rank in step.
    fn check_rooted(
        &self,
        what: &str,
        sizes: &[usize],
        (own_name, own_len): (&str, usize),
        (whole_name, whole_len): (&str, usize),
        root: usize,
    ) -> Result<()> {
        let total = self.check_sizes(sizes, what)?;
        if own_len != sizes[self.rank()] {
            return Err(Error::invalid(format!(
                "{what}: {own_name} size differs from sizes[rank]"
            )));
        }
        if root == self.rank() && whole_len != total {
            return Err(Error::invalid(format!(
                "{what}: {whole_name} size differs from the sum of sizes"
            )));
        }
        Ok(())
    }

    fn check_root(&self, st: &State, root: usize) -> Result<()> {
        if st.mask.has(root) {
            Ok(())
        } else {
            Err(Error::invalid(format!("root {root} is not an active rank")))
        }
    }

    /// Combines `buf` (elements of `dtype`) across the active ranks; every active rank
    /// ends with the same result. A failed operation leaves `buf` as it was, so it can
    /// be run again over the survivors as it is (above 64 KiB the buffer is reduced in
    /// place, so the bytes each phase overwrites are saved first, into scratch as large
    /// as the buffer, kept for the next operation up to `staging_keep_bytes`).
    pub fn all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        self.all_reduce_keeping(buf, dtype, op, true)
    }

    /// [`Group::all_reduce`]; with `keep` false a failure may leave `buf` partly
    /// reduced (for a staging buffer that is copied back only on success).
    pub(super) fn all_reduce_keeping(
        &self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        keep: bool,
    ) -> Result<()> {
        if buf.len() % dtype.size() != 0 {
            return Err(Error::invalid("buffer is not a whole number of elements"));
        }
        let mut st = self.begin_collective()?;
        let members = st.mask.ranks();
        let others = self.others(&st);
        if buf.len() <= ONE_ROUND_MAX {
            let got = self.swap_with_all(&mut st, KIND_ALL_REDUCE, &others, buf)?;
            let mine = buf.to_vec();
            // Every rank combines in rank order, so all get bit-identical results.
            let parts: Vec<&[u8]> = members
                .iter()
                .map(|&r| match others.iter().position(|&p| p == r) {
                    Some(i) => got[i].as_slice(),
                    None => mine.as_slice(),
                })
                .collect();
            reduce_parts(buf, &parts, dtype, op);
            return Ok(());
        }
        let n = members.len();
        let elems = buf.len() / dtype.size();
        let sizes: Vec<usize> = (0..n)
            .map(|i| (elems * (i + 1) / n - elems * i / n) * dtype.size())
            .collect();
        let me = members.iter().position(|&r| r == self.rank()).unwrap_or(0);
        // A lone member overwrites nothing before it succeeds.
        let kept = (keep && n > 1).then(|| {
            let mut kept = std::mem::take(&mut st.kept);
            if kept.len() < buf.len() {
                kept.resize(buf.len(), 0);
            }
            kept
        });
        let keeping = kept.is_some();
        let regions = RefCell::new(FinishedRegions::new(
            sizes[me],
            self.layout.payload(),
            n - 1,
            n,
            kept,
        ));
        let result = self.reduce_then_gather(&mut st, buf, &sizes, me, dtype, op, &regions);
        let kept = regions.into_inner().into_kept();
        // Kept for the next operation up to the same cap as device staging.
        if keeping && kept.len() <= self.options.staging_keep_bytes {
            st.kept = kept;
        }
        result
    }

    /// All-reduce's two phases over blocks of `sizes` (member `me` owns block `me`).
    /// The caller's buffer is the accumulator, and what the phases overwrite in it is
    /// saved first (into `regions`' scratch), so that an operation that fails leaves
    /// the buffer as it was: a retry over the survivors starts from the caller's values.
    #[allow(clippy::too_many_arguments)]
    fn reduce_then_gather(
        &self,
        st: &mut State,
        buf: &mut [u8],
        sizes: &[usize],
        me: usize,
        dtype: DType,
        op: ReduceOp,
        regions: &RefCell<FinishedRegions>,
    ) -> Result<()> {
        let members = st.mask.ranks();
        let others = self.others(st);
        let own = offsets(sizes)[me]..offsets(sizes)[me] + sizes[me];
        // Phase 1: member i reduces block i from everyone's copy of it, each cell as it
        // arrives (the order varies between runs; every rank gets the owner's result),
        // in place: block i of the caller's buffer is the accumulator. Each region is
        // finished (and its CRC taken) as its last part comes in.
        let phase1 = {
            let mut acc: &mut [u8] = &mut [];
            let mut out: Vec<Outgoing> = Vec::with_capacity(members.len());
            for (i, b) in split_mut(buf, sizes).into_iter().enumerate() {
                if i == me {
                    acc = b;
                } else {
                    out.push(Outgoing::new(members[i], b));
                }
            }
            let shared = Accumulator::new(acc, dtype, op, Some(regions));
            let mut inc: Vec<Incoming> = others
                .iter()
                .map(|&p| Incoming::new(p, Sink::Reduce(shared)))
                .collect();
            self.exchange(st, KIND_REDUCE_SCATTER_PHASE, &mut out, &mut inc)
        };
        let mut regions = regions.borrow_mut();
        if let Err(e) = phase1 {
            regions.restore(&mut buf[own]);
            return Err(e);
        }
        // Phase 2: every member sends its reduced block to all; the others' blocks are
        // overwritten as their cells come in, their originals saved first in the
        // scratch behind the own block's.
        let known = regions.complete(&mut buf[own.clone()], dtype, op);
        let phase2 = {
            let mut spare = regions.spare();
            let mut mine: &[u8] = &[];
            let mut inc: Vec<Incoming> = Vec::with_capacity(members.len());
            for (i, b) in split_mut(buf, sizes).into_iter().enumerate() {
                if i == me {
                    mine = b;
                } else if spare.len() >= b.len() {
                    let (original, rest) = std::mem::take(&mut spare).split_at_mut(b.len());
                    spare = rest;
                    inc.push(Incoming::new(members[i], Sink::Copy(b)).keeping(original));
                } else {
                    // Nothing kept (see `all_reduce_keeping`).
                    inc.push(Incoming::new(members[i], Sink::Copy(b)));
                }
            }
            let mut out: Vec<Outgoing> = others.iter().map(|&p| Outgoing::new(p, mine)).collect();
            let result = self.exchange_known(st, KIND_ALL_GATHER_PHASE, &mut out, &mut inc, known);
            if result.is_err() {
                inc.iter_mut().for_each(Incoming::restore);
            }
            result
        };
        if phase2.is_err() {
            regions.restore(&mut buf[own]);
        }
        phase2
    }

    /// Copies `root`'s `buf` into every active rank's `buf`.
    pub fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<()> {
        let mut st = self.begin_collective()?;
        self.check_root(&st, root)?;
        if root == self.rank() {
            let mut out: Vec<Outgoing> = self
                .others(&st)
                .into_iter()
                .map(|p| Outgoing::new(p, buf))
                .collect();
            self.exchange(&mut st, KIND_BROADCAST, &mut out, &mut [])
        } else {
            let mut inc = [Incoming::new(root, Sink::Copy(buf))];
            self.exchange(&mut st, KIND_BROADCAST, &mut [], &mut inc)
        }
    }

    /// Every active rank's `input` into block r of `output` (blocks of `sizes[r]`
    /// bytes, in rank order); blocks of inactive ranks are left as they are.
    pub fn all_gather(&self, input: &[u8], output: &mut [u8], sizes: &[usize]) -> Result<()> {
        let total = self.check_sizes(sizes, "all_gather")?;
        if output.len() != total || input.len() != sizes[self.rank()] {
            return Err(Error::invalid(format!(
                "all_gather: input {} bytes (size says {}), output {} (sizes sum to {total})",
                input.len(),
                sizes[self.rank()],
                output.len()
            )));
        }
        let mut st = self.begin_collective()?;
        let others = self.others(&st);
        let mut blocks = split_mut(output, sizes);
        blocks[self.rank()].copy_from_slice(input);
        let mut out: Vec<Outgoing> = others.iter().map(|&p| Outgoing::new(p, input)).collect();
        let mut inc: Vec<Incoming> = blocks
            .into_iter()
            .enumerate()
            .filter(|(r, _)| others.contains(r))
            .map(|(r, b)| Incoming::new(r, Sink::Copy(b)))
            .collect();
        self.exchange(&mut st, KIND_ALL_GATHER, &mut out, &mut inc)
    }

    /// Reduces `input` (blocks of `counts[r]` elements, in rank order) across the active
    /// ranks; this rank gets its reduced block in `output`.
    pub fn reduce_scatter(
        &self,
        input: &[u8],
        output: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let sizes: Vec<usize> = counts
            .iter()
            .map(|c| c.saturating_mul(dtype.size()))
            .collect();
        let total = self.check_sizes(&sizes, "reduce_scatter")?;
        let me = self.rank();
        if input.len() != total || output.len() != sizes[me] {
            return Err(Error::invalid(
                "reduce_scatter: input or output size mismatch",
            ));
        }
        let mut st = self.begin_collective()?;
        let others = self.others(&st);
        let offs = offsets(&sizes);
        let block = |r: usize| &input[offs[r]..offs[r] + sizes[r]];
        let mut got: Vec<Vec<u8>> = others.iter().map(|_| vec![0; sizes[me]]).collect();
        {
            let mut out: Vec<Outgoing> =
                others.iter().map(|&p| Outgoing::new(p, block(p))).collect();
            let mut inc: Vec<Incoming> = others
                .iter()
                .zip(got.iter_mut())
                .map(|(&p, g)| Incoming::new(p, Sink::Copy(g)))
                .collect();
            self.exchange(&mut st, KIND_REDUCE_SCATTER, &mut out, &mut inc)?;
        }
        let parts: Vec<&[u8]> = st
            .mask
            .ranks()
            .iter()
            .map(|&r| match others.iter().position(|&p| p == r) {
                Some(i) => got[i].as_slice(),
                None => block(me),
            })
            .collect();
        reduce_parts(output, &parts, dtype, op);
        Ok(())
    }

    /// Block r of `input` (`send[r]` bytes) goes to rank r, which stores it as block
    /// `self` of its `output` (`recv[self]` bytes); blocks of inactive ranks are skipped.
    pub fn all_to_all(
        &self,
        input: &[u8],
        send: &[usize],
        output: &mut [u8],
        recv: &[usize],
    ) -> Result<()> {
        self.all_to_all_within(input, send, output, recv, None)
    }

    /// [`all_to_all`](Self::all_to_all) whose wait for peers is bounded by `timeout`
    /// instead of the group's (expert-parallel dispatch gives each call its own).
    /// Reconciling membership after a failure still uses the group's timeout.
    pub fn all_to_all_within(
        &self,
        input: &[u8],
        send: &[usize],
        output: &mut [u8],
        recv: &[usize],
        timeout: Option<std::time::Duration>,
    ) -> Result<()> {
        if timeout.is_some_and(|t| t.is_zero()) {
            return Err(Error::invalid("all_to_all: timeout must be positive"));
        }
        let in_total = self.check_sizes(send, "all_to_all send")?;
        let out_total = self.check_sizes(recv, "all_to_all recv")?;
        let me = self.rank();
        if input.len() != in_total || output.len() != out_total || send[me] != recv[me] {
            return Err(Error::invalid(
                "all_to_all: buffer sizes do not match the splits",
            ));
        }
        let mut st = self.begin_collective()?;
        let others = self.others(&st);
        let offs = offsets(send);
        let mut blocks = split_mut(output, recv);
        blocks[me].copy_from_slice(&input[offs[me]..offs[me] + send[me]]);
        let mut out: Vec<Outgoing> = others
            .iter()
            .map(|&p| Outgoing::new(p, &input[offs[p]..offs[p] + send[p]]))
            .collect();
        let mut inc: Vec<Incoming> = blocks
            .into_iter()
            .enumerate()
            .filter(|(r, _)| others.contains(r))
            .map(|(r, b)| Incoming::new(r, Sink::Copy(b)))
            .collect();
        st.op_timeout = timeout;
        let result = self.exchange(&mut st, KIND_ALL_TO_ALL, &mut out, &mut inc);
        st.op_timeout = None;
        result
    }

    /// Returns once every active rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        let mut st = self.begin_collective()?;
        let others = self.others(&st);
        self.swap_with_all(&mut st, KIND_BARRIER, &others, &[])
            .map(|_| ())
    }

    /// The largest of the active ranks' `value`s. A collective of its own kind: a rank
    /// that runs a caller's operation where the others agree fails with a mismatch
    /// instead of pairing with them. Callers use it after a membership change to find
    /// out where each rank stands (see `mooncake.pg`: a rank whose operation failed
    /// while a peer's completed must not run it again against that peer's next one).
    pub fn agree_max(&self, value: u64) -> Result<u64> {
        let mut st = self.begin()?;
        let others = self.others(&st);
        let got = self.swap_with_all(&mut st, KIND_AGREE, &others, &value.to_le_bytes())?;
        Ok(got
            .iter()
            .filter_map(|g| g.as_slice().try_into().ok().map(u64::from_le_bytes))
            .fold(value, u64::max))
    }

    /// Sends `mine` to each of `others` and returns what each sent back, as long.
    fn swap_with_all(
        &self,
        st: &mut State,
        kind: u64,
        others: &[usize],
        mine: &[u8],
    ) -> Result<Vec<Vec<u8>>> {
        let mut got: Vec<Vec<u8>> = others.iter().map(|_| vec![0; mine.len()]).collect();
        let mut out: Vec<Outgoing> = others.iter().map(|&p| Outgoing::new(p, mine)).collect();
        let mut inc: Vec<Incoming> = others
            .iter()
            .zip(got.iter_mut())
            .map(|(&p, g)| Incoming::new(p, Sink::Copy(g)))
            .collect();
        self.exchange(st, kind, &mut out, &mut inc)?;
        drop(inc);
        Ok(got)
    }

    /// Combines `buf` across the active ranks into `root`'s `buf` (others' unchanged).
    pub fn reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp, root: usize) -> Result<()> {
        if buf.len() % dtype.size() != 0 {
            return Err(Error::invalid("buffer is not a whole number of elements"));
        }
        let mut st = self.begin_collective()?;
        self.check_root(&st, root)?;
        if root != self.rank() {
            let mut out = [Outgoing::new(root, buf)];
            return self.exchange(&mut st, KIND_REDUCE, &mut out, &mut []);
        }
        let others = self.others(&st);
        let mut got: Vec<Vec<u8>> = others.iter().map(|_| vec![0; buf.len()]).collect();
        {
            let mut inc: Vec<Incoming> = others
                .iter()
                .zip(got.iter_mut())
                .map(|(&p, g)| Incoming::new(p, Sink::Copy(g)))
                .collect();
            self.exchange(&mut st, KIND_REDUCE, &mut [], &mut inc)?;
        }
        let mine = buf.to_vec();
        let parts: Vec<&[u8]> = st
            .mask
            .ranks()
            .iter()
            .map(|&r| match others.iter().position(|&p| p == r) {
                Some(i) => got[i].as_slice(),
                None => mine.as_slice(),
            })
            .collect();
        reduce_parts(buf, &parts, dtype, op);
        Ok(())
    }

    /// Every active rank's `input` into block r of `root`'s `output` (blocks of
    /// `sizes[r]` bytes); `output` is only used on the root.
    pub fn gather(
        &self,
        input: &[u8],
        output: &mut [u8],
        sizes: &[usize],
        root: usize,
    ) -> Result<()> {
        self.check_rooted(
            "gather",
            sizes,
            ("input", input.len()),
            ("output", output.len()),
            root,
        )?;
        let mut st = self.begin_collective()?;
        self.check_root(&st, root)?;
        if root != self.rank() {
            let mut out = [Outgoing::new(root, input)];
            return self.exchange(&mut st, KIND_GATHER, &mut out, &mut []);
        }
        let others = self.others(&st);
        let mut blocks = split_mut(output, sizes);
        blocks[root].copy_from_slice(input);
        let mut inc: Vec<Incoming> = blocks
            .into_iter()
            .enumerate()
            .filter(|(r, _)| others.contains(r))
            .map(|(r, b)| Incoming::new(r, Sink::Copy(b)))
            .collect();
        self.exchange(&mut st, KIND_GATHER, &mut [], &mut inc)
    }

    /// Block r of `root`'s `input` (blocks of `sizes[r]` bytes) into rank r's `output`.
    pub fn scatter(
        &self,
        input: &[u8],
        output: &mut [u8],
        sizes: &[usize],
        root: usize,
    ) -> Result<()> {
        self.check_rooted(
            "scatter",
            sizes,
            ("output", output.len()),
            ("input", input.len()),
            root,
        )?;
        let mut st = self.begin_collective()?;
        self.check_root(&st, root)?;
        if root != self.rank() {
            let mut inc = [Incoming::new(root, Sink::Copy(output))];
            return self.exchange(&mut st, KIND_SCATTER, &mut [], &mut inc);
        }
        let offs = offsets(sizes);
        output.copy_from_slice(&input[offs[root]..offs[root] + sizes[root]]);
        let mut out: Vec<Outgoing> = self
            .others(&st)
            .into_iter()
            .map(|p| Outgoing::new(p, &input[offs[p]..offs[p] + sizes[p]]))
            .collect();
        self.exchange(&mut st, KIND_SCATTER, &mut out, &mut [])
    }

    /// Point-to-point: sends and receives done together (at most one of each per peer),
    /// so paired sends cannot wait on each other. Messages between two ranks arrive in
    /// the order they were sent; a receive's buffer must be the size sent. A send is
    /// through once its receiver has taken it (so a send to a rank that is gone fails,
    /// and a send waits for the matching receive). A peer that fails fails only the
    /// messages with it: the others complete, and the error (a timeout) names, in
    /// [`failed_ranks`](Self::failed_ranks), exactly the peers of the messages not
    /// through (all of them when the call failed before sending anything).
    pub fn send_recv(
        &self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
    ) -> Result<()> {
        let mut st = self.lock();
        if let Err(e) = self.begin_op(&mut st) {
            let mut peers: Vec<usize> = sends.iter().map(|m| m.0).collect();
            peers.extend(recvs.iter().map(|m| m.0));
            peers.sort_unstable();
            peers.dedup();
            st.last_failed = peers;
            return Err(e);
        }
        let mut seen_send = super::Mask::default();
        let mut seen_recv = super::Mask::default();
        for &(p, _) in sends {
            if p == self.rank() || !st.mask.has(p) || seen_send.has(p) {
                return Err(Error::invalid(format!(
                    "send to rank {p}: not an active peer, or twice"
                )));
            }
            seen_send.set(p);
        }
        for (p, _) in recvs.iter() {
            if *p == self.rank() || !st.mask.has(*p) || seen_recv.has(*p) {
                return Err(Error::invalid(format!(
                    "receive from rank {p}: not an active peer, or twice"
                )));
            }
            seen_recv.set(*p);
        }
        let mut out: Vec<Outgoing> = sends.iter().map(|&(p, d)| Outgoing::new(p, d)).collect();
        let mut inc: Vec<Incoming> = recvs
            .iter_mut()
            .map(|(p, b)| Incoming::new(*p, Sink::Copy(b)))
            .collect();
        self.exchange(&mut st, KIND_P2P, &mut out, &mut inc)
    }
}
