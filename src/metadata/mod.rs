//! Where segment descriptors and RPC addresses live. `MetadataStore` is the key-value
//! seam (HTTP and in-process now; etcd and redis later); `Directory` puts Mooncake's
//! key layout, or the server-less P2P handshake, on top.

pub mod descriptor;
pub mod directory;
pub mod embedded;
pub mod http_client;
pub mod http_server;

use std::sync::Arc;

pub use descriptor::{BufferDesc, DeviceDesc, HostInfo, RpcMeta, SegmentDesc};
pub use directory::Directory;

use crate::error::{Code, Error, Result};

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
/// `http://host:port/metadata`, or `embedded` (in-process, for one-process setups).
pub fn open(connection: &str, cluster_id: &str) -> Result<Directory> {
    let conn = connection.trim();
    if conn.eq_ignore_ascii_case("P2PHANDSHAKE") {
        return Ok(Directory::P2p);
    }
    if conn == "embedded" {
        return Ok(Directory::over(
            Arc::new(embedded::EmbeddedStore),
            cluster_id,
        ));
    }
    if conn.starts_with("http://") {
        let store = http_client::HttpMetadataStore::new(conn)?;
        return Ok(Directory::over(Arc::new(store), cluster_id));
    }
    if conn.starts_with("etcd://") || conn.starts_with("redis://") || !conn.contains("://") {
        return Err(Error::new(
            Code::NotSupported,
            format!("metadata backend {conn:?} is not available yet (use P2PHANDSHAKE, http://…, or embedded)"),
        ));
    }
    Err(Error::invalid(format!(
        "unknown metadata connection string {conn:?}"
    )))
}
