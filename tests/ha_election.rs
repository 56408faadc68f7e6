//! Master leader election on a real etcd (skipped with a message when etcd is not
//! installed): one leader at a time, epochs that only grow, a standby taking over when
//! the leader resigns or loses its lease, and a deposed leader that knows it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::services;
use mooncake::etcd::EtcdClient;
use mooncake::store::ha::{self, StopSignal};
use mooncake::Code;

const TTL_S: i64 = 2;

/// Waits (bounded) until `cond` holds; false if it never did.
fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let pause = StopSignal::new();
    for _ in 0..300 {
        if cond() {
            return true;
        }
        pause.wait(Duration::from_millis(50));
    }
    false
}

#[test]
fn one_leader_at_a_time_and_a_standby_takes_over() {
    let Some(etcd) = services::etcd() else { return };
    let client = Arc::new(EtcdClient::new(&etcd.addr).unwrap());
    assert_eq!(ha::read_view(&client, "c1").unwrap(), None);

    let never = StopSignal::new();
    let a = ha::campaign(client.clone(), "c1", "127.0.0.1:1001", TTL_S, &never).unwrap();
    assert!(a.is_current());
    let view = ha::read_view(&client, "c1").unwrap().unwrap();
    assert_eq!(
        (view.address.as_str(), view.epoch),
        ("127.0.0.1:1001", a.epoch())
    );
    // Mooncake's key, holding the bare address.
    let raw = client
        .get(b"mooncake-store/c1/master_view")
        .unwrap()
        .unwrap();
    assert_eq!(raw.value, b"127.0.0.1:1001");

    // A standby blocks while A leads, and takes over once A resigns.
    let standby = {
        let client = client.clone();
        std::thread::spawn(move || {
            let never = StopSignal::new();
            ha::campaign(client, "c1", "127.0.0.1:1002", TTL_S, &never)
        })
    };
    assert_eq!(
        ha::read_view(&client, "c1").unwrap().unwrap().address,
        "127.0.0.1:1001",
        "the standby did not displace the leader"
    );
    let a_epoch = a.epoch();
    a.resign();
    let b = standby.join().unwrap().unwrap();
    assert!(b.is_current());
    assert!(
        b.epoch() > a_epoch,
        "epochs only grow: {} then {}",
        a_epoch,
        b.epoch()
    );
    assert_eq!(
        ha::read_view(&client, "c1").unwrap().unwrap().address,
        "127.0.0.1:1002"
    );

    // Another cluster id is another election.
    let other = ha::campaign(client.clone(), "c2", "127.0.0.1:2001", TTL_S, &never).unwrap();
    assert!(other.is_current() && b.is_current());
}

#[test]
fn a_leader_whose_lease_is_gone_knows_it_is_deposed() {
    let Some(etcd) = services::etcd() else { return };
    let client = Arc::new(EtcdClient::new(&etcd.addr).unwrap());
    let never = StopSignal::new();
    let a = ha::campaign(client.clone(), "c", "127.0.0.1:1", TTL_S, &never).unwrap();
    // Someone (an operator, or etcd after a partition) takes the lease away.
    let lease = client
        .get(b"mooncake-store/c/master_view")
        .unwrap()
        .unwrap()
        .lease;
    client.lease_revoke(lease).unwrap();
    assert!(eventually(|| !a.is_current()), "the deposed leader noticed");
    // And a new leader gets in with a larger epoch.
    let b = ha::campaign(client.clone(), "c", "127.0.0.1:2", TTL_S, &never).unwrap();
    assert!(b.epoch() > a.epoch());
    drop(a); // revoking an already-gone lease is harmless
    assert!(b.is_current());
}

#[test]
fn a_standby_can_be_stopped_and_an_unreachable_etcd_is_an_error() {
    let Some(etcd) = services::etcd() else { return };
    let client = Arc::new(EtcdClient::new(&etcd.addr).unwrap());
    let never = StopSignal::new();
    let _leader = ha::campaign(client.clone(), "c", "127.0.0.1:1", TTL_S, &never).unwrap();
    let stop = StopSignal::new();
    let standby = {
        let (client, stop) = (client.clone(), stop.clone());
        std::thread::spawn(move || ha::campaign(client, "c", "127.0.0.1:2", TTL_S, &stop))
    };
    stop.raise();
    let err = standby.join().unwrap().unwrap_err();
    assert_eq!(err.code(), Code::UnavailableInCurrentStatus);

    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = dead.local_addr().unwrap();
    drop(dead);
    let nowhere = Arc::new(EtcdClient::new(&addr.to_string()).unwrap());
    assert!(ha::campaign(nowhere, "c", "127.0.0.1:3", TTL_S, &never).is_err());
}

#[test]
fn a_watch_wakes_on_the_keys_next_change_and_not_before() {
    let Some(etcd) = services::etcd() else { return };
    let client = Arc::new(EtcdClient::new(&etcd.addr).unwrap());
    let rev = client.put(b"watched/k", b"1", 0).unwrap();
    // Nothing changes: the watch ends empty when its time is up.
    assert!(!client
        .watch_change(b"watched/k", rev + 1, Duration::from_millis(300))
        .unwrap());
    // A change made before the watch starts, but after `from`, counts too.
    client.put(b"watched/k", b"2", 0).unwrap();
    assert!(client
        .watch_change(b"watched/k", rev + 1, Duration::from_secs(30))
        .unwrap());
    // A deletion while watching wakes it.
    let now = client.get(b"watched/k").unwrap().unwrap().mod_revision;
    let deleter = {
        let c = client.clone();
        std::thread::spawn(move || c.delete(b"watched/k").unwrap())
    };
    assert!(client
        .watch_change(b"watched/k", now + 1, Duration::from_secs(30))
        .unwrap());
    deleter.join().unwrap();
}
