//! A protection domain.

use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use super::Context;
use crate::ffi::ibverbs as ibv;

/// `ibv_alloc_pd`, deallocated on drop once its MRs and QPs are gone (they hold an
/// `Arc` of it).
pub struct ProtectionDomain {
    ctx: Arc<Context>,
    pd: NonNull<ibv::ibv_pd>,
}

// SAFETY: a PD may be used from any thread (libibverbs is thread-safe); it is
// deallocated only by Drop, when no reference remains.
unsafe impl Send for ProtectionDomain {}
// SAFETY: `&ProtectionDomain` only passes the PD to thread-safe libibverbs calls (reg_mr,
// create_qp); nothing is mutated through it, and dealloc needs `&mut` (Drop).
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    /// Allocates a protection domain on `ctx`.
    pub fn new(ctx: &Arc<Context>) -> io::Result<Arc<ProtectionDomain>> {
        // SAFETY: an open context; the PD returned is owned by the value made here.
        let pd = unsafe { (ctx.verbs().alloc_pd)(ctx.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(io::Error::last_os_error)?;
        Ok(Arc::new(ProtectionDomain {
            ctx: ctx.clone(),
            pd,
        }))
    }

    /// The device context the domain belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw protection domain, for verbs calls.
    pub fn as_ptr(&self) -> *mut ibv::ibv_pd {
        self.pd.as_ptr()
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: the MRs and QPs of the PD hold an Arc of it, so none is left; the PD
        // is deallocated once, here, before the Arc of its context goes.
        let rc = unsafe { (self.ctx.verbs().dealloc_pd)(self.as_ptr()) };
        super::released("ibv_dealloc_pd", self.ctx.name(), rc);
    }
}
