//! Thin safe wrappers over the few Linux calls std does not offer: epoll, eventfd,
//! futexes, vectored I/O on raw descriptors, and non-blocking connect.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn cvt_size(ret: libc::ssize_t) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// An epoll instance: registered descriptors and the tokens of those that are ready.
pub struct Epoll {
    fd: OwnedFd,
}

/// Interest in (or readiness for) reading.
pub const READABLE: u32 = libc::EPOLLIN as u32;
/// Interest in (or readiness for) writing.
pub const WRITABLE: u32 = libc::EPOLLOUT as u32;
/// Edge-triggered: reported once per change, not while the condition holds.
pub const EDGE: u32 = libc::EPOLLET as u32;

impl Epoll {
    /// A new epoll instance, closed on exec.
    pub fn new() -> io::Result<Epoll> {
        // SAFETY: plain syscall; the returned descriptor is owned from here on.
        let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Epoll { fd })
    }

    /// Watches `fd` for `events`, reported as `token`.
    pub fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: `ev` is a valid epoll_event for the duration of the call.
        cvt(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) })?;
        Ok(())
    }

    /// Stops watching `fd`.
    pub fn delete(&self, fd: RawFd) -> io::Result<()> {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: `ev` is a valid epoll_event for the call (EPOLL_CTL_DEL ignores it, but pre-2.6.9
        // kernels require a non-null pointer); `self.fd` is our open epoll descriptor.
        cvt(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, &mut ev) })?;
        Ok(())
    }

    /// Waits up to `timeout_ms` (-1: forever, 0: poll) and returns the ready tokens.
    pub fn wait(&self, tokens: &mut Vec<u64>, timeout_ms: i32) -> io::Result<()> {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
        // SAFETY: the buffer holds 64 events and we pass its length.
        let n = unsafe {
            libc::epoll_wait(
                self.fd.as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as i32,
                timeout_ms,
            )
        };
        tokens.clear();
        match cvt(n) {
            Ok(n) => {
                tokens.extend(events[..n as usize].iter().map(|e| e.u64));
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The epoll descriptor, for nesting in another poller.
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// A counter descriptor used to wake a parked thread.
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A new non-blocking eventfd, closed on exec.
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: plain syscall.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        // SAFETY: fresh descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(EventFd { fd })
    }

    /// Wakes whoever polls this descriptor.
    pub fn notify(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64. A full counter (EAGAIN) already
        // means "woken", so the result needs no handling.
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Clears pending wake-ups.
    pub fn drain(&self) {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a live u64; EAGAIN (nothing pending) is fine.
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }

    /// The descriptor to poll for wake-ups.
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Sleeps until `fd` (when given) is readable, this eventfd is notified, or
    /// `timeout` passes (`None`: no limit). Returns whether it was notified; the
    /// count is left pending (see [`EventFd::drain`]). A signal ends the wait early,
    /// like a timeout, so callers wait in a loop that re-checks their condition.
    pub fn wait(&self, fd: Option<RawFd>, timeout: Option<Duration>) -> io::Result<bool> {
        let poll_fd = |fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let mut fds = [poll_fd(self.fd.as_raw_fd()), poll_fd(fd.unwrap_or(-1))];
        let n = if fd.is_some() { 2 } else { 1 };
        let ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs().min(i32::MAX as u64) as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const _);
        // SAFETY: `fds` holds `n` valid pollfds and `ts_ptr` is null or points at a
        // live timespec; both outlive the call.
        match cvt(unsafe { libc::ppoll(fds.as_mut_ptr(), n, ts_ptr, std::ptr::null()) }) {
            Ok(_) => Ok(fds[0].revents != 0),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// `writev` on a descriptor; parts are (pointer, length) pairs.
///
/// # Safety
/// Every part must be readable for its length.
pub unsafe fn writev(fd: RawFd, parts: &[(*const u8, usize)]) -> io::Result<usize> {
    let iov: Vec<libc::iovec> = parts
        .iter()
        .filter(|p| p.1 > 0)
        .map(|&(base, len)| libc::iovec {
            iov_base: base as *mut _,
            iov_len: len,
        })
        .collect();
    // SAFETY: the caller guarantees the parts are readable; `iov` outlives the call.
    // MSG_NOSIGNAL semantics come from ignoring SIGPIPE (see `ignore_sigpipe`).
    cvt_size(unsafe { libc::writev(fd, iov.as_ptr(), iov.len() as i32) })
}

/// `readv` on a descriptor; parts are (pointer, length) pairs.
///
/// # Safety
/// Every part must be writable for its length and not aliased.
pub unsafe fn readv(fd: RawFd, parts: &[(*mut u8, usize)]) -> io::Result<usize> {
    let iov: Vec<libc::iovec> = parts
        .iter()
        .filter(|p| p.1 > 0)
        .map(|&(base, len)| libc::iovec {
            iov_base: base.cast(),
            iov_len: len,
        })
        .collect();
    // SAFETY: the caller guarantees the parts are writable; `iov` outlives the call.
    cvt_size(unsafe { libc::readv(fd, iov.as_ptr(), iov.len() as i32) })
}

/// The IPv4 address of the network interface `name` (its first); `None` when no
/// interface of that name has one.
pub fn interface_ipv4(name: &str) -> io::Result<Option<Ipv4Addr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list that is freed below.
    cvt(unsafe { libc::getifaddrs(&mut head) })?;
    let mut found = None;
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_name.is_null() || ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: a NUL-terminated name owned by the list.
        let ifa_name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
        // SAFETY: a non-null ifa_addr points at a sockaddr, whose family says its type.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        if ifa_name.to_bytes() == name.as_bytes() && family == libc::AF_INET {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let sin = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
            found = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
            break;
        }
    }
    // SAFETY: the list getifaddrs returned, freed once; nothing borrowed from it remains.
    unsafe { libc::freeifaddrs(head) };
    Ok(found)
}

/// Broken connections must surface as EPIPE, not kill the process.
pub fn ignore_sigpipe() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: installing SIG_IGN for SIGPIPE has no memory-safety preconditions.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    });
}

/// Faults the pages of `[addr, addr + len)` in for writing with one call
/// (`MADV_POPULATE_WRITE`, Linux 5.14), so a copy into fresh memory takes no fault per
/// page; pages already there cost a page-table walk. An older kernel refuses it, and
/// the copy then faults as before: the result is ignored.
///
/// # Safety
/// The range must lie in one live writable mapping; populating changes no contents.
pub unsafe fn populate_for_write(addr: *mut u8, len: usize) {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    let start = addr as usize & !(page - 1);
    let end = (addr as usize).saturating_add(len);
    // SAFETY: the caller's contract; the range is widened only to whole pages of
    // the same mapping (mappings are page-aligned).
    unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            end - start,
            libc::MADV_POPULATE_WRITE,
        )
    };
}

/// Moves the calling thread to the idle scheduling class (`SCHED_IDLE`): it runs only
/// on CPU time no other thread wants. For background work that must never delay the
/// caller's own threads.
pub fn run_at_idle_priority() -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param for the call; pid 0 is the calling thread.
    cvt(unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) }).map(|_| ())
}

/// Starts a non-blocking connect; the stream becomes writable once it completes.
pub fn connect_nonblocking(addr: SocketAddr) -> io::Result<TcpStream> {
    // SAFETY: the sockaddr storage is zeroed and filled per family below.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let (family, len) = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            let sin = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
            (libc::AF_INET, std::mem::size_of::<libc::sockaddr_in>())
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in6 and was zeroed
            // above, so the `&mut` reborrow is a valid, exclusive view of it.
            let sin6 = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_scope_id = a.scope_id();
            (libc::AF_INET6, std::mem::size_of::<libc::sockaddr_in6>())
        }
    };
    // SAFETY: plain syscall.
    let fd = cvt(unsafe {
        libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    })?;
    // SAFETY: fresh descriptor, owned by the stream from here on.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    // SAFETY: `storage` holds a valid address of `len` bytes.
    let ret = unsafe {
        libc::connect(
            fd,
            &storage as *const _ as *const libc::sockaddr,
            len as u32,
        )
    };
    if ret < 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(err);
        }
    }
    Ok(stream)
}

/// For a non-blocking connect: `None` while in progress, then its result.
pub fn connect_result(stream: &TcpStream) -> Option<io::Result<()>> {
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    if n <= 0 {
        return None;
    }
    match stream.take_error() {
        Ok(None) => Some(Ok(())),
        Ok(Some(e)) | Err(e) => Some(Err(e)),
    }
}

/// Whether an idle connection is over: the peer closed it (or reset it, or sent
/// something unasked), so a request must not be sent on it. One non-blocking peek.
pub fn idle_connection_closed(stream: &TcpStream) -> bool {
    let mut byte = 0u8;
    // SAFETY: a one-byte buffer we own, valid for the call.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error().kind();
        return !matches!(e, io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted);
    }
    true
}

/// Sleeps while `word` holds `expected`, for at most `timeout`: returns at once when
/// it holds something else, when woken ([`futex_wake`]), when the time is up, or on a
/// signal, so callers check `word` again. Not the private kind: `word` may lie in
/// memory shared with another process.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned u32 for the call and `ts` a valid relative
    // timeout; FUTEX_WAIT reads the word and touches nothing else.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
}

/// Wakes every thread, of any process, sleeping in [`futex_wait`] on `word`.
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned u32; FUTEX_WAKE only reads its address.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

/// Which host this process is on, for same-host shortcuts (shared memory, mailboxes):
/// `boot_id`, PID namespace and network namespace. Equal PID namespaces on one boot can
/// name each other's PIDs (and so open each other's descriptors through `/proc`); a
/// peer in another network namespace is treated as another host, as the multi-host
/// tests simulate hosts with network namespaces.
pub fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let namespace = |kind: &str| {
        std::fs::read_link(format!("/proc/self/ns/{kind}"))
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    };
    format!("{}/{}|{}", boot.trim(), namespace("pid"), namespace("net"))
}

/// Whether `stream` is over: the peer closed or reset it, or it was shut down here,
/// even with bytes still waiting to be read. One `poll` that does not wait.
pub fn stream_ended(stream: &TcpStream) -> bool {
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one pollfd we own, valid for the call; a zero timeout never blocks.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    let over = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL;
    n > 0 && pfd.revents & over != 0
}

/// One `recv` that never blocks: `WouldBlock` when nothing is there yet.
pub fn recv_nonblocking(stream: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is ours and writable for its length during the call.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Whether a thread about to spin would leave every other runnable thread of the
/// machine a CPU: the kernel's count of runnable threads right now (the fourth field
/// of `/proc/loadavg`, the caller included) is at most the CPUs this process may use.
/// False when it cannot tell.
pub fn cpu_to_spare() -> bool {
    cpus_beyond_runnable().is_some_and(|spare| spare >= 0)
}

/// Whether a CPU would sit idle even with the calling thread running: runnable
/// threads (the caller included) are fewer than the CPUs this process may use. For
/// background work that should leave the next woken thread a CPU of its own. False
/// when it cannot tell.
pub fn cpu_idle_beside_caller() -> bool {
    cpus_beyond_runnable().is_some_and(|spare| spare >= 1)
}

/// The CPUs this process may use (its affinity and CPU quota), asked once.
fn usable_cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The CPUs this process may use minus the machine's runnable threads right now.
fn cpus_beyond_runnable() -> Option<i64> {
    use std::os::unix::fs::FileExt;
    // One descriptor for the process: `pread` takes its offset, so threads share it.
    static LOADAVG: OnceLock<Option<std::fs::File>> = OnceLock::new();
    let cpus = usable_cpus();
    let loadavg = LOADAVG.get_or_init(|| std::fs::File::open("/proc/loadavg").ok());
    let mut text = [0u8; 128];
    let n = loadavg.as_ref()?.read_at(&mut text, 0).ok()?;
    let running = runnable_threads(&text[..n])?;
    Some(cpus as i64 - running as i64)
}

/// How long a server connection polls for its peer's next request before it blocks
/// (waking a blocked thread costs tens of microseconds on a VM, more than a small
/// request takes to arrive): briefly for a peer that came back slowly last time, and
/// patiently for one that came back within the patient spin. A synchronous caller
/// comes back within microseconds; a store client reading batch after batch within
/// ~100 µs, once it has copied what the last answer named. Polling stops once the
/// request is in and runs only while a CPU is to spare, so the patient spin costs its
/// whole length only after a peer's last request of a run. At most half the CPUs'
/// worth of a process's connections poll patiently at once (the rest poll briefly),
/// so a server with many busy connections does not spin a thread for each. (The
/// engine's data server keeps its brief poll: it runs inside the application's
/// process, and patience there lost 4 KiB reads in upstream's stress benchmark on two
/// cores.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestSpin {
    came_back_soon: bool,
}

/// This process's threads in a patient poll now.
static PATIENT_POLLS: AtomicUsize = AtomicUsize::new(0);

/// A place among the patient polls, given back when dropped.
struct PatientSlot;

impl PatientSlot {
    /// A place, unless `limit` threads hold one already.
    fn take(limit: usize) -> Option<PatientSlot> {
        PATIENT_POLLS
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| PatientSlot)
    }
}

impl Drop for PatientSlot {
    fn drop(&mut self) {
        PATIENT_POLLS.fetch_sub(1, Ordering::AcqRel);
    }
}

impl RequestSpin {
    /// The poll after a peer that came back slowly (or not yet at all).
    pub const BRIEF: Duration = Duration::from_micros(20);
    /// The poll after a peer that came back within it.
    pub const PATIENT: Duration = Duration::from_micros(200);

    /// How long to poll for the next request, were a patient place free.
    pub fn budget(self) -> Duration {
        if self.came_back_soon {
            Self::PATIENT
        } else {
            Self::BRIEF
        }
    }

    /// Polls `stream` for the next request ([`spin_until_readable`]) for `budget`, or
    /// briefly when the patient places are taken; true when it is readable.
    pub fn poll(self, stream: &TcpStream) -> bool {
        self.spin_for(|spin| spin_until_readable(stream, spin))
    }

    /// Runs `wait` with how long it may poll: `budget`, or briefly when the patient
    /// places are taken (a place is held while `wait` runs).
    pub fn spin_for<R>(self, wait: impl FnOnce(Duration) -> R) -> R {
        let slot = (self.budget() > Self::BRIEF)
            .then(|| PatientSlot::take((usable_cpus() / 2).max(1)))
            .flatten();
        let spin = if slot.is_some() {
            Self::PATIENT
        } else {
            Self::BRIEF
        };
        let got = wait(spin);
        drop(slot);
        got
    }

    /// Notes how long the connection waited for the request that just came in.
    pub fn came_back_after(&mut self, gap: Duration) {
        self.came_back_soon = gap <= Self::PATIENT;
    }
}

/// Polls `stream` for up to `spin` until it has a byte to read (or its end, or an
/// error, which the read that follows reports): true then, so that read does not put
/// the thread to sleep. Waking a blocked thread costs tens of microseconds on a VM,
/// more than a small request or answer takes to arrive. Spins only while the machine
/// has a CPU to spare ([`cpu_to_spare`], asked every 16 polls); false when nothing
/// came in time.
pub fn spin_until_readable(stream: &TcpStream, spin: Duration) -> bool {
    const POLLS_PER_CHECK: u32 = 16;
    let started = std::time::Instant::now();
    let mut byte = [0u8; 1];
    let mut polls = 0u32;
    loop {
        // SAFETY: `byte` is ours and writable for its length during the call.
        let n = unsafe {
            libc::recv(
                stream.as_raw_fd(),
                byte.as_mut_ptr().cast(),
                1,
                libc::MSG_DONTWAIT | libc::MSG_PEEK,
            )
        };
        if n >= 0 {
            return true;
        }
        let e = io::Error::last_os_error().kind();
        if e != io::ErrorKind::WouldBlock && e != io::ErrorKind::Interrupted {
            return true;
        }
        polls += 1;
        if polls % POLLS_PER_CHECK == 0 && (started.elapsed() >= spin || !cpu_to_spare()) {
            return false;
        }
        std::hint::spin_loop();
    }
}

/// The runnable count of a `/proc/loadavg` line ("0.78 1.32 1.56 1/77 30027").
fn runnable_threads(line: &[u8]) -> Option<usize> {
    let field = std::str::from_utf8(line).ok()?.split_whitespace().nth(3)?;
    field.split('/').next()?.parse().ok()
}

/// Sets SO_SNDBUF and SO_RCVBUF (0 leaves the kernel's auto-tuning alone).
pub fn set_socket_buffers(stream: &TcpStream, bytes: usize) {
    if bytes == 0 {
        return;
    }
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: passes a live c_int of the declared size.
        unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as u32,
            )
        };
    }
}

/// Whether every page of `[addr, addr+len)` is mapped in this process: `msync` with
/// `MS_ASYNC` writes nothing back and fails with ENOMEM on a hole.
pub fn is_mapped(addr: u64, len: u64) -> bool {
    // SAFETY: sysconf reads a constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    let start = addr & !(page - 1);
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    // SAFETY: msync only inspects this process's mappings of the range (MS_ASYNC
    // schedules no I/O since Linux 2.6.19); no memory is read or written.
    unsafe {
        libc::msync(
            start as *mut libc::c_void,
            (end - start) as usize,
            libc::MS_ASYNC,
        ) == 0
    }
}

/// Asks the kernel to drop `file`'s cached pages (only clean ones go: write the file
/// out first).
pub fn drop_page_cache(file: &std::fs::File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is open
    // for the duration of the call because `file` is borrowed.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Fills `buf` from the kernel's random pool, blocking only until it is seeded.
pub fn fill_random(buf: &mut [u8]) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: the kernel writes at most `rest.len()` bytes into `rest`.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        filled += n as usize;
    }
    Ok(())
}

/// A random u64 from the kernel; if the kernel has none to give, one still unique per
/// process and time.
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    match fill_random(&mut b) {
        Ok(()) => u64::from_ne_bytes(b),
        Err(_) => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            (t.as_nanos() as u64) ^ ((std::process::id() as u64) << 32)
        }
    }
}

/// Forks this process's line has gone through, bumped in each child as it starts.
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_fork_in_child() {
    // Async-signal-safe, as a child's fork handler must be: one atomic add.
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Which process of a fork line this is: equal values mean the same process, so
/// something made where the value was different belongs to an ancestor (its threads
/// did not follow into this child, its descriptors and mappings are shared with the
/// parent). The first call starts the count, so take the value of anything that must
/// tell a child apart when it is made.
pub fn fork_generation() -> u64 {
    // A flag, not a `Once`: a fork landing while another thread registers must not
    // leave the child a `Once` stuck in its running state.
    static COUNTING: AtomicBool = AtomicBool::new(false);
    if !COUNTING.load(Ordering::Acquire) && !COUNTING.swap(true, Ordering::AcqRel) {
        // SAFETY: the handler only touches a static atomic; glibc's pthread_atfork ties
        // it to this library's image, so unloading the library removes it.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(count_fork_in_child)) };
        if rc != 0 {
            log::warn!("forks cannot be told apart here (pthread_atfork: {rc})");
        }
    }
    FORKS.load(Ordering::Relaxed)
}

#[cfg(test)]
mod random_tests {
    #[test]
    fn two_draws_differ() {
        let (mut a, mut b) = ([0u8; 32], [0u8; 32]);
        super::fill_random(&mut a).unwrap();
        super::fill_random(&mut b).unwrap();
        assert_ne!(a, b);
    }
}

#[cfg(test)]
mod loadavg_tests {
    #[test]
    fn the_runnable_count_is_the_fourth_fields_numerator() {
        assert_eq!(
            super::runnable_threads(b"0.78 1.32 1.56 3/77 30027\n"),
            Some(3)
        );
        assert_eq!(super::runnable_threads(b"0.78 1.32 1.56"), None);
        assert_eq!(super::runnable_threads(b"0.78 1.32 1.56 x/77 1"), None);
        assert_eq!(super::runnable_threads(b"\xff\xfe"), None);
    }
}

#[cfg(test)]
mod interface_tests {
    use std::net::Ipv4Addr;

    #[test]
    fn an_interface_is_found_by_name() {
        // Every Linux network namespace has a loopback interface named `lo`.
        assert_eq!(
            super::interface_ipv4("lo").unwrap(),
            Some(Ipv4Addr::LOCALHOST)
        );
        assert_eq!(super::interface_ipv4("mc-no-such-if0").unwrap(), None);
        assert_eq!(super::interface_ipv4("").unwrap(), None);
    }
}

#[cfg(test)]
mod spin_tests {
    use super::spin_until_readable;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    #[test]
    fn a_server_waits_awake_longer_for_a_peer_that_came_back_soon() {
        use super::RequestSpin;
        let mut spin = RequestSpin::default();
        assert_eq!(spin.budget(), RequestSpin::BRIEF, "nothing known yet");
        for (gap_us, patient) in [
            (90, true),
            (200, true),
            (201, false),
            (5_000, false),
            (0, true),
        ] {
            spin.came_back_after(Duration::from_micros(gap_us));
            let want = if patient {
                RequestSpin::PATIENT
            } else {
                RequestSpin::BRIEF
            };
            assert_eq!(spin.budget(), want, "after a gap of {gap_us} us");
        }
    }

    #[test]
    fn patient_polls_are_limited_and_their_places_given_back() {
        use super::{PatientSlot, PATIENT_POLLS};
        use std::sync::atomic::Ordering;
        // Other tests may hold places now and then: the limit counts from what is
        // held when this one starts (no other test of this file takes one).
        let held = PATIENT_POLLS.load(Ordering::Acquire);
        let first = PatientSlot::take(held + 1).expect("a place is free");
        assert!(
            PatientSlot::take(held + 1).is_none(),
            "the limit is reached"
        );
        drop(first);
        assert!(PatientSlot::take(held + 1).is_some(), "its place came back");
        assert_eq!(PATIENT_POLLS.load(Ordering::Acquire), held);
    }

    #[test]
    fn readable_only_once_a_byte_or_the_end_arrived_and_nothing_is_consumed() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        let spin = Duration::from_micros(50);
        assert!(!spin_until_readable(&server, spin), "nothing sent yet");
        client.write_all(b"x").unwrap();
        // Bounded: the byte is on its way over loopback.
        assert!((0..100_000).any(|_| spin_until_readable(&server, spin)));
        let mut got = [0u8; 1];
        server.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"x", "the peek left the byte for the read");
        drop(client);
        assert!(
            (0..100_000).any(|_| spin_until_readable(&server, spin)),
            "the end"
        );
    }
}

#[cfg(test)]
mod populate_tests {
    use crate::memfd::{SharedMemory, Sharing};

    #[test]
    fn populating_an_unaligned_range_changes_no_byte() {
        let len = 5 << 12;
        let shm = SharedMemory::create("populate-test", len, Sharing::PeersWrite).unwrap();
        // SAFETY: the mapping is this test's alone, `len` bytes long.
        let bytes = unsafe { std::slice::from_raw_parts_mut(shm.ptr(), len) };
        for (i, b) in bytes[..2 << 12].iter_mut().enumerate() {
            *b = (i % 251) as u8 + 1;
        }
        // From inside the first page over written and fresh pages, to inside the last.
        // SAFETY: the range lies in the mapping.
        unsafe { super::populate_for_write(shm.ptr().add(100), len - 200) };
        // SAFETY: as above.
        let bytes = unsafe { std::slice::from_raw_parts(shm.ptr(), len) };
        assert!(bytes[..2 << 12]
            .iter()
            .enumerate()
            .all(|(i, b)| *b == (i % 251) as u8 + 1));
        assert!(
            bytes[2 << 12..].iter().all(|b| *b == 0),
            "fresh pages read zero"
        );
    }
}
