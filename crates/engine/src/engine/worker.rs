//! The poll-mode transfer loop. Each worker thread owns one `TransportWorker` per
//! transport, drains its submission queue, polls completions, retries failed slices on
//! another path, and after a bounded number of idle iterations parks in epoll on its
//! wake-up eventfd plus every transport's completion descriptor, so an idle engine
//! burns no CPU.

use crate::util::sync::Unpoisoned;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::batch::{Batch, TaskState};
use super::segments::Segments;
use crate::device::{self, Bounce, MemoryKind};
use crate::sys::{self, Epoll, EventFd};
use crate::transport::{Finished, Kind, Op, Outcome, Slice, Transport, TransportWorker};
use crate::util::crc32c::crc32c;

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

    /// Queues items for the worker; true when it was parked and had to be woken.
    pub fn push(&self, items: impl IntoIterator<Item = WorkItem>) -> bool {
        self.queue.locked().extend(items);
        // Pairs with the fence in `park`: either we see `parked`, or it sees the items.
        fence(Ordering::SeqCst);
        let parked = self.parked.load(Ordering::SeqCst);
        if parked {
            self.wake.notify();
        }
        parked
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
    /// Submissions handed to a worker thread's queue.
    pub handoffs: AtomicU64,
    /// Of those, the ones that had to wake a parked worker.
    pub wakeups: AtomicU64,
    /// Synchronous transfers the calling thread ran to completion itself.
    pub inline_runs: AtomicU64,
    /// Of those, the ones copied within the engine's own memory (`Engine::copy_own`).
    pub own_copies: AtomicU64,
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

/// The time the poll loop hands transports for their deadlines, read from the clock
/// only when the loop is idle or every `CLOCK_EVERY` busy rounds: deadlines are
/// seconds away, and a busy loop need not pay for a clock read per round.
struct Clock {
    now: Instant,
    rounds: u32,
}

const CLOCK_EVERY: u32 = 64;

impl Clock {
    fn starting_at(now: Instant) -> Clock {
        Clock { now, rounds: 0 }
    }

    /// The next `now` reads the clock (after a sleep: the cached time is stale by
    /// the whole sleep, and transports judge spinning and arming by it).
    fn expire(&mut self) {
        self.rounds = CLOCK_EVERY;
    }

    /// The time, `idle` rounds into an idle stretch (0: the loop was busy).
    fn now(&mut self, idle: u32) -> Instant {
        self.rounds += 1;
        // Idle: each spin re-reads it from the 8th on, so an expiring lane is seen.
        if self.rounds >= CLOCK_EVERY || idle >= 8 {
            self.rounds = 0;
            self.now = Instant::now();
        }
        self.now
    }
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
        let mut clock = Clock::starting_at(Instant::now());
        let mut intake = Vec::new();
        while !self.handle.stop.load(Ordering::Relaxed) {
            std::mem::swap(&mut intake, &mut *self.handle.queue.locked());
            let mut busy = !intake.is_empty();
            for item in intake.drain(..) {
                self.start(item);
            }
            busy |= self.step(clock.now(idle));
            if busy {
                idle = 0;
            } else {
                idle += 1;
                if self.should_park(idle) {
                    self.park();
                    clock.expire();
                    idle = 0;
                }
            }
        }
    }

    /// Runs `items`, all of `batch`, on the calling thread until every task of the
    /// batch is final: the thread posts the slices and polls their completions itself
    /// (no hand-off, no wake-up), spinning while answers are near and sleeping on the
    /// transports' descriptors when they are not. `now` is when it was submitted.
    pub fn run_inline(&mut self, items: Vec<WorkItem>, batch: &Batch, now: Instant) {
        for item in items {
            self.start(item);
        }
        let mut idle = 0u32;
        let mut clock = Clock::starting_at(now);
        // Slices posted above may already be done (memcpy transports finish in `post`).
        self.finish_done();
        while batch.unfinished() != 0 {
            if self.step(clock.now(idle)) {
                idle = 0;
                continue;
            }
            idle += 1;
            if self.should_park(idle) {
                self.wait_for_transports();
                clock.expire();
                idle = 0;
            }
        }
    }

    /// One round of polling: advances every transport, settles what finished and
    /// starts deferred slices; true when anything moved.
    fn step(&mut self, now: Instant) -> bool {
        let mut busy = false;
        for w in &mut self.workers {
            busy |= w.progress(now, &mut self.done);
        }
        busy |= !self.done.is_empty();
        self.finish_done();
        busy | self.start_deferred()
    }

    /// After `idle` empty rounds: whether to stop spinning (the budget is spent, or
    /// only bulk data is awaited, which arrives at the kernel's pace).
    fn should_park(&self, idle: u32) -> bool {
        idle >= self.config.spin_budget || (idle == BULK_SPINS && self.bulk_in_flight())
    }

    /// Sleeps until a transport has something to progress, or a tick passes (for
    /// deadlines); an inline runner's own wake-up descriptor is never signalled.
    fn wait_for_transports(&mut self) {
        let mut tokens = Vec::new();
        if let Err(e) = self.epoll.wait(&mut tokens, PARKED_TICK_MS) {
            log::warn!("inline transfer: epoll_wait: {e}");
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
        let has_work = !self.handle.queue.locked().is_empty();
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

    fn choose(&self, slice: &Slice, avoid: Option<Kind>) -> Option<usize> {
        choose(&self.transports, slice, avoid)
    }

    fn start(&mut self, item: WorkItem) {
        let mut item = item;
        let host = item.slice.local_kind.is_host();
        // Host memory goes direct whatever carries it: `post` chooses, once.
        let native = !host && self.choose(&item.slice, None).is_some();
        let staged = match admit(host, native, self.staged_in_flight) {
            Admit::Direct => None,
            Admit::Defer => {
                self.deferred.push_back(item);
                return;
            }
            Admit::Stage => match stage(&mut item.slice) {
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
            },
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
        self.post_avoiding(slice, None);
    }

    /// As `post`, preferring any transport but `avoid` (the one whose path just failed).
    fn post_avoiding(&mut self, slice: Slice, avoid: Option<Kind>) {
        let mut slice = slice;
        let mut chosen = self.choose(&slice, avoid);
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
                    self.done.push(Finished::new(
                        slice.id,
                        Outcome::PathFailed(format!("staging device memory: {e}")),
                    ));
                    return;
                }
            }
            chosen = self.choose(&slice, avoid);
        }
        if let Some(entry) = self.slots.get_mut(id).and_then(Option::as_mut) {
            entry.via = chosen.map(|i| self.transports[i].kind());
        }
        match chosen {
            Some(i) => self.workers[i].post(slice, &mut self.done),
            None => self.done.push(Finished::new(
                slice.id,
                Outcome::PathFailed(format!("no enabled transport reaches {}", slice.peer.name)),
            )),
        }
    }

    fn finish_done(&mut self) {
        while let Some(f) = self.done.pop() {
            let id = f.id as usize;
            let Some(entry) = self.slots.get_mut(id).and_then(Option::as_mut) else {
                log::error!("worker: completion for unknown slice {id}");
                continue;
            };
            let retriable = matches!(f.outcome, Outcome::Stale | Outcome::PathFailed(_));
            let expired = retriable && Instant::now() >= entry.slice.deadline;
            let state =
                match next_step(&f.outcome, entry.attempts, self.config.max_retries, expired) {
                    Next::Retire(state) => {
                        match (&f.outcome, state) {
                            (Outcome::TimedOut, _) => {
                                log::warn!("slice to {} timed out", entry.slice.peer.name)
                            }
                            (Outcome::Rejected(why), _) => log::warn!("slice rejected: {why}"),
                            (Outcome::Stale | Outcome::PathFailed(_), TaskState::Failed) => {
                                let why = match &f.outcome {
                                    Outcome::PathFailed(why) => why.as_str(),
                                    _ => "descriptor kept changing",
                                };
                                log::warn!(
                                    "slice to {} failed after {} attempts: {why}",
                                    entry.slice.peer.name,
                                    entry.attempts + 1
                                );
                            }
                            _ => {}
                        }
                        if state == TaskState::Completed && entry.slice.checksum {
                            record_checksum(entry, f.crc);
                        }
                        state
                    }
                    Next::Retry { resync } => {
                        entry.attempts += 1;
                        self.config.counters.retries.fetch_add(1, Ordering::Relaxed);
                        let slice = entry.slice.clone();
                        let mut avoid = None;
                        if let Outcome::PathFailed(why) = &f.outcome {
                            log::debug!("slice to {}: {why}; retrying", slice.peer.name);
                            avoid = entry.via;
                        }
                        if resync {
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
                        self.post_avoiding(slice, avoid);
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
                        device::copy_from_bounce(
                            s.kind,
                            s.device_addr,
                            &s.bounce,
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

/// Records a completed checksummed slice's CRC32C in its batch: the transport's, or
/// else one computed here over the bytes that landed in host memory (still in this
/// core's cache; a staged slice's bounce buffer counts). Device memory a transport
/// filled directly gets none, so its task has no checksum.
fn record_checksum(entry: &InFlight, folded: Option<u32>) {
    let s = &entry.slice;
    let crc = folded.or_else(|| {
        // SAFETY: a completed read into host memory (the caller's buffer, valid until
        // its task is final, which it is not before `slice_finished`; or the bounce
        // this entry holds).
        s.local_kind
            .is_host()
            .then(|| unsafe { landed_crc(s.local, s.len) })
    });
    if let Some(crc) = crc {
        entry.batch.slice_checksum(entry.task, s.remote, s.len, crc);
    }
}

/// The CRC32C of `len` bytes a read just landed at `local` (for a copy that could not
/// fold it on the way: its two ends overlapped, or its transport folds none).
///
/// # Safety
/// `local` must be readable for `len` bytes.
pub(super) unsafe fn landed_crc(local: u64, len: u64) -> u32 {
    // SAFETY: the caller's contract.
    crc32c(unsafe { std::slice::from_raw_parts(local as *const u8, len as usize) })
}

/// The most preferred transport (the first in `transports`) that reaches the slice's
/// peer, is not disabled for it, and carries the slice; other than `avoid` if another
/// does (a retry after a path failure goes elsewhere when it can: shared memory's
/// transient failures then end on TCP rather than spending every retry on shm).
fn choose(transports: &[Arc<dyn Transport>], slice: &Slice, avoid: Option<Kind>) -> Option<usize> {
    let desc = slice.peer.desc();
    let usable = |t: &Arc<dyn Transport>| {
        !slice.peer.is_disabled(t.kind()) && t.reaches(&desc) && t.carries(slice)
    };
    transports
        .iter()
        .position(|t| Some(t.kind()) != avoid && usable(t))
        .or_else(|| transports.iter().position(usable))
}

/// How a new slice starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Admit {
    /// Posted as it is: host memory, or device memory a transport moves natively
    /// (IPC, GPUDirect RDMA, FI_HMEM).
    Direct,
    /// Device memory no transport carries: through a host bounce buffer.
    Stage,
    /// As `Stage`, but every bounce buffer is taken: waits in `deferred`.
    Defer,
}

fn admit(host: bool, native: bool, staged_in_flight: usize) -> Admit {
    if host || native {
        Admit::Direct
    } else if staged_in_flight >= MAX_STAGED {
        Admit::Defer
    } else {
        Admit::Stage
    }
}

/// What becomes of a slice a transport handed back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    /// Final: its task learns `TaskState`.
    Retire(TaskState),
    /// Posted again (on whichever transport `choose` now prefers), after re-reading
    /// the peer's descriptor if `resync`.
    Retry { resync: bool },
}

/// A completed slice is done; a timed-out or refused one is final; one whose path
/// failed or whose descriptor was stale is retried until `max_retries` retries were
/// spent (then it failed) or its deadline passed (then it timed out).
fn next_step(outcome: &Outcome, attempts: u32, max_retries: u32, expired: bool) -> Next {
    match outcome {
        Outcome::Done => Next::Retire(TaskState::Completed),
        Outcome::TimedOut => Next::Retire(TaskState::Timeout),
        Outcome::Rejected(_) => Next::Retire(TaskState::Failed),
        Outcome::Stale | Outcome::PathFailed(_) if attempts >= max_retries => {
            Next::Retire(TaskState::Failed)
        }
        Outcome::Stale | Outcome::PathFailed(_) if expired => Next::Retire(TaskState::Timeout),
        Outcome::Stale => Next::Retry { resync: true },
        Outcome::PathFailed(_) => Next::Retry { resync: false },
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::SegmentDesc;
    use crate::transport::{Endpoints, Peer};

    /// A transport that reaches a peer or not, and carries device memory or not.
    struct Fake {
        kind: Kind,
        reaches: bool,
        device: bool,
    }

    impl Transport for Fake {
        fn kind(&self) -> Kind {
            self.kind
        }
        fn describe(&self, _desc: &mut SegmentDesc) {}
        fn reaches(&self, _peer: &SegmentDesc) -> bool {
            self.reaches
        }
        fn carries(&self, slice: &Slice) -> bool {
            slice.local_kind.is_host() || self.device
        }
        fn slice_size(&self) -> u64 {
            1 << 20
        }
        fn new_worker(&self) -> crate::Result<Box<dyn TransportWorker>> {
            Err(crate::Error::new(crate::Code::Internal, "not used here"))
        }
    }

    fn fake(kind: Kind, reaches: bool, device: bool) -> Arc<dyn Transport> {
        Arc::new(Fake {
            kind,
            reaches,
            device,
        })
    }

    fn slice(kind: MemoryKind) -> Slice {
        let endpoints = Endpoints {
            data: "127.0.0.1:9".parse().unwrap(),
            rpc: String::new(),
        };
        Slice {
            id: 0,
            op: Op::Write,
            local: 0x1000,
            local_kind: kind,
            remote: 0x2000,
            len: 64,
            peer: Arc::new(Peer::new(1, SegmentDesc::new("peer"), endpoints)),
            deadline: Instant::now(),
            checksum: false,
        }
    }

    #[test]
    fn the_first_enabled_transport_that_reaches_and_carries_is_chosen() {
        let ts = [
            fake(Kind::Rdma, false, true),
            fake(Kind::Shm, true, false),
            fake(Kind::Tcp, true, false),
        ];
        let host = slice(MemoryKind::Host);
        assert_eq!(
            choose(&ts, &host, None),
            Some(1),
            "RDMA does not reach the peer"
        );
        let shm = Some(Kind::Shm);
        assert_eq!(choose(&ts, &host, shm), Some(2), "a retry goes elsewhere");
        assert_eq!(choose(&ts, &host, Some(Kind::Tcp)), Some(1));
        host.peer.disable(Kind::Shm);
        assert_eq!(
            choose(&ts, &host, None),
            Some(2),
            "a failed path is skipped"
        );
        let tcp = Some(Kind::Tcp);
        assert_eq!(
            choose(&ts, &host, tcp),
            Some(2),
            "nothing else: the same path again"
        );
        host.peer.disable(Kind::Tcp);
        assert_eq!(choose(&ts, &host, None), None);

        let device = slice(MemoryKind::Cuda(0));
        assert_eq!(
            choose(&ts, &device, None),
            None,
            "nothing moves device memory"
        );
        let with_native: Vec<_> = ts
            .iter()
            .cloned()
            .chain([fake(Kind::Fabric, true, true)])
            .collect();
        assert_eq!(choose(&with_native, &device, None), Some(3));
    }

    #[test]
    fn device_slices_take_bounce_buffers_until_they_run_out() {
        assert_eq!(admit(true, false, MAX_STAGED), Admit::Direct);
        assert_eq!(admit(false, true, MAX_STAGED), Admit::Direct, "native path");
        assert_eq!(admit(false, false, 0), Admit::Stage);
        assert_eq!(admit(false, false, MAX_STAGED - 1), Admit::Stage);
        assert_eq!(admit(false, false, MAX_STAGED), Admit::Defer);
    }

    #[test]
    fn failed_paths_retry_until_the_budget_or_the_deadline_runs_out() {
        let failed = Outcome::PathFailed("lane broke".into());
        let retire = Next::Retire;
        assert_eq!(
            next_step(&Outcome::Done, 0, 3, true),
            retire(TaskState::Completed)
        );
        assert_eq!(
            next_step(&Outcome::TimedOut, 0, 3, false),
            retire(TaskState::Timeout)
        );
        let refused = Outcome::Rejected("out of range".into());
        assert_eq!(
            next_step(&refused, 0, 3, false),
            retire(TaskState::Failed),
            "never retried"
        );
        assert_eq!(
            next_step(&failed, 0, 3, false),
            Next::Retry { resync: false }
        );
        assert_eq!(
            next_step(&failed, 2, 3, false),
            Next::Retry { resync: false }
        );
        assert_eq!(
            next_step(&Outcome::Stale, 0, 3, false),
            Next::Retry { resync: true }
        );
        assert_eq!(next_step(&failed, 3, 3, false), retire(TaskState::Failed));
        assert_eq!(
            next_step(&Outcome::Stale, 3, 3, true),
            retire(TaskState::Failed)
        );
        assert_eq!(next_step(&failed, 1, 3, true), retire(TaskState::Timeout));
        assert_eq!(
            next_step(&failed, 0, 0, false),
            retire(TaskState::Failed),
            "no retries"
        );
    }

    fn readable(fd: std::os::fd::RawFd) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    #[test]
    fn submitters_wake_only_a_parked_worker_and_stop_always_wakes() {
        let h = WorkerHandle::new().unwrap();
        let item = || WorkItem {
            batch: Arc::new(Batch::new(1)),
            task: 0,
            slice: slice(MemoryKind::Host),
        };
        assert!(!h.push([item()]), "no wake-up is counted");
        assert!(
            !readable(h.wake.raw_fd()),
            "a spinning worker needs no wake-up"
        );
        h.parked.store(true, Ordering::SeqCst);
        assert!(h.push([item(), item()]), "the wake-up is counted");
        assert!(readable(h.wake.raw_fd()), "a parked worker is woken");
        assert_eq!(
            h.queue.lock().unwrap().len(),
            3,
            "items queue in order of arrival"
        );
        h.wake.drain();
        h.parked.store(false, Ordering::SeqCst);
        h.stop();
        assert!(h.stop.load(Ordering::SeqCst));
        assert!(readable(h.wake.raw_fd()));
    }
}
