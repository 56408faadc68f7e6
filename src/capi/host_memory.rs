//! `mc_host_memory_alloc` / `mc_host_memory_free`: a plain C allocator pair over host
//! memory, for callers that take allocation callbacks by address (Python's
//! `mooncake.store.get_alloc_func_addr`, which LMCache's Mooncake allocator calls).
//!
//! The signatures are fixed by those callers (`void *(size_t)`, `void (void *)`), so
//! there is no error code: failures are NULL (logged), and a free of an address this
//! pair did not hand out is ignored (logged) rather than trusted.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use crate::memfd::Mapping;
use crate::util::sync::Unpoisoned;

use super::guard_value;

/// Live allocations by address: a free needs the length, and must not unmap what it
/// was not given.
fn live() -> &'static Mutex<HashMap<usize, Mapping>> {
    static LIVE: OnceLock<Mutex<HashMap<usize, Mapping>>> = OnceLock::new();
    LIVE.get_or_init(Mutex::default)
}

/// `len` zeroed, page-aligned bytes (huge pages advised); NULL for 0 or on failure.
#[no_mangle]
pub extern "C" fn mc_host_memory_alloc(len: usize) -> *mut c_void {
    guard_value("mc_host_memory_alloc", std::ptr::null_mut(), || {
        if len == 0 {
            return std::ptr::null_mut();
        }
        match Mapping::anonymous(len) {
            Ok(memory) => {
                let ptr = memory.ptr();
                live().locked().insert(ptr as usize, memory);
                ptr.cast()
            }
            Err(e) => {
                log::warn!("mc_host_memory_alloc({len}): {e}");
                std::ptr::null_mut()
            }
        }
    })
}

/// Releases what `mc_host_memory_alloc` gave; NULL and unknown addresses are ignored.
///
/// # Safety
/// Nothing may use the memory at `addr` once this is called (as for `free`).
#[no_mangle]
pub unsafe extern "C" fn mc_host_memory_free(addr: *mut c_void) {
    guard_value("mc_host_memory_free", (), || {
        if addr.is_null() {
            return;
        }
        // Dropped (unmapped) once out of the lock.
        let memory = live().locked().remove(&(addr as usize));
        if memory.is_none() {
            log::warn!("mc_host_memory_free: {addr:p} did not come from mc_host_memory_alloc");
        }
    })
}
