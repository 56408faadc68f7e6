//! One error type for the whole crate. Each variant maps to exactly one C ABI code
//! (`c_include/mooncake.h`, `enum mc_error`), so the Rust and C views never drift apart.

#![forbid(unsafe_code)]

use std::fmt;
use std::io;

use crate::ffi::error as ffi;

/// Error codes shared with the C ABI. Values that also exist in Mooncake Store's
/// error space keep the same number (see `docs/store.md`); engine-only
/// codes live in the otherwise unused -1200 range. Exhaustive on purpose: the C
/// mappings above this crate match every code, so a new one cannot be left unmapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Code {
    /// An unexpected internal failure (a bug, or a panic caught at the ABI).
    Internal = -1,
    /// The caller's buffer is too small for the result.
    BufferOverflow = -10,
    /// No such segment.
    SegmentNotFound = -101,
    /// A segment with that name is already mounted.
    SegmentAlreadyExists = -102,
    /// The master does not know this client.
    ClientNotFound = -103,
    /// No free handle is left.
    NoAvailableHandle = -200,
    /// Version mismatch.
    InvalidVersion = -300,
    /// The key is empty or otherwise unusable.
    InvalidKey = -400,
    /// A write failed.
    WriteFail = -500,
    /// An argument is invalid.
    InvalidParams = -600,
    /// The client is not allowed to do this.
    IllegalClient = -601,
    /// The write is not allowed in the object's current state.
    InvalidWrite = -700,
    /// The read is not allowed in the object's current state.
    InvalidRead = -701,
    /// The replica is unusable.
    InvalidReplica = -702,
    /// The object is still being written.
    ReplicaIsNotReady = -703,
    /// No such object.
    ObjectNotFound = -704,
    /// The object already exists.
    ObjectAlreadyExists = -705,
    /// The object is leased to a reader and cannot be removed now.
    ObjectHasLease = -706,
    /// The object's lease expired while it was being read.
    LeaseExpired = -707,
    /// Moving the bytes failed.
    TransferFail = -800,
    /// The bytes read do not match the stored checksum.
    ChecksumMismatch = -801,
    /// An RPC failed.
    RpcFail = -900,
    /// An RPC got no answer in time.
    RpcTimeout = -901,
    /// The etcd metadata backend failed.
    EtcdOperationError = -1000,
    /// Not possible in the current state.
    UnavailableInCurrentStatus = -1010,
    /// Not supported by this build or configuration.
    NotSupported = -1012,
    /// No such file.
    FileNotFound = -1100,
    /// A file could not be opened.
    FileOpenFail = -1101,
    /// Reading a file failed.
    FileReadFail = -1102,
    /// Writing a file failed.
    FileWriteFail = -1103,
    /// The range overlaps memory already registered.
    AddressOverlap = -1201,
    /// An address is not inside registered memory.
    AddressNotRegistered = -1202,
    /// No such batch.
    BatchNotFound = -1203,
    /// The batch still has unfinished tasks.
    BatchBusy = -1204,
    /// The batch has no room for more tasks.
    BatchFull = -1205,
    /// Time ran out.
    Timeout = -1206,
    /// The metadata store failed or holds something unusable.
    Metadata = -1207,
    /// A peer sent something that breaks the wire protocol.
    Protocol = -1208,
    /// A runtime-loaded library (verbs, libfabric, a GPU runtime) is unavailable.
    BackendUnavailable = -1209,
    /// An operating-system I/O error.
    Io = -1210,
}

impl Code {
    /// Every code, for tables and tests.
    pub const ALL: [Code; 40] = [
        Code::Internal,
        Code::BufferOverflow,
        Code::SegmentNotFound,
        Code::SegmentAlreadyExists,
        Code::ClientNotFound,
        Code::NoAvailableHandle,
        Code::InvalidVersion,
        Code::InvalidKey,
        Code::WriteFail,
        Code::InvalidParams,
        Code::IllegalClient,
        Code::InvalidWrite,
        Code::InvalidRead,
        Code::InvalidReplica,
        Code::ReplicaIsNotReady,
        Code::ObjectNotFound,
        Code::ObjectAlreadyExists,
        Code::ObjectHasLease,
        Code::LeaseExpired,
        Code::TransferFail,
        Code::ChecksumMismatch,
        Code::RpcFail,
        Code::RpcTimeout,
        Code::EtcdOperationError,
        Code::UnavailableInCurrentStatus,
        Code::NotSupported,
        Code::FileNotFound,
        Code::FileOpenFail,
        Code::FileReadFail,
        Code::FileWriteFail,
        Code::AddressOverlap,
        Code::AddressNotRegistered,
        Code::BatchNotFound,
        Code::BatchBusy,
        Code::BatchFull,
        Code::Timeout,
        Code::Metadata,
        Code::Protocol,
        Code::BackendUnavailable,
        Code::Io,
    ];

    /// The code with this number, if there is one.
    pub fn from_i32(v: i32) -> Option<Code> {
        Code::ALL.iter().copied().find(|c| *c as i32 == v)
    }

    /// Short, stable description (also what `mc_error_string` returns).
    pub fn describe(self) -> &'static str {
        match self {
            Code::Internal => "internal error",
            Code::BufferOverflow => "output buffer too small",
            Code::SegmentNotFound => "segment not found",
            Code::InvalidParams => "invalid parameters",
            Code::TransferFail => "transfer failed",
            Code::RpcFail => "rpc failed",
            Code::RpcTimeout => "rpc timed out",
            Code::NotSupported => "not supported",
            Code::AddressOverlap => "address range overlaps a registered buffer",
            Code::AddressNotRegistered => "address range is not inside one registered buffer",
            Code::BatchNotFound => "batch not found",
            Code::BatchBusy => "batch has unfinished tasks",
            Code::BatchFull => "batch capacity exceeded",
            Code::Timeout => "timed out",
            Code::Metadata => "metadata service error",
            Code::Protocol => "protocol error",
            Code::BackendUnavailable => "backend unavailable",
            Code::SegmentAlreadyExists => "segment already exists",
            Code::ClientNotFound => "client not found",
            Code::NoAvailableHandle => "no space available",
            Code::InvalidVersion => "invalid version",
            Code::InvalidKey => "invalid key",
            Code::WriteFail => "write failed",
            Code::IllegalClient => "illegal client",
            Code::InvalidWrite => "invalid write",
            Code::InvalidRead => "invalid read",
            Code::InvalidReplica => "invalid replica",
            Code::ReplicaIsNotReady => "replica is not ready",
            Code::ObjectNotFound => "object not found",
            Code::ObjectAlreadyExists => "object already exists",
            Code::ObjectHasLease => "object has a lease",
            Code::LeaseExpired => "lease expired",
            Code::ChecksumMismatch => "checksum mismatch",
            Code::EtcdOperationError => "etcd operation failed",
            Code::UnavailableInCurrentStatus => "unavailable in current status",
            Code::FileNotFound => "file not found",
            Code::FileOpenFail => "file open failed",
            Code::FileReadFail => "file read failed",
            Code::FileWriteFail => "file write failed",
            Code::Io => "i/o error",
        }
    }
}

/// A crate error: a code plus a human-readable context saying what failed and why,
/// and, for a failure of a native library, that library's own error as the `source()`.
#[derive(Clone, Debug)]
pub struct Error {
    code: Code,
    context: String,
    source: Option<Box<ffi::Error>>,
}

/// Results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error with `code` and a message saying what failed.
    pub fn new(code: Code, context: impl Into<String>) -> Error {
        Error {
            code,
            context: context.into(),
            source: None,
        }
    }

    /// The native library's error this one came from, if any (also `source()`).
    pub fn ffi(&self) -> Option<&ffi::Error> {
        self.source.as_deref()
    }

    /// A native library's failure while setting something up (opening, registering,
    /// connecting): out of memory stays `NoAvailableHandle`, and a failed call is
    /// `BackendUnavailable` rather than `TransferFail`.
    pub fn backend(e: ffi::Error) -> Error {
        let mut err = Error::from(e);
        if err.code == Code::TransferFail {
            err.code = Code::BackendUnavailable;
        }
        err
    }

    /// This error with `what` put in front of its context; the code and the source stay.
    pub fn prefixed(mut self, what: impl fmt::Display) -> Error {
        self.context = if self.context.is_empty() {
            what.to_string()
        } else {
            format!("{what}: {}", self.context)
        };
        self
    }

    /// The error's code.
    pub fn code(&self) -> Code {
        self.code
    }

    /// What failed, in words.
    pub fn context(&self) -> &str {
        &self.context
    }

    /// Wraps an I/O error with what we were doing when it happened.
    pub fn io(what: impl fmt::Display, err: io::Error) -> Error {
        let code = match err.kind() {
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => Code::Timeout,
            _ => Code::Io,
        };
        Error::new(code, format!("{what}: {err}"))
    }

    /// An [`Code::InvalidParams`] error.
    pub fn invalid(context: impl Into<String>) -> Error {
        Error::new(Code::InvalidParams, context)
    }

    /// A [`Code::Protocol`] error: a peer broke the wire format.
    pub fn protocol(context: impl Into<String>) -> Error {
        Error::new(Code::Protocol, context)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.context.is_empty() {
            f.write_str(self.code.describe())
        } else {
            write!(f, "{}: {}", self.code.describe(), self.context)
        }
    }
}

/// Errors compare by code and context (the source only details the context).
impl PartialEq for Error {
    fn eq(&self, other: &Error) -> bool {
        self.code == other.code && self.context == other.context
    }
}

impl Eq for Error {}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// A native library's failure as a crate error. A library that cannot be used at all
/// (not loadable, wrong, too old, not initialized) is `BackendUnavailable`; a call that
/// ran out of memory is `NoAvailableHandle` (no space, not a transfer failure); a call
/// that found no device is `BackendUnavailable`; any other failed call is `TransferFail`.
impl From<ffi::Error> for Error {
    fn from(e: ffi::Error) -> Error {
        let code = match &e {
            ffi::Error::Driver(d) if d.is_out_of_memory() => Code::NoAvailableHandle,
            ffi::Error::Driver(d) if d.is_no_device() => Code::BackendUnavailable,
            ffi::Error::Driver(_) => Code::TransferFail,
            ffi::Error::Unsupported { .. } => Code::NotSupported,
            _ => Code::BackendUnavailable,
        };
        Error {
            code,
            context: e.to_string(),
            source: Some(Box::new(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    fn driver(backend: ffi::Backend, code: i32) -> ffi::Error {
        ffi::Error::Driver(ffi::DriverError {
            backend,
            call: "cuMemAlloc_v2",
            code,
            text: format!("text (code {code})"),
        })
    }

    #[test]
    fn native_failures_map_to_codes_and_stay_the_source() {
        let oom = Error::from(driver(ffi::Backend::Cuda, 2));
        assert_eq!(oom.code(), Code::NoAvailableHandle);
        assert_eq!(oom.context(), "cuMemAlloc_v2: text (code 2)");
        let source = oom.source().expect("the ffi error is the source");
        assert_eq!(source.to_string(), oom.context());
        assert!(matches!(oom.ffi(), Some(ffi::Error::Driver(d)) if d.code == 2));

        assert_eq!(
            Error::from(driver(ffi::Backend::Cuda, 1)).code(),
            Code::TransferFail
        );
        assert_eq!(
            Error::backend(driver(ffi::Backend::Fabric, -libc::EINVAL)).code(),
            Code::BackendUnavailable
        );
        assert_eq!(
            Error::backend(driver(ffi::Backend::Fabric, -libc::ENOMEM)).code(),
            Code::NoAvailableHandle
        );
        let missing = Error::from(ffi::Error::MissingSymbol {
            library: "libx.so".into(),
            symbol: "cuInit",
            override_var: "MC_CUDA_LIB",
        });
        assert_eq!(missing.code(), Code::BackendUnavailable);
        let unsupported = Error::from(ffi::Error::Unsupported {
            library: "libcuda.so.1".into(),
            what: "cuMemGetHandleForAddressRange",
        });
        assert_eq!(unsupported.code(), Code::NotSupported);
    }

    #[test]
    fn prefixing_keeps_code_and_source() {
        let e = Error::from(driver(ffi::Backend::Hip, 2)).prefixed("staging");
        assert_eq!(e.code(), Code::NoAvailableHandle);
        assert!(e.context().starts_with("staging: cuMemAlloc_v2"));
        assert!(e.source().is_some());
        assert_eq!(Error::invalid("x").source().map(|s| s.to_string()), None);
    }
}
