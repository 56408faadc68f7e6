//! A master process killed with SIGKILL in the middle of a replay and started again on
//! the same address: the nodes (processes too) remount with their catalogs, every
//! object committed before is served again byte for byte, and after the reconnect
//! window the replay sees no error.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::cprog::Proc;
use common::{free_port, pattern};
use mooncake::store::protocol::ReplicateConfig;
use mooncake::store::{Client, ClientConfig};

const BIN: &str = env!("CARGO_BIN_EXE_mooncake");

fn master(rpc: u16, metadata: u16) -> Proc {
    let mut cmd = Command::new(BIN);
    cmd.args(["master", "--bind", "127.0.0.1"])
        .args(["--rpc-port", &rpc.to_string()])
        .args(["--metadata-port", &metadata.to_string()])
        .args(["--metrics-port", "off", "--until-stdin-eof"]);
    let mut p = Proc::spawn("master", &mut cmd);
    p.ready();
    p
}

fn node(master: &str, metadata: &str) -> Proc {
    let mut cmd = Command::new(BIN);
    cmd.args(["node", "--master", master, "--metadata", metadata])
        .args(["--segment-size", "32M", "--protocol", "tcp"])
        .arg("--until-stdin-eof");
    let mut p = Proc::spawn("node", &mut cmd);
    p.ready();
    p
}

fn size(i: u64) -> usize {
    // Mostly KV-block sizes, now and then one larger than a slab (striped).
    if i % 50 == 7 {
        300_000
    } else {
        4096 + (i as usize % 13) * 1500
    }
}

#[test]
fn a_master_killed_mid_replay_comes_back_with_every_object() {
    let (rpc, meta) = (free_port(), free_port());
    let master_addr = format!("127.0.0.1:{rpc}");
    let metadata = format!("http://127.0.0.1:{meta}/metadata");
    let mut m = master(rpc, meta);
    let _nodes = [node(&master_addr, &metadata), node(&master_addr, &metadata)];
    let c = Client::new(ClientConfig {
        ping_interval: Duration::from_millis(100),
        ..ClientConfig::connect(&master_addr, &metadata, "tcp").unwrap()
    })
    .unwrap();
    let cfg = ReplicateConfig::default();
    let mut committed = Vec::new();
    let mut errors_in_window = 0;
    let all_readable = |committed: &[u64]| {
        committed.iter().all(|&i| {
            c.get(&format!("obj{i}"))
                .is_ok_and(|v| v == pattern(i, size(i)))
        })
    };
    let mut killed_at = None;
    let mut window_closed = None;
    for i in 0..600u64 {
        if i == 200 {
            m.kill();
            killed_at = Some(Instant::now());
            m = master(rpc, meta);
        }
        let key = format!("obj{i}");
        let put = c.put(&key, &pattern(i, size(i)), &cfg);
        match (&put, killed_at, window_closed) {
            (Ok(()), _, _) => committed.push(i),
            (Err(e), None, _) => panic!("{key} before the kill: {e}"),
            (Err(e), Some(_), Some(_)) => panic!("{key} after the reconnect window: {e}"),
            (Err(_), Some(_), None) => errors_in_window += 1,
        }
        if let (Some(at), None) = (killed_at, window_closed) {
            // The window closes once the nodes remounted and everything committed
            // so far is served again (bounded: the replay itself is).
            if put.is_ok() && all_readable(&committed) {
                window_closed = Some(at.elapsed());
            } else {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        if i % 25 == 0 && window_closed.is_some() {
            assert!(all_readable(&committed), "after obj{i}");
        }
    }
    let window = window_closed.expect("the cluster came back within the replay");
    eprintln!(
        "master restart: reconnect window {window:?}, {errors_in_window} failed puts in it, 0 after; {} objects committed",
        committed.len()
    );
    for &i in &committed {
        let got = c
            .get(&format!("obj{i}"))
            .unwrap_or_else(|e| panic!("obj{i}: {e}"));
        assert!(got == pattern(i, size(i)), "obj{i} bytes");
    }
    assert!(committed.len() > 400);
}
