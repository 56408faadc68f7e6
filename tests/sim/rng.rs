//! A small seeded PRNG (splitmix64) and the bytes each object version holds.

/// Deterministic random numbers: the same seed gives the same run.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `per_mille / 1000`.
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The value of version `version` of an object: `size` bytes that differ from every
/// other version's (of any key) with overwhelming probability.
pub fn value(version: u64, size: u64) -> Vec<u8> {
    let base = mix(version.wrapping_mul(0xD1B5_4A32_D192_ED03) ^ 0x5EED);
    let mut out = vec![0u8; size as usize];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let word = mix(base ^ i as u64).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
    out
}
