//! Owning wrappers over the libibverbs objects the transport uses, one object per file:
//! a device [`Context`], a [`ProtectionDomain`], a [`CompChannel`], a
//! [`CompletionQueue`], a [`QueuePair`] and a [`MemoryRegion`].
//!
//! Each wrapper releases its handle through the loaded verbs table when dropped, and
//! each child holds an `Arc` of the parents it was made from (a PD its context, a CQ its
//! context and channel, a QP its PD and CQ, an MR its PD), so whatever order the owners
//! go in, verbs sees children released before their parents. Releasing never fails
//! silently: a non-zero return is logged and counted ([`release_failures`]).
//!
//! libibverbs objects may be used from any thread (rdma-core's verbs are thread-safe),
//! which is why every wrapper is `Send` and `Sync`.

mod channel;
mod context;
mod cq;
mod mr;
mod pd;
mod qp;

use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, Ordering};

pub use channel::CompChannel;
pub use context::{Context, DeviceList};
pub use cq::CompletionQueue;
pub use mr::MemoryRegion;
pub use pd::ProtectionDomain;
pub use qp::{QueuePair, RcPath};

static RELEASE_FAILURES: AtomicU64 = AtomicU64::new(0);

/// How many verbs objects this process failed to release (`ibv_destroy_*`,
/// `ibv_dealloc_pd`, `ibv_dereg_mr` or `ibv_close_device` returning non-zero) since it
/// started. A provider refuses to release an object that still has children (or, for a
/// CQ, events not acknowledged), so this stays 0 while drop order is right.
pub fn release_failures() -> u64 {
    RELEASE_FAILURES.load(Ordering::Relaxed)
}

/// Notes the return code of a release call made from a wrapper's Drop.
fn released(call: &str, what: &str, rc: c_int) {
    if rc != 0 {
        RELEASE_FAILURES.fetch_add(1, Ordering::Relaxed);
        log::warn!("rdma: {call}({what}): error {rc}");
    }
}
