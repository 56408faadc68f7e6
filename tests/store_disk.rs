//! A node's disk tier in the store: objects evicted from the node's memory go to disk
//! and are read back byte for byte, promoted to memory after the admission
//! threshold; a node restarted on the same directory announces what its disk holds;
//! a corrupted record is detected and never returned. Objects larger than a block
//! (striped into several pieces) take the same path.

mod common;

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Duration;

use common::pattern;
use mooncake::store::disk::DiskConfig;
use mooncake::store::master::Clock;
use mooncake::store::protocol::ReplicateConfig;
use mooncake::store::{Client, ClientConfig, MasterServer, ServerConfig};

const MIB: u64 = 1 << 20;
const OBJECTS: u64 = 60;
const SIZE: usize = 200_000;

struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let d = std::env::temp_dir().join(format!(
            "mc-store-disk-{what}-{}-{nonce}",
            std::process::id()
        ));
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The master runs on a manual clock: `read` moves it past each read's lease, so
/// objects read once become evictable again without waiting (clients keep their own
/// lease check on real time).
fn server(threshold: u32, clock: &Clock) -> MasterServer {
    let mut cfg = ServerConfig {
        rpc_port: 0,
        metadata_port: Some(0),
        metrics_port: None,
        ..Default::default()
    };
    cfg.master.promotion_admission_threshold = threshold;
    cfg.master.lease_ttl = Duration::from_secs(1);
    cfg.master.client_ttl = Duration::from_secs(1 << 30);
    MasterServer::start_with_clock(cfg, clock.clone()).unwrap()
}

/// Reads `i`, then lets its lease run out (for the master).
fn read(c: &Client, clock: &Clock, i: u64) -> mooncake::Result<Vec<u8>> {
    let got = c.get(&format!("d{i}"));
    clock.advance(1001);
    got
}

fn config(s: &MasterServer, segment: u64, disk: Option<&TempDir>) -> ClientConfig {
    ClientConfig {
        global_segment_size: segment,
        ping_interval: Duration::from_millis(50),
        disk: disk.map(|d| DiskConfig::new(&d.0, 64 * MIB)),
        ..ClientConfig::connect(&s.rpc_addr().to_string(), &s.metadata_url().unwrap(), "tcp")
            .unwrap()
    }
}

/// Puts more than the node's memory holds; returns how many were evicted.
fn fill(s: &MasterServer, c: &Client) -> u64 {
    for i in 0..OBJECTS {
        c.put(
            &format!("d{i}"),
            &pattern(i, SIZE),
            &ReplicateConfig::default(),
        )
        .unwrap();
    }
    let evicted = s.master().stats().evicted_objects;
    assert!(
        evicted > OBJECTS / 2,
        "the segment holds few of them: {evicted} evicted"
    );
    evicted
}

/// Memory replicas of `key` as the master sees them (no read, no read-back).
fn in_memory(s: &MasterServer, key: &str) -> usize {
    s.master()
        .query(key)
        .map_or(0, |(_, _, replicas)| replicas.len())
}

#[test]
fn evicted_objects_are_read_back_from_disk_and_promoted_on_the_second_read() {
    let dir = TempDir::new("offload");
    let clock = Clock::manual();
    let s = server(2, &clock);
    let node = Client::new(config(&s, 4 * MIB, Some(&dir))).unwrap();
    let c = Client::new(config(&s, 0, None)).unwrap();
    fill(&s, &c);
    // Nothing evicted was lost: every object is there, most of them only on disk.
    let on_disk: Vec<u64> = (0..OBJECTS)
        .filter(|i| in_memory(&s, &format!("d{i}")) == 0)
        .collect();
    assert!(on_disk.len() as u64 > OBJECTS / 2, "{on_disk:?}");
    assert_eq!(s.master().stats().objects, OBJECTS);
    let key = format!("d{}", on_disk[0]);
    // Described as a disk-tier copy on the node, without reading it back.
    let (desc, disk) = c.describe(&key).unwrap();
    assert!(desc.replicas.is_empty() && desc.size == SIZE as u64);
    assert_eq!(disk.as_deref(), Some(node.hostname()));
    assert_eq!(in_memory(&s, &key), 0);
    // First read: staged for the reader only (threshold 2); second: kept in memory.
    assert_eq!(
        read(&c, &clock, on_disk[0]).unwrap(),
        pattern(on_disk[0], SIZE)
    );
    assert_eq!(in_memory(&s, &key), 0);
    assert_eq!(
        read(&c, &clock, on_disk[0]).unwrap(),
        pattern(on_disk[0], SIZE)
    );
    assert_eq!(in_memory(&s, &key), 1, "promoted on its second read");
    // Every object reads back byte for byte (reading back evicts others to disk).
    for i in 0..OBJECTS {
        let got = read(&c, &clock, i).unwrap_or_else(|e| panic!("d{i}: {e}"));
        assert!(got == pattern(i, SIZE), "d{i} bytes");
    }
    // A removed object is gone from disk too: it does not come back.
    c.remove(&key, true).unwrap();
    assert!(c.get(&key).is_err());
}

#[test]
fn a_restarted_node_serves_its_disk_tier_and_a_corrupt_record_is_never_returned() {
    let dir = TempDir::new("restart");
    let clock = Clock::manual();
    let s = server(1, &clock);
    let c = Client::new(config(&s, 0, None)).unwrap();
    {
        let _node = Client::new(config(&s, 4 * MIB, Some(&dir))).unwrap();
        fill(&s, &c);
        // Read everything once: what is on disk comes back to memory and what was in
        // memory goes to disk, so the tier ends up holding every object.
        for i in 0..OBJECTS {
            assert!(read(&c, &clock, i).unwrap() == pattern(i, SIZE));
        }
    }
    // The node closed (its memory is gone): only what its disk holds can come back.
    assert_eq!(s.master().stats().objects, 0);
    let node = Client::new(config(&s, 4 * MIB, Some(&dir))).unwrap();
    let back: Vec<u64> = (0..OBJECTS)
        .filter(|i| s.master().query(&format!("d{i}")).is_some())
        .collect();
    assert!(
        back.len() as u64 >= OBJECTS / 2,
        "announced after the restart: {back:?}"
    );
    for &i in &back {
        let got = read(&c, &clock, i).unwrap_or_else(|e| panic!("d{i} after the restart: {e}"));
        assert!(got == pattern(i, SIZE), "d{i} bytes after the restart");
    }
    drop(node);

    // Flip one byte in the middle of every log file: those records fail their
    // checksum when read and are reported, never returned.
    let mut flipped = 0;
    for entry in std::fs::read_dir(&dir.0).unwrap() {
        let path = entry.unwrap().path();
        let len = std::fs::metadata(&path).unwrap().len();
        if len < 4096 {
            continue;
        }
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, len / 2).unwrap();
        f.write_all_at(&[b[0] ^ 0x5A], len / 2).unwrap();
        flipped += 1;
    }
    assert!(flipped > 0);
    let _node = Client::new(config(&s, 4 * MIB, Some(&dir))).unwrap();
    let (mut good, mut refused) = (0, 0);
    for i in 0..OBJECTS {
        match read(&c, &clock, i) {
            Ok(v) => {
                assert!(v == pattern(i, SIZE), "d{i}: wrong bytes returned");
                good += 1;
            }
            Err(_) => refused += 1,
        }
    }
    assert!(refused >= 1, "a corrupted record was detected");
    assert!(good >= 1, "the other records still serve");
}

/// A node's disk copy that the pool no longer counts (here: a later version of the key
/// was put while the node was away) is refused at remount and then dropped from the
/// disk, so it can never come back.
#[test]
fn a_disk_copy_the_pool_does_not_count_is_dropped_after_the_remount() {
    let dir = TempDir::new("stale");
    let clock = Clock::manual();
    let s = server(1, &clock);
    let c = Client::new(config(&s, 0, None)).unwrap();
    {
        let _node = Client::new(config(&s, 4 * MIB, Some(&dir))).unwrap();
        fill(&s, &c);
    }
    // The disk node is gone, and its objects with it; d0 is written again elsewhere.
    let _other = Client::new(config(&s, 16 * MIB, None)).unwrap();
    c.put("d0", &pattern(999, SIZE), &ReplicateConfig::default())
        .unwrap();
    {
        let node = Client::new(config(&s, 4 * MIB, Some(&dir))).unwrap();
        assert_eq!(
            read(&c, &clock, 0).unwrap(),
            pattern(999, SIZE),
            "the later d0 wins"
        );
        // A put on the node is answered once the node acknowledged its commit, which
        // comes after the reset snapshot in its log: the snapshot is applied by then.
        let here = ReplicateConfig {
            preferred_segments: vec![node.hostname().to_owned()],
            ..Default::default()
        };
        c.put("marker", b"after the snapshot", &here).unwrap();
    }
    let (tier, _) =
        mooncake::store::disk::DiskTier::open(DiskConfig::new(&dir.0, 64 * MIB)).unwrap();
    assert!(!tier.contains("d0"), "the stale copy of d0 left the disk");
    assert!(
        (1..OBJECTS).any(|i| tier.contains(&format!("d{i}"))),
        "copies the pool took back stay"
    );
}

/// Objects larger than the segment's largest block are striped into several pieces;
/// evicted, their node gathers the pieces onto disk, a read scatters them back (striped
/// again), a promotion keeps that striped replica, and a restarted node announces them.
#[test]
fn striped_objects_go_to_disk_come_back_and_survive_a_node_restart() {
    const BIG: usize = 1 << 20;
    const COUNT: u64 = 12;
    let dir = TempDir::new("striped");
    let clock = Clock::manual();
    let s = server(2, &clock);
    let c = Client::new(config(&s, 0, None)).unwrap();
    let key = |i: u64| format!("d{i}");
    {
        let _node = Client::new(config(&s, 4 * MIB, Some(&dir))).unwrap();
        for i in 0..COUNT {
            c.put(&key(i), &pattern(i, BIG), &ReplicateConfig::default())
                .unwrap();
        }
        let (_, _, replicas) = s.master().query(&key(COUNT - 1)).unwrap();
        assert!(
            replicas[0].pieces.len() > 1,
            "1 MiB is striped on a 4 MiB segment"
        );
        assert_eq!(
            s.master().stats().objects,
            COUNT,
            "nothing evicted was dropped"
        );
        let on_disk: Vec<u64> = (0..COUNT)
            .filter(|&i| in_memory(&s, &key(i)) == 0)
            .collect();
        assert!(on_disk.len() as u64 >= COUNT / 2, "{on_disk:?}");
        // Read back twice: the second read promotes it, striped as it came.
        let first = on_disk[0];
        for _ in 0..2 {
            assert!(read(&c, &clock, first).unwrap() == pattern(first, BIG));
        }
        let (_, _, replicas) = s.master().query(&key(first)).unwrap();
        assert_eq!(replicas.len(), 1, "promoted on its second read");
        assert!(replicas[0].pieces.len() > 1);
        for i in 0..COUNT {
            let got = read(&c, &clock, i).unwrap_or_else(|e| panic!("d{i}: {e}"));
            assert!(got == pattern(i, BIG), "d{i} bytes");
        }
    }
    // The node closed: what its disk holds comes back with it, striped objects too.
    assert_eq!(s.master().stats().objects, 0);
    let _node = Client::new(config(&s, 4 * MIB, Some(&dir))).unwrap();
    let back: Vec<u64> = (0..COUNT)
        .filter(|&i| s.master().query(&key(i)).is_some())
        .collect();
    assert!(
        back.len() as u64 >= COUNT / 2,
        "announced after the restart: {back:?}"
    );
    for &i in &back {
        let got = read(&c, &clock, i).unwrap_or_else(|e| panic!("d{i} after the restart: {e}"));
        assert!(got == pattern(i, BIG), "d{i} bytes after the restart");
    }
}

/// Read leases do not starve disk-tier reads: with a lease far longer than the test,
/// every object is read back from disk in turn (each copy promoted once read), more
/// bytes than the node's memory holds, and none fails for want of space.
#[test]
fn disk_tier_reads_do_not_wait_for_one_anothers_leases() {
    let dir = TempDir::new("leases");
    let clock = Clock::manual();
    let mut cfg = ServerConfig {
        rpc_port: 0,
        metadata_port: Some(0),
        metrics_port: None,
        ..Default::default()
    };
    cfg.master.promotion_admission_threshold = 1;
    cfg.master.lease_ttl = Duration::from_secs(3600);
    cfg.master.client_ttl = Duration::from_secs(1 << 30);
    let s = MasterServer::start_with_clock(cfg, clock).unwrap();
    let _node = Client::new(config(&s, 4 * MIB, Some(&dir))).unwrap();
    let c = Client::new(config(&s, 0, None)).unwrap();
    // Puts take no lease, so they fill memory and overflow to disk as before.
    fill(&s, &c);
    for round in 0..2 {
        for i in 0..OBJECTS {
            let got = c
                .get(&format!("d{i}"))
                .unwrap_or_else(|e| panic!("round {round}, d{i}: {e}"));
            assert!(got == pattern(i, SIZE), "d{i} bytes");
        }
    }
    assert_eq!(s.master().stats().objects, OBJECTS);
}

/// A disk-tier read finds no room while leases hold all of the node's memory (a reader
/// just described every object): it waits for the leases to end, within one lease,
/// and the reader's own lease counts from the read back, not from its request.
#[test]
fn a_disk_read_waits_for_leases_that_hold_every_byte() {
    let dir = TempDir::new("leased");
    let mut cfg = ServerConfig {
        rpc_port: 0,
        metadata_port: Some(0),
        metrics_port: None,
        ..Default::default()
    };
    cfg.master.lease_ttl = Duration::from_millis(300);
    let s = MasterServer::start(cfg).unwrap();
    let _node = Client::new(config(&s, 4 * MIB, Some(&dir))).unwrap();
    let c = Client::new(config(&s, 0, None)).unwrap();
    fill(&s, &c);
    let on_disk: Vec<u64> = (0..OBJECTS)
        .filter(|i| in_memory(&s, &format!("d{i}")) == 0)
        .collect();
    // Describing leases every object in memory: nothing there can be evicted now.
    for i in 0..OBJECTS {
        c.describe(&format!("d{i}")).unwrap();
    }
    let i = on_disk[0];
    assert!(c.get(&format!("d{i}")).unwrap() == pattern(i, SIZE));
}
