//! `mooncake bench first-touch`: the first same-host access to a fresh, large segment
//! (a `mooncake target` child, as a node's segment is: engine-allocated memory nobody
//! touched yet). Prints how long opening it and reading 4 KiB took, the same read again
//! (the same-run baseline), and how much shared memory the machine gained meanwhile.

use std::time::{Duration, Instant};

use crate::common::ChildProc;
use mooncake_base::json::Value;
use mooncake_cli::args::Args;
use mooncake_engine::{Engine, Op, Request};

/// A `kB` field of a `/proc` status-like file (`Shmem:` of meminfo, `RssShmem:` ...).
fn kib_field(path: &str, key: &str) -> Result<u64, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?;
    text.lines()
        .find_map(|l| {
            l.strip_prefix(key)?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .ok_or_else(|| format!("{path} has no {key} line"))
}

/// Machine-wide shared memory and this process's resident shared pages, in KiB.
fn shared_kib() -> Result<(u64, u64), String> {
    Ok((
        kib_field("/proc/meminfo", "Shmem:")?,
        kib_field("/proc/self/status", "RssShmem:")?,
    ))
}

/// One synchronous read of `buf.len()` bytes at `remote`; how long it took.
fn read(engine: &Engine, seg: u64, remote: u64, buf: &mut [u8]) -> Result<Duration, String> {
    let req = Request {
        op: Op::Read,
        local: buf.as_mut_ptr() as u64,
        segment: seg,
        remote,
        len: buf.len() as u64,
    };
    let t = Instant::now();
    // SAFETY: `buf` outlives the call, which returns only once the task is final.
    unsafe { engine.transfer_sync(&[req]) }.map_err(|e| e.to_string())?;
    Ok(t.elapsed())
}

pub fn run(raw: &[String]) -> Result<(), String> {
    let a = Args::parse(raw)?;
    let size: u64 = a.get("size", 2u64 << 30)?;
    let mut cfg = mooncake_cli::engine_config(&a)?;
    if a.str("protocol").is_none() {
        cfg.set("protocol", "shm").map_err(|e| e.to_string())?;
    }
    a.finish()?;
    let child = ChildProc::target(size, &[])?;
    let name = child.name();
    let engine = Engine::new(cfg).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 4096];
    let before = shared_kib()?;
    let t = Instant::now();
    let seg = engine.open_segment(name).map_err(|e| e.to_string())?;
    let desc = engine.segment_descriptor(seg).map_err(|e| e.to_string())?;
    let remote = desc
        .buffers
        .iter()
        .find(|b| b.length >= size)
        .ok_or_else(|| format!("segment {name} has no buffer of {size} bytes"))?
        .addr;
    read(&engine, seg, remote, &mut buf)?;
    let first = t.elapsed();
    let after = shared_kib()?;
    let again = read(&engine, seg, remote, &mut buf)?;
    let stats = engine.stats();
    let line = Value::object([
        ("bench", Value::from("first_touch")),
        (
            "protocol",
            format!("{:?}", engine.config().protocol)
                .to_lowercase()
                .as_str()
                .into(),
        ),
        ("segment_bytes", size.into()),
        ("first_access_ms", (first.as_secs_f64() * 1e3).into()),
        ("baseline_same_read_us", (again.as_secs_f64() * 1e6).into()),
        (
            "machine_shmem_gain_kib",
            (after.0 as i64 - before.0 as i64).into(),
        ),
        (
            "own_rss_shmem_gain_kib",
            (after.1 as i64 - before.1 as i64).into(),
        ),
        ("shm_bytes", stats.shm_bytes.into()),
        ("tcp_bytes", stats.tcp_bytes.into()),
    ]);
    println!("{line}");
    Ok(())
}
