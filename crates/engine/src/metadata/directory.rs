//! Mooncake's key layout over a metadata backend, and the server-less P2P handshake.

use std::sync::Arc;
use std::time::Duration;

use super::descriptor::{RpcMeta, SegmentDesc};
use super::MetadataStore;
use crate::auth::ClusterSecret;
use crate::error::{Code, Error, Result};
use crate::wire::rpc::{self, RpcType};

/// How long a P2P descriptor exchange may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Finds and publishes segment descriptors.
pub enum Directory {
    /// Descriptors live in a key-value store under `mooncake/[cluster/]ram/<name>`.
    Store {
        /// The key-value store.
        store: Arc<dyn MetadataStore>,
        /// Key prefix, including the cluster id.
        prefix: String,
    },
    /// No store: a segment's name is its `host:port` RPC address and the descriptor
    /// is exchanged with a Metadata RPC.
    P2p {
        /// Authenticates the exchange when set.
        secret: Option<ClusterSecret>,
    },
}

/// How long a previous owner's RPC port may take to accept before it is taken for
/// alive anyway (a host that does not answer at all may only be slow).
const OWNER_PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// Whether the server a record names still listens: false only when its host answers
/// and refuses the connection (nobody holds the port: the owner is gone).
fn owner_is_alive(meta: &RpcMeta) -> bool {
    use std::net::{TcpStream, ToSocketAddrs};
    let Ok(addrs) = (meta.ip_or_host_name.as_str(), meta.rpc_port).to_socket_addrs() else {
        return true;
    };
    let mut refused = false;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, OWNER_PROBE_TIMEOUT) {
            Ok(_) => return true,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => refused = true,
            Err(_) => return true,
        }
    }
    !refused
}

impl Directory {
    /// A directory in `store` under `cluster_id`'s namespace.
    pub fn over(store: Arc<dyn MetadataStore>, cluster_id: &str) -> Directory {
        let prefix = if cluster_id.is_empty() {
            "mooncake/".to_owned()
        } else {
            format!("mooncake/{cluster_id}/")
        };
        Directory::Store { store, prefix }
    }

    /// True when descriptors are exchanged peer to peer instead of stored.
    pub fn is_p2p(&self) -> bool {
        matches!(self, Directory::P2p { .. })
    }

    /// Publishes both records of a server; a clash on the RPC record means another
    /// live server already uses this name.
    pub fn publish(&self, desc: &SegmentDesc, rpc_meta: &RpcMeta) -> Result<()> {
        if let Directory::Store { store, prefix } = self {
            let key = format!("{prefix}rpc_meta/{}", desc.name);
            let value = rpc_meta.to_json().to_string();
            if let Err(clash) = store.put(&key, &value) {
                // A process that died without unpublishing leaves its record behind:
                // its successor under the same name replaces it, a live owner keeps it.
                match store.get(&key)?.map(|t| RpcMeta::parse(&t)) {
                    Some(Ok(old)) if old != *rpc_meta && !owner_is_alive(&old) => {
                        log::warn!(
                            "{}: replacing the record of a previous owner that no longer answers on {}:{}",
                            desc.name,
                            old.ip_or_host_name,
                            old.rpc_port
                        );
                        store.remove(&key)?;
                        store.put(&key, &value)?;
                    }
                    _ => return Err(clash),
                }
            }
            if let Err(e) = self.republish(desc) {
                // Half a publication would name a server nobody can reach.
                let _ = store.remove(&key);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Refreshes the descriptor only (after buffers change).
    pub fn republish(&self, desc: &SegmentDesc) -> Result<()> {
        if let Directory::Store { store, prefix } = self {
            store.put(
                &format!("{prefix}ram/{}", desc.name),
                &desc.to_json().to_string(),
            )?;
        }
        Ok(())
    }

    /// Removes the records `publish(_, ours)` made, unless the name's RPC record now
    /// belongs to someone else (a server that took the name over): only what this
    /// server published may be removed by it.
    pub fn unpublish(&self, name: &str, ours: &RpcMeta) -> Result<()> {
        if let Directory::Store { store, prefix } = self {
            let key = format!("{prefix}rpc_meta/{name}");
            match store.get(&key)?.map(|t| RpcMeta::parse(&t)) {
                // Removed already (publish writes this record first, so the other went too).
                None => return Ok(()),
                Some(Ok(meta)) if &meta != ours => {
                    log::info!("{name} is now published by another server; its records stay");
                    return Ok(());
                }
                _ => {}
            }
            store.remove(&format!("{prefix}ram/{name}"))?;
            store.remove(&key)?;
        }
        Ok(())
    }

    /// Fetches a peer's descriptor. `own` is our descriptor, sent in a P2P handshake.
    pub fn fetch(&self, name: &str, own: &SegmentDesc) -> Result<SegmentDesc> {
        match self {
            Directory::Store { store, prefix } => {
                let text = store.get(&format!("{prefix}ram/{name}"))?.ok_or_else(|| {
                    Error::new(
                        Code::SegmentNotFound,
                        format!("no descriptor for segment {name}"),
                    )
                })?;
                SegmentDesc::parse(&text)
            }
            Directory::P2p { secret } => {
                let reply = rpc::call(
                    name,
                    RpcType::Metadata,
                    &own.to_json().to_string(),
                    HANDSHAKE_TIMEOUT,
                    secret.as_ref(),
                )
                .map_err(|e| {
                    Error::new(Code::SegmentNotFound, format!("handshake with {name}: {e}"))
                })?;
                SegmentDesc::parse(&reply)
            }
        }
    }

    /// Where a server's handshake RPC listens, as `host:port`.
    pub fn rpc_address(&self, name: &str) -> Result<String> {
        match self {
            Directory::Store { store, prefix } => {
                let text = store
                    .get(&format!("{prefix}rpc_meta/{name}"))?
                    .ok_or_else(|| {
                        Error::new(Code::SegmentNotFound, format!("no rpc_meta for {name}"))
                    })?;
                let meta = RpcMeta::parse(&text)?;
                Ok(join_host_port(&meta.ip_or_host_name, meta.rpc_port))
            }
            Directory::P2p { .. } => Ok(name.to_owned()),
        }
    }
}

/// `host:port`, bracketing IPv6 literals.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}
