//! Nodes that crash: a node killed with SIGKILL and started again on the same disk
//! tier keeps every object its disk held, whether it comes back before the master
//! gave up on the dead process or after.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::cprog::Proc;
use common::{free_port, pattern};
use mooncake::store::protocol::ReplicateConfig;
use mooncake::store::{Client, ClientConfig, MasterServer, ServerConfig};

const BIN: &str = env!("CARGO_BIN_EXE_mooncake");
const OBJECTS: u64 = 48;
const SIZE: usize = 200_000;

struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("mc-store-crash-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn server() -> MasterServer {
    let mut cfg = ServerConfig {
        rpc_port: 0,
        metadata_port: Some(0),
        metrics_port: None,
        ..Default::default()
    };
    cfg.master.client_ttl = Duration::from_secs(2);
    MasterServer::start(cfg).unwrap()
}

/// A node process lending 4 MiB under a fixed `name`, with a disk tier in `dir`.
fn node(s: &MasterServer, name: &str, dir: &TempDir) -> Proc {
    let mut cmd = Command::new(BIN);
    cmd.args(["node", "--master", &s.rpc_addr().to_string()])
        .args(["--metadata", &s.metadata_url().unwrap()])
        .args(["--segment-size", "4M", "--protocol", "tcp", "--name", name])
        .args(["--bind", "127.0.0.1", "--ssd-size", "64M", "--ssd-path"])
        .arg(&dir.0)
        .arg("--until-stdin-eof");
    let mut p = Proc::spawn("node", &mut cmd);
    p.ready();
    p
}

/// Polls `done` every 20 ms for at most 30 s.
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "waited 30 s for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Keys the master keeps only on a disk tier (no memory replica).
fn disk_only(s: &MasterServer) -> Vec<u64> {
    (0..OBJECTS)
        .filter(|i| {
            s.master()
                .query(&format!("k{i}"))
                .is_some_and(|(_, _, replicas)| replicas.is_empty())
        })
        .collect()
}

#[test]
fn a_node_killed_and_restarted_on_its_disk_keeps_what_the_disk_held() {
    let s = server();
    let dir = TempDir::new("restart");
    let name = format!("127.0.0.1:{}", free_port());
    let c = Client::new(ClientConfig {
        global_segment_size: 0,
        ..ClientConfig::connect(&s.rpc_addr().to_string(), &s.metadata_url().unwrap(), "tcp")
            .unwrap()
    })
    .unwrap();
    let mut first = node(&s, &name, &dir);
    for i in 0..OBJECTS {
        c.put(
            &format!("k{i}"),
            &pattern(i, SIZE),
            &ReplicateConfig::default(),
        )
        .unwrap();
    }
    let on_disk = disk_only(&s);
    assert!(on_disk.len() as u64 > OBJECTS / 2, "offloaded: {on_disk:?}");
    first.kill();

    // At once, while the master still counts the dead process's segment.
    let _second = node(&s, &name, &dir);
    // The dead process's segment goes after the client TTL, with what only its memory
    // held; the new one is mounted.
    let in_memory: Vec<u64> = (0..OBJECTS).filter(|i| !on_disk.contains(i)).collect();
    wait_for("the dead process's segment to go", || {
        in_memory
            .iter()
            .all(|i| s.master().query(&format!("k{i}")).is_none())
    });
    // The restarted node remounts once the name is free and announces its disk.
    wait_for("the disk tier's objects to be announced", || {
        on_disk
            .iter()
            .all(|i| s.master().query(&format!("k{i}")).is_some())
    });
    for i in on_disk {
        let key = format!("k{i}");
        let got = c
            .get(&key)
            .unwrap_or_else(|e| panic!("{key} after the restart: {e}"));
        assert!(got == pattern(i, SIZE), "{key} bytes after the restart");
    }
}
