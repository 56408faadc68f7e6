//! `mooncake bench store`: objects per second and per-call latency of the store, with
//! every byte crossing a process boundary. Without `--master` it starts a `mooncake
//! master` and one `mooncake node` as child processes; the benchmarking client runs in
//! this process as a pure client (it lends no memory), so a put moves bytes from here
//! into the node and a get moves them back, over TCP unless `--protocol` says otherwise.
//!
//! APIs: `zero-copy` registers one long-lived buffer per thread and calls
//! `batch_put_from` / `batch_get_into` directly; `copy` works from ordinary unregistered
//! memory — puts read the caller's vectors (`put` for one object, the batch call above
//! that), gets land in a freshly allocated vector per object per call (`get_into` for
//! one object, `batch_get_into` above that), as a `get` returning owned bytes would.
//!
//! Every value carries a pattern derived from its key; gets check the bytes they read
//! outside the latency window (every byte up to 1 MiB, a sample of every page above,
//! where the store's CRC32C check covers every byte; `--no-verify` skips it), and a
//! put run reads back its last batch from each thread at the end. Prints one JSON object per run, with a
//! same-run reference: the transfer engine alone reading the same sizes from the node.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::common::ChildProc;
use mooncake_base::json::Value;
use mooncake_base::util::percentile;
use mooncake_cli::args::Args;
use mooncake_engine::{Engine, Op, Request};
use mooncake_store::protocol::ReplicateConfig;
use mooncake_store::Client;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// The node never lends more than this by default.
const MAX_NODE_SEGMENT: u64 = 4 * GIB;
/// The node's pool for put runs: smaller than what a run of large puts writes, so they
/// reach the steady state of a full pool (pages touched before, eviction running)
/// instead of paying first-touch page faults on a fresh pool throughout.
const PUT_NODE_SEGMENT: u64 = GIB;
/// A get run populates at most this many bytes of values.
const MAX_POPULATE: u64 = GIB;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Put,
    Get,
    Exists,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Put => "put",
            Kind::Get => "get",
            Kind::Exists => "exists",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Copy,
    ZeroCopy,
}

struct Params {
    kind: Kind,
    api: Api,
    size: usize,
    batch: usize,
    threads: usize,
    duration: Duration,
    /// Check the bytes of every get.
    verify: bool,
    /// Keys populated for get/exists.
    keys: usize,
    /// Prefix unique to this run, so runs against a shared master never collide.
    run: String,
}

/// The master and node processes; the node goes first on drop.
struct Cluster {
    node: ChildProc,
    _master: ChildProc,
    rpc: String,
    metadata: String,
}

impl Cluster {
    fn start(segment_size: u64) -> Result<Cluster, String> {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let master = ChildProc::spawn(
            "master",
            &args(&[
                "master",
                "--rpc-port",
                "0",
                "--metadata-port",
                "0",
                "--metrics-port",
                "off",
                "--until-stdin-eof",
            ]),
        )?;
        let rpc = master.field("rpc").ok_or("master named no rpc address")?;
        let metadata = master
            .field("metadata")
            .ok_or("master named no metadata url")?;
        let (rpc, metadata) = (rpc.to_owned(), metadata.to_owned());
        let node = ChildProc::spawn(
            "node",
            &args(&[
                "node",
                "--master",
                &rpc,
                "--metadata",
                &metadata,
                "--segment-size",
                &segment_size.to_string(),
                "--protocol",
                "tcp",
                "--bind",
                "127.0.0.1",
                "--until-stdin-eof",
            ]),
        )?;
        Ok(Cluster {
            node,
            _master: master,
            rpc,
            metadata,
        })
    }
}

const WORD_STEP: u64 = 0xD6E8_FEB8_6659_FD93;

/// The first word of the pattern for `seed`; word `i` is `base ^ i * WORD_STEP`.
fn pattern_base(seed: u64) -> u64 {
    (seed ^ 0x5EED_5EED).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

/// Fills `buf` with the pattern of `seed`.
fn fill(buf: &mut [u8], seed: u64) {
    let base = pattern_base(seed);
    let mut words = buf.chunks_exact_mut(8);
    let mut i = 0u64;
    for w in &mut words {
        w.copy_from_slice(&(base ^ i.wrapping_mul(WORD_STEP)).to_le_bytes());
        i += 1;
    }
    let tail = words.into_remainder();
    let last = (base ^ i.wrapping_mul(WORD_STEP)).to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// Values up to this size are checked byte for byte; larger ones are sampled.
const FULL_CHECK_MAX: usize = 1 << 20;

/// Whether `buf` holds exactly the pattern of `seed`.
fn check(buf: &[u8], seed: u64) -> bool {
    let base = pattern_base(seed);
    let words = buf.chunks_exact(8);
    let tail = words.remainder();
    let n = words.len() as u64;
    let mut diff = 0u64;
    for (i, w) in (0u64..).zip(words) {
        let v = u64::from_le_bytes(w.try_into().unwrap_or_default());
        diff |= v ^ base ^ i.wrapping_mul(WORD_STEP);
    }
    let last = (base ^ n.wrapping_mul(WORD_STEP)).to_le_bytes();
    diff == 0 && tail == &last[..tail.len()]
}

/// Whether `buf` holds the pattern of `seed` at its first and last 4 KiB and at one
/// word of every 4 KiB page between (the word moving from page to page): catches a
/// wrong key, offset, length or stale page at a fraction of a full check's cost. The
/// store's own CRC32C check (`--verify-checksum true`) covers every byte.
fn check_sampled(buf: &[u8], seed: u64) -> bool {
    const PAGE: usize = 4096;
    if buf.len() <= 3 * PAGE {
        return check(buf, seed);
    }
    let base = pattern_base(seed);
    let word_ok = |w: usize| {
        let v = u64::from_le_bytes(buf[w * 8..w * 8 + 8].try_into().unwrap_or_default());
        v == base ^ (w as u64).wrapping_mul(WORD_STEP)
    };
    let tail_from = (buf.len() - PAGE) / 8 * 8;
    let tail_ok = {
        // `check` numbers words from the start of its slice: re-derive in place.
        let words = tail_from / 8;
        (words..buf.len() / 8).all(word_ok) && {
            let rest = &buf[buf.len() / 8 * 8..];
            let last = (base ^ ((buf.len() / 8) as u64).wrapping_mul(WORD_STEP)).to_le_bytes();
            rest == &last[..rest.len()]
        }
    };
    check(&buf[..PAGE], seed)
        && tail_ok
        && (1..buf.len() / PAGE).all(|p| word_ok(p * PAGE / 8 + (p * 37) % (PAGE / 8)))
}

/// The byte check a get of `size` bytes gets.
fn verify_mode(verify: bool, size: usize) -> &'static str {
    match (verify, size <= FULL_CHECK_MAX) {
        (false, _) => "off",
        (true, true) => "full",
        (true, false) => "sampled",
    }
}

/// Checks a value read back: in full up to `FULL_CHECK_MAX`, sampled above.
fn verify_value(buf: &[u8], seed: u64) -> bool {
    if buf.len() <= FULL_CHECK_MAX {
        check(buf, seed)
    } else {
        check_sampled(buf, seed)
    }
}

/// Seed of populated key `i`.
fn key_seed(i: usize) -> u64 {
    i as u64
}

/// Seed of slot `j` of put thread `t` (every put of that slot carries the same value).
fn put_seed(t: usize, j: usize) -> u64 {
    (1 << 40) + ((t as u64) << 20) + j as u64
}

/// What one bench thread measured.
#[derive(Default)]
struct ThreadResult {
    objects: u64,
    errors: u64,
    first_error: Option<String>,
    latencies_us: Vec<f64>,
    /// Put runs: the last keys written and their seeds, for the read-back.
    last_put: Vec<(String, u64)>,
}

impl ThreadResult {
    fn error(&mut self, what: String) {
        self.errors += 1;
        self.first_error.get_or_insert(what);
    }
}

/// One thread's buffer of `batch` slots of `size` bytes, registered for zero-copy.
struct SlotBuffer<'a> {
    client: &'a Client,
    buf: Vec<u8>,
    registered: bool,
}

impl<'a> SlotBuffer<'a> {
    fn new(client: &'a Client, p: &Params) -> Result<SlotBuffer<'a>, String> {
        let mut buf = vec![0u8; p.size * p.batch];
        let registered = p.api == Api::ZeroCopy;
        if registered {
            // SAFETY: `buf` is neither moved nor freed before `drop` unregisters it.
            unsafe { client.register_buffer(buf.as_mut_ptr(), buf.len()) }
                .map_err(|e| format!("register_buffer: {e}"))?;
        }
        Ok(SlotBuffer {
            client,
            buf,
            registered,
        })
    }

    fn parts(&mut self, size: usize, batch: usize) -> Vec<Vec<(u64, u64)>> {
        let base = self.buf.as_mut_ptr() as u64;
        (0..batch)
            .map(|j| vec![(base + (j * size) as u64, size as u64)])
            .collect()
    }
}

impl Drop for SlotBuffer<'_> {
    fn drop(&mut self) {
        if self.registered {
            let _ = self.client.unregister_buffer(self.buf.as_mut_ptr());
        }
    }
}

fn bench_thread(
    client: &Client,
    t: usize,
    p: &Params,
    stop: &AtomicBool,
) -> Result<ThreadResult, String> {
    match p.kind {
        Kind::Put => put_thread(client, t, p, stop),
        Kind::Get | Kind::Exists => read_thread(client, t, p, stop),
    }
}

fn put_thread(
    client: &Client,
    t: usize,
    p: &Params,
    stop: &AtomicBool,
) -> Result<ThreadResult, String> {
    let cfg = ReplicateConfig::default();
    let mut r = ThreadResult::default();
    let mut slots = SlotBuffer::new(client, p)?;
    for (j, chunk) in slots.buf.chunks_mut(p.size).enumerate() {
        fill(chunk, put_seed(t, j));
    }
    let parts = slots.parts(p.size, p.batch);
    let mut n = 0u64;
    let mut keys: Vec<String> = Vec::with_capacity(p.batch);
    while !stop.load(Ordering::Relaxed) {
        keys.clear();
        keys.extend((0..p.batch).map(|j| format!("{}/p{t}/{n}.{j}", p.run)));
        n += 1;
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let t0 = Instant::now();
        let results = if p.batch == 1 && p.api == Api::Copy {
            vec![client.put(refs[0], &slots.buf[..p.size], &cfg)]
        } else {
            // SAFETY: the parts lie in `slots.buf`, alive and unchanged for the call.
            unsafe { client.batch_put_from(&refs, &parts, &cfg, false) }
        };
        r.latencies_us.push(t0.elapsed().as_secs_f64() * 1e6);
        for (key, res) in keys.iter().zip(results) {
            r.objects += 1;
            if let Err(e) = res {
                r.error(format!("put {key:?}: {e}"));
            }
        }
    }
    r.last_put = keys
        .into_iter()
        .enumerate()
        .map(|(j, k)| (k, put_seed(t, j)))
        .collect();
    Ok(r)
}

/// Get and exists: loops over this thread's share of the populated keys.
fn read_thread(
    client: &Client,
    t: usize,
    p: &Params,
    stop: &AtomicBool,
) -> Result<ThreadResult, String> {
    let mut r = ThreadResult::default();
    let per_thread = p.keys / p.threads;
    let first = t * per_thread;
    let names: Vec<String> = (first..first + per_thread)
        .map(|i| key_name(&p.run, i))
        .collect();
    let mut slots = SlotBuffer::new(client, p)?;
    let parts = slots.parts(p.size, p.batch);
    let mut at = 0;
    while !stop.load(Ordering::Relaxed) {
        if at + p.batch > per_thread {
            at = 0;
        }
        let keys: Vec<&str> = names[at..at + p.batch].iter().map(String::as_str).collect();
        let idx = first + at;
        at += p.batch;
        match p.kind {
            Kind::Exists => {
                let t0 = Instant::now();
                let results = if p.batch == 1 {
                    vec![client.exists(keys[0])]
                } else {
                    client.batch_exists(&keys)
                };
                r.latencies_us.push(t0.elapsed().as_secs_f64() * 1e6);
                for (key, res) in keys.iter().zip(results) {
                    r.objects += 1;
                    match res {
                        Ok(true) => {}
                        Ok(false) => r.error(format!("exists {key:?}: false")),
                        Err(e) => r.error(format!("exists {key:?}: {e}")),
                    }
                }
            }
            _ if p.api == Api::ZeroCopy => {
                let t0 = Instant::now();
                // SAFETY: the parts lie in `slots.buf`, which nothing else touches.
                let results = unsafe { client.batch_get_into(&keys, &parts) };
                r.latencies_us.push(t0.elapsed().as_secs_f64() * 1e6);
                for (j, res) in results.into_iter().enumerate() {
                    let got = &slots.buf[j * p.size..(j + 1) * p.size];
                    read_outcome(&mut r, keys[j], res, got, key_seed(idx + j), p);
                }
            }
            _ => {
                let t0 = Instant::now();
                // Fresh memory per object per call, as a get returning owned bytes has.
                let mut bufs: Vec<Vec<u8>> = (0..p.batch).map(|_| vec![0u8; p.size]).collect();
                let results = if p.batch == 1 {
                    vec![client.get_into(keys[0], &mut bufs[0])]
                } else {
                    let parts: Vec<Vec<(u64, u64)>> = bufs
                        .iter_mut()
                        .map(|b| vec![(b.as_mut_ptr() as u64, b.len() as u64)])
                        .collect();
                    // SAFETY: `bufs` is owned here and outlives the call.
                    unsafe { client.batch_get_into(&keys, &parts) }
                };
                r.latencies_us.push(t0.elapsed().as_secs_f64() * 1e6);
                for (j, res) in results.into_iter().enumerate() {
                    read_outcome(&mut r, keys[j], res, &bufs[j], key_seed(idx + j), p);
                }
            }
        }
    }
    Ok(r)
}

fn read_outcome(
    r: &mut ThreadResult,
    key: &str,
    res: mooncake_base::Result<u64>,
    got: &[u8],
    seed: u64,
    p: &Params,
) {
    r.objects += 1;
    match res {
        Err(e) => r.error(format!("get {key:?}: {e}")),
        Ok(n) if n != p.size as u64 => r.error(format!("get {key:?}: {n} bytes")),
        Ok(_) if p.verify && !verify_value(got, seed) => {
            r.error(format!("get {key:?}: wrong bytes"))
        }
        Ok(_) => {}
    }
}

fn key_name(run: &str, i: usize) -> String {
    format!("{run}/k{i}")
}

/// Stores keys `0..p.keys` with their patterns, in batches of up to 64 keys / 64 MiB.
fn populate(client: &Client, p: &Params) -> Result<(), String> {
    let cfg = ReplicateConfig::default();
    let chunk = (64 * MIB as usize / p.size).clamp(1, 64);
    let mut i = 0;
    while i < p.keys {
        let n = chunk.min(p.keys - i);
        let mut bufs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; p.size]).collect();
        for (j, b) in bufs.iter_mut().enumerate() {
            fill(b, key_seed(i + j));
        }
        let names: Vec<String> = (i..i + n).map(|k| key_name(&p.run, k)).collect();
        let keys: Vec<&str> = names.iter().map(String::as_str).collect();
        let parts: Vec<Vec<(u64, u64)>> = bufs
            .iter()
            .map(|b| vec![(b.as_ptr() as u64, b.len() as u64)])
            .collect();
        // SAFETY: `bufs` outlives the call.
        let results = unsafe { client.batch_put_from(&keys, &parts, &cfg, false) };
        for (k, res) in keys.iter().zip(results) {
            res.map_err(|e| format!("populating {k:?}: {e}"))?;
        }
        i += n;
    }
    Ok(())
}

/// Reads back the last batch each put thread wrote; (objects checked, errors, first).
fn read_back(client: &Client, last: &[(String, u64)], size: usize) -> (u64, u64, Option<String>) {
    let mut errors = 0;
    let mut first = None;
    let mut buf = vec![0u8; size];
    for (key, seed) in last {
        let bad = match client.get_into(key, &mut buf) {
            Ok(n) if n == size as u64 && check(&buf, *seed) => None,
            Ok(n) => Some(format!(
                "read-back {key:?}: {n} bytes, pattern mismatch or short"
            )),
            Err(e) => Some(format!("read-back {key:?}: {e}")),
        };
        if let Some(b) = bad {
            errors += 1;
            first.get_or_insert(b);
        }
    }
    (last.len() as u64, errors, first)
}

/// The transfer engine alone: `batch` reads of `size` bytes from the node's segment
/// per call, cycling over `ranges` distinct places (the gets' working set, so neither
/// side reads from a cache the other cannot fit: one re-read 16 MiB range sits in a
/// 32 MiB L3, 64 keys of it do not); (p50 µs, p99 µs, GB/s).
fn engine_reference(
    engine: &Engine,
    node: &str,
    size: usize,
    batch: usize,
    ranges: usize,
    duration: Duration,
) -> Result<(f64, f64, f64), String> {
    let seg = engine.open_segment(node).map_err(|e| e.to_string())?;
    let desc = engine.segment_descriptor(seg).map_err(|e| e.to_string())?;
    let buffer = desc
        .buffers
        .iter()
        .max_by_key(|b| b.length)
        .ok_or_else(|| format!("segment {node} has no buffer"))?;
    let fit = ((buffer.length / size as u64) as usize).max(1);
    let n = batch.min(fit);
    let places = ranges.clamp(n, fit.max(n)) / n * n;
    let mut local = vec![0u8; n * size];
    let base = local.as_mut_ptr() as u64;
    let requests = |call: usize| -> Vec<Request> {
        (0..n)
            .map(|i| Request {
                op: Op::Read,
                local: base + (i * size) as u64,
                segment: seg,
                remote: buffer.addr + (((call * n + i) % places) * size) as u64,
                len: size as u64,
            })
            .collect()
    };
    let mut lat = Vec::new();
    let start = Instant::now();
    while lat.len() < 3 || start.elapsed() < duration {
        let reqs = requests(lat.len());
        let t0 = Instant::now();
        let batch = engine.allocate_batch(n).map_err(|e| e.to_string())?;
        // SAFETY: `local` outlives the batch, which is waited for before freeing, and
        // nothing else touches it meanwhile.
        unsafe { engine.submit(batch, &reqs) }.map_err(|e| format!("submit: {e}"))?;
        let waited = engine.wait_batch(batch, Some(Duration::from_secs(60)));
        let _ = engine.free_batch(batch);
        waited.map_err(|e| format!("engine read: {e}"))?;
        lat.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    let secs = start.elapsed().as_secs_f64();
    let gbps = (lat.len() * n * size) as f64 / secs / 1e9;
    lat.sort_by(f64::total_cmp);
    Ok((percentile(&lat, 0.5), percentile(&lat, 0.99), gbps))
}

fn measure(client: &Client, p: &Params) -> Result<(f64, Vec<ThreadResult>), String> {
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let results: Vec<Result<ThreadResult, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..p.threads)
            .map(|t| {
                let stop = &stop;
                s.spawn(move || bench_thread(client, t, p, stop))
            })
            .collect();
        std::thread::sleep(p.duration);
        stop.store(true, Ordering::Relaxed);
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("bench thread panicked".into()))
            })
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    Ok((seconds, results.into_iter().collect::<Result<_, _>>()?))
}

pub fn run(raw: &[String]) -> Result<(), String> {
    let a = Args::parse(raw)?;
    let kind = match a.str("op").unwrap_or("get") {
        "put" => Kind::Put,
        "get" => Kind::Get,
        "exists" => Kind::Exists,
        other => return Err(format!("--op: {other:?} is not put, get or exists")),
    };
    let api = match a.str("api").unwrap_or("zero-copy") {
        "copy" => Api::Copy,
        "zero-copy" | "zerocopy" | "zero_copy" => Api::ZeroCopy,
        other => return Err(format!("--api: {other:?} is not copy or zero-copy")),
    };
    let size: usize = a.get("size", 4096usize)?;
    let batch: usize = a.get("batch", 1usize)?;
    let threads: usize = a.get("threads", 1usize)?;
    let duration = Duration::from_secs_f64(a.get("duration", 3.0f64)?);
    let verify = !a.flag("no-verify")?;
    let keys_flag: Option<usize> = a.get("keys", 0usize).map(|k| (k > 0).then_some(k))?;
    let external = a.str("master").is_some();
    let mut cfg = mooncake_cli::store::client_config(&a)?;
    if a.str("protocol").is_none() {
        cfg.engine
            .set("protocol", "tcp")
            .map_err(|e| e.to_string())?;
    }
    a.finish()?;
    if size == 0 || batch == 0 || threads == 0 {
        return Err("--size, --batch and --threads must be positive".into());
    }
    let group = threads * batch;
    // Enough keys that a thread cycles through 64 batches, within MAX_POPULATE bytes.
    let keys = keys_flag.unwrap_or_else(|| {
        let fit = (MAX_POPULATE / size as u64) as usize;
        (group * 64).min(fit.max(group))
    });
    let keys = keys.max(group) / group * group;
    let node_segment = match cfg.global_segment_size {
        0 if kind == Kind::Put => PUT_NODE_SEGMENT,
        0 => {
            let need = (keys * size) as u64 + (keys * size) as u64 / 2 + 64 * MIB;
            need.div_ceil(64 * MIB) * 64 * MIB
        }
        n => n,
    }
    .clamp(256 * MIB, MAX_NODE_SEGMENT.max(cfg.global_segment_size));
    // The bench client lends nothing: every byte goes to or comes from the node.
    cfg.global_segment_size = 0;
    let verify_checksum = cfg.verify_checksum;
    let protocol = cfg.engine.protocol.name().to_owned();
    let cluster = match external {
        true => {
            mooncake_cli::store::metadata_from_master(&a, &mut cfg)?;
            None
        }
        false => {
            let c = Cluster::start(node_segment)?;
            cfg.master_address = c.rpc.clone();
            cfg.engine
                .set("metadata", &c.metadata)
                .map_err(|e| e.to_string())?;
            Some(c)
        }
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let p = Params {
        kind,
        api,
        size,
        batch,
        threads,
        duration,
        verify,
        keys: if kind == Kind::Put { 0 } else { keys },
        run: format!("bench-{}-{:x}", std::process::id(), nanos),
    };
    let client = Client::new(cfg).map_err(|e| format!("store client: {e}"))?;
    if kind != Kind::Put {
        populate(&client, &p)?;
    }
    let before = client.stats().map_err(|e| format!("stats: {e}"))?;
    let (seconds, results) = measure(&client, &p)?;
    let after = client.stats().map_err(|e| format!("stats: {e}"))?;
    let (mut objects, mut errors, mut first_error, mut lat, mut last) =
        (0u64, 0u64, None, Vec::new(), Vec::new());
    for r in results {
        objects += r.objects;
        errors += r.errors;
        if first_error.is_none() {
            first_error = r.first_error;
        }
        lat.extend(r.latencies_us);
        last.extend(r.last_put);
    }
    lat.sort_by(f64::total_cmp);
    let (checked, back_errors, back_first) = read_back(&client, &last, size);
    errors += back_errors;
    first_error = first_error.or(back_first);
    let reference = match (&cluster, kind) {
        (Some(c), Kind::Put | Kind::Get) => Some(engine_reference(
            client.engine(),
            &c.node.ready,
            size,
            batch,
            p.keys,
            duration.min(Duration::from_secs(1)),
        )?),
        _ => None,
    };
    drop(client);
    drop(cluster);
    let moved = if kind == Kind::Exists { 0 } else { size as u64 };
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    let opt = |x: Option<f64>| x.map_or(Value::Null, |v| round(v).into());
    let mut fields = vec![
        ("bench", Value::from("store")),
        ("op", kind.name().into()),
        (
            "api",
            if api == Api::Copy {
                "copy"
            } else {
                "zero-copy"
            }
            .into(),
        ),
        ("size", (size as u64).into()),
        ("batch", batch.into()),
        ("threads", threads.into()),
        ("ops", objects.into()),
        ("seconds", round(seconds).into()),
        (
            "ops_per_s",
            ((objects as f64 / seconds).round() as u64).into(),
        ),
        (
            "gbps",
            round((objects * moved) as f64 / seconds / 1e9).into(),
        ),
        ("lat_p50_us", round(percentile(&lat, 0.5)).into()),
        ("lat_p99_us", round(percentile(&lat, 0.99)).into()),
        ("calls", lat.len().into()),
        ("errors", errors.into()),
        ("protocol", protocol.as_str().into()),
        ("verify_checksum", verify_checksum.into()),
        ("verify_bytes", verify_mode(verify, size).into()),
        ("keys", p.keys.into()),
        ("read_back", checked.into()),
        (
            "evicted_objects",
            (after.evicted_objects - before.evicted_objects).into(),
        ),
        (
            "evicted_bytes",
            (after.evicted_bytes - before.evicted_bytes).into(),
        ),
        (
            "node_segment_size",
            if external {
                Value::Null
            } else {
                node_segment.into()
            },
        ),
        ("baseline", Value::from("transfer_engine_read")),
    ];
    fields.push(("transfer_engine_p50_us", opt(reference.map(|r| r.0))));
    fields.push(("transfer_engine_p99_us", opt(reference.map(|r| r.1))));
    fields.push(("transfer_engine_gbps", opt(reference.map(|r| r.2))));
    println!("{}", Value::object(fields));
    if let Some(e) = first_error {
        return Err(format!("{errors} error(s); first: {e}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampled_check_matches_pattern_and_catches_misplacement() {
        for len in [4096 * 5, 4096 * 5 + 3, 1 << 21] {
            let mut b = vec![0u8; len];
            fill(&mut b, 7);
            assert!(check_sampled(&b, 7), "len {len}");
            assert!(!check_sampled(&b, 8), "len {len}");
            // A page from elsewhere in the value (a wrong offset) is caught.
            let (lo, hi) = b.split_at_mut(4096 * 3);
            lo[4096..8192].copy_from_slice(&hi[..4096]);
            assert!(!check_sampled(&b, 7), "len {len}");
            let mut b2 = vec![0u8; len];
            fill(&mut b2, 7);
            let end = b2.len() - 1;
            b2[end] ^= 0x80;
            assert!(!check_sampled(&b2, 7), "len {len}");
        }
    }

    #[test]
    fn pattern_round_trips_and_differs_per_seed() {
        for len in [0, 1, 7, 8, 9, 4096, 4099] {
            let mut b = vec![0u8; len];
            fill(&mut b, 42);
            assert!(check(&b, 42), "len {len}");
            if len > 0 {
                assert!(!check(&b, 43), "len {len}");
                let last = len - 1;
                b[last] ^= 1;
                assert!(!check(&b, 42), "len {len}");
            }
        }
    }
}
