//! Matrix products with fp8 rollout weights (block-scaled e4m3, [`lifecycle_layout::fp8`]): every
//! weight is read as `e4m3 × scale_inv` in f32, as the CPU decoder reads it.
//!
//! - Up to [`GEMV_ROWS`] product rows (decoding): one kernel reads each weight byte once,
//!   dequantises it in registers and accumulates all rows in f32: the weights cross device
//!   memory at one byte per element, half of bf16.
//! - More rows (prefill): the weights are dequantised into a scratch as two bf16 matrices,
//!   `hi = bf16(w)` and `lo = bf16(w − hi)`, and multiplied by cuBLAS as two accumulating GEMMs,
//!   so the product sees each weight to about 16 significant bits (the dequantised value has
//!   at most 28) instead of rounding it to bf16.

use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};
use lifecycle_cuda::{CudaError, KernelSet, RankCtx};

use crate::kernels::{launch, Arg};

/// Product rows up to which the weight-streaming kernel runs (split activations: twice the
/// tokens).
pub(crate) const GEMV_ROWS: usize = 16;

/// CUDA C source of the fp8 matrix kernels (no headers).
pub const FP8_DECODER_KERNEL_SRC: &str = r#"
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// The value of an e4m3 byte (0x7f / 0xff, NaN, never appear in a quantised rollout).
__device__ __forceinline__ float e4m3_val(u32 b) {
    u32 e = (b >> 3) & 15u, m = b & 7u;
    float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
    return (b & 0x80u) ? -v : v;
}

__device__ __forceinline__ float bf(u16 h) { return __uint_as_float(((u32)h) << 16); }

// round to nearest even
__device__ __forceinline__ u16 f2bf_rne(float f) {
    u32 x = __float_as_uint(f);
    return (u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// y[r * out + o] = sum_c x[r * inp + c] * w(row0 + o, c) for r < rows (<= 16): one warp per
// output o. w is row-major e4m3 [.. x inp] with one scale per 128 x 128 block (bc = ceil(inp /
// 128) per block row); x is bf16.
extern "C" __global__ void fp8_gemv(const unsigned char* __restrict__ w,
                                    const float* __restrict__ scales, u32 row0, u32 out, u32 inp,
                                    const u16* __restrict__ x, u32 rows, float* __restrict__ y) {
    u32 lane = threadIdx.x & 31u;
    u32 o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= out) return;
    u64 r = (u64)row0 + o;
    const unsigned char* wr = w + r * inp;
    const float* sr = scales + (r / 128) * ((inp + 127) / 128);
    float acc[16];
    #pragma unroll
    for (int k = 0; k < 16; ++k) acc[k] = 0.0f;
    if (inp % 16 == 0) {
        for (u32 c = 16 * lane; c < inp; c += 512) {
            uint4 q = *reinterpret_cast<const uint4*>(wr + c);
            float s = sr[c / 128];
            u32 words[4] = {q.x, q.y, q.z, q.w};
            float wv[16];
            #pragma unroll
            for (int k = 0; k < 16; ++k) wv[k] = e4m3_val((words[k / 4] >> (8 * (k % 4))) & 0xffu) * s;
            #pragma unroll
            for (int rr = 0; rr < 16; ++rr) {
                if (rr < rows) {
                    const uint4* xp = reinterpret_cast<const uint4*>(x + (u64)rr * inp + c);
                    uint4 a = xp[0], b = xp[1];
                    u32 xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                    float sum = acc[rr];
                    #pragma unroll
                    for (int k = 0; k < 16; ++k) {
                        u16 h = (u16)((xs[k / 2] >> (16 * (k % 2))) & 0xffffu);
                        sum = fmaf(wv[k], bf(h), sum);
                    }
                    acc[rr] = sum;
                }
            }
        }
    } else {
        for (u32 c = lane; c < inp; c += 32) {
            float wv = e4m3_val(wr[c]) * sr[c / 128];
            #pragma unroll
            for (int rr = 0; rr < 16; ++rr) {
                if (rr < rows) acc[rr] = fmaf(wv, bf(x[(u64)rr * inp + c]), acc[rr]);
            }
        }
    }
    #pragma unroll
    for (int rr = 0; rr < 16; ++rr) {
        float v = acc[rr];
        for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
        if (lane == 0 && rr < rows) y[(u64)rr * out + o] = v;
    }
}

// Rows row0 .. row0 + out of an e4m3 matrix [.. x inp] dequantised into hi (bf16 of the value)
// and lo (bf16 of the rest), each [out x inp] row-major, hi first in dst.
extern "C" __global__ void fp8_dequant_split(const unsigned char* __restrict__ w,
                                             const float* __restrict__ scales, u32 row0, u32 out,
                                             u32 inp, u16* __restrict__ dst) {
    u64 n = (u64)out * inp;
    u64 bc = (inp + 127) / 128;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 o = i / inp, c = i - o * inp;
        u64 r = row0 + o;
        float v = e4m3_val(w[r * inp + c]) * scales[(r / 128) * bc + c / 128];
        u16 hi = f2bf_rne(v);
        dst[i] = hi;
        dst[n + i] = f2bf_rne(v - bf(hi));
    }
}
"#;

/// [`FP8_DECODER_KERNEL_SRC`] as a kernel set.
pub const FP8_DECODER_KERNELS: KernelSet =
    KernelSet::new("lifecycle_decoder_gpu fp8 kernels", FP8_DECODER_KERNEL_SRC);

/// The fp8 kernels loaded into one rank's context.
#[derive(Debug, Clone)]
pub(crate) struct Fp8Kernels {
    gemv: CudaFunction,
    dequant: CudaFunction,
}

impl Fp8Kernels {
    pub fn load(ctx: &RankCtx) -> Result<Self, CudaError> {
        let m = ctx.module(&FP8_DECODER_KERNELS)?;
        Ok(Fp8Kernels {
            gemv: m.function("fp8_gemv")?,
            dequant: m.function("fp8_dequant_split")?,
        })
    }
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
/// its columns), bf16 `x`, f32 `y`: the weight-streaming kernel up to [`GEMV_ROWS`] rows, else
/// the dequantised hi/lo GEMMs through `scratch` (at least `2 · out · inp` bf16).
///
/// # Safety
/// The addresses must be device memory of this context: `w` its matrix and scales (rows
/// `row0 + out` at least), `x` `rows · inp` bf16, `y` `rows · out` f32, `scratch` as said, all
/// alive until the stream ran the products.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn fp8_gemm(
    stream: &Arc<CudaStream>,
    blas: &CudaBlas,
    k: &Fp8Kernels,
    w: Fp8Weight,
    x: u64,
    y: u64,
    (out, rows, inp): (usize, usize, usize),
    scratch: Option<u64>,
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
    if rows <= GEMV_ROWS {
        let cfg = LaunchConfig {
            grid_dim: (outs.div_ceil(8).max(1), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            Arg::U64(w.data),
            Arg::U64(w.scales),
            Arg::U32(row0),
            Arg::U32(outs),
            Arg::U32(inps),
            Arg::U64(x),
            Arg::U32(rows as u32),
            Arg::U64(y),
        ];
        // SAFETY: the argument list matches fp8_gemv; the addresses per the caller.
        return unsafe { launch(stream, &k.gemv, cfg, &args, rank, "fp8_gemv") };
    }
    let scratch = scratch.ok_or_else(|| {
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
        crate::decoder::gemm_beta(blas, scratch, x, y, out, rows, inp, 0.0, rank)?;
        crate::decoder::gemm_beta(blas, scratch + 2 * n, x, y, out, rows, inp, 1.0, rank)
    }
}
