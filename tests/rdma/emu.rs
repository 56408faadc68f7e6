//! The emulated verbs provider (tests/emu/verbs_emu.c): built with `cc`, installed as
//! this process's libibverbs, and driven through its fault-injection and counter entry
//! points.

use std::path::Path;
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::common;

pub const DEVICES: [&str; 3] = ["emu0", "emu1", "emu2"];

/// The emulator's fault-injection and counter entry points.
pub struct Emu {
    _lib: libloading::Library,
    fail_device: unsafe extern "C" fn(*const libc::c_char, libc::c_int) -> libc::c_int,
    fail_after: unsafe extern "C" fn(*const libc::c_char, u64) -> libc::c_int,
    bytes: unsafe extern "C" fn(*const libc::c_char) -> u64,
    hold_completions: unsafe extern "C" fn(libc::c_int),
    wait_held: unsafe extern "C" fn(libc::c_int, libc::c_int) -> libc::c_int,
    wait_held_armed: unsafe extern "C" fn(libc::c_int) -> libc::c_int,
    cq_events: unsafe extern "C" fn() -> u64,
    wait_cq_events: unsafe extern "C" fn(u64, libc::c_int) -> u64,
    fabric_entries: unsafe extern "C" fn(libc::c_int) -> libc::c_int,
    fabric_reclaim: unsafe extern "C" fn() -> libc::c_int,
}

impl Emu {
    pub fn bytes(&self, dev: &str) -> u64 {
        let name = std::ffi::CString::new(dev).unwrap();
        // SAFETY: emulator entry point taking a C string.
        unsafe { (self.bytes)(name.as_ptr()) }
    }

    pub fn set_down(&self, dev: &str, down: bool) {
        let name = std::ffi::CString::new(dev).unwrap();
        assert_eq!(
            // SAFETY: emulator entry point taking a C string, live for the call.
            unsafe { (self.fail_device)(name.as_ptr(), down as libc::c_int) },
            0
        );
    }

    pub fn fail_after(&self, dev: &str, bytes: u64) {
        let name = std::ffi::CString::new(dev).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { (self.fail_after)(name.as_ptr(), bytes) }, 0);
    }

    /// Keeps completions back until the returned guard goes (which delivers them).
    pub fn hold_completions(&self) -> Held<'_> {
        // SAFETY: emulator entry point without preconditions.
        unsafe { (self.hold_completions)(1) };
        Held(self)
    }

    /// Waits (bounded) until `n` completions are held; returns how many are.
    pub fn wait_held(&self, n: i32) -> i32 {
        // SAFETY: as above.
        unsafe { (self.wait_held)(n, 30_000) }
    }

    /// Waits (bounded) until every CQ a held completion is bound for is armed (so
    /// delivering them raises channel events); whether they all are.
    pub fn wait_held_armed(&self) -> bool {
        // SAFETY: as above.
        unsafe { (self.wait_held_armed)(30_000) != 0 }
    }

    /// CQ events read through ibv_get_cq_event so far, by anyone in this process.
    pub fn cq_events(&self) -> u64 {
        // SAFETY: as above.
        unsafe { (self.cq_events)() }
    }

    /// Waits (bounded) until at least `n` CQ events have been read; how many have.
    pub fn wait_cq_events(&self, n: u64) -> u64 {
        // SAFETY: as above.
        unsafe { (self.wait_cq_events)(n, 30_000) }
    }

    /// QPs and MRs of process `pid` published on the shared fabric.
    pub fn fabric_entries(&self, pid: u32) -> i32 {
        // SAFETY: as above.
        unsafe { (self.fabric_entries)(pid as libc::c_int) }
    }

    /// Frees the fabric entries of processes that are gone; returns how many.
    pub fn fabric_reclaim(&self) -> i32 {
        // SAFETY: as above.
        unsafe { (self.fabric_reclaim)() }
    }
}

/// Held completions; dropping it delivers them.
pub struct Held<'a>(&'a Emu);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        // SAFETY: emulator entry point without preconditions.
        unsafe { (self.0.hold_completions)(0) };
    }
}

/// Whether `fd` is readable within `timeout_ms` (0: right now).
pub fn readable(fd: std::os::fd::RawFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    assert!(n >= 0, "poll: {}", std::io::Error::last_os_error());
    n == 1 && p.revents & libc::POLLIN != 0
}

/// Builds and installs the emulator as this process's libibverbs (once, before any
/// engine loads verbs). `None` (test skipped) when no C compiler is present.
pub fn emu() -> Option<&'static Emu> {
    static EMU: OnceLock<Option<Emu>> = OnceLock::new();
    EMU.get_or_init(|| {
        if std::env::var_os("MC_RDMA_TEST_CHILD").is_some() {
            return None;
        }
        if !common::cprog::have("cc") {
            eprintln!("skipping: no C compiler (cc) to build the emulated verbs provider");
            return None;
        }
        let path = common::cprog::build(
            "cc",
            "emu/verbs_emu.c",
            "libverbs_emu.so",
            &["-O2", "-Wall"],
            common::cprog::Output::SharedObject,
        )
        .unwrap_or_else(|e| panic!("emulator builds: {e}"));
        std::env::set_var("MC_IBVERBS_LIB", &path);
        // The fake GPU drivers too, before any engine start looks for GPUs (the
        // driver tables load once per process).
        common::fakes::fakes();
        std::env::set_var("VERBS_EMU_DEVICES", DEVICES.len().to_string());
        // One fabric for this process and the `mooncake target` children it starts
        // (they inherit the variable). It outlives the run on purpose: entries that
        // dead processes leave are reclaimed by the next ones.
        let fabric = Path::new(env!("CARGO_TARGET_TMPDIR")).join("verbs_emu.fabric");
        std::env::set_var("VERBS_EMU_FABRIC", fabric);
        // SAFETY: the emulator's initializers have no preconditions; dlopen of the same
        // path shares the instance the engine loads.
        let lib = unsafe { libloading::Library::new(&path) }.expect("emulator loads");
        // SAFETY: the signatures match tests/emu/verbs_emu.c.
        unsafe {
            let fail_device = *lib.get(b"verbs_emu_fail_device\0").unwrap();
            let fail_after = *lib.get(b"verbs_emu_fail_after\0").unwrap();
            let bytes = *lib.get(b"verbs_emu_bytes\0").unwrap();
            let hold_completions = *lib.get(b"verbs_emu_hold_completions\0").unwrap();
            let wait_held = *lib.get(b"verbs_emu_wait_held\0").unwrap();
            let wait_held_armed = *lib.get(b"verbs_emu_wait_held_armed\0").unwrap();
            let cq_events = *lib.get(b"verbs_emu_cq_events\0").unwrap();
            let wait_cq_events = *lib.get(b"verbs_emu_wait_cq_events\0").unwrap();
            let fabric_entries = *lib.get(b"verbs_emu_fabric_entries\0").unwrap();
            let fabric_reclaim = *lib.get(b"verbs_emu_fabric_reclaim\0").unwrap();
            Some(Emu {
                _lib: lib,
                fail_device,
                fail_after,
                bytes,
                hold_completions,
                wait_held,
                wait_held_armed,
                cq_events,
                wait_cq_events,
                fabric_entries,
                fabric_reclaim,
            })
        }
    })
    .as_ref()
}

/// Tests share the emulated devices (faults are global): one at a time.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
