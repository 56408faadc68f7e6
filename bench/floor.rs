//! `mooncake bench floor`: the latency floor a poll-mode engine is measured against —
//! a loopback TCP ping-pong (32-byte request, 4 KiB answer by default) where both ends
//! busy-poll non-blocking sockets, and the same exchange with ordinary blocking
//! sockets. Prints one JSON object per line with p50/p99 in microseconds.
//!
//! Options: `--request BYTES` (32), `--answer BYTES` (4K), `--duration S` (2).

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use mooncake_base::json::Value;
use mooncake_base::util::percentile;
use mooncake_cli::args::Args;

/// Reads exactly `buf.len()` bytes, spinning on `WouldBlock` (non-blocking sockets).
fn read_full(s: &mut TcpStream, buf: &mut [u8]) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_full(s: &mut TcpStream, buf: &[u8]) -> io::Result<()> {
    let mut sent = 0;
    while sent < buf.len() {
        match s.write(&buf[sent..]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Latencies (µs) of ping-pongs for `duration`, both ends polling when `spin`.
pub fn ping_pong(
    spin: bool,
    request: usize,
    answer: usize,
    duration: Duration,
) -> io::Result<Vec<f64>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        s.set_nonblocking(spin)?;
        let (mut req, ans) = (vec![0u8; request], vec![7u8; answer]);
        loop {
            match read_full(&mut s, &mut req) {
                Ok(()) => write_full(&mut s, &ans)?,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    c.set_nonblocking(spin)?;
    let (req, mut ans) = (vec![1u8; request], vec![0u8; answer]);
    let mut lat = Vec::new();
    let start = Instant::now();
    while start.elapsed() < duration && lat.len() < 10_000_000 {
        let t = Instant::now();
        write_full(&mut c, &req)?;
        read_full(&mut c, &mut ans)?;
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(c);
    server
        .join()
        .map_err(|_| io::Error::other("ping-pong server panicked"))??;
    Ok(lat)
}

/// Entry point of `mooncake bench floor`.
pub fn run(raw: &[String]) -> Result<(), String> {
    let a = Args::parse(raw)?;
    let request: u64 = a.get("request", 32)?;
    let answer: u64 = a.get("answer", 4096)?;
    let duration: f64 = a.get("duration", 2.0)?;
    a.finish()?;
    if request == 0 || answer == 0 || !(duration > 0.0 && duration <= 3600.0) {
        return Err("--request and --answer must be positive, --duration in (0, 3600]".into());
    }
    for (mode, spin) in [("busy_poll", true), ("blocking", false)] {
        let mut lat = ping_pong(
            spin,
            request as usize,
            answer as usize,
            Duration::from_secs_f64(duration),
        )
        .map_err(|e| format!("{mode} ping-pong: {e}"))?;
        lat.sort_by(f64::total_cmp);
        let round = |x: f64| (x * 100.0).round() / 100.0;
        let line = Value::object([
            ("figure", Value::from("floor_pingpong")),
            ("mode", Value::from(mode)),
            ("request_bytes", Value::from(request)),
            ("answer_bytes", Value::from(answer)),
            ("samples", Value::from(lat.len())),
            ("p50_us", Value::from(round(percentile(&lat, 0.5)))),
            ("p99_us", Value::from(round(percentile(&lat, 0.99)))),
        ]);
        println!("{line}");
    }
    Ok(())
}
