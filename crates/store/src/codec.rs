//! The store RPC's binary encoding: little-endian integers, length-prefixed byte
//! strings and lists. Every read is bounds-checked; a short or inconsistent payload is
//! an error, never a panic.

#![forbid(unsafe_code)]

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::util::SmallList;

/// Builds a store RPC payload (little-endian, length-prefixed strings and lists).
#[derive(Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// An empty payload.
    pub fn new() -> Writer {
        Writer::default()
    }

    /// A payload built in `buf`, emptied first: a buffer kept from one payload to the
    /// next keeps its capacity.
    pub fn with_buffer(mut buf: Vec<u8>) -> Writer {
        buf.clear();
        Writer { buf }
    }

    /// Makes room for `n` more bytes: a payload whose size is known up front is
    /// written without the buffer growing step by step.
    pub fn reserve(&mut self, n: usize) -> &mut Self {
        self.buf.reserve(n);
        self
    }

    /// The bytes written so far.
    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    /// How many bytes were written so far.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether nothing was written yet.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Bytes `range` of what was written so far.
    pub fn written(&self, range: std::ops::Range<usize>) -> &[u8] {
        &self.buf[range]
    }

    /// Appends bytes already encoded, as they are.
    pub fn raw(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self
    }

    /// Appends one byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    /// Appends a bool as one byte.
    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(v as u8)
    }

    /// Appends a little-endian `u32`.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a little-endian `i32`.
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a little-endian `u64`.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a length-prefixed byte string.
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32);
        self.buf.extend_from_slice(v);
        self
    }

    /// Appends a length-prefixed UTF-8 string.
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }

    /// Appends a count, then each item through `each`.
    pub fn list<T>(&mut self, items: &[T], mut each: impl FnMut(&mut Self, &T)) -> &mut Self {
        self.u32(items.len() as u32);
        for item in items {
            each(self, item);
        }
        self
    }
}

/// What a [`Reader`] reads a list into: room made for its length (checked against
/// the payload first), then each item put.
pub trait Collection<T> {
    /// An empty collection with room for `n` items.
    fn with_room(n: usize) -> Self;
    /// Appends `item`.
    fn put(&mut self, item: T);
}

impl<T> Collection<T> for Vec<T> {
    fn with_room(n: usize) -> Self {
        Vec::with_capacity(n)
    }
    fn put(&mut self, item: T) {
        self.push(item);
    }
}

impl<T> Collection<T> for SmallList<T> {
    fn with_room(n: usize) -> Self {
        SmallList::with_capacity(n)
    }
    fn put(&mut self, item: T) {
        self.push(item);
    }
}

/// Reads a payload [`Writer`] built; every read fails cleanly on short input.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// The strings `shared_str` read last, each allocated once.
    shared: Vec<Arc<str>>,
}

/// How many distinct strings `Reader::shared_str` remembers.
const SHARED_STRINGS: usize = 16;

impl<'a> Reader<'a> {
    /// A reader at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader {
            buf,
            pos: 0,
            shared: Vec::new(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                Error::protocol(format!(
                    "payload ends at byte {} (wanted {n} more)",
                    self.buf.len()
                ))
            })?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    /// Reads one byte.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    /// Reads a bool (0 or 1).
    pub fn bool(&mut self) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(Error::protocol(format!("bad boolean {v}"))),
        }
    }

    /// Reads a little-endian `u32`.
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    /// Reads a little-endian `i32`.
    pub fn i32(&mut self) -> Result<i32> {
        Ok(i32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    /// Reads a little-endian `u64`.
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    /// Reads a length-prefixed byte string, borrowed from the payload.
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    /// Reads a length-prefixed UTF-8 string, borrowed from the payload.
    pub fn str(&mut self) -> Result<&'a str> {
        std::str::from_utf8(self.bytes()?).map_err(|_| Error::protocol("string is not UTF-8"))
    }

    /// Reads a length-prefixed UTF-8 string a payload repeats (a segment name in each
    /// of a batch's descriptors): one allocation per distinct string of the last few,
    /// shared by every place it is read.
    pub fn shared_str(&mut self) -> Result<Arc<str>> {
        let bytes = self.bytes()?;
        // Most recently read first: a batch spread over more segments than are
        // remembered still finds the ones it names most. (Bytes equal to a string
        // read before are UTF-8: only a new one is checked.)
        if let Some(i) = self.shared.iter().position(|k| k.as_bytes() == bytes) {
            self.shared[..=i].rotate_right(1);
            return Ok(self.shared[0].clone());
        }
        let s = std::str::from_utf8(bytes).map_err(|_| Error::protocol("string is not UTF-8"))?;
        let new: Arc<str> = s.into();
        self.shared.truncate(SHARED_STRINGS - 1);
        self.shared.insert(0, new.clone());
        Ok(new)
    }

    /// Reads a length-prefixed UTF-8 string into an owned `String`.
    pub fn string(&mut self) -> Result<String> {
        self.str().map(str::to_owned)
    }

    /// A list whose length is checked against the bytes left (each item takes at least
    /// `min_item` bytes), so a forged count cannot make us allocate without bound.
    pub fn list<T>(
        &mut self,
        min_item: usize,
        each: impl FnMut(&mut Self) -> Result<T>,
    ) -> Result<Vec<T>> {
        self.list_of(min_item, each)
    }

    /// As `list`, into a `Vec` or a `SmallList`. (A plain loop: collecting the items
    /// through an iterator of results cost a 64-descriptor answer twice its decode.)
    pub fn list_of<C: Collection<T>, T>(
        &mut self,
        min_item: usize,
        mut each: impl FnMut(&mut Self) -> Result<T>,
    ) -> Result<C> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_item.max(1)) > self.buf.len() - self.pos {
            return Err(Error::protocol(format!(
                "list of {n} items cannot fit the payload"
            )));
        }
        let mut out = C::with_room(n);
        for _ in 0..n {
            out.put(each(self)?);
        }
        Ok(out)
    }

    /// Fails unless every byte was consumed.
    pub fn finish(&self) -> Result<()> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(Error::protocol(format!(
                "{} trailing bytes",
                self.buf.len() - self.pos
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation() {
        let mut w = Writer::new();
        w.u8(7)
            .bool(true)
            .u32(9)
            .i32(-704)
            .u64(u64::MAX)
            .str("kv")
            .list(&[1u64, 2], |w, v| {
                w.u64(*v);
            });
        let bytes = w.into_bytes();
        let mut r = Reader::new(&bytes);
        assert_eq!(r.u8().unwrap(), 7);
        assert!(r.bool().unwrap());
        assert_eq!(r.u32().unwrap(), 9);
        assert_eq!(r.i32().unwrap(), -704);
        assert_eq!(r.u64().unwrap(), u64::MAX);
        assert_eq!(r.str().unwrap(), "kv");
        assert_eq!(r.list(8, |r| r.u64()).unwrap(), vec![1, 2]);
        r.finish().unwrap();
        for cut in 0..bytes.len() {
            let mut r = Reader::new(&bytes[..cut]);
            let all = (|| -> Result<()> {
                r.u8()?;
                r.bool()?;
                r.u32()?;
                r.i32()?;
                r.u64()?;
                r.str()?;
                r.list(8, |r| r.u64())?;
                Ok(())
            })();
            assert!(all.is_err(), "cut at {cut}");
        }
        let forged = [0xff, 0xff, 0xff, 0x7f];
        assert!(Reader::new(&forged).list(8, |r| r.u64()).is_err());
    }

    #[test]
    fn a_repeated_string_is_allocated_once_and_every_one_reads_right() {
        let names: Vec<String> = (0..20).map(|i| format!("seg-{}", i % 10)).collect();
        let mut w = Writer::new();
        for n in &names {
            w.str(n).str(n);
        }
        let bytes = w.into_bytes();
        let mut r = Reader::new(&bytes);
        for n in &names {
            let (a, b) = (r.shared_str().unwrap(), r.shared_str().unwrap());
            assert_eq!((&*a, &*b), (n.as_str(), n.as_str()));
            assert!(Arc::ptr_eq(&a, &b), "{n} read twice in a row");
        }
        r.finish().unwrap();
        assert!(Reader::new(&[3, 0, 0, 0, 0xff, 0xfe, 0xfd])
            .shared_str()
            .is_err());
    }
}
