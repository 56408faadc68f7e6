//! Approximate-LRU eviction by sampling: a round looks at a bounded sample of objects
//! whose lease has expired, evicts the least recently used first, soft-pinned ones
//! only when nothing else is left, hard-pinned never.

use std::sync::atomic::Ordering;

use super::{Master, Object};

/// Objects sampled per shard per round.
const SAMPLE_PER_SHARD: usize = 8;

/// Whether an object may be evicted now: complete, not hard-pinned, lease expired, and
/// soft pin expired unless soft-pinned objects are fair game this round.
fn evictable(o: &Object, now: u64, allow_soft_pinned: bool) -> bool {
    o.complete
        && !o.hard_pin
        && o.lease_until_ms <= now
        && (allow_soft_pinned || o.soft_pin_until_ms <= now)
}

impl Master {
    /// Evicts until at least `want` bytes are freed or nothing evictable is left in a
    /// round's sample. Returns the bytes freed.
    pub(super) fn evict(&self, want: u64, allow_soft_pinned: bool) -> u64 {
        let mut freed = 0;
        // Bounded: each round evicts at least one object or stops.
        for _ in 0..1024 {
            if freed >= want {
                break;
            }
            let now = self.clock.now_ms();
            let mut sample = Vec::new();
            let start = (self.next_seed() % self.shards.len() as u64) as usize;
            for i in 0..self.shards.len() {
                let shard = &self.shards[(start + i) % self.shards.len()];
                let map = Self::lock(shard);
                // Start at a random position: always sampling the head of the table
                // would leave objects further along it never evicted.
                let skip = (self.next_seed() % map.len().max(1) as u64) as usize;
                let rotated = map.iter().skip(skip).chain(map.iter().take(skip));
                let candidates = rotated.filter(|(_, o)| evictable(o, now, allow_soft_pinned));
                for (k, o) in candidates.take(SAMPLE_PER_SHARD) {
                    sample.push((o.soft_pin_until_ms > now, o.last_access_ms, k.clone()));
                }
            }
            if sample.is_empty() {
                break;
            }
            sample.sort();
            // Evict the older half of the sample (at least one) per round.
            let take = sample.len().div_ceil(2);
            let mut progressed = false;
            for (_, _, key) in sample.into_iter().take(take) {
                let mut map = Self::lock(self.shard(&key));
                // Recheck under the lock: it may have been leased or removed meanwhile.
                if !map
                    .get(&key)
                    .is_some_and(|o| evictable(o, now, allow_soft_pinned))
                {
                    continue;
                }
                if let Some(o) = map.remove(&key) {
                    drop(map);
                    freed += self.account_eviction(&o);
                    progressed = true;
                    if !o.groups.is_empty() {
                        freed += self.evict_group(&key, &o.groups, now, allow_soft_pinned);
                    }
                }
                if freed >= want {
                    break;
                }
            }
            if !progressed {
                break;
            }
        }
        freed
    }

    /// Counts an evicted object; returns its bytes (freed when `o` drops).
    fn account_eviction(&self, o: &Object) -> u64 {
        let bytes: u64 = o
            .replicas
            .iter()
            .flatten()
            .map(|p| p.alloc.block_size())
            .sum();
        self.objects.fetch_sub(1, Ordering::Relaxed);
        self.evicted_objects.fetch_add(1, Ordering::Relaxed);
        self.evicted_bytes.fetch_add(bytes, Ordering::Relaxed);
        bytes
    }

    /// Group members share an evicted object's fate (pins and leases still hold).
    fn evict_group(&self, key: &str, groups: &[String], now: u64, allow_soft_pinned: bool) -> u64 {
        let mut freed = 0;
        for m in self.group_members(key, groups) {
            let mut map = Self::lock(self.shard(&m));
            if map
                .get(&m)
                .is_some_and(|o| evictable(o, now, allow_soft_pinned))
            {
                if let Some(o) = map.remove(&m) {
                    drop(map);
                    freed += self.account_eviction(&o);
                }
            }
        }
        freed
    }

    /// Above the high watermark, frees down to `watermark - ratio` of capacity.
    pub(super) fn evict_above_watermark(&self) {
        let (capacity, used) = self.segments.capacity_and_used();
        if capacity == 0 || (used as f64) < capacity as f64 * self.config.eviction_high_watermark {
            return;
        }
        let target = capacity as f64
            * (self.config.eviction_high_watermark - self.config.eviction_ratio).max(0.0);
        let want = used.saturating_sub(target as u64);
        let freed = self.evict(want, false);
        if freed < want {
            self.evict(want - freed, true);
        }
    }
}
