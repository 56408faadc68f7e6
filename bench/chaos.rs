//! `mooncake bench chaos-load`: the load side of `bench/chaos.py`. A pure client of a
//! running cluster that puts objects whose bytes derive from their key, at a steady
//! rate, and reads random committed ones back, checking every byte. After each
//! committed put it asks the master where the object lives (`describe`), so that an
//! object missing at the end can be told apart: gone with the memory of a node killed
//! after its put started, or lost.
//!
//! Output (stdout, one JSON object per line): `{"phase":"loaded",...}` when the load
//! ends; then it waits for a line on stdin (the driver has every process back up) and
//! reads every committed object again, retrying the unreadable ones until none is
//! left, the set stops shrinking for `--stable` seconds or `--settle` seconds passed;
//! `{"phase":"verified",...}` lists those still unreadable with where they were put.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mooncake_base::json::Value;
use mooncake_base::Code;
use mooncake_cli::args::Args;
use mooncake_store::{Client, ReplicateConfig};

/// Object sizes, picked per key from its pattern's seed (`bench/chaos.py` knows them).
/// At most 256 KiB: the smallest slab a node's segment gets, so no object is striped
/// over several nodes (those leave no disk copy when evicted, by design).
const SIZES: [usize; 4] = [16 << 10, 64 << 10, 128 << 10, 256 << 10];
/// Gets aim at the newest this many objects half of the time (likely in memory),
/// at any committed object otherwise (mostly on disk).
const RECENT: usize = 1000;
/// Reads that returned wrong bytes, kept by key for the report.
const KEPT_WRONG: usize = 20;

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Object `i`'s seed; word `j` of its value is `splitmix64(base + j)`, little-endian.
fn base_of(seed: u64, i: u64) -> u64 {
    splitmix64((seed << 32) ^ i)
}

fn size_of(seed: u64, i: u64) -> usize {
    SIZES[(base_of(seed, i) >> 62) as usize]
}

fn value_of(seed: u64, i: u64) -> Vec<u8> {
    let base = base_of(seed, i);
    let words = size_of(seed, i) / 8;
    (0..words as u64)
        .flat_map(|j| splitmix64(base.wrapping_add(j)).to_le_bytes())
        .collect()
}

fn key_of(seed: u64, i: u64) -> String {
    format!("chaos-{seed}-{i}")
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A put the store acknowledged.
struct Committed {
    i: u64,
    /// Wall-clock ms when its put started (nodes killed after this may take it along).
    start_ms: u64,
    /// Per memory replica right after the put, the segments holding its pieces;
    /// `None`: the master could not say (it was down, or the object was already gone).
    replicas: Option<Vec<Vec<String>>>,
}

#[derive(Default)]
struct Counts {
    puts: u64,
    put_errors: BTreeMap<String, u64>,
    gets: u64,
    hits: u64,
    misses: u64,
    get_errors: BTreeMap<String, u64>,
    wrong: u64,
    wrong_keys: Vec<String>,
    /// Committed objects with a replica spread over several nodes' segments.
    striped: u64,
}

enum Read {
    Right,
    Wrong(String),
    Missing,
    Failed(String),
}

struct Load {
    client: Client,
    seed: u64,
    replicate: ReplicateConfig,
    committed: Vec<Committed>,
    counts: Counts,
    rng: u64,
}

impl Load {
    fn random(&mut self, below: usize) -> usize {
        self.rng = splitmix64(self.rng);
        (self.rng % below.max(1) as u64) as usize
    }

    fn read(&self, i: u64) -> Read {
        match self.client.get(&key_of(self.seed, i)) {
            Ok(bytes) if bytes == value_of(self.seed, i) => Read::Right,
            Ok(bytes) => Read::Wrong(format!(
                "{}: {} bytes back, {} expected, first difference at byte {:?}",
                key_of(self.seed, i),
                bytes.len(),
                size_of(self.seed, i),
                bytes
                    .iter()
                    .zip(value_of(self.seed, i))
                    .position(|(a, b)| *a != b)
            )),
            Err(e) if e.code() == Code::ObjectNotFound => Read::Missing,
            Err(e) => Read::Failed(format!("{:?}", e.code())),
        }
    }

    fn count_read(&mut self, r: Read) {
        self.counts.gets += 1;
        match r {
            Read::Right => self.counts.hits += 1,
            Read::Missing => self.counts.misses += 1,
            Read::Failed(code) => *self.counts.get_errors.entry(code).or_default() += 1,
            Read::Wrong(what) => {
                self.counts.wrong += 1;
                if self.counts.wrong_keys.len() < KEPT_WRONG {
                    self.counts.wrong_keys.push(what);
                }
            }
        }
    }

    /// Where object `i` lives, asked again for a while when the master is away.
    fn locate(&self, i: u64) -> Option<Vec<Vec<String>>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.client.describe(&key_of(self.seed, i)) {
                Ok((desc, _)) => {
                    let replicas = desc.replicas.iter().map(|r| {
                        let mut segments: Vec<String> =
                            r.pieces.iter().map(|p| p.segment.to_string()).collect();
                        segments.sort();
                        segments.dedup();
                        segments
                    });
                    return Some(replicas.collect());
                }
                Err(e) if e.code() == Code::ObjectNotFound => return None,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(_) => return None,
            }
        }
    }

    fn put(&mut self, i: u64) {
        let start_ms = now_ms();
        let key = key_of(self.seed, i);
        match self
            .client
            .put(&key, &value_of(self.seed, i), &self.replicate)
        {
            Ok(()) => {
                self.counts.puts += 1;
                let replicas = self.locate(i);
                if replicas.iter().flatten().any(|r| r.len() > 1) {
                    self.counts.striped += 1;
                }
                self.committed.push(Committed {
                    i,
                    start_ms,
                    replicas,
                });
            }
            Err(e) => {
                *self
                    .counts
                    .put_errors
                    .entry(format!("{:?}", e.code()))
                    .or_default() += 1
            }
        }
    }

    fn get_one(&mut self) {
        let n = self.committed.len();
        if n == 0 {
            return;
        }
        let pick = if self.random(2) == 0 {
            n - 1 - self.random(n.min(RECENT))
        } else {
            self.random(n)
        };
        let r = self.read(self.committed[pick].i);
        self.count_read(r);
    }

    fn counts_json(&self, phase: &str, seconds: f64) -> Vec<(String, Value)> {
        let c = &self.counts;
        let codes = |m: &BTreeMap<String, u64>| {
            Value::object(m.iter().map(|(k, v)| (k.clone(), Value::from(*v))))
        };
        vec![
            ("phase".into(), Value::from(phase)),
            (
                "seconds".into(),
                Value::from((seconds * 10.0).round() / 10.0),
            ),
            ("puts".into(), Value::from(c.puts)),
            ("put_errors".into(), codes(&c.put_errors)),
            ("gets".into(), Value::from(c.gets)),
            ("hits".into(), Value::from(c.hits)),
            ("misses".into(), Value::from(c.misses)),
            ("get_errors".into(), codes(&c.get_errors)),
            ("wrong".into(), Value::from(c.wrong)),
            ("striped".into(), Value::from(c.striped)),
            (
                "wrong_keys".into(),
                Value::from(
                    c.wrong_keys
                        .iter()
                        .map(|k| Value::from(k.as_str()))
                        .collect::<Vec<_>>(),
                ),
            ),
        ]
    }

    /// Reads every committed object; the unreadable ones again every second until
    /// none is left, none came back for `stable`, or `settle` passed. Returns the
    /// indices (into `committed`) still unreadable.
    fn verify(&mut self, settle: Duration, stable: Duration) -> Vec<usize> {
        let started = Instant::now();
        let mut last_change = Instant::now();
        let mut left: Vec<usize> = (0..self.committed.len()).collect();
        loop {
            let before = left.len();
            let mut still = Vec::new();
            for idx in left {
                match self.read(self.committed[idx].i) {
                    Read::Right => {}
                    Read::Wrong(what) => {
                        self.counts.wrong += 1;
                        if self.counts.wrong_keys.len() < KEPT_WRONG {
                            self.counts.wrong_keys.push(what);
                        }
                    }
                    Read::Missing | Read::Failed(_) => still.push(idx),
                }
            }
            left = still;
            if left.len() < before {
                last_change = Instant::now();
            }
            if left.is_empty() || started.elapsed() >= settle || last_change.elapsed() >= stable {
                return left;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

fn print_line(fields: Vec<(String, Value)>) {
    println!("{}", Value::object(fields));
    let _ = std::io::stdout().flush();
}

pub fn run(raw: &[String]) -> Result<(), String> {
    let a = Args::parse(raw)?;
    let seconds: f64 = a.get("seconds", 60.0)?;
    let put_rate: f64 = a.get("put-rate", 25.0)?;
    let gets_per_put: u32 = a.get("gets-per-put", 2)?;
    let replica_num: u32 = a.get("replicas", 1)?;
    let seed: u64 = a.get("seed", 1)?;
    let settle = Duration::from_secs(a.get("settle", 120)?);
    let stable = Duration::from_secs(a.get("stable", 30)?);
    let mut cfg = mooncake_cli::store::client_config(&a)?;
    a.finish()?;
    mooncake_cli::store::metadata_from_master(&a, &mut cfg)?;
    if !(put_rate > 0.0 && seconds > 0.0) || replica_num == 0 || seed >= 1 << 24 {
        return Err(
            "--put-rate and --seconds must be positive, --replicas at least 1, --seed below 2^24"
                .into(),
        );
    }
    let client = Client::new(cfg).map_err(|e| format!("connecting to the cluster: {e}"))?;
    let mut load = Load {
        client,
        seed,
        replicate: ReplicateConfig {
            replica_num,
            ..ReplicateConfig::default()
        },
        committed: Vec::new(),
        counts: Counts::default(),
        rng: splitmix64(seed ^ 0xC4A0_5EED),
    };

    let started = Instant::now();
    let period = Duration::from_secs_f64(1.0 / put_rate);
    let mut i = 0u64;
    while started.elapsed().as_secs_f64() < seconds {
        load.put(i);
        for _ in 0..gets_per_put {
            load.get_one();
        }
        i += 1;
        // Paced: the next put is due at i periods from the start.
        if let Some(wait) = (period * i as u32).checked_sub(started.elapsed()) {
            std::thread::sleep(wait);
        }
    }
    let mut loaded = load.counts_json("loaded", started.elapsed().as_secs_f64());
    loaded.push(("attempted".into(), Value::from(i)));
    print_line(loaded);

    // The driver says when every process is back.
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| format!("waiting for the driver: {e}"))?;
    let verify_started = Instant::now();
    let left = load.verify(settle, stable);
    let unreadable: Vec<Value> = left
        .iter()
        .map(|&idx| {
            let c = &load.committed[idx];
            Value::object([
                ("key", Value::from(key_of(seed, c.i))),
                ("size", Value::from(size_of(seed, c.i))),
                ("start_ms", Value::from(c.start_ms)),
                (
                    "replicas",
                    match &c.replicas {
                        Some(replicas) => Value::from(
                            replicas
                                .iter()
                                .map(|r| {
                                    Value::from(
                                        r.iter()
                                            .map(|n| Value::from(n.as_str()))
                                            .collect::<Vec<_>>(),
                                    )
                                })
                                .collect::<Vec<_>>(),
                        ),
                        None => Value::Null,
                    },
                ),
            ])
        })
        .collect();
    let mut verified = load.counts_json("verified", verify_started.elapsed().as_secs_f64());
    verified.push(("committed".into(), Value::from(load.committed.len())));
    verified.push(("unreadable".into(), Value::from(unreadable)));
    print_line(verified);
    Ok(())
}
