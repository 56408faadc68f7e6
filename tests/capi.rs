//! The C ABI: shims called straight from Rust (bad input, buffers, notifications),
//! the header checked against the Rust definitions, and C / C++ programs linked
//! against `libmooncake.a` moving data between processes.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod common;

use common::cprog::*;
use mooncake::capi::*;
use mooncake::engine::config::KEYS;
use mooncake::engine::TaskState;
use mooncake::Code;

const INVALID: c_int = Code::InvalidParams as c_int;
/// An engine made through the C ABI, freed on drop.
struct Handle(*mut McEngine);

impl Handle {
    fn new(settings: &[(&CStr, &CStr)]) -> Handle {
        let cfg = mc_config_new();
        assert!(!cfg.is_null());
        for (k, v) in settings {
            // SAFETY: `cfg` is live; keys and values are NUL-terminated literals.
            let rc = unsafe { mc_config_set(cfg, k.as_ptr(), v.as_ptr()) };
            assert_eq!(rc, MC_OK, "setting {k:?} = {v:?}");
        }
        let mut e = std::ptr::null_mut();
        // SAFETY: `cfg` is live and `e` writable.
        let rc = unsafe { mc_engine_new(cfg, &mut e) };
        // SAFETY: `cfg` came from mc_config_new and is not used again.
        unsafe { mc_config_free(cfg) };
        assert_eq!(rc, MC_OK);
        assert!(!e.is_null());
        Handle(e)
    }

    fn tcp() -> Handle {
        Handle::new(&[(c"protocol", c"tcp"), (c"bind_address", c"127.0.0.1")])
    }

    fn name(&self) -> String {
        let mut buf = [0 as c_char; 256];
        // SAFETY: live engine; `buf` is writable for its length.
        let rc = unsafe { mc_engine_segment_name(self.0, buf.as_mut_ptr(), buf.len()) };
        assert_eq!(rc, MC_OK);
        // SAFETY: on success the buffer holds a NUL-terminated string.
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_str()
            .unwrap()
            .to_owned()
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: from mc_engine_new, freed once, no call in progress.
        unsafe { mc_engine_free(self.0) };
    }
}

#[test]
fn null_pointers_and_bad_input_are_refused() {
    quiet_logs();
    let null_e: *mut McEngine = std::ptr::null_mut();
    let mut u = 0u64;
    let mut byte = 0u8;
    let p = (&mut byte as *mut u8).cast::<c_void>();
    let mut text = [0 as c_char; 64];
    let mut st = McTaskStatus::default();
    let non_utf8 = c"\xff\xfe".as_ptr();
    // SAFETY: every pointer is NULL, a live engine, or valid for the lengths given.
    unsafe {
        assert_eq!(
            mc_engine_new(std::ptr::null(), std::ptr::null_mut()),
            INVALID
        );
        assert_eq!(
            mc_engine_segment_name(null_e, text.as_mut_ptr(), 64),
            INVALID
        );
        assert_eq!(mc_register_memory(null_e, p, 1, std::ptr::null()), INVALID);
        assert_eq!(mc_unregister_memory(null_e, p), INVALID);
        let mut out: *mut c_void = std::ptr::null_mut();
        assert_eq!(
            mc_allocate_buffer(null_e, 8, std::ptr::null(), &mut out),
            INVALID
        );
        assert_eq!(mc_free_buffer(null_e, p), INVALID);
        assert_eq!(mc_open_segment(null_e, c"x".as_ptr(), &mut u), INVALID);
        assert_eq!(mc_resync_segment(null_e, 1), INVALID);
        assert_eq!(mc_batch_new(null_e, 1, &mut u), INVALID);
        assert_eq!(mc_submit(null_e, 1, std::ptr::null(), 0), INVALID);
        assert_eq!(mc_task_status(null_e, 1, 0, &mut st), INVALID);
        assert_eq!(mc_batch_wait(null_e, 1, 0), INVALID);
        assert_eq!(mc_batch_free(null_e, 1), INVALID);
        assert_eq!(mc_notify(null_e, 1, c"m".as_ptr()), INVALID);
        let t = text.as_mut_ptr();
        assert_eq!(mc_take_notification(null_e, t, 64, t, 64), INVALID);
        assert_eq!(mc_probe(null_e, 1), INVALID);
        mc_engine_free(null_e);

        // Configs.
        let cfg = mc_config_new();
        assert!(!cfg.is_null());
        let key = c"workers".as_ptr();
        assert_eq!(
            mc_config_set(std::ptr::null_mut(), key, c"2".as_ptr()),
            INVALID
        );
        assert_eq!(mc_config_set(cfg, std::ptr::null(), c"2".as_ptr()), INVALID);
        assert_eq!(mc_config_set(cfg, key, std::ptr::null()), INVALID);
        assert_eq!(mc_config_set(cfg, non_utf8, c"2".as_ptr()), INVALID);
        assert_eq!(mc_config_set(cfg, key, non_utf8), INVALID);
        assert_eq!(
            mc_config_set(cfg, c"no_such_key".as_ptr(), c"1".as_ptr()),
            INVALID
        );
        assert_eq!(mc_config_set(cfg, key, c"0".as_ptr()), INVALID);
        assert_eq!(mc_config_set(cfg, key, c"2".as_ptr()), MC_OK);
        assert_eq!(
            mc_config_set(cfg, c"protocol".as_ptr(), c"carrier-pigeon".as_ptr()),
            INVALID
        );
        // Hardware protocols are settings like any other; what an engine does without
        // their backend (TCP, or a refusal when strict) is tests/protocol_fallback.rs.
        for hardware in [c"nvlink", c"rdma", c"efa"] {
            assert_eq!(
                mc_config_set(cfg, c"protocol".as_ptr(), hardware.as_ptr()),
                MC_OK
            );
        }
        assert_eq!(
            mc_config_set(cfg, c"protocol".as_ptr(), c"tcp".as_ptr()),
            MC_OK
        );
        mc_config_free(cfg);
        mc_config_free(std::ptr::null_mut());
    }

    let h = Handle::tcp();
    let e = h.0;
    let name = h.name();
    // SAFETY: as above; `e` stays live until `h` drops at the end.
    unsafe {
        // Segment name: too small → overflow with an emptied buffer; exact fit works.
        text[0] = b'x' as c_char;
        let t = text.as_mut_ptr();
        let code = mc_engine_segment_name(e, t, name.len());
        assert_eq!(code, Code::BufferOverflow as c_int);
        assert_eq!(text[0], 0, "buffer left empty");
        assert_eq!(
            mc_engine_segment_name(e, t, 0),
            Code::BufferOverflow as c_int
        );
        assert_eq!(mc_engine_segment_name(e, std::ptr::null_mut(), 64), INVALID);
        assert_eq!(mc_engine_segment_name(e, t, name.len() + 1), MC_OK);
        assert_eq!(CStr::from_ptr(t).to_str().unwrap(), name);

        // Registration.
        assert_eq!(
            mc_register_memory(e, std::ptr::null_mut(), 1, std::ptr::null()),
            INVALID
        );
        assert_eq!(mc_register_memory(e, p, 0, std::ptr::null()), INVALID);
        assert_eq!(mc_register_memory(e, p, 1, non_utf8), INVALID);
        assert_eq!(mc_unregister_memory(e, std::ptr::null_mut()), INVALID);
        let unknown = Code::AddressNotRegistered as c_int;
        assert_eq!(mc_unregister_memory(e, p), unknown);

        // Engine-owned buffers.
        let mut out: *mut c_void = std::ptr::null_mut();
        assert_eq!(
            mc_allocate_buffer(e, 0, std::ptr::null(), &mut out),
            INVALID
        );
        assert_eq!(
            mc_allocate_buffer(e, 8, std::ptr::null(), std::ptr::null_mut()),
            INVALID
        );
        assert_eq!(
            mc_allocate_buffer(e, 1 << 16, c"cpu:0".as_ptr(), &mut out),
            MC_OK
        );
        assert!(!out.is_null());
        let overlap = Code::AddressOverlap as c_int;
        assert_eq!(mc_register_memory(e, out, 8, std::ptr::null()), overlap);
        assert_eq!(mc_free_buffer(e, p), INVALID, "not from mc_allocate_buffer");
        assert_eq!(mc_free_buffer(e, out), MC_OK);
        assert_eq!(mc_free_buffer(e, out), INVALID, "already freed");

        // Segments.
        assert_eq!(mc_open_segment(e, std::ptr::null(), &mut u), INVALID);
        assert_eq!(mc_open_segment(e, non_utf8, &mut u), INVALID);
        assert_eq!(mc_open_segment(e, t, std::ptr::null_mut()), INVALID);
        let mut seg = 0u64;
        assert_eq!(mc_open_segment(e, t, &mut seg), MC_OK, "own segment opens");
        let missing = Code::SegmentNotFound as c_int;
        assert_eq!(mc_probe(e, seg + 1000), missing);
        assert_eq!(mc_resync_segment(e, seg + 1000), missing);
        assert_eq!(mc_notify(e, seg, std::ptr::null()), INVALID);
        assert_eq!(mc_notify(e, seg, non_utf8), INVALID);

        // Batches and requests.
        assert_eq!(mc_batch_new(e, 4, std::ptr::null_mut()), INVALID);
        assert_eq!(mc_batch_new(e, 0, &mut u), INVALID);
        let mut batch = 0u64;
        assert_eq!(mc_batch_new(e, 4, &mut batch), MC_OK);
        let req = McRequest {
            op: 7,
            local: p,
            segment: seg,
            remote_addr: p as u64,
            len: 1,
        };
        assert_eq!(mc_submit(e, batch, &req, 1), INVALID, "op 7");
        assert_eq!(mc_submit(e, batch, std::ptr::null(), 1), INVALID);
        assert_eq!(
            mc_submit(e, batch, std::ptr::null(), 0),
            MC_OK,
            "nothing to submit"
        );
        let no_batch = Code::BatchNotFound as c_int;
        assert_eq!(mc_submit(e, batch + 1, std::ptr::null(), 0), no_batch);
        assert_eq!(mc_task_status(e, batch, 0, std::ptr::null_mut()), INVALID);
        assert_eq!(
            mc_task_status(e, batch, 0, &mut st),
            INVALID,
            "task 0 unsubmitted"
        );
        assert_eq!(mc_batch_wait(e, batch + 1, 0), no_batch);
        assert_eq!(mc_batch_wait(e, batch, -1), MC_OK, "empty batch");
        assert_eq!(mc_batch_free(e, batch + 1), no_batch);
        assert_eq!(mc_batch_free(e, batch), MC_OK);
        assert_eq!(mc_batch_free(e, batch), no_batch, "freed twice");

        // Notifications.
        let null = std::ptr::null_mut();
        assert_eq!(mc_take_notification(e, null, 64, t, 64), INVALID);
        assert_eq!(mc_take_notification(e, t, 64, null, 64), INVALID);
        assert_eq!(
            mc_take_notification(e, t, 32, t.add(32), 32),
            0,
            "none queued"
        );
    }
}

#[test]
fn host_memory_pair_hands_out_zeroed_pages_and_ignores_foreign_frees() {
    assert!(mc_host_memory_alloc(0).is_null());
    let len = (2 << 20) + 3;
    let ptr = mc_host_memory_alloc(len).cast::<u8>();
    assert!(!ptr.is_null() && ptr as usize % 4096 == 0);
    // SAFETY: `ptr` holds `len` bytes until the free below.
    let bytes = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
    assert!(bytes.iter().all(|&b| b == 0));
    bytes[len - 1] = 7;
    let mut foreign = vec![1u8; 64];
    // SAFETY: each address is either ours (freed once) or NULL or foreign: all allowed.
    unsafe {
        mc_host_memory_free(foreign.as_mut_ptr().cast());
        mc_host_memory_free(std::ptr::null_mut());
        mc_host_memory_free(ptr.cast());
        mc_host_memory_free(ptr.cast()); // a second free of it is ignored too
    }
    assert_eq!(foreign, vec![1u8; 64]);
}

#[test]
fn error_strings_cover_every_code() {
    quiet_logs();
    let text = |c: c_int| {
        let p = mc_error_string(c);
        assert!(!p.is_null());
        // SAFETY: mc_error_string returns static NUL-terminated strings.
        unsafe { CStr::from_ptr(p) }.to_str().unwrap()
    };
    assert_eq!(text(0), "success");
    for c in Code::ALL {
        assert_eq!(text(c as c_int), c.describe());
    }
    for c in [1, -2, -1211, i32::MIN, i32::MAX] {
        assert_eq!(text(c), "unknown error");
    }
    assert_eq!(mc_abi_version(), MC_ABI_VERSION);
}

#[test]
fn struct_layouts_match_the_header() {
    quiet_logs();
    use std::mem::{align_of, offset_of, size_of};
    if size_of::<usize>() == 8 {
        assert_eq!(size_of::<McRequest>(), 40);
        assert_eq!(
            [
                offset_of!(McRequest, local),
                offset_of!(McRequest, segment),
                offset_of!(McRequest, remote_addr),
                offset_of!(McRequest, len),
            ],
            [8, 16, 24, 32]
        );
        assert_eq!(size_of::<McTaskStatus>(), 16);
        assert_eq!(offset_of!(McTaskStatus, bytes), 8);
    }
    assert_eq!(
        align_of::<McRequest>(),
        align_of::<u64>().max(align_of::<*mut u8>())
    );
}

/// `NAME = VALUE` pairs of `enum mc_error` and `#define NAME VALUE` lines.
fn header_constants(header: &str) -> HashMap<String, i64> {
    let mut out = HashMap::new();
    for line in header.lines() {
        let code = line.split("/*").next().unwrap_or("").trim();
        let (name, value) = if let Some(rest) = code.strip_prefix("#define ") {
            match rest.split_once(char::is_whitespace) {
                Some((n, v)) => (n, v),
                None => continue,
            }
        } else if let Some((n, v)) = code.split_once('=') {
            (n, v)
        } else {
            continue;
        };
        let name = name.trim();
        if let (true, Ok(v)) = (
            name.starts_with("MC_"),
            value.trim().trim_end_matches(',').trim().parse::<i64>(),
        ) {
            assert!(
                out.insert(name.to_owned(), v).is_none(),
                "{name} defined twice"
            );
        }
    }
    out
}

/// `AddressNotRegistered` → `ADDRESS_NOT_REGISTERED`.
fn screaming(camel: &str) -> String {
    let mut s = String::new();
    for (i, ch) in camel.chars().enumerate() {
        if ch.is_uppercase() && i > 0 {
            s.push('_');
        }
        s.push(ch.to_ascii_uppercase());
    }
    s
}

#[test]
fn header_matches_the_rust_definitions() {
    quiet_logs();
    let header = std::fs::read_to_string(header_path().join("mooncake.h")).unwrap();
    let consts = header_constants(&header);
    assert_eq!(consts.get("MC_OK"), Some(&0));
    for c in Code::ALL {
        let name = format!("MC_ERR_{}", screaming(&format!("{c:?}")));
        assert_eq!(consts.get(&name), Some(&(c as i64)), "{name} in mooncake.h");
    }
    let errors = consts.keys().filter(|k| k.starts_with("MC_ERR_")).count();
    assert_eq!(
        errors,
        Code::ALL.len(),
        "mooncake.h lists no extra error codes"
    );
    assert_eq!(
        consts.get("MC_ABI_VERSION"),
        Some(&(mc_abi_version() as i64))
    );
    assert_eq!(
        consts.get("MC_ABI_REVISION"),
        Some(&(mc_abi_revision() as i64))
    );
    // The release macros are the crate's version, and mc_version() says the same.
    for (name, part) in [
        ("MC_VERSION_MAJOR", env!("CARGO_PKG_VERSION_MAJOR")),
        ("MC_VERSION_MINOR", env!("CARGO_PKG_VERSION_MINOR")),
        ("MC_VERSION_PATCH", env!("CARGO_PKG_VERSION_PATCH")),
    ] {
        assert_eq!(
            consts.get(name).map(i64::to_string).as_deref(),
            Some(part),
            "{name} in mooncake.h"
        );
    }
    let version = format!(
        "#define MC_VERSION_STRING \"{}\"",
        env!("CARGO_PKG_VERSION")
    );
    assert!(header.contains(&version), "{version} in mooncake.h");
    // SAFETY: mc_version returns a static NUL-terminated string.
    let loaded = unsafe { CStr::from_ptr(mc_version()) };
    assert_eq!(loaded.to_str(), Ok(env!("CARGO_PKG_VERSION")));
    assert!(header.contains("const char *mc_version(void);"));
    let pc = std::fs::read_to_string(header_path().join("mooncake.pc.in")).unwrap();
    let line = format!("Version: {}", env!("CARGO_PKG_VERSION"));
    assert!(pc.lines().any(|l| l == line), "{line} in mooncake.pc.in");
    assert_eq!(consts.get("MC_OP_READ"), Some(&(MC_OP_READ as i64)));
    assert_eq!(consts.get("MC_OP_WRITE"), Some(&(MC_OP_WRITE as i64)));
    let states = [
        TaskState::Waiting,
        TaskState::Pending,
        TaskState::Invalid,
        TaskState::Canceled,
        TaskState::Completed,
        TaskState::Timeout,
        TaskState::Failed,
    ];
    for s in states {
        let name = format!("MC_TASK_{}", screaming(&format!("{s:?}")));
        assert_eq!(consts.get(&name), Some(&(s as i64)), "{name} in mooncake.h");
    }
    for key in KEYS {
        assert!(
            header.contains(&format!(" {key} ")),
            "config key {key} documented"
        );
    }
}

/// Two engines in one process through the C ABI: transfers from several threads on
/// one engine, and notifications that survive a too-small buffer.
#[test]
fn transfers_and_notifications_through_the_abi() {
    quiet_logs();
    let server = Handle::tcp();
    let client = Handle::tcp();
    let len = (1 << 20) + 7;
    let mut remote: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let server_name = std::ffi::CString::new(server.name()).unwrap();
    let (s, c) = (server.0, client.0);
    let mut seg = 0u64;
    // SAFETY: live engines; `remote` outlives its registration (unregistered below).
    unsafe {
        let addr = remote.as_mut_ptr().cast::<c_void>();
        assert_eq!(mc_register_memory(s, addr, len, c"cpu:0".as_ptr()), MC_OK);
        assert_eq!(mc_open_segment(c, server_name.as_ptr(), &mut seg), MC_OK);
        assert_eq!(mc_probe(c, seg), MC_OK);
    }
    let remote_addr = remote.as_ptr() as u64;
    let engine = c as usize;
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            std::thread::spawn(move || {
                let e = engine as *mut McEngine;
                let off = t * 1000;
                let mut local = vec![0u8; 4096];
                let mut batch = 0u64;
                let req = McRequest {
                    op: MC_OP_READ,
                    local: local.as_mut_ptr().cast(),
                    segment: seg,
                    remote_addr: remote_addr + off,
                    len: 4096,
                };
                let mut st = McTaskStatus::default();
                // SAFETY: the engine outlives the threads (joined below); `local` lives
                // until after the wait.
                unsafe {
                    assert_eq!(mc_batch_new(e, 1, &mut batch), MC_OK);
                    assert_eq!(mc_submit(e, batch, &req, 1), MC_OK);
                    assert_eq!(mc_submit(e, batch, &req, 1), Code::BatchFull as c_int);
                    assert_eq!(mc_batch_wait(e, batch, 60_000), MC_OK);
                    assert_eq!(mc_task_status(e, batch, 0, &mut st), MC_OK);
                    assert_eq!(mc_batch_free(e, batch), MC_OK);
                }
                assert_eq!(st.state, TaskState::Completed as c_int);
                assert_eq!(st.bytes, 4096);
                let want: Vec<u8> = (off..off + 4096).map(|i| (i % 251) as u8).collect();
                assert!(local == want, "thread {t} read the right bytes");
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // Our own key's "tcp" keeps even a same-host peer on sockets.
    let stats = engine_stats(c);
    let count = |k: &str| stats.get(k).and_then(|v| v.as_u64());
    assert_eq!(count("tcp_bytes"), Some(4 * 4096), "{stats:?}");
    assert_eq!(count("shm_bytes"), Some(0), "{stats:?}");
    assert_eq!(stats.get("protocol").and_then(|p| p.as_str()), Some("tcp"));
    assert_eq!(
        stats.get("same_host_shm").and_then(|p| p.as_bool()),
        Some(false)
    );

    let mut from = [0 as c_char; 128];
    let mut msg = [0 as c_char; 128];
    let (f, m) = (from.as_mut_ptr(), msg.as_mut_ptr());
    // SAFETY: live engines; the buffers are writable for the lengths given.
    unsafe {
        assert_eq!(mc_notify(c, seg, c"first".as_ptr()), MC_OK);
        assert_eq!(mc_notify(c, seg, c"second".as_ptr()), MC_OK);
        let overflow = Code::BufferOverflow as c_int;
        assert_eq!(
            mc_take_notification(s, f, 128, m, 5),
            overflow,
            "'first' needs 6"
        );
        assert_eq!(mc_take_notification(s, f, 1, m, 128), overflow);
        assert_eq!(mc_take_notification(s, f, 128, m, 6), 1);
        assert_eq!(CStr::from_ptr(m).to_str().unwrap(), "first");
        assert_eq!(CStr::from_ptr(f).to_string_lossy(), client.name());
        assert_eq!(mc_take_notification(s, f, 128, m, 128), 1);
        assert_eq!(CStr::from_ptr(m).to_str().unwrap(), "second");
        assert_eq!(mc_take_notification(s, f, 128, m, 128), 0);
        let addr = remote.as_mut_ptr().cast::<c_void>();
        assert_eq!(mc_unregister_memory(s, addr), MC_OK);
    }
}

/// `mc_engine_stats` as parsed JSON, after checking its overflow contract.
fn engine_stats(e: *mut McEngine) -> mooncake::json::Value {
    let mut needed = 0usize;
    let mut small = [0 as c_char; 8];
    // SAFETY: a live engine; the buffers are writable for the lengths given.
    unsafe {
        let rc = mc_engine_stats(e, small.as_mut_ptr(), small.len(), &mut needed);
        assert_eq!(rc, Code::BufferOverflow as c_int);
        assert_eq!(small[0], 0, "an overflow leaves an empty string");
        assert_eq!(
            mc_engine_stats(std::ptr::null_mut(), small.as_mut_ptr(), 8, &mut needed),
            INVALID
        );
    }
    let mut buf = vec![0 as c_char; needed];
    // SAFETY: as above.
    let rc = unsafe { mc_engine_stats(e, buf.as_mut_ptr(), buf.len(), std::ptr::null_mut()) };
    assert_eq!(rc, MC_OK);
    // SAFETY: NUL-terminated on success.
    let text = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap();
    mooncake::json::parse(text).unwrap()
}

// ---------------------------------------------------------------- C and C++ programs

/// Starts `target` from one program, runs `client` from another against it, and
/// checks both exit 0 and that the target received the client's notification.
fn pair(target: &(String, PathBuf), client: &(String, PathBuf), size: u64) {
    let label = format!("{} target / {} client", target.0, client.0);
    let mut t = Proc::spawn(
        &format!("{} target", target.0),
        Command::new(&target.1)
            .args(["target", &size.to_string()])
            .stdin(Stdio::piped()),
    );
    let Some(ready) = t.line(LIMIT) else {
        let out = t.finish(LIMIT);
        panic!("{label}: no ready line ({:?}):\n{}", out.status, out.stderr);
    };
    let fields: Vec<&str> = ready.split_whitespace().collect();
    let [_, name, addr] = fields[..] else {
        panic!("{label}: bad ready line {ready:?}");
    };
    assert_eq!(fields[0], "ready", "{label}");

    let mut c = Proc::spawn(
        &format!("{} client", client.0),
        Command::new(&client.1)
            .args(["client", name, addr, &size.to_string()])
            .stdin(Stdio::null()),
    );
    let out = c.finish(LIMIT);
    assert!(
        out.status.success(),
        "{label}: client {:?}\nstdout: {:?}\nstderr:\n{}",
        out.status,
        out.stdout,
        out.stderr
    );

    let out = t.finish(LIMIT);
    assert!(
        out.status.success(),
        "{label}: target {:?}\nstdout: {:?}\nstderr:\n{}",
        out.status,
        out.stdout,
        out.stderr
    );
    let note = format!(" hello from {}", client.0);
    assert!(
        out.stdout
            .iter()
            .any(|l| l.starts_with("notified ") && l.ends_with(&note)),
        "{label}: target got the notification: {:?}",
        out.stdout
    );
}

#[test]
fn c_and_cpp_programs_transfer_between_processes() {
    quiet_logs();
    if !have("cc") {
        eprintln!("skipping: no C compiler `cc` on PATH");
        return;
    }
    let lib = static_lib().expect("cargo builds libmooncake.a along with the library");
    let mut programs = Vec::new();
    let c_bin = program("cc", "-std=c99", "transfer.c", &lib);
    programs.push(("C".to_owned(), c_bin));
    if have("c++") {
        let cpp_bin = program("c++", "-std=c++17", "transfer.cpp", &lib);
        programs.push(("C++".to_owned(), cpp_bin));
    } else {
        eprintln!("skipping the C++ program: no `c++` on PATH");
    }

    // Larger than one 4 MiB slice, odd so the halves are uneven.
    let size = (5 << 20) + 12_345;
    for target in &programs {
        for client in &programs {
            pair(target, client, size);
        }
    }
}

/// The README's C example is a whole function that compiles, strictly warned, against
/// the header: a newcomer can paste it.
#[test]
fn the_readme_c_example_compiles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let section = &readme[readme.find("## Using it from C and C++").unwrap()..];
    let start = section.find("```c\n").unwrap() + 5;
    let snippet = &section[start..start + section[start..].find("```").unwrap()];
    let dir = build_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("readme_example.c");
    std::fs::write(&src, snippet).unwrap();
    let out = Command::new("cc")
        .args([
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fsyntax-only",
            "-I",
        ])
        .arg(header_path())
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
