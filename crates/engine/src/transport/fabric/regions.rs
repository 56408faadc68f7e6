//! The engine's buffers as registered on every opened domain. Peers address them by
//! key; our own operations pass their descriptors, so providers that want local memory
//! registered (FI_MR_LOCAL, e.g. EFA) or told where device memory is (FI_HMEM) need no
//! registration per operation.

use crate::util::sync::UnpoisonedRw;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::{RwLock, RwLockReadGuard};

use super::nic::Mr;

/// A buffer's registrations: its length and one MR per domain, in the transport's
/// domain order.
struct Registered {
    len: u64,
    mrs: Vec<Mr>,
}

#[derive(Default)]
pub(super) struct Registrations {
    by_addr: RwLock<BTreeMap<u64, Registered>>,
}

/// A read view of the table: registrations found through it stay open while it lives.
pub(super) struct View<'a>(RwLockReadGuard<'a, BTreeMap<u64, Registered>>);

impl Registrations {
    pub fn insert(&self, addr: u64, len: u64, mrs: Vec<Mr>) {
        let mut t = self.by_addr.write_locked();
        t.insert(addr, Registered { len, mrs });
    }

    /// Forgets a buffer; its MRs close when the returned value drops (after any
    /// operation holding a `View` has been posted).
    pub fn remove(&self, addr: u64) -> bool {
        let mut t = self.by_addr.write_locked();
        t.remove(&addr).is_some()
    }

    pub fn view(&self) -> View<'_> {
        View(self.by_addr.read_locked())
    }
}

impl View<'_> {
    /// Whether one registered buffer holds all of `[addr, addr+len)`.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        self.find(addr, len).is_some()
    }

    /// The descriptor of domain `nic` for `[addr, addr+len)`, if one buffer holds it.
    pub fn desc(&self, addr: u64, len: u64, nic: usize) -> Option<*mut c_void> {
        self.find(addr, len)?.mrs.get(nic).map(|m| m.desc)
    }

    fn find(&self, addr: u64, len: u64) -> Option<&Registered> {
        let (start, r) = self.0.range(..=addr).next_back()?;
        let end = addr.checked_add(len)?;
        (end <= start + r.len).then_some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_need_one_buffer_holding_the_whole_range() {
        let r = Registrations::default();
        r.insert(0x1000, 0x1000, Vec::new());
        r.insert(0x2000, 0x800, Vec::new());
        let v = r.view();
        assert!(v.covers(0x1000, 0x1000));
        assert!(v.covers(0x1800, 0x10));
        assert!(!v.covers(0x1800, 0x1000), "spans two buffers");
        assert!(!v.covers(0x2700, 0x200), "past the end");
        assert!(!v.covers(0x800, 0x10), "before the first");
        assert!(!v.covers(u64::MAX, 2), "overflow");
        assert_eq!(v.desc(0x1000, 8, 0), None, "no MR for that NIC");
        drop(v);
        assert!(r.remove(0x1000));
        assert!(!r.remove(0x1000));
        assert!(!r.view().covers(0x1000, 1));
    }
}
