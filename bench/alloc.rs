//! `mooncake bench alloc`: the store's slab allocator. Prints one JSON object per
//! line: alloc+free pair latency on 1 and 2 threads next to `std::alloc` measured
//! in the same run, and how full a 1 GiB segment gets on the FAST'25
//! conversation trace's object sizes before the first allocation fails.
//!
//! Options: `--ops N` pairs per thread (default 2000000), `--batch N` pairs per
//! timed batch (1000), `--trace PATH`, `--bytes-per-token N` (128), `--capacity
//! BYTES` (1G), `--slab-size BYTES` (only this slab size; default: 4M, then 1M
//! and 256K for comparison). Sizes accept K/M/G.

use std::alloc::Layout;
use std::hint::black_box;
use std::sync::Barrier;
use std::time::Instant;

use mooncake_base::json::{self, Value};
use mooncake_base::util::percentile;
use mooncake_store::allocator::{AllocatorConfig, SlabAllocator};

/// 48..64 KiB: a few neighbouring classes around a 512-token KV block.
const PAIR_SIZES: [u64; 8] = [65536, 61440, 57344, 53248, 49152, 63488, 59392, 65535];
const TOKENS_PER_BLOCK: u64 = 512;

struct Params {
    ops: u64,
    batch: u64,
    /// `None`: the shipped trace (built in).
    trace: Option<String>,
    bytes_per_token: u64,
    capacity: u64,
    slab_size: Option<u64>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    mooncake_base::util::size::parse(s)
}

fn parse_args(args: &[String]) -> Result<Params, String> {
    let mut p = Params {
        ops: 2_000_000,
        batch: 1000,
        trace: None,
        bytes_per_token: 128,
        capacity: 1 << 30,
        slab_size: None,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--ops" => p.ops = parse_size(value)?,
            "--batch" => p.batch = parse_size(value)?.max(1),
            "--trace" => p.trace = Some(value.clone()),
            "--bytes-per-token" => p.bytes_per_token = parse_size(value)?.max(1),
            "--capacity" => p.capacity = parse_size(value)?,
            "--slab-size" => p.slab_size = Some(parse_size(value)?),
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(p)
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round4(x: f64) -> f64 {
    (x * 10_000.0).round() / 10_000.0
}

/// Per-batch ns per pair over all threads, and the wall time of the whole run.
struct Timing {
    batch_ns: Vec<f64>,
    seconds: f64,
}

/// Runs `pair(i)` `ops` times on each of `threads` threads, timing batches.
fn timed(threads: usize, ops: u64, batch: u64, pair: &(dyn Fn(usize) + Sync)) -> Timing {
    let start = Barrier::new(threads + 1);
    let (mut batch_ns, seconds) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let start = &start;
                s.spawn(move || {
                    let mut lat = Vec::with_capacity((ops / batch + 1) as usize);
                    start.wait();
                    let mut done = 0;
                    while done < ops {
                        let n = batch.min(ops - done);
                        let t = Instant::now();
                        for i in 0..n {
                            pair((done + i) as usize);
                        }
                        lat.push(t.elapsed().as_nanos() as f64 / n as f64);
                        done += n;
                    }
                    lat
                })
            })
            .collect();
        start.wait();
        let t = Instant::now();
        let lat: Vec<f64> = handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        (lat, t.elapsed().as_secs_f64())
    });
    batch_ns.sort_by(f64::total_cmp);
    Timing { batch_ns, seconds }
}

fn pair_figures(p: &Params) -> Result<(), String> {
    let slab = SlabAllocator::new(1 << 30, AllocatorConfig::default());
    let ours = |i: usize| {
        let a = slab
            .alloc(PAIR_SIZES[i % PAIR_SIZES.len()])
            .expect("1 GiB has room");
        slab.free(black_box(a));
    };
    let layouts: Vec<Layout> = PAIR_SIZES
        .iter()
        .map(|&s| Layout::from_size_align(s as usize, 64).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let std_pair = |i: usize| {
        let layout = layouts[i % layouts.len()];
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        // SAFETY: `ptr` came from `alloc` with this layout and is freed once.
        unsafe { std::alloc::dealloc(black_box(ptr), layout) };
    };
    // Warm up both (first slabs carved, malloc arenas made) outside the timing.
    timed(2, 10 * p.batch, p.batch, &ours);
    timed(2, 10 * p.batch, p.batch, &std_pair);
    let (mut single_ops_per_s, mut single_median) = (0.0, 0.0);
    for threads in [1usize, 2] {
        let t = timed(threads, p.ops, p.batch, &ours);
        let base = timed(threads, p.ops, p.batch, &std_pair);
        let ops_per_s = (threads as u64 * p.ops) as f64 / t.seconds;
        let base_ops_per_s = (threads as u64 * p.ops) as f64 / base.seconds;
        let mut fields = vec![
            ("bench", Value::from("alloc")),
            ("figure", "alloc_free_pair".into()),
            ("threads", threads.into()),
            ("ops", (threads as u64 * p.ops).into()),
            ("sizes", "48-64KiB".into()),
            ("median_ns", round1(percentile(&t.batch_ns, 0.5)).into()),
            ("p50_ns", round1(percentile(&t.batch_ns, 0.5)).into()),
            ("p99_ns", round1(percentile(&t.batch_ns, 0.99)).into()),
            ("ops_per_s", (ops_per_s.round() as u64).into()),
            ("baseline", "std_alloc_dealloc".into()),
            (
                "baseline_median_ns",
                round1(percentile(&base.batch_ns, 0.5)).into(),
            ),
            ("baseline_ops_per_s", (base_ops_per_s.round() as u64).into()),
        ];
        let median = percentile(&t.batch_ns, 0.5);
        if threads == 1 {
            (single_ops_per_s, single_median) = (ops_per_s, median);
        } else {
            // Wall-clock ratio as asked; the median-based one (per-thread pair
            // latency) shrugs off other processes taking a core for a while.
            fields.push(("scaling", round4(ops_per_s / single_ops_per_s).into()));
            let by_median = threads as f64 * single_median / median;
            fields.push(("scaling_by_median", round4(by_median).into()));
        }
        println!("{}", Value::object(fields));
    }
    Ok(())
}

/// Object sizes in trace order: one per 512-token block, the last block of a
/// request holding the remainder of its input.
fn trace_sizes(path: Option<&str>, bytes_per_token: u64) -> Result<Vec<u64>, String> {
    let text = mooncake_cli::trace::text(path)?;
    let path = mooncake_cli::trace::name(path);
    let mut sizes = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let bad = |what: &str| format!("{path}:{}: {what}", n + 1);
        let v = json::parse(line).map_err(|e| bad(&e.to_string()))?;
        let input = v
            .u64_field("input_length")
            .map_err(|e| bad(&e.to_string()))?;
        let blocks = v
            .get("hash_ids")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no hash_ids array"))?
            .len() as u64;
        for i in 0..blocks {
            let tokens = if i + 1 < blocks {
                TOKENS_PER_BLOCK
            } else {
                input.saturating_sub(TOKENS_PER_BLOCK * (blocks - 1)).max(1)
            };
            sizes.push(tokens * bytes_per_token);
        }
    }
    Ok(sizes)
}

/// Fills a fresh allocator in trace order until the first allocation fails
/// (objects above the largest class are striped, as the master does).
fn utilization(p: &Params, sizes: &[u64], config: AllocatorConfig, label: &str) {
    let a = SlabAllocator::new(p.capacity, config);
    let max = a.max_object_size();
    let mut objects = 0u64;
    'fill: for &size in sizes {
        let mut left = size;
        while left > 0 {
            let piece = left.min(max);
            if a.alloc(piece).is_none() {
                break 'fill;
            }
            left -= piece;
        }
        objects += 1;
    }
    let cap = p.capacity.max(1) as f64;
    let line = Value::object([
        ("bench", Value::from("alloc")),
        ("figure", "utilization".into()),
        ("config", label.into()),
        (
            "trace",
            mooncake_cli::trace::name(p.trace.as_deref())
                .rsplit('/')
                .next()
                .unwrap_or("")
                .into(),
        ),
        ("bytes_per_token", p.bytes_per_token.into()),
        ("capacity", p.capacity.into()),
        ("slab_size", a.slab_size().into()),
        ("classes", a.size_classes().len().into()),
        ("objects", objects.into()),
        ("requested_bytes", a.requested_bytes().into()),
        (
            "utilization",
            round4(a.requested_bytes() as f64 / cap).into(),
        ),
        ("used_ratio", round4(a.used_bytes() as f64 / cap).into()),
        ("carved_ratio", round4(a.carved_bytes() as f64 / cap).into()),
        ("target", 0.95.into()),
    ]);
    println!("{line}");
}

pub fn run(args: &[String]) -> Result<(), String> {
    let p = parse_args(args)?;
    pair_figures(&p)?;
    let sizes = trace_sizes(p.trace.as_deref(), p.bytes_per_token)?;
    let base = AllocatorConfig::default();
    match p.slab_size {
        Some(slab_size) => utilization(&p, &sizes, AllocatorConfig { slab_size, ..base }, "given"),
        None => {
            // What the master uses for a segment of this size, then the fixed default.
            utilization(&p, &sizes, base.for_segment(p.capacity), "sized_to_segment");
            utilization(&p, &sizes, base, "fixed_default");
        }
    }
    Ok(())
}
