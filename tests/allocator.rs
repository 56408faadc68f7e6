//! The store's slab allocator: no overlap, exact accounting, exhaustion and
//! recovery, refused bad frees, and the same under concurrent use.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use mooncake::store::allocator::{Allocation, AllocatorConfig, FreeError, SlabAllocator};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// xorshift64: deterministic, no dependencies.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// 1..=max, log-uniform so every size class gets traffic.
    fn size(&mut self, max: u64) -> u64 {
        let bits = self.below(u64::from(64 - max.leading_zeros()) + 1);
        (1 + self.below(1u64 << bits)).min(max)
    }
}

fn allocator(slabs: u64, slab_size: u64) -> SlabAllocator {
    // A tail shorter than a slab is never used.
    let capacity = slabs * slab_size + slab_size / 2;
    SlabAllocator::new(
        capacity,
        AllocatorConfig {
            slab_size,
            ..AllocatorConfig::default()
        },
    )
}

/// Every live block lies inside the used slabs, within one slab, and apart from
/// every other; the byte counters match.
fn check_consistent(a: &SlabAllocator, live: &[Allocation]) {
    let mut ranges: Vec<(u64, u64)> = live
        .iter()
        .map(|x| (x.offset, x.offset + x.block_size()))
        .collect();
    ranges.sort_unstable();
    let end = a.slab_count() as u64 * a.slab_size();
    for (x, &(start, stop)) in live.iter().zip(&ranges) {
        assert!(x.size >= 1 && x.size <= x.block_size());
        assert!(
            stop <= end && end <= a.capacity(),
            "{start}..{stop} past {end}"
        );
        assert_eq!(
            start / a.slab_size(),
            (stop - 1) / a.slab_size(),
            "block straddles slabs"
        );
    }
    for pair in ranges.windows(2) {
        assert!(
            pair[0].1 <= pair[1].0,
            "overlap: {:?} and {:?}",
            pair[0],
            pair[1]
        );
    }
    assert_eq!(
        a.used_bytes(),
        live.iter().map(Allocation::block_size).sum::<u64>()
    );
    assert_eq!(
        a.requested_bytes(),
        live.iter().map(|x| x.size).sum::<u64>()
    );
    assert!(a.used_bytes() <= a.carved_bytes());
}

#[test]
fn random_alloc_free_never_overlaps() {
    for seed in 1..=3 {
        let a = allocator(48, 256 * KIB);
        let mut rng = Rng::new(seed);
        let mut live: Vec<Allocation> = Vec::new();
        let mut failures = 0;
        for step in 0..6_000 {
            if rng.below(100) < 55 {
                match a.alloc(rng.size(a.max_object_size())) {
                    Some(x) => live.push(x),
                    None => failures += 1,
                }
            } else if !live.is_empty() {
                let i = rng.below(live.len() as u64) as usize;
                a.free(live.swap_remove(i));
            }
            if step % 500 == 0 {
                check_consistent(&a, &live);
            }
        }
        check_consistent(&a, &live);
        assert!(
            failures > 0,
            "the run should reach exhaustion (seed {seed})"
        );
        for x in live.drain(..) {
            a.free(x);
        }
        assert_eq!((a.used_bytes(), a.requested_bytes()), (0, 0));
    }
}

#[test]
fn every_size_up_to_the_max_gets_the_smallest_fitting_class() {
    let a = allocator(2, 64 * KIB);
    let classes = a.size_classes().to_vec();
    assert_eq!(a.max_object_size(), 64 * KIB);
    assert_eq!(*classes.last().unwrap(), a.max_object_size());
    assert!(a.alloc(0).is_none());
    assert!(a.alloc(a.max_object_size() + 1).is_none());
    for size in 1..=a.max_object_size() {
        let x = a.alloc(size).expect("an empty allocator fits any size");
        let want = *classes.iter().find(|&&c| c >= size).unwrap();
        assert_eq!(x.block_size(), want, "size {size}");
        assert_eq!(a.block_size_for(size), Some(want));
        assert_eq!(x.size, size);
        a.free(x);
    }
    assert_eq!(a.used_bytes(), 0);
}

#[test]
fn exhaustion_returns_none_and_frees_make_room() {
    let a = allocator(8, 64 * KIB);
    let mut live: Vec<Allocation> = std::iter::from_fn(|| a.alloc(4 * KIB)).collect();
    assert_eq!(live.len(), 8 * 16);
    assert_eq!(a.carved_bytes(), 8 * 64 * KIB);
    assert!(a.alloc(1).is_none(), "no slab left for another class");
    check_consistent(&a, &live);
    let freed = live.swap_remove(37);
    a.free(freed);
    let again = a.alloc(4000).expect("a free makes room");
    assert_eq!(again.offset, freed.offset);
    live.push(again);
    assert!(a.alloc(4 * KIB).is_none());
    for x in live {
        a.free(x);
    }
    assert_eq!((a.used_bytes(), a.requested_bytes()), (0, 0));
}

#[test]
fn double_free_is_detected_and_harmless() {
    let a = allocator(4, 64 * KIB);
    let x = a.alloc(1000).unwrap();
    let y = a.alloc(1000).unwrap();
    a.free(x);
    let used = a.used_bytes();
    assert_eq!(a.try_free(x), Err(FreeError::DoubleFree));
    a.free(x); // logged and ignored
    assert_eq!(a.used_bytes(), used);
    // The block went back once: two new allocations get two distinct blocks.
    let (p, q) = (a.alloc(1000).unwrap(), a.alloc(1000).unwrap());
    assert_ne!(p.offset, q.offset);
    check_consistent(&a, &[y, p, q]);
    for z in [y, p, q] {
        assert_eq!(a.try_free(z), Ok(()));
    }
    assert_eq!(a.used_bytes(), 0);
}

#[test]
fn foreign_allocations_are_refused() {
    let a = allocator(4, 64 * KIB);
    let other = allocator(64, 4 * MIB);
    let mine = a.alloc(300).unwrap();
    let _ = other.alloc(100 * KIB).unwrap(); // offset 0 in a big slab
    let theirs = other.alloc(100 * KIB).unwrap();
    assert_eq!(a.try_free(theirs), Err(FreeError::Foreign));
    let mut altered = mine;
    altered.size = 2000;
    assert_eq!(a.try_free(altered), Err(FreeError::Foreign));
    assert_eq!(a.used_bytes(), mine.block_size());
    a.free(mine);
    assert_eq!(a.used_bytes(), 0);
}

#[test]
fn after_freeing_everything_the_whole_capacity_is_there_again() {
    let a = allocator(16, 128 * KIB);
    let fill = |size: u64| -> Vec<Allocation> { std::iter::from_fn(|| a.alloc(size)).collect() };
    let first = fill(10 * KIB);
    let per_slab = 128 * KIB / first[0].block_size();
    assert_eq!(first.len() as u64, 16 * per_slab);
    let mut offsets: Vec<u64> = first.iter().map(|x| x.offset).collect();
    for x in first {
        a.free(x);
    }
    let second = fill(10 * KIB);
    let mut again: Vec<u64> = second.iter().map(|x| x.offset).collect();
    offsets.sort_unstable();
    again.sort_unstable();
    assert_eq!(again, offsets, "same class, same blocks");
    for x in second {
        a.free(x);
    }
    // Slabs are recycled, so another class gets the whole segment too.
    let other = fill(2 * KIB);
    assert_eq!(other.len() as u64, 16 * 128 / 2);
    check_consistent(&a, &other);
    for x in other {
        a.free(x);
    }
    assert_eq!(a.reclaim_free_slabs(), 16);
    assert_eq!(a.carved_bytes(), 0);
}

/// One bit per 64-byte granule of the segment: set while some thread owns it.
struct Owners(Vec<AtomicU64>);

impl Owners {
    fn new(bytes: u64) -> Owners {
        Owners(
            (0..bytes.div_ceil(64 * 64))
                .map(|_| AtomicU64::new(0))
                .collect(),
        )
    }

    /// Sets (or clears) the granules of `x`, asserting none was already so.
    fn mark(&self, x: &Allocation, set: bool) {
        let (mut g, end) = (x.offset / 64, (x.offset + x.block_size()) / 64);
        while g < end {
            let (word, bit) = ((g / 64) as usize, g % 64);
            let n = (end - g).min(64 - bit);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            let before = if set {
                self.0[word].fetch_or(mask, Ordering::Relaxed)
            } else {
                self.0[word].fetch_and(!mask, Ordering::Relaxed)
            };
            let expect = if set { 0 } else { mask };
            assert_eq!(
                before & mask,
                expect,
                "{x:?} overlaps a live block (set={set})"
            );
            g += n;
        }
    }
}

#[test]
fn concurrent_alloc_free_stays_consistent() {
    const THREADS: u64 = 4;
    const OPS: u64 = 15_000;
    let a = allocator(24, 256 * KIB);
    let owners = Owners::new(a.capacity());
    let mailbox: Mutex<Vec<Allocation>> = Mutex::new(Vec::new());
    let kept: Vec<Vec<Allocation>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (a, owners, mailbox) = (&a, &owners, &mailbox);
                s.spawn(move || {
                    let mut rng = Rng::new(100 + t);
                    let mut live: Vec<Allocation> = Vec::new();
                    for _ in 0..OPS {
                        match rng.below(100) {
                            0..=49 => {
                                // Mostly small and mid sizes, some up to a slab.
                                let max = if rng.below(8) == 0 {
                                    a.max_object_size()
                                } else {
                                    16 * KIB
                                };
                                if let Some(x) = a.alloc(rng.size(max)) {
                                    owners.mark(&x, true);
                                    if rng.below(8) == 0 {
                                        mailbox.lock().unwrap().push(x);
                                    } else {
                                        live.push(x);
                                    }
                                }
                            }
                            50..=89 if !live.is_empty() => {
                                let x = live.swap_remove(rng.below(live.len() as u64) as usize);
                                owners.mark(&x, false);
                                a.free(x);
                            }
                            _ => {
                                // Free one another thread allocated.
                                let x = mailbox.lock().unwrap().pop();
                                if let Some(x) = x {
                                    owners.mark(&x, false);
                                    assert_eq!(a.try_free(x), Ok(()));
                                }
                            }
                        }
                    }
                    live
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut live: Vec<Allocation> = kept.into_iter().flatten().collect();
    live.append(&mut mailbox.lock().unwrap());
    check_consistent(&a, &live);
    for x in live {
        owners.mark(&x, false);
        a.free(x);
    }
    assert_eq!((a.used_bytes(), a.requested_bytes()), (0, 0));
    // Every block is back: all slabs come free and a new fill gets them all.
    a.reclaim_free_slabs();
    assert_eq!(a.carved_bytes(), 0);
    let fill: Vec<Allocation> = std::iter::from_fn(|| a.alloc(64 * KIB)).collect();
    assert_eq!(fill.len(), 24 * 4);
    check_consistent(&a, &fill);
}
