//! A lock-free slab allocator of offsets inside one segment.
//!
//! The bytes live in a storage node's memory (often another process); the master
//! keeps one allocator per mounted segment and hands out `[offset, offset + size)`
//! ranges from many threads at once, so `alloc` and `free` take no lock.
//!
//! * **Size classes** (`classes.rs`): `classes_per_doubling` geometric steps
//!   per power of two from `min_class` to `slab_size`, multiples of 64 bytes;
//!   sizes that fit equally many blocks into a slab are merged into the largest
//!   (the slab holds as many blocks either way, so block size = real footprint).
//!   With the defaults (153 classes) a request wastes at most: 24% for 257..1024
//!   bytes (64-byte rounding: 257 takes 320), 6.7% for 1..64 KiB, 7.1% to
//!   128 KiB, 7.7% to 256 KiB, then more as few blocks fit a slab (just over half
//!   a slab takes a whole one). Objects above [`SlabAllocator::max_object_size`]
//!   (= `slab_size`) are the caller's to stripe; `alloc` refuses them.
//! * **Slabs** (`slab.rs`): the segment is `capacity / slab_size` slabs; a tail
//!   shorter than a slab is never used. A class with no free block claims a slab
//!   (a recycled one, else the next fresh one by an atomic bump), cuts it into
//!   `slab_size / block` blocks, keeps block 0 and pushes the rest with one CAS.
//!   No slab left: `alloc` returns `None` (the master evicts and retries).
//! * **Free lists** (`freelist.rs`): per class, Treiber stacks of block ids with
//!   a 32-bit ABA tag in the head; links live in per-slab arrays of the
//!   allocator's own memory, never in the segment. Each class has one stack per
//!   shard (the CPU count, up to 8; `shards.rs`): a thread pushes to its own and
//!   pops from its own first, then the others, so threads on one class rarely
//!   share a cache line. An uncontended `free` is one CAS on the block's link
//!   (the double-free check) and one on the class head; `alloc` is one CAS.
//!   The byte counters are per thread, written without read-modify-write.
//! * **Recycling** (`reclaim.rs`): when a class is out of slabs, slabs with no
//!   allocated block are taken back from their classes and reused by any class.
//!   A pass briefly holds each class's free blocks, so an `alloc` racing with it
//!   may return `None`; passes that find nothing back off (until a slab's worth
//!   more is free), so a slab freed then may wait for a later failure or
//!   [`SlabAllocator::reclaim_free_slabs`]. A
//!   reused slab keeps the link array it was first given (at least 4096 links
//!   with the defaults), so a small class may use only part of a slab that first
//!   served large blocks. Slabs only partly free stay with their class.
//! * **Bad frees** are refused without touching any list: a foreign or altered
//!   [`Allocation`] fails validation (class, slab, block, offset), and a double
//!   free finds its block's link not marked allocated. A stale free arriving
//!   after the block was allocated again cannot be told from a valid one.
//! * **Limits**: block ids are 32 bits (`slab << shift | block`). When
//!   `capacity / min_class` would not fit (about 1 TiB with the defaults), the
//!   smallest class is raised until it does (logged).
//!
//! No `unsafe`, no locks: std atomics, boxed slices and `OnceLock` slots that are
//! each set once by the thread that claimed the slab.

#![forbid(unsafe_code)]

mod classes;
mod freelist;
mod reclaim;
mod shards;
mod slab;

use std::fmt;
use std::sync::atomic::Ordering;

use classes::{SizeClasses, ALIGN};
use freelist::{TaggedStack, ALLOCATED, MAX_ID};
use reclaim::ReclaimState;
use shards::{Counters, Padded};
use slab::{SlabMeta, SlabTable};

/// Sizing of one allocator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocatorConfig {
    /// Bytes per slab, also the largest object (rounded down to 64).
    pub slab_size: u64,
    /// The smallest block (rounded up to 64).
    pub min_class: u64,
    /// Geometric size steps per power of two (1..=1024).
    pub classes_per_doubling: u32,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            slab_size: 4 << 20,
            min_class: 256,
            classes_per_doubling: 16,
        }
    }
}

/// A segment should hold at least this many slabs: every size class in use keeps one
/// partly filled slab, so with fewer slabs that tail waste becomes a visible share.
pub const MIN_SLABS_PER_SEGMENT: u64 = 2048;
/// The smallest slab `for_segment` shrinks to.
pub const MIN_AUTO_SLAB: u64 = 256 << 10;

impl AllocatorConfig {
    /// This config with `slab_size` halved (down to `MIN_AUTO_SLAB`) until a segment of
    /// `capacity` bytes holds `MIN_SLABS_PER_SEGMENT` slabs. Big segments keep big
    /// slabs (fewer pieces per large object); small ones get utilization.
    pub fn for_segment(&self, capacity: u64) -> AllocatorConfig {
        let mut slab = self.slab_size;
        while slab / 2 >= MIN_AUTO_SLAB && capacity / slab < MIN_SLABS_PER_SEGMENT {
            slab /= 2;
        }
        AllocatorConfig {
            slab_size: slab,
            ..self.clone()
        }
    }
}

/// One allocated range of a segment: `[offset, offset + size)` is the caller's,
/// inside a block of [`Allocation::block_size`] bytes starting at `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Offset of the block inside the allocator's range.
    pub offset: u64,
    /// The requested size.
    pub size: u64,
    /// Block id (`slab << shift | block`); opaque.
    block: u32,
    /// Block size in 64-byte units; opaque.
    units: u32,
}

impl Allocation {
    /// Bytes reserved for this allocation (its size class).
    pub fn block_size(&self) -> u64 {
        u64::from(self.units) * ALIGN
    }
}

/// Why [`SlabAllocator::try_free`] refused an allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeError {
    /// Not from this allocator, or its fields were altered.
    Foreign,
    /// Already free.
    DoubleFree,
}

impl fmt::Display for FreeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FreeError::Foreign => "not an allocation of this allocator",
            FreeError::DoubleFree => "already free (double free)",
        })
    }
}

impl std::error::Error for FreeError {}

/// Largest slab (so a block size in 64-byte units fits 32 bits).
const MAX_SLAB: u64 = 1 << 37;
/// Links a fresh slab gets at least, so it can later serve classes with that
/// many blocks.
const MIN_LINKS: u64 = 4096;

/// Lock-free slab allocator for the space of one mounted segment.
pub struct SlabAllocator {
    capacity: u64,
    slab_size: u64,
    classes: SizeClasses,
    slabs: SlabTable,
    /// Free lists, `[class << shard_bits | shard]`.
    heads: Box<[Padded<TaggedStack>]>,
    shard_bits: u32,
    shard_mask: usize,
    counters: Counters,
    reclaim: ReclaimState,
}

fn ceil_log2(n: u64) -> u32 {
    if n <= 1 {
        0
    } else {
        64 - (n - 1).leading_zeros()
    }
}

impl SlabAllocator {
    /// An allocator for a segment of `capacity` bytes. Out-of-range settings are
    /// clamped (see [`AllocatorConfig`]); nothing is allocated per slab until a
    /// slab is first used.
    pub fn new(capacity: u64, config: AllocatorConfig) -> SlabAllocator {
        let slab_size = (config.slab_size / ALIGN * ALIGN).clamp(ALIGN, MAX_SLAB);
        let asked_min = config.min_class.max(1).div_ceil(ALIGN) * ALIGN;
        let mut min_class = asked_min.min(slab_size);
        let per_doubling = config.classes_per_doubling.clamp(1, 1024);
        let mut slabs = capacity / slab_size;
        let id_space = u128::from(MAX_ID) + 1;
        let fits = |slabs: u64, min: u64| {
            u128::from(slabs.max(1)) << ceil_log2(slab_size / min) <= id_space
        };
        while min_class < slab_size && !fits(slabs, min_class) {
            min_class = (min_class * 2).min(slab_size);
        }
        if min_class != asked_min.min(slab_size) {
            log::warn!("slab allocator: smallest block raised to {min_class} bytes so block ids of a {capacity}-byte segment fit 32 bits");
        }
        if !fits(slabs, min_class) {
            slabs = (id_space - 1) as u64;
            log::warn!("slab allocator: only the first {slabs} slabs of a {capacity}-byte segment are used");
        }
        let classes = SizeClasses::new(min_class, slab_size, per_doubling);
        let per_slab0 = slab_size / classes.size(0);
        let min_links = per_slab0.min(MIN_LINKS);
        let min_payload = (0..classes.len())
            .map(|c| (slab_size / classes.size(c)).min(min_links) * classes.size(c))
            .min()
            .unwrap_or(slab_size);
        let shards = shards::shard_count();
        let shard_bits = shards.trailing_zeros();
        SlabAllocator {
            capacity,
            slab_size,
            slabs: SlabTable::new(slabs as usize, ceil_log2(per_slab0), min_links as u32),
            heads: (0..classes.len() << shard_bits)
                .map(|_| Padded::default())
                .collect(),
            classes,
            shard_bits,
            shard_mask: shards - 1,
            counters: Counters::new(),
            reclaim: ReclaimState::new(min_payload),
        }
    }

    /// An allocator for a segment some of whose space is already in use: each claim
    /// `(offset, size)` names a block this allocator's layout (same `capacity` and
    /// `config`) would have handed out. It is taken back as allocated, in claim order;
    /// a claim that does not fit the layout (misaligned, past the end, a block taken
    /// twice, a slab claimed by two size classes) gets `None`. Used to rebuild a
    /// restarted master's view of a node that still holds its objects.
    pub fn with_claims(
        capacity: u64,
        config: AllocatorConfig,
        claims: &[(u64, u64)],
    ) -> (SlabAllocator, Vec<Option<Allocation>>) {
        let a = SlabAllocator::new(capacity, config);
        // Per slab: its class and which blocks are taken.
        let mut slabs: std::collections::BTreeMap<usize, (usize, Vec<bool>)> =
            std::collections::BTreeMap::new();
        let mut out = Vec::with_capacity(claims.len());
        for &(offset, size) in claims {
            out.push(a.place_claim(offset, size, &mut slabs));
        }
        let slot = shards::thread_slot();
        let mut bound = vec![false; slabs.keys().next_back().map_or(0, |s| s + 1)];
        for (&slab, (class, taken)) in &slabs {
            let block_size = a.classes.size(*class);
            let blocks = taken.len() as u32;
            a.reclaim.bound(u64::from(blocks) * block_size);
            if let Some((first, last)) = a.slabs.bind_taken(slab, *class, blocks, taken) {
                a.head(*class, 0).push_chain(first, last);
            }
            bound[slab] = true;
        }
        let smallest = (a.slab_size / a.classes.size(0)) as u32;
        a.slabs.settle_rebuilt(bound.len(), &bound, smallest);
        for x in out.iter().flatten() {
            a.counters.add(slot, x.block_size(), x.size);
        }
        (a, out)
    }

    /// Places one claim of [`with_claims`](Self::with_claims) in `slabs`.
    fn place_claim(
        &self,
        offset: u64,
        size: u64,
        slabs: &mut std::collections::BTreeMap<usize, (usize, Vec<bool>)>,
    ) -> Option<Allocation> {
        let class = self.classes.class_of(size)?;
        let block_size = self.classes.size(class);
        let slab = usize::try_from(offset / self.slab_size).ok()?;
        let within = offset % self.slab_size;
        if slab >= self.slabs.len() || within % block_size != 0 {
            return None;
        }
        let per_slab = (self.slab_size / block_size) as u32;
        let block = (within / block_size) as u32;
        if block >= per_slab {
            return None;
        }
        let (bound_class, taken) = slabs
            .entry(slab)
            .or_insert_with(|| (class, vec![false; per_slab as usize]));
        if *bound_class != class || taken[block as usize] {
            return None;
        }
        taken[block as usize] = true;
        Some(Allocation {
            offset,
            size,
            block: self.slabs.id(slab, block),
            units: (block_size / ALIGN) as u32,
        })
    }

    /// Allocates a block for `size` bytes; `None` for 0, for sizes above
    /// [`max_object_size`](Self::max_object_size), or when no space is left.
    #[inline]
    pub fn alloc(&self, size: u64) -> Option<Allocation> {
        let class = self.classes.class_of(size)?;
        let slot = shards::thread_slot();
        let id = self.take(class, slot & self.shard_mask)?;
        let block_size = self.classes.size(class);
        let (slab, block) = self.slabs.split(id);
        self.counters.add(slot, block_size, size);
        let offset = slab as u64 * self.slab_size + u64::from(block) * block_size;
        debug_assert!(size <= block_size && block_size % ALIGN == 0);
        debug_assert!(
            offset % ALIGN == 0 && offset + block_size <= (slab as u64 + 1) * self.slab_size,
            "block {block} of slab {slab} ({block_size} bytes) crosses its slab"
        );
        debug_assert!(
            offset + block_size <= self.capacity,
            "block past the segment"
        );
        Some(Allocation {
            offset,
            size,
            block: id,
            units: (block_size / ALIGN) as u32,
        })
    }

    /// Frees an allocation. A foreign one or a double free is refused and
    /// logged as an error, leaving the allocator unchanged.
    pub fn free(&self, a: Allocation) {
        if let Err(e) = self.try_free(a) {
            log::error!("slab allocator: refusing to free {a:?}: {e}");
        }
    }

    /// Frees an allocation, saying why if it is refused.
    #[inline]
    pub fn try_free(&self, a: Allocation) -> Result<(), FreeError> {
        let (class, meta, block) = self.validate(&a).ok_or(FreeError::Foreign)?;
        let slot = shards::thread_slot();
        if !self
            .head(class, slot & self.shard_mask)
            .push_allocated(a.block, meta.link(block))
        {
            return Err(FreeError::DoubleFree);
        }
        self.counters.sub(slot, a.block_size(), a.size);
        Ok(())
    }

    /// The largest size `alloc` accepts (the slab size).
    pub fn max_object_size(&self) -> u64 {
        self.classes.max()
    }

    /// The segment size this allocator was made for.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes of allocated blocks (by block size). Exact when no call is in flight.
    pub fn used_bytes(&self) -> u64 {
        self.counters.used()
    }

    /// Sum of the requested sizes of live allocations.
    pub fn requested_bytes(&self) -> u64 {
        self.counters.requested()
    }

    /// Bytes of slabs now serving a size class.
    pub fn carved_bytes(&self) -> u64 {
        self.slabs.bound() as u64 * self.slab_size
    }

    /// Bytes per slab.
    pub fn slab_size(&self) -> u64 {
        self.slab_size
    }

    /// Slabs the segment is cut into (`capacity / slab_size`, maybe clamped).
    pub fn slab_count(&self) -> usize {
        self.slabs.len()
    }

    /// The block sizes, ascending.
    pub fn size_classes(&self) -> &[u64] {
        self.classes.sizes()
    }

    /// The block size `alloc(size)` would use.
    pub fn block_size_for(&self, size: u64) -> Option<u64> {
        self.classes.class_of(size).map(|c| self.classes.size(c))
    }

    #[inline]
    fn head(&self, class: usize, shard: usize) -> &TaggedStack {
        &self.heads[(class << self.shard_bits) | shard].0
    }

    /// A free block of `class`: own shard, other shards, a new slab, recycled
    /// slabs, and a last look at the lists.
    #[inline]
    fn take(&self, class: usize, shard: usize) -> Option<u32> {
        if let Some(id) = self.pop_any(class, shard) {
            return Some(id);
        }
        self.take_slow(class, shard)
    }

    #[cold]
    fn take_slow(&self, class: usize, shard: usize) -> Option<u32> {
        if let Some(id) = self.carve(class, shard) {
            return Some(id);
        }
        if self.reclaim_if_worthwhile() {
            if let Some(id) = self.carve(class, shard) {
                return Some(id);
            }
        }
        self.pop_any(class, shard)
    }

    #[inline]
    fn pop_any(&self, class: usize, shard: usize) -> Option<u32> {
        for k in 0..=self.shard_mask {
            let stack = self.head(class, (shard + k) & self.shard_mask);
            if let Some((id, cell)) = stack.pop(|id| self.slabs.link(id)) {
                cell.store(ALLOCATED, Ordering::Relaxed);
                self.debug_check_taken(class, id);
                return Some(id);
            }
        }
        None
    }

    /// A block just taken off `class`'s lists belongs to a slab bound to `class` and
    /// is one of its blocks (the slab cannot be released meanwhile: a reclaim pass
    /// releases only slabs whose every block it found on the lists).
    #[inline]
    fn debug_check_taken(&self, class: usize, id: u32) {
        if cfg!(debug_assertions) {
            let (slab, block) = self.slabs.split(id);
            let shape = self.slabs.meta(slab).and_then(SlabMeta::shape);
            debug_assert!(
                shape.is_some_and(|s| s.class == class && block < s.blocks),
                "block {id:#x} on class {class}'s list, but its slab is {shape:?}"
            );
        }
    }

    /// Binds a slab to `class`, keeps its first block and frees the rest.
    fn carve(&self, class: usize, shard: usize) -> Option<u32> {
        let size = self.classes.size(class);
        let per_slab = (self.slab_size / size) as u32;
        debug_assert!(per_slab >= 1, "class {class} is larger than a slab");
        let (slab, meta) = self.slabs.claim(per_slab)?;
        let blocks = per_slab.min(meta.link_capacity());
        self.reclaim.bound(u64::from(blocks) * size);
        if let Some((first, last)) = self.slabs.bind(slab, meta, class, blocks) {
            self.head(class, shard).push_chain(first, last);
        }
        Some(self.slabs.id(slab, 0))
    }

    /// The class, slab and block of a genuine allocation of this allocator.
    fn validate(&self, a: &Allocation) -> Option<(usize, &SlabMeta, u32)> {
        let class = self.classes.class_of(a.size)?;
        let size = self.classes.size(class);
        let (slab, block) = self.slabs.split(a.block);
        let meta = self.slabs.meta(slab)?;
        let shape = meta.shape()?;
        let offset = slab as u64 * self.slab_size + u64::from(block) * size;
        (size == a.block_size()
            && shape.class == class
            && block < shape.blocks
            && a.offset == offset)
            .then_some((class, meta, block))
    }
}

impl fmt::Debug for SlabAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlabAllocator")
            .field("capacity", &self.capacity)
            .field("slab_size", &self.slab_size)
            .field("slabs", &self.slabs.len())
            .field("classes", &self.classes.len())
            .field("carved_bytes", &self.carved_bytes())
            .field("used_bytes", &self.used_bytes())
            .field("requested_bytes", &self.requested_bytes())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn small(slabs: u64) -> SlabAllocator {
        SlabAllocator::new(
            slabs * 64 * 1024 + 100,
            AllocatorConfig {
                slab_size: 64 * 1024,
                ..AllocatorConfig::default()
            },
        )
    }

    #[test]
    fn is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<SlabAllocator>();
    }

    #[test]
    fn first_blocks_of_a_class_are_consecutive() {
        let a = SlabAllocator::new(8 * MIB, AllocatorConfig::default());
        let x = a.alloc(4096).unwrap();
        let y = a.alloc(4000).unwrap();
        assert_eq!((x.offset, x.block_size()), (0, 4096));
        assert_eq!((y.offset, y.block_size()), (4096, 4096));
        assert_eq!(a.carved_bytes(), 4 * MIB);
        assert_eq!(a.used_bytes(), 8192);
        assert_eq!(a.requested_bytes(), 8096);
    }

    #[test]
    fn config_is_normalized() {
        let a = SlabAllocator::new(
            MIB,
            AllocatorConfig {
                slab_size: 100_000,
                min_class: 1,
                classes_per_doubling: 0,
            },
        );
        assert_eq!(a.slab_size(), 99_968);
        assert_eq!(a.max_object_size(), 99_968);
        assert_eq!(a.size_classes()[0], 64);
        assert_eq!(a.slab_count(), 10);
        assert!(a.alloc(99_969).is_none());
    }

    #[test]
    fn huge_segments_raise_the_smallest_block_to_keep_ids_in_32_bits() {
        let a = SlabAllocator::new(4 << 40, AllocatorConfig::default());
        assert_eq!(a.slab_count(), 1 << 20);
        assert!(a.size_classes()[0] >= 1024);
        let far = (0..4).map(|_| a.alloc(4 * MIB).unwrap()).last().unwrap();
        assert_eq!(far.offset, 12 * MIB);
    }

    #[test]
    fn tampered_allocations_are_refused() {
        let a = small(4);
        let x = a.alloc(1000).unwrap();
        for bad in [
            Allocation {
                offset: x.offset + 64,
                ..x
            },
            Allocation { size: 5000, ..x },
            Allocation {
                block: x.block + 1,
                ..x
            },
            Allocation {
                units: x.units + 1,
                ..x
            },
        ] {
            assert_eq!(a.try_free(bad), Err(FreeError::Foreign), "{bad:?}");
        }
        assert_eq!(a.try_free(x), Ok(()));
        assert_eq!(a.try_free(x), Err(FreeError::DoubleFree));
        assert_eq!(a.used_bytes(), 0);
    }

    #[test]
    fn a_free_slab_moves_to_another_class() {
        let a = small(2);
        let big: Vec<_> = (0..2).map(|_| a.alloc(64 * 1024).unwrap()).collect();
        assert!(a.alloc(100).is_none(), "both slabs hold big blocks");
        a.free(big[1]);
        let x = a.alloc(100).expect("the freed slab is recycled");
        assert_eq!(x.offset, big[1].offset);
        assert_eq!(a.carved_bytes(), 128 * 1024);
        a.free(big[0]);
        a.free(x);
        assert_eq!(a.reclaim_free_slabs(), 2);
        assert_eq!(a.carved_bytes(), 0);
    }

    #[test]
    fn claims_rebuild_the_same_allocations_and_the_rest_stays_free() {
        let cfg = AllocatorConfig {
            slab_size: 64 * 1024,
            ..AllocatorConfig::default()
        };
        let first = SlabAllocator::new(8 * 64 * 1024, cfg.clone());
        let mut live: Vec<Allocation> = (0..40)
            .map(|i| first.alloc(if i % 2 == 0 { 1000 } else { 20_000 }).unwrap())
            .collect();
        // Leave some out so the rebuilt allocator has holes inside slabs.
        live.drain(..10);
        live.remove(7);
        let claims: Vec<(u64, u64)> = live.iter().map(|x| (x.offset, x.size)).collect();
        let (again, got) = SlabAllocator::with_claims(first.capacity(), cfg, &claims);
        assert!(got.iter().all(Option::is_some));
        assert_eq!(
            again.requested_bytes(),
            claims.iter().map(|c| c.1).sum::<u64>()
        );
        // New allocations never overlap a claimed block.
        let taken: Vec<(u64, u64)> = got
            .iter()
            .flatten()
            .map(|x| (x.offset, x.block_size()))
            .collect();
        let mut fresh = Vec::new();
        while let Some(x) = again.alloc(1000) {
            assert!(taken
                .iter()
                .all(|(o, l)| x.offset + x.block_size() <= *o || x.offset >= o + l));
            fresh.push(x);
        }
        assert!(!fresh.is_empty());
        for x in got.into_iter().flatten().chain(fresh) {
            assert_eq!(again.try_free(x), Ok(()));
        }
        assert_eq!(again.used_bytes(), 0);
    }

    #[test]
    fn claims_that_do_not_fit_the_layout_are_refused() {
        let cfg = AllocatorConfig {
            slab_size: 64 * 1024,
            ..AllocatorConfig::default()
        };
        let claims = [
            (0, 1000),          // ok: block 0 of a 1024-byte class
            (0, 1000),          // the same block twice
            (64, 1000),         // misaligned for its class
            (1024, 20_000),     // a second class in the same slab
            (10 * 65536, 1000), // past the end
            (65536, 0),         // empty
        ];
        let (_, got) = SlabAllocator::with_claims(4 * 64 * 1024, cfg, &claims);
        let ok: Vec<bool> = got.iter().map(Option::is_some).collect();
        assert_eq!(ok, [true, false, false, false, false, false]);
    }

    #[test]
    fn partly_free_slabs_stay_and_keep_their_blocks() {
        let a = small(1);
        let xs: Vec<_> = (0..64).map(|_| a.alloc(1024).unwrap()).collect();
        a.free(xs[3]);
        assert_eq!(a.reclaim_free_slabs(), 0);
        assert_eq!(a.alloc(1024).map(|x| x.offset), Some(xs[3].offset));
        assert!(a.alloc(1024).is_none());
    }
}
