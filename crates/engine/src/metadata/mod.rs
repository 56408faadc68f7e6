//! Where segment descriptors and RPC addresses live. `MetadataStore` is the key-value
//! seam (HTTP, etcd, redis, in-process); `Directory` puts Mooncake's key layout, or the
//! server-less P2P handshake, on top.

#![forbid(unsafe_code)]

pub mod descriptor;
pub mod directory;
pub mod embedded;
pub mod etcd_store;
pub mod http_client;
pub mod http_server;
pub mod quota;
pub mod redis_store;

use std::sync::Arc;

pub use descriptor::{BufferDesc, DeviceDesc, HostInfo, RpcMeta, SegmentDesc};
pub use directory::Directory;

use crate::auth::ClusterSecret;
use crate::error::{Error, Result};

/// A key-value metadata backend holding JSON strings under Mooncake's keys.
pub trait MetadataStore: Send + Sync {
    /// The value under `key`, or `None` when absent.
    fn get(&self, key: &str) -> Result<Option<String>>;
    /// Stores `value` under `key`, replacing any previous value.
    fn put(&self, key: &str, value: &str) -> Result<()>;
    /// Removes `key`; removing an absent key is not an error.
    fn remove(&self, key: &str) -> Result<()>;
}

/// Opens the directory named by a Mooncake connection string: `P2PHANDSHAKE`,
/// `http://host:port/metadata`, `etcd://host:port[,host:port...]` (a string without a
/// scheme means etcd too, as in Mooncake), `redis://host:port`, or `embedded`
/// (in-process, for one-process setups). With a cluster secret, P2P handshakes
/// authenticate and HTTP writes are signed (`crate::auth`).
pub fn open(
    connection: &str,
    cluster_id: &str,
    secret: Option<&ClusterSecret>,
) -> Result<Directory> {
    let conn = connection.trim();
    if conn.eq_ignore_ascii_case("P2PHANDSHAKE") {
        return Ok(Directory::P2p {
            secret: secret.cloned(),
        });
    }
    let store: Arc<dyn MetadataStore> = if conn == "embedded" {
        Arc::new(embedded::EmbeddedStore)
    } else if conn.starts_with("http://") {
        Arc::new(http_client::HttpMetadataStore::new(conn)?.with_secret(secret.cloned()))
    } else if let Some(endpoints) = conn.strip_prefix("etcd://") {
        Arc::new(etcd_store::EtcdMetadataStore::new(endpoints)?)
    } else if let Some(addr) = conn.strip_prefix("redis://") {
        Arc::new(redis_store::RedisMetadataStore::new(addr)?)
    } else if !conn.contains("://") && !conn.is_empty() {
        Arc::new(etcd_store::EtcdMetadataStore::new(conn)?)
    } else {
        return Err(Error::invalid(format!(
            "unknown metadata connection string {conn:?} (use P2PHANDSHAKE, http://…, \
             etcd://…, redis://… or embedded)"
        )));
    };
    Ok(Directory::over(store, cluster_id))
}

/// A stored value as text: descriptors are JSON, so anything else is an error naming
/// the backend and key.
fn utf8_value(backend: &str, key: &str, value: Vec<u8>) -> Result<String> {
    String::from_utf8(value).map_err(|_| {
        Error::new(
            crate::error::Code::Metadata,
            format!("{backend}: value of {key:?} is not UTF-8"),
        )
    })
}
