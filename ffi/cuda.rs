//! The CUDA driver API (`libcuda.so.1`, override `MC_CUDA_LIB`), loaded at run time.
//! Only the subset the device-memory layer calls: initialization and device listing,
//! primary contexts (a worker thread needs a current context to copy), pointer
//! queries, synchronous copies, pinned host memory, device allocation (for checks and
//! tests), IPC handles and dma-buf export.
//!
//! Several entry points are exported under versioned names (`cuMemcpyDtoH_v2`,
//! `cuMemAlloc_v2`, ...): those are the ones `cuda.h` maps the plain names to, and the
//! ones looked up here.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Mutex, OnceLock};

use super::error::{Backend, DriverError, Error, Result};
use super::loader::{self, BackendInfo};
use super::table::function_table;

/// Environment variable naming the libcuda to load instead of the system one.
pub const OVERRIDE_VAR: &str = "MC_CUDA_LIB";
/// Library names tried when the override is not set.
pub const CANDIDATES: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// `CUresult`: a driver API status code.
pub type CUresult = c_int;
/// `CUdevice`: a device ordinal handle.
pub type CUdevice = c_int;
/// `CUdeviceptr`: a device virtual address.
pub type CUdeviceptr = u64;
/// `CUcontext`: an opaque driver context.
pub type CUcontext = *mut c_void;

/// The call succeeded.
pub const CUDA_SUCCESS: CUresult = 0;
/// An argument was out of range (also: the pointer is not CUDA memory).
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
/// No CUDA-capable device is present.
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
/// `cuPointerGetAttribute`: which memory type the pointer names.
pub const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
/// `cuPointerGetAttribute`: the ordinal of the device owning the pointer.
pub const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
/// `CUmemorytype`: host memory.
pub const CU_MEMORYTYPE_HOST: c_uint = 1;
/// `CUmemorytype`: device memory.
pub const CU_MEMORYTYPE_DEVICE: c_uint = 2;
/// `CUmemorytype`: a CUDA array.
pub const CU_MEMORYTYPE_ARRAY: c_uint = 3;
/// `CUmemorytype`: unified (managed) memory.
pub const CU_MEMORYTYPE_UNIFIED: c_uint = 4;
/// Pinned memory usable from every context, not just the allocating one.
pub const CU_MEMHOSTALLOC_PORTABLE: c_uint = 1;
/// `cuIpcOpenMemHandle` flag: enable peer access lazily when the mapping is used.
pub const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
/// `cuMemGetHandleForAddressRange`: export the range as a dma-buf descriptor.
pub const CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int = 1;

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CUipcMemHandle {
    /// Opaque handle bytes, passed to the importing process as is.
    pub reserved: [u8; 64],
}

function_table! {
    /// The loaded driver: its function table, with the library kept alive beside it.
    pub struct Cuda (override OVERRIDE_VAR) {
        state {
            /// Why `cuInit` failed (e.g. no device), if it did; calls needing a device fail.
            init_error: Option<DriverError> = None,
            contexts: Mutex<Vec<(CUdevice, usize)>> = Mutex::new(Vec::new()),
        }
        symbols {
            cu_init: required ["cuInit"] unsafe extern "C" fn(c_uint) -> CUresult,
            cu_driver_get_version: required ["cuDriverGetVersion"]
                unsafe extern "C" fn(*mut c_int) -> CUresult,
            cu_device_get_count: required ["cuDeviceGetCount"]
                unsafe extern "C" fn(*mut c_int) -> CUresult,
            cu_device_get: required ["cuDeviceGet"]
                unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult,
            cu_device_get_name: required ["cuDeviceGetName"]
                unsafe extern "C" fn(*mut c_char, c_int, CUdevice) -> CUresult,
            cu_device_get_pci_bus_id: required ["cuDeviceGetPCIBusId"]
                unsafe extern "C" fn(*mut c_char, c_int, CUdevice) -> CUresult,
            cu_device_primary_ctx_retain: required ["cuDevicePrimaryCtxRetain"]
                unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult,
            cu_ctx_set_current: required ["cuCtxSetCurrent"]
                unsafe extern "C" fn(CUcontext) -> CUresult,
            cu_ctx_get_current: required ["cuCtxGetCurrent"]
                unsafe extern "C" fn(*mut CUcontext) -> CUresult,
            cu_ctx_synchronize: required ["cuCtxSynchronize"] unsafe extern "C" fn() -> CUresult,
            cu_pointer_get_attribute: required ["cuPointerGetAttribute"]
                unsafe extern "C" fn(*mut c_void, c_int, CUdeviceptr) -> CUresult,
            cu_memcpy_dtoh: required ["cuMemcpyDtoH_v2", "cuMemcpyDtoH"]
                unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize) -> CUresult,
            cu_memcpy_htod: required ["cuMemcpyHtoD_v2", "cuMemcpyHtoD"]
                unsafe extern "C" fn(CUdeviceptr, *const c_void, usize) -> CUresult,
            cu_memcpy_dtod: required ["cuMemcpyDtoD_v2", "cuMemcpyDtoD"]
                unsafe extern "C" fn(CUdeviceptr, CUdeviceptr, usize) -> CUresult,
            cu_mem_host_alloc: required ["cuMemHostAlloc"]
                unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CUresult,
            cu_mem_free_host: required ["cuMemFreeHost"]
                unsafe extern "C" fn(*mut c_void) -> CUresult,
            cu_mem_alloc: required ["cuMemAlloc_v2", "cuMemAlloc"]
                unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult,
            cu_mem_free: required ["cuMemFree_v2", "cuMemFree"]
                unsafe extern "C" fn(CUdeviceptr) -> CUresult,
            cu_mem_get_address_range: required ["cuMemGetAddressRange_v2", "cuMemGetAddressRange"]
                unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, CUdeviceptr) -> CUresult,
            cu_ipc_get_mem_handle: required ["cuIpcGetMemHandle"]
                unsafe extern "C" fn(*mut CUipcMemHandle, CUdeviceptr) -> CUresult,
            cu_ipc_open_mem_handle: required ["cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"]
                unsafe extern "C" fn(*mut CUdeviceptr, CUipcMemHandle, c_uint) -> CUresult,
            cu_ipc_close_mem_handle: required ["cuIpcCloseMemHandle"]
                unsafe extern "C" fn(CUdeviceptr) -> CUresult,
            cu_get_error_string: required ["cuGetErrorString"]
                unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult,
            /// `cuMemGetHandleForAddressRange` (CUDA 11.7+): dma-buf export; absent on
            /// old drivers.
            cu_mem_get_handle_for_address_range: optional ["cuMemGetHandleForAddressRange"]
                unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize, c_int, u64) -> CUresult,
        }
    }
}

thread_local! {
    /// The device whose primary context this thread made current (-1: none yet).
    static CURRENT: Cell<CUdevice> = const { Cell::new(-1) };
}

impl Cuda {
    /// Opens the library `path` (no caching): for tests and tools.
    pub fn load_from(path: &str) -> Result<Cuda> {
        Cuda::open(Some(path))
    }

    fn open(path: Option<&str>) -> Result<Cuda> {
        let (lib, name) = loader::open(Backend::Cuda, path, OVERRIDE_VAR, CANDIDATES, None)?;
        let mut cuda = Cuda::bind(lib, name)?;
        // SAFETY: cuInit takes flags (must be 0).
        let rc = unsafe { (cuda.cu_init)(0) };
        if rc != CUDA_SUCCESS {
            cuda.init_error = Some(cuda.error("cuInit", rc));
        }
        Ok(cuda)
    }

    /// "CUDA_ERROR_X (text)" for a result code.
    pub fn describe(&self, rc: CUresult) -> String {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: the driver stores a pointer to a static string (or fails).
        let ok = unsafe { (self.cu_get_error_string)(rc, &mut text) } == CUDA_SUCCESS;
        if ok && !text.is_null() {
            // SAFETY: a NUL-terminated static string owned by the driver.
            let s = unsafe { CStr::from_ptr(text) }.to_string_lossy();
            format!("{s} (CUresult {rc})")
        } else {
            format!("CUresult {rc}")
        }
    }

    fn error(&self, call: &'static str, rc: CUresult) -> DriverError {
        DriverError {
            backend: Backend::Cuda,
            call,
            code: rc,
            text: self.describe(rc),
        }
    }

    fn check(&self, call: &'static str, rc: CUresult) -> Result<()> {
        DriverError::check(Backend::Cuda, call, rc, rc == CUDA_SUCCESS, || {
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

    /// The driver's API version (`1000 * major + 10 * minor`), when it reports one.
    pub fn driver_version(&self) -> Option<i32> {
        let mut v = 0;
        // SAFETY: writes one int.
        (unsafe { (self.cu_driver_get_version)(&mut v) } == CUDA_SUCCESS).then_some(v)
    }

    /// Number of CUDA devices the driver sees.
    pub fn device_count(&self) -> Result<i32> {
        self.initialized()?;
        let mut n = 0;
        // SAFETY: writes one int.
        self.check("cuDeviceGetCount", unsafe {
            (self.cu_device_get_count)(&mut n)
        })?;
        Ok(n)
    }

    /// The device's PCI address, `domain:bus:device.function` (e.g. `0000:3B:00.0`).
    pub fn pci_bus_id(&self, ordinal: i32) -> Result<String> {
        self.device_string(
            ordinal,
            "cuDeviceGetPCIBusId",
            self.cu_device_get_pci_bus_id,
        )
    }

    /// The marketing name of device `ordinal`.
    pub fn device_name(&self, ordinal: i32) -> Result<String> {
        self.device_string(ordinal, "cuDeviceGetName", self.cu_device_get_name)
    }

    /// A NUL-terminated string the driver writes about device `ordinal`.
    fn device_string(
        &self,
        ordinal: i32,
        call: &'static str,
        f: unsafe extern "C" fn(*mut c_char, c_int, CUdevice) -> CUresult,
    ) -> Result<String> {
        self.initialized()?;
        let mut dev: CUdevice = 0;
        // SAFETY: writes one device handle.
        self.check("cuDeviceGet", unsafe {
            (self.cu_device_get)(&mut dev, ordinal)
        })?;
        let mut text = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated.
        self.check(call, unsafe {
            f(text.as_mut_ptr(), text.len() as c_int - 1, dev)
        })?;
        // SAFETY: NUL-terminated within the buffer (zeroed, last byte never written).
        Ok(unsafe { CStr::from_ptr(text.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// Makes `ordinal`'s primary context current on this thread (cached per thread,
    /// so the steady state costs a thread-local read).
    pub fn make_current(&self, ordinal: i32) -> Result<()> {
        if CURRENT.with(|c| c.get()) == ordinal {
            return Ok(());
        }
        self.initialized()?;
        let ctx = {
            let mut contexts = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
            match contexts.iter().find(|(d, _)| *d == ordinal) {
                Some((_, c)) => *c as CUcontext,
                None => {
                    let mut dev: CUdevice = 0;
                    // SAFETY: writes one device handle.
                    self.check("cuDeviceGet", unsafe {
                        (self.cu_device_get)(&mut dev, ordinal)
                    })?;
                    let mut ctx: CUcontext = std::ptr::null_mut();
                    // SAFETY: writes one context handle; retained for the process's life.
                    self.check("cuDevicePrimaryCtxRetain", unsafe {
                        (self.cu_device_primary_ctx_retain)(&mut ctx, dev)
                    })?;
                    contexts.push((ordinal, ctx as usize));
                    ctx
                }
            }
        };
        // SAFETY: a retained primary context.
        self.check("cuCtxSetCurrent", unsafe { (self.cu_ctx_set_current)(ctx) })?;
        CURRENT.with(|c| c.set(ordinal));
        Ok(())
    }

    /// This thread's current context (0: none), for `restore_context`. Also tells the
    /// `make_current` cache which device that is: the caller (torch, say) may have
    /// switched contexts since this thread last made one current.
    pub fn current_context(&self) -> Result<usize> {
        self.initialized()?;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle.
        self.check("cuCtxGetCurrent", unsafe {
            (self.cu_ctx_get_current)(&mut ctx)
        })?;
        CURRENT.with(|c| c.set(self.ordinal_of(ctx as usize)));
        Ok(ctx as usize)
    }

    /// Makes `ctx`, from `current_context`, current again on this thread.
    pub fn restore_context(&self, ctx: usize) -> Result<()> {
        // SAFETY: a context the driver reported current on this thread (or 0: none).
        self.check("cuCtxSetCurrent", unsafe {
            (self.cu_ctx_set_current)(ctx as CUcontext)
        })?;
        CURRENT.with(|c| c.set(self.ordinal_of(ctx)));
        Ok(())
    }

    /// The device whose retained primary context `ctx` is (-1: not one of ours).
    fn ordinal_of(&self, ctx: usize) -> CUdevice {
        let contexts = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        contexts
            .iter()
            .find(|(_, c)| ctx != 0 && *c == ctx)
            .map_or(-1, |(d, _)| *d)
    }

    /// Waits until the current context's work, copies included, is done.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: no arguments.
        self.check("cuCtxSynchronize", unsafe { (self.cu_ctx_synchronize)() })
    }

    /// Whether some context is current on this thread.
    pub fn has_current_context(&self) -> bool {
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle.
        unsafe { (self.cu_ctx_get_current)(&mut ctx) == CUDA_SUCCESS && !ctx.is_null() }
    }

    /// What the driver knows of `addr`: `Some((memory type, device ordinal))`, or `None`
    /// when the address is not CUDA memory at all (plain host memory).
    pub fn pointer_info(&self, addr: u64) -> Result<Option<(c_uint, i32)>> {
        self.initialized()?;
        let mut kind: c_uint = 0;
        // SAFETY: MEMORY_TYPE writes one `CUmemorytype` (an unsigned int).
        let rc = unsafe {
            (self.cu_pointer_get_attribute)(
                (&mut kind as *mut c_uint).cast(),
                CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                addr,
            )
        };
        if rc == CUDA_ERROR_INVALID_VALUE {
            return Ok(None);
        }
        self.check("cuPointerGetAttribute(MEMORY_TYPE)", rc)?;
        let mut ordinal: c_int = -1;
        // SAFETY: DEVICE_ORDINAL writes one int.
        let rc = unsafe {
            (self.cu_pointer_get_attribute)(
                (&mut ordinal as *mut c_int).cast(),
                CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        };
        self.check("cuPointerGetAttribute(DEVICE_ORDINAL)", rc)?;
        Ok(Some((kind, ordinal)))
    }

    /// Device → host, synchronous.
    ///
    /// # Safety
    /// `dst` must be valid for `len` bytes of writes; `src` device memory of `len` bytes.
    pub unsafe fn copy_dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        // SAFETY: the caller guarantees `dst` is writable for `len` bytes and `src` is `len` bytes
        // of device memory, which is all cuMemcpyDtoH requires.
        self.check("cuMemcpyDtoH_v2", unsafe {
            (self.cu_memcpy_dtoh)(dst.cast(), src, len)
        })
    }

    /// Host → device, synchronous.
    ///
    /// # Safety
    /// `src` must be valid for `len` bytes of reads; `dst` device memory of `len` bytes.
    pub unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        // SAFETY: the caller guarantees `src` is readable for `len` bytes and `dst` is `len` bytes
        // of device memory, which is all cuMemcpyHtoD requires.
        self.check("cuMemcpyHtoD_v2", unsafe {
            (self.cu_memcpy_htod)(dst, src.cast(), len)
        })
    }

    /// Device → device (any devices, unified addressing), synchronous.
    ///
    /// # Safety
    /// Both ranges must be device memory of `len` bytes.
    pub unsafe fn copy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: the caller guarantees both ranges are `len` bytes of device memory (unified
        // addressing lets them be on different devices), as cuMemcpyDtoD requires.
        self.check("cuMemcpyDtoD_v2", unsafe {
            (self.cu_memcpy_dtod)(dst, src, len)
        })
    }

    /// Pinned, portable host memory.
    pub fn host_alloc(&self, len: usize) -> Result<*mut u8> {
        self.initialized()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        self.check("cuMemHostAlloc", unsafe {
            (self.cu_mem_host_alloc)(&mut p, len, CU_MEMHOSTALLOC_PORTABLE)
        })?;
        Ok(p.cast())
    }

    /// # Safety
    /// `p` must come from `host_alloc` and not be used afterwards.
    pub unsafe fn host_free(&self, p: *mut u8) {
        // SAFETY: the caller guarantees `p` came from `host_alloc` (cuMemHostAlloc) and is never
        // used again, so freeing it once here is sound.
        unsafe { (self.cu_mem_free_host)(p.cast()) };
    }

    /// Device memory on `ordinal`.
    pub fn mem_alloc(&self, ordinal: i32, len: usize) -> Result<u64> {
        self.make_current(ordinal)?;
        let mut p: CUdeviceptr = 0;
        // SAFETY: writes one device pointer.
        self.check("cuMemAlloc_v2", unsafe { (self.cu_mem_alloc)(&mut p, len) })?;
        Ok(p)
    }

    /// # Safety
    /// `p` must come from `mem_alloc` and not be used afterwards.
    pub unsafe fn mem_free(&self, p: u64) -> Result<()> {
        // SAFETY: the caller guarantees `p` came from `mem_alloc` (cuMemAlloc) and is never used
        // again, so freeing it once here is sound.
        self.check("cuMemFree_v2", unsafe { (self.cu_mem_free)(p) })
    }

    /// The allocation holding `addr`: its base and size. IPC handles and dma-buf
    /// exports name whole allocations, so callers export the base and add the offset.
    pub fn mem_range(&self, addr: u64) -> Result<(u64, usize)> {
        let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
        // SAFETY: writes one pointer and one size.
        self.check("cuMemGetAddressRange_v2", unsafe {
            (self.cu_mem_get_address_range)(&mut base, &mut size, addr)
        })?;
        Ok((base, size))
    }

    /// An IPC handle another process on this host can open.
    pub fn ipc_get_handle(&self, addr: u64) -> Result<CUipcMemHandle> {
        let mut h = CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: writes one handle.
        self.check("cuIpcGetMemHandle", unsafe {
            (self.cu_ipc_get_mem_handle)(&mut h, addr)
        })?;
        Ok(h)
    }

    /// Maps a peer's IPC handle into this process; close with `ipc_close`.
    pub fn ipc_open(&self, handle: &CUipcMemHandle) -> Result<u64> {
        let mut p: CUdeviceptr = 0;
        // SAFETY: writes one device pointer; the handle is passed by value.
        self.check("cuIpcOpenMemHandle_v2", unsafe {
            (self.cu_ipc_open_mem_handle)(&mut p, *handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        })?;
        Ok(p)
    }

    /// # Safety
    /// `p` must come from `ipc_open` and not be used afterwards.
    pub unsafe fn ipc_close(&self, p: u64) -> Result<()> {
        // SAFETY: the caller guarantees `p` is a mapping returned by `ipc_open` and is never used
        // again, so unmapping it once here is sound.
        self.check("cuIpcCloseMemHandle", unsafe {
            (self.cu_ipc_close_mem_handle)(p)
        })
    }

    /// Whether the driver can export dma-buf handles (for GPUDirect RDMA registration).
    pub fn has_dma_buf(&self) -> bool {
        self.cu_mem_get_handle_for_address_range.is_some()
    }

    /// A dma-buf file descriptor for `[addr, addr+len)` (page-aligned device memory);
    /// the caller owns (and closes) it.
    pub fn dma_buf_fd(&self, addr: u64, len: usize) -> Result<i32> {
        let f = self
            .cu_mem_get_handle_for_address_range
            .ok_or_else(|| Error::Unsupported {
                library: self.library.clone(),
                what: "cuMemGetHandleForAddressRange (driver too old for dma-buf)",
            })?;
        let mut fd: c_int = -1;
        // SAFETY: for DMA_BUF_FD the handle is one int.
        self.check("cuMemGetHandleForAddressRange", unsafe {
            f(
                (&mut fd as *mut c_int).cast(),
                addr,
                len,
                CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        Ok(fd)
    }
}

static API: OnceLock<Result<Cuda>> = OnceLock::new();

/// The process-wide driver table, loaded on first use (from `MC_CUDA_LIB` if set).
pub fn api() -> Result<&'static Cuda> {
    API.get_or_init(|| Cuda::open(None))
        .as_ref()
        .map_err(Clone::clone)
}

/// What `mooncake info` shows for CUDA.
pub fn info() -> BackendInfo {
    match api() {
        Ok(cuda) => info_of(cuda),
        Err(e) => BackendInfo::unavailable("cuda", e),
    }
}

/// As `info`, for a given table.
pub fn info_of(cuda: &Cuda) -> BackendInfo {
    let mut info = BackendInfo {
        name: "cuda",
        library: Ok(cuda.library.clone()),
        version: cuda
            .driver_version()
            .map(|v| format!("{}.{}", v / 1000, v % 1000 / 10)),
        devices: Vec::new(),
        notes: Vec::new(),
    };
    match cuda.device_count() {
        Ok(0) => info.notes.push("no device".into()),
        Ok(n) => {
            for i in 0..n {
                let name = cuda.device_name(i).unwrap_or_else(|e| e.to_string());
                info.devices.push(format!("cuda:{i} {name}"));
            }
            if cuda.has_dma_buf() {
                info.notes.push("dma-buf export available".into());
            }
        }
        Err(e) => info.notes.push(format!("no device: {e}")),
    }
    info
}
