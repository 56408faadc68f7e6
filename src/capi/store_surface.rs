//! Revision 7 of the store ABI: put and get sessions with ranged transfers, extra
//! segments (allocated or mapped from a file), the disk tier's drain, copy and move
//! tasks, and the count of reads staged from a disk tier. Same translation rules as
//! `store.rs`: every rule lives in the client.

use std::ffi::{c_char, c_int, c_void};
use std::time::Duration;

use super::args::{answer_text, array, array_mut, c_str, copy_out, non_null};
use super::store::{batch_keys, key, replicate_config, store, store_guard};
use super::store_batch::{per_key, per_key_ranges, put_options, McPutOptions};
use super::{McReplicateConfig, McStore, MC_OK};
use crate::error::{Code, Error, Result};
use crate::json::Value;
use crate::store::client::{Backing, TaskInfo, TaskKind, TaskStatus};

/// Reserves `n` keys of `sizes[i]` bytes for a put session; per key 0 or a negative
/// code.
///
/// # Safety
/// `s` a live store; `keys`, `sizes` and `results` NULL (only with `n == 0`) or arrays
/// of `n`; each key NULL or NUL-terminated; `cfg` NULL or a valid
/// `mc_replicate_config`; `opts` NULL or a valid `mc_put_options`.
#[no_mangle]
pub unsafe extern "C" fn mc_store_put_session_start(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    sizes: *const u64,
    cfg: *const McReplicateConfig,
    opts: *const McPutOptions,
    results: *mut c_int,
) -> c_int {
    store_guard("mc_store_put_session_start", || {
        // SAFETY: the caller guarantees `sizes` NULL only with `n == 0` or `n` readable
        // u64s, `cfg` NULL or valid and `opts` NULL or valid: the contracts of `array`,
        // `replicate_config` and `put_options`.
        let (sizes, mut cfg, (groups, upsert)) = unsafe {
            (
                array(sizes, n, "sizes")?,
                replicate_config(cfg)?,
                put_options(opts)?,
            )
        };
        if upsert {
            return Err(Error::invalid("a put session cannot upsert"));
        }
        cfg.group_ids = groups;
        // SAFETY: this fn's contract covers `per_key`'s.
        unsafe {
            per_key(s, keys, n, results, |client, good, index| {
                let sizes: Vec<u64> = index.iter().map(|&i| sizes[i]).collect();
                client.put_session_start(good, &sizes, &cfg)
            })
        }
    })
}

/// Writes byte ranges into objects of open put sessions; per key the bytes written or
/// a negative code.
///
/// # Safety
/// As `mc_store_batch_get_ranges`, with each buffer readable for its length.
#[no_mangle]
pub unsafe extern "C" fn mc_store_put_session_write(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    bufs: *const *const c_void,
    offsets: *const u64,
    lens: *const u64,
    counts: *const usize,
    results: *mut i64,
) -> c_int {
    store_guard("mc_store_put_session_write", || {
        // SAFETY: this fn's contract covers `per_key_ranges`'s; every buffer left is
        // readable for its length during the call.
        unsafe {
            per_key_ranges(
                s,
                keys,
                n,
                bufs,
                offsets,
                lens,
                counts,
                results,
                |c, k, r| c.put_session_write(k, r),
            )
        }
    })
}

/// Makes the objects of put sessions readable and ends the sessions; per key 0 or a
/// negative code.
///
/// # Safety
/// `s` a live store; `keys` and `results` NULL (only with `n == 0`) or arrays of `n`;
/// each key NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mc_store_put_session_end(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    results: *mut c_int,
) -> c_int {
    store_guard("mc_store_put_session_end", || {
        // SAFETY: this fn's contract is `per_key`'s.
        unsafe { per_key(s, keys, n, results, |c, k, _| c.put_session_end(k)) }
    })
}

/// Drops the objects of put sessions and ends the sessions; per key 0 or a negative
/// code.
///
/// # Safety
/// As `mc_store_put_session_end`.
#[no_mangle]
pub unsafe extern "C" fn mc_store_put_session_revoke(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    results: *mut c_int,
) -> c_int {
    store_guard("mc_store_put_session_revoke", || {
        // SAFETY: this fn's contract is `per_key`'s.
        unsafe { per_key(s, keys, n, results, |c, k, _| c.put_session_revoke(k)) }
    })
}

/// Opens get sessions; per key 0 or a negative code.
///
/// # Safety
/// As `mc_store_put_session_end`.
#[no_mangle]
pub unsafe extern "C" fn mc_store_get_session_start(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    results: *mut c_int,
) -> c_int {
    store_guard("mc_store_get_session_start", || {
        // SAFETY: this fn's contract is `per_key`'s.
        unsafe { per_key(s, keys, n, results, |c, k, _| c.get_session_start(k)) }
    })
}

/// Reads byte ranges of objects with get sessions; per key the bytes read or a
/// negative code.
///
/// # Safety
/// As `mc_store_batch_get_ranges`.
#[no_mangle]
pub unsafe extern "C" fn mc_store_get_session_read(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    bufs: *const *mut c_void,
    offsets: *const u64,
    lens: *const u64,
    counts: *const usize,
    results: *mut i64,
) -> c_int {
    store_guard("mc_store_get_session_read", || {
        // SAFETY: this fn's contract covers `per_key_ranges`'s; every buffer left is
        // writable for its length, and untouched by others, during the call.
        unsafe {
            per_key_ranges(
                s,
                keys,
                n,
                bufs.cast(),
                offsets,
                lens,
                counts,
                results,
                |c, k, r| c.get_session_read(k, r),
            )
        }
    })
}

/// Ends the get sessions of `n` keys (NULL keys and keys without one are skipped).
///
/// # Safety
/// `s` a live store; `keys` NULL (only with `n == 0`) or an array of `n`, each NULL or
/// NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mc_store_get_session_end(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
) -> c_int {
    store_guard("mc_store_get_session_end", || {
        // SAFETY: the caller guarantees a live store and `keys` NULL only with `n == 0` or
        // `n` readable pointers.
        let (client, keys) = unsafe { (store(s)?, array(keys, n, "keys")?) };
        // SAFETY: each key is NULL or NUL-terminated.
        let good: Vec<&str> = unsafe { batch_keys(keys, |_| false) }
            .into_iter()
            .flatten()
            .collect();
        client.get_session_end(&good);
        Ok(MC_OK)
    })
}

/// Copies a segment id into `id_buf[..id_len]` (NUL-terminated).
///
/// # Safety
/// `id_buf` NULL or writable for `id_len` bytes.
unsafe fn give_id(id: &str, id_buf: *mut c_char, id_len: usize) -> Result<()> {
    non_null(id_buf, "id_buf")?;
    // SAFETY: non-null and writable for `id_len` bytes, per the caller.
    if unsafe { copy_out(id, id_buf, id_len) } {
        Ok(())
    } else {
        Err(Error::new(
            Code::BufferOverflow,
            format!(
                "segment id needs {} bytes, id_buf has {id_len}",
                id.len() + 1
            ),
        ))
    }
}

/// `location` as a string; NULL means host memory.
///
/// # Safety
/// NULL or NUL-terminated.
unsafe fn location<'a>(p: *const c_char) -> Result<&'a str> {
    if p.is_null() {
        return Ok("");
    }
    // SAFETY: non-null and NUL-terminated, per the caller.
    unsafe { c_str(p, "location") }
}

/// Allocates `size` bytes (rounded up) at `location` and lends them to the pool as an
/// extra segment: its id into `id_buf`, the bytes allocated into `*allocated_out`.
///
/// # Safety
/// `s` a live store; `location` NULL or NUL-terminated; `id_buf` NULL or writable for
/// `id_len` bytes; `allocated_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_store_allocate_segment(
    s: *mut McStore,
    size: u64,
    location_name: *const c_char,
    id_buf: *mut c_char,
    id_len: usize,
    allocated_out: *mut u64,
) -> c_int {
    store_guard("mc_store_allocate_segment", || {
        // SAFETY: the caller guarantees a live store and `location_name` NULL or
        // NUL-terminated.
        let (client, loc) = unsafe { (store(s)?, location(location_name)?) };
        non_null(id_buf, "id_buf")?;
        non_null(allocated_out, "allocated_out")?;
        let (id, allocated) = client.allocate_segment(size, loc)?;
        // SAFETY: `id_buf` is writable for `id_len` bytes, per the caller.
        if let Err(e) = unsafe { give_id(&id, id_buf, id_len) } {
            // The caller cannot name it: give it back.
            let _ = client.unmount_segment(&id, Backing::Allocated, Duration::ZERO);
            return Err(e);
        }
        // SAFETY: non-null (checked) and writable, per the caller.
        unsafe { *allocated_out = allocated };
        Ok(MC_OK)
    })
}

/// Maps `size` bytes of the file at `path` from `offset` and lends them to the pool as
/// an extra segment: its id into `id_buf`.
///
/// # Safety
/// `s` a live store; `path` and `location` NULL or NUL-terminated; `id_buf` NULL or
/// writable for `id_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn mc_store_mount_file_segment(
    s: *mut McStore,
    path: *const c_char,
    offset: u64,
    size: u64,
    location_name: *const c_char,
    id_buf: *mut c_char,
    id_len: usize,
) -> c_int {
    store_guard("mc_store_mount_file_segment", || {
        // SAFETY: the caller guarantees a live store and `path` and `location_name` NULL
        // or NUL-terminated.
        let (client, path, loc) =
            unsafe { (store(s)?, c_str(path, "path")?, location(location_name)?) };
        non_null(id_buf, "id_buf")?;
        let id = client.mount_file_segment(path, offset, size, loc)?;
        // SAFETY: `id_buf` is writable for `id_len` bytes, per the caller.
        if let Err(e) = unsafe { give_id(&id, id_buf, id_len) } {
            let _ = client.unmount_segment(&id, Backing::Mapped, Duration::ZERO);
            return Err(e);
        }
        Ok(MC_OK)
    })
}

/// Unmounts extra segment `id` of `backing`'s kind after `grace_ms`.
///
/// # Safety
/// `s` a live store; `id` NULL or NUL-terminated.
unsafe fn unmount(
    s: *mut McStore,
    id: *const c_char,
    backing: Backing,
    grace_ms: u64,
) -> Result<c_int> {
    // SAFETY: the caller guarantees a live store and `id` NULL or NUL-terminated.
    let (client, id) = unsafe { (store(s)?, c_str(id, "segment id")?) };
    client.unmount_segment(id, backing, Duration::from_millis(grace_ms))?;
    Ok(MC_OK)
}

/// Unmounts a segment of `mc_store_mount_file_segment` (at once, or after `grace_ms`)
/// and unmaps it.
///
/// # Safety
/// `s` a live store; `id` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mc_store_unmount_file_segment(
    s: *mut McStore,
    id: *const c_char,
    grace_ms: u64,
) -> c_int {
    store_guard("mc_store_unmount_file_segment", || {
        // SAFETY: this fn's contract is `unmount`'s.
        unsafe { unmount(s, id, Backing::Mapped, grace_ms) }
    })
}

/// Unmounts a segment of `mc_store_allocate_segment` (at once, or after `grace_ms`) and
/// frees its memory.
///
/// # Safety
/// `s` a live store; `id` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mc_store_unmount_allocated_segment(
    s: *mut McStore,
    id: *const c_char,
    grace_ms: u64,
) -> c_int {
    store_guard("mc_store_unmount_allocated_segment", || {
        // SAFETY: this fn's contract is `unmount`'s.
        unsafe { unmount(s, id, Backing::Allocated, grace_ms) }
    })
}

/// Gives up the store's disk tier after `grace_ms` (waiting it out): 0, or 1 when the
/// store has none (nothing done).
///
/// # Safety
/// `s` a live store.
#[no_mangle]
pub unsafe extern "C" fn mc_store_drain_disk_tier(s: *mut McStore, grace_ms: u64) -> c_int {
    store_guard("mc_store_drain_disk_tier", || {
        // SAFETY: the caller guarantees a live store.
        let client = unsafe { store(s)? };
        Ok(
            match client.drain_disk_tier(Duration::from_millis(grace_ms)) {
                true => MC_OK,
                false => 1,
            },
        )
    })
}

/// Writes a task id into `id_out[0..2]`.
///
/// # Safety
/// `id_out` NULL or writable for two u64s.
unsafe fn give_task(id: (u64, u64), id_out: *mut u64) -> Result<c_int> {
    // SAFETY: the caller guarantees `id_out` NULL or two writable u64s.
    let out = unsafe { array_mut(id_out, 2, "id_out")? };
    out[0] = id.0;
    out[1] = id.1;
    Ok(MC_OK)
}

/// Starts a task copying `key` onto the `n` segments named in `targets`; its id into
/// `id_out[0..2]`.
///
/// # Safety
/// `s` a live store; `key` NULL or NUL-terminated; `targets` NULL (only with `n == 0`)
/// or `n` pointers, each NULL or NUL-terminated; `id_out` NULL or two writable u64s.
#[no_mangle]
pub unsafe extern "C" fn mc_store_create_copy_task(
    s: *mut McStore,
    k: *const c_char,
    targets: *const *const c_char,
    n: usize,
    id_out: *mut u64,
) -> c_int {
    store_guard("mc_store_create_copy_task", || {
        // SAFETY: the caller guarantees a live store, `k` NULL or NUL-terminated and
        // `targets` NULL only with `n == 0` or `n` readable pointers.
        let (client, key, targets) = unsafe { (store(s)?, key(k)?, array(targets, n, "targets")?) };
        non_null(id_out, "id_out")?;
        let names = targets
            .iter()
            // SAFETY: each is NULL (refused) or NUL-terminated.
            .map(|&t| unsafe { c_str(t, "target segment") })
            .collect::<Result<Vec<&str>>>()?;
        let id = client.create_copy_task(key, &names)?;
        // SAFETY: `id_out` is two writable u64s, per the caller.
        unsafe { give_task(id, id_out) }
    })
}

/// Starts a task moving `key`'s replica on segment `source` to segment `target`; its
/// id into `id_out[0..2]`.
///
/// # Safety
/// `s` a live store; `key`, `source` and `target` NULL or NUL-terminated; `id_out`
/// NULL or two writable u64s.
#[no_mangle]
pub unsafe extern "C" fn mc_store_create_move_task(
    s: *mut McStore,
    k: *const c_char,
    source: *const c_char,
    target: *const c_char,
    id_out: *mut u64,
) -> c_int {
    store_guard("mc_store_create_move_task", || {
        // SAFETY: the caller guarantees a live store and NULL or NUL-terminated strings.
        let (client, key, source, target) = unsafe {
            (
                store(s)?,
                key(k)?,
                c_str(source, "source segment")?,
                c_str(target, "target segment")?,
            )
        };
        non_null(id_out, "id_out")?;
        let id = client.create_move_task(key, source, target)?;
        // SAFETY: `id_out` is two writable u64s, per the caller.
        unsafe { give_task(id, id_out) }
    })
}

/// The JSON `mc_store_query_task` answers.
fn task_json(t: &TaskInfo) -> Value {
    let kind = match t.kind {
        TaskKind::Copy => "copy",
        TaskKind::Move => "move",
    };
    let status = match t.status {
        TaskStatus::Pending => "pending",
        TaskStatus::Processing => "processing",
        TaskStatus::Failed => "failed",
        TaskStatus::Success => "success",
    };
    Value::object([
        ("id", Value::Array(vec![t.id.0.into(), t.id.1.into()])),
        ("type", Value::from(kind)),
        ("status", Value::from(status)),
        ("created_at_ms", Value::from(t.created_ms)),
        ("updated_at_ms", Value::from(t.updated_ms)),
        (
            "assigned_client",
            Value::Array(vec![t.assigned_client.0.into(), t.assigned_client.1.into()]),
        ),
        ("message", Value::from(t.message.as_str())),
    ])
}

/// Task `(id_hi, id_lo)` of this store as JSON into `buf` (0), or 1 when the store
/// knows no such task (`buf` untouched).
///
/// # Safety
/// `s` a live store; `buf` NULL or writable for `len` bytes; `needed_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn mc_store_query_task(
    s: *mut McStore,
    id_hi: u64,
    id_lo: u64,
    buf: *mut c_char,
    len: usize,
    needed_out: *mut usize,
) -> c_int {
    store_guard("mc_store_query_task", || {
        // SAFETY: the caller guarantees a live store.
        let client = unsafe { store(s)? };
        let Some(task) = client.query_task((id_hi, id_lo)) else {
            return Ok(1);
        };
        let text = task_json(&task).to_string();
        // SAFETY: the caller guarantees `buf` NULL or writable for `len` bytes and
        // `needed_out` NULL or writable: `answer_text`'s contract.
        unsafe { answer_text(&text, buf, len, needed_out, "task") }
    })
}

/// How many reads got an object staged from a disk tier for them, into `*count_out`.
///
/// # Safety
/// `s` a live store; `count_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_store_disk_read_count(s: *mut McStore, count_out: *mut u64) -> c_int {
    store_guard("mc_store_disk_read_count", || {
        // SAFETY: the caller guarantees a live store.
        let client = unsafe { store(s)? };
        non_null(count_out, "count_out")?;
        // SAFETY: non-null (checked) and writable, per the caller.
        unsafe { *count_out = client.disk_reads() };
        Ok(MC_OK)
    })
}
