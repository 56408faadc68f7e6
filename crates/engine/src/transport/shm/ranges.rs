//! The owner's table of what same-host peers may touch. Every buffer an engine
//! registers is listed here by the engine itself, in a memfd sealed so that only the
//! owner's own mapping can write it; a copier reads the table before it touches
//! anything. A descriptor only says where to look; this table says what is really
//! there. A forged descriptor (buffers pointing at memory the owner never registered,
//! or at a descriptor that is not the buffer's memfd) is thus refused.
//!
//! Layout (little-endian words): `magic, token, seq, count, overflowed`, then `count`
//! entries of five words `addr, len, meta, a, b`, where `meta` holds the backing's
//! kind in its low byte, what peers may do in the next, and the memfd's number in its
//! high half, and `a, b` are the
//! memfd's device and inode, or a device buffer's IPC offset and handle hash. The
//! owner rewrites it under a sequence lock (odd `seq` while writing), so readers
//! never see a half-written table.

use crate::util::sync::Unpoisoned;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::memfd::{self, FileId, Mapping, SharedMemory, Sharing};
use crate::registry::Access;

/// The table memfd's name; a copier checks it on the file it opened.
pub const TABLE_NAME: &str = "mooncake-shm-ranges";
const MAGIC: u64 = u64::from_le_bytes(*b"mcrange1");
/// Virtual size; only the pages the entries use are ever touched.
pub const TABLE_LEN: usize = 1 << 20;
const HEADER_WORDS: usize = 5;
const ENTRY_WORDS: usize = 5;
/// Entries that fit; ranges beyond are left to other paths (`Lookup::Unlisted`).
pub const CAPACITY: usize = (TABLE_LEN / 8 - HEADER_WORDS) / ENTRY_WORDS;
/// Reads retried while the owner is mid-update before giving up on this copy.
const READ_TRIES: usize = 10_000;

const KIND_PLAIN: u64 = 1;
const KIND_MEMFD: u64 = 2;
const KIND_DEVICE: u64 = 3;

/// What backs a registered range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// Engine-allocated host memory: the owner's memfd number and which file it is.
    Memfd {
        /// The memfd's number in the owner's fd table.
        fd: i32,
        /// The file, as the owner's `fstat` saw it.
        id: FileId,
    },
    /// Host memory the application registered: reachable only through process_vm.
    Plain,
    /// Device memory exported for IPC.
    Device {
        /// The buffer's offset in the exported allocation.
        offset: u64,
        /// `handle_hash` of the exported handle.
        handle_hash: u64,
    },
}

/// One registered range as its owner lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// What backs it.
    pub backing: Backing,
    /// What peers may do with it.
    pub access: Access,
}

impl Entry {
    fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr.saturating_add(self.len))
    }

    fn encode(&self) -> [u64; ENTRY_WORDS] {
        let (kind, fd, a, b) = match self.backing {
            Backing::Plain => (KIND_PLAIN, 0, 0, 0),
            Backing::Memfd { fd, id } => (KIND_MEMFD, fd as u32, id.dev, id.ino),
            Backing::Device {
                offset,
                handle_hash,
            } => (KIND_DEVICE, 0, offset, handle_hash),
        };
        let access = match self.access {
            Access::ReadWrite => 0,
            Access::ReadOnly => 1,
            Access::LocalOnly => 2,
        };
        [
            self.addr,
            self.len,
            kind | access << 8 | (fd as u64) << 32,
            a,
            b,
        ]
    }

    fn decode(w: [u64; ENTRY_WORDS]) -> Option<Entry> {
        let backing = match w[2] & 0xff {
            KIND_PLAIN => Backing::Plain,
            KIND_MEMFD => Backing::Memfd {
                fd: (w[2] >> 32) as u32 as i32,
                id: FileId {
                    dev: w[3],
                    ino: w[4],
                },
            },
            KIND_DEVICE => Backing::Device {
                offset: w[3],
                handle_hash: w[4],
            },
            _ => return None,
        };
        let access = match (w[2] >> 8) & 0xff {
            0 => Access::ReadWrite,
            1 => Access::ReadOnly,
            _ => Access::LocalOnly,
        };
        Some(Entry {
            addr: w[0],
            len: w[1],
            backing,
            access,
        })
    }
}

/// FNV-1a of an IPC handle: ties a descriptor's handle to the one the owner exported.
pub fn handle_hash(handle: &[u8]) -> u64 {
    handle.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The words of a table mapping.
///
/// # Safety
/// `map` must be a live mapping of `TABLE_LEN` bytes (page-aligned, so the words are
/// aligned); the table is only ever accessed through atomics.
unsafe fn words(map: *mut u8) -> &'static [AtomicU64] {
    // SAFETY: per the contract, `TABLE_LEN / 8` aligned words, accessed atomically.
    unsafe { std::slice::from_raw_parts(map as *const AtomicU64, TABLE_LEN / 8) }
}

/// The owner's side: lists and withdraws ranges.
pub struct OwnerTable {
    mem: SharedMemory,
    entries: Mutex<Vec<Entry>>,
}

impl OwnerTable {
    /// An empty table stamped with the guard page's `token`.
    pub fn new(token: u64) -> std::io::Result<OwnerTable> {
        let mem = SharedMemory::create(TABLE_NAME, TABLE_LEN, Sharing::OwnerWrites)?;
        let t = OwnerTable {
            mem,
            entries: Mutex::new(Vec::new()),
        };
        let w = t.words();
        w[1].store(token, Ordering::Relaxed);
        w[0].store(MAGIC, Ordering::Release);
        Ok(t)
    }

    fn words(&self) -> &[AtomicU64] {
        // SAFETY: `mem` is our TABLE_LEN-byte mapping, alive as long as `self`.
        unsafe { words(self.mem.ptr()) }
    }

    /// The table's memfd, for the descriptor.
    pub fn fd(&self) -> RawFd {
        self.mem.fd()
    }

    /// Lists a range (registration already refused overlaps, so addresses are unique).
    pub fn insert(&self, entry: Entry) {
        let mut entries = self.entries.locked();
        entries.push(entry);
        self.publish(&entries, entries.len() - 1);
    }

    /// Withdraws the range at `addr`, if listed.
    pub fn remove(&self, addr: u64) {
        let mut entries = self.entries.locked();
        if let Some(at) = entries.iter().position(|e| e.addr == addr) {
            entries.swap_remove(at);
            self.publish(&entries, at);
        }
    }

    /// Rewrites slot `changed` (the shared copy mirrors the first `CAPACITY` entries
    /// slot for slot) and the counts, under the sequence lock; one writer, since
    /// `entries` is held.
    fn publish(&self, entries: &[Entry], changed: usize) {
        let w = self.words();
        let seq = w[2].load(Ordering::Relaxed);
        w[2].store(seq + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        if let Some(e) = entries.get(changed).filter(|_| changed < CAPACITY) {
            let at = HEADER_WORDS + changed * ENTRY_WORDS;
            for (slot, v) in w[at..at + ENTRY_WORDS].iter().zip(e.encode()) {
                slot.store(v, Ordering::Relaxed);
            }
        }
        w[3].store(entries.len().min(CAPACITY) as u64, Ordering::Relaxed);
        w[4].store(u64::from(entries.len() > CAPACITY), Ordering::Relaxed);
        w[2].store(seq + 2, Ordering::Release);
    }
}

/// What the owner's table says about a range.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Listed: the range lies inside this entry.
    Found(Entry),
    /// The owner did not register it.
    Absent,
    /// Not listed, but the table overflowed: the owner may have it; use another path.
    Unlisted,
    /// The owner kept rewriting the table while we read.
    Busy,
}

/// A copier's read-only view of a peer's table.
pub struct TableView {
    map: Mapping,
}

impl TableView {
    /// Opens descriptor `fd` of process `pid` as its table, checking it is one: a
    /// memfd of our table's name, size and seals (so only its owner writes it), stamped
    /// with `token`. The caller still has to check that `pid` is the process it meant.
    pub fn open(pid: u32, fd: i32, token: u64) -> Result<TableView, String> {
        let file = memfd::open_peer(pid, fd, false).map_err(|e| e.to_string())?;
        let name = memfd::name_of(&file).map_err(|e| e.to_string())?;
        let (_, size) = memfd::identify(file.as_raw_fd()).map_err(|e| e.to_string())?;
        let owner_written = memfd::seals(file.as_raw_fd()) & libc::F_SEAL_FUTURE_WRITE as u32 != 0;
        if name != memfd::memfd_link(TABLE_NAME)
            || !owner_written
            || !memfd::holds(file.as_raw_fd(), TABLE_LEN as u64)
        {
            return Err(format!(
                "fd {fd} of process {pid} is not a range table ({name}, {size} bytes)"
            ));
        }
        let map = Mapping::map(file.as_raw_fd(), TABLE_LEN, false).map_err(|e| e.to_string())?;
        let view = TableView { map };
        let w = view.words();
        if w[0].load(Ordering::Acquire) != MAGIC || w[1].load(Ordering::Relaxed) != token {
            return Err(format!(
                "the range table of process {pid} belongs to another engine"
            ));
        }
        Ok(view)
    }

    fn words(&self) -> &[AtomicU64] {
        // SAFETY: `map` is a read-only mapping of TABLE_LEN bytes, alive as long as `self`.
        unsafe { words(self.map.ptr()) }
    }

    /// The owner's entry holding all of `[addr, addr+len)`.
    pub fn find(&self, addr: u64, len: u64) -> Lookup {
        let w = self.words();
        for _ in 0..READ_TRIES {
            let seq = w[2].load(Ordering::Acquire);
            if seq % 2 == 1 {
                std::thread::yield_now();
                continue;
            }
            let count = (w[3].load(Ordering::Relaxed) as usize).min(CAPACITY);
            let found = (0..count).find_map(|i| {
                let at = HEADER_WORDS + i * ENTRY_WORDS;
                let mut e = [0u64; ENTRY_WORDS];
                for (v, slot) in e.iter_mut().zip(&w[at..at + ENTRY_WORDS]) {
                    *v = slot.load(Ordering::Relaxed);
                }
                Entry::decode(e).filter(|e| e.contains(addr, len))
            });
            let overflowed = w[4].load(Ordering::Relaxed) != 0;
            fence(Ordering::Acquire);
            if w[2].load(Ordering::Relaxed) != seq {
                continue;
            }
            return match (found, overflowed) {
                (Some(e), _) => Lookup::Found(e),
                (None, true) => Lookup::Unlisted,
                (None, false) => Lookup::Absent,
            };
        }
        Lookup::Busy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_lists_and_withdraws_and_a_reader_sees_exactly_that() {
        let table = OwnerTable::new(77).unwrap();
        let me = std::process::id();
        let view = TableView::open(me, table.fd(), 77).unwrap();
        assert!(TableView::open(me, table.fd(), 78).is_err(), "wrong token");
        let memfd = Entry {
            addr: 0x10000,
            len: 0x4000,
            backing: Backing::Memfd {
                fd: 9,
                id: FileId { dev: 3, ino: 44 },
            },
            access: Access::ReadWrite,
        };
        let device = Entry {
            addr: 0x90000,
            len: 0x1000,
            backing: Backing::Device {
                offset: 512,
                handle_hash: handle_hash(&[1; 64]),
            },
            access: Access::ReadOnly,
        };
        table.insert(memfd);
        table.insert(device);
        assert_eq!(view.find(0x11000, 0x1000), Lookup::Found(memfd));
        assert_eq!(view.find(0x90000, 0x1000), Lookup::Found(device));
        assert_eq!(view.find(0x13000, 0x1001), Lookup::Absent, "runs past");
        assert_eq!(view.find(0xf000, 0x2000), Lookup::Absent, "starts before");
        assert_eq!(view.find(u64::MAX, 2), Lookup::Absent, "overflows");
        table.remove(0x10000);
        assert_eq!(view.find(0x11000, 0x1000), Lookup::Absent);
        assert_eq!(view.find(0x90000, 1), Lookup::Found(device));
    }

    #[test]
    fn only_a_table_opens_as_one() {
        let table = OwnerTable::new(5).unwrap();
        let other = SharedMemory::create(TABLE_NAME, TABLE_LEN, Sharing::PeersWrite).unwrap();
        let me = std::process::id();
        let err = TableView::open(me, other.fd(), 5).err().unwrap();
        assert!(err.contains("is not a range table"), "{err}");
        assert!(TableView::open(me, table.fd(), 5).is_ok());
    }

    #[test]
    fn an_overflowed_table_says_so_for_what_it_could_not_list() {
        let table = OwnerTable::new(1).unwrap();
        for i in 0..=CAPACITY as u64 {
            let addr = 0x1000 * (i + 1);
            table.insert(Entry {
                addr,
                len: 0x1000,
                backing: Backing::Plain,
                access: Access::LocalOnly,
            });
        }
        let view = TableView::open(std::process::id(), table.fd(), 1).unwrap();
        assert!(matches!(view.find(0x1000, 8), Lookup::Found(_)));
        let last = 0x1000 * (CAPACITY as u64 + 1);
        assert_eq!(view.find(last, 8), Lookup::Unlisted);
        assert_eq!(view.find(0, 8), Lookup::Unlisted);
        // A withdrawal makes room: the unlisted range moves into the freed slot.
        table.remove(0x1000);
        assert!(matches!(view.find(last, 8), Lookup::Found(_)));
        assert_eq!(view.find(0x1000, 8), Lookup::Absent);
    }
}
