//! A node's disk tier as the store uses it: objects evicted from the node's memory
//! are kept here (the master says which, `Offload`), read back into memory when
//! asked (`Load`), and announced to a master after a restart of either side.
//!
//! Each value is stored behind a 16-byte prefix, `"MCV1" | crc32c u32 | version u64`
//! (little-endian), so the tier can say what it holds without reading whole values;
//! every read checks both the record's checksum and the object's own.

use crate::disk::{DiskConfig, DiskTier};
use crate::error::{Code, Error, Result};
use crate::protocol::{CatalogEntry, DiskEntry};
use crate::util::crc32c::{crc32c, crc32c_append};

const MAGIC: &[u8; 4] = b"MCV1";
const PREFIX: usize = 16;

/// The disk tier of one node.
pub struct NodeDisk {
    tier: DiskTier,
    capacity: u64,
}

fn prefix(version: u64, crc: u32) -> [u8; PREFIX] {
    let mut p = [0u8; PREFIX];
    p[..4].copy_from_slice(MAGIC);
    p[4..8].copy_from_slice(&crc.to_le_bytes());
    p[8..].copy_from_slice(&version.to_le_bytes());
    p
}

/// `(crc32c, version)` from a prefix, if it is one.
fn parse_prefix(p: &[u8]) -> Option<(u32, u64)> {
    if p.len() < PREFIX || &p[..4] != MAGIC {
        return None;
    }
    let crc = u32::from_le_bytes(p[4..8].try_into().ok()?);
    let version = u64::from_le_bytes(p[8..16].try_into().ok()?);
    Some((crc, version))
}

impl NodeDisk {
    /// Opens (or creates) the tier; what it already holds is kept.
    pub fn open(config: DiskConfig) -> Result<NodeDisk> {
        let capacity = config.quota;
        let (tier, report) = DiskTier::open(config)?;
        if report.skipped_bytes > 0 || report.corrupt_files > 0 {
            log::warn!(
                "disk tier: {} bytes skipped, {} files with a corrupt record at reopen",
                report.skipped_bytes,
                report.corrupt_files
            );
        }
        log::info!(
            "disk tier: {} objects found in {} files",
            report.keys,
            report.files
        );
        Ok(NodeDisk { tier, capacity })
    }

    /// The tier's quota in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Keeps the value of `entry`'s object, whose pieces are `parts` in value order.
    pub fn offload(&self, entry: &CatalogEntry, parts: &[&[u8]]) -> Result<()> {
        let crc = parts.iter().fold(0, |crc, p| crc32c_append(crc, p));
        if crc != entry.crc32c {
            // Changed under us (the space was reused early): keep nothing wrong.
            return Err(Error::new(
                Code::ChecksumMismatch,
                format!(
                    "disk tier: bytes of {:?} changed before the offload",
                    entry.key
                ),
            ));
        }
        let p = prefix(entry.version, entry.crc32c);
        let mut record = Vec::with_capacity(parts.len() + 1);
        record.push(&p[..]);
        record.extend_from_slice(parts);
        self.tier.put(&entry.key, &record)
    }

    /// Reads `key` (of `version`) into `dst`, pieces in value order that together are
    /// its exact size; the bytes are checked against the object's checksum before
    /// anything is written to `dst`.
    pub fn load(&self, key: &str, version: u64, dst: &mut [&mut [u8]]) -> Result<()> {
        let value = self.tier.get(key)?;
        let (crc, stored) = parse_prefix(&value).ok_or_else(|| {
            Error::new(
                Code::ChecksumMismatch,
                format!("disk tier: {key:?} has no object prefix"),
            )
        })?;
        let bytes = &value[PREFIX..];
        let want: usize = dst.iter().map(|d| d.len()).sum();
        if stored != version || bytes.len() != want || crc32c(bytes) != crc {
            return Err(Error::new(
                Code::ObjectNotFound,
                format!(
                    "disk tier: {key:?} holds version {stored} of {} bytes, asked for version {version} of {}",
                    bytes.len(),
                    want
                ),
            ));
        }
        let mut rest = bytes;
        for d in dst.iter_mut() {
            let (head, tail) = rest.split_at(d.len());
            d.copy_from_slice(head);
            rest = tail;
        }
        Ok(())
    }

    /// Drops `key`'s copy if it is of `version` (a later version stays).
    pub fn forget(&self, key: &str, version: u64) {
        let mut p = [0u8; PREFIX];
        let stored = match self.tier.read_prefix(key, &mut p) {
            Ok(PREFIX) => parse_prefix(&p).map(|(_, v)| v),
            _ => return, // not here
        };
        if stored.is_some_and(|v| v > version) {
            return;
        }
        if let Err(e) = self.tier.remove(key) {
            log::warn!("disk tier: forgetting {key:?}: {e}");
        }
    }

    /// Whether the tier holds a copy of `key` (from its index: no disk read).
    pub fn holds(&self, key: &str) -> bool {
        self.tier.size(key).is_some()
    }

    /// Every key the tier holds (from its index: no disk read).
    pub fn keys(&self) -> Vec<String> {
        self.tier.keys()
    }

    /// Keys the tier dropped by itself since the last call.
    pub fn take_dropped(&self) -> Vec<String> {
        self.tier.take_dropped()
    }

    /// What the tier holds, as announced to a master.
    pub fn entries(&self) -> Vec<DiskEntry> {
        let mut out = Vec::new();
        for key in self.tier.keys() {
            let mut p = [0u8; PREFIX];
            let size = self.tier.size(&key).unwrap_or(0);
            match self.tier.read_prefix(&key, &mut p) {
                Ok(PREFIX) => {}
                _ => continue,
            }
            if let Some((crc32c, version)) = parse_prefix(&p) {
                out.push(DiskEntry {
                    key,
                    version,
                    size: size - PREFIX as u64,
                    crc32c,
                });
            }
        }
        out
    }
}
