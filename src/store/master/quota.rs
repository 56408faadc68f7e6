//! Unfinished-put quotas: the bytes a client holds in puts it started and has not
//! ended (PutStart without PutEnd) are capped, so a client cannot fill the pool with
//! space nobody may read while real objects are evicted to make room for it.
//!
//! A put's reservation is a [`Hold`] kept in its object: it is returned when the put
//! ends, and however else the object goes (revoked, taken over, removed, cleared),
//! since dropping the hold returns it.

use crate::util::sync::Unpoisoned;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Unfinished bytes per client.
#[derive(Default)]
pub(super) struct PutQuota {
    held: Arc<Mutex<HashMap<u64, u64>>>,
}

/// `bytes` of `client`'s quota, returned on drop. Boxed: every object has room for
/// one, and only unfinished puts use it (8 bytes an object instead of 24).
pub(super) struct Hold(Box<Reserved>);

struct Reserved {
    held: Arc<Mutex<HashMap<u64, u64>>>,
    client: u64,
    bytes: u64,
}

impl PutQuota {
    /// Reserves `bytes` for `client` if its unfinished bytes stay within `cap`.
    pub(super) fn reserve(&self, client: u64, bytes: u64, cap: u64) -> Option<Hold> {
        let mut held = self.held.locked();
        let mine = held.entry(client).or_default();
        let after = mine.checked_add(bytes).filter(|after| *after <= cap)?;
        *mine = after;
        Some(Hold(Box::new(Reserved {
            held: self.held.clone(),
            client,
            bytes,
        })))
    }

    /// Bytes `client` holds in unfinished puts.
    #[cfg(test)]
    fn held_by(&self, client: u64) -> u64 {
        let held = self.held.locked();
        held.get(&client).copied().unwrap_or(0)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let r = &self.0;
        let mut held = r.held.locked();
        if let Some(mine) = held.get_mut(&r.client) {
            *mine = mine.saturating_sub(r.bytes);
            if *mine == 0 {
                held.remove(&r.client);
            }
        }
    }
}

/// The cap on one client's unfinished bytes: `ratio` of the pool's capacity.
pub(super) fn cap(capacity: u64, ratio: f64) -> u64 {
    (capacity as f64 * ratio.clamp(0.0, 1.0)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_count_until_dropped_and_the_cap_is_per_client() {
        let q = PutQuota::default();
        let a = q.reserve(1, 60, 100).unwrap();
        assert!(q.reserve(1, 41, 100).is_none());
        let b = q.reserve(2, 100, 100).unwrap(); // another client has its own share
        let c = q.reserve(1, 40, 100).unwrap();
        assert_eq!(q.held_by(1), 100);
        drop(a);
        assert_eq!(q.held_by(1), 40);
        drop((b, c));
        assert_eq!((q.held_by(1), q.held_by(2)), (0, 0));
        let all = q.reserve(1, u64::MAX, u64::MAX).unwrap();
        assert!(q.reserve(1, 1, u64::MAX).is_none()); // overflow refused
        drop(all);
    }

    #[test]
    fn an_object_without_a_hold_pays_one_pointer() {
        assert_eq!(std::mem::size_of::<Option<Hold>>(), 8);
    }
}
