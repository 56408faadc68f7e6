//! CRC-32C (Castagnoli), as used by iSCSI, ext4, SCTP and many storage
//! systems: reflected polynomial `0x82F63B78`, initial value `!0`, final
//! XOR `!0`.
//!
//! [`crc32c`] checksums a buffer; [`crc32c_append`] continues a checksum,
//! so `crc32c_append(crc32c(a), b) == crc32c(a ++ b)`.
//!
//! On x86_64 CPUs with SSE4.2 the hardware `crc32` instruction is used,
//! running three independent streams side by side to hide its 3-cycle
//! latency; the partial results are stitched together with precomputed
//! "shift" tables (multiplication by `x^(8n) mod P` in GF(2)). Everywhere
//! else a table-driven slicing-by-8 implementation is used. All tables are
//! built at compile time.

/// The CRC-32C polynomial in reflected (LSB-first) bit order.
const POLY: u32 = 0x82F6_3B78;

// ---------------------------------------------------------------------------
// GF(2) polynomial arithmetic modulo P, in reflected representation: bit 31
// holds the coefficient of x^0 and bit 0 the coefficient of x^31.
// ---------------------------------------------------------------------------

/// Multiplies `p` by `x` modulo P.
const fn mul_x(p: u32) -> u32 {
    if p & 1 != 0 {
        (p >> 1) ^ POLY
    } else {
        p >> 1
    }
}

/// Returns `a * b mod P`.
const fn mul_mod(a: u32, mut b: u32) -> u32 {
    let mut product = 0u32;
    let mut degree = 0;
    while degree < 32 {
        // Coefficient of x^degree in `a`; `b` holds `b_orig * x^degree`.
        if a & (1u32 << (31 - degree)) != 0 {
            product ^= b;
        }
        b = mul_x(b);
        degree += 1;
    }
    product
}

/// Returns `x^n mod P`, by square-and-multiply.
const fn x_pow_mod(mut n: u64) -> u32 {
    let mut result = 1u32 << 31; // x^0
    let mut square = 1u32 << 30; // x^1
    while n != 0 {
        if n & 1 != 0 {
            result = mul_mod(result, square);
        }
        square = mul_mod(square, square);
        n >>= 1;
    }
    result
}

/// Builds a table that multiplies a 32-bit CRC register by `x^(8 * bytes)`
/// modulo P, i.e. advances it over `bytes` zero bytes. The map is linear,
/// so the register is split into its four bytes and the per-byte products
/// are XORed together.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const fn shift_table(bytes: u64) -> [[u32; 256]; 4] {
    let factor = x_pow_mod(8 * bytes);
    let mut table = [[0u32; 256]; 4];
    let mut lane = 0;
    while lane < 4 {
        let mut value = 0;
        while value < 256 {
            table[lane][value] = mul_mod(factor, (value as u32) << (8 * lane));
            value += 1;
        }
        lane += 1;
    }
    table
}

/// Applies a table built by [`shift_table`].
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline]
fn shift(table: &[[u32; 256]; 4], crc: u32) -> u32 {
    table[0][(crc & 0xff) as usize]
        ^ table[1][((crc >> 8) & 0xff) as usize]
        ^ table[2][((crc >> 16) & 0xff) as usize]
        ^ table[3][(crc >> 24) as usize]
}

// ---------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------

/// Computes the CRC-32C of `data`.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c_append(0, data)
}

/// Continues `crc` (a finished CRC-32C of some prefix, or 0 for none) over
/// `data`, so that `crc32c_append(crc32c(a), b) == crc32c(a ++ b)`.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if hw::available() {
            // SAFETY: `available()` confirmed at run time that this CPU
            // supports SSE4.2, the only target feature the function needs.
            return !unsafe { hw::update(!crc, data) };
        }
    }
    !sw_update(!crc, data)
}

/// Portable (slicing-by-8) CRC-32C, with the same result as [`crc32c`].
/// Exposed so tests and benchmarks can compare it with the hardware path.
pub fn crc32c_software(data: &[u8]) -> u32 {
    crc32c_software_append(0, data)
}

/// Portable counterpart of [`crc32c_append`].
pub fn crc32c_software_append(crc: u32, data: &[u8]) -> u32 {
    !sw_update(!crc, data)
}

/// Whether [`crc32c`] uses a hardware CRC instruction on this machine.
pub fn hardware_accelerated() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        hw::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

// ---------------------------------------------------------------------------
// Software path: slicing-by-8.
// ---------------------------------------------------------------------------

const fn slicing_tables() -> [[u32; 256]; 8] {
    let mut tables = [[0u32; 256]; 8];
    let mut value = 0;
    while value < 256 {
        let mut crc = value as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = mul_x(crc);
            bit += 1;
        }
        tables[0][value] = crc;
        value += 1;
    }
    let mut slice = 1;
    while slice < 8 {
        let mut value = 0;
        while value < 256 {
            let prev = tables[slice - 1][value];
            tables[slice][value] = (prev >> 8) ^ tables[0][(prev & 0xff) as usize];
            value += 1;
        }
        slice += 1;
    }
    tables
}

/// `SLICING[k][b]`: the register contribution of byte `b` followed by `k`
/// zero bytes.
static SLICING: [[u32; 256]; 8] = slicing_tables();

/// Advances the raw (un-inverted) CRC register over `data`.
fn sw_update(mut crc: u32, data: &[u8]) -> u32 {
    let t = &SLICING;
    let mut chunks = data.chunks_exact(8);
    for chunk in &mut chunks {
        let lo = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]) ^ crc;
        let hi = u32::from_le_bytes([chunk[4], chunk[5], chunk[6], chunk[7]]);
        crc = t[7][(lo & 0xff) as usize]
            ^ t[6][((lo >> 8) & 0xff) as usize]
            ^ t[5][((lo >> 16) & 0xff) as usize]
            ^ t[4][(lo >> 24) as usize]
            ^ t[3][(hi & 0xff) as usize]
            ^ t[2][((hi >> 8) & 0xff) as usize]
            ^ t[1][((hi >> 16) & 0xff) as usize]
            ^ t[0][(hi >> 24) as usize];
    }
    for &byte in chunks.remainder() {
        crc = (crc >> 8) ^ t[0][((crc ^ u32::from(byte)) & 0xff) as usize];
    }
    crc
}

// ---------------------------------------------------------------------------
// Hardware path: SSE4.2 `crc32`, three interleaved streams.
// ---------------------------------------------------------------------------

#[cfg(target_arch = "x86_64")]
mod hw {
    use super::{shift, shift_table};
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    use std::sync::atomic::{AtomicU8, Ordering};

    /// Bytes per stream in the large interleaved blocks.
    const LONG: usize = 8192;
    /// Bytes per stream in the small interleaved blocks.
    const SHORT: usize = 256;

    static SHIFT_LONG: [[u32; 256]; 4] = shift_table(LONG as u64);
    static SHIFT_SHORT: [[u32; 256]; 4] = shift_table(SHORT as u64);

    const UNKNOWN: u8 = 0;
    const ABSENT: u8 = 1;
    const PRESENT: u8 = 2;
    static SSE42: AtomicU8 = AtomicU8::new(UNKNOWN);

    /// Whether the CPU supports SSE4.2 (detected once, then cached).
    #[inline]
    pub(super) fn available() -> bool {
        match SSE42.load(Ordering::Relaxed) {
            PRESENT => true,
            ABSENT => false,
            _ => {
                let present = is_x86_feature_detected!("sse4.2");
                SSE42.store(if present { PRESENT } else { ABSENT }, Ordering::Relaxed);
                present
            }
        }
    }

    #[inline(always)]
    fn word(bytes: &[u8]) -> u64 {
        let mut buf = [0u8; 8];
        buf.copy_from_slice(bytes);
        u64::from_le_bytes(buf)
    }

    /// Runs three streams of `len` bytes each (`block.len() == 3 * len`)
    /// and folds them into one register: with `a`, `b`, `c` the registers
    /// after each stream (`b` and `c` started from 0), the combined
    /// register is `shift(shift(a) ^ b) ^ c`.
    ///
    /// # Safety
    /// The CPU must support SSE4.2.
    #[target_feature(enable = "sse4.2")]
    unsafe fn triple(crc: u32, block: &[u8], len: usize, table: &[[u32; 256]; 4]) -> u32 {
        debug_assert_eq!(block.len(), 3 * len);
        let (s0, rest) = block.split_at(len);
        let (s1, s2) = rest.split_at(len);
        let (mut a, mut b, mut c) = (u64::from(crc), 0u64, 0u64);
        for ((x, y), z) in s0
            .chunks_exact(8)
            .zip(s1.chunks_exact(8))
            .zip(s2.chunks_exact(8))
        {
            a = _mm_crc32_u64(a, word(x));
            b = _mm_crc32_u64(b, word(y));
            c = _mm_crc32_u64(c, word(z));
        }
        let ab = shift(table, a as u32) ^ b as u32;
        shift(table, ab) ^ c as u32
    }

    /// Advances the raw (un-inverted) CRC register over `data`.
    ///
    /// # Safety
    /// The CPU must support SSE4.2.
    #[target_feature(enable = "sse4.2")]
    pub(super) unsafe fn update(mut crc: u32, mut data: &[u8]) -> u32 {
        // Byte steps up to 8-byte alignment, so the word loads are aligned.
        let misalign = data.as_ptr().align_offset(8).min(data.len());
        let (head, rest) = data.split_at(misalign);
        for &byte in head {
            crc = _mm_crc32_u8(crc, byte);
        }
        data = rest;

        while data.len() >= 3 * LONG {
            let (block, rest) = data.split_at(3 * LONG);
            // SAFETY: SSE4.2 is present, as `update`'s own contract requires.
            crc = unsafe { triple(crc, block, LONG, &SHIFT_LONG) };
            data = rest;
        }
        while data.len() >= 3 * SHORT {
            let (block, rest) = data.split_at(3 * SHORT);
            // SAFETY: SSE4.2 is present, as `update`'s own contract requires.
            crc = unsafe { triple(crc, block, SHORT, &SHIFT_SHORT) };
            data = rest;
        }

        let mut wide = u64::from(crc);
        let mut words = data.chunks_exact(8);
        for w in &mut words {
            wide = _mm_crc32_u64(wide, word(w));
        }
        let mut crc = wide as u32;
        for &byte in words.remainder() {
            crc = _mm_crc32_u8(crc, byte);
        }
        crc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bit-at-a-time reference implementation.
    fn reference(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &byte in data {
            crc ^= u32::from(byte);
            for _ in 0..8 {
                crc = mul_x(crc);
            }
        }
        !crc
    }

    fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
        let mut state = seed | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect()
    }

    #[test]
    fn known_answers() {
        for f in [crc32c, crc32c_software, reference] {
            assert_eq!(f(b""), 0);
            assert_eq!(f(b"123456789"), 0xE306_9283);
            assert_eq!(f(&[0u8; 32]), 0x8A91_36AA);
            assert_eq!(f(&[0xffu8; 32]), 0x62A8_AB43);
        }
    }

    #[test]
    fn gf2_arithmetic() {
        let one = 1u32 << 31;
        assert_eq!(x_pow_mod(0), one);
        assert_eq!(x_pow_mod(1), 1 << 30);
        assert_eq!(x_pow_mod(31), 1);
        assert_eq!(x_pow_mod(32), POLY);
        assert_eq!(mul_mod(one, 0x1234_5678), 0x1234_5678);
        assert_eq!(mul_mod(x_pow_mod(40), x_pow_mod(60)), x_pow_mod(100));
        // Shifting a register over n zero bytes with the table equals
        // feeding the zero bytes through the byte-wise loop.
        let table = shift_table(37);
        for crc in [1u32, 0xdead_beef, 0x8000_0000, !0] {
            let mut slow = crc;
            for _ in 0..37 {
                slow = (slow >> 8) ^ SLICING[0][(slow & 0xff) as usize];
            }
            assert_eq!(shift(&table, crc), slow);
        }
    }

    #[test]
    fn matches_reference_on_all_paths() {
        let data = pseudo_random(3 * 8192 * 2 + 3 * 256 + 77, 0x5eed);
        for &len in &[0usize, 1, 7, 8, 9, 767, 768, 769, 3 * 8192, data.len()] {
            for offset in 0..3 {
                let slice = &data[offset..offset + len.min(data.len() - offset)];
                let want = reference(slice);
                assert_eq!(crc32c(slice), want, "len {len} offset {offset}");
                assert_eq!(crc32c_software(slice), want, "len {len} offset {offset}");
            }
        }
    }

    #[test]
    fn append_composes() {
        let data = pseudo_random(5000, 7);
        let whole = crc32c(&data);
        for split in [0, 1, 100, 2500, 4999, 5000] {
            let (a, b) = data.split_at(split);
            assert_eq!(crc32c_append(crc32c(a), b), whole);
            assert_eq!(crc32c_software_append(crc32c_software(a), b), whole);
        }
    }
}
