//! Where segment descriptors and RPC addresses live. `MetadataStore` is the key-value
//! seam (HTTP now; etcd and redis later); `directory` puts Mooncake's key layout on top.

pub mod http_client;
pub mod http_server;

use crate::error::Result;

/// A key-value metadata backend holding JSON strings under Mooncake's keys.
pub trait MetadataStore: Send + Sync {
    /// The value under `key`, or `None` when absent.
    fn get(&self, key: &str) -> Result<Option<String>>;
    /// Stores `value` under `key`, replacing any previous value.
    fn put(&self, key: &str, value: &str) -> Result<()>;
    /// Removes `key`; removing an absent key is not an error.
    fn remove(&self, key: &str) -> Result<()>;
}
