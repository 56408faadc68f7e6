//! The RPC server's answers. Lookups, the read path every first read of a key takes,
//! are encoded into the answer as each key is found, under its shard's lock: no
//! descriptor is built per key only to be encoded and dropped (three allocations a key,
//! and a batch's worth of small frees for glibc to consolidate at the next large one).
//! Every other request is `handle_from`'s answer, encoded.

use std::net::IpAddr;

use super::eviction::tail_first_each;
use super::metrics;
use super::replicas::Replicas;
use super::{Located, Master};
use crate::codec::Writer;
use crate::error::{Code, Result};
use crate::protocol::{
    check_key, encode_desc, encode_failed, encode_found, KeyResult, KeyedAnswers, Lookup,
    ObjectDesc, Request,
};

/// Where a lookup's descriptor goes.
pub(super) trait DescSink {
    type Out;
    /// The descriptor of replicas held in memory, asked for under the shard's lock.
    fn replicas(&mut self, size: u64, crc32c: u32, lease_ms: u64, replicas: &Replicas)
        -> Self::Out;
    /// A descriptor built already (a copy read back from a disk tier).
    fn built(&mut self, desc: ObjectDesc) -> Self::Out;
}

/// Builds the descriptor (in-process callers, and the requests answered whole).
pub(super) struct Build;

impl DescSink for Build {
    type Out = ObjectDesc;

    fn replicas(
        &mut self,
        size: u64,
        crc32c: u32,
        lease_ms: u64,
        replicas: &Replicas,
    ) -> ObjectDesc {
        ObjectDesc {
            size,
            crc32c,
            lease_ms,
            replicas: replicas.describe(),
        }
    }

    fn built(&mut self, desc: ObjectDesc) -> ObjectDesc {
        desc
    }
}

/// Writes one key's answer, found, as the wire carries it.
struct WriteTo<'a>(&'a mut Writer);

impl DescSink for WriteTo<'_> {
    type Out = ();

    fn replicas(&mut self, size: u64, crc32c: u32, lease_ms: u64, replicas: &Replicas) {
        encode_found(self.0, size, crc32c, lease_ms);
        replicas.encode(self.0);
    }

    fn built(&mut self, desc: ObjectDesc) {
        encode_desc(self.0, &Ok(desc));
    }
}

impl Master {
    /// A lookup for a reader that keeps descriptors, and whether it may keep this one.
    pub(super) fn lookup_keepable<S: DescSink>(
        &self,
        key: &str,
        now: u64,
        at: Option<Located>,
        sink: &mut S,
    ) -> (KeyResult<S::Out>, bool) {
        match self.lookup_into(key, false, now, at, sink) {
            // Only on disk (or unfinished): a copy staged for this reader is not
            // kept, so that each read of it still counts here.
            Err(Code::ReplicaIsNotReady) => (self.lookup_into(key, true, now, at, sink), false),
            other => (other, true),
        }
    }

    /// Answers `req` (from `peer`, as `handle_from`) into `w`, the payload the wire
    /// carries: the bytes `handle_from(req)`'s answer encodes to. Counted in the
    /// request metrics.
    pub fn answer_into(&self, req: Request, peer: Option<IpAddr>, w: &mut Writer) -> Result<()> {
        let counted = metrics::family_of(&req);
        let answered = self.answer_counting_failures(req, peer, w);
        if let Some((family, keys)) = counted {
            self.count_answer(family, keys, &answered);
        }
        answered.map(drop)
    }

    /// Answers a lookup (keys borrowed from the request's payload) into `w`, as
    /// `answer_into` answers the `Request` it decodes to, counted alike.
    pub fn answer_lookup_into(&self, lookup: &Lookup, w: &mut Writer) -> Result<()> {
        let answered = self.lookups_answer(&lookup.keys, lookup.keepable, w);
        let family = metrics::Family::GetReplicaList;
        self.count_answer(family, lookup.keys.len(), &answered);
        answered.map(drop)
    }

    /// Counts a request of `keys` keys in the request metrics: answered (with how many
    /// keys failed) or refused.
    fn count_answer(&self, family: metrics::Family, keys: usize, answered: &Result<usize>) {
        let outcome = match answered {
            Ok(failed) => metrics::Outcome::Answered { failed: *failed },
            Err(_) => metrics::Outcome::Refused,
        };
        self.request_metrics.record(family, keys, outcome);
    }

    /// The answer to a lookup of `keys` (`GetReplicasKeepable` when `keepable`, else
    /// `GetReplicas`); how many keys failed.
    fn lookups_answer<K: AsRef<str>>(
        &self,
        keys: &[K],
        keepable: bool,
        w: &mut Writer,
    ) -> Result<usize> {
        let at = self.locate_all(keys);
        let now = self.clock.now_ms();
        if !keepable {
            return self.lookups_into(keys.len(), w, |i, found| {
                self.lookup_into(keys[i].as_ref(), true, now, at[i], found)
            });
        }
        let mut kept = vec![true; keys.len()];
        let failed = self.lookups_into(keys.len(), w, |i, found| {
            let (looked, keep) = self.lookup_keepable(keys[i].as_ref(), now, at[i], found);
            kept[i] = keep;
            looked
        })?;
        w.list(&kept, |w, k| {
            w.bool(*k);
        });
        Ok(failed)
    }

    /// As `answer_into`; how many of the request's keys failed.
    fn answer_counting_failures(
        &self,
        req: Request,
        peer: Option<IpAddr>,
        w: &mut Writer,
    ) -> Result<usize> {
        match req {
            Request::GetReplicas { keys } => self.lookups_answer(&keys, false, w),
            Request::GetReplicasKeepable { keys } => self.lookups_answer(&keys, true, w),
            other => {
                // (A drain's `Relocate` answers as a put start does, but is no put.)
                let put_start = matches!(
                    other,
                    Request::PutStart { .. } | Request::PutStartNoted { .. }
                );
                let answer = self.handle_from(other, peer)?;
                answer.encode(w);
                if put_start {
                    let refused = metrics::allocation_failures(&answer);
                    self.request_metrics.record_allocation_failures(refused);
                }
                Ok(metrics::failed_keys(&answer))
            }
        }
    }

    /// Where each of a batch's keys goes (`locate`); none for a key not to be looked
    /// up, or for a batch of one (nothing to overlap its miss with).
    fn locate_all<K: AsRef<str>>(&self, keys: &[K]) -> Vec<Option<Located>> {
        let overlap = keys.len() > 1;
        keys.iter()
            .map(|k| k.as_ref())
            .map(|k| (overlap && check_key(k).is_ok()).then(|| self.locate(k)))
            .collect()
    }

    /// The list of a batch's answers, key `i`'s from `lookup(i)`, looked up tail first
    /// and sent in key order; refused, as `handle_from` refuses it, when a key is
    /// missing while nodes remount. How many keys failed.
    fn lookups_into(
        &self,
        keys: usize,
        w: &mut Writer,
        mut lookup: impl FnMut(usize, &mut WriteTo) -> KeyResult<()>,
    ) -> Result<usize> {
        let mut answers = KeyedAnswers::new(keys);
        let mut failed = 0;
        tail_first_each(keys, |i| {
            answers.answer(i, |w| {
                if let Err(code) = lookup(i, &mut WriteTo(w)) {
                    encode_failed(w, code);
                    failed += 1;
                }
            })
        });
        self.unless_recovering(failed > 0)?;
        answers.finish(w);
        Ok(failed)
    }
}

#[cfg(test)]
mod tests {
    use super::super::quota::Payer;
    use super::super::{Clock, Master, MasterConfig};
    use crate::codec::Writer;
    use crate::protocol::{Lookup, ReplicateConfig, Request, Response, SegmentInfo};

    const MIB: u64 = 1 << 20;

    fn master() -> Master {
        let mut cfg = MasterConfig::default();
        cfg.allocator.slab_size = MIB;
        let m = Master::with_clock(cfg, Clock::manual());
        for (i, name) in ["seg-a", "seg-b"].into_iter().enumerate() {
            let seg = SegmentInfo {
                name: name.into(),
                base: (i as u64 + 1) << 40,
                size: 16 * MIB,
            };
            m.mount(1, seg).unwrap();
        }
        let put = |key: &str, replica_num, end: bool| {
            let cfg = ReplicateConfig {
                replica_num,
                ..Default::default()
            };
            m.put_start(1, Payer::Client(1), key, 4096, &cfg, false)
                .unwrap();
            if end {
                m.put_end(1, key, 7, &mut Default::default()).unwrap();
            }
        };
        put("one", 1, true);
        put("two", 2, true);
        put("unfinished", 1, false);
        m
    }

    fn answered(m: &Master, req: Request) -> Vec<u8> {
        let mut w = Writer::new();
        m.answer_into(req, None, &mut w).unwrap();
        w.into_bytes()
    }

    fn encoded(m: &Master, req: Request) -> Vec<u8> {
        let mut w = Writer::new();
        m.handle(req).unwrap().encode(&mut w);
        w.into_bytes()
    }

    #[test]
    fn lookups_written_as_found_match_the_answer_built_and_encoded() {
        let m = master();
        let keys: Vec<String> = ["two", "missing", "one", "unfinished", "", "one"]
            .map(String::from)
            .to_vec();
        for req in [
            Request::GetReplicas { keys: keys.clone() },
            Request::GetReplicasKeepable { keys: keys.clone() },
        ] {
            let method = req.method();
            let fast = answered(&m, req.clone());
            // The server reads a lookup with its keys borrowed: the same answer.
            let mut payload = Writer::new();
            req.encode(&mut payload);
            let payload = payload.into_bytes();
            let lookup = Lookup::decode(method, &payload).unwrap().unwrap();
            let mut borrowed = Writer::new();
            m.answer_lookup_into(&lookup, &mut borrowed).unwrap();
            assert_eq!(borrowed.into_bytes(), fast, "method {method}");
            assert_eq!(fast, encoded(&m, req), "method {method}");
            let descs = match Response::decode(method, &fast).unwrap() {
                Response::GetReplicas(d) => d,
                Response::Keepable { descs, keepable } => {
                    assert_eq!(keepable, [true, true, true, false, true, true]);
                    descs
                }
                other => panic!("{other:?}"),
            };
            let replicas: Vec<_> = descs
                .iter()
                .map(|d| d.as_ref().map(|d| d.replicas.len()).map_err(|c| *c))
                .collect();
            use crate::error::Code::*;
            assert_eq!(
                replicas,
                [
                    Ok(2),
                    Err(ObjectNotFound),
                    Ok(1),
                    Err(ReplicaIsNotReady),
                    Err(InvalidKey),
                    Ok(1)
                ]
            );
        }
        // Anything else is the built answer, encoded.
        let exists = Request::Exists { keys };
        assert_eq!(answered(&m, exists.clone()), encoded(&m, exists));
    }

    #[test]
    fn answered_requests_are_counted_with_their_failed_keys_and_refusals() {
        let m = master();
        let figure = |name: &str| {
            m.metrics_text()
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<u64>().ok())
        };
        let keys = |list: &[&str]| list.iter().map(|k| k.to_string()).collect::<Vec<_>>();
        // Six lookups, three failing (missing, unfinished, invalid): a partial success.
        // (Read as the server reads a lookup, its keys borrowed.)
        let lookup = Lookup {
            keys: vec!["two", "missing", "one", "unfinished", "", "one"],
            keepable: true,
        };
        m.answer_lookup_into(&lookup, &mut Writer::new()).unwrap();
        // One key: the single-key call, failing.
        answered(
            &m,
            Request::GetReplicas {
                keys: keys(&["missing"]),
            },
        );
        // A key not there is an answer, an invalid one a failure.
        answered(
            &m,
            Request::Exists {
                keys: keys(&["one", "nope", ""]),
            },
        );
        // Refused whole: a pattern that does not compile.
        let bad = Request::RemoveByRegex {
            pattern: "(".into(),
            force: false,
        };
        assert!(m.answer_into(bad, None, &mut Writer::new()).is_err());
        // A put start with no room for its value: a failed put start, and the full-pool
        // counter's key.
        let huge = Request::PutStart {
            client: 1,
            items: vec![("huge".into(), 1 << 30)],
            config: Default::default(),
            upsert: false,
        };
        answered(&m, huge);
        // Not counted: no such counter upstream.
        answered(&m, Request::Stats);
        for (name, want) in [
            ("master_batch_get_replica_list_requests_total", 1),
            ("master_batch_get_replica_list_items_total", 6),
            ("master_batch_get_replica_list_partial_successes_total", 1),
            ("master_batch_get_replica_list_failed_items_total", 3),
            ("master_get_replica_list_requests_total", 1),
            ("master_get_replica_list_failures_total", 1),
            ("master_batch_exist_key_items_total", 3),
            ("master_batch_exist_key_failed_items_total", 1),
            ("master_remove_by_regex_requests_total", 1),
            ("master_remove_by_regex_failures_total", 1),
            ("master_put_start_requests_total", 1),
            ("master_put_start_failures_total", 1),
            ("master_put_start_alloc_failures_total", 1),
        ] {
            assert_eq!(figure(name), Some(want), "{name}");
        }
    }
}
