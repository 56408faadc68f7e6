//! Draining a node before it leaves: nothing new is placed on its segment, and each
//! object whose only replica is there gets a new replica elsewhere, written by the
//! node itself from its memory (`Relocate`, the node's engine writes, `RelocateEnd`).

use crate::util::sync::Unpoisoned;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::catalog::Commits;
use super::segments::{self, ReplicaAlloc, Segment};
use super::Master;
use crate::error::{Code, Error, Result};
use crate::protocol::{check_key, KeyResult, ReplicaDesc, ReplicateConfig};

/// A replica placed for an object leaving a draining segment.
pub(super) struct Relocation {
    version: u64,
    replica: ReplicaAlloc,
    pub(super) started_ms: u64,
}

impl Relocation {
    /// Lets the space go once its node can no longer be writing there.
    pub(super) fn into_limbo(self) {
        if let Some(seg) = self.replica.first().map(|p| p.seg.clone()) {
            seg.log.hold_in_limbo(self.replica);
        }
    }
}

/// What draining a segment would put at risk: objects with no copy outside its node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DrainRisk {
    /// Objects whose every memory replica touches the segment and that have no disk
    /// copy on another node: each needs a new replica elsewhere.
    pub to_move: u64,
    /// Their bytes.
    pub to_move_bytes: u64,
    /// Objects held only by the segment's own disk tier: a drain moves memory, so
    /// these leave with the node.
    pub disk_only: u64,
    /// Their bytes.
    pub disk_only_bytes: u64,
    /// Free bytes on the other segments that take new replicas.
    pub room_elsewhere: u64,
}

impl DrainRisk {
    /// Objects and bytes a drain may lose: those on the disk tier alone, and all those
    /// to move when the other segments lack room for them.
    pub fn at_risk(&self) -> (u64, u64) {
        let (mut objects, mut bytes) = (self.disk_only, self.disk_only_bytes);
        if self.to_move_bytes > self.room_elsewhere {
            objects += self.to_move;
            bytes += self.to_move_bytes;
        }
        (objects, bytes)
    }

    /// Why the objects at risk have nowhere to go, in words.
    fn reasons(&self) -> String {
        let mut why = Vec::new();
        if self.to_move_bytes > self.room_elsewhere {
            why.push(format!(
                "{} objects ({} bytes) have no copy on another node and the other segments have room for {} bytes",
                self.to_move, self.to_move_bytes, self.room_elsewhere
            ));
        }
        if self.disk_only > 0 {
            why.push(format!(
                "{} objects ({} bytes) are only on its node's disk tier, which a drain does not move",
                self.disk_only, self.disk_only_bytes
            ));
        }
        why.join("; ")
    }
}

impl Master {
    /// Marks segment `name` draining: no new replica is placed on it, and its node
    /// (told in its catalog polls) moves what only it holds elsewhere, then unmounts.
    /// `client`, when given, must own the segment (an admin request gives none).
    /// Unless `force`, a drain that would lose objects (see [`DrainRisk::at_risk`]) is
    /// refused and changes nothing; the answer is what the drain puts at risk.
    pub fn drain(&self, client: Option<u64>, name: &str, force: bool) -> Result<DrainRisk> {
        let seg = self
            .segments
            .get(name)
            .ok_or_else(|| Error::new(Code::SegmentNotFound, format!("segment {name}")))?;
        if client.is_some_and(|c| c != seg.client) {
            return Err(Error::new(
                Code::IllegalClient,
                format!("segment {name} belongs to another client"),
            ));
        }
        let risk = self.drain_risk(&seg);
        let (objects, bytes) = risk.at_risk();
        if objects > 0 && !force {
            return Err(Error::new(
                Code::NoAvailableHandle,
                format!(
                    "drain of segment {name} refused: it would lose {objects} objects ({bytes} bytes): {}; drain with force to lose them",
                    risk.reasons()
                ),
            ));
        }
        if !seg.draining.swap(true, Ordering::SeqCst) {
            if objects > 0 {
                log::warn!("segment {name} draining by force; {objects} objects ({bytes} bytes) at risk: {}", risk.reasons());
            } else {
                log::info!("segment {name} draining");
            }
            // The node learns it from its next catalog poll's answer.
            seg.log.wake();
        }
        // The node moves what its catalog lists: commits acknowledged to writers
        // without waiting (their notes cover them) must be in it first.
        let timeout = self.config.catalog_ack_timeout;
        if let (Some(head), false) = (seg.log.head(), timeout.is_zero()) {
            seg.log.wait_acked(head, timeout);
        }
        Ok(risk)
    }

    /// What draining `seg` would put at risk now.
    fn drain_risk(&self, seg: &Arc<Segment>) -> DrainRisk {
        let mut risk = DrainRisk {
            room_elsewhere: self
                .segments
                .snapshot()
                .iter()
                .filter(|s| !Arc::ptr_eq(s, seg) && !s.draining.load(Ordering::SeqCst))
                .map(|s| segments::usable(&s.alloc).saturating_sub(s.alloc.used_bytes()))
                .sum(),
            ..DrainRisk::default()
        };
        let on_seg = |r: &[super::segments::PieceAlloc]| r.iter().any(|p| Arc::ptr_eq(&p.seg, seg));
        for shard in self.shards.iter() {
            let map = shard.locked();
            for (_, o) in map.objects.iter() {
                let disk_elsewhere = o.disk.as_ref().is_some_and(|d| !Arc::ptr_eq(&d.seg, seg));
                if !o.complete || disk_elsewhere || !o.replicas.iter().all(on_seg) {
                    continue;
                }
                if o.replicas.is_empty() {
                    risk.disk_only += 1;
                    risk.disk_only_bytes += o.size;
                } else {
                    risk.to_move += 1;
                    risk.to_move_bytes += o.size;
                }
            }
        }
        risk
    }

    /// The draining segment `name` of `client`.
    fn draining(&self, client: u64, name: &str) -> KeyResult<Arc<Segment>> {
        self.segments
            .get(name)
            .filter(|s| s.client == client && s.draining.load(Ordering::SeqCst))
            .ok_or(Code::SegmentNotFound)
    }

    /// A place elsewhere for `key`'s bytes, if its only replicas touch `segment`.
    pub(super) fn relocate(
        &self,
        client: u64,
        segment: &str,
        key: &str,
    ) -> KeyResult<Vec<ReplicaDesc>> {
        check_key(key)?;
        let seg = self.draining(client, segment)?;
        if self
            .catalogs
            .relocations
            .locked()
            .contains_key(&(client, key.to_owned()))
        {
            return Err(Code::ObjectAlreadyExists); // one relocation of a key at a time
        }
        let (version, size) = {
            let now = self.clock.now_ms();
            let ttl = self.config.lease_ttl.as_millis() as u64;
            let mut map = self.shard(key).locked();
            let o = map.get_mut(key).ok_or(Code::ObjectNotFound)?;
            if !o.complete {
                return Err(Code::ReplicaIsNotReady);
            }
            // Leased, as for a reader: the node reads the source while it copies.
            o.lease_until_ms = o.lease_until_ms.max(now + ttl);
            let elsewhere = o
                .replicas
                .iter()
                .any(|r| r.iter().all(|p| !Arc::ptr_eq(&p.seg, &seg)));
            if elsewhere {
                return Ok(Vec::new());
            }
            (o.version, o.size)
        };
        let config = ReplicateConfig::default();
        let mut placed = self.allocate(client, size, &config);
        let replica = placed.pop().ok_or(Code::NoAvailableHandle)?;
        let desc = segments::describe(std::slice::from_ref(&replica));
        let relocation = Relocation {
            version,
            replica,
            started_ms: self.clock.now_ms(),
        };
        if let Some(raced) = self
            .catalogs
            .relocations
            .locked()
            .insert((client, key.to_owned()), relocation)
        {
            raced.into_limbo();
        }
        Ok(desc)
    }

    /// Ends one relocation: when the bytes `moved`, the new replica replaces those on
    /// the draining segment (the object unchanged meanwhile); else its space goes.
    pub(super) fn relocate_end(
        &self,
        client: u64,
        segment: &str,
        key: &str,
        moved: bool,
        committed: &mut Commits,
    ) -> KeyResult<()> {
        check_key(key)?;
        let seg = self.draining(client, segment)?;
        let relocation = self
            .catalogs
            .relocations
            .locked()
            .remove(&(client, key.to_owned()))
            .ok_or(Code::ObjectNotFound)?;
        if !moved {
            relocation.into_limbo();
            return Ok(());
        }
        let mut map = self.shard(key).locked();
        // The copy is good only if its source, the replica on the draining segment,
        // stayed in place the whole time (the lease keeps eviction off it).
        let Some(o) = map.get_mut(key).filter(|o| {
            o.complete
                && o.version == relocation.version
                && o.replicas
                    .iter()
                    .any(|r| r.iter().all(|p| Arc::ptr_eq(&p.seg, &seg)))
        }) else {
            return Err(Code::ObjectNotFound);
        };
        o.replicas.push(relocation.replica);
        // Readers within their lease may still read the old replica: its node stays
        // up until it unmounts, after this.
        o.replicas
            .retain(|r| r.iter().all(|p| !Arc::ptr_eq(&p.seg, &seg)));
        committed.record(key, o);
        Ok(())
    }
}
