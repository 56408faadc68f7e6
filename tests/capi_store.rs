//! The store's C ABI: `mc_store_*` called straight from Rust against an in-process
//! master and node (results, bad input, batches, threads), the header checked against
//! the Rust definitions, and a C program linked against `libmooncake.a` using a cluster
//! of `mooncake master` / `mooncake node` processes.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::process::Command;
use std::ptr::{null, null_mut};
use std::sync::OnceLock;

mod common;

use common::cprog::*;
use common::pattern as value;
use mooncake::capi::*;
use mooncake::store::protocol::{DEFAULT_SOFT_PIN_TTL_MS, MAX_KEY_LEN};
use mooncake::store::{Client, ClientConfig, MasterServer, ServerConfig};
use mooncake::Code;

const MIB: u64 = 1 << 20;
const INVALID: c_int = Code::InvalidParams as c_int;
const BAD_KEY: c_int = Code::InvalidKey as c_int;
const NOT_FOUND: c_int = Code::ObjectNotFound as c_int;
const HAS_LEASE: c_int = Code::ObjectHasLease as c_int;
const OVERFLOW: c_int = Code::BufferOverflow as c_int;

fn cstring(s: &str) -> CString {
    CString::new(s).unwrap()
}

/// A master on OS-assigned ports with its embedded metadata server.
fn master() -> MasterServer {
    MasterServer::start(ServerConfig {
        rpc_port: 0,
        metadata_port: Some(0),
        metrics_port: None,
        ..ServerConfig::default()
    })
    .unwrap()
}

/// A node lending `segment` bytes, through the Rust API.
fn node(m: &MasterServer, segment: u64) -> Client {
    Client::new(ClientConfig {
        global_segment_size: segment,
        ..ClientConfig::connect(&m.rpc_addr().to_string(), &m.metadata_url().unwrap(), "tcp")
            .unwrap()
    })
    .unwrap()
}

/// An `mc_config` with `settings` applied (each must be accepted).
fn config(settings: &[(&str, &str)]) -> *mut McConfig {
    let cfg = mc_config_new();
    assert!(!cfg.is_null());
    for (k, v) in settings {
        let (k, v) = (cstring(k), cstring(v));
        // SAFETY: `cfg` is live; the strings are NUL-terminated.
        let rc = unsafe { mc_config_set(cfg, k.as_ptr(), v.as_ptr()) };
        assert_eq!(rc, MC_OK, "setting {k:?} = {v:?}");
    }
    cfg
}

/// A store made through the C ABI, freed on drop.
struct Store(*mut McStore);

// SAFETY: the header allows one store to be used from many threads at once.
unsafe impl Send for Store {}
// SAFETY: as above.
unsafe impl Sync for Store {}

impl Store {
    fn with(settings: &[(&str, &str)]) -> Store {
        let cfg = config(settings);
        let mut s = null_mut();
        // SAFETY: `cfg` is live and `s` writable.
        let rc = unsafe { mc_store_new(cfg, &mut s) };
        // SAFETY: from mc_config_new, not used again.
        unsafe { mc_config_free(cfg) };
        assert_eq!(rc, MC_OK);
        assert!(!s.is_null());
        Store(s)
    }

    /// A pure client of `m` (tcp, so only the node's segment is used).
    fn client_of(m: &MasterServer) -> Store {
        let master = m.rpc_addr().to_string();
        let metadata = m.metadata_url().unwrap();
        Store::with(&[
            ("master_address", &master),
            ("metadata", &metadata),
            ("protocol", "tcp"),
            ("global_segment_size", "0"),
        ])
    }

    fn put(&self, key: &str, v: &[u8]) -> c_int {
        let k = cstring(key);
        // SAFETY: live store; `v` is readable for its length during the call.
        unsafe { mc_store_put(self.0, k.as_ptr(), v.as_ptr().cast(), v.len(), null()) }
    }

    /// `mc_store_get_into` with a `cap`-byte buffer: the code and, on success, the bytes.
    fn get(&self, key: &str, cap: usize) -> (c_int, Vec<u8>) {
        let k = cstring(key);
        let mut buf = vec![0u8; cap];
        let mut len = u64::MAX;
        // SAFETY: live store; `buf` is writable for `cap` bytes; `len` writable.
        let rc = unsafe {
            mc_store_get_into(self.0, k.as_ptr(), buf.as_mut_ptr().cast(), cap, &mut len)
        };
        if rc == MC_OK {
            buf.truncate(len as usize);
        } else {
            assert_eq!(len, u64::MAX, "len_out written only on success");
        }
        (rc, buf)
    }

    fn exists(&self, key: &str) -> c_int {
        let k = cstring(key);
        // SAFETY: live store; NUL-terminated key.
        unsafe { mc_store_exists(self.0, k.as_ptr()) }
    }

    fn remove(&self, key: &str, force: bool) -> c_int {
        let k = cstring(key);
        // SAFETY: live store; NUL-terminated key.
        unsafe { mc_store_remove(self.0, k.as_ptr(), force.into()) }
    }

    fn hostname(&self) -> String {
        let mut buf = [0 as c_char; 256];
        assert_eq!(
            // SAFETY: live store; `buf` writable for its length.
            unsafe { mc_store_hostname(self.0, buf.as_mut_ptr(), buf.len()) },
            MC_OK
        );
        // SAFETY: NUL-terminated on success.
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_str()
            .unwrap()
            .to_owned()
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: from mc_store_new, freed once, no call in progress.
        unsafe { mc_store_free(self.0) };
    }
}

#[test]
fn null_pointers_and_bad_config_are_refused() {
    quiet_logs();
    let null_s: *mut McStore = null_mut();
    let k = c"k".as_ptr();
    let mut byte = 0u8;
    let p = (&mut byte as *mut u8).cast::<c_void>();
    let mut u = 0u64;
    let mut r = 0 as c_int;
    let mut r64 = 0i64;
    let mut text = [0 as c_char; 64];
    let keys = [k];
    let bufs = [p.cast_const()];
    let mbufs = [p];
    let lens = [1usize];
    // SAFETY: every pointer is NULL or valid for the lengths given.
    unsafe {
        assert_eq!(mc_store_new(null(), null_mut()), INVALID);
        assert_eq!(mc_store_put(null_s, k, p, 1, null()), INVALID);
        assert_eq!(mc_store_put_from(null_s, k, p, 1, null()), INVALID);
        assert_eq!(mc_store_get_into(null_s, k, p, 1, &mut u), INVALID);
        assert_eq!(mc_store_exists(null_s, k), INVALID);
        assert_eq!(mc_store_size(null_s, k, &mut u), INVALID);
        assert_eq!(mc_store_remove(null_s, k, 1), INVALID);
        assert_eq!(mc_store_remove_all(null_s, 1, &mut u), INVALID);
        assert_eq!(mc_store_remove_by_regex(null_s, k, 1, &mut u), INVALID);
        assert_eq!(mc_store_register_buffer(null_s, p, 1), INVALID);
        assert_eq!(mc_store_unregister_buffer(null_s, p), INVALID);
        assert_eq!(mc_store_hostname(null_s, text.as_mut_ptr(), 64), INVALID);
        let (kp, bp, lp) = (keys.as_ptr(), bufs.as_ptr(), lens.as_ptr());
        let nil = null();
        assert_eq!(
            mc_store_batch_put_from(null_s, kp, bp, lp, 1, nil, &mut r),
            INVALID
        );
        let mb = mbufs.as_ptr();
        assert_eq!(
            mc_store_batch_get_into(null_s, kp, mb, lp, 1, &mut r64),
            INVALID
        );
        assert_eq!(mc_store_batch_exists(null_s, kp, 1, &mut r), INVALID);
        mc_store_free(null_s);
        mc_replicate_config_init(null_mut());

        // Store keys on the shared config: checked at once, engine keys still work.
        let cfg = mc_config_new();
        let set = |key: &CStr, v: &CStr| mc_config_set(cfg, key.as_ptr(), v.as_ptr());
        for (key, good, bad) in [
            (c"global_segment_size", c"64M", c"lots"),
            (c"global_segment_size", c"1048576", c"-1"),
            (c"local_buffer_size", c"16MiB", c"1X"),
            (c"verify_checksum", c"0", c"maybe"),
            (c"verify_checksum", c"1", c""),
            (c"prefault_segment", c"0", c"sometimes"),
            (c"master_address", c"127.0.0.1:1", c""),
            (c"local_hostname", c"127.0.0.1:0", c"\xff"),
            (c"protocol", c"tcp", c"carrier-pigeon"),
        ] {
            assert_eq!(set(key, good), MC_OK, "{key:?} = {good:?}");
            assert_eq!(set(key, bad), INVALID, "{key:?} = {bad:?}");
        }
        assert_eq!(set(c"metadata", c"P2PHANDSHAKE"), MC_OK);
        assert_eq!(set(c"workers", c"2"), MC_OK);
        assert_eq!(set(c"no_such_key", c"1"), INVALID);

        // A node whose master does not answer: no store, *out NULL.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = cstring(&closed.local_addr().unwrap().to_string());
        drop(closed);
        assert_eq!(
            mc_config_set(cfg, c"master_address".as_ptr(), addr.as_ptr()),
            MC_OK
        );
        let mut out = std::ptr::dangling_mut::<McStore>();
        assert_eq!(mc_store_new(cfg, &mut out), Code::RpcFail as c_int);
        assert!(out.is_null(), "*out is NULL on failure");
        mc_config_free(cfg);
    }
}

#[test]
fn put_get_and_friends_through_the_abi() {
    quiet_logs();
    let m = master();
    let n = node(&m, 64 * MIB);
    let s = Store::client_of(&m);
    let e = s.0;
    let host = s.hostname();
    assert!(host.starts_with("127.0.0.1:"), "{host}");

    // Put, get, exists, size; the Rust node sees the same object.
    let v = value(1, 100_000);
    assert_eq!(s.put("a", &v), MC_OK);
    assert_eq!(s.get("a", v.len()), (MC_OK, v.clone()));
    assert_eq!(
        s.get("a", v.len() + 10),
        (MC_OK, v.clone()),
        "roomier buffer"
    );
    assert_eq!(n.get("a").unwrap(), v);
    assert_eq!(s.put("a", &value(2, 10)), MC_OK, "immutable: unchanged");
    assert_eq!(s.get("a", v.len()).1, v);
    assert_eq!(s.exists("a"), 1);
    assert_eq!(s.exists("b"), 0);
    let mut size = 0u64;
    let mut text = [0 as c_char; 64];
    let t = text.as_mut_ptr();
    // SAFETY: live store; outputs writable; strings NUL-terminated.
    unsafe {
        assert_eq!(mc_store_size(e, c"a".as_ptr(), &mut size), MC_OK);
        assert_eq!(size, v.len() as u64);
        assert_eq!(mc_store_size(e, c"b".as_ptr(), &mut size), NOT_FOUND);
        assert_eq!(mc_store_size(e, c"a".as_ptr(), null_mut()), INVALID);
        // len_out may be NULL.
        let mut buf = vec![0u8; v.len()];
        let b = buf.as_mut_ptr().cast();
        let nil = null_mut();
        assert_eq!(mc_store_get_into(e, c"a".as_ptr(), b, v.len(), nil), MC_OK);
        assert_eq!(buf, v);
        assert_eq!(
            mc_store_get_into(e, c"a".as_ptr(), nil.cast(), 8, nil),
            INVALID
        );

        // Hostname: too small → overflow with an emptied buffer; exact fit works.
        text[0] = b'x' as c_char;
        assert_eq!(mc_store_hostname(e, t, host.len()), OVERFLOW);
        assert_eq!(text[0], 0);
        assert_eq!(mc_store_hostname(e, t, 0), OVERFLOW);
        assert_eq!(mc_store_hostname(e, null_mut(), 64), INVALID);
        assert_eq!(mc_store_hostname(e, t, host.len() + 1), MC_OK);
        assert_eq!(CStr::from_ptr(t).to_str().unwrap(), host);
    }

    // Bad keys and values.
    let max_key = "k".repeat(MAX_KEY_LEN);
    let long_key = "k".repeat(MAX_KEY_LEN + 1);
    assert_eq!(
        s.put(&max_key, b"x"),
        MC_OK,
        "a key of MC_STORE_MAX_KEY_LEN"
    );
    assert_eq!(s.put(&long_key, b"x"), BAD_KEY);
    assert_eq!(s.put("", b"x"), BAD_KEY);
    assert_eq!(s.put("empty", b""), INVALID, "zero-length value");
    assert_eq!(s.exists(&long_key), BAD_KEY);
    assert_eq!(s.get(&long_key, 8).0, BAD_KEY);
    assert_eq!(s.remove(&long_key, true), BAD_KEY);
    assert_eq!(s.get("missing", 8).0, NOT_FOUND);
    assert_eq!(s.remove("missing", false), NOT_FOUND);
    let non_utf8 = c"\xff\xfe".as_ptr();
    let nil_key = null();
    let mut byte = 1u8;
    let p = (&mut byte as *mut u8).cast::<c_void>();
    // SAFETY: live store; pointers NULL or valid for the lengths given.
    unsafe {
        let nil = null();
        assert_eq!(mc_store_put(e, nil_key, p, 1, nil), INVALID, "NULL key");
        assert_eq!(mc_store_put(e, non_utf8, p, 1, nil), BAD_KEY, "not UTF-8");
        assert_eq!(mc_store_put(e, c"k".as_ptr(), null(), 1, nil), INVALID);
        assert_eq!(mc_store_exists(e, nil_key), INVALID);
        assert_eq!(mc_store_exists(e, non_utf8), BAD_KEY);
        assert_eq!(mc_store_remove(e, nil_key, 0), INVALID);
        let mut u = 0u64;
        assert_eq!(mc_store_get_into(e, nil_key, p, 1, &mut u), INVALID);
        assert_eq!(mc_store_remove_by_regex(e, nil_key, 0, &mut u), INVALID);
        assert_eq!(
            mc_store_remove_by_regex(e, c"(".as_ptr(), 0, &mut u),
            INVALID
        );
    }

    // Too small a buffer; the object was just read, so it is leased.
    assert_eq!(s.get("a", v.len() - 1).0, OVERFLOW);
    assert_eq!(s.get("a", 0).0, OVERFLOW);
    assert_eq!(s.remove("a", false), HAS_LEASE);
    assert_eq!(s.exists("a"), 1);
    assert_eq!(s.remove("a", true), MC_OK);
    assert_eq!(s.exists("a"), 0);
    assert_eq!(s.remove("a", true), NOT_FOUND);

    // Replication settings.
    let mut rc = std::mem::MaybeUninit::<McReplicateConfig>::uninit();
    // SAFETY: `rc` is writable; init fills every field.
    let mut rc = unsafe {
        mc_replicate_config_init(rc.as_mut_ptr());
        rc.assume_init()
    };
    assert_eq!(rc.replica_num, 1);
    assert_eq!((rc.hard_pin, rc.soft_pin, rc.prefer_same_node), (0, 0, 0));
    assert_eq!(rc.soft_pin_ttl_ms, DEFAULT_SOFT_PIN_TTL_MS);
    assert!(rc.preferred_segments.is_null());
    assert_eq!(rc.preferred_segments_count, 0);
    let node_name = cstring(n.hostname());
    let preferred = [node_name.as_ptr()];
    rc.preferred_segments = preferred.as_ptr();
    rc.preferred_segments_count = 1;
    rc.hard_pin = 1;
    let pinned = value(3, 5000);
    // SAFETY: live store; `rc` and its strings outlive the calls; buffers valid.
    unsafe {
        let put = |key: &CStr, cfg: &McReplicateConfig| {
            mc_store_put(e, key.as_ptr(), pinned.as_ptr().cast(), pinned.len(), cfg)
        };
        assert_eq!(put(c"pinned", &rc), MC_OK);
        let mut bad = rc;
        bad.replica_num = 0;
        assert_eq!(put(c"r0", &bad), INVALID, "replica_num 0");
        bad = rc;
        bad.preferred_segments = null();
        assert_eq!(put(c"r1", &bad), INVALID, "NULL preferred_segments");
        let nulls = [null::<c_char>()];
        bad.preferred_segments = nulls.as_ptr();
        assert_eq!(put(c"r2", &bad), INVALID, "NULL preferred segment");
        bad.preferred_segments_count = 0;
        assert_eq!(put(c"r3", &bad), MC_OK, "count 0: the array is not read");
    }
    assert_eq!(s.get("pinned", 5000), (MC_OK, pinned.clone()));
    assert_eq!(s.exists("r0"), 0);

    // Registered buffers.
    let mut reg = value(4, 70_000);
    let addr = reg.as_mut_ptr().cast::<c_void>();
    // SAFETY: `reg` outlives its registration (withdrawn below).
    unsafe {
        assert_eq!(mc_store_register_buffer(e, addr, reg.len()), MC_OK);
        let key = c"registered".as_ptr();
        let nil = null();
        assert_eq!(mc_store_put_from(e, key, addr, reg.len(), nil), MC_OK);
        assert_eq!(mc_store_register_buffer(e, null_mut(), 8), INVALID);
        assert_eq!(mc_store_unregister_buffer(e, null_mut()), INVALID);
        assert_eq!(mc_store_unregister_buffer(e, addr), MC_OK);
        let unknown = Code::AddressNotRegistered as c_int;
        assert_eq!(mc_store_unregister_buffer(e, addr), unknown);
    }
    assert_eq!(s.get("registered", reg.len()), (MC_OK, reg.clone()));

    // Removal by pattern and of everything; counts optional.
    for i in 0..5 {
        assert_eq!(s.put(&format!("group-{i}"), &value(10 + i, 100)), MC_OK);
    }
    let mut removed = 0u64;
    // SAFETY: live store; outputs writable or NULL.
    unsafe {
        let re = c"^group-[0-2]$".as_ptr();
        assert_eq!(mc_store_remove_by_regex(e, re, 0, &mut removed), MC_OK);
        assert_eq!(removed, 3);
        let re = c"group".as_ptr();
        assert_eq!(mc_store_remove_by_regex(e, re, 0, null_mut()), MC_OK);
        assert_eq!(s.exists("group-4"), 0);
        // "pinned" and "registered" were read: leased, so kept unless forced.
        assert_eq!(mc_store_remove_all(e, 0, &mut removed), MC_OK);
        assert_eq!(s.exists("pinned"), 1);
        assert_eq!(mc_store_remove_all(e, 1, &mut removed), MC_OK);
        assert!(removed >= 2, "{removed}");
        assert_eq!(mc_store_remove_all(e, 1, null_mut()), MC_OK);
    }
    assert_eq!(s.exists("pinned"), 0);
    assert_eq!(m.master().stats().objects, 0);
}

#[test]
fn batches_give_per_key_results() {
    quiet_logs();
    let m = master();
    let _n = node(&m, 64 * MIB);
    let s = Store::client_of(&m);
    let e = s.0;

    let names: Vec<CString> = (0..8).map(|i| cstring(&format!("b{i}"))).collect();
    let values: Vec<Vec<u8>> = (0..8).map(|i| value(i, 1000 + 3000 * i as usize)).collect();
    let mut keys: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let mut bufs: Vec<*const c_void> = values.iter().map(|v| v.as_ptr().cast()).collect();
    let mut lens: Vec<usize> = values.iter().map(Vec::len).collect();
    // Spoil three entries: a NULL key, a non-UTF-8 key, a NULL buffer; and a zero length.
    keys[1] = null();
    keys[2] = c"\xff".as_ptr();
    bufs[3] = null();
    lens[4] = 0;
    let mut results = vec![7 as c_int; 8];
    // SAFETY: live store; arrays of 8; buffers readable for their lengths.
    let rc = unsafe {
        mc_store_batch_put_from(
            e,
            keys.as_ptr(),
            bufs.as_ptr(),
            lens.as_ptr(),
            8,
            null(),
            results.as_mut_ptr(),
        )
    };
    assert_eq!(rc, MC_OK);
    assert_eq!(
        results,
        [MC_OK, INVALID, BAD_KEY, INVALID, INVALID, MC_OK, MC_OK, MC_OK]
    );

    // Read back: key 5 into a too-small buffer, key 4 was never stored.
    let mut reads: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len() + 1]).collect();
    reads[5].truncate(10);
    let mut rbufs: Vec<*mut c_void> = reads.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
    rbufs[3] = null_mut();
    let caps: Vec<usize> = reads.iter().map(Vec::len).collect();
    let mut got = vec![7i64; 8];
    // SAFETY: live store; arrays of 8; buffers writable for their capacities.
    let rc = unsafe {
        mc_store_batch_get_into(
            e,
            keys.as_ptr(),
            rbufs.as_ptr(),
            caps.as_ptr(),
            8,
            got.as_mut_ptr(),
        )
    };
    assert_eq!(rc, MC_OK);
    let len = |i: usize| values[i].len() as i64;
    let (inv, bad, nf, of) = (
        INVALID as i64,
        BAD_KEY as i64,
        NOT_FOUND as i64,
        OVERFLOW as i64,
    );
    assert_eq!(got, [len(0), inv, bad, inv, nf, of, len(6), len(7)]);
    for i in [0, 6, 7] {
        assert_eq!(&reads[i][..values[i].len()], &values[i][..], "key {i}");
    }

    let mut ex = vec![7 as c_int; 8];
    // SAFETY: live store; arrays of 8.
    let rc = unsafe { mc_store_batch_exists(e, keys.as_ptr(), 8, ex.as_mut_ptr()) };
    assert_eq!(rc, MC_OK);
    assert_eq!(ex, [1, INVALID, BAD_KEY, 0, 0, 1, 1, 1]);

    // Whole-call failures leave results untouched; n = 0 needs no arrays.
    let untouched = ex.clone();
    // SAFETY: live store; every non-NULL array holds 8 elements.
    unsafe {
        let (k, r) = (keys.as_ptr(), ex.as_mut_ptr());
        assert_eq!(mc_store_batch_exists(e, null(), 8, r), INVALID);
        assert_eq!(mc_store_batch_exists(e, k, 8, null_mut()), INVALID);
        assert_eq!(ex, untouched);
        assert_eq!(mc_store_batch_exists(e, null(), 0, null_mut()), MC_OK);
        let (b, l) = (bufs.as_ptr(), lens.as_ptr());
        assert_eq!(
            mc_store_batch_put_from(e, k, null(), l, 8, null(), r),
            INVALID
        );
        assert_eq!(
            mc_store_batch_put_from(e, k, b, null(), 8, null(), r),
            INVALID
        );
        assert_eq!(
            mc_store_batch_put_from(e, null(), null(), null(), 0, null(), null_mut()),
            MC_OK
        );
        let mut zero = std::mem::zeroed::<McReplicateConfig>();
        assert_eq!(mc_store_batch_put_from(e, k, b, l, 8, &zero, r), INVALID);
        zero.replica_num = 2; // more than the one segment: best effort
        let mut res = [7 as c_int; 1];
        let one = [c"two-replicas".as_ptr()];
        let rp = res.as_mut_ptr();
        assert_eq!(
            mc_store_batch_put_from(e, one.as_ptr(), b, l, 1, &zero, rp),
            MC_OK
        );
        assert_eq!(res, [MC_OK]);
        let (rb, c, g) = (rbufs.as_ptr(), caps.as_ptr(), got.as_mut_ptr());
        assert_eq!(mc_store_batch_get_into(e, k, null(), c, 8, g), INVALID);
        assert_eq!(mc_store_batch_get_into(e, k, rb, null(), 8, g), INVALID);
        assert_eq!(mc_store_batch_get_into(e, k, rb, c, 8, null_mut()), INVALID);
        assert_eq!(
            mc_store_batch_get_into(e, null(), null(), null(), 0, null_mut()),
            MC_OK
        );
    }
    assert_eq!(
        s.get("two-replicas", values[0].len()),
        (MC_OK, values[0].clone())
    );
}

/// A packed batch whose buffers lie in the allowed ranges reads as the pointer-array
/// call does, per-key errors included; a packing or a buffer it cannot take leaves every
/// buffer and result untouched and says why.
#[test]
fn packed_batch_reads_only_regular_batches() {
    quiet_logs();
    let m = master();
    let _n = node(&m, 64 * MIB);
    let s = Store::client_of(&m);
    let e = s.0;
    let values: Vec<Vec<u8>> = (0..3).map(|i| value(40 + i, 5000)).collect();
    for (i, v) in values.iter().enumerate() {
        assert_eq!(s.put(&format!("p{i}"), v), MC_OK);
    }
    let mut dst = vec![0u8; 4 * 8192];
    let base = dst.as_mut_ptr();
    // SAFETY: inside `dst`.
    let bufs: Vec<*mut c_void> = (0..4)
        .map(|i| unsafe { base.add(i * 8192) }.cast())
        .collect();
    let mut caps = [8192usize; 4];
    caps[2] = 100; // too small for p2
    let allowed = [base as u64, base as u64 + dst.len() as u64];
    let read = |packed: &[u8], n: usize, bufs: &[*mut c_void], allowed: &[u64]| {
        let mut got = vec![7i64; n];
        // SAFETY: live store; arrays of `n`; buffers writable for their capacities.
        let rc = unsafe {
            mc_store_batch_get_into_packed(
                e,
                packed.as_ptr().cast(),
                packed.len(),
                n,
                bufs.as_ptr(),
                caps.as_ptr(),
                allowed.as_ptr(),
                allowed.len() / 2,
                got.as_mut_ptr(),
            )
        };
        (rc, got)
    };
    let (rc, got) = read(b"p1\0p0\0p2\0missing\0", 4, &bufs, &allowed);
    assert_eq!(rc, MC_OK);
    assert_eq!(got, [5000, 5000, OVERFLOW as i64, NOT_FOUND as i64]);
    assert_eq!(&dst[..5000], &values[1][..]);
    assert_eq!(&dst[8192..8192 + 5000], &values[0][..]);

    dst.fill(0);
    let untouched = vec![7i64; 4];
    for (packed, n, code) in [
        (&b"p0\0p1\0p2\0"[..], 4, INVALID),   // three keys for four
        (&b"p0\0\0p1\0p2\0"[..], 4, BAD_KEY), // an empty key
        (&b"p0\0p1\0p2\0p0"[..], 4, INVALID), // no final NUL
        (&b"p0\0\xff\0p1\0p2\0"[..], 4, BAD_KEY),
    ] {
        assert_eq!(read(packed, n, &bufs, &allowed), (code, untouched.clone()));
    }
    let keys = b"p0\0p1\0p2\0p0\0";
    let not_registered = Code::AddressNotRegistered as c_int;
    // The last buffer reaches one byte past the allowed range; then none is allowed.
    let short = [allowed[0], allowed[1] - 1];
    assert_eq!(
        read(keys, 4, &bufs, &short),
        (not_registered, untouched.clone())
    );
    assert_eq!(
        read(keys, 4, &bufs, &[]),
        (not_registered, untouched.clone())
    );
    let mut with_null = bufs.clone();
    with_null[1] = null_mut();
    assert_eq!(
        read(keys, 4, &with_null, &allowed),
        (not_registered, untouched.clone())
    );
    assert!(dst.iter().all(|&b| b == 0), "nothing read");
    // A buffer across two adjacent allowed ranges lies in neither.
    let across = [allowed[0], allowed[0] + 4096, allowed[0] + 4096, allowed[1]];
    assert_eq!(
        read(keys, 4, &bufs, &across),
        (not_registered, untouched.clone())
    );
    // Two allowed ranges, each buffer inside one: regular.
    let split = [allowed[0], allowed[0] + 8192, allowed[0] + 8192, allowed[1]];
    assert_eq!(read(keys, 4, &bufs, &split).0, MC_OK);
    // SAFETY: NULL store; n = 0 needs no arrays.
    unsafe {
        let null_s = null_mut();
        let r = null_mut();
        assert_eq!(
            mc_store_batch_get_into_packed(null_s, null(), 0, 0, null(), null(), null(), 0, r),
            INVALID
        );
        assert_eq!(
            mc_store_batch_get_into_packed(e, null(), 0, 0, null(), null(), null(), 0, r),
            MC_OK
        );
    }
}

#[test]
fn one_store_serves_many_threads() {
    quiet_logs();
    let m = master();
    let _n = node(&m, 64 * MIB);
    let s = Store::client_of(&m);
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let s = &s;
            scope.spawn(move || {
                for i in 0..10u64 {
                    let key = format!("t{t}-{i}");
                    let v = value(t * 100 + i, 4096 + (i as usize) * 777);
                    assert_eq!(s.put(&key, &v), MC_OK);
                    assert_eq!(s.get(&key, v.len()), (MC_OK, v));
                    assert_eq!(s.exists(&key), 1);
                }
            });
        }
    });
    assert_eq!(m.master().stats().objects, 40);
}

// ---------------------------------------------------------------- the header

/// `#define NAME VALUE` lines of the header.
fn header_defines(header: &str) -> HashMap<String, i64> {
    header
        .lines()
        .filter_map(|l| l.split("/*").next()?.trim().strip_prefix("#define "))
        .filter_map(|rest| {
            let (n, v) = rest.split_once(char::is_whitespace)?;
            Some((n.trim().to_owned(), v.trim().parse().ok()?))
        })
        .collect()
}

#[test]
fn header_declares_the_store_abi() {
    quiet_logs();
    let header = std::fs::read_to_string(header_path().join("mooncake.h")).unwrap();
    let defines = header_defines(&header);
    assert_eq!(
        defines.get("MC_STORE_MAX_KEY_LEN"),
        Some(&(MC_STORE_MAX_KEY_LEN as i64))
    );
    assert_eq!(MC_STORE_MAX_KEY_LEN, MAX_KEY_LEN);
    for key in STORE_CONFIG_KEYS {
        assert!(
            header.contains(&format!(" {key} ")),
            "store config key {key} documented"
        );
    }
    // Every shim is declared (its name followed by an argument list).
    for f in [
        "mc_replicate_config_init",
        "mc_store_new",
        "mc_store_free",
        "mc_store_put",
        "mc_store_put_from",
        "mc_store_get_into",
        "mc_store_exists",
        "mc_store_size",
        "mc_store_remove",
        "mc_store_remove_all",
        "mc_store_remove_by_regex",
        "mc_store_register_buffer",
        "mc_store_unregister_buffer",
        "mc_store_hostname",
        "mc_store_batch_put_from",
        "mc_store_batch_get_into",
        "mc_store_batch_get_into_packed",
        "mc_store_batch_exists",
        "mc_put_options_init",
        "mc_store_batch_put_parts",
        "mc_store_batch_get_parts",
        "mc_store_batch_get_ranges",
        "mc_store_batch_remove",
        "mc_store_batch_replica_clear",
        "mc_store_replica_desc",
        "mc_store_get_buffer",
        "mc_store_buffer_free",
        "mc_store_batch_get_alloc",
        "mc_store_health",
        "mc_store_new_with_engine",
    ] {
        assert!(header.contains(&format!(" {f}(")), "{f} declared");
    }
    // Field names and order of the Rust mirror; offsets are checked with a C compiler
    // in `replicate_config_layout_matches_c`.
    let body = header
        .split("typedef struct {\n    uint32_t replica_num;")
        .nth(1)
        .and_then(|rest| rest.split("} mc_replicate_config;").next())
        .expect("mc_replicate_config in mooncake.h");
    let fields: Vec<&str> = std::iter::once("replica_num")
        .chain(body.lines().filter_map(|l| {
            let decl = l.split("/*").next()?.trim().strip_suffix(';')?;
            decl.rsplit([' ', '*']).next()
        }))
        .collect();
    assert_eq!(
        fields,
        [
            "replica_num",
            "hard_pin",
            "soft_pin",
            "soft_pin_ttl_ms",
            "preferred_segments",
            "preferred_segments_count",
            "prefer_same_node"
        ]
    );
}

// ---------------------------------------------------------------- C program

fn store_program() -> Option<PathBuf> {
    static BUILT: OnceLock<Option<PathBuf>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            if !have("cc") {
                eprintln!("skipping: no C compiler `cc` on PATH");
                return None;
            }
            let lib = static_lib().expect("cargo builds libmooncake.a along with the library");
            Some(program("cc", "-std=c99", "store.c", &lib))
        })
        .clone()
}

#[test]
fn replicate_config_layout_matches_c() {
    quiet_logs();
    use std::mem::{align_of, offset_of, size_of};
    let Some(program) = store_program() else {
        return;
    };
    let out = Command::new(&program).arg("layout").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let c: Vec<usize> = text
        .strip_prefix("layout ")
        .expect("layout line")
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    let rust = [
        size_of::<McReplicateConfig>(),
        offset_of!(McReplicateConfig, replica_num),
        offset_of!(McReplicateConfig, hard_pin),
        offset_of!(McReplicateConfig, soft_pin),
        offset_of!(McReplicateConfig, soft_pin_ttl_ms),
        offset_of!(McReplicateConfig, preferred_segments),
        offset_of!(McReplicateConfig, preferred_segments_count),
        offset_of!(McReplicateConfig, prefer_same_node),
    ];
    assert_eq!(
        c, rust,
        "sizeof and offsets of mc_replicate_config, C vs Rust"
    );
    if size_of::<usize>() == 8 {
        assert_eq!(rust, [48, 0, 4, 8, 16, 24, 32, 40]);
    }
    assert_eq!(align_of::<McReplicateConfig>(), align_of::<u64>());
}

/// `key=value` fields of a ready line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|f| f.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

/// A C program against mooncake.h does put/get/exists/remove on a running cluster.
#[test]
fn c_program_uses_a_running_cluster() {
    quiet_logs();
    let Some(program) = store_program() else {
        return;
    };
    let bin = env!("CARGO_BIN_EXE_mooncake");
    let mut master = Proc::spawn(
        "master",
        Command::new(bin).args([
            "master",
            "--bind",
            "127.0.0.1",
            "--rpc-port",
            "0",
            "--metadata-port",
            "0",
            "--metrics-port",
            "off",
            "--until-stdin-eof",
        ]),
    );
    let ready = master.ready();
    let rpc = field(&ready, "rpc").to_owned();
    let metadata = field(&ready, "metadata").to_owned();
    assert!(rpc.starts_with("127.0.0.1:"), "{ready}");

    let mut node = Proc::spawn(
        "node",
        Command::new(bin).args([
            "node",
            "--master",
            &rpc,
            "--metadata",
            &metadata,
            "--segment-size",
            "64M",
            "--protocol",
            "tcp",
            "--until-stdin-eof",
        ]),
    );
    let node_name = node.ready()["ready ".len()..].trim().to_owned();

    let mut c = Proc::spawn("store.c", Command::new(&program).args([&rpc, &metadata]));
    let out = c.finish(LIMIT);
    assert!(
        out.status.success() && out.stdout.last().map(String::as_str) == Some("ok"),
        "store.c: {:?}\nstdout: {:?}\nstderr:\n{}",
        out.status,
        out.stdout,
        out.stderr
    );
    let host = out
        .stdout
        .iter()
        .find_map(|l| l.strip_prefix("hostname "))
        .expect("hostname line");
    assert!(
        host.starts_with("127.0.0.1:") && host != node_name,
        "{host}"
    );

    // Both servers leave cleanly when their stdin closes.
    for (what, p) in [("node", &mut node), ("master", &mut master)] {
        let out = p.finish(LIMIT);
        assert!(
            out.status.success(),
            "{what}: {:?}\nstdout: {:?}\nstderr:\n{}",
            out.status,
            out.stdout,
            out.stderr
        );
    }
}

#[test]
fn revision_2_calls_through_the_abi() {
    quiet_logs();
    assert!(mc_abi_revision() >= 2);
    let m = master();
    let n1 = node(&m, 32 * MIB);
    let s = Store::client_of(&m);
    // SAFETY: `s.0` is a live store. Below, every array holds the count passed with
    // it and outlives the call; keys are NUL-terminated.
    assert_eq!(unsafe { mc_store_health(s.0) }, MC_OK);

    // Two keys from parts: "a" = 3 parts, "b" = 1 part; "c" has no part.
    let (a0, a1, a2, b0) = (value(1, 1000), value(2, 3000), value(3, 5), value(4, 4096));
    let keys = [cstring("a"), cstring("b"), cstring("c")];
    let kp: Vec<*const c_char> = keys.iter().map(|k| k.as_ptr()).collect();
    let bufs: Vec<*const c_void> = [&a0, &a1, &a2, &b0]
        .iter()
        .map(|v| v.as_ptr().cast())
        .collect();
    let lens = [a0.len(), a1.len(), a2.len(), b0.len()];
    let counts = [3usize, 1, 0];
    let groups = [cstring("g1")];
    let gp: Vec<*const c_char> = groups.iter().map(|g| g.as_ptr()).collect();
    let mut opts = McPutOptions {
        group_ids: null(),
        group_ids_count: 7,
        upsert: 9,
    };
    // SAFETY: live `opts`, writable.
    unsafe { mc_put_options_init(&mut opts) };
    assert_eq!((opts.group_ids_count, opts.upsert), (0, 0));
    opts.group_ids = gp.as_ptr();
    opts.group_ids_count = 1;
    let mut results = [1 as c_int; 3];
    // SAFETY: `s.0` is live; `kp`, `bufs`, `lens`, `counts` and `results` hold the
    // counts passed and outlive the call.
    let rc = unsafe {
        mc_store_batch_put_parts(
            s.0,
            kp.as_ptr(),
            3,
            bufs.as_ptr(),
            lens.as_ptr(),
            counts.as_ptr(),
            null(),
            &opts,
            results.as_mut_ptr(),
        )
    };
    assert_eq!(rc, MC_OK);
    assert_eq!(results, [MC_OK, MC_OK, INVALID]);
    let whole_a: Vec<u8> = [a0.clone(), a1.clone(), a2.clone()].concat();
    assert_eq!(s.get("a", 8192), (MC_OK, whole_a.clone()));

    // Read "a" back split differently; "b" into a buffer too small.
    let (mut x, mut y, mut z) = (vec![0u8; 2500], vec![0u8; 2000], vec![0u8; 100]);
    let out: Vec<*mut c_void> = [&mut x, &mut y, &mut z]
        .iter_mut()
        .map(|v| v.as_mut_ptr().cast())
        .collect();
    let caps = [2500usize, 2000, 100];
    let mut sizes = [0i64; 2];
    // SAFETY: `s.0` is live; `out`, `caps`, the part counts and `sizes` hold two keys'
    // worth and outlive the call.
    let rc = unsafe {
        mc_store_batch_get_parts(
            s.0,
            kp.as_ptr(),
            2,
            out.as_ptr(),
            caps.as_ptr(),
            [2usize, 1].as_ptr(),
            sizes.as_mut_ptr(),
        )
    };
    assert_eq!(rc, MC_OK);
    assert_eq!(sizes, [4005, OVERFLOW as i64]);
    assert_eq!([&x[..], &y[..1505]].concat(), whole_a);

    // Ranges: bytes 990..1010 of "a", and past its end.
    let mut r = vec![0u8; 20];
    let rp = [r.as_mut_ptr().cast::<c_void>()];
    let mut got = [0i64; 1];
    // SAFETY: `s.0` is live; `rp` and the offset, length, count and `got` arrays hold
    // one key's worth.
    let rc = unsafe {
        mc_store_batch_get_ranges(
            s.0,
            kp.as_ptr(),
            1,
            rp.as_ptr(),
            [990u64].as_ptr(),
            [20u64].as_ptr(),
            [1usize].as_ptr(),
            got.as_mut_ptr(),
        )
    };
    assert_eq!((rc, got[0]), (MC_OK, 20));
    assert_eq!(r, whole_a[990..1010]);
    // SAFETY: `s.0` is live; every array holds one key's worth and outlives the call.
    let rc = unsafe {
        mc_store_batch_get_ranges(
            s.0,
            kp.as_ptr(),
            1,
            rp.as_ptr(),
            [4000u64].as_ptr(),
            [20u64].as_ptr(),
            [1usize].as_ptr(),
            got.as_mut_ptr(),
        )
    };
    assert_eq!((rc, got[0]), (MC_OK, INVALID as i64));

    // One round trip get into library memory.
    let (mut p, mut len) = (null_mut(), 0u64);
    assert_eq!(
        // SAFETY: `s.0` is live, `kp[1]` NUL-terminated; `p` and `len` writable.
        unsafe { mc_store_get_buffer(s.0, kp[1], &mut p, &mut len) },
        MC_OK
    );
    assert_eq!(
        // SAFETY: the library handed out `len` readable bytes at `p`, not yet freed.
        unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len as usize) },
        &b0[..]
    );
    // SAFETY: `p`/`len` came from mc_store_get_buffer and are not used again.
    unsafe { mc_store_buffer_free(p, len) };
    assert_eq!(
        // SAFETY: `s.0` is live, `kp[2]` NUL-terminated; `p` and `len` writable.
        unsafe { mc_store_get_buffer(s.0, kp[2], &mut p, &mut len) },
        NOT_FOUND
    );

    // A batch into memory the caller places once sizes are known: a hit each for "a"
    // and "b", a miss, a NULL key; then the same with an allocator that gives none.
    unsafe extern "C" fn place(ctx: *mut c_void, index: usize, size: u64) -> *mut c_void {
        // SAFETY: `ctx` is the test's `Vec<Vec<u8>>`, used by nothing else during the call.
        let bufs = unsafe { &mut *ctx.cast::<Vec<Vec<u8>>>() };
        bufs[index] = vec![0; size as usize];
        bufs[index].as_mut_ptr().cast()
    }
    unsafe extern "C" fn refuse(_: *mut c_void, _: usize, _: u64) -> *mut c_void {
        null_mut()
    }
    let batch = [kp[0], kp[1], kp[2], null()];
    let mut placed: Vec<Vec<u8>> = vec![Vec::new(); 4];
    let mut got = [1i64; 4];
    // SAFETY: `s.0` is live; `batch` and `got` hold four entries; `place` gives memory
    // `placed` keeps until after the call.
    let rc = unsafe {
        mc_store_batch_get_alloc(
            s.0,
            batch.as_ptr(),
            4,
            Some(place),
            (&mut placed as *mut Vec<Vec<u8>>).cast(),
            got.as_mut_ptr(),
        )
    };
    let sizes = [whole_a.len() as i64, b0.len() as i64];
    assert_eq!(
        (rc, got),
        (
            MC_OK,
            [sizes[0], sizes[1], NOT_FOUND as i64, INVALID as i64]
        )
    );
    assert_eq!((&placed[0], &placed[1]), (&whole_a, &b0));
    assert!(
        placed[2].is_empty() && placed[3].is_empty(),
        "no memory asked for a miss"
    );
    // SAFETY: as above; `refuse` gives no memory.
    let rc = unsafe {
        mc_store_batch_get_alloc(
            s.0,
            batch.as_ptr(),
            2,
            Some(refuse),
            null_mut(),
            got.as_mut_ptr(),
        )
    };
    assert_eq!((rc, &got[..2]), (MC_OK, &[INVALID as i64; 2][..]));
    // SAFETY: a live store and valid arrays; the NULL allocator is refused first.
    let rc = unsafe {
        mc_store_batch_get_alloc(s.0, batch.as_ptr(), 2, None, null_mut(), got.as_mut_ptr())
    };
    assert_eq!(rc, INVALID);

    // The replica descriptor names the node's segment; a small buffer tells the size.
    let mut needed = 0usize;
    let mut tiny = [0 as c_char; 4];
    assert_eq!(
        // SAFETY: `s.0` is live; `tiny` is writable for 4 bytes; `needed` writable.
        unsafe { mc_store_replica_desc(s.0, kp[0], tiny.as_mut_ptr(), 4, &mut needed) },
        OVERFLOW
    );
    let mut text = vec![0 as c_char; needed];
    assert_eq!(
        // SAFETY: `s.0` is live; `text` is writable for `needed` bytes.
        unsafe { mc_store_replica_desc(s.0, kp[0], text.as_mut_ptr(), needed, null_mut()) },
        MC_OK
    );
    // SAFETY: NUL-terminated on success.
    let text = unsafe { CStr::from_ptr(text.as_ptr()) }
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        text.contains(&format!("\"segment\":\"{}\"", n1.hostname())),
        "{text}"
    );
    assert!(text.starts_with("{\"size\":4005,"), "{text}");

    // "a" and "b" were read: leased, so neither cleared nor removed without force.
    let mut res = [9 as c_int; 2];
    assert_eq!(
        // SAFETY: `s.0` is live; `kp` and `res` hold two entries.
        unsafe { mc_store_batch_replica_clear(s.0, kp.as_ptr(), 2, null(), res.as_mut_ptr()) },
        MC_OK
    );
    assert_eq!(res, [0, 0]);
    assert_eq!(
        // SAFETY: `s.0` is live; `kp` and the result array hold three entries.
        unsafe { mc_store_batch_remove(s.0, kp.as_ptr(), 3, 0, [0; 3].as_mut_ptr()) },
        MC_OK
    );
    let mut rm = [9 as c_int; 3];
    assert_eq!(
        // SAFETY: `s.0` is live; `kp` and `rm` hold three entries.
        unsafe { mc_store_batch_remove(s.0, kp.as_ptr(), 3, 1, rm.as_mut_ptr()) },
        MC_OK
    );
    assert_eq!(rm, [MC_OK, MC_OK, NOT_FOUND]);
    assert_eq!(s.exists("a"), 0);
}

#[test]
fn a_store_can_share_an_engine() {
    quiet_logs();
    let m = master();
    let metadata = m.metadata_url().unwrap();
    let cfg = config(&[("metadata", &metadata), ("protocol", "tcp")]);
    let mut engine = null_mut();
    // SAFETY: live config; `engine` writable.
    assert_eq!(unsafe { mc_engine_new(cfg, &mut engine) }, MC_OK);
    // SAFETY: from mc_config_new, not used again.
    unsafe { mc_config_free(cfg) };
    let master_addr = m.rpc_addr().to_string();
    let cfg = config(&[
        ("master_address", &master_addr),
        ("global_segment_size", "8M"),
    ]);
    let mut s = null_mut();
    assert_eq!(
        // SAFETY: live config; NULL engine refused; `s` writable.
        unsafe { mc_store_new_with_engine(cfg, null_mut(), &mut s) },
        INVALID
    );
    assert!(s.is_null());
    assert_eq!(
        // SAFETY: live config and engine; `s` writable.
        unsafe { mc_store_new_with_engine(cfg, engine, &mut s) },
        MC_OK
    );
    // SAFETY: from mc_config_new, not used again.
    unsafe { mc_config_free(cfg) };
    let store = Store(s);
    let mut name = [0 as c_char; 128];
    assert_eq!(
        // SAFETY: live engine; `name` writable for 128 bytes.
        unsafe { mc_engine_segment_name(engine, name.as_mut_ptr(), 128) },
        MC_OK
    );
    // SAFETY: NUL-terminated on success.
    let name = unsafe { CStr::from_ptr(name.as_ptr()) }
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(store.hostname(), name);
    // The engine handle goes first; the store keeps working on the engine it shares.
    // SAFETY: live handle, not used again; the store holds its own reference.
    unsafe { mc_engine_free(engine) };
    assert_eq!(store.put("shared", &value(5, 777)), MC_OK);
    assert_eq!(store.get("shared", 1000), (MC_OK, value(5, 777)));
}
