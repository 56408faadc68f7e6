//! The master's request counters, exported at `/metrics` under the names Mooncake's
//! own master uses (`master_put_start_requests_total`, `master_batch_exist_key_items_total`,
//! ...), so dashboards and alerts written for it keep working when this master replaces it.
//!
//! Mooncake has a single-key and a batch RPC for most operations; here one method takes
//! a list of keys. A request of one key counts as the single-key RPC (a request, and a
//! failure when it failed), a longer one as the batch RPC: a request and its keys, and
//! then, when keys failed, a failure (every key failed) or a partial success (some did),
//! with the failed keys counted. A key fails when its answer is an error code (a key
//! not found included, as Mooncake counts it); a refused request fails all its keys.
//! Counted are the requests the RPC server answers, not the in-process `Master::handle`.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::protocol::{PoolStats, Request, Response};

/// A kind of request, after Mooncake's RPC of the same job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    PutStart,
    PutEnd,
    PutRevoke,
    GetReplicaList,
    ExistKey,
    Remove,
    RemoveAll,
    RemoveByRegex,
    ReplicaClear,
    MountSegment,
    UnmountSegment,
    RemountSegment,
    Ping,
}

/// Which of Mooncake's counters a family has: a single-key RPC's, a batch RPC's, or both.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rpcs {
    Single,
    Batch,
    Both,
}

impl Family {
    /// Every family, in declaration order (their counters sit at `family as usize`).
    const ALL: [Family; 13] = [
        Family::PutStart,
        Family::PutEnd,
        Family::PutRevoke,
        Family::GetReplicaList,
        Family::ExistKey,
        Family::Remove,
        Family::RemoveAll,
        Family::RemoveByRegex,
        Family::ReplicaClear,
        Family::MountSegment,
        Family::UnmountSegment,
        Family::RemountSegment,
        Family::Ping,
    ];

    /// The stem of its counters' names (`master_<stem>_requests_total`, and
    /// `master_batch_<stem>_requests_total` for the batch RPC), which RPCs Mooncake
    /// counts for it, and what it counts, for the help lines.
    fn naming(self) -> (&'static str, Rpcs, &'static str) {
        match self {
            Family::PutStart => (
                "put_start",
                Rpcs::Both,
                "put starts (space reserved for a value)",
            ),
            Family::PutEnd => ("put_end", Rpcs::Both, "put ends (values made readable)"),
            Family::PutRevoke => (
                "put_revoke",
                Rpcs::Both,
                "put revokes (unfinished puts given up)",
            ),
            Family::GetReplicaList => ("get_replica_list", Rpcs::Both, "replica lookups for reads"),
            Family::ExistKey => ("exist_key", Rpcs::Both, "existence checks"),
            Family::Remove => ("remove", Rpcs::Single, "removals of one key"),
            Family::RemoveAll => ("remove_all", Rpcs::Single, "removals of every key"),
            Family::RemoveByRegex => ("remove_by_regex", Rpcs::Single, "removals by pattern"),
            Family::ReplicaClear => ("replica_clear", Rpcs::Batch, "replica clears"),
            Family::MountSegment => ("mount_segment", Rpcs::Single, "segment mounts"),
            Family::UnmountSegment => ("unmount_segment", Rpcs::Single, "segment unmounts"),
            Family::RemountSegment => (
                "remount_segment",
                Rpcs::Single,
                "segment remounts (counted at their last chunk)",
            ),
            Family::Ping => ("ping", Rpcs::Single, "client keep-alives"),
        }
    }
}

const FAMILIES: usize = Family::ALL.len();

/// One family's counts of single-key requests.
#[derive(Default)]
struct Single {
    requests: AtomicU64,
    failures: AtomicU64,
}

/// One family's counts of batch requests.
#[derive(Default)]
struct Batch {
    requests: AtomicU64,
    items: AtomicU64,
    failures: AtomicU64,
    partial_successes: AtomicU64,
    failed_items: AtomicU64,
}

/// The counters (one per master, shared by its connections).
#[derive(Default)]
pub struct RequestMetrics {
    single: [Single; FAMILIES],
    batch: [Batch; FAMILIES],
}

/// Which family `req` counts in, and how many keys it carries; `None` for requests
/// Mooncake has no counter for.
pub fn family_of(req: &Request) -> Option<(Family, usize)> {
    Some(match req {
        Request::PutStart { items, .. } => (Family::PutStart, items.len()),
        Request::PutStartNoted { items, .. } => (Family::PutStart, items.len()),
        Request::PutEnd { items, .. } => (Family::PutEnd, items.len()),
        Request::PutRevoke { keys, .. } => (Family::PutRevoke, keys.len()),
        Request::GetReplicas { keys } | Request::GetReplicasKeepable { keys } => {
            (Family::GetReplicaList, keys.len())
        }
        Request::Exists { keys } => (Family::ExistKey, keys.len()),
        Request::Remove { .. } => (Family::Remove, 1),
        Request::RemoveAll { .. } => (Family::RemoveAll, 1),
        Request::RemoveByRegex { .. } => (Family::RemoveByRegex, 1),
        Request::ReplicaClear { keys, .. } => (Family::ReplicaClear, keys.len()),
        Request::Mount { .. } => (Family::MountSegment, 1),
        Request::Unmount { .. } => (Family::UnmountSegment, 1),
        Request::Remount { last: true, .. } => (Family::RemountSegment, 1),
        Request::Ping { .. } => (Family::Ping, 1),
        _ => return None,
    })
}

/// How many of an answer's keys failed (an error code in place of their answer).
pub fn failed_keys(answer: &Response) -> usize {
    fn errors<T>(list: &[crate::protocol::KeyResult<T>]) -> usize {
        list.iter().filter(|r| r.is_err()).count()
    }
    match answer {
        Response::PutStart(r) => errors(r),
        Response::PutStartNoted(r) => errors(r),
        Response::PerKey(r) => errors(r),
        Response::GetReplicas(r) => errors(r),
        Response::Exists(r) => errors(r),
        Response::Keepable { descs, .. } | Response::Described { descs, .. } => errors(descs),
        _ => 0,
    }
}

impl RequestMetrics {
    /// Counts one answered request of `family` that carried `keys` keys, `failed` of
    /// which failed (all of them when the request was refused).
    pub fn record(&self, family: Family, keys: usize, failed: usize) {
        let (_, rpcs, _) = family.naming();
        let failed = failed.min(keys) as u64;
        let keys = keys as u64;
        let add = |c: &AtomicU64, n: u64| {
            if n > 0 {
                c.fetch_add(n, Ordering::Relaxed);
            }
        };
        if rpcs == Rpcs::Batch || (rpcs == Rpcs::Both && keys > 1) {
            let b = &self.batch[family as usize];
            add(&b.requests, 1);
            add(&b.items, keys);
            if failed > 0 {
                let outcome = if failed == keys {
                    &b.failures
                } else {
                    &b.partial_successes
                };
                add(outcome, 1);
                add(&b.failed_items, failed);
            }
        } else {
            let s = &self.single[family as usize];
            add(&s.requests, 1);
            add(&s.failures, u64::from(failed > 0));
        }
    }

    /// Appends every counter in Prometheus' text format.
    pub fn render(&self, out: &mut String) {
        for family in Family::ALL {
            let (stem, rpcs, what) = family.naming();
            if rpcs != Rpcs::Batch {
                let s = &self.single[family as usize];
                counter(out, stem, "requests", "requests", what, &s.requests);
                counter(out, stem, "failures", "failed requests", what, &s.failures);
            }
            if rpcs != Rpcs::Single {
                let b = &self.batch[family as usize];
                let stem = format!("batch_{stem}");
                let stem = stem.as_str();
                counter(out, stem, "requests", "batch requests", what, &b.requests);
                counter(out, stem, "items", "keys in batch requests", what, &b.items);
                let failures = "batch requests every key of which failed";
                counter(out, stem, "failures", failures, what, &b.failures);
                let partial = "batch requests some keys of which failed";
                counter(
                    out,
                    stem,
                    "partial_successes",
                    partial,
                    what,
                    &b.partial_successes,
                );
                let failed = "failed keys of batch requests";
                counter(out, stem, "failed_items", failed, what, &b.failed_items);
            }
        }
    }
}

/// Appends the pool's figures under Mooncake's names: what is lent and allocated, the
/// keys held, the clients alive, and what eviction took since start.
pub fn render_pool(stats: &PoolStats, active_clients: u64, out: &mut String) {
    let figures = [
        (
            "master_total_capacity_bytes",
            "gauge",
            "Bytes the mounted segments lend.",
            stats.capacity,
        ),
        (
            "master_allocated_bytes",
            "gauge",
            "Bytes allocated to objects.",
            stats.used,
        ),
        ("master_key_count", "gauge", "Objects held.", stats.objects),
        (
            "master_active_clients",
            "gauge",
            "Clients whose keep-alives are current.",
            active_clients,
        ),
        (
            "master_evicted_key_count",
            "counter",
            "Objects evicted since start.",
            stats.evicted_objects,
        ),
        (
            "master_evicted_size_bytes",
            "counter",
            "Bytes evicted since start.",
            stats.evicted_bytes,
        ),
    ];
    for (name, kind, help, value) in figures {
        let _ = write!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        );
    }
}

/// A mounted segment's figures, for `render_segments`.
pub struct SegmentUse {
    pub name: String,
    pub capacity: u64,
    pub used: u64,
}

/// Appends each mounted segment's capacity and allocated bytes, labelled with its name
/// (`segment_total_capacity_bytes{segment="host:port"}`, as Mooncake's master has them).
pub fn render_segments(segments: &[SegmentUse], out: &mut String) {
    let help = "Bytes the segment lends.";
    segment_gauge(out, "segment_total_capacity_bytes", help, segments, |s| {
        s.capacity
    });
    let help = "Bytes of the segment allocated to objects.";
    segment_gauge(out, "segment_allocated_bytes", help, segments, |s| s.used);
}

fn segment_gauge(
    out: &mut String,
    name: &str,
    help: &str,
    segments: &[SegmentUse],
    value: impl Fn(&SegmentUse) -> u64,
) {
    let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n");
    for segment in segments {
        let label = label_value(&segment.name);
        let _ = writeln!(out, "{name}{{segment=\"{label}\"}} {}", value(segment));
    }
}

/// `text` as a Prometheus label value: backslash, double quote and line feed escaped
/// (segment names come from clients).
fn label_value(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// One counter: `master_<stem>_<part>_total`.
fn counter(out: &mut String, stem: &str, part: &str, counts: &str, what: &str, value: &AtomicU64) {
    let name = format!("master_{stem}_{part}_total");
    let value = value.load(Ordering::Relaxed);
    let _ = write!(
        out,
        "# HELP {name} Answered {counts} of {what}.\n# TYPE {name} counter\n{name} {value}\n"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rendered(m: &RequestMetrics) -> String {
        let mut text = String::new();
        m.render(&mut text);
        text
    }

    fn value(text: &str, name: &str) -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    /// Asserts each named counter's value in `m`'s text.
    fn assert_counts(m: &RequestMetrics, want: &[(&str, Option<u64>)]) -> String {
        let text = rendered(m);
        for &(name, value) in want {
            assert_eq!(self::value(&text, name), value, "{name} in {text}");
        }
        text
    }

    #[test]
    fn one_key_counts_as_the_single_rpc_and_more_as_the_batch_rpc() {
        let m = RequestMetrics::default();
        m.record(Family::PutStart, 1, 0);
        m.record(Family::PutStart, 1, 1);
        m.record(Family::PutStart, 64, 0);
        m.record(Family::PutStart, 64, 64);
        m.record(Family::PutStart, 64, 3);
        let text = assert_counts(
            &m,
            &[
                ("master_put_start_requests_total", Some(2)),
                ("master_put_start_failures_total", Some(1)),
                ("master_batch_put_start_requests_total", Some(3)),
                ("master_batch_put_start_items_total", Some(192)),
                ("master_batch_put_start_failures_total", Some(1)),
                ("master_batch_put_start_partial_successes_total", Some(1)),
                ("master_batch_put_start_failed_items_total", Some(67)),
                ("master_exist_key_requests_total", Some(0)),
            ],
        );
        assert!(text.contains("# TYPE master_batch_exist_key_items_total counter\n"));
    }

    #[test]
    fn families_without_a_single_rpc_count_every_request_as_a_batch() {
        let m = RequestMetrics::default();
        m.record(Family::ReplicaClear, 1, 1);
        m.record(Family::Ping, 1, 0);
        m.record(Family::RemoveAll, 1, 5);
        let text = assert_counts(
            &m,
            &[
                ("master_batch_replica_clear_requests_total", Some(1)),
                ("master_batch_replica_clear_failures_total", Some(1)),
                ("master_batch_replica_clear_failed_items_total", Some(1)),
                ("master_ping_requests_total", Some(1)),
                ("master_remove_all_failures_total", Some(1)),
                ("master_replica_clear_requests_total", None),
            ],
        );
        // Every line is a comment or a name and a number.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, n) = line.split_once(' ').unwrap();
            assert!(
                name.starts_with("master_") && name.ends_with("_total"),
                "{line}"
            );
            assert!(n.parse::<u64>().is_ok(), "{line}");
        }
    }

    #[test]
    fn segments_are_labelled_by_name_with_the_name_escaped() {
        let segment = |name: &str, capacity, used| SegmentUse {
            name: name.to_owned(),
            capacity,
            used,
        };
        let segments = [
            segment("10.0.0.1:12300", 4096, 1024),
            segment("odd\"name\\\n", 8, 0),
        ];
        let mut text = String::new();
        render_segments(&segments, &mut text);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "# HELP segment_total_capacity_bytes Bytes the segment lends.",
                "# TYPE segment_total_capacity_bytes gauge",
                "segment_total_capacity_bytes{segment=\"10.0.0.1:12300\"} 4096",
                "segment_total_capacity_bytes{segment=\"odd\\\"name\\\\\\n\"} 8",
                "# HELP segment_allocated_bytes Bytes of the segment allocated to objects.",
                "# TYPE segment_allocated_bytes gauge",
                "segment_allocated_bytes{segment=\"10.0.0.1:12300\"} 1024",
                "segment_allocated_bytes{segment=\"odd\\\"name\\\\\\n\"} 0",
            ]
        );
    }

    #[test]
    fn every_family_sits_at_its_own_place() {
        for (i, family) in Family::ALL.into_iter().enumerate() {
            assert_eq!(family as usize, i, "{family:?}");
        }
    }

    #[test]
    fn requests_map_to_their_family_and_answers_count_their_failed_keys() {
        use crate::error::Code;
        let keys = vec!["a".to_owned(), "b".to_owned()];
        let req = Request::Exists { keys: keys.clone() };
        assert_eq!(family_of(&req), Some((Family::ExistKey, 2)));
        let req = Request::GetReplicasKeepable { keys };
        assert_eq!(family_of(&req), Some((Family::GetReplicaList, 2)));
        assert_eq!(family_of(&Request::Stats), None);
        let answer = Response::Exists(vec![Ok(true), Err(Code::ObjectNotFound), Ok(false)]);
        assert_eq!(failed_keys(&answer), 1);
        assert_eq!(failed_keys(&Response::Done), 0);
    }
}
