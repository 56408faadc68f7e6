//! The `mooncake` binary: bench output shape, backend report, metadata server, errors,
//! and the master's upstream defaults and flags.

mod common;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Command, Stdio};

use common::cprog::{Proc, LIMIT};
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

/// Runs the binary; (success, stdout, stderr).
/// A listing whose reader is gone (`mooncake calc --list | head -1`) ends quietly,
/// by SIGPIPE as any Unix filter, instead of panicking on the write.
#[test]
fn a_listing_whose_reader_is_gone_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    // The read end closed before the child starts: its first write meets no reader.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(BIN)
        .args(["calc", "--list"])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}: {stderr}",
        out.status
    );
}

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_subcommand_explains_itself() {
    for cmd in [
        &["target"][..],
        &["metadata-server"],
        &["info"],
        &["master"],
        &["node"],
        &["demo"],
        &["replay"],
        &["bench", "transfer"],
        &["bench", "store"],
        &["bench", "master"],
        &["bench", "alloc"],
    ] {
        for help in ["--help", "-h"] {
            let mut args = cmd.to_vec();
            args.push(help);
            let (ok, stdout, stderr) = run(&args);
            assert!(ok, "{args:?}: {stderr}");
            assert!(
                stdout.contains(&format!("mooncake {}", cmd.join(" "))),
                "{args:?}: {stdout}"
            );
        }
    }
    // `help CMD` is the same; the help of a command that does not exist is an error.
    let (ok, stdout, _) = run(&["help", "node"]);
    assert!(ok && stdout.contains("--segment-size"), "{stdout}");
    let (ok, _, stderr) = run(&["frobnicate", "--help"]);
    assert!(!ok && stderr.contains("unknown command"), "{stderr}");
    for v in ["--version", "-V", "version"] {
        let (ok, stdout, _) = run(&[v]);
        assert!(ok, "{v}");
        assert_eq!(
            stdout.trim(),
            format!("mooncake {}", env!("CARGO_PKG_VERSION"))
        );
    }
    // A misspelt flag is named, with where to look.
    let (ok, _, stderr) = run(&["master", "--lease-tl-ms", "5"]);
    assert!(!ok);
    assert!(stderr.contains("--lease-tl-ms"), "{stderr}");
    assert!(stderr.contains("`mooncake master --help`"), "{stderr}");
}

#[test]
fn settings_people_get_wrong_are_refused_by_name() {
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["node", "--master", "127.0.0.1:1"],
            &["--segment-size is required"],
        ),
        (
            &["node", "--master", "127.0.0.1:1", "--segment-size", "0"],
            &["--segment-size must be positive"],
        ),
        // 16 PiB: more than any machine this runs on; both sizes are named.
        (
            &[
                "node",
                "--master",
                "127.0.0.1:1",
                "--segment-size",
                "16384T",
            ],
            &["--segment-size 18014398509481984 bytes", "this machine's"],
        ),
        (
            &["master", "--rpc-port", "0", "--lease-ttl-ms", "0"],
            &["--lease-ttl-ms must be positive"],
        ),
        // An on/off value in another spelling is refused, never read as "on".
        (
            &["bench", "store", "--verify-checksum", "no"],
            &[r#"--verify-checksum: "no" is not true or false"#],
        ),
        (
            &["bench", "store", "--replica-cache", "disabled"],
            &["--replica-cache"],
        ),
        (&["calc", "--list=maybe"], &["--list"]),
        (
            &["master", "--promotion-on-hit", "sometimes"],
            &[r#"--promotion-on-hit: "sometimes" is not true or false"#],
        ),
        (
            &[
                "master",
                "--bind",
                "127.0.0.1",
                "--rpc-port",
                "0",
                "--client_ttl=-1",
            ],
            &["--client-ttl", "-1"],
        ),
        (
            &["master", "--rpc-port", "0", "--default_kv_lease_ttl=0"],
            &["--lease-ttl-ms must be positive"],
        ),
        // Upstream's validators, and features this build lacks, refused by name.
        (
            &["master", "--eviction_ratio=1.5"],
            &["--eviction_ratio", "0.0 and 1.0"],
        ),
        (
            &["master", "--offload_cap_ratio=2"],
            &["--offload_cap_ratio"],
        ),
        (
            &["master", "--offloading_queue_limit=0"],
            &["--offloading_queue_limit"],
        ),
        (
            &["master", "--default_kv_lease_ttl=5d"],
            &["--default_kv_lease_ttl", "unit"],
        ),
        (
            &["master", "--max_kv_soft_pin_ttl=later"],
            &["--max_kv_soft_pin_ttl"],
        ),
        (
            &["master", "--rpc_thread_num=many"],
            &["--rpc_thread_num", "integer"],
        ),
        (&["master", "-v=loud"], &["--v"]),
        (
            &["master", "--enable_kv_events"],
            &["--enable_kv_events", "not available"],
        ),
        (
            &["master", "--enable_multi_tenants=true"],
            &["--enable_multi_tenants"],
        ),
        (
            &["master", "--enable_oplog"],
            &["--enable_oplog needs --enable_ha"],
        ),
        (
            &[
                "master",
                "--rpc-port",
                "0",
                "--owner-key-file",
                "/nonexistent/mc-owner-key",
            ],
            &["--owner-key-file", "owner key /nonexistent/mc-owner-key"],
        ),
        (
            &["master", "--rpc_interface=mc-no-such-if0"],
            &["--rpc_interface mc-no-such-if0"],
        ),
        (
            &["master", "--flagfile=/no/such/flags"],
            &["--flagfile /no/such/flags"],
        ),
    ];
    for (args, needles) in cases {
        // Were one accepted, the master it starts would end with its (empty) stdin.
        let mut args = args.to_vec();
        if args[0] == "master" {
            args.extend(["--bind", "127.0.0.1", "--rpc-port", "0"]);
            args.extend(["--metrics-port", "off", "--until-stdin-eof"]);
        }
        let (ok, _, stderr) = run(&args);
        assert!(!ok, "{args:?} accepted");
        for n in *needles {
            assert!(stderr.contains(n), "{args:?}: {stderr}");
        }
    }
}

#[test]
fn target_names_its_buffer_on_the_ready_line() {
    let mut child = Command::new(BIN)
        .args(["target", "--size", "64K", "--bind", "127.0.0.1"])
        .args(["--protocol", "tcp", "--until-stdin-eof"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(words.len(), 4, "{line:?}");
    assert_eq!(words[0], "ready");
    assert!(words[1].starts_with("127.0.0.1:"), "{line:?}");
    let addr = words[2]
        .strip_prefix("addr=0x")
        .unwrap_or_else(|| panic!("{line:?}"));
    assert!(
        u64::from_str_radix(addr, 16).is_ok_and(|a| a != 0),
        "{line:?}"
    );
    assert_eq!(words[3], "size=65536");
    assert!(status.success());
}

#[test]
fn metadata_server_command_serves_rest_until_stdin_closes() {
    let mut child = Command::new(BIN)
        .args([
            "metadata-server",
            "--port",
            "0",
            "--host",
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

/// `mooncake master` with these arguments (plus `--until-stdin-eof`), its log level left
/// to the arguments alone.
fn master(args: &[&str]) -> Proc {
    let mut cmd = Command::new(BIN);
    cmd.arg("master")
        .args(args)
        .arg("--until-stdin-eof")
        .env_remove("RUST_LOG");
    Proc::spawn("master", &mut cmd)
}

/// The `key=value` word of a ready line.
fn field<'a>(ready: &'a str, key: &str) -> Option<&'a str> {
    ready
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// A port of 127.0.0.1 held by this test (nobody else can listen on it meanwhile).
fn held_port() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port().to_string();
    (l, port)
}

#[test]
fn master_runs_no_metadata_server_unless_asked() {
    // Upstream's standard launch starts a metadata server on 8080 first; the master must
    // not try to take that port. Here a port this test holds stands for it.
    let (_held, port) = held_port();
    let upstream_port = format!("--http_metadata_server_port={port}");
    let pinned = [
        "--rpc_address=127.0.0.1",
        // Upstream's rpc_port 0 means "use --port" (50051): the OS picks through --port.
        "--port=0",
        "--metrics_port=off",
    ];
    let mut m = master(&[&pinned[..], &[upstream_port.as_str()]].concat());
    let ready = m.ready();
    assert!(field(&ready, "metadata").is_none(), "{ready}");
    let rpc = field(&ready, "rpc").expect("an rpc address").to_owned();
    assert!(rpc.starts_with("127.0.0.1:"), "{ready}");
    // The master answers, and says it runs no metadata server.
    let e = mooncake::store::metadata_of_master(&rpc, None).unwrap_err();
    assert!(e.to_string().contains("runs no metadata server"), "{e}");
    assert!(m.finish(LIMIT).status.success());

    // Asked for one, it takes the port it is given: the held one, which it cannot.
    let mut m = master(
        &[
            &pinned[..],
            &["--enable_http_metadata_server=true", &upstream_port],
        ]
        .concat(),
    );
    let out = m.finish(LIMIT);
    assert!(!out.status.success(), "{:?}", out.stdout);
    assert!(out.stderr.contains(&format!(":{port}")), "{}", out.stderr);

    // On a free port, it serves, and tells nodes where.
    let mut m = master(
        &[
            &pinned[..],
            &[
                "--enable_http_metadata_server",
                "--http_metadata_server_port=0",
            ],
            &["--http_metadata_server_host=127.0.0.1"],
        ]
        .concat(),
    );
    let ready = m.ready();
    let url = field(&ready, "metadata")
        .expect("a metadata url")
        .to_owned();
    let rpc = field(&ready, "rpc").unwrap().to_owned();
    let told = mooncake::store::metadata_of_master(&rpc, None);
    let health = HttpClient::new(&url).and_then(|c| c.request("GET", "/health", b""));
    assert!(m.finish(LIMIT).status.success());
    assert_eq!(told.unwrap(), url);
    assert_eq!(health.unwrap().0, 200);
}

#[test]
fn master_answers_version_and_helpfull() {
    let (ok, stdout, stderr) = run(&["master", "--version"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains(env!("CARGO_PKG_VERSION")), "{stdout}");
    let (ok, stdout, _) = run(&["metadata-server", "--version"]);
    assert!(ok && stdout.contains(env!("CARGO_PKG_VERSION")), "{stdout}");
    let (ok, stdout, stderr) = run(&["master", "--helpfull"]);
    assert!(ok, "{stderr}");
    for name in [
        "--rpc_interface",
        "--enable_kv_events",
        "--offload_cap_ratio",
        "--v ",
    ] {
        assert!(stdout.contains(name), "{name} missing from:\n{stdout}");
    }
}

#[test]
fn glog_verbosity_sets_the_masters_log_level() {
    // An inert flag is logged at debug level: shown with -v=1, not without.
    let note = "--max_threads=4: accepted";
    let pinned = [
        "--bind",
        "127.0.0.1",
        "--rpc-port",
        "0",
        "--metrics-port",
        "off",
    ];
    for (verbosity, shown) in [
        (&[][..], false),
        (&["-v=1"], true),
        (&["--v=1"], true),
        (&["-v", "1"], true),
    ] {
        let mut m = master(&[&pinned[..], verbosity, &["--max_threads=4"]].concat());
        m.ready();
        let out = m.finish(LIMIT);
        assert!(out.status.success(), "{verbosity:?}: {}", out.stderr);
        assert_eq!(
            out.stderr.contains(note),
            shown,
            "{verbosity:?}: {}",
            out.stderr
        );
    }
}
