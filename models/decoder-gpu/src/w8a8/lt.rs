//! cuBLASLt's block-scaled fp8 GEMM (`CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F` weights,
//! `CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F` activations, f32 accumulation and output): one
//! rank's handle, workspace and plans, and the tensor-core kernel of [`super::mma`] beside them.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lifecycle_cuda::cudarc::cublas::sys::cublasOperation_t;
use lifecycle_cuda::cudarc::cublaslt::{result as lt, sys as lt_sys};
use lifecycle_cuda::cudarc::driver::{result as drv, CudaSlice, CudaStream, LaunchConfig};
use lifecycle_cuda::{alloc_device, CudaError, RankCtx};

use super::mma::MmaKernels;
use super::quant::padded_tokens;
use crate::fp8::{Fp8Kernels, Fp8Weight};
use crate::kernels::{launch, refuse_in_capture, Arg};

/// The identity the next [`W8a8Gemm`] gets.
static NEXT_GEMM: AtomicU64 = AtomicU64::new(0);

/// Bytes of the cuBLASLt workspace of a rank (NVIDIA's recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Plans kept per rank before the cache starts over (one per product shape: decode batches
/// shrink as sequences finish, prefills come in any length).
const MAX_PLANS: usize = 512;

/// Whether cuBLASLt's block-scaled GEMM can read `w` as stored: its first row on a 128-row
/// block boundary (the scales of its blocks are then rows of the stored grid), its columns a
/// multiple of 16 (fp8 tensor-core operands), its bytes on 16-byte boundaries.
pub(crate) fn lt_reads(w: &Fp8Weight) -> bool {
    w.row0.is_multiple_of(128)
        && w.cols.is_multiple_of(16)
        && w.data.is_multiple_of(16)
        && w.scales.is_multiple_of(16)
}

/// One product shape's cuBLASLt objects and chosen algorithm.
struct Plan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    /// A, B, and C = D.
    layouts: [lt_sys::cublasLtMatrixLayout_t; 3],
    algo: lt_sys::cublasLtMatmulAlgo_t,
    /// Whether D is bf16 (where cuBLASLt has no f32 output for this product): written into
    /// the lo half of the split output, then widened into the hi half.
    out_bf16: bool,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by this plan and destroyed once, here; a failure cannot be reported
        // from drop and leaves nothing to clean up.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
}

/// A rank's block-scaled fp8 products: cuBLASLt's GEMM (handle, workspace and plans) and the
/// tensor-core kernel of [`super::mma`] for few tokens.
pub(crate) struct W8a8Gemm {
    /// The tensor-core kernel, `None` on a device without e4m3 mma instructions.
    pub(crate) mma: Option<MmaKernels>,
    handle: lt_sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    /// The block scales of a weight whose rows of scales do not start on 16 bytes (blocks per
    /// row not a multiple of 4), copied padded before its product; grown as needed.
    padded: Mutex<Option<CudaSlice<f32>>>,
    plans: Mutex<HashMap<(usize, usize, usize), Plan>>,
    /// Unique in the process, and how often `padded` grew.
    id: u64,
    grown: AtomicU64,
}

// SAFETY: the handle and the plans' descriptors are used only by the thread that holds the
// rank's state (the plans behind a mutex); cuBLASLt handles may move between threads.
unsafe impl Send for W8a8Gemm {}
// SAFETY: as Send: every use of a descriptor goes through the mutex.
unsafe impl Sync for W8a8Gemm {}

impl Drop for W8a8Gemm {
    fn drop(&mut self) {
        if let Ok(plans) = self.plans.get_mut() {
            plans.clear();
        }
        // SAFETY: the handle was created by `new` and is destroyed once; its plans are gone.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

fn lt_err(rank: usize, op: &str, e: lt::CublasError) -> CudaError {
    CudaError::Driver {
        rank,
        op: format!("cuBLASLt {op}"),
        detail: format!("{:?}", e.0),
    }
}

/// Sets one attribute of a matmul descriptor from a plain value.
///
/// # Safety
/// `desc` must be alive and `T` the attribute's C type.
unsafe fn set_attr<T>(
    desc: lt_sys::cublasLtMatmulDesc_t,
    attr: lt_sys::cublasLtMatmulDescAttributes_t,
    v: &T,
    rank: usize,
) -> Result<(), CudaError> {
    // SAFETY: `v` is a live value of the attribute's type, its size passed along.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            (v as *const T).cast::<c_void>(),
            std::mem::size_of::<T>(),
        )
    }
    .map_err(|e| lt_err(rank, "setting a matmul attribute", e))
}

impl W8a8Gemm {
    /// A handle and a workspace on this rank, or a clear error when the library is missing.
    pub(crate) fn new(ctx: &RankCtx) -> Result<Self, CudaError> {
        // SAFETY: only asks the dynamic loader whether the library can be opened.
        if !unsafe { lt_sys::is_culib_present() } {
            return Err(CudaError::Invalid(
                "W8A8 fp8 needs cuBLASLt (libcublasLt.so.13), which the dynamic loader did not \
                 find: install the CUDA 13 cuBLAS libraries or use --fp8-compute weight-only"
                    .into(),
            ));
        }
        let handle = lt::create_handle().map_err(|e| lt_err(ctx.rank, "creating a handle", e))?;
        // SAFETY: the workspace is scratch cuBLASLt writes before it reads.
        let workspace = match unsafe {
            alloc_device::<u8>(
                &ctx.compute,
                WORKSPACE_BYTES,
                ctx.rank,
                "the cuBLASLt workspace",
            )
        } {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: created just above, destroyed once.
                let _ = unsafe { lt::destroy_handle(handle) };
                return Err(e);
            }
        };
        let mma = match MmaKernels::load(ctx) {
            Ok(m) => m,
            Err(e) => {
                // SAFETY: created just above, destroyed once.
                let _ = unsafe { lt::destroy_handle(handle) };
                return Err(e);
            }
        };
        Ok(W8a8Gemm {
            mma,
            handle,
            workspace,
            plans: Mutex::new(HashMap::new()),
            padded: Mutex::new(None),
            id: NEXT_GEMM.fetch_add(1, Ordering::Relaxed),
            grown: AtomicU64::new(0),
        })
    }

    /// This GEMM's identity and how often its scratch (here and in its tensor-core kernels)
    /// grew: a graph captured with an earlier version may read freed scratch.
    pub(crate) fn version(&self) -> (u64, u64) {
        let mma = self.mma.as_ref().map_or(0, MmaKernels::grown);
        (
            self.id,
            self.grown.load(Ordering::Relaxed).wrapping_add(mma),
        )
    }

    /// A plan for `out × tokens × inp` (descriptors and heuristic) with f32 output, or bf16
    /// where cuBLASLt offers no f32 one; `scales` the scale pointers the heuristic sees (it
    /// refuses a block-scaled query without them).
    fn plan(
        &self,
        (out, tokens, inp): (usize, usize, usize),
        scales: (*const c_void, *const c_void),
        rank: usize,
    ) -> Result<Plan, CudaError> {
        use lt_sys::cublasLtMatmulDescAttributes_t as A;
        let f32t = lt_sys::cudaDataType::CUDA_R_32F;
        let e4m3 = lt_sys::cudaDataType::CUDA_R_8F_E4M3;
        let desc = lt::create_matmul_desc(lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32t)
            .map_err(|e| lt_err(rank, "creating a matmul descriptor", e))?;
        let mut plan = Plan {
            desc,
            layouts: [std::ptr::null_mut(); 3],
            // SAFETY: a plain C struct of integers, filled by the heuristic below.
            algo: unsafe { std::mem::zeroed() },
            out_bf16: false,
        };
        let layout = |t, rows: usize, cols: usize| {
            lt::create_matrix_layout(t, rows as u64, cols as u64, rows as i64)
                .map_err(|e| lt_err(rank, "creating a matrix layout", e))
        };
        // column-major: D[out × tokens] = Aᵀ · B with A the row-major weights read as
        // [inp × out] (ld inp), B the row-major activations read as [inp × tokens]
        plan.layouts[0] = layout(e4m3, inp, out)?;
        let tokens = padded_tokens(tokens);
        plan.layouts[1] = layout(e4m3, inp, tokens)?;
        plan.layouts[2] = layout(f32t, out, tokens)?;
        let (ta, tb) = (
            cublasOperation_t::CUBLAS_OP_T as i32,
            cublasOperation_t::CUBLAS_OP_N as i32,
        );
        let blk =
            lt_sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F as i32;
        let vec =
            lt_sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F as i32;
        // SAFETY: each value has its attribute's C type (enums as int32, pointers as void*).
        unsafe {
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &ta, rank)?;
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &tb, rank)?;
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &blk, rank)?;
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec, rank)?;
            set_attr(
                desc,
                A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                &scales.0,
                rank,
            )?;
            set_attr(
                desc,
                A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                &scales.1,
                rank,
            )?;
        }
        let pref =
            lt::create_matmul_pref().map_err(|e| lt_err(rank, "creating a preference", e))?;
        let ws = WORKSPACE_BYTES as u64;
        // SAFETY: the preference is alive; the attribute is a u64.
        let set = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        // SAFETY: every descriptor is alive and describes this product.
        let (la, lb) = (plan.layouts[0], plan.layouts[1]);
        let handle = self.handle;
        // the heuristic's first algorithm (not the fastest of several timed: a choice by
        // timing could differ from run to run, and with it the products' rounding)
        // SAFETY: every descriptor is alive and describes this product.
        let ask = |d| unsafe { lt::get_matmul_algo_heuristic(handle, desc, la, lb, d, d, pref) };
        let mut found = set.and_then(|()| ask(plan.layouts[2]));
        let mut why = String::new();
        if let Err(e) = &found {
            // no f32 output for this product: bf16, widened afterwards
            why = format!("f32 output: {:?}; ", e.0);
            let bf = layout(lt_sys::cudaDataType::CUDA_R_16BF, out, tokens)?;
            // SAFETY: the f32 layout is replaced, destroyed once.
            let _ = unsafe { lt::destroy_matrix_layout(plan.layouts[2]) };
            plan.layouts[2] = bf;
            plan.out_bf16 = true;
            found = ask(bf);
        }
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let found = found.map_err(|e| CudaError::Driver {
            rank,
            op: format!(
                "cuBLASLt choosing a block-scaled fp8 GEMM for {out} outputs × {tokens} \
                     tokens × {inp} inputs"
            ),
            detail: format!("{why}bf16 output: {:?}", e.0),
        })?;
        plan.algo = found.algo;
        Ok(plan)
    }

    /// `y[tokens × out] = dequant(xq) · dequant(w)ᵀ` in f32 for at least 2 tokens: `xq` the
    /// e4m3 activations (`[padded_tokens(tokens) × inp]`, the padding zero) with scales at
    /// [`ActLayout::Rows`](super::ActLayout::Rows)'s strides, `w` rows `row0 .. row0 + out` of a block-scaled e4m3 matrix
    /// ([`lt_reads`] must hold). The `tokens · out` f32 after the result are scratch: the
    /// padded tokens' zeros land there, or a bf16 output first, then zeros.
    ///
    /// # Safety
    /// The addresses must be device memory of this context: `w` its matrix and scales, `xq` and
    /// `xsc` as said, `y` `2 · tokens · out` f32, alive until the stream ran the product.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gemm(
        &self,
        stream: &Arc<CudaStream>,
        k: &Fp8Kernels,
        w: Fp8Weight,
        (xq, xsc): (u64, u64),
        y: u64,
        (out, tokens, inp): (usize, usize, usize),
        rank: usize,
    ) -> Result<(), CudaError> {
        use lt_sys::cublasLtMatmulDescAttributes_t as A;
        if tokens < 2 {
            return Err(CudaError::Invalid(format!(
                "a block-scaled fp8 GEMM of {tokens} token: it takes 2 or more (1 goes to the \
                 weight-streaming kernel)"
            )));
        }
        if !lt_reads(&w) || w.cols != inp as u64 {
            return Err(CudaError::Invalid(format!(
                "a block-scaled fp8 GEMM reads rows from a multiple of 128, columns a multiple \
                 of 16 and 16-byte aligned data; found rows from {}, {} columns ({inp} inputs)",
                w.row0, w.cols
            )));
        }
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| CudaError::Invalid("the W8A8 plan cache was poisoned".into()))?;
        let bc = w.cols.div_ceil(128);
        let a = w.data + w.row0 * w.cols;
        let mut a_scales = w.scales + 4 * (w.row0 / 128) * bc;
        let mut padded = self
            .padded
            .lock()
            .map_err(|_| CudaError::Invalid("the W8A8 scale scratch was poisoned".into()))?;
        if !bc.is_multiple_of(4) {
            // cuBLASLt reads the rows of a weight's scales from 16-byte boundaries
            let (rows, ld) = (out.div_ceil(128), bc.next_multiple_of(4));
            let need = rows * ld as usize;
            if padded.as_ref().is_none_or(|p| p.len() < need) {
                refuse_in_capture(stream, rank, "growing the padded W8A8 weight scales")?;
                self.grown.fetch_add(1, Ordering::Relaxed);
                // SAFETY: written whole by the copy below before the GEMM reads it.
                *padded = Some(unsafe {
                    alloc_device::<f32>(stream, need, rank, "padded W8A8 weight scales")?
                });
            }
            let dst = padded
                .as_ref()
                .map(|p| {
                    use lifecycle_cuda::cudarc::driver::DevicePtr;
                    p.device_ptr(stream).0
                })
                .ok_or_else(|| CudaError::Invalid("no padded scale scratch".into()))?;
            let cfg = LaunchConfig {
                grid_dim: ((need as u64).div_ceil(256).clamp(1, 1 << 16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let args = [
                Arg::U64(a_scales),
                Arg::U64(dst),
                Arg::U32(rows as u32),
                Arg::U32(bc as u32),
                Arg::U32(ld as u32),
            ];
            // SAFETY: the source holds the rows × bc scales of the product's block rows (the
            // caller's matrix), the scratch rows × ld f32.
            unsafe { launch(stream, &k.pad_scales, cfg, &args, rank, "fp8_pad_scales")? };
            a_scales = dst;
        }
        let (pa, pb) = (a_scales as *const c_void, xsc as *const c_void);
        let key = (out, tokens, inp);
        if !plans.contains_key(&key) {
            if plans.len() >= MAX_PLANS {
                plans.clear();
            }
            let plan = self.plan(key, (pa, pb), rank)?;
            plans.insert(key, plan);
        }
        let plan = plans
            .get(&key)
            .ok_or_else(|| CudaError::Invalid("a W8A8 plan vanished from its cache".into()))?;
        // a bf16 output goes to the second half of y (tokens · out f32 hold twice its bytes)
        let d = if plan.out_bf16 {
            y + 4 * (tokens * out) as u64
        } else {
            y
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (ws, _) = {
            use lifecycle_cuda::cudarc::driver::DevicePtr;
            self.workspace.device_ptr(stream)
        };
        // SAFETY: the scale pointers are device addresses per the caller.
        unsafe {
            set_attr(
                plan.desc,
                A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                &pa,
                rank,
            )?;
            set_attr(
                plan.desc,
                A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                &pb,
                rank,
            )?;
        }
        // SAFETY: the plan describes this shape; A, B, D and the workspace are device memory of
        // this context of the sizes the layouts state; queued on `stream`.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                a as *const c_void,
                plan.layouts[0],
                xq as *const c_void,
                plan.layouts[1],
                d as *const c_void,
                plan.layouts[2],
                d as *mut c_void,
                plan.layouts[2],
                &plan.algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as lt_sys::cudaStream_t,
            )
        }
        .map_err(|e| {
            lt_err(
                rank,
                &format!("block-scaled fp8 GEMM of {out} outputs × {tokens} tokens × {inp} inputs"),
                e,
            )
        })?;
        if !plan.out_bf16 {
            return Ok(());
        }
        let n = (tokens * out) as u64;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 1 << 16) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [Arg::U64(d), Arg::U64(y), Arg::U64(n)];
        // SAFETY: d holds the tokens · out bf16 the GEMM wrote (the second half of y), y's first
        // half takes them widened: the two do not overlap; then the second half is zeroed.
        unsafe {
            launch(stream, &k.widen, cfg, &args, rank, "fp8_widen_bf16")?;
            drv::memset_d8_async(d, 0, 4 * tokens * out, stream.cu_stream()).map_err(|e| {
                CudaError::Driver {
                    rank,
                    op: "zeroing the lo rows of a W8A8 product".into(),
                    detail: format!("{e:?}"),
                }
            })
        }
    }
}
