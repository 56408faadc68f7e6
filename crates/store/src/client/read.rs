//! The read path: descriptors (kept ones first, then the master's), whole objects
//! into caller memory, into memory placed once sizes are known, and byte ranges; each
//! key tried on its replicas in preference order, whole objects checked against their
//! checksum.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{all_err, fragments, one, positions, Client, FragmentList, Fragments, Parts};
use crate::error::{Code, Error, Result};
use crate::protocol::{shown_key, ObjectDesc, ReplicaDesc, Request, Response};
use crate::replica_cache::{Leased, Looked};
use crate::transport::Op;
use crate::util::SmallList;

/// What a read fills: whole objects (into parts, or into one span each), or byte
/// ranges of them.
pub(super) enum ReadInto<'a> {
    Whole(&'a [Parts]),
    Spans(&'a [(u64, u64)]),
    Ranges(&'a [Fragments]),
}

impl ReadInto<'_> {
    /// Whether whole objects are read (checked against their checksum, and fitting
    /// their buffers), not ranges of them.
    fn is_whole(&self) -> bool {
        !matches!(self, ReadInto::Ranges(_))
    }

    /// The bytes of caller memory the read fills at most.
    fn total_len(&self) -> u64 {
        let sum = |lens: &mut dyn Iterator<Item = u64>| lens.fold(0u64, u64::saturating_add);
        match self {
            ReadInto::Whole(parts) => sum(&mut parts.iter().flatten().map(|p| p.1)),
            ReadInto::Spans(spans) => sum(&mut spans.iter().map(|s| s.1)),
            ReadInto::Ranges(ranges) => sum(&mut ranges.iter().flatten().map(|r| r.2)),
        }
    }

    /// What keys `which` (in that order) are read into, copied.
    fn subset(&self, which: &[usize]) -> IntoSubset {
        match self {
            ReadInto::Whole(parts) => {
                IntoSubset::Whole(which.iter().map(|&i| parts[i].clone()).collect())
            }
            ReadInto::Spans(spans) => IntoSubset::Spans(which.iter().map(|&i| spans[i]).collect()),
            ReadInto::Ranges(ranges) => {
                IntoSubset::Ranges(which.iter().map(|&i| ranges[i].clone()).collect())
            }
        }
    }
}

/// Some keys' part of a `ReadInto`, owned.
enum IntoSubset {
    Whole(Vec<Parts>),
    Spans(Vec<(u64, u64)>),
    Ranges(Vec<Fragments>),
}

impl IntoSubset {
    fn as_into(&self) -> ReadInto<'_> {
        match self {
            IntoSubset::Whole(parts) => ReadInto::Whole(parts),
            IntoSubset::Spans(spans) => ReadInto::Spans(spans),
            IntoSubset::Ranges(ranges) => ReadInto::Ranges(ranges),
        }
    }
}

/// Keys to ask the master for, from which a batch is read in two steps (see
/// `Client::lease_and_read`).
const PIPELINE_FROM: usize = 32;
/// Bytes a batch read in two steps fills at most: past this its copies, not the
/// master's lookups, take its time, and one engine batch spreads them best.
const PIPELINE_MAX_BYTES: u64 = 4 << 20;

/// `size` zeroed bytes, or None when this process cannot have them: the size is the
/// master's word, and a key whose value does not fit fails (`INVALID_PARAMS`) rather
/// than the process aborting. Zeroed by the allocator, so a large buffer's pages are
/// not written twice (once with zeros, once with the value).
fn zeroed(size: u64) -> Option<Vec<u8>> {
    let n = usize::try_from(size).ok()?;
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(n).ok()?;
    // SAFETY: the layout's size is not zero.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` is the global allocator's, for exactly this layout (n bytes, align 1),
    // and every byte is initialised (zeroed).
    Some(unsafe { Vec::from_raw_parts(p, n, n) })
}

impl Client {
    /// Reads `key` into a new vector.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        one(self.batch_get(&[key]))
    }

    /// Reads several keys, each into a new vector of its size (see
    /// [`batch_get_placed`](Self::batch_get_placed)).
    pub fn batch_get(&self, keys: &[&str]) -> Vec<Result<Vec<u8>>> {
        let mut bufs: Vec<Vec<u8>> = vec![Vec::new(); keys.len()];
        // SAFETY: each address is of a vector `bufs` owns, as long as asked; a vector is
        // replaced only when its key is placed again, after the read into it returned.
        let sizes = unsafe {
            self.batch_get_placed(keys, &mut |i, size| {
                bufs[i] = zeroed(size)?;
                Some(bufs[i].as_mut_ptr() as u64)
            })
        };
        sizes
            .into_iter()
            .zip(bufs)
            .map(|(r, b)| r.map(|_| b))
            .collect()
    }

    /// Reads several keys into memory the caller places once their sizes are known:
    /// `place(i, size)` gives the address of `size` writable bytes for key `i` (None:
    /// that key fails with `INVALID_PARAMS`). Per key the object's size or an error. One
    /// master round trip for the descriptors not kept, one engine batch; a key whose
    /// kept descriptor failed is asked of the master once more and placed again (the
    /// object may have moved or been replaced): its last place gets the bytes.
    ///
    /// # Safety
    /// Every address `place` gives must stay writable for its size, and untouched by
    /// others, until the call returns or the key is placed again.
    pub unsafe fn batch_get_placed(
        &self,
        keys: &[&str],
        place: &mut dyn FnMut(usize, u64) -> Option<u64>,
    ) -> Vec<Result<u64>> {
        let all: Vec<usize> = (0..keys.len()).collect();
        // SAFETY: this fn's contract, passed on.
        let (mut results, retry) =
            unsafe { self.read_placed(keys, &all, self.leased(keys), place) };
        if !retry.is_empty() {
            let again: Vec<&str> = retry.iter().map(|&i| keys[i]).collect();
            let keep = self.keep_all(again.len());
            let fresh = self.fetch(&again, keep.as_deref(), &mut || {});
            // SAFETY: as above.
            let (redone, _) = unsafe { self.read_placed(&again, &retry, fresh, place) };
            for (&i, r) in retry.iter().zip(redone) {
                results[i] = r;
            }
        }
        results
    }

    /// Reads each key's object, as `leased` describes it, where `place` puts it
    /// (`index[j]`: key `j`'s number for `place`): the results, and the keys (numbered
    /// as `index`) whose kept descriptor failed them.
    ///
    /// # Safety
    /// As [`batch_get_placed`](Self::batch_get_placed).
    unsafe fn read_placed(
        &self,
        keys: &[&str],
        index: &[usize],
        mut leased: Vec<Result<Leased>>,
        place: &mut dyn FnMut(usize, u64) -> Option<u64>,
    ) -> (Vec<Result<u64>>, Vec<usize>) {
        let mut parts: Vec<Parts> = Vec::with_capacity(keys.len());
        for (j, l) in leased.iter_mut().enumerate() {
            let size = match l {
                Ok(l) => l.desc.size,
                Err(_) => {
                    parts.push(Parts::new());
                    continue;
                }
            };
            match place(index[j], size) {
                Some(addr) => parts.push(vec![(addr, size)]),
                None => {
                    *l = Err(Error::invalid(format!("no memory placed for {}", keys[j])));
                    parts.push(Parts::new());
                }
            }
        }
        // SAFETY: every part is a place the caller keeps writable for its size until
        // this returns (this fn's contract); the read waits for its transfers.
        let reads = unsafe { self.read_objects(keys, &leased, &ReadInto::Whole(&parts)) };
        let cached = |j: usize| matches!(&leased[j], Ok(l) if l.cached);
        let hits: Vec<String> = (0..keys.len())
            .filter(|&j| cached(j) && reads[j].is_ok())
            .map(|j| keys[j].to_owned())
            .collect();
        let retry: Vec<usize> = (0..keys.len())
            .filter(|&j| cached(j) && reads[j].is_err())
            .map(|j| index[j])
            .collect();
        let wrong = (0..keys.len()).filter(|&j| leased[j].is_ok() && reads[j].is_err());
        self.shared.cache.drop_keys(wrong.map(|j| keys[j]));
        self.touched(hits);
        (reads, retry)
    }

    /// Descriptors for `keys`: kept ones where the cache has them, the rest from the
    /// master in one round trip (kept for next time when their keys were read lately).
    fn leased(&self, keys: &[&str]) -> Vec<Result<Leased>> {
        let (leased, keep) = self.look_up(keys);
        self.lease_missing(keys, leased, keep.as_deref())
    }

    /// Every key's descriptor: `leased`'s where it has one, the others' asked of the
    /// master in one round trip (kept as `keep` says).
    fn lease_missing(
        &self,
        keys: &[&str],
        mut leased: Vec<Option<Result<Leased>>>,
        keep: Option<&[bool]>,
    ) -> Vec<Result<Leased>> {
        let missing: Vec<usize> = positions(keys.len(), |i| leased[i].is_none());
        let fresh = self.ask(keys, &missing, keep, &mut || {});
        Self::fill(&mut leased, &missing, fresh);
        leased.into_iter().map(Self::found).collect()
    }

    /// The cache's word on `keys`: each key's kept descriptor (None: the master is to
    /// be asked), and whether the descriptor of a key asked for is to be kept (None
    /// when descriptors are not kept).
    fn look_up(&self, keys: &[&str]) -> (Vec<Option<Result<Leased>>>, Option<Vec<bool>>) {
        if !self.caching() {
            return (keys.iter().map(|_| None).collect(), None);
        }
        let mut keep = Vec::with_capacity(keys.len());
        let leased = (self.shared.cache.look_up(keys, Instant::now()).into_iter())
            .map(|l| {
                keep.push(matches!(l, Looked::ReadBefore));
                match l {
                    Looked::Kept(kept) => Some(Ok(kept)),
                    Looked::ReadBefore | Looked::New => None,
                }
            })
            .collect();
        (leased, Some(keep))
    }

    /// The descriptors of keys `which` from the master, kept for next time as `keep`
    /// (per key of `keys`) says; `meanwhile` runs once while the master works (see
    /// `fetch`).
    fn ask(
        &self,
        keys: &[&str],
        which: &[usize],
        keep: Option<&[bool]>,
        meanwhile: &mut dyn FnMut(),
    ) -> Vec<Result<Leased>> {
        if which.is_empty() {
            meanwhile();
            return Vec::new();
        }
        let asked: Vec<&str> = which.iter().map(|&i| keys[i]).collect();
        let keep = keep.map(|keep| which.iter().map(|&i| keep[i]).collect::<Vec<bool>>());
        self.fetch(&asked, keep.as_deref(), meanwhile)
    }

    /// Puts descriptors `got` (of keys `which`) in their keys' places.
    fn fill(leased: &mut [Option<Result<Leased>>], which: &[usize], got: Vec<Result<Leased>>) {
        for (&i, g) in which.iter().zip(got) {
            leased[i] = Some(g);
        }
    }

    fn found(l: Option<Result<Leased>>) -> Result<Leased> {
        l.unwrap_or_else(|| Err(Error::new(Code::Internal, "no descriptor")))
    }

    /// Descriptors for `keys` from the master (one round trip); with `keep`, key `i`'s
    /// is kept for next time when `keep[i]` and the master allows it. `meanwhile` runs
    /// once, while the master works on the request when it can.
    fn fetch(
        &self,
        keys: &[&str],
        keep: Option<&[bool]>,
        meanwhile: &mut dyn FnMut(),
    ) -> Vec<Result<Leased>> {
        // The lease counts from before the request left: a conservative reading.
        let asked = Instant::now();
        // A master that says what is keepable also says what it staged from disk.
        if keep.is_none() && !self.shared.master_keeps() {
            meanwhile();
            return self
                .replicas(keys)
                .into_iter()
                .map(|r| r.map(|d| Leased::granted(d, asked)))
                .collect();
        }
        let answer = match self.shared.lookup(keys, meanwhile) {
            Ok(Response::Keepable { descs, keepable })
                if descs.len() == keys.len() && keepable.len() == keys.len() =>
            {
                descs.into_iter().zip(keepable)
            }
            Ok(other) => {
                let e = Error::protocol(format!("unexpected answer {other:?}"));
                return all_err(keys.len(), e);
            }
            Err(e) => return all_err(keys.len(), e),
        };
        let answered = Instant::now();
        let granted: Vec<Result<Leased>> = answer
            .zip(keys)
            .map(|((desc, keepable), k)| {
                let desc = desc.map_err(|c| Error::new(c, format!("get {}", shown_key(k))))?;
                let mut leased = Leased::granted(desc, asked);
                if !keepable {
                    // Not keepable: a copy staged from disk for this reader.
                    self.shared.disk_reads.fetch_add(1, Ordering::Relaxed);
                    leased.staged = true;
                }
                Ok(leased)
            })
            .collect();
        if let Some(keep) = keep.filter(|k| k.contains(&true)) {
            let kept = keys
                .iter()
                .zip(&granted)
                .zip(keep)
                .filter_map(|((k, g), &keep)| {
                    let l = g.as_ref().ok()?;
                    (keep && !l.staged).then_some((*k, l))
                });
            self.shared.cache.keep_many(kept, answered);
        }
        granted
    }

    /// Keep every one of `n` descriptors (keys read again after a kept descriptor of
    /// theirs failed): None when descriptors are not kept.
    fn keep_all(&self, n: usize) -> Option<Vec<bool>> {
        self.caching().then(|| vec![true; n])
    }

    /// Queues reads served from kept descriptors for the master's eviction order,
    /// sending them now when they are due.
    fn touched(&self, keys: Vec<String>) {
        if self.shared.cache.touched(keys) {
            self.shared.flush_touches();
        }
    }

    /// Reads `keys` into `into` with descriptors from `leased`; a key whose kept
    /// descriptor failed is read once more with a fresh one from the master.
    ///
    /// # Safety
    /// As `batch_get_into`.
    unsafe fn read_leased(&self, keys: &[&str], into: ReadInto) -> Vec<Result<u64>> {
        // SAFETY: the caller's contract, passed on unchanged.
        let (leased, mut results) = unsafe { self.lease_and_read(keys, &into) };
        let failed_cached =
            |i: usize| matches!(&leased[i], Ok(l) if l.cached) && results[i].is_err();
        let retry: Vec<usize> = positions(keys.len(), failed_cached);
        let hits: Vec<String> = (0..keys.len())
            .filter(|&i| matches!(&leased[i], Ok(l) if l.cached) && results[i].is_ok())
            .map(|i| keys[i].to_owned())
            .collect();
        let wrong = (0..keys.len()).filter(|&i| leased[i].is_ok() && results[i].is_err());
        self.shared.cache.drop_keys(wrong.map(|i| keys[i]));
        if !retry.is_empty() {
            let again: Vec<&str> = retry.iter().map(|&i| keys[i]).collect();
            let sub = into.subset(&retry);
            // SAFETY: a subset of the caller's buffers, under the same contract.
            let redone = unsafe { self.read_fresh(&again, sub.as_into()) };
            for (&i, r) in retry.iter().zip(redone) {
                results[i] = r;
            }
        }
        self.touched(hits);
        results
    }

    /// The descriptors of `keys` (as `leased` gets them) and what reading into `into`
    /// with them gave. A batch of small values with many keys to ask the master for
    /// (of a master that keeps descriptors: an older one answers another request)
    /// asks for a third of them first, then for the rest, and reads the keys it has
    /// (those, and the kept ones) while the master looks the rest up: the master's time
    /// for most keys is spent beside this client's copying rather than before it.
    ///
    /// # Safety
    /// As `batch_get_into`.
    unsafe fn lease_and_read(
        &self,
        keys: &[&str],
        into: &ReadInto,
    ) -> (Vec<Result<Leased>>, Vec<Result<u64>>) {
        let (mut leased, keep) = self.look_up(keys);
        let missing: Vec<usize> = positions(keys.len(), |i| leased[i].is_none());
        let pipelined = missing.len() >= PIPELINE_FROM
            && into.total_len() <= PIPELINE_MAX_BYTES
            && self.shared.master_keeps();
        if !pipelined {
            let leased = self.lease_missing(keys, leased, keep.as_deref());
            // SAFETY: the caller's contract, passed on unchanged.
            let results = unsafe { self.read_objects(keys, &leased, into) };
            return (leased, results);
        }
        let (first, rest) = missing.split_at(missing.len() / 3);
        let got = self.ask(keys, first, keep.as_deref(), &mut || {});
        // A master away or silent for the first keys would be for the rest too: they
        // fail alike rather than wait as long again.
        let away = got
            .iter()
            .all(|g| matches!(g, Err(e) if matches!(e.code(), Code::RpcFail | Code::Timeout)));
        let away = away.then(|| got.first().cloned()).flatten();
        Self::fill(&mut leased, first, got);
        // Every key but the rest's is ready now.
        let ready: Vec<usize> = positions(keys.len(), |i| leased[i].is_some());
        let ready_leased: Vec<Result<Leased>> = ready
            .iter()
            .map(|&i| Self::found(leased[i].take()))
            .collect();
        let mut ready_read = Vec::new();
        let mut read_ready = || {
            // SAFETY: the caller's contract, passed on unchanged.
            ready_read = unsafe { self.read_subset(keys, into, &ready, &ready_leased) };
        };
        let rest_leased = match away {
            Some(e) => {
                read_ready();
                rest.iter().map(|_| e.clone()).collect()
            }
            None => self.ask(keys, rest, keep.as_deref(), &mut read_ready),
        };
        // SAFETY: as above.
        let rest_read = unsafe { self.read_subset(keys, into, rest, &rest_leased) };
        debug_assert_eq!(ready_read.len(), ready.len());
        debug_assert_eq!(rest_read.len(), rest.len());
        let mut results: Vec<Option<Result<u64>>> = keys.iter().map(|_| None).collect();
        Self::fill(&mut leased, &ready, ready_leased);
        Self::fill(&mut leased, rest, rest_leased);
        for (which, read) in [(&ready[..], ready_read), (rest, rest_read)] {
            for (&i, r) in which.iter().zip(read) {
                results[i] = Some(r);
            }
        }
        let leased = leased.into_iter().map(Self::found).collect();
        let results = results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(Error::new(Code::Internal, "no read"))))
            .collect();
        (leased, results)
    }

    /// Reads keys `which` of `keys` into their part of `into`, with `leased` (theirs,
    /// in that order).
    ///
    /// # Safety
    /// As `batch_get_into`.
    unsafe fn read_subset(
        &self,
        keys: &[&str],
        into: &ReadInto,
        which: &[usize],
        leased: &[Result<Leased>],
    ) -> Vec<Result<u64>> {
        let sub_keys: Vec<&str> = which.iter().map(|&i| keys[i]).collect();
        let sub = into.subset(which);
        // SAFETY: a subset of the caller's buffers, under the caller's contract.
        unsafe { self.read_objects(&sub_keys, leased, &sub.as_into()) }
    }

    /// Reads `keys` with descriptors asked of the master now (kept ones are not used).
    ///
    /// # Safety
    /// As `batch_get_into`.
    unsafe fn read_fresh(&self, keys: &[&str], into: ReadInto) -> Vec<Result<u64>> {
        let keep = self.keep_all(keys.len());
        let leased = self.fetch(keys, keep.as_deref(), &mut || {});
        // SAFETY: the caller's contract, passed on unchanged.
        let results = unsafe { self.read_objects(keys, &leased, &into) };
        let failed = keys.iter().zip(&results).filter(|(_, r)| r.is_err());
        self.shared.cache.drop_keys(failed.map(|(k, _)| *k));
        results
    }

    /// Reads `key` into `buf`; returns the object's size.
    pub fn get_into(&self, key: &str, buf: &mut [u8]) -> Result<u64> {
        let parts = vec![(buf.as_mut_ptr() as u64, buf.len() as u64)];
        // SAFETY: `buf` is exclusively borrowed for the call.
        one(unsafe { self.batch_get_into(&[key], &[parts]) })
    }

    pub(super) fn replicas(&self, keys: &[&str]) -> Vec<Result<ObjectDesc>> {
        let req = Request::GetReplicas {
            keys: keys.iter().map(|k| k.to_string()).collect(),
        };
        self.per_key(req, keys, "get", |r| match r {
            Response::GetReplicas(v) => Ok(v),
            other => Err(other),
        })
    }

    /// Reads several keys into caller buffers; per key the object's size or an error
    /// (`BUFFER_OVERFLOW` when the buffers are too small).
    ///
    /// # Safety
    /// Every part must be writable for its length, and untouched by others, until the
    /// call returns.
    pub unsafe fn batch_get_into(&self, keys: &[&str], parts: &[Parts]) -> Vec<Result<u64>> {
        if keys.len() != parts.len() {
            return keys
                .iter()
                .map(|_| Err(Error::invalid("keys and buffers differ in count")))
                .collect();
        }
        // SAFETY: `read_leased` has this fn's contract: the caller keeps every part writable for
        // its length, and untouched by others, until the call returns, and the parts are passed
        // unchanged.
        unsafe { self.read_leased(keys, ReadInto::Whole(parts)) }
    }

    /// As [`batch_get_into`](Self::batch_get_into), key `i` into the one buffer
    /// `spans[i]` (address, length).
    ///
    /// # Safety
    /// As `batch_get_into`, for each span.
    pub unsafe fn batch_get_into_spans(
        &self,
        keys: &[&str],
        spans: &[(u64, u64)],
    ) -> Vec<Result<u64>> {
        if keys.len() != spans.len() {
            return all_err(
                keys.len(),
                Error::invalid("keys and buffers differ in count"),
            );
        }
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { self.read_leased(keys, ReadInto::Spans(spans)) }
    }

    /// Reads byte ranges of several keys: per key, `(object offset, local address,
    /// length)` ranges; per key the bytes read or an error (`INVALID_PARAMS` for a range
    /// past the object's end). Ranges are not checked against the object's checksum,
    /// which covers the whole value.
    ///
    /// # Safety
    /// Every range's local memory must be writable for its length, and untouched by
    /// others, until the call returns.
    pub unsafe fn batch_get_ranges(&self, keys: &[&str], ranges: &[Fragments]) -> Vec<Result<u64>> {
        if keys.len() != ranges.len() {
            return all_err(
                keys.len(),
                Error::invalid("keys and ranges differ in count"),
            );
        }
        // SAFETY: `read_leased` needs each local range writable and untouched until the call
        // returns, which is exactly what the caller guarantees for `ranges`, passed unchanged.
        unsafe { self.read_leased(keys, ReadInto::Ranges(ranges)) }
    }

    /// # Safety
    /// As `batch_get_into`.
    pub(super) unsafe fn read_objects(
        &self,
        keys: &[&str],
        descs: &[Result<Leased>],
        into: &ReadInto,
    ) -> Vec<Result<u64>> {
        let mut results: Vec<Result<u64>> = Vec::with_capacity(keys.len());
        let mut choices: Vec<SmallList<&ReplicaDesc>> = Vec::with_capacity(keys.len());
        let frags: Vec<FragmentList> = match into {
            ReadInto::Whole(parts) => parts.iter().map(|p| fragments(p)).collect(),
            ReadInto::Spans(spans) => spans.iter().map(|&s| fragments(&[s])).collect(),
            ReadInto::Ranges(ranges) => {
                ranges.iter().map(|r| r.iter().copied().collect()).collect()
            }
        };
        for (i, d) in descs.iter().enumerate() {
            choices.push(SmallList::new());
            results.push(match d {
                Err(e) => Err(e.clone()),
                Ok(Leased { desc: d, .. }) => match Self::fits(keys[i], d.size, &frags[i], into) {
                    Ok(n) => {
                        // One replica leaves nothing to rank (ranking looks descriptors up).
                        choices[i] = match d.replicas.len() {
                            0 | 1 => d.replicas.iter().collect(),
                            _ => self.preference(&d.replicas).into(),
                        };
                        Ok(n)
                    }
                    Err(e) => Err(e),
                },
            });
        }
        // Whole objects are checked against their checksum, folded during the read.
        let verify = into.is_whole() && self.config.verify_checksum;
        let mut crcs = vec![Some(0u32); if verify { keys.len() } else { 0 }];
        // Try each key's best replica; on failure its next one, and so on.
        let mut last_err: HashMap<usize, Error> = HashMap::new();
        let mut pending: Vec<usize> = positions(keys.len(), |i| results[i].is_ok());
        let mut attempt = 0;
        while !pending.is_empty() {
            let mut plan: Vec<(usize, &ReplicaDesc)> = Vec::with_capacity(pending.len());
            plan.extend((pending.iter()).filter_map(|&i| choices[i].get(attempt).map(|r| (i, *r))));
            if plan.is_empty() {
                break;
            }
            if verify {
                for (i, _) in &plan {
                    crcs[*i] = Some(0); // a new attempt joins from the start
                }
            }
            let outcome = self.move_replicas(
                Op::Read,
                &plan,
                &frags,
                verify.then_some(&mut crcs[..]),
                &[],
            );
            pending.retain(|&i| match &outcome[i] {
                Some(Err(e)) => {
                    last_err.insert(i, e.clone());
                    true
                }
                Some(Ok(())) => {
                    // (An empty map still hashes the key it is asked to remove.)
                    if !last_err.is_empty() {
                        last_err.remove(&i);
                    }
                    false
                }
                None => {
                    results[i] = Err(last_err
                        .remove(&i)
                        .unwrap_or_else(|| Error::new(Code::InvalidReplica, "no replica")));
                    false
                }
            });
            attempt += 1;
        }
        for i in pending {
            let e = last_err
                .remove(&i)
                .unwrap_or_else(|| Error::new(Code::TransferFail, "every replica failed"));
            results[i] = Err(Error::new(
                e.code(),
                format!(
                    "reading {}: every replica failed: {}",
                    shown_key(keys[i]),
                    e.context()
                ),
            ));
        }
        // Read after every transfer ended: a key whose lease ended before is refused.
        let read = Instant::now();
        for (i, d) in descs.iter().enumerate() {
            let (
                Ok(Leased {
                    desc: d,
                    lease_ends,
                    ..
                }),
                Ok(_),
            ) = (d, &results[i])
            else {
                continue;
            };
            if read >= *lease_ends {
                results[i] = Err(Error::new(
                    Code::LeaseExpired,
                    format!("read of {} outlived its lease", shown_key(keys[i])),
                ));
                continue;
            }
            // (A key read straight into device memory has no host checksum to compare.)
            if let Some(crc) = verify.then(|| crcs[i]).flatten() {
                if crc != d.crc32c {
                    results[i] = Err(Error::new(
                        Code::ChecksumMismatch,
                        format!(
                            "{}: crc32c {crc:#010x}, stored {:#010x}",
                            shown_key(keys[i]),
                            d.crc32c
                        ),
                    ));
                }
            }
        }
        self.release_staged(keys, descs);
        results
    }

    /// Tells the master these reads are done with the copies it staged from disk for
    /// them, so their space serves the next disk-tier read at once (their leases would
    /// free it otherwise, later).
    fn release_staged(&self, keys: &[&str], descs: &[Result<Leased>]) {
        let items: Vec<(String, u64)> = keys
            .iter()
            .zip(descs)
            .filter_map(|(k, d)| match d {
                Ok(l) if l.staged => {
                    let first = l.desc.replicas.first()?.pieces.first()?;
                    Some((k.to_string(), first.addr))
                }
                _ => None,
            })
            .collect();
        if items.is_empty() {
            return;
        }
        if let Err(e) = self.call(Request::ReleaseStaged { items }) {
            log::debug!("releasing copies staged from disk: {e}");
        }
    }

    /// The bytes a read of a `size`-byte object into `frags` gives, or why it cannot.
    pub(super) fn fits(
        key: &str,
        size: u64,
        frags: &[(u64, u64, u64)],
        into: &ReadInto,
    ) -> Result<u64> {
        match into {
            ReadInto::Whole(_) | ReadInto::Spans(_) => {
                let room: u64 = frags.iter().map(|f| f.2).sum();
                if room < size {
                    return Err(Error::new(
                        Code::BufferOverflow,
                        format!("{} is {size} bytes, buffer {room}", shown_key(key)),
                    ));
                }
                Ok(size)
            }
            ReadInto::Ranges(_) => {
                frags
                    .iter()
                    .try_fold(0u64, |total, &(off, _, len)| match off.checked_add(len) {
                        Some(end) if end <= size => Ok(total + len),
                        _ => Err(Error::invalid(format!(
                            "range [{off}, +{len}) past the end of {} ({size} bytes)",
                            shown_key(key)
                        ))),
                    })
            }
        }
    }

    /// Replicas in read preference: our own memory, then same-host peers, then remote.
    fn preference<'a>(&self, replicas: &'a [ReplicaDesc]) -> Vec<&'a ReplicaDesc> {
        let own = self.engine.segment_name();
        let own_host = self.engine.descriptor().host.map(|h| h.host_id);
        let rank = |r: &ReplicaDesc| -> u8 {
            if r.pieces.iter().all(|p| &*p.segment == own) {
                return 0;
            }
            let same_host = r.pieces.iter().all(|p| {
                let desc = self
                    .engine
                    .open_segment(&p.segment)
                    .and_then(|s| self.engine.segment_descriptor(s));
                desc.ok().and_then(|d| d.host).map(|h| h.host_id) == own_host
            });
            if same_host && own_host.is_some() {
                1
            } else {
                2
            }
        };
        let mut v: Vec<(u8, &ReplicaDesc)> = replicas.iter().map(|r| (rank(r), r)).collect();
        v.sort_by_key(|(k, _)| *k);
        v.into_iter().map(|(_, r)| r).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::zeroed;

    #[test]
    fn a_value_buffer_is_zeroed_or_refused_never_an_abort() {
        assert_eq!(zeroed(0), Some(Vec::new()));
        assert_eq!(zeroed(5), Some(vec![0; 5]));
        // Past what any allocation may be: the key fails, the process goes on.
        assert_eq!(zeroed(u64::MAX), None);
        assert_eq!(zeroed(1 << 62), None);
    }
}
