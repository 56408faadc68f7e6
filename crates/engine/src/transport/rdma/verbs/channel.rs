//! A completion channel: events of armed CQs are read from its descriptor.

use std::io;
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::Arc;

use super::Context;
use crate::ffi::ibverbs as ibv;

/// `ibv_create_comp_channel`, destroyed on drop once the CQs reporting to it are gone
/// (they hold an `Arc` of it).
pub struct CompChannel {
    ctx: Arc<Context>,
    ch: NonNull<ibv::ibv_comp_channel>,
}

// SAFETY: a channel may be used from any thread (libibverbs is thread-safe); it is
// destroyed only by Drop, when no reference remains.
unsafe impl Send for CompChannel {}
// SAFETY: `&CompChannel` only reads the immutable `fd` and passes the channel to thread-safe
// libibverbs calls (get_cq_event); destruction needs `&mut` (Drop).
unsafe impl Sync for CompChannel {}

impl CompChannel {
    /// Creates a completion event channel on `ctx`.
    pub fn new(ctx: &Arc<Context>) -> io::Result<Arc<CompChannel>> {
        // SAFETY: an open context; the channel returned is owned by the value made here.
        let ch = unsafe { (ctx.verbs().create_comp_channel)(ctx.as_ptr()) };
        let ch = NonNull::new(ch).ok_or_else(io::Error::last_os_error)?;
        Ok(Arc::new(CompChannel {
            ctx: ctx.clone(),
            ch,
        }))
    }

    /// The device context the channel belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The raw channel, for verbs calls.
    pub fn as_ptr(&self) -> *mut ibv::ibv_comp_channel {
        self.ch.as_ptr()
    }

    /// The descriptor that turns readable while events are queued.
    pub fn fd(&self) -> RawFd {
        // SAFETY: a live channel; `fd` is set at creation and never changes.
        unsafe { (*self.as_ptr()).fd }
    }

    /// Makes reading an event fail with `WouldBlock` instead of waiting for one.
    pub fn set_nonblocking(&self) -> io::Result<()> {
        let fd = self.fd();
        // SAFETY: fcntl on the channel's own open descriptor.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: `fd` is the channel's own descriptor, open while `self` lives; F_SETFL takes an
        // int and touches no memory of ours.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// `ibv_get_cq_event`: the CQ whose event was read. The event must be acknowledged
    /// on that CQ ([`super::CompletionQueue::read_event`] does both).
    pub(super) fn get_event(&self) -> io::Result<*mut ibv::ibv_cq> {
        let mut cq = std::ptr::null_mut();
        let mut cq_context = std::ptr::null_mut();
        // SAFETY: a live channel and valid out-parameters.
        let rc =
            unsafe { (self.ctx.verbs().get_cq_event)(self.as_ptr(), &mut cq, &mut cq_context) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(cq)
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: the CQs reporting to the channel hold an Arc of it, so none is left;
        // it is destroyed once, here, before the Arc of its context goes.
        let rc = unsafe { (self.ctx.verbs().destroy_comp_channel)(self.as_ptr()) };
        super::released("ibv_destroy_comp_channel", self.ctx.name(), rc);
    }
}
