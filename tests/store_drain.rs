//! Nodes leaving mid-replay without losing anything: one drained through the
//! master's admin endpoint (`POST /drain?segment=NAME`), one that exits in an orderly
//! way (end of stdin, as SIGTERM); every object committed before is still readable,
//! byte for byte, from the nodes that stay. A node that joins mid-replay takes puts.

mod common;

use std::process::Command;
use std::time::Duration;

use common::cprog::Proc;
use common::pattern;
use mooncake::http::HttpClient;
use mooncake::store::protocol::{ReplicateConfig, Request, Response, SegmentInfo};
use mooncake::store::{Client, ClientConfig, MasterServer, ServerConfig};

const BIN: &str = env!("CARGO_BIN_EXE_mooncake");
const LIMIT: Duration = Duration::from_secs(60);

fn node(s: &MasterServer) -> (Proc, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["node", "--master", &s.rpc_addr().to_string()])
        .args(["--metadata", &s.metadata_url().unwrap()])
        .args(["--segment-size", "32M", "--protocol", "tcp"])
        .arg("--until-stdin-eof");
    let mut p = Proc::spawn("node", &mut cmd);
    let ready = p.ready();
    let name = ready.trim_start_matches("ready ").trim().to_owned();
    (p, name)
}

fn size(i: u64) -> usize {
    3000 + (i as usize % 11) * 2000
}

#[test]
fn nodes_drained_mid_replay_lose_nothing() {
    let s = MasterServer::start(ServerConfig {
        rpc_port: 0,
        metadata_port: Some(0),
        metrics_port: Some(0),
        ..Default::default()
    })
    .unwrap();
    let (mut a, a_name) = node(&s);
    let (mut b, _) = node(&s);
    let (_c, _) = node(&s);
    let client = Client::new(
        ClientConfig::connect(&s.rpc_addr().to_string(), &s.metadata_url().unwrap(), "tcp")
            .unwrap(),
    )
    .unwrap();
    let one = ReplicateConfig::default();
    let admin = HttpClient::new(&format!("http://{}", s.admin_addr().unwrap())).unwrap();
    let all_readable = |n: u64| {
        (0..n).all(|i| {
            client
                .get(&format!("o{i}"))
                .is_ok_and(|v| v == pattern(i, size(i)))
        })
    };
    let mut joined = None;
    for i in 0..300u64 {
        if i == 100 {
            // Through the master: the node moves its objects, then unmounts.
            let (status, body) = admin
                .request("POST", &format!("/drain?segment={a_name}"), b"")
                .unwrap();
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            let (status, _) = admin.request("POST", "/drain?segment=nobody", b"").unwrap();
            assert_eq!(status, 404);
        }
        if i == 150 {
            joined = Some(node(&s));
        }
        if i == 200 {
            // An orderly exit drains too.
            let out = b.finish(LIMIT);
            assert!(out.status.success(), "{}", out.stderr);
            assert!(out.stderr.contains("drained:"), "{}", out.stderr);
        }
        // Puts never fail: a draining node takes nothing new, the others take it all.
        client
            .put(&format!("o{i}"), &pattern(i, size(i)), &one)
            .unwrap_or_else(|e| panic!("o{i}: {e}"));
    }
    // The admin drain ran beside the replay; it ends with the segment gone.
    let mut gone = false;
    for _ in 0..600 {
        if s.master()
            .all_segments()
            .iter()
            .all(|(info, _, _)| info.name != a_name)
        {
            gone = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if !gone {
        let out = a.finish(LIMIT);
        panic!("node A did not unmount after its drain:\n{}", out.stderr);
    }
    // Left: C, and D, which joined mid-replay and took puts at once.
    let (_d, d_name) = joined.expect("D joined");
    let segments = s.master().all_segments();
    assert_eq!(segments.len(), 2);
    let d_used = segments
        .iter()
        .find(|(info, _, _)| info.name == d_name)
        .map_or(0, |(_, _, used)| *used);
    assert!(d_used > 0, "the node that joined took new puts");
    assert!(all_readable(300), "every object survived both drains");
    let out = a.finish(LIMIT);
    assert!(out.status.success(), "{}", out.stderr);
}

/// Mounts segment `name` of `client` straight on the master (no node behind it: the
/// drain's refusal is decided before any node is asked to move a byte).
fn mount(s: &MasterServer, client: u64, name: &str, size: u64) {
    let segment = SegmentInfo {
        name: name.into(),
        base: 1 << 40,
        size,
    };
    s.master()
        .handle(Request::Mount { client, segment })
        .unwrap();
}

/// Puts `key` (`size` bytes, one replica) through the master alone.
fn put(s: &MasterServer, client: u64, key: &str, size: u64) {
    let config = ReplicateConfig::default();
    let started = s.master().handle(Request::PutStart {
        client,
        items: vec![(key.to_owned(), size)],
        config,
        upsert: false,
    });
    assert!(
        matches!(started, Ok(Response::PutStart(ref r)) if r[0].is_ok()),
        "{started:?}"
    );
    let ended = s.master().handle(Request::PutEnd {
        client,
        items: vec![(key.to_owned(), 0)],
    });
    assert!(
        matches!(ended, Ok(Response::PerKey(ref r)) if r[0].is_ok()),
        "{ended:?}"
    );
}

#[test]
fn a_drain_that_would_lose_objects_is_refused_unless_forced() {
    let s = MasterServer::start(ServerConfig {
        rpc_port: 0,
        metadata_port: None,
        metrics_port: Some(0),
        ..Default::default()
    })
    .unwrap();
    let admin = HttpClient::new(&format!("http://{}", s.admin_addr().unwrap())).unwrap();
    let drain = |query: &str| {
        let (status, body) = admin
            .request("POST", &format!("/drain?{query}"), b"")
            .unwrap();
        (status, String::from_utf8_lossy(&body).into_owned())
    };
    const MIB: u64 = 1 << 20;
    mount(&s, 1, "only", 64 * MIB);
    for i in 0..3 {
        put(&s, 1, &format!("k{i}"), 100_000);
    }
    // The last node: its objects have nowhere to go.
    let (status, why) = drain("segment=only");
    assert_eq!(status, 409, "{why}");
    assert!(
        why.contains("only") && why.contains("3 objects") && why.contains("300000 bytes"),
        "{why}"
    );
    // Refused means unchanged: the segment still takes puts.
    put(&s, 1, "after refusal", 100_000);
    let (status, why) = drain("segment=only&force=maybe");
    assert_eq!(status, 400, "{why}");

    // With room on another node the drain goes ahead, and puts go there.
    mount(&s, 2, "spare", 64 * MIB);
    let (status, answer) = drain("segment=only");
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("\"objects_at_risk\":0"), "{answer}");
    put(&s, 2, "on spare", 100_000);

    // Now "spare" is the last segment taking replicas (a draining one takes none).
    let (status, why) = drain("segment=spare");
    assert_eq!(status, 409, "{why}");
    assert!(
        why.contains("1 objects") && why.contains("room for 0 bytes"),
        "{why}"
    );
    // Forced, it drains and says what it puts at risk.
    let (status, answer) = drain("segment=spare&force=1");
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer.contains("\"objects_at_risk\":1") && answer.contains("\"bytes_at_risk\":100000"),
        "{answer}"
    );
}

/// A node run as a service (no `--until-stdin-eof`: it waits for a signal) that the
/// master drains through its admin port leaves by itself, exiting 0, instead of
/// staying alive with nothing to lend.
#[test]
fn a_node_drained_through_the_admin_port_exits() {
    let s = MasterServer::start(ServerConfig {
        rpc_port: 0,
        metadata_port: Some(0),
        metrics_port: Some(0),
        ..Default::default()
    })
    .unwrap();
    let mut cmd = Command::new(BIN);
    cmd.args(["node", "--master", &s.rpc_addr().to_string()])
        .args(["--metadata", &s.metadata_url().unwrap()])
        .args(["--segment-size", "16M", "--protocol", "tcp"]);
    let mut p = Proc::spawn("node", &mut cmd);
    let name = p.ready().trim_start_matches("ready ").trim().to_owned();
    let admin = HttpClient::new(&format!("http://{}", s.admin_addr().unwrap())).unwrap();
    let (status, body) = admin
        .request("POST", &format!("/drain?segment={name}"), b"")
        .unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    // `finish` kills it after LIMIT if it does not leave by itself.
    let out = p.finish(LIMIT);
    assert!(out.status.success(), "{:?}\n{}", out.status, out.stderr);
    assert!(
        out.stderr.contains("drained as the master asked"),
        "{}",
        out.stderr
    );
}
