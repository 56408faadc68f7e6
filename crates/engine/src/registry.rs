//! The local segment's registered buffers: overlap checks on registration, range
//! validation for every remote access, and in-flight guards so that unregistering a
//! buffer waits until no transfer still touches it.

use crate::util::sync::{Unpoisoned, UnpoisonedRw};
use std::collections::BTreeMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};

use crate::error::{Code, Error, Result};

/// What peers may do with a registered buffer (its owner's own transfers may always
/// read and write it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Access {
    /// Peers read and write it (Mooncake's only mode).
    #[default]
    ReadWrite,
    /// Peers read it; a write is refused.
    ReadOnly,
    /// Peers can neither read nor write it: it serves only this engine's transfers.
    LocalOnly,
}

impl Access {
    /// Its name in configuration and descriptors: `read_write`, `read_only`, `local`.
    pub fn name(self) -> &'static str {
        match self {
            Access::ReadWrite => "read_write",
            Access::ReadOnly => "read_only",
            Access::LocalOnly => "local",
        }
    }

    /// Parses a name as [`Access::name`] gives it.
    pub fn parse(s: &str) -> Result<Access> {
        match s {
            "read_write" | "rw" => Ok(Access::ReadWrite),
            "read_only" | "ro" => Ok(Access::ReadOnly),
            "local" | "local_only" | "none" => Ok(Access::LocalOnly),
            _ => Err(Error::invalid(format!(
                "unknown access {s:?} (read_write, read_only, local)"
            ))),
        }
    }

    /// Whether a peer may read (`write` false) or write (`write` true) the buffer.
    pub fn allows_peer(self, write: bool) -> bool {
        self.peer_refusal(write).is_none()
    }

    /// Why a peer may not read (`write` false) or write the buffer: the error code and
    /// what to say of the buffer; `None` when it may.
    pub fn peer_refusal(self, write: bool) -> Option<(Code, &'static str)> {
        match self {
            Access::ReadWrite => None,
            Access::ReadOnly if !write => None,
            Access::ReadOnly => Some((Code::InvalidWrite, "is read-only to peers")),
            Access::LocalOnly => Some((Code::AddressNotRegistered, "is not open to peers")),
        }
    }
}

/// One registered buffer.
#[derive(Debug)]
pub struct Region {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Where the memory lives, e.g. `cpu:0` or `cuda:1`.
    pub location: String,
    /// What the location names, checked with the driver at registration
    /// (`crate::device::classify`); `Host` for every non-device location.
    pub device: crate::device::MemoryKind,
    /// For engine-allocated buffers: the memfd backing them, which same-host peers
    /// may map to copy with plain memcpy.
    pub shared_fd: Option<RawFd>,
    /// What peers may do with it.
    pub access: Access,
    valid: AtomicBool,
    in_flight: AtomicUsize,
    drained: (Mutex<()>, Condvar),
}

impl Region {
    /// One past the last address.
    pub fn end(&self) -> u64 {
        self.addr + self.len
    }

    fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.checked_add(len).is_some_and(|end| end <= self.end())
    }
}

/// Proof that `[addr, addr+len)` lies inside a registered buffer that cannot be
/// unregistered until this guard drops.
#[derive(Debug)]
pub struct RangeGuard {
    region: Arc<Region>,
    addr: u64,
    len: u64,
}

impl RangeGuard {
    /// Start address of the guarded range.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length of the range in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty range.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start address as a pointer.
    pub fn ptr(&self) -> *mut u8 {
        self.addr as usize as *mut u8
    }

    /// Whether `[addr, +len)` lies inside the buffer this guard pins (which stays
    /// registered, all of it, while the guard lives).
    pub fn buffer_holds(&self, addr: u64, len: u64) -> bool {
        self.region.contains(addr, len)
    }

    /// Whether the buffer is being unregistered: a transfer stalled on this range
    /// should give up, since unregistration waits for it.
    pub fn is_revoked(&self) -> bool {
        !self.region.valid.load(Ordering::SeqCst)
    }

    /// Where the guarded bytes live; anything but `Host` must not be touched by the CPU.
    pub fn device(&self) -> crate::device::MemoryKind {
        self.region.device
    }

    /// The guarded bytes.
    ///
    /// # Safety
    /// The registrant promised the buffer stays valid while registered; the caller
    /// must not create overlapping mutable views of the same range.
    // The bytes are foreign memory the guard only pins, not data it owns, so handing
    // out a mutable view from a shared guard is the point.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: the range is inside a live registered region (checked at guard
        // creation, and unregistration waits for this guard); aliasing is the caller's
        // contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len as usize) }
    }
}

impl Drop for RangeGuard {
    fn drop(&mut self) {
        if self.region.in_flight.fetch_sub(1, Ordering::SeqCst) == 1
            && !self.region.valid.load(Ordering::SeqCst)
        {
            let _lock = self.region.drained.0.lock();
            self.region.drained.1.notify_all();
        }
    }
}

/// The set of registered buffers of one engine.
#[derive(Default)]
pub struct LocalMemory {
    regions: RwLock<BTreeMap<u64, Arc<Region>>>,
    /// Registered device-memory regions: while 0, requests skip the device lookup.
    device_regions: AtomicUsize,
}

impl LocalMemory {
    /// An empty registry.
    pub fn new() -> LocalMemory {
        LocalMemory::default()
    }

    /// Adds a buffer; zero length, address overflow and any overlap are refused.
    pub fn register(&self, addr: u64, len: u64, location: &str) -> Result<Arc<Region>> {
        self.register_with(addr, len, location, None, Access::ReadWrite)
    }

    /// As `register`, for memory backed by a shareable memfd and with what peers may
    /// do with it.
    pub fn register_with(
        &self,
        addr: u64,
        len: u64,
        location: &str,
        shared_fd: Option<RawFd>,
        access: Access,
    ) -> Result<Arc<Region>> {
        if len == 0 {
            return Err(Error::invalid("cannot register a zero-length buffer"));
        }
        if addr == 0 {
            return Err(Error::invalid("cannot register a null address"));
        }
        let end = addr
            .checked_add(len)
            .ok_or_else(|| Error::invalid(format!("buffer {addr:#x}+{len} overflows")))?;
        let device = crate::device::classify(addr, len, location)?;
        let mut regions = self.regions.write_locked();
        let before = regions.range(..end).next_back();
        if let Some((_, r)) = before.filter(|(_, r)| r.end() > addr) {
            return Err(Error::new(
                Code::AddressOverlap,
                format!(
                    "[{addr:#x}, {end:#x}) overlaps registered [{:#x}, {:#x})",
                    r.addr,
                    r.end()
                ),
            ));
        }
        let region = Arc::new(Region {
            addr,
            len,
            location: location.to_owned(),
            device,
            shared_fd,
            access,
            valid: AtomicBool::new(true),
            in_flight: AtomicUsize::new(0),
            drained: (Mutex::new(()), Condvar::new()),
        });
        regions.insert(addr, region.clone());
        if !device.is_host() {
            self.device_regions.fetch_add(1, Ordering::SeqCst);
        }
        Ok(region)
    }

    /// Removes the buffer starting at `addr` and waits until no transfer uses it.
    pub fn unregister(&self, addr: u64) -> Result<Arc<Region>> {
        let region = self.regions.write_locked().remove(&addr).ok_or_else(|| {
            Error::new(
                Code::AddressNotRegistered,
                format!("no buffer registered at {addr:#x}"),
            )
        })?;
        region.valid.store(false, Ordering::SeqCst);
        if !region.device.is_host() {
            self.device_regions.fetch_sub(1, Ordering::SeqCst);
        }
        let mut lock = region.drained.0.locked();
        while region.in_flight.load(Ordering::SeqCst) != 0 {
            lock = region
                .drained
                .1
                .wait(lock)
                .unwrap_or_else(|e| e.into_inner());
        }
        drop(lock);
        Ok(region)
    }

    /// The region holding all of `[addr, addr+len)`, if any (no guard taken).
    pub fn find(&self, addr: u64, len: u64) -> Option<Arc<Region>> {
        let regions = self.regions.read_locked();
        let (_, r) = regions.range(..=addr).next_back()?;
        r.contains(addr, len).then(|| r.clone())
    }

    /// Validates `[addr, addr+len)` against one registered buffer and pins it.
    pub fn guard(&self, addr: u64, len: u64) -> Result<RangeGuard> {
        if len == 0 {
            return Err(Error::invalid("zero-length access"));
        }
        let region = self.find(addr, len).ok_or_else(|| {
            Error::new(
                Code::AddressNotRegistered,
                format!("[{addr:#x}, +{len}) is not inside one registered buffer"),
            )
        })?;
        region.in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = RangeGuard { region, addr, len };
        if !guard.region.valid.load(Ordering::SeqCst) {
            return Err(Error::new(
                Code::AddressNotRegistered,
                format!("buffer at {:#x} is being unregistered", guard.region.addr),
            ));
        }
        Ok(guard)
    }

    /// As [`guard`](Self::guard), for a peer's request: refused unless the buffer's
    /// [`Access`] lets peers read (or, with `write`, write) it.
    pub fn guard_for_peer(&self, addr: u64, len: u64, write: bool) -> Result<RangeGuard> {
        let guard = self.guard(addr, len)?;
        match guard.region.access.peer_refusal(write) {
            None => Ok(guard),
            Some((code, what)) => Err(Error::new(
                code,
                format!("buffer at {:#x} {what}", guard.region.addr),
            )),
        }
    }

    /// Whether any device-memory buffer is registered (one atomic load).
    pub fn has_device(&self) -> bool {
        self.device_regions.load(Ordering::Relaxed) != 0
    }

    /// The memory kind of a range inside one registered buffer; `Host` for host
    /// buffers and for unregistered ranges. Costs one atomic load while no device
    /// buffer is registered.
    pub fn device_of(&self, addr: u64, len: u64) -> crate::device::MemoryKind {
        if !self.has_device() {
            return crate::device::MemoryKind::Host;
        }
        self.find(addr, len.max(1))
            .map_or(crate::device::MemoryKind::Host, |r| r.device)
    }

    /// All regions in address order.
    pub fn snapshot(&self) -> Vec<Arc<Region>> {
        let regions = self.regions.read_locked();
        regions.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mapped memory to register (registration refuses holes), and the page-aligned
    /// address the tests count from.
    fn arena() -> (Vec<u8>, u64) {
        let mem = vec![0u8; 0x6000];
        let base = (mem.as_ptr() as u64 + 0xfff) & !0xfff;
        (mem, base)
    }

    #[test]
    fn overlap_and_validation() {
        let (_mem, b) = arena();
        let m = LocalMemory::new();
        m.register(b + 0x1000, 0x1000, "cpu:0").unwrap();
        assert_eq!(
            m.register(b + 0x1800, 0x100, "cpu:0").unwrap_err().code(),
            Code::AddressOverlap
        );
        assert_eq!(
            m.register(b + 0x800, 0x900, "cpu:0").unwrap_err().code(),
            Code::AddressOverlap
        );
        assert_eq!(
            m.register(b + 0x3000, 0, "cpu:0").unwrap_err().code(),
            Code::InvalidParams
        );
        assert_eq!(
            m.register(u64::MAX - 1, 4, "cpu:0").unwrap_err().code(),
            Code::InvalidParams
        );
        m.register(b + 0x2000, 0x1000, "cpu:0").unwrap();
        m.register(b + 0x800, 0x800, "cpu:0").unwrap();
        assert!(m.guard(b + 0x1000, 0x1000).is_ok());
        // Spanning two adjacent buffers is not "inside one buffer".
        assert_eq!(
            m.guard(b + 0x1800, 0x1000).unwrap_err().code(),
            Code::AddressNotRegistered
        );
        assert!(m.guard(b + 0x2fff, 2).is_err());
        assert!(m.guard(u64::MAX, 2).is_err());
        assert!(m.guard(b + 0x1000, 0).is_err());
        m.unregister(b + 0x1000).unwrap();
        assert!(m.guard(b + 0x1000, 1).is_err());
        assert!(m.unregister(b + 0x1000).is_err());
    }

    #[test]
    fn unregister_waits_for_guards() {
        let (_mem, b) = arena();
        let m = Arc::new(LocalMemory::new());
        m.register(b + 0x1000, 0x1000, "cpu:0").unwrap();
        let g = m.guard(b + 0x1000, 8).unwrap();
        let m2 = m.clone();
        let t = std::thread::spawn(move || m2.unregister(b + 0x1000).map(|_| ()));
        // New accesses are refused as soon as unregistration starts; the waiting
        // unregister completes only once the guard is dropped.
        while m.find(b + 0x1000, 8).is_some() {
            std::thread::yield_now();
        }
        assert!(!t.is_finished());
        drop(g);
        t.join().unwrap().unwrap();
    }
}
