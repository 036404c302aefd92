//! CPU kernels: bf16 weights, f32 activations and accumulation.

use half::bf16;
use lifecycle_layout::fp8::{
    e4m3_to_f32, quantize_activation_groups, BlockQuantized, Fp8Compute, FP8_BLOCK,
};

/// Multiply-adds above which [`linear`] splits the batch rows over threads.
const PARALLEL_MACS: usize = 1 << 20;

#[inline(always)]
fn widen(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// Dot product of a bf16 row and f32 values, eight independent accumulators (vectorisable).
#[inline]
pub fn dot(w: &[bf16], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let tail: f32 = wc
        .remainder()
        .iter()
        .zip(xc.remainder())
        .map(|(a, b)| widen(*a) * b)
        .sum();
    for (a, b) in wc.zip(xc) {
        for i in 0..8 {
            acc[i] += widen(a[i]) * b[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// A weight matrix as a rollout holds it: bf16 values, or rows of a block-scaled e4m3 matrix
/// ([`BlockQuantized`]), read as `e4m3 × scale_inv` in f32.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mat<'w> {
    /// Row-major bf16.
    Bf16(&'w [bf16]),
    /// Rows `row0 .. row0 + rows` of `q`, computed with as `compute` says.
    Fp8 {
        q: &'w BlockQuantized,
        row0: usize,
        rows: usize,
        compute: Fp8Compute,
    },
}

impl<'w> From<&'w [bf16]> for Mat<'w> {
    fn from(w: &'w [bf16]) -> Self {
        Mat::Bf16(w)
    }
}

impl<'w> Mat<'w> {
    /// The whole of `q`.
    pub(crate) fn fp8(q: &'w BlockQuantized) -> Self {
        Mat::Fp8 {
            q,
            row0: 0,
            rows: q.rows(),
            compute: Fp8Compute::WeightOnly,
        }
    }

    /// The same matrix, its products computed as `compute` says when it is fp8.
    pub(crate) fn with_compute(self, compute: Fp8Compute) -> Mat<'w> {
        match self {
            Mat::Fp8 { q, row0, rows, .. } => Mat::Fp8 {
                q,
                row0,
                rows,
                compute,
            },
            bf16 => bf16,
        }
    }

    /// Elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            Mat::Bf16(w) => w.len(),
            Mat::Fp8 { q, rows, .. } => rows * q.cols(),
        }
    }

    /// Rows `range` of this matrix, whose rows hold `width` elements.
    pub(crate) fn rows(self, range: std::ops::Range<usize>, width: usize) -> Mat<'w> {
        match self {
            Mat::Bf16(w) => Mat::Bf16(&w[range.start * width..range.end * width]),
            Mat::Fp8 {
                q, row0, compute, ..
            } => Mat::Fp8 {
                q,
                row0: row0 + range.start,
                rows: range.len(),
                compute,
            },
        }
    }
}

/// `y[n × out] = x[n × in] · wᵀ (+ bias)` for a row-major `w[out × in]` (a PyTorch linear).
/// Each weight row is read once for all `n` rows (an fp8 row dequantised once); large products
/// split the rows over threads.
pub(crate) fn linear<'w>(
    x: &[f32],
    w: impl Into<Mat<'w>>,
    bias: Option<&[bf16]>,
    inp: usize,
    y: &mut [f32],
) {
    let w = w.into();
    let out = w.len() / inp;
    let n = x.len() / inp;
    let threads = if n >= 2 && n * out * inp >= PARALLEL_MACS {
        std::thread::available_parallelism()
            .map_or(1, |t| t.get())
            .min(n)
    } else {
        1
    };
    if threads <= 1 {
        linear_rows(x, w, bias, inp, y);
        return;
    }
    let rows_per = n.div_ceil(threads);
    std::thread::scope(|s| {
        for (xc, yc) in x.chunks(rows_per * inp).zip(y.chunks_mut(rows_per * out)) {
            s.spawn(move || linear_rows(xc, w, bias, inp, yc));
        }
    });
}

fn linear_rows(x: &[f32], w: Mat<'_>, bias: Option<&[bf16]>, inp: usize, y: &mut [f32]) {
    let out = w.len() / inp;
    match w {
        Mat::Bf16(w) => {
            for (o, row) in w.chunks_exact(inp).enumerate() {
                let b = bias.map_or(0.0, |b| widen(b[o]));
                for (xi, yi) in x.chunks_exact(inp).zip(y.chunks_exact_mut(out)) {
                    yi[o] = dot(row, xi) + b;
                }
            }
        }
        Mat::Fp8 {
            q,
            row0,
            compute: Fp8Compute::W8A8,
            ..
        } => w8a8_rows(x, q, row0, bias, inp, y),
        Mat::Fp8 { q, row0, .. } => {
            let lut = e4m3_table();
            let mut row = vec![0.0f32; inp];
            for o in 0..out {
                let r = row0 + o;
                let bytes = &q.data()[r * inp..(r + 1) * inp];
                // one scale per 128 columns
                for (blk, (vs, bs)) in row
                    .chunks_mut(FP8_BLOCK)
                    .zip(bytes.chunks(FP8_BLOCK))
                    .enumerate()
                {
                    let scale = q.scale_at(r, blk * FP8_BLOCK);
                    for (v, b) in vs.iter_mut().zip(bs) {
                        *v = lut[usize::from(*b)] * scale;
                    }
                }
                let b = bias.map_or(0.0, |b| widen(b[o]));
                for (xi, yi) in x.chunks_exact(inp).zip(y.chunks_exact_mut(out)) {
                    yi[o] = dot_f32(&row, xi) + b;
                }
            }
        }
    }
}

/// W8A8 block fp8 ([`Fp8Compute::W8A8`]): each row of `x` quantised per token in groups of 128
/// columns, then for every output `o` and row `i`:
/// `y[i, o] = Σ_g (Σ_{k ∈ g} e4m3(x̂[i, k]) · e4m3(ŵ[o, k])) · s_x[i, g] · s_w[o / 128, g]`, each
/// group's e4m3 products summed in f32 (as [`dot_f32`]), the groups added in order.
fn w8a8_rows(
    x: &[f32],
    q: &BlockQuantized,
    row0: usize,
    bias: Option<&[bf16]>,
    inp: usize,
    y: &mut [f32],
) {
    let lut = e4m3_table();
    let out = y.len() / (x.len() / inp).max(1);
    let qx = quantize_activation_groups(x, inp);
    let groups = qx.groups();
    let xv: Vec<f32> = qx.data.iter().map(|&b| lut[usize::from(b)]).collect();
    let mut row = vec![0.0f32; inp];
    for o in 0..out {
        let r = row0 + o;
        for (v, b) in row.iter_mut().zip(&q.data()[r * inp..(r + 1) * inp]) {
            *v = lut[usize::from(*b)];
        }
        let b = bias.map_or(0.0, |b| widen(b[o]));
        for (i, (xi, yi)) in xv
            .chunks_exact(inp)
            .zip(y.chunks_exact_mut(out))
            .enumerate()
        {
            let mut acc = 0.0f32;
            for (g, (wg, xg)) in row.chunks(FP8_BLOCK).zip(xi.chunks(FP8_BLOCK)).enumerate() {
                let scale = qx.scale_inv[i * groups + g] * q.scale_at(r, g * FP8_BLOCK);
                acc += dot_f32(wg, xg) * scale;
            }
            yi[o] = acc + b;
        }
    }
}

/// Every e4m3 byte's value.
fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| e4m3_to_f32(b as u8)))
}

/// Dot product of two f32 rows, eight accumulators as [`dot`].
#[inline]
fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
    let tail: f32 = wc
        .remainder()
        .iter()
        .zip(xc.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (a, b) in wc.zip(xc) {
        for i in 0..8 {
            acc[i] += a[i] * b[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// RMSNorm of every `hidden`-sized row of `x` into `y`: `x / sqrt(mean(x²) + eps) · w`.
pub fn rms_norm(x: &[f32], w: &[bf16], eps: f32, y: &mut [f32]) {
    let h = w.len();
    for (xr, yr) in x.chunks_exact(h).zip(y.chunks_exact_mut(h)) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / h as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, v), g) in yr.iter_mut().zip(xr).zip(w) {
            *o = widen(*g) * (v * inv);
        }
    }
}

/// SiLU(gate) · up, in place into `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Rotary tables: `cos`/`sin` of `position · θ^(-2i/d)` for `i < d/2`.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Tables for head size `head_dim` and base `theta`, computed as Hugging Face does (f32).
    pub fn new(head_dim: usize, theta: f64) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0 / (theta.powf((2 * i) as f64 / head_dim as f64)) as f32)
            .collect();
        Rope { inv_freq }
    }

    /// Rotates one head vector in place at `position` (HF's `rotate_half`: the pairs are
    /// `(x[i], x[i + d/2])`).
    pub fn apply(&self, x: &mut [f32], position: usize) {
        let half = self.inv_freq.len();
        let (a, b) = x.split_at_mut(half);
        for ((xa, xb), f) in a.iter_mut().zip(b.iter_mut()).zip(&self.inv_freq) {
            let angle = position as f32 * f;
            let (s, c) = angle.sin_cos();
            let (u, v) = (*xa, *xb);
            *xa = u * c - v * s;
            *xb = v * c + u * s;
        }
    }
}

/// Softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut total = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        total += *v;
    }
    for v in x.iter_mut() {
        *v /= total;
    }
}

/// The `top_k` experts of one row of router logits and their weights, as Qwen3-MoE computes
/// them: softmax over every expert (in place: `logits` ends as the probabilities), the `top_k`
/// largest probabilities (the lower index first among equals), divided by their sum when
/// `norm_topk_prob`. Both decoders route with it.
///
/// ```
/// use lifecycle_decoder::route_top_k;
/// let mut logits = [0.0f32, 2.0, 1.0, 2.0];
/// let picked = route_top_k(&mut logits, 2, true);
/// assert_eq!(picked.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 3]); // a tie: lower first
/// assert!((picked[0].1 - 0.5).abs() < 1e-6);
/// ```
pub fn route_top_k(logits: &mut [f32], top_k: usize, norm_topk_prob: bool) -> Vec<(usize, f32)> {
    softmax(logits);
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    order.truncate(top_k);
    let sum: f32 = order.iter().map(|&e| logits[e]).sum();
    order
        .into_iter()
        .map(|e| {
            let w = if norm_topk_prob {
                logits[e] / sum
            } else {
                logits[e]
            };
            (e, w)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use lifecycle_layout::fp8::quantize_blocks;

    /// W8A8 against the same formula in f64 from the quantised values (an independent sum), on
    /// rows with a zero group, a partial group (300 = 2 × 128 + 44 columns), an outlier and
    /// weights of 2 block rows (130 outputs), with and without threads.
    #[test]
    fn w8a8_equals_the_block_scaled_product_of_the_quantised_values() {
        for n in [3usize, 64] {
            let (inp, out) = (300, 130);
            let mut x: Vec<f32> = (0..n * inp)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.05 * (1 + (i / 97) % 5) as f32)
                .collect();
            x[..128].iter_mut().for_each(|v| *v = 0.0);
            x[inp + 7] = 300.0;
            let wf: Vec<f32> = (0..out * inp)
                .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.01)
                .collect();
            let q = quantize_blocks("w", &wf, out, inp).unwrap();
            let bias: Vec<bf16> = (0..out).map(|i| bf16::from_f32(i as f32 * 0.25)).collect();
            let mut y = vec![0.0f32; n * out];
            let w8a8 = Mat::fp8(&q).with_compute(Fp8Compute::W8A8);
            linear(&x, w8a8, Some(&bias), inp, &mut y);
            let mut weight_only = vec![0.0f32; n * out];
            linear(&x, Mat::fp8(&q), Some(&bias), inp, &mut weight_only);
            let qx = quantize_activation_groups(&x, inp);
            let (mut worst, mut moved) = (0.0f64, 0.0f32);
            for i in 0..n {
                for o in 0..out {
                    let (mut want, mut mag) = (f64::from(bias[o].to_f32()), 0.0f64);
                    for k in 0..inp {
                        let xs = f64::from(qx.scale_inv[i * qx.groups() + k / FP8_BLOCK]);
                        let xv = f64::from(e4m3_to_f32(qx.data[i * inp + k])) * xs;
                        let term = xv * f64::from(q.value(o, k));
                        want += term;
                        mag += term.abs();
                    }
                    let got = f64::from(y[i * out + o]);
                    let err = (got - want).abs() / (mag + 1e-30);
                    assert!(err <= 1e-5, "row {i} out {o}: {got} vs {want}");
                    worst = worst.max(err);
                    moved = moved.max((y[i * out + o] - weight_only[i * out + o]).abs());
                }
            }
            // the activations' quantisation moves the products (the mode is not weight-only)
            assert!(moved > 1e-3, "W8A8 equals weight-only: {moved}");
            assert!(worst < 1e-5);
        }
    }

    /// W8A8 against PyTorch (`fixtures/w8a8/make_w8a8.py`, run with torch 2.11 on an H200
    /// machine; `oracle.json` beside it): the activation groups' bytes and scales and the
    /// weights' blocks bit-identical to torch's, the products within `1e-5 · Σ|terms|` of
    /// torch's f64 block-scaled product (rows with an all-zero group, an outlier, small
    /// activations; a partial group and a partial block row).
    #[test]
    fn w8a8_matches_the_pytorch_oracle() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/w8a8/oracle.json");
        let text = std::fs::read_to_string(path).unwrap();
        let o: serde_json::Value = serde_json::from_str(&text).unwrap();
        let num = |k: &str| o[k].as_u64().unwrap() as usize;
        let (n, inp, out) = (num("rows"), num("inp"), num("out"));
        let f32s = |k: &str| -> Vec<f32> {
            let v = o[k].as_array().unwrap();
            v.iter()
                .map(|b| f32::from_bits(b.as_i64().unwrap() as i32 as u32))
                .collect()
        };
        let floats = |k: &str| -> Vec<f64> {
            o[k].as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect()
        };
        let bytes = |k: &str| -> Vec<u8> {
            o[k].as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u8)
                .collect()
        };
        let (x, w) = (f32s("x_bits"), f32s("w_bits"));
        assert_eq!((x.len(), w.len()), (n * inp, out * inp));
        let qx = quantize_activation_groups(&x, inp);
        assert_eq!(qx.data, bytes("x_q"), "activation bytes");
        let xs: Vec<f32> = floats("x_scale_inv").iter().map(|&v| v as f32).collect();
        assert_eq!(qx.scale_inv, xs, "activation scales");
        let q = quantize_blocks("w", &w, out, inp).unwrap();
        assert_eq!(q.data(), &bytes("w_q")[..], "weight bytes");
        let ws: Vec<f32> = floats("w_scale_inv").iter().map(|&v| v as f32).collect();
        assert_eq!(q.scale_inv(), &ws[..], "weight scales");
        let mut y = vec![0.0f32; n * out];
        linear(
            &x,
            Mat::fp8(&q).with_compute(Fp8Compute::W8A8),
            None,
            inp,
            &mut y,
        );
        let (want, mag) = (floats("y"), floats("y_magnitude"));
        let mut worst = 0.0f64;
        for (i, ((&g, &w), &m)) in y.iter().zip(&want).zip(&mag).enumerate() {
            let err = (f64::from(g) - w).abs() / (m + 1e-30);
            assert!(err <= 1e-5, "output {i}: {g} vs torch {w} (Σ|terms| {m})");
            worst = worst.max(err);
        }
    }

    #[test]
    fn linear_matches_a_naive_product_with_and_without_threads() {
        for (n, inp, out) in [(3, 5, 4), (64, 256, 80)] {
            let w: Vec<bf16> = (0..inp * out)
                .map(|i| bf16::from_f32(((i * 7 % 13) as f32 - 6.0) / 8.0))
                .collect();
            let x: Vec<f32> = (0..n * inp)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0)
                .collect();
            let b: Vec<bf16> = (0..out).map(|i| bf16::from_f32(i as f32)).collect();
            let mut y = vec![0.0; n * out];
            linear(&x, &w[..], Some(&b), inp, &mut y);
            for r in 0..n {
                for o in 0..out {
                    let want: f32 = (0..inp)
                        .map(|i| w[o * inp + i].to_f32() * x[r * inp + i])
                        .sum::<f32>()
                        + o as f32;
                    assert!((y[r * out + o] - want).abs() < 1e-3, "{r} {o}");
                }
            }
        }
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let rope = Rope::new(8, 10000.0);
        let mut x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let orig = x;
        rope.apply(&mut x, 0);
        assert_eq!(x, orig);
        rope.apply(&mut x, 5);
        let n = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((n(&x) - n(&orig)).abs() < 1e-3);
    }
}
