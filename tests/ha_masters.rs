//! Masters with `--enable-ha` on a real etcd (skipped with a message when etcd is not
//! installed): one leads and the other stands by; clients and nodes given
//! `etcd://...` as the master address follow the leader; when the leader is killed
//! the standby takes over with a larger epoch and puts and gets work again; the old
//! leader, restarted, stands by.

mod common;

use std::process::Command;
use std::time::Duration;

use common::cprog::Proc;
use common::{pattern, services};
use mooncake::etcd::EtcdClient;
use mooncake::store::protocol::ReplicateConfig;
use mooncake::store::{ha, Client, ClientConfig};

const BIN: &str = env!("CARGO_BIN_EXE_mooncake");
/// Safety net for a child's next line; never a timing assertion.
const LINE_LIMIT: Duration = Duration::from_secs(60);

fn master(etcd: &str) -> Proc {
    let mut cmd = Command::new(BIN);
    cmd.args(["master", "--enable-ha", "--etcd-endpoints", etcd])
        .args(["--ha-lease-ttl", "2", "--rpc-port", "0"])
        .args(["--bind", "127.0.0.1"])
        .args([
            "--metadata-port",
            "off",
            "--metrics-port",
            "off",
            "--until-stdin-eof",
        ]);
    Proc::spawn("master", &mut cmd)
}

/// The epoch in a leader's ready line.
fn epoch(ready: &str) -> i64 {
    ready
        .split_whitespace()
        .find_map(|w| w.strip_prefix("epoch="))
        .and_then(|e| e.parse().ok())
        .unwrap_or_else(|| panic!("no epoch in {ready:?}"))
}

fn rpc(ready: &str) -> String {
    ready
        .split_whitespace()
        .find_map(|w| w.strip_prefix("rpc="))
        .unwrap_or_else(|| panic!("no rpc address in {ready:?}"))
        .to_owned()
}

/// A client (a node with a segment) that finds the leader through etcd and keeps
/// engine metadata there too: every master's embedded server would die with it.
fn client_config(etcd: &str, segment: u64) -> ClientConfig {
    let etcd = format!("etcd://{etcd}");
    ClientConfig {
        global_segment_size: segment,
        ping_interval: Duration::from_millis(50),
        ..ClientConfig::connect(&etcd, &etcd, "tcp").unwrap()
    }
}

/// Puts `key` until the cluster takes it (bounded: the node remounts on the new
/// leader at its next ping); true once it did.
fn put_eventually(c: &Client, key: &str, value: &[u8]) -> bool {
    for _ in 0..400 {
        if c.put(key, value, &ReplicateConfig::default()).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    false
}

#[test]
fn a_standby_takes_over_when_the_leader_dies() {
    let Some(etcd) = services::etcd() else { return };
    let mut a = master(&etcd.addr);
    let a_ready = a.ready();
    let mut b = master(&etcd.addr);
    let view = EtcdClient::new(&etcd.addr).unwrap();
    let current = ha::read_view(&view, ha::DEFAULT_CLUSTER_ID)
        .unwrap()
        .unwrap();
    assert_eq!(
        current.address,
        rpc(&a_ready),
        "etcd names the leader's real address"
    );
    assert_eq!(current.epoch, epoch(&a_ready));

    let cfg = |segment| client_config(&etcd.addr, segment);
    let _node = Client::new(cfg(32 << 20)).unwrap();
    let c = Client::new(cfg(0)).unwrap();
    let v = pattern(1, 100_000);
    c.put("before", &v, &ReplicateConfig::default()).unwrap();
    assert_eq!(c.get("before").unwrap(), v);

    // The leader dies without a word; the standby leads once its lease runs out.
    let killed = std::time::Instant::now();
    a.kill();
    let b_ready = b.line(LINE_LIMIT).expect("the standby took over");
    // A figure for the record (lease TTL 2 s), not an assertion.
    eprintln!(
        "failover: the standby led {:?} after the kill",
        killed.elapsed()
    );
    assert!(b_ready.starts_with("ready "), "{b_ready}");
    assert!(
        epoch(&b_ready) > epoch(&a_ready),
        "{a_ready} then {b_ready}"
    );
    let current = ha::read_view(&view, ha::DEFAULT_CLUSTER_ID)
        .unwrap()
        .unwrap();
    assert_eq!(current.address, rpc(&b_ready));

    // The same clients, unchanged, work against the new leader.
    let w = pattern(2, 50_000);
    assert!(put_eventually(&c, "after", &w), "puts work again");
    eprintln!(
        "failover: puts worked again {:?} after the kill",
        killed.elapsed()
    );
    assert_eq!(c.get("after").unwrap(), w);

    // The old leader, back, stands by: the view still names the new one.
    let _a2 = master(&etcd.addr);
    let again = Client::new(cfg(0)).unwrap();
    assert_eq!(again.get("after").unwrap(), w);
    let current = ha::read_view(&view, ha::DEFAULT_CLUSTER_ID)
        .unwrap()
        .unwrap();
    assert_eq!(current.address, rpc(&b_ready));
    drop(again);
    drop(c);
    let out = b.finish(LINE_LIMIT);
    assert!(
        out.status.success(),
        "the leader stepped down cleanly: {}",
        out.stderr
    );
}

/// Three masters on etcd and a replay with `replica_num = 2`: the leader is killed
/// with SIGKILL mid-replay; a standby leads, the nodes remount on it with their
/// catalogs, and no object committed before is lost or wrong; after the reconnect
/// window the replay sees no error. The old leader, restarted, stands by.
#[test]
fn a_failover_mid_replay_loses_no_committed_object() {
    let Some(etcd) = services::etcd() else { return };
    let mut leader = master(&etcd.addr);
    let leader_ready = leader.ready();
    let standbys = [master(&etcd.addr), master(&etcd.addr)];
    let cfg = |segment| client_config(&etcd.addr, segment);
    let _nodes = [
        Client::new(cfg(32 << 20)).unwrap(),
        Client::new(cfg(32 << 20)).unwrap(),
    ];
    let c = Client::new(cfg(0)).unwrap();
    let two = ReplicateConfig {
        replica_num: 2,
        ..Default::default()
    };
    let size = |i: u64| 4096 + (i as usize % 7) * 3000;
    let readable = |committed: &[u64]| {
        committed.iter().all(|&i| {
            c.get(&format!("r{i}"))
                .is_ok_and(|v| v == pattern(i, size(i)))
        })
    };
    let mut committed = Vec::new();
    let (mut killed, mut window, mut in_window) = (None, None, 0);
    for i in 0..400u64 {
        if i == 150 {
            leader.kill();
            killed = Some(std::time::Instant::now());
        }
        let put = c.put(&format!("r{i}"), &pattern(i, size(i)), &two);
        match (&put, killed, window) {
            (Ok(()), _, _) => committed.push(i),
            (Err(e), None, _) => panic!("r{i} before the kill: {e}"),
            (Err(e), Some(_), Some(_)) => panic!("r{i} after the reconnect window: {e}"),
            (Err(_), Some(_), None) => in_window += 1,
        }
        if let (Some(at), None) = (killed, window) {
            if put.is_ok() && readable(&committed) {
                window = Some(at.elapsed());
            } else {
                std::thread::sleep(Duration::from_millis(25));
            }
        }
    }
    let window = window.expect("a standby took over within the replay");
    eprintln!(
        "failover mid-replay: reconnect window {window:?} (lease TTL 2 s), {in_window} failed puts in it, 0 after, {} committed",
        committed.len()
    );
    for &i in &committed {
        let got = c
            .get(&format!("r{i}"))
            .unwrap_or_else(|e| panic!("r{i}: {e}"));
        assert!(got == pattern(i, size(i)), "r{i} bytes");
        // Both replicas of what was committed before the kill came back; a put in the
        // moments when only one node had remounted got one (replica_num is best effort).
        let replicas = c.describe(&format!("r{i}")).unwrap().0.replicas.len();
        assert!(
            replicas == 2 || (i >= 150 && replicas == 1),
            "r{i}: {replicas}"
        );
    }
    // The old leader, back, stands by: the view keeps naming another master.
    let _back = master(&etcd.addr);
    let view = EtcdClient::new(&etcd.addr).unwrap();
    let current = ha::read_view(&view, ha::DEFAULT_CLUSTER_ID)
        .unwrap()
        .unwrap();
    assert!(current.epoch > epoch(&leader_ready));
    drop(standbys);
}
