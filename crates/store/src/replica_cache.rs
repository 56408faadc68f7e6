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
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::protocol::ObjectDesc;

/// Descriptors kept at most; past this, expired ones go, then (if still full) all.
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

#[derive(Default)]
struct Inner {
    entries: HashMap<String, (Arc<ObjectDesc>, Instant)>,
    /// Keys of reads served from here, one list per read batch, not yet told.
    touched: Vec<Vec<String>>,
    touched_keys: usize,
    first_touch: Option<Instant>,
}

/// The cache (one per client; shared by its threads).
#[derive(Default)]
pub struct ReplicaCache {
    inner: Mutex<Inner>,
}

impl ReplicaCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    /// The kept descriptor of `key`, if its lease still has room for a read.
    pub fn get(&self, key: &str, now: Instant) -> Option<Leased> {
        let inner = self.lock();
        let (desc, usable_until) = inner.entries.get(key)?;
        if now >= *usable_until {
            return None;
        }
        let lease_ends = *usable_until + margin(desc.lease_ms);
        Some(Leased {
            desc: desc.clone(),
            lease_ends,
            cached: true,
            staged: false,
        })
    }

    /// Keeps a freshly granted descriptor.
    pub fn insert(&self, key: &str, leased: &Leased) {
        let usable_until = leased.lease_ends - margin(leased.desc.lease_ms);
        if usable_until <= Instant::now() {
            return;
        }
        let mut inner = self.lock();
        if inner.entries.len() >= MAX_ENTRIES && !inner.entries.contains_key(key) {
            let now = Instant::now();
            inner.entries.retain(|_, (_, until)| *until > now);
            if inner.entries.len() >= MAX_ENTRIES {
                inner.entries.clear();
            }
        }
        inner
            .entries
            .insert(key.to_owned(), (leased.desc.clone(), usable_until));
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
        self.lock().entries.clear();
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

    /// Descriptors kept now (expired ones included until replaced).
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
