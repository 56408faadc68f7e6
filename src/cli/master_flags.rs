//! Upstream `mooncake_master`'s command line, so launch scripts written for it work:
//! every flag name it defines is accepted (gflags syntax: `--f=v`, `--f v`, `-f`, bare
//! and `--nof` booleans, `--config_path` with the same keys as JSON); a value asking for
//! a feature this build lacks fails with a message naming it; anything else passes
//! through to our own flags, whose parser refuses unknown names.

use mooncake::json::Value;

/// What an upstream flag becomes here.
#[derive(Clone, Copy)]
enum Action {
    /// Our flag of this name (its value converted by `convert`).
    Ours(&'static str, fn(&str) -> Result<String, String>),
    /// Accepted without effect: tuning of upstream's internals we do not have.
    Inert,
    /// Refused when the value asks for the feature named.
    Lacking(&'static str, fn(&str) -> bool),
}

struct Flag {
    name: &'static str,
    boolean: bool,
    action: Action,
}

const fn flag(name: &'static str, boolean: bool, action: Action) -> Flag {
    Flag {
        name,
        boolean,
        action,
    }
}

fn same(v: &str) -> Result<String, String> {
    Ok(v.to_owned())
}

/// A duration in ms: plain milliseconds, or with a `ms`, `s`, `m` or `h` suffix.
fn millis(v: &str) -> Result<String, String> {
    let v = v.trim();
    let (num, scale) = [("ms", 1.0), ("s", 1e3), ("m", 6e4), ("h", 3.6e6)]
        .iter()
        .find_map(|(suffix, scale)| v.strip_suffix(suffix).map(|n| (n, *scale)))
        .unwrap_or((v, 1.0));
    match num.trim().parse::<f64>() {
        Ok(n) if n.is_finite() && n >= 0.0 => Ok(((n * scale).round() as u64).to_string()),
        _ => Err(format!(
            "{v:?} is not a duration (e.g. 5000, 500ms, 5s, 1m)"
        )),
    }
}

fn truthy(v: &str) -> bool {
    matches!(
        v.to_ascii_lowercase().as_str(),
        "true" | "1" | "yes" | "y" | "t"
    )
}

fn not_etcd(v: &str) -> bool {
    !v.trim().is_empty() && !v.trim().eq_ignore_ascii_case("etcd")
}

fn nonempty(v: &str) -> bool {
    !v.trim().is_empty()
}

fn not_offset_allocator(v: &str) -> bool {
    !matches!(v, "offset" | "cachelib")
}

fn cxl_strategy(v: &str) -> bool {
    v == "cxl"
}

const FLAGS: &[Flag] = &[
    flag("rpc_port", false, Action::Ours("rpc-port", same)),
    flag("port", false, Action::Ours("rpc-port", same)),
    flag("rpc_address", false, Action::Ours("bind", same)),
    flag("rpc_interface", false, Action::Lacking("--rpc_interface (binding by interface name; give --rpc_address)", nonempty)),
    flag("max_threads", false, Action::Inert),
    flag("rpc_thread_num", false, Action::Inert),
    flag("rpc_conn_timeout_seconds", false, Action::Inert),
    flag("rpc_enable_tcp_no_delay", true, Action::Inert),
    flag("enable_metric_reporting", true, Action::Ours("enable-metric-reporting", same)),
    flag("metrics_port", false, Action::Ours("metrics-port", same)),
    flag("default_kv_lease_ttl", false, Action::Ours("lease-ttl-ms", millis)),
    flag("default_kv_soft_pin_ttl", false, Action::Ours("default-soft-pin-ttl-ms", millis)),
    flag("allow_evict_soft_pinned_objects", true, Action::Lacking("--allow_evict_soft_pinned_objects=false (soft-pinned objects are evicted after all others)", |v| !truthy(v))),
    flag("eviction_ratio", false, Action::Ours("eviction-ratio", same)),
    flag("eviction_high_watermark_ratio", false, Action::Ours("eviction-high-watermark", same)),
    flag("put_start_discard_timeout_sec", false, Action::Ours("put-start-discard-timeout", same)),
    flag("put_start_release_timeout_sec", false, Action::Ours("put-start-release-timeout", same)),
    flag("enable_ha", true, Action::Ours("enable-ha", same)),
    flag("etcd_endpoints", false, Action::Ours("etcd-endpoints", same)),
    flag("ha_backend_type", false, Action::Lacking("an HA backend other than etcd (--ha_backend_type)", not_etcd)),
    flag("ha_backend_connstring", false, Action::Ours("etcd-endpoints", same)),
    flag("client_ttl", false, Action::Ours("client-ttl", same)),
    flag("cluster_id", false, Action::Ours("cluster-id", same)),
    flag("enable_offload", true, Action::Ours("offload-on-evict", same)),
    flag("offload_on_evict", true, Action::Ours("offload-on-evict", same)),
    flag("promotion_on_hit", true, Action::Ours("promotion-on-hit", same)),
    flag("promotion_admission_threshold", false, Action::Ours("promotion-admission-threshold", same)),
    flag("root_fs_dir", false, Action::Ours("root-fs-dir", same)),
    flag("global_file_segment_size", false, Action::Inert),
    flag("enable_disk_eviction", true, Action::Inert),
    flag("quota_bytes", false, Action::Inert),
    flag("memory_allocator", false, Action::Lacking("--memory_allocator other than offset or cachelib", not_offset_allocator)),
    flag("allocation_strategy", false, Action::Lacking("CXL allocation (--allocation_strategy=cxl)", cxl_strategy)),
    flag("enable_http_metadata_server", true, Action::Ours("enable-http-metadata-server", same)),
    flag("http_metadata_server_port", false, Action::Ours("metadata-port", same)),
    flag("http_metadata_server_host", false, Action::Inert),
    flag("enable_metadata_cleanup_on_timeout", true, Action::Inert),
    flag("max_total_finished_tasks", false, Action::Inert),
    flag("max_total_pending_tasks", false, Action::Inert),
    flag("max_total_processing_tasks", false, Action::Inert),
    flag("pending_task_timeout_sec", false, Action::Inert),
    flag("processing_task_timeout_sec", false, Action::Inert),
    flag("max_retry_attempts", false, Action::Inert),
    flag("enable_cxl", true, Action::Lacking("CXL memory (--enable_cxl)", truthy)),
    flag("cxl_path", false, Action::Inert),
    flag("cxl_size", false, Action::Inert),
    flag("enable_snapshot", true, Action::Lacking("metadata snapshots (--enable_snapshot)", truthy)),
    flag("enable_snapshot_restore", true, Action::Lacking("snapshot restore (--enable_snapshot_restore)", truthy)),
    flag("snapshot_backup_dir", false, Action::Inert),
    flag("snapshot_interval_seconds", false, Action::Inert),
    flag("snapshot_child_timeout_seconds", false, Action::Inert),
    flag("snapshot_retention_count", false, Action::Inert),
    flag("snapshot_object_store_type", false, Action::Inert),
    flag("snapshot_catalog_store_type", false, Action::Inert),
    flag("snapshot_catalog_store_connstring", false, Action::Inert),
    flag("snapshot_payload_store_type", false, Action::Inert),
    flag("snapshot_payload_backend_type", false, Action::Inert),
    flag("snapshot_catalog_backend_type", false, Action::Inert),
    flag("snapshot_catalog_backend_connstring", false, Action::Inert),
    flag("config_path", false, Action::Inert),
    // Ours, so a `--config_path` file may name it too.
    flag("cluster_secret_file", false, Action::Ours("cluster-secret-file", same)),
    flag("max_unfinished_put_ratio", false, Action::Ours("max-unfinished-put-ratio", same)),
];

fn upstream(name: &str) -> Option<&'static Flag> {
    FLAGS.iter().find(|f| f.name == name)
}

/// One `name=value` from the command line, in the order given.
type Setting = (String, String);

/// Splits the command line into upstream settings and the rest (our own flags).
fn split(raw: &[String]) -> Result<(Vec<Setting>, Vec<String>), String> {
    let mut settings = Vec::new();
    let mut ours = Vec::new();
    let mut it = raw.iter();
    while let Some(arg) = it.next() {
        let body = arg.trim_start_matches('-');
        let (name, value) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v.to_owned())),
            None => (body, None),
        };
        let negated = name
            .strip_prefix("no")
            .and_then(upstream)
            .filter(|f| f.boolean);
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
        let value = match (
            value,
            f.boolean,
            negated.is_some() && upstream(name).is_none(),
        ) {
            (Some(v), _, false) => v,
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
    let doc = mooncake::json::parse(&text).map_err(|e| format!("--config_path {path}: {e}"))?;
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
    let (cli, mut ours) = split(raw)?;
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
        match f.action {
            Action::Ours(_, _) if name == "port" && rpc_port_given => {}
            Action::Ours(_, _) if name == "rpc_port" && value == "0" => {}
            Action::Ours(ours_name, convert) => {
                let v = convert(&value).map_err(|e| format!("--{name}: {e}"))?;
                out.push(format!("--{ours_name}={v}"));
            }
            Action::Inert => log::debug!("--{name}={value}: accepted, no effect in this build"),
            Action::Lacking(feature, asks) => {
                if asks(&value) {
                    return Err(format!(
                        "--{name}={value}: {feature} is not available in this build"
                    ));
                }
            }
        }
    }
    out.append(&mut ours);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn upstream_syntax_becomes_ours() {
        let out = translate(&args(&[
            "--rpc_port=50052",
            "--default_kv_lease_ttl",
            "2s",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_port=8081",
            "-metrics_port=9100",
            "--enable_gc=false",
        ]));
        // `enable_gc` is not an upstream flag: it passes through and our parser refuses it.
        let out = out.unwrap();
        assert!(out.contains(&"--rpc-port=50052".to_owned()));
        assert!(out.contains(&"--lease-ttl-ms=2000".to_owned()));
        assert!(out.contains(&"--metadata-port=8081".to_owned()));
        assert!(out.contains(&"--metrics-port=9100".to_owned()));
        assert!(out.contains(&"--enable_gc=false".to_owned()));
    }

    #[test]
    fn booleans_bare_and_negated() {
        let out = translate(&args(&[
            "--enable_http_metadata_server",
            "--noenable_metric_reporting",
        ]))
        .unwrap();
        assert!(out.contains(&"--enable-http-metadata-server=true".to_owned()));
        assert!(out.contains(&"--enable-metric-reporting=false".to_owned()));
        assert!(translate(&args(&["--noenable_ha"])).is_ok());
    }

    #[test]
    fn ha_flags_become_ours() {
        let out = translate(&args(&[
            "--enable_ha",
            "--etcd_endpoints=127.0.0.1:2379;127.0.0.1:2380",
            "--cluster_id=c1",
        ]))
        .unwrap();
        assert!(out.contains(&"--enable-ha=true".to_owned()), "{out:?}");
        assert!(out.contains(&"--etcd-endpoints=127.0.0.1:2379;127.0.0.1:2380".to_owned()));
        assert!(out.contains(&"--cluster-id=c1".to_owned()));
        let e = translate(&args(&["--ha_backend_type=redis"])).unwrap_err();
        assert!(e.contains("HA backend"), "{e}");
        assert!(translate(&args(&["--ha_backend_type=etcd"])).is_ok());
    }

    #[test]
    fn lacking_features_are_named() {
        let e = translate(&args(&["--enable_cxl"])).unwrap_err();
        assert!(e.contains("enable_cxl"), "{e}");
        let out = translate(&args(&[
            "--enable_offload=false",
            "--promotion_admission_threshold=3",
        ]))
        .unwrap();
        assert!(
            out.contains(&"--offload-on-evict=false".to_owned()),
            "{out:?}"
        );
        assert!(
            out.contains(&"--promotion-admission-threshold=3".to_owned()),
            "{out:?}"
        );
        assert!(translate(&args(&["--memory_allocator=offset"])).is_ok());
        assert!(translate(&args(&["--memory_allocator=jemalloc"])).is_err());
    }

    #[test]
    fn durations_and_port_fallback() {
        assert_eq!(millis("500ms").unwrap(), "500");
        assert_eq!(millis("1m").unwrap(), "60000");
        assert_eq!(millis("5000").unwrap(), "5000");
        assert!(millis("soon").is_err());
        let out = translate(&args(&["--port=6000"])).unwrap();
        assert_eq!(out, vec!["--rpc-port=6000"]);
        let out = translate(&args(&["--port=6000", "--rpc_port=7000"])).unwrap();
        assert_eq!(out, vec!["--rpc-port=7000"]);
    }

    #[test]
    fn config_file_then_command_line() {
        let dir = std::env::temp_dir().join(format!("mc-master-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("master.json");
        std::fs::write(
            &path,
            r#"{"rpc_port": 6100, "client_live_ttl_sec": 3, "eviction_ratio": 0.1}"#,
        )
        .unwrap();
        let p = path.to_str().unwrap();
        let out = translate(&args(&[&format!("--config_path={p}"), "--rpc_port=6200"])).unwrap();
        let last_port = out
            .iter()
            .rev()
            .find(|a| a.starts_with("--rpc-port="))
            .unwrap();
        assert_eq!(last_port, "--rpc-port=6200");
        assert!(out.contains(&"--client-ttl=3".to_owned()));
        std::fs::write(&path, r#"{"no_such_flag": 1}"#).unwrap();
        assert!(translate(&args(&[&format!("--config_path={p}")])).is_err());
        assert!(translate(&args(&["--config_path=/x/master.yaml"]))
            .unwrap_err()
            .contains("YAML"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
