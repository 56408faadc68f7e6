//! The slab table: which class each slab serves, and the blocks' free-list links.
//!
//! Slots are preallocated (`capacity / slab_size` of them) and each slab's
//! metadata is created once, lock-free, by the one thread that claims the slab
//! from the fresh-slab counter; it is never replaced or freed, so any thread may
//! follow a link of any id it has seen. A recycled slab keeps its link array,
//! which bounds how many blocks it can have in its next class.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::freelist::{link_to, TaggedStack, ALLOCATED, MAX_ID};

const LINKS_PER_LINE: usize = 16;

/// One cache line of links, so two slabs' links never share a line.
#[repr(align(64))]
struct LinkLine([AtomicU32; LINKS_PER_LINE]);

/// `shape` bit set while the slab serves a class.
const BOUND: u64 = 1 << 63;

/// What a bound slab serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    pub(crate) class: usize,
    pub(crate) blocks: u32,
}

pub(crate) struct SlabMeta {
    /// 0 while unbound, else `BOUND | class << 32 | blocks`.
    shape: AtomicU64,
    /// `1 << line_bits` lines; block `b` is on line `b % lines`, so neighbouring
    /// blocks (which different threads often hold) never share a line.
    links: Box<[LinkLine]>,
    line_bits: u32,
}

impl SlabMeta {
    fn new(links: u32) -> SlabMeta {
        let lines = (links as usize)
            .div_ceil(LINKS_PER_LINE)
            .next_power_of_two();
        SlabMeta {
            shape: AtomicU64::new(0),
            links: (0..lines)
                .map(|_| LinkLine(std::array::from_fn(|_| AtomicU32::new(ALLOCATED))))
                .collect(),
            line_bits: lines.trailing_zeros(),
        }
    }

    #[inline]
    pub(crate) fn link(&self, block: u32) -> &AtomicU32 {
        debug_assert!(block < self.link_capacity(), "block {block} has no link");
        let b = block as usize;
        &self.links[b & (self.links.len() - 1)].0[b >> self.line_bits]
    }

    /// How many blocks this slab can ever be cut into.
    pub(crate) fn link_capacity(&self) -> u32 {
        (self.links.len() * LINKS_PER_LINE).min(u32::MAX as usize) as u32
    }

    pub(crate) fn shape(&self) -> Option<Shape> {
        let v = self.shape.load(Ordering::Acquire);
        (v & BOUND != 0).then_some(Shape {
            class: ((v >> 32) & 0xFFFF) as usize,
            blocks: v as u32,
        })
    }
}

struct Slot {
    meta: OnceLock<SlabMeta>,
    /// Link in the free-slab stack.
    next_free: AtomicU32,
}

pub(crate) struct SlabTable {
    /// A block id is `slab << shift | block`.
    shift: u32,
    /// Fewest links a fresh slab gets, so it can later serve smaller classes.
    min_links: u32,
    slots: Box<[Slot]>,
    /// Next never-used slab (may overshoot `slots.len()` by a few failed claims).
    fresh: AtomicUsize,
    /// Recycled, unbound slabs.
    free: TaggedStack,
    free_count: AtomicUsize,
}

impl SlabTable {
    pub(crate) fn new(slabs: usize, shift: u32, min_links: u32) -> SlabTable {
        SlabTable {
            shift,
            min_links,
            slots: (0..slabs)
                .map(|_| Slot {
                    meta: OnceLock::new(),
                    next_free: AtomicU32::new(0),
                })
                .collect(),
            fresh: AtomicUsize::new(0),
            free: TaggedStack::default(),
            free_count: AtomicUsize::new(0),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    #[inline]
    pub(crate) fn id(&self, slab: usize, block: u32) -> u32 {
        ((slab as u32) << self.shift) | block
    }

    #[inline]
    pub(crate) fn split(&self, id: u32) -> (usize, u32) {
        let mask = ((1u64 << self.shift) - 1) as u32;
        ((id >> self.shift) as usize, id & mask)
    }

    pub(crate) fn shift(&self) -> u32 {
        self.shift
    }

    pub(crate) fn meta(&self, slab: usize) -> Option<&SlabMeta> {
        self.slots.get(slab)?.meta.get()
    }

    /// The link cell of a block id that has been on a free list (so its slab exists).
    #[inline]
    pub(crate) fn link(&self, id: u32) -> &AtomicU32 {
        let (slab, block) = self.split(id);
        debug_assert!(
            slab < self.slots.len(),
            "block id {id:#x} past the last slab"
        );
        self.slots[slab]
            .meta
            .get()
            .expect("block ids exist only in claimed slabs")
            .link(block)
    }

    /// Takes an unbound slab: a recycled one first, else a fresh one with links
    /// for at least `blocks` blocks. The caller owns it until it binds it.
    pub(crate) fn claim(&self, blocks: u32) -> Option<(usize, &SlabMeta)> {
        if let Some((slab, _)) = self.free.pop(|s| &self.slots[s as usize].next_free) {
            let was = self.free_count.fetch_sub(1, Ordering::Relaxed);
            // `release` counts a slab before pushing it, so the count covers every pop.
            debug_assert!(was > 0, "free-slab count went negative");
            let slab = slab as usize;
            let meta = self.slots[slab]
                .meta
                .get()
                .expect("recycled slabs have metadata");
            debug_assert_eq!(meta.shape(), None, "a slab on the free stack is unbound");
            return Some((slab, meta));
        }
        if self.fresh.load(Ordering::Relaxed) >= self.slots.len() {
            return None;
        }
        let slab = self.fresh.fetch_add(1, Ordering::Relaxed);
        let slot = self.slots.get(slab)?;
        let meta = slot
            .meta
            .get_or_init(|| SlabMeta::new(blocks.max(self.min_links)));
        debug_assert_eq!(meta.shape(), None, "a fresh slab is unbound");
        Some((slab, meta))
    }

    /// Binds a claimed slab to `class` with `blocks` blocks: block 0 is returned
    /// allocated, blocks 1.. are linked in order; returns that chain's first id
    /// and last cell for one `push_chain`, or None for a one-block slab.
    pub(crate) fn bind<'a>(
        &self,
        slab: usize,
        meta: &'a SlabMeta,
        class: usize,
        blocks: u32,
    ) -> Option<(u32, &'a AtomicU32)> {
        debug_assert!(blocks >= 1 && blocks <= meta.link_capacity());
        debug_assert_eq!(
            meta.shape(),
            None,
            "binding a slab that already serves a class"
        );
        debug_assert!(
            ((slab as u64) << self.shift | u64::from(blocks - 1)) <= u64::from(MAX_ID),
            "slab {slab} has block ids past MAX_ID"
        );
        meta.link(0).store(ALLOCATED, Ordering::Relaxed);
        for b in 1..blocks.saturating_sub(1) {
            meta.link(b)
                .store(link_to(self.id(slab, b + 1)), Ordering::Relaxed);
        }
        meta.shape.store(
            BOUND | ((class as u64) << 32) | u64::from(blocks),
            Ordering::Release,
        );
        (blocks > 1).then(|| (self.id(slab, 1), meta.link(blocks - 1)))
    }

    /// Unbinds a slab none of whose blocks is allocated or on any free list (the
    /// caller took them all) and puts it on the free-slab stack.
    pub(crate) fn release(&self, slab: usize) {
        let meta = self.slots[slab]
            .meta
            .get()
            .expect("released slabs were claimed");
        debug_assert!(meta.shape().is_some(), "releasing slab {slab} twice");
        meta.shape.store(0, Ordering::Release);
        self.free_count.fetch_add(1, Ordering::Relaxed);
        self.free
            .push_chain(slab as u32, &self.slots[slab].next_free);
    }

    /// Rebuild only (one thread, before the table is shared): binds slab `slab` to
    /// `class` with `blocks` blocks of which those with `taken[b]` are allocated, and
    /// returns the chain of the others for one `push_chain`, as `bind` does.
    pub(crate) fn bind_taken(
        &self,
        slab: usize,
        class: usize,
        blocks: u32,
        taken: &[bool],
    ) -> Option<(u32, &AtomicU32)> {
        let meta = self.slots[slab]
            .meta
            .get_or_init(|| SlabMeta::new(blocks.max(self.min_links)));
        debug_assert!(blocks <= meta.link_capacity() && taken.len() == blocks as usize);
        let mut first: Option<u32> = None;
        let mut prev: Option<u32> = None;
        for b in 0..blocks {
            if taken[b as usize] {
                meta.link(b).store(ALLOCATED, Ordering::Relaxed);
                continue;
            }
            match prev {
                Some(p) => meta
                    .link(p)
                    .store(link_to(self.id(slab, b)), Ordering::Relaxed),
                None => first = Some(b),
            }
            prev = Some(b);
        }
        meta.shape.store(
            BOUND | ((class as u64) << 32) | u64::from(blocks),
            Ordering::Release,
        );
        Some((self.id(slab, first?), meta.link(prev?)))
    }

    /// Rebuild only: the slabs below `end` are claimed; those of them not bound
    /// (`bound[s]` false) go on the free-slab stack, with `links` links each (as many
    /// as a fresh slab of the smallest class gets), the rest stay fresh.
    pub(crate) fn settle_rebuilt(&self, end: usize, bound: &[bool], links: u32) {
        self.fresh.store(end, Ordering::Relaxed);
        for slab in (0..end).filter(|s| !bound[*s]) {
            self.slots[slab]
                .meta
                .get_or_init(|| SlabMeta::new(links.max(self.min_links)));
            self.free_count.fetch_add(1, Ordering::Relaxed);
            self.free
                .push_chain(slab as u32, &self.slots[slab].next_free);
        }
    }

    /// Slabs currently serving a class (claimed and not back on the free stack).
    pub(crate) fn bound(&self) -> usize {
        let claimed = self.fresh.load(Ordering::Relaxed).min(self.slots.len());
        claimed.saturating_sub(self.free_count.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_block_has_its_own_link_and_neighbours_differ_in_line() {
        let meta = SlabMeta::new(100);
        assert_eq!(meta.link_capacity(), 128);
        let addr = |b: u32| meta.link(b) as *const AtomicU32 as usize;
        let mut all: Vec<usize> = (0..128).map(addr).collect();
        assert!((0..127).all(|b| addr(b) / 64 != addr(b + 1) / 64));
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 128);
    }

    #[test]
    fn ids_round_trip_and_claims_stop_at_the_end() {
        let t = SlabTable::new(3, 4, 16);
        assert_eq!(t.split(t.id(2, 15)), (2, 15));
        let claimed: Vec<usize> = std::iter::from_fn(|| t.claim(16).map(|(s, _)| s)).collect();
        assert_eq!(claimed, [0, 1, 2]);
        assert_eq!(t.bound(), 3);
    }

    #[test]
    fn bind_chains_the_rest_and_release_recycles() {
        let t = SlabTable::new(2, 4, 16);
        let (slab, meta) = t.claim(10).unwrap();
        let (first, last) = t.bind(slab, meta, 7, 10).unwrap();
        assert_eq!(
            meta.shape(),
            Some(Shape {
                class: 7,
                blocks: 10
            })
        );
        assert_eq!(meta.link(0).load(Ordering::Relaxed), ALLOCATED);
        let mut at = first;
        for b in 1..9 {
            assert_eq!(t.split(at), (slab, b));
            at = t.link(at).load(Ordering::Relaxed) - 1;
        }
        assert!(std::ptr::eq(t.link(at), last));
        t.release(slab);
        assert_eq!(meta.shape(), None);
        assert_eq!(t.bound(), 0);
        assert_eq!(
            t.claim(4).map(|(s, _)| s),
            Some(slab),
            "recycled before fresh"
        );
    }
}
