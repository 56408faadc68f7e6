//! A completion queue, optionally reporting to a completion channel.

use std::ffi::c_int;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::{CompChannel, Context};
use crate::ffi::ibverbs as ibv;

/// CQ events are acknowledged this many at a time (each acknowledgement takes a lock
/// in libibverbs); the rest when the CQ goes.
const ACK_BATCH: u32 = 64;

/// `ibv_create_cq`, destroyed on drop once the QPs using it are gone (they hold an
/// `Arc` of it), after acknowledging the events read from it.
pub struct CompletionQueue {
    ctx: Arc<Context>,
    channel: Option<Arc<CompChannel>>,
    cq: NonNull<ibv::ibv_cq>,
    /// Events read but not acknowledged yet.
    unacked: AtomicU32,
}

// SAFETY: a CQ may be used from any thread (libibverbs is thread-safe); it is
// destroyed only by Drop, when no reference remains.
unsafe impl Send for CompletionQueue {}
// SAFETY: `&CompletionQueue` only passes the CQ to thread-safe libibverbs calls (poll, notify, ack)
// and updates `unacked`, an AtomicU32; destruction needs `&mut` (Drop).
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// A CQ of at least `depth` entries on `ctx`, reporting to `channel` (which must be
    /// a channel of the same context) when armed.
    pub fn new(
        ctx: &Arc<Context>,
        depth: c_int,
        channel: Option<&Arc<CompChannel>>,
    ) -> io::Result<Arc<CompletionQueue>> {
        let ch = channel.map_or(std::ptr::null_mut(), |c| c.as_ptr());
        // SAFETY: an open context and, when given, a live channel; the CQ returned is
        // owned by the value made here.
        let cq =
            unsafe { (ctx.verbs().create_cq)(ctx.as_ptr(), depth, std::ptr::null_mut(), ch, 0) };
        let cq = NonNull::new(cq).ok_or_else(io::Error::last_os_error)?;
        Ok(Arc::new(CompletionQueue {
            ctx: ctx.clone(),
            channel: channel.cloned(),
            cq,
            unacked: AtomicU32::new(0),
        }))
    }

    /// The device context the CQ belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The event channel completions are signalled on, if any.
    pub fn channel(&self) -> Option<&Arc<CompChannel>> {
        self.channel.as_ref()
    }

    /// The raw CQ, for verbs calls.
    pub fn as_ptr(&self) -> *mut ibv::ibv_cq {
        self.cq.as_ptr()
    }

    /// `ibv_poll_cq`: takes up to `wcs.len()` completions; returns how many.
    pub fn poll(&self, wcs: &mut [ibv::ibv_wc]) -> Result<usize, c_int> {
        let n = wcs.len().min(c_int::MAX as usize) as c_int;
        // SAFETY: a live CQ; `wcs` has room for `n` entries.
        let rc = unsafe { ibv::poll_cq(self.as_ptr(), n, wcs.as_mut_ptr()) };
        usize::try_from(rc).map_err(|_| rc)
    }

    /// `ibv_req_notify_cq`: the next completion raises one event on the channel.
    pub fn arm(&self) -> Result<(), c_int> {
        // SAFETY: a live CQ.
        match unsafe { ibv::req_notify_cq(self.as_ptr(), false) } {
            0 => Ok(()),
            rc => Err(rc),
        }
    }

    /// Reads the next event queued on this CQ's channel (`ibv_get_cq_event`) and
    /// accounts for its acknowledgement. `Ok(false)`: the event was another CQ's (the
    /// channel serves more than this one); it is acknowledged at once. Fails with
    /// `WouldBlock` on a non-blocking channel with nothing queued, and with
    /// `InvalidInput` for a CQ without a channel.
    pub fn read_event(&self) -> io::Result<bool> {
        let Some(channel) = &self.channel else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the CQ has no completion channel",
            ));
        };
        let cq = channel.get_event()?;
        if cq != self.as_ptr() {
            // SAFETY: the event was just read for `cq`, a live CQ on our channel (a CQ
            // cannot go while it has events not acknowledged).
            unsafe { (self.ctx.verbs().ack_cq_events)(cq, 1) };
            return Ok(false);
        }
        if self.unacked.fetch_add(1, Ordering::Relaxed) + 1 >= ACK_BATCH {
            self.ack_events();
        }
        Ok(true)
    }

    /// Acknowledges every event read so far.
    pub fn ack_events(&self) {
        let n = self.unacked.swap(0, Ordering::Relaxed);
        if n > 0 {
            // SAFETY: a live CQ; `n` events were read for it and not acknowledged.
            unsafe { (self.ctx.verbs().ack_cq_events)(self.as_ptr(), n) };
        }
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        self.ack_events();
        // SAFETY: the QPs using the CQ hold an Arc of it, so none is left, and its
        // events are acknowledged; it is destroyed once, here, before the Arcs of its
        // channel and context go.
        let rc = unsafe { (self.ctx.verbs().destroy_cq)(self.as_ptr()) };
        super::released("ibv_destroy_cq", self.ctx.name(), rc);
    }
}
