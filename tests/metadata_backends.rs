//! etcd and redis metadata backends against real servers (skipped with a message when
//! the server is not installed): the clients' operations, Mooncake's key layout, and
//! two engines that find each other through each backend and move bytes.

mod common;

use std::time::Duration;

use common::services::{self, Service};
use common::{engine_with, pattern, Registered};
use mooncake::engine::TaskState;
use mooncake::etcd::EtcdClient;
use mooncake::redis::{RedisClient, RedisOptions};
use mooncake::{Op, Request};

#[test]
fn etcd_client_operations() {
    let Some(etcd) = services::etcd() else { return };
    let c = EtcdClient::new(&etcd.addr).unwrap();
    assert_eq!(c.get(b"k").unwrap(), None);
    let rev = c.put(b"k", b"v1", 0).unwrap();
    let kv = c.get(b"k").unwrap().unwrap();
    assert_eq!((kv.value.as_slice(), kv.mod_revision), (&b"v1"[..], rev));
    // Binary and empty values survive base64.
    c.put(b"bin", &[0, 255, 10, 13], 0).unwrap();
    assert_eq!(c.get(b"bin").unwrap().unwrap().value, vec![0, 255, 10, 13]);
    c.put(b"empty", b"", 0).unwrap();
    assert_eq!(c.get(b"empty").unwrap().unwrap().value, b"");

    // Compare-and-set: create only if absent, update only at the seen revision.
    assert!(!c.put_if(b"k", 0, b"v2", 0).unwrap());
    assert!(c.put_if(b"new", 0, b"n", 0).unwrap());
    assert!(!c.put_if(b"k", rev - 1, b"v2", 0).unwrap());
    assert!(c.put_if(b"k", rev, b"v2", 0).unwrap());
    assert_eq!(c.get(b"k").unwrap().unwrap().value, b"v2");

    c.put(b"p/a", b"1", 0).unwrap();
    c.put(b"p/b", b"2", 0).unwrap();
    c.put(b"q", b"3", 0).unwrap();
    let keys: Vec<_> = c
        .get_prefix(b"p/")
        .unwrap()
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    assert_eq!(keys, vec![b"p/a".to_vec(), b"p/b".to_vec()]);

    assert_eq!(c.delete(b"k").unwrap(), 1);
    assert_eq!(c.delete(b"k").unwrap(), 0);
    assert_eq!(c.get(b"k").unwrap(), None);

    // Leases: a key attached to a revoked lease is gone.
    let lease = c.lease_grant(30).unwrap();
    assert!(c.lease_keepalive(lease).unwrap() > 0);
    c.put(b"leased", b"x", lease).unwrap();
    assert_eq!(c.get(b"leased").unwrap().unwrap().lease, lease);
    c.lease_revoke(lease).unwrap();
    assert_eq!(c.get(b"leased").unwrap(), None);
    assert_eq!(
        c.lease_keepalive(lease).unwrap(),
        0,
        "a revoked lease has no TTL left"
    );
    // An etcd error is an error value, not a panic.
    assert!(c.put(b"x", b"y", 12345).is_err(), "put on an unknown lease");
}

#[test]
fn etcd_endpoint_list_skips_dead_members() {
    let Some(etcd) = services::etcd() else { return };
    // A closed port first: the client moves on to the live member.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    let c = EtcdClient::new(&format!("{dead_addr};{}", etcd.addr)).unwrap();
    c.put(b"k", b"v", 0).unwrap();
    assert_eq!(c.get(b"k").unwrap().unwrap().value, b"v");
    let none = EtcdClient::new(&dead_addr.to_string()).unwrap();
    let err = none.get(b"k").unwrap_err();
    assert!(err.to_string().contains("no endpoint reachable"), "{err}");
}

#[test]
fn redis_client_operations() {
    let Some(redis) = services::redis() else {
        return;
    };
    let c = RedisClient::new(&redis.addr, RedisOptions::default()).unwrap();
    assert_eq!(c.get(b"k").unwrap(), None);
    c.set(b"k", b"v\r\n with CRLF").unwrap();
    assert_eq!(c.get(b"k").unwrap().unwrap(), b"v\r\n with CRLF");
    assert_eq!(c.del(b"k").unwrap(), 1);
    assert_eq!(c.del(b"k").unwrap(), 0);
    // A refused command is a clear error.
    let auth = RedisClient::new(
        &redis.addr,
        RedisOptions {
            password: "wrong".into(),
            ..RedisOptions::default()
        },
    )
    .unwrap();
    let err = auth.get(b"k").unwrap_err();
    assert!(err.to_string().contains("AUTH failed"), "{err}");
    // SELECT picks another database.
    let db1 = RedisClient::new(
        &redis.addr,
        RedisOptions {
            db: 1,
            ..RedisOptions::default()
        },
    )
    .unwrap();
    db1.set(b"only-in-1", b"x").unwrap();
    assert_eq!(c.get(b"only-in-1").unwrap(), None);
    assert_eq!(db1.get(b"only-in-1").unwrap().unwrap(), b"x");
}

/// Two engines on `metadata` find each other and move bytes both ways; the server's
/// descriptor sits under Mooncake's key while it runs and is gone after it stops.
fn engines_move_bytes(metadata: &str, read_key: impl Fn(&str) -> Option<Vec<u8>>) {
    let server = engine_with(metadata, "tcp");
    let client = engine_with(metadata, "tcp");
    let key = format!("mooncake/ram/{}", server.segment_name());
    let published = read_key(&key).expect("descriptor published under mooncake/ram/<name>");
    assert!(String::from_utf8_lossy(&published).contains("buffers"));

    let remote = Registered::new(&server, pattern(1, 1 << 20));
    let mut local = vec![0u8; 1 << 20];
    let seg = client.open_segment(server.segment_name()).unwrap();
    let batch = client.allocate_batch(2).unwrap();
    let reqs = [Request {
        op: Op::Read,
        local: local.as_mut_ptr() as u64,
        segment: seg,
        remote: remote.addr(),
        len: local.len() as u64,
    }];
    // SAFETY: `local` outlives the wait below.
    unsafe { client.submit(batch, &reqs) }.unwrap();
    client
        .wait_batch(batch, Some(Duration::from_secs(30)))
        .unwrap();
    assert_eq!(
        client.task_status(batch, 0).unwrap().state,
        TaskState::Completed
    );
    assert!(local == remote.buf);
    drop(remote);
    let name = server.segment_name().to_owned();
    drop(server);
    assert_eq!(
        read_key(&format!("mooncake/ram/{name}")),
        None,
        "unpublished on drop"
    );
}

#[test]
fn engines_meet_through_etcd() {
    let Some(etcd) = services::etcd() else { return };
    let c = EtcdClient::new(&etcd.addr).unwrap();
    let read = |k: &str| c.get(k.as_bytes()).unwrap().map(|kv| kv.value);
    engines_move_bytes(&format!("etcd://{}", etcd.addr), read);
    // A bare host:port means etcd, as in Mooncake.
    engines_move_bytes(&etcd.addr, read);
}

#[test]
fn engines_meet_through_redis() {
    let Some(redis) = services::redis() else {
        return;
    };
    let c = RedisClient::new(&redis.addr, RedisOptions::default()).unwrap();
    engines_move_bytes(&format!("redis://{}", redis.addr), |k| {
        c.get(k.as_bytes()).unwrap()
    });
}

#[test]
fn unreachable_backends_fail_engine_start() {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = dead.local_addr().unwrap();
    drop(dead);
    for metadata in [format!("etcd://{addr}"), format!("redis://{addr}")] {
        let mut cfg = mooncake::EngineConfig::default();
        cfg.set("metadata", &metadata).unwrap();
        cfg.set("protocol", "tcp").unwrap();
        assert!(mooncake::Engine::new(cfg).is_err(), "{metadata}");
    }
    let _unused: Option<Service> = None;
}
