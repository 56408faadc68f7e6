//! `mooncake bench master`: metadata operations per second of the store's master, in
//! process (no RPC, no bytes: one mounted segment that exists only on paper). Requests
//! go through `Master::handle`, the entry point the RPC server calls, so every figure
//! includes building the request and answer the way a decoded RPC would.
//!
//! Phases, each `--duration` long, on `--keys` pre-populated keys: `put` (a PutStart
//! and a PutEnd of a fresh key, counted as two requests), `get_replicas`, `exists`, and
//! a `mix` of one put pair, four get_replicas and four exists per round. Prints one
//! JSON object per thread count (`--threads 1,2` gives two).
//!
//! `--objects N` (e.g. 10000000) runs the scale test instead, one thread: N objects
//! put into a pool that holds exactly N, the master's resident memory per object
//! (RSS growth over the run / N), then `--duration` of puts that each evict one
//! object, and of get_replicas, at that size. Baseline, printed first: the same on
//! `--keys` objects, in the same run.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use mooncake_base::json::Value;
use mooncake_cli::args::Args;
use mooncake_store::master::{Master, MasterConfig};
use mooncake_store::protocol::{ReplicateConfig, Request, Response, SegmentInfo};

/// The paper segment's owner.
const CLIENT: u64 = 0xB0B;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Put,
    GetReplicas,
    Exists,
    Mix,
}

struct Params {
    keys: usize,
    batch: usize,
    size: u64,
    duration: Duration,
}

/// xorshift64: spreads key choices, needs no quality.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// Per-key failures in an answer (a whole-request error counts every key).
fn failures(answer: mooncake_base::Result<Response>, n: usize) -> u64 {
    match answer {
        Err(_) => n as u64,
        Ok(Response::PutStart(r)) => r.iter().filter(|x| x.is_err()).count() as u64,
        Ok(Response::PerKey(r)) => r.iter().filter(|x| x.is_err()).count() as u64,
        Ok(Response::GetReplicas(r)) => r.iter().filter(|x| x.is_err()).count() as u64,
        Ok(Response::Exists(r)) => r.iter().filter(|x| !matches!(x, Ok(true))).count() as u64,
        Ok(_) => 0,
    }
}

fn put_pair(master: &Master, keys: Vec<String>, size: u64) -> u64 {
    let n = keys.len();
    let items = keys.iter().map(|k| (k.clone(), size)).collect();
    let mut bad = failures(
        master.handle(Request::PutStart {
            client: CLIENT,
            items,
            config: ReplicateConfig::default(),
            upsert: false,
        }),
        n,
    );
    let items = keys.into_iter().map(|k| (k, 0x1234_5678)).collect();
    bad += failures(
        master.handle(Request::PutEnd {
            client: CLIENT,
            items,
        }),
        n,
    );
    bad
}

fn pick(names: &[String], rng: &mut Rng, batch: usize) -> Vec<String> {
    (0..batch)
        .map(|_| names[rng.below(names.len())].clone())
        .collect()
}

/// One thread of one phase: (requests' keys handled, failures, fresh keys it put).
fn worker(
    master: &Master,
    names: &[String],
    phase: Phase,
    t: usize,
    p: &Params,
    start: &Barrier,
    stop: &AtomicBool,
) -> (u64, u64, Vec<String>) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((t as u64 + 1) << 32) ^ phase as u64);
    let (mut ops, mut bad, mut fresh) = (0u64, 0u64, 0u64);
    let mut put_keys = Vec::new();
    let mut new_keys = |fresh: &mut u64| -> Vec<String> {
        let ks: Vec<String> = (0..p.batch)
            .map(|j| format!("fresh/{phase:?}/t{t}/{fresh}.{j}", phase = phase as u8))
            .collect();
        *fresh += 1;
        put_keys.extend(ks.iter().cloned());
        ks
    };
    let b = p.batch as u64;
    start.wait();
    while !stop.load(Ordering::Relaxed) {
        match phase {
            Phase::Put => {
                bad += put_pair(master, new_keys(&mut fresh), p.size);
                ops += 2 * b;
            }
            Phase::GetReplicas => {
                let keys = pick(names, &mut rng, p.batch);
                bad += failures(master.handle(Request::GetReplicas { keys }), p.batch);
                ops += b;
            }
            Phase::Exists => {
                let keys = pick(names, &mut rng, p.batch);
                bad += failures(master.handle(Request::Exists { keys }), p.batch);
                ops += b;
            }
            Phase::Mix => {
                bad += put_pair(master, new_keys(&mut fresh), p.size);
                for _ in 0..4 {
                    let keys = pick(names, &mut rng, p.batch);
                    bad += failures(master.handle(Request::GetReplicas { keys }), p.batch);
                    let keys = pick(names, &mut rng, p.batch);
                    bad += failures(master.handle(Request::Exists { keys }), p.batch);
                }
                ops += 10 * b;
            }
        }
    }
    (ops, bad, put_keys)
}

/// Runs one phase on `threads` threads; (requests per second, failures).
fn phase(
    master: &Master,
    names: &[String],
    phase: Phase,
    threads: usize,
    p: &Params,
) -> (f64, u64) {
    let stop = AtomicBool::new(false);
    let start = Barrier::new(threads + 1);
    let (secs, outcomes) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (stop, start) = (&stop, &start);
                s.spawn(move || worker(master, names, phase, t, p, start, stop))
            })
            .collect();
        start.wait();
        let t0 = Instant::now();
        std::thread::sleep(p.duration);
        stop.store(true, Ordering::Relaxed);
        let outcomes: Vec<_> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or((0, u64::MAX / 4, Vec::new())))
            .collect();
        (t0.elapsed().as_secs_f64(), outcomes)
    });
    let (mut ops, mut bad) = (0u64, 0u64);
    for (o, b, put) in outcomes {
        ops += o;
        bad += b;
        // Keep the table at its populated size for the next phase.
        for k in put {
            if master.remove(&k, true).is_err() {
                bad += 1;
            }
        }
    }
    (ops as f64 / secs, bad)
}

/// A default master with one segment of `size` bytes mounted by `CLIENT`.
fn mounted_master(size: u64) -> Result<Master, String> {
    let master = Master::new(MasterConfig::default());
    let segment = SegmentInfo {
        name: "paper-node:1".to_owned(),
        base: 1 << 44,
        size,
    };
    master
        .mount(CLIENT, segment)
        .map_err(|e| format!("mount: {e}"))?;
    Ok(master)
}

fn one_run(threads: usize, p: &Params, segment_size: u64) -> Result<Value, String> {
    let master = mounted_master(segment_size)?;
    let names: Vec<String> = (0..p.keys).map(|i| format!("key/{i}")).collect();
    let mut errors = 0;
    for chunk in names.chunks(256) {
        errors += put_pair(&master, chunk.to_vec(), p.size);
    }
    if errors > 0 {
        return Err(format!("populating {} keys: {errors} failed", p.keys));
    }
    let mut rates = Vec::new();
    for ph in [Phase::Put, Phase::GetReplicas, Phase::Exists, Phase::Mix] {
        let (rate, bad) = phase(&master, &names, ph, threads, p);
        rates.push(rate);
        errors += bad;
    }
    let stats = master.stats();
    let round = |x: f64| x.round() as u64;
    Ok(Value::object([
        ("bench", Value::from("master")),
        ("threads", threads.into()),
        ("keys", p.keys.into()),
        ("batch", p.batch.into()),
        ("size", p.size.into()),
        ("seconds_per_phase", p.duration.as_secs_f64().into()),
        ("put_pairs_per_s", round(rates[0] / 2.0).into()),
        ("put_ops_per_s", round(rates[0]).into()),
        ("get_replicas_per_s", round(rates[1]).into()),
        ("exists_per_s", round(rates[2]).into()),
        ("mix_ops_per_s", round(rates[3]).into()),
        ("ops_per_s", round(rates[3]).into()),
        ("mix", "1 put pair : 4 get_replicas : 4 exists".into()),
        ("errors", errors.into()),
        ("evicted_objects", stats.evicted_objects.into()),
        ("objects_after", stats.objects.into()),
    ]))
}

pub fn run(raw: &[String]) -> Result<(), String> {
    let a = Args::parse(raw)?;
    let threads: Vec<usize> = a
        .str("threads")
        .unwrap_or("1")
        .split(',')
        .map(|t| {
            t.trim()
                .parse()
                .map_err(|_| format!("--threads: bad count {t:?}"))
        })
        .collect::<Result<_, _>>()?;
    let p = Params {
        keys: a.get("keys", 100_000usize)?,
        batch: a.get("batch", 1usize)?,
        size: a.get("size", 4096u64)?,
        duration: Duration::from_secs_f64(a.get("duration", 2.0f64)?),
    };
    // Paper bytes: big enough that the put phases never evict.
    let segment_size: u64 = a.get("segment-size", 64u64 << 30)?;
    let objects: usize = a.get("objects", 0usize)?;
    a.finish()?;
    if objects > 0 {
        // The baseline first: the same phases on `--keys` objects.
        for n in [p.keys, objects] {
            let line = scale_run(n, &p)?;
            println!("{line}");
        }
        return Ok(());
    }
    if p.keys == 0 || p.batch == 0 || p.size == 0 || threads.contains(&0) {
        return Err("--keys, --batch, --size and --threads must be positive".into());
    }
    let mut errors = 0;
    for &t in &threads {
        let line = one_run(t, &p, segment_size)?;
        errors += line.get("errors").and_then(Value::as_u64).unwrap_or(0);
        println!("{line}");
    }
    if errors > 0 {
        return Err(format!("{errors} metadata request(s) failed"));
    }
    Ok(())
}

/// Resident memory of this process, in bytes (Linux; 0 elsewhere).
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * page.max(0) as u64
}

/// The scale test on `objects` objects (see the module's comment).
fn scale_run(objects: usize, p: &Params) -> Result<Value, String> {
    let rss_before = rss_bytes();
    // Whole slabs, exactly `objects` blocks of this size class.
    let slab = MasterConfig::default().allocator.slab_size;
    let per_slab = (slab / p.size.max(1)).max(1);
    let slabs = (objects as u64).div_ceil(per_slab);
    let master = mounted_master(slabs * slab)?;
    let t0 = Instant::now();
    let mut errors = 0;
    let mut keys = Vec::with_capacity(256);
    for i in 0..objects {
        keys.push(format!("key/{i}"));
        if keys.len() == 256 || i + 1 == objects {
            errors += put_pair(&master, std::mem::take(&mut keys), p.size);
        }
    }
    let populate_s = t0.elapsed().as_secs_f64();
    let rss_after = rss_bytes();
    let stored = master.stats().objects;
    // Every put now evicts (the pool is full); keys read are picked among all.
    let mut rng = Rng(0x5EED);
    let (mut puts, mut gets) = (0u64, 0u64);
    let t1 = Instant::now();
    while t1.elapsed() < p.duration {
        errors += put_pair(&master, vec![format!("fresh/{puts}")], p.size);
        puts += 1;
    }
    let put_s = t1.elapsed().as_secs_f64();
    let t2 = Instant::now();
    while t2.elapsed() < p.duration {
        let key = format!("key/{}", rng.below(objects));
        // Evicted keys fail: counted as requests all the same.
        let _ = master.handle(Request::GetReplicas { keys: vec![key] });
        gets += 1;
    }
    let get_s = t2.elapsed().as_secs_f64();
    let evicted = master.stats().evicted_objects;
    drop(master);
    let per_object = rss_after.saturating_sub(rss_before) as f64 / objects.max(1) as f64;
    Ok(Value::object([
        ("bench", Value::from("master_scale")),
        ("objects", objects.into()),
        ("objects_stored", stored.into()),
        ("size", p.size.into()),
        (
            "populate_put_pairs_per_s",
            (objects as f64 / populate_s).round().into(),
        ),
        (
            "rss_delta_bytes",
            rss_after.saturating_sub(rss_before).into(),
        ),
        ("bytes_per_object", per_object.round().into()),
        (
            "evicting_put_pairs_per_s",
            (puts as f64 / put_s).round().into(),
        ),
        ("get_replicas_per_s", (gets as f64 / get_s).round().into()),
        ("evicted_objects", evicted.into()),
        ("errors", errors.into()),
    ]))
}
