//! What an engine does when the hardware protocol it was asked for cannot start here:
//! it runs over TCP and says so once, loudly, unless strictness asks it to refuse.
//! Mooncake's builds do the same (no RDMA device found: TCP), which is what serving
//! engines that default to "rdma" rely on.

use std::fmt;
use std::sync::Arc;

use super::config::{Protocol, STRICT_PROTOCOL_VAR};
use crate::error::{Code, Error, Result};
use crate::registry::LocalMemory;
use crate::transport::fabric::FabricTransport;
use crate::transport::rdma::RdmaTransport;
use crate::transport::{BackendConfig, Transport};

/// What an engine runs in place of an unavailable hardware protocol.
pub const FALLBACK_PROTOCOL: Protocol = Protocol::Tcp;

/// An engine running another protocol than the one asked for, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProtocolFallback {
    /// The protocol asked for.
    pub requested: Protocol,
    /// Why its backend is unavailable here.
    pub reason: Error,
    /// The `device_name` given with it, now unused ("" when none was).
    pub ignored_devices: String,
    /// The protocol the engine runs instead.
    pub used: Protocol,
}

impl fmt::Display for ProtocolFallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "protocol {} requested but unavailable on this host ({}); using {} instead",
            self.requested.name(),
            self.reason.context(),
            self.used.name()
        )?;
        if !self.ignored_devices.is_empty() {
            write!(f, ", device_name {:?} ignored", self.ignored_devices)?;
        }
        write!(f, " (set {STRICT_PROTOCOL_VAR}=1 to refuse instead)")
    }
}

/// Decides what an engine asked for `requested` does when its backend failed to start
/// with `failure`: falls back (the returned description, to be logged once) unless
/// `strict`, or the failure is not about availability (a malformed `device_name`, out
/// of memory): then start-up fails with `failure` as it is.
pub fn fall_back(
    requested: Protocol,
    failure: Error,
    devices: &str,
    strict: bool,
) -> Result<ProtocolFallback> {
    if strict || failure.code() != Code::BackendUnavailable || !requested.is_hardware() {
        return Err(failure);
    }
    Ok(ProtocolFallback {
        requested,
        reason: failure,
        ignored_devices: devices.trim().to_owned(),
        used: FALLBACK_PROTOCOL,
    })
}

/// Starts the hardware transport `protocol` names: `None` for a software protocol, an
/// error (`BackendUnavailable` when the library, a device or the whole backend is
/// missing) when it cannot start.
pub(super) fn start_hardware(
    protocol: Protocol,
    backend: &BackendConfig,
    memory: &Arc<LocalMemory>,
) -> Result<Option<Arc<dyn Transport>>> {
    Ok(match protocol {
        Protocol::Rdma => Some(Arc::new(RdmaTransport::start(backend, memory.clone())?)),
        Protocol::Fabric => Some(Arc::new(FabricTransport::start(backend, memory.clone())?)),
        Protocol::NoBackend(name) => {
            return Err(Error::new(
                Code::BackendUnavailable,
                format!("no {name} transport in this build"),
            ))
        }
        Protocol::Auto | Protocol::Tcp | Protocol::Shm => None,
    })
}

/// Whether `protocol`'s backend starts on this host with default settings: `Ok`, or
/// why not (what an engine asking for it would fall back over). For `mooncake info`.
pub fn probe(protocol: Protocol) -> Result<()> {
    start_hardware(
        protocol,
        &BackendConfig::default(),
        &Arc::new(LocalMemory::new()),
    )
    .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn missing() -> Error {
        Error::new(Code::BackendUnavailable, "no RDMA devices")
    }

    #[test]
    fn an_unavailable_backend_falls_back_to_tcp_naming_both_and_why() {
        let f = fall_back(Protocol::Rdma, missing(), "", false).unwrap();
        assert_eq!(f.used, Protocol::Tcp);
        assert_eq!(f.requested, Protocol::Rdma);
        let line = f.to_string();
        assert!(line.contains("protocol rdma requested"), "{line}");
        assert!(line.contains("no RDMA devices"), "{line}");
        assert!(line.contains("using tcp instead"), "{line}");
        assert!(line.contains("MC_STRICT_PROTOCOL=1"), "{line}");
        assert!(!line.contains("device_name"), "{line}");
    }

    #[test]
    fn devices_given_with_it_are_named_as_ignored() {
        let f = fall_back(Protocol::Fabric, missing(), " mlx5_0,mlx5_1 ", false).unwrap();
        assert_eq!(f.ignored_devices, "mlx5_0,mlx5_1");
        let line = f.to_string();
        assert!(line.starts_with("protocol efa requested"), "{line}");
        assert!(
            line.contains(r#"device_name "mlx5_0,mlx5_1" ignored"#),
            "{line}"
        );
    }

    #[test]
    fn strictness_keeps_the_original_failure() {
        let err = fall_back(Protocol::Rdma, missing(), "mlx5_0", true).unwrap_err();
        assert_eq!(err, missing());
        assert_eq!(err.code() as i32, -1209);
    }

    #[test]
    fn other_failures_are_not_a_reason_to_fall_back() {
        let bad = Error::invalid("device_name priority matrix: bad JSON");
        assert_eq!(
            fall_back(Protocol::Rdma, bad.clone(), "{", false).unwrap_err(),
            bad
        );
        let oom = Error::new(Code::NoAvailableHandle, "ibv_alloc_pd: ENOMEM");
        assert_eq!(
            fall_back(Protocol::Rdma, oom.clone(), "", false).unwrap_err(),
            oom
        );
        // Only hardware protocols fall back (shm not starting is its own error).
        let shm = Error::new(Code::BackendUnavailable, "memfd");
        assert_eq!(
            fall_back(Protocol::Shm, shm.clone(), "", false).unwrap_err(),
            shm
        );
    }

    #[test]
    fn a_protocol_without_a_backend_here_always_falls_back_unless_strict() {
        let nvlink = Protocol::parse("NVLink").unwrap();
        assert_eq!(nvlink, Protocol::NoBackend("nvlink"));
        let memory = Arc::new(LocalMemory::new());
        let why = start_hardware(nvlink, &BackendConfig::default(), &memory)
            .err()
            .expect("no nvlink backend");
        assert_eq!(why.code(), Code::BackendUnavailable);
        assert!(why.to_string().contains("no nvlink transport"), "{why}");
        let f = fall_back(nvlink, why.clone(), "", false).unwrap();
        assert!(
            f.to_string().starts_with("protocol nvlink requested"),
            "{f}"
        );
        assert_eq!(fall_back(nvlink, why.clone(), "", true).unwrap_err(), why);
        assert!(probe(nvlink).is_err());
        assert!(probe(Protocol::Tcp).is_ok());
    }
}
