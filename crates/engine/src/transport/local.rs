//! Transfers whose peer is this very engine: validated memcpy.

use std::sync::Arc;

use super::{copy_host, Finished, Kind, Op, Outcome, Slice, Transport, TransportWorker};
use crate::error::Result;
use crate::metadata::SegmentDesc;
use crate::registry::LocalMemory;

/// Writes from this size on have their destination faulted in first (one call per
/// write; a smaller one would pay the call for little).
const POPULATE_FROM: u64 = 256 << 10;

/// Transfers within one engine: a memcpy (or driver copy) between its own buffers.
pub struct LocalTransport {
    memory: Arc<LocalMemory>,
    own_name: String,
}

impl LocalTransport {
    /// A local transport over `memory`, for the segment named `own_name`.
    pub fn new(memory: Arc<LocalMemory>, own_name: &str) -> LocalTransport {
        LocalTransport {
            memory,
            own_name: own_name.to_owned(),
        }
    }
}

impl Transport for LocalTransport {
    fn kind(&self) -> Kind {
        Kind::Local
    }

    fn describe(&self, _desc: &mut SegmentDesc) {}

    fn reaches(&self, peer: &SegmentDesc) -> bool {
        peer.name == self.own_name
    }

    /// Device memory on either side is copied by its driver.
    fn carries(&self, _slice: &Slice) -> bool {
        true
    }

    fn slice_size(&self) -> u64 {
        64 << 20
    }

    fn new_worker(&self) -> Result<Box<dyn TransportWorker>> {
        Ok(Box::new(LocalWorker {
            memory: self.memory.clone(),
        }))
    }
}

struct LocalWorker {
    memory: Arc<LocalMemory>,
}

impl TransportWorker for LocalWorker {
    fn post(&mut self, slice: Slice, done: &mut Vec<Finished>) {
        let mut crc = None;
        let outcome = match self.memory.guard(slice.remote, slice.len) {
            Ok(target) if !target.device().is_host() || self.memory.has_device() => {
                // Device memory on either side: the driver copies (local side: the
                // kind it was registered with; unregistered means host).
                let local = self.memory.device_of(slice.local, slice.len);
                let remote = target.device();
                let ((dk, d), (sk, s)) = match slice.op {
                    Op::Read => ((local, slice.local), (remote, target.addr())),
                    Op::Write => ((remote, target.addr()), (local, slice.local)),
                };
                // SAFETY: as below; `copy` dispatches device ranges to their driver.
                match unsafe { crate::device::copy(dk, d, sk, s, slice.len as usize) } {
                    Ok(()) => Outcome::Done,
                    Err(e) => Outcome::Rejected(e.to_string()),
                }
            }
            Ok(target) => {
                // SAFETY: the local side is the caller's buffer, valid for `len` bytes
                // by the submit contract.
                crc = unsafe {
                    copy_own_host(
                        target.addr(),
                        target.len(),
                        slice.op,
                        slice.local,
                        slice.checksum,
                    )
                };
                Outcome::Done
            }
            Err(e) => Outcome::Rejected(e.to_string()),
        };
        done.push(Finished {
            id: slice.id,
            outcome,
            crc,
        });
    }
}

/// Moves `len` bytes between the caller's host memory at `local` and `[remote,
/// +len)`, a pinned host range of this engine's own registered memory, as `op` says:
/// the local transport's copy, which the engine also runs directly for its own
/// segment. A large write faults its destination in first; a checksummed read whose
/// ends do not overlap returns its CRC32C, folded during the copy.
///
/// # Safety
/// `local` must be valid for `len` bytes (written by a read) during the call, and
/// a guard must pin the registered buffer holding `[remote, +len)`.
pub(crate) unsafe fn copy_own_host(
    remote: u64,
    len: u64,
    op: Op,
    local: u64,
    checksum: bool,
) -> Option<u32> {
    let remote = remote as usize as *mut u8;
    let (src, dst) = match op {
        Op::Read => (remote as *const u8, local as *mut u8),
        Op::Write => (local as *const u8, remote),
    };
    if op == Op::Write && len >= POPULATE_FROM {
        // A store node writes its fresh segment page by page: fault the range in with
        // one call rather than a fault per 4 KiB page.
        // SAFETY: the caller's pin holds the registered range, writable by us.
        unsafe { crate::sys::populate_for_write(dst, len as usize) };
    }
    // SAFETY: the registered side is pinned by the caller's guard; the local side is
    // the caller's promise. `copy_host` tolerates a request whose two ends overlap.
    unsafe { copy_host(op, len, checksum, src, dst) }
}
