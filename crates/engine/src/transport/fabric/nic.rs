//! One libfabric domain (a "NIC"): its fabric and domain objects, the serving endpoint
//! peers address their RMA to, the thread that drives that endpoint when the provider's
//! data progress is manual, and memory registrations in the domain.

use crate::util::sync::Unpoisoned;
use std::ffi::{c_int, c_void};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Code, Error, Result};
use crate::ffi::fabric::{self as fi, FabricLib};
use crate::sys::EventFd;

/// A raw pointer handed to the progress thread.
struct SendPtr<T>(*mut T);
// SAFETY: the pointee is a libfabric object of a FI_THREAD_SAFE domain, and the Nic
// joins the thread before closing it.
unsafe impl<T> Send for SendPtr<T> {}

/// Counters of the RMA peers direct at the serving endpoint.
#[derive(Clone, Copy)]
struct Counters {
    writes: *mut fi::fid_cntr,
    reads: *mut fi::fid_cntr,
}

// SAFETY: as for `SendPtr`; the Nic closes them after joining the progress thread.
unsafe impl Send for Counters {}

/// Entries asked for in each CQ: completions of this many outstanding operations.
const CQ_ENTRIES: usize = 1024;
/// What a CQ of the provider's default size is assumed to hold (`sockets`: 256).
const CQ_ENTRIES_DEFAULT: usize = 128;

/// One endpoint with its completion queue and address vector.
pub(super) struct Endpoint {
    pub ep: *mut fi::fid_ep,
    pub cq: *mut fi::fid_cq,
    pub av: *mut fi::fid_av,
    /// The CQ's wait descriptor (`FI_GETWAIT`), when the provider has one.
    pub fd: Option<RawFd>,
    /// How many completions the CQ is sure to hold: no more operations than this may
    /// be outstanding on the endpoint, as some providers (`sockets`) drop completions
    /// that find the CQ full.
    pub cq_entries: usize,
}

// SAFETY: the objects belong to a FI_THREAD_SAFE domain; an Endpoint is used by one
// thread at a time (its owner), and closed only by its owner.
unsafe impl Send for Endpoint {}

impl Endpoint {
    /// Opens an RDM endpoint in `nic`'s domain with its own CQ (with a wait descriptor
    /// if the provider offers one) and AV, and enables it.
    pub fn open(nic: &Nic) -> Result<Endpoint> {
        Endpoint::open_counted(nic, None)
    }

    /// As `open`, with counters of the WRITEs and READs peers direct at it.
    fn open_counted(nic: &Nic, counters: Option<Counters>) -> Result<Endpoint> {
        let (cq, cq_entries) = nic.open_cq()?;
        let mut fd: c_int = -1;
        // SAFETY: `cq` is live; FI_GETWAIT writes an int descriptor for FI_WAIT_FD CQs.
        let rc = unsafe {
            fi::fi_control(
                std::ptr::addr_of_mut!((*cq).fid),
                fi::FI_GETWAIT,
                (&mut fd as *mut c_int).cast(),
            )
        };
        let mut e = Endpoint {
            ep: std::ptr::null_mut(),
            cq,
            av: std::ptr::null_mut(),
            fd: (rc == 0 && fd >= 0).then_some(fd),
            cq_entries,
        };
        e.open_ep(nic, counters)?;
        Ok(e)
    }

    fn open_ep(&mut self, nic: &Nic, counters: Option<Counters>) -> Result<()> {
        let mut attr = fi::fi_av_attr {
            type_: nic.av_type,
            rx_ctx_bits: 0,
            count: 64,
            ep_per_node: 0,
            name: std::ptr::null(),
            map_addr: std::ptr::null_mut(),
            flags: 0,
        };
        // SAFETY: live domain, valid attr and out-pointer.
        nic.check("fi_av_open", unsafe {
            fi::fi_av_open(nic.domain, &mut attr, &mut self.av)
        })?;
        // SAFETY: live domain; `info` is the info the domain was opened with.
        nic.check("fi_endpoint", unsafe {
            fi::fi_endpoint(nic.domain, nic.info, &mut self.ep)
        })?;
        // SAFETY: `ep`, `cq` and `av` are live objects of this domain.
        unsafe {
            nic.check(
                "fi_ep_bind(cq)",
                fi::fi_ep_bind(
                    self.ep,
                    std::ptr::addr_of_mut!((*self.cq).fid),
                    fi::FI_TRANSMIT | fi::FI_RECV,
                ),
            )?;
            nic.check(
                "fi_ep_bind(av)",
                fi::fi_ep_bind(self.ep, std::ptr::addr_of_mut!((*self.av).fid), 0),
            )?;
            if let Some(c) = counters {
                for (cntr, what) in [
                    (c.writes, fi::FI_REMOTE_WRITE),
                    (c.reads, fi::FI_REMOTE_READ),
                ] {
                    nic.check(
                        "fi_ep_bind(cntr)",
                        fi::fi_ep_bind(self.ep, std::ptr::addr_of_mut!((*cntr).fid), what),
                    )?;
                }
            }
            nic.check("fi_enable", fi::fi_enable(self.ep))?;
        }
        Ok(())
    }

    /// The endpoint's address, as peers insert it into their AVs.
    pub fn name(&self, nic: &Nic) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 64];
        for _ in 0..2 {
            let mut len = buf.len();
            // SAFETY: live, enabled endpoint; `buf` has `len` writable bytes.
            let rc = unsafe { fi::fi_getname(self.ep, buf.as_mut_ptr().cast(), &mut len) };
            if rc == 0 {
                buf.truncate(len);
                return Ok(buf);
            }
            if len > buf.len() && len <= 4096 {
                buf.resize(len, 0);
                continue;
            }
            nic.check("fi_getname", rc)?;
        }
        Err(nic.error("fi_getname", "address keeps growing"))
    }

    /// Replaces endpoint, AV and CQ after a connection-level error: the provider may
    /// have torn down its connection to a peer for good. Nothing the old endpoint had
    /// posted is reported afterwards. On error the endpoint stays closed (null).
    pub fn reset(&mut self, nic: &Nic) -> Result<()> {
        self.close();
        *self = Endpoint::open(nic)?;
        Ok(())
    }

    fn close(&mut self) {
        self.close_ep();
        self.fd = None;
        if !self.cq.is_null() {
            // SAFETY: live CQ, no endpoint bound any more.
            unsafe { fi::fi_close(std::ptr::addr_of_mut!((*self.cq).fid)) };
            self.cq = std::ptr::null_mut();
        }
    }

    fn close_ep(&mut self) {
        // SAFETY: each object is live (or NULL) and owned by us; the endpoint closes
        // before the AV it is bound to.
        unsafe {
            if !self.ep.is_null() {
                fi::fi_close(std::ptr::addr_of_mut!((*self.ep).fid));
                self.ep = std::ptr::null_mut();
            }
            if !self.av.is_null() {
                fi::fi_close(std::ptr::addr_of_mut!((*self.av).fid));
                self.av = std::ptr::null_mut();
            }
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.close();
    }
}

/// A memory registration in one domain; closed on drop.
pub(super) struct Mr {
    mr: *mut fi::fid_mr,
    pub key: u64,
    pub desc: *mut c_void,
    _nic: Arc<Nic>,
}

// SAFETY: an MR of a FI_THREAD_SAFE domain; only closed once, by its owner.
unsafe impl Send for Mr {}
// SAFETY: shared access only reads `key`/`desc`.
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: live MR owned by us; the Arc keeps its domain open.
        unsafe { fi::fi_close(std::ptr::addr_of_mut!((*self.mr).fid)) };
    }
}

/// Where a buffer lives, for `FI_MR_HMEM` registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Device {
    pub iface: c_int,
    pub id: u64,
}

impl Device {
    /// `cuda:1` → CUDA device 1; host locations (`cpu:0`, `*`, ...) → None; device
    /// memory libfabric has no interface for (`npu:0`) → an error.
    pub fn of_location(location: &str) -> Result<Option<Device>> {
        let Some((kind, id)) = location.split_once(':') else {
            return Ok(None);
        };
        let iface = match kind.to_ascii_lowercase().as_str() {
            "cuda" => fi::FI_HMEM_CUDA,
            "hip" | "rocm" | "rocr" => fi::FI_HMEM_ROCR,
            "ze" => fi::FI_HMEM_ZE,
            "neuron" => fi::FI_HMEM_NEURON,
            "synapseai" | "hpu" => fi::FI_HMEM_SYNAPSEAI,
            "npu" | "ascend" => {
                return Err(Error::new(
                    Code::NotSupported,
                    format!(
                        "libfabric cannot register {location} memory (no FI_HMEM interface for it)"
                    ),
                ))
            }
            _ => return Ok(None),
        };
        let id = id
            .trim()
            .parse()
            .map_err(|_| Error::invalid(format!("bad device location {location:?}")))?;
        Ok(Some(Device { iface, id }))
    }
}

struct Progress {
    stop: Arc<AtomicBool>,
    wake: Arc<EventFd>,
    thread: JoinHandle<()>,
}

/// One opened domain.
pub(super) struct Nic {
    pub lib: Arc<FabricLib>,
    info: *mut fi::fi_info,
    fabric: *mut fi::fid_fabric,
    domain: *mut fi::fid_domain,
    /// `provider/domain`, as published in the descriptor's `devices`.
    pub name: String,
    pub provider: String,
    pub mr_mode: c_int,
    /// The domain was opened with FI_HMEM: device memory can be registered.
    pub hmem: bool,
    /// Largest single RMA operation.
    pub max_msg: u64,
    /// Operations the transmit queue is sized for (`tx_attr->size`; 0: not said).
    /// `sockets` accepts posts past it and then loses some of them.
    pub tx_depth: usize,
    /// The provider accepted FI_DELIVERY_COMPLETE for this domain.
    delivery_complete: bool,
    /// A software provider: its progress runs on host CPUs (the kernel's TCP stack, a
    /// peer process on this host), which waiting on its CQ must leave to it.
    pub software: bool,
    /// Data progress is manual: transfers advance only inside our calls (CQ reads).
    pub manual: bool,
    av_type: c_int,
    /// The serving endpoint's address (hex in the descriptor's `gid`).
    pub address: Vec<u8>,
    serving: Option<Endpoint>,
    /// Count RMA at the serving endpoint, for providers whose CQ has no descriptor to
    /// sleep on: how the progress thread notices traffic.
    counters: Option<Counters>,
    progress: Mutex<Option<Progress>>,
}

// SAFETY: all objects belong to a domain opened with FI_THREAD_SAFE; the pointers are
// only closed in Drop, when no other reference remains.
unsafe impl Send for Nic {}
// SAFETY: `&Nic` only makes libfabric calls on objects of its FI_THREAD_SAFE domain (safe from any
// thread at once) and reads `info`, which nothing mutates after open; `progress` is behind a Mutex.
unsafe impl Sync for Nic {}

impl Nic {
    /// Opens fabric, domain and serving endpoint for `info` (which the Nic takes over
    /// and frees), and starts the progress thread for manual-progress providers.
    ///
    /// # Safety
    /// `info` is a single `fi_info` from `fi_dupinfo`, not owned by anyone else.
    pub unsafe fn open(lib: Arc<FabricLib>, info: *mut fi::fi_info) -> Result<Arc<Nic>> {
        // SAFETY: the caller guarantees `info` is a live single fi_info from fi_dupinfo (a deep
        // copy of a getinfo entry), so its attribute pointers are valid or NULL, as `summarize`
        // requires.
        let s = unsafe { fi::summarize(info) };
        // SAFETY: attribute pointers of a getinfo answer are valid.
        let (max_msg, av_type, tx_flags, tx_depth) = unsafe {
            let ep = (*info).ep_attr;
            let tx = (*info).tx_attr;
            let da = (*info).domain_attr;
            let max = if ep.is_null() {
                u64::MAX
            } else {
                (*ep).max_msg_size as u64
            };
            let av = if da.is_null() || (*da).av_type == fi::FI_AV_UNSPEC {
                fi::FI_AV_TABLE
            } else {
                (*da).av_type
            };
            let (flags, depth) = if tx.is_null() {
                (0, 0)
            } else {
                ((*tx).op_flags, (*tx).size)
            };
            (max, av, flags, depth)
        };
        let mut nic = Nic {
            lib,
            info,
            fabric: std::ptr::null_mut(),
            domain: std::ptr::null_mut(),
            name: format!("{}/{}", s.provider, s.domain),
            software: is_software(&s.provider),
            manual: s.data_progress != fi::FI_PROGRESS_AUTO,
            provider: s.provider,
            mr_mode: s.mr_mode,
            hmem: s.caps & fi::FI_HMEM != 0,
            max_msg: max_msg.max(4096),
            tx_depth,
            delivery_complete: tx_flags & fi::FI_DELIVERY_COMPLETE != 0,
            av_type,
            address: Vec::new(),
            serving: None,
            counters: None,
            progress: Mutex::new(None),
        };
        let mut fabric = std::ptr::null_mut();
        // SAFETY: the fabric attributes come from the getinfo answer.
        let rc =
            unsafe { (nic.lib.fabric)((*info).fabric_attr, &mut fabric, std::ptr::null_mut()) };
        nic.fabric = fabric;
        nic.check("fi_fabric", rc)?;
        let mut domain = std::ptr::null_mut();
        // SAFETY: live fabric and its info.
        let rc = unsafe { fi::fi_domain(nic.fabric, info, &mut domain) };
        nic.domain = domain;
        nic.check("fi_domain", rc)?;
        let manual = s.data_progress != fi::FI_PROGRESS_AUTO;
        let mut serving = Endpoint::open(&nic)?;
        if manual && serving.fd.is_none() && s.caps & fi::FI_RMA_EVENT != 0 {
            // No descriptor to sleep on: the progress thread polls, and counters of
            // incoming RMA tell it how often.
            drop(serving);
            let mut c = Counters {
                writes: std::ptr::null_mut(),
                reads: std::ptr::null_mut(),
            };
            // SAFETY: live domain and out-pointers; Drop closes what was opened.
            let rc = unsafe { fi::fi_cntr_open(nic.domain, &mut c.writes) };
            nic.counters = Some(c);
            nic.check("fi_cntr_open", rc)?;
            // SAFETY: `nic.domain` is live (fi_domain succeeded above) and `c.reads` is a writable
            // local out-slot; as with `writes`, Drop closes whatever was opened.
            let rc = unsafe { fi::fi_cntr_open(nic.domain, &mut c.reads) };
            nic.counters = Some(c);
            nic.check("fi_cntr_open", rc)?;
            serving = Endpoint::open_counted(&nic, nic.counters)?;
        }
        nic.address = serving.name(&nic)?;
        let fd = serving.fd;
        let cq = SendPtr(serving.cq);
        let counters = nic.counters;
        nic.serving = Some(serving);
        if manual {
            let stop = Arc::new(AtomicBool::new(false));
            let wake = Arc::new(EventFd::new().map_err(|e| Error::io("creating an eventfd", e))?);
            let fabric = SendPtr(nic.fabric);
            let (stop2, wake2) = (stop.clone(), wake.clone());
            let thread = std::thread::Builder::new()
                .name("mc-fabric-progress".into())
                .spawn(move || match fd {
                    Some(fd) => serve_waiting(fabric, cq, fd, &stop2, &wake2),
                    None => serve_polling(cq, counters, &stop2, &wake2),
                })
                .map_err(|e| Error::io("spawning the fabric progress thread", e))?;
            *nic.progress.locked() = Some(Progress { stop, wake, thread });
        }
        Ok(Arc::new(nic))
    }

    fn error(&self, what: &str, why: impl std::fmt::Display) -> Error {
        Error::new(
            Code::BackendUnavailable,
            format!(
                "libfabric {} ({}): {what}: {why}",
                self.name, self.lib.library
            ),
        )
    }

    pub fn check(&self, what: &str, rc: c_int) -> Result<()> {
        if rc == 0 {
            Ok(())
        } else {
            Err(self.error(what, self.lib.strerror(rc as i64)))
        }
    }

    /// Local buffers must be registered for the provider to use them.
    pub fn needs_local_mr(&self) -> bool {
        self.mr_mode & fi::FI_MR_LOCAL != 0
    }

    /// Flags for `fi_writemsg`: the completion must mean the bytes are in the target's
    /// memory (a peer told about the write reads them next), where the provider can.
    pub fn write_flags(&self) -> u64 {
        if self.delivery_complete {
            fi::FI_COMPLETION | fi::FI_DELIVERY_COMPLETE
        } else {
            fi::FI_COMPLETION
        }
    }

    /// Opens a CQ of `CQ_ENTRIES` entries (or, where the provider refuses that size,
    /// of its default size, assumed to be at least `CQ_ENTRIES_DEFAULT`), with a wait
    /// descriptor if the provider offers one; returns it with the entries it holds.
    fn open_cq(&self) -> Result<(*mut fi::fid_cq, usize)> {
        let mut last = 0;
        for (size, entries) in [(CQ_ENTRIES, CQ_ENTRIES), (0, CQ_ENTRIES_DEFAULT)] {
            for wait in [fi::FI_WAIT_FD, fi::FI_WAIT_NONE] {
                let mut attr = fi::fi_cq_attr {
                    size,
                    flags: 0,
                    format: fi::FI_CQ_FORMAT_CONTEXT,
                    wait_obj: wait,
                    signaling_vector: 0,
                    wait_cond: fi::FI_CQ_COND_NONE,
                    wait_set: std::ptr::null_mut(),
                };
                let mut cq = std::ptr::null_mut();
                // SAFETY: live domain, valid attr and out-pointer.
                last = unsafe { fi::fi_cq_open(self.domain, &mut attr, &mut cq) };
                if last == 0 {
                    return Ok((cq, entries));
                }
            }
        }
        Err(self.error("fi_cq_open", self.lib.strerror(last as i64)))
    }

    /// Registers `[addr, addr+len)` for `access`; `key` is used unless the provider
    /// picks keys itself.
    pub fn register(
        self: &Arc<Nic>,
        addr: u64,
        len: u64,
        access: u64,
        key: u64,
        device: Option<Device>,
    ) -> Result<Mr> {
        let mut mr: *mut fi::fid_mr = std::ptr::null_mut();
        let rc = match device {
            None => {
                // SAFETY: live domain; the caller keeps the memory mapped while the MR
                // lives (registered buffers stay valid until unregistered).
                unsafe {
                    fi::fi_mr_reg(
                        self.domain,
                        addr as *const c_void,
                        len as usize,
                        access,
                        key,
                        &mut mr,
                    )
                }
            }
            Some(_) if !self.hmem => {
                return Err(Error::new(
                    Code::NotSupported,
                    format!(
                        "provider {} was opened without FI_HMEM and cannot register device \
                         memory (set MC_FABRIC_HMEM=1 to ask for it)",
                        self.provider
                    ),
                ))
            }
            Some(d) => {
                let iov = libc::iovec {
                    iov_base: addr as *mut c_void,
                    iov_len: len as usize,
                };
                let attr = fi::fi_mr_attr {
                    mr_iov: &iov,
                    iov_count: 1,
                    access,
                    offset: 0,
                    requested_key: key,
                    context: std::ptr::null_mut(),
                    auth_key_size: 0,
                    auth_key: std::ptr::null_mut(),
                    iface: d.iface,
                    device: d.id,
                };
                // SAFETY: live domain; `attr` and `iov` outlive the call.
                unsafe { fi::fi_mr_regattr(self.domain, &attr, &mut mr) }
            }
        };
        if rc != 0 || mr.is_null() {
            let call = if device.is_some() {
                "fi_mr_regattr"
            } else {
                "fi_mr_reg"
            };
            return Err(
                Error::backend(self.lib.error(call, rc)).prefixed(format_args!(
                    "registering {len} bytes at {addr:#x} on {}",
                    self.name
                )),
            );
        }
        // SAFETY: a freshly registered MR.
        let (key, desc) = unsafe { ((*mr).key, (*mr).mem_desc) };
        Ok(Mr {
            mr,
            key,
            desc,
            _nic: self.clone(),
        })
    }

    /// `fi_trywait` on a CQ of this fabric: 0 when its wait descriptor may be waited on.
    pub fn trywait(&self, cq: *mut fi::fid_cq) -> c_int {
        // SAFETY: live fabric; `cq` is a live CQ of one of its domains.
        unsafe { fi::fi_trywait(self.fabric, std::ptr::addr_of_mut!((*cq).fid)) }
    }
}

impl Drop for Nic {
    fn drop(&mut self) {
        if let Some(p) = self
            .progress
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            p.stop.store(true, Ordering::SeqCst);
            p.wake.notify();
            let _ = p.thread.join();
        }
        drop(self.serving.take());
        // SAFETY: every endpoint and MR of the domain holds an Arc to this Nic, so none
        // is left; the objects are closed child-first, then the info freed.
        unsafe {
            if let Some(c) = self.counters {
                for cntr in [c.writes, c.reads] {
                    if !cntr.is_null() {
                        fi::fi_close(std::ptr::addr_of_mut!((*cntr).fid));
                    }
                }
            }
            if !self.domain.is_null() {
                fi::fi_close(std::ptr::addr_of_mut!((*self.domain).fid));
            }
            if !self.fabric.is_null() {
                fi::fi_close(std::ptr::addr_of_mut!((*self.fabric).fid));
            }
            (self.lib.freeinfo)(self.info);
        }
    }
}

/// Whether `provider` (`tcp;ofi_rxm`, `shm`, ...) is carried out by host software
/// rather than a NIC.
fn is_software(provider: &str) -> bool {
    provider
        .split(';')
        .next()
        .is_some_and(|core| matches!(core, "tcp" | "sockets" | "shm" | "udp" | "net"))
}

/// Reads the serving CQ dry; incoming RMA is carried out inside these reads.
fn drain(cq: *mut fi::fid_cq) {
    let mut entries = [fi::fi_cq_entry {
        op_context: std::ptr::null_mut(),
    }; 16];
    loop {
        // SAFETY: the CQ stays open until the progress thread is joined.
        let n = unsafe { fi::fi_cq_read(cq, &mut entries) };
        if n == -(fi::FI_EAVAIL as isize) {
            // SAFETY: zeroed entry is a valid out-buffer; live CQ.
            let mut err: fi::fi_cq_err_entry = unsafe { std::mem::zeroed() };
            // SAFETY: `cq` is still open (the progress thread is joined before it is closed) and
            // `err` is a zeroed, writable fi_cq_err_entry for the provider to fill.
            unsafe { fi::fi_cq_readerr(cq, &mut err) };
            log::debug!("fabric serving endpoint: error entry {}", err.err);
        } else if n <= 0 {
            return;
        }
    }
}

/// Drives the serving endpoint of a manual-progress provider whose CQ has a wait
/// descriptor: incoming RMA is only carried out while someone reads the target's CQ,
/// so this thread reads it whenever the descriptor turns readable and otherwise sleeps
/// on it. It never spins: with a peer on this host, a spinning target takes the core
/// the initiator needs (measured on two cores: a 50 µs spin after each request made
/// 4 KiB reads about four times slower).
fn serve_waiting(
    fabric: SendPtr<fi::fid_fabric>,
    cq: SendPtr<fi::fid_cq>,
    fd: RawFd,
    stop: &AtomicBool,
    wake: &EventFd,
) {
    let (fabric, cq) = (fabric.0, cq.0);
    let mut last_active: Option<Instant> = None;
    while !stop.load(Ordering::SeqCst) {
        drain(cq);
        // SAFETY: live fabric and CQ.
        if unsafe { fi::fi_trywait(fabric, std::ptr::addr_of_mut!((*cq).fid)) } != 0 {
            last_active = Some(Instant::now());
            continue;
        }
        // While RMA arrives, look again within a millisecond even if the descriptor
        // stays quiet: progress a provider leaves pending without signalling it (a
        // reply waiting for socket space) must not wait for the idle timeout.
        let timeout = match last_active {
            Some(t) if t.elapsed() < WARM => WAITING_WARM_TIMEOUT,
            _ => WAITING_IDLE_TIMEOUT,
        };
        let started = Instant::now();
        let _ = wake.wait(Some(fd), Some(timeout));
        if started.elapsed() < timeout {
            last_active = Some(Instant::now());
        }
    }
}

/// `serve_waiting`'s longest sleep while RMA has arrived within `WARM`, and otherwise.
const WAITING_WARM_TIMEOUT: Duration = Duration::from_millis(1);
const WAITING_IDLE_TIMEOUT: Duration = Duration::from_millis(100);

/// The polling progress thread's interval while WRITEs arrive, and for how long after
/// the last one. Shorter intervals backfired on two cores: below ~10 µs the timer
/// wake-ups crowded out the initiator's threads and 4 KiB writes took 150 µs.
const HOT_INTERVAL: Duration = Duration::from_micros(10);
const HOT: Duration = Duration::from_millis(2);
/// Then this interval (the only one without counters)...
const WARM_INTERVAL: Duration = Duration::from_micros(100);
/// ...until RMA has been gone this long; then the idle one.
const WARM: Duration = Duration::from_millis(100);
const IDLE_INTERVAL: Duration = Duration::from_millis(1);

/// Drives the serving endpoint of a manual-progress provider without a wait descriptor
/// (`shm`): reads the CQ on a timer, sleeping in between, never spinning (see
/// `serve_waiting`). While WRITEs arrive the timer is short, so a peer's
/// delivery-complete WRITE waits ~10 µs rather than a 100 µs tick. READs keep it at
/// the 100 µs tick only: where `shm` copies across processes itself they need no
/// target, and a busier target slowed them (4 KiB: 1.0 GB/s, 0.35 at the short tick);
/// where it cannot, they wait as long as before. Idle, it backs off to a millisecond.
fn serve_polling(
    cq: SendPtr<fi::fid_cq>,
    counters: Option<Counters>,
    stop: &AtomicBool,
    wake: &EventFd,
) {
    let cq = cq.0;
    // Keep the kernel from stretching the short sleeps by its default 50 µs slack.
    // SAFETY: prctl with integer arguments, affecting this thread only.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000, 0, 0, 0) };
    let (mut writes, mut reads) = (0u64, 0u64);
    let (mut last_write, mut last_any) = (Instant::now(), Instant::now());
    while !stop.load(Ordering::SeqCst) {
        drain(cq);
        let interval = match counters {
            None => WARM_INTERVAL,
            Some(c) => {
                let now = Instant::now();
                // SAFETY: the counters stay open until this thread is joined.
                let (w, r) = unsafe { (fi::fi_cntr_read(c.writes), fi::fi_cntr_read(c.reads)) };
                if w != writes {
                    last_write = now;
                }
                if (w, r) != (writes, reads) {
                    last_any = now;
                }
                (writes, reads) = (w, r);
                if now - last_write < HOT {
                    HOT_INTERVAL
                } else if now - last_any < WARM {
                    WARM_INTERVAL
                } else {
                    IDLE_INTERVAL
                }
            }
        };
        // The eventfd wakes us for shutdown.
        let _ = wake.wait(None, Some(interval));
    }
}
