//! Subcommands of the `mooncake` binary (`src/main.rs` dispatches), over the public
//! API of the layers below: serve a segment, run a metadata server, a master or a node,
//! replay and simulate traces, size a deployment.

pub mod args;
pub mod calc;
pub mod master_flags;
pub mod replay;
pub mod simulate;
pub mod store;
pub mod trace;
pub mod usage;

use std::io::{BufRead, Write};
use std::net::{IpAddr, SocketAddr};

use args::Args;
use mooncake_base::auth::ClusterSecret;
use mooncake_base::util::crc32c::{crc32c, crc32c_append};
use mooncake_engine::device::{self, Bounce, MemoryKind};
use mooncake_engine::metadata::http_server::MetadataServer;
use mooncake_engine::{Engine, EngineConfig};
use mooncake_sys::loader;

/// Serves line commands on stdin until EOF (the parent closed it or died). Used by
/// tests and the bench to drive a child target: `unregister` withdraws its buffer.
fn serve_stdin(mut on_command: impl FnMut(&str) -> String) {
    let stdin = std::io::stdin();
    let mut line = String::new();
    while stdin
        .lock()
        .read_line(&mut line)
        .map(|n| n > 0)
        .unwrap_or(false)
    {
        if !line.trim().is_empty() {
            println!("{}", on_command(line.trim()));
            let _ = std::io::stdout().flush();
        }
        line.clear();
    }
}

/// Lets SIGPIPE end the process, as for any Unix filter: a command that only prints
/// then stops quietly when its reader goes (`mooncake calc --list | head -1`)
/// instead of panicking on the write. Never for commands that serve or move bytes:
/// a peer closing a socket must not kill them (the engine ignores SIGPIPE).
pub fn end_quietly_on_closed_stdout() {
    // SAFETY: installing SIG_DFL for SIGPIPE has no memory-safety preconditions.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// SIGINT and SIGTERM, the signals that end a serving command.
fn termination_signals() -> libc::sigset_t {
    // SAFETY: sigset operations on a local, zero-initialized set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    }
}

/// Blocks the termination signals in this thread and every thread started after, so
/// that `wait_for_signal` receives them instead of the default handler.
pub fn block_signals_for_wait() {
    let set = termination_signals();
    // SAFETY: a valid set; a NULL old-set pointer is allowed.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// Blocks until SIGINT or SIGTERM (after `block_signals_for_wait`).
fn wait_for_signal() {
    let set = termination_signals();
    let mut sig = 0;
    // SAFETY: a valid set and a live output integer.
    unsafe { libc::sigwait(&set, &mut sig) };
}

/// Serves until stdin closes (`until_eof`) or a termination signal arrives.
pub fn serve_until_done(until_eof: bool) {
    serve_until_done_or(until_eof, || false);
}

/// As `serve_until_done`, and without `until_eof` also until `done()` turns true
/// (asked every 200 ms).
pub fn serve_until_done_or(until_eof: bool, done: impl Fn() -> bool) {
    if until_eof {
        serve_stdin(|cmd| format!("error unknown command {cmd:?}"));
        return;
    }
    let set = termination_signals();
    let tick = libc::timespec {
        tv_sec: 0,
        tv_nsec: 200_000_000,
    };
    // SAFETY: a valid set, a live timespec, and no siginfo wanted (NULL is allowed).
    while unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &tick) } < 0 && !done() {}
}

/// Engine tuning flags (worker and TCP settings) over the default config.
pub fn engine_tuning(a: &Args) -> Result<EngineConfig, String> {
    apply_engine_flags(
        a,
        EngineConfig::default(),
        &[
            ("workers", "workers"),
            ("spin-budget", "spin_budget"),
            ("lanes", "lanes_per_peer"),
            ("slice-size", "slice_size"),
            ("socket-buffer", "socket_buffer"),
            ("device-name", "device_name"),
            ("fabric-provider", "fabric_provider"),
            ("cluster-secret-file", "cluster_secret_file"),
        ],
    )
}

/// The cluster secret of a serving command: `--cluster-secret-file`, else
/// `MC_CLUSTER_SECRET`, else none (no authentication).
pub fn cluster_secret(a: &Args) -> Result<Option<ClusterSecret>, String> {
    match a.str("cluster-secret-file") {
        Some(path) => ClusterSecret::from_file(path)
            .map(Some)
            .map_err(|e| format!("--cluster-secret-file: {e}")),
        None => ClusterSecret::from_env().map_err(|e| e.to_string()),
    }
}

/// Builds an engine config from the flags shared by all subcommands: identity and
/// transport choice, plus the tuning flags.
pub fn engine_config(a: &Args) -> Result<EngineConfig, String> {
    apply_engine_flags(
        a,
        engine_tuning(a)?,
        &[
            ("metadata", "metadata"),
            ("name", "local_server_name"),
            ("bind", "bind_address"),
            ("rpc-port", "rpc_port"),
            ("protocol", "protocol"),
        ],
    )
}

fn apply_engine_flags(
    a: &Args,
    mut cfg: EngineConfig,
    keys: &[(&str, &str)],
) -> Result<EngineConfig, String> {
    for (flag, key) in keys {
        if let Some(v) = a.str(flag) {
            cfg.set(key, v).map_err(|e| format!("--{flag}: {e}"))?;
        }
    }
    Ok(cfg)
}

/// `mooncake target`: registers a buffer, publishes it, and serves it until killed.
pub fn target(raw: &[String]) -> Result<(), String> {
    let a = Args::parse(raw)?;
    let size: usize = a.get("size", 64 << 20)?;
    let location = a.str("location").unwrap_or("cpu:0").to_owned();
    let until_eof = a.flag("until-stdin-eof")?;
    let cfg = engine_config(&a)?;
    a.finish()?;
    if size == 0 {
        return Err("--size must be positive".into());
    }
    // Block signals before any thread starts so sigwait sees them.
    if !until_eof {
        block_signals_for_wait();
    }
    let engine = Engine::new(cfg).map_err(|e| e.to_string())?;
    // Engine-owned memory: for host memory a memfd same-host peers copy with plain
    // memcpy; for a device location, the driver's.
    let kind = MemoryKind::parse_location(&location).map_err(|e| e.to_string())?;
    let buffer = engine
        .allocate_buffer(size, &location)
        .map_err(|e| e.to_string())?;
    // `ready <segment>` first (tests and benches take the second word); then the
    // buffer, for people and scripts that read or write it directly.
    println!(
        "ready {} addr={:#x} size={size}",
        engine.segment_name(),
        buffer as usize
    );
    let _ = std::io::stdout().flush();
    let mut registered = true;
    if until_eof {
        serve_stdin(|cmd| match cmd {
            "unregister" if registered => {
                registered = false;
                match engine.free_buffer(buffer) {
                    Ok(()) => "unregistered".to_owned(),
                    Err(e) => format!("error {e}"),
                }
            }
            "checksum" if registered => match checksum(kind, buffer, size) {
                Ok(crc) => format!("crc32c {crc:08x}"),
                Err(e) => format!("error {e}"),
            },
            other => format!("error unknown command {other:?}"),
        });
    } else {
        wait_for_signal();
    }
    if registered {
        engine.free_buffer(buffer).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// CRC32C of a buffer's bytes, read through its driver when it is device memory.
fn checksum(kind: MemoryKind, buffer: *mut u8, size: usize) -> mooncake_base::Result<u32> {
    if kind.is_host() {
        // SAFETY: the engine-owned buffer of `size` bytes, still allocated.
        return Ok(crc32c(unsafe { std::slice::from_raw_parts(buffer, size) }));
    }
    let bounce = Bounce::take(kind);
    let (mut crc, mut off) = (0, 0);
    while off < size {
        let n = (size - off).min(bounce.len());
        // SAFETY: device memory of `size` bytes, still allocated; the bounce holds `n`.
        unsafe { device::copy_to_host(kind, bounce.ptr(), buffer as u64 + off as u64, n)? };
        crc = crc32c_append(crc, bounce.bytes(n));
        off += n;
    }
    Ok(crc)
}

/// Starts logging: `RUST_LOG` (default `warn`), overridden for `mooncake master` by
/// glog's `-v` / `--minloglevel` as upstream's master takes them.
pub fn init_logging(raw: &[String]) {
    let mut logger =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"));
    if let Some(("master", rest)) = raw.split_first().map(|(c, r)| (c.as_str(), r)) {
        if let Some(level) = master_flags::log_level(rest) {
            logger.filter_level(level);
        }
    }
    logger.init();
}

/// `mooncake metadata-server`: on all interfaces unless told otherwise, as upstream's
/// `mooncake_http_metadata_server` (`--host` is its name for `--bind`).
pub fn metadata_server(raw: &[String]) -> Result<(), String> {
    if raw.iter().any(|a| a == "--version" || a == "-version") {
        println!(
            "mooncake_http_metadata_server version {}",
            env!("CARGO_PKG_VERSION")
        );
        return Ok(());
    }
    let a = Args::parse_with_aliases(raw, &[("host", "bind")])?;
    let port: u16 = a.get("port", 8080)?;
    let bind: IpAddr = a.get("bind", IpAddr::from([0, 0, 0, 0]))?;
    let secret = cluster_secret(&a)?;
    let until_eof = a.flag("until-stdin-eof")?;
    a.finish()?;
    if !until_eof {
        block_signals_for_wait();
    }
    let server = MetadataServer::start_with_secret(SocketAddr::new(bind, port), secret)
        .map_err(|e| e.to_string())?;
    println!("ready {}", server.url());
    let _ = std::io::stdout().flush();
    serve_until_done(until_eof);
    drop(server);
    Ok(())
}

/// `mooncake info`: every transport backend, whether it loaded and why not, where
/// from, which devices it sees.
pub fn info(raw: &[String]) -> Result<(), String> {
    Args::parse(raw)?.finish()?;
    let static_note = if loader::is_static_binary() {
        " (static binary: no runtime-loaded backends; tcp and shm only)"
    } else {
        ""
    };
    println!("mooncake {}{static_note}", env!("CARGO_PKG_VERSION"));
    println!("tcp: built in");
    println!("shm: built in (same host: shared mappings, process_vm_readv/writev)");
    let reports = [
        mooncake_sys::ibverbs::info(),
        mooncake_sys::fabric::info(),
        mooncake_sys::cuda::info(),
        mooncake_sys::hip::info(),
        mooncake_sys::acl::info(),
    ];
    for r in reports {
        match &r.library {
            Ok(lib) => {
                let version = r
                    .version
                    .as_deref()
                    .map(|v| format!(" version {v}"))
                    .unwrap_or_default();
                println!("{}: loaded from {lib}{version}", r.name);
            }
            Err(why) => println!("{}: unavailable: {why}", r.name),
        }
        for d in &r.devices {
            println!("    device {d}");
        }
        for n in &r.notes {
            println!("    {n}");
        }
        if r.name.starts_with("rdma") {
            let nics = mooncake_sys::ibverbs::verbs()
                .map(|v| v.device_names())
                .unwrap_or_default();
            if !nics.is_empty() {
                let matrix = mooncake_engine::transport::rdma::discovered_matrix(&nics);
                println!("    topology (NIC priority matrix, device_name overrides): {matrix}");
            }
        }
    }
    // What an engine asking for each hardware protocol would run here: the engine's own
    // decision, on the same probe of the backend.
    use mooncake_engine::engine::{config, fallback};
    use mooncake_engine::Protocol;
    let strict = config::strict_protocol_from_env();
    println!(
        "hardware protocols ({}):",
        if strict {
            "MC_STRICT_PROTOCOL=1: an unavailable one fails start-up"
        } else {
            "an unavailable one falls back to tcp with a warning; MC_STRICT_PROTOCOL=1 refuses"
        }
    );
    let verdict = |p: Protocol| match fallback::probe(p) {
        Ok(()) => "available".to_owned(),
        Err(why) => match fallback::fall_back(p, why, "", strict) {
            Ok(f) => format!("falls back to {}: {}", f.used.name(), f.reason.context()),
            Err(e) => format!("refused: {e}"),
        },
    };
    let no_backend = config::NO_BACKEND
        .iter()
        .map(|name| Protocol::NoBackend(name));
    for p in [Protocol::Rdma, Protocol::Fabric]
        .into_iter()
        .chain(no_backend)
    {
        println!("    {}: {}", p.name(), verdict(p));
    }
    Ok(())
}
