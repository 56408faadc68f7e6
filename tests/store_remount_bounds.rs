//! A remount's chunks sent with `last=false` wait in the master for the last one:
//! what they may hold is bounded in bytes, per segment and for all remounts
//! together, so a member cannot grow the master's memory by announcing catalogs it
//! never finishes. A refused chunk ends its own remount and nothing else.

use mooncake::store::master::{Clock, Master, MasterConfig};
use mooncake::store::protocol::{CatalogEntry, Piece, ReplicaDesc, Request, SegmentInfo};
use mooncake::Code;

const BASE: u64 = 1 << 40;

fn segment(name: &str, size: u64) -> SegmentInfo {
    SegmentInfo {
        name: name.into(),
        base: BASE,
        size,
    }
}

/// `count` catalog entries of segment `name`, each with a `key_len`-byte key.
fn chunk(name: &str, first: usize, count: usize, key_len: usize) -> Vec<CatalogEntry> {
    (first..first + count)
        .map(|i| CatalogEntry {
            key: format!("{i:0key_len$}"),
            version: 1,
            size: 64,
            crc32c: 0,
            hard_pin: false,
            replica: ReplicaDesc {
                pieces: vec![Piece {
                    segment: name.into(),
                    addr: BASE + i as u64 * 64,
                    len: 64,
                }]
                .into(),
            },
            index: 0,
        })
        .collect()
}

fn remount(
    m: &Master,
    client: u64,
    info: &SegmentInfo,
    entries: Vec<CatalogEntry>,
    last: bool,
) -> mooncake::Result<()> {
    m.handle(Request::Remount {
        client,
        segment: info.clone(),
        entries,
        disk: Vec::new(),
        last,
        owner: None,
    })
    .map(drop)
}

fn mounted(m: &Master, name: &str) -> bool {
    m.all_segments()
        .iter()
        .any(|(info, _, _)| info.name == name)
}

#[test]
fn unfinished_remount_chunks_are_bounded_per_segment() {
    let m = Master::with_clock(MasterConfig::default(), Clock::manual());
    // A segment as large as the master allows, so the old bound (one entry per 64
    // bytes of segment) would take billions of entries.
    let phantom = segment("phantom", 1 << 40);
    // About 17 MB a chunk (4096 entries with 4000-byte keys), as fast as it can send.
    let mut refused = None;
    for i in 0..24 {
        let entries = chunk("phantom", i * 4096, 4096, 4000);
        if let Err(e) = remount(&m, 7, &phantom, entries, false) {
            refused = Some((i, e));
            break;
        }
    }
    let (at, e) = refused.expect("400 MB of unfinished remount chunks were all held");
    assert!((1..=16).contains(&at), "refused at chunk {at}: {e}");
    assert_eq!(e.code(), Code::NoAvailableHandle, "{e}");
    assert!(
        e.to_string().contains("phantom") && e.to_string().contains("bound per segment"),
        "{e}"
    );
    assert!(!mounted(&m, "phantom"));
    // Its chunks were dropped: the node's next remount starts over and finishes.
    remount(&m, 7, &phantom, chunk("phantom", 0, 2, 8), true).unwrap();
    assert!(mounted(&m, "phantom"));
    // Nothing else changed: another node remounts as before.
    let real = segment("real", 64 << 20);
    remount(&m, 8, &real, chunk("real", 0, 100, 16), false).unwrap();
    remount(&m, 8, &real, Vec::new(), true).unwrap();
    assert!(mounted(&m, "real"));
}

#[test]
fn unfinished_remounts_together_are_bounded() {
    let config = MasterConfig {
        max_remount_bytes_per_segment: 1 << 20,
        max_remount_bytes: (5 << 20) / 2,
        ..MasterConfig::default()
    };
    let m = Master::with_clock(config, Clock::manual());
    let names = ["a", "b", "c"];
    let infos: Vec<_> = names.iter().map(|n| segment(n, 1 << 30)).collect();
    // About 0.9 MB each: two fit in the 2.5 MB budget, a third does not.
    let part = |n: &str| chunk(n, 0, 220, 4000);
    remount(&m, 1, &infos[0], part("a"), false).unwrap();
    remount(&m, 2, &infos[1], part("b"), false).unwrap();
    let e = remount(&m, 3, &infos[2], part("c"), false).unwrap_err();
    assert!(e.to_string().contains("unfinished remounts"), "{e}");
    // One over its own bound is refused too, whatever the total.
    let e = remount(&m, 1, &infos[0], part("a"), false).unwrap_err();
    assert!(e.to_string().contains("bound per segment"), "{e}");
    // The refused remounts left; the one in good standing still finishes.
    remount(&m, 2, &infos[1], Vec::new(), true).unwrap();
    assert!(mounted(&m, "b"));
    // With the budget free again, the third node's remount goes through.
    remount(&m, 3, &infos[2], part("c"), false).unwrap();
    remount(&m, 3, &infos[2], Vec::new(), true).unwrap();
    assert!(mounted(&m, "c"));
}

/// A node's catalog thread polls while its pinger remounts: the first snapshot the
/// poll gets must name every disk copy the remount announced (`Keep`). A snapshot
/// taken while the remount was still adopting them missed some, and the node then
/// deleted from its disk tier every copy the snapshot did not name (seen in CI:
/// `store_crash`, an object announced and then lost).
#[test]
fn a_catalog_poll_during_a_remount_waits_for_every_announced_copy() {
    use mooncake::store::protocol::{CatalogEvent, DiskEntry, Response};
    use std::collections::HashSet;
    use std::time::{Duration, Instant};

    const CLIENT: u64 = 7;
    const COPIES: usize = 20_000;
    let m = Master::with_clock(MasterConfig::default(), Clock::system());
    let info = segment("node-a", 1 << 30);
    let disk: Vec<DiskEntry> = (0..COPIES)
        .map(|i| DiskEntry {
            key: format!("d{i}"),
            version: 1,
            size: 4096,
            crc32c: 0,
        })
        .collect();
    let poll = |instance: u64, acked: u64| {
        m.handle(Request::SegmentEvents {
            client: CLIENT,
            segment: info.name.clone(),
            instance,
            acked,
            disk_capacity: 1 << 30,
            lost: Vec::new(),
            ring: Default::default(),
        })
    };
    let kept: HashSet<String> = std::thread::scope(|scope| {
        let poller = scope.spawn(|| {
            let deadline = Instant::now() + Duration::from_secs(60);
            // Until the segment is mounted and may be followed: a reset.
            let reset = loop {
                assert!(Instant::now() < deadline, "no snapshot within 60 s");
                match poll(0, 0) {
                    Ok(Response::SegmentEvents(ev)) => break ev,
                    Ok(other) => panic!("unexpected answer {other:?}"),
                    Err(e) => assert!(
                        matches!(
                            e.code(),
                            Code::SegmentNotFound | Code::UnavailableInCurrentStatus
                        ),
                        "{e}"
                    ),
                }
            };
            assert!(reset.reset);
            let mut kept = HashSet::new();
            let mut acked = reset.last;
            while acked < reset.snapshot_end {
                assert!(
                    Instant::now() < deadline,
                    "the snapshot did not end in 60 s"
                );
                let Ok(Response::SegmentEvents(ev)) = poll(reset.instance, acked) else {
                    panic!("a poll after the reset failed");
                };
                for e in ev.events {
                    if let CatalogEvent::Keep(key) = e {
                        kept.insert(key);
                    }
                }
                acked = ev.last;
            }
            kept
        });
        m.handle(Request::Remount {
            client: CLIENT,
            segment: info.clone(),
            entries: Vec::new(),
            disk: disk.clone(),
            last: true,
            owner: None,
        })
        .expect("the remount is taken");
        poller.join().expect("the poller ends")
    });
    let missing = disk.iter().filter(|d| !kept.contains(&d.key)).count();
    assert_eq!(
        missing, 0,
        "{missing} of {COPIES} announced copies not in the snapshot"
    );
}
