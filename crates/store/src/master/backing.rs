//! Mounts backed by memory: a segment counts in the pool only once the master read
//! it, so a client cannot lend what no process holds (a "phantom" terabyte that puts
//! would be placed in and fail on, issue 28). The master itself does no I/O: whoever
//! runs it gives a `SegmentReach` (the server: one over a transfer engine).

use crate::error::Result;
use crate::protocol::SegmentInfo;

/// Reads a segment a client asks to lend, as a writer of the pool would.
pub trait SegmentReach: Send + Sync {
    /// `Ok` when the segment's first and last bytes can be read where `segment` says;
    /// else why not.
    fn reach(&self, segment: &SegmentInfo) -> Result<()>;
}
