//! Transfers against other processes: same-host shared memory, HTTP metadata, peers
//! that die or misbehave mid-transfer.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

use common::{engine_with, pattern, Target};
use mooncake::engine::TaskState;
use mooncake::json::Value;
use mooncake::metadata::http_server::MetadataServer;
use mooncake::metadata::SegmentDesc;
use mooncake::wire::data::{Header, Status, HEADER_LEN};
use mooncake::wire::rpc::{self, MAX_FRAME_LEN};
use mooncake::{Code, Engine, EngineConfig, Op, Request};

const WAIT: Option<Duration> = Some(Duration::from_secs(30));

/// Writes a pattern to the whole target buffer, reads it back, compares.
fn write_then_read(engine: &Engine, name: &str, len: usize) {
    let seg = engine.open_segment(name).unwrap();
    let remote = engine.segment_descriptor(seg).unwrap().buffers[0].addr;
    let src = pattern(42, len);
    let mut back = vec![0u8; len];
    let b = engine.allocate_batch(2).unwrap();
    let w = Request {
        op: Op::Write,
        local: src.as_ptr() as u64,
        segment: seg,
        remote,
        len: len as u64,
    };
    // SAFETY: buffers outlive the waits.
    unsafe { engine.submit(b, &[w]) }.unwrap();
    engine.wait_batch(b, WAIT).unwrap();
    let r = Request {
        op: Op::Read,
        local: back.as_mut_ptr() as u64,
        ..w
    };
    // SAFETY: as above.
    unsafe { engine.submit(b, &[r]) }.unwrap();
    engine.wait_batch(b, WAIT).unwrap();
    assert!(back == src, "bytes read back equal bytes written");
    assert_eq!(engine.task_status(b, 1).unwrap().bytes, len as u64);
}

#[test]
fn shared_memory_between_processes() {
    let target = Target::spawn("P2PHANDSHAKE", 40 << 20);
    let e = engine_with("P2PHANDSHAKE", "shm");
    write_then_read(&e, &target.name, 40 << 20);
}

#[test]
fn auto_picks_shared_memory_tcp_stays_on_tcp() {
    let target = Target::spawn("P2PHANDSHAKE", 3 << 20);
    let auto = engine_with("P2PHANDSHAKE", "auto");
    write_then_read(&auto, &target.name, 3 << 20);
    let s = auto.stats();
    assert_eq!((s.shm_bytes, s.tcp_bytes), (6 << 20, 0), "{s:?}");
    let tcp = engine_with("P2PHANDSHAKE", "tcp");
    write_then_read(&tcp, &target.name, 3 << 20);
    let s = tcp.stats();
    assert_eq!((s.shm_bytes, s.tcp_bytes), (0, 6 << 20), "{s:?}");
}

#[test]
fn shared_memory_refused_falls_back_to_tcp() {
    let target = Target::spawn("P2PHANDSHAKE", 1 << 20);
    let probe = engine_with("P2PHANDSHAKE", "tcp");
    let seg = probe.open_segment(&target.name).unwrap();
    let mut desc = probe.segment_descriptor(seg).unwrap();
    // A same-host peer whose guard page cannot be opened (as under a container policy).
    let rpc_l = TcpListener::bind("127.0.0.1:0").unwrap();
    desc.name = rpc_l.local_addr().unwrap().to_string();
    desc.host.as_mut().unwrap().guard_fd = 999_999;
    let text = desc.to_json().to_string();
    let h = std::thread::spawn(move || {
        let (mut s, _) = rpc_l.accept().unwrap();
        let (kind, _) = rpc::read_frame(&mut s, MAX_FRAME_LEN).unwrap();
        rpc::write_frame(&mut s, kind, &text).unwrap();
    });
    let auto = engine_with("P2PHANDSHAKE", "auto");
    write_then_read(&auto, &desc.name, 1 << 20);
    h.join().unwrap();
    let s = auto.stats();
    assert_eq!((s.shm_bytes, s.tcp_bytes), (0, 2 << 20), "{s:?}");
    assert!(s.retries >= 1, "{s:?}");
}

#[test]
fn http_metadata_server_between_processes() {
    let server = MetadataServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
    let target = Target::spawn(&server.url(), 1 << 20);
    let e = engine_with(&server.url(), "tcp");
    write_then_read(&e, &target.name, 1 << 20);
    assert_eq!(
        e.open_segment("no-such-segment").unwrap_err().code(),
        Code::SegmentNotFound
    );
}

#[test]
fn killed_peer_fails_tasks_without_hanging() {
    let mut target = Target::spawn("P2PHANDSHAKE", 64 << 20);
    let e = engine_with("P2PHANDSHAKE", "tcp");
    let seg = e.open_segment(&target.name).unwrap();
    let remote = e.segment_descriptor(seg).unwrap().buffers[0].addr;
    let mut local = vec![0u8; 64 << 20];
    let b = e.allocate_batch(1).unwrap();
    let r = Request {
        op: Op::Read,
        local: local.as_mut_ptr() as u64,
        segment: seg,
        remote,
        len: 64 << 20,
    };
    // SAFETY: `local` outlives the wait.
    unsafe { e.submit(b, &[r]) }.unwrap();
    target.kill();
    // Either it finished before the kill or it fails; it never hangs.
    match e.wait_batch(b, WAIT) {
        Ok(()) => assert_eq!(e.task_status(b, 0).unwrap().state, TaskState::Completed),
        Err(err) => {
            assert_eq!(err.code(), Code::TransferFail, "{err}");
            assert_eq!(e.task_status(b, 0).unwrap().state, TaskState::Failed);
        }
    }
    // Later requests to the dead peer fail cleanly too.
    let b2 = e.allocate_batch(1).unwrap();
    // SAFETY: as above.
    unsafe { e.submit(b2, &[Request { len: 4096, ..r }]) }.unwrap();
    assert_eq!(
        e.wait_batch(b2, WAIT).unwrap_err().code(),
        Code::TransferFail
    );
    e.free_batch(b).unwrap();
}

/// A fake peer: answers the P2P handshake with a descriptor of one buffer at `addr`,
/// and runs `data` on the first data connection.
fn fake_peer(
    data: impl FnOnce(std::net::TcpStream) + Send + 'static,
) -> (String, std::thread::JoinHandle<()>) {
    let rpc_l = TcpListener::bind("127.0.0.1:0").unwrap();
    let data_l = TcpListener::bind("127.0.0.1:0").unwrap();
    let name = rpc_l.local_addr().unwrap().to_string();
    let desc = Value::object([
        ("name", Value::from(name.as_str())),
        ("protocol", "tcp".into()),
        ("tcp_data_port", data_l.local_addr().unwrap().port().into()),
        ("tcp_proto_version", 2u64.into()),
        (
            "buffers",
            vec![Value::object([
                ("name", Value::from("cpu:0")),
                ("addr", (1u64 << 20).into()),
                ("length", (1u64 << 20).into()),
            ])]
            .into(),
        ),
    ])
    .to_string();
    let h = std::thread::spawn(move || {
        let (mut s, _) = rpc_l.accept().unwrap();
        let (kind, _) = rpc::read_frame(&mut s, MAX_FRAME_LEN).unwrap();
        rpc::write_frame(&mut s, kind, &desc).unwrap();
        let (conn, _) = data_l.accept().unwrap();
        data(conn);
    });
    (name, h)
}

fn read_from_fake(name: &str, timeout_ms: &str) -> (mooncake::Result<()>, TaskState, u64) {
    let mut cfg = EngineConfig::default();
    cfg.set("protocol", "tcp").unwrap();
    cfg.set("transfer_timeout_ms", timeout_ms).unwrap();
    cfg.set("max_retries", "0").unwrap();
    let e = Engine::new(cfg).unwrap();
    let seg = e.open_segment(name).unwrap();
    let mut local = vec![0u8; 1 << 20];
    let b = e.allocate_batch(1).unwrap();
    let r = Request {
        op: Op::Read,
        local: local.as_mut_ptr() as u64,
        segment: seg,
        remote: 1 << 20,
        len: 1 << 20,
    };
    // SAFETY: `local` outlives the wait.
    unsafe { e.submit(b, &[r]) }.unwrap();
    let res = e.wait_batch(b, WAIT);
    let st = e.task_status(b, 0).unwrap();
    (res, st.state, st.bytes)
}

#[test]
fn peer_dying_mid_payload_fails_the_task() {
    let (name, h) = fake_peer(|mut s| {
        let mut hdr = [0u8; HEADER_LEN];
        s.read_exact(&mut hdr).unwrap();
        assert_eq!(Header::decode(&hdr).unwrap().size, 1 << 20);
        s.write_all(&Status::Ok.encode()).unwrap();
        s.write_all(&vec![1u8; 1000]).unwrap();
        // ...and the peer dies.
    });
    let (res, state, bytes) = read_from_fake(&name, "30000");
    h.join().unwrap();
    assert_eq!(res.unwrap_err().code(), Code::TransferFail);
    assert_eq!((state, bytes), (TaskState::Failed, 0));
}

#[test]
fn garbage_status_is_a_protocol_failure() {
    let (name, h) = fake_peer(|mut s| {
        let mut hdr = [0u8; HEADER_LEN];
        s.read_exact(&mut hdr).unwrap();
        s.write_all(&[0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 0]).unwrap();
        let _ = s.read(&mut [0u8; 1]);
    });
    let (res, state, _) = read_from_fake(&name, "30000");
    h.join().unwrap();
    assert!(res.is_err());
    assert_eq!(state, TaskState::Failed);
}

#[test]
fn silent_peer_times_out() {
    let (name, h) = fake_peer(|mut s| {
        // Read the request, never answer; return when the client gives up.
        let _ = s.read(&mut [0u8; 64]);
        let _ = s.read(&mut [0u8; 64]);
    });
    let (res, state, _) = read_from_fake(&name, "300");
    h.join().unwrap();
    assert_eq!(res.unwrap_err().code(), Code::TransferFail);
    assert_eq!(state, TaskState::Timeout);
}

#[test]
fn buffer_withdrawn_by_its_owner_is_never_touched_again() {
    for protocol in ["shm", "tcp"] {
        let mut target = Target::spawn("P2PHANDSHAKE", 1 << 20);
        let e = engine_with("P2PHANDSHAKE", protocol);
        write_then_read(&e, &target.name, 1 << 20); // caches descriptor and mappings
        assert_eq!(target.command("unregister"), "unregistered");
        let seg = e.open_segment(&target.name).unwrap();
        let remote = e.segment_descriptor(seg).unwrap().buffers[0].addr; // stale cache
        let src = pattern(9, 4096);
        let b = e.allocate_batch(1).unwrap();
        let w = Request {
            op: Op::Write,
            local: src.as_ptr() as u64,
            segment: seg,
            remote,
            len: 4096,
        };
        // SAFETY: `src` outlives the wait.
        unsafe { e.submit(b, &[w]) }.unwrap();
        let err = e.wait_batch(b, WAIT).unwrap_err();
        assert_eq!(err.code(), Code::TransferFail, "{protocol}: {err}");
        assert_eq!(
            e.task_status(b, 0).unwrap().state,
            TaskState::Failed,
            "{protocol}"
        );
        // After a resync the address is refused up front.
        e.resync_segment(seg).unwrap();
        assert!(e.segment_descriptor(seg).unwrap().buffers.is_empty());
        let b2 = e.allocate_batch(1).unwrap();
        // SAFETY: nothing is submitted on error.
        let err = unsafe { e.submit(b2, &[w]) }.unwrap_err();
        assert_eq!(err.code(), Code::AddressNotRegistered, "{protocol}");
    }
}

/// Start and length of the `[heap]` mapping of process `pid`.
fn heap_of(pid: u32) -> (u64, u64) {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let line = maps.lines().find(|l| l.ends_with("[heap]")).unwrap();
    let range = line.split_whitespace().next().unwrap();
    let (a, b) = range.split_once('-').unwrap();
    let a = u64::from_str_radix(a, 16).unwrap();
    (a, u64::from_str_radix(b, 16).unwrap() - a)
}

/// Answers one descriptor request with `desc`, renamed to the listener's address.
fn serve_descriptor_once(mut desc: SegmentDesc) -> (String, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    desc.name = l.local_addr().unwrap().to_string();
    let text = desc.to_json().to_string();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let (kind, _) = rpc::read_frame(&mut s, MAX_FRAME_LEN).unwrap();
        rpc::write_frame(&mut s, kind, &text).unwrap();
    });
    (desc.name, h)
}

#[test]
fn a_forged_descriptor_cannot_touch_its_victims_memory() {
    let mut victim = Target::spawn("P2PHANDSHAKE", 1 << 20);
    let before = victim.command("checksum");
    let probe = engine_with("P2PHANDSHAKE", "tcp");
    let seg = probe.open_segment(&victim.name).unwrap();
    let honest = probe.segment_descriptor(seg).unwrap();
    let (heap, heap_len) = heap_of(victim.child.id());
    let attacker = engine_with("P2PHANDSHAKE", "shm");
    // A copy of the victim's descriptor, renamed, its buffer moved onto the victim's
    // heap (never registered): as a plain buffer, and still claiming the memfd.
    for shm_fd in [None, honest.buffers[0].shm_fd] {
        let mut forged = honest.clone();
        forged.buffers[0].addr = heap;
        forged.buffers[0].length = heap_len;
        forged.buffers[0].shm_fd = shm_fd;
        let (name, server) = serve_descriptor_once(forged);
        let seg = attacker.open_segment(&name).unwrap();
        server.join().unwrap();
        for op in [Op::Write, Op::Read] {
            let mut local = pattern(3, 4096);
            let req = Request {
                op,
                local: local.as_mut_ptr() as u64,
                segment: seg,
                remote: heap,
                len: 4096,
            };
            // SAFETY: `local` outlives the synchronous call.
            let err = unsafe { attacker.transfer_sync(&[req]) }.unwrap_err();
            assert_eq!(err.code(), Code::TransferFail, "{op:?}: {err}");
            assert!(local == pattern(3, 4096), "{op:?}: nothing was read");
        }
    }
    assert_eq!(attacker.stats().shm_bytes, 0);
    // The victim lives on, its buffer as it was.
    assert!(victim.child.try_wait().unwrap().is_none());
    assert_eq!(victim.command("checksum"), before);
}
