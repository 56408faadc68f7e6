//! The HIP runtime (`libamdhip64.so`, override `MC_HIP_LIB`), loaded at run time. Only
//! the subset the device-memory layer calls: device listing, the per-thread current
//! device, pointer queries, synchronous copies, pinned host memory, device allocation
//! (for checks and tests) and IPC handles.
//!
//! `hipPointerAttribute_t` is laid out as in ROCm 5.x and 6.x alike (memory type,
//! device, device pointer, host pointer, isManaged, allocationFlags), but the memory
//! type enum was renumbered in ROCm 6 (an `Unregistered = 0` entry was added in
//! front); the runtime version tells which numbering applies.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use super::error::{Backend, DriverError, Error, Result};
use super::loader::{self, BackendInfo};
use super::table::function_table;

/// Environment variable naming the libamdhip64 to load instead of the system one.
pub const OVERRIDE_VAR: &str = "MC_HIP_LIB";
/// Library names tried when the override is not set.
pub const CANDIDATES: &[&str] = &["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"];

/// `hipError_t`: a HIP status code.
pub type HipError = c_int;
/// The call succeeded.
pub const HIP_SUCCESS: HipError = 0;
/// An argument was out of range (also: the pointer is not HIP memory).
pub const HIP_ERROR_INVALID_VALUE: HipError = 1;
/// No HIP-capable device is present.
pub const HIP_ERROR_NO_DEVICE: HipError = 100;

/// `hipMemcpyKind`.
pub const HIP_MEMCPY_HOST_TO_DEVICE: c_int = 1;
/// Device to host.
pub const HIP_MEMCPY_DEVICE_TO_HOST: c_int = 2;
/// Device to device.
pub const HIP_MEMCPY_DEVICE_TO_DEVICE: c_int = 3;
/// `hipHostMalloc` flag: pinned memory usable from every device context.
pub const HIP_HOST_MALLOC_PORTABLE: c_uint = 1;
/// `hipIpcOpenMemHandle` flag: enable peer access lazily.
pub const HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// `hipPointerAttribute_t` (hip_runtime_api.h).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HipPointerAttribute {
    /// A `hipMemoryType`: host, device, unified, ...
    pub memory_type: c_int,
    /// Ordinal of the device owning the memory.
    pub device: c_int,
    /// The device-side address of the allocation.
    pub device_pointer: *mut c_void,
    /// The host-side address, for host or managed memory.
    pub host_pointer: *mut c_void,
    /// Non-zero for managed memory.
    pub is_managed: c_int,
    /// The flags the memory was allocated with.
    pub allocation_flags: c_uint,
}

/// `hipIpcMemHandle_t`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HipIpcMemHandle {
    /// Opaque handle bytes, passed to the importing process as is.
    pub reserved: [u8; 64],
}

/// Where the memory a pointer names lives, as far as HIP knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HipMemory {
    /// Host memory (or memory HIP does not know).
    Host,
    /// Memory of the device with this ordinal.
    Device(i32),
}

function_table! {
    /// The loaded runtime: its function table, with the library kept alive beside it.
    pub struct Hip (override OVERRIDE_VAR) {
        state {
            /// Why `hipInit` failed (e.g. `hipErrorNoDevice`), if it did.
            init_error: Option<DriverError> = None,
            runtime_version: Option<i32> = None,
        }
        symbols {
            hip_init: required ["hipInit"] unsafe extern "C" fn(c_uint) -> HipError,
            hip_runtime_get_version: required ["hipRuntimeGetVersion"]
                unsafe extern "C" fn(*mut c_int) -> HipError,
            hip_get_device_count: required ["hipGetDeviceCount"]
                unsafe extern "C" fn(*mut c_int) -> HipError,
            hip_device_get_name: required ["hipDeviceGetName"]
                unsafe extern "C" fn(*mut c_char, c_int, c_int) -> HipError,
            hip_device_get_pci_bus_id: required ["hipDeviceGetPCIBusId"]
                unsafe extern "C" fn(*mut c_char, c_int, c_int) -> HipError,
            hip_set_device: required ["hipSetDevice"] unsafe extern "C" fn(c_int) -> HipError,
            hip_get_device: required ["hipGetDevice"] unsafe extern "C" fn(*mut c_int) -> HipError,
            hip_device_synchronize: required ["hipDeviceSynchronize"]
                unsafe extern "C" fn() -> HipError,
            hip_pointer_get_attributes: required ["hipPointerGetAttributes"]
                unsafe extern "C" fn(*mut HipPointerAttribute, *const c_void) -> HipError,
            hip_memcpy: required ["hipMemcpy"]
                unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> HipError,
            hip_host_malloc: required ["hipHostMalloc"]
                unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> HipError,
            hip_host_free: required ["hipHostFree"] unsafe extern "C" fn(*mut c_void) -> HipError,
            hip_malloc: required ["hipMalloc"]
                unsafe extern "C" fn(*mut *mut c_void, usize) -> HipError,
            hip_free: required ["hipFree"] unsafe extern "C" fn(*mut c_void) -> HipError,
            hip_mem_get_address_range: required ["hipMemGetAddressRange"]
                unsafe extern "C" fn(*mut *mut c_void, *mut usize, *mut c_void) -> HipError,
            hip_ipc_get_mem_handle: required ["hipIpcGetMemHandle"]
                unsafe extern "C" fn(*mut HipIpcMemHandle, *mut c_void) -> HipError,
            hip_ipc_open_mem_handle: required ["hipIpcOpenMemHandle"]
                unsafe extern "C" fn(*mut *mut c_void, HipIpcMemHandle, c_uint) -> HipError,
            hip_ipc_close_mem_handle: required ["hipIpcCloseMemHandle"]
                unsafe extern "C" fn(*mut c_void) -> HipError,
            hip_get_error_string: required ["hipGetErrorString"]
                unsafe extern "C" fn(HipError) -> *const c_char,
            hip_get_error_name: required ["hipGetErrorName"]
                unsafe extern "C" fn(HipError) -> *const c_char,
        }
    }
}

thread_local! {
    static CURRENT: Cell<c_int> = const { Cell::new(-1) };
}

impl Hip {
    /// Opens the library `path` (no caching): for tests and tools.
    pub fn load_from(path: &str) -> Result<Hip> {
        Hip::open(Some(path))
    }

    fn open(path: Option<&str>) -> Result<Hip> {
        let (lib, name) = loader::open(Backend::Hip, path, OVERRIDE_VAR, CANDIDATES, None)?;
        let mut hip = Hip::bind(lib, name)?;
        // SAFETY: flags must be 0.
        let rc = unsafe { (hip.hip_init)(0) };
        if rc != HIP_SUCCESS {
            hip.init_error = Some(DriverError {
                backend: Backend::Hip,
                call: "hipInit",
                code: rc,
                text: hip.describe(rc),
            });
        }
        let mut v = 0;
        // SAFETY: writes one int.
        if unsafe { (hip.hip_runtime_get_version)(&mut v) } == HIP_SUCCESS {
            hip.runtime_version = Some(v);
        }
        Ok(hip)
    }

    /// "hipErrorX: text" for a result code.
    pub fn describe(&self, rc: HipError) -> String {
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: a static NUL-terminated string owned by the runtime.
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        // SAFETY: both take a code and return a static string.
        let (name, desc) = unsafe {
            (
                text((self.hip_get_error_name)(rc)),
                text((self.hip_get_error_string)(rc)),
            )
        };
        format!("{name}: {desc} (hipError_t {rc})")
    }

    fn check(&self, call: &'static str, rc: HipError) -> Result<()> {
        DriverError::check(Backend::Hip, call, rc, rc == HIP_SUCCESS, || {
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

    /// HIP_VERSION-style number (major * 10^7 + minor * 10^5 + patch).
    pub fn runtime_version(&self) -> Option<i32> {
        self.runtime_version
    }

    /// Number of HIP devices the runtime sees.
    pub fn device_count(&self) -> Result<i32> {
        self.initialized()?;
        let mut n = 0;
        // SAFETY: writes one int.
        self.check("hipGetDeviceCount", unsafe {
            (self.hip_get_device_count)(&mut n)
        })?;
        Ok(n)
    }

    /// The marketing name of device `ordinal`.
    pub fn device_name(&self, ordinal: i32) -> Result<String> {
        self.device_string(ordinal, "hipDeviceGetName", self.hip_device_get_name)
    }

    /// The device's PCI address, `domain:bus:device.function`.
    pub fn pci_bus_id(&self, ordinal: i32) -> Result<String> {
        self.device_string(
            ordinal,
            "hipDeviceGetPCIBusId",
            self.hip_device_get_pci_bus_id,
        )
    }

    /// A NUL-terminated string the runtime writes about device `ordinal`.
    fn device_string(
        &self,
        ordinal: i32,
        call: &'static str,
        f: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> HipError,
    ) -> Result<String> {
        let mut text = [0 as c_char; 256];
        // SAFETY: the runtime writes at most `len` bytes, NUL-terminated.
        self.check(call, unsafe {
            f(text.as_mut_ptr(), text.len() as c_int - 1, ordinal)
        })?;
        // SAFETY: the zeroed last byte is never written.
        Ok(unsafe { CStr::from_ptr(text.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// Makes `ordinal` this thread's current device (cached per thread).
    pub fn make_current(&self, ordinal: i32) -> Result<()> {
        if CURRENT.with(|c| c.get()) == ordinal {
            return Ok(());
        }
        self.initialized()?;
        // SAFETY: takes an ordinal.
        self.check("hipSetDevice", unsafe { (self.hip_set_device)(ordinal) })?;
        CURRENT.with(|c| c.set(ordinal));
        Ok(())
    }

    /// This thread's current device, for `make_current` to restore later. Also
    /// refreshes the `make_current` cache: the caller may have switched devices since.
    pub fn current_device(&self) -> Result<i32> {
        self.initialized()?;
        let mut d: c_int = -1;
        // SAFETY: writes one int.
        self.check("hipGetDevice", unsafe { (self.hip_get_device)(&mut d) })?;
        CURRENT.with(|c| c.set(d));
        Ok(d)
    }

    /// Waits until the current device's work, copies included, is done.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: no arguments.
        self.check("hipDeviceSynchronize", unsafe {
            (self.hip_device_synchronize)()
        })
    }

    /// Host or which device `addr` lives on.
    pub fn pointer_info(&self, addr: u64) -> Result<HipMemory> {
        self.initialized()?;
        let mut a = HipPointerAttribute {
            memory_type: -1,
            device: -1,
            device_pointer: std::ptr::null_mut(),
            host_pointer: std::ptr::null_mut(),
            is_managed: 0,
            allocation_flags: 0,
        };
        // SAFETY: fills one attribute struct of the declared layout.
        let rc = unsafe { (self.hip_pointer_get_attributes)(&mut a, addr as *const c_void) };
        if rc == HIP_ERROR_INVALID_VALUE {
            return Ok(HipMemory::Host); // not known to HIP: plain host memory
        }
        self.check("hipPointerGetAttributes", rc)?;
        // ROCm 6: Unregistered 0, Host 1, Device 2, Managed 3; ROCm 5: Host 0, Device 1.
        let rocm6 = self.runtime_version.is_some_and(|v| v >= 60_000_000);
        let device = if rocm6 {
            matches!(a.memory_type, 2 | 3 | 10)
        } else {
            matches!(a.memory_type, 1 | 2)
        };
        Ok(if device || a.is_managed != 0 {
            HipMemory::Device(a.device)
        } else {
            HipMemory::Host
        })
    }

    fn memcpy(
        &self,
        what: &'static str,
        dst: *mut c_void,
        src: *const c_void,
        len: usize,
        kind: c_int,
    ) -> Result<()> {
        // SAFETY: callers uphold the copy contracts below.
        self.check(what, unsafe { (self.hip_memcpy)(dst, src, len, kind) })
    }

    /// # Safety
    /// `dst` valid for `len` bytes of writes; `src` device memory of `len` bytes.
    pub unsafe fn copy_dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        self.memcpy(
            "hipMemcpy(DtoH)",
            dst.cast(),
            src as *const c_void,
            len,
            HIP_MEMCPY_DEVICE_TO_HOST,
        )
    }

    /// # Safety
    /// `src` valid for `len` bytes of reads; `dst` device memory of `len` bytes.
    pub unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        self.memcpy(
            "hipMemcpy(HtoD)",
            dst as *mut c_void,
            src.cast(),
            len,
            HIP_MEMCPY_HOST_TO_DEVICE,
        )
    }

    /// # Safety
    /// Both ranges must be device memory of `len` bytes.
    pub unsafe fn copy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        self.memcpy(
            "hipMemcpy(DtoD)",
            dst as *mut c_void,
            src as *const c_void,
            len,
            HIP_MEMCPY_DEVICE_TO_DEVICE,
        )
    }

    /// Allocates `len` bytes of pinned host memory (free with `host_free`).
    pub fn host_alloc(&self, len: usize) -> Result<*mut u8> {
        self.initialized()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        self.check("hipHostMalloc", unsafe {
            (self.hip_host_malloc)(&mut p, len, HIP_HOST_MALLOC_PORTABLE)
        })?;
        Ok(p.cast())
    }

    /// # Safety
    /// `p` must come from `host_alloc` and not be used afterwards.
    pub unsafe fn host_free(&self, p: *mut u8) {
        // SAFETY: the caller guarantees `p` came from `host_alloc` (hipHostMalloc) and is never
        // used again, so freeing it once here is sound.
        unsafe { (self.hip_host_free)(p.cast()) };
    }

    /// Allocates `len` bytes on device `ordinal`; returns the device address.
    pub fn mem_alloc(&self, ordinal: i32, len: usize) -> Result<u64> {
        self.make_current(ordinal)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        self.check("hipMalloc", unsafe { (self.hip_malloc)(&mut p, len) })?;
        Ok(p as u64)
    }

    /// # Safety
    /// `p` must come from `mem_alloc` and not be used afterwards.
    pub unsafe fn mem_free(&self, p: u64) -> Result<()> {
        // SAFETY: the caller guarantees `p` came from `mem_alloc` (hipMalloc) and is never used
        // again, so freeing it once here is sound.
        self.check("hipFree", unsafe { (self.hip_free)(p as *mut c_void) })
    }

    /// The allocation holding `addr`: its base and size (IPC handles name allocations).
    pub fn mem_range(&self, addr: u64) -> Result<(u64, usize)> {
        let (mut base, mut size): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: writes one pointer and one size.
        self.check("hipMemGetAddressRange", unsafe {
            (self.hip_mem_get_address_range)(&mut base, &mut size, addr as *mut c_void)
        })?;
        Ok((base as u64, size))
    }

    /// Exports the allocation holding `addr` for another process to open.
    pub fn ipc_get_handle(&self, addr: u64) -> Result<HipIpcMemHandle> {
        let mut h = HipIpcMemHandle { reserved: [0; 64] };
        // SAFETY: writes one handle.
        self.check("hipIpcGetMemHandle", unsafe {
            (self.hip_ipc_get_mem_handle)(&mut h, addr as *mut c_void)
        })?;
        Ok(h)
    }

    /// Maps another process's exported allocation; returns its address here.
    pub fn ipc_open(&self, handle: &HipIpcMemHandle) -> Result<u64> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer; the handle is passed by value.
        self.check("hipIpcOpenMemHandle", unsafe {
            (self.hip_ipc_open_mem_handle)(&mut p, *handle, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        })?;
        Ok(p as u64)
    }

    /// # Safety
    /// `p` must come from `ipc_open` and not be used afterwards.
    pub unsafe fn ipc_close(&self, p: u64) -> Result<()> {
        // SAFETY: the caller guarantees `p` is a mapping returned by `ipc_open` and is never used
        // again, so unmapping it once here is sound.
        self.check("hipIpcCloseMemHandle", unsafe {
            (self.hip_ipc_close_mem_handle)(p as *mut c_void)
        })
    }
}

static API: OnceLock<Result<Hip>> = OnceLock::new();

/// The process-wide runtime table, loaded on first use (from `MC_HIP_LIB` if set).
pub fn api() -> Result<&'static Hip> {
    API.get_or_init(|| Hip::open(None))
        .as_ref()
        .map_err(Clone::clone)
}

/// What `mooncake info` shows for HIP.
pub fn info() -> BackendInfo {
    match api() {
        Ok(hip) => info_of(hip),
        Err(e) => BackendInfo::unavailable("hip", e),
    }
}

/// As `info`, for a given table.
pub fn info_of(hip: &Hip) -> BackendInfo {
    let mut info = BackendInfo {
        name: "hip",
        library: Ok(hip.library.clone()),
        version: hip
            .runtime_version()
            .map(|v| format!("{}.{}.{}", v / 10_000_000, v / 100_000 % 100, v % 100_000)),
        devices: Vec::new(),
        notes: Vec::new(),
    };
    match hip.device_count() {
        Ok(0) => info.notes.push("no device".into()),
        Ok(n) => {
            for i in 0..n {
                let name = hip.device_name(i).unwrap_or_else(|e| e.to_string());
                info.devices.push(format!("hip:{i} {name}"));
            }
        }
        Err(e) => info.notes.push(format!("no device: {e}")),
    }
    info
}
