//! `mc_abi_version`, `mc_abi_revision`, `mc_version` and `mc_error_string`.

use std::ffi::{c_char, c_int, CStr, CString};
use std::sync::OnceLock;

use super::{guard_value, MC_ABI_REVISION, MC_ABI_VERSION};
use crate::error::Code;

const SUCCESS: &CStr = c"success";
const UNKNOWN: &CStr = c"unknown error";

/// The ABI version this library implements (`MC_ABI_VERSION`).
#[no_mangle]
pub extern "C" fn mc_abi_version() -> u32 {
    MC_ABI_VERSION
}

/// The revision of this ABI version the library implements (`MC_ABI_REVISION`).
#[no_mangle]
pub extern "C" fn mc_abi_revision() -> u32 {
    MC_ABI_REVISION
}

/// This crate's version as a C string (`MC_VERSION_STRING`).
const VERSION: &CStr =
    match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(v) => v,
        Err(_) => panic!("the package version contains a NUL"),
    };

/// The library's release, `"MAJOR.MINOR.PATCH"` (`MC_VERSION_STRING`); static, never
/// NULL.
#[no_mangle]
pub extern "C" fn mc_version() -> *const c_char {
    VERSION.as_ptr()
}

/// A static description of an error code; "unknown error" for codes not in
/// `enum mc_error`. Never NULL.
#[no_mangle]
pub extern "C" fn mc_error_string(code: c_int) -> *const c_char {
    static TABLE: OnceLock<Vec<(c_int, CString)>> = OnceLock::new();
    guard_value("mc_error_string", UNKNOWN.as_ptr(), || {
        if code == 0 {
            return SUCCESS.as_ptr();
        }
        let table = TABLE.get_or_init(|| {
            Code::ALL
                .iter()
                .filter_map(|&c| Some((c as c_int, CString::new(c.describe()).ok()?)))
                .collect()
        });
        table
            .iter()
            .find(|(c, _)| *c == code)
            .map_or(UNKNOWN.as_ptr(), |(_, s)| s.as_ptr())
    })
}
