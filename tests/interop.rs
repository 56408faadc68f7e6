//! Interop with the real Mooncake Transfer Engine (its Python package,
//! `mooncake-transfer-engine-non-cuda` 0.3.x) on loopback: P2PHANDSHAKE metadata, TCP
//! transport, data moved in both directions.
//!
//! The Mooncake side is `tests/interop/mooncake_peer.py` (its docstring defines the byte
//! patterns used here). The interpreter is `$MC_INTEROP_PYTHON`, else `python3`; when
//! neither can `import mooncake.engine` the tests print `SKIP interop: ...` and pass, unless
//! `MC_INTEROP_REQUIRED=1`, which turns the skip into a failure. A child's stderr is printed
//! when a test fails, and always with `MC_INTEROP_LOGS=1`.
//!
//! Run: `MC_INTEROP_PYTHON=/path/to/venv/bin/python cargo test --test interop -- --nocapture`

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::engine_with;
use mooncake::engine::{SegmentId, TaskState};
use mooncake::{Engine, Op, Request};

/// Not a multiple of any slice size, and many slices long on both engines.
const SIZE: usize = (8 << 20) + 12345;
/// Time allowed for a peer to start and answer `ready`.
const START: Duration = Duration::from_secs(20);
/// Time allowed for any one step after that.
const STEP: Duration = Duration::from_secs(20);

const PEER_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/interop/mooncake_peer.py"
);

// The patterns of `mooncake_peer.py` (i counts from the start of the region concerned).
fn pattern1(len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 7 + 3) % 251) as u8).collect()
}
fn pattern2(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 13 + seed) % 256) as u8).collect()
}
fn pattern3(len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 11 + 5) % 241) as u8).collect()
}

/// Panics naming the first differing byte (printing megabytes of diff helps nobody).
fn assert_bytes(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: byte {i} is {}, expected {}", got[i], want[i]);
    }
}

/// A child process whose stdout is read line by line with timeouts and whose stderr is
/// kept for failure reports. Dropping it closes stdin, kills and reaps the child.
struct Peer {
    what: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Arc<Mutex<Vec<u8>>>,
    /// Disconnects when the stderr reader has seen the end of it.
    stderr_end: Receiver<()>,
}

impl Peer {
    fn spawn(what: &str, mut cmd: Command) -> std::io::Result<Peer> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        let mut err = child.stderr.take().expect("piped stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let sink = stderr.clone();
        let (end_tx, stderr_end) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            let _end = end_tx;
            let mut chunk = [0u8; 4096];
            while let Ok(n @ 1..) = err.read(&mut chunk) {
                sink.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(&chunk[..n]);
            }
        });
        Ok(Peer {
            what: what.to_owned(),
            child,
            stdin,
            lines,
            stderr,
            stderr_end,
        })
    }

    /// Everything the child wrote to stderr; call after it was reaped to get all of it.
    fn stderr_text(&self) -> String {
        let _ = self.stderr_end.recv_timeout(Duration::from_secs(2));
        String::from_utf8_lossy(&self.stderr.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }

    /// The next stdout line; `None` at end of output.
    fn try_line(&mut self, timeout: Duration) -> Option<String> {
        match self.lines.recv_timeout(timeout) {
            Ok(l) => Some(l),
            Err(RecvTimeoutError::Disconnected) => None,
            Err(RecvTimeoutError::Timeout) => panic!("{}: no output within {timeout:?}", self.what),
        }
    }

    fn line(&mut self, timeout: Duration) -> String {
        match self.try_line(timeout) {
            Some(l) => l,
            None => panic!("{}: output ended early", self.what),
        }
    }

    fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin still open");
        writeln!(stdin, "{line}")
            .and_then(|_| stdin.flush())
            .unwrap_or_else(|e| panic!("{}: writing stdin: {e}", self.what));
    }

    /// Closes stdin, reads the remaining output to its end, then reaps the child: the peers
    /// close stdout only by exiting, so the final `wait` does not block for long.
    fn finish(&mut self, timeout: Duration) -> (ExitStatus, Vec<String>) {
        drop(self.stdin.take());
        let deadline = Instant::now() + timeout;
        let mut rest = Vec::new();
        while let Some(l) = self.try_line(deadline.saturating_duration_since(Instant::now())) {
            rest.push(l);
        }
        let status = self
            .child
            .wait()
            .unwrap_or_else(|e| panic!("{}: wait: {e}", self.what));
        (status, rest)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() || std::env::var_os("MC_INTEROP_LOGS").is_some() {
            eprintln!(
                "---- stderr of {} ----\n{}---- end ----",
                self.what,
                self.stderr_text()
            );
        }
    }
}

/// The Mooncake peer script; it passes `127.0.0.1` as Mooncake's host name, which is
/// what Mooncake then advertises in its segment name and descriptor.
fn python_command(python: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(python);
    cmd.arg(PEER_SCRIPT).args(args).env("PYTHONUNBUFFERED", "1");
    cmd
}

/// An interpreter that can import `mooncake.engine`, or why there is none.
fn mooncake_python() -> Option<&'static str> {
    static FOUND: OnceLock<Result<String, String>> = OnceLock::new();
    let found = FOUND.get_or_init(|| {
        let mut reasons = Vec::new();
        let candidates = std::env::var("MC_INTEROP_PYTHON")
            .ok()
            .into_iter()
            .chain(["python3".to_owned()]);
        for py in candidates {
            let mut cmd = Command::new(&py);
            cmd.args(["-c", "import mooncake.engine; print('importable')"]);
            let mut peer = match Peer::spawn(&py, cmd) {
                Ok(p) => p,
                Err(e) => {
                    reasons.push(format!("{py}: {e}"));
                    continue;
                }
            };
            let (status, out) = peer.finish(STEP);
            if status.success() && out.iter().any(|l| l == "importable") {
                return Ok(py);
            }
            let err = peer.stderr_text();
            let last = err.lines().last().unwrap_or("no message").to_owned();
            reasons.push(format!("{py}: {status}, {last}"));
        }
        Err(format!(
            "no Python can import mooncake.engine ({})",
            reasons.join("; ")
        ))
    });
    match found {
        Ok(py) => Some(py),
        Err(reason) if std::env::var("MC_INTEROP_REQUIRED").is_ok_and(|v| v == "1") => {
            panic!("MC_INTEROP_REQUIRED=1 but {reason}")
        }
        Err(reason) => {
            eprintln!("SKIP interop: {reason}");
            None
        }
    }
}

/// Runs `requests` as one batch and checks every task completed in full.
fn run_batch(engine: &Engine, requests: &[Request]) {
    let batch = engine.allocate_batch(requests.len()).unwrap();
    // SAFETY: every local range belongs to a buffer the caller keeps alive past the wait.
    unsafe { engine.submit(batch, requests) }.unwrap();
    let waited = engine.wait_batch(batch, Some(STEP));
    for (i, r) in requests.iter().enumerate() {
        let st = engine.task_status(batch, i).unwrap();
        assert_eq!(
            (st.state, st.bytes),
            (TaskState::Completed, r.len),
            "task {i} ({:?} {:#x}+{}) after wait {waited:?}",
            r.op,
            r.remote,
            r.len
        );
    }
    waited.unwrap();
    engine.free_batch(batch).unwrap();
}

fn read(engine: &Engine, segment: SegmentId, remote: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let local = out.as_mut_ptr() as u64;
    run_batch(
        engine,
        &[Request {
            op: Op::Read,
            local,
            segment,
            remote,
            len: len as u64,
        }],
    );
    out
}

fn mbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-9) / 1e6
}

/// Mooncake serves a buffer; our engine reads it, writes two regions, and Mooncake checks them.
#[test]
fn our_engine_reads_and_writes_a_mooncake_segment() {
    let Some(python) = mooncake_python() else {
        return;
    };
    let size = SIZE.to_string();
    let mut peer = Peer::spawn(
        "mooncake target",
        python_command(python, &["target", &size]),
    )
    .unwrap();
    let ready = peer.line(START);
    let words: Vec<&str> = ready.split_whitespace().collect();
    let ["ready", name, addr] = words.as_slice() else {
        panic!("mooncake target said {ready:?}")
    };
    let addr: u64 = addr.parse().unwrap();
    assert!(name.starts_with("127.0.0.1:"), "Mooncake advertises {name}");

    let engine = engine_with("P2PHANDSHAKE", "tcp");
    let seg = engine.open_segment(name).unwrap();
    let desc = engine.segment_descriptor(seg).unwrap();
    assert!(
        desc.buffers
            .iter()
            .any(|b| b.addr == addr && b.length == SIZE as u64),
        "Mooncake's descriptor lists its buffer {addr:#x}+{SIZE}: {desc:?}"
    );

    let t = Instant::now();
    let got = read(&engine, seg, addr, SIZE);
    let read_time = t.elapsed();
    assert_bytes("bytes read from Mooncake", &got, &pattern1(SIZE));

    // Two writes in one batch, at odd offsets, the first spanning many slices.
    let regions = [(4099usize, 5_000_001usize, 90usize), (SIZE - 777, 777, 7)];
    let sources: Vec<Vec<u8>> = regions
        .iter()
        .map(|&(_, len, seed)| pattern2(len, seed))
        .collect();
    let requests: Vec<Request> = regions
        .iter()
        .zip(&sources)
        .map(|(&(off, len, _), src)| Request {
            op: Op::Write,
            local: src.as_ptr() as u64,
            segment: seg,
            remote: addr + off as u64,
            len: len as u64,
        })
        .collect();
    let t = Instant::now();
    run_batch(&engine, &requests);
    let write_time = t.elapsed();
    for &(off, len, seed) in &regions {
        peer.send(&format!("check {off} {len} {seed}"));
        assert_eq!(peer.line(STEP), "ok", "Mooncake's check of [{off}, +{len})");
    }
    // Untouched bytes stay as they were, and we read back what we wrote.
    let after = read(&engine, seg, addr, SIZE);
    let mut want = pattern1(SIZE);
    for (&(off, len, _), src) in regions.iter().zip(&sources) {
        want[off..off + len].copy_from_slice(src);
    }
    assert_bytes("bytes read back from Mooncake", &after, &want);

    let (status, rest) = peer.finish(STEP);
    assert!(
        status.success() && rest.is_empty(),
        "mooncake target ended with {status}, output {rest:?}"
    );
    eprintln!(
        "interop: ours -> Mooncake: read {SIZE} B at {:.0} MB/s, wrote {} B at {:.0} MB/s",
        mbps(SIZE, read_time),
        regions[0].1 + regions[1].1,
        mbps(regions[0].1 + regions[1].1, write_time)
    );
}

/// Our `mooncake target` serves a buffer; a Mooncake client reads what we put there and
/// writes a new pattern, which we read back.
#[test]
fn mooncake_reads_and_writes_our_segment() {
    let Some(python) = mooncake_python() else {
        return;
    };
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mooncake"));
    cmd.args([
        "target",
        "--metadata",
        "P2PHANDSHAKE",
        "--bind",
        "127.0.0.1",
        "--until-stdin-eof",
    ])
    .args(["--size", &SIZE.to_string()]);
    let mut target = Peer::spawn("our target", cmd).unwrap();
    let ready = target.line(START);
    let name = ready
        .strip_prefix("ready ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("our target said {ready:?}"))
        .to_owned();

    let engine = engine_with("P2PHANDSHAKE", "tcp");
    let seg = engine.open_segment(&name).unwrap();
    let desc = engine.segment_descriptor(seg).unwrap();
    let addr = desc
        .buffers
        .iter()
        .find(|b| b.length == SIZE as u64)
        .unwrap_or_else(|| panic!("our target's descriptor lists no {SIZE}-byte buffer: {desc:?}"))
        .addr;
    let src = pattern3(SIZE);
    run_batch(
        &engine,
        &[Request {
            op: Op::Write,
            local: src.as_ptr() as u64,
            segment: seg,
            remote: addr,
            len: SIZE as u64,
        }],
    );

    let seed = 201;
    let args = [
        "client",
        &name,
        &addr.to_string(),
        &SIZE.to_string(),
        &seed.to_string(),
    ];
    let mut client = Peer::spawn("mooncake client", python_command(python, &args)).unwrap();
    let done = client.line(START + STEP);
    assert!(done.starts_with("done"), "mooncake client said {done:?}");
    let (status, rest) = client.finish(STEP);
    assert!(
        status.success() && rest.is_empty(),
        "mooncake client ended with {status}, output {rest:?}"
    );
    eprintln!("interop: Mooncake -> ours: {SIZE} B each way, {done}");

    assert_bytes(
        "bytes Mooncake wrote to our target",
        &read(&engine, seg, addr, SIZE),
        &pattern2(SIZE, seed),
    );
    let (status, rest) = target.finish(STEP);
    assert!(
        status.success() && rest.is_empty(),
        "our target ended with {status}, output {rest:?}"
    );
}
