//! The handshake RPC port against malformed frames, and the replies Mooncake peers expect.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::engine_with;
use mooncake::json;
use mooncake::wire::rpc::{self, RpcType, MAX_FRAME_LEN};

fn rpc_port(name: &str) -> u16 {
    name.rsplit_once(':').unwrap().1.parse().unwrap()
}

fn conn(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn closed_without_reply(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn malformed_frames_close_only_that_connection() {
    let e = engine_with("P2PHANDSHAKE", "tcp");
    let port = rpc_port(e.segment_name());
    let mut bad: Vec<(&str, Vec<u8>)> = vec![
        ("length 0", 0u64.to_le_bytes().to_vec()),
        ("oversized", (MAX_FRAME_LEN + 1).to_le_bytes().to_vec()),
        ("unknown type", rpc::encode(RpcType::Probe, "{}")),
        ("not json", rpc::encode(RpcType::Notify, "{nope")),
        (
            "notify without message",
            rpc::encode(RpcType::Notify, r#"{"name":"x"}"#),
        ),
        ("not utf-8", vec![3, 0, 0, 0, 0, 0, 0, 0, 2, 0xff, 0xfe]),
    ];
    bad[2].1[8] = 42;
    for (what, frame) in bad {
        let mut s = conn(port);
        s.write_all(&frame).unwrap();
        assert!(closed_without_reply(&mut s), "{what}");
    }
    // A truncated frame: announced 100 bytes, sent 5, then half-closed.
    let mut s = conn(port);
    s.write_all(&101u64.to_le_bytes()).unwrap();
    s.write_all(&[1, b'{', b'"', b'a', b'"']).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(closed_without_reply(&mut s));
    // Still serving, and nothing was queued by the bad notify.
    let reply = rpc::call(
        e.segment_name(),
        RpcType::Probe,
        "{}",
        Duration::from_secs(5),
        None,
    )
    .unwrap();
    assert_eq!(reply, r#"{"status":"success"}"#);
    assert!(e.take_notifications().is_empty());
}

#[test]
fn replies_match_mooncake_shapes() {
    let e = engine_with("P2PHANDSHAKE", "tcp");
    let t = Duration::from_secs(5);
    let notify = rpc::call(
        e.segment_name(),
        RpcType::Notify,
        r#"{"name":"peer","notify_msg":"hi"}"#,
        t,
        None,
    )
    .unwrap();
    assert_eq!(notify, r#"{"name":"","notify_msg":"success"}"#);
    let meta = json::parse(&rpc::call(e.segment_name(), RpcType::Metadata, "{}", t, None).unwrap())
        .unwrap();
    assert_eq!(
        meta.get("name").and_then(|v| v.as_str()),
        Some(e.segment_name())
    );
    assert_eq!(
        meta.get("tcp_proto_version").and_then(|v| v.as_u64()),
        Some(2)
    );
    assert!(meta
        .get("tcp_data_port")
        .and_then(|v| v.as_u64())
        .is_some_and(|p| p > 0));
    assert!(meta.get("buffers").and_then(|v| v.as_array()).is_some());
    let conn_req = r#"{"local_nic_path":"a@mlx5_0","local_lid":1,"local_gid":"00","peer_nic_path":"b@mlx5_0","qp_num":[1],"ready_ack":false,"reply_msg":""}"#;
    let reply =
        json::parse(&rpc::call(e.segment_name(), RpcType::Connection, conn_req, t, None).unwrap())
            .unwrap();
    assert!(
        !reply
            .get("reply_msg")
            .and_then(|v| v.as_str())
            .unwrap_or("")
            .is_empty(),
        "rejected without RDMA"
    );
}
