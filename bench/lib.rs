//! `mooncake bench ...`: the benchmarks, each a module with a `run` over its flags.
//! A crate of their own above the CLI's helpers, used by the `mooncake` binary only:
//! the C ABI library never uses them (tests/layers.rs). Each prints JSON lines with a same-run baseline where one exists.

mod alloc;
mod auth;
mod chaos;
mod common;
mod disk;
mod first_touch;
mod floor;
mod master;
mod store;
mod transfer;

/// Runs `mooncake bench SUB [flags]`; `args` starts at `SUB`.
pub fn run(args: &[String]) -> Result<(), String> {
    let rest = args.get(1..).unwrap_or_default();
    match args.first().map(String::as_str) {
        Some("transfer") => transfer::run(rest),
        Some("alloc") => alloc::run(rest),
        Some("disk") => disk::run(rest),
        Some("floor") => floor::run(rest),
        Some("store") => store::run(rest),
        Some("master") => master::run(rest),
        Some("first-touch") => first_touch::run(rest),
        Some("auth") => auth::run(rest),
        Some("chaos-load") => chaos::run(rest),
        _ => Err(
            "usage: mooncake bench transfer|alloc|store|master|first-touch|auth|chaos-load [options]"
                .to_owned(),
        ),
    }
}
