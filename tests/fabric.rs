//! The libfabric transport for real, on loopback: two engines in one process and an
//! engine against a `mooncake target` child, for every provider that offers RMA here
//! (`tcp;ofi_rxm`, `sockets`, `shm` with Debian's libfabric 1.17). Skipped, saying why,
//! where libfabric or such a provider is missing.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::pattern;
use mooncake::engine::TaskState;
use mooncake::{Code, Engine, EngineConfig, Op, Request};

const WAIT: Option<Duration> = Some(Duration::from_secs(30));
/// Providers worth testing here, in the order tried.
const CANDIDATES: &[&str] = &["tcp;ofi_rxm", "sockets", "shm"];
/// Set in the re-executed child of `missing_library_is_backend_unavailable`.
const CHILD_VAR: &str = "MC_FABRIC_TEST_CHILD";

/// Pins every provider to loopback (by default they pick eth0), once, before any
/// engine exists; returns the providers that offer RMA here.
fn providers() -> &'static [String] {
    static P: OnceLock<Vec<String>> = OnceLock::new();
    P.get_or_init(|| {
        for var in ["FI_TCP_IFACE", "FI_SOCKETS_IFACE"] {
            if std::env::var_os(var).is_none() {
                // Set before any engine (or libfabric) starts; the 2021 edition allows it.
                std::env::set_var(var, "lo");
            }
        }
        let lib = match mooncake::ffi::fabric::library() {
            Ok(l) => l,
            Err(e) => {
                eprintln!("skipping libfabric tests: {e}");
                return Vec::new();
            }
        };
        let offered = match mooncake::ffi::fabric::rma_providers(&lib) {
            Ok(list) => list,
            Err(e) => {
                eprintln!("skipping libfabric tests: {e}");
                return Vec::new();
            }
        };
        // MC_FABRIC_TEST_PROVIDERS (comma-separated) replaces the candidates.
        let wanted: Vec<String> = match std::env::var("MC_FABRIC_TEST_PROVIDERS") {
            Ok(list) => list.split(',').map(|p| p.trim().to_owned()).collect(),
            Err(_) => CANDIDATES.iter().map(|c| c.to_string()).collect(),
        };
        let found: Vec<String> = wanted
            .into_iter()
            .filter(|c| offered.iter().any(|(p, _, _)| p == c))
            .collect();
        if found.is_empty() {
            eprintln!(
                "skipping libfabric tests: no RMA provider among {CANDIDATES:?} ({offered:?})"
            );
        }
        found
    })
}

fn config(provider: &str) -> EngineConfig {
    let mut cfg = EngineConfig::default();
    cfg.set("metadata", "P2PHANDSHAKE").unwrap();
    cfg.set("bind_address", "127.0.0.1").unwrap();
    cfg.set("protocol", "efa").unwrap();
    cfg.set("fabric_provider", provider).unwrap();
    // These tests are about libfabric: an unavailable provider must fail, not run TCP.
    cfg.strict_protocol = true;
    cfg
}

fn engine(provider: &str) -> Engine {
    Engine::new(config(provider)).unwrap_or_else(|e| panic!("engine with {provider}: {e}"))
}

/// Memory registered with an engine; unregistered on drop (the Vec outlives that).
struct Buffer<'a> {
    engine: &'a Engine,
    bytes: Vec<u8>,
    registered: bool,
}

impl<'a> Buffer<'a> {
    fn new(engine: &'a Engine, bytes: Vec<u8>) -> Buffer<'a> {
        let mut b = Buffer {
            engine,
            bytes,
            registered: true,
        };
        // SAFETY: the Vec lives in `b` and is unregistered before it is dropped.
        unsafe { engine.register_memory(b.bytes.as_mut_ptr(), b.bytes.len(), "cpu:0") }.unwrap();
        b
    }

    fn addr(&self) -> u64 {
        self.bytes.as_ptr() as u64
    }

    fn unregister(&mut self) {
        if std::mem::take(&mut self.registered) {
            self.engine
                .unregister_memory(self.bytes.as_mut_ptr())
                .unwrap();
        }
    }
}

impl Drop for Buffer<'_> {
    fn drop(&mut self) {
        self.unregister();
    }
}

/// One request in a fresh batch, waited for; returns the final state.
fn run(engine: &Engine, op: Op, local: u64, seg: u64, remote: u64, len: usize) -> TaskState {
    let b = engine.allocate_batch(1).unwrap();
    let r = Request {
        op,
        local,
        segment: seg,
        remote,
        len: len as u64,
    };
    // SAFETY: every caller keeps `local` alive across the wait below.
    unsafe { engine.submit(b, &[r]) }.unwrap();
    let waited = engine.wait_batch(b, WAIT);
    let state = engine.task_status(b, 0).unwrap().state;
    if state == TaskState::Completed {
        waited.unwrap();
    } else {
        assert!(
            matches!(state, TaskState::Failed | TaskState::Timeout),
            "{state:?}"
        );
        assert_ne!(
            waited.as_ref().map_err(|e| e.code()),
            Err(Code::Timeout),
            "the batch must end, not hang"
        );
    }
    engine.free_batch(b).unwrap();
    state
}

/// WRITE then READ of each size at an odd offset; bytes checked on both sides.
fn round_trips(initiator: &Engine, seg: u64, remote: u64, check_remote: Option<&[u8]>) {
    for (i, len) in [1usize, 4 << 10, 1 << 20, 9 << 20].into_iter().enumerate() {
        let off = 3 + i as u64;
        let src = pattern(i as u64 + 7, len);
        assert_eq!(
            run(
                initiator,
                Op::Write,
                src.as_ptr() as u64,
                seg,
                remote + off,
                len
            ),
            TaskState::Completed,
            "write of {len} bytes"
        );
        if let Some(target) = check_remote {
            let at = off as usize;
            assert!(
                target[at..at + len] == src[..],
                "target holds the written {len} bytes"
            );
        }
        let mut back = vec![0u8; len];
        assert_eq!(
            run(
                initiator,
                Op::Read,
                back.as_mut_ptr() as u64,
                seg,
                remote + off,
                len
            ),
            TaskState::Completed,
            "read of {len} bytes"
        );
        assert!(back == src, "read back the {len} bytes written");
    }
}

#[test]
fn read_and_write_between_two_engines() {
    for p in providers() {
        let target = engine(p);
        let initiator = engine(p);
        let remote = Buffer::new(&target, vec![0u8; 10 << 20]);
        let seg = initiator.open_segment(target.segment_name()).unwrap();
        let desc = initiator.segment_descriptor(seg).unwrap();
        assert!(
            desc.devices
                .iter()
                .any(|d| d.name.starts_with(&format!("{p}/"))),
            "{p}: descriptor publishes the endpoint: {:?}",
            desc.devices
        );
        // Unregistered local memory on the initiator (its own buffers are not needed).
        round_trips(&initiator, seg, remote.addr(), Some(&remote.bytes));
        let s = initiator.stats();
        assert!(s.fabric_bytes >= 2 * (10 << 20), "{p}: {s:?}");
        assert_eq!((s.tcp_bytes, s.retries), (0, 0), "{p}: {s:?}");
        eprintln!("{p}: two engines OK ({s:?})");
    }
}

#[test]
fn read_from_registered_local_memory_and_idle_target() {
    // The target engine does nothing after registering: with manual-progress providers
    // its progress thread alone must carry the peer's READ.
    for p in providers() {
        let target = engine(p);
        let remote = Buffer::new(&target, pattern(99, 3 << 20));
        let initiator = engine(p);
        let mut local = Buffer::new(&initiator, vec![0u8; 3 << 20]);
        let seg = initiator.open_segment(target.segment_name()).unwrap();
        let dst = local.bytes.as_mut_ptr() as u64;
        assert_eq!(
            run(&initiator, Op::Read, dst, seg, remote.addr(), 3 << 20),
            TaskState::Completed,
            "{p}"
        );
        assert!(local.bytes == remote.bytes, "{p}: read the target's bytes");
        local.unregister();
    }
}

/// Every WRITE is in the target's memory when it completes (whoever is told about it
/// next reads it there), also back to back with nothing else running: writes
/// over each other, each checked in the target's buffer as soon as it completed.
#[test]
fn each_write_is_in_target_memory_when_it_completes() {
    for p in providers() {
        let target = engine(p);
        let initiator = engine(p);
        let remote = Buffer::new(&target, vec![0u8; 1 << 20]);
        let seg = initiator.open_segment(target.segment_name()).unwrap();
        for i in 0..300u64 {
            let len = [8usize, 4 << 10, 16 << 10, 256 << 10][i as usize % 4];
            let off = (i % 5) as usize * 1000;
            let src = pattern(1000 + i, len);
            let dst = remote.addr() + off as u64;
            assert_eq!(
                run(&initiator, Op::Write, src.as_ptr() as u64, seg, dst, len),
                TaskState::Completed,
                "{p}: write {i}"
            );
            assert!(
                remote.bytes[off..off + len] == src[..],
                "{p}: write {i} ({len} bytes) is in the target's memory once complete"
            );
            let mut back = vec![0u8; len];
            assert_eq!(
                run(
                    &initiator,
                    Op::Read,
                    back.as_mut_ptr() as u64,
                    seg,
                    dst,
                    len
                ),
                TaskState::Completed,
                "{p}: read {i}"
            );
            assert!(back == src, "{p}: read {i} returns write {i}");
        }
    }
}

/// `count` requests of `block` bytes in one batch, from `local` to consecutive blocks
/// at `remote`; every one must complete (`what` names the run in a failure).
fn run_batch(
    what: &str,
    engine: &Engine,
    op: Op,
    local: &mut [u8],
    seg: u64,
    remote: u64,
    block: usize,
) {
    let reqs: Vec<Request> = local
        .chunks_mut(block)
        .enumerate()
        .map(|(i, chunk)| Request {
            op,
            local: chunk.as_mut_ptr() as u64,
            segment: seg,
            remote: remote + (i * block) as u64,
            len: chunk.len() as u64,
        })
        .collect();
    let b = engine.allocate_batch(reqs.len()).unwrap();
    // SAFETY: `local` outlives the wait below.
    unsafe { engine.submit(b, &reqs) }.unwrap();
    if let Err(e) = engine.wait_batch(b, WAIT) {
        panic!("{what}: {op:?} batch of {} blocks: {e}", reqs.len());
    }
    engine.free_batch(b).unwrap();
}

/// Thousands of small operations posted at once: more than the providers' queues hold
/// (they push back, the rest waits its turn), against a target process that was idle.
#[test]
fn a_burst_of_small_operations_completes() {
    const BLOCK: usize = 4 << 10;
    const COUNT: usize = 2048;
    for p in providers() {
        if p == "sockets" {
            // libfabric 1.17's sockets provider (deprecated upstream) stalls here about
            // once in 10–40 runs under CPU contention: ~256 operations posted, within
            // its transmit queue and CQ, none completed for 30 s, its threads idle on
            // both sides. The engine logs a warning when sockets is chosen.
            eprintln!("sockets: skipping the burst (the provider stalls under load)");
            continue;
        }
        let target = FabricTarget::spawn(p, BLOCK * COUNT);
        let initiator = engine(p);
        let seg = initiator.open_segment(&target.name).unwrap();
        let remote = initiator.segment_descriptor(seg).unwrap().buffers[0].addr;
        let mut src = pattern(77, BLOCK * COUNT);
        run_batch(p, &initiator, Op::Write, &mut src, seg, remote, BLOCK);
        let mut back = vec![0u8; BLOCK * COUNT];
        run_batch(p, &initiator, Op::Read, &mut back, seg, remote, BLOCK);
        assert!(back == src, "{p}: every block read back as written");
    }
}

#[test]
fn access_to_an_unregistered_buffer_fails_then_the_path_recovers() {
    for p in providers() {
        if p == "shm" {
            // libfabric 1.17's shm copies with process_vm_* without checking keys, so a
            // stale descriptor is caught only by the engine's own range check.
            eprintln!("shm: skipping the refused-access check (provider does not verify keys)");
            continue;
        }
        let target = engine(p);
        let initiator = engine(p);
        let mut gone = Buffer::new(&target, pattern(5, 1 << 20));
        let kept = Buffer::new(&target, pattern(6, 1 << 20));
        let seg = initiator.open_segment(target.segment_name()).unwrap();
        // The initiator's cached descriptor still lists `gone` after this.
        gone.unregister();
        let mut local = vec![0u8; 64 << 10];
        let started = Instant::now();
        let state = run(
            &initiator,
            Op::Read,
            local.as_mut_ptr() as u64,
            seg,
            gone.addr(),
            64 << 10,
        );
        assert_eq!(state, TaskState::Failed, "{p}");
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{p}: failed promptly"
        );
        assert!(local.iter().all(|&b| b == 0), "{p}: nothing was read");
        // A fresh endpoint (the provider may have dropped the connection) still works.
        assert_eq!(
            run(
                &initiator,
                Op::Read,
                local.as_mut_ptr() as u64,
                seg,
                kept.addr(),
                64 << 10
            ),
            TaskState::Completed,
            "{p}: the path recovers"
        );
        assert!(local[..] == kept.bytes[..64 << 10], "{p}");
    }
}

/// A `mooncake target --protocol efa` child on loopback; killed and reaped on drop.
struct FabricTarget {
    child: Child,
    name: String,
}

impl FabricTarget {
    fn spawn(provider: &str, size: usize) -> FabricTarget {
        let mut child = Command::new(env!("CARGO_BIN_EXE_mooncake"))
            .args([
                "target",
                "--protocol",
                "efa",
                "--metadata",
                "P2PHANDSHAKE",
                "--bind",
                "127.0.0.1",
                "--until-stdin-eof",
                "--size",
                &size.to_string(),
            ])
            .env("MC_FABRIC_PROVIDER", provider)
            .env("MC_STRICT_PROTOCOL", "1")
            .env("FI_TCP_IFACE", "lo")
            .env("FI_SOCKETS_IFACE", "lo")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn mooncake target");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut target = FabricTarget {
            child,
            name: String::new(),
        };
        let line = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
        match line
            .trim()
            .strip_prefix("ready ")
            .and_then(|rest| rest.split_whitespace().next())
        {
            Some(name) => target.name = name.to_owned(),
            None => panic!("{provider}: target did not report ready (got {line:?})"),
        }
        target
    }
}

impl FabricTarget {
    /// Kills the target outright, as a crash would, and removes what that leaves behind.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        remove_shm_regions(self.child.id());
    }
}

impl Drop for FabricTarget {
    fn drop(&mut self) {
        // Closing stdin ends the target cleanly: libfabric's shm provider then unlinks its
        // /dev/shm regions (16 MiB each), which a killed process leaves behind.
        drop(self.child.stdin.take());
        if exits_within(&self.child, Duration::from_secs(30)) {
            let _ = self.child.wait();
        } else {
            self.kill();
        }
    }
}

/// Waits up to `limit` for `child` to exit (without reaping it); false when it has not.
fn exits_within(child: &Child, limit: Duration) -> bool {
    let Ok(pid) = libc::pid_t::try_from(child.id()) else {
        return false;
    };
    // SAFETY: pidfd_open(2) on our own child, not yet reaped (we hold its `Child`).
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let Ok(fd) = i32::try_from(fd) else {
        return false;
    };
    if fd < 0 {
        return false;
    }
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = i32::try_from(limit.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: one valid pollfd for the call.
    let ready = unsafe { libc::poll(&mut p, 1, ms) };
    // SAFETY: `fd` is ours and closed once.
    unsafe { libc::close(fd) };
    ready == 1
}

/// Removes the libfabric shm provider's regions of the (dead) process `pid`: files named
/// `PID:UID:N` in /dev/shm, which it unlinks on a clean exit only.
fn remove_shm_regions(pid: u32) {
    let prefix = format!("{pid}:");
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    for entry in dir.flatten() {
        if entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(&prefix))
        {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

#[test]
fn transfers_with_a_target_process() {
    for p in providers() {
        let target = FabricTarget::spawn(p, 10 << 20);
        let initiator = engine(p);
        let seg = initiator.open_segment(&target.name).unwrap();
        let remote = initiator.segment_descriptor(seg).unwrap().buffers[0].addr;
        round_trips(&initiator, seg, remote, None);
        let s = initiator.stats();
        assert!(
            s.fabric_bytes > 0 && s.tcp_bytes == 0 && s.shm_bytes == 0,
            "{p}: {s:?}"
        );
        eprintln!("{p}: target process OK ({s:?})");
    }
}

#[test]
fn missing_library_is_backend_unavailable() {
    if std::env::var_os(CHILD_VAR).is_some() {
        // In the re-executed child, where MC_FABRIC_LIB=/nonexistent from the start.
        let err = match Engine::new(config("tcp;ofi_rxm")) {
            Ok(_) => panic!("engine started without libfabric"),
            Err(e) => e,
        };
        assert_eq!(err.code(), Code::BackendUnavailable, "{err}");
        let text = err.to_string();
        assert!(
            text.contains("/nonexistent") && text.contains("MC_FABRIC_LIB"),
            "{text}"
        );
        return;
    }
    // The override must be in place before libfabric is first loaded, so the check runs
    // in a fresh process: this test binary, running only this test.
    let exe = std::env::current_exe().unwrap();
    let child = Command::new(exe)
        .args([
            "--exact",
            "missing_library_is_backend_unavailable",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(CHILD_VAR, "1")
        .env("MC_FABRIC_LIB", "/nonexistent")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait on a thread so a hung child ends in a kill, not a hung test.
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            // SAFETY: signalling our own child process by pid.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("child test did not finish");
        }
    };
    let status = out.status;
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(status.success() && text.contains("1 passed"), "{text}");
}

#[test]
fn connection_rpc_answers_efa_addr() {
    let Some(p) = providers().first() else {
        return;
    };
    let e = engine(p);
    let desc = e.descriptor();
    let dev = desc
        .devices
        .iter()
        .find(|d| d.name.starts_with(&format!("{p}/")))
        .expect("our device is published");
    let request = mooncake::json::Value::object([
        ("local_nic_path", mooncake::json::Value::from("peer:1@efa0")),
        ("local_lid", 0u64.into()),
        ("local_gid", "".into()),
        (
            "peer_nic_path",
            format!("{}@{}", e.segment_name(), dev.name).as_str().into(),
        ),
        ("qp_num", mooncake::json::Value::Array(Vec::new())),
        ("efa_addr", "00".into()),
    ])
    .to_string();
    let reply = mooncake::wire::rpc::call(
        e.segment_name(),
        mooncake::wire::rpc::RpcType::Connection,
        &request,
        Duration::from_secs(5),
        None,
    )
    .unwrap();
    let v = mooncake::json::parse(&reply).unwrap();
    assert_eq!(
        v.get("reply_msg").and_then(|x| x.as_str()),
        Some(""),
        "{reply}"
    );
    assert_eq!(
        v.get("efa_addr").and_then(|x| x.as_str()),
        Some(dev.gid.as_str()),
        "{reply}"
    );
    assert_eq!(
        v.get("peer_nic_path").and_then(|x| x.as_str()),
        Some("peer:1@efa0")
    );
}

#[test]
fn info_lists_rma_providers() {
    if providers().is_empty() {
        return;
    }
    let info = mooncake::ffi::fabric::info();
    assert!(info.library.is_ok(), "{info:?}");
    assert!(info.version.is_some(), "{info:?}");
    for p in providers() {
        assert!(
            info.devices.iter().any(|d| d.starts_with(&format!("{p} "))),
            "{p} in {info:?}"
        );
    }
}

/// Two "NICs" (`lo` and a second interface, `MC_FABRIC_SECOND_NIC`, default `eth0`)
/// opened as two domains, slices spread over both. Needs a second interface with an
/// IPv4 address, and the tcp provider not pinned to one interface, so it is run on
/// request: `cargo test --test fabric -- --ignored multi_nic`.
#[test]
#[ignore = "needs a second NIC with an IPv4 address (MC_FABRIC_SECOND_NIC, default eth0); run with --ignored multi_nic"]
fn multi_nic_round_robin() {
    if std::env::var_os("FI_TCP_IFACE").is_some() {
        eprintln!("skipping: FI_TCP_IFACE pins the tcp provider to one interface");
        return;
    }
    let second = std::env::var("MC_FABRIC_SECOND_NIC").unwrap_or_else(|_| "eth0".into());
    let make = || {
        let mut cfg = config("tcp;ofi_rxm");
        cfg.set("device_name", &format!("lo,{second}")).unwrap();
        Engine::new(cfg)
    };
    let (target, initiator) = match (make(), make()) {
        (Ok(t), Ok(i)) => (t, i),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("skipping: {e}");
            return;
        }
    };
    let devices = target.descriptor().devices;
    assert_eq!(devices.len(), 2, "{devices:?}");
    let remote = Buffer::new(&target, vec![0u8; 10 << 20]);
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    round_trips(&initiator, seg, remote.addr(), Some(&remote.bytes));
    let s = initiator.stats();
    assert_eq!(
        (s.tcp_bytes, s.retries, s.failed_slices),
        (0, 0, 0),
        "{s:?}"
    );
}

#[test]
fn a_dead_target_fails_the_transfer_without_hanging() {
    for p in providers() {
        let mut target = FabricTarget::spawn(p, 1 << 20);
        let mut cfg = config(p);
        cfg.set("transfer_timeout_ms", "3000").unwrap();
        let initiator = Engine::new(cfg).unwrap();
        let seg = initiator.open_segment(&target.name).unwrap();
        let remote = initiator.segment_descriptor(seg).unwrap().buffers[0].addr;
        let mut local = vec![0u8; 1 << 20];
        let dst = local.as_mut_ptr() as u64;
        assert_eq!(
            run(&initiator, Op::Read, dst, seg, remote, 1 << 20),
            TaskState::Completed
        );
        target.kill();
        let started = Instant::now();
        let state = run(&initiator, Op::Read, dst, seg, remote, 1 << 20);
        assert_ne!(state, TaskState::Completed, "{p}");
        eprintln!(
            "{p}: dead target -> {state:?} after {:?}",
            started.elapsed()
        );
        assert!(started.elapsed() < Duration::from_secs(20), "{p}");
    }
}
