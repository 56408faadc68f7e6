//! A reliable-connected queue pair and its state machine (RESET → INIT → RTR → RTS).

use std::ffi::{c_int, c_uint};
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use super::{CompletionQueue, ProtectionDomain};
use crate::ffi::ibverbs as ibv;

/// What RTR needs to know about the two ends of an RC connection.
#[derive(Clone, Copy, Debug)]
pub struct RcPath {
    /// Local port (1-based).
    pub port: u8,
    /// Index of the local GID (the source GID of global routing).
    pub gid_index: u8,
    /// Path MTU (`IBV_MTU_*`).
    pub mtu: c_uint,
    /// The peer QP's number.
    pub remote_qpn: u32,
    /// The peer port's GID (routing is always global, which RoCE needs).
    pub remote_gid: ibv::ibv_gid,
    /// The peer port's LID (InfiniBand; 0 on RoCE).
    pub remote_lid: u16,
}

/// An RC QP (`ibv_create_qp`), destroyed on drop; it keeps its PD and CQ alive.
pub struct QueuePair {
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
    qp: NonNull<ibv::ibv_qp>,
}

// SAFETY: a QP may be used from any thread (libibverbs is thread-safe, posting
// included); it is destroyed only by Drop.
unsafe impl Send for QueuePair {}
// SAFETY: `&QueuePair` only hands the pointer to libibverbs calls (post, modify, query), which are
// thread-safe, and reads `qp_num`, which never changes; no Rust-side state is mutated.
unsafe impl Sync for QueuePair {}

impl QueuePair {
    /// An RC QP on `pd` whose send and receive completions go to `cq` (a CQ of the same
    /// device), with room for `max_send_wr` outstanding sends. `signal_all`: every
    /// send completes on the CQ, not only those flagged `IBV_SEND_SIGNALED`.
    pub fn new_rc(
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<CompletionQueue>,
        max_send_wr: u32,
        signal_all: bool,
    ) -> io::Result<QueuePair> {
        let mut init = ibv::ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq.as_ptr(),
            recv_cq: cq.as_ptr(),
            srq: std::ptr::null_mut(),
            cap: ibv::ibv_qp_cap {
                max_send_wr,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ibv::IBV_QPT_RC,
            sq_sig_all: c_int::from(signal_all),
        };
        // SAFETY: a live PD and CQ and a filled-in init struct; the QP returned is
        // owned by the value made here.
        let qp = unsafe { (pd.context().verbs().create_qp)(pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(io::Error::last_os_error)?;
        Ok(QueuePair {
            pd: pd.clone(),
            cq: cq.clone(),
            qp,
        })
    }

    /// The protection domain the QP was created in.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// The CQ its send and receive completions go to.
    pub fn cq(&self) -> &Arc<CompletionQueue> {
        &self.cq
    }

    /// The raw QP, for verbs calls.
    pub fn as_ptr(&self) -> *mut ibv::ibv_qp {
        self.qp.as_ptr()
    }

    /// The QP's number, which the peer's RTR names.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: a live QP; its number is set at creation and never changes.
        unsafe { (*self.as_ptr()).qp_num }
    }

    /// `ibv_modify_qp` with `attr` and `mask` (`IBV_QP_*`).
    pub fn modify(&self, attr: &mut ibv::ibv_qp_attr, mask: c_int) -> Result<(), c_int> {
        let verbs = self.pd.context().verbs();
        // SAFETY: a live QP and a valid attribute struct for the call.
        match unsafe { (verbs.modify_qp)(self.as_ptr(), attr, mask) } {
            0 => Ok(()),
            rc => Err(rc),
        }
    }

    /// A transition that takes no attributes but the state: to RESET (from any state,
    /// to connect again) or ERR (flushing what is outstanding).
    pub fn set_state(&self, state: c_uint) -> Result<(), c_int> {
        let mut a = ibv::ibv_qp_attr {
            qp_state: state,
            ..Default::default()
        };
        self.modify(&mut a, ibv::IBV_QP_STATE)
    }

    /// RESET → INIT on `port`, letting peers use `access` (`IBV_ACCESS_*`).
    pub fn to_init(&self, port: u8, access: c_int) -> Result<(), c_int> {
        let mut a = ibv::ibv_qp_attr {
            qp_state: ibv::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: port,
            qp_access_flags: access as u32,
            ..Default::default()
        };
        let mask = ibv::IBV_QP_STATE
            | ibv::IBV_QP_PKEY_INDEX
            | ibv::IBV_QP_PORT
            | ibv::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut a, mask)
    }

    /// INIT → RTR (ready to receive) from the peer QP at `path`: PSN 0, 16 RDMA READs
    /// served at once, a 12 (0.64 ms) RNR timer.
    pub fn to_rtr(&self, path: &RcPath) -> Result<(), c_int> {
        let mut a = ibv::ibv_qp_attr {
            qp_state: ibv::IBV_QPS_RTR,
            path_mtu: path.mtu,
            dest_qp_num: path.remote_qpn,
            rq_psn: 0,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            ..Default::default()
        };
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid = path.remote_gid;
        a.ah_attr.grh.hop_limit = 16;
        a.ah_attr.grh.sgid_index = path.gid_index;
        a.ah_attr.dlid = path.remote_lid;
        a.ah_attr.port_num = path.port;
        let mask = ibv::IBV_QP_STATE
            | ibv::IBV_QP_AV
            | ibv::IBV_QP_PATH_MTU
            | ibv::IBV_QP_DEST_QPN
            | ibv::IBV_QP_RQ_PSN
            | ibv::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut a, mask)
    }

    /// RTR → RTS (ready to send): PSN 0, 16 RDMA READs outstanding, timeout 14
    /// (~67 ms), 7 retries and 7 RNR retries (the most: 7 means unlimited).
    pub fn to_rts(&self) -> Result<(), c_int> {
        let mut a = ibv::ibv_qp_attr {
            qp_state: ibv::IBV_QPS_RTS,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            sq_psn: 0,
            max_rd_atomic: 16,
            ..Default::default()
        };
        let mask = ibv::IBV_QP_STATE
            | ibv::IBV_QP_TIMEOUT
            | ibv::IBV_QP_RETRY_CNT
            | ibv::IBV_QP_RNR_RETRY
            | ibv::IBV_QP_SQ_PSN
            | ibv::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut a, mask)
    }

    /// Connects a fresh (RESET) QP to the peer at `path`: INIT → RTR → RTS. An error
    /// names the transition that failed and carries `ibv_modify_qp`'s errno.
    pub fn connect(&self, access: c_int, path: &RcPath) -> io::Result<()> {
        fn failed(to: &'static str) -> impl Fn(c_int) -> io::Error {
            move |rc| {
                let e = io::Error::from_raw_os_error(rc);
                io::Error::new(e.kind(), format!("modify QP to {to}: error {rc} ({e})"))
            }
        }
        self.to_init(path.port, access).map_err(failed("INIT"))?;
        self.to_rtr(path).map_err(failed("RTR"))?;
        self.to_rts().map_err(failed("RTS"))
    }

    /// verbs.h's `ibv_post_send` on this QP.
    ///
    /// # Safety
    /// `wr` must be a valid chain of work requests whose scatter lists are readable for
    /// the call, and whose local ranges lie in memory registered (and kept valid) for
    /// the lkeys they name: the NIC reads or writes them after the call returns.
    pub unsafe fn post_send(&self, wr: *mut ibv::ibv_send_wr) -> Result<(), c_int> {
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live QP; the caller vouches for `wr`.
        match unsafe { ibv::post_send(self.as_ptr(), wr, &mut bad) } {
            0 => Ok(()),
            rc => Err(rc),
        }
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: a live QP owned by us, destroyed once, here, before the Arcs of its
        // PD and CQ go.
        let rc = unsafe { (self.pd.context().verbs().destroy_qp)(self.as_ptr()) };
        super::released("ibv_destroy_qp", self.pd.context().name(), rc);
    }
}
