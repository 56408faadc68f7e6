//! Revision 2 of the store ABI: multi-buffer and ranged batches, batch removal,
//! replica clearing and descriptors, health. Same translation rules as `store.rs`.

use std::ffi::{c_char, c_int, c_void};
use std::ops::Range;

use super::args::{answer_text, array, array_mut, c_str, non_null};
use super::store::{
    batch_keys, code_of, key, replicate_config, scatter, size_results, store, store_guard,
};
use super::{McReplicateConfig, McStore, MC_OK};
use crate::error::{Error, Result};
use crate::json::Value;
use crate::store::client::Fragments;
use crate::store::protocol::ObjectDesc;
use crate::store::Client;

/// `mc_put_options`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct McPutOptions {
    /// Group ids to add every key to (`group_ids_count` entries, may be NULL when 0).
    pub group_ids: *const *const c_char,
    /// Number of entries in `group_ids`.
    pub group_ids_count: usize,
    /// Non-zero: overwrite keys that already exist instead of failing them.
    pub upsert: c_int,
}

/// Fills `*opts` with the defaults: no group, no upsert. NULL is ignored.
///
/// # Safety
/// `opts` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_put_options_init(opts: *mut McPutOptions) {
    if opts.is_null() {
        return;
    }
    // SAFETY: `opts` is non-null (checked above) and the caller guarantees a non-null `opts` is a
    // writable mc_put_options; `write` neither reads nor drops the possibly uninitialised old
    // value.
    unsafe {
        opts.write(McPutOptions {
            group_ids: std::ptr::null(),
            group_ids_count: 0,
            upsert: 0,
        })
    };
}

/// Group ids and the upsert flag of `opts` (NULL: none, no upsert).
///
/// # Safety
/// `opts` must be NULL or readable, its `group_ids` NULL or `group_ids_count` readable
/// pointers to NUL-terminated strings.
pub(super) unsafe fn put_options(opts: *const McPutOptions) -> Result<(Vec<String>, bool)> {
    if opts.is_null() {
        return Ok((Vec::new(), false));
    }
    // SAFETY: `opts` is non-null (checked above) and the caller guarantees a non-null `opts` points
    // at a readable mc_put_options, unchanged for the duration of the call.
    let o = unsafe { &*opts };
    // SAFETY: the caller guarantees `group_ids` is NULL or `group_ids_count` readable pointers,
    // unchanged during the call, which is what `array` needs (it rejects NULL with a nonzero
    // count).
    let ids = unsafe { array(o.group_ids, o.group_ids_count, "group_ids")? };
    let groups = ids
        .iter()
        // SAFETY: each is NULL (refused) or a NUL-terminated string.
        .map(|&p| unsafe { c_str(p, "group id") }.map(str::to_owned))
        .collect::<Result<_>>()?;
    Ok((groups, o.upsert != 0))
}

/// Splits `n` keys' consecutive entries by `counts`: the start of each key's run, and
/// the total number of entries.
fn runs(counts: &[usize]) -> Result<(Vec<usize>, usize)> {
    let mut starts = Vec::with_capacity(counts.len());
    let mut total = 0usize;
    for &c in counts {
        starts.push(total);
        total = total
            .checked_add(c)
            .ok_or_else(|| Error::invalid("counts overflow"))?;
    }
    Ok((starts, total))
}

/// A key whose run is empty or holds a NULL buffer (`buf_is_null` of an entry) cannot
/// be asked.
fn run_is_bad(mut run: Range<usize>, buf_is_null: impl Fn(usize) -> bool) -> bool {
    run.is_empty() || run.any(buf_is_null)
}

/// A batch whose key `i` owns the run of entries `starts[i]..starts[i] + counts[i]` of
/// its per-entry arrays (buffers, lengths, offsets).
struct KeyRuns<'a> {
    client: &'a Client,
    keys: &'a [*const c_char],
    counts: &'a [usize],
    starts: Vec<usize>,
    /// Entries over all runs: the length of every per-entry array.
    total: usize,
}

impl<'a> KeyRuns<'a> {
    /// The store, keys and runs of a batch of `n` keys.
    ///
    /// # Safety
    /// `s` a live store; `keys` and `counts` NULL (only with `n == 0`) or arrays of `n`,
    /// unchanged during `'a`.
    unsafe fn new(
        s: *mut McStore,
        keys: *const *const c_char,
        n: usize,
        counts: *const usize,
    ) -> Result<Self> {
        // SAFETY: the caller guarantees a live store (NULL rejected by `store`) and `keys` and
        // `counts` each NULL only with `n == 0` or `n` readable elements: the contracts of
        // `store` and `array`.
        let (client, keys, counts) = unsafe {
            (
                store(s)?,
                array(keys, n, "keys")?,
                array(counts, n, "counts")?,
            )
        };
        let (starts, total) = runs(counts)?;
        Ok(Self {
            client,
            keys,
            counts,
            starts,
            total,
        })
    }

    fn run(&self, key: usize) -> Range<usize> {
        self.starts[key]..self.starts[key] + self.counts[key]
    }

    /// Per key, the key or why it cannot be asked (see `batch_keys`; also an empty run
    /// or one holding a buffer for which `buf_is_null` of its entry says so).
    ///
    /// # Safety
    /// Each key NULL or NUL-terminated, unchanged during `'a`.
    unsafe fn checked_keys(&self, buf_is_null: impl Fn(usize) -> bool) -> Vec<Result<&'a str>> {
        // SAFETY: the caller guarantees each key is NULL or NUL-terminated.
        unsafe { batch_keys(self.keys, |i| run_is_bad(self.run(i), &buf_is_null)) }
    }

    /// Per key of `index`, what `entry` makes of each entry of its run.
    fn gather<E>(&self, index: &[usize], entry: impl Fn(usize) -> E) -> Vec<Vec<E>> {
        index
            .iter()
            .map(|&i| self.run(i).map(&entry).collect())
            .collect()
    }
}

/// Writes per-key 0 or codes into `results`.
fn done_results(results: &mut [c_int], answers: Vec<Result<()>>) {
    for (slot, a) in results.iter_mut().zip(answers) {
        *slot = a.map_or_else(|e| code_of(&e), |()| MC_OK);
    }
}

/// Runs `run` on the usable keys of a batch and writes per-key 0 or a code.
///
/// # Safety
/// `s` a live store; `keys` and `results` NULL (only with `n == 0`) or arrays of `n`;
/// each key NULL or NUL-terminated.
pub(super) unsafe fn per_key(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    results: *mut c_int,
    run: impl FnOnce(&Client, &[&str], &[usize]) -> Vec<Result<()>>,
) -> Result<c_int> {
    // SAFETY: the caller guarantees a live store (NULL rejected by `store`) and `keys` NULL
    // only with `n == 0` or `n` readable pointers: the contracts of `store` and `array`.
    let (client, keys) = unsafe { (store(s)?, array(keys, n, "keys")?) };
    // SAFETY: the caller guarantees `results` is NULL only with `n == 0` or `n` writable ints
    // that nothing else touches during the call (`array_mut`'s contract); it is only written,
    // never read.
    let results = unsafe { array_mut(results, n, "results")? };
    // SAFETY: each key is NULL or NUL-terminated.
    let checked = unsafe { batch_keys(keys, |_| false) };
    done_results(
        results,
        scatter(checked, |good, index| run(client, good, index)),
    );
    Ok(MC_OK)
}

/// Runs `run` on the usable keys of a ranged batch (runs of `counts[i]` ranges of
/// `bufs`, `offsets` and `lens` per key) and writes per-key bytes moved or a code.
///
/// # Safety
/// `s` a live store; `keys`, `counts` and `results` NULL (only with `n == 0`) or arrays
/// of `n`; `bufs`, `offsets` and `lens` arrays of the sum of `counts`; each key NULL or
/// NUL-terminated.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn per_key_ranges(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    bufs: *const *const c_void,
    offsets: *const u64,
    lens: *const u64,
    counts: *const usize,
    results: *mut i64,
    run: impl FnOnce(&Client, &[&str], &[Fragments]) -> Vec<Result<u64>>,
) -> Result<c_int> {
    // SAFETY: the caller guarantees a live store and `keys` and `counts` NULL only with
    // `n == 0` or `n` readable elements: `KeyRuns::new`'s contract.
    let batch = unsafe { KeyRuns::new(s, keys, n, counts)? };
    // SAFETY: the caller guarantees `bufs`, `offsets` and `lens` hold the sum of `counts`
    // elements, which is `batch.total` (overflow rejected by `runs`), so `array`'s contract
    // holds for each.
    let (bufs, offsets, lens) = unsafe {
        (
            array(bufs, batch.total, "bufs")?,
            array(offsets, batch.total, "offsets")?,
            array(lens, batch.total, "lens")?,
        )
    };
    // SAFETY: the caller guarantees `results` is NULL only with `n == 0` or `n` writable i64s
    // that nothing else touches during the call (`array_mut`'s contract); it is only written,
    // never read.
    let results = unsafe { array_mut(results, n, "results")? };
    // SAFETY: each key is NULL or NUL-terminated.
    let checked = unsafe { batch.checked_keys(|j| bufs[j].is_null()) };
    let answers = scatter(checked, |good, index| {
        let ranges = batch.gather(index, |j| (offsets[j], bufs[j] as u64, lens[j]));
        run(batch.client, good, &ranges)
    });
    size_results(results, answers);
    Ok(MC_OK)
}

/// Puts `n` keys from runs of buffers; per key 0 or a negative code in `results`.
///
/// # Safety
/// `s` a live store; `keys`, `counts` and `results` NULL (only with `n == 0`) or arrays
/// of `n`; `bufs` and `lens` arrays of the sum of `counts`; each key NULL or
/// NUL-terminated; each buffer NULL or readable for its length during the call; `cfg`
/// as for `mc_store_put`; `opts` NULL or a valid `mc_put_options`.
#[no_mangle]
pub unsafe extern "C" fn mc_store_batch_put_parts(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    bufs: *const *const c_void,
    lens: *const usize,
    counts: *const usize,
    cfg: *const McReplicateConfig,
    opts: *const McPutOptions,
    results: *mut c_int,
) -> c_int {
    store_guard("mc_store_batch_put_parts", || {
        // SAFETY: the caller guarantees a live store and `keys` and `counts` NULL only with
        // `n == 0` or `n` readable elements: `KeyRuns::new`'s contract.
        let batch = unsafe { KeyRuns::new(s, keys, n, counts)? };
        // SAFETY: the caller guarantees `bufs` and `lens` hold the sum of `counts` elements, which
        // is `batch.total` (overflow rejected by `runs`), so `array`'s contract holds for both.
        let (bufs, lens) = unsafe {
            (
                array(bufs, batch.total, "bufs")?,
                array(lens, batch.total, "lens")?,
            )
        };
        // SAFETY: the caller guarantees `cfg` is NULL or valid as for mc_store_put and `opts` NULL
        // or a valid mc_put_options: the contracts of `replicate_config` and `put_options`.
        let (mut cfg, (groups, upsert)) = unsafe { (replicate_config(cfg)?, put_options(opts)?) };
        cfg.group_ids = groups;
        // SAFETY: the caller guarantees `results` is NULL only with `n == 0` or `n` writable ints
        // that nothing else touches during the call (`array_mut`'s contract); it is only written,
        // never read.
        let results = unsafe { array_mut(results, n, "results")? };
        // SAFETY: each key is NULL or NUL-terminated.
        let checked = unsafe { batch.checked_keys(|j| bufs[j].is_null()) };
        let answers = scatter(checked, |good, index| {
            let parts = batch.gather(index, |j| (bufs[j] as u64, lens[j] as u64));
            // SAFETY: every buffer left is readable for its length during the call.
            unsafe { batch.client.batch_put_from(good, &parts, &cfg, upsert) }
        });
        done_results(results, answers);
        Ok(MC_OK)
    })
}

/// Reads `n` keys into runs of buffers; per key the object's size or a negative code.
///
/// # Safety
/// `s` a live store; `keys`, `counts` and `results` NULL (only with `n == 0`) or arrays
/// of `n`; `bufs` and `caps` arrays of the sum of `counts`; each key NULL or
/// NUL-terminated; each buffer NULL or writable for its capacity, untouched by others
/// during the call, and not overlapping another.
#[no_mangle]
pub unsafe extern "C" fn mc_store_batch_get_parts(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    bufs: *const *mut c_void,
    caps: *const usize,
    counts: *const usize,
    results: *mut i64,
) -> c_int {
    store_guard("mc_store_batch_get_parts", || {
        // SAFETY: the caller guarantees a live store and `keys` and `counts` NULL only with
        // `n == 0` or `n` readable elements: `KeyRuns::new`'s contract.
        let batch = unsafe { KeyRuns::new(s, keys, n, counts)? };
        // SAFETY: the caller guarantees `bufs` and `caps` hold the sum of `counts` elements, which
        // is `batch.total` (overflow rejected by `runs`), so `array`'s contract holds for both.
        let (bufs, caps) = unsafe {
            (
                array(bufs, batch.total, "bufs")?,
                array(caps, batch.total, "caps")?,
            )
        };
        // SAFETY: the caller guarantees `results` is NULL only with `n == 0` or `n` writable i64s
        // that nothing else touches during the call (`array_mut`'s contract); it is only written,
        // never read.
        let results = unsafe { array_mut(results, n, "results")? };
        // SAFETY: each key is NULL or NUL-terminated.
        let checked = unsafe { batch.checked_keys(|j| bufs[j].is_null()) };
        let answers = scatter(checked, |good, index| {
            let parts = batch.gather(index, |j| (bufs[j] as u64, caps[j] as u64));
            // SAFETY: every buffer left is writable for its capacity during the call.
            unsafe { batch.client.batch_get_into(good, &parts) }
        });
        size_results(results, answers);
        Ok(MC_OK)
    })
}

/// Reads byte ranges of `n` keys; per key the bytes read or a negative code.
///
/// # Safety
/// `s` a live store; `keys`, `counts` and `results` NULL (only with `n == 0`) or arrays
/// of `n`; `bufs`, `offsets` and `lens` arrays of the sum of `counts`; each key NULL or
/// NUL-terminated; each buffer NULL or writable for its length, untouched by others
/// during the call, and not overlapping another.
#[no_mangle]
pub unsafe extern "C" fn mc_store_batch_get_ranges(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    bufs: *const *mut c_void,
    offsets: *const u64,
    lens: *const u64,
    counts: *const usize,
    results: *mut i64,
) -> c_int {
    store_guard("mc_store_batch_get_ranges", || {
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
                |c, k, r| c.batch_get_ranges(k, r),
            )
        }
    })
}

/// Removes `n` keys; per key 0 or a negative code in `results`.
///
/// # Safety
/// `s` a live store; `keys` and `results` NULL (only with `n == 0`) or arrays of `n`;
/// each key NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mc_store_batch_remove(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    force: c_int,
    results: *mut c_int,
) -> c_int {
    store_guard("mc_store_batch_remove", || {
        // SAFETY: this fn's contract is `per_key`'s.
        unsafe { per_key(s, keys, n, results, |c, k, _| c.batch_remove(k, force != 0)) }
    })
}

/// Drops replicas of `n` keys on `segment` (NULL or "": all); per key 1, 0 or a
/// negative code in `results`.
///
/// # Safety
/// `s` a live store; `keys` and `results` NULL (only with `n == 0`) or arrays of `n`;
/// each key NULL or NUL-terminated; `segment` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mc_store_batch_replica_clear(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    segment: *const c_char,
    results: *mut c_int,
) -> c_int {
    store_guard("mc_store_batch_replica_clear", || {
        // SAFETY: the caller guarantees a live store (NULL rejected by `store`) and `keys` NULL
        // only with `n == 0` or `n` readable pointers: the contracts of `store` and `array`.
        let (client, keys) = unsafe { (store(s)?, array(keys, n, "keys")?) };
        let segment = match segment.is_null() {
            true => "",
            // SAFETY: `segment` is non-null (this match arm) and the caller guarantees a non-null
            // `segment` is a NUL-terminated string unchanged during the call, as `c_str` requires.
            false => unsafe { c_str(segment, "segment")? },
        };
        // SAFETY: the caller guarantees `results` is NULL only with `n == 0` or `n` writable ints
        // that nothing else touches during the call (`array_mut`'s contract); it is only written,
        // never read.
        let results = unsafe { array_mut(results, n, "results")? };
        // SAFETY: each key is NULL or NUL-terminated.
        let checked = unsafe { batch_keys(keys, |_| false) };
        let answers = scatter(checked, |good, _| client.batch_replica_clear(good, segment));
        for (slot, a) in results.iter_mut().zip(answers) {
            *slot = a.map_or_else(|e| code_of(&e), c_int::from);
        }
        Ok(MC_OK)
    })
}

/// The JSON `mc_store_replica_desc` gives for an object.
fn replica_json(d: &ObjectDesc, disk: Option<&str>) -> Value {
    // A copy in a node's disk tier is upstream's LOCAL_DISK replica.
    let on_disk = disk.map(|segment| {
        Value::object([
            ("kind", Value::from("local_disk")),
            ("status", Value::from("complete")),
            ("segment", Value::from(segment)),
            ("object_size", d.size.into()),
        ])
    });
    let replicas = d.replicas.iter().map(|r| {
        let pieces = r.pieces.iter().map(|p| {
            Value::object([
                ("segment", Value::from(&*p.segment)),
                ("addr", p.addr.into()),
                ("len", p.len.into()),
            ])
        });
        Value::object([
            ("kind", Value::from("memory")),
            ("status", Value::from("complete")),
            ("pieces", Value::Array(pieces.collect())),
        ])
    });
    Value::object([
        ("size", Value::from(d.size)),
        ("replicas", Value::Array(replicas.chain(on_disk).collect())),
    ])
}

/// Where `key` lives, as JSON into `buf[..len]`.
///
/// # Safety
/// `s` a live store; `key` NULL or NUL-terminated; `buf` NULL or writable for `len`
/// bytes; `needed_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_store_replica_desc(
    s: *mut McStore,
    k: *const c_char,
    buf: *mut c_char,
    len: usize,
    needed_out: *mut usize,
) -> c_int {
    store_guard("mc_store_replica_desc", || {
        // SAFETY: the caller guarantees `s` is NULL or a live store not being freed and `k` NULL or
        // a NUL-terminated string, which is what `store` and `key` need (both reject NULL).
        let (client, key) = unsafe { (store(s)?, key(k)?) };
        let (desc, disk) = client.describe(key)?;
        let text = replica_json(&desc, disk.as_deref()).to_string();
        // SAFETY: the caller guarantees `buf` is NULL or writable for `len` bytes and `needed_out`
        // NULL or writable, which is exactly `answer_text`'s contract (it rejects a NULL `buf` with
        // `len > 0`).
        unsafe { answer_text(&text, buf, len, needed_out, "replica descriptor") }
    })
}

/// 0 when the master answers, else a negative code.
///
/// # Safety
/// `s` a live store.
#[no_mangle]
pub unsafe extern "C" fn mc_store_health(s: *mut McStore) -> c_int {
    store_guard("mc_store_health", || {
        // SAFETY: the caller guarantees `s` is NULL or a live store not freed during the call
        // (mooncake.h), which is what `store` needs.
        unsafe { store(s)? }.health()?;
        Ok(MC_OK)
    })
}

/// Reads the object under `key` into memory the library allocates: its address into
/// `*buf_out` and size into `*len_out`; release it with `mc_store_buffer_free`.
///
/// # Safety
/// `s` a live store; `key` NULL or NUL-terminated; `buf_out` and `len_out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn mc_store_get_buffer(
    s: *mut McStore,
    k: *const c_char,
    buf_out: *mut *mut c_void,
    len_out: *mut u64,
) -> c_int {
    store_guard("mc_store_get_buffer", || {
        // SAFETY: the caller guarantees `s` is NULL or a live store not being freed and `k` NULL or
        // a NUL-terminated string, which is what `store` and `key` need (both reject NULL).
        let (client, key) = unsafe { (store(s)?, key(k)?) };
        non_null(buf_out, "buf_out")?;
        non_null(len_out, "len_out")?;
        let bytes = client.get(key)?.into_boxed_slice();
        let len = bytes.len() as u64;
        // SAFETY: `buf_out` and `len_out` are non-null (checked above) and the caller guarantees
        // non-null ones are writable; `mc_store_buffer_free` rebuilds the box from this pointer and
        // `len`.
        unsafe {
            *buf_out = Box::into_raw(bytes).cast::<c_void>();
            *len_out = len;
        }
        Ok(MC_OK)
    })
}

/// `mc_alloc_fn`: the memory for key `index` of a batch read, `size` bytes (NULL: none).
pub type McAllocFn = unsafe extern "C" fn(ctx: *mut c_void, index: usize, size: u64) -> *mut c_void;

/// Reads `n` keys into memory `alloc` gives once each size is known (one master round
/// trip for all): per key in `results` the size read or a negative code.
///
/// # Safety
/// `s` a live store; `keys` and `results` NULL (only with `n == 0`) or arrays of `n`;
/// each key NULL or NUL-terminated; `alloc` NULL or a function that returns NULL or
/// `size` bytes writable, and untouched by others, until this returns.
#[no_mangle]
pub unsafe extern "C" fn mc_store_batch_get_alloc(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    alloc: Option<McAllocFn>,
    ctx: *mut c_void,
    results: *mut i64,
) -> c_int {
    store_guard("mc_store_batch_get_alloc", || {
        // SAFETY: the caller guarantees a live store (NULL rejected by `store`) and `keys` NULL
        // only with `n == 0` or `n` readable pointers: the contracts of `store` and `array`.
        let (client, keys) = unsafe { (store(s)?, array(keys, n, "keys")?) };
        let alloc = alloc.ok_or_else(|| Error::invalid("alloc is NULL"))?;
        // SAFETY: the caller guarantees `results` is NULL only with `n == 0` or `n` writable
        // elements nothing else touches during the call (`array_mut`'s contract); only written.
        let results = unsafe { array_mut(results, n, "results")? };
        // SAFETY: each key is NULL or NUL-terminated.
        let checked = unsafe { batch_keys(keys, |_| false) };
        let answers = scatter(checked, |good, index| {
            let mut place = |j: usize, size: u64| {
                // SAFETY: the caller's function, called as its contract says; it returns NULL
                // or `size` bytes kept writable until this call returns.
                let p = unsafe { alloc(ctx, index[j], size) };
                (!p.is_null()).then_some(p as u64)
            };
            // SAFETY: `place` hands out only what `alloc` promised (see above).
            unsafe { client.batch_get_placed(good, &mut place) }
        });
        for (slot, a) in results.iter_mut().zip(answers) {
            *slot = a.map_or_else(|e| i64::from(code_of(&e)), |size| size as i64);
        }
        Ok(MC_OK)
    })
}

/// Releases memory from `mc_store_get_buffer`; NULL is ignored.
///
/// # Safety
/// `buf` must be NULL or come, with this `len`, from `mc_store_get_buffer`, freed once.
#[no_mangle]
pub unsafe extern "C" fn mc_store_buffer_free(buf: *mut c_void, len: u64) {
    if buf.is_null() {
        return;
    }
    super::guard_value("mc_store_buffer_free", (), || {
        let slice = std::ptr::slice_from_raw_parts_mut(buf.cast::<u8>(), len as usize);
        // SAFETY: from `Box::into_raw` of a boxed slice of `len` bytes, per the contract.
        drop(unsafe { Box::from_raw(slice) });
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_consecutive_entries() {
        assert_eq!(runs(&[2, 0, 3]).unwrap(), (vec![0, 2, 2], 5));
        assert!(runs(&[usize::MAX, 1]).is_err());
        let null = |j: usize| j == 1;
        assert!(!run_is_bad(0..1, null));
        assert!(run_is_bad(0..2, null));
        assert!(run_is_bad(2..2, null));
    }

    #[test]
    fn replica_json_lists_pieces_in_order() {
        use crate::store::protocol::{Piece, ReplicaDesc};
        let d = ObjectDesc {
            size: 10,
            crc32c: 0,
            lease_ms: 1,
            replicas: vec![ReplicaDesc {
                pieces: vec![
                    Piece {
                        segment: "a:1".into(),
                        addr: 4096,
                        len: 6,
                    },
                    Piece {
                        segment: "b:2".into(),
                        addr: 8192,
                        len: 4,
                    },
                ]
                .into(),
            }]
            .into(),
        };
        assert_eq!(
            replica_json(&d, None).to_string(),
            r#"{"size":10,"replicas":[{"kind":"memory","status":"complete","pieces":[{"segment":"a:1","addr":4096,"len":6},{"segment":"b:2","addr":8192,"len":4}]}]}"#
        );
        // A disk tier's copy comes last, as upstream's LOCAL_DISK replica.
        let only_disk = ObjectDesc {
            replicas: Default::default(),
            ..d
        };
        assert_eq!(
            replica_json(&only_disk, Some("c:3")).to_string(),
            r#"{"size":10,"replicas":[{"kind":"local_disk","status":"complete","segment":"c:3","object_size":10}]}"#
        );
    }
}
