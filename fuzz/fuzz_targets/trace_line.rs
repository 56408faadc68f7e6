//! Trace lines as `mooncake replay` reads them (the CLI crate's own parser):
//! whatever parses has a non-negative timestamp and unsigned hash ids, and prints back
//! to a line that parses to the same request.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake::json::Value;
use mooncake_cli::trace;

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(req) = trace::parse_line(line) else {
        return;
    };
    assert!(req.timestamp_ms >= 0.0);
    let printed = Value::object([
        ("timestamp", Value::from(req.timestamp_ms)),
        ("input_length", Value::from(req.input_length)),
        (
            "hash_ids",
            Value::Array(req.hash_ids.iter().map(|&h| Value::from(h)).collect()),
        ),
    ])
    .to_string();
    assert_eq!(trace::parse_line(&printed).as_ref(), Ok(&req), "{printed}");
});
