//! Element types and the reductions collectives apply to them.

#![forbid(unsafe_code)]

use crate::error::{Error, Result};

/// Element type of a collective's buffers (numbered as the C ABI's `mc_pg_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    /// IEEE 754 binary32.
    F32 = 0,
    /// IEEE 754 binary64.
    F64 = 1,
    /// IEEE 754 binary16.
    F16 = 2,
    /// bfloat16: the upper half of a binary32.
    BF16 = 3,
    /// Signed 32-bit integer.
    I32 = 4,
    /// Signed 64-bit integer.
    I64 = 5,
    /// Unsigned byte.
    U8 = 6,
}

impl DType {
    /// The type with C ABI number `v`.
    pub fn from_raw(v: i32) -> Result<DType> {
        Ok(match v {
            0 => DType::F32,
            1 => DType::F64,
            2 => DType::F16,
            3 => DType::BF16,
            4 => DType::I32,
            5 => DType::I64,
            6 => DType::U8,
            _ => return Err(Error::invalid(format!("unknown dtype {v} (0..=6)"))),
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }
}

/// How `all_reduce`, `reduce` and `reduce_scatter` combine contributions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum of all contributions.
    Sum = 0,
    /// Element-wise minimum.
    Min = 1,
    /// Element-wise maximum.
    Max = 2,
    /// Product of all contributions.
    Product = 3,
    /// Sum divided by the number of contributors (integer types: truncated).
    Avg = 4,
}

impl ReduceOp {
    /// The op with C ABI number `v`.
    pub fn from_raw(v: i32) -> Result<ReduceOp> {
        Ok(match v {
            0 => ReduceOp::Sum,
            1 => ReduceOp::Min,
            2 => ReduceOp::Max,
            3 => ReduceOp::Product,
            4 => ReduceOp::Avg,
            _ => return Err(Error::invalid(format!("unknown reduce op {v} (0..=4)"))),
        })
    }
}

/// binary16 bits to f32 (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let frac = (h & 0x3ff) as u32;
    let bits = match exp {
        0 if frac == 0 => sign,
        0 => {
            // Subnormal: value = frac * 2^-24, exactly representable in f32.
            let v = frac as f32 * f32::from_bits(0x3380_0000);
            return if sign != 0 { -v } else { v };
        }
        0x1f => sign | 0x7f80_0000 | (frac << 13),
        _ => sign | ((exp + 112) << 23) | (frac << 13),
    };
    f32::from_bits(bits)
}

/// f32 to binary16 bits, rounding to nearest even.
pub fn f32_to_f16(v: f32) -> u16 {
    let bits = v.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32;
    let frac = bits & 0x7f_ffff;
    if exp == 0xff {
        let nan = if frac != 0 { 0x200 } else { 0 };
        return sign | 0x7c00 | nan;
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        // Subnormal half: shift the full significand into place, rounding to even.
        let m = frac | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = m >> shift;
        let rem = m & ((1 << shift) - 1);
        let midpoint = 1 << (shift - 1);
        let round = rem > midpoint || (rem == midpoint && half & 1 == 1);
        return sign | (half + round as u32) as u16;
    }
    let half = ((e as u32) << 10) | (frac >> 13);
    let rem = frac & 0x1fff;
    let round = rem > 0x1000 || (rem == 0x1000 && half & 1 == 1);
    // A carry out of the fraction correctly bumps the exponent (up to infinity).
    sign | (half + round as u32) as u16
}

/// bfloat16 bits to f32 (exact).
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 to bfloat16 bits, rounding to nearest even.
pub fn f32_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

macro_rules! reduce_native {
    ($acc:expr, $src:expr, $t:ty, $op:expr) => {{
        const N: usize = std::mem::size_of::<$t>();
        for (a, s) in $acc.chunks_exact_mut(N).zip($src.chunks_exact(N)) {
            let x = <$t>::from_ne_bytes(a.try_into().unwrap_or([0; N]));
            let y = <$t>::from_ne_bytes(s.try_into().unwrap_or([0; N]));
            let r: $t = $op(x, y);
            a.copy_from_slice(&r.to_ne_bytes());
        }
    }};
}

macro_rules! reduce_half {
    ($acc:expr, $src:expr, $to:expr, $from:expr, $op:expr) => {{
        for (a, s) in $acc.chunks_exact_mut(2).zip($src.chunks_exact(2)) {
            let x = $to(u16::from_ne_bytes([a[0], a[1]]));
            let y = $to(u16::from_ne_bytes([s[0], s[1]]));
            let r: f32 = $op(x, y);
            a.copy_from_slice(&$from(r).to_ne_bytes());
        }
    }};
}

/// Combines `src` into `acc` element-wise (`Avg` accumulates a sum; see [`finish_avg`]).
/// Both hold whole elements of `dtype`; any trailing partial element is left alone.
pub fn reduce_into(acc: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    let n = acc.len().min(src.len());
    let (acc, src) = (&mut acc[..n], &src[..n]);
    macro_rules! float_op {
        ($t:ty) => {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => reduce_native!(acc, src, $t, |x: $t, y: $t| x + y),
                ReduceOp::Product => reduce_native!(acc, src, $t, |x: $t, y: $t| x * y),
                ReduceOp::Min => reduce_native!(acc, src, $t, |x: $t, y: $t| x.min(y)),
                ReduceOp::Max => reduce_native!(acc, src, $t, |x: $t, y: $t| x.max(y)),
            }
        };
    }
    macro_rules! int_op {
        ($t:ty) => {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => {
                    reduce_native!(acc, src, $t, |x: $t, y: $t| x.wrapping_add(y))
                }
                ReduceOp::Product => reduce_native!(acc, src, $t, |x: $t, y: $t| x.wrapping_mul(y)),
                ReduceOp::Min => reduce_native!(acc, src, $t, |x: $t, y: $t| x.min(y)),
                ReduceOp::Max => reduce_native!(acc, src, $t, |x: $t, y: $t| x.max(y)),
            }
        };
    }
    macro_rules! half_op {
        ($to:expr, $from:expr) => {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => {
                    reduce_half!(acc, src, $to, $from, |x: f32, y: f32| x + y)
                }
                ReduceOp::Product => reduce_half!(acc, src, $to, $from, |x: f32, y: f32| x * y),
                ReduceOp::Min => reduce_half!(acc, src, $to, $from, |x: f32, y: f32| x.min(y)),
                ReduceOp::Max => reduce_half!(acc, src, $to, $from, |x: f32, y: f32| x.max(y)),
            }
        };
    }
    match dtype {
        DType::F32 => float_op!(f32),
        DType::F64 => float_op!(f64),
        DType::I32 => int_op!(i32),
        DType::I64 => int_op!(i64),
        DType::U8 => int_op!(u8),
        DType::F16 => half_op!(f16_to_f32, f32_to_f16),
        DType::BF16 => half_op!(bf16_to_f32, f32_to_bf16),
    }
}

/// Divides a sum of `count` contributions by `count` (the last step of `Avg`).
pub fn finish_avg(acc: &mut [u8], dtype: DType, count: usize) {
    if count <= 1 {
        return;
    }
    macro_rules! div {
        ($t:ty, $n:expr) => {{
            const N: usize = std::mem::size_of::<$t>();
            for a in acc.chunks_exact_mut(N) {
                let x = <$t>::from_ne_bytes(a.try_into().unwrap_or([0; N]));
                a.copy_from_slice(&(x / $n).to_ne_bytes());
            }
        }};
    }
    match dtype {
        DType::F32 => div!(f32, count as f32),
        DType::F64 => div!(f64, count as f64),
        DType::I32 => div!(i32, count as i32),
        DType::I64 => div!(i64, count as i64),
        DType::U8 => div!(u8, count.min(255) as u8),
        DType::F16 | DType::BF16 => {
            type Convert = (fn(u16) -> f32, fn(f32) -> u16);
            let (to, from): Convert = if dtype == DType::F16 {
                (f16_to_f32, f32_to_f16)
            } else {
                (bf16_to_f32, f32_to_bf16)
            };
            for a in acc.chunks_exact_mut(2) {
                let x = to(u16::from_ne_bytes([a[0], a[1]]));
                a.copy_from_slice(&from(x / count as f32).to_ne_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_conversions_round_trip_and_round_to_even() {
        for h in 0u16..=u16::MAX {
            let f = f16_to_f32(h);
            if !f.is_nan() {
                assert_eq!(f32_to_f16(f), h, "{h:#x}");
            }
            let b = bf16_to_f32(h);
            if !b.is_nan() {
                assert_eq!(f32_to_bf16(b), h, "{h:#x}");
            }
        }
        // 1 + 2^-11 lies halfway between two halves: ties go to the even one (1.0).
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00);
        assert_eq!(f32_to_f16(65536.0), 0x7c00);
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
    }

    #[test]
    fn reductions_apply_per_element() {
        let mut acc: Vec<u8> = [3i32, -4, 7].iter().flat_map(|v| v.to_ne_bytes()).collect();
        let src: Vec<u8> = [1i32, 5, -2].iter().flat_map(|v| v.to_ne_bytes()).collect();
        reduce_into(&mut acc, &src, DType::I32, ReduceOp::Max);
        let got: Vec<i32> = acc
            .chunks_exact(4)
            .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, [3, 5, 7]);
        let mut acc = f32_to_f16(1.5).to_ne_bytes().to_vec();
        reduce_into(
            &mut acc,
            &f32_to_f16(2.0).to_ne_bytes(),
            DType::F16,
            ReduceOp::Product,
        );
        assert_eq!(f16_to_f32(u16::from_ne_bytes([acc[0], acc[1]])), 3.0);
        finish_avg(&mut acc, DType::F16, 2);
        assert_eq!(f16_to_f32(u16::from_ne_bytes([acc[0], acc[1]])), 1.5);
    }
}
