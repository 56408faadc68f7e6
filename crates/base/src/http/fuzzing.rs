//! Entry points for the fuzz targets in `fuzz/` (not an API): the server's request
//! reader and the client's response reader, run over bytes held in memory.

use std::io;

use super::server::{read_request, RequestFailure};
use super::wire::{ReadErr, Request, Wire};

/// Why a message was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The server would answer with this status and close.
    Status(u16),
    /// The connection would just be closed (truncated input).
    Closed,
}

/// Reads requests from `bytes` as a server connection would, until the input ends or
/// a request is refused. Answers each request read with its keep-alive decision,
/// and the refusal that ended the input, if any.
pub fn parse_requests(bytes: &[u8]) -> (Vec<(Request, bool)>, Option<Refusal>) {
    let mut wire = Wire::new(bytes);
    let mut out = Vec::new();
    loop {
        match read_request(&mut wire, io::sink()) {
            Ok(Some(r)) => out.push(r),
            Ok(None) => return (out, None),
            Err(RequestFailure::Respond(status, _)) => return (out, Some(Refusal::Status(status))),
            Err(RequestFailure::Close) => return (out, Some(Refusal::Closed)),
        }
    }
}

/// Reads one response to a `method` request from `bytes` as the client would:
/// (status, body, keep-alive), or a description of why it was refused.
pub fn parse_response(bytes: &[u8], method: &str) -> Result<(u16, Vec<u8>, bool), String> {
    let answer = super::client::read_response(&mut Wire::new(bytes), method);
    answer
        .map(|a| (a.status, a.body, a.keep))
        .map_err(|e| match e {
            ReadErr::Eof => "truncated".to_owned(),
            ReadErr::Io(e) => e.to_string(),
            ReadErr::TooLarge => "too large".to_owned(),
            ReadErr::Malformed(m) => m.to_owned(),
        })
}
