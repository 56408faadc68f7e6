//! The C functions of upstream's `transfer_engine_c.h`, each a thin shell over
//! `TeEngine`: arguments checked (`capi::args`), errors mapped to upstream's codes.

#![allow(non_snake_case)]

use super::*;

// ---------------------------------------------------------------- engine

/// Creates an engine (started now when `auto_discover` is nonzero); NULL on failure.
///
/// # Safety
/// Each string must be NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn createTransferEngine(
    metadata_conn_string: *const c_char,
    local_server_name: *const c_char,
    ip_or_host_name: *const c_char,
    rpc_port: u64,
    auto_discover: c_int,
) -> *mut TeEngine {
    run_value("createTransferEngine", std::ptr::null_mut(), || {
        init_logging();
        // SAFETY: the caller guarantees each string is NULL or NUL-terminated and unchanged during
        // the call: the contracts of `c_str` (which rejects NULL) and `opt_str`.
        let (metadata, name, host) = unsafe {
            (
                c_str(metadata_conn_string, "metadata_conn_string")?,
                opt_str(local_server_name, "local_server_name")?,
                opt_str(ip_or_host_name, "ip_or_host_name")?,
            )
        };
        let (config, protocol_set) = create_config(metadata, name, host, rpc_port)?;
        let te = TeCore::new(config, protocol_set)?;
        if auto_discover != 0 {
            te.start_discovered()?;
        }
        Ok(Box::into_raw(Box::new(TeEngine::new(te))))
    })
}

/// Stops and frees an engine; NULL is ignored.
///
/// # Safety
/// `engine` must be NULL or a pointer from `createTransferEngine` not yet destroyed,
/// with no other call on it in progress or to come.
#[no_mangle]
pub unsafe extern "C" fn destroyTransferEngine(engine: *mut TeEngine) {
    if engine.is_null() {
        return;
    }
    guard_value("destroyTransferEngine", (), || {
        // SAFETY: from `Box::into_raw` in `createTransferEngine`, freed once, no
        // longer shared.
        drop(unsafe { Box::from_raw(engine) });
    });
}

/// Writes "ip:port" of the engine's RPC server into `buf_out`.
///
/// # Safety
/// `engine` as for every call; `buf_out` NULL or writable for `buf_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn getLocalIpAndPort(
    engine: *mut TeEngine,
    buf_out: *mut c_char,
    buf_len: usize,
) -> c_int {
    run("getLocalIpAndPort", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let addr = match te.local_addr.get() {
            Some(a) => a,
            None => {
                let name = te.engine()?.segment_name().to_owned();
                let addr = te.directory.rpc_address(&name)?;
                te.local_addr.get_or_init(|| addr)
            }
        };
        // SAFETY: the caller guarantees `buf_out` is NULL or writable for `buf_len` bytes, which is
        // `write_out`'s contract (it rejects NULL).
        unsafe { write_out(addr, buf_out, buf_len, "the address") }
    })
}

/// Installs a transport (starting the engine with it if not yet started: an
/// unavailable hardware protocol then runs over TCP, see `Engine::protocol_fallback`);
/// NULL if the protocol is unknown, refused (`MC_STRICT_PROTOCOL=1`) or incompatible
/// with the running engine.
///
/// # Safety
/// `engine` as for every call; `proto` NULL or NUL-terminated; `args` NULL or pointing
/// to at least one pointer, which is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn installTransport(
    engine: *mut TeEngine,
    proto: *const c_char,
    args: *mut *mut c_void,
) -> *mut c_void {
    run_value("installTransport", std::ptr::null_mut(), || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: NULL (refused) or NUL-terminated.
        let name = unsafe { c_str(proto, "proto")? };
        let protocol = Protocol::parse(name)?;
        let hardware = protocol.is_hardware();
        let matrix = if hardware && !args.is_null() {
            // SAFETY: `args` is non-null (checked in the `if`) and the caller guarantees a non-null
            // `args` points to at least one readable pointer.
            let first = unsafe { *args };
            // SAFETY: the caller guarantees `args[0]` is NULL or a NUL-terminated string unchanged
            // during the call, which is `opt_str`'s contract.
            unsafe { opt_str(first.cast_const().cast(), "args[0]")? }.map(str::to_owned)
        } else {
            None
        };
        let running = te.start_with(|| {
            let mut cfg = te.config.clone();
            cfg.protocol = protocol;
            // Upstream's names: its `tcp`, asked or fallen back to, also reaches
            // same-host peers through shared memory (`EngineConfig::same_host_shm`),
            // unless the connection string chose with our own `protocol` key.
            if !te.protocol_set {
                cfg.same_host_shm = same_host_shm_from_env();
            }
            if let Some(m) = &matrix {
                cfg.backend.devices = m.clone();
            }
            cfg
        })?;
        // What the engine runs (a hardware protocol it fell back from runs as tcp); asking
        // again for what it was started with is no change.
        let current = running.protocol();
        let compatible = current == protocol
            || running.config().protocol == protocol
            || protocol == Protocol::Tcp
            || (protocol == Protocol::Shm && running.same_host_shm());
        if !compatible {
            return Err(Error::new(
                Code::NotSupported,
                format!(
                    "the engine already runs protocol {}; it chooses transports when it \
                     starts, so call installTransport({name:?}) first (auto_discover 0)",
                    current.name()
                ),
            ));
        }
        if let Some(m) = matrix {
            if m != running.config().backend.devices {
                log::warn!("installTransport({name:?}): the engine already runs; args[0] ignored");
            }
        }
        let mut installed = te.transports.locked();
        match installed.iter_mut().find(|t| t.protocol == protocol) {
            Some(t) => t.active = true,
            None => installed.push(Installed {
                protocol,
                active: true,
            }),
        }
        Ok(transport_handle(protocol))
    })
}

/// Releases an installed transport's handle.
///
/// # Safety
/// `engine` as for every call; `proto` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn uninstallTransport(engine: *mut TeEngine, proto: *const c_char) -> c_int {
    run("uninstallTransport", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: NULL (refused) or NUL-terminated.
        let name = unsafe { c_str(proto, "proto")? };
        let protocol = Protocol::parse(name)?;
        let mut installed = te.transports.locked();
        let t = installed
            .iter_mut()
            .find(|t| t.protocol == protocol && t.active)
            .ok_or_else(|| Error::invalid(format!("transport {name:?} is not installed")))?;
        t.active = false;
        log::info!("uninstallTransport({name:?}): it serves peers until destroyTransferEngine");
        Ok(0)
    })
}

// ---------------------------------------------------------------- segments

/// Opens a segment by name; its id, or -1.
///
/// # Safety
/// `engine` as for every call; `segment_name` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn openSegment(engine: *mut TeEngine, segment_name: *const c_char) -> i32 {
    run_value("openSegment", -1, || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: NULL (refused) or NUL-terminated.
        te.open(unsafe { c_str(segment_name, "segment_name")? }, false)
    })
}

/// As `openSegment`, refetching the segment's descriptor first.
///
/// # Safety
/// As `openSegment`.
#[no_mangle]
pub unsafe extern "C" fn openSegmentNoCache(
    engine: *mut TeEngine,
    segment_name: *const c_char,
) -> i32 {
    run_value("openSegmentNoCache", -1, || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: NULL (refused) or NUL-terminated.
        te.open(unsafe { c_str(segment_name, "segment_name")? }, true)
    })
}

/// Forgets a segment id.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn closeSegment(engine: *mut TeEngine, segment_id: i32) -> c_int {
    run("closeSegment", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        if segment_id == LOCAL_SEGMENT {
            return Ok(0);
        }
        let mut table = te.segments.locked();
        let opened = table
            .ids
            .remove(&segment_id)
            .ok_or_else(|| Error::invalid(format!("segment id {segment_id} is not open")))?;
        table.by_segment.remove(&opened.segment);
        Ok(0)
    })
}

/// Removes a segment's records from the metadata server.
///
/// # Safety
/// `engine` as for every call; `segment_name` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn removeLocalSegment(
    engine: *mut TeEngine,
    segment_name: *const c_char,
) -> c_int {
    run("removeLocalSegment", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: NULL (refused) or NUL-terminated.
        let name = unsafe { c_str(segment_name, "segment_name")? };
        // Only what this engine published may be removed by it.
        let engine = te.engine()?;
        if name != engine.segment_name() {
            return Err(Error::invalid(format!(
                "removeLocalSegment({name:?}): this engine is {:?}; another's records are not its to remove",
                engine.segment_name()
            )));
        }
        engine.unpublish()?;
        Ok(0)
    })
}

/// Refetches every opened segment's descriptor.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn syncSegmentCache(engine: *mut TeEngine) -> c_int {
    run("syncSegmentCache", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let eng = te.engine()?;
        let segments: Vec<SegmentId> = te
            .segments
            .locked()
            .ids
            .values()
            .map(|o| o.segment)
            .collect();
        let mut first = Ok(());
        for s in segments {
            if let Err(e) = eng.resync_segment(s) {
                log::warn!("syncSegmentCache: segment {s}: {e}");
                first = first.and(Err(e));
            }
        }
        first.map(|()| 0)
    })
}

// ---------------------------------------------------------------- memory

/// Registers `[addr, addr+length)`.
///
/// # Safety
/// `engine` as for every call; `location` NULL or NUL-terminated; the memory must stay
/// valid (and may be written by peers) until unregistered.
#[no_mangle]
pub unsafe extern "C" fn registerLocalMemory(
    engine: *mut TeEngine,
    addr: *mut c_void,
    length: usize,
    location: *const c_char,
    remote_accessible: c_int,
) -> c_int {
    run("registerLocalMemory", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        non_null(addr, "addr")?;
        // SAFETY: NULL or NUL-terminated.
        let location = location_of(unsafe { opt_str(location, "location")? }, addr as u64);
        if remote_accessible == 0 {
            log::debug!("registerLocalMemory: {addr:p} is published to peers all the same");
        }
        // SAFETY: the caller keeps the memory valid until it unregisters it.
        unsafe {
            te.engine()?
                .register_memory(addr.cast(), length, &location)?
        };
        Ok(0)
    })
}

/// Unregisters the buffer at `addr`.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn unregisterLocalMemory(engine: *mut TeEngine, addr: *mut c_void) -> c_int {
    run("unregisterLocalMemory", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        non_null(addr, "addr")?;
        te.engine()?.unregister_memory(addr.cast())?;
        Ok(0)
    })
}

/// Registers several buffers with one location; all or none.
///
/// # Safety
/// `engine` as for every call; `buffer_list` NULL (only with `buffer_len` 0) or
/// `buffer_len` readable entries; `location` as for `registerLocalMemory`.
#[no_mangle]
pub unsafe extern "C" fn registerLocalMemoryBatch(
    engine: *mut TeEngine,
    buffer_list: *mut BufferEntry,
    buffer_len: usize,
    location: *const c_char,
) -> c_int {
    run("registerLocalMemoryBatch", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: the caller guarantees `buffer_list` is NULL only with `buffer_len` 0 or
        // `buffer_len` readable entries, unchanged during the call, which is `c_array`'s contract.
        let list = unsafe { array(buffer_list.cast_const(), buffer_len, "buffer_list")? };
        // SAFETY: NULL or NUL-terminated.
        let location = unsafe { opt_str(location, "location")? };
        let eng = te.engine()?;
        for (i, b) in list.iter().enumerate() {
            let registered = non_null(b.addr, "addr").and_then(|()| {
                let loc = location_of(location, b.addr as u64);
                // SAFETY: the caller keeps the memory valid until it unregisters it.
                unsafe { eng.register_memory(b.addr.cast(), b.length, &loc) }
            });
            if let Err(e) = registered {
                for done in &list[..i] {
                    if let Err(undo) = eng.unregister_memory(done.addr.cast()) {
                        log::warn!("registerLocalMemoryBatch: undoing {:p}: {undo}", done.addr);
                    }
                }
                return Err(Error::new(e.code(), format!("buffer {i}: {}", e.context())));
            }
        }
        Ok(0)
    })
}

/// Unregisters several buffers; all are tried, the first error is returned.
///
/// # Safety
/// `engine` as for every call; `addr_list` NULL (only with `addr_len` 0) or `addr_len`
/// readable pointers.
#[no_mangle]
pub unsafe extern "C" fn unregisterLocalMemoryBatch(
    engine: *mut TeEngine,
    addr_list: *mut *mut c_void,
    addr_len: usize,
) -> c_int {
    run("unregisterLocalMemoryBatch", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: the caller guarantees `addr_list` is NULL only with `addr_len` 0 or `addr_len`
        // readable pointers, unchanged during the call, which is `c_array`'s contract.
        let list = unsafe { array(addr_list.cast_const(), addr_len, "addr_list")? };
        let eng = te.engine()?;
        let mut first = Ok(());
        for (i, &a) in list.iter().enumerate() {
            let done = non_null(a, "addr").and_then(|()| eng.unregister_memory(a.cast()));
            if let Err(e) = done {
                log::warn!("unregisterLocalMemoryBatch: buffer {i} ({a:p}): {e}");
                first = first.and(Err(e));
            }
        }
        first.map(|()| 0)
    })
}

// ---------------------------------------------------------------- transfers

/// Allocates a batch of `batch_size` tasks; `INVALID_BATCH` on failure.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn allocateBatchID(engine: *mut TeEngine, batch_size: usize) -> u64 {
    run_value("allocateBatchID", INVALID_BATCH, || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let id = te.engine()?.allocate_batch(batch_size)?;
        te.batches.locked().insert(id, BatchInfo::default());
        Ok(id)
    })
}

/// Submits `count` requests to a batch; a status code.
///
/// # Safety
/// `engine` as for every call; `entries` NULL (only with `count` 0) or `count`
/// readable requests; every source buffer must stay valid and untouched until its task
/// is final.
#[no_mangle]
pub unsafe extern "C" fn submitTransfer(
    engine: *mut TeEngine,
    batch_id: u64,
    entries: *mut TransferRequest,
    count: usize,
) -> c_int {
    run_status("submitTransfer", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: the caller guarantees `entries` is NULL only with `count` 0 or `count` readable
        // requests, unchanged during the call, which is `c_array`'s contract.
        let entries = unsafe { array(entries.cast_const(), count, "entries")? };
        // SAFETY: submitTransfer's contract (transfer_engine_c.h): the caller keeps every
        // source buffer valid and untouched until its task is final.
        unsafe { te.submit(batch_id, entries, None) }
    })
}

/// As `submitTransfer`, sending `notify_msg` to the first request's segment once the
/// batch is complete.
///
/// # Safety
/// As `submitTransfer`; both strings of `notify_msg` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn submitTransferWithNotify(
    engine: *mut TeEngine,
    batch_id: u64,
    entries: *mut TransferRequest,
    count: usize,
    notify_msg: NotifyMsg,
) -> c_int {
    run_status("submitTransferWithNotify", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: `notify_msg.name` and `.msg` are NULL or NUL-terminated strings unchanged during
        // the call, as the caller guarantees; that is what `opt_str` and `c_str` need (`c_str`
        // rejects NULL).
        let (name, msg) = unsafe {
            (
                opt_str(notify_msg.name, "notify_msg.name")?,
                c_str(notify_msg.msg, "notify_msg.msg")?,
            )
        };
        // SAFETY: the caller guarantees `entries` is NULL only with `count` 0 or `count` readable
        // requests, unchanged during the call, which is `c_array`'s contract.
        let entries = unsafe { array(entries.cast_const(), count, "entries")? };
        let target = entries
            .first()
            .ok_or_else(|| Error::invalid("no requests to notify about"))?
            .target_id;
        let name = match name {
            Some(n) => n.to_owned(),
            None => te.engine()?.segment_name().to_owned(),
        };
        let note = PendingNotify {
            target,
            name,
            msg: msg.to_owned(),
        };
        // SAFETY: submitTransfer's contract (transfer_engine_c.h): the caller keeps every
        // source buffer valid and untouched until its task is final.
        unsafe { te.submit(batch_id, entries, Some(note)) }
    })
}

/// Writes a task's state into `*status`; a status code.
///
/// # Safety
/// `engine` as for every call; `status` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn getTransferStatus(
    engine: *mut TeEngine,
    batch_id: u64,
    task_id: usize,
    status: *mut TransferStatus,
) -> c_int {
    run_status("getTransferStatus", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        non_null(status, "status")?;
        let eng = te.engine()?;
        let st = eng.task_status(batch_id, task_id)?;
        // SAFETY: `status` is non-null (checked above) and the caller guarantees a non-null
        // `status` is a writable transfer_status.
        unsafe {
            *status = TransferStatus {
                status: st.state as c_int,
                transferred_bytes: st.bytes,
            }
        };
        if st.state.is_final() && te.pending_notifies.load(Ordering::Relaxed) > 0 {
            te.settle_notify(eng, batch_id);
        }
        Ok(())
    })
}

/// Frees a batch whose tasks are all final; a status code (4 while busy).
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn freeBatchID(engine: *mut TeEngine, batch_id: u64) -> c_int {
    run_status("freeBatchID", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let eng = te.engine()?;
        // Sends the batch's notification if every task completed (and drops it if
        // every task is final but some did not). With tasks running the batch is busy,
        // and stays so even if they finish right after this look: freeing it then
        // would lose the notification.
        if te.pending_notifies.load(Ordering::Relaxed) > 0 && !te.settle_notify(eng, batch_id) {
            return Err(Error::new(
                Code::BatchBusy,
                format!("batch {batch_id} has unfinished tasks"),
            ));
        }
        eng.free_batch(batch_id)?;
        te.batches.locked().remove(&batch_id);
        Ok(())
    })
}

// ---------------------------------------------------------------- notifications

/// Duplicates `s` with `malloc`; NULL if out of memory.
fn malloc_str(s: &str) -> *mut c_char {
    // SAFETY: plain allocation; the result is checked before use.
    let p = unsafe { libc::malloc(s.len() + 1) }.cast::<c_char>();
    if !p.is_null() {
        // SAFETY: `p` holds `s.len() + 1` bytes, disjoint from `s`.
        unsafe {
            std::ptr::copy_nonoverlapping(s.as_ptr(), p.cast::<u8>(), s.len());
            *p.add(s.len()) = 0;
        }
    }
    p
}

/// Takes every received notification as a `malloc`ed array (NULL when none).
///
/// # Safety
/// `engine` as for every call; `size` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn getNotifsFromEngine(
    engine: *mut TeEngine,
    size: *mut c_int,
) -> *mut NotifyMsg {
    run_value("getNotifsFromEngine", std::ptr::null_mut(), || {
        non_null(size, "size")?;
        // SAFETY: `size` is non-null (checked just above) and the caller guarantees a non-null
        // `size` is a writable int.
        unsafe { *size = 0 };
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let notes = te.engine()?.take_notifications();
        if notes.is_empty() {
            return Ok(std::ptr::null_mut());
        }
        let n = c_int::try_from(notes.len())
            .map_err(|_| Error::new(Code::Internal, "too many notifications"))?;
        // SAFETY: plain allocation of `n` entries (no overflow: `n` is small); checked.
        let array = unsafe { libc::calloc(notes.len(), std::mem::size_of::<NotifyMsg>()) }
            .cast::<NotifyMsg>();
        if array.is_null() {
            return Err(Error::new(
                Code::NoAvailableHandle,
                format!("out of memory for {n} notifications (dropped)"),
            ));
        }
        for (i, note) in notes.iter().enumerate() {
            let entry = NotifyMsg {
                name: malloc_str(&note.from),
                msg: malloc_str(&note.message),
            };
            // SAFETY: `array` holds `notes.len()` zeroed entries; `i` is in range.
            unsafe { array.add(i).write(entry) };
            if entry.name.is_null() || entry.msg.is_null() {
                // SAFETY: the array and what is in it so far came from malloc/calloc.
                unsafe { freeNotifsMsgBuf(array, n) };
                return Err(Error::new(
                    Code::NoAvailableHandle,
                    format!("out of memory for {n} notifications (dropped)"),
                ));
            }
        }
        // SAFETY: `size` was checked non-null at the top of this closure and is a writable int, as
        // the caller guarantees.
        unsafe { *size = n };
        Ok(array)
    })
}

/// Frees what `getNotifsFromEngine` returned.
///
/// # Safety
/// `msg` must be NULL or an array from `getNotifsFromEngine` of `size` entries, not
/// freed before and not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn freeNotifsMsgBuf(msg: *mut NotifyMsg, size: c_int) -> c_int {
    run("freeNotifsMsgBuf", || {
        if msg.is_null() {
            return Ok(0);
        }
        let n = usize::try_from(size)
            .map_err(|_| Error::invalid(format!("size {size} is negative")))?;
        for i in 0..n {
            // SAFETY: `i < size` entries of a malloc'd array whose strings came from
            // malloc (or are NULL, which free ignores); each is freed once.
            unsafe {
                let e = msg.add(i).read();
                libc::free(e.name.cast());
                libc::free(e.msg.cast());
            }
        }
        // SAFETY: the array came from calloc and is freed once.
        unsafe { libc::free(msg.cast()) };
        Ok(0)
    })
}

/// Sends a notification to an opened segment's engine.
///
/// # Safety
/// `engine` as for every call; both strings of `notify_msg` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn genNotifyInEngine(
    engine: *mut TeEngine,
    target_id: u64,
    notify_msg: NotifyMsg,
) -> c_int {
    run("genNotifyInEngine", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        // SAFETY: `notify_msg.name` and `.msg` are NULL or NUL-terminated strings unchanged during
        // the call, as the caller guarantees; that is what `opt_str` and `c_str` need (`c_str`
        // rejects NULL).
        let (name, msg) = unsafe {
            (
                opt_str(notify_msg.name, "notify_msg.name")?,
                c_str(notify_msg.msg, "notify_msg.msg")?,
            )
        };
        let target = i32::try_from(target_id)
            .map_err(|_| Error::invalid(format!("target_id {target_id} is not a segment id")))?;
        let eng = te.engine()?;
        let name = name.unwrap_or(eng.segment_name());
        te.send_notify(eng, target, name, msg)?;
        Ok(0)
    })
}

// ---------------------------------------------------------------- diagnostics

/// Looks for RDMA NICs and logs the priority matrix the engine would use.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn discoverTopology(engine: *mut TeEngine) -> c_int {
    run("discoverTopology", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        unsafe { handle(engine)? };
        let verbs = crate::ffi::ibverbs::verbs()?;
        let nics = verbs.device_names();
        if nics.is_empty() {
            return Err(Error::new(
                Code::BackendUnavailable,
                "libibverbs finds no RDMA NIC",
            ));
        }
        log::info!(
            "discoverTopology: NICs {}; priority matrix {}",
            nics.join(", "),
            crate::transport::rdma::discovered_matrix(&nics)
        );
        Ok(0)
    })
}

/// Makes `destroyTransferEngine` wait for unfinished batches first.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn enableGracefulShutdown(engine: *mut TeEngine) {
    run("enableGracefulShutdown", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        unsafe { handle(engine)? }
            .graceful
            .store(true, Ordering::Relaxed);
        Ok(0)
    });
}

/// Writes the engine's protocol and opened segments into `buf_out`.
///
/// # Safety
/// `engine` as for every call; `buf_out` NULL or writable for `buf_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn showLinks(
    engine: *mut TeEngine,
    buf_out: *mut c_char,
    buf_len: usize,
    json: c_int,
) -> c_int {
    run("showLinks", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let (own, protocol, shm) = match te.engine.get() {
            Some(e) => (
                e.segment_name().to_owned(),
                e.protocol().name(),
                e.same_host_shm(),
            ),
            None => (String::new(), "(not started)", false),
        };
        let mut opened: Vec<(i32, String)> = te
            .segments
            .locked()
            .ids
            .iter()
            .map(|(&id, o)| (id, o.name.clone()))
            .collect();
        opened.sort();
        let text = if json != 0 {
            Value::object([
                ("local_segment", Value::from(own)),
                ("protocol", Value::from(protocol)),
                ("same_host_shm", Value::Bool(shm)),
                (
                    "segments",
                    Value::Array(
                        opened
                            .into_iter()
                            .map(|(id, name)| {
                                Value::object([
                                    ("id", Value::from(i64::from(id))),
                                    ("name", Value::from(name)),
                                ])
                            })
                            .collect(),
                    ),
                ),
            ])
            .to_string()
        } else {
            let mut s = format!(
                "local segment {own}, protocol {protocol}, same-host shared memory {}\n",
                if shm { "on" } else { "off" }
            );
            for (id, name) in opened {
                s.push_str(&format!("segment {id} {name}\n"));
            }
            s
        };
        // SAFETY: the caller guarantees `buf_out` is NULL or writable for `buf_len` bytes, which is
        // `write_out`'s contract (it rejects NULL).
        unsafe { write_out(&text, buf_out, buf_len, "the links") }
    })
}

/// Per-NIC load: not tracked by this engine, so `ERR_NOT_IMPLEMENTED`.
///
/// # Safety
/// `engine` as for every call.
#[no_mangle]
pub unsafe extern "C" fn getNicLoadStats(
    engine: *mut TeEngine,
    _buf_out: *mut c_char,
    _buf_len: usize,
) -> c_int {
    run("getNicLoadStats", || {
        // SAFETY: the caller guarantees `engine` is NULL or a live handle from createTransferEngine
        // that destroyTransferEngine is not freeing concurrently (transfer_engine_c.h), which is
        // what `handle` needs.
        let te = unsafe { handle(engine)? };
        let protocol = te.engine.get().map_or(te.config.protocol, Engine::protocol);
        Err(Error::new(
            Code::NotSupported,
            format!(
                "per-NIC load statistics are not tracked (protocol {}{})",
                protocol.name(),
                if matches!(protocol, Protocol::Rdma | Protocol::Fabric) {
                    ""
                } else {
                    ", no RDMA NICs in use"
                }
            ),
        ))
    })
}
