//! W8A8 block fp8 products ([`Fp8Compute::W8A8`]), as vLLM's `W8A8BlockFp8LinearOp` runs them:
//! the activations are quantised on the device per token in 1 × 128 groups (one f32 scale each,
//! [`quantize_activation_groups`]'s formula), then multiplied with the block-scaled e4m3 weights.
//!
//! - Up to the weight-streaming threshold ([`W8A8_GEMV_TOKENS`] by default,
//!   `GpuDecoder::set_fp8_gemv_tokens`): the
//!   quantised activations are dequantised into f32 (`e4m3 × scale`, exact) and the fp8 weight
//!   streaming kernel multiplies them: the same products, each weight byte read once.
//! - Then up to [`W8A8_MMA_TOKENS`] tokens by default (`GpuDecoder::set_fp8_mma_tokens`): the
//!   decoder's `mma.sync` tensor-core kernel ([`mma`]), each weight byte read once.
//! - Then up to [`W8A8_WGMMA_TOKENS`] tokens by default (`GpuDecoder::set_fp8_wgmma_tokens`),
//!   on Hopper (its kernels compiled for sm_90a): the decoder's warpgroup (`wgmma`) kernel, each
//!   weight byte read once.
//! - More tokens: cuBLASLt's tensor-core fp8 GEMM with block scales
//!   (`CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F` for the weights,
//!   `CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F` for the activations, f32 accumulation and output).
//!
//!
//! On Hopper the tensor-core kernels, their split sums and the quantisations that feed them are
//! launched early (programmatic dependent launch, `crate::kernels::LaunchHow::early`): a product's
//! blocks request their weights into L2 while its input is still being quantised, then wait for
//! that kernel (`griddepcontrol.wait`) before they read what it writes.
//!
//! [`Fp8Compute::W8A8`]: lifecycle_layout::fp8::Fp8Compute::W8A8
//! [`quantize_activation_groups`]: lifecycle_layout::fp8::quantize_activation_groups

#[cfg(test)]
mod bf16_tests;
mod lt;
mod mma;
mod quant;
#[cfg(test)]
mod tests;

use std::cell::Cell;
use std::sync::Arc;

use lifecycle_cuda::cudarc::driver::CudaStream;
use lifecycle_cuda::CudaError;

use crate::fp8::{fp8_gemv, Fp8Kernels, Fp8Weight, GEMV_TOKENS};
pub(crate) use lt::{lt_reads, W8a8Gemm};
pub(crate) use mma::{
    bf16_mma_reads, mma_reads, MmaKernels, MmaProduct, BF16_MMA_DEFAULT_TOKENS, BF16_MMA_TOKENS,
    MAX_PRODUCTS,
};
pub(crate) use quant::{quantize, ActLayout, ActSrc, QuantInto, QuantOut, W8a8Scratch, MMA_TOKENS};

/// Tokens up to which a W8A8 product takes the weight-streaming kernel by default: none (on an
/// H200 at 7.6B shapes the tensor-core kernel is as fast for one token and faster from two).
pub(crate) const W8A8_GEMV_TOKENS: usize = 0;

/// Tokens up to which a W8A8 product takes the `mma.sync` tensor-core kernel by default (on an
/// H200 at 7.6B shapes cuBLASLt's block-scaled GEMM is faster from 16 tokens; BENCHMARKS.md).
pub(crate) const W8A8_MMA_TOKENS: usize = 8;

/// Tokens up to which a W8A8 product beyond the `mma.sync` kernel's takes the warpgroup
/// kernel by default, where it is loaded: all it takes (at 7.6B shapes it is faster than
/// cuBLASLt's GEMM at 16, 32 and 64 tokens since its row blocks past the resident ones split;
/// BENCHMARKS.md). Beyond, cuBLASLt's GEMM.
pub(crate) const W8A8_WGMMA_TOKENS: usize = MMA_TOKENS;

/// Token counts that choose a W8A8 product's path ([`w8a8_gemm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct W8a8Limits {
    /// Up to these tokens (0 to [`GEMV_TOKENS`]) the weight-streaming kernel, on the
    /// dequantised quantised activations.
    pub gemv: usize,
    /// Then up to these (0 to [`MMA_TOKENS`]) the `mma.sync` tensor-core kernel of [`mma`].
    pub mma: usize,
    /// Then up to these (0 to [`MMA_TOKENS`]) its warpgroup kernel, where loaded; beyond,
    /// cuBLASLt's block-scaled GEMM.
    pub wgmma: usize,
}

impl Default for W8a8Limits {
    fn default() -> Self {
        W8a8Limits {
            gemv: W8A8_GEMV_TOKENS,
            mma: W8A8_MMA_TOKENS,
            wgmma: W8A8_WGMMA_TOKENS,
        }
    }
}

/// The path a W8A8 product takes ([`W8a8Limits::path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum W8a8Path {
    /// The weight-streaming kernel on the dequantised quantised activations.
    Streaming,
    /// The `mma.sync` tensor-core kernel of [`mma`].
    TensorCores,
    /// The warpgroup (`wgmma`) kernel of [`mma`].
    Warpgroup,
    /// cuBLASLt's block-scaled GEMM.
    CublasLt,
}

/// What can take a W8A8 product ([`W8a8Limits::path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct W8a8Readers {
    /// The tensor-core kernels are loaded and read the weight ([`mma_reads`]).
    pub mma: bool,
    /// Their warpgroup kernel is loaded too.
    pub wgmma: bool,
    /// cuBLASLt's GEMM reads the weight ([`lt_reads`]).
    pub lt: bool,
    /// The weight holds at most [`SMALL_WEIGHT`] elements.
    pub small: bool,
}

/// Elements (16 Mi) up to which a weight's W8A8 products take the warpgroup kernel up to
/// [`MMA_TOKENS`] tokens, beyond [`W8a8Limits::wgmma`] (where that is not 0): on an H200 at
/// 7.6B shapes and 64 tokens it takes 11-18 µs for q, k, v and o (reusing one quantisation of
/// the input for q, k and v), cuBLASLt's GEMM 18-19 µs each plus a quantisation each; for gate,
/// up and down (68 Mi elements) cuBLASLt's is faster (BENCHMARKS.md).
pub(crate) const SMALL_WEIGHT: usize = 16 << 20;

impl W8a8Limits {
    /// The path of a product of `tokens` tokens: the weight-streaming kernel up to `gemv`
    /// tokens, the `mma.sync` kernel up to `mma`, the warpgroup kernel up to `wgmma` (up to
    /// [`MMA_TOKENS`] for a weight of at most [`SMALL_WEIGHT`] elements, `wgmma` not 0),
    /// cuBLASLt beyond; where a path cannot take the product the next one does, and a product cuBLASLt
    /// cannot take (a weight it cannot read, or a single token) goes to the tensor-core
    /// kernels up to [`MMA_TOKENS`] tokens (the warpgroup one where loaded), a single token
    /// they cannot take to the weight-streaming kernel.
    pub(crate) fn path(&self, tokens: usize, can: W8a8Readers) -> W8a8Path {
        let mma = can.mma && tokens <= MMA_TOKENS;
        let wgmma = mma && can.wgmma;
        if tokens <= self.gemv.min(GEMV_TOKENS) {
            W8a8Path::Streaming
        } else if mma && tokens <= self.mma {
            W8a8Path::TensorCores
        } else if wgmma && (tokens <= self.wgmma || (can.small && self.wgmma > 0)) {
            W8a8Path::Warpgroup
        } else if can.lt && tokens >= 2 {
            W8a8Path::CublasLt
        } else if wgmma {
            W8a8Path::Warpgroup
        } else if mma {
            W8a8Path::TensorCores
        } else if tokens < 2 {
            W8a8Path::Streaming
        } else {
            W8a8Path::CublasLt
        }
    }
}

/// The scratch a W8A8 product works through.
#[derive(Clone, Copy)]
pub(crate) struct W8a8Through<'a> {
    /// f32 activations of the weight-streaming kernel (at least `GEMV_TOKENS · inp`).
    pub x32: Option<u64>,
    /// The pass's quantised activations and their scales ([`W8a8Scratch`]), and the layout
    /// they hold the current input in, if they do.
    pub act: Option<(u64, u64, &'a Cell<Option<ActLayout>>)>,
    /// Whether the input is the previous product's (q, k and v; gate and up): its quantisation,
    /// where a product left it in `act`, is used again.
    pub same_input: bool,
}

/// A W8A8 product's output written by the product itself ([`w8a8_gemm`]'s `fin`): `out[tokens ×
/// width]` (f32, `width` the product's rows) = (sum + `bias`) + `res`, `bias` bf16 per column and
/// `res` f32 of `out`'s shape (it may be `out` itself), each where given: what the decoder's
/// `combine` of the split output would write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Finish {
    /// The f32 output.
    pub out: u64,
    /// bf16 bias per output column.
    pub bias: Option<u64>,
    /// f32 residual.
    pub res: Option<u64>,
}

/// The path of a W8A8 product of `tokens` tokens by `w` (`out × inp`) under `limits`
/// ([`W8a8Limits::path`], with what can read the weight).
pub(crate) fn w8a8_path(
    lt_gemm: &W8a8Gemm,
    w: &Fp8Weight,
    (out, tokens, inp): (usize, usize, usize),
    limits: W8a8Limits,
) -> W8a8Path {
    let can = W8a8Readers {
        mma: lt_gemm.mma.is_some() && mma_reads(w, inp),
        wgmma: lt_gemm.mma.as_ref().is_some_and(|m| m.has_wgmma()),
        lt: lt_reads(w),
        small: out * inp <= SMALL_WEIGHT,
    };
    limits.path(tokens, can)
}

/// The layout in which a W8A8 product of `tokens` tokens by `w` (`out × inp`) reads its
/// quantised activations where one of the tensor-core kernels takes it ([`w8a8_path`]): the
/// kernel that makes the product's input may quantise it there itself (the norm, the SwiGLU:
/// [`QuantInto`]), the product then called with [`W8a8Through::same_input`]. `None` for the
/// other paths (the weight-streaming kernel, cuBLASLt's GEMM), which quantise through
/// [`w8a8_gemm`].
pub(crate) fn fusable_layout(
    lt_gemm: &W8a8Gemm,
    w: &Fp8Weight,
    (out, tokens, inp): (usize, usize, usize),
    limits: W8a8Limits,
) -> Option<ActLayout> {
    match w8a8_path(lt_gemm, w, (out, tokens, inp), limits) {
        W8a8Path::TensorCores => Some(ActLayout::Rows),
        W8a8Path::Warpgroup => Some(ActLayout::of(tokens, true)),
        W8a8Path::Streaming | W8a8Path::CublasLt => None,
    }
}

impl Finish {
    /// The plain product into `out`: no bias, no residual.
    pub(crate) fn split(out: u64) -> Self {
        Finish {
            out,
            bias: None,
            res: None,
        }
    }

    /// The tensor-core kernels' product of `out` rows of `w` written so.
    pub(crate) fn product(&self, w: Fp8Weight, out: usize) -> MmaProduct {
        MmaProduct {
            w,
            out,
            y: self.out,
            bias: self.bias.unwrap_or(0),
            res: self.res.unwrap_or(0),
        }
    }
}

/// `y[rows × out] = x[rows × inp] · wᵀ` in W8A8 for split bf16 `x` (hi rows, then lo rows) and
/// f32 `y` (its lo rows written 0): the activations quantised per token group (once per input:
/// [`W8a8Through::same_input`]), then, by `limits` ([`W8a8Limits::path`]), the weight-streaming
/// kernel on their dequantised values, a tensor-core kernel or the block-scaled GEMM. With `fin`
/// a tensor-core kernel writes [`Finish`]'s output instead (`y` untouched) and the result is
/// `true`; `false`: `y` was written, for the caller to finish.
///
/// # Safety
/// As [`crate::fp8::fp8_gemm`], `through.act` holding `rows / 2` tokens of `inp` inputs, and
/// `fin`'s buffers of its sizes.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn w8a8_gemm(
    stream: &Arc<CudaStream>,
    lt_gemm: &W8a8Gemm,
    k: &Fp8Kernels,
    w: Fp8Weight,
    x: u64,
    y: u64,
    (out, rows, inp): (usize, usize, usize),
    through: W8a8Through<'_>,
    fin: Option<Finish>,
    limits: W8a8Limits,
    rank: usize,
) -> Result<bool, CudaError> {
    let tokens = rows / 2;
    if !rows.is_multiple_of(2) {
        return Err(CudaError::Invalid(format!(
            "a W8A8 product over {rows} split rows (hi and lo rows come in pairs)"
        )));
    }
    if let (Some((_, _, held)), false) = (through.act, through.same_input) {
        held.set(None);
    }
    let path = w8a8_path(lt_gemm, &w, (out, tokens, inp), limits);
    let mma = lt_gemm
        .mma
        .as_ref()
        .filter(|_| matches!(path, W8a8Path::TensorCores | W8a8Path::Warpgroup));
    let gemv = path == W8a8Path::Streaming;
    if gemv {
        let x32 = through.x32.ok_or_else(|| {
            CudaError::Invalid("a W8A8 product without its activation scratch".into())
        })?;
        let deq = QuantOut {
            deq: Some(x32),
            ..QuantOut::default()
        };
        // SAFETY: x holds 2 · tokens rows of inp bf16, x32 at least tokens · inp f32; then the
        // weight-streaming kernel reads them (sizes per the caller).
        return unsafe {
            quantize(
                stream,
                k,
                ActSrc::Split(x),
                (tokens, tokens, inp),
                deq,
                rank,
            )?;
            fp8_gemv(stream, k, w, x32, y, (out, tokens, inp), rank).map(|()| false)
        };
    }
    let (xq, xsc, held) = through.act.ok_or_else(|| {
        CudaError::Invalid("a W8A8 product without its quantised-activation scratch".into())
    })?;
    let lo = y + 4 * (tokens * out) as u64;
    let layout = ActLayout::of(tokens, path == W8a8Path::Warpgroup);
    if !(mma.is_some() && through.same_input && held.get() == Some(layout)) {
        let q = QuantOut {
            q: Some(xq),
            scales: Some((xsc, layout.scale_strides(tokens))),
            deq: None,
            // the tensor-core kernels write the lo rows themselves
            zero: mma.is_none().then_some((lo, (tokens * out) as u64)),
            layout,
        };
        // SAFETY: x holds 2 · tokens rows of inp bf16, the scratch layout.padded(tokens) · inp
        // bytes and as many groups of scales (W8a8Scratch::alloc); y 2 · tokens rows of out f32
        // (the second half zeroed by the quantisation for the GEMM, the padded tokens' zero
        // products landing there).
        unsafe {
            quantize(
                stream,
                k,
                ActSrc::Split(x),
                (tokens, layout.padded(tokens), inp),
                q,
                rank,
            )?
        };
        held.set(Some(layout));
    }
    // SAFETY: the scratch holds this input's quantisation (written above or by the previous
    // product of the same input); y 2 · tokens rows of out f32, fin's buffers per the caller.
    unsafe {
        match (mma, fin) {
            (Some(m), Some(f)) => m
                .gemm(
                    stream,
                    &[f.product(w, out)],
                    (xq, xsc, layout),
                    false,
                    (tokens, inp),
                    rank,
                )
                .map(|()| true),
            (Some(m), None) => {
                let p = MmaProduct {
                    w,
                    out,
                    y,
                    bias: 0,
                    res: 0,
                };
                m.gemm(stream, &[p], (xq, xsc, layout), true, (tokens, inp), rank)
                    .map(|()| false)
            }
            (None, _) => lt_gemm
                .gemm(stream, k, w, (xq, xsc), y, (out, tokens, inp), rank)
                .map(|()| false),
        }
    }
}

/// Up to [`MAX_PRODUCTS`] W8A8 products of one input `x` (split bf16, `rows` = 2 · tokens rows
/// of `inp`), each `(w, out, fin)` writing its [`Finish`], in one launch of a tensor-core
/// kernel (q, k and v: one launch instead of three, its row blocks split and summed as those of
/// the three matrices stacked, [`MmaShape::of_products`]): `true`. Where the products would not
/// all take the same tensor-core path ([`w8a8_path`]) nothing is launched or changed: `false`,
/// for the caller to run them one by one ([`w8a8_gemm`]). With `split` each product writes
/// its output as a split product's (its `tokens` rows to [`Finish::out`], then `tokens` rows of
/// zeros: the layout [`w8a8_gemm`] writes, gate and up for the SwiGLU), else as its [`Finish`]
/// says.
///
/// # Safety
/// As [`w8a8_gemm`] for each product; with `split`, each [`Finish::out`] holds `2 · tokens`
/// rows of its product's outputs.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn w8a8_gemm_group(
    stream: &Arc<CudaStream>,
    lt_gemm: &W8a8Gemm,
    k: &Fp8Kernels,
    prods: &[(Fp8Weight, usize, Finish)],
    x: u64,
    (rows, inp): (usize, usize),
    (through, split): (W8a8Through<'_>, bool),
    limits: W8a8Limits,
    rank: usize,
) -> Result<bool, CudaError> {
    let tokens = rows / 2;
    let (Some(m), Some((xq, xsc, held))) = (lt_gemm.mma.as_ref(), through.act) else {
        return Ok(false);
    };
    let paths: Vec<W8a8Path> = prods
        .iter()
        .map(|(w, out, _)| w8a8_path(lt_gemm, w, (*out, tokens, inp), limits))
        .collect();
    let path = match paths.first() {
        Some(&p @ (W8a8Path::TensorCores | W8a8Path::Warpgroup))
            if rows.is_multiple_of(2)
                && prods.len() <= MAX_PRODUCTS
                && paths.iter().all(|&q| q == p) =>
        {
            p
        }
        _ => return Ok(false),
    };
    let layout = ActLayout::of(tokens, path == W8a8Path::Warpgroup);
    if !(through.same_input && held.get() == Some(layout)) {
        let q = QuantOut {
            q: Some(xq),
            scales: Some((xsc, layout.scale_strides(tokens))),
            deq: None,
            zero: None,
            layout,
        };
        // SAFETY: as in w8a8_gemm: x holds 2 · tokens rows of inp bf16, the scratch the layout's
        // padded tokens of bytes and scales.
        unsafe {
            quantize(
                stream,
                k,
                ActSrc::Split(x),
                (tokens, layout.padded(tokens), inp),
                q,
                rank,
            )?
        };
        held.set(Some(layout));
    }
    let list: Vec<MmaProduct> = prods.iter().map(|&(w, out, f)| f.product(w, out)).collect();
    // SAFETY: the scratch holds this input's quantisation; each Finish's buffers per the caller.
    unsafe { m.gemm(stream, &list, (xq, xsc, layout), split, (tokens, inp), rank)? };
    Ok(true)
}
