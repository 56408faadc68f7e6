//! A memory region: a buffer registered with a protection domain.

use std::ffi::{c_int, c_void};
use std::io;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::Arc;

use super::ProtectionDomain;
use crate::ffi::ibverbs as ibv;

/// A registration (`ibv_reg_mr` or `ibv_reg_dmabuf_mr`), deregistered on drop; it keeps
/// its PD (and so the device) alive.
pub struct MemoryRegion {
    pd: Arc<ProtectionDomain>,
    mr: NonNull<ibv::ibv_mr>,
}

// SAFETY: an MR may be used from any thread (libibverbs is thread-safe); shared use
// only reads its keys, and it is deregistered only by Drop.
unsafe impl Send for MemoryRegion {}
// SAFETY: `&MemoryRegion` only reads `lkey`, `rkey` and `addr`, fixed at registration, and clones
// nothing but the `Arc` PD; deregistration needs `&mut` (Drop).
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// `ibv_reg_mr` of `len` bytes at `addr` with `access` (`IBV_ACCESS_*`).
    ///
    /// # Safety
    /// `[addr, addr + len)` must stay mapped, and not be handed out for other uses,
    /// until the region is dropped: the NIC reads and (with write access) writes it
    /// on its own, for this process and for peers holding the rkey.
    pub unsafe fn register(
        pd: &Arc<ProtectionDomain>,
        addr: *mut c_void,
        len: usize,
        access: c_int,
    ) -> io::Result<MemoryRegion> {
        let verbs = pd.context().verbs();
        // SAFETY: a live PD; the caller keeps the range valid for the MR's lifetime.
        let mr = unsafe { (verbs.reg_mr)(pd.as_ptr(), addr, len, access) };
        Self::made(pd, mr)
    }

    /// `ibv_reg_dmabuf_mr`: `len` bytes from `offset` of the dma-buf `fd`, addressed
    /// by peers from `iova`. `Unsupported` when the loaded libibverbs lacks the call.
    ///
    /// # Safety
    /// `fd` must be a dma-buf export of memory that holds `[offset, offset + len)` and
    /// stays allocated, and not handed out for other uses, until the region is dropped.
    pub unsafe fn register_dmabuf(
        pd: &Arc<ProtectionDomain>,
        offset: u64,
        len: usize,
        iova: u64,
        fd: RawFd,
        access: c_int,
    ) -> io::Result<MemoryRegion> {
        let Some(reg_dmabuf_mr) = pd.context().verbs().reg_dmabuf_mr else {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "libibverbs has no ibv_reg_dmabuf_mr",
            ));
        };
        // SAFETY: a live PD; the caller vouches for the dma-buf and its lifetime.
        let mr = unsafe { reg_dmabuf_mr(pd.as_ptr(), offset, len, iova, fd, access) };
        Self::made(pd, mr)
    }

    fn made(pd: &Arc<ProtectionDomain>, mr: *mut ibv::ibv_mr) -> io::Result<MemoryRegion> {
        let mr = NonNull::new(mr).ok_or_else(io::Error::last_os_error)?;
        Ok(MemoryRegion { pd: pd.clone(), mr })
    }

    /// The protection domain the region is registered in.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// The raw memory region, for verbs calls and its keys.
    pub fn as_ptr(&self) -> *mut ibv::ibv_mr {
        self.mr.as_ptr()
    }

    /// The key local work requests name the region by.
    pub fn lkey(&self) -> u32 {
        // SAFETY: a live MR; the key is set at registration and never changes.
        unsafe { (*self.as_ptr()).lkey }
    }

    /// The key peers name the region by in RDMA requests.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as for `lkey`.
        unsafe { (*self.as_ptr()).rkey }
    }

    /// The registered address (the iova of a dma-buf registration).
    pub fn addr(&self) -> u64 {
        // SAFETY: as for `lkey`.
        unsafe { (*self.as_ptr()).addr as u64 }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        let addr = self.addr();
        // SAFETY: a live MR owned by us, deregistered once, here, before the Arc of its
        // PD goes; once it is, no peer can use its rkey.
        let rc = unsafe { (self.pd.context().verbs().dereg_mr)(self.as_ptr()) };
        if rc != 0 {
            let what = format!("{addr:#x} on {}", self.pd.context().name());
            super::released("ibv_dereg_mr", &what, rc);
        }
    }
}
