//! `MetadataStore` on etcd (`etcd://host:port[,host:port...]`, or a bare `host:port`
//! as Mooncake reads it): the same keys and JSON values as Mooncake's etcd backend, so
//! engines of both find each other through one etcd.

use crate::error::Result;
use crate::etcd::EtcdClient;
use crate::metadata::MetadataStore;

/// Engine metadata kept in etcd.
#[derive(Debug)]
pub struct EtcdMetadataStore {
    client: EtcdClient,
}

impl EtcdMetadataStore {
    /// `endpoints` as [`EtcdClient::new`] takes them. Nothing is contacted yet.
    pub fn new(endpoints: &str) -> Result<EtcdMetadataStore> {
        Ok(EtcdMetadataStore {
            client: EtcdClient::new(endpoints)?,
        })
    }
}

impl MetadataStore for EtcdMetadataStore {
    fn get(&self, key: &str) -> Result<Option<String>> {
        let Some(kv) = self.client.get(key.as_bytes())? else {
            return Ok(None);
        };
        let backend = format!("etcd {}", self.client.describe());
        super::utf8_value(&backend, key, kv.value).map(Some)
    }

    fn put(&self, key: &str, value: &str) -> Result<()> {
        self.client
            .put(key.as_bytes(), value.as_bytes(), 0)
            .map(drop)
    }

    fn remove(&self, key: &str) -> Result<()> {
        self.client.delete(key.as_bytes()).map(drop)
    }
}
