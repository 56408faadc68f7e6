//! An index from hash tags to arena slots, for tables that keep their entries in an
//! arena of their own (the master's objects, the client's replica cache).
//!
//! Open addressing with linear probing over (tag << 32 | slot) buckets, at most 3/4
//! full. A removal shifts the rest of its probe run back (no tombstones), so a table
//! under steady churn never has to rehash to clear them: a rehash of a large cache
//! stalled its caller for milliseconds. The tag (32 bits of the key's hash) picks the
//! home bucket, so growing never reads a key; equal tags are told apart by the
//! caller's own check of the slot.

#![forbid(unsafe_code)]

/// An empty bucket.
const VACANT: u64 = u64::MAX;
/// The fewest buckets an index that holds anything has.
const MIN_BUCKETS: usize = 16;

#[derive(Default)]
pub struct SlotIndex {
    buckets: Vec<u64>,
    len: usize,
}

impl SlotIndex {
    /// An index that holds `n` entries without growing.
    pub fn with_capacity(n: usize) -> SlotIndex {
        let mut index = SlotIndex::default();
        if n > 0 {
            index.buckets = vec![VACANT; Self::buckets_for(n)];
        }
        index
    }

    /// Buckets for `n` entries at most 3/4 full (a power of two).
    fn buckets_for(n: usize) -> usize {
        (n * 4 / 3 + 1).next_power_of_two().max(MIN_BUCKETS)
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Buckets allocated.
    #[cfg(test)]
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// The bucket and slot of the entry under `tag` that `is_it` accepts.
    pub fn find(&self, tag: u32, mut is_it: impl FnMut(u32) -> bool) -> Option<(usize, u32)> {
        if self.buckets.is_empty() {
            return None;
        }
        let mask = self.buckets.len() - 1;
        let mut i = tag as usize & mask;
        // Bounded: the index always has vacant buckets.
        loop {
            let bucket = self.buckets[i];
            if bucket == VACANT {
                return None;
            }
            let slot = bucket as u32;
            if (bucket >> 32) as u32 == tag && is_it(slot) {
                return Some((i, slot));
            }
            i = (i + 1) & mask;
        }
    }

    /// Asks for the home bucket of `tag` to be brought into the cache (see
    /// `util::prefetch`): a batch asks for all its keys' before it finds any.
    pub fn prefetch(&self, tag: u32) {
        if !self.buckets.is_empty() {
            let home = tag as usize & (self.buckets.len() - 1);
            crate::util::prefetch::prefetch_read(self.buckets[home..].as_ptr());
        }
    }

    /// Adds `slot` under `tag`, growing first when the index would pass 3/4 full.
    pub fn insert(&mut self, tag: u32, slot: u32) {
        if (self.len + 1) * 4 > self.buckets.len() * 3 {
            let size = (self.buckets.len() * 2).max(MIN_BUCKETS);
            let old = std::mem::replace(&mut self.buckets, vec![VACANT; size]);
            for bucket in old.into_iter().filter(|b| *b != VACANT) {
                self.place(bucket);
            }
        }
        self.place((u64::from(tag) << 32) | u64::from(slot));
        self.len += 1;
    }

    /// Puts `bucket` (tag and slot) in the first vacant bucket from its tag's.
    fn place(&mut self, bucket: u64) {
        let mask = self.buckets.len() - 1;
        let mut i = (bucket >> 32) as usize & mask;
        while self.buckets[i] != VACANT {
            i = (i + 1) & mask;
        }
        self.buckets[i] = bucket;
    }

    /// Removes the entry in `bucket` (as `find` returned it), moving later buckets of
    /// the same probe run back so that every entry stays reachable from its home.
    pub fn remove_at(&mut self, mut hole: usize) {
        let mask = self.buckets.len() - 1;
        let mut i = (hole + 1) & mask;
        while self.buckets[i] != VACANT {
            let home = (self.buckets[i] >> 32) as usize & mask;
            // Movable when its home is not within (hole, i].
            if i.wrapping_sub(home) & mask >= i.wrapping_sub(hole) & mask {
                self.buckets[hole] = self.buckets[i];
                hole = i;
            }
            i = (i + 1) & mask;
        }
        self.buckets[hole] = VACANT;
        self.len -= 1;
    }

    /// Removes every entry, keeping the buckets.
    pub fn clear(&mut self) {
        self.buckets.fill(VACANT);
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slot `s`'s tag in these tests: few distinct tags, so probe runs are long and
    /// many entries share a tag.
    fn tag(s: u32) -> u32 {
        s.wrapping_mul(0x9E37_79B9) % 7
    }

    #[test]
    fn entries_stay_reachable_through_churn_and_growth() {
        let mut index = SlotIndex::default();
        let mut live = std::collections::BTreeSet::new();
        let mut rng = 0x1234_5678_u64;
        for step in 0..20_000u32 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let s = (rng % 600) as u32;
            match index.find(tag(s), |x| x == s) {
                Some((bucket, found)) => {
                    assert_eq!(found, s);
                    index.remove_at(bucket);
                    live.remove(&s);
                }
                None => {
                    assert!(!live.contains(&s), "step {step}: slot {s} lost");
                    index.insert(tag(s), s);
                    live.insert(s);
                }
            }
            assert_eq!(index.len(), live.len());
            assert!(index.buckets() * 3 >= index.len() * 4);
        }
        for s in 0..600 {
            assert_eq!(index.find(tag(s), |x| x == s).is_some(), live.contains(&s));
        }
        index.clear();
        assert_eq!(index.len(), 0);
        assert!((0..600).all(|s| index.find(tag(s), |x| x == s).is_none()));
    }

    #[test]
    fn an_index_sized_ahead_does_not_grow() {
        let mut index = SlotIndex::with_capacity(1000);
        let buckets = index.buckets();
        for s in 0..1000 {
            index.insert(s, s);
        }
        assert_eq!(index.buckets(), buckets);
        assert_eq!(SlotIndex::with_capacity(0).buckets(), 0);
        assert_eq!(SlotIndex::default().find(1, |_| true), None);
    }
}
