//! Device memory through fake drivers (tests/emu/fake_{cuda,hip,acl}.c, built here with
//! the system C compiler): loading and dispatch, classification at registration, and
//! staging through host bounce buffers over TCP and in-process. The fakes map "device"
//! memory PROT_NONE, so any CPU access to it (a missed staging path) crashes the test.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::fakes::{counter, fakes, Fakes};
use common::{engine_with, pattern};
use mooncake::device::{self, MemoryKind};
use mooncake::engine::TaskState;
use mooncake::ffi::{acl, cuda, hip};
use mooncake::{Code, Engine, Op, Request};

macro_rules! need_fakes {
    () => {
        match fakes() {
            Some(f) => f,
            None => return,
        }
    };
}

fn cuda_copies(f: &Fakes) -> u64 {
    counter(&f.cuda, "fake_cuda_copies")
}

/// Fresh device memory of `kind` through our own driver tables.
fn dev_alloc(kind: MemoryKind, len: usize) -> u64 {
    match kind {
        MemoryKind::Cuda(n) => cuda::api().unwrap().mem_alloc(n, len).unwrap(),
        MemoryKind::Hip(n) => hip::api().unwrap().mem_alloc(n, len).unwrap(),
        MemoryKind::Npu(n) => acl::api().unwrap().mem_alloc(n, len).unwrap(),
        MemoryKind::Host => unreachable!(),
    }
}

fn dev_write(kind: MemoryKind, addr: u64, bytes: &[u8]) {
    // SAFETY: `addr` is device memory of at least `bytes.len()` bytes.
    unsafe { device::copy_from_host(kind, addr, bytes.as_ptr(), bytes.len()) }.unwrap();
}

fn dev_read(kind: MemoryKind, addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `addr` is device memory of at least `len` bytes.
    unsafe { device::copy_to_host(kind, out.as_mut_ptr(), addr, len) }.unwrap();
    out
}

fn run(engine: &Engine, reqs: &[Request]) -> Vec<TaskState> {
    let batch = engine.allocate_batch(reqs.len()).unwrap();
    // SAFETY: every local buffer outlives the wait below.
    unsafe { engine.submit(batch, reqs) }.unwrap();
    let _ = engine.wait_batch(batch, Some(Duration::from_secs(30)));
    let states = (0..reqs.len())
        .map(|i| engine.task_status(batch, i).unwrap().state)
        .collect();
    engine.free_batch(batch).unwrap();
    states
}

fn one_worker_tcp_engine() -> Engine {
    let mut cfg = mooncake::EngineConfig::default();
    cfg.set("metadata", "P2PHANDSHAKE").unwrap();
    cfg.set("protocol", "tcp").unwrap();
    cfg.set("workers", "1").unwrap();
    Engine::new(cfg).unwrap()
}

fn register(engine: &Engine, addr: u64, len: usize, location: &str) {
    // SAFETY: test buffers live until the end of the test (device memory is never
    // freed by the fakes' bump allocators).
    unsafe { engine.register_memory(addr as *mut u8, len, location) }.unwrap();
}

#[test]
fn classification_asks_the_driver_once_at_registration() {
    let _f = need_fakes!();
    let host = vec![0u8; 4096];
    let h = host.as_ptr() as u64;
    assert_eq!(
        device::classify(h, 4096, "cpu:0").unwrap(),
        MemoryKind::Host
    );
    for kind in [MemoryKind::Cuda(0), MemoryKind::Cuda(1), MemoryKind::Hip(1)] {
        let d = dev_alloc(kind, 8192);
        assert_eq!(device::classify(d, 8192, &kind.location()).unwrap(), kind);
        // Host memory claimed as device memory, and the wrong device, are refused.
        let err = device::classify(h, 4096, &kind.location()).unwrap_err();
        assert_eq!(err.code(), Code::InvalidParams, "{err}");
        assert!(err.to_string().contains("host memory"), "{err}");
        let other = match kind {
            MemoryKind::Cuda(n) => MemoryKind::Cuda(1 - n),
            MemoryKind::Hip(n) => MemoryKind::Hip(1 - n),
            k => k,
        };
        assert!(device::classify(d, 8192, &other.location()).is_err());
    }
    // Ascend: checked against the device count and, as the fake (like CANN 7+) has
    // one, ACL's pointer query.
    let npu = dev_alloc(MemoryKind::Npu(1), 4096);
    assert_eq!(
        device::classify(npu, 1, "npu:1").unwrap(),
        MemoryKind::Npu(1)
    );
    assert!(device::classify(npu, 1, "npu:0").is_err());
    assert!(device::classify(h, 1, "npu:1").is_err());
    assert!(device::classify(h, 1, "npu:7").is_err());

    let engine = engine_with("P2PHANDSHAKE", "tcp");
    // SAFETY: `host` is a live 4096-byte buffer (refused here: not CUDA memory).
    let err =
        unsafe { engine.register_memory(host.as_ptr() as *mut u8, 4096, "cuda:0") }.unwrap_err();
    assert_eq!(err.code(), Code::InvalidParams);
    let d = dev_alloc(MemoryKind::Cuda(0), 4096);
    register(&engine, d, 4096, "cuda:0");
    let desc = engine.descriptor();
    assert_eq!(desc.buffer_for(d, 4096).unwrap().name, "cuda:0");
    engine.unregister_memory(d as *mut u8).unwrap();
}

#[test]
fn tcp_server_stages_device_memory_through_bounce_buffers() {
    let f = need_fakes!();
    let kind = MemoryKind::Cuda(0);
    let server = engine_with("P2PHANDSHAKE", "tcp");
    let client = engine_with("P2PHANDSHAKE", "tcp");
    // Several slices, each more than one bounce, plus an odd tail.
    let len = (9 << 20) + 123;
    let dev = dev_alloc(kind, len);
    dev_write(kind, dev, &pattern(1, len));
    register(&server, dev, len, "cuda:0");
    let seg = client.open_segment(server.segment_name()).unwrap();
    let before = cuda_copies(f);

    let mut got = vec![0u8; len];
    let read = Request {
        op: Op::Read,
        local: got.as_mut_ptr() as u64,
        segment: seg,
        remote: dev,
        len: len as u64,
    };
    assert_eq!(run(&client, &[read]), [TaskState::Completed]);
    assert!(got == pattern(1, len), "device bytes read over tcp");

    let src = pattern(2, len - 1000);
    let write = Request {
        op: Op::Write,
        local: src.as_ptr() as u64,
        segment: seg,
        remote: dev + 1000,
        len: src.len() as u64,
    };
    assert_eq!(run(&client, &[write]), [TaskState::Completed]);
    let now = dev_read(kind, dev, len);
    assert_eq!(&now[..1000], &pattern(1, len)[..1000]);
    assert!(now[1000..] == src[..], "device bytes written over tcp");
    // 2 × 9 MiB through 4 MiB bounces: at least 3 + 3 driver copies.
    assert!(cuda_copies(f) - before >= 6, "staging used the driver");
    server.unregister_memory(dev as *mut u8).unwrap();
}

#[test]
fn client_side_device_memory_is_staged_by_the_worker() {
    let f = need_fakes!();
    let kind = MemoryKind::Cuda(1);
    let server = engine_with("P2PHANDSHAKE", "tcp");
    // One worker: 11 staged slices exceed its in-flight bound, so some wait.
    let client = one_worker_tcp_engine();
    let len = (42 << 20) + 7;
    let mut remote = pattern(3, len);
    register(&server, remote.as_mut_ptr() as u64, len, "cpu:0");
    let dev = dev_alloc(kind, len);
    register(&client, dev, len, "cuda:1");
    let seg = client.open_segment(server.segment_name()).unwrap();
    let before = cuda_copies(f);

    // Remote host → local device.
    let read = Request {
        op: Op::Read,
        local: dev,
        segment: seg,
        remote: remote.as_ptr() as u64,
        len: len as u64,
    };
    assert_eq!(run(&client, &[read]), [TaskState::Completed]);
    assert!(
        dev_read(kind, dev, len) == remote,
        "read landed in device memory"
    );

    // Local device → remote host.
    dev_write(kind, dev, &pattern(4, len));
    let write = Request {
        op: Op::Write,
        local: dev,
        segment: seg,
        remote: remote.as_ptr() as u64,
        len: len as u64,
    };
    assert_eq!(run(&client, &[write]), [TaskState::Completed]);
    assert!(remote == pattern(4, len), "write came from device memory");
    assert!(cuda_copies(f) - before >= 2 * 11);
    client.unregister_memory(dev as *mut u8).unwrap();
    server.unregister_memory(remote.as_mut_ptr()).unwrap();
}

/// A synchronous transfer over 1 MiB runs on the calling thread when the engine has one
/// worker, but not into device memory: that is staged through bounce buffers, and the
/// worker keeps the one set of them (each calling thread would pin its own).
#[test]
fn a_large_synchronous_transfer_to_device_memory_stays_with_the_worker() {
    let _f = need_fakes!();
    let kind = MemoryKind::Cuda(0);
    let server = engine_with("P2PHANDSHAKE", "tcp");
    let client = one_worker_tcp_engine();
    let len = 4 << 20;
    let mut remote = pattern(6, len);
    register(&server, remote.as_mut_ptr() as u64, len, "cpu:0");
    let dev = dev_alloc(kind, len);
    register(&client, dev, len, "cuda:0");
    let mut host = vec![0u8; len];
    let seg = client.open_segment(server.segment_name()).unwrap();
    let read = |local: u64| Request {
        op: Op::Read,
        local,
        segment: seg,
        remote: remote.as_ptr() as u64,
        len: len as u64,
    };
    let before = client.stats();
    // SAFETY: the device buffer stays registered, and `host` alive, past the calls.
    unsafe { client.transfer_sync(&[read(dev)]) }.unwrap();
    let to_device = client.stats();
    // SAFETY: as above.
    unsafe { client.transfer_sync(&[read(host.as_mut_ptr() as u64)]) }.unwrap();
    let to_host = client.stats();
    assert!(dev_read(kind, dev, len) == remote && host == remote);
    assert_eq!(
        to_device.inline_transfers, before.inline_transfers,
        "{to_device:?}"
    );
    assert!(
        to_device.worker_handoffs > before.worker_handoffs,
        "{to_device:?}"
    );
    assert_eq!(
        to_host.inline_transfers,
        to_device.inline_transfers + 1,
        "{to_host:?}"
    );
    assert_eq!(
        to_host.worker_handoffs, to_device.worker_handoffs,
        "{to_host:?}"
    );
    client.unregister_memory(dev as *mut u8).unwrap();
    server.unregister_memory(remote.as_mut_ptr()).unwrap();
}

#[test]
fn device_to_device_over_tcp_for_each_runtime() {
    let f = need_fakes!();
    for (kind, lib, name) in [
        (MemoryKind::Cuda(0), &f.cuda, "fake_cuda_copies"),
        (MemoryKind::Hip(0), &f.hip, "fake_hip_copies"),
        (MemoryKind::Npu(1), &f.acl, "fake_acl_copies"),
    ] {
        let server = engine_with("P2PHANDSHAKE", "tcp");
        let client = engine_with("P2PHANDSHAKE", "tcp");
        let len = (5 << 20) + 11;
        let (a, b) = (dev_alloc(kind, len), dev_alloc(kind, len));
        dev_write(kind, a, &pattern(5, len));
        dev_write(kind, b, &pattern(6, len));
        register(&server, a, len, &kind.location());
        register(&client, b, len, &kind.location());
        let seg = client.open_segment(server.segment_name()).unwrap();
        let before = counter(lib, name);
        let read = Request {
            op: Op::Read,
            local: b,
            segment: seg,
            remote: a,
            len: len as u64,
        };
        assert_eq!(run(&client, &[read]), [TaskState::Completed], "{kind:?}");
        assert!(dev_read(kind, b, len) == pattern(5, len), "{kind:?} read");
        dev_write(kind, b, &pattern(7, len));
        let write = Request {
            op: Op::Write,
            ..read
        };
        assert_eq!(run(&client, &[write]), [TaskState::Completed], "{kind:?}");
        assert!(dev_read(kind, a, len) == pattern(7, len), "{kind:?} write");
        assert!(counter(lib, name) - before >= 8, "{kind:?} staged");
        client.unregister_memory(b as *mut u8).unwrap();
        server.unregister_memory(a as *mut u8).unwrap();
    }
}

#[test]
fn local_transport_copies_device_memory_with_the_driver() {
    let f = need_fakes!();
    let engine = engine_with("P2PHANDSHAKE", "tcp");
    let len = 3 << 20;
    let (d0, d1) = (
        dev_alloc(MemoryKind::Cuda(0), len),
        dev_alloc(MemoryKind::Cuda(1), len),
    );
    let mut host = pattern(8, len);
    register(&engine, d0, len, "cuda:0");
    register(&engine, d1, len, "cuda:1");
    register(&engine, host.as_mut_ptr() as u64, len, "cpu:0");
    let own = engine.open_segment(engine.segment_name()).unwrap();
    let before = cuda_copies(f);
    let h = host.as_mut_ptr() as u64;
    // host → d0, d0 → d1 (local device side, remote device side), d1 → host.
    let req = |op, local, remote| Request {
        op,
        local,
        segment: own,
        remote,
        len: len as u64,
    };
    assert_eq!(
        run(&engine, &[req(Op::Write, h, d0)]),
        [TaskState::Completed]
    );
    assert_eq!(
        run(&engine, &[req(Op::Write, d0, d1)]),
        [TaskState::Completed]
    );
    host.fill(0);
    assert_eq!(
        run(&engine, &[req(Op::Read, h, d1)]),
        [TaskState::Completed]
    );
    assert!(host == pattern(8, len), "host → cuda:0 → cuda:1 → host");
    // (Other tests copy concurrently, so only a lower bound holds.)
    assert!(cuda_copies(f) - before >= 3, "each request used the driver");
    assert_eq!(engine.stats().local_bytes, 3 * len as u64);
}

#[test]
fn ipc_and_dma_buf_exports_name_the_allocation() {
    let _f = need_fakes!();
    let kind = MemoryKind::Cuda(0);
    let d = dev_alloc(kind, 1 << 20);
    let ipc = device::ipc_export(kind, d + 4096).unwrap();
    assert_eq!(
        ipc.offset, 4096,
        "handles name the allocation; the buffer is inside"
    );
    // CUDA refuses to open a handle in the process that exported it (so does the fake);
    // tests/device_ipc.rs opens them from another process.
    assert!(device::ipc_open(kind, &ipc.handle).is_err());
    let buf = device::dma_buf(kind, d + 8192, 4096).unwrap();
    assert_eq!(buf.offset, 8192);
    // SAFETY: fstat on a descriptor we own, into a zeroed stat.
    let size = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        assert_eq!(
            libc::fstat(std::os::fd::AsRawFd::as_raw_fd(&buf.fd), &mut st),
            0
        );
        st.st_size
    };
    assert_eq!(size, 1 << 20, "the dma-buf covers the whole allocation");
    assert!(cuda::api().unwrap().has_dma_buf());
    assert!(
        device::dma_buf(kind, d + 4096, 1 << 20).is_err(),
        "past the allocation"
    );

    let hk = MemoryKind::Hip(1);
    let hd = dev_alloc(hk, 8192);
    assert_eq!(device::ipc_export(hk, hd + 100).unwrap().offset, 100);
    assert_eq!(
        device::dma_buf(hk, hd, 4096).unwrap_err().code(),
        Code::NotSupported
    );
    assert_eq!(
        device::ipc_export(MemoryKind::Npu(0), 0x1000)
            .unwrap_err()
            .code(),
        Code::NotSupported
    );
    // Not device memory at all: the driver's range query refuses it.
    let host = [0u8; 64];
    assert!(device::ipc_export(kind, host.as_ptr() as u64).is_err());
}

#[test]
fn engine_allocates_zeroed_device_buffers() {
    let _f = need_fakes!();
    let engine = engine_with("P2PHANDSHAKE", "tcp");
    for location in ["cuda:1", "hip:0", "npu:0"] {
        let kind = MemoryKind::parse_location(location).unwrap();
        let len = (4 << 20) + 10;
        let p = engine.allocate_buffer(len, location).unwrap() as u64;
        assert!(dev_read(kind, p, len).iter().all(|&b| b == 0), "{location}");
        let desc = engine.descriptor();
        let buf = desc.buffer_for(p, len as u64).unwrap();
        assert_eq!(buf.name, location);
        assert_eq!(buf.ipc.is_some(), location != "npu:0", "{location}");
        engine.free_buffer(p as *mut u8).unwrap();
    }
}

#[test]
fn info_lists_fake_devices() {
    let _f = need_fakes!();
    let c = cuda::info();
    assert!(c.library.as_ref().unwrap().contains("libfake_cuda"));
    assert_eq!(
        c.devices,
        ["cuda:0 Fake CUDA Device 0", "cuda:1 Fake CUDA Device 1"]
    );
    assert_eq!(c.version.as_deref(), Some("12.4"));
    let h = hip::info();
    assert_eq!(h.devices.len(), 2, "{h:?}");
    assert_eq!(h.version.as_deref(), Some("5.2.21153"));
    let a = acl::info();
    assert_eq!(a.devices, ["npu:0", "npu:1"]);
}

#[test]
fn missing_library_or_symbol_names_the_override_variable() {
    let f = need_fakes!();
    let err = cuda::Cuda::load_from("/nonexistent/libcuda.so.1")
        .err()
        .unwrap();
    assert_eq!(
        mooncake::Error::from(err.clone()).code(),
        Code::BackendUnavailable
    );
    let text = err.to_string();
    assert!(
        text.contains("MC_CUDA_LIB") && text.contains("/nonexistent/libcuda.so.1"),
        "{text}"
    );
    // A library that is not the CUDA driver: the first missing symbol is named.
    let err = cuda::Cuda::load_from(f.hip.to_str().unwrap())
        .err()
        .unwrap();
    let text = err.to_string();
    assert!(
        text.contains("cuInit") && text.contains("MC_CUDA_LIB"),
        "{text}"
    );
    let err = acl::Acl::load_from(f.cuda.to_str().unwrap()).err().unwrap();
    assert!(err.to_string().contains("aclInit") && err.to_string().contains("MC_ACL_LIB"));

    // Through an engine, in a child process whose variable points nowhere.
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_registers_cuda_without_a_driver",
            "--ignored",
        ])
        .env("MC_DEVICE_TEST_CHILD", "1")
        .env("MC_CUDA_LIB", "/nonexistent/libcuda.so.1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "run by missing_library_or_symbol_names_the_override_variable"]
fn child_registers_cuda_without_a_driver() {
    if std::env::var_os("MC_DEVICE_TEST_CHILD").is_none() {
        return;
    }
    let engine = engine_with("P2PHANDSHAKE", "tcp");
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` is 4096 bytes and outlives `engine`.
    let err = unsafe { engine.register_memory(buf.as_mut_ptr(), 4096, "cuda:0") }.unwrap_err();
    assert_eq!(err.code(), Code::BackendUnavailable, "{err}");
    assert!(err.to_string().contains("MC_CUDA_LIB"), "{err}");
    // Host memory is unaffected.
    // SAFETY: `buf` is 4096 bytes and outlives `engine`.
    unsafe { engine.register_memory(buf.as_mut_ptr(), 4096, "cpu:0") }.unwrap();
    assert!(cuda::info().library.is_err());
}

#[test]
fn real_hip_runtime_without_a_gpu_reports_no_device() {
    let Some(path) = ["libamdhip64.so.5", "libamdhip64.so.6", "libamdhip64.so"]
        .iter()
        .map(|n| PathBuf::from("/usr/lib/x86_64-linux-gnu").join(n))
        .find(|p| p.exists())
    else {
        eprintln!("skipping: libamdhip64 is not installed");
        return;
    };
    let hip = match hip::Hip::load_from(path.to_str().unwrap()) {
        Ok(h) => h,
        Err(e) => panic!("the real HIP runtime should load: {e}"),
    };
    let info = hip::info_of(&hip);
    if !info.devices.is_empty() {
        eprintln!("this machine has an AMD GPU: {:?}", info.devices);
        return;
    }
    assert!(
        info.notes.iter().any(|n| n.starts_with("no device")),
        "{info:?}"
    );
}
