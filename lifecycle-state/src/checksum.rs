//! A fast non-cryptographic checksum for verification mode: four independent multiply-rotate
//! lanes over the words of a buffer (so the loop vectorises), folded with the length. It detects
//! bit flips and overwritten ranges; it is not a defence against deliberate tampering.

use half::bf16;
use half::slice::HalfFloatSliceExt;

const PRIME1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME2: u64 = 0xC2B2_AE3D_27D4_EB4F;

fn lanes<T: Copy>(words: &[T], bits: impl Fn(T) -> u64) -> u64 {
    let mut acc = [PRIME1, PRIME2, PRIME1 ^ PRIME2, !PRIME1];
    let chunks = words.chunks_exact(4);
    let tail = chunks.remainder();
    for c in chunks {
        for i in 0..4 {
            acc[i] = (acc[i] ^ bits(c[i])).wrapping_mul(PRIME1).rotate_left(29);
        }
    }
    let mut h = (words.len() as u64).wrapping_mul(PRIME2);
    for (i, a) in acc.iter().enumerate() {
        h = (h ^ a.rotate_left(7 * i as u32)).wrapping_mul(PRIME2);
    }
    for &w in tail {
        h = (h ^ bits(w)).wrapping_mul(PRIME1).rotate_left(31);
    }
    h ^ (h >> 29)
}

/// Checksum of f32 values (by their bits).
pub fn checksum_f32(values: &[f32]) -> u64 {
    lanes(values, |v| u64::from(v.to_bits()))
}

/// Checksum of bf16 values (by their bits).
pub fn checksum_bf16(values: &[bf16]) -> u64 {
    let words: &[u16] = values.reinterpret_cast();
    lanes(words, u64::from)
}

/// Checksum of one rollout slice as held: its bf16 bits, or its fp8 bytes and block scales.
pub fn checksum_tensor(t: &lifecycle_layout::RolloutTensor) -> u64 {
    match &t.fp8 {
        Some(q) => lanes(q.data(), u64::from) ^ checksum_f32(q.scale_inv()).rotate_left(17),
        None => checksum_bf16(&t.data),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_single_bit_flip_changes_the_sum() {
        let v: Vec<f32> = (0..37).map(|i| i as f32 * 0.37 - 3.0).collect();
        let base = checksum_f32(&v);
        for i in 0..v.len() {
            for bit in [0, 7, 22, 31] {
                let mut w = v.clone();
                w[i] = f32::from_bits(w[i].to_bits() ^ (1 << bit));
                assert_ne!(checksum_f32(&w), base, "element {i} bit {bit}");
            }
        }
        let b: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut c = b.clone();
        c[5] = bf16::from_bits(c[5].to_bits() ^ 1);
        assert_ne!(checksum_bf16(&b), checksum_bf16(&c));
        assert_ne!(checksum_f32(&v[..36]), checksum_f32(&v), "length counts");
    }
}
