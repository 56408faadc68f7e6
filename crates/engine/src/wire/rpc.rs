//! Control-plane ("handshake") frames: `u64 length` (= 1 + JSON bytes), `u8 type`, JSON.

use std::io::{Read, Write};
use std::net::ToSocketAddrs;
use std::time::Duration;

use crate::auth::ClusterSecret;
use crate::error::{Code, Error, Result};

/// Default and hard upper bound on one frame's length field.
pub const MAX_FRAME_LEN: u64 = 1 << 20;

/// Kinds of handshake RPC frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum RpcType {
    /// RDMA/EFA queue-pair exchange.
    Connection = 0,
    /// Peer-to-peer segment descriptor exchange.
    Metadata = 1,
    /// A notification message for the peer's inbox.
    Notify = 2,
    /// A liveness probe.
    Probe = 3,
}

impl RpcType {
    /// The frame kind with this number, if there is one.
    pub fn from_u8(v: u8) -> Option<RpcType> {
        match v {
            0 => Some(RpcType::Connection),
            1 => Some(RpcType::Metadata),
            2 => Some(RpcType::Notify),
            3 => Some(RpcType::Probe),
            _ => None,
        }
    }
}

/// Encodes one frame into a fresh buffer.
pub fn encode(kind: RpcType, json: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(9 + json.len());
    out.extend_from_slice(&(1 + json.len() as u64).to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(json.as_bytes());
    out
}

/// Validates a frame's length field before anything is allocated for it.
pub fn check_len(len: u64, max: u64) -> Result<()> {
    if len == 0 {
        return Err(Error::protocol("rpc frame with length 0"));
    }
    if len > max {
        return Err(Error::protocol(format!(
            "rpc frame of {len} bytes exceeds the {max}-byte limit"
        )));
    }
    Ok(())
}

/// Parses a complete frame held in memory (used by tests and fuzzing; `read_frame`
/// is the streaming form). Returns the type byte and the JSON text.
pub fn decode(bytes: &[u8], max: u64) -> Result<(RpcType, &str)> {
    let Some((len_bytes, rest)) = bytes.split_first_chunk::<8>() else {
        return Err(Error::protocol("truncated rpc frame header"));
    };
    let len = u64::from_le_bytes(*len_bytes);
    check_len(len, max)?;
    if rest.len() as u64 != len {
        return Err(Error::protocol(format!(
            "rpc frame announces {len} bytes but carries {}",
            rest.len()
        )));
    }
    body(rest[0], &rest[1..])
}

fn body(type_byte: u8, json: &[u8]) -> Result<(RpcType, &str)> {
    let kind = RpcType::from_u8(type_byte)
        .ok_or_else(|| Error::protocol(format!("unknown rpc type {type_byte}")))?;
    let text =
        std::str::from_utf8(json).map_err(|_| Error::protocol("rpc frame body is not UTF-8"))?;
    Ok((kind, text))
}

/// Reads one frame from a stream; the body is returned as owned JSON text.
pub fn read_frame(stream: &mut impl Read, max: u64) -> Result<(RpcType, String)> {
    let mut len_bytes = [0u8; 8];
    stream
        .read_exact(&mut len_bytes)
        .map_err(|e| Error::io("reading rpc frame header", e))?;
    let len = u64::from_le_bytes(len_bytes);
    check_len(len, max)?;
    let mut rest = vec![0u8; len as usize];
    stream
        .read_exact(&mut rest)
        .map_err(|e| Error::io("reading rpc frame body", e))?;
    let (kind, text) = body(rest[0], &rest[1..])?;
    Ok((kind, text.to_owned()))
}

/// Writes one frame of kind `kind` carrying `json`.
pub fn write_frame(stream: &mut impl Write, kind: RpcType, json: &str) -> Result<()> {
    stream
        .write_all(&encode(kind, json))
        .map_err(|e| Error::io("writing rpc frame", e))
}

/// One request and one response on a fresh connection, as Mooncake peers expect;
/// with a cluster secret the connection authenticates first (`crate::auth`).
pub fn call(
    addr: &str,
    kind: RpcType,
    json: &str,
    timeout: Duration,
    secret: Option<&ClusterSecret>,
) -> Result<String> {
    let fail =
        |what: &str, e: std::io::Error| Error::new(Code::RpcFail, format!("{what} {addr}: {e}"));
    let sock = addr
        .to_socket_addrs()
        .map_err(|e| fail("resolving", e))?
        .next()
        .ok_or_else(|| Error::new(Code::RpcFail, format!("{addr} resolves to nothing")))?;
    let mut stream =
        crate::auth::connect(&sock, timeout, secret).map_err(|e| fail("connecting to", e))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| fail("configuring", e))?;
    stream
        .set_write_timeout(Some(timeout))
        .map_err(|e| fail("configuring", e))?;
    let _ = stream.set_nodelay(true);
    write_frame(&mut stream, kind, json)?;
    let (reply_kind, body) =
        read_frame(&mut stream, MAX_FRAME_LEN).map_err(|e| match e.code() {
            Code::Timeout => Error::new(Code::RpcTimeout, format!("{addr}: {}", e.context())),
            _ => Error::new(Code::RpcFail, format!("{addr}: {e}")),
        })?;
    if reply_kind != kind {
        return Err(Error::protocol(format!(
            "{addr} answered a {kind:?} request with {reply_kind:?}"
        )));
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejects() {
        let f = encode(RpcType::Probe, "{}");
        assert_eq!(decode(&f, MAX_FRAME_LEN).unwrap(), (RpcType::Probe, "{}"));
        assert_eq!(read_frame(&mut &f[..], MAX_FRAME_LEN).unwrap().1, "{}");
        let mut zero = f.clone();
        zero[..8].copy_from_slice(&0u64.to_le_bytes());
        assert_eq!(
            decode(&zero, MAX_FRAME_LEN).unwrap_err().code(),
            Code::Protocol
        );
        let mut big = f.clone();
        big[..8].copy_from_slice(&(MAX_FRAME_LEN + 1).to_le_bytes());
        assert!(read_frame(&mut &big[..], MAX_FRAME_LEN).is_err());
        let mut unknown = f.clone();
        unknown[8] = 9;
        assert!(decode(&unknown, MAX_FRAME_LEN).is_err());
        assert!(decode(&f[..f.len() - 1], MAX_FRAME_LEN).is_err());
        assert!(read_frame(&mut &f[..5], MAX_FRAME_LEN).is_err());
    }
}
