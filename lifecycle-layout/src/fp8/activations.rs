//! W8A8 block fp8, as vLLM's `W8A8BlockFp8LinearOp` and DeepSeek-V3 run it: the activations are
//! quantised on the fly per token in groups of 128 columns (one fp32 scale per group, the same
//! formula as the weights' 128 × 128 blocks), and a product sums, per group, the e4m3 products
//! times both scales. [`Fp8Compute`] chooses it over the weight-only mode (e4m3 weights against
//! the activations as they are).

use super::{block_scale_inv, e4m3_from_f32, FP8_BLOCK};

/// How a decoder computes with fp8 weights.
///
/// ```
/// use lifecycle_layout::fp8::Fp8Compute;
/// assert_eq!(Fp8Compute::default(), Fp8Compute::W8A8);
/// assert_eq!("w8a8".parse::<Fp8Compute>(), Ok(Fp8Compute::W8A8));
/// assert_eq!(Fp8Compute::W8A8.to_string(), "w8a8");
/// assert!("int8".parse::<Fp8Compute>().unwrap_err().contains("weight-only"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Compute {
    /// e4m3 weights times the activations in f32: exact against the dequantised weights (the
    /// exact mode, by name; the per-call decoders' default).
    WeightOnly,
    /// Activations quantised per token in 1 × 128 groups ([`quantize_activation_groups`]), then
    /// block-scaled e4m3 × e4m3 products accumulated in f32: the fast mode, as vLLM and verl run
    /// block fp8 (the rollout engines' default).
    #[default]
    W8A8,
}

impl Fp8Compute {
    /// The setting's name on command lines: `weight-only` or `w8a8`.
    pub fn name(self) -> &'static str {
        match self {
            Fp8Compute::WeightOnly => "weight-only",
            Fp8Compute::W8A8 => "w8a8",
        }
    }
}

impl std::fmt::Display for Fp8Compute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Fp8Compute {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "weight-only" | "weight_only" => Ok(Fp8Compute::WeightOnly),
            "w8a8" => Ok(Fp8Compute::W8A8),
            other => Err(format!(
                "fp8 compute mode `{other}`: expected weight-only or w8a8"
            )),
        }
    }
}

/// Activations quantised per token in groups of [`FP8_BLOCK`] columns: `rows × cols` e4m3 bytes
/// (row-major) and one `scale_inv` per row and group (`rows × ⌈cols / 128⌉`, row-major).
#[derive(Debug, Clone, PartialEq)]
pub struct GroupQuantized {
    /// Columns of a row.
    pub cols: usize,
    /// The e4m3 bytes.
    pub data: Vec<u8>,
    /// One scale per row and group: `value ≈ e4m3(byte) × scale_inv`.
    pub scale_inv: Vec<f32>,
}

impl GroupQuantized {
    /// Groups per row.
    pub fn groups(&self) -> usize {
        self.cols.div_ceil(FP8_BLOCK)
    }
}

/// Quantises the rows of `x` (`cols` values each) per token in groups of 128 columns (the last
/// group of a row may be narrower): a group's `scale_inv` is [`block_scale_inv`] of its largest
/// magnitude, and each value the e4m3 byte of `value / scale_inv` (round to nearest even), the
/// formula of the weights' blocks and of vLLM's `per_token_group_quant_fp8` (whose `eps` clamp
/// gives the same bytes and products for an all-zero group). A non-finite value makes its
/// group's scale and bytes NaN, so the products it reaches are NaN.
///
/// ```
/// use lifecycle_layout::fp8::{e4m3_to_f32, quantize_activation_groups};
/// let mut x = vec![0.0f32; 2 * 130];
/// x[0] = 448.0 * 2.0; // row 0, group 0: scale 2
/// x[128] = -3.0; // row 0, group 1 (two columns): scale 3 / 448
/// let q = quantize_activation_groups(&x, 130);
/// assert_eq!(q.groups(), 2);
/// assert_eq!(q.scale_inv, vec![2.0, 3.0 / 448.0, 1.0, 1.0]);
/// assert_eq!(e4m3_to_f32(q.data[0]) * q.scale_inv[0], 896.0);
/// assert_eq!(e4m3_to_f32(q.data[128]), -448.0);
/// ```
pub fn quantize_activation_groups(x: &[f32], cols: usize) -> GroupQuantized {
    let cols = cols.max(1);
    let groups = cols.div_ceil(FP8_BLOCK);
    let rows = x.len() / cols;
    let mut data = vec![0u8; rows * cols];
    let mut scale_inv = vec![1.0f32; rows * groups];
    for (r, (row, out)) in x
        .chunks_exact(cols)
        .zip(data.chunks_exact_mut(cols))
        .enumerate()
    {
        for (g, (vs, bs)) in row
            .chunks(FP8_BLOCK)
            .zip(out.chunks_mut(FP8_BLOCK))
            .enumerate()
        {
            // NaN once a non-finite value is seen (f32::max would drop it)
            let amax = vs.iter().fold(0.0f32, |m, v| {
                if m.is_nan() || !v.is_finite() {
                    f32::NAN
                } else {
                    m.max(v.abs())
                }
            });
            let s = if amax.is_nan() {
                f32::NAN
            } else {
                block_scale_inv(amax)
            };
            scale_inv[r * groups + g] = s;
            for (b, v) in bs.iter_mut().zip(vs) {
                *b = e4m3_from_f32(v / s);
            }
        }
    }
    GroupQuantized {
        cols,
        data,
        scale_inv,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::e4m3_to_f32;

    #[test]
    fn every_value_comes_back_within_half_a_step_of_its_group_scale() {
        let cols = 300;
        let x: Vec<f32> = (0..3 * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37 * (1 + i / 128) as f32)
            .collect();
        let q = quantize_activation_groups(&x, cols);
        assert_eq!(
            (q.data.len(), q.scale_inv.len(), q.groups()),
            (3 * cols, 9, 3)
        );
        for (i, v) in x.iter().enumerate() {
            let (r, c) = (i / cols, i % cols);
            let s = q.scale_inv[r * 3 + c / FP8_BLOCK];
            let back = e4m3_to_f32(q.data[i]) * s;
            // e4m3 keeps 3 mantissa bits: within 1/16 relative, or a subnormal step
            assert!(
                (back - v).abs() <= v.abs() / 16.0 * 1.0001 + s * 2f32.powi(-10),
                "{i}: {v} -> {back}"
            );
        }
        // the largest magnitude of each group lands on ±448
        for r in 0..3 {
            for g in 0..3 {
                let range = r * cols + g * FP8_BLOCK..r * cols + ((g + 1) * FP8_BLOCK).min(cols);
                let top = range
                    .clone()
                    .max_by(|&a, &b| x[a].abs().total_cmp(&x[b].abs()))
                    .unwrap();
                assert_eq!(e4m3_to_f32(q.data[top]).abs(), 448.0, "row {r} group {g}");
            }
        }
    }

    #[test]
    fn a_non_finite_value_poisons_its_group_only() {
        let mut x = vec![1.0f32; 256];
        x[3] = f32::INFINITY;
        let q = quantize_activation_groups(&x, 256);
        assert!(q.scale_inv[0].is_nan());
        assert!(e4m3_to_f32(q.data[0]).is_nan());
        assert_eq!(q.scale_inv[1], 1.0 / 448.0);
        assert_eq!(e4m3_to_f32(q.data[200]), 448.0);
    }
}
