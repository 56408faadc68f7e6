//! TCP data plane: a stream of 24-byte request headers and 8-byte status words, each
//! decoded as the data server and client do, and every accepted range checked against
//! the registered buffers the way the server checks it before moving a byte.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use mooncake::registry::LocalMemory;
use mooncake::wire::data::{Header, Status, HEADER_LEN, STATUS_LEN};

/// Two registered buffers, `(addr, len)`, set up once per process.
fn registered() -> &'static (LocalMemory, [(u64, u64); 2]) {
    static MEMORY: OnceLock<(LocalMemory, [(u64, u64); 2])> = OnceLock::new();
    MEMORY.get_or_init(|| {
        let memory = LocalMemory::new();
        let buffers = [4096usize, 1 << 16].map(|len| {
            let buf: &'static mut [u8] = Vec::leak(vec![0u8; len]);
            (buf.as_ptr() as u64, len as u64)
        });
        for (addr, len) in buffers {
            memory.register(addr, len, "cpu:0").expect("fresh buffers");
        }
        (memory, buffers)
    })
}

fuzz_target!(|data: &[u8]| {
    let (memory, buffers) = registered();
    // Headers aimed near the buffers: the input's addresses are offsets from the first.
    let base = buffers[0].0;
    for raw in data.chunks_exact(HEADER_LEN) {
        let raw: &[u8; HEADER_LEN] = raw.try_into().expect("chunk length");
        let Ok(mut header) = Header::decode(raw) else {
            continue;
        };
        // What decodes re-encodes to the same header (bytes 17.. are padding).
        assert_eq!(Header::decode(&header.encode()).ok(), Some(header));
        assert_eq!(header.encode()[..17], raw[..17]);
        header.addr = header.addr.wrapping_add(base);
        if let Ok(guard) = memory.guard(header.addr, header.size) {
            let end = guard.addr().checked_add(guard.len()).expect("no overflow");
            assert!(
                buffers
                    .iter()
                    .any(|&(a, l)| guard.addr() >= a && end <= a + l),
                "accepted [{:#x}, +{}) outside every buffer",
                header.addr,
                header.size
            );
        }
    }
    for raw in data.chunks_exact(STATUS_LEN) {
        let raw: &[u8; STATUS_LEN] = raw.try_into().expect("chunk length");
        if let Ok(status) = Status::decode(raw) {
            assert_eq!(&status.encode(), raw);
        }
    }
});
