//! Batches and their tasks: lock-free status counters written by workers, read by
//! pollers, with a condition variable for waiters that stop spinning.

use crate::util::sync::Unpoisoned;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Code, Error, Result};
use crate::util::crc32c::crc32c_combine;
use crate::util::SmallList;

/// Task states, numbered as Mooncake's (`docs/wire.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum TaskState {
    /// Reserved, not yet submitted.
    Waiting = 0,
    /// Submitted, slices in flight.
    Pending = 1,
    /// No such task.
    Invalid = 2,
    /// Canceled before it finished.
    Canceled = 3,
    /// Every byte moved.
    Completed = 4,
    /// Ran out of time.
    Timeout = 5,
    /// At least one slice failed.
    Failed = 6,
}

impl TaskState {
    fn from_u8(v: u8) -> TaskState {
        match v {
            0 => TaskState::Waiting,
            1 => TaskState::Pending,
            2 => TaskState::Invalid,
            3 => TaskState::Canceled,
            4 => TaskState::Completed,
            5 => TaskState::Timeout,
            _ => TaskState::Failed,
        }
    }

    /// True once the task can no longer change state.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            TaskState::Completed | TaskState::Timeout | TaskState::Failed | TaskState::Canceled
        )
    }
}

/// A task's state and the bytes it has moved so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskStatus {
    /// Where the task stands.
    pub state: TaskState,
    /// Bytes moved so far (a lower bound while pending).
    pub bytes: u64,
}

#[derive(Default)]
struct Task {
    state: AtomicU8,
    bytes: AtomicU64,
    slices_left: AtomicU32,
    /// The worst slice result so far: 0 none, else a failing `TaskState`.
    worst: AtomicU8,
}

/// A fixed-capacity set of tasks submitted and waited on together.
pub struct Batch {
    tasks: Box<[Task]>,
    /// Tasks handed out so far; taken under a lock so concurrent submits get disjoint
    /// task ranges.
    submitted: Mutex<usize>,
    unfinished: AtomicUsize,
    /// Bytes of unfinished slices: waiters spin only when little is outstanding.
    pending_bytes: AtomicU64,
    failed: AtomicUsize,
    sleepers: AtomicUsize,
    done: (Mutex<()>, Condvar),
    /// For a batch whose reads are checksummed: per task, each finished slice's
    /// remote address, length and CRC32C, joined in address order when asked.
    checksums: Option<Box<[Mutex<SmallList<SliceChecksum>>]>>,
}

#[derive(Clone, Copy)]
struct SliceChecksum {
    remote: u64,
    len: u64,
    crc: u32,
}

/// How many times a waiter polls before it sleeps...
const WAIT_SPINS: u32 = 2000;
/// ...when no more than this is outstanding. Larger transfers take long enough that
/// spinning would only steal a core from the threads moving the bytes.
const SPIN_MAX_PENDING: u64 = 256 << 10;
/// Spins between two offers of the core to other runnable threads...
const YIELD_EVERY: u32 = 64;
/// ...for waits on at most this many bytes.
const YIELD_MAX_PENDING: u64 = 64 << 10;

impl Batch {
    /// A batch with room for `capacity` tasks.
    pub fn new(capacity: usize) -> Batch {
        Batch {
            tasks: (0..capacity).map(|_| Task::default()).collect(),
            submitted: Mutex::new(0),
            unfinished: AtomicUsize::new(0),
            pending_bytes: AtomicU64::new(0),
            failed: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            done: (Mutex::new(()), Condvar::new()),
            checksums: None,
        }
    }

    /// A batch with room for `capacity` tasks whose slices report their CRC32C
    /// (`slice_checksum`), so each completed task has one (`task_checksum`).
    pub fn checksummed(capacity: usize) -> Batch {
        Batch {
            checksums: Some((0..capacity).map(|_| Mutex::default()).collect()),
            ..Batch::new(capacity)
        }
    }

    /// Whether this batch's slices are checksummed.
    pub fn wants_checksums(&self) -> bool {
        self.checksums.is_some()
    }

    /// Records the CRC32C of a completed slice of `task` (before `slice_finished`
    /// says so, so the task's checksum is whole once it is final).
    pub fn slice_checksum(&self, task: usize, remote: u64, len: u64, crc: u32) {
        if let Some(c) = self.checksums.as_ref().and_then(|c| c.get(task)) {
            c.locked().push(SliceChecksum { remote, len, crc });
        }
    }

    /// The CRC32C of a completed task's bytes: its slices' checksums joined in
    /// address order. `None` when the batch is not checksummed, the task is not
    /// complete, or its slices do not cover its bytes end to end.
    pub fn task_checksum(&self, task: usize) -> Option<u32> {
        let status = self.task_status(task).ok()?;
        if status.state != TaskState::Completed {
            return None;
        }
        let mut pieces = self.checksums.as_ref()?.get(task)?.lock().ok()?;
        // The task is final: no slice of it records a checksum any more, so they are
        // put in order where they are.
        pieces.sort_unstable_by_key(|p| p.remote);
        let Some(first) = pieces.first().map(|p| p.remote) else {
            return (status.bytes == 0).then_some(0);
        };
        let mut crc = 0;
        let mut next = first;
        for p in pieces.iter() {
            if p.remote != next {
                return None;
            }
            crc = crc32c_combine(crc, p.crc, p.len);
            next = p.remote + p.len;
        }
        (next - first == status.bytes).then_some(crc)
    }

    /// How many tasks the batch can hold.
    pub fn capacity(&self) -> usize {
        self.tasks.len()
    }

    /// How many task slots have been reserved so far.
    pub fn submitted(&self) -> usize {
        *self.submitted.locked()
    }

    /// Reserves task slots, task `i` to be split into `slices[i]` slices, `bytes` in
    /// all; returns the first task index.
    pub fn reserve(&self, slices: &[u32], bytes: u64) -> Result<usize> {
        let mut submitted = self.submitted.locked();
        let first = *submitted;
        if first + slices.len() > self.tasks.len() {
            return Err(Error::new(
                Code::BatchFull,
                format!(
                    "batch holds {} tasks, {first} used, {} more requested",
                    self.tasks.len(),
                    slices.len()
                ),
            ));
        }
        self.unfinished.fetch_add(slices.len(), Ordering::SeqCst);
        self.pending_bytes.fetch_add(bytes, Ordering::Relaxed);
        for (i, &n) in slices.iter().enumerate() {
            let t = &self.tasks[first + i];
            t.slices_left.store(n, Ordering::SeqCst);
            t.state.store(TaskState::Pending as u8, Ordering::SeqCst);
        }
        *submitted += slices.len();
        Ok(first)
    }

    /// Records one finished slice of `task`.
    pub fn slice_finished(&self, task: usize, len: u64, result: TaskState) {
        let t = &self.tasks[task];
        self.pending_bytes.fetch_sub(len, Ordering::Relaxed);
        if result == TaskState::Completed {
            t.bytes.fetch_add(len, Ordering::Relaxed);
        } else {
            // FAILED (6) outranks TIMEOUT (5).
            t.worst.fetch_max(result as u8, Ordering::SeqCst);
        }
        if t.slices_left.fetch_sub(1, Ordering::SeqCst) != 1 {
            return;
        }
        let worst = t.worst.load(Ordering::SeqCst);
        let fin = if worst == 0 {
            TaskState::Completed
        } else {
            TaskState::from_u8(worst)
        };
        if fin != TaskState::Completed {
            self.failed.fetch_add(1, Ordering::SeqCst);
        }
        t.state.store(fin as u8, Ordering::SeqCst);
        if self.unfinished.fetch_sub(1, Ordering::SeqCst) == 1
            && self.sleepers.load(Ordering::SeqCst) > 0
        {
            let _lock = self.done.0.lock();
            self.done.1.notify_all();
        }
    }

    /// The state of task `task`; `Invalid` for one never submitted.
    pub fn task_state(&self, task: usize) -> TaskState {
        self.task_status(task)
            .map_or(TaskState::Invalid, |s| s.state)
    }

    /// The state and bytes of task `task`.
    pub fn task_status(&self, task: usize) -> Result<TaskStatus> {
        if task >= self.submitted() {
            return Err(Error::invalid(format!(
                "task {task} was not submitted to this batch"
            )));
        }
        let t = &self.tasks[task];
        Ok(TaskStatus {
            state: TaskState::from_u8(t.state.load(Ordering::SeqCst)),
            bytes: t.bytes.load(Ordering::SeqCst),
        })
    }

    /// Number of submitted tasks not yet final.
    pub fn unfinished(&self) -> usize {
        self.unfinished.load(Ordering::SeqCst)
    }

    /// Waits until every submitted task is final. `Ok` when all completed;
    /// `TransferFail` when any failed; `Timeout` when time ran out first.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut spins = 0;
        let pending = self.pending_bytes.load(Ordering::Relaxed);
        if pending > SPIN_MAX_PENDING {
            spins = WAIT_SPINS;
        }
        // A lone small operation completes through one chain of wake-ups (a worker,
        // a provider's progress thread) that may be waiting for this very core, so
        // its waiter offers the core now and then; bigger batches keep those threads
        // busy anyway and only lose by yielding (measured: bench/README.md).
        let yield_every = if pending <= YIELD_MAX_PENDING {
            YIELD_EVERY
        } else {
            u32::MAX
        };
        while self.unfinished() != 0 {
            if spins < WAIT_SPINS {
                spins += 1;
                if spins % yield_every == 0 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            let guard = self.done.0.locked();
            if self.unfinished() != 0 {
                let wait = match deadline {
                    Some(d) => d.saturating_duration_since(Instant::now()),
                    None => Duration::from_secs(3600),
                };
                let _ = self.done.1.wait_timeout(guard, wait);
            }
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            if deadline.is_some_and(|d| Instant::now() >= d) && self.unfinished() != 0 {
                return Err(Error::new(
                    Code::Timeout,
                    format!(
                        "{} of {} tasks still pending",
                        self.unfinished(),
                        self.submitted()
                    ),
                ));
            }
        }
        match self.failed.load(Ordering::SeqCst) {
            0 => Ok(()),
            n => Err(Error::new(
                Code::TransferFail,
                format!("{n} of {} tasks failed or timed out", self.submitted()),
            )),
        }
    }
}
