//! Bounds on a metadata store (the HTTP server's and the in-process one): a writer
//! cannot grow it without limit, and one peer (one IP address, or IPv6 /64) can hold
//! only a share of it, so a single host cannot fill the store and keep every other
//! engine from publishing. A put over a bound is refused and stores nothing.

use std::collections::HashMap;
use std::net::IpAddr;

/// Bounds on one metadata store. [`MetadataLimits::from_env`] reads overrides from
/// `MC_METADATA_MAX_VALUE_BYTES`, `MC_METADATA_MAX_KEYS`, `MC_METADATA_MAX_BYTES` and
/// `MC_METADATA_PEER_SHARE_PERCENT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetadataLimits {
    /// Largest value, in bytes.
    pub max_value_bytes: usize,
    /// Most keys stored at once.
    pub max_keys: usize,
    /// Most bytes of keys and values stored at once.
    pub max_total_bytes: usize,
    /// Percent of `max_keys` and of `max_total_bytes` the keys one peer wrote may
    /// take (100: no share; writes from within the process have none).
    pub peer_share_percent: usize,
}

impl Default for MetadataLimits {
    fn default() -> Self {
        MetadataLimits {
            max_value_bytes: 4 << 20,
            max_keys: 100_000,
            max_total_bytes: 256 << 20,
            peer_share_percent: 25,
        }
    }
}

impl MetadataLimits {
    /// The defaults with the `MC_METADATA_*` overrides of the environment applied (an
    /// unparsable or zero value, or a share over 100, is reported and ignored).
    pub fn from_env() -> MetadataLimits {
        let d = MetadataLimits::default();
        let get = |name: &str, default: usize, most: usize| match std::env::var(name) {
            Err(_) => default,
            Ok(raw) => match raw.trim().parse::<usize>() {
                Ok(n) if n > 0 && n <= most => n,
                _ => {
                    log::warn!("ignoring {name}={raw:?}: expected a whole number from 1 to {most}");
                    default
                }
            },
        };
        MetadataLimits {
            max_value_bytes: get("MC_METADATA_MAX_VALUE_BYTES", d.max_value_bytes, usize::MAX),
            max_keys: get("MC_METADATA_MAX_KEYS", d.max_keys, usize::MAX),
            max_total_bytes: get("MC_METADATA_MAX_BYTES", d.max_total_bytes, usize::MAX),
            peer_share_percent: get("MC_METADATA_PEER_SHARE_PERCENT", d.peer_share_percent, 100),
        }
    }

    /// Keys and bytes one peer may hold.
    fn peer_share(&self) -> Usage {
        let percent = self.peer_share_percent.min(100) as u128;
        let share = |n: usize| ((n as u128 * percent / 100) as usize).max(1);
        Usage {
            keys: share(self.max_keys),
            bytes: share(self.max_total_bytes),
        }
    }
}

/// Keys and bytes (of keys and values) held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Usage {
    keys: usize,
    bytes: usize,
}

/// A value and the peer whose write stored it (`None`: the process itself).
struct Entry {
    value: String,
    writer: Option<IpAddr>,
}

/// A string map within [`MetadataLimits`].
#[derive(Default)]
pub struct BoundedMap {
    map: HashMap<String, Entry>,
    /// Bytes of every key and value stored.
    bytes: usize,
    /// What each peer's writes hold, by [`crate::net::peer_group`].
    peers: HashMap<IpAddr, Usage>,
    limits: MetadataLimits,
}

impl BoundedMap {
    /// An empty map within `limits`.
    pub fn new(limits: MetadataLimits) -> BoundedMap {
        BoundedMap {
            limits,
            ..BoundedMap::default()
        }
    }

    /// Changes the bounds (what is stored stays, even if over the new ones).
    pub fn set_limits(&mut self, limits: MetadataLimits) {
        self.limits = limits;
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&String> {
        self.map.get(key).map(|e| &e.value)
    }

    /// Stores `value` under `key` for `peer` (`None`: a write from within this
    /// process), or says which bound it would break (storing nothing). The key then
    /// counts in the writer's share, no longer in a previous writer's.
    pub fn insert(&mut self, key: &str, value: &str, peer: Option<IpAddr>) -> Result<(), String> {
        let l = &self.limits;
        if value.len() > l.max_value_bytes {
            return Err(format!(
                "metadata value of {} bytes exceeds the limit of {} bytes",
                value.len(),
                l.max_value_bytes
            ));
        }
        let old = self.map.get(key);
        let old_bytes = old.map(|e| key.len() + e.value.len());
        if old.is_none() && self.map.len() >= l.max_keys {
            return Err(format!("metadata store full: {} keys stored", l.max_keys));
        }
        let bytes = self.bytes - old_bytes.unwrap_or(0) + key.len() + value.len();
        if bytes > l.max_total_bytes {
            return Err(format!(
                "metadata store full: {} more bytes would exceed the limit of {} bytes",
                value.len(),
                l.max_total_bytes
            ));
        }
        let writer = peer.map(crate::net::peer_group);
        if let Some(p) = writer {
            let mut held = self.peers.get(&p).copied().unwrap_or_default();
            if let Some(b) = old_bytes.filter(|_| old.is_some_and(|e| e.writer == writer)) {
                held.keys -= 1;
                held.bytes -= b;
            }
            let share = l.peer_share();
            if held.keys + 1 > share.keys || held.bytes + key.len() + value.len() > share.bytes {
                return Err(format!(
                    "metadata share of {p} used up: its writes hold {} keys and {} bytes, and one peer may hold {} keys and {} bytes ({}% of the store)",
                    held.keys, held.bytes, share.keys, share.bytes, l.peer_share_percent
                ));
            }
        }
        self.remove(key);
        self.charge(writer, key.len() + value.len(), true);
        self.map.insert(
            key.to_owned(),
            Entry {
                value: value.to_owned(),
                writer,
            },
        );
        self.bytes = bytes;
        Ok(())
    }

    /// Removes `key`; its value if it was there.
    pub fn remove(&mut self, key: &str) -> Option<String> {
        let e = self.map.remove(key)?;
        let bytes = key.len() + e.value.len();
        self.bytes -= bytes;
        self.charge(e.writer, bytes, false);
        Some(e.value)
    }

    /// Counts a key of `bytes` (with its value) in or out of `writer`'s share.
    fn charge(&mut self, writer: Option<IpAddr>, bytes: usize, add: bool) {
        let Some(p) = writer else { return };
        let held = self.peers.entry(p).or_default();
        if add {
            held.keys += 1;
            held.bytes += bytes;
        } else {
            held.keys -= 1;
            held.bytes -= bytes;
        }
        if held.keys == 0 {
            self.peers.remove(&p);
        }
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
            peer_share_percent: 100,
        })
    }

    #[test]
    fn each_bound_refuses_and_stores_nothing() {
        let mut m = small();
        assert!(m.insert("a", "123456789", None).is_err()); // value over 8 bytes
        assert!(m.is_empty());
        m.insert("a", "12345678", None).unwrap(); // 9 bytes
        m.insert("b", "12345678", None).unwrap(); // 18 bytes
        assert!(m.insert("c", "1", None).is_err()); // a third key
        assert!(m.insert("a", "123456789", None).is_err()); // too big still
        m.insert("a", "123", None).unwrap(); // replacing frees bytes: 13
        m.remove("b").unwrap(); // 4
        m.insert("cc", "1234567", None).unwrap(); // 4 + 9 = 13
        assert!(m.insert("cc", "12345678", None).is_ok()); // 4 + 10 = 14
        assert_eq!(m.get("cc").map(String::as_str), Some("12345678"));
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn total_bytes_bound_counts_keys_and_values() {
        let mut m = BoundedMap::new(MetadataLimits {
            max_value_bytes: 100,
            max_keys: 100,
            max_total_bytes: 10,
            peer_share_percent: 100,
        });
        m.insert("k1", "123", None).unwrap(); // 5
        m.insert("k2", "123", None).unwrap(); // 10
        assert!(m.insert("k3", "", None).is_err()); // 12 > 10
        assert!(m.get("k3").is_none());
        m.remove("k1");
        m.insert("k3", "", None).unwrap();
    }

    #[test]
    fn one_peer_holds_only_its_share_and_others_still_write() {
        let mut m = BoundedMap::new(MetadataLimits {
            max_value_bytes: 100,
            max_keys: 40,
            max_total_bytes: 1000,
            peer_share_percent: 25, // 10 keys, 250 bytes
        });
        let greedy = Some(IpAddr::from([10, 0, 0, 1]));
        let other = Some(IpAddr::from([10, 0, 0, 2]));
        for i in 0..10 {
            m.insert(&format!("g{i}"), "v", greedy).unwrap();
        }
        let refused = m.insert("g10", "v", greedy).unwrap_err();
        assert!(refused.contains("share of 10.0.0.1"), "{refused}");
        assert!(m.get("g10").is_none());
        // Replacing its own key fits; so do other peers' writes and the process's own.
        m.insert("g0", "new value", greedy).unwrap();
        m.insert("o0", "v", other).unwrap();
        m.insert("local", "v", None).unwrap();
        // Bytes are shared out too: 250 bytes at most.
        assert!(m.insert("o1", &"x".repeat(100), other).is_ok());
        assert!(m.insert("o2", &"x".repeat(100), other).is_ok());
        assert!(m.insert("o3", &"x".repeat(100), other).is_err());
        // A key rewritten by another peer counts in the new writer's share.
        m.insert("g1", "taken over", other).unwrap();
        m.insert("g10", "v", greedy).unwrap();
        // Removing frees the share.
        m.remove("g2");
        m.insert("g11", "v", greedy).unwrap();
        assert!(m.insert("g12", "v", greedy).is_err());
        // IPv6 peers share by /64.
        let v6 = |last: u16| Some(IpAddr::from([0x2001, 0xdb8, 0, 1, 0, 0, 0, last]));
        for i in 0..10 {
            m.insert(&format!("six{i}"), "v", v6(i)).unwrap();
        }
        assert!(m.insert("six10", "v", v6(99)).is_err());
    }
}
