//! A copy whose destination is not read again soon (a backup kept in case an operation
//! fails): written with non-temporal stores, so it neither reads the destination's
//! lines first nor evicts the data the operation is working on from the caches.

/// Copies `src` into `dst` (equal lengths) bypassing the caches where the CPU allows.
pub fn copy_bypassing_cache(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_bypassing_cache: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Small copies gain nothing from streaming.
        if dst.len() >= 4096 {
            let head = dst.as_ptr().align_offset(16).min(dst.len());
            dst[..head].copy_from_slice(&src[..head]);
            let body = (dst.len() - head) / 16 * 16;
            let mut i = head;
            while i < head + body {
                // SAFETY: x86_64 always has SSE2; `dst + i` is 16-byte aligned (`head`
                // aligns it, `i` advances by 16) and `i + 16 <= dst.len() == src.len()`,
                // so both accesses stay inside the slices.
                unsafe {
                    let v = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
                    _mm_stream_si128(dst.as_mut_ptr().add(i).cast::<__m128i>(), v);
                }
                i += 16;
            }
            // SAFETY: SSE2 is always present on x86_64; orders the streaming stores
            // before anything written after this copy.
            unsafe { _mm_sfence() };
            dst[i..].copy_from_slice(&src[i..]);
            return;
        }
    }
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::copy_bypassing_cache;

    #[test]
    fn copies_every_byte_at_any_alignment_and_length() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + 3) as u8).collect();
        for (off, len) in [(0, 0), (1, 15), (3, 4096), (5, 10_001), (16, 19_000)] {
            let mut dst = vec![0u8; 20_016];
            copy_bypassing_cache(&mut dst[off..off + len], &src[..len]);
            assert_eq!(&dst[off..off + len], &src[..len], "off {off} len {len}");
            assert!(
                dst[..off].iter().all(|b| *b == 0),
                "wrote before: off {off}"
            );
            assert!(
                dst[off + len..].iter().all(|b| *b == 0),
                "wrote past: off {off}"
            );
        }
    }
}
