//! The engine's view of segments: its own published descriptor, and a cache of remote
//! ones resolved through the directory.

use crate::util::sync::{Unpoisoned, UnpoisonedRw};
use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::inbox::Inbox;
use crate::error::{Code, Error, Result};
use crate::metadata::{Directory, SegmentDesc};
use crate::transport::{Endpoints, Peer};
use crate::util::id_hash::IdHashing;

/// What this engine shows the world; shared with the RPC server.
pub struct Published {
    /// This engine's own segment descriptor.
    pub desc: RwLock<SegmentDesc>,
    /// Notifications peers sent to this engine.
    pub inbox: Inbox,
}

/// Resolves, caches and refreshes remote segment descriptors.
pub struct Segments {
    /// Where descriptors are looked up and published.
    pub directory: Directory,
    /// What this engine publishes.
    pub own: Arc<Published>,
    by_name: RwLock<HashMap<String, Arc<Peer>>>,
    by_id: RwLock<HashMap<u64, Arc<Peer>, IdHashing>>,
    next_id: AtomicU64,
    /// Serializes resyncs so a burst of stale slices fetches once.
    resync_lock: Mutex<()>,
}

impl Segments {
    /// A resolver over `directory`, publishing `own`.
    pub fn new(directory: Directory, own: Arc<Published>) -> Segments {
        Segments {
            directory,
            own,
            by_name: RwLock::default(),
            by_id: RwLock::default(),
            next_id: AtomicU64::new(1),
            resync_lock: Mutex::new(()),
        }
    }

    /// A copy of this engine's own descriptor.
    pub fn own_desc(&self) -> SegmentDesc {
        self.own.desc.read_locked().clone()
    }

    /// Descriptor and server addresses of `name`, fetched fresh.
    fn fetch(&self, name: &str) -> Result<(SegmentDesc, Endpoints)> {
        let own = self.own_desc();
        let desc = if name == own.name {
            own.clone()
        } else {
            self.directory.fetch(name, &own)?
        };
        if desc.name != name {
            return Err(Error::new(
                Code::Metadata,
                format!(
                    "asked for segment {name}, got a descriptor named {}",
                    desc.name
                ),
            ));
        }
        // The data server's host: published by the peer (Mooncake does too), else the
        // host of its RPC address.
        let rpc = self
            .directory
            .rpc_address(name)
            .unwrap_or_else(|_| name.to_owned());
        let host = desc
            .tcp_data_host
            .as_deref()
            .unwrap_or_else(|| host_of(&rpc));
        let data = resolve(host, desc.tcp_data_port)?;
        Ok((desc, Endpoints { data, rpc }))
    }

    /// Resolves segment `name`, reusing the cached peer when there is one.
    pub fn open(&self, name: &str) -> Result<Arc<Peer>> {
        if let Some(p) = self.by_name.read_locked().get(name) {
            return Ok(p.clone());
        }
        let (desc, data) = self.fetch(name)?;
        let mut by_name = self.by_name.write_locked();
        if let Some(p) = by_name.get(name) {
            return Ok(p.clone());
        }
        let peer = Arc::new(Peer::new(
            self.next_id.fetch_add(1, Ordering::Relaxed),
            desc,
            data,
        ));
        by_name.insert(name.to_owned(), peer.clone());
        self.by_id.write_locked().insert(peer.id, peer.clone());
        Ok(peer)
    }

    /// The peer with handle `id`.
    pub fn get(&self, id: u64) -> Result<Arc<Peer>> {
        self.by_id.read_locked().get(&id).cloned().ok_or_else(|| {
            Error::new(
                Code::SegmentNotFound,
                format!("segment id {id} was never opened"),
            )
        })
    }

    /// Refetches a peer's descriptor (its buffers changed, or it restarted).
    pub fn resync(&self, peer: &Peer) -> Result<()> {
        let _serial = self.resync_lock.locked();
        let (desc, data) = self.fetch(&peer.name)?;
        peer.update(desc, data);
        Ok(())
    }
}

/// The host part of `host:port` (IPv6 in brackets allowed); the whole string if no port.
pub fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match addr.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.parse::<u16>().is_ok() => h,
        _ => addr,
    }
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::new(Code::Metadata, format!("resolving {host}: {e}")))?
        .next()
        .ok_or_else(|| Error::new(Code::Metadata, format!("{host} resolves to no address")))
}
