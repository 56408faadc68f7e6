//! The poll-mode transfer loop. Each worker thread owns one `TransportWorker` per
//! transport, drains its submission queue, polls completions, retries failed slices on
//! another path, and after a bounded number of idle iterations parks in epoll on its
//! wake-up eventfd plus every transport's completion descriptor, so an idle engine
//! burns no CPU.

use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::batch::{Batch, TaskState};
use super::segments::Segments;
use crate::device::{self, Bounce, MemoryKind};
use crate::sys::{self, Epoll, EventFd};
use crate::transport::{Finished, Kind, Op, Outcome, Slice, Transport, TransportWorker};

/// A slice bound for a worker, with the task it belongs to.
pub struct WorkItem {
    pub batch: Arc<Batch>,
    pub task: usize,
    /// A slice whose local side is device memory (`slice.local_kind`) is at most
    /// `device::BOUNCE_SIZE` long, so it can be staged if no transport carries it.
    pub slice: Slice,
}

/// The half of a worker that submitters talk to.
pub struct WorkerHandle {
    queue: Mutex<Vec<WorkItem>>,
    wake: EventFd,
    parked: AtomicBool,
    stop: AtomicBool,
}

impl WorkerHandle {
    pub fn new() -> std::io::Result<WorkerHandle> {
        Ok(WorkerHandle {
            queue: Mutex::new(Vec::new()),
            wake: EventFd::new()?,
            parked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        })
    }

    pub fn push(&self, items: impl IntoIterator<Item = WorkItem>) {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(items);
        // Pairs with the fence in `park`: either we see `parked`, or it sees the items.
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            self.wake.notify();
        }
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.wake.notify();
    }
}

pub struct WorkerConfig {
    pub spin_budget: u32,
    pub max_retries: u32,
    pub counters: Arc<Counters>,
}

struct InFlight {
    batch: Arc<Batch>,
    task: usize,
    slice: Slice,
    attempts: u32,
    /// The transport currently carrying the slice.
    via: Option<Kind>,
    /// For a device-memory local side: the bounce buffer standing in for it.
    staged: Option<Staged>,
}

/// A slice whose local side is device memory travels from/into `bounce`: a WRITE's
/// bytes are copied device → bounce before it starts, a READ's bounce → device once it
/// completed. `slice.local` points into the bounce meanwhile.
struct Staged {
    bounce: Bounce,
    device_addr: u64,
    kind: MemoryKind,
}

/// Staged slices in flight per worker at most (bounce memory: this many times
/// `device::BOUNCE_SIZE`); more wait in `deferred`.
const MAX_STAGED: usize = 8;

/// Counters an engine exposes through `Engine::stats`.
#[derive(Default)]
pub struct Counters {
    pub bytes: [AtomicU64; Kind::COUNT],
    pub retries: AtomicU64,
    pub failed_slices: AtomicU64,
}

pub struct Worker {
    handle: Arc<WorkerHandle>,
    transports: Vec<Arc<dyn Transport>>,
    workers: Vec<Box<dyn TransportWorker>>,
    segments: Arc<Segments>,
    config: WorkerConfig,
    /// In-flight slices by id; ids index this table, freed slots are reused.
    slots: Vec<Option<InFlight>>,
    free: Vec<usize>,
    done: Vec<Finished>,
    epoll: Epoll,
    /// Staged slices waiting for a bounce buffer, and how many hold one.
    deferred: std::collections::VecDeque<WorkItem>,
    staged_in_flight: usize,
}

/// Token of the wake-up eventfd in the parking epoll; transports use their index.
const WAKE_TOKEN: u64 = u64::MAX;
/// Idle iterations after which a worker waiting only on bulk data parks: the bytes
/// arrive at the kernel's pace, and spinning would steal a core from the peer.
const BULK_SPINS: u32 = 16;
const BULK_BYTES: u64 = 256 << 10;
/// While slices are in flight, a parked worker still looks at deadlines this often.
const PARKED_TICK_MS: i32 = 20;

impl Worker {
    pub fn new(
        handle: Arc<WorkerHandle>,
        transports: Vec<Arc<dyn Transport>>,
        segments: Arc<Segments>,
        config: WorkerConfig,
    ) -> crate::Result<Worker> {
        let io = |what: &str, e| crate::Error::io(what.to_owned(), e);
        let epoll = Epoll::new().map_err(|e| io("epoll", e))?;
        epoll
            .add(handle.wake.raw_fd(), sys::READABLE, WAKE_TOKEN)
            .map_err(|e| io("epoll add", e))?;
        let mut workers = Vec::new();
        for (i, t) in transports.iter().enumerate() {
            let w = t.new_worker()?;
            if let Some(fd) = w.wait_fd() {
                epoll
                    .add(fd, sys::READABLE, i as u64)
                    .map_err(|e| io("epoll add", e))?;
            }
            workers.push(w);
        }
        Ok(Worker {
            handle,
            transports,
            workers,
            segments,
            config,
            slots: Vec::new(),
            free: Vec::new(),
            done: Vec::new(),
            epoll,
            deferred: Default::default(),
            staged_in_flight: 0,
        })
    }

    pub fn run(mut self) {
        let mut idle = 0u32;
        let mut intake = Vec::new();
        while !self.handle.stop.load(Ordering::Relaxed) {
            std::mem::swap(
                &mut intake,
                &mut *self.handle.queue.lock().unwrap_or_else(|e| e.into_inner()),
            );
            let mut busy = !intake.is_empty();
            for item in intake.drain(..) {
                self.start(item);
            }
            let now = Instant::now();
            for w in &mut self.workers {
                busy |= w.progress(now, &mut self.done);
            }
            busy |= !self.done.is_empty();
            self.finish_done();
            busy |= self.start_deferred();
            if busy {
                idle = 0;
            } else {
                idle += 1;
                let waiting_on_bulk = idle == BULK_SPINS && self.bulk_in_flight();
                if idle >= self.config.spin_budget || waiting_on_bulk {
                    self.park();
                    idle = 0;
                }
            }
        }
    }

    fn bulk_in_flight(&self) -> bool {
        self.workers
            .iter()
            .map(|w| w.in_flight_bytes())
            .sum::<u64>()
            > BULK_BYTES
    }

    fn park(&mut self) {
        self.handle.parked.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let has_work = !self
            .handle
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty();
        if !has_work && !self.handle.stop.load(Ordering::SeqCst) {
            let in_flight = self.workers.iter().any(|w| w.in_flight() > 0);
            let timeout = if in_flight { PARKED_TICK_MS } else { -1 };
            let mut tokens = Vec::new();
            if let Err(e) = self.epoll.wait(&mut tokens, timeout) {
                log::warn!("worker: epoll_wait: {e}");
            }
        }
        self.handle.parked.store(false, Ordering::SeqCst);
        self.handle.wake.drain();
    }

    /// Starts deferred staged slices as bounce buffers free up.
    fn start_deferred(&mut self) -> bool {
        let mut started = false;
        while self.staged_in_flight < MAX_STAGED {
            let Some(item) = self.deferred.pop_front() else {
                break;
            };
            self.start(item);
            started = true;
        }
        started
    }

    /// The most preferred transport that reaches the slice's peer and carries it.
    fn choose(&self, slice: &Slice) -> Option<usize> {
        let desc = slice.peer.desc();
        self.transports
            .iter()
            .position(|t| !slice.peer.is_disabled(t.kind()) && t.reaches(&desc) && t.carries(slice))
    }

    fn start(&mut self, item: WorkItem) {
        let mut item = item;
        // Device memory goes straight to a transport that moves it natively (IPC,
        // GPUDirect RDMA, FI_HMEM); otherwise through a host bounce buffer.
        let must_stage = !item.slice.local_kind.is_host() && self.choose(&item.slice).is_none();
        let staged = if !must_stage {
            None
        } else if self.staged_in_flight >= MAX_STAGED {
            self.deferred.push_back(item);
            return;
        } else {
            match stage(&mut item.slice) {
                Ok(s) => {
                    self.staged_in_flight += 1;
                    Some(s)
                }
                Err(e) => {
                    log::warn!("staging device memory for a slice failed: {e}");
                    let c = &self.config.counters;
                    c.failed_slices.fetch_add(1, Ordering::Relaxed);
                    item.batch
                        .slice_finished(item.task, item.slice.len, TaskState::Failed);
                    return;
                }
            }
        };
        let id = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        let mut slice = item.slice;
        slice.id = id as u64;
        self.slots[id] = Some(InFlight {
            batch: item.batch,
            task: item.task,
            slice: slice.clone(),
            attempts: 0,
            via: None,
            staged,
        });
        self.post(slice);
    }

    /// Hands a slice to the most preferred transport that reaches its peer and
    /// carries it. A device-memory slice that no transport carries any more (its
    /// native path failed) is staged now and goes the host way.
    fn post(&mut self, slice: Slice) {
        let mut slice = slice;
        let mut chosen = self.choose(&slice);
        let id = slice.id as usize;
        let entry = self.slots.get_mut(id).and_then(Option::as_mut);
        if let (None, false, Some(entry)) = (chosen, slice.local_kind.is_host(), entry) {
            match stage(&mut slice) {
                Ok(s) => {
                    // The bounce lives in the entry until the slice is retired.
                    self.staged_in_flight += 1;
                    entry.staged = Some(s);
                    entry.slice = slice.clone();
                }
                Err(e) => {
                    self.done.push(Finished {
                        id: slice.id,
                        outcome: Outcome::PathFailed(format!("staging device memory: {e}")),
                    });
                    return;
                }
            }
            chosen = self.choose(&slice);
        }
        if let Some(entry) = self.slots.get_mut(id).and_then(Option::as_mut) {
            entry.via = chosen.map(|i| self.transports[i].kind());
        }
        match chosen {
            Some(i) => self.workers[i].post(slice, &mut self.done),
            None => self.done.push(Finished {
                id: slice.id,
                outcome: Outcome::PathFailed(format!(
                    "no enabled transport reaches {}",
                    slice.peer.name
                )),
            }),
        }
    }

    fn finish_done(&mut self) {
        while let Some(f) = self.done.pop() {
            let id = f.id as usize;
            let Some(entry) = self.slots.get_mut(id).and_then(Option::as_mut) else {
                log::error!("worker: completion for unknown slice {id}");
                continue;
            };
            let state = match f.outcome {
                Outcome::Done => TaskState::Completed,
                Outcome::TimedOut => {
                    log::warn!("slice to {} timed out", entry.slice.peer.name);
                    TaskState::Timeout
                }
                Outcome::Rejected(why) => {
                    log::warn!("slice rejected: {why}");
                    TaskState::Failed
                }
                Outcome::Stale | Outcome::PathFailed(_)
                    if entry.attempts >= self.config.max_retries =>
                {
                    let why = match &f.outcome {
                        Outcome::PathFailed(why) => why.as_str(),
                        _ => "descriptor kept changing",
                    };
                    log::warn!(
                        "slice to {} failed after {} attempts: {why}",
                        entry.slice.peer.name,
                        entry.attempts + 1
                    );
                    TaskState::Failed
                }
                Outcome::Stale | Outcome::PathFailed(_)
                    if Instant::now() >= entry.slice.deadline =>
                {
                    TaskState::Timeout
                }
                Outcome::Stale | Outcome::PathFailed(_) => {
                    entry.attempts += 1;
                    self.config.counters.retries.fetch_add(1, Ordering::Relaxed);
                    let slice = entry.slice.clone();
                    if let Outcome::PathFailed(why) = &f.outcome {
                        log::debug!("slice to {}: {why}; retrying", slice.peer.name);
                    }
                    if f.outcome == Outcome::Stale {
                        if let Err(e) = self.segments.resync(&slice.peer) {
                            log::warn!("resync of {} failed: {e}", slice.peer.name);
                        }
                        if slice
                            .peer
                            .desc()
                            .buffer_for(slice.remote, slice.len)
                            .is_none()
                        {
                            self.retire(id, TaskState::Failed);
                            continue;
                        }
                    }
                    self.post(slice);
                    continue;
                }
            };
            self.retire(id, state);
        }
    }

    fn retire(&mut self, id: usize, state: TaskState) {
        if let Some(mut entry) = self.slots[id].take() {
            let mut state = state;
            if let Some(s) = entry.staged.take() {
                self.staged_in_flight -= 1;
                if state == TaskState::Completed && entry.slice.op == Op::Read {
                    // SAFETY: the bounce holds the slice's bytes; the device range was
                    // validated as registered device memory at submit.
                    let copied = unsafe {
                        device::copy_from_host(
                            s.kind,
                            s.device_addr,
                            s.bounce.ptr(),
                            entry.slice.len as usize,
                        )
                    };
                    if let Err(e) = copied {
                        log::warn!("copying a staged read into device memory failed: {e}");
                        state = TaskState::Failed;
                    }
                }
            }
            let c = &self.config.counters;
            match (state, entry.via) {
                (TaskState::Completed, Some(kind)) => {
                    c.bytes[kind as usize].fetch_add(entry.slice.len, Ordering::Relaxed);
                }
                (TaskState::Completed, None) => {}
                _ => {
                    c.failed_slices.fetch_add(1, Ordering::Relaxed);
                }
            }
            entry
                .batch
                .slice_finished(entry.task, entry.slice.len, state);
            self.free.push(id);
        }
    }
}

/// Points `slice.local` at a bounce buffer standing in for its device memory; for a
/// WRITE, first copies the device bytes into it.
fn stage(slice: &mut Slice) -> crate::Result<Staged> {
    let kind = slice.local_kind;
    let len = slice.len as usize;
    let bounce = Bounce::take(kind);
    if len > bounce.len() {
        return Err(crate::Error::new(
            crate::Code::Internal,
            format!("staged slice of {len} bytes exceeds the bounce buffer"),
        ));
    }
    if slice.op == Op::Write {
        // SAFETY: the local range is registered device memory (checked at submit,
        // valid until the task is final by the submit contract); the bounce holds
        // `len` bytes.
        unsafe { device::copy_to_host(kind, bounce.ptr(), slice.local, len)? };
    }
    let device_addr = std::mem::replace(&mut slice.local, bounce.ptr() as u64);
    slice.local_kind = MemoryKind::Host;
    Ok(Staged {
        bounce,
        device_addr,
        kind,
    })
}
