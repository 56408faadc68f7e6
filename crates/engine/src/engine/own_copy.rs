//! Synchronous transfers whose every request stays inside this engine's own host
//! memory (a store client reading what its own segment holds): copied on the calling
//! thread as the local transport copies, with no slices planned, posted or polled.
//! For a batch of small values the poll loop's bookkeeping cost several times the
//! copies (a 64-key read of 4 KiB values: ~17 µs of ~21 µs of copying).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::batch::{Batch, TaskState};
use super::worker::landed_crc;
use super::{Engine, Request, INLINE_MAX_BYTES};
use crate::error::Result;
use crate::registry::RangeGuard;
use crate::transport::local::copy_own_host;
use crate::transport::{Kind, Op, Peer};
use crate::util::SmallList;

impl Engine {
    /// Copies `requests` on the calling thread when each is a copy between the
    /// caller's host memory and this engine's own registered host memory, each buffer
    /// pinned for the copy as the local transport pins it; `landed(i, crc)` is told
    /// each request's CRC32C in order when `checksum` (None otherwise). False, with
    /// nothing pinned or moved, when any request is not such a copy or would be
    /// refused: the poll loop then takes them all (and says why it refuses one). Large
    /// transfers also go there when several workers can share their slices.
    ///
    /// # Safety
    /// As `run_sync`: each local range must be valid (written by a read) until the
    /// call returns.
    pub(super) unsafe fn copy_own(
        &self,
        requests: &[Request],
        checksum: bool,
        mut landed: impl FnMut(usize, Option<u32>),
    ) -> bool {
        if requests.is_empty() {
            return true; // nothing to copy, nothing counted
        }
        if self.memory.has_device() || (checksum && requests.iter().any(|r| r.op != Op::Read)) {
            return false;
        }
        let bytes = requests.iter().fold(0u64, |n, r| n.saturating_add(r.len));
        if bytes > INLINE_MAX_BYTES && self.workers.len() > 1 {
            return false;
        }
        let mut own: Option<Arc<Peer>> = None;
        // One pin per registered buffer: a batch's ranges mostly share one.
        let mut pins: SmallList<RangeGuard> = SmallList::new();
        for r in requests {
            if r.local == 0 || r.local.checked_add(r.len).is_none() {
                return false;
            }
            if own.as_ref().is_none_or(|p| p.id != r.segment) {
                let Ok(peer) = self.segments.get(r.segment) else {
                    return false;
                };
                if peer.name != self.name || peer.is_disabled(Kind::Local) {
                    return false;
                }
                own = Some(peer);
            }
            if r.len == 0 {
                return false; // as `guard` refuses it
            }
            // The last pin first: a batch's ranges mostly follow one another.
            let held = |p: &RangeGuard| p.buffer_holds(r.remote, r.len);
            if pins.last().is_some_and(held) || pins.iter().any(held) {
                continue;
            }
            // Refuses ranges outside one registered buffer.
            match self.memory.guard(r.remote, r.len) {
                Ok(pin) if pin.device().is_host() => pins.push(pin),
                _ => return false,
            }
        }
        for (i, r) in requests.iter().enumerate() {
            // SAFETY: the local range is the caller's promise; a pin holds the other.
            let folded = unsafe { copy_own_host(r.remote, r.len, r.op, r.local, checksum) };
            // A read whose ends overlap was copied without folding: checksum what landed.
            // SAFETY: the caller's buffer, just written, valid for `len` bytes.
            let crc =
                checksum.then(|| folded.unwrap_or_else(|| unsafe { landed_crc(r.local, r.len) }));
            landed(i, crc);
        }
        drop(pins);
        self.counters.bytes[Kind::Local as usize].fetch_add(bytes, Ordering::Relaxed);
        self.counters.inline_runs.fetch_add(1, Ordering::Relaxed);
        self.counters.own_copies.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// Records in `batch` (a batch of their own) that `requests` were copied whole.
pub(super) fn mark_copied(batch: &Batch, requests: &[Request]) -> Result<()> {
    let bytes = requests.iter().fold(0u64, |n, r| n.saturating_add(r.len));
    let first = batch.reserve(&vec![1; requests.len()], bytes)?;
    for (i, r) in requests.iter().enumerate() {
        batch.slice_finished(first + i, r.len, TaskState::Completed);
    }
    Ok(())
}
