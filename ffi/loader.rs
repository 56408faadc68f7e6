//! Opening shared libraries once, with errors that say what was tried and why it failed.

use std::fmt;
use std::sync::Arc;

use libloading::Library;

use super::error::{Backend, Error};

/// Why a backend's library could not be opened.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LoadError {
    /// This binary is statically linked; `dlopen` from it is unsafe (glibc) or
    /// impossible (musl), so runtime-loaded backends are disabled.
    StaticBinary,
    /// None of the candidate names could be opened; one reason per candidate.
    NotFound {
        /// `(name, why it failed)` for each candidate tried.
        tried: Vec<(String, String)>,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::StaticBinary => f.write_str(
                "this static binary has no runtime-loaded backends (it cannot load shared \
                 libraries); use the dynamically linked build for hardware backends",
            ),
            LoadError::NotFound { tried } => {
                f.write_str("could not load ")?;
                for (i, (name, why)) in tried.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "{name} ({why})")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for LoadError {}

/// Whether this binary was linked with a static C runtime: built with crt-static, or
/// for a binary that will be (`MC_STATIC_BINARY=1` at build time, see build.rs).
pub const fn is_static_binary() -> bool {
    cfg!(any(target_feature = "crt-static", mc_static_binary))
}

/// Opens the first loadable library among `candidates`.
pub fn open_first(candidates: &[&str]) -> Result<Arc<Library>, LoadError> {
    if is_static_binary() {
        return Err(LoadError::StaticBinary);
    }
    let mut tried = Vec::new();
    for name in candidates {
        // SAFETY: loading runs the library's initializers; the candidates are system
        // driver libraries whose initializers have no preconditions on us.
        match unsafe { Library::new(*name) } {
            Ok(lib) => return Ok(Arc::new(lib)),
            Err(e) => {
                // libloading's Display says only "dlopen failed"; the source has dlerror().
                let why = std::error::Error::source(&e)
                    .map_or_else(|| format!("{e:?}"), |s| s.to_string());
                tried.push(((*name).to_owned(), why));
            }
        }
    }
    Err(LoadError::NotFound { tried })
}

/// Opens a backend's library: the path in environment variable `override_var` when
/// set (e.g. `MC_IBVERBS_LIB=/opt/rdma/lib/libibverbs.so.1`), else the first loadable
/// candidate. Returns the library and the name it was opened under.
pub fn open_backend(
    override_var: &str,
    candidates: &[&str],
) -> Result<(Arc<Library>, String), LoadError> {
    match std::env::var(override_var) {
        Ok(path) if !path.is_empty() => open_first(&[path.as_str()]).map(|l| (l, path)),
        _ => {
            if is_static_binary() {
                return Err(LoadError::StaticBinary);
            }
            let mut tried = Vec::new();
            for name in candidates {
                match open_first(&[name]) {
                    Ok(lib) => return Ok((lib, (*name).to_owned())),
                    Err(LoadError::NotFound { tried: t }) => tried.extend(t),
                    Err(e) => return Err(e),
                }
            }
            Err(LoadError::NotFound { tried })
        }
    }
}

/// Opens a backend's library: `path` when given (tests and tools), else the override
/// variable or the first loadable candidate. `hint` says what to install when nothing
/// loads.
pub fn open(
    backend: Backend,
    path: Option<&str>,
    override_var: &'static str,
    candidates: &[&str],
    hint: Option<&'static str>,
) -> Result<(Arc<Library>, String), Error> {
    let opened = match path {
        Some(p) => open_first(&[p]).map(|lib| (lib, p.to_owned())),
        None => open_backend(override_var, candidates),
    };
    opened.map_err(|error| Error::Load {
        backend,
        override_var,
        hint,
        error,
    })
}

/// A function pointer from `lib`: the first of `names` it exports (newer versioned names
/// first, e.g. `cuMemAlloc_v2`, then older ones); otherwise an error naming the library,
/// the symbol and the override variable.
///
/// # Safety
/// `T` must be the C signature of every symbol in `names`.
pub unsafe fn symbol<T: Copy>(
    lib: &Library,
    library: &str,
    names: &[&'static str],
    override_var: &'static str,
) -> Result<T, Error> {
    for name in names {
        // SAFETY: the caller guarantees `T` matches the symbol's signature.
        if let Ok(s) = unsafe { lib.get::<T>(*name) } {
            return Ok(*s);
        }
    }
    Err(Error::MissingSymbol {
        library: library.to_owned(),
        symbol: names.first().copied().unwrap_or("?"),
        override_var,
    })
}

/// What `mooncake info` shows for one backend.
#[derive(Clone, Debug)]
pub struct BackendInfo {
    /// The backend's display name.
    pub name: &'static str,
    /// The library it was loaded from, or why it could not be.
    pub library: Result<String, Error>,
    /// The version the library reports, once loaded.
    pub version: Option<String>,
    /// Devices found (HCAs with ports/GIDs, fabric providers, GPUs), one line each.
    pub devices: Vec<String>,
    /// Anything else worth saying (e.g. "no device: hipErrorNoDevice").
    pub notes: Vec<String>,
}

impl BackendInfo {
    /// A backend whose library did not load.
    pub fn unavailable(name: &'static str, why: Error) -> BackendInfo {
        BackendInfo {
            name,
            library: Err(why),
            version: None,
            devices: Vec::new(),
            notes: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_an_ordinary_error() {
        let err = open_first(&["libdefinitely-not-here.so.9"]).unwrap_err();
        let text = err.to_string();
        if is_static_binary() {
            assert_eq!(err, LoadError::StaticBinary);
        } else {
            assert!(text.contains("libdefinitely-not-here.so.9"), "{text}");
            assert!(
                text.contains("No such file") || text.contains("cannot open"),
                "{text}"
            );
        }
    }

    #[test]
    fn libc_loads() {
        if !is_static_binary() {
            assert!(open_first(&["libc.so.6"]).is_ok());
        }
    }
}
