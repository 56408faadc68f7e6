//! `mooncake bench auth`: what the cluster secret costs. Two targets in child processes,
//! one started with a secret and one without, read over TCP by two engines of this
//! process (with and without it), taking turns: 4 KiB latency and 16 MiB bandwidth,
//! and the time of a probe RPC on a fresh connection (where the handshake is paid).
//! The secret-off figures are the same-run baseline. One JSON object per line.

use std::time::{Duration, Instant};

use crate::common::ChildProc;
use mooncake_base::json::Value;
use mooncake_base::util::percentile;
use mooncake_cli::args::Args;
use mooncake_engine::wire::rpc::{self, RpcType};
use mooncake_engine::{Engine, EngineConfig, Op, Request};

const SECRET: &str = "bench secret: any bytes the cluster shares";
const BLOCKS: [u64; 2] = [4 << 10, 16 << 20];
/// Each side's time per block size is cut into this many slices, the sides taking
/// turns, so a machine's drift (other processes, frequency) falls on both alike.
const ROUNDS: u32 = 8;
const PROBES: usize = 200;

/// One side of the comparison: a target and the engine that reads it.
struct Side {
    _target: ChildProc,
    engine: Engine,
    seg: u64,
    remote: u64,
    rpc_addr: String,
    secret: Option<mooncake_base::auth::ClusterSecret>,
}

impl Side {
    fn start(secret_file: Option<&str>) -> Result<Side, String> {
        let extra = match secret_file {
            Some(f) => vec!["--cluster-secret-file".to_owned(), f.to_owned()],
            None => Vec::new(),
        };
        let target = ChildProc::target(16 << 20, &extra)?;
        let name = target.name().to_owned();
        let mut cfg = EngineConfig::default();
        let set =
            |cfg: &mut EngineConfig, k: &str, v: &str| cfg.set(k, v).map_err(|e| e.to_string());
        set(&mut cfg, "protocol", "tcp")?;
        set(
            &mut cfg,
            "cluster_secret",
            if secret_file.is_some() { SECRET } else { "" },
        )?;
        let secret = cfg.cluster_secret.clone();
        let engine = Engine::new(cfg).map_err(|e| e.to_string())?;
        let seg = engine.open_segment(&name).map_err(|e| e.to_string())?;
        let desc = engine.segment_descriptor(seg).map_err(|e| e.to_string())?;
        let remote = desc.buffers.first().ok_or("target has no buffer")?.addr;
        Ok(Side {
            _target: target,
            engine,
            seg,
            remote,
            rpc_addr: name,
            secret,
        })
    }

    /// `buf`, whole, against the start of the target's buffer.
    fn request(&self, op: Op, buf: &mut [u8]) -> Request {
        Request {
            op,
            local: buf.as_mut_ptr() as u64,
            segment: self.seg,
            remote: self.remote,
            len: buf.len() as u64,
        }
    }

    fn seed(&self, data: &mut [u8]) -> Result<(), String> {
        let r = self.request(Op::Write, data);
        // SAFETY: `data` outlives the synchronous call.
        unsafe { self.engine.transfer_sync(&[r]) }.map_err(|e| e.to_string())
    }

    /// Reads `block` bytes in a loop for `duration`: bytes moved, seconds, latencies.
    fn read_for(&self, buf: &mut [u8], duration: Duration) -> Result<(u64, f64, Vec<f64>), String> {
        let r = self.request(Op::Read, buf);
        let (start, mut lat, mut bytes) = (Instant::now(), Vec::new(), 0);
        while start.elapsed() < duration {
            let t0 = Instant::now();
            // SAFETY: `buf` outlives the synchronous call.
            unsafe { self.engine.transfer_sync(&[r]) }.map_err(|e| e.to_string())?;
            lat.push(t0.elapsed().as_secs_f64() * 1e6);
            bytes += buf.len() as u64;
        }
        Ok((bytes, start.elapsed().as_secs_f64(), lat))
    }

    /// Probe RPCs, each on a fresh connection: handshake included. Latencies in µs.
    fn probes(&self) -> Result<Vec<f64>, String> {
        (0..PROBES)
            .map(|_| {
                let t0 = Instant::now();
                rpc::call(
                    &self.rpc_addr,
                    RpcType::Probe,
                    "{}",
                    Duration::from_secs(5),
                    self.secret.as_ref(),
                )
                .map_err(|e| e.to_string())?;
                Ok(t0.elapsed().as_secs_f64() * 1e6)
            })
            .collect()
    }
}

#[derive(Default)]
struct Figures {
    bytes: u64,
    seconds: f64,
    lat: Vec<f64>,
}

fn line(
    block: u64,
    secret: bool,
    verified: bool,
    f: &mut Figures,
    baseline: Option<(f64, f64)>,
) -> (f64, f64) {
    f.lat.sort_by(f64::total_cmp);
    let gbps = f.bytes as f64 / f.seconds / 1e9;
    let p50 = percentile(&f.lat, 0.5);
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    let mut fields = vec![
        ("bench", Value::from("auth")),
        ("protocol", "tcp".into()),
        ("op", "read".into()),
        ("block_size", block.into()),
        ("secret", secret.into()),
        ("gbps", round(gbps).into()),
        (
            "ops_per_s",
            ((f.bytes / block) as f64 / f.seconds).round().into(),
        ),
        ("lat_p50_us", round(p50).into()),
        ("lat_p99_us", round(percentile(&f.lat, 0.99)).into()),
        ("verified", verified.into()),
    ];
    if let Some((base_gbps, base_p50)) = baseline {
        fields.push(("baseline", "secret_off".into()));
        fields.push(("baseline_gbps", round(base_gbps).into()));
        fields.push(("ratio_to_baseline", round(gbps / base_gbps).into()));
        fields.push(("p50_ratio_to_baseline", round(p50 / base_p50).into()));
    }
    println!("{}", Value::object(fields));
    (gbps, p50)
}

pub fn run(raw: &[String]) -> Result<(), String> {
    let a = Args::parse(raw)?;
    let duration = Duration::from_secs_f64(a.get("duration", 4.0f64)?) / ROUNDS;
    // Both sides without the secret: how far apart two identical sides land on this
    // machine (the noise floor of the comparison).
    let control = a.flag("control")?;
    a.finish()?;
    // The secret-off side must really be off, whatever this shell exports.
    std::env::remove_var(mooncake_base::auth::SECRET_ENV);
    let file = std::env::temp_dir().join(format!("mc-bench-auth-{}", std::process::id()));
    std::fs::write(&file, SECRET).map_err(|e| format!("writing {}: {e}", file.display()))?;
    let sides = (|| {
        Ok::<_, String>([
            Side::start(None)?,
            Side::start(file.to_str().filter(|_| !control))?,
        ])
    })();
    let _ = std::fs::remove_file(&file);
    let sides = sides?;
    for block in BLOCKS {
        let mut figures = [Figures::default(), Figures::default()];
        let mut bufs: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; block as usize]).collect();
        let mut expected: Vec<u8> = (0..block).map(|i| (i * 31 + block) as u8).collect();
        for side in &sides {
            side.seed(&mut expected)?;
        }
        for round in 0..ROUNDS {
            // Odd rounds go secret-on first, so neither side always follows the other.
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for i in order {
                let side = &sides[i];
                let (bytes, seconds, lat) = side.read_for(&mut bufs[i], duration)?;
                figures[i].bytes += bytes;
                figures[i].seconds += seconds;
                figures[i].lat.extend(lat);
            }
        }
        let verified: Vec<bool> = bufs.iter().map(|b| *b == expected).collect();
        let [off, on] = &mut figures;
        let base = line(block, false, verified[0], off, None);
        line(block, true, verified[1], on, Some(base));
        if verified.contains(&false) {
            return Err("read bytes did not verify".into());
        }
    }
    let mut probes: Vec<Vec<f64>> = sides.iter().map(Side::probes).collect::<Result<_, _>>()?;
    let round = |x: f64| (x * 10.0).round() / 10.0;
    for p in &mut probes {
        p.sort_by(f64::total_cmp);
    }
    let (off, on) = (percentile(&probes[0], 0.5), percentile(&probes[1], 0.5));
    for (secret, p50, base) in [(false, off, None), (true, on, Some(off))] {
        let mut fields = vec![
            ("bench", Value::from("auth")),
            ("what", "probe_rpc_on_a_fresh_connection".into()),
            ("secret", secret.into()),
            ("count", PROBES.into()),
            ("p50_us", round(p50).into()),
        ];
        if let Some(b) = base {
            fields.push(("baseline", "secret_off".into()));
            fields.push(("baseline_p50_us", round(b).into()));
            fields.push(("handshake_cost_us", round(p50 - b).into()));
        }
        println!("{}", Value::object(fields));
    }
    Ok(())
}
