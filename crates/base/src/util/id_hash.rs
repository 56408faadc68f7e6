//! A hasher for maps keyed by ids this process hands out itself (segment ids): one
//! multiply instead of SipHash, which costs more than the rest of a lookup on the
//! small-transfer path. Not for keys a peer can choose (no flooding resistance).

use std::hash::{BuildHasherDefault, Hasher};

/// Hashes one integer key by a multiply with a large odd constant (Fibonacci hashing).
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        // The map picks buckets by the low bits; a product's low bits see only the
        // key's low bits (ids that are multiples of a page would share buckets), its
        // high bits see them all.
        self.0.rotate_left(26)
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not reached for integer keys; a fold keeps any other key correct.
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// `HashMap<u64, V, IdHashing>`: a map keyed by ids of our own.
pub type IdHashing = BuildHasherDefault<IdHasher>;

#[cfg(test)]
mod tests {
    use super::IdHashing;
    use std::collections::HashMap;

    #[test]
    fn a_map_keyed_by_ids_finds_every_key() {
        let mut m: HashMap<u64, u64, IdHashing> = HashMap::default();
        for k in (0..10_000u64).map(|i| i * 4096) {
            m.insert(k, k + 1);
        }
        assert!((0..10_000u64).all(|i| m.get(&(i * 4096)) == Some(&(i * 4096 + 1))));
        assert_eq!(m.get(&1), None);
    }

    #[test]
    fn keys_that_differ_only_in_high_bits_spread_over_low_bits() {
        use std::hash::BuildHasher;
        let low: std::collections::HashSet<u64> = (0..256u64)
            .map(|i| IdHashing::default().hash_one(i << 12) & 0xff)
            .collect();
        // 256 keys into 256 buckets: far more than a few distinct buckets.
        assert!(low.len() > 128, "{} distinct", low.len());
    }
}
