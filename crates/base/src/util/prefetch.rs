//! A hint that memory is about to be read, so that the cache misses of a batch's
//! independent lookups overlap rather than come one after another.

/// Asks the CPU to bring the cache line at `addr` into its caches. A hint only: nothing
/// is read through the pointer, and no address faults, valid or not.
#[inline]
pub fn prefetch_read<T>(addr: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never dereferences its address architecturally: it cannot
    // fault or change memory, whatever the address (SSE is part of x86_64).
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(addr.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}
