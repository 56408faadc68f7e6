//! A node's duties, for a store client that lends memory: mounting its segment (and
//! mounting it again on a master that lost it, with what it holds), following the
//! catalog the master keeps of it, pinging, and draining it when it leaves.

use crate::util::sync::Unpoisoned;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::{fragments, run_batch, scatter, MasterSession, Parts, SegmentIds};
use crate::error::{Code, Error, Result};
use crate::protocol::{shown_key, CatalogEntry, Request, Response, SegmentInfo};
use crate::transport::Op;

/// What a drain did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    /// Objects moved to other nodes.
    pub moved: u64,
    /// Objects that had a replica elsewhere already.
    pub safe_elsewhere: u64,
    /// Objects that found no place elsewhere, or failed to move.
    pub lost: u64,
}

impl MasterSession {
    /// Introduces this client to the master (only known clients may put): mounts its
    /// segment, or for a client lending no memory, pings.
    pub(crate) fn register(&self) -> Result<()> {
        match &self.segment {
            // A remount with an empty catalog is a mount; one with a disk tier that
            // survived a restart announces what it holds.
            Some(_) => self.remount(),
            None => self.rpc.call(&Request::Ping { client: self.id }).map(drop),
        }
    }

    /// Mounts this node's segment again on a master that lost it, handing over the
    /// catalog so the objects still in the segment are served again.
    pub(crate) fn remount(&self) -> Result<()> {
        let Some(seg) = &self.segment else {
            return Ok(());
        };
        let owner = *self.owner.locked();
        let (requests, announced) = {
            let mut catalog = self.catalog.locked();
            catalog.forget_master();
            // SAFETY: the segment is this client's own buffer, allocated at
            // construction and freed only after the pinger (this thread) is joined.
            unsafe { catalog.remount_requests(self.id, seg, owner) }
        };
        let started = Instant::now();
        for req in &requests {
            if let Response::Mounted(ticket) = self.rpc.call(req)? {
                *self.owner.locked() = ticket;
            }
        }
        let seconds = announced.seconds + started.elapsed().as_secs_f64();
        log::info!(
            "mounted {}: {} object pieces ({} bytes; {} known from commit notes) and {} disk-tier objects announced in {:.3} s ({:.1} MB/s), {} dropped as corrupt",
            seg.name,
            announced.pieces,
            announced.bytes,
            announced.noted,
            announced.on_disk,
            seconds,
            announced.bytes as f64 / seconds.max(1e-9) / 1e6,
            announced.corrupt
        );
        Ok(())
    }

    /// Follows the master's log of this node's segment (see `node::catalog`) until the
    /// client closes.
    pub(crate) fn catalog_loop(self: Arc<Self>) {
        while !self.stop.is_raised() && !self.drained.load(Ordering::SeqCst) {
            self.catalog_poll();
            let asked = self.catalog.locked().take_drain_request();
            if asked && self.draining.try_lock().is_ok() {
                // Draining waits on the master, which waits on this loop's
                // acknowledgements: it runs beside it.
                let s = self.clone();
                let spawned = std::thread::Builder::new()
                    .name("mc-store-drain".into())
                    .spawn(move || match s.drain() {
                        Ok(r) => log::info!("drained as the master asked: {r:?}"),
                        Err(e) => log::warn!("drain failed: {e}"),
                    });
                match spawned {
                    Ok(t) => *self.drain_thread.locked() = Some(t),
                    Err(e) => log::warn!("spawning the drain: {e}"),
                }
            }
        }
    }

    /// Moves every object only this node holds to other nodes (the master places
    /// them; this node writes its bytes there), then unmounts the segment for good.
    pub(crate) fn drain(&self) -> Result<DrainReport> {
        let Some(seg) = &self.segment else {
            return Err(Error::invalid(
                "this client lends no memory: nothing to drain",
            ));
        };
        let _one_at_a_time = self.draining.locked();
        if self.drained.load(Ordering::SeqCst) {
            return Ok(DrainReport::default()); // drained already
        }
        self.rpc.call(&Request::Drain {
            client: self.id,
            segment: seg.name.clone(),
        })?;
        let mut report = DrainReport::default();
        // Puts that were placed here before the drain began may end after it began:
        // look again until a pass finds nothing new (bounded).
        let mut done = std::collections::HashSet::new();
        for _pass in 0..8 {
            let movable: Vec<CatalogEntry> = self
                .catalog
                .locked()
                .movable(&seg.name)
                .into_iter()
                .filter(|e| done.insert(e.key.clone()))
                .collect();
            if movable.is_empty() {
                break;
            }
            self.relocate(seg, &movable, &mut report)?;
        }
        self.drained.store(true, Ordering::SeqCst);
        self.rpc.call(&Request::Unmount {
            client: self.id,
            name: seg.name.clone(),
        })?;
        Ok(report)
    }

    /// Moves `movable` (objects wholly in this node's segment `seg`) elsewhere.
    pub(crate) fn relocate(
        &self,
        seg: &SegmentInfo,
        movable: &[CatalogEntry],
        report: &mut DrainReport,
    ) -> Result<()> {
        for chunk in movable.chunks(64) {
            if self.stop.is_raised() {
                return Err(Error::new(
                    Code::UnavailableInCurrentStatus,
                    "drain interrupted: the client is closing",
                ));
            }
            let keys: Vec<String> = chunk.iter().map(|e| e.key.clone()).collect();
            let places = match self.rpc.call(&Request::Relocate {
                client: self.id,
                segment: seg.name.clone(),
                keys,
            })? {
                Response::PutStart(v) if v.len() == chunk.len() => v,
                other => {
                    return Err(Error::protocol(format!(
                        "unexpected Relocate answer {other:?}"
                    )))
                }
            };
            let mut reqs = Vec::new();
            let mut owner = Vec::new();
            let mut moving = Vec::new();
            let mut segments = SegmentIds::default();
            for (entry, place) in chunk.iter().zip(places) {
                let target = match place {
                    Ok(t) if t.is_empty() => {
                        report.safe_elsewhere += 1;
                        continue;
                    }
                    Ok(mut t) => t.remove(0),
                    Err(code) => {
                        log::warn!("drain: no place for {}: {code:?}", shown_key(&entry.key));
                        report.lost += 1;
                        continue;
                    }
                };
                let local: Parts = entry
                    .replica
                    .pieces
                    .iter()
                    .map(|p| (p.addr, p.len))
                    .collect();
                let frags = fragments(&local);
                let mut off = 0;
                let mut ok = true;
                for piece in &target.pieces {
                    let engine = &self.engine;
                    match scatter(
                        &mut segments,
                        engine,
                        Op::Write,
                        &frags,
                        off,
                        piece,
                        &mut reqs,
                    ) {
                        Ok(n) => owner.extend(std::iter::repeat_n(moving.len(), n)),
                        Err(_) => ok = false,
                    }
                    off += piece.len;
                }
                moving.push((entry.key.clone(), ok));
            }
            for (task, result) in run_batch(&self.engine, &reqs).into_iter().enumerate() {
                if result.is_err() {
                    moving[owner[task]].1 = false;
                }
            }
            if moving.is_empty() {
                continue;
            }
            let ended = self.rpc.call(&Request::RelocateEnd {
                client: self.id,
                segment: seg.name.clone(),
                items: moving.clone(),
            })?;
            let results = match ended {
                Response::PerKey(v) if v.len() == moving.len() => v,
                other => {
                    return Err(Error::protocol(format!(
                        "unexpected RelocateEnd answer {other:?}"
                    )))
                }
            };
            for ((key, moved), result) in moving.iter().zip(results) {
                if *moved && result.is_ok() {
                    report.moved += 1;
                } else {
                    log::warn!("drain: {} did not move", shown_key(key));
                    report.lost += 1;
                }
            }
        }
        Ok(())
    }

    /// One poll of the segment's log (see `catalog_loop`).
    pub(crate) fn catalog_poll(&self) {
        let Some(seg) = &self.segment else { return };
        let req = self.catalog.locked().poll_request(self.id, &seg.name);
        let answer = self.rpc.call(&req);
        let mut catalog = self.catalog.locked();
        match answer {
            // SAFETY: the segment is this client's own buffer, freed only after the
            // polling threads are joined.
            Ok(Response::SegmentEvents(ev)) => unsafe { catalog.apply(ev, seg) },
            Ok(other) => {
                drop(catalog);
                log::warn!("catalog poll: unexpected answer {other:?}");
                self.pause(Duration::from_secs(1));
            }
            Err(e) => {
                catalog.unsent(req);
                drop(catalog);
                // Master away or the segment not (yet) mounted: the pinger sorts that
                // out; keep the catalog and ask again shortly.
                log::debug!("catalog poll: {e}");
                self.pause(Duration::from_millis(200));
            }
        }
    }

    /// Waits `d`, or less when the client closes.
    pub(crate) fn pause(&self, d: Duration) {
        self.stop.wait(d);
    }

    /// Mounts this client's segments again on a master that lost them.
    pub(crate) fn remount_all(&self) {
        let main = self.segment.is_some() && !self.drained.load(Ordering::SeqCst);
        if !main && !self.mounts.any() {
            return;
        }
        log::warn!("master asks client {:#x} to remount", self.id);
        // A restarted master's embedded metadata server starts empty: without the
        // descriptor no peer could reach the segment.
        if let Err(e) = self.engine.restore_publication() {
            log::warn!("republishing the segment's descriptor failed: {e}");
        }
        if main {
            if let Err(e) = self.remount() {
                log::warn!("remount failed: {e}");
            }
        }
        self.remount_extras();
    }

    pub(crate) fn ping_loop(&self, interval: Duration) {
        while !self.stop.wait(interval) {
            self.reap_extras(false);
            match self.call_with_touches(&Request::Ping { client: self.id }) {
                Ok(Response::Ping { need_remount: true }) => self.remount_all(),
                Ok(_) => {}
                Err(e) => log::debug!("ping: {e}"),
            }
        }
    }
}
