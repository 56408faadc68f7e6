//! `mc_store_*`: the store [`Client`] behind an opaque pointer, and the store keys of
//! `mc_config`.
//!
//! The shims only translate: C strings and arrays into Rust values, per-key results
//! into codes. Every rule (key checks, sizes, leases, replicas) lives in the client and
//! the master, so the C ABI and the Rust API answer alike.

use std::ffi::{c_char, c_int, c_void};

use super::args::{self, array, array_mut, c_str, copy_out, non_null};
use super::process_bound::ProcessBound;
use super::{guard, guard_value, init_logging, McConfig, MC_OK};
use crate::engine::config::KEYS;
use crate::engine::EngineConfig;
use crate::error::{Code, Error, Result};
use crate::store::client::Parts;
use crate::store::protocol::{check_key, DEFAULT_SOFT_PIN_TTL_MS, MAX_KEY_LEN};
use crate::store::{Client, ClientConfig, ReplicateConfig};

/// `MC_STORE_MAX_KEY_LEN`: the longest key, in bytes.
pub const MC_STORE_MAX_KEY_LEN: usize = MAX_KEY_LEN;

/// Keys of `mc_config_set` that only the store reads, documented in `mooncake.h`. The
/// store also reads the engine keys (`metadata`, `protocol`, ... see [`KEYS`]).
pub const STORE_CONFIG_KEYS: &[&str] = &[
    "master_address",
    "local_hostname",
    "global_segment_size",
    "local_buffer_size",
    "verify_checksum",
    "prefault_segment",
    "ssd_path",
    "ssd_size",
];

/// The store's part of an `mc_config`: what [`ClientConfig`] has beyond the engine.
#[derive(Clone, Debug, Default)]
pub(crate) struct StoreSettings {
    /// Its `engine`, `metadata`, `protocol` and `local_hostname` are taken from the
    /// engine settings when a store starts.
    client: ClientConfig,
    /// Whether `metadata` was set: if not, a store uses its master's embedded server.
    metadata_set: bool,
    /// `ssd_path` and `ssd_size` (both, for a disk tier).
    ssd_path: Option<String>,
    ssd_size: u64,
}

/// A store switch's value (`util::switch`: 1, true, on; 0, false, off).
fn store_switch(key: &str, value: &str) -> Result<bool> {
    crate::util::switch::parse(value)
        .ok_or_else(|| Error::invalid(format!("config {key}: {value:?} (1 or 0)")))
}

fn store_size(key: &str, value: &str) -> Result<u64> {
    crate::util::size::parse(value).map_err(|e| Error::invalid(format!("config {key}: {e}")))
}

impl StoreSettings {
    /// Applies one `mc_config_set` key: a store key here, any other to `engine`.
    pub(crate) fn set(&mut self, engine: &mut EngineConfig, key: &str, value: &str) -> Result<()> {
        let c = &mut self.client;
        match key {
            "master_address" => {
                if value.is_empty() {
                    return Err(Error::invalid("config master_address: empty"));
                }
                c.master_address = value.to_owned();
            }
            "local_hostname" => engine.set("local_server_name", value)?,
            "global_segment_size" => c.global_segment_size = store_size(key, value)?,
            "local_buffer_size" => c.local_buffer_size = store_size(key, value)?,
            "ssd_path" => self.ssd_path = Some(value.to_owned()).filter(|v| !v.is_empty()),
            "ssd_size" => self.ssd_size = store_size(key, value)?,
            "verify_checksum" => c.verify_checksum = store_switch(key, value)?,
            "prefault_segment" => c.prefault_segment = store_switch(key, value)?,
            "metadata" | "metadata_server" => {
                engine.set(key, value)?;
                self.metadata_set = true;
            }
            _ if KEYS.contains(&key) => engine.set(key, value)?,
            _ => {
                return Err(Error::invalid(format!(
                    "unknown config key {key:?} (engine: {}; store: {})",
                    KEYS.join(", "),
                    STORE_CONFIG_KEYS.join(", ")
                )))
            }
        }
        Ok(())
    }

    /// The client settings these and the engine settings describe.
    fn client_config(&self, engine: &EngineConfig) -> ClientConfig {
        let mut c = self.client.clone();
        c.engine = engine.clone();
        if let (Some(dir), size) = (&self.ssd_path, self.ssd_size) {
            // Without a size: four times the segment, at least 1 GiB.
            let quota = if size > 0 {
                size
            } else {
                c.global_segment_size.saturating_mul(4).max(1 << 30)
            };
            c.disk = Some(crate::store::disk::DiskConfig::new(dir, quota));
        }
        if !self.metadata_set {
            c.engine.metadata = crate::store::default_metadata(&c.master_address);
        }
        c
    }
}

/// `mc_store`: a connected store client behind an opaque pointer.
pub struct McStore {
    client: ProcessBound<Client>,
}

// The header promises that one store may be used from many threads at once.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<Client>();
};

/// `mc_replicate_config` (48 bytes on 64-bit targets).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct McReplicateConfig {
    /// Copies to keep (at least 1).
    pub replica_num: u32,
    /// Non-zero: never evicted.
    pub hard_pin: c_int,
    /// Non-zero: evicted only after unpinned objects, until the TTL passes.
    pub soft_pin: c_int,
    /// The soft pin's lifetime in milliseconds (0: the default).
    pub soft_pin_ttl_ms: u64,
    /// Segment names to place replicas on first (`preferred_segments_count` entries).
    pub preferred_segments: *const *const c_char,
    /// Number of entries in `preferred_segments`.
    pub preferred_segments_count: usize,
    /// Non-zero: prefer the caller's own node for the first replica.
    pub prefer_same_node: c_int,
}

/// Fills `*cfg` with the defaults: 1 replica, no pins, a 30 min soft-pin TTL, no
/// preferences. NULL is ignored.
///
/// # Safety
/// `cfg` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_replicate_config_init(cfg: *mut McReplicateConfig) {
    if cfg.is_null() {
        return;
    }
    let d = ReplicateConfig::default();
    debug_assert_eq!(d.soft_pin_ttl_ms, DEFAULT_SOFT_PIN_TTL_MS);
    // SAFETY: `cfg` is non-null (checked above) and the caller guarantees a non-null `cfg` is a
    // writable mc_replicate_config; `write` neither reads nor drops the possibly uninitialised old
    // value.
    unsafe {
        cfg.write(McReplicateConfig {
            replica_num: d.replica_num,
            hard_pin: d.hard_pin.into(),
            soft_pin: d.soft_pin.into(),
            soft_pin_ttl_ms: d.soft_pin_ttl_ms,
            preferred_segments: std::ptr::null(),
            preferred_segments_count: 0,
            prefer_same_node: d.prefer_same_node.into(),
        })
    };
}

/// The replication settings a `mc_replicate_config` describes; NULL gives the defaults.
///
/// # Safety
/// `cfg` must be NULL or readable, its `preferred_segments` NULL or
/// `preferred_segments_count` readable pointers to NUL-terminated strings.
pub(super) unsafe fn replicate_config(cfg: *const McReplicateConfig) -> Result<ReplicateConfig> {
    if cfg.is_null() {
        return Ok(ReplicateConfig::default());
    }
    // SAFETY: `cfg` is non-null (checked above) and the caller guarantees a non-null `cfg` points
    // at a readable mc_replicate_config, unchanged for the duration of the call.
    let c = unsafe { &*cfg };
    if c.replica_num == 0 {
        return Err(Error::invalid(
            "replica_num is 0 (at least 1; see mc_replicate_config_init)",
        ));
    }
    // SAFETY: the caller guarantees `preferred_segments` is NULL or `preferred_segments_count`
    // readable pointers, unchanged during the call, which is what `array` needs (it rejects NULL
    // with a nonzero count and misalignment itself).
    let names = unsafe {
        array(
            c.preferred_segments,
            c.preferred_segments_count,
            "preferred_segments",
        )?
    };
    let preferred_segments = names
        .iter()
        // SAFETY: each is NULL (refused) or a NUL-terminated string.
        .map(|&p| unsafe { c_str(p, "preferred segment") }.map(str::to_owned))
        .collect::<Result<_>>()?;
    Ok(ReplicateConfig {
        replica_num: c.replica_num,
        hard_pin: c.hard_pin != 0,
        soft_pin: c.soft_pin != 0,
        soft_pin_ttl_ms: c.soft_pin_ttl_ms,
        preferred_segments,
        prefer_same_node: c.prefer_same_node != 0,
        group_ids: Vec::new(),
    })
}

/// [`guard`] for store calls: the codes engines meet in normal operation (a miss, a
/// leased object, a full pool) are logged at debug level rather than as warnings.
pub(super) fn store_guard(what: &str, body: impl FnOnce() -> Result<c_int>) -> c_int {
    guard(what, || {
        body().or_else(|e| match e.code() {
            Code::ObjectNotFound | Code::ObjectHasLease | Code::NoAvailableHandle => {
                log::debug!("{what}: {e}");
                Ok(e.code() as c_int)
            }
            _ => Err(e),
        })
    })
}

/// Borrows the client behind a handle.
///
/// # Safety
/// `s` must be NULL or a live pointer from `mc_store_new` not freed during `'a`.
pub(super) unsafe fn store<'a>(s: *mut McStore) -> Result<&'a Client> {
    non_null(s, "store")?;
    // SAFETY: `s` is non-null (checked by `non_null`) and the caller guarantees a live store from
    // mc_store_new that mc_store_free does not free during `'a` (mooncake.h); only shared access is
    // made, which `Client: Sync` allows from many threads.
    unsafe { &(*s).client }.get("store")
}

/// Borrows a key: NULL gives `MC_ERR_INVALID_PARAMS`, bytes that are not UTF-8
/// `MC_ERR_INVALID_KEY`. Length rules are the master's.
///
/// # Safety
/// `p` must be NULL or a NUL-terminated string unchanged during `'a`.
pub(super) unsafe fn key<'a>(p: *const c_char) -> Result<&'a str> {
    // SAFETY: the caller guarantees `p` is NULL or a NUL-terminated string unchanged during `'a`,
    // which is exactly `c_str`'s contract (it rejects NULL itself).
    unsafe { c_str(p, "key") }.map_err(|e| match p.is_null() {
        true => e,
        false => Error::new(Code::InvalidKey, "key is not valid UTF-8"),
    })
}

/// The `n` keys laid end to end in `packed`, each followed by one NUL (the last byte
/// is one): `MC_ERR_INVALID_PARAMS` when `packed` holds another number of strings,
/// `MC_ERR_INVALID_KEY` when one is empty, longer than `MC_STORE_MAX_KEY_LEN` or not
/// UTF-8.
fn packed_keys(packed: &[u8], n: usize) -> std::result::Result<Vec<&str>, Code> {
    if packed.last().is_some_and(|&b| b != 0) {
        return Err(Code::InvalidParams);
    }
    // Each key takes two bytes at least: a forged `n` allocates nothing beyond `packed`.
    let mut keys = Vec::with_capacity(n.min(packed.len() / 2));
    for k in packed.split_inclusive(|&b| b == 0) {
        if keys.len() == n {
            return Err(Code::InvalidParams);
        }
        let key = std::str::from_utf8(&k[..k.len() - 1]).map_err(|_| Code::InvalidKey)?;
        check_key(key)?;
        keys.push(key);
    }
    if keys.len() == n {
        Ok(keys)
    } else {
        Err(Code::InvalidParams)
    }
}

/// Points `out[i]` at key `i` of the `n` keys packed in `packed[..len]` (see
/// `key_starts`); nothing is written unless every key is one the store takes. For
/// bindings: building a key array costs them more per key than the whole check here.
///
/// # Safety
/// `packed` NULL (only with `len == 0`) or `len` readable bytes that stay unchanged while
/// `out` is used; `out` NULL (only with `n == 0`) or `n` writable pointers.
#[no_mangle]
pub unsafe extern "C" fn mc_store_key_array(
    packed: *const c_char,
    len: usize,
    n: usize,
    out: *mut *const c_char,
) -> c_int {
    guard_value("mc_store_key_array", Code::Internal as c_int, || {
        // SAFETY: the caller guarantees `len` readable bytes at a non-NULL `packed` (and
        // `out`'s `n` writable pointers), `bytes`'s and `array_mut`'s contracts.
        let (bytes, out) = match unsafe {
            (
                args::bytes(packed.cast(), len, "packed"),
                array_mut(out, n, "out"),
            )
        } {
            (Ok(b), Ok(o)) => (b, o),
            _ => return Code::InvalidParams as c_int,
        };
        match packed_keys(bytes, n) {
            Ok(keys) => {
                // Each key is followed by its NUL inside `bytes`.
                for (slot, key) in out.iter_mut().zip(keys) {
                    *slot = key.as_ptr().cast::<c_char>();
                }
                MC_OK
            }
            Err(code) => code as c_int,
        }
    })
}

/// One negative code from a per-key result.
pub(super) fn code_of(e: &Error) -> c_int {
    log::debug!("store key: {e}");
    e.code() as c_int
}

/// Per key of a batch: the key, or why it cannot be asked (NULL, not UTF-8, or its
/// buffer NULL: `no_buf(i)`).
///
/// # Safety
/// Each of `keys` must be NULL or a NUL-terminated string unchanged during `'a`.
pub(super) unsafe fn batch_keys<'a>(
    keys: &[*const c_char],
    no_buf: impl Fn(usize) -> bool,
) -> Vec<Result<&'a str>> {
    keys.iter()
        .enumerate()
        .map(|(i, &p)| {
            // SAFETY: `p` is an element of `keys`, each of which the caller guarantees is NULL or a
            // NUL-terminated string unchanged during `'a`, as `key` requires.
            let k = unsafe { key(p) }?;
            match no_buf(i) {
                true => Err(Error::invalid(format!("buffer {i} is NULL"))),
                false => Ok(k),
            }
        })
        .collect()
}

/// Runs `run` on the usable keys (with their indexes in the batch) and puts its answers
/// in place; the other keys keep their error.
pub(super) fn scatter<T>(
    keys: Vec<Result<&str>>,
    run: impl FnOnce(&[&str], &[usize]) -> Vec<Result<T>>,
) -> Vec<Result<T>> {
    let mut good = Vec::new();
    let mut index = Vec::new();
    let mut out: Vec<Result<T>> = Vec::with_capacity(keys.len());
    for (i, k) in keys.into_iter().enumerate() {
        match k {
            Ok(k) => {
                good.push(k);
                index.push(i);
                out.push(Err(Error::new(Code::Internal, "no answer for key")));
            }
            Err(e) => out.push(Err(e)),
        }
    }
    if !good.is_empty() {
        for (i, a) in index.iter().zip(run(&good, &index)) {
            out[*i] = a;
        }
    }
    out
}

/// Connects a store client from `cfg` (NULL: defaults) into `*out` (NULL on error).
///
/// # Safety
/// `cfg` must be NULL or a live `mc_config`; `out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_store_new(cfg: *const McConfig, out: *mut *mut McStore) -> c_int {
    store_guard("mc_store_new", || {
        init_logging();
        non_null(out, "out")?;
        // SAFETY: `out` is non-null (checked just above) and the caller guarantees a non-null `out`
        // is writable, as this fn's `# Safety` and mooncake.h require.
        unsafe { *out = std::ptr::null_mut() };
        let (mut config, metadata_set) = if cfg.is_null() {
            let c = StoreSettings::default().client_config(&EngineConfig::default());
            (c, false)
        } else {
            // SAFETY: `cfg` is non-null (checked) and the caller guarantees a live mc_config that
            // no other thread uses meanwhile (mooncake.h's rule for configs); it is only read.
            let c = unsafe { &*cfg };
            (c.store.client_config(&c.config), c.store.metadata_set)
        };
        if !metadata_set {
            // No metadata given: the master says which server its nodes use.
            config.engine.metadata = crate::store::metadata_of_master(
                &config.master_address,
                config.engine.cluster_secret.as_ref(),
            )?;
        }
        let client = Client::new(config)?;
        let handle = Box::into_raw(Box::new(McStore {
            client: ProcessBound::new(client),
        }));
        // SAFETY: `out` was checked non-null at the top of this closure and is writable, as the
        // caller guarantees; storing the handle is its only use.
        unsafe { *out = handle };
        Ok(MC_OK)
    })
}

/// As `mc_store_new`, moving bytes with `engine` instead of an engine of its own.
///
/// # Safety
/// `cfg` NULL or a live `mc_config`; `engine` NULL or a live `mc_engine`; `out` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn mc_store_new_with_engine(
    cfg: *const McConfig,
    engine: *mut super::McEngine,
    out: *mut *mut McStore,
) -> c_int {
    store_guard("mc_store_new_with_engine", || {
        init_logging();
        non_null(out, "out")?;
        // SAFETY: `out` is non-null (checked just above) and the caller guarantees a non-null `out`
        // is writable, as this fn's `# Safety` and mooncake.h require.
        unsafe { *out = std::ptr::null_mut() };
        non_null(engine, "engine")?;
        // SAFETY: `engine` is non-null (checked above) and the caller guarantees a live mc_engine
        // that mc_engine_free is not freeing concurrently (mooncake.h); the Arc is cloned, so the
        // engine outlives this store whatever happens to the handle.
        let engine = unsafe { &*engine }.shared()?.clone();
        let config = if cfg.is_null() {
            StoreSettings::default().client_config(&EngineConfig::default())
        } else {
            // SAFETY: `cfg` is non-null (checked) and the caller guarantees a live mc_config that
            // no other thread uses meanwhile (mooncake.h's rule for configs); it is only read.
            let c = unsafe { &*cfg };
            c.store.client_config(&c.config)
        };
        let client = Client::with_engine(config, engine)?;
        let handle = Box::into_raw(Box::new(McStore {
            client: ProcessBound::new(client),
        }));
        // SAFETY: `out` was checked non-null at the top of this closure and is writable, as the
        // caller guarantees; storing the handle is its only use.
        unsafe { *out = handle };
        Ok(MC_OK)
    })
}

/// Unmounts the store's segment, disconnects and frees it; NULL is ignored.
///
/// # Safety
/// `s` must be NULL or a pointer from `mc_store_new` not yet freed, with no other call
/// on it in progress or to come.
#[no_mangle]
pub unsafe extern "C" fn mc_store_free(s: *mut McStore) {
    if s.is_null() {
        return;
    }
    guard_value("mc_store_free", (), || {
        // SAFETY: from `Box::into_raw` in `mc_store_new`, freed once, no longer shared.
        drop(unsafe { Box::from_raw(s) });
    });
}

/// Puts one value from `len` bytes at `buf`.
///
/// # Safety
/// As `mc_store_put`.
unsafe fn put_one(
    s: *mut McStore,
    k: *const c_char,
    buf: *const c_void,
    len: usize,
    cfg: *const McReplicateConfig,
) -> Result<c_int> {
    // SAFETY: the caller guarantees, as for mc_store_put, that `s` is NULL or a live store not
    // freed during the call, which is what `store` needs (it rejects NULL).
    let client = unsafe { store(s)? };
    // SAFETY: the caller guarantees `k` is NULL or a NUL-terminated string unchanged during the
    // call, which is `key`'s contract.
    let key = unsafe { key(k)? };
    non_null(buf, "buf")?;
    // SAFETY: the caller guarantees `cfg` is NULL or a valid mc_replicate_config (its
    // `preferred_segments` readable C strings), which is `replicate_config`'s contract.
    let cfg = unsafe { replicate_config(cfg)? };
    let parts: Parts = vec![(buf as u64, len as u64)];
    // SAFETY: `buf` is non-null (checked above) and, as mc_store_put requires, readable for `len`
    // bytes during the call, which is `batch_put_from`'s contract.
    let mut r = unsafe { client.batch_put_from(&[key], &[parts], &cfg, false) };
    r.pop()
        .unwrap_or_else(|| Err(Error::new(Code::Internal, "empty batch result")))?;
    Ok(MC_OK)
}

/// Stores `len` bytes at `buf` under `key`; an existing key is left unchanged.
///
/// # Safety
/// `s` a live store; `key` NULL or NUL-terminated; `buf` NULL or readable for `len`
/// bytes during the call; `cfg` NULL or a valid `mc_replicate_config`.
#[no_mangle]
pub unsafe extern "C" fn mc_store_put(
    s: *mut McStore,
    key: *const c_char,
    buf: *const c_void,
    len: usize,
    cfg: *const McReplicateConfig,
) -> c_int {
    // SAFETY: `put_one`'s contract is this fn's own `# Safety` (live `s`, C-string `key`, `buf`
    // readable for `len` bytes, valid `cfg`), and the arguments are passed through unchanged.
    store_guard("mc_store_put", || unsafe { put_one(s, key, buf, len, cfg) })
}

/// `mc_store_put` from a buffer registered with `mc_store_register_buffer`.
///
/// # Safety
/// As `mc_store_put`.
#[no_mangle]
pub unsafe extern "C" fn mc_store_put_from(
    s: *mut McStore,
    key: *const c_char,
    buf: *const c_void,
    len: usize,
    cfg: *const McReplicateConfig,
) -> c_int {
    // SAFETY: `put_one`'s contract is this fn's own `# Safety` (as mc_store_put), and the arguments
    // are passed through unchanged.
    store_guard("mc_store_put_from", || unsafe {
        put_one(s, key, buf, len, cfg)
    })
}

/// Reads `key` into `buf[..cap]`; the object's size into `*len_out` (may be NULL).
///
/// # Safety
/// `s` a live store; `key` NULL or NUL-terminated; `buf` NULL or writable for `cap`
/// bytes, untouched by others during the call; `len_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_store_get_into(
    s: *mut McStore,
    key: *const c_char,
    buf: *mut c_void,
    cap: usize,
    len_out: *mut u64,
) -> c_int {
    store_guard("mc_store_get_into", || {
        // SAFETY: the caller guarantees `s` is NULL or a live store not freed during the call
        // (mooncake.h), which is what `store` needs.
        let client = unsafe { store(s)? };
        // SAFETY: the caller guarantees `key` is NULL or a NUL-terminated string unchanged during
        // the call, which is `key`'s contract.
        let key = unsafe { self::key(key)? };
        non_null(buf, "buf")?;
        let parts: Parts = vec![(buf as u64, cap as u64)];
        // SAFETY: `buf` is writable for `cap` bytes during the call.
        let mut r = unsafe { client.batch_get_into(&[key], &[parts]) };
        let size = r
            .pop()
            .unwrap_or_else(|| Err(Error::new(Code::Internal, "empty batch result")))?;
        if !len_out.is_null() {
            // SAFETY: `len_out` is non-null (just checked) and the caller guarantees a non-null
            // `len_out` is a writable u64.
            unsafe { *len_out = size };
        }
        Ok(MC_OK)
    })
}

/// 1 if a complete object is stored under `key`, 0 if not, else a negative code.
///
/// # Safety
/// `s` a live store; `key` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mc_store_exists(s: *mut McStore, key: *const c_char) -> c_int {
    store_guard("mc_store_exists", || {
        // SAFETY: the caller guarantees `s` is NULL or a live store not being freed and `key` NULL
        // or a NUL-terminated string, which is what `store` and `key` need (both reject NULL).
        let (client, key) = unsafe { (store(s)?, self::key(key)?) };
        Ok(client.exists(key)?.into())
    })
}

/// The size of the object under `key` into `*size_out`.
///
/// # Safety
/// `s` a live store; `key` NULL or NUL-terminated; `size_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_store_size(
    s: *mut McStore,
    key: *const c_char,
    size_out: *mut u64,
) -> c_int {
    store_guard("mc_store_size", || {
        // SAFETY: the caller guarantees `s` is NULL or a live store not being freed and `key` NULL
        // or a NUL-terminated string, which is what `store` and `key` need (both reject NULL).
        let (client, key) = unsafe { (store(s)?, self::key(key)?) };
        non_null(size_out, "size_out")?;
        let size = client.size(key)?;
        // SAFETY: non-null and writable.
        unsafe { *size_out = size };
        Ok(MC_OK)
    })
}

/// Removes `key`; while a reader holds its lease only with `force`.
///
/// # Safety
/// `s` a live store; `key` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mc_store_remove(
    s: *mut McStore,
    key: *const c_char,
    force: c_int,
) -> c_int {
    store_guard("mc_store_remove", || {
        // SAFETY: the caller guarantees `s` is NULL or a live store not being freed and `key` NULL
        // or a NUL-terminated string, which is what `store` and `key` need (both reject NULL).
        let (client, key) = unsafe { (store(s)?, self::key(key)?) };
        client.remove(key, force != 0)?;
        Ok(MC_OK)
    })
}

/// Writes `n` into `*out` when `out` is not NULL.
///
/// # Safety
/// `out` must be NULL or writable.
unsafe fn put_count(out: *mut u64, n: u64) {
    if !out.is_null() {
        // SAFETY: `out` is non-null (just checked) and the caller guarantees a non-null `out` is a
        // writable u64.
        unsafe { *out = n };
    }
}

/// Removes every object (leased ones only with `force`); the count into `*removed_out`
/// (may be NULL).
///
/// # Safety
/// `s` a live store; `removed_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_store_remove_all(
    s: *mut McStore,
    force: c_int,
    removed_out: *mut u64,
) -> c_int {
    store_guard("mc_store_remove_all", || {
        // SAFETY: the caller guarantees `s` is NULL or a live store not freed during the call
        // (mooncake.h), which is what `store` needs.
        let n = unsafe { store(s)? }.remove_all(force != 0)?;
        // SAFETY: the caller guarantees `removed_out` is NULL or writable, which is `put_count`'s
        // contract.
        unsafe { put_count(removed_out, n) };
        Ok(MC_OK)
    })
}

/// Removes every object whose key matches `pattern` (leased ones only with `force`);
/// the count into `*removed_out` (may be NULL).
///
/// # Safety
/// `s` a live store; `pattern` NULL or NUL-terminated; `removed_out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn mc_store_remove_by_regex(
    s: *mut McStore,
    pattern: *const c_char,
    force: c_int,
    removed_out: *mut u64,
) -> c_int {
    store_guard("mc_store_remove_by_regex", || {
        // SAFETY: the caller guarantees `s` is NULL or a live store not being freed and `pattern`
        // NULL or a NUL-terminated string, which is what `store` and `c_str` need (both reject
        // NULL).
        let (client, pattern) = unsafe { (store(s)?, c_str(pattern, "pattern")?) };
        let n = client.remove_by_regex(pattern, force != 0)?;
        // SAFETY: the caller guarantees `removed_out` is NULL or writable, which is `put_count`'s
        // contract.
        unsafe { put_count(removed_out, n) };
        Ok(MC_OK)
    })
}

/// Registers `[addr, addr+len)` for zero-copy puts and gets.
///
/// # Safety
/// `s` a live store; the memory must stay valid until it is unregistered (or the store
/// is freed), and peers may read and write it meanwhile.
#[no_mangle]
pub unsafe extern "C" fn mc_store_register_buffer(
    s: *mut McStore,
    addr: *mut c_void,
    len: usize,
) -> c_int {
    store_guard("mc_store_register_buffer", || {
        // SAFETY: the caller guarantees `s` is NULL or a live store not freed during the call
        // (mooncake.h), which is what `store` needs.
        let client = unsafe { store(s)? };
        non_null(addr, "addr")?;
        // SAFETY: the caller keeps the memory valid until it unregisters it.
        unsafe { client.register_buffer(addr.cast(), len)? };
        Ok(MC_OK)
    })
}

/// Withdraws a buffer registered with `mc_store_register_buffer`.
///
/// # Safety
/// `s` a live store.
#[no_mangle]
pub unsafe extern "C" fn mc_store_unregister_buffer(s: *mut McStore, addr: *mut c_void) -> c_int {
    store_guard("mc_store_unregister_buffer", || {
        // SAFETY: the caller guarantees `s` is NULL or a live store not freed during the call
        // (mooncake.h), which is what `store` needs.
        let client = unsafe { store(s)? };
        non_null(addr, "addr")?;
        client.unregister_buffer(addr.cast())?;
        Ok(MC_OK)
    })
}

/// Copies the store's segment name, NUL-terminated, into `buf[..len]`.
///
/// # Safety
/// `s` a live store; `buf` NULL or writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn mc_store_hostname(s: *mut McStore, buf: *mut c_char, len: usize) -> c_int {
    store_guard("mc_store_hostname", || {
        // SAFETY: the caller guarantees `s` is NULL or a live store not freed during the call
        // (mooncake.h), which is what `store` needs.
        let client = unsafe { store(s)? };
        non_null(buf, "buf")?;
        let name = client.hostname();
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
                "hostname {name:?} needs {} bytes, buffer has {len}",
                name.len() + 1
            ),
        ))
    })
}

/// Puts `n` keys from one buffer each; per key 0 or a negative code in `results`.
///
/// # Safety
/// `s` a live store; `keys`, `bufs`, `lens` and `results` NULL (only with `n == 0`) or
/// arrays of `n`; each key NULL or NUL-terminated; each buffer NULL or readable for its
/// length during the call; `cfg` as for `mc_store_put`.
#[no_mangle]
pub unsafe extern "C" fn mc_store_batch_put_from(
    s: *mut McStore,
    keys: *const *const c_char,
    bufs: *const *const c_void,
    lens: *const usize,
    n: usize,
    cfg: *const McReplicateConfig,
    results: *mut c_int,
) -> c_int {
    store_guard("mc_store_batch_put_from", || {
        // SAFETY: the caller guarantees a live store (NULL rejected by `store`), `keys`, `bufs` and
        // `lens` each NULL only with `n == 0` or `n` readable elements (mooncake.h "Batches"), and
        // `cfg` as for mc_store_put: the contracts of `store`, `array` and `replicate_config`.
        let (client, keys, bufs, lens, cfg) = unsafe {
            (
                store(s)?,
                array(keys, n, "keys")?,
                array(bufs, n, "bufs")?,
                array(lens, n, "lens")?,
                replicate_config(cfg)?,
            )
        };
        // SAFETY: the caller guarantees `results` is NULL only with `n == 0` or `n` writable ints
        // that nothing else touches during the call (`array_mut`'s contract); it is only written,
        // never read.
        let results = unsafe { array_mut(results, n, "results")? };
        // SAFETY: each key is NULL or NUL-terminated.
        let checked = unsafe { batch_keys(keys, |i| bufs[i].is_null()) };
        let answers = scatter(checked, |good, index| {
            let parts: Vec<Parts> = index
                .iter()
                .map(|&i| vec![(bufs[i] as u64, lens[i] as u64)])
                .collect();
            // SAFETY: every buffer left is readable for its length during the call.
            unsafe { client.batch_put_from(good, &parts, &cfg, false) }
        });
        for (slot, a) in results.iter_mut().zip(answers) {
            *slot = a.map_or_else(|e| code_of(&e), |()| MC_OK);
        }
        Ok(MC_OK)
    })
}

/// Reads `n` keys into one buffer each; per key the bytes read (the object's size) or
/// a negative code in `results`.
///
/// # Safety
/// `s` a live store; `keys`, `bufs`, `caps` and `results` NULL (only with `n == 0`) or
/// arrays of `n`; each key NULL or NUL-terminated; each buffer NULL or writable for its
/// capacity, untouched by others during the call, and not overlapping another.
#[no_mangle]
pub unsafe extern "C" fn mc_store_batch_get_into(
    s: *mut McStore,
    keys: *const *const c_char,
    bufs: *const *mut c_void,
    caps: *const usize,
    n: usize,
    results: *mut i64,
) -> c_int {
    store_guard("mc_store_batch_get_into", || {
        // SAFETY: the caller guarantees a live store (NULL rejected by `store`) and `keys`, `bufs`
        // and `caps` each NULL only with `n == 0` or `n` readable elements (mooncake.h "Batches"):
        // the contracts of `store` and `array`.
        let (client, keys, bufs, caps) = unsafe {
            (
                store(s)?,
                array(keys, n, "keys")?,
                array(bufs, n, "bufs")?,
                array(caps, n, "caps")?,
            )
        };
        // SAFETY: the caller guarantees `results` is NULL only with `n == 0` or `n` writable i64s
        // that nothing else touches during the call (`array_mut`'s contract); it is only written,
        // never read.
        let results = unsafe { array_mut(results, n, "results")? };
        // SAFETY: each key is NULL or NUL-terminated.
        let checked = unsafe { batch_keys(keys, |i| bufs[i].is_null()) };
        let answers = scatter(checked, |good, index| {
            let spans: Vec<(u64, u64)> = index
                .iter()
                .map(|&i| (bufs[i] as u64, caps[i] as u64))
                .collect();
            // SAFETY: every buffer left is writable for its capacity during the call.
            unsafe { client.batch_get_into_spans(good, &spans) }
        });
        size_results(results, answers);
        Ok(MC_OK)
    })
}

/// Reads `n` keys packed as for `mc_store_key_array` into `bufs` (`caps` bytes each), as
/// `mc_store_batch_get_into` does, when the batch is regular: every key one the store
/// takes and every buffer inside one of the `n_allowed` `[start, end)` ranges at
/// `allowed`. Otherwise nothing is read or written and the code says why, so that a
/// binding answers the batch key by key (with its own checks and messages).
///
/// # Safety
/// `s` a live store; `packed` NULL (only with `len == 0`) or `len` readable bytes;
/// `bufs`, `caps` and `results` NULL (only with `n == 0`) or arrays of `n`; `allowed`
/// NULL (only with `n_allowed == 0`) or `2 * n_allowed` u64s; each buffer inside the
/// allowed ranges writable for its capacity, untouched by others during the call.
#[no_mangle]
pub unsafe extern "C" fn mc_store_batch_get_into_packed(
    s: *mut McStore,
    packed: *const c_char,
    len: usize,
    n: usize,
    bufs: *const *mut c_void,
    caps: *const usize,
    allowed: *const u64,
    n_allowed: usize,
    results: *mut i64,
) -> c_int {
    store_guard("mc_store_batch_get_into_packed", || {
        let pairs = n_allowed
            .checked_mul(2)
            .ok_or_else(|| Error::invalid("n_allowed is too large"))?;
        // SAFETY: the caller guarantees a live store and each pointer NULL only with a zero
        // count or that many readable elements (`results` writable, touched by no one else):
        // the contracts of `store`, `bytes`, `array` and `array_mut`.
        let (client, packed, bufs, caps, allowed, results) = unsafe {
            (
                store(s)?,
                args::bytes(packed.cast(), len, "packed")?,
                array(bufs, n, "bufs")?,
                array(caps, n, "caps")?,
                array(allowed, pairs, "allowed")?,
                array_mut(results, n, "results")?,
            )
        };
        let spans: Vec<(u64, u64)> = (0..n).map(|i| (bufs[i] as u64, caps[i] as u64)).collect();
        // SAFETY: every buffer inside the allowed ranges is writable for its capacity
        // during the call (this fn's contract).
        match unsafe { read_regular_batch(client, packed, &spans, allowed) } {
            Ok(answers) => {
                size_results(results, answers);
                Ok(MC_OK)
            }
            // Irregular batches are answered without a warning: the binding goes key
            // by key.
            Err(code) => Ok(code as c_int),
        }
    })
}

/// Reads a regular batch: key `i` of the `spans.len()` keys packed in `packed` (as
/// for `mc_store_key_array`) into span `i` (address, capacity), every key one the
/// store takes and every span inside one of the `[start, end)` pairs of `allowed`.
/// The per-key answers, or the code that says why the batch is not regular, when
/// nothing was read.
///
/// # Safety
/// Every span inside the allowed ranges is writable for its capacity, untouched by
/// others, during the call.
pub(super) unsafe fn read_regular_batch(
    client: &Client,
    packed: &[u8],
    spans: &[(u64, u64)],
    allowed: &[u64],
) -> std::result::Result<Vec<Result<u64>>, Code> {
    let keys = packed_keys(packed, spans.len()).inspect_err(|code| {
        log::debug!("a regular batch read: packed keys: {code:?}");
    })?;
    let span = |&(start, cap): &(u64, u64)| {
        (start != 0)
            .then(|| Some((start, start.checked_add(cap)?)))
            .flatten()
    };
    let covered = |(start, end): (u64, u64)| {
        allowed
            .chunks_exact(2)
            .any(|r| r[0] <= start && end <= r[1])
    };
    // The usual batch lies in one registered buffer: one look at the spans' envelope,
    // else one per span (a batch over many buffers).
    let envelope = spans.iter().try_fold((u64::MAX, 0u64), |(lo, hi), s| {
        span(s).map(|(s, e)| (lo.min(s), hi.max(e)))
    });
    if !spans.is_empty() && !envelope.is_some_and(covered) {
        if let Some(i) = spans.iter().position(|s| !span(s).is_some_and(covered)) {
            log::debug!("a regular batch read: buffer {i} is outside the ranges");
            return Err(Code::AddressNotRegistered);
        }
    }
    // SAFETY: every span is inside the allowed ranges, writable for its capacity
    // during the call (this fn's contract).
    Ok(unsafe { client.batch_get_into_spans(&keys, spans) })
}

/// Writes per-key sizes or codes into `results`.
pub(super) fn size_results(results: &mut [i64], answers: Vec<Result<u64>>) {
    for (slot, a) in results.iter_mut().zip(answers) {
        *slot = answer_code(a);
    }
}

/// A per-key answer as a binding reports it: the size, or the negative code.
pub(super) fn answer_code(answer: Result<u64>) -> i64 {
    match answer {
        Ok(size) => i64::try_from(size).unwrap_or(i64::MAX),
        Err(e) => code_of(&e).into(),
    }
}

/// Per key 1 (stored), 0 (not) or a negative code in `results`.
///
/// # Safety
/// `s` a live store; `keys` and `results` NULL (only with `n == 0`) or arrays of `n`;
/// each key NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mc_store_batch_exists(
    s: *mut McStore,
    keys: *const *const c_char,
    n: usize,
    results: *mut c_int,
) -> c_int {
    store_guard("mc_store_batch_exists", || {
        // SAFETY: the caller guarantees a live store (NULL rejected by `store`) and `keys` NULL
        // only with `n == 0` or `n` readable pointers: the contracts of `store` and `array`.
        let (client, keys) = unsafe { (store(s)?, array(keys, n, "keys")?) };
        // SAFETY: the caller guarantees `results` is NULL only with `n == 0` or `n` writable ints
        // that nothing else touches during the call (`array_mut`'s contract); it is only written,
        // never read.
        let results = unsafe { array_mut(results, n, "results")? };
        // SAFETY: each key is NULL or NUL-terminated.
        let checked = unsafe { batch_keys(keys, |_| false) };
        let answers = scatter(checked, |good, _| client.batch_exists(good));
        for (slot, a) in results.iter_mut().zip(answers) {
            *slot = a.map_or_else(|e| code_of(&e), c_int::from);
        }
        Ok(MC_OK)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(pairs: &[(&str, &str)]) -> ClientConfig {
        let (mut engine, mut store) = (EngineConfig::default(), StoreSettings::default());
        for (k, v) in pairs {
            store.set(&mut engine, k, v).unwrap();
        }
        store.client_config(&engine)
    }

    #[test]
    fn packed_keys_point_at_each_key_or_at_nothing() {
        assert_eq!(packed_keys(b"a\0bc\0d\0", 3), Ok(vec!["a", "bc", "d"]));
        assert_eq!(packed_keys(b"", 0), Ok(vec![]));
        // Another count, or a key not ended by NUL: the caller packed something else.
        assert_eq!(packed_keys(b"a\0b\0", 1), Err(Code::InvalidParams));
        assert_eq!(packed_keys(b"a\0b\0", 3), Err(Code::InvalidParams));
        assert_eq!(packed_keys(b"a\0b", 2), Err(Code::InvalidParams));
        assert_eq!(packed_keys(b"a\0", 0), Err(Code::InvalidParams));
        // Keys the store refuses.
        assert_eq!(packed_keys(b"a\0\0", 2), Err(Code::InvalidKey));
        assert_eq!(packed_keys(b"\xff\0", 1), Err(Code::InvalidKey));
        let long = [vec![b'k'; MAX_KEY_LEN + 1], vec![0]].concat();
        assert_eq!(packed_keys(&long, 1), Err(Code::InvalidKey));
        let longest = [vec![b'k'; MAX_KEY_LEN], vec![0]].concat();
        assert_eq!(
            packed_keys(&longest, 1),
            Ok(vec![&"k".repeat(MAX_KEY_LEN)[..]])
        );

        let packed = b"one\0two\0";
        let mut out = [std::ptr::null::<c_char>(); 2];
        // SAFETY: `packed` and `out` are live arrays of the lengths given.
        let rc = unsafe { mc_store_key_array(packed.as_ptr().cast(), 8, 2, out.as_mut_ptr()) };
        assert_eq!(rc, MC_OK);
        // SAFETY: each pointer is into `packed`, at a NUL-terminated key.
        let second = unsafe { std::ffi::CStr::from_ptr(out[1]) };
        assert_eq!(second.to_bytes(), b"two");
        let mut untouched = [std::ptr::null::<c_char>(); 1];
        // SAFETY: as above.
        let rc =
            unsafe { mc_store_key_array(packed.as_ptr().cast(), 8, 1, untouched.as_mut_ptr()) };
        assert_eq!(rc, Code::InvalidParams as c_int);
        assert!(untouched[0].is_null());
        // SAFETY: NULL arrays are refused, not read or written.
        let rc = unsafe { mc_store_key_array(std::ptr::null(), 4, 1, out.as_mut_ptr()) };
        assert_eq!(rc, Code::InvalidParams as c_int);
        // SAFETY: as above.
        let rc = unsafe { mc_store_key_array(packed.as_ptr().cast(), 8, 2, std::ptr::null_mut()) };
        assert_eq!(rc, Code::InvalidParams as c_int);
    }

    #[test]
    fn store_keys_reach_the_client_config() {
        let c = settings(&[]);
        assert_eq!(c.master_address, "127.0.0.1:50051");
        assert_eq!(c.engine.metadata, "http://127.0.0.1:8080/metadata");
        assert_eq!(c.global_segment_size, 0);
        assert_eq!(c.engine.protocol.name(), "auto");
        assert!(c.verify_checksum);

        let c = settings(&[
            ("master_address", "10.0.0.5:7000"),
            ("global_segment_size", "64M"),
            ("local_buffer_size", "1G"),
            ("verify_checksum", "0"),
            ("prefault_segment", "false"),
            ("protocol", "tcp"),
            ("local_hostname", "10.0.0.6:9000"),
            ("workers", "3"),
        ]);
        assert_eq!(c.engine.metadata, "http://10.0.0.5:8080/metadata");
        assert_eq!(c.global_segment_size, 64 << 20);
        assert_eq!(c.local_buffer_size, 1 << 30);
        assert!(!c.verify_checksum);
        assert!(!c.prefault_segment);
        assert_eq!(c.engine.protocol.name(), "tcp");
        assert_eq!(c.engine.local_server_name.as_deref(), Some("10.0.0.6:9000"));
        assert_eq!(c.engine.workers, 3);

        assert_eq!(
            settings(&[("master_address", "[::1]:50051")])
                .engine
                .metadata,
            "http://[::1]:8080/metadata"
        );
        // Set explicitly, even to the engine default, the metadata key wins.
        let c = settings(&[
            ("master_address", "10.0.0.5:7000"),
            ("metadata", "P2PHANDSHAKE"),
        ]);
        assert_eq!(c.engine.metadata, "P2PHANDSHAKE");
    }
}
