//! Device memory (CUDA, HIP, Ascend) as the transports see it: which kind of memory a
//! registered buffer is, copies between it and host memory through the runtime-loaded
//! driver, and a pool of pinned host bounce buffers for staging.
//!
//! Classification happens once, when a buffer is registered (`classify`): a location
//! `cuda:N` / `hip:N` / `npu:N` is trusted if the driver loads and, for CUDA and HIP,
//! the driver's pointer query agrees (device memory of device N); a disagreement is a
//! registration error. `npu:N` is checked against the device count and, where ACL has
//! a pointer query (CANN 7+), against its answer. Every other location (`cpu:0`, ...)
//! is host memory and costs no driver call, now or per transfer: host buffers never
//! reach this module.
//!
//! The CPU must never dereference device memory. Transports that move bytes with the
//! CPU (TCP, shared memory, local memcpy) stage it: device → pinned bounce → wire, and
//! wire → bounce → device, a bounce (`BOUNCE_SIZE`) at a time.

use crate::util::sync::Unpoisoned;
use std::sync::Mutex;

use crate::error::{Code, Error, Result};
use crate::ffi::{acl, cuda, hip};

/// Where a registered buffer's bytes live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Ordinary host memory.
    #[default]
    Host,
    /// Memory of CUDA device `n`.
    Cuda(i32),
    /// Memory of HIP (ROCm) device `n`.
    Hip(i32),
    /// Memory of Ascend NPU `n`.
    Npu(i32),
}

impl MemoryKind {
    /// True for host memory.
    pub fn is_host(self) -> bool {
        self == MemoryKind::Host
    }

    /// Parses a location string without asking any driver: `cuda:N`, `hip:N`, `npu:N`
    /// are device memory; anything else (`cpu:0`, `*`, empty) is host memory.
    pub fn parse_location(location: &str) -> Result<MemoryKind> {
        let (family, ordinal) = location.split_once(':').unwrap_or((location, "0"));
        let make: fn(i32) -> MemoryKind = match family {
            "cuda" => MemoryKind::Cuda,
            "hip" => MemoryKind::Hip,
            "npu" => MemoryKind::Npu,
            _ => return Ok(MemoryKind::Host),
        };
        match ordinal.parse::<i32>() {
            Ok(n) if n >= 0 => Ok(make(n)),
            _ => Err(Error::invalid(format!(
                "location {location:?}: expected {family}:<device number>"
            ))),
        }
    }

    /// Whether a location names device memory (peers' buffer names, no driver call).
    pub fn location_is_device(location: &str) -> bool {
        !matches!(MemoryKind::parse_location(location), Ok(MemoryKind::Host))
    }

    /// The location string this kind is registered under.
    pub fn location(self) -> String {
        match self {
            MemoryKind::Host => "cpu:0".into(),
            MemoryKind::Cuda(n) => format!("cuda:{n}"),
            MemoryKind::Hip(n) => format!("hip:{n}"),
            MemoryKind::Npu(n) => format!("npu:{n}"),
        }
    }
}

/// What kind of memory `[addr, addr+len)`, registered under `location`, is. Host
/// locations return at once; device locations ask the driver (see the module notes),
/// and leave the calling thread's current device as it was.
pub fn classify(addr: u64, len: u64, location: &str) -> Result<MemoryKind> {
    let kind = MemoryKind::parse_location(location)?;
    let mismatch = |what: String| {
        Error::invalid(format!(
            "buffer [{addr:#x}, +{len}) registered as {location}, but {what}"
        ))
    };
    // The values come from C callers: a range past the end of the address space is
    // refused here, before any probe or allocation sized by it.
    let last = addr
        .checked_add(len.max(1) - 1)
        .ok_or_else(|| mismatch("it runs past the end of the address space".into()))?;
    // Registration runs on the caller's thread (torch's, say), whose device must stay.
    let _caller_device = CurrentKept::save(kind);
    match kind {
        // Peers and local copies would fault on a hole; refuse it now instead.
        MemoryKind::Host if !crate::sys::is_mapped(addr, len) => {
            return Err(mismatch("part of it is not mapped in this process".into()))
        }
        MemoryKind::Host => {}
        MemoryKind::Cuda(n) => {
            let api = cuda::api()?;
            api.make_current(n)?;
            for probe in [addr, last] {
                match api.pointer_info(probe)? {
                    None | Some((cuda::CU_MEMORYTYPE_HOST, _)) => {
                        return Err(mismatch(format!(
                            "the CUDA driver says {probe:#x} is host memory"
                        )))
                    }
                    Some((_, ordinal)) if ordinal != n => {
                        return Err(mismatch(format!(
                            "the CUDA driver says {probe:#x} is on cuda:{ordinal}"
                        )))
                    }
                    Some(_) => {}
                }
            }
        }
        MemoryKind::Hip(n) => {
            let api = hip::api()?;
            api.make_current(n)?;
            for probe in [addr, last] {
                match api.pointer_info(probe)? {
                    hip::HipMemory::Host => {
                        return Err(mismatch(format!(
                            "the HIP runtime says {probe:#x} is host memory"
                        )))
                    }
                    hip::HipMemory::Device(d) if d != n => {
                        return Err(mismatch(format!(
                            "the HIP runtime says {probe:#x} is on hip:{d}"
                        )))
                    }
                    hip::HipMemory::Device(_) => {}
                }
            }
        }
        MemoryKind::Npu(n) => {
            let api = acl::api()?;
            let count = api.device_count()?;
            if n as u32 >= count {
                return Err(mismatch(format!("ACL sees {count} device(s)")));
            }
            // Only a definite answer refuses: a runtime without the query, or one that
            // cannot place the address, leaves the location trusted as before.
            for probe in [addr, last] {
                match api.pointer_info(probe)? {
                    Some(acl::AclMemory::NotDevice) => {
                        return Err(mismatch(format!(
                            "ACL says {probe:#x} is not device memory"
                        )))
                    }
                    Some(acl::AclMemory::Device(d)) if d != n => {
                        return Err(mismatch(format!("ACL says {probe:#x} is on npu:{d}")))
                    }
                    Some(acl::AclMemory::Device(_)) | None => {}
                }
            }
        }
    }
    Ok(kind)
}

/// Which device's memory `[addr, addr+len)` is, by the loaded CUDA and/or HIP runtime's
/// pointer query on its first and last byte; `None` when neither claims it (host
/// memory). A thread with no CUDA context borrows device 0's for the query (the driver
/// may refuse the query without one) and is left as it was. For callers given host
/// memory that must not touch a device pointer by mistake.
pub fn device_memory_at(addr: u64, len: u64, cuda: bool, hip: bool) -> Result<Option<MemoryKind>> {
    let last = addr.checked_add(len.max(1) - 1).ok_or_else(|| {
        Error::invalid(format!(
            "buffer [{addr:#x}, +{len}) runs past the end of the address space"
        ))
    })?;
    if cuda {
        let api = cuda::api()?;
        let _kept = match api.current_context()? {
            0 => {
                let kept = CurrentKept::save(MemoryKind::Cuda(0));
                api.make_current(0)?;
                Some(kept)
            }
            _ => None,
        };
        for probe in [addr, last] {
            if let Some((kind, ordinal)) = api.pointer_info(probe)? {
                if kind != cuda::CU_MEMORYTYPE_HOST {
                    return Ok(Some(MemoryKind::Cuda(ordinal)));
                }
            }
        }
    }
    if hip {
        for probe in [addr, last] {
            if let hip::HipMemory::Device(d) = hip::api()?.pointer_info(probe)? {
                return Ok(Some(MemoryKind::Hip(d)));
            }
        }
    }
    Ok(None)
}

/// Which NPU's memory `[addr, addr+len)` is, by ACL's pointer query on its first and
/// last byte; `None` when ACL does not call it device memory, or has no pointer query
/// (CANN before 7: nothing can be checked then). As `device_memory_at`, for Ascend.
pub fn npu_memory_at(addr: u64, len: u64) -> Result<Option<MemoryKind>> {
    let last = addr.checked_add(len.max(1) - 1).ok_or_else(|| {
        Error::invalid(format!(
            "buffer [{addr:#x}, +{len}) runs past the end of the address space"
        ))
    })?;
    let api = acl::api()?;
    for probe in [addr, last] {
        if let Some(acl::AclMemory::Device(d)) = api.pointer_info(probe)? {
            return Ok(Some(MemoryKind::Npu(d)));
        }
    }
    Ok(None)
}

fn host_kind_error() -> Error {
    Error::new(Code::Internal, "device copy asked for host memory")
}

/// The calls every device runtime's table offers, so that dispatch on a
/// `MemoryKind` is one lookup (`runtime`) instead of a match per operation.
trait Runtime: Sync {
    fn make_current(&self, ordinal: i32) -> Result<()>;
    /// # Safety
    /// As the table's method of the same name.
    unsafe fn copy_dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<()>;
    /// # Safety
    /// As the table's method of the same name.
    unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<()>;
    /// # Safety
    /// As the table's method of the same name.
    unsafe fn copy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<()>;
    fn host_alloc(&self, len: usize) -> Result<*mut u8>;
    /// # Safety
    /// As the table's method of the same name.
    unsafe fn host_free(&self, p: *mut u8);
    fn mem_alloc(&self, ordinal: i32, len: usize) -> Result<u64>;
    /// # Safety
    /// As the table's method of the same name.
    unsafe fn mem_free(&self, p: u64) -> Result<()>;
}

macro_rules! runtime_table {
    ($t:ty) => {
        impl Runtime for $t {
            fn make_current(&self, ordinal: i32) -> Result<()> {
                Ok(<$t>::make_current(self, ordinal)?)
            }
            unsafe fn copy_dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
                // SAFETY: this trait method's `# Safety` is the table method's, so the caller's
                // guarantee (`dst` writable for `len` bytes, `src` `len` bytes of device memory) is
                // passed on unchanged.
                Ok(unsafe { <$t>::copy_dtoh(self, dst, src, len) }?)
            }
            unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
                // SAFETY: the caller guarantees what the table's `copy_htod` needs (`src` readable
                // for `len` bytes, `dst` `len` bytes of device memory); the arguments are passed on
                // unchanged.
                Ok(unsafe { <$t>::copy_htod(self, dst, src, len) }?)
            }
            unsafe fn copy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<()> {
                // SAFETY: the caller guarantees what the table's `copy_dtod` needs (both ranges
                // `len` bytes of device memory); the arguments are passed on unchanged.
                Ok(unsafe { <$t>::copy_dtod(self, dst, src, len) }?)
            }
            fn host_alloc(&self, len: usize) -> Result<*mut u8> {
                Ok(<$t>::host_alloc(self, len)?)
            }
            unsafe fn host_free(&self, p: *mut u8) {
                // SAFETY: the caller guarantees `p` came from this table's `host_alloc` and is not
                // used again, which is the table's `host_free` contract.
                unsafe { <$t>::host_free(self, p) }
            }
            fn mem_alloc(&self, ordinal: i32, len: usize) -> Result<u64> {
                Ok(<$t>::mem_alloc(self, ordinal, len)?)
            }
            unsafe fn mem_free(&self, p: u64) -> Result<()> {
                // SAFETY: the caller guarantees `p` came from this table's `mem_alloc` and is not
                // used again, which is the table's `mem_free` contract.
                Ok(unsafe { <$t>::mem_free(self, p) }?)
            }
        }
    };
}
runtime_table!(cuda::Cuda);
runtime_table!(hip::Hip);
runtime_table!(acl::Acl);

/// The loaded runtime of a device kind, with that device made current on this thread.
fn runtime(kind: MemoryKind) -> Result<&'static dyn Runtime> {
    let (rt, ordinal): (&'static dyn Runtime, i32) = match kind {
        MemoryKind::Host => return Err(host_kind_error()),
        MemoryKind::Cuda(n) => (cuda::api()?, n),
        MemoryKind::Hip(n) => (hip::api()?, n),
        MemoryKind::Npu(n) => (acl::api()?, n),
    };
    rt.make_current(ordinal)?;
    Ok(rt)
}

/// The device context (CUDA) or current device (HIP, Ascend) this thread had when
/// saved, made current again on drop. Device calls switch the calling thread's device;
/// a caller such as torch keeps its own current device and must find it unchanged.
/// An Ascend thread with no device set yet keeps the one a call set (ACL cannot unset
/// it), as does one whose runtime lacks `aclrtGetDevice`.
pub struct CurrentKept(Option<SavedCurrent>);

enum SavedCurrent {
    Cuda(usize),
    Hip(i32),
    Npu(i32),
}

impl CurrentKept {
    /// Saves this thread's current device of `kind`'s runtime (nothing for host
    /// memory, or when the runtime does not load: no driver call is made then).
    pub fn save(kind: MemoryKind) -> CurrentKept {
        let saved = match kind {
            MemoryKind::Cuda(_) => cuda::api()
                .and_then(|a| a.current_context())
                .ok()
                .map(SavedCurrent::Cuda),
            MemoryKind::Hip(_) => hip::api()
                .and_then(|a| a.current_device())
                .ok()
                .map(SavedCurrent::Hip),
            MemoryKind::Npu(_) => acl::api()
                .and_then(|a| a.current_device())
                .ok()
                .flatten()
                .map(SavedCurrent::Npu),
            MemoryKind::Host => None,
        };
        CurrentKept(saved)
    }
}

impl Drop for CurrentKept {
    fn drop(&mut self) {
        let restored = match self.0 {
            Some(SavedCurrent::Cuda(ctx)) => cuda::api().and_then(|a| a.restore_context(ctx)),
            Some(SavedCurrent::Hip(d)) => hip::api().and_then(|a| a.make_current(d)),
            Some(SavedCurrent::Npu(d)) => acl::api().and_then(|a| a.make_current(d)),
            None => Ok(()),
        };
        if let Err(e) = restored {
            log::warn!("could not make the caller's device current again: {e}");
        }
    }
}

/// Waits for the device's outstanding work. A copy from pageable (unpinned) host
/// memory may return before the bytes reach the device; ACL's copies return when done.
fn synchronize(kind: MemoryKind) -> Result<()> {
    match kind {
        MemoryKind::Cuda(n) => {
            let api = cuda::api()?;
            api.make_current(n)?;
            Ok(api.synchronize()?)
        }
        MemoryKind::Hip(n) => {
            let api = hip::api()?;
            api.make_current(n)?;
            Ok(api.synchronize()?)
        }
        MemoryKind::Host | MemoryKind::Npu(_) => Ok(()),
    }
}

/// Device → host, synchronous.
///
/// # Safety
/// `dst` must be valid for `len` bytes of writes; `src` must be `len` bytes of device
/// memory of `kind`.
pub unsafe fn copy_to_host(kind: MemoryKind, dst: *mut u8, src: u64, len: usize) -> Result<()> {
    // SAFETY: the caller guarantees `dst` is writable for `len` bytes and `src` is `len` bytes of
    // device memory of `kind`, and `runtime(kind)` picks that kind's table, so its `copy_dtoh`
    // contract holds.
    unsafe { runtime(kind)?.copy_dtoh(dst, src, len) }
}

/// Host → device: done on the device when it returns. A source the driver does not
/// know as pinned adds a device synchronize, since a copy from pageable memory may
/// return before its DMA to the device is done; pinned sources need no wait.
///
/// # Safety
/// `src` must be valid for `len` bytes of reads; `dst` must be `len` bytes of device
/// memory of `kind`.
pub unsafe fn copy_from_host(kind: MemoryKind, dst: u64, src: *const u8, len: usize) -> Result<()> {
    // SAFETY: the caller's guarantee, passed on.
    unsafe { copy_htod_unwaited(kind, dst, src, len) }?;
    if !known_pinned(kind, src as u64) {
        synchronize(kind)?;
    }
    Ok(())
}

/// Host → device, one driver copy and no wait: for callers that know whether their
/// source is pinned and synchronize themselves when it is not (bounce and staging
/// buffers).
///
/// # Safety
/// As `copy_from_host`.
unsafe fn copy_htod_unwaited(kind: MemoryKind, dst: u64, src: *const u8, len: usize) -> Result<()> {
    // SAFETY: the caller guarantees `src` is readable for `len` bytes and `dst` is `len` bytes of
    // device memory of `kind`, and `runtime(kind)` picks that kind's table, so its `copy_htod`
    // contract holds.
    unsafe { runtime(kind)?.copy_htod(dst, src, len) }
}

/// Whether host address `addr` is pinned memory that `kind`'s copies complete from
/// before returning. CUDA's pointer query says so (no device round trip, unlike a
/// synchronize); HIP's cannot tell pinned from pageable, so HIP sources never count;
/// ACL's copies always complete (its synchronize is a no-op anyway).
fn known_pinned(kind: MemoryKind, addr: u64) -> bool {
    match kind {
        MemoryKind::Cuda(_) => cuda::api()
            .and_then(|a| a.pointer_info(addr))
            .is_ok_and(|info| matches!(info, Some((cuda::CU_MEMORYTYPE_HOST, _)))),
        MemoryKind::Npu(_) => true,
        MemoryKind::Host | MemoryKind::Hip(_) => false,
    }
}

/// Host → device from a bounce buffer taken for `kind`: done on the device when it
/// returns, pinned or not (a copy from unpinned memory is followed by a wait).
///
/// # Safety
/// `bounce` must hold `len` readable bytes; `dst` must be `len` bytes of device memory
/// of `kind`.
pub unsafe fn copy_from_bounce(
    kind: MemoryKind,
    dst: u64,
    bounce: &Bounce,
    len: usize,
) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { copy_htod_unwaited(kind, dst, bounce.ptr(), len) }?;
    if !bounce.is_pinned() {
        synchronize(kind)?;
    }
    Ok(())
}

/// Zeroed device memory of `kind` from its driver; release with `free`.
pub fn alloc(kind: MemoryKind, len: usize) -> Result<u64> {
    let ordinal = match kind {
        MemoryKind::Cuda(n) | MemoryKind::Hip(n) | MemoryKind::Npu(n) => n,
        MemoryKind::Host => return Err(host_kind_error()),
    };
    let _caller_device = CurrentKept::save(kind);
    let addr = runtime(kind)?.mem_alloc(ordinal, len)?;
    // Drivers hand out whatever the memory held before: zero it a bounce at a time.
    let mut zeros = Bounce::take(kind);
    zeros.bytes_mut(BOUNCE_SIZE).fill(0);
    let mut off = 0;
    while off < len {
        let n = (len - off).min(BOUNCE_SIZE);
        // SAFETY: `addr` is a fresh allocation of `len` bytes; the bounce holds `n`.
        if let Err(e) = unsafe { copy_htod_unwaited(kind, addr + off as u64, zeros.ptr(), n) } {
            // SAFETY: allocated above, never handed out.
            let _ = unsafe { free(kind, addr) };
            return Err(e);
        }
        off += n;
    }
    if !zeros.is_pinned() {
        if let Err(e) = synchronize(kind) {
            // SAFETY: allocated above, never handed out.
            let _ = unsafe { free(kind, addr) };
            return Err(e);
        }
    }
    Ok(addr)
}

/// # Safety
/// `addr` must come from `alloc(kind, ..)` and not be used afterwards.
pub unsafe fn free(kind: MemoryKind, addr: u64) -> Result<()> {
    let _caller_device = CurrentKept::save(kind);
    // SAFETY: the caller guarantees `addr` came from `alloc(kind, ..)`, i.e. from the `mem_alloc`
    // of the same table `runtime(kind)` returns, and is not used again.
    unsafe { runtime(kind)?.mem_free(addr) }
}

/// Any → any: plain memcpy for host to host, one driver copy when a device is
/// involved, and a staged copy through a bounce buffer between different runtimes.
///
/// # Safety
/// Both ranges must be valid for `len` bytes of memory of the stated kinds; host ranges
/// may overlap (memmove semantics), device ranges must not.
pub unsafe fn copy(
    dst_kind: MemoryKind,
    dst: u64,
    src_kind: MemoryKind,
    src: u64,
    len: usize,
) -> Result<()> {
    use MemoryKind::*;
    // SAFETY (all arms): the caller guarantees both ranges are valid for `len` bytes of the
    // stated kinds, and not overlapping on a device; each arm says how its callee is satisfied.
    match (dst_kind, src_kind) {
        (Host, Host) => {
            // SAFETY: both host ranges are valid for `len` bytes (contract); `copy` is
            // memmove, so overlap is fine.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
            Ok(())
        }
        // SAFETY: `dst` is host memory and `src` memory of kind `k`, both `len` bytes.
        (Host, k) => unsafe { copy_to_host(k, dst as *mut u8, src, len) },
        // SAFETY: `dst` is memory of kind `k` and `src` host memory, both `len` bytes.
        (k, Host) => unsafe { copy_from_host(k, dst, src as *const u8, len) },
        // SAFETY: both ranges are `len` bytes of the same runtime's device memory and
        // do not overlap (contract).
        (Cuda(_), Cuda(_)) | (Hip(_), Hip(_)) => unsafe {
            runtime(src_kind)?.copy_dtod(dst, src, len)
        },
        // SAFETY: both ranges are `len` bytes of one NPU's memory and do not overlap.
        (Npu(d), Npu(n)) if d == n => unsafe { runtime(src_kind)?.copy_dtod(dst, src, len) },
        (d, s) => {
            let bounce = Bounce::take(s);
            let mut off = 0;
            while off < len {
                let n = (len - off).min(bounce.len());
                // SAFETY: the bounce holds `n` bytes, and `[off, off + n)` lies inside
                // both caller ranges, which are valid for `len` bytes of their kinds.
                unsafe {
                    copy_to_host(s, bounce.ptr(), src + off as u64, n)?;
                    copy_htod_unwaited(d, dst + off as u64, bounce.ptr(), n)?;
                }
                off += n;
            }
            // The bounce is pinned, if at all, by the source's runtime.
            if !bounce.is_pinned() || pool_index(d) != pool_index(s) {
                synchronize(d)?;
            }
            Ok(())
        }
    }
}

/// Bytes in one bounce buffer; device-side slices are cut to this size.
pub const BOUNCE_SIZE: usize = 4 << 20;
/// Idle pinned buffers kept per runtime for reuse; more are freed when returned.
const POOL_KEEP: usize = 32;

/// Idle pinned buffers per runtime (CUDA, HIP, ACL), as addresses.
static POOLS: [Mutex<Vec<usize>>; 3] = [
    Mutex::new(Vec::new()),
    Mutex::new(Vec::new()),
    Mutex::new(Vec::new()),
];

fn pool_index(kind: MemoryKind) -> Option<usize> {
    match kind {
        MemoryKind::Host => None,
        MemoryKind::Cuda(_) => Some(0),
        MemoryKind::Hip(_) => Some(1),
        MemoryKind::Npu(_) => Some(2),
    }
}

/// `len` bytes pinned by `kind`'s runtime (no heap box), or heap memory when it cannot
/// pin them (logged, naming `what`): the address and the box that owns heap memory.
fn pinned_or_heap(kind: MemoryKind, len: usize, what: &str) -> (*mut u8, Option<Box<[u8]>>) {
    if pool_index(kind).is_some() && len > 0 {
        match runtime(kind).and_then(|rt| rt.host_alloc(len)) {
            Ok(p) if !p.is_null() => return (p, None),
            Ok(_) => log::warn!("pinned {what} allocation returned null; using heap memory"),
            Err(e) => log::warn!("pinned {what} allocation failed ({e}); using heap memory"),
        }
    }
    let mut heap = vec![0u8; len].into_boxed_slice();
    (heap.as_mut_ptr(), Some(heap))
}

/// Frees pinned memory with a device of its runtime current (CUDA refuses the free on
/// a thread without a context, e.g. one dropping a group), the caller's kept.
///
/// # Safety
/// `p` must come from the `host_alloc` of `kind`'s runtime and not be used afterwards.
unsafe fn pinned_free(kind: MemoryKind, p: *mut u8) {
    let _kept = CurrentKept::save(kind);
    match runtime(kind) {
        // SAFETY: the caller guarantees `p` came from this runtime's `host_alloc` (pinned
        // memory is portable: any device of the runtime may free it) and is not used again.
        Ok(rt) => unsafe { rt.host_free(p) },
        Err(e) => log::warn!("pinned memory not freed: {e}"),
    }
}

/// A host staging buffer of `BOUNCE_SIZE` bytes: pinned by the device's runtime when
/// it can be (fast DMA), ordinary heap memory otherwise. Returned to its pool on drop.
pub struct Bounce {
    ptr: *mut u8,
    /// The memory a pinned buffer was taken for (its runtime's pool takes it back);
    /// `None` for heap memory.
    pinned: Option<MemoryKind>,
    _heap: Option<Box<[u8]>>,
}

// SAFETY: the buffer is exclusively owned; the raw pointer is just its address.
unsafe impl Send for Bounce {}

impl Bounce {
    /// A bounce buffer for staging memory of `kind`: a pooled pinned one, a freshly
    /// pinned one, or (when pinning fails) heap memory. Never blocks on other users.
    pub fn take(kind: MemoryKind) -> Bounce {
        if let Some(i) = pool_index(kind) {
            let reused = POOLS[i].locked().pop();
            if let Some(p) = reused {
                return Bounce {
                    ptr: p as *mut u8,
                    pinned: Some(kind),
                    _heap: None,
                };
            }
        }
        let (ptr, heap) = pinned_or_heap(kind, BOUNCE_SIZE, "bounce");
        Bounce {
            ptr,
            pinned: heap.is_none().then_some(kind),
            _heap: heap,
        }
    }

    /// Start of the bounce buffer.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its size in bytes (always `BOUNCE_SIZE`).
    pub fn len(&self) -> usize {
        BOUNCE_SIZE
    }

    /// Always false: a bounce buffer is never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// True when the buffer is page-locked by the device runtime (DMA-capable).
    pub fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }

    /// The first `len` bytes (at most `BOUNCE_SIZE`).
    pub fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        // SAFETY: the buffer holds BOUNCE_SIZE bytes owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len.min(BOUNCE_SIZE)) }
    }

    /// The first `len` bytes (at most the buffer's size), read-only.
    pub fn bytes(&self, len: usize) -> &[u8] {
        // SAFETY: `self.ptr` points at BOUNCE_SIZE bytes owned by `self` (pinned or `_heap`), and
        // the length is capped at BOUNCE_SIZE; `&self` rules out a concurrent `bytes_mut`.
        unsafe { std::slice::from_raw_parts(self.ptr, len.min(BOUNCE_SIZE)) }
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        let Some(kind) = self.pinned else { return };
        let Some(i) = pool_index(kind) else { return };
        let mut pool = POOLS[i].locked();
        if pool.len() < POOL_KEEP {
            pool.push(self.ptr as usize);
        } else {
            drop(pool);
            // SAFETY: a pinned buffer of `kind`'s runtime, no longer referenced.
            unsafe { pinned_free(kind, self.ptr) };
        }
    }
}

/// Host memory of any length for staging device memory of `kind` with one driver copy
/// each way (a bounce buffer would take one copy per `BOUNCE_SIZE`): pinned by the
/// device's runtime when it can be, heap memory otherwise. Freed on drop; callers that
/// stage repeatedly keep these for reuse, since pinning costs more than a copy.
pub struct Staging {
    ptr: *mut u8,
    len: usize,
    kind: MemoryKind,
    /// True when the runtime of `kind` pinned it; heap memory otherwise.
    pinned: bool,
    _heap: Option<Box<[u8]>>,
}

// SAFETY: the memory is exclusively owned; the raw pointer is just its address.
unsafe impl Send for Staging {}

impl Staging {
    /// `len` bytes for staging memory of `kind` (contents unspecified).
    pub fn new(kind: MemoryKind, len: usize) -> Staging {
        let (ptr, heap) = pinned_or_heap(kind, len, "staging");
        Staging {
            ptr,
            len,
            kind,
            pinned: heap.is_none(),
            _heap: heap,
        }
    }

    /// The memory kind this buffer stages.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when the buffer is page-locked by the device runtime (DMA-capable).
    pub fn is_pinned(&self) -> bool {
        self.pinned
    }

    /// The first `len` bytes (at most the buffer's size), read-only.
    pub fn bytes(&self, len: usize) -> &[u8] {
        // SAFETY: `self.ptr` points at `self.len` bytes owned by `self` (pinned or `_heap`),
        // and the length is capped at that; `&self` rules out a concurrent `bytes_mut`.
        unsafe { std::slice::from_raw_parts(self.ptr, len.min(self.len)) }
    }

    /// The first `len` bytes (at most the buffer's size).
    pub fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        // SAFETY: as `bytes`, with `&mut self` making the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len.min(self.len)) }
    }

    /// Device → this buffer: `len` bytes from `src`, one driver copy (none for 0 bytes).
    ///
    /// # Safety
    /// `src` must be `len` bytes of device memory of `self.kind()`.
    pub unsafe fn fill_from(&mut self, src: u64, len: usize) -> Result<()> {
        if len > self.len {
            return Err(Error::invalid(format!(
                "staging {len} bytes into a buffer of {}",
                self.len
            )));
        }
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the buffer holds at least `len` bytes (checked); `src` is `len` bytes of
        // device memory of `self.kind` (caller's guarantee).
        unsafe { copy_to_host(self.kind, self.ptr, src, len) }
    }

    /// This buffer → device: `len` bytes to `dst`, one driver copy (none for 0 bytes),
    /// done on the device when this returns (heap memory adds a device synchronize).
    ///
    /// # Safety
    /// `dst` must be `len` bytes of device memory of `self.kind()`.
    pub unsafe fn drain_to(&self, dst: u64, len: usize) -> Result<()> {
        if len > self.len {
            return Err(Error::invalid(format!(
                "unstaging {len} bytes from a buffer of {}",
                self.len
            )));
        }
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the buffer holds at least `len` bytes (checked); `dst` is `len` bytes of
        // device memory of `self.kind` (caller's guarantee).
        unsafe { copy_htod_unwaited(self.kind, dst, self.ptr, len) }?;
        if !self.pinned {
            synchronize(self.kind)?;
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.pinned {
            // SAFETY: pinned memory of `kind`'s runtime from `Staging::new`, no longer
            // referenced.
            unsafe { pinned_free(self.kind, self.ptr) };
        }
    }
}

/// Checks that `kind` names a device this process can use: its runtime loads and the
/// device exists (the thread's current device is left as it was). Host memory needs no
/// check.
pub fn check_available(kind: MemoryKind) -> Result<()> {
    if kind.is_host() {
        return Ok(());
    }
    let _caller_device = CurrentKept::save(kind);
    runtime(kind).map(|_| ())
}

/// What a same-host process needs to reach a device buffer: the IPC handle of the
/// driver allocation holding it (handles name whole allocations) and the buffer's
/// offset inside that allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcExport {
    /// The runtime's IPC handle for the allocation.
    pub handle: [u8; 64],
    /// Where the buffer starts inside that allocation.
    pub offset: u64,
}

/// Exports the allocation holding `addr` (CUDA or HIP IPC); another process on this
/// host maps it with `ipc_open` and adds `offset`.
pub fn ipc_export(kind: MemoryKind, addr: u64) -> Result<IpcExport> {
    let _caller_device = CurrentKept::save(kind);
    let rt = ipc_runtime(kind)?;
    let (base, _) = rt.mem_range(addr)?;
    Ok(IpcExport {
        handle: rt.ipc_handle(base)?,
        offset: addr - base,
    })
}

/// Maps a peer's IPC handle on device `kind` of this process; returns the mapped
/// allocation's base. Release with `ipc_close`.
pub fn ipc_open(kind: MemoryKind, handle: &[u8; 64]) -> Result<u64> {
    let _caller_device = CurrentKept::save(kind);
    ipc_runtime(kind)?.ipc_open(handle)
}

/// # Safety
/// `addr` must come from `ipc_open(kind, ..)` and not be used afterwards.
pub unsafe fn ipc_close(kind: MemoryKind, addr: u64) -> Result<()> {
    let _caller_device = CurrentKept::save(kind);
    // SAFETY: the caller guarantees `addr` came from `ipc_open(kind, ..)`, i.e. from the same table
    // `ipc_runtime(kind)` returns, and is not used again.
    unsafe { ipc_runtime(kind)?.ipc_close(addr) }
}

/// The IPC calls of the runtimes that have them (CUDA, HIP); handles are 64 opaque
/// bytes in both.
trait IpcRuntime {
    fn mem_range(&self, addr: u64) -> Result<(u64, usize)>;
    fn ipc_handle(&self, base: u64) -> Result<[u8; 64]>;
    fn ipc_open(&self, handle: &[u8; 64]) -> Result<u64>;
    /// # Safety
    /// As the table's `ipc_close`.
    unsafe fn ipc_close(&self, addr: u64) -> Result<()>;
}

macro_rules! ipc_table {
    ($t:ty, $handle:expr) => {
        impl IpcRuntime for $t {
            fn mem_range(&self, addr: u64) -> Result<(u64, usize)> {
                Ok(<$t>::mem_range(self, addr)?)
            }
            fn ipc_handle(&self, base: u64) -> Result<[u8; 64]> {
                Ok(self.ipc_get_handle(base)?.reserved)
            }
            fn ipc_open(&self, handle: &[u8; 64]) -> Result<u64> {
                Ok(<$t>::ipc_open(self, &$handle(*handle))?)
            }
            unsafe fn ipc_close(&self, addr: u64) -> Result<()> {
                // SAFETY: the caller guarantees `addr` came from this table's `ipc_open` and is not
                // used again, which is the table's `ipc_close` contract.
                Ok(unsafe { <$t>::ipc_close(self, addr) }?)
            }
        }
    };
}
ipc_table!(cuda::Cuda, |reserved| cuda::CUipcMemHandle { reserved });
ipc_table!(hip::Hip, |reserved| hip::HipIpcMemHandle { reserved });

/// The IPC-capable runtime of a device kind, with that device made current.
fn ipc_runtime(kind: MemoryKind) -> Result<&'static dyn IpcRuntime> {
    let rt: &'static dyn IpcRuntime = match kind {
        MemoryKind::Cuda(_) => cuda::api()?,
        MemoryKind::Hip(_) => hip::api()?,
        _ => {
            return Err(Error::new(
                Code::NotSupported,
                format!("no IPC handles for {} memory", kind.location()),
            ))
        }
    };
    // Makes the device current on this thread.
    runtime(kind)?;
    Ok(rt)
}

/// A dma-buf for GPUDirect RDMA registration (`ibv_reg_dmabuf_mr`): the descriptor
/// covers the whole driver allocation holding the buffer; `offset` is where the
/// buffer starts inside it.
#[derive(Debug)]
pub struct DmaBuf {
    /// The dma-buf descriptor.
    pub fd: std::os::fd::OwnedFd,
    /// Where the buffer starts inside it.
    pub offset: u64,
}

/// Exports the allocation holding `[addr, addr+len)` as a dma-buf; `NotSupported`
/// where the driver offers none (HIP, Ascend, CUDA before 11.7).
pub fn dma_buf(kind: MemoryKind, addr: u64, len: u64) -> Result<DmaBuf> {
    use std::os::fd::FromRawFd;
    match kind {
        MemoryKind::Cuda(n) => {
            let api = cuda::api()?;
            let _caller_device = CurrentKept::save(kind);
            api.make_current(n)?;
            let (base, size) = api.mem_range(addr)?;
            let end = addr.checked_add(len);
            if end.is_none_or(|end| end > base + size as u64) {
                return Err(Error::invalid(format!(
                    "[{addr:#x}, +{len}) spans more than one CUDA allocation"
                )));
            }
            let fd = api.dma_buf_fd(base, size)?;
            Ok(DmaBuf {
                // SAFETY: the driver handed us this fresh descriptor to own.
                fd: unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) },
                offset: addr - base,
            })
        }
        _ => Err(Error::new(
            Code::NotSupported,
            format!("no dma-buf export for {} memory", kind.location()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse_without_drivers() {
        assert_eq!(
            MemoryKind::parse_location("cpu:0").unwrap(),
            MemoryKind::Host
        );
        assert_eq!(MemoryKind::parse_location("").unwrap(), MemoryKind::Host);
        assert_eq!(MemoryKind::parse_location("*").unwrap(), MemoryKind::Host);
        assert_eq!(
            MemoryKind::parse_location("cuda:1").unwrap(),
            MemoryKind::Cuda(1)
        );
        assert_eq!(
            MemoryKind::parse_location("hip:0").unwrap(),
            MemoryKind::Hip(0)
        );
        assert_eq!(
            MemoryKind::parse_location("npu:3").unwrap(),
            MemoryKind::Npu(3)
        );
        assert_eq!(
            MemoryKind::parse_location("cuda").unwrap(),
            MemoryKind::Cuda(0)
        );
        assert!(MemoryKind::parse_location("cuda:x").is_err());
        assert!(MemoryKind::parse_location("npu:-1").is_err());
        assert!(MemoryKind::location_is_device("cuda:0"));
        assert!(!MemoryKind::location_is_device("cpu:1"));
        let mem = [0u8; 10];
        let addr = mem.as_ptr() as u64;
        assert_eq!(classify(addr, 10, "cpu:0").unwrap(), MemoryKind::Host);
        assert!(
            classify(0x1000, 10, "cpu:0").is_err(),
            "page 1 is never mapped"
        );
    }

    #[test]
    fn ranges_past_the_end_of_the_address_space_are_refused() {
        // Refused before any driver is asked: none is loaded here, and no probe or
        // allocation may be sized by the wrapped end.
        for location in ["cpu:0", "cuda:0", "hip:0"] {
            let e = classify(u64::MAX - 10, 100, location).unwrap_err();
            assert!(e.to_string().contains("past the end"), "{location}: {e}");
        }
        let e = device_memory_at(u64::MAX, 2, true, true).unwrap_err();
        assert!(e.to_string().contains("past the end"), "{e}");
    }
}
