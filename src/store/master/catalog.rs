//! Node catalogs: each node keeps a list of the object pieces in its own segment, fed
//! by the master in commit order, so that a master which lost its state (restart,
//! failover to a standby) gets every object back from the nodes that hold the bytes.
//!
//! Per segment the master keeps a log of catalog events (`Commit` at `PutEnd`, `Free`
//! when a piece's space is given back). The node long-polls it (`SegmentEvents`) and
//! acknowledges what it applied; a `PutEnd` is answered only once every segment
//! holding the object acknowledged its commit, so nothing acknowledged to a writer is
//! missing from the catalogs. A node that stops acknowledging loses its log (its puts
//! stop waiting) and gets a fresh snapshot when it polls again. The log itself is
//! `segment_log`; disk-tier copies are `offload`.

use crate::util::sync::Unpoisoned;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::replicas::Replicas;
use super::segment_log::{MAX_EVENTS_PER_POLL, POLL_WAIT};
use super::segments::{PieceAlloc, ReplicaAlloc, Segment};
use super::{policy, Master, Object};
use crate::error::{Code, Error, Result};
use crate::store::allocator::SlabAllocator;
use crate::store::protocol::{
    check_key, shown_key, CatalogEntry, CatalogEvent, DiskEntry, ReplicaDesc, SegmentEvents,
    SegmentInfo,
};

/// A remount whose last chunk does not come within this long is dropped.
const REMOUNT_PATIENCE_MS: u64 = 60_000;

/// Catalog state of the master as a whole.
pub struct Catalogs {
    /// This master's incarnation: sequence numbers of another one mean nothing here.
    instance: u64,
    /// The last version handed out: milliseconds since the epoch at start, shifted
    /// left by `VERSION_SEQ_BITS`, so a restarted master (or a new leader) writes
    /// versions above its predecessor's.
    versions: AtomicU64,
    /// Remounts whose chunks are still arriving, by (client, segment).
    remounts: Mutex<HashMap<(u64, String), PendingRemount>>,
    /// Pieces of striped replicas waiting for their siblings (which may sit on nodes
    /// that remount later), by (key, version, first piece's segment and address).
    stripes: Mutex<HashMap<(String, u64, String, u64), PendingStripe>>,
    /// Replicas placed for objects leaving a draining node, until the node says the
    /// bytes moved, by (client, key).
    pub(super) relocations: Mutex<HashMap<(u64, String), super::drain::Relocation>>,
}

struct PendingRemount {
    info: SegmentInfo,
    entries: Vec<CatalogEntry>,
    disk: Vec<DiskEntry>,
    started_ms: u64,
    /// What `entries` and `disk` cost the master (see `held_bytes`).
    bytes: u64,
}

impl PendingRemount {
    fn new(info: SegmentInfo, started_ms: u64) -> PendingRemount {
        PendingRemount {
            info,
            entries: Vec::new(),
            disk: Vec::new(),
            started_ms,
            bytes: 0,
        }
    }
}

/// Master memory a chunk of catalog takes while it waits for its remount's last
/// chunk: each entry's struct and the strings it owns.
fn held_bytes(entries: &[CatalogEntry], disk: &[DiskEntry]) -> u64 {
    let entry = |e: &CatalogEntry| {
        let pieces = e
            .replica
            .pieces
            .iter()
            .map(|p| p.segment.len())
            .sum::<usize>()
            + e.replica.pieces.len() * std::mem::size_of::<crate::store::protocol::Piece>();
        std::mem::size_of::<CatalogEntry>() + e.key.len() + pieces
    };
    let disk_entry = |d: &DiskEntry| std::mem::size_of::<DiskEntry>() + d.key.len();
    (entries.iter().map(entry).sum::<usize>() + disk.iter().map(disk_entry).sum::<usize>()) as u64
}

/// Remounts whose chunks may be arriving at once.
const MAX_PENDING_REMOUNTS: usize = 256;
/// Most disk-tier objects one remount may announce.
const MAX_DISK_ENTRIES: usize = 1 << 26;

struct PendingStripe {
    pieces: Vec<Option<PieceAlloc>>,
    started_ms: u64,
}

impl Catalogs {
    pub fn new() -> Catalogs {
        Catalogs {
            instance: crate::sys::random_u64() | 1,
            versions: AtomicU64::new(now_unix_ms() << VERSION_SEQ_BITS),
            remounts: Mutex::new(HashMap::new()),
            stripes: Mutex::new(HashMap::new()),
            relocations: Mutex::new(HashMap::new()),
        }
    }

    /// A version above every one handed out or seen so far.
    pub fn next_version(&self) -> u64 {
        self.versions.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Takes note of a version a node announced, so later puts write above it; false
    /// (and ignored) when it lies more than a day in the future of this clock: no
    /// master could have written it, and taking it would push versions to the end.
    pub(super) fn observe(&self, version: u64) -> bool {
        let limit = (now_unix_ms() + 86_400_000) << VERSION_SEQ_BITS;
        if version >= limit {
            return false;
        }
        self.versions.fetch_max(version, Ordering::Relaxed);
        true
    }

    /// Drops remounts and striped pieces that waited too long (their space is freed).
    pub fn expire(&self, now_ms: u64) {
        let fresh = |started: u64| now_ms.saturating_sub(started) < REMOUNT_PATIENCE_MS;
        self.remounts.locked().retain(|_, r| fresh(r.started_ms));
        self.stripes.locked().retain(|_, s| fresh(s.started_ms));
        let expired: Vec<_> = {
            let mut relocations = self.relocations.locked();
            let keys: Vec<_> = relocations
                .iter()
                .filter(|(_, r)| !fresh(r.started_ms))
                .map(|(k, _)| k.clone())
                .collect();
            keys.into_iter()
                .filter_map(|k| relocations.remove(&k))
                .collect()
        };
        for r in expired {
            r.into_limbo(); // its node may still be writing there
        }
    }
}

/// Low bits of a version that count puts within a millisecond (a carry into the
/// millisecond bits keeps versions growing).
const VERSION_SEQ_BITS: u32 = 20;

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Catalog events a batch of `PutEnd`s recorded: what the answer waits for.
#[derive(Default)]
pub struct Commits(Vec<(Arc<Segment>, u64)>);

impl Commits {
    /// Records the commit of `key` in the log of every segment holding a piece of it.
    pub fn record(&mut self, key: &str, o: &Object) {
        for replica in o.replicas.iter() {
            for (index, piece) in replica.iter().enumerate() {
                let seq = piece
                    .seg
                    .log
                    .record(|| CatalogEvent::Commit(entry_of(key, o, replica, index)));
                if let Some(seq) = seq {
                    self.0.push((piece.seg.clone(), seq));
                }
            }
        }
    }
}

/// The object a re-announced replica becomes: complete, unleased, in no group.
fn adopted(entry: &CatalogEntry, replica: ReplicaAlloc) -> Object {
    Object {
        size: entry.size,
        crc32c: entry.crc32c,
        complete: true,
        pending: None,
        replicas: Replicas::from(vec![replica]),
        lease_until_ms: 0,
        node: policy::NONE,
        hard_pin: entry.hard_pin,
        soft_pin_until_ms: 0,
        groups: Box::default(),
        version: entry.version,
        disk: None,
    }
}

/// Tells the owners' catalogs that these pieces hold nothing any more (their space
/// is freed later, which tells them again, harmlessly).
pub(super) fn forget_pieces(replicas: &Replicas) {
    for piece in replicas.pieces() {
        let addr = piece.piece().addr;
        piece.seg.log.record(|| CatalogEvent::Free(addr));
    }
}

fn entry_of(key: &str, o: &Object, replica: &[PieceAlloc], index: usize) -> CatalogEntry {
    CatalogEntry {
        key: key.to_owned(),
        version: o.version,
        size: o.size,
        crc32c: o.crc32c,
        hard_pin: o.hard_pin,
        replica: ReplicaDesc {
            pieces: replica.iter().map(PieceAlloc::piece).collect(),
        },
        index: index as u32,
    }
}

impl Master {
    /// Waits until the nodes recorded `commits` (see the module's comment).
    pub(super) fn await_catalogs(&self, commits: Commits) {
        let mut latest: HashMap<u64, (Arc<Segment>, u64)> = HashMap::new();
        for (seg, seq) in commits.0 {
            let e = latest.entry(seg.id).or_insert((seg, seq));
            e.1 = e.1.max(seq);
        }
        // Every node starts on its events before the first wait (and at once even
        // when puts do not wait: a drain reads its catalog right after asking).
        for (seg, _) in latest.values() {
            seg.log.deliver();
        }
        let timeout = self.config.catalog_ack_timeout;
        if timeout.is_zero() {
            return;
        }
        for (seg, seq) in latest.into_values() {
            seg.log.wait_acked(seq, timeout);
        }
    }

    /// Waits until every node caught up with its log (after removals: a removed
    /// object must not come back after a restart).
    pub(super) fn await_all_catalogs(&self) {
        let segments = self.deliver_all_catalogs();
        let timeout = self.config.catalog_ack_timeout;
        if timeout.is_zero() {
            return;
        }
        for seg in segments {
            if let Some(seq) = seg.log.head() {
                seg.log.wait_acked(seq, timeout);
            }
        }
    }

    /// Has every node's poll answer with what its log holds now (after changes no
    /// put waits for); the segments.
    pub(super) fn deliver_all_catalogs(&self) -> Vec<Arc<Segment>> {
        let segments = self.segments.snapshot();
        for seg in &segments {
            seg.log.deliver();
        }
        segments
    }

    /// Answers a node's catalog poll (see `Request::SegmentEvents`).
    pub(super) fn segment_events(
        &self,
        client: u64,
        name: &str,
        instance: u64,
        acked: u64,
        disk_capacity: u64,
        lost: Vec<String>,
    ) -> Result<SegmentEvents> {
        let seg = self
            .segments
            .get(name)
            .filter(|s| s.client == client)
            .ok_or_else(|| {
                Error::new(
                    Code::SegmentNotFound,
                    format!("segment {name} is not mounted by this client"),
                )
            })?;
        seg.disk_capacity.store(disk_capacity, Ordering::Relaxed);
        // Before the acknowledgement: a read-back waiting on it must see the loss.
        for key in &lost {
            self.lose_disk_copy(key, &seg);
        }
        let instance_now = self.catalogs.instance;
        if instance != instance_now || !seg.log.follows(acked) {
            let expected = self.objects.load(Ordering::Relaxed) as usize;
            let base = seg.log.restart(expected);
            self.record_snapshot(&seg);
            return Ok(SegmentEvents {
                instance: instance_now,
                reset: true,
                snapshot_end: seg.log.head().unwrap_or(base),
                draining: seg.draining.load(Ordering::SeqCst),
                last: base,
                events: Vec::new(),
            });
        }
        let (last, events) = seg.log.poll(acked, POLL_WAIT, MAX_EVENTS_PER_POLL);
        Ok(SegmentEvents {
            instance: instance_now,
            reset: false,
            snapshot_end: 0,
            draining: seg.draining.load(Ordering::SeqCst),
            last,
            events,
        })
    }

    /// Records a commit for every piece of every complete object in `seg`, and a
    /// `Keep` for every disk copy its node holds for the pool.
    fn record_snapshot(&self, seg: &Arc<Segment>) {
        for shard in self.shards.iter() {
            let map = shard.locked();
            for (key, o) in map.objects.iter().filter(|(_, o)| o.complete) {
                if o.disk.as_ref().is_some_and(|d| Arc::ptr_eq(&d.seg, seg)) {
                    seg.log.record(|| CatalogEvent::Keep(key.to_string()));
                }
                for replica in o.replicas.iter() {
                    for (index, piece) in replica.iter().enumerate() {
                        if Arc::ptr_eq(&piece.seg, seg) {
                            seg.log
                                .record(|| CatalogEvent::Commit(entry_of(key, o, replica, index)));
                        }
                    }
                }
            }
        }
    }

    /// Takes a chunk of a remounting node's catalog; at the last one, mounts the
    /// segment with the space its objects use already taken, and adopts the objects.
    pub(super) fn remount(
        &self,
        client: u64,
        info: SegmentInfo,
        entries: Vec<CatalogEntry>,
        disk: Vec<DiskEntry>,
        last: bool,
    ) -> Result<()> {
        self.check_segment(&info)?;
        if let Some(seg) = self.segments.get(&info.name) {
            if seg.client == client {
                return Ok(()); // mounted already: a repeated remount changes nothing
            }
            return Err(Error::new(
                Code::SegmentAlreadyExists,
                format!("segment {} is already mounted by another client", info.name),
            ));
        }
        let now = self.clock.now_ms();
        let name = info.name.clone();
        let pending = {
            let mut remounts = self.catalogs.remounts.locked();
            let id = (client, name.clone());
            if remounts.len() >= MAX_PENDING_REMOUNTS && !remounts.contains_key(&id) {
                return Err(Error::new(
                    Code::NoAvailableHandle,
                    format!(
                        "remount of {name}: {MAX_PENDING_REMOUNTS} remounts in progress already"
                    ),
                ));
            }
            let held_elsewhere: u64 = remounts
                .iter()
                .filter(|(k, _)| **k != id)
                .map(|(_, r)| r.bytes)
                .sum();
            let p = remounts
                .entry(id.clone())
                .or_insert_with(|| PendingRemount::new(info.clone(), now));
            if p.info != info {
                *p = PendingRemount::new(info.clone(), now);
            }
            // No segment holds more objects than 64-byte blocks.
            if (p.entries.len() + entries.len()) as u64 > info.size / 64 + 1
                || p.disk.len() + disk.len() > MAX_DISK_ENTRIES
            {
                remounts.remove(&id);
                return Err(Error::invalid(format!(
                    "remount of {name}: more catalog entries than the segment has room for"
                )));
            }
            let bytes = p.bytes + held_bytes(&entries, &disk);
            if let Some(why) = self.remount_over_budget(bytes, held_elsewhere) {
                // Refused, the remount cannot finish: its chunks go now (the node's
                // next remount starts over).
                remounts.remove(&id);
                return Err(Error::new(
                    Code::NoAvailableHandle,
                    format!("remount of {name} refused and dropped: {why}"),
                ));
            }
            p.bytes = bytes;
            p.entries.extend(entries);
            p.disk.extend(disk);
            if !last {
                return Ok(());
            }
            remounts.remove(&id).map(|p| (p.entries, p.disk))
        };
        let (entries, disk) = pending.unwrap_or_default();
        let base = info.base;
        let end = info.base + info.size;
        let claims: Vec<(u64, u64)> = entries
            .iter()
            .map(|e| match e.piece() {
                Some(p)
                    if p.segment == name
                        && p.addr >= base
                        && p.len > 0
                        && p.addr.checked_add(p.len).is_some_and(|e| e <= end) =>
                {
                    (p.addr - base, p.len)
                }
                // Never a valid block: the claim is refused.
                _ => (u64::MAX, 0),
            })
            .collect();
        let config = self.config.allocator.for_segment(info.size);
        let (alloc, taken) = SlabAllocator::with_claims(info.size, config, &claims);
        let seg = self
            .segments
            .mount_rebuilt(client, info, alloc)
            .map_err(|_| {
                Error::new(
                    Code::SegmentAlreadyExists,
                    format!("segment {name} is already mounted by another client"),
                )
            })?;
        self.ping(client);
        let (mut adopted, mut bytes, mut refused) = (0u64, 0u64, 0u64);
        for (entry, alloc) in entries.into_iter().zip(taken) {
            let Some(alloc) = alloc else {
                refused += 1;
                continue;
            };
            let len = alloc.size;
            let piece = PieceAlloc {
                seg: seg.clone(),
                alloc,
            };
            if self.adopt_piece(entry, piece, now) {
                adopted += 1;
                bytes += len;
            } else {
                refused += 1;
            }
        }
        let on_disk = disk
            .iter()
            .filter(|d| self.adopt_disk(d, &seg, now))
            .count();
        log::info!(
            "segment {name} of client {client:#x} mounted: {adopted} object pieces ({bytes} bytes) taken back, {refused} refused, {on_disk} objects on its disk tier"
        );
        Ok(())
    }

    /// Why a remount whose catalog would take `bytes` (with `held_elsewhere` held by
    /// the other unfinished remounts) is over the bounds, if it is.
    fn remount_over_budget(&self, bytes: u64, held_elsewhere: u64) -> Option<String> {
        let per_segment = self.config.max_remount_bytes_per_segment;
        let total = self.config.max_remount_bytes;
        if bytes > per_segment {
            return Some(format!(
                "its catalog would take {bytes} bytes of master memory, over the {per_segment}-byte bound per segment"
            ));
        }
        if held_elsewhere + bytes > total {
            return Some(format!(
                "unfinished remounts would take {} bytes of master memory, over the {total}-byte bound (retry when they are done)",
                held_elsewhere + bytes
            ));
        }
        None
    }

    /// Adopts one re-announced piece (a striped replica once all its pieces are in);
    /// false when it is refused (and its space freed).
    fn adopt_piece(&self, entry: CatalogEntry, piece: PieceAlloc, now: u64) -> bool {
        if check_key(&entry.key).is_err() || !self.catalogs.observe(entry.version) {
            return false;
        }
        let count = entry.replica.pieces.len();
        if count == 1 {
            return self.adopt_replica(&entry, vec![piece], now);
        }
        let first = &entry.replica.pieces[0];
        let id = (
            entry.key.clone(),
            entry.version,
            first.segment.clone(),
            first.addr,
        );
        let mut stripes = self.catalogs.stripes.locked();
        let pending = stripes.entry(id.clone()).or_insert_with(|| PendingStripe {
            pieces: (0..count).map(|_| None).collect(),
            started_ms: now,
        });
        let slot = entry.index as usize;
        if pending.pieces.len() != count || pending.pieces[slot].is_some() {
            return false;
        }
        pending.pieces[slot] = Some(piece);
        if pending.pieces.iter().any(Option::is_none) {
            return true;
        }
        let Some(done) = stripes.remove(&id) else {
            return false;
        };
        drop(stripes);
        let replica: ReplicaAlloc = done.pieces.into_iter().flatten().collect();
        self.adopt_replica(&entry, replica, now)
    }

    /// Makes `replica` a replica of `entry.key`: a new object, another replica of the
    /// same version, or a later version replacing an earlier one. Refused (false) when
    /// its pieces do not add up to the value or a later or unfinished put holds the key.
    fn adopt_replica(&self, entry: &CatalogEntry, replica: ReplicaAlloc, now: u64) -> bool {
        let described: Vec<_> = replica.iter().map(PieceAlloc::piece).collect();
        if described != entry.replica.pieces
            || described.iter().map(|p| p.len).sum::<u64>() != entry.size
        {
            return false;
        }
        let key = entry.key.as_str();
        let mut guard = self.shard(key).locked();
        let shard = &mut *guard;
        match shard.objects.get_mut(key) {
            None => {
                shard.objects.insert(key, adopted(entry, replica));
                self.objects.fetch_add(1, Ordering::Relaxed);
            }
            Some(o) => {
                let same = o.complete
                    && o.version == entry.version
                    && o.size == entry.size
                    && o.crc32c == entry.crc32c;
                if same {
                    o.replicas.push(replica);
                    return true;
                }
                if !o.complete || o.version >= entry.version {
                    log::debug!(
                        "re-announced {} is older than what the master holds",
                        shown_key(key)
                    );
                    return false;
                }
                // A later version than the one held: it replaces it.
                let old = std::mem::replace(o, adopted(entry, replica));
                if old.node != policy::NONE {
                    shard.policy.remove(old.node);
                }
                self.dispose(old, now);
            }
        }
        self.touch(shard, key);
        true
    }
}
