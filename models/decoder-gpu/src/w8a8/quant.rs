//! The activations' quantisation of a W8A8 product: per token in 1 × 128 groups on the device
//! (`fp8_quant_split` / `fp8_quant_f32`), and the pass's scratch that holds it.

use std::cell::Cell;
use std::sync::Arc;

use lifecycle_cuda::cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use lifecycle_cuda::{alloc_device, CudaError};

use crate::fp8::Fp8Kernels;
use crate::kernels::{launch, Arg};

/// Where the scale of token `t`, group `g` of a quantised activation matrix of `tokens` rows
/// lies (in f32 elements): the layout cuBLASLt reads for
/// `CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F` on the activations' operand, the groups of one
/// column of 128 inputs next to each other for all tokens (token-contiguous, as PyTorch's
/// `_scaled_mm` takes its 1 × 128 scales).
/// `tokens` are padded to [`padded_tokens`] columns (cuBLASLt wants the scale columns on
/// 16 bytes).
pub(crate) fn act_scale_strides(tokens: usize) -> (u32, u32) {
    (1, padded_tokens(tokens) as u32)
}

/// The tokens a block-scaled product multiplies: `tokens` rounded up to a multiple of 4 (the
/// extra ones zero), as its activation scales' columns must start on 16 bytes.
pub(crate) fn padded_tokens(tokens: usize) -> usize {
    tokens.next_multiple_of(4)
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
    ];
    // SAFETY: the argument list matches fp8_quant_split / fp8_quant_f32; sizes per the caller.
    unsafe { launch(stream, func, cfg, &args, rank, "fp8_quant") }
}

/// The per-pass scratch of the W8A8 products: the quantised activations and their scales,
/// sized for the pass's rows (padded, [`padded_tokens`]) and widest input
/// ([`W8a8Scratch::alloc`]).
pub(crate) struct W8a8Scratch {
    /// e4m3 activations, `[rows × widest]`.
    pub q: CudaSlice<u8>,
    /// Their scales, `rows × ⌈widest / 128⌉`.
    pub scales: CudaSlice<f32>,
    /// Whether `q` and `scales` hold the quantisation of the current input (set by the product
    /// that quantised it, cleared by the first product of a new input).
    pub held: Cell<bool>,
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
        let rows = padded_tokens(rows.max(1));
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
                held: Cell::new(false),
            })
        }
    }
}
