//! fp32 → bf16 conversion, rounding to nearest even (as PyTorch and `half::bf16::from_f32` do).
//!
//! `half`'s slice conversion goes element by element through a branchy scalar routine; this loop
//! computes the same bits without branches so the compiler vectorises it, which is what keeps the
//! host reshard close to memory bandwidth. Bit equality with `half` is tested below on every
//! class of input (normals, subnormals, ties, overflow to infinity, infinities, NaNs).

use half::bf16;
use half::slice::HalfFloatSliceExt;

/// Rounds the f32 with bits `x` to the nearest bf16, ties to even; NaNs stay NaN (quietened).
#[inline(always)]
fn round_bits(x: u32) -> u16 {
    let is_nan = (x & 0x7fff_ffff) > 0x7f80_0000;
    let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((x >> 16) as u16) | 0x0040;
    if is_nan {
        quiet_nan
    } else {
        rounded
    }
}

fn cast_bits(src: &[f32], dst: &mut [u16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = round_bits(s.to_bits());
    }
}

/// AVX2 version: 16 values per step, rounded with the same integer arithmetic, packed to 16 bits
/// and written with non-temporal stores, which skip reading the destination into the cache first
/// (the rollout slices are written once and not read back soon), as large `memcpy`s do.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn cast_bits_avx2(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let mut i = 0;
    // Scalar until the destination is 32-byte aligned (streaming stores need it).
    while i < n && !(dst.as_ptr() as usize + 2 * i).is_multiple_of(32) {
        dst[i] = round_bits(src[i].to_bits());
        i += 1;
    }
    let bias = _mm256_set1_epi32(0x7fff);
    let one = _mm256_set1_epi32(1);
    let abs_mask = _mm256_set1_epi32(0x7fff_ffff);
    let inf = _mm256_set1_epi32(0x7f80_0000);
    let quiet = _mm256_set1_epi32(0x40);
    let round8 = |x: __m256i| {
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), one);
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(x, _mm256_add_epi32(bias, lsb)));
        let nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), inf);
        let qnan = _mm256_or_si256(_mm256_srli_epi32::<16>(x), quiet);
        _mm256_blendv_epi8(rounded, qnan, nan)
    };
    while i + 16 <= n {
        // SAFETY: i + 16 <= n <= src.len(), dst.len(): the loads read src[i..i + 16] and the
        // store writes dst[i..i + 16], 32-byte aligned by the loop above (i advances by 16
        // elements = 32 bytes); unaligned loads are allowed for the source.
        unsafe {
            let a = _mm256_loadu_si256(src.as_ptr().add(i).cast());
            let b = _mm256_loadu_si256(src.as_ptr().add(i + 8).cast());
            // Results are in 0..=0xffff, so the signed-to-unsigned saturating pack is exact; it
            // interleaves 128-bit halves, which the permute puts back in order.
            let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(
                round8(a),
                round8(b),
            ));
            _mm256_stream_si256(dst.as_mut_ptr().add(i).cast(), packed);
        }
        i += 16;
    }
    while i < n {
        dst[i] = round_bits(src[i].to_bits());
        i += 1;
    }
    // Streaming stores are weakly ordered: fence so later readers (other threads) see them.
    _mm_sfence();
}

/// Writes `src` rounded to bf16 into `dst` (same length; extra elements of the longer are left).
pub fn cast_f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    let dst: &mut [u16] = dst.reinterpret_cast_mut();
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the only requirement of
        // `cast_bits_avx2`.
        unsafe { cast_bits_avx2(src, dst) };
        return;
    }
    cast_bits(src, dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(x: f32) {
        let mut out = [bf16::ZERO];
        cast_f32_to_bf16(&[x], &mut out);
        assert_eq!(
            out[0].to_bits(),
            bf16::from_f32(x).to_bits(),
            "{x:e} (bits {:#010x})",
            x.to_bits()
        );
    }

    #[test]
    fn long_slices_at_every_alignment_match_half() {
        let mut values: Vec<f32> = Vec::new();
        for hi in (0..=u32::MAX >> 16).step_by(13) {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                values.push(f32::from_bits((hi << 16) | lo));
            }
        }
        values.extend([
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::from_bits(0x7f80_0001),
        ]);
        for offset in 0..17 {
            let src = &values[offset..];
            let mut dst = vec![bf16::ZERO; src.len() + 1];
            cast_f32_to_bf16(src, &mut dst[1..]);
            for (i, (x, y)) in src.iter().zip(&dst[1..]).enumerate() {
                assert_eq!(
                    y.to_bits(),
                    bf16::from_f32(*x).to_bits(),
                    "offset {offset}, index {i}, bits {:#010x}",
                    x.to_bits()
                );
            }
            assert_eq!(dst[0].to_bits(), 0, "nothing written before the slice");
        }
    }

    #[test]
    fn matches_half_on_every_class_of_input() {
        let specials = [
            0.0,
            -0.0,
            1.0,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // signalling NaN
            f32::from_bits(0x0000_0001), // smallest subnormal
            f32::from_bits(0x3f80_8000), // tie, even below: rounds down
            f32::from_bits(0x3f81_8000), // tie, odd below: rounds up
            f32::from_bits(0x7f7f_ffff), // rounds to infinity
        ];
        specials.into_iter().for_each(check);
        // every 2^16-th bit pattern plus its neighbourhood of the rounding boundary
        for hi in (0..=u32::MAX >> 16).step_by(7) {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                check(f32::from_bits((hi << 16) | lo));
            }
        }
    }
}
