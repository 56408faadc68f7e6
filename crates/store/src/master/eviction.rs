//! Eviction: just enough, just in time. A put that does not fit evicts what it needs
//! at once; victims are the lowest of all shards' victim orders (`policy.rs`:
//! frequency with aging), soft-pinned objects only when nothing else is left,
//! hard-pinned, leased and unfinished ones never.
//!
//! Space comes back in size classes and slabs (`store::allocator`): evicting small
//! objects frees blocks that serve a larger class only once their whole slab is free.
//! Victims taken by order sit all over the pool, so when they did not make room the
//! next round empties whole slabs instead, the ones that hold the fewest live bytes
//! (`evict_slabs`): a pool full of small objects makes room for a large one at the
//! cost of about that one's size, not of the pool.
//!
//! Two things beyond hit counts place an object in the order: the pool ages with every
//! object listed, not only with every victim (else, while a pool fills, an object read
//! once long ago outranks everything written since), and the last block of a put batch
//! (a prefix's tail, which the next turn of a conversation rewrites rather than reads)
//! starts at the bottom.

use crate::util::sync::Unpoisoned;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use super::policy::{Head, Lowest, MeanGap, Policy};
use super::segments::{PieceAlloc, Segment};
use super::table::Shard;
use super::{Master, Object};
use crate::protocol::KeyResult;

/// The pool's age, shared by the shards' victim orders.
#[derive(Default)]
pub(super) struct Aging {
    /// The level of the last victim, or higher as objects are listed: the level an
    /// object with no hits would get now.
    floor: AtomicU64,
    /// Insertion order across shards.
    seq: AtomicU32,
    /// Objects listed since the floor last rose by itself.
    listed: AtomicU64,
    /// How long objects typically wait between touches, on the `seq` clock.
    gaps: MeanGap,
}

/// Levels the floor rises by itself while as many objects are listed as the pool
/// holds: one one-hit weight, as victims alone would raise it once the pool is full
/// (chosen on the conversation trace, bench/README.md).
const LEVELS_PER_TURNOVER: u64 = 8;

impl Aging {
    fn floor(&self) -> u64 {
        self.floor.load(Ordering::Relaxed)
    }

    fn next_seq(&self) -> u32 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Counts an object newly listed in a pool of `objects`: the floor rises by one
    /// level each `objects / LEVELS_PER_TURNOVER` of them.
    fn listed(&self, objects: u64) {
        let n = self.listed.fetch_add(1, Ordering::Relaxed) + 1;
        if n * LEVELS_PER_TURNOVER >= objects
            && self
                .listed
                .compare_exchange(n, 0, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.floor.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Runs `f` on a batch's items from the last to the first and returns the results in
/// the batch's order. A batch lists one request's blocks in prefix order; touching it
/// tail first leaves the head the most recently used, so of equally hit blocks the
/// tail goes first (a block is no use once a block before it is gone).
pub(super) fn tail_first<T, R>(items: &[T], f: impl FnMut(&T) -> R) -> Vec<R> {
    let mut out: Vec<R> = items.iter().rev().map(f).collect();
    out.reverse();
    out
}

/// Runs `f` on the indices of a batch of `n` items in `tail_first`'s order.
pub(super) fn tail_first_each(n: usize, f: impl FnMut(usize)) {
    (0..n).rev().for_each(f);
}

/// Whether an object may be evicted now: complete, not hard-pinned, lease expired, and
/// soft pin expired unless soft-pinned objects are fair game this time.
fn evictable(o: &Object, now: u64, allow_soft_pinned: bool) -> bool {
    o.complete
        && !o.hard_pin
        && o.lease_until_ms <= now
        && (allow_soft_pinned || o.soft_pin_until_ms <= now)
}

/// Runs an eviction with unpinned objects only, then, if that freed nothing, with
/// soft-pinned ones too; the bytes freed.
fn unpinned_first(evict: impl Fn(bool) -> u64) -> u64 {
    match evict(false) {
        0 => evict(true),
        n => n,
    }
}

/// When a passed-over object becomes evictable as time goes on (its lease or pin runs
/// out); never for one no time frees (unfinished, hard-pinned).
fn evictable_from(o: &Object, allow_soft_pinned: bool) -> u64 {
    if !o.complete || o.hard_pin {
        return u64::MAX;
    }
    let pin = if allow_soft_pinned {
        0
    } else {
        o.soft_pin_until_ms
    };
    o.lease_until_ms.max(pin)
}

/// Leased or pinned objects a look at a shard's bottom passes over before giving up.
const PASS_OVER: usize = 64;

/// What one look at every shard found.
#[derive(Default)]
struct Round {
    /// The shard with the lowest evictable entry.
    best: Option<usize>,
    /// The second-lowest evictable entry (in another shard).
    second: Option<Head>,
    /// Objects in all orders.
    listed: usize,
    /// Blocked shard bottoms moved up.
    moved_up: usize,
}

/// A slab of a segment: the segment's id and the slab's index in it.
type SlabId = (u64, u64);

fn slab_of(p: &PieceAlloc) -> SlabId {
    (p.seg.id, p.alloc.offset / p.seg.alloc.slab_size())
}

/// What emptying one slab would cost.
#[derive(Default)]
struct SlabCost {
    /// Block bytes of the objects in it.
    live: u64,
    /// It holds an object that may not be evicted now.
    blocked: bool,
}

/// The slabs to empty for a whole-slab eviction, and their segments.
#[derive(Default)]
struct SlabChoice {
    slabs: HashSet<SlabId>,
    segments: HashMap<u64, Arc<Segment>>,
}

impl Master {
    /// Makes room for about `want` bytes: evicts the lowest objects (unpinned ones
    /// first, soft-pinned ones only when nothing else is left), or, when that was tried
    /// already and did not make room (`whole_slabs`), empties whole slabs, falling back
    /// to the order if no slab can be emptied. Returns the bytes freed.
    pub(super) fn make_room(&self, want: u64, whole_slabs: bool) -> u64 {
        let by_slab = if whole_slabs {
            unpinned_first(|allow| self.evict_slabs(want, allow))
        } else {
            0
        };
        match by_slab {
            0 => unpinned_first(|allow| self.evict(want, allow)),
            n => n,
        }
    }

    /// Records a hit of `key` (a read, or the end of its put) in its shard's order.
    pub(super) fn touch(&self, shard: &mut Shard, key: &str) {
        if let Some(slot) = shard.objects.slot(key) {
            self.touch_at(shard, slot, key);
        }
    }

    /// As `touch`, for the object in arena slot `slot` (found already).
    pub(super) fn touch_at(&self, shard: &mut Shard, slot: u32, key: &str) {
        let (floor, seq) = (self.aging.floor(), self.aging.next_seq());
        if shard.hit_at(slot, || Self::key_hash(key), floor, seq, &self.aging.gaps) {
            self.aging.listed(self.objects.load(Ordering::Relaxed));
        }
    }

    /// After a PutEnd batch of several blocks: its last one, if written, goes to the
    /// bottom of the order (see the module's comment). A batch of one is not taken for
    /// a prefix.
    pub(super) fn sink_batch_tail<T, R>(&self, items: &[(String, T)], results: &[KeyResult<R>]) {
        if items.len() < 2 {
            return;
        }
        if let (Some((key, _)), Some(Ok(_))) = (items.last(), results.last()) {
            let (floor, seq) = (self.aging.floor(), self.aging.next_seq());
            self.shard(key).locked().sink(key, floor, seq);
        }
    }

    /// Evicts the lowest evictable objects of all shards until at least `want` bytes
    /// are freed or nothing evictable is left. Returns the bytes freed. The cost per
    /// victim is a look at the bottom of each shard's order (passing over at most
    /// `PASS_OVER` leased or pinned objects), independent of how many objects there are.
    pub(super) fn evict(&self, want: u64, allow_soft_pinned: bool) -> u64 {
        let mut freed = 0;
        let mut moved_up = 0;
        // Rounds repeated for this victim because a shard's remembered lowest was
        // leased meanwhile.
        let mut stale = 0;
        while freed < want {
            let now = self.clock.now_ms();
            let round = self.lowest_heads(now, allow_soft_pinned);
            moved_up += round.moved_up;
            let Some(best) = round.best else {
                // Some shards were blocked and moved up: look again, once per object.
                if round.moved_up > 0 && moved_up <= round.listed {
                    continue;
                }
                break;
            };
            let mut shard = self.shards[best].locked();
            let mut groups = Vec::new();
            // Take from this shard while its lowest stays below every other shard's.
            let mut again = false;
            for first in [true].into_iter().chain(std::iter::repeat(false)) {
                let Lowest::Found(head, id) =
                    Self::lowest(&mut shard, now, allow_soft_pinned, true)
                else {
                    break;
                };
                if round.second.is_some_and(|s| !head.before(&s)) {
                    // At first, the round saw a lowest that is no longer evictable
                    // (now looked at afresh): look at every shard again, boundedly.
                    again = first && stale < self.shards.len();
                    if !first || again {
                        break;
                    }
                }
                let Some((bytes, g)) = self.evict_node(&mut shard, head, id) else {
                    break;
                };
                freed += bytes;
                groups = g;
                stale = 0;
                if freed >= want || !groups.is_empty() {
                    break;
                }
            }
            drop(shard);
            if again {
                stale += 1;
                continue;
            }
            if !groups.is_empty() {
                freed += self.evict_group(&groups, allow_soft_pinned);
            }
        }
        freed
    }

    /// The lowest evictable entry of `shard`: the one its last look found while it
    /// holds (see `Policy::remember_lowest`), else a new look. With `verify`, a
    /// remembered entry is checked to be evictable still (an object can be leased
    /// without moving in the order: a group member); eviction itself always verifies.
    fn lowest(shard: &mut Shard, now: u64, allow_soft_pinned: bool, verify: bool) -> Lowest {
        let Shard {
            objects, policy, ..
        } = shard;
        match policy.remembered_lowest(now, allow_soft_pinned) {
            Some(None) => return Lowest::None,
            Some(Some((head, id)))
                if !verify
                    || policy
                        .slot(id)
                        .and_then(|slot| objects.at(slot))
                        .is_some_and(|o| evictable(o, now, allow_soft_pinned)) =>
            {
                return Lowest::Found(head, id)
            }
            _ => {}
        }
        let mut until_ms = u64::MAX;
        let lowest = policy.lowest_where(PASS_OVER, |slot| match objects.at(slot) {
            Some(o) if evictable(o, now, allow_soft_pinned) => true,
            Some(o) => {
                until_ms = until_ms.min(evictable_from(o, allow_soft_pinned));
                false
            }
            None => false,
        });
        match lowest {
            Lowest::Found(head, id) => {
                policy.remember_lowest(Some((head, id)), allow_soft_pinned, until_ms)
            }
            Lowest::None => policy.remember_lowest(None, allow_soft_pinned, until_ms),
            // A remembered entry that failed its check must not answer the next look.
            Lowest::Blocked(_) => policy.forget_lowest(),
        }
        lowest
    }

    /// One look at every shard: where the lowest evictable entry is, the second
    /// lowest, how many objects all orders hold. A shard whose bottom is blocked by
    /// more than `PASS_OVER` leased or pinned objects moves its lowest up to the top,
    /// so that the next look gets further.
    fn lowest_heads(&self, now: u64, allow_soft_pinned: bool) -> Round {
        let mut round = Round::default();
        let mut best_head: Option<Head> = None;
        for (i, s) in self.shards.iter().enumerate() {
            let mut shard = s.locked();
            round.listed += shard.policy.len();
            let h = match Self::lowest(&mut shard, now, allow_soft_pinned, false) {
                Lowest::Found(h, _) => h,
                Lowest::Blocked(id) => {
                    let top = Policy::top(self.aging.floor());
                    shard.policy.requeue(id, top, self.aging.next_seq());
                    round.moved_up += 1;
                    continue;
                }
                Lowest::None => continue,
            };
            match best_head {
                Some(b) if !h.before(&b) => {
                    if round.second.is_none_or(|s2| h.before(&s2)) {
                        round.second = Some(h);
                    }
                }
                _ => {
                    round.second = best_head;
                    best_head = Some(h);
                    round.best = Some(i);
                }
            }
        }
        round
    }

    /// Evicts the object of node `id` at `head` of `shard`'s order (found evictable
    /// under the same lock): its bytes and its groups.
    fn evict_node(&self, shard: &mut Shard, head: Head, id: u32) -> Option<(u64, Vec<String>)> {
        let slot = shard.policy.slot(id)?;
        // A node outliving its object would name whatever took the slot since.
        if shard.objects.at(slot)?.node != id {
            debug_assert!(false, "policy node {id} outlived its object");
            return None;
        }
        let key = shard.objects.key_at(slot)?.to_owned();
        let o = shard.evict(&key, Self::key_hash(&key))?;
        self.aging.floor.fetch_max(head.level, Ordering::Relaxed);
        let bytes = self.account_eviction(&o);
        let groups = o.groups.to_vec();
        if !groups.is_empty() {
            self.forget_member(&groups, &key);
        }
        self.keep_on_disk(shard, &key, o);
        Some((bytes, groups))
    }

    /// Counts an evicted object; returns its bytes (freed when `o` drops).
    fn account_eviction(&self, o: &Object) -> u64 {
        let bytes: u64 = o.replicas.pieces().map(|p| p.alloc.block_size()).sum();
        self.objects.fetch_sub(1, Ordering::Relaxed);
        self.evicted_objects.fetch_add(1, Ordering::Relaxed);
        self.evicted_bytes.fetch_add(bytes, Ordering::Relaxed);
        bytes
    }

    /// Drops an evicted key from its groups' member lists.
    fn forget_member(&self, groups: &[String], key: &str) {
        let mut index = self.groups.locked();
        for g in groups {
            if let Some(v) = index.get_mut(g) {
                v.retain(|m| m != key);
                if v.is_empty() {
                    index.remove(g);
                }
            }
        }
    }

    /// Empties the slabs cheapest to empty (see `cheapest_slabs`) until they add up to
    /// `want` bytes, and hands them back to their allocators so any size class can take
    /// them. Returns the bytes evicted. Space no object holds (quarantined, staged or
    /// being offloaded) is not seen, so a slab holding some stays bound; the caller's
    /// next round asks for more.
    fn evict_slabs(&self, want: u64, allow_soft_pinned: bool) -> u64 {
        let now = self.clock.now_ms();
        let choice = self.cheapest_slabs(want, now, allow_soft_pinned);
        if choice.slabs.is_empty() {
            return 0;
        }
        let mut freed = 0;
        let mut groups = Vec::new();
        for s in self.shards.iter() {
            let mut shard = s.locked();
            let victims: Vec<String> = shard
                .objects
                .iter()
                .filter(|(_, o)| {
                    evictable(o, now, allow_soft_pinned)
                        && o.replicas
                            .pieces()
                            .any(|p| choice.slabs.contains(&slab_of(p)))
                })
                .map(|(key, _)| key.to_owned())
                .collect();
            for key in victims {
                let Some(o) = shard.evict(&key, Self::key_hash(&key)) else {
                    continue;
                };
                freed += self.account_eviction(&o);
                if !o.groups.is_empty() {
                    self.forget_member(&o.groups, &key);
                    groups.extend(o.groups.iter().cloned());
                }
                self.keep_on_disk(&mut shard, &key, o);
            }
        }
        if !groups.is_empty() {
            groups.sort_unstable();
            groups.dedup();
            freed += self.evict_group(&groups, allow_soft_pinned);
        }
        // The emptied slabs go back now, not when some later allocation fails and the
        // allocator's own look at its free lists is due.
        for seg in choice.segments.values() {
            seg.alloc.reclaim_free_slabs();
        }
        freed
    }

    /// One look at every object: the slabs whose objects may all be evicted now, fewest
    /// live bytes first (those lose the least), until their bytes add up to `want`.
    /// Segments leaving the pool are left alone (nothing new is placed there).
    fn cheapest_slabs(&self, want: u64, now: u64, allow_soft_pinned: bool) -> SlabChoice {
        let mut costs: HashMap<SlabId, SlabCost> = HashMap::new();
        let mut segments: HashMap<u64, Arc<Segment>> = HashMap::new();
        for s in self.shards.iter() {
            let shard = s.locked();
            for (_, o) in shard.objects.iter() {
                let blocked = !evictable(o, now, allow_soft_pinned);
                for p in o.replicas.pieces() {
                    if p.seg.draining.load(Ordering::Relaxed) {
                        continue;
                    }
                    let cost = costs.entry(slab_of(p)).or_default();
                    cost.live += p.alloc.block_size();
                    cost.blocked |= blocked;
                    segments.entry(p.seg.id).or_insert_with(|| p.seg.clone());
                }
            }
        }
        let mut open: Vec<(u64, SlabId)> = costs
            .into_iter()
            .filter(|(_, c)| !c.blocked)
            .map(|(id, c)| (c.live, id))
            .collect();
        open.sort_unstable();
        let mut choice = SlabChoice::default();
        let mut room = 0u64;
        for (_, id) in open {
            if room >= want {
                break;
            }
            let Some(seg) = segments.get(&id.0) else {
                continue;
            };
            room += seg.alloc.slab_size();
            choice.segments.entry(id.0).or_insert_with(|| seg.clone());
            choice.slabs.insert(id);
        }
        choice
    }

    /// Group members share an evicted object's fate (pins and leases still hold).
    fn evict_group(&self, groups: &[String], allow_soft_pinned: bool) -> u64 {
        let now = self.clock.now_ms();
        let mut freed = 0;
        for m in self.group_members("", groups) {
            let mut shard = self.shard(&m).locked();
            if !shard
                .get(&m)
                .is_some_and(|o| evictable(o, now, allow_soft_pinned))
            {
                continue;
            }
            // Like any victim it leaves a ghost of its hits; the floor stays (the member
            // was not the lowest).
            if let Some(o) = shard.evict(&m, Self::key_hash(&m)) {
                freed += self.account_eviction(&o);
                self.keep_on_disk(&mut shard, &m, o);
            }
        }
        freed
    }

    /// Background eviction, off unless the high watermark is set below 1: above it,
    /// frees down to `watermark - ratio` of capacity. Puts never need it (they evict
    /// what they need themselves); it only keeps headroom for bursts.
    pub(super) fn evict_above_watermark(&self) {
        let high = self.config.eviction_high_watermark;
        let (capacity, used) = self.segments.capacity_and_used();
        if high >= 1.0 || capacity == 0 || (used as f64) < capacity as f64 * high {
            return;
        }
        let target = capacity as f64 * (high - self.config.eviction_ratio).max(0.0);
        let want = used.saturating_sub(target as u64);
        let freed = self.evict(want, false);
        if freed < want {
            self.evict(want - freed, true);
        }
    }
}

#[cfg(test)]
mod tests {
    //! Victim choice, driven with a manual clock: exact orders, no timing.

    use super::super::quota::Payer;
    use super::super::{Clock, Master, MasterConfig};
    use super::tail_first;
    use crate::protocol::{ReplicateConfig, Request, SegmentInfo};

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const OBJ: u64 = 64 * KIB;

    fn master_with(clock: &Clock, segment: u64, shards: usize) -> Master {
        let mut cfg = MasterConfig::default();
        cfg.allocator.slab_size = MIB;
        cfg.shards = shards;
        let m = Master::with_clock(cfg, clock.clone());
        let seg = SegmentInfo {
            name: "seg".into(),
            base: 1 << 40,
            size: segment,
        };
        m.mount(1, seg).unwrap();
        m
    }

    fn master(clock: &Clock, segment: u64) -> Master {
        master_with(clock, segment, 1)
    }

    /// A complete object of `OBJ` bytes; the clock then moves on a millisecond.
    fn put(m: &Master, clock: &Clock, key: &str, cfg: &ReplicateConfig) {
        m.put_start(1, Payer::Client(1), key, OBJ, cfg, false)
            .unwrap();
        m.put_end(1, key, 0, &mut Default::default()).unwrap();
        clock.advance(1);
    }

    /// A read that leaves no lease behind (the clock moves past it).
    fn read(m: &Master, clock: &Clock, key: &str) {
        m.get_replicas(key).unwrap();
        clock.advance(MasterConfig::default().lease_ttl.as_millis() as u64);
    }

    fn present(m: &Master, keys: &[&str]) -> Vec<bool> {
        keys.iter().map(|k| m.exists(k).unwrap()).collect()
    }

    #[test]
    fn oldest_first_among_equals_and_pins_leases_and_writers_hold() {
        let clock = Clock::manual();
        let m = master(&clock, 8 * MIB);
        let plain = ReplicateConfig::default();
        let soft = ReplicateConfig {
            soft_pin: true,
            ..Default::default()
        };
        let hard = ReplicateConfig {
            hard_pin: true,
            ..Default::default()
        };
        // Oldest first: pins would be the first victims if they counted for nothing.
        put(&m, &clock, "soft", &soft);
        put(&m, &clock, "hard", &hard);
        put(&m, &clock, "old", &plain);
        put(&m, &clock, "mid", &plain);
        put(&m, &clock, "new", &plain);
        put(&m, &clock, "leased", &plain);
        m.get_replicas("leased").unwrap();
        m.put_start(1, Payer::Client(1), "writing", OBJ, &plain, false)
            .unwrap();
        put(&m, &clock, "older", &plain);
        let all = ["soft", "hard", "old", "mid", "new", "leased", "older"];
        let block = m.stats().used / 8;
        assert_eq!(block, OBJ, "a 64 KiB object takes one 64 KiB block");

        // One byte wanted: exactly one victim, the oldest plain object.
        assert_eq!(m.evict(1, false), block);
        assert_eq!(
            present(&m, &all),
            [true, true, false, true, true, true, true]
        );
        // As much as possible without soft-pinned objects: the other plain ones.
        assert_eq!(m.evict(u64::MAX, false), 3 * block);
        assert_eq!(
            present(&m, &all),
            [true, true, false, false, false, true, false]
        );
        // Soft pins give way when asked; a lease, a hard pin and a writer do not.
        assert_eq!(m.evict(u64::MAX, true), block);
        assert!(!m.exists("soft").unwrap());
        assert_eq!(m.evict(u64::MAX, true), 0, "nothing evictable is left");
        // Once the lease runs out the leased object goes; the hard pin never does.
        clock.advance(MasterConfig::default().lease_ttl.as_millis() as u64);
        assert_eq!(m.evict(u64::MAX, true), block);
        assert_eq!(present(&m, &["hard", "leased"]), [true, false]);
        assert!(
            m.query("writing").is_some(),
            "a put in progress is never evicted"
        );
        assert_eq!(m.stats().evicted_objects, 6);
        assert_eq!(m.stats().evicted_bytes, 6 * block);
    }

    #[test]
    fn an_expired_soft_pin_counts_for_nothing() {
        let clock = Clock::manual();
        let m = master(&clock, 8 * MIB);
        let soft = ReplicateConfig {
            soft_pin: true,
            soft_pin_ttl_ms: 100,
            ..Default::default()
        };
        put(&m, &clock, "soft", &soft);
        assert_eq!(m.evict(u64::MAX, false), 0, "soft pin still holds");
        clock.advance(100);
        assert_eq!(m.evict(u64::MAX, false), OBJ);
        assert!(!m.exists("soft").unwrap());
    }

    #[test]
    fn a_frequently_read_object_survives_a_scan_of_one_time_objects() {
        let clock = Clock::manual();
        // 16 blocks, many shards: the victim is the lowest across all of them.
        let m = master_with(&clock, MIB, 8);
        let plain = ReplicateConfig::default();
        put(&m, &clock, "hot", &plain);
        for _ in 0..4 {
            read(&m, &clock, "hot");
        }
        let scan = |from: usize, to: usize| {
            for i in from..to {
                put(&m, &clock, &format!("scan{i}"), &plain);
            }
        };
        // A scan twice the pool, each object written once and never read: under
        // plain recency the hot object, the least recently used, would go first.
        scan(0, 32);
        assert!(m.exists("hot").unwrap(), "the hot object was evicted");
        assert!(m.exists("scan31").unwrap());
        assert!(!m.exists("scan0").unwrap());
        assert_eq!(m.stats().used, MIB, "the whole pool in use");
        // Popularity fades: a long enough scan ages it out.
        scan(32, 320);
        assert!(!m.exists("hot").unwrap(), "a once-hot object stays forever");
    }

    #[test]
    fn a_put_into_a_full_pool_evicts_just_enough() {
        let clock = Clock::manual();
        let m = master_with(&clock, MIB, 4);
        let plain = ReplicateConfig::default();
        for i in 0..16 {
            put(&m, &clock, &format!("k{i}"), &plain);
        }
        let full = m.stats();
        assert_eq!((full.used, full.capacity), (MIB, MIB), "the pool is full");
        assert_eq!(full.evicted_objects, 0);
        for (n, key) in ["one-more", "two-more"].into_iter().enumerate() {
            put(&m, &clock, key, &plain);
            let s = m.stats();
            assert_eq!(s.evicted_objects, n as u64 + 1, "exactly one victim a put");
            assert_eq!((s.used, s.objects), (MIB, 16), "no pool left idle");
        }
        assert_eq!(present(&m, &["k0", "k1", "k2"]), [false, false, true]);
    }

    #[test]
    fn a_batch_keeps_its_head_longest() {
        let clock = Clock::manual();
        let m = master_with(&clock, MIB, 4);
        let keys: Vec<String> = (0..4).map(|i| format!("block{i}")).collect();
        put_batch(&m, &keys.iter().map(String::as_str).collect::<Vec<_>>());
        let alive = || -> Vec<bool> { keys.iter().map(|k| m.exists(k).unwrap()).collect() };
        // A block is no use without the ones before it: the deepest goes first.
        assert_eq!(m.evict(1, false), OBJ);
        assert_eq!(alive(), [true, true, true, false]);
        assert_eq!(m.evict(1, false), OBJ);
        assert_eq!(alive(), [true, true, false, false]);
        // Reading the batch keeps the same order.
        m.handle(Request::GetReplicas {
            keys: keys[..2].to_vec(),
        })
        .unwrap();
        clock.advance(MasterConfig::default().lease_ttl.as_millis() as u64);
        assert_eq!(m.evict(1, false), OBJ);
        assert_eq!(alive(), [true, false, false, false]);
    }

    /// Puts `keys` as one batch (PutStart, then PutEnd), as a client writes a prefix.
    fn put_batch(m: &Master, keys: &[&str]) {
        let items = keys.iter().map(|k| (k.to_string(), OBJ)).collect();
        m.handle(Request::PutStart {
            client: 1,
            items,
            config: ReplicateConfig::default(),
            upsert: false,
        })
        .unwrap();
        let items = keys.iter().map(|k| (k.to_string(), 0)).collect();
        m.handle(Request::PutEnd { client: 1, items }).unwrap();
    }

    #[test]
    fn the_tail_of_a_put_batch_goes_before_older_objects() {
        let clock = Clock::manual();
        let m = master_with(&clock, MIB, 4);
        put(&m, &clock, "old", &ReplicateConfig::default());
        put_batch(&m, &["head", "middle", "tail"]);
        put_batch(&m, &["single"]);
        let all = ["old", "head", "middle", "tail", "single"];
        // The tail, written last, goes first; then the oldest as usual.
        assert_eq!(m.evict(1, false), OBJ);
        assert_eq!(present(&m, &all), [true, true, true, false, true]);
        assert_eq!(m.evict(1, false), OBJ);
        assert_eq!(present(&m, &all), [false, true, true, false, true]);
        // A batch of one is no prefix: "single" outlasts the older batch.
        assert_eq!(m.evict(2 * OBJ, false), 2 * OBJ);
        assert_eq!(present(&m, &all), [false, false, false, false, true]);
    }

    #[test]
    fn a_tail_that_is_read_earns_its_place_back() {
        let clock = Clock::manual();
        let m = master_with(&clock, MIB, 4);
        put_batch(&m, &["head", "tail"]);
        put(&m, &clock, "newer", &ReplicateConfig::default());
        read(&m, &clock, "tail");
        assert_eq!(m.evict(1, false), OBJ);
        assert_eq!(present(&m, &["head", "tail", "newer"]), [false, true, true]);
    }

    #[test]
    fn the_pool_ages_while_it_fills() {
        let clock = Clock::manual();
        // 128 blocks, never full here: no victim raises the floor.
        let m = master_with(&clock, 8 * MIB, 4);
        let plain = ReplicateConfig::default();
        put(&m, &clock, "early", &plain);
        read(&m, &clock, "early");
        for i in 0..100 {
            put(&m, &clock, &format!("later{i}"), &plain);
        }
        assert_eq!(m.stats().evicted_objects, 0);
        // One read long ago outranks the objects written just after it, not the
        // hundred written since (were the floor to wait for victims, it would go last).
        assert_eq!(m.evict(10 * OBJ, false), 10 * OBJ);
        assert!(!m.exists("early").unwrap());
        assert!((10..100).all(|i| m.exists(&format!("later{i}")).unwrap()));
    }

    #[test]
    fn group_members_evicted_with_a_victim_leave_ghosts() {
        let clock = Clock::manual();
        let m = master_with(&clock, MIB, 4);
        let grouped = ReplicateConfig {
            group_ids: vec!["g".into()],
            ..Default::default()
        };
        let plain = ReplicateConfig::default();
        put(&m, &clock, "member", &grouped);
        for _ in 0..6 {
            read(&m, &clock, "member");
        }
        put(&m, &clock, "victim", &grouped);
        // Hits aside, the fresh victim is the lowest; its group goes with it.
        assert_eq!(m.evict(1, false), 2 * OBJ);
        assert_eq!(present(&m, &["member", "victim"]), [false, false]);
        // Written again, the member gets its seven hits back from its ghost and
        // outlasts an object written after it.
        put(&m, &clock, "member", &plain);
        put(&m, &clock, "fresh", &plain);
        assert_eq!(m.evict(1, false), OBJ);
        assert_eq!(present(&m, &["member", "fresh"]), [true, false]);
    }

    #[test]
    fn a_remembered_victim_leased_through_its_group_since_is_passed_over() {
        let clock = Clock::manual();
        let m = master_with(&clock, 8 * MIB, 2);
        let grouped = ReplicateConfig {
            group_ids: vec!["g".into()],
            ..Default::default()
        };
        // The reader sits in the other shard, so reading it moves nothing in the
        // member's shard.
        let in_shard_of = |key: &str, same: bool, name: &str| {
            (0..64)
                .map(|i| format!("{name}{i}"))
                .find(|k| std::ptr::eq(m.shard(k), m.shard(key)) == same)
                .unwrap()
        };
        let (plain, reader) = (
            in_shard_of("member", true, "plain"),
            in_shard_of("member", false, "reader"),
        );
        put(&m, &clock, "member", &grouped);
        put(&m, &clock, &plain, &ReplicateConfig::default());
        put(&m, &clock, &reader, &grouped);
        // A look at every shard remembers the member as the lowest of its shard.
        m.lowest_heads(clock.now_ms(), false);
        // Reading a member of its group leases it where it stands in the order.
        m.get_replicas(&reader).unwrap();
        assert_eq!(m.evict(1, false), OBJ);
        assert_eq!(
            present(&m, &["member", &plain, &reader]),
            [true, false, true]
        );
    }

    #[test]
    fn a_remembered_victim_leased_in_place_over_a_blocked_bottom_ends_the_eviction() {
        let clock = Clock::manual();
        let m = std::sync::Arc::new(master_with(&clock, 16 * MIB, 2));
        let grouped = ReplicateConfig {
            group_ids: vec!["g".into()],
            ..Default::default()
        };
        let keys_in = |same: bool, name: &str, n: usize| -> Vec<String> {
            (0..100_000)
                .map(|i| format!("{name}{i}"))
                .filter(|k| std::ptr::eq(m.shard(k), m.shard("victim")) == same)
                .take(n)
                .collect()
        };
        put(&m, &clock, "victim", &grouped);
        // Above it, more leased objects than a look passes over.
        for k in keys_in(true, "leased", super::PASS_OVER + 6) {
            put(&m, &clock, &k, &ReplicateConfig::default());
            m.get_replicas(&k).unwrap();
        }
        let reader = keys_in(false, "reader", 1).remove(0);
        put(&m, &clock, &reader, &grouped);
        m.lowest_heads(clock.now_ms(), false);
        // Leases the remembered victim where it stands, through its group.
        m.get_replicas(&reader).unwrap();
        let (done, finished) = std::sync::mpsc::channel();
        let evicting = m.clone();
        // Not scoped: a spinning eviction must not keep the test from failing.
        std::thread::spawn(move || done.send(evicting.evict(1, false)));
        // A bound on a hang, not a timing claim: the eviction takes microseconds.
        let freed = finished.recv_timeout(std::time::Duration::from_secs(120));
        assert_eq!(freed, Ok(0), "everything is leased: nothing to evict");
    }

    #[test]
    fn more_leased_objects_than_a_look_passes_over_still_let_a_victim_through() {
        let clock = Clock::manual();
        let m = master(&clock, 8 * MIB);
        let plain = ReplicateConfig::default();
        let n = super::PASS_OVER + 6;
        for i in 0..n {
            put(&m, &clock, &format!("leased{i}"), &plain);
            m.get_replicas(&format!("leased{i}")).unwrap();
        }
        put(&m, &clock, "free", &plain);
        assert_eq!(m.evict(1, false), OBJ);
        assert!(!m.exists("free").unwrap());
        assert_eq!(m.stats().objects, n as u64, "every leased object stays");
        assert_eq!(m.evict(1, true), 0, "then nothing is evictable");
    }

    #[test]
    fn tail_first_keeps_the_batch_order_of_results() {
        let mut seen = Vec::new();
        let out = tail_first(&[1, 2, 3], |x| {
            seen.push(*x);
            x * 10
        });
        assert_eq!(seen, [3, 2, 1]);
        assert_eq!(out, [10, 20, 30]);
    }

    #[test]
    fn no_background_eviction_by_default_and_the_watermark_when_asked() {
        let clock = Clock::manual();
        let mut m = master(&clock, 4 * MIB);
        let (capacity, _) = m.segments.capacity_and_used();
        assert_eq!(capacity, 4 * MIB);
        let soft = ReplicateConfig {
            soft_pin: true,
            ..Default::default()
        };
        // The whole pool: 64 objects.
        for i in 0..54 {
            put(&m, &clock, &format!("p{i}"), &ReplicateConfig::default());
        }
        for i in 0..10 {
            put(&m, &clock, &format!("s{i}"), &soft);
        }
        m.tick();
        assert_eq!(m.stats().objects, 64, "a full pool is no reason to evict");

        // Above 50%, free down to 50% - 10% = 1.6 MiB: more than the soft-pinned
        // objects alone could give but less than the unpinned ones.
        m.config.eviction_high_watermark = 0.5;
        m.config.eviction_ratio = 0.1;
        let target = (capacity as f64 * 0.4) as u64;
        let want = 64 * OBJ - target;
        m.evict_above_watermark();
        let s = m.stats();
        assert_eq!(s.evicted_bytes, want.div_ceil(OBJ) * OBJ);
        assert!(s.used <= target);
        assert!(
            (0..10).all(|i| m.exists(&format!("s{i}")).unwrap()),
            "soft-pinned objects stay while unpinned ones can go"
        );

        // Wanting more than the unpinned objects hold takes soft-pinned ones too.
        m.config.eviction_high_watermark = 0.05;
        m.config.eviction_ratio = 0.05;
        m.evict_above_watermark();
        assert_eq!(m.stats().objects, 0);
    }

    /// The slab a one-piece object lies in.
    fn slab_holding(m: &Master, key: &str) -> u64 {
        let shard = m.shard(key).lock().unwrap();
        let o = shard.get(key).expect("present");
        let piece = o.replicas.pieces().next().expect("in memory");
        piece.alloc.offset / piece.seg.alloc.slab_size()
    }

    #[test]
    fn whole_slab_eviction_empties_the_emptiest_free_slab_and_hands_it_back() {
        let clock = Clock::manual();
        let m = master(&clock, 4 * MIB);
        let slab = m.segments.snapshot()[0].alloc.slab_size();
        let per_slab = (slab / OBJ) as usize;
        assert!(per_slab >= 4, "{slab}-byte slabs");
        let plain = ReplicateConfig::default();
        let keys: Vec<String> = (0..4 * MIB / OBJ).map(|i| format!("k{i}")).collect();
        for k in &keys {
            put(&m, &clock, k, &plain);
        }
        let in_slab = |n: u64| -> Vec<&String> {
            keys.iter()
                .filter(|k| m.exists(k).unwrap() && slab_holding(&m, k) == n)
                .collect()
        };
        assert_eq!(in_slab(2).len(), per_slab, "the pool is full");
        // Slab 2 keeps two objects; slab 3 keeps one, read (leased) just now.
        for k in in_slab(2).into_iter().skip(2) {
            m.remove(k, true).unwrap();
        }
        for k in in_slab(3).into_iter().skip(1) {
            m.remove(k, true).unwrap();
        }
        let leased = in_slab(3)[0].clone();
        m.get_replicas(&leased).unwrap();
        let doomed = in_slab(2);
        let others = keys.len() - per_slab * 2;

        assert_eq!(
            m.evict_slabs(slab, false),
            2 * OBJ,
            "slab 2: slab 3 is leased"
        );
        assert!(doomed.iter().all(|k| !m.exists(k).unwrap()));
        assert_eq!(m.stats().objects, (others + 1) as u64);
        // The slab serves a block of the largest class at once, evicting nothing more.
        m.put_start(1, Payer::Client(1), "big", slab, &plain, false)
            .unwrap();
        assert_eq!(slab_holding(&m, "big"), 2);
        assert_eq!(m.stats().evicted_objects, 2);
        // Asked for everything, it empties every slab but the leased one and the
        // unfinished put's.
        assert_eq!(m.evict_slabs(u64::MAX, false), others as u64 * OBJ);
        assert!(m.exists(&leased).unwrap());
    }
}
