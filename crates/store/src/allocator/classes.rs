//! Size classes: a geometric series, so internal fragmentation is a bounded
//! fraction of the request rather than a fixed number of bytes.
//!
//! `per_doubling` sizes per power of two from `min_class` up to `slab_size`, each
//! rounded up to [`ALIGN`]. Sizes that would fit the same number of blocks into a
//! slab are then merged into the largest such size: a slab holds as many blocks
//! either way, so the smaller sizes would only hide the slab's tail as "unused"
//! while adding classes (and so partially filled slabs).

/// Every block size is a multiple of this (a cache line, and RDMA friendly).
pub(crate) const ALIGN: u64 = 64;

/// Sub-ranges per power of two in the lookup table (fine enough that a lookup
/// is one table read plus rarely one step).
const SUB_BITS: u32 = 6;
const FIRST_POW: u32 = 6; // 2^6 = ALIGN, the smallest possible class

pub(crate) struct SizeClasses {
    sizes: Box<[u64]>,
    /// For each power-of-two sub-range of sizes, the class of its smallest size.
    lookup: Box<[u16]>,
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

/// The class sizes for a normalized configuration (`min_class` and `slab_size`
/// multiples of [`ALIGN`], `min_class <= slab_size`, `per_doubling >= 1`).
fn build(min_class: u64, slab_size: u64, per_doubling: u32) -> Vec<u64> {
    let mut raw = Vec::new();
    let mut base = min_class;
    'grow: while base < slab_size {
        for j in 0..u64::from(per_doubling) {
            let step = (u128::from(base) * u128::from(j) / u128::from(per_doubling)) as u64;
            let size = round_up(base + step, ALIGN);
            if size >= slab_size {
                break 'grow;
            }
            raw.push(size);
        }
        base = base.saturating_mul(2);
    }
    raw.push(slab_size);
    let mut out: Vec<u64> = Vec::with_capacity(raw.len());
    for size in raw {
        let per_slab = slab_size / size;
        let widened = slab_size / per_slab / ALIGN * ALIGN;
        if out.last().is_none_or(|&last| last < widened) {
            out.push(widened);
        }
    }
    out
}

impl SizeClasses {
    pub(crate) fn new(min_class: u64, slab_size: u64, per_doubling: u32) -> SizeClasses {
        let sizes = build(min_class, slab_size, per_doubling);
        assert!(
            sizes.len() <= usize::from(u16::MAX),
            "too many size classes"
        );
        let top_pow = 63 - (slab_size - 1).max(ALIGN).leading_zeros();
        let rows = (top_pow - FIRST_POW + 1) as usize;
        let lookup = (0..rows << SUB_BITS)
            .map(|i| {
                let pow = FIRST_POW + (i >> SUB_BITS) as u32;
                let sub = (i & ((1 << SUB_BITS) - 1)) as u64;
                // Smallest `size - 1` in this sub-range.
                let x = ((1u64 << SUB_BITS) + sub) << (pow - SUB_BITS);
                sizes.partition_point(|&s| s < x.saturating_add(1)) as u16
            })
            .collect();
        SizeClasses {
            sizes: sizes.into_boxed_slice(),
            lookup,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.sizes.len()
    }

    pub(crate) fn sizes(&self) -> &[u64] {
        &self.sizes
    }

    pub(crate) fn size(&self, class: usize) -> u64 {
        self.sizes[class]
    }

    pub(crate) fn max(&self) -> u64 {
        self.sizes[self.sizes.len() - 1]
    }

    /// The smallest class holding `size` bytes; `None` for 0 or above the largest.
    #[inline]
    pub(crate) fn class_of(&self, size: u64) -> Option<usize> {
        if size == 0 || size > self.max() {
            return None;
        }
        if size <= self.sizes[0] {
            return Some(0);
        }
        let x = size - 1; // >= 64, so pow >= FIRST_POW
        let pow = 63 - x.leading_zeros();
        let sub = (x >> (pow - SUB_BITS)) as usize & ((1 << SUB_BITS) - 1);
        let row = (pow - FIRST_POW) as usize;
        let mut class = usize::from(self.lookup[(row << SUB_BITS) | sub]);
        while self.sizes[class] < size {
            class += 1;
        }
        Some(class)
    }

    /// Worst internal waste (`block / request - 1`) over requests in `from..=to`:
    /// a request one byte above a class lands in the next one.
    #[cfg(test)]
    pub(crate) fn worst_waste(&self, from: u64, to: u64) -> f64 {
        let mut worst: f64 = 0.0;
        let mut lower = 0; // largest request that fits the previous class
        for &size in self.sizes.iter() {
            let smallest = (lower + 1).max(from);
            if smallest <= size && smallest <= to {
                worst = worst.max(size as f64 / smallest as f64 - 1.0);
            }
            lower = size;
        }
        worst
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn slow_class_of(c: &SizeClasses, size: u64) -> Option<usize> {
        (size != 0).then_some(())?;
        c.sizes().iter().position(|&s| s >= size)
    }

    #[test]
    fn default_classes_are_aligned_increasing_and_end_at_the_slab() {
        let c = SizeClasses::new(256, 4 * MIB, 16);
        assert_eq!(c.sizes()[0], 256);
        assert_eq!(c.max(), 4 * MIB);
        assert!(c.sizes().windows(2).all(|w| w[0] < w[1]));
        assert!(c.sizes().iter().all(|s| s % ALIGN == 0));
        // Power-of-two sizes stay classes (common KV block sizes waste nothing).
        for p in 8..=22 {
            assert!(c.sizes().contains(&(1u64 << p)), "2^{p} missing");
        }
    }

    #[test]
    fn lookup_matches_a_linear_scan() {
        for (min, slab, per) in [
            (256, 4 * MIB, 16),
            (64, MIB, 4),
            (320, 3 * MIB, 7),
            (64, 64, 1),
        ] {
            let c = SizeClasses::new(min, slab, per);
            let mut x: u64 = 0x2545_F491_4F6C_DD1D;
            let probe =
                |size: u64| assert_eq!(c.class_of(size), slow_class_of(&c, size), "size {size}");
            for size in 0..4096 {
                probe(size);
            }
            for &s in c.sizes() {
                probe(s - 1);
                probe(s);
                probe(s + 1);
            }
            for _ in 0..20_000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                probe(x % (slab + 2));
            }
        }
    }

    #[test]
    fn waste_is_bounded_by_one_step_of_the_series() {
        let c = SizeClasses::new(256, 4 * MIB, 16);
        // 64-byte rounding dominates small sizes: 257 bytes take a 320-byte block.
        let small = c.worst_waste(257, 1024);
        assert!((small - (320.0 / 257.0 - 1.0)).abs() < 1e-9, "{small}");
        // From 1 KiB the geometric step rules (a little over 1/16 where merging
        // by blocks-per-slab skips a count, more so as fewer blocks fit a slab).
        assert!(c.worst_waste(1024, 64 * 1024) < 0.067);
        assert!(c.worst_waste(64 * 1024, 128 * 1024) < 0.072);
        assert!(c.worst_waste(128 * 1024, 256 * 1024) < 0.077);
        // Near the top few blocks fit a slab: just over half a slab takes all of it.
        let top = c.worst_waste(4 * MIB / 16, 4 * MIB);
        assert!(top < 1.0 && top > 0.9, "{top}");
    }
}
