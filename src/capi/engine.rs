//! `mc_engine_*`, memory registration, segments, batches, transfers, notifications.

use std::ffi::{c_char, c_int, c_void};
use std::time::Duration;

use super::args::{array, c_str, copy_out, non_null};
use super::process_bound::ProcessBound;
use super::{guard, guard_value, init_logging, McConfig, MC_OK};
use crate::engine::{Access, BatchId, Engine, EngineConfig, Request, SegmentId};
use crate::error::{Code, Error, Result};
use crate::transport::Op;

/// `mc_engine`: a running engine behind an opaque pointer.
pub struct McEngine {
    /// Shared with the stores set up on this engine (`mc_store_new_with_engine`).
    engine: ProcessBound<std::sync::Arc<Engine>>,
}

impl McEngine {
    /// The engine, shared; refused in a forked child.
    pub(crate) fn shared(&self) -> Result<&std::sync::Arc<Engine>> {
        self.engine.get("engine")
    }
}

// The header promises that one engine may be used from many threads at once.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<Engine>();
};

/// `MC_OP_READ`: remote → local.
pub const MC_OP_READ: c_int = 0;
/// `MC_OP_WRITE`: local → remote.
pub const MC_OP_WRITE: c_int = 1;

/// `mc_request` (40 bytes on 64-bit targets).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct McRequest {
    /// `MC_OP_READ` or `MC_OP_WRITE`.
    pub op: c_int,
    /// The local buffer: read into for reads, copied from for writes.
    pub local: *mut c_void,
    /// The peer segment's handle, from `mc_engine_open_segment`.
    pub segment: u64,
    /// Absolute address in the peer segment.
    pub remote_addr: u64,
    /// Bytes to move.
    pub len: u64,
}

/// `mc_task_status_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct McTaskStatus {
    /// A `MC_TASK_*` value (the numbering of [`crate::engine::TaskState`]).
    pub state: c_int,
    /// Bytes moved so far.
    pub bytes: u64,
}

/// Borrows the engine behind a handle.
///
/// # Safety
/// `e` must be NULL or a live pointer from `mc_engine_new` that is not freed during `'a`.
unsafe fn engine<'a>(e: *mut McEngine) -> Result<&'a Engine> {
    non_null(e, "engine")?;
    // SAFETY: `e` is non-null (checked by `non_null`) and the caller guarantees a live engine from
    // mc_engine_new that mc_engine_free does not free during `'a` (mooncake.h); only shared access
    // is made, which `Engine: Sync` allows from many threads.
    unsafe { &*e }.shared().map(|engine| &**engine)
}

/// Starts an engine from `cfg` (NULL: defaults) and stores it in `*out` (NULL on error).
///
/// # Safety
/// `cfg` must be NULL or a live `mc_config`; `out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_engine_new(cfg: *const McConfig, out: *mut *mut McEngine) -> c_int {
    guard("mc_engine_new", || {
        init_logging();
        non_null(out, "out")?;
        // SAFETY: `out` is non-null (checked just above) and the caller guarantees a non-null `out`
        // is writable, as this fn's `# Safety` and mooncake.h require.
        unsafe { *out = std::ptr::null_mut() };
        let config = if cfg.is_null() {
            EngineConfig::default()
        } else {
            // SAFETY: `cfg` is non-null (checked) and the caller guarantees a live mc_config that
            // no other thread uses meanwhile (mooncake.h's rule for configs); it is only read
            // (cloned).
            unsafe { (*cfg).config.clone() }
        };
        let engine = Engine::new(config)?;
        let handle = Box::into_raw(Box::new(McEngine {
            engine: ProcessBound::new(std::sync::Arc::new(engine)),
        }));
        // SAFETY: `out` was checked non-null at the top of this closure and is writable, as the
        // caller guarantees; storing the handle is its only use.
        unsafe { *out = handle };
        Ok(MC_OK)
    })
}

/// Stops and frees an engine; NULL is ignored.
///
/// # Safety
/// `e` must be NULL or a pointer from `mc_engine_new` not yet freed, with no other call
/// on it in progress or to come.
#[no_mangle]
pub unsafe extern "C" fn mc_engine_free(e: *mut McEngine) {
    if e.is_null() {
        return;
    }
    guard_value("mc_engine_free", (), || {
        // SAFETY: from `Box::into_raw` in `mc_engine_new`, freed once, no longer shared.
        drop(unsafe { Box::from_raw(e) });
    });
}

/// Copies the segment name, NUL-terminated, into `buf[..len]`.
///
/// # Safety
/// `e` as for every engine call; `buf` must be NULL or writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn mc_engine_segment_name(
    e: *mut McEngine,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    guard("mc_engine_segment_name", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let engine = unsafe { engine(e)? };
        non_null(buf, "buf")?;
        let name = engine.segment_name();
        // SAFETY: `buf` is writable for `len` bytes.
        if unsafe { copy_out(name, buf, len) } {
            return Ok(MC_OK);
        }
        if len > 0 {
            // SAFETY: `buf` holds at least one byte.
            unsafe { *buf = 0 };
        }
        Err(Error::new(
            Code::BufferOverflow,
            format!(
                "segment name {name:?} needs {} bytes, buffer has {len}",
                name.len() + 1
            ),
        ))
    })
}

/// Publishes `[addr, addr+len)` to peers; `location` NULL means "cpu:0".
///
/// # Safety
/// `e` as for every engine call; `location` NULL or a NUL-terminated string; the memory
/// must stay valid (and may be written by peers) until it is unregistered.
#[no_mangle]
pub unsafe extern "C" fn mc_register_memory(
    e: *mut McEngine,
    addr: *mut c_void,
    len: usize,
    location: *const c_char,
) -> c_int {
    // SAFETY: the same contract, passed on unchanged; 0 is MC_ACCESS_READ_WRITE.
    unsafe { mc_register_memory_with_access(e, addr, len, location, 0) }
}

/// `MC_ACCESS_*` as an [`Access`]; `None` for any other number.
fn access_from_c(access: u32) -> Option<Access> {
    match access {
        0 => Some(Access::ReadWrite),
        1 => Some(Access::ReadOnly),
        2 => Some(Access::LocalOnly),
        _ => None,
    }
}

/// As `mc_register_memory`, with what peers may do with the buffer (`MC_ACCESS_*`).
///
/// # Safety
/// As `mc_register_memory`.
#[no_mangle]
pub unsafe extern "C" fn mc_register_memory_with_access(
    e: *mut McEngine,
    addr: *mut c_void,
    len: usize,
    location: *const c_char,
    access: u32,
) -> c_int {
    guard("mc_register_memory_with_access", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let engine = unsafe { engine(e)? };
        non_null(addr, "addr")?;
        let access = access_from_c(access).ok_or_else(|| {
            Error::invalid(format!("access {access} is not an MC_ACCESS_* value"))
        })?;
        let location = if location.is_null() {
            "cpu:0"
        } else {
            // SAFETY: `location` is non-null (this branch) and the caller guarantees a non-null
            // `location` is a NUL-terminated string unchanged during the call, as `c_str` requires.
            unsafe { c_str(location, "location")? }
        };
        // SAFETY: the caller keeps the memory valid until it unregisters it.
        unsafe { engine.register_memory_with_access(addr.cast(), len, location, access)? };
        Ok(MC_OK)
    })
}

/// Allocates engine-owned, registered, shareable memory.
///
/// # Safety
/// `e` as for every engine call; `location` NULL or a C string; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn mc_allocate_buffer(
    e: *mut McEngine,
    len: usize,
    location: *const c_char,
    out: *mut *mut c_void,
) -> c_int {
    guard("mc_allocate_buffer", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let engine = unsafe { engine(e)? };
        non_null(out, "out")?;
        let location = if location.is_null() {
            "cpu:0"
        } else {
            // SAFETY: `location` is non-null (this branch) and the caller guarantees a non-null
            // `location` is a NUL-terminated string unchanged during the call, as `c_str` requires.
            unsafe { c_str(location, "location")? }
        };
        let ptr = engine.allocate_buffer(len, location)?;
        // SAFETY: `out` is non-null (checked above) and the caller guarantees it is writable (this
        // fn's `# Safety`).
        unsafe { *out = ptr.cast() };
        Ok(MC_OK)
    })
}

/// Releases memory from `mc_allocate_buffer`.
///
/// # Safety
/// `e` as for every engine call.
#[no_mangle]
pub unsafe extern "C" fn mc_free_buffer(e: *mut McEngine, addr: *mut c_void) -> c_int {
    guard("mc_free_buffer", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let engine = unsafe { engine(e)? };
        non_null(addr, "addr")?;
        engine.free_buffer(addr.cast())?;
        Ok(MC_OK)
    })
}

/// Withdraws the buffer registered at `addr`.
///
/// # Safety
/// `e` as for every engine call.
#[no_mangle]
pub unsafe extern "C" fn mc_unregister_memory(e: *mut McEngine, addr: *mut c_void) -> c_int {
    guard("mc_unregister_memory", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let engine = unsafe { engine(e)? };
        non_null(addr, "addr")?;
        engine.unregister_memory(addr.cast())?;
        Ok(MC_OK)
    })
}

/// Resolves a segment by name into `*segment_out`.
///
/// # Safety
/// `e` as for every engine call; `name` NULL or NUL-terminated; `segment_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn mc_open_segment(
    e: *mut McEngine,
    name: *const c_char,
    segment_out: *mut u64,
) -> c_int {
    guard("mc_open_segment", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let engine = unsafe { engine(e)? };
        non_null(segment_out, "segment_out")?;
        // SAFETY: NULL (rejected) or a NUL-terminated string.
        let name = unsafe { c_str(name, "name")? };
        let id: SegmentId = engine.open_segment(name)?;
        // SAFETY: non-null and writable.
        unsafe { *segment_out = id };
        Ok(MC_OK)
    })
}

/// Refetches an opened segment's descriptor.
///
/// # Safety
/// `e` as for every engine call.
#[no_mangle]
pub unsafe extern "C" fn mc_resync_segment(e: *mut McEngine, segment: u64) -> c_int {
    guard("mc_resync_segment", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        unsafe { engine(e)? }.resync_segment(segment)?;
        Ok(MC_OK)
    })
}

/// Allocates a batch of `capacity` tasks into `*batch_out`.
///
/// # Safety
/// `e` as for every engine call; `batch_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_batch_new(
    e: *mut McEngine,
    capacity: usize,
    batch_out: *mut u64,
) -> c_int {
    guard("mc_batch_new", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let engine = unsafe { engine(e)? };
        non_null(batch_out, "batch_out")?;
        let id: BatchId = engine.allocate_batch(capacity)?;
        // SAFETY: non-null and writable.
        unsafe { *batch_out = id };
        Ok(MC_OK)
    })
}

fn to_request(i: usize, r: &McRequest) -> Result<Request> {
    let op = match r.op {
        MC_OP_READ => Op::Read,
        MC_OP_WRITE => Op::Write,
        other => {
            return Err(Error::invalid(format!(
                "request {i}: op {other} (must be MC_OP_READ 0 or MC_OP_WRITE 1)"
            )))
        }
    };
    Ok(Request {
        op,
        local: r.local as u64,
        segment: r.segment,
        remote: r.remote_addr,
        len: r.len,
    })
}

/// Submits `n` requests to a batch; all or none.
///
/// # Safety
/// `e` as for every engine call; `reqs` NULL (only with `n == 0`) or `n` readable
/// requests; every local buffer must stay valid and untouched until its task is final.
#[no_mangle]
pub unsafe extern "C" fn mc_submit(
    e: *mut McEngine,
    batch: u64,
    reqs: *const McRequest,
    n: usize,
) -> c_int {
    guard("mc_submit", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine not being freed (`engine`'s
        // contract) and `reqs` NULL only with `n == 0` or `n` readable requests (`requests`'s).
        let (engine, requests) = unsafe { (engine(e)?, requests(reqs, n)?) };
        // SAFETY: the caller keeps each local buffer valid until its task is final.
        unsafe { engine.submit(batch, &requests)? };
        Ok(MC_OK)
    })
}

/// The engine requests `n` C requests at `reqs` describe.
///
/// # Safety
/// `reqs` NULL (only with `n == 0`) or `n` readable requests.
unsafe fn requests(reqs: *const McRequest, n: usize) -> Result<Vec<Request>> {
    // SAFETY: `n` readable requests (caller's guarantee), only read during this call.
    let reqs = unsafe { array(reqs, n, "reqs") }?;
    reqs.iter()
        .enumerate()
        .map(|(i, r)| to_request(i, r))
        .collect()
}

/// Moves `n` requests and returns once every one is final: one call where a
/// batch takes five (new, submit, wait, status, free).
///
/// # Safety
/// `e` as for every engine call; `reqs` NULL (only with `n == 0`) or `n` readable
/// requests whose local buffers stay valid and untouched during the call.
#[no_mangle]
pub unsafe extern "C" fn mc_transfer_sync(
    e: *mut McEngine,
    reqs: *const McRequest,
    n: usize,
) -> c_int {
    guard("mc_transfer_sync", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine not being freed (`engine`'s
        // contract) and `reqs` NULL only with `n == 0` or `n` readable requests (`requests`'s).
        let (engine, requests) = unsafe { (engine(e)?, requests(reqs, n)?) };
        // SAFETY: the caller keeps each local buffer valid for the call, which returns
        // only once every task is final.
        unsafe { engine.transfer_sync(&requests)? };
        Ok(MC_OK)
    })
}

/// Writes the status of task `task` of a batch into `*out`.
///
/// # Safety
/// `e` as for every engine call; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_task_status(
    e: *mut McEngine,
    batch: u64,
    task: usize,
    out: *mut McTaskStatus,
) -> c_int {
    guard("mc_task_status", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let engine = unsafe { engine(e)? };
        non_null(out, "out")?;
        let st = engine.task_status(batch, task)?;
        // SAFETY: non-null and writable.
        unsafe {
            *out = McTaskStatus {
                state: st.state as c_int,
                bytes: st.bytes,
            }
        };
        Ok(MC_OK)
    })
}

/// Waits for every submitted task of a batch; `timeout_ms < 0` means no limit.
///
/// # Safety
/// `e` as for every engine call.
#[no_mangle]
pub unsafe extern "C" fn mc_batch_wait(e: *mut McEngine, batch: u64, timeout_ms: i64) -> c_int {
    guard("mc_batch_wait", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let engine = unsafe { engine(e)? };
        let timeout = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
        engine.wait_batch(batch, timeout)?;
        Ok(MC_OK)
    })
}

/// Frees a batch whose tasks are all final.
///
/// # Safety
/// `e` as for every engine call.
#[no_mangle]
pub unsafe extern "C" fn mc_batch_free(e: *mut McEngine, batch: u64) -> c_int {
    guard("mc_batch_free", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        unsafe { engine(e)? }.free_batch(batch)?;
        Ok(MC_OK)
    })
}

/// Sends a text message to an opened segment's engine.
///
/// # Safety
/// `e` as for every engine call; `msg` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mc_notify(e: *mut McEngine, segment: u64, msg: *const c_char) -> c_int {
    guard("mc_notify", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let engine = unsafe { engine(e)? };
        // SAFETY: NULL (rejected) or a NUL-terminated string.
        let msg = unsafe { c_str(msg, "msg")? };
        engine.notify(segment, msg)?;
        Ok(MC_OK)
    })
}

/// Takes the oldest notification into `from`/`msg`: 1 taken, 0 none, or an error (on
/// `MC_ERR_BUFFER_OVERFLOW` it stays queued).
///
/// # Safety
/// `e` as for every engine call; `from` and `msg` NULL or writable for `from_len` and
/// `msg_len` bytes, not overlapping.
#[no_mangle]
pub unsafe extern "C" fn mc_take_notification(
    e: *mut McEngine,
    from: *mut c_char,
    from_len: usize,
    msg: *mut c_char,
    msg_len: usize,
) -> c_int {
    guard("mc_take_notification", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let engine = unsafe { engine(e)? };
        non_null(from, "from")?;
        non_null(msg, "msg")?;
        let taken = engine.take_notification_with(|n| {
            if n.from.len() >= from_len || n.message.len() >= msg_len {
                return Err(Error::new(
                    Code::BufferOverflow,
                    format!(
                        "notification needs {} bytes for the sender and {} for the message, \
                         buffers have {from_len} and {msg_len}",
                        n.from.len() + 1,
                        n.message.len() + 1
                    ),
                ));
            }
            // SAFETY: both fit (checked above) in buffers writable for their lengths.
            unsafe {
                copy_out(&n.from, from, from_len);
                copy_out(&n.message, msg, msg_len);
            }
            Ok(())
        });
        match taken {
            None => Ok(0),
            Some(r) => r.map(|()| 1),
        }
    })
}

/// Checks that an opened segment's engine answers.
///
/// # Safety
/// `e` as for every engine call.
#[no_mangle]
pub unsafe extern "C" fn mc_probe(e: *mut McEngine, segment: u64) -> c_int {
    guard("mc_probe", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        unsafe { engine(e)? }.probe(segment)?;
        Ok(MC_OK)
    })
}

/// The port of the engine's RPC server, or a negative code.
///
/// # Safety
/// `e` must be NULL or a live engine.
#[no_mangle]
pub unsafe extern "C" fn mc_engine_rpc_port(e: *mut McEngine) -> c_int {
    guard("mc_engine_rpc_port", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let port = unsafe { engine(e)? }.rpc_port();
        port.map(c_int::from)
            .ok_or_else(|| Error::new(Code::UnavailableInCurrentStatus, "rpc server stopped"))
    })
}

/// A segment's descriptor as Mooncake's JSON into `buf[..len]`; segment 0 is the
/// engine's own.
///
/// # Safety
/// `e` NULL or a live engine; `buf` NULL or writable for `len` bytes; `needed_out`
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_segment_describe(
    e: *mut McEngine,
    segment: u64,
    buf: *mut c_char,
    len: usize,
    needed_out: *mut usize,
) -> c_int {
    guard("mc_segment_describe", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let engine = unsafe { engine(e)? };
        let desc = match segment {
            0 => engine.descriptor(),
            s => engine.segment_descriptor(s)?,
        };
        let text = desc.to_json().to_string();
        // SAFETY: the caller guarantees `buf` is NULL or writable for `len` bytes and `needed_out`
        // NULL or writable, which is exactly `answer_text`'s contract (it rejects a NULL `buf` with
        // `len > 0`).
        unsafe { super::args::answer_text(&text, buf, len, needed_out, "segment descriptor") }
    })
}

/// Copies the engine's counters (bytes per transport, retries, failed slices, ...) as
/// one JSON object, with `"protocol"`, the protocol it runs, and `"same_host_shm"`,
/// whether its requests reach same-host peers through shared memory.
///
/// # Safety
/// `e` NULL or a live engine; `buf` NULL or writable for `len` bytes; `needed_out` NULL
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_engine_stats(
    e: *mut McEngine,
    buf: *mut c_char,
    len: usize,
    needed_out: *mut usize,
) -> c_int {
    guard("mc_engine_stats", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine from mc_engine_new that
        // mc_engine_free is not freeing concurrently (mooncake.h), which is what `engine` needs.
        let engine = unsafe { engine(e)? };
        let text = engine.stats_json().to_string();
        // SAFETY: as in `mc_segment_describe`: `answer_text`'s contract is the caller's.
        unsafe { super::args::answer_text(&text, buf, len, needed_out, "engine stats") }
    })
}

/// As `mc_notify`, under the sender name `name` instead of this engine's.
///
/// # Safety
/// `e` NULL or a live engine; `name` and `msg` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mc_notify_as(
    e: *mut McEngine,
    segment: u64,
    name: *const c_char,
    msg: *const c_char,
) -> c_int {
    guard("mc_notify_as", || {
        // SAFETY: the caller guarantees `e` is NULL or a live engine not being freed and `name` and
        // `msg` NULL or NUL-terminated strings: the contracts of `engine` and `c_str` (both reject
        // NULL).
        let (engine, name, msg) = unsafe { (engine(e)?, c_str(name, "name")?, c_str(msg, "msg")?) };
        engine.notify_as(segment, name, msg)?;
        Ok(MC_OK)
    })
}
