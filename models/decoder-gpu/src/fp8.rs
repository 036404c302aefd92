//! Matrix products with fp8 rollout weights (block-scaled e4m3, [`lifecycle_layout::fp8`]): every
//! weight is read as `e4m3 × scale_inv` in f32, as the CPU decoder reads it.
//!
//! - Up to [`GEMV_TOKENS`] tokens (decoding): the split activations are joined back into f32
//!   and one kernel reads each weight byte once, dequantises it in registers and accumulates
//!   every token in f32: the weights cross device memory at one byte per element.
//! - More rows (prefill): the weights are dequantised into a scratch as two bf16 matrices,
//!   `hi = bf16(w)` and `lo = bf16(w − hi)`, and multiplied by cuBLAS as two accumulating GEMMs,
//!   so the product sees each weight to about 16 significant bits (the dequantised value has
//!   at most 28) instead of rounding it to bf16.

use std::sync::Arc;

use lifecycle_cuda::cudarc::cublas::CudaBlas;
use lifecycle_cuda::cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};
use lifecycle_cuda::{CudaError, KernelSet, RankCtx};

use crate::kernels::{launch, Arg};

/// Tokens (half the split product rows) up to which the weight-streaming kernel runs; beyond,
/// the dequantised GEMMs.
pub(crate) const GEMV_TOKENS: usize = 8;

/// Device scratch of the fp8 products: the f32 activations of the weight-streaming kernel
/// (`GEMV_TOKENS` rows of the widest fp8 matrix) and the dequantisation scratch of the GEMMs.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Fp8Scratch {
    pub x32: Option<u64>,
    pub dequant: Option<u64>,
}

/// CUDA C source of the fp8 matrix kernels (no headers).
pub const FP8_DECODER_KERNEL_SRC: &str = include_str!("../../../kernels/decoder_fp8.cu");

/// [`FP8_DECODER_KERNEL_SRC`] as a kernel set.
pub const FP8_DECODER_KERNELS: KernelSet =
    KernelSet::new("lifecycle_decoder_gpu fp8 kernels", FP8_DECODER_KERNEL_SRC);

/// The fp8 kernels loaded into one rank's context.
#[derive(Debug, Clone)]
pub(crate) struct Fp8Kernels {
    join: CudaFunction,
    /// The weight-streaming kernel for up to 1, 2, 4 and 8 tokens.
    gemv: [CudaFunction; 4],
    /// The same over a table of products ([`fp8_gemv_table`]), and its bf16 twin.
    table: [CudaFunction; 4],
    bf16_table: [CudaFunction; 4],
    dequant: CudaFunction,
    /// W8A8 activation quantisation from split bf16 and from f32 rows ([`crate::w8a8`]; in
    /// the decoder's kernels, `kernels/decoder.cu`).
    pub(crate) quant_split: CudaFunction,
    pub(crate) quant_f32: CudaFunction,
    /// bf16 → f32 of a W8A8 product's bf16 output.
    pub(crate) widen: CudaFunction,
    /// A weight's block scales copied with their rows on 16 bytes.
    pub(crate) pad_scales: CudaFunction,
    /// The quantisations are launched early ([`crate::kernels::launches_early`]).
    pub(crate) early: bool,
}

impl Fp8Kernels {
    pub fn load(ctx: &RankCtx) -> Result<Self, CudaError> {
        let m = ctx.module(&FP8_DECODER_KERNELS)?;
        // the quantisation lives with the decoder's kernels, which fuse it into theirs
        let exact = ctx.module(&crate::kernels::DECODER_KERNELS)?;
        Ok(Fp8Kernels {
            join: m.function("fp8_join_split")?,
            gemv: [
                m.function("fp8_gemv_1")?,
                m.function("fp8_gemv_2")?,
                m.function("fp8_gemv_4")?,
                m.function("fp8_gemv_8")?,
            ],
            table: [
                m.function("fp8_gemv_table_1")?,
                m.function("fp8_gemv_table_2")?,
                m.function("fp8_gemv_table_4")?,
                m.function("fp8_gemv_table_8")?,
            ],
            bf16_table: [
                m.function("bf16_gemv_table_1")?,
                m.function("bf16_gemv_table_2")?,
                m.function("bf16_gemv_table_4")?,
                m.function("bf16_gemv_table_8")?,
            ],
            dequant: m.function("fp8_dequant_split")?,
            quant_split: exact.function("fp8_quant_split")?,
            quant_f32: exact.function("fp8_quant_f32")?,
            widen: m.function("fp8_widen_bf16")?,
            pad_scales: m.function("fp8_pad_scales")?,
            early: crate::kernels::launches_early(ctx, &crate::kernels::DECODER_KERNELS)?,
        })
    }
}

/// The split activations `xs` (bf16 `[2 · rows × inp]`, hi rows then lo rows) recombined into
/// f32 `x` (`[rows × inp]`).
///
/// # Safety
/// `xs` and `x` must be device memory of this context holding those sizes, alive until the
/// stream ran the kernel.
pub(crate) unsafe fn fp8_join(
    stream: &Arc<CudaStream>,
    k: &Fp8Kernels,
    (xs, x): (u64, u64),
    (rows, inp): (usize, usize),
    rank: usize,
) -> Result<(), CudaError> {
    let n = (rows * inp) as u64;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 1 << 12) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        Arg::U64(xs),
        Arg::U32(rows as u32),
        Arg::U32(inp as u32),
        Arg::U64(x),
    ];
    // SAFETY: the argument list matches fp8_join_split; the sizes per the caller.
    unsafe { launch(stream, &k.join, cfg, &args, rank, "fp8_join_split") }
}

/// `problems` weight-streaming products of `out` outputs each in one launch: `table` the device
/// address of `8 · problems` u64, per problem the weight matrix (e4m3, or bf16 with `bf16`), its
/// block scales (e4m3), its first row, its columns, the f32 activations, their rows (at most
/// `max_rows` ≤ [`GEMV_TOKENS`]; 0: the problem does nothing), and the f32 outputs of the hi
/// rows and of the lo rows (written 0). Each block computes 8 outputs per warp-row share: 8
/// outputs up to 2 rows, 32 from 4 (the kernel's `GV_RO`).
///
/// # Safety
/// Every address of the table must be device memory of this context holding its sizes, alive
/// until the stream ran the kernel.
pub(crate) unsafe fn fp8_gemv_table(
    stream: &Arc<CudaStream>,
    k: &Fp8Kernels,
    table: u64,
    (problems, out, max_rows): (usize, usize, usize),
    bf16: bool,
    rank: usize,
) -> Result<(), CudaError> {
    if max_rows == 0 || max_rows > GEMV_TOKENS || problems == 0 || problems > 65_535 {
        return Err(CudaError::Invalid(format!(
            "product table of {problems} problems of up to {max_rows} rows: at most 65535 \
             problems of 1 to {GEMV_TOKENS} rows"
        )));
    }
    let n = max_rows.next_power_of_two();
    // outputs per block: 8 warps of GV_RO(n) rows
    let per_block = 8 * if n <= 2 { 1 } else { 4 };
    let cfg = LaunchConfig {
        grid_dim: ((out as u32).div_ceil(per_block).max(1), problems as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let kernels = if bf16 { &k.bf16_table } else { &k.table };
    let kernel = &kernels[n.trailing_zeros() as usize];
    let args = [Arg::U64(table), Arg::U32(out as u32)];
    // SAFETY: the argument list matches fp8_gemv_table_N / bf16_gemv_table_N (N ≥ every
    // problem's rows); the table per the caller.
    unsafe { launch(stream, kernel, cfg, &args, rank, "gemv_table") }
}

/// Where an fp8 weight matrix lies: device addresses of its first e4m3 byte (row 0 of the
/// stored matrix) and of its block scales, the first row a product uses, and its columns.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fp8Weight {
    pub data: u64,
    pub scales: u64,
    pub row0: u64,
    pub cols: u64,
}

/// `y[rows × out] = x[rows × inp] · wᵀ` for fp8 `w` (rows `row0 .. row0 + out` of it, `inp`
/// its columns), bf16 split `x` (hi rows, then lo rows), f32 `y`: the weight-streaming kernel up
/// to [`GEMV_TOKENS`] tokens (through `scratch.x32`, at least `GEMV_TOKENS · inp` f32, which
/// with `joined` already holds `x` joined; the lo rows of `y` are written 0), else the
/// dequantised hi/lo GEMMs through `scratch.dequant` (at least `2 · out · inp` bf16).
///
/// # Safety
/// The addresses must be device memory of this context: `w` its matrix and scales (rows
/// `row0 + out` at least), `x` `rows · inp` bf16, `y` `rows · out` f32, `scratch` as said (with
/// `joined`, `x32` written from this `x` by an earlier product on this stream), all alive until
/// the stream ran the products.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn fp8_gemm(
    stream: &Arc<CudaStream>,
    blas: &CudaBlas,
    k: &Fp8Kernels,
    w: Fp8Weight,
    x: u64,
    y: u64,
    (out, rows, inp): (usize, usize, usize),
    (scratch, joined): (Fp8Scratch, bool),
    rank: usize,
) -> Result<(), CudaError> {
    let u32a = |v: u64, what: &str| {
        u32::try_from(v).map_err(|_| CudaError::Invalid(format!("fp8 GEMM {what} {v} > u32")))
    };
    if w.cols != inp as u64 {
        return Err(CudaError::Invalid(format!(
            "fp8 GEMM over {inp} inputs on a matrix of {} columns",
            w.cols
        )));
    }
    let (row0, outs, inps) = (
        u32a(w.row0, "row")?,
        u32a(out as u64, "rows")?,
        u32a(inp as u64, "columns")?,
    );
    let tokens = rows / 2;
    if rows % 2 == 0 && tokens <= GEMV_TOKENS {
        let x32 = scratch.x32.ok_or_else(|| {
            CudaError::Invalid("an fp8 product without its activation scratch".into())
        })?;
        // SAFETY: x holds 2 · tokens rows of inp bf16 and the activation scratch at least
        // tokens · inp f32 (sized at bind for the widest fp8 matrix); y 2 · tokens rows.
        return unsafe {
            if !joined {
                fp8_join(stream, k, (x, x32), (tokens, inp), rank)?;
            }
            fp8_gemv(stream, k, w, x32, y, (out, tokens, inp), rank)
        };
    }
    let scratch = scratch.dequant.ok_or_else(|| {
        CudaError::Invalid("an fp8 prefill product without its dequantisation scratch".into())
    })?;
    let n = out as u64 * inp as u64;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 1 << 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        Arg::U64(w.data),
        Arg::U64(w.scales),
        Arg::U32(row0),
        Arg::U32(outs),
        Arg::U32(inps),
        Arg::U64(scratch),
    ];
    // SAFETY: the argument list matches fp8_dequant_split; the scratch holds 2 · out · inp bf16.
    unsafe { launch(stream, &k.dequant, cfg, &args, rank, "fp8_dequant_split")? };
    // SAFETY: hi then lo, each out · inp bf16 in the scratch; x and y per the caller; the second
    // product accumulates into the first.
    unsafe {
        crate::blas::gemm_beta(blas, scratch, x, y, out, rows, inp, 0.0, rank)?;
        crate::blas::gemm_beta(blas, scratch + 2 * n, x, y, out, rows, inp, 1.0, rank)
    }
}

/// `y[tokens × out] = x32[tokens × inp] · wᵀ` by the weight-streaming kernel (`tokens` at most
/// [`GEMV_TOKENS`]), f32 `x32`; the `tokens` rows after `y`'s are written 0 (the lo rows of a
/// split product).
///
/// # Safety
/// The addresses must be device memory of this context: `w` its matrix and scales (rows
/// `row0 + out` at least), `x32` `tokens · inp` f32, `y` `2 · tokens · out` f32, alive until the
/// stream ran the kernel.
pub(crate) unsafe fn fp8_gemv(
    stream: &Arc<CudaStream>,
    k: &Fp8Kernels,
    w: Fp8Weight,
    x32: u64,
    y: u64,
    (out, tokens, inp): (usize, usize, usize),
    rank: usize,
) -> Result<(), CudaError> {
    let u32a = |v: u64, what: &str| {
        u32::try_from(v).map_err(|_| CudaError::Invalid(format!("fp8 product {what} {v} > u32")))
    };
    if tokens == 0 || tokens > GEMV_TOKENS || w.cols != inp as u64 {
        return Err(CudaError::Invalid(format!(
            "the fp8 weight-streaming kernel multiplies 1 to {GEMV_TOKENS} tokens over the \
             matrix's {} columns; asked for {tokens} tokens over {inp}",
            w.cols
        )));
    }
    let outs = u32a(out as u64, "rows")?;
    let cfg = LaunchConfig {
        grid_dim: (outs.div_ceil(4).max(1), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = [
        Arg::U64(w.data),
        Arg::U64(w.scales),
        Arg::U32(u32a(w.row0, "row")?),
        Arg::U32(outs),
        Arg::U32(u32a(inp as u64, "columns")?),
        Arg::U64(x32),
        Arg::U32(tokens as u32),
        Arg::U64(y),
    ];
    let gemv = &k.gemv[tokens.next_power_of_two().trailing_zeros() as usize];
    // SAFETY: the argument list matches fp8_gemv_N (N ≥ tokens); sizes per the caller.
    unsafe { launch(stream, gemv, cfg, &args, rank, "fp8_gemv") }
}
