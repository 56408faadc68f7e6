//! The RDMA verbs transport against an emulated verbs provider (tests/emu/verbs_emu.c,
//! built here with `cc`): this machine has no RDMA hardware. Engines in this process
//! share the emulated HCAs directly; `mooncake target` children reach them through the
//! emulator's shared fabric (VERBS_EMU_FABRIC). Emulated figures are not performance
//! claims.

mod common;

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use common::{pattern, Target};
use mooncake::device::{self, MemoryKind};
use mooncake::engine::TaskState;
use mooncake::ffi::ibverbs as ibv;
use mooncake::memory::LocalMemory;
use mooncake::metadata::SegmentDesc;
use mooncake::transport::rdma::RdmaTransport;
use mooncake::transport::{
    BackendConfig, Endpoints, Outcome, Peer, Slice, Transport, TransportWorker,
};
use mooncake::util::crc32c::crc32c;
use mooncake::wire::rpc::{self, RpcType};
use mooncake::{Code, Engine, EngineConfig, Op, Request};

const DEVICES: [&str; 3] = ["emu0", "emu1", "emu2"];

/// The emulator's fault-injection and counter entry points.
struct Emu {
    _lib: libloading::Library,
    fail_device: unsafe extern "C" fn(*const libc::c_char, libc::c_int) -> libc::c_int,
    fail_after: unsafe extern "C" fn(*const libc::c_char, u64) -> libc::c_int,
    bytes: unsafe extern "C" fn(*const libc::c_char) -> u64,
    hold_completions: unsafe extern "C" fn(libc::c_int),
    wait_held: unsafe extern "C" fn(libc::c_int, libc::c_int) -> libc::c_int,
    cq_events: unsafe extern "C" fn() -> u64,
    fabric_entries: unsafe extern "C" fn(libc::c_int) -> libc::c_int,
    fabric_reclaim: unsafe extern "C" fn() -> libc::c_int,
}

impl Emu {
    fn bytes(&self, dev: &str) -> u64 {
        let name = std::ffi::CString::new(dev).unwrap();
        // SAFETY: emulator entry point taking a C string.
        unsafe { (self.bytes)(name.as_ptr()) }
    }

    fn set_down(&self, dev: &str, down: bool) {
        let name = std::ffi::CString::new(dev).unwrap();
        // SAFETY: as above.
        assert_eq!(
            unsafe { (self.fail_device)(name.as_ptr(), down as libc::c_int) },
            0
        );
    }

    fn fail_after(&self, dev: &str, bytes: u64) {
        let name = std::ffi::CString::new(dev).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { (self.fail_after)(name.as_ptr(), bytes) }, 0);
    }

    /// Keeps completions back until the returned guard goes (which delivers them).
    fn hold_completions(&self) -> Held<'_> {
        // SAFETY: emulator entry point without preconditions.
        unsafe { (self.hold_completions)(1) };
        Held(self)
    }

    /// Waits (bounded) until `n` completions are held; returns how many are.
    fn wait_held(&self, n: i32) -> i32 {
        // SAFETY: as above.
        unsafe { (self.wait_held)(n, 30_000) }
    }

    /// CQ events read through ibv_get_cq_event so far, by anyone in this process.
    fn cq_events(&self) -> u64 {
        // SAFETY: as above.
        unsafe { (self.cq_events)() }
    }

    /// QPs and MRs of process `pid` published on the shared fabric.
    fn fabric_entries(&self, pid: u32) -> i32 {
        // SAFETY: as above.
        unsafe { (self.fabric_entries)(pid as libc::c_int) }
    }

    /// Frees the fabric entries of processes that are gone; returns how many.
    fn fabric_reclaim(&self) -> i32 {
        // SAFETY: as above.
        unsafe { (self.fabric_reclaim)() }
    }
}

/// Held completions; dropping it delivers them.
struct Held<'a>(&'a Emu);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        // SAFETY: emulator entry point without preconditions.
        unsafe { (self.0.hold_completions)(0) };
    }
}

/// Whether `fd` is readable within `timeout_ms` (0: right now).
fn readable(fd: std::os::fd::RawFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    assert!(n >= 0, "poll: {}", std::io::Error::last_os_error());
    n == 1 && p.revents & libc::POLLIN != 0
}

fn have_cc() -> bool {
    std::process::Command::new("cc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn build_emulator() -> Result<PathBuf, String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/emu/verbs_emu.c");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("libverbs_emu.so");
    let status = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-o"])
        .arg(&out)
        .arg(&src)
        .arg("-lpthread")
        .status()
        .map_err(|e| format!("running cc: {e}"))?;
    if !status.success() {
        return Err(format!("cc failed on {}", src.display()));
    }
    Ok(out)
}

/// Builds and installs the emulator as this process's libibverbs (once, before any
/// engine loads verbs). `None` (test skipped) when no C compiler is present.
fn emu() -> Option<&'static Emu> {
    static EMU: OnceLock<Option<Emu>> = OnceLock::new();
    EMU.get_or_init(|| {
        if std::env::var_os("MC_RDMA_TEST_CHILD").is_some() {
            return None;
        }
        if !have_cc() {
            eprintln!("skipping: no C compiler (cc) to build the emulated verbs provider");
            return None;
        }
        let path = build_emulator().expect("emulator builds");
        std::env::set_var("MC_IBVERBS_LIB", &path);
        // The fake GPU drivers too, before any engine start looks for GPUs (the
        // driver tables load once per process).
        common::fakes::fakes();
        std::env::set_var("VERBS_EMU_DEVICES", DEVICES.len().to_string());
        // One fabric for this process and the `mooncake target` children it starts
        // (they inherit the variable). It outlives the run on purpose: entries that
        // dead processes leave are reclaimed by the next ones.
        let fabric = Path::new(env!("CARGO_TARGET_TMPDIR")).join("verbs_emu.fabric");
        std::env::set_var("VERBS_EMU_FABRIC", fabric);
        // SAFETY: the emulator's initializers have no preconditions; dlopen of the same
        // path shares the instance the engine loads.
        let lib = unsafe { libloading::Library::new(&path) }.expect("emulator loads");
        // SAFETY: the signatures match tests/emu/verbs_emu.c.
        unsafe {
            let fail_device = *lib.get(b"verbs_emu_fail_device\0").unwrap();
            let fail_after = *lib.get(b"verbs_emu_fail_after\0").unwrap();
            let bytes = *lib.get(b"verbs_emu_bytes\0").unwrap();
            let hold_completions = *lib.get(b"verbs_emu_hold_completions\0").unwrap();
            let wait_held = *lib.get(b"verbs_emu_wait_held\0").unwrap();
            let cq_events = *lib.get(b"verbs_emu_cq_events\0").unwrap();
            let fabric_entries = *lib.get(b"verbs_emu_fabric_entries\0").unwrap();
            let fabric_reclaim = *lib.get(b"verbs_emu_fabric_reclaim\0").unwrap();
            Some(Emu {
                _lib: lib,
                fail_device,
                fail_after,
                bytes,
                hold_completions,
                wait_held,
                cq_events,
                fabric_entries,
                fabric_reclaim,
            })
        }
    })
    .as_ref()
}

/// Tests share the emulated devices (faults are global): one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn rdma_engine(workers: usize) -> Engine {
    rdma_engine_with(workers, &[])
}

fn rdma_engine_with(workers: usize, settings: &[(&str, &str)]) -> Engine {
    let mut cfg = EngineConfig::default();
    cfg.set("metadata", "P2PHANDSHAKE").unwrap();
    cfg.set("protocol", "rdma").unwrap();
    cfg.set("workers", &workers.to_string()).unwrap();
    for (k, v) in settings {
        cfg.set(k, v).unwrap();
    }
    Engine::new(cfg).expect("rdma engine starts on the emulated devices")
}

/// A registered buffer that unregisters itself on drop.
struct Buf<'a> {
    engine: &'a Engine,
    buf: Vec<u8>,
}

impl<'a> Buf<'a> {
    fn new(engine: &'a Engine, buf: Vec<u8>) -> Buf<'a> {
        let mut b = Buf { engine, buf };
        // SAFETY: the Vec lives in `b` and is unregistered before it is dropped.
        unsafe { engine.register_memory(b.buf.as_mut_ptr(), b.buf.len(), "cpu:0") }.unwrap();
        b
    }

    fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }
}

impl Drop for Buf<'_> {
    fn drop(&mut self) {
        let _ = self.engine.unregister_memory(self.buf.as_mut_ptr());
    }
}

/// Runs one request to completion; returns its final state.
fn run(client: &Engine, seg: u64, op: Op, local: u64, remote: u64, len: usize) -> TaskState {
    let batch = start(client, seg, op, local, remote, len);
    finish(client, batch)
}

/// Submits one request as a batch of its own.
fn start(client: &Engine, seg: u64, op: Op, local: u64, remote: u64, len: usize) -> u64 {
    let batch = client.allocate_batch(1).unwrap();
    let req = [Request {
        op,
        local,
        segment: seg,
        remote,
        len: len as u64,
    }];
    // SAFETY: callers keep the local range alive until the batch is final.
    unsafe { client.submit(batch, &req) }.unwrap();
    batch
}

/// Waits (bounded) for a one-request batch, frees it and returns the request's state.
fn finish(client: &Engine, batch: u64) -> TaskState {
    if let Err(e) = client.wait_batch(batch, Some(Duration::from_secs(30))) {
        // A failed task ends the wait with TransferFail; a hang would be a timeout.
        assert_eq!(e.code(), Code::TransferFail, "{e}");
    }
    let st = client.task_status(batch, 0).unwrap();
    client.free_batch(batch).unwrap();
    st.state
}

#[test]
fn descriptor_lists_devices_and_per_nic_keys() {
    let Some(_) = emu() else { return };
    let _g = serial();
    let server = rdma_engine(1);
    let b = Buf::new(&server, vec![0; 8192]);
    let desc = server.descriptor();
    assert_eq!(desc.protocol, "rdma");
    let names: Vec<&str> = desc.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, DEVICES);
    for (i, d) in desc.devices.iter().enumerate() {
        assert_eq!(d.lid as usize, i + 1);
        assert_eq!(d.gid.len(), 32, "{}", d.gid);
    }
    let buf = desc.buffer_for(b.addr(), 8192).unwrap();
    assert_eq!(buf.rkey.len(), 3);
    assert_eq!(buf.lkey.len(), 3);
    let mut keys = buf.rkey.clone();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 3, "one distinct rkey per NIC");
}

#[test]
fn read_write_sizes_over_every_nic() {
    let Some(emu) = emu() else { return };
    let _g = serial();
    let server = rdma_engine(2);
    let client = rdma_engine(2);
    let before: Vec<u64> = DEVICES.iter().map(|d| emu.bytes(d)).collect();
    let big = 9 << 20;
    let remote = Buf::new(&server, pattern(1, big));
    let mut local = Buf::new(&client, vec![0; big]);
    let seg = client.open_segment(server.segment_name()).unwrap();
    for len in [4096, 1 << 20, big] {
        local.buf.fill(0);
        let st = run(&client, seg, Op::Read, local.addr(), remote.addr(), len);
        assert_eq!(st, TaskState::Completed, "read of {len}");
        assert!(local.buf[..len] == remote.buf[..len], "read of {len} bytes");

        let src = pattern(len as u64 + 7, len);
        local.buf[..len].copy_from_slice(&src);
        let st = run(&client, seg, Op::Write, local.addr(), remote.addr(), len);
        assert_eq!(st, TaskState::Completed, "write of {len}");
        assert!(remote.buf[..len] == src[..], "write of {len} bytes");
    }
    // An unaligned write inside the buffer.
    let src = pattern(99, 100_000);
    local.buf[..100_000].copy_from_slice(&src);
    let st = run(
        &client,
        seg,
        Op::Write,
        local.addr(),
        remote.addr() + 12345,
        100_000,
    );
    assert_eq!(st, TaskState::Completed);
    assert!(remote.buf[12345..112345] == src[..]);

    let stats = client.stats();
    assert!(
        stats.rdma_bytes >= 2 * (4096 + (1 << 20) + big as u64),
        "{stats:?}"
    );
    assert_eq!(stats.tcp_bytes, 0, "{stats:?}");
    for (i, d) in DEVICES.iter().enumerate() {
        let moved = emu.bytes(d) - before[i];
        assert!(moved >= 4 << 20, "{d} carried only {moved} bytes");
    }
}

#[test]
fn device_memory_registers_through_dma_buf_and_moves_unstaged() {
    let Some(_) = emu() else { return };
    let Some(fakes) = common::fakes::fakes() else {
        return;
    };
    let _g = serial();
    let server = rdma_engine(1);
    let client = rdma_engine(2);
    // Many 64 KiB slices over every NIC; the fakes' device memory faults on any CPU
    // access, so only the NICs' dma-buf mappings can move it.
    let len = (6 << 20) + 4096;
    let remote = server.allocate_buffer(len, "cuda:1").unwrap() as u64;
    let local = client.allocate_buffer(len, "cuda:0").unwrap() as u64;
    let data = pattern(21, len);
    // SAFETY: `local` is device memory of `len` bytes.
    unsafe { device::copy_from_host(MemoryKind::Cuda(0), local, data.as_ptr(), len) }.unwrap();
    let seg = client.open_segment(server.segment_name()).unwrap();
    let copies = || common::fakes::counter(&fakes.cuda, "fake_cuda_copies");

    let before = copies();
    let st = run(&client, seg, Op::Write, local, remote, len);
    assert_eq!(st, TaskState::Completed);
    assert_eq!(
        copies(),
        before,
        "GPU to GPU through the NICs: no driver copy, no staging"
    );
    let mut landed = vec![0u8; len];
    // SAFETY: `remote` is device memory of `len` bytes.
    unsafe { device::copy_to_host(MemoryKind::Cuda(1), landed.as_mut_ptr(), remote, len) }.unwrap();
    assert!(
        landed == data,
        "the bytes reached the server's device memory"
    );

    // Device memory read into host memory at an offset.
    let host = Buf::new(&client, vec![0; len - 8192]);
    let st = run(
        &client,
        seg,
        Op::Read,
        host.addr(),
        remote + 8192,
        len - 8192,
    );
    assert_eq!(st, TaskState::Completed);
    assert!(host.buf[..] == data[8192..]);
    assert_eq!(client.stats().tcp_bytes, 0);

    // No dma-buf (HIP) and memory the NIC cannot pin: registration says why.
    let err = client.allocate_buffer(1 << 20, "hip:0").unwrap_err();
    assert_eq!(err.code(), Code::BackendUnavailable, "{err}");
    assert!(err.to_string().contains("GPUDirect"), "{err}");
    client.free_buffer(local as *mut u8).unwrap();
    server.free_buffer(remote as *mut u8).unwrap();
}

#[test]
fn nic_failure_mid_transfer_completes_on_the_others() {
    let Some(emu) = emu() else { return };
    let _g = serial();
    let server = rdma_engine(1);
    let client = rdma_engine(1);
    let len = 9 << 20;
    let remote = Buf::new(&server, pattern(5, len));
    let mut local = Buf::new(&client, vec![0; len]);
    let seg = client.open_segment(server.segment_name()).unwrap();
    let before: Vec<u64> = DEVICES.iter().map(|d| emu.bytes(d)).collect();
    // emu1 dies after 512 KiB of this transfer.
    emu.fail_after("emu1", 512 << 10);
    let st = run(&client, seg, Op::Read, local.addr(), remote.addr(), len);
    let moved: Vec<u64> = DEVICES
        .iter()
        .enumerate()
        .map(|(i, d)| emu.bytes(d) - before[i])
        .collect();
    // Bring it back for the next tests before asserting anything.
    emu.set_down("emu1", false);
    assert_eq!(st, TaskState::Completed, "per-NIC bytes {moved:?}");
    assert!(local.buf == remote.buf, "every byte arrived");
    assert!(
        moved[1] >= 512 << 10 && moved[1] < (1 << 20),
        "emu1 moved {}",
        moved[1]
    );
    assert!(moved[0] + moved[2] >= (len as u64) - moved[1], "{moved:?}");
    let stats = client.stats();
    assert!(stats.retries >= 1, "{stats:?}");
    assert_eq!(stats.failed_slices, 0, "{stats:?}");

    // Writes keep working with the rail paused or probed back.
    let src = pattern(6, 1 << 20);
    local.buf[..1 << 20].copy_from_slice(&src);
    let st = run(
        &client,
        seg,
        Op::Write,
        local.addr(),
        remote.addr(),
        1 << 20,
    );
    assert_eq!(st, TaskState::Completed);
    assert!(remote.buf[..1 << 20] == src[..]);
}

#[test]
fn every_nic_down_fails_without_hanging() {
    let Some(emu) = emu() else { return };
    let _g = serial();
    let server = rdma_engine(1);
    let client = rdma_engine(1);
    let remote = Buf::new(&server, vec![0; 1 << 20]);
    let local = Buf::new(&client, vec![1; 1 << 20]);
    let seg = client.open_segment(server.segment_name()).unwrap();
    for d in DEVICES {
        emu.set_down(d, true);
    }
    let st = run(
        &client,
        seg,
        Op::Write,
        local.addr(),
        remote.addr(),
        1 << 20,
    );
    for d in DEVICES {
        emu.set_down(d, false);
    }
    assert_eq!(st, TaskState::Failed);
    assert!(client.stats().failed_slices > 0);
}

#[test]
fn stale_rkey_fails_with_a_clear_status() {
    let Some(_) = emu() else { return };
    let _g = serial();
    let server = rdma_engine(1);
    let client = rdma_engine(1);
    let mut remote = vec![0u8; 1 << 16];
    let raddr = remote.as_mut_ptr();
    // SAFETY: `remote` outlives its registration (unregistered below).
    unsafe { server.register_memory(raddr, remote.len(), "cpu:0") }.unwrap();
    let local = Buf::new(&client, vec![3; 4096]);
    let seg = client.open_segment(server.segment_name()).unwrap();
    // The client's cached descriptor still lists the buffer and its rkeys; the MRs
    // behind them are gone, so the emulated HCA answers a remote access error.
    server.unregister_memory(raddr).unwrap();
    let st = run(&client, seg, Op::Write, local.addr(), raddr as u64, 4096);
    assert_eq!(st, TaskState::Failed);
    assert!(remote.iter().all(|b| *b == 0), "nothing was written");
}

#[test]
fn unregistered_local_memory_is_rejected() {
    let Some(_) = emu() else { return };
    let _g = serial();
    let server = rdma_engine(1);
    let client = rdma_engine(1);
    let remote = Buf::new(&server, vec![0; 4096]);
    let local = vec![7u8; 4096];
    let seg = client.open_segment(server.segment_name()).unwrap();
    let st = run(
        &client,
        seg,
        Op::Write,
        local.as_ptr() as u64,
        remote.addr(),
        4096,
    );
    assert_eq!(st, TaskState::Failed);
}

/// The verbs layer itself on the emulator: key and bounds checks, QP states.
#[test]
fn verbs_layer_checks_keys_ranges_and_states() {
    let Some(_) = emu() else { return };
    let _g = serial();
    let v = ibv::verbs().expect("emulator loads as libibverbs");
    assert_eq!(v.device_names(), DEVICES);
    let mut n = 0;
    // SAFETY: straight-line verbs usage on the emulator; everything is freed at the end.
    unsafe {
        let list = (v.get_device_list)(&mut n);
        let c0 = (v.open_device)(*list);
        let c1 = (v.open_device)(*list.add(1));
        (v.free_device_list)(list);
        let p = v.query_port(c0, 1).unwrap();
        assert_eq!((p.state, p.lid), (ibv::IBV_PORT_ACTIVE, 1));
        let (pd0, pd1) = ((v.alloc_pd)(c0), (v.alloc_pd)(c1));
        let mut a = vec![1u8; 4096];
        let mut b = vec![0u8; 4096];
        let flags = ibv::IBV_ACCESS_LOCAL_WRITE
            | ibv::IBV_ACCESS_REMOTE_WRITE
            | ibv::IBV_ACCESS_REMOTE_READ;
        let ma = (v.reg_mr)(pd0, a.as_mut_ptr().cast(), a.len(), flags);
        let mb = (v.reg_mr)(pd1, b.as_mut_ptr().cast(), b.len(), flags);
        assert!(!ma.is_null() && !mb.is_null());
        let cq0 = (v.create_cq)(c0, 16, std::ptr::null_mut(), std::ptr::null_mut(), 0);
        let cq1 = (v.create_cq)(c1, 16, std::ptr::null_mut(), std::ptr::null_mut(), 0);
        let mk = |pd, cq| {
            let mut init = ibv::ibv_qp_init_attr {
                qp_context: std::ptr::null_mut(),
                send_cq: cq,
                recv_cq: cq,
                srq: std::ptr::null_mut(),
                cap: ibv::ibv_qp_cap {
                    max_send_wr: 16,
                    max_recv_wr: 1,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 0,
                },
                qp_type: ibv::IBV_QPT_RC,
                sq_sig_all: 0,
            };
            (v.create_qp)(pd, &mut init)
        };
        let (q0, q1) = (mk(pd0, cq0), mk(pd1, cq1));
        let post = |qp, rkey: u32, raddr: u64, len: u32| {
            let mut sge = ibv::ibv_sge {
                addr: a.as_ptr() as u64,
                length: len,
                lkey: (*ma).lkey,
            };
            let mut wr = ibv::ibv_send_wr {
                wr_id: 42,
                sg_list: &mut sge,
                num_sge: 1,
                opcode: ibv::IBV_WR_RDMA_WRITE,
                send_flags: ibv::IBV_SEND_SIGNALED,
                ..Default::default()
            };
            wr.rdma.remote_addr = raddr;
            wr.rdma.rkey = rkey;
            let mut bad = std::ptr::null_mut();
            ibv::post_send(qp, &mut wr, &mut bad)
        };
        // Posting on a QP that is not ready to send is refused.
        assert_eq!(post(q0, (*mb).rkey, b.as_ptr() as u64, 64), libc::EINVAL);
        // Connect q0 <-> q1 by hand (RESET -> INIT -> RTR -> RTS).
        let mut gid0 = ibv::ibv_gid::default();
        let mut gid1 = ibv::ibv_gid::default();
        (v.query_gid)(c0, 1, 0, &mut gid0);
        (v.query_gid)(c1, 1, 0, &mut gid1);
        assert_ne!(gid0, gid1);
        let connect_pair = || {
            for (qp, peer, gid) in [(q0, q1, gid1), (q1, q0, gid0)] {
                let mut at = ibv::ibv_qp_attr {
                    qp_state: ibv::IBV_QPS_RESET,
                    ..Default::default()
                };
                assert_eq!((v.modify_qp)(qp, &mut at, ibv::IBV_QP_STATE), 0);
                let mut at = ibv::ibv_qp_attr {
                    qp_state: ibv::IBV_QPS_RTR,
                    ..Default::default()
                };
                // Skipping INIT is refused.
                assert_ne!((v.modify_qp)(qp, &mut at, ibv::IBV_QP_STATE), 0);
                let mut at = ibv::ibv_qp_attr {
                    qp_state: ibv::IBV_QPS_INIT,
                    port_num: 1,
                    qp_access_flags: flags as u32,
                    ..Default::default()
                };
                let m = ibv::IBV_QP_STATE
                    | ibv::IBV_QP_PKEY_INDEX
                    | ibv::IBV_QP_PORT
                    | ibv::IBV_QP_ACCESS_FLAGS;
                assert_eq!((v.modify_qp)(qp, &mut at, m), 0);
                let mut at = ibv::ibv_qp_attr {
                    qp_state: ibv::IBV_QPS_RTR,
                    path_mtu: ibv::IBV_MTU_4096,
                    dest_qp_num: (*peer).qp_num,
                    max_dest_rd_atomic: 16,
                    min_rnr_timer: 12,
                    ..Default::default()
                };
                at.ah_attr.is_global = 1;
                at.ah_attr.grh.dgid = gid;
                at.ah_attr.port_num = 1;
                let m = ibv::IBV_QP_STATE
                    | ibv::IBV_QP_AV
                    | ibv::IBV_QP_PATH_MTU
                    | ibv::IBV_QP_DEST_QPN
                    | ibv::IBV_QP_RQ_PSN
                    | ibv::IBV_QP_MAX_DEST_RD_ATOMIC
                    | ibv::IBV_QP_MIN_RNR_TIMER;
                assert_eq!((v.modify_qp)(qp, &mut at, m), 0);
                let mut at = ibv::ibv_qp_attr {
                    qp_state: ibv::IBV_QPS_RTS,
                    timeout: 14,
                    retry_cnt: 7,
                    rnr_retry: 7,
                    max_rd_atomic: 16,
                    ..Default::default()
                };
                let m = ibv::IBV_QP_STATE
                    | ibv::IBV_QP_TIMEOUT
                    | ibv::IBV_QP_RETRY_CNT
                    | ibv::IBV_QP_RNR_RETRY
                    | ibv::IBV_QP_SQ_PSN
                    | ibv::IBV_QP_MAX_QP_RD_ATOMIC;
                assert_eq!((v.modify_qp)(qp, &mut at, m), 0);
            }
        };
        connect_pair();
        let poll = |cq| {
            let mut wc = [ibv::ibv_wc::default(); 4];
            let n = ibv::poll_cq(cq, 4, wc.as_mut_ptr());
            assert_eq!(n, 1);
            wc[0]
        };
        // A good write.
        assert_eq!(post(q0, (*mb).rkey, b.as_ptr() as u64 + 100, 64), 0);
        let wc = poll(cq0);
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len),
            (42, ibv::IBV_WC_SUCCESS, 64)
        );
        assert!(b[100..164].iter().all(|x| *x == 1) && b[164] == 0);
        // A wrong rkey, in the other direction: remote access error, q1 to ERR.
        let mut sge = ibv::ibv_sge {
            addr: b.as_ptr() as u64,
            length: 64,
            lkey: (*mb).lkey,
        };
        let mut wr = ibv::ibv_send_wr {
            wr_id: 7,
            sg_list: &mut sge,
            num_sge: 1,
            opcode: ibv::IBV_WR_RDMA_READ,
            send_flags: ibv::IBV_SEND_SIGNALED,
            ..Default::default()
        };
        wr.rdma.remote_addr = a.as_ptr() as u64;
        wr.rdma.rkey = (*ma).rkey ^ 0x5555;
        let mut bad = std::ptr::null_mut();
        assert_eq!(ibv::post_send(q1, &mut wr, &mut bad), 0);
        assert_eq!(poll(cq1).status, ibv::IBV_WC_REM_ACCESS_ERR);
        // ERR -> RESET -> ... -> RTS brings the pair back.
        connect_pair();

        // Past the end of the remote MR: remote access error, QP to ERR.
        assert_eq!(post(q0, (*mb).rkey, b.as_ptr() as u64 + 4090, 64), 0);
        let wc = poll(cq0);
        assert_eq!(
            wc.status,
            ibv::IBV_WC_REM_ACCESS_ERR,
            "{}",
            ibv::wc_status_name(wc.status)
        );
        assert_eq!(b[4090], 0);
        // Later requests on the broken QP are flushed.
        assert_eq!(post(q0, (*mb).rkey, b.as_ptr() as u64, 64), 0);
        assert_eq!(poll(cq0).status, ibv::IBV_WC_WR_FLUSH_ERR);
        for qp in [q0, q1] {
            assert_eq!((v.destroy_qp)(qp), 0);
        }
        for cq in [cq0, cq1] {
            assert_eq!((v.destroy_cq)(cq), 0);
        }
        for mr in [ma, mb] {
            assert_eq!((v.dereg_mr)(mr), 0);
        }
        (v.dealloc_pd)(pd0);
        (v.dealloc_pd)(pd1);
        (v.close_device)(c0);
        (v.close_device)(c1);
    }
    let info = ibv::info();
    assert_eq!(info.devices.len(), 3, "{info:?}");
    assert!(info.devices[0].contains("emu0 port 1: active"), "{info:?}");
}

/// Completion channels on the emulator, through the ffi: an armed CQ's next completion
/// makes the channel's descriptor readable and queues one event, which reads without
/// blocking and must be acknowledged before the CQ can go.
#[test]
fn completion_channel_reports_armed_cqs() {
    let Some(_) = emu() else { return };
    let _g = serial();
    let v = ibv::verbs().expect("emulator loads as libibverbs");
    let null = std::ptr::null_mut();
    let mut n = 0;
    // SAFETY: straight-line verbs usage on the emulator; everything is freed at the end.
    unsafe {
        let list = (v.get_device_list)(&mut n);
        let c0 = (v.open_device)(*list);
        let c1 = (v.open_device)(*list.add(1));
        (v.free_device_list)(list);
        let ch = (v.create_comp_channel)(c0);
        assert!(!ch.is_null());
        let fd = (*ch).fd;
        let flags = libc::fcntl(fd, libc::F_GETFL);
        assert_eq!(libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK), 0);
        // A channel serves the CQs of its own device only.
        assert!((v.create_cq)(c1, 16, null, ch, 0).is_null());
        let cq = (v.create_cq)(c0, 16, null, ch, 0);
        assert!(!cq.is_null());
        assert_eq!((*cq).channel, ch);
        let mut got = null.cast();
        let mut cq_context = null;
        // Nothing queued: not readable, and reading fails at once instead of blocking.
        assert!(!readable(fd, 0));
        assert_eq!((v.get_cq_event)(ch, &mut got, &mut cq_context), -1);
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EAGAIN)
        );
        // Completions come cheaply from a QP in the error state: each post is flushed.
        let pd = (v.alloc_pd)(c0);
        let mut init = ibv::ibv_qp_init_attr {
            qp_context: null,
            send_cq: cq,
            recv_cq: cq,
            srq: null,
            cap: ibv::ibv_qp_cap {
                max_send_wr: 16,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ibv::IBV_QPT_RC,
            sq_sig_all: 1,
        };
        let qp = (v.create_qp)(pd, &mut init);
        assert!(!qp.is_null());
        let mut at = ibv::ibv_qp_attr {
            qp_state: ibv::IBV_QPS_ERR,
            ..Default::default()
        };
        assert_eq!((v.modify_qp)(qp, &mut at, ibv::IBV_QP_STATE), 0);
        let flushed = || {
            let mut wr = ibv::ibv_send_wr {
                wr_id: 5,
                opcode: ibv::IBV_WR_RDMA_WRITE,
                ..Default::default()
            };
            let mut bad = std::ptr::null_mut();
            assert_eq!(ibv::post_send(qp, &mut wr, &mut bad), 0);
        };
        let mut wc = [ibv::ibv_wc::default(); 4];
        // Not armed: a completion raises no event.
        flushed();
        assert!(!readable(fd, 0));
        assert_eq!(ibv::poll_cq(cq, 4, wc.as_mut_ptr()), 1);
        assert_eq!(wc[0].status, ibv::IBV_WC_WR_FLUSH_ERR);
        // Armed: the next completion does, once.
        assert_eq!(ibv::req_notify_cq(cq, false), 0);
        assert!(!readable(fd, 0));
        flushed();
        assert!(readable(fd, 0));
        assert_eq!((v.get_cq_event)(ch, &mut got, &mut cq_context), 0);
        assert_eq!(got, cq);
        assert!(!readable(fd, 0));
        flushed();
        assert!(!readable(fd, 0), "one event per arm");
        assert_eq!(ibv::poll_cq(cq, 4, wc.as_mut_ptr()), 2);
        // An event read but not acknowledged keeps the CQ, and so the channel, alive.
        assert_eq!((v.destroy_qp)(qp), 0);
        assert_eq!((v.destroy_cq)(cq), libc::EBUSY);
        assert_eq!((v.destroy_comp_channel)(ch), libc::EBUSY);
        (v.ack_cq_events)(cq, 1);
        assert_eq!((v.destroy_cq)(cq), 0);
        assert_eq!((v.destroy_comp_channel)(ch), 0);
        assert_eq!((v.dealloc_pd)(pd), 0);
        (v.close_device)(c0);
        (v.close_device)(c1);
    }
}

/// One RDMA transport worker driven by hand (one NIC on each side, so one rail): its
/// wait descriptor turns readable when the handshake reply comes back from the
/// connector thread, and when a completion lands on its armed CQ; `progress` then
/// finishes the slice and the descriptor is quiet again.
#[test]
fn worker_wait_fd_wakes_for_handshake_replies_and_completions() {
    let Some(emu) = emu() else { return };
    let _g = serial();
    let server = rdma_engine_with(1, &[("device_name", "emu0")]);
    let remote = Buf::new(&server, vec![0; 1 << 16]);
    let memory = Arc::new(LocalMemory::new());
    let config = BackendConfig {
        devices: "emu0".to_owned(),
        ..Default::default()
    };
    let transport = RdmaTransport::start(&config, memory.clone()).unwrap();
    transport.describe(&mut SegmentDesc::new("hand-driven"));
    let src = pattern(11, 8192);
    let base = src.as_ptr() as u64;
    let region = memory.register(base, src.len() as u64, "cpu:0").unwrap();
    transport.register(&region).unwrap();
    let peer = Arc::new(Peer::new(
        1,
        server.descriptor(),
        Endpoints {
            data: "127.0.0.1:9".parse().unwrap(),
            rpc: server.segment_name().to_owned(),
        },
    ));
    let slice = |id: u64| Slice {
        id,
        op: Op::Write,
        local: base + (id - 1) * 4096,
        local_kind: MemoryKind::Host,
        remote: remote.addr() + (id - 1) * 4096,
        len: 4096,
        peer: peer.clone(),
        deadline: Instant::now() + Duration::from_secs(30),
    };
    let mut worker = transport.new_worker().unwrap();
    let fd = worker
        .wait_fd()
        .expect("the RDMA worker has a wait descriptor");
    let mut done = Vec::new();

    // The rail connects off this thread; the reply wakes the descriptor.
    worker.post(slice(1), &mut done);
    assert!(done.is_empty());
    assert_eq!(worker.in_flight(), 1);
    assert!(readable(fd, 30_000), "the handshake reply never signalled");
    // Taking it connects the QP and posts; the emulator completes at once.
    assert!(worker.progress(Instant::now(), &mut done));
    let outcomes: Vec<(u64, Outcome)> = done.drain(..).map(|f| (f.id, f.outcome)).collect();
    assert_eq!(outcomes, [(1, Outcome::Done)]);
    assert!(!readable(fd, 0));

    // A completion that arrives later, on the CQ the last `progress` armed.
    let held = emu.hold_completions();
    worker.post(slice(2), &mut done);
    assert!(!worker.progress(Instant::now(), &mut done));
    assert!(done.is_empty());
    assert_eq!(worker.in_flight(), 1);
    assert!(!readable(fd, 0), "nothing completed yet");
    drop(held);
    assert!(
        readable(fd, 0),
        "a completion on an armed CQ wakes the worker"
    );
    assert!(worker.progress(Instant::now(), &mut done));
    let outcomes: Vec<(u64, Outcome)> = done.drain(..).map(|f| (f.id, f.outcome)).collect();
    assert_eq!(outcomes, [(2, Outcome::Done)]);
    assert!(!readable(fd, 0), "the event was read");
    assert_eq!(worker.in_flight(), 0);
    assert!(remote.buf[..8192] == src[..]);

    drop(worker);
    transport.unregister(&region);
    memory.unregister(base).unwrap();
}

/// With a spin budget of one idle round the engine worker parks as soon as nothing
/// moves. Completions held back until it has posted every slice arrive on armed CQs,
/// and their channel events are what the worker reads.
#[test]
fn transfer_completes_with_the_worker_parked() {
    let Some(emu) = emu() else { return };
    let _g = serial();
    let server = rdma_engine(1);
    let client = rdma_engine_with(1, &[("spin_budget", "1")]);
    let len = 1 << 20;
    let remote = Buf::new(&server, vec![0; len]);
    let local = Buf::new(&client, pattern(21, len));
    let seg = client.open_segment(server.segment_name()).unwrap();
    let events = emu.cq_events();
    let held = emu.hold_completions();
    let batch = start(&client, seg, Op::Write, local.addr(), remote.addr(), len);
    let slices = (len as u64 / mooncake::transport::rdma::SLICE_SIZE) as i32;
    let posted = emu.wait_held(slices);
    drop(held);
    assert_eq!(posted, slices, "every slice was posted");
    assert_eq!(finish(&client, batch), TaskState::Completed);
    assert!(remote.buf == local.buf);
    assert!(
        emu.cq_events() > events,
        "the completions raised channel events"
    );
}

/// A `mooncake target --protocol rdma` child; it inherits the emulator and its fabric
/// from `emu()`'s environment.
fn rdma_target(size: usize, extra: &[&str]) -> Target {
    let mut args = vec!["--protocol", "rdma"];
    args.extend_from_slice(extra);
    Target::spawn_with("P2PHANDSHAKE", size, &args)
}

/// The target's answer to `checksum` when its buffer holds `bytes`.
fn checksum_of(bytes: &[u8]) -> String {
    format!("crc32c {:08x}", crc32c(bytes))
}

/// An engine here reads and writes a target process's buffer: the Connection
/// handshake runs through the transport, the bytes cross through the fabric, many
/// slices over every NIC.
#[test]
fn reads_and_writes_a_target_process_over_every_nic() {
    let Some(emu) = emu() else { return };
    let _g = serial();
    let len = 6 << 20;
    let mut target = rdma_target(len, &[]);
    {
        let client = rdma_engine(2);
        let seg = client.open_segment(&target.name).unwrap();
        let desc = client.segment_descriptor(seg).unwrap();
        assert_eq!(desc.protocol, "rdma");
        assert_eq!(desc.devices.len(), DEVICES.len());
        for (theirs, ours) in desc.devices.iter().zip(&client.descriptor().devices) {
            assert_ne!(theirs.gid, ours.gid, "GIDs differ per process");
        }
        assert_eq!(desc.buffers[0].length, len as u64);
        let remote = desc.buffers[0].addr;
        assert!(
            emu.fabric_entries(target.child.id()) >= DEVICES.len() as i32,
            "the target's MRs are on the fabric"
        );
        let before: Vec<u64> = DEVICES.iter().map(|d| emu.bytes(d)).collect();

        let data = pattern(41, len);
        let src = Buf::new(&client, data.clone());
        let st = run(&client, seg, Op::Write, src.addr(), remote, len);
        assert_eq!(st, TaskState::Completed);
        assert_eq!(target.command("checksum"), checksum_of(&data));

        let mut dst = Buf::new(&client, vec![0; len]);
        let st = run(&client, seg, Op::Read, dst.addr(), remote, len);
        assert_eq!(st, TaskState::Completed);
        assert!(dst.buf == data, "read back what was written");

        // Unaligned ranges inside the buffer, both ways.
        let (at, n) = (12345, 100_000);
        let patch = pattern(42, n);
        dst.buf[..n].copy_from_slice(&patch);
        let st = run(&client, seg, Op::Write, dst.addr(), remote + at as u64, n);
        assert_eq!(st, TaskState::Completed);
        let mut expect = data;
        expect[at..at + n].copy_from_slice(&patch);
        assert_eq!(target.command("checksum"), checksum_of(&expect));
        dst.buf.fill(0);
        let (from, m) = (at - 1000, n + 2000);
        let st = run(&client, seg, Op::Read, dst.addr(), remote + from as u64, m);
        assert_eq!(st, TaskState::Completed);
        assert!(dst.buf[..m] == expect[from..from + m]);

        let stats = client.stats();
        assert!(
            stats.rdma_bytes >= 2 * len as u64 + (n + m) as u64,
            "{stats:?}"
        );
        assert_eq!(stats.tcp_bytes, 0, "{stats:?}");
        for (i, d) in DEVICES.iter().enumerate() {
            let moved = emu.bytes(d) - before[i];
            assert!(moved >= 1 << 20, "{d} carried only {moved} bytes");
        }
    }
    // The engine is gone: its QPs were destroyed and its MRs deregistered, and with
    // them their fabric entries.
    assert_eq!(emu.fabric_entries(std::process::id()), 0);
}

/// A target's device memory, registered through a dma-buf in the target process, is
/// reached through that process's mapping of it.
#[test]
fn reaches_a_target_process_device_memory_through_its_dma_buf() {
    let Some(_) = emu() else { return };
    if common::fakes::fakes().is_none() {
        return;
    }
    let _g = serial();
    let len = (2 << 20) + 4096;
    let mut target = rdma_target(len, &["--location", "cuda:1"]);
    let client = rdma_engine(1);
    let seg = client.open_segment(&target.name).unwrap();
    let desc = client.segment_descriptor(seg).unwrap();
    assert_eq!(desc.buffers[0].name, "cuda:1");
    let remote = desc.buffers[0].addr;
    let data = pattern(43, len);
    let src = Buf::new(&client, data.clone());
    let st = run(&client, seg, Op::Write, src.addr(), remote, len);
    assert_eq!(st, TaskState::Completed);
    // Read back through the target's GPU driver.
    assert_eq!(target.command("checksum"), checksum_of(&data));
    let dst = Buf::new(&client, vec![0; len - 8192]);
    let st = run(
        &client,
        seg,
        Op::Read,
        dst.addr(),
        remote + 8192,
        len - 8192,
    );
    assert_eq!(st, TaskState::Completed);
    assert!(dst.buf[..] == data[8192..]);
    assert_eq!(client.stats().tcp_bytes, 0);
}

/// A target killed while a transfer to it is under way: the slices posted before are
/// done, the rest fail, and the transfer ends Failed rather than hanging.
#[test]
fn target_killed_mid_transfer_fails_the_transfer() {
    let Some(emu) = emu() else { return };
    let _g = serial();
    // One rail (emu0 to emu0), whose send queue holds at most 256 requests: with the
    // completions held, a transfer of more slices cannot be fully posted before the kill.
    let len = 20 << 20;
    let mut target = rdma_target(len, &["--device-name", "emu0"]);
    let client = rdma_engine_with(1, &[("device_name", "emu0")]);
    let seg = client.open_segment(&target.name).unwrap();
    let remote = client.segment_descriptor(seg).unwrap().buffers[0].addr;
    let src = Buf::new(&client, pattern(44, len));
    let before = emu.bytes("emu0");
    let held = emu.hold_completions();
    let batch = start(&client, seg, Op::Write, src.addr(), remote, len);
    assert!(emu.wait_held(1) >= 1, "the transfer started");
    target.kill();
    drop(held);
    let st = finish(&client, batch);
    let moved = emu.bytes("emu0") - before;
    assert_eq!(st, TaskState::Failed, "{moved} bytes moved");
    assert!(
        moved > 0 && moved < len as u64,
        "{moved} of {len} bytes moved"
    );
    assert!(client.stats().failed_slices > 0);
}

/// Requests on rails connected to a target that has since died fail (its HCA is gone),
/// and the fabric entries it left are reclaimed.
#[test]
fn dead_target_fails_on_connected_rails_and_its_entries_are_reclaimed() {
    let Some(emu) = emu() else { return };
    let _g = serial();
    let len = 1 << 20;
    let mut target = rdma_target(len, &[]);
    let client = rdma_engine(1);
    let seg = client.open_segment(&target.name).unwrap();
    let remote = client.segment_descriptor(seg).unwrap().buffers[0].addr;
    let mut local = Buf::new(&client, pattern(45, len));
    let st = run(&client, seg, Op::Write, local.addr(), remote, len);
    assert_eq!(st, TaskState::Completed);
    let pid = target.child.id();
    assert!(emu.fabric_entries(pid) > 0, "the target's QPs and MRs");
    target.kill();
    let st = run(&client, seg, Op::Write, local.addr(), remote, len);
    assert_eq!(st, TaskState::Failed);
    local.buf.fill(0);
    let st = run(&client, seg, Op::Read, local.addr(), remote, len);
    assert_eq!(st, TaskState::Failed);
    assert!(local.buf.iter().all(|b| *b == 0), "nothing was read");
    emu.fabric_reclaim();
    assert_eq!(emu.fabric_entries(pid), 0, "a dead process's entries go");
}

/// Posts one slice on a hand-driven worker and drives it (bounded) to its outcome.
fn drive(worker: &mut Box<dyn TransportWorker>, slice: Slice) -> Outcome {
    let fd = worker
        .wait_fd()
        .expect("the RDMA worker has a wait descriptor");
    let mut done = Vec::new();
    worker.post(slice, &mut done);
    for _ in 0..50 {
        worker.progress(Instant::now(), &mut done);
        if let Some(f) = done.pop() {
            return f.outcome;
        }
        readable(fd, 30_000);
    }
    panic!("the slice never finished");
}

/// A slice the remote HCA must refuse: its first remote access error asks for a fresh
/// descriptor (`Stale`); refused again, it is `Rejected` with the completion status.
fn refused(worker: &mut Box<dyn TransportWorker>, slice: Slice) {
    assert_eq!(drive(worker, slice.clone()), Outcome::Stale);
    match drive(worker, slice) {
        Outcome::Rejected(why) => assert!(why.contains("remote access error"), "{why}"),
        other => panic!("{other:?}"),
    }
}

/// Accesses the target's HCA must refuse, through a hand-driven worker whose
/// descriptors of the target claim them: past the end of its buffer, and with wrong
/// rkeys; then, through the engine, the keys of a buffer the target has unregistered.
#[test]
fn target_process_refuses_bad_rkeys_and_ranges() {
    let Some(_) = emu() else { return };
    let _g = serial();
    let len = 1 << 16;
    let mut target = rdma_target(len, &[]);
    let client = rdma_engine(1);
    let seg = client.open_segment(&target.name).unwrap();
    let desc = client.segment_descriptor(seg).unwrap();
    let remote = desc.buffers[0].addr;

    let memory = Arc::new(LocalMemory::new());
    let config = BackendConfig {
        devices: "emu0".to_owned(),
        ..Default::default()
    };
    let transport = RdmaTransport::start(&config, memory.clone()).unwrap();
    transport.describe(&mut SegmentDesc::new("hand-driven"));
    let src = pattern(46, 4096);
    let base = src.as_ptr() as u64;
    let region = memory.register(base, src.len() as u64, "cpu:0").unwrap();
    transport.register(&region).unwrap();
    let mut worker = transport.new_worker().unwrap();
    let rpc = target.name.clone();
    let peer = |id: u64, desc: SegmentDesc| {
        Arc::new(Peer::new(
            id,
            desc,
            Endpoints {
                data: "127.0.0.1:9".parse().unwrap(),
                rpc: rpc.clone(),
            },
        ))
    };
    let write = |peer: &Arc<Peer>, id: u64, remote: u64| Slice {
        id,
        op: Op::Write,
        local: base,
        local_kind: MemoryKind::Host,
        remote,
        len: 4096,
        peer: peer.clone(),
        deadline: Instant::now() + Duration::from_secs(30),
    };

    // The published keys and range: the write lands.
    let good = peer(1, desc.clone());
    assert_eq!(drive(&mut worker, write(&good, 1, remote)), Outcome::Done);
    let mut expect = vec![0u8; len];
    expect[..4096].copy_from_slice(&src);
    assert_eq!(target.command("checksum"), checksum_of(&expect));

    // 8 KiB more than the target registered: a write across the end of its MR.
    let mut longer = desc.clone();
    longer.buffers[0].length += 8192;
    let longer = peer(2, longer);
    refused(&mut worker, write(&longer, 2, remote + len as u64 - 2048));
    // Wrong rkeys on every NIC, inside the buffer.
    let mut wrong = desc.clone();
    for k in &mut wrong.buffers[0].rkey {
        *k ^= 0x5555;
    }
    let wrong = peer(3, wrong);
    refused(&mut worker, write(&wrong, 3, remote + 8192));
    assert_eq!(
        target.command("checksum"),
        checksum_of(&expect),
        "nothing else was written"
    );
    drop(worker);
    transport.unregister(&region);
    memory.unregister(base).unwrap();

    // The engine's cached keys of a buffer the target has since unregistered.
    let local = Buf::new(&client, src);
    assert_eq!(target.command("unregister"), "unregistered");
    let st = run(&client, seg, Op::Write, local.addr(), remote, 4096);
    assert_eq!(st, TaskState::Failed);
}

/// A peer whose RPC port hands out its descriptor but never answers a Connection
/// request: it keeps those connections open, unanswered, until stopped.
struct SilentPeer {
    name: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SilentPeer {
    /// Serves `desc` (renamed after its own address); reports each handshake on `seen`.
    fn start(mut desc: SegmentDesc, seen: mpsc::Sender<()>) -> SilentPeer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let name = listener.local_addr().unwrap().to_string();
        desc.name = name.clone();
        let text = desc.to_json().to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut unanswered = Vec::new();
            for conn in listener.incoming() {
                if stopping.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(mut conn) = conn else { continue };
                let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
                match rpc::read_frame(&mut conn, rpc::MAX_FRAME_LEN) {
                    Ok((RpcType::Metadata, _)) => {
                        let _ = rpc::write_frame(&mut conn, RpcType::Metadata, &text);
                        let _ = conn.flush();
                    }
                    Ok((RpcType::Connection, _)) => {
                        unanswered.push(conn);
                        let _ = seen.send(());
                    }
                    _ => {}
                }
            }
            // Returning closes the listener and hangs up on every unanswered handshake.
        });
        SilentPeer {
            name,
            stop,
            thread: Some(thread),
        }
    }

    fn stop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.store(true, Ordering::SeqCst);
            // Wakes the accept loop; it may already have stopped on another connection.
            let _ = TcpStream::connect(&self.name);
            t.join().unwrap();
        }
    }
}

impl Drop for SilentPeer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One engine worker serves a healthy peer while a handshake with a silent one is
/// outstanding; once the silent peer hangs up, the request to it fails (on every rail
/// it tries) rather than hanging.
#[test]
fn slow_handshake_does_not_hold_up_the_worker() {
    let Some(_) = emu() else { return };
    let _g = serial();
    let server = rdma_engine(1);
    let client = rdma_engine(1);
    let remote = Buf::new(&server, vec![0; 1 << 16]);
    let local = Buf::new(&client, pattern(31, 1 << 16));
    let (seen, handshakes) = mpsc::channel();
    let mut silent = SilentPeer::start(server.descriptor(), seen);
    let slow = client.open_segment(&silent.name).unwrap();
    let healthy = client.open_segment(server.segment_name()).unwrap();
    let stuck = start(&client, slow, Op::Read, local.addr(), remote.addr(), 4096);
    handshakes
        .recv_timeout(Duration::from_secs(30))
        .expect("the client starts a handshake with the silent peer");
    // The only worker, with that handshake outstanding, still moves the write.
    let (at, len) = (8192, 8192);
    let st = run(
        &client,
        healthy,
        Op::Write,
        local.addr() + at as u64,
        remote.addr() + at as u64,
        len,
    );
    assert_eq!(st, TaskState::Completed);
    assert!(remote.buf[at..at + len] == local.buf[at..at + len]);
    // The read still waits: each of its attempts gives up only after the handshake
    // timeout, seconds after a loopback write is done.
    let state = client.task_status(stuck, 0).unwrap().state;
    assert_eq!(state, TaskState::Pending);
    silent.stop();
    assert_eq!(finish(&client, stuck), TaskState::Failed);
}

/// Hand-written layouts against the installed verbs.h, when there is one.
#[test]
fn layouts_match_verbs_h() {
    if !Path::new("/usr/include/infiniband/verbs.h").exists() || !have_cc() {
        eprintln!("skipping: no infiniband/verbs.h (apt-get install libibverbs-dev) or cc");
        return;
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let src = dir.join("verbs_layout.c");
    let exe = dir.join("verbs_layout");
    std::fs::write(
        &src,
        r#"#include <infiniband/verbs.h>
#include <stdio.h>
#include <stddef.h>
#define S(t) printf("%s %zu\n", #t, sizeof(struct t));
#define O(t, f) printf("%s.%s %zu\n", #t, #f, offsetof(struct t, f));
int main(void) {
  S(ibv_device) S(ibv_context) S(ibv_context_ops) S(ibv_pd) S(ibv_mr) S(ibv_cq) S(ibv_qp)
  S(ibv_qp_init_attr) S(ibv_qp_attr) S(ibv_send_wr) S(ibv_sge) S(ibv_wc) S(ibv_port_attr)
  S(ibv_ah_attr) S(ibv_comp_channel)
  O(ibv_comp_channel, fd) O(ibv_cq, channel) O(ibv_context_ops, req_notify_cq)
  O(ibv_context_ops, poll_cq) O(ibv_context_ops, post_send) O(ibv_context_ops, post_recv)
  O(ibv_context, ops) O(ibv_qp, qp_num) O(ibv_qp, state) O(ibv_mr, lkey) O(ibv_mr, rkey)
  O(ibv_send_wr, wr.rdma.remote_addr) O(ibv_send_wr, wr.rdma.rkey) O(ibv_send_wr, send_flags)
  O(ibv_qp_attr, ah_attr) O(ibv_qp_attr, dest_qp_num) O(ibv_qp_attr, max_dest_rd_atomic)
  O(ibv_qp_attr, rnr_retry) O(ibv_wc, byte_len) O(ibv_wc, qp_num) O(ibv_port_attr, lid)
  O(ibv_port_attr, link_layer) O(ibv_device, name)
  return 0;
}
"#,
    )
    .unwrap();
    let ok = std::process::Command::new("cc")
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .status()
        .unwrap()
        .success();
    assert!(ok, "layout probe compiles");
    let out = std::process::Command::new(&exe).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let c: std::collections::HashMap<&str, usize> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect();
    use std::mem::{offset_of, size_of};
    let rust: &[(&str, usize)] = &[
        ("ibv_device", size_of::<ibv::ibv_device>()),
        ("ibv_context", size_of::<ibv::ibv_context>()),
        ("ibv_context_ops", size_of::<ibv::ibv_context_ops>()),
        ("ibv_pd", size_of::<ibv::ibv_pd>()),
        ("ibv_mr", size_of::<ibv::ibv_mr>()),
        ("ibv_cq", size_of::<ibv::ibv_cq>()),
        ("ibv_qp", size_of::<ibv::ibv_qp>()),
        ("ibv_qp_init_attr", size_of::<ibv::ibv_qp_init_attr>()),
        ("ibv_qp_attr", size_of::<ibv::ibv_qp_attr>()),
        ("ibv_send_wr", size_of::<ibv::ibv_send_wr>()),
        ("ibv_sge", size_of::<ibv::ibv_sge>()),
        ("ibv_wc", size_of::<ibv::ibv_wc>()),
        ("ibv_port_attr", size_of::<ibv::ibv_port_attr>()),
        ("ibv_ah_attr", size_of::<ibv::ibv_ah_attr>()),
        ("ibv_comp_channel", size_of::<ibv::ibv_comp_channel>()),
        ("ibv_comp_channel.fd", offset_of!(ibv::ibv_comp_channel, fd)),
        ("ibv_cq.channel", offset_of!(ibv::ibv_cq, channel)),
        (
            "ibv_context_ops.req_notify_cq",
            offset_of!(ibv::ibv_context_ops, req_notify_cq),
        ),
        (
            "ibv_context_ops.poll_cq",
            offset_of!(ibv::ibv_context_ops, poll_cq),
        ),
        (
            "ibv_context_ops.post_send",
            offset_of!(ibv::ibv_context_ops, post_send),
        ),
        (
            "ibv_context_ops.post_recv",
            offset_of!(ibv::ibv_context_ops, post_recv),
        ),
        ("ibv_context.ops", offset_of!(ibv::ibv_context, ops)),
        ("ibv_qp.qp_num", offset_of!(ibv::ibv_qp, qp_num)),
        ("ibv_qp.state", offset_of!(ibv::ibv_qp, state)),
        ("ibv_mr.lkey", offset_of!(ibv::ibv_mr, lkey)),
        ("ibv_mr.rkey", offset_of!(ibv::ibv_mr, rkey)),
        (
            "ibv_send_wr.wr.rdma.remote_addr",
            offset_of!(ibv::ibv_send_wr, rdma),
        ),
        (
            "ibv_send_wr.wr.rdma.rkey",
            offset_of!(ibv::ibv_send_wr, rdma) + offset_of!(ibv::ibv_send_wr_rdma, rkey),
        ),
        (
            "ibv_send_wr.send_flags",
            offset_of!(ibv::ibv_send_wr, send_flags),
        ),
        ("ibv_qp_attr.ah_attr", offset_of!(ibv::ibv_qp_attr, ah_attr)),
        (
            "ibv_qp_attr.dest_qp_num",
            offset_of!(ibv::ibv_qp_attr, dest_qp_num),
        ),
        (
            "ibv_qp_attr.max_dest_rd_atomic",
            offset_of!(ibv::ibv_qp_attr, max_dest_rd_atomic),
        ),
        (
            "ibv_qp_attr.rnr_retry",
            offset_of!(ibv::ibv_qp_attr, rnr_retry),
        ),
        ("ibv_wc.byte_len", offset_of!(ibv::ibv_wc, byte_len)),
        ("ibv_wc.qp_num", offset_of!(ibv::ibv_wc, qp_num)),
        ("ibv_port_attr.lid", offset_of!(ibv::ibv_port_attr, lid)),
        (
            "ibv_port_attr.link_layer",
            offset_of!(ibv::ibv_port_attr, link_layer),
        ),
        ("ibv_device.name", offset_of!(ibv::ibv_device, name)),
    ];
    for (name, size) in rust {
        assert_eq!(c.get(name), Some(size), "{name}");
    }
}

/// A missing library is an ordinary error naming the override variable. The verbs
/// table loads once per process, so this runs in a child process.
#[test]
fn info_lists_emulated_nics_and_the_topology_in_use() {
    let Some(_) = emu() else { return };
    // The child inherits MC_IBVERBS_LIB and VERBS_EMU_DEVICES from emu().
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mooncake"))
        .arg("info")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for d in DEVICES {
        assert!(
            text.contains(&format!("device {d} port 1: active")),
            "{text}"
        );
    }
    // Emulated NICs are unknown to sysfs: every NIC preferred.
    assert!(
        text.contains(r#"topology (NIC priority matrix, device_name overrides): {"cpu:0":[["emu0","emu1","emu2"],[]]}"#),
        "{text}"
    );
}

#[test]
fn missing_library_is_backend_unavailable() {
    if std::env::var("MC_RDMA_TEST_CHILD").as_deref() == Ok("missing") {
        let mut cfg = EngineConfig::default();
        cfg.set("protocol", "rdma").unwrap();
        let err = Engine::new(cfg).err().expect("start-up fails");
        assert_eq!(err.code(), Code::BackendUnavailable, "{err}");
        let text = err.to_string();
        assert!(text.contains("MC_IBVERBS_LIB"), "{text}");
        assert!(text.contains("/nonexistent/libibverbs.so.1"), "{text}");
        println!("CHILD-OK");
        return;
    }
    if std::env::var_os("MC_RDMA_TEST_CHILD").is_some() {
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "missing_library_is_backend_unavailable",
            "--nocapture",
        ])
        .env("MC_RDMA_TEST_CHILD", "missing")
        .env("MC_IBVERBS_LIB", "/nonexistent/libibverbs.so.1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("CHILD-OK"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The system's libibverbs (when installed) on this machine, which has no RDMA
/// devices: `info` says so and start-up fails with BackendUnavailable, not a crash.
#[test]
fn system_libibverbs_without_devices() {
    if std::env::var("MC_RDMA_TEST_CHILD").as_deref() == Ok("system") {
        let info = ibv::info();
        println!("{info:?}");
        let mut cfg = EngineConfig::default();
        cfg.set("protocol", "rdma").unwrap();
        match Engine::new(cfg) {
            // A machine with a real HCA starts; nothing more to check here.
            Ok(_) => assert!(!info.devices.is_empty(), "{info:?}"),
            Err(err) => {
                assert_eq!(err.code(), Code::BackendUnavailable, "{err}");
                if info.library.is_ok() {
                    assert!(err.to_string().contains("no RDMA devices"), "{err}");
                    assert!(
                        info.notes.iter().any(|n| n.contains("no RDMA devices")),
                        "{info:?}"
                    );
                } else {
                    assert!(err.to_string().contains("MC_IBVERBS_LIB"), "{err}");
                }
            }
        }
        println!("CHILD-OK");
        return;
    }
    if std::env::var_os("MC_RDMA_TEST_CHILD").is_some() {
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "system_libibverbs_without_devices",
            "--nocapture",
        ])
        .env("MC_RDMA_TEST_CHILD", "system")
        .env_remove("MC_IBVERBS_LIB")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("CHILD-OK"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
