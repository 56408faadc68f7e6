//! A node's catalog of the object pieces in its own segment (see the master's
//! `catalog` module): kept up to date by long-polling the master, and handed to a
//! master that lost its state, so that objects whose bytes this node still holds are
//! served again without being written again.

use std::collections::HashMap;
use std::time::Instant;

use super::disk::NodeDisk;
use crate::protocol::{
    note, CatalogEntry, CatalogEvent, DiskEntry, NoteKey, NoteRing, OwnerTicket, Request,
    SegmentEvents, SegmentInfo, NOTE_SLOT,
};
use crate::util::crc32c::crc32c;

/// Entries per `Remount` chunk.
const CHUNK_ENTRIES: usize = 4096;
/// Bytes per `Remount` chunk (the RPC frame limit is 16 MiB).
const CHUNK_BYTES: usize = 4 << 20;

/// What this node knows of its segment, by piece address.
#[derive(Default)]
pub struct NodeCatalog {
    /// The master incarnation `acked` counts in (0: none yet).
    instance: u64,
    acked: u64,
    /// Bumped by each reset; entries carry the generation that last confirmed them.
    generation: u64,
    /// While a reset's snapshot is arriving: the sequence number that completes it.
    snapshot_end: Option<u64>,
    entries: HashMap<u64, (CatalogEntry, u64)>,
    /// Where evicted objects go, if this node has a disk tier.
    disk: Option<NodeDisk>,
    /// Disk copies gone that the master has yet to hear of.
    lost: Vec<String>,
    /// The master asked this node to drain (and leave).
    drain_asked: bool,
    /// Disk copies the current reset's snapshot (or an offload since) confirmed.
    disk_kept: std::collections::HashSet<String>,
    /// The disk tier takes no new copies (it is being given up).
    disk_closed: bool,
    /// Where writers put the notes of commits this catalog has yet to hear of (see
    /// `protocol::note`): memory of this process beside the segment (no slots: none).
    ring: NoteRing,
    /// The key and epoch the master seals notes with now.
    note_key: Option<(NoteKey, u64)>,
    /// Per ring slot, the last lend whose note was consumed: a note of it or of an
    /// earlier lend names nothing (written late, or replayed). In this process's own
    /// memory, out of writers' reach.
    consumed: Vec<u64>,
}

/// What one remount sent.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Announced {
    /// Pieces announced.
    pub pieces: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Pieces dropped because their bytes no longer match their checksum.
    pub corrupt: u64,
    /// Objects announced from the disk tier.
    pub on_disk: u64,
    /// Pieces known from notes (commits this catalog had not applied yet).
    pub noted: u64,
    /// Seconds spent checking and sending.
    pub seconds: f64,
}

/// `len` bytes at `addr` of `segment`, if they lie inside it.
///
/// # Safety
/// The segment must be memory of this process, readable and writable, for `'a`.
unsafe fn segment_bytes<'a>(segment: &SegmentInfo, addr: u64, len: u64) -> Option<&'a mut [u8]> {
    let end = addr.checked_add(len)?;
    if addr < segment.base || end > segment.base + segment.size || len == 0 {
        return None;
    }
    // SAFETY: the range lies inside the segment, which the caller guarantees is this
    // process's memory for `'a`.
    Some(unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len as usize) })
}

/// The ranges `(addr, len)` of one value as slices of `segment`, if every one lies in
/// it, none overlaps another, and together they are `size` bytes.
///
/// # Safety
/// As `segment_bytes`.
unsafe fn segment_pieces<'a>(
    segment: &SegmentInfo,
    ranges: &[(u64, u64)],
    size: u64,
) -> Option<Vec<&'a mut [u8]>> {
    let total = ranges.iter().try_fold(0u64, |n, r| n.checked_add(r.1))?;
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable();
    // Distinct slices may be handed out as `&mut` only if they do not overlap.
    let disjoint = sorted
        .windows(2)
        .all(|w| w[0].0.checked_add(w[0].1).is_some_and(|end| end <= w[1].0));
    if total != size || !disjoint {
        return None;
    }
    ranges
        .iter()
        // SAFETY: each range is checked by `segment_bytes`; they are disjoint.
        .map(|&(addr, len)| unsafe { segment_bytes(segment, addr, len) })
        .collect()
}

impl NodeCatalog {
    /// A catalog for a node with (or without) a disk tier and a note ring.
    ///
    /// # Safety
    /// The ring's memory must be this process's, readable and writable, for as long
    /// as the catalog lives, and touched by nothing else but writers' notes.
    pub unsafe fn new(disk: Option<NodeDisk>, ring: NoteRing) -> NodeCatalog {
        NodeCatalog {
            disk,
            ring,
            ..NodeCatalog::default()
        }
    }

    /// The bytes of `slot` of the ring.
    fn slot_bytes(&mut self, slot: u32) -> Option<&mut [u8]> {
        if slot >= self.ring.slots {
            return None;
        }
        // SAFETY: `new`'s caller guarantees the ring is this process's memory for the
        // catalog's life; the slot lies inside it.
        Some(unsafe {
            std::slice::from_raw_parts_mut(self.ring.slot_addr(slot) as *mut u8, NOTE_SLOT)
        })
    }

    /// Takes the notes of commits this catalog has not applied yet into it (at the
    /// generation now): before a reset, whose snapshot then confirms or drops them,
    /// and before a remount. A note never replaces an entry as new as itself.
    fn fold_notes(&mut self, segment: &SegmentInfo) -> u64 {
        let Some((key, epoch)) = self.note_key else {
            return 0;
        };
        let mut folded = 0;
        for slot in 0..self.ring.slots {
            let Some((lend, entry)) = self
                .slot_bytes(slot)
                .and_then(|b| note::open(b, &key, epoch, slot))
            else {
                continue;
            };
            if self.consumed.get(slot as usize).is_some_and(|c| lend <= *c) {
                continue;
            }
            let Some(addr) = entry
                .piece()
                .filter(|p| *p.segment == segment.name)
                .map(|p| p.addr)
            else {
                continue;
            };
            let newer = self
                .entries
                .get(&addr)
                .is_some_and(|(e, _)| e.version >= entry.version);
            if !newer {
                self.entries.insert(addr, (entry, self.generation));
                folded += 1;
            }
        }
        folded
    }

    /// The next poll's request for `segment` of `client` (it carries the disk copies
    /// lost so far; give them back with `unsent` if the request fails).
    pub fn poll_request(&mut self, client: u64, segment: &str) -> Request {
        if let Some(d) = &self.disk {
            self.lost.extend(d.take_dropped());
        }
        Request::SegmentEvents {
            client,
            segment: segment.to_owned(),
            instance: self.instance,
            acked: self.acked,
            disk_capacity: match self.disk_closed {
                true => 0,
                false => self.disk.as_ref().map_or(0, NodeDisk::capacity),
            },
            lost: std::mem::take(&mut self.lost),
            ring: self.ring,
        }
    }

    /// Takes back the lost keys of a request that did not reach the master.
    pub fn unsent(&mut self, req: Request) {
        if let Request::SegmentEvents { lost, .. } = req {
            self.lost.extend(lost);
        }
    }

    /// Applies a poll's answer: the catalog changes, and what the master asks of the
    /// disk tier (keep an evicted object, read one back, drop one).
    ///
    /// # Safety
    /// `segment` must be memory of this process, readable and writable, for the call.
    pub unsafe fn apply(&mut self, ev: SegmentEvents, segment: &SegmentInfo) {
        self.drain_asked |= ev.draining;
        if ev.reset {
            // Notes of the ending epoch cannot be opened after it: read them now.
            self.fold_notes(segment);
            self.note_key = ev.note_key.map(|k| (k, ev.last));
            self.instance = ev.instance;
            self.generation += 1;
            self.disk_kept.clear();
            self.snapshot_end = Some(ev.snapshot_end);
            self.acked = ev.last;
            return;
        }
        if ev.instance != self.instance {
            return; // an answer of a master that is gone
        }
        for e in ev.events {
            match e {
                CatalogEvent::Commit(entry) => {
                    if let Some(addr) = entry.piece().map(|p| p.addr) {
                        self.entries.insert(addr, (entry, self.generation));
                    }
                }
                CatalogEvent::Free(addr) => {
                    self.entries.remove(&addr);
                }
                CatalogEvent::Unnote { slot, lend } => {
                    if let Some(b) = self.slot_bytes(slot) {
                        note::clear(b);
                        self.consumed.resize(self.ring.slots as usize, 0);
                        let c = &mut self.consumed[slot as usize];
                        *c = (*c).max(lend);
                    }
                }
                CatalogEvent::Offload(addr) => {
                    let Some((entry, _)) = self.entries.remove(&addr) else {
                        continue;
                    };
                    let Some(disk) = &self.disk else { continue };
                    let ranges: Vec<(u64, u64)> = entry
                        .replica
                        .pieces
                        .iter()
                        .map(|p| (p.addr, p.len))
                        .collect();
                    // SAFETY: the caller guarantees the segment is this process's
                    // memory; `segment_pieces` keeps every range inside it.
                    let kept = match unsafe { segment_pieces(segment, &ranges, entry.size) } {
                        Some(parts) => {
                            let parts: Vec<&[u8]> = parts.into_iter().map(|p| &*p).collect();
                            disk.offload(&entry, &parts)
                        }
                        // The master offloads only replicas wholly in this segment.
                        None => Err(crate::error::Error::invalid(
                            "a replica not wholly in this segment",
                        )),
                    };
                    if kept.is_ok() {
                        self.disk_kept.insert(entry.key.clone());
                    }
                    if let Err(e) = kept {
                        log::warn!("offloading {}: {e}", crate::protocol::shown_key(&entry.key));
                        self.lost.push(entry.key);
                    }
                }
                CatalogEvent::Load {
                    key,
                    version,
                    pieces,
                } => {
                    let size = pieces.iter().fold(0u64, |n, p| n.saturating_add(p.1));
                    // SAFETY: as above.
                    let dst = unsafe { segment_pieces(segment, &pieces, size) };
                    let loaded = match (&self.disk, dst) {
                        (Some(disk), Some(mut dst)) => disk.load(&key, version, &mut dst),
                        _ => Err(crate::error::Error::invalid(
                            "no disk tier or a bad address",
                        )),
                    };
                    if let Err(e) = loaded {
                        log::warn!(
                            "reading {} back from disk: {e}",
                            crate::protocol::shown_key(&key)
                        );
                        self.lost.push(key);
                    }
                }
                CatalogEvent::Forget { key, version } => {
                    if let Some(disk) = &self.disk {
                        disk.forget(&key, version);
                    }
                    self.disk_kept.remove(&key);
                }
                CatalogEvent::Keep(key) => {
                    // A copy the pool counts on but this tier lacks (an offload that
                    // never got written): say so now, not at its first read.
                    if self.disk.as_ref().is_some_and(|d| d.holds(&key)) {
                        self.disk_kept.insert(key);
                    } else {
                        self.lost.push(key);
                    }
                }
            }
        }
        self.acked = ev.last;
        if self.snapshot_end.is_some_and(|end| self.acked >= end) {
            // Whatever the snapshot did not confirm is no longer there.
            let generation = self.generation;
            self.entries.retain(|_, (_, g)| *g == generation);
            self.snapshot_end = None;
            // Likewise on disk: a copy the pool no longer counts (its Forget was lost
            // while nobody followed the log) must not come back at the next restart.
            if let Some(disk) = &self.disk {
                for key in disk.keys() {
                    if !self.disk_kept.contains(&key) {
                        disk.forget(&key, u64::MAX);
                    }
                }
            }
            self.disk_kept.clear();
        }
    }

    /// Stops offering the disk tier: the next poll reports no room, so nothing more is
    /// offloaded there (copies in it are still read back). False without a disk tier.
    pub fn close_disk(&mut self) -> bool {
        self.disk_closed = true;
        self.disk.is_some()
    }

    /// Gives the disk tier up: every copy in it is deleted and reported lost (an
    /// object kept only there goes with it).
    pub fn drop_disk(&mut self) {
        if let Some(disk) = self.disk.take() {
            for key in disk.keys() {
                disk.forget(&key, u64::MAX);
                self.lost.push(key);
            }
        }
    }

    /// Whether the master asked this node to drain (in any answer since the last call).
    pub fn take_drain_request(&mut self) -> bool {
        std::mem::take(&mut self.drain_asked)
    }

    /// One entry per object whose replica lies wholly in this node's segment (what
    /// this node can move elsewhere from its own memory), by key.
    pub fn movable(&self, segment: &str) -> Vec<CatalogEntry> {
        let mut seen = std::collections::HashSet::new();
        self.entries
            .values()
            .map(|(e, _)| e)
            .filter(|e| e.replica.pieces.iter().all(|p| *p.segment == *segment))
            .filter(|e| seen.insert((e.key.clone(), e.version)))
            .cloned()
            .collect()
    }

    /// Forgets the master followed so far (a new one answers with a reset).
    pub fn forget_master(&mut self) {
        self.instance = 0;
        self.acked = 0;
    }

    /// Pieces known.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no piece is known.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The catalog as `Remount` requests for `segment`, showing the node's `owner`
    /// ticket for its name, after dropping entries outside it and, for unstriped
    /// pieces, those whose bytes no longer match their CRC32C.
    ///
    /// # Safety
    /// `segment.base .. segment.base + segment.size` must be readable memory of this
    /// process for the whole call.
    pub unsafe fn remount_requests(
        &mut self,
        client: u64,
        segment: &SegmentInfo,
        owner: OwnerTicket,
    ) -> (Vec<Request>, Announced) {
        let started = Instant::now();
        // The notes of the master that is gone, then no more of them.
        let mut stats = Announced {
            noted: self.fold_notes(segment),
            ..Announced::default()
        };
        self.note_key = None;
        let end = segment.base + segment.size;
        self.entries.retain(|_, (e, _)| {
            let Some(p) = e.piece() else { return false };
            let inside =
                p.addr >= segment.base && p.addr.checked_add(p.len).is_some_and(|e| e <= end);
            if *p.segment != segment.name || !inside {
                return false;
            }
            if e.replica.pieces.len() == 1 {
                // SAFETY: the piece lies inside the segment, which the caller
                // guarantees is readable for the whole call.
                let bytes =
                    unsafe { std::slice::from_raw_parts(p.addr as *const u8, p.len as usize) };
                if crc32c(bytes) != e.crc32c {
                    log::warn!(
                        "catalog: {} at {:#x} no longer matches its checksum; not announced",
                        crate::protocol::shown_key(&e.key),
                        p.addr
                    );
                    stats.corrupt += 1;
                    return false;
                }
            }
            stats.pieces += 1;
            stats.bytes += p.len;
            true
        });
        let mut requests = Vec::new();
        let mut chunk: Vec<CatalogEntry> = Vec::new();
        let mut bytes = 0;
        for (e, _) in self.entries.values() {
            if !chunk.is_empty()
                && (chunk.len() == CHUNK_ENTRIES || bytes + e.wire_size() > CHUNK_BYTES)
            {
                requests.push(remount(
                    (client, owner),
                    segment,
                    std::mem::take(&mut chunk),
                    vec![],
                    false,
                ));
                bytes = 0;
            }
            bytes += e.wire_size();
            chunk.push(e.clone());
        }
        requests.push(remount((client, owner), segment, chunk, vec![], false));
        let disk = self
            .disk
            .as_ref()
            .map(NodeDisk::entries)
            .unwrap_or_default();
        stats.on_disk = disk.len() as u64;
        for part in disk.chunks(CHUNK_ENTRIES) {
            requests.push(remount(
                (client, owner),
                segment,
                vec![],
                part.to_vec(),
                false,
            ));
        }
        if let Some(Request::Remount { last, .. }) = requests.last_mut() {
            *last = true;
        }
        stats.seconds = started.elapsed().as_secs_f64();
        (requests, stats)
    }
}

fn remount(
    (client, owner): (u64, OwnerTicket),
    segment: &SegmentInfo,
    entries: Vec<CatalogEntry>,
    disk: Vec<DiskEntry>,
    last: bool,
) -> Request {
    Request::Remount {
        client,
        segment: segment.clone(),
        entries,
        disk,
        last,
        owner: Some(owner),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Piece, ReplicaDesc};

    fn entry(key: &str, addr: u64, bytes: &[u8]) -> CatalogEntry {
        CatalogEntry {
            key: key.into(),
            version: 1,
            size: bytes.len() as u64,
            crc32c: crc32c(bytes),
            hard_pin: false,
            replica: ReplicaDesc {
                pieces: vec![Piece {
                    segment: "seg".into(),
                    addr,
                    len: bytes.len() as u64,
                }]
                .into(),
            },
            index: 0,
        }
    }

    fn apply(c: &mut NodeCatalog, segment: &SegmentInfo, ev: SegmentEvents) {
        // SAFETY: the tests' segments are vectors alive for the whole test.
        unsafe { c.apply(ev, segment) }
    }

    fn answer(
        reset: bool,
        snapshot_end: u64,
        last: u64,
        events: Vec<CatalogEvent>,
    ) -> SegmentEvents {
        SegmentEvents {
            instance: 7,
            reset,
            snapshot_end,
            draining: false,
            last,
            events,
            note_key: None,
        }
    }

    #[test]
    fn a_reset_keeps_old_entries_until_its_snapshot_is_complete() {
        let memory = vec![5u8; 4096];
        let base = memory.as_ptr() as u64;
        let segment = SegmentInfo {
            name: "seg".into(),
            base,
            size: 4096,
        };
        let mut c = NodeCatalog::default();
        apply(&mut c, &segment, answer(true, 12, 10, vec![]));
        apply(
            &mut c,
            &segment,
            answer(
                false,
                0,
                11,
                vec![CatalogEvent::Commit(entry("a", base, &memory[..100]))],
            ),
        );
        assert_eq!(c.len(), 1);
        // A second reset: "a" stays while the snapshot arrives, and goes when the
        // snapshot ends without naming it.
        apply(&mut c, &segment, answer(true, 22, 20, vec![]));
        apply(
            &mut c,
            &segment,
            answer(
                false,
                0,
                21,
                vec![CatalogEvent::Commit(entry("b", base + 1024, &memory[..50]))],
            ),
        );
        assert_eq!(c.len(), 2);
        apply(
            &mut c,
            &segment,
            answer(false, 0, 22, vec![CatalogEvent::Free(base + 4000)]),
        );
        assert_eq!(c.len(), 1);
        // SAFETY: `memory` is alive and 4096 bytes long.
        let (reqs, stats) = unsafe { c.remount_requests(1, &segment, OwnerTicket::default()) };
        assert_eq!((stats.pieces, stats.bytes, stats.corrupt), (1, 50, 0));
        assert!(
            matches!(&reqs[..], [Request::Remount { last: true, entries, .. }] if entries[0].key == "b")
        );
    }

    #[test]
    fn pieces_whose_bytes_changed_are_not_announced() {
        let mut memory = vec![1u8; 256];
        let base = memory.as_ptr() as u64;
        let segment = SegmentInfo {
            name: "seg".into(),
            base,
            size: 256,
        };
        let mut c = NodeCatalog::default();
        apply(&mut c, &segment, answer(true, 1, 1, vec![]));
        apply(
            &mut c,
            &segment,
            answer(
                false,
                0,
                2,
                vec![CatalogEvent::Commit(entry("k", base, &memory[..128]))],
            ),
        );
        memory[3] ^= 0xFF;
        // SAFETY: `memory` is alive and 256 bytes long.
        let (reqs, stats) = unsafe { c.remount_requests(1, &segment, OwnerTicket::default()) };
        assert_eq!((stats.pieces, stats.corrupt), (0, 1));
        assert!(matches!(&reqs[..], [Request::Remount { entries, .. }] if entries.is_empty()));
    }
}
