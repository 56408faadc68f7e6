//! Victim order of one shard: frequency with aging, in O(1) per operation.
//!
//! An evictable object sits at a priority *level* `floor + weight(hits)`: `floor` is
//! the pool's age, shared by all shards (the level of the last victim, or higher as
//! objects are listed: `eviction.rs`), and `weight`
//! grows sublinearly with the object's hit count, so many hits buy a longer stay but
//! not a permanent one. An object nobody touches sinks as the floor rises past it;
//! one-time objects (a scan) enter at the lowest weight and go first. Victims come
//! from the lowest level, oldest first.
//!
//! Levels are the buckets of a ring of intrusive lists (a calendar queue): insert,
//! move, remove and pop are O(1), apart from stepping over at most `RING` empty
//! buckets. Each object counts its hits; a small table of ghosts (key fingerprint and
//! hit count of evicted objects) gives an object written again soon after its
//! eviction its history back.
//!
//! An object read again after a clearly longer wait than objects typically leave
//! between two touches earns a longer stay: its next read is likely to come as late (on
//! the conversation trace the next gap grows with the last one, while the chance of a
//! next read does not fall), and frequency alone would let it sink first.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;

use super::table::Chunks;

/// Levels per unit of weight: weights are quantized to 1/`STEPS`.
const STEPS: f64 = 8.0;
/// Hit counts saturate here.
const MAX_HITS: u8 = 255;
/// Buckets in the ring; more than the largest weight, so every level a touch can ask
/// for lies within one turn of the ring above the floor.
const RING: usize = 512;
/// "No node": the end of a list, or an object not in the policy.
pub(super) const NONE: u32 = u32::MAX;

/// Weight of an object with `hits` hits, in levels: `STEPS × hits^0.6` (the exponent
/// was chosen on the conversation trace; see bench/README.md).
fn weight(hits: u8) -> u64 {
    static TABLE: OnceLock<[u16; 256]> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        std::array::from_fn(|h| (STEPS * (h.max(1) as f64).powf(0.6)).round() as u16)
    });
    u64::from(table[usize::from(hits)])
}

/// Ghost slots per listed object: history pays when it covers the keys that come back,
/// many times more than the pool holds (measured on the conversation trace).
const GHOSTS_PER_OBJECT: usize = 256;
/// At most this many ghost slots per shard (8 bytes each): 32 MiB for 64 shards, so
/// a master of millions of objects spends a few bytes per object on them.
const MAX_GHOSTS: usize = 1 << 16;

/// The largest weight, the level skipped objects are moved to above the floor.
fn max_weight() -> u64 {
    weight(MAX_HITS)
}

/// Samples after which the mean gap becomes a moving average of about this many.
const GAP_SAMPLES: u32 = 4096;

/// The mean gap between two touches of an object, measured on the insertion-order
/// clock (touches of all objects in between, so it follows the load, not the wall
/// clock), over about the last `GAP_SAMPLES` hits of all shards, which share it.
#[derive(Default)]
pub(super) struct MeanGap {
    /// The mean, as `f64` bits.
    mean: AtomicU64,
    /// Samples so far, up to `GAP_SAMPLES`.
    samples: AtomicU32,
}

impl MeanGap {
    /// Adds a gap of `gap` touches; returns the new mean. Load and store are separate:
    /// a sample lost to a concurrent hit only makes the mean a little less exact.
    pub fn add(&self, gap: f64) -> f64 {
        let n = self.samples.load(Ordering::Relaxed);
        if n < GAP_SAMPLES {
            self.samples.store(n + 1, Ordering::Relaxed);
        }
        // An exact mean over the first samples, then an exponential moving average.
        let rate = 1.0 / f64::from((n + 1).min(GAP_SAMPLES));
        let old = f64::from_bits(self.mean.load(Ordering::Relaxed));
        let mean = old + (gap - old) * rate;
        self.mean.store(mean.to_bits(), Ordering::Relaxed);
        mean
    }
}

/// A gap is long above this multiple of the mean gap.
const LONG_GAP: f64 = 1.25;

/// The weight of an object hit after `gap` touches where the mean gap is `mean`: a
/// long gap stretches the weight by the square root of its ratio to a long gap's
/// bound, up to the largest weight (bound and root chosen on the conversation trace,
/// bench/README.md).
fn stretched(weight: u64, gap: f64, mean: f64) -> u64 {
    let long = LONG_GAP * mean;
    if gap <= long || long <= 0.0 {
        return weight;
    }
    let w = (weight as f64 * (gap / long).sqrt()).round() as u64;
    w.min(max_weight())
}

struct Node {
    /// The object's slot in the table's arena, for the table to find a victim;
    /// `NONE` in a free node.
    slot: u32,
    prev: u32,
    next: u32,
    /// Insertion order, to break ties between shards (wrapping).
    seq: u32,
    /// The ring bucket the node is in.
    bucket: u16,
    /// Hits so far (the put that wrote it counts as one), saturating.
    hits: u8,
}

#[derive(Clone, Copy)]
struct List {
    head: u32,
    tail: u32,
}

const EMPTY: List = List {
    head: NONE,
    tail: NONE,
};

/// The lowest entry of a policy: (level, insertion order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Head {
    pub level: u64,
    pub seq: u32,
}

impl Head {
    /// Whether `self` goes before `other` (lower level, then older).
    pub fn before(&self, other: &Head) -> bool {
        self.level < other.level
            || (self.level == other.level && (self.seq.wrapping_sub(other.seq) as i32) < 0)
    }
}

/// What [`Policy::lowest_where`] found.
pub(super) enum Lowest {
    /// The entry, and its node.
    Found(Head, u32),
    /// None accepted within the limit: the lowest entry's node.
    Blocked(u32),
    /// None accepted at all.
    None,
}

/// The answer of a shard's last look for a victim (see [`Policy::remember_lowest`]).
#[derive(Clone, Copy)]
struct Remembered {
    /// The lowest evictable entry and its node, if any.
    found: Option<(Head, u32)>,
    /// Whether soft-pinned objects counted as evictable.
    soft: bool,
    /// When the first entry passed over below it becomes evictable (a lease or pin
    /// running out), in the master clock's milliseconds.
    until_ms: u64,
}

/// One shard's victim order and hit history.
pub(super) struct Policy {
    nodes: Chunks<Node>,
    /// Free node slots, linked through `next`.
    free: u32,
    ring: Box<[List; RING]>,
    /// No node lies below this level; bucket `base % RING` is the lowest.
    base: u64,
    /// No node lies above this level.
    top: u64,
    len: usize,
    ghosts: Ghosts,
    /// Forgotten whenever a node moves.
    remembered: Option<Remembered>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            nodes: Chunks::default(),
            free: NONE,
            ring: Box::new([EMPTY; RING]),
            base: 0,
            top: 0,
            len: 0,
            ghosts: Ghosts::default(),
            remembered: None,
        }
    }
}

impl Policy {
    /// Objects in the order.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Counts a hit of node `id` and moves it to the level that earns now: by its
    /// hits, stretched if it waited longer than `gaps`' mean since its last touch.
    pub fn hit(&mut self, id: u32, floor: u64, seq: u32, gaps: &MeanGap) {
        let n = &mut self.nodes[id as usize];
        n.hits = n.hits.saturating_add(1);
        // The node's insertion order is the clock's reading at its last touch (or move).
        let gap = f64::from(seq.wrapping_sub(n.seq));
        let mean = gaps.add(gap);
        let level = floor + stretched(weight(n.hits), gap, mean);
        self.requeue(id, level, seq);
    }

    /// Adds the object in table slot `slot` (its key hashed to `hash`) with its first
    /// hit, or with its ghost's hits and one more; returns its node.
    pub fn insert_hit(&mut self, slot: u32, hash: u64, floor: u64, seq: u32) -> u32 {
        let hits = self.ghosts.recall(hash).saturating_add(1);
        let id = self.insert(slot, floor + weight(hits), seq);
        self.nodes[id as usize].hits = hits;
        id
    }

    /// Drops evicted node `id` (its key hashed to `hash`), leaving a ghost of its hits.
    pub fn evicted(&mut self, id: u32, hash: u64) {
        let hits = self.nodes[id as usize].hits;
        let room = (self.len * GHOSTS_PER_OBJECT).min(MAX_GHOSTS);
        self.ghosts.remember(hash, hits, room);
        self.remove(id);
    }

    /// The level for an object that must be passed over (leased or pinned): as high
    /// as any hit could put it.
    pub fn top(floor: u64) -> u64 {
        floor + max_weight()
    }

    /// Adds the object in table slot `slot` at `level`; returns its node.
    pub fn insert(&mut self, slot: u32, level: u64, seq: u32) -> u32 {
        let node = Node {
            slot,
            prev: NONE,
            next: NONE,
            seq,
            bucket: 0,
            hits: 1,
        };
        let id = if self.free == NONE {
            self.nodes.push(node)
        } else {
            let id = self.free;
            self.free = self.nodes[id as usize].next;
            self.nodes[id as usize] = node;
            id
        };
        if self.len == 0 {
            (self.base, self.top) = (level, level);
        }
        self.len += 1;
        self.link(id, level);
        id
    }

    /// Moves `id` to the back of `level`, with a new insertion order.
    pub fn requeue(&mut self, id: u32, level: u64, seq: u32) {
        self.unlink(id);
        self.nodes[id as usize].seq = seq;
        self.link(id, level);
    }

    /// Drops `id` from the order.
    pub fn remove(&mut self, id: u32) {
        self.unlink(id);
        let n = &mut self.nodes[id as usize];
        n.slot = NONE;
        n.next = self.free;
        self.free = id;
        self.len -= 1;
        // Give back slack once the slots are mostly free (an order that shrank a lot).
        if self.len == 0 && self.nodes.len() > 1024 {
            self.nodes = Chunks::default();
            self.free = NONE;
        }
    }

    /// The lowest entry, if any.
    pub fn head(&mut self) -> Option<(Head, u32)> {
        if self.len == 0 {
            return None;
        }
        // Bounded: some bucket within one turn of the ring holds a node.
        for _ in 0..RING {
            let list = self.ring[self.base as usize % RING];
            if list.head != NONE {
                let seq = self.nodes[list.head as usize].seq;
                let head = Head {
                    level: self.base,
                    seq,
                };
                return Some((head, list.head));
            }
            self.base += 1;
        }
        None
    }

    /// The lowest entry whose table slot `pick` accepts, looking at no more than
    /// `limit` entries from the bottom.
    pub fn lowest_where(&mut self, limit: usize, mut pick: impl FnMut(u32) -> bool) -> Lowest {
        let Some((first, lowest)) = self.head() else {
            return Lowest::None;
        };
        let (mut level, mut id) = (first.level, lowest);
        for _ in 0..limit {
            let n = &self.nodes[id as usize];
            if n.slot != NONE && pick(n.slot) {
                return Lowest::Found(Head { level, seq: n.seq }, id);
            }
            let mut next = n.next;
            // Bounded: the nodes lie within one turn of the ring.
            while next == NONE {
                level += 1;
                if level >= self.base + RING as u64 {
                    return Lowest::None;
                }
                next = self.ring[level as usize % RING].head;
            }
            id = next;
        }
        Lowest::Blocked(lowest)
    }

    /// Keeps the answer of a look for a victim: the lowest evictable entry (`found`)
    /// under `soft`'s rule, the entries passed over below it evictable from
    /// `until_ms` on. A pool that evicts looks at every shard for each victim; most
    /// shards did not change since their last look.
    pub fn remember_lowest(&mut self, found: Option<(Head, u32)>, soft: bool, until_ms: u64) {
        self.remembered = Some(Remembered {
            found,
            soft,
            until_ms,
        });
    }

    /// Drops the kept answer.
    pub fn forget_lowest(&mut self) {
        self.remembered = None;
    }

    /// The kept answer, if no node moved since and nothing passed over became
    /// evictable by `now_ms`. The entry's object may have been leased or pinned
    /// meanwhile without moving (a group member): callers that evict check it.
    pub fn remembered_lowest(&self, now_ms: u64, soft: bool) -> Option<Option<(Head, u32)>> {
        self.remembered
            .filter(|r| r.soft == soft && now_ms < r.until_ms)
            .map(|r| r.found)
    }

    /// The table slot of node `id`'s object.
    pub fn slot(&self, id: u32) -> Option<u32> {
        Some(self.nodes[id as usize].slot).filter(|s| *s != NONE)
    }

    fn link(&mut self, id: u32, level: u64) {
        self.forget_lowest();
        // Below the lowest: the ring turns down as far as the highest node allows
        // (one turn); lower still shares the lowest level, behind its nodes.
        if level < self.base {
            self.base = level.max(self.top.saturating_sub(RING as u64 - 1));
        }
        let level = level.max(self.base);
        self.top = self.top.max(level);
        // Keep the ring one turn wide: fold the lowest buckets upwards (their nodes
        // stay the oldest of the new lowest level).
        while level >= self.base + RING as u64 {
            let low = self.base as usize % RING;
            let next = (self.base + 1) as usize % RING;
            self.splice_before(low, next);
            self.base += 1;
        }
        let b = level as usize % RING;
        let tail = self.ring[b].tail;
        {
            let n = &mut self.nodes[id as usize];
            n.bucket = b as u16;
            n.prev = tail;
            n.next = NONE;
        }
        if tail == NONE {
            self.ring[b].head = id;
        } else {
            self.nodes[tail as usize].next = id;
        }
        self.ring[b].tail = id;
    }

    fn unlink(&mut self, id: u32) {
        self.forget_lowest();
        let (prev, next, b) = {
            let n = &self.nodes[id as usize];
            (n.prev, n.next, n.bucket as usize)
        };
        if prev == NONE {
            self.ring[b].head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NONE {
            self.ring[b].tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }

    /// Moves every node of bucket `from` to the front of bucket `to`.
    fn splice_before(&mut self, from: usize, to: usize) {
        let src = self.ring[from];
        if src.head == NONE {
            return;
        }
        let mut id = src.head;
        while id != NONE {
            // Relabel. Rare: victims are the lowest of all shards, so the floor stays
            // at or below every shard's lowest node and new levels stay within a turn.
            self.nodes[id as usize].bucket = to as u16;
            id = self.nodes[id as usize].next;
        }
        let dst = self.ring[to];
        if dst.head == NONE {
            self.ring[to] = src;
        } else {
            self.nodes[src.tail as usize].next = dst.head;
            self.nodes[dst.head as usize].prev = src.tail;
            self.ring[to].head = src.head;
        }
        self.ring[from] = EMPTY;
    }
}

/// Hit counts of evicted objects by key hash: a table of (tag, hits) in buckets of
/// `WAYS` slots, a few slots per listed object. A ghost goes to its bucket's empty or
/// oldest slot, so one is lost only once `WAYS` newer ones landed in its bucket (one
/// slot per bucket would lose a ghost to the first, and each lost ghost costs hits on
/// the conversation trace: bench/README.md). A tag that differs means "no history",
/// so collisions lose history but never invent it. The bucket is named by the tag's
/// low bits, so a table that grows with its shard keeps every ghost.
#[derive(Default)]
struct Ghosts {
    slots: Vec<Ghost>,
    /// Ghosts remembered so far (wrapping): the slots' ages.
    clock: u16,
}

/// Slots per bucket.
const WAYS: usize = 4;

#[derive(Clone, Copy, Default)]
struct Ghost {
    /// High hash bits; 0 = empty.
    tag: u32,
    /// `Ghosts::clock` when remembered.
    stamp: u16,
    hits: u8,
}

impl Ghosts {
    fn tag(hash: u64) -> u32 {
        // Remix: the shard index already took the hash's low bits.
        let h = hash.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((h >> 32) as u32).max(1)
    }

    /// The slots of `tag`'s bucket.
    fn bucket(&mut self, tag: u32) -> &mut [Ghost] {
        let first = tag as usize & (self.slots.len() - 1) & !(WAYS - 1);
        &mut self.slots[first..first + WAYS]
    }

    fn remember(&mut self, hash: u64, hits: u8, room: usize) {
        let want = room.max(WAYS * 4).next_power_of_two();
        if self.slots.len() < want {
            let old = std::mem::replace(&mut self.slots, vec![Ghost::default(); want]);
            let mut old: Vec<Ghost> = old.into_iter().filter(|g| g.tag != 0).collect();
            // Oldest first, so that where a bucket overflows the newest stay.
            old.sort_by_key(|g| std::cmp::Reverse(self.clock.wrapping_sub(g.stamp)));
            for g in old {
                self.place(g);
            }
        }
        self.clock = self.clock.wrapping_add(1);
        let ghost = Ghost {
            tag: Self::tag(hash),
            stamp: self.clock,
            hits,
        };
        self.place(ghost);
    }

    /// Puts `ghost` in its bucket: over an older ghost of the same key, else in an
    /// empty slot, else over the oldest.
    fn place(&mut self, ghost: Ghost) {
        let clock = self.clock;
        let bucket = self.bucket(ghost.tag);
        let age = |g: &Ghost| match g.tag {
            t if t == ghost.tag => u32::MAX,
            0 => u32::MAX - 1,
            _ => u32::from(clock.wrapping_sub(g.stamp)),
        };
        if let Some(slot) = bucket.iter_mut().max_by_key(|g| age(g)) {
            *slot = ghost;
        }
    }

    /// The hits of the ghost of `hash` (0 without one), which it leaves.
    fn recall(&mut self, hash: u64) -> u8 {
        if self.slots.is_empty() {
            return 0;
        }
        let tag = Self::tag(hash);
        match self.bucket(tag).iter_mut().find(|g| g.tag == tag) {
            Some(g) => std::mem::take(g).hits,
            None => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table slot of the object named `i` in these tests.
    fn key(i: u32) -> u32 {
        i
    }

    fn pop(p: &mut Policy) -> Option<String> {
        let (_, id) = p.head()?;
        let k = format!("k{}", p.slot(id)?);
        p.remove(id);
        Some(k)
    }

    #[test]
    fn lowest_level_first_then_oldest() {
        let mut p = Policy::default();
        p.insert(key(0), 10, 0);
        p.insert(key(1), 5, 1);
        p.insert(key(2), 10, 2);
        let id3 = p.insert(key(3), 5, 3);
        p.requeue(id3, 12, 4);
        assert_eq!(p.len(), 4);
        let order: Vec<_> = std::iter::from_fn(|| pop(&mut p)).collect();
        assert_eq!(order, ["k1", "k0", "k2", "k3"]);
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn a_rising_floor_folds_old_levels_without_reordering() {
        let mut p = Policy::default();
        p.insert(key(0), 0, 0);
        p.insert(key(1), 3, 1);
        // Far above one turn of the ring: the old nodes fold into the lowest bucket,
        // oldest level first.
        p.insert(key(2), 10 * RING as u64, 2);
        p.insert(key(3), 10 * RING as u64 - 1, 3);
        let order: Vec<_> = std::iter::from_fn(|| pop(&mut p)).collect();
        assert_eq!(order, ["k0", "k1", "k3", "k2"]);
    }

    #[test]
    fn freed_slots_are_reused() {
        let mut p = Policy::default();
        let a = p.insert(key(0), 1, 0);
        p.remove(a);
        let b = p.insert(key(1), 1, 1);
        assert_eq!(a, b);
        assert_eq!(p.nodes.len(), 1);
    }

    #[test]
    fn hits_raise_the_level_sublinearly_and_ghosts_remember_them() {
        let mut p = Policy::default();
        let a = p.insert_hit(key(0), 42, 100, 0);
        let b = p.insert_hit(key(1), 43, 100, 1);
        let gaps = MeanGap::default();
        for seq in 2..6 {
            p.hit(a, 100, seq, &gaps);
        }
        // Five hits against one: `a` sits higher, so `b` goes first.
        assert_eq!(pop(&mut p).as_deref(), Some("k1"));
        assert_eq!(p.head().map(|(h, _)| h.level), Some(100 + weight(5)));
        assert!(weight(200) < 200 * weight(1) / 4, "sublinear");
        assert!(max_weight() < RING as u64);
        let _ = b;
        // Evicted with its five hits, written again: it comes back with six.
        p.evicted(a, 42);
        let again = p.insert_hit(key(0), 42, 100, 7);
        assert_eq!(p.nodes[again as usize].hits, 6);
        // A ghost is recalled once; another key finds none.
        p.evicted(again, 42);
        assert_eq!(p.ghosts.recall(42), 6);
        assert_eq!(p.ghosts.recall(42), 0);
        assert_eq!(p.ghosts.recall(44), 0);
    }

    #[test]
    fn a_hit_after_a_long_wait_earns_a_longer_stay() {
        let gaps = MeanGap::default();
        // The first samples average exactly: objects come back 10 touches apart.
        for gap in [5.0, 15.0] {
            gaps.add(gap);
        }
        assert_eq!(gaps.add(10.0), 10.0);
        let mut p = Policy::default();
        let slow = p.insert_hit(key(1), 2, 100, 0);
        let prompt = p.insert_hit(key(0), 1, 100, 395);
        // Both hit a second time, the slow one first (so older among equals), after a
        // long wait; the other after a typical one.
        p.hit(slow, 100, 400, &gaps);
        p.hit(prompt, 100, 405, &gaps);
        assert_eq!(p.nodes[slow as usize].hits, p.nodes[prompt as usize].hits);
        // Same hits, yet the one that waited long stays longer.
        assert_eq!(pop(&mut p).as_deref(), Some("k0"));
        let (head, _) = p.head().unwrap();
        assert!(head.level > 100 + weight(2), "long gap stretched");
        assert!(head.level <= 100 + max_weight());
        // A gap up to a long gap's bound changes nothing; the stretch has a ceiling.
        assert_eq!(stretched(weight(2), LONG_GAP * 10.0, 10.0), weight(2));
        assert_eq!(
            stretched(weight(2), 4.0 * LONG_GAP * 10.0, 10.0),
            2 * weight(2)
        );
        assert_eq!(stretched(weight(200), 1e9, 10.0), max_weight());
        assert_eq!(stretched(weight(2), 40.0, 0.0), weight(2), "no mean yet");
    }

    #[test]
    fn ghosts_survive_the_table_growing() {
        let mut g = Ghosts::default();
        let hash = |i: u64| i.wrapping_mul(0xD6E8_FEB8_6659_FD93) ^ (i << 7);
        // Remembered into a small table, recalled from one 64 times larger.
        for i in 0..200u64 {
            g.remember(hash(i), i as u8 + 1, 256);
        }
        g.remember(hash(1000), 1, 1 << 14);
        assert_eq!(g.slots.len(), 1 << 14);
        // A key remembered twice keeps one ghost, the newer.
        g.remember(hash(1000), 9, 1 << 14);
        assert_eq!(
            g.slots
                .iter()
                .filter(|s| s.tag == Ghosts::tag(hash(1000)))
                .count(),
            1
        );
        let kept = (0..200u64)
            .filter(|&i| g.recall(hash(i)) == i as u8 + 1)
            .count();
        // Only overflowing buckets of the 256-slot table lost ghosts.
        assert!(kept >= 170, "{kept} of 200 ghosts kept");
        assert_eq!(g.recall(hash(1000)), 9);
    }

    #[test]
    fn a_full_bucket_forgets_its_oldest_ghost() {
        let mut g = Ghosts::default();
        g.remember(1, 1, 16);
        let bucket = |g: &Ghosts, h: u64| (Ghosts::tag(h) as usize & (g.slots.len() - 1)) / WAYS;
        let first = bucket(&g, 1);
        let same: Vec<u64> = (2..100_000u64)
            .filter(|&h| bucket(&g, h) == first)
            .take(WAYS)
            .collect();
        assert_eq!(same.len(), WAYS);
        for (n, &h) in same.iter().enumerate() {
            g.remember(h, n as u8 + 2, 16);
        }
        // Five ghosts for four slots: the first one remembered is the one lost.
        assert_eq!(g.recall(1), 0);
        for (n, &h) in same.iter().enumerate() {
            assert_eq!(g.recall(h), n as u8 + 2);
        }
    }

    #[test]
    fn ties_between_shards_go_to_the_older() {
        let a = Head { level: 3, seq: 7 };
        let b = Head { level: 3, seq: 9 };
        let c = Head { level: 2, seq: 100 };
        assert!(a.before(&b) && !b.before(&a));
        assert!(c.before(&a) && !a.before(&c));
        let wrapped = Head {
            level: 3,
            seq: u32::MAX,
        };
        let after_wrap = Head { level: 3, seq: 1 };
        assert!(wrapped.before(&after_wrap));
    }
}
