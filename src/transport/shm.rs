//! Same-host transfers between processes with one copy: `process_vm_readv` /
//! `process_vm_writev` straight between the two address spaces.
//!
//! Safety across processes rests on a shared guard page (a memfd each engine exposes):
//! it holds a random token (proving which process we are talking to), a generation
//! bumped on every unregistration, and a count of copies in progress. A copier
//! increments the count, checks the generation against the descriptor it validated
//! against, copies, and decrements; an unregistering owner bumps the generation and
//! waits for the count to drain. So no copy can touch a buffer after
//! `unregister_memory` returns. A pidfd tells whether the peer still lives, so a
//! recycled PID is never written to.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{Finished, Kind, Op, Outcome, Slice, Transport, TransportWorker};
use crate::error::{Error, Result};
use crate::memory::Region;
use crate::metadata::{HostInfo, SegmentDesc};

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

/// A shared mapping of a guard page.
struct Mapping {
    ptr: *mut GuardPage,
}

// SAFETY: the mapping is only accessed through atomics.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn map(fd: RawFd) -> std::io::Result<Mapping> {
        // SAFETY: maps one page of a memfd we hold open; checked for MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping { ptr: ptr.cast() })
    }

    fn page(&self) -> &GuardPage {
        // SAFETY: `ptr` maps a whole page, alive until drop; all fields are atomics.
        unsafe { &*self.ptr }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the page mapped in `map`.
        unsafe { libc::munmap(self.ptr.cast(), PAGE) };
    }
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

pub struct ShmTransport {
    memfd: OwnedFd,
    page: Mapping,
    host_id: String,
}

impl ShmTransport {
    pub fn new() -> Result<ShmTransport> {
        let name = CString::new("mooncake-shm-guard").expect("no NUL");
        // SAFETY: valid C string; the result is checked.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::io("memfd_create", std::io::Error::last_os_error()));
        }
        // SAFETY: fresh descriptor.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain syscall on our descriptor.
        if unsafe { libc::ftruncate(fd, PAGE as libc::off_t) } != 0 {
            return Err(Error::io("ftruncate guard page", std::io::Error::last_os_error()));
        }
        let page = Mapping::map(fd).map_err(|e| Error::io("mmap guard page", e))?;
        page.page().token.store(random_u64() | 1, Ordering::SeqCst);
        // Under Yama's ptrace_scope=1 only ancestors may process_vm_* us: allow peers.
        // SAFETY: prctl with integer arguments only.
        unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
        Ok(ShmTransport {
            memfd,
            page,
            host_id: host_id(),
        })
    }
}

impl Transport for ShmTransport {
    fn kind(&self) -> Kind {
        Kind::Shm
    }

    fn unregister(&self, region: &Region) {
        let page = self.page.page();
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
        let page = self.page.page();
        desc.host = Some(HostInfo {
            host_id: self.host_id.clone(),
            pid: std::process::id(),
            guard_fd: self.memfd.as_raw_fd(),
            token: page.token.load(Ordering::SeqCst),
            generation: page.generation.load(Ordering::SeqCst),
        });
    }

    fn reaches(&self, peer: &SegmentDesc) -> bool {
        peer.host
            .as_ref()
            .is_some_and(|h| h.host_id == self.host_id && h.pid != std::process::id() && h.guard_fd >= 0)
    }

    fn slice_size(&self) -> u64 {
        16 << 20
    }

    fn new_worker(&self) -> Result<Box<dyn TransportWorker>> {
        Ok(Box::new(ShmWorker { peers: HashMap::new() }))
    }
}

/// A peer process we have attached to.
struct Attached {
    pid: i32,
    token: u64,
    pidfd: OwnedFd,
    page: Mapping,
}

impl Attached {
    fn attach(h: &HostInfo) -> std::result::Result<Attached, String> {
        let pid = h.pid as i32;
        // SAFETY: pidfd_open takes a pid and flags.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
        if pidfd < 0 {
            return Err(format!("pidfd_open({pid}): {}", std::io::Error::last_os_error()));
        }
        // SAFETY: fresh descriptor.
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
        let path = format!("/proc/{pid}/fd/{}", h.guard_fd);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("open {path}: {e}"))?;
        let page = Mapping::map(file.as_raw_fd()).map_err(|e| format!("mmap {path}: {e}"))?;
        if page.page().token.load(Ordering::SeqCst) != h.token {
            return Err(format!("{path} is not the published guard page"));
        }
        let attached = Attached { pid, token: h.token, pidfd, page };
        // The pidfd was taken before the page was checked, so a live pidfd proves the
        // token belongs to the same process we will copy to.
        if !attached.alive() {
            return Err(format!("process {pid} exited"));
        }
        Ok(attached)
    }

    fn alive(&self) -> bool {
        let mut pfd = libc::pollfd { fd: self.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd; a pidfd turns readable when the process exits.
        unsafe { libc::poll(&mut pfd, 1, 0) == 0 }
    }

    /// One guarded copy. `generation` is the one the range was validated against.
    fn copy(&self, op: Op, local: u64, remote: u64, len: u64, generation: u64) -> Outcome {
        let page = self.page.page();
        page.active.fetch_add(1, Ordering::SeqCst);
        let outcome = if page.generation.load(Ordering::SeqCst) != generation {
            Outcome::Stale
        } else if !self.alive() {
            Outcome::PathFailed(format!("process {} exited", self.pid))
        } else {
            self.copy_unguarded(op, local, remote, len)
        };
        page.active.fetch_sub(1, Ordering::SeqCst);
        outcome
    }

    fn copy_unguarded(&self, op: Op, local: u64, remote: u64, len: u64) -> Outcome {
        let mut done = 0u64;
        while done < len {
            let l = libc::iovec { iov_base: (local + done) as *mut _, iov_len: (len - done) as usize };
            let r = libc::iovec { iov_base: (remote + done) as *mut _, iov_len: (len - done) as usize };
            // SAFETY: the local range is the caller's buffer (submit contract); the
            // remote range was validated against the peer's published buffers under
            // the guard protocol. The kernel checks both mappings.
            let n = unsafe {
                match op {
                    Op::Read => libc::process_vm_readv(self.pid, &l, 1, &r, 1, 0),
                    Op::Write => libc::process_vm_writev(self.pid, &l, 1, &r, 1, 0),
                }
            };
            if n <= 0 {
                let err = std::io::Error::last_os_error();
                return match err.raw_os_error() {
                    Some(libc::EFAULT) => Outcome::Rejected(format!("process_vm: bad address: {err}")),
                    _ if n == 0 => Outcome::PathFailed("process_vm moved no bytes".into()),
                    _ => Outcome::PathFailed(format!("process_vm({}): {err}", self.pid)),
                };
            }
            done += n as u64;
        }
        Outcome::Done
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
        if self.peers.get(&slice.peer.id).is_some_and(|a| a.token != host.token) {
            self.peers.remove(&slice.peer.id);
        }
        if !self.peers.contains_key(&slice.peer.id) {
            match Attached::attach(host) {
                Ok(a) => {
                    self.peers.insert(slice.peer.id, a);
                }
                Err(why) => {
                    // Not permitted here (other user, container policy): use TCP.
                    log::info!("shm to {} unavailable, falling back: {why}", slice.peer.name);
                    slice.peer.disable(Kind::Shm);
                    return Outcome::PathFailed(why);
                }
            }
        }
        let attached = &self.peers[&slice.peer.id];
        if desc.buffer_for(slice.remote, slice.len).is_none() {
            return Outcome::Rejected(format!(
                "[{:#x}, +{}) is not inside one buffer of {}",
                slice.remote, slice.len, slice.peer.name
            ));
        }
        let outcome = attached.copy(slice.op, slice.local, slice.remote, slice.len, host.generation);
        if let Outcome::PathFailed(why) = &outcome {
            if why.contains("Operation not permitted") {
                slice.peer.disable(Kind::Shm);
            }
            self.peers.remove(&slice.peer.id);
        }
        outcome
    }
}

impl TransportWorker for ShmWorker {
    fn post(&mut self, slice: Slice, done: &mut Vec<Finished>) {
        let outcome = self.transfer(&slice);
        done.push(Finished { id: slice.id, outcome });
    }

    fn progress(&mut self, _now: Instant, _done: &mut Vec<Finished>) -> bool {
        false
    }

    fn in_flight(&self) -> usize {
        0
    }

    fn wait_fd(&self) -> Option<RawFd> {
        None
    }
}
