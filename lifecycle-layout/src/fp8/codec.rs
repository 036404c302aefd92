//! The e4m3 codec and the 128 × 128 block formula ([`quantize_blocks`]).

use crate::LayoutError;

/// Rows and columns of one scale block.
pub const FP8_BLOCK: usize = 128;

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// `x` as a `float8_e4m3fn` byte, rounded to nearest even; magnitudes above 464 (which round
/// past 448) and non-finite values give NaN (`0x7f` with the sign), as PyTorch's cast does. The
/// block formula never scales a value above 448.
///
/// ```
/// use lifecycle_layout::fp8::e4m3_from_f32;
/// assert_eq!(e4m3_from_f32(1.0), 0x38);
/// assert_eq!(e4m3_from_f32(448.0), 0x7e);
/// assert_eq!(e4m3_from_f32(-2f32.powi(-9)), 0x81); // the smallest subnormal
/// assert_eq!(e4m3_from_f32(500.0), 0x7f);
/// ```
pub fn e4m3_from_f32(x: f32) -> u8 {
    // 480: from here on (and for infinities and NaN) the result is NaN without rounding
    const NAN_FROM: u32 = 1087 << 20;
    // 2^-6, the smallest normal e4m3 value
    const NORMAL_FROM: u32 = 121 << 23;
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let mag = bits & 0x7fff_ffff;
    let byte = if mag >= NAN_FROM {
        0x7f
    } else if mag < NORMAL_FROM {
        // subnormal: adding 2^14, whose f32 ulp is 2^-9 (the e4m3 subnormal step), rounds the
        // value to nearest even in steps of 2^-9; the low bits of the sum are then the e4m3
        // byte (8 steps carrying into the smallest normal, 2^-6 = 0x08)
        let magic = f32::from_bits(141 << 23);
        let sum = (f32::from_bits(mag) + magic).to_bits();
        sum.wrapping_sub(141 << 23) as u8
    } else {
        let odd = (mag >> 20) & 1;
        let rebased = mag
            .wrapping_add(((7u32).wrapping_sub(127) << 23).wrapping_add(0x7ffff))
            .wrapping_add(odd);
        (rebased >> 20) as u8
    };
    byte | sign
}

/// The value of a `float8_e4m3fn` byte (`0x7f` / `0xff` are NaN; there are no infinities).
///
/// ```
/// use lifecycle_layout::fp8::e4m3_to_f32;
/// assert_eq!(e4m3_to_f32(0x38), 1.0);
/// assert_eq!(e4m3_to_f32(0xfe), -448.0);
/// assert!(e4m3_to_f32(0x7f).is_nan());
/// ```
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0x0f);
    let mant = f32::from(b & 0x07);
    if b & 0x7f == 0x7f {
        f32::NAN
    } else if exp == 0 {
        sign * mant * 2f32.powi(-9)
    } else {
        sign * (1.0 + mant / 8.0) * 2f32.powi(exp - 7)
    }
}

/// The `scale_inv` of a block whose largest magnitude is `amax`: `amax / 448`, or 1 for an
/// all-zero block (whose elements quantise to zero whatever the scale).
pub fn block_scale_inv(amax: f32) -> f32 {
    if amax > 0.0 {
        amax / E4M3_MAX
    } else {
        1.0
    }
}

/// A 2-D tensor in block-scaled e4m3: `rows × cols` bytes, row-major, and one `scale_inv` per
/// block (`⌈rows/128⌉ × ⌈cols/128⌉`, row-major). Built only by [`quantize_blocks`], so the sizes
/// always agree.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockQuantized {
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    scale_inv: Vec<f32>,
}

impl BlockQuantized {
    /// Rows of the 2-D view.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns of the 2-D view.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The e4m3 bytes, row-major.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// One `scale_inv` per block, row-major over the blocks.
    pub fn scale_inv(&self) -> &[f32] {
        &self.scale_inv
    }

    /// Blocks per row and per column: `(⌈rows/128⌉, ⌈cols/128⌉)`.
    pub fn blocks(&self) -> (usize, usize) {
        (self.rows.div_ceil(FP8_BLOCK), self.cols.div_ceil(FP8_BLOCK))
    }

    /// A block-scaled tensor from its parts: `data` (`rows × cols` e4m3 bytes, row-major) and
    /// one `scale_inv` per 128 × 128 block (row-major over the blocks). A rank's slice of a
    /// quantised tensor is one of these when the slice starts on block boundaries, which the
    /// fp8 plan checks ([`fp8_rank_traffic`](super::fp8_rank_traffic)). Sizes that disagree are
    /// [`LayoutError::ValueCount`], naming `name`; so is a `scale_inv` that is not finite and
    /// positive.
    ///
    /// ```
    /// use lifecycle_layout::fp8::BlockQuantized;
    /// let q = BlockQuantized::from_parts("w", 2, 130, vec![0x38; 260], vec![0.5, 2.0])?;
    /// assert_eq!(q.value(1, 129), 2.0); // 1.0 × the second block's scale
    /// assert!(BlockQuantized::from_parts("w", 2, 130, vec![0x38; 260], vec![0.5]).is_err());
    /// # Ok::<(), lifecycle_layout::LayoutError>(())
    /// ```
    pub fn from_parts(
        name: &str,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
        scale_inv: Vec<f32>,
    ) -> Result<BlockQuantized, LayoutError> {
        let blocks = rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK);
        if data.len() != rows * cols {
            return Err(LayoutError::ValueCount {
                name: name.to_string(),
                found: data.len(),
                expected: rows * cols,
            });
        }
        if scale_inv.len() != blocks {
            return Err(LayoutError::ValueCount {
                name: format!("{name} (weight_scale_inv)"),
                found: scale_inv.len(),
                expected: blocks,
            });
        }
        if let Some(index) = scale_inv.iter().position(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(LayoutError::NonFinite {
                name: format!("{name} (weight_scale_inv)"),
                index,
            });
        }
        Ok(BlockQuantized {
            rows,
            cols,
            data,
            scale_inv,
        })
    }

    /// Rows `rows` of this tensor as one of their own, when they start on a block boundary and
    /// end on one or at the last row (so their blocks are whole blocks of this tensor).
    ///
    /// ```
    /// use lifecycle_layout::fp8::quantize_blocks;
    /// let q = quantize_blocks("w", &vec![1.0; 300 * 2], 300, 2)?;
    /// assert_eq!(q.block_rows(128..300).map(|p| p.rows()), Some(172));
    /// assert!(q.block_rows(64..128).is_none());
    /// # Ok::<(), lifecycle_layout::LayoutError>(())
    /// ```
    pub fn block_rows(&self, rows: std::ops::Range<usize>) -> Option<BlockQuantized> {
        let aligned = rows.start.is_multiple_of(FP8_BLOCK)
            && (rows.end.is_multiple_of(FP8_BLOCK) || rows.end == self.rows)
            && rows.start < rows.end
            && rows.end <= self.rows;
        if !aligned {
            return None;
        }
        let bc = self.cols.div_ceil(FP8_BLOCK);
        let blocks = rows.start / FP8_BLOCK..rows.end.div_ceil(FP8_BLOCK);
        Some(BlockQuantized {
            rows: rows.len(),
            cols: self.cols,
            data: self.data[rows.start * self.cols..rows.end * self.cols].to_vec(),
            scale_inv: self.scale_inv[blocks.start * bc..blocks.end * bc].to_vec(),
        })
    }

    /// `parts` stacked by rows into one tensor (as a fused tensor of them quantised whole),
    /// when they share their columns and every part but the last is a whole number of blocks.
    ///
    /// ```
    /// use lifecycle_layout::fp8::{quantize_blocks, BlockQuantized};
    /// let x: Vec<f32> = (0..384 * 4).map(|i| (i % 7) as f32 - 3.0).collect();
    /// let whole = quantize_blocks("w", &x, 384, 4)?;
    /// let a = quantize_blocks("a", &x[..256 * 4], 256, 4)?;
    /// let b = quantize_blocks("b", &x[256 * 4..], 128, 4)?;
    /// assert_eq!(BlockQuantized::stack_rows(&[a, b.clone()]), Some(whole));
    /// // a first part of 200 rows would share its last block with the next part
    /// let c = quantize_blocks("c", &x[..200 * 4], 200, 4)?;
    /// assert!(BlockQuantized::stack_rows(&[c, b]).is_none());
    /// # Ok::<(), lifecycle_layout::LayoutError>(())
    /// ```
    pub fn stack_rows(parts: &[BlockQuantized]) -> Option<BlockQuantized> {
        let (first, rest) = parts.split_first()?;
        let cols = first.cols;
        let whole = |p: &BlockQuantized| p.rows.is_multiple_of(FP8_BLOCK);
        if rest.iter().any(|p| p.cols != cols) || parts[..parts.len() - 1].iter().any(|p| !whole(p))
        {
            return None;
        }
        Some(BlockQuantized {
            rows: parts.iter().map(|p| p.rows).sum(),
            cols,
            data: parts.iter().flat_map(|p| p.data.iter().copied()).collect(),
            scale_inv: parts
                .iter()
                .flat_map(|p| p.scale_inv.iter().copied())
                .collect(),
        })
    }

    /// The `scale_inv` of the block holding element (`row`, `col`).
    pub fn scale_at(&self, row: usize, col: usize) -> f32 {
        self.scale_inv[(row / FP8_BLOCK) * self.cols.div_ceil(FP8_BLOCK) + col / FP8_BLOCK]
    }

    /// Element (`row`, `col`) dequantised.
    pub fn value(&self, row: usize, col: usize) -> f32 {
        e4m3_to_f32(self.data[row * self.cols + col]) * self.scale_at(row, col)
    }

    /// Bytes it occupies: one per element and four per scale.
    pub fn bytes(&self) -> u64 {
        (self.data.len() + 4 * self.scale_inv.len()) as u64
    }

    /// Every element dequantised (`e4m3 × scale_inv`), row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let bc = self.cols.div_ceil(FP8_BLOCK);
        (0..self.rows * self.cols)
            .map(|i| {
                let (r, c) = (i / self.cols, i % self.cols);
                e4m3_to_f32(self.data[i]) * self.scale_inv[(r / FP8_BLOCK) * bc + c / FP8_BLOCK]
            })
            .collect()
    }
}

/// Quantises the `rows × cols` f32 values `x` (row-major; `name` names the tensor in errors)
/// block by block with the formula of the module docs. A non-finite value is
/// [`LayoutError::NonFinite`], checked before anything is built.
pub fn quantize_blocks(
    name: &str,
    x: &[f32],
    rows: usize,
    cols: usize,
) -> Result<BlockQuantized, LayoutError> {
    if x.len() != rows * cols {
        return Err(LayoutError::ValueCount {
            name: name.to_string(),
            found: x.len(),
            expected: rows * cols,
        });
    }
    if let Some(index) = x.iter().position(|v| !v.is_finite()) {
        return Err(LayoutError::NonFinite {
            name: name.to_string(),
            index,
        });
    }
    let (br, bc) = (rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK));
    let mut amax = vec![0.0f32; br * bc];
    for (i, v) in x.iter().enumerate() {
        let b = (i / cols / FP8_BLOCK) * bc + (i % cols) / FP8_BLOCK;
        amax[b] = amax[b].max(v.abs());
    }
    let scale_inv: Vec<f32> = amax.into_iter().map(block_scale_inv).collect();
    let data = x
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let b = (i / cols / FP8_BLOCK) * bc + (i % cols) / FP8_BLOCK;
            e4m3_from_f32(v / scale_inv[b])
        })
        .collect();
    Ok(BlockQuantized {
        rows,
        cols,
        data,
        scale_inv,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The device kernel's quotient (`kernels/fp8_quantise.cu`, `quotient`): `x * (1 / s)`
    /// unless its discarded 20 bits lie within 16 ulps of the e4m3 midpoint or it is below 2^-6.
    fn device_quotient(x: f32, s: f32) -> f32 {
        let q = x * (1.0 / s);
        let low = q.to_bits() & 0xfffff;
        if low.wrapping_add(16).wrapping_sub(0x80000) < 32 || q.abs() < 0.0157 {
            x / s
        } else {
            q
        }
    }

    /// The kernel's multiply gives every e4m3 byte the IEEE division gives, on random weights
    /// and on quotients placed within a few ulps of every rounding midpoint and binade edge.
    #[test]
    fn the_kernels_multiply_gives_the_divisions_e4m3_bytes() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut checked = 0u64;
        for _ in 0..50_000 {
            let amax = f32::from_bits(0x3000_0000 + (next() % 0x1000_0000) as u32);
            let s = block_scale_inv(amax);
            // random values of the block
            let x = amax * ((next() % (1 << 24)) as f32 / (1 << 24) as f32) * 2.0 - amax;
            assert_eq!(
                e4m3_from_f32(device_quotient(x, s)),
                e4m3_from_f32(x / s),
                "x {x:e}, s {s:e}"
            );
            // values whose quotient lies near a midpoint of every e4m3 binade, and near 2^-6
            let byte = (next() % 0x7e) as u8;
            let mid = (e4m3_to_f32(byte) + e4m3_to_f32(byte + 1)) / 2.0;
            for target in [mid, e4m3_to_f32(byte), 0.015625] {
                for d in -40i32..=40 {
                    let t = f32::from_bits((target.to_bits() as i32 + d) as u32);
                    let x = t * s;
                    if !x.is_finite() || (x / s).abs() > 448.0 {
                        continue;
                    }
                    assert_eq!(
                        e4m3_from_f32(device_quotient(x, s)),
                        e4m3_from_f32(x / s),
                        "x {x:e}, s {s:e}, near {target:e}"
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked > 5_000_000, "{checked}");
    }

    /// The device kernel's quotient over bf16 sources (`kernels/fp8_quantise.cu`,
    /// `corrected_quotient`): `x · (1 / s)` corrected by the fused residual, `x`'s sign.
    fn device_corrected_quotient(x: f32, s: f32) -> f32 {
        let inv = 1.0 / s;
        let q0 = x * inv;
        let r = (-q0).mul_add(s, x);
        r.mul_add(inv, q0).copysign(x)
    }

    /// The corrected quotient is the IEEE quotient, bit for bit, for every block scale from
    /// 2^-60 (the kernel divides below): bf16 values of random blocks over 150 binades of amax,
    /// quotients placed within a few ulps of every e4m3 rounding midpoint and of 2^-6, and
    /// signed zeros. Fails without the residual's correction (the plain product differs).
    #[test]
    fn the_kernels_fma_quotient_is_the_division() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let bf16_round = |x: f32| half::bf16::from_f32(x).to_f32();
        let (mut checked, mut plain_differs) = (0u64, 0u64);
        for _ in 0..40_000 {
            // amax from about 2^-51 to 2^99: s = amax / 448 from 2^-60
            let exp = 76 + (next() % 150) as u32;
            let amax = f32::from_bits((exp << 23) | (next() as u32 & 0x7f_ffff));
            let s = block_scale_inv(amax);
            assert!(s >= 2f32.powi(-60));
            let mut check = |x: f32| {
                if !x.is_finite() || (x / s).abs() > 448.0 {
                    return;
                }
                let want = x / s;
                assert_eq!(
                    device_corrected_quotient(x, s).to_bits(),
                    want.to_bits(),
                    "x {x:e}, s {s:e}"
                );
                plain_differs += u64::from((x * (1.0 / s)).to_bits() != want.to_bits());
                checked += 1;
            };
            for _ in 0..16 {
                let m = (next() % (1 << 24)) as f32 / (1 << 24) as f32 * 2.0 - 1.0;
                check(bf16_round(amax * m));
            }
            check(0.0);
            check(-0.0);
            let byte = (next() % 0x7e) as u8;
            let mid = (e4m3_to_f32(byte) + e4m3_to_f32(byte + 1)) / 2.0;
            for target in [mid, -mid, 0.015625] {
                for d in -24i32..=24 {
                    let t = f32::from_bits((target.to_bits() as i32 + d) as u32);
                    check(t * s);
                    check(bf16_round(t * s));
                }
            }
        }
        assert!(checked > 7_000_000, "{checked}");
        assert!(plain_differs > 100_000, "{plain_differs}");
    }

    #[test]
    fn every_byte_round_trips_and_encoding_rounds_to_nearest_even() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                continue;
            }
            // -0.0 keeps its sign byte
            assert_eq!(e4m3_from_f32(v), b, "byte {b:#04x} = {v}");
        }
        // halfway between 1.0 (0x38) and 1.125 (0x39): to the even mantissa, 1.0
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        // halfway between 1.125 and 1.25 (0x3a): to 1.25
        assert_eq!(e4m3_from_f32(1.1875), 0x3a);
        // 464 is halfway between 448 and 480 (which would be 0x7f, NaN): to even, 448; above
        // it rounding carries into the NaN pattern, as PyTorch's cast does
        assert_eq!(e4m3_from_f32(464.0), 0x7e);
        assert_eq!(e4m3_from_f32(464.5), 0x7f);
        assert_eq!(e4m3_from_f32(480.0), 0x7f);
        assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7f);
        assert_eq!(e4m3_from_f32(f32::NEG_INFINITY), 0xff);
        // half the smallest subnormal rounds to zero (even), a bit more to the subnormal
        assert_eq!(e4m3_from_f32(2f32.powi(-10)), 0x00);
        assert_eq!(e4m3_from_f32(2f32.powi(-10) * 1.01), 0x01);
    }

    #[test]
    fn blocks_are_partial_at_the_edges_and_zero_blocks_scale_by_one() {
        let (rows, cols) = (130, 129);
        let mut x = vec![0.0f32; rows * cols];
        x[0] = 2.0; // block (0, 0)
        x[129 * cols + 128] = -7.0; // block (1, 1): the corner element alone
        let q = quantize_blocks("w", &x, rows, cols).unwrap();
        assert_eq!(q.blocks(), (2, 2));
        assert_eq!(q.scale_inv(), &[2.0 / 448.0, 1.0, 1.0, 7.0 / 448.0]);
        assert_eq!(q.data()[0], 0x7e);
        assert_eq!(q.data()[129 * cols + 128], 0xfe);
        let back = q.dequantize();
        assert_eq!((back[0], back[129 * cols + 128]), (2.0, -7.0));
        let mut bad = x.clone();
        bad[77] = f32::NAN;
        let err = quantize_blocks("model.layers.0.mlp.up_proj.weight", &bad, rows, cols)
            .unwrap_err()
            .to_string();
        assert!(err.contains("up_proj") && err.contains("77"), "{err}");
    }
}
