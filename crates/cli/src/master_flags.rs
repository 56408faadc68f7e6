//! Upstream `mooncake_master`'s command line, so launch scripts written for it work:
//! every flag name its master.cpp defines is accepted, plus the glog flags launch
//! scripts pass and gflags' own conventions (`--f=v`, `--f v`, `-f`, bare and `--nof`
//! booleans, `--flagfile=PATH`, `--version`, `--helpfull`); `--config_path` takes the
//! same keys as JSON. Each value is checked as upstream checks it (its type, the
//! duration and ratio validators); one asking for a feature this build lacks fails
//! with a message naming it; anything else passes through to our own flags, whose
//! parser refuses unknown names.

use mooncake_base::json::Value;
use Action::{Inert, Lacking, Logging, Noted, Ours};
use Kind::{Bool, Choice, Str, F64, I32, I64, U32, U64};

/// The type of an upstream flag's value, checked as gflags checks it.
#[derive(Clone, Copy)]
enum Kind {
    Bool,
    I32,
    I64,
    U32,
    U64,
    F64,
    Str,
    /// A string from a fixed set.
    Choice(&'static [&'static str]),
}

/// Converts a checked value to the value of our flag, or says why it is refused.
type Convert = fn(&str) -> Result<String, String>;
/// Checks a value beyond its type (upstream's validators).
type Check = fn(&str) -> Result<(), String>;

/// What an upstream flag becomes here.
#[derive(Clone, Copy)]
enum Action {
    /// Our flag of this name, its value converted.
    Ours(&'static str, Convert),
    /// Accepted without effect once checked: tuning of upstream internals we do not have.
    Inert(Check),
    /// As `Inert`, with a warning saying what happens here instead.
    Noted(Check, &'static str),
    /// Refused when the value asks for the feature named.
    Lacking(&'static str, fn(&str) -> bool),
    /// glog's verbosity, described: applied when logging starts (`log_level`).
    Logging(&'static str),
}

struct Flag {
    name: &'static str,
    kind: Kind,
    action: Action,
}

const fn flag(name: &'static str, kind: Kind, action: Action) -> Flag {
    Flag { name, kind, action }
}

fn same(v: &str) -> Result<String, String> {
    Ok(v.to_owned())
}

fn any(_: &str) -> Result<(), String> {
    Ok(())
}

/// A duration as upstream writes one: a whole number of milliseconds, or one with an
/// `ms`, `s`, `m` or `h` unit (any case); converted to milliseconds.
fn millis(v: &str) -> Result<String, String> {
    let v = v.trim();
    let digits = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (number, unit) = v.split_at(digits);
    let n: u64 = number.parse().map_err(|_| {
        format!("{v:?} is not a duration: a whole number, then ms, s, m or h (e.g. 5000, 5s)")
    })?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        other => {
            return Err(format!(
                "{v:?}: the unit {other:?} is not one of ms, s, m, h"
            ))
        }
    };
    n.checked_mul(scale)
        .map(|ms| ms.to_string())
        .ok_or_else(|| format!("{v:?} is too long a duration"))
}

fn duration(v: &str) -> Result<(), String> {
    millis(v).map(drop)
}

/// A share in [0, 1] (upstream's ratio validators).
fn ratio(v: &str) -> Result<(), String> {
    match v.trim().parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(()),
        _ => Err(format!("{v:?} must lie between 0.0 and 1.0")),
    }
}

fn ratio_value(v: &str) -> Result<String, String> {
    ratio(v).map(|()| v.trim().to_owned())
}

/// Upstream bounds the offloading queue to keep its offload-cap arithmetic in range.
fn offloading_queue_limit(v: &str) -> Result<(), String> {
    match v.parse::<u64>() {
        Ok(1..=100_000_000) => Ok(()),
        _ => Err(format!("{v:?} must be between 1 and 100000000")),
    }
}

/// A port, or (ours) `off` for a server not to start.
fn port(v: &str) -> Result<String, String> {
    match v.trim() {
        off @ ("off" | "none") => Ok(off.to_owned()),
        p => p
            .parse::<u16>()
            .map(|p| p.to_string())
            .map_err(|_| format!("{v:?} is not a port (0-65535, or off)")),
    }
}

fn allocation_strategy(v: &str) -> Result<String, String> {
    match v {
        "cxl" | "ssd_free_ratio_first" => Err(format!(
            "the {v} allocation strategy is not available in this build \
             (random, free_ratio_first, local_first are)"
        )),
        _ => Ok(v.to_owned()),
    }
}

/// gflags' spellings of a boolean.
fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "t" | "yes" | "y" | "1" => Some(true),
        "false" | "f" | "no" | "n" | "0" => Some(false),
        _ => None,
    }
}

fn truthy(v: &str) -> bool {
    parse_bool(v) == Some(true)
}

fn falsy(v: &str) -> bool {
    parse_bool(v) == Some(false)
}

fn not_etcd(v: &str) -> bool {
    !v.trim().is_empty() && !v.trim().eq_ignore_ascii_case("etcd")
}

fn not_off(v: &str) -> bool {
    v != "off"
}

/// Checks `value` against `kind`; booleans come back as `true` or `false`.
fn check_kind(kind: Kind, value: &str) -> Result<String, String> {
    let v = value.trim();
    let ok = match kind {
        Kind::Bool => {
            return parse_bool(v)
                .map(|b| b.to_string())
                .ok_or_else(|| format!("{value:?} is not a boolean (true or false)"))
        }
        Kind::I32 => v.parse::<i32>().is_ok(),
        Kind::I64 => v.parse::<i64>().is_ok(),
        Kind::U32 => v.parse::<u32>().is_ok(),
        Kind::U64 => v.parse::<u64>().is_ok(),
        Kind::F64 => v.parse::<f64>().is_ok_and(f64::is_finite),
        Kind::Str => true,
        Kind::Choice(choices) => {
            if !choices.contains(&v) {
                return Err(format!("{value:?} is not one of {}", choices.join(", ")));
            }
            true
        }
    };
    match ok {
        true => Ok(value.to_owned()),
        false => Err(format!("{value:?} is not {}", kind_name(kind))),
    }
}

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::I32 | Kind::I64 => "an integer",
        Kind::U32 | Kind::U64 => "a non-negative integer",
        Kind::F64 => "a number",
        Kind::Bool => "a boolean",
        Kind::Str | Kind::Choice(_) => "a string",
    }
}

const STRATEGIES: &[&str] = &[
    "random",
    "free_ratio_first",
    "cxl",
    "ssd_free_ratio_first",
    "local_first",
];
const REPLICATION_MODES: &[&str] = &["off", "observe", "enforce"];
const DYNAMIC_REPLICAS: &str = "dynamic memory replication (observe or enforce)";
const PINS_EVICTED_LAST: &str =
    "keeping soft-pinned objects from eviction (here they are evicted after all others)";
const NO_SOFT_PIN_CAP: &str = "a put's own soft-pin TTL is not capped here";

const FLAGS: &[Flag] = &[
    // Where the servers listen.
    flag("rpc_port", Str, Ours("rpc-port", port)),
    flag("port", Str, Ours("rpc-port", port)),
    flag("rpc_address", Str, Ours("rpc-bind", same)),
    flag("rpc_interface", Str, Ours("rpc-interface", same)),
    flag("max_threads", I32, Inert(any)),
    flag("rpc_thread_num", I32, Inert(any)),
    flag("rpc_conn_timeout_seconds", I32, Inert(any)),
    flag("rpc_enable_tcp_no_delay", Bool, Inert(any)),
    flag(
        "enable_metric_reporting",
        Bool,
        Ours("enable-metric-reporting", same),
    ),
    flag("metrics_port", Str, Ours("metrics-port", port)),
    flag("metrics_host", Str, Ours("metrics-bind", same)),
    flag(
        "enable_http_metadata_server",
        Bool,
        Ours("enable-http-metadata-server", same),
    ),
    flag(
        "http_metadata_server_port",
        Str,
        Ours("http-metadata-server-port", port),
    ),
    flag(
        "http_metadata_server_host",
        Str,
        Ours("metadata-bind", same),
    ),
    flag("enable_metadata_cleanup_on_timeout", Bool, Inert(any)),
    // Leases, pins and eviction.
    flag("default_kv_lease_ttl", Str, Ours("lease-ttl-ms", millis)),
    flag(
        "default_kv_soft_pin_ttl",
        Str,
        Ours("default-soft-pin-ttl-ms", millis),
    ),
    flag("max_kv_soft_pin_ttl", Str, Noted(duration, NO_SOFT_PIN_CAP)),
    flag(
        "allow_evict_soft_pinned_objects",
        Bool,
        Lacking(PINS_EVICTED_LAST, falsy),
    ),
    flag("eviction_ratio", F64, Ours("eviction-ratio", ratio_value)),
    flag(
        "eviction_high_watermark_ratio",
        F64,
        Ours("eviction-high-watermark", ratio_value),
    ),
    flag("nof_eviction_ratio", F64, Inert(ratio)),
    flag("nof_eviction_high_watermark_ratio", F64, Inert(any)),
    flag(
        "put_start_discard_timeout_sec",
        U64,
        Ours("put-start-discard-timeout", same),
    ),
    flag(
        "put_start_release_timeout_sec",
        U64,
        Ours("put-start-release-timeout", same),
    ),
    flag("client_ttl", I64, Ours("client-ttl", same)),
    flag(
        "memory_allocator",
        Choice(&["offset", "cachelib"]),
        Inert(any),
    ),
    flag(
        "allocation_strategy",
        Choice(STRATEGIES),
        Ours("allocation-strategy", allocation_strategy),
    ),
    // High availability.
    flag("enable_ha", Bool, Ours("enable-ha", same)),
    flag("etcd_endpoints", Str, Ours("etcd-endpoints", same)),
    flag(
        "ha_backend_type",
        Str,
        Lacking("an HA backend other than etcd", not_etcd),
    ),
    flag("ha_backend_connstring", Str, Ours("etcd-endpoints", same)),
    flag("cluster_id", Str, Ours("cluster-id", same)),
    // A new leader gets the objects back from the nodes' catalogs: what upstream's
    // op log replicates to standbys, without one.
    flag("enable_oplog", Bool, Ours("enable-oplog", same)),
    flag("oplog_poll_interval_ms", I32, Inert(any)),
    flag("oplog_batch_max_entries", U32, Inert(any)),
    flag("batch_oplog_retry_timeout_sec", U32, Inert(any)),
    flag("pod_name", Str, Inert(any)),
    flag("pod_namespace", Str, Inert(any)),
    // The disk tier: offload on eviction, promotion on reads.
    flag("enable_offload", Bool, Ours("offload-on-evict", same)),
    flag("offload_on_evict", Bool, Ours("offload-on-evict", same)),
    flag("offload_force_evict", Bool, Inert(any)),
    flag("offloading_queue_limit", U64, Inert(offloading_queue_limit)),
    flag("offload_cap_ratio", F64, Inert(ratio)),
    flag("promotion_on_hit", Bool, Ours("promotion-on-hit", same)),
    flag(
        "promotion_admission_threshold",
        U32,
        Ours("promotion-admission-threshold", same),
    ),
    flag("promotion_queue_limit", U32, Inert(any)),
    flag("promotion_max_per_heartbeat", U32, Inert(any)),
    flag("root_fs_dir", Str, Ours("root-fs-dir", same)),
    flag("global_file_segment_size", I64, Inert(any)),
    flag("enable_disk_eviction", Bool, Inert(any)),
    flag("quota_bytes", U64, Inert(any)),
    // NVMe-oF segments (not in this build: their tuning has nothing to tune).
    flag("nof_heartbeat_interval_sec", I64, Inert(any)),
    flag("nof_heartbeat_probe_timeout_ms", U32, Inert(any)),
    flag("nof_heartbeat_failures_threshold", U32, Inert(any)),
    // Dynamic replication, KV events, tenants, CXL, snapshots: refused when switched on.
    flag(
        "dynamic_replication_mode",
        Choice(REPLICATION_MODES),
        Lacking(DYNAMIC_REPLICAS, not_off),
    ),
    flag("dynamic_replication_heat_window_seconds", U32, Inert(any)),
    flag(
        "dynamic_replication_admission_qps_threshold",
        F64,
        Inert(any),
    ),
    flag("dynamic_replication_max_memory_replicas", U64, Inert(any)),
    flag(
        "enable_kv_events",
        Bool,
        Lacking("the KV cache event publisher", truthy),
    ),
    flag("kv_events_bind_endpoint", Str, Inert(any)),
    flag("kv_events_model_name", Str, Inert(any)),
    flag("kv_events_backend_id", Str, Inert(any)),
    flag("kv_events_tenant_id", Str, Inert(any)),
    flag("kv_events_additional_salt", Str, Inert(any)),
    flag("kv_events_lora_name", Str, Inert(any)),
    flag("kv_events_block_size", U32, Inert(any)),
    flag("kv_events_dp_rank", U32, Inert(any)),
    flag("kv_events_emit_legacy_compat", Bool, Inert(any)),
    flag("kv_events_emit_object_key", Bool, Inert(any)),
    flag("kv_events_queue_capacity", U32, Inert(any)),
    flag(
        "enable_multi_tenants",
        Bool,
        Lacking("multi-tenant namespaces and quotas", truthy),
    ),
    flag("tenant_quota_connector_type", Str, Inert(any)),
    flag("tenant_quota_connector_uri", Str, Inert(any)),
    flag("enable_cxl", Bool, Lacking("CXL memory", truthy)),
    flag("cxl_path", Str, Inert(any)),
    flag("cxl_size", U64, Inert(any)),
    flag(
        "enable_snapshot",
        Bool,
        Lacking("metadata snapshots", truthy),
    ),
    flag(
        "enable_snapshot_restore",
        Bool,
        Lacking("snapshot restore", truthy),
    ),
    flag("snapshot_backup_dir", Str, Inert(any)),
    flag("snapshot_interval_seconds", U64, Inert(any)),
    flag("snapshot_child_timeout_seconds", U64, Inert(any)),
    flag("snapshot_retention_count", U32, Inert(any)),
    flag("snapshot_object_store_type", Str, Inert(any)),
    flag("snapshot_catalog_store_type", Str, Inert(any)),
    flag("snapshot_catalog_store_connstring", Str, Inert(any)),
    flag("snapshot_payload_store_type", Str, Inert(any)),
    flag("snapshot_payload_backend_type", Str, Inert(any)),
    flag("snapshot_catalog_backend_type", Str, Inert(any)),
    flag("snapshot_catalog_backend_connstring", Str, Inert(any)),
    // The task manager (upstream's queue of offload and replica tasks).
    flag("max_total_finished_tasks", U32, Inert(any)),
    flag("max_total_pending_tasks", U32, Inert(any)),
    flag("max_total_processing_tasks", U32, Inert(any)),
    flag("pending_task_timeout_sec", U64, Inert(any)),
    flag("processing_task_timeout_sec", U64, Inert(any)),
    flag("max_retry_attempts", U32, Inert(any)),
    flag("config_path", Str, Inert(any)),
    // Not the master's, but engines' launch scripts pass it to every process.
    flag("enable_gc", Bool, Inert(any)),
    // glog's: we always log to standard error.
    flag("v", I32, Logging("log level: 1 debug, 2 and more trace")),
    flag(
        "minloglevel",
        I32,
        Logging("log level: 0 info, 1 warn, 2 error"),
    ),
    flag("vmodule", Str, Inert(any)),
    flag("logtostderr", Bool, Inert(any)),
    flag("alsologtostderr", Bool, Inert(any)),
    flag("colorlogtostderr", Bool, Inert(any)),
    flag("stderrthreshold", I32, Inert(any)),
    flag(
        "log_dir",
        Str,
        Noted(any, "logs go to standard error here (RUST_LOG, -v)"),
    ),
    // Ours, so a `--config_path` file may name them too.
    flag(
        "cluster_secret_file",
        Str,
        Ours("cluster-secret-file", same),
    ),
    flag("owner_key_file", Str, Ours("owner-key-file", same)),
    flag(
        "max_unfinished_put_ratio",
        F64,
        Ours("max-unfinished-put-ratio", ratio_value),
    ),
];

fn upstream(name: &str) -> Option<&'static Flag> {
    FLAGS.iter().find(|f| f.name == name)
}

/// gflags' own flags that answer instead of running the master.
#[derive(Debug, PartialEq, Eq)]
pub enum Builtin {
    /// `--version`: print the version.
    Version,
    /// `--help` and its spellings: print the flags.
    Help,
}

/// `--version` or `--helpfull` (any spelling gflags takes), if the command line asks.
pub fn builtin(raw: &[String]) -> Option<Builtin> {
    raw.iter()
        .filter(|a| a.starts_with('-'))
        .find_map(|a| match a.trim_start_matches('-') {
            "version" => Some(Builtin::Version),
            "help" | "helpfull" | "helpshort" => Some(Builtin::Help),
            _ => None,
        })
}

/// The `--helpfull` table: each upstream flag and what it does here.
pub fn upstream_help() -> String {
    let mut out = String::from(
        "Upstream mooncake_master flags (gflags syntax; --flagfile=PATH, --config_path=JSON):\n",
    );
    for f in FLAGS {
        let what = match f.action {
            Ours(ours, _) => format!("as our --{ours}"),
            Inert(_) => "accepted, no effect here".to_owned(),
            Noted(_, note) => format!("accepted: {note}"),
            Lacking(feature, _) => format!("refused when asking for {feature}"),
            Logging(what) => what.to_owned(),
        };
        out += &format!("  --{:<44} {what}\n", f.name);
    }
    out
}

/// One `name=value` from the command line, in the order given.
type Setting = (String, String);

/// Files may name further files this deep.
const FLAGFILE_DEPTH: usize = 8;

/// gflags' `--flagfile=PATH`: the file's lines (`--flag=value`; blank lines and `#`
/// comments skipped) stand where it was named.
fn expand_flagfiles(raw: &[String], depth: usize) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut it = raw.iter();
    while let Some(arg) = it.next() {
        let path = match arg.trim_start_matches('-') {
            "flagfile" if arg.starts_with('-') => {
                it.next().ok_or("--flagfile needs a path")?.clone()
            }
            body => match body.strip_prefix("flagfile=") {
                Some(p) if arg.starts_with('-') => p.to_owned(),
                _ => {
                    out.push(arg.clone());
                    continue;
                }
            },
        };
        if depth == 0 {
            return Err(format!(
                "--flagfile {path}: flag files nested more than {FLAGFILE_DEPTH} deep"
            ));
        }
        out.extend(expand_flagfiles(&flagfile_lines(&path)?, depth - 1)?);
    }
    Ok(out)
}

fn flagfile_lines(path: &str) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("--flagfile {path}: {e}"))?;
    let mut lines = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if !line.starts_with('-') {
            // The line itself is not echoed: the path may name a file the caller cannot
            // otherwise read.
            return Err(format!(
                "--flagfile {path} line {}: only --flag=value lines are supported (not \
                 lines naming programs)",
                n + 1
            ));
        }
        lines.push(line.to_owned());
    }
    Ok(lines)
}

/// The command line with every `--flagfile` replaced by its lines, read once: `main` calls
/// this before logging and `translate` look at the flags (a one-shot source such as
/// `/dev/stdin` could not be read twice).
pub fn with_flagfiles_expanded(raw: &[String]) -> Result<Vec<String>, String> {
    expand_flagfiles(raw, FLAGFILE_DEPTH)
}

/// Splits the command line into upstream settings and the rest (our own flags).
fn split(raw: &[String]) -> Result<(Vec<Setting>, Vec<String>), String> {
    let mut settings = Vec::new();
    let mut ours = Vec::new();
    let mut it = raw.iter().peekable();
    while let Some(arg) = it.next() {
        if !arg.starts_with('-') {
            // gflags would leave a stray word as an ignored positional argument, which
            // hides a mistake such as `--rpc_port 7000 8000`.
            return Err(format!(
                "unexpected argument {arg:?} (flags are --name=value)"
            ));
        }
        let body = arg.trim_start_matches('-');
        let (name, value) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v.to_owned())),
            None => (body, None),
        };
        let negated = name
            .strip_prefix("no")
            .and_then(upstream)
            .filter(|f| matches!(f.kind, Kind::Bool));
        let Some(f) = upstream(name).or(negated) else {
            ours.push(arg.clone());
            if value.is_none() && !super::args::SWITCHES.contains(&name) {
                // `--ours value`: keep the value with its flag.
                if let Some(v) = it.next() {
                    ours.push(v.clone());
                }
            }
            continue;
        };
        let is_bool = matches!(f.kind, Kind::Bool);
        let value = match (
            value,
            is_bool,
            negated.is_some() && upstream(name).is_none(),
        ) {
            (Some(v), _, false) => v,
            // `--enable_ha false` means what it says (gflags would set true and leave
            // `false` as a positional argument).
            (None, true, false) if it.peek().is_some_and(|v| parse_bool(v).is_some()) => {
                it.next().cloned().unwrap_or_default()
            }
            (None, true, negated) => (!negated).to_string(),
            (None, false, _) => it
                .next()
                .cloned()
                .ok_or_else(|| format!("--{name} needs a value"))?,
            (Some(_), _, true) => return Err(format!("--{name} takes no value")),
        };
        settings.push((f.name.to_owned(), value));
    }
    Ok((settings, ours))
}

/// The settings of a `--config_path` file (JSON; keys are flag names).
fn config_file(path: &str) -> Result<Vec<Setting>, String> {
    if path.ends_with(".yaml") || path.ends_with(".yml") {
        return Err(format!(
            "--config_path {path}: YAML config files are not supported by this build; write the same keys as JSON"
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("--config_path {path}: {e}"))?;
    let doc =
        mooncake_base::json::parse(&text).map_err(|e| format!("--config_path {path}: {e}"))?;
    let Value::Object(fields) = doc else {
        return Err(format!("--config_path {path}: not a JSON object"));
    };
    fields
        .into_iter()
        .map(|(k, v)| {
            // Upstream's file names the client TTL differently from the flag.
            let k = if k == "client_live_ttl_sec" {
                "client_ttl".to_owned()
            } else {
                k
            };
            if upstream(&k).is_none() {
                return Err(format!("--config_path {path}: unknown key {k:?}"));
            }
            let v = match v {
                Value::String(s) => s,
                other => other.to_string(),
            };
            Ok((k, v))
        })
        .collect()
}

/// Our `mooncake master` arguments for a command line in upstream's syntax (ours
/// mixed in are kept as they are). Upstream settings from `--config_path` come first,
/// so the command line overrides them.
pub fn translate(raw: &[String]) -> Result<Vec<String>, String> {
    let (cli, mut ours) = split(&expand_flagfiles(raw, FLAGFILE_DEPTH)?)?;
    let mut settings = Vec::new();
    if let Some((_, path)) = cli
        .iter()
        .rev()
        .find(|(k, v)| k == "config_path" && !v.is_empty())
    {
        settings.extend(config_file(path)?);
    }
    settings.extend(cli);
    // Upstream: rpc_port 0 means "use --port".
    let rpc_port_given = settings.iter().any(|(k, v)| k == "rpc_port" && v != "0");
    let mut out = Vec::new();
    for (name, value) in settings {
        let Some(f) = upstream(&name) else { continue };
        let value = check_kind(f.kind, &value).map_err(|e| format!("--{name}: {e}"))?;
        match f.action {
            Ours(_, _) if name == "port" && rpc_port_given => {}
            Ours(_, _) if name == "rpc_port" && value == "0" => {}
            Ours(ours_name, convert) => {
                let v = convert(&value).map_err(|e| format!("--{name}: {e}"))?;
                out.push(format!("--{ours_name}={v}"));
            }
            Inert(check) => {
                check(&value).map_err(|e| format!("--{name}: {e}"))?;
                log::debug!("--{name}={value}: accepted, no effect in this build");
            }
            Noted(check, note) => {
                check(&value).map_err(|e| format!("--{name}: {e}"))?;
                if !value.trim().is_empty() {
                    log::warn!("--{name}={value}: {note}");
                }
            }
            Lacking(feature, asks) => {
                if asks(&value) {
                    return Err(format!(
                        "--{name}={value}: {feature} is not available in this build"
                    ));
                }
            }
            Logging(_) => {}
        }
    }
    out.append(&mut ours);
    Ok(out)
}

/// The log level glog's `-v` / `--minloglevel` ask for on this command line (the last
/// of each wins; `-v` 1 is debug, 2 and more trace); `None` leaves the default. Errors
/// are left for `translate` to report.
pub fn log_level(raw: &[String]) -> Option<log::LevelFilter> {
    let expanded = expand_flagfiles(raw, FLAGFILE_DEPTH).ok()?;
    let (settings, _) = split(&expanded).ok()?;
    let last = |name: &str| {
        settings
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| v.trim().parse::<i32>().ok())
    };
    match (last("v"), last("minloglevel")) {
        (Some(v), _) if v >= 2 => Some(log::LevelFilter::Trace),
        (Some(1), _) => Some(log::LevelFilter::Debug),
        (_, Some(i32::MIN..=0)) => Some(log::LevelFilter::Info),
        (_, Some(1)) => Some(log::LevelFilter::Warn),
        (_, Some(_)) => Some(log::LevelFilter::Error),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn refused(v: &[&str]) -> String {
        translate(&args(v)).expect_err(&format!("{v:?} was accepted"))
    }

    /// Every flag upstream's master.cpp defines, with a value it accepts (our own
    /// list, so a flag dropped from the table fails here).
    const UPSTREAM_MASTER_FLAGS: &[(&str, &str)] = &[
        ("config_path", ""),
        ("port", "50051"),
        ("max_threads", "16"),
        ("enable_metric_reporting", "true"),
        ("metrics_port", "9003"),
        ("metrics_host", "0.0.0.0"),
        ("default_kv_lease_ttl", "10s"),
        ("default_kv_soft_pin_ttl", "30m"),
        ("max_kv_soft_pin_ttl", "24h"),
        ("allow_evict_soft_pinned_objects", "true"),
        ("eviction_ratio", "0.05"),
        ("eviction_high_watermark_ratio", "0.95"),
        ("nof_eviction_ratio", "0.1"),
        ("nof_eviction_high_watermark_ratio", "0.9"),
        ("rpc_thread_num", "4"),
        ("rpc_port", "50051"),
        ("rpc_address", "0.0.0.0"),
        ("rpc_interface", "lo"),
        ("rpc_conn_timeout_seconds", "0"),
        ("rpc_enable_tcp_no_delay", "true"),
        ("enable_ha", "false"),
        ("enable_offload", "false"),
        ("offload_on_evict", "false"),
        ("offload_force_evict", "false"),
        ("offloading_queue_limit", "50000"),
        ("offload_cap_ratio", "0.5"),
        ("promotion_on_hit", "false"),
        ("promotion_admission_threshold", "2"),
        ("promotion_queue_limit", "50000"),
        ("promotion_max_per_heartbeat", "1"),
        ("dynamic_replication_mode", "off"),
        ("dynamic_replication_heat_window_seconds", "10"),
        ("dynamic_replication_admission_qps_threshold", "0.8"),
        ("dynamic_replication_max_memory_replicas", "2"),
        ("enable_kv_events", "false"),
        ("kv_events_bind_endpoint", "tcp://0.0.0.0:5557"),
        ("kv_events_model_name", "m"),
        ("kv_events_backend_id", "b"),
        ("kv_events_tenant_id", "default"),
        ("kv_events_additional_salt", "s"),
        ("kv_events_lora_name", "l"),
        ("kv_events_block_size", "16"),
        ("kv_events_dp_rank", "0"),
        ("kv_events_emit_legacy_compat", "true"),
        ("kv_events_emit_object_key", "true"),
        ("kv_events_queue_capacity", "65536"),
        ("ha_backend_type", "etcd"),
        ("ha_backend_connstring", "127.0.0.1:2379"),
        ("etcd_endpoints", "127.0.0.1:2379"),
        ("client_ttl", "10"),
        ("nof_heartbeat_interval_sec", "5"),
        ("nof_heartbeat_probe_timeout_ms", "1000"),
        ("nof_heartbeat_failures_threshold", "3"),
        ("root_fs_dir", ""),
        ("global_file_segment_size", "0"),
        ("cluster_id", "mooncake_cluster"),
        ("enable_oplog", "false"),
        ("oplog_poll_interval_ms", "1000"),
        ("oplog_batch_max_entries", "1024"),
        ("batch_oplog_retry_timeout_sec", "180"),
        ("memory_allocator", "offset"),
        ("allocation_strategy", "random"),
        ("enable_http_metadata_server", "false"),
        ("http_metadata_server_port", "8080"),
        ("http_metadata_server_host", "0.0.0.0"),
        ("enable_metadata_cleanup_on_timeout", "false"),
        ("pod_name", "p"),
        ("pod_namespace", "ns"),
        ("put_start_discard_timeout_sec", "30"),
        ("put_start_release_timeout_sec", "600"),
        ("enable_disk_eviction", "true"),
        ("quota_bytes", "0"),
        ("enable_multi_tenants", "false"),
        ("tenant_quota_connector_type", "file"),
        ("tenant_quota_connector_uri", ""),
        ("snapshot_backup_dir", ""),
        ("enable_snapshot_restore", "false"),
        ("enable_snapshot", "false"),
        ("snapshot_interval_seconds", "600"),
        ("snapshot_child_timeout_seconds", "300"),
        ("snapshot_retention_count", "3"),
        ("snapshot_object_store_type", "local"),
        ("snapshot_payload_store_type", ""),
        ("snapshot_payload_backend_type", ""),
        ("snapshot_catalog_store_type", ""),
        ("snapshot_catalog_backend_type", ""),
        ("snapshot_catalog_store_connstring", ""),
        ("snapshot_catalog_backend_connstring", ""),
        ("max_total_finished_tasks", "10000"),
        ("max_total_pending_tasks", "10000"),
        ("max_total_processing_tasks", "10000"),
        ("pending_task_timeout_sec", "300"),
        ("processing_task_timeout_sec", "300"),
        ("max_retry_attempts", "10"),
        ("cxl_path", "/dev/dax0.0"),
        ("cxl_size", "0"),
        ("enable_cxl", "false"),
    ];

    #[test]
    fn every_upstream_master_flag_is_accepted() {
        for (name, value) in UPSTREAM_MASTER_FLAGS {
            let out = translate(&args(&[&format!("--{name}={value}")]))
                .unwrap_or_else(|e| panic!("--{name}={value}: {e}"));
            // Nothing upstream's leaks through to our parser under its own name.
            assert!(
                out.iter().all(|a| !a.starts_with(&format!("--{name}="))),
                "--{name}: {out:?}"
            );
            // The separate-value form is accepted too (booleans take none in gflags).
            if !matches!(upstream(name).map(|f| f.kind), Some(Kind::Bool)) {
                let out = translate(&args(&[&format!("--{name}"), value]));
                assert!(out.is_ok(), "--{name} {value}: {out:?}");
            }
        }
    }

    #[test]
    fn upstream_syntax_becomes_ours() {
        let out = translate(&args(&[
            "--rpc_port=50052",
            "--default_kv_lease_ttl",
            "2s",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_port=8081",
            "--http_metadata_server_host=127.0.0.1",
            "-metrics_port=9100",
            "--metrics_host=127.0.0.2",
            "--rpc_address=127.0.0.3",
            "--rpc_interface=lo",
            "--enable_gc=false",
            "--allocation_strategy=local_first",
            "--until-stdin-eof",
        ]))
        .unwrap();
        for expected in [
            "--rpc-port=50052",
            "--lease-ttl-ms=2000",
            "--enable-http-metadata-server=true",
            "--http-metadata-server-port=8081",
            "--metadata-bind=127.0.0.1",
            "--metrics-port=9100",
            "--metrics-bind=127.0.0.2",
            "--rpc-bind=127.0.0.3",
            "--rpc-interface=lo",
            "--allocation-strategy=local_first",
            "--until-stdin-eof",
        ] {
            assert!(out.contains(&expected.to_owned()), "{expected}: {out:?}");
        }
        assert!(!out.iter().any(|a| a.contains("enable_gc")), "{out:?}");
    }

    #[test]
    fn booleans_in_every_gflags_spelling() {
        let out = translate(&args(&[
            "--enable_http_metadata_server",
            "--noenable_metric_reporting",
            "--enable_ha=yes",
            "--promotion_on_hit=0",
        ]))
        .unwrap();
        for expected in [
            "--enable-http-metadata-server=true",
            "--enable-metric-reporting=false",
            "--enable-ha=true",
            "--promotion-on-hit=false",
        ] {
            assert!(out.contains(&expected.to_owned()), "{expected}: {out:?}");
        }
        let e = refused(&["--enable_ha=maybe"]);
        assert!(e.contains("--enable_ha") && e.contains("boolean"), "{e}");
        assert!(refused(&["--noenable_ha=true"]).contains("takes no value"));
    }

    #[test]
    fn values_are_checked_as_upstream_checks_them() {
        for (bad, needle) in [
            (
                &["--default_kv_lease_ttl=soon"][..],
                "--default_kv_lease_ttl",
            ),
            (
                &["--default_kv_soft_pin_ttl=1.5s"],
                "--default_kv_soft_pin_ttl",
            ),
            (&["--max_kv_soft_pin_ttl=5d"], "--max_kv_soft_pin_ttl"),
            (&["--default_kv_lease_ttl="], "--default_kv_lease_ttl"),
            (&["--eviction_ratio=1.5"], "--eviction_ratio"),
            (&["--eviction_ratio=-0.1"], "--eviction_ratio"),
            (&["--nof_eviction_ratio=2"], "--nof_eviction_ratio"),
            (&["--offload_cap_ratio=1.01"], "--offload_cap_ratio"),
            (&["--offloading_queue_limit=0"], "--offloading_queue_limit"),
            (
                &["--offloading_queue_limit=100000001"],
                "--offloading_queue_limit",
            ),
            (&["--max_threads=many"], "--max_threads"),
            (&["--kv_events_dp_rank=-1"], "--kv_events_dp_rank"),
            (&["--memory_allocator=jemalloc"], "--memory_allocator"),
            (
                &["--dynamic_replication_mode=sometimes"],
                "--dynamic_replication_mode",
            ),
            (&["--rpc_port=70000"], "--rpc_port"),
            (&["-v=loud"], "--v"),
        ] {
            let e = refused(bad);
            assert!(e.contains(needle), "{bad:?}: {e}");
        }
        assert_eq!(millis("500ms").unwrap(), "500");
        assert_eq!(millis("2 S").unwrap(), "2000");
        assert_eq!(millis("1m").unwrap(), "60000");
        assert_eq!(millis("1h").unwrap(), "3600000");
        assert_eq!(millis("5000").unwrap(), "5000");
        assert!(millis("18446744073709551615h").is_err());
        assert!(translate(&args(&["--offloading_queue_limit=100000000"])).is_ok());
        assert!(translate(&args(&["--eviction_ratio=1"])).is_ok());
    }

    #[test]
    fn lacking_features_are_named() {
        for (asks, needle) in [
            ("--enable_cxl", "CXL"),
            ("--enable_kv_events=true", "KV cache event"),
            ("--enable_multi_tenants", "multi-tenant"),
            (
                "--dynamic_replication_mode=enforce",
                "dynamic memory replication",
            ),
            (
                "--dynamic_replication_mode=observe",
                "dynamic memory replication",
            ),
            ("--allow_evict_soft_pinned_objects=false", "soft-pinned"),
            ("--ha_backend_type=redis", "HA backend"),
            ("--allocation_strategy=cxl", "cxl allocation strategy"),
            ("--enable_snapshot", "snapshots"),
        ] {
            let e = refused(&[asks]);
            assert!(
                e.contains(needle) && e.contains("not available"),
                "{asks}: {e}"
            );
        }
        // The same flags, not asking, are fine.
        assert!(translate(&args(&[
            "--enable_kv_events=false",
            "--enable_multi_tenants=false",
            "--dynamic_replication_mode=off",
            "--ha_backend_type=etcd",
            "--memory_allocator=cachelib",
        ]))
        .is_ok());
    }

    #[test]
    fn ports_and_the_port_fallback() {
        assert_eq!(
            translate(&args(&["--port=6000"])).unwrap(),
            ["--rpc-port=6000"]
        );
        let out = translate(&args(&["--port=6000", "--rpc_port=7000"])).unwrap();
        assert_eq!(out, ["--rpc-port=7000"]);
        let out = translate(&args(&["--metrics_port=off"])).unwrap();
        assert_eq!(out, ["--metrics-port=off"]);
    }

    #[test]
    fn glog_verbosity_sets_the_log_level() {
        use log::LevelFilter::{Debug, Error, Info, Trace, Warn};
        for (line, level) in [
            (&["-v=1"][..], Some(Debug)),
            (&["--v=1"], Some(Debug)),
            (&["-v", "1"], Some(Debug)),
            (&["--v", "3"], Some(Trace)),
            (&["-v=0"], None),
            (&["--minloglevel=0"], Some(Info)),
            (&["--minloglevel=1"], Some(Warn)),
            (&["--minloglevel=2"], Some(Error)),
            (&["--minloglevel=2", "-v=2"], Some(Trace)),
            (&["--v=2", "--v=1"], Some(Debug)),
            (&["--rpc_port=1"], None),
        ] {
            assert_eq!(log_level(&args(line)), level, "{line:?}");
            assert!(translate(&args(line)).is_ok(), "{line:?}");
        }
    }

    #[test]
    fn builtins_are_recognised() {
        assert_eq!(builtin(&args(&["--version"])), Some(Builtin::Version));
        assert_eq!(builtin(&args(&["-version"])), Some(Builtin::Version));
        assert_eq!(builtin(&args(&["--helpfull"])), Some(Builtin::Help));
        assert_eq!(builtin(&args(&["-help"])), Some(Builtin::Help));
        assert_eq!(builtin(&args(&["--rpc_port=1"])), None);
        let help = upstream_help();
        for (name, _) in UPSTREAM_MASTER_FLAGS {
            assert!(
                help.contains(&format!("--{name} ")),
                "{name} missing from --helpfull"
            );
        }
    }

    /// A scratch directory of this test alone, removed when dropped.
    struct Scratch(std::path::PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("mc-master-{tag}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        fn file(&self, name: &str, text: &str) -> String {
            let path = self.0.join(name);
            std::fs::write(&path, text).unwrap();
            path.to_str().unwrap().to_owned()
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn flagfiles_stand_where_they_are_named() {
        let dir = Scratch::new("flagfile");
        let inner = dir.file("inner.flags", "--eviction_ratio=0.2\n");
        let outer = dir.file(
            "outer.flags",
            &format!("# a comment\n\n--rpc_port=6100\n-v=1\n--flagfile={inner}\n"),
        );
        let out = translate(&args(&[&format!("--flagfile={outer}"), "--rpc_port=6200"])).unwrap();
        assert_eq!(
            out,
            ["--rpc-port=6100", "--eviction-ratio=0.2", "--rpc-port=6200"]
        );
        assert_eq!(
            log_level(&args(&["-flagfile", &outer])),
            Some(log::LevelFilter::Debug)
        );
        let named = dir.file("programs.flags", "mooncake_master\n--rpc_port=1\n");
        let e = refused(&[&format!("--flagfile={named}")]);
        assert!(e.contains("line 1"), "{e}");
        assert!(
            !e.contains("mooncake_master"),
            "the line is not echoed: {e}"
        );
        // Only a flag names a file: a value spelled "flagfile" is a value.
        let out = translate(&args(&["--cluster_id", "flagfile", "--rpc_port=7"])).unwrap();
        assert!(out.contains(&"--cluster-id=flagfile".to_owned()), "{out:?}");
        let looping = dir.file("loop.flags", "");
        std::fs::write(&looping, format!("--flagfile={looping}\n")).unwrap();
        assert!(refused(&[&format!("--flagfile={looping}")]).contains("nested"));
        assert!(refused(&["--flagfile=/no/such/file"]).contains("/no/such/file"));
        assert!(refused(&["--flagfile"]).contains("needs a path"));
    }

    #[test]
    fn a_boolean_may_take_its_value_as_the_next_word_and_strays_are_refused() {
        let out = translate(&args(&["--enable_ha", "false", "--rpc_port", "7000"])).unwrap();
        assert_eq!(out, ["--enable-ha=false", "--rpc-port=7000"]);
        assert!(refused(&["--rpc_port", "7000", "8000"]).contains("\"8000\""));
    }

    #[test]
    fn config_file_then_command_line() {
        let dir = Scratch::new("cfg");
        let p = dir.file(
            "master.json",
            r#"{"rpc_port": 6100, "client_live_ttl_sec": 3, "eviction_ratio": 0.1}"#,
        );
        let out = translate(&args(&[&format!("--config_path={p}"), "--rpc_port=6200"])).unwrap();
        let last_port = out
            .iter()
            .rev()
            .find(|a| a.starts_with("--rpc-port="))
            .unwrap();
        assert_eq!(last_port, "--rpc-port=6200");
        assert!(out.contains(&"--client-ttl=3".to_owned()));
        let p = dir.file("bad.json", r#"{"no_such_flag": 1}"#);
        assert!(translate(&args(&[&format!("--config_path={p}")])).is_err());
        let p = dir.file("ratio.json", r#"{"eviction_ratio": 3}"#);
        assert!(refused(&[&format!("--config_path={p}")]).contains("--eviction_ratio"));
        assert!(refused(&["--config_path=/x/master.yaml"]).contains("YAML"));
    }
}
