//! Shareable memory: memfd-backed mappings this process creates, and mappings of a
//! same-host peer's memfd opened through `/proc/<pid>/fd/<n>`.
//!
//! Everything here is lazy: creating a memfd of any size, or mapping one, allocates no
//! memory; a page costs memory only once someone touches it. (memfds live on the
//! kernel's internal shm mount, so `/dev/shm`'s size limit does not apply.)
//!
//! Every memfd is sealed against resizing, so no process that can open it (any
//! same-user process, through `/proc`) can shrink it under its owner (SIGBUS) or add
//! seals of its own. `Sharing::OwnerWrites` also seals future writes: only the
//! mapping the owner made at creation can write; peers map it read-only.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Who may write a memfd's contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// The owner and any peer that maps it.
    PeersWrite,
    /// Only the owner, through its own mapping; peers can map it read-only.
    OwnerWrites,
}

/// A shared mapping, unmapped on drop.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a mapping is plain memory; synchronization of its contents is the users' job.
unsafe impl Send for Mapping {}
// SAFETY: `&Mapping` only exposes the address and length, never unsynchronized access of its own;
// the mapping stays valid until drop, and users synchronize the shared contents.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` shared, read-write or read-only. Nothing is prefaulted:
    /// the mapping reserves address space only, and pages arrive as they are touched.
    pub fn map(fd: RawFd, len: usize, writable: bool) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "zero-length mapping",
            ));
        }
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        // SAFETY: a fresh mapping of a descriptor we hold open; checked for MAP_FAILED.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Maps `len` bytes of private anonymous memory: zeroed, page-aligned, committed
    /// as touched, and advised to be backed by transparent huge pages. Not shareable;
    /// here so that every mapping this crate makes has one owner type.
    pub fn anonymous(len: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "zero-length mapping",
            ));
        }
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        // SAFETY: a fresh anonymous mapping the kernel places; checked for MAP_FAILED.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // Advice only: kernels without transparent huge pages refuse it, harmlessly.
        // SAFETY: the range is the mapping just made.
        unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Start of the mapping.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length mapping.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Memory backed by a memfd this process owns.
pub struct SharedMemory {
    fd: OwnedFd,
    mapping: Mapping,
}

impl SharedMemory {
    /// Creates a memfd named `name` of `len` bytes (zeroed, untouched) and maps it
    /// here read-write; sealed as `sharing` says.
    pub fn create(name: &str, len: usize, sharing: Sharing) -> io::Result<SharedMemory> {
        let cname = CString::new(name)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in name"))?;
        // SAFETY: valid C string; result checked.
        let fd = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh descriptor owned from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let size = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "too large"))?;
        // SAFETY: plain syscall on our descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mapping = Mapping::map(fd.as_raw_fd(), len, true)?;
        let mut seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        if sharing == Sharing::OwnerWrites {
            // After our own writable mapping exists: it keeps writing, nobody else can.
            seals |= libc::F_SEAL_FUTURE_WRITE;
        }
        // SAFETY: fcntl on our descriptor with integer arguments.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(SharedMemory { fd, mapping })
    }

    /// The memfd and the local mapping, apart (the mapping outlives a closed memfd).
    pub fn into_parts(self) -> (OwnedFd, Mapping) {
        (self.fd, self.mapping)
    }

    /// The memfd, for peers to map through `/proc/<pid>/fd`.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Start of the local mapping.
    pub fn ptr(&self) -> *mut u8 {
        self.mapping.ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mapping.len()
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.mapping.is_empty()
    }
}

/// Which file an open descriptor is: device and inode, as `fstat` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileId {
    /// `st_dev`.
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
}

/// Identity and size of an open descriptor.
pub fn identify(fd: RawFd) -> io::Result<(FileId, u64)> {
    // SAFETY: an all-zero stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat fills `st`; result checked.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let id = FileId {
        dev: st.st_dev,
        ino: st.st_ino,
    };
    Ok((id, u64::try_from(st.st_size).unwrap_or(0)))
}

/// The seals on a memfd (0 for files that take none).
pub fn seals(fd: RawFd) -> u32 {
    // SAFETY: fcntl query with no pointer arguments.
    let s = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    u32::try_from(s).unwrap_or(0)
}

/// Whether no one can shrink the file under a mapping of its first `len` bytes (which
/// would make touching it a SIGBUS): at least `len` long and sealed against shrinking.
pub fn holds(fd: RawFd, len: u64) -> bool {
    let sealed = seals(fd) & libc::F_SEAL_SHRINK as u32 != 0;
    sealed && identify(fd).is_ok_and(|(_, size)| size >= len)
}

/// The name the kernel shows for an open descriptor of ours (`/memfd:NAME (deleted)`
/// for a memfd). Read from our own fd table, so it names the file we really hold.
pub fn name_of(file: &File) -> io::Result<String> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
    Ok(link.display().to_string())
}

/// What `/proc/self/fd/N` shows for a memfd created as `name`.
pub fn memfd_link(name: &str) -> String {
    format!("/memfd:{name} (deleted)")
}

/// Opens descriptor `fd` of process `pid` through `/proc/<pid>/fd` (needs the same
/// access as reading the peer's `/proc` entries, not ptrace attach), read-write or
/// read-only. Whose file this is must be checked by the caller.
pub fn open_peer(pid: u32, fd: i32, writable: bool) -> io::Result<File> {
    let path = format!("/proc/{pid}/fd/{fd}");
    std::fs::OpenOptions::new()
        .read(true)
        .write(writable)
        .open(&path)
        .map_err(|e| io::Error::new(e.kind(), format!("open {path}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_cannot_resize_and_owner_written_memory_is_read_only_to_them() {
        let shared = SharedMemory::create("mc-test-rw", 8192, Sharing::PeersWrite).unwrap();
        let own = SharedMemory::create("mc-test-ro", 8192, Sharing::OwnerWrites).unwrap();
        let me = std::process::id();
        for mem in [&shared, &own] {
            let f = open_peer(me, mem.fd(), mem.fd() == shared.fd()).unwrap();
            for size in [0, 1 << 20] {
                // SAFETY: plain syscall on a descriptor we hold.
                let resized = unsafe { libc::ftruncate(f.as_raw_fd(), size) };
                assert_ne!(resized, 0, "resizing to {size}");
            }
            assert_eq!(identify(f.as_raw_fd()).unwrap().1, 8192);
        }
        assert!(open_peer(me, shared.fd(), true).is_ok());
        let ro = open_peer(me, own.fd(), true).unwrap();
        assert!(Mapping::map(ro.as_raw_fd(), 8192, true).is_err());
        let view = Mapping::map(ro.as_raw_fd(), 8192, false).unwrap();
        // SAFETY: both mappings are 8192 bytes of the same memfd; the owner writes
        // through its own mapping, the reader sees it.
        unsafe {
            own.ptr().write(7);
            assert_eq!(view.ptr().read(), 7);
        }
        assert_eq!(name_of(&ro).unwrap(), memfd_link("mc-test-ro"));
        assert!(seals(ro.as_raw_fd()) & libc::F_SEAL_FUTURE_WRITE as u32 != 0);
    }
}
