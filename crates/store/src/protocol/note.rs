//! Commit notes: a node's catalog record of one object piece, sealed by the master and
//! written by the writer into a slot of the node's note ring together with the bytes.
//!
//! A put is acknowledged only once the node holding each piece could name it after a
//! master restart. Waiting for the node's catalog thread to apply the commit costs a
//! chain of thread wake-ups on every put; a note in the node's memory, landed with the
//! data before `PutEnd`, gives the same guarantee with no wait. The node reads its
//! ring only when it would otherwise lose track: at a log reset and at a remount.
//!
//! The master seals each note with a key it hands the node over the catalog poll (one
//! per log epoch), so no other member can forge a catalog record into a node's ring:
//! what a note names (key, version, checksum, pieces) is what the master allocated, and
//! the checksum is the writer's, declared before the seal. Each lend of a slot has its
//! own number, sealed too; the node remembers, per slot, the highest lend whose note
//! was consumed (`CatalogEvent::Unnote`), so a consumed note written again (by a late
//! writer, or replayed by another member) names nothing.

use super::{CatalogEntry, Reader, Writer};
use crate::util::hmac;

/// Bytes of one ring slot.
pub const NOTE_SLOT: usize = 512;
/// Bytes of the key notes are sealed with.
pub const NOTE_KEY_LEN: usize = 32;
/// The key notes of one log epoch are sealed with.
pub type NoteKey = [u8; NOTE_KEY_LEN];

/// Marks a slot holding a note (zero: empty or consumed).
const MAGIC: u32 = 0x314e_434d; // "MCN1" little-endian
/// Bytes of the seal kept (a truncated HMAC-SHA256).
const SEAL_LEN: usize = 16;
/// magic, epoch, slot, lend, body length.
const HEADER_LEN: usize = 4 + 8 + 4 + 8 + 2;

/// A node's note ring: `slots` slots of `NOTE_SLOT` bytes from `addr`, in memory
/// registered with its engine beside (not inside) the segment it lends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoteRing {
    /// Address of slot 0.
    pub addr: u64,
    /// Slots (0: no ring).
    pub slots: u32,
}

impl NoteRing {
    /// The address of `slot`.
    pub fn slot_addr(&self, slot: u32) -> u64 {
        self.addr + slot as u64 * NOTE_SLOT as u64
    }

    /// Its bytes.
    pub fn bytes(&self) -> u64 {
        self.slots as u64 * NOTE_SLOT as u64
    }
}

/// A note a writer puts beside the object's bytes, in the same engine batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoteWrite {
    /// The segment whose node keeps the note.
    pub segment: String,
    /// Where in that node's ring.
    pub addr: u64,
    /// The sealed note.
    pub bytes: Vec<u8>,
}

fn seal_of(key: &NoteKey, sealed: &[u8]) -> [u8; SEAL_LEN] {
    let mut out = [0u8; SEAL_LEN];
    out.copy_from_slice(&hmac::mac(key, sealed)[..SEAL_LEN]);
    out
}

/// Where a note goes and which lend of its slot it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotePlace {
    /// The log epoch whose key seals it.
    pub epoch: u64,
    /// The ring slot.
    pub slot: u32,
    /// The lend's number: above every earlier lend of any slot of this ring.
    pub lend: u64,
}

/// The note of `entry` at `place`; None when it does not fit a slot.
pub fn seal(key: &NoteKey, place: NotePlace, entry: &CatalogEntry) -> Option<Vec<u8>> {
    let mut body = Writer::new();
    super::wire::encode_entry(&mut body, entry);
    let body = body.into_bytes();
    if HEADER_LEN + body.len() + SEAL_LEN > NOTE_SLOT {
        return None;
    }
    let mut note = Vec::with_capacity(HEADER_LEN + body.len() + SEAL_LEN);
    note.extend_from_slice(&MAGIC.to_le_bytes());
    note.extend_from_slice(&place.epoch.to_le_bytes());
    note.extend_from_slice(&place.slot.to_le_bytes());
    note.extend_from_slice(&place.lend.to_le_bytes());
    note.extend_from_slice(&(body.len() as u16).to_le_bytes());
    note.extend_from_slice(&body);
    let seal = seal_of(key, &note);
    note.extend_from_slice(&seal);
    Some(note)
}

/// The lend and entry a slot's bytes name, if they are a note of this epoch and slot
/// sealed with `key`.
pub fn open(bytes: &[u8], key: &NoteKey, epoch: u64, slot: u32) -> Option<(u64, CatalogEntry)> {
    let header = bytes.get(..HEADER_LEN)?;
    let word = |at: usize, n: usize| {
        let mut b = [0u8; 8];
        b[..n].copy_from_slice(&header[at..at + n]);
        u64::from_le_bytes(b)
    };
    if word(0, 4) != MAGIC as u64 || word(4, 8) != epoch || word(12, 4) != slot as u64 {
        return None;
    }
    let lend = word(16, 8);
    let body_end = HEADER_LEN + word(24, 2) as usize;
    let seal = bytes.get(body_end..body_end + SEAL_LEN)?;
    if !hmac::equal(&seal_of(key, &bytes[..body_end]), seal) {
        return None;
    }
    let mut r = Reader::new(&bytes[HEADER_LEN..body_end]);
    let entry = super::wire::decode_entry(&mut r).ok()?;
    r.finish().ok()?;
    Some((lend, entry))
}

/// Marks a slot empty (its note consumed): zeroes its magic.
pub fn clear(slot: &mut [u8]) {
    if let Some(m) = slot.get_mut(..4) {
        m.fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Piece, ReplicaDesc};

    fn entry(key: &str) -> CatalogEntry {
        CatalogEntry {
            key: key.into(),
            version: 9,
            size: 4096,
            crc32c: 0xdead_beef,
            hard_pin: false,
            replica: ReplicaDesc {
                pieces: vec![Piece {
                    segment: "10.0.0.1:1234".into(),
                    addr: 0x1000,
                    len: 4096,
                }]
                .into(),
            },
            index: 0,
        }
    }

    #[test]
    fn a_note_opens_only_under_its_key_epoch_and_slot() {
        let key = [7u8; NOTE_KEY_LEN];
        let place = NotePlace {
            epoch: 3,
            slot: 5,
            lend: 40,
        };
        let note = seal(&key, place, &entry("k")).unwrap();
        let mut slot = vec![0u8; NOTE_SLOT];
        slot[..note.len()].copy_from_slice(&note);
        assert_eq!(open(&slot, &key, 3, 5), Some((40, entry("k"))));
        assert_eq!(open(&slot, &[8u8; NOTE_KEY_LEN], 3, 5), None);
        assert_eq!(open(&slot, &key, 4, 5), None);
        assert_eq!(open(&slot, &key, 3, 6), None);
        // Any changed byte (the checksum here) breaks the seal.
        let mut forged = slot.clone();
        forged[HEADER_LEN + 3] ^= 1;
        assert_eq!(open(&forged, &key, 3, 5), None);
        clear(&mut slot);
        assert_eq!(open(&slot, &key, 3, 5), None);
    }

    #[test]
    fn a_note_too_long_for_a_slot_is_refused() {
        let long = "k".repeat(NOTE_SLOT);
        let place = NotePlace {
            epoch: 1,
            slot: 0,
            lend: 1,
        };
        assert!(seal(&[0u8; NOTE_KEY_LEN], place, &entry(&long)).is_none());
        assert!(open(&[0u8; 3], &[0u8; NOTE_KEY_LEN], 1, 0).is_none());
    }
}
