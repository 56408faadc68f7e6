//! Draining a node before it leaves: nothing new is placed on its segment, and each
//! object whose only replica is there gets a new replica elsewhere, written by the
//! node itself from its memory (`Relocate`, the node's engine writes, `RelocateEnd`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::catalog::{lock, Commits};
use super::segments::{self, ReplicaAlloc, Segment};
use super::Master;
use crate::error::{Code, Error, Result};
use crate::store::protocol::{check_key, KeyResult, ReplicaDesc, ReplicateConfig};

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

impl Master {
    /// Marks segment `name` draining: no new replica is placed on it, and its node
    /// (told in its catalog polls) moves what only it holds elsewhere, then unmounts.
    /// `client`, when given, must own the segment (an admin request gives none).
    pub fn drain(&self, client: Option<u64>, name: &str) -> Result<()> {
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
        if !seg.draining.swap(true, Ordering::SeqCst) {
            log::info!("segment {name} draining");
            // The node learns it from its next catalog poll's answer.
            seg.log.wake();
        }
        Ok(())
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
        if lock(&self.catalogs.relocations).contains_key(&(client, key.to_owned())) {
            return Err(Code::ObjectAlreadyExists); // one relocation of a key at a time
        }
        let (version, size) = {
            let now = self.clock.now_ms();
            let ttl = self.config.lease_ttl.as_millis() as u64;
            let mut map = Self::lock(self.shard(key));
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
        if let Some(raced) =
            lock(&self.catalogs.relocations).insert((client, key.to_owned()), relocation)
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
        let relocation = lock(&self.catalogs.relocations)
            .remove(&(client, key.to_owned()))
            .ok_or(Code::ObjectNotFound)?;
        if !moved {
            relocation.into_limbo();
            return Ok(());
        }
        let mut map = Self::lock(self.shard(key));
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
