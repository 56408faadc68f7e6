//! The stable C ABI declared in `c_include/mooncake.h`: thin `extern "C"` shims over
//! [`Engine`](crate::Engine).
//!
//! Every entry point checks its pointers and strings, catches panics (none may unwind
//! into C: a panic becomes `MC_ERR_INTERNAL`), and turns an [`Error`] into its negative
//! code, logging the context so users can see why a call failed.

mod args;
mod collective;
mod config;
mod engine;
mod error;
mod host_memory;
mod process_bound;
mod python;
mod store;
mod store_batch;
mod store_surface;
mod te_compat;

pub use collective::*;
pub use config::*;
pub use engine::*;
pub use error::*;
pub use host_memory::*;
pub use python::*;
pub use store::*;
pub use store_batch::*;
pub use store_surface::*;
pub use te_compat::*;

use std::any::Any;
use std::ffi::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;

use crate::error::{Code, Result};

/// `MC_ABI_VERSION` of the header this library implements.
pub const MC_ABI_VERSION: u32 = 1;
/// `MC_ABI_REVISION`: functions added within this ABI version.
pub const MC_ABI_REVISION: u32 = 13;
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
