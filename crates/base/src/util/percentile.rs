//! The one percentile rule every report uses (the `mooncake replay` summary and the
//! benchmarks; `bench/*.py` copy it): nearest rank.

/// The nearest-rank `p` quantile (`0.0..=1.0`) of samples sorted ascending: the
/// sample at 1-based rank `⌈p·n⌉`, clamped to `1..=n`, i.e. the smallest sample with
/// at least a share `p` of all samples at or below it. Always one of the samples,
/// never an interpolation; `T::default()` (0) when there are none.
///
/// `p·n` is computed in floating point, so a product a rounding step above an
/// integer (`0.07 × 100 = 7.000000000000001`) is taken as that integer.
pub fn percentile<T: Copy + PartialOrd + Default>(sorted: &[T], p: f64) -> T {
    debug_assert!((0.0..=1.0).contains(&p), "quantile {p} outside 0..=1");
    debug_assert!(
        sorted.windows(2).all(|w| w[0] <= w[1]),
        "percentile of unsorted samples"
    );
    let n = sorted.len();
    if n == 0 {
        return T::default();
    }
    let rank = (p * n as f64 - 1e-9).ceil();
    let rank = if rank.is_nan() {
        1
    } else {
        (rank as usize).clamp(1, n)
    };
    sorted[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank_of_one_to_a_hundred() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.5), 50);
        assert_eq!(percentile(&v, 0.99), 99);
        assert_eq!(
            percentile(&v, 0.07),
            7,
            "rounding noise must not push a rank up"
        );
        assert_eq!(percentile(&v, 0.0), 1);
        assert_eq!(percentile(&v, 1.0), 100);
    }

    #[test]
    fn small_and_empty_sets() {
        assert_eq!(percentile::<u64>(&[], 0.5), 0);
        assert_eq!(percentile(&[3.5], 0.99), 3.5);
        // Ten samples: p99 is the largest (rank ⌈9.9⌉ = 10), p50 the fifth, not an
        // interpolation between the fifth and sixth.
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.99), 10.0);
        assert_eq!(percentile(&v, 0.5), 5.0);
        assert_eq!(percentile(&v, 0.51), 6.0);
    }
}
