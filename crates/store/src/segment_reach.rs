//! The master server's `SegmentReach`: a transfer engine of its own, started at the
//! first mount, reads one byte at each end of every segment lent before it counts.
//! For the common `host:port` names it can ask the node itself for its descriptor,
//! whatever metadata service the nodes use.
//! Mooncake's master takes mounts at their word; here a segment no process backs
//! (or one larger than what its node registered) is refused with the reason.

use std::net::IpAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::auth::ClusterSecret;
use crate::engine::{Engine, EngineConfig, Request};
use crate::error::{Code, Error, Result};
use crate::master::SegmentReach;
use crate::protocol::SegmentInfo;
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
    /// Segments are looked up in the master's own metadata server, if it runs one,
    /// and one named `host:port` (every engine's default name) not found there is
    /// asked for its descriptor at that address, peer to peer. Without a metadata
    /// server, what cannot be found is taken at its word, with a warning.
    Auto,
}

/// Reads in flight at once per engine (each lands in its own two bytes); more wait.
const LANDING_SLOTS: usize = 32;

/// A started engine and the buffer reads land in, two bytes a slot.
struct Started {
    engine: Engine,
    landing: u64,
    free: Mutex<Vec<u64>>,
    freed: Condvar,
}

impl Started {
    /// A slot of its own for one read (waits while every slot is taken).
    fn take_slot(&self) -> u64 {
        let mut free = self.free.locked();
        loop {
            if let Some(slot) = free.pop() {
                return slot;
            }
            free = self.freed.wait(free).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn give_back(&self, slot: u64) {
        self.free.locked().push(slot);
        self.freed.notify_one();
    }
}

/// One engine reading segments, found through one metadata service; started at the
/// first read. A read that hangs (an address that never answers) holds up no other.
struct Reader {
    metadata: String,
    started: Mutex<Option<Arc<Started>>>,
}

impl Reader {
    fn new(metadata: String) -> Reader {
        Reader {
            metadata,
            started: Mutex::new(None),
        }
    }

    fn engine(&self, secret: &Option<ClusterSecret>) -> Result<Arc<Started>> {
        let mut started = self.started.locked();
        if let Some(s) = started.as_ref() {
            return Ok(s.clone());
        }
        let config = EngineConfig {
            metadata: self.metadata.clone(),
            // It only reads: its own servers need no other host, and loopback
            // always has an address (a wildcard needs a route to name itself).
            bind_address: IpAddr::from([127, 0, 0, 1]),
            rpc_port: 0,
            transfer_timeout: READ_TIMEOUT,
            max_retries: 1,
            cluster_secret: secret.clone(),
            ..EngineConfig::default()
        };
        let engine = Engine::new(config)
            .map_err(|e| e.prefixed("starting the engine that checks mounts"))?;
        let landing = engine.allocate_buffer(2 * LANDING_SLOTS, "cpu:0")? as u64;
        let s = Arc::new(Started {
            engine,
            landing,
            free: Mutex::new((0..LANDING_SLOTS as u64).collect()),
            freed: Condvar::new(),
        });
        *started = Some(s.clone());
        Ok(s)
    }

    /// Reads the first and last byte of `segment`, with one retry on a fresh
    /// descriptor (its node may have restarted under the same name).
    fn read_ends(&self, secret: &Option<ClusterSecret>, segment: &SegmentInfo) -> Result<()> {
        let s = self.engine(secret)?;
        let id = s.engine.open_segment(&segment.name)?;
        let slot = s.take_slot();
        let at = s.landing + 2 * slot;
        let last = segment.base + (segment.size - 1);
        let reads = [(segment.base, at), (last, at + 1)].map(|(remote, local)| Request {
            op: Op::Read,
            local,
            segment: id,
            remote,
            len: 1,
        });
        // SAFETY: `at` is a slot of this engine's own landing buffer, alive as long as
        // the engine and used by no other read until given back; nothing reads it, and
        // `transfer_sync` returns once no task can touch it.
        let mut read = unsafe { s.engine.transfer_sync(&reads) };
        if read.is_err() {
            read = s.engine.resync_segment(id).and_then(|()| {
                // SAFETY: as above.
                unsafe { s.engine.transfer_sync(&reads) }
            });
        }
        s.give_back(slot);
        read
    }
}

/// The master server's `SegmentReach`.
pub struct EngineReach {
    /// For segments named `host:port`, when asked peer to peer.
    by_address: Option<Reader>,
    /// For the others (and `host:port` ones when `by_address` is `None`).
    by_name: Option<Reader>,
    secret: Option<ClusterSecret>,
    warned: std::sync::Once,
}

impl EngineReach {
    /// Checks mounts as `verify` says, given the metadata server the master runs
    /// (`own_metadata`, a URL it reaches itself). `None`
    /// for `Off`.
    pub fn new(
        verify: &VerifyMounts,
        own_metadata: Option<String>,
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

impl EngineReach {
    /// Takes `segment` unchecked: nothing here can find it (`why`), though its node may
    /// well publish it in a metadata service this master was not told of.
    fn unverifiable(&self, segment: &SegmentInfo, why: &str) -> Result<()> {
        self.warned.call_once(|| {
            log::warn!(
                "mounts are not all checked: segment {:?} {why}; give the master \
                 --verify-metadata URL (the nodes' metadata service) to check every one",
                segment.name
            )
        });
        Ok(())
    }
}

/// Whether `e` says the segment is not known where it was looked for.
fn not_found(e: &Error) -> bool {
    e.code() == Code::SegmentNotFound
}

impl SegmentReach for EngineReach {
    /// Where the master knows the nodes' metadata (`by_name`), a segment it cannot
    /// find or read is refused. Without it, a `host:port` name is asked peer to peer:
    /// a descriptor there must be read; no answer there, or another name, cannot be
    /// checked and is taken, with a warning.
    fn reach(&self, segment: &SegmentInfo) -> Result<()> {
        let address = is_address(&segment.name);
        let peer_to_peer = self.by_address.as_ref().filter(|_| address);
        if let Some(reader) = &self.by_name {
            match reader.read_ends(&self.secret, segment) {
                Err(e) if not_found(&e) && peer_to_peer.is_some() => {}
                decided => return decided,
            }
        }
        let Some(reader) = peer_to_peer else {
            return self.unverifiable(segment, "is no host:port");
        };
        match reader.read_ends(&self.secret, segment) {
            Err(e) if not_found(&e) && self.by_name.is_none() => {
                self.unverifiable(segment, "does not answer at its name")
            }
            decided => decided,
        }
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
