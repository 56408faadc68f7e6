//! The `store` policy: the trace replayed against the real master, in process, with no
//! bytes moved. The master is the one `mooncake master` and `mooncake demo` run (the
//! server's default configuration: allocator, eviction, leases, watermarks), on a
//! manual clock that follows the trace's timestamps; its housekeeping tick runs every
//! server tick period of trace time, with the nodes' heartbeats before it.
//!
//! Each request goes through the master as `mooncake demo` sends it through a client
//! (see `replay.rs`): probe which blocks exist (no lease), read the longest stored
//! prefix (`GetReplicas`, which leases and touches), then write the missing blocks from
//! the first one not hit (`PutStart` and `PutEnd` batches). The hit is the prefix read.

use mooncake_base::Code;
use mooncake_store::master::Clock;
use mooncake_store::protocol::{KeyResult, ReplicateConfig, Request, Response, SegmentInfo};
use mooncake_store::{Master, ServerConfig};

use super::plan::Plan;
use super::policies::Tally;
use crate::replay::{blocks_to_write, stored_prefix, Block};

/// The pure client that reads and writes (it lends no memory, as in the demo).
const WRITER: u64 = 0x5157_0000;

/// Figures beyond the hit rates.
#[derive(Clone, Debug, Default)]
pub struct StoreFigures {
    /// Bytes lent to the pool (all segments).
    pub pool_bytes: u64,
    /// Segments mounted.
    pub segments: u64,
    /// The most objects stored at once.
    pub peak_objects: u64,
    /// Mean share of the pool's bytes in use over the last half of the requests.
    pub mean_used_last_half: f64,
    /// Objects evicted.
    pub evictions: u64,
    /// Puts refused for lack of space.
    pub puts_rejected: u64,
}

/// How the pool is laid out.
pub struct StoreSetup {
    /// Bytes of one block object.
    pub block_bytes: u64,
    /// Segments the pool is split into (as many nodes lending memory).
    pub segments: u64,
}

/// Mounts `capacity` blocks of `setup.block_bytes` over `setup.segments` segments and
/// replays `plan`.
pub fn run(
    plan: &Plan,
    capacity: u64,
    setup: &StoreSetup,
) -> Result<(Tally, StoreFigures), String> {
    let server = ServerConfig::default();
    let clock = Clock::manual();
    let master = Master::with_clock(server.master.clone(), clock.clone());
    let pool = capacity
        .checked_mul(setup.block_bytes)
        .ok_or("the pool's size overflows")?;
    let max_segment = master.config().max_segment_size;
    let segments = setup.segments.max(pool.div_ceil(max_segment)).max(1);
    let slab = master
        .config()
        .allocator
        .for_segment(pool / segments)
        .slab_size;
    if pool / segments < slab {
        return Err(format!(
            "store: {capacity} blocks of {} bytes ({pool} bytes) in {segments} segment(s) leave each \
             less than one allocator slab ({slab} bytes); give a larger capacity or fewer segments",
            setup.block_bytes
        ));
    }
    let mut clients = Vec::new();
    for i in 0..segments {
        let size = pool / segments + u64::from(i < pool % segments);
        let client = i + 1;
        let segment = SegmentInfo {
            name: format!("sim-node-{i}"),
            base: (i + 1) << 46,
            size,
        };
        master
            .mount(client, segment)
            .map_err(|e| format!("store: mounting a segment: {e}"))?;
        clients.push(client);
    }
    // The writer lends no memory; like the demo's client, it introduces itself with a
    // heartbeat, and keeps beating (every client pings more often than a tick).
    clients.push(WRITER);
    master.ping(WRITER);
    let tick_ms = (server.tick.as_millis() as u64).max(1);
    let mut replay = Replay {
        master: &master,
        block_bytes: setup.block_bytes,
        tally: Tally::default(),
        figures: StoreFigures {
            pool_bytes: pool,
            segments,
            ..StoreFigures::default()
        },
        errors: Vec::new(),
    };
    let first = plan.timestamps_ms.first().copied().unwrap_or(0.0);
    let mut last_tick = clock.now_ms();
    let mut used_sum = 0.0;
    for r in 0..plan.requests() {
        // The manual clock starts at 1 ms and only moves forward.
        let due = 1 + (plan.timestamps_ms[r] - first).max(0.0).round() as u64;
        let now = clock.now_ms();
        if due > now {
            clock.advance(due - now);
        }
        if clock.now_ms() - last_tick >= tick_ms {
            for &c in &clients {
                master.ping(c);
            }
            master.tick();
            last_tick = clock.now_ms();
        }
        replay.request(plan, r);
        let s = master.stats();
        replay.figures.peak_objects = replay.figures.peak_objects.max(s.objects);
        if r >= plan.warmup {
            used_sum += s.used as f64 / s.capacity.max(1) as f64;
        }
        // Under pressure before the measured half: something was evicted or refused.
        if r < plan.warmup && (s.evicted_objects > 0 || replay.figures.puts_rejected > 0) {
            replay.tally.filled = true;
        }
    }
    let measured = (plan.requests() - plan.warmup).max(1);
    replay.figures.mean_used_last_half = used_sum / measured as f64;
    replay.figures.evictions = master.stats().evicted_objects;
    match replay.errors.first() {
        None => Ok((replay.tally, replay.figures)),
        Some(e) => Err(format!(
            "store: {} error(s) from the master, first: {e}",
            replay.errors.len()
        )),
    }
}

struct Replay<'a> {
    master: &'a Master,
    block_bytes: u64,
    tally: Tally,
    figures: StoreFigures,
    errors: Vec<String>,
}

impl Replay<'_> {
    fn call(&mut self, req: Request) -> Option<Response> {
        match self.master.handle(req) {
            Ok(r) => Some(r),
            Err(e) => {
                self.errors.push(e.to_string());
                None
            }
        }
    }

    fn failed(&mut self, what: &str, key: &str, code: Code) -> Block {
        self.errors.push(format!("{what} {key}: {code:?}"));
        Block::Failed
    }

    fn request(&mut self, plan: &Plan, r: usize) {
        let keys: Vec<String> = plan.ids[plan.range(r)]
            .iter()
            .map(|id| format!("sim-{id}"))
            .collect();
        // Probe: which blocks exist (no lease taken).
        let mut blocks: Vec<Block> = match self.call(Request::Exists { keys: keys.clone() }) {
            Some(Response::Exists(found)) => found
                .into_iter()
                .zip(&keys)
                .map(|(f, k)| match f {
                    Ok(true) => Block::Present,
                    Ok(false) => Block::Missing,
                    Err(c) => self.failed("exists", k, c),
                })
                .collect(),
            _ => vec![Block::Failed; keys.len()],
        };
        // Read the stored prefix: a lease and a touch for each.
        let stored = stored_prefix(&blocks);
        if stored > 0 {
            let want = keys[..stored].to_vec();
            let got: Vec<KeyResult<()>> = match self.call(Request::GetReplicas { keys: want }) {
                Some(Response::GetReplicas(v)) => v.into_iter().map(|x| x.map(|_| ())).collect(),
                _ => vec![Err(Code::Internal); stored],
            };
            for (i, g) in got.into_iter().enumerate() {
                blocks[i] = match g {
                    Ok(()) => Block::Read,
                    // Gone between probe and read: a miss, written again.
                    Err(Code::ObjectNotFound | Code::ReplicaIsNotReady) => Block::Missing,
                    Err(c) => self.failed("read", &keys[i], c),
                };
            }
        }
        let hit = blocks.iter().take_while(|b| **b == Block::Read).count();
        self.tally.add(plan, r, hit);
        // Write what is missing from the first block not hit on.
        let todo = blocks_to_write(&blocks, hit);
        if todo.is_empty() {
            return;
        }
        let items = todo
            .iter()
            .map(|&i| (keys[i].clone(), self.block_bytes))
            .collect();
        let started = match self.call(Request::PutStart {
            client: WRITER,
            items,
            config: ReplicateConfig::default(),
            upsert: false,
        }) {
            Some(Response::PutStart(v)) => v,
            _ => return,
        };
        let mut ends = Vec::new();
        for (&i, s) in todo.iter().zip(started) {
            match s {
                Ok(_) => ends.push((keys[i].clone(), 0u32)),
                Err(Code::ObjectAlreadyExists) => {}
                Err(Code::NoAvailableHandle) => self.figures.puts_rejected += 1,
                Err(c) => {
                    self.failed("put", &keys[i], c);
                }
            }
        }
        if ends.is_empty() {
            return;
        }
        if let Some(Response::PerKey(v)) = self.call(Request::PutEnd {
            client: WRITER,
            items: ends.clone(),
        }) {
            for ((k, _), e) in ends.iter().zip(v) {
                if let Err(c) = e {
                    self.failed("put end", k, c);
                }
            }
        }
    }
}
