//! Build script: AVX-512 intrinsics (CRC32C folding, `src/util/crc32c.rs`) are stable
//! from Rust 1.89; older toolchains (the MSRV is lower) build without that path.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-check-cfg=cfg(mc_avx512_intrinsics)");
    if rustc_minor().is_some_and(|minor| minor >= 89) {
        println!("cargo:rustc-cfg=mc_avx512_intrinsics");
    }
}

/// The minor version of the compiler building this crate (`rustc 1.MINOR.x`).
fn rustc_minor() -> Option<u32> {
    let rustc = std::env::var_os("RUSTC")?;
    let out = std::process::Command::new(rustc)
        .arg("--version")
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let version = text.split_whitespace().nth(1)?;
    version.split('.').nth(1)?.parse().ok()
}
