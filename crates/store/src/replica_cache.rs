//! Replica descriptors a client keeps while the lease the master granted with them
//! lasts, so a repeated get is one engine read and no master round trip.
//!
//! Why it is safe: while a key's lease runs the master refuses to remove, evict or
//! replace the object unless forced, and a forced remove quarantines its space until
//! the lease ends, so the bytes a kept descriptor names stay the object's bytes. An
//! entry is used only until the lease would end, counted from when the request that
//! granted it was *sent*, less a margin; this client's own puts and removes drop it at
//! once, and the client drops it on any failed or mismatching read (then asks the
//! master once more).
//!
//! A descriptor is kept only at its key's second read within a while (`ReadBefore`):
//! engines read most KV blocks once, and keeping every descriptor cost each batch of
//! fresh keys more than the master round trips it saved, while pushing out the
//! entries of keys that are read again.
//!
//! Reads served from here still count for eviction: their keys are queued, per read
//! batch and in batch order, and sent as one `Touch` request, pipelined ahead of the
//! client's next master request or flushed after `TOUCH_FLUSH_AFTER`.

#![forbid(unsafe_code)]

use crate::slot_index::SlotIndex;
use crate::util::sync::Unpoisoned;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::protocol::ObjectDesc;

/// Descriptors kept at most; past this, the oldest kept goes for each new one.
const MAX_ENTRIES: usize = 1 << 16;
/// Expired entries let go per insert at most.
const EXPIRED_PER_INSERT: usize = 8;
/// Queued touches are sent at the latest this long after the first of them.
pub const TOUCH_FLUSH_AFTER: Duration = Duration::from_millis(50);
/// Queued touches are sent once this many keys wait.
const TOUCH_FLUSH_KEYS: usize = 4096;

/// Bits in each generation of `ReadBefore` (a power of two).
const READ_BEFORE_BITS: usize = 1 << 20;
/// Keys marked in a generation of `ReadBefore` before the next one starts: each
/// generation stays under a quarter full, so a key never read passes for one read
/// before about one time in twenty per generation asked.
const READ_BEFORE_MARKS: usize = READ_BEFORE_BITS / 8;

/// The keys read lately, as two generations of a Bloom filter (two bits per key, in
/// one word the key's hash picks): the current one is marked, the previous one is still
/// asked, and when the current one is full the previous one is cleared and becomes
/// the current. A key counts as read before when either generation has it: marked
/// within the last one to two generations. A false "read before" only keeps a
/// descriptor that will not be read again; a false "never read" costs a master round
/// trip, never a wrong answer.
#[derive(Default)]
struct ReadBefore {
    /// Both generations' words, `[current, previous]` by `current`; empty until the
    /// first mark.
    words: Vec<u64>,
    current: usize,
    marks: usize,
}

impl ReadBefore {
    const WORDS: usize = READ_BEFORE_BITS / 64;

    /// The key's word in a generation, and its two bits there (one word: one cache
    /// line to look at per generation).
    fn place(hash: u64) -> (usize, u64) {
        let word = (hash as usize) & (Self::WORDS - 1);
        let bits = 1u64 << ((hash >> 20) & 63) | 1u64 << ((hash >> 26) & 63);
        (word, bits)
    }

    fn has(&self, generation: usize, hash: u64) -> bool {
        let (word, bits) = Self::place(hash);
        self.words[generation * Self::WORDS + word] & bits == bits
    }

    /// Asks for the words of a key with this hash to be brought into the cache.
    fn prefetch(&self, hash: u64) {
        if !self.words.is_empty() {
            let (word, _) = Self::place(hash);
            crate::util::prefetch::prefetch_read(&self.words[word]);
            crate::util::prefetch::prefetch_read(&self.words[Self::WORDS + word]);
        }
    }

    /// Whether a key with this hash was marked in either generation.
    fn seen(&self, hash: u64) -> bool {
        !self.words.is_empty() && (self.has(0, hash) || self.has(1, hash))
    }

    /// Marks a key with this hash as read now.
    fn mark(&mut self, hash: u64) {
        if self.words.is_empty() {
            self.words = vec![0; 2 * Self::WORDS];
        }
        if self.marks >= READ_BEFORE_MARKS {
            self.current ^= 1;
            self.words[self.current * Self::WORDS..][..Self::WORDS].fill(0);
            self.marks = 0;
        }
        let (word, bits) = Self::place(hash);
        self.words[self.current * Self::WORDS + word] |= bits;
        self.marks += 1;
    }
}

/// A descriptor, one read's alone or shared with the cache's entry: a batch of kept
/// descriptors is served without copying one, and a fresh one read once costs no
/// allocation (most are never kept).
#[derive(Clone, Debug)]
pub enum Desc {
    /// Granted to this read, not kept.
    Alone(ObjectDesc),
    /// The cache's entry's.
    Shared(Arc<ObjectDesc>),
}

impl std::ops::Deref for Desc {
    type Target = ObjectDesc;
    fn deref(&self) -> &ObjectDesc {
        match self {
            Desc::Alone(d) => d,
            Desc::Shared(d) => d,
        }
    }
}

impl Desc {
    /// The descriptor as the cache keeps it.
    fn shared(&self) -> Arc<ObjectDesc> {
        match self {
            Desc::Alone(d) => Arc::new(d.clone()),
            Desc::Shared(d) => d.clone(),
        }
    }
}

/// A descriptor and the lease it came with.
#[derive(Clone, Debug)]
pub struct Leased {
    pub desc: Desc,
    /// When the lease ends at the latest (measured from the request's send time).
    pub lease_ends: Instant,
    /// Served from the cache rather than asked for now.
    pub cached: bool,
    /// A copy the master staged from a disk tier for this read only: released once read.
    pub staged: bool,
}

impl Leased {
    /// A descriptor the master just granted to a request sent at `asked`.
    pub fn granted(desc: ObjectDesc, asked: Instant) -> Leased {
        let lease_ends = asked + Duration::from_millis(desc.lease_ms);
        Leased {
            desc: Desc::Alone(desc),
            lease_ends,
            cached: false,
            staged: false,
        }
    }
}

/// What the cache holds for a key looked up.
pub enum Looked {
    /// Its kept descriptor.
    Kept(Leased),
    /// None, but the key was read lately: its descriptor is to be kept.
    ReadBefore,
    /// None, and the key was not read lately.
    New,
}

/// How long before its lease ends an entry stops being handed out: an eighth of the
/// lease, at most a second (room for the read itself and for clock drift).
fn margin(lease_ms: u64) -> Duration {
    Duration::from_millis((lease_ms / 8).min(1000))
}

/// A kept descriptor, its key and the key's hash tag, and until when it is handed
/// out.
struct Kept {
    key: Box<str>,
    tag: u32,
    desc: Arc<ObjectDesc>,
    usable_until: Instant,
}

struct Inner {
    capacity: usize,
    /// Keys are hashed with a random key; the index finds ring slots by the hash's
    /// tag, and each candidate is checked against its key. It never rehashes under
    /// churn (a general hash map clearing its removed entries rehashed every kept
    /// key, cold in memory: a read stalled for 13 ms).
    hasher: RandomState,
    index: SlotIndex,
    /// Entries in the order kept: the one kept `n`-th sits at slot `n % capacity`, so
    /// a full cache lets the oldest go for each new one (a fresh-key workload fills
    /// it in a fraction of a second), never all at once. A key kept again takes a new
    /// slot and leaves its old one empty (no scan ever looks for the oldest live one),
    /// so keys kept over and over leave fewer than `capacity` entries for a while.
    /// Invariant: `index` names a slot exactly when that slot holds an entry, under
    /// that entry's tag.
    ring: Vec<Option<Kept>>,
    kept: u64,
    read_before: ReadBefore,
    /// Keeping positions before this hold nothing (let go, or expired). Leases are
    /// alike, so the oldest kept is about the first to expire.
    front: u64,
    /// Keys of reads served from here, one list per read batch, not yet told.
    touched: Vec<Vec<String>>,
    touched_keys: usize,
    first_touch: Option<Instant>,
}

/// The cache (one per client; shared by its threads).
pub struct ReplicaCache {
    inner: Mutex<Inner>,
}

impl Default for ReplicaCache {
    fn default() -> Self {
        ReplicaCache::with_capacity(MAX_ENTRIES)
    }
}

impl Inner {
    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The index's tag of a key with this hash.
    fn tag_of(hash: u64) -> u32 {
        (hash >> 32) as u32
    }

    fn tag(&self, key: &str) -> u32 {
        Self::tag_of(self.hash(key))
    }

    /// The slot of `key`'s entry, if one is kept.
    fn slot_of(&self, key: &str) -> Option<usize> {
        self.slot_under(key, self.tag(key))
    }

    /// The slot of `key`'s entry, if one is kept, `tag` being its tag.
    fn slot_under(&self, key: &str, tag: u32) -> Option<usize> {
        let is_key = |slot: u32| {
            let kept = self.ring[slot as usize].as_ref();
            kept.is_some_and(|k| &*k.key == key)
        };
        let (_, slot) = self.index.find(tag, is_key)?;
        Some(slot as usize)
    }

    /// Empties `slot`, and the index entry naming it.
    fn let_go(&mut self, slot: usize) {
        if let Some(old) = self.ring[slot].take() {
            if let Some((bucket, _)) = self.index.find(old.tag, |s| s as usize == slot) {
                self.index.remove_at(bucket);
            }
        }
    }

    /// Lets go of the entries at the front whose use has ended, at most
    /// `EXPIRED_PER_INSERT` of them: after a quiet spell the whole cache may have
    /// expired, and freeing it in one call would stall that read (the ring overwrites
    /// the rest in turn, and `get` never serves them).
    fn drop_expired(&mut self, now: Instant) {
        for _ in 0..EXPIRED_PER_INSERT {
            if self.front >= self.kept {
                return;
            }
            let slot = (self.front % self.capacity as u64) as usize;
            if self.ring[slot]
                .as_ref()
                .is_some_and(|k| k.usable_until > now)
            {
                return;
            }
            self.let_go(slot);
            self.front += 1;
        }
    }

    /// The kept descriptor of `key` (whose hash is `hash`), if its lease has room. Asked
    /// only of a key read lately: one not read lately has no entry (kept ones were
    /// marked when looked up, and one whose mark aged out is asked of the master once
    /// more), and its index probe, a cache miss in a large table, is saved.
    fn get(&self, key: &str, hash: u64, now: Instant) -> Option<Leased> {
        let slot = self.slot_under(key, Inner::tag_of(hash))?;
        let kept = self.ring[slot].as_ref()?;
        if now >= kept.usable_until {
            return None;
        }
        let lease_ends = kept.usable_until + margin(kept.desc.lease_ms);
        Some(Leased {
            desc: Desc::Shared(kept.desc.clone()),
            lease_ends,
            cached: true,
            staged: false,
        })
    }

    /// Keeps one freshly granted descriptor as of `now`, letting go of the key's
    /// previous entry, and of the oldest when full.
    fn keep(&mut self, key: &str, leased: &Leased, now: Instant) {
        let usable_until = leased.lease_ends - margin(leased.desc.lease_ms);
        if usable_until <= now {
            return;
        }
        if self.ring.capacity() == 0 {
            let capacity = self.capacity;
            self.index = SlotIndex::with_capacity(capacity);
            self.ring.reserve_exact(capacity);
        }
        self.drop_expired(now);
        let tag = self.tag(key);
        // Kept again: the old entry goes.
        if let Some(old) = self.slot_under(key, tag) {
            self.let_go(old);
        }
        let capacity = self.capacity as u64;
        let slot = (self.kept % capacity) as usize;
        let kept = Kept {
            key: key.into(),
            tag,
            desc: leased.desc.shared(),
            usable_until,
        };
        if slot == self.ring.len() {
            self.ring.push(Some(kept));
        } else {
            self.let_go(slot); // the oldest kept
            self.ring[slot] = Some(kept);
        }
        self.index.insert(tag, slot as u32);
        self.kept += 1;
        self.front = self.front.max(self.kept.saturating_sub(capacity));
    }
}

impl ReplicaCache {
    /// A cache keeping at most `capacity` descriptors. Its index and ring are sized
    /// for them at the first insert (a client that never reads holds none of it), not
    /// grown as entries come: growing stalls the read that pays for it.
    fn with_capacity(capacity: usize) -> ReplicaCache {
        let capacity = capacity.max(1);
        ReplicaCache {
            inner: Mutex::new(Inner {
                capacity,
                hasher: RandomState::new(),
                index: SlotIndex::default(),
                ring: Vec::new(),
                kept: 0,
                read_before: ReadBefore::default(),
                front: 0,
                touched: Vec::new(),
                touched_keys: 0,
                first_touch: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    /// The kept descriptor of `key`, if its lease still has room for a read.
    #[cfg(test)]
    pub fn get(&self, key: &str, now: Instant) -> Option<Leased> {
        match self.look_up(&[key], now).pop() {
            Some(Looked::Kept(l)) => Some(l),
            _ => None,
        }
    }

    /// Each key's kept descriptor, if its lease still has room for a read; for a key
    /// without one, whether it was read lately (its descriptor is then to be kept, see
    /// [`keep_many`](Self::keep_many)). Every key is marked read now. A batch
    /// looks its keys up under one lock, the filter's words prefetched first.
    pub fn look_up(&self, keys: &[&str], now: Instant) -> Vec<Looked> {
        let mut inner = self.lock();
        // The filter's words first, all asked for at once: their cache misses overlap.
        let hashes: Vec<u64> = keys.iter().map(|k| inner.hash(k)).collect();
        for &h in &hashes {
            inner.read_before.prefetch(h);
        }
        keys.iter()
            .zip(hashes)
            .map(|(k, h)| {
                let read_before = inner.read_before.seen(h);
                // Marked at every read, served from here or not: a key read over and
                // over stays read lately.
                inner.read_before.mark(h);
                if let Some(kept) = read_before.then(|| inner.get(k, h, now)).flatten() {
                    return Looked::Kept(kept);
                }
                if read_before {
                    Looked::ReadBefore
                } else {
                    Looked::New
                }
            })
            .collect()
    }

    /// Keeps freshly granted descriptors (keys whose lookup said `ReadBefore`), as
    /// of `now` (a batch's answers share one reading of the clock), under one lock.
    pub fn keep_many<'a>(
        &self,
        granted: impl IntoIterator<Item = (&'a str, &'a Leased)>,
        now: Instant,
    ) {
        let mut inner = self.lock();
        for (key, leased) in granted {
            inner.keep(key, leased, now);
        }
    }

    /// Keeps one freshly granted descriptor (as `keep_many`).
    #[cfg(test)]
    pub fn insert(&self, key: &str, leased: &Leased, now: Instant) {
        self.keep_many([(key, leased)], now);
    }
    /// Marks `key` read, as a lookup that finds nothing kept does (for tests).
    #[cfg(test)]
    fn mark_read(&self, key: &str) {
        let mut inner = self.lock();
        let hash = inner.hash(key);
        inner.read_before.mark(hash);
    }

    /// Forgets `keys` (written, removed, or read wrongly).
    pub fn drop_keys<'a>(&self, keys: impl IntoIterator<Item = &'a str>) {
        let mut inner = self.lock();
        for k in keys {
            if let Some(slot) = inner.slot_of(k) {
                inner.let_go(slot);
            }
        }
    }

    /// Forgets everything (a remove by pattern or of all objects).
    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.index.clear();
        inner.ring.clear();
        (inner.kept, inner.front) = (0, 0);
    }

    /// Queues one read batch's keys served from here; true when the queue is due to be
    /// sent now (old or large enough).
    pub fn touched(&self, keys: Vec<String>) -> bool {
        if keys.is_empty() {
            return false;
        }
        let mut inner = self.lock();
        inner.touched_keys += keys.len();
        inner.touched.push(keys);
        let first = *inner.first_touch.get_or_insert_with(Instant::now);
        inner.touched_keys >= TOUCH_FLUSH_KEYS || first.elapsed() >= TOUCH_FLUSH_AFTER
    }

    /// Takes the queued touches (empty when none).
    pub fn take_touches(&self) -> Vec<Vec<String>> {
        let mut inner = self.lock();
        inner.touched_keys = 0;
        inner.first_touch = None;
        std::mem::take(&mut inner.touched)
    }

    /// Descriptors kept now (expired ones included until they reach the front).
    pub fn len(&self) -> usize {
        self.lock().index.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inserts as a key's second read does (its first marked it).
    fn keep(c: &ReplicaCache, key: &str, leased: &Leased, now: Instant) {
        c.mark_read(key);
        c.insert(key, leased, now);
    }

    fn desc(lease_ms: u64) -> ObjectDesc {
        ObjectDesc {
            size: 4,
            crc32c: 1,
            lease_ms,
            replicas: Default::default(),
        }
    }

    #[test]
    fn an_entry_is_served_only_within_its_lease_less_the_margin() {
        let c = ReplicaCache::default();
        let asked = Instant::now();
        keep(&c, "k", &Leased::granted(desc(8000), asked), asked);
        let hit = c.get("k", asked).expect("fresh entry");
        assert!(hit.cached);
        assert_eq!(hit.lease_ends, asked + Duration::from_millis(8000));
        // 8 s lease: usable for 7 s (margin 1 s), never past it.
        assert!(c.get("k", asked + Duration::from_millis(6999)).is_some());
        assert!(c.get("k", asked + Duration::from_millis(7000)).is_none());
        assert!(c.get("other", asked).is_none());
    }

    #[test]
    fn an_already_expired_grant_is_not_kept_and_drops_forget() {
        let c = ReplicaCache::default();
        keep(
            &c,
            "old",
            &Leased::granted(desc(0), Instant::now()),
            Instant::now(),
        );
        assert_eq!(c.len(), 0);
        let now = Instant::now();
        keep(&c, "a", &Leased::granted(desc(10_000), now), now);
        keep(&c, "b", &Leased::granted(desc(10_000), now), now);
        c.drop_keys(["a"]);
        assert!(c.get("a", now).is_none());
        assert!(c.get("b", now).is_some());
        c.clear();
        assert!(c.get("b", now).is_none());
    }

    #[test]
    fn a_full_cache_lets_the_oldest_go_one_at_a_time() {
        let c = ReplicaCache::with_capacity(100);
        let now = Instant::now();
        let keep = |k: &str| keep(&c, k, &Leased::granted(desc(60_000), now), now);
        for i in 0..100 {
            keep(&format!("k{i}"));
        }
        keep("k0"); // kept again: now the newest
        for i in 100..150 {
            keep(&format!("k{i}"));
        }
        assert_eq!(c.len(), 100);
        let kept = |i: usize| c.get(&format!("k{i}"), now).is_some();
        assert!(kept(0), "kept again, so not the oldest");
        assert!((1..=50).all(|i| !kept(i)), "the oldest went first");
        assert!((51..150).all(kept));
        // A key kept again takes a new place and leaves its old one empty: keeping
        // the same 50 keys over and over, each is kept once, and they outlive the rest.
        for _ in 0..4 {
            for i in 100..150 {
                keep(&format!("k{i}"));
            }
        }
        assert_eq!(c.lock().ring.len(), 100);
        assert_eq!(c.len(), 50);
        assert!((100..150).all(kept) && !kept(0) && !kept(99));
        c.clear();
        assert_eq!((c.len(), c.lock().ring.len()), (0, 0));
        keep("again");
        assert!(c.get("again", now).is_some() && c.len() == 1);
    }

    #[test]
    fn the_tables_are_sized_once_at_the_first_insert() {
        let c = ReplicaCache::with_capacity(1000);
        let sizes = || {
            let inner = c.lock();
            (inner.index.buckets(), inner.ring.capacity())
        };
        assert_eq!(sizes(), (0, 0));
        let now = Instant::now();
        keep(&c, "k0", &Leased::granted(desc(60_000), now), now);
        let sized = sizes();
        assert!(sized.0 * 3 >= 1000 * 4 && sized.1 >= 1000, "{sized:?}");
        for i in 1..3000 {
            keep(
                &c,
                &format!("k{i}"),
                &Leased::granted(desc(60_000), now),
                now,
            );
        }
        assert_eq!(sizes(), sized);
        assert_eq!(c.len(), 1000);
    }

    #[test]
    fn expired_entries_leave_from_the_front_as_new_ones_come() {
        let c = ReplicaCache::with_capacity(1000);
        let t0 = Instant::now();
        // 12 s leases: usable for 11 s (margin 1 s).
        for i in 0..10 {
            let at = t0 + Duration::from_millis(i);
            keep(
                &c,
                &format!("old{i}"),
                &Leased::granted(desc(12_000), at),
                at,
            );
        }
        let later = t0 + Duration::from_millis(11_005);
        keep(&c, "new", &Leased::granted(desc(12_000), later), later);
        // The six whose room ended by now are gone; the four after them stay.
        assert_eq!(c.len(), 5);
        assert!(c.get("old6", later).is_some() && c.get("old5", later).is_none());
    }

    #[test]
    fn a_cache_expired_whole_is_let_go_a_few_entries_per_insert() {
        let c = ReplicaCache::with_capacity(100);
        let t0 = Instant::now();
        for i in 0..100 {
            keep(&c, &format!("k{i}"), &Leased::granted(desc(8_000), t0), t0);
        }
        let later = t0 + Duration::from_secs(60);
        assert!(
            c.get("k5", later).is_none(),
            "expired entries are never served"
        );
        keep(&c, "new", &Leased::granted(desc(8_000), later), later);
        assert_eq!(c.len(), 100 - EXPIRED_PER_INSERT + 1);
        for i in 0..20 {
            keep(
                &c,
                &format!("n{i}"),
                &Leased::granted(desc(8_000), later),
                later,
            );
        }
        assert_eq!(c.len(), 21);
    }

    #[test]
    fn keys_sharing_a_tag_are_told_apart_by_their_keys() {
        let c = ReplicaCache::default();
        let now = Instant::now();
        keep(&c, "b", &Leased::granted(desc(50_000), now), now);
        {
            // As if "b" had the tag of "a": it takes a's home bucket, a goes after it.
            let mut inner = c.lock();
            let (ta, tb) = (inner.tag("a"), inner.tag("b"));
            let (bucket, slot) = inner.index.find(tb, |_| true).unwrap();
            inner.index.remove_at(bucket);
            inner.ring[slot as usize].as_mut().unwrap().tag = ta;
            inner.index.insert(ta, slot);
        }
        keep(&c, "a", &Leased::granted(desc(60_000), now), now);
        assert_eq!(c.get("a", now).map(|l| l.desc.lease_ms), Some(60_000));
        c.drop_keys(["a"]);
        assert!(c.get("a", now).is_none());
        assert_eq!(c.len(), 1, "the other key under that tag stays");
        keep(&c, "a", &Leased::granted(desc(70_000), now), now);
        assert_eq!(c.get("a", now).map(|l| l.desc.lease_ms), Some(70_000));
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn a_key_counts_as_read_before_from_its_second_lookup_within_two_generations() {
        let c = ReplicaCache::default();
        let now = Instant::now();
        let looked = |key: &str| match c.look_up(&[key], now).pop() {
            Some(Looked::Kept(_)) => "kept",
            Some(Looked::ReadBefore) => "read before",
            Some(Looked::New) => "new",
            None => "nothing",
        };
        // The filter is random (its hash is keyed): a key is "new" for sure only when
        // no word says otherwise, so the keys below that must be new are picked so.
        let unseen = |prefix: &str| {
            (0..)
                .map(|i| format!("{prefix}{i}"))
                .find(|k| {
                    let inner = c.lock();
                    !inner.read_before.seen(inner.hash(k))
                })
                .expect("a key the filter has not seen")
        };
        let seen = |key: &str| {
            let inner = c.lock();
            inner.read_before.seen(inner.hash(key))
        };
        let k = unseen("k");
        assert_eq!(looked(&k), "new");
        assert_eq!(looked(&k), "read before");
        c.insert(&k, &Leased::granted(desc(60_000), now), now);
        assert_eq!(looked(&k), "kept");
        // A mark lasts through the next generation: a thousand keys marked, then a
        // generation of others, are all still read before.
        let marked: Vec<String> = (0..1000).map(|i| unseen(&format!("m{i}-"))).collect();
        for key in &marked {
            assert_eq!(looked(key), "new");
        }
        for i in 0..READ_BEFORE_MARKS {
            c.mark_read(&format!("x{i}"));
        }
        assert!(
            marked.iter().all(|key| seen(key)),
            "marked in the previous generation"
        );
        // Not past it: after two more generations, only the filter's few false
        // positives (under a tenth when both are full) still pass for read before.
        for i in 0..2 * READ_BEFORE_MARKS {
            c.mark_read(&format!("y{i}"));
        }
        let still = marked.iter().filter(|key| seen(key)).count();
        assert!(
            still < 200,
            "{still} of 1000 marks outlived two generations"
        );
        // A key read over and over stays read lately, and kept: each read marks it.
        assert_ne!(looked(&k), "nothing");
        for i in 0..3 * READ_BEFORE_MARKS {
            c.mark_read(&format!("z{i}"));
            if i % (READ_BEFORE_MARKS / 2) == 0 {
                assert_eq!(looked(&k), "kept");
            }
        }
        // A batch: each key answered in its place.
        let once = unseen("once");
        assert_eq!(looked(&once), "new");
        let fresh = unseen("fresh");
        let keys = [k.as_str(), fresh.as_str(), once.as_str()];
        let got: Vec<_> = c
            .look_up(&keys, now)
            .into_iter()
            .map(|l| match l {
                Looked::Kept(_) => 0,
                Looked::ReadBefore => 1,
                Looked::New => 2,
            })
            .collect();
        assert_eq!(got, [0, 2, 1]);
        // Few keys never read pass for read before.
        let passed = (0..1000).filter(|i| seen(&format!("new{i}"))).count();
        assert!(
            passed < 200,
            "{passed} of 1000 new keys passed for read before"
        );
    }

    #[test]
    fn touches_queue_per_batch_and_come_due_by_count() {
        let c = ReplicaCache::default();
        assert!(!c.touched(Vec::new()));
        assert!(!c.touched(vec!["a".into(), "b".into()]));
        c.touched(vec!["c".into()]); // due or not, depending on how slow this runs
        assert_eq!(
            c.take_touches(),
            vec![vec!["a".to_owned(), "b".to_owned()], vec!["c".to_owned()]]
        );
        assert!(c.take_touches().is_empty());
        let many: Vec<String> = (0..TOUCH_FLUSH_KEYS).map(|i| i.to_string()).collect();
        assert!(c.touched(many));
    }
}
