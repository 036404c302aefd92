//! The activations' quantisation of a W8A8 product: per token in 1 × 128 groups on the device
//! (`fp8_quant_split` / `fp8_quant_f32`), and the pass's scratch that holds it.

use std::cell::Cell;
use std::sync::Arc;

use lifecycle_cuda::cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use lifecycle_cuda::{alloc_device, CudaError};

use crate::fp8::Fp8Kernels;
use crate::kernels::{launch_maybe_early, Arg};

/// The tokens a block-scaled product multiplies: `tokens` rounded up to a multiple of 4 (the
/// extra ones zero), as its activation scales' columns must start on 16 bytes.
pub(crate) fn padded_tokens(tokens: usize) -> usize {
    tokens.next_multiple_of(4)
}

/// How a quantisation lays out its e4m3 bytes and scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum ActLayout {
    /// Token rows, `[tokens × inp]`, the tokens padded to [`padded_tokens`] and the scales at
    /// [`ActLayout::scale_strides`]: what cuBLASLt's GEMM and the `mma.sync` kernel read.
    #[default]
    Rows,
    /// The warpgroup kernel's: `8 · tiles` tokens (the ones past the product's zero), each
    /// 128-wide input group's bytes in the core matrices its kernel stages (`tiled_offset`),
    /// the scales `[group][8 · tiles]`.
    Tiles(usize),
}

impl ActLayout {
    /// The layout of a product of `tokens` tokens on the warpgroup kernel, or not.
    pub(crate) fn of(tokens: usize, warpgroup: bool) -> Self {
        if warpgroup {
            ActLayout::Tiles(wgmma_tiles(tokens))
        } else {
            ActLayout::Rows
        }
    }

    /// The tokens whose bytes and scales the layout holds (the product's, then zeros).
    pub(crate) fn padded(&self, tokens: usize) -> usize {
        match *self {
            ActLayout::Rows => padded_tokens(tokens),
            ActLayout::Tiles(tiles) => (8 * tiles).max(tokens),
        }
    }

    /// The scales' (token, group) strides for `tokens` tokens: the scale of token `t`, group
    /// `g` at `t · s.0 + g · s.1` (in f32 elements), the groups of one column of 128 inputs next
    /// to each other for all the padded tokens. In [`ActLayout::Rows`] that is the layout
    /// cuBLASLt reads for `CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F` on the activations' operand
    /// (token-contiguous, as PyTorch's `_scaled_mm` takes its 1 × 128 scales; the columns on
    /// 16 bytes).
    pub(crate) fn scale_strides(&self, tokens: usize) -> (u32, u32) {
        (1, self.padded(tokens) as u32)
    }
}

/// Tokens up to which the tensor-core kernels of [`super::mma`] multiply (8 per mma, up to 8
/// mma's per warp and group): the most a product in [`ActLayout::Tiles`] holds.
pub(crate) const MMA_TOKENS: usize = 64;

/// Token tiles of 8 of the warpgroup kernel for `tokens` tokens: a power of two.
pub(crate) fn wgmma_tiles(tokens: usize) -> usize {
    tokens.div_ceil(8).max(1).next_power_of_two()
}

/// Where byte `c` (0 to 127) of input group `g` of token `t` lies in the [`ActLayout::Tiles`]
/// layout of `tiles` token tiles: the group's 32 four-byte words, word `w` in core matrix
/// `w & 7` (8 tokens × 16 bytes, 128 contiguous bytes), as word `w >> 3` of its token's row,
/// the token tiles' core matrices next to each other: the order in which the warpgroup kernel's
/// `wgmma` reads them, the weights' k order permuted as the kernel loads their fragments.
#[cfg(test)]
pub(crate) fn tiled_offset(t: usize, g: usize, c: usize, tiles: usize) -> usize {
    let word = c / 4;
    g * 1024 * tiles + ((word % 8) * tiles + t / 8) * 128 + (t % 8) * 16 + 4 * (word / 8) + c % 4
}

/// The f32 activation source of a quantisation.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ActSrc {
    /// Split bf16 rows (`[2 · rows × inp]`, hi rows then lo rows).
    Split(u64),
    /// f32 rows (`[rows × inp]`).
    F32(u64),
}

/// What a quantisation writes (each where it is `Some`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct QuantOut {
    /// The e4m3 bytes, `[rows × inp]`.
    pub q: Option<u64>,
    /// The scales with their (token, group) strides.
    pub scales: Option<(u64, (u32, u32))>,
    /// The dequantised values in f32, `[rows × inp]` (may be an [`ActSrc::F32`] source).
    pub deq: Option<u64>,
    /// f32 zeroed by the same launch (address, count): the lo rows of the product's output.
    pub zero: Option<(u64, u64)>,
    /// How the bytes lie ([`ActLayout::Tiles`] wants `pad` = its tokens and inputs in whole
    /// groups of 128).
    pub layout: ActLayout,
}

/// Quantises `rows × inp` activations per token in 1 × 128 groups (`fp8_quant_split` /
/// `fp8_quant_f32`), the bytes and scales of `pad ≥ rows` tokens (those past `rows` zero).
///
/// # Safety
/// Every address must be device memory of this context holding the sizes [`ActSrc`] and
/// [`QuantOut`] state (the bytes `pad` rows; the scales: every (token, group) index of its
/// strides for `pad` tokens), alive until the stream ran the kernel.
pub(crate) unsafe fn quantize(
    stream: &Arc<CudaStream>,
    k: &Fp8Kernels,
    src: ActSrc,
    (rows, pad, inp): (usize, usize, usize),
    out: QuantOut,
    rank: usize,
) -> Result<(), CudaError> {
    let u32a = |v: usize, what: &str| {
        u32::try_from(v)
            .map_err(|_| CudaError::Invalid(format!("W8A8 quantisation {what} {v} > u32")))
    };
    let pad = pad.max(rows);
    let tiles = match out.layout {
        ActLayout::Rows => 0,
        ActLayout::Tiles(tiles) => {
            if pad != 8 * tiles || !inp.is_multiple_of(128) {
                return Err(CudaError::Invalid(format!(
                    "the warpgroup kernel's layout of {tiles} token tiles holds {} tokens of \
                     whole 128-wide groups: asked for {pad} tokens of {inp} inputs",
                    8 * tiles
                )));
            }
            u32a(tiles, "token tiles")?
        }
    };
    let warps = pad as u64 * inp.div_ceil(128) as u64;
    if warps == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (u32a(warps.div_ceil(8) as usize, "blocks")?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (func, from) = match src {
        ActSrc::Split(p) => (&k.quant_split, p),
        ActSrc::F32(p) => (&k.quant_f32, p),
    };
    let (sc, (tok, grp)) = out.scales.unwrap_or((0, (0, 0)));
    let (zero, nzero) = out.zero.unwrap_or((0, 0));
    let args = [
        Arg::U64(from),
        Arg::U32(u32a(rows, "rows")?),
        Arg::U32(u32a(pad, "padded rows")?),
        Arg::U32(u32a(inp, "columns")?),
        Arg::U64(out.q.unwrap_or(0)),
        Arg::U64(sc),
        Arg::U32(tok),
        Arg::U32(grp),
        Arg::U64(out.deq.unwrap_or(0)),
        Arg::U64(zero),
        Arg::U64(nzero),
        Arg::U32(tiles),
    ];
    // SAFETY: the argument list matches fp8_quant_split / fp8_quant_f32, which wait for the
    // grid before them first thing (launched early where `k.early`); sizes per the caller.
    unsafe { launch_maybe_early(k.early, stream, func, cfg, &args, rank, "fp8_quant") }
}

/// Where a quantisation fused into the kernel that makes a product's input (`rms_norm_quant`,
/// `swiglu_quant`) writes it: the bytes and scales of `tokens` tokens in `layout`, as
/// [`quantize`] would for the product (the padded tokens zero, no dequantised copy, no zeroed
/// output rows: the tensor-core kernels' quantisation, [`crate::w8a8::fusable_layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QuantInto {
    /// e4m3 bytes, `layout.padded(tokens)` rows of the product's inputs.
    pub q: u64,
    /// Their scales at `layout.scale_strides(tokens)`.
    pub scales: u64,
    /// How they lie.
    pub layout: ActLayout,
    /// The product's tokens.
    pub tokens: usize,
}

impl QuantInto {
    /// The tokens written, the product's and the zero ones after them.
    pub(crate) fn padded(&self) -> usize {
        self.layout.padded(self.tokens)
    }

    /// The fused kernels' trailing arguments: the padded tokens, then `q, sc, sc_tok, sc_grp,
    /// tiles`, for `inp` inputs (the warpgroup layout wants whole groups of 128).
    pub(crate) fn args(&self, inp: usize) -> Result<[Arg; 6], CudaError> {
        let u32a = |v: usize, what: &str| {
            u32::try_from(v).map_err(|_| {
                CudaError::Invalid(format!("a fused W8A8 quantisation's {what} {v} > u32"))
            })
        };
        let tiles = match self.layout {
            ActLayout::Rows => 0,
            ActLayout::Tiles(tiles) if inp.is_multiple_of(128) => tiles,
            ActLayout::Tiles(tiles) => {
                return Err(CudaError::Invalid(format!(
                    "the warpgroup kernel's layout of {tiles} token tiles holds whole 128-wide \
                     groups: asked for {inp} inputs"
                )))
            }
        };
        let (tok, grp) = self.layout.scale_strides(self.tokens);
        Ok([
            Arg::U32(u32a(self.padded(), "padded tokens")?),
            Arg::U64(self.q),
            Arg::U64(self.scales),
            Arg::U32(tok),
            Arg::U32(grp),
            Arg::U32(u32a(tiles, "token tiles")?),
        ])
    }
}

/// The per-pass scratch of the W8A8 products: the quantised activations and their scales,
/// sized for the pass's rows (padded, [`padded_tokens`]) and widest input
/// ([`W8a8Scratch::alloc`]).
pub(crate) struct W8a8Scratch {
    /// e4m3 activations, `[rows × widest]`.
    pub q: CudaSlice<u8>,
    /// Their scales, `rows × ⌈widest / 128⌉`.
    pub scales: CudaSlice<f32>,
    /// The layout in which `q` and `scales` hold the quantisation of the current input, if
    /// they do (set by the product that quantised it, cleared by the first product of a new
    /// input).
    pub held: Cell<Option<ActLayout>>,
}

impl W8a8Scratch {
    /// The scratch of a pass of `rows` tokens whose widest product input is `widest`.
    ///
    /// # Safety
    /// The buffers are uninitialised: every product writes what it reads first.
    pub(crate) unsafe fn alloc(
        s: &Arc<CudaStream>,
        rows: usize,
        widest: usize,
        rank: usize,
    ) -> Result<Self, CudaError> {
        let rows = rows.max(1);
        // the warpgroup kernel's tiles may pad the tokens further
        let rows = if rows <= MMA_TOKENS {
            ActLayout::Tiles(wgmma_tiles(rows)).padded(rows)
        } else {
            0
        }
        .max(padded_tokens(rows));
        // SAFETY: forwarded to the caller.
        unsafe {
            Ok(W8a8Scratch {
                q: alloc_device::<u8>(s, rows * widest, rank, "W8A8 activations")?,
                scales: alloc_device::<f32>(
                    s,
                    rows * widest.div_ceil(128),
                    rank,
                    "W8A8 activation scales",
                )?,
                held: Cell::new(None),
            })
        }
    }
}
