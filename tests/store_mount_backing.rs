//! Issue 28, item 10: a mount counts only once the master read the segment. A client
//! that lends memory no process backs (a "phantom" segment, which puts would be placed
//! in and fail on), or more than its node registered, is refused with the reason and
//! the pool does not change; real nodes mount as before.

use std::time::Duration;

use mooncake::engine::{Engine, EngineConfig, Protocol};
use mooncake::store::protocol::{ReplicateConfig, Request, SegmentInfo};
use mooncake::store::rpc::RpcClient;
use mooncake::store::segment_reach::VerifyMounts;
use mooncake::store::{Client, ClientConfig, MasterServer, ServerConfig};
use mooncake::Code;

const MIB: u64 = 1 << 20;

fn master() -> MasterServer {
    MasterServer::start(ServerConfig {
        rpc_port: 0,
        metadata_port: Some(0),
        metrics_port: None,
        verify_mounts: VerifyMounts::Auto,
        ..ServerConfig::default()
    })
    .unwrap()
}

/// Bytes lent to the pool, over every mounted segment.
fn pool_bytes(s: &MasterServer) -> u64 {
    s.master().all_segments().iter().map(|seg| seg.0.size).sum()
}

fn mount(rpc: &RpcClient, client: u64, segment: SegmentInfo) -> mooncake::Result<()> {
    rpc.call(&Request::Mount { client, segment }).map(drop)
}

#[test]
fn a_segment_the_master_cannot_read_is_refused_and_real_nodes_mount() {
    let s = master();
    let metadata = s.metadata_url().unwrap();
    let node = Client::new(ClientConfig {
        global_segment_size: 4 * MIB,
        ping_interval: Duration::from_millis(100),
        ..ClientConfig::connect(&s.rpc_addr().to_string(), &metadata, "tcp").unwrap()
    })
    .unwrap();
    assert_eq!(
        pool_bytes(&s),
        4 * MIB,
        "the node's segment was read and counted"
    );
    node.put("k", b"backed", &ReplicateConfig::default())
        .unwrap();
    assert_eq!(node.get("k").unwrap(), b"backed");

    let rpc = RpcClient::new(&s.rpc_addr().to_string(), None).unwrap();
    let client = 0x6_0057;
    rpc.call(&Request::Ping { client }).unwrap();
    // A name nothing published, and a terabyte behind it.
    let ghost = SegmentInfo {
        name: "ghost".into(),
        base: 1 << 40,
        size: 1 << 40,
    };
    let e = mount(&rpc, client, ghost).unwrap_err();
    assert_eq!(e.code(), Code::InvalidParams, "{e}");
    assert!(e.to_string().contains("could not read"), "{e}");

    // A real engine's buffer, claimed larger than it is: its last byte is not there.
    let engine = Engine::new(EngineConfig {
        metadata: metadata.clone(),
        bind_address: [127, 0, 0, 1].into(),
        rpc_port: 0,
        protocol: Protocol::Tcp,
        ..EngineConfig::default()
    })
    .unwrap();
    let base = engine.allocate_buffer(MIB as usize, "cpu:0").unwrap() as u64;
    let name = engine.segment_name().to_owned();
    let inflated = SegmentInfo {
        name: name.clone(),
        base,
        size: 2 * MIB,
    };
    let e = mount(&rpc, client, inflated).unwrap_err();
    assert_eq!(e.code(), Code::InvalidParams, "{e}");
    assert_eq!(pool_bytes(&s), 4 * MIB, "nothing refused was counted");

    // The same buffer at its true size is backed: it counts.
    let honest = SegmentInfo {
        name,
        base,
        size: MIB,
    };
    mount(&rpc, client, honest).unwrap();
    assert_eq!(pool_bytes(&s), 5 * MIB);
}
