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

#[cfg(test)]
mod tests {
    //! Victim choice, driven with a manual clock and one object shard, so that a
    //! round's sample holds every candidate and the order is exact.

    use super::super::{Clock, Master, MasterConfig};
    use crate::store::protocol::{ReplicateConfig, SegmentInfo};

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const OBJ: u64 = 64 * KIB;

    fn master(clock: &Clock, segment: u64) -> Master {
        let mut cfg = MasterConfig::default();
        cfg.allocator.slab_size = MIB;
        cfg.shards = 1;
        let m = Master::with_clock(cfg, clock.clone());
        let seg = SegmentInfo {
            name: "seg".into(),
            base: 1 << 40,
            size: segment,
        };
        m.mount(1, seg).unwrap();
        m
    }

    /// A complete object of `OBJ` bytes, last touched now; the clock then moves on a
    /// millisecond so every object has its own age.
    fn put(m: &Master, clock: &Clock, key: &str, cfg: &ReplicateConfig) {
        m.put_start(1, key, OBJ, cfg, false).unwrap();
        m.put_end(1, key, 0).unwrap();
        clock.advance(1);
    }

    fn present(m: &Master, keys: &[&str]) -> Vec<bool> {
        keys.iter().map(|k| m.exists(k).unwrap()).collect()
    }

    #[test]
    fn least_recently_used_first_and_pins_leases_and_writers_hold() {
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
        m.put_start(1, "writing", OBJ, &plain, false).unwrap();
        put(&m, &clock, "older", &plain);
        let all = ["soft", "hard", "old", "mid", "new", "leased", "older"];
        // Seven objects and the one being written hold a block each.
        let block = m.stats().used / 8;
        assert_eq!(block, OBJ, "a 64 KiB object takes one 64 KiB block");

        // One byte wanted: exactly one victim, the least recently used plain object.
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
    fn the_watermark_frees_down_to_its_target_unpinned_first() {
        let clock = Clock::manual();
        let mut m = master(&clock, 4 * MIB);
        let (capacity, _) = m.segments.capacity_and_used();
        assert_eq!(capacity, 4 * MIB);
        let soft = ReplicateConfig {
            soft_pin: true,
            ..Default::default()
        };
        // 40 objects: 2.5 MiB of 4, under the default 90% watermark.
        for i in 0..30 {
            put(&m, &clock, &format!("p{i}"), &ReplicateConfig::default());
        }
        for i in 0..10 {
            put(&m, &clock, &format!("s{i}"), &soft);
        }
        m.evict_above_watermark();
        assert_eq!(m.stats().objects, 40, "below the watermark nothing goes");

        // Above 50%, free down to 50% - 10% = 1.6 MiB: 0.9 MiB, more than the
        // soft-pinned objects alone could give but less than the unpinned ones.
        m.config.eviction_high_watermark = 0.5;
        m.config.eviction_ratio = 0.1;
        let target = (capacity as f64 * 0.4) as u64;
        let want = 40 * OBJ - target;
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
}
