//! Device memory between processes on one host: CUDA and HIP IPC handles through the
//! shm transport, with the fake drivers (tests/emu/fake_gpu_mem.h), whose IPC really
//! maps the exporting process's allocation. A test binary of its own so the drivers'
//! copy counters are exact: one driver copy per slice proves nothing was staged.

mod common;

use std::time::Duration;

use common::fakes::{counter, fakes};
use common::{engine_with, pattern, Target};
use mooncake::device::{self, MemoryKind};
use mooncake::engine::SegmentId;
use mooncake::engine::TaskState;
use mooncake::util::crc32c::crc32c;
use mooncake::{Engine, Op, Request};

fn run(engine: &Engine, req: Request) -> TaskState {
    let batch = engine.allocate_batch(1).unwrap();
    // SAFETY: every local buffer outlives the wait below.
    unsafe { engine.submit(batch, &[req]) }.unwrap();
    let _ = engine.wait_batch(batch, Some(Duration::from_secs(30)));
    let state = engine.task_status(batch, 0).unwrap().state;
    engine.free_batch(batch).unwrap();
    state
}

fn request(op: Op, local: u64, segment: SegmentId, remote: u64, len: usize) -> Request {
    Request {
        op,
        local,
        segment,
        remote,
        len: len as u64,
    }
}

#[test]
fn device_memory_moves_between_processes_through_ipc_handles() {
    let Some(f) = fakes() else { return };
    for (family, lib, copies) in [
        ("cuda", &f.cuda, "fake_cuda_copies"),
        ("hip", &f.hip, "fake_hip_copies"),
    ] {
        // Under one bounce, so each transfer is one slice.
        let len = (3 << 20) + 5;
        let remote_location = format!("{family}:1");
        let mut target = Target::spawn_with(
            "P2PHANDSHAKE",
            len,
            &["--location", &remote_location, "--protocol", "shm"],
        );
        let engine = engine_with("P2PHANDSHAKE", "auto");
        let seg = engine.open_segment(&target.name).unwrap();
        let desc = engine.segment_descriptor(seg).unwrap();
        let remote = &desc.buffers[0];
        assert_eq!(remote.name, remote_location);
        assert!(
            remote.ipc.is_some(),
            "{family}: the target publishes a handle"
        );
        let remote = remote.addr;

        let local_kind = MemoryKind::parse_location(&format!("{family}:0")).unwrap();
        let local = engine.allocate_buffer(len, &local_kind.location()).unwrap() as u64;
        let data = pattern(11, len);
        // SAFETY: `local` is device memory of `len` bytes.
        unsafe { device::copy_from_host(local_kind, local, data.as_ptr(), len) }.unwrap();

        // Our device → their device: one driver copy between the two allocations.
        let before = counter(lib, copies);
        let write = request(Op::Write, local, seg, remote, len);
        assert_eq!(run(&engine, write), TaskState::Completed, "{family}");
        assert_eq!(
            counter(lib, copies) - before,
            1,
            "{family}: GPU to GPU, unstaged"
        );
        assert_eq!(
            target.command("checksum"),
            format!("crc32c {:08x}", crc32c(&data)),
            "{family}: the bytes are in the target's device memory"
        );

        // Their device → our host memory, at an offset: one driver copy again.
        let mut host = vec![0u8; len - 4096];
        let host_addr = host.as_mut_ptr() as u64;
        // SAFETY: `host` outlives its registration (unregistered below).
        unsafe { engine.register_memory(host.as_mut_ptr(), host.len(), "cpu:0") }.unwrap();
        let before = counter(lib, copies);
        let read = request(Op::Read, host_addr, seg, remote + 4096, len - 4096);
        assert_eq!(run(&engine, read), TaskState::Completed, "{family}");
        assert_eq!(counter(lib, copies) - before, 1, "{family}");
        assert!(host[..] == data[4096..], "{family}: read back through IPC");

        let stats = engine.stats();
        assert_eq!(stats.shm_bytes, (2 * len - 4096) as u64, "{family}");
        assert_eq!(stats.tcp_bytes, 0, "{family}: nothing went over TCP");

        // Once the target withdraws the buffer, its handle is never used again.
        assert_eq!(target.command("unregister"), "unregistered");
        let again = request(Op::Write, local, seg, remote, len);
        assert_eq!(run(&engine, again), TaskState::Failed, "{family}");
        engine.unregister_memory(host.as_mut_ptr()).unwrap();
        engine.free_buffer(local as *mut u8).unwrap();
    }
}

#[test]
fn device_memory_without_ipc_falls_back_to_staged_tcp() {
    let Some(f) = fakes() else { return };
    // Ascend has no IPC handles: shm cannot carry these slices, TCP stages both ends.
    let len = (5 << 20) + 3;
    let mut target = Target::spawn_with("P2PHANDSHAKE", len, &["--location", "npu:1"]);
    let engine = engine_with("P2PHANDSHAKE", "auto");
    let seg = engine.open_segment(&target.name).unwrap();
    let remote = engine.segment_descriptor(seg).unwrap().buffers[0].clone();
    assert!(remote.ipc.is_none());
    let kind = MemoryKind::Npu(0);
    let local = engine.allocate_buffer(len, "npu:0").unwrap() as u64;
    let data = pattern(12, len);
    // SAFETY: `local` is device memory of `len` bytes.
    unsafe { device::copy_from_host(kind, local, data.as_ptr(), len) }.unwrap();
    let before = counter(&f.acl, "fake_acl_copies");
    let write = request(Op::Write, local, seg, remote.addr, len);
    assert_eq!(run(&engine, write), TaskState::Completed);
    assert!(
        counter(&f.acl, "fake_acl_copies") - before >= 2,
        "staged locally"
    );
    assert_eq!(
        target.command("checksum"),
        format!("crc32c {:08x}", crc32c(&data))
    );
    let stats = engine.stats();
    assert_eq!(stats.tcp_bytes, len as u64);
    assert_eq!(stats.shm_bytes, 0);
    engine.free_buffer(local as *mut u8).unwrap();
}
