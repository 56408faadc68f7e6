//! A same-host mailbox: one request and one answer at a time between two processes,
//! through a shared memfd, for an RPC connection whose peers share a machine. Handing
//! over a small message costs a store and a load here (a loopback TCP round trip costs
//! ~10 µs on a VM, most of it system calls); a reader that stopped polling sleeps on a
//! futex, and one that went back to its socket is nudged there by the writer.
//!
//! The memfd's owner (the server) offers it over the connection; the peer opens it
//! through `/proc/<pid>/fd/<n>`, checks that it is the file offered (device, inode, a
//! random token the owner wrote) and maps it. Each direction is a slot: a sequence
//! word bumped once per message, the message's length, the reader's state, and a data
//! area of [`CAPACITY`] bytes. Messages strictly alternate (a request, its answer),
//! so a slot is never written while its last message is unread.
//!
//! **Neither side trusts the other's bytes.** A reader loads the length once, bounds it
//! and copies the message out before looking at it, so a writer that keeps scribbling
//! can only corrupt its own request. The other words the peer can write say whether to
//! wake it and how many frames it sent on the socket: a lie there costs the liar its
//! connection, nobody else anything.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::memfd::{self, FileId, Mapping, SharedMemory, Sharing};
use crate::sys;

/// The most bytes one message may take; larger ones travel on the socket.
pub const CAPACITY: usize = 64 << 10;
const MAGIC: u64 = u64::from_le_bytes(*b"MCMBOX01");
/// The header page: magic, token and the two slots' words.
const HEADER: usize = 4096;
const SIZE: usize = HEADER + 2 * CAPACITY;
/// A slot's length word with this bit: no bytes here, the low bits count frames
/// sent on the socket instead.
const ON_SOCKET_BIT: u32 = 1 << 31;

/// What a slot's reader is doing, as its state word says.
const AWAKE: u32 = 0;
const PARKED: u32 = 1;
const ON_SOCKET: u32 = 2;

/// How often a spinning reader asks whether the machine has a CPU to spare.
const SPARE_CPU_CHECK: Duration = Duration::from_micros(10);
/// When a spinning reader first asks (see `Slot::spin`).
const FIRST_SPARE_CPU_CHECK: Duration = Duration::from_micros(2);
/// Polls between two looks at the clock (a look costs ~20 ns, a poll a few).
const POLLS_PER_CLOCK: u32 = 8;

/// One direction's words, on cache lines of their own.
#[repr(C, align(128))]
struct SlotWords {
    seq: AtomicU32,
    len: AtomicU32,
    reader: AtomicU32,
}

#[repr(C)]
struct Header {
    magic: AtomicU64,
    token: [AtomicU64; 2],
    slots: [SlotWords; 2],
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER);

/// The two directions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Client to server.
    Requests = 0,
    /// Server to client.
    Answers = 1,
}

/// Where a mailbox lives, for the peer to open it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Offer {
    /// [`sys::host_id`] of the owner: equal means the peer may open it.
    pub host: String,
    /// The owner's process.
    pub pid: u32,
    /// The memfd's number in the owner's process.
    pub fd: i32,
    /// The memfd's device, as `fstat` says.
    pub dev: u64,
    /// The memfd's inode.
    pub ino: u64,
    /// What the owner wrote into the header.
    pub token: [u64; 2],
}

/// What a slot held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Incoming {
    /// A message, now in the caller's buffer.
    Here,
    /// This many frames went on the socket instead.
    OnSocket(u32),
}

/// What a writer posts.
#[derive(Clone, Copy, Debug)]
pub enum Outgoing<'a> {
    /// A message of at most [`CAPACITY`] bytes.
    Here(&'a [u8]),
    /// Word that this many frames went on the socket.
    OnSocket(u32),
}

/// What the reader was doing when a message was posted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reader {
    /// Polling or parked on the mailbox (woken if parked): nothing more to do.
    Here,
    /// Waiting on the socket: the writer must nudge it there.
    OnSocket,
}

/// One mailbox, either side's. Each side has one writer and one reader per slot, so a
/// mailbox moves between threads but is not shared by them (not `Sync`): two threads
/// posting at once would interleave their bytes.
pub struct Mailbox {
    mapping: Mapping,
    /// The owner's memfd while it is offered.
    offered: Option<OwnedFd>,
    _one_thread_at_a_time: std::marker::PhantomData<std::cell::Cell<()>>,
}

impl Mailbox {
    /// A new mailbox to offer a peer.
    pub fn create() -> io::Result<Mailbox> {
        let shm = SharedMemory::create("mc-rpc-mailbox", SIZE, Sharing::PeersWrite)?;
        let mut token = [0u8; 16];
        sys::fill_random(&mut token)?;
        let (fd, mapping) = shm.into_parts();
        let mailbox = Mailbox {
            mapping,
            offered: Some(fd),
            _one_thread_at_a_time: std::marker::PhantomData,
        };
        let h = mailbox.header();
        h.token[0].store(
            u64::from_le_bytes(token[..8].try_into().expect("8")),
            Ordering::Relaxed,
        );
        h.token[1].store(
            u64::from_le_bytes(token[8..].try_into().expect("8")),
            Ordering::Relaxed,
        );
        // Until the peer shows it attached, the server reads the socket.
        h.slots[Direction::Requests as usize]
            .reader
            .store(ON_SOCKET, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok(mailbox)
    }

    /// How the peer finds this mailbox; None once the descriptor is closed.
    pub fn offer(&self) -> Option<Offer> {
        let fd = self.offered.as_ref()?.as_raw_fd();
        let (FileId { dev, ino }, _) = memfd::identify(fd).ok()?;
        let h = self.header();
        Some(Offer {
            host: sys::host_id(),
            pid: std::process::id(),
            fd,
            dev,
            ino,
            token: [
                h.token[0].load(Ordering::Relaxed),
                h.token[1].load(Ordering::Relaxed),
            ],
        })
    }

    /// Closes the descriptor the offer named (the mapping stays): once the peer has
    /// attached or declined, nobody else needs to open it.
    pub fn close_descriptor(&mut self) {
        self.offered = None;
    }

    /// Opens the mailbox `offer` names, if it is on this host and is what was offered.
    pub fn attach(offer: &Offer) -> io::Result<Mailbox> {
        let refused = |why: &str| io::Error::new(io::ErrorKind::PermissionDenied, why.to_owned());
        if offer.host != sys::host_id() {
            return Err(refused("the mailbox is on another host"));
        }
        let file = memfd::open_peer(offer.pid, offer.fd, true)?;
        let (id, _) = memfd::identify(file.as_raw_fd())?;
        if id
            != (FileId {
                dev: offer.dev,
                ino: offer.ino,
            })
        {
            return Err(refused("the descriptor is not the mailbox offered"));
        }
        if !memfd::holds(file.as_raw_fd(), SIZE as u64) {
            return Err(refused("the mailbox is too small or not sealed"));
        }
        let mailbox = Mailbox {
            mapping: Mapping::map(file.as_raw_fd(), SIZE, true)?,
            offered: None,
            _one_thread_at_a_time: std::marker::PhantomData,
        };
        let h = mailbox.header();
        let magic = h.magic.load(Ordering::Acquire);
        let token = [
            h.token[0].load(Ordering::Relaxed),
            h.token[1].load(Ordering::Relaxed),
        ];
        if magic != MAGIC || token != offer.token {
            return Err(refused("the mailbox's token is not the one offered"));
        }
        Ok(mailbox)
    }

    /// Whether a message of `len` bytes fits a slot.
    pub fn fits(len: usize) -> bool {
        len <= CAPACITY
    }

    fn base(&self) -> *mut u8 {
        self.mapping.ptr()
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is SIZE bytes, page-aligned, and lives as long as `self`;
        // the header's fields are atomics, so the peer's writes are no data race.
        unsafe { &*(self.base() as *const Header) }
    }

    /// One direction.
    pub fn slot(&self, d: Direction) -> Slot<'_> {
        Slot {
            words: &self.header().slots[d as usize],
            // SAFETY: slot areas lie inside the SIZE-byte mapping.
            data: unsafe { self.base().add(HEADER + d as usize * CAPACITY) },
            _mailbox: std::marker::PhantomData,
        }
    }
}

/// One direction of a mailbox.
pub struct Slot<'a> {
    words: &'a SlotWords,
    data: *mut u8,
    _mailbox: std::marker::PhantomData<&'a Mailbox>,
}

impl Slot<'_> {
    /// Posts `msg` (a message must fit: [`Mailbox::fits`]) and wakes the reader if it
    /// is parked here; says whether it waits on the socket instead.
    pub fn post(&self, msg: Outgoing) -> Reader {
        let len = match msg {
            Outgoing::Here(bytes) => {
                assert!(bytes.len() <= CAPACITY, "a mailbox message over capacity");
                // SAFETY: the area is CAPACITY bytes of our mapping; the reader copies
                // it only after the sequence word below says it is complete.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.data, bytes.len()) };
                bytes.len() as u32
            }
            Outgoing::OnSocket(n) => ON_SOCKET_BIT | (n & !ON_SOCKET_BIT),
        };
        self.words.len.store(len, Ordering::Relaxed);
        // SeqCst with the reader's: either it sees this message before parking, or we
        // see it parked (or on its socket) and wake it.
        self.words.seq.fetch_add(1, Ordering::SeqCst);
        match self.words.reader.load(Ordering::SeqCst) {
            PARKED => {
                sys::futex_wake(&self.words.seq);
                Reader::Here
            }
            ON_SOCKET => Reader::OnSocket,
            _ => Reader::Here,
        }
    }

    /// The next message if one came since `seen` (the last sequence taken, updated):
    /// its bytes are copied into `buf`.
    pub fn take(&self, seen: &mut u32, buf: &mut Vec<u8>) -> Option<Incoming> {
        let seq = self.words.seq.load(Ordering::SeqCst);
        if seq == *seen {
            return None;
        }
        *seen = seq;
        let len = self.words.len.load(Ordering::Acquire);
        if len & ON_SOCKET_BIT != 0 {
            return Some(Incoming::OnSocket(len & !ON_SOCKET_BIT));
        }
        // Loaded once and bounded: a peer rewriting it now changes nothing here.
        let len = (len as usize).min(CAPACITY);
        buf.clear();
        buf.reserve(len);
        // SAFETY: `len` bytes lie in the slot's area, and `buf` has room for them. The
        // peer may write them meanwhile (another process: no Rust object aliases them);
        // that can only garble its own message, which is parsed from the copy alone.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data, buf.as_mut_ptr(), len);
            buf.set_len(len);
        }
        Some(Incoming::Here)
    }

    /// Polls for the next message for at most `spin`, only while the machine has a
    /// CPU to spare. None when nothing came.
    pub fn spin(&self, seen: &mut u32, buf: &mut Vec<u8>, spin: Duration) -> Option<Incoming> {
        let started = Instant::now();
        // The first look comes early: a reader that should give its CPU up gives it up
        // before the peer it waits for needs it (with a CPU-bound thread beside them, a
        // later first look cost a put a third more than the TCP path).
        let mut next_look = started + FIRST_SPARE_CPU_CHECK;
        let mut polls = 0u32;
        loop {
            if let Some(m) = self.take(seen, buf) {
                return Some(m);
            }
            polls = polls.wrapping_add(1);
            if polls % POLLS_PER_CLOCK == 0 {
                let now = Instant::now();
                if now - started >= spin {
                    break;
                }
                if now >= next_look {
                    if !sys::cpu_to_spare() {
                        break;
                    }
                    next_look = now + SPARE_CPU_CHECK;
                }
            }
            std::hint::spin_loop();
        }
        None
    }

    /// Sleeps on the slot until the next message, for at most `park`. None when
    /// nothing came.
    pub fn park(&self, seen: &mut u32, buf: &mut Vec<u8>, park: Duration) -> Option<Incoming> {
        let until = Instant::now() + park;
        loop {
            self.words.reader.store(PARKED, Ordering::SeqCst);
            let got = self.take(seen, buf);
            let left = until.saturating_duration_since(Instant::now());
            if got.is_some() || left.is_zero() {
                self.words.reader.store(AWAKE, Ordering::SeqCst);
                return got;
            }
            sys::futex_wait(&self.words.seq, *seen, left);
        }
    }

    /// Marks the reader as waiting on its socket, unless a message came since `seen`:
    /// true when marked (a writer will nudge it there).
    pub fn wait_on_socket(&self, seen: u32) -> bool {
        self.words.reader.store(ON_SOCKET, Ordering::SeqCst);
        if self.words.seq.load(Ordering::SeqCst) != seen {
            self.awake();
            return false;
        }
        true
    }

    /// Whether the reader says it waits on its socket.
    pub fn reader_on_socket(&self) -> bool {
        self.words.reader.load(Ordering::SeqCst) == ON_SOCKET
    }

    /// Whether the reader says it sleeps on the slot.
    #[cfg(test)]
    fn reader_parked(&self) -> bool {
        self.words.reader.load(Ordering::SeqCst) == PARKED
    }

    /// The reader is back from its socket.
    pub fn awake(&self) {
        self.words.reader.store(AWAKE, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Mailbox, Mailbox) {
        let server = Mailbox::create().unwrap();
        let client = Mailbox::attach(&server.offer().unwrap()).unwrap();
        (server, client)
    }

    #[test]
    fn a_request_and_its_answer_cross_and_big_ones_are_marked_for_the_socket() {
        let (server, client) = pair();
        let (mut srv_seen, mut cli_seen) = (0, 0);
        let mut buf = Vec::new();
        let requests = server.slot(Direction::Requests);
        assert_eq!(
            requests.take(&mut srv_seen, &mut buf),
            None,
            "nothing posted"
        );
        // A fresh mailbox's server reads its socket until the client shows up.
        assert_eq!(
            client
                .slot(Direction::Requests)
                .post(Outgoing::Here(b"ping")),
            Reader::OnSocket
        );
        assert_eq!(requests.take(&mut srv_seen, &mut buf), Some(Incoming::Here));
        assert_eq!(buf, b"ping");
        assert_eq!(requests.take(&mut srv_seen, &mut buf), None, "taken once");
        let answers = client.slot(Direction::Answers);
        assert_eq!(
            server.slot(Direction::Answers).post(Outgoing::OnSocket(2)),
            Reader::Here
        );
        assert_eq!(
            answers.take(&mut cli_seen, &mut buf),
            Some(Incoming::OnSocket(2))
        );
        let big = vec![7u8; CAPACITY];
        assert!(Mailbox::fits(big.len()) && !Mailbox::fits(CAPACITY + 1));
        server.slot(Direction::Answers).post(Outgoing::Here(&big));
        assert_eq!(answers.take(&mut cli_seen, &mut buf), Some(Incoming::Here));
        assert_eq!(buf, big);
    }

    #[test]
    fn a_parked_reader_is_woken_and_a_quiet_one_times_out() {
        let (server, client) = pair();
        let mut seen = 0;
        let mut buf = Vec::new();
        let requests = server.slot(Direction::Requests);
        assert_eq!(
            requests.park(&mut seen, &mut buf, Duration::from_millis(5)),
            None
        );
        assert!(!requests.reader_parked(), "awake again after its park");
        let (done, woken) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let mut seen = 0;
            let mut buf = Vec::new();
            // Far longer than the test waits below: only the wake can end it in time.
            let got = server.slot(Direction::Requests).park(
                &mut seen,
                &mut buf,
                Duration::from_secs(600),
            );
            done.send((got, buf)).unwrap();
            server
        });
        let on_the_futex = || {
            // The server's mailbox moved to the waiter: look through the client's.
            client.header().slots[Direction::Requests as usize]
                .reader
                .load(Ordering::SeqCst)
                == PARKED
        };
        // Bounded: the waiter parks within its first instructions.
        assert!((0..100_000).any(|_| {
            std::thread::yield_now();
            on_the_futex()
        }));
        client
            .slot(Direction::Requests)
            .post(Outgoing::Here(b"wake"));
        let (got, buf) = woken
            .recv_timeout(Duration::from_secs(60))
            .expect("the post woke the parked reader");
        assert_eq!((got, buf.as_slice()), (Some(Incoming::Here), &b"wake"[..]));
        waiter.join().unwrap();
    }

    #[test]
    fn a_reader_on_its_socket_is_reported_unless_a_message_beat_it() {
        let (server, client) = pair();
        let requests = server.slot(Direction::Requests);
        requests.awake();
        assert!(requests.wait_on_socket(0));
        assert_eq!(
            client.slot(Direction::Requests).post(Outgoing::Here(b"x")),
            Reader::OnSocket
        );
        assert!(!requests.wait_on_socket(0), "a message is waiting");
        assert_eq!(
            client.slot(Direction::Requests).post(Outgoing::Here(b"y")),
            Reader::Here
        );
    }

    #[test]
    fn only_the_offered_file_on_this_host_attaches() {
        let server = Mailbox::create().unwrap();
        let offer = server.offer().unwrap();
        let mut elsewhere = offer.clone();
        elsewhere.host.push('x');
        assert!(Mailbox::attach(&elsewhere).is_err());
        let mut wrong_token = offer.clone();
        wrong_token.token[0] ^= 1;
        assert!(Mailbox::attach(&wrong_token).is_err());
        let other = Mailbox::create().unwrap();
        let mut wrong_file = offer.clone();
        wrong_file.fd = other.offer().unwrap().fd;
        assert!(
            Mailbox::attach(&wrong_file).is_err(),
            "another memfd of ours"
        );
        let mut server = server;
        server.close_descriptor();
        assert_eq!(server.offer(), None);
        assert!(Mailbox::attach(&offer).is_err(), "descriptor closed");
    }

    #[test]
    fn a_length_the_peer_garbled_is_bounded() {
        let (server, client) = pair();
        let h = client.header();
        h.slots[0].len.store(u32::MAX >> 1, Ordering::Relaxed);
        h.slots[0].seq.fetch_add(1, Ordering::SeqCst);
        let mut seen = 0;
        let mut buf = Vec::new();
        assert_eq!(
            server.slot(Direction::Requests).take(&mut seen, &mut buf),
            Some(Incoming::Here)
        );
        assert_eq!(buf.len(), CAPACITY);
    }
}
