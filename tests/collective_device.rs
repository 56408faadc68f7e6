//! Mooncake PG with device buffers, through the fake drivers (tests/emu/fake_*.c): every
//! collective's device form against the same collective on host copies, the number of
//! driver copies per operation (one in and one out per buffer, however many peers), a
//! dead peer leaving device outputs as they were (point-to-point: only its own
//! receives), refusals of bad input, the caller's
//! current device kept, pinned memory freed on a thread without a context, and the C
//! ABI's `mc_pg_set_memory` (device memory on the host path refused). Ranks are threads of this process. The fakes map device
//! memory PROT_NONE, so a path that touched it from the CPU would crash the test.

mod common;

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use common::fakes::{counter, fakes, Fakes};
use mooncake::capi::*;
use mooncake::collective::{DType, Group, GroupOptions, ReduceOp};
use mooncake::device::{self, MemoryKind};
use mooncake::ffi::{acl, cuda, hip};
use mooncake::Code;

/// The fakes count copies per process: tests that count them run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

macro_rules! need_fakes {
    () => {
        match fakes() {
            Some(f) => f,
            None => {
                eprintln!("skipping: the fake device drivers could not be built");
                return;
            }
        }
    };
}

fn cuda_copies(f: &Fakes) -> u64 {
    counter(&f.cuda, "fake_cuda_copies")
}

/// Ranks alternate between the two fake CUDA devices.
fn cuda_of(rank: usize) -> MemoryKind {
    MemoryKind::Cuda((rank % 2) as i32)
}

/// Device memory of `kind` holding `bytes` (never freed: the fakes' bump allocators
/// do not reuse addresses).
fn dev_with(kind: MemoryKind, bytes: &[u8]) -> u64 {
    let len = bytes.len().max(1);
    let addr = match kind {
        MemoryKind::Cuda(n) => cuda::api().unwrap().mem_alloc(n, len).unwrap(),
        MemoryKind::Hip(n) => hip::api().unwrap().mem_alloc(n, len).unwrap(),
        MemoryKind::Npu(n) => acl::api().unwrap().mem_alloc(n, len).unwrap(),
        other => panic!("no allocator here for {other:?}"),
    };
    if !bytes.is_empty() {
        // SAFETY: `addr` is a fresh device allocation of at least `bytes.len()` bytes.
        unsafe { device::copy_from_host(kind, addr, bytes.as_ptr(), bytes.len()) }.unwrap();
    }
    addr
}

fn dev_read(kind: MemoryKind, addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    if len > 0 {
        // SAFETY: `addr` is device memory of at least `len` bytes (from `dev_with`).
        unsafe { device::copy_to_host(kind, out.as_mut_ptr(), addr, len) }.unwrap();
    }
    out
}

/// `n` elements of `dt` that differ per rank and seed; small integers, so float sums
/// are exact in any order.
fn values(dt: DType, rank: usize, n: usize, seed: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| match dt {
            DType::F32 => (((rank * 7 + i * 3 + seed) % 11) as f32 - 5.0)
                .to_ne_bytes()
                .to_vec(),
            DType::I32 => ((rank * 100_003 + i * 31 + seed) as i32 - 50_000)
                .to_ne_bytes()
                .to_vec(),
            other => panic!("no values for {other:?}"),
        })
        .collect()
}

/// Element-wise sum of equal-length buffers of `dt`.
fn sum(dt: DType, parts: &[Vec<u8>]) -> Vec<u8> {
    let n = parts[0].len() / 4;
    (0..n)
        .flat_map(|i| {
            let at = |p: &Vec<u8>| -> [u8; 4] { p[i * 4..i * 4 + 4].try_into().unwrap() };
            match dt {
                DType::F32 => parts
                    .iter()
                    .map(|p| f32::from_ne_bytes(at(p)))
                    .sum::<f32>()
                    .to_ne_bytes(),
                _ => parts
                    .iter()
                    .map(|p| i32::from_ne_bytes(at(p)))
                    .fold(0i32, i32::wrapping_add)
                    .to_ne_bytes(),
            }
        })
        .collect()
}

fn start(world: usize, timeout: Duration, tweak: impl Fn(&mut GroupOptions)) -> Vec<Group> {
    common::groups::connected_groups(world, |o| {
        o.timeout = timeout;
        // Small cells, so the larger buffers are cut into many messages.
        o.cell_bytes = 64 << 10;
        tweak(o);
    })
}

/// Runs `script(group)` on every rank, each on its own thread.
fn on_all_ranks<T: Send>(groups: &[Group], script: impl Fn(&Group) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = groups.iter().map(|g| s.spawn(|| script(g))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

fn offsets(sizes: &[usize]) -> Vec<usize> {
    sizes
        .iter()
        .scan(0, |a, &s| {
            *a += s;
            Some(*a - s)
        })
        .collect()
}

/// One rank's run of every collective, host form then device form on the same data;
/// the device outputs must equal the host ones, and the host ones the reference.
fn every_collective(g: &Group, dt: DType) {
    let (r, w, es) = (g.rank(), g.size(), dt.size());
    let kind = cuda_of(r);
    // Both all-reduce algorithms: one round, and reduce-scatter + all-gather (> 64 KiB).
    for (n, op) in [
        (1001, ReduceOp::Sum),
        (100_003, ReduceOp::Sum),
        (777, ReduceOp::Max),
    ] {
        let mut host = values(dt, r, n, n);
        g.all_reduce(&mut host, dt, op).unwrap();
        if op == ReduceOp::Sum {
            let all: Vec<Vec<u8>> = (0..w).map(|q| values(dt, q, n, n)).collect();
            assert_eq!(host, sum(dt, &all), "host all_reduce of {n}");
        }
        let d = dev_with(kind, &values(dt, r, n, n));
        // SAFETY: `d` holds `n` elements of device memory of `kind`.
        unsafe { g.all_reduce_device(kind, d, n * es, dt, op) }.unwrap();
        assert_eq!(dev_read(kind, d, n * es), host, "all_reduce {op:?} of {n}");
    }

    let root = 1 % w;
    let len = 777 * es;
    let mut host = values(dt, r, 777, 1);
    g.broadcast(&mut host, root).unwrap();
    assert_eq!(host, values(dt, root, 777, 1));
    let d = dev_with(kind, &values(dt, r, 777, 1));
    // SAFETY: `len` bytes of device memory.
    unsafe { g.broadcast_device(kind, d, len, root) }.unwrap();
    assert_eq!(dev_read(kind, d, len), host, "broadcast");

    // Uneven blocks everywhere below.
    let sizes: Vec<usize> = (0..w).map(|q| (q * 5 + 3) * es).collect();
    let total: usize = sizes.iter().sum();
    let input = values(dt, r, sizes[r] / es, 2);
    let mut host = vec![0xab; total];
    g.all_gather(&input, &mut host, &sizes).unwrap();
    for (q, o) in offsets(&sizes).into_iter().enumerate() {
        assert_eq!(host[o..o + sizes[q]], values(dt, q, sizes[q] / es, 2));
    }
    let (di, dout) = (dev_with(kind, &input), dev_with(kind, &vec![0xab; total]));
    // SAFETY: both ranges device memory of the stated sizes.
    unsafe { g.all_gather_device(kind, di, dout, &sizes) }.unwrap();
    assert_eq!(dev_read(kind, dout, total), host, "all_gather");
    assert_eq!(dev_read(kind, di, input.len()), input, "input untouched");

    let counts: Vec<usize> = (0..w).map(|q| q * 2 + 5).collect();
    let all_in = values(dt, r, counts.iter().sum(), 3);
    let mut host = vec![0; counts[r] * es];
    g.reduce_scatter(&all_in, &mut host, &counts, dt, ReduceOp::Sum)
        .unwrap();
    let (di, dout) = (dev_with(kind, &all_in), dev_with(kind, &host));
    // SAFETY: as above.
    unsafe { g.reduce_scatter_device(kind, di, dout, &counts, dt, ReduceOp::Sum) }.unwrap();
    assert_eq!(dev_read(kind, dout, host.len()), host, "reduce_scatter");

    let send: Vec<usize> = (0..w).map(|q| ((2 * r + q) % 3 + 1) * 4 * es).collect();
    let recv: Vec<usize> = (0..w).map(|q| ((2 * q + r) % 3 + 1) * 4 * es).collect();
    let all_in = values(dt, r, send.iter().sum::<usize>() / es, 4);
    let out_len: usize = recv.iter().sum();
    let mut host = vec![0; out_len];
    g.all_to_all(&all_in, &send, &mut host, &recv).unwrap();
    let (di, dout) = (dev_with(kind, &all_in), dev_with(kind, &vec![0; out_len]));
    let timeout = Some(Duration::from_secs(10));
    // SAFETY: as above.
    unsafe { g.all_to_all_device(kind, (di, &send), (dout, &recv), timeout) }.unwrap();
    assert_eq!(dev_read(kind, dout, out_len), host, "all_to_all");

    let mut host = values(dt, r, 500, 5);
    g.reduce(&mut host, dt, ReduceOp::Sum, 0).unwrap();
    let d = dev_with(kind, &values(dt, r, 500, 5));
    // SAFETY: as above.
    unsafe { g.reduce_device(kind, d, 500 * es, dt, ReduceOp::Sum, 0) }.unwrap();
    assert_eq!(dev_read(kind, d, 500 * es), host, "reduce");

    let gsizes = vec![40 * es; w];
    let groot = w - 1;
    let input = values(dt, r, 40, 6);
    let out_len = if r == groot { 40 * es * w } else { 0 };
    let mut host = vec![0; out_len];
    g.gather(&input, &mut host, &gsizes, groot).unwrap();
    let (di, dout) = (dev_with(kind, &input), dev_with(kind, &vec![0; out_len]));
    // SAFETY: as above (the output is used on the root only).
    unsafe { g.gather_device(kind, di, dout, &gsizes, groot) }.unwrap();
    assert_eq!(dev_read(kind, dout, out_len), host, "gather");

    let in_len = if r == 0 { 40 * es * w } else { 0 };
    let input = values(dt, r, in_len / es, 7);
    let mut host = vec![0; 40 * es];
    g.scatter(&input, &mut host, &gsizes, 0).unwrap();
    let (di, dout) = (dev_with(kind, &input), dev_with(kind, &host));
    // SAFETY: as above (the input is read on the root only).
    unsafe { g.scatter_device(kind, di, dout, &gsizes, 0) }.unwrap();
    assert_eq!(dev_read(kind, dout, host.len()), host, "scatter");

    let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
    let mine = values(dt, r, (r + 1) * 100, 8);
    let from_prev = values(dt, prev, (prev + 1) * 100, 8);
    let (ds, dr) = (
        dev_with(kind, &mine),
        dev_with(kind, &vec![0; from_prev.len()]),
    );
    let sends = [(next, ds, mine.len())];
    let recvs = [(prev, dr, from_prev.len())];
    // SAFETY: both ranges device memory of the stated sizes.
    unsafe { g.send_recv_device(kind, &sends, &recvs) }.unwrap();
    assert_eq!(dev_read(kind, dr, from_prev.len()), from_prev, "send/recv");
}

#[test]
fn every_device_collective_equals_its_host_form_on_three_ranks() {
    let _f = need_fakes!();
    let _one = serial();
    let groups = start(3, Duration::from_secs(20), |_| {});
    for dt in [DType::F32, DType::I32] {
        on_all_ranks(&groups, |g| every_collective(g, dt));
    }
}

/// The driver copies all ranks made for each operation, in order; counted between
/// group barriers, so no rank is still copying for another operation.
fn copies_per_operation(f: &Fakes, world: usize) -> Vec<u64> {
    let groups = start(world, Duration::from_secs(20), |_| {});
    let counts = on_all_ranks(&groups, |g| {
        let (r, w) = (g.rank(), g.size());
        let kind = cuda_of(r);
        let n = 40_000; // bytes; above one cell, so every peer gets several messages
        let d = dev_with(kind, &vec![1; n]);
        let d2 = dev_with(kind, &vec![0; n * w]);
        let sizes = vec![n; w];
        let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
        let mut seen = Vec::new();
        let mut measured = |op: &dyn Fn() -> mooncake::Result<()>| {
            g.barrier().unwrap();
            let before = cuda_copies(f);
            g.barrier().unwrap();
            op().unwrap();
            g.barrier().unwrap();
            seen.push(cuda_copies(f) - before);
        };
        // SAFETY: in every call below, `d` holds `n` bytes and `d2` `n * w` bytes of
        // device memory of `kind`.
        unsafe {
            measured(&|| g.all_reduce_device(kind, d, n, DType::U8, ReduceOp::Max));
            measured(&|| g.broadcast_device(kind, d, n, 0));
            measured(&|| g.all_gather_device(kind, d, d2, &sizes));
            measured(&|| g.reduce_scatter_device(kind, d2, d, &sizes, DType::U8, ReduceOp::Sum));
            measured(&|| g.all_to_all_device(kind, (d2, &sizes), (d2, &sizes), None));
            measured(&|| g.reduce_device(kind, d, n, DType::U8, ReduceOp::Max, 0));
            measured(&|| g.gather_device(kind, d, d2, &sizes, 0));
            measured(&|| g.scatter_device(kind, d2, d, &sizes, 0));
            measured(&|| g.send_recv_device(kind, &[(next, d, n)], &[(prev, d2, n)]));
        }
        seen
    });
    // Rank 0 saw the whole process's copies between the barriers.
    counts.into_iter().next().unwrap()
}

#[test]
fn each_buffer_is_copied_in_once_and_out_once_however_many_peers() {
    let f = need_fakes!();
    let _one = serial();
    for w in [2u64, 4] {
        // Per rank: all_reduce in+out; broadcast root in, others out; all_gather input
        // in, output in+out (inactive ranks' blocks are kept); reduce_scatter in, out;
        // all_to_all as all_gather; reduce root in+out, others in; gather root input
        // in, output in+out, others in; scatter root in+out, others out; send in,
        // receive out.
        let expected = vec![2 * w, w, 3 * w, 2 * w, 3 * w, w + 1, w + 2, w + 1, 2 * w];
        assert_eq!(copies_per_operation(f, w as usize), expected, "{w} ranks");
    }
}

#[test]
fn a_dead_peer_leaves_device_outputs_as_they_were() {
    let f = need_fakes!();
    let _one = serial();
    let mut groups = start(2, Duration::from_millis(500), |o| {
        o.auto_sync_on_failure = false;
        o.auto_deactivate_on_failure = false;
    });
    drop(groups.pop());
    let g = &groups[0];
    let kind = cuda_of(0);
    let before_data = values(DType::F32, 0, 100_003, 9);
    let d = dev_with(kind, &before_data);
    let before = cuda_copies(f);
    // SAFETY: `d` holds 100003 f32 of device memory.
    let e = unsafe { g.all_reduce_device(kind, d, before_data.len(), DType::F32, ReduceOp::Sum) }
        .unwrap_err();
    assert_eq!(cuda_copies(f) - before, 1, "copied in, never out: {e}");
    assert_eq!(g.failed_ranks(), vec![1], "{e}");
    assert_eq!(dev_read(kind, d, before_data.len()), before_data);

    let out_data = vec![0x5a; 2 * 4096];
    let (di, dout) = (
        dev_with(kind, &before_data[..4096]),
        dev_with(kind, &out_data),
    );
    let before = cuda_copies(f);
    // SAFETY: `di` holds 4096 bytes and `dout` 8192, device memory.
    let e = unsafe { g.all_gather_device(kind, di, dout, &[4096, 4096]) }.unwrap_err();
    assert_eq!(
        cuda_copies(f) - before,
        2,
        "input and output in, nothing out: {e}"
    );
    assert_eq!(dev_read(kind, dout, out_data.len()), out_data);

    let before = cuda_copies(f);
    // SAFETY: as above; rank 1 is the (dead) root.
    let e = unsafe { g.broadcast_device(kind, dout, out_data.len(), 1) }.unwrap_err();
    assert_eq!(
        cuda_copies(f) - before,
        0,
        "a receive-only output is not copied in: {e}"
    );
    assert_eq!(dev_read(kind, dout, out_data.len()), out_data);
}

/// Point-to-point on device memory with a peer gone: as on the host, only the messages
/// with it fail. The receive from the live peer reaches the device; the one from the
/// gone peer is not copied back (its device buffer keeps what it held).
#[test]
fn a_gone_peer_fails_only_its_own_device_messages() {
    let _f = need_fakes!();
    let _one = serial();
    let mut groups = start(3, Duration::from_millis(1000), |_| {});
    drop(groups.pop());
    let n = 4096;
    let results = on_all_ranks(&groups, |g| {
        let (r, kind) = (g.rank(), cuda_of(g.rank()));
        let mine = dev_with(kind, &values(DType::I32, r, n, 1));
        let (from_other, from_gone) = (
            dev_with(kind, &vec![0x11; 4 * n]),
            dev_with(kind, &vec![0x22; 4 * n]),
        );
        let sends = [(1 - r, mine, 4 * n), (2, mine, 4 * n)];
        let recvs = [(1 - r, from_other, 4 * n), (2, from_gone, 4 * n)];
        // SAFETY: every range is `4 n` bytes of device memory of `kind`.
        let result = unsafe { g.send_recv_device(kind, &sends, &recvs) };
        let got = (
            dev_read(kind, from_other, 4 * n),
            dev_read(kind, from_gone, 4 * n),
        );
        (result, g.failed_ranks(), got)
    });
    for (r, (result, failed, (from_other, from_gone))) in results.into_iter().enumerate() {
        let error = result.expect_err("rank 2 never answered");
        assert_eq!(error.code(), Code::Timeout, "rank {r}: {error}");
        assert_eq!(failed, vec![2], "rank {r}: {error}");
        assert!(
            from_other == values(DType::I32, 1 - r, n, 1),
            "rank {r}: live peer's message"
        );
        assert!(
            from_gone == vec![0x22; 4 * n],
            "rank {r}: gone peer's buffer changed"
        );
    }
}

#[test]
fn bad_device_buffers_are_refused_before_any_copy() {
    let f = need_fakes!();
    let _one = serial();
    let groups = start(1, Duration::from_secs(5), |_| {});
    let g = &groups[0];
    let mut host = vec![7u8; 64];
    let on_dev1 = dev_with(MemoryKind::Cuda(1), &[1; 64]);
    let before = cuda_copies(f);
    let addr = host.as_mut_ptr() as u64;
    let refused = |kind: MemoryKind, addr: u64| {
        // SAFETY: refused before the memory is touched (host memory named as device
        // memory, or memory of another device), as asserted below.
        unsafe { g.all_reduce_device(kind, addr, 64, DType::U8, ReduceOp::Sum) }.unwrap_err()
    };
    let err = refused(MemoryKind::Host, addr);
    assert_eq!(err.code(), Code::InvalidParams, "{err}");
    let err = refused(cuda_of(0), addr);
    assert!(err.to_string().contains("host memory"), "{err}");
    let err = refused(MemoryKind::Cuda(0), on_dev1);
    assert!(err.to_string().contains("cuda:1"), "{err}");
    assert_eq!(cuda_copies(f), before, "refused before any copy");
    assert_eq!(host, vec![7u8; 64]);
    // A single rank still runs on device memory.
    let d = dev_with(cuda_of(0), &[3; 64]);
    // SAFETY: 64 bytes of device memory.
    unsafe { g.all_reduce_device(cuda_of(0), d, 64, DType::U8, ReduceOp::Sum) }.unwrap();
    assert_eq!(dev_read(cuda_of(0), d, 64), vec![3; 64]);
}

#[test]
fn hip_device_memory_is_staged_the_same_way() {
    let f = need_fakes!();
    let _one = serial();
    let groups = start(2, Duration::from_secs(20), |_| {});
    let n = 30_001;
    let before = counter(&f.hip, "fake_hip_copies");
    let results = on_all_ranks(&groups, |g| {
        let kind = MemoryKind::Hip(g.rank() as i32);
        let d = dev_with(kind, &values(DType::F32, g.rank(), n, 0));
        // SAFETY: `n` f32 of device memory of `kind`.
        unsafe { g.all_reduce_device(kind, d, n * 4, DType::F32, ReduceOp::Sum) }.unwrap();
        (kind, d)
    });
    // Two ranks, one copy in and one out each (the writes above are two more).
    assert_eq!(counter(&f.hip, "fake_hip_copies") - before, 2 + 4);
    let all: Vec<Vec<u8>> = (0..2).map(|q| values(DType::F32, q, n, 0)).collect();
    for (kind, d) in results {
        assert_eq!(dev_read(kind, d, n * 4), sum(DType::F32, &all));
    }
}

/// A `mc_pg *` that may cross to the thread running its rank.
struct Pg(*mut McPg);
// SAFETY: mooncake.h allows a mc_pg on any thread, one call at a time; each handle here
// is used by one thread at a time.
unsafe impl Send for Pg {}
// SAFETY: as above; the handles are shared only to be used one call at a time.
unsafe impl Sync for Pg {}

fn c_location(pg: &Pg, location: &str) -> c_int {
    let loc = CString::new(location).unwrap();
    // SAFETY: a live handle and a NUL-terminated string.
    unsafe { mc_pg_set_memory(pg.0, loc.as_ptr()) }
}

#[test]
fn the_c_abi_takes_device_buffers_after_mc_pg_set_memory() {
    let _f = need_fakes!();
    let _one = serial();
    let ranks: Vec<Pg> = (0..2)
        .map(|r| {
            let opts = CString::new("timeout_ms=20000").unwrap();
            let mut pg = std::ptr::null_mut();
            // SAFETY: valid string and out pointer.
            assert_eq!(unsafe { mc_pg_new(r, 2, opts.as_ptr(), &mut pg) }, 0);
            Pg(pg)
        })
        .collect();
    let addrs: Vec<CString> = ranks
        .iter()
        .map(|pg| {
            let mut buf = vec![0 as c_char; 512];
            // SAFETY: `buf` is writable for its length.
            let rc =
                unsafe { mc_pg_address(pg.0, buf.as_mut_ptr(), buf.len(), std::ptr::null_mut()) };
            assert_eq!(rc, 0);
            // SAFETY: NUL-terminated by mc_pg_address.
            unsafe { CStr::from_ptr(buf.as_ptr()) }.to_owned()
        })
        .collect();
    let list: Vec<*const c_char> = addrs.iter().map(|a| a.as_ptr()).collect();
    for pg in &ranks {
        // SAFETY: `list` holds two valid strings.
        assert_eq!(unsafe { mc_pg_connect(pg.0, list.as_ptr(), 2) }, 0);
    }
    // Bad locations: a clear error, and the setting (host) unchanged.
    let invalid = Code::InvalidParams as c_int;
    assert_eq!(c_location(&ranks[0], "cuda:x"), invalid);
    assert_eq!(c_location(&ranks[0], "gpu:0"), invalid);
    assert_eq!(c_location(&ranks[0], "cpu:zero"), invalid);
    let no_such_device = c_location(&ranks[0], "cuda:9");
    assert_eq!(no_such_device, invalid, "the fakes have two devices");
    // SAFETY: a NULL handle, refused.
    let null_handle = unsafe { mc_pg_set_memory(std::ptr::null_mut(), std::ptr::null()) };
    assert_eq!(null_handle, invalid);

    let results = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .enumerate()
            .map(|(r, pg)| {
                s.spawn(move || {
                    // Host first: nothing set yet.
                    let mut v = vec![r as i32 + 1; 1000];
                    // SAFETY: `v` holds 1000 i32.
                    let rc = unsafe { mc_pg_all_reduce(pg.0, v.as_mut_ptr().cast(), 1000, 4, 0) };
                    assert_eq!((rc, v[999]), (0, 3));
                    let kind = cuda_of(r);
                    assert_eq!(c_location(pg, &kind.location()), 0);
                    let n = 50_000;
                    let d = dev_with(kind, &values(DType::I32, r, n, 0));
                    // SAFETY: `d` holds `n` i32 of device memory, as set.
                    let rc = unsafe { mc_pg_all_reduce(pg.0, d as *mut c_void, n, 4, 0) };
                    assert_eq!(rc, 0);
                    let send: Vec<u8> = (0..24).map(|i| (r * 100 + i) as u8).collect();
                    let recv = if r == 0 { [8usize, 8] } else { [16, 16] };
                    let out_len: usize = recv.iter().sum();
                    let (di, dout) = (dev_with(kind, &send), dev_with(kind, &vec![0; out_len]));
                    let send_split = [8usize, 16];
                    // SAFETY: device ranges of the split sums, as set.
                    let rc = unsafe {
                        mc_pg_all_to_all_timeout(
                            pg.0,
                            di as *const c_void,
                            send_split.as_ptr(),
                            dout as *mut c_void,
                            recv.as_ptr(),
                            5_000_000,
                        )
                    };
                    let got = dev_read(kind, dout, out_len);
                    // Reduce-scatter of 3 + 5 i32, and a gather of 12 bytes to rank 0.
                    let counts = [3usize, 5];
                    let rs_in = dev_with(kind, &values(DType::I32, r, 8, 1));
                    let rs_out = dev_with(kind, &vec![0; counts[r] * 4]);
                    // SAFETY: 8 i32 in, `counts[r]` i32 out, device memory as set.
                    let rs_rc = unsafe {
                        mc_pg_reduce_scatter(
                            pg.0,
                            rs_in as *const c_void,
                            rs_out as *mut c_void,
                            counts.as_ptr(),
                            4,
                            0,
                        )
                    };
                    let reduced_block = dev_read(kind, rs_out, counts[r] * 4);
                    let gather_sizes = [12usize, 12];
                    let g_in = dev_with(kind, &[r as u8 + 10; 12]);
                    let g_out = if r == 0 { dev_with(kind, &[0; 24]) } else { 0 };
                    // SAFETY: 12 bytes in; 24 out on the root only, device memory as set.
                    let g_rc = unsafe {
                        mc_pg_gather(
                            pg.0,
                            g_in as *const c_void,
                            g_out as *mut c_void,
                            gather_sizes.as_ptr(),
                            0,
                        )
                    };
                    let gathered = if r == 0 {
                        dev_read(kind, g_out, 24)
                    } else {
                        vec![]
                    };
                    assert_eq!(c_location(pg, "cpu:0"), 0);
                    // Device memory on the host path (another thread's setting, say) is
                    // refused before the CPU touches it: the fakes would fault.
                    // SAFETY: refused before any access (the point of the check).
                    let misrouted = unsafe { mc_pg_all_reduce(pg.0, d as *mut c_void, n, 4, 0) };
                    let calls = Calls {
                        all_to_all: rc,
                        reduce_scatter: rs_rc,
                        gather: g_rc,
                        misrouted,
                    };
                    (
                        calls,
                        dev_read(kind, d, n * 4),
                        got,
                        reduced_block,
                        gathered,
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect::<Vec<_>>()
    });
    for pg in ranks {
        // SAFETY: from mc_pg_new, freed once.
        unsafe { mc_pg_free(pg.0) };
    }
    let all: Vec<Vec<u8>> = (0..2).map(|q| values(DType::I32, q, 50_000, 0)).collect();
    let rs_all = sum(
        DType::I32,
        &(0..2)
            .map(|q| values(DType::I32, q, 8, 1))
            .collect::<Vec<_>>(),
    );
    let mut blocks = Vec::new();
    for (r, (calls, reduced, got, reduced_block, gathered)) in results.into_iter().enumerate() {
        let invalid = Code::InvalidParams as c_int;
        assert_eq!(
            (calls.all_to_all, calls.reduce_scatter, calls.gather),
            (0, 0, 0)
        );
        assert_eq!(
            calls.misrouted, invalid,
            "rank {r}: device memory on the host path"
        );
        // The refused call left the device buffer as the all-reduce wrote it.
        assert_eq!(reduced, sum(DType::I32, &all));
        let block = if r == 0 { 0..12 } else { 12..32 };
        assert_eq!(
            reduced_block, rs_all[block],
            "rank {r}'s reduce_scatter block"
        );
        if r == 0 {
            assert_eq!(gathered, [[10u8; 12], [11u8; 12]].concat());
        }
        blocks.push(got);
    }
    // Rank 0 sends 8 bytes to itself and 16 to rank 1; rank 1 sends 8 to rank 0 and 16
    // to itself.
    let from = |r: usize, range: std::ops::Range<usize>| -> Vec<u8> {
        range.map(|i| (r * 100 + i) as u8).collect()
    };
    assert_eq!(blocks[0], [from(0, 0..8), from(1, 0..8)].concat());
    assert_eq!(blocks[1], [from(0, 8..24), from(1, 8..24)].concat());
}

/// Return codes of one rank's C-ABI calls in the test above.
struct Calls {
    all_to_all: c_int,
    reduce_scatter: c_int,
    gather: c_int,
    /// An all-reduce of device memory after the setting went back to host memory.
    misrouted: c_int,
}

/// The device a thread's current fake CUDA context is for (-1: none), asked of the
/// fake itself rather than of mooncake's table.
fn fake_cuda_current(f: &Fakes) -> i64 {
    // SAFETY: the fake is loaded already (same path, same handle); cuCtxGetCurrent
    // writes one pointer-sized handle.
    unsafe {
        let lib = libloading::Library::new(&f.cuda).unwrap();
        let get: libloading::Symbol<unsafe extern "C" fn(*mut usize) -> c_int> =
            lib.get(b"cuCtxGetCurrent").unwrap();
        let mut ctx = 0usize;
        assert_eq!(get(&mut ctx), 0);
        if ctx == 0 {
            -1
        } else {
            ctx as i64 - 0x1000
        }
    }
}

/// The fake HIP runtime's current device on this thread.
fn fake_hip_current(f: &Fakes) -> i32 {
    // SAFETY: as `fake_cuda_current`; hipGetDevice writes one int.
    unsafe {
        let lib = libloading::Library::new(&f.hip).unwrap();
        let get: libloading::Symbol<unsafe extern "C" fn(*mut c_int) -> c_int> =
            lib.get(b"hipGetDevice").unwrap();
        let mut d: c_int = -1;
        assert_eq!(get(&mut d), 0);
        d
    }
}

#[test]
fn a_staged_operation_leaves_the_callers_current_device_as_it_was() {
    let f = need_fakes!();
    let _one = serial();
    let groups = start(2, Duration::from_secs(20), |_| {});
    let seen = on_all_ranks(&groups, |g| {
        let r = g.rank();
        // Rank 0's thread has the other device's context current (torch on cuda:1
        // with a tensor on cuda:0); rank 1's has none at all.
        let kind = cuda_of(r);
        let d = dev_with(kind, &values(DType::I32, r, 100, 0));
        if r == 0 {
            cuda::api().unwrap().make_current(1).unwrap();
        } else {
            cuda::api().unwrap().restore_context(0).unwrap();
        }
        let before = fake_cuda_current(f);
        // SAFETY: 100 i32 of device memory of `kind`.
        unsafe { g.all_reduce_device(kind, d, 400, DType::I32, ReduceOp::Sum) }.unwrap();
        let cuda_after = fake_cuda_current(f);
        let hip = MemoryKind::Hip(r as i32);
        let h = dev_with(hip, &values(DType::I32, r, 100, 0));
        hip::api().unwrap().make_current(1 - r as i32).unwrap();
        // SAFETY: 100 i32 of device memory of `hip`.
        unsafe { g.all_reduce_device(hip, h, 400, DType::I32, ReduceOp::Sum) }.unwrap();
        (before, cuda_after, fake_hip_current(f))
    });
    assert_eq!(
        seen[0],
        (1, 1, 1),
        "rank 0: cuda:1's context and hip:1 kept"
    );
    assert_eq!(seen[1], (-1, -1, 0), "rank 1: no context, and hip:0, kept");
}

#[test]
fn pinned_staging_is_freed_on_a_thread_without_a_context() {
    let f = need_fakes!();
    let _one = serial();
    let live = || counter(&f.cuda, "fake_cuda_pinned_buffers");
    let before = live();
    let staging = device::Staging::new(MemoryKind::Cuda(0), 1000);
    assert!(staging.is_pinned());
    assert_eq!(live(), before + 1);
    // A fresh thread has no context; the fake, like the driver, refuses a free then.
    let context_there = std::thread::spawn(move || {
        let had = fake_cuda_current(f);
        drop(staging);
        (had, fake_cuda_current(f))
    })
    .join()
    .unwrap();
    assert_eq!(context_there, (-1, -1), "none before, none left behind");
    assert_eq!(live(), before, "the pinned buffer was freed");
}

/// The fake ACL runtime's current device on this thread (-1: none set).
fn fake_acl_current(f: &Fakes) -> i32 {
    // SAFETY: as `fake_cuda_current`; aclrtGetDevice writes one int32_t.
    unsafe {
        let lib = libloading::Library::new(&f.acl).unwrap();
        let get: libloading::Symbol<unsafe extern "C" fn(*mut i32) -> c_int> =
            lib.get(b"aclrtGetDevice").unwrap();
        let mut d: i32 = -1;
        if get(&mut d) == 0 {
            d
        } else {
            -1
        }
    }
}

#[test]
fn an_ascend_staged_operation_leaves_the_callers_device_as_it_was() {
    let f = need_fakes!();
    let _one = serial();
    let groups = start(2, Duration::from_secs(20), |_| {});
    let n = 10_007;
    let seen = on_all_ranks(&groups, |g| {
        let r = g.rank();
        let kind = MemoryKind::Npu(r as i32);
        let d = dev_with(kind, &values(DType::I32, r, n, 0));
        // The caller works on the other NPU (its tensor on this one).
        acl::api().unwrap().make_current(1 - r as i32).unwrap();
        // SAFETY: `n` i32 of device memory of `kind`.
        unsafe { g.all_reduce_device(kind, d, n * 4, DType::I32, ReduceOp::Sum) }.unwrap();
        (fake_acl_current(f), dev_read(kind, d, n * 4))
    });
    let all: Vec<Vec<u8>> = (0..2).map(|q| values(DType::I32, q, n, 0)).collect();
    for (r, (current, reduced)) in seen.into_iter().enumerate() {
        assert_eq!(current, 1 - r as i32, "rank {r}: npu:{} kept", 1 - r);
        assert_eq!(reduced, sum(DType::I32, &all), "rank {r}");
    }
}

#[test]
fn registering_device_memory_leaves_the_callers_device_as_it_was() {
    let f = need_fakes!();
    let _one = serial();
    let (on_cuda0, on_hip0, on_npu0) = (
        dev_with(MemoryKind::Cuda(0), &[1; 64]),
        dev_with(MemoryKind::Hip(0), &[1; 64]),
        dev_with(MemoryKind::Npu(0), &[1; 64]),
    );
    // Each runtime on a fresh thread, whose current device the "caller" sets first:
    // the other device than the memory's.
    let cuda_seen = std::thread::spawn(move || {
        cuda::api().unwrap().make_current(1).unwrap();
        let kind = device::classify(on_cuda0, 64, "cuda:0").unwrap();
        let after_classify = fake_cuda_current(f);
        device::check_available(MemoryKind::Cuda(0)).unwrap();
        let after_check = fake_cuda_current(f);
        // A thread with no context is left with none.
        cuda::api().unwrap().restore_context(0).unwrap();
        device::classify(on_cuda0, 64, "cuda:0").unwrap();
        (kind, after_classify, after_check, fake_cuda_current(f))
    })
    .join()
    .unwrap();
    assert_eq!(cuda_seen, (MemoryKind::Cuda(0), 1, 1, -1));
    let hip_seen = std::thread::spawn(move || {
        hip::api().unwrap().make_current(1).unwrap();
        let kind = device::classify(on_hip0, 64, "hip:0").unwrap();
        (kind, fake_hip_current(f))
    })
    .join()
    .unwrap();
    assert_eq!(hip_seen, (MemoryKind::Hip(0), 1));
    let npu_seen = std::thread::spawn(move || {
        acl::api().unwrap().make_current(1).unwrap();
        let kind = device::classify(on_npu0, 64, "npu:0").unwrap();
        let after_classify = fake_acl_current(f);
        let allocated = device::alloc(MemoryKind::Npu(0), 4096).unwrap();
        (kind, after_classify, fake_acl_current(f), allocated != 0)
    })
    .join()
    .unwrap();
    assert_eq!(npu_seen, (MemoryKind::Npu(0), 1, 1, true));
}

#[test]
fn acls_pointer_query_refuses_wrong_npu_locations() {
    let _f = need_fakes!();
    let _one = serial();
    assert!(acl::api().unwrap().has_pointer_query());
    let on_npu1 = dev_with(MemoryKind::Npu(1), &[1; 64]);
    let host = [0u8; 64];
    let e = device::classify(host.as_ptr() as u64, 64, "npu:0").unwrap_err();
    assert!(e.to_string().contains("not device memory"), "{e}");
    let e = device::classify(on_npu1, 64, "npu:0").unwrap_err();
    assert!(e.to_string().contains("npu:1"), "{e}");
    assert_eq!(
        device::classify(on_npu1, 64, "npu:1").unwrap(),
        MemoryKind::Npu(1)
    );
    assert_eq!(
        device::npu_memory_at(on_npu1, 64).unwrap(),
        Some(MemoryKind::Npu(1))
    );
    assert_eq!(
        device::npu_memory_at(host.as_ptr() as u64, 64).unwrap(),
        None
    );
}

#[test]
fn the_c_abi_host_path_refuses_npu_memory_after_an_npu_setting() {
    let _f = need_fakes!();
    let _one = serial();
    let opts = CString::new("timeout_ms=5000").unwrap();
    let mut raw = std::ptr::null_mut();
    // SAFETY: valid string and out pointer.
    assert_eq!(unsafe { mc_pg_new(0, 1, opts.as_ptr(), &mut raw) }, 0);
    let pg = Pg(raw);
    let mut buf = vec![0 as c_char; 512];
    // SAFETY: `buf` is writable for its length.
    let rc = unsafe { mc_pg_address(pg.0, buf.as_mut_ptr(), buf.len(), std::ptr::null_mut()) };
    assert_eq!(rc, 0);
    let list = [buf.as_ptr() as *const c_char];
    // SAFETY: one NUL-terminated address.
    assert_eq!(unsafe { mc_pg_connect(pg.0, list.as_ptr(), 1) }, 0);
    let n = 256;
    let d = dev_with(MemoryKind::Npu(0), &values(DType::I32, 0, n, 0));
    assert_eq!(c_location(&pg, "npu:0"), 0);
    // SAFETY: `n` i32 of NPU memory, as set.
    let on_device = unsafe { mc_pg_all_reduce(pg.0, d as *mut c_void, n, 4, 0) };
    assert_eq!(c_location(&pg, "cpu:0"), 0);
    // SAFETY: refused before any access (the point of the check): the fake maps NPU
    // memory PROT_NONE.
    let misrouted = unsafe { mc_pg_all_reduce(pg.0, d as *mut c_void, n, 4, 0) };
    let mut host = vec![2i32; n];
    // SAFETY: `host` holds `n` i32.
    let on_host = unsafe { mc_pg_all_reduce(pg.0, host.as_mut_ptr().cast(), n, 4, 0) };
    // SAFETY: from mc_pg_new, freed once.
    unsafe { mc_pg_free(pg.0) };
    assert_eq!(on_device, 0);
    assert_eq!(
        misrouted,
        Code::InvalidParams as c_int,
        "NPU memory on the host path"
    );
    assert_eq!(
        (on_host, host[n - 1]),
        (0, 2),
        "host memory still goes through"
    );
    assert_eq!(
        dev_read(MemoryKind::Npu(0), d, n * 4),
        values(DType::I32, 0, n, 0)
    );
}

#[test]
fn host_to_device_copies_wait_unless_the_source_is_pinned() {
    let f = need_fakes!();
    let _one = serial();
    let syncs = || counter(&f.cuda, "fake_cuda_syncs");
    let kind = MemoryKind::Cuda(0);
    let d = dev_with(kind, &[0; 4096]);
    let pageable = vec![7u8; 4096];
    let before = syncs();
    // SAFETY: 4096 bytes of host memory into 4096 bytes of device memory.
    unsafe { device::copy(kind, d, MemoryKind::Host, pageable.as_ptr() as u64, 4096) }.unwrap();
    assert_eq!(syncs() - before, 1, "a pageable source is waited for");
    assert_eq!(dev_read(kind, d, 4096), pageable);
    let mut pinned = device::Staging::new(kind, 4096);
    assert!(pinned.is_pinned());
    pinned.bytes_mut(4096).fill(9);
    let before = syncs();
    // SAFETY: as above; the staging buffer holds 4096 bytes.
    unsafe {
        device::copy(
            kind,
            d,
            MemoryKind::Host,
            pinned.bytes(4096).as_ptr() as u64,
            4096,
        )
    }
    .unwrap();
    assert_eq!(
        syncs() - before,
        0,
        "a pinned source completes before return"
    );
    assert_eq!(dev_read(kind, d, 4096), vec![9; 4096]);
}

#[test]
fn a_large_staged_operation_keeps_no_more_staging_than_the_cap() {
    let f = need_fakes!();
    let _one = serial();
    let cap = 1 << 20;
    let groups = start(1, Duration::from_secs(5), |o| {
        o.set("staging_keep_bytes", &cap.to_string()).unwrap();
    });
    let g = &groups[0];
    let kind = MemoryKind::Cuda(0);
    let pinned = || counter(&f.cuda, "fake_cuda_pinned_buffers");
    let live_before = pinned();
    let small = dev_with(kind, &[1; 4096]);
    // SAFETY: 4096 bytes of device memory of `kind`.
    unsafe { g.all_reduce_device(kind, small, 4096, DType::U8, ReduceOp::Sum) }.unwrap();
    assert_eq!(
        g.kept_staging_bytes(),
        4096,
        "a small buffer is kept for reuse"
    );
    let big_len = 3 << 20;
    let big = dev_with(kind, &vec![2; big_len]);
    // SAFETY: `big_len` bytes of device memory of `kind`.
    unsafe { g.all_reduce_device(kind, big, big_len, DType::U8, ReduceOp::Sum) }.unwrap();
    assert!(
        g.kept_staging_bytes() <= cap,
        "{} kept",
        g.kept_staging_bytes()
    );
    assert_eq!(g.kept_staging_bytes(), 4096, "the small one still kept");
    assert_eq!(
        pinned(),
        live_before + 1,
        "the large one's pinned memory freed"
    );
    assert_eq!(dev_read(kind, big, big_len), vec![2; big_len]);
    let mut bad = GroupOptions::new(0, 1);
    assert!(bad.set("staging_keep_bytes", "lots").is_err());
}
