//! Segments a client lends besides its main one (Mooncake's `mount_segment` and
//! `allocate_and_mount_segment`): memory its engine allocates, or a file it maps,
//! registered with the engine (peers reach it under the client's segment name) and
//! mounted under an id of its own. Unmounted at once, or after a grace period in which
//! the master places nothing new there (reaped by the pinger), and on close.

use crate::util::sync::Unpoisoned;
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Client, MasterSession};
use crate::error::{Code, Error, Result};
use crate::protocol::{Request, SegmentInfo};

/// Space an extra segment takes is rounded up to this: the master's slab size, below
/// which a segment's tail is never used (Mooncake rounds to its slab size too).
pub const SEGMENT_ALIGN: u64 = 4 << 20;

/// Where an extra segment's memory came from, which says how to give it back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// Allocated by the engine (`allocate_segment`).
    Allocated,
    /// A shared mapping of a file (`mount_file_segment`).
    Mapped,
}

struct Mounted {
    info: SegmentInfo,
    backing: Backing,
    /// Set once an unmount with a grace period began: unmount for good then.
    release_at: Option<Instant>,
}

/// The extra segments of one client, by id.
#[derive(Default)]
pub(crate) struct Mounts {
    by_id: Mutex<HashMap<String, Mounted>>,
    last: AtomicU64,
}

impl Mounts {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Mounted>> {
        self.by_id.locked()
    }

    /// Whether any extra segment is mounted.
    pub(crate) fn any(&self) -> bool {
        !self.lock().is_empty()
    }
}

/// Maps `len` bytes of the file at `path` from `offset` (page-aligned), shared.
fn map_file(path: &str, offset: u64, len: u64) -> Result<*mut u8> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| {
            let code = match e.kind() {
                std::io::ErrorKind::NotFound => Code::FileNotFound,
                _ => Code::FileOpenFail,
            };
            Error::new(code, format!("opening {path}: {e}"))
        })?;
    let file_len = file
        .metadata()
        .map_err(|e| Error::new(Code::FileOpenFail, format!("{path}: {e}")))?
        .len();
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    if len == 0 || offset.checked_add(len).is_none_or(|end| end > file_len) {
        return Err(Error::invalid(format!(
            "{path}: [{offset}, +{len}) is empty or past the file's {file_len} bytes"
        )));
    }
    if offset % page != 0 {
        return Err(Error::invalid(format!(
            "{path}: offset {offset} is not a multiple of the page size {page}"
        )));
    }
    let (Ok(length), Ok(at)) = (usize::try_from(len), libc::off_t::try_from(offset)) else {
        return Err(Error::invalid(format!("{path}: range too large")));
    };
    // SAFETY: a fresh shared mapping of an open file (the mapping outlives the
    // descriptor); no existing memory is touched.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            length,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            at,
        )
    };
    if ptr == libc::MAP_FAILED {
        let e = std::io::Error::last_os_error();
        return Err(Error::new(
            Code::FileOpenFail,
            format!("mapping {path}: {e}"),
        ));
    }
    Ok(ptr.cast())
}

/// Undoes `map_file`.
fn unmap(base: u64, len: u64) {
    // SAFETY: `[base, base+len)` is a mapping `map_file` made, unregistered from the
    // engine (no transfer can touch it) and unmapped once.
    if unsafe { libc::munmap(base as *mut libc::c_void, len as usize) } != 0 {
        log::warn!(
            "unmapping a segment at {base:#x}: {}",
            std::io::Error::last_os_error()
        );
    }
}

impl Client {
    /// Allocates `size` bytes (rounded up to [`SEGMENT_ALIGN`]) of memory at
    /// `location` ("cpu:N", "cuda:N", ...; empty: host memory) and lends it to the pool
    /// as an extra segment: its id and the bytes allocated.
    pub fn allocate_segment(&self, size: u64, location: &str) -> Result<(String, u64)> {
        let len = size
            .checked_next_multiple_of(SEGMENT_ALIGN)
            .filter(|&l| l > 0 && usize::try_from(l).is_ok())
            .ok_or_else(|| Error::invalid(format!("segment size {size}")))?;
        let ptr = self
            .engine
            .allocate_buffer(len as usize, location_or_host(location))?;
        let id = self
            .shared
            .mount_extra(ptr as u64, len, Backing::Allocated)
            .inspect_err(|_| {
                let _ = self.engine.free_buffer(ptr);
            })?;
        Ok((id, len))
    }

    /// Maps `size` bytes of the file at `path` from `offset` (a multiple of the page
    /// size; the range must lie inside the file) and lends them to the pool as an
    /// extra segment; its id. The file's bytes are the segment's: what is stored there
    /// is written to the file.
    pub fn mount_file_segment(
        &self,
        path: &str,
        offset: u64,
        size: u64,
        location: &str,
    ) -> Result<String> {
        let ptr = map_file(path, offset, size)?;
        // SAFETY: a mapping of our own, valid until `unmap` after it is unregistered.
        let registered = unsafe {
            self.engine
                .register_memory(ptr, size as usize, location_or_host(location))
        };
        if let Err(e) = registered {
            unmap(ptr as u64, size);
            return Err(e);
        }
        self.shared
            .mount_extra(ptr as u64, size, Backing::Mapped)
            .inspect_err(|_| {
                let _ = self.engine.unregister_memory(ptr);
                unmap(ptr as u64, size);
            })
    }

    /// Unmounts the extra segment `id` of `backing`'s kind and gives its memory back:
    /// at once, or with a `grace` period after the master stops placing objects there
    /// (objects already there stay readable until it ends). `SEGMENT_NOT_FOUND` for an
    /// id this client did not mount that way.
    pub fn unmount_segment(&self, id: &str, backing: Backing, grace: Duration) -> Result<()> {
        let known = self
            .shared
            .mounts
            .lock()
            .get(id)
            .is_some_and(|m| m.backing == backing && m.release_at.is_none());
        if !known {
            return Err(Error::new(
                Code::SegmentNotFound,
                format!("no {backing:?} segment {id} of this client"),
            ));
        }
        if grace.is_zero() {
            return self.shared.release_extra(id);
        }
        self.shared.call_with_touches(&Request::Drain {
            client: self.shared.id,
            segment: id.to_owned(),
        })?;
        if let Some(m) = self.shared.mounts.lock().get_mut(id) {
            m.release_at = Some(Instant::now() + grace);
        }
        Ok(())
    }
}

impl Client {
    /// Gives up this node's disk tier (Mooncake's `unmount_local_disk_segment`): no
    /// new object is offloaded there at once; after `grace` (objects already there stay
    /// readable meanwhile; the call waits it out, or less if the client closes) every
    /// copy in it is deleted and the master told, so objects kept only there are gone.
    /// False, doing nothing, for a client without a disk tier.
    pub fn drain_disk_tier(&self, grace: Duration) -> bool {
        let catalog = || self.shared.catalog.locked();
        if !catalog().close_disk() {
            return false;
        }
        if !grace.is_zero() {
            self.shared.pause(grace);
        }
        catalog().drop_disk();
        true
    }
}

/// "" means host memory.
fn location_or_host(location: &str) -> &str {
    match location {
        "" => "cpu:0",
        l => l,
    }
}

impl MasterSession {
    /// Mounts `[base, base+len)`, registered with the engine, as an extra segment; its id.
    fn mount_extra(&self, base: u64, len: u64, backing: Backing) -> Result<String> {
        let seq = self.mounts.last.fetch_add(1, Ordering::Relaxed) + 1;
        // Mooncake's "first-second" form; the client id makes it unique in the pool.
        let id = format!("{}-{seq}", self.id);
        let info = SegmentInfo {
            name: self.engine.segment_name().to_owned(),
            base,
            size: len,
        };
        self.rpc.call(&Request::MountExtra {
            client: self.id,
            id: id.clone(),
            segment: info.clone(),
        })?;
        self.mounts.lock().insert(
            id.clone(),
            Mounted {
                info,
                backing,
                release_at: None,
            },
        );
        Ok(id)
    }

    /// Unmounts extra segment `id` and gives its memory back. A master that no longer
    /// knows it counts as unmounted; any other failure keeps it mounted.
    fn release_extra(&self, id: &str) -> Result<()> {
        match self.rpc.call(&Request::Unmount {
            client: self.id,
            name: id.to_owned(),
        }) {
            Err(e) if e.code() != Code::SegmentNotFound => return Err(e),
            _ => {}
        }
        let Some(m) = self.mounts.lock().remove(id) else {
            return Ok(()); // released meanwhile by another caller
        };
        let ptr = m.info.base as *mut u8;
        let freed = match m.backing {
            Backing::Allocated => self.engine.free_buffer(ptr),
            Backing::Mapped => self.engine.unregister_memory(ptr).map(|()| {
                unmap(m.info.base, m.info.size);
            }),
        };
        if let Err(e) = freed {
            log::warn!("releasing the memory of segment {id}: {e}");
        }
        Ok(())
    }

    /// Unmounts the extra segments whose grace period is over (`all`: every one).
    pub(crate) fn reap_extras(&self, all: bool) {
        let now = Instant::now();
        let due: Vec<String> = self
            .mounts
            .lock()
            .iter()
            .filter(|(_, m)| all || m.release_at.is_some_and(|t| t <= now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in due {
            if let Err(e) = self.release_extra(&id) {
                log::warn!("unmounting segment {id}: {e}");
            }
        }
    }

    /// Mounts the extra segments again on a master that lost them (empty: their
    /// objects were lost with its state); those in their grace period go instead.
    pub(crate) fn remount_extras(&self) {
        let (open, leaving): (Vec<_>, Vec<_>) = self
            .mounts
            .lock()
            .iter()
            .map(|(id, m)| (id.clone(), m.info.clone(), m.release_at.is_none()))
            .partition(|(_, _, open)| *open);
        for (id, info, _) in open {
            let req = Request::MountExtra {
                client: self.id,
                id: id.clone(),
                segment: info,
            };
            if let Err(e) = self.rpc.call(&req) {
                log::warn!("remounting segment {id}: {e}");
            }
        }
        for (id, _, _) in leaving {
            if let Err(e) = self.release_extra(&id) {
                log::warn!("unmounting segment {id}: {e}");
            }
        }
    }
}
