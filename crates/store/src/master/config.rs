//! Master settings, with Mooncake's defaults.

use std::time::Duration;

use crate::allocator::AllocatorConfig;

/// How replicas are placed across segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocationStrategy {
    /// Preferred segments first, then from a random starting segment onwards.
    Random,
    /// The freest segments (by free ratio) first.
    FreeRatioFirst,
    /// The writer's own segments first, then as `Random`.
    LocalFirst,
}

impl AllocationStrategy {
    /// Parses a strategy name (`random`, `free_ratio_first`, `local_first`).
    pub fn parse(s: &str) -> Option<AllocationStrategy> {
        match s {
            "random" => Some(AllocationStrategy::Random),
            "free_ratio_first" => Some(AllocationStrategy::FreeRatioFirst),
            "local_first" => Some(AllocationStrategy::LocalFirst),
            _ => None,
        }
    }
}

/// 16 TiB: with 4 MiB slabs, about 4M slab entries (some 200 MB of master memory).
pub const DEFAULT_MAX_SEGMENT_SIZE: u64 = 16 << 40;

/// Tunables of the store [`Master`](super::Master).
#[derive(Clone, Debug)]
pub struct MasterConfig {
    /// How long a reader may use a replica list (`default_kv_lease_ttl`).
    pub lease_ttl: Duration,
    /// Pool usage above which background eviction (on `tick`) runs; 1.0 (the
    /// default) turns it off, since a put evicts just what it needs itself.
    pub eviction_high_watermark: f64,
    /// Share of the pool background eviction frees below the watermark.
    pub eviction_ratio: f64,
    /// A client silent this long loses its segments.
    pub client_ttl: Duration,
    /// An unfinished put older than this may be taken over by a new put of the key.
    pub put_start_discard_timeout: Duration,
    /// Space of an abandoned put is reused only after this long (its writer may still
    /// be writing into it).
    pub put_start_release_timeout: Duration,
    /// How replicas are placed across segments.
    pub allocation_strategy: AllocationStrategy,
    /// Per-segment allocator settings.
    pub allocator: AllocatorConfig,
    /// Shards of the object table (more shards, less contention).
    pub shards: usize,
    /// Largest segment a client may mount. The master's memory grows with mounted
    /// bytes (a slab table entry per slab), so this bounds what one Mount can cost it.
    pub max_segment_size: u64,
    /// Work one remove-by-regex may spend matching keys (a unit is about a nanosecond
    /// in a release build): a costlier pattern is refused, removing nothing.
    pub regex_budget: u64,
    /// Share of the pool's capacity one host (see `quota::Payer`) may hold in
    /// unfinished puts (started, not ended); a PutStart beyond it gets
    /// `NoAvailableHandle` and changes nothing.
    pub max_unfinished_put_ratio: f64,
    /// How long a `PutEnd` waits for the nodes holding the object to record it in
    /// their catalogs (what a restarted master rebuilds from); zero: do not wait.
    pub catalog_ack_timeout: Duration,
    /// How long a node's catalog poll waits for news before it is answered empty
    /// (events nobody waits for reach the node within this).
    pub catalog_poll_wait: Duration,
    /// An object evicted from a node that has a disk tier goes there instead of away
    /// (Mooncake's `--enable_offload` / `--offload_on_evict`).
    pub offload_on_evict: bool,
    /// Reads of an object on disk before it is kept in memory again; below that a read
    /// stages it in memory for the reader only (`--promotion_admission_threshold`).
    pub promotion_admission_threshold: u32,
    /// Bytes of catalog one segment's unfinished remount may hold (chunks sent with
    /// `last=false` wait for the last one): a chunk past it ends that remount.
    pub max_remount_bytes_per_segment: u64,
    /// Bytes of catalog all unfinished remounts together may hold.
    pub max_remount_bytes: u64,
    /// For this long after it starts (and while remounts it asked for are arriving,
    /// up to ten times as long), the master answers a lookup that finds a key missing
    /// with `UnavailableInCurrentStatus` instead of a miss: a restarted master (or a
    /// new leader) starts empty and the node holding the key may not have remounted
    /// yet. Readers wait and ask again (`store::rpc`). Zero (the default for a master
    /// built in process) answers misses at once; `mooncake master` uses 2 s, about two
    /// of a node's ping intervals.
    pub recovery_window: Duration,
}

impl Default for MasterConfig {
    fn default() -> Self {
        MasterConfig {
            lease_ttl: Duration::from_millis(10_000),
            eviction_high_watermark: 1.0,
            eviction_ratio: 0.05,
            client_ttl: Duration::from_secs(10),
            put_start_discard_timeout: Duration::from_secs(30),
            put_start_release_timeout: Duration::from_secs(600),
            allocation_strategy: AllocationStrategy::Random,
            allocator: AllocatorConfig::default(),
            shards: 64,
            max_segment_size: DEFAULT_MAX_SEGMENT_SIZE,
            regex_budget: 300_000_000,
            max_unfinished_put_ratio: 0.5,
            catalog_ack_timeout: Duration::from_secs(2),
            catalog_poll_wait: Duration::from_millis(500),
            offload_on_evict: true,
            promotion_admission_threshold: 1,
            // About 1.3 million object pieces per node; four nodes at once.
            max_remount_bytes_per_segment: 256 << 20,
            max_remount_bytes: 1 << 30,
            recovery_window: Duration::ZERO,
        }
    }
}
