//! Copies and moves of one object onto named segments (the client's copy and move
//! tasks): `CopyStart` places a replica on each target and leases the object, the
//! client moves the bytes with its engine, and `CopyEnd` adds the new replicas (for a
//! move, taking the source segment's away).

use crate::util::sync::Unpoisoned;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::catalog::{forget_pieces, Commits};
use super::replicas::Replicas;
use super::segments::{self, ReplicaAlloc};
use super::Master;
use crate::error::{Code, Error, Result};
use crate::protocol::{check_key, shown_key, CopyPlan, ReplicaDesc};

/// How long a copy may go unended before its space is given up (its client is gone, or
/// its task waited that long behind others).
const COPY_PATIENCE_MS: u64 = 10 * 60 * 1000;

/// A copy between `CopyStart` and `CopyEnd`.
struct PendingCopy {
    client: u64,
    key: String,
    /// The object's version when the copy started: a later put makes the copy stale.
    version: u64,
    /// The replica the client reads; the copy is good only if it is still the object's.
    source: ReplicaDesc,
    /// A move's source segment: its replicas go once the copy is in.
    moved_from: Option<String>,
    /// Per target segment name, the replica placed there.
    placed: Vec<(String, ReplicaAlloc)>,
    started_ms: u64,
}

impl PendingCopy {
    /// Lets the space go once its client can no longer be writing there.
    fn into_limbo(self) {
        for (_, replica) in self.placed {
            if let Some(seg) = replica.first().map(|p| p.seg.clone()) {
                seg.log.hold_in_limbo(replica);
            }
        }
    }
}

/// The copies in progress, by ticket.
#[derive(Default)]
pub(super) struct Copies {
    pending: Mutex<HashMap<u64, PendingCopy>>,
    last_ticket: AtomicU64,
}

impl Copies {
    fn insert(&self, copy: PendingCopy) -> u64 {
        let ticket = self.last_ticket.fetch_add(1, Ordering::Relaxed) + 1;
        self.pending.locked().insert(ticket, copy);
        ticket
    }

    /// Takes out `client`'s copy `ticket`.
    fn take(&self, client: u64, ticket: u64) -> Option<PendingCopy> {
        let mut pending = self.pending.locked();
        match pending.get(&ticket) {
            Some(c) if c.client == client => pending.remove(&ticket),
            _ => None,
        }
    }

    /// Gives up copies that waited too long for their end.
    pub(super) fn expire(&self, now_ms: u64) {
        let expired: Vec<PendingCopy> = {
            let mut pending = self.pending.locked();
            let old: Vec<u64> = pending
                .iter()
                .filter(|(_, c)| now_ms.saturating_sub(c.started_ms) >= COPY_PATIENCE_MS)
                .map(|(t, _)| *t)
                .collect();
            old.iter().filter_map(|t| pending.remove(t)).collect()
        };
        for copy in expired {
            log::warn!(
                "copy of {} by client {:#x} never ended; its space is given up",
                shown_key(&copy.key),
                copy.client
            );
            copy.into_limbo();
        }
    }
}

/// Whether every piece of `r` lies on segments named `name`.
fn wholly_on(r: &ReplicaDesc, name: &str) -> bool {
    r.pieces.iter().all(|p| *p.segment == *name)
}

impl Master {
    /// Starts copying `key` onto `targets` (with a `source`, moving it from there): see
    /// `Request::CopyStart`. Fails, placing nothing, on a bad argument (no target, a
    /// target named twice or unmounted, a move without one target or from a segment
    /// holding no replica), a missing object, or no room on a target.
    pub(super) fn copy_start(
        &self,
        client: u64,
        key: &str,
        source: &str,
        targets: &[String],
    ) -> Result<CopyPlan> {
        check_key(key).map_err(|c| Error::new(c, "copy: bad key"))?;
        let what = || format!("copy of {}", shown_key(key));
        let invalid = |why: &str| Err(Error::invalid(format!("{}: {why}", what())));
        if !self.is_known(client) {
            return Err(Error::new(Code::ClientNotFound, what()));
        }
        let moving = !source.is_empty();
        if targets.is_empty() {
            return invalid("no target segment");
        }
        if moving && targets.len() != 1 {
            return invalid("a move has one target");
        }
        for (i, t) in targets.iter().enumerate() {
            if t == source {
                return invalid("source and target are the same segment");
            }
            if targets[..i].contains(t) {
                return invalid(&format!("target {t} named twice"));
            }
            let segs = self.segments.named(t);
            if segs.is_empty() {
                return invalid(&format!("target segment {t} is not mounted"));
            }
            if segs.iter().all(|s| s.draining.load(Ordering::Relaxed)) {
                return Err(Error::new(
                    Code::UnavailableInCurrentStatus,
                    format!("{}: target segment {t} takes no new objects", what()),
                ));
            }
        }
        let now = self.clock.now_ms();
        let ttl = self.config.lease_ttl.as_millis() as u64;
        let (version, size, crc32c, read, todo) = {
            let mut map = self.shard(key).locked();
            let o = map
                .get_mut(key)
                .ok_or_else(|| Error::new(Code::ObjectNotFound, what()))?;
            if !o.complete {
                return Err(Error::new(Code::ReplicaIsNotReady, what()));
            }
            let descs: Vec<ReplicaDesc> = o.replicas.describe();
            let read = match moving {
                true => descs
                    .iter()
                    .find(|r| r.pieces.iter().any(|p| *p.segment == *source)),
                false => descs.first(),
            };
            let read = match (read, moving) {
                (Some(r), _) => r.clone(),
                (None, true) => return invalid(&format!("no replica on segment {source}")),
                // Kept only in a disk tier: nothing in memory to copy from.
                (None, false) => return Err(Error::new(Code::ReplicaIsNotReady, what())),
            };
            // Leased, as for a reader: the client reads the source while it copies.
            o.lease_until_ms = o.lease_until_ms.max(now + ttl);
            let todo: Vec<String> = targets
                .iter()
                .filter(|t| !descs.iter().any(|r| wholly_on(r, t)))
                .cloned()
                .collect();
            (o.version, o.size, o.crc32c, read, todo)
        };
        let mut placed = Vec::with_capacity(todo.len());
        for target in todo {
            match self.allocate_on(&target, size) {
                Some(replica) => placed.push((target, replica)),
                // Dropping what was placed gives its space back.
                None => {
                    return Err(Error::new(
                        Code::NoAvailableHandle,
                        format!("{}: no room on {target}", what()),
                    ))
                }
            }
        }
        let targets = placed
            .iter()
            .flat_map(|(_, r)| segments::describe(std::slice::from_ref(r)))
            .collect();
        let ticket = self.copies.insert(PendingCopy {
            client,
            key: key.to_owned(),
            version,
            source: read.clone(),
            moved_from: moving.then(|| source.to_owned()),
            placed,
            started_ms: now,
        });
        Ok(CopyPlan {
            ticket,
            size,
            crc32c,
            source: read,
            targets,
        })
    }

    /// One replica of `size` bytes on the segments named `target`, evicting there (and
    /// elsewhere) when they are full.
    fn allocate_on(&self, target: &str, size: u64) -> Option<ReplicaAlloc> {
        self.allocate_evicting(size, || {
            let open: Vec<_> = self
                .segments
                .named(target)
                .into_iter()
                .filter(|s| !s.draining.load(Ordering::Relaxed))
                .collect();
            segments::allocate(&open, size, 1)
        })
        .pop()
    }

    /// Ends `client`'s copy `ticket`: when `done`, its replicas join the object (a
    /// target that meanwhile got one keeps that one) and a move's source replicas go,
    /// provided the object is the one copied and still has the replica read; else, or
    /// when not `done`, the placed space is freed.
    pub(super) fn copy_end(&self, client: u64, ticket: u64, done: bool) -> Result<()> {
        let copy = self
            .copies
            .take(client, ticket)
            .ok_or_else(|| Error::invalid(format!("no copy {ticket} of this client")))?;
        if !done {
            // The client ends a copy once its transfers are over: nothing writes there.
            return Ok(());
        }
        let key = copy.key;
        let now = self.clock.now_ms();
        let mut committed = Commits::default();
        {
            let mut map = self.shard(&key).locked();
            let current = map.get_mut(&key).filter(|o| {
                o.complete
                    && o.version == copy.version
                    && o.replicas.describe::<Vec<_>>().contains(&copy.source)
            });
            let Some(o) = current else {
                return Err(Error::new(
                    Code::ObjectNotFound,
                    format!("{} changed or went while being copied", shown_key(&key)),
                ));
            };
            for (target, replica) in copy.placed {
                if !o
                    .replicas
                    .describe::<Vec<_>>()
                    .iter()
                    .any(|r| wholly_on(r, &target))
                {
                    o.replicas.push(replica);
                }
            }
            if let Some(source) = &copy.moved_from {
                let mut gone = Vec::new();
                while o.replicas.len() > 1 {
                    let on_source =
                        |r: &[segments::PieceAlloc]| r.iter().any(|p| p.seg.info.name == *source);
                    match o.replicas.take_where(on_source) {
                        Some(r) => gone.push(r),
                        None => break,
                    }
                }
                let gone = Replicas::from(gone);
                // Gone for the nodes' catalogs now; readers within their lease may
                // still read the space, which waits for them.
                forget_pieces(&gone);
                self.quarantine_replicas(gone, o.lease_until_ms.max(now));
            }
            committed.record(&key, o);
        }
        self.await_catalogs(committed);
        Ok(())
    }
}
