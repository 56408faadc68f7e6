//! Build script: marks a static build (`MC_STATIC_BINARY=1`, set by scripts/test.sh
//! when it links the `mooncake` binary with a static C runtime), in which the
//! runtime-loaded backends must stay off: there is no dynamic loader to open them.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=MC_STATIC_BINARY");
    println!("cargo:rustc-check-cfg=cfg(mc_static_binary)");
    if std::env::var("MC_STATIC_BINARY").as_deref() == Ok("1") {
        println!("cargo:rustc-cfg=mc_static_binary");
    }
}
