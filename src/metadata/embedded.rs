//! `embedded`: an in-process metadata store shared by every engine of this process.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use super::MetadataStore;
use crate::error::Result;

/// The in-process metadata store: a map shared by the engines of one process.
pub struct EmbeddedStore;

fn table() -> &'static Mutex<HashMap<String, String>> {
    static TABLE: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

impl MetadataStore for EmbeddedStore {
    fn get(&self, key: &str) -> Result<Option<String>> {
        Ok(table()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned())
    }

    fn put(&self, key: &str, value: &str) -> Result<()> {
        table()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.to_owned(), value.to_owned());
        Ok(())
    }

    fn remove(&self, key: &str) -> Result<()> {
        table()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
        Ok(())
    }
}
