//! One simulated cluster: the real master (on a manual clock) and a few store client
//! processes, each lending a segment of simulated node memory and running puts, gets
//! and removes. Everything happens in one thread, ordered by an event queue; every
//! random choice comes from one seeded PRNG, so a seed replays exactly.
//!
//! The network between clients and master drops, duplicates and delays messages;
//! processes crash (their memory is gone), restart (a new client id, fresh memory),
//! pause past their TTL, and the master restarts (it has no recovery yet, so a restart
//! loses all its state: then only the safety invariants are asserted).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::time::Duration;

use mooncake::store::master::{Clock, Master, MasterConfig};
use mooncake::store::protocol::{
    ObjectDesc, ReplicaDesc, ReplicateConfig, Request, Response, SegmentInfo,
};
use mooncake::util::crc32c::crc32c;
use mooncake::Code;

use super::rng::{value, Rng};

const SEGMENT_SIZE: u64 = 2 << 20;
const LEASE_MS: u64 = 2_000;
const CLIENT_TTL_MS: u64 = 10_000;
const DISCARD_MS: u64 = 10_000;
const RELEASE_MS: u64 = 60_000;
/// A client gives up on an RPC answered later than this.
const RPC_TIMEOUT_MS: u64 = 3_000;
const PING_EVERY_MS: u64 = 1_000;
const TICK_EVERY_MS: u64 = 500;
const CHECK_EVERY_MS: u64 = 1_000;
/// Pauses (and the writes they hold up) stay well under the release timeout: a
/// writer never writes into space after the master may have given it to someone
/// else (the documented contract).
const MAX_PAUSE_MS: u64 = 2 * CLIENT_TTL_MS;
/// Longest a write a pause interrupted takes to finish once its process resumes.
const MAX_RESUMED_WRITE_MS: u64 = 5_000;
const KEYS: u64 = 48;

/// What can go wrong in one run; drawn from the seed.
#[derive(Clone, Debug)]
pub struct Faults {
    /// Per mille of messages lost.
    pub drop: u64,
    /// Per mille of requests delivered twice.
    pub duplicate: u64,
    /// Largest one-way message delay.
    pub max_delay_ms: u64,
    /// Per mille of process steps that crash the process.
    pub crash: u64,
    /// Per mille of process steps that pause it (up to twice the client TTL).
    pub pause: u64,
    /// Whether the master restarts (losing its state) during the run.
    pub master_restart: bool,
}

impl Faults {
    pub fn draw(rng: &mut Rng) -> Faults {
        Faults {
            drop: [0, 5, 50][rng.below(3) as usize],
            duplicate: [0, 5, 50][rng.below(3) as usize],
            max_delay_ms: [1, 50, 1_500][rng.below(3) as usize],
            crash: [0, 2, 10][rng.below(3) as usize],
            pause: [0, 2, 10][rng.below(3) as usize],
            master_restart: rng.chance(200),
        }
    }
}

/// Figures of one run, and a digest of everything that happened in it (equal digests:
/// the run replayed exactly).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub events: u64,
    pub committed: u64,
    pub reads_ok: u64,
    pub reads_refused: u64,
    pub digest: u64,
}

/// One version of one key, as its writer wrote it.
struct Version {
    version: u64,
    size: u64,
    crc: u32,
    /// `(segment, addr, len, incarnation of the node written to)` per piece.
    pieces: Vec<(String, u64, u64, u64)>,
}

/// The operation a process is waiting on (one at a time, besides its pings).
enum Op {
    Mount,
    PutStart {
        key: String,
        version: u64,
    },
    /// PutStart answered: the bytes go out at the next `DataWrite`.
    Write {
        key: String,
        version: u64,
        replicas: Vec<ReplicaDesc>,
    },
    PutEnd,
    Revoke,
    Get {
        key: String,
    },
    Remove,
}

/// A store client process: lends one segment and runs one operation at a time.
struct Process {
    /// Segment name: stays the same across restarts, as a node's address would.
    name: String,
    client: u64,
    incarnation: u64,
    base: u64,
    /// Node memory lent to the pool; empty while the process is dead.
    memory: Vec<u8>,
    alive: bool,
    paused_until: u64,
    mounted: bool,
    op: Option<(u64, Op)>,
    op_deadline: u64,
}

/// What happens next; process events carry `(process, incarnation)` and are void
/// once that incarnation died.
enum Event {
    /// A request arriving at the master.
    ToMaster {
        from: usize,
        incarnation: u64,
        id: u64,
        req: Request,
    },
    /// The master's answer arriving at a process.
    ToProcess {
        to: usize,
        incarnation: u64,
        id: u64,
        handled_ms: u64,
        answer: Result<Response, Code>,
    },
    /// The process takes its next step.
    Wake(usize, u64),
    /// The process's heartbeat.
    Ping(usize, u64),
    /// The writer moves the bytes of its put (the operation with this request id).
    DataWrite(usize, u64, u64),
    /// A crashed process comes back: new client id, fresh memory.
    Restart(usize),
    Tick,
    Check,
    MasterRestart,
}

pub struct World {
    rng: Rng,
    faults: Faults,
    clock: Clock,
    master: Master,
    procs: Vec<Process>,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: BTreeMap<u64, Event>,
    seq: u64,
    next_id: u64,
    next_version: u64,
    /// Every version written so far, by key.
    versions: BTreeMap<String, Vec<Version>>,
    /// Each version's size, from its PutStart on.
    version_size: BTreeMap<u64, u64>,
    master_restarted: bool,
    summary: Summary,
}

fn master_config() -> MasterConfig {
    MasterConfig {
        lease_ttl: Duration::from_millis(LEASE_MS),
        client_ttl: Duration::from_millis(CLIENT_TTL_MS),
        put_start_discard_timeout: Duration::from_millis(DISCARD_MS),
        put_start_release_timeout: Duration::from_millis(RELEASE_MS),
        shards: 8,
        ..MasterConfig::default()
    }
}

impl World {
    pub fn new(seed: u64) -> World {
        let mut rng = Rng::new(seed);
        let faults = Faults::draw(&mut rng);
        let clock = Clock::manual();
        let master = Master::with_clock(master_config(), clock.clone());
        let n = rng.range(2, 4) as usize;
        let procs = (0..n)
            .map(|i| Process {
                name: format!("node-{i}"),
                client: rng.next() | 1,
                incarnation: 0,
                base: (1 << 40) + ((i as u64) << 32),
                memory: vec![0; SEGMENT_SIZE as usize],
                alive: true,
                paused_until: 0,
                mounted: false,
                op: None,
                op_deadline: 0,
            })
            .collect();
        let mut w = World {
            rng,
            faults,
            clock,
            master,
            procs,
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            seq: 0,
            next_id: 1,
            next_version: 1,
            versions: BTreeMap::new(),
            version_size: BTreeMap::new(),
            master_restarted: false,
            summary: Summary::default(),
        };
        for i in 0..w.procs.len() {
            w.at(0, Event::Wake(i, 0));
            w.at(0, Event::Ping(i, 0));
        }
        w.at(TICK_EVERY_MS, Event::Tick);
        w.at(CHECK_EVERY_MS, Event::Check);
        if w.faults.master_restart {
            let when = w.rng.range(5_000, 25_000);
            w.at(when, Event::MasterRestart);
        }
        w
    }

    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    fn at(&mut self, delay_ms: u64, e: Event) {
        let when = self.now() + delay_ms;
        self.seq += 1;
        self.queue.push(Reverse((when, self.seq)));
        self.events.insert(self.seq, e);
    }

    fn note(&mut self, what: u64) {
        // FNV-1a over everything observable: equal digests, equal runs.
        self.summary.digest = (self.summary.digest ^ what).wrapping_mul(0x0100_0000_01B3);
    }

    /// Runs `duration_ms` of simulated time with faults, then quiesces and checks that
    /// every byte the pool lent comes back.
    pub fn run(mut self, duration_ms: u64) -> Result<Summary, String> {
        self.summary.digest = 0xCBF2_9CE4_8422_2325;
        while let Some(Reverse((when, seq))) = self.queue.pop() {
            if when > duration_ms {
                break;
            }
            let e = self.events.remove(&seq).expect("queued event");
            self.clock.advance(when - self.now());
            self.summary.events += 1;
            self.note(when ^ (seq << 20));
            self.step(e)?;
        }
        self.quiesce()?;
        Ok(self.summary)
    }

    fn step(&mut self, e: Event) -> Result<(), String> {
        match e {
            Event::ToMaster {
                from,
                incarnation,
                id,
                req,
            } => {
                let answer = self.master.handle(req).map_err(|e| e.code());
                self.note(match &answer {
                    Ok(_) => 1,
                    Err(c) => *c as i64 as u64,
                });
                let handled_ms = self.now();
                self.send(Event::ToProcess {
                    to: from,
                    incarnation,
                    id,
                    handled_ms,
                    answer,
                });
            }
            Event::ToProcess {
                to,
                incarnation,
                id,
                handled_ms,
                answer,
            } => {
                if let Some(later) = self.held(to, incarnation) {
                    let e = Event::ToProcess {
                        to,
                        incarnation,
                        id,
                        handled_ms,
                        answer,
                    };
                    self.at(later, e);
                } else if self.procs[to].alive && self.procs[to].incarnation == incarnation {
                    self.answer(to, id, handled_ms, answer)?;
                }
            }
            Event::Wake(p, inc) => {
                if let Some(later) = self.held(p, inc) {
                    self.at(later, Event::Wake(p, inc));
                } else if self.procs[p].alive && self.procs[p].incarnation == inc {
                    self.wake(p);
                    let next = self.rng.range(20, 400);
                    self.at(next, Event::Wake(p, inc));
                }
            }
            Event::Ping(p, inc) => {
                if let Some(later) = self.held(p, inc) {
                    self.at(later, Event::Ping(p, inc));
                } else if self.procs[p].alive && self.procs[p].incarnation == inc {
                    let client = self.procs[p].client;
                    self.request(p, Request::Ping { client });
                    self.at(PING_EVERY_MS, Event::Ping(p, inc));
                }
            }
            Event::DataWrite(p, inc, id) => {
                if let Some(later) = self.held(p, inc) {
                    // A transfer a pause interrupted finishes a while after the
                    // process resumed: its remount may come first.
                    let finish = self.rng.range(0, MAX_RESUMED_WRITE_MS);
                    self.at(later + finish, Event::DataWrite(p, inc, id));
                } else if self.procs[p].alive && self.procs[p].incarnation == inc {
                    self.write(p, id);
                }
            }
            Event::Restart(p) => self.restart(p),
            Event::Tick => {
                self.master.tick();
                self.at(TICK_EVERY_MS, Event::Tick);
            }
            Event::Check => {
                self.check_pool()?;
                self.at(CHECK_EVERY_MS, Event::Check);
            }
            Event::MasterRestart => {
                // No recovery exists yet: the new master knows nothing; processes learn
                // it from their next ping and mount again.
                self.master = Master::with_clock(master_config(), self.clock.clone());
                self.master_restarted = true;
            }
        }
        Ok(())
    }

    /// While a process is paused its events wait: how long, if it is.
    fn held(&self, p: usize, inc: u64) -> Option<u64> {
        let proc = &self.procs[p];
        (proc.alive && proc.incarnation == inc && proc.paused_until > self.now())
            .then(|| proc.paused_until - self.now())
    }

    /// Schedules a message, unless the network loses it.
    fn send(&mut self, e: Event) {
        if self.rng.chance(self.faults.drop) {
            self.note(0xD50);
            return;
        }
        let delay = self.rng.range(0, self.faults.max_delay_ms);
        self.at(delay, e);
    }

    fn request(&mut self, p: usize, req: Request) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let incarnation = self.procs[p].incarnation;
        if self.rng.chance(self.faults.duplicate) {
            let copy = Event::ToMaster {
                from: p,
                incarnation,
                id,
                req: req.clone(),
            };
            self.send(copy);
        }
        self.send(Event::ToMaster {
            from: p,
            incarnation,
            id,
            req,
        });
        id
    }

    fn start(&mut self, p: usize, req: Request, op: Op) {
        let id = self.request(p, req);
        self.procs[p].op = Some((id, op));
        self.procs[p].op_deadline = self.now() + RPC_TIMEOUT_MS;
    }

    /// A process's next step: maybe a fault, else continue or start an operation.
    fn wake(&mut self, p: usize) {
        if self.rng.chance(self.faults.crash) {
            self.crash(p);
            return;
        }
        if self.rng.chance(self.faults.pause) {
            let pause = self.rng.range(1, MAX_PAUSE_MS);
            self.procs[p].paused_until = self.now() + pause;
            self.note(0xA05E ^ pause);
            return;
        }
        if self.procs[p].op.is_some() {
            if self.now() >= self.procs[p].op_deadline {
                self.procs[p].op = None; // gave up; the outcome is unknown
            }
            return;
        }
        let client = self.procs[p].client;
        if !self.procs[p].mounted {
            let segment = SegmentInfo {
                name: self.procs[p].name.clone(),
                base: self.procs[p].base,
                size: SEGMENT_SIZE,
            };
            self.start(p, Request::Mount { client, segment }, Op::Mount);
            return;
        }
        let key = format!("key-{}", self.rng.below(KEYS));
        match self.rng.below(100) {
            0..=44 => {
                let version = self.next_version;
                self.next_version += 1;
                let size = match self.rng.below(50) {
                    0 => self.rng.range(200 << 10, 500 << 10),
                    1..=9 => self.rng.range(4 << 10, 64 << 10),
                    _ => self.rng.range(1, 4 << 10),
                };
                self.version_size.insert(version, size);
                let config = ReplicateConfig {
                    replica_num: self.rng.range(1, 3) as u32,
                    ..ReplicateConfig::default()
                };
                let upsert = self.rng.chance(500);
                let req = Request::PutStart {
                    client,
                    items: vec![(key.clone(), size)],
                    config,
                    upsert,
                };
                self.start(p, req, Op::PutStart { key, version });
            }
            45..=84 => {
                self.start(
                    p,
                    Request::GetReplicas {
                        keys: vec![key.clone()],
                    },
                    Op::Get { key },
                );
            }
            85..=98 => {
                let force = self.rng.chance(300);
                self.start(p, Request::Remove { key, force }, Op::Remove);
            }
            _ => {
                let force = self.rng.chance(500);
                self.start(p, Request::RemoveAll { force }, Op::Remove);
            }
        }
    }

    fn answer(
        &mut self,
        p: usize,
        id: u64,
        handled_ms: u64,
        answer: Result<Response, Code>,
    ) -> Result<(), String> {
        if let Ok(Response::Ping { need_remount }) = answer {
            if need_remount {
                self.procs[p].mounted = false;
            }
            return Ok(());
        }
        // Only the answer to the operation in progress counts (duplicates, late
        // answers to abandoned operations and pings' errors are dropped).
        if self.procs[p].op.as_ref().map(|(i, _)| *i) != Some(id) {
            return Ok(());
        }
        let (_, op) = self.procs[p].op.take().expect("checked");
        match (op, answer) {
            (Op::Mount, Ok(Response::Done)) => self.procs[p].mounted = true,
            (Op::PutStart { key, version }, Ok(Response::PutStart(mut r))) => {
                if let Some(Ok(replicas)) = r.pop() {
                    self.procs[p].op = Some((
                        id,
                        Op::Write {
                            key,
                            version,
                            replicas,
                        },
                    ));
                    self.procs[p].op_deadline = u64::MAX;
                    let inc = self.procs[p].incarnation;
                    let delay = self.rng.range(0, 30);
                    self.at(delay, Event::DataWrite(p, inc, id));
                }
            }
            (Op::PutEnd, Ok(Response::PerKey(r))) => {
                if matches!(r.first(), Some(Ok(()))) {
                    self.summary.committed += 1;
                }
            }
            (Op::Get { key }, Ok(Response::GetReplicas(mut r))) => {
                if let Some(Ok(desc)) = r.pop() {
                    let within_lease = self.now() < handled_ms + desc.lease_ms;
                    self.read(&key, &desc, within_lease)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Where a piece's bytes live now: the live process serving `segment`, if `addr`
    /// is inside what it lent.
    fn locate(&self, segment: &str, addr: u64, len: u64) -> Option<(usize, usize)> {
        let p = self
            .procs
            .iter()
            .position(|q| q.alive && q.name == segment)?;
        let q = &self.procs[p];
        let off = addr.checked_sub(q.base)?;
        (off.checked_add(len)? <= SEGMENT_SIZE).then_some((p, off as usize))
    }

    /// The writer moves its value into every replica, then ends (or revokes) the put.
    fn write(&mut self, p: usize, id: u64) {
        let (key, version, replicas) = match self.procs[p].op.take() {
            Some((
                op_id,
                Op::Write {
                    key,
                    version,
                    replicas,
                },
            )) if op_id == id => (key, version, replicas),
            other => {
                self.procs[p].op = other;
                return;
            }
        };
        let size = self.version_size[&version];
        let bytes = value(version, size);
        let mut pieces = Vec::new();
        let mut failed = false;
        for r in &replicas {
            let mut at = 0usize;
            for piece in &r.pieces {
                let len = piece.len as usize;
                match self.locate(&piece.segment, piece.addr, piece.len) {
                    Some((q, off)) if at + len <= bytes.len() => {
                        self.procs[q].memory[off..off + len].copy_from_slice(&bytes[at..at + len]);
                        let inc = self.procs[q].incarnation;
                        pieces.push((piece.segment.to_string(), piece.addr, piece.len, inc));
                    }
                    _ => failed = true,
                }
                at += len;
            }
            failed |= at != bytes.len();
        }
        let client = self.procs[p].client;
        if failed {
            self.start(
                p,
                Request::PutRevoke {
                    client,
                    keys: vec![key],
                },
                Op::Revoke,
            );
            return;
        }
        let crc = crc32c(&bytes);
        let list = self.versions.entry(key.clone()).or_default();
        list.push(Version {
            version,
            size,
            crc,
            pieces,
        });
        self.start(
            p,
            Request::PutEnd {
                client,
                items: vec![(key, crc)],
            },
            Op::PutEnd,
        );
    }

    /// A reader: tries the replicas in order, verifying each as the real client does.
    /// Safety: bytes that pass the checksum are one of the key's written versions.
    /// Liveness: a replica still in the memory its writer wrote, read within the
    /// lease, is readable (unless a master restart voided the master's knowledge).
    fn read(&mut self, key: &str, desc: &ObjectDesc, within_lease: bool) -> Result<(), String> {
        let candidates = self.versions.get(key).map(Vec::as_slice).unwrap_or(&[]);
        let served = candidates
            .iter()
            .find(|v| v.crc == desc.crc32c && v.size == desc.size);
        for r in &desc.replicas {
            let mut bytes = Vec::with_capacity(desc.size as usize);
            let mut reachable = true;
            for piece in &r.pieces {
                match self.locate(&piece.segment, piece.addr, piece.len) {
                    Some((q, off)) => bytes
                        .extend_from_slice(&self.procs[q].memory[off..off + piece.len as usize]),
                    None => reachable = false,
                }
            }
            if !reachable || bytes.len() as u64 != desc.size {
                continue;
            }
            if crc32c(&bytes) == desc.crc32c {
                let written = candidates.iter().any(|v| {
                    v.size == desc.size && v.crc == desc.crc32c && value(v.version, v.size) == bytes
                });
                if !written {
                    return Err(format!(
                        "{key}: read {} bytes that no writer wrote (crc {:#x})",
                        bytes.len(),
                        desc.crc32c
                    ));
                }
                self.summary.reads_ok += 1;
                self.note(0x12EAD);
                return Ok(());
            }
            self.summary.reads_refused += 1;
            let live = served.is_some_and(|v| {
                r.pieces.iter().all(|piece| {
                    v.pieces.iter().any(|(s, a, l, inc)| {
                        **s == *piece.segment
                            && *a == piece.addr
                            && *l == piece.len
                            && self
                                .procs
                                .iter()
                                .any(|q| q.alive && &q.name == s && q.incarnation == *inc)
                    })
                })
            });
            if live && within_lease && !self.master_restarted {
                return Err(format!(
                    "{key}: a committed replica {:?} in live memory fails its checksum",
                    r.pieces
                ));
            }
        }
        Ok(())
    }

    /// The process dies and its memory with it; half the time it first unmounts (a
    /// clean shutdown), else the master learns only when its TTL runs out.
    fn crash(&mut self, p: usize) {
        if self.procs[p].mounted && self.rng.chance(500) {
            let client = self.procs[p].client;
            let name = self.procs[p].name.clone();
            self.request(p, Request::Unmount { client, name });
        }
        let proc = &mut self.procs[p];
        proc.alive = false;
        proc.memory = Vec::new();
        proc.op = None;
        self.note(0xC2A5 ^ p as u64);
        let back = self.rng.range(500, 3 * CLIENT_TTL_MS);
        self.at(back, Event::Restart(p));
    }

    fn restart(&mut self, p: usize) {
        let client = self.rng.next() | 1;
        let moved = self.rng.chance(500);
        let proc = &mut self.procs[p];
        proc.alive = true;
        proc.incarnation += 1;
        proc.client = client;
        if moved {
            proc.base += SEGMENT_SIZE;
        }
        proc.memory = vec![0; SEGMENT_SIZE as usize];
        proc.paused_until = 0;
        proc.mounted = false;
        let inc = proc.incarnation;
        self.at(0, Event::Wake(p, inc));
        self.at(0, Event::Ping(p, inc));
    }

    /// The master's books, checked at any moment: listed pieces lie inside their
    /// segment and never overlap, each segment uses at least what is listed on it,
    /// and the object count matches the keys.
    fn check_pool(&mut self) -> Result<(), String> {
        let segments = self.master.all_segments();
        let mut ranges: BTreeMap<&str, Vec<(u64, u64, String)>> = BTreeMap::new();
        let keys = self.master.all_keys();
        let stats = self.master.stats();
        if stats.objects != keys.len() as u64 {
            return Err(format!(
                "master counts {} objects but lists {} keys",
                stats.objects,
                keys.len()
            ));
        }
        let queried: Vec<_> = keys
            .iter()
            .filter_map(|k| self.master.query(k).map(|q| (k.clone(), q)))
            .collect();
        for (key, (_, _, replicas)) in &queried {
            for piece in replicas.iter().flat_map(|r| &r.pieces) {
                let Some((info, _, _)) =
                    segments.iter().find(|(i, _, _)| *i.name == *piece.segment)
                else {
                    return Err(format!(
                        "{key} has a piece on unmounted segment {}",
                        piece.segment
                    ));
                };
                if piece.addr < info.base || piece.addr + piece.len > info.base + info.size {
                    return Err(format!("{key}: piece {piece:?} outside segment {info:?}"));
                }
                ranges.entry(info.name.as_str()).or_default().push((
                    piece.addr,
                    piece.len,
                    key.clone(),
                ));
            }
        }
        for (name, list) in &mut ranges {
            list.sort();
            for pair in list.windows(2) {
                if pair[0].0 + pair[0].1 > pair[1].0 {
                    return Err(format!(
                        "{name}: {} and {} overlap: {:?}",
                        pair[0].2, pair[1].2, pair
                    ));
                }
            }
            let listed: u64 = list.iter().map(|x| x.1).sum();
            let used = segments
                .iter()
                .find(|(i, _, _)| i.name == *name)
                .map_or(0, |s| s.2);
            if listed > used {
                return Err(format!(
                    "{name}: {listed} bytes listed but only {used} in use"
                ));
            }
        }
        self.note(stats.used ^ (stats.objects << 32));
        Ok(())
    }

    /// Ends the run: every process resumes and stays up, messages in flight arrive,
    /// then everything is removed and every timeout passes. Each segment must then
    /// use no bytes at all: nothing leaked.
    fn quiesce(&mut self) -> Result<(), String> {
        self.faults = Faults {
            drop: 0,
            duplicate: 0,
            max_delay_ms: 1,
            crash: 0,
            pause: 0,
            master_restart: false,
        };
        let pending: Vec<Event> = std::mem::take(&mut self.events).into_values().collect();
        self.queue.clear();
        for e in pending {
            if let Event::ToMaster { req, .. } = e {
                let _ = self.master.handle(req);
            }
        }
        self.check_pool()?;
        for _ in 0..3 {
            let _ = self.master.handle(Request::RemoveAll { force: true });
            self.clock.advance(RELEASE_MS + LEASE_MS + 1);
            // Keep every segment's owner alive through the wait.
            for p in &self.procs {
                let _ = self.master.handle(Request::Ping { client: p.client });
            }
            self.master.tick();
        }
        let stats = self.master.stats();
        for (info, _, used) in self.master.all_segments() {
            if used != 0 {
                return Err(format!(
                    "segment {} still uses {used} bytes with no object stored ({stats:?})",
                    info.name
                ));
            }
        }
        if stats.objects != 0 || stats.used != 0 {
            return Err(format!(
                "pool not empty after removing everything: {stats:?}"
            ));
        }
        Ok(())
    }
}
