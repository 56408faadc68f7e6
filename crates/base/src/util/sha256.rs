//! SHA-256 (FIPS 180-4), written out so the crate needs no hashing dependency. Used
//! for HMAC-SHA256 (cluster authentication) and request body digests.

/// Bytes in a digest.
pub const DIGEST_LEN: usize = 32;
/// Bytes in one compression block.
pub const BLOCK_LEN: usize = 64;

/// First 32 bits of the fractional parts of the cube roots of the first 64 primes.
const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

/// First 32 bits of the fractional parts of the square roots of the first 8 primes.
const H0: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

/// An incremental SHA-256 computation.
#[derive(Clone)]
pub struct Sha256 {
    state: [u32; 8],
    block: [u8; BLOCK_LEN],
    /// Bytes of `block` filled.
    filled: usize,
    /// Message bytes hashed so far.
    total: u64,
}

impl Default for Sha256 {
    fn default() -> Self {
        Sha256::new()
    }
}

impl Sha256 {
    /// A fresh computation.
    pub fn new() -> Sha256 {
        Sha256 {
            state: H0,
            block: [0; BLOCK_LEN],
            filled: 0,
            total: 0,
        }
    }

    /// Hashes more message bytes.
    pub fn update(&mut self, mut data: &[u8]) {
        self.total = self.total.wrapping_add(data.len() as u64);
        if self.filled > 0 {
            let take = data.len().min(BLOCK_LEN - self.filled);
            self.block[self.filled..self.filled + take].copy_from_slice(&data[..take]);
            self.filled += take;
            data = &data[take..];
            if self.filled < BLOCK_LEN {
                return;
            }
            let block = self.block;
            compress(&mut self.state, &block);
            self.filled = 0;
        }
        let mut chunks = data.chunks_exact(BLOCK_LEN);
        for chunk in &mut chunks {
            compress(&mut self.state, chunk.try_into().expect("a whole block"));
        }
        let rest = chunks.remainder();
        self.block[..rest.len()].copy_from_slice(rest);
        self.filled = rest.len();
    }

    /// Pads, finishes and returns the digest.
    pub fn finish(mut self) -> [u8; DIGEST_LEN] {
        let bits = self.total.wrapping_mul(8);
        // 0x80, zeros up to 56 mod 64, then the message length in bits, big-endian.
        let pad_len = if self.filled < 56 {
            56 - self.filled
        } else {
            120 - self.filled
        };
        let mut pad = [0u8; BLOCK_LEN + 8];
        pad[0] = 0x80;
        pad[pad_len..pad_len + 8].copy_from_slice(&bits.to_be_bytes());
        let total = self.total;
        self.update(&pad[..pad_len + 8]);
        debug_assert_eq!(self.filled, 0);
        self.total = total;
        let mut out = [0u8; DIGEST_LEN];
        for (o, w) in out.chunks_exact_mut(4).zip(self.state) {
            o.copy_from_slice(&w.to_be_bytes());
        }
        out
    }
}

/// The SHA-256 digest of `data`.
pub fn digest(data: &[u8]) -> [u8; DIGEST_LEN] {
    let mut h = Sha256::new();
    h.update(data);
    h.finish()
}

fn compress(state: &mut [u32; 8], block: &[u8; BLOCK_LEN]) {
    #[cfg(target_arch = "x86_64")]
    if shani::available() {
        // SAFETY: the CPU has the SHA extensions, SSSE3 and SSE4.1 (just checked).
        unsafe { shani::compress(state, block) };
        return;
    }
    compress_portable(state, block);
}

fn compress_portable(state: &mut [u32; 8], block: &[u8; BLOCK_LEN]) {
    let mut w = [0u32; 64];
    for (i, word) in block.chunks_exact(4).enumerate() {
        w[i] = u32::from_be_bytes(word.try_into().expect("4 bytes"));
    }
    for i in 16..64 {
        let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
        let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16]
            .wrapping_add(s0)
            .wrapping_add(w[i - 7])
            .wrapping_add(s1);
    }
    let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut h] = *state;
    for i in 0..64 {
        let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
        let ch = (e & f) ^ (!e & g);
        let t1 = h
            .wrapping_add(s1)
            .wrapping_add(ch)
            .wrapping_add(K[i])
            .wrapping_add(w[i]);
        let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
        let maj = (a & b) ^ (a & c) ^ (b & c);
        let t2 = s0.wrapping_add(maj);
        h = g;
        g = f;
        f = e;
        e = d.wrapping_add(t1);
        d = c;
        c = b;
        b = a;
        a = t1.wrapping_add(t2);
    }
    for (s, v) in state.iter_mut().zip([a, b, c, d, e, f, g, h]) {
        *s = s.wrapping_add(v);
    }
}

/// The compression function on the x86 SHA extensions (a tenth of the portable one's
/// time here): the notes a master seals on every put are HMAC-SHA256.
#[cfg(target_arch = "x86_64")]
mod shani {
    use super::{BLOCK_LEN, K};
    use std::arch::x86_64::*;

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("sha")
            && is_x86_feature_detected!("ssse3")
            && is_x86_feature_detected!("sse4.1")
    }

    /// # Safety
    /// The CPU must have the SHA extensions, SSSE3 and SSE4.1.
    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    pub(super) unsafe fn compress(state: &mut [u32; 8], block: &[u8; BLOCK_LEN]) {
        // The instructions keep the working variables as (a, b, e, f) and
        // (c, d, g, h), highest lane first.
        // SAFETY: 16-byte unaligned loads within `state`, `block` and `K`.
        unsafe {
            let abcd = _mm_loadu_si128(state.as_ptr().cast());
            let efgh = _mm_loadu_si128(state.as_ptr().add(4).cast());
            let badc = _mm_shuffle_epi32(abcd, 0xB1);
            let hgfe = _mm_shuffle_epi32(efgh, 0x1B);
            let mut abef = _mm_alignr_epi8(badc, hgfe, 8);
            let mut cdgh = _mm_blend_epi16(hgfe, badc, 0xF0);
            let (abef_in, cdgh_in) = (abef, cdgh);
            // Message words are big-endian: reverse the bytes of each lane.
            let swap = _mm_set_epi64x(0x0c0d_0e0f_0809_0a0b, 0x0405_0607_0001_0203);
            let mut w = [_mm_setzero_si128(); 4];
            for (g, slot) in w.iter_mut().enumerate() {
                *slot = _mm_shuffle_epi8(_mm_loadu_si128(block.as_ptr().add(16 * g).cast()), swap);
            }
            for g in 0..16 {
                if g >= 4 {
                    // W[t] = σ1(W[t-2]) + W[t-7] + σ0(W[t-15]) + W[t-16], four at a time.
                    let (w16, w12, w8, w4) =
                        (w[g % 4], w[(g + 1) % 4], w[(g + 2) % 4], w[(g + 3) % 4]);
                    let partial =
                        _mm_add_epi32(_mm_sha256msg1_epu32(w16, w12), _mm_alignr_epi8(w4, w8, 4));
                    w[g % 4] = _mm_sha256msg2_epu32(partial, w4);
                }
                let wk = _mm_add_epi32(w[g % 4], _mm_loadu_si128(K.as_ptr().add(4 * g).cast()));
                cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
                abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));
            }
            abef = _mm_add_epi32(abef, abef_in);
            cdgh = _mm_add_epi32(cdgh, cdgh_in);
            let feba = _mm_shuffle_epi32(abef, 0x1B);
            let dchg = _mm_shuffle_epi32(cdgh, 0xB1);
            _mm_storeu_si128(state.as_mut_ptr().cast(), _mm_blend_epi16(feba, dchg, 0xF0));
            _mm_storeu_si128(
                state.as_mut_ptr().add(4).cast(),
                _mm_alignr_epi8(dchg, feba, 8),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::hex;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_sha_extensions_compress_as_the_portable_code_does() {
        if !shani::available() {
            eprintln!("skipped: no SHA extensions on this CPU");
            return;
        }
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..2000 {
            let mut state = [0u32; 8];
            state.iter_mut().for_each(|s| *s = next() as u32);
            let mut block = [0u8; BLOCK_LEN];
            block.iter_mut().for_each(|b| *b = next() as u8);
            let mut want = state;
            compress_portable(&mut want, &block);
            // SAFETY: the CPU has the extensions (checked above).
            unsafe { shani::compress(&mut state, &block) };
            assert_eq!(state, want);
        }
    }

    fn hex_digest(data: &[u8]) -> String {
        hex::encode(&digest(data))
    }

    #[test]
    fn fips_180_4_and_rfc_6234_vectors() {
        assert_eq!(
            hex_digest(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            hex_digest(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex_digest(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        assert_eq!(
            hex_digest(
                b"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu"
            ),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"
        );
        assert_eq!(
            hex_digest(&vec![b'a'; 1_000_000]),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"
        );
        // RFC 6234 TEST4: 64 bytes repeated 10 times.
        let test4 = b"0123456701234567012345670123456701234567012345670123456701234567".repeat(10);
        assert_eq!(
            hex_digest(&test4),
            "594847328451bdfa85056225462cc1d867d877fb388df0ce35f25ab5562bfbb5"
        );
    }

    #[test]
    fn incremental_updates_match_one_shot_at_every_split() {
        let data: Vec<u8> = (0..200u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0, 1, 55, 56, 63, 64, 65, 119, 120, 128, 200] {
            let want = digest(&data[..len]);
            for split in 0..=len {
                let mut h = Sha256::new();
                h.update(&data[..split]);
                h.update(&data[split..len]);
                assert_eq!(h.finish(), want, "len {len} split {split}");
            }
        }
    }
}
