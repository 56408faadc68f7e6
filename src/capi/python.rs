//! The Python package's calls made in CPython's own calling convention
//! (`METH_FASTCALL`), for a hot path where ctypes costs more than the work: a ctypes
//! call with nine arguments takes ~1.9 µs, and the conversions of a batch's lists it
//! needs ~5 µs for 64 keys, while the whole read of 64 small values takes ~55.
//!
//! Each function reads the Python objects it is given with the GIL held, gives the
//! GIL up for the store's work, and answers `None` where the package's ctypes path
//! is to answer instead, with its own checks, errors and logs: the fast path never
//! decides an error a user sees.

use std::ffi::{c_char, c_void, CStr};
use std::ptr::null_mut;

use mooncake_sys::cpython::{self, CPython, PyMethodDef, PyObject, METH_FASTCALL};

use super::args::array;
use super::store::{answer_code, read_regular_batch, store, McStore};
use super::{guard_value, init_logging};
use crate::error::Result;

/// The functions `mc_python_function` hands out.
static FUNCTIONS: [PyMethodDef; 1] = [PyMethodDef {
    ml_name: c"batch_get_into".as_ptr(),
    ml_meth: Some(batch_get_into),
    ml_flags: METH_FASTCALL,
    ml_doc: c"batch_get_into(store, keys, buffer_ptrs, sizes, allowed, n_allowed): as \
        mc_store_batch_get_into_packed, from three lists of one length; a list of \
        results, or None when the batch is not regular."
        .as_ptr(),
}];

/// The definition (a `PyMethodDef`) of the built-in function `name` (see
/// mooncake.h), for the package to make a function object of; NULL when there is none
/// of that name or the process is not a Python interpreter whose C API this library
/// finds.
///
/// # Safety
/// `name` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mc_python_function(name: *const c_char) -> *const c_void {
    init_logging();
    guard_value("mc_python_function", std::ptr::null(), || {
        if let Err(e) = cpython::api() {
            log::debug!("mc_python_function: no Python C API: {e}");
            return std::ptr::null();
        }
        if name.is_null() {
            return std::ptr::null();
        }
        // SAFETY: non-null and NUL-terminated (this fn's contract).
        let name = unsafe { CStr::from_ptr(name) };
        // SAFETY: every `ml_name` is a static C string.
        let def = (FUNCTIONS.iter()).find(|d| unsafe { CStr::from_ptr(d.ml_name) } == name);
        def.map_or(std::ptr::null(), |d| (d as *const PyMethodDef).cast())
    })
}

/// `batch_get_into(store, keys, buffer_ptrs, sizes, allowed, n_allowed)`: the
/// results of `mc_store_batch_get_into_packed` as a list of ints, or None when the
/// batch is not regular (nothing read) or its lists hold what the ctypes path is to
/// judge. `store` is the handle as an int; `allowed` the address of `2 * n_allowed`
/// u64s, the `[start, end)` ranges its user registered.
unsafe extern "C-unwind" fn batch_get_into(
    _module: *mut PyObject,
    args: *const *mut PyObject,
    nargs: isize,
) -> *mut PyObject {
    // Bound before this function object was made (unreachable otherwise).
    let Ok(api) = cpython::api() else {
        return null_mut();
    };
    // The GIL held: the arguments checked, the lists copied out.
    // SAFETY: the interpreter passes `nargs` live arguments and holds the GIL.
    let first = guard_value("batch_get_into", Step::Decline, || unsafe {
        prepare(api, args, nargs)
    });
    let pending = match first {
        Step::Answer(answer) => return answer,
        Step::Decline => return api.new_none(),
        Step::Read(pending) => Box::into_raw(pending),
    };
    // The GIL given up for the read. Every value the read makes is dropped or boxed
    // before the GIL is asked back: on CPython 3.8 to 3.13, `PyEval_RestoreThread`
    // during the interpreter's shutdown ends a daemon thread with a forced unwind,
    // which may only cross frames with nothing to drop (as this one is then).
    // SAFETY: the GIL is held; nothing touches a Python object until it is back.
    let state = unsafe { (api.save_thread)() };
    let done = guard_value("batch_get_into", null_mut(), || {
        // SAFETY: `pending` came from `Box::into_raw` just above, taken back once;
        // its read's contract is the package's (as for mc_store_batch_get_into_packed).
        let answers = unsafe { Box::from_raw(pending).read() };
        answers.map_or(null_mut(), |a| Box::into_raw(Box::new(a)))
    });
    // SAFETY: the state `save_thread` gave this thread, handed back once.
    unsafe { (api.restore_thread)(state) };
    if done.is_null() {
        return api.new_none();
    }
    // The GIL held again.
    let list = guard_value("batch_get_into", null_mut(), || {
        // SAFETY: `done` came from `Box::into_raw`, taken back once; the GIL is held.
        unsafe { results_list(api, *Box::from_raw(done)) }
    });
    // (NULL with no error set only after a panic, logged: the ctypes path answers.)
    // SAFETY: the GIL is held.
    if list.is_null() && unsafe { (api.err_occurred)() }.is_null() {
        return api.new_none();
    }
    list
}

/// What `batch_get_into` does after its first step.
enum Step {
    /// Answers now (NULL: the error raised).
    Answer(*mut PyObject),
    /// Answers `None`: the ctypes path is to.
    Decline,
    /// Reads this batch, the GIL given up.
    Read(Box<PendingRead>),
}

/// The first step of `batch_get_into`, the GIL held.
///
/// # Safety
/// `args` holds `nargs` live objects; the calling thread holds the GIL.
unsafe fn prepare(api: &CPython, args: *const *mut PyObject, nargs: isize) -> Step {
    if nargs != 6 || args.is_null() {
        return Step::Answer(api.raise_type_error(
            c"batch_get_into takes store, keys, buffer_ptrs, sizes, allowed and n_allowed",
        ));
    }
    // SAFETY: six live arguments (checked count, the interpreter's contract).
    let args = unsafe { std::slice::from_raw_parts(args, 6) };
    // SAFETY: live objects, the GIL held (this fn's contract).
    let ints = unsafe { [args[0], args[4], args[5]].map(|o| u64_of(api, o)) };
    let [Some(handle), Some(allowed), Some(n_allowed)] = ints else {
        return Step::Answer(api.raise_type_error(
            c"batch_get_into: store, allowed and n_allowed are ints of 64 bits",
        ));
    };
    // SAFETY: as above.
    match unsafe { ListedBatch::read(api, args[1], args[2], args[3]) } {
        Some(batch) => Step::Read(Box::new(PendingRead {
            batch,
            handle,
            allowed,
            n_allowed,
        })),
        None => {
            api.clear_error();
            Step::Decline
        }
    }
}

/// A batch to read, and the store call's other arguments as the package gave them.
struct PendingRead {
    batch: ListedBatch,
    handle: u64,
    allowed: u64,
    n_allowed: u64,
}

impl PendingRead {
    /// The regular batch read of `mc_store_batch_get_into_packed`: the per-key
    /// answers, or None when the batch is not regular or the arguments are refused
    /// (nothing read then).
    ///
    /// # Safety
    /// As `mc_store_batch_get_into_packed`'s: `handle` a live store, `allowed` the
    /// address of `2 * n_allowed` u64s, and every span inside those ranges writable
    /// for its size, untouched by others, during the call.
    unsafe fn read(self) -> Option<Vec<Result<u64>>> {
        let pairs = usize::try_from(self.n_allowed).ok()?.checked_mul(2)?;
        let ListedBatch { packed, spans } = &self.batch;
        // SAFETY: this fn's contract.
        let got = unsafe {
            store(self.handle as usize as *mut McStore).and_then(|client| {
                let allowed = array(self.allowed as usize as *const u64, pairs, "allowed")?;
                Ok(read_regular_batch(client, packed, spans, allowed))
            })
        };
        match got {
            Ok(Ok(answers)) => Some(answers),
            Ok(Err(code)) => {
                log::debug!("batch_get_into: not a regular batch: {code:?}");
                None
            }
            Err(e) => {
                log::debug!("batch_get_into: {e}");
                None
            }
        }
    }
}

/// An int's value as a u64; None (the error cleared) for anything else.
///
/// # Safety
/// `o` is a live object; the calling thread holds the GIL.
unsafe fn u64_of(api: &CPython, o: *mut PyObject) -> Option<u64> {
    // SAFETY: this fn's contract.
    let v = unsafe { (api.long_as_unsigned_long_long)(o) };
    // SAFETY: the GIL is held.
    if v == u64::MAX && !unsafe { (api.err_occurred)() }.is_null() {
        api.clear_error();
        return None;
    }
    Some(v)
}

/// A batch copied out of the Python lists: its keys packed as for
/// `mc_store_key_array` (each followed by a NUL), and its spans (address, size).
struct ListedBatch {
    packed: Vec<u8>,
    spans: Vec<(u64, u64)>,
}

impl ListedBatch {
    /// The batch three lists of one length hold; None (an error may be set) for
    /// anything else: a key that is not a str UTF-8 can carry, an address or a size
    /// that is not an int within 64 bits, or a size below 2 (the ctypes path tells a
    /// bool from an int, which this does not).
    ///
    /// # Safety
    /// The objects are live; the calling thread holds the GIL.
    unsafe fn read(
        api: &CPython,
        keys: *mut PyObject,
        addrs: *mut PyObject,
        sizes: *mut PyObject,
    ) -> Option<ListedBatch> {
        // SAFETY: live objects, the GIL held (this fn's contract); nothing called here
        // runs Python code, so the lists cannot change while they are read.
        unsafe {
            let n = (api.list_size)(keys);
            if n < 0 || (api.list_size)(addrs) != n || (api.list_size)(sizes) != n {
                return None;
            }
            let mut packed = Vec::with_capacity(n as usize * 16);
            let mut spans = Vec::with_capacity(n as usize);
            for i in 0..n {
                let item = |list| Some((api.list_get_item)(list, i)).filter(|o| !o.is_null());
                let mut len = 0isize;
                let utf8 = (api.unicode_as_utf8_and_size)(item(keys)?, &mut len);
                if utf8.is_null() || len < 0 {
                    return None;
                }
                // The str's own UTF-8, alive while the str is: copied before the GIL goes.
                // (For a str not all ASCII, CPython makes it once and keeps it with the str.)
                packed.extend_from_slice(std::slice::from_raw_parts(utf8.cast(), len as usize));
                packed.push(0);
                let addr = u64_of(api, item(addrs)?)?;
                let size = u64_of(api, item(sizes)?).filter(|&s| s >= 2)?;
                spans.push((addr, size));
            }
            Some(ListedBatch { packed, spans })
        }
    }
}

/// A new list of the answers as ints (sizes, or negative codes); NULL (the error
/// set) when the interpreter is out of memory. Equal neighbours share one int.
///
/// # Safety
/// The calling thread holds the GIL.
unsafe fn results_list(api: &CPython, answers: Vec<Result<u64>>) -> *mut PyObject {
    // SAFETY: the GIL is held (this fn's contract); each int put in the list gives it
    // the one reference it owns (a shared one is counted once more first).
    unsafe {
        let list = (api.list_new)(answers.len() as isize);
        if list.is_null() {
            return null_mut();
        }
        let mut last: Option<(i64, *mut PyObject)> = None;
        for (i, a) in answers.into_iter().enumerate() {
            let v = answer_code(a);
            let int = match last {
                Some((seen, int)) if seen == v => {
                    (api.inc_ref)(int);
                    int
                }
                _ => {
                    let int = (api.long_from_long_long)(v);
                    if int.is_null() {
                        (api.dec_ref)(list);
                        return null_mut();
                    }
                    int
                }
            };
            last = Some((v, int));
            (api.list_set_item)(list, i as isize, int);
        }
        list
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_without_python_is_handed_no_function() {
        // This test binary exports no CPython API: nothing to call into, whatever the name.
        for name in [c"batch_get_into", c"no_such_function"] {
            // SAFETY: a NUL-terminated name.
            assert!(unsafe { mc_python_function(name.as_ptr()) }.is_null());
        }
        // SAFETY: NULL is allowed.
        assert!(unsafe { mc_python_function(std::ptr::null()) }.is_null());
    }
}
