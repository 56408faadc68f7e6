//! The `mooncake` binary: bench output shape, backend report, metadata server, errors.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use mooncake::http::HttpClient;
use mooncake::json;

const BIN: &str = env!("CARGO_BIN_EXE_mooncake");

#[test]
fn bench_prints_one_verified_json_line_per_run() {
    for (protocol, op) in [("tcp", "read"), ("shm", "write"), ("auto", "read")] {
        let out = Command::new(BIN)
            .args(["bench", "transfer", "--protocol", protocol, "--op", op])
            .args([
                "--block-size",
                "64K",
                "--batch-size",
                "4",
                "--threads",
                "2",
                "--duration",
                "0.2",
            ])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{protocol}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), 1, "{stdout}");
        let v = json::parse(lines[0]).unwrap();
        for key in [
            "bench",
            "protocol",
            "op",
            "block_size",
            "batch_size",
            "threads",
            "bytes",
            "seconds",
            "gbps",
            "ops_per_s",
            "lat_p50_us",
            "lat_p99_us",
            "baseline_gbps",
        ] {
            assert!(
                v.get(key).is_some(),
                "{protocol}: missing {key} in {stdout}"
            );
        }
        assert_eq!(v.get("protocol").and_then(|x| x.as_str()), Some(protocol));
        assert_eq!(v.get("block_size").and_then(|x| x.as_u64()), Some(65536));
        assert_eq!(v.get("verified").and_then(|x| x.as_bool()), Some(true));
        assert!(v
            .get("bytes")
            .and_then(|x| x.as_u64())
            .is_some_and(|b| b > 0));
    }
}

#[test]
fn info_reports_each_runtime_loaded_backend() {
    let out = Command::new(BIN).arg("info").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for name in ["rdma", "efa", "cuda", "hip", "ascend"] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
}

#[test]
fn bad_flags_fail_with_a_clear_message() {
    for args in [
        vec!["target", "--sise", "4K"],
        vec!["target", "--protocol", "carrier-pigeon"],
        vec!["bench", "transfer", "--op", "erase"],
        vec!["target", "--size"],
        vec!["frobnicate"],
    ] {
        let out = Command::new(BIN).args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("mooncake: "), "{args:?}: {err}");
    }
}

#[test]
fn metadata_server_command_serves_rest_until_stdin_closes() {
    let mut child = Command::new(BIN)
        .args([
            "metadata-server",
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--until-stdin-eof",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("ready ")
        .unwrap_or_else(|| panic!("{line:?}"))
        .to_owned();
    let client = HttpClient::new(&url);
    let result = client.and_then(|c| {
        let put = c.request("PUT", "/metadata?key=k", b"{\"a\":1}")?;
        let get = c.request("GET", "/metadata?key=k", b"")?;
        let health = c.request("GET", "/health", b"")?;
        Ok((put.0, get, health))
    });
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    let (put, get, health) = result.unwrap();
    assert_eq!(put, 200);
    assert_eq!(get, (200, b"{\"a\":1}".to_vec()));
    assert_eq!(health.0, 200);
    assert!(status.success());
}
