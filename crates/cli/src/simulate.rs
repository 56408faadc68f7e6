//! `mooncake simulate`: replays a trace's block ids (no bytes move) through caches of
//! several capacities and prints the prefix hit rates, per policy: FIFO, LRU and
//! Belady-optimal as the `kvcache-simulator` package computes them, and `store`, the
//! real master. Every (capacity, policy) run is independent, so they run in parallel.

mod plan;
mod policies;
mod store;
mod svg;

use mooncake_base::util::sync::Unpoisoned;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use super::args::Args;
use super::calc::{self, Catalog};
use mooncake_base::json::Value;
use mooncake_base::util::size;
use plan::Plan;
pub use plan::DEFAULT_BLOCK_TOKENS;
use policies::{Policy, Tally};
use store::{StoreFigures, StoreSetup};

/// The store's block object when neither `--block-bytes` nor a model says: the
/// demo's 64 KiB.
const DEFAULT_STORE_BLOCK_BYTES: u64 = 64 << 10;
/// Segments the store's pool is split into unless told: the demo's two nodes.
const DEFAULT_SEGMENTS: u64 = 2;

/// LRU's and Belady-optimal's prefix hit rates (all requests, then the last half) for a
/// cache of `capacity` blocks over the trace's first `limit` requests: the yardsticks
/// a replay's own hit rate is read against.
pub fn reference_rates(
    trace: Option<&str>,
    limit: Option<usize>,
    capacity: u64,
) -> Result<[(f64, f64); 2], String> {
    let text = super::trace::text(trace)?;
    let plan = plan::parse(
        &text,
        super::trace::name(trace),
        DEFAULT_BLOCK_TOKENS,
        limit,
    )?;
    Ok([Policy::Lru, Policy::Optimal].map(|p| {
        let t = policies::run(&plan, p, capacity);
        (t.rate(), t.rate_last_half())
    }))
}

/// One `--capacities` item: a block count, or a size that `block_bytes` converts.
fn parse_capacity(item: &str, block_bytes: Option<f64>) -> Result<u64, String> {
    let item = item.trim();
    if let Ok(n) = item.parse::<u64>() {
        return match n {
            0 => Err("--capacities: a capacity must be at least one block".into()),
            n => Ok(n),
        };
    }
    let bytes = size::parse(item).map_err(|e| format!("--capacities: {e}"))?;
    let per = block_bytes.ok_or_else(|| {
        format!(
            "--capacities: {item:?} is a size; give --block-bytes N or --model ID to convert it \
             to blocks (plain numbers are block counts)"
        )
    })?;
    // As the package converts a budget: floor(bytes / bytes per block).
    let blocks = (bytes as f64 / per).floor() as u64;
    if blocks == 0 {
        return Err(format!(
            "--capacities: {item:?} holds no block of {per} bytes"
        ));
    }
    Ok(blocks)
}

/// What one run produced.
struct Outcome {
    capacity: u64,
    policy: Policy,
    tally: Tally,
    store: Option<StoreFigures>,
    seconds: f64,
}

/// Everything the output needs besides the outcomes.
struct Context<'a> {
    trace: &'a str,
    plan: &'a Plan,
    /// Bytes per block, when a model or `--block-bytes` gave them.
    block_bytes: Option<f64>,
    /// The store's object size.
    store_block_bytes: u64,
    model: Option<String>,
    ceiling: Tally,
    seconds: f64,
}

/// `mooncake simulate`.
pub fn simulate(raw: &[String]) -> Result<(), String> {
    let started = Instant::now();
    let a = Args::parse(raw)?;
    let trace = a.str("trace").map(str::to_owned);
    let limit = match a.str("requests") {
        None => None,
        Some(_) => Some(a.get::<usize>("requests", 0)?),
    };
    let block_tokens: u64 = a.get("block-tokens", DEFAULT_BLOCK_TOKENS)?;
    let catalog = Catalog::builtin()?;
    let chosen = calc::model_flags(&a, &catalog)?;
    let estimate_tokens: u64 = a.get("estimate-tokens", 0)?;
    let block_bytes_flag = match a.str("block-bytes") {
        None => None,
        Some(s) => Some(size::parse(s).map_err(|e| format!("--block-bytes: {e}"))?),
    };
    let capacities_arg = a.str("capacities").map(str::to_owned);
    let policies_arg = a
        .str("policies")
        .unwrap_or("fifo,lru,optimal,store")
        .to_owned();
    let segments: u64 = a.get("segments", DEFAULT_SEGMENTS)?;
    let threads: usize = a.get(
        "threads",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    )?;
    let json_out = a.flag("json")?;
    let svg_path = a.str("svg").map(str::to_owned);
    a.finish()?;
    if block_tokens == 0 {
        return Err("--block-tokens must be positive".into());
    }
    if segments == 0 {
        return Err("--segments must be at least 1".into());
    }
    if chosen.is_some() && block_bytes_flag.is_some() {
        return Err("give --model (or --config) or --block-bytes, not both".into());
    }
    if block_bytes_flag == Some(0) {
        return Err("--block-bytes must be positive".into());
    }
    let mut policies = Vec::new();
    for name in policies_arg
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let p = Policy::parse(name).ok_or_else(|| {
            format!("--policies: unknown policy {name:?} (fifo, lru, optimal, store)")
        })?;
        if !policies.contains(&p) {
            policies.push(p);
        }
    }
    if policies.is_empty() {
        return Err("--policies: name at least one policy".into());
    }

    let text = super::trace::text(trace.as_deref())?;
    let name = super::trace::name(trace.as_deref()).to_owned();
    let plan = plan::parse(&text, &name, block_tokens, limit)?;
    drop(text);

    // Bytes per block: from the model (sized for the trace's average input, as the
    // package does) or given.
    let (block_bytes, model) = match &chosen {
        Some((m, ask)) => {
            let tokens = if estimate_tokens > 0 {
                estimate_tokens
            } else {
                plan.estimate_tokens()
            };
            let s = calc::size(&catalog, m, tokens, ask)?;
            let per_block = s.bytes_per_token * plan.block_tokens as f64;
            let label = format!(
                "{} {}{}: {}/token, {}/block (sized at {tokens} tokens)",
                m.id,
                s.precision,
                s.indexer_precision
                    .as_deref()
                    .map(|p| format!(" (indexer {p})"))
                    .unwrap_or_default(),
                calc::human(s.bytes_per_token),
                calc::human(per_block)
            );
            (Some(per_block), Some(label))
        }
        None => (block_bytes_flag.map(|b| b as f64), None),
    };
    if block_bytes.is_some_and(|b| b.is_nan() || b <= 0.0) {
        return Err("the model's blocks take no bytes".into());
    }
    let store_block_bytes = block_bytes.map_or(DEFAULT_STORE_BLOCK_BYTES, |b| b.ceil() as u64);

    let mut capacities = match &capacities_arg {
        Some(list) => list
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|c| parse_capacity(c, block_bytes))
            .collect::<Result<Vec<u64>, String>>()?,
        None => default_capacities(plan.unique_blocks() as u64),
    };
    capacities.sort_unstable();
    capacities.dedup();
    if capacities.is_empty() {
        return Err("--capacities: name at least one capacity".into());
    }

    let setup = StoreSetup {
        block_bytes: store_block_bytes,
        segments,
    };
    let outcomes = run_all(&plan, &capacities, &policies, &setup, threads)?;
    let ctx = Context {
        trace: &name,
        plan: &plan,
        block_bytes,
        store_block_bytes,
        model,
        ceiling: policies::ceiling(&plan),
        seconds: started.elapsed().as_secs_f64(),
    };
    if let Some(path) = &svg_path {
        write_svg(path, &ctx, &outcomes, &policies)?;
    }
    if json_out {
        for o in &outcomes {
            println!("{}", to_json(&ctx, o));
        }
    } else {
        print!("{}", table(&ctx, &outcomes, svg_path.as_deref()));
    }
    Ok(())
}

/// Powers of two from 1,024 blocks up to the first that holds every block.
fn default_capacities(unique: u64) -> Vec<u64> {
    let mut out = vec![1024u64];
    while *out.last().unwrap_or(&0) < unique.max(1024) {
        out.push(out.last().unwrap_or(&1024) * 2);
    }
    out
}

/// Runs every (capacity, policy) pair on `threads` threads, costliest first.
fn run_all(
    plan: &Plan,
    capacities: &[u64],
    policies: &[Policy],
    setup: &StoreSetup,
    threads: usize,
) -> Result<Vec<Outcome>, String> {
    let mut tasks: Vec<(u64, Policy)> = capacities
        .iter()
        .flat_map(|&c| policies.iter().map(move |&p| (c, p)))
        .collect();
    // The store is the slowest, then the tree policies; big caches cost more.
    let rank = |p: Policy| match p {
        Policy::Store => 0,
        Policy::Optimal | Policy::Lru => 1,
        Policy::Fifo => 2,
    };
    tasks.sort_by_key(|&(c, p)| (rank(p), std::cmp::Reverse(c)));
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Result<Outcome, String>>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, tasks.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(capacity, policy)) = tasks.get(i) else {
                    break;
                };
                let t = Instant::now();
                let r = match policy {
                    Policy::Store => store::run(plan, capacity, setup)
                        .map(|(tally, figures)| (tally, Some(figures))),
                    p => Ok((policies::run(plan, p, capacity), None)),
                };
                let out = r.map(|(tally, store)| Outcome {
                    capacity,
                    policy,
                    tally,
                    store,
                    seconds: t.elapsed().as_secs_f64(),
                });
                results.locked().push(out);
            });
        }
    });
    let mut outcomes = results
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let order = |p: Policy| policies.iter().position(|q| *q == p).unwrap_or(0);
    outcomes.sort_by_key(|o| (o.capacity, order(o.policy)));
    Ok(outcomes)
}

fn to_json(ctx: &Context, o: &Outcome) -> Value {
    let t = &o.tally;
    let mut v = vec![
        ("capacity_blocks", Value::from(o.capacity)),
        ("policy", o.policy.name().into()),
        ("hit_rate", t.rate().into()),
        ("hit_rate_last_half", t.rate_last_half().into()),
        ("hit_tokens", t.hit.into()),
        ("input_tokens", t.total.into()),
        ("hit_tokens_last_half", t.hit_last_half.into()),
        ("input_tokens_last_half", t.total_last_half.into()),
        // The package leaves such capacities out: no pressure before the measured half.
        ("underfilled", (!t.filled).into()),
        ("ceiling_last_half", ctx.ceiling.rate_last_half().into()),
        ("requests", ctx.plan.requests().into()),
        ("unique_blocks", ctx.plan.unique_blocks().into()),
        ("unique_ids", ctx.plan.unique_ids.into()),
        ("block_tokens", ctx.plan.block_tokens.into()),
        ("seconds", o.seconds.into()),
    ];
    if let Some(b) = ctx.block_bytes {
        v.push(("block_bytes", b.into()));
        v.push(("capacity_bytes", (b * o.capacity as f64).into()));
    }
    if let Some(s) = &o.store {
        v.push(("store_block_bytes", ctx.store_block_bytes.into()));
        v.push(("pool_bytes", s.pool_bytes.into()));
        v.push(("segments", s.segments.into()));
        v.push(("peak_objects", s.peak_objects.into()));
        v.push(("mean_used_last_half", s.mean_used_last_half.into()));
        v.push(("evictions", s.evictions.into()));
        v.push(("puts_rejected", s.puts_rejected.into()));
    }
    Value::object(v)
}

fn table(ctx: &Context, outcomes: &[Outcome], svg: Option<&str>) -> String {
    let p = ctx.plan;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "mooncake simulate: {}: {} requests, {} prefix blocks ({} distinct ids) of {} tokens{}",
        ctx.trace,
        p.requests(),
        p.unique_blocks(),
        p.unique_ids,
        p.block_tokens,
        if p.skipped > 0 {
            format!(" ({} records without blocks skipped)", p.skipped)
        } else {
            String::new()
        }
    );
    if let Some(m) = &ctx.model {
        let _ = writeln!(s, "  model         {m}");
    }
    if outcomes.iter().any(|o| o.policy == Policy::Store) {
        let _ = writeln!(
            s,
            "  store         the real master (server defaults) on a manual clock following the \
             trace; {} objects",
            calc::human(ctx.store_block_bytes as f64)
        );
    }
    let _ = writeln!(
        s,
        "  hit rate      input tokens in each request's longest cached prefix / input tokens; \
         last half = requests {}.. (the package's figure)",
        p.warmup
    );
    let _ = writeln!(
        s,
        "  ceiling       {:.4} (last half) with an unbounded cache",
        ctx.ceiling.rate_last_half()
    );
    let _ = writeln!(s);
    let sized = ctx.block_bytes.is_some();
    let _ = writeln!(
        s,
        "{:>10}  {}{:<8}  {:>8}  {:>9}  note",
        "capacity",
        if sized {
            format!("{:>11}  ", "size")
        } else {
            String::new()
        },
        "policy",
        "hit rate",
        "last half",
    );
    for o in outcomes {
        let mut note = String::new();
        if !o.tally.filled {
            note += "underfilled (not full before the last half) ";
        }
        if let Some(st) = &o.store {
            let _ = write!(
                note,
                "pool {:.0}% used (mean, last half), peak {} objects",
                st.mean_used_last_half * 100.0,
                st.peak_objects
            );
        }
        let size = match ctx.block_bytes {
            Some(b) => format!("{:>11}  ", calc::human(b * o.capacity as f64)),
            None => String::new(),
        };
        let _ = writeln!(
            s,
            "{:>10}  {size}{:<8}  {:>8.4}  {:>9.4}  {}",
            o.capacity,
            o.policy.name(),
            o.tally.rate(),
            o.tally.rate_last_half(),
            note.trim_end()
        );
    }
    let _ = writeln!(s);
    let _ = write!(s, "{} runs in {:.2} s", outcomes.len(), ctx.seconds);
    if let Some(path) = svg {
        let _ = write!(s, "; chart written to {path}");
    }
    s.push('\n');
    s
}

fn write_svg(
    path: &str,
    ctx: &Context,
    outcomes: &[Outcome],
    policies: &[Policy],
) -> Result<(), String> {
    let series: Vec<svg::Series> = policies
        .iter()
        .map(|&p| svg::Series {
            name: p.name().to_owned(),
            points: outcomes
                .iter()
                .filter(|o| o.policy == p)
                .map(|o| (o.capacity, o.tally.rate_last_half()))
                .collect(),
        })
        .collect();
    let title = format!(
        "Prefix hit rate (last half) vs capacity: {}",
        ctx.trace.trim_end_matches(" (built in)")
    );
    let text = svg::chart(
        &title,
        "hit rate, last half of requests",
        &series,
        Some(ctx.ceiling.rate_last_half()),
    );
    std::fs::write(path, text).map_err(|e| format!("--svg {path}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_capacities_parse() {
        assert_eq!(parse_capacity("8192", None).unwrap(), 8192);
        assert_eq!(parse_capacity("512M", Some(65536.0)).unwrap(), 8192);
        // Sizes convert as the package does: floor(bytes / bytes per block).
        assert_eq!(
            parse_capacity("1G", Some(3.0 * 1024.0 * 1024.0)).unwrap(),
            341
        );
        assert!(parse_capacity("1G", None)
            .unwrap_err()
            .contains("--block-bytes"));
        assert!(parse_capacity("0", None).is_err());
        assert!(parse_capacity("1K", Some(1e6)).is_err());
    }

    #[test]
    fn default_capacities_reach_the_whole_trace() {
        assert_eq!(default_capacities(100), [1024]);
        assert_eq!(default_capacities(5000), [1024, 2048, 4096, 8192]);
    }
}
