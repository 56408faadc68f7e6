//! Same-host transfers between processes with one copy and no network: plain memcpy
//! through a mapping of the peer's buffer when the peer allocated it from the engine
//! (memfd-backed), otherwise `process_vm_readv` / `process_vm_writev`.
//!
//! Safety across processes rests on a shared guard page (a memfd every engine exposes):
//! it holds a random token (proving which process we are talking to), a generation
//! bumped on every unregistration, and a count of copies in progress. A copier
//! increments the count, checks the generation against the descriptor it validated
//! against, copies, and decrements; an unregistering owner bumps the generation and
//! waits for the count to drain. So no copy touches a buffer after
//! `unregister_memory` returns. A pidfd tells whether the peer still lives, so a
//! recycled PID is never written to.
//!
//! Device memory (CUDA, HIP) moves GPU to GPU without touching the CPU: a registered
//! device buffer is exported with an IPC handle (published as `mc_ipc_handle`), which
//! a same-host peer opens once per buffer and generation; the driver then copies
//! between the mapped peer allocation and our side, host or device. A local device
//! buffer also goes straight to or from a peer's memfd-backed host buffer with one
//! driver copy. What this cannot carry (device memory on the peer without a handle, or
//! local device memory against a peer buffer reachable only by process_vm) is left to
//! other paths by `carries`.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{Finished, Kind, Op, Outcome, RegionKeys, Slice, Transport, TransportWorker};
use crate::device::{self, IpcExport, MemoryKind};
use crate::error::{Error, Result};
use crate::memfd::{self, Mapping, SharedMemory};
use crate::metadata::{BufferDesc, HostInfo, SegmentDesc};
use crate::registry::Region;

const PAGE: usize = 4096;
/// How long an unregistration waits for a crashed copier's count before going on.
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// The guard page layout, shared by owner and copiers.
#[repr(C)]
struct GuardPage {
    token: AtomicU64,
    generation: AtomicU64,
    active: AtomicU64,
}

/// # Safety
/// `ptr` must point at a live mapping of at least one page.
unsafe fn guard_page<'a>(ptr: *mut u8) -> &'a GuardPage {
    // SAFETY: the caller guarantees `ptr` is a live mapping of at least a page, so the 24-byte
    // GuardPage is in bounds; callers pass a mapping's start, which is page-aligned (the contract
    // leaves that and `'a` to them). All fields are atomics, so sharing across processes is sound.
    unsafe { &*(ptr as *const GuardPage) }
}

/// `boot_id` plus PID namespace: two processes with equal ids can name each other's PIDs.
pub fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns = std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!("{}/{}", boot.trim(), ns)
}

fn random_u64() -> u64 {
    let mut v = 0u64;
    // SAFETY: fills 8 bytes of a live u64.
    let n = unsafe { libc::getrandom((&mut v as *mut u64).cast(), 8, 0) };
    if n == 8 {
        v
    } else {
        // Weak fallback: still unique per process and time.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        (t.as_nanos() as u64) ^ ((std::process::id() as u64) << 32)
    }
}

/// Same-host transport: peer memfds mapped here, or `process_vm_readv`/`writev`.
pub struct ShmTransport {
    guard: SharedMemory,
    host_id: String,
}

impl ShmTransport {
    /// A transport for peers on this host.
    pub fn new() -> Result<ShmTransport> {
        let guard = SharedMemory::create("mooncake-shm-guard", PAGE)
            .map_err(|e| Error::io("creating the shm guard page", e))?;
        let t = ShmTransport {
            guard,
            host_id: host_id(),
        };
        t.page().token.store(random_u64() | 1, Ordering::SeqCst);
        // Under Yama's ptrace_scope=1 only ancestors may process_vm_* us: allow peers.
        // SAFETY: prctl with integer arguments only.
        unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
        Ok(t)
    }

    fn page(&self) -> &GuardPage {
        // SAFETY: the guard memory is one page, alive as long as `self`.
        unsafe { guard_page(self.guard.ptr()) }
    }
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
        Ok(keys)
    }

    fn unregister(&self, region: &Region) {
        let page = self.page();
        page.generation.fetch_add(1, Ordering::SeqCst);
        let start = Instant::now();
        while page.active.load(Ordering::SeqCst) != 0 {
            if start.elapsed() > DRAIN_LIMIT {
                // Only a copier that died mid-copy leaves the count raised.
                log::warn!(
                    "shm: unregistering {:#x}: {} peer copies never finished; going on",
                    region.addr,
                    page.active.load(Ordering::SeqCst)
                );
                page.active.store(0, Ordering::SeqCst);
                break;
            }
            std::thread::yield_now();
        }
    }

    fn describe(&self, desc: &mut SegmentDesc) {
        let page = self.page();
        desc.host = Some(HostInfo {
            host_id: self.host_id.clone(),
            pid: std::process::id(),
            guard_fd: self.guard.fd(),
            token: page.token.load(Ordering::SeqCst),
            generation: page.generation.load(Ordering::SeqCst),
        });
    }

    fn reaches(&self, peer: &SegmentDesc) -> bool {
        peer.host.as_ref().is_some_and(|h| {
            h.host_id == self.host_id && h.pid != std::process::id() && h.guard_fd >= 0
        })
    }

    fn carries(&self, slice: &Slice) -> bool {
        let desc = slice.peer.desc();
        let Some(buf) = desc.buffer_for(slice.remote, slice.len) else {
            // Out of range: `transfer` rejects it with the reason.
            return true;
        };
        match MemoryKind::parse_location(&buf.name) {
            Ok(MemoryKind::Host) => slice.local_kind.is_host() || buf.shm_fd.is_some(),
            Ok(remote) => buf.ipc.is_some() && import_kind(remote, slice.local_kind).is_some(),
            Err(_) => false,
        }
    }

    fn slice_size(&self) -> u64 {
        16 << 20
    }

    fn new_worker(&self) -> Result<Box<dyn TransportWorker>> {
        Ok(Box::new(ShmWorker {
            peers: HashMap::new(),
        }))
    }
}

/// Why a copy could not happen.
enum CopyError {
    /// The descriptor we validated against is out of date.
    Stale,
    /// The peer refused or the address is bad: final.
    Rejected(String),
    /// Not permitted from here: stop trying shared memory with this peer.
    Denied(String),
    /// Anything else: retry on another path.
    Failed(String),
}

/// A peer process we have attached to.
struct Attached {
    pid: i32,
    token: u64,
    pidfd: OwnedFd,
    guard: Mapping,
    /// Mappings of the peer's memfd-backed buffers, by buffer address, valid for
    /// `generation`.
    buffers: HashMap<u64, Mapping>,
    /// The peer's device allocations opened through IPC, by buffer address, valid
    /// for `generation`.
    imports: HashMap<u64, Import>,
    generation: u64,
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
        let guard = memfd::map_peer(h.pid, h.guard_fd, PAGE)
            .map_err(|e| CopyError::Denied(e.to_string()))?;
        let attached = Attached {
            pid,
            token: h.token,
            pidfd,
            guard,
            buffers: HashMap::new(),
            imports: HashMap::new(),
            generation: h.generation,
        };
        if attached.page().token.load(Ordering::SeqCst) != h.token {
            return Err(CopyError::Denied(format!(
                "fd {} of {pid} is not its guard page",
                h.guard_fd
            )));
        }
        // The pidfd was taken before the page was checked, so a live pidfd proves the
        // token belongs to the process we will copy to.
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
        unsafe { libc::poll(&mut pfd, 1, 0) == 0 }
    }

    /// Our mapping of a memfd-backed peer buffer, made on first use.
    fn buffer_mapping(
        &mut self,
        buf: &BufferDesc,
        fd: i32,
    ) -> std::result::Result<*mut u8, CopyError> {
        if let Some(m) = self.buffers.get(&buf.addr) {
            return Ok(m.ptr());
        }
        let m = memfd::map_peer(self.pid as u32, fd, buf.length as usize)
            .map_err(|e| CopyError::Failed(e.to_string()))?;
        let ptr = m.ptr();
        self.buffers.insert(buf.addr, m);
        Ok(ptr)
    }

    /// A peer device allocation opened through its IPC handle, made on first use.
    fn import(
        &mut self,
        buf: &BufferDesc,
        remote: MemoryKind,
        local: MemoryKind,
        ipc: &IpcExport,
    ) -> std::result::Result<&Import, CopyError> {
        use std::collections::hash_map::Entry;
        match self.imports.entry(buf.addr) {
            Entry::Occupied(e) => Ok(e.into_mut()),
            Entry::Vacant(v) => {
                let kind = import_kind(remote, local).ok_or_else(|| {
                    CopyError::Denied(format!("cannot open {} IPC handles here", buf.name))
                })?;
                let base = device::ipc_open(kind, &ipc.handle).map_err(|e| {
                    // Another container or driver instance: the handle is useless here.
                    CopyError::Denied(format!("opening the IPC handle of {:#x}: {e}", buf.addr))
                })?;
                Ok(v.insert(Import { kind, base }))
            }
        }
    }

    /// Where `slice`'s remote range is as this process sees it: inside a mapping of
    /// the peer's memfd or an opened IPC allocation; `None`: reachable only through
    /// process_vm.
    fn remote_view(
        &mut self,
        slice: &Slice,
        buf: &BufferDesc,
    ) -> std::result::Result<Option<(MemoryKind, u64)>, CopyError> {
        let within = slice.remote - buf.addr;
        match MemoryKind::parse_location(&buf.name) {
            Ok(MemoryKind::Host) => Ok(match buf.shm_fd {
                // Unmappable (e.g. sealed): process_vm still works for this buffer.
                Some(fd) => self
                    .buffer_mapping(buf, fd)
                    .ok()
                    .map(|base| (MemoryKind::Host, base as u64 + within)),
                None => None,
            }),
            Ok(remote) => {
                let ipc = buf.ipc.ok_or_else(|| {
                    CopyError::Failed(format!("device buffer {:#x} has no IPC handle", buf.addr))
                })?;
                let import = self.import(buf, remote, slice.local_kind, &ipc)?;
                Ok(Some((import.kind, import.base + ipc.offset + within)))
            }
            Err(e) => Err(CopyError::Rejected(e.to_string())),
        }
    }

    /// One guarded copy of a range inside `buf`, validated against `generation`.
    fn copy(
        &mut self,
        slice: &Slice,
        buf: &BufferDesc,
        generation: u64,
    ) -> std::result::Result<(), CopyError> {
        if generation != self.generation {
            // The peer's buffers changed: drop mappings of buffers that may be gone.
            self.buffers.clear();
            self.imports.clear();
            self.generation = generation;
        }
        let remote = self.remote_view(slice, buf)?;
        let page = self.page();
        page.active.fetch_add(1, Ordering::SeqCst);
        let result = if page.generation.load(Ordering::SeqCst) != generation {
            Err(CopyError::Stale)
        } else if !self.alive() {
            Err(CopyError::Failed(format!("process {} exited", self.pid)))
        } else {
            match remote {
                Some((kind, addr)) => {
                    let local = (slice.local_kind, slice.local);
                    let ((dk, d), (sk, s)) = match slice.op {
                        Op::Read => (local, (kind, addr)),
                        Op::Write => ((kind, addr), local),
                    };
                    // SAFETY: the remote range lies inside our mapping of the peer
                    // buffer or allocation (range validated against the descriptor of
                    // this generation, which the guard count pins); the local side is
                    // the caller's buffer of `local_kind`. `copy` uses the driver for
                    // device memory and memmove for host memory.
                    unsafe { device::copy(dk, d, sk, s, slice.len as usize) }
                        .map_err(|e| CopyError::Failed(e.to_string()))
                }
                None if slice.local_kind.is_host() => self.process_vm(slice),
                None => Err(CopyError::Failed(
                    "device memory cannot move through process_vm".into(),
                )),
            }
        };
        page.active.fetch_sub(1, Ordering::SeqCst);
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
            // remote range was validated against the peer's published buffers under
            // the guard protocol. The kernel checks both mappings.
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
                        CopyError::Denied(format!("process_vm({}): {err}", self.pid))
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
    peers: HashMap<u64, Attached>,
}

impl ShmWorker {
    fn transfer(&mut self, slice: &Slice) -> Outcome {
        let desc = slice.peer.desc();
        let Some(host) = desc.host.as_ref() else {
            return Outcome::PathFailed("peer publishes no host identity".into());
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
                Err(e) => return self.failed(slice, e),
            },
        };
        let Some(buf) = desc.buffer_for(slice.remote, slice.len) else {
            return Outcome::Rejected(format!(
                "[{:#x}, +{}) is not inside one buffer of {}",
                slice.remote, slice.len, slice.peer.name
            ));
        };
        match attached.copy(slice, buf, host.generation) {
            Ok(()) => Outcome::Done,
            Err(e) => self.failed(slice, e),
        }
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
            CopyError::Failed(why) => {
                self.peers.remove(&slice.peer.id);
                Outcome::PathFailed(why)
            }
        }
    }
}

impl TransportWorker for ShmWorker {
    fn post(&mut self, slice: Slice, done: &mut Vec<Finished>) {
        let outcome = self.transfer(&slice);
        done.push(Finished {
            id: slice.id,
            outcome,
        });
    }
}
