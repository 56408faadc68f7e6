//! libibverbs (rdma-core), loaded at run time: the subset the RDMA transport calls.
//!
//! Struct layouts are written by hand to match rdma-core 44's `infiniband/verbs.h`
//! (x86-64 / aarch64 LP64). Only the fields we read or write are named precisely;
//! trailing parts we never touch are still laid out so that sizes match the header
//! where we allocate the struct ourselves (`ibv_qp_attr`, `ibv_send_wr`, `ibv_wc`, ...).
//!
//! `ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq` and `ibv_req_notify_cq` are
//! `static inline` in verbs.h: they call through `context->ops`. [`post_send`],
//! [`post_recv`], [`poll_cq`] and [`req_notify_cq`] do exactly the same. `ibv_query_port` is a macro around an inline function that uses
//! the extended context when there is one and otherwise calls the exported
//! `ibv_query_port@IBVERBS_1.1` on a zeroed struct; [`Verbs::query_port`] takes the latter
//! path, which every provider supports (it fills the fields up to `link_layer`).
//! `ibv_reg_mr` is a macro that calls the exported `ibv_reg_mr` when the access flags
//! have no optional bits (ours never do).

#![allow(non_camel_case_types)]
// The `ibv_*`/`IBV_*` items mirror verbs.h one to one under their C names; their
// documentation is rdma-core's (`man ibv_post_send`, ...), so they carry no doc comments
// of their own. The Rust-side helpers below are documented.
#![allow(missing_docs)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use super::error::{Backend, Result};
use super::loader::{self, BackendInfo};
use super::table::function_table;

/// Environment variable naming the libibverbs to load instead of the system one.
pub const OVERRIDE_VAR: &str = "MC_IBVERBS_LIB";
/// Names tried when the override is not set.
pub const CANDIDATES: &[&str] = &["libibverbs.so.1", "libibverbs.so"];

// ---- constants (verbs.h enums) ----

pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 1 << 1;
pub const IBV_ACCESS_REMOTE_READ: c_int = 1 << 2;

pub const IBV_QP_STATE: c_int = 1 << 0;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

pub const IBV_QPS_RESET: c_uint = 0;
pub const IBV_QPS_INIT: c_uint = 1;
pub const IBV_QPS_RTR: c_uint = 2;
pub const IBV_QPS_RTS: c_uint = 3;
pub const IBV_QPS_ERR: c_uint = 6;

pub const IBV_QPT_RC: c_uint = 2;

pub const IBV_MTU_1024: c_uint = 3;
pub const IBV_MTU_4096: c_uint = 5;

pub const IBV_PORT_DOWN: c_uint = 1;
pub const IBV_PORT_ACTIVE: c_uint = 4;

pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

pub const IBV_WR_RDMA_WRITE: c_uint = 0;
pub const IBV_WR_RDMA_READ: c_uint = 4;

pub const IBV_SEND_SIGNALED: c_uint = 1 << 1;

pub const IBV_WC_SUCCESS: c_uint = 0;
pub const IBV_WC_LOC_LEN_ERR: c_uint = 1;
pub const IBV_WC_LOC_PROT_ERR: c_uint = 4;
pub const IBV_WC_WR_FLUSH_ERR: c_uint = 5;
pub const IBV_WC_REM_INV_REQ_ERR: c_uint = 9;
pub const IBV_WC_REM_ACCESS_ERR: c_uint = 10;
pub const IBV_WC_REM_OP_ERR: c_uint = 11;
pub const IBV_WC_RETRY_EXC_ERR: c_uint = 12;
pub const IBV_WC_RNR_RETRY_EXC_ERR: c_uint = 13;

/// `ibv_wc_status_str` is exported, but a local table saves a call and never fails.
pub fn wc_status_name(status: c_uint) -> &'static str {
    const NAMES: [&str; 25] = [
        "success",
        "local length error",
        "local QP operation error",
        "local EE context operation error",
        "local protection error",
        "WR flushed",
        "memory bind operation error",
        "bad response error",
        "local access error",
        "remote invalid request error",
        "remote access error",
        "remote operation error",
        "transport retry counter exceeded",
        "RNR retry counter exceeded",
        "local RDD violation error",
        "remote invalid RD request",
        "operation aborted",
        "invalid EE context number",
        "invalid EE context state",
        "fatal error",
        "response timeout error",
        "general error",
        "TM error",
        "TM rendezvous incomplete",
        "unknown",
    ];
    NAMES[(status as usize).min(NAMES.len() - 1)]
}

// ---- structs ----

/// `union ibv_gid` (16 raw bytes; `global` is two big-endian u64s over the same bytes,
/// which makes the union 8-aligned).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

#[repr(C)]
pub struct _ibv_device_ops {
    pub _dummy1: *mut c_void,
    pub _dummy2: *mut c_void,
}

pub const IBV_SYSFS_NAME_MAX: usize = 64;
pub const IBV_SYSFS_PATH_MAX: usize = 256;

#[repr(C)]
pub struct ibv_device {
    pub _ops: _ibv_device_ops,
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

type Compat = Option<unsafe extern "C" fn()>;

pub type PollCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
pub type PostSendFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
pub type PostRecvFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// `struct ibv_context_ops`, every field in header order.
#[repr(C)]
pub struct ibv_context_ops {
    pub _compat_query_device: Compat,
    pub _compat_query_port: Compat,
    pub _compat_alloc_pd: Compat,
    pub _compat_dealloc_pd: Compat,
    pub _compat_reg_mr: Compat,
    pub _compat_rereg_mr: Compat,
    pub _compat_dereg_mr: Compat,
    pub alloc_mw: Compat,
    pub bind_mw: Compat,
    pub dealloc_mw: Compat,
    pub _compat_create_cq: Compat,
    pub poll_cq: Option<PollCqFn>,
    pub req_notify_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int>,
    pub _compat_cq_event: Compat,
    pub _compat_resize_cq: Compat,
    pub _compat_destroy_cq: Compat,
    pub _compat_create_srq: Compat,
    pub _compat_modify_srq: Compat,
    pub _compat_query_srq: Compat,
    pub _compat_destroy_srq: Compat,
    pub post_srq_recv: Compat,
    pub _compat_create_qp: Compat,
    pub _compat_query_qp: Compat,
    pub _compat_modify_qp: Compat,
    pub _compat_destroy_qp: Compat,
    pub post_send: Option<PostSendFn>,
    pub post_recv: Option<PostRecvFn>,
    pub _compat_create_ah: Compat,
    pub _compat_destroy_ah: Compat,
    pub _compat_attach_mcast: Compat,
    pub _compat_detach_mcast: Compat,
    pub _compat_async_event: Compat,
}

#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_comp_channel`: CQ events of armed CQs are read from `fd`.
#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_uint,
    pub qp_type: c_uint,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: c_uint,
    pub cur_qp_state: c_uint,
    pub path_mtu: c_uint,
    pub path_mig_state: c_uint,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The `wr.rdma` arm of `ibv_send_wr`'s `wr` union. The union's largest arm
/// (`atomic`: two more u64s) is kept as padding so the size matches.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_send_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
    pub _union_tail: [u32; 5],
}

#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    /// `imm_data` / `invalidate_rkey`.
    pub imm_data: u32,
    pub rdma: ibv_send_wr_rdma,
    /// `qp_type.xrc.remote_srqn`.
    pub remote_srqn: u32,
    /// The `bind_mw` / `tso` union (48 bytes, 8-aligned).
    pub _bind_mw: [u64; 6],
}

impl Default for ibv_send_wr {
    fn default() -> Self {
        ibv_send_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
            opcode: 0,
            send_flags: 0,
            imm_data: 0,
            rdma: ibv_send_wr_rdma::default(),
            remote_srqn: 0,
            _bind_mw: [0; 6],
        }
    }
}

#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_uint,
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_port_attr {
    pub state: c_uint,
    pub max_mtu: c_uint,
    pub active_mtu: c_uint,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

// Sizes from rdma-core 44's verbs.h on LP64 (checked against the header by tests/layout.rs).
const _: () = {
    assert!(std::mem::size_of::<ibv_wc>() == 48);
    assert!(std::mem::size_of::<ibv_send_wr>() == 128);
    assert!(std::mem::size_of::<ibv_qp_attr>() == 144);
    assert!(std::mem::size_of::<ibv_port_attr>() == 52);
    assert!(std::mem::size_of::<ibv_qp_init_attr>() == 64);
    assert!(std::mem::size_of::<ibv_context_ops>() == 32 * 8);
    assert!(std::mem::size_of::<ibv_device>() == 16 + 8 + 2 * 64 + 2 * 256);
    assert!(std::mem::size_of::<ibv_mr>() == 48);
    assert!(std::mem::size_of::<ibv_context>() == 328);
    assert!(std::mem::size_of::<ibv_cq>() == 128);
    assert!(std::mem::size_of::<ibv_comp_channel>() == 16);
    assert!(std::mem::size_of::<ibv_qp>() == 160);
    assert!(std::mem::offset_of!(ibv_send_wr, rdma) == 40);
    assert!(std::mem::offset_of!(ibv_send_wr, remote_srqn) == 72);
};

// ---- the loaded library ----

function_table! {
    /// Function pointers into the loaded libibverbs; the library stays loaded with them.
    pub struct Verbs (override OVERRIDE_VAR) {
        state {}
        symbols {
            pub get_device_list: required ["ibv_get_device_list"]
                unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
            pub free_device_list: required ["ibv_free_device_list"]
                unsafe extern "C" fn(*mut *mut ibv_device),
            pub get_device_name: required ["ibv_get_device_name"]
                unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
            pub open_device: required ["ibv_open_device"]
                unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
            pub close_device: required ["ibv_close_device"]
                unsafe extern "C" fn(*mut ibv_context) -> c_int,
            /// The exported `ibv_query_port@IBVERBS_1.1` (takes the compat struct prefix).
            pub query_port_compat: required ["ibv_query_port"]
                unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
            pub query_gid: required ["ibv_query_gid"]
                unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int,
            pub alloc_pd: required ["ibv_alloc_pd"]
                unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
            pub dealloc_pd: required ["ibv_dealloc_pd"] unsafe extern "C" fn(*mut ibv_pd) -> c_int,
            pub reg_mr: required ["ibv_reg_mr"]
                unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
            pub dereg_mr: required ["ibv_dereg_mr"] unsafe extern "C" fn(*mut ibv_mr) -> c_int,
            /// `ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)` (rdma-core 34+):
            /// registers device memory exported as a dma-buf (GPUDirect RDMA without
            /// nvidia-peermem); absent from older libraries.
            pub reg_dmabuf_mr: optional ["ibv_reg_dmabuf_mr"]
                unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr,
            pub create_cq: required ["ibv_create_cq"]
                unsafe extern "C" fn(
                    *mut ibv_context,
                    c_int,
                    *mut c_void,
                    *mut ibv_comp_channel,
                    c_int,
                ) -> *mut ibv_cq,
            pub destroy_cq: required ["ibv_destroy_cq"] unsafe extern "C" fn(*mut ibv_cq) -> c_int,
            pub create_comp_channel: required ["ibv_create_comp_channel"]
                unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
            pub destroy_comp_channel: required ["ibv_destroy_comp_channel"]
                unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
            /// Returns 0 and the CQ of the next event, or -1 with errno (EAGAIN on a
            /// non-blocking channel with nothing queued).
            pub get_cq_event: required ["ibv_get_cq_event"]
                unsafe extern "C" fn(
                    *mut ibv_comp_channel,
                    *mut *mut ibv_cq,
                    *mut *mut c_void,
                ) -> c_int,
            pub ack_cq_events: required ["ibv_ack_cq_events"]
                unsafe extern "C" fn(*mut ibv_cq, c_uint),
            pub create_qp: required ["ibv_create_qp"]
                unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
            pub modify_qp: required ["ibv_modify_qp"]
                unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
            pub destroy_qp: required ["ibv_destroy_qp"] unsafe extern "C" fn(*mut ibv_qp) -> c_int,
        }
    }
}

static VERBS: OnceLock<Result<Verbs>> = OnceLock::new();

/// Loads libibverbs once (`MC_IBVERBS_LIB` overrides the search); later calls return
/// the same table or the same error.
pub fn verbs() -> Result<&'static Verbs> {
    VERBS.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Verbs> {
    let (lib, library) = loader::open(
        Backend::Ibverbs,
        None,
        OVERRIDE_VAR,
        CANDIDATES,
        Some("install rdma-core's libibverbs"),
    )?;
    Verbs::bind(lib, library)
}

impl Verbs {
    /// `ibv_query_port` as verbs.h's inline wrapper does it without an extended
    /// context: zero the struct, call the exported symbol.
    ///
    /// # Safety
    /// `ctx` must be an open device context.
    pub unsafe fn query_port(
        &self,
        ctx: *mut ibv_context,
        port: u8,
    ) -> Result<ibv_port_attr, c_int> {
        let mut attr = ibv_port_attr::default();
        // SAFETY: `ctx` is an open context (this function's contract) and `attr` is a
        // zeroed, writable `ibv_port_attr` that outlives the call.
        match unsafe { (self.query_port_compat)(ctx, port, &mut attr) } {
            0 => Ok(attr),
            rc => Err(rc),
        }
    }

    /// Names of the devices present (empty when there are none).
    pub fn device_names(&self) -> Vec<String> {
        let mut n: c_int = 0;
        // SAFETY: plain verbs calls; the list is freed before returning.
        unsafe {
            let list = (self.get_device_list)(&mut n);
            if list.is_null() {
                return Vec::new();
            }
            let names = (0..n.max(0) as usize)
                .map(|i| device_name(self, *list.add(i)))
                .collect();
            (self.free_device_list)(list);
            names
        }
    }
}

/// A device's name as a String.
///
/// # Safety
/// `dev` must come from a live device list.
pub unsafe fn device_name(verbs: &Verbs, dev: *mut ibv_device) -> String {
    // SAFETY: `dev` comes from a live device list (this function's contract).
    let p = unsafe { (verbs.get_device_name)(dev) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libibverbs returns a NUL-terminated name owned by the device, which
    // lives as long as the list; it is copied out before returning.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// verbs.h's inline `ibv_post_send`: through the QP's context ops.
///
/// # Safety
/// `qp` must be a live QP and `wr` a valid chain of work requests.
#[inline]
pub unsafe fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: `qp` is a live QP (this function's contract), so it and its context can
    // be read; the provider's op gets the caller's valid QP and work-request chain.
    unsafe {
        match (*(*qp).context).ops.post_send {
            Some(f) => f(qp, wr, bad),
            None => libc::EOPNOTSUPP,
        }
    }
}

/// verbs.h's inline `ibv_post_recv`.
///
/// # Safety
/// As [`post_send`].
#[inline]
pub unsafe fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: `qp` is a live QP (this function's contract), so it and its context can
    // be read; the provider's op gets the caller's valid QP and work-request chain.
    unsafe {
        match (*(*qp).context).ops.post_recv {
            Some(f) => f(qp, wr, bad),
            None => libc::EOPNOTSUPP,
        }
    }
}

/// verbs.h's inline `ibv_poll_cq`: returns completions written, or a negative error.
///
/// # Safety
/// `cq` must be a live CQ and `wc` point to `n` writable entries.
#[inline]
pub unsafe fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: `cq` is a live CQ (this function's contract), so it and its context can
    // be read; the provider's op gets room for `n` completions at `wc`.
    unsafe {
        match (*(*cq).context).ops.poll_cq {
            Some(f) => f(cq, n, wc),
            None => -libc::EOPNOTSUPP,
        }
    }
}

/// verbs.h's inline `ibv_req_notify_cq`: asks for one event on the CQ's channel when
/// its next completion arrives (`solicited_only`: only for solicited ones).
///
/// # Safety
/// `cq` must be a live CQ.
#[inline]
pub unsafe fn req_notify_cq(cq: *mut ibv_cq, solicited_only: bool) -> c_int {
    // SAFETY: `cq` is a live CQ (this function's contract), so it and its context can
    // be read and the provider's op called on it.
    unsafe {
        match (*(*cq).context).ops.req_notify_cq {
            Some(f) => f(cq, c_int::from(solicited_only)),
            None => libc::EOPNOTSUPP,
        }
    }
}

/// A GID as Mooncake writes it: 32 lower-case hex digits.
pub fn gid_hex(gid: &ibv_gid) -> String {
    gid.raw.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses [`gid_hex`]'s form (colons tolerated).
pub fn parse_gid(text: &str) -> Option<ibv_gid> {
    let digits: Vec<u8> = text.bytes().filter(|b| *b != b':').collect();
    if digits.len() != 32 {
        return None;
    }
    let mut gid = ibv_gid::default();
    for (i, pair) in digits.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        gid.raw[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(gid)
}

/// What `mooncake info` shows: the library, and each device with its port 1 state,
/// LID and GID 0.
pub fn info() -> BackendInfo {
    let verbs = match verbs() {
        Ok(v) => v,
        Err(e) => return BackendInfo::unavailable("rdma (ibverbs)", e),
    };
    let mut info = BackendInfo {
        name: "rdma (ibverbs)",
        library: Ok(verbs.library.clone()),
        version: None,
        devices: Vec::new(),
        notes: Vec::new(),
    };
    let mut n: c_int = 0;
    // SAFETY: verbs calls on objects opened and closed here.
    unsafe {
        let list = (verbs.get_device_list)(&mut n);
        if list.is_null() {
            info.notes.push(format!(
                "no RDMA devices (ibv_get_device_list: {}; no InfiniBand/RoCE NIC or kernel driver)",
                std::io::Error::last_os_error()
            ));
            return info;
        }
        for i in 0..n.max(0) as usize {
            let dev = *list.add(i);
            let name = device_name(verbs, dev);
            let ctx = (verbs.open_device)(dev);
            if ctx.is_null() {
                info.devices.push(format!(
                    "{name}: cannot open ({})",
                    std::io::Error::last_os_error()
                ));
                continue;
            }
            let line = match verbs.query_port(ctx, 1) {
                Ok(p) => {
                    let mut gid = ibv_gid::default();
                    let g = if (verbs.query_gid)(ctx, 1, 0, &mut gid) == 0 {
                        gid_hex(&gid)
                    } else {
                        "?".to_owned()
                    };
                    let state = match p.state {
                        IBV_PORT_ACTIVE => "active",
                        IBV_PORT_DOWN => "down",
                        _ => "not active",
                    };
                    let ll = if p.link_layer == IBV_LINK_LAYER_ETHERNET {
                        "RoCE"
                    } else {
                        "IB"
                    };
                    format!("{name} port 1: {state}, {ll}, lid {}, gid {g}", p.lid)
                }
                Err(rc) => format!("{name}: ibv_query_port failed ({rc})"),
            };
            info.devices.push(line);
            (verbs.close_device)(ctx);
        }
        (verbs.free_device_list)(list);
    }
    if info.devices.is_empty() {
        info.notes.push(
            "no RDMA devices (ibv_get_device_list found none: no InfiniBand/RoCE NIC or kernel driver)"
                .to_owned(),
        );
    }
    info
}
