//! One simulated PG run: a few ranks, each the real `Group` (membership, channels,
//! collectives) over the simulated clock and transport, each running the same script
//! of collectives the way `mooncake.pg` calls them (`_pg_torch.py`'s `_execute`: a
//! failure is reconciled and run again over the survivors; the first operation of each
//! new view is an agreement round that leaves an operation some survivor completed),
//! then staying available, reconciling whatever is pending, until every live rank is
//! done. Faults come from the seed (or a scenario): ranks killed, stalled or slowed,
//! writes delayed, writes to the dead failing or landing in their memory.

use std::sync::Arc;
use std::time::Duration;

use mooncake::collective::{DType, Group, GroupOptions, ReduceOp, SyncStatus};
use mooncake::Code;

use super::rng::Rng;
use super::sched::{segment_name, Fault, Net, Sim, SimRank, What, When};

/// The operations a script runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// 16 `i32`s summed: one round, everyone to everyone.
    AllReduceSmall,
    /// 80 KiB of `i32`s summed: a reduce-scatter, then an all-gather (past 64 KiB).
    AllReduceLarge,
    Barrier,
}

impl OpKind {
    fn elements(self) -> usize {
        match self {
            OpKind::AllReduceSmall => 16,
            OpKind::AllReduceLarge => 20 << 10,
            OpKind::Barrier => 0,
        }
    }
}

/// Everything one run is made of.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub seed: u64,
    pub ranks: usize,
    pub ops: Vec<OpKind>,
    /// The group's timeout, in virtual time.
    pub timeout: Duration,
    pub net: Net,
    pub faults: Vec<Fault>,
    /// Ranks whose process is gone before anyone connects (address published).
    pub never_started: Vec<usize>,
    /// `(rank, percent)`: pauses stretched (a slow process).
    pub slow: Vec<(usize, u64)>,
    /// Per mille of clock reads that are scheduling points.
    pub preempt_per_mille: u64,
    /// Bound on the run's virtual time, in timeouts...
    pub limit_timeouts: u32,
    /// ...or this, when given.
    pub limit: Option<Duration>,
}

impl Scenario {
    /// A run drawn from `seed`: 3 to 5 ranks, 6 to 9 operations, fewer than half the
    /// ranks killed, and half the seeds with stalls or slow ranks.
    pub fn draw(seed: u64) -> Scenario {
        let mut rng = Rng::new(seed);
        let ranks = rng.range(3, 5) as usize;
        let timeout = Duration::from_millis(100);
        let ops = (0..rng.range(6, 9))
            .map(|_| match rng.below(10) {
                0..=4 => OpKind::AllReduceSmall,
                5..=7 => OpKind::Barrier,
                _ => OpKind::AllReduceLarge,
            })
            .collect::<Vec<_>>();
        let net = Net {
            inline: rng.chance(300),
            latency_us: [(1, 20), (10, 300), (100, 3_000)][rng.below(3) as usize],
            slow_per_mille: [0, 5, 30][rng.below(3) as usize],
            // Not drawn from `rng`, so every other draw (and the pinned seeds of
            // scenarios.rs) stays as it was before short delays existed.
            slow_us: if seed % 4 == 1 { 3_000 } else { 30_000 },
            dead_writes_land: rng.chance(500),
        };
        let mut faults = Vec::new();
        let mut victims: Vec<usize> = (0..ranks).collect();
        let kills = rng.below((ranks as u64 - 1) / 2 + 1) as usize;
        for _ in 0..kills {
            let rank = victims.remove(rng.below(victims.len() as u64) as usize);
            let when = match rng.below(3) {
                0 => When::Point(rng.range(1, 40 * ops.len() as u64)),
                1 => When::InOp(rng.below(ops.len() as u64)),
                _ => When::AfterWrite {
                    op: rng.below(ops.len() as u64),
                    peer: (rank + 1 + rng.below(ranks as u64 - 1) as usize) % ranks,
                    nth: rng.range(1, 3),
                },
            };
            faults.push(Fault {
                rank,
                when,
                what: What::Kill,
            });
        }
        let mut slow = Vec::new();
        if rng.chance(500) {
            for _ in 0..rng.range(1, 3) {
                let rank = rng.below(ranks as u64) as usize;
                let stall = Duration::from_micros(rng.range(10_000, 250_000));
                let when = if rng.chance(500) {
                    When::Point(rng.range(1, 40 * ops.len() as u64))
                } else {
                    When::InOp(rng.below(ops.len() as u64))
                };
                faults.push(Fault {
                    rank,
                    when,
                    what: What::Stall(stall),
                });
            }
            if rng.chance(300) {
                slow.push((rng.below(ranks as u64) as usize, rng.range(150, 400)));
            }
        }
        Scenario {
            seed,
            ranks,
            ops,
            timeout,
            net,
            faults,
            never_started: Vec::new(),
            slow,
            preempt_per_mille: [0, 20, 200][rng.below(3) as usize],
            limit_timeouts: 600,
            limit: None,
        }
    }

    /// No rank is stalled or slowed and no write is delayed long enough to hide a
    /// proof of life: only deaths and short delays, so a live rank is never left out
    /// and never fails for good. A coordinator gives a suspect a quarter timeout to
    /// show life, and a rank between operations answers within an eighth (its
    /// linger pause), so a write delayed past the other eighth can drop a live rank:
    /// by design (seed 860 of the first draw: 30 ms at a 100 ms timeout).
    pub fn calm(&self) -> bool {
        let delays_hide_life = self.net.slow_per_mille > 0
            && Duration::from_micros(self.net.slow_us) * 8 >= self.timeout;
        self.slow.is_empty()
            && self.faults.iter().all(|f| f.what == What::Kill)
            && !delays_hide_life
    }
}

/// How one operation of a script ended, as `mooncake.pg` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Ran to the end in view (public epoch, members); `failed` is the hint (missed
    /// ranks the reconciliation left out).
    Completed {
        epoch: u64,
        members: Vec<usize>,
        failed: Vec<usize>,
    },
    /// Left: a survivor had completed it (local success false).
    Left { failed: Vec<usize> },
    /// Failed for good.
    Failed { code: Code, why: String },
}

/// What one rank's script gave.
#[derive(Debug, Default)]
pub struct RankLog {
    pub outcomes: Vec<Outcome>,
    /// Invariant breaches seen from inside the rank (wrong results, a live member
    /// named failed after a reconciliation).
    pub breaches: Vec<String>,
    /// The rank was not a member any more when its script ended.
    pub excluded: bool,
    /// Final view: (public epoch, members).
    pub view: (u64, Vec<usize>),
    /// The failed ranks named by the first operation's first failure, if it failed.
    pub first_failed: Option<Vec<usize>>,
}

/// Rank `r`'s input element `i` of operation `op`.
fn input(r: usize, op: usize, i: usize) -> i32 {
    (r as i32 + 1) * 1_000 + op as i32 * 7 + (i % 13) as i32
}

fn encode(values: impl Iterator<Item = i32>) -> Vec<u8> {
    values.flat_map(i32::to_le_bytes).collect()
}

fn members(g: &Group) -> Vec<usize> {
    g.active_ranks()
        .iter()
        .enumerate()
        .filter(|(_, a)| **a)
        .map(|(r, _)| r)
        .collect()
}

/// `mooncake.pg`'s attempts per operation and agreement, and new views entered.
const ATTEMPTS: usize = 3;
const NEW_VIEWS: usize = 16;
/// Most rounds a finished script waits for the others.
const TAIL_ROUNDS: usize = 400;

/// A rank's caller: `_pg_torch.py`'s `_execute` and `_completed_elsewhere`.
struct Caller<'a> {
    g: &'a Group,
    sim: &'a Sim,
    me: usize,
    /// (public epoch, operations run in it).
    ran: (u64, u64),
    log: RankLog,
}

impl Caller<'_> {
    fn run_op(&self, kind: OpKind, op: usize) -> mooncake::Result<()> {
        match kind {
            OpKind::Barrier => self.g.barrier(),
            _ => {
                let n = kind.elements();
                let mut buf = encode((0..n).map(|i| input(self.me, op, i)));
                let before = buf.clone();
                let result = self.g.all_reduce(&mut buf, DType::I32, ReduceOp::Sum);
                match &result {
                    Ok(()) => {
                        let who = members(self.g);
                        let want = encode(
                            (0..n).map(|i| who.iter().map(|&r| input(r, op, i)).sum::<i32>()),
                        );
                        if buf != want {
                            self.breach(format!(
                                "op {op}: all_reduce over {who:?} gave a wrong sum"
                            ));
                        }
                    }
                    Err(_) if buf != before => {
                        self.breach(format!("op {op}: a failed all_reduce changed its buffer"))
                    }
                    Err(_) => {}
                }
                result
            }
        }
    }

    fn breach(&self, why: String) {
        self.sim.note(&[0xb4d, self.me as u64]);
        BREACHES.with(|b| b.borrow_mut().push(format!("rank {}: {why}", self.me)));
    }

    /// Reconciles, and checks that the failed ranks it names are out of the view.
    fn sync(&self) -> mooncake::Result<SyncStatus> {
        let status = self.g.sync_after_failure();
        if let Ok(SyncStatus::Reconciled) = status {
            let active = self.g.active_ranks();
            let blamed: Vec<usize> = self
                .g
                .failed_ranks()
                .into_iter()
                .filter(|&r| active.get(r) == Some(&true))
                .collect();
            if !blamed.is_empty() {
                self.breach(format!(
                    "after reconciling, members {blamed:?} are named failed (view {:?})",
                    members(self.g)
                ));
            }
        }
        status
    }

    fn completed_elsewhere(&mut self) -> mooncake::Result<bool> {
        self.sync()?;
        let epoch = self.g.epoch();
        if epoch == self.ran.0 {
            return Ok(false);
        }
        let (last, position) = self.ran;
        let mine = (last & 0x7f_ffff) << 40 | (position + 1).min((1 << 40) - 1);
        let mut furthest = mine;
        for attempt in 0..ATTEMPTS {
            match self.g.agree_max(mine) {
                Ok(f) => {
                    furthest = f;
                    break;
                }
                Err(e) if attempt + 1 == ATTEMPTS => return Err(e),
                Err(_) => {
                    self.sync()?;
                }
            }
        }
        self.ran = (self.g.epoch(), 0);
        Ok(furthest >> 40 == mine >> 40 && mine < furthest)
    }

    fn ran_one(&mut self) {
        let epoch = self.g.epoch();
        if epoch == self.ran.0 {
            self.ran.1 += 1;
        } else {
            self.ran = (epoch, 1);
        }
    }

    fn excluded(&self, missed: &[usize]) -> Vec<usize> {
        let active = self.g.active_ranks();
        missed
            .iter()
            .copied()
            .filter(|&r| active.get(r) != Some(&true))
            .collect()
    }

    fn execute(&mut self, kind: OpKind, op: usize) -> Outcome {
        let mut missed: Vec<usize> = Vec::new();
        let (mut attempt, mut entered) = (0, 0);
        while attempt < ATTEMPTS {
            let tried = self.completed_elsewhere().and_then(|left| {
                if left {
                    return Ok(true);
                }
                self.run_op(kind, op)?;
                self.ran_one();
                Ok(false)
            });
            let e = match tried {
                Ok(true) => {
                    return Outcome::Left {
                        failed: self.excluded(&missed),
                    }
                }
                Ok(false) => {
                    return Outcome::Completed {
                        epoch: self.g.epoch(),
                        members: members(self.g),
                        failed: self.excluded(&missed),
                    }
                }
                Err(e) => e,
            };
            let member = self.g.active_ranks().get(self.me) == Some(&true);
            if entered < NEW_VIEWS && e.code() == Code::UnavailableInCurrentStatus && member {
                entered += 1;
                continue;
            }
            let failed = self.g.failed_ranks();
            if op == 0 && self.log.first_failed.is_none() {
                self.log.first_failed = Some(failed.clone());
            }
            missed.extend(&failed);
            missed.sort_unstable();
            missed.dedup();
            let may_retry = matches!(e.code(), Code::Timeout | Code::InvalidParams)
                && !failed.is_empty()
                && attempt + 1 < ATTEMPTS;
            let retry = may_retry && !matches!(self.sync(), Ok(SyncStatus::Rejected) | Err(_));
            if !retry {
                return Outcome::Failed {
                    code: e.code(),
                    why: e.to_string(),
                };
            }
            attempt += 1;
        }
        Outcome::Completed {
            epoch: self.g.epoch(),
            members: members(self.g),
            failed: self.excluded(&missed),
        }
    }

    /// After the script: stays available, taking part in whatever change is pending,
    /// until every live rank is done and nothing is pending anywhere.
    fn linger(&self, timeout: Duration) {
        self.sim.at_tail(self.me);
        for _ in 0..TAIL_ROUNDS {
            let status = self.sync();
            let quiet = matches!(status, Ok(SyncStatus::NoPending | SyncStatus::Rejected));
            if self.sim.quiet(self.me, quiet) {
                return;
            }
            // A bounded pause between rounds, whatever the timeout (a day, some runs),
            // and shorter than the quarter timeout a coordinator gives a suspect to
            // show life: PG has no responder of its own between calls, so a rank that
            // polls more slowly than that is dropped while another rank's operation
            // waits on it (seeds 534, 914 with a pause of half the timeout).
            self.sim
                .pause(self.me, (timeout / 8).min(Duration::from_millis(50)));
        }
        self.breach("still reconciling after the script, past its bound".into());
    }
}

thread_local! {
    static BREACHES: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn options(s: &Scenario, r: usize) -> GroupOptions {
    let mut o = GroupOptions::new(r, s.ranks);
    o.timeout = s.timeout;
    o.cells_per_peer = 2;
    o.cell_bytes = 4096;
    o.agree_on_new_view = true;
    o
}

/// What a run gave: each rank's log (`None`: it died), the sim's digest and switches.
pub struct Run {
    pub logs: Vec<Option<RankLog>>,
    pub digest: u64,
    pub switches: u64,
    pub deaths: Vec<Option<(Duration, u64)>>,
}

/// Runs `s` to its end; `Err` when the simulation itself failed (a hang past the
/// bound, a panic).
pub fn run(s: &Scenario) -> Result<Run, String> {
    let limit = s.limit.unwrap_or(s.timeout * s.limit_timeouts);
    let sim = Sim::new(
        s.seed,
        s.ranks,
        s.net.clone(),
        s.faults.clone(),
        s.preempt_per_mille,
        limit,
    );
    for &r in &s.never_started {
        sim.never_started(r);
    }
    for &(r, percent) in &s.slow {
        sim.stretch(r, percent);
    }
    let mut groups = Vec::new();
    for r in 0..s.ranks {
        let seams = || Box::new(SimRank::new(&sim, r));
        let g = Group::with_seams(options(s, r), seams(), seams())
            .map_err(|e| format!("rank {r}: {e}"))?;
        groups.push(g);
    }
    let addresses: Vec<String> = groups.iter().map(Group::address).collect();
    debug_assert!(addresses
        .iter()
        .enumerate()
        .all(|(r, a)| a.starts_with(&segment_name(r))));
    let scripts: Vec<Box<dyn FnOnce() -> RankLog + Send>> = groups
        .into_iter()
        .enumerate()
        .map(|(r, g)| {
            let (sim, addresses, s) = (sim.clone(), addresses.clone(), s.clone());
            Box::new(move || script(&sim, g, r, &addresses, &s)) as Box<_>
        })
        .collect();
    let logs = sim.run(scripts)?;
    let (digest, switches) = sim.digest();
    let deaths = (0..s.ranks).map(|r| sim.death(r)).collect();
    Ok(Run {
        logs,
        digest,
        switches,
        deaths,
    })
}

fn script(sim: &Arc<Sim>, g: Group, r: usize, addresses: &[String], s: &Scenario) -> RankLog {
    BREACHES.with(|b| b.borrow_mut().clear());
    if let Err(e) = g.connect(addresses) {
        BREACHES.with(|b| b.borrow_mut().push(format!("rank {r}: connect: {e}")));
    }
    let mut caller = Caller {
        g: &g,
        sim,
        me: r,
        ran: (g.epoch(), 0),
        log: RankLog::default(),
    };
    for (op, &kind) in s.ops.iter().enumerate() {
        sim.enter_op(r, op as u64);
        let outcome = caller.execute(kind, op);
        sim.note(&[0x0b, r as u64, op as u64, outcome_code(&outcome)]);
        let out =
            matches!(outcome, Outcome::Failed { .. }) && g.active_ranks().get(r) != Some(&true);
        caller.log.outcomes.push(outcome);
        if out {
            break; // not a member any more: it would have to join again
        }
    }
    sim.enter_op(r, s.ops.len() as u64);
    caller.linger(s.timeout);
    let mut log = std::mem::take(&mut caller.log);
    log.excluded = g.active_ranks().get(r) != Some(&true);
    log.view = (g.epoch(), members(&g));
    log.breaches = BREACHES.with(|b| std::mem::take(&mut *b.borrow_mut()));
    drop(caller);
    drop(g);
    log
}

fn outcome_code(o: &Outcome) -> u64 {
    match o {
        Outcome::Completed { epoch, .. } => 1 | epoch << 8,
        Outcome::Left { .. } => 2,
        Outcome::Failed { code, .. } => 3 | (*code as i64 as u64) << 8,
    }
}

/// Checks a finished run's invariants; the first breach found.
pub fn check(s: &Scenario, run: &Run) -> Result<(), String> {
    let dead = |r: usize| run.deaths[r].is_some();
    for log in run.logs.iter().flatten() {
        if let Some(b) = log.breaches.first() {
            return Err(b.clone());
        }
    }
    // Every operation completed in one view has one member set, without the ranks
    // that died before it began.
    let mut views: std::collections::BTreeMap<(usize, u64), (usize, Vec<usize>)> =
        Default::default();
    for (r, log) in run.logs.iter().enumerate() {
        let Some(log) = log else { continue };
        for (op, o) in log.outcomes.iter().enumerate() {
            let Outcome::Completed { epoch, members, .. } = o else {
                continue;
            };
            if let Some((other, seen)) = views.get(&(op, *epoch)) {
                if seen != members {
                    return Err(format!(
                        "op {op} completed at epoch {epoch} over {seen:?} (rank {other}) and \
                         over {members:?} (rank {r})"
                    ));
                }
            } else {
                views.insert((op, *epoch), (r, members.clone()));
            }
            for &m in members {
                if let Some((_, died_in)) = run.deaths[m] {
                    if (op as u64) > died_in || s.never_started.contains(&m) {
                        return Err(format!(
                            "rank {r} completed op {op} with rank {m} a member, which died in \
                             op {died_in}"
                        ));
                    }
                }
            }
        }
    }
    // Survivors end on one view.
    let finals: Vec<(usize, &(u64, Vec<usize>))> = run
        .logs
        .iter()
        .enumerate()
        .filter_map(|(r, l)| l.as_ref().filter(|l| !l.excluded).map(|l| (r, &l.view)))
        .collect();
    if let Some((r0, v0)) = finals.first() {
        for (r, v) in &finals {
            if v != v0 {
                return Err(format!(
                    "survivors disagree: rank {r0} ends on {v0:?}, rank {r} on {v:?}"
                ));
            }
        }
    }
    if s.calm() {
        for (r, log) in run.logs.iter().enumerate() {
            let Some(log) = log else { continue };
            if dead(r) {
                continue;
            }
            if log.excluded {
                return Err(format!(
                    "rank {r} kept running and was left out of the group"
                ));
            }
            // The script's last operation is the one exception: when a death left
            // it done on some ranks and not on others, the ranks done with their
            // script never take part in another collective (a real program would, at
            // its next operation), so the others cannot learn it completed. They
            // must stay members, which is checked above.
            let last = s.ops.len() - 1;
            let done_elsewhere = |op: usize| {
                run.logs.iter().enumerate().any(|(o, l)| {
                    o != r
                        && !dead(o)
                        && l.as_ref()
                            .and_then(|l| l.outcomes.get(op))
                            .is_some_and(|x| {
                                matches!(x, Outcome::Completed { .. } | Outcome::Left { .. })
                            })
                })
            };
            if let Some(o) = log
                .outcomes
                .iter()
                .enumerate()
                .find(|(op, o)| {
                    matches!(o, Outcome::Failed { .. }) && !(*op == last && done_elsewhere(*op))
                })
                .map(|(_, o)| o)
            {
                return Err(format!(
                    "rank {r} kept running and an operation failed: {o:?}"
                ));
            }
            if log.outcomes.len() != s.ops.len() {
                return Err(format!("rank {r} ran {} operations", log.outcomes.len()));
            }
        }
    }
    Ok(())
}
