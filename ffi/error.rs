//! What can go wrong in this layer: a library that does not load, a symbol it lacks, a
//! library too old, or a call that returns a failure code. Each variant names what
//! failed and keeps the native code; nothing here knows the crate's error codes (the
//! crate's `Error` converts from this one and keeps it as its `source()`).

use std::fmt;

use super::loader::LoadError;

/// The native libraries this layer loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Backend {
    /// libibverbs (RDMA verbs).
    Ibverbs,
    /// libfabric.
    Fabric,
    /// The CUDA driver API (libcuda).
    Cuda,
    /// The HIP runtime (ROCm).
    Hip,
    /// Ascend CL (Huawei NPUs).
    Acl,
}

impl Backend {
    /// The library's human-readable name, as errors and `mooncake info` print it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Ibverbs => "libibverbs",
            Backend::Fabric => "libfabric",
            Backend::Cuda => "CUDA driver",
            Backend::Hip => "HIP runtime",
            Backend::Acl => "Ascend ACL",
        }
    }
}

/// CUDA_ERROR_OUT_OF_MEMORY.
const CUDA_ERROR_OUT_OF_MEMORY: i32 = 2;
/// hipErrorOutOfMemory (hipErrorMemoryAllocation).
const HIP_ERROR_OUT_OF_MEMORY: i32 = 2;
/// CUDA_ERROR_NO_DEVICE and hipErrorNoDevice.
const GPU_ERROR_NO_DEVICE: i32 = 100;
/// ACL_ERROR_BAD_ALLOC (acl_base.h).
const ACL_ERROR_BAD_ALLOC: i32 = 200_000;
/// ACL_ERROR_RT_MEMORY_ALLOCATION (rt_error_codes.h).
const ACL_ERROR_RT_MEMORY_ALLOCATION: i32 = 207_001;
/// ACL_ERROR_RT_NO_DEVICE.
const ACL_ERROR_RT_NO_DEVICE: i32 = 207_004;

/// A native call that returned a failure code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverError {
    /// The library whose call failed.
    pub backend: Backend,
    /// The call, as its header names it (a variant in parentheses: `hipMemcpy(DtoH)`).
    pub call: &'static str,
    /// The library's own code: `CUresult`, `hipError_t`, `aclError`, a libfabric or
    /// verbs errno (sign as returned).
    pub code: i32,
    /// The library's words for the code.
    pub text: String,
}

impl DriverError {
    /// `Ok` when `succeeded`, else the error, described (only then) by `describe`.
    pub fn check(
        backend: Backend,
        call: &'static str,
        code: i32,
        succeeded: bool,
        describe: impl FnOnce() -> String,
    ) -> Result<(), Error> {
        if succeeded {
            Ok(())
        } else {
            Err(Error::Driver(DriverError {
                backend,
                call,
                code,
                text: describe(),
            }))
        }
    }

    /// Whether the call failed for want of memory (device, pinned host or kernel).
    pub fn is_out_of_memory(&self) -> bool {
        match self.backend {
            Backend::Cuda => self.code == CUDA_ERROR_OUT_OF_MEMORY,
            Backend::Hip => self.code == HIP_ERROR_OUT_OF_MEMORY,
            Backend::Acl => matches!(
                self.code,
                ACL_ERROR_BAD_ALLOC | ACL_ERROR_RT_MEMORY_ALLOCATION
            ),
            Backend::Ibverbs | Backend::Fabric => self.code.abs() == libc::ENOMEM,
        }
    }

    /// Whether the call failed because there is no device to run it on.
    pub fn is_no_device(&self) -> bool {
        match self.backend {
            Backend::Cuda | Backend::Hip => self.code == GPU_ERROR_NO_DEVICE,
            Backend::Acl => self.code == ACL_ERROR_RT_NO_DEVICE,
            Backend::Ibverbs | Backend::Fabric => self.code.abs() == libc::ENODEV,
        }
    }
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.call, self.text)
    }
}

impl std::error::Error for DriverError {}

/// An error of the native-library layer.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// The library could not be opened.
    Load {
        /// The library that failed to load.
        backend: Backend,
        /// The variable that names the library to load instead.
        override_var: &'static str,
        /// What to install, where it helps (never in a static binary).
        hint: Option<&'static str>,
        /// Why every candidate name failed.
        error: LoadError,
    },
    /// The library lacks a required entry point (wrong library, or too old).
    MissingSymbol {
        /// The name or path it was opened under.
        library: String,
        /// The entry point that is missing.
        symbol: &'static str,
        /// The environment variable that selects another library.
        override_var: &'static str,
    },
    /// The library is older than the oldest version these bindings support.
    TooOld {
        /// The name or path it was opened under.
        library: String,
        /// Which library it is.
        what: Backend,
        /// The version it reports.
        found: String,
        /// The oldest version supported.
        needed: &'static str,
        /// The environment variable that selects another library.
        override_var: &'static str,
    },
    /// The override variable names another library than the one this process loaded.
    AlreadyLoaded {
        /// Which library it is.
        what: Backend,
        /// The environment variable that was set.
        override_var: &'static str,
        /// What the variable names now.
        requested: String,
        /// What this process loaded earlier.
        loaded: String,
    },
    /// The library's initialization call failed when it was loaded (no device, no
    /// kernel driver, ...); every call needing a device reports it.
    NotInitialized {
        /// The name or path it was opened under.
        library: String,
        /// What the initialization call returned.
        error: DriverError,
    },
    /// A call returned a failure code.
    Driver(DriverError),
    /// The loaded library lacks an optional entry point an operation needs.
    Unsupported {
        /// The name or path it was opened under.
        library: String,
        /// The missing entry point and what it means.
        what: &'static str,
    },
}

impl Error {
    /// The failed call's error, where there is one.
    pub fn driver(&self) -> Option<&DriverError> {
        match self {
            Error::Driver(d) | Error::NotInitialized { error: d, .. } => Some(d),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Load {
                backend,
                error: error @ LoadError::StaticBinary,
                ..
            } => write!(f, "{} unavailable: {error}", backend.name()),
            Error::Load {
                backend,
                override_var,
                hint,
                error,
            } => {
                write!(
                    f,
                    "{} unavailable ({override_var} overrides the library): {error}",
                    backend.name()
                )?;
                match hint {
                    Some(h) => write!(f, " ({h})"),
                    None => Ok(()),
                }
            }
            Error::MissingSymbol {
                library,
                symbol,
                override_var: "",
            } => write!(f, "{library} has no symbol {symbol}"),
            Error::MissingSymbol {
                library,
                symbol,
                override_var,
            } => write!(
                f,
                "{library} has no symbol {symbol} (wrong library? point {override_var} at the right one)"
            ),
            Error::TooOld {
                library,
                what,
                found,
                needed,
                override_var,
            } => write!(
                f,
                "{library} is {} {found}; at least {needed} is needed (point {override_var} at a newer one)",
                what.name()
            ),
            Error::AlreadyLoaded {
                what,
                override_var,
                requested,
                loaded,
            } => write!(
                f,
                "{override_var}={requested}, but this process already loaded {} from {loaded}",
                what.name()
            ),
            Error::NotInitialized { library, error } => {
                write!(f, "{} failed in {library}: {}", error.call, error.text)
            }
            Error::Driver(d) => d.fmt(f),
            Error::Unsupported { library, what } => write!(f, "{library} has no {what}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Load { error, .. } => Some(error),
            Error::NotInitialized { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// Results of the native-library layer.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    fn call(backend: Backend, code: i32) -> DriverError {
        DriverError {
            backend,
            call: "x",
            code,
            text: String::new(),
        }
    }

    #[test]
    fn out_of_memory_is_recognized_per_library() {
        assert!(call(Backend::Cuda, 2).is_out_of_memory());
        assert!(call(Backend::Hip, 2).is_out_of_memory());
        assert!(call(Backend::Acl, 207_001).is_out_of_memory());
        assert!(call(Backend::Fabric, -libc::ENOMEM).is_out_of_memory());
        assert!(!call(Backend::Cuda, 1).is_out_of_memory());
        assert!(call(Backend::Cuda, 100).is_no_device());
    }

    #[test]
    fn messages_name_the_call_and_the_override() {
        let e = Error::Driver(DriverError {
            backend: Backend::Cuda,
            call: "cuMemAlloc_v2",
            code: 2,
            text: "out of memory (CUresult 2)".into(),
        });
        assert_eq!(e.to_string(), "cuMemAlloc_v2: out of memory (CUresult 2)");
        let e = Error::MissingSymbol {
            library: "libx.so".into(),
            symbol: "cuInit",
            override_var: "MC_CUDA_LIB",
        };
        assert!(e.to_string().contains("cuInit") && e.to_string().contains("MC_CUDA_LIB"));
        let e = Error::Load {
            backend: Backend::Ibverbs,
            override_var: "MC_IBVERBS_LIB",
            hint: Some("install rdma-core"),
            error: LoadError::NotFound {
                tried: vec![("libibverbs.so.1".into(), "missing".into())],
            },
        };
        let text = e.to_string();
        assert!(text.contains("MC_IBVERBS_LIB") && text.ends_with("(install rdma-core)"));
        assert!(std::error::Error::source(&e).is_some());
        // No hint where none can help: a static binary loads no library at all.
        let e = Error::Load {
            backend: Backend::Ibverbs,
            override_var: "MC_IBVERBS_LIB",
            hint: Some("install rdma-core"),
            error: LoadError::StaticBinary,
        };
        assert!(!e.to_string().contains("MC_IBVERBS_LIB"), "{e}");
        assert!(e.to_string().contains("no runtime-loaded backends"), "{e}");
    }
}
