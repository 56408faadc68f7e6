//! Same-host transfers between processes with one copy and no network: plain memcpy
//! through a mapping of the peer's buffer when the peer allocated it from the engine
//! (memfd-backed), otherwise `process_vm_readv` / `process_vm_writev` where the system
//! already permits it.
//!
//! **The owner is the authority.** A descriptor published to the metadata server is
//! only a hint: anyone can publish one, naming any process and any addresses. So every
//! engine lists the ranges it registered in its own range table (`ranges`: a memfd
//! only the owner can write), and a copier looks each range up there before touching
//! it, then uses what the owner listed (memfd number, which file it is, IPC offset),
//! never what the descriptor claims. A memfd is opened through `/proc/<pid>/fd`, and
//! its device and inode must be the ones the owner listed, so only the owner's buffer
//! memfds are ever mapped. A descriptor naming someone else's process, or pointing at
//! memory its owner never registered, gets a clear refusal and no byte moves.
//!
//! **No ptrace grant.** Engines do not call `PR_SET_PTRACER` (with `ANY` it switches
//! off Yama for every same-user process). Mapping a peer's memfd needs only the access
//! `/proc/<pid>/fd` asks (ptrace *read*, which Yama does not restrict), so engine-
//! allocated memory (`allocate_buffer`, store segments) moves by memcpy whatever the
//! Yama setting. Memory the application registered itself can only be reached with
//! process_vm, which needs ptrace *attach*: it is used where the system allows that
//! (Yama off, `ptrace_scope` 0, or CAP_SYS_PTRACE) and otherwise, after the first
//! `EPERM`, such buffers of that peer go another way (TCP under `auto`).
//!
//! **Lazy mapping.** A peer's buffer is mapped whole on first use without prefaulting:
//! the mapping reserves address space only, and memory is spent on the pages a copy
//! touches, so opening a 1 TiB segment costs nothing until it is used.
//!
//! Safety across processes rests on a shared guard page (a memfd every engine exposes):
//! it holds a random token (proving which process we are talking to), a generation
//! bumped on every unregistration, and counts of copies in progress, one per parity of
//! the generation. A copier reads the generation, validates its range against the
//! owner's table, increments that generation's count, checks the generation again,
//! copies, and decrements; an unregistering owner withdraws the range from its table,
//! bumps the generation and waits for the old generation's count to drain (copies
//! starting meanwhile count on the other one, so a busy engine cannot stall it). So no copy touches a buffer after `unregister_memory` returns. A pidfd tells
//! whether the peer still lives, so a recycled PID is never written to: checked before
//! every process_vm copy; a copy through a mapping (which cannot reach another
//! process) relies on a check at most `LIVENESS_AGE` old.
//!
//! Device memory (CUDA, HIP) moves GPU to GPU without touching the CPU: a registered
//! device buffer is exported with an IPC handle (published as `mc_ipc_handle`), which
//! a same-host peer opens once per buffer and generation; the driver then copies
//! between the mapped peer allocation and our side, host or device. A local device
//! buffer also goes straight to or from a peer's memfd-backed host buffer with one
//! driver copy. What this cannot carry (device memory on the peer without a handle, or
//! local device memory against a peer buffer reachable only by process_vm) is left to
//! other paths by `carries`.

mod fill;
mod ranges;
#[cfg(test)]
mod tests;

use crate::util::sync::UnpoisonedRw;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use super::{
    coarse_now, copy_host, Finished, Kind, Op, Outcome, RegionKeys, Slice, Transport,
    TransportWorker,
};
use crate::device::{self, IpcExport, MemoryKind};
use crate::error::{Error, Result};
use crate::memfd::{self, Mapping, SharedMemory, Sharing};
use crate::metadata::{BufferDesc, HostInfo, SegmentDesc};
use crate::registry::{Access, Region};
use crate::util::id_hash::IdHashing;
use fill::Filled;
use ranges::{Backing, Entry, Lookup, OwnerTable, TableView};

const PAGE: usize = 4096;
/// The guard page memfd's name; a copier checks it on the file it opened.
const GUARD_NAME: &str = "mooncake-shm-guard";
/// How long an unregistration waits for a crashed copier's count before going on.
const DRAIN_LIMIT: Duration = Duration::from_secs(2);
/// How old a liveness check a copy through a mapping may rely on: the mapping holds
/// the peer's file, never another process's memory, so the check only decides how
/// soon copies to an exited peer start failing, and one syscall per small copy would
/// cost more than the copy. Measured on the coarse clock (a tick is a few ms).
const LIVENESS_AGE: Duration = Duration::from_millis(10);

/// The guard page layout, shared by owner and copiers.
#[repr(C)]
struct GuardPage {
    token: AtomicU64,
    generation: AtomicU64,
    /// Copies in flight, by the parity of the generation they validated against: an
    /// unregistration moves the generation on and waits only for the old parity's
    /// copies, so copies arriving meanwhile (counted on the other one) never keep it
    /// waiting.
    active: [AtomicU64; 2],
}

impl GuardPage {
    fn active(&self, generation: u64) -> &AtomicU64 {
        &self.active[(generation & 1) as usize]
    }
}

/// Takes one from `count`, never below zero: after an unregistration gave up on a
/// crashed copier and reset the count, a late decrement must not wrap it.
fn release(count: &AtomicU64) {
    let _ = count.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1));
}

/// # Safety
/// `ptr` must point at a live mapping of at least one page.
unsafe fn guard_page<'a>(ptr: *mut u8) -> &'a GuardPage {
    // SAFETY: the caller guarantees `ptr` is a live mapping of at least a page, so the 24-byte
    // GuardPage is in bounds; callers pass a mapping's start, which is page-aligned (the contract
    // leaves that and `'a` to them). All fields are atomics, so sharing across processes is sound.
    unsafe { &*(ptr as *const GuardPage) }
}

/// Peers (by engine handle) whose process_vm calls the system refused.
type VmDenied = Arc<RwLock<HashSet<u64>>>;

/// Same-host transport: peer memfds mapped here, or `process_vm_readv`/`writev`.
pub struct ShmTransport {
    guard: SharedMemory,
    table: OwnerTable,
    host_id: String,
    vm_denied: VmDenied,
    /// This process's id, asked once (every lookup is a system call).
    pid: u32,
}

impl ShmTransport {
    /// A transport for peers on this host.
    pub fn new() -> Result<ShmTransport> {
        let guard = SharedMemory::create(GUARD_NAME, PAGE, Sharing::PeersWrite)
            .map_err(|e| Error::io("creating the shm guard page", e))?;
        let token = crate::sys::random_u64() | 1;
        let table =
            OwnerTable::new(token).map_err(|e| Error::io("creating the shm range table", e))?;
        let t = ShmTransport {
            guard,
            table,
            host_id: crate::sys::host_id(),
            vm_denied: VmDenied::default(),
            pid: std::process::id(),
        };
        t.page().token.store(token, Ordering::SeqCst);
        Ok(t)
    }

    fn page(&self) -> &GuardPage {
        // SAFETY: the guard memory is one page, alive as long as `self`.
        unsafe { guard_page(self.guard.ptr()) }
    }
}

/// How the owner lists `region` in its table; `None` when no peer can reach it here.
fn entry_for(region: &Region, ipc: Option<&IpcExport>) -> Option<Entry> {
    let backing = match (region.device, region.shared_fd, ipc) {
        (MemoryKind::Host, Some(fd), _) => match memfd::identify(fd) {
            Ok((id, _)) => Backing::Memfd { fd, id },
            Err(e) => {
                log::info!("shm: {:#x}: fstat of its memfd: {e}", region.addr);
                Backing::Plain
            }
        },
        (MemoryKind::Host, None, _) => Backing::Plain,
        (_, _, Some(ipc)) => Backing::Device {
            offset: ipc.offset,
            handle_hash: ranges::handle_hash(&ipc.handle),
        },
        _ => return None,
    };
    Some(Entry {
        addr: region.addr,
        len: region.len,
        backing,
        access: region.access,
    })
}

impl Transport for ShmTransport {
    fn kind(&self) -> Kind {
        Kind::Shm
    }

    fn register(&self, region: &Region) -> Result<RegionKeys> {
        let mut keys = RegionKeys::default();
        if matches!(region.device, MemoryKind::Cuda(_) | MemoryKind::Hip(_)) {
            // Without a handle peers still reach the buffer (TCP stages it), so a
            // driver that refuses IPC is not a registration error.
            match device::ipc_export(region.device, region.addr) {
                Ok(ipc) => keys.ipc = Some(ipc),
                Err(e) => log::info!(
                    "shm: no IPC handle for {:#x} ({}): {e}",
                    region.addr,
                    region.location
                ),
            }
        }
        if let Some(entry) = entry_for(region, keys.ipc.as_ref()) {
            self.table.insert(entry);
        }
        Ok(keys)
    }

    fn unregister(&self, region: &Region) {
        // Withdrawn before the generation moves: a copier that validated against the
        // old table then fails its generation check, one that reads the table now
        // does not find the range.
        self.table.remove(region.addr);
        let page = self.page();
        let old = page.generation.fetch_add(1, Ordering::SeqCst);
        let draining = page.active(old);
        let start = Instant::now();
        while draining.load(Ordering::SeqCst) != 0 {
            if start.elapsed() > DRAIN_LIMIT {
                // Only a copier that died mid-copy leaves the count raised.
                log::warn!(
                    "shm: unregistering {:#x}: {} peer copies never finished; going on",
                    region.addr,
                    draining.load(Ordering::SeqCst)
                );
                draining.store(0, Ordering::SeqCst);
                break;
            }
            std::thread::yield_now();
        }
    }

    fn describe(&self, desc: &mut SegmentDesc) {
        let page = self.page();
        desc.host = Some(HostInfo {
            host_id: self.host_id.clone(),
            pid: self.pid,
            guard_fd: self.guard.fd(),
            ranges_fd: self.table.fd(),
            token: page.token.load(Ordering::SeqCst),
            generation: page.generation.load(Ordering::SeqCst),
        });
    }

    /// Every engine on this host, another in this very process included (an embedded
    /// cluster): the copy then maps the same memfd a second time and checks the same
    /// range table, rather than pushing bytes through loopback TCP.
    fn reaches(&self, peer: &SegmentDesc) -> bool {
        peer.host
            .as_ref()
            .is_some_and(|h| h.host_id == self.host_id && h.guard_fd >= 0 && h.ranges_fd >= 0)
    }

    fn carries(&self, slice: &Slice) -> bool {
        let desc = slice.peer.desc();
        let Some(buf) = desc.buffer_for(slice.remote, slice.len) else {
            // Out of range: `transfer` rejects it with the reason.
            return true;
        };
        match MemoryKind::parse_location(&buf.name) {
            Ok(MemoryKind::Host) if buf.shm_fd.is_some() => true,
            Ok(MemoryKind::Host) => {
                slice.local_kind.is_host() && !self.vm_denied.read_locked().contains(&slice.peer.id)
            }
            Ok(remote) => buf.ipc.is_some() && import_kind(remote, slice.local_kind).is_some(),
            Err(_) => false,
        }
    }

    fn slice_size(&self) -> u64 {
        16 << 20
    }

    fn new_worker(&self) -> Result<Box<dyn TransportWorker>> {
        Ok(Box::new(ShmWorker {
            peers: HashMap::default(),
            vm_denied: self.vm_denied.clone(),
        }))
    }
}

/// Why a copy could not happen.
#[derive(Debug)]
enum CopyError {
    /// The owner's buffers changed while we validated.
    Stale,
    /// The owner does not allow it or the address is bad: final.
    Rejected(String),
    /// Not permitted from here: stop trying shared memory with this peer.
    Denied(String),
    /// The system refuses process_vm with this peer: its plain buffers go another way.
    VmDenied(String),
    /// Anything else: retry on another path.
    Failed(String),
}

/// A peer process we have attached to.
struct Attached {
    pid: i32,
    token: u64,
    pidfd: OwnedFd,
    guard: Mapping,
    table: TableView,
    /// What we learnt of the owner's ranges (and made of them) this `generation`,
    /// by start address.
    known: BTreeMap<u64, Known>,
    generation: u64,
    /// When the pidfd last said the peer lives (`coarse_now`).
    seen_alive: std::cell::Cell<Duration>,
}

/// One of the owner's ranges as listed in its table, with our view of it.
struct Known {
    entry: Entry,
    view: View,
}

/// How this process reaches a range of the owner.
enum View {
    /// Our mapping of the owner's memfd; read-only when the owner allows no writes.
    Mapped {
        map: Mapping,
        writable: bool,
        /// How writes into it go (see `fill`).
        filled: Arc<Filled>,
    },
    /// The owner's device allocation, opened through IPC, and where the range
    /// starts in it.
    Imported(Import, u64),
    /// Only process_vm reaches it.
    ProcessVm,
}

/// A peer's device allocation mapped into this process; closed on drop.
struct Import {
    kind: MemoryKind,
    base: u64,
}

impl Drop for Import {
    fn drop(&mut self) {
        // SAFETY: `base` came from `ipc_open(kind, ..)`; the map entry owning this was
        // removed, so nothing uses it afterwards.
        if let Err(e) = unsafe { device::ipc_close(self.kind, self.base) } {
            log::warn!("shm: closing an IPC mapping: {e}");
        }
    }
}

/// The device of ours through which a peer allocation on `remote` is opened: our
/// local side's device when it is of the same family (the driver then copies device
/// to device), else the peer's ordinal if we have it, else device 0. `None` when this
/// process cannot open that family's handles.
fn import_kind(remote: MemoryKind, local: MemoryKind) -> Option<MemoryKind> {
    let count = |n: crate::ffi::error::Result<i32>| n.ok().filter(|c| *c > 0);
    match (remote, local) {
        (MemoryKind::Cuda(_), MemoryKind::Cuda(l)) => Some(MemoryKind::Cuda(l)),
        (MemoryKind::Hip(_), MemoryKind::Hip(l)) => Some(MemoryKind::Hip(l)),
        (MemoryKind::Cuda(r), _) => {
            let n = count(crate::ffi::cuda::api().and_then(|a| a.device_count()))?;
            Some(MemoryKind::Cuda(if r < n { r } else { 0 }))
        }
        (MemoryKind::Hip(r), _) => {
            let n = count(crate::ffi::hip::api().and_then(|a| a.device_count()))?;
            Some(MemoryKind::Hip(if r < n { r } else { 0 }))
        }
        _ => None,
    }
}

impl Attached {
    fn attach(h: &HostInfo) -> std::result::Result<Attached, CopyError> {
        let pid = h.pid as i32;
        // SAFETY: pidfd_open takes a pid and flags.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
        if pidfd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(CopyError::Denied(format!("pidfd_open({pid}): {e}")));
        }
        // SAFETY: fresh descriptor.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
        let denied = |e: String| CopyError::Denied(e);
        let guard_file =
            memfd::open_peer(h.pid, h.guard_fd, true).map_err(|e| denied(e.to_string()))?;
        let name = memfd::name_of(&guard_file).map_err(|e| denied(e.to_string()))?;
        if name != memfd::memfd_link(GUARD_NAME)
            || !memfd::holds(guard_file.as_raw_fd(), PAGE as u64)
        {
            return Err(denied(format!(
                "fd {} of process {pid} is not a guard page ({name})",
                h.guard_fd
            )));
        }
        let guard = Mapping::map(guard_file.as_raw_fd(), PAGE, true)
            .map_err(|e| denied(format!("mapping the guard page of {pid}: {e}")))?;
        let table = TableView::open(h.pid, h.ranges_fd, h.token).map_err(denied)?;
        let attached = Attached {
            pid,
            token: h.token,
            pidfd,
            guard,
            table,
            known: BTreeMap::new(),
            generation: 0,
            seen_alive: std::cell::Cell::new(Duration::ZERO),
        };
        if attached.page().token.load(Ordering::SeqCst) != h.token {
            return Err(denied(format!(
                "fd {} of {pid} is not its guard page",
                h.guard_fd
            )));
        }
        // The pidfd was taken before the files were opened, so a live pidfd proves they
        // belong to the process we will copy to.
        if !attached.alive() {
            return Err(CopyError::Failed(format!("process {pid} exited")));
        }
        Ok(attached)
    }

    fn page(&self) -> &GuardPage {
        // SAFETY: `guard` maps one page of the peer's guard memfd.
        unsafe { guard_page(self.guard.ptr()) }
    }

    fn alive(&self) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; a pidfd turns readable when the process exits.
        let alive = unsafe { libc::poll(&mut pfd, 1, 0) == 0 };
        if alive {
            self.seen_alive.set(coarse_now());
        }
        alive
    }

    /// Whether the peer lives, by a check at most `LIVENESS_AGE` old.
    fn alive_lately(&self) -> bool {
        coarse_now().saturating_sub(self.seen_alive.get()) < LIVENESS_AGE || self.alive()
    }

    /// The owner's range holding the slice's remote range, looked up in its table on
    /// first use this generation.
    fn known(&mut self, slice: &Slice, buf: &BufferDesc) -> std::result::Result<&Known, CopyError> {
        let (addr, len) = (slice.remote, slice.len);
        let cached = self
            .known
            .range(..=addr)
            .next_back()
            .filter(|(_, k)| {
                addr.checked_add(len)
                    .is_some_and(|end| end <= k.entry.addr.saturating_add(k.entry.len))
            })
            .map(|(start, _)| *start);
        if let Some(start) = cached {
            return Ok(&self.known[&start]);
        }
        let entry = match self.table.find(addr, len) {
            Lookup::Found(e) => e,
            Lookup::Absent => {
                return Err(CopyError::Rejected(format!(
                    "refused: [{addr:#x}, +{len}) is not memory process {} registered \
                     (its descriptor as published claims what its owner does not list)",
                    self.pid
                )))
            }
            Lookup::Unlisted => {
                return Err(CopyError::Failed(format!(
                    "process {} lists too many buffers to vouch for [{addr:#x}, +{len})",
                    self.pid
                )))
            }
            Lookup::Busy => {
                return Err(CopyError::Failed(format!(
                    "process {} kept changing its range table",
                    self.pid
                )))
            }
        };
        if entry.access == Access::LocalOnly {
            return Err(CopyError::Rejected(format!(
                "refused: process {} keeps [{:#x}, +{}) to itself",
                self.pid, entry.addr, entry.len
            )));
        }
        let view = self.view_of(&entry, buf, slice.local_kind)?;
        Ok(self
            .known
            .entry(entry.addr)
            .or_insert(Known { entry, view }))
    }

    /// How we reach the owner's `entry`: its memfd (verified to be the file the owner
    /// listed) mapped here, its device allocation opened, or process_vm.
    fn view_of(
        &self,
        entry: &Entry,
        buf: &BufferDesc,
        local: MemoryKind,
    ) -> std::result::Result<View, CopyError> {
        match entry.backing {
            Backing::Plain => Ok(View::ProcessVm),
            Backing::Memfd { fd, id } => match self.map_memfd(entry, fd, id) {
                Ok(view) => Ok(view),
                Err(CopyError::Failed(why)) => {
                    // Unmappable here (e.g. a policy on /proc): process_vm may still work.
                    log::debug!("shm: {why}; trying process_vm");
                    Ok(View::ProcessVm)
                }
                Err(e) => Err(e),
            },
            Backing::Device {
                offset,
                handle_hash,
            } => {
                let ipc = buf
                    .ipc
                    .filter(|ipc| ranges::handle_hash(&ipc.handle) == handle_hash)
                    .ok_or_else(|| {
                        CopyError::Rejected(format!(
                            "refused: the IPC handle published for {:#x} is not the one \
                             process {} exported",
                            entry.addr, self.pid
                        ))
                    })?;
                let remote = match MemoryKind::parse_location(&buf.name) {
                    Ok(k) if !k.is_host() => k,
                    _ => {
                        return Err(CopyError::Rejected(format!(
                            "refused: {:#x} of process {} is device memory, published as {:?}",
                            entry.addr, self.pid, buf.name
                        )))
                    }
                };
                let kind = import_kind(remote, local).ok_or_else(|| {
                    CopyError::Denied(format!("cannot open {} IPC handles here", buf.name))
                })?;
                let base = device::ipc_open(kind, &ipc.handle).map_err(|e| {
                    // Another container or driver instance: the handle is useless here.
                    CopyError::Denied(format!("opening the IPC handle of {:#x}: {e}", entry.addr))
                })?;
                Ok(View::Imported(Import { kind, base }, offset))
            }
        }
    }

    /// Opens the owner's memfd `fd`, checks it is the file the owner listed, and maps
    /// it whole, without prefaulting.
    fn map_memfd(
        &self,
        entry: &Entry,
        fd: i32,
        id: memfd::FileId,
    ) -> std::result::Result<View, CopyError> {
        let failed = |e: std::io::Error| CopyError::Failed(e.to_string());
        let (file, writable) = match memfd::open_peer(self.pid as u32, fd, true) {
            Ok(f) => (f, true),
            Err(_) => (
                memfd::open_peer(self.pid as u32, fd, false).map_err(failed)?,
                false,
            ),
        };
        let (found, _) = memfd::identify(file.as_raw_fd()).map_err(failed)?;
        if found != id || !memfd::holds(file.as_raw_fd(), entry.len) {
            return Err(CopyError::Rejected(format!(
                "refused: fd {fd} of process {} is not the sealed memfd it registered at {:#x}",
                self.pid, entry.addr
            )));
        }
        if !self.alive() {
            return Err(CopyError::Failed(format!("process {} exited", self.pid)));
        }
        let len = usize::try_from(entry.len)
            .map_err(|_| CopyError::Failed(format!("{} bytes do not map here", entry.len)))?;
        // A buffer read-only to peers, or a memfd sealed against their writes, maps
        // read-only.
        let writable = writable
            && entry.access == Access::ReadWrite
            && memfd::seals(file.as_raw_fd()) & libc::F_SEAL_FUTURE_WRITE as u32 == 0;
        let map = Mapping::map(file.as_raw_fd(), len, writable).map_err(failed)?;
        Ok(View::Mapped {
            map,
            writable,
            filled: Arc::new(Filled::new(len)),
        })
    }

    /// One guarded copy of the slice, validated against the owner's table; the
    /// CRC32C of the bytes when the copy folded them (see `copy_host`).
    fn copy(
        &mut self,
        slice: &Slice,
        buf: &BufferDesc,
    ) -> std::result::Result<Option<u32>, CopyError> {
        let generation = self.page().generation.load(Ordering::SeqCst);
        if generation != self.generation {
            // The owner withdrew something: forget what we learnt of its buffers.
            self.known.clear();
            self.generation = generation;
        }
        let pid = self.pid;
        let known = self.known(slice, buf)?;
        let within = slice.remote - known.entry.addr;
        // Read-only as the owner listed it, or as its memfd is sealed.
        let read_only = known.entry.access != Access::ReadWrite
            || matches!(
                known.view,
                View::Mapped {
                    writable: false,
                    ..
                }
            );
        if slice.op == Op::Write && read_only {
            return Err(CopyError::Rejected(format!(
                "refused: process {pid} shares {:#x} read-only",
                known.entry.addr
            )));
        }
        // A host-to-host write into a mapping is populated and streamed (see `fill`).
        let (remote, filling) = match &known.view {
            View::Mapped { map, filled, .. } => {
                let fills = slice.op == Op::Write && slice.local_kind.is_host();
                (
                    Some((MemoryKind::Host, map.ptr() as u64 + within)),
                    fills.then(|| (filled.clone(), map.ptr(), map.len())),
                )
            }
            View::Imported(import, offset) => {
                (Some((import.kind, import.base + offset + within)), None)
            }
            View::ProcessVm => (None, None),
        };
        let page = self.page();
        let active = page.active(generation);
        active.fetch_add(1, Ordering::SeqCst);
        let result = if page.generation.load(Ordering::SeqCst) != generation {
            Err(CopyError::Stale)
        } else if !(if remote.is_some() {
            self.alive_lately()
        } else {
            self.alive()
        }) {
            // process_vm addresses the peer by pid: a fresh check, always.
            Err(CopyError::Failed(format!("process {pid} exited")))
        } else {
            match (remote, filling) {
                (_, Some((filled, base, map_len))) => {
                    // SAFETY: `within + len` lies inside our writable mapping of the
                    // owner's buffer (validated against the owner's table this
                    // generation, which the guard count pins); the source is the
                    // caller's host buffer (submit contract), in another mapping.
                    unsafe {
                        filled.write(
                            base,
                            map_len,
                            within as usize,
                            slice.local as *const u8,
                            slice.len as usize,
                        )
                    };
                    Ok(None)
                }
                (Some((MemoryKind::Host, addr)), _) if slice.local_kind.is_host() => {
                    let (src, dst) = match slice.op {
                        Op::Read => (addr as *const u8, slice.local as *mut u8),
                        Op::Write => (slice.local as *const u8, addr as *mut u8),
                    };
                    // SAFETY: the remote range lies inside our mapping of the owner's
                    // buffer (range validated against the owner's own table this
                    // generation, which the guard count pins); the local side is the
                    // caller's host buffer (submit contract).
                    Ok(unsafe { copy_host(slice.op, slice.len, slice.checksum, src, dst) })
                }
                (Some((kind, addr)), _) => {
                    let local = (slice.local_kind, slice.local);
                    let ((dk, d), (sk, s)) = match slice.op {
                        Op::Read => (local, (kind, addr)),
                        Op::Write => ((kind, addr), local),
                    };
                    // SAFETY: the remote range lies inside our mapping of the owner's
                    // buffer or allocation (range validated against the owner's own
                    // table this generation, which the guard count pins); the local side
                    // is the caller's buffer of `local_kind`. `copy` uses the driver for
                    // device memory and memmove for host memory.
                    unsafe { device::copy(dk, d, sk, s, slice.len as usize) }
                        .map(|()| None)
                        .map_err(|e| CopyError::Failed(e.to_string()))
                }
                (None, _) if slice.local_kind.is_host() => self.process_vm(slice).map(|()| None),
                (None, _) => Err(CopyError::Failed(
                    "device memory cannot move through process_vm".into(),
                )),
            }
        };
        release(active);
        result
    }

    fn process_vm(&self, slice: &Slice) -> std::result::Result<(), CopyError> {
        let (local, remote, len) = (slice.local, slice.remote, slice.len);
        let mut done = 0u64;
        while done < len {
            let l = libc::iovec {
                iov_base: (local + done) as *mut _,
                iov_len: (len - done) as usize,
            };
            let r = libc::iovec {
                iov_base: (remote + done) as *mut _,
                iov_len: (len - done) as usize,
            };
            // SAFETY: the local range is the caller's buffer (submit contract); the
            // remote range was validated against the owner's table under the guard
            // protocol. The kernel checks both mappings.
            let n = unsafe {
                match slice.op {
                    Op::Read => libc::process_vm_readv(self.pid, &l, 1, &r, 1, 0),
                    Op::Write => libc::process_vm_writev(self.pid, &l, 1, &r, 1, 0),
                }
            };
            if n <= 0 {
                let err = std::io::Error::last_os_error();
                return Err(match err.raw_os_error() {
                    _ if n == 0 => CopyError::Failed("process_vm moved no bytes".into()),
                    Some(libc::EFAULT) => {
                        CopyError::Rejected(format!("process_vm: bad address: {err}"))
                    }
                    Some(libc::EPERM) => {
                        CopyError::VmDenied(format!("process_vm({}): {err}", self.pid))
                    }
                    _ => CopyError::Failed(format!("process_vm({}): {err}", self.pid)),
                });
            }
            done += n as u64;
        }
        Ok(())
    }
}

struct ShmWorker {
    peers: HashMap<u64, Attached, IdHashing>,
    vm_denied: VmDenied,
}

impl ShmWorker {
    /// Copies the slice: `Ok` with the bytes' CRC32C when the copy folded them.
    fn transfer(&mut self, slice: &Slice) -> Result<Option<u32>, Outcome> {
        let desc = slice.peer.desc();
        let Some(host) = desc.host.as_ref() else {
            return Err(Outcome::PathFailed(
                "peer publishes no host identity".into(),
            ));
        };
        if self
            .peers
            .get(&slice.peer.id)
            .is_some_and(|a| a.token != host.token)
        {
            // The peer restarted under the same name.
            self.peers.remove(&slice.peer.id);
        }
        let attached = match self.peers.entry(slice.peer.id) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => match Attached::attach(host) {
                Ok(a) => v.insert(a),
                Err(e) => return Err(self.failed(slice, e)),
            },
        };
        let Some(buf) = desc.buffer_for(slice.remote, slice.len) else {
            return Err(Outcome::Rejected(format!(
                "[{:#x}, +{}) is not inside one buffer of {}",
                slice.remote, slice.len, slice.peer.name
            )));
        };
        attached.copy(slice, buf).map_err(|e| self.failed(slice, e))
    }

    fn failed(&mut self, slice: &Slice, e: CopyError) -> Outcome {
        match e {
            CopyError::Stale => Outcome::Stale,
            CopyError::Rejected(why) => Outcome::Rejected(why),
            CopyError::Denied(why) => {
                // Not permitted here (other user, container policy): use TCP.
                log::info!(
                    "shm to {} unavailable, falling back: {why}",
                    slice.peer.name
                );
                slice.peer.disable(Kind::Shm);
                self.peers.remove(&slice.peer.id);
                Outcome::PathFailed(why)
            }
            CopyError::VmDenied(why) => {
                // Yama or a container policy: memfd buffers still map, the rest of
                // this peer's buffers go another way from now on.
                log::info!(
                    "shm: process_vm to {} not permitted ({why}); its application-registered \
                     buffers go another way",
                    slice.peer.name
                );
                self.vm_denied.write_locked().insert(slice.peer.id);
                Outcome::PathFailed(why)
            }
            CopyError::Failed(why) => {
                self.peers.remove(&slice.peer.id);
                Outcome::PathFailed(why)
            }
        }
    }
}

impl TransportWorker for ShmWorker {
    fn post(&mut self, slice: Slice, done: &mut Vec<Finished>) {
        let (outcome, crc) = match self.transfer(&slice) {
            Ok(crc) => (Outcome::Done, crc),
            Err(outcome) => (outcome, None),
        };
        done.push(Finished {
            id: slice.id,
            outcome,
            crc,
        });
    }
}
