//! Unfinished-put quotas: the bytes a host holds in puts it started and has not ended
//! (PutStart without PutEnd) are capped, so no one can fill the pool with space nobody
//! may read while real objects are evicted to make room for it. The cap is per host
//! ([`Payer`]), not per client id: ids are the clients' own choice, and two rotated ids
//! once held the whole pool.
//!
//! A put's reservation is a [`Hold`] kept in its object: it is returned when the put
//! ends, and however else the object goes (revoked, taken over, removed, cleared),
//! since dropping the hold returns it.

use crate::util::sync::Unpoisoned;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex};

/// Who an unfinished put counts against: the host it came from as the master's RPC
/// server saw it (an IPv4 address; an IPv6 /64, what one host is usually given),
/// which a client cannot choose. A client id only for requests with no network
/// origin: a master driven in process (tests, the simulation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Payer {
    Host(IpAddr),
    Client(u64),
}

impl Payer {
    /// The payer of a request from `peer` (none: in process) by `client`.
    pub fn of(peer: Option<IpAddr>, client: u64) -> Payer {
        match peer {
            None => Payer::Client(client),
            Some(IpAddr::V4(v4)) => Payer::Host(IpAddr::V4(v4)),
            Some(IpAddr::V6(v6)) => Payer::Host(match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
            }),
        }
    }
}

/// Unfinished bytes per payer.
#[derive(Default)]
pub(super) struct PutQuota {
    held: Arc<Mutex<HashMap<Payer, u64>>>,
}

/// `bytes` of `client`'s quota, returned on drop. Boxed: every object has room for
/// one, and only unfinished puts use it (8 bytes an object instead of 24).
pub(super) struct Hold(Box<Reserved>);

struct Reserved {
    held: Arc<Mutex<HashMap<Payer, u64>>>,
    payer: Payer,
    bytes: u64,
}

impl PutQuota {
    /// Reserves `bytes` for `payer` if its unfinished bytes stay within `cap`.
    pub(super) fn reserve(&self, payer: Payer, bytes: u64, cap: u64) -> Option<Hold> {
        let mut held = self.held.locked();
        let mine = held.entry(payer).or_default();
        let after = mine.checked_add(bytes).filter(|after| *after <= cap)?;
        *mine = after;
        Some(Hold(Box::new(Reserved {
            held: self.held.clone(),
            payer,
            bytes,
        })))
    }

    /// Bytes `payer` holds in unfinished puts.
    #[cfg(test)]
    fn held_by(&self, payer: Payer) -> u64 {
        let held = self.held.locked();
        held.get(&payer).copied().unwrap_or(0)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let r = &self.0;
        let mut held = r.held.locked();
        if let Some(mine) = held.get_mut(&r.payer) {
            *mine = mine.saturating_sub(r.bytes);
            if *mine == 0 {
                held.remove(&r.payer);
            }
        }
    }
}

/// The cap on one payer's unfinished bytes: `ratio` of the pool's capacity.
pub(super) fn cap(capacity: u64, ratio: f64) -> u64 {
    (capacity as f64 * ratio.clamp(0.0, 1.0)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_count_until_dropped_and_the_cap_is_per_payer() {
        let q = PutQuota::default();
        let (one, two) = (Payer::Client(1), Payer::Client(2));
        let a = q.reserve(one, 60, 100).unwrap();
        assert!(q.reserve(one, 41, 100).is_none());
        let b = q.reserve(two, 100, 100).unwrap(); // another payer has its own share
        let c = q.reserve(one, 40, 100).unwrap();
        assert_eq!(q.held_by(one), 100);
        drop(a);
        assert_eq!(q.held_by(one), 40);
        drop((b, c));
        assert_eq!((q.held_by(one), q.held_by(two)), (0, 0));
        let all = q.reserve(one, u64::MAX, u64::MAX).unwrap();
        assert!(q.reserve(one, 1, u64::MAX).is_none()); // overflow refused
        drop(all);
    }

    #[test]
    fn a_host_pays_whatever_client_id_it_shows() {
        let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        assert_eq!(Payer::of(ip("10.0.0.7"), 1), Payer::of(ip("10.0.0.7"), 2));
        assert_ne!(Payer::of(ip("10.0.0.7"), 1), Payer::of(ip("10.0.0.8"), 1));
        // One IPv6 /64 is one host; an IPv4-mapped address is its IPv4 host.
        assert_eq!(
            Payer::of(ip("2001:db8::1"), 1),
            Payer::of(ip("2001:db8::ffff:2"), 3)
        );
        assert_ne!(
            Payer::of(ip("2001:db8::1"), 1),
            Payer::of(ip("2001:db8:0:1::1"), 1)
        );
        assert_eq!(
            Payer::of(ip("::ffff:10.0.0.7"), 1),
            Payer::of(ip("10.0.0.7"), 9)
        );
        assert_eq!(Payer::of(None, 5), Payer::Client(5));
    }

    #[test]
    fn an_object_without_a_hold_pays_one_pointer() {
        assert_eq!(std::mem::size_of::<Option<Hold>>(), 8);
    }
}
