//! Slab recycling: a slab none of whose blocks is allocated goes back to the
//! free-slab stack, so a class that ran out of slabs can take it.
//!
//! Blocks of a free slab sit on its class's free lists mixed with other slabs'
//! blocks, and a Treiber stack cannot unlink from the middle. So a reclaim pass
//! takes each class's whole lists (one CAS each, which makes the chains private),
//! counts free blocks per slab, releases slabs whose every block is there, and
//! pushes the rest back as one chain. While a class's blocks are held by the pass
//! an `alloc` of that class may find nothing and return `None` (the caller treats
//! it as full and retries); nothing is lost or duplicated. Passes run only when a
//! class is out of slabs (or when asked) and one at a time (a try-flag; a second
//! caller skips rather than waits).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use super::freelist::{link_to, ALLOCATED, NIL};
use super::SlabAllocator;

pub(super) struct ReclaimState {
    busy: AtomicBool,
    /// Bytes of all blocks of bound slabs (allocated or free).
    bound_block_bytes: AtomicU64,
    /// Free block bytes seen by the last pass that found nothing.
    last_fruitless: AtomicU64,
    /// Triggers to ignore before the next pass, and the current backoff: each
    /// pass that finds nothing doubles it, so a full allocator whose callers keep
    /// failing scans its lists on a vanishing share of the failures.
    skip: AtomicU32,
    backoff: AtomicU32,
    /// The fewest block bytes a bound slab can hold: less free than this, and no
    /// slab can be entirely free.
    min_payload: u64,
}

impl ReclaimState {
    pub(super) fn new(min_payload: u64) -> ReclaimState {
        ReclaimState {
            busy: AtomicBool::new(false),
            bound_block_bytes: AtomicU64::new(0),
            last_fruitless: AtomicU64::new(u64::MAX),
            skip: AtomicU32::new(0),
            backoff: AtomicU32::new(0),
            min_payload,
        }
    }

    pub(super) fn bound(&self, bytes: u64) {
        self.bound_block_bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// Most triggers skipped after a run of fruitless passes.
const MAX_BACKOFF: u32 = 255;

/// Clears the busy flag when a pass ends, even by panic.
struct Busy<'a>(&'a AtomicBool);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl SlabAllocator {
    /// Runs a pass if it might find something: enough free block bytes exist for
    /// a whole slab, they changed since the last pass that found nothing, and the
    /// backoff after fruitless passes has run out, or at least a whole slab's worth
    /// more came free since that pass (a burst of frees, as eviction makes for a
    /// large object, is worth a look however many passes failed before it). A slab
    /// freed otherwise waits for a later trigger (or an explicit
    /// [`reclaim_free_slabs`](Self::reclaim_free_slabs)).
    pub(super) fn reclaim_if_worthwhile(&self) -> bool {
        let r = &self.reclaim;
        let free = r
            .bound_block_bytes
            .load(Ordering::Relaxed)
            .saturating_sub(self.used_bytes());
        let last_fruitless = r.last_fruitless.load(Ordering::Relaxed);
        if free < r.min_payload || free == last_fruitless {
            return false;
        }
        let freed_a_slab_since = free >= last_fruitless.saturating_add(r.min_payload);
        let skip = r.skip.load(Ordering::Relaxed);
        if skip > 0 && !freed_a_slab_since {
            r.skip.store(skip - 1, Ordering::Relaxed); // racy: a hint, not a count
            return false;
        }
        let recycled = self.reclaim_free_slabs();
        if recycled == 0 {
            r.last_fruitless.store(free, Ordering::Relaxed);
            let backoff = (r.backoff.load(Ordering::Relaxed) * 2 + 1).min(MAX_BACKOFF);
            r.backoff.store(backoff, Ordering::Relaxed);
            r.skip.store(backoff, Ordering::Relaxed);
        }
        recycled > 0
    }

    /// Returns every slab with no allocated block to the free-slab stack, so any
    /// class can carve it; returns how many. `alloc` calls this itself when a
    /// class is out of slabs; call it directly after freeing a lot (e.g. after
    /// eviction) to rebalance at a time of your choosing. Returns 0 without
    /// waiting if another pass is running.
    pub fn reclaim_free_slabs(&self) -> usize {
        let r = &self.reclaim;
        if r.busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return 0;
        }
        let _busy = Busy(&r.busy);
        let shift = self.slabs.shift();
        let mut recycled = 0;
        let mut ids: Vec<u32> = Vec::new();
        let mut kept: Vec<u32> = Vec::new();
        for class in 0..self.classes.len() {
            ids.clear();
            for shard in 0..=self.shard_mask {
                let mut at = self.head(class, shard).take_all();
                while at != NIL {
                    debug_assert_ne!(at, ALLOCATED, "an allocated block was on a free list");
                    ids.push(at - 1);
                    at = self.slabs.link(at - 1).load(Ordering::Relaxed);
                }
            }
            if ids.is_empty() {
                continue;
            }
            ids.sort_unstable();
            debug_assert!(
                ids.windows(2).all(|w| w[0] != w[1]),
                "a block was on class {class}'s free lists twice (freed twice)"
            );
            kept.clear();
            let size = self.classes.size(class);
            for group in ids.chunk_by(|a, b| a >> shift == b >> shift) {
                let slab = (group[0] >> shift) as usize;
                let shape = self.slabs.meta(slab).and_then(|m| m.shape());
                debug_assert_eq!(shape.map(|s| s.class), Some(class));
                debug_assert!(
                    shape.is_some_and(|s| group.len() as u64 <= u64::from(s.blocks)),
                    "more free blocks than slab {slab} has"
                );
                match shape {
                    Some(s) if s.class == class && group.len() as u64 == u64::from(s.blocks) => {
                        let bytes = u64::from(s.blocks) * size;
                        let was = r.bound_block_bytes.fetch_sub(bytes, Ordering::Relaxed);
                        debug_assert!(was >= bytes, "bound block bytes went negative");
                        self.slabs.release(slab);
                        recycled += 1;
                    }
                    _ => kept.extend_from_slice(group),
                }
            }
            if let (Some(&first), Some(&last)) = (kept.first(), kept.last()) {
                for pair in kept.windows(2) {
                    self.slabs
                        .link(pair[0])
                        .store(link_to(pair[1]), Ordering::Relaxed);
                }
                self.head(class, 0).push_chain(first, self.slabs.link(last));
            }
        }
        if recycled > 0 {
            r.last_fruitless.store(u64::MAX, Ordering::Relaxed);
            r.backoff.store(0, Ordering::Relaxed);
            r.skip.store(0, Ordering::Relaxed);
        }
        recycled
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Allocation, AllocatorConfig, SlabAllocator};
    use std::sync::atomic::Ordering;

    const SLAB: u64 = 64 * 1024;

    /// Eight slabs of 1 KiB blocks, every block allocated, by slab.
    fn full_of_small_blocks() -> (SlabAllocator, Vec<Vec<Allocation>>) {
        let slab_cfg = AllocatorConfig {
            slab_size: SLAB,
            ..AllocatorConfig::default()
        };
        let a = SlabAllocator::new(8 * SLAB, slab_cfg);
        let mut by_slab: Vec<Vec<Allocation>> = vec![Vec::new(); 8];
        while let Some(x) = a.alloc(1024) {
            by_slab[(x.offset / SLAB) as usize].push(x);
        }
        assert!(by_slab.iter().all(|s| s.len() == 64));
        (a, by_slab)
    }

    #[test]
    fn a_burst_of_frees_is_looked_at_despite_the_backoff() {
        let (a, mut by_slab) = full_of_small_blocks();
        // Half of every slab free: plenty of bytes, no whole slab.
        for s in by_slab.iter_mut() {
            for x in s.drain(..32) {
                a.free(x);
            }
        }
        assert!(a.alloc(SLAB).is_none(), "a fruitless pass");
        // A few more scattered frees and failures build up the backoff.
        for s in by_slab.iter_mut().take(2) {
            a.free(s.pop().unwrap());
            assert!(a.alloc(SLAB).is_none());
        }
        assert!(a.reclaim.skip.load(Ordering::Relaxed) > 0, "backing off");
        // Now whole slabs come free (as when the master evicts for a large object).
        for s in by_slab.iter_mut().skip(4) {
            for x in s.drain(..) {
                a.free(x);
            }
        }
        let big = a
            .alloc(SLAB)
            .expect("the freed slabs serve the large class at once");
        assert_eq!(big.block_size(), SLAB);
        assert!(big.offset >= 4 * SLAB, "one of the slabs just freed");
    }

    #[test]
    fn without_new_frees_the_backoff_holds() {
        let (a, mut by_slab) = full_of_small_blocks();
        for s in by_slab.iter_mut() {
            for x in s.drain(..32) {
                a.free(x);
            }
        }
        assert!(a.alloc(SLAB).is_none());
        let passes_before = a.reclaim.backoff.load(Ordering::Relaxed);
        // Failing again and again with nothing freed runs no further pass.
        for _ in 0..100 {
            assert!(a.alloc(SLAB).is_none());
        }
        assert_eq!(a.reclaim.backoff.load(Ordering::Relaxed), passes_before);
    }
}
