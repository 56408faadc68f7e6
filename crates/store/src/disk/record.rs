//! One record of the disk tier's log: a 24-byte header, the key, the value.
//!
//! ```text
//! magic u32 "MCD1" | kind u8 | 0 u8 | key_len u16 | value_len u64 | value_crc u32 | head_crc u32
//! key bytes | value bytes
//! ```
//! Little-endian. `head_crc` is CRC32C of the first 20 header bytes and the key, so a
//! header whose lengths cannot be trusted is recognised before they are used;
//! `value_crc` covers the value and is checked on every read.

use crate::util::crc32c::{crc32c, crc32c_append};

/// "MCD1" read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"MCD1");
/// Bytes before the key.
pub const HEADER_LEN: usize = 24;
/// Longest key a record holds.
pub const MAX_KEY_LEN: usize = u16::MAX as usize;

/// What a record says about its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The key's value follows.
    Value = 1,
    /// The key was removed (no value).
    Tombstone = 2,
}

/// A decoded, checked header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Value or tombstone.
    pub kind: Kind,
    /// Key bytes after the header.
    pub key_len: usize,
    /// Value bytes after the key.
    pub value_len: u64,
    /// CRC32C of the value.
    pub value_crc: u32,
}

impl Header {
    /// Bytes of the whole record.
    pub fn record_len(&self) -> u64 {
        (HEADER_LEN + self.key_len) as u64 + self.value_len
    }
}

/// Why bytes are not a valid record header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderError {
    /// Fewer bytes than a header and its key.
    Short,
    /// Wrong magic, unknown kind or a checksum mismatch: nothing here can be trusted.
    Corrupt,
}

fn raw_header(kind: Kind, key: &[u8], value_len: u64, value_crc: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = kind as u8;
    h[6..8].copy_from_slice(&(key.len() as u16).to_le_bytes());
    h[8..16].copy_from_slice(&value_len.to_le_bytes());
    h[16..20].copy_from_slice(&value_crc.to_le_bytes());
    let head_crc = crc32c_append(crc32c(&h[..20]), key);
    h[20..24].copy_from_slice(&head_crc.to_le_bytes());
    h
}

/// Header and key of a record whose value is `value_len` bytes with CRC32C
/// `value_crc` (the value is written after it). `key` must be at most
/// [`MAX_KEY_LEN`] bytes.
pub fn encode_head(kind: Kind, key: &[u8], value_len: u64, value_crc: u32) -> Vec<u8> {
    debug_assert!(key.len() <= MAX_KEY_LEN);
    let mut out = Vec::with_capacity(HEADER_LEN + key.len());
    out.extend_from_slice(&raw_header(kind, key, value_len, value_crc));
    out.extend_from_slice(key);
    out
}

/// Decodes and checks the header and key at the start of `bytes`.
pub fn decode_head(bytes: &[u8]) -> Result<(Header, &[u8]), HeaderError> {
    let h = bytes.get(..HEADER_LEN).ok_or(HeaderError::Short)?;
    let word = |r: std::ops::Range<usize>| -> u64 {
        h[r].iter()
            .rev()
            .fold(0u64, |acc, b| (acc << 8) | u64::from(*b))
    };
    if word(0..4) as u32 != MAGIC {
        return Err(HeaderError::Corrupt);
    }
    let kind = match h[4] {
        1 => Kind::Value,
        2 => Kind::Tombstone,
        _ => return Err(HeaderError::Corrupt),
    };
    let key_len = word(6..8) as usize;
    let key = bytes
        .get(HEADER_LEN..HEADER_LEN + key_len)
        .ok_or(HeaderError::Short)?;
    if crc32c_append(crc32c(&h[..20]), key) != word(20..24) as u32 {
        return Err(HeaderError::Corrupt);
    }
    let header = Header {
        kind,
        key_len,
        value_len: word(8..16),
        value_crc: word(16..20) as u32,
    };
    if kind == Kind::Tombstone && header.value_len != 0 {
        return Err(HeaderError::Corrupt);
    }
    Ok((header, key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_round_trip() {
        let head = encode_head(Kind::Value, b"key", 5, 77);
        let (h, key) = decode_head(&head).unwrap();
        assert_eq!(
            (h.kind, h.key_len, h.value_len, h.value_crc),
            (Kind::Value, 3, 5, 77)
        );
        assert_eq!(key, b"key");
        assert_eq!(h.record_len(), 24 + 3 + 5);
    }

    #[test]
    fn any_flipped_bit_is_caught_or_short() {
        let head = encode_head(Kind::Value, b"some/key", 1 << 20, 0xdead_beef);
        for i in 0..head.len() * 8 {
            let mut bad = head.clone();
            bad[i / 8] ^= 1 << (i % 8);
            // A flipped key length may make the key look longer than the bytes given.
            assert!(decode_head(&bad).is_err(), "bit {i}");
        }
        assert_eq!(decode_head(&head[..10]), Err(HeaderError::Short));
        assert_eq!(
            decode_head(&head[..HEADER_LEN + 2]),
            Err(HeaderError::Short)
        );
    }
}
