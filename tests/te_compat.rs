//! Mooncake's own C API (`c_include/transfer_engine_c.h`): the header checked against
//! the Rust definitions, the shims called from Rust (bad input, a metadata server,
//! lazily started engines), and a C program written against that header only, linked
//! with `libmooncake.a`, moving bytes to and from a `mooncake target` process.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::process::Command;
use std::time::Instant;

mod common;

use common::cprog::*;
use common::Target;
use mooncake::capi::*;
use mooncake::engine::TaskState;
use mooncake::metadata::http_server::MetadataServer;
use mooncake::util::crc32c::crc32c;

/// `NAME -> VALUE` of every `#define NAME VALUE` line (VALUE with its parentheses and
/// any trailing comment removed).
fn header_defines(header: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for line in header.lines() {
        let code = line.split("/*").next().unwrap_or("").trim();
        let Some(rest) = code.strip_prefix("#define ") else {
            continue;
        };
        let Some((name, value)) = rest.split_once(char::is_whitespace) else {
            continue;
        };
        let value = value.trim().trim_start_matches('(').trim_end_matches(')');
        assert!(
            out.insert(name.to_owned(), value.trim().to_owned())
                .is_none(),
            "{name} defined twice"
        );
    }
    out
}

#[test]
fn header_matches_the_rust_definitions() {
    quiet_logs();
    let header = std::fs::read_to_string(header_path().join("transfer_engine_c.h")).unwrap();
    let defines = header_defines(&header);
    let number = |name: &str| -> i64 {
        defines
            .get(name)
            .unwrap_or_else(|| panic!("{name} not in transfer_engine_c.h"))
            .parse()
            .unwrap_or_else(|_| panic!("{name} is not a number"))
    };
    let expected: &[(&str, i64)] = &[
        ("OPCODE_READ", OPCODE_READ.into()),
        ("OPCODE_WRITE", OPCODE_WRITE.into()),
        ("LOCAL_SEGMENT", LOCAL_SEGMENT.into()),
        ("STATUS_WAITING", STATUS_WAITING.into()),
        ("STATUS_PENDING", STATUS_PENDING.into()),
        ("STATUS_INVALID", STATUS_INVALID.into()),
        ("STATUS_CANCELED", STATUS_CANCELED.into()),
        ("STATUS_COMPLETED", STATUS_COMPLETED.into()),
        ("STATUS_TIMEOUT", STATUS_TIMEOUT.into()),
        ("STATUS_FAILED", STATUS_FAILED.into()),
        ("ERR_INVALID_ARGUMENT", ERR_INVALID_ARGUMENT.into()),
        ("ERR_TOO_MANY_REQUESTS", ERR_TOO_MANY_REQUESTS.into()),
        (
            "ERR_ADDRESS_NOT_REGISTERED",
            ERR_ADDRESS_NOT_REGISTERED.into(),
        ),
        ("ERR_BATCH_BUSY", ERR_BATCH_BUSY.into()),
        ("ERR_DEVICE_NOT_FOUND", ERR_DEVICE_NOT_FOUND.into()),
        ("ERR_ADDRESS_OVERLAPPED", ERR_ADDRESS_OVERLAPPED.into()),
        (
            "ERR_NOT_LOCAL_SEGMENT_OR_SHM",
            ERR_NOT_LOCAL_SEGMENT_OR_SHM.into(),
        ),
        ("ERR_DNS", ERR_DNS.into()),
        ("ERR_SOCKET", ERR_SOCKET.into()),
        ("ERR_MALFORMED_JSON", ERR_MALFORMED_JSON.into()),
        ("ERR_REJECT_HANDSHAKE", ERR_REJECT_HANDSHAKE.into()),
        ("ERR_METADATA", ERR_METADATA.into()),
        ("ERR_ENDPOINT", ERR_ENDPOINT.into()),
        ("ERR_CONTEXT", ERR_CONTEXT.into()),
        ("ERR_NUMA", ERR_NUMA.into()),
        ("ERR_CLOCK", ERR_CLOCK.into()),
        ("ERR_MEMORY", ERR_MEMORY.into()),
        ("ERR_NOT_IMPLEMENTED", ERR_NOT_IMPLEMENTED.into()),
    ];
    for (name, value) in expected {
        assert_eq!(number(name), *value, "{name} in transfer_engine_c.h");
    }
    // Upstream's numbers, independently of the Rust constants.
    assert_eq!(
        [number("ERR_INVALID_ARGUMENT"), number("ERR_BATCH_BUSY")],
        [-1, -4]
    );
    assert_eq!(
        [number("ERR_METADATA"), number("ERR_NOT_IMPLEMENTED")],
        [-200, -303]
    );
    let errors = defines.keys().filter(|k| k.starts_with("ERR_")).count();
    let statuses = defines.keys().filter(|k| k.starts_with("STATUS_")).count();
    assert_eq!(errors, 18, "every ERR_ of the header is checked");
    assert_eq!(statuses, 7, "every STATUS_ of the header is checked");
    assert_eq!(defines["INVALID_BATCH"], "UINT64_MAX");
    assert_eq!(INVALID_BATCH, u64::MAX);
    // The task states are the engine's (and mooncake.h's MC_TASK_*).
    for (state, value) in [
        (TaskState::Waiting, STATUS_WAITING),
        (TaskState::Pending, STATUS_PENDING),
        (TaskState::Invalid, STATUS_INVALID),
        (TaskState::Canceled, STATUS_CANCELED),
        (TaskState::Completed, STATUS_COMPLETED),
        (TaskState::Timeout, STATUS_TIMEOUT),
        (TaskState::Failed, STATUS_FAILED),
    ] {
        assert_eq!(state as c_int, value, "{state:?}");
    }
    for typedef in [
        "typedef int32_t segment_id_t;",
        "typedef uint64_t batch_id_t;",
        "typedef void *transfer_engine_t;",
        "typedef void *transport_t;",
    ] {
        assert!(header.contains(typedef), "{typedef}");
    }
    // Every function the header declares is exported under that name (a missing one
    // fails to compile here), with upstream's return types.
    let functions: [(&str, *const ()); 26] = [
        ("createTransferEngine", createTransferEngine as *const ()),
        ("getLocalIpAndPort", getLocalIpAndPort as *const ()),
        ("installTransport", installTransport as *const ()),
        ("uninstallTransport", uninstallTransport as *const ()),
        ("destroyTransferEngine", destroyTransferEngine as *const ()),
        ("openSegment", openSegment as *const ()),
        ("openSegmentNoCache", openSegmentNoCache as *const ()),
        ("closeSegment", closeSegment as *const ()),
        ("removeLocalSegment", removeLocalSegment as *const ()),
        ("syncSegmentCache", syncSegmentCache as *const ()),
        ("registerLocalMemory", registerLocalMemory as *const ()),
        ("unregisterLocalMemory", unregisterLocalMemory as *const ()),
        (
            "registerLocalMemoryBatch",
            registerLocalMemoryBatch as *const (),
        ),
        (
            "unregisterLocalMemoryBatch",
            unregisterLocalMemoryBatch as *const (),
        ),
        ("allocateBatchID", allocateBatchID as *const ()),
        ("submitTransfer", submitTransfer as *const ()),
        (
            "submitTransferWithNotify",
            submitTransferWithNotify as *const (),
        ),
        ("getNotifsFromEngine", getNotifsFromEngine as *const ()),
        ("freeNotifsMsgBuf", freeNotifsMsgBuf as *const ()),
        ("genNotifyInEngine", genNotifyInEngine as *const ()),
        ("getTransferStatus", getTransferStatus as *const ()),
        ("freeBatchID", freeBatchID as *const ()),
        ("discoverTopology", discoverTopology as *const ()),
        (
            "enableGracefulShutdown",
            enableGracefulShutdown as *const (),
        ),
        ("showLinks", showLinks as *const ()),
        ("getNicLoadStats", getNicLoadStats as *const ()),
    ];
    for (name, _) in functions {
        assert!(header.contains(&format!("{name}(")), "{name} declared");
    }
    for signature in [
        "transfer_engine_t createTransferEngine(",
        "segment_id_t openSegment(",
        "segment_id_t openSegmentNoCache(",
        "batch_id_t allocateBatchID(",
        "notify_msg_t *getNotifsFromEngine(",
        "transport_t installTransport(",
        "void destroyTransferEngine(",
        "void enableGracefulShutdown(",
        "int genNotifyInEngine(transfer_engine_t engine, uint64_t target_id,",
    ] {
        assert!(header.contains(signature), "{signature}");
    }
    let declared = header
        .lines()
        .filter(|l| !l.starts_with([' ', '#', '/']) && l.contains('(') && !l.starts_with("extern"))
        .count();
    assert_eq!(
        declared,
        functions.len(),
        "the header declares only the functions checked above"
    );
}

#[test]
fn struct_layouts_match_the_header() {
    use std::mem::{offset_of, size_of};
    if size_of::<usize>() != 8 {
        return;
    }
    assert_eq!(size_of::<TransferRequest>(), 40);
    assert_eq!(
        [
            offset_of!(TransferRequest, opcode),
            offset_of!(TransferRequest, source),
            offset_of!(TransferRequest, target_id),
            offset_of!(TransferRequest, target_offset),
            offset_of!(TransferRequest, length),
        ],
        [0, 8, 16, 24, 32]
    );
    assert_eq!(size_of::<TransferStatus>(), 16);
    assert_eq!(offset_of!(TransferStatus, transferred_bytes), 8);
    assert_eq!(size_of::<NotifyMsg>(), 16);
    assert_eq!(offset_of!(NotifyMsg, msg), 8);
    assert_eq!(size_of::<BufferEntry>(), 16);
    assert_eq!(offset_of!(BufferEntry, length), 8);
}

#[test]
fn null_and_bad_arguments_are_refused() {
    quiet_logs();
    let null: *mut TeEngine = std::ptr::null_mut();
    let mut byte = 0u8;
    let p = (&mut byte as *mut u8).cast::<c_void>();
    let mut text = [0 as c_char; 256];
    let mut st = TransferStatus::default();
    let mut n: c_int = 7;
    let note = NotifyMsg {
        name: std::ptr::null_mut(),
        msg: c"m".as_ptr().cast_mut(),
    };
    let invalid = ERR_INVALID_ARGUMENT;
    let invalid_status = -ERR_INVALID_ARGUMENT;
    let t = text.as_mut_ptr();
    // SAFETY: every pointer is NULL or valid for the lengths given.
    unsafe {
        let host = c"127.0.0.1".as_ptr();
        assert!(createTransferEngine(std::ptr::null(), std::ptr::null(), host, 0, 0).is_null());
        assert!(createTransferEngine(c"".as_ptr(), std::ptr::null(), host, 0, 0).is_null());
        let non_utf8 = c"\xff".as_ptr();
        assert!(createTransferEngine(non_utf8, std::ptr::null(), host, 0, 0).is_null());
        let p2p = c"P2PHANDSHAKE".as_ptr();
        assert!(createTransferEngine(p2p, std::ptr::null(), c"::".as_ptr(), 0, 0).is_null());
        assert!(createTransferEngine(p2p, std::ptr::null(), host, 1 << 16, 0).is_null());
        let reserved = c"P2PHANDSHAKE;bind_address=127.0.0.1".as_ptr();
        assert!(createTransferEngine(reserved, std::ptr::null(), host, 0, 0).is_null());
        let unknown = c"P2PHANDSHAKE;protocol=carrier-pigeon".as_ptr();
        assert!(createTransferEngine(unknown, std::ptr::null(), host, 0, 0).is_null());

        assert_eq!(getLocalIpAndPort(null, t, 64), invalid);
        assert!(installTransport(null, c"tcp".as_ptr(), std::ptr::null_mut()).is_null());
        assert_eq!(uninstallTransport(null, c"tcp".as_ptr()), invalid);
        destroyTransferEngine(null);
        assert_eq!(openSegment(null, c"x".as_ptr()), -1);
        assert_eq!(openSegmentNoCache(null, c"x".as_ptr()), -1);
        assert_eq!(closeSegment(null, 1), invalid);
        assert_eq!(removeLocalSegment(null, c"x".as_ptr()), invalid);
        assert_eq!(syncSegmentCache(null), invalid);
        assert_eq!(
            registerLocalMemory(null, p, 1, std::ptr::null(), 1),
            invalid
        );
        assert_eq!(unregisterLocalMemory(null, p), invalid);
        assert_eq!(
            registerLocalMemoryBatch(null, std::ptr::null_mut(), 0, std::ptr::null()),
            invalid
        );
        assert_eq!(
            unregisterLocalMemoryBatch(null, std::ptr::null_mut(), 0),
            invalid
        );
        assert_eq!(allocateBatchID(null, 1), INVALID_BATCH);
        assert_eq!(
            submitTransfer(null, 1, std::ptr::null_mut(), 0),
            invalid_status
        );
        assert_eq!(
            submitTransferWithNotify(null, 1, std::ptr::null_mut(), 0, note),
            invalid_status
        );
        assert!(getNotifsFromEngine(null, &mut n).is_null());
        assert_eq!(n, 0, "size cleared");
        assert!(getNotifsFromEngine(null, std::ptr::null_mut()).is_null());
        assert_eq!(freeNotifsMsgBuf(std::ptr::null_mut(), 3), 0);
        assert_eq!(genNotifyInEngine(null, 1, note), invalid);
        assert_eq!(getTransferStatus(null, 1, 0, &mut st), invalid_status);
        assert_eq!(freeBatchID(null, 1), invalid_status);
        assert_eq!(discoverTopology(null), invalid);
        enableGracefulShutdown(null);
        assert_eq!(showLinks(null, t, 64, 0), invalid);
        assert_eq!(getNicLoadStats(null, t, 64), invalid);
    }

    // A live engine, never started: argument checks that need no engine come first.
    let metadata = CString::new("P2PHANDSHAKE;protocol=tcp").unwrap();
    // SAFETY: NUL-terminated strings; the engine is destroyed at the end.
    let e = unsafe {
        createTransferEngine(
            metadata.as_ptr(),
            std::ptr::null(),
            c"127.0.0.1".as_ptr(),
            0,
            0,
        )
    };
    assert!(!e.is_null());
    // SAFETY: `e` is live until destroyed below; other pointers as above.
    unsafe {
        assert_eq!(showLinks(e, t, 256, 1), 0);
        let links = CStr::from_ptr(t).to_str().unwrap();
        assert!(links.contains("not started"), "{links}");
        let bad_proto = installTransport(e, c"carrier-pigeon".as_ptr(), std::ptr::null_mut());
        assert!(bad_proto.is_null());
        assert!(installTransport(e, std::ptr::null(), std::ptr::null_mut()).is_null());
        assert_eq!(uninstallTransport(e, c"tcp".as_ptr()), invalid, "none yet");
        assert_eq!(
            getNicLoadStats(e, t, 64),
            ERR_NOT_IMPLEMENTED,
            "no NIC load without RDMA"
        );
        assert_eq!(freeNotifsMsgBuf(std::ptr::null_mut(), -1), 0, "NULL first");
        // The first call that needs the engine starts it with ";protocol=tcp".
        assert_eq!(
            openSegment(e, std::ptr::null()),
            -1,
            "checked before starting"
        );
        assert_eq!(openSegment(e, c"".as_ptr()), -1, "an empty name");
        assert_eq!(showLinks(e, t, 256, 1), 0);
        let links = CStr::from_ptr(t).to_str().unwrap();
        assert!(links.contains(r#""protocol":"tcp""#), "{links}");
        assert!(
            installTransport(e, c"shm".as_ptr(), std::ptr::null_mut()).is_null(),
            "a tcp engine does not carry shm"
        );
        assert!(!installTransport(e, c"tcp".as_ptr(), std::ptr::null_mut()).is_null());

        assert_eq!(registerLocalMemory(e, p, 0, std::ptr::null(), 1), invalid);
        assert_eq!(registerLocalMemory(e, p, 1, c"\xff".as_ptr(), 1), invalid);
        assert_eq!(
            registerLocalMemoryBatch(e, std::ptr::null_mut(), 1, std::ptr::null()),
            invalid
        );
        let mut list = [std::ptr::null_mut::<c_void>()];
        assert_eq!(unregisterLocalMemoryBatch(e, list.as_mut_ptr(), 1), invalid);
        assert_eq!(allocateBatchID(e, (1 << 20) + 1), INVALID_BATCH);
        let batch = allocateBatchID(e, 1);
        assert_ne!(batch, INVALID_BATCH);
        assert_eq!(
            submitTransfer(e, batch, std::ptr::null_mut(), 1),
            invalid_status
        );
        assert_eq!(submitTransfer(e, batch, std::ptr::null_mut(), 0), 0);
        assert_eq!(
            submitTransferWithNotify(e, batch, std::ptr::null_mut(), 0, note),
            invalid_status,
            "a notification needs a request"
        );
        let no_msg = NotifyMsg {
            name: std::ptr::null_mut(),
            msg: std::ptr::null_mut(),
        };
        assert_eq!(genNotifyInEngine(e, 0, no_msg), invalid);
        assert_eq!(genNotifyInEngine(e, 1 << 40, note), invalid);
        assert_eq!(freeBatchID(e, batch), 0);
        destroyTransferEngine(e);
    }
}

/// Polls a task until it is final, failing after `LIMIT`.
fn wait_task(e: *mut TeEngine, batch: u64, task: usize) -> TransferStatus {
    let deadline = Instant::now() + LIMIT;
    loop {
        let mut st = TransferStatus::default();
        // SAFETY: `e` is a live engine; `st` is writable.
        assert_eq!(unsafe { getTransferStatus(e, batch, task, &mut st) }, 0);
        if matches!(
            st.status,
            STATUS_CANCELED | STATUS_COMPLETED | STATUS_TIMEOUT | STATUS_FAILED
        ) {
            return st;
        }
        assert!(Instant::now() < deadline, "task {task} stuck in {st:?}");
        std::thread::yield_now();
    }
}

/// An engine made through `createTransferEngine`, destroyed on drop.
struct Te(*mut TeEngine);

impl Te {
    fn new(metadata: &str, name: &str, auto_discover: c_int) -> Te {
        let metadata = CString::new(metadata).unwrap();
        let name = CString::new(name).unwrap();
        // SAFETY: NUL-terminated strings, not retained.
        let e = unsafe {
            createTransferEngine(
                metadata.as_ptr(),
                name.as_ptr(),
                c"localhost".as_ptr(),
                0,
                auto_discover,
            )
        };
        assert!(!e.is_null(), "createTransferEngine({metadata:?})");
        Te(e)
    }

    fn open(&self, name: &str) -> i32 {
        let name = CString::new(name).unwrap();
        // SAFETY: live engine, NUL-terminated name.
        unsafe { openSegment(self.0, name.as_ptr()) }
    }

    fn address(&self) -> String {
        let mut buf = [0 as c_char; 128];
        assert_eq!(
            // SAFETY: live engine; `buf` is writable for its length.
            unsafe { getLocalIpAndPort(self.0, buf.as_mut_ptr(), buf.len()) },
            0
        );
        // SAFETY: NUL-terminated on success.
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_str()
            .unwrap()
            .to_owned()
    }
}

impl Drop for Te {
    fn drop(&mut self) {
        // SAFETY: from createTransferEngine, destroyed once, no call in progress.
        unsafe { destroyTransferEngine(self.0) };
    }
}

/// installTransport("rdma") where RDMA is unavailable (here: a NIC no host has) starts
/// the engine over TCP, as Mooncake's wheel serves over TCP without RDMA devices;
/// showLinks says what runs. (MC_STRICT_PROTOCOL=1 refusing is tests/protocol_fallback.rs.)
#[test]
fn rdma_without_devices_installs_over_tcp() {
    quiet_logs();
    let e = Te::new("P2PHANDSHAKE;device_name=mc_no_such_nic0", "unused", 0);
    let none = std::ptr::null_mut();
    let mut text = [0 as c_char; 256];
    // SAFETY: a live engine; literal strings; `text` is writable for its length.
    unsafe {
        let rdma = installTransport(e.0, c"rdma".as_ptr(), none);
        assert!(!rdma.is_null(), "rdma falls back rather than failing");
        assert_eq!(installTransport(e.0, c"rdma".as_ptr(), none), rdma);
        assert!(!installTransport(e.0, c"tcp".as_ptr(), none).is_null());
        assert_eq!(showLinks(e.0, text.as_mut_ptr(), text.len(), 1), 0);
        let links = CStr::from_ptr(text.as_ptr()).to_str().unwrap();
        assert!(links.contains(r#""protocol":"tcp""#), "{links}");
        assert_eq!(
            getNicLoadStats(e.0, text.as_mut_ptr(), text.len()),
            ERR_NOT_IMPLEMENTED
        );
    }
    assert!(e.address().starts_with("127.0.0.1:"));
}

/// installTransport("tcp") as the first call starts the engine the way upstream's
/// "tcp" is meant, "no RDMA": TCP that also reaches same-host peers through shared
/// memory (the switch MC_SAME_HOST_SHM=0 is the config's unit test), unless the
/// connection string chose with our own `protocol` key. Asking again, and uninstalling
/// by the same name, still work.
#[test]
fn tcp_installed_first_also_carries_same_host_peers_through_shared_memory() {
    quiet_logs();
    let widened = mooncake::engine::config::same_host_shm_from_env();
    let none = std::ptr::null_mut();
    let mut text = [0 as c_char; 256];
    for (metadata, shm) in [
        ("P2PHANDSHAKE", widened),
        ("P2PHANDSHAKE;protocol=tcp", false),
    ] {
        let e = Te::new(metadata, "unused", 0);
        // SAFETY: a live engine; literal strings; `text` is writable for its length.
        unsafe {
            let tcp = installTransport(e.0, c"tcp".as_ptr(), none);
            assert!(!tcp.is_null());
            assert_eq!(installTransport(e.0, c"tcp".as_ptr(), none), tcp);
            let shm_handle = installTransport(e.0, c"shm".as_ptr(), none);
            assert_eq!(
                !shm_handle.is_null(),
                shm,
                "{metadata}: shm only when carried"
            );
            assert_eq!(showLinks(e.0, text.as_mut_ptr(), text.len(), 1), 0);
            let links = CStr::from_ptr(text.as_ptr()).to_str().unwrap();
            assert!(links.contains(r#""protocol":"tcp""#), "{links}");
            let want = format!(r#""same_host_shm":{shm}"#);
            assert!(links.contains(&want), "{metadata}: {links}");
            assert_eq!(uninstallTransport(e.0, c"tcp".as_ptr()), 0);
        }
    }
}

/// A child forked after an engine started is refused every call on it with the
/// failure value each function has, and destroying it there leaves the parent's engine
/// as it was. (The child only calls the library and leaves with `_exit`.)
#[test]
fn a_forked_child_is_refused_the_parents_engine() {
    quiet_logs();
    let e = Te::new("P2PHANDSHAKE", "unused", 0);
    let none = std::ptr::null_mut();
    // SAFETY: a live engine; literal strings.
    assert!(!unsafe { installTransport(e.0, c"tcp".as_ptr(), none) }.is_null());
    let own = e.address();
    assert!(e.open(&own) >= 0, "the parent opens its own segment");
    // SAFETY: the child makes library calls that take no lock another thread of this
    // test process could hold for them (every handle call is refused first), then _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let mut text = [0 as c_char; 128];
        let mut failures = 0;
        // SAFETY: the inherited handle; `text` is writable for its length.
        unsafe {
            failures += i32::from(!installTransport(e.0, c"tcp".as_ptr(), none).is_null());
            failures += i32::from(e.open(&own) != -1);
            failures +=
                i32::from(getLocalIpAndPort(e.0, text.as_mut_ptr(), text.len()) != ERR_CONTEXT);
            failures += i32::from(allocateBatchID(e.0, 1) != INVALID_BATCH);
            failures += i32::from(freeBatchID(e.0, 1) != -ERR_CONTEXT);
            destroyTransferEngine(e.0);
            libc::_exit(failures);
        }
    }
    let mut status = 0;
    // SAFETY: waits for the child made above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status),
        "the child ended by signal: {status}"
    );
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "calls the child was not refused"
    );
    assert_eq!(e.address(), own, "the parent's engine is untouched");
    assert!(e.open(&own) >= 0);
}

/// Two engines that find each other by name through an HTTP metadata server: the
/// advertised address, a transfer, a named notification, and removal of a segment's
/// records.
#[test]
fn engines_found_through_a_metadata_server() {
    quiet_logs();
    let server = MetadataServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
    let url = server.url();
    // A starts lazily, B at once with a chosen protocol.
    let a = Te::new(&url, "te-node-a", 0);
    let b = Te::new(&format!("{url};protocol=tcp;workers=2"), "te-node-b", 1);
    let b_addr = b.address();
    assert!(b_addr.starts_with("127.0.0.1:"), "{b_addr}");
    assert_ne!(b_addr, "te-node-b");

    let seg_b = a.open("te-node-b");
    assert!(seg_b > 0, "openSegment by name: {seg_b}");
    assert_eq!(a.open("te-node-a"), LOCAL_SEGMENT);
    assert_eq!(a.open("te-node-nobody"), -1);
    assert!(a.address().starts_with("127.0.0.1:"));
    // A started with the default protocol (auto): tcp and shm are carried, rdma not.
    // SAFETY: live engine; literal strings.
    unsafe {
        let none = std::ptr::null_mut();
        assert!(!installTransport(a.0, c"tcp".as_ptr(), none).is_null());
        assert!(!installTransport(a.0, c"shm".as_ptr(), none).is_null());
        assert!(installTransport(a.0, c"rdma".as_ptr(), none).is_null());
    }

    let len = 256 * 1024 + 5;
    let mut target = vec![0u8; len];
    let mut source: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
    // SAFETY: live engines; `target` outlives its registration (unregistered below) and
    // `source` the transfer (waited for below).
    unsafe {
        let t = target.as_mut_ptr().cast::<c_void>();
        assert_eq!(registerLocalMemory(b.0, t, len, c"cpu:0".as_ptr(), 1), 0);
        let batch = allocateBatchID(a.0, 1);
        assert_ne!(batch, INVALID_BATCH);
        let mut req = TransferRequest {
            opcode: OPCODE_WRITE,
            source: source.as_mut_ptr().cast(),
            target_id: seg_b,
            target_offset: target.as_ptr() as u64,
            length: len as u64,
        };
        let note = NotifyMsg {
            name: c"writer".as_ptr().cast_mut(),
            msg: c"done".as_ptr().cast_mut(),
        };
        assert_eq!(submitTransferWithNotify(a.0, batch, &mut req, 1, note), 0);
        // Waited for by freeBatchID alone (busy until the task is final), so no status
        // poll sees the completion: freeBatchID sends the notification.
        let deadline = Instant::now() + LIMIT;
        loop {
            match freeBatchID(a.0, batch) {
                0 => break,
                rc => assert_eq!(rc, -ERR_BATCH_BUSY),
            }
            assert!(Instant::now() < deadline, "batch still busy");
            std::thread::yield_now();
        }
        assert!(target == source, "bytes arrived at B");

        // And back, waiting through status polls.
        let mut back = vec![0u8; len];
        let batch = allocateBatchID(a.0, 1);
        let mut req = TransferRequest {
            opcode: OPCODE_READ,
            source: back.as_mut_ptr().cast(),
            ..req
        };
        assert_eq!(submitTransfer(a.0, batch, &mut req, 1), 0);
        let st = wait_task(a.0, batch, 0);
        assert_eq!(
            (st.status, st.transferred_bytes),
            (STATUS_COMPLETED, len as u64)
        );
        assert_eq!(freeBatchID(a.0, batch), 0);
        assert!(back == source, "bytes read back from B");

        let mut n: c_int = -1;
        let notes = getNotifsFromEngine(b.0, &mut n);
        assert_eq!(n, 1);
        assert!(!notes.is_null());
        assert_eq!(CStr::from_ptr((*notes).name).to_str().unwrap(), "writer");
        assert_eq!(CStr::from_ptr((*notes).msg).to_str().unwrap(), "done");
        assert_eq!(freeNotifsMsgBuf(notes, n), 0);

        // Only what an engine published may be removed by it: A cannot withdraw B.
        assert_eq!(removeLocalSegment(a.0, c"te-node-b".as_ptr()), -1);
        assert!(openSegmentNoCache(a.0, c"te-node-b".as_ptr()) >= 0);
        assert_eq!(removeLocalSegment(b.0, c"te-node-b".as_ptr()), 0);
        assert_eq!(
            openSegmentNoCache(a.0, c"te-node-b".as_ptr()),
            -1,
            "its records are gone"
        );
        assert_eq!(unregisterLocalMemory(b.0, t), 0);
    }
}

/// `registerLocalMemory(..., "*", ...)` asks the GPU drivers (here the fakes of
/// tests/emu) where the memory lives and publishes that location.
#[test]
fn star_location_asks_the_gpu_drivers() {
    quiet_logs();
    if common::fakes::fakes().is_none() {
        return;
    }
    let len = 64 * 1024;
    let dev = mooncake::ffi::cuda::api()
        .unwrap()
        .mem_alloc(0, len)
        .unwrap();
    let mut host = vec![0u8; len];
    let te = Te::new("P2PHANDSHAKE;protocol=tcp", "", 1);
    // SAFETY: live engine; the device memory is never freed (bump allocator) and
    // `host` outlives its registration (unregistered below).
    unsafe {
        let star = c"*".as_ptr();
        assert_eq!(
            registerLocalMemory(te.0, dev as *mut c_void, len, star, 1),
            0
        );
        let h = host.as_mut_ptr().cast::<c_void>();
        assert_eq!(registerLocalMemory(te.0, h, len, star, 1), 0);
    }
    let probe = common::engine_with("P2PHANDSHAKE", "tcp");
    let seg = probe.open_segment(&te.address()).unwrap();
    let desc = probe.segment_descriptor(seg).unwrap();
    let location = |addr: u64| desc.buffer_for(addr, 1).map(|b| b.name.clone());
    assert_eq!(location(dev).as_deref(), Some("cuda:0"));
    assert_eq!(location(host.as_ptr() as u64).as_deref(), Some("cpu:0"));
    // SAFETY: as above.
    unsafe {
        assert_eq!(unregisterLocalMemory(te.0, dev as *mut c_void), 0);
        assert_eq!(unregisterLocalMemory(te.0, host.as_mut_ptr().cast()), 0);
    }
}

/// The header also compiles as C++ (declarations only).
fn cpp_accepts_the_header() {
    use std::io::Write;
    use std::process::Stdio;
    let mut cpp = Command::new("c++")
        .args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .args(["-fsyntax-only", "-x", "c++", "-I"])
        .arg(header_path())
        .arg("-")
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running c++");
    let source = "#include <transfer_engine_c.h>\n\
                  static_assert(sizeof(transfer_request_t) == 40 || sizeof(void *) != 8, \"layout\");\n\
                  int main() { return OPCODE_WRITE - 1; }\n";
    cpp.stdin
        .take()
        .expect("piped stdin")
        .write_all(source.as_bytes())
        .expect("writing to c++");
    let out = cpp.wait_with_output().expect("waiting for c++");
    assert!(
        out.status.success(),
        "c++ rejects transfer_engine_c.h:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The byte pattern of `tests/c/te_compat.c`.
fn c_pattern(seed: u64, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 131 + seed * 71 + (i >> 9)) & 0xff) as u8)
        .collect()
}

#[test]
fn c_program_moves_bytes_and_notifications() {
    quiet_logs();
    if !have("cc") {
        eprintln!("skipping: no C compiler `cc` on PATH");
        return;
    }
    let lib = static_lib().expect("cargo builds libmooncake.a along with the library");
    let bin = program("cc", "-std=c99", "te_compat.c", &lib);
    if have("c++") {
        cpp_accepts_the_header();
    }

    // Larger than one 4 MiB slice, odd so the halves are uneven.
    let size: u64 = (5 << 20) + 12_345;
    let mut target = Target::spawn("P2PHANDSHAKE", size as usize);
    // Where the target's buffer is: what an application learns out of band.
    let probe = common::engine_with("P2PHANDSHAKE", "tcp");
    let seg = probe.open_segment(&target.name).unwrap();
    let desc = probe.segment_descriptor(seg).unwrap();
    assert_eq!(desc.buffers.len(), 1);
    let addr = desc.buffers[0].addr;
    drop(probe);

    let mut c = Proc::spawn(
        "te_compat.c",
        Command::new(&bin).args([
            target.name.clone(),
            addr.to_string(),
            size.to_string(),
            target.child.id().to_string(),
        ]),
    );
    let out = c.finish(LIMIT);
    assert!(
        out.status.success(),
        "te_compat.c {:?}\nstdout: {:?}\nstderr:\n{}",
        out.status,
        out.stdout,
        out.stderr
    );
    assert_eq!(out.stdout, ["ok"]);
    // The target itself holds pattern 1 now (and is running again: it answers).
    let want = format!("crc32c {:08x}", crc32c(&c_pattern(1, size)));
    assert_eq!(target.command("checksum"), want);
}
