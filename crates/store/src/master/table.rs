//! One shard of the object table: objects by key, and the victim order of those that
//! may be evicted, kept in step (every removal also leaves the order).
//!
//! Laid out for millions of objects per master: objects live in a chunked arena
//! (growth adds a chunk, never copies the arena) and are found through an
//! open-addressing index of (hash tag, arena slot) pairs; short keys sit inline in
//! their slot, longer ones in one byte arena per shard (no allocation per key),
//! compacted once dead bytes outnumber live ones. The victim order refers to objects
//! by arena slot. bench/README.md has the figures.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::ops::{Index, IndexMut};

use super::policy::{MeanGap, Policy, NONE};
use super::Object;
use crate::slot_index::SlotIndex;

/// Elements per arena chunk (a power of two): small enough that a near-empty shard
/// costs little, large enough that the chunk list stays short.
const CHUNK_BITS: u32 = 9;
const CHUNK: usize = 1 << CHUNK_BITS;

/// A growable array in fixed-size chunks: pushing never moves what is stored, and
/// the spare room is at most one chunk.
pub(super) struct Chunks<T> {
    chunks: Vec<Vec<T>>,
}

impl<T> Default for Chunks<T> {
    fn default() -> Self {
        Chunks { chunks: Vec::new() }
    }
}

impl<T> Chunks<T> {
    pub fn len(&self) -> usize {
        match self.chunks.last() {
            Some(last) => ((self.chunks.len() - 1) << CHUNK_BITS) + last.len(),
            None => 0,
        }
    }

    /// Appends `value`; returns its index.
    pub fn push(&mut self, value: T) -> u32 {
        let index = self.len() as u32;
        match self.chunks.last_mut() {
            Some(last) if last.len() < CHUNK => last.push(value),
            _ => {
                let mut chunk = Vec::with_capacity(CHUNK);
                chunk.push(value);
                self.chunks.push(chunk);
            }
        }
        index
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }
}

impl<T> Index<usize> for Chunks<T> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        &self.chunks[i >> CHUNK_BITS][i & (CHUNK - 1)]
    }
}

impl<T> IndexMut<usize> for Chunks<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.chunks[i >> CHUNK_BITS][i & (CHUNK - 1)]
    }
}

/// An arena slot: an object and its key; a free slot holds no object, and its key
/// field the next free slot.
struct Entry {
    key: KeyRef,
    object: Option<Object>,
}

/// A key: its bytes inline when it is short (the common case: no second cache miss
/// to compare it), else where they are in the shard's key arena. The last byte is the
/// inline length, or `SPILLED`.
#[derive(Clone, Copy)]
struct KeyRef([u8; 16]);

/// Longest key kept inline.
const INLINE: usize = 15;
const SPILLED: u8 = u8::MAX;

impl KeyRef {
    fn inline(key: &[u8]) -> KeyRef {
        let mut b = [0; 16];
        b[..key.len()].copy_from_slice(key);
        b[INLINE] = key.len() as u8;
        KeyRef(b)
    }

    /// Bytes `at..at + len` of the key arena (the master takes keys of at most
    /// `protocol::MAX_KEY_LEN` bytes; the length field holds up to 4 GiB).
    fn spilled(at: usize, len: usize) -> KeyRef {
        let mut b = [0; 16];
        b[..8].copy_from_slice(&(at as u64).to_le_bytes());
        b[8..12].copy_from_slice(&(len as u32).to_le_bytes());
        b[INLINE] = SPILLED;
        KeyRef(b)
    }

    /// A free slot's link to the next free one.
    fn link(next: u32) -> KeyRef {
        let mut b = [0; 16];
        b[..4].copy_from_slice(&next.to_le_bytes());
        KeyRef(b)
    }

    fn next_free(&self) -> u32 {
        u32::from_le_bytes([self.0[0], self.0[1], self.0[2], self.0[3]])
    }

    /// The key's range in the key arena, when it is there.
    fn span(&self) -> Option<std::ops::Range<usize>> {
        if self.0[INLINE] != SPILLED {
            return None;
        }
        let mut at = [0; 8];
        at.copy_from_slice(&self.0[..8]);
        let at = u64::from_le_bytes(at) as usize;
        let len = u32::from_le_bytes([self.0[8], self.0[9], self.0[10], self.0[11]]);
        Some(at..at + len as usize)
    }

    fn bytes<'a>(&'a self, arena: &'a [u8]) -> &'a [u8] {
        match self.span() {
            Some(span) => &arena[span],
            None => &self.0[..usize::from(self.0[INLINE])],
        }
    }
}

/// Dead key bytes below this are never worth a compaction.
const MIN_COMPACT: usize = 4096;
/// A compaction walks every slot, inline keys' too: it waits until this many dead
/// bytes per slot have piled up, so a shard of short keys with a few long ones
/// replaced over and over does not walk itself on every few removals (at most this
/// many bytes per object wasted).
const COMPACT_BYTES_PER_SLOT: usize = 4;

/// Objects by key.
pub(super) struct Table {
    /// Arena slots by the high half of the key's hash.
    index: SlotIndex,
    entries: Chunks<Entry>,
    /// First free arena slot (`NONE`: none).
    free: u32,
    keys: Vec<u8>,
    /// Bytes in `keys` no object refers to any more.
    dead_key_bytes: usize,
    hasher: RandomState,
}

impl Default for Table {
    fn default() -> Self {
        Table {
            index: SlotIndex::default(),
            entries: Chunks::default(),
            free: NONE,
            keys: Vec::new(),
            dead_key_bytes: 0,
            hasher: RandomState::new(),
        }
    }
}

impl Table {
    /// Objects held: one index entry each.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// The index tag of `key`, its home bucket asked into the cache.
    pub fn prefetch(&self, key: &str) -> u32 {
        let tag = self.tag(key);
        self.index.prefetch(tag);
        tag
    }

    fn tag(&self, key: &str) -> u32 {
        (self.hasher.hash_one(key) >> 32) as u32
    }

    fn key_bytes_of(&self, slot: u32) -> &[u8] {
        self.entries[slot as usize].key.bytes(&self.keys)
    }

    fn key_of(&self, slot: u32) -> &str {
        // Keys go in as `&str` and are copied whole, so every span holds UTF-8.
        std::str::from_utf8(self.key_bytes_of(slot)).unwrap_or_default()
    }

    /// The index bucket of `key`, and its arena slot.
    fn find(&self, key: &str) -> Option<(usize, u32)> {
        self.find_tagged(key, self.tag(key))
    }

    /// As `find`, `tag` being `key`'s (from `prefetch`).
    fn find_tagged(&self, key: &str, tag: u32) -> Option<(usize, u32)> {
        self.index
            .find(tag, |slot| self.key_bytes_of(slot) == key.as_bytes())
    }

    /// The arena slot of `key`.
    pub fn slot(&self, key: &str) -> Option<u32> {
        self.find(key).map(|(_, slot)| slot)
    }

    /// The arena slot of `key`, `tag` being its tag here (from `prefetch`).
    pub fn slot_tagged(&self, key: &str, tag: u32) -> Option<u32> {
        self.find_tagged(key, tag).map(|(_, slot)| slot)
    }

    /// The object in arena slot `slot`, if any.
    pub fn at(&self, slot: u32) -> Option<&Object> {
        let entries = &self.entries;
        ((slot as usize) < entries.len())
            .then(|| entries[slot as usize].object.as_ref())
            .flatten()
    }

    pub fn at_mut(&mut self, slot: u32) -> Option<&mut Object> {
        if (slot as usize) < self.entries.len() {
            self.entries[slot as usize].object.as_mut()
        } else {
            None
        }
    }

    /// The key of the object in `slot`, if any.
    pub fn key_at(&self, slot: u32) -> Option<&str> {
        self.at(slot).map(|_| self.key_of(slot))
    }

    pub fn get(&self, key: &str) -> Option<&Object> {
        self.slot(key).and_then(|s| self.at(s))
    }

    pub fn get_mut(&mut self, key: &str) -> Option<&mut Object> {
        self.slot(key).and_then(|s| self.at_mut(s))
    }

    /// Stores `o` under `key`; returns the object it replaced, if any.
    pub fn insert(&mut self, key: &str, o: Object) -> Option<Object> {
        if let Some(slot) = self.slot(key) {
            return self.at_mut(slot).map(|old| std::mem::replace(old, o));
        }
        let key_ref = if key.len() <= INLINE {
            KeyRef::inline(key.as_bytes())
        } else {
            let at = self.keys.len();
            self.keys.extend_from_slice(key.as_bytes());
            KeyRef::spilled(at, key.len())
        };
        let entry = Entry {
            key: key_ref,
            object: Some(o),
        };
        let slot = if self.free == NONE {
            self.entries.push(entry)
        } else {
            let slot = self.free;
            let e = &mut self.entries[slot as usize];
            self.free = e.key.next_free();
            *e = entry;
            slot
        };
        let tag = self.tag(key);
        self.index.insert(tag, slot);
        None
    }

    pub fn remove(&mut self, key: &str) -> Option<Object> {
        let (bucket, slot) = self.find(key)?;
        self.remove_at(bucket, slot)
    }

    /// Empties index bucket `bucket` and arena slot `slot` (which it names).
    fn remove_at(&mut self, bucket: usize, slot: u32) -> Option<Object> {
        self.index.remove_at(bucket);
        let e = &mut self.entries[slot as usize];
        let spilled = e.key.span().map_or(0, |span| span.len());
        let o = e.object.take();
        e.key = KeyRef::link(self.free);
        self.free = slot;
        self.dead_key_bytes += spilled;
        if self.len() == 0 {
            // Give everything back once empty (a shard that shrank a lot).
            *self = Table {
                hasher: std::mem::take(&mut self.hasher),
                ..Table::default()
            };
        } else if self.dead_key_bytes >= MIN_COMPACT
            && self.dead_key_bytes > self.keys.len() / 2
            && self.dead_key_bytes >= self.entries.len() * COMPACT_BYTES_PER_SLOT
        {
            self.compact_keys();
        }
        o
    }

    /// Copies the live spilled keys into a fresh arena, in slot order.
    fn compact_keys(&mut self) {
        let mut keys = Vec::with_capacity(self.keys.len() - self.dead_key_bytes);
        for i in 0..self.entries.len() {
            let e = &mut self.entries[i];
            if let Some(span) = e.key.span().filter(|_| e.object.is_some()) {
                e.key = KeyRef::spilled(keys.len(), span.len());
                keys.extend_from_slice(&self.keys[span]);
            }
        }
        self.keys = keys;
        self.dead_key_bytes = 0;
    }

    /// Every key and its object, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Object)> {
        self.entries.iter().filter_map(|e| {
            let o = e.object.as_ref()?;
            let key = std::str::from_utf8(e.key.bytes(&self.keys)).unwrap_or_default();
            Some((key, o))
        })
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.iter().map(|(k, _)| k)
    }

    /// Bytes the key arena holds, live or dead (for tests of its compaction).
    #[cfg(test)]
    fn key_bytes(&self) -> usize {
        self.keys.len()
    }
}

/// Unfinished-put slots listed before the list is pruned of finished ones between
/// sweeps (it then may grow to twice what it kept), so a master nobody sweeps stays
/// bounded.
const UNFINISHED_PRUNE_AT: usize = 4096;

/// One shard's objects and their eviction order.
#[derive(Default)]
pub(super) struct Shard {
    pub objects: Table,
    pub policy: Policy,
    /// Arena slots that were given an unfinished put ([`Shard::note_unfinished`]),
    /// so that the sweep for abandoned puts looks at these and not at every object
    /// (a master holds millions). A slot may be listed twice, or name a put that has
    /// since finished or a slot since reused: the sweep judges the object it finds.
    unfinished: Vec<u32>,
    prune_at: usize,
}

impl Shard {
    pub fn get(&self, key: &str) -> Option<&Object> {
        self.objects.get(key)
    }

    pub fn get_mut(&mut self, key: &str) -> Option<&mut Object> {
        self.objects.get_mut(key)
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.objects.keys()
    }

    /// Removes `key` from the table and from the victim order.
    pub fn remove(&mut self, key: &str) -> Option<Object> {
        let mut o = self.objects.remove(key)?;
        self.unlist(&mut o);
        Some(o)
    }

    /// Lists `key`'s slot as holding an unfinished put (called once per placeholder).
    pub fn note_unfinished(&mut self, key: &str) {
        let Some(slot) = self.objects.slot(key) else {
            return;
        };
        self.unfinished.push(slot);
        if self.unfinished.len() >= self.prune_at.max(UNFINISHED_PRUNE_AT) {
            self.sweep_unfinished(|_| false);
        }
    }

    /// Removes the unfinished puts `expired` condemns (each is judged once), and
    /// forgets the listed slots that hold no unfinished put any more; how many puts
    /// were removed. Costs the puts listed since the last sweep, not the table.
    pub fn sweep_unfinished(&mut self, mut expired: impl FnMut(&Object) -> bool) -> u64 {
        let mut listed = std::mem::take(&mut self.unfinished);
        listed.sort_unstable();
        listed.dedup();
        let mut doomed = Vec::new();
        listed.retain(|&slot| match self.objects.at(slot) {
            Some(o) if !o.complete => {
                if expired(o) {
                    doomed.push(slot);
                    return false;
                }
                true
            }
            _ => false,
        });
        if listed.capacity() > 4 * listed.len().max(UNFINISHED_PRUNE_AT) {
            listed.shrink_to(2 * listed.len());
        }
        self.prune_at = 2 * listed.len();
        self.unfinished = listed;
        let mut removed = 0;
        for slot in doomed {
            if let Some(key) = self.objects.key_at(slot).map(str::to_owned) {
                removed += u64::from(self.remove(&key).is_some());
            }
        }
        removed
    }

    /// Keeps the objects `keep` approves; the others leave the victim order too.
    pub fn retain(&mut self, mut keep: impl FnMut(&str, &mut Object) -> bool) {
        let mut doomed = Vec::new();
        for slot in 0..self.objects.entries.len() as u32 {
            let e = &mut self.objects.entries[slot as usize];
            let Some(o) = e.object.as_mut() else {
                continue;
            };
            let key = std::str::from_utf8(e.key.bytes(&self.objects.keys)).unwrap_or_default();
            // Both borrow disjoint fields of the table.
            if !keep(key, o) {
                doomed.push(key.to_owned());
            }
        }
        for key in doomed {
            self.remove(&key);
        }
    }

    /// Takes `o` out of the victim order (it stays in the table).
    pub fn unlist(&mut self, o: &mut Object) {
        if o.node != NONE {
            self.policy.remove(o.node);
            o.node = NONE;
        }
    }

    /// Counts a hit of the object in arena slot `slot` in the victim order, adding it
    /// there first if needed (only then is `hash` asked for its key's hash); objects
    /// that may never be evicted (unfinished, hard-pinned) stay out. True when it was
    /// added.
    pub fn hit_at(
        &mut self,
        slot: u32,
        hash: impl FnOnce() -> u64,
        floor: u64,
        seq: u32,
        gaps: &MeanGap,
    ) -> bool {
        let Some(o) = self.objects.at_mut(slot) else {
            return false;
        };
        if !o.complete || o.hard_pin {
            return false;
        }
        if o.node != NONE {
            self.policy.hit(o.node, floor, seq, gaps);
            return false;
        }
        o.node = self.policy.insert_hit(slot, hash(), floor, seq);
        true
    }

    /// Moves `key` to the back of level `floor`, below every object written or read
    /// since (its hits stay counted for its next read).
    pub fn sink(&mut self, key: &str, floor: u64, seq: u32) {
        if let Some(o) = self.objects.get(key) {
            if o.node != NONE {
                self.policy.requeue(o.node, floor, seq);
            }
        }
    }

    /// Removes evicted `key` (hashed to `hash`), leaving a ghost of its hits.
    pub fn evict(&mut self, key: &str, hash: u64) -> Option<Object> {
        let mut o = self.objects.remove(key)?;
        if o.node != NONE {
            self.policy.evicted(o.node, hash);
            o.node = NONE;
        }
        Some(o)
    }
}

#[cfg(test)]
mod tests {
    use super::super::replicas::Replicas;
    use super::*;

    fn object(size: u64) -> Object {
        Object {
            size,
            crc32c: 0,
            complete: true,
            pending: None,
            replicas: Replicas::default(),
            lease_until_ms: 0,
            node: NONE,
            hard_pin: false,
            soft_pin_until_ms: 0,
            groups: Box::default(),
            version: 0,
            disk: None,
        }
    }

    fn size_of(t: &Table, key: &str) -> Option<u64> {
        t.get(key).map(|o| o.size)
    }

    #[test]
    fn an_object_and_its_slot_fit_the_memory_budget() {
        // bench/README.md: ≤ 200 bytes per object at 10M objects, of which the arena
        // slot takes this much and the index, key bytes and victim order the rest.
        let slot = std::mem::size_of::<Entry>();
        assert!(slot <= 128, "arena slot of {slot} bytes");
    }

    #[test]
    fn insert_get_remove_and_a_freed_slot_is_reused() {
        let mut t = Table::default();
        assert!(t.insert("a", object(1)).is_none());
        assert!(t.insert("b", object(2)).is_none());
        assert_eq!(
            (size_of(&t, "a"), size_of(&t, "b"), t.len()),
            (Some(1), Some(2), 2)
        );
        assert_eq!(size_of(&t, "c"), None);
        let a = t.slot("a").unwrap();
        assert_eq!(t.remove("a").map(|o| o.size), Some(1));
        assert_eq!((size_of(&t, "a"), t.len(), t.key_at(a)), (None, 1, None));
        assert!(t.remove("a").is_none());
        t.insert("c", object(3));
        assert_eq!(t.slot("c"), Some(a), "the freed slot goes first");
        assert_eq!(t.key_at(a), Some("c"));
        assert_eq!(t.entries.len(), 2);
        assert_eq!(size_of(&t, "b"), Some(2));
    }

    #[test]
    fn a_key_removed_and_put_again_holds_the_new_object() {
        let mut t = Table::default();
        t.insert("k", object(1));
        t.insert("other", object(9));
        t.remove("k");
        t.insert("k", object(2));
        assert_eq!(size_of(&t, "k"), Some(2));
        // Putting a key held replaces its object in place.
        let slot = t.slot("k");
        assert_eq!(t.insert("k", object(3)).map(|o| o.size), Some(2));
        assert_eq!((size_of(&t, "k"), t.slot("k"), t.len()), (Some(3), slot, 2));
    }

    /// A tag taken by `prefetch` finds what `slot` finds, also after the index grew and
    /// after the table emptied and started again (the hasher stays).
    #[test]
    fn a_prefetched_tag_finds_the_key_through_growth_and_reset() {
        let mut t = Table::default();
        t.insert("k", object(1));
        let tag = t.prefetch("k");
        assert_eq!(t.slot_tagged("k", tag), t.slot("k"));
        assert_eq!(t.slot_tagged("absent", t.prefetch("absent")), None);
        for i in 0..1000 {
            t.insert(&format!("more/{i}"), object(i));
        }
        assert_eq!(t.slot_tagged("k", tag), t.slot("k"));
        assert!(t.slot("k").is_some());
        for i in 0..1000 {
            t.remove(&format!("more/{i}"));
        }
        t.remove("k");
        assert_eq!(t.len(), 0);
        t.insert("k", object(2));
        assert_eq!(t.slot_tagged("k", tag), t.slot("k"));
        assert_eq!(size_of(&t, "k"), Some(2));
    }

    #[test]
    fn growth_across_chunks_moves_nothing() {
        let mut t = Table::default();
        let n = 3 * CHUNK + 7;
        let first = {
            t.insert("key/0", object(0));
            t.slot("key/0").unwrap()
        };
        for i in 1..n {
            t.insert(&format!("key/{i}"), object(i as u64));
        }
        assert_eq!(t.entries.chunks.len(), 4);
        assert!(t.entries.chunks.iter().all(|c| c.capacity() == CHUNK));
        assert_eq!(t.slot("key/0"), Some(first));
        for i in 0..n {
            let key = format!("key/{i}");
            let slot = t.slot(&key).unwrap();
            assert_eq!(t.key_at(slot), Some(key.as_str()));
            assert_eq!(t.at(slot).map(|o| o.size), Some(i as u64));
        }
        assert!(
            t.index.buckets() * 3 >= t.len() * 4,
            "index at most 3/4 full"
        );
    }

    #[test]
    fn many_keys_in_and_out() {
        let mut t = Table::default();
        let n = 100_000u64;
        for i in 0..n {
            t.insert(&format!("block/{i}"), object(i));
        }
        for i in (0..n).step_by(2) {
            assert_eq!(t.remove(&format!("block/{i}")).map(|o| o.size), Some(i));
        }
        assert_eq!(t.len(), n as usize / 2);
        for i in 0..n {
            let want = (i % 2 == 1).then_some(i);
            assert_eq!(size_of(&t, &format!("block/{i}")), want, "key {i}");
        }
        // Put back: every freed slot is used again, no arena growth.
        let slots = t.entries.len();
        for i in (0..n).step_by(2) {
            t.insert(&format!("again/{i}"), object(i + 1));
        }
        assert_eq!(t.entries.len(), slots);
        assert_eq!(t.len(), n as usize);
        assert_eq!(t.keys().count(), n as usize);
        assert_eq!(size_of(&t, "again/8"), Some(9));
    }

    #[test]
    fn empty_short_and_longest_keys() {
        let mut t = Table::default();
        let long = "x".repeat(u16::MAX as usize);
        let almost = "x".repeat(u16::MAX as usize - 1);
        // The longest inline key, the shortest in the arena, and a multi-byte one.
        let (inline, spilled, wide) = ("y".repeat(INLINE), "y".repeat(INLINE + 1), "ключ/é");
        let keys = ["", long.as_str(), &almost, &inline, &spilled, wide];
        for (i, k) in keys.iter().enumerate() {
            t.insert(k, object(i as u64));
        }
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(size_of(&t, k), Some(i as u64), "key of {} bytes", k.len());
            assert_eq!(t.key_at(t.slot(k).unwrap()), Some(*k));
        }
        assert_eq!(t.key_bytes(), long.len() + almost.len() + spilled.len());
        let mut lens: Vec<usize> = t.keys().map(str::len).collect();
        lens.sort();
        assert_eq!(
            lens,
            [
                0,
                wide.len(),
                INLINE,
                INLINE + 1,
                long.len() - 1,
                long.len()
            ]
        );
        assert_eq!(t.remove(&long).map(|o| o.size), Some(1));
        assert_eq!(t.remove(&inline).map(|o| o.size), Some(3));
        assert_eq!(size_of(&t, &almost), Some(2));
        assert_eq!(size_of(&t, &spilled), Some(4));
        assert_eq!(size_of(&t, &"y".repeat(INLINE - 1)), None);
    }

    #[test]
    fn dead_key_bytes_are_compacted_away() {
        let mut t = Table::default();
        let key = |i: usize| format!("{i:0>100}");
        for i in 0..1000 {
            t.insert(&key(i), object(i as u64));
        }
        assert_eq!(t.key_bytes(), 100_000);
        // Churn: keys come and go many times over; the arena stays near the live keys.
        for round in 0..20 {
            for i in 0..900 {
                t.remove(&key(i));
            }
            for i in 0..900 {
                t.insert(&key(i), object((round * 1000 + i) as u64));
            }
            assert!(
                t.key_bytes() <= 2 * 100_000 + MIN_COMPACT,
                "{} key bytes",
                t.key_bytes()
            );
        }
        for i in 0..1000 {
            let want = if i < 900 { 19_000 + i } else { i };
            assert_eq!(size_of(&t, &key(i)), Some(want as u64), "key {i}");
        }
        // Dead bytes never outnumber the live ones for long.
        for i in 0..600 {
            t.remove(&key(i));
            let live = t.key_bytes() - t.dead_key_bytes;
            assert_eq!(live, (999 - i) * 100);
            assert!(t.dead_key_bytes <= live.max(MIN_COMPACT), "{i}");
        }
        for i in 600..1000 {
            assert!(t.get(&key(i)).is_some());
        }
    }

    #[test]
    fn an_emptied_table_gives_its_memory_back() {
        let mut t = Table::default();
        for i in 0..2000 {
            t.insert(&format!("k{i}"), object(i));
        }
        for i in 0..2000 {
            t.remove(&format!("k{i}"));
        }
        assert_eq!(
            (t.len(), t.entries.len(), t.index.buckets(), t.key_bytes()),
            (0, 0, 0, 0)
        );
        t.insert("k1", object(7));
        assert_eq!(size_of(&t, "k1"), Some(7));
    }

    fn unfinished(size: u64) -> Object {
        Object {
            complete: false,
            ..object(size)
        }
    }

    #[test]
    fn the_sweep_judges_only_unfinished_puts_and_removes_the_condemned() {
        let mut s = Shard::default();
        for i in 0..100u64 {
            s.objects.insert(&format!("done{i}"), object(i));
        }
        for i in 0..10u64 {
            let key = format!("u{i}");
            s.objects.insert(&key, unfinished(i));
            s.note_unfinished(&key);
        }
        // u0 finishes; u1 is put again (listed twice); u2 is removed and its slot reused.
        s.get_mut("u0").unwrap().complete = true;
        s.note_unfinished("u1");
        s.remove("u2");
        s.objects.insert("late", object(2));
        let mut judged = Vec::new();
        let removed = s.sweep_unfinished(|o| {
            judged.push(o.size);
            o.size % 2 == 1
        });
        judged.sort();
        // Each unfinished put judged once; no complete object looked at.
        assert_eq!(judged, [1, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(removed, 5);
        for (key, kept) in [("u1", false), ("u3", false), ("u4", true), ("u9", false)] {
            assert_eq!(s.get(key).is_some(), kept, "{key}");
        }
        assert!(s.get("u0").is_some() && s.get("late").is_some() && s.get("done1").is_some());
        // The survivors stay listed, the rest are forgotten.
        let mut again = Vec::new();
        assert_eq!(
            s.sweep_unfinished(|o| {
                again.push(o.size);
                true
            }),
            3
        );
        again.sort();
        assert_eq!(again, [4, 6, 8]);
        assert_eq!(s.sweep_unfinished(|_| true), 0);
        assert_eq!(s.len(), 102);
    }

    #[test]
    fn the_unfinished_list_stays_bounded_without_sweeps() {
        let mut s = Shard::default();
        for i in 0..50_000u64 {
            let key = format!("k{i}");
            s.objects.insert(&key, unfinished(i));
            s.note_unfinished(&key);
            s.get_mut(&key).unwrap().complete = true;
        }
        assert!(
            s.unfinished.len() <= UNFINISHED_PRUNE_AT,
            "{}",
            s.unfinished.len()
        );
        // Unfinished puts are never pruned away before a sweep judges them.
        for i in 0..3u64 {
            let key = format!("open{i}");
            s.objects.insert(&key, unfinished(i));
            s.note_unfinished(&key);
        }
        for i in 0..10_000u64 {
            s.note_unfinished(&format!("k{i}"));
        }
        assert_eq!(s.sweep_unfinished(|_| true), 3);
        assert_eq!(s.len(), 50_000);
    }

    #[test]
    fn retain_drops_the_rejected_from_table_and_order() {
        let mut s = Shard::default();
        for i in 0..10u64 {
            let key = format!("k{i}");
            s.objects.insert(&key, object(i));
            let slot = s.objects.slot(&key).unwrap();
            assert!(s.hit_at(slot, || i, 0, i as u32, &MeanGap::default()));
        }
        assert_eq!(s.policy.len(), 10);
        s.retain(|_, o| o.size % 3 == 0);
        assert_eq!((s.len(), s.policy.len()), (4, 4));
        let mut kept: Vec<&str> = s.keys().collect();
        kept.sort();
        assert_eq!(kept, ["k0", "k3", "k6", "k9"]);
        // The victim order names the kept objects by their slots, lowest first.
        let (_, node) = s.policy.head().unwrap();
        let slot = s.policy.slot(node).unwrap();
        assert_eq!(s.objects.key_at(slot), Some("k0"));
    }
}
