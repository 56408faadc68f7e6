//! The RDMA verbs transport against an emulated verbs provider (tests/emu/verbs_emu.c,
//! built here with `cc`): this machine has no RDMA hardware. Engines in this process
//! share the emulated HCAs directly; `mooncake target` children reach them through the
//! emulator's shared fabric (VERBS_EMU_FABRIC). Emulated figures are not performance
//! claims.
//!
//! `emu` builds and drives the emulator, `support` holds the engine and worker helpers,
//! `verbs` tests the verbs objects themselves; the transport's tests are here.

#[path = "../common/mod.rs"]
mod common;
mod emu;
mod support;
mod verbs;

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::{assert_child_ok, pattern, test_in_child};
use emu::{emu, readable, serial, DEVICES};
use mooncake::device::{self, MemoryKind};
use mooncake::engine::TaskState;
use mooncake::ffi::ibverbs as ibv;
use mooncake::metadata::SegmentDesc;
use mooncake::registry::LocalMemory;
use mooncake::transport::rdma::RdmaTransport;
use mooncake::transport::{BackendConfig, Endpoints, Outcome, Peer, Slice, Transport};
use mooncake::{Code, Engine, EngineConfig, Op};
use support::{
    checksum_of, drive, finish, rdma_engine, rdma_engine_with, rdma_target, refused, run, start,
    Buf, SilentPeer,
};

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
        checksum: false,
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
    // Released only once their CQs are armed: released before the worker's progress
    // arms them (a loaded host can run this thread first), they would sit in the CQs
    // unannounced, and the worker would poll them without any channel event.
    let armed = emu.wait_held_armed();
    drop(held);
    assert_eq!(posted, slices, "every slice was posted");
    assert!(armed, "the worker armed the CQs its completions go to");
    assert_eq!(finish(&client, batch), TaskState::Completed);
    assert!(remote.buf == local.buf);
    // The worker may finish the batch by polling the CQ right after arming it and
    // read the event a round later: wait for it, bounded.
    assert!(
        emu.wait_cq_events(events + 1) > events,
        "the completions raised channel events"
    );
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
    let failures = mooncake::transport::rdma::verbs::release_failures();
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
    // them their fabric entries; every verbs object went after its children.
    assert_eq!(emu.fabric_entries(std::process::id()), 0);
    assert_eq!(
        mooncake::transport::rdma::verbs::release_failures(),
        failures
    );
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
        checksum: false,
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

/// `mooncake info` lists the emulated NICs and the priority matrix it would use.
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

/// A missing library is an ordinary error naming the override variable. The verbs
/// table loads once per process, so this runs in a child process.
#[test]
fn missing_library_is_backend_unavailable() {
    if std::env::var("MC_RDMA_TEST_CHILD").as_deref() == Ok("missing") {
        let mut cfg = EngineConfig::default();
        cfg.set("protocol", "rdma").unwrap();
        cfg.strict_protocol = true;
        let err = Engine::new(cfg.clone())
            .err()
            .expect("strict start-up fails");
        assert_eq!(err.code(), Code::BackendUnavailable, "{err}");
        let text = err.to_string();
        assert!(text.contains("MC_IBVERBS_LIB"), "{text}");
        assert!(text.contains("/nonexistent/libibverbs.so.1"), "{text}");
        // Not strict: TCP, with the same reason.
        cfg.strict_protocol = false;
        let engine = Engine::new(cfg).expect("falls back to tcp");
        let fallback = engine.protocol_fallback().expect("reported");
        assert_eq!(fallback.reason, err);
        assert_eq!(engine.protocol(), mooncake::Protocol::Tcp);
        println!("CHILD-OK");
        return;
    }
    if std::env::var_os("MC_RDMA_TEST_CHILD").is_some() {
        return;
    }
    assert_child_ok(
        test_in_child("missing_library_is_backend_unavailable")
            .env("MC_RDMA_TEST_CHILD", "missing")
            .env("MC_IBVERBS_LIB", "/nonexistent/libibverbs.so.1"),
    );
}

/// The system's libibverbs (when installed) on this machine, which has no RDMA
/// devices: `info` says so and a strict start-up fails with BackendUnavailable, not a
/// crash (without strictness the engine runs over TCP: tests/protocol_fallback.rs).
#[test]
fn system_libibverbs_without_devices() {
    if std::env::var("MC_RDMA_TEST_CHILD").as_deref() == Ok("system") {
        let info = ibv::info();
        println!("{info:?}");
        let mut cfg = EngineConfig::default();
        cfg.set("protocol", "rdma").unwrap();
        cfg.strict_protocol = true;
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
    assert_child_ok(
        test_in_child("system_libibverbs_without_devices")
            .env("MC_RDMA_TEST_CHILD", "system")
            .env_remove("MC_IBVERBS_LIB"),
    );
}

/// With a cluster secret, the queue-pair exchange rides on the authenticated handshake
/// RPC: engines sharing it move bytes over RDMA, one without it reaches nothing.
#[test]
fn queue_pairs_are_exchanged_only_between_engines_sharing_the_secret() {
    let Some(_emu) = emu() else { return };
    let _g = serial();
    let secret = ("cluster_secret", "rdma test cluster secret");
    let server = rdma_engine_with(1, &[secret]);
    let client = rdma_engine_with(1, &[secret]);
    let remote = Buf::new(&server, pattern(61, 1 << 16));
    let mut local = Buf::new(&client, vec![0; 1 << 16]);
    let seg = client.open_segment(server.segment_name()).unwrap();
    let st = run(&client, seg, Op::Read, local.addr(), remote.addr(), 1 << 16);
    assert_eq!(st, TaskState::Completed);
    assert!(local.buf == remote.buf);
    assert!(client.stats().rdma_bytes >= 1 << 16);
    local.buf.fill(0);
    drop(local);
    let stranger = rdma_engine_with(1, &[("cluster_secret", "")]);
    assert!(stranger.open_segment(server.segment_name()).is_err());
}
