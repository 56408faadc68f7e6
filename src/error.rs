//! One error type for the whole crate. Each variant maps to exactly one C ABI code
//! (`c_include/mooncake.h`, `enum mc_error`), so the Rust and C views never drift apart.

use std::fmt;
use std::io;

use crate::ffi::error as ffi;

/// Error codes shared with the C ABI. Values that also exist in Mooncake Store's
/// error space keep the same number (see `docs/store.md`); engine-only
/// codes live in the otherwise unused -1200 range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
#[non_exhaustive]
pub enum Code {
    Internal = -1,
    BufferOverflow = -10,
    SegmentNotFound = -101,
    SegmentAlreadyExists = -102,
    ClientNotFound = -103,
    NoAvailableHandle = -200,
    InvalidVersion = -300,
    InvalidKey = -400,
    WriteFail = -500,
    InvalidParams = -600,
    IllegalClient = -601,
    InvalidWrite = -700,
    InvalidRead = -701,
    InvalidReplica = -702,
    ReplicaIsNotReady = -703,
    ObjectNotFound = -704,
    ObjectAlreadyExists = -705,
    ObjectHasLease = -706,
    LeaseExpired = -707,
    TransferFail = -800,
    ChecksumMismatch = -801,
    RpcFail = -900,
    RpcTimeout = -901,
    EtcdOperationError = -1000,
    UnavailableInCurrentStatus = -1010,
    NotSupported = -1012,
    FileNotFound = -1100,
    FileOpenFail = -1101,
    FileReadFail = -1102,
    FileWriteFail = -1103,
    AddressOverlap = -1201,
    AddressNotRegistered = -1202,
    BatchNotFound = -1203,
    BatchBusy = -1204,
    BatchFull = -1205,
    Timeout = -1206,
    Metadata = -1207,
    Protocol = -1208,
    BackendUnavailable = -1209,
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

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
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

    pub fn code(&self) -> Code {
        self.code
    }

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

    pub fn invalid(context: impl Into<String>) -> Error {
        Error::new(Code::InvalidParams, context)
    }

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
