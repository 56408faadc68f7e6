//! The view record a coordinator publishes, and how epochs are numbered.
//!
//! An epoch is `generation << 8 | coordinator`: a change of a view of generation `g`
//! publishes generation `g + 1` stamped with the rank that coordinated it. Two ranks
//! that both coordinate a change of the same view (one was slow, the others moved on)
//! therefore never publish the same epoch, so data cells of one can never be read as
//! the other's, and every rank that sees both settles on the same one: the higher.
//!
//! A view also names the epoch it was derived from, and the incarnation of every rank
//! it admits, so a member adopting it knows which join record to reach the newcomer
//! through, whichever of the two lands first.

#![forbid(unsafe_code)]

use super::layout::{Mask, RECORD};
use crate::util::crc32c::crc32c;

const VIEW_MAGIC: u32 = 0x4d43_5657;
const HEAD: usize = 12;
const FIXED: usize = 8 + 8 + 4 + 32 + 32 + 4;
const JOINER: usize = 12;
/// Most ranks one view admits (what fits in a record); more wait for the next view.
pub const MAX_ADMITTED: usize = (RECORD - HEAD - FIXED) / JOINER;

/// The first epoch of a view derived from one at `base`, coordinated by `coordinator`.
pub fn next_epoch(base: u64, coordinator: usize) -> u64 {
    ((base >> 8) + 1) << 8 | (coordinator as u64 & 0xff)
}

/// The epoch users see (`get_current_epoch`): the generation counted from 1, so it
/// starts at 1 and grows by one per change; 0 (an extension not yet admitted) stays 0.
/// Rival views of one generation (see the module comment) show the same number.
pub fn public_epoch(epoch: u64) -> u64 {
    if epoch == 0 {
        0
    } else {
        (epoch >> 8) + 1
    }
}

/// A published membership view.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ViewRecord {
    /// The epoch it starts.
    pub epoch: u64,
    /// The epoch it replaces.
    pub base: u64,
    /// The rank that decided it (and wrote it).
    pub coordinator: usize,
    /// Its active ranks.
    pub mask: Mask,
    /// Members of the base view left out although nobody asked to remove them.
    pub dropped: Mask,
    /// `(rank, incarnation)` of each rank it admits through a join record.
    pub admitted: Vec<(usize, u64)>,
}

impl ViewRecord {
    /// The incarnation this view admits `rank` with, if it admits it.
    pub fn admitted_incarnation(&self, rank: usize) -> Option<u64> {
        self.admitted
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, i)| *i)
    }

    /// The view restricted to ranks `0..size`: a peer's record is data from outside,
    /// and a rank past the group would index past every per-rank table.
    pub fn clipped(mut self, size: usize) -> ViewRecord {
        let within = Mask::first(size);
        let outside = |m: &Mask| m.minus(&within);
        self.mask = self.mask.minus(&outside(&self.mask));
        self.dropped = self.dropped.minus(&outside(&self.dropped));
        self.admitted.retain(|&(r, _)| r < size);
        self
    }

    /// The record's bytes (at most [`RECORD`]); `None` when it admits too many ranks.
    pub fn encode(&self) -> Option<Vec<u8>> {
        if self.admitted.len() > MAX_ADMITTED {
            return None;
        }
        let mut rec = Vec::with_capacity(RECORD);
        rec.extend_from_slice(&VIEW_MAGIC.to_le_bytes());
        rec.extend_from_slice(&[0; 8]);
        rec.extend_from_slice(&self.epoch.to_le_bytes());
        rec.extend_from_slice(&self.base.to_le_bytes());
        rec.extend_from_slice(&(self.coordinator as u32).to_le_bytes());
        for m in [&self.mask, &self.dropped] {
            for w in m.0 {
                rec.extend_from_slice(&w.to_le_bytes());
            }
        }
        rec.extend_from_slice(&(self.admitted.len() as u32).to_le_bytes());
        for &(r, inc) in &self.admitted {
            rec.extend_from_slice(&(r as u32).to_le_bytes());
            rec.extend_from_slice(&inc.to_le_bytes());
        }
        let len = rec.len() as u32;
        rec[8..12].copy_from_slice(&len.to_le_bytes());
        let crc = crc32c(&rec[8..]);
        rec[4..8].copy_from_slice(&crc.to_le_bytes());
        Some(rec)
    }

    /// Decodes a copy of a slot; `None` unless it holds a complete, intact view.
    pub fn decode(slot: &[u8]) -> Option<ViewRecord> {
        let u32_at = |at: usize| -> Option<u32> {
            Some(u32::from_le_bytes(slot.get(at..at + 4)?.try_into().ok()?))
        };
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(slot.get(at..at + 8)?.try_into().ok()?))
        };
        if u32_at(0)? != VIEW_MAGIC {
            return None;
        }
        let len = u32_at(8)? as usize;
        if !(HEAD + FIXED..=RECORD.min(slot.len())).contains(&len)
            || crc32c(&slot[8..len]) != u32_at(4)?
        {
            return None;
        }
        let mask_at = |at: usize| -> Option<Mask> {
            let mut m = Mask::default();
            for (i, w) in m.0.iter_mut().enumerate() {
                *w = u64_at(at + 8 * i)?;
            }
            Some(m)
        };
        let n = u32_at(HEAD + 84)? as usize;
        if n > MAX_ADMITTED || len != HEAD + FIXED + n * JOINER {
            return None;
        }
        let admitted = (0..n)
            .map(|i| {
                let at = HEAD + FIXED + i * JOINER;
                Some((u32_at(at)? as usize, u64_at(at + 4)?))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(ViewRecord {
            epoch: u64_at(HEAD)?,
            base: u64_at(HEAD + 8)?,
            coordinator: u32_at(HEAD + 16)? as usize,
            mask: mask_at(HEAD + 20)?,
            dropped: mask_at(HEAD + 52)?,
            admitted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_round_trip_and_refuse_damage() {
        let v = ViewRecord {
            epoch: next_epoch(1, 2),
            base: 1,
            coordinator: 2,
            mask: Mask::of(&[0, 2, 3, 200]),
            dropped: Mask::of(&[1]),
            admitted: vec![(3, 0xdead_beef_0000_0001), (200, 7)],
        };
        let mut rec = v.encode().unwrap();
        assert!(rec.len() <= RECORD);
        assert_eq!(ViewRecord::decode(&rec), Some(v.clone()));
        assert_eq!(v.admitted_incarnation(200), Some(7));
        assert_eq!(v.admitted_incarnation(0), None);
        rec[30] ^= 1;
        assert_eq!(ViewRecord::decode(&rec), None, "damaged");
        let too_many = ViewRecord {
            admitted: vec![(1, 1); MAX_ADMITTED + 1],
            ..v
        };
        assert!(too_many.encode().is_none());
        const { assert!(MAX_ADMITTED >= 8) };
    }

    #[test]
    fn epochs_of_rival_coordinators_differ_and_keep_increasing() {
        let base = next_epoch(1, 0);
        assert!(base > 1);
        let (a, b) = (next_epoch(base, 1), next_epoch(base, 3));
        assert_ne!(a, b);
        assert!(a > base && b > base);
        // A later generation outranks either rival, whoever coordinates it.
        assert!(next_epoch(a, 0) > b);
    }

    #[test]
    fn users_see_a_consecutive_epoch_count() {
        assert_eq!(public_epoch(0), 0, "extension before admission");
        assert_eq!(public_epoch(1), 1, "start");
        let first = next_epoch(1, 0);
        assert_eq!(public_epoch(first), 2);
        assert_eq!(public_epoch(next_epoch(1, 3)), 2, "rivals share a number");
        assert_eq!(public_epoch(next_epoch(first, 2)), 3);
    }

    #[test]
    fn consecutive_generations_use_different_receive_sets() {
        let l = crate::layout::Layout {
            ranks: 4,
            cells: 2,
            cell_bytes: 4096,
        };
        // Rank 0 coordinates most changes: the set must follow the generation, not
        // the coordinator byte.
        let mut e = 1;
        for _ in 0..4 {
            let next = next_epoch(e, 0);
            assert_ne!(
                l.recv_cell(1, 0, e),
                l.recv_cell(1, 0, next),
                "{e} -> {next}"
            );
            e = next;
        }
        assert_ne!(l.recv_cell(1, 0, 1), l.recv_cell(1, 0, next_epoch(1, 1)));
    }

    #[test]
    fn clipping_drops_ranks_past_the_group() {
        let v = ViewRecord {
            epoch: next_epoch(1, 0),
            base: 1,
            coordinator: 0,
            mask: Mask::of(&[0, 1, 5, 200]),
            dropped: Mask::of(&[2, 9]),
            admitted: vec![(1, 3), (200, 7)],
        }
        .clipped(4);
        assert_eq!(v.mask.ranks(), vec![0, 1]);
        assert_eq!(v.dropped.ranks(), vec![2]);
        assert_eq!(v.admitted, vec![(1, 3)]);
    }
}
