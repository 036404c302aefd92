//! Every cuBLAS call of the GPU decoder: the handle, the bf16 × bf16 → f32 products of the
//! dense layers and the fp8 dequantised paths ([`gemm`], [`gemm_beta`]), and the batched
//! products of the mixture-of-experts blocks ([`batched_gemm`]). All in the row-major terms of
//! a PyTorch linear, `y[rows × out] = x[rows × inp] · wᵀ`, computed column-major.

use std::ffi::c_void;
use std::sync::Arc;

use lifecycle_cuda::cudarc::cublas::{result as cublas_result, sys as cublas_sys, CudaBlas};
use lifecycle_cuda::cudarc::driver::CudaStream;
use lifecycle_cuda::CudaError;

use crate::error::GpuDecodeError;

/// Whether the cuBLAS library can be loaded ([`GpuDecodeError::NoCublas`] when not).
pub(crate) fn require_cublas() -> Result<(), GpuDecodeError> {
    // SAFETY: only asks the dynamic loader whether the library can be opened.
    if !unsafe { cublas_sys::is_culib_present() } {
        return Err(GpuDecodeError::NoCublas);
    }
    Ok(())
}

/// A cuBLAS handle on `stream` for rank `rank`.
pub(crate) fn handle(stream: &Arc<CudaStream>, rank: usize) -> Result<CudaBlas, CudaError> {
    CudaBlas::new(stream.clone()).map_err(|e| cublas_err(rank, "creating a handle", e))
}

/// A cuBLAS failure as the engine's error, naming the rank and the call.
pub(crate) fn cublas_err(rank: usize, op: &str, e: cublas_result::CublasError) -> CudaError {
    CudaError::Driver {
        rank,
        op: format!("cuBLAS {op}"),
        detail: format!("{:?}", e.0),
    }
}

/// `y[2n × out] = x[2n × inp] · wᵀ` for a row-major bf16 `w[out × inp]` (a PyTorch linear) and
/// bf16 `x`, f32 accumulation and output.
///
/// # Safety
/// `w`, `x`, `y` must be device addresses of this handle's context holding at least
/// `out · inp` bf16, `rows · inp` bf16 and `rows · out` f32, alive until the stream ran the GEMM.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    blas: &CudaBlas,
    w: u64,
    x: u64,
    y: u64,
    out: usize,
    rows: usize,
    inp: usize,
    rank: usize,
) -> Result<(), CudaError> {
    // SAFETY: forwarded to the caller.
    unsafe { gemm_beta(blas, w, x, y, out, rows, inp, 0.0, rank) }
}

/// [`gemm`] adding `beta · y` to the product (`beta` 0 or 1 here).
///
/// # Safety
/// As [`gemm`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_beta(
    blas: &CudaBlas,
    w: u64,
    x: u64,
    y: u64,
    out: usize,
    rows: usize,
    inp: usize,
    beta: f32,
    rank: usize,
) -> Result<(), CudaError> {
    // SAFETY: forwarded to the caller (rows of y are `out` apart).
    unsafe { gemm_ld(blas, w, x, y, (out, rows, inp), out, beta, rank) }
}

/// [`gemm_beta`] into rows of `y` that lie `ldc` ≥ `out` f32 apart (a column block of a wider
/// output).
///
/// # Safety
/// As [`gemm`], `y` holding `(rows − 1) · ldc + out` f32.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_ld(
    blas: &CudaBlas,
    w: u64,
    x: u64,
    y: u64,
    (out, rows, inp): (usize, usize, usize),
    ldc: usize,
    beta: f32,
    rank: usize,
) -> Result<(), CudaError> {
    let alpha = 1.0f32;
    let dim = |v: usize| {
        i32::try_from(v).map_err(|_| CudaError::Invalid(format!("GEMM dimension {v} > i32::MAX")))
    };
    // SAFETY: column-major view: C[out × rows] = op(A) · B with A = w as a col-major
    // [inp × out] matrix (transposed), B = x as col-major [inp × rows]; sizes per the caller;
    // alpha/beta are host scalars (the handle's default pointer mode).
    unsafe {
        cublas_result::gemm_ex(
            *blas.handle(),
            cublas_sys::cublasOperation_t::CUBLAS_OP_T,
            cublas_sys::cublasOperation_t::CUBLAS_OP_N,
            dim(out)?,
            dim(rows)?,
            dim(inp)?,
            (&alpha as *const f32).cast::<c_void>(),
            w as *const c_void,
            cublas_sys::cudaDataType::CUDA_R_16BF,
            dim(inp)?,
            x as *const c_void,
            cublas_sys::cudaDataType::CUDA_R_16BF,
            dim(inp)?,
            (&beta as *const f32).cast::<c_void>(),
            y as *mut c_void,
            cublas_sys::cudaDataType::CUDA_R_32F,
            dim(ldc)?,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| cublas_err(rank, "GemmEx (bf16 x bf16 -> f32)", e))
}

/// One batched GEMM of `count` problems of one size, each `C[rows × out] = B[rows × inp] · Aᵀ`
/// in row-major terms, A a bf16 `[out × inp]` weight, B bf16 activations, C f32; `arrays` the
/// device addresses of the A, B and C pointer arrays (`count` entries each).
///
/// # Safety
/// Every pointer of the arrays must address a matrix of the sizes given, alive until the
/// products ran on the handle's stream.
pub(crate) unsafe fn batched_gemm(
    blas: &CudaBlas,
    (a, b, c): (u64, u64, u64),
    (out, rows, inp): (usize, usize, usize),
    count: usize,
    rank: usize,
) -> Result<(), CudaError> {
    let dim = |v: usize| {
        i32::try_from(v).map_err(|_| CudaError::Invalid(format!("GEMM dimension {v} > i32::MAX")))
    };
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: column-major view as in `gemm`: C[out × rows] = op(A) · B with A col-major
    // [inp × out] (transposed), B col-major [inp × rows]; alpha/beta are host scalars; the
    // pointer arrays are device memory per the caller.
    let status = unsafe {
        cublas_sys::cublasGemmBatchedEx(
            *blas.handle(),
            cublas_sys::cublasOperation_t::CUBLAS_OP_T,
            cublas_sys::cublasOperation_t::CUBLAS_OP_N,
            dim(out)?,
            dim(rows)?,
            dim(inp)?,
            (&alpha as *const f32).cast::<c_void>(),
            a as *const *const c_void,
            cublas_sys::cudaDataType::CUDA_R_16BF,
            dim(inp)?,
            b as *const *const c_void,
            cublas_sys::cudaDataType::CUDA_R_16BF,
            dim(inp)?,
            (&beta as *const f32).cast::<c_void>(),
            c as *const *mut c_void,
            cublas_sys::cudaDataType::CUDA_R_32F,
            dim(out)?,
            dim(count)?,
            cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    status
        .result()
        .map_err(|e| cublas_err(rank, "GemmBatchedEx (bf16 x bf16 -> f32)", e))
}
