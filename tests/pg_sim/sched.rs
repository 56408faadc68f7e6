//! The simulated machine under the ranks: one OS thread per rank, but only the one
//! holding the baton runs. Every clock pause (and, by the seed's draw, a clock read)
//! is a scheduling point: the rank's next wake-up goes into virtual time and the rank
//! due first runs next (ties drawn from the seed). Writes between ranks are delivered
//! into the peer's buffer in virtual time, by whichever thread moves time past them,
//! while every rank thread is parked; so a seed decides the whole run.
//!
//! A killed rank parks for good (its writes in flight are lost); at the end of the run
//! every parked thread unwinds with [`Unwound`] (no panic message), its clock then
//! answering "far in the future" and never pausing, so its `Group` drops quickly.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mooncake::collective::{Clock, Transport};
use mooncake::engine::{BatchId, SegmentId, TaskState};
use mooncake::{Code, Error, Request, Result};

use super::rng::Rng;

/// The virtual time of the run in progress, in µs, for the debug log's timestamps.
pub static VIRTUAL_NOW_US: AtomicU64 = AtomicU64::new(0);

/// The payload a parked rank thread unwinds with when the run ends.
pub struct Unwound;

/// When a fault strikes a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    /// At its n-th scheduling point (1-based).
    Point(u64),
    /// At its first scheduling point in the script's operation `op`.
    InOp(u64),
    /// At its caller's pause just before the library call of operation `op` (after
    /// the caller checked for a pending change; see [`Sim::before_call`]).
    AtCall(u64),
    /// Right after it posts its `nth` data write (a write longer than a credit word)
    /// to `peer` in operation `op`; the rest of that batch is never posted.
    AfterWrite { op: u64, peer: usize, nth: u64 },
}

/// What a fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum What {
    /// The process dies: it never runs again and its writes in flight are lost.
    Kill,
    /// The process is descheduled this long (a loaded host).
    Stall(Duration),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    pub rank: usize,
    pub when: When,
    pub what: What,
}

/// How the network behaves; drawn from the seed.
#[derive(Clone, Debug)]
pub struct Net {
    /// Writes are made on the caller's thread at once (same-host copies) instead of
    /// being posted and landing later.
    pub inline: bool,
    /// Latency of a posted write, uniform in this range (µs).
    pub latency_us: (u64, u64),
    /// Per mille of posted writes that take up to `slow_us` instead.
    pub slow_per_mille: u64,
    pub slow_us: u64,
    /// A write to a dead rank lands (its shared memory lives on) instead of failing.
    pub dead_writes_land: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Runnable,
    Dead,
    Finished,
}

struct RankState {
    status: Status,
    wake: Duration,
    points: u64,
    /// The script's operation (set by the script as each starts).
    op: u64,
    /// Data writes to each peer within the current operation.
    writes_in_op: Vec<u64>,
    /// Percent its pauses are stretched by (a slow rank: 100 is none).
    stretch: u64,
    /// A kill decided inside a post, taken at the next scheduling point.
    dying: bool,
    /// Virtual time it died at.
    died_at: Option<Duration>,
    died_in_op: Option<u64>,
    /// Its script is done and it only stays available (see `quiet`).
    at_tail: bool,
    /// Its last reconciliation at the tail found nothing pending.
    quiet: bool,
    /// It is at its caller's pause before a library call (see `Sim::before_call`).
    at_call: bool,
}

struct Task {
    state: TaskState,
}

/// A posted write on its way.
struct Delivery {
    src: usize,
    dst: usize,
    batch: BatchId,
    task: usize,
    /// The bytes, when they came from outside the sender's buffer (copied at post);
    /// else read from the sender's buffer as they land, as an engine would.
    bytes: Option<Vec<u8>>,
    local: u64,
    remote: u64,
    len: usize,
}

struct World {
    now: Duration,
    running: Option<usize>,
    ranks: Vec<RankState>,
    rng: Rng,
    faults: Vec<(Fault, bool)>,
    net: Net,
    /// Per mille of clock reads that are also scheduling points.
    preempt_per_mille: u64,
    limit: Duration,
    deliveries: BTreeMap<(Duration, u64), Delivery>,
    sequence: u64,
    batches: HashMap<BatchId, Vec<Task>>,
    next_batch: BatchId,
    /// Each rank's buffer: (address, bytes). Never freed before the world.
    buffers: Vec<Option<(Box<[u64]>, usize)>>,
    digest: u64,
    switches: u64,
    points: u64,
    shutdown: bool,
    failure: Option<String>,
}

/// The shared simulated machine.
pub struct Sim {
    world: Mutex<World>,
    turns: Vec<Condvar>,
    idle: Condvar,
    base: Instant,
    reads_outside: std::sync::atomic::AtomicU64,
}

/// Most scheduling points in one run (a livelock guard next to the time bound).
const MAX_POINTS: u64 = 20_000_000;

fn mix(h: u64, x: u64) -> u64 {
    let mut z = (h ^ x).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl World {
    fn note(&mut self, words: &[u64]) {
        for &w in words {
            self.digest = mix(self.digest, w);
        }
    }

    fn fail(&mut self, why: String) {
        if self.failure.is_none() {
            self.failure = Some(why);
        }
        self.shutdown = true;
    }

    fn kill(&mut self, r: usize) {
        let rank = &mut self.ranks[r];
        if rank.status != Status::Runnable {
            return;
        }
        rank.status = Status::Dead;
        rank.died_at = Some(self.now);
        rank.died_in_op = Some(rank.op);
        // Writes it posted before are on the wire and still land.
        let now = self.now.as_nanos() as u64;
        self.note(&[0xdead, r as u64, now]);
    }

    /// Lands every write due by now, in time order.
    fn deliver_due(&mut self) {
        while let Some(entry) = self.deliveries.first_entry() {
            if entry.key().0 > self.now {
                break;
            }
            let d = entry.remove();
            let state = self.land(&d);
            if let Some(task) = self
                .batches
                .get_mut(&d.batch)
                .and_then(|tasks| tasks.get_mut(d.task))
            {
                task.state = state;
            }
        }
    }

    /// Makes one write: copies the bytes into the destination's buffer unless it is
    /// dead (and its memory does not take writes in this run).
    fn land(&mut self, d: &Delivery) -> TaskState {
        let dead = self.ranks[d.dst].status == Status::Dead;
        let landed = if dead && !self.net.dead_writes_land {
            TaskState::Failed
        } else {
            match self.target(d.dst, d.remote, d.len) {
                Some(dst) => {
                    match &d.bytes {
                        // SAFETY: `dst` has `len` bytes (checked); the bytes are ours.
                        Some(b) => unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), dst, d.len) },
                        // SAFETY: the sender's buffer holds `local..local + len`
                        // (checked at post) and lives as long as the world; no rank
                        // thread runs while we copy.
                        None => unsafe {
                            std::ptr::copy_nonoverlapping(d.local as *const u8, dst, d.len)
                        },
                    }
                    TaskState::Completed
                }
                None => TaskState::Failed,
            }
        };
        let now = self.now.as_nanos() as u64;
        self.note(&[
            0x1a4d,
            d.src as u64,
            d.dst as u64,
            d.remote - self.base_of(d.dst),
            d.len as u64,
            landed as u64,
            now,
        ]);
        landed
    }

    fn base_of(&self, r: usize) -> u64 {
        self.buffers[r]
            .as_ref()
            .map_or(0, |(b, _)| b.as_ptr() as u64)
    }

    /// The destination of a write of `len` bytes at `remote` in rank `r`'s buffer.
    fn target(&self, r: usize, remote: u64, len: usize) -> Option<*mut u8> {
        let (buf, size) = self.buffers.get(r)?.as_ref()?;
        let base = buf.as_ptr() as u64;
        let end = remote.checked_add(len as u64)?;
        (remote >= base && end <= base + *size as u64).then_some(remote as *mut u8)
    }

    /// Whether `local..local + len` lies in rank `r`'s own buffer.
    fn owns(&self, r: usize, local: u64, len: usize) -> bool {
        self.target(r, local, len).is_some()
    }

    /// Picks who runs next: the runnable rank due first (ties from the seed), moving
    /// time to it and landing the writes due by then.
    fn switch(&mut self, sim: &Sim) {
        if self.shutdown {
            return;
        }
        let due = self
            .ranks
            .iter()
            .filter(|r| r.status == Status::Runnable)
            .map(|r| r.wake)
            .min();
        let Some(due) = due else {
            self.running = None;
            sim.idle.notify_all();
            return;
        };
        let tied: Vec<usize> = (0..self.ranks.len())
            .filter(|&r| self.ranks[r].status == Status::Runnable && self.ranks[r].wake == due)
            .collect();
        let next = tied[self.rng.below(tied.len() as u64) as usize];
        self.now = self.now.max(due);
        VIRTUAL_NOW_US.store(self.now.as_micros() as u64, Ordering::Relaxed);
        self.deliver_due();
        if self.now > self.limit {
            let why = format!(
                "virtual time passed its bound of {:?}: a rank hangs (ranks {:?})",
                self.limit,
                self.ranks
                    .iter()
                    .map(|r| (r.status, r.op))
                    .collect::<Vec<_>>()
            );
            self.fail(why);
            sim.wake_all();
            return;
        }
        if self.running != Some(next) {
            self.switches += 1;
            let now = self.now.as_nanos() as u64;
            self.note(&[0x5c4e, next as u64, now]);
        }
        self.running = Some(next);
        sim.turns[next].notify_one();
    }

    /// Applies the faults due for rank `r` now; returns the stall to add.
    fn strike(&mut self, r: usize) -> Duration {
        let mut stall = Duration::ZERO;
        let (points, op, at_call) = (
            self.ranks[r].points,
            self.ranks[r].op,
            self.ranks[r].at_call,
        );
        for i in 0..self.faults.len() {
            let (f, fired) = self.faults[i];
            if fired || f.rank != r {
                continue;
            }
            let due = match f.when {
                When::Point(n) => points >= n,
                When::InOp(k) => op == k,
                When::AtCall(k) => at_call && op == k,
                When::AfterWrite { .. } => false,
            };
            if !due {
                continue;
            }
            self.faults[i].1 = true;
            match f.what {
                What::Kill => self.kill(r),
                What::Stall(d) => {
                    stall += d;
                    let now = self.now.as_nanos() as u64;
                    self.note(&[0x57a1, r as u64, d.as_nanos() as u64, now]);
                }
            }
        }
        if std::mem::take(&mut self.ranks[r].dying) {
            self.kill(r);
        }
        stall
    }
}

impl Sim {
    /// A machine for `ranks` ranks; `dead` never start (their addresses refuse).
    pub fn new(
        seed: u64,
        ranks: usize,
        net: Net,
        faults: Vec<Fault>,
        preempt_per_mille: u64,
        limit: Duration,
    ) -> Arc<Sim> {
        let states = (0..ranks)
            .map(|_| RankState {
                status: Status::Runnable,
                wake: Duration::ZERO,
                points: 0,
                op: 0,
                writes_in_op: vec![0; ranks],
                stretch: 100,
                dying: false,
                died_at: None,
                died_in_op: None,
                at_tail: false,
                quiet: false,
                at_call: false,
            })
            .collect();
        Arc::new(Sim {
            world: Mutex::new(World {
                now: Duration::ZERO,
                running: None,
                ranks: states,
                rng: Rng::new(seed ^ 0x5eed_5c4e),
                faults: faults.into_iter().map(|f| (f, false)).collect(),
                net,
                preempt_per_mille,
                limit,
                deliveries: BTreeMap::new(),
                sequence: 0,
                batches: HashMap::new(),
                next_batch: 1,
                buffers: (0..ranks).map(|_| None).collect(),
                digest: seed,
                switches: 0,
                points: 0,
                shutdown: false,
                failure: None,
            }),
            turns: (0..ranks).map(|_| Condvar::new()).collect(),
            idle: Condvar::new(),
            base: Instant::now(),
            reads_outside: Default::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wake_all(&self) {
        for t in &self.turns {
            t.notify_all();
        }
        self.idle.notify_all();
    }

    /// Rank `r` never starts: its address is published but refuses connections.
    pub fn never_started(&self, r: usize) {
        let mut w = self.lock();
        w.ranks[r].status = Status::Dead;
        w.ranks[r].died_at = Some(Duration::ZERO);
        w.ranks[r].died_in_op = Some(0);
    }

    /// Stretches every pause of rank `r` to `percent` (a slow process).
    pub fn stretch(&self, r: usize, percent: u64) {
        self.lock().ranks[r].stretch = percent.max(100);
    }

    /// The script of rank `r` starts operation `op`: a scheduling point, where the
    /// faults of that operation strike.
    pub fn enter_op(&self, r: usize, op: u64) {
        {
            let mut w = self.lock();
            let rank = &mut w.ranks[r];
            rank.op = op;
            rank.writes_in_op.iter_mut().for_each(|n| *n = 0);
        }
        self.point(r, Duration::from_micros(5));
    }

    /// Rank `r`'s caller is about to make a library call: the time a Python caller
    /// spends between its check for a pending change and the call (a scheduling
    /// point, where `When::AtCall` faults strike), so a peer's announcement can land
    /// in between, as it can on a real host.
    pub fn before_call(&self, r: usize) {
        self.lock().ranks[r].at_call = true;
        self.point(r, Duration::from_micros(20));
        self.lock().ranks[r].at_call = false;
    }

    /// Rank `r`'s script is done; it stays available until every live rank is.
    pub fn at_tail(&self, r: usize) {
        self.lock().ranks[r].at_tail = true;
    }

    /// Records whether rank `r` found nothing pending; true once every live rank is
    /// at its tail and found nothing pending (then no change can start any more).
    pub fn quiet(&self, r: usize, quiet: bool) -> bool {
        let mut w = self.lock();
        w.ranks[r].quiet = quiet;
        quiet
            && w.ranks
                .iter()
                .all(|x| x.status != Status::Runnable || x.at_tail && x.quiet)
    }

    /// Pauses rank `r` (a scheduling point).
    pub fn pause(&self, r: usize, duration: Duration) {
        self.point(r, duration);
    }

    /// A script event, folded into the run's digest.
    pub fn note(&self, words: &[u64]) {
        self.lock().note(words);
    }

    /// Where rank `r` died: (virtual time, script operation), if it did.
    pub fn death(&self, r: usize) -> Option<(Duration, u64)> {
        let w = self.lock();
        let rank = &w.ranks[r];
        rank.died_at.zip(rank.died_in_op)
    }

    /// Ends the run: parked threads unwind.
    fn end(&self, w: &mut World) {
        w.shutdown = true;
        self.wake_all();
    }

    /// Ends the run of a thread that cannot go on: unwinds unless it already is.
    fn leave(&self) {
        if !std::thread::panicking() {
            std::panic::resume_unwind(Box::new(Unwound));
        }
    }

    /// Whether calls of rank `r` are outside the scheduled run now (the run is over, or
    /// the rank's script is): they neither wait nor pause.
    fn outside(w: &World, r: usize) -> bool {
        w.shutdown || w.ranks[r].status == Status::Finished
    }

    /// Parks the calling thread (rank `r`) until it holds the baton.
    fn wait_turn<'a>(&'a self, mut w: MutexGuard<'a, World>, r: usize) {
        while !(w.shutdown || w.running == Some(r) && w.ranks[r].status == Status::Runnable) {
            w = self.turns[r].wait(w).unwrap_or_else(|e| e.into_inner());
        }
        if w.shutdown {
            drop(w);
            self.leave();
        }
    }

    /// The first wait of rank `r`'s thread, before its script.
    pub fn enter(&self, r: usize) {
        let w = self.lock();
        self.wait_turn(w, r);
    }

    /// A scheduling point of rank `r` that pauses it `pause` of virtual time.
    pub fn point(&self, r: usize, pause: Duration) {
        let mut w = self.lock();
        if Self::outside(&w, r) {
            let cut_short = w.shutdown && w.ranks[r].status != Status::Finished;
            drop(w);
            if cut_short {
                self.leave();
            }
            return;
        }
        w.points += 1;
        if w.points > MAX_POINTS {
            w.fail(format!(
                "more than {MAX_POINTS} scheduling points: a livelock"
            ));
            self.end(&mut w);
            drop(w);
            self.leave();
            return;
        }
        w.ranks[r].points += 1;
        let stall = w.strike(r);
        let pause = pause.max(Duration::from_micros(1));
        let jitter = w.rng.below(pause.as_nanos() as u64 / 4 + 1);
        let stretched = (pause.as_nanos() as u64 + jitter) * w.ranks[r].stretch / 100;
        let wake = w.now + Duration::from_nanos(stretched) + stall;
        w.ranks[r].wake = wake;
        w.switch(self);
        self.wait_turn(w, r);
    }

    /// Spawns one thread per script, runs them to the end (every rank finished or
    /// dead), and returns what each finished script gave, or why the run failed.
    pub fn run<T: Send + 'static>(
        self: &Arc<Sim>,
        scripts: Vec<Box<dyn FnOnce() -> T + Send>>,
    ) -> std::result::Result<Vec<Option<T>>, String> {
        let threads: Vec<_> = scripts
            .into_iter()
            .enumerate()
            .map(|(r, script)| {
                let sim = self.clone();
                std::thread::Builder::new()
                    .name(format!("sim-rank-{r}"))
                    .spawn(move || {
                        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            sim.enter(r);
                            script()
                        }));
                        let mut w = sim.lock();
                        match result {
                            Ok(v) => {
                                w.ranks[r].status = Status::Finished;
                                w.note(&[0xf1, r as u64]);
                                if w.running == Some(r) {
                                    w.switch(&sim);
                                }
                                Some(v)
                            }
                            Err(p) if p.is::<Unwound>() => None,
                            Err(p) => {
                                let why = p
                                    .downcast_ref::<String>()
                                    .cloned()
                                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                                    .unwrap_or_default();
                                w.fail(format!("rank {r} panicked: {why}"));
                                sim.end(&mut w);
                                None
                            }
                        }
                    })
                    .expect("spawn a rank thread")
            })
            .collect();
        {
            let mut w = self.lock();
            w.switch(self);
            // Bounded in real time too: a run that stops moving is a simulator bug.
            let started = Instant::now();
            while !w.shutdown && w.running.is_some() {
                if started.elapsed() > Duration::from_secs(300) {
                    w.fail("no progress in 300 s of real time".into());
                    break;
                }
                w = self
                    .idle
                    .wait_timeout(w, Duration::from_secs(1))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            self.end(&mut w);
        }
        let results: Vec<Option<T>> = threads
            .into_iter()
            .map(|t| t.join().ok().flatten())
            .collect();
        match self.lock().failure.clone() {
            Some(why) => Err(why),
            None => Ok(results),
        }
    }

    /// The run's digest (equal digests: the same run) and its count of switches.
    pub fn digest(&self) -> (u64, u64) {
        let w = self.lock();
        (w.digest, w.switches)
    }
}

/// Rank `r`'s clock and transport: its view of the simulated machine.
pub struct SimRank {
    pub sim: Arc<Sim>,
    pub rank: usize,
    pub name: String,
}

impl SimRank {
    pub fn new(sim: &Arc<Sim>, rank: usize) -> SimRank {
        SimRank {
            sim: sim.clone(),
            rank,
            name: segment_name(rank),
        }
    }
}

/// The segment name of rank `r`.
pub fn segment_name(r: usize) -> String {
    format!("sim-rank-{r}")
}

fn rank_of(name: &str) -> Option<usize> {
    name.strip_prefix("sim-rank-")?.parse().ok()
}

/// Far past any deadline of the run. Outside the run, each clock read moves an hour
/// further, so every wait (even one whose deadline was read outside) ends at once.
const BEYOND: Duration = Duration::from_secs(1 << 40);

impl Sim {
    fn beyond(&self) -> Instant {
        let hours = self
            .reads_outside
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.base + BEYOND + Duration::from_secs(3600 * hours)
    }
}

impl Clock for SimRank {
    fn now(&self) -> Instant {
        let mut w = self.sim.lock();
        if Sim::outside(&w, self.rank) {
            return self.sim.beyond();
        }
        let per_mille = w.preempt_per_mille;
        if w.rng.chance(per_mille) {
            drop(w);
            self.sim.point(self.rank, Duration::from_micros(1));
            w = self.sim.lock();
            if Sim::outside(&w, self.rank) {
                return self.sim.beyond();
            }
        }
        self.sim.base + w.now
    }

    fn backoff(&self, idle: u32) {
        let pause = if idle < 32 {
            Duration::from_micros(20)
        } else if idle < 128 {
            Duration::from_micros(200)
        } else {
            Duration::from_millis(1)
        };
        self.sim.point(self.rank, pause);
    }

    fn sleep(&self, duration: Duration) {
        self.sim.point(self.rank, duration);
    }
}

impl Transport for SimRank {
    fn segment_name(&self) -> &str {
        &self.name
    }

    fn allocate_buffer(&self, len: usize) -> Result<u64> {
        let mut w = self.sim.lock();
        let buf = vec![0u64; len.div_ceil(8)].into_boxed_slice();
        let addr = buf.as_ptr() as u64;
        w.buffers[self.rank] = Some((buf, len));
        Ok(addr)
    }

    fn open_segment(&self, name: &str) -> Result<SegmentId> {
        let w = self.sim.lock();
        match rank_of(name) {
            Some(r) if r < w.ranks.len() && w.ranks[r].status != Status::Dead => Ok(r as u64 + 1),
            _ => Err(Error::new(
                Code::TransferFail,
                format!("{name}: connection refused"),
            )),
        }
    }

    fn refuses_connections(&self, name: &str) -> bool {
        let w = self.sim.lock();
        rank_of(name).is_none_or(|r| r >= w.ranks.len() || w.ranks[r].status == Status::Dead)
    }

    fn resync_segment(&self, _segment: SegmentId) -> Result<()> {
        Ok(())
    }

    unsafe fn write_inline(&self, requests: &[Request]) -> Option<Result<Vec<TaskState>>> {
        let mut w = self.sim.lock();
        if !w.net.inline || Sim::outside(&w, self.rank) {
            return None;
        }
        let mut states = Vec::with_capacity(requests.len());
        for (t, req) in requests.iter().enumerate() {
            if w.ranks[self.rank].status != Status::Runnable || w.ranks[self.rank].dying {
                // Died in the middle of its post: the rest never happens.
                states.push(TaskState::Failed);
                continue;
            }
            match self.delivery(&mut w, req, 0, t) {
                Some(d) => states.push(w.land(&d)),
                None => states.push(TaskState::Failed),
            }
        }
        Some(Ok(states))
    }

    unsafe fn submit(&self, requests: &[Request]) -> Result<BatchId> {
        let mut w = self.sim.lock();
        if Sim::outside(&w, self.rank) {
            return Err(Error::new(Code::TransferFail, "the run is over"));
        }
        let batch = w.next_batch;
        w.next_batch += 1;
        let mut tasks = Vec::with_capacity(requests.len());
        for (t, req) in requests.iter().enumerate() {
            let alive = w.ranks[self.rank].status == Status::Runnable && !w.ranks[self.rank].dying;
            let delivery = if alive {
                self.delivery(&mut w, req, batch, t)
            } else {
                None
            };
            let Some(d) = delivery else {
                tasks.push(Task {
                    state: if alive {
                        TaskState::Failed
                    } else {
                        TaskState::Pending
                    },
                });
                continue;
            };
            let net = w.net.clone();
            let latency = if w.rng.chance(net.slow_per_mille) {
                w.rng
                    .range(net.latency_us.1, net.slow_us.max(net.latency_us.1))
            } else {
                w.rng.range(net.latency_us.0, net.latency_us.1)
            };
            let at = w.now + Duration::from_micros(latency);
            w.sequence += 1;
            let key = (at, w.sequence);
            w.deliveries.insert(key, d);
            tasks.push(Task {
                state: TaskState::Pending,
            });
        }
        w.batches.insert(batch, tasks);
        Ok(batch)
    }

    fn task_state(&self, batch: BatchId, task: usize) -> Result<TaskState> {
        let w = self.sim.lock();
        w.batches
            .get(&batch)
            .and_then(|tasks| tasks.get(task))
            .map(|t| t.state)
            .ok_or_else(|| Error::invalid(format!("batch {batch} task {task}")))
    }

    fn free_batch(&self, batch: BatchId) {
        self.sim.lock().batches.remove(&batch);
    }

    fn wait_batch(&self, batch: BatchId, timeout: Duration) {
        let deadline = self.now() + timeout;
        loop {
            let settled = {
                let w = self.sim.lock();
                w.batches
                    .get(&batch)
                    .is_none_or(|tasks| tasks.iter().all(|t| t.state.is_final()))
            };
            if settled || self.now() >= deadline {
                return;
            }
            self.sim.point(self.rank, Duration::from_micros(100));
        }
    }
}

impl SimRank {
    /// The write `req` of task `task` of `batch`, checked; counts it against the
    /// rank's write faults (which may kill it right after). `None`: refused.
    fn delivery(
        &self,
        w: &mut World,
        req: &Request,
        batch: BatchId,
        task: usize,
    ) -> Option<Delivery> {
        let dst = (req.segment as usize).checked_sub(1)?;
        let len = usize::try_from(req.len).ok()?;
        w.target(dst, req.remote, len)?;
        let bytes = (!w.owns(self.rank, req.local, len)).then(|| {
            // SAFETY: a local range outside our buffer is the caller's memory, valid
            // for the call (the transport's contract).
            unsafe { std::slice::from_raw_parts(req.local as *const u8, len) }.to_vec()
        });
        if len > 8 {
            let rank = &mut w.ranks[self.rank];
            rank.writes_in_op[dst] += 1;
            let (op, nth) = (rank.op, rank.writes_in_op[dst]);
            let due = w.faults.iter().position(|(f, fired)| {
                !fired
                    && f.rank == self.rank
                    && f.what == What::Kill
                    && f.when == When::AfterWrite { op, peer: dst, nth }
            });
            if let Some(i) = due {
                w.faults[i].1 = true;
                w.ranks[self.rank].dying = true;
            }
        }
        Some(Delivery {
            src: self.rank,
            dst,
            batch,
            task,
            bytes,
            local: req.local,
            remote: req.remote,
            len,
        })
    }
}
