//! The catalog event log of one segment (see `catalog`): events recorded in commit
//! order, long-polled and acknowledged by the segment's node, with the space of
//! offloaded objects held until the node copied it.

use crate::util::sync::Unpoisoned;
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::note_slots::{Lent, NoteSlots};
use super::segments::ReplicaAlloc;
use crate::protocol::{CatalogEvent, NoteKey, NoteRing, SegmentInfo};

/// Events one answer carries at most.
pub const MAX_EVENTS_PER_POLL: usize = 4096;
/// Disk copies (offloads, read-backs) one answer asks of a node at most.
const MAX_DISK_EVENTS_PER_POLL: usize = 64;
/// Bytes of events one answer carries at most (well inside the RPC frame limit).
const MAX_POLL_BYTES: usize = 4 << 20;
/// Events a log holds unacknowledged beyond its snapshot before it gives up on its node.
const SLACK_EVENTS: usize = 1 << 20;

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
    held: VecDeque<(u64, Held)>,
    /// Held space whose event was dropped unacknowledged (a reset, a timeout): the
    /// node may still be copying from it, so it waits here until `LIMBO` passes.
    limbo: Vec<(Instant, Held)>,
    /// A waiting poll should answer now.
    woken: bool,
    /// The node's note ring: which slots puts may use.
    notes: NoteSlots,
}

/// The object an offload was ordered for. Its other memory replicas are freed only
/// once the node acknowledged the disk copy: until then a node that dies, or fails
/// to write, must not take the object with it (`take_fallback`).
pub struct Fallback {
    pub key: Box<str>,
    pub version: u64,
    pub replicas: Vec<ReplicaAlloc>,
}

/// What an unacknowledged offload keeps allocated.
struct Held {
    /// The replica the node copies from (held only: dropping it frees it).
    _space: ReplicaAlloc,
    fallback: Option<Fallback>,
}

impl Held {
    fn is_fallback_of(&self, key: &str, version: u64) -> bool {
        self.fallback
            .as_ref()
            .is_some_and(|f| f.version == version && &*f.key == key)
    }
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
        self.state.locked()
    }

    /// Records an event if a node follows this log; its sequence number. A waiting
    /// poll is not woken for it: the event leaves with the next answer, at once when
    /// someone waits for an acknowledgement (`wait_acked`, `deliver`), else within
    /// `MasterConfig::catalog_poll_wait`. A batch of puts so costs its node one poll, not one per event (on
    /// a small machine each was a thread hand-off on the put's path).
    pub fn record(&self, event: impl FnOnce() -> CatalogEvent) -> Option<u64> {
        let mut s = self.lock();
        if !s.active {
            return None;
        }
        let (seq, released) = self.push(&mut s, event());
        drop(s);
        drop(released); // frees space: records events, so never under the lock
        Some(seq)
    }

    /// Appends `event` to an active log; its sequence number, and space to drop once
    /// the lock is let go (when the node fell too far behind and lost its log).
    fn push(&self, s: &mut LogState, event: CatalogEvent) -> (u64, Vec<Held>) {
        s.last += 1;
        let seq = s.last;
        s.events.push_back((seq, event));
        let released = if s.events.len() > s.cap {
            log::warn!(
                "a node fell {} catalog events behind; it gets a snapshot when it polls again",
                s.events.len()
            );
            self.drop_log(s)
        } else {
            Vec::new()
        };
        (seq, released)
    }

    /// Lends a slot of the node's note ring to a put, numbered by `lend` (called under
    /// this log's lock, so numbers rise in lend order): the slot, the key and the
    /// ring; None when the node keeps no ring, none is free, or nobody follows the log.
    pub fn lend_note(&self, lend: impl FnOnce() -> u64) -> Option<(Lent, NoteKey, NoteRing)> {
        let mut s = self.lock();
        if !s.active {
            return None;
        }
        let base = s.base;
        let (lent, low) = s.notes.lend(base, lend, Instant::now());
        if low {
            // Have the node clear consumed notes now, not at its next poll.
            s.woken = true;
            self.news.notify_all();
        }
        Some((lent?, s.notes.key()?, s.notes.ring()?))
    }

    /// Gives back a lent slot no note was written to.
    pub fn unlend_note(&self, lent: Lent) {
        self.lock().notes.unlend(lent);
    }

    /// Records `commit` (of the object whose note is in `lent`), and clears the note;
    /// the commit's sequence number, and whether the note covers it: true when the
    /// note is of the current epoch (the node reads it if it loses track before it
    /// applies the commit), so nobody need wait for the node.
    pub fn commit_noted(&self, commit: CatalogEvent, lent: Lent) -> (Option<u64>, bool) {
        let mut s = self.lock();
        if !s.active {
            s.notes.release_stale(lent.slot);
            return (None, false);
        }
        let (seq, mut released) = self.push(&mut s, commit);
        let covered = s.active && lent.epoch == s.base;
        if covered {
            let unnote = CatalogEvent::Unnote {
                slot: lent.slot,
                lend: lent.lend,
            };
            let (unnote, more) = self.push(&mut s, unnote);
            released.extend(more);
            s.notes.clear_after(unnote, lent.slot);
        } else {
            s.notes.release_stale(lent.slot);
        }
        let covered = covered && s.active;
        drop(s);
        drop(released);
        (Some(seq), covered)
    }

    /// Drops the note of a put that ends without a commit: the node is told to clear
    /// it (the `Unnote`'s sequence number, to wait for when the writer was told the
    /// put failed). A writer not known to be done may still write the note: its slot
    /// is not lent again before `until`.
    pub fn drop_note(&self, lent: Lent, writer_done: bool, until: Instant) -> Option<u64> {
        let mut s = self.lock();
        let current = s.active && lent.epoch == s.base;
        let (seq, released) = match current {
            true => {
                let unnote = CatalogEvent::Unnote {
                    slot: lent.slot,
                    lend: lent.lend,
                };
                let (seq, released) = self.push(&mut s, unnote);
                (Some(seq), released)
            }
            false => (None, Vec::new()),
        };
        match (writer_done, seq) {
            (false, _) => s.notes.quarantine(lent.slot, until),
            (true, Some(seq)) => s.notes.clear_after(seq, lent.slot),
            (true, None) => s.notes.release_stale(lent.slot),
        }
        drop(s);
        drop(released);
        seq
    }

    /// Keeps ring slots at these addresses from being lent before their time (see
    /// `NoteSlots::fence`).
    pub fn fence_notes(&self, fences: Vec<(u64, Instant)>) {
        self.lock().notes.fence(fences);
    }

    /// The key this epoch's notes are sealed with, if the node keeps a ring.
    pub fn note_key(&self) -> Option<NoteKey> {
        self.lock().notes.key()
    }

    /// Records `event` and keeps `space` and `fallback` allocated until the node
    /// acknowledges it; gives both back when no node follows this log.
    pub fn record_holding(
        &self,
        event: CatalogEvent,
        space: ReplicaAlloc,
        fallback: Option<Fallback>,
    ) -> std::result::Result<u64, (ReplicaAlloc, Option<Fallback>)> {
        let mut s = self.lock();
        if !s.active {
            return Err((space, fallback));
        }
        s.last += 1;
        let seq = s.last;
        s.events.push_back((seq, event));
        s.held.push_back((
            seq,
            Held {
                _space: space,
                fallback,
            },
        ));
        self.news.notify_all();
        Ok(seq)
    }

    /// Takes the replicas `key` (at `version`) had in memory when it was offloaded
    /// here, if the offload was dropped unacknowledged (the node died, or was reset
    /// before it wrote the copy): the object falls back to them. A node that follows
    /// the log and fails its write is not helped: retried, the write may fail again
    /// and again, and eviction would free nothing.
    pub fn take_fallback(&self, key: &str, version: u64) -> Option<Vec<ReplicaAlloc>> {
        let mut s = self.lock();
        let found = s
            .limbo
            .iter_mut()
            .map(|(_, h)| h)
            .find(|h| h.is_fallback_of(key, version))?;
        found.fallback.take().map(|f| f.replicas)
    }

    /// The last event whose space is still held, if any.
    pub fn held_until(&self) -> Option<u64> {
        self.lock().held.back().map(|(seq, _)| *seq)
    }

    /// Has a waiting poll answer with the events recorded so far (see `record`).
    pub fn deliver(&self) {
        self.news.notify_all();
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
        if s.acked < seq {
            // Events are recorded without waking the poll (see `record`): now it must.
            self.deliver();
        }
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
    pub fn restart(&self, expected: usize, ring: NoteRing, segment: &SegmentInfo) -> u64 {
        let mut s = self.lock();
        s.notes.announce(ring, segment);
        s.notes.new_epoch();
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
                released.extend(s.held.pop_front().map(|(_, h)| h));
            }
            self.acks.notify_all();
        }
        if s.active && acked >= s.base {
            let acked = s.acked;
            s.notes.acknowledged(acked);
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
    fn drop_log(&self, s: &mut LogState) -> Vec<Held> {
        s.active = false;
        s.events.clear();
        self.news.notify_all();
        self.acks.notify_all();
        Self::to_limbo(s)
    }

    /// Moves the held space to limbo; returns what finished its time there.
    fn to_limbo(s: &mut LogState) -> Vec<Held> {
        let now = Instant::now();
        let held: Vec<_> = s.held.drain(..).map(|(_, r)| (now, r)).collect();
        s.limbo.extend(held);
        Self::out_of_limbo(s)
    }

    fn out_of_limbo(s: &mut LogState) -> Vec<Held> {
        let now = Instant::now();
        let (done, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut s.limbo)
            .into_iter()
            .partition(|(since, _)| now.duration_since(*since) >= LIMBO);
        s.limbo = wait;
        done.into_iter().map(|(_, h)| h).collect()
    }

    /// Keeps `space`, which a node may still touch (its event went unacknowledged),
    /// unused until `LIMBO` passes.
    pub fn hold_in_limbo(&self, space: ReplicaAlloc) {
        let mut s = self.lock();
        let held = Held {
            _space: space,
            fallback: None,
        };
        s.limbo.push((Instant::now(), held));
        let released = Self::out_of_limbo(&mut s);
        drop(s);
        drop(released);
    }
}

/// About how many bytes `e` takes on the wire.
fn encoded_size(e: &CatalogEvent) -> usize {
    match e {
        CatalogEvent::Free(_) | CatalogEvent::Offload(_) => 9,
        CatalogEvent::Unnote { .. } => 13,
        CatalogEvent::Load { key, pieces, .. } => key.len() + 20 + 16 * pieces.len(),
        CatalogEvent::Forget { key, .. } | CatalogEvent::Keep(key) => key.len() + 32,
        CatalogEvent::Commit(entry) => entry.wire_size(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn no_segment() -> SegmentInfo {
        SegmentInfo {
            name: "s".into(),
            base: 0,
            size: 0,
        }
    }

    #[test]
    fn nothing_is_recorded_until_a_node_follows() {
        let log = SegmentLog::default();
        assert_eq!(log.record(|| CatalogEvent::Free(1)), None);
        assert_eq!(log.head(), None);
        let base = log.restart(0, NoteRing::default(), &no_segment());
        assert_eq!(log.record(|| CatalogEvent::Free(64)), Some(base + 1));
        let (last, events) = log.poll(base, Duration::ZERO, 10);
        assert_eq!((last, events), (base + 1, vec![CatalogEvent::Free(64)]));
        assert!(log.follows(last));
        assert!(!log.follows(last + 1));
    }

    #[test]
    fn a_waiting_put_returns_once_the_node_acknowledges() {
        let log = Arc::new(SegmentLog::default());
        let base = log.restart(0, NoteRing::default(), &no_segment());
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
    fn a_put_waiting_on_its_events_wakes_a_waiting_poll() {
        // Polls wait far longer than the put does: only the put can end them early.
        const LONG: Duration = Duration::from_secs(120);
        let log = Arc::new(SegmentLog::default());
        let base = log.restart(0, NoteRing::default(), &no_segment());
        let node = {
            let log = log.clone();
            std::thread::spawn(move || {
                let mut acked = base;
                // A poll returns what was recorded when it began or woke: three at most.
                for _ in 0..3 {
                    let (last, events) = log.poll(acked, LONG, 10);
                    acked = last;
                    if events.contains(&CatalogEvent::Free(2)) {
                        break;
                    }
                }
                log.poll(acked, Duration::ZERO, 10);
            })
        };
        let mut last = base;
        for i in 0..3 {
            last = log.record(|| CatalogEvent::Free(i)).unwrap();
        }
        assert!(log.wait_acked(last, LONG));
        node.join().unwrap();
    }

    #[test]
    fn a_silent_node_loses_its_log_and_puts_stop_waiting() {
        let log = SegmentLog::default();
        log.restart(0, NoteRing::default(), &no_segment());
        let seq = log.record(|| CatalogEvent::Free(0)).unwrap();
        assert!(!log.wait_acked(seq, Duration::from_millis(1)));
        assert_eq!(log.head(), None);
        assert!(!log.follows(seq));
    }
}
