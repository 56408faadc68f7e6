//! The `mooncake` command: serve a segment, run a metadata server, benchmark, report.
//! The commands live in `mooncake-cli`, the benchmarks in `mooncake-bench` (`bench/`).

use std::process::ExitCode;

use mooncake_cli as cli;
use mooncake_cli::usage::{usage, usage_of, wants_help, with_hint};

fn main() -> ExitCode {
    let mut raw: Vec<String> = std::env::args().skip(1).collect();
    if raw.first().map(String::as_str) == Some("master") {
        match cli::master_flags::with_flagfiles_expanded(&raw[1..]) {
            Ok(expanded) => raw.splice(1.., expanded).for_each(drop),
            Err(e) => {
                eprintln!("mooncake: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    cli::init_logging(&raw);
    if raw.len() > 1 && !raw[0].starts_with('-') && wants_help(&raw[1..]) {
        return match usage_of(&raw) {
            Some(text) => {
                println!("{text}");
                ExitCode::SUCCESS
            }
            None => {
                eprintln!("mooncake: unknown command {:?}\n\n{}", raw[0], usage());
                ExitCode::FAILURE
            }
        };
    }
    // Commands that only print end quietly when their reader goes.
    let prints_only = matches!(
        raw.first().map(String::as_str),
        Some("info" | "backends" | "simulate" | "calc" | "help" | "version" | "--version")
            | Some("-V" | "--help" | "-h")
            | None
    );
    if prints_only {
        cli::end_quietly_on_closed_stdout();
    }
    let result = match raw.first().map(String::as_str) {
        Some("target") => cli::target(&raw[1..]),
        Some("metadata-server") => cli::metadata_server(&raw[1..]),
        Some("bench") => mooncake_bench::run(&raw[1..]),
        Some("info" | "backends") => cli::info(&raw[1..]),
        Some("master") => cli::store::master(&raw[1..]),
        Some("node") => cli::store::node(&raw[1..]),
        Some("demo") => cli::replay::demo(&raw[1..]),
        Some("replay") => cli::replay::replay(&raw[1..]),
        Some("simulate") => cli::simulate::simulate(&raw[1..]),
        Some("calc") => cli::calc::calc(&raw[1..]),
        Some("--version" | "-V" | "version") => {
            println!("mooncake {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Some("help") => {
            match usage_of(&raw[1..]) {
                Some(text) => println!("{text}"),
                None => println!("{}", usage()),
            }
            Ok(())
        }
        Some("--help" | "-h") | None => {
            println!("{}", usage());
            Ok(())
        }
        Some(other) => Err(format!("unknown command {other:?}\n\n{}", usage())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mooncake: {}", with_hint(e, &raw));
            ExitCode::FAILURE
        }
    }
}
