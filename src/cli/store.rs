//! `mooncake master` and `mooncake node`.

use std::io::Write;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::args::Args;
use mooncake::etcd::EtcdClient;
use mooncake::store::ha;
use mooncake::store::master::AllocationStrategy;
use mooncake::store::{Client, ClientConfig, MasterServer, ServerConfig};

/// Mooncake's `mooncake_master` flag names, accepted as aliases of ours.
const MASTER_ALIASES: &[(&str, &str)] = &[
    ("http-metadata-server-port", "metadata-port"),
    ("default-kv-lease-ttl", "lease-ttl-ms"),
    ("eviction-high-watermark-ratio", "eviction-high-watermark"),
    ("rpc-address", "bind"),
];

/// A port flag: a number (0 picks a free port) or "off".
fn port_flag(a: &Args, key: &str, default: u16) -> Result<Option<u16>, String> {
    match a.str(key) {
        Some("off" | "none") => Ok(None),
        _ => a.get(key, default).map(Some),
    }
}

pub fn master(raw: &[String]) -> Result<(), String> {
    let translated = super::master_flags::translate(raw)?;
    let a = Args::parse_with_aliases(&translated, MASTER_ALIASES)?;
    let mut cfg = ServerConfig {
        bind: a.get("bind", IpAddr::from([127, 0, 0, 1]))?,
        rpc_port: a.get("rpc-port", 50051)?,
        metadata_port: port_flag(&a, "metadata-port", 8080)?,
        metrics_port: port_flag(&a, "metrics-port", 9003)?,
        cluster_secret: super::cluster_secret(&a)?,
        ..ServerConfig::default()
    };
    if !a.get("enable-http-metadata-server", true)? {
        cfg.metadata_port = None;
    }
    if !a.get("enable-metric-reporting", true)? {
        cfg.metrics_port = None;
    }
    let m = &mut cfg.master;
    let lease_ttl_ms: u64 = a.get("lease-ttl-ms", m.lease_ttl.as_millis() as u64)?;
    if lease_ttl_ms == 0 {
        // Every read would find its lease already expired.
        return Err("--lease-ttl-ms must be positive (a read holds its lease this long)".into());
    }
    m.lease_ttl = Duration::from_millis(lease_ttl_ms);
    m.eviction_high_watermark = a.get("eviction-high-watermark", m.eviction_high_watermark)?;
    m.eviction_ratio = a.get("eviction-ratio", m.eviction_ratio)?;
    m.client_ttl = Duration::from_secs_f64(a.get("client-ttl", m.client_ttl.as_secs_f64())?);
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
    m.offload_on_evict = a.get("offload-on-evict", m.offload_on_evict)?;
    m.promotion_admission_threshold = a.get(
        "promotion-admission-threshold",
        m.promotion_admission_threshold,
    )?;
    if !a.get("promotion-on-hit", true)? {
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
    let until_eof = a.flag("until-stdin-eof");
    let ha = ha_settings(&a)?;
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
    let mut line = format!("ready rpc={}", server.rpc_addr());
    if let Some(leader) = &leadership {
        leader
            .announce(&server.rpc_addr().to_string())
            .map_err(|e| format!("announcing this master in etcd: {e}"))?;
        line += &format!(" leader epoch={}", leader.epoch());
    }
    let fence = leadership.as_ref().map(watch_leadership);
    if let Some(url) = server.metadata_url() {
        line += &format!(" metadata={url}");
    }
    if let Some(addr) = server.admin_addr() {
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
    if !a.flag("enable-ha") {
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
        let planned = format!("{}:{}", cfg.bind, cfg.rpc_port);
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

pub fn node(raw: &[String]) -> Result<(), String> {
    let a = Args::parse(raw)?;
    let size = match a.str("segment-size") {
        None => return Err("--segment-size is required: the bytes this node lends to the pool (e.g. --segment-size 4G)".into()),
        Some(_) => a.get::<u64>("segment-size", 0)?,
    };
    check_segment_size(size, physical_memory())?;
    let mut cfg = client_config(&a)?;
    cfg.disk = disk_tier(&a)?;
    let until_eof = a.flag("until-stdin-eof");
    a.finish()?;
    metadata_from_master(&a, &mut cfg)?;
    if !until_eof {
        super::block_signals_for_wait();
    }
    let client = Client::new(cfg).map_err(|e| e.to_string())?;
    println!("ready {}", client.hostname());
    let _ = std::io::stdout().flush();
    super::serve_until_done(until_eof);
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
fn disk_tier(a: &Args) -> Result<Option<mooncake::store::disk::DiskConfig>, String> {
    match (a.str("ssd-path"), a.str("ssd-size")) {
        (None, None) => Ok(None),
        (Some(dir), Some(_)) if !dir.is_empty() => {
            let quota: u64 = a.get("ssd-size", 0)?;
            if quota < (4 << 20) {
                return Err(
                    "--ssd-size must be at least 4M (the bytes of disk the tier may use)".into(),
                );
            }
            Ok(Some(mooncake::store::disk::DiskConfig::new(dir, quota)))
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
    let metadata = mooncake::store::metadata_of_master(&cfg.master_address, secret)
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
        let metadata = mooncake::store::default_metadata(&cfg.master_address);
        cfg.engine
            .set("metadata", &metadata)
            .map_err(|e| e.to_string())?;
    }
    if let Some(v) = a.str("verify-checksum") {
        cfg.verify_checksum = v != "false" && v != "0";
    }
    if let Some(v) = a.str("replica-cache") {
        cfg.cache_replicas = v != "false" && v != "0";
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
