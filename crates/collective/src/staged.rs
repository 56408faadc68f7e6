//! Collectives whose user buffers are device memory (CUDA, HIP, Ascend), staged through
//! the device layer ([`crate::device`]): each buffer is copied into host memory once,
//! the host collective runs on the copies, and each output is copied back once, only
//! if the operation succeeded (a failed one leaves device memory as it was, except that
//! a driver error while copying the outputs back can leave the outputs copied before it
//! written; the call still fails; and a point-to-point exchange that failed for some
//! peers copies back the receives from the others, which were delivered). Inputs are
//! never written. The CPU never touches device memory: every access is a driver copy.
//! The caller's current device (CUDA context, HIP or Ascend device) is the same after
//! the call as before it.
//!
//! An output is copied in as well when the operation may leave part of it unwritten
//! (blocks of inactive ranks, a reduce's accumulator), so the copy back restores those
//! bytes unchanged; outputs the operation always fills are only copied out.
//!
//! Host buffers never come here: the slice-based methods are the host path.

use crate::util::sync::Unpoisoned;
use std::time::Duration;

use super::{DType, Group, ReduceOp};
use crate::device::{self, MemoryKind, Staging};
use crate::error::{Code, Error, Result};

/// Staging buffers a group keeps for reuse (pinning costs more than copying), within
/// `GroupOptions::staging_keep_bytes` in all.
const STAGING_KEEP: usize = 4;

/// One device range of an operation: read into host memory first (`fill`), written
/// back after success (`back`).
#[derive(Clone, Copy)]
struct Range {
    addr: u64,
    len: usize,
    fill: bool,
    back: bool,
}

/// A range the operation only reads.
fn input(addr: u64, len: usize) -> Range {
    Range {
        addr,
        len,
        fill: true,
        back: false,
    }
}

/// A range the operation writes entirely (on success).
fn output(addr: u64, len: usize) -> Range {
    Range {
        addr,
        len,
        fill: false,
        back: true,
    }
}

/// A range the operation reads, or may leave partly unwritten, and writes.
fn in_out(addr: u64, len: usize) -> Range {
    Range {
        addr,
        len,
        fill: true,
        back: true,
    }
}

/// A range and its host copy.
struct Staged {
    range: Range,
    host: Staging,
}

impl Group {
    /// A staging buffer of at least `len` bytes for `kind`: the smallest kept one that
    /// fits, or a new one.
    fn take_staging(&self, kind: MemoryKind, len: usize) -> Staging {
        let mut kept = self.staging.locked();
        let best = kept
            .iter()
            .enumerate()
            .filter(|(_, s)| s.kind() == kind && s.len() >= len)
            .min_by_key(|(_, s)| s.len())
            .map(|(i, _)| i);
        match best {
            Some(i) => kept.swap_remove(i),
            None => {
                drop(kept);
                Staging::new(kind, len)
            }
        }
    }

    /// Keeps staging buffers for reuse, largest first, at most `STAGING_KEEP` of them
    /// and `staging_keep_bytes` in all: one huge operation must not pin its buffers
    /// for the group's life. The rest are freed (outside the lock).
    fn give_staging(&self, staged: Vec<Staged>) {
        let mut kept = self.staging.locked();
        let mut all = std::mem::take(&mut *kept);
        all.extend(staged.into_iter().map(|s| s.host));
        all.sort_by_key(|s| std::cmp::Reverse(s.len()));
        let mut surplus = Vec::new();
        let mut bytes = 0usize;
        for buffer in all {
            if kept.len() < STAGING_KEEP
                && bytes.saturating_add(buffer.len()) <= self.options.staging_keep_bytes
            {
                bytes += buffer.len();
                kept.push(buffer);
            } else {
                surplus.push(buffer);
            }
        }
        drop(kept);
        drop(surplus);
    }

    /// Bytes of staging memory this group keeps between device operations (at most
    /// the `staging_keep_bytes` option).
    pub fn kept_staging_bytes(&self) -> usize {
        let kept = self.staging.locked();
        kept.iter().map(|s| s.len()).sum()
    }

    /// Stages `ranges` of device memory of `kind` (checked with the driver, then copied
    /// in where `fill`), runs `op` over the host copies in the same order, and on
    /// success copies back the ranges marked `back`, one driver copy per buffer (a
    /// failing copy stops there: outputs already copied stay written). The staging
    /// buffers go back to the group's keep, and the thread's current device to what it
    /// was, whatever happens.
    ///
    /// # Safety
    /// Each range with `len > 0` must be device memory of `kind`; ranges marked `back`
    /// must not be accessed elsewhere during the call.
    unsafe fn run_staged(
        &self,
        kind: MemoryKind,
        ranges: &[Range],
        op: impl FnOnce(&mut [&mut [u8]]) -> Result<()>,
    ) -> Result<()> {
        // SAFETY: the caller's guarantee.
        unsafe { self.run_staged_keeping(kind, ranges, op, |_| Vec::new()) }
    }

    /// [`run_staged`](Self::run_staged) for an operation whose failure may still have
    /// written some outputs in full: `written(error)` names them (indices into
    /// `ranges`), and those marked `back` are copied back before the error is returned.
    ///
    /// # Safety
    /// As [`run_staged`](Self::run_staged).
    unsafe fn run_staged_keeping(
        &self,
        kind: MemoryKind,
        ranges: &[Range],
        op: impl FnOnce(&mut [&mut [u8]]) -> Result<()>,
        written: impl FnOnce(&Error) -> Vec<usize>,
    ) -> Result<()> {
        if kind.is_host() {
            return Err(Error::invalid(
                "device collective given host memory: use the slice-based method",
            ));
        }
        let _caller_device = device::CurrentKept::save(kind);
        let mut staged = Vec::with_capacity(ranges.len());
        let mut result = Ok(());
        for &range in ranges {
            if range.len > 0 {
                if range.addr == 0 {
                    result = Err(Error::invalid("device buffer address is NULL"));
                    break;
                }
                // A wrong location or a host pointer is refused here, before any copy.
                if let Err(e) = device::classify(range.addr, range.len as u64, &kind.location()) {
                    result = Err(e);
                    break;
                }
            }
            let mut host = self.take_staging(kind, range.len);
            if range.fill {
                // SAFETY: `range` is device memory of `kind` (caller's guarantee, and
                // classified above).
                result = unsafe { host.fill_from(range.addr, range.len) };
            }
            staged.push(Staged { range, host });
            if result.is_err() {
                break;
            }
        }
        if result.is_ok() {
            let mut bufs: Vec<&mut [u8]> = staged
                .iter_mut()
                .map(|s| s.host.bytes_mut(s.range.len))
                .collect();
            result = op(&mut bufs);
        }
        let back = match &result {
            Ok(()) => (0..staged.len()).collect(),
            Err(e) => written(e),
        };
        let copied = staged
            .iter()
            .enumerate()
            .filter(|(i, s)| s.range.back && back.contains(i))
            .try_for_each(|(_, s)| {
                // SAFETY: `s.range` is device memory of `kind`, the staging buffer's
                // kind (caller's guarantee, classified above).
                unsafe { s.host.drain_to(s.range.addr, s.range.len) }
            });
        self.give_staging(staged);
        result.and(copied)
    }

    /// [`all_reduce`](Self::all_reduce) of `len` bytes of device memory at `buf`.
    ///
    /// # Safety
    /// `[buf, buf+len)` must be device memory of `kind`, not accessed elsewhere during
    /// the call.
    pub unsafe fn all_reduce_device(
        &self,
        kind: MemoryKind,
        buf: u64,
        len: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        // SAFETY: the caller's guarantee.
        unsafe {
            // The staging buffer is copied back only on success: nothing to restore.
            self.run_staged(kind, &[in_out(buf, len)], |b| {
                self.all_reduce_keeping(b[0], dtype, op, false)
            })
        }
    }

    /// [`broadcast`](Self::broadcast) of `len` bytes of device memory at `buf`: read
    /// on `root`, written elsewhere.
    ///
    /// # Safety
    /// As [`all_reduce_device`](Self::all_reduce_device).
    pub unsafe fn broadcast_device(
        &self,
        kind: MemoryKind,
        buf: u64,
        len: usize,
        root: usize,
    ) -> Result<()> {
        let range = if root == self.rank() {
            input(buf, len)
        } else {
            output(buf, len)
        };
        // SAFETY: the caller's guarantee.
        unsafe { self.run_staged(kind, &[range], |b| self.broadcast(b[0], root)) }
    }

    /// [`reduce`](Self::reduce) of device memory: `buf` is written on `root` only.
    ///
    /// # Safety
    /// As [`all_reduce_device`](Self::all_reduce_device).
    pub unsafe fn reduce_device(
        &self,
        kind: MemoryKind,
        buf: u64,
        len: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let range = if root == self.rank() {
            in_out(buf, len)
        } else {
            input(buf, len)
        };
        // SAFETY: the caller's guarantee.
        unsafe { self.run_staged(kind, &[range], |b| self.reduce(b[0], dtype, op, root)) }
    }

    /// [`all_gather`](Self::all_gather) with device memory `input` (`sizes[rank]` bytes)
    /// and `output` (their sum).
    ///
    /// # Safety
    /// Both ranges device memory of `kind`; `output` not accessed elsewhere during the
    /// call (it may overlap `input`: the input is copied in first).
    pub unsafe fn all_gather_device(
        &self,
        kind: MemoryKind,
        inp: u64,
        out: u64,
        sizes: &[usize],
    ) -> Result<()> {
        let total = self.check_sizes(sizes, "all_gather")?;
        let ranges = [input(inp, sizes[self.rank()]), in_out(out, total)];
        // SAFETY: the caller's guarantee.
        unsafe {
            self.run_staged(kind, &ranges, |b| {
                let (i, o) = pair(b);
                self.all_gather(i, o, sizes)
            })
        }
    }

    /// [`reduce_scatter`](Self::reduce_scatter) with device memory `input` (the sum of
    /// `counts` elements) and `output` (`counts[rank]` elements).
    ///
    /// # Safety
    /// As [`all_gather_device`](Self::all_gather_device).
    pub unsafe fn reduce_scatter_device(
        &self,
        kind: MemoryKind,
        inp: u64,
        out: u64,
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let sizes = counts
            .iter()
            .map(|&c| c.checked_mul(dtype.size()))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::invalid("reduce_scatter: counts overflow"))?;
        let total = self.check_sizes(&sizes, "reduce_scatter")?;
        let ranges = [input(inp, total), output(out, sizes[self.rank()])];
        // SAFETY: the caller's guarantee.
        unsafe {
            self.run_staged(kind, &ranges, |b| {
                let (i, o) = pair(b);
                self.reduce_scatter(i, o, counts, dtype, op)
            })
        }
    }

    /// [`all_to_all_within`](Self::all_to_all_within) with device memory `input` (the
    /// sum of `send`) and `output` (the sum of `recv`).
    ///
    /// # Safety
    /// As [`all_gather_device`](Self::all_gather_device).
    pub unsafe fn all_to_all_device(
        &self,
        kind: MemoryKind,
        (inp, send): (u64, &[usize]),
        (out, recv): (u64, &[usize]),
        timeout: Option<Duration>,
    ) -> Result<()> {
        let in_total = self.check_sizes(send, "all_to_all send")?;
        let out_total = self.check_sizes(recv, "all_to_all recv")?;
        let ranges = [input(inp, in_total), in_out(out, out_total)];
        // SAFETY: the caller's guarantee.
        unsafe {
            self.run_staged(kind, &ranges, |b| {
                let (i, o) = pair(b);
                self.all_to_all_within(i, send, o, recv, timeout)
            })
        }
    }

    /// [`gather`](Self::gather) with device memory: `output` (the sum of `sizes`) is
    /// only used on `root`.
    ///
    /// # Safety
    /// As [`all_gather_device`](Self::all_gather_device), for `output` on the root.
    pub unsafe fn gather_device(
        &self,
        kind: MemoryKind,
        inp: u64,
        out: u64,
        sizes: &[usize],
        root: usize,
    ) -> Result<()> {
        let total = self.check_sizes(sizes, "gather")?;
        let out_len = if root == self.rank() { total } else { 0 };
        let ranges = [input(inp, sizes[self.rank()]), in_out(out, out_len)];
        // SAFETY: the caller's guarantee.
        unsafe {
            self.run_staged(kind, &ranges, |b| {
                let (i, o) = pair(b);
                self.gather(i, o, sizes, root)
            })
        }
    }

    /// [`scatter`](Self::scatter) with device memory: `input` (the sum of `sizes`) is
    /// only read on `root`.
    ///
    /// # Safety
    /// As [`all_gather_device`](Self::all_gather_device), for `input` on the root.
    pub unsafe fn scatter_device(
        &self,
        kind: MemoryKind,
        inp: u64,
        out: u64,
        sizes: &[usize],
        root: usize,
    ) -> Result<()> {
        let total = self.check_sizes(sizes, "scatter")?;
        let in_len = if root == self.rank() { total } else { 0 };
        let ranges = [input(inp, in_len), output(out, sizes[self.rank()])];
        // SAFETY: the caller's guarantee.
        unsafe {
            self.run_staged(kind, &ranges, |b| {
                let (i, o) = pair(b);
                self.scatter(i, o, sizes, root)
            })
        }
    }

    /// [`send_recv`](Self::send_recv) with device memory: `(peer, addr, len)` for each
    /// send and receive. As on the host, a failed peer fails only its own messages:
    /// the receives from the others are copied back all the same.
    ///
    /// # Safety
    /// Every range device memory of `kind`; receive ranges distinct from each other and
    /// not accessed elsewhere during the call.
    pub unsafe fn send_recv_device(
        &self,
        kind: MemoryKind,
        sends: &[(usize, u64, usize)],
        recvs: &[(usize, u64, usize)],
    ) -> Result<()> {
        let ranges: Vec<Range> = sends
            .iter()
            .map(|&(_, a, n)| input(a, n))
            .chain(recvs.iter().map(|&(_, a, n)| output(a, n)))
            .collect();
        // The receives a failed exchange still completed: after a timeout, those from
        // the peers it does not name (see `send_recv`); an error of another kind
        // stopped the exchange, and nothing is copied back.
        let delivered = |e: &Error| -> Vec<usize> {
            if e.code() != Code::Timeout {
                return Vec::new();
            }
            let failed = self.failed_ranks();
            (sends.len()..ranges.len())
                .filter(|&i| !failed.contains(&recvs[i - sends.len()].0))
                .collect()
        };
        // SAFETY: the caller's guarantee.
        unsafe {
            self.run_staged_keeping(
                kind,
                &ranges,
                |b| {
                    let (s, r) = b.split_at_mut(sends.len());
                    let s: Vec<(usize, &[u8])> = sends
                        .iter()
                        .zip(s.iter())
                        .map(|(m, b)| (m.0, &**b))
                        .collect();
                    let mut r: Vec<(usize, &mut [u8])> = recvs
                        .iter()
                        .zip(r.iter_mut())
                        .map(|(m, b)| (m.0, &mut **b))
                        .collect();
                    self.send_recv(&s, &mut r)
                },
                delivered,
            )
        }
    }
}

/// The first staged buffer as the input, the second as the output.
fn pair<'a>(bufs: &'a mut [&mut [u8]]) -> (&'a [u8], &'a mut [u8]) {
    let (first, rest) = bufs.split_at_mut(1);
    (&*first[0], &mut *rest[0])
}
