//! The master's rules, driven in-process with a manual clock (no sleeping): leases,
//! eviction, pins, abandoned puts, client liveness, bad input.

use std::time::Duration;

use mooncake::store::master::{Clock, Master, MasterConfig};
use mooncake::store::protocol::{ReplicateConfig, Request, Response, SegmentInfo};
use mooncake::Code;

const MIB: u64 = 1 << 20;

fn master(clock: &Clock) -> Master {
    let mut cfg = MasterConfig::default();
    cfg.allocator.slab_size = MIB;
    Master::with_clock(cfg, clock.clone())
}

fn mount(m: &Master, client: u64, name: &str, size: u64) {
    let seg = SegmentInfo {
        name: name.into(),
        base: 1 << 40,
        size,
    };
    m.handle(Request::Mount {
        client,
        segment: seg,
    })
    .unwrap();
}

fn put(
    m: &Master,
    client: u64,
    key: &str,
    size: u64,
    cfg: &ReplicateConfig,
) -> Result<usize, Code> {
    let items = vec![(key.to_owned(), size)];
    let Response::PutStart(mut r) = m
        .handle(Request::PutStart {
            client,
            items,
            config: cfg.clone(),
            upsert: false,
        })
        .unwrap()
    else {
        panic!("wrong answer")
    };
    let replicas = r.pop().unwrap()?;
    let Response::PerKey(mut e) = m
        .handle(Request::PutEnd {
            client,
            items: vec![(key.to_owned(), 7)],
        })
        .unwrap()
    else {
        panic!("wrong answer")
    };
    e.pop().unwrap()?;
    Ok(replicas.len())
}

fn get(m: &Master, key: &str) -> Result<u64, Code> {
    let Response::GetReplicas(mut r) = m
        .handle(Request::GetReplicas {
            keys: vec![key.to_owned()],
        })
        .unwrap()
    else {
        panic!("wrong answer")
    };
    r.pop().unwrap().map(|d| d.size)
}

fn exists(m: &Master, key: &str) -> bool {
    let Response::Exists(mut r) = m
        .handle(Request::Exists {
            keys: vec![key.to_owned()],
        })
        .unwrap()
    else {
        panic!("wrong answer")
    };
    r.pop().unwrap().unwrap()
}

fn remove(m: &Master, key: &str, force: bool) -> Result<(), Code> {
    m.handle(Request::Remove {
        key: key.to_owned(),
        force,
    })
    .map(|_| ())
    .map_err(|e| e.code())
}

#[test]
fn replicas_land_on_distinct_segments_best_effort() {
    let clock = Clock::manual();
    let m = master(&clock);
    mount(&m, 1, "a", 16 * MIB);
    mount(&m, 2, "b", 16 * MIB);
    let three = ReplicateConfig {
        replica_num: 3,
        ..Default::default()
    };
    assert_eq!(
        put(&m, 1, "k", 4096, &three),
        Ok(2),
        "only two segments exist"
    );
    let Response::GetReplicas(r) = m
        .handle(Request::GetReplicas {
            keys: vec!["k".into()],
        })
        .unwrap()
    else {
        panic!()
    };
    let d = r[0].clone().unwrap();
    assert_ne!(
        d.replicas[0].pieces[0].segment,
        d.replicas[1].pieces[0].segment
    );
    assert_eq!(d.crc32c, 7);
}

#[test]
fn leases_guard_removal_and_exists_takes_none() {
    let clock = Clock::manual();
    let m = master(&clock);
    mount(&m, 1, "a", 16 * MIB);
    put(&m, 1, "k", 4096, &ReplicateConfig::default()).unwrap();
    assert!(exists(&m, "k"));
    assert_eq!(remove(&m, "k", false), Ok(()), "exists took no lease");
    put(&m, 1, "k", 4096, &ReplicateConfig::default()).unwrap();
    assert_eq!(get(&m, "k"), Ok(4096));
    assert_eq!(remove(&m, "k", false), Err(Code::ObjectHasLease));
    clock.advance(10_001);
    assert_eq!(remove(&m, "k", false), Ok(()));
    assert_eq!(get(&m, "k"), Err(Code::ObjectNotFound));
    assert_eq!(remove(&m, "k", false), Err(Code::ObjectNotFound));
    put(&m, 1, "k", 4096, &ReplicateConfig::default()).unwrap();
    get(&m, "k").unwrap();
    assert_eq!(remove(&m, "k", true), Ok(()), "force wins over a lease");
}

#[test]
fn bad_input_gets_documented_codes() {
    let clock = Clock::manual();
    let m = master(&clock);
    mount(&m, 1, "a", 16 * MIB);
    let cfg = ReplicateConfig::default();
    assert_eq!(
        put(&m, 1, &"x".repeat(5000), 10, &cfg),
        Err(Code::InvalidKey)
    );
    assert_eq!(put(&m, 1, "", 10, &cfg), Err(Code::InvalidKey));
    assert_eq!(put(&m, 1, "zero", 0, &cfg), Err(Code::InvalidParams));
    assert_eq!(get(&m, "nope"), Err(Code::ObjectNotFound));
    assert_eq!(put(&m, 1, "k", 10, &cfg), Ok(1));
    assert_eq!(put(&m, 1, "k", 10, &cfg), Err(Code::ObjectAlreadyExists));
    let bad = m
        .handle(Request::RemoveByRegex {
            pattern: "(".into(),
            force: false,
        })
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidParams);
    let seg = SegmentInfo {
        name: "a".into(),
        base: 0,
        size: MIB,
    };
    assert_eq!(
        m.handle(Request::Mount {
            client: 2,
            segment: seg
        })
        .unwrap_err()
        .code(),
        Code::SegmentAlreadyExists
    );
}

#[test]
fn puts_never_fail_for_space_while_evictable_objects_exist() {
    let clock = Clock::manual();
    let m = master(&clock);
    mount(&m, 1, "a", 8 * MIB);
    mount(&m, 2, "b", 8 * MIB);
    let cfg = ReplicateConfig::default();
    let pinned = ReplicateConfig {
        hard_pin: true,
        ..Default::default()
    };
    for i in 0..8 {
        put(&m, 1, &format!("pinned{i}"), 64 << 10, &pinned).unwrap();
    }
    // Ten times the pool: every put succeeds by evicting older objects.
    for i in 0..2560 {
        put(&m, 1, &format!("k{i}"), 64 << 10, &cfg).unwrap_or_else(|c| panic!("put {i}: {c:?}"));
        // Constant probing must not make anything unevictable.
        assert!(exists(&m, &format!("k{i}")));
    }
    let s = m.stats();
    assert!(s.evicted_objects > 2000, "{s:?}");
    for i in 0..8 {
        assert!(
            exists(&m, &format!("pinned{i}")),
            "hard-pinned objects are never evicted"
        );
    }
    assert!(s.used <= s.capacity);
}

#[test]
fn leased_objects_are_not_evicted_and_full_pool_reports_no_space() {
    let clock = Clock::manual();
    let m = master(&clock);
    mount(&m, 1, "a", 4 * MIB);
    let cfg = ReplicateConfig::default();
    let mut n = 0;
    while put(&m, 1, &format!("k{n}"), MIB, &cfg).is_ok() {
        get(&m, &format!("k{n}")).unwrap(); // a reader holds each one
        n += 1;
        assert!(n < 100);
    }
    assert!(n >= 3);
    assert_eq!(
        put(&m, 1, "one-more", MIB, &cfg),
        Err(Code::NoAvailableHandle)
    );
    clock.advance(10_001); // leases expire: now evictable
    assert_eq!(put(&m, 1, "one-more", MIB, &cfg), Ok(1));
}

#[test]
fn soft_pinned_objects_go_last() {
    let clock = Clock::manual();
    let m = master(&clock);
    mount(&m, 1, "a", 4 * MIB);
    let soft = ReplicateConfig {
        soft_pin: true,
        ..Default::default()
    };
    put(&m, 1, "soft", MIB, &soft).unwrap();
    for i in 0..6 {
        put(&m, 1, &format!("k{i}"), MIB, &ReplicateConfig::default()).unwrap();
    }
    assert!(exists(&m, "soft"), "unpinned objects were evicted first");
}

#[test]
fn large_objects_are_striped() {
    let clock = Clock::manual();
    let m = master(&clock);
    mount(&m, 1, "a", 16 * MIB);
    mount(&m, 2, "b", 16 * MIB);
    put(&m, 1, "big", 5 * MIB + 17, &ReplicateConfig::default()).unwrap();
    let Response::GetReplicas(r) = m
        .handle(Request::GetReplicas {
            keys: vec!["big".into()],
        })
        .unwrap()
    else {
        panic!()
    };
    let d = r[0].clone().unwrap();
    let pieces = &d.replicas[0].pieces;
    assert_eq!(pieces.iter().map(|p| p.len).sum::<u64>(), 5 * MIB + 17);
    assert!(pieces.len() >= 6, "slab size 1 MiB caps each piece");
    assert!(pieces.iter().any(|p| &*p.segment == "a") && pieces.iter().any(|p| &*p.segment == "b"));
}

#[test]
fn abandoned_puts_are_taken_over_and_released() {
    let clock = Clock::manual();
    let m = master(&clock);
    mount(&m, 1, "a", 4 * MIB);
    let cfg = ReplicateConfig::default();
    let start = |client| {
        let items = vec![("k".to_owned(), MIB)];
        let Response::PutStart(mut r) = m
            .handle(Request::PutStart {
                client,
                items,
                config: cfg.clone(),
                upsert: false,
            })
            .unwrap()
        else {
            panic!()
        };
        r.pop().unwrap().map(|_| ())
    };
    start(1).unwrap(); // client 1 dies before PutEnd
    m.ping(2); // a client lending no memory introduces itself before it puts
    assert_eq!(
        start(2),
        Err(Code::ObjectAlreadyExists),
        "too early to take over"
    );
    assert_eq!(get(&m, "k"), Err(Code::ReplicaIsNotReady));
    clock.advance(30_001);
    start(2).unwrap();
    // The dead writer's space is quarantined, not reused, for 600 s.
    let used = m.stats().used;
    assert_eq!(used, 2 * MIB);
    // 600 s after the first put started (its quarantine ends), not yet after the second.
    clock.advance(570_001);
    assert!(m.ping(1), "the node itself stays alive");
    m.tick();
    assert_eq!(m.stats().used, MIB, "quarantined space released");
    let Response::PerKey(r) = m
        .handle(Request::PutEnd {
            client: 1,
            items: vec![("k".into(), 0)],
        })
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(
        r[0],
        Err(Code::InvalidWrite),
        "the old writer can no longer finish"
    );
    // Client 2 also vanishes: after the release timeout the put is cleared entirely.
    clock.advance(30_000);
    assert!(m.ping(1));
    m.tick();
    assert_eq!(get(&m, "k"), Err(Code::ObjectNotFound));
    assert_eq!(m.stats().used, 0);
}

#[test]
fn silent_clients_lose_their_segments_and_remount() {
    let clock = Clock::manual();
    let mut cfg = MasterConfig {
        client_ttl: Duration::from_secs(10),
        ..Default::default()
    };
    cfg.allocator.slab_size = MIB;
    let m = Master::with_clock(cfg, clock.clone());
    mount(&m, 1, "a", 4 * MIB);
    mount(&m, 2, "b", 4 * MIB);
    let two = ReplicateConfig {
        replica_num: 2,
        ..Default::default()
    };
    put(&m, 1, "both", 4096, &two).unwrap();
    put(
        &m,
        1,
        "only-a",
        4096,
        &ReplicateConfig {
            preferred_segments: vec!["a".into()],
            ..Default::default()
        },
    )
    .unwrap();
    clock.advance(6_000);
    assert!(m.ping(2));
    clock.advance(6_000);
    m.tick();
    assert!(!m.ping(1), "client 1 was dropped and must remount");
    assert!(m.ping(2));
    assert_eq!(m.stats().segments, 1);
    assert_eq!(get(&m, "both"), Ok(4096), "the other replica survives");
    assert_eq!(get(&m, "only-a"), Err(Code::ObjectNotFound));
    mount(&m, 1, "a", 4 * MIB);
    assert!(m.ping(1));
    assert_eq!(m.stats().segments, 2);
}

#[test]
fn remove_all_and_by_regex_respect_leases() {
    let clock = Clock::manual();
    let m = master(&clock);
    mount(&m, 1, "a", 16 * MIB);
    let cfg = ReplicateConfig::default();
    for k in ["layer0/a", "layer0/b", "layer1/a", "other"] {
        put(&m, 1, k, 4096, &cfg).unwrap();
    }
    get(&m, "layer0/b").unwrap();
    let Response::Count(n) = m
        .handle(Request::RemoveByRegex {
            pattern: "^layer0/".into(),
            force: false,
        })
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(n, 1, "the leased one stays");
    let Response::Count(n) = m.handle(Request::RemoveAll { force: false }).unwrap() else {
        panic!()
    };
    assert_eq!(n, 2);
    let Response::Count(n) = m.handle(Request::RemoveAll { force: true }).unwrap() else {
        panic!()
    };
    assert_eq!(n, 1);
    assert_eq!(m.stats().objects, 0);
}

#[test]
fn groups_share_leases_and_eviction() {
    let clock = Clock::manual();
    let m = master(&clock);
    mount(&m, 1, "a", 8 * MIB);
    let grouped = ReplicateConfig {
        group_ids: vec!["req-7".into()],
        ..Default::default()
    };
    for k in ["g0", "g1", "g2"] {
        put(&m, 1, k, 64 << 10, &grouped).unwrap();
    }
    put(&m, 1, "solo", 64 << 10, &ReplicateConfig::default()).unwrap();
    // Reading one member leases all of them.
    get(&m, "g0").unwrap();
    assert_eq!(remove(&m, "g2", false), Err(Code::ObjectHasLease));
    assert_eq!(remove(&m, "solo", false), Ok(()));
    clock.advance(10_001);
    // Fill the pool: when one member is evicted, its group goes with it.
    for i in 0..400 {
        put(
            &m,
            1,
            &format!("k{i}"),
            64 << 10,
            &ReplicateConfig::default(),
        )
        .unwrap();
    }
    let alive = ["g0", "g1", "g2"].iter().filter(|k| exists(&m, k)).count();
    assert!(alive == 0 || alive == 3, "{alive} of 3 group members left");
}

#[test]
fn a_costly_regex_fails_within_its_budget_and_removes_nothing() {
    let clock = Clock::manual();
    // A small budget, so that the debug build finds out quickly.
    let m = Master::with_clock(
        MasterConfig {
            regex_budget: 20_000_000,
            ..MasterConfig::default()
        },
        clock.clone(),
    );
    mount(&m, 1, "a", 256 * MIB);
    let cfg = ReplicateConfig::default();
    // Long keys and a pattern whose automaton keeps many states alive on them.
    let keys: Vec<String> = (0..200)
        .map(|i| format!("{i:05}{}", "a".repeat(3000)))
        .collect();
    for k in &keys {
        put(&m, 1, k, 4096, &cfg).unwrap();
    }
    let costly = "(.*a){100}x";
    let err = m
        .handle(Request::RemoveByRegex {
            pattern: costly.into(),
            force: true,
        })
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidParams);
    assert!(err.context().contains("costs more"), "{err}");
    assert!(keys.iter().all(|k| exists(&m, k)), "nothing removed");
    // An anchored pattern stops at the first character that cannot match: cheap.
    let Response::Count(n) = m
        .handle(Request::RemoveByRegex {
            pattern: "^0000[0-9]a".into(),
            force: true,
        })
        .unwrap()
    else {
        panic!("wrong answer")
    };
    assert_eq!(n, 10);
    assert!(!exists(&m, &keys[3]) && exists(&m, &keys[10]));
}

#[test]
fn absurd_mounts_are_refused_and_owners_never_echoed() {
    let clock = Clock::manual();
    let m = master(&clock);
    for size in [1u64 << 62, 64 << 40] {
        let err = m
            .handle(Request::Mount {
                client: 7,
                segment: SegmentInfo {
                    name: format!("huge-{size}"),
                    base: 4096,
                    size,
                },
            })
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidParams, "{err}");
    }
    let owner = 0x5eed_cafe_f00d_u64;
    mount(&m, owner, "victim", 16 * MIB);
    let err = m
        .handle(Request::Mount {
            client: 9,
            segment: SegmentInfo {
                name: "victim".into(),
                base: 0,
                size: MIB,
            },
        })
        .unwrap_err();
    assert_eq!(err.code(), Code::SegmentAlreadyExists);
    let text = err.to_string();
    assert!(
        !text.contains("5eedcafef00d") && !text.contains(&owner.to_string()),
        "the owner's id leaked: {text}"
    );
    // Without the owner's id, nobody unmounts it.
    assert!(m
        .handle(Request::Unmount {
            client: 9,
            name: "victim".into()
        })
        .is_err());
}
