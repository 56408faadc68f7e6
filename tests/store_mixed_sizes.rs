//! Objects of very different sizes sharing one pool, end to end (an in-process master
//! on 127.0.0.1, a node and a client over TCP): space small objects held must serve
//! large ones once they are evicted.

mod common;

use common::pattern as value;
use mooncake::store::protocol::{PoolStats, ReplicateConfig};
use mooncake::store::Client;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn stats(c: &Client) -> PoolStats {
    c.stats().expect("pool stats")
}

/// Puts `batches` batches of 64 fresh 4 KiB objects (a batch's last block starts at
/// the bottom of the victim order, so victims come from all over the pool, not slab
/// by slab); every put must succeed, evicting older ones as the pool fills.
fn put_small_batches(c: &Client, batches: u64) {
    let block = value(4, (4 * KIB) as usize);
    let parts: Vec<Vec<(u64, u64)>> = (0..64)
        .map(|_| vec![(block.as_ptr() as u64, block.len() as u64)])
        .collect();
    for b in 0..batches {
        let keys: Vec<String> = (0..64).map(|i| format!("small/{b}/{i}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        // SAFETY: `block` outlives the call, which returns once the bytes are sent.
        let results =
            unsafe { c.batch_put_from(&keys, &parts, &ReplicateConfig::default(), false) };
        for (k, r) in keys.iter().zip(results) {
            if let Err(e) = r {
                panic!("small put {k}: {e}");
            }
        }
    }
}

#[test]
fn large_puts_after_small_objects_filled_the_pool_succeed_and_evict_about_their_size() {
    common::cprog::quiet_logs();
    let pool = 512 * MIB;
    let s = common::store_server(10_000);
    let _node = common::store_client(&s, pool, true);
    let c = common::store_client(&s, 0, true);
    // One and a half pools of 4 KiB objects: full, the first ones evicted.
    put_small_batches(&c, pool * 3 / 2 / (4 * KIB) / 64);
    let before = stats(&c);
    assert!(before.used * 10 >= pool * 9, "the pool is full: {before:?}");

    let big = value(16, (16 * MIB) as usize);
    let puts = 12;
    for i in 0..puts {
        let key = format!("big/{i}");
        c.put(&key, &big, &ReplicateConfig::default())
            .unwrap_or_else(|e| panic!("16 MiB put {i} after the 4 KiB ones: {e}"));
        assert!(c.get(&key).unwrap() == big, "{key} reads back as written");
    }
    // Room is made slab by slab, not by evicting small objects until all their slabs
    // happen to be empty (which took the whole pool for the first large put).
    let after = stats(&c);
    let evicted = after.evicted_bytes - before.evicted_bytes;
    assert!(
        evicted <= 2 * puts * 16 * MIB,
        "{puts} puts of 16 MiB evicted {evicted} bytes; {before:?} -> {after:?}"
    );
}
