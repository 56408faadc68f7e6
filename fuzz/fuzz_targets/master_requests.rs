//! Master RPC requests from an untrusted client, applied to a real master on a manual
//! clock: frames of `u16 method | u16 payload length | payload`, with a clock step and a
//! housekeeping tick between them (remounts with catalogs, drains and relocations
//! included). No request may panic or abort the master, and its
//! accounting stays consistent.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake::store::master::{Clock, Master, MasterConfig};
use mooncake::store::protocol::Request;

fuzz_target!(|data: &[u8]| {
    let config = MasterConfig {
        shards: 4,
        // Mounts up to 1 GiB: each costs the master a slab table, and an input may hold many.
        max_segment_size: 1 << 30,
        regex_budget: 1_000_000,
        // No node follows a catalog here: nothing to wait for.
        catalog_ack_timeout: std::time::Duration::ZERO,
        ..MasterConfig::default()
    };
    let clock = Clock::manual();
    let master = Master::with_clock(config, clock.clone());
    let mut rest = data;
    while let Some((head, tail)) = rest.split_first_chunk::<4>() {
        let method = u16::from_le_bytes([head[0], head[1]]);
        let len = (u16::from_le_bytes([head[2], head[3]]) as usize).min(tail.len());
        let (payload, tail) = tail.split_at(len);
        rest = tail;
        // The low method bits pick the method; the high ones move the clock.
        clock.advance(u64::from(method >> 5) * 100);
        // A catalog poll waits for news (half a second): the tests cover it.
        match Request::decode(method & 0x1f, payload) {
            Ok(Request::SegmentEvents { .. }) | Err(_) => {}
            Ok(req) => {
                let _ = master.handle(req);
            }
        }
        master.tick();
        let stats = master.stats();
        assert!(stats.used <= stats.capacity, "{stats:?}");
        assert_eq!(stats.segments as usize, master.all_segments().len());
    }
});
