//! The FAST'25 conversation trace shipped in `traces/` (Apache-2.0, see `NOTICE`), built
//! into the binary so `mooncake demo` runs from any directory and any install.

use std::borrow::Cow;

/// How reports name the built-in trace.
pub const SHIPPED_NAME: &str = "conversation_trace.jsonl (built in)";

const SHIPPED: &str = include_str!("../../traces/conversation_trace.jsonl");

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
