//! `mooncake demo` and `mooncake replay`: replay a KV-cache trace (the FAST'25
//! conversation trace format) against the store. `demo` first starts a whole cluster in
//! this process (a master, two store nodes, a pure client, all on loopback); `replay`
//! joins a running cluster as a pure client.
//!
//! Each hash id of the trace is one 512-token KV block, stored as one object whose
//! bytes derive from the id, so every read is verified. Per request: probe which blocks
//! exist (no lease taken), read the longest stored prefix in one batch, then write the
//! missing rest in one batch.

use std::io::Write;
use std::time::{Duration, Instant};

use super::args::Args;
use super::trace::{self, Request as TraceRequest};
use mooncake_base::json::Value;
use mooncake_base::util::{percentile, size};
use mooncake_base::Code;
use mooncake_engine::EngineConfig;
use mooncake_store::protocol::PoolStats;
use mooncake_store::{Client, ClientConfig, MasterServer, ReplicateConfig, ServerConfig};

/// Tokens per KV block (the trace's hash-id granularity).
const TOKENS_PER_BLOCK: u64 = 512;
/// One block of a real 8B model: 128 KiB of KV cache per token × 512 tokens.
const REAL_BLOCK_BYTES: u64 = (128 << 10) * TOKENS_PER_BLOCK;
/// Errors whose messages are kept for the report.
const KEPT_ERRORS: usize = 5;
/// The pool's use is sampled every this many requests of the last half.
const IDLE_SAMPLE_EVERY: usize = 64;

/// Settings shared by `demo` and `replay`.
struct Options {
    /// `None`: the shipped trace (built in).
    trace: Option<String>,
    limit: Option<usize>,
    block_bytes: u64,
    /// Arrival times are replayed scaled by this; 0 = as fast as possible.
    time_scale: f64,
    json: bool,
    replicate: ReplicateConfig,
}

fn options(a: &Args) -> Result<Options, String> {
    let block_bytes: u64 = a.get("block-bytes", 64 << 10)?;
    if block_bytes == 0 || block_bytes % 8 != 0 {
        return Err(format!(
            "--block-bytes must be a positive multiple of 8 (got {block_bytes})"
        ));
    }
    let limit = match a.str("requests") {
        None => None,
        Some(_) => Some(a.get::<usize>("requests", 0)?),
    };
    let time_scale: f64 = a.get("time-scale", 0.0)?;
    if !time_scale.is_finite() || time_scale < 0.0 {
        return Err(format!(
            "--time-scale must be a non-negative number (got {time_scale})"
        ));
    }
    let replica_num: u32 = a.get("replicas", 1)?;
    if replica_num == 0 {
        return Err("--replicas must be at least 1".into());
    }
    Ok(Options {
        trace: a.str("trace").map(str::to_owned),
        limit,
        block_bytes,
        time_scale,
        json: a.flag("json")?,
        replicate: ReplicateConfig {
            replica_num,
            ..ReplicateConfig::default()
        },
    })
}

// ---------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------

/// `mooncake demo`: an embedded cluster on loopback, then the replay.
pub fn demo(raw: &[String]) -> Result<(), String> {
    let a = Args::parse(raw)?;
    let opts = options(&a)?;
    let pool: u64 = a.get("pool-size", 3 << 30)?;
    let protocol = a.str("protocol").unwrap_or("auto").to_owned();
    let engine = super::engine_tuning(&a)?;
    let ssd = DemoDisk::from_args(&a)?;
    a.finish()?;
    if pool < 2 * opts.block_bytes {
        return Err(format!(
            "--pool-size must hold at least two blocks (got {pool} bytes)"
        ));
    }
    let trace = trace::load(opts.trace.as_deref(), opts.limit)?;
    let lease = demo_lease(opts.time_scale);
    let cluster = Cluster::start(pool, lease, &protocol, &engine, ssd.as_ref())?;
    if !opts.json {
        println!("{}", cluster.describe());
    }
    run(&cluster.client, &opts, &trace, "demo")
}

/// `mooncake replay`: the same replay as a pure client of a running cluster.
pub fn replay(raw: &[String]) -> Result<(), String> {
    let a = Args::parse(raw)?;
    let opts = options(&a)?;
    let mut cfg = super::store::client_config(&a)?;
    a.finish()?;
    super::store::metadata_from_master(&a, &mut cfg)?;
    let trace = trace::load(opts.trace.as_deref(), opts.limit)?;
    let client = Client::new(cfg).map_err(|e| format!("connecting to the cluster: {e}"))?;
    run(&client, &opts, &trace, "replay")
}

/// Replays `trace`, prints the summary, and fails when any error occurred.
fn run(client: &Client, opts: &Options, trace: &[TraceRequest], label: &str) -> Result<(), String> {
    let before = client.stats().map_err(|e| format!("pool stats: {e}"))?;
    if before.capacity == 0 {
        return Err("the pool has no memory (no store node is mounted)".into());
    }
    let mut replayer = Replayer::new(client, opts, trace);
    let started = Instant::now();
    replayer.replay(trace);
    let seconds = started.elapsed().as_secs_f64();
    let after = client.stats().map_err(|e| format!("pool stats: {e}"))?;
    let summary = Summary::new(opts, &replayer.stats, &before, &after, seconds);
    if opts.json {
        println!("{}", summary.to_json());
    } else {
        // Is the hit rate good? The same requests through LRU and through the best
        // possible cache of the same capacity (block ids only: instant).
        let reference = super::simulate::reference_rates(
            opts.trace.as_deref(),
            opts.limit,
            summary.capacity_blocks,
        )
        .map_err(|e| log::warn!("reference hit rates: {e}"))
        .ok();
        summary.print(label, trace::name(opts.trace.as_deref()), reference);
    }
    let _ = std::io::stdout().flush();
    let s = &replayer.stats;
    for msg in &s.error_messages {
        eprintln!("error: {msg}");
    }
    match s.errors {
        0 => Ok(()),
        n => Err(format!("{n} error(s) during the replay")),
    }
}

// ---------------------------------------------------------------------------
// The embedded cluster
// ---------------------------------------------------------------------------

/// The demo's disk tier (`--ssd-size BYTES [--ssd-path DIR]`), split between the two
/// nodes; a directory the demo made for it is removed at the end.
struct DemoDisk {
    dir: std::path::PathBuf,
    size: u64,
    made: bool,
}

impl DemoDisk {
    fn from_args(a: &Args) -> Result<Option<DemoDisk>, String> {
        let size: u64 = a.get("ssd-size", 0)?;
        if size == 0 {
            return Ok(None);
        }
        if size < (8 << 20) {
            return Err("--ssd-size must be at least 8M (shared by the two nodes)".into());
        }
        let (dir, made) = match a.str("ssd-path") {
            Some(d) => (std::path::PathBuf::from(d), false),
            None => (
                std::env::temp_dir().join(format!("mooncake-demo-ssd-{}", std::process::id())),
                true,
            ),
        };
        Ok(Some(DemoDisk { dir, size, made }))
    }

    /// The disk tier of node `i`.
    fn node(&self, i: usize) -> mooncake_store::disk::DiskConfig {
        mooncake_store::disk::DiskConfig::new(self.dir.join(format!("node-{i}")), self.size / 2)
    }
}

impl Drop for DemoDisk {
    fn drop(&mut self) {
        if self.made {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The shortest read lease the demo gives, and the one for a replay as fast as it can
/// go (50-110x the trace's pace): enough for a batch read on a loaded machine, including
/// one from descriptors the client kept (it stops using them an eighth of the lease
/// before its end; at 200-300 ms, reads of a paced replay outlived their leases), and
/// a minute or two of trace time, which moves no figure (bench/README.md).
const MIN_DEMO_LEASE: Duration = Duration::from_secs(1);

/// The demo master's read lease: the server's default lease of *trace* time on the
/// replay's clock (`--time-scale`), at least `MIN_DEMO_LEASE`, never longer than the
/// default. Unscaled, a 10 s lease covers a seventh of a fast replay, pins that share
/// of the read blocks in place and makes the hit rate depend on the machine's speed.
fn demo_lease(time_scale: f64) -> Duration {
    if time_scale <= 0.0 {
        return MIN_DEMO_LEASE;
    }
    let default = ServerConfig::default().master.lease_ttl;
    default.mul_f64(time_scale.min(1.0)).max(MIN_DEMO_LEASE)
}

/// Fields drop in order: the client first, then the nodes, then the master.
struct Cluster {
    client: Client,
    nodes: Vec<Client>,
    server: MasterServer,
}

impl Cluster {
    fn start(
        pool: u64,
        lease: Duration,
        protocol: &str,
        engine: &EngineConfig,
        ssd: Option<&DemoDisk>,
    ) -> Result<Cluster, String> {
        let mut server_config = ServerConfig {
            bind: [127, 0, 0, 1].into(),
            rpc_port: 0,
            metadata_port: Some(0),
            metrics_port: Some(0),
            cluster_secret: engine.cluster_secret.clone(),
            ..ServerConfig::default()
        };
        server_config.master.lease_ttl = lease;
        // The allocator carves segments into whole slabs; a smaller segment holds nothing.
        let slab = server_config
            .master
            .allocator
            .for_segment(pool / 2)
            .slab_size;
        if pool / 2 < slab {
            return Err(format!(
                "--pool-size {pool}: each of the two nodes would get less than one allocator slab \
                 ({slab} bytes); use at least {}",
                2 * slab
            ));
        }
        let server =
            MasterServer::start(server_config).map_err(|e| format!("starting the master: {e}"))?;
        let metadata = server
            .metadata_url()
            .ok_or("the master has no metadata server")?;
        let mut engine = engine.clone();
        engine
            .set("metadata", &metadata)
            .map_err(|e| e.to_string())?;
        engine
            .set("protocol", protocol)
            .map_err(|e| e.to_string())?;
        let config = |segment: u64| ClientConfig {
            master_address: server.rpc_addr().to_string(),
            global_segment_size: segment,
            engine: engine.clone(),
            ..ClientConfig::default()
        };
        let halves = [pool / 2, pool - pool / 2];
        let nodes = halves
            .iter()
            .enumerate()
            .map(|(i, &size)| {
                let node = ClientConfig {
                    disk: ssd.map(|d| d.node(i)),
                    ..config(size)
                };
                Client::new(node).map_err(|e| format!("starting a store node: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let client = Client::new(config(0)).map_err(|e| format!("starting the client: {e}"))?;
        Ok(Cluster {
            client,
            nodes,
            server,
        })
    }

    fn describe(&self) -> String {
        let mut s = format!("cluster: master rpc={}", self.server.rpc_addr());
        if let Some(url) = self.server.metadata_url() {
            s += &format!(" metadata={url}");
        }
        if let Some(addr) = self.server.admin_addr() {
            s += &format!(" metrics=http://{addr}/metrics");
        }
        for n in &self.nodes {
            s += &format!("\n         node {}", n.hostname());
            if let Some(d) = &n.config().disk {
                s += &format!(" + disk tier {} bytes at {}", d.quota, d.dir.display());
            }
        }
        s + &format!("\n         client {}", self.client.hostname())
    }
}

// ---------------------------------------------------------------------------
// Block contents
// ---------------------------------------------------------------------------

fn key_of(block_bytes: u64, hash_id: u64) -> String {
    // The size is part of the key: replays with other block sizes never collide.
    format!("trace-{block_bytes}-{hash_id}")
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Word `j` of block `hash_id`: unique per block and position.
const STRIDE: u64 = 0xD1B5_4A32_D192_ED03;

/// Words filled or checked side by side: eight independent running values (one per
/// lane) let the compiler use vector registers; one word at a time, filling every
/// byte written and checking every byte read took about a tenth of the replaying
/// thread's cycles in a profile.
const LANES: usize = 8;

/// The first `LANES` words of block `hash_id`, and the step from one group of
/// `LANES` words to the next.
fn first_words(hash_id: u64) -> ([u64; LANES], u64) {
    let base = splitmix64(hash_id);
    let lanes = std::array::from_fn(|i| base.wrapping_add((i as u64).wrapping_mul(STRIDE)));
    (lanes, STRIDE.wrapping_mul(LANES as u64))
}

fn fill_block(words: &mut [u64], hash_id: u64) {
    let (mut next, step) = first_words(hash_id);
    let mut groups = words.chunks_exact_mut(LANES);
    for group in &mut groups {
        for (w, n) in group.iter_mut().zip(&mut next) {
            *w = *n;
            *n = n.wrapping_add(step);
        }
    }
    for (w, n) in groups.into_remainder().iter_mut().zip(next) {
        *w = n;
    }
}

fn block_matches(words: &[u64], hash_id: u64) -> bool {
    let (mut next, step) = first_words(hash_id);
    // Differences are ORed up, not tested word by word: no early exit to vectorize
    // around (a mismatch is an error the demo reports, not a case to speed up).
    let mut diff = [0u64; LANES];
    let mut groups = words.chunks_exact(LANES);
    for group in &mut groups {
        for ((w, n), d) in group.iter().zip(&mut next).zip(&mut diff) {
            *d |= w ^ *n;
            *n = n.wrapping_add(step);
        }
    }
    let tail = groups
        .remainder()
        .iter()
        .zip(next)
        .fold(0, |acc, (w, n)| acc | (w ^ n));
    diff.iter().fold(tail, |acc, d| acc | d) == 0
}

// ---------------------------------------------------------------------------
// The replay loop
// ---------------------------------------------------------------------------

/// What is known about one block of the request being replayed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Block {
    /// Reported present, not read (beyond the stored prefix).
    Present,
    /// Absent, or gone by the time it was read (evicted): to be written.
    Missing,
    /// Read and verified.
    Read,
    /// Probe or read failed with an error (counted).
    Failed,
}

/// How many leading blocks the probe found: the prefix worth reading. (Shared with
/// `mooncake simulate`'s `store` policy, which sends the same requests to a master.)
pub(crate) fn stored_prefix(blocks: &[Block]) -> usize {
    blocks.iter().take_while(|b| **b == Block::Present).count()
}

/// The blocks to write once `hit` leading blocks were read: the missing ones after them.
pub(crate) fn blocks_to_write(blocks: &[Block], hit: usize) -> Vec<usize> {
    (hit..blocks.len())
        .filter(|&i| blocks[i] == Block::Missing)
        .collect()
}

#[derive(Default)]
struct Stats {
    requests: u64,
    input_tokens: u64,
    hit_tokens: u64,
    last_half_input: u64,
    last_half_hit: u64,
    objects_written: u64,
    bytes_written: u64,
    objects_read: u64,
    bytes_read: u64,
    /// Puts refused for lack of space (NO_AVAILABLE_HANDLE): back-pressure, not errors.
    puts_rejected: u64,
    /// Blocks reported present that were gone when read (evicted in between).
    read_misses: u64,
    /// Sum and count of samples of the pool's unused share of capacity.
    idle_sum: f64,
    idle_samples: u64,
    errors: u64,
    error_messages: Vec<String>,
    exists_us: Vec<u64>,
    get_us: Vec<u64>,
    put_us: Vec<u64>,
}

impl Stats {
    fn error(&mut self, msg: String) {
        self.errors += 1;
        log::debug!("{msg}");
        if self.error_messages.len() < KEPT_ERRORS {
            self.error_messages.push(msg);
        }
    }

    fn moved_bytes(&self) -> u64 {
        self.bytes_written + self.bytes_read
    }

    fn hit_rate(&self) -> f64 {
        ratio(self.hit_tokens, self.input_tokens)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

fn micros_since(t: Instant) -> u64 {
    t.elapsed().as_micros() as u64
}

struct Replayer<'a> {
    client: &'a Client,
    opts: &'a Options,
    /// One slot of `block_bytes` per block of the largest request, reused throughout.
    buf: Vec<u64>,
    words: usize,
    stats: Stats,
}

impl<'a> Replayer<'a> {
    fn new(client: &'a Client, opts: &'a Options, trace: &[TraceRequest]) -> Replayer<'a> {
        let words = (opts.block_bytes / 8) as usize;
        let most = trace.iter().map(|r| r.hash_ids.len()).max().unwrap_or(0);
        Replayer {
            client,
            opts,
            buf: vec![0; words * most],
            words,
            stats: Stats::default(),
        }
    }

    fn replay(&mut self, trace: &[TraceRequest]) {
        let mut progress = Progress::new(trace.len());
        let started = Instant::now();
        let first_ts = trace.first().map_or(0.0, |r| r.timestamp_ms);
        for (i, req) in trace.iter().enumerate() {
            if self.opts.time_scale > 0.0 {
                let due = (req.timestamp_ms - first_ts).max(0.0) * self.opts.time_scale / 1000.0;
                let wait = due - started.elapsed().as_secs_f64();
                if wait > 0.0 {
                    std::thread::sleep(Duration::from_secs_f64(wait));
                }
            }
            let last_half = i >= trace.len() / 2;
            self.request(req, last_half);
            if last_half && i % IDLE_SAMPLE_EVERY == 0 {
                self.sample_idle();
            }
            progress.tick(i + 1, &self.stats, started);
        }
        progress.finish();
    }

    /// Samples the pool's unused share of capacity (skipped when stats fail).
    fn sample_idle(&mut self) {
        if let Ok(p) = self.client.stats() {
            if p.capacity > 0 {
                let used = p.used.min(p.capacity) as f64 / p.capacity as f64;
                self.stats.idle_sum += 1.0 - used;
                self.stats.idle_samples += 1;
            }
        }
    }

    /// Probe, read the stored prefix, write the rest.
    fn request(&mut self, req: &TraceRequest, last_half: bool) {
        let keys: Vec<String> = req
            .hash_ids
            .iter()
            .map(|&h| key_of(self.opts.block_bytes, h))
            .collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut blocks = self.probe(&keys);
        let stored = stored_prefix(&blocks);
        let hit = self.read_prefix(
            &keys[..stored],
            &req.hash_ids[..stored],
            &mut blocks[..stored],
        );
        self.write_missing(&keys, &req.hash_ids, &blocks, hit);
        let hit_tokens = (hit as u64 * TOKENS_PER_BLOCK).min(req.input_length);
        let s = &mut self.stats;
        s.requests += 1;
        s.input_tokens += req.input_length;
        s.hit_tokens += hit_tokens;
        if last_half {
            s.last_half_input += req.input_length;
            s.last_half_hit += hit_tokens;
        }
    }

    /// Which blocks exist (no lease taken, so probing never blocks eviction).
    fn probe(&mut self, keys: &[&str]) -> Vec<Block> {
        let t = Instant::now();
        let found = self.client.batch_exists(keys);
        self.stats.exists_us.push(micros_since(t));
        found
            .into_iter()
            .zip(keys)
            .map(|(r, k)| match r {
                Ok(true) => Block::Present,
                Ok(false) => Block::Missing,
                Err(e) => {
                    self.stats.error(format!("exists {k:?}: {e}"));
                    Block::Failed
                }
            })
            .collect()
    }

    fn slot_parts(&mut self, indices: impl Iterator<Item = usize>) -> Vec<Vec<(u64, u64)>> {
        let base = self.buf.as_mut_ptr() as u64;
        let bb = self.opts.block_bytes;
        indices.map(|i| vec![(base + i as u64 * bb, bb)]).collect()
    }

    fn slot(&mut self, i: usize) -> &mut [u64] {
        &mut self.buf[i * self.words..(i + 1) * self.words]
    }

    /// Reads the blocks reported present at the head of the request in one batch and
    /// verifies them; returns how many leading blocks were read intact (the hit).
    fn read_prefix(&mut self, keys: &[&str], ids: &[u64], blocks: &mut [Block]) -> usize {
        if keys.is_empty() {
            return 0;
        }
        let parts = self.slot_parts(0..keys.len());
        let t = Instant::now();
        // SAFETY: every part is a distinct slot of `self.buf`, which is neither moved nor
        // touched until the call returns.
        let results = unsafe { self.client.batch_get_into(keys, &parts) };
        self.stats.get_us.push(micros_since(t));
        for (i, r) in results.into_iter().enumerate() {
            blocks[i] = self.check_read(keys[i], ids[i], i, r);
        }
        blocks.iter().take_while(|b| **b == Block::Read).count()
    }

    fn check_read(
        &mut self,
        key: &str,
        id: u64,
        slot: usize,
        r: mooncake_base::Result<u64>,
    ) -> Block {
        let bb = self.opts.block_bytes;
        match r {
            Ok(size) if size == bb => {
                self.stats.objects_read += 1;
                self.stats.bytes_read += size;
                if block_matches(self.slot(slot), id) {
                    Block::Read
                } else {
                    self.stats
                        .error(format!("{key:?}: read bytes differ from what was written"));
                    Block::Failed
                }
            }
            Ok(size) => {
                self.stats
                    .error(format!("{key:?}: object is {size} bytes, expected {bb}"));
                Block::Failed
            }
            // Evicted between the probe and the read: a miss, not an error.
            Err(e) if matches!(e.code(), Code::ObjectNotFound | Code::ReplicaIsNotReady) => {
                self.stats.read_misses += 1;
                Block::Missing
            }
            Err(e) => {
                self.stats.error(format!("reading {key:?}: {e}"));
                Block::Failed
            }
        }
    }

    /// Writes every missing block from the first one not hit onwards, in one batch.
    fn write_missing(&mut self, keys: &[&str], ids: &[u64], blocks: &[Block], hit: usize) {
        let todo = blocks_to_write(blocks, hit);
        if todo.is_empty() {
            return;
        }
        for &i in &todo {
            fill_block(self.slot(i), ids[i]);
        }
        let parts = self.slot_parts(todo.iter().copied());
        let put_keys: Vec<&str> = todo.iter().map(|&i| keys[i]).collect();
        let t = Instant::now();
        // SAFETY: the parts are slots of `self.buf`, untouched until the call returns.
        let results = unsafe {
            self.client
                .batch_put_from(&put_keys, &parts, &self.opts.replicate, false)
        };
        self.stats.put_us.push(micros_since(t));
        for (key, r) in put_keys.iter().zip(results) {
            match r {
                Ok(()) => {
                    self.stats.objects_written += 1;
                    self.stats.bytes_written += self.opts.block_bytes;
                }
                Err(e) if e.code() == Code::NoAvailableHandle => self.stats.puts_rejected += 1,
                Err(e) => self.stats.error(format!("writing {key:?}: {e}")),
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Progress bar
// ---------------------------------------------------------------------------

/// One updating line on stderr, at most ten times a second; silent when stderr is not
/// a terminal.
struct Progress {
    on: bool,
    total: usize,
    last: Option<Instant>,
}

impl Progress {
    fn new(total: usize) -> Progress {
        // SAFETY: isatty only inspects the descriptor.
        let on = unsafe { libc::isatty(2) } == 1;
        Progress {
            on,
            total,
            last: None,
        }
    }

    fn tick(&mut self, done: usize, s: &Stats, started: Instant) {
        if !self.on
            || (done < self.total
                && self
                    .last
                    .is_some_and(|t| t.elapsed() < Duration::from_millis(100)))
        {
            return;
        }
        self.last = Some(Instant::now());
        const WIDTH: usize = 30;
        let filled = done * WIDTH / self.total.max(1);
        let secs = started.elapsed().as_secs_f64();
        let line = format!(
            "\r[{}{}] {done}/{} requests  hit {:.1}%  {:.2} GB/s  {} errors  {secs:.1} s\x1b[K",
            "#".repeat(filled),
            " ".repeat(WIDTH - filled),
            self.total,
            s.hit_rate() * 100.0,
            s.moved_bytes() as f64 / 1e9 / secs.max(1e-9),
            s.errors,
        );
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(line.as_bytes());
        let _ = err.flush();
    }

    fn finish(&mut self) {
        if self.on && self.last.is_some() {
            eprintln!();
        }
    }
}

// ---------------------------------------------------------------------------
// Summary
// ---------------------------------------------------------------------------

struct Latency {
    p50: u64,
    p99: u64,
    count: usize,
    /// Sum of the samples: the share of the wall time this operation took.
    total_us: u64,
}

impl Latency {
    fn of(samples: &[u64]) -> Latency {
        let mut sorted = samples.to_vec();
        sorted.sort_unstable();
        Latency {
            p50: percentile(&sorted, 0.50),
            p99: percentile(&sorted, 0.99),
            count: samples.len(),
            total_us: samples.iter().sum(),
        }
    }
}

struct Summary {
    requests: u64,
    hit_rate: f64,
    hit_rate_last_half: f64,
    block_bytes: u64,
    pool_bytes: u64,
    segments: u64,
    capacity_blocks: u64,
    objects_written: u64,
    bytes_written: u64,
    objects_read: u64,
    bytes_read: u64,
    puts_rejected: u64,
    read_misses: u64,
    evictions: u64,
    evicted_bytes: u64,
    objects_stored: u64,
    /// Mean unused share of the pool's capacity over the last half of the requests.
    idle_fraction: f64,
    errors: u64,
    seconds: f64,
    exists: Latency,
    get: Latency,
    put: Latency,
}

impl Summary {
    fn new(
        opts: &Options,
        s: &Stats,
        before: &PoolStats,
        after: &PoolStats,
        seconds: f64,
    ) -> Summary {
        Summary {
            requests: s.requests,
            hit_rate: s.hit_rate(),
            hit_rate_last_half: ratio(s.last_half_hit, s.last_half_input),
            block_bytes: opts.block_bytes,
            pool_bytes: after.capacity,
            segments: after.segments,
            capacity_blocks: after.capacity / opts.block_bytes,
            objects_written: s.objects_written,
            bytes_written: s.bytes_written,
            objects_read: s.objects_read,
            bytes_read: s.bytes_read,
            puts_rejected: s.puts_rejected,
            read_misses: s.read_misses,
            evictions: after.evicted_objects.saturating_sub(before.evicted_objects),
            evicted_bytes: after.evicted_bytes.saturating_sub(before.evicted_bytes),
            objects_stored: after.objects,
            idle_fraction: s.idle_sum / s.idle_samples.max(1) as f64,
            errors: s.errors,
            seconds,
            exists: Latency::of(&s.exists_us),
            get: Latency::of(&s.get_us),
            put: Latency::of(&s.put_us),
        }
    }

    fn gbps(&self) -> f64 {
        (self.bytes_written + self.bytes_read) as f64 / 1e9 / self.seconds.max(1e-9)
    }

    /// The pool as real KV cache: each block stands for an 8B model's 64 MiB block.
    fn real_model_equivalent_gib(&self) -> f64 {
        (self.capacity_blocks * REAL_BLOCK_BYTES) as f64 / (1u64 << 30) as f64
    }

    fn to_json(&self) -> Value {
        let u = |n: u64| Value::from(n);
        Value::object([
            ("requests", u(self.requests)),
            ("hit_rate", self.hit_rate.into()),
            ("hit_rate_last_half", self.hit_rate_last_half.into()),
            ("capacity_blocks", u(self.capacity_blocks)),
            ("errors", u(self.errors)),
            ("seconds", self.seconds.into()),
            ("objects_written", u(self.objects_written)),
            ("bytes_written", u(self.bytes_written)),
            ("objects_read", u(self.objects_read)),
            ("bytes_read", u(self.bytes_read)),
            ("evictions", u(self.evictions)),
            ("evicted_bytes", u(self.evicted_bytes)),
            ("puts_rejected", u(self.puts_rejected)),
            ("read_misses", u(self.read_misses)),
            ("gbps", self.gbps().into()),
            ("exists_p50_us", u(self.exists.p50)),
            ("exists_p99_us", u(self.exists.p99)),
            ("get_p50_us", u(self.get.p50)),
            ("get_p99_us", u(self.get.p99)),
            ("put_p50_us", u(self.put.p50)),
            ("put_p99_us", u(self.put.p99)),
            ("exists_total_us", u(self.exists.total_us)),
            ("get_total_us", u(self.get.total_us)),
            ("put_total_us", u(self.put.total_us)),
            ("block_bytes", u(self.block_bytes)),
            ("pool_bytes", u(self.pool_bytes)),
            ("idle_fraction", self.idle_fraction.into()),
            (
                "real_model_equivalent_gib",
                self.real_model_equivalent_gib().into(),
            ),
        ])
    }

    /// `reference`: LRU's and the best possible hit rates (all, last half) at this
    /// capacity, printed under the replay's own.
    fn print(&self, label: &str, trace: &str, reference: Option<[(f64, f64); 2]>) {
        println!(
            "mooncake {label}: replayed {} requests of {} in {:.1} s",
            self.requests, trace, self.seconds
        );
        println!(
            "  pool          {} in {} segment(s) = {} blocks of {} ({} objects stored at the end)",
            size::format(self.pool_bytes),
            self.segments,
            self.capacity_blocks,
            size::format(self.block_bytes),
            self.objects_stored,
        );
        println!(
            "  idle pool     {:.1}% of capacity unused (mean over the last half of the requests, \
             sampled every {IDLE_SAMPLE_EVERY})",
            self.idle_fraction * 100.0
        );
        println!(
            "  scale         one {} block here stands for one 512-token block of an 8B model's KV cache \
             (128 KiB/token = 64 MiB): the hit rates are those of a {:.0} GiB cache",
            size::format(self.block_bytes),
            self.real_model_equivalent_gib(),
        );
        println!(
            "  prefix hits   {:.1}% of input tokens; last half of requests {:.1}%",
            self.hit_rate * 100.0,
            self.hit_rate_last_half * 100.0
        );
        if let Some([(lru, lru_half), (best, best_half)]) = reference {
            println!(
                "  compare with  LRU {:.1}% (last half {:.1}%), best possible {:.1}% ({:.1}%) \
                 at this capacity (`mooncake simulate` for other sizes)",
                lru * 100.0,
                lru_half * 100.0,
                best * 100.0,
                best_half * 100.0
            );
        }
        println!(
            "  written       {} objects, {}",
            self.objects_written,
            size::format(self.bytes_written)
        );
        println!(
            "  read          {} objects, {}",
            self.objects_read,
            size::format(self.bytes_read)
        );
        println!(
            "  throughput    {:.2} GB/s (bytes written + read / wall time)",
            self.gbps()
        );
        println!(
            "  evictions     {} objects, {}",
            self.evictions,
            size::format(self.evicted_bytes)
        );
        println!(
            "  back-pressure {} puts refused for space (NO_AVAILABLE_HANDLE), {} blocks evicted between probe and read",
            self.puts_rejected, self.read_misses
        );
        for (name, l) in [
            ("exists", &self.exists),
            ("get-batch", &self.get),
            ("put-batch", &self.put),
        ] {
            println!(
                "  {name:<13} p50 {} µs, p99 {} µs ({} batches, {:.2} s in all)",
                l.p50,
                l.p99,
                l.count,
                l.total_us as f64 / 1e6
            );
        }
        println!("  errors        {}", self.errors);
        println!("  wall time     {:.2} s", self.seconds);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_lease_follows_the_replay_clock() {
        let default = ServerConfig::default().master.lease_ttl;
        assert_eq!(default, Duration::from_secs(10));
        // Real time, and slower: the default.
        assert_eq!(demo_lease(1.0), default);
        assert_eq!(demo_lease(3.0), default);
        assert_eq!(demo_lease(0.25), Duration::from_millis(2500));
        // Fast, and as fast as possible: the floor.
        assert_eq!(demo_lease(0.03), MIN_DEMO_LEASE);
        assert_eq!(demo_lease(0.0), MIN_DEMO_LEASE);
    }

    #[test]
    fn blocks_verify_only_their_own_bytes() {
        let mut w = vec![0u64; 512];
        fill_block(&mut w, 7);
        assert!(block_matches(&w, 7));
        assert!(!block_matches(&w, 8));
        w[100] ^= 1;
        assert!(!block_matches(&w, 7));
    }

    #[test]
    fn blocks_hold_word_j_at_position_j_whatever_their_length() {
        for len in [0usize, 1, 7, 8, 9, 63, 8192] {
            let mut w = vec![0u64; len];
            fill_block(&mut w, 11);
            let base = splitmix64(11);
            for (j, word) in w.iter().enumerate() {
                assert_eq!(*word, base.wrapping_add((j as u64).wrapping_mul(STRIDE)));
            }
            assert!(block_matches(&w, 11));
            if let Some(last) = w.last_mut() {
                *last ^= 1 << 63; // a difference in the tail is seen too
                assert!(!block_matches(&w, 11), "len {len}");
            }
        }
    }

    #[test]
    fn latency_summary_sorts_before_taking_nearest_ranks() {
        let v: Vec<u64> = (1..=100).rev().collect();
        let l = Latency::of(&v);
        assert_eq!((l.p50, l.p99, l.count, l.total_us), (50, 99, 100, 5050));
        let none = Latency::of(&[]);
        assert_eq!(
            (none.p50, none.p99, none.count, none.total_us),
            (0, 0, 0, 0)
        );
    }
}
