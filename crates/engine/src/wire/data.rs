//! TCP data plane, protocol v2: a 24-byte request header and an 8-byte status frame.

use crate::error::{Error, Result};

/// Size of a data-channel request header.
pub const HEADER_LEN: usize = 24;
/// Size of a data-channel status word.
pub const STATUS_LEN: usize = 8;
/// Bit 7 of the opcode byte marks protocol v2.
pub const V2_FLAG: u8 = 0x80;
/// High 32 bits of every status frame: "MCTV".
pub const STATUS_MAGIC: u32 = 0x4D43_5456;

/// Direction of a data-channel request, seen from the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataOp {
    /// Remote → caller.
    Read,
    /// Caller → remote.
    Write,
}

/// A data-channel request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Bytes to move.
    pub size: u64,
    /// Absolute address in the server's address space.
    pub addr: u64,
    /// Read or write.
    pub op: DataOp,
}

impl Header {
    /// The header's wire form.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..8].copy_from_slice(&self.size.to_le_bytes());
        out[8..16].copy_from_slice(&self.addr.to_le_bytes());
        out[16] = V2_FLAG
            | match self.op {
                DataOp::Read => 0,
                DataOp::Write => 1,
            };
        out
    }

    /// Decodes a v2 header. v1 headers (no flag) are refused: v1 writes carry no
    /// acknowledgement, so they cannot honour "acknowledged means in memory".
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Header> {
        let size = u64::from_le_bytes(bytes[0..8].try_into().expect("8 bytes"));
        let addr = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let opcode = bytes[16];
        if opcode & V2_FLAG == 0 {
            return Err(Error::protocol(
                "tcp data protocol v1 header is not supported",
            ));
        }
        let op = match opcode & !V2_FLAG {
            0 => DataOp::Read,
            1 => DataOp::Write,
            other => return Err(Error::protocol(format!("unknown data opcode {other}"))),
        };
        Ok(Header { size, addr, op })
    }
}

/// A data-channel request's outcome, as the server reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// The request was served.
    Ok,
    /// The server refused the request (bad range or unregistered memory).
    Rejected,
}

impl Status {
    /// The status word's wire form.
    pub fn encode(self) -> [u8; STATUS_LEN] {
        let low = match self {
            Status::Ok => 0u64,
            Status::Rejected => 1,
        };
        (((STATUS_MAGIC as u64) << 32) | low).to_le_bytes()
    }

    /// Parses a status word; fails on a bad magic or value.
    pub fn decode(bytes: &[u8; STATUS_LEN]) -> Result<Status> {
        let v = u64::from_le_bytes(*bytes);
        if (v >> 32) as u32 != STATUS_MAGIC {
            return Err(Error::protocol(format!(
                "status frame without magic: {v:#018x}"
            )));
        }
        match v as u32 {
            0 => Ok(Status::Ok),
            1 => Ok(Status::Rejected),
            other => Err(Error::protocol(format!("unknown status code {other}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_and_status_layouts() {
        let h = Header {
            size: 4096,
            addr: 0x7f00_0000_1000,
            op: DataOp::Write,
        };
        let b = h.encode();
        assert_eq!(&b[0..8], &4096u64.to_le_bytes());
        assert_eq!(b[16], 0x81);
        assert_eq!(Header::decode(&b).unwrap(), h);
        let mut v1 = b;
        v1[16] = 1;
        assert!(Header::decode(&v1).is_err());
        let mut bad = b;
        bad[16] = 0x85;
        assert!(Header::decode(&bad).is_err());
        assert_eq!(Status::Ok.encode(), 0x4D43_5456_0000_0000u64.to_le_bytes());
        assert_eq!(
            Status::decode(&Status::Rejected.encode()).unwrap(),
            Status::Rejected
        );
        assert!(Status::decode(&[0; 8]).is_err());
    }
}
