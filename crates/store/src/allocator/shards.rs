//! Per-thread sharding of hot words, so threads allocating the same size class
//! do not all CAS one cache line.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Keeps `T` on its own cache lines (128 bytes: adjacent-line prefetch pairs lines).
#[repr(align(128))]
#[derive(Default)]
pub(crate) struct Padded<T>(pub(crate) T);

/// Shards per allocator: the CPU count rounded up to a power of two, capped.
pub(crate) fn shard_count() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .next_power_of_two()
        .min(8)
}

static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SLOT: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// A small number fixed per thread, handed out round-robin so the first threads
/// land on distinct shards.
#[inline]
pub(crate) fn thread_slot() -> usize {
    SLOT.with(|slot| {
        let v = slot.get();
        if v != usize::MAX {
            return v;
        }
        let v = NEXT_SLOT.fetch_add(1, Ordering::Relaxed) & (usize::MAX >> 1);
        slot.set(v);
        v
    })
}

/// Threads whose slot is below this own a pair of byte counters and update it
/// with a plain load and store (a locked RMW costs as much as the free-list CAS
/// itself); later threads share one pair updated with `fetch_add`.
const OWNED_SLOTS: usize = 64;

#[derive(Default)]
struct Pair {
    used: AtomicU64,
    requested: AtomicU64,
}

/// Bytes used and requested, as wrapping deltas per writer (a block may be
/// freed by another thread than allocated it); only the sum means anything.
pub(crate) struct Counters {
    owned: Box<[Padded<Pair>]>,
    shared: Padded<Pair>,
}

impl Counters {
    pub(crate) fn new() -> Counters {
        Counters {
            owned: (0..OWNED_SLOTS).map(|_| Padded::default()).collect(),
            shared: Padded::default(),
        }
    }

    /// Adds (wrapping) deltas on behalf of the thread with `slot`.
    #[inline]
    pub(crate) fn add(&self, slot: usize, used: u64, requested: u64) {
        match self.owned.get(slot) {
            // Only the thread with this slot writes here: no RMW needed.
            Some(own) => {
                let p = &own.0;
                p.used.store(
                    p.used.load(Ordering::Relaxed).wrapping_add(used),
                    Ordering::Relaxed,
                );
                p.requested.store(
                    p.requested.load(Ordering::Relaxed).wrapping_add(requested),
                    Ordering::Relaxed,
                );
            }
            None => {
                self.shared.0.used.fetch_add(used, Ordering::Relaxed);
                self.shared
                    .0
                    .requested
                    .fetch_add(requested, Ordering::Relaxed);
            }
        }
    }

    #[inline]
    pub(crate) fn sub(&self, slot: usize, used: u64, requested: u64) {
        self.add(slot, used.wrapping_neg(), requested.wrapping_neg());
    }

    pub(crate) fn used(&self) -> u64 {
        self.total(|p| &p.used)
    }

    pub(crate) fn requested(&self) -> u64 {
        self.total(|p| &p.requested)
    }

    /// Sums one counter; a momentarily negative total (a free counted before its
    /// alloc was read) reads as 0.
    fn total(&self, field: impl Fn(&Pair) -> &AtomicU64) -> u64 {
        let sum = self
            .owned
            .iter()
            .chain(std::iter::once(&self.shared))
            .fold(0u64, |acc, p| {
                acc.wrapping_add(field(&p.0).load(Ordering::Relaxed))
            });
        if (sum as i64) < 0 {
            0
        } else {
            sum
        }
    }
}
