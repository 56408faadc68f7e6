//! HMAC-SHA256 (RFC 2104 over FIPS 180-4), and a comparison that takes the same time
//! wherever two MACs differ.

use super::sha256::{Sha256, BLOCK_LEN, DIGEST_LEN};

/// An incremental HMAC-SHA256 computation.
#[derive(Clone)]
pub struct HmacSha256 {
    inner: Sha256,
    /// The key XOR opad, kept for the outer hash.
    outer_key: [u8; BLOCK_LEN],
}

impl HmacSha256 {
    /// Starts a MAC under `key` (a key longer than a block is hashed first).
    pub fn new(key: &[u8]) -> HmacSha256 {
        let mut block = [0u8; BLOCK_LEN];
        if key.len() > BLOCK_LEN {
            block[..DIGEST_LEN].copy_from_slice(&super::sha256::digest(key));
        } else {
            block[..key.len()].copy_from_slice(key);
        }
        let mut inner_key = block;
        let mut outer_key = block;
        for (i, o) in inner_key.iter_mut().zip(outer_key.iter_mut()) {
            *i ^= 0x36;
            *o ^= 0x5c;
        }
        let mut inner = Sha256::new();
        inner.update(&inner_key);
        HmacSha256 { inner, outer_key }
    }

    /// Adds message bytes.
    pub fn update(&mut self, data: &[u8]) {
        self.inner.update(data);
    }

    /// The MAC.
    pub fn finish(self) -> [u8; DIGEST_LEN] {
        let inner = self.inner.finish();
        let mut outer = Sha256::new();
        outer.update(&self.outer_key);
        outer.update(&inner);
        outer.finish()
    }
}

/// HMAC-SHA256 of `data` under `key`.
pub fn mac(key: &[u8], data: &[u8]) -> [u8; DIGEST_LEN] {
    let mut h = HmacSha256::new(key);
    h.update(data);
    h.finish()
}

/// Whether `a` and `b` are equal, in time that depends only on their lengths (so a
/// forger learns nothing from how fast a wrong MAC is refused).
pub fn equal(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // Keeps the optimizer from turning the fold into an early exit.
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::hex;

    fn check(key: &[u8], data: &[u8], want: &str) {
        let got = hex::encode(&mac(key, data));
        assert_eq!(&got[..want.len()], want);
    }

    #[test]
    fn rfc_4231_test_cases() {
        // 1: short key.
        check(
            &[0x0b; 20],
            b"Hi There",
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
        );
        // 2: key shorter than the output.
        check(
            b"Jefe",
            b"what do ya want for nothing?",
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
        );
        // 3: combined key and data of 0xaa/0xdd.
        check(
            &[0xaa; 20],
            &[0xdd; 50],
            "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe",
        );
        // 4: a counting key.
        let key4: Vec<u8> = (1..=25).collect();
        check(
            &key4,
            &[0xcd; 50],
            "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
        );
        // 5: output truncated to 128 bits.
        check(
            &[0x0c; 20],
            b"Test With Truncation",
            "a3b6167473100ee06e0c796c2955552b",
        );
        // 6: a key larger than a block.
        check(
            &[0xaa; 131],
            b"Test Using Larger Than Block-Size Key - Hash Key First",
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
        );
        // 7: a larger-than-block key and larger-than-block data.
        check(
            &[0xaa; 131],
            b"This is a test using a larger than block-size key and a larger than block-size data. The key needs to be hashed before being used by the HMAC algorithm.",
            "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2",
        );
    }

    #[test]
    fn incremental_matches_one_shot_and_keys_of_a_block_are_not_hashed() {
        let mut h = HmacSha256::new(b"key");
        h.update(b"The quick brown fox ");
        h.update(b"jumps over the lazy dog");
        assert_eq!(
            hex::encode(&h.finish()),
            "f7bc83f430538424b13298e6aa6fb143ef4d59a14946175997479dbc2d1a3cd8"
        );
        // A 64-byte key is used as it is; hashing it first would give another MAC.
        let key = [0x11u8; 64];
        assert_ne!(
            mac(&key, b"x"),
            mac(&crate::util::sha256::digest(&key), b"x")
        );
    }

    #[test]
    fn equal_compares_whole_values() {
        assert!(equal(b"abc", b"abc"));
        assert!(!equal(b"abc", b"abd"));
        assert!(!equal(b"xbc", b"abc"));
        assert!(!equal(b"ab", b"abc"));
        assert!(equal(b"", b""));
    }
}
