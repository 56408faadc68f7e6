//! Huawei Ascend's runtime, AscendCL (`libascendcl.so`, override `MC_ACL_LIB`), loaded
//! at run time. (Never `libacl.so`: that is the Linux access-control-list library.)
//! Only the subset the device-memory layer calls: init, device count, the per-thread
//! current device, synchronous copies with an explicit kind, pinned host memory and
//! device allocation (for checks and tests).
//!
//! Ascend memory is classified by the location a buffer is registered under (`npu:N`),
//! checked against the device count and, where the runtime has it (CANN 7+), against
//! `aclrtPointerGetAttributes`. Older runtimes have no pointer query at all.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use super::error::{Backend, DriverError, Error, Result};
use super::loader::{self, BackendInfo};
use super::table::function_table;

/// Environment variable naming the libascendcl to load instead of the system one.
pub const OVERRIDE_VAR: &str = "MC_ACL_LIB";
/// Library names tried when the override is not set.
pub const CANDIDATES: &[&str] = &["libascendcl.so"];

/// `aclError`: 0 on success, an ACL error number otherwise.
pub type AclError = c_int;
/// The call succeeded.
pub const ACL_SUCCESS: AclError = 0;
/// `aclInit` called twice in one process: harmless.
pub const ACL_ERROR_REPEAT_INITIALIZE: AclError = 100002;

/// `aclrtMemcpyKind`.
pub const ACL_MEMCPY_HOST_TO_DEVICE: c_int = 1;
/// Device to host.
pub const ACL_MEMCPY_DEVICE_TO_HOST: c_int = 2;
/// Device to device.
pub const ACL_MEMCPY_DEVICE_TO_DEVICE: c_int = 3;
/// `ACL_MEM_MALLOC_HUGE_FIRST`.
pub const ACL_MEM_MALLOC_HUGE_FIRST: c_int = 0;
/// `aclrtMemLocationType`: device memory from an ACL allocator (`aclrtMalloc`).
pub const ACL_MEM_LOCATION_TYPE_DEVICE: c_int = 1;

/// `aclrtPtrAttributes` (CANN 7+): an `aclrtMemLocation` (`uint32_t id`, then the
/// `aclrtMemLocationType` enum, an int), the page size and four reserved words.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AclrtPtrAttributes {
    /// `location.id`: the device (or NUMA node) the memory belongs to.
    pub location_id: u32,
    /// `location.type`: host 0, device 1, unregistered 2, host NUMA 4.
    pub location_type: c_int,
    /// Page size in bytes.
    pub page_size: u32,
    /// Reserved.
    pub rsv: [u32; 4],
}

/// What ACL's pointer query says of an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AclMemory {
    /// Memory of this NPU.
    Device(i32),
    /// Anything else: pinned host memory, memory ACL did not allocate, ...
    NotDevice,
}

function_table! {
    /// The loaded runtime: its function table, with the library kept alive beside it.
    pub struct Acl (override OVERRIDE_VAR) {
        state {
            /// Why `aclInit` failed, if it did.
            init_error: Option<DriverError> = None,
        }
        symbols {
            acl_init: required ["aclInit"] unsafe extern "C" fn(*const c_char) -> AclError,
            aclrt_get_version: required ["aclrtGetVersion"]
                unsafe extern "C" fn(*mut i32, *mut i32, *mut i32) -> AclError,
            aclrt_get_device_count: required ["aclrtGetDeviceCount"]
                unsafe extern "C" fn(*mut u32) -> AclError,
            aclrt_set_device: required ["aclrtSetDevice"] unsafe extern "C" fn(i32) -> AclError,
            /// `aclrtGetDevice`: the thread's current device, to put it back after a call
            /// that switched it; optional, as a table without it merely cannot.
            aclrt_get_device: optional ["aclrtGetDevice"] unsafe extern "C" fn(*mut i32) -> AclError,
            /// `aclrtPointerGetAttributes` (CANN 7+): which memory an address is.
            aclrt_pointer_get_attributes: optional ["aclrtPointerGetAttributes"]
                unsafe extern "C" fn(*const c_void, *mut AclrtPtrAttributes) -> AclError,
            aclrt_memcpy: required ["aclrtMemcpy"]
                unsafe extern "C" fn(*mut c_void, usize, *const c_void, usize, c_int) -> AclError,
            aclrt_malloc_host: required ["aclrtMallocHost"]
                unsafe extern "C" fn(*mut *mut c_void, usize) -> AclError,
            aclrt_free_host: required ["aclrtFreeHost"]
                unsafe extern "C" fn(*mut c_void) -> AclError,
            aclrt_malloc: required ["aclrtMalloc"]
                unsafe extern "C" fn(*mut *mut c_void, usize, c_int) -> AclError,
            aclrt_free: required ["aclrtFree"] unsafe extern "C" fn(*mut c_void) -> AclError,
            acl_get_recent_err_msg: required ["aclGetRecentErrMsg"]
                unsafe extern "C" fn() -> *const c_char,
        }
    }
}

thread_local! {
    static CURRENT: Cell<i32> = const { Cell::new(-1) };
}

impl Acl {
    /// Opens the library `path` (no caching): for tests and tools.
    pub fn load_from(path: &str) -> Result<Acl> {
        Acl::open(Some(path))
    }

    fn open(path: Option<&str>) -> Result<Acl> {
        let (lib, name) = loader::open(Backend::Acl, path, OVERRIDE_VAR, CANDIDATES, None)?;
        let mut acl = Acl::bind(lib, name)?;
        // SAFETY: a null config path means defaults.
        let rc = unsafe { (acl.acl_init)(std::ptr::null()) };
        if rc != ACL_SUCCESS && rc != ACL_ERROR_REPEAT_INITIALIZE {
            acl.init_error = Some(DriverError {
                backend: Backend::Acl,
                call: "aclInit",
                code: rc,
                text: acl.describe(rc),
            });
        }
        Ok(acl)
    }

    /// The code plus the runtime's most recent error message, if any.
    pub fn describe(&self, rc: AclError) -> String {
        // SAFETY: returns a thread-local string owned by the runtime, or null.
        let p = unsafe { (self.acl_get_recent_err_msg)() };
        if p.is_null() {
            format!("aclError {rc}")
        } else {
            // SAFETY: NUL-terminated, valid until the next ACL call on this thread.
            let msg = unsafe { CStr::from_ptr(p) }.to_string_lossy();
            format!("aclError {rc}: {}", msg.trim())
        }
    }

    fn check(&self, call: &'static str, rc: AclError) -> Result<()> {
        DriverError::check(Backend::Acl, call, rc, rc == ACL_SUCCESS, || {
            self.describe(rc)
        })
    }

    fn initialized(&self) -> Result<()> {
        match &self.init_error {
            None => Ok(()),
            Some(error) => Err(Error::NotInitialized {
                library: self.library.clone(),
                error: error.clone(),
            }),
        }
    }

    /// The runtime's `(major, minor, patch)` version, when it reports one.
    pub fn version(&self) -> Option<(i32, i32, i32)> {
        let (mut a, mut b, mut c) = (0, 0, 0);
        // SAFETY: writes three ints.
        (unsafe { (self.aclrt_get_version)(&mut a, &mut b, &mut c) } == ACL_SUCCESS)
            .then_some((a, b, c))
    }

    /// Number of NPUs the runtime sees.
    pub fn device_count(&self) -> Result<u32> {
        self.initialized()?;
        let mut n = 0u32;
        // SAFETY: writes one u32.
        self.check("aclrtGetDeviceCount", unsafe {
            (self.aclrt_get_device_count)(&mut n)
        })?;
        Ok(n)
    }

    /// Makes `ordinal` this thread's device (ACL copies need one; cached per thread).
    pub fn make_current(&self, ordinal: i32) -> Result<()> {
        if CURRENT.with(|c| c.get()) == ordinal {
            return Ok(());
        }
        self.initialized()?;
        // SAFETY: takes an ordinal.
        self.check("aclrtSetDevice", unsafe {
            (self.aclrt_set_device)(ordinal)
        })?;
        CURRENT.with(|c| c.set(ordinal));
        Ok(())
    }

    /// This thread's current device, for `make_current` to restore later; `None` when
    /// the runtime lacks `aclrtGetDevice` or no device is set on this thread (ACL has
    /// no "no device" to go back to). Refreshes the `make_current` cache: the caller
    /// may have switched devices since.
    pub fn current_device(&self) -> Result<Option<i32>> {
        self.initialized()?;
        let Some(get) = self.aclrt_get_device else {
            return Ok(None);
        };
        let mut d: i32 = -1;
        // SAFETY: writes one int32_t.
        if unsafe { get(&mut d) } != ACL_SUCCESS {
            return Ok(None);
        }
        CURRENT.with(|c| c.set(d));
        Ok(Some(d))
    }

    /// Whether the runtime has a pointer query (`pointer_info`).
    pub fn has_pointer_query(&self) -> bool {
        self.aclrt_pointer_get_attributes.is_some()
    }

    /// What the runtime says `addr` is; `None` without a pointer query or when the
    /// query fails (no answer either way).
    pub fn pointer_info(&self, addr: u64) -> Result<Option<AclMemory>> {
        self.initialized()?;
        let Some(query) = self.aclrt_pointer_get_attributes else {
            return Ok(None);
        };
        let mut a = AclrtPtrAttributes::default();
        // SAFETY: fills one attribute struct of the declared layout; the address is
        // only looked up, never dereferenced.
        let rc = unsafe { query(addr as *const c_void, &mut a) };
        if rc != ACL_SUCCESS {
            log::debug!(
                "aclrtPointerGetAttributes({addr:#x}): {}",
                self.describe(rc)
            );
            return Ok(None);
        }
        Ok(Some(if a.location_type == ACL_MEM_LOCATION_TYPE_DEVICE {
            AclMemory::Device(a.location_id as i32)
        } else {
            AclMemory::NotDevice
        }))
    }

    unsafe fn memcpy(
        &self,
        what: &'static str,
        dst: *mut c_void,
        src: *const c_void,
        len: usize,
        kind: c_int,
    ) -> Result<()> {
        // SAFETY: the caller upholds the copy contract; destMax is the copy length.
        self.check(what, unsafe {
            (self.aclrt_memcpy)(dst, len, src, len, kind)
        })
    }

    /// # Safety
    /// `dst` valid for `len` bytes of writes; `src` device memory of `len` bytes.
    pub unsafe fn copy_dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        // SAFETY: the caller guarantees `dst` is writable for `len` bytes and `src` is `len` bytes
        // of device memory, which is exactly what the DtoH `memcpy` requires.
        unsafe {
            self.memcpy(
                "aclrtMemcpy(DtoH)",
                dst.cast(),
                src as *const c_void,
                len,
                ACL_MEMCPY_DEVICE_TO_HOST,
            )
        }
    }

    /// # Safety
    /// `src` valid for `len` bytes of reads; `dst` device memory of `len` bytes.
    pub unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        // SAFETY: the caller guarantees `src` is readable for `len` bytes and `dst` is `len` bytes
        // of device memory, which is exactly what the HtoD `memcpy` requires.
        unsafe {
            self.memcpy(
                "aclrtMemcpy(HtoD)",
                dst as *mut c_void,
                src.cast(),
                len,
                ACL_MEMCPY_HOST_TO_DEVICE,
            )
        }
    }

    /// # Safety
    /// Both ranges must be device memory of `len` bytes.
    pub unsafe fn copy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: the caller guarantees both `src` and `dst` are `len` bytes of device memory, as
        // the DtoD `memcpy` requires.
        unsafe {
            self.memcpy(
                "aclrtMemcpy(DtoD)",
                dst as *mut c_void,
                src as *const c_void,
                len,
                ACL_MEMCPY_DEVICE_TO_DEVICE,
            )
        }
    }

    /// Allocates `len` bytes of page-locked host memory (free with `host_free`).
    pub fn host_alloc(&self, len: usize) -> Result<*mut u8> {
        self.initialized()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        self.check("aclrtMallocHost", unsafe {
            (self.aclrt_malloc_host)(&mut p, len)
        })?;
        Ok(p.cast())
    }

    /// # Safety
    /// `p` must come from `host_alloc` and not be used afterwards.
    pub unsafe fn host_free(&self, p: *mut u8) {
        // SAFETY: the caller guarantees `p` came from `host_alloc` (aclrtMallocHost) and is never
        // used again, so freeing it once here is sound.
        unsafe { (self.aclrt_free_host)(p.cast()) };
    }

    /// Allocates `len` bytes on NPU `ordinal`; returns the device address.
    pub fn mem_alloc(&self, ordinal: i32, len: usize) -> Result<u64> {
        self.make_current(ordinal)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        self.check("aclrtMalloc", unsafe {
            (self.aclrt_malloc)(&mut p, len, ACL_MEM_MALLOC_HUGE_FIRST)
        })?;
        Ok(p as u64)
    }

    /// # Safety
    /// `p` must come from `mem_alloc` and not be used afterwards.
    pub unsafe fn mem_free(&self, p: u64) -> Result<()> {
        // SAFETY: the caller guarantees `p` came from `mem_alloc` (aclrtMalloc) and is never used
        // again, so freeing it once here is sound.
        self.check("aclrtFree", unsafe { (self.aclrt_free)(p as *mut c_void) })
    }
}

static API: OnceLock<Result<Acl>> = OnceLock::new();

/// The process-wide runtime table, loaded on first use (from `MC_ACL_LIB` if set).
pub fn api() -> Result<&'static Acl> {
    API.get_or_init(|| Acl::open(None))
        .as_ref()
        .map_err(Clone::clone)
}

/// What `mooncake info` shows for Ascend.
pub fn info() -> BackendInfo {
    match api() {
        Ok(acl) => info_of(acl),
        Err(e) => BackendInfo::unavailable("ascend", e),
    }
}

/// As `info`, for a given table.
pub fn info_of(acl: &Acl) -> BackendInfo {
    let mut info = BackendInfo {
        name: "ascend",
        library: Ok(acl.library.clone()),
        version: acl.version().map(|(a, b, c)| format!("{a}.{b}.{c}")),
        devices: Vec::new(),
        notes: Vec::new(),
    };
    match acl.device_count() {
        Ok(0) => info.notes.push("no device".into()),
        Ok(n) => info.devices.extend((0..n).map(|i| format!("npu:{i}"))),
        Err(e) => info.notes.push(format!("no device: {e}")),
    }
    info
}
