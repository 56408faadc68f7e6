//! Put and get sessions (Mooncake's `batch_put_session_*` and `batch_get_session_*`):
//! the master is asked once per object, then byte ranges move between caller buffers
//! and the object with no master round trip, as layer-wise KV saves and loads want.
//!
//! A put session reserves the object (`PutStart`); range writes go straight to its
//! replicas; its end makes the object readable (`PutEnd`) with the checksum of what was
//! written (folded from the ranges when they tile the object, else read back once), and
//! a revoke drops it (`PutRevoke`). End and revoke seal the session first and wait for
//! range writes in flight. A get session keeps the object's descriptor and the lease
//! that came with it; range reads use it until the lease ends (`LEASE_EXPIRED`, and the
//! session is gone).

use crate::util::sync::Unpoisoned;
use std::collections::{HashMap, HashSet};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use super::{all_err, fragments, positions, Client, Fragments, ReadInto};
use crate::error::{Code, Error, Result};
use crate::protocol::{shown_key, KeyResult, ReplicaDesc, ReplicateConfig, Request, Response};
use crate::replica_cache::Leased;
use crate::transport::Op;
use crate::util::crc32c::{crc32c, crc32c_append, crc32c_combine};

/// An object reserved by `put_session_start` and not yet ended or revoked.
struct PutSession {
    size: u64,
    replicas: Vec<ReplicaDesc>,
    /// False once an end or revoke began: no new range write starts.
    writable: bool,
    /// Range writes in flight.
    writing: u32,
    /// What the range writes stored: `(offset, len, crc32c)` each.
    written: Vec<(u64, u64, u32)>,
}

#[derive(Default)]
struct State {
    puts: HashMap<String, PutSession>,
    gets: HashMap<String, Leased>,
}

/// The sessions of one client.
#[derive(Default)]
pub(super) struct Sessions {
    state: Mutex<State>,
    /// Signalled when range writes end (ends and revokes wait for them).
    idle: Condvar,
}

impl Sessions {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.locked()
    }

    /// Seals the put sessions of `keys` and waits until no range write runs in them;
    /// per key, its size and replicas, or why it has no session (or is named twice).
    fn seal(&self, keys: &[&str]) -> Vec<Result<(u64, Vec<ReplicaDesc>)>> {
        let mut seen = HashSet::new();
        let mut state = self.lock();
        let out: Vec<_> = keys
            .iter()
            .map(|k| {
                if !seen.insert(*k) {
                    return Err(Error::invalid(format!("{} named twice", shown_key(k))));
                }
                let s = state.puts.get_mut(*k).ok_or_else(|| no_session("put", k))?;
                s.writable = false;
                Ok((s.size, s.replicas.clone()))
            })
            .collect();
        while keys
            .iter()
            .any(|k| state.puts.get(*k).is_some_and(|s| s.writing > 0))
        {
            state = self.idle.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        out
    }
}

fn no_session(kind: &str, key: &str) -> Error {
    Error::invalid(format!("no open {kind} session for {}", shown_key(key)))
}

/// The CRC32C of a `size`-byte object whose bytes `written` covers exactly once, in
/// pieces; None when the pieces overlap or leave gaps.
fn tiled_crc(written: &mut [(u64, u64, u32)], size: u64) -> Option<u32> {
    written.sort_unstable_by_key(|w| w.0);
    let mut crc = 0;
    let mut end = 0;
    for &(off, len, c) in written.iter() {
        if off != end {
            return None;
        }
        crc = crc32c_combine(crc, c, len);
        end += len;
    }
    (end == size).then_some(crc)
}

impl Client {
    /// Reserves each key for `sizes[i]` bytes (Mooncake's `batch_put_session_start`):
    /// per key, success or why not (`INVALID_PARAMS` when it has a put session already,
    /// the master's code otherwise, e.g. `OBJECT_ALREADY_EXISTS`).
    pub fn put_session_start(
        &self,
        keys: &[&str],
        sizes: &[u64],
        config: &ReplicateConfig,
    ) -> Vec<Result<()>> {
        if keys.len() != sizes.len() {
            return all_err(keys.len(), Error::invalid("keys and sizes differ in count"));
        }
        let mut results: Vec<Result<()>> = Vec::with_capacity(keys.len());
        let mut asked = Vec::new();
        {
            let state = self.sessions.lock();
            let mut seen = HashSet::new();
            for (i, k) in keys.iter().enumerate() {
                if state.puts.contains_key(*k) || !seen.insert(*k) {
                    results.push(Err(Error::invalid(format!(
                        "{} has a put session already",
                        shown_key(k)
                    ))));
                } else {
                    results.push(Ok(()));
                    asked.push(i);
                }
            }
        }
        if asked.is_empty() {
            return results;
        }
        self.shared.cache.drop_keys(asked.iter().map(|&i| keys[i]));
        let req = Request::PutStart {
            client: self.shared.id,
            items: asked
                .iter()
                .map(|&i| (keys[i].to_owned(), sizes[i]))
                .collect(),
            config: config.clone(),
            upsert: false,
        };
        let answers = match self.call(req) {
            Ok(Response::PutStart(r)) if r.len() == asked.len() => r,
            Ok(other) => {
                let e = Error::protocol(format!("unexpected answer {other:?}"));
                return all_err(keys.len(), e);
            }
            Err(e) => return all_err(keys.len(), e),
        };
        let mut state = self.sessions.lock();
        for (&i, answer) in asked.iter().zip(answers) {
            match answer {
                Ok(replicas) => {
                    let session = PutSession {
                        size: sizes[i],
                        replicas,
                        writable: true,
                        writing: 0,
                        written: Vec::new(),
                    };
                    state.puts.insert(keys[i].to_owned(), session);
                }
                Err(code) => {
                    results[i] = Err(Error::new(
                        code,
                        format!("put session of {}", shown_key(keys[i])),
                    ))
                }
            }
        }
        results
    }

    /// Writes byte ranges into objects of open put sessions (Mooncake's
    /// `batch_put_from_multi_buffer_ranges`): per key, `(object offset, local address,
    /// length)` ranges; per key the bytes written or an error (`INVALID_PARAMS` for no
    /// open session or a range past the object's end). No master round trip.
    ///
    /// # Safety
    /// Every range's local memory must be readable for its length until the call
    /// returns.
    pub unsafe fn put_session_write(
        &self,
        keys: &[&str],
        ranges: &[Fragments],
    ) -> Vec<Result<u64>> {
        if keys.len() != ranges.len() {
            return all_err(
                keys.len(),
                Error::invalid("keys and ranges differ in count"),
            );
        }
        let mut results: Vec<Result<u64>> = Vec::with_capacity(keys.len());
        let mut plan = Vec::new();
        {
            let mut state = self.sessions.lock();
            let mut seen = HashSet::new();
            for (i, k) in keys.iter().enumerate() {
                let session = match state.puts.get_mut(*k) {
                    Some(s) if s.writable && seen.insert(*k) => s,
                    Some(s) if s.writable => {
                        results.push(Err(Error::invalid(format!("{} named twice", shown_key(k)))));
                        continue;
                    }
                    _ => {
                        results.push(Err(no_session("put", k)));
                        continue;
                    }
                };
                match Self::fits(k, session.size, &ranges[i], &ReadInto::Ranges(ranges)) {
                    Ok(n) => {
                        session.writing += 1;
                        plan.extend(session.replicas.iter().map(|r| (i, r.clone())));
                        results.push(Ok(n));
                    }
                    Err(e) => results.push(Err(e)),
                }
            }
        }
        let writing: Vec<usize> = positions(keys.len(), |i| results[i].is_ok());
        if writing.is_empty() {
            return results;
        }
        // The checksum of each range, while it is at hand (the session's end needs it).
        let crcs: Vec<Vec<(u64, u64, u32)>> = writing
            .iter()
            .map(|&i| {
                ranges[i]
                    .iter()
                    .filter(|r| r.2 > 0)
                    // SAFETY: the caller keeps every range readable for the call.
                    .map(|&(off, addr, len)| (off, len, unsafe { range_crc(addr, len) }))
                    .collect()
            })
            .collect();
        let plan: Vec<(usize, &ReplicaDesc)> = plan.iter().map(|(i, r)| (*i, r)).collect();
        let outcome = self.move_replicas(Op::Write, &plan, ranges, None, &[]);
        let mut state = self.sessions.lock();
        for (&i, crcs) in writing.iter().zip(crcs) {
            let Some(session) = state.puts.get_mut(keys[i]) else {
                continue; // cannot happen: ends and revokes wait for this write
            };
            session.writing -= 1;
            match &outcome[i] {
                Some(Err(e)) => results[i] = Err(e.clone()),
                _ => session.written.extend(crcs),
            }
        }
        self.sessions.idle.notify_all();
        results
    }

    /// Makes the objects of put sessions readable and closes the sessions (Mooncake's
    /// `batch_put_session_end`). A key whose end fails keeps its session (end it again
    /// or revoke it); `INVALID_PARAMS` for a key with no session.
    pub fn put_session_end(&self, keys: &[&str]) -> Vec<Result<()>> {
        let sealed = self.sessions.seal(keys);
        let mut results: Vec<Result<()>> = Vec::with_capacity(keys.len());
        let mut items = Vec::new();
        let mut ending = Vec::new();
        for (i, s) in sealed.into_iter().enumerate() {
            let crc = s.and_then(|(size, replicas)| self.session_crc(keys[i], size, &replicas));
            match crc {
                Ok(crc) => {
                    items.push((keys[i].to_owned(), crc));
                    ending.push(i);
                    results.push(Ok(()));
                }
                Err(e) => results.push(Err(e)),
            }
        }
        if items.is_empty() {
            return results;
        }
        let req = Request::PutEnd {
            client: self.shared.id,
            items,
        };
        let Some(answers) = self.asked_per_key(req, "PutEnd", &ending, &mut results) else {
            return results;
        };
        let mut state = self.sessions.lock();
        for (&i, answer) in ending.iter().zip(answers) {
            match answer {
                Ok(()) => {
                    state.puts.remove(keys[i]);
                }
                Err(code) => {
                    let what = format!("ending the put session of {}", shown_key(keys[i]));
                    results[i] = Err(Error::new(code, what));
                }
            }
        }
        results
    }

    /// The master's per-key answers to `req` (`name` in errors), which asks about the
    /// keys at `asked` of a batch. Without them the batch's `results` say why and `None`
    /// comes back: the call's error for the asked keys, or a protocol error for every key
    /// when the answer has another shape.
    fn asked_per_key(
        &self,
        req: Request,
        name: &str,
        asked: &[usize],
        results: &mut [Result<()>],
    ) -> Option<Vec<KeyResult<()>>> {
        match self.call(req) {
            Ok(Response::PerKey(r)) if r.len() == asked.len() => Some(r),
            Ok(other) => {
                let e = Error::protocol(format!("unexpected {name} answer {other:?}"));
                results.fill(Err(e));
                None
            }
            Err(e) => {
                for &i in asked {
                    results[i] = Err(e.clone());
                }
                None
            }
        }
    }

    /// The checksum of what the sealed put session of `key` stored: folded from its
    /// range writes when they tile the object, else read back from a replica.
    fn session_crc(&self, key: &str, size: u64, replicas: &[ReplicaDesc]) -> Result<u32> {
        let folded = self
            .sessions
            .lock()
            .puts
            .get_mut(key)
            .and_then(|s| tiled_crc(&mut s.written, size));
        if let Some(crc) = folded {
            return Ok(crc);
        }
        let mut bytes = vec![0u8; size as usize];
        let frags = [fragments(&[(bytes.as_mut_ptr() as u64, size)])];
        let mut last = Error::new(Code::InvalidReplica, "no replica to read back");
        for replica in replicas {
            let plan = [(0, replica)];
            match self.move_replicas(Op::Read, &plan, &frags, None, &[]).pop() {
                Some(Some(Ok(()))) => return Ok(crc32c(&bytes)),
                Some(Some(Err(e))) => last = e,
                _ => {}
            }
        }
        Err(Error::new(
            last.code(),
            format!("reading back {}: {}", shown_key(key), last.context()),
        ))
    }

    /// Drops the objects of put sessions and closes the sessions (Mooncake's
    /// `batch_put_session_revoke`); an object the master no longer has counts as
    /// dropped. A key whose revoke fails keeps its session.
    pub fn put_session_revoke(&self, keys: &[&str]) -> Vec<Result<()>> {
        let sealed = self.sessions.seal(keys);
        let revoking: Vec<usize> = positions(keys.len(), |i| sealed[i].is_ok());
        let mut results: Vec<Result<()>> = sealed.into_iter().map(|s| s.map(drop)).collect();
        if revoking.is_empty() {
            return results;
        }
        let req = Request::PutRevoke {
            client: self.shared.id,
            keys: revoking.iter().map(|&i| keys[i].to_owned()).collect(),
        };
        let Some(answers) = self.asked_per_key(req, "PutRevoke", &revoking, &mut results) else {
            return results;
        };
        let mut state = self.sessions.lock();
        for (&i, answer) in revoking.iter().zip(answers) {
            match answer {
                Ok(()) | Err(Code::ObjectNotFound) => {
                    state.puts.remove(keys[i]);
                }
                Err(code) => {
                    let what = format!("revoking the put session of {}", shown_key(keys[i]));
                    results[i] = Err(Error::new(code, what));
                }
            }
        }
        results
    }

    /// Looks each key up once and keeps its descriptor and lease for range reads
    /// (Mooncake's `batch_get_session_start`); per key success or the master's code. A
    /// key that had a session gets a fresh one.
    pub fn get_session_start(&self, keys: &[&str]) -> Vec<Result<()>> {
        let asked = Instant::now();
        let found = self.replicas(keys);
        let mut state = self.sessions.lock();
        keys.iter()
            .zip(found)
            .map(|(k, desc)| {
                state.gets.remove(*k);
                let desc = desc?;
                state
                    .gets
                    .insert((*k).to_owned(), Leased::granted(desc, asked));
                Ok(())
            })
            .collect()
    }

    /// Reads byte ranges of objects with a get session (Mooncake's
    /// `batch_get_into_multi_buffer_ranges`), with no master round trip: per key the
    /// bytes read or an error (`INVALID_PARAMS` for no session or a range past the
    /// end, `LEASE_EXPIRED` once the session's lease is over, which ends it).
    ///
    /// # Safety
    /// As `batch_get_ranges`.
    pub unsafe fn get_session_read(&self, keys: &[&str], ranges: &[Fragments]) -> Vec<Result<u64>> {
        if keys.len() != ranges.len() {
            return all_err(
                keys.len(),
                Error::invalid("keys and ranges differ in count"),
            );
        }
        let now = Instant::now();
        let leased: Vec<Result<Leased>> = {
            let mut state = self.sessions.lock();
            keys.iter()
                .map(|k| match state.gets.get(*k) {
                    None => Err(no_session("get", k)),
                    Some(l) if now >= l.lease_ends => {
                        state.gets.remove(*k);
                        Err(lease_over(k))
                    }
                    Some(l) => Ok(l.clone()),
                })
                .collect()
        };
        // SAFETY: the caller's contract, passed on unchanged.
        let results = unsafe { self.read_objects(keys, &leased, &ReadInto::Ranges(ranges)) };
        let mut state = self.sessions.lock();
        for (k, r) in keys.iter().zip(&results) {
            if matches!(r, Err(e) if e.code() == Code::LeaseExpired) {
                state.gets.remove(*k);
            }
        }
        results
    }

    /// Ends the get sessions of `keys` (keys without one are ignored).
    pub fn get_session_end(&self, keys: &[&str]) {
        let mut state = self.sessions.lock();
        for k in keys {
            state.gets.remove(*k);
        }
    }
}

fn lease_over(key: &str) -> Error {
    Error::new(
        Code::LeaseExpired,
        format!("the get session of {} outlived its lease", shown_key(key)),
    )
}

/// CRC32C of `len` bytes at `addr`.
///
/// # Safety
/// `[addr, addr+len)` must be readable.
unsafe fn range_crc(addr: u64, len: u64) -> u32 {
    // SAFETY: the caller guarantees the range is readable.
    crc32c_append(0, unsafe {
        std::slice::from_raw_parts(addr as *const u8, len as usize)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_that_tile_the_object_give_its_crc() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let piece = |a: usize, b: usize| (a as u64, (b - a) as u64, crc32c(&data[a..b]));
        let mut out_of_order = vec![piece(600, 1000), piece(0, 250), piece(250, 600)];
        assert_eq!(tiled_crc(&mut out_of_order, 1000), Some(crc32c(&data)));
        // A gap, an overlap, or a short cover gives nothing to fold.
        assert_eq!(
            tiled_crc(&mut [piece(0, 250), piece(300, 1000)], 1000),
            None
        );
        assert_eq!(
            tiled_crc(&mut [piece(0, 300), piece(250, 1000)], 1000),
            None
        );
        assert_eq!(tiled_crc(&mut [piece(0, 999)], 1000), None);
    }
}
