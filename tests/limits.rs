//! Resource limits (issue 10): only known clients may put and their unfinished puts
//! are capped; the master's RPC closes silent and half-sent connections but keeps
//! idle clients; admin HTTP checks methods and bounds `/get_all_keys`; the metadata
//! server refuses puts over its quotas. Every wait is bounded; nothing is timed.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use mooncake::http::HttpClient;
use mooncake::metadata::http_server::MetadataServer;
use mooncake::metadata::quota::MetadataLimits;
use mooncake::store::master::{Clock, Master, MasterConfig};
use mooncake::store::protocol::{ReplicateConfig, Request, Response, SegmentInfo};
use mooncake::store::rpc::RpcClient;
use mooncake::store::{MasterServer, ServerConfig};
use mooncake::{Code, ServerLimits};

const MIB: u64 = 1 << 20;
/// Safety net so a server that never closes fails the test instead of hanging it.
const SAFETY_TIMEOUT: Duration = Duration::from_secs(20);

fn mount(m: &Master, client: u64, name: &str, size: u64) {
    let segment = SegmentInfo {
        name: name.into(),
        base: 1 << 40,
        size,
    };
    m.handle(Request::Mount { client, segment }).unwrap();
}

fn put_start(m: &Master, client: u64, key: &str, size: u64) -> Result<(), Code> {
    put_start_through(|req| m.handle(req), client, key, size)
}

/// One key's PutStart sent through `call` (a master in process, or over RPC).
fn put_start_through(
    call: impl FnOnce(Request) -> mooncake::Result<Response>,
    client: u64,
    key: &str,
    size: u64,
) -> Result<(), Code> {
    let Response::PutStart(mut r) = call(Request::PutStart {
        client,
        items: vec![(key.to_owned(), size)],
        config: ReplicateConfig::default(),
        upsert: false,
    })
    .unwrap() else {
        panic!("wrong answer to PutStart")
    };
    r.pop().unwrap().map(|_| ())
}

fn put_end(m: &Master, client: u64, key: &str) -> Result<(), Code> {
    let Response::PerKey(mut r) = m
        .handle(Request::PutEnd {
            client,
            items: vec![(key.to_owned(), 0)],
        })
        .unwrap()
    else {
        panic!("wrong answer to PutEnd")
    };
    r.pop().unwrap()
}

fn object_state(m: &Master, key: &str) -> Option<bool> {
    m.query(key).map(|(_, complete, _)| complete)
}

#[test]
fn unknown_clients_cannot_put_and_unfinished_bytes_are_capped() {
    let mut cfg = MasterConfig {
        max_unfinished_put_ratio: 0.25,
        ..MasterConfig::default()
    };
    cfg.allocator.slab_size = MIB;
    let m = Master::with_clock(cfg, Clock::manual());
    mount(&m, 1, "node", 16 * MIB); // the cap is 4 MiB of unfinished puts per client
                                    // A client the master never heard of may not put.
    assert_eq!(put_start(&m, 99, "k", MIB), Err(Code::ClientNotFound));
    assert_eq!(object_state(&m, "k"), None);
    assert_eq!(m.stats().used, 0);
    // One that introduced itself (a ping; a mount works too) may.
    m.ping(50);
    put_start(&m, 50, "a", 3 * MIB).unwrap();
    let used = m.stats().used;
    // Over the cap: refused, nothing allocated or recorded.
    assert_eq!(
        put_start(&m, 50, "b", 2 * MIB),
        Err(Code::NoAvailableHandle)
    );
    assert_eq!(object_state(&m, "b"), None);
    assert_eq!(m.stats().used, used);
    // Another client has its own share.
    put_start(&m, 1, "c", 4 * MIB).unwrap();
    // Finishing a put returns its share.
    put_end(&m, 50, "a").unwrap();
    put_start(&m, 50, "b", 2 * MIB).unwrap();
    assert_eq!(object_state(&m, "b"), Some(false));
    // So does revoking one.
    let Response::PerKey(r) = m
        .handle(Request::PutRevoke {
            client: 50,
            keys: vec!["b".into()],
        })
        .unwrap()
    else {
        panic!("wrong answer to PutRevoke")
    };
    assert_eq!(r, vec![Ok(())]);
    put_start(&m, 50, "d", 4 * MIB).unwrap();
}

/// Issue 28, item 10: over the wire the cap is per host, whatever client ids it shows:
/// two ids from one address share one share (two rotated ids once held the pool).
#[test]
fn rotated_client_ids_from_one_host_share_one_quota() {
    let s = master_with(ServerLimits::default());
    let rpc = RpcClient::new(&s.rpc_addr().to_string(), None).unwrap();
    let segment = SegmentInfo {
        name: "node".into(),
        base: 1 << 40,
        size: 16 * MIB,
    };
    rpc.call(&Request::Mount { client: 1, segment }).unwrap();
    rpc.call(&Request::Ping { client: 2 }).unwrap();
    let put_start =
        |client, key: &str, size| put_start_through(|req| rpc.call(&req), client, key, size);
    // The default cap: half of the pool's 16 MiB.
    put_start(1, "a", 6 * MIB).unwrap();
    assert_eq!(put_start(2, "b", 3 * MIB), Err(Code::NoAvailableHandle));
    // Ending the first id's put frees the host's share for the second.
    rpc.call(&Request::PutRevoke {
        client: 1,
        keys: vec!["a".into()],
    })
    .unwrap();
    put_start(2, "b", 3 * MIB).unwrap();
}

fn master_with(connections: ServerLimits) -> MasterServer {
    MasterServer::start(ServerConfig {
        rpc_port: 0,
        metadata_port: None,
        metrics_port: Some(0),
        connections,
        ..ServerConfig::default()
    })
    .unwrap()
}

/// Whether the server closed `s` (end of stream or a reset); a read that merely
/// waited out the safety timeout is not a close.
fn server_closed(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(SAFETY_TIMEOUT)).unwrap();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) => return e.kind() == ErrorKind::ConnectionReset,
        }
    }
}

#[test]
fn master_rpc_closes_silent_and_half_sent_connections_but_serves_idle_clients() {
    let s = master_with(ServerLimits {
        frame_timeout: Duration::from_millis(100),
        ..ServerLimits::default()
    });
    let rpc = RpcClient::new(&s.rpc_addr().to_string(), None).unwrap();
    assert!(matches!(rpc.call(&Request::Stats), Ok(Response::Stats(_))));
    // Connects and never speaks.
    let mut silent = TcpStream::connect(s.rpc_addr()).unwrap();
    assert!(server_closed(&mut silent));
    // Sends the start of a frame (length 20, then only 3 more bytes) and stalls.
    let mut half = TcpStream::connect(s.rpc_addr()).unwrap();
    half.write_all(&[20, 0, 0, 0, 1, 0, 0]).unwrap();
    assert!(server_closed(&mut half));
    // The client's pooled connection sat idle meanwhile; it is still served.
    assert!(matches!(rpc.call(&Request::Stats), Ok(Response::Stats(_))));
}

#[test]
fn master_rpc_times_a_frame_whose_start_came_with_the_one_before() {
    // The master reads ahead: a request and the first bytes of the next can arrive in
    // one read. That next frame's deadline runs from then, not the (long) idle timeout.
    let s = master_with(ServerLimits {
        frame_timeout: Duration::from_millis(100),
        idle_timeout: Duration::from_secs(3600),
        ..ServerLimits::default()
    });
    let stats = mooncake::store::protocol::Method::Stats as u16;
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&12u32.to_le_bytes());
    bytes.extend_from_slice(&mooncake::store::protocol::PROTOCOL_VERSION.to_le_bytes());
    bytes.extend_from_slice(&stats.to_le_bytes());
    bytes.extend_from_slice(&1u64.to_le_bytes());
    // The next frame announces 20 bytes and brings 3.
    bytes.extend_from_slice(&[20, 0, 0, 0, 1, 0, 0]);
    let mut conn = TcpStream::connect(s.rpc_addr()).unwrap();
    conn.write_all(&bytes).unwrap();
    // The first is answered (which proves the connection, so it may idle long) ...
    conn.set_read_timeout(Some(SAFETY_TIMEOUT)).unwrap();
    let mut len = [0u8; 4];
    conn.read_exact(&mut len).unwrap();
    let mut answer = vec![0u8; u32::from_le_bytes(len) as usize];
    conn.read_exact(&mut answer).unwrap();
    assert_eq!(&answer[..2], &1u16.to_le_bytes(), "protocol version");
    assert_eq!(&answer[12..16], &0i32.to_le_bytes(), "status ok");
    // ... and the stalled second is cut at its frame deadline.
    assert!(server_closed(&mut conn));
}

#[test]
fn admin_http_checks_methods_and_bounds_get_all_keys() {
    let s = master_with(ServerLimits::default());
    let m = s.master();
    mount(m, 1, "node", 16 * MIB);
    for i in 0..5 {
        let key = format!("k{i}");
        put_start(m, 1, &key, 4096).unwrap();
        put_end(m, 1, &key).unwrap();
    }
    let admin = HttpClient::new(&format!("http://{}", s.admin_addr().unwrap())).unwrap();
    let call = |method: &str, path: &str| {
        let (status, body) = admin.request(method, path, b"").unwrap();
        (status, String::from_utf8(body).unwrap())
    };
    let (status, all) = call("GET", "/get_all_keys");
    assert_eq!(status, 200);
    let all = mooncake::json::parse(&all).unwrap();
    assert_eq!(all.as_array().map(|a| a.len()), Some(5));
    let (status, some) = call("GET", "/get_all_keys?limit=2");
    assert_eq!(status, 200);
    let some = mooncake::json::parse(&some).unwrap();
    assert_eq!(some.get("truncated").and_then(|v| v.as_bool()), Some(true));
    assert_eq!(some.get("total").and_then(|v| v.as_u64()), Some(5));
    let listed = some.get("keys").and_then(|v| v.as_array()).map(|a| a.len());
    assert_eq!(listed, Some(2));
    assert_eq!(call("GET", "/get_all_keys?limit=many").0, 400);
    for path in ["/health", "/metrics", "/get_all_keys", "/get_all_segments"] {
        for method in ["POST", "PUT", "DELETE"] {
            assert_eq!(call(method, path).0, 405, "{method} {path}");
        }
    }
    assert_eq!(call("GET", "/health"), (200, "OK".to_owned()));
}

#[test]
fn metadata_server_refuses_puts_over_its_quotas() {
    let server = MetadataServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
    server.set_limits(MetadataLimits {
        max_value_bytes: 16,
        max_keys: 2,
        max_total_bytes: 64,
        peer_share_percent: 100,
    });
    let http = HttpClient::new(&server.url()).unwrap();
    let put = |key: &str, value: &str| {
        let path = format!("/metadata?key={key}");
        http.request("PUT", &path, value.as_bytes()).unwrap().0
    };
    let get = |key: &str| {
        let path = format!("/metadata?key={key}");
        http.request("GET", &path, b"").unwrap().0
    };
    assert_eq!(put("big", &"x".repeat(17)), 413);
    assert_eq!(get("big"), 404);
    assert_eq!(put("a", "1"), 200);
    assert_eq!(put("b", "2"), 200);
    assert_eq!(put("c", "3"), 413, "a third key");
    assert_eq!(get("c"), 404);
    assert_eq!(put("a", "replaced"), 200, "replacing needs no new key");
    assert_eq!(server.len(), 2);
}

#[test]
fn one_peer_cannot_fill_the_metadata_store() {
    let server = MetadataServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
    server.set_limits(MetadataLimits {
        max_keys: 40,
        max_total_bytes: 1 << 20,
        ..MetadataLimits::default()
    });
    let http = HttpClient::new(&server.url()).unwrap();
    // One host writes as fast as it can: it gets its share, never the whole store.
    let mut refusal = None;
    for i in 0..40 {
        let (status, body) = http
            .request("PUT", &format!("/metadata?key=k{i}"), b"value")
            .unwrap();
        if status != 200 {
            refusal = Some((status, String::from_utf8_lossy(&body).into_owned()));
            break;
        }
    }
    let (status, why) = refusal.expect("one peer filled the whole metadata store");
    assert_eq!(status, 413, "{why}");
    assert!(why.contains("share"), "{why}");
    assert!(server.len() < 40, "{} keys", server.len());
}
