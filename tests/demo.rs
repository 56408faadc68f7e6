//! `mooncake demo`: replays the shipped conversation trace through an embedded cluster.

use std::process::{Command, Output};

use mooncake::json::{self, Value};

fn demo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mooncake"))
        .arg("demo")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("running mooncake demo")
}

/// Runs the demo with `--json`, insists on success and one JSON object on stdout.
fn demo_json(args: &[&str]) -> Value {
    let out = demo(&[args, &["--json"]].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "demo failed: {:?}\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    assert_eq!(
        stdout.trim().lines().count(),
        1,
        "expected one line of JSON, got: {stdout}"
    );
    json::parse(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

fn num(v: &Value, key: &str) -> f64 {
    v.get(key)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("field {key} missing in {v}"))
}

const FIELDS: &[&str] = &[
    "requests",
    "hit_rate",
    "hit_rate_last_half",
    "capacity_blocks",
    "errors",
    "seconds",
    "objects_written",
    "bytes_written",
    "bytes_read",
    "evictions",
    "gbps",
    "get_p50_us",
    "get_p99_us",
    "put_p50_us",
    "put_p99_us",
    "exists_total_us",
    "get_total_us",
    "put_total_us",
    "block_bytes",
    "pool_bytes",
    "idle_fraction",
    "real_model_equivalent_gib",
];

#[test]
fn demo_replays_a_trace_prefix_with_prefix_hits() {
    let v = demo_json(&[
        "--requests",
        "300",
        "--pool-size",
        "64M",
        "--block-bytes",
        "16K",
    ]);
    for f in FIELDS {
        num(&v, f);
    }
    // A total sums every sample: never below the slowest one.
    assert!(num(&v, "put_total_us") >= num(&v, "put_p99_us"), "{v}");
    assert!(num(&v, "get_total_us") >= num(&v, "get_p99_us"), "{v}");
    assert_eq!(num(&v, "errors"), 0.0, "{v}");
    assert_eq!(num(&v, "requests"), 300.0, "{v}");
    let hit = num(&v, "hit_rate");
    assert!(hit > 0.0 && hit <= 1.0, "hit rate {hit}: {v}");
    assert_eq!(num(&v, "block_bytes"), 16384.0);
    assert_eq!(num(&v, "pool_bytes"), (64u64 << 20) as f64);
    assert_eq!(num(&v, "capacity_blocks"), 4096.0);
    // Every block object is written at most once and whole.
    assert_eq!(
        num(&v, "bytes_written"),
        num(&v, "objects_written") * 16384.0
    );
    assert!(num(&v, "bytes_read") > 0.0, "{v}");
    assert_eq!(num(&v, "real_model_equivalent_gib"), 4096.0 / 16.0);
}

#[test]
fn demo_with_a_tiny_pool_evicts_without_errors() {
    let v = demo_json(&[
        "--requests",
        "400",
        "--pool-size",
        "8M",
        "--block-bytes",
        "64K",
    ]);
    assert_eq!(num(&v, "errors"), 0.0, "{v}");
    assert!(num(&v, "evictions") > 0.0, "no eviction: {v}");
    assert!(
        num(&v, "objects_written") > num(&v, "capacity_blocks"),
        "{v}"
    );
    // Puts evict just what they need: once full, the pool stays full.
    assert!(num(&v, "idle_fraction") < 0.05, "pool left idle: {v}");
}

#[test]
fn demo_prints_a_human_summary() {
    let out = demo(&[
        "--requests",
        "50",
        "--pool-size",
        "16M",
        "--block-bytes",
        "8K",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "replayed 50 requests",
        "prefix hits",
        "block here stands for one 512-token block",
        "hit rates are those of a",
        "compare with  LRU ",
        "best possible ",
        "evictions",
        "errors        0",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in:\n{stdout}");
    }
}

#[test]
fn demo_rejects_a_missing_trace() {
    let out = demo(&["--trace", "/nonexistent/trace.jsonl", "--requests", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("/nonexistent/trace.jsonl"), "{stderr}");
}

#[test]
fn demo_names_the_bad_line_of_a_trace() {
    let dir = std::env::temp_dir().join(format!("mooncake-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.jsonl");
    let good = r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}"#;
    std::fs::write(
        &path,
        format!("{good}\n{good}\n{{\"timestamp\": 1, \"hash_ids\": [2]}}\n"),
    )
    .unwrap();
    let out = demo(&["--trace", path.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success());
    assert!(stderr.contains("bad.jsonl:3"), "{stderr}");
    assert!(stderr.contains("input_length"), "{stderr}");
}

#[test]
fn demo_refuses_a_pool_too_small_to_hold_anything() {
    let out = demo(&["--pool-size", "256K", "--requests", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--pool-size"), "{stderr}");
}
