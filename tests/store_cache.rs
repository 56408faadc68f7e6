//! Replica descriptors kept by a client within their lease (a repeated get is one
//! engine read): what the lease makes safe, what drops an entry, and that reads served
//! from kept descriptors still count for the master's eviction order.

mod common;

use common::pattern as value;
use std::time::Duration;

use mooncake::store::master::{Clock, Master, MasterConfig};
use mooncake::store::protocol::{ReplicateConfig, Request, Response, SegmentInfo};
use mooncake::store::{Client, ClientConfig, MasterServer};
use mooncake::Code;

const MIB: u64 = 1 << 20;

use common::store_server as server;

use common::store_client as client_with;

fn client(s: &MasterServer, segment: u64) -> Client {
    client_with(s, segment, true)
}

/// Overwrites `len` bytes at `addr` of `segment` behind the store's back (as a reuse of
/// the space would).
fn scribble(writer: &Client, segment: &str, addr: u64, len: usize) {
    let garbage = vec![0xEEu8; len];
    let e = writer.engine();
    let seg = e.open_segment(segment).unwrap();
    let b = e.allocate_batch(1).unwrap();
    let req = mooncake::Request {
        op: mooncake::Op::Write,
        local: garbage.as_ptr() as u64,
        segment: seg,
        remote: addr,
        len: len as u64,
    };
    // SAFETY: `garbage` outlives the wait.
    unsafe { e.submit(b, &[req]) }.unwrap();
    e.wait_batch(b, Some(Duration::from_secs(10))).unwrap();
    e.free_batch(b).unwrap();
}

#[test]
fn a_kept_descriptor_serves_gets_without_the_master() {
    let s = server(10_000);
    let node = client(&s, 16 * MIB);
    let kept = client(&s, 0);
    let uncached = client_with(&s, 0, false);
    let v = value(1, 4096);
    kept.put("k", &v, &ReplicateConfig::default()).unwrap();
    kept.put("never-read", &v, &ReplicateConfig::default())
        .unwrap();
    // A key's first read keeps nothing (most keys are read once); its second does.
    assert_eq!(kept.get("k").unwrap(), v);
    assert_eq!(kept.cached_descriptors(), 0);
    assert_eq!(kept.get("k").unwrap(), v);
    assert_eq!(uncached.get("k").unwrap(), v);
    assert_eq!(kept.cached_descriptors(), 1);
    assert_eq!(uncached.cached_descriptors(), 0);
    drop(s); // the master is gone; the node still serves its memory
    assert_eq!(kept.get("k").unwrap(), v, "served with the kept descriptor");
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` is exclusively borrowed for the call.
    let batch = unsafe { kept.batch_get_into(&["k"], &[vec![(buf.as_mut_ptr() as u64, 4096)]]) };
    assert_eq!(batch[0].as_ref().copied().unwrap(), 4096);
    assert_eq!(buf, v);
    // Whatever was not kept needs the master.
    assert!(kept.get("never-read").is_err());
    assert!(uncached.get("k").is_err());
    drop((kept, uncached, node));
}

#[test]
fn the_lease_forbids_a_plain_remove_and_a_forced_one_never_yields_wrong_bytes() {
    let s = server(10_000);
    let node = client(&s, 16 * MIB);
    let reader = client(&s, 0);
    let other = client(&s, 0);
    let v = value(2, 8192);
    other.put("k", &v, &ReplicateConfig::default()).unwrap();
    for _ in 0..2 {
        assert_eq!(reader.get("k").unwrap(), v); // the second read keeps it
    }
    assert_eq!(reader.cached_descriptors(), 1);
    let (_, _, replicas) = s.master().query("k").unwrap();
    let piece = replicas[0].pieces[0].clone();
    // The reader's lease stands: another client may not remove the object ...
    assert_eq!(
        other.remove("k", false).unwrap_err().code(),
        Code::ObjectHasLease
    );
    // ... unless forced; its space is then kept until the lease ends, so a kept read
    // still gets the bytes it leased.
    other.remove("k", true).unwrap();
    other
        .put("k", &value(3, 8192), &ReplicateConfig::default())
        .unwrap();
    assert_eq!(reader.get("k").unwrap(), v);
    // Were the space rewritten anyway (a node that lost its master, say), the checksum
    // catches it: the kept descriptor is dropped and the master asked again.
    scribble(&node, &piece.segment, piece.addr, 64);
    assert_eq!(reader.get("k").unwrap(), value(3, 8192));
    // A batch read of a value that is wrong at the master's own place too fails.
    let (_, _, now) = s.master().query("k").unwrap();
    let fresh = now[0].pieces[0].clone();
    scribble(&node, &fresh.segment, fresh.addr, 64);
    let mut buf = vec![0u8; 8192];
    // SAFETY: `buf` is exclusively borrowed for the call.
    let r = unsafe { reader.batch_get_into(&["k"], &[vec![(buf.as_mut_ptr() as u64, 8192)]]) };
    assert_eq!(
        r[0].as_ref().unwrap_err().code(),
        Code::ChecksumMismatch,
        "a wrong value is an error, never bytes"
    );
    assert_eq!(
        reader.cached_descriptors(),
        0,
        "a failed read keeps nothing"
    );
}

#[test]
fn own_removes_and_puts_drop_the_kept_descriptor() {
    let s = server(10_000);
    let _node = client(&s, 16 * MIB);
    let c = client(&s, 0);
    let cfg = ReplicateConfig::default();
    c.put("a", &value(4, 1000), &cfg).unwrap();
    c.put("b", &value(5, 1000), &cfg).unwrap();
    for _ in 0..2 {
        c.get("a").unwrap();
        c.get("b").unwrap();
    }
    assert_eq!(c.cached_descriptors(), 2);
    c.remove("a", true).unwrap();
    assert_eq!(c.cached_descriptors(), 1);
    assert_eq!(c.get("a").unwrap_err().code(), Code::ObjectNotFound);
    c.put("a", &value(6, 500), &cfg).unwrap();
    assert_eq!(c.get("a").unwrap(), value(6, 500));
    // An upsert drops it before asking the master (which refuses while leased).
    assert_eq!(
        c.upsert("b", &value(7, 10), &cfg).unwrap_err().code(),
        Code::ObjectHasLease
    );
    assert_eq!(c.cached_descriptors(), 1);
    assert_eq!(c.batch_remove(&["a"], true)[0].as_ref().copied(), Ok(()));
    assert_eq!(c.cached_descriptors(), 0);
    c.get("b").unwrap(); // read before: kept again
    assert_eq!(c.cached_descriptors(), 1);
    assert_eq!(c.remove_all(true).unwrap(), 1);
    assert_eq!(c.cached_descriptors(), 0);
    assert_eq!(c.get("b").unwrap_err().code(), Code::ObjectNotFound);
}

#[test]
fn an_expired_lease_is_never_kept() {
    let s = server(0);
    let _node = client(&s, 8 * MIB);
    let c = client(&s, 0);
    c.put("k", &value(1, 1000), &ReplicateConfig::default())
        .unwrap();
    for _ in 0..2 {
        assert_eq!(c.get("k").unwrap_err().code(), Code::LeaseExpired);
        assert_eq!(c.cached_descriptors(), 0);
    }
}

/// A read into one span per key (what the packed C call makes) keeps descriptors and,
/// when a kept one's bytes turn out wrong, drops it and asks the master again, as a read
/// into parts does.
#[test]
fn a_span_read_asks_again_for_a_wrong_kept_descriptor() {
    let s = server(10_000);
    let node = client(&s, 16 * MIB);
    let reader = client(&s, 0);
    let other = client(&s, 0);
    let cfg = ReplicateConfig::default();
    other.put("k", &value(2, 8192), &cfg).unwrap();
    let mut buf = vec![0u8; 2 * 8192];
    let spans = [
        (buf.as_mut_ptr() as u64, 8192),
        (buf.as_mut_ptr() as u64 + 8192, 8192),
    ];
    // SAFETY: `buf` outlives each call and nothing else touches it meanwhile.
    let read = || unsafe { reader.batch_get_into_spans(&["k", "absent"], &spans) };
    read(); // the first read marks the key; the second keeps its descriptor
    let got = read();
    assert_eq!(got[0].as_ref().ok(), Some(&8192));
    assert_eq!(got[1].as_ref().unwrap_err().code(), Code::ObjectNotFound);
    assert_eq!(&buf[..8192], &value(2, 8192)[..]);
    assert_eq!(reader.cached_descriptors(), 1);
    let (_, _, replicas) = s.master().query("k").unwrap();
    let old = replicas[0].pieces[0].clone();
    other.remove("k", true).unwrap();
    other.put("k", &value(3, 8192), &cfg).unwrap();
    scribble(&node, &old.segment, old.addr, 64);
    assert_eq!(read()[0].as_ref().ok(), Some(&8192));
    assert_eq!(&buf[..8192], &value(3, 8192)[..]);
    // SAFETY: as above.
    let short = unsafe { reader.batch_get_into_spans(&["k"], &spans) };
    assert_eq!(short[0].as_ref().unwrap_err().code(), Code::InvalidParams);
}

/// Keys in the large batches below.
const BATCH: usize = 48;

/// A master, a node, and a reader that put `BATCH` keys `{prefix}-{i}` (value `i`,
/// `1000 + i` bytes) and read keys `kept` twice, so that their descriptors are kept.
fn batch_with_kept_keys(
    prefix: &str,
    kept: std::ops::Range<usize>,
) -> (MasterServer, Client, Client, Vec<String>) {
    let s = server(10_000);
    let node = client(&s, 32 * MIB);
    let reader = client(&s, 0);
    let keys: Vec<String> = (0..BATCH).map(|i| format!("{prefix}-{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        let cfg = ReplicateConfig::default();
        reader.put(k, &value(i as u64, 1000 + i), &cfg).unwrap();
    }
    for _ in 0..2 {
        for k in &keys[kept.clone()] {
            reader.get(k).unwrap();
        }
    }
    assert_eq!(reader.cached_descriptors(), kept.len());
    (s, node, reader, keys)
}

/// `BATCH` spans of 2 KiB, one after another in `buf`.
fn spans_in(buf: &mut [u8]) -> Vec<(u64, u64)> {
    (0..BATCH)
        .map(|i| (buf.as_mut_ptr() as u64 + i as u64 * 2048, 2048))
        .collect()
}

/// A batch's answers from `batch_with_kept_keys`'s values: keys `missing` not found,
/// key `short` too small for its buffer, every other key its value, in its place.
fn assert_answered_in_place(
    got: &[mooncake::Result<u64>],
    buf: &[u8],
    missing: &[usize],
    short: usize,
) {
    for (i, r) in got.iter().enumerate() {
        if missing.contains(&i) {
            assert_eq!(r.as_ref().unwrap_err().code(), Code::ObjectNotFound);
        } else if i == short {
            assert_eq!(r.as_ref().unwrap_err().code(), Code::BufferOverflow);
        } else {
            assert_eq!(r.as_ref().ok(), Some(&(1000 + i as u64)), "key {i}");
            let want = value(i as u64, 1000 + i);
            assert_eq!(&buf[i * 2048..][..want.len()], &want[..], "key {i}");
        }
    }
}

/// A batch with many keys to ask the master for asks for a third first and reads
/// those (with the kept ones) while the master looks up the rest: two lookups, and
/// every key's answer and bytes in its own place, whatever each key's fate.
#[test]
fn a_large_batch_is_asked_for_in_two_steps_and_answered_in_key_order() {
    // Three keys read twice before: kept, served without asking.
    let (s, _node, reader, keys) = batch_with_kept_keys("big", 10..13);
    let mut asked: Vec<&str> = keys.iter().map(String::as_str).collect();
    asked[5] = "big-missing";
    let mut buf = vec![0u8; BATCH * 2048];
    let mut spans = spans_in(&mut buf);
    spans[40].1 = 100; // too small for its value
    let before = master_lookups(&s);
    // SAFETY: `buf` outlives the call and nothing else touches it meanwhile.
    let got = unsafe { reader.batch_get_into_spans(&asked, &spans) };
    let asked_for = master_lookups(&s) - before;
    assert_eq!(asked_for, 2, "45 keys asked for in two steps");
    assert_answered_in_place(&got, &buf, &[5], 40);
}

/// A large batch whose kept keys sit in its tail, and missing keys and a buffer too
/// small on both sides of its first third: two lookups, every key's answer and bytes
/// in its own place; once most keys are kept, the few new ones take one lookup.
#[test]
fn a_large_batch_with_kept_keys_in_its_tail_answers_in_key_order() {
    // Keys 30..33 read twice before: kept, in the batch's tail.
    let (s, _node, reader, keys) = batch_with_kept_keys("head", 30..33);
    let lookups = || master_lookups(&s);
    let mut asked: Vec<&str> = keys.iter().map(String::as_str).collect();
    asked[2] = "head-missing"; // in the first third
    asked[20] = "tail-missing";
    let mut buf = vec![0u8; BATCH * 2048];
    let mut spans = spans_in(&mut buf);
    spans[7].1 = 100; // too small for its value, in the first third
    let before = lookups();
    // SAFETY: `buf` outlives the call and nothing else touches it meanwhile.
    let got = unsafe { reader.batch_get_into_spans(&asked, &spans) };
    let asked_for = lookups() - before;
    assert_eq!(
        asked_for, 2,
        "a third of the keys to ask for, then the rest"
    );
    assert_answered_in_place(&got, &buf, &[2, 20], 7);
    // Read twice now, every key found is kept but key 7 (its read failed): a batch of
    // 12 new keys, then 36 kept ones, asks for the new ones alone.
    // SAFETY: as above.
    let _ = unsafe { reader.batch_get_into_spans(&asked, &spans) };
    let fresh: Vec<String> = (0..12).map(|i| format!("head-new-{i}")).collect();
    for (i, k) in fresh.iter().enumerate() {
        let cfg = ReplicateConfig::default();
        reader.put(k, &value(100 + i as u64, 900), &cfg).unwrap();
    }
    let kept = (8..BATCH).filter(|&i| i != 20).take(36);
    let mixed: Vec<&str> = (fresh.iter().map(String::as_str))
        .chain(kept.clone().map(|i| asked[i]))
        .collect();
    let spans = spans_in(&mut buf);
    let before = lookups();
    // SAFETY: as above.
    let got = unsafe { reader.batch_get_into_spans(&mixed, &spans) };
    assert_eq!(lookups() - before, 1, "12 new keys asked for in one step");
    let sizes = (0..12).map(|_| 900).chain(kept.map(|i| 1000 + i as u64));
    for (j, (r, size)) in got.iter().zip(sizes).enumerate() {
        assert_eq!(r.as_ref().ok(), Some(&size), "key {j}");
    }
    assert_eq!(&buf[..900], &value(100, 900)[..]);
}

fn master_lookups(s: &MasterServer) -> u64 {
    s.master()
        .metrics_text()
        .lines()
        .find_map(|l| {
            let v = l.strip_prefix("master_batch_get_replica_list_requests_total ")?;
            v.parse::<u64>().ok()
        })
        .unwrap_or(0)
}

/// With the master gone, a large batch's kept keys are still read, and the keys to ask
/// for fail with the master's absence (asked for once: the rest fail as the first did),
/// whether a kept key is among the first third or not.
#[test]
fn a_large_batch_reads_its_kept_keys_with_the_master_gone() {
    for kept in [3, 30] {
        let s = server(10_000);
        let node = client(&s, 32 * MIB);
        let reader = client(&s, 0);
        let cfg = ReplicateConfig::default();
        let keys: Vec<String> = (0..40).map(|i| format!("gone-{i}")).collect();
        for (i, k) in keys.iter().enumerate() {
            node.put(k, &value(i as u64, 512), &cfg).unwrap();
        }
        for _ in 0..2 {
            reader.get(&keys[kept]).unwrap();
        }
        assert_eq!(reader.cached_descriptors(), 1);
        drop(s); // the node still serves its memory
        let asked: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut buf = vec![0u8; 40 * 512];
        let spans: Vec<(u64, u64)> = (0..40)
            .map(|i| (buf.as_mut_ptr() as u64 + i * 512, 512))
            .collect();
        // SAFETY: `buf` outlives the call and nothing else touches it meanwhile.
        let got = unsafe { reader.batch_get_into_spans(&asked, &spans) };
        for (i, r) in got.iter().enumerate() {
            if i == kept {
                assert_eq!(r.as_ref().ok(), Some(&512));
                assert_eq!(&buf[kept * 512..][..512], &value(kept as u64, 512)[..]);
            } else {
                assert_eq!(r.as_ref().unwrap_err().code(), Code::RpcFail, "key {i}");
            }
        }
        drop((reader, node));
    }
}

#[test]
fn a_dead_node_sends_kept_reads_to_another_replica() {
    let s = server(10_000);
    let n1 = client(&s, 16 * MIB);
    let _n2 = client(&s, 16 * MIB);
    let c = client(&s, 0);
    let two = ReplicateConfig {
        replica_num: 2,
        ..Default::default()
    };
    let v = value(8, 20_000);
    c.put("k", &v, &two).unwrap();
    assert_eq!(c.get("k").unwrap(), v);
    drop(n1); // unmounts and frees its memory
    for _ in 0..3 {
        assert_eq!(c.get("k").unwrap(), v);
    }
}

fn in_process_master(clock: &Clock) -> Master {
    let mut cfg = MasterConfig::default();
    cfg.allocator.slab_size = MIB;
    let m = Master::with_clock(cfg, clock.clone());
    m.handle(Request::Mount {
        client: 1,
        segment: SegmentInfo {
            name: "a".into(),
            base: 1 << 40,
            size: 4 * MIB,
        },
    })
    .unwrap();
    m
}

fn put(m: &Master, key: &str) {
    let Response::PutStart(r) = m
        .handle(Request::PutStart {
            client: 1,
            items: vec![(key.to_owned(), MIB)],
            config: ReplicateConfig::default(),
            upsert: false,
        })
        .unwrap()
    else {
        panic!("wrong answer")
    };
    assert!(r[0].is_ok(), "{key}: {:?}", r[0]);
    m.handle(Request::PutEnd {
        client: 1,
        items: vec![(key.to_owned(), 7)],
    })
    .unwrap();
}

fn exists(m: &Master, key: &str) -> bool {
    let Response::Exists(r) = m
        .handle(Request::Exists {
            keys: vec![key.to_owned()],
        })
        .unwrap()
    else {
        panic!("wrong answer")
    };
    r[0].unwrap()
}

/// Fills the pool with `k0`, `k1`, ..., hitting `k0` through `Touch` when `touch`, then
/// puts until the first eviction; whether `k0` survived it.
fn first_survives_eviction(touch: bool) -> bool {
    let clock = Clock::manual();
    let m = in_process_master(&clock);
    put(&m, "k0");
    put(&m, "k1");
    put(&m, "k2");
    if touch {
        for _ in 0..3 {
            let batches = vec![vec!["k0".to_owned(), "unknown".to_owned()], vec![]];
            assert!(matches!(
                m.handle(Request::Touch { batches }),
                Ok(Response::Done)
            ));
        }
    }
    let mut n = 3;
    while m.stats().evicted_objects == 0 {
        put(&m, &format!("k{n}"));
        n += 1;
        assert!(n < 64, "the pool never filled");
    }
    exists(&m, "k0")
}

#[test]
fn touches_count_as_hits_and_take_no_lease() {
    assert!(
        !first_survives_eviction(false),
        "untouched, the oldest goes first"
    );
    assert!(first_survives_eviction(true), "touched, it stays");
    // A touch takes no lease: the object may still be removed.
    let clock = Clock::manual();
    let m = in_process_master(&clock);
    put(&m, "t");
    m.handle(Request::Touch {
        batches: vec![vec!["t".into()]],
    })
    .unwrap();
    m.handle(Request::Remove {
        key: "t".into(),
        force: false,
    })
    .unwrap();
    assert!(!exists(&m, "t"));
}

/// A client over `protocol` (the others here use TCP).
fn client_over(s: &MasterServer, segment: u64, protocol: &str) -> Client {
    client_with_workers(s, segment, protocol, 1)
}

fn client_with_workers(s: &MasterServer, segment: u64, protocol: &str, workers: usize) -> Client {
    let metadata = s.metadata_url().unwrap();
    let mut cfg = ClientConfig {
        global_segment_size: segment,
        ..ClientConfig::connect(&s.rpc_addr().to_string(), &metadata, protocol).unwrap()
    };
    cfg.engine.set("workers", &workers.to_string()).unwrap();
    Client::new(cfg).unwrap()
}

/// The read is one checksummed engine batch whatever the path: the calling thread runs
/// it (TCP, or shared memory with the copy folding the bytes as it moves them), or,
/// with several workers over TCP, the workers checksum each slice as it lands. Either
/// way a byte changed anywhere in the object is caught.
#[test]
fn a_large_read_checks_every_chunk_of_its_checksum() {
    for (protocol, workers) in [("tcp", 1), ("tcp", 2), ("auto", 1)] {
        a_large_read_checks_every_chunk_over(protocol, workers);
    }
}

fn a_large_read_checks_every_chunk_over(protocol: &str, workers: usize) {
    let s = server(10_000);
    let node = client_over(&s, 32 * MIB, protocol);
    let c = client_with_workers(&s, 0, protocol, workers);
    // Striped over slabs and not a whole number of checksum chunks.
    let v = value(9, (9 * MIB + 12_345) as usize);
    c.put("big", &v, &ReplicateConfig::default()).unwrap();
    let before = c.engine().stats().inline_transfers;
    assert_eq!(c.get("big").unwrap(), v);
    let inline = c.engine().stats().inline_transfers - before;
    match workers {
        1 => assert_eq!(inline, 1, "one batch, on the calling thread"),
        _ => assert_eq!(inline, 0, "one batch, to the workers"),
    }
    let mut buf = vec![0u8; v.len() + 100];
    // SAFETY: `buf` is exclusively borrowed for the call.
    let r = unsafe {
        c.batch_get_into(
            &["big"],
            &[vec![(buf.as_mut_ptr() as u64, buf.len() as u64)]],
        )
    };
    assert_eq!(*r[0].as_ref().unwrap(), v.len() as u64);
    assert_eq!(&buf[..v.len()], &v[..]);
    // Into three buffers whose edges fall inside slices.
    let mut split = vec![0u8; v.len()];
    let (a, rest) = split.split_at_mut(MIB as usize / 3);
    let (b, tail) = rest.split_at_mut(5 * MIB as usize + 7);
    let parts = vec![
        (a.as_mut_ptr() as u64, a.len() as u64),
        (b.as_mut_ptr() as u64, b.len() as u64),
        (tail.as_mut_ptr() as u64, tail.len() as u64),
    ];
    // SAFETY: `split` is exclusively borrowed for the call.
    let r = unsafe { c.batch_get_into(&["big"], &[parts]) };
    assert_eq!(*r[0].as_ref().unwrap(), v.len() as u64);
    assert!(split == v);
    // One byte wrong in the last piece is caught; so is one in the first.
    c.put("big2", &v, &ReplicateConfig::default()).unwrap();
    let (_, _, replicas) = s.master().query("big").unwrap();
    let last = replicas[0].pieces.last().unwrap().clone();
    scribble(&node, &last.segment, last.addr + last.len - 1, 1);
    assert_eq!(c.get("big").unwrap_err().code(), Code::ChecksumMismatch);
    assert_eq!(c.get("big2").unwrap(), v);
    let (_, _, replicas) = s.master().query("big2").unwrap();
    let first = replicas[0].pieces[0].clone();
    scribble(&node, &first.segment, first.addr, 1);
    assert_eq!(c.get("big2").unwrap_err().code(), Code::ChecksumMismatch);
}
