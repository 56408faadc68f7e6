//! `mooncake bench disk`: the store's disk tier (`crates/store/src/disk/`) against a plain
//! `pwrite`/`pread` loop of the same object sizes on the same file system, in the same
//! run. Prints one JSON object per line: put and read-back GB/s (median of the
//! repetitions, with each repetition's figure), the baseline's, and the ratio.
//!
//! Options: `--dir DIR` (default: a fresh folder under the temp dir, removed after),
//! `--total BYTES` written per repetition (1G), `--object BYTES` (4M), `--reps N` (3),
//! `--cached` (read back from the page cache).
//! Both sides write without fsync (the page cache and the file system's write path).
//! Before reading back, both write their files out and drop them from the page cache,
//! so the read-back comes from the device, as a disk tier's reads do; with `--cached`
//! both read what the page cache holds (then the checksum the tier verifies on every
//! read is what separates them).

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Instant;

use mooncake_base::json::Value;

use mooncake_base::util::percentile;
use mooncake_store::disk::{drop_page_cache, DiskConfig, DiskTier};

struct Params {
    dir: Option<PathBuf>,
    total: u64,
    object: u64,
    reps: usize,
    cached: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    match mooncake_base::util::size::parse(s)? {
        0 => Err(format!("{s:?}: a size must be positive")),
        n => Ok(n),
    }
}

fn parse_args(args: &[String]) -> Result<Params, String> {
    let mut p = Params {
        dir: None,
        total: 1 << 30,
        object: 4 << 20,
        reps: 3,
        cached: false,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        if flag == "--cached" {
            p.cached = true;
            continue;
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--dir" => p.dir = Some(PathBuf::from(value)),
            "--total" => p.total = parse_size(value)?,
            "--object" => p.object = parse_size(value)?,
            "--reps" => p.reps = parse_size(value)?.min(100) as usize,
            other => return Err(format!("unknown option {other}")),
        }
    }
    if p.object > p.total {
        return Err("--object must not exceed --total".into());
    }
    Ok(p)
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    (bytes as f64 / secs.max(1e-9) / 1e9 * 1000.0).round() / 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}

/// (put GB/s, read GB/s) of the plain loop: one file, objects back to back.
fn baseline(
    dir: &std::path::Path,
    p: &Params,
    data: &[u8],
    buf: &mut [u8],
) -> Result<(f64, f64), String> {
    let path = dir.join("baseline.bin");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let n = p.total / p.object;
    let t = Instant::now();
    for i in 0..n {
        f.write_all_at(data, i * p.object)
            .map_err(|e| format!("pwrite: {e}"))?;
    }
    let put = gbps(n * p.object, t.elapsed().as_secs_f64());
    if !p.cached {
        f.sync_data().map_err(|e| format!("fdatasync: {e}"))?;
        drop_page_cache(&f).map_err(|e| format!("posix_fadvise: {e}"))?;
    }
    let t = Instant::now();
    for i in 0..n {
        f.read_exact_at(buf, i * p.object)
            .map_err(|e| format!("pread: {e}"))?;
    }
    let read = gbps(n * p.object, t.elapsed().as_secs_f64());
    drop(f);
    let _ = std::fs::remove_file(&path);
    Ok((put, read))
}

/// (put GB/s, read GB/s) of the disk tier, checking every value read.
fn tier(
    dir: &std::path::Path,
    p: &Params,
    data: &[u8],
    buf: &mut [u8],
) -> Result<(f64, f64), String> {
    let tier_dir = dir.join("tier");
    let _ = std::fs::remove_dir_all(&tier_dir);
    // Room for every object: this measures the write path, not eviction.
    let quota = p.total + p.total / 8 + (64 << 20);
    let (tier, _) = DiskTier::open(DiskConfig::new(&tier_dir, quota)).map_err(|e| e.to_string())?;
    let n = p.total / p.object;
    let t = Instant::now();
    for i in 0..n {
        tier.put(&format!("bench/{i}"), &[data])
            .map_err(|e| e.to_string())?;
    }
    let put = gbps(n * p.object, t.elapsed().as_secs_f64());
    if !p.cached {
        tier.release_page_cache().map_err(|e| e.to_string())?;
    }
    let t = Instant::now();
    for i in 0..n {
        let got = tier
            .read_into(&format!("bench/{i}"), buf)
            .map_err(|e| e.to_string())?;
        if got != p.object {
            return Err(format!("object {i}: read {got} bytes"));
        }
    }
    let read = gbps(n * p.object, t.elapsed().as_secs_f64());
    drop(tier);
    let _ = std::fs::remove_dir_all(&tier_dir);
    Ok((put, read))
}

/// Entry point of `mooncake bench disk`.
pub fn run(args: &[String]) -> Result<(), String> {
    let p = parse_args(args)?;
    let (dir, remove_after) = match &p.dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("mc-bench-disk-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let data: Vec<u8> = (0..p.object).map(|i| (i * 7 + 3) as u8).collect();
    let mut buf = vec![0u8; p.object as usize];
    let (mut bp, mut br, mut tp, mut tr) = (vec![], vec![], vec![], vec![]);
    let result = (|| {
        for _ in 0..p.reps.max(1) {
            // Alternate so neither side always runs on a warmer page cache.
            let (put, read) = baseline(&dir, &p, &data, &mut buf)?;
            bp.push(put);
            br.push(read);
            let (put, read) = tier(&dir, &p, &data, &mut buf)?;
            if buf != data {
                return Err("disk tier returned wrong bytes".to_owned());
            }
            tp.push(put);
            tr.push(read);
        }
        Ok(())
    })();
    if remove_after {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result?;
    for (figure, ours, base) in [("disk_tier_put", &tp, &bp), ("disk_tier_read", &tr, &br)] {
        let (o, b) = (median(ours.clone()), median(base.clone()));
        let line = Value::object([
            ("figure", Value::from(figure)),
            ("object_bytes", Value::from(p.object)),
            ("total_bytes", Value::from(p.total)),
            (
                "read_from",
                Value::from(if p.cached { "page cache" } else { "device" }),
            ),
            ("median_gbps", Value::from(o)),
            (
                "runs_gbps",
                Value::from(ours.iter().map(|x| Value::from(*x)).collect::<Vec<_>>()),
            ),
            (
                "baseline",
                Value::from("pwrite/pread loop, same file system"),
            ),
            ("baseline_median_gbps", Value::from(b)),
            (
                "ratio",
                Value::from((o / b.max(1e-9) * 1000.0).round() / 1000.0),
            ),
        ]);
        println!("{line}");
    }
    Ok(())
}
