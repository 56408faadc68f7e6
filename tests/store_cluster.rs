//! The store end to end over real RPC and transfers: an in-process master, nodes and
//! clients, plus node processes that get killed.

mod common;

use common::pattern as value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use mooncake::store::protocol::ReplicateConfig;
use mooncake::store::{Client, ClientConfig, MasterServer, ServerConfig};
use mooncake::Code;

const MIB: u64 = 1 << 20;

use common::store_server as server;

/// The port of an `http://host:port/...` URL.
fn port_of(url: &str) -> u16 {
    url.trim_start_matches("http://")
        .split(['/', ':'])
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("a port in the URL")
}

fn client(s: &MasterServer, segment: u64) -> Client {
    common::store_client(s, segment, true)
}

#[test]
fn put_get_and_friends_across_nodes() {
    let s = server(10_000);
    let _n1 = client(&s, 32 * MIB);
    let _n2 = client(&s, 32 * MIB);
    let c = client(&s, 0);
    let cfg = ReplicateConfig {
        replica_num: 2,
        ..Default::default()
    };
    let v = value(1, 100_000);
    c.put("a", &v, &cfg).unwrap();
    assert_eq!(c.get("a").unwrap(), v);
    assert_eq!(c.size("a").unwrap(), 100_000);
    assert!(c.exists("a").unwrap());
    assert!(!c.exists("b").unwrap());
    c.put("a", &value(2, 10), &cfg).unwrap(); // immutable: unchanged
    assert_eq!(c.get("a").unwrap(), v);
    let mut small = vec![0u8; 10];
    assert_eq!(
        c.get_into("a", &mut small).unwrap_err().code(),
        Code::BufferOverflow
    );
    assert_eq!(c.get("missing").unwrap_err().code(), Code::ObjectNotFound);
    assert_eq!(
        c.put("empty", &[], &cfg).unwrap_err().code(),
        Code::InvalidParams
    );
    assert_eq!(
        c.put(&"k".repeat(5000), &v, &cfg).unwrap_err().code(),
        Code::InvalidKey
    );
    // Striped: bigger than one slab (4 MiB), read back whole.
    let big = value(3, (9 * MIB + 123) as usize);
    c.put("big", &big, &ReplicateConfig::default()).unwrap();
    assert_eq!(c.get("big").unwrap(), big);
    assert_eq!(
        c.remove("a", false).unwrap_err().code(),
        Code::ObjectHasLease
    );
    c.remove("a", true).unwrap();
    assert!(!c.exists("a").unwrap());
}

#[test]
fn batches_with_several_buffers_per_key() {
    let s = server(10_000);
    let _n = client(&s, 64 * MIB);
    let c = client(&s, 0);
    let keys: Vec<String> = (0..32).map(|i| format!("layer{i}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    // Each value is two buffers (as vLLM stores K and V separately).
    let halves: Vec<(Vec<u8>, Vec<u8>)> = (0..32)
        .map(|i| (value(i, 3000), value(i + 100, 5000)))
        .collect();
    let parts: Vec<Vec<(u64, u64)>> = halves
        .iter()
        .map(|(k, v)| vec![(k.as_ptr() as u64, 3000), (v.as_ptr() as u64, 5000)])
        .collect();
    // SAFETY: the buffers outlive the call.
    let r = unsafe { c.batch_put_from(&keys, &parts, &ReplicateConfig::default(), false) };
    assert!(r.iter().all(|x| x.is_ok()), "{r:?}");
    let exists = c.batch_exists(&keys);
    assert!(exists.iter().all(|e| *e.as_ref().unwrap()));
    let mut out: Vec<(Vec<u8>, Vec<u8>)> = (0..32)
        .map(|_| (vec![0u8; 5000], vec![0u8; 3000]))
        .collect();
    let parts: Vec<Vec<(u64, u64)>> = out
        .iter_mut()
        .map(|(a, b)| vec![(a.as_mut_ptr() as u64, 5000), (b.as_mut_ptr() as u64, 3000)])
        .collect();
    // SAFETY: as above.
    let r = unsafe { c.batch_get_into(&keys, &parts) };
    for (i, res) in r.iter().enumerate() {
        assert_eq!(*res.as_ref().unwrap(), 8000);
        let mut joined = out[i].0.clone();
        joined.extend_from_slice(&out[i].1);
        let mut want = halves[i].0.clone();
        want.extend_from_slice(&halves[i].1);
        assert!(joined == want, "key {i}");
    }
    assert_eq!(c.remove_by_regex("^layer1", true).unwrap(), 11);
    assert_eq!(c.remove_all(true).unwrap(), 21);
}

#[test]
fn expired_lease_fails_the_read() {
    let s = server(0);
    let _n = client(&s, 8 * MIB);
    let c = client(&s, 0);
    c.put("k", &value(1, 1000), &ReplicateConfig::default())
        .unwrap();
    assert_eq!(c.get("k").unwrap_err().code(), Code::LeaseExpired);
}

#[test]
fn corrupted_bytes_fail_the_checksum() {
    let s = server(10_000);
    let node = client(&s, 8 * MIB);
    let c = client(&s, 0);
    c.put("k", &value(1, 4096), &ReplicateConfig::default())
        .unwrap();
    let (_, _, replicas) = s.master().query("k").unwrap();
    let piece = &replicas[0].pieces[0];
    // Flip bytes in the node's memory behind the store's back.
    let garbage = [0xEEu8; 16];
    let e = node.engine();
    let seg = e.open_segment(&piece.segment).unwrap();
    let b = e.allocate_batch(1).unwrap();
    let req = mooncake::Request {
        op: mooncake::Op::Write,
        local: garbage.as_ptr() as u64,
        segment: seg,
        remote: piece.addr,
        len: 16,
    };
    // SAFETY: `garbage` outlives the wait.
    unsafe { e.submit(b, &[req]) }.unwrap();
    e.wait_batch(b, Some(Duration::from_secs(10))).unwrap();
    assert_eq!(c.get("k").unwrap_err().code(), Code::ChecksumMismatch);
}

#[test]
fn malformed_rpc_frames_close_only_their_connection() {
    let s = server(10_000);
    let _n = client(&s, 8 * MIB);
    let c = client(&s, 0);
    for junk in [
        &b"\xff\xff\xff\xff"[..],
        &[4, 0, 0, 0, 1, 0, 2, 0],
        &[20, 0, 0, 0, 1, 0, 99, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4],
    ] {
        let mut t = TcpStream::connect(s.rpc_addr()).unwrap();
        t.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        t.write_all(junk).unwrap();
        let mut buf = [0u8; 64];
        assert!(
            matches!(t.read(&mut buf), Ok(0) | Err(_)),
            "closed without an answer"
        );
    }
    c.put("still", &value(1, 10), &ReplicateConfig::default())
        .unwrap();
    assert!(c.exists("still").unwrap());
}

#[test]
fn puts_keep_succeeding_past_capacity_under_constant_probing() {
    let s = server(10_000);
    let _n = client(&s, 16 * MIB);
    let writer = client(&s, 0);
    let prober = client(&s, 0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let keys: Vec<String> = (0..64).map(|i| format!("k{i}")).collect();
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                prober.batch_exists(&keys);
            }
        });
        let v = value(9, 256 << 10);
        for i in 0..256 {
            let r = writer.put(&format!("k{i}"), &v, &ReplicateConfig::default());
            if let Err(e) = r {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                panic!("put {i}: {e}");
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let st = writer.stats().unwrap();
    assert!(st.evicted_objects > 0, "{st:?}");
    assert_eq!(writer.get("k255").unwrap(), value(9, 256 << 10));
}

struct NodeProcess(Child);

impl NodeProcess {
    fn spawn(s: &MasterServer, size: &str) -> NodeProcess {
        let metadata = s.metadata_url().unwrap();
        NodeProcess::spawn_with(s, size, &["--metadata", &metadata])
    }

    /// A node given `extra` flags on top of the master, size and protocol.
    fn spawn_with(s: &MasterServer, size: &str, extra: &[&str]) -> NodeProcess {
        let mut child = Command::new(env!("CARGO_BIN_EXE_mooncake"))
            .args(["node", "--master", &s.rpc_addr().to_string()])
            .args(extra)
            .args([
                "--segment-size",
                size,
                "--protocol",
                "tcp",
                "--until-stdin-eof",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.starts_with("ready "), "{line:?}");
        NodeProcess(child)
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn node_killed_mid_replay_loses_nothing_with_two_replicas() {
    let s = server(10_000);
    let mut a = NodeProcess::spawn(&s, "32M");
    let _b = NodeProcess::spawn(&s, "32M");
    let c = client(&s, 0);
    let cfg = ReplicateConfig {
        replica_num: 2,
        ..Default::default()
    };
    let mut stored = Vec::new();
    // A replay-like stream of puts and reads; node A dies a third of the way in.
    for i in 0..300u64 {
        if i == 100 {
            a.0.kill().unwrap();
            a.0.wait().unwrap();
        }
        let key = format!("obj{i}");
        // After the kill, puts that place a replica on the dead node fail as a whole
        // (and are revoked); the ones that succeed must be fully readable.
        if c.put(&key, &value(i, 20_000 + i as usize), &cfg).is_ok() {
            stored.push(i);
        }
        if i % 10 == 0 {
            for &j in &stored {
                assert!(
                    c.get(&format!("obj{j}")).unwrap() == value(j, 20_000 + j as usize),
                    "obj{j}"
                );
            }
        }
    }
    assert!(stored.len() >= 100, "every put before the kill succeeded");
    for &i in &stored {
        let got = c
            .get(&format!("obj{i}"))
            .unwrap_or_else(|e| panic!("obj{i}: {e}"));
        assert!(got == value(i, 20_000 + i as usize), "obj{i} bytes");
    }
}

#[test]
fn admin_endpoints_report_the_pool() {
    let s = server(10_000);
    let _n = client(&s, 8 * MIB);
    let c = client(&s, 0);
    c.put("layer/0", &value(1, 5000), &ReplicateConfig::default())
        .unwrap();
    let admin =
        mooncake::http::HttpClient::new(&format!("http://{}", s.admin_addr().unwrap())).unwrap();
    let get = |path: &str| {
        let (status, body) = admin.request("GET", path, b"").unwrap();
        (status, String::from_utf8(body).unwrap())
    };
    assert_eq!(get("/health"), (200, "OK".to_owned()));
    let (status, metrics) = get("/metrics");
    assert_eq!(status, 200);
    assert!(metrics.contains("mooncake_objects 1"), "{metrics}");
    assert!(
        metrics.contains("# TYPE mooncake_used_bytes gauge"),
        "{metrics}"
    );
    // Mooncake's own names, for dashboards written for its master: a put of one key
    // is its single-key PutStart and PutEnd, a lookup of a missing key a failed
    // GetReplicaList, and an existence check of three keys a batch of three (a key
    // that is not there is an answer, not a failure).
    assert!(c.get("nope").is_err());
    let found = c.batch_exists(&["layer/0", "nope", "other"]);
    assert_eq!(found, vec![Ok(true), Ok(false), Ok(false)]);
    let (_, metrics) = get("/metrics");
    let figure = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<u64>().ok())
    };
    for (name, want) in [
        ("master_key_count", 1),
        ("master_total_capacity_bytes", 8 * MIB),
        ("master_put_start_requests_total", 1),
        ("master_put_start_failures_total", 0),
        ("master_put_end_requests_total", 1),
        ("master_get_replica_list_requests_total", 1),
        ("master_get_replica_list_failures_total", 1),
        ("master_batch_exist_key_requests_total", 1),
        ("master_batch_exist_key_items_total", 3),
        ("master_batch_exist_key_failed_items_total", 0),
    ] {
        assert_eq!(figure(name), Some(want), "{name} in {metrics}");
    }
    // Each segment's own figures, labelled with its name: the one node lends 8 MiB.
    let lent: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("segment_total_capacity_bytes{segment=\""))
        .collect();
    assert_eq!(lent.len(), 1, "{metrics}");
    assert!(lent[0].ends_with(&format!("\"}} {}", 8 * MIB)), "{metrics}");
    // Allocated space, in the allocator's units: the same figure as our own gauge.
    let allocated = figure("master_allocated_bytes");
    assert!(allocated >= Some(5000), "{metrics}");
    assert_eq!(allocated, figure("mooncake_used_bytes"), "{metrics}");
    assert!(
        metrics.contains("# TYPE master_put_start_requests_total counter\n"),
        "{metrics}"
    );
    let (status, q) = get("/query_key?key=layer%2F0");
    assert_eq!(status, 200);
    let q = mooncake::json::parse(&q).unwrap();
    assert_eq!(q.get("size").and_then(|v| v.as_u64()), Some(5000));
    assert_eq!(get("/query_key?key=nope").0, 404);
    assert_eq!(get("/query_key").0, 400);
    assert_eq!(get("/get_all_keys"), (200, r#"["layer/0"]"#.to_owned()));
    let (status, segs) = get("/get_all_segments");
    assert_eq!(status, 200);
    let segs = mooncake::json::parse(&segs).unwrap();
    assert_eq!(segs.as_array().map(|a| a.len()), Some(1));
}

#[test]
fn ranges_batch_remove_and_replica_clear() {
    let s = server(10_000);
    let n1 = client(&s, 32 * MIB);
    let n2 = client(&s, 32 * MIB);
    let c = client(&s, 0);
    // Striped across slabs, so ranges straddle pieces.
    let big = value(7, (9 * MIB + 77) as usize);
    c.put("big", &big, &ReplicateConfig::default()).unwrap();
    let mut a = vec![0u8; 100];
    let mut b = vec![0u8; 5000];
    let at = (4 * MIB - 2000) as usize;
    let ranges = vec![vec![
        (0u64, a.as_mut_ptr() as u64, 100u64),
        (at as u64, b.as_mut_ptr() as u64, 5000),
    ]];
    // SAFETY: both buffers are owned here and outlive the call.
    let r = unsafe { c.batch_get_ranges(&["big"], &ranges) };
    assert_eq!(r[0].as_ref().unwrap(), &5100);
    assert_eq!(a, big[..100]);
    assert_eq!(b, big[at..at + 5000]);
    let past = vec![vec![(big.len() as u64 - 10, a.as_mut_ptr() as u64, 11u64)]];
    // SAFETY: as above.
    let r = unsafe { c.batch_get_ranges(&["big"], &past) };
    assert_eq!(r[0].as_ref().unwrap_err().code(), Code::InvalidParams);

    let two = ReplicateConfig {
        replica_num: 2,
        ..Default::default()
    };
    for k in ["x", "y", "z"] {
        c.put(k, &value(1, 1000), &two).unwrap();
    }
    // One replica dropped from n1 (nothing read, so nothing leased): the object stays.
    let cleared = c.batch_replica_clear(&["x", "missing"], n1.hostname());
    assert!(cleared[0].as_ref().unwrap());
    assert!(!cleared[1].as_ref().unwrap());
    assert!(!c.batch_replica_clear(&["x"], n1.hostname())[0]
        .as_ref()
        .unwrap());
    assert!(c.exists("x").unwrap());
    // Its last replica dropped: the object is gone.
    assert!(c.batch_replica_clear(&["x"], n2.hostname())[0]
        .as_ref()
        .unwrap());
    assert!(!c.exists("x").unwrap());
    // Every replica at once.
    assert!(c.batch_replica_clear(&["y"], "")[0].as_ref().unwrap());
    assert!(!c.exists("y").unwrap());
    // A read leases z: it is neither cleared nor removed without force.
    let (d, _) = c.describe("z").unwrap();
    assert_eq!(d.replicas.len(), 2);
    assert_ne!(
        d.replicas[0].pieces[0].segment,
        d.replicas[1].pieces[0].segment
    );
    assert!(!c.batch_replica_clear(&["z"], "")[0].as_ref().unwrap());
    let removed = c.batch_remove(&["z", "nope"], false);
    assert_eq!(
        removed[0].as_ref().unwrap_err().code(),
        Code::ObjectHasLease
    );
    assert_eq!(
        removed[1].as_ref().unwrap_err().code(),
        Code::ObjectNotFound
    );
    assert!(c.batch_remove(&["z"], true)[0].is_ok());
    assert!(!c.exists("z").unwrap());
    c.health().unwrap();
}

/// A node given no metadata URL asks the master, whose metadata server is on a port of
/// its own choosing (not 8080): a pure client then reads what was stored on the node.
#[test]
fn a_node_without_metadata_uses_the_masters_metadata_server() {
    let s = server(10_000);
    let url = s.metadata_url().unwrap();
    assert_eq!(
        mooncake::store::metadata_of_master(&s.rpc_addr().to_string(), None).unwrap(),
        url
    );
    let _node = NodeProcess::spawn_with(&s, "16M", &[]);
    let c = client(&s, 0);
    let v = value(3, 300_000);
    c.put("from-node", &v, &ReplicateConfig::default()).unwrap();
    assert_eq!(c.get("from-node").unwrap(), v);

    // A master without a metadata server says so instead of a guess.
    let quiet = MasterServer::start(ServerConfig {
        rpc_port: 0,
        metadata_port: None,
        metrics_port: None,
        ..Default::default()
    })
    .unwrap();
    let e = mooncake::store::metadata_of_master(&quiet.rpc_addr().to_string(), None).unwrap_err();
    assert!(e.to_string().contains("runs no metadata server"), "{e}");
}

/// A key far over the limit is refused with a message that quotes only its start.
#[test]
fn an_oversized_key_is_cut_in_the_error() {
    let s = server(10_000);
    let _n = client(&s, 8 * MIB);
    let c = client(&s, 0);
    let key = "k".repeat(1 << 20);
    let e = c
        .put(&key, b"value", &ReplicateConfig::default())
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidKey);
    let text = e.to_string();
    assert!(text.len() < 400, "{} bytes of error text", text.len());
    assert!(text.contains(&format!("({} bytes)", 1 << 20)), "{text}");
    let e = c.get(&key).unwrap_err();
    assert!(e.to_string().len() < 400);
}

/// A master restarted on the same address: the node remounts and republishes its
/// descriptor (the new master's embedded metadata server starts empty), so new puts
/// and gets work again, from new clients too, without restarting the node; and the
/// node's catalog gives the new master every object committed before.
#[test]
fn a_restarted_master_is_usable_again_without_restarting_nodes() {
    let first = server(10_000);
    let (rpc_port, meta_url) = (first.rpc_addr().port(), first.metadata_url().unwrap());
    let meta_port = port_of(&meta_url);
    let rpc_addr = first.rpc_addr().to_string();
    let fast = |segment| ClientConfig {
        global_segment_size: segment,
        ping_interval: Duration::from_millis(50),
        ..ClientConfig::connect(&rpc_addr, &meta_url, "tcp").unwrap()
    };
    let _node = Client::new(fast(32 * MIB)).unwrap();
    let c = Client::new(fast(0)).unwrap();
    let cfg = ReplicateConfig::default();
    // Objects of many sizes, one of them striped (larger than a slab of this
    // segment), one hard-pinned; one removed again.
    let sizes = |i: u64| match i {
        0 => 600_000,
        _ => 1000 + 977 * i as usize,
    };
    let pinned = ReplicateConfig {
        hard_pin: true,
        ..Default::default()
    };
    for i in 0..40u64 {
        let config = if i == 7 { &pinned } else { &cfg };
        c.put(&format!("before-{i}"), &value(i, sizes(i)), config)
            .unwrap();
    }
    c.remove("before-39", false).unwrap();
    drop(c);
    drop(first);

    let second = MasterServer::start(ServerConfig {
        rpc_port,
        metadata_port: Some(meta_port),
        metrics_port: Some(0),
        ..Default::default()
    })
    .expect("the old ports are free again");
    // A client that never saw the node needs its descriptor from the new master's
    // metadata server. The node remounts at its next ping; until then puts fail.
    let c = Client::new(fast(0)).unwrap();
    let v = value(2, 50_000);
    let mut last = None;
    for attempt in 0..400 {
        match c.put(&format!("after-{attempt}"), &v, &cfg) {
            Ok(()) => {
                last = Some(attempt);
                break;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(25)),
        }
    }
    let attempt = last.expect("puts work again after the node remounted");
    assert_eq!(c.get(&format!("after-{attempt}")).unwrap(), v);
    // What was committed before the restart came back with the node's remount,
    // byte for byte; what was removed did not.
    for i in 0..39u64 {
        let got = c
            .get(&format!("before-{i}"))
            .unwrap_or_else(|e| panic!("before-{i}: {e}"));
        assert!(got == value(i, sizes(i)), "before-{i} bytes");
    }
    assert_eq!(c.get("before-39").unwrap_err().code(), Code::ObjectNotFound);
    // And keep working: the descriptor is there, not just a lucky first call.
    for i in 0..20 {
        let v = value(100 + i, 4096 + i as usize);
        c.put(&format!("more-{i}"), &v, &cfg).unwrap();
        assert_eq!(c.get(&format!("more-{i}")).unwrap(), v);
    }
    drop(second);
}

/// Issue 28, item 5: a get during a master's restart is answered with the object, not
/// a miss. The restarted master starts empty; until the node holding the object
/// remounts, it answers lookups that miss with "ask again" (its recovery window), and
/// the reader waits for the node instead of reporting a miss. Once the window has
/// passed, a key nobody put is a plain miss again.
#[test]
fn a_get_while_the_master_restarts_waits_for_the_nodes_remount() {
    let recovering = |rpc_port, metadata_port| {
        let mut cfg = ServerConfig {
            bind: "127.0.0.1".parse().unwrap(),
            rpc_port,
            metadata_port: Some(metadata_port),
            metrics_port: None,
            ..Default::default()
        };
        cfg.master.recovery_window = Duration::from_secs(2);
        MasterServer::start(cfg)
    };
    let first = recovering(0, 0).unwrap();
    let rpc_port = first.rpc_addr().port();
    let meta_url = first.metadata_url().unwrap();
    let meta_port = port_of(&meta_url);
    let rpc_addr = first.rpc_addr().to_string();
    let config = |segment| ClientConfig {
        global_segment_size: segment,
        ping_interval: Duration::from_millis(200),
        ..ClientConfig::connect(&rpc_addr, &meta_url, "tcp").unwrap()
    };
    let _node = Client::new(config(32 * MIB)).unwrap();
    let writer = Client::new(config(0)).unwrap();
    let v = value(5, 100_000);
    writer.put("kept", &v, &ReplicateConfig::default()).unwrap();
    drop(writer);
    drop(first);

    let _second = recovering(rpc_port, meta_port).expect("the old ports are free again");
    // Asked at once: the node has not remounted yet (it learns at its next ping).
    let reader = Client::new(config(0)).unwrap();
    assert_eq!(
        reader
            .get("kept")
            .expect("the object, once its node is back"),
        v
    );
    assert_eq!(
        reader.get("never-put").unwrap_err().code(),
        Code::ObjectNotFound
    );
}
