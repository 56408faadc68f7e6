//! Node catalogs: each node keeps a list of the object pieces in its own segment, fed
//! by the master in commit order, so that a master which lost its state (restart,
//! failover to a standby) gets every object back from the nodes that hold the bytes.
//!
//! Per segment the master keeps a log of catalog events (`Commit` at `PutEnd`, `Free`
//! when a piece's space is given back). The node long-polls it (`SegmentEvents`) and
//! acknowledges what it applied; a `PutEnd` is answered only once every segment
//! holding the object acknowledged its commit, so nothing acknowledged to a writer is
//! missing from the catalogs. A node that stops acknowledging loses its log (its puts
//! stop waiting) and gets a fresh snapshot when it polls again.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::segments::{self, PieceAlloc, ReplicaAlloc, Segment};
use super::table::Shard;
use super::{policy, Master, Object};
use crate::error::{Code, Error, Result};
use crate::store::allocator::SlabAllocator;
use crate::store::protocol::{
    check_key, shown_key, CatalogEntry, CatalogEvent, DiskEntry, KeyResult, ObjectDesc,
    ReplicaDesc, SegmentEvents, SegmentInfo,
};

/// Events one answer carries at most.
pub const MAX_EVENTS_PER_POLL: usize = 4096;
/// How long a poll waits for news before answering empty.
pub const POLL_WAIT: Duration = Duration::from_millis(500);
/// Disk copies (offloads, read-backs) one answer asks of a node at most.
const MAX_DISK_EVENTS_PER_POLL: usize = 64;
/// Bytes of events one answer carries at most (well inside the RPC frame limit).
const MAX_POLL_BYTES: usize = 4 << 20;
/// Events a log holds unacknowledged beyond its snapshot before it gives up on its node.
const SLACK_EVENTS: usize = 1 << 20;
/// A remount whose last chunk does not come within this long is dropped.
const REMOUNT_PATIENCE_MS: u64 = 60_000;

#[derive(Default)]
struct LogState {
    /// Events are recorded only while a node follows the log.
    active: bool,
    /// Sequence number of the last event recorded (never reused).
    last: u64,
    /// Where the current activation started: acknowledgements below it are stale.
    base: u64,
    acked: u64,
    events: VecDeque<(u64, CatalogEvent)>,
    cap: usize,
    /// Space of offloaded objects, given back once the node acknowledged the event
    /// (it copies the bytes to its disk tier first), in sequence order.
    held: VecDeque<(u64, ReplicaAlloc)>,
    /// Held space whose event was dropped unacknowledged (a reset, a timeout): the
    /// node may still be copying from it, so it waits here until `LIMBO` passes.
    limbo: Vec<(Instant, ReplicaAlloc)>,
    /// A waiting poll should answer now.
    woken: bool,
}

/// How long space a node may still touch stays unused after its event was dropped.
const LIMBO: Duration = Duration::from_secs(60);

/// The catalog event log of one segment.
#[derive(Default)]
pub struct SegmentLog {
    state: Mutex<LogState>,
    /// Signalled when an event is recorded or the log is dropped.
    news: Condvar,
    /// Signalled when the node acknowledges, or the log is dropped.
    acks: Condvar,
}

impl SegmentLog {
    fn lock(&self) -> MutexGuard<'_, LogState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records an event if a node follows this log; its sequence number.
    pub fn record(&self, event: impl FnOnce() -> CatalogEvent) -> Option<u64> {
        let mut s = self.lock();
        if !s.active {
            return None;
        }
        s.last += 1;
        let seq = s.last;
        s.events.push_back((seq, event()));
        let released = if s.events.len() > s.cap {
            log::warn!(
                "a node fell {} catalog events behind; it gets a snapshot when it polls again",
                s.events.len()
            );
            self.drop_log(&mut s)
        } else {
            Vec::new()
        };
        self.news.notify_all();
        drop(s);
        drop(released); // frees space: records events, so never under the lock
        Some(seq)
    }

    /// Records `event` and keeps `space` allocated until the node acknowledges it;
    /// gives `space` back when no node follows this log.
    pub fn record_holding(
        &self,
        event: CatalogEvent,
        space: ReplicaAlloc,
    ) -> std::result::Result<u64, ReplicaAlloc> {
        let mut s = self.lock();
        if !s.active {
            return Err(space);
        }
        s.last += 1;
        let seq = s.last;
        s.events.push_back((seq, event));
        s.held.push_back((seq, space));
        self.news.notify_all();
        Ok(seq)
    }

    /// The last event whose space is still held, if any.
    pub fn held_until(&self) -> Option<u64> {
        self.lock().held.back().map(|(seq, _)| *seq)
    }

    /// Ends a waiting poll early (the segment's state changed).
    pub fn wake(&self) {
        self.lock().woken = true;
        self.news.notify_all();
    }

    /// The last event recorded, if a node follows this log.
    pub fn head(&self) -> Option<u64> {
        let s = self.lock();
        s.active.then_some(s.last)
    }

    /// Waits until the node acknowledged `seq` (true), or the log was dropped or
    /// `timeout` passed (false; the log is then dropped: its node is too slow to wait
    /// for, and gets a snapshot when it polls again).
    pub fn wait_acked(&self, seq: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut s = self.lock();
        // A reset meanwhile discards the event: then it was never acknowledged.
        let base = s.base;
        while s.active && s.base == base && s.acked < seq {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                log::warn!(
                    "a node did not acknowledge catalog event {seq} within {timeout:?}; its puts no longer wait for it"
                );
                let released = self.drop_log(&mut s);
                drop(s);
                drop(released);
                return false;
            }
            s = self
                .acks
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        s.active && s.base == base
    }

    /// Starts (or restarts) following: events from now on are recorded; returns the
    /// sequence number they count from. `expected` objects are about to be recorded
    /// as the snapshot.
    pub fn restart(&self, expected: usize) -> u64 {
        let mut s = self.lock();
        // Offloads of the previous activation will not be acknowledged any more.
        let released = Self::to_limbo(&mut s);
        s.events.clear();
        s.active = true;
        // Never 0, which a node sends before it follows anything.
        s.last += 1;
        s.base = s.last;
        s.acked = s.last;
        s.cap = expected.saturating_add(SLACK_EVENTS);
        self.acks.notify_all();
        let base = s.base;
        drop(s);
        drop(released);
        base
    }

    /// Whether `acked` is an acknowledgement of the current activation.
    pub fn follows(&self, acked: u64) -> bool {
        let s = self.lock();
        s.active && acked >= s.base && acked <= s.last && acked > 0
    }

    /// Takes the acknowledgement `acked`, then waits up to `wait` for events after it;
    /// returns the sequence number of the last event returned (or `acked`) and up to
    /// `max` events.
    pub fn poll(&self, acked: u64, wait: Duration, max: usize) -> (u64, Vec<CatalogEvent>) {
        let mut s = self.lock();
        let mut released = Vec::new();
        if s.active && acked > s.acked {
            s.acked = acked.min(s.last);
            while s.events.front().is_some_and(|(seq, _)| *seq <= acked) {
                s.events.pop_front();
            }
            while s.held.front().is_some_and(|(seq, _)| *seq <= acked) {
                released.extend(s.held.pop_front().map(|(_, r)| r));
            }
            self.acks.notify_all();
        }
        if !released.is_empty() {
            drop(s);
            drop(released);
            s = self.lock();
        }
        let deadline = Instant::now() + wait;
        while s.active && s.events.is_empty() && !s.woken {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self
                .news
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        s.woken = false;
        let (mut bytes, mut disk_work) = (0, 0);
        let out: Vec<(u64, CatalogEvent)> = s
            .events
            .iter()
            .take(max)
            .enumerate()
            .take_while(|(i, (_, e))| {
                bytes += encoded_size(e);
                // The node copies to or from disk before it acknowledges: keep the
                // copying per answer well inside the acknowledgement timeout.
                if matches!(e, CatalogEvent::Offload(_) | CatalogEvent::Load { .. }) {
                    disk_work += 1;
                }
                *i == 0 || (bytes <= MAX_POLL_BYTES && disk_work <= MAX_DISK_EVENTS_PER_POLL)
            })
            .map(|(_, e)| e)
            .cloned()
            .collect();
        let last = out.last().map_or(acked.min(s.last), |(seq, _)| *seq);
        (last, out.into_iter().map(|(_, e)| e).collect())
    }

    /// Stops following (the segment left the pool): pollers and waiting puts return.
    pub fn close(&self) {
        let mut s = self.lock();
        let released = self.drop_log(&mut s);
        drop(s);
        drop(released);
    }

    /// Stops recording and wakes everyone waiting; returns space whose time in limbo
    /// is over, for the caller to drop once it let go of the lock.
    fn drop_log(&self, s: &mut LogState) -> Vec<ReplicaAlloc> {
        s.active = false;
        s.events.clear();
        self.news.notify_all();
        self.acks.notify_all();
        Self::to_limbo(s)
    }

    /// Moves the held space to limbo; returns what finished its time there.
    fn to_limbo(s: &mut LogState) -> Vec<ReplicaAlloc> {
        let now = Instant::now();
        let held: Vec<_> = s.held.drain(..).map(|(_, r)| (now, r)).collect();
        s.limbo.extend(held);
        Self::out_of_limbo(s)
    }

    fn out_of_limbo(s: &mut LogState) -> Vec<ReplicaAlloc> {
        let now = Instant::now();
        let (done, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut s.limbo)
            .into_iter()
            .partition(|(since, _)| now.duration_since(*since) >= LIMBO);
        s.limbo = wait;
        done.into_iter().map(|(_, r)| r).collect()
    }

    /// Keeps `space`, which a node may still touch (its event went unacknowledged),
    /// unused until `LIMBO` passes.
    pub fn hold_in_limbo(&self, space: ReplicaAlloc) {
        let mut s = self.lock();
        s.limbo.push((Instant::now(), space));
        let released = Self::out_of_limbo(&mut s);
        drop(s);
        drop(released);
    }
}

/// About how many bytes `e` takes on the wire.
fn encoded_size(e: &CatalogEvent) -> usize {
    match e {
        CatalogEvent::Free(_) | CatalogEvent::Offload(_) => 9,
        CatalogEvent::Load { key, .. }
        | CatalogEvent::Forget { key, .. }
        | CatalogEvent::Keep(key) => key.len() + 32,
        CatalogEvent::Commit(entry) => entry.wire_size(),
    }
}

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
}

/// Remounts whose chunks may be arriving at once.
const MAX_PENDING_REMOUNTS: usize = 256;
/// Most disk-tier objects one remount may announce.
const MAX_DISK_ENTRIES: usize = 1 << 26;

/// An object's copy in a node's disk tier. Dropping it (the object was removed,
/// replaced, or lost its copy) tells the node to drop the copy too.
pub struct DiskCopy {
    pub seg: Arc<Segment>,
    key: Box<str>,
    version: u64,
    /// Reads served from disk so far (for the promotion threshold).
    reads: u32,
}

impl DiskCopy {
    fn new(seg: &Arc<Segment>, key: &str, version: u64) -> Box<DiskCopy> {
        Box::new(DiskCopy {
            seg: seg.clone(),
            key: key.into(),
            version,
            reads: 0,
        })
    }
}

impl Drop for DiskCopy {
    fn drop(&mut self) {
        let (key, version) = (&self.key, self.version);
        self.seg.log.record(|| CatalogEvent::Forget {
            key: key.to_string(),
            version,
        });
    }
}

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
    fn observe(&self, version: u64) -> bool {
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
        lock(&self.remounts).retain(|_, r| fresh(r.started_ms));
        lock(&self.stripes).retain(|_, s| fresh(s.started_ms));
        let expired: Vec<_> = {
            let mut relocations = lock(&self.relocations);
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

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Catalog events a batch of `PutEnd`s recorded: what the answer waits for.
#[derive(Default)]
pub struct Commits(Vec<(Arc<Segment>, u64)>);

impl Commits {
    /// Records the commit of `key` in the log of every segment holding a piece of it.
    pub fn record(&mut self, key: &str, o: &Object) {
        for replica in &o.replicas {
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
fn adopted(entry: &CatalogEntry, replica: ReplicaAlloc, now: u64) -> Object {
    Object {
        size: entry.size,
        crc32c: entry.crc32c,
        complete: true,
        writer: 0,
        started_ms: now,
        replicas: vec![replica],
        lease_until_ms: 0,
        node: policy::NONE,
        hard_pin: entry.hard_pin,
        soft_pin_until_ms: 0,
        groups: Vec::new(),
        hold: None,
        version: entry.version,
        disk: None,
    }
}

/// The object a disk tier's copy becomes when memory holds none.
fn disk_only(d: &DiskEntry, seg: &Arc<Segment>, now: u64) -> Object {
    Object {
        size: d.size,
        crc32c: d.crc32c,
        complete: true,
        writer: 0,
        started_ms: now,
        replicas: Vec::new(),
        lease_until_ms: 0,
        node: policy::NONE,
        hard_pin: false,
        soft_pin_until_ms: 0,
        groups: Vec::new(),
        hold: None,
        version: d.version,
        disk: Some(DiskCopy::new(seg, &d.key, d.version)),
    }
}

/// Tells the owners' catalogs that these pieces hold nothing any more (their space
/// is freed later, which tells them again, harmlessly).
pub(super) fn forget_pieces(replicas: &[ReplicaAlloc]) {
    for piece in replicas.iter().flatten() {
        let addr = piece.piece().addr;
        piece.seg.log.record(|| CatalogEvent::Free(addr));
    }
}

fn entry_of(key: &str, o: &Object, replica: &ReplicaAlloc, index: usize) -> CatalogEntry {
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
        let timeout = self.config.catalog_ack_timeout;
        if timeout.is_zero() {
            return;
        }
        let mut latest: HashMap<u64, (Arc<Segment>, u64)> = HashMap::new();
        for (seg, seq) in commits.0 {
            let e = latest.entry(seg.id).or_insert((seg, seq));
            e.1 = e.1.max(seq);
        }
        for (seg, seq) in latest.into_values() {
            seg.log.wait_acked(seq, timeout);
        }
    }

    /// Waits until every node caught up with its log (after removals: a removed
    /// object must not come back after a restart).
    pub(super) fn await_all_catalogs(&self) {
        let timeout = self.config.catalog_ack_timeout;
        if timeout.is_zero() {
            return;
        }
        for seg in self.segments.snapshot() {
            if let Some(seq) = seg.log.head() {
                seg.log.wait_acked(seq, timeout);
            }
        }
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
            let map = Self::lock(shard);
            for (key, o) in map.objects.iter().filter(|(_, o)| o.complete) {
                if o.disk.as_ref().is_some_and(|d| Arc::ptr_eq(&d.seg, seg)) {
                    seg.log.record(|| CatalogEvent::Keep(key.to_string()));
                }
                for replica in &o.replicas {
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
            let mut remounts = lock(&self.catalogs.remounts);
            if remounts.len() >= MAX_PENDING_REMOUNTS
                && !remounts.contains_key(&(client, name.clone()))
            {
                return Err(Error::new(
                    Code::NoAvailableHandle,
                    format!(
                        "remount of {name}: {MAX_PENDING_REMOUNTS} remounts in progress already"
                    ),
                ));
            }
            let p = remounts
                .entry((client, name.clone()))
                .or_insert_with(|| PendingRemount {
                    info: info.clone(),
                    entries: Vec::new(),
                    disk: Vec::new(),
                    started_ms: now,
                });
            if p.info != info {
                *p = PendingRemount {
                    info: info.clone(),
                    entries: Vec::new(),
                    disk: Vec::new(),
                    started_ms: now,
                };
            }
            // No segment holds more objects than 64-byte blocks.
            if (p.entries.len() + entries.len()) as u64 > info.size / 64 + 1
                || p.disk.len() + disk.len() > MAX_DISK_ENTRIES
            {
                remounts.remove(&(client, name.clone()));
                return Err(Error::invalid(format!(
                    "remount of {name}: more catalog entries than the segment has room for"
                )));
            }
            p.entries.extend(entries);
            p.disk.extend(disk);
            if !last {
                return Ok(());
            }
            remounts
                .remove(&(client, name.clone()))
                .map(|p| (p.entries, p.disk))
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

    /// Adopts an object the node's disk tier holds: a new object kept only there, or
    /// the disk copy of the version held in memory. False when refused.
    fn adopt_disk(&self, d: &DiskEntry, seg: &Arc<Segment>, now: u64) -> bool {
        if check_key(&d.key).is_err()
            || d.size == 0
            || d.size > seg.alloc.max_object_size()
            || !self.catalogs.observe(d.version)
        {
            return false;
        }
        let mut guard = Self::lock(self.shard(&d.key));
        let shard = &mut *guard;
        match shard.objects.entry(Arc::from(d.key.as_str())) {
            Entry::Vacant(v) => {
                v.insert(disk_only(d, seg, now));
                self.objects.fetch_add(1, Ordering::Relaxed);
                true
            }
            Entry::Occupied(mut o) => {
                let o = o.get_mut();
                if o.complete && o.version == d.version && o.size == d.size {
                    if o.disk.is_none() {
                        o.disk = Some(DiskCopy::new(seg, &d.key, d.version));
                    }
                    return true;
                }
                if !o.complete || o.version >= d.version {
                    return false;
                }
                let old = std::mem::replace(o, disk_only(d, seg, now));
                if old.node != policy::NONE {
                    shard.policy.remove(old.node);
                }
                self.dispose(old, now);
                true
            }
        }
    }

    /// Keeps an object just evicted from memory on a disk tier (see `DiskCopy`): one
    /// already there loses only its memory; otherwise, with offload on, a node that
    /// has a tier copies it there (its space is held until then). Without either, the
    /// object goes.
    pub(super) fn keep_on_disk(&self, shard: &mut Shard, key: &str, mut o: Object) {
        if !o.complete {
            return;
        }
        if o.disk.is_none() {
            if !self.config.offload_on_evict {
                return;
            }
            let fits = |r: &ReplicaAlloc| {
                r.len() == 1 && r[0].seg.disk_capacity.load(Ordering::Relaxed) >= o.size
            };
            let Some(pos) = o.replicas.iter().position(fits) else {
                return;
            };
            let replica = o.replicas.swap_remove(pos);
            let seg = replica[0].seg.clone();
            let addr = replica[0].piece().addr;
            if seg
                .log
                .record_holding(CatalogEvent::Offload(addr), replica)
                .is_err()
            {
                return; // no node follows the log: nobody to copy it
            }
            o.disk = Some(DiskCopy::new(&seg, key, o.version));
        }
        o.replicas.clear();
        o.node = policy::NONE;
        o.groups.clear();
        o.soft_pin_until_ms = 0;
        shard.objects.insert(Arc::from(key), o);
        self.objects.fetch_add(1, Ordering::Relaxed);
    }

    /// Waits until nodes copied what was offloaded to them, so its space is free.
    pub(super) fn await_offloads(&self) {
        let timeout = self.config.catalog_ack_timeout.max(Duration::from_secs(1));
        for seg in self.segments.snapshot() {
            if let Some(seq) = seg.log.held_until() {
                seg.log.wait_acked(seq, timeout);
            }
        }
    }

    /// Reads an object kept only on `seg`'s disk tier back into that node's memory;
    /// the replica stays (promotion) once the object was read `promotion_admission_threshold`
    /// times from disk, else it serves this reader only, until its lease ends.
    pub(super) fn read_back(
        &self,
        key: &str,
        seg: &Arc<Segment>,
        version: u64,
        size: u64,
    ) -> KeyResult<ObjectDesc> {
        // Eviction frees the pool's lowest objects wherever they are: ask for more each
        // round until some of it is in this node's segment (bounded).
        let mut space = None;
        let mut want = size;
        for _ in 0..16 {
            if let Some(alloc) = seg.alloc.alloc(size) {
                space = Some(PieceAlloc {
                    seg: seg.clone(),
                    alloc,
                });
                break;
            }
            if self.evict(want, false) == 0 && self.evict(want, true) == 0 {
                break;
            }
            self.await_offloads();
            want = want.saturating_mul(2);
        }
        let space = space.ok_or(Code::NoAvailableHandle)?;
        let addr = space.piece().addr;
        let seq = seg
            .log
            .record(|| CatalogEvent::Load {
                key: key.to_owned(),
                version,
                addr,
                size,
            })
            .ok_or(Code::ReplicaIsNotReady)?;
        let timeout = self.config.catalog_ack_timeout.max(Duration::from_secs(1));
        if !seg.log.wait_acked(seq, timeout) {
            // The node may still write the value there later: not reusable for a while.
            seg.log.hold_in_limbo(vec![space]);
            return Err(Code::ReplicaIsNotReady);
        }
        let now = self.clock.now_ms();
        let ttl = self.config.lease_ttl.as_millis() as u64;
        let mut map = Self::lock(self.shard(key));
        // The node reports a copy it could not read as lost before it acknowledges,
        // so an object still holding its disk copy here was read back.
        let Some(o) = map.get_mut(key).filter(|o| {
            o.complete
                && o.version == version
                && o.disk.as_ref().is_some_and(|d| Arc::ptr_eq(&d.seg, seg))
        }) else {
            return Err(Code::ObjectNotFound);
        };
        let reads = o.disk.as_mut().map_or(0, |d| {
            d.reads = d.reads.saturating_add(1);
            d.reads
        });
        if reads >= self.config.promotion_admission_threshold {
            o.replicas.push(vec![space]);
            Commits::default().record(key, o);
            drop(map);
            return self.lookup(key, false);
        }
        o.lease_until_ms = o.lease_until_ms.max(now + ttl);
        let staged = vec![vec![space]];
        let desc = ObjectDesc {
            size: o.size,
            crc32c: o.crc32c,
            lease_ms: ttl,
            replicas: segments::describe(&staged),
        };
        drop(map);
        self.quarantine_replicas(staged, now + ttl);
        Ok(desc)
    }

    /// A node's disk tier lost `key`'s copy: the object goes with it unless it is
    /// also in memory.
    fn lose_disk_copy(&self, key: &str, seg: &Arc<Segment>) {
        if check_key(key).is_err() {
            return;
        }
        let mut map = Self::lock(self.shard(key));
        let Some(o) = map.get_mut(key) else { return };
        if !o.disk.as_ref().is_some_and(|d| Arc::ptr_eq(&d.seg, seg)) {
            return;
        }
        o.disk = None;
        if o.replicas.is_empty() {
            map.remove(key);
            self.objects.fetch_sub(1, Ordering::Relaxed);
        }
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
        let mut stripes = lock(&self.catalogs.stripes);
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
        let mut guard = Self::lock(self.shard(key));
        let shard = &mut *guard;
        match shard.objects.entry(Arc::from(key)) {
            Entry::Vacant(v) => {
                v.insert(adopted(entry, replica, now));
                self.objects.fetch_add(1, Ordering::Relaxed);
            }
            Entry::Occupied(mut o) => {
                let o = o.get_mut();
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
                let old = std::mem::replace(o, adopted(entry, replica, now));
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn nothing_is_recorded_until_a_node_follows() {
        let log = SegmentLog::default();
        assert_eq!(log.record(|| CatalogEvent::Free(1)), None);
        assert_eq!(log.head(), None);
        let base = log.restart(0);
        assert_eq!(log.record(|| CatalogEvent::Free(64)), Some(base + 1));
        let (last, events) = log.poll(base, Duration::ZERO, 10);
        assert_eq!((last, events), (base + 1, vec![CatalogEvent::Free(64)]));
        assert!(log.follows(last));
        assert!(!log.follows(last + 1));
    }

    #[test]
    fn a_waiting_put_returns_once_the_node_acknowledges() {
        let log = Arc::new(SegmentLog::default());
        let base = log.restart(0);
        let seq = log.record(|| CatalogEvent::Free(0)).unwrap();
        let node = {
            let log = log.clone();
            std::thread::spawn(move || {
                let (last, _) = log.poll(base, Duration::from_secs(5), 10);
                log.poll(last, Duration::ZERO, 10);
            })
        };
        assert!(log.wait_acked(seq, Duration::from_secs(30)));
        node.join().unwrap();
    }

    #[test]
    fn a_silent_node_loses_its_log_and_puts_stop_waiting() {
        let log = SegmentLog::default();
        log.restart(0);
        let seq = log.record(|| CatalogEvent::Free(0)).unwrap();
        assert!(!log.wait_acked(seq, Duration::from_millis(1)));
        assert_eq!(log.head(), None);
        assert!(!log.follows(seq));
    }
}
