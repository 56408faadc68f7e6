//! A hardware protocol whose backend is unavailable here: the engine runs over TCP and
//! says so (a warning, `protocol_fallback`, stats, its descriptor, `mooncake info`), or,
//! when strict, refuses to start with BackendUnavailable (-1209) as before.
//!
//! The RDMA cases name a device no host has, so the backend is unavailable on every
//! machine (no libibverbs, no devices, or no such device), whatever NICs it has.

mod common;

use std::ffi::c_int;
use std::process::{Command, Stdio};

use common::{assert_child_ok, engine_with, pattern, test_in_child, Registered};
use mooncake::capi::{
    mc_config_free, mc_config_new, mc_config_set, mc_engine_free, mc_engine_new,
    mc_segment_describe, McEngine,
};
use mooncake::{Code, Engine, EngineConfig, Op, Protocol, Request};

const NO_SUCH_NIC: &str = "mc_no_such_nic0";

fn config(protocol: &str, strict: bool) -> EngineConfig {
    let mut cfg = EngineConfig::default();
    cfg.set("metadata", "P2PHANDSHAKE").unwrap();
    cfg.set("protocol", protocol).unwrap();
    cfg.strict_protocol = strict;
    cfg
}

fn rdma_without_devices(strict: bool) -> EngineConfig {
    let mut cfg = config("rdma", strict);
    cfg.set("device_name", NO_SUCH_NIC).unwrap();
    cfg
}

/// Writes then reads back a pattern between `client` and `server` over one segment.
fn round_trip(client: &Engine, server: &Engine) {
    let len = 3 << 20;
    let remote = Registered::new(server, vec![0; len]);
    let seg = client.open_segment(server.segment_name()).unwrap();
    let src = pattern(7, len);
    let mut back = vec![0u8; len];
    let write = Request {
        op: Op::Write,
        local: src.as_ptr() as u64,
        segment: seg,
        remote: remote.addr(),
        len: len as u64,
    };
    let read = Request {
        op: Op::Read,
        local: back.as_mut_ptr() as u64,
        ..write
    };
    // SAFETY: `src` and `back` outlive the synchronous transfers.
    unsafe { client.transfer_sync(&[write]) }.unwrap();
    assert!(remote.buf == src, "the write landed");
    // SAFETY: as above.
    unsafe { client.transfer_sync(&[read]) }.unwrap();
    assert!(back == src, "the read returned the bytes");
}

/// Upstream's MC_FORCE_TCP (`force_tcp`): TCP as asked, so no fallback to report, and
/// strictness has nothing to refuse.
#[test]
fn force_tcp_runs_a_hardware_protocol_over_tcp_without_a_fallback() {
    let mut cfg = rdma_without_devices(true);
    cfg.force_tcp = true;
    let forced = Engine::new(cfg).expect("tcp was asked for");
    assert_eq!(forced.protocol(), Protocol::Tcp);
    assert!(forced.protocol_fallback().is_none());
    let server = Engine::new(config("tcp", false)).unwrap();
    round_trip(&forced, &server);
}

#[test]
fn rdma_without_devices_runs_over_tcp_and_says_why() {
    let client = Engine::new(rdma_without_devices(false)).expect("falls back");
    assert_eq!(client.config().protocol, Protocol::Rdma, "what was asked");
    assert_eq!(client.protocol(), Protocol::Tcp, "what runs");
    let f = client.protocol_fallback().expect("fallback reported");
    assert_eq!((f.requested, f.used), (Protocol::Rdma, Protocol::Tcp));
    assert_eq!(f.reason.code(), Code::BackendUnavailable);
    assert_eq!(f.ignored_devices, NO_SUCH_NIC);
    let line = f.to_string();
    for part in ["protocol rdma requested", "using tcp instead", NO_SUCH_NIC] {
        assert!(line.contains(part), "{part:?} missing from {line:?}");
    }
    assert_eq!(client.descriptor().protocol, "tcp");
    assert!(client.descriptor().devices.is_empty());

    // A second engine, also fallen back, and a plain TCP one: bytes move both ways.
    let fellback_server = Engine::new(rdma_without_devices(false)).unwrap();
    let tcp_server = engine_with("P2PHANDSHAKE", "tcp");
    round_trip(&client, &fellback_server);
    round_trip(&client, &tcp_server);
    let s = client.stats();
    assert_eq!(s.protocol_fallbacks, 1, "{s:?}");
    assert!(s.tcp_bytes >= 4 * (3 << 20), "{s:?}");
    assert_eq!((s.rdma_bytes, s.shm_bytes, s.failed_slices), (0, 0, 0));
    // And the plain engine reads from the fallen-back one.
    round_trip(&tcp_server, &client);
    assert_eq!(tcp_server.stats().protocol_fallbacks, 0);
    assert!(tcp_server.protocol_fallback().is_none());
}

#[test]
fn strict_rdma_without_devices_refuses_to_start() {
    let err = Engine::new(rdma_without_devices(true))
        .err()
        .expect("strict: no fallback");
    assert_eq!(err.code(), Code::BackendUnavailable, "{err}");
    assert_eq!(err.code() as c_int, -1209);
    // The backend's own reason, not a message about falling back.
    assert!(!err.to_string().contains("using tcp"), "{err}");
}

#[test]
fn a_protocol_without_a_backend_in_this_build_falls_back_unless_strict() {
    let e = Engine::new(config("nvlink", false)).expect("falls back");
    assert_eq!(e.protocol(), Protocol::Tcp);
    let f = e.protocol_fallback().unwrap();
    assert_eq!(f.requested, Protocol::NoBackend("nvlink"));
    assert!(f.reason.context().contains("no nvlink transport"), "{f}");
    round_trip(&e, &engine_with("P2PHANDSHAKE", "tcp"));

    let err = Engine::new(config("nvlink", true)).err().unwrap();
    assert_eq!(err.code(), Code::BackendUnavailable, "{err}");
    // A name that is no protocol at all stays a configuration error.
    let mut cfg = EngineConfig::default();
    assert_eq!(
        cfg.set("protocol", "carrier-pigeon").unwrap_err().code(),
        Code::InvalidParams
    );
}

#[test]
fn software_protocols_never_report_a_fallback() {
    for p in ["auto", "tcp"] {
        let e = Engine::new(config(p, true)).unwrap();
        assert_eq!(e.protocol(), e.config().protocol);
        assert!(e.protocol_fallback().is_none());
        assert_eq!(e.stats().protocol_fallbacks, 0);
    }
}

/// The engine's own descriptor through the C ABI (what a C program queries).
fn c_descriptor_protocol(e: *mut McEngine) -> String {
    let mut buf = vec![0u8; 64 << 10];
    let mut needed = 0usize;
    // SAFETY: a live engine; `buf` is writable for its length.
    let rc = unsafe { mc_segment_describe(e, 0, buf.as_mut_ptr().cast(), buf.len(), &mut needed) };
    assert_eq!(rc, 0);
    let text = std::ffi::CStr::from_bytes_until_nul(&buf).unwrap();
    let v = mooncake::json::parse(text.to_str().unwrap()).unwrap();
    v.get("protocol")
        .and_then(|p| p.as_str())
        .unwrap()
        .to_owned()
}

/// `mc_engine_new` with `protocol` and `device_name`: its code, and the engine's
/// descriptor protocol when it started.
fn c_engine(protocol: &std::ffi::CStr, device: &std::ffi::CStr) -> (c_int, Option<String>) {
    // SAFETY: configs and engines made and freed here; literal strings.
    unsafe {
        let cfg = mc_config_new();
        assert_eq!(
            mc_config_set(cfg, c"protocol".as_ptr(), protocol.as_ptr()),
            0
        );
        assert_eq!(
            mc_config_set(cfg, c"device_name".as_ptr(), device.as_ptr()),
            0
        );
        let mut e: *mut McEngine = std::ptr::null_mut();
        let rc = mc_engine_new(cfg, &mut e);
        mc_config_free(cfg);
        let described = (!e.is_null()).then(|| c_descriptor_protocol(e));
        mc_engine_free(e);
        (rc, described)
    }
}

#[test]
fn the_c_abi_falls_back_by_default() {
    assert_eq!(
        c_engine(c"rdma", c"mc_no_such_nic0"),
        (0, Some("tcp".into()))
    );
    assert_eq!(c_engine(c"nvlink", c""), (0, Some("tcp".into())));
}

const CHILD: &str = "MC_FALLBACK_TEST_CHILD";

/// `MC_STRICT_PROTOCOL=1` is read where configs are made (`EngineConfig::default`,
/// `mc_config_new`): every entry point refuses again. Environment variables are
/// process-wide, so this runs in a child process.
#[test]
fn the_environment_switch_restores_the_refusal() {
    if std::env::var_os(CHILD).is_some() {
        assert!(EngineConfig::default().strict_protocol);
        let err = Engine::new(rdma_without_devices(true)).err().unwrap();
        assert_eq!(err.code(), Code::BackendUnavailable);
        let mut cfg = EngineConfig::default();
        cfg.set("protocol", "nvlink").unwrap();
        assert_eq!(
            Engine::new(cfg).err().unwrap().code(),
            Code::BackendUnavailable
        );
        assert_eq!(c_engine(c"rdma", c"mc_no_such_nic0"), (-1209, None));
        assert_eq!(c_engine(c"efa", c""), (-1209, None));
        println!("CHILD-OK");
        return;
    }
    assert_child_ok(
        test_in_child("the_environment_switch_restores_the_refusal")
            .env(CHILD, "1")
            .env("MC_STRICT_PROTOCOL", "1")
            .env("MC_FABRIC_LIB", "/nonexistent/libfabric.so.1"),
    );
}

/// Runs `mooncake` with `args` and `env`; (success, stdout, stderr).
fn mooncake(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mooncake"))
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The CLI falls back with exactly one warning, and refuses under the switch.
#[test]
fn a_cli_target_falls_back_with_one_warning_or_refuses_when_strict() {
    let args = [
        "target",
        "--metadata",
        "P2PHANDSHAKE",
        "--bind",
        "127.0.0.1",
        "--size",
        "4096",
        "--protocol",
        "rdma",
        "--device-name",
        NO_SUCH_NIC,
        "--until-stdin-eof",
    ];
    // stdin is /dev/null: the target reports ready, sees EOF and exits.
    let (ok, out, err) = mooncake(&args, &[]);
    assert!(ok && out.starts_with("ready "), "{out}{err}");
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    for part in ["protocol rdma requested", "using tcp instead", NO_SUCH_NIC] {
        assert!(warnings[0].contains(part), "{part:?} missing: {err}");
    }

    let (ok, out, err) = mooncake(&args, &[("MC_STRICT_PROTOCOL", "1")]);
    assert!(!ok, "{out}{err}");
    assert!(err.contains("backend unavailable"), "{err}");
}

#[test]
fn info_says_what_an_unavailable_protocol_becomes() {
    let (ok, out, err) = mooncake(
        &["info"],
        &[("MC_IBVERBS_LIB", "/nonexistent/libibverbs.so.1")],
    );
    assert!(ok, "{err}");
    assert!(out.contains("\n    rdma: falls back to tcp: "), "{out}");
    assert!(
        out.contains("\n    nvlink: falls back to tcp: no nvlink transport"),
        "{out}"
    );
    let (ok, out, err) = mooncake(
        &["info"],
        &[
            ("MC_IBVERBS_LIB", "/nonexistent/libibverbs.so.1"),
            ("MC_STRICT_PROTOCOL", "1"),
        ],
    );
    assert!(ok, "{err}");
    assert!(
        out.contains("\n    rdma: refused: backend unavailable"),
        "{out}"
    );
}
