//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod cprog;
pub mod fakes;
pub mod groups;
pub mod services;

use std::process::Command;

use mooncake::{Engine, EngineConfig};

pub fn engine_with(metadata: &str, protocol: &str) -> Engine {
    engine_configured(&[("metadata", metadata), ("protocol", protocol)])
}

/// An engine with these settings (`mc_config_set` keys) over the defaults.
pub fn engine_configured(settings: &[(&str, &str)]) -> Engine {
    let mut cfg = EngineConfig::default();
    for (k, v) in settings {
        cfg.set(k, v).unwrap();
    }
    Engine::new(cfg).expect("engine starts")
}

/// This test binary, set to run only test `name` (with its output shown): for a check
/// that needs a fresh process, such as one reading environment variables at start-up.
pub fn test_in_child(name: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary path"));
    cmd.args(["--exact", name, "--nocapture"]);
    cmd
}

/// Runs `child` to its end and asserts that it passed and printed `CHILD-OK` (the test
/// it ran got past its checks, rather than returning early).
pub fn assert_child_ok(child: &mut Command) {
    let out = child.output().expect("test child runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("CHILD-OK"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A port the OS just handed out on 127.0.0.1 and that is free again (for a server
/// that must come back on the same one, or a name that must stay the same).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A deterministic byte pattern that differs per seed and offset.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A registered buffer that unregisters itself on drop.
pub struct Registered<'a> {
    pub engine: &'a Engine,
    pub buf: Vec<u8>,
}

impl<'a> Registered<'a> {
    pub fn new(engine: &'a Engine, buf: Vec<u8>) -> Registered<'a> {
        let mut r = Registered { engine, buf };
        // SAFETY: the Vec lives in `r` and is unregistered before it is dropped.
        unsafe { engine.register_memory(r.buf.as_mut_ptr(), r.buf.len(), "cpu:0") }.unwrap();
        r
    }

    pub fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        let _ = self.engine.unregister_memory(self.buf.as_mut_ptr());
    }
}

/// A `mooncake target` child process; killed and reaped on drop.
pub struct Target {
    pub child: std::process::Child,
    pub name: String,
    stdout: Option<std::io::BufReader<std::process::ChildStdout>>,
}

impl Target {
    pub fn spawn(metadata: &str, size: usize) -> Target {
        Target::spawn_with(metadata, size, &[])
    }

    /// As `spawn`, with more `mooncake target` flags (e.g. `--location cuda:0`).
    pub fn spawn_with(metadata: &str, size: usize, extra: &[&str]) -> Target {
        use std::io::BufRead;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_mooncake"))
            .args([
                "target",
                "--metadata",
                metadata,
                "--bind",
                "127.0.0.1",
                "--until-stdin-eof",
            ])
            .args(["--size", &size.to_string()])
            .args(extra)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn mooncake target");
        let mut line = String::new();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        stdout.read_line(&mut line).unwrap();
        // `ready <segment> addr=0x... size=N`: the segment is the second word.
        let name = line
            .trim()
            .strip_prefix("ready ")
            .and_then(|rest| rest.split_whitespace().next())
            .map(str::to_owned);
        let mut t = Target {
            child,
            name: String::new(),
            stdout: Some(stdout),
        };
        t.name = name.unwrap_or_else(|| panic!("target said {line:?}"));
        t
    }

    /// Sends a line command and returns the target's one-line answer.
    pub fn command(&mut self, cmd: &str) -> String {
        use std::io::{BufRead, Write};
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.as_mut().unwrap().read_line(&mut line).unwrap();
        line.trim().to_owned()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        self.kill();
    }
}

/// An in-process master with metadata and metrics servers on free ports and the given
/// read lease.
pub fn store_server(lease_ms: u64) -> mooncake::store::MasterServer {
    let mut cfg = mooncake::store::ServerConfig {
        rpc_port: 0,
        metadata_port: Some(0),
        metrics_port: Some(0),
        ..Default::default()
    };
    cfg.master.lease_ttl = std::time::Duration::from_millis(lease_ms);
    mooncake::store::MasterServer::start(cfg).unwrap()
}

/// A store client of `s` over TCP lending `segment` bytes (0: a pure client).
pub fn store_client(
    s: &mooncake::store::MasterServer,
    segment: u64,
    cache_replicas: bool,
) -> mooncake::store::Client {
    use mooncake::store::ClientConfig;
    let metadata = s.metadata_url().unwrap();
    let cfg = ClientConfig {
        global_segment_size: segment,
        cache_replicas,
        ..ClientConfig::connect(&s.rpc_addr().to_string(), &metadata, "tcp").unwrap()
    };
    mooncake::store::Client::new(cfg).unwrap()
}
