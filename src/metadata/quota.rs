//! Bounds on a metadata store (the HTTP server's and the in-process one): a writer
//! cannot grow it without limit. A put over a bound is refused and stores nothing.

use std::collections::HashMap;

/// Bounds on one metadata store. [`MetadataLimits::from_env`] reads overrides from
/// `MC_METADATA_MAX_VALUE_BYTES`, `MC_METADATA_MAX_KEYS` and `MC_METADATA_MAX_BYTES`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetadataLimits {
    /// Largest value, in bytes.
    pub max_value_bytes: usize,
    /// Most keys stored at once.
    pub max_keys: usize,
    /// Most bytes of keys and values stored at once.
    pub max_total_bytes: usize,
}

impl Default for MetadataLimits {
    fn default() -> Self {
        MetadataLimits {
            max_value_bytes: 4 << 20,
            max_keys: 100_000,
            max_total_bytes: 256 << 20,
        }
    }
}

impl MetadataLimits {
    /// The defaults with the `MC_METADATA_*` overrides of the environment applied (an
    /// unparsable or zero value is reported and ignored).
    pub fn from_env() -> MetadataLimits {
        let d = MetadataLimits::default();
        let get = |name: &str, default: usize| match std::env::var(name) {
            Err(_) => default,
            Ok(raw) => match raw.trim().parse::<usize>() {
                Ok(n) if n > 0 => n,
                _ => {
                    log::warn!("ignoring {name}={raw:?}: expected a positive whole number");
                    default
                }
            },
        };
        MetadataLimits {
            max_value_bytes: get("MC_METADATA_MAX_VALUE_BYTES", d.max_value_bytes),
            max_keys: get("MC_METADATA_MAX_KEYS", d.max_keys),
            max_total_bytes: get("MC_METADATA_MAX_BYTES", d.max_total_bytes),
        }
    }
}

/// A string map within [`MetadataLimits`].
#[derive(Default)]
pub struct BoundedMap {
    map: HashMap<String, String>,
    /// Bytes of every key and value stored.
    bytes: usize,
    limits: MetadataLimits,
}

impl BoundedMap {
    /// An empty map within `limits`.
    pub fn new(limits: MetadataLimits) -> BoundedMap {
        BoundedMap {
            map: HashMap::new(),
            bytes: 0,
            limits,
        }
    }

    /// Changes the bounds (what is stored stays, even if over the new ones).
    pub fn set_limits(&mut self, limits: MetadataLimits) {
        self.limits = limits;
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&String> {
        self.map.get(key)
    }

    /// Stores `value` under `key`, or says which bound it would break (storing nothing).
    pub fn insert(&mut self, key: &str, value: &str) -> Result<(), String> {
        let l = &self.limits;
        if value.len() > l.max_value_bytes {
            return Err(format!(
                "metadata value of {} bytes exceeds the limit of {} bytes",
                value.len(),
                l.max_value_bytes
            ));
        }
        let old = self.map.get(key).map(|v| key.len() + v.len());
        if old.is_none() && self.map.len() >= l.max_keys {
            return Err(format!("metadata store full: {} keys stored", l.max_keys));
        }
        let bytes = self.bytes - old.unwrap_or(0) + key.len() + value.len();
        if bytes > l.max_total_bytes {
            return Err(format!(
                "metadata store full: {} more bytes would exceed the limit of {} bytes",
                value.len(),
                l.max_total_bytes
            ));
        }
        self.map.insert(key.to_owned(), value.to_owned());
        self.bytes = bytes;
        Ok(())
    }

    /// Removes `key`; its value if it was there.
    pub fn remove(&mut self, key: &str) -> Option<String> {
        let v = self.map.remove(key)?;
        self.bytes -= key.len() + v.len();
        Some(v)
    }

    /// Keys stored.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no key is stored.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> BoundedMap {
        BoundedMap::new(MetadataLimits {
            max_value_bytes: 8,
            max_keys: 2,
            max_total_bytes: 20,
        })
    }

    #[test]
    fn each_bound_refuses_and_stores_nothing() {
        let mut m = small();
        assert!(m.insert("a", "123456789").is_err()); // value over 8 bytes
        assert!(m.is_empty());
        m.insert("a", "12345678").unwrap(); // 9 bytes
        m.insert("b", "12345678").unwrap(); // 18 bytes
        assert!(m.insert("c", "1").is_err()); // a third key
        assert!(m.insert("a", "123456789").is_err()); // too big still
        m.insert("a", "123").unwrap(); // replacing frees bytes: 13
        m.remove("b").unwrap(); // 4
        m.insert("cc", "1234567").unwrap(); // 4 + 9 = 13
        assert!(m.insert("cc", "12345678").is_ok()); // 4 + 10 = 14
        assert_eq!(m.get("cc").map(String::as_str), Some("12345678"));
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn total_bytes_bound_counts_keys_and_values() {
        let mut m = BoundedMap::new(MetadataLimits {
            max_value_bytes: 100,
            max_keys: 100,
            max_total_bytes: 10,
        });
        m.insert("k1", "123").unwrap(); // 5
        m.insert("k2", "123").unwrap(); // 10
        assert!(m.insert("k3", "").is_err()); // 12 > 10
        assert!(m.get("k3").is_none());
        m.remove("k1");
        m.insert("k3", "").unwrap();
    }
}
