//! Segment descriptors and RPC records as read from the metadata store: whatever
//! parses prints to JSON that parses back to the same descriptor, and buffer lookups
//! only ever answer a buffer that holds the whole range asked for.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake::metadata::{RpcMeta, SegmentDesc};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(desc) = SegmentDesc::parse(text) {
        let again = SegmentDesc::parse(&desc.to_json().to_string()).expect("printed parses");
        assert_eq!(again, desc);
        for b in &desc.buffers {
            for (addr, len) in [(b.addr, b.length), (b.addr, 1), (b.addr.wrapping_sub(1), 2)] {
                if let Some(found) = desc.buffer_for(addr, len) {
                    assert!(addr >= found.addr);
                    let end = addr.checked_add(len).expect("an accepted range ends");
                    assert!(end <= found.addr.saturating_add(found.length));
                }
            }
        }
    }
    if let Ok(meta) = RpcMeta::parse(text) {
        assert_eq!(RpcMeta::parse(&meta.to_json().to_string()).ok(), Some(meta));
    }
});
