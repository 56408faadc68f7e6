//! The disk tier: objects kept in append-only log files under one directory, each
//! record checksummed (see [`record`]), written with `pwrite` and read with `pread`.
//!
//! - **Writes** reserve space at the tail of the active file under a short lock, copy
//!   outside it, and become visible only once written: a reader never sees a half
//!   written value.
//! - **Reads** check the header and the value's CRC32C; a record that fails is
//!   reported, dropped from the index and never returned.
//! - **Space**: files roll over at `file_size`; past the quota the oldest file goes
//!   whole (log-structured FIFO eviction, O(1) per file and no compaction copies), and
//!   the keys it held are dropped.
//! - **Restart**: [`DiskTier::open`] scans the files in order and rebuilds the index
//!   (later records win, tombstones remove); a torn tail or a corrupt header ends that
//!   file's scan and is reported, never guessed past. New writes go to a new file.

#![forbid(unsafe_code)]

pub mod record;

/// Drops a file's clean cached pages (what [`DiskTier::release_page_cache`] does to
/// the tier's files), for callers comparing against plain files.
pub use crate::sys::drop_page_cache;

use crate::util::sync::Unpoisoned;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Code, Error, Result};
use crate::util::crc32c::{crc32c, crc32c_append};
use record::{decode_head, encode_head, HeaderError, Kind, HEADER_LEN, MAX_KEY_LEN};

/// Default size at which a log file rolls over.
pub const DEFAULT_FILE_SIZE: u64 = 256 << 20;
const FILE_SUFFIX: &str = ".mclog";
/// Values are checksummed in pieces of this size, each while it is still in cache.
const CHUNK: usize = 256 << 10;

/// Where and how much.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    /// Directory holding the log files (created if missing).
    pub dir: PathBuf,
    /// Most bytes of log files kept.
    pub quota: u64,
    /// Size at which a log file rolls over.
    pub file_size: u64,
}

impl DiskConfig {
    /// `quota` bytes under `dir`, default file size (smaller when the quota is small,
    /// so eviction never has to drop more than a quarter of the tier at once).
    pub fn new(dir: impl Into<PathBuf>, quota: u64) -> DiskConfig {
        DiskConfig {
            dir: dir.into(),
            quota,
            file_size: DEFAULT_FILE_SIZE.min((quota / 4).max(1 << 20)),
        }
    }
}

/// What [`DiskTier::open`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RebuildReport {
    /// Log files scanned.
    pub files: usize,
    /// Records read (values and tombstones).
    pub records: u64,
    /// Keys readable afterwards.
    pub keys: usize,
    /// Bytes at the end of files that held no complete, trustworthy record (torn
    /// writes or corrupt headers), skipped.
    pub skipped_bytes: u64,
    /// Files whose scan stopped at a corrupt header.
    pub corrupt_files: usize,
}

/// Where one key's current value lives.
#[derive(Debug, Clone, Copy)]
struct Loc {
    file: u32,
    offset: u64,
    key_len: usize,
    value_len: u64,
}

struct LogFile {
    file: Arc<File>,
    path: PathBuf,
    /// Bytes reserved so far (the append offset).
    tail: u64,
    /// Keys whose current value is in this file (checked against the index when the
    /// file is evicted, so stale names cost nothing).
    keys: Vec<String>,
}

struct Inner {
    files: BTreeMap<u32, LogFile>,
    active: u32,
    index: HashMap<String, Loc>,
    /// Sum of the files' tails.
    used: u64,
    /// Keys dropped by eviction, and records found corrupt at read time.
    evicted: u64,
    corrupt: u64,
    /// Keys dropped (evicted or corrupt) since `take_dropped` last ran.
    dropped: Vec<String>,
}

/// Figures of a disk tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskStats {
    /// Readable keys.
    pub keys: usize,
    /// Bytes of log files.
    pub used: u64,
    /// The quota.
    pub quota: u64,
    /// Keys dropped to stay within the quota.
    pub evicted: u64,
    /// Records found corrupt when read (dropped, never returned).
    pub corrupt: u64,
}

/// An object store on local disk; safe to share between threads.
pub struct DiskTier {
    config: DiskConfig,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("dir", &self.config.dir)
            .finish()
    }
}

fn io_err(code: Code, what: impl std::fmt::Display, e: std::io::Error) -> Error {
    Error::new(code, format!("disk tier: {what}: {e}"))
}

fn file_name(id: u32) -> String {
    format!("{id:08}{FILE_SUFFIX}")
}

fn open_log(path: &Path, create: bool) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        .open(path)
        .map_err(|e| io_err(Code::FileOpenFail, path.display(), e))
}

/// Scans one log file from the start, applying its records to `index`.
fn scan(
    id: u32,
    file: &File,
    index: &mut HashMap<String, Loc>,
    report: &mut RebuildReport,
) -> Result<u64> {
    let len = file
        .metadata()
        .map_err(|e| io_err(Code::FileReadFail, "stat", e))?
        .len();
    let mut r = BufReader::with_capacity(1 << 20, file);
    r.seek(SeekFrom::Start(0))
        .map_err(|e| io_err(Code::FileReadFail, "seek", e))?;
    let mut offset = 0u64;
    let mut head = vec![0u8; HEADER_LEN + MAX_KEY_LEN];
    while offset < len {
        let avail = (len - offset).min(head.len() as u64) as usize;
        // Read the fixed header, then as much of the key as it announces.
        let want = HEADER_LEN.min(avail);
        if r.read_exact(&mut head[..want]).is_err() || want < HEADER_LEN {
            break;
        }
        let key_len = usize::from(u16::from_le_bytes([head[6], head[7]]));
        if HEADER_LEN + key_len > avail
            || r.read_exact(&mut head[HEADER_LEN..HEADER_LEN + key_len])
                .is_err()
        {
            break;
        }
        let (h, key) = match decode_head(&head[..HEADER_LEN + key_len]) {
            Ok(v) => v,
            Err(HeaderError::Short) => break,
            Err(HeaderError::Corrupt) => {
                report.corrupt_files += 1;
                break;
            }
        };
        if offset + h.record_len() > len {
            break; // torn: the value was not completely written
        }
        let Ok(key) = std::str::from_utf8(key) else {
            report.corrupt_files += 1;
            break;
        };
        match h.kind {
            Kind::Value => {
                let loc = Loc {
                    file: id,
                    offset,
                    key_len: h.key_len,
                    value_len: h.value_len,
                };
                index.insert(key.to_owned(), loc);
            }
            Kind::Tombstone => {
                index.remove(key);
            }
        }
        report.records += 1;
        offset += h.record_len();
        let value_len = i64::try_from(h.value_len).unwrap_or(i64::MAX);
        r.seek_relative(value_len)
            .map_err(|e| io_err(Code::FileReadFail, "seek", e))?;
    }
    report.skipped_bytes += len - offset;
    Ok(offset)
}

impl DiskTier {
    /// Opens (or creates) the tier in `config.dir` and rebuilds its index from the
    /// files found there.
    pub fn open(config: DiskConfig) -> Result<(DiskTier, RebuildReport)> {
        if config.quota == 0 || config.file_size == 0 {
            return Err(Error::invalid(
                "disk tier: quota and file size must be positive",
            ));
        }
        fs::create_dir_all(&config.dir)
            .map_err(|e| io_err(Code::FileOpenFail, config.dir.display(), e))?;
        let mut ids = Vec::new();
        let entries = fs::read_dir(&config.dir)
            .map_err(|e| io_err(Code::FileReadFail, config.dir.display(), e))?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if let Some(id) = name
                .strip_suffix(FILE_SUFFIX)
                .and_then(|n| n.parse::<u32>().ok())
            {
                ids.push(id);
            }
        }
        ids.sort_unstable();
        let mut report = RebuildReport::default();
        let mut index = HashMap::new();
        let mut files = BTreeMap::new();
        let mut used = 0;
        for &id in &ids {
            let path = config.dir.join(file_name(id));
            let file = open_log(&path, false)?;
            let tail = scan(id, &file, &mut index, &mut report)?;
            report.files += 1;
            if file.metadata().is_ok_and(|m| m.len() == 0) {
                // An active file nothing was written to before the last close.
                let _ = fs::remove_file(&path);
                continue;
            }
            used += tail;
            files.insert(
                id,
                LogFile {
                    file: Arc::new(file),
                    path,
                    tail,
                    keys: Vec::new(),
                },
            );
        }
        for (key, loc) in &index {
            if let Some(f) = files.get_mut(&loc.file) {
                f.keys.push(key.clone());
            }
        }
        report.keys = index.len();
        let tier = DiskTier {
            config,
            inner: Mutex::new(Inner {
                files,
                active: ids.last().copied().unwrap_or(0),
                index,
                used,
                evicted: 0,
                corrupt: 0,
                dropped: Vec::new(),
            }),
        };
        // Appends never follow bytes a scan could not account for: start a new file.
        tier.roll(&mut tier.lock())?;
        Ok((tier, report))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    /// Starts a new active file.
    fn roll(&self, inner: &mut Inner) -> Result<()> {
        let id = inner
            .active
            .checked_add(1)
            .ok_or_else(|| Error::new(Code::FileWriteFail, "disk tier: file ids exhausted"))?;
        let path = self.config.dir.join(file_name(id));
        let file = open_log(&path, true)?;
        inner.files.insert(
            id,
            LogFile {
                file: Arc::new(file),
                path,
                tail: 0,
                keys: Vec::new(),
            },
        );
        inner.active = id;
        Ok(())
    }

    /// Drops the oldest file that is not the active one; false if there is none.
    fn evict_oldest(&self, inner: &mut Inner) -> bool {
        let Some((&id, _)) = inner
            .files
            .iter()
            .next()
            .filter(|(&id, _)| id != inner.active)
        else {
            return false;
        };
        let Some(f) = inner.files.remove(&id) else {
            return false;
        };
        for key in f.keys {
            if inner.index.get(&key).is_some_and(|l| l.file == id) {
                inner.index.remove(&key);
                inner.evicted += 1;
                inner.dropped.push(key);
            }
        }
        inner.used -= f.tail;
        // Readers holding the file keep their descriptor; the name goes now.
        if let Err(e) = fs::remove_file(&f.path) {
            log::warn!("disk tier: removing {}: {e}", f.path.display());
        }
        true
    }

    /// Reserves `len` bytes at the tail, rolling over and evicting as needed.
    fn reserve(&self, inner: &mut Inner, len: u64) -> Result<(u32, u64, Arc<File>)> {
        if len > self.config.quota {
            return Err(Error::new(
                Code::InvalidParams,
                format!(
                    "disk tier: a record of {len} bytes exceeds the quota of {}",
                    self.config.quota
                ),
            ));
        }
        let tail = inner.files.get(&inner.active).map_or(0, |f| f.tail);
        if tail > 0 && tail + len > self.config.file_size {
            self.roll(inner)?;
        }
        while inner.used + len > self.config.quota {
            if !self.evict_oldest(inner) {
                break;
            }
        }
        if inner.used + len > self.config.quota {
            // Only the active file is left and it is full: start afresh.
            self.roll(inner)?;
            while inner.used + len > self.config.quota && self.evict_oldest(inner) {}
        }
        let active = inner.active;
        let f = inner
            .files
            .get_mut(&active)
            .ok_or_else(|| Error::new(Code::Internal, "disk tier: no active file"))?;
        let offset = f.tail;
        f.tail += len;
        inner.used += len;
        Ok((active, offset, f.file.clone()))
    }

    /// Stores the concatenation of `parts` under `key`, replacing any previous value.
    pub fn put(&self, key: &str, parts: &[&[u8]]) -> Result<()> {
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(Error::new(
                Code::InvalidKey,
                format!(
                    "disk tier: key length {} is not 1..={MAX_KEY_LEN}",
                    key.len()
                ),
            ));
        }
        let value_len: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let head_len = (HEADER_LEN + key.len()) as u64;
        let (file_id, offset, file) = self.reserve(&mut self.lock(), head_len + value_len)?;
        // The value first, checksummed piece by piece as it is written; the header,
        // which carries that checksum, last: a crash before it leaves no valid record.
        let mut crc = crc32c(&[]);
        let mut at = offset + head_len;
        for chunk in parts.iter().flat_map(|p| p.chunks(CHUNK)) {
            crc = crc32c_append(crc, chunk);
            file.write_all_at(chunk, at)
                .map_err(|e| io_err(Code::FileWriteFail, "pwrite", e))?;
            at += chunk.len() as u64;
        }
        let head = encode_head(Kind::Value, key.as_bytes(), value_len, crc);
        file.write_all_at(&head, offset)
            .map_err(|e| io_err(Code::FileWriteFail, "pwrite", e))?;
        let loc = Loc {
            file: file_id,
            offset,
            key_len: key.len(),
            value_len,
        };
        let mut inner = self.lock();
        // Evicted while being written: the value is gone with its file.
        if let Some(f) = inner.files.get_mut(&file_id) {
            f.keys.push(key.to_owned());
            inner.index.insert(key.to_owned(), loc);
        }
        Ok(())
    }

    /// Whether `key` is readable (its bytes are checked when read).
    pub fn contains(&self, key: &str) -> bool {
        self.lock().index.contains_key(key)
    }

    /// Bytes of `key`'s value, if present.
    pub fn size(&self, key: &str) -> Option<u64> {
        self.lock().index.get(key).map(|l| l.value_len)
    }

    /// Where `key`'s value is now, and its file (kept open even if evicted meanwhile).
    fn locate(&self, key: &str) -> Result<(Loc, Arc<File>)> {
        let inner = self.lock();
        let loc = *inner.index.get(key).ok_or_else(|| {
            Error::new(
                Code::ObjectNotFound,
                format!("disk tier: no object {key:?}"),
            )
        })?;
        let file = inner
            .files
            .get(&loc.file)
            .map(|f| f.file.clone())
            .ok_or_else(|| Error::new(Code::Internal, "disk tier: index names a missing file"))?;
        Ok((loc, file))
    }

    /// Reads `key`'s value into `buf` (which must hold it); returns its length.
    pub fn read_into(&self, key: &str, buf: &mut [u8]) -> Result<u64> {
        let (loc, file) = self.locate(key)?;
        let len = usize::try_from(loc.value_len).unwrap_or(usize::MAX);
        if buf.len() < len {
            return Err(Error::new(
                Code::BufferOverflow,
                format!(
                    "disk tier: {key:?} holds {len} bytes, the buffer {}",
                    buf.len()
                ),
            ));
        }
        self.read_record(key, loc, &file, &mut buf[..len])
    }

    /// `key`'s value.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        // One lookup: a value replaced meanwhile by a longer one cannot overflow.
        let (loc, file) = self.locate(key)?;
        let mut buf = vec![0u8; usize::try_from(loc.value_len).unwrap_or(usize::MAX)];
        self.read_record(key, loc, &file, &mut buf)?;
        Ok(buf)
    }

    /// Reads the record at `loc` (whose value is `value.len()` bytes) and checks it;
    /// a record that fails is dropped from the index and reported, never returned.
    fn read_record(&self, key: &str, loc: Loc, file: &File, value: &mut [u8]) -> Result<u64> {
        let mut head = vec![0u8; HEADER_LEN + loc.key_len];
        file.read_exact_at(&mut head, loc.offset)
            .map_err(|e| io_err(Code::FileReadFail, "pread", e))?;
        // Checksummed chunk by chunk while each is still in cache.
        let mut crc = crc32c(&[]);
        let mut at = loc.offset + head.len() as u64;
        for chunk in value.chunks_mut(CHUNK) {
            file.read_exact_at(chunk, at)
                .map_err(|e| io_err(Code::FileReadFail, "pread", e))?;
            crc = crc32c_append(crc, chunk);
            at += chunk.len() as u64;
        }
        let ok = match decode_head(&head) {
            Ok((h, k)) => {
                k == key.as_bytes()
                    && h.kind == Kind::Value
                    && h.value_len == loc.value_len
                    && crc == h.value_crc
            }
            Err(_) => false,
        };
        if !ok {
            let mut inner = self.lock();
            if inner
                .index
                .get(key)
                .is_some_and(|l| l.file == loc.file && l.offset == loc.offset)
            {
                inner.index.remove(key);
                inner.dropped.push(key.to_owned());
            }
            inner.corrupt += 1;
            log::error!(
                "disk tier: record of {key:?} in {} at {} is corrupt; dropped",
                file_name(loc.file),
                loc.offset
            );
            return Err(Error::new(
                Code::ChecksumMismatch,
                format!(
                    "disk tier: stored bytes of {key:?} fail their checksum; the object is dropped"
                ),
            ));
        }
        Ok(loc.value_len)
    }

    /// Removes `key`; a tombstone keeps it removed across a restart. Returns whether
    /// it was present.
    pub fn remove(&self, key: &str) -> Result<bool> {
        let mut inner = self.lock();
        if inner.index.remove(key).is_none() {
            return Ok(false);
        }
        let head = encode_head(Kind::Tombstone, key.as_bytes(), 0, crc32c(&[]));
        let (_, offset, file) = self.reserve(&mut inner, head.len() as u64)?;
        drop(inner);
        file.write_all_at(&head, offset)
            .map_err(|e| io_err(Code::FileWriteFail, "pwrite", e))?;
        Ok(true)
    }

    /// Keys the tier dropped by itself (evicted to stay within the quota, or found
    /// corrupt) since the last call: whoever indexes the tier forgets them.
    pub fn take_dropped(&self) -> Vec<String> {
        std::mem::take(&mut self.lock().dropped)
    }

    /// The first bytes of `key`'s value (up to `buf.len()`), unchecked: for a look at a
    /// header of the caller's own, whose full value is checked when read.
    pub fn read_prefix(&self, key: &str, buf: &mut [u8]) -> Result<usize> {
        let (loc, file) = self.locate(key)?;
        let n = buf
            .len()
            .min(usize::try_from(loc.value_len).unwrap_or(usize::MAX));
        file.read_exact_at(
            &mut buf[..n],
            loc.offset + (HEADER_LEN + loc.key_len) as u64,
        )
        .map_err(|e| io_err(Code::FileReadFail, "pread", e))?;
        Ok(n)
    }

    /// Every readable key.
    pub fn keys(&self) -> Vec<String> {
        self.lock().index.keys().cloned().collect()
    }

    /// Current figures.
    pub fn stats(&self) -> DiskStats {
        let inner = self.lock();
        DiskStats {
            keys: inner.index.len(),
            used: inner.used,
            quota: self.config.quota,
            evicted: inner.evicted,
            corrupt: inner.corrupt,
        }
    }

    /// Forces written data to the device (not needed for a cache's correctness: a
    /// record lost in a crash is detected on restart).
    pub fn sync(&self) -> Result<()> {
        for f in self.open_files() {
            f.sync_data()
                .map_err(|e| io_err(Code::FileWriteFail, "fdatasync", e))?;
        }
        Ok(())
    }

    /// Writes everything out and asks the kernel to drop the files' cached pages: the
    /// tier exists to hold what DRAM cannot, so its bytes should not also sit in the
    /// page cache (and a benchmark of it should read from the device).
    pub fn release_page_cache(&self) -> Result<()> {
        self.sync()?;
        for f in self.open_files() {
            crate::sys::drop_page_cache(&f)
                .map_err(|e| io_err(Code::FileReadFail, "posix_fadvise", e))?;
        }
        Ok(())
    }

    fn open_files(&self) -> Vec<Arc<File>> {
        self.lock().files.values().map(|f| f.file.clone()).collect()
    }
}
