//! The master server's `SegmentReach`: a transfer engine of its own, started at the
//! first mount, reads one byte at each end of every segment lent before it counts.
//! For the common `host:port` names it asks the node itself for its descriptor, so
//! the check works whatever metadata service the nodes use.
//! Mooncake's master takes mounts at their word; here a segment no process backs
//! (or one larger than what its node registered) is refused with the reason.

use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use crate::auth::ClusterSecret;
use crate::engine::{Engine, EngineConfig, Request};
use crate::error::{Error, Result};
use crate::store::master::SegmentReach;
use crate::store::protocol::SegmentInfo;
use crate::transport::Op;
use crate::util::sync::Unpoisoned;

/// How long one read of a segment may take: a mount waits this long at most.
const READ_TIMEOUT: Duration = Duration::from_secs(3);

/// How the master finds the segments it checks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum VerifyMounts {
    /// Mounts are taken at their word (Mooncake's behaviour).
    #[default]
    Off,
    /// Segments are looked up in this metadata service (a connection string as
    /// nodes give it: `http://...`, `etcd://...`, `redis://...`, `P2PHANDSHAKE`).
    Via(String),
    /// A segment named `host:port` (every engine's default name) is asked for its
    /// descriptor there, peer to peer, whatever metadata service its node uses; one
    /// named otherwise is looked up in the master's own metadata server, or, when it
    /// runs none, taken at its word with a warning.
    Auto,
}

/// One engine reading segments, found through one metadata service; started at the
/// first read. Reads go one at a time (mounts are rare).
struct Reader {
    metadata: String,
    /// The engine and its two-byte landing buffer, once started.
    engine: Mutex<Option<(Engine, u64)>>,
}

impl Reader {
    fn new(metadata: String) -> Reader {
        Reader {
            metadata,
            engine: Mutex::new(None),
        }
    }

    fn start_engine(&self, bind: IpAddr, secret: &Option<ClusterSecret>) -> Result<(Engine, u64)> {
        let config = EngineConfig {
            metadata: self.metadata.clone(),
            bind_address: bind,
            rpc_port: 0,
            transfer_timeout: READ_TIMEOUT,
            max_retries: 1,
            cluster_secret: secret.clone(),
            ..EngineConfig::default()
        };
        let engine = Engine::new(config)
            .map_err(|e| e.prefixed("starting the engine that checks mounts"))?;
        let landing = engine.allocate_buffer(2, "cpu:0")? as u64;
        Ok((engine, landing))
    }

    /// Reads the first and last byte of `segment`, with one retry on a fresh
    /// descriptor (its node may have restarted under the same name).
    fn read_ends(
        &self,
        bind: IpAddr,
        secret: &Option<ClusterSecret>,
        segment: &SegmentInfo,
    ) -> Result<()> {
        let mut slot = self.engine.locked();
        if slot.is_none() {
            *slot = Some(self.start_engine(bind, secret)?);
        }
        let Some((engine, landing)) = slot.as_ref() else {
            return Err(Error::invalid("no engine to check mounts with"));
        };
        let id = engine.open_segment(&segment.name)?;
        let last = segment.base + (segment.size - 1);
        let reads =
            [(segment.base, *landing), (last, landing + 1)].map(|(remote, local)| Request {
                op: Op::Read,
                local,
                segment: id,
                remote,
                len: 1,
            });
        // SAFETY: `landing` is this engine's own two-byte buffer, alive as long as the
        // engine; nothing reads it, and `transfer_sync` returns once no task can
        // touch it.
        let first = unsafe { engine.transfer_sync(&reads) };
        if first.is_ok() {
            return first;
        }
        engine.resync_segment(id)?;
        // SAFETY: as above.
        unsafe { engine.transfer_sync(&reads) }
    }
}

/// The master server's `SegmentReach`.
pub struct EngineReach {
    /// For segments named `host:port`, when asked peer to peer.
    by_address: Option<Reader>,
    /// For the others (and `host:port` ones when `by_address` is `None`).
    by_name: Option<Reader>,
    bind: IpAddr,
    secret: Option<ClusterSecret>,
    warned: std::sync::Once,
}

impl EngineReach {
    /// Checks mounts as `verify` says, given the metadata server the master runs
    /// (`own_metadata`, a URL it reaches itself); its engines listen on `bind`. `None`
    /// for `Off`.
    pub fn new(
        verify: &VerifyMounts,
        own_metadata: Option<String>,
        bind: IpAddr,
        secret: Option<ClusterSecret>,
    ) -> Option<EngineReach> {
        let (by_address, by_name) = match verify {
            VerifyMounts::Off => return None,
            VerifyMounts::Via(url) => (None, Some(url.clone())),
            VerifyMounts::Auto => (Some("P2PHANDSHAKE".to_owned()), own_metadata),
        };
        Some(EngineReach {
            by_address: by_address.map(Reader::new),
            by_name: by_name.map(Reader::new),
            bind,
            secret,
            warned: std::sync::Once::new(),
        })
    }
}

/// Whether `name` reads as `host:port` (a peer-to-peer segment name).
fn is_address(name: &str) -> bool {
    name.rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
}

impl SegmentReach for EngineReach {
    fn reach(&self, segment: &SegmentInfo) -> Result<()> {
        let reader = match &self.by_address {
            Some(r) if is_address(&segment.name) => Some(r),
            _ => self.by_name.as_ref(),
        };
        let Some(reader) = reader else {
            self.warned.call_once(|| {
                log::warn!(
                    "mounts are not all checked: segment {:?} is no host:port and this \
                     master runs no metadata server to find it in (give --verify-metadata URL)",
                    segment.name
                )
            });
            return Ok(());
        };
        reader.read_ends(self.bind, &self.secret, segment)
    }
}

#[cfg(test)]
mod tests {
    use super::is_address;

    #[test]
    fn peer_to_peer_names_are_host_and_port() {
        assert!(is_address("10.0.0.2:15000"));
        assert!(is_address("node-a.local:1"));
        assert!(is_address("[::1]:80"));
        assert!(!is_address("node-a"));
        assert!(!is_address("node:a"));
        assert!(!is_address(":80"));
        assert!(!is_address("h:70000"));
    }
}
