//! The store's control plane: object metadata (sharded), mounted segments with one
//! slab allocator each, leases, eviction, client liveness. It never touches data bytes.

#![forbid(unsafe_code)]

mod answer;
mod backing;
mod catalog;
mod clock;
mod config;
mod copy;
mod drain;
mod eviction;
mod metrics;
mod note_slots;
mod offload;
mod owner;
mod policy;
mod quota;
mod replicas;
mod segment_log;
mod segments;
mod table;

pub use backing::SegmentReach;
pub use clock::Clock;
pub use config::{AllocationStrategy, MasterConfig};
pub use drain::DrainRisk;

use crate::util::sync::Unpoisoned;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Code, Error, Result};
use crate::protocol::{
    check_key, shown_key, CatalogEntry, KeyResult, NoteWrite, ObjectDesc, PoolStats, ReplicaDesc,
    ReplicateConfig, Request, Response, SegmentInfo, MAX_SOFT_PIN_TTL_MS,
};
use crate::util::regex::Regex;
use replicas::Replicas;
use segments::{PieceAlloc, ReplicaAlloc, Segment, SegmentTable};
use table::Shard;

/// The most keys a `PutStartNoted` batch gets notes for (see `catalog::NoteHold`).
const MAX_NOTED_BATCH: usize = 8;

/// One object's metadata, packed: a master holds millions (bench/README.md).
struct Object {
    size: u64,
    crc32c: u32,
    /// False while the writer is still moving bytes (between PutStart and PutEnd).
    complete: bool,
    /// The put in progress, while not `complete`.
    pending: Option<Box<Pending>>,
    replicas: Replicas,
    lease_until_ms: u64,
    /// This object's place in its shard's victim order (`policy::NONE`: not evictable
    /// by policy, being unfinished or hard-pinned).
    node: u32,
    hard_pin: bool,
    soft_pin_until_ms: u64,
    /// Groups whose members share this object's lease and eviction fate.
    groups: Box<[String]>,
    /// Which put wrote it (`Master::next_version`): a copy a node re-announces is
    /// this object only at this version (`Master::judge_claim`).
    version: u64,
    /// Its copy in a node's disk tier, if any.
    disk: Option<Box<offload::DiskCopy>>,
}

/// An unfinished put: who writes, since when, and the writer's unfinished-put quota
/// the object takes until its PutEnd.
struct Pending {
    writer: u64,
    started_ms: u64,
    _hold: quota::Hold,
    /// Note slots lent for the pieces (`PutStartNoted`), and the checksum and version
    /// the notes were sealed with; empty when the put waits for the nodes instead.
    notes: Vec<catalog::NoteHold>,
    noted: Option<(u32, u64)>,
}

impl Object {
    /// Whether `client` is writing this unfinished object.
    fn written_by(&self, client: u64) -> bool {
        !self.complete && self.pending.as_ref().is_some_and(|p| p.writer == client)
    }

    /// When the unfinished put began (0 for a complete object).
    fn started_ms(&self) -> u64 {
        self.pending.as_ref().map_or(0, |p| p.started_ms)
    }
}

/// Space that must not be reused yet (an abandoned writer or a force-removed object's
/// readers may still touch it); freed when its time comes.
struct Quarantined {
    until_ms: u64,
    replicas: Replicas,
}

struct ClientState {
    last_ping_ms: u64,
}

/// Where a key's lookup goes: its shard, and its tag in that shard's table.
#[derive(Clone, Copy)]
pub(super) struct Located {
    shard: usize,
    tag: u32,
}

/// The store master: object metadata, leases, placement and eviction.
pub struct Master {
    config: MasterConfig,
    clock: Clock,
    shards: Box<[Mutex<Shard>]>,
    segments: SegmentTable,
    clients: Mutex<HashMap<u64, ClientState>>,
    put_quota: quota::PutQuota,
    quarantine: Mutex<Vec<Quarantined>>,
    /// Copies read back from a disk tier for one reader, by key and first piece's
    /// address, until the reader is done (`ReleaseStaged`) or its lease ends.
    staged: Mutex<HashMap<(String, u64), offload::StagedCopy>>,
    /// Group id → member keys (pruned lazily when a member is gone).
    groups: Mutex<HashMap<String, Vec<String>>>,
    objects: AtomicU64,
    evicted_objects: AtomicU64,
    evicted_bytes: AtomicU64,
    aging: eviction::Aging,
    seed: AtomicU64,
    /// The metadata service nodes publish to, as `MetadataUrl` reports it.
    metadata_url: std::sync::OnceLock<String>,
    /// Node catalogs: this incarnation, versions, remounts in progress.
    catalogs: catalog::Catalogs,
    /// The key segment names' owner tickets are signed with.
    owners: owner::Owners,
    /// Replicas placed for copies and moves, until their client ends them.
    copies: copy::Copies,
    /// When this master started (its clock), for `recovering`.
    started_ms: u64,
    /// Reads each segment before it is mounted (`set_segment_reach`); unset, mounts
    /// are taken at their word.
    reach: std::sync::OnceLock<Arc<dyn SegmentReach>>,
    /// Answered requests, by kind, under Mooncake's metric names.
    request_metrics: metrics::RequestMetrics,
}

impl Master {
    /// A master on the system clock.
    pub fn new(config: MasterConfig) -> Master {
        Master::with_clock(config, Clock::system())
    }

    /// A master on `clock` (tests pass a manual one).
    pub fn with_clock(config: MasterConfig, clock: Clock) -> Master {
        let shards = (0..config.shards.max(1))
            .map(|_| Mutex::new(Shard::default()))
            .collect();
        Master {
            config,
            shards,
            segments: SegmentTable::default(),
            clients: Mutex::new(HashMap::new()),
            put_quota: quota::PutQuota::default(),
            quarantine: Mutex::new(Vec::new()),
            staged: Mutex::new(HashMap::new()),
            groups: Mutex::new(HashMap::new()),
            objects: AtomicU64::new(0),
            evicted_objects: AtomicU64::new(0),
            evicted_bytes: AtomicU64::new(0),
            aging: eviction::Aging::default(),
            seed: AtomicU64::new(0x9E37_79B9_7F4A_7C15),
            metadata_url: std::sync::OnceLock::new(),
            catalogs: catalog::Catalogs::new(),
            owners: owner::Owners::new(),
            copies: copy::Copies::default(),
            started_ms: clock.now_ms(),
            reach: std::sync::OnceLock::new(),
            request_metrics: metrics::RequestMetrics::default(),
            clock,
        }
    }

    /// The configuration the master was built with.
    pub fn config(&self) -> &MasterConfig {
        &self.config
    }

    /// Records the metadata service this master's nodes use (once; later calls are
    /// ignored). Clients that give no metadata URL ask for it (`Request::MetadataUrl`).
    pub fn set_metadata_url(&self, url: &str) {
        let _ = self.metadata_url.set(url.to_owned());
    }

    /// Has every mount and remount read its segment first (once; later calls are
    /// ignored): a segment no process backs is refused before it counts.
    pub fn set_segment_reach(&self, reach: Arc<dyn SegmentReach>) {
        let _ = self.reach.set(reach);
    }

    /// Refuses `segment` when the master cannot read it (see `backing`).
    fn check_backed(&self, segment: &SegmentInfo) -> Result<()> {
        let Some(reach) = self.reach.get() else {
            return Ok(());
        };
        reach.reach(segment).map_err(|e| {
            Error::new(
                Code::InvalidParams,
                format!(
                    "segment {} ({} bytes at {:#x}) refused: the master could not read it ({e}); \
                     a segment counts only once the master reached it",
                    segment.name, segment.size, segment.base
                ),
            )
        })
    }

    /// Signs segment names' owner tickets with `key` from now on (see `owner`): every
    /// master of a cluster should have the same one, known to no node, so that a
    /// restarted master still gives each name back to the node that held it.
    pub fn set_owner_key(&self, key: &[u8]) {
        self.owners.set_key(key);
    }

    /// Whether this master may still be getting objects back from nodes' catalogs
    /// (see `MasterConfig::recovery_window`).
    fn recovering(&self) -> bool {
        let window = self.config.recovery_window.as_millis() as u64;
        let age = self.clock.now_ms().saturating_sub(self.started_ms);
        age < window || (age < window.saturating_mul(10) && self.catalogs.remounts_pending())
    }

    /// Refuses a lookup that found something missing while the master recovers: the
    /// node holding it may not have remounted yet, so that is not yet a miss.
    fn unless_recovering(&self, something_missing: bool) -> Result<()> {
        if something_missing && self.recovering() {
            return Err(Error::new(
                Code::UnavailableInCurrentStatus,
                "the master just started and nodes are still remounting; ask again",
            ));
        }
        Ok(())
    }

    /// The metadata URL set by `set_metadata_url`, if any.
    pub fn metadata_url(&self) -> Option<&str> {
        self.metadata_url.get().map(String::as_str)
    }

    /// The master's clock.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    fn key_hash(key: &str) -> u64 {
        let mut h = DefaultHasher::new();
        key.hash(&mut h);
        h.finish()
    }

    fn shard(&self, key: &str) -> &Mutex<Shard> {
        &self.shards[self.shard_of(key)]
    }

    fn shard_of(&self, key: &str) -> usize {
        (Self::key_hash(key) % self.shards.len() as u64) as usize
    }

    /// Where `key`'s lookup goes, its index bucket asked into the cache on the way: a
    /// batch locates every key before it looks any up, so that their cache misses
    /// overlap rather than come one lookup after another.
    pub(super) fn locate(&self, key: &str) -> Located {
        let shard = self.shard_of(key);
        let tag = self.shards[shard].locked().objects.prefetch(key);
        Located { shard, tag }
    }

    fn next_seed(&self) -> u64 {
        // xorshift; only spreads placement, needs no quality.
        let mut x = self.seed.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.seed.store(x, Ordering::Relaxed);
        x
    }

    /// Answers one RPC request made in process (no network origin: quotas count per
    /// client id, see `quota::Payer`).
    pub fn handle(&self, req: Request) -> Result<Response> {
        self.handle_from(req, None)
    }

    /// Answers one RPC request that came from `peer` (the RPC server's view of the
    /// connection), which unfinished puts are counted against.
    pub fn handle_from(&self, req: Request, peer: Option<IpAddr>) -> Result<Response> {
        Ok(match req {
            Request::Ping { client } => Response::Ping {
                need_remount: !self.ping(client),
            },
            Request::Mount { client, segment } => {
                self.mount(client, segment)?;
                Response::Done
            }
            Request::MountExtra {
                client,
                id,
                segment,
            } => {
                self.mount_as(client, &id, segment)?;
                Response::Done
            }
            Request::CopyStart {
                client,
                key,
                source,
                targets,
            } => Response::CopyStart(self.copy_start(client, &key, &source, &targets)?),
            Request::CopyEnd {
                client,
                ticket,
                done,
            } => {
                self.copy_end(client, ticket, done)?;
                Response::Done
            }
            Request::Unmount { client, name } => {
                self.unmount(client, &name)?;
                Response::Done
            }
            Request::PutStart {
                client,
                items,
                config,
                upsert,
            } => Response::PutStart(
                items
                    .iter()
                    .map(|(k, s)| {
                        let payer = quota::Payer::of(peer, client);
                        self.put_start(client, payer, k, *s, &config, upsert)
                    })
                    .collect(),
            ),
            Request::PutStartNoted {
                client,
                items,
                config,
                upsert,
            } => {
                // A batch waits for its nodes' catalogs once, at its end: beyond a few
                // keys that costs less than sealing and landing a note per key.
                let noting = items.len() <= MAX_NOTED_BATCH;
                Response::PutStartNoted(
                    items
                        .iter()
                        .map(|(k, s, crc)| {
                            let payer = quota::Payer::of(peer, client);
                            let desc = self.put_start(client, payer, k, *s, &config, upsert)?;
                            let notes = match noting {
                                true => self.lend_notes(client, k, *crc),
                                false => Vec::new(),
                            };
                            Ok((desc, notes))
                        })
                        .collect(),
                )
            }
            Request::PutEnd { client, items } => {
                let mut committed = catalog::Commits::default();
                let results = eviction::tail_first(&items, |(k, crc)| {
                    self.put_end(client, k, *crc, &mut committed)
                });
                self.sink_batch_tail(&items, &results);
                self.await_catalogs(committed);
                Response::PerKey(results)
            }
            Request::PutRevoke { client, keys } => {
                let mut cleared = Vec::new();
                let results = keys
                    .iter()
                    .map(|k| self.put_revoke(client, k, &mut cleared))
                    .collect();
                // A failed put's notes must not bring it back after a restart: its
                // nodes clear them, and drop what they read of them at a reset.
                let timeout = self.config.catalog_ack_timeout;
                let mut seen = std::collections::HashSet::new();
                for seg in cleared.into_iter().filter(|s| seen.insert(s.id)) {
                    if let (Some(head), false) = (seg.log.head(), timeout.is_zero()) {
                        seg.log.wait_acked(head, timeout);
                    }
                }
                Response::PerKey(results)
            }
            Request::GetReplicas { keys } => {
                let descs = eviction::tail_first(&keys, |k| self.get_replicas(k));
                self.unless_recovering(descs.iter().any(|d| d.is_err()))?;
                Response::GetReplicas(descs)
            }
            Request::Exists { keys } => {
                let found: Vec<_> = keys.iter().map(|k| self.exists(k)).collect();
                self.unless_recovering(found.iter().any(|f| *f != Ok(true)))?;
                Response::Exists(found)
            }
            Request::GetReplicasKeepable { keys } => {
                let now = self.clock.now_ms();
                let answers = eviction::tail_first(&keys, |k| {
                    self.lookup_keepable(k, now, None, &mut answer::Build)
                });
                let (descs, keepable): (Vec<_>, _) = answers.into_iter().unzip();
                self.unless_recovering(descs.iter().any(|d| d.is_err()))?;
                Response::Keepable { descs, keepable }
            }
            Request::Touch { batches } => {
                for keys in &batches {
                    eviction::tail_first(keys, |k| self.touch_cached_read(k));
                }
                Response::Done
            }
            Request::Describe { keys } => {
                let (descs, disk): (Vec<_>, _) = keys.iter().map(|k| self.describe(k)).unzip();
                self.unless_recovering(descs.iter().any(|d| d.is_err()))?;
                Response::Described { descs, disk }
            }
            Request::ReleaseStaged { items } => {
                self.release_staged(items);
                Response::Done
            }
            Request::Remove { key, force } => {
                let removed = self.remove(&key, force);
                self.await_all_catalogs();
                removed.map_err(|c| Error::new(c, format!("remove {}", shown_key(&key))))?;
                Response::Count(1)
            }
            Request::RemoveAll { force } => {
                let n = self.remove_matching(|_| true, force);
                self.await_all_catalogs();
                Response::Count(n)
            }
            Request::RemoveByRegex { pattern, force } => {
                let re = Regex::new(&pattern)
                    .map_err(|e| Error::invalid(format!("regex {pattern:?}: {e}")))?;
                let n = self.remove_by_regex(&re, force);
                self.await_all_catalogs();
                Response::Count(n?)
            }
            Request::Stats => Response::Stats(self.stats()),
            Request::MetadataUrl => {
                Response::MetadataUrl(self.metadata_url().unwrap_or_default().to_owned())
            }
            Request::RemoveKeys { keys, force } => {
                let results = keys.iter().map(|k| self.remove(k, force)).collect();
                self.await_all_catalogs();
                Response::PerKey(results)
            }
            Request::ReplicaClear { keys, segment } => {
                let cleared = keys
                    .iter()
                    .map(|k| self.replica_clear(k, &segment))
                    .collect();
                self.deliver_all_catalogs();
                Response::PerKey(cleared)
            }
            Request::Drain { client, segment } => {
                // A node drains itself as it leaves: refusing would save nothing, so
                // it moves what it can, and its report counts what was lost.
                self.drain(Some(client), &segment, true)?;
                Response::Done
            }
            Request::Relocate {
                client,
                segment,
                keys,
            } => Response::PutStart(
                keys.iter()
                    .map(|k| self.relocate(client, &segment, k))
                    .collect(),
            ),
            Request::RelocateEnd {
                client,
                segment,
                items,
            } => {
                let mut committed = catalog::Commits::default();
                let results = items
                    .iter()
                    .map(|(k, moved)| {
                        self.relocate_end(client, &segment, k, *moved, &mut committed)
                    })
                    .collect();
                self.await_catalogs(committed);
                Response::PerKey(results)
            }
            Request::Remount {
                client,
                segment,
                entries,
                disk,
                last,
                owner,
            } => match self.remount(client, segment, entries, disk, last, owner)? {
                Some(ticket) => Response::Mounted(ticket),
                None => Response::Done,
            },
            Request::SegmentEvents {
                client,
                segment,
                instance,
                acked,
                disk_capacity,
                lost,
                ring,
            } => Response::SegmentEvents(self.segment_events(
                client,
                &segment,
                (instance, acked),
                disk_capacity,
                lost,
                ring,
            )?),
        })
    }

    /// Records a client's heartbeat (a first one makes the client known, so it may
    /// put); false when the client has no segment mounted (one that lends memory must
    /// remount).
    pub fn ping(&self, client: u64) -> bool {
        let now = self.clock.now_ms();
        self.clients
            .locked()
            .insert(client, ClientState { last_ping_ms: now });
        self.segments.has_client(client)
    }

    /// Whether `client` mounted a segment or pinged within its TTL.
    fn is_known(&self, client: u64) -> bool {
        let clients = self.clients.locked();
        clients.contains_key(&client)
    }

    /// Adds `segment`, the main one of `client`, to the pool.
    pub fn mount(&self, client: u64, segment: SegmentInfo) -> Result<()> {
        let key = segment.name.clone();
        self.mount_as(client, &key, segment)
    }

    /// Adds `segment` of `client` to the pool under `key` (its name for a node's main
    /// segment, the client's id for an extra one).
    fn mount_as(&self, client: u64, key: &str, segment: SegmentInfo) -> Result<()> {
        self.check_segment(&segment)?;
        if key.is_empty() {
            return Err(Error::invalid("a segment needs a non-empty id"));
        }
        if self.segments.get(key).is_some_and(|s| s.client == client) {
            return Ok(()); // mounted already: a repeated mount changes nothing
        }
        self.check_backed(&segment)?;
        let name = key.to_owned();
        let now = self.clock.now_ms();
        let fenced = self
            .segments
            .mount(key, client, segment, &self.config.allocator, now)
            .map_err(|_owner| {
                // Never echo the owner: a client id is all an unmount asks for.
                Error::new(
                    Code::SegmentAlreadyExists,
                    format!("segment {name} is already mounted by another client"),
                )
            })?;
        self.hold_fenced(fenced);
        self.clients
            .locked()
            .insert(client, ClientState { last_ping_ms: now });
        log::info!("mounted segment {name} of client {client:#x}");
        Ok(())
    }

    /// Refuses a segment no allocator could be built for.
    fn check_segment(&self, segment: &SegmentInfo) -> Result<()> {
        if segment.size == 0
            || segment.name.is_empty()
            || segment.base.checked_add(segment.size).is_none()
        {
            return Err(Error::invalid(format!("bad segment {segment:?}")));
        }
        // The master keeps a slab table per mounted byte range: an absurd size must be
        // refused here, never allocated.
        if segment.size > self.config.max_segment_size {
            return Err(Error::invalid(format!(
                "segment {} of {} bytes exceeds this master's limit of {} bytes (--max_segment_size)",
                segment.name, segment.size, self.config.max_segment_size
            )));
        }
        Ok(())
    }

    /// Removes `client`'s segment `name` (its key) from the pool, dropping the replicas
    /// on it.
    pub fn unmount(&self, client: u64, name: &str) -> Result<()> {
        match self.segments.get(name) {
            Some(s) if s.client == client => {
                self.drop_segment(name, true);
                Ok(())
            }
            Some(_) => Err(Error::new(
                Code::IllegalClient,
                format!("segment {name} belongs to another client"),
            )),
            None => Err(Error::new(Code::SegmentNotFound, format!("segment {name}"))),
        }
    }

    /// Removes the segment mounted under `name` and every replica on it; objects left
    /// without a replica are gone (their bytes were only there).
    fn drop_segment(&self, name: &str, voluntary: bool) {
        let Some(seg) = self.segments.unmount(name) else {
            return;
        };
        seg.log.close();
        let mut lost = 0;
        let mut fences = self.quarantine_fences(&seg);
        let release = self.config.put_start_release_timeout.as_millis() as u64;
        for shard in self.shards.iter() {
            let mut map = shard.locked();
            let mut restored = Vec::new();
            map.retain(|key, o| {
                if !o.complete {
                    let until_ms = o.started_ms() + release;
                    fences.extend(fences_on(&seg, &o.replicas, until_ms));
                    let notes = o.pending.iter().flat_map(|p| &p.notes);
                    fences.extend(notes.filter_map(|n| n.fence_on(&seg, until_ms)));
                }
                o.replicas.retain(|r| r.iter().all(|p| p.seg.id != seg.id));
                if o.disk.as_ref().is_some_and(|d| d.seg.id == seg.id) {
                    if self.fall_back(key, o) {
                        restored.push(key.to_owned());
                    }
                    o.disk = None;
                }
                // An unfinished put keeps its entry: its PutEnd then fails, or the
                // release timeout clears it.
                let keep = !o.replicas.is_empty() || o.disk.is_some() || !o.complete;
                if !keep {
                    lost += 1;
                }
                keep
            });
            for key in restored {
                self.touch(&mut map, &key);
            }
        }
        self.objects.fetch_sub(lost, Ordering::Relaxed);
        let now = self.clock.now_ms();
        self.segments.fence(&seg.key, &seg.info, fences, now);
        if voluntary {
            log::info!("segment {name} unmounted; {lost} objects left with it");
        } else {
            log::warn!("segment {name} dropped; {lost} objects lost their last replica");
        }
    }

    /// Fences (see `segments::Fence`) for the quarantined space in `seg`: whoever it
    /// waits for may still touch it after the segment comes back.
    fn quarantine_fences(&self, seg: &Segment) -> Vec<segments::Fence> {
        let quarantine = self.quarantine.locked();
        quarantine
            .iter()
            .flat_map(|q| fences_on(seg, &q.replicas, q.until_ms))
            .collect()
    }

    /// Quarantines the space a mount took for its fences, each until its time.
    fn hold_fenced(&self, fenced: Vec<(PieceAlloc, u64)>) {
        for (piece, until_ms) in fenced {
            self.quarantine_replicas(Replicas::from(vec![vec![piece]]), until_ms);
        }
    }

    fn put_start(
        &self,
        client: u64,
        payer: quota::Payer,
        key: &str,
        size: u64,
        config: &ReplicateConfig,
        upsert: bool,
    ) -> KeyResult<Vec<ReplicaDesc>> {
        check_key(key)?;
        if size == 0 {
            return Err(Code::InvalidParams);
        }
        if !self.is_known(client) {
            return Err(Code::ClientNotFound);
        }
        let (capacity, _) = self.segments.capacity_and_used();
        let cap = quota::cap(capacity, self.config.max_unfinished_put_ratio);
        let bytes = size.saturating_mul(config.replica_num.max(1) as u64);
        let hold = self
            .put_quota
            .reserve(payer, bytes, cap)
            .ok_or(Code::NoAvailableHandle)?;
        let now = self.clock.now_ms();
        {
            let mut guard = self.shard(key).locked();
            let shard = &mut *guard;
            match shard.objects.get_mut(key) {
                Some(o) => {
                    if o.complete {
                        if !upsert {
                            return Err(Code::ObjectAlreadyExists);
                        }
                        if o.lease_until_ms > now {
                            return Err(Code::ObjectHasLease);
                        }
                    } else if now.saturating_sub(o.started_ms())
                        < self.config.put_start_discard_timeout.as_millis() as u64
                    {
                        return Err(Code::ObjectAlreadyExists);
                    } else {
                        // Take over an abandoned put; its space waits out the release timeout.
                        let until = o.started_ms()
                            + self.config.put_start_release_timeout.as_millis() as u64;
                        self.quarantine_replicas(std::mem::take(&mut o.replicas), until);
                        log::warn!(
                            "put of {} by client {:#x} abandoned; taken over",
                            shown_key(key),
                            o.pending.as_ref().map_or(0, |p| p.writer)
                        );
                    }
                    if o.node != policy::NONE {
                        // Replaced: the old object leaves the victim order.
                        shard.policy.remove(o.node);
                    }
                    let placeholder = self.placeholder(client, size, now, config, hold);
                    *o = placeholder;
                }
                None => {
                    let o = self.placeholder(client, size, now, config, hold);
                    shard.objects.insert(key, o);
                    self.objects.fetch_add(1, Ordering::Relaxed);
                }
            }
            shard.note_unfinished(key);
        }
        // Allocate without holding the shard lock: eviction takes shard locks.
        let replicas = self.allocate(client, size, config);
        let mut map = self.shard(key).locked();
        let ours = map.get(key).is_some_and(|o| {
            o.written_by(client) && o.started_ms() == now && o.replicas.is_empty()
        });
        if !ours {
            // Force-removed or taken over meanwhile: dropping `replicas` frees the space.
            return Err(Code::ObjectNotFound);
        }
        if replicas.is_empty() {
            map.remove(key);
            self.objects.fetch_sub(1, Ordering::Relaxed);
            return Err(Code::NoAvailableHandle);
        }
        let replicas = Replicas::from(replicas);
        let desc = replicas.describe();
        if let Some(o) = map.get_mut(key) {
            o.replicas = replicas;
        }
        Ok(desc)
    }

    /// Lends note slots to the put `client` just started of `key` and seals its
    /// notes with `crc32c`; none (the put then waits for the nodes at its end) when a
    /// node keeps no ring or has no free slot.
    fn lend_notes(&self, client: u64, key: &str, crc32c: u32) -> Vec<NoteWrite> {
        let until = std::time::Instant::now() + self.config.put_start_release_timeout;
        let version = self.catalogs.next_version();
        let mut map = self.shard(key).locked();
        let Some(o) = map.get_mut(key).filter(|o| o.written_by(client)) else {
            return Vec::new();
        };
        let mut entry = CatalogEntry {
            key: key.to_owned(),
            version,
            size: o.size,
            crc32c,
            hard_pin: o.hard_pin,
            replica: ReplicaDesc {
                pieces: Default::default(),
            },
            index: 0,
        };
        let next_lend = || self.catalogs.next_version();
        let lent = catalog::lend_notes(&o.replicas, &mut entry, until, &next_lend);
        let Some((holds, writes)) = lent else {
            return Vec::new();
        };
        if let Some(p) = o.pending.as_mut() {
            p.notes = holds;
            p.noted = Some((crc32c, version));
        }
        writes
    }

    fn placeholder(
        &self,
        client: u64,
        size: u64,
        now: u64,
        config: &ReplicateConfig,
        hold: quota::Hold,
    ) -> Object {
        let soft_ttl = config.soft_pin_ttl_ms.min(MAX_SOFT_PIN_TTL_MS);
        Object {
            size,
            crc32c: 0,
            complete: false,
            pending: Some(Box::new(Pending {
                writer: client,
                started_ms: now,
                _hold: hold,
                notes: Vec::new(),
                noted: None,
            })),
            replicas: Replicas::default(),
            lease_until_ms: 0,
            node: policy::NONE,
            hard_pin: config.hard_pin,
            groups: config.group_ids.clone().into(),
            soft_pin_until_ms: if config.soft_pin { now + soft_ttl } else { 0 },
            version: 0,
            disk: None,
        }
    }

    /// Places replicas, evicting just enough when the pool is full (unpinned objects
    /// first, soft-pinned ones only when nothing else is left); empty when nothing fits
    /// even then.
    fn allocate(&self, client: u64, size: u64, config: &ReplicateConfig) -> Vec<ReplicaAlloc> {
        let want = size.saturating_mul(u64::from(config.replica_num.max(1)));
        self.allocate_evicting(want, || {
            let order = segments::placement_order(
                self.segments.snapshot(),
                self.config.allocation_strategy,
                config,
                client,
                self.next_seed(),
            );
            segments::allocate(&order, size, config.replica_num)
        })
    }

    /// Runs `attempt` until it places something, evicting about `want` bytes (then
    /// more) between tries; empty when nothing fits even then.
    fn allocate_evicting(
        &self,
        mut want: u64,
        attempt: impl Fn() -> Vec<ReplicaAlloc>,
    ) -> Vec<ReplicaAlloc> {
        // Bounded: each round evicts something or stops. Space freed in another size
        // class may not serve this one until whole slabs come free: after the first
        // round, empty whole slabs (see `eviction`), wanting more each time.
        let mut whole_slabs = false;
        for _ in 0..32 {
            let replicas = attempt();
            if !replicas.is_empty() {
                return replicas;
            }
            if self.free_expired_quarantine() {
                continue;
            }
            let freed = self.make_room(want, whole_slabs);
            // Space of objects going to a disk tier comes back once it is copied.
            self.await_offloads();
            if freed == 0 {
                break;
            }
            if whole_slabs {
                want = want.saturating_mul(2);
            }
            whole_slabs = true;
        }
        Vec::new()
    }

    /// Frees quarantined space whose time has come (as `tick` does), so an allocation
    /// does not fail on space that is only waiting for the next tick; whether any was.
    fn free_expired_quarantine(&self) -> bool {
        let now = self.clock.now_ms();
        let mut quarantine = self.quarantine.locked();
        let before = quarantine.len();
        quarantine.retain(|q| q.until_ms > now);
        let mut staged = self.staged.locked();
        let staged_before = staged.len();
        staged.retain(|_, q| q.until_ms > now);
        quarantine.len() < before || staged.len() < staged_before
    }

    fn quarantine_replicas(&self, replicas: Replicas, until_ms: u64) {
        if !replicas.is_empty() {
            self.quarantine
                .locked()
                .push(Quarantined { until_ms, replicas });
        }
    }

    fn put_end(
        &self,
        client: u64,
        key: &str,
        crc32c: u32,
        committed: &mut catalog::Commits,
    ) -> KeyResult<()> {
        check_key(key)?;
        let mut map = self.shard(key).locked();
        match map.get_mut(key) {
            Some(o) if o.written_by(client) && !o.replicas.is_empty() => {
                let (notes, noted) = o
                    .pending
                    .take()
                    .map(|mut p| (std::mem::take(&mut p.notes), p.noted))
                    .unwrap_or_default();
                o.complete = true;
                o.crc32c = crc32c;
                o.version = match noted {
                    Some((crc, version)) if crc == crc32c => version,
                    _ => self.catalogs.next_version(),
                };
                // Notes sealed with another checksum name other bytes: not used.
                let notes = match noted {
                    Some((crc, _)) if crc == crc32c => notes,
                    _ => {
                        notes.into_iter().for_each(|n| drop(n.revoke()));
                        Vec::new()
                    }
                };
                committed.record_noted(key, o, notes);
                let groups = o.groups.clone();
                self.touch(&mut map, key);
                drop(map);
                self.join_groups(key, &groups);
                Ok(())
            }
            Some(_) => Err(Code::InvalidWrite),
            None => Err(Code::ObjectNotFound),
        }
    }

    fn put_revoke(&self, client: u64, key: &str, cleared: &mut Vec<Arc<Segment>>) -> KeyResult<()> {
        check_key(key)?;
        let mut map = self.shard(key).locked();
        match map.get_mut(key) {
            Some(o) if o.written_by(client) => {
                if let Some(p) = o.pending.as_mut() {
                    cleared.extend(p.notes.drain(..).filter_map(catalog::NoteHold::revoke));
                }
                map.remove(key);
                self.objects.fetch_sub(1, Ordering::Relaxed);
                Ok(())
            }
            Some(_) => Err(Code::InvalidWrite),
            None => Err(Code::ObjectNotFound),
        }
    }

    fn get_replicas(&self, key: &str) -> KeyResult<ObjectDesc> {
        self.lookup(key, true)
    }

    /// An object's descriptor, leased; one kept only on disk is read back into memory
    /// first when `load` allows.
    fn lookup(&self, key: &str, load: bool) -> KeyResult<ObjectDesc> {
        self.lookup_into(key, load, self.clock.now_ms(), None, &mut answer::Build)
    }

    /// As `lookup`, leased from `now` (a batch's keys share one reading of the clock:
    /// taken before the first lookup, it ends no lease later than a reading of each
    /// would), the descriptor given to `sink`, which may write it out under the
    /// shard's lock rather than build it; `at`, when given, is where `locate` found the
    /// key's place.
    fn lookup_into<S: answer::DescSink>(
        &self,
        key: &str,
        load: bool,
        now: u64,
        at: Option<Located>,
        sink: &mut S,
    ) -> KeyResult<S::Out> {
        check_key(key)?;
        let ttl = self.config.lease_ttl.as_millis() as u64;
        let (mut map, slot) = match at {
            Some(at) => {
                let map = self.shards[at.shard].locked();
                let slot = map.objects.slot_tagged(key, at.tag);
                (map, slot)
            }
            None => {
                let map = self.shard(key).locked();
                let slot = map.objects.slot(key);
                (map, slot)
            }
        };
        let slot = slot.ok_or(Code::ObjectNotFound)?;
        let o = map.objects.at_mut(slot).ok_or(Code::ObjectNotFound)?;
        if !o.complete {
            return Err(Code::ReplicaIsNotReady);
        }
        if o.replicas.is_empty() {
            let on_disk = o.disk.as_ref().map(|d| (d.seg.clone(), o.version, o.size));
            drop(map);
            return match on_disk {
                Some((seg, version, size)) if load => self
                    .read_back(key, &seg, version, size)
                    .map(|desc| sink.built(desc)),
                Some(_) => Err(Code::ReplicaIsNotReady),
                None => Err(Code::ObjectNotFound),
            };
        }
        o.lease_until_ms = o.lease_until_ms.max(now + ttl);
        let out = sink.replicas(o.size, o.crc32c, ttl, &o.replicas);
        let groups = o.groups.clone();
        self.touch_at(&mut map, slot, key);
        if !groups.is_empty() {
            // Members are leased one shard lock at a time, never two at once.
            drop(map);
            self.for_group_members(key, &groups, |m| {
                m.lease_until_ms = m.lease_until_ms.max(now + ttl)
            });
        }
        Ok(out)
    }

    /// Counts a read a client served from a descriptor it kept within its lease, as
    /// `lookup` counts one it asked for (no lease is taken).
    fn touch_cached_read(&self, key: &str) {
        if check_key(key).is_err() {
            return;
        }
        let mut map = self.shard(key).locked();
        if map
            .get(key)
            .is_some_and(|o| o.complete && !o.replicas.is_empty())
        {
            self.touch(&mut map, key);
        }
    }

    fn join_groups(&self, key: &str, groups: &[String]) {
        if groups.is_empty() {
            return;
        }
        let mut index = self.groups.locked();
        for g in groups {
            index.entry(g.clone()).or_default().push(key.to_owned());
        }
    }

    /// The other members of `groups`, as last indexed.
    fn group_members(&self, key: &str, groups: &[String]) -> Vec<String> {
        let index = self.groups.locked();
        let members = groups.iter().filter_map(|g| index.get(g)).flatten();
        members.filter(|m| *m != key).cloned().collect()
    }

    /// Runs `f` on every other live member of `groups`, each under its own shard lock
    /// (never two at once), and prunes members that are gone.
    fn for_group_members(&self, key: &str, groups: &[String], mut f: impl FnMut(&mut Object)) {
        let members = self.group_members(key, groups);
        let mut gone = Vec::new();
        for m in members {
            match self.shard(&m).locked().get_mut(&m) {
                Some(o) => f(o),
                None => gone.push(m),
            }
        }
        if !gone.is_empty() {
            let mut index = self.groups.locked();
            for g in groups {
                if let Some(v) = index.get_mut(g) {
                    v.retain(|m| !gone.contains(m));
                    if v.is_empty() {
                        index.remove(g);
                    }
                }
            }
        }
    }

    /// Whether a complete object exists. Deliberately neither leases nor touches it:
    /// constant probing must not make objects unevictable (upstream #2187).
    fn exists(&self, key: &str) -> KeyResult<bool> {
        check_key(key)?;
        Ok(self
            .shard(key)
            .locked()
            .get(key)
            .is_some_and(|o| o.complete))
    }

    /// Removes `key` (even when leased, with `force`).
    pub fn remove(&self, key: &str, force: bool) -> KeyResult<()> {
        check_key(key)?;
        let now = self.clock.now_ms();
        let mut map = self.shard(key).locked();
        let o = map.get(key).ok_or(Code::ObjectNotFound)?;
        if let Some(code) = Self::refusal(o, force, now) {
            return Err(code);
        }
        if let Some(o) = map.remove(key) {
            self.dispose(o, now);
            self.objects.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Drops `key`'s replicas that have a piece on `segment` (every replica when
    /// `segment` is empty); the object goes with its last replica. Objects that are
    /// being written or read are left alone.
    fn replica_clear(&self, key: &str, segment: &str) -> KeyResult<()> {
        check_key(key)?;
        let now = self.clock.now_ms();
        let mut map = self.shard(key).locked();
        let o = map.get_mut(key).ok_or(Code::ObjectNotFound)?;
        if !o.complete {
            return Err(Code::ReplicaIsNotReady);
        }
        if o.lease_until_ms > now {
            return Err(Code::ObjectHasLease);
        }
        let on_segment =
            |r: &[PieceAlloc]| segment.is_empty() || r.iter().any(|p| p.wire().0 == segment);
        let doomed = o.replicas.iter().filter(|r| on_segment(r)).count();
        if doomed == 0 {
            return Err(Code::SegmentNotFound);
        }
        if doomed < o.replicas.len() {
            // Not leased, so no reader can be using the dropped space.
            o.replicas.retain(|r| !on_segment(r));
            return Ok(());
        }
        map.remove(key);
        self.objects.fetch_sub(1, Ordering::Relaxed);
        Ok(())
    }

    /// Why `o` may not be removed (a writer mid-put, a reader within its lease), unless
    /// `force`d.
    fn refusal(o: &Object, force: bool, now: u64) -> Option<Code> {
        if force {
            None
        } else if !o.complete {
            Some(Code::ReplicaIsNotReady)
        } else if o.lease_until_ms > now {
            Some(Code::ObjectHasLease)
        } else {
            None
        }
    }

    /// Lets go of a removed object. Space that someone may still touch (a writer
    /// mid-put, a reader within its lease) is quarantined rather than freed.
    fn dispose(&self, o: Object, now: u64) {
        if !o.complete {
            let until = o.started_ms() + self.config.put_start_release_timeout.as_millis() as u64;
            self.quarantine_replicas(o.replicas, until);
        } else if o.lease_until_ms > now {
            // Gone for the nodes' catalogs now, though its space waits for the readers.
            catalog::forget_pieces(&o.replicas);
            self.quarantine_replicas(o.replicas, o.lease_until_ms);
        }
    }

    /// Removes the keys `re` matches. Matching runs outside the shard locks (other calls
    /// go on meanwhile) within `regex_budget` units of work in all; a pattern too
    /// costly for the keys stored fails the request and removes nothing.
    fn remove_by_regex(&self, re: &Regex, force: bool) -> Result<u64> {
        let mut budget = self.config.regex_budget;
        let mut matched = std::collections::HashSet::new();
        for shard in self.shards.iter() {
            let keys: Vec<String> = shard.locked().keys().map(str::to_owned).collect();
            for k in keys {
                match re.is_match_within(&k, &mut budget) {
                    Some(true) => {
                        matched.insert(k);
                    }
                    Some(false) => {}
                    None => {
                        return Err(Error::invalid(format!(
                            "regex {:?} costs more than this master allows over the keys stored \
                             (nothing removed); use a simpler or anchored pattern",
                            crate::protocol::shown_key(re.as_str())
                        )))
                    }
                }
            }
        }
        Ok(self.remove_matching(|k| matched.contains(k), force))
    }

    fn remove_matching(&self, pred: impl Fn(&str) -> bool, force: bool) -> u64 {
        let now = self.clock.now_ms();
        let mut removed = 0;
        for shard in self.shards.iter() {
            let mut map = shard.locked();
            let keys: Vec<String> = map.keys().filter(|k| pred(k)).map(str::to_owned).collect();
            for k in keys {
                let allowed = map
                    .get(&k)
                    .is_some_and(|o| Self::refusal(o, force, now).is_none());
                if !allowed {
                    continue;
                }
                if let Some(o) = map.remove(&k) {
                    self.dispose(o, now);
                    removed += 1;
                }
            }
        }
        self.objects.fetch_sub(removed, Ordering::Relaxed);
        removed
    }

    /// Pool statistics: segments, capacity, use, objects and evictions.
    pub fn stats(&self) -> PoolStats {
        let (capacity, used) = self.segments.capacity_and_used();
        PoolStats {
            segments: self.segments.snapshot().len() as u64,
            capacity,
            used,
            objects: self.objects.load(Ordering::Relaxed),
            evicted_objects: self.evicted_objects.load(Ordering::Relaxed),
            evicted_bytes: self.evicted_bytes.load(Ordering::Relaxed),
        }
    }

    /// `/metrics`' body (Prometheus text): the pool's figures, ours and under the names
    /// Mooncake's master exports them by, each segment's, and the answered requests'
    /// counters (`metrics`).
    pub fn metrics_text(&self) -> String {
        let mut out = String::new();
        let active_clients = self.clients.locked().len() as u64;
        metrics::render_pool(&self.stats(), active_clients, &mut out);
        let segments = self.all_segments().into_iter();
        let named = segments.map(|(info, capacity, used)| (info.name, capacity, used));
        metrics::render_segments(named, &mut out);
        self.request_metrics.render(&mut out);
        out
    }

    /// Housekeeping: drops silent clients' segments, frees quarantined space whose
    /// time has come, releases abandoned puts, and evicts above the watermark.
    pub fn tick(&self) {
        let now = self.clock.now_ms();
        let ttl = self.config.client_ttl.as_millis() as u64;
        let expired: Vec<u64> = {
            let mut clients = self.clients.locked();
            let dead: Vec<u64> = clients
                .iter()
                .filter(|(_, c)| now.saturating_sub(c.last_ping_ms) > ttl)
                .map(|(id, _)| *id)
                .collect();
            for id in &dead {
                clients.remove(id);
            }
            dead
        };
        for client in expired {
            for name in self.segments.of_client(client) {
                log::warn!(
                    "client {client:#x} silent for over {ttl} ms: dropping its segment {name}"
                );
                self.drop_segment(&name, false);
            }
        }
        self.free_expired_quarantine();
        let release = self.config.put_start_release_timeout.as_millis() as u64;
        let mut released = 0;
        for shard in self.shards.iter() {
            released += shard
                .locked()
                .sweep_unfinished(|o| now.saturating_sub(o.started_ms()) >= release);
        }
        self.objects.fetch_sub(released, Ordering::Relaxed);
        self.catalogs.expire(now);
        self.copies.expire(now);
        self.evict_above_watermark();
    }

    /// Keys and descriptors for the admin endpoints (no lease taken).
    pub fn query(&self, key: &str) -> Option<(u64, bool, Vec<ReplicaDesc>)> {
        let map = self.shard(key).locked();
        map.get(key)
            .map(|o| (o.size, o.complete, o.replicas.describe()))
    }

    /// Every key, complete or not (unbounded: for tests and tools, not for serving).
    pub fn all_keys(&self) -> Vec<String> {
        self.keys(usize::MAX).0
    }

    /// Up to `limit` keys, complete or not, and how many keys there are in all.
    pub fn keys(&self, limit: usize) -> (Vec<String>, usize) {
        let (mut keys, mut total) = (Vec::new(), 0);
        for shard in self.shards.iter() {
            let map = shard.locked();
            total += map.len();
            let room = limit.saturating_sub(keys.len());
            keys.extend(map.keys().take(room).map(str::to_owned));
        }
        (keys, total)
    }

    /// Every mounted segment with its capacity and bytes in use.
    pub fn all_segments(&self) -> Vec<(SegmentInfo, u64, u64)> {
        self.segments
            .snapshot()
            .iter()
            .map(|s| {
                (
                    s.info.clone(),
                    segments::usable(&s.alloc),
                    s.alloc.used_bytes(),
                )
            })
            .collect()
    }
}

/// Fences until `until_ms` for the pieces of `replicas` that lie in `seg`.
fn fences_on<'a>(
    seg: &'a Segment,
    replicas: &'a Replicas,
    until_ms: u64,
) -> impl Iterator<Item = segments::Fence> + 'a {
    replicas
        .pieces()
        .filter(move |p| p.seg.id == seg.id)
        .map(move |p| segments::Fence {
            addr: p.piece().addr,
            len: p.alloc.size,
            until_ms,
        })
}

/// The master under a shared handle, for servers and tests.
pub type SharedMaster = Arc<Master>;
