//! Cluster authentication and per-buffer access, end to end: with a secret every port
//! (TCP data, engine RPC, master RPC, HTTP writes) refuses peers that do not prove it
//! and serves those that do; buffers registered read-only or local are served only as
//! far as their access allows. (Without a secret the wire is unchanged: the interop,
//! wire and store tests cover that.)

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{pattern, Registered, Target};
use mooncake::auth::ClusterSecret;
use mooncake::engine::Access;
use mooncake::http::HttpClient;
use mooncake::metadata::http_server::MetadataServer;
use mooncake::store::protocol::{ReplicateConfig, Request as StoreRequest, Response, SegmentInfo};
use mooncake::store::rpc::RpcClient;
use mooncake::store::{Client, ClientConfig, MasterServer, ServerConfig};
use mooncake::wire::data::{DataOp, Header, Status};
use mooncake::wire::rpc::{self, RpcType};
use mooncake::{Code, Engine, EngineConfig, Op, Request};

const SECRET: &str = "the cluster secret of these tests";
const T: Duration = Duration::from_secs(5);

fn secret(s: &str) -> ClusterSecret {
    ClusterSecret::new(s.as_bytes()).unwrap()
}

fn engine(secret: Option<&str>) -> Engine {
    let mut cfg = EngineConfig::default();
    cfg.set("protocol", "tcp").unwrap();
    cfg.set("cluster_secret", secret.unwrap_or("")).unwrap();
    Engine::new(cfg).expect("engine starts")
}

/// True when the server closed `s` without sending a byte.
fn closed_silently(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut b = [0u8; 64];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

/// One synchronous transfer of all of `local` to or from `remote`.
fn transfer(e: &Engine, op: Op, seg: u64, local: &mut [u8], remote: u64) -> mooncake::Result<()> {
    let r = Request {
        op,
        local: local.as_mut_ptr() as u64,
        segment: seg,
        remote,
        len: local.len() as u64,
    };
    // SAFETY: `local` is registered by the caller and outlives the synchronous call.
    unsafe { e.transfer_sync(&[r]) }
}

fn read(e: &Engine, seg: u64, local: &mut [u8], remote: u64) -> mooncake::Result<()> {
    transfer(e, Op::Read, seg, local, remote)
}

fn write(e: &Engine, seg: u64, local: &mut [u8], remote: u64) -> mooncake::Result<()> {
    transfer(e, Op::Write, seg, local, remote)
}

#[test]
fn engines_sharing_the_secret_transfer_and_others_are_refused_on_every_port() {
    let target = engine(Some(SECRET));
    let remote = Registered::new(&target, pattern(1, 1 << 20));

    // The right secret: descriptor exchange, reads and writes over TCP.
    let peer = engine(Some(SECRET));
    let mut local = Registered::new(&peer, vec![0; 1 << 20]);
    let seg = peer.open_segment(target.segment_name()).unwrap();
    read(&peer, seg, &mut local.buf, remote.addr()).unwrap();
    assert_eq!(local.buf, remote.buf);
    local.buf.copy_from_slice(&pattern(2, 1 << 20));
    write(&peer, seg, &mut local.buf, remote.addr()).unwrap();
    assert_eq!(remote.buf, pattern(2, 1 << 20));
    assert!(peer.stats().tcp_bytes >= 2 << 20);

    // No secret, or another one: the P2P handshake RPC is refused.
    for other in [None, Some("another secret, same length!!")] {
        let stranger = engine(other);
        let e = stranger.open_segment(target.segment_name()).unwrap_err();
        assert_eq!(e.code(), Code::SegmentNotFound, "{e}");
        let s = other.map(secret);
        let e = rpc::call(target.segment_name(), RpcType::Probe, "{}", T, s.as_ref());
        assert!(e.is_err());
    }
    let ok = rpc::call(
        target.segment_name(),
        RpcType::Probe,
        "{}",
        T,
        Some(&secret(SECRET)),
    );
    assert!(ok.unwrap().contains("success"));

    // The data port, spoken to as a Mooncake peer without the secret: a WRITE header
    // and payload, then a READ. Nothing is written, nothing is read.
    let port = target.descriptor().tcp_data_port;
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut out = Header {
        size: 8,
        addr: remote.addr(),
        op: DataOp::Write,
    }
    .encode()
    .to_vec();
    out.extend_from_slice(b"intruder");
    out.extend_from_slice(
        &Header {
            size: 64,
            addr: remote.addr(),
            op: DataOp::Read,
        }
        .encode(),
    );
    let _ = s.write_all(&out);
    assert!(closed_silently(&mut s));
    assert_eq!(remote.buf, pattern(2, 1 << 20));

    // With a wrong secret the handshake itself fails, on the data port as on the RPC.
    let data = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let wrong = secret("another secret, same length!!");
    let e = mooncake::auth::connect(&data, T, Some(&wrong)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    assert!(mooncake::auth::connect(&data, T, Some(&secret(SECRET))).is_ok());

    // A peer that connects and stays silent is refused within the handshake timeout.
    let mut silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    assert!(closed_silently(&mut silent));
}

#[test]
fn a_target_process_with_a_secret_file_serves_only_peers_with_the_secret() {
    let dir = std::env::temp_dir().join(format!("mc-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("secret");
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    let target = Target::spawn_with(
        "P2PHANDSHAKE",
        1 << 20,
        &["--cluster-secret-file", file.to_str().unwrap()],
    );
    let peer = engine(Some(SECRET)); // the file's trailing newline is not the secret's
    let seg = peer.open_segment(&target.name).unwrap();
    let remote = peer.segment_descriptor(seg).unwrap().buffers[0].addr;
    let mut local = Registered::new(&peer, pattern(3, 4096));
    write(&peer, seg, &mut local.buf, remote).unwrap();
    local.buf.fill(0);
    read(&peer, seg, &mut local.buf, remote).unwrap();
    assert_eq!(local.buf, pattern(3, 4096));
    let stranger = engine(None);
    assert!(stranger.open_segment(&target.name).is_err());
    drop(target);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn master(secret: Option<&str>) -> MasterServer {
    MasterServer::start(ServerConfig {
        rpc_port: 0,
        metadata_port: Some(0),
        metrics_port: Some(0),
        cluster_secret: secret.map(self::secret),
        ..Default::default()
    })
    .unwrap()
}

fn store_client(m: &MasterServer, secret: Option<&str>, segment: u64) -> mooncake::Result<Client> {
    let mut cfg =
        ClientConfig::connect(&m.rpc_addr().to_string(), &m.metadata_url().unwrap(), "tcp")?;
    cfg.global_segment_size = segment;
    cfg.engine.set("cluster_secret", secret.unwrap_or(""))?;
    Client::new(cfg)
}

#[test]
fn the_store_works_with_the_secret_and_its_master_refuses_strangers() {
    let m = master(Some(SECRET));
    let _node = store_client(&m, Some(SECRET), 16 << 20).unwrap();
    let c = store_client(&m, Some(SECRET), 0).unwrap();
    let v = pattern(4, 300_000);
    c.put("k", &v, &ReplicateConfig::default()).unwrap();
    assert_eq!(c.get("k").unwrap(), v);
    let before = m.master().stats();
    assert_eq!(before.segments, 1);

    // The master RPC port: no secret or a wrong one cannot even ask for stats, nor
    // mount, remove or put.
    for other in [None, Some(secret("a wrong secret for the master"))] {
        let rpc = RpcClient::new(&m.rpc_addr().to_string(), other).unwrap();
        assert!(rpc.call(&StoreRequest::Stats).is_err());
        let mount = StoreRequest::Mount {
            client: 7,
            segment: SegmentInfo {
                name: "intruder".into(),
                base: 1 << 40,
                size: 64 << 20,
            },
        };
        assert!(rpc.call(&mount).is_err());
    }
    let rpc = RpcClient::new(&m.rpc_addr().to_string(), Some(secret(SECRET))).unwrap();
    assert!(matches!(
        rpc.call(&StoreRequest::Stats),
        Ok(Response::Stats(_))
    ));
    // Clients without the secret fail at set-up (their engine cannot publish to the
    // metadata server, their RPC cannot reach the master).
    assert!(store_client(&m, None, 16 << 20).is_err());
    assert!(store_client(&m, Some("wrong wrong wrong wrong"), 0).is_err());
    let after = m.master().stats();
    assert_eq!(
        (after.segments, after.objects),
        (before.segments, before.objects)
    );
    assert_eq!(c.get("k").unwrap(), v);
}

#[test]
fn http_reads_stay_open_and_writes_need_the_secret() {
    let server =
        MetadataServer::start_with_secret("127.0.0.1:0".parse().unwrap(), Some(secret(SECRET)))
            .unwrap();
    let url = server.url();
    let target = "/metadata?key=a%20key";
    let signed = HttpClient::new(&url)
        .unwrap()
        .with_secret(Some(secret(SECRET)));
    let plain = HttpClient::new(&url).unwrap();
    let wrong = HttpClient::new(&url)
        .unwrap()
        .with_secret(Some(secret("not the metadata secret!")));
    for c in [&plain, &wrong] {
        assert_eq!(c.request("PUT", target, b"forged").unwrap().0, 401);
    }
    assert_eq!(signed.request("PUT", target, b"value").unwrap().0, 200);
    // Reads need nothing (curl keeps working).
    let (status, body) = plain.request("GET", target, b"").unwrap();
    assert_eq!((status, body.as_slice()), (200, &b"value"[..]));
    for c in [&plain, &wrong] {
        assert_eq!(c.request("DELETE", target, b"").unwrap().0, 401);
        assert_eq!(c.request("POST", target, b"forged").unwrap().0, 401);
    }
    assert_eq!(plain.request("GET", target, b"").unwrap().1, b"value");
    assert_eq!(signed.request("DELETE", target, b"").unwrap().0, 200);
    assert_eq!(server.len(), 0);

    // The master's admin HTTP: reads open, anything else needs the proof.
    let m = master(Some(SECRET));
    let admin = format!("http://{}", m.admin_addr().unwrap());
    let plain = HttpClient::new(&admin).unwrap();
    assert_eq!(plain.request("GET", "/health", b"").unwrap().0, 200);
    assert_eq!(plain.request("POST", "/health", b"x").unwrap().0, 401);
}

/// The identity a server with a secret gives in every answer, which proofs name.
fn server_id(addr: std::net::SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    let header = format!("{}: ", mooncake::http::signed::SERVER_HEADER);
    reply
        .lines()
        .find_map(|l| l.strip_prefix(header.as_str()))
        .unwrap_or_else(|| panic!("no identity in {reply}"))
        .to_owned()
}

/// Sends `bytes` to `addr` as one connection and returns all it answers.
fn send_raw(addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(bytes).unwrap();
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    String::from_utf8_lossy(&reply).into_owned()
}

#[test]
fn http_replayed_write_is_refused() {
    let k = secret(SECRET);
    let server =
        MetadataServer::start_with_secret("127.0.0.1:0".parse().unwrap(), Some(k.clone())).unwrap();
    let addr = server.local_addr();
    let query = vec![("key".to_owned(), "r".to_owned())];
    let id = server_id(addr);
    let header = mooncake::http::signed::sign(&k, &id, "PUT", "/metadata", &query, b"v").unwrap();
    let request = format!(
        "PUT /metadata?key=r HTTP/1.1\r\nHost: x\r\n{}: {header}\r\nContent-Length: 1\r\nConnection: close\r\n\r\nv",
        mooncake::http::signed::HEADER
    );
    assert!(send_raw(addr, request.as_bytes()).starts_with("HTTP/1.1 200"));
    let again = send_raw(addr, request.as_bytes());
    assert!(again.starts_with("HTTP/1.1 401"), "{again}");
    assert!(again.contains("replayed"), "{again}");
}

/// A loopback relay in front of `upstream` that records what its one client sends.
fn recording_relay(
    upstream: std::net::SocketAddr,
) -> (std::net::SocketAddr, std::thread::JoinHandle<Vec<u8>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let relay = std::thread::spawn(move || {
        let (mut client, _) = listener.accept().unwrap();
        let mut server = TcpStream::connect(upstream).unwrap();
        for s in [&client, &server] {
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        }
        let (mut from_server, mut to_client) =
            (server.try_clone().unwrap(), client.try_clone().unwrap());
        let answers = std::thread::spawn(move || {
            let _ = std::io::copy(&mut from_server, &mut to_client);
            let _ = to_client.shutdown(std::net::Shutdown::Write);
        });
        let mut recorded = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = client.read(&mut buf) {
            recorded.extend_from_slice(&buf[..n]);
            if server.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = server.shutdown(std::net::Shutdown::Write);
        let _ = answers.join();
        recorded
    });
    (addr, relay)
}

#[test]
fn a_signed_write_replayed_to_another_server_or_after_a_restart_is_refused() {
    let start = |addr: &str| {
        MetadataServer::start_with_secret(addr.parse().unwrap(), Some(secret(SECRET))).unwrap()
    };
    let first = start("127.0.0.1:0");
    let other = start("127.0.0.1:0");
    // A member's signed write, captured on its way to the first server.
    let (relay, recorded) = recording_relay(first.local_addr());
    let client = HttpClient::new(&format!("http://{relay}/metadata"))
        .unwrap()
        .with_secret(Some(secret(SECRET)));
    let (status, _) = client
        .request("PUT", "/metadata?key=captured", b"v")
        .unwrap();
    assert_eq!(status, 200);
    drop(client);
    let captured = recorded.join().unwrap();
    assert_eq!(first.len(), 1);

    // Replayed at once to another server that shares the secret: refused.
    let answer = send_raw(other.local_addr(), &captured);
    assert!(!answer.contains(" 200 "), "{answer}");
    assert_eq!(
        other.len(),
        0,
        "a write for one server was taken by another"
    );

    // Replayed to the first server after it restarts on the same port: refused. (Its
    // socket may linger a moment, or a test running beside this one may take the port:
    // then a new port stands for it, since a server is known by its id, not its port.)
    let addr = first.local_addr();
    drop(first);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let restarted = loop {
        match MetadataServer::start_with_secret(addr, Some(secret(SECRET))) {
            Ok(server) => break server,
            Err(_) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(_) => break start("127.0.0.1:0"),
        }
    };
    let answer = send_raw(restarted.local_addr(), &captured);
    assert!(!answer.contains(" 200 "), "{answer}");
    assert_eq!(
        restarted.len(),
        0,
        "a write from before the restart was taken"
    );
    // A member signing now still writes there (it learns the new identity).
    let client = HttpClient::new(&restarted.url())
        .unwrap()
        .with_secret(Some(secret(SECRET)));
    assert_eq!(
        client
            .request("PUT", "/metadata?key=fresh", b"v")
            .unwrap()
            .0,
        200
    );
    assert_eq!(restarted.len(), 1);
}

#[test]
fn a_blank_cluster_secret_is_refused_at_start() {
    let bin = env!("CARGO_BIN_EXE_mooncake");
    for blank in ["", "  \n"] {
        let mut server = common::cprog::Proc::spawn(
            "metadata-server",
            std::process::Command::new(bin)
                .args(["metadata-server", "--port", "0", "--host", "127.0.0.1"])
                .arg("--until-stdin-eof")
                .env("MC_CLUSTER_SECRET", blank),
        );
        let out = server.finish(T * 6);
        assert!(
            !out.status.success(),
            "started with MC_CLUSTER_SECRET={blank:?}"
        );
        assert!(out.stderr.contains("MC_CLUSTER_SECRET"), "{}", out.stderr);
    }
    assert!(ClusterSecret::new(b" \t\n").is_err());
}

#[test]
fn read_only_and_local_buffers_are_served_only_as_their_access_allows() {
    let owner = engine(None);
    let mut ro = vec![7u8; 4096];
    let mut local_only = vec![9u8; 4096];
    // SAFETY: both vectors outlive the engine's registration (unregistered below).
    unsafe {
        owner
            .register_memory_with_access(ro.as_mut_ptr(), ro.len(), "cpu:0", Access::ReadOnly)
            .unwrap();
        owner
            .register_memory_with_access(
                local_only.as_mut_ptr(),
                local_only.len(),
                "cpu:0",
                Access::LocalOnly,
            )
            .unwrap();
    }
    let (ro_addr, local_addr) = (ro.as_ptr() as u64, local_only.as_ptr() as u64);

    // A cooperating peer: reads the read-only buffer, is told why it may do no more.
    let peer = engine(None);
    let mut buf = Registered::new(&peer, vec![0; 4096]);
    let seg = peer.open_segment(owner.segment_name()).unwrap();
    let desc = peer.segment_descriptor(seg).unwrap();
    let local_desc = desc.buffer_for(local_addr, 1).unwrap();
    assert_eq!(local_desc.access, Access::LocalOnly);
    assert!(local_desc.shm_fd.is_none() && local_desc.rkey.is_empty());
    read(&peer, seg, &mut buf.buf, ro_addr).unwrap();
    assert_eq!(buf.buf, vec![7u8; 4096]);
    buf.buf.fill(1);
    let e = write(&peer, seg, &mut buf.buf, ro_addr).unwrap_err();
    assert_eq!(e.code(), Code::InvalidWrite, "{e}");
    assert!(e.to_string().contains("read-only"), "{e}");
    for e in [
        read(&peer, seg, &mut buf.buf, local_addr).unwrap_err(),
        write(&peer, seg, &mut buf.buf, local_addr).unwrap_err(),
    ] {
        assert_eq!(e.code(), Code::AddressNotRegistered, "{e}");
    }

    // A peer that ignores the descriptor: the data server refuses it all the same.
    let port = owner.descriptor().tcp_data_port;
    let refused = |op: DataOp, addr: u64| {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut out = Header { size: 16, addr, op }.encode().to_vec();
        if op == DataOp::Write {
            out.extend_from_slice(&[0xEE; 16]);
        }
        s.write_all(&out).unwrap();
        let mut status = [0u8; 8];
        s.read_exact(&mut status).unwrap();
        Status::decode(&status).unwrap() == Status::Rejected
    };
    assert!(refused(DataOp::Write, ro_addr));
    assert!(!refused(DataOp::Read, ro_addr));
    assert!(refused(DataOp::Read, local_addr));
    assert!(refused(DataOp::Write, local_addr));
    assert_eq!(ro, vec![7u8; 4096]);
    assert_eq!(local_only, vec![9u8; 4096]);

    // The owner's own transfers through its own segment are not limited.
    let own = owner.open_segment(owner.segment_name()).unwrap();
    let mut mine = Registered::new(&owner, vec![5u8; 16]);
    write(&owner, own, &mut mine.buf, local_addr).unwrap();
    assert_eq!(&local_only[..16], &[5u8; 16]);
    drop(mine);
    owner.unregister_memory(ro.as_mut_ptr()).unwrap();
    owner.unregister_memory(local_only.as_mut_ptr()).unwrap();
}

#[test]
fn the_c_abi_registers_with_access_and_refuses_unknown_values() {
    use mooncake::capi::*;
    use std::ffi::{c_char, CStr};
    let header = std::fs::read_to_string(common::cprog::header_path().join("mooncake.h")).unwrap();
    for (name, access) in [
        ("MC_ACCESS_READ_WRITE", 0),
        ("MC_ACCESS_READ_ONLY", 1),
        ("MC_ACCESS_LOCAL", 2),
    ] {
        assert!(
            header.contains(&format!("#define {name} {access} ")),
            "{name}"
        );
    }
    assert!(
        mc_abi_revision() >= 3,
        "mc_register_memory_with_access came in revision 3"
    );
    let cfg = mc_config_new();
    let mut e = std::ptr::null_mut();
    let mut buf = vec![3u8; 4096];
    let ptr = buf.as_mut_ptr().cast();
    let mut name = [0 as c_char; 128];
    // SAFETY: `cfg` and `e` are live between their creation and free; `buf` outlives its
    // registration; `name` is writable for its length.
    unsafe {
        assert_eq!(
            mc_config_set(cfg, c"protocol".as_ptr(), c"tcp".as_ptr()),
            MC_OK
        );
        assert_eq!(mc_engine_new(cfg, &mut e), MC_OK);
        mc_config_free(cfg);
        let bad = mc_register_memory_with_access(e, ptr, 4096, std::ptr::null(), 3);
        assert_eq!(bad, Code::InvalidParams as i32);
        // Refused without registering: the range is still free.
        assert_eq!(
            mc_register_memory_with_access(e, ptr, 4096, std::ptr::null(), 1),
            MC_OK
        );
        assert_eq!(
            mc_engine_segment_name(e, name.as_mut_ptr(), name.len()),
            MC_OK
        );
    }
    // SAFETY: mc_engine_segment_name wrote a NUL-terminated string into `name`.
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_str()
        .unwrap()
        .to_owned();
    let peer = engine(None);
    let seg = peer.open_segment(&name).unwrap();
    let desc = peer.segment_descriptor(seg).unwrap();
    assert_eq!(
        desc.buffer_for(buf.as_ptr() as u64, 1).unwrap().access,
        Access::ReadOnly
    );
    drop(peer);
    // SAFETY: `e` is live and freed once; `ptr` was registered above.
    unsafe {
        assert_eq!(mc_unregister_memory(e, ptr), MC_OK);
        mc_engine_free(e);
    }
}
