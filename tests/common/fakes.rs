//! The fake GPU drivers (tests/emu/fake_{cuda,hip,acl}.c), built by `cprog::build`
//! and selected through the override variables.

use std::path::PathBuf;
use std::sync::OnceLock;

use super::cprog::{build, have, Output};

pub struct Fakes {
    pub cuda: PathBuf,
    pub hip: PathBuf,
    pub acl: PathBuf,
}

/// Builds the fakes once and points the override variables at them, before any test
/// touches a driver table (they load once per process).
pub fn fakes() -> Option<&'static Fakes> {
    static FAKES: OnceLock<Option<Fakes>> = OnceLock::new();
    FAKES
        .get_or_init(|| {
            if !have("cc") {
                eprintln!("skipping device tests: no C compiler (cc)");
                return None;
            }
            let mut built = Vec::new();
            for name in ["cuda", "hip", "acl"] {
                let source = format!("emu/fake_{name}.c");
                let so = format!("libfake_{name}.so");
                match build("cc", &source, &so, &["-O1"], Output::SharedObject) {
                    Ok(path) => built.push(path),
                    Err(e) => panic!("{e}"),
                }
            }
            std::env::set_var("MC_CUDA_LIB", &built[0]);
            std::env::set_var("MC_HIP_LIB", &built[1]);
            std::env::set_var("MC_ACL_LIB", &built[2]);
            Some(Fakes {
                cuda: built[0].clone(),
                hip: built[1].clone(),
                acl: built[2].clone(),
            })
        })
        .as_ref()
}

/// A counter exported by a fake (how many driver copies it made).
pub fn counter(lib: &PathBuf, name: &str) -> u64 {
    // SAFETY: the fake is already loaded (same path, same handle); the counter takes
    // no arguments and returns an unsigned long.
    unsafe {
        let lib = libloading::Library::new(lib).unwrap();
        let f: libloading::Symbol<unsafe extern "C" fn() -> std::ffi::c_ulong> =
            lib.get(name).unwrap();
        f()
    }
}
