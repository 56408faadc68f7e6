//! The `mooncake` command: serve a segment, run a metadata server, benchmark, report.

#[path = "../bench/alloc.rs"]
mod alloc_bench;
#[path = "../bench/common.rs"]
mod bench_common;
mod cli;
#[path = "../bench/master.rs"]
mod master_bench;
#[path = "../bench/store.rs"]
mod store_bench;
#[path = "../bench/transfer.rs"]
mod transfer_bench;

use std::process::ExitCode;

const USAGE: &str = "\
mooncake — transfer engine (Mooncake-compatible)

USAGE:
  mooncake target --metadata URL --name NAME --size BYTES [--location cpu:0|cuda:N|hip:N|npu:N]
      [--bind IP] [--protocol P]
      Allocate and register a SIZE-byte buffer (host memory, or device memory from the
      location's driver), publish it, print `ready <segment>`, serve until killed.
  mooncake metadata-server [--port P] [--bind IP]
      Run Mooncake's HTTP metadata server (REST on /metadata, /health).
  mooncake bench transfer [--protocol tcp|shm|auto|rdma|efa] [--fabric-provider P] [--op read|write] [--block-size B]
      [--batch-size N] [--threads N] [--duration S] [--workers N] [--segment NAME --metadata URL]
      Measure transfers; prints one JSON object per line with a same-run baseline.
  mooncake bench store [--op get|put|exists] [--size 4K] [--batch N] [--threads N]
      [--duration S] [--api zero-copy|copy] [--protocol tcp|auto] [--verify-checksum B]
      [--no-verify] [--segment-size B] [--master HOST:PORT --metadata URL]
      Store objects/s and latency against a master and node in child processes.
  mooncake bench master [--threads 1,2] [--duration S] [--keys K] [--batch N]
      Metadata requests/s of an in-process master (put, get_replicas, exists, mix).
  mooncake info
      Every transport backend: loaded or not and why, library and version, devices found.
  mooncake master [--rpc-port 50051] [--metadata-port 8080|off] [--metrics-port 9003|off]
      [--lease-ttl-ms 10000] [--eviction-high-watermark 0.9] [--eviction-ratio 0.05]
      [--client-ttl 10] [--allocation-strategy random|free_ratio_first|local_first]
      The store's control plane (Mooncake's mooncake_master flag names are accepted too).
  mooncake node --master HOST:PORT --segment-size BYTES [--metadata URL] [--name HOST:PORT]
      Lend SIZE bytes of this machine's memory to the store pool.
  mooncake demo [--trace FILE] [--requests N] [--block-bytes 64K] [--pool-size 3G]
      [--time-scale X] [--replicas 1] [--protocol tcp] [--json]
      Start a master, two store nodes and a client in this process and replay the
      conversation trace through the store (prefix reads, writes, eviction); print a summary.
  mooncake replay --master HOST:PORT [--metadata URL] [same options as demo, less --pool-size]
      The same replay, as a pure client of a running cluster.

Sizes accept K/M/G suffixes. Logging: RUST_LOG=info|debug.";

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let result = match raw.first().map(String::as_str) {
        Some("target") => cli::target(&raw[1..]),
        Some("metadata-server") => cli::metadata_server(&raw[1..]),
        Some("bench") => match raw.get(1).map(String::as_str) {
            Some("transfer") => transfer_bench::run(&raw[2..]),
            Some("alloc") => alloc_bench::run(&raw[2..]),
            Some("store") => store_bench::run(&raw[2..]),
            Some("master") => master_bench::run(&raw[2..]),
            _ => Err("usage: mooncake bench transfer|alloc|store|master [options]".to_owned()),
        },
        Some("info" | "backends") => cli::info(),
        Some("master") => cli::store::master(&raw[1..]),
        Some("node") => cli::store::node(&raw[1..]),
        Some("demo") => cli::replay::demo(&raw[1..]),
        Some("replay") => cli::replay::replay(&raw[1..]),
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
