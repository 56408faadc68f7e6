//! Views and how they change: announcements, the coordinator's round, adoption, join.
//!
//! A change of epoch `e` runs like this. Whoever starts it (a rank whose operation
//! failed, or one with a proposal) writes an announcement to every member, so members
//! blocked in an operation stop waiting and members between operations take part at
//! their next call. Each participant sends a sync report (its suspects and proposals)
//! to the lowest member it does not suspect, the coordinator. The coordinator waits
//! until every member nobody suspects has reported (or the timeout), then publishes
//! view `e + 1`: the members that reported, minus ranks asked to be removed, plus
//! ranks asked to be added that have claimed their rank with a join record. A
//! participant that gets no view in time, or learns that someone suspects its
//! coordinator, moves on to the next lowest member, down to itself.

use std::time::{Duration, Instant};

use super::channel::{backoff, Channel, State};
use super::layout::{
    decode_join, decode_proposal, decode_view, encode_join, encode_proposal, encode_view,
    JoinRecord, Layout, Mask, Proposal, RecordKind, View,
};
use super::{Group, ProposalResponse, ProposalStatus, SyncStatus};
use crate::error::{Code, Error, Result};

impl Group {
    /// Tells every member but the suspects that a change of our epoch starts.
    pub(super) fn announce(&self, st: &mut State, suspects: Mask, add: Mask, remove: Mask) {
        let me = self.rank();
        let targets: Vec<usize> = st
            .mask
            .minus(&suspects)
            .ranks()
            .into_iter()
            .filter(|&r| r != me)
            .collect();
        let rec = encode_proposal(
            RecordKind::Announce,
            &Proposal {
                base: st.epoch,
                suspects,
                add,
                remove,
            },
        );
        let timeout = self.options.timeout;
        self.write_records(st, &targets, |l: &Layout, s| l.announce(s), &rec, timeout);
    }

    /// The suspects of a change of our epoch someone announced, or an empty set when a
    /// newer view is already out; `None` when nothing is pending.
    pub(super) fn change_announced(&self, st: &State) -> Option<Mask> {
        if self.newest_view(st).is_some() {
            return Some(Mask::default());
        }
        let me = self.rank();
        let mut found: Option<Mask> = None;
        for src in st.mask.ranks().into_iter().filter(|&r| r != me) {
            let slot = self.read_slot(self.layout.announce(src));
            if let Some(p) = decode_proposal(&slot, RecordKind::Announce) {
                if p.base == st.epoch {
                    found = Some(found.unwrap_or_default().union(&p.suspects));
                }
            }
        }
        found
    }

    /// The newest view in our slots, if newer than ours.
    fn newest_view(&self, st: &State) -> Option<View> {
        (0..self.size())
            .filter_map(|src| decode_view(&self.read_slot(self.layout.view(src))))
            .filter(|v| v.epoch > st.epoch)
            .max_by_key(|v| v.epoch)
    }

    /// A join record for rank `r` newer than what we reach `r` through.
    pub(super) fn fresh_join(&self, st: &State, r: usize) -> Option<JoinRecord> {
        let j = decode_join(&self.read_slot(self.layout.join(r)))?;
        let known = st
            .peers
            .get(r)
            .copied()
            .flatten()
            .map_or(0, |p| p.incarnation);
        (j.incarnation != known).then_some(j)
    }

    /// Everything an operation does first: catch up with a view published without us,
    /// refuse if we are not a member, and take part in a pending change.
    pub(super) fn begin_op(&self, st: &mut State) -> Result<()> {
        if let Some(v) = self.newest_view(st) {
            self.adopt(st, &v);
        }
        if !st.mask.has(self.rank()) {
            return Err(Error::new(
                Code::UnavailableInCurrentStatus,
                format!(
                    "rank {} is not active at epoch {}: join_group first",
                    self.rank(),
                    st.epoch
                ),
            ));
        }
        let announced = self.change_announced(st);
        if announced.is_some() || (st.needs_sync && self.options.auto_sync_on_failure) {
            let suspects = self.own_suspects(st);
            self.view_change(st, suspects, Mask::default(), Mask::default())?;
            if !st.mask.has(self.rank()) {
                return Err(Error::new(
                    Code::UnavailableInCurrentStatus,
                    format!("rank {} was left out of epoch {}", self.rank(), st.epoch),
                ));
            }
        }
        Ok(())
    }

    fn own_suspects(&self, st: &State) -> Mask {
        if st.needs_sync && self.options.auto_deactivate_on_failure {
            Mask::of(&st.last_failed)
        } else {
            Mask::default()
        }
    }

    /// Runs a change of the current epoch (see the module comment) and adopts its view.
    pub(super) fn view_change(
        &self,
        st: &mut State,
        suspects: Mask,
        add: Mask,
        remove: Mask,
    ) -> Result<View> {
        let me = self.rank();
        let base = st.epoch;
        log::debug!(
            "group rank {me}: change of epoch {base}: suspects {:?} add {:?} remove {:?}",
            suspects.ranks(),
            add.ranks(),
            remove.ranks()
        );
        self.announce(st, suspects, add, remove);
        let mut prop = Proposal {
            base,
            suspects,
            add,
            remove,
        };
        let mut candidates = st.mask.minus(&suspects).minus(&remove);
        candidates.set(me);
        loop {
            let Some(&c) = candidates.ranks().first() else {
                return Err(Error::invalid("no coordinator candidate"));
            };
            if c == me {
                return Ok(self.coordinate(st, prop));
            }
            let rec = encode_proposal(RecordKind::Sync, &prop);
            let timeout = self.options.timeout;
            let unreached = self.write_records(st, &[c], |l: &Layout, s| l.sync(s), &rec, timeout);
            if unreached.is_empty() {
                // The coordinator may wait a whole timeout for slow members first.
                let deadline = Instant::now() + 2 * self.options.timeout;
                let mut idle = 0;
                while Instant::now() < deadline {
                    if let Some(v) = self.newest_view(st) {
                        self.adopt(st, &v);
                        return Ok(v);
                    }
                    if idle % 64 == 63 && self.suspected_by_others(st, c) {
                        break;
                    }
                    idle += 1;
                    backoff(idle);
                }
            }
            log::warn!("group rank {me}: coordinator {c} of epoch {base} did not answer");
            candidates.clear(c);
            prop.suspects.set(c);
        }
    }

    /// Whether another member's announcement of our epoch suspects `r`.
    fn suspected_by_others(&self, st: &State, r: usize) -> bool {
        st.mask.ranks().into_iter().any(|src| {
            decode_proposal(
                &self.read_slot(self.layout.announce(src)),
                RecordKind::Announce,
            )
            .is_some_and(|p| p.base == st.epoch && p.suspects.has(r))
        })
    }

    /// The coordinator's round: collect reports, decide, publish, adopt.
    fn coordinate(&self, st: &mut State, mine: Proposal) -> View {
        let me = self.rank();
        let base = st.epoch;
        let old = st.mask;
        let deadline = Instant::now() + self.options.timeout;
        let mut merged = mine;
        let mut reported = Mask::of(&[me]);
        let mut idle = 0;
        loop {
            for src in old.ranks().into_iter().filter(|&r| r != me) {
                let merge = |m: &mut Proposal, p: Proposal| {
                    m.suspects = m.suspects.union(&p.suspects);
                    m.add = m.add.union(&p.add);
                    m.remove = m.remove.union(&p.remove);
                };
                let sync =
                    decode_proposal(&self.read_slot(self.layout.sync(src)), RecordKind::Sync);
                if let Some(p) = sync.filter(|p| p.base == base) {
                    reported.set(src);
                    merge(&mut merged, p);
                }
                let ann = decode_proposal(
                    &self.read_slot(self.layout.announce(src)),
                    RecordKind::Announce,
                );
                if let Some(p) = ann.filter(|p| p.base == base) {
                    merge(&mut merged, p);
                }
            }
            let waiting = old
                .minus(&reported)
                .minus(&merged.suspects)
                .minus(&merged.remove);
            if waiting.is_empty() || Instant::now() >= deadline {
                break;
            }
            idle += 1;
            backoff(idle);
        }
        let mut mask = reported.minus(&merged.remove);
        for a in merged.add.ranks() {
            if a < self.size() && (old.has(a) || self.fresh_join(st, a).is_some()) {
                mask.set(a);
            }
        }
        let view = View {
            epoch: base + 1,
            mask,
            dropped: old.minus(&mask).minus(&merged.remove),
        };
        let dead = merged.suspects.minus(&reported);
        log::debug!(
            "group rank {me}: coordinating epoch {}: members {:?}, dropped {:?}",
            view.epoch,
            mask.ranks(),
            view.dropped.ranks()
        );
        self.adopt(st, &view);
        let targets: Vec<usize> = old
            .union(&mask)
            .minus(&dead)
            .ranks()
            .into_iter()
            .filter(|&r| r != me)
            .collect();
        let timeout = self.options.timeout;
        let missed = self.write_records(
            st,
            &targets,
            |l: &Layout, s| l.view(s),
            &encode_view(&view),
            timeout,
        );
        if !missed.is_empty() {
            log::warn!(
                "group rank {me}: view {} did not reach {missed:?}",
                view.epoch
            );
        }
        view
    }

    /// Makes `view` ours: no write of the old epoch left in flight, new members
    /// reached through their join records, channels restarted.
    pub(super) fn adopt(&self, st: &mut State, view: &View) {
        log::debug!(
            "group rank {}: adopting epoch {} members {:?}",
            self.rank(),
            view.epoch,
            view.mask.ranks()
        );
        self.drain(st);
        let deadline = Instant::now() + self.options.timeout;
        for x in view.mask.ranks() {
            if x == self.rank() || (st.mask.has(x) && st.peers[x].is_some()) {
                continue;
            }
            // The joiner wrote its record to every rank before asking; it may still be
            // landing here.
            let mut idle = 0;
            let join = loop {
                match self.fresh_join(st, x) {
                    Some(j) => break Some(j),
                    None if Instant::now() >= deadline || st.peers[x].is_some() && idle > 1000 => {
                        break None
                    }
                    None => {
                        idle += 1;
                        backoff(idle);
                    }
                }
            };
            if let Some(j) = join {
                // A replacement may reuse its predecessor's name (the port is free
                // again): never trust a descriptor cached for the old process.
                let opened = self
                    .open_peer(&j.segment, deadline)
                    .and_then(|seg| self.engine.resync_segment(seg).map(|()| seg));
                match opened {
                    Ok(seg) => st.set_peer(x, seg, j.addr, j.incarnation),
                    Err(e) => log::warn!("group rank {}: rank {x} unreachable: {e}", self.rank()),
                }
            }
        }
        st.epoch = view.epoch;
        st.mask = view.mask;
        st.seq = 0;
        st.channels.iter_mut().for_each(|c| *c = Channel::default());
        st.needs_sync = false;
        log::debug!("group rank {}: at epoch {}", self.rank(), st.epoch);
    }

    /// Reconciles membership after a failure: `NoPending` when nothing failed and no
    /// change is announced, else the members agree on a view without the failed ranks.
    pub fn sync_after_failure(&self) -> Result<SyncStatus> {
        let mut st = self.lock();
        if let Some(v) = self.newest_view(&st) {
            self.adopt(&mut st, &v);
            return Ok(self.member_status(&st));
        }
        if !st.mask.has(self.rank()) {
            return Ok(SyncStatus::Rejected);
        }
        if !st.needs_sync && self.change_announced(&st).is_none() {
            return Ok(SyncStatus::NoPending);
        }
        let suspects = self.own_suspects(&st);
        self.view_change(&mut st, suspects, Mask::default(), Mask::default())?;
        Ok(self.member_status(&st))
    }

    fn member_status(&self, st: &State) -> SyncStatus {
        if st.mask.has(self.rank()) {
            SyncStatus::Reconciled
        } else {
            SyncStatus::Rejected
        }
    }

    /// Proposes activating (`true`) or deactivating `ranks`. Every active member takes
    /// part (at its next operation or proposal, within the timeout); ranks to activate
    /// must have called [`join`](Self::join).
    pub fn propose(&self, activate: bool, ranks: &[usize]) -> Result<ProposalResponse> {
        if let Some(&r) = ranks.iter().find(|&&r| r >= self.size()) {
            return Err(Error::invalid(format!(
                "rank {r} out of range (world_size {})",
                self.size()
            )));
        }
        let mut st = self.lock();
        if let Some(v) = self.newest_view(&st) {
            self.adopt(&mut st, &v);
        }
        let reject = |st: &State, why: String| ProposalResponse {
            status: ProposalStatus::Rejected,
            new_epoch: st.epoch,
            dropped_ranks: Vec::new(),
            reject_reason: why,
        };
        if !st.mask.has(self.rank()) {
            let why = format!("rank {} is not active", self.rank());
            return Ok(reject(&st, why));
        }
        let wanted = Mask::of(ranks);
        let todo = if activate {
            wanted.minus(&st.mask)
        } else {
            Mask(std::array::from_fn(|i| wanted.0[i] & st.mask.0[i]))
        };
        if todo.is_empty() && self.change_announced(&st).is_none() {
            return Ok(ProposalResponse {
                status: ProposalStatus::Applied,
                new_epoch: st.epoch,
                dropped_ranks: Vec::new(),
                reject_reason: String::new(),
            });
        }
        let suspects = self.own_suspects(&st);
        let (add, remove) = if activate {
            (todo, Mask::default())
        } else {
            (Mask::default(), todo)
        };
        let view = self.view_change(&mut st, suspects, add, remove)?;
        let missing: Vec<usize> = if activate {
            wanted.minus(&st.mask).ranks()
        } else {
            ranks.iter().copied().filter(|&r| st.mask.has(r)).collect()
        };
        if !missing.is_empty() {
            let why = if activate {
                format!("ranks {missing:?} have not claimed their rank (join_group) yet")
            } else {
                format!("ranks {missing:?} are still active")
            };
            return Ok(reject(&st, why));
        }
        let dropped = view.dropped.ranks();
        Ok(ProposalResponse {
            status: if dropped.is_empty() {
                ProposalStatus::Applied
            } else {
                ProposalStatus::AppliedWithDroppedRanks
            },
            new_epoch: st.epoch,
            dropped_ranks: dropped,
            reject_reason: String::new(),
        })
    }

    /// Claims this rank (a replacement, a late rank, or one deactivated before): tells
    /// every peer how to reach this process, then waits up to `timeout` until a member
    /// activates it.
    pub fn join(&self, timeout: Duration) -> Result<()> {
        let mut st = self.lock();
        if st.mask.has(self.rank()) && st.epoch > 0 {
            return Ok(());
        }
        st.incarnation = crate::sys::random_u64() | 1;
        let rec = encode_join(&JoinRecord {
            incarnation: st.incarnation,
            addr: self.base as u64,
            segment: self.engine.segment_name().to_owned(),
        })
        .ok_or_else(|| Error::invalid("segment name too long for a join record"))?;
        let me = self.rank();
        let peers: Vec<usize> = (0..self.size())
            .filter(|&r| r != me && st.peers[r].is_some())
            .collect();
        let wait = self.options.timeout;
        let unreached = self.write_records(&mut st, &peers, |l: &Layout, s| l.join(s), &rec, wait);
        if unreached.len() == peers.len() {
            return Err(Error::new(
                Code::TransferFail,
                format!("rank {me}: no peer reachable to join through"),
            ));
        }
        let deadline = Instant::now() + timeout;
        let mut idle = 0;
        while Instant::now() < deadline {
            if let Some(v) = self.newest_view(&st).filter(|v| v.mask.has(me)) {
                self.adopt(&mut st, &v);
                return Ok(());
            }
            idle += 1;
            backoff(idle.min(600));
            if idle > 600 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        Err(Error::new(
            Code::Timeout,
            format!("rank {me}: not activated within {timeout:?}"),
        ))
    }
}
