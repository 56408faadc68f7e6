//! Scripted runs of the real master on a manual clock, for members that lie, come
//! back late or die mid-task: a forged catalog, a squatted segment name, a writer
//! landing in space that was lent again, a node killed before it wrote an offload. Each script is one exact sequence of requests; the
//! randomised worlds (`world.rs`) keep the other invariants.

use std::time::{Duration, Instant};

use mooncake::store::master::{Clock, Master, MasterConfig};
use mooncake::store::protocol::{
    CatalogEntry, CatalogEvent, DiskEntry, ObjectDesc, OwnerTicket, Piece, ReplicaDesc,
    ReplicateConfig, Request, Response, SegmentEvents, SegmentInfo,
};
use mooncake::Code;

const SEGMENT: u64 = 1 << 20;
const SIZE: u64 = 4096;
const TTL_MS: u64 = 10_000;
const LEASE_MS: u64 = 2_000;
const RELEASE_MS: u64 = 60_000;

fn master(clock: &Clock) -> Master {
    let config = MasterConfig {
        lease_ttl: Duration::from_millis(LEASE_MS),
        client_ttl: Duration::from_millis(TTL_MS),
        put_start_discard_timeout: Duration::from_millis(10_000),
        put_start_release_timeout: Duration::from_millis(RELEASE_MS),
        // Nobody follows the catalogs here: a PutEnd must not wait for them.
        catalog_ack_timeout: Duration::ZERO,
        shards: 4,
        ..MasterConfig::default()
    };
    Master::with_clock(config, clock.clone())
}

/// A master started at least a millisecond after now (by the wall clock its versions
/// count from), as a restarted one always is.
fn master_started_later(clock: &Clock) -> Master {
    let (start, deadline) = (unix_ms(), Instant::now() + Duration::from_secs(1));
    while unix_ms() <= start {
        assert!(Instant::now() < deadline, "the wall clock stands still");
        std::hint::spin_loop();
    }
    master(clock)
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Segment `name`, the `index`th node's memory.
fn segment(name: &str, index: u64) -> SegmentInfo {
    SegmentInfo {
        name: name.into(),
        base: (1 << 40) + (index << 32),
        size: SEGMENT,
    }
}

fn remount(
    m: &Master,
    client: u64,
    info: &SegmentInfo,
    entries: Vec<CatalogEntry>,
    disk: Vec<DiskEntry>,
) -> Result<(), Code> {
    m.handle(Request::Remount {
        client,
        segment: info.clone(),
        entries,
        disk,
        last: true,
        owner: None,
    })
    .map(drop)
    .map_err(|e| e.code())
}

/// A remount by a node that shows `ticket` for the segment's name; the ticket the
/// master renews.
fn remount_owned(
    m: &Master,
    client: u64,
    info: &SegmentInfo,
    entries: Vec<CatalogEntry>,
    ticket: OwnerTicket,
) -> Result<OwnerTicket, Code> {
    let answer = m.handle(Request::Remount {
        client,
        segment: info.clone(),
        entries,
        disk: Vec::new(),
        last: true,
        owner: Some(ticket),
    });
    match answer.map_err(|e| e.code())? {
        Response::Mounted(ticket) => Ok(ticket),
        other => panic!("remount answered {other:?}"),
    }
}

/// Starts a put of `key` by `client`; the replicas to write.
fn put_start(m: &Master, client: u64, key: &str, config: ReplicateConfig) -> Vec<ReplicaDesc> {
    let answer = m.handle(Request::PutStart {
        client,
        items: vec![(key.into(), SIZE)],
        config,
        upsert: false,
    });
    match answer {
        Ok(Response::PutStart(mut r)) => r.pop().unwrap().unwrap(),
        other => panic!("put_start {key}: {other:?}"),
    }
}

fn put_end(m: &Master, client: u64, key: &str, crc: u32) {
    match m.handle(Request::PutEnd {
        client,
        items: vec![(key.into(), crc)],
    }) {
        Ok(Response::PerKey(r)) => assert_eq!(r, vec![Ok(())], "put_end {key}"),
        other => panic!("put_end {key}: {other:?}"),
    }
}

fn put(m: &Master, client: u64, key: &str, crc: u32, config: ReplicateConfig) {
    put_start(m, client, key, config);
    put_end(m, client, key, crc);
}

fn get(m: &Master, key: &str) -> Result<ObjectDesc, Code> {
    match m.handle(Request::GetReplicas {
        keys: vec![key.into()],
    }) {
        Ok(Response::GetReplicas(mut r)) => r.pop().unwrap(),
        other => panic!("get {key}: {other:?}"),
    }
}

/// The objects the master committed to `client`'s segment `name`, as its node's
/// catalog learns them.
fn catalog(m: &Master, client: u64, name: &str) -> Vec<CatalogEntry> {
    let poll = |instance, acked| match m.handle(Request::SegmentEvents {
        client,
        segment: name.into(),
        instance,
        acked,
        disk_capacity: 0,
        lost: Vec::new(),
        ring: Default::default(),
    }) {
        Ok(Response::SegmentEvents(e)) => e,
        other => panic!("catalog of {name}: {other:?}"),
    };
    let reset = poll(0, 0);
    let events = poll(reset.instance, reset.last).events;
    events
        .into_iter()
        .filter_map(|e| match e {
            CatalogEvent::Commit(entry) => Some(entry),
            _ => None,
        })
        .collect()
}

fn entry_of<'a>(catalog: &'a [CatalogEntry], key: &str) -> &'a CatalogEntry {
    catalog
        .iter()
        .find(|e| e.key == key)
        .expect("in the catalog")
}

/// A claim that `key` (of `SIZE` bytes, at `version`, with checksum `crc`) lies at
/// the start of segment `at`.
fn forged(key: &str, version: u64, crc: u32, at: &SegmentInfo) -> CatalogEntry {
    CatalogEntry {
        key: key.into(),
        version,
        size: SIZE,
        crc32c: crc,
        hard_pin: false,
        replica: ReplicaDesc {
            pieces: vec![Piece {
                segment: at.name.as_str().into(),
                addr: at.base,
                len: SIZE,
            }]
            .into(),
        },
        index: 0,
    }
}

/// A claim that a node's disk tier holds `key` (of `SIZE` bytes) at `version`.
fn forged_on_disk(key: &str, version: u64, crc: u32) -> DiskEntry {
    DiskEntry {
        key: key.into(),
        version,
        size: SIZE,
        crc32c: crc,
    }
}

fn on(name: &str) -> ReplicateConfig {
    ReplicateConfig {
        preferred_segments: vec![name.into()],
        ..ReplicateConfig::default()
    }
}

const NODE_A: u64 = 0xA1;
const NODE_B: u64 = 0xB1;
const MALLORY: u64 = 0x666;
const REAL_CRC: u32 = 0xC0FF_EE00;
const FORGED_CRC: u32 = 0xBAD_BAD;

/// Issue 28, item 6: a remount naming any new segment claimed a committed key at a
/// later version (one this master even issued) and replaced it, its checksum chosen
/// by the claimant. A master that wrote an object itself never gives it up to a claim.
#[test]
fn a_remount_never_replaces_an_object_this_master_wrote() {
    let clock = Clock::manual();
    let m = master(&clock);
    let a = segment("node-a", 0);
    remount(&m, NODE_A, &a, Vec::new(), Vec::new()).unwrap();
    put(&m, NODE_A, "k", REAL_CRC, on("node-a"));
    put(&m, NODE_A, "later", 1, on("node-a"));
    let commits = catalog(&m, NODE_A, "node-a");
    let issued = entry_of(&commits, "later").version;
    assert!(issued > entry_of(&commits, "k").version);

    let evil = segment("evil", 1);
    let claim = forged("k", issued, FORGED_CRC, &evil);
    let on_disk = forged_on_disk("k", issued, FORGED_CRC);
    remount(&m, MALLORY, &evil, vec![claim], vec![on_disk]).unwrap();

    let k = get(&m, "k").expect("k is still served");
    assert_eq!(k.crc32c, REAL_CRC, "k's checksum is the writer's");
    assert_eq!(k.replicas.len(), 1);
    assert_eq!(&*k.replicas[0].pieces[0].segment, "node-a");
    // The refused claim holds no space in the claimant's segment.
    let evil_used = m.all_segments().into_iter().find(|s| s.0.name == "evil");
    assert_eq!(evil_used.map(|s| s.2), Some(0));
}

/// Issue 28, item 6: versions this master never issued (here an hour ahead of its
/// clock) are refused, for a new key too.
#[test]
fn a_claim_above_every_version_issued_is_refused() {
    let clock = Clock::manual();
    let m = master(&clock);
    let ahead = (unix_ms() + 3_600_000) << 20;
    let evil = segment("evil", 1);
    let claim = forged("fresh", ahead, FORGED_CRC, &evil);
    let on_disk = forged_on_disk("fresh-on-disk", ahead, FORGED_CRC);
    remount(&m, MALLORY, &evil, vec![claim], vec![on_disk]).unwrap();
    assert_eq!(get(&m, "fresh").err(), Some(Code::ObjectNotFound));
    assert_eq!(get(&m, "fresh-on-disk").err(), Some(Code::ObjectNotFound));
}

/// Issue 28, item 6, after a master restart: what the nodes vouch for comes back;
/// a claim contradicting an object another node vouched for (which the new master
/// cannot settle) leaves neither, so a reader misses rather than gets forged bytes,
/// whichever remounts first.
#[test]
fn after_a_restart_a_contradicted_object_is_dropped_never_replaced() {
    let clock = Clock::manual();
    let (a, b, evil) = (
        segment("node-a", 0),
        segment("node-b", 1),
        segment("evil", 2),
    );
    let (catalog_a, catalog_b) = {
        let m = master(&clock);
        remount(&m, NODE_A, &a, Vec::new(), Vec::new()).unwrap();
        remount(&m, NODE_B, &b, Vec::new(), Vec::new()).unwrap();
        let both = ReplicateConfig {
            replica_num: 2,
            ..ReplicateConfig::default()
        };
        put(&m, NODE_A, "shared", REAL_CRC, both);
        put(&m, NODE_A, "solo", REAL_CRC, on("node-a"));
        (catalog(&m, NODE_A, "node-a"), catalog(&m, NODE_B, "node-b"))
    };
    let shared = entry_of(&catalog_a, "shared").version;
    let solo = entry_of(&catalog_a, "solo").version;

    // The master restarts (a process start takes longer than the millisecond a
    // master's versions count from); Mallory remounts first, then the nodes.
    let m = master_started_later(&clock);
    let claim = forged("shared", shared + 1, FORGED_CRC, &evil);
    remount(&m, MALLORY, &evil, vec![claim], Vec::new()).unwrap();
    remount(&m, NODE_A, &a, catalog_a, Vec::new()).unwrap();
    remount(&m, NODE_B, &b, catalog_b, Vec::new()).unwrap();
    // Node A contradicted Mallory's "shared": both went; node B's copy came back.
    let got = get(&m, "shared").expect("node B's copy is served");
    assert_eq!(got.crc32c, REAL_CRC);
    assert_eq!(got.replicas.len(), 1);
    assert_eq!(&*got.replicas[0].pieces[0].segment, "node-b");

    // Mallory claims "solo" after node A vouched for it: a miss, never her bytes.
    assert_eq!(get(&m, "solo").unwrap().crc32c, REAL_CRC);
    let later = segment("evil-2", 3);
    let claim = forged("solo", solo + 1, FORGED_CRC, &later);
    remount(&m, MALLORY + 1, &later, vec![claim], Vec::new()).unwrap();
    assert_eq!(get(&m, "solo").err(), Some(Code::ObjectNotFound));
}

fn ping(m: &Master, client: u64) -> bool {
    match m.handle(Request::Ping { client }) {
        Ok(Response::Ping { need_remount }) => need_remount,
        other => panic!("ping: {other:?}"),
    }
}

fn used(m: &Master, name: &str) -> u64 {
    let segments = m.all_segments();
    let seg = segments.iter().find(|s| s.0.name == name);
    seg.map_or(0, |s| s.2)
}

fn addresses(replicas: &[ReplicaDesc]) -> Vec<u64> {
    replicas
        .iter()
        .flat_map(|r| &r.pieces)
        .map(|p| p.addr)
        .collect()
}

/// Issue 28, item 11: a writer whose node paused past its TTL still holds the
/// replica its PutStart placed in the node's own segment. The master dropped that
/// segment; the node remounts the same memory, and the writer's bytes may land any
/// time until the put's release timeout. That space is not lent again before then.
#[test]
fn space_a_late_writer_may_land_in_is_not_lent_again_until_its_release_timeout() {
    let clock = Clock::manual();
    let m = master(&clock);
    let a = segment("node-a", 0);
    remount(&m, NODE_A, &a, Vec::new(), Vec::new()).unwrap();
    let late = addresses(&put_start(&m, NODE_A, "late", on("node-a")));

    // Node A pauses past its TTL; a pure client stays known by pinging.
    clock.advance(TTL_MS + 1);
    ping(&m, NODE_B);
    m.tick();
    assert!(
        ping(&m, NODE_A),
        "node A's segment was dropped: it must remount"
    );
    remount(&m, NODE_A, &a, Vec::new(), Vec::new()).unwrap();
    assert_eq!(used(&m, "node-a"), SIZE, "the late put's space is held");

    // Another client's put goes elsewhere in the segment, never where A may write.
    let next = addresses(&put_start(&m, NODE_B, "next", on("node-a")));
    assert!(
        next.iter().all(|x| !late.contains(x)),
        "lent again: {next:?} (late writer: {late:?})"
    );
    put_end(&m, NODE_B, "next", REAL_CRC);
    // The late put cannot end: its replica went with the dropped segment.
    let ended = m.handle(Request::PutEnd {
        client: NODE_A,
        items: vec![("late".into(), REAL_CRC)],
    });
    assert!(matches!(ended, Ok(Response::PerKey(r)) if r[0] == Err(Code::InvalidWrite)));

    // Once no writer of that put can land any more, the space comes back.
    clock.advance(RELEASE_MS);
    for client in [NODE_A, NODE_B] {
        ping(&m, client);
    }
    m.tick();
    assert_eq!(used(&m, "node-a"), SIZE, "only \"next\" holds space now");
}

fn holder_of(m: &Master, name: &str, clients: &[u64]) -> Option<u64> {
    // The master never names a segment's client: ask each whether it must remount.
    let mounted = m.all_segments().iter().any(|s| s.0.name == name);
    let holders: Vec<u64> = clients.iter().copied().filter(|c| !ping(m, *c)).collect();
    match holders[..] {
        [one] if mounted => Some(one),
        [] => None,
        _ => panic!("{name}: several holders {holders:?}"),
    }
}

/// Issue 28, item 9: segment names are public. Right after a master restart a
/// squatter remounted a node's name first, and the node's remount was refused (its
/// objects lost) for as long as the squatter kept pinging. The node shows the ticket
/// the previous master gave it (signed with the key all the cluster's masters share),
/// takes its name back and its objects with it; the squatter's next remount is refused.
#[test]
fn after_a_master_restart_a_squatted_name_goes_back_to_its_ticket_holder() {
    const KEY: &[u8] = b"owner key of this cluster's masters";
    let clock = Clock::manual();
    let a = segment("node-a", 0);
    let (ticket, commits) = {
        let m = master(&clock);
        m.set_owner_key(KEY);
        let ticket = remount_owned(&m, NODE_A, &a, Vec::new(), OwnerTicket::default()).unwrap();
        put(&m, NODE_A, "k", REAL_CRC, on("node-a"));
        (ticket, catalog(&m, NODE_A, "node-a"))
    };
    let m = master_started_later(&clock);
    m.set_owner_key(KEY);
    // Mallory remounts the name first (with or without a ticket of her own).
    let squat = remount_owned(&m, MALLORY, &a, Vec::new(), OwnerTicket::default()).unwrap();
    assert_eq!(holder_of(&m, "node-a", &[NODE_A, MALLORY]), Some(MALLORY));

    let renewed = remount_owned(&m, NODE_A, &a, commits.clone(), ticket).unwrap();
    assert_eq!(renewed, ticket, "the name keeps its first ticket");
    assert_eq!(holder_of(&m, "node-a", &[NODE_A, MALLORY]), Some(NODE_A));
    assert_eq!(
        get(&m, "k").unwrap().crc32c,
        REAL_CRC,
        "its objects came back"
    );
    for shown in [squat, OwnerTicket::default()] {
        let again = remount_owned(&m, MALLORY, &a, Vec::new(), shown);
        assert_eq!(again, Err(Code::SegmentAlreadyExists));
        assert_eq!(
            remount(&m, MALLORY, &a, Vec::new(), Vec::new()),
            Err(Code::SegmentAlreadyExists)
        );
    }
    // A ticket for another name, or an altered one, takes nothing.
    let b = segment("node-b", 1);
    let ticket_b = remount_owned(&m, NODE_B, &b, Vec::new(), OwnerTicket::default()).unwrap();
    let altered = OwnerTicket {
        issued_ms: ticket.issued_ms - 1,
        ..ticket
    };
    for shown in [ticket_b, altered] {
        let taken = remount_owned(&m, MALLORY, &a, Vec::new(), shown);
        assert_eq!(taken, Err(Code::SegmentAlreadyExists));
    }
    assert_eq!(holder_of(&m, "node-a", &[NODE_A, MALLORY]), Some(NODE_A));
}

/// Issue 28, item 9, while the master runs: a node paused past its TTL loses its
/// segment; whoever mounts the name meanwhile holds a later ticket, and the node
/// takes the name back when it remounts.
#[test]
fn a_name_squatted_while_its_node_was_away_goes_back_to_the_node() {
    let clock = Clock::manual();
    let m = master(&clock);
    let a = segment("node-a", 0);
    let ticket = remount_owned(&m, NODE_A, &a, Vec::new(), OwnerTicket::default()).unwrap();
    put(&m, NODE_A, "k", REAL_CRC, on("node-a"));
    let commits = catalog(&m, NODE_A, "node-a");
    clock.advance(TTL_MS + 1);
    m.tick();
    assert_eq!(
        get(&m, "k").err(),
        Some(Code::ObjectNotFound),
        "dropped with A"
    );

    remount_owned(&m, MALLORY, &a, Vec::new(), OwnerTicket::default()).unwrap();
    remount_owned(&m, NODE_A, &a, commits, ticket).unwrap();
    assert_eq!(holder_of(&m, "node-a", &[NODE_A, MALLORY]), Some(NODE_A));
    assert_eq!(get(&m, "k").unwrap().crc32c, REAL_CRC);
}

/// One poll of node A's catalog, offering a disk tier.
fn poll_a(m: &Master, instance: u64, acked: u64) -> SegmentEvents {
    let answer = m.handle(Request::SegmentEvents {
        client: NODE_A,
        segment: "node-a".into(),
        instance,
        acked,
        disk_capacity: 1 << 30,
        lost: Vec::new(),
        ring: Default::default(),
    });
    match answer {
        Ok(Response::SegmentEvents(e)) => e,
        other => panic!("node A's poll: {other:?}"),
    }
}

/// Node A's catalog follower (from its first answer, `start`) until the first
/// offload reaches it, when it dies without acknowledging anything more (a node
/// killed -9 mid-offload); the key offloaded.
fn follow_until_an_offload(
    m: &Master,
    start: SegmentEvents,
    stop: &std::sync::atomic::AtomicBool,
) -> Option<String> {
    use std::sync::atomic::Ordering;
    let mut at: std::collections::HashMap<u64, String> = Default::default();
    let (mut instance, mut acked) = (start.instance, start.last);
    while !stop.load(Ordering::Relaxed) {
        let e = poll_a(m, instance, acked);
        for event in e.events {
            match event {
                CatalogEvent::Commit(entry) => {
                    let addr = entry.replica.pieces[entry.index as usize].addr;
                    at.insert(addr, entry.key);
                }
                CatalogEvent::Offload(addr) => return at.remove(&addr),
                _ => {}
            }
        }
        (instance, acked) = (e.instance, e.last);
    }
    None
}

/// Issue 28, chaos run: an object evicted with two replicas was offloaded to the
/// node with a disk tier and its other replica freed at once; that node died before
/// writing the copy and the object was gone, though a live node had held it. The
/// other replica is now freed only once the copy is confirmed: here the object
/// falls back to it.
#[test]
fn an_object_whose_disk_copy_dies_unwritten_keeps_its_other_replica() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let clock = Clock::manual();
    let m = Master::with_clock(
        MasterConfig {
            offload_on_evict: true,
            lease_ttl: Duration::from_millis(LEASE_MS),
            catalog_ack_timeout: Duration::from_secs(1),
            client_ttl: Duration::from_millis(TTL_MS),
            shards: 4,
            ..MasterConfig::default()
        },
        clock.clone(),
    );
    let (a, b) = (segment("node-a", 0), segment("node-b", 1));
    remount(&m, NODE_A, &a, Vec::new(), Vec::new()).unwrap();
    remount(&m, NODE_B, &b, Vec::new(), Vec::new()).unwrap();
    let both = ReplicateConfig {
        replica_num: 2,
        ..ReplicateConfig::default()
    };
    // A follows its catalog (and offers its disk) before the first put.
    let start = poll_a(&m, 0, 0);
    let stop = AtomicBool::new(false);
    let offloaded = std::thread::scope(|s| {
        let node_a = s.spawn(|| follow_until_an_offload(&m, start, &stop));
        // Twice what either segment holds: eviction (and an offload) must come.
        for i in 0..2 * SEGMENT / SIZE {
            if node_a.is_finished() {
                break;
            }
            put(&m, NODE_A, &format!("k{i}"), REAL_CRC, both.clone());
        }
        stop.store(true, Ordering::Relaxed);
        node_a.join().unwrap()
    });
    let key = offloaded.expect("an object was offloaded to node A");
    // A is gone; B stays.
    clock.advance(TTL_MS + 1);
    ping(&m, NODE_B);
    m.tick();
    assert!(m.all_segments().iter().all(|s| s.0.name != "node-a"));
    let desc = get(&m, &key).expect("kept in B's memory");
    assert_eq!(desc.crc32c, REAL_CRC);
    let segments: Vec<_> = desc.replicas.iter().flat_map(|r| &r.pieces).collect();
    assert!(!segments.is_empty() && segments.iter().all(|p| &*p.segment == "node-b"));
    // Back in memory, it is evictable again: B alone takes twice what it holds.
    clock.advance(LEASE_MS + 1);
    for i in 0..2 * SEGMENT / SIZE {
        put(&m, NODE_B, &format!("b{i}"), REAL_CRC, on("node-b"));
    }
    assert_eq!(get(&m, &key).err(), Some(Code::ObjectNotFound), "evicted");
}
