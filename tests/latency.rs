//! Small-operation paths, by what they do rather than how long they take: a small
//! synchronous transfer runs on the calling thread (no worker handed anything, none
//! woken), a burst of small slices to one peer leaves in a handful of sends, and
//! mapping an untouched same-host segment costs address space, not memory.

mod common;

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{engine_with, pattern, Registered};
use mooncake::{Engine, EngineConfig, Op, Request};

/// A request of `len` bytes at `off` of both `local` and the remote buffer at `remote`.
fn at(op: Op, local: &[u8], seg: u64, remote: u64, off: u64, len: u64) -> Request {
    Request {
        op,
        local: local.as_ptr() as u64 + off,
        segment: seg,
        remote: remote + off,
        len,
    }
}

/// Runs `reqs` through a batch's submit and wait (the asynchronous path).
fn submit_and_wait(engine: &Engine, reqs: &[Request]) {
    let b = engine.allocate_batch(reqs.len()).unwrap();
    // SAFETY: every local buffer outlives the wait below.
    unsafe { engine.submit(b, reqs) }.unwrap();
    engine.wait_batch(b, Some(Duration::from_secs(60))).unwrap();
    engine.free_batch(b).unwrap();
}

#[test]
fn a_small_synchronous_transfer_wakes_no_worker() {
    let server = engine_with("P2PHANDSHAKE", "tcp");
    let client = engine_with("P2PHANDSHAKE", "tcp");
    let remote = Registered::new(&server, pattern(1, 1 << 20));
    let seg = client.open_segment(server.segment_name()).unwrap();
    let mut local = vec![0u8; 4096];
    let before = client.stats();
    for round in 0..100u64 {
        let off = round * 4096 % (1 << 20);
        let req = Request {
            op: Op::Read,
            local: local.as_mut_ptr() as u64,
            segment: seg,
            remote: remote.addr() + off,
            len: 4096,
        };
        // SAFETY: `local` outlives the call, which returns once the task is final.
        unsafe { client.transfer_sync(&[req]) }.unwrap();
        assert_eq!(local[..], remote.buf[off as usize..off as usize + 4096]);
        local.fill(0);
    }
    let after = client.stats();
    assert_eq!(after.worker_handoffs, before.worker_handoffs, "{after:?}");
    assert_eq!(after.worker_wakeups, before.worker_wakeups, "{after:?}");
    assert_eq!(after.inline_transfers - before.inline_transfers, 100);
    assert_eq!(after.tcp_bytes - before.tcp_bytes, 100 * 4096);

    // The same read through submit and wait goes to a worker: the counter counts.
    submit_and_wait(
        &client,
        &[at(Op::Read, &local, seg, remote.addr(), 0, 4096)],
    );
    let batch = client.stats();
    assert_eq!(batch.worker_handoffs, after.worker_handoffs + 1);
    assert_eq!(batch.inline_transfers, after.inline_transfers);

    // Up to 1 MiB runs on the calling thread; more too, with this engine's one worker
    // (several share it: `a_large_transfer_runs_inline_unless_workers_can_share_it`).
    let mut whole = vec![0u8; 2 << 20];
    let first = at(Op::Read, &whole, seg, remote.addr(), 0, 1 << 20);
    // SAFETY: `whole` outlives both calls.
    unsafe { client.transfer_sync(&[first]) }.unwrap();
    let one_mib = client.stats();
    assert_eq!(one_mib.inline_transfers, batch.inline_transfers + 1);
    assert_eq!(one_mib.worker_handoffs, batch.worker_handoffs);
    let second = Request {
        local: whole.as_mut_ptr() as u64 + (1 << 20),
        ..first
    };
    // SAFETY: as above.
    unsafe { client.transfer_sync(&[first, second]) }.unwrap();
    assert!(whole[..1 << 20] == remote.buf[..] && whole[1 << 20..] == remote.buf[..]);
    let two_mib = client.stats();
    assert_eq!(two_mib.inline_transfers, one_mib.inline_transfers + 1);
    assert_eq!(
        two_mib.worker_handoffs, one_mib.worker_handoffs,
        "{two_mib:?}"
    );
}

#[test]
fn a_small_synchronous_transfer_to_this_engine_wakes_no_worker() {
    let engine = engine_with("P2PHANDSHAKE", "auto");
    let remote = Registered::new(&engine, pattern(2, 64 << 10));
    let seg = engine.open_segment(engine.segment_name()).unwrap();
    let local = vec![0u8; 64 << 10];
    let before = engine.stats();
    let reqs: Vec<Request> = (0..16)
        .map(|i| at(Op::Read, &local, seg, remote.addr(), i * 4096, 4096))
        .collect();
    // SAFETY: `local` outlives the call.
    unsafe { engine.transfer_sync(&reqs) }.unwrap();
    assert!(local == remote.buf);
    let after = engine.stats();
    assert_eq!(after.worker_handoffs, before.worker_handoffs, "{after:?}");
    assert_eq!(after.worker_wakeups, before.worker_wakeups);
    assert_eq!(after.local_bytes - before.local_bytes, 64 << 10);
}

/// An engine with `workers` workers over `protocol`.
fn engine_with_workers(protocol: &str, workers: usize) -> Engine {
    let mut cfg = EngineConfig::default();
    cfg.set("protocol", protocol).unwrap();
    cfg.set("workers", &workers.to_string()).unwrap();
    Engine::new(cfg).unwrap()
}

/// Over shared memory (a copy) and over TCP alike: with TCP the bytes then land in the
/// caller's buffer from the caller's own core (a worker on another core would find the
/// lines the caller last read in that core's cache, and pay for each one).
#[test]
fn a_large_transfer_runs_inline_unless_workers_can_share_it() {
    let server = engine_with("P2PHANDSHAKE", "tcp");
    for protocol in ["auto", "tcp"] {
        for (workers, inline) in [(1, true), (2, false)] {
            let client = engine_with_workers(protocol, workers);
            // Same process over shared memory: the client's own segment.
            let owner = if protocol == "auto" { &client } else { &server };
            let remote = Registered::new(owner, pattern(4, 4 << 20));
            let seg = client.open_segment(owner.segment_name()).unwrap();
            let local = vec![0u8; 4 << 20];
            let before = client.stats();
            let read = at(Op::Read, &local, seg, remote.addr(), 0, 4 << 20);
            // SAFETY: `local` outlives the call.
            unsafe { client.transfer_sync(&[read]) }.unwrap();
            assert!(local == remote.buf);
            let after = client.stats();
            let ran_inline = after.inline_transfers - before.inline_transfers == 1;
            let how = format!("{protocol}, {workers} worker(s): {after:?}");
            assert_eq!(ran_inline, inline, "{how}");
            assert_eq!(
                after.worker_handoffs == before.worker_handoffs,
                inline,
                "{how}"
            );
        }
    }
}

/// A client engine with one TCP lane per peer, so its sends are countable exactly.
fn one_lane_client() -> Engine {
    let mut cfg = EngineConfig::default();
    cfg.set("protocol", "tcp").unwrap();
    cfg.set("lanes_per_peer", "1").unwrap();
    // One worker: the send count below is per lane, and each worker has its own.
    cfg.set("workers", "1").unwrap();
    Engine::new(cfg).unwrap()
}

#[test]
fn sixty_four_small_reads_to_one_peer_leave_in_a_handful_of_sends() {
    let server = engine_with("P2PHANDSHAKE", "tcp");
    let client = one_lane_client();
    let remote = Registered::new(&server, pattern(3, 64 * 4096));
    let seg = client.open_segment(server.segment_name()).unwrap();
    let local = vec![0u8; 64 * 4096];
    let reads: Vec<Request> = (0..64)
        .map(|i| at(Op::Read, &local, seg, remote.addr(), i * 4096, 4096))
        .collect();
    // Connect both paths first (the worker's lane and the calling thread's).
    submit_and_wait(&client, &reads[..1]);
    // SAFETY: `local` outlives the call.
    unsafe { client.transfer_sync(&reads[..1]) }.unwrap();

    let before = client.stats();
    submit_and_wait(&client, &reads);
    let batch = client.stats();
    assert!(local == remote.buf, "the batch read every byte");
    let sends = batch.tcp_sends - before.tcp_sends;
    assert!(sends <= 4, "64 reads through a worker took {sends} sends");

    let local = vec![0u8; 64 * 4096];
    let reads: Vec<Request> = (0..64)
        .map(|i| at(Op::Read, &local, seg, remote.addr(), i * 4096, 4096))
        .collect();
    // SAFETY: `local` outlives the call.
    unsafe { client.transfer_sync(&reads) }.unwrap();
    let sync = client.stats();
    assert!(local == remote.buf, "the synchronous batch read every byte");
    let sends = sync.tcp_sends - batch.tcp_sends;
    assert!(sends <= 4, "64 synchronous reads took {sends} sends");
    assert_eq!(sync.tcp_bytes - before.tcp_bytes, 2 * 64 * 4096);
}

/// A `kB` line of `/proc/self/status`.
fn status_kib(key: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(key)?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no {key} in /proc/self/status"))
}

/// A `mooncake target` child serving one engine-allocated buffer of `size` bytes, or
/// `None` (said why) when it cannot start, e.g. the machine refuses the address space.
struct BigTarget(Child, String);

impl BigTarget {
    fn spawn(size: u64) -> Option<BigTarget> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_mooncake"))
            .args([
                "target",
                "--metadata",
                "P2PHANDSHAKE",
                "--bind",
                "127.0.0.1",
            ])
            .args(["--until-stdin-eof", "--size", &size.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn mooncake target");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("piped stdout");
        let _ = std::io::BufReader::new(stdout).read_line(&mut line);
        let name = line
            .trim()
            .strip_prefix("ready ")
            .and_then(|rest| rest.split_whitespace().next())
            .map(str::to_owned);
        let target = BigTarget(child, name.clone().unwrap_or_default());
        name.map(|_| target)
    }
}

impl Drop for BigTarget {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn mapping_an_untouched_64_gib_same_host_segment_allocates_no_memory() {
    const SIZE: u64 = 64 << 30;
    let Some(target) = BigTarget::spawn(SIZE) else {
        eprintln!("skipped: a target with a 64 GiB buffer did not start here (address space?)");
        return;
    };
    let client = engine_with("P2PHANDSHAKE", "shm");
    let seg = client.open_segment(&target.1).unwrap();
    let desc = client.segment_descriptor(seg).unwrap();
    let remote = desc
        .buffers
        .iter()
        .find(|b| b.length >= SIZE)
        .expect("the target's buffer")
        .addr;
    let mut buf = vec![1u8; 4096];
    let (size_before, shmem_before) = (status_kib("VmSize:"), status_kib("RssShmem:"));
    // The first touch maps the whole segment; its last page is read.
    let req = at(Op::Read, &buf, seg, remote + SIZE - 4096, 0, 4096);
    // SAFETY: `buf` outlives the call.
    unsafe { client.transfer_sync(&[req]) }.unwrap();
    let (size_after, shmem_after) = (status_kib("VmSize:"), status_kib("RssShmem:"));
    assert!(
        buf.iter().all(|&b| b == 0),
        "the untouched page reads as zeros"
    );
    assert_eq!(
        client.stats().shm_bytes,
        4096,
        "the read went through the mapping"
    );
    // Less a GiB: the other tests in this process start and end engines meanwhile
    // (thread stacks, buffers), so the address space also moves by their share.
    assert!(
        size_after.saturating_sub(size_before) >= (SIZE >> 10) - (1 << 20),
        "the segment is mapped: VmSize {size_before} -> {size_after} KiB"
    );
    // A few pages (the guard page, the owner's range table, the page read), not 64 GiB.
    let gained = shmem_after.saturating_sub(shmem_before);
    assert!(
        gained < 16 << 10,
        "mapping cost {gained} KiB of shared memory"
    );
    buf.fill(0);
}

#[test]
fn synchronous_transfers_from_more_threads_than_runners_all_land() {
    let server = engine_with("P2PHANDSHAKE", "tcp");
    let client = engine_with("P2PHANDSHAKE", "tcp");
    let threads = 12u64; // more than an engine keeps calling-thread poll loops for
    let remote = Registered::new(&server, pattern(4, threads as usize * 4096));
    let seg = client.open_segment(server.segment_name()).unwrap();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (client, remote) = (&client, &remote);
            s.spawn(move || {
                let mut local = vec![0u8; 4096];
                let want = &remote.buf[t as usize * 4096..][..4096];
                for _ in 0..50 {
                    let req = Request {
                        op: Op::Read,
                        local: local.as_mut_ptr() as u64,
                        segment: seg,
                        remote: remote.addr() + t * 4096,
                        len: 4096,
                    };
                    // SAFETY: `local` outlives the call.
                    unsafe { client.transfer_sync(&[req]) }.unwrap();
                    assert_eq!(&local[..], want, "thread {t}");
                    local.fill(0);
                }
            });
        }
    });
    let stats = client.stats();
    assert_eq!(stats.tcp_bytes, threads * 50 * 4096);
    assert_eq!(stats.failed_slices, 0, "{stats:?}");
}
