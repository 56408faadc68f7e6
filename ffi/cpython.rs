//! CPython's C API, for the Python package's calls that ctypes makes too slow: looked
//! up in the running process (the interpreter that loaded this library), never linked
//! against, so the library loads in any process and only a Python one binds it.
//!
//! Only functions every CPython from 3.8 exports (all in the limited API from 3.10),
//! and no layout that differs between builds: objects are opaque pointers,
//! `PyMethodDef` is four words in every build. The Python package does not ask for
//! these calls on a free-threaded interpreter, whose lists hand out references
//! another thread may drop.
//!
//! There is no guard that takes the GIL back when dropped: on CPython 3.8 to 3.13,
//! `PyEval_RestoreThread` during the interpreter's shutdown ends a daemon thread with
//! a forced unwind, which may only cross frames with nothing to drop. A caller gives
//! the GIL up and takes it back in one frame that holds no value with a destructor.

use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, OnceLock};

use super::error::Result;
use super::table::function_table;

/// An object of the interpreter; opaque.
#[repr(C)]
pub struct PyObject {
    _opaque: [u8; 0],
}

/// `PyCFunction` as `METH_FASTCALL` calls it: `self`, the positional arguments, their
/// count.
/// ("C-unwind": the GIL taken back inside may end the thread with a forced unwind.)
pub type FastCall =
    unsafe extern "C-unwind" fn(*mut PyObject, *const *mut PyObject, isize) -> *mut PyObject;

/// `PyMethodDef`: a built-in function's name, entry point, calling convention and
/// docstring.
#[repr(C)]
pub struct PyMethodDef {
    /// The function's name, NUL-terminated.
    pub ml_name: *const c_char,
    /// Its entry point (cast to `PyCFunction` by the interpreter, as `ml_flags` says).
    pub ml_meth: Option<FastCall>,
    /// The calling convention (`METH_FASTCALL`).
    pub ml_flags: c_int,
    /// Its docstring, NUL-terminated, or NULL.
    pub ml_doc: *const c_char,
}

// SAFETY: a definition is written once (static) and only read after, by the
// interpreter, under its lock.
unsafe impl Sync for PyMethodDef {}

/// `METH_FASTCALL`: arguments as an array, no tuple built per call.
pub const METH_FASTCALL: c_int = 0x0080;

/// `PyThreadState *`, as `PyEval_SaveThread` hands it out and takes it back.
pub type ThreadState = *mut c_void;

function_table! {
    /// The interpreter's entry points this library calls.
    pub struct CPython (override "") {
        state {}
        symbols {
            /// `PyList_New`: a new list of `n` empty places, each to be set once.
            pub list_new: required ["PyList_New"] unsafe extern "C" fn(isize) -> *mut PyObject,
            /// `PyList_Size`: the length, or -1 (an error set) for a non-list.
            pub list_size: required ["PyList_Size"] unsafe extern "C" fn(*mut PyObject) -> isize,
            /// `PyList_GetItem`: a borrowed reference, or NULL (an error set) past the end
            /// or for a non-list.
            pub list_get_item: required ["PyList_GetItem"]
                unsafe extern "C" fn(*mut PyObject, isize) -> *mut PyObject,
            /// `PyList_SetItem`: steals the item's reference.
            pub list_set_item: required ["PyList_SetItem"]
                unsafe extern "C" fn(*mut PyObject, isize, *mut PyObject) -> c_int,
            /// `PyUnicode_AsUTF8AndSize`: the str's UTF-8, cached in the object (valid while it lives); NULL with an
            /// error set for another type or a string UTF-8 cannot encode.
            pub unicode_as_utf8_and_size: required ["PyUnicode_AsUTF8AndSize"]
                unsafe extern "C" fn(*mut PyObject, *mut isize) -> *const c_char,
            /// `PyLong_AsUnsignedLongLong`: an int's value; `u64::MAX` with an error set for a negative, too large or
            /// non-int object (no `__index__` is called).
            pub long_as_unsigned_long_long: required ["PyLong_AsUnsignedLongLong"]
                unsafe extern "C" fn(*mut PyObject) -> u64,
            /// `PyLong_FromLongLong`: a new int.
            pub long_from_long_long: required ["PyLong_FromLongLong"]
                unsafe extern "C" fn(i64) -> *mut PyObject,
            /// `PyErr_Occurred`: the error set, borrowed, or NULL.
            pub err_occurred: required ["PyErr_Occurred"] unsafe extern "C" fn() -> *mut PyObject,
            /// `PyErr_Clear`.
            pub err_clear: required ["PyErr_Clear"] unsafe extern "C" fn(),
            /// `PyErr_SetString`: raises the type with a message.
            pub err_set_string: required ["PyErr_SetString"]
                unsafe extern "C" fn(*mut PyObject, *const c_char),
            /// `Py_IncRef`.
            pub inc_ref: required ["Py_IncRef"] unsafe extern "C" fn(*mut PyObject),
            /// `Py_DecRef`.
            pub dec_ref: required ["Py_DecRef"] unsafe extern "C" fn(*mut PyObject),
            /// `PyEval_SaveThread`: gives the GIL up.
            pub save_thread: required ["PyEval_SaveThread"] unsafe extern "C" fn() -> ThreadState,
            /// `PyEval_RestoreThread`: takes the GIL back (or, during shutdown, ends a
            /// daemon thread with a forced unwind).
            pub restore_thread: required ["PyEval_RestoreThread"]
                unsafe extern "C-unwind" fn(ThreadState),
            /// The address of `None` (a data symbol, not a function).
            pub none: required ["_Py_NoneStruct"] *mut PyObject,
            /// The address of the variable holding `TypeError` (a data symbol).
            pub type_error: required ["PyExc_TypeError"] *mut *mut PyObject,
        }
    }
}

// SAFETY: besides function pointers, the table holds the addresses of two of the
// interpreter's statics, which live as long as the process and are only read with
// the GIL held.
unsafe impl Send for CPython {}
// SAFETY: as for `Send`; nothing in the table is written after it is bound.
unsafe impl Sync for CPython {}

static API: OnceLock<Result<CPython>> = OnceLock::new();

/// The interpreter's table, bound on first use from the symbols the process exports
/// (a Python executable's own, or its libpython's); an error in a process without them.
pub fn api() -> std::result::Result<&'static CPython, &'static super::error::Error> {
    API.get_or_init(bind).as_ref()
}

fn bind() -> Result<CPython> {
    let this: libloading::Library = libloading::os::unix::Library::this().into();
    CPython::bind(Arc::new(this), "the running process".to_owned())
}

impl CPython {
    /// A new reference to `None`.
    pub fn new_none(&self) -> *mut PyObject {
        // SAFETY: `none` is the interpreter's `None`, which lives as long as it does;
        // the caller holds the GIL, as every use of this table requires.
        unsafe { (self.inc_ref)(self.none) };
        self.none
    }

    /// Raises `TypeError` with `message`; NULL, for the caller to return.
    pub fn raise_type_error(&self, message: &std::ffi::CStr) -> *mut PyObject {
        // SAFETY: `type_error` is the address of the interpreter's `PyExc_TypeError`,
        // set at its start; the caller holds the GIL.
        unsafe { (self.err_set_string)(*self.type_error, message.as_ptr()) };
        std::ptr::null_mut()
    }

    /// Drops whatever error a failed conversion set (the caller answers otherwise).
    pub fn clear_error(&self) {
        // SAFETY: the caller holds the GIL.
        unsafe { (self.err_clear)() };
    }
}
