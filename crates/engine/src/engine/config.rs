//! Engine configuration: typed fields plus the string keys shared by the C ABI
//! (`mc_config_set`) and the CLI.

use std::net::IpAddr;
use std::time::Duration;

use crate::auth::ClusterSecret;
use crate::error::{Error, Result};
use crate::transport::tcp::TcpConfig;
use crate::transport::BackendConfig;

/// Which transports an engine may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// Same-host peers through shared memory, everything else through TCP.
    Auto,
    /// TCP only, even between processes on one host.
    Tcp,
    /// Same-host shared memory only.
    Shm,
    /// RDMA verbs (libibverbs and a device needed; see [`EngineConfig::strict_protocol`]).
    Rdma,
    /// libfabric RMA (EFA) (libfabric and a provider needed; see `strict_protocol`).
    Fabric,
    /// A hardware protocol of Mooncake's this build has no transport for (one of
    /// [`NO_BACKEND`]): the engine runs over TCP instead, or refuses when strict.
    NoBackend(&'static str),
}

/// Mooncake's hardware protocols that have no transport here. Asking for one is not a
/// typo: an engine starts over TCP (with a warning), as Mooncake's own builds do
/// without the matching option.
pub const NO_BACKEND: &[&str] = &[
    "nvlink",
    "nvlink_intra",
    "nvmeof",
    "cxl",
    "cxi",
    "ascend",
    "hccl",
    "musa",
    "hip",
    "barex",
    "maca",
    "ub",
    "ubshmem",
    "sunrise_link",
];

/// The environment variable that turns the fallback off: with `MC_STRICT_PROTOCOL=1`
/// an unavailable hardware protocol fails start-up with `BackendUnavailable`.
pub const STRICT_PROTOCOL_VAR: &str = "MC_STRICT_PROTOCOL";

/// Upstream's switch that makes every engine run over TCP whatever protocol it is asked
/// for (SGLang documents it as the way to run Mooncake without RDMA).
pub const FORCE_TCP_VAR: &str = "MC_FORCE_TCP";

/// The switch that keeps same-host peers on sockets when upstream's API asks for
/// `tcp` (see [`EngineConfig::same_host_shm`]); on unless set to `0`, `false` or `off`.
pub const SAME_HOST_SHM_VAR: &str = "MC_SAME_HOST_SHM";

/// Whether upstream's `tcp` may carry same-host peers through shared memory:
/// `MC_SAME_HOST_SHM`, on unless switched off (a value that is no switch keeps it on,
/// with a warning).
pub fn same_host_shm_from_env() -> bool {
    same_host_shm_switch(std::env::var(SAME_HOST_SHM_VAR).ok().as_deref())
}

fn same_host_shm_switch(value: Option<&str>) -> bool {
    let Some(value) = value else {
        return true;
    };
    crate::util::switch::parse(value).unwrap_or_else(|| {
        log::warn!("{SAME_HOST_SHM_VAR}={value:?} is not 1/true/on or 0/false/off; kept on");
        true
    })
}

/// Whether environment variable `name` is set to a yes (`1`, `true`, `yes`, `on`).
fn env_switch(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// Whether `MC_STRICT_PROTOCOL` asks for strictness.
pub fn strict_protocol_from_env() -> bool {
    env_switch(STRICT_PROTOCOL_VAR)
}

impl Protocol {
    /// Parses a protocol name as configuration files spell it.
    pub fn parse(s: &str) -> Result<Protocol> {
        let lower = s.to_ascii_lowercase();
        match lower.as_str() {
            "auto" => Ok(Protocol::Auto),
            "tcp" => Ok(Protocol::Tcp),
            "shm" => Ok(Protocol::Shm),
            "rdma" => Ok(Protocol::Rdma),
            "efa" | "fabric" => Ok(Protocol::Fabric),
            other => match NO_BACKEND.iter().find(|n| **n == other) {
                Some(name) => Ok(Protocol::NoBackend(name)),
                None => Err(Error::invalid(format!(
                    "unknown protocol {s:?} (auto, tcp, shm, rdma, efa)"
                ))),
            },
        }
    }

    /// The protocol's configuration name.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Auto => "auto",
            Protocol::Tcp => "tcp",
            Protocol::Shm => "shm",
            Protocol::Rdma => "rdma",
            Protocol::Fabric => "efa",
            Protocol::NoBackend(name) => name,
        }
    }

    /// Whether the protocol needs a hardware backend (and so may fall back to TCP).
    pub fn is_hardware(self) -> bool {
        matches!(
            self,
            Protocol::Rdma | Protocol::Fabric | Protocol::NoBackend(_)
        )
    }
}

/// Everything an [`Engine`](crate::Engine) is built from.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Metadata connection string: `P2PHANDSHAKE`, `http://h:p/metadata`, `embedded`.
    pub metadata: String,
    /// Segment name; default `<bind_address>:<rpc_port>`.
    pub local_server_name: Option<String>,
    /// Address the data and RPC servers listen on.
    pub bind_address: IpAddr,
    /// Handshake RPC port; 0 picks a free one.
    pub rpc_port: u16,
    /// Which transports to use.
    pub protocol: Protocol,
    /// When a hardware `protocol`'s backend is unavailable: `false` starts over TCP
    /// with a warning (`Engine::protocol_fallback` says why), `true` fails start-up
    /// with `BackendUnavailable`. Default: `MC_STRICT_PROTOCOL`, else `false`.
    pub strict_protocol: bool,
    /// Run a hardware `protocol` over TCP without trying its backend, as asked (no
    /// warning, no fallback record). Default: `MC_FORCE_TCP`, else `false`.
    pub force_tcp: bool,
    /// Whether TCP (asked for, forced, or fallen back to) also reaches same-host peers
    /// through shared memory, as `auto` does: what upstream's `tcp` means, "no RDMA"
    /// rather than "sockets even within one host" (set with the key
    /// `upstream_protocol`, from `MC_SAME_HOST_SHM`). Default `false`: our own `tcp`
    /// is sockets only, as the TCP benchmarks and tests need.
    pub same_host_shm: bool,
    /// Worker threads that drive transfers.
    pub workers: usize,
    /// Idle poll iterations before a worker parks.
    pub spin_budget: u32,
    /// TCP transport settings.
    pub tcp: TcpConfig,
    /// RDMA and libfabric settings.
    pub backend: BackendConfig,
    /// How long a transfer may take before its task times out.
    pub transfer_timeout: Duration,
    /// Extra attempts per slice after a path failure.
    pub max_retries: u32,
    /// Cluster namespace in the metadata store (empty: none).
    pub cluster_id: String,
    /// With a secret, every connection to and from this engine authenticates first
    /// (`crate::auth`); `None` (the default unless `MC_CLUSTER_SECRET` is set) keeps
    /// every wire as Mooncake's.
    pub cluster_secret: Option<ClusterSecret>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            metadata: "P2PHANDSHAKE".to_owned(),
            local_server_name: None,
            bind_address: IpAddr::from([127, 0, 0, 1]),
            rpc_port: 0,
            protocol: Protocol::Auto,
            strict_protocol: strict_protocol_from_env(),
            force_tcp: env_switch(FORCE_TCP_VAR),
            same_host_shm: false,
            workers: 1,
            spin_budget: 256,
            tcp: TcpConfig::default(),
            backend: BackendConfig::default(),
            transfer_timeout: Duration::from_secs(30),
            max_retries: 2,
            cluster_id: String::new(),
            cluster_secret: ClusterSecret::env_default(),
        }
    }
}

/// Keys accepted by `EngineConfig::set`, documented in `c_include/mooncake.h`.
pub const KEYS: &[&str] = &[
    "metadata",
    "local_server_name",
    "bind_address",
    "rpc_port",
    "protocol",
    "upstream_protocol",
    "workers",
    "spin_budget",
    "lanes_per_peer",
    "slice_size",
    "socket_buffer",
    "transfer_timeout_ms",
    "max_retries",
    "cluster_id",
    "device_name",
    "fabric_provider",
    "cluster_secret",
    "cluster_secret_file",
];

fn number<T: TryFrom<u64>>(key: &str, value: &str) -> Result<T> {
    crate::util::size::parse(value)
        .ok()
        .and_then(|n| T::try_from(n).ok())
        .ok_or_else(|| Error::invalid(format!("config {key}: {value:?} is not a valid number")))
}

impl EngineConfig {
    /// Sets one key from its string form; unknown keys and bad values are errors.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "metadata" | "metadata_server" => self.metadata = value.to_owned(),
            "local_server_name" => {
                self.local_server_name = (!value.is_empty()).then(|| value.to_owned())
            }
            "bind_address" => {
                self.bind_address = value.parse().map_err(|_| {
                    Error::invalid(format!(
                        "config bind_address: {value:?} is not an IP address"
                    ))
                })?
            }
            "rpc_port" => self.rpc_port = number(key, value)?,
            "protocol" => self.protocol = Protocol::parse(value)?,
            "upstream_protocol" => {
                self.protocol = Protocol::parse(value.trim())?;
                self.same_host_shm = same_host_shm_from_env();
            }
            "workers" => {
                self.workers = number(key, value)?;
                if !(1..=64).contains(&self.workers) {
                    return Err(Error::invalid("config workers: must be 1..=64"));
                }
            }
            "spin_budget" => self.spin_budget = number(key, value)?,
            "lanes_per_peer" => {
                self.tcp.lanes_per_peer = number(key, value)?;
                if !(1..=64).contains(&self.tcp.lanes_per_peer) {
                    return Err(Error::invalid("config lanes_per_peer: must be 1..=64"));
                }
            }
            "slice_size" => {
                self.tcp.slice_size = number(key, value)?;
                if self.tcp.slice_size < 4096 {
                    return Err(Error::invalid("config slice_size: must be at least 4096"));
                }
            }
            "socket_buffer" => self.tcp.socket_buffer = number(key, value)?,
            "transfer_timeout_ms" => {
                self.transfer_timeout = Duration::from_millis(number(key, value)?)
            }
            "max_retries" => self.max_retries = number(key, value)?,
            "cluster_id" => self.cluster_id = value.to_owned(),
            "device_name" => self.backend.devices = value.to_owned(),
            "fabric_provider" => self.backend.fabric_provider = value.to_owned(),
            // Empty turns authentication off (even when MC_CLUSTER_SECRET is set).
            "cluster_secret" => {
                self.cluster_secret = match value {
                    "" => None,
                    v => Some(ClusterSecret::new(v.as_bytes())?),
                }
            }
            "cluster_secret_file" => self.cluster_secret = Some(ClusterSecret::from_file(value)?),
            _ => {
                return Err(Error::invalid(format!(
                    "unknown config key {key:?} (known: {})",
                    KEYS.join(", ")
                )))
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{EngineConfig, Protocol};

    #[test]
    fn upstream_names_keep_their_protocol_and_widen_tcp_to_same_host_peers() {
        let mut c = EngineConfig::default();
        c.set("protocol", "tcp").unwrap();
        assert_eq!((c.protocol, c.same_host_shm), (Protocol::Tcp, false));
        // The environment decides the widening (on unless switched off); the name
        // stays what was asked, so a fallback or MC_FORCE_TCP keeps it too.
        for (name, p) in [
            (" TCP ", Protocol::Tcp),
            ("rdma", Protocol::Rdma),
            ("efa", Protocol::Fabric),
            ("nvlink", Protocol::NoBackend("nvlink")),
        ] {
            let mut c = EngineConfig::default();
            c.set("upstream_protocol", name).unwrap();
            assert_eq!(c.protocol, p, "{name}");
            assert_eq!(c.same_host_shm, super::same_host_shm_from_env(), "{name}");
        }
        for (value, on) in [
            (None, true),
            (Some("0"), false),
            (Some(" OFF"), false),
            (Some("1"), true),
            (Some("no"), true), // not a switch: warned about, kept on
        ] {
            assert_eq!(super::same_host_shm_switch(value), on, "{value:?}");
        }
        let mut c = EngineConfig::default();
        assert!(c.set("upstream_protocol", "tcpx").is_err());
        assert_eq!(
            (c.protocol, c.same_host_shm),
            (Protocol::Auto, false),
            "unchanged"
        );
    }
}
