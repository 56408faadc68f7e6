//! Which slots of a node's note ring (see `protocol::note`) are free, lent to a put,
//! or waiting for the node to clear them; no I/O: the segment log drives it under its
//! lock.
//!
//! Slots are lent only while the node follows the current epoch. Before, it may lack
//! the epoch's key (a reset's answer lost), and a note it cannot open covers nothing;
//! and it follows a new epoch only after reading the old epoch's notes into its
//! catalog, so a note of an object committed without waiting is never overwritten
//! before the node read it. A slot goes back to the free list only once no live note
//! can be in it:
//!
//! - consumed in this epoch (its commit recorded, or its put dropped by a writer that
//!   is done): when the node acknowledges the `Unnote` that clears it;
//! - consumed in an epoch that ended: at once (lending waits for the node anyway);
//! - lent to a writer that may still be writing (an abandoned put): after a quarantine
//!   as long as the space of such a put's object gets (its late note is refused by the
//!   node, which saw the lend consumed; the quarantine keeps it from overwriting a
//!   live note of a later lend), also across a drop and remount of the segment
//!   (`fence`).

use std::collections::VecDeque;
use std::time::Instant;

use crate::protocol::{NoteKey, NoteRing, SegmentInfo, NOTE_KEY_LEN};

/// The most slots a ring may have.
pub const MAX_SLOTS: u32 = 1 << 16;

#[derive(Default)]
pub struct NoteSlots {
    /// The node's ring (no slots: none, or not announced yet).
    ring: NoteRing,
    /// This epoch's sealing key.
    key: NoteKey,
    free: Vec<u32>,
    /// Slots whose `Unnote` (by its sequence number) the node has yet to acknowledge.
    clearing: VecDeque<(u64, u32)>,
    /// Slots a writer may still write into, until their time.
    quarantined: Vec<(Instant, u32)>,
    /// The node has this epoch's key (it follows the epoch): only then can a note
    /// sealed with it cover a put.
    key_delivered: bool,
    /// Slot addresses a writer of an earlier mount may still write into, until their
    /// time: quarantined when the ring is announced.
    fences: Vec<(u64, Instant)>,
}

/// A slot lent to a put: where its note goes, and the lend's number.
pub type Lent = crate::protocol::NotePlace;

impl NoteSlots {
    /// Takes the ring a node announced, once: a ring outside the node's segment and of
    /// at most `MAX_SLOTS` slots (a node's ring does not move while it lives).
    pub fn announce(&mut self, ring: NoteRing, segment: &SegmentInfo) {
        if self.ring.slots > 0 || ring.slots == 0 || ring.slots > MAX_SLOTS {
            return;
        }
        let end = ring.addr.checked_add(ring.bytes());
        let seg_end = segment.base.saturating_add(segment.size);
        let apart = end.is_some_and(|end| end <= segment.base || ring.addr >= seg_end);
        if !apart {
            log::warn!(
                "segment {}: its note ring overlaps it; not used",
                segment.name
            );
            return;
        }
        self.ring = ring;
        let fences = std::mem::take(&mut self.fences);
        for slot in (0..ring.slots).rev() {
            let fence = fences
                .iter()
                .find(|(addr, _)| *addr == ring.slot_addr(slot));
            match fence {
                Some((_, until)) => self.quarantined.push((*until, slot)),
                None => self.free.push(slot),
            }
        }
    }

    /// Keeps the slots at these addresses from being lent before their time, once the
    /// ring is announced (a writer of the segment's earlier mount may write there).
    pub fn fence(&mut self, fences: Vec<(u64, Instant)>) {
        self.fences = fences;
    }

    /// A new epoch: a new key, and no lending until the node has it.
    pub fn new_epoch(&mut self) {
        let words = (0..NOTE_KEY_LEN / 8).flat_map(|_| crate::sys::random_u64().to_le_bytes());
        for (k, b) in self.key.iter_mut().zip(words) {
            *k = b;
        }
        self.free
            .extend(self.clearing.drain(..).map(|(_, slot)| slot));
        self.key_delivered = false;
    }

    /// The key notes are sealed with now, if there is a ring.
    pub fn key(&self) -> Option<NoteKey> {
        (self.ring.slots > 0).then_some(self.key)
    }

    /// The ring, if any.
    pub fn ring(&self) -> Option<NoteRing> {
        (self.ring.slots > 0).then_some(self.ring)
    }

    /// Lends a free slot as lend number `lend()`; whether the node should be asked to
    /// clear slots now (a quarter or less is left).
    pub fn lend(
        &mut self,
        epoch: u64,
        lend: impl FnOnce() -> u64,
        now: Instant,
    ) -> (Option<Lent>, bool) {
        if self
            .quarantined
            .first()
            .is_some_and(|(until, _)| *until <= now)
        {
            let (done, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut self.quarantined)
                .into_iter()
                .partition(|(until, _)| *until <= now);
            self.quarantined = wait;
            self.free.extend(done.into_iter().map(|(_, slot)| slot));
        }
        if !self.key_delivered {
            return (None, false);
        }
        let lent = self.free.pop().map(|slot| Lent {
            slot,
            epoch,
            lend: lend(),
        });
        let low = (self.free.len() as u64) * 4 <= self.ring.slots as u64;
        (lent, low && self.ring.slots > 0)
    }

    /// Gives back a slot nothing was written to (the put was refused before it got
    /// its placement).
    pub fn unlend(&mut self, lent: Lent) {
        self.free.push(lent.slot);
    }

    /// A note consumed in the current epoch: free once `seq` (its `Unnote`) is
    /// acknowledged.
    pub fn clear_after(&mut self, seq: u64, slot: u32) {
        self.clearing.push_back((seq, slot));
    }

    /// A note of an ended epoch (or one nobody follows), by a writer that is done:
    /// nothing waits on it (its commit, if any, waits on the node's catalog, or is in
    /// the snapshot of the epoch to come).
    pub fn release_stale(&mut self, slot: u32) {
        self.free.push(slot);
    }

    /// A slot a writer that may still be alive could write into, until `until`.
    pub fn quarantine(&mut self, slot: u32, until: Instant) {
        self.quarantined.push((until, slot));
    }

    /// The node acknowledged everything up to `acked` in the current epoch.
    pub fn acknowledged(&mut self, acked: u64) {
        while self.clearing.front().is_some_and(|(seq, _)| *seq <= acked) {
            self.free
                .extend(self.clearing.pop_front().map(|(_, slot)| slot));
        }
        self.key_delivered = true;
    }

    /// Slots free now (for tests).
    #[cfg(test)]
    pub fn free_count(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment() -> SegmentInfo {
        SegmentInfo {
            name: "s".into(),
            base: 1 << 20,
            size: 1 << 20,
        }
    }

    #[test]
    fn a_ring_inside_the_segment_or_too_large_is_not_used() {
        let mut s = NoteSlots::default();
        s.announce(
            NoteRing {
                addr: (1 << 20) + 4096,
                slots: 8,
            },
            &segment(),
        );
        assert_eq!(s.ring(), None);
        s.announce(
            NoteRing {
                addr: 0,
                slots: MAX_SLOTS + 1,
            },
            &segment(),
        );
        assert_eq!(s.ring(), None);
        s.announce(
            NoteRing {
                addr: 2 << 20,
                slots: 8,
            },
            &segment(),
        );
        assert_eq!(s.free_count(), 8);
    }

    #[test]
    fn slots_come_back_only_when_no_live_note_can_be_in_them() {
        let mut s = NoteSlots::default();
        s.announce(
            NoteRing {
                addr: 2 << 20,
                slots: 4,
            },
            &segment(),
        );
        s.new_epoch();
        let now = Instant::now();
        assert_eq!(
            s.lend(10, || 1, now).0,
            None,
            "not before the node has the key"
        );
        s.acknowledged(10);
        let a = s.lend(10, || 1, now).0.unwrap();
        let b = s.lend(10, || 1, now).0.unwrap();
        let (c, low) = s.lend(10, || 1, now);
        assert!(low, "one of four left");
        s.clear_after(12, a.slot);
        s.quarantine(b.slot, now + std::time::Duration::from_secs(60));
        s.acknowledged(11);
        assert_eq!(s.free_count(), 1);
        s.acknowledged(12);
        assert_eq!(s.free_count(), 2);
        // Consumed, then the epoch ends before the node cleared it: nothing is lent
        // until the node follows the new epoch (having read the old notes).
        s.clear_after(13, c.unwrap().slot);
        s.new_epoch();
        assert_eq!(s.lend(20, || 2, now).0, None, "the node lacks the new key");
        s.acknowledged(20);
        assert_eq!(s.free_count(), 3);
        // The abandoned writer's slot waits out its quarantine.
        s.lend(20, || 3, now + std::time::Duration::from_secs(61));
        assert_eq!(s.free_count(), 3);
    }
}
