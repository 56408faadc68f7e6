//! `mc_pg_*`: Mooncake PG collectives ([`crate::collective`]) for C callers.

use std::borrow::Cow;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

use super::args::{answer_text, array, bytes, bytes_mut, c_str, copy_out, non_null};
use super::process_bound::ProcessBound;
use super::{guard, init_logging, MC_OK};
use crate::collective::{DType, Group, GroupOptions, ReduceOp};
use crate::device::{self, MemoryKind};
use crate::error::{Error, Result};

/// `mc_pg`: one rank of a collective group behind an opaque pointer.
pub struct McPg {
    group: ProcessBound<Group>,
    /// Where the buffers passed to this handle live ([`encode_memory`]); 0 is host
    /// memory, so the host path costs one relaxed load.
    memory: AtomicU64,
    /// The device runtimes this handle's memory was ever set to ([`HostPath`]).
    runtimes_set: AtomicU8,
}

/// `runtimes_set` bits: runtimes whose pointer query can tell device memory apart.
const CUDA_SET: u8 = 1;
const HIP_SET: u8 = 2;
/// Ascend: checked only where ACL has a pointer query (CANN 7+).
const NPU_SET: u8 = 4;

/// The host path of a handle that has had a CUDA, HIP or Ascend location: the setting is shared
/// by every thread, so another thread's `mc_pg_set_memory` may have switched it back to
/// host memory between a caller's own setting and its call. A buffer the driver calls
/// device memory is refused then, before the CPU touches it. A handle never set to such
/// a device makes no driver call here.
struct HostPath {
    runtimes: u8,
}

impl HostPath {
    fn refuse_device_memory(&self, p: *const c_void, len: usize, what: &str) -> Result<()> {
        if self.runtimes == 0 || len == 0 || p.is_null() {
            return Ok(());
        }
        let (cuda, hip) = (self.runtimes & CUDA_SET != 0, self.runtimes & HIP_SET != 0);
        let device = match device::device_memory_at(p as u64, len as u64, cuda, hip)? {
            None if self.runtimes & NPU_SET != 0 => device::npu_memory_at(p as u64, len as u64)?,
            found => found,
        };
        match device {
            Some(kind) => Err(Error::invalid(format!(
                "{what} is {} memory, but this handle's memory is host memory now \
                 (mc_pg_set_memory is the handle's, shared by every thread)",
                kind.location()
            ))),
            None => Ok(()),
        }
    }
}

/// `MemoryKind` as one word: 0 for host, else the runtime (1 CUDA, 2 HIP, 3 NPU) in the
/// high half and the device number in the low half.
fn encode_memory(kind: MemoryKind) -> u64 {
    let (family, n) = match kind {
        MemoryKind::Host => return 0,
        MemoryKind::Cuda(n) => (1u64, n),
        MemoryKind::Hip(n) => (2, n),
        MemoryKind::Npu(n) => (3, n),
    };
    family << 32 | u64::from(n as u32)
}

fn decode_memory(word: u64) -> Option<MemoryKind> {
    let n = (word & 0xffff_ffff) as u32 as i32;
    match word >> 32 {
        1 => Some(MemoryKind::Cuda(n)),
        2 => Some(MemoryKind::Hip(n)),
        3 => Some(MemoryKind::Npu(n)),
        _ => None,
    }
}

/// The group behind a handle, the device its buffers are on (`None`: host memory), and
/// the host path's check of them.
///
/// # Safety
/// As [`group`].
unsafe fn group_and_memory<'a>(pg: *mut McPg) -> Result<(&'a Group, Option<MemoryKind>, HostPath)> {
    non_null(pg, "pg")?;
    // SAFETY: non-null, and the caller guarantees it came from mc_pg_new and is live;
    // only shared access is made.
    let h = unsafe { &*pg };
    let group = h.group.get("process group")?;
    // The setting first (Acquire): its store follows the runtime's bit (`mc_pg_set_memory`),
    // so a call that sees a device setting gone also sees that runtime's bit.
    let memory = decode_memory(h.memory.load(Ordering::Acquire));
    let host = HostPath {
        runtimes: h.runtimes_set.load(Ordering::Acquire),
    };
    Ok((group, memory, host))
}

/// `mc_pg_message`: one point-to-point send or receive.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct McPgMessage {
    /// The peer rank.
    pub peer: i32,
    /// What to send, or where to receive.
    pub buf: *mut c_void,
    /// Bytes.
    pub len: usize,
}

/// Borrows the group behind a handle.
///
/// # Safety
/// `pg` must be NULL or a live pointer from `mc_pg_new`, not freed during `'a`.
unsafe fn group<'a>(pg: *mut McPg) -> Result<&'a Group> {
    non_null(pg, "pg")?;
    // SAFETY: non-null, and the caller guarantees it came from mc_pg_new and is live;
    // only shared access is made (Group locks internally).
    unsafe { &(*pg).group }.get("process group")
}

/// `len` bytes at `p` that an operation reads while it writes `out_len` bytes at
/// `out`: borrowed when the two ranges are apart, else copied first (torch's in-place
/// forms pass an output that is a block of the input, or the reverse; a shared and a
/// mutable slice over the same bytes may not exist at once).
///
/// # Safety
/// As `bytes` for `p`; `out` is only compared, never accessed here.
unsafe fn input_apart<'a>(
    p: *const c_void,
    len: usize,
    out: *const c_void,
    out_len: usize,
    what: &str,
) -> Result<Cow<'a, [u8]>> {
    // SAFETY: the caller's guarantee for `p`.
    let input = unsafe { bytes(p, len, what) }?;
    let (start, end) = (p as usize, (p as usize).saturating_add(len));
    let (out_start, out_end) = (out as usize, (out as usize).saturating_add(out_len));
    let overlap = len > 0 && out_len > 0 && start < out_end && out_start < end;
    Ok(if overlap {
        Cow::Owned(input.to_vec())
    } else {
        Cow::Borrowed(input)
    })
}

fn total(s: &[usize], scale: usize) -> Result<usize> {
    s.iter()
        .try_fold(0usize, |a, &x| a.checked_add(x.checked_mul(scale)?))
        .ok_or_else(|| Error::invalid("sizes overflow"))
}

fn rank_arg(r: c_int) -> Result<usize> {
    usize::try_from(r).map_err(|_| Error::invalid(format!("rank {r}")))
}

fn elements(count: usize, dtype: DType) -> Result<usize> {
    count
        .checked_mul(dtype.size())
        .ok_or_else(|| Error::invalid("count overflows"))
}

/// Starts rank `rank` of `world_size` with `options` ("key=value;..." or NULL; see
/// mooncake.h) and stores it in `*out` (NULL on error).
///
/// # Safety
/// `options` NULL or a NUL-terminated string; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_new(
    rank: c_int,
    world_size: c_int,
    options: *const c_char,
    out: *mut *mut McPg,
) -> c_int {
    guard("mc_pg_new", || {
        init_logging();
        non_null(out, "out")?;
        // SAFETY: non-null and writable (caller's guarantee).
        unsafe { *out = std::ptr::null_mut() };
        let mut o = GroupOptions::new(rank_arg(rank)?, rank_arg(world_size)?);
        if !options.is_null() {
            // SAFETY: a NUL-terminated string (caller's guarantee).
            let text = unsafe { c_str(options, "options") }?;
            for item in text.split(';').map(str::trim).filter(|s| !s.is_empty()) {
                let (k, v) = item
                    .split_once('=')
                    .ok_or_else(|| Error::invalid(format!("option {item:?} is not key=value")))?;
                o.set(k.trim(), v.trim())?;
            }
        }
        let group = Group::new(o)?;
        let (memory, runtimes_set) = (AtomicU64::new(0), AtomicU8::new(0));
        let handle = McPg {
            group: ProcessBound::new(group),
            memory,
            runtimes_set,
        };
        // SAFETY: as above.
        unsafe { *out = Box::into_raw(Box::new(handle)) };
        Ok(MC_OK)
    })
}

/// Stops the rank and frees the handle; NULL is ignored.
///
/// # Safety
/// `pg` NULL or from `mc_pg_new`, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_free(pg: *mut McPg) {
    super::guard_value("mc_pg_free", (), || {
        if !pg.is_null() {
            // SAFETY: from Box::into_raw in mc_pg_new, freed once (caller's guarantee).
            drop(unsafe { Box::from_raw(pg) });
        }
    })
}

/// Copies this rank's rendezvous address into `buf` (NUL-terminated).
///
/// # Safety
/// `buf` writable for `len` bytes; `needed_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_address(
    pg: *mut McPg,
    buf: *mut c_char,
    len: usize,
    needed_out: *mut usize,
) -> c_int {
    guard("mc_pg_address", || {
        // SAFETY: caller's guarantees, passed on.
        let g = unsafe { group(pg) }?;
        // SAFETY: as above.
        unsafe { answer_text(&g.address(), buf, len, needed_out, "address") }
    })
}

/// Reaches the peers: `addresses[r]` is rank r's address, "" or NULL when not running.
///
/// # Safety
/// `addresses` readable for `count` pointers, each NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_connect(
    pg: *mut McPg,
    addresses: *const *const c_char,
    count: usize,
) -> c_int {
    guard("mc_pg_connect", || {
        // SAFETY: caller's guarantee.
        let g = unsafe { group(pg) }?;
        non_null(addresses, "addresses")?;
        let mut list = Vec::with_capacity(count);
        for i in 0..count {
            // SAFETY: `addresses` holds `count` pointers (caller's guarantee).
            let p = unsafe { *addresses.add(i) };
            list.push(if p.is_null() {
                String::new()
            } else {
                // SAFETY: a NUL-terminated string (caller's guarantee).
                unsafe { c_str(p, "address") }?.to_owned()
            });
        }
        g.connect(&list)?;
        Ok(MC_OK)
    })
}

/// Claims this rank and waits up to `timeout_ms` until a member activates it.
///
/// # Safety
/// `pg` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_join(pg: *mut McPg, timeout_ms: u32) -> c_int {
    guard("mc_pg_join", || {
        // SAFETY: caller's guarantee.
        unsafe { group(pg) }?.join(Duration::from_millis(timeout_ms.into()))?;
        Ok(MC_OK)
    })
}

/// A buffer location for `mc_pg_set_memory`: `cpu[:N]` or a device location. Unlike
/// registration, which takes any other name as host memory, an unknown name is refused
/// (a typo would otherwise hand device pointers to the host path).
fn memory_location(location: &str) -> Result<MemoryKind> {
    let bad = || {
        Error::invalid(format!(
            "location {location:?}: expected cpu:0, cuda:N, hip:N or npu:N"
        ))
    };
    let (family, ordinal) = location.split_once(':').unwrap_or((location, "0"));
    match family {
        "cpu" if ordinal.parse::<u32>().is_ok() => Ok(MemoryKind::Host),
        "cuda" | "hip" | "npu" => MemoryKind::parse_location(location),
        _ => Err(bad()),
    }
}

/// Sets where the buffers passed to this handle's operations live from now on:
/// `location` as the engine's registration takes it ("cpu:0" or NULL for host memory,
/// "cuda:N", "hip:N", "npu:N"). A device location is checked now (its runtime loads and
/// device N exists); a bad one is refused and the setting is left as it was.
///
/// # Safety
/// `pg` NULL or live; `location` NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_set_memory(pg: *mut McPg, location: *const c_char) -> c_int {
    guard("mc_pg_set_memory", || {
        // SAFETY: `pg` NULL or live (caller's guarantee); borrowed only to check it.
        unsafe { group(pg) }?;
        let kind = if location.is_null() {
            MemoryKind::Host
        } else {
            // SAFETY: a NUL-terminated string (caller's guarantee).
            memory_location(unsafe { c_str(location, "location") }?)?
        };
        device::check_available(kind)
            .map_err(|e| Error::invalid(format!("location {}: {e}", kind.location())))?;
        // SAFETY: non-null and live (caller's guarantee); shared access only.
        let h = unsafe { &*pg };
        let runtime = match kind {
            MemoryKind::Cuda(_) => CUDA_SET,
            MemoryKind::Hip(_) => HIP_SET,
            MemoryKind::Npu(_) => NPU_SET,
            MemoryKind::Host => 0,
        };
        // Before the setting: a host call that sees a device setting gone sees this too.
        h.runtimes_set.fetch_or(runtime, Ordering::SeqCst);
        h.memory.store(encode_memory(kind), Ordering::SeqCst);
        Ok(MC_OK)
    })
}

/// All-reduce of `count` elements in place.
///
/// # Safety
/// `buf` readable and writable for `count` elements of `dtype`.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_all_reduce(
    pg: *mut McPg,
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
) -> c_int {
    guard("mc_pg_all_reduce", || {
        // SAFETY: caller's guarantee.
        let (g, memory, host) = unsafe { group_and_memory(pg) }?;
        let (dt, op) = (DType::from_raw(dtype)?, ReduceOp::from_raw(op)?);
        let len = elements(count, dt)?;
        if let Some(kind) = memory {
            // SAFETY: `len` bytes of that device's memory (caller's guarantee).
            unsafe { g.all_reduce_device(kind, buf as u64, len, dt, op) }?;
            return Ok(MC_OK);
        }
        host.refuse_device_memory(buf, len, "buf")?;
        // SAFETY: as above.
        let b = unsafe { bytes_mut(buf, len, "buf") }?;
        g.all_reduce(b, dt, op)?;
        Ok(MC_OK)
    })
}

/// Reduce of `count` elements into `root`'s `buf`.
///
/// # Safety
/// As `mc_pg_all_reduce`.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_reduce(
    pg: *mut McPg,
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
) -> c_int {
    guard("mc_pg_reduce", || {
        // SAFETY: caller's guarantee.
        let (g, memory, host) = unsafe { group_and_memory(pg) }?;
        let (dt, op) = (DType::from_raw(dtype)?, ReduceOp::from_raw(op)?);
        let len = elements(count, dt)?;
        if let Some(kind) = memory {
            // SAFETY: `len` bytes of that device's memory (caller's guarantee).
            unsafe { g.reduce_device(kind, buf as u64, len, dt, op, rank_arg(root)?) }?;
            return Ok(MC_OK);
        }
        host.refuse_device_memory(buf, len, "buf")?;
        // SAFETY: as above.
        let b = unsafe { bytes_mut(buf, len, "buf") }?;
        g.reduce(b, dt, op, rank_arg(root)?)?;
        Ok(MC_OK)
    })
}

/// Broadcast of `len` bytes from `root`.
///
/// # Safety
/// `buf` readable and writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_broadcast(
    pg: *mut McPg,
    buf: *mut c_void,
    len: usize,
    root: c_int,
) -> c_int {
    guard("mc_pg_broadcast", || {
        // SAFETY: caller's guarantee.
        let (g, memory, host) = unsafe { group_and_memory(pg) }?;
        if let Some(kind) = memory {
            // SAFETY: `len` bytes of that device's memory (caller's guarantee).
            unsafe { g.broadcast_device(kind, buf as u64, len, rank_arg(root)?) }?;
            return Ok(MC_OK);
        }
        host.refuse_device_memory(buf, len, "buf")?;
        // SAFETY: as above.
        let b = unsafe { bytes_mut(buf, len, "buf") }?;
        g.broadcast(b, rank_arg(root)?)?;
        Ok(MC_OK)
    })
}

/// All-gather: `sizes[r]` bytes from each rank r, concatenated in rank order.
///
/// # Safety
/// `sizes` holds world_size entries; `input` readable for `sizes[rank]` bytes, `output`
/// writable for their sum.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_all_gather(
    pg: *mut McPg,
    input: *const c_void,
    output: *mut c_void,
    sizes: *const usize,
) -> c_int {
    guard("mc_pg_all_gather", || {
        // SAFETY: caller's guarantees, for each borrow below.
        let (g, memory, host) = unsafe { group_and_memory(pg) }?;
        // SAFETY: as above.
        let s = unsafe { self::array(sizes, g.size(), "sizes") }?;
        if let Some(kind) = memory {
            // SAFETY: both ranges that device's memory (caller's guarantee).
            unsafe { g.all_gather_device(kind, input as u64, output as u64, s) }?;
            return Ok(MC_OK);
        }
        // SAFETY: as above.
        let out_len = total(s, 1)?;
        host.refuse_device_memory(input, s[g.rank()], "input")?;
        host.refuse_device_memory(output, out_len, "output")?;
        // SAFETY: as above.
        let i = unsafe { input_apart(input, s[g.rank()], output, out_len, "input") }?;
        // SAFETY: as above; `i` is apart from it (or a copy).
        let o = unsafe { bytes_mut(output, out_len, "output") }?;
        g.all_gather(&i, o, s)?;
        Ok(MC_OK)
    })
}

/// Reduce-scatter: `counts[r]` elements per rank block; this rank's reduced block into
/// `output`.
///
/// # Safety
/// `counts` holds world_size entries; `input` readable for their sum, `output` writable
/// for `counts[rank]` elements.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_reduce_scatter(
    pg: *mut McPg,
    input: *const c_void,
    output: *mut c_void,
    counts: *const usize,
    dtype: c_int,
    op: c_int,
) -> c_int {
    guard("mc_pg_reduce_scatter", || {
        // SAFETY: caller's guarantees, for each borrow below.
        let (g, memory, host) = unsafe { group_and_memory(pg) }?;
        let (dt, op) = (DType::from_raw(dtype)?, ReduceOp::from_raw(op)?);
        // SAFETY: as above.
        let c = unsafe { self::array(counts, g.size(), "counts") }?;
        if let Some(kind) = memory {
            // SAFETY: both ranges that device's memory (caller's guarantee).
            unsafe { g.reduce_scatter_device(kind, input as u64, output as u64, c, dt, op) }?;
            return Ok(MC_OK);
        }
        // SAFETY: as above.
        let out_len = elements(c[g.rank()], dt)?;
        host.refuse_device_memory(input, total(c, dt.size())?, "input")?;
        host.refuse_device_memory(output, out_len, "output")?;
        // SAFETY: as above.
        let i = unsafe { input_apart(input, total(c, dt.size())?, output, out_len, "input") }?;
        // SAFETY: as above; `i` is apart from it (or a copy).
        let o = unsafe { bytes_mut(output, out_len, "output") }?;
        g.reduce_scatter(&i, o, c, dt, op)?;
        Ok(MC_OK)
    })
}

/// All-to-all: block r of `input` (`send[r]` bytes) to rank r, block r of `output`
/// (`recv[r]` bytes) from rank r.
///
/// # Safety
/// `send`, `recv` hold world_size entries; buffers cover their sums.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_all_to_all(
    pg: *mut McPg,
    input: *const c_void,
    send: *const usize,
    output: *mut c_void,
    recv: *const usize,
) -> c_int {
    guard("mc_pg_all_to_all", || {
        // SAFETY: the caller's guarantees.
        unsafe { all_to_all(pg, input, send, output, recv, None) }
    })
}

/// `mc_pg_all_to_all` whose wait for peers is bounded by `timeout_us` (> 0) instead
/// of the group's `timeout_ms`.
///
/// # Safety
/// As `mc_pg_all_to_all`.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_all_to_all_timeout(
    pg: *mut McPg,
    input: *const c_void,
    send: *const usize,
    output: *mut c_void,
    recv: *const usize,
    timeout_us: u64,
) -> c_int {
    guard("mc_pg_all_to_all_timeout", || {
        if timeout_us == 0 {
            return Err(Error::invalid("timeout_us must be positive"));
        }
        let timeout = Duration::from_micros(timeout_us);
        // SAFETY: the caller's guarantees.
        unsafe { all_to_all(pg, input, send, output, recv, Some(timeout)) }
    })
}

/// The all-to-all of both shims above, waiting `timeout` for peers (the group's if None).
///
/// # Safety
/// As `mc_pg_all_to_all`.
unsafe fn all_to_all(
    pg: *mut McPg,
    input: *const c_void,
    send: *const usize,
    output: *mut c_void,
    recv: *const usize,
    timeout: Option<Duration>,
) -> Result<c_int> {
    // SAFETY: caller's guarantees, for each borrow below.
    let (g, memory, host) = unsafe { group_and_memory(pg) }?;
    // SAFETY: as above.
    let s = unsafe { array(send, g.size(), "send") }?;
    // SAFETY: as above.
    let r = unsafe { array(recv, g.size(), "recv") }?;
    if let Some(kind) = memory {
        let (i, o) = ((input as u64, s), (output as u64, r));
        // SAFETY: both ranges that device's memory (caller's guarantee).
        unsafe { g.all_to_all_device(kind, i, o, timeout) }?;
        return Ok(MC_OK);
    }
    let (in_len, out_len) = (total(s, 1)?, total(r, 1)?);
    host.refuse_device_memory(input, in_len, "input")?;
    host.refuse_device_memory(output, out_len, "output")?;
    // SAFETY: as above.
    let i = unsafe { input_apart(input, in_len, output, out_len, "input") }?;
    // SAFETY: as above; `i` is apart from it (or a copy).
    let o = unsafe { bytes_mut(output, out_len, "output") }?;
    g.all_to_all_within(&i, s, o, r, timeout)?;
    Ok(MC_OK)
}

/// Gather to `root` (`output`, the sum of `sizes`, only used there; may be NULL elsewhere).
///
/// # Safety
/// As `mc_pg_all_gather`.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_gather(
    pg: *mut McPg,
    input: *const c_void,
    output: *mut c_void,
    sizes: *const usize,
    root: c_int,
) -> c_int {
    guard("mc_pg_gather", || {
        // SAFETY: caller's guarantees, for each borrow below.
        let (g, memory, host) = unsafe { group_and_memory(pg) }?;
        let root = rank_arg(root)?;
        // SAFETY: as above.
        let s = unsafe { self::array(sizes, g.size(), "sizes") }?;
        if let Some(kind) = memory {
            // SAFETY: the ranges used are that device's memory (caller's guarantee).
            unsafe { g.gather_device(kind, input as u64, output as u64, s, root) }?;
            return Ok(MC_OK);
        }
        let out_len = if g.rank() == root { total(s, 1)? } else { 0 };
        host.refuse_device_memory(input, s[g.rank()], "input")?;
        host.refuse_device_memory(output, out_len, "output")?;
        // SAFETY: as above.
        let i = unsafe { input_apart(input, s[g.rank()], output, out_len, "input") }?;
        // SAFETY: as above; `i` is apart from it (or a copy).
        let o = unsafe { bytes_mut(output, out_len, "output") }?;
        g.gather(&i, o, s, root)?;
        Ok(MC_OK)
    })
}

/// Scatter from `root` (`input`, the sum of `sizes`, only read there; may be NULL elsewhere).
///
/// # Safety
/// As `mc_pg_all_gather`, with input and output swapped.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_scatter(
    pg: *mut McPg,
    input: *const c_void,
    output: *mut c_void,
    sizes: *const usize,
    root: c_int,
) -> c_int {
    guard("mc_pg_scatter", || {
        // SAFETY: caller's guarantees, for each borrow below.
        let (g, memory, host) = unsafe { group_and_memory(pg) }?;
        let root = rank_arg(root)?;
        // SAFETY: as above.
        let s = unsafe { self::array(sizes, g.size(), "sizes") }?;
        if let Some(kind) = memory {
            // SAFETY: the ranges used are that device's memory (caller's guarantee).
            unsafe { g.scatter_device(kind, input as u64, output as u64, s, root) }?;
            return Ok(MC_OK);
        }
        let in_len = if g.rank() == root { total(s, 1)? } else { 0 };
        host.refuse_device_memory(input, in_len, "input")?;
        host.refuse_device_memory(output, s[g.rank()], "output")?;
        // SAFETY: as above.
        let i = unsafe { input_apart(input, in_len, output, s[g.rank()], "input") }?;
        // SAFETY: as above; `i` is apart from it (or a copy).
        let o = unsafe { bytes_mut(output, s[g.rank()], "output") }?;
        g.scatter(&i, o, s, root)?;
        Ok(MC_OK)
    })
}

/// Waits until every active rank has entered the barrier.
///
/// # Safety
/// `pg` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_barrier(pg: *mut McPg) -> c_int {
    guard("mc_pg_barrier", || {
        // SAFETY: caller's guarantee.
        unsafe { group(pg) }?.barrier()?;
        Ok(MC_OK)
    })
}

/// Point-to-point sends and receives, done together.
///
/// # Safety
/// `sends` / `recvs` hold `nsends` / `nrecvs` entries whose buffers are valid for their
/// lengths (receive buffers writable and distinct).
#[no_mangle]
pub unsafe extern "C" fn mc_pg_send_recv(
    pg: *mut McPg,
    sends: *const McPgMessage,
    nsends: usize,
    recvs: *const McPgMessage,
    nrecvs: usize,
) -> c_int {
    guard("mc_pg_send_recv", || {
        // SAFETY: caller's guarantees, for each borrow below.
        let (g, memory, host) = unsafe { group_and_memory(pg) }?;
        // SAFETY: `n` entries at `p` (caller's guarantee).
        let list = |p: *const McPgMessage, n: usize| unsafe { array(p, n, "messages") };
        if let Some(kind) = memory {
            let ranges = |p, n| -> Result<Vec<(usize, u64, usize)>> {
                list(p, n)?
                    .iter()
                    .map(|m| Ok((rank_arg(m.peer)?, m.buf as u64, m.len)))
                    .collect()
            };
            let (out, inc) = (ranges(sends, nsends)?, ranges(recvs, nrecvs)?);
            // SAFETY: every message's buffer is that device's memory (caller's guarantee).
            unsafe { g.send_recv_device(kind, &out, &inc) }?;
            return Ok(MC_OK);
        }
        let mut out = Vec::new();
        for m in list(sends, nsends)? {
            host.refuse_device_memory(m.buf, m.len, "send buf")?;
            // SAFETY: as above.
            out.push((rank_arg(m.peer)?, unsafe {
                bytes(m.buf, m.len, "send buf")
            }?));
        }
        let mut inc = Vec::new();
        for m in list(recvs, nrecvs)? {
            host.refuse_device_memory(m.buf, m.len, "recv buf")?;
            // SAFETY: as above.
            inc.push((rank_arg(m.peer)?, unsafe {
                bytes_mut(m.buf, m.len, "recv buf")
            }?));
        }
        g.send_recv(&out, &mut inc)?;
        Ok(MC_OK)
    })
}

/// The ranks the last failed operation did not hear from: up to `cap` into `ranks`,
/// how many in `*count`.
///
/// # Safety
/// `ranks` writable for `cap` entries (NULL when 0); `count` writable.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_failed_ranks(
    pg: *mut McPg,
    ranks: *mut i32,
    cap: usize,
    count: *mut usize,
) -> c_int {
    guard("mc_pg_failed_ranks", || {
        // SAFETY: caller's guarantee.
        let failed = unsafe { group(pg) }?.failed_ranks();
        non_null(count, "count")?;
        // SAFETY: non-null, writable.
        unsafe { *count = failed.len() };
        for (i, r) in failed.iter().take(cap).enumerate() {
            non_null(ranks, "ranks")?;
            // SAFETY: `i < cap` entries are writable.
            unsafe { *ranks.add(i) = *r as i32 };
        }
        Ok(MC_OK)
    })
}

/// The largest of the active ranks' `value`s, in `*max` (an agreement round of its
/// own kind: it never pairs with another collective).
///
/// # Safety
/// `max` writable.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_agree_max(pg: *mut McPg, value: u64, max: *mut u64) -> c_int {
    guard("mc_pg_agree_max", || {
        // SAFETY: caller's guarantee.
        let g = unsafe { group(pg) }?;
        non_null(max, "max")?;
        let m = g.agree_max(value)?;
        // SAFETY: non-null, writable.
        unsafe { *max = m };
        Ok(MC_OK)
    })
}

/// The active ranks: `mask[r]` 1 or 0 for each of `len` (= world_size) ranks.
///
/// # Safety
/// `mask` writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_active_ranks(pg: *mut McPg, mask: *mut u8, len: usize) -> c_int {
    guard("mc_pg_active_ranks", || {
        // SAFETY: caller's guarantee.
        let active = unsafe { group(pg) }?.active_ranks();
        if len != active.len() {
            return Err(Error::invalid(format!(
                "mask of {len} for world_size {}",
                active.len()
            )));
        }
        // SAFETY: as above.
        let m = unsafe { bytes_mut(mask.cast(), len, "mask") }?;
        for (d, a) in m.iter_mut().zip(active) {
            *d = a.into();
        }
        Ok(MC_OK)
    })
}

/// Adopts a view published for this rank while it was between operations (a member
/// that deactivated only itself publishes one), unless an operation holds the rank.
///
/// # Safety
/// `pg` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_refresh(pg: *mut McPg) -> c_int {
    guard("mc_pg_refresh", || {
        // SAFETY: caller's guarantee.
        unsafe { group(pg) }?.refresh();
        Ok(MC_OK)
    })
}

/// The current membership epoch: 1 at start, one more per change, 0 for an
/// extension not yet admitted.
///
/// # Safety
/// `epoch` writable.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_epoch(pg: *mut McPg, epoch: *mut u64) -> c_int {
    guard("mc_pg_epoch", || {
        // SAFETY: caller's guarantee.
        let e = unsafe { group(pg) }?.epoch();
        non_null(epoch, "epoch")?;
        // SAFETY: non-null, writable.
        unsafe { *epoch = e };
        Ok(MC_OK)
    })
}

/// For each of `n` ranks, 1 when active or ready to be activated, else 0.
///
/// # Safety
/// `ranks` readable and `states` writable for `n` entries.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_peer_state(
    pg: *mut McPg,
    ranks: *const i32,
    n: usize,
    states: *mut u8,
) -> c_int {
    guard("mc_pg_peer_state", || {
        // SAFETY: caller's guarantee.
        let g = unsafe { group(pg) }?;
        let len = n
            .checked_mul(4)
            .ok_or_else(|| Error::invalid("too many ranks"))?;
        // SAFETY: as above; `len` covers `n` int32 values.
        let rs = unsafe { bytes(ranks.cast(), len, "ranks") }?;
        let list: Vec<usize> = rs
            .chunks_exact(4)
            .map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .map(|r| usize::try_from(r).unwrap_or(usize::MAX))
            .collect();
        // SAFETY: as above.
        let out = unsafe { bytes_mut(states.cast(), n, "states") }?;
        for (o, s) in out.iter_mut().zip(g.peer_state(&list)) {
            *o = s.into();
        }
        Ok(MC_OK)
    })
}

/// Proposes activating (`activate` 1) or deactivating (0) `n` ranks. `*status` gets a
/// `MC_PG_PROPOSAL_*`, `*new_epoch` the epoch after, `dropped` (up to `dropped_cap`)
/// the members left out and `*dropped_count` how many, `reason` (NUL-terminated,
/// `reason_len` bytes, may be 0) why a rejection.
///
/// # Safety
/// Pointers valid for the sizes given; any output may be NULL when not wanted.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_propose(
    pg: *mut McPg,
    activate: c_int,
    ranks: *const i32,
    n: usize,
    status: *mut c_int,
    new_epoch: *mut u64,
    dropped: *mut i32,
    dropped_cap: usize,
    dropped_count: *mut usize,
    reason: *mut c_char,
    reason_len: usize,
) -> c_int {
    guard("mc_pg_propose", || {
        // SAFETY: caller's guarantees, for each access below.
        let g = unsafe { group(pg) }?;
        let len = n
            .checked_mul(4)
            .ok_or_else(|| Error::invalid("too many ranks"))?;
        // SAFETY: as above; `len` covers `n` int32 values.
        let rs = unsafe { bytes(ranks.cast(), len, "ranks") }?;
        let mut list = Vec::with_capacity(n);
        for c in rs.chunks_exact(4) {
            list.push(rank_arg(i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))?);
        }
        let resp = g.propose(activate != 0, &list)?;
        // SAFETY: each output is NULL or writable (caller's guarantee).
        unsafe {
            if !status.is_null() {
                *status = resp.status as c_int;
            }
            if !new_epoch.is_null() {
                *new_epoch = resp.new_epoch;
            }
            if !dropped_count.is_null() {
                *dropped_count = resp.dropped_ranks.len();
            }
            if !dropped.is_null() {
                for (i, r) in resp.dropped_ranks.iter().take(dropped_cap).enumerate() {
                    *dropped.add(i) = *r as i32;
                }
            }
            if !reason.is_null() && reason_len > 0 {
                let text = &resp.reject_reason;
                let mut end = text.len().min(reason_len - 1);
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                copy_out(&text[..end], reason, reason_len);
            }
        }
        Ok(MC_OK)
    })
}

/// Reconciles membership after a failure; `*status` gets a `MC_PG_SYNC_*`.
///
/// # Safety
/// `status` writable.
#[no_mangle]
pub unsafe extern "C" fn mc_pg_sync_after_failure(pg: *mut McPg, status: *mut c_int) -> c_int {
    guard("mc_pg_sync_after_failure", || {
        // SAFETY: caller's guarantee.
        let s = unsafe { group(pg) }?.sync_after_failure()?;
        non_null(status, "status")?;
        // SAFETY: non-null, writable.
        unsafe { *status = s as c_int };
        Ok(MC_OK)
    })
}
