//! Every C argument is checked here, once: strings, required pointers, arrays and byte
//! ranges (non-NULL unless empty, aligned, within `isize::MAX` bytes), and text answers
//! copied out. Entry points borrow through these helpers and never build a slice from a
//! raw pointer themselves.

use std::ffi::{c_char, c_int, c_void, CStr};

use super::MC_OK;
use crate::error::{Code, Error, Result};

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

/// Borrows an optional C string: NULL and "" give `None`.
///
/// # Safety
/// `p` must be NULL or a NUL-terminated string valid during `'a`.
pub(crate) unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null, so the caller guarantees a NUL-terminated string valid for `'a`.
    let s = unsafe { c_str(p, what)? };
    Ok((!s.is_empty()).then_some(s))
}

/// Fails unless `n` elements at `p` can be a slice: non-NULL, aligned, and within
/// `isize::MAX` bytes.
fn check_array<T>(p: *const T, n: usize, what: &str) -> Result<()> {
    non_null(p, what)?;
    if !p.is_aligned() || n > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(Error::invalid(format!("{what} {p:p} with n = {n}")));
    }
    Ok(())
}

/// Borrows `n` elements at `p` (which may be NULL when `n` is 0).
///
/// # Safety
/// `p` must be NULL or point to `n` initialised elements that stay unchanged for `'a`.
pub(crate) unsafe fn array<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    check_array(p, n, what)?;
    // SAFETY: non-null, aligned, size in range (checked), and `n` readable elements per
    // the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Mutable form of [`array`].
///
/// # Safety
/// `p` must be NULL or point to `n` writable elements not otherwise accessed in `'a`.
pub(crate) unsafe fn array_mut<'a, T>(p: *mut T, n: usize, what: &str) -> Result<&'a mut [T]> {
    if n == 0 {
        return Ok(&mut []);
    }
    check_array(p, n, what)?;
    // SAFETY: non-null, aligned, size in range (checked); the caller guarantees `n`
    // writable elements that nothing else accesses during `'a`.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
}

/// `len` bytes at `p` (NULL allowed when `len` is 0).
///
/// # Safety
/// As [`array`].
pub(crate) unsafe fn bytes<'a>(p: *const c_void, len: usize, what: &str) -> Result<&'a [u8]> {
    // SAFETY: the caller's guarantee, for bytes.
    unsafe { array(p.cast::<u8>(), len, what) }
}

/// `len` writable bytes at `p` (NULL allowed when `len` is 0).
///
/// # Safety
/// As [`array_mut`].
pub(crate) unsafe fn bytes_mut<'a>(p: *mut c_void, len: usize, what: &str) -> Result<&'a mut [u8]> {
    // SAFETY: the caller's guarantee, for bytes.
    unsafe { array_mut(p.cast::<u8>(), len, what) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_must_be_non_null_aligned_and_in_range_unless_empty() {
        let words = [1u64, 2, 3];
        // SAFETY: each call either borrows `words` within its length or is refused
        // before any access.
        unsafe {
            assert_eq!(array(words.as_ptr(), 3, "words").unwrap(), &words);
            assert!(array(std::ptr::null::<u64>(), 0, "empty")
                .unwrap()
                .is_empty());
            assert!(array(std::ptr::null::<u64>(), 1, "null").is_err());
            let odd = words.as_ptr().cast::<u8>().add(1).cast::<u64>();
            assert!(array(odd, 1, "misaligned").is_err());
            assert!(array(words.as_ptr(), usize::MAX / 4, "huge").is_err());
            assert!(bytes(std::ptr::null(), 1, "null bytes").is_err());
            assert_eq!(
                bytes(words.as_ptr().cast(), 8, "bytes").unwrap(),
                &1u64.to_ne_bytes()
            );
        }
    }
}
