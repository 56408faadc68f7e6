//! Views and how they change: announcements, the coordinator's round, adoption, join.
//!
//! A change of epoch `e` runs like this. Whoever starts it (a rank whose operation
//! failed, or one with a proposal) writes an announcement to every member, suspects
//! included, so members blocked in an operation stop waiting and members between
//! operations take part at their next call. Every participant announces too, which is
//! its proof of life for this change. Each participant sends a sync report (its
//! suspects and proposals) to the coordinator: the lowest member it neither suspects
//! (nor hears suspected) without proof of life, nor has given up on. The coordinator
//! waits until every member that is not a lifeless suspect has reported (or the
//! timeout), giving suspects a quarter of the timeout (at most a second) to show
//! life; it steps down if a lower member shows life meanwhile. Short of a majority at
//! the timeout, it waits up to four timeouts for members that announced but have not
//! reported (they may be waiting out a coordinator that died holding their reports).
//! It publishes only with reports from a majority of the view (half counts when it
//! holds the view's lowest rank), after checking once more that no other view is out
//! and that it should still lead. A report is not exclusive, so two coordinators of
//! one change can both publish (a stalled one that resumed and the one the others
//! moved to); every rank then moves to the higher epoch, whichever it saw first
//! ([`acceptable_view`]), so the two cannot both go on. The new view (see
//! [`ViewRecord`]) goes to every rank of the old and new views, the excluded ones too,
//! so they learn they are out. A participant that gets no view in time moves on to
//! the next candidate, down to itself; one that cannot gather a majority steps out of
//! the group and fails until it joins again.

use std::time::Duration;

use super::channel::{Channel, State};
use super::layout::{
    decode_join, decode_proposal, encode_join, encode_proposal, JoinRecord, Layout, Mask, Proposal,
    RecordKind,
};
use super::seam::Recheck;
use super::view::{next_epoch, public_epoch, ViewRecord, MAX_ADMITTED};
use super::{Group, ProposalResponse, ProposalStatus, SyncStatus};
use crate::error::{Code, Error, Result};
use crate::Request;

/// The views a rank held, for readers outside the state lock and for the rival rule
/// in [`acceptable_view`].
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ViewHistory {
    pub epoch: u64,
    pub mask: Mask,
    /// The view the current one replaced, when known (epoch 0: unknown).
    pub base_epoch: u64,
    pub base_mask: Mask,
    /// The incarnation a `join` announced and no view has admitted yet: a retried
    /// join reuses it, so members waiting for that record find it.
    pub joining: Option<u64>,
}

impl ViewHistory {
    pub fn starting(epoch: u64, mask: Mask) -> ViewHistory {
        ViewHistory {
            epoch,
            mask,
            ..ViewHistory::default()
        }
    }

    /// Moves to `view`. A rival of our view (same base) keeps our base, so a later
    /// rival is still recognised; a view derived from ours makes ours its base; a
    /// view that skips some we never saw leaves the base unknown.
    fn advance(&mut self, view: &ViewRecord, me: usize) {
        if view.base == self.epoch {
            (self.base_epoch, self.base_mask) = (self.epoch, self.mask);
        } else if view.base != self.base_epoch {
            (self.base_epoch, self.base_mask) = (0, Mask::default());
        }
        (self.epoch, self.mask) = (view.epoch, view.mask);
        if view.mask.has(me) {
            self.joining = None;
        }
    }
}

/// Whether `v`, found in rank `src`'s view slot, is one for us to adopt. It must be
/// newer than ours and written by its own coordinator. While we are a member, that
/// coordinator must be a member of our view (a rank we excluded cannot lead us
/// anywhere) or, for a rival of our view (one derived from the same base), a member
/// of that base: two coordinators of one change both publish, and every rank must end
/// on the higher epoch, whichever it saw first.
pub(super) fn acceptable_view(v: &ViewRecord, src: usize, me: usize, h: &ViewHistory) -> bool {
    let trusted = !h.mask.has(me)
        || h.mask.has(src)
        || h.base_epoch != 0 && v.base == h.base_epoch && h.base_mask.has(src);
    v.coordinator == src && v.epoch > h.epoch && trusted
}

/// Whether the coordinator stops collecting reports, `elapsed` after it started.
/// Members it is not still `waiting` for (lifeless suspects) get `grace`, but only
/// when it has a majority without them: short of one, stopping means leaving the
/// group, and a suspect that is merely between operations shows life at its next
/// call, so it gets the whole timeout. At the timeout it stops if it has a majority,
/// or if no member that announced this change is still missing; otherwise it waits up
/// to [`COORDINATOR_PATIENCE`] timeouts: such a member may be waiting out a
/// coordinator that died after taking its report, and participants give a
/// coordinator 3 timeouts before moving on to the next.
pub(super) fn collection_over(
    elapsed: Duration,
    timeout: Duration,
    grace: Duration,
    unreported: &Mask,
    waiting: &Mask,
    announced_unreported: &Mask,
    majority: bool,
) -> bool {
    unreported.is_empty()
        || waiting.is_empty() && elapsed >= grace && majority
        || elapsed >= timeout && (majority || announced_unreported.is_empty())
        || elapsed >= COORDINATOR_PATIENCE * timeout
}

/// Timeouts a participant waits for its coordinator's view before moving on.
const PARTICIPANT_PATIENCE: u32 = 3;
/// Most timeouts a coordinator short of a majority waits for announced members: one
/// more than a participant's patience, so one stuck on a dead coordinator reaches us.
const COORDINATOR_PATIENCE: u32 = PARTICIPANT_PATIENCE + 1;

/// Whether reports from `reported` are enough to change `old`: a majority of it, or
/// exactly half when they include its lowest rank.
fn has_majority(old: &Mask, reported: &Mask) -> bool {
    let have = old.ranks().iter().filter(|&&r| reported.has(r)).count();
    let total = old.ranks().len();
    let lowest = old.ranks().first().copied();
    2 * have > total || 2 * have == total && lowest.is_some_and(|l| reported.has(l))
}

/// How a coordinator's collection of reports ended.
enum Collected {
    /// A view came out meanwhile (another coordinator's), and was adopted.
    Adopted(ViewRecord),
    /// A lower member showed life: it leads instead.
    SteppedDown,
    /// The reports gathered, merged with our own proposal.
    Reports { merged: Proposal, reported: Mask },
}

/// What the announcements of the current change say, read in one pass.
struct Announcements {
    /// Union of everyone's proposals.
    merged: Proposal,
    /// Ranks that announced this change (so are alive).
    alive: Mask,
    /// The fewest collective exchanges any of them had begun.
    least_exchanges: u64,
}

impl Announcements {
    /// The suspects, when a member blocked in collective exchange `exchange` (`None`:
    /// point-to-point, or no exchange at all) should stop waiting (see [`Group::change_stops_operation`]).
    fn stop_exchange(&self, exchange: Option<u64>) -> Option<Mask> {
        let m = &self.merged;
        let proposal_only = m.suspects.is_empty() && !(m.add.is_empty() && m.remove.is_empty());
        let all_past = exchange.is_some_and(|e| self.least_exchanges >= e);
        let keep_waiting = self.alive.is_empty() || proposal_only && all_past;
        (!keep_waiting).then_some(m.suspects)
    }
}

impl Group {
    /// Tells every member that a change of our epoch starts: waits (bounded) for the
    /// writes to those we do not suspect; the suspects' writes go out unawaited, so a
    /// dead one costs nothing and a live one learns of the change.
    pub(super) fn announce(&self, st: &mut State, suspects: Mask, add: Mask, remove: Mask) {
        let me = self.rank();
        let others = st.mask.minus(&Mask::of(&[me]));
        let rec = encode_proposal(
            RecordKind::Announce,
            &Proposal {
                base: st.epoch,
                suspects,
                add,
                remove,
                exchanges: st.seq,
            },
        );
        let timeout = self.options.timeout;
        let trusted = others.minus(&suspects).ranks();
        self.write_records(st, &trusted, |l: &Layout, s| l.announce(s), &rec, timeout);
        let suspected = others.minus(&others.minus(&suspects)).ranks();
        self.post_records(st, &suspected, |l: &Layout, s| l.announce(s), &rec);
    }

    /// Writes `record` into slot `slot(me)` of each of `to` without waiting; failures
    /// prove nothing about anyone (these are ranks that may be gone).
    fn post_records(
        &self,
        st: &mut State,
        to: &[usize],
        slot: impl Fn(&Layout, usize) -> usize,
        record: &[u8],
    ) {
        let reqs: Vec<Request> = to
            .iter()
            .filter_map(|&p| self.record_write(st, p, &slot, record))
            .collect();
        let n = reqs.len();
        self.post(st, reqs, vec![None; n]);
    }

    /// The announcements of a change of our epoch in our slots.
    fn announcements(&self, st: &State) -> Announcements {
        let me = self.rank();
        let mut merged = Proposal {
            base: st.epoch,
            ..Proposal::default()
        };
        let mut alive = Mask::default();
        let mut least_exchanges = u64::MAX;
        for src in st.mask.ranks().into_iter().filter(|&r| r != me) {
            let slot = self.read_slot(self.layout.announce(src));
            if let Some(p) = decode_proposal(&slot, RecordKind::Announce) {
                if p.base == st.epoch {
                    alive.set(src);
                    merge(&mut merged, &p);
                    least_exchanges = least_exchanges.min(p.exchanges);
                }
            }
        }
        Announcements {
            merged,
            alive,
            least_exchanges,
        }
    }

    /// The suspects of a change of our epoch someone announced, or an empty set when a
    /// newer view is already out; `None` when nothing is pending.
    pub(super) fn change_announced(&self, st: &State) -> Option<Mask> {
        // Outside an exchange every pending change counts, proposals too.
        self.change_stops_operation(st, None)
    }

    /// The suspects of a pending change, for a member blocked in collective exchange
    /// number `exchange` (`None` for point-to-point or none): `None` when nothing is pending,
    /// or when the change is only a proposal (ranks to activate or deactivate, no one
    /// suspected) and every announcer is past that exchange. Those announcers finished
    /// it, so what they owe us is on its way, and ours completes; we take part at our
    /// next call. Stopping instead would fail an operation the others completed (and
    /// leave us agreeing on the change while they run their next one).
    pub(super) fn change_stops_operation(&self, st: &State, exchange: Option<u64>) -> Option<Mask> {
        if self.newest_view().is_some() {
            return Some(Mask::default());
        }
        self.announcements(st).stop_exchange(exchange)
    }

    /// The newest view in our slots that [`acceptable_view`] lets us adopt, clipped
    /// to the group's ranks.
    fn newest_view(&self) -> Option<ViewRecord> {
        let (me, size) = (self.rank(), self.size());
        let h = *self.views();
        (0..size)
            .filter_map(|src| {
                ViewRecord::decode(&self.read_slot(self.layout.view(src)))
                    .map(|v| v.clipped(size))
                    .filter(|v| acceptable_view(v, src, me, &h))
            })
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
        if let Some(v) = self.newest_view() {
            self.adopt(st, &v);
        }
        if !st.mask.has(self.rank()) {
            return Err(self.not_member(st));
        }
        let announced = self.change_announced(st);
        if announced.is_some() || (st.needs_sync && self.options.auto_sync_on_failure) {
            let suspects = self.own_suspects(st);
            self.view_change(st, suspects, Mask::default(), Mask::default())?;
            if !st.mask.has(self.rank()) {
                return Err(self.not_member(st));
            }
        }
        Ok(())
    }

    fn not_member(&self, st: &State) -> Error {
        Error::new(
            Code::UnavailableInCurrentStatus,
            format!(
                "rank {} is not active at epoch {} (deactivated, or excluded after not \
                 answering in time): join_group first",
                self.rank(),
                st.epoch
            ),
        )
    }

    fn own_suspects(&self, st: &State) -> Mask {
        if st.needs_sync && self.options.auto_deactivate_on_failure {
            Mask::of(&st.last_failed).minus(&Mask::of(&[self.rank()]))
        } else {
            Mask::default()
        }
    }

    /// The rank of our view that should coordinate: the lowest not asked to be removed,
    /// not given up on, and not suspected (by us or an announcement) unless it has
    /// announced this change itself. Never above us.
    fn pick_coordinator(&self, st: &State, mine: &Proposal, skipped: &Mask) -> usize {
        let me = self.rank();
        let a = self.announcements(st);
        let suspected = mine.suspects.union(&a.merged.suspects).minus(&a.alive);
        st.mask
            .minus(&mine.remove)
            .minus(skipped)
            .minus(&suspected)
            .ranks()
            .into_iter()
            .find(|&r| r < me)
            .unwrap_or(me)
    }

    /// Runs a change of the current epoch (see the module comment) and adopts its view.
    ///
    /// Bounded but long in the worst case: at most `2n + 2` rounds (n = world size),
    /// each one timeout of writes plus three of waiting for a coordinator, or four of
    /// coordinating plus one of writing the view. It holds the state lock throughout,
    /// so this rank's other operations wait; `epoch` and `active_ranks` do not (they
    /// read [`ViewHistory`]).
    pub(super) fn view_change(
        &self,
        st: &mut State,
        suspects: Mask,
        add: Mask,
        remove: Mask,
    ) -> Result<ViewRecord> {
        let me = self.rank();
        let base = st.epoch;
        let suspects = suspects.minus(&Mask::of(&[me]));
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
            exchanges: st.seq,
        };
        let mut skipped = Mask::default();
        let timeout = self.options.timeout;
        // A round ends when we give up on a candidate or learn something that changes
        // the choice (a suspicion, a proof of life); both only grow, so a few rounds
        // per rank bound it.
        for _ in 0..2 * self.size() + 2 {
            if let Some(v) = self.newest_view() {
                self.adopt(st, &v);
                return Ok(v);
            }
            let c = self.pick_coordinator(st, &prop, &skipped);
            if c == me {
                match self.coordinate(st, prop, &skipped)? {
                    Some(v) => return Ok(v),
                    None => continue,
                }
            }
            let rec = encode_proposal(RecordKind::Sync, &prop);
            let unreached = self.write_records(st, &[c], |l: &Layout, s| l.sync(s), &rec, timeout);
            let mut moved = false;
            if unreached.is_empty() {
                // The coordinator may wait a whole timeout for slow members, then a
                // whole timeout for its writes.
                let deadline = self.clock.now() + PARTICIPANT_PATIENCE * timeout;
                let mut idle = 0;
                let mut recheck = Recheck::within(&*self.clock, timeout);
                while self.clock.now() < deadline {
                    if let Some(v) = self.newest_view() {
                        self.adopt(st, &v);
                        return Ok(v);
                    }
                    idle += 1;
                    if recheck.due(&*self.clock, idle)
                        && self.pick_coordinator(st, &prop, &skipped) != c
                    {
                        moved = true;
                        break;
                    }
                    self.clock.backoff(idle);
                }
            }
            if !moved {
                log::warn!("group rank {me}: coordinator {c} of epoch {base} did not answer");
                skipped.set(c);
                prop.suspects.set(c);
            }
        }
        Err(Error::new(
            Code::Timeout,
            format!("rank {me}: no coordinator answered for the change of epoch {base}"),
        ))
    }

    /// The coordinator's round: collect reports, decide, publish, adopt. `None` when a
    /// lower member showed life meanwhile (it coordinates instead).
    fn coordinate(
        &self,
        st: &mut State,
        mine: Proposal,
        skipped: &Mask,
    ) -> Result<Option<ViewRecord>> {
        let me = self.rank();
        let base = st.epoch;
        let old = st.mask;
        let (merged, reported) = match self.collect_reports(st, mine, skipped) {
            Collected::Adopted(v) => return Ok(Some(v)),
            Collected::SteppedDown => return Ok(None),
            Collected::Reports { merged, reported } => (merged, reported),
        };
        // Another coordinator may have published while we collected (we were slow or
        // stopped), or a lower member may have shown life: re-check just before
        // deciding, so we neither publish a rival we could have adopted nor lead when
        // someone else should.
        if let Some(v) = self.newest_view() {
            self.adopt(st, &v);
            return Ok(Some(v));
        }
        if self.pick_coordinator(st, &mine, skipped) != me {
            return Ok(None);
        }
        if !has_majority(&old, &reported) {
            // Either this rank is cut off from the others (they went on without it) or
            // too many died at once: going on alone could split the group in two.
            st.mask.clear(me);
            self.views().mask = st.mask;
            st.needs_sync = false;
            return Err(Error::new(
                Code::UnavailableInCurrentStatus,
                format!(
                    "rank {me}: only ranks {:?} of epoch {base}'s members {:?} answered, no \
                     majority: this rank leaves the group (join_group to come back)",
                    reported.ranks(),
                    old.ranks()
                ),
            ));
        }
        let view = self.decide_view(st, &merged, reported);
        self.publish_view(st, view).map(Some)
    }

    /// Collects sync reports for the change of our epoch until [`collection_over`],
    /// unless a view comes out meanwhile or a lower member should lead.
    fn collect_reports(&self, st: &mut State, mine: Proposal, skipped: &Mask) -> Collected {
        let me = self.rank();
        let base = st.epoch;
        let old = st.mask;
        let started = self.clock.now();
        let timeout = self.options.timeout;
        // A live suspect (blamed for a mismatch, or slow) announces within moments of
        // seeing the change; a dead one never does. Waiting this long for suspects
        // keeps recovery from a death under 1.25 timeouts (and a second past the
        // failed operation's own bound, for callers that give one).
        let grace = (self.options.timeout / 4).min(Duration::from_secs(1));
        let mut merged = mine;
        let mut reported = Mask::of(&[me]);
        let mut idle = 0;
        let mut recheck = Recheck::within(&*self.clock, timeout);
        loop {
            if let Some(v) = self.newest_view() {
                self.adopt(st, &v);
                return Collected::Adopted(v);
            }
            let a = self.announcements(st);
            merge(&mut merged, &a.merged);
            for src in old.ranks().into_iter().filter(|&r| r != me) {
                let sync =
                    decode_proposal(&self.read_slot(self.layout.sync(src)), RecordKind::Sync);
                if let Some(p) = sync.filter(|p| p.base == base) {
                    reported.set(src);
                    merge(&mut merged, &p);
                }
            }
            if recheck.due(&*self.clock, idle) && self.pick_coordinator(st, &mine, skipped) != me {
                return Collected::SteppedDown;
            }
            let unreported = old.minus(&reported).minus(&merged.remove);
            let waiting = unreported.minus(&merged.suspects.minus(&a.alive));
            let announced_unreported = unreported.minus(&unreported.minus(&a.alive));
            if collection_over(
                self.clock.now().saturating_duration_since(started),
                timeout,
                grace,
                &unreported,
                &waiting,
                &announced_unreported,
                has_majority(&old, &reported),
            ) {
                break;
            }
            idle += 1;
            self.clock.backoff(idle);
        }
        Collected::Reports { merged, reported }
    }

    /// The view the reports make: the members that reported, less those asked to be
    /// removed, plus the ranks asked to be added (old members, or joiners with a fresh
    /// join record, at most [`MAX_ADMITTED`]).
    fn decide_view(&self, st: &State, merged: &Proposal, reported: Mask) -> ViewRecord {
        let me = self.rank();
        let base = st.epoch;
        let old = st.mask;
        let mut mask = reported.minus(&merged.remove);
        let mut admitted = Vec::new();
        for a in merged.add.ranks() {
            if a >= self.size() {
                continue;
            }
            if old.has(a) {
                mask.set(a);
            } else if let Some(j) = self.fresh_join(st, a) {
                if admitted.len() < MAX_ADMITTED {
                    admitted.push((a, j.incarnation));
                    mask.set(a);
                }
            }
        }
        ViewRecord {
            epoch: next_epoch(base, me),
            base,
            coordinator: me,
            mask,
            dropped: old.minus(&mask).minus(&merged.remove),
            admitted,
        }
    }

    /// Writes `view` to its members (the admitted at their new addresses), posts it to
    /// the excluded so they learn they are out, and adopts it.
    fn publish_view(&self, st: &mut State, view: ViewRecord) -> Result<ViewRecord> {
        let me = self.rank();
        let old = st.mask;
        let mask = view.mask;
        let timeout = self.options.timeout;
        log::debug!(
            "group rank {me}: coordinating epoch {}: members {:?}, dropped {:?}",
            view.epoch,
            mask.ranks(),
            view.dropped.ranks()
        );
        let Some(rec) = view.encode() else {
            return Err(Error::invalid("view record does not fit"));
        };
        // A replacement is written to at its new address, not its predecessor's.
        self.reach_admitted(st, &view);
        self.introduce_admitted(st, &view);
        let me_only = Mask::of(&[me]);
        let members = mask.minus(&me_only).ranks();
        let missed = self.write_records(st, &members, |l: &Layout, s| l.view(s), &rec, timeout);
        if !missed.is_empty() {
            log::warn!(
                "group rank {me}: view {} did not reach {missed:?}",
                view.epoch
            );
        }
        // The excluded learn they are out (a live one then fails clearly instead of
        // forming a view of its own); a dead one costs nothing.
        let excluded = old.minus(&mask).minus(&me_only).ranks();
        self.post_records(st, &excluded, |l: &Layout, s| l.view(s), &rec);
        self.adopt(st, &view);
        Ok(view)
    }

    /// Passes each rank `view` admits the join records of the others it admits: a
    /// joiner wrote its record only to the ranks up when it joined, which need not
    /// include a joiner that started after it (that one would wait out the timeout for
    /// the record on adopting the view). A record not readable here is left to its
    /// writer. All of it within one timeout, and a rank that missed one record is not
    /// written to again: a joiner gone meanwhile must not hold the view back by a
    /// timeout per joiner (its members wait for it a bounded time).
    fn introduce_admitted(&self, st: &mut State, view: &ViewRecord) {
        let deadline = self.clock.now() + self.options.timeout;
        let mut unreached = Mask::default();
        for &(a, incarnation) in &view.admitted {
            let record = decode_join(&self.read_slot(self.layout.join(a)))
                .filter(|j| j.incarnation == incarnation)
                .and_then(|j| encode_join(&j));
            let Some(record) = record else { continue };
            let others: Vec<usize> = view
                .admitted
                .iter()
                .map(|&(b, _)| b)
                .filter(|&b| b != a && !unreached.has(b))
                .collect();
            if others.is_empty() {
                continue;
            }
            let left = deadline.saturating_duration_since(self.clock.now());
            if left.is_zero() {
                log::warn!(
                    "group rank {}: out of time to pass rank {a}'s join record to {others:?}",
                    self.rank()
                );
                continue;
            }
            let missed = self.write_records(st, &others, |l: &Layout, _| l.join(a), &record, left);
            for &b in &missed {
                unreached.set(b);
            }
            if !missed.is_empty() {
                log::warn!(
                    "group rank {}: rank {a}'s join record did not reach {missed:?}",
                    self.rank()
                );
            }
        }
    }

    /// Makes `view` ours: no write of the old epoch left in flight, new members
    /// reached through their join records, channels restarted.
    pub(super) fn adopt(&self, st: &mut State, view: &ViewRecord) {
        let view = &view.clone().clipped(self.size());
        log::debug!(
            "group rank {}: adopting epoch {} (from {} by {}) members {:?}",
            self.rank(),
            view.epoch,
            view.base,
            view.coordinator,
            view.mask.ranks()
        );
        self.drain(st);
        self.reach_admitted(st, view);
        st.epoch = view.epoch;
        st.mask = view.mask;
        self.views().advance(view, self.rank());
        st.seq = 0;
        st.channels.iter_mut().for_each(|c| *c = Channel::default());
        st.needs_sync = false;
        // Every member of the view answered its coordinator: the last failure's
        // missed ranks that are still members were slow, not failed.
        st.last_failed.retain(|&r| !view.mask.has(r));
        log::debug!("group rank {}: at epoch {}", self.rank(), st.epoch);
    }

    /// Opens the way to `view`'s members we cannot reach yet (admitted through a join
    /// record), bounded by the timeout.
    fn reach_admitted(&self, st: &mut State, view: &ViewRecord) {
        let deadline = self.clock.now() + self.options.timeout;
        for x in view.mask.ranks() {
            if x == self.rank() {
                continue;
            }
            let known = st.peers[x].map(|p| p.incarnation);
            let wanted = view.admitted_incarnation(x);
            match wanted {
                Some(inc) if known == Some(inc) => continue,
                None if st.mask.has(x) && known.is_some() => continue,
                _ => {}
            }
            // The joiner wrote its record to every rank before asking; it may still be
            // landing here. With the incarnation the view names we wait for exactly
            // that record; without one (we missed the view that admitted `x`) for any
            // newer record, briefly when we already know an address for `x`.
            let mut idle = 0u32;
            let join = loop {
                let seen = self
                    .fresh_join(st, x)
                    .filter(|j| wanted.is_none_or(|inc| j.incarnation == inc));
                if seen.is_some()
                    || self.clock.now() >= deadline
                    || wanted.is_none() && known.is_some() && idle > 1000
                {
                    break seen;
                }
                idle += 1;
                self.clock.backoff(idle);
            };
            match join {
                Some(j) => {
                    // A replacement may reuse its predecessor's name (the port is free
                    // again): never trust a descriptor cached for the old process.
                    let opened = self
                        .open_peer(&j.segment, deadline)
                        .and_then(|seg| self.transport.resync_segment(seg).map(|()| seg));
                    match opened {
                        Ok(seg) => st.set_peer(x, seg, j.addr, j.incarnation),
                        Err(e) => {
                            log::warn!("group rank {}: rank {x} unreachable: {e}", self.rank())
                        }
                    }
                }
                None if wanted.is_some() => log::warn!(
                    "group rank {}: rank {x}'s join record never arrived",
                    self.rank()
                ),
                None => {}
            }
        }
    }

    /// Reconciles membership after a failure: `NoPending` when nothing failed and no
    /// change is announced, else the members agree on a view without the failed ranks;
    /// `Rejected` when this rank is not (or no longer) a member.
    pub fn sync_after_failure(&self) -> Result<SyncStatus> {
        let mut st = self.lock();
        if let Some(v) = self.newest_view() {
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

    /// Adopts a view published for this rank while it was between operations (one a
    /// member published on leaving, see [`propose`](Self::propose)), so that
    /// [`active_ranks`](Self::active_ranks) and [`epoch`](Self::epoch) show it; nothing
    /// when an operation holds the rank now (that one adopts it as it starts). A
    /// pending change is not taken part in here: that waits for the next operation.
    pub fn refresh(&self) {
        let mut st = match self.state.try_lock() {
            Ok(st) => st,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        if let Some(v) = self.newest_view() {
            self.adopt(&mut st, &v);
        }
    }

    fn member_status(&self, st: &State) -> SyncStatus {
        if st.mask.has(self.rank()) {
            SyncStatus::Reconciled
        } else {
            SyncStatus::Rejected
        }
    }

    /// Proposes activating (`true`) or deactivating `ranks`. Every active member takes
    /// part (at its next operation or proposal, within the timeout), except in a rank's
    /// deactivation of only itself, which it applies alone ([`leave`](Self::leave));
    /// ranks to activate must have called [`join`](Self::join).
    pub fn propose(&self, activate: bool, ranks: &[usize]) -> Result<ProposalResponse> {
        if let Some(&r) = ranks.iter().find(|&&r| r >= self.size()) {
            return Err(Error::invalid(format!(
                "rank {r} out of range (world_size {})",
                self.size()
            )));
        }
        let mut st = self.lock();
        if let Some(v) = self.newest_view() {
            self.adopt(&mut st, &v);
        }
        let reject = |st: &State, why: String| ProposalResponse {
            status: ProposalStatus::Rejected,
            new_epoch: public_epoch(st.epoch),
            dropped_ranks: Vec::new(),
            reject_reason: why,
        };
        let wanted = Mask::of(ranks);
        let todo = if activate {
            wanted.minus(&st.mask)
        } else {
            wanted.minus(&wanted.minus(&st.mask))
        };
        // Already so (every member proposing the same change, the first to coordinate
        // it applied it for all, the deactivated proposer included): nothing to do.
        if todo.is_empty() && self.change_announced(&st).is_none() {
            return Ok(ProposalResponse {
                status: ProposalStatus::Applied,
                new_epoch: public_epoch(st.epoch),
                dropped_ranks: Vec::new(),
                reject_reason: String::new(),
            });
        }
        if !st.mask.has(self.rank()) {
            let why = format!("rank {} is not active", self.rank());
            return Ok(reject(&st, why));
        }
        let me = Mask::of(&[self.rank()]);
        if !activate && todo == me && !st.needs_sync && self.change_announced(&st).is_none() {
            return self.leave(&mut st);
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
                format!(
                    "ranks {missing:?} were not admitted: no join_group claim seen yet (at \
                     most {MAX_ADMITTED} are admitted per view)"
                )
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
            new_epoch: public_epoch(st.epoch),
            dropped_ranks: dropped,
            reject_reason: String::new(),
        })
    }

    /// Takes this rank out of the group by itself (it deactivates only itself, and no
    /// change is pending): as the change's coordinator it publishes the view of the
    /// other members to them and adopts it. No majority is needed, since the leaver
    /// does not go on alone, and none could be had: members between operations take
    /// part in no change until their next call. They adopt the view at that call (or
    /// [`refresh`](Self::refresh)); one blocked in an operation with this rank stops,
    /// as on any new view, and goes on without it.
    fn leave(&self, st: &mut State) -> Result<ProposalResponse> {
        let me = self.rank();
        let view = ViewRecord {
            epoch: next_epoch(st.epoch, me),
            base: st.epoch,
            coordinator: me,
            mask: st.mask.minus(&Mask::of(&[me])),
            dropped: Mask::default(),
            admitted: Vec::new(),
        };
        let rec = view
            .encode()
            .ok_or_else(|| Error::invalid("view record does not fit"))?;
        let members = view.mask.ranks();
        let timeout = self.options.timeout;
        let missed = self.write_records(st, &members, |l: &Layout, s| l.view(s), &rec, timeout);
        if !missed.is_empty() {
            log::warn!("group rank {me}: leaving view did not reach {missed:?}");
        }
        self.adopt(st, &view);
        Ok(ProposalResponse {
            status: ProposalStatus::Applied,
            new_epoch: public_epoch(st.epoch),
            dropped_ranks: Vec::new(),
            reject_reason: String::new(),
        })
    }

    /// Claims this rank (a replacement, a late rank, or one deactivated or excluded
    /// before): tells every peer how to reach this process, then waits up to `timeout`
    /// until a member activates it.
    pub fn join(&self, timeout: Duration) -> Result<()> {
        let mut st = self.lock();
        if st.mask.has(self.rank()) && st.epoch > 0 {
            return Ok(());
        }
        // Until a view admits us, a retry (after a timeout) keeps the incarnation
        // members may already be waiting for.
        st.incarnation = *self
            .views()
            .joining
            .get_or_insert_with(|| crate::sys::random_u64() | 1);
        let rec = encode_join(&JoinRecord {
            incarnation: st.incarnation,
            addr: self.base as u64,
            segment: self.transport.segment_name().to_owned(),
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
        let deadline = self.clock.now() + timeout;
        let mut idle = 0;
        while self.clock.now() < deadline {
            if let Some(v) = self.newest_view().filter(|v| v.mask.has(me)) {
                self.adopt(&mut st, &v);
                return Ok(());
            }
            idle += 1;
            self.clock.backoff(idle.min(600));
            if idle > 600 {
                self.clock.sleep(Duration::from_millis(1));
            }
        }
        Err(Error::new(
            Code::Timeout,
            format!("rank {me}: not activated within {timeout:?}"),
        ))
    }
}

fn merge(into: &mut Proposal, p: &Proposal) {
    into.suspects = into.suspects.union(&p.suspects);
    into.add = into.add.union(&p.add);
    into.remove = into.remove.union(&p.remove);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(base: u64, coordinator: usize, members: &[usize]) -> ViewRecord {
        ViewRecord {
            epoch: next_epoch(base, coordinator),
            base,
            coordinator,
            mask: Mask::of(members),
            ..ViewRecord::default()
        }
    }

    /// A blocked member keeps waiting only for a proposal whose announcers are all past
    /// its exchange; a suspicion, an announcer behind it, or a point-to-point exchange
    /// stops it.
    #[test]
    fn only_a_proposal_from_ranks_past_the_exchange_lets_it_go_on() {
        let announced = |suspects: &[usize], remove: &[usize], least_exchanges| Announcements {
            merged: Proposal {
                base: 3,
                suspects: Mask::of(suspects),
                remove: Mask::of(remove),
                ..Proposal::default()
            },
            alive: Mask::of(&[1, 2]),
            least_exchanges,
        };
        assert_eq!(announced(&[], &[2], 7).stop_exchange(Some(7)), None);
        assert_eq!(announced(&[], &[2], 9).stop_exchange(Some(7)), None);
        assert_eq!(
            announced(&[], &[2], 6).stop_exchange(Some(7)),
            Some(Mask::default())
        );
        assert_eq!(
            announced(&[], &[2], 9).stop_exchange(None),
            Some(Mask::default())
        );
        assert_eq!(
            announced(&[4], &[2], 9).stop_exchange(Some(7)),
            Some(Mask::of(&[4]))
        );
        // A failure reported without suspects (auto-deactivate off) is no proposal.
        assert_eq!(
            announced(&[], &[], 9).stop_exchange(Some(7)),
            Some(Mask::default())
        );
        let nobody = Announcements {
            alive: Mask::default(),
            ..announced(&[4], &[], 0)
        };
        assert_eq!(nobody.stop_exchange(Some(7)), None);
    }

    /// The review's split: 5 ranks at epoch `e`; stalled coordinator 0 and coordinator
    /// 1 both publish a change of `e`. Whatever each rank sees first, all end on the
    /// higher view, and no rank goes back to the lower one.
    #[test]
    fn ranks_that_saw_either_rival_all_end_on_the_higher() {
        let e = next_epoch(1, 0);
        let low = view(e, 0, &[0, 2, 3, 4]);
        let high = view(e, 1, &[1, 2, 3, 4]);
        assert!(high.epoch > low.epoch);
        for me in 0..5 {
            let mut h = ViewHistory::starting(e, Mask::first(5));
            assert!(acceptable_view(&low, 0, me, &h));
            assert!(acceptable_view(&high, 1, me, &h));
            // This rank saw the lower rival first (rank 1 is outside it).
            h.advance(&low, me);
            assert_eq!((h.base_epoch, h.base_mask), (e, Mask::first(5)));
            assert!(
                acceptable_view(&high, 1, me, &h),
                "rank {me} refuses the higher rival"
            );
            h.advance(&high, me);
            assert_eq!(h.epoch, high.epoch);
            assert!(!acceptable_view(&low, 0, me, &h), "no way back");
            // The losing side's next change (derived from the lower rival, by a rank
            // outside the higher one) does not pull a member of the higher back.
            let from_low = view(low.epoch, 0, &[0, 2, 3]);
            assert!(from_low.epoch > h.epoch);
            if h.mask.has(me) {
                assert!(!acceptable_view(&from_low, 0, me, &h), "rank {me}");
            }
            // The next change of the higher is taken as usual.
            assert!(acceptable_view(&view(high.epoch, 2, &[2, 3, 4]), 2, me, &h));
        }
    }

    #[test]
    fn views_are_taken_only_from_their_coordinators_slot_and_trusted_ranks() {
        let e = next_epoch(1, 0);
        let h = ViewHistory::starting(e, Mask::of(&[0, 1, 2]));
        let v = view(e, 1, &[1, 2]);
        assert!(!acceptable_view(&v, 2, 2, &h), "written by another rank");
        let outsider = view(e, 3, &[2, 3]);
        assert!(
            !acceptable_view(&outsider, 3, 2, &h),
            "coordinator not a member"
        );
        assert!(
            acceptable_view(&outsider, 3, 5, &h),
            "a non-member takes any"
        );
        let stale = ViewRecord {
            epoch: e,
            ..view(1, 0, &[0, 1, 2])
        };
        assert!(!acceptable_view(&stale, 0, 2, &h), "not newer");
        // A view that skipped some we never saw: the base is unknown, so only the
        // plain rule applies.
        let mut h = h;
        h.advance(&view(next_epoch(e, 1), 1, &[0, 1, 2]), 2);
        assert_eq!(h.base_epoch, 0);
    }

    #[test]
    fn a_retried_join_keeps_its_incarnation_until_admitted() {
        let mut h = ViewHistory::starting(0, Mask::of(&[0, 1]));
        let first = *h.joining.get_or_insert(7);
        assert_eq!(*h.joining.get_or_insert(9), first, "retry");
        h.advance(&view(1, 0, &[0, 1]), 2);
        assert_eq!(h.joining, Some(7), "a view without us");
        h.advance(&view(next_epoch(1, 0), 0, &[0, 1, 2]), 2);
        assert_eq!(
            h.joining, None,
            "admitted: the next join is a new incarnation"
        );
    }

    /// The review's cascade: coordinator 0 took ranks 2 and 3's reports and died;
    /// rank 1 coordinates alone. At one timeout it must not give up while 2 and 3
    /// (announced, alive) are still waiting out rank 0.
    #[test]
    fn a_coordinator_short_of_a_majority_waits_for_announced_members() {
        let t = Duration::from_secs(1);
        let grace = t / 4;
        let old = Mask::first(4);
        let reported = Mask::of(&[1]);
        assert!(!has_majority(&old, &reported));
        let unreported = Mask::of(&[0, 2, 3]);
        let announced = Mask::of(&[0, 2, 3]);
        let over = |elapsed, majority| {
            collection_over(
                elapsed,
                t,
                grace,
                &unreported,
                &unreported,
                &announced,
                majority,
            )
        };
        assert!(!over(t, false));
        assert!(!over(3 * t, false));
        assert!(over(4 * t, false), "bounded");
        assert!(over(t, true), "a majority goes on at the timeout");
        // Nobody missing announced (they are dead): no reason to wait longer.
        let none = Mask::default();
        assert!(collection_over(
            t,
            t,
            grace,
            &unreported,
            &unreported,
            &none,
            false
        ));
        // Ranks 2 and 3 arrive: a majority of the 4.
        assert!(has_majority(&old, &Mask::of(&[1, 2, 3])));
        assert!(
            has_majority(&old, &Mask::of(&[0, 3])),
            "half with the lowest"
        );
        assert!(!has_majority(&old, &Mask::of(&[1, 3])), "half without it");
    }

    /// Seed 129 of the PG simulation: rank 1 of view [0, 1] suspects rank 0, which
    /// is alive but between operations. Past the grace, with nobody left to wait for,
    /// a coordinator short of a majority must keep collecting until the timeout (rank
    /// 0 showed life 13 ms after the grace there), or it leaves the group for nothing.
    #[test]
    fn a_coordinator_short_of_a_majority_gives_a_lifeless_suspect_the_timeout() {
        let t = Duration::from_secs(1);
        let grace = t / 4;
        let unreported = Mask::of(&[0]);
        let nobody = Mask::default();
        let over = |elapsed, majority| {
            collection_over(elapsed, t, grace, &unreported, &nobody, &nobody, majority)
        };
        assert!(!over(grace, false), "short of a majority, at the grace");
        assert!(over(t, false), "short of a majority, at the timeout");
        assert!(over(grace, true), "a majority need not wait for suspects");
    }
}
