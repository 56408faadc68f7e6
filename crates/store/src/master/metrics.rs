//! What the master's `/metrics` reports: our own `mooncake_*` figures, and the same
//! figures and request counters under the names Mooncake's master exports
//! (`master_key_count`, `master_put_start_requests_total`, `segment_allocated_bytes`, ...),
//! so dashboards and alerts written for it keep working when this master replaces it.
//!
//! Mooncake has a single-key and a batch RPC for most operations; here one method takes
//! a list of keys. A request of one key counts as the single-key RPC (a request, and a
//! failure when it failed), any other as the batch RPC: a request and its keys, and
//! then, when keys failed, a failure (every key failed) or a partial success (some did),
//! with the failed keys counted. Removals count per key, as Mooncake's batch remove
//! adds to its single-key counters. A key fails when its answer is an error code (a key
//! not found included, as Mooncake counts it); a refused request fails all its keys.
//! Counted are the requests the RPC server answers, not the in-process `Master::handle`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::Code;
use crate::protocol::{PoolStats, Request, Response};

/// How Mooncake counts a family's requests.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rpcs {
    /// A single-key RPC only: `master_<stem>_{requests,failures}_total`.
    Single,
    /// A batch RPC only: `master_batch_<stem>_{requests,items,...}_total`.
    Batch,
    /// Both: one key counts as the single-key RPC, any other number as the batch RPC.
    Both,
    /// Single-key counters that count keys, batches adding theirs.
    PerKey,
}

/// Declares the families once: the enum, `Family::ALL` in the same order (their
/// counters sit at `family as usize`), and each one's naming.
macro_rules! families {
    ($($name:ident => ($stem:literal, $rpcs:ident, $what:literal),)*) => {
        /// A kind of request, after Mooncake's RPC of the same job.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Family {
            $($name,)*
        }

        impl Family {
            const ALL: &[Family] = &[$(Family::$name,)*];

            /// The stem of its counters' names, how Mooncake counts it, and what it
            /// counts (for the help lines).
            fn naming(self) -> (&'static str, Rpcs, &'static str) {
                match self {
                    $(Family::$name => ($stem, Rpcs::$rpcs, $what),)*
                }
            }
        }
    };
}

families! {
    PutStart => ("put_start", Both, "Put starts (space reserved for a value)"),
    PutEnd => ("put_end", Both, "Put ends (values made readable)"),
    PutRevoke => ("put_revoke", Both, "Put revokes (unfinished puts given up)"),
    GetReplicaList => ("get_replica_list", Both, "Replica lookups for reads"),
    ExistKey => ("exist_key", Both, "Existence checks"),
    Remove => ("remove", PerKey, "Removals of keys"),
    RemoveAll => ("remove_all", Single, "Removals of every key"),
    RemoveByRegex => ("remove_by_regex", Single, "Removals by pattern"),
    ReplicaClear => ("replica_clear", Batch, "Replica clears"),
    MountSegment => ("mount_segment", Single, "Segment mounts"),
    UnmountSegment => ("unmount_segment", Single, "Segment unmounts"),
    RemountSegment => ("remount_segment", Single, "Segment remounts (counted at their last chunk; one refused before it is not)"),
    Ping => ("ping", Single, "Client keep-alives"),
}

const FAMILIES: usize = Family::ALL.len();

/// One family's single-key counters.
#[derive(Default)]
struct Single {
    requests: AtomicU64,
    failures: AtomicU64,
}

/// One family's batch counters.
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
    /// Keys of put starts refused for want of space (`NoAvailableHandle`: the pool, or
    /// the room for unfinished puts, is full): the alert a full pool raises.
    put_start_alloc_failures: AtomicU64,
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
        Request::RemoveKeys { keys, .. } => (Family::Remove, keys.len()),
        Request::RemoveAll { .. } => (Family::RemoveAll, 1),
        Request::RemoveByRegex { .. } => (Family::RemoveByRegex, 1),
        Request::ReplicaClear { keys, .. } => (Family::ReplicaClear, keys.len()),
        Request::Mount { .. } | Request::MountExtra { .. } => (Family::MountSegment, 1),
        Request::Unmount { .. } => (Family::UnmountSegment, 1),
        Request::Remount { last: true, .. } => (Family::RemountSegment, 1),
        Request::Ping { .. } => (Family::Ping, 1),
        _ => return None,
    })
}

/// How many keys of an answer `handle_from` built failed (an error code in place of
/// their answer). Lookups are answered, and their failures counted, by `lookups_into`.
pub fn failed_keys(answer: &Response) -> usize {
    keys_failing(answer, |_| true)
}

/// How many keys of a put start's answer found no space.
pub fn allocation_failures(answer: &Response) -> usize {
    keys_failing(answer, |code| code == Code::NoAvailableHandle)
}

/// The keys of a per-key answer whose error code `counts` accepts.
fn keys_failing(answer: &Response, counts: impl Fn(Code) -> bool) -> usize {
    fn count<T>(list: &[crate::protocol::KeyResult<T>], counts: impl Fn(Code) -> bool) -> usize {
        list.iter()
            .filter(|r| matches!(r, Err(c) if counts(*c)))
            .count()
    }
    match answer {
        Response::PutStart(r) => count(r, counts),
        Response::PutStartNoted(r) => count(r, counts),
        Response::PerKey(r) => count(r, counts),
        Response::Exists(r) => count(r, counts),
        _ => 0,
    }
}

/// How an answered request went.
#[derive(Clone, Copy, Debug)]
pub enum Outcome {
    /// Answered key by key, this many keys failing.
    Answered { failed: usize },
    /// Refused whole.
    Refused,
}

impl RequestMetrics {
    /// Counts one request of `family` that carried `keys` keys.
    pub fn record(&self, family: Family, keys: usize, outcome: Outcome) {
        let add = |c: &AtomicU64, n: usize| {
            if n > 0 {
                c.fetch_add(n as u64, Ordering::Relaxed);
            }
        };
        let (refused, failed) = match outcome {
            Outcome::Answered { failed } => (false, failed.min(keys)),
            Outcome::Refused => (true, keys),
        };
        let (_, rpcs, _) = family.naming();
        let s = &self.single[family as usize];
        let single_key_call = rpcs == Rpcs::Single || (rpcs == Rpcs::Both && keys == 1);
        match rpcs {
            Rpcs::PerKey => {
                add(&s.requests, keys);
                add(&s.failures, failed);
            }
            _ if single_key_call => {
                add(&s.requests, 1);
                add(&s.failures, usize::from(refused || failed > 0));
            }
            _ => {
                let b = &self.batch[family as usize];
                add(&b.requests, 1);
                add(&b.items, keys);
                if refused || (failed == keys && keys > 0) {
                    add(&b.failures, 1);
                } else if failed > 0 {
                    add(&b.partial_successes, 1);
                }
                add(&b.failed_items, failed);
            }
        }
    }

    /// Counts `keys` put starts refused for want of space.
    pub fn record_allocation_failures(&self, keys: usize) {
        if keys > 0 {
            let n = keys as u64;
            self.put_start_alloc_failures
                .fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Appends every counter in Prometheus' text format.
    pub fn render(&self, out: &mut String) {
        let (_, _, what) = Family::PutStart.naming();
        let refused_help = "keys refused for want of space";
        let refused = &self.put_start_alloc_failures;
        counter(
            out,
            "put_start_alloc",
            "failures",
            what,
            refused_help,
            refused,
        );
        for &family in Family::ALL {
            let (stem, rpcs, what) = family.naming();
            if rpcs != Rpcs::Batch {
                let s = &self.single[family as usize];
                let (requests, failures) = match rpcs {
                    Rpcs::PerKey => ("keys asked for", "keys that failed"),
                    _ => ("requests answered", "requests that failed"),
                };
                counter(out, stem, "requests", what, requests, &s.requests);
                counter(out, stem, "failures", what, failures, &s.failures);
            }
            if matches!(rpcs, Rpcs::Batch | Rpcs::Both) {
                let b = &self.batch[family as usize];
                let stem = &format!("batch_{stem}");
                let counts: [(&str, &str, &AtomicU64); 5] = [
                    ("requests", "batch requests answered", &b.requests),
                    ("items", "keys in batch requests", &b.items),
                    (
                        "failures",
                        "batch requests in which every key failed",
                        &b.failures,
                    ),
                    (
                        "partial_successes",
                        "batch requests in which some keys failed",
                        &b.partial_successes,
                    ),
                    (
                        "failed_items",
                        "keys that failed in batch requests",
                        &b.failed_items,
                    ),
                ];
                for (part, counts, value) in counts {
                    counter(out, stem, part, what, counts, value);
                }
            }
        }
    }
}

/// One counter: `master_<stem>_<part>_total`.
fn counter(out: &mut String, stem: &str, part: &str, what: &str, counts: &str, value: &AtomicU64) {
    let name = format!("master_{stem}_{part}_total");
    let value = value.load(Ordering::Relaxed);
    let _ = write!(
        out,
        "# HELP {name} {what}: {counts}.\n# TYPE {name} counter\n{name} {value}\n"
    );
}

/// Appends the pool's figures, from one reading: ours (`mooncake_*`), then under
/// Mooncake's names (what is lent and allocated, the keys held, the clients alive, and
/// what eviction took since start).
pub fn render_pool(stats: &PoolStats, active_clients: u64, out: &mut String) {
    let ours = [
        ("mooncake_segments", "gauge", stats.segments),
        ("mooncake_capacity_bytes", "gauge", stats.capacity),
        ("mooncake_used_bytes", "gauge", stats.used),
        ("mooncake_objects", "gauge", stats.objects),
        (
            "mooncake_evicted_objects_total",
            "counter",
            stats.evicted_objects,
        ),
        (
            "mooncake_evicted_bytes_total",
            "counter",
            stats.evicted_bytes,
        ),
    ];
    for (name, kind, value) in ours {
        let _ = write!(out, "# TYPE {name} {kind}\n{name} {value}\n");
    }
    let mooncakes = [
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
    for (name, kind, help, value) in mooncakes {
        let _ = write!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        );
    }
}

/// Appends each segment name's capacity and allocated bytes, labelled with the name
/// (`segment_total_capacity_bytes{segment="host:port"}`, as Mooncake's master has them).
/// `segments`: (name, capacity, used). A client's extra segments share its name: their
/// figures are summed, as Mooncake sums them, so each series appears once.
pub fn render_segments(segments: impl IntoIterator<Item = (String, u64, u64)>, out: &mut String) {
    let mut by_name: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for (name, capacity, used) in segments {
        let sums = by_name.entry(name).or_default();
        *sums = (sums.0 + capacity, sums.1 + used);
    }
    let help = "Bytes the segment lends.";
    segment_gauge(out, "segment_total_capacity_bytes", help, &by_name, |s| s.0);
    let help = "Bytes of the segment allocated to objects.";
    segment_gauge(out, "segment_allocated_bytes", help, &by_name, |s| s.1);
}

fn segment_gauge(
    out: &mut String,
    name: &str,
    help: &str,
    by_name: &BTreeMap<String, (u64, u64)>,
    value: impl Fn((u64, u64)) -> u64,
) {
    let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n");
    for (segment, &sums) in by_name {
        let label = label_value(segment);
        let _ = writeln!(out, "{name}{{segment=\"{label}\"}} {}", value(sums));
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

    /// Asserts each named counter's value in `m`'s text; the text.
    fn assert_counts(m: &RequestMetrics, want: &[(&str, Option<u64>)]) -> String {
        let text = rendered(m);
        for &(name, value) in want {
            assert_eq!(self::value(&text, name), value, "{name} in {text}");
        }
        text
    }

    fn answered(failed: usize) -> Outcome {
        Outcome::Answered { failed }
    }

    #[test]
    fn one_key_counts_as_the_single_rpc_and_any_other_number_as_the_batch_rpc() {
        let m = RequestMetrics::default();
        m.record(Family::PutStart, 1, answered(0));
        m.record(Family::PutStart, 1, answered(1));
        m.record(Family::PutStart, 1, Outcome::Refused);
        m.record(Family::PutStart, 64, answered(0));
        m.record(Family::PutStart, 64, answered(64));
        m.record(Family::PutStart, 64, answered(3));
        m.record(Family::PutStart, 0, answered(0));
        m.record(Family::PutStart, 0, Outcome::Refused);
        let text = assert_counts(
            &m,
            &[
                ("master_put_start_requests_total", Some(3)),
                ("master_put_start_failures_total", Some(2)),
                ("master_batch_put_start_requests_total", Some(5)),
                ("master_batch_put_start_items_total", Some(192)),
                ("master_batch_put_start_failures_total", Some(2)),
                ("master_batch_put_start_partial_successes_total", Some(1)),
                ("master_batch_put_start_failed_items_total", Some(67)),
                ("master_exist_key_requests_total", Some(0)),
            ],
        );
        assert!(text.contains("# TYPE master_batch_exist_key_items_total counter\n"));
        assert!(text.contains(
            "# HELP master_batch_exist_key_failures_total Existence checks: batch requests \
             in which every key failed.\n"
        ));
    }

    #[test]
    fn other_families_count_as_mooncake_counts_them() {
        let m = RequestMetrics::default();
        // Only a batch RPC: one key is a batch of one.
        m.record(Family::ReplicaClear, 1, answered(1));
        // Only a single-key RPC.
        m.record(Family::Ping, 1, answered(0));
        m.record(Family::RemoveAll, 1, Outcome::Refused);
        // Per key: a remove of one key and a batch remove of five, two failing.
        m.record(Family::Remove, 1, answered(0));
        m.record(Family::Remove, 5, answered(2));
        let text = assert_counts(
            &m,
            &[
                ("master_batch_replica_clear_requests_total", Some(1)),
                ("master_batch_replica_clear_failures_total", Some(1)),
                ("master_batch_replica_clear_failed_items_total", Some(1)),
                ("master_replica_clear_requests_total", None),
                ("master_ping_requests_total", Some(1)),
                ("master_ping_failures_total", Some(0)),
                ("master_remove_all_failures_total", Some(1)),
                ("master_remove_requests_total", Some(6)),
                ("master_remove_failures_total", Some(2)),
                ("master_batch_remove_requests_total", None),
            ],
        );
        // Every line is a comment or a name and a number, each name once.
        let mut names = std::collections::HashSet::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, n) = line.split_once(' ').unwrap();
            assert!(
                name.starts_with("master_") && name.ends_with("_total"),
                "{line}"
            );
            assert!(n.parse::<u64>().is_ok(), "{line}");
            assert!(names.insert(name), "{name} twice");
        }
    }

    #[test]
    fn the_pool_reads_the_same_under_both_names() {
        let stats = PoolStats {
            segments: 2,
            capacity: 1 << 30,
            used: 5120,
            objects: 1,
            evicted_objects: 3,
            evicted_bytes: 12288,
        };
        let mut text = String::new();
        render_pool(&stats, 4, &mut text);
        for (ours, theirs, want) in [
            (
                "mooncake_capacity_bytes",
                "master_total_capacity_bytes",
                1 << 30,
            ),
            ("mooncake_used_bytes", "master_allocated_bytes", 5120),
            ("mooncake_objects", "master_key_count", 1),
            (
                "mooncake_evicted_objects_total",
                "master_evicted_key_count",
                3,
            ),
            (
                "mooncake_evicted_bytes_total",
                "master_evicted_size_bytes",
                12288,
            ),
        ] {
            assert_eq!(value(&text, ours), Some(want), "{ours}");
            assert_eq!(value(&text, theirs), Some(want), "{theirs}");
        }
        assert_eq!(value(&text, "master_active_clients"), Some(4));
        assert!(text.contains("# TYPE master_evicted_key_count counter\n"));
    }

    #[test]
    fn segments_are_labelled_by_name_once_each_with_the_name_escaped() {
        let segment = |name: &str, capacity, used| (name.to_owned(), capacity, used);
        // A client's extra segment shares its name: one series, the sums.
        let segments = [
            segment("odd\"name\\\n", 8, 0),
            segment("10.0.0.1:12300", 4000, 1000),
            segment("10.0.0.1:12300", 96, 24),
        ];
        let mut text = String::new();
        render_segments(segments, &mut text);
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
    fn requests_map_to_their_family_and_answers_count_their_failed_keys() {
        let keys = vec!["a".to_owned(), "b".to_owned()];
        let req = Request::Exists { keys: keys.clone() };
        assert_eq!(family_of(&req), Some((Family::ExistKey, 2)));
        let req = Request::RemoveKeys {
            keys: keys.clone(),
            force: false,
        };
        assert_eq!(family_of(&req), Some((Family::Remove, 2)));
        let req = Request::GetReplicasKeepable { keys };
        assert_eq!(family_of(&req), Some((Family::GetReplicaList, 2)));
        assert_eq!(family_of(&Request::Stats), None);
        let answer = Response::Exists(vec![Ok(true), Err(Code::ObjectNotFound), Ok(false)]);
        assert_eq!(failed_keys(&answer), 1);
        assert_eq!(failed_keys(&Response::Done), 0);
        let started = Response::PutStart(vec![
            Err(Code::NoAvailableHandle),
            Ok(Vec::new()),
            Err(Code::ObjectAlreadyExists),
            Err(Code::NoAvailableHandle),
        ]);
        assert_eq!(
            (failed_keys(&started), allocation_failures(&started)),
            (3, 2)
        );
        let m = RequestMetrics::default();
        m.record_allocation_failures(2);
        let name = "master_put_start_alloc_failures_total";
        assert_eq!(value(&rendered(&m), name), Some(2));
    }
}
