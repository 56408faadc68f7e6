//! A trace read the way the `kvcache-simulator` package reads one, then laid out for
//! replay: per block event its interned id, its token weight and its node in the prefix
//! tree of all requests, and when that node is next used (for Belady's optimal).
//!
//! The package's rules, kept here so the hit rates agree with it:
//! * requests are replayed in file order (`timestamp` only paces the `store` policy);
//! * a record with an empty `hash_ids` list is skipped (it is not a request);
//! * a block's token weight is `block_tokens[i]` when the record lists them, else
//!   `min(block_size, input_length - i * block_size)`, at least 1 (the last block
//!   carries the remainder, blocks past `input_length` weigh 1 token);
//! * `block_size` (tokens per block) comes from the records when they carry it (all the
//!   same), else from `--block-tokens`;
//! * a block is identified by its whole prefix: the same id under another parent is
//!   another tree node (for the FAST'25 traces, whose ids are prefix hashes, the two
//!   coincide);
//! * the measured window is the last half: requests from `floor(n / 2)` on.
//!
//! Stricter than the package: a line that is not JSON, a record that is not an object
//! or lacks `hash_ids`, and a bad `input_length` are errors naming the line, not
//! silently dropped.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use mooncake_base::json::{self, Number, Value};

/// Multiplicative hashing for integer keys (ids and tree edges): the keys are already
/// well spread and the maps are hot.
#[derive(Default)]
pub struct IntHasher(u64);

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 ^= self.0 >> 29;
    }
}

/// A `HashMap` keyed by integers, hashed by [`IntHasher`].
pub type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

pub use crate::trace::DEFAULT_BLOCK_TOKENS;

/// A trace ready for replay.
pub struct Plan {
    /// Per event: the interned block id (the same raw id always gets the same number).
    pub ids: Vec<u32>,
    /// Per event: its prefix-tree node (0 is the root, never an event).
    pub node: Vec<u32>,
    /// Per event: cumulative token weight *before* it (`cum[i + 1] - cum[i]` is its
    /// weight), so a prefix's tokens are one subtraction.
    pub cum: Vec<u64>,
    /// Per request: its first event; one more entry closes the last request.
    pub starts: Vec<usize>,
    /// Per request: arrival in milliseconds (0 when the record has none).
    pub timestamps_ms: Vec<f64>,
    /// Per node: its parent (the root is its own).
    pub parent: Vec<u32>,
    /// Per event: the next request that uses the same node, or `requests + 1`.
    pub next_use: Vec<u32>,
    /// Requests before the measured last half: `floor(requests / 2)`.
    pub warmup: usize,
    /// Tokens per block in use.
    pub block_tokens: u64,
    /// Distinct raw block ids.
    pub unique_ids: usize,
    /// Records skipped for an empty `hash_ids`.
    pub skipped: usize,
    /// Input tokens of all requests (the sum of the block weights).
    pub total_tokens: u64,
}

impl Plan {
    /// Requests in the trace.
    pub fn requests(&self) -> usize {
        self.starts.len() - 1
    }

    /// Prefix-tree nodes other than the root: distinct blocks by prefix.
    pub fn unique_blocks(&self) -> usize {
        self.parent.len() - 1
    }

    /// Events of request `r`.
    pub fn range(&self, r: usize) -> std::ops::Range<usize> {
        self.starts[r]..self.starts[r + 1]
    }

    /// Token weight of the first `k` blocks of request `r`.
    pub fn prefix_tokens(&self, r: usize, k: usize) -> u64 {
        let s = self.starts[r];
        self.cum[s + k] - self.cum[s]
    }

    /// Average input tokens per request, floored and at least 1: the token count the
    /// package sizes token-dependent models (sliding windows, compression) for.
    pub fn estimate_tokens(&self) -> u64 {
        (self.total_tokens / self.requests() as u64).max(1)
    }
}

/// One record's raw block ids, as interned keys (integers and decimal strings alike).
#[derive(Clone, PartialEq, Eq, Hash)]
enum RawId {
    Int(i128),
    Text(String),
}

fn raw_id(v: &Value) -> Result<RawId, String> {
    match v {
        Value::Number(Number::U64(n)) => Ok(RawId::Int(i128::from(*n))),
        Value::Number(Number::I64(n)) => Ok(RawId::Int(i128::from(*n))),
        // The package keys ids by their decimal text, so "12" and 12 are one block.
        Value::String(s) => match s.parse::<i128>() {
            Ok(n) if n.to_string() == *s => Ok(RawId::Int(n)),
            _ => Ok(RawId::Text(s.clone())),
        },
        _ => Err("`hash_ids` must hold integers or strings".into()),
    }
}

/// Interns raw ids into dense numbers, fast for the common non-negative integers.
#[derive(Default)]
struct Interner {
    ints: IntMap<u64, u32>,
    others: HashMap<RawId, u32>,
    count: u32,
}

impl Interner {
    fn intern(&mut self, id: &Value) -> Result<u32, String> {
        let next = self.count;
        let got = match id {
            Value::Number(Number::U64(n)) => *self.ints.entry(*n).or_insert(next),
            other => match raw_id(other)? {
                RawId::Int(n) if (0..=i128::from(u64::MAX)).contains(&n) => {
                    *self.ints.entry(n as u64).or_insert(next)
                }
                key => *self.others.entry(key).or_insert(next),
            },
        };
        if got == next {
            self.count = self
                .count
                .checked_add(1)
                .ok_or("more than 2^32 distinct block ids")?;
        }
        Ok(got)
    }
}

/// A positive integer field (`int()` of a number, as the package reads it).
fn positive(v: &Value) -> Option<u64> {
    match v {
        Value::Number(Number::U64(n)) if *n > 0 => Some(*n),
        Value::Number(Number::F64(f)) if *f >= 1.0 && f.is_finite() => Some(*f as u64),
        _ => None,
    }
}

struct Record {
    ids: Vec<u32>,
    input_length: u64,
    block_tokens: Option<Vec<u64>>,
    timestamp_ms: f64,
}

/// Parses the trace text; `fallback_block_tokens` applies unless records carry
/// `block_size`. `name` labels errors.
pub fn parse(
    text: &str,
    name: &str,
    fallback_block_tokens: u64,
    limit: Option<usize>,
) -> Result<Plan, String> {
    let mut interner = Interner::default();
    let mut records = Vec::new();
    let mut trace_block_size: Option<u64> = None;
    let mut skipped = 0;
    for (i, line) in text.lines().enumerate() {
        if limit.is_some_and(|n| records.len() >= n) {
            break;
        }
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let at = |e: String| format!("{name}:{}: {e}", i + 1);
        let v = json::parse(line).map_err(|e| at(e.to_string()))?;
        if v.as_object().is_none() {
            return Err(at("expected a JSON object".into()));
        }
        let ids = v
            .get("hash_ids")
            .and_then(Value::as_array)
            .ok_or_else(|| at("field `hash_ids`: expected an array".into()))?;
        if ids.is_empty() {
            skipped += 1;
            continue;
        }
        let input_length = v
            .get("input_length")
            .and_then(positive)
            .ok_or_else(|| at("field `input_length`: expected a positive integer".into()))?;
        if let Some(bs) = v.get("block_size").filter(|b| !b.is_null()) {
            let bs = positive(bs)
                .ok_or_else(|| at("field `block_size`: expected a positive integer".into()))?;
            match trace_block_size {
                None => trace_block_size = Some(bs),
                Some(t) if t != bs => {
                    return Err(at(format!(
                        "`block_size` {bs} differs from the trace's {t} (it must be consistent)"
                    )))
                }
                Some(_) => {}
            }
        }
        let block_tokens = match v.get("block_tokens").filter(|b| !b.is_null()) {
            None => None,
            Some(b) => {
                let list = b
                    .as_array()
                    .filter(|l| l.len() == ids.len())
                    .and_then(|l| l.iter().map(positive).collect::<Option<Vec<u64>>>())
                    .ok_or_else(|| {
                        at(
                            "field `block_tokens`: expected positive integers, one per hash id"
                                .into(),
                        )
                    })?;
                Some(list)
            }
        };
        let timestamp_ms = match v.get("timestamp") {
            None => 0.0,
            Some(t) => t
                .as_f64()
                .filter(|t| t.is_finite())
                .ok_or_else(|| at("field `timestamp`: expected a number".into()))?,
        };
        let ids = ids
            .iter()
            .map(|x| interner.intern(x))
            .collect::<Result<Vec<u32>, String>>()
            .map_err(at)?;
        records.push(Record {
            ids,
            input_length,
            block_tokens,
            timestamp_ms,
        });
    }
    if records.is_empty() {
        return Err(format!("trace {name} has no requests"));
    }
    let block_tokens = trace_block_size.unwrap_or(fallback_block_tokens);
    if block_tokens == 0 {
        return Err("tokens per block must be positive".into());
    }
    Ok(layout(
        records,
        block_tokens,
        interner.count as usize,
        skipped,
    ))
}

/// The package's weight of block `index` of `count` in a request of `input_length`.
fn weight(input_length: u64, block_size: u64, index: u64) -> u64 {
    match input_length.checked_sub(index * block_size) {
        None | Some(0) => 1,
        Some(remaining) => remaining.min(block_size),
    }
}

fn layout(records: Vec<Record>, block_tokens: u64, unique_ids: usize, skipped: usize) -> Plan {
    let events: usize = records.iter().map(|r| r.ids.len()).sum();
    let mut ids = Vec::with_capacity(events);
    let mut node = Vec::with_capacity(events);
    let mut cum = Vec::with_capacity(events + 1);
    let mut starts = Vec::with_capacity(records.len() + 1);
    let mut timestamps_ms = Vec::with_capacity(records.len());
    let mut parent = vec![0u32];
    let mut edges: IntMap<u64, u32> = IntMap::default();
    edges.reserve(events.min(8 << 20));
    cum.push(0u64);
    for r in &records {
        starts.push(ids.len());
        timestamps_ms.push(r.timestamp_ms);
        let mut at = 0u32;
        for (j, &id) in r.ids.iter().enumerate() {
            let fresh = parent.len() as u32;
            let n = *edges
                .entry(u64::from(at) << 32 | u64::from(id))
                .or_insert(fresh);
            if n == fresh {
                parent.push(at);
            }
            ids.push(id);
            node.push(n);
            let w = match &r.block_tokens {
                Some(list) => list[j],
                None => weight(r.input_length, block_tokens, j as u64),
            };
            cum.push(cum.last().copied().unwrap_or(0) + w);
            at = n;
        }
    }
    starts.push(ids.len());
    let requests = records.len();
    // Next use of each event's node by a later request (the package's "next request").
    let never = (requests + 1) as u32;
    let mut next_use = vec![never; events];
    let mut last = vec![never; parent.len()];
    for r in (0..requests).rev() {
        let range = starts[r]..starts[r + 1];
        for i in range.clone() {
            next_use[i] = last[node[i] as usize];
        }
        for i in range {
            last[node[i] as usize] = r as u32;
        }
    }
    let warmup = requests / 2;
    let total_tokens = cum[events];
    Plan {
        ids,
        node,
        cum,
        starts,
        timestamps_ms,
        parent,
        next_use,
        warmup,
        block_tokens,
        unique_ids,
        skipped,
        total_tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(text: &str) -> Plan {
        parse(text, "t", 4, None).unwrap()
    }

    #[test]
    fn weights_follow_input_length() {
        // 10 tokens in blocks of 4: 4, 4, 2; a fourth block past the input weighs 1.
        let p = plan(r#"{"input_length": 10, "hash_ids": [1, 2, 3, 4]}"#);
        let w: Vec<u64> = p.cum.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(w, [4, 4, 2, 1]);
        let p = plan(r#"{"input_length": 10, "hash_ids": [1, 2], "block_tokens": [3, 9]}"#);
        assert_eq!(p.total_tokens, 12);
        let p = plan(r#"{"input_length": 10, "hash_ids": [1, 2], "block_size": 8}"#);
        assert_eq!((p.block_tokens, p.total_tokens), (8, 10));
    }

    #[test]
    fn blocks_are_tree_nodes_and_ids_intern_by_text() {
        let p = plan(
            "{\"input_length\": 8, \"hash_ids\": [1, 2]}\n\
             {\"input_length\": 8, \"hash_ids\": [\"1\", 3]}\n\
             {\"input_length\": 8, \"hash_ids\": [3, 2]}\n\
             {\"input_length\": 8, \"hash_ids\": []}\n",
        );
        assert_eq!(p.requests(), 3);
        assert_eq!(p.skipped, 1);
        assert_eq!(p.unique_ids, 3);
        // 1, 1/2, 1/3, 3, 3/2: the same id 2 under two parents is two nodes.
        assert_eq!(p.unique_blocks(), 5);
        assert_eq!(p.node[0], p.node[2]);
        assert_ne!(p.node[1], p.node[5]);
        // Node 1 is used again by request 1; nothing of request 2 is.
        assert_eq!(p.next_use[0], 1);
        assert_eq!(&p.next_use[4..], &[4, 4]);
        assert_eq!(p.warmup, 1);
    }

    #[test]
    fn bad_records_name_their_line() {
        for (text, what) in [
            ("{\"input_length\": 8, \"hash_ids\": [1]}\nnot json", "t:2:"),
            ("[1]", "object"),
            ("{\"input_length\": 8}", "hash_ids"),
            ("{\"input_length\": 0, \"hash_ids\": [1]}", "input_length"),
            ("{\"input_length\": 8, \"hash_ids\": [1.5]}", "hash_ids"),
            (
                "{\"input_length\": 8, \"hash_ids\": [1], \"block_tokens\": [1, 2]}",
                "block_tokens",
            ),
            (
                "{\"input_length\": 8, \"hash_ids\": [1], \"block_size\": 4}\n\
                 {\"input_length\": 8, \"hash_ids\": [1], \"block_size\": 8}",
                "consistent",
            ),
            ("", "no requests"),
        ] {
            let e = parse(text, "t", 4, None).err().unwrap();
            assert!(e.contains(what), "{text:?}: {e}");
        }
    }
}
