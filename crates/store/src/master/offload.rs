//! Objects on nodes' disk tiers, as the master sees them: an object evicted from a
//! node that has a tier is copied there (`Offload`) instead of dropped, read back into
//! that node's memory when someone reads it (`Load`), promoted after enough reads, and
//! forgotten with the object (`Forget`). A remounting node announces what its disk
//! holds (`adopt_disk`).

use crate::util::sync::Unpoisoned;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::catalog::{Claim, Commits};
use super::replicas::Replicas;
use super::segment_log::Fallback;
use super::segments::{self, PieceAlloc, ReplicaAlloc, Segment};
use super::table::Shard;
use super::{policy, Master, Object};
use crate::error::Code;
use crate::protocol::{check_key, CatalogEvent, DiskEntry, KeyResult, ObjectDesc, ReplicaDesc};

/// How long a read-back waits at most for leases to free space in its node's memory.
const MAX_LEASE_WAIT: Duration = Duration::from_secs(1);
const LEASE_WAIT_STEP: Duration = Duration::from_millis(20);

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

/// A copy read back from a disk tier for one reader (see `release_staged`).
pub struct StagedCopy {
    /// When it is freed if its reader never says it is done (its lease's end).
    pub until_ms: u64,
    /// The version to promote it as, once read, when its read crossed the threshold.
    promote: Option<u64>,
    space: ReplicaAlloc,
}

/// The object a disk tier's copy becomes when memory holds none.
fn disk_only(d: &DiskEntry, seg: &Arc<Segment>) -> Object {
    Object {
        size: d.size,
        crc32c: d.crc32c,
        complete: true,
        pending: None,
        replicas: Replicas::default(),
        lease_until_ms: 0,
        node: policy::NONE,
        hard_pin: false,
        soft_pin_until_ms: 0,
        groups: Box::default(),
        version: d.version,
        disk: Some(DiskCopy::new(seg, &d.key, d.version)),
    }
}

impl Master {
    /// Adopts an object the node's disk tier holds, as `judge_claim` rules: a new
    /// object kept only there, or the disk copy of the object held. False when refused.
    pub(super) fn adopt_disk(&self, d: &DiskEntry, seg: &Arc<Segment>, now: u64) -> bool {
        if check_key(&d.key).is_err()
            || d.size == 0
            || d.size > seg.alloc.capacity()
            || !self.catalogs.may_claim(d.version)
        {
            return false;
        }
        let mut guard = self.shard(&d.key).locked();
        let shard = &mut *guard;
        match self.judge_claim(shard.get(&d.key), (d.version, d.size, d.crc32c)) {
            Claim::New => {
                shard.objects.insert(&d.key, disk_only(d, seg));
                self.objects.fetch_add(1, Ordering::Relaxed);
                true
            }
            Claim::Same => {
                if let Some(o) = shard.get_mut(&d.key).filter(|o| o.disk.is_none()) {
                    o.disk = Some(DiskCopy::new(seg, &d.key, d.version));
                }
                true
            }
            Claim::Refused => false,
            Claim::Contested => {
                self.drop_contested(shard, &d.key, now);
                false
            }
        }
    }

    /// Keeps an object just evicted from memory on a disk tier (see `DiskCopy`): one
    /// already there loses only its memory; otherwise, with offload on, a node that
    /// has a tier copies one replica there (its space, and that of the others, is
    /// held until then: see `Fallback`). Without either, the object goes.
    pub(super) fn keep_on_disk(&self, shard: &mut Shard, key: &str, mut o: Object) {
        if !o.complete {
            return;
        }
        if o.disk.is_none() {
            if !self.config.offload_on_evict {
                return;
            }
            let size = o.size;
            // A striped replica qualifies when all its pieces are on that one segment:
            // its node gathers them.
            let fits = |r: &[PieceAlloc]| {
                r.iter().all(|p| Arc::ptr_eq(&p.seg, &r[0].seg))
                    && r[0].seg.disk_capacity.load(Ordering::Relaxed) >= size
            };
            let Some(replica) = o.replicas.take_where(fits) else {
                log::debug!(
                    "{} leaves memory with no disk tier to keep it",
                    crate::protocol::shown_key(key)
                );
                return;
            };
            let seg = replica[0].seg.clone();
            let addr = replica[0].piece().addr;
            // The other replicas stay allocated until the copy is on disk.
            let fallback = (!o.replicas.is_empty()).then(|| Fallback {
                key: key.into(),
                version: o.version,
                replicas: o.replicas.take_list(),
            });
            let offload = CatalogEvent::Offload(addr);
            if seg.log.record_holding(offload, replica, fallback).is_err() {
                return; // no node follows the log: nobody to copy it
            }
            o.disk = Some(DiskCopy::new(&seg, key, o.version));
        }
        o.replicas.clear();
        o.node = policy::NONE;
        o.groups = Box::default();
        o.soft_pin_until_ms = 0;
        shard.objects.insert(key, o);
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
        let started_ms = self.clock.now_ms();
        // Eviction frees the pool's lowest objects wherever they are: `allocate_evicting`
        // asks for more each round until some of it is in this node's segment. When
        // leases hold all of it (a reader just described or read every object), wait
        // a little for them to end rather than fail the read.
        let patience = Instant::now() + self.config.lease_ttl.min(MAX_LEASE_WAIT);
        let space = loop {
            let placed = self.allocate_evicting(size, || {
                segments::allocate(std::slice::from_ref(seg), size, 1)
            });
            if let Some(space) = placed.into_iter().next() {
                break space;
            }
            if Instant::now() >= patience {
                return Err(Code::NoAvailableHandle);
            }
            std::thread::sleep(LEASE_WAIT_STEP);
        };
        let pieces: Vec<(u64, u64)> = space
            .iter()
            .map(|p| (p.piece().addr, p.alloc.size))
            .collect();
        let first_addr = pieces[0].0;
        // A node that just remounted follows its log again within one poll: until
        // then nothing can ask it to read, so wait for it as for a lease above.
        let seq = loop {
            let load = || CatalogEvent::Load {
                key: key.to_owned(),
                version,
                pieces: pieces.clone(),
            };
            if let Some(seq) = seg.log.record(load) {
                break seq;
            }
            if Instant::now() >= patience {
                return Err(Code::ReplicaIsNotReady);
            }
            std::thread::sleep(LEASE_WAIT_STEP);
        };
        let timeout = self.config.catalog_ack_timeout.max(Duration::from_secs(1));
        if !seg.log.wait_acked(seq, timeout) {
            // The node may still write the value there later: not reusable for a while.
            seg.log.hold_in_limbo(space);
            return Err(Code::ReplicaIsNotReady);
        }
        let now = self.clock.now_ms();
        let ttl = self.config.lease_ttl.as_millis() as u64;
        let mut map = self.shard(key).locked();
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
        // No lease on the object: the reader reads the staged copy, which is held for
        // it here until it says it is done or the lease would end. A lease would pin
        // the promoted copy for nobody and starve the next disk-tier reads.
        let desc = ObjectDesc {
            size: o.size,
            crc32c: o.crc32c,
            // The reader counts its lease from when it asked: add the time spent
            // here (finding room, the node's disk read) to what it is held for.
            lease_ms: ttl + now.saturating_sub(started_ms),
            replicas: vec![ReplicaDesc {
                pieces: space.iter().map(PieceAlloc::piece).collect(),
            }]
            .into(),
        };
        drop(map);
        let copy = StagedCopy {
            until_ms: now + ttl,
            promote: (reads >= self.config.promotion_admission_threshold).then_some(version),
            space,
        };
        self.staged
            .locked()
            .insert((key.to_owned(), first_addr), copy);
        Ok(desc)
    }

    /// Ends reads of copies staged from disk (by key and first piece's address): each
    /// is freed at once, so disk-tier reads never wait on one another's leases, or
    /// becomes the object's memory replica if its read crossed the promotion
    /// threshold. Ids of nothing staged (released or expired already) change nothing.
    pub(super) fn release_staged(&self, items: Vec<(String, u64)>) {
        for id in items {
            let Some(copy) = self.staged.locked().remove(&id) else {
                continue;
            };
            if let Some(version) = copy.promote {
                self.promote(&id.0, version, copy.space);
            }
        }
    }

    /// Makes `space`, holding `key`'s value (of `version`) read back from its disk
    /// tier, the object's memory replica, unless the object changed meanwhile.
    fn promote(&self, key: &str, version: u64, space: ReplicaAlloc) {
        let seg = space[0].seg.clone();
        let mut map = self.shard(key).locked();
        let Some(o) = map.get_mut(key).filter(|o| {
            o.complete
                && o.version == version
                && o.replicas.is_empty()
                && o.disk.as_ref().is_some_and(|d| Arc::ptr_eq(&d.seg, &seg))
        }) else {
            return; // dropping `space` frees it
        };
        o.replicas.push(space);
        Commits::default().record(key, o);
        // Into the eviction order, as a read of it.
        self.touch(&mut map, key);
        drop(map);
        // Nobody waits for this commit: the node should still have it at once.
        seg.log.deliver();
    }

    /// Where `key` is, without reading anything back: its memory replicas (leased, as
    /// a lookup does; none for an object only on disk) and the segment whose node's
    /// disk tier holds a copy ("" for none).
    pub(super) fn describe(&self, key: &str) -> (KeyResult<ObjectDesc>, String) {
        let found = self.lookup(key, false);
        let map = self.shard(key).locked();
        let Some(o) = map.get(key).filter(|o| o.complete) else {
            return (found, String::new());
        };
        let disk = o
            .disk
            .as_ref()
            .map_or(String::new(), |d| d.seg.info.name.clone());
        match found {
            Err(Code::ReplicaIsNotReady) if o.disk.is_some() => {
                let on_disk = ObjectDesc {
                    size: o.size,
                    crc32c: o.crc32c,
                    lease_ms: 0,
                    replicas: Default::default(),
                };
                (Ok(on_disk), disk)
            }
            other => (other, disk),
        }
    }

    /// A node's disk tier lost `key`'s copy: the object goes with it unless it is
    /// also in memory.
    pub(super) fn lose_disk_copy(&self, key: &str, seg: &Arc<Segment>) {
        if check_key(key).is_err() {
            return;
        }
        let mut map = self.shard(key).locked();
        let Some(o) = map.get_mut(key) else { return };
        if !o.disk.as_ref().is_some_and(|d| Arc::ptr_eq(&d.seg, seg)) {
            return;
        }
        let restored = self.fall_back(key, o);
        o.disk = None;
        if o.replicas.is_empty() {
            map.remove(key);
            self.objects.fetch_sub(1, Ordering::Relaxed);
        } else if restored {
            self.touch(&mut map, key);
        }
    }

    /// Gives `o`, kept only as a disk copy its node never confirmed (the node died or
    /// was reset first: its segment is dropping, or it reports the copy missing), back
    /// the memory replicas it had when it was offloaded, those still on mounted
    /// segments (see `Fallback`). True when it did: the caller puts the object back in
    /// the eviction order (`touch`), which a disk-only object is not in.
    pub(super) fn fall_back(&self, key: &str, o: &mut Object) -> bool {
        let Some(disk) = o.disk.as_ref().filter(|_| o.replicas.is_empty()) else {
            return false;
        };
        let Some(mut replicas) = disk.seg.log.take_fallback(key, o.version) else {
            return false;
        };
        replicas.retain(|r| r.iter().all(|p| self.segments.holds(&p.seg)));
        if replicas.is_empty() {
            return false;
        }
        log::info!(
            "{}: its disk copy was never confirmed; it keeps its memory replicas",
            crate::protocol::shown_key(key)
        );
        o.replicas = Replicas::from(replicas);
        // Their nodes' catalogs may have dropped them meanwhile (a snapshot).
        Commits::default().record(key, o);
        true
    }
}
