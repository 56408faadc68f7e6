//! `mooncake bench store` and `mooncake bench master`: each run prints one JSON line
//! with the fields scripts read, and no errors (figures are not asserted).

use std::process::Command;

use mooncake::json::{self, Value};

const BIN: &str = env!("CARGO_BIN_EXE_mooncake");

/// Runs `mooncake bench ARGS`; the single JSON line it printed.
fn bench(args: &[&str]) -> Value {
    let out = Command::new(BIN).arg("bench").args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{args:?}: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "{args:?}: {stdout}");
    json::parse(lines[0]).unwrap_or_else(|e| panic!("{args:?}: {e}: {stdout}"))
}

fn has(v: &Value, keys: &[&str]) {
    for key in keys {
        assert!(v.get(key).is_some(), "missing {key} in {v}");
    }
    assert_eq!(v.get("errors").and_then(Value::as_u64), Some(0), "{v}");
}

const STORE_FIELDS: &[&str] = &[
    "bench",
    "op",
    "api",
    "size",
    "batch",
    "threads",
    "ops",
    "seconds",
    "ops_per_s",
    "gbps",
    "lat_p50_us",
    "lat_p99_us",
    "errors",
    "protocol",
    "verify_checksum",
    "evicted_objects",
    "baseline",
    "transfer_engine_p50_us",
];

#[test]
fn store_get_prints_one_clean_line() {
    let v = bench(&["store", "--op", "get", "--size", "4K", "--duration", "0.3"]);
    has(&v, STORE_FIELDS);
    assert_eq!(v.get("bench").and_then(Value::as_str), Some("store"));
    assert_eq!(v.get("op").and_then(Value::as_str), Some("get"));
    assert_eq!(v.get("size").and_then(Value::as_u64), Some(4096));
    assert_eq!(v.get("protocol").and_then(Value::as_str), Some("tcp"));
    assert!(v.get("ops").and_then(Value::as_u64).unwrap() > 0, "{v}");
    // Measured against the node in the same run.
    assert!(v
        .get("transfer_engine_p50_us")
        .and_then(Value::as_f64)
        .is_some());
}

#[test]
fn store_batched_put_prints_one_clean_line() {
    let v = bench(&[
        "store",
        "--op",
        "put",
        "--batch",
        "8",
        "--api",
        "copy",
        "--duration",
        "0.3",
    ]);
    has(&v, STORE_FIELDS);
    assert_eq!(v.get("op").and_then(Value::as_str), Some("put"));
    assert_eq!(v.get("api").and_then(Value::as_str), Some("copy"));
    assert_eq!(v.get("batch").and_then(Value::as_u64), Some(8));
    let ops = v.get("ops").and_then(Value::as_u64).unwrap();
    assert!(ops > 0 && ops % 8 == 0, "{v}");
    // The last batch was read back and matched.
    assert_eq!(v.get("read_back").and_then(Value::as_u64), Some(8), "{v}");
}

#[test]
fn store_exists_prints_one_clean_line() {
    let v = bench(&[
        "store",
        "--op",
        "exists",
        "--batch",
        "4",
        "--threads",
        "2",
        "--duration",
        "0.2",
    ]);
    has(&v, STORE_FIELDS);
    assert_eq!(v.get("threads").and_then(Value::as_u64), Some(2));
}

#[test]
fn store_rejects_bad_options() {
    for args in [
        &["store", "--op", "scan"][..],
        &["store", "--api", "mmap"],
        &["store", "--batch", "0"],
        &["store", "--no-such-flag", "1"],
    ] {
        let out = Command::new(BIN).arg("bench").args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn master_prints_one_clean_line() {
    let v = bench(&["master", "--duration", "0.2", "--keys", "20000"]);
    has(
        &v,
        &[
            "bench",
            "threads",
            "keys",
            "put_pairs_per_s",
            "get_replicas_per_s",
            "exists_per_s",
            "mix_ops_per_s",
            "ops_per_s",
            "errors",
        ],
    );
    assert_eq!(v.get("bench").and_then(Value::as_str), Some("master"));
    for key in ["put_pairs_per_s", "get_replicas_per_s", "exists_per_s"] {
        assert!(
            v.get(key).and_then(Value::as_f64).unwrap() > 0.0,
            "{key}: {v}"
        );
    }
}
