//! Commits a node's lent memory before the pool needs it.
//!
//! The segment is a fresh shared mapping: left alone, the first write to each 4 KiB
//! page (a put's copy, or the node's TCP server receiving one) stops while the kernel
//! allocates and zeroes it, and for large values that costs more than the copy
//! (bench/NOTEBOOK.md, "Memory committed ahead of puts"). So from its allocation on,
//! a thread in the idle scheduling class faults the segment in, front to back, while
//! the node is quiet. Three rules keep it out of the node's way:
//! - it works only while another CPU would stay idle beside it: a runnable thread,
//!   even of the idle class, makes the spinning waiters of a latency-bound loop block;
//! - it faults 4 pages per call: most kernels do not preempt that work, so a thread
//!   woken on its CPU waits for the call (2 MiB calls cut 4 KiB gets by a third), and
//!   the call holds the process's memory-map lock for reading, which an `mmap` or
//!   `munmap` of another thread (a large `malloc`) waits out;
//! - it stops, leaving the rest to fault on first use as before, when committing more
//!   would bring the machine or the process's memory cgroup within a reserve of its
//!   limit: lending memory must never wake the OOM killer by itself.
//!
//! Mooncake's RDMA nodes commit the segment at mount as well (registration pins it);
//! its TCP nodes do not. The price: a node holds what it lends from the start, not
//! as the pool fills, so memory a neighbour could have used until then is taken.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::util::sync::StopSignal;
use mooncake_base::memory_room::{memory_room, MemoryRoom};

/// Bytes faulted in per call (see the module's second rule).
const CHUNK: usize = 16 << 10;
/// How long it waits, while no CPU is idle, before it looks again: doubled at each
/// look that finds none, up to the longest (a CPU-limited container on a busy host
/// may never see one; a look costs ~1 µs), and back to the shortest once it commits
/// again. The longest is short: a node whose own work leaves only brief gaps (a
/// client putting 4 MiB values back to back, its master round trips a few µs) must
/// not sleep through them (with 500 ms, 4 MiB puts of upstream's stress benchmark
/// ran at 256–794 ops/s against 771–792 with 20 ms).
const BUSY_PAUSE: Duration = Duration::from_millis(2);
const LONGEST_PAUSE: Duration = Duration::from_millis(20);
/// Bytes committed between two looks at the memory room.
const ROOM_CHECK_EVERY: usize = 64 << 20;
/// Room always left to everything else: an eighth of the tightest limit, within
/// these bounds.
const MIN_RESERVE: u64 = 256 << 20;
const MAX_RESERVE: u64 = 2 << 30;

/// The memory left alone for others under `room`'s limit.
fn reserve(room: &MemoryRoom) -> u64 {
    (room.limit / 8).clamp(MIN_RESERVE, MAX_RESERVE)
}

/// Whether `bytes` more may be committed in `room`.
fn fits(room: &MemoryRoom, bytes: u64) -> bool {
    room.free.saturating_sub(reserve(room)) >= bytes
}

/// The background commit of one segment; stopped and joined when dropped.
pub(super) struct Prefault {
    stop: Arc<Stop>,
    thread: Option<JoinHandle<Committed>>,
}

/// The stop: a flag the loop reads without a lock (an idle-class thread must not
/// hold one the closing thread waits for), and a signal that ends its pauses.
#[derive(Default)]
struct Stop {
    flag: AtomicBool,
    signal: StopSignal,
}

impl Stop {
    fn raise(&self) {
        self.flag.store(true, Ordering::Relaxed);
        self.signal.raise();
    }

    fn is_raised(&self) -> bool {
        self.flag.load(Ordering::Relaxed)
    }
}

/// How a commit ended: the bytes committed, and whether it stopped at the reserve.
#[derive(Debug, PartialEq, Eq)]
struct Committed {
    bytes: usize,
    at_reserve: bool,
}

impl Prefault {
    /// Starts committing `[base, base + len)`.
    ///
    /// # Safety
    /// The range must lie in one writable mapping that stays mapped until the value
    /// returned is dropped (faulting pages in changes none of their bytes).
    pub(super) unsafe fn start(base: *mut u8, len: usize) -> Prefault {
        // SAFETY: the caller's contract.
        unsafe { Prefault::start_when(base, len, crate::sys::cpu_idle_beside_caller) }
    }

    /// As `start`, working only while `quiet()` says a CPU is idle beside it.
    ///
    /// # Safety
    /// As `start`.
    unsafe fn start_when(base: *mut u8, len: usize, quiet: fn() -> bool) -> Prefault {
        let stop = Arc::new(Stop::default());
        let flag = stop.clone();
        let base = base as usize;
        let thread = std::thread::Builder::new()
            .name("mc-store-prefault".into())
            .spawn(move || commit(base, len, &flag, quiet));
        let thread = thread
            .inspect_err(|e| log::debug!("segment prefault not started: {e}"))
            .ok();
        Prefault { stop, thread }
    }

    /// Asks the thread to stop without waiting for it (`drop` waits).
    pub(super) fn stop_soon(&self) {
        self.stop.raise();
    }
}

impl Drop for Prefault {
    fn drop(&mut self) {
        self.stop.raise();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn commit(base: usize, len: usize, stop: &Stop, quiet: fn() -> bool) -> Committed {
    let mut done = 0;
    let stopped = |bytes, at_reserve| Committed { bytes, at_reserve };
    if let Err(e) = crate::sys::run_at_idle_priority() {
        // At normal priority it would compete with the node's own work: leave it.
        log::debug!("segment prefault skipped (no idle priority: {e})");
        return stopped(done, false);
    }
    let began = Instant::now();
    let mut pause = BUSY_PAUSE;
    while done < len && !stop.is_raised() {
        if !quiet() {
            stop.signal.wait(pause);
            pause = (pause * 2).min(LONGEST_PAUSE);
            continue;
        }
        pause = BUSY_PAUSE;
        if done % ROOM_CHECK_EVERY == 0 {
            let next = ROOM_CHECK_EVERY.min(len - done) as u64;
            match memory_room() {
                Some(room) if fits(&room, next) => {}
                room => {
                    log::info!(
                        "segment prefault stopped after {} of {} MiB: {room:?} leaves no \
                         room beyond the reserve; the rest is committed on first use",
                        done >> 20,
                        len >> 20
                    );
                    return stopped(done, true);
                }
            }
        }
        let n = CHUNK.min(len - done);
        // SAFETY: `[base + done, base + done + n)` lies in the caller's mapping, which
        // stays mapped until `Prefault` is dropped, and that joins this thread first.
        unsafe { crate::sys::populate_for_write((base + done) as *mut u8, n) };
        done += n;
    }
    log::debug!(
        "segment prefault: {} of {} MiB committed in {:?}",
        done >> 20,
        len >> 20,
        began.elapsed()
    );
    stopped(done, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_base::memfd::{SharedMemory, Sharing};

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_reserve_is_an_eighth_of_the_limit_within_bounds() {
        let room = |limit| MemoryRoom { free: 0, limit };
        assert_eq!(reserve(&room(24 * GIB)), 2 * GIB);
        assert_eq!(reserve(&room(4 * GIB)), GIB / 2);
        assert_eq!(reserve(&room(GIB)), MIN_RESERVE);
    }

    #[test]
    fn memory_is_committed_only_beyond_the_reserve() {
        let room = |free| MemoryRoom {
            free,
            limit: 8 * GIB,
        };
        assert!(fits(&room(2 * GIB), GIB));
        assert!(fits(&room(GIB + (64 << 20)), 64 << 20));
        assert!(!fits(&room(GIB + (63 << 20)), 64 << 20));
        assert!(!fits(&room(GIB / 2), 1), "below the reserve: nothing");
    }

    /// Pages of `[p, p + len)` the shared memory holds (`mincore`).
    fn resident(p: *mut u8, len: usize) -> usize {
        let mut vec = vec![0u8; len.div_ceil(4096)];
        // SAFETY: the range is one live mapping; `vec` has a byte per page.
        let rc = unsafe { libc::mincore(p.cast(), len, vec.as_mut_ptr()) };
        assert_eq!(rc, 0);
        vec.iter().filter(|b| **b & 1 == 1).count()
    }

    #[test]
    fn a_segment_is_committed_in_the_background_and_its_bytes_kept() {
        let len = 8 << 20;
        let shm = SharedMemory::create("prefault-test", len, Sharing::PeersWrite).unwrap();
        // SAFETY: the mapping is this test's alone.
        unsafe { *shm.ptr().add(4096 * 300 + 7) = 42 };
        // (A kernel with huge shmem pages makes more than the page written resident.)
        let before = resident(shm.ptr(), len);
        assert!(before < len / 4096);
        // SAFETY: the mapping outlives `p`, joined below. (Whether this machine has an
        // idle CPU is not what this test is about: it is told so.)
        let mut p = unsafe { Prefault::start_when(shm.ptr(), len, || true) };
        // Joined without the stop: it runs to the end, or to the memory reserve.
        let done = p.thread.take().expect("spawned").join().unwrap();
        match done {
            Committed {
                at_reserve: true, ..
            } => eprintln!("this machine is within the reserve: nothing to check"),
            Committed { bytes, .. } => {
                assert_eq!(bytes, len);
                assert_eq!(resident(shm.ptr(), len), len / 4096);
            }
        }
        // SAFETY: as above.
        assert_eq!(unsafe { *shm.ptr().add(4096 * 300 + 7) }, 42);
    }

    #[test]
    fn dropping_it_stops_the_commit_early() {
        let len = 1 << 30;
        let shm = SharedMemory::create("prefault-stop", len, Sharing::PeersWrite).unwrap();
        // SAFETY: the mapping outlives `p`, dropped (joined) at once.
        drop(unsafe { Prefault::start_when(shm.ptr(), len, || true) });
        assert!(
            resident(shm.ptr(), len) < len / 4096,
            "stopped before the end"
        );
    }
}
