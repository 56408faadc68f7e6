//! The `mooncake` command: serve a segment, run a metadata server, benchmark, report.

mod cli;
#[path = "../bench/transfer.rs"]
mod transfer_bench;

use std::process::ExitCode;

const USAGE: &str = "\
mooncake — transfer engine (Mooncake-compatible)

USAGE:
  mooncake target --metadata URL --name NAME --size BYTES [--bind IP] [--protocol P]
      Register a SIZE-byte buffer, publish it, print `ready <segment>`, serve until killed.
  mooncake metadata-server [--port P] [--bind IP]
      Run Mooncake's HTTP metadata server (REST on /metadata, /health).
  mooncake bench transfer [--protocol tcp|shm|auto] [--op read|write] [--block-size B]
      [--batch-size N] [--threads N] [--duration S] [--workers N] [--segment NAME --metadata URL]
      Measure transfers; prints one JSON object per line with a same-run baseline.
  mooncake backends
      Report which runtime-loaded hardware backends this host can load.

Sizes accept K/M/G suffixes. Logging: RUST_LOG=info|debug.";

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let result = match raw.first().map(String::as_str) {
        Some("target") => cli::target(&raw[1..]),
        Some("metadata-server") => cli::metadata_server(&raw[1..]),
        Some("bench") => match raw.get(1).map(String::as_str) {
            Some("transfer") => transfer_bench::run(&raw[2..]),
            _ => Err("usage: mooncake bench transfer [options]".to_owned()),
        },
        Some("backends") => cli::backends(),
        Some("help" | "--help" | "-h") | None => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(format!("unknown command {other:?}\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mooncake: {e}");
            ExitCode::FAILURE
        }
    }
}
