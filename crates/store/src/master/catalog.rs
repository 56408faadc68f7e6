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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::note_slots::Lent;
use super::replicas::Replicas;
use super::segment_log::MAX_EVENTS_PER_POLL;
use super::segments::{self, PieceAlloc, ReplicaAlloc, Segment};
use super::table::Shard;
use super::{policy, Master, Object};
use crate::allocator::SlabAllocator;
use crate::error::{Code, Error, Result};
use crate::protocol::{
    check_key, note, shown_key, CatalogEntry, CatalogEvent, DiskEntry, NoteRing, NoteWrite,
    OwnerTicket, ReplicaDesc, SegmentEvents, SegmentInfo, NOTE_SLOT,
};

/// A remount whose last chunk does not come within this long is dropped.
const REMOUNT_PATIENCE_MS: u64 = 60_000;

/// Catalog state of the master as a whole.
pub struct Catalogs {
    /// This master's incarnation: sequence numbers of another one mean nothing here.
    instance: u64,
    /// Versions at or below this were written by an earlier master (see
    /// `predates_this_master`); every version this one hands out is above it.
    recovered_ceiling: u64,
    /// The last version handed out. Versions are milliseconds since the epoch shifted
    /// left by `VERSION_SEQ_BITS`; this one starts at `recovered_ceiling`, so a
    /// restarted master (or a new leader) writes versions above its predecessor's.
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
            + e.replica.pieces.len() * std::mem::size_of::<crate::protocol::Piece>();
        std::mem::size_of::<CatalogEntry>() + e.key.len() + pieces
    };
    let disk_entry = |d: &DiskEntry| std::mem::size_of::<DiskEntry>() + d.key.len();
    (entries.iter().map(entry).sum::<usize>() + disk.iter().map(disk_entry).sum::<usize>()) as u64
}

/// What a node's claim to an object does (see `Master::judge_claim`).
pub(super) enum Claim {
    /// The master holds nothing under the key: the claim becomes the object.
    New,
    /// The very object the master holds: the claim adds a copy of it.
    Same,
    /// Refused; the object held stays.
    Refused,
    /// Refused, and the object held goes too.
    Contested,
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
        let recovered_ceiling = (now_unix_ms() + MAX_CLOCK_SKEW_MS) << VERSION_SEQ_BITS;
        Catalogs {
            instance: crate::sys::random_u64() | 1,
            recovered_ceiling,
            versions: AtomicU64::new(recovered_ceiling),
            remounts: Mutex::new(HashMap::new()),
            stripes: Mutex::new(HashMap::new()),
            relocations: Mutex::new(HashMap::new()),
        }
    }

    /// A version above every one handed out so far.
    pub fn next_version(&self) -> u64 {
        self.versions.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Whether a node may announce an object at `version`: never above what this
    /// master has handed out (an earlier master's versions all lie below the first).
    pub(super) fn may_claim(&self, version: u64) -> bool {
        version <= self.versions.load(Ordering::Relaxed)
    }

    /// Whether `version` was written by an earlier master, not by this one. Only
    /// nodes vouch for such an object; this master wrote every other one itself.
    pub(super) fn predates_this_master(&self, version: u64) -> bool {
        version <= self.recovered_ceiling
    }

    /// Whether some node's remount is still arriving.
    pub(super) fn remounts_pending(&self) -> bool {
        !self.remounts.locked().is_empty()
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

/// How far ahead of this master's clock a predecessor's may have run: its versions
/// up to this far ahead are still its own (a standby whose clock lags more loses the
/// objects written in the difference, which are then refused as never issued).
const MAX_CLOCK_SKEW_MS: u64 = 60_000;

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
        self.record_noted(key, o, Vec::new());
    }

    /// As `record`; a piece whose node holds the put's note (`notes`) needs no
    /// waiting for, unless its segment drains (the node moves what its catalog lists).
    pub fn record_noted(&mut self, key: &str, o: &Object, mut notes: Vec<NoteHold>) {
        for replica in o.replicas.iter() {
            for (index, piece) in replica.iter().enumerate() {
                let commit = || CatalogEvent::Commit(entry_of(key, o, replica, index));
                let noted = notes.iter().position(|n| n.is_for(piece));
                let (seq, covered) = match noted {
                    Some(at) => notes.swap_remove(at).commit(commit()),
                    None => (piece.seg.log.record(commit), false),
                };
                let covered = covered && !piece.seg.draining.load(Ordering::SeqCst);
                if let (Some(seq), false) = (seq, covered) {
                    self.0.push((piece.seg.clone(), seq));
                }
            }
        }
        // Notes of pieces the object no longer has: the writer is done with them.
        for n in notes {
            n.revoke();
        }
    }
}

/// A slot of a node's note ring lent to an unfinished put, for the note of one piece.
/// Dropped unconsumed (the put abandoned), its note is cleared, and the slot kept
/// from other puts until `until`: the writer may still write into it.
pub struct NoteHold {
    seg: Arc<Segment>,
    /// The piece's address.
    addr: u64,
    /// Where in the ring the note goes.
    slot_addr: u64,
    lent: Option<Lent>,
    until: Instant,
}

impl NoteHold {
    /// Whether this is the note of `piece`.
    fn is_for(&self, piece: &PieceAlloc) -> bool {
        Arc::ptr_eq(&self.seg, &piece.seg) && self.addr == piece.piece().addr
    }

    /// Records the piece's commit; its sequence number and whether the note covers it.
    fn commit(mut self, commit: CatalogEvent) -> (Option<u64>, bool) {
        match self.lent.take() {
            Some(lent) => self.seg.log.commit_noted(commit, lent),
            None => (self.seg.log.record(|| commit), false),
        }
    }

    /// The writer is done and the put failed: the note is cleared. The segment, whose
    /// log head the answer waits for: the node may hold the put already (its note read
    /// at a reset), and drops it at the frees recorded since.
    pub fn revoke(mut self) -> Option<Arc<Segment>> {
        let lent = self.lent.take()?;
        self.seg.log.drop_note(lent, true, self.until);
        Some(self.seg.clone())
    }

    /// The fence keeping this note's slot from other puts, should `seg` (its segment)
    /// be mounted again while the writer may still write (see `Master::drop_segment`).
    pub fn fence_on(&self, seg: &Segment, until_ms: u64) -> Option<segments::Fence> {
        (self.seg.id == seg.id && self.lent.is_some()).then_some(segments::Fence {
            addr: self.slot_addr,
            len: NOTE_SLOT as u64,
            until_ms,
        })
    }
}

impl Drop for NoteHold {
    fn drop(&mut self) {
        if let Some(lent) = self.lent.take() {
            self.seg.log.drop_note(lent, false, self.until);
        }
    }
}

/// Lends a note slot for the piece of every replica (`next_lend` numbers them) and
/// seals each piece's note for `entry` (its key, version, size, checksum and pin);
/// None, with every slot given back, when a node keeps no ring, has no free slot, a
/// note does not fit a slot, or a replica is striped (one piece's note cannot vouch
/// for the bytes of the others, which the node does not hold).
pub(super) fn lend_notes(
    replicas: &Replicas,
    entry: &mut CatalogEntry,
    until: Instant,
    next_lend: &dyn Fn() -> u64,
) -> Option<(Vec<NoteHold>, Vec<NoteWrite>)> {
    if replicas.iter().any(|r| r.len() != 1) {
        return None;
    }
    let mut holds = Vec::new();
    let mut writes = Vec::new();
    for piece in replicas.pieces() {
        entry.replica = ReplicaDesc {
            pieces: vec![piece.piece()].into(),
        };
        entry.index = 0;
        let Some((lent, key, ring)) = piece.seg.log.lend_note(next_lend) else {
            unlend(holds);
            return None;
        };
        let hold = NoteHold {
            seg: piece.seg.clone(),
            addr: piece.piece().addr,
            slot_addr: ring.slot_addr(lent.slot),
            lent: Some(lent),
            until,
        };
        let Some(bytes) = note::seal(&key, lent, entry) else {
            holds.push(hold);
            unlend(holds);
            return None;
        };
        writes.push(NoteWrite {
            segment: piece.seg.info.name.clone(),
            addr: hold.slot_addr,
            bytes,
        });
        holds.push(hold);
    }
    Some((holds, writes))
}

/// Gives back slots no note was written to.
fn unlend(holds: Vec<NoteHold>) {
    for mut h in holds {
        if let Some(lent) = h.lent.take() {
            h.seg.log.unlend_note(lent);
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
        (instance, acked): (u64, u64),
        disk_capacity: u64,
        lost: Vec<String>,
        ring: NoteRing,
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
        if seg.adopting.load(Ordering::SeqCst) {
            // Its remount is still adopting objects: a snapshot now would miss them.
            return Err(Error::new(
                Code::UnavailableInCurrentStatus,
                format!("segment {name} is still taking its catalog back"),
            ));
        }
        let instance_now = self.catalogs.instance;
        if instance != instance_now || !seg.log.follows(acked) {
            let expected = self.objects.load(Ordering::Relaxed) as usize;
            let base = seg.log.restart(expected, ring, &seg.info);
            self.record_snapshot(&seg);
            return Ok(SegmentEvents {
                instance: instance_now,
                reset: true,
                snapshot_end: seg.log.head().unwrap_or(base),
                draining: seg.draining.load(Ordering::SeqCst),
                last: base,
                events: Vec::new(),
                note_key: seg.log.note_key(),
            });
        }
        let (last, events) =
            seg.log
                .poll(acked, self.config.catalog_poll_wait, MAX_EVENTS_PER_POLL);
        Ok(SegmentEvents {
            instance: instance_now,
            reset: false,
            snapshot_end: 0,
            draining: seg.draining.load(Ordering::SeqCst),
            last,
            events,
            note_key: None,
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
        owner: Option<OwnerTicket>,
    ) -> Result<Option<OwnerTicket>> {
        self.check_segment(&info)?;
        if let Some(seg) = self.segments.get(&info.name) {
            if seg.client == client {
                // Mounted already: a repeated remount changes nothing.
                return Ok(owner.and(seg.owner));
            }
        }
        self.contest_name(client, &info.name, owner.as_ref(), false)?;
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
                return Ok(None);
            }
            remounts.remove(&id).map(|p| (p.entries, p.disk))
        };
        let (entries, disk) = pending.unwrap_or_default();
        self.check_backed(&info)?;
        let base = info.base;
        let end = info.base + info.size;
        let claims: Vec<(u64, u64)> = entries
            .iter()
            .map(|e| match e.piece() {
                Some(p)
                    if *p.segment == *name
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
        self.contest_name(client, &name, owner.as_ref(), true)?;
        // Space writers may still land in (the segment was dropped under them) is
        // held as well, after what the catalog claims.
        let fences = self.segments.take_fences(&name, &info, now);
        let mut claims = claims;
        claims.extend(segments::fence_claims(&info, &fences));
        let config = self.config.allocator.for_segment(info.size);
        let (alloc, mut taken) = SlabAllocator::with_claims(info.size, config, &claims);
        let fence_taken = taken.split_off(entries.len());
        let ticket = owner.map(|shown| self.owners.renew(&name, shown));
        let seg = match self
            .segments
            .mount_rebuilt(client, info.clone(), alloc, ticket)
        {
            Ok(seg) => seg,
            Err(_) => {
                self.segments.restore_fences(&name, &info, fences);
                return Err(Error::new(
                    Code::SegmentAlreadyExists,
                    format!("segment {name} is already mounted by another client"),
                ));
            }
        };
        // Polls wait (`adopting`) until every announced object is adopted below.
        let _adopted = Adopting(&seg.adopting);
        self.hold_fenced(segments::fenced_space(&seg, &fences, fence_taken));
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
        Ok(ticket)
    }

    /// Refuses a remount of `name`, held by another client, unless the ticket it
    /// shows outranks the holder's (see `owner`); with `take`, the holder's segment is
    /// dropped then (it squatted the name: what was put there is lost).
    fn contest_name(
        &self,
        client: u64,
        name: &str,
        shown: Option<&OwnerTicket>,
        take: bool,
    ) -> Result<()> {
        let Some(held) = self.segments.get(name).filter(|s| s.client != client) else {
            return Ok(());
        };
        if !self.owners.outranks(name, shown, held.owner.as_ref()) {
            return Err(Error::new(
                Code::SegmentAlreadyExists,
                format!("segment {name} is already mounted by another client"),
            ));
        }
        if take {
            log::warn!(
                "segment {name}: client {client:#x} holds an earlier owner ticket than the client that mounted it; that mount is dropped"
            );
            self.drop_segment(name, false);
        }
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
        if check_key(&entry.key).is_err() || !self.catalogs.may_claim(entry.version) {
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
            first.segment.to_string(),
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

    /// Makes `replica` a replica of `entry.key`, as `judge_claim` rules; false when
    /// refused, or when its pieces do not add up to the value.
    fn adopt_replica(&self, entry: &CatalogEntry, replica: ReplicaAlloc, now: u64) -> bool {
        let described: Vec<_> = replica.iter().map(PieceAlloc::piece).collect();
        if described[..] != entry.replica.pieces[..]
            || described.iter().map(|p| p.len).sum::<u64>() != entry.size
        {
            return false;
        }
        let key = entry.key.as_str();
        let mut guard = self.shard(key).locked();
        let shard = &mut *guard;
        let claimed = (entry.version, entry.size, entry.crc32c);
        match self.judge_claim(shard.get(key), claimed) {
            Claim::New => {
                shard.objects.insert(key, adopted(entry, replica));
                self.objects.fetch_add(1, Ordering::Relaxed);
            }
            Claim::Same => {
                if let Some(o) = shard.get_mut(key) {
                    o.replicas.push(replica);
                }
                return true;
            }
            Claim::Refused => return false,
            Claim::Contested => {
                self.drop_contested(shard, key, now);
                return false;
            }
        }
        self.touch(shard, key);
        true
    }

    /// How far a node's claim that it holds `key` at `claimed` (version, size,
    /// CRC32C) is believed, given the object the master holds under the key. A node
    /// is taken at its word only where the master cannot know better: for a key it
    /// does not hold, or as one more copy of the very object it holds (readers check
    /// every copy's checksum). An object this master wrote itself is never replaced
    /// by a claim; one that only an earlier master wrote, and some node vouched for,
    /// cannot be told from a contradicting claim, so both go (a miss, never a guess).
    pub(super) fn judge_claim(&self, held: Option<&Object>, claimed: (u64, u64, u32)) -> Claim {
        let Some(o) = held else {
            return Claim::New;
        };
        if !o.complete {
            return Claim::Refused; // a put of the key is under way here
        }
        if (o.version, o.size, o.crc32c) == claimed {
            return Claim::Same;
        }
        if self.catalogs.predates_this_master(o.version) {
            Claim::Contested
        } else {
            Claim::Refused
        }
    }

    /// Removes `key`, held from an earlier master, after a node contradicted it.
    pub(super) fn drop_contested(&self, shard: &mut Shard, key: &str, now: u64) {
        if let Some(o) = shard.remove(key) {
            self.objects.fetch_sub(1, Ordering::Relaxed);
            log::warn!(
                "{}: nodes announce different objects under this key; dropped, as \
                 nothing tells which one is right",
                shown_key(key)
            );
            self.dispose(o, now);
        }
    }
}

/// Clears a remounted segment's `adopting` flag when its adoption ends, however it
/// ends.
struct Adopting<'a>(&'a AtomicBool);

impl Drop for Adopting<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}
