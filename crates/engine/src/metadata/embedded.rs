//! `embedded`: an in-process metadata store shared by every engine of this process,
//! within the same bounds as the HTTP server's ([`MetadataLimits::from_env`]).

use crate::util::sync::Unpoisoned;
use std::sync::{Mutex, OnceLock};

use super::quota::{BoundedMap, MetadataLimits};
use super::MetadataStore;
use crate::error::{Error, Result};

/// The in-process metadata store: a map shared by the engines of one process.
pub struct EmbeddedStore;

fn table() -> &'static Mutex<BoundedMap> {
    static TABLE: OnceLock<Mutex<BoundedMap>> = OnceLock::new();
    TABLE.get_or_init(|| Mutex::new(BoundedMap::new(MetadataLimits::from_env())))
}

impl MetadataStore for EmbeddedStore {
    fn get(&self, key: &str) -> Result<Option<String>> {
        Ok(table().locked().get(key).cloned())
    }

    fn put(&self, key: &str, value: &str) -> Result<()> {
        table()
            .locked()
            .insert(key, value, None)
            .map_err(Error::invalid)
    }

    fn remove(&self, key: &str) -> Result<()> {
        table().locked().remove(key);
        Ok(())
    }
}
