//! One shard of the object table: objects by key, and the victim order of those that
//! may be evicted, kept in step (every removal also leaves the order).

use std::collections::HashMap;
use std::sync::Arc;

use super::policy::{Policy, NONE};
use super::Object;

/// One shard's objects and their eviction order.
#[derive(Default)]
pub(super) struct Shard {
    pub objects: HashMap<Arc<str>, Object>,
    pub policy: Policy,
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
        self.objects.keys().map(|k| &**k)
    }

    /// Removes `key` from the table and from the victim order.
    pub fn remove(&mut self, key: &str) -> Option<Object> {
        let mut o = self.objects.remove(key)?;
        self.unlist(&mut o);
        Some(o)
    }

    /// Keeps the objects `keep` approves; the others leave the victim order too.
    pub fn retain(&mut self, mut keep: impl FnMut(&str, &mut Object) -> bool) {
        let policy = &mut self.policy;
        self.objects.retain(|k, o| {
            let kept = keep(k, o);
            if !kept && o.node != NONE {
                policy.remove(o.node);
                o.node = NONE;
            }
            kept
        });
    }

    /// Takes `o` out of the victim order (it stays in the table).
    pub fn unlist(&mut self, o: &mut Object) {
        if o.node != NONE {
            self.policy.remove(o.node);
            o.node = NONE;
        }
    }

    /// Counts a hit of `key` in the victim order, adding it there first if needed (only
    /// then is `hash` asked for the key's hash); objects that may never be evicted
    /// (unfinished, hard-pinned) stay out. True when `key` was added.
    pub fn hit(&mut self, key: &str, hash: impl FnOnce() -> u64, floor: u64, seq: u32) -> bool {
        let Some((k, o)) = self.objects.get_key_value(key) else {
            return false;
        };
        if !o.complete || o.hard_pin {
            return false;
        }
        if o.node != NONE {
            self.policy.hit(o.node, floor, seq);
            return false;
        }
        let node = self.policy.insert_hit(k.clone(), hash(), floor, seq);
        if let Some(o) = self.objects.get_mut(key) {
            o.node = node;
        }
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
