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

#[inline(always)]
fn cast_bits(src: &[f32], dst: &mut [u16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = round_bits(s.to_bits());
    }
}

/// The same loop compiled for AVX2 (8 lanes and a native 32 → 16-bit pack).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn cast_bits_avx2(src: &[f32], dst: &mut [u16]) {
    cast_bits(src, dst)
}

/// Writes `src` rounded to bf16 into `dst` (same length; extra elements of the longer are left).
pub fn cast_f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    let dst: &mut [u16] = dst.reinterpret_cast_mut();
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), the only requirement of calling a
        // function compiled with `target_feature(enable = "avx2")`.
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
