//! Writes into a peer's mapped segment. A store node's segment is written page by
//! page once, then overwritten again and again, and the writer never reads back what
//! it wrote there, so:
//! - the first write into each 2 MiB window of the mapping populates the whole window
//!   in one call (`MADV_POPULATE_WRITE`, Linux 5.14; older kernels fault as before)
//!   rather than taking a fault per 4 KiB page, then copies as usual: about a third
//!   less time for a fresh window on this project's VM;
//! - later writes stream past the caches: they neither read the destination's lines
//!   first nor push the writer's working set out (about 1.9× an ordinary copy into a
//!   pool larger than the caches, same VM; bench/README.md).
//!
//! A window is populated at most once per view (two views may both do it: harmless).
//! It costs memory for at most the 2 MiB around a write, never for untouched windows.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::util::stream_copy::copy_bypassing_cache;

/// Bytes of the mapping one populate call covers.
const WINDOW: usize = 2 << 20;

/// Which windows of one mapping this view already wrote into.
pub(super) struct Filled {
    /// One bit per window.
    windows: Box<[AtomicU64]>,
}

impl Filled {
    /// For a mapping of `len` bytes, nothing written yet.
    pub(super) fn new(len: usize) -> Filled {
        let words = len.div_ceil(WINDOW).div_ceil(64);
        Filled {
            windows: (0..words).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Copies `len` bytes from `src` to `offset` of the mapping at `base` (`map_len`
    /// bytes long), populating windows written for the first time.
    ///
    /// # Safety
    /// `base` must be a live writable shared mapping of `map_len` bytes, `offset +
    /// len <= map_len`, and `src` readable for `len` bytes and not overlapping the
    /// destination (the contract of a memcpy into the mapping).
    pub(super) unsafe fn write(
        &self,
        base: *mut u8,
        map_len: usize,
        offset: usize,
        src: *const u8,
        len: usize,
    ) {
        if len == 0 {
            return;
        }
        let mut fresh = false;
        for w in offset / WINDOW..=(offset + len - 1) / WINDOW {
            let (word, bit) = (w / 64, 1u64 << (w % 64));
            if self.windows[word].fetch_or(bit, Ordering::Relaxed) & bit == 0 {
                fresh = true;
                let start = w * WINDOW;
                let end = (start + WINDOW).min(map_len);
                // SAFETY: [start, end) lies inside the mapping (the caller's
                // contract); populating only faults pages in, it changes no contents.
                unsafe { crate::sys::populate_for_write(base.add(start), end - start) };
            }
        }
        // SAFETY: the caller's contract: both ranges valid, disjoint, ours alone.
        let (dst, src) = unsafe {
            (
                std::slice::from_raw_parts_mut(base.add(offset), len),
                std::slice::from_raw_parts(src, len),
            )
        };
        if fresh {
            // Populated pages were just zeroed through the caches: an ordinary copy
            // measured faster here than streaming over them.
            dst.copy_from_slice(src);
        } else {
            copy_bypassing_cache(dst, src);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Filled, WINDOW};
    use crate::memfd::{SharedMemory, Sharing};

    #[test]
    fn writes_land_whole_across_windows_first_and_later() {
        let len = 3 * WINDOW + 4096;
        let shm = SharedMemory::create("fill-test", len, Sharing::PeersWrite).unwrap();
        let filled = Filled::new(len);
        let src: Vec<u8> = (0..WINDOW).map(|i| (i % 251) as u8).collect();
        // Spans windows 0 and 1, fresh; then again (streamed); then the last, short one.
        for (offset, n) in [(WINDOW - 5_000, WINDOW), (7, 70_000), (len - 4000, 4000)] {
            // SAFETY: inside the mapping, which this test alone uses.
            unsafe { filled.write(shm.ptr(), len, offset, src.as_ptr(), n) };
            // SAFETY: as above, read back after the write.
            let got = unsafe { std::slice::from_raw_parts(shm.ptr().add(offset), n) };
            assert!(got == &src[..n], "offset {offset} len {n}");
        }
        assert_eq!(
            filled.windows[0].load(std::sync::atomic::Ordering::Relaxed),
            0b1011
        );
    }
}
