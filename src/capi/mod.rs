//! The stable C ABI declared in `c_include/mooncake.h`: thin `extern "C"` shims over
//! [`Engine`](crate::Engine).
//!
//! Every entry point checks its pointers and strings, catches panics (none may unwind
//! into C: a panic becomes `MC_ERR_INTERNAL`), and turns an [`Error`] into its negative
//! code, logging the context so users can see why a call failed.

mod collective;
mod config;
mod engine;
mod error;
mod store;
mod store_batch;
mod store_surface;
mod te_compat;

pub use collective::*;
pub use config::*;
pub use engine::*;
pub use error::*;
pub use store::*;
pub use store_batch::*;
pub use store_surface::*;
pub use te_compat::*;

use std::any::Any;
use std::ffi::{c_char, c_int, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;

use crate::error::{Code, Error, Result};

/// `MC_ABI_VERSION` of the header this library implements.
pub const MC_ABI_VERSION: u32 = 1;
/// `MC_ABI_REVISION`: functions added within this ABI version.
pub const MC_ABI_REVISION: u32 = 7;
/// `MC_OK`.
pub const MC_OK: c_int = 0;

/// Installs a stderr logger (filtered by `RUST_LOG`, default `warn`) unless the process
/// already has one, so C callers see why calls fail.
pub(crate) fn init_logging() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let env = env_logger::Env::default().default_filter_or("warn");
        let _ = env_logger::Builder::from_env(env).try_init();
    });
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// Runs the body of an int-returning entry point: `Ok(v)` gives `v`, an error its code
/// (logged with its context), a panic `MC_ERR_INTERNAL`.
pub(crate) fn guard(what: &str, body: impl FnOnce() -> Result<c_int>) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            match e.code() {
                // Expected in normal polling use; not worth a warning.
                Code::BufferOverflow | Code::Timeout => log::debug!("{what}: {e}"),
                // Rate-limited: while a master fails over, every call of a busy client
                // fails alike (400 identical lines in 3 s before).
                _ => crate::warn_limited!("{what}: {e}"),
            }
            e.code() as c_int
        }
        Err(p) => {
            log::error!("{what}: panic: {}", panic_message(p.as_ref()));
            Code::Internal as c_int
        }
    }
}

/// Runs the body of an entry point that returns no code; a panic gives `fallback`.
pub(crate) fn guard_value<T>(what: &str, fallback: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|p| {
        log::error!("{what}: panic: {}", panic_message(p.as_ref()));
        fallback
    })
}

/// Borrows a C string argument as UTF-8.
///
/// # Safety
/// `p` must be NULL or point to a NUL-terminated string that stays valid and unchanged
/// for `'a`.
pub(crate) unsafe fn c_str<'a>(p: *const c_char, what: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-null, and the caller guarantees a valid NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map_err(|_| Error::invalid(format!("{what} is not valid UTF-8")))
}

/// Fails with `MC_ERR_INVALID_PARAMS` when a required pointer is NULL.
pub(crate) fn non_null<T>(p: *const T, what: &str) -> Result<()> {
    if p.is_null() {
        Err(Error::invalid(format!("{what} is NULL")))
    } else {
        Ok(())
    }
}

/// Copies a text answer into `buf[..len]` NUL-terminated, telling `*needed_out` (when
/// not NULL) how many bytes it takes; `MC_ERR_BUFFER_OVERFLOW` (and `buf` set to "")
/// when it does not fit.
///
/// # Safety
/// `buf` must be NULL or writable for `len` bytes; `needed_out` NULL or writable.
pub(crate) unsafe fn answer_text(
    text: &str,
    buf: *mut c_char,
    len: usize,
    needed_out: *mut usize,
    what: &str,
) -> Result<c_int> {
    if !needed_out.is_null() {
        // SAFETY: `needed_out` is non-null (just checked) and the caller guarantees a non-null
        // `needed_out` is writable; `usize` has no drop glue, so the plain store is fine.
        unsafe { *needed_out = text.len() + 1 };
    }
    if len > 0 {
        non_null(buf, "buf")?;
    }
    // SAFETY: `buf` is writable for `len` bytes (or `len` is 0 and nothing is written).
    if len > 0 && unsafe { copy_out(text, buf, len) } {
        return Ok(MC_OK);
    }
    if len > 0 {
        // SAFETY: `buf` holds at least one byte.
        unsafe { *buf = 0 };
    }
    Err(Error::new(
        Code::BufferOverflow,
        format!("{what} needs {} bytes, buffer has {len}", text.len() + 1),
    ))
}

/// Copies `s` plus a NUL into `buf`; `false` (nothing copied) when it does not fit.
///
/// # Safety
/// `buf` must be valid for writes of `len` bytes.
pub(crate) unsafe fn copy_out(s: &str, buf: *mut c_char, len: usize) -> bool {
    if s.len() >= len {
        return false;
    }
    // SAFETY: `s.len() + 1 <= len` bytes fit in `buf`, which the caller guarantees is
    // writable for `len` bytes; a Rust string never overlaps caller-owned memory.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        *buf.add(s.len()) = 0;
    }
    true
}
