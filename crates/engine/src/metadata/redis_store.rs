//! `MetadataStore` on Redis (`redis://host:port`): plain `GET`/`SET`/`DEL` of
//! Mooncake's keys with JSON values, as Mooncake's redis backend does; credentials and
//! database from `MC_REDIS_USERNAME`, `MC_REDIS_PASSWORD`, `MC_REDIS_DB_INDEX`.

use crate::error::Result;
use crate::metadata::MetadataStore;
use crate::redis::{RedisClient, RedisOptions};

/// Engine metadata kept in Redis.
#[derive(Debug)]
pub struct RedisMetadataStore {
    client: RedisClient,
}

impl RedisMetadataStore {
    /// `addr` is `host:port`; options come from the environment. Nothing is
    /// contacted yet.
    pub fn new(addr: &str) -> Result<RedisMetadataStore> {
        Ok(RedisMetadataStore {
            client: RedisClient::new(addr, RedisOptions::from_env()?)?,
        })
    }
}

impl MetadataStore for RedisMetadataStore {
    fn get(&self, key: &str) -> Result<Option<String>> {
        let Some(value) = self.client.get(key.as_bytes())? else {
            return Ok(None);
        };
        let backend = format!("redis {}", self.client.addr());
        super::utf8_value(&backend, key, value).map(Some)
    }

    fn put(&self, key: &str, value: &str) -> Result<()> {
        self.client.set(key.as_bytes(), value.as_bytes())
    }

    fn remove(&self, key: &str) -> Result<()> {
        self.client.del(key.as_bytes()).map(drop)
    }
}
