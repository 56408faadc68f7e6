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
use crate::transport::local::copy_own_host;
use crate::transport::{Kind, Op, Peer};

impl Engine {
    /// Moves `requests` into `batch` (a batch of their own) when each is a copy
    /// between the caller's host memory and this engine's own registered host memory,
    /// the range pinned for the copy as the local transport pins it. `None`, with
    /// nothing reserved or moved, when any request is not such a copy or would be
    /// refused: the poll loop then takes them all (and says why it refuses one). Large
    /// transfers also go there when several workers can share their slices.
    ///
    /// # Safety
    /// As `run_sync`: each local range must be valid (written by a read) until the
    /// call returns.
    pub(super) unsafe fn copy_own(
        &self,
        batch: &Batch,
        requests: &[Request],
    ) -> Option<Result<()>> {
        let checksum = batch.wants_checksums();
        if self.memory.has_device() || (checksum && requests.iter().any(|r| r.op != Op::Read)) {
            return None;
        }
        let bytes = requests.iter().fold(0u64, |n, r| n.saturating_add(r.len));
        if bytes > INLINE_MAX_BYTES && self.workers.len() > 1 {
            return None;
        }
        let mut own: Option<Arc<Peer>> = None;
        let mut pinned = Vec::with_capacity(requests.len());
        for r in requests {
            if r.local == 0 || r.local.checked_add(r.len).is_none() {
                return None;
            }
            if own.as_ref().is_none_or(|p| p.id != r.segment) {
                let peer = self.segments.get(r.segment).ok()?;
                if peer.name != self.name || peer.is_disabled(Kind::Local) {
                    return None;
                }
                own = Some(peer);
            }
            // Refuses zero lengths and ranges outside one registered buffer.
            let target = self.memory.guard(r.remote, r.len).ok()?;
            if !target.device().is_host() {
                return None;
            }
            pinned.push(target);
        }
        let first = match batch.reserve(&vec![1; requests.len()], bytes) {
            Ok(first) => first,
            Err(e) => return Some(Err(e)),
        };
        for (i, (r, target)) in requests.iter().zip(&pinned).enumerate() {
            // SAFETY: the local range is the caller's promise; `target` pins the other.
            let folded = unsafe { copy_own_host(target, r.op, r.local, checksum) };
            if checksum {
                // A read whose ends overlap was copied without folding: checksum what
                // landed.
                // SAFETY: the caller's buffer, just written, valid for `len` bytes.
                let crc = folded.unwrap_or_else(|| unsafe { landed_crc(r.local, r.len) });
                batch.slice_checksum(first + i, r.remote, r.len, crc);
            }
            self.counters.bytes[Kind::Local as usize].fetch_add(r.len, Ordering::Relaxed);
            batch.slice_finished(first + i, r.len, TaskState::Completed);
        }
        self.counters.inline_runs.fetch_add(1, Ordering::Relaxed);
        self.counters.own_copies.fetch_add(1, Ordering::Relaxed);
        Some(Ok(()))
    }
}
