//! Revision 7 of the store ABI, called straight from Rust against an in-process master:
//! put and get sessions with ranged transfers, extra segments (allocated and mapped from
//! a file), the disk tier's drain, copy and move tasks, and their bad input.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

mod common;

use common::cprog::{header_path, quiet_logs};
use common::pattern as value;
use common::{store_client, store_server};
use mooncake::capi::*;
use mooncake::json::{self, Value};
use mooncake::store::client::Backing;
use mooncake::store::protocol::ReplicateConfig;
use mooncake::store::{Client, ClientConfig, MasterServer, ServerConfig};
use mooncake::Code;

const MIB: u64 = 1 << 20;
const INVALID: c_int = Code::InvalidParams as c_int;
const NOT_FOUND: c_int = Code::ObjectNotFound as c_int;

fn cstring(s: &str) -> CString {
    CString::new(s).unwrap()
}

/// A store made through the C ABI, freed on drop.
struct Store(*mut McStore);

impl Store {
    /// A client of `m` over TCP lending `segment` bytes, with extra `settings`.
    fn of(m: &MasterServer, segment: u64, settings: &[(&str, &str)]) -> Store {
        let master = m.rpc_addr().to_string();
        let metadata = m.metadata_url().unwrap();
        let segment = segment.to_string();
        let cfg = mc_config_new();
        let base = [
            ("master_address", master.as_str()),
            ("metadata", metadata.as_str()),
            ("protocol", "tcp"),
            ("global_segment_size", segment.as_str()),
        ];
        for (k, v) in base.iter().chain(settings) {
            let (k, v) = (cstring(k), cstring(v));
            // SAFETY: `cfg` is live; the strings are NUL-terminated.
            assert_eq!(unsafe { mc_config_set(cfg, k.as_ptr(), v.as_ptr()) }, MC_OK);
        }
        let mut s = null_mut();
        // SAFETY: `cfg` is live and `s` writable.
        let rc = unsafe { mc_store_new(cfg, &mut s) };
        // SAFETY: from mc_config_new, not used again.
        unsafe { mc_config_free(cfg) };
        assert_eq!(rc, MC_OK);
        Store(s)
    }

    fn hostname(&self) -> String {
        let mut buf = [0 as c_char; 128];
        // SAFETY: live store; `buf` writable for its length.
        let rc = unsafe { mc_store_hostname(self.0, buf.as_mut_ptr(), 128) };
        assert_eq!(rc, MC_OK);
        // SAFETY: NUL-terminated by the call.
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_str()
            .unwrap()
            .to_owned()
    }

    /// Puts `v` under `key`, on `preferred` first when given.
    fn put(&self, key: &str, v: &[u8], preferred: Option<&str>) -> c_int {
        let mut cfg = std::mem::MaybeUninit::uninit();
        // SAFETY: `cfg` is writable.
        unsafe { mc_replicate_config_init(cfg.as_mut_ptr()) };
        // SAFETY: initialized just above.
        let mut cfg = unsafe { cfg.assume_init() };
        let name = preferred.map(cstring);
        let names = [name.as_ref().map_or(null(), |n| n.as_ptr())];
        if name.is_some() {
            cfg.preferred_segments = names.as_ptr();
            cfg.preferred_segments_count = 1;
        }
        let k = cstring(key);
        // SAFETY: live store; `v` readable; `cfg` valid with its strings alive.
        unsafe { mc_store_put(self.0, k.as_ptr(), v.as_ptr().cast(), v.len(), &cfg) }
    }

    fn get(&self, key: &str, cap: usize) -> (c_int, Vec<u8>) {
        let k = cstring(key);
        let mut buf = vec![0u8; cap];
        let mut len = 0u64;
        // SAFETY: live store; `buf` writable for `cap` bytes.
        let rc = unsafe {
            mc_store_get_into(self.0, k.as_ptr(), buf.as_mut_ptr().cast(), cap, &mut len)
        };
        buf.truncate(len as usize);
        (rc, buf)
    }

    fn exists(&self, key: &str) -> c_int {
        let k = cstring(key);
        // SAFETY: live store; NUL-terminated key.
        unsafe { mc_store_exists(self.0, k.as_ptr()) }
    }

    /// The segments holding each replica of `key` (as `mc_store_replica_desc` says; a
    /// striped replica may have several pieces on one).
    fn replica_segments(&self, key: &str) -> Vec<Vec<String>> {
        let k = cstring(key);
        let mut buf = vec![0 as c_char; 64 << 10];
        // SAFETY: live store; `buf` writable for its length.
        let rc = unsafe {
            mc_store_replica_desc(self.0, k.as_ptr(), buf.as_mut_ptr(), buf.len(), null_mut())
        };
        if rc != MC_OK {
            return Vec::new();
        }
        // SAFETY: NUL-terminated by the call.
        let text = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap();
        let desc = json::parse(text).unwrap();
        let replicas = desc.get("replicas").and_then(Value::as_array).unwrap();
        replicas
            .iter()
            .map(|r| {
                let pieces = r.get("pieces").and_then(Value::as_array).unwrap();
                let mut names: Vec<String> = pieces
                    .iter()
                    .map(|p| p.str_field("segment").unwrap().to_owned())
                    .collect();
                names.dedup();
                names
            })
            .collect()
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: from mc_store_new, freed once.
        unsafe { mc_store_free(self.0) };
    }
}

/// NUL-terminated pointers to `keys` (which must outlive their use).
fn ptrs(keys: &[CString]) -> Vec<*const c_char> {
    keys.iter().map(|k| k.as_ptr()).collect()
}

fn cstrings(keys: &[&str]) -> Vec<CString> {
    keys.iter().map(|k| cstring(k)).collect()
}

/// Calls a keys-only batch function; per-key results.
fn keyed(
    s: &Store,
    keys: &[&str],
    f: unsafe extern "C" fn(*mut McStore, *const *const c_char, usize, *mut c_int) -> c_int,
) -> Vec<c_int> {
    let owned = cstrings(keys);
    let p = ptrs(&owned);
    let mut results = vec![1; keys.len()];
    // SAFETY: live store; arrays of `keys.len()`.
    let rc = unsafe { f(s.0, p.as_ptr(), p.len(), results.as_mut_ptr()) };
    assert_eq!(rc, MC_OK);
    results
}

/// One key's ranges, `(object offset, local buffer)` each.
type Ranges<'a> = Vec<(u64, &'a mut [u8])>;

/// Writes (or, with `read`, reads) ranges of session objects; per-key results.
fn ranged(s: &Store, keys: &[&str], ranges: &mut [Ranges], read: bool) -> Vec<i64> {
    let owned = cstrings(keys);
    let p = ptrs(&owned);
    let mut bufs: Vec<*mut c_void> = Vec::new();
    let (mut offs, mut lens, mut counts) = (Vec::new(), Vec::new(), Vec::new());
    for key_ranges in ranges.iter_mut() {
        counts.push(key_ranges.len());
        for (off, buf) in key_ranges.iter_mut() {
            bufs.push(buf.as_mut_ptr().cast());
            offs.push(*off);
            lens.push(buf.len() as u64);
        }
    }
    let mut results = vec![1i64; keys.len()];
    let (b, o, l, c, r) = (
        bufs.as_ptr(),
        offs.as_ptr(),
        lens.as_ptr(),
        counts.as_ptr(),
        results.as_mut_ptr(),
    );
    // SAFETY: live store; arrays sized as the calls require; buffers live and distinct.
    let rc = unsafe {
        match read {
            true => mc_store_get_session_read(s.0, p.as_ptr(), p.len(), b, o, l, c, r),
            false => mc_store_put_session_write(s.0, p.as_ptr(), p.len(), b.cast(), o, l, c, r),
        }
    };
    assert_eq!(rc, MC_OK);
    results
}

fn session_start(s: &Store, keys: &[&str], sizes: &[u64], opts: *const McPutOptions) -> Vec<c_int> {
    let owned = cstrings(keys);
    let p = ptrs(&owned);
    let mut results = vec![1; keys.len()];
    // SAFETY: live store; arrays of `keys.len()`; `opts` NULL or valid.
    let rc = unsafe {
        mc_store_put_session_start(
            s.0,
            p.as_ptr(),
            p.len(),
            sizes.as_ptr(),
            null(),
            opts,
            results.as_mut_ptr(),
        )
    };
    if rc != MC_OK {
        return vec![rc];
    }
    results
}

#[test]
fn put_sessions_write_ranges_and_publish_at_the_end() {
    quiet_logs();
    let m = store_server(10_000);
    let _node = store_client(&m, 64 * MIB, true);
    let s = Store::of(&m, 0, &[]);
    let size = 3 * 4096u64;
    let a = value(1, size as usize);
    let b = value(2, size as usize);
    assert_eq!(
        session_start(&s, &["a", "b"], &[size, size], null()),
        [0, 0]
    );
    assert_eq!(s.exists("a"), 0, "invisible until the session ends");
    assert_eq!(
        session_start(&s, &["a"], &[size], null()),
        [INVALID],
        "a second session for a key"
    );
    // "a": three layers, out of order (they tile the object: no read-back); "b": one
    // range written twice over (its checksum is read back at the end).
    let (mut a0, mut a1, mut a2) = (
        a[..4096].to_vec(),
        a[4096..8192].to_vec(),
        a[8192..].to_vec(),
    );
    let mut b_all = b.clone();
    let mut b_mid = b[100..200].to_vec();
    let mut batch = vec![
        vec![(8192, &mut a2[..]), (0, &mut a0[..])],
        vec![(0, &mut b_all[..]), (100, &mut b_mid[..])],
    ];
    assert_eq!(
        ranged(&s, &["a", "b"], &mut batch, false),
        [8192, size as i64 + 100]
    );
    let mut rest = vec![vec![(4096, &mut a1[..])]];
    assert_eq!(ranged(&s, &["a"], &mut rest, false), [4096]);
    // A range past the end, or a key without a session, fails and writes nothing.
    let (mut junk, mut junk2) = (vec![0xEEu8; 20], vec![0xEEu8; 10]);
    let mut past = vec![vec![(size - 10, &mut junk[..])], vec![(0, &mut junk2[..])]];
    assert_eq!(
        ranged(&s, &["a", "zz"], &mut past, false),
        [INVALID as i64, INVALID as i64]
    );
    assert_eq!(
        keyed(&s, &["a", "b", "zz"], mc_store_put_session_end),
        [0, 0, INVALID]
    );
    assert_eq!(
        s.get("a", size as usize),
        (MC_OK, a),
        "verified against its checksum"
    );
    assert_eq!(s.get("b", size as usize), (MC_OK, b));
    // Ended: no more writes.
    assert_eq!(ranged(&s, &["a"], &mut rest, false), [INVALID as i64]);

    // A revoked session leaves nothing behind, and the key can be put again.
    assert_eq!(session_start(&s, &["c"], &[4096], null()), [0]);
    let mut c = value(3, 4096);
    assert_eq!(
        ranged(&s, &["c"], &mut [vec![(0, &mut c[..])]], false),
        [4096]
    );
    assert_eq!(
        keyed(&s, &["c", "c2"], mc_store_put_session_revoke),
        [0, INVALID]
    );
    assert_eq!(s.exists("c"), 0);
    assert_eq!(s.put("c", &c, None), MC_OK);

    // An existing key, a zero size, and upsert are refused.
    assert_eq!(
        session_start(&s, &["a", "z"], &[size, 0], null()),
        [Code::ObjectAlreadyExists as c_int, INVALID]
    );
    let mut opts = std::mem::MaybeUninit::uninit();
    // SAFETY: writable.
    unsafe { mc_put_options_init(opts.as_mut_ptr()) };
    // SAFETY: initialized just above.
    let mut opts = unsafe { opts.assume_init() };
    opts.upsert = 1;
    assert_eq!(session_start(&s, &["u"], &[10], &opts), [INVALID]);
    assert_eq!(s.exists("u"), 0);
    // SAFETY: a NULL store or sizes array is refused before anything is read.
    unsafe {
        let mut r = [0; 1];
        let k = [c"k".as_ptr()];
        let nil: *const u64 = null();
        assert_eq!(
            mc_store_put_session_start(
                null_mut(),
                k.as_ptr(),
                1,
                &4,
                null(),
                null(),
                r.as_mut_ptr()
            ),
            INVALID
        );
        assert_eq!(
            mc_store_put_session_start(s.0, k.as_ptr(), 1, nil, null(), null(), r.as_mut_ptr()),
            INVALID
        );
    }
}

#[test]
fn get_sessions_read_ranges_until_their_lease_ends() {
    quiet_logs();
    let m = store_server(300);
    let _node = store_client(&m, 64 * MIB, true);
    let s = Store::of(&m, 0, &[]);
    let v = value(4, 10_000);
    assert_eq!(s.put("k", &v, None), MC_OK);
    assert_eq!(
        keyed(&s, &["k", "missing"], mc_store_get_session_start),
        [0, NOT_FOUND]
    );
    let (mut head, mut tail) = (vec![0u8; 100], vec![0u8; 900]);
    let mut batch = vec![vec![(0, &mut head[..]), (9_100, &mut tail[..])]];
    assert_eq!(ranged(&s, &["k"], &mut batch, true), [1000]);
    assert_eq!((&head[..], &tail[..]), (&v[..100], &v[9_100..]));
    let mut past = vec![vec![(9_999, &mut head[..2])]];
    assert_eq!(ranged(&s, &["k"], &mut past, true), [INVALID as i64]);
    // The lease ends (300 ms): the session answers LEASE_EXPIRED once and is gone.
    let deadline = Instant::now() + Duration::from_secs(20);
    let expired = loop {
        let mut one = vec![vec![(0, &mut head[..10])]];
        let r = ranged(&s, &["k"], &mut one, true)[0];
        if r != 10 || Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(expired, Code::LeaseExpired as i64);
    let mut again = vec![vec![(0, &mut head[..10])]];
    assert_eq!(ranged(&s, &["k"], &mut again, true), [INVALID as i64]);
    // A new session reads again; an ended one does not.
    assert_eq!(keyed(&s, &["k"], mc_store_get_session_start), [0]);
    assert_eq!(ranged(&s, &["k"], &mut again, true), [10]);
    let k = [c"k".as_ptr(), null()];
    // SAFETY: live store; two pointers (one NULL, skipped).
    let rc = unsafe { mc_store_get_session_end(s.0, k.as_ptr(), 2) };
    assert_eq!(rc, MC_OK);
    assert_eq!(ranged(&s, &["k"], &mut again, true), [INVALID as i64]);
}

/// Allocates an extra segment of `size` on `s`: its id and bytes allocated, or the code.
fn allocate(s: &Store, size: u64) -> Result<(String, u64), c_int> {
    let mut id = [0 as c_char; 64];
    let mut got = 0u64;
    // SAFETY: live store; `id` writable for 64 bytes; `got` writable.
    let rc = unsafe { mc_store_allocate_segment(s.0, size, null(), id.as_mut_ptr(), 64, &mut got) };
    if rc != MC_OK {
        return Err(rc);
    }
    // SAFETY: NUL-terminated by the call.
    let id = unsafe { CStr::from_ptr(id.as_ptr()) }
        .to_str()
        .unwrap()
        .to_owned();
    Ok((id, got))
}

fn segments(m: &MasterServer) -> u64 {
    m.master().stats().segments
}

#[test]
fn extra_segments_change_where_objects_can_go() {
    quiet_logs();
    let m = store_server(10_000);
    let s = Store::of(&m, 0, &[]);
    let v = value(5, 50_000);
    assert_eq!(
        s.put("k", &v, None),
        Code::NoAvailableHandle as c_int,
        "no segment yet"
    );
    let (id, got) = allocate(&s, 5 * MIB).unwrap();
    assert_eq!(got, 8 * MIB, "rounded up to 4 MiB");
    assert!(id.contains('-'), "{id}");
    assert_eq!(segments(&m), 1);
    assert_eq!(s.put("k", &v, None), MC_OK);
    assert_eq!(s.replica_segments("k"), [[s.hostname()]]);
    assert_eq!(s.get("k", v.len()), (MC_OK, v.clone()));
    // Unmounted: what only it held is gone, and nothing can be placed.
    let cid = cstring(&id);
    // SAFETY: live store; NUL-terminated id.
    unsafe {
        let wrong_kind = mc_store_unmount_file_segment(s.0, cid.as_ptr(), 0);
        assert_eq!(wrong_kind, Code::SegmentNotFound as c_int);
        assert_eq!(
            mc_store_unmount_allocated_segment(s.0, cid.as_ptr(), 0),
            MC_OK
        );
        let again = mc_store_unmount_allocated_segment(s.0, cid.as_ptr(), 0);
        assert_eq!(again, Code::SegmentNotFound as c_int);
    }
    assert_eq!(segments(&m), 0);
    assert_eq!(
        s.exists("k"),
        0,
        "its only replica was on the unmounted segment"
    );
    assert_eq!(s.put("k", &v, None), Code::NoAvailableHandle as c_int);
    // A file mapped as a segment: what is stored there lands in the file.
    let dir = std::env::temp_dir().join(format!("mc-surface-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("segment");
    std::fs::write(&path, vec![0u8; 16 << 20]).unwrap();
    let p = cstring(path.to_str().unwrap());
    let mut fid = [0 as c_char; 64];
    let f = fid.as_mut_ptr();
    // SAFETY: live store; strings NUL-terminated; `fid` writable for 64 bytes.
    let rc = unsafe { mc_store_mount_file_segment(s.0, p.as_ptr(), 4096, 8 * MIB, null(), f, 64) };
    assert_eq!(rc, MC_OK);
    // SAFETY: NUL-terminated by the call.
    let fid = unsafe { CStr::from_ptr(fid.as_ptr()) }.to_owned();
    assert_eq!(segments(&m), 1);
    let w = value(7, 3000);
    assert_eq!(s.put("w", &w, None), MC_OK);
    let stored = std::fs::read(&path).unwrap();
    assert!(
        stored.windows(w.len()).any(|win| win == w),
        "the value is in the file"
    );
    // A grace period: no new placements at once, unmounted once it is over.
    // SAFETY: live store; NUL-terminated id.
    let rc = unsafe { mc_store_unmount_file_segment(s.0, fid.as_ptr(), 500) };
    assert_eq!(rc, MC_OK);
    assert_eq!(s.put("late", &w, None), Code::NoAvailableHandle as c_int);
    let deadline = Instant::now() + Duration::from_secs(20);
    while segments(&m) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(segments(&m), 0, "unmounted after the grace period");
    assert_eq!(s.exists("w"), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_segment_requests_change_nothing() {
    quiet_logs();
    let m = store_server(10_000);
    let s = Store::of(&m, 0, &[]);
    let dir = std::env::temp_dir().join(format!("mc-surface-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("small");
    std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
    let p = cstring(path.to_str().unwrap());
    let missing = cstring(dir.join("none").to_str().unwrap());
    let mut id = [0 as c_char; 64];
    let i = id.as_mut_ptr();
    // SAFETY: live store; strings NUL-terminated; `id` writable for 64 bytes.
    unsafe {
        let file = |path: *const c_char, off, len, id_len| {
            mc_store_mount_file_segment(s.0, path, off, len, null(), i, id_len)
        };
        assert_eq!(
            file(missing.as_ptr(), 0, 4096, 64),
            Code::FileNotFound as c_int
        );
        assert_eq!(
            file(p.as_ptr(), 0, 2 << 20, 64),
            INVALID,
            "past the file's end"
        );
        assert_eq!(file(p.as_ptr(), 100, 4096, 64), INVALID, "unaligned offset");
        assert_eq!(file(p.as_ptr(), 0, 0, 64), INVALID, "empty");
        assert_eq!(file(null(), 0, 4096, 64), INVALID);
        assert_eq!(
            file(p.as_ptr(), 0, 4096, 4),
            Code::BufferOverflow as c_int,
            "id_buf too small"
        );
        let mut got = 0u64;
        assert_eq!(
            mc_store_allocate_segment(s.0, 0, null(), i, 64, &mut got),
            INVALID
        );
        assert_eq!(
            mc_store_allocate_segment(s.0, MIB, null(), i, 3, &mut got),
            Code::BufferOverflow as c_int
        );
        assert_eq!(
            mc_store_allocate_segment(s.0, MIB, c"cuda:x".as_ptr(), i, 64, &mut got),
            INVALID
        );
        assert_eq!(
            mc_store_allocate_segment(s.0, MIB, null(), i, 64, null_mut()),
            INVALID
        );
        assert_eq!(
            mc_store_unmount_allocated_segment(s.0, c"1-1".as_ptr(), 0),
            Code::SegmentNotFound as c_int
        );
        assert_eq!(mc_store_unmount_file_segment(s.0, null(), 0), INVALID);
    }
    assert_eq!(segments(&m), 0, "nothing stays mounted");
    // Without a disk tier, draining it does nothing.
    // SAFETY: live store.
    assert_eq!(unsafe { mc_store_drain_disk_tier(s.0, 0) }, 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_disk_tier_can_be_given_up() {
    quiet_logs();
    let m = store_server(10_000);
    let dir = std::env::temp_dir().join(format!("mc-surface-disk-{}", std::process::id()));
    let tier = [("ssd_path", dir.to_str().unwrap()), ("ssd_size", "64M")];
    let s = Store::of(&m, 4 * MIB, &tier);
    let objects = 40;
    for i in 0..objects {
        assert_eq!(s.put(&format!("d{i}"), &value(i, 200_000), None), MC_OK);
    }
    let in_memory = |i: u64| {
        let replicas = m.master().query(&format!("d{i}")).map(|(_, _, r)| r.len());
        replicas.unwrap_or(0) > 0
    };
    let on_disk: Vec<u64> = (0..objects).filter(|&i| !in_memory(i)).collect();
    assert!(on_disk.len() > 10, "evicted to the disk tier: {on_disk:?}");
    assert_eq!(m.master().stats().objects, objects, "none lost");
    // A read of an object only on disk is staged for it: counted.
    let mut reads = u64::MAX;
    // SAFETY: live store; `reads` writable.
    unsafe {
        assert_eq!(mc_store_disk_read_count(s.0, &mut reads), MC_OK);
        assert_eq!(reads, 0);
        assert_eq!(mc_store_disk_read_count(s.0, null_mut()), INVALID);
    }
    let d = on_disk[0];
    assert_eq!(s.get(&format!("d{d}"), 200_000), (MC_OK, value(d, 200_000)));
    // SAFETY: as above.
    assert_eq!(unsafe { mc_store_disk_read_count(s.0, &mut reads) }, MC_OK);
    assert_eq!(reads, 1);
    // Given up: what only the disk held is gone; what is in memory stays.
    // SAFETY: live store (and a NULL one refused).
    unsafe {
        assert_eq!(mc_store_drain_disk_tier(null_mut(), 0), INVALID);
        assert_eq!(mc_store_drain_disk_tier(s.0, 0), MC_OK);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let only_on_disk =
        || (0..objects).any(|i| !in_memory(i) && m.master().query(&format!("d{i}")).is_some());
    while only_on_disk() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!only_on_disk(), "objects kept only on disk are gone");
    assert!(m.master().stats().objects < objects);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Where task `id` of `s` stands: its JSON, or None when `s` does not know it.
fn query(s: &Store, id: [u64; 2]) -> Option<Value> {
    let mut buf = vec![0 as c_char; 4096];
    let mut needed = 0usize;
    // SAFETY: live store; `buf` writable for its length.
    let rc =
        unsafe { mc_store_query_task(s.0, id[0], id[1], buf.as_mut_ptr(), buf.len(), &mut needed) };
    if rc == 1 {
        return None;
    }
    assert_eq!(rc, MC_OK);
    // SAFETY: NUL-terminated by the call.
    Some(json::parse(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap()).unwrap())
}

/// Polls task `id` until it is final; its status and message.
fn finished(s: &Store, id: [u64; 2]) -> (String, String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let t = query(s, id).expect("a task of this store");
        let status = t.str_field("status").unwrap().to_owned();
        if status == "success" || status == "failed" || Instant::now() > deadline {
            return (status, t.str_field("message").unwrap().to_owned());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn copy_and_move_tasks_place_replicas_on_named_segments() {
    quiet_logs();
    let m = store_server(10_000);
    let node = store_client(&m, 32 * MIB, true);
    let a = node.hostname().to_owned();
    let s = Store::of(&m, 0, &[]);
    let v = value(9, 300_000);
    assert_eq!(s.put("k", &v, None), MC_OK);
    assert_eq!(s.put("m", &v, None), MC_OK);
    let (_id, _) = allocate(&s, 16 * MIB).unwrap();
    let b = s.hostname();

    // Copy "k" onto the store's own segment: two replicas.
    let targets = cstrings(&[&b]);
    let t = ptrs(&targets);
    let mut id = [0u64; 2];
    // SAFETY: live store; NUL-terminated strings; `id` two writable u64s.
    let rc =
        unsafe { mc_store_create_copy_task(s.0, c"k".as_ptr(), t.as_ptr(), 1, id.as_mut_ptr()) };
    assert_eq!(rc, MC_OK);
    let created = query(&s, id).unwrap();
    assert_eq!(created.str_field("type").unwrap(), "copy");
    assert!(created.u64_field("created_at_ms").unwrap() > 0);
    assert_eq!(
        finished(&s, id),
        ("success".into(), "Task completed successfully".into())
    );
    let mut held = s.replica_segments("k");
    held.sort();
    let mut want = vec![vec![a.clone()], vec![b.clone()]];
    want.sort();
    assert_eq!(held, want);
    assert_eq!(s.get("k", v.len()), (MC_OK, v.clone()));

    // Move "m" from the node to the store's segment: one replica, there.
    let (src, dst) = (cstring(&a), cstring(&b));
    // SAFETY: as above.
    let rc = unsafe {
        mc_store_create_move_task(
            s.0,
            c"m".as_ptr(),
            src.as_ptr(),
            dst.as_ptr(),
            id.as_mut_ptr(),
        )
    };
    assert_eq!(rc, MC_OK);
    assert_eq!(finished(&s, id).0, "success");
    assert_eq!(s.replica_segments("m"), [[b.clone()]]);
    assert_eq!(node.get("m").unwrap(), v, "readable from another client");

    // Refused at once, creating nothing: unknown segment, missing key, same segment,
    // no replica on the source, no target.
    let nowhere = cstrings(&["nowhere:1"]);
    let nw = ptrs(&nowhere);
    let mut other = [7u64; 2];
    // SAFETY: as above.
    unsafe {
        let o = other.as_mut_ptr();
        assert_eq!(
            mc_store_create_copy_task(s.0, c"k".as_ptr(), nw.as_ptr(), 1, o),
            INVALID
        );
        assert_eq!(
            mc_store_create_copy_task(s.0, c"none".as_ptr(), t.as_ptr(), 1, o),
            NOT_FOUND
        );
        assert_eq!(
            mc_store_create_copy_task(s.0, c"k".as_ptr(), t.as_ptr(), 0, o),
            INVALID
        );
        assert_eq!(
            mc_store_create_copy_task(s.0, c"k".as_ptr(), t.as_ptr(), 1, null_mut()),
            INVALID
        );
        assert_eq!(
            mc_store_create_move_task(s.0, c"m".as_ptr(), dst.as_ptr(), dst.as_ptr(), o),
            INVALID
        );
        assert_eq!(
            mc_store_create_move_task(s.0, c"m".as_ptr(), src.as_ptr(), dst.as_ptr(), o),
            INVALID
        );
    }
    assert_eq!(other, [7, 7], "no id written");
    assert_eq!(s.replica_segments("m"), [[b.clone()]]);
    assert_eq!(query(&s, [id[0], id[1] + 100]), None);
    let mut small = [0 as c_char; 4];
    let mut needed = 0usize;
    // SAFETY: live store; `small` writable for 4 bytes.
    let rc = unsafe { mc_store_query_task(s.0, id[0], id[1], small.as_mut_ptr(), 4, &mut needed) };
    assert_eq!((rc, needed > 4), (Code::BufferOverflow as c_int, true));
}

#[test]
fn the_header_declares_revision_7() {
    let header = std::fs::read_to_string(header_path().join("mooncake.h")).unwrap();
    for f in [
        "mc_store_put_session_start",
        "mc_store_put_session_write",
        "mc_store_put_session_end",
        "mc_store_put_session_revoke",
        "mc_store_get_session_start",
        "mc_store_get_session_read",
        "mc_store_get_session_end",
        "mc_store_allocate_segment",
        "mc_store_mount_file_segment",
        "mc_store_unmount_file_segment",
        "mc_store_unmount_allocated_segment",
        "mc_store_drain_disk_tier",
        "mc_store_create_copy_task",
        "mc_store_create_move_task",
        "mc_store_query_task",
        "mc_store_disk_read_count",
    ] {
        assert_eq!(
            header.matches(&format!(" {f}(")).count(),
            1,
            "{f} declared once"
        );
    }
    assert!(mc_abi_revision() >= 7);
}

/// A master on fixed ports (so a new one can take the old one's place).
fn master_on(rpc: u16, metadata: u16) -> MasterServer {
    MasterServer::start(ServerConfig {
        rpc_port: rpc,
        metadata_port: Some(metadata),
        metrics_port: None,
        ..ServerConfig::default()
    })
    .unwrap()
}

#[test]
fn extra_segments_are_mounted_again_on_a_restarted_master() {
    quiet_logs();
    let port = || {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let (rpc, meta) = (port(), port());
    let m = master_on(rpc, meta);
    let c = Client::new(ClientConfig {
        ping_interval: Duration::from_millis(50),
        ..ClientConfig::connect(&m.rpc_addr().to_string(), &m.metadata_url().unwrap(), "tcp")
            .unwrap()
    })
    .unwrap();
    let (id, size) = c.allocate_segment(MIB, "").unwrap();
    assert_eq!(size, 4 * MIB);
    assert_eq!(segments(&m), 1);
    drop(m);
    let m = master_on(rpc, meta);
    let deadline = Instant::now() + Duration::from_secs(20);
    while segments(&m) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(segments(&m), 1, "the client mounted it again");
    let cfg = ReplicateConfig::default();
    c.put("after", &value(11, 5000), &cfg).unwrap();
    assert_eq!(c.get("after").unwrap(), value(11, 5000));
    c.unmount_segment(&id, Backing::Allocated, Duration::ZERO)
        .unwrap();
    assert_eq!(segments(&m), 0);
}
