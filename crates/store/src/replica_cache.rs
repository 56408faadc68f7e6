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
//! Reads served from here still count for eviction: their keys are queued, per read
//! batch and in batch order, and sent as one `Touch` request, pipelined ahead of the
//! client's next master request or flushed after `TOUCH_FLUSH_AFTER`.

#![forbid(unsafe_code)]

use crate::util::sync::Unpoisoned;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::protocol::ObjectDesc;

/// Descriptors kept at most; past this, the oldest kept goes for each new one.
const MAX_ENTRIES: usize = 1 << 16;
/// Queued touches are sent at the latest this long after the first of them.
pub const TOUCH_FLUSH_AFTER: Duration = Duration::from_millis(50);
/// Queued touches are sent once this many keys wait.
const TOUCH_FLUSH_KEYS: usize = 4096;

/// A descriptor and the lease it came with.
#[derive(Clone, Debug)]
pub struct Leased {
    /// Shared with the cache's entry: a batch of kept descriptors is served without
    /// copying one.
    pub desc: Arc<ObjectDesc>,
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
            desc: Arc::new(desc),
            lease_ends,
            cached: false,
            staged: false,
        }
    }
}

/// How long before its lease ends an entry stops being handed out: an eighth of the
/// lease, at most a second (room for the read itself and for clock drift).
fn margin(lease_ms: u64) -> Duration {
    Duration::from_millis((lease_ms / 8).min(1000))
}

/// A key's place in the keeping order, with the stamp and end of use its entry had
/// when kept: an entry kept again or dropped since leaves a stale place, skipped when
/// met. The end of use is here too, so that expiry is seen without a lookup.
struct Place {
    stamp: u64,
    usable_until: Instant,
    key: Arc<str>,
}

/// A kept descriptor: until when it is handed out, and the stamp of its place in
/// the keeping order.
struct Kept {
    desc: Arc<ObjectDesc>,
    usable_until: Instant,
    stamp: u64,
}

struct Inner {
    capacity: usize,
    entries: HashMap<Arc<str>, Kept>,
    /// The keeping order, oldest first ([`Place`]). Leases are alike, so the oldest
    /// kept is about the first to expire: a full cache lets one go per new one (a
    /// fresh-key workload fills it in a fraction of a second), never all at once.
    order: VecDeque<Place>,
    next_stamp: u64,
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
    /// Lets go of the entry at the front of the order, if the place is not stale;
    /// false when the order is empty.
    fn drop_front(&mut self) -> bool {
        let Some(place) = self.order.pop_front() else {
            return false;
        };
        // One lookup in the common case; a stale place puts back what it took.
        if let Some((key, kept)) = self.entries.remove_entry(&place.key) {
            if kept.stamp != place.stamp {
                self.entries.insert(key, kept);
            }
        }
        true
    }

    /// Lets go of the oldest entries until there is room for one more.
    fn make_room(&mut self) {
        while self.entries.len() >= self.capacity && self.drop_front() {}
    }

    /// Lets go of the entries at the front whose use has ended.
    fn drop_expired(&mut self, now: Instant) {
        while self.order.front().is_some_and(|p| p.usable_until <= now) {
            self.drop_front();
        }
    }
}

impl ReplicaCache {
    /// A cache keeping at most `capacity` descriptors. Its tables are sized for them
    /// at once (pages are touched as entries come): growing one meant rehashing every
    /// key, a read stalled for milliseconds at each doubling.
    fn with_capacity(capacity: usize) -> ReplicaCache {
        let capacity = capacity.max(1);
        ReplicaCache {
            inner: Mutex::new(Inner {
                capacity,
                entries: HashMap::with_capacity(capacity),
                order: VecDeque::with_capacity(capacity),
                next_stamp: 0,
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
    pub fn get(&self, key: &str, now: Instant) -> Option<Leased> {
        let inner = self.lock();
        let kept = inner.entries.get(key)?;
        if now >= kept.usable_until {
            return None;
        }
        let lease_ends = kept.usable_until + margin(kept.desc.lease_ms);
        Some(Leased {
            desc: kept.desc.clone(),
            lease_ends,
            cached: true,
            staged: false,
        })
    }

    /// Keeps a freshly granted descriptor.
    pub fn insert(&self, key: &str, leased: &Leased) {
        self.insert_at(key, leased, Instant::now());
    }

    fn insert_at(&self, key: &str, leased: &Leased, now: Instant) {
        let usable_until = leased.lease_ends - margin(leased.desc.lease_ms);
        if usable_until <= now {
            return;
        }
        let mut inner = self.lock();
        inner.drop_expired(now);
        let stamp = inner.next_stamp;
        inner.next_stamp += 1;
        let kept = Kept {
            desc: leased.desc.clone(),
            usable_until,
            stamp,
        };
        let key = match inner.entries.get_key_value(key) {
            Some((k, _)) => {
                let k = k.clone();
                inner.entries.insert(k.clone(), kept);
                k
            }
            None => {
                inner.make_room();
                let k: Arc<str> = Arc::from(key);
                inner.entries.insert(k.clone(), kept);
                k
            }
        };
        inner.order.push_back(Place {
            stamp,
            usable_until,
            key,
        });
        if inner.order.len() > 2 * inner.capacity {
            // Keys kept again and again leave stale places behind: bound them.
            let Inner { entries, order, .. } = &mut *inner;
            order.retain(|p| entries.get(&p.key).is_some_and(|e| e.stamp == p.stamp));
        }
    }

    /// Forgets `keys` (written, removed, or read wrongly).
    pub fn drop_keys<'a>(&self, keys: impl IntoIterator<Item = &'a str>) {
        let mut inner = self.lock();
        for k in keys {
            inner.entries.remove(k);
        }
    }

    /// Forgets everything (a remove by pattern or of all objects).
    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.entries.clear();
        inner.order.clear();
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
        self.lock().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(lease_ms: u64) -> ObjectDesc {
        ObjectDesc {
            size: 4,
            crc32c: 1,
            lease_ms,
            replicas: Vec::new(),
        }
    }

    #[test]
    fn an_entry_is_served_only_within_its_lease_less_the_margin() {
        let c = ReplicaCache::default();
        let asked = Instant::now();
        c.insert("k", &Leased::granted(desc(8000), asked));
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
        c.insert("old", &Leased::granted(desc(0), Instant::now()));
        assert_eq!(c.len(), 0);
        let now = Instant::now();
        c.insert("a", &Leased::granted(desc(10_000), now));
        c.insert("b", &Leased::granted(desc(10_000), now));
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
        let keep = |k: &str| c.insert(k, &Leased::granted(desc(60_000), now));
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
        // Keeping the same keys over and over leaves the order bounded.
        for round in 0..50 {
            for i in 100..150 {
                keep(&format!("k{i}"));
            }
            let order = c.lock().order.len();
            assert!(order <= 200, "round {round}: {order} places");
        }
        assert_eq!(c.len(), 100);
        assert!((51..150).all(kept));
        c.clear();
        assert_eq!((c.len(), c.lock().order.len()), (0, 0));
    }

    #[test]
    fn expired_entries_leave_from_the_front_as_new_ones_come() {
        let c = ReplicaCache::with_capacity(1000);
        let t0 = Instant::now();
        // 12 s leases: usable for 11 s (margin 1 s).
        for i in 0..10 {
            let at = t0 + Duration::from_millis(i);
            c.insert_at(&format!("old{i}"), &Leased::granted(desc(12_000), at), at);
        }
        let later = t0 + Duration::from_millis(11_005);
        c.insert_at("new", &Leased::granted(desc(12_000), later), later);
        // The six whose room ended by now are gone; the four after them stay.
        assert_eq!(c.len(), 5);
        assert!(c.get("old6", later).is_some() && c.get("old5", later).is_none());
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
