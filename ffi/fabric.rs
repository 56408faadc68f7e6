//! libfabric, loaded at run time: the structs we touch written by hand after
//! `<rdma/fabric.h>`, `fi_domain.h`, `fi_endpoint.h`, `fi_rma.h`, `fi_cm.h` and `fi_eq.h`
//! (libfabric 1.17, x86-64/aarch64 LP64), the constants we use, a table of the exported
//! entry points, and the header's `static inline` calls reproduced through the
//! providers' ops tables.
//!
//! Only setup calls are exported by the library (`fi_getinfo`, `fi_fabric`, ...); the
//! data path (`fi_domain`, `fi_endpoint`, `fi_mr_reg`, `fi_writemsg`, `fi_cq_read`, ...) is
//! reached through function pointers inside each object, exactly as the headers do.

#![allow(non_camel_case_types)]
// The `fi_*`/`FI_*` items mirror the libfabric headers one to one under their C names; their
// documentation is libfabric's (`man fi_getinfo`, ...), so they carry no doc comments
// of their own. The Rust-side helpers below are documented.
#![allow(missing_docs)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};

use super::error::{Backend, DriverError, Error, Result};
use super::loader::{self, BackendInfo};
use super::table::function_table;

/// The variable that overrides which libfabric is loaded.
pub const OVERRIDE_VAR: &str = "MC_FABRIC_LIB";
/// Library names tried when the override is not set.
pub const CANDIDATES: &[&str] = &["libfabric.so.1", "libfabric.so"];

// ---- versions -------------------------------------------------------------------------

/// `FI_VERSION(major, minor)`: the packed version number `fi_getinfo` takes.
pub const fn fi_version(major: u32, minor: u32) -> u32 {
    (major << 16) | minor
}
/// The API these mirrors were written against.
pub const FI_API_VERSION: u32 = fi_version(1, 17);
/// The oldest library whose structs match these mirrors.
pub const FI_MIN_VERSION: u32 = fi_version(1, 9);

// ---- capability and mode bits ---------------------------------------------------------

pub const FI_MSG: u64 = 1 << 1;
pub const FI_RMA: u64 = 1 << 2;
pub const FI_READ: u64 = 1 << 8;
pub const FI_WRITE: u64 = 1 << 9;
pub const FI_RECV: u64 = 1 << 10;
pub const FI_SEND: u64 = 1 << 11;
pub const FI_TRANSMIT: u64 = FI_SEND;
pub const FI_REMOTE_READ: u64 = 1 << 12;
pub const FI_REMOTE_WRITE: u64 = 1 << 13;
pub const FI_RMA_EVENT: u64 = 1 << 56;
pub const FI_HMEM: u64 = 1 << 47;
pub const FI_SOURCE: u64 = 1 << 57;
/// Mode bits: the provider needs caller-owned scratch space in each operation context.
pub const FI_CONTEXT: u64 = 1 << 59;
pub const FI_CONTEXT2: u64 = 1 << 52;

// ---- operation flags -------------------------------------------------------------------

/// The operation reports a completion (the default without selective completion).
pub const FI_COMPLETION: u64 = 1 << 24;
/// A WRITE completes only once its data is visible in the target's memory.
pub const FI_DELIVERY_COMPLETE: u64 = 1 << 28;

// ---- enums ------------------------------------------------------------------------------

pub const FI_EP_RDM: c_int = 3;
pub const FI_AV_UNSPEC: c_int = 0;
pub const FI_AV_MAP: c_int = 1;
pub const FI_AV_TABLE: c_int = 2;
pub const FI_THREAD_UNSPEC: c_int = 0;
pub const FI_THREAD_SAFE: c_int = 1;
pub const FI_PROGRESS_UNSPEC: c_int = 0;
pub const FI_PROGRESS_AUTO: c_int = 1;
pub const FI_PROGRESS_MANUAL: c_int = 2;
pub const FI_CQ_FORMAT_CONTEXT: c_int = 1;
pub const FI_WAIT_NONE: c_int = 0;
pub const FI_WAIT_UNSPEC: c_int = 1;
pub const FI_WAIT_FD: c_int = 3;
pub const FI_CQ_COND_NONE: c_int = 0;
pub const FI_CNTR_EVENTS_COMP: c_int = 0;

// fi_hmem_iface
pub const FI_HMEM_SYSTEM: c_int = 0;
pub const FI_HMEM_CUDA: c_int = 1;
pub const FI_HMEM_ROCR: c_int = 2;
pub const FI_HMEM_ZE: c_int = 3;
pub const FI_HMEM_NEURON: c_int = 4;
pub const FI_HMEM_SYNAPSEAI: c_int = 5;

// ---- memory registration modes -----------------------------------------------------------

pub const FI_MR_LOCAL: c_int = 1 << 2;
pub const FI_MR_RAW: c_int = 1 << 3;
pub const FI_MR_VIRT_ADDR: c_int = 1 << 4;
pub const FI_MR_ALLOCATED: c_int = 1 << 5;
pub const FI_MR_PROV_KEY: c_int = 1 << 6;
pub const FI_MR_MMU_NOTIFY: c_int = 1 << 7;
pub const FI_MR_RMA_EVENT: c_int = 1 << 8;
pub const FI_MR_ENDPOINT: c_int = 1 << 9;
pub const FI_MR_HMEM: c_int = 1 << 10;

// ---- control commands ----------------------------------------------------------------------

pub const FI_GETWAIT: c_int = 5;
pub const FI_ENABLE: c_int = 6;

// ---- errors (negated in return values) -----------------------------------------------------

pub const FI_SUCCESS: c_int = 0;
pub const FI_EAGAIN: c_int = libc::EAGAIN;
pub const FI_ENOSYS: c_int = libc::ENOSYS;
pub const FI_ENODATA: c_int = libc::ENODATA;
pub const FI_ECANCELED: c_int = libc::ECANCELED;
pub const FI_EAVAIL: c_int = 259;
pub const FI_ENOKEY: c_int = 266;

// ---- structs -------------------------------------------------------------------------------

#[repr(C)]
pub struct fi_tx_attr {
    pub caps: u64,
    pub mode: u64,
    pub op_flags: u64,
    pub msg_order: u64,
    pub comp_order: u64,
    pub inject_size: usize,
    pub size: usize,
    pub iov_limit: usize,
    pub rma_iov_limit: usize,
    pub tclass: u32,
}

#[repr(C)]
pub struct fi_rx_attr {
    pub caps: u64,
    pub mode: u64,
    pub op_flags: u64,
    pub msg_order: u64,
    pub comp_order: u64,
    pub total_buffered_recv: usize,
    pub size: usize,
    pub iov_limit: usize,
}

#[repr(C)]
pub struct fi_ep_attr {
    pub type_: c_int,
    pub protocol: u32,
    pub protocol_version: u32,
    pub max_msg_size: usize,
    pub msg_prefix_size: usize,
    pub max_order_raw_size: usize,
    pub max_order_war_size: usize,
    pub max_order_waw_size: usize,
    pub mem_tag_format: u64,
    pub tx_ctx_cnt: usize,
    pub rx_ctx_cnt: usize,
    pub auth_key_size: usize,
    pub auth_key: *mut u8,
}

#[repr(C)]
pub struct fi_domain_attr {
    pub domain: *mut fid_domain,
    pub name: *mut c_char,
    pub threading: c_int,
    pub control_progress: c_int,
    pub data_progress: c_int,
    pub resource_mgmt: c_int,
    pub av_type: c_int,
    pub mr_mode: c_int,
    pub mr_key_size: usize,
    pub cq_data_size: usize,
    pub cq_cnt: usize,
    pub ep_cnt: usize,
    pub tx_ctx_cnt: usize,
    pub rx_ctx_cnt: usize,
    pub max_ep_tx_ctx: usize,
    pub max_ep_rx_ctx: usize,
    pub max_ep_stx_ctx: usize,
    pub max_ep_srx_ctx: usize,
    pub cntr_cnt: usize,
    pub mr_iov_limit: usize,
    pub caps: u64,
    pub mode: u64,
    pub auth_key: *mut u8,
    pub auth_key_size: usize,
    pub max_err_data: usize,
    pub mr_cnt: usize,
    pub tclass: u32,
}

#[repr(C)]
pub struct fi_fabric_attr {
    pub fabric: *mut fid_fabric,
    pub name: *mut c_char,
    pub prov_name: *mut c_char,
    pub prov_version: u32,
    pub api_version: u32,
}

#[repr(C)]
pub struct fi_info {
    pub next: *mut fi_info,
    pub caps: u64,
    pub mode: u64,
    pub addr_format: u32,
    pub src_addrlen: usize,
    pub dest_addrlen: usize,
    pub src_addr: *mut c_void,
    pub dest_addr: *mut c_void,
    pub handle: *mut fid,
    pub tx_attr: *mut fi_tx_attr,
    pub rx_attr: *mut fi_rx_attr,
    pub ep_attr: *mut fi_ep_attr,
    pub domain_attr: *mut fi_domain_attr,
    pub fabric_attr: *mut fi_fabric_attr,
    pub nic: *mut c_void,
}

/// Every libfabric object starts with this.
#[repr(C)]
pub struct fid {
    pub fclass: usize,
    pub context: *mut c_void,
    pub ops: *mut fi_ops,
}

#[repr(C)]
pub struct fi_ops {
    pub size: usize,
    pub close: Option<unsafe extern "C" fn(*mut fid) -> c_int>,
    pub bind: Option<unsafe extern "C" fn(*mut fid, *mut fid, u64) -> c_int>,
    pub control: Option<unsafe extern "C" fn(*mut fid, c_int, *mut c_void) -> c_int>,
    pub ops_open: *const c_void,
    pub tostr: *const c_void,
    pub ops_set: *const c_void,
}

#[repr(C)]
pub struct fi_ops_fabric {
    pub size: usize,
    pub domain: Option<
        unsafe extern "C" fn(
            *mut fid_fabric,
            *mut fi_info,
            *mut *mut fid_domain,
            *mut c_void,
        ) -> c_int,
    >,
    pub passive_ep: *const c_void,
    pub eq_open: *const c_void,
    pub wait_open: *const c_void,
    pub trywait: Option<unsafe extern "C" fn(*mut fid_fabric, *mut *mut fid, c_int) -> c_int>,
    pub domain2: *const c_void,
}

#[repr(C)]
pub struct fid_fabric {
    pub fid: fid,
    pub ops: *mut fi_ops_fabric,
    pub api_version: u32,
}

#[repr(C)]
pub struct fi_ops_domain {
    pub size: usize,
    pub av_open: Option<
        unsafe extern "C" fn(
            *mut fid_domain,
            *mut fi_av_attr,
            *mut *mut fid_av,
            *mut c_void,
        ) -> c_int,
    >,
    pub cq_open: Option<
        unsafe extern "C" fn(
            *mut fid_domain,
            *mut fi_cq_attr,
            *mut *mut fid_cq,
            *mut c_void,
        ) -> c_int,
    >,
    pub endpoint: Option<
        unsafe extern "C" fn(*mut fid_domain, *mut fi_info, *mut *mut fid_ep, *mut c_void) -> c_int,
    >,
    pub scalable_ep: *const c_void,
    pub cntr_open: Option<
        unsafe extern "C" fn(
            *mut fid_domain,
            *mut fi_cntr_attr,
            *mut *mut fid_cntr,
            *mut c_void,
        ) -> c_int,
    >,
    pub poll_open: *const c_void,
    pub stx_ctx: *const c_void,
    pub srx_ctx: *const c_void,
    pub query_atomic: *const c_void,
    pub query_collective: *const c_void,
    pub endpoint2: *const c_void,
}

#[repr(C)]
pub struct fi_ops_mr {
    pub size: usize,
    #[allow(clippy::type_complexity)]
    pub reg: Option<
        unsafe extern "C" fn(
            *mut fid,
            *const c_void,
            usize,
            u64,
            u64,
            u64,
            u64,
            *mut *mut fid_mr,
            *mut c_void,
        ) -> c_int,
    >,
    pub regv: *const c_void,
    pub regattr:
        Option<unsafe extern "C" fn(*mut fid, *const fi_mr_attr, u64, *mut *mut fid_mr) -> c_int>,
}

#[repr(C)]
pub struct fid_domain {
    pub fid: fid,
    pub ops: *mut fi_ops_domain,
    pub mr: *mut fi_ops_mr,
}

#[repr(C)]
pub struct fid_mr {
    pub fid: fid,
    pub mem_desc: *mut c_void,
    pub key: u64,
}

#[repr(C)]
pub struct fi_mr_attr {
    pub mr_iov: *const libc::iovec,
    pub iov_count: usize,
    pub access: u64,
    pub offset: u64,
    pub requested_key: u64,
    pub context: *mut c_void,
    pub auth_key_size: usize,
    pub auth_key: *mut u8,
    pub iface: c_int,
    /// The header's `device` union (`uint64_t reserved` / `int cuda` / ...).
    pub device: u64,
}

#[repr(C)]
pub struct fi_av_attr {
    pub type_: c_int,
    pub rx_ctx_bits: c_int,
    pub count: usize,
    pub ep_per_node: usize,
    pub name: *const c_char,
    pub map_addr: *mut c_void,
    pub flags: u64,
}

#[repr(C)]
pub struct fi_ops_av {
    pub size: usize,
    pub insert: Option<
        unsafe extern "C" fn(
            *mut fid_av,
            *const c_void,
            usize,
            *mut u64,
            u64,
            *mut c_void,
        ) -> c_int,
    >,
    pub insertsvc: *const c_void,
    pub insertsym: *const c_void,
    pub remove: Option<unsafe extern "C" fn(*mut fid_av, *mut u64, usize, u64) -> c_int>,
    pub lookup: *const c_void,
    pub straddr: *const c_void,
    pub av_set: *const c_void,
}

#[repr(C)]
pub struct fid_av {
    pub fid: fid,
    pub ops: *mut fi_ops_av,
}

#[repr(C)]
pub struct fi_cq_attr {
    pub size: usize,
    pub flags: u64,
    pub format: c_int,
    pub wait_obj: c_int,
    pub signaling_vector: c_int,
    pub wait_cond: c_int,
    pub wait_set: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct fi_cq_entry {
    pub op_context: *mut c_void,
}

#[repr(C)]
pub struct fi_cq_err_entry {
    pub op_context: *mut c_void,
    pub flags: u64,
    pub len: usize,
    pub buf: *mut c_void,
    pub data: u64,
    pub tag: u64,
    pub olen: usize,
    pub err: c_int,
    pub prov_errno: c_int,
    pub err_data: *mut c_void,
    pub err_data_size: usize,
}

#[repr(C)]
pub struct fi_ops_cq {
    pub size: usize,
    pub read: Option<unsafe extern "C" fn(*mut fid_cq, *mut c_void, usize) -> isize>,
    pub readfrom: *const c_void,
    pub readerr: Option<unsafe extern "C" fn(*mut fid_cq, *mut fi_cq_err_entry, u64) -> isize>,
    pub sread: *const c_void,
    pub sreadfrom: *const c_void,
    pub signal: *const c_void,
    pub strerror: Option<
        unsafe extern "C" fn(
            *mut fid_cq,
            c_int,
            *const c_void,
            *mut c_char,
            usize,
        ) -> *const c_char,
    >,
}

#[repr(C)]
pub struct fid_cq {
    pub fid: fid,
    pub ops: *mut fi_ops_cq,
}

#[repr(C)]
pub struct fi_cntr_attr {
    pub events: c_int,
    pub wait_obj: c_int,
    pub wait_set: *mut c_void,
    pub flags: u64,
}

#[repr(C)]
pub struct fi_ops_cntr {
    pub size: usize,
    pub read: Option<unsafe extern "C" fn(*mut fid_cntr) -> u64>,
    pub readerr: *const c_void,
    pub add: *const c_void,
    pub set: *const c_void,
    pub wait: *const c_void,
    pub adderr: *const c_void,
    pub seterr: *const c_void,
}

#[repr(C)]
pub struct fid_cntr {
    pub fid: fid,
    pub ops: *mut fi_ops_cntr,
}

#[repr(C)]
pub struct fi_ops_ep {
    pub size: usize,
    pub cancel: *const c_void,
    pub getopt: *const c_void,
    pub setopt: *const c_void,
    pub tx_ctx: *const c_void,
    pub rx_ctx: *const c_void,
    pub rx_size_left: *const c_void,
    pub tx_size_left: *const c_void,
}

#[repr(C)]
pub struct fi_ops_cm {
    pub size: usize,
    pub setname: *const c_void,
    pub getname: Option<unsafe extern "C" fn(*mut fid, *mut c_void, *mut usize) -> c_int>,
    pub getpeer: *const c_void,
    pub connect: *const c_void,
    pub listen: *const c_void,
    pub accept: *const c_void,
    pub reject: *const c_void,
    pub shutdown: *const c_void,
    pub join: *const c_void,
}

type RmaMsgFn = Option<unsafe extern "C" fn(*mut fid_ep, *const fi_msg_rma, u64) -> isize>;

#[repr(C)]
pub struct fi_rma_iov {
    pub addr: u64,
    pub len: usize,
    pub key: u64,
}

#[repr(C)]
pub struct fi_msg_rma {
    pub msg_iov: *const libc::iovec,
    pub desc: *mut *mut c_void,
    pub iov_count: usize,
    pub addr: u64,
    pub rma_iov: *const fi_rma_iov,
    pub rma_iov_count: usize,
    pub context: *mut c_void,
    pub data: u64,
}

#[repr(C)]
pub struct fi_ops_rma {
    pub size: usize,
    pub read: *const c_void,
    pub readv: *const c_void,
    pub readmsg: RmaMsgFn,
    pub write: *const c_void,
    pub writev: *const c_void,
    pub writemsg: RmaMsgFn,
    pub inject: *const c_void,
    pub writedata: *const c_void,
    pub injectdata: *const c_void,
}

#[repr(C)]
pub struct fid_ep {
    pub fid: fid,
    pub ops: *mut fi_ops_ep,
    pub cm: *mut fi_ops_cm,
    pub msg: *mut c_void,
    pub rma: *mut fi_ops_rma,
    pub tagged: *mut c_void,
    pub atomic: *mut c_void,
    pub collective: *mut c_void,
}

/// Scratch space a provider with `FI_CONTEXT`/`FI_CONTEXT2` mode may use per operation
/// (the larger of the two, so one type serves both).
#[repr(C)]
pub struct fi_context2 {
    pub internal: [*mut c_void; 8],
}

// SAFETY: scratch space only the provider touches, while the operation that owns it is
// in flight; moving the owner between threads does not move the (boxed) space.
unsafe impl Send for fi_context2 {}

// ---- the loaded library ------------------------------------------------------------------------

type GetinfoFn = unsafe extern "C" fn(
    u32,
    *const c_char,
    *const c_char,
    u64,
    *const fi_info,
    *mut *mut fi_info,
) -> c_int;

function_table! {
    /// The exported entry points of one loaded libfabric. The library stays loaded as
    /// long as the table lives.
    pub struct FabricLib (override OVERRIDE_VAR) {
        state {
            /// `fi_version()` of the loaded library.
            pub version: u32 = 0,
        }
        symbols {
            version_fn: required ["fi_version"] unsafe extern "C" fn() -> u32,
            pub getinfo: required ["fi_getinfo"] GetinfoFn,
            pub freeinfo: required ["fi_freeinfo"] unsafe extern "C" fn(*mut fi_info),
            pub dupinfo: required ["fi_dupinfo"]
                unsafe extern "C" fn(*const fi_info) -> *mut fi_info,
            pub fabric: required ["fi_fabric"]
                unsafe extern "C" fn(*mut fi_fabric_attr, *mut *mut fid_fabric, *mut c_void) -> c_int,
            pub strerror_fn: required ["fi_strerror"] unsafe extern "C" fn(c_int) -> *const c_char,
        }
    }
}

impl FabricLib {
    fn load() -> Result<FabricLib> {
        let (lib, path) = loader::open(Backend::Fabric, None, OVERRIDE_VAR, CANDIDATES, None)?;
        let mut table = FabricLib::bind(lib, path)?;
        // SAFETY: fi_version takes no arguments and only returns a constant.
        table.version = unsafe { (table.version_fn)() };
        if table.version < FI_MIN_VERSION {
            return Err(Error::TooOld {
                library: table.library.clone(),
                what: Backend::Fabric,
                found: table.version_string(),
                needed: "1.9",
                override_var: OVERRIDE_VAR,
            });
        }
        Ok(table)
    }

    /// The API version to ask for: ours, or the library's when it is older.
    pub fn api_version(&self) -> u32 {
        self.version.min(FI_API_VERSION)
    }

    /// `"1.17"` style.
    pub fn version_string(&self) -> String {
        format!("{}.{}", self.version >> 16, self.version & 0xffff)
    }

    /// Text for a libfabric error code (positive or negated).
    pub fn strerror(&self, code: i64) -> String {
        let code = code.unsigned_abs().min(i32::MAX as u64) as c_int;
        // SAFETY: fi_strerror returns a static string for any code.
        let p = unsafe { (self.strerror_fn)(code) };
        if p.is_null() {
            return format!("error {code}");
        }
        // SAFETY: non-null, NUL-terminated static string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// A failed call's error: the code as returned, in libfabric's words.
    pub fn error(&self, call: &'static str, code: c_int) -> Error {
        Error::Driver(DriverError {
            backend: Backend::Fabric,
            call,
            code,
            text: self.strerror(i64::from(code)),
        })
    }

    /// `fi_allocinfo()`: a zeroed info with every attribute struct allocated.
    pub fn allocinfo(&self) -> *mut fi_info {
        // SAFETY: fi_dupinfo(NULL) allocates a fresh, zeroed info (what the header's
        // inline fi_allocinfo does).
        unsafe { (self.dupinfo)(std::ptr::null()) }
    }
}

/// The process-wide libfabric, loaded on first use. The outcome of the first attempt
/// is kept, so a missing library is reported the same way every time.
pub fn library() -> Result<Arc<FabricLib>> {
    static LIB: OnceLock<Result<Arc<FabricLib>>> = OnceLock::new();
    // An override pointing elsewhere than what was loaded first is reported, not ignored.
    let loaded = LIB.get_or_init(|| FabricLib::load().map(Arc::new)).clone();
    if let (Ok(lib), Ok(path)) = (&loaded, std::env::var(OVERRIDE_VAR)) {
        if !path.is_empty() && path != lib.library {
            return Err(Error::AlreadyLoaded {
                what: Backend::Fabric,
                override_var: OVERRIDE_VAR,
                requested: path,
                loaded: lib.library.clone(),
            });
        }
    }
    loaded
}

/// Reads a C string field (NULL gives "").
///
/// # Safety
/// `p` is NULL or points at a NUL-terminated string.
pub unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: `p` is non-null (checked just above) and the caller guarantees it points at a
        // NUL-terminated string, which is what `CStr::from_ptr` needs.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

// ---- the headers' inline functions, through the ops tables -----------------------------------

/// What a header's inline call gives back when the provider left its ops slot (or the
/// whole ops table) empty: `-FI_ENOSYS`, or 0 for a counter read.
trait Nosys {
    const NOSYS: Self;
}

impl Nosys for c_int {
    const NOSYS: c_int = -FI_ENOSYS;
}

impl Nosys for isize {
    const NOSYS: isize = -(FI_ENOSYS as isize);
}

impl Nosys for u64 {
    const NOSYS: u64 = 0;
}

/// Each header inline is one call through an ops table of a libfabric object:
/// `pub unsafe fn NAME(ARGS) -> RET = (TABLE) . SLOT(CALL ARGS);` calls slot `SLOT` of
/// the ops table `TABLE` points at, or returns `Nosys::NOSYS` when the table or the
/// slot is empty. Every such function has the contract "the object whose table is read
/// is live, and the arguments are what the slot expects", spelled out in its docs.
macro_rules! ops_call {
    ($(
        $(#[$meta:meta])*
        pub unsafe fn $name:ident($($arg:ident: $aty:ty),* $(,)?) -> $ret:ty
            = ($table:expr) . $slot:ident ($($call:expr),* $(,)?);
    )*) => {$(
        $(#[$meta])*
        pub unsafe fn $name($($arg: $aty),*) -> $ret {
            // SAFETY: each generated fn's `# Safety` makes the caller keep the object live, so the
            // ops table pointer read from it is valid or NULL (NULL is checked here), and a present
            // slot has the header's signature; the arguments passed are the ones that slot expects.
            unsafe {
                let table = $table;
                if table.is_null() {
                    return <$ret as Nosys>::NOSYS;
                }
                match (*table).$slot {
                    Some(f) => f($($call),*),
                    None => <$ret as Nosys>::NOSYS,
                }
            }
        }
    )*};
}

ops_call! {
    /// `fi_close`.
    ///
    /// # Safety
    /// `f` is a live libfabric object not used again afterwards.
    pub unsafe fn fi_close(f: *mut fid) -> c_int = ((*f).ops).close(f);

    /// `fi_control`.
    ///
    /// # Safety
    /// `f` is live; `arg` is what `command` expects.
    pub unsafe fn fi_control(f: *mut fid, command: c_int, arg: *mut c_void) -> c_int =
        ((*f).ops).control(f, command, arg);

    /// `fi_bind`.
    ///
    /// # Safety
    /// `f` and `bfid` are live objects of one domain.
    pub unsafe fn fi_bind(f: *mut fid, bfid: *mut fid, flags: u64) -> c_int =
        ((*f).ops).bind(f, bfid, flags);

    /// `fi_domain`.
    ///
    /// # Safety
    /// `fabric` is live; `info` came from `fi_getinfo` for it.
    pub unsafe fn fi_domain(
        fabric: *mut fid_fabric,
        info: *mut fi_info,
        domain: *mut *mut fid_domain,
    ) -> c_int = ((*fabric).ops).domain(fabric, info, domain, std::ptr::null_mut());

    /// `fi_trywait` for one object.
    ///
    /// # Safety
    /// `fabric` and `f` are live, `f` belongs to `fabric`.
    pub unsafe fn fi_trywait(fabric: *mut fid_fabric, f: *mut fid) -> c_int =
        // The one-element array lives until the end of the call's statement.
        ((*fabric).ops).trywait(fabric, [f].as_mut_ptr(), 1);

    /// `fi_cq_open`.
    ///
    /// # Safety
    /// `domain` is live; `attr` valid for the call.
    pub unsafe fn fi_cq_open(
        domain: *mut fid_domain,
        attr: *mut fi_cq_attr,
        cq: *mut *mut fid_cq,
    ) -> c_int = ((*domain).ops).cq_open(domain, attr, cq, std::ptr::null_mut());

    /// `fi_av_open`.
    ///
    /// # Safety
    /// `domain` is live; `attr` valid for the call.
    pub unsafe fn fi_av_open(
        domain: *mut fid_domain,
        attr: *mut fi_av_attr,
        av: *mut *mut fid_av,
    ) -> c_int = ((*domain).ops).av_open(domain, attr, av, std::ptr::null_mut());

    /// `fi_cntr_open` with the caller's attributes.
    ///
    /// # Safety
    /// `domain` is live; `attr` valid for the call.
    pub unsafe fn fi_cntr_open_attr(
        domain: *mut fid_domain,
        attr: *mut fi_cntr_attr,
        cntr: *mut *mut fid_cntr,
    ) -> c_int = ((*domain).ops).cntr_open(domain, attr, cntr, std::ptr::null_mut());

    /// `fi_endpoint`.
    ///
    /// # Safety
    /// `domain` is live; `info` is the info the domain was opened with (or a copy).
    pub unsafe fn fi_endpoint(
        domain: *mut fid_domain,
        info: *mut fi_info,
        ep: *mut *mut fid_ep,
    ) -> c_int = ((*domain).ops).endpoint(domain, info, ep, std::ptr::null_mut());

    /// `fi_getname`: the endpoint's address.
    ///
    /// # Safety
    /// `ep` is live and enabled; `addr` has `*len` writable bytes.
    pub unsafe fn fi_getname(ep: *mut fid_ep, addr: *mut c_void, len: *mut usize) -> c_int =
        ((*ep).cm).getname(std::ptr::addr_of_mut!((*ep).fid), addr, len);

    /// `fi_mr_reg` (offset and flags 0, as the man page requires).
    ///
    /// # Safety
    /// `domain` is live; `[buf, buf+len)` stays mapped while the MR is open.
    pub unsafe fn fi_mr_reg(
        domain: *mut fid_domain,
        buf: *const c_void,
        len: usize,
        access: u64,
        requested_key: u64,
        mr: *mut *mut fid_mr,
    ) -> c_int = ((*domain).mr).reg(
        std::ptr::addr_of_mut!((*domain).fid),
        buf,
        len,
        access,
        0,
        requested_key,
        0,
        mr,
        std::ptr::null_mut(),
    );

    /// `fi_mr_regattr`.
    ///
    /// # Safety
    /// `domain` is live; `attr` describes memory that stays valid while the MR is open.
    pub unsafe fn fi_mr_regattr(
        domain: *mut fid_domain,
        attr: *const fi_mr_attr,
        mr: *mut *mut fid_mr,
    ) -> c_int = ((*domain).mr).regattr(std::ptr::addr_of_mut!((*domain).fid), attr, 0, mr);

    /// `fi_av_insert` of one address; returns how many were inserted (1) or a negated
    /// error.
    ///
    /// # Safety
    /// `av` is live; `addr` points at one address in the provider's format.
    pub unsafe fn fi_av_insert(av: *mut fid_av, addr: *const c_void, fi_addr: *mut u64) -> c_int =
        ((*av).ops).insert(av, addr, 1, fi_addr, 0, std::ptr::null_mut());

    /// `fi_readmsg`.
    ///
    /// # Safety
    /// `ep` is live; the `msg.msg_iov` buffers stay writable and `msg.context` valid
    /// until the completion is read.
    pub unsafe fn fi_readmsg(ep: *mut fid_ep, msg: &fi_msg_rma, flags: u64) -> isize =
        ((*ep).rma).readmsg(ep, msg, flags);

    /// `fi_writemsg`.
    ///
    /// # Safety
    /// As `fi_readmsg`, with the buffers readable.
    pub unsafe fn fi_writemsg(ep: *mut fid_ep, msg: &fi_msg_rma, flags: u64) -> isize =
        ((*ep).rma).writemsg(ep, msg, flags);

    /// `fi_cntr_read`.
    ///
    /// # Safety
    /// `cntr` is live.
    pub unsafe fn fi_cntr_read(cntr: *mut fid_cntr) -> u64 = ((*cntr).ops).read(cntr);

    /// `fi_cq_read` into `FI_CQ_FORMAT_CONTEXT` entries (the slice bounds the count).
    ///
    /// # Safety
    /// `cq` is live and was opened with the context format.
    pub unsafe fn fi_cq_read(cq: *mut fid_cq, entries: &mut [fi_cq_entry]) -> isize =
        ((*cq).ops).read(cq, entries.as_mut_ptr().cast(), entries.len());

    /// `fi_cq_readerr`.
    ///
    /// # Safety
    /// `cq` is live.
    pub unsafe fn fi_cq_readerr(cq: *mut fid_cq, entry: *mut fi_cq_err_entry) -> isize =
        ((*cq).ops).readerr(cq, entry, 0);
}

/// `fi_ep_bind`.
///
/// # Safety
/// `ep` and `bfid` are live objects of one domain.
pub unsafe fn fi_ep_bind(ep: *mut fid_ep, bfid: *mut fid, flags: u64) -> c_int {
    // SAFETY: the caller keeps `ep` live, and a `fid_ep` begins with its `fid`, so `addr_of_mut!`
    // yields the endpoint's live fid; `bfid` is live in the same domain, as fi_bind requires.
    unsafe { fi_bind(std::ptr::addr_of_mut!((*ep).fid), bfid, flags) }
}

/// `fi_enable`.
///
/// # Safety
/// `ep` is live and bound.
pub unsafe fn fi_enable(ep: *mut fid_ep) -> c_int {
    // SAFETY: the caller keeps `ep` live and bound, so its embedded `fid` is a valid control
    // target; FI_ENABLE takes no argument, so passing NULL is what the header does.
    unsafe {
        fi_control(
            std::ptr::addr_of_mut!((*ep).fid),
            FI_ENABLE,
            std::ptr::null_mut(),
        )
    }
}

/// `fi_cntr_open` (no wait object: counters are only read).
///
/// # Safety
/// `domain` is live.
pub unsafe fn fi_cntr_open(domain: *mut fid_domain, cntr: *mut *mut fid_cntr) -> c_int {
    let mut attr = fi_cntr_attr {
        events: FI_CNTR_EVENTS_COMP,
        wait_obj: FI_WAIT_NONE,
        wait_set: std::ptr::null_mut(),
        flags: 0,
    };
    // SAFETY: the caller keeps `domain` live and `attr` is a local that outlives the call; `cntr`
    // is handed on as the out-slot for the new counter (its writability is assumed, not stated in
    // this fn's `# Safety`).
    unsafe { fi_cntr_open_attr(domain, &mut attr, cntr) }
}

/// `fi_cq_strerror`: the provider's text for an error entry.
///
/// # Safety
/// `cq` is live and `entry` was just read from it.
pub unsafe fn fi_cq_strerror(cq: *mut fid_cq, entry: &fi_cq_err_entry) -> Option<String> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: the caller keeps `cq` live, so its ops table is readable (a live provider cq has
    // one); the provider writes at most `buf.len()` bytes into the local `buf`, and `cstr` reads
    // the NUL-terminated text it returns (or we skip NULL).
    unsafe {
        let f = (*(*cq).ops).strerror?;
        let p = f(
            cq,
            entry.prov_errno,
            entry.err_data,
            buf.as_mut_ptr(),
            buf.len(),
        );
        (!p.is_null()).then(|| cstr(p))
    }
}

// ---- fi_info helpers ---------------------------------------------------------------------------

/// One provider entry of a `fi_getinfo` answer, copied out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InfoSummary {
    pub provider: String,
    pub fabric: String,
    pub domain: String,
    pub caps: u64,
    pub mr_mode: c_int,
    pub data_progress: c_int,
}

/// Copies the names and modes out of one `fi_info`.
///
/// # Safety
/// `info` points at a live `fi_info` from `fi_getinfo`.
pub unsafe fn summarize(info: *const fi_info) -> InfoSummary {
    // SAFETY: the caller guarantees `info` is a live fi_info from fi_getinfo, whose attribute
    // pointers are valid or NULL (each is NULL-checked before use) and whose names are C strings.
    unsafe {
        let fa = (*info).fabric_attr;
        let da = (*info).domain_attr;
        InfoSummary {
            provider: if fa.is_null() {
                String::new()
            } else {
                cstr((*fa).prov_name)
            },
            fabric: if fa.is_null() {
                String::new()
            } else {
                cstr((*fa).name)
            },
            domain: if da.is_null() {
                String::new()
            } else {
                cstr((*da).name)
            },
            caps: (*info).caps,
            mr_mode: if da.is_null() { 0 } else { (*da).mr_mode },
            data_progress: if da.is_null() {
                FI_PROGRESS_UNSPEC
            } else {
                (*da).data_progress
            },
        }
    }
}

/// Providers offering RMA on reliable-datagram endpoints: `(provider, domain, fabric)`
/// in libfabric's order, without duplicates. Opens nothing.
pub fn rma_providers(lib: &FabricLib) -> Result<Vec<(String, String, String)>> {
    let hints = lib.allocinfo();
    if hints.is_null() {
        // fi_dupinfo fails only for want of memory.
        return Err(lib.error("fi_allocinfo", -libc::ENOMEM));
    }
    // SAFETY: `hints` is a fresh info with all attribute structs allocated.
    unsafe {
        (*hints).caps = FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
        (*hints).mode = FI_CONTEXT | FI_CONTEXT2;
        (*(*hints).ep_attr).type_ = FI_EP_RDM;
        (*(*hints).domain_attr).mr_mode =
            FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_HMEM;
    }
    let mut list: *mut fi_info = std::ptr::null_mut();
    // SAFETY: valid hints and an out-pointer; no node or service.
    let rc = unsafe {
        (lib.getinfo)(
            lib.api_version(),
            std::ptr::null(),
            std::ptr::null(),
            0,
            hints,
            &mut list,
        )
    };
    // SAFETY: hints came from fi_dupinfo and are not used again.
    unsafe { (lib.freeinfo)(hints) };
    if rc == -FI_ENODATA {
        return Ok(Vec::new());
    }
    if rc != 0 {
        return Err(lib.error("fi_getinfo", rc));
    }
    let mut out: Vec<(String, String, String)> = Vec::new();
    let mut p = list;
    while !p.is_null() {
        // SAFETY: `p` walks the list fi_getinfo returned.
        let s = unsafe { summarize(p) };
        let entry = (s.provider, s.domain, s.fabric);
        if !out.contains(&entry) {
            out.push(entry);
        }
        // SAFETY: `p` is non-null (loop condition) and still an entry of the list fi_getinfo
        // returned, which is not freed until after the loop.
        p = unsafe { (*p).next };
    }
    // SAFETY: the list came from fi_getinfo and is not used again.
    unsafe { (lib.freeinfo)(list) };
    Ok(out)
}

/// What `mooncake info` shows for libfabric: the library, its version, and the
/// providers that offer RMA on RDM endpoints (as `fi_getinfo` reports them; note that
/// the tcp provider lists every interface unless `FI_TCP_IFACE` narrows it).
pub fn info() -> BackendInfo {
    let lib = match library() {
        Ok(l) => l,
        Err(e) => return BackendInfo::unavailable("efa (libfabric)", e),
    };
    let mut info = BackendInfo {
        name: "efa (libfabric)",
        library: Ok(lib.library.clone()),
        version: Some(lib.version_string()),
        devices: Vec::new(),
        notes: Vec::new(),
    };
    match rma_providers(&lib) {
        Ok(list) if list.is_empty() => info
            .notes
            .push("no provider offers RMA on reliable-datagram endpoints".into()),
        Ok(list) => {
            info.devices = list
                .into_iter()
                .map(|(p, d, f)| format!("{p} {d} {f}"))
                .collect()
        }
        Err(e) => info.notes.push(e.to_string()),
    }
    info
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Sizes and offsets measured from the 1.17 headers with a C compiler (x86-64).
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn layouts_match_the_headers() {
        assert_eq!(size_of::<fi_info>(), 120);
        assert_eq!(offset_of!(fi_info, addr_format), 24);
        assert_eq!(offset_of!(fi_info, src_addrlen), 32);
        assert_eq!(offset_of!(fi_info, fabric_attr), 104);
        assert_eq!(offset_of!(fi_info, nic), 112);
        assert_eq!(size_of::<fi_tx_attr>(), 80);
        assert_eq!(offset_of!(fi_tx_attr, tclass), 72);
        assert_eq!(size_of::<fi_rx_attr>(), 64);
        assert_eq!(size_of::<fi_ep_attr>(), 96);
        assert_eq!(offset_of!(fi_ep_attr, max_msg_size), 16);
        assert_eq!(offset_of!(fi_ep_attr, auth_key), 88);
        assert_eq!(size_of::<fi_domain_attr>(), 192);
        assert_eq!(offset_of!(fi_domain_attr, threading), 16);
        assert_eq!(offset_of!(fi_domain_attr, mr_mode), 36);
        assert_eq!(offset_of!(fi_domain_attr, mr_key_size), 40);
        assert_eq!(offset_of!(fi_domain_attr, caps), 136);
        assert_eq!(offset_of!(fi_domain_attr, mr_cnt), 176);
        assert_eq!(offset_of!(fi_domain_attr, tclass), 184);
        assert_eq!(size_of::<fi_fabric_attr>(), 32);
        assert_eq!(offset_of!(fi_fabric_attr, api_version), 28);
        assert_eq!(size_of::<fid>(), 24);
        assert_eq!(size_of::<fi_ops>(), 56);
        assert_eq!(size_of::<fid_fabric>(), 40);
        assert_eq!(size_of::<fi_ops_fabric>(), 56);
        assert_eq!(size_of::<fid_domain>(), 40);
        assert_eq!(size_of::<fi_ops_domain>(), 96);
        assert_eq!(size_of::<fi_ops_mr>(), 32);
        assert_eq!(size_of::<fid_mr>(), 40);
        assert_eq!(offset_of!(fid_mr, key), 32);
        assert_eq!(size_of::<fi_mr_attr>(), 80);
        assert_eq!(offset_of!(fi_mr_attr, iface), 64);
        assert_eq!(offset_of!(fi_mr_attr, device), 72);
        assert_eq!(size_of::<fid_av>(), 32);
        assert_eq!(size_of::<fi_ops_av>(), 64);
        assert_eq!(size_of::<fi_av_attr>(), 48);
        assert_eq!(offset_of!(fi_av_attr, flags), 40);
        assert_eq!(size_of::<fid_cq>(), 32);
        assert_eq!(size_of::<fi_ops_cq>(), 64);
        assert_eq!(size_of::<fi_cq_attr>(), 40);
        assert_eq!(offset_of!(fi_cq_attr, wait_set), 32);
        assert_eq!(size_of::<fi_cq_entry>(), 8);
        assert_eq!(size_of::<fi_cq_err_entry>(), 80);
        assert_eq!(offset_of!(fi_cq_err_entry, err), 56);
        assert_eq!(offset_of!(fi_cq_err_entry, err_data_size), 72);
        assert_eq!(size_of::<fid_ep>(), 80);
        assert_eq!(size_of::<fi_ops_ep>(), 64);
        assert_eq!(size_of::<fi_ops_cm>(), 80);
        assert_eq!(size_of::<fi_ops_rma>(), 80);
        assert_eq!(size_of::<fi_context2>(), 64);
    }

    #[test]
    fn version_macro() {
        assert_eq!(FI_API_VERSION, 0x0001_0011);
    }
}
