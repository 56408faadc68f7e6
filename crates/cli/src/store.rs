//! `mooncake master` and `mooncake node`.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::args::Args;
use super::master_flags::Builtin;
use mooncake_base::etcd::EtcdClient;
use mooncake_store::ha;
use mooncake_store::master::AllocationStrategy;
use mooncake_store::segment_reach::VerifyMounts;
use mooncake_store::{Client, ClientConfig, MasterServer, ServerConfig};

/// Mooncake's `mooncake_master` flag names, accepted as aliases of ours.
const MASTER_ALIASES: &[(&str, &str)] = &[
    ("default-kv-lease-ttl", "lease-ttl-ms"),
    ("eviction-high-watermark-ratio", "eviction-high-watermark"),
    ("rpc-address", "rpc-bind"),
];

/// A port flag: a number (0 picks a free port) or "off"; `None` when not given.
fn port_flag(a: &Args, key: &str) -> Result<Option<Option<u16>>, String> {
    match a.str(key) {
        None => Ok(None),
        Some("off" | "none") => Ok(Some(None)),
        Some(_) => a.get(key, 0).map(|p| Some(Some(p))),
    }
}

/// The embedded metadata server's port, when it runs: only when asked for, as in
/// upstream (`--enable_http_metadata_server` on `--http_metadata_server_port`, 8080),
/// or by our `--metadata-port N`.
fn metadata_port(a: &Args) -> Result<Option<u16>, String> {
    let ours = port_flag(a, "metadata-port")?;
    let upstream_port = a.get("http-metadata-server-port", 8080)?;
    let enabled = a.switch("enable-http-metadata-server")?;
    match (enabled, ours) {
        (Some(false), _) => Ok(None),
        (Some(true), Some(None)) => Err(
            "--enable_http_metadata_server=true and --metadata-port off contradict each other"
                .into(),
        ),
        (Some(true), Some(port)) => Ok(port),
        (Some(true), None) => Ok(Some(upstream_port)),
        (None, ours) => Ok(ours.flatten()),
    }
}

/// A host flag: an IP address, or a name this machine resolves; errors name the flag
/// as `shown` (the upstream name people write).
fn host_flag(a: &Args, key: &str, shown: &str) -> Result<Option<IpAddr>, String> {
    let Some(host) = a.str(key) else {
        return Ok(None);
    };
    if let Ok(ip) = host.trim().parse() {
        return Ok(Some(ip));
    }
    let resolved = (host.trim(), 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next());
    match resolved {
        Some(addr) => Ok(Some(addr.ip())),
        None => Err(format!(
            "{shown} {host:?}: not an IP address, nor a host name this machine resolves"
        )),
    }
}

/// Where each of the master's servers listens.
#[derive(Debug, PartialEq, Eq)]
struct Binds {
    rpc: IpAddr,
    metadata: IpAddr,
    metrics: IpAddr,
}

/// All interfaces unless told otherwise, as upstream: `--bind` for every server;
/// `--rpc_address` (or the IPv4 address of `--rpc_interface`), `--http_metadata_server_host`
/// and `--metrics_host` for one each.
fn binds(a: &Args) -> Result<Binds, String> {
    let all = host_flag(a, "bind", "--bind")?.unwrap_or(IpAddr::from([0, 0, 0, 0]));
    let rpc_address = host_flag(a, "rpc-bind", "--rpc_address")?;
    let rpc = match a.str("rpc-interface").filter(|i| !i.is_empty()) {
        Some(name) => {
            let ip = mooncake_base::net::interface_ipv4(name)
                .map_err(|e| format!("--rpc_interface {name}: listing interfaces: {e}"))?
                .ok_or_else(|| {
                    format!("--rpc_interface {name}: no network interface of that name has an IPv4 address")
                })?;
            if rpc_address.is_some_and(|a| !a.is_unspecified()) {
                log::warn!("--rpc_interface {name} ({ip}) overrides --rpc_address");
            }
            IpAddr::V4(ip)
        }
        None => rpc_address.unwrap_or(all),
    };
    Ok(Binds {
        rpc,
        metadata: host_flag(a, "metadata-bind", "--http_metadata_server_host")?.unwrap_or(all),
        metrics: host_flag(a, "metrics-bind", "--metrics_host")?.unwrap_or(all),
    })
}

/// Where other hosts reach a server listening on `addr`: itself, or for a wildcard,
/// this host's address on its default route (`None` when it has none).
fn reachable(addr: SocketAddr) -> Option<SocketAddr> {
    mooncake_base::net::reachable_address(addr.ip(), mooncake_base::net::default_route_source)
        .map(|ip| SocketAddr::new(ip, addr.port()))
}

/// Answers gflags' `--version` and `--helpfull` (`--help` is answered before).
fn answer_builtin(which: Builtin) {
    match which {
        Builtin::Version => println!("mooncake_master version {}", env!("CARGO_PKG_VERSION")),
        Builtin::Help => {
            let usage = crate::usage::usage_of(&["master".to_owned()]).unwrap_or_default();
            println!("{usage}\n\n{}", super::master_flags::upstream_help());
        }
    }
}

/// `mooncake master`: the store's master, with upstream's gflags accepted.
pub fn master(raw: &[String]) -> Result<(), String> {
    if let Some(which) = super::master_flags::builtin(raw) {
        answer_builtin(which);
        return Ok(());
    }
    let translated = super::master_flags::translate(raw)?;
    let a = Args::parse_with_aliases(&translated, MASTER_ALIASES)?;
    let binds = binds(&a)?;
    let mut cfg = ServerConfig {
        bind: binds.rpc,
        metadata_bind: Some(binds.metadata),
        metrics_bind: Some(binds.metrics),
        rpc_port: a.get("rpc-port", 50051)?,
        metadata_port: metadata_port(&a)?,
        metrics_port: port_flag(&a, "metrics-port")?.unwrap_or(Some(9003)),
        cluster_secret: super::cluster_secret(&a)?,
        owner_key: a
            .str("owner-key-file")
            .map(|path| mooncake_base::auth::ClusterSecret::from_file_named(path, "owner key"))
            .transpose()
            .map_err(|e| format!("--owner-key-file: {e}"))?,
        ..ServerConfig::default()
    };
    if !a.switch("enable-metric-reporting")?.unwrap_or(true) {
        cfg.metrics_port = None;
    }
    let verify_mounts = a.switch("verify-mounts")?.unwrap_or(true);
    cfg.verify_mounts = match (verify_mounts, a.str("verify-metadata")) {
        (false, _) => VerifyMounts::Off,
        (true, Some(url)) if !url.is_empty() => VerifyMounts::Via(url.to_owned()),
        (true, _) => VerifyMounts::Auto,
    };
    let m = &mut cfg.master;
    let lease_ttl_ms: u64 = a.get("lease-ttl-ms", m.lease_ttl.as_millis() as u64)?;
    if lease_ttl_ms == 0 {
        // Every read would find its lease already expired.
        return Err("--lease-ttl-ms must be positive (a read holds its lease this long)".into());
    }
    m.lease_ttl = Duration::from_millis(lease_ttl_ms);
    m.eviction_high_watermark = a.get("eviction-high-watermark", m.eviction_high_watermark)?;
    m.eviction_ratio = a.get("eviction-ratio", m.eviction_ratio)?;
    let client_ttl: f64 = a.get("client-ttl", m.client_ttl.as_secs_f64())?;
    m.client_ttl = Duration::try_from_secs_f64(client_ttl)
        .map_err(|_| format!("--client-ttl: {client_ttl} is not a number of seconds >= 0"))?;
    m.max_segment_size = a.get("max-segment-size", m.max_segment_size)?;
    m.max_unfinished_put_ratio = a.get("max-unfinished-put-ratio", m.max_unfinished_put_ratio)?;
    m.put_start_discard_timeout = Duration::from_secs(a.get(
        "put-start-discard-timeout",
        m.put_start_discard_timeout.as_secs(),
    )?);
    m.put_start_release_timeout = Duration::from_secs(a.get(
        "put-start-release-timeout",
        m.put_start_release_timeout.as_secs(),
    )?);
    if let Some(s) = a.str("allocation-strategy") {
        m.allocation_strategy = AllocationStrategy::parse(s).ok_or_else(|| {
            format!("--allocation-strategy: {s:?} (random, free_ratio_first, local_first)")
        })?;
    }
    m.catalog_ack_timeout = Duration::from_millis(a.get(
        "catalog-ack-timeout-ms",
        m.catalog_ack_timeout.as_millis() as u64,
    )?);
    m.recovery_window = Duration::from_millis(a.get("recovery-window-ms", 2000)?);
    m.offload_on_evict = a.switch("offload-on-evict")?.unwrap_or(m.offload_on_evict);
    m.promotion_admission_threshold = a.get(
        "promotion-admission-threshold",
        m.promotion_admission_threshold,
    )?;
    if !a.switch("promotion-on-hit")?.unwrap_or(true) {
        m.promotion_admission_threshold = u32::MAX; // read back for the reader only
    }
    if a.str("root-fs-dir").is_some_and(|d| !d.is_empty()) {
        log::warn!("--root_fs_dir: here each node keeps its own disk tier; start nodes with --ssd-path DIR --ssd-size BYTES");
    }
    // Each put carries its own soft-pin TTL (ReplicateConfig, default 30 min).
    let soft_pin_ttl: u64 = a.get("default-soft-pin-ttl-ms", 1_800_000)?;
    if soft_pin_ttl != 1_800_000 {
        log::warn!("--default_kv_soft_pin_ttl: puts carry their own soft-pin TTL here (ReplicateConfig.soft_pin_ttl_ms)");
    }
    let until_eof = a.flag("until-stdin-eof")?;
    let ha = ha_settings(&a)?;
    // Upstream replicates metadata to standbys through an op log; here a new leader
    // gets the objects back from the nodes' catalogs. Either way, it needs HA.
    if a.flag("enable-oplog")? && ha.is_none() {
        return Err("--enable_oplog needs --enable_ha=true".into());
    }
    a.finish()?;
    if !(0.0..=1.0).contains(&cfg.master.eviction_high_watermark)
        || !(0.0..=1.0).contains(&cfg.master.eviction_ratio)
    {
        return Err("eviction ratios must lie in [0, 1]".into());
    }
    if !(0.0..=1.0).contains(&cfg.master.max_unfinished_put_ratio) {
        return Err("--max-unfinished-put-ratio must lie in [0, 1]".into());
    }
    // A standby waits here (a termination signal ends it as usual) until it leads.
    let leadership = match &ha {
        Some(ha) => Some(ha.campaign(&cfg)?),
        None => None,
    };
    if !until_eof {
        super::block_signals_for_wait();
    }
    let server = MasterServer::start(cfg).map_err(|e| e.to_string())?;
    // The ready line names where other hosts reach each server.
    let rpc = reachable(server.rpc_addr()).unwrap_or(server.rpc_addr());
    let mut line = format!("ready rpc={rpc}");
    if let Some(leader) = &leadership {
        leader
            .announce(&advertised_rpc(server.rpc_addr())?.to_string())
            .map_err(|e| format!("announcing this master in etcd: {e}"))?;
        line += &format!(" leader epoch={}", leader.epoch());
    }
    let fence = leadership.as_ref().map(watch_leadership);
    if let Some(url) = server.metadata_url() {
        line += &format!(" metadata={url}");
    }
    if let Some(addr) = server.admin_addr() {
        let addr = reachable(addr).unwrap_or(addr);
        line += &format!(" metrics=http://{addr}/metrics");
    }
    println!("{line}");
    let _ = std::io::stdout().flush();
    super::serve_until_done(until_eof);
    // Stepping down on purpose: stop serving, then give the lease back so a standby
    // takes over at once.
    if let Some(fence) = fence {
        fence.raise();
    }
    drop(server);
    if let Some(leader) = leadership {
        leader.resign();
    }
    Ok(())
}

/// `--enable-ha`: masters elect a leader through etcd (Mooncake's `--enable_ha`,
/// `--etcd_endpoints`, `--cluster_id`).
struct HaSettings {
    etcd: Arc<EtcdClient>,
    cluster_id: String,
    lease_ttl_s: i64,
}

fn ha_settings(a: &Args) -> Result<Option<HaSettings>, String> {
    let endpoints = a.str("etcd-endpoints").map(str::to_owned);
    let cluster_id = a.str("cluster-id").map(str::to_owned);
    let lease_ttl_s: i64 = a.get("ha-lease-ttl", ha::DEFAULT_LEASE_TTL_S)?;
    if !a.flag("enable-ha")? {
        return Ok(None);
    }
    let endpoints = endpoints.ok_or("--enable-ha needs --etcd-endpoints HOST:PORT[;HOST:PORT]")?;
    if !(1..=3600).contains(&lease_ttl_s) {
        return Err("--ha-lease-ttl must be 1..=3600 seconds".into());
    }
    let cluster_id = ha::cluster_id(cluster_id);
    let etcd = EtcdClient::new(&endpoints).map_err(|e| e.to_string())?;
    Ok(Some(HaSettings {
        etcd: Arc::new(etcd),
        cluster_id,
        lease_ttl_s,
    }))
}

impl HaSettings {
    /// Blocks until this master leads.
    fn campaign(&self, cfg: &ServerConfig) -> Result<ha::Leadership, String> {
        let planned = advertised_rpc(SocketAddr::new(cfg.bind, cfg.rpc_port))?.to_string();
        eprintln!(
            "campaigning to lead cluster {:?} (etcd {}); standing by while another leads",
            self.cluster_id,
            self.etcd.describe()
        );
        let never = ha::StopSignal::new();
        ha::campaign(
            self.etcd.clone(),
            &self.cluster_id,
            &planned,
            self.lease_ttl_s,
            &never,
        )
        .map_err(|e| format!("leader election: {e}"))
    }
}

/// The RPC address a leader publishes in etcd: never a wildcard, nor (bound to all
/// interfaces) a loopback address, which clients on other hosts could not reach.
fn advertised_rpc(bound: SocketAddr) -> Result<SocketAddr, String> {
    reachable(bound).ok_or_else(|| {
        format!(
            "this master listens on {} and this host has no default route to take its \
             address from; give --rpc_address (or --rpc_interface, --bind) the address \
             other hosts reach it at",
            bound.ip()
        )
    })
}

/// Fencing: a master that loses its lease stops at once (its supervisor restarts it
/// as a standby), so two masters never both act as leader. Raise the returned signal
/// before stepping down on purpose.
fn watch_leadership(leader: &ha::Leadership) -> Arc<ha::StopSignal> {
    let current = leader.current_flag();
    let done = ha::StopSignal::new();
    let quiet = done.clone();
    let spawned = std::thread::Builder::new()
        .name("mc-ha-fence".into())
        .spawn(move || {
            while current.load(Ordering::SeqCst) {
                if quiet.wait(Duration::from_millis(100)) {
                    return;
                }
            }
            if !quiet.is_raised() {
                log::error!("lost the master lease: stopping so that the new leader alone serves");
                std::process::exit(3);
            }
        });
    if let Err(e) = spawned {
        log::error!("cannot watch the master lease ({e}); stopping");
        std::process::exit(3);
    }
    done
}

/// `mooncake node`: a store node lending memory (and a disk tier) to a master.
pub fn node(raw: &[String]) -> Result<(), String> {
    let a = Args::parse(raw)?;
    let size = match a.str("segment-size") {
        None => return Err("--segment-size is required: the bytes this node lends to the pool (e.g. --segment-size 4G)".into()),
        Some(_) => a.get::<u64>("segment-size", 0)?,
    };
    check_segment_size(size, physical_memory())?;
    let mut cfg = client_config(&a)?;
    cfg.disk = disk_tier(&a)?;
    let until_eof = a.flag("until-stdin-eof")?;
    a.finish()?;
    metadata_from_master(&a, &mut cfg)?;
    if !until_eof {
        super::block_signals_for_wait();
    }
    let client = Client::new(cfg).map_err(|e| e.to_string())?;
    println!("ready {}", client.hostname());
    let _ = std::io::stdout().flush();
    // A node drained as the master asked (its admin port) lends nothing any more: it
    // leaves rather than stay alive idle.
    super::serve_until_done_or(until_eof, || client.is_drained());
    if client.is_drained() {
        eprintln!("drained as the master asked; leaving");
        return Ok(());
    }
    // An orderly exit (SIGTERM, SIGINT, end of stdin) drains first; SIGKILL cannot.
    match client.drain() {
        Ok(r) => eprintln!(
            "drained: {} objects moved to other nodes, {} had replicas elsewhere, {} lost",
            r.moved, r.safe_elsewhere, r.lost
        ),
        Err(e) => eprintln!("drain failed ({e}); objects only this node held are gone"),
    }
    Ok(())
}

/// A node's disk tier: `--ssd-path DIR --ssd-size BYTES` (both or neither).
fn disk_tier(a: &Args) -> Result<Option<mooncake_store::disk::DiskConfig>, String> {
    match (a.str("ssd-path"), a.str("ssd-size")) {
        (None, None) => Ok(None),
        (Some(dir), Some(_)) if !dir.is_empty() => {
            let quota: u64 = a.get("ssd-size", 0)?;
            if quota < (4 << 20) {
                return Err(
                    "--ssd-size must be at least 4M (the bytes of disk the tier may use)".into(),
                );
            }
            Ok(Some(mooncake_store::disk::DiskConfig::new(dir, quota)))
        }
        _ => Err("a disk tier needs both --ssd-path DIR and --ssd-size BYTES".into()),
    }
}

/// When no `--metadata` was given, asks the master which metadata server its nodes use
/// (its embedded one, whatever its port) and sets it in `cfg`.
pub fn metadata_from_master(a: &Args, cfg: &mut ClientConfig) -> Result<(), String> {
    if a.str("metadata").is_some() {
        return Ok(());
    }
    let secret = cfg.engine.cluster_secret.as_ref();
    let metadata = mooncake_store::metadata_of_master(&cfg.master_address, secret)
        .map_err(|e| format!("no --metadata given, and asking the master failed: {e}"))?;
    cfg.engine
        .set("metadata", &metadata)
        .map_err(|e| e.to_string())
}

/// Client settings shared by `node`, `replay` and `bench store` (without `--metadata`,
/// call `metadata_from_master` once the flags are checked).
pub fn client_config(a: &Args) -> Result<ClientConfig, String> {
    let mut cfg = ClientConfig {
        master_address: a.str("master").unwrap_or("127.0.0.1:50051").to_owned(),
        global_segment_size: a.get("segment-size", 0u64)?,
        engine: super::engine_config(a)?,
        ..ClientConfig::default()
    };
    if a.str("metadata").is_none() {
        // A placeholder until `metadata_from_master` asks (after the flags are checked).
        let metadata = mooncake_store::default_metadata(&cfg.master_address);
        cfg.engine
            .set("metadata", &metadata)
            .map_err(|e| e.to_string())?;
    }
    if let Some(on) = a.switch("verify-checksum")? {
        cfg.verify_checksum = on;
    }
    if let Some(on) = a.switch("replica-cache")? {
        cfg.cache_replicas = on;
    }
    if let Some(on) = a.switch("prefault-segment")? {
        cfg.prefault_segment = on;
    }
    Ok(cfg)
}

/// This machine's physical memory in bytes, when the system says.
fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf only reads system configuration.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let (pages, page) = (u64::try_from(pages).ok()?, u64::try_from(page).ok()?);
    pages.checked_mul(page).filter(|&b| b > 0)
}

/// A node's `--segment-size`: positive, and no more than the machine's memory.
fn check_segment_size(size: u64, physical: Option<u64>) -> Result<(), String> {
    if size == 0 {
        return Err(
            "--segment-size must be positive (the bytes this node lends to the pool)".into(),
        );
    }
    match physical {
        Some(total) if size > total => Err(format!(
            "--segment-size {size} bytes ({}) is more than this machine's {total} bytes ({}) of memory",
            human(size),
            human(total)
        )),
        _ => Ok(()),
    }
}

/// Bytes in the largest binary unit that keeps a number of at least 1 (`24.0 GiB`).
fn human(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    match i {
        0 => format!("{bytes} B"),
        _ => format!("{v:.1} {}", units[i]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(v: &[&str]) -> Args {
        let raw: Vec<String> = v.iter().map(|s| s.to_string()).collect();
        Args::parse_with_aliases(
            &super::super::master_flags::translate(&raw).unwrap(),
            MASTER_ALIASES,
        )
        .unwrap()
    }

    #[test]
    fn the_master_listens_on_all_interfaces_unless_told() {
        let any = IpAddr::from([0, 0, 0, 0]);
        let binds_of = |v: &[&str]| binds(&parsed(v));
        let all = |ip| Binds {
            rpc: ip,
            metadata: ip,
            metrics: ip,
        };
        assert_eq!(binds_of(&[]).unwrap(), all(any));
        let lo = IpAddr::from([127, 0, 0, 1]);
        assert_eq!(binds_of(&["--bind", "127.0.0.1"]).unwrap(), all(lo));
        let named = binds_of(&["--bind", "localhost"]).unwrap();
        assert!(named.rpc.is_loopback(), "{named:?}");
        // Upstream's flags set one server each.
        let b = binds_of(&[
            "--rpc_address=127.0.0.2",
            "--http_metadata_server_host=127.0.0.3",
            "--metrics_host=::1",
        ])
        .unwrap();
        assert_eq!(b.rpc, IpAddr::from([127, 0, 0, 2]));
        assert_eq!(b.metadata, IpAddr::from([127, 0, 0, 3]));
        assert_eq!(b.metrics, "::1".parse::<IpAddr>().unwrap());
        // An interface's IPv4 address overrides --rpc_address.
        let b = binds_of(&["--rpc_address=127.0.0.2", "--rpc_interface=lo"]).unwrap();
        assert_eq!(b.rpc, lo);
        assert_eq!(b.metrics, any);
        let e = binds_of(&["--rpc_interface=mc-no-such-if0"]).unwrap_err();
        assert!(e.contains("--rpc_interface mc-no-such-if0"), "{e}");
        let e = binds_of(&["--metrics_host=no such host"]).unwrap_err();
        assert!(e.contains("--metrics_host"), "{e}");
    }

    #[test]
    fn the_metadata_server_runs_only_when_asked() {
        let port_of = |v: &[&str]| metadata_port(&parsed(v));
        assert_eq!(port_of(&[]).unwrap(), None);
        // Upstream's port alone starts nothing; enabled, it starts on 8080 or that port.
        assert_eq!(
            port_of(&["--http_metadata_server_port=9000"]).unwrap(),
            None
        );
        assert_eq!(
            port_of(&["--enable_http_metadata_server"]).unwrap(),
            Some(8080)
        );
        let on_9000 = [
            "--enable_http_metadata_server=true",
            "--http_metadata_server_port=9000",
        ];
        assert_eq!(port_of(&on_9000).unwrap(), Some(9000));
        // Ours: a port starts one there; off or a disabling flag starts none.
        assert_eq!(port_of(&["--metadata-port", "0"]).unwrap(), Some(0));
        assert_eq!(port_of(&["--metadata-port", "off"]).unwrap(), None);
        let disabled = [
            "--metadata-port",
            "7000",
            "--enable_http_metadata_server=false",
        ];
        assert_eq!(port_of(&disabled).unwrap(), None);
        let both = ["--enable-http-metadata-server", "--metadata-port", "7000"];
        assert_eq!(port_of(&both).unwrap(), Some(7000));
        let e = port_of(&["--enable_http_metadata_server", "--metadata-port", "off"]).unwrap_err();
        assert!(e.contains("contradict"), "{e}");
    }

    #[test]
    fn a_leader_never_publishes_a_wildcard() {
        let lo: SocketAddr = "127.0.0.1:50051".parse().unwrap();
        assert_eq!(advertised_rpc(lo).unwrap(), lo);
        // Bound to all interfaces: the default route's address, when the host has one.
        let any: SocketAddr = "0.0.0.0:50051".parse().unwrap();
        match advertised_rpc(any) {
            Ok(addr) => {
                assert!(
                    !addr.ip().is_unspecified() && !addr.ip().is_loopback(),
                    "{addr}"
                );
                assert_eq!(addr.port(), 50051);
            }
            Err(e) => assert!(e.contains("--rpc_address"), "{e}"),
        }
    }

    #[test]
    fn segment_size_must_be_positive_and_fit_in_memory() {
        let gib24 = 24u64 << 30;
        assert!(check_segment_size(1 << 30, Some(gib24)).is_ok());
        assert!(check_segment_size(gib24, Some(gib24)).is_ok());
        assert!(check_segment_size(1 << 40, None).is_ok());
        let e = check_segment_size(0, Some(gib24)).unwrap_err();
        assert!(e.contains("--segment-size must be positive"), "{e}");
        let e = check_segment_size(1 << 40, Some(gib24)).unwrap_err();
        assert!(e.contains("1099511627776 bytes (1.0 TiB)"), "{e}");
        assert!(e.contains("25769803776 bytes (24.0 GiB)"), "{e}");
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 29), "1.5 GiB");
    }
}
