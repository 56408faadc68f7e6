//! Shareable memory: memfd-backed mappings this process creates, and mappings of a
//! same-host peer's memfd opened through `/proc/<pid>/fd/<n>`.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

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
    /// Maps `len` bytes of `fd` read-write and shared; `populate` prefaults the pages.
    pub fn map(fd: RawFd, len: usize, populate: bool) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "zero-length mapping",
            ));
        }
        let flags = libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 };
        // SAFETY: a fresh mapping of a descriptor we hold open; checked for MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
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
    /// Creates a memfd named `name` of `len` bytes and maps it here.
    pub fn create(name: &str, len: usize) -> io::Result<SharedMemory> {
        let cname = CString::new(name)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in name"))?;
        // SAFETY: valid C string; result checked.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
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
        let mapping = Mapping::map(fd.as_raw_fd(), len, false)?;
        Ok(SharedMemory { fd, mapping })
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

/// Maps `len` bytes of descriptor `fd` of process `pid` (needs ptrace-read access).
pub fn map_peer(pid: u32, fd: i32, len: usize) -> io::Result<Mapping> {
    let path = format!("/proc/{pid}/fd/{fd}");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| io::Error::new(e.kind(), format!("open {path}: {e}")))?;
    Mapping::map(file.as_raw_fd(), len, true)
        .map_err(|e| io::Error::new(e.kind(), format!("mmap {path}: {e}")))
}
