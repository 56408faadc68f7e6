//! The fake GPU drivers (tests/emu/fake_{cuda,hip,acl}.c), built once per test
//! binary with the system C compiler and selected through the override variables.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

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
            let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("emu");
            std::fs::create_dir_all(&dir).unwrap();
            let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/emu");
            let mut built = Vec::new();
            for name in ["cuda", "hip", "acl"] {
                let out = dir.join(format!("libfake_{name}.so"));
                let status = Command::new("cc")
                    .args(["-O1", "-shared", "-fPIC", "-o"])
                    .arg(&out)
                    .arg(src.join(format!("fake_{name}.c")))
                    .status();
                match status {
                    Ok(s) if s.success() => built.push(out),
                    Ok(s) => panic!("building fake_{name}.c failed: {s}"),
                    Err(e) => {
                        eprintln!("skipping device tests: no C compiler (cc: {e})");
                        return None;
                    }
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
