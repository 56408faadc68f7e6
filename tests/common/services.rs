//! Real etcd and redis servers for tests: started on loopback ports the OS picked,
//! ready when they say so in their logs, killed and their data removed on drop.
//! `None` (with a message) when the server binary is not installed.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use super::cprog::have;
use std::sync::mpsc;
use std::time::Duration;

/// How long a server may take to say it is ready; a safety net, not a timing check.
const READY_LIMIT: Duration = Duration::from_secs(30);

/// A loopback port the OS just handed out (released for the server to bind; a server
/// that loses the race fails to start and is retried on new ports).
fn os_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    l.local_addr().expect("local addr").port()
}

/// A child server, killed and reaped on drop, with its data directory removed.
pub struct Service {
    child: Child,
    dir: Option<PathBuf>,
    /// `host:port` of its client port.
    pub addr: String,
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// Starts `cmd` and waits until a line of its output (stdout or stderr) contains
/// `ready`; `None` if it exits or stays silent past the limit.
fn start(
    mut cmd: Command,
    ready: &'static str,
    addr: String,
    dir: Option<PathBuf>,
) -> Option<Service> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().ok()?;
    let (tx, rx) = mpsc::channel();
    for out in [
        child
            .stdout
            .take()
            .map(|o| Box::new(o) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|e| Box::new(e) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if line.contains(ready) && tx.send(()).is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);
    let service = Service { child, dir, addr };
    match rx.recv_timeout(READY_LIMIT) {
        Ok(()) => Some(service),
        Err(_) => None,
    }
}

fn temp_dir(what: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "mc-test-{what}-{}-{}",
        std::process::id(),
        os_port()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A one-member etcd cluster on loopback.
pub fn etcd() -> Option<Service> {
    if !have("etcd") {
        eprintln!("skipped: etcd is not installed (Debian: apt-get install etcd-server)");
        return None;
    }
    for _ in 0..3 {
        let (client, peer) = (os_port(), os_port());
        let dir = temp_dir("etcd");
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut cmd = Command::new("etcd");
        cmd.args(["--name", "t", "--data-dir"])
            .arg(&dir)
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("t={peer_url}")])
            .args(["--logger", "zap", "--log-outputs", "stderr"]);
        // etcd logs this once its client listener serves, after the member is ready.
        if let Some(s) = start(
            cmd,
            "serving client traffic",
            format!("127.0.0.1:{client}"),
            Some(dir),
        ) {
            return Some(s);
        }
    }
    panic!("etcd did not start on loopback after 3 tries");
}

/// A redis server on loopback, without persistence.
pub fn redis() -> Option<Service> {
    if !have("redis-server") {
        eprintln!("skipped: redis-server is not installed (Debian: apt-get install redis-server)");
        return None;
    }
    for _ in 0..3 {
        let port = os_port();
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"]);
        if let Some(s) = start(
            cmd,
            "Ready to accept connections",
            format!("127.0.0.1:{port}"),
            None,
        ) {
            return Some(s);
        }
    }
    panic!("redis-server did not start on loopback after 3 tries");
}
