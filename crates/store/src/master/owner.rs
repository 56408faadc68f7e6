//! Who a segment name belongs to. Names are public (`/get_all_segments`), so taking a
//! name first proves nothing: the master hands the node that mounts a name a ticket
//! (`OwnerTicket`: when, and a MAC under the master's owner key), the node keeps it and
//! shows it at every remount, and the name goes to whoever shows the earliest valid
//! ticket for it. A squatter who took the name while its node was away (dropped past
//! its TTL, or the master restarted) holds a later ticket, or none, and gives the name
//! back to its node, whose catalog is then adopted as usual.
//!
//! The master keeps nothing on disk: across its restarts, tickets verify only if the
//! new master has the same owner key (`Master::set_owner_key`, the same for every
//! master of a cluster, known to no node). Without one, each master draws its own key,
//! and after a restart the first to remount a name keeps it, as before tickets.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use crate::protocol::OwnerTicket;
use crate::util::hmac;
use crate::util::sync::UnpoisonedRw;

/// The master's owner key and the tickets it signs.
pub(super) struct Owners {
    key: RwLock<Vec<u8>>,
    /// The `issued_ms` of the last ticket issued.
    last_issued_ms: AtomicU64,
}

impl Owners {
    /// Owners under a key drawn at random (tickets then verify in this process only).
    pub fn new() -> Owners {
        let key = (0..4).flat_map(|_| crate::sys::random_u64().to_le_bytes());
        Owners {
            key: RwLock::new(key.collect()),
            last_issued_ms: AtomicU64::new(0),
        }
    }

    /// Signs and verifies tickets under `key` from now on.
    pub fn set_key(&self, key: &[u8]) {
        *self.key.write_locked() = key.to_vec();
    }

    fn mac(&self, name: &str, issued_ms: u64, nonce: u64) -> u64 {
        let mut data = Vec::with_capacity(name.len() + 16);
        data.extend_from_slice(&issued_ms.to_le_bytes());
        data.extend_from_slice(&nonce.to_le_bytes());
        data.extend_from_slice(name.as_bytes());
        let digest = hmac::mac(&self.key.read_locked(), &data);
        let mut first = [0; 8];
        first.copy_from_slice(&digest[..8]);
        u64::from_le_bytes(first)
    }

    /// Whether this master (or one with its key) issued `ticket` for `name`.
    fn valid(&self, name: &str, ticket: &OwnerTicket) -> bool {
        let expected = self.mac(name, ticket.issued_ms, ticket.nonce).to_le_bytes();
        ticket.issued_ms != 0 && hmac::equal(&expected, &ticket.mac.to_le_bytes())
    }

    /// The ticket a remount of `name` that showed `shown` mounts under: the one
    /// shown when it is valid (so the name keeps its first date), else a new one.
    pub fn renew(&self, name: &str, shown: OwnerTicket) -> OwnerTicket {
        if self.valid(name, &shown) {
            return shown;
        }
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_millis() as u64);
        // Strictly after every ticket this master issued before, even within one
        // millisecond: a later mount must never draw an earlier (or tied) ticket.
        let issued_ms = now_ms.max(self.last_issued_ms.load(Ordering::Relaxed) + 1);
        self.last_issued_ms.fetch_max(issued_ms, Ordering::Relaxed);
        let nonce = crate::sys::random_u64();
        OwnerTicket {
            issued_ms,
            nonce,
            mac: self.mac(name, issued_ms, nonce),
        }
    }

    /// Whether a remount showing `shown` takes `name` from the client holding it
    /// under `held` (`None`: it mounted without a ticket): only with a valid ticket
    /// for the name, issued before the holder's.
    pub fn outranks(
        &self,
        name: &str,
        shown: Option<&OwnerTicket>,
        held: Option<&OwnerTicket>,
    ) -> bool {
        let Some(shown) = shown.filter(|t| self.valid(name, t)) else {
            return false;
        };
        held.is_none_or(|h| (shown.issued_ms, shown.nonce) < (h.issued_ms, h.nonce))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_is_valid_for_its_name_under_its_key_and_earlier_ones_win() {
        let owners = Owners::new();
        let none = OwnerTicket::default();
        let first = owners.renew("node-a", none);
        assert_eq!(
            owners.renew("node-a", first),
            first,
            "a valid ticket is kept"
        );
        assert!(owners.outranks("node-a", Some(&first), None));
        // Issued at once after it, for the same name: strictly later, never tied.
        let squat = owners.renew("node-a", none);
        assert!(squat.issued_ms > first.issued_ms);
        assert!(owners.outranks("node-a", Some(&first), Some(&squat)));
        assert!(
            !owners.outranks("node-b", Some(&first), None),
            "another name"
        );
        assert!(!owners.outranks("node-a", Some(&none), None), "no ticket");
        let forged = OwnerTicket {
            issued_ms: 1,
            ..first
        };
        assert!(!owners.outranks("node-a", Some(&forged), None), "altered");
        let later = OwnerTicket {
            issued_ms: first.issued_ms + 1,
            ..owners.renew("node-a", none)
        };
        assert!(owners.outranks("node-a", Some(&first), Some(&later)));
        assert!(!owners.outranks("node-a", Some(&later), Some(&first)));

        let restarted = Owners::new();
        assert!(
            !restarted.outranks("node-a", Some(&first), None),
            "another key"
        );
        let key = b"the cluster's owner key";
        owners.set_key(key);
        restarted.set_key(key);
        let signed = owners.renew("node-a", none);
        assert!(
            restarted.outranks("node-a", Some(&signed), None),
            "same key"
        );
    }
}
