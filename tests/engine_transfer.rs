//! Transfers between two engines in one process, over TCP and in-process memcpy.

mod common;

use std::time::Duration;

use common::{engine_configured, engine_with, pattern, Registered};
use mooncake::engine::TaskState;
use mooncake::{Code, Op, Request};

fn round_trip(metadata: &str) {
    let server = engine_with(metadata, "tcp");
    let client = engine_with(metadata, "tcp");
    let len = 9 << 20; // several slices
    let remote = Registered::new(&server, pattern(1, len));
    let mut local = pattern(2, len);
    let seg = client.open_segment(server.segment_name()).unwrap();
    let batch = client.allocate_batch(4).unwrap();
    let reqs = [Request {
        op: Op::Read,
        local: local.as_mut_ptr() as u64,
        segment: seg,
        remote: remote.addr(),
        len: len as u64,
    }];
    // SAFETY: `local` outlives the wait below.
    unsafe { client.submit(batch, &reqs) }.unwrap();
    client
        .wait_batch(batch, Some(Duration::from_secs(30)))
        .unwrap();
    let st = client.task_status(batch, 0).unwrap();
    assert_eq!((st.state, st.bytes), (TaskState::Completed, len as u64));
    assert!(local == remote.buf, "read returned the remote bytes");

    let src = pattern(3, 4096);
    let reqs = [Request {
        op: Op::Write,
        local: src.as_ptr() as u64,
        segment: seg,
        remote: remote.addr() + 100,
        len: 4096,
    }];
    // SAFETY: `src` outlives the wait.
    unsafe { client.submit(batch, &reqs) }.unwrap();
    client
        .wait_batch(batch, Some(Duration::from_secs(30)))
        .unwrap();
    assert_eq!(&remote.buf[100..4196], &src[..]);
    assert_eq!(
        client.task_status(batch, 1).unwrap().state,
        TaskState::Completed
    );
    client.free_batch(batch).unwrap();
}

#[test]
fn p2p_tcp_round_trip() {
    round_trip("P2PHANDSHAKE");
}

#[test]
fn embedded_metadata_round_trip() {
    round_trip("embedded");
}

#[test]
fn bad_requests_are_refused_and_change_nothing() {
    let server = engine_with("P2PHANDSHAKE", "tcp");
    let client = engine_with("P2PHANDSHAKE", "tcp");
    let remote = Registered::new(&server, vec![7u8; 8192]);
    let local = vec![0u8; 8192];
    let local_addr = local.as_ptr() as u64;
    let seg = client.open_segment(server.segment_name()).unwrap();
    let batch = client.allocate_batch(2).unwrap();
    let req = |remote_addr: u64, len: u64| Request {
        op: Op::Write,
        local: local_addr,
        segment: seg,
        remote: remote_addr,
        len,
    };
    let cases = [
        (req(remote.addr(), 0), Code::InvalidParams),
        (req(remote.addr() + 8000, 200), Code::AddressNotRegistered),
        (req(remote.addr() - 1, 10), Code::AddressNotRegistered),
        (
            Request {
                segment: 999,
                ..req(remote.addr(), 8)
            },
            Code::SegmentNotFound,
        ),
    ];
    for (r, code) in cases {
        // SAFETY: nothing is submitted on error; `local` outlives the call anyway.
        let err = unsafe { client.submit(batch, &[r]) }.unwrap_err();
        assert_eq!(err.code(), code, "{err}");
    }
    assert!(remote.buf.iter().all(|&b| b == 7));
    // SAFETY: as above.
    let too_many = unsafe { client.submit(batch, &[req(remote.addr(), 8); 3]) }.unwrap_err();
    assert_eq!(too_many.code(), Code::BatchFull);
    assert_eq!(
        client.open_segment("127.0.0.1:1").unwrap_err().code(),
        Code::SegmentNotFound
    );
    assert_eq!(
        client.free_batch(12345).unwrap_err().code(),
        Code::BatchNotFound
    );
}

#[test]
fn own_segment_uses_memcpy() {
    let e = engine_with("P2PHANDSHAKE", "auto");
    let r = Registered::new(&e, pattern(5, 1 << 20));
    let mut out = vec![0u8; 1 << 20];
    let seg = e.open_segment(e.segment_name()).unwrap();
    let b = e.allocate_batch(1).unwrap();
    // SAFETY: `out` outlives the wait.
    unsafe {
        e.submit(
            b,
            &[Request {
                op: Op::Read,
                local: out.as_mut_ptr() as u64,
                segment: seg,
                remote: r.addr(),
                len: 1 << 20,
            }],
        )
    }
    .unwrap();
    e.wait_batch(b, Some(Duration::from_secs(10))).unwrap();
    assert!(out == r.buf);
}

/// A synchronous batch that stays inside the engine's own host memory is copied on
/// the calling thread, with no worker hand-off: each request's bytes land and its
/// checksum is of what landed (also for a read whose two ends overlap, which is not
/// folded during the copy). A request outside registered memory sends the whole
/// batch down the planned path, which refuses it before anything moves.
#[test]
fn own_segment_batches_are_copied_by_the_caller() {
    use mooncake::util::crc32c::crc32c;
    let e = engine_configured(&[
        ("metadata", "P2PHANDSHAKE"),
        ("protocol", "tcp"),
        ("workers", "2"),
    ]);
    let target = Registered::new(&e, pattern(7, 1 << 20));
    let seg = e.open_segment(e.segment_name()).unwrap();
    let mut out = vec![0u8; 64 * 4096];
    let reqs: Vec<Request> = (0..64u64)
        .map(|i| Request {
            op: Op::Read,
            local: out.as_mut_ptr() as u64 + i * 4096,
            segment: seg,
            remote: target.addr() + i * 8192 + 3,
            len: 4096,
        })
        .collect();
    let before = e.stats();
    // SAFETY: `out` outlives the call, which returns with every task final.
    let got = unsafe { e.read_checksummed(&reqs) }.unwrap();
    for (i, (state, crc)) in got.into_iter().enumerate() {
        let want = &target.buf[i * 8192 + 3..][..4096];
        assert_eq!(state, TaskState::Completed);
        assert_eq!(&out[i * 4096..][..4096], want, "request {i}");
        assert_eq!(crc, Some(crc32c(want)), "request {i}");
    }
    let after = e.stats();
    assert_eq!(after.local_bytes - before.local_bytes, 64 * 4096);
    assert_eq!(after.worker_handoffs, before.worker_handoffs);
    assert_eq!(after.inline_transfers, before.inline_transfers + 1);
    assert_eq!(after.own_copies, before.own_copies + 1);

    // Within the registered buffer, 100 bytes on: the ends overlap.
    let shifted = Request {
        op: Op::Read,
        local: target.addr() + 100,
        segment: seg,
        remote: target.addr(),
        len: 4096,
    };
    let original = target.buf[..4096].to_vec();
    // SAFETY: inside `target`'s buffer, which outlives the call.
    let got = unsafe { e.read_checksummed(&[shifted]) }.unwrap();
    assert_eq!(got, vec![(TaskState::Completed, Some(crc32c(&original)))]);
    assert_eq!(&target.buf[100..4196], &original[..]);

    // Writes too; and one request past the buffer refuses them all, nothing moved.
    let fresh = pattern(8, 4096);
    let write = Request {
        op: Op::Write,
        local: fresh.as_ptr() as u64,
        segment: seg,
        remote: target.addr() + (1 << 19),
        len: 4096,
    };
    let past = Request {
        remote: target.addr() + (1 << 20) - 10,
        len: 20,
        ..write
    };
    let kept = target.buf[1 << 19..][..4096].to_vec();
    // SAFETY: `fresh` outlives the call (refused before anything moves).
    let refused = unsafe { e.transfer_sync(&[write, past]) }.unwrap_err();
    assert_eq!(refused.code(), Code::AddressNotRegistered);
    assert_eq!(&target.buf[1 << 19..][..4096], &kept[..]);
    // SAFETY: as above.
    unsafe { e.transfer_sync(&[write]) }.unwrap();
    assert_eq!(&target.buf[1 << 19..][..4096], &fresh[..]);
    assert_eq!(e.stats().own_copies, after.own_copies + 2);

    // Ranges in two buffers, one after the other in either order: each buffer is
    // pinned once and every range lands; a range beginning in one buffer and
    // ending past it is refused, however the buffers lie.
    let second = Registered::new(&e, pattern(9, 1 << 16));
    let mut two = vec![0u8; 4 * 4096];
    let sources = [
        (&second, 0usize),
        (&target, 4096),
        (&second, 8192),
        (&target, 0),
    ];
    let reqs: Vec<Request> = sources
        .iter()
        .enumerate()
        .map(|(i, (buf, at))| Request {
            op: Op::Read,
            local: two.as_mut_ptr() as u64 + i as u64 * 4096,
            segment: seg,
            remote: buf.addr() + *at as u64,
            len: 4096,
        })
        .collect();
    // SAFETY: `two` outlives the call.
    let got = unsafe { e.read_checksummed(&reqs) }.unwrap();
    for (i, (buf, at)) in sources.iter().enumerate() {
        let want = &buf.buf[*at..][..4096];
        assert_eq!(&two[i * 4096..][..4096], want, "request {i}");
        assert_eq!(
            got[i],
            (TaskState::Completed, Some(crc32c(want))),
            "request {i}"
        );
    }
    assert_eq!(e.stats().own_copies, after.own_copies + 3);
    let straddling = Request {
        remote: second.addr() + (1 << 16) - 8,
        len: 16,
        ..reqs[0]
    };
    // SAFETY: as above (refused before anything moves).
    let refused = unsafe { e.read_checksummed(&[reqs[0], straddling]) };
    assert_eq!(refused.unwrap_err().code(), Code::AddressNotRegistered);
}

#[test]
fn notifications_and_probe() {
    let a = engine_with("P2PHANDSHAKE", "tcp");
    let b = engine_with("P2PHANDSHAKE", "tcp");
    let seg = a.open_segment(b.segment_name()).unwrap();
    a.probe(seg).unwrap();
    a.notify(seg, "kv ready: layer 3").unwrap();
    a.notify(seg, "done").unwrap();
    let got = b.take_notifications();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].from, a.segment_name());
    assert_eq!(got[0].message, "kv ready: layer 3");
    assert!(b.take_notifications().is_empty());
}

#[test]
fn a_notification_flood_is_bounded_in_bytes() {
    let a = engine_with("P2PHANDSHAKE", "tcp");
    let b = engine_with("P2PHANDSHAKE", "tcp");
    let seg = a.open_segment(b.segment_name()).unwrap();
    // Over the per-message limit: refused, and the sender is told.
    let huge = "x".repeat(200 << 10);
    assert_eq!(
        a.notify(seg, &huge).unwrap_err().code(),
        Code::NoAvailableHandle
    );
    // 60 KiB messages from one sender: its 4 MiB share fills, the rest is dropped.
    let msg = "y".repeat(60 << 10);
    let mut accepted = 0usize;
    for _ in 0..100 {
        if a.notify(seg, &msg).is_ok() {
            accepted += 1;
        }
    }
    assert!(accepted > 0 && accepted < 100, "accepted {accepted}");
    assert_eq!(b.dropped_notifications(), 1 + (100 - accepted) as u64);
    let queued = b.take_notifications();
    assert_eq!(queued.len(), accepted);
    let bytes: usize = queued.iter().map(|n| n.from.len() + n.message.len()).sum();
    assert!(bytes <= 4 << 20, "{bytes} bytes queued from one sender");
    // Draining frees the share.
    a.notify(seg, &msg).unwrap();
    assert_eq!(b.take_notifications().len(), 1);
}

#[test]
fn concurrent_batches_on_several_workers_move_exact_bytes() {
    let client = engine_configured(&[
        ("protocol", "tcp"),
        ("workers", "2"),
        ("lanes_per_peer", "3"),
        ("slice_size", "64K"),
    ]);
    let server = engine_with("P2PHANDSHAKE", "tcp");
    let region = 1 << 20;
    let remote = Registered::new(&server, vec![0u8; 4 * region]);
    let seg = client.open_segment(server.segment_name()).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let client = &client;
            let base = remote.addr() + t * region as u64;
            s.spawn(move || {
                let mut x = t + 1;
                for round in 0..10u64 {
                    // Eight writes of varied sizes, then one read of the whole region.
                    let src = pattern(t * 100 + round, region);
                    let b = client.allocate_batch(8).unwrap();
                    let mut reqs = Vec::new();
                    let mut off = 0u64;
                    for _ in 0..8 {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let len = (x >> 40) % (region as u64 / 8) + 1;
                        reqs.push(Request {
                            op: Op::Write,
                            local: src.as_ptr() as u64 + off,
                            segment: seg,
                            remote: base + off,
                            len,
                        });
                        off += len;
                    }
                    // SAFETY: `src` outlives the wait.
                    unsafe { client.submit(b, &reqs) }.unwrap();
                    client.wait_batch(b, Some(Duration::from_secs(60))).unwrap();
                    client.free_batch(b).unwrap();
                    let mut back = vec![0u8; off as usize];
                    let b = client.allocate_batch(1).unwrap();
                    let r = Request {
                        op: Op::Read,
                        local: back.as_mut_ptr() as u64,
                        segment: seg,
                        remote: base,
                        len: off,
                    };
                    // SAFETY: `back` outlives the wait.
                    unsafe { client.submit(b, &[r]) }.unwrap();
                    client.wait_batch(b, Some(Duration::from_secs(60))).unwrap();
                    assert!(back[..] == src[..off as usize], "thread {t} round {round}");
                    client.free_batch(b).unwrap();
                }
            });
        }
    });
    let stats = client.stats();
    assert_eq!(stats.failed_slices, 0, "{stats:?}");
}

#[test]
fn freeing_a_batch_with_unfinished_tasks_is_refused() {
    let server = engine_with("P2PHANDSHAKE", "tcp");
    let client = engine_with("P2PHANDSHAKE", "tcp");
    let remote = Registered::new(&server, vec![0u8; 64 << 20]);
    let mut local = vec![0u8; 64 << 20];
    let seg = client.open_segment(server.segment_name()).unwrap();
    let b = client.allocate_batch(1).unwrap();
    let r = Request {
        op: Op::Read,
        local: local.as_mut_ptr() as u64,
        segment: seg,
        remote: remote.addr(),
        len: 64 << 20,
    };
    // SAFETY: `local` outlives the wait.
    unsafe { client.submit(b, &[r]) }.unwrap();
    // Either still running (refused) or already done (freed); never freed while running.
    match client.free_batch(b) {
        Err(e) => {
            assert_eq!(e.code(), Code::BatchBusy);
            client.wait_batch(b, Some(Duration::from_secs(60))).unwrap();
            client.free_batch(b).unwrap();
        }
        Ok(()) => assert_eq!(
            client.task_status(b, 0).unwrap_err().code(),
            Code::BatchNotFound
        ),
    }
    assert_eq!(
        client.task_status(b, 0).unwrap_err().code(),
        Code::BatchNotFound
    );
}

/// Each completed request of a checksummed read comes back with the CRC32C of exactly
/// its bytes: over TCP cut into many slices that two workers finish in any order, and
/// through shared memory and the local copy, where the copy folds them as it goes. A
/// bad range or a write is refused before anything moves.
#[test]
fn checksummed_reads_tell_each_requests_crc32c() {
    use mooncake::util::crc32c::crc32c;
    let tcp_client = engine_configured(&[
        ("metadata", "P2PHANDSHAKE"),
        ("protocol", "tcp"),
        ("workers", "2"),
        ("slice_size", "64K"),
    ]);
    let server = engine_with("P2PHANDSHAKE", "tcp");
    let shm_client = engine_with("P2PHANDSHAKE", "shm");
    let shm_server = engine_with("P2PHANDSHAKE", "shm");
    let len = 3 << 20;
    let remote = Registered::new(&server, pattern(41, len));
    let shm_remote = Registered::new(&shm_server, pattern(42, len));
    let lens = [1usize, 100, 4096, 65_536 + 7, 1 << 20, len - 1_200_000];
    for (client, target, peer) in [
        (&tcp_client, &remote, &server),
        (&shm_client, &shm_remote, &shm_server),
        (&server, &remote, &server), // the engine reading its own segment
    ] {
        let seg = client.open_segment(peer.segment_name()).unwrap();
        let mut local = vec![0u8; lens.iter().sum::<usize>() + 4096];
        let mut reqs = Vec::new();
        let (mut at, mut from) = (0usize, 3usize);
        for &n in &lens {
            reqs.push(Request {
                op: Op::Read,
                local: local.as_mut_ptr() as u64 + at as u64,
                segment: seg,
                remote: target.addr() + from as u64,
                len: n as u64,
            });
            at += n;
            from += n / 2 + 11;
        }
        // SAFETY: `local` outlives the call, which returns with every task final.
        let got = unsafe { client.read_checksummed(&reqs) }.unwrap();
        for (r, (state, crc)) in reqs.iter().zip(got) {
            assert_eq!(state, TaskState::Completed);
            let off = (r.remote - target.addr()) as usize;
            let want = &target.buf[off..off + r.len as usize];
            let landed = (r.local - local.as_ptr() as u64) as usize;
            assert_eq!(&local[landed..landed + r.len as usize], want);
            assert_eq!(crc, Some(crc32c(want)), "{} bytes at {off}", r.len);
        }
        // A request past the end of the remote buffer: the whole call is refused.
        let past = Request {
            remote: target.addr() + len as u64 - 10,
            len: 20,
            ..reqs[0]
        };
        // SAFETY: as above (refused before anything moves).
        let refused = unsafe { client.read_checksummed(&[reqs[0], past]) }.unwrap_err();
        assert_eq!(refused.code(), Code::AddressNotRegistered);
        let write = [Request {
            op: Op::Write,
            ..reqs[0]
        }];
        // SAFETY: as above (refused before anything moves).
        let refused = unsafe { client.read_checksummed(&write) }.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidParams);
    }
}
