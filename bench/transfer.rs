//! `mooncake bench transfer`: throughput and latency of the transfer engine against a
//! target in another process, next to a baseline measured in the same run (a plain
//! loopback TCP stream for tcp, memcpy for shm/auto). Prints one JSON object per line.
//!
//! `--api sync` times `Engine::transfer_sync` (what `mc_transfer_sync` and Python's
//! `transfer_sync_*` call) instead of a batch's submit and wait; `--floor true` adds the
//! loopback ping-pong of `bench floor` (32-byte request, one block of answer; both ends
//! busy-polling, then both blocking) measured in the same run, and our latency's
//! ratios to them.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::common::ChildProc;
use mooncake_base::json::Value;
use mooncake_base::util::percentile;
use mooncake_cli::args::Args;
use mooncake_engine::{Engine, Op, Request};

struct Params {
    protocol: String,
    op: Op,
    /// Time `transfer_sync` rather than submit + wait.
    sync: bool,
    block: u64,
    batch: usize,
    threads: usize,
    duration: Duration,
}

/// Fills `buf` with a pattern unique to `seed` and each position.
fn fill(buf: &mut [u8], seed: u64) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let v = (i as u64 ^ seed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// Runs one batch and waits for it; errors name the failing step.
fn transfer(engine: &Engine, batch: u64, reqs: &[Request]) -> Result<(), String> {
    // SAFETY: every request's local buffer outlives this call, which waits for completion.
    unsafe { engine.submit(batch, reqs) }.map_err(|e| format!("submit: {e}"))?;
    engine
        .wait_batch(batch, Some(Duration::from_secs(60)))
        .map_err(|e| format!("transfer: {e}"))
}

/// What one bench thread measured.
struct ThreadResult {
    bytes: u64,
    latencies_us: Vec<f64>,
    verified: bool,
}

/// Requests covering `span` bytes of `local` as `batch` blocks at `remote`.
fn block_requests(op: Op, local: &mut [u8], seg: u64, remote: u64, p: &Params) -> Vec<Request> {
    (0..p.batch as u64)
        .map(|i| Request {
            op,
            local: local.as_mut_ptr() as u64 + i * p.block,
            segment: seg,
            remote: remote + i * p.block,
            len: p.block,
        })
        .collect()
}

/// Runs a fresh batch of `reqs` to completion.
fn one_batch(engine: &Engine, reqs: &[Request]) -> Result<(), String> {
    let batch = engine
        .allocate_batch(reqs.len())
        .map_err(|e| e.to_string())?;
    transfer(engine, batch, reqs)?;
    engine.free_batch(batch).map_err(|e| e.to_string())
}

/// One bench thread: seed its remote region, loop timed batches until `stop`, verify.
/// A local buffer registered with the engine while it lives (RDMA needs registered
/// local memory; the other transports do not mind).
struct Registered<'a>(Vec<u8>, &'a Engine);

impl<'a> Registered<'a> {
    fn new(engine: &'a Engine, mut buf: Vec<u8>) -> Result<Registered<'a>, String> {
        // SAFETY: the Vec is owned by the guard and unregistered before it is freed.
        unsafe { engine.register_memory(buf.as_mut_ptr(), buf.len(), "cpu:0") }
            .map_err(|e| e.to_string())?;
        Ok(Registered(buf, engine))
    }
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let _ = self.1.unregister_memory(self.0.as_mut_ptr());
    }
}

fn bench_thread(
    engine: &Engine,
    seg: u64,
    remote: u64,
    seed: u64,
    p: &Params,
    stop: &AtomicBool,
) -> Result<ThreadResult, String> {
    let span = (p.block * p.batch as u64) as usize;
    let mut expected = vec![0u8; span];
    fill(&mut expected, seed);
    // Seed the remote region so reads have known content to verify.
    let mut seeded = Registered::new(engine, expected.clone())?;
    one_batch(
        engine,
        &block_requests(Op::Write, &mut seeded.0, seg, remote, p),
    )?;
    drop(seeded);
    let mut local = Registered::new(
        engine,
        if p.op == Op::Write {
            expected.clone()
        } else {
            vec![0u8; span]
        },
    )?;
    let local = &mut local.0;
    let timed = block_requests(p.op, local, seg, remote, p);
    let mut latencies_us = Vec::new();
    let mut bytes = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let t0 = Instant::now();
        if p.sync {
            // SAFETY: `local` outlives the call, which returns once every task is final.
            unsafe { engine.transfer_sync(&timed) }.map_err(|e| format!("transfer: {e}"))?;
        } else {
            one_batch(engine, &timed)?;
        }
        latencies_us.push(t0.elapsed().as_secs_f64() * 1e6);
        bytes += span as u64;
    }
    // Reads must have returned the seeded bytes; writes must read back as written.
    let verified = if p.op == Op::Read {
        *local == expected
    } else {
        let mut back = Registered::new(engine, vec![0u8; span])?;
        one_batch(
            engine,
            &block_requests(Op::Read, &mut back.0, seg, remote, p),
        )?;
        back.0 == expected
    };
    Ok(ThreadResult {
        bytes,
        latencies_us,
        verified,
    })
}

fn measure(
    engine: &Engine,
    seg: u64,
    remote_base: u64,
    p: &Params,
) -> Result<(u64, f64, Vec<f64>, bool), String> {
    let span = p.block * p.batch as u64;
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let results: Vec<Result<ThreadResult, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..p.threads)
            .map(|t| {
                let stop = &stop;
                let remote = remote_base + t as u64 * span;
                s.spawn(move || bench_thread(engine, seg, remote, 0x5EED + t as u64, p, stop))
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
    let (mut bytes, mut lat, mut verified) = (0, Vec::new(), true);
    for r in results {
        let r = r?;
        bytes += r.bytes;
        lat.extend(r.latencies_us);
        verified &= r.verified;
    }
    lat.sort_by(f64::total_cmp);
    Ok((bytes, seconds, lat, verified))
}

/// A plain TCP stream over loopback: one writer thread, one reader, `block`-sized writes.
fn tcp_baseline(block: u64, duration: Duration) -> Result<f64, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let reader = std::thread::spawn(move || -> u64 {
        let Ok((mut s, _)) = listener.accept() else {
            return 0;
        };
        let mut buf = vec![0u8; 4 << 20];
        let mut total = 0u64;
        while let Ok(n) = s.read(&mut buf) {
            if n == 0 {
                break;
            }
            total += n as u64;
        }
        total
    });
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    let _ = s.set_nodelay(true);
    let buf = vec![7u8; block as usize];
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < duration {
        s.write_all(&buf).map_err(|e| e.to_string())?;
        sent += block;
    }
    drop(s);
    let received = reader.join().map_err(|_| "baseline reader panicked")?;
    let secs = start.elapsed().as_secs_f64();
    Ok(received.min(sent) as f64 / secs / 1e9)
}

/// The loopback ping-pong floors for a `block`-byte answer, measured now (busy-poll,
/// the floor, and blocking, which holds up better on a crowded machine where
/// a spinning end loses its core), and our latencies' ratios to each.
fn floor_fields(
    lat: &[f64],
    block: u64,
    duration: Duration,
) -> Result<Vec<(&'static str, Value)>, String> {
    let answer = usize::try_from(block).map_err(|_| "block too large for the floor")?;
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    let mut fields = Vec::new();
    let names = [
        (
            true,
            [
                "floor_p50_us",
                "floor_p99_us",
                "p50_to_floor",
                "p99_to_floor",
            ],
        ),
        (
            false,
            [
                "blocking_floor_p50_us",
                "blocking_floor_p99_us",
                "p50_to_blocking_floor",
                "p99_to_blocking_floor",
            ],
        ),
    ];
    for (spin, [p50_name, p99_name, p50_ratio, p99_ratio]) in names {
        let mut floor = crate::floor::ping_pong(spin, 32, answer, duration)
            .map_err(|e| format!("floor ping-pong: {e}"))?;
        floor.sort_by(f64::total_cmp);
        let (p50, p99) = (percentile(&floor, 0.5), percentile(&floor, 0.99));
        fields.push((p50_name, round(p50).into()));
        fields.push((p99_name, round(p99).into()));
        fields.push((
            p50_ratio,
            round(percentile(lat, 0.5) / p50.max(1e-9)).into(),
        ));
        fields.push((
            p99_ratio,
            round(percentile(lat, 0.99) / p99.max(1e-9)).into(),
        ));
    }
    Ok(fields)
}

/// memcpy between two buffers of the bench's working-set size.
fn memcpy_baseline(block: u64, batch: usize, duration: Duration) -> f64 {
    let span = (block as usize) * batch;
    let src = vec![3u8; span];
    let mut dst = vec![0u8; span];
    let start = Instant::now();
    let mut bytes = 0u64;
    while start.elapsed() < duration {
        for (d, s) in dst
            .chunks_mut(block as usize)
            .zip(src.chunks(block as usize))
        {
            d.copy_from_slice(s);
        }
        std::hint::black_box(&mut dst);
        bytes += span as u64;
    }
    bytes as f64 / start.elapsed().as_secs_f64() / 1e9
}

pub fn run(raw: &[String]) -> Result<(), String> {
    let a = Args::parse(raw)?;
    let op = match a.str("op").unwrap_or("read") {
        "read" => Op::Read,
        "write" => Op::Write,
        other => return Err(format!("--op: {other:?} is not read or write")),
    };
    let sync = match a.str("api").unwrap_or("batch") {
        "batch" => false,
        "sync" => true,
        other => return Err(format!("--api: {other:?} is not batch or sync")),
    };
    let with_floor = a.flag("floor")?;
    let p = Params {
        protocol: a.str("protocol").unwrap_or("tcp").to_owned(),
        op,
        sync,
        block: a.get("block-size", 1u64 << 20)?,
        batch: a.get("batch-size", 1usize)?,
        threads: a.get("threads", 1usize)?,
        duration: Duration::from_secs_f64(a.get("duration", 3.0f64)?),
    };
    let segment = a.str("segment").map(str::to_owned);
    let metadata = a.str("metadata").unwrap_or("P2PHANDSHAKE").to_owned();
    let fabric = matches!(p.protocol.as_str(), "fabric" | "efa");
    let rdma = p.protocol == "rdma";
    let provider = a.str("fabric-provider").map(str::to_owned);
    let mut cfg = mooncake_cli::engine_config(&a)?;
    a.finish()?;
    if fabric {
        // Before any thread or child exists: the child target inherits these.
        fabric_bench::pin_to_loopback(provider.as_deref());
        if let Some(prov) = &provider {
            cfg.set("fabric_provider", prov)
                .map_err(|e| e.to_string())?;
        }
    }
    if p.block == 0 || p.batch == 0 || p.threads == 0 {
        return Err("--block-size, --batch-size and --threads must be positive".into());
    }
    cfg.set("protocol", &p.protocol)
        .map_err(|e| e.to_string())?;
    // A figure labelled with a protocol must be that protocol's: no quiet TCP fallback.
    cfg.strict_protocol = true;
    cfg.set("metadata", &metadata).map_err(|e| e.to_string())?;
    let need = p.block * p.batch as u64 * p.threads as u64;
    let (_child, name) = match segment {
        Some(name) => (None, name),
        None => {
            // Hardware protocols: the target serves over the same backend (the
            // child inherits MC_FABRIC_PROVIDER, MC_IBVERBS_LIB, ...).
            let extra = match fabric || rdma {
                true => vec!["--protocol".to_owned(), p.protocol.clone()],
                false => Vec::new(),
            };
            let child = ChildProc::target(need, &extra)?;
            // `ready <segment> addr=0x... size=N`
            let name = child.name().to_owned();
            (Some(child), name)
        }
    };
    let engine = Engine::new(cfg).map_err(|e| e.to_string())?;
    let seg = engine.open_segment(&name).map_err(|e| e.to_string())?;
    let desc = engine.segment_descriptor(seg).map_err(|e| e.to_string())?;
    let buffer = desc
        .buffers
        .iter()
        .find(|b| b.length >= need)
        .ok_or_else(|| format!("segment {name} has no buffer of {need} bytes"))?;
    let before = engine.stats();
    let (bytes, seconds, lat, verified) = measure(&engine, seg, buffer.addr, &p)?;
    let after = engine.stats();
    let mut extra = Vec::new();
    // What each operation cost in hand-offs and sends, setup and verification included.
    let ops_run = (lat.len() as f64).max(1.0);
    let per_op = |a: u64, b: u64| Value::from(((a - b) as f64 / ops_run * 1000.0).round() / 1000.0);
    extra.push(("api", Value::from(if p.sync { "sync" } else { "batch" })));
    extra.push((
        "worker_handoffs_per_op",
        per_op(after.worker_handoffs, before.worker_handoffs),
    ));
    extra.push((
        "tcp_sends_per_op",
        per_op(after.tcp_sends, before.tcp_sends),
    ));
    if with_floor {
        extra.extend(floor_fields(&lat, p.block, p.duration)?);
    }
    let (baseline, baseline_gbps) = if fabric {
        // The provider's own figure: fi_pingpong, same provider and message size.
        let prov = provider.unwrap_or_else(|| fabric_bench::provider_of(&engine));
        extra.push(("fabric_provider", Value::from(prov.as_str())));
        match fabric_bench::pingpong(&prov, p.block, p.duration) {
            Ok((gbps, usec)) => {
                // Its one-way time per message, next to our per-operation latency.
                extra.push(("baseline_usec_per_xfer", Value::from(usec)));
                ("fi_pingpong", Some(gbps))
            }
            Err(why) => {
                extra.push(("note", Value::from(why.as_str())));
                ("", None)
            }
        }
    } else if rdma {
        // No same-run baseline exists for verbs here (no perftest); say where the
        // figure came from instead.
        let library = mooncake_sys::ibverbs::verbs()
            .map(|v| v.library.clone())
            .unwrap_or_default();
        extra.push(("verbs_library", Value::from(library.as_str())));
        if std::env::var_os(mooncake_sys::ibverbs::OVERRIDE_VAR).is_some() {
            extra.push((
                "note",
                Value::from("libibverbs overridden (MC_IBVERBS_LIB): an emulated provider's figures are not performance claims"),
            ));
        }
        ("", None)
    } else if p.protocol == "tcp" {
        (
            "tcp_socket_loopback",
            Some(tcp_baseline(p.block.max(64 << 10), p.duration)?),
        )
    } else {
        (
            "memcpy",
            Some(memcpy_baseline(p.block, p.batch, p.duration)),
        )
    };
    let gbps = bytes as f64 / seconds / 1e9;
    let ops = (bytes / p.block) as f64 / seconds;
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    let opt = |x: Option<f64>| x.map_or(Value::Null, |v| round(v).into());
    let mut fields = vec![
        ("bench", Value::from("transfer")),
        ("protocol", p.protocol.as_str().into()),
        ("op", if p.op == Op::Read { "read" } else { "write" }.into()),
        ("block_size", p.block.into()),
        ("batch_size", p.batch.into()),
        ("threads", p.threads.into()),
        ("bytes", bytes.into()),
        ("seconds", round(seconds).into()),
        ("gbps", round(gbps).into()),
        ("ops_per_s", ops.round().into()),
        ("lat_p50_us", round(percentile(&lat, 0.5)).into()),
        ("lat_p99_us", round(percentile(&lat, 0.99)).into()),
        ("median_us", round(percentile(&lat, 0.5)).into()),
        (
            "baseline",
            if baseline.is_empty() {
                Value::Null
            } else {
                baseline.into()
            },
        ),
        ("baseline_gbps", opt(baseline_gbps)),
        ("ratio_to_baseline", opt(baseline_gbps.map(|b| gbps / b))),
        ("verified", verified.into()),
    ];
    fields.extend(extra);
    let line = Value::object(fields);
    println!("{line}");
    if !verified {
        return Err("moved bytes did not verify".into());
    }
    Ok(())
}

/// The `--protocol fabric`/`efa` pieces: loopback pinning and the `fi_pingpong` baseline.
mod fabric_bench {
    use std::io::Read;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use mooncake_engine::Engine;

    const LOOPBACK_VARS: [&str; 2] = ["FI_TCP_IFACE", "FI_SOCKETS_IFACE"];

    /// Keeps libfabric's tcp/sockets providers on loopback (they pick eth0 otherwise)
    /// unless the user chose an interface, and hands the provider to the child target.
    pub fn pin_to_loopback(provider: Option<&str>) {
        for var in LOOPBACK_VARS {
            if std::env::var_os(var).is_none() {
                // Called before any thread or child is started.
                std::env::set_var(var, "lo");
            }
        }
        if let Some(p) = provider {
            std::env::set_var("MC_FABRIC_PROVIDER", p);
        }
    }

    /// The provider our engine opened (`provider/domain` in its descriptor).
    pub fn provider_of(engine: &Engine) -> String {
        engine
            .descriptor()
            .devices
            .iter()
            .find_map(|d| d.name.split_once('/').map(|(p, _)| p.to_owned()))
            .unwrap_or_default()
    }

    /// A process killed and reaped on drop.
    struct Reaped(Child);

    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn free_port() -> Result<u16, String> {
        let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        l.local_addr().map(|a| a.port()).map_err(|e| e.to_string())
    }

    fn command(provider: &str, iters: u64, size: u64) -> Command {
        let mut c = Command::new("fi_pingpong");
        c.args(["-p", provider, "-e", "rdm"])
            .args(["-I", &iters.to_string(), "-S", &size.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    /// Waits up to `limit` for a child's exit; its stdout and stderr.
    fn finish(mut child: Reaped, limit: Duration) -> Result<String, String> {
        let deadline = Instant::now() + limit;
        loop {
            match child.0.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Ok(None) => return Err(format!("fi_pingpong ran past {limit:?}")),
                Err(e) => return Err(e.to_string()),
            }
        }
        let mut text = String::new();
        if let Some(mut o) = child.0.stdout.take() {
            let _ = o.read_to_string(&mut text);
        }
        if let Some(mut e) = child.0.stderr.take() {
            let _ = e.read_to_string(&mut text);
        }
        Ok(text)
    }

    /// `(MB/sec, usec/xfer)` from fi_pingpong's result line.
    fn parse(text: &str) -> Option<(f64, f64)> {
        text.lines().rev().find_map(|l| {
            let t: Vec<&str> = l.split_whitespace().collect();
            match t.as_slice() {
                [_, _, ack, _, time, mbs, usec, _]
                    if ack.starts_with('=') && time.ends_with('s') =>
                {
                    Some((mbs.parse().ok()?, usec.parse().ok()?))
                }
                _ => None,
            }
        })
    }

    /// One server/client pair on 127.0.0.1.
    fn once(provider: &str, iters: u64, size: u64, limit: Duration) -> Result<(f64, f64), String> {
        let port = free_port()?.to_string();
        let server = command(provider, iters, size)
            .args(["-B", &port])
            .spawn()
            .map(Reaped)
            .map_err(|e| format!("fi_pingpong not runnable ({e}); install libfabric-bin"))?;
        // The server needs a moment to listen on its control port.
        let mut last = String::new();
        for _ in 0..20 {
            std::thread::sleep(Duration::from_millis(100));
            let client = command(provider, iters, size)
                .args(["-P", &port, "127.0.0.1"])
                .spawn()
                .map(Reaped)
                .map_err(|e| e.to_string())?;
            let text = finish(client, limit)?;
            if let Some(r) = parse(&text) {
                drop(server);
                return Ok(r);
            }
            last = text;
        }
        drop(server);
        Err(format!("fi_pingpong gave no figure: {}", last.trim()))
    }

    /// fi_pingpong's bandwidth for `size`-byte messages in GB/s, and its time per
    /// message in µs. Its MB/sec counts the bytes of pings and pongs over the run, and
    /// its usec/xfer is run time over messages in both directions, i.e. one way. A
    /// short probe sizes the real run to about `duration`.
    pub fn pingpong(provider: &str, size: u64, duration: Duration) -> Result<(f64, f64), String> {
        if provider.is_empty() {
            return Err("no fabric provider to compare with".into());
        }
        let size = size.max(1);
        let (_, usec) = once(provider, 10, size, Duration::from_secs(30))?;
        let iters = (duration.as_secs_f64() * 1e6 / usec.max(0.1)).clamp(10.0, 200_000.0) as u64;
        let limit = duration * 4 + Duration::from_secs(20);
        let (mbs, usec) = once(provider, iters, size, limit)?;
        Ok((mbs / 1000.0, usec))
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn parses_the_result_line() {
            let out = "bytes   #sent   #ack     total       time     MB/sec    usec/xfer   Mxfers/sec\n\
                       64k     1k      =1k      125m        0.05s   2893.10      22.65       0.04\n";
            assert_eq!(super::parse(out), Some((2893.10, 22.65)));
            assert_eq!(super::parse("nothing"), None);
        }
    }
}
