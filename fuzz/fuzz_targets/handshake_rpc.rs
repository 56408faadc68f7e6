//! Handshake RPC frames (`u64 length | u8 type | JSON`): the in-memory and streaming
//! decoders must agree, what decodes re-encodes to the same bytes, and the JSON bodies
//! go through the parsers the RPC server and client use on them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake::json::{self, Value};
use mooncake::metadata::{RpcMeta, SegmentDesc};
use mooncake::wire::rpc::{self, RpcType};

/// Small enough that the fuzzer reaches the limit check.
const MAX: u64 = 4096;

fuzz_target!(|data: &[u8]| {
    let whole = rpc::decode(data, MAX);
    let streamed = rpc::read_frame(&mut &data[..], MAX);
    match &whole {
        Ok((kind, text)) => {
            assert_eq!(rpc::encode(*kind, text), data);
            let (skind, stext) = streamed.expect("a whole frame also streams");
            assert_eq!((skind, stext.as_str()), (*kind, *text));
            body(*kind, text);
        }
        Err(_) => {
            // The stream form may accept a prefix (trailing bytes are the next frame).
            if let Ok((kind, text)) = streamed {
                assert!(rpc::encode(kind, &text).len() < data.len());
            }
        }
    }
});

/// What the engine's RPC server and clients read out of each kind of body.
fn body(kind: RpcType, text: &str) {
    let Ok(v) = json::parse(text) else { return };
    match kind {
        RpcType::Notify => {
            let _ = v.get("name").and_then(Value::as_str);
            let _ = v.str_field("notify_msg");
        }
        RpcType::Metadata => {
            let _ = SegmentDesc::from_json(&v);
        }
        RpcType::Connection | RpcType::Probe => {
            let _ = RpcMeta::parse(text);
        }
    }
}
