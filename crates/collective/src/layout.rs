//! Where everything lives in a rank's registered buffer, and the self-checking
//! records peers write into it.
//!
//! Every write a peer makes is stamped and checksummed: a data cell carries the
//! membership epoch, its message number on that (sender, receiver) channel, the
//! collective it belongs to, and a CRC-32C over the payload and the stamp; a control
//! record carries a CRC over its body. A reader accepts a cell only when the stamp is
//! the one it expects and the CRC matches, so a write from an older epoch, a late
//! duplicate, or one still landing (torn) is never taken for data. Consecutive epochs
//! receive into alternate sets of cells, so a previous epoch's write landing late does
//! not even overwrite a current cell (which would cost the current operation its data).

use crate::util::crc32c::{crc32c, crc32c_append};

/// Most ranks a group can have (the width of [`Mask`]).
pub const MAX_RANKS: usize = 256;
/// Bytes of a data cell's stamp, ahead of its payload.
pub const CELL_HEADER: usize = 48;
/// Bytes of one control record slot.
pub const RECORD: usize = 256;
const CELL_MAGIC: u32 = 0x4d43_5047;
/// Sets of receive cells, used by epochs in turn (see [`Layout::recv_cell`]).
pub const RECV_SETS: usize = 2;
const RECORD_MAGIC: u32 = 0x4d43_5052;

/// A set of ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mask(pub [u64; MAX_RANKS / 64]);

impl Mask {
    /// The ranks `0..n`.
    pub fn first(n: usize) -> Mask {
        let mut m = Mask::default();
        for r in 0..n.min(MAX_RANKS) {
            m.set(r);
        }
        m
    }
    /// Adds `r`.
    pub fn set(&mut self, r: usize) {
        if r < MAX_RANKS {
            self.0[r / 64] |= 1 << (r % 64);
        }
    }
    /// Removes `r`.
    pub fn clear(&mut self, r: usize) {
        if r < MAX_RANKS {
            self.0[r / 64] &= !(1 << (r % 64));
        }
    }
    /// Whether `r` is in the set.
    pub fn has(&self, r: usize) -> bool {
        r < MAX_RANKS && self.0[r / 64] & (1 << (r % 64)) != 0
    }
    /// Ranks in ascending order.
    pub fn ranks(&self) -> Vec<usize> {
        (0..MAX_RANKS).filter(|&r| self.has(r)).collect()
    }
    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }
    /// Ranks in either set.
    pub fn union(&self, o: &Mask) -> Mask {
        Mask(std::array::from_fn(|i| self.0[i] | o.0[i]))
    }
    /// Ranks in `self` but not in `o`.
    pub fn minus(&self, o: &Mask) -> Mask {
        Mask(std::array::from_fn(|i| self.0[i] & !o.0[i]))
    }
    /// The set of `ranks`.
    pub fn of(ranks: &[usize]) -> Mask {
        let mut m = Mask::default();
        for &r in ranks {
            m.set(r);
        }
        m
    }
    fn put(&self, out: &mut Vec<u8>) {
        for w in self.0 {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
    fn get(bytes: &[u8]) -> Mask {
        Mask(std::array::from_fn(|i| le64(bytes, i * 8)))
    }
}

fn le64(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

fn le32(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u32::from_le_bytes)
}

/// Offsets of the regions of one rank's buffer. Every rank of a group uses the same
/// layout (peers compute where to write from it), so its parameters travel in the
/// rank's address and a mismatch is refused at connect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Ranks the buffer has room for.
    pub ranks: usize,
    /// Cells per (sender, receiver) channel: how many messages may be in flight.
    pub cells: usize,
    /// Bytes per cell, stamp included.
    pub cell_bytes: usize,
}

fn align(v: usize) -> usize {
    v.div_ceil(4096) * 4096
}

impl Layout {
    /// Payload bytes a cell carries (whole 8-byte words, so no element straddles two).
    pub fn payload(&self) -> usize {
        (self.cell_bytes - CELL_HEADER) / 8 * 8
    }
    /// The credit word `src` writes: how many of our messages it has consumed.
    pub fn credit(&self, src: usize) -> usize {
        src * 8
    }
    fn control(&self) -> usize {
        align(self.ranks * 8)
    }
    /// `src`'s announcement that it starts a membership change.
    pub fn announce(&self, src: usize) -> usize {
        self.control() + src * RECORD
    }
    /// `src`'s report to us as coordinator of a membership change.
    pub fn sync(&self, src: usize) -> usize {
        self.control() + (self.ranks + src) * RECORD
    }
    /// The view `src` published as coordinator.
    pub fn view(&self, src: usize) -> usize {
        self.control() + (2 * self.ranks + src) * RECORD
    }
    /// Where a process taking rank `src` says how to reach it.
    pub fn join(&self, src: usize) -> usize {
        self.control() + (3 * self.ranks + src) * RECORD
    }
    /// Our staging copy of the record we are writing to `dst`.
    pub fn record_stage(&self, dst: usize) -> usize {
        self.control() + (4 * self.ranks + dst) * RECORD
    }
    /// Our staging copy of the credit word we are writing to `dst`.
    pub fn credit_stage(&self, dst: usize) -> usize {
        self.control() + 5 * self.ranks * RECORD + dst * 8
    }
    fn data(&self) -> usize {
        align(self.control() + 5 * self.ranks * RECORD + self.ranks * 8)
    }
    /// Cell `k` of the channel from `src` to us in `epoch`. Consecutive epochs use
    /// different sets of cells, so a write of the previous epoch still landing (a TCP
    /// write its sender gave up on, a copier resumed late) cannot overwrite a cell of
    /// the current one; it lands in the idle set, where its stamp keeps it unread.
    pub fn recv_cell(&self, src: usize, k: usize, epoch: u64) -> usize {
        let set = ((epoch >> 8) % RECV_SETS as u64) as usize;
        self.data() + ((set * self.ranks + src) * self.cells + k) * self.cell_bytes
    }
    /// Our staging copy of cell `k` of the channel to `dst`.
    pub fn send_cell(&self, dst: usize, k: usize) -> usize {
        self.data() + ((RECV_SETS * self.ranks + dst) * self.cells + k) * self.cell_bytes
    }
    /// Bytes of the whole buffer.
    pub fn total(&self) -> usize {
        self.data() + (RECV_SETS + 1) * self.ranks * self.cells * self.cell_bytes
    }
}

/// The stamp of one data cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CellStamp {
    /// Membership epoch the message was sent in.
    pub epoch: u64,
    /// Message number on its channel within the epoch, from 1.
    pub msg: u64,
    /// Which operation: `(sequence << 8) | kind`.
    pub tag: u64,
    /// Payload bytes in this cell.
    pub len: usize,
    /// Bytes of the whole message this cell is part of.
    pub total: u64,
}

/// Writes a cell (stamp, payload, CRC) into `cell`, which holds at least
/// `CELL_HEADER + payload.len()` bytes.
pub fn encode_cell(cell: &mut [u8], stamp: &CellStamp, payload: &[u8]) {
    cell[0..4].copy_from_slice(&CELL_MAGIC.to_le_bytes());
    cell[8..16].copy_from_slice(&stamp.epoch.to_le_bytes());
    cell[16..24].copy_from_slice(&stamp.msg.to_le_bytes());
    cell[24..32].copy_from_slice(&stamp.tag.to_le_bytes());
    cell[32..40].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    cell[40..48].copy_from_slice(&stamp.total.to_le_bytes());
    cell[CELL_HEADER..CELL_HEADER + payload.len()].copy_from_slice(payload);
    let crc = crc32c_append(
        crc32c(&cell[CELL_HEADER..CELL_HEADER + payload.len()]),
        &cell[8..CELL_HEADER],
    );
    cell[4..8].copy_from_slice(&crc.to_le_bytes());
}

/// Writes only the stamp of a cell whose payload travels separately (straight from
/// the caller's memory, see `channel`), given `payload_crc`, the [`crc32c`] of its
/// `len` payload bytes: the cell's CRC covers payload then stamp, so the receiver
/// checks it exactly as a cell from [`encode_cell`], and a payload sent to several
/// peers, or whose CRC was taken while it was produced, is not read again for it.
pub fn encode_cell_header(header: &mut [u8; CELL_HEADER], stamp: &CellStamp, payload_crc: u32) {
    header[0..4].copy_from_slice(&CELL_MAGIC.to_le_bytes());
    header[8..16].copy_from_slice(&stamp.epoch.to_le_bytes());
    header[16..24].copy_from_slice(&stamp.msg.to_le_bytes());
    header[24..32].copy_from_slice(&stamp.tag.to_le_bytes());
    header[32..40].copy_from_slice(&(stamp.len as u64).to_le_bytes());
    header[40..48].copy_from_slice(&stamp.total.to_le_bytes());
    let crc = crc32c_append(payload_crc, &header[8..]);
    header[4..8].copy_from_slice(&crc.to_le_bytes());
}

/// A cell's stamp as read once, before its payload is checked against it.
#[derive(Clone, Copy, Debug)]
pub struct CellHead {
    /// The stamp (trustworthy only once [`payload_matches`](Self::payload_matches)).
    pub stamp: CellStamp,
    /// The CRC the writer recorded.
    crc: u32,
    /// The stamp's bytes as read, which the CRC covers after the payload.
    stamp_bytes: [u8; CELL_HEADER - 8],
}

impl CellHead {
    /// Whether `payload` (the cell's payload, or a copy of it) completes the CRC: the
    /// cell was whole and is the one the stamp describes.
    pub fn payload_matches(&self, payload: &[u8]) -> bool {
        self.payload_crc_matches(crc32c(payload))
    }

    /// [`payload_matches`](Self::payload_matches) for a payload whose CRC32C is
    /// already known (taken by the copy that moved it).
    pub fn payload_crc_matches(&self, payload_crc: u32) -> bool {
        crc32c_append(payload_crc, &self.stamp_bytes) == self.crc
    }
}

/// Reads the stamp of a cell that may be changing under us, all of it once (the CRC is
/// then computed over exactly what was parsed): `None` unless the magic, the epoch and
/// the message number are the expected ones and the length fits. The payload is not
/// checked yet (see [`CellHead::payload_matches`]).
///
/// # Safety
/// `cell` must be readable for `CELL_HEADER` bytes.
pub unsafe fn read_cell_head(
    cell: *const u8,
    cap: usize,
    epoch: u64,
    msg: u64,
) -> Option<CellHead> {
    // SAFETY: the caller guarantees the header is readable; volatile because a peer
    // writes it behind the compiler's back.
    let word = |at: usize| unsafe { std::ptr::read_volatile(cell.add(at).cast::<u64>()) };
    let head = word(0);
    if head as u32 != CELL_MAGIC || word(8) != epoch || word(16) != msg {
        return None;
    }
    let mut stamp = [0u8; CELL_HEADER - 8];
    for (i, chunk) in stamp.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(8 + 8 * i).to_le_bytes());
    }
    let field = |at: usize| le64(&stamp, at - 8);
    let len = usize::try_from(field(32)).ok().filter(|&l| l <= cap)?;
    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
    Some(CellHead {
        stamp: CellStamp {
            epoch: field(8),
            msg: field(16),
            tag: field(24),
            len,
            total: field(40),
        },
        crc: (head >> 32) as u32,
        stamp_bytes: stamp,
    })
}

/// Kinds of control records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// "I start a membership change of epoch `base`."
    Announce = 1,
    /// "Coordinator, here is what I know for the change of epoch `base`."
    Sync = 2,
    // 3 was the view record before views got their own format (`super::view`).
    /// "Rank r is now reachable here."
    Join = 4,
}

/// A proposal (announcement or sync report): what its writer wants changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Proposal {
    /// The epoch the change starts from.
    pub base: u64,
    /// Ranks the writer believes failed.
    pub suspects: Mask,
    /// Ranks to activate.
    pub add: Mask,
    /// Ranks to deactivate.
    pub remove: Mask,
    /// Collective exchanges the writer had begun in epoch `base` when it wrote (members
    /// run them in the same order): tells a member blocked in one whether the writer
    /// is past it.
    pub exchanges: u64,
}

/// A process's claim of a rank: where to reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JoinRecord {
    /// Random per process: tells a replacement from the process it replaces.
    pub incarnation: u64,
    /// Address of its group buffer.
    pub addr: u64,
    /// Its engine's segment name.
    pub segment: String,
}

fn seal(kind: RecordKind, body: &[u8]) -> Vec<u8> {
    let mut rec = Vec::with_capacity(16 + body.len());
    rec.extend_from_slice(&RECORD_MAGIC.to_le_bytes());
    rec.extend_from_slice(&[0; 4]);
    rec.extend_from_slice(&(kind as u32).to_le_bytes());
    rec.extend_from_slice(&((16 + body.len()) as u32).to_le_bytes());
    rec.extend_from_slice(body);
    let crc = crc32c(&rec[8..]);
    rec[4..8].copy_from_slice(&crc.to_le_bytes());
    rec
}

/// The body of a record of `kind` in `slot` (a copy of one slot), if it is complete.
fn open(slot: &[u8], kind: RecordKind) -> Option<&[u8]> {
    if le32(slot, 0) != RECORD_MAGIC || le32(slot, 8) != kind as u32 {
        return None;
    }
    let len = le32(slot, 12) as usize;
    if !(16..=RECORD).contains(&len) || len > slot.len() || crc32c(&slot[8..len]) != le32(slot, 4) {
        return None;
    }
    Some(&slot[16..len])
}

/// Encodes a proposal as a record of `kind` (announce or sync).
pub fn encode_proposal(kind: RecordKind, p: &Proposal) -> Vec<u8> {
    let mut body = p.base.to_le_bytes().to_vec();
    p.suspects.put(&mut body);
    p.add.put(&mut body);
    p.remove.put(&mut body);
    body.extend_from_slice(&p.exchanges.to_le_bytes());
    seal(kind, &body)
}

/// Decodes a proposal record of `kind`.
pub fn decode_proposal(slot: &[u8], kind: RecordKind) -> Option<Proposal> {
    let b = open(slot, kind)?;
    (b.len() == 8 + 96 + 8).then(|| Proposal {
        base: le64(b, 0),
        suspects: Mask::get(&b[8..40]),
        add: Mask::get(&b[40..72]),
        remove: Mask::get(&b[72..104]),
        exchanges: le64(b, 104),
    })
}

/// Longest segment name a join record carries.
pub const MAX_SEGMENT_NAME: usize = RECORD - 16 - 20;

/// Encodes a join record; `None` when the segment name does not fit.
pub fn encode_join(j: &JoinRecord) -> Option<Vec<u8>> {
    if j.segment.len() > MAX_SEGMENT_NAME {
        return None;
    }
    let mut body = j.incarnation.to_le_bytes().to_vec();
    body.extend_from_slice(&j.addr.to_le_bytes());
    body.extend_from_slice(&(j.segment.len() as u32).to_le_bytes());
    body.extend_from_slice(j.segment.as_bytes());
    Some(seal(RecordKind::Join, &body))
}

/// Decodes a join record.
pub fn decode_join(slot: &[u8]) -> Option<JoinRecord> {
    let b = open(slot, RecordKind::Join)?;
    let n = le32(b, 16) as usize;
    let name = b.get(20..20 + n)?;
    Some(JoinRecord {
        incarnation: le64(b, 0),
        addr: le64(b, 8),
        segment: String::from_utf8(name.to_vec()).ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole check a receiver makes on a cell in place.
    fn check(cell: &[u8], epoch: u64, msg: u64) -> Option<CellStamp> {
        // SAFETY: `cell` holds CELL_HEADER bytes and more.
        let head = unsafe { read_cell_head(cell.as_ptr(), cell.len() - CELL_HEADER, epoch, msg) }?;
        let payload = &cell[CELL_HEADER..CELL_HEADER + head.stamp.len];
        head.payload_matches(payload).then_some(head.stamp)
    }

    #[test]
    fn cells_are_accepted_only_complete_and_current() {
        let mut cell = vec![0u8; CELL_HEADER + 64];
        let stamp = CellStamp {
            epoch: 3,
            msg: 7,
            tag: 0x105,
            len: 40,
            total: 40,
        };
        encode_cell(&mut cell, &stamp, &[9u8; 40]);
        assert_eq!(check(&cell, 3, 7), Some(stamp));
        assert_eq!(check(&cell, 2, 7), None, "older epoch");
        assert_eq!(check(&cell, 3, 8), None, "other message");
        let mut header = [0u8; CELL_HEADER];
        encode_cell_header(&mut header, &stamp, crc32c(&[9u8; 40]));
        assert_eq!(
            header[..],
            cell[..CELL_HEADER],
            "a split cell checks the same"
        );
        cell[CELL_HEADER + 39] = 0; // the payload's last bytes not landed yet
        assert_eq!(check(&cell, 3, 7), None, "torn");
        cell[CELL_HEADER + 39] = 9;
        cell[24] ^= 1; // the stamp itself half-written
        assert_eq!(check(&cell, 3, 7), None, "torn stamp");
    }

    #[test]
    fn records_round_trip_and_refuse_damage() {
        let p = Proposal {
            base: 4,
            suspects: Mask::of(&[2]),
            add: Mask::of(&[5, 200]),
            remove: Mask::default(),
            exchanges: 9,
        };
        let mut slot = encode_proposal(RecordKind::Sync, &p);
        assert_eq!(decode_proposal(&slot, RecordKind::Sync), Some(p));
        assert_eq!(decode_proposal(&slot, RecordKind::Announce), None);
        slot[20] ^= 1;
        assert_eq!(decode_proposal(&slot, RecordKind::Sync), None);
        let j = JoinRecord {
            incarnation: 77,
            addr: 0x1000,
            segment: "127.0.0.1:5555".into(),
        };
        assert_eq!(decode_join(&encode_join(&j).unwrap()), Some(j));
        let l = Layout {
            ranks: 4,
            cells: 2,
            cell_bytes: 4096,
        };
        assert!(l.total() > 4 * 2 * 4096 * 3);
        // Sets follow the generation (epoch >> 8), not the coordinator byte.
        assert_ne!(
            l.recv_cell(1, 0, 1),
            l.recv_cell(1, 0, 0x100),
            "consecutive generations alternate sets"
        );
        assert_eq!(l.recv_cell(1, 0, 0x100), l.recv_cell(1, 0, 0x103));
        assert_eq!(l.recv_cell(1, 0, 1), l.recv_cell(1, 0, 0x200));
        assert!(l.recv_cell(3, 1, 6) + 4096 <= l.send_cell(0, 0));
        assert!(l.send_cell(3, 1) + 4096 <= l.total());
    }
}
