//! The FAST'25 conversation trace shipped in `traces/` (Apache-2.0, see `NOTICE`), built
//! into the binary so `mooncake demo` runs from any directory and any install, and the
//! reading of its JSON lines.

use std::borrow::Cow;

use mooncake_base::json::{self, Value};

/// Default tokens per block: the FAST'25 traces hash 512-token blocks.
pub const DEFAULT_BLOCK_TOKENS: u64 = 512;

/// How reports name the built-in trace.
pub const SHIPPED_NAME: &str = "conversation_trace.jsonl (built in)";

const SHIPPED: &str = include_str!("../../../traces/conversation_trace.jsonl");

/// One request of a trace: when it came, its prompt length, and its blocks' hashes.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Arrival time in milliseconds (non-negative).
    pub timestamp_ms: f64,
    /// Prompt length in tokens.
    pub input_length: u64,
    /// The prompt's KV blocks, as hash ids (a shared prefix shares ids).
    pub hash_ids: Vec<u64>,
}

/// The text of the trace at `path`, or of the shipped one when `None`.
pub fn text(path: Option<&str>) -> Result<Cow<'static, str>, String> {
    match path {
        None => Ok(Cow::Borrowed(SHIPPED)),
        Some(p) => std::fs::read_to_string(p)
            .map(Cow::Owned)
            .map_err(|e| format!("reading trace {p}: {e}")),
    }
}

/// How reports name a trace.
pub fn name(path: Option<&str>) -> &str {
    path.unwrap_or(SHIPPED_NAME)
}

/// Reads up to `limit` requests (all when `None`) of the trace at `path`.
pub fn load(path: Option<&str>, limit: Option<usize>) -> Result<Vec<Request>, String> {
    let text = text(path)?;
    let name = name(path);
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if limit.is_some_and(|n| out.len() >= n) {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        out.push(parse_line(line).map_err(|e| format!("{}:{}: {e}", name, i + 1))?);
    }
    if out.is_empty() {
        return Err(format!("trace {} has no requests", name));
    }
    Ok(out)
}

/// Parses one trace line, or says which field is wrong.
pub fn parse_line(line: &str) -> Result<Request, String> {
    let v = json::parse(line).map_err(|e| e.to_string())?;
    let timestamp_ms = v
        .get("timestamp")
        .and_then(Value::as_f64)
        .filter(|t| *t >= 0.0)
        .ok_or("field `timestamp`: expected a non-negative number")?;
    let input_length = v.u64_field("input_length").map_err(|e| e.to_string())?;
    let ids = v
        .get("hash_ids")
        .and_then(Value::as_array)
        .ok_or("field `hash_ids`: expected an array")?;
    let hash_ids = ids
        .iter()
        .map(|x| {
            x.as_u64()
                .ok_or("field `hash_ids`: expected unsigned integers")
        })
        .collect::<Result<Vec<u64>, _>>()?;
    Ok(Request {
        timestamp_ms,
        input_length,
        hash_ids,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_or_explain() {
        let r = parse_line(
            r#"{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}"#,
        )
        .unwrap();
        assert_eq!(
            (r.timestamp_ms, r.input_length, r.hash_ids),
            (5.0, 600, vec![0, 1])
        );
        assert!(parse_line("{").is_err());
        let e = parse_line(r#"{"timestamp": 0, "input_length": 1}"#)
            .err()
            .unwrap();
        assert!(e.contains("hash_ids"), "{e}");
    }

    #[test]
    fn shipped_trace_loads() {
        let all = load(None, Some(3)).unwrap();
        assert_eq!(all.len(), 3);
        assert!(all.iter().all(|r| !r.hash_ids.is_empty()));
    }
}
