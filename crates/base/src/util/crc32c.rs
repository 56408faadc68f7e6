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
//! "shift" tables (multiplication by `x^(8n) mod P` in GF(2)). Where the CPU
//! also has wide carry-less multiplication (`vpclmulqdq`, with AVX-512 or with
//! AVX2), and the crate is built with Rust 1.89 or later, buffers of 256 bytes
//! and more are folded 256 bytes per step instead, several times the `crc32`
//! instruction's throughput (it bounds how fast a store read can be verified).
//! Everywhere else a table-driven slicing-by-8 implementation is used. All
//! tables and constants are built at compile time.

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
    // SAFETY: without copying, `dst` is never used.
    match unsafe { hardware::<false>(!crc, data, std::ptr::null_mut()) } {
        Some(raw) => !raw,
        None => !sw_update(!crc, data),
    }
}

/// The raw CRC register `raw` continued over `data` on the fastest path this CPU
/// runs (folding for long buffers, else SSE4.2's `crc32`), copying `data` to `dst`
/// with `COPY`; `None` where the CPU has neither (the caller takes the portable path).
/// Each path's features are checked at run time, once.
///
/// # Safety
/// With `COPY`, `dst` must be valid for writes of `data.len()` bytes and must not
/// overlap `data`.
#[inline]
unsafe fn hardware<const COPY: bool>(raw: u32, data: &[u8], dst: *mut u8) -> Option<u32> {
    #[cfg(target_arch = "x86_64")]
    {
        #[cfg(mc_avx512_intrinsics)]
        if data.len() >= fold::MIN_LEN {
            if fold::available() {
                // SAFETY: this CPU has every feature `fold::update` enables, the
                // buffer is at least `MIN_LEN` bytes, and `dst` is the caller's promise.
                return Some(unsafe { fold::update::<COPY>(raw, data, dst) });
            }
            if fold::available_256() {
                // SAFETY: as above, for `update_256` and `available_256`.
                return Some(unsafe { fold::update_256::<COPY>(raw, data, dst) });
            }
        }
        if hw::available() {
            // SAFETY: SSE4.2 is present, the only feature `hw::update` needs; `dst`
            // is the caller's promise.
            return Some(unsafe { hw::update::<COPY>(raw, data, dst) });
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (raw, data, dst);
    None
}

/// Copies `src` to `dst` and continues `crc` over the bytes, in one pass: each word
/// is folded into the checksum between its load and its store, so a read that must be
/// verified costs one trip through memory, not a copy and then a second read.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes and must not overlap `src`.
pub unsafe fn crc32c_append_copying(crc: u32, src: &[u8], dst: *mut u8) -> u32 {
    // SAFETY: `dst` is the caller's promise, as `hardware` needs it.
    if let Some(raw) = unsafe { hardware::<true>(!crc, src, dst) } {
        return !raw;
    }
    // Chunks small enough to be checksummed while still in the first-level cache.
    let mut crc = !crc;
    for (i, chunk) in src.chunks(16 << 10).enumerate() {
        // SAFETY: `dst + i * 16 KiB` is inside the caller's `src.len()` bytes at `dst`,
        // which do not overlap `src`.
        unsafe {
            std::ptr::copy_nonoverlapping(chunk.as_ptr(), dst.add(i * (16 << 10)), chunk.len())
        };
        crc = sw_update(crc, chunk);
    }
    !crc
}

/// The CRC-32C of `a ++ b` from `crc32c(a)`, `crc32c(b)` and `b`'s length: checksums
/// of pieces moved in parallel, joined in their order.
pub fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    // Appending `b` to a register `r` gives `r * x^(8 len_b) + f(b)`; the fixed
    // initial and final inversions cancel out of the difference of two such sums.
    // `x^(8 len_b)` is the product of the table's powers for `len_b`'s set bits.
    let mut shifted = crc_a;
    let mut n = len_b;
    while n != 0 && shifted != 0 {
        let bit = n.trailing_zeros();
        shifted = mul_mod(X_POW_8_TIMES_2K[bit as usize], shifted);
        n &= n - 1;
    }
    shifted ^ crc_b
}

/// `x^(8 * 2^k) mod P` for each `k`: shifts by a power-of-two number of bytes.
static X_POW_8_TIMES_2K: [u32; 64] = {
    let mut table = [0u32; 64];
    let mut k = 0;
    let mut power = x_pow_mod(8);
    while k < 64 {
        table[k] = power;
        power = mul_mod(power, power);
        k += 1;
    }
    table
};

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

/// Stores `bytes` at `dst` when copying (the byte heads and tails of the copying
/// forms of the hardware paths).
///
/// # Safety
/// With `COPY`, `dst` must be writable for `bytes.len()` bytes, apart from them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn copy_bytes<const COPY: bool>(bytes: &[u8], dst: *mut u8) {
    if COPY {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
    }
}

// ---------------------------------------------------------------------------
// Hardware path: SSE4.2 `crc32`, three interleaved streams.
// ---------------------------------------------------------------------------

/// A CPU feature test, run once and then cached (each path asks on every call).
#[cfg(target_arch = "x86_64")]
struct Detected(std::sync::atomic::AtomicU8);

#[cfg(target_arch = "x86_64")]
impl Detected {
    const UNKNOWN: u8 = 0;
    const ABSENT: u8 = 1;
    const PRESENT: u8 = 2;

    const fn new() -> Detected {
        Detected(std::sync::atomic::AtomicU8::new(Detected::UNKNOWN))
    }

    /// The cached answer, asking `detect` the first time.
    #[inline]
    fn get(&self, detect: fn() -> bool) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        match self.0.load(Relaxed) {
            Detected::PRESENT => true,
            Detected::ABSENT => false,
            _ => {
                let present = detect();
                let state = if present {
                    Detected::PRESENT
                } else {
                    Detected::ABSENT
                };
                self.0.store(state, Relaxed);
                present
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod hw {
    use super::{copy_bytes, shift, shift_table, Detected};
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};

    /// Bytes per stream in the large interleaved blocks.
    const LONG: usize = 8192;
    /// Bytes per stream in the small interleaved blocks.
    const SHORT: usize = 256;

    static SHIFT_LONG: [[u32; 256]; 4] = shift_table(LONG as u64);
    static SHIFT_SHORT: [[u32; 256]; 4] = shift_table(SHORT as u64);

    static SSE42: Detected = Detected::new();

    /// Whether the CPU supports SSE4.2 (detected once, then cached).
    #[inline]
    pub(super) fn available() -> bool {
        SSE42.get(|| is_x86_feature_detected!("sse4.2"))
    }

    #[inline(always)]
    fn word(bytes: &[u8]) -> u64 {
        let mut buf = [0u8; 8];
        buf.copy_from_slice(bytes);
        u64::from_le_bytes(buf)
    }

    /// The word at `bytes`, also stored at `dst + at` when copying.
    ///
    /// # Safety
    /// With `COPY`, `dst + at .. + 8` must be writable.
    #[inline(always)]
    unsafe fn take<const COPY: bool>(bytes: &[u8], dst: *mut u8, at: usize) -> u64 {
        let w = word(bytes);
        if COPY {
            // SAFETY: the caller's contract; no alignment needed.
            unsafe { dst.add(at).cast::<u64>().write_unaligned(w) };
        }
        w
    }

    /// Runs three streams of `len` bytes each (`block.len() == 3 * len`)
    /// and folds them into one register: with `a`, `b`, `c` the registers
    /// after each stream (`b` and `c` started from 0), the combined
    /// register is `shift(shift(a) ^ b) ^ c`. With `COPY` the block is also
    /// stored at `dst`.
    ///
    /// # Safety
    /// The CPU must support SSE4.2; with `COPY`, `dst` must be writable for
    /// `block.len()` bytes.
    #[target_feature(enable = "sse4.2")]
    unsafe fn triple<const COPY: bool>(
        crc: u32,
        block: &[u8],
        dst: *mut u8,
        len: usize,
        table: &[[u32; 256]; 4],
    ) -> u32 {
        debug_assert_eq!(block.len(), 3 * len);
        let (s0, rest) = block.split_at(len);
        let (s1, s2) = rest.split_at(len);
        let (mut a, mut b, mut c) = (u64::from(crc), 0u64, 0u64);
        for (i, ((x, y), z)) in s0
            .chunks_exact(8)
            .zip(s1.chunks_exact(8))
            .zip(s2.chunks_exact(8))
            .enumerate()
        {
            let at = 8 * i;
            // SAFETY: `at + 2 len + 8 <= block.len()`, writable at `dst` when copying.
            let (x, y, z) = unsafe {
                (
                    take::<COPY>(x, dst, at),
                    take::<COPY>(y, dst, len + at),
                    take::<COPY>(z, dst, 2 * len + at),
                )
            };
            a = _mm_crc32_u64(a, x);
            b = _mm_crc32_u64(b, y);
            c = _mm_crc32_u64(c, z);
        }
        let ab = shift(table, a as u32) ^ b as u32;
        shift(table, ab) ^ c as u32
    }

    /// Advances the raw (un-inverted) CRC register over `data`, and with
    /// `COPY` also copies it to `dst`.
    ///
    /// # Safety
    /// The CPU must support SSE4.2; with `COPY`, `dst` must be writable for
    /// `data.len()` bytes and must not overlap `data`.
    #[target_feature(enable = "sse4.2")]
    pub(super) unsafe fn update<const COPY: bool>(
        mut crc: u32,
        mut data: &[u8],
        mut dst: *mut u8,
    ) -> u32 {
        // Byte steps up to 8-byte alignment, so the word loads are aligned.
        let misalign = data.as_ptr().align_offset(8).min(data.len());
        let (head, rest) = data.split_at(misalign);
        // (Below, `dst` advances with `data`, within the caller's writable bytes.)
        // SAFETY: the first `head.len()` of the caller's writable bytes.
        unsafe { copy_bytes::<COPY>(head, dst) };
        for &byte in head {
            crc = _mm_crc32_u8(crc, byte);
        }
        data = rest;
        dst = dst.wrapping_add(misalign);

        for (stream, table) in [(LONG, &SHIFT_LONG), (SHORT, &SHIFT_SHORT)] {
            while data.len() >= 3 * stream {
                let (block, rest) = data.split_at(3 * stream);
                // SAFETY: SSE4.2 is present and `dst` is writable for the block.
                crc = unsafe { triple::<COPY>(crc, block, dst, stream, table) };
                data = rest;
                dst = dst.wrapping_add(3 * stream);
            }
        }

        let mut wide = u64::from(crc);
        let mut words = data.chunks_exact(8);
        for (i, w) in (&mut words).enumerate() {
            // SAFETY: inside the remaining writable bytes at `dst`.
            wide = _mm_crc32_u64(wide, unsafe { take::<COPY>(w, dst, 8 * i) });
        }
        let tail = words.remainder();
        // SAFETY: the last `tail.len()` writable bytes.
        unsafe { copy_bytes::<COPY>(tail, dst.wrapping_add(data.len() - tail.len())) };
        let mut crc = wide as u32;
        for &byte in tail {
            crc = _mm_crc32_u8(crc, byte);
        }
        crc
    }
}

// ---------------------------------------------------------------------------
// Folding paths: wide carry-less multiplication (AVX-512, or AVX2 on CPUs with
// `vpclmulqdq` but no AVX-512), 256 bytes per step.
// ---------------------------------------------------------------------------

/// Folding keeps the message as a 128-bit remainder-equivalent: a 16-byte lane
/// `D` followed by `F` more bits contributes `D * x^F`, which equals (mod P)
/// the lane's first 8 bytes times `x^(F+64)` plus its last 8 times `x^F`, each
/// product short enough to XOR into the lane `F` bits further on. A carry-less
/// product of two reflected operands comes out multiplied by `x`, hence the
/// constants are `x^(F+63)` and `x^(F-1)`. The register's initial value is the
/// first 32 message bits XORed in; the final 16-byte remainder is a message of
/// its own whose `crc32` (from 0) is the checksum so far. The AVX2 form keeps
/// eight 32-byte accumulators where the AVX-512 form keeps four of 64.
/// (Built with Rust 1.89 and later, whose AVX-512 and `vpclmulqdq` intrinsics it
/// needs; see `build.rs`.)
#[cfg(all(target_arch = "x86_64", mc_avx512_intrinsics))]
#[clippy::msrv = "1.89"]
mod fold {
    use super::{x_pow_mod, Detected};
    use std::arch::x86_64::{
        __m128i, __m256i, __m512i, _mm256_castsi256_si128, _mm256_clmulepi64_epi128,
        _mm256_extracti128_si256, _mm256_loadu_si256, _mm256_set_epi64x, _mm256_storeu_si256,
        _mm256_xor_si256, _mm256_zextsi128_si256, _mm512_castsi128_si512, _mm512_clmulepi64_epi128,
        _mm512_extracti32x4_epi32, _mm512_loadu_si512, _mm512_set_epi64, _mm512_storeu_si512,
        _mm512_ternarylogic_epi64, _mm512_xor_si512, _mm_clmulepi64_si128, _mm_crc32_u64,
        _mm_crc32_u8, _mm_cvtsi128_si64, _mm_cvtsi32_si128, _mm_extract_epi64, _mm_loadu_si128,
        _mm_set_epi64x, _mm_xor_si128,
    };

    /// Shortest buffer folded (one 256-byte block: every accumulator of either form).
    pub(super) const MIN_LEN: usize = 256;

    /// Constants moving a 16-byte lane `bits` further: (first 8 bytes, last 8),
    /// as 64-bit reflected operands (a polynomial of degree < 32 in the top half).
    const fn constants(bits: u64) -> (i64, i64) {
        (
            ((x_pow_mod(bits + 63) as u64) << 32) as i64,
            ((x_pow_mod(bits - 1) as u64) << 32) as i64,
        )
    }
    const BY_256_BYTES: (i64, i64) = constants(2048);
    const BY_64_BYTES: (i64, i64) = constants(512);
    const BY_32_BYTES: (i64, i64) = constants(256);
    const BY_16_BYTES: (i64, i64) = constants(128);

    static FEATURES: Detected = Detected::new();
    static FEATURES_256: Detected = Detected::new();

    /// Whether the CPU has every feature `update` enables (detected once).
    #[inline]
    pub(super) fn available() -> bool {
        FEATURES.get(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("vpclmulqdq")
                && is_x86_feature_detected!("pclmulqdq")
                && is_x86_feature_detected!("sse4.2")
        })
    }

    /// Whether the CPU has every feature `update_256` enables (detected once).
    #[inline]
    pub(super) fn available_256() -> bool {
        FEATURES_256.get(|| {
            is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("vpclmulqdq")
                && is_x86_feature_detected!("pclmulqdq")
                && is_x86_feature_detected!("sse4.2")
        })
    }

    /// `k` repeated in each 128-bit lane of a 512-bit register.
    #[target_feature(enable = "avx512f")]
    fn wide(k: (i64, i64)) -> __m512i {
        _mm512_set_epi64(k.1, k.0, k.1, k.0, k.1, k.0, k.1, k.0)
    }

    /// The first 64 bytes of `bytes` (unaligned), also stored at `dst + at` when
    /// copying.
    ///
    /// # Safety
    /// With `COPY`, `dst + at .. + 64` must be writable.
    #[target_feature(enable = "avx512f")]
    unsafe fn load<const COPY: bool>(bytes: &[u8], dst: *mut u8, at: usize) -> __m512i {
        let chunk = &bytes[..64];
        // SAFETY: `chunk` holds 64 readable bytes; the load needs no alignment.
        let v = unsafe { _mm512_loadu_si512(chunk.as_ptr().cast()) };
        if COPY {
            // SAFETY: the caller's contract; the store needs no alignment.
            unsafe { _mm512_storeu_si512(dst.add(at).cast(), v) };
        }
        v
    }

    /// Moves each lane of `x` forward by the distance `k` was built for, onto `next`.
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    fn fold_wide(x: __m512i, k: __m512i, next: __m512i) -> __m512i {
        let first = _mm512_clmulepi64_epi128(x, k, 0x00);
        let last = _mm512_clmulepi64_epi128(x, k, 0x11);
        // 0x96: the three-way XOR.
        _mm512_ternarylogic_epi64(first, last, next, 0x96)
    }

    /// As `fold_wide`, for one 16-byte lane.
    #[target_feature(enable = "pclmulqdq,sse2")]
    fn fold_lane(x: __m128i, k: __m128i, next: __m128i) -> __m128i {
        let first = _mm_clmulepi64_si128(x, k, 0x00);
        let last = _mm_clmulepi64_si128(x, k, 0x11);
        _mm_xor_si128(_mm_xor_si128(first, last), next)
    }

    /// Advances the raw (un-inverted) CRC register over `data`, and with `COPY` also
    /// copies it to `dst`.
    ///
    /// # Safety
    /// The CPU must have what `available` checks, and `data.len() >= MIN_LEN`; with
    /// `COPY`, `dst` must be writable for `data.len()` bytes and must not overlap `data`.
    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    pub(super) unsafe fn update<const COPY: bool>(crc: u32, data: &[u8], dst: *mut u8) -> u32 {
        debug_assert!(data.len() >= MIN_LEN);
        let mut blocks = data.chunks_exact(256);
        let Some(first) = blocks.next() else {
            return crc; // unreachable by the contract; nothing to fold
        };
        // (Below, `at` is the offset of the loaded bytes in `data`, so a `load`'s
        // store lands inside the caller's writable `dst` range.)
        let seed = _mm512_castsi128_si512(_mm_cvtsi32_si128(crc as i32));
        // SAFETY: the first 256 bytes, at their offsets.
        let mut acc = unsafe {
            [
                _mm512_xor_si512(load::<COPY>(first, dst, 0), seed),
                load::<COPY>(&first[64..], dst, 64),
                load::<COPY>(&first[128..], dst, 128),
                load::<COPY>(&first[192..], dst, 192),
            ]
        };
        let k256 = wide(BY_256_BYTES);
        let mut at = 256;
        for block in &mut blocks {
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: 64 bytes at their offset `at + 64 i`.
                let next = unsafe { load::<COPY>(&block[64 * i..], dst, at + 64 * i) };
                *a = fold_wide(*a, k256, next);
            }
            at += 256;
        }
        let k64 = wide(BY_64_BYTES);
        let mut x = fold_wide(acc[0], k64, acc[1]);
        x = fold_wide(x, k64, acc[2]);
        x = fold_wide(x, k64, acc[3]);
        let rest = blocks.remainder();
        let mut sixty_fours = rest.chunks_exact(64);
        for chunk in &mut sixty_fours {
            // SAFETY: 64 bytes at their offset `at`.
            let next = unsafe { load::<COPY>(chunk, dst, at) };
            x = fold_wide(x, k64, next);
            at += 64;
        }
        let k16 = _mm_set_epi64x(BY_16_BYTES.1, BY_16_BYTES.0);
        let mut lane = _mm512_extracti32x4_epi32(x, 0);
        lane = fold_lane(lane, k16, _mm512_extracti32x4_epi32(x, 1));
        lane = fold_lane(lane, k16, _mm512_extracti32x4_epi32(x, 2));
        lane = fold_lane(lane, k16, _mm512_extracti32x4_epi32(x, 3));
        // SAFETY: `rest` is the last part of `data`, at `at` in the caller's `dst`.
        unsafe { finish::<COPY>(lane, sixty_fours.remainder(), dst.wrapping_add(at)) }
    }

    /// `k` repeated in each 128-bit lane of a 256-bit register.
    #[target_feature(enable = "avx2")]
    fn wide_256(k: (i64, i64)) -> __m256i {
        _mm256_set_epi64x(k.1, k.0, k.1, k.0)
    }

    /// The first 32 bytes of `bytes` (unaligned), also stored at `dst + at` when
    /// copying.
    ///
    /// # Safety
    /// With `COPY`, `dst + at .. + 32` must be writable.
    #[target_feature(enable = "avx2")]
    unsafe fn load_256<const COPY: bool>(bytes: &[u8], dst: *mut u8, at: usize) -> __m256i {
        let chunk = &bytes[..32];
        // SAFETY: `chunk` holds 32 readable bytes; the load needs no alignment.
        let v = unsafe { _mm256_loadu_si256(chunk.as_ptr().cast()) };
        if COPY {
            // SAFETY: the caller's contract; the store needs no alignment.
            unsafe { _mm256_storeu_si256(dst.add(at).cast(), v) };
        }
        v
    }

    /// As `fold_wide`, for the two lanes of a 256-bit register.
    #[target_feature(enable = "avx2,vpclmulqdq")]
    fn fold_256(x: __m256i, k: __m256i, next: __m256i) -> __m256i {
        let first = _mm256_clmulepi64_epi128(x, k, 0x00);
        let last = _mm256_clmulepi64_epi128(x, k, 0x11);
        _mm256_xor_si256(_mm256_xor_si256(first, last), next)
    }

    /// As `update`, with eight 32-byte accumulators on a CPU with `vpclmulqdq` and
    /// AVX2 but no AVX-512.
    ///
    /// # Safety
    /// The CPU must have what `available_256` checks, and `data.len() >= MIN_LEN`;
    /// with `COPY`, `dst` must be writable for `data.len()` bytes and must not
    /// overlap `data`.
    #[target_feature(enable = "avx2,vpclmulqdq,pclmulqdq,sse4.2")]
    pub(super) unsafe fn update_256<const COPY: bool>(crc: u32, data: &[u8], dst: *mut u8) -> u32 {
        debug_assert!(data.len() >= MIN_LEN);
        let mut blocks = data.chunks_exact(256);
        let Some(first) = blocks.next() else {
            return crc; // unreachable by the contract; nothing to fold
        };
        // (As in `update`, `at` is the offset of the loaded bytes in `data`.)
        // SAFETY: the first 256 bytes, at their offsets.
        let mut acc: [__m256i; 8] =
            std::array::from_fn(|i| unsafe { load_256::<COPY>(&first[32 * i..], dst, 32 * i) });
        acc[0] = _mm256_xor_si256(
            acc[0],
            _mm256_zextsi128_si256(_mm_cvtsi32_si128(crc as i32)),
        );
        let k256 = wide_256(BY_256_BYTES);
        let mut at = 256;
        for block in &mut blocks {
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: 32 bytes at their offset `at + 32 i`.
                let next = unsafe { load_256::<COPY>(&block[32 * i..], dst, at + 32 * i) };
                *a = fold_256(*a, k256, next);
            }
            at += 256;
        }
        let k32 = wide_256(BY_32_BYTES);
        let mut x = acc[0];
        for a in &acc[1..] {
            x = fold_256(x, k32, *a);
        }
        let rest = blocks.remainder();
        let mut thirty_twos = rest.chunks_exact(32);
        for chunk in &mut thirty_twos {
            // SAFETY: 32 bytes at their offset `at`.
            let next = unsafe { load_256::<COPY>(chunk, dst, at) };
            x = fold_256(x, k32, next);
            at += 32;
        }
        let k16 = _mm_set_epi64x(BY_16_BYTES.1, BY_16_BYTES.0);
        let lane = fold_lane(
            _mm256_castsi256_si128(x),
            k16,
            _mm256_extracti128_si256(x, 1),
        );
        // SAFETY: `rest`'s last part is the end of `data`, at `at` in the caller's `dst`.
        unsafe { finish::<COPY>(lane, thirty_twos.remainder(), dst.wrapping_add(at)) }
    }

    /// Folds the last (< 64, or < 32) bytes `rest` onto the 16-byte remainder `lane` (copying
    /// them to `dst` with `COPY`) and reduces it to the raw CRC register.
    ///
    /// # Safety
    /// With `COPY`, `dst` must be writable for `rest.len()` bytes, apart from them.
    #[target_feature(enable = "pclmulqdq,sse4.2")]
    unsafe fn finish<const COPY: bool>(mut lane: __m128i, rest: &[u8], dst: *mut u8) -> u32 {
        // SAFETY: the caller's contract.
        unsafe { super::copy_bytes::<COPY>(rest, dst) };
        let k16 = _mm_set_epi64x(BY_16_BYTES.1, BY_16_BYTES.0);
        let mut sixteens = rest.chunks_exact(16);
        for chunk in &mut sixteens {
            // SAFETY: the chunk is 16 bytes; the load is unaligned.
            let next = unsafe { _mm_loadu_si128(chunk.as_ptr().cast()) };
            lane = fold_lane(lane, k16, next);
        }
        let mut wide_crc = _mm_crc32_u64(0, _mm_cvtsi128_si64(lane) as u64);
        wide_crc = _mm_crc32_u64(wide_crc, _mm_extract_epi64(lane, 1) as u64);
        let mut crc = wide_crc as u32;
        for &byte in sixteens.remainder() {
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

    /// Every length across the folding path's boundaries (one 256-byte block, then
    /// 64- and 16-byte steps and a byte tail), at several alignments and starting
    /// registers, against the portable implementation.
    #[test]
    fn wide_buffers_match_the_portable_path() {
        let data = pseudo_random(4096 + 64, 0xf01d);
        for len in (250..1300).chain([4095, 4096]) {
            for offset in [0usize, 1, 13, 64] {
                let slice = &data[offset..offset + len];
                for start in [0u32, 1, 0xdead_beef] {
                    assert_eq!(
                        crc32c_append(start, slice),
                        crc32c_software_append(start, slice),
                        "len {len} offset {offset} start {start:#x}"
                    );
                }
            }
        }
    }

    /// The copying form stores exactly the source and checksums it as `crc32c_append`
    /// does, across every path's boundaries and alignments of either side.
    #[test]
    fn copying_matches_append_and_copies_exactly() {
        let data = pseudo_random(3 * 8192 * 2 + 3 * 256 + 300, 0xc0b1);
        let lens = (0..300).chain(740..800).chain(1000..1100).chain([
            3 * 8192 - 1,
            3 * 8192,
            3 * 8192 + 9,
            data.len() - 64,
        ]);
        for len in lens {
            for (from, to) in [(0usize, 0usize), (1, 0), (3, 5), (64, 7)] {
                let src = &data[from..from + len];
                let mut out = vec![0x5au8; len + to + 8];
                for start in [0u32, 0xdead_beef] {
                    // SAFETY: `out` holds `to + len` bytes and is not `data`.
                    let crc =
                        unsafe { crc32c_append_copying(start, src, out.as_mut_ptr().add(to)) };
                    assert_eq!(crc, crc32c_append(start, src), "len {len} at {from}/{to}");
                    assert_eq!(&out[to..to + len], src, "len {len} at {from}/{to}");
                    assert!(
                        out[..to].iter().all(|&b| b == 0x5a),
                        "wrote before, len {len}"
                    );
                    assert!(
                        out[to + len..].iter().all(|&b| b == 0x5a),
                        "wrote past, len {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn combine_joins_pieces_in_order() {
        let data = pseudo_random(70_000, 3);
        let whole = crc32c(&data);
        for split in [0, 1, 255, 4096, 65_536, 70_000] {
            let (a, b) = data.split_at(split);
            assert_eq!(crc32c_combine(crc32c(a), crc32c(b), b.len() as u64), whole);
        }
        let (a, rest) = data.split_at(1000);
        let (b, c) = rest.split_at(30_000);
        let ab = crc32c_combine(crc32c(a), crc32c(b), b.len() as u64);
        assert_eq!(crc32c_combine(ab, crc32c(c), c.len() as u64), whole);
    }

    /// Each implementation this CPU can run, called directly (the public functions
    /// pick one), checksumming and copying, against the portable path: every length
    /// across the folds' 256-, 32- and 16-byte steps, and copies that stay within
    /// their destination.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn every_path_this_cpu_runs_agrees() {
        type Path = unsafe fn(u32, &[u8], *mut u8) -> u32;
        let mut paths: Vec<(&str, Path, Path)> = Vec::new();
        if hw::available() {
            paths.push(("sse4.2", hw::update::<false>, hw::update::<true>));
        }
        #[cfg(mc_avx512_intrinsics)]
        {
            if fold::available() {
                paths.push(("avx512", fold::update::<false>, fold::update::<true>));
            }
            if fold::available_256() {
                paths.push(("avx2", fold::update_256::<false>, fold::update_256::<true>));
            }
        }
        let data = pseudo_random(3 * 8192 * 2 + 3 * 256 + 300, 0xa11);
        let lens = (256usize..=800).chain([3 * 8192 + 5, data.len() - 3]);
        for len in lens {
            let src = &data[3..3 + len];
            let want = crc32c_software_append(7, src);
            for &(name, sum, copy) in &paths {
                let mut out = vec![0x5au8; len + 16];
                // SAFETY: each path runs only where `available` said so, on at least
                // MIN_LEN bytes; `out` holds `8 + len` bytes, apart from `src`.
                unsafe {
                    assert_eq!(!sum(!7, src, std::ptr::null_mut()), want, "{name} {len}");
                    assert_eq!(
                        !copy(!7, src, out.as_mut_ptr().add(8)),
                        want,
                        "{name} {len}"
                    );
                }
                assert_eq!(&out[8..8 + len], src, "{name} {len}");
                assert!(out[..8].iter().chain(&out[8 + len..]).all(|&b| b == 0x5a));
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
