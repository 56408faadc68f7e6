//! Byte layouts shared with Mooncake 0.3.x peers (`docs/wire.md`): the
//! control-plane RPC frame and the TCP data-plane v2 header and status frame.

#![forbid(unsafe_code)]

pub mod data;
pub mod rpc;
