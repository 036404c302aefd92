//! W8A8 block fp8 products ([`Fp8Compute::W8A8`]), as vLLM's `W8A8BlockFp8LinearOp` runs them:
//! the activations are quantised on the device per token in 1 × 128 groups (one f32 scale each,
//! [`quantize_activation_groups`]'s formula), then multiplied with the block-scaled e4m3 weights.
//!
//! - Up to the weight-streaming threshold ([`W8A8_GEMV_TOKENS`] by default,
//!   `GpuDecoder::set_fp8_gemv_tokens`): the
//!   quantised activations are dequantised into f32 (`e4m3 × scale`, exact) and the fp8 weight
//!   streaming kernel multiplies them: the same products, each weight byte read once.
//! - Then up to [`W8A8_MMA_TOKENS`] tokens by default (`GpuDecoder::set_fp8_mma_tokens`): the
//!   decoder's tensor-core kernel ([`crate::w8a8_mma`]), each weight byte read once.
//! - More tokens: cuBLASLt's tensor-core fp8 GEMM with block scales
//!   (`CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F` for the weights,
//!   `CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F` for the activations, f32 accumulation and output).
//!
//! [`Fp8Compute::W8A8`]: lifecycle_layout::fp8::Fp8Compute::W8A8
//! [`quantize_activation_groups`]: lifecycle_layout::fp8::quantize_activation_groups

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use lifecycle_cuda::cudarc::cublas::sys::cublasOperation_t;
use lifecycle_cuda::cudarc::cublaslt::{result as lt, sys as lt_sys};
use lifecycle_cuda::cudarc::driver::{result as drv, CudaSlice, CudaStream, LaunchConfig};
use lifecycle_cuda::{alloc_device, CudaError, RankCtx};

use crate::fp8::{fp8_gemv, Fp8Kernels, Fp8Weight, GEMV_TOKENS};
use crate::kernels::{launch, Arg};
use crate::w8a8_mma::{mma_reads, MmaKernels, MMA_TOKENS};

/// Tokens up to which a W8A8 product takes the weight-streaming kernel by default: none (on an
/// H200 at 7.6B shapes the tensor-core kernel is as fast for one token and faster from two).
pub(crate) const W8A8_GEMV_TOKENS: usize = 0;

/// Tokens up to which a W8A8 product takes the tensor-core kernel by default (on an H200 at
/// 7.6B shapes cuBLASLt's block-scaled GEMM is faster from 16 tokens; BENCHMARKS.md).
pub(crate) const W8A8_MMA_TOKENS: usize = 8;

/// Bytes of the cuBLASLt workspace of a rank (NVIDIA's recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Plans kept per rank before the cache starts over (one per product shape: decode batches
/// shrink as sequences finish, prefills come in any length).
const MAX_PLANS: usize = 512;

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

/// Whether cuBLASLt's block-scaled GEMM can read `w` as stored: its first row on a 128-row
/// block boundary (the scales of its blocks are then rows of the stored grid), its columns a
/// multiple of 16 (fp8 tensor-core operands), its bytes on 16-byte boundaries.
pub(crate) fn lt_reads(w: &Fp8Weight) -> bool {
    w.row0.is_multiple_of(128)
        && w.cols.is_multiple_of(16)
        && w.data.is_multiple_of(16)
        && w.scales.is_multiple_of(16)
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
/// tensor-core kernel of [`crate::w8a8_mma`] for few tokens.
pub(crate) struct W8a8Gemm {
    /// The tensor-core kernel, `None` on a device without e4m3 mma instructions.
    pub(crate) mma: Option<MmaKernels>,
    handle: lt_sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    /// The block scales of a weight whose rows of scales do not start on 16 bytes (blocks per
    /// row not a multiple of 4), copied padded before its product; grown as needed.
    padded: Mutex<Option<CudaSlice<f32>>>,
    plans: Mutex<HashMap<(usize, usize, usize), Plan>>,
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
        })
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
    /// [`act_scale_strides`], `w` rows `row0 .. row0 + out` of a block-scaled e4m3 matrix
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

/// Token counts that choose a W8A8 product's path ([`w8a8_gemm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct W8a8Limits {
    /// Up to these tokens (0 to [`GEMV_TOKENS`]) the weight-streaming kernel, on the
    /// dequantised quantised activations.
    pub gemv: usize,
    /// Then up to these (0 to [`MMA_TOKENS`]) the tensor-core kernel of [`crate::w8a8_mma`];
    /// beyond, cuBLASLt's block-scaled GEMM.
    pub mma: usize,
}

impl Default for W8a8Limits {
    fn default() -> Self {
        W8a8Limits {
            gemv: W8A8_GEMV_TOKENS,
            mma: W8A8_MMA_TOKENS,
        }
    }
}

/// The scratch a W8A8 product works through.
#[derive(Clone, Copy)]
pub(crate) struct W8a8Through<'a> {
    /// f32 activations of the weight-streaming kernel (at least `GEMV_TOKENS · inp`).
    pub x32: Option<u64>,
    /// The pass's quantised activations and their scales ([`W8a8Scratch`]).
    pub act: Option<(u64, u64, &'a Cell<bool>)>,
    /// Whether the input is the previous product's (q, k and v; gate and up): its quantisation,
    /// where a product left it in `act`, is used again.
    pub same_input: bool,
}

/// `y[rows × out] = x[rows × inp] · wᵀ` in W8A8 for split bf16 `x` (hi rows, then lo rows) and
/// f32 `y` (its lo rows written 0): the activations quantised per token group (once per input:
/// [`W8a8Through::same_input`]), then, by `limits`, the weight-streaming kernel on their
/// dequantised values, the tensor-core kernel or the block-scaled GEMM. A single token the
/// tensor-core kernel cannot take goes to the weight-streaming kernel whatever the limits
/// (cuBLASLt's GEMM takes two or more).
///
/// # Safety
/// As [`crate::fp8::fp8_gemm`], and `through.act` holding `rows / 2` tokens of `inp` inputs.
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
    limits: W8a8Limits,
    rank: usize,
) -> Result<(), CudaError> {
    let tokens = rows / 2;
    if !rows.is_multiple_of(2) {
        return Err(CudaError::Invalid(format!(
            "a W8A8 product over {rows} split rows (hi and lo rows come in pairs)"
        )));
    }
    if let (Some((_, _, held)), false) = (through.act, through.same_input) {
        held.set(false);
    }
    // the tensor-core kernel up to its limit, and for any product it can take that cuBLASLt
    // cannot read (rows not from a block of scales)
    let mma = lt_gemm.mma.as_ref().filter(|_| {
        tokens <= MMA_TOKENS
            && mma_reads(&w, inp)
            && (tokens <= limits.mma || !lt_reads(&w) || tokens < 2)
    });
    let gemv = tokens <= limits.gemv.min(GEMV_TOKENS) || (tokens < 2 && mma.is_none());
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
            fp8_gemv(stream, k, w, x32, y, (out, tokens, inp), rank)
        };
    }
    let (xq, xsc, held) = through.act.ok_or_else(|| {
        CudaError::Invalid("a W8A8 product without its quantised-activation scratch".into())
    })?;
    let lo = y + 4 * (tokens * out) as u64;
    if !(mma.is_some() && through.same_input && held.get()) {
        let q = QuantOut {
            q: Some(xq),
            scales: Some((xsc, act_scale_strides(tokens))),
            deq: None,
            // the tensor-core kernel writes the lo rows itself
            zero: mma.is_none().then_some((lo, (tokens * out) as u64)),
        };
        // SAFETY: x holds 2 · tokens rows of inp bf16, the scratch padded_tokens(tokens) · inp
        // bytes and as many groups of scales; y 2 · tokens rows of out f32 (the second half
        // zeroed by the quantisation for the GEMM, the padded tokens' zero products landing
        // there).
        unsafe {
            quantize(
                stream,
                k,
                ActSrc::Split(x),
                (tokens, padded_tokens(tokens), inp),
                q,
                rank,
            )?
        };
        held.set(true);
    }
    // SAFETY: the scratch holds this input's quantisation (written above or by the previous
    // product of the same input); y 2 · tokens rows of out f32.
    unsafe {
        match mma {
            Some(m) => m.gemm(
                stream,
                w,
                (xq, xsc, padded_tokens(tokens)),
                (y, true),
                (out, tokens, inp),
                rank,
            ),
            None => lt_gemm.gemm(stream, k, w, (xq, xsc), y, (out, tokens, inp), rank),
        }
    }
}

#[cfg(test)]
mod tests {
    //! On the GPU (`cargo test --release -p lifecycle-decoder-gpu --lib w8a8 -- --ignored
    //! --nocapture`): the device quantisation against [`quantize_activation_groups`] bit for
    //! bit, and the block-scaled GEMM (and the weight-streaming W8A8 path) against the same sums
    //! in f64 on the host.
    use super::*;
    use half::bf16;
    use lifecycle_cuda::testing::require_gpus;
    use lifecycle_cuda::{RankExecutor, ThreadRankPool};
    use lifecycle_layout::fp8::{e4m3_to_f32, quantize_activation_groups, quantize_blocks};

    fn ptr<T>(b: &CudaSlice<T>, s: &Arc<CudaStream>) -> u64 {
        use lifecycle_cuda::cudarc::driver::DevicePtr;
        b.device_ptr(s).0
    }

    /// Deterministic values in ±1 with a magnitude that changes per 128 × 128 block.
    fn values(n: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                let block = (i / cols / 128) * 7 + (i % cols) / 128;
                u * (0.25 + (block % 5) as f32)
            })
            .collect()
    }

    /// The split rows of `x` (hi rows, then lo rows) and their sums in f32.
    fn split(x: &[f32]) -> (Vec<u16>, Vec<f32>) {
        let hi: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let lo: Vec<bf16> = x
            .iter()
            .zip(&hi)
            .map(|(&v, h)| bf16::from_f32(v - h.to_f32()))
            .collect();
        let joined = hi
            .iter()
            .zip(&lo)
            .map(|(h, l)| h.to_f32() + l.to_f32())
            .collect();
        let bits = hi.iter().chain(&lo).map(|v| v.to_bits()).collect();
        (bits, joined)
    }

    /// The products' bound against the f64 sums, relative to Σ|terms|: Hopper's fp8 tensor
    /// cores accumulate each 128-wide group to less than f32's precision before the scales
    /// apply (measured up to 1.1e-4, on 512 × 200 × 768).
    const TOLERANCE: f64 = 5e-4;

    /// Runs the tensor-core kernel on `weight` and the quantised activations, twice (the
    /// counters of a split product must come back to zero: the second run gives the same bits).
    #[allow(clippy::too_many_arguments)]
    fn mma_twice(
        s: &Arc<CudaStream>,
        m: &MmaKernels,
        weight: Fp8Weight,
        (qd, scd, pad): (u64, u64, usize),
        yd: &CudaSlice<f32>,
        (out, tokens, inp): (usize, usize, usize),
        ctx: &RankCtx,
    ) -> Result<Vec<f32>, CudaError> {
        let mut runs = Vec::new();
        for _ in 0..2 {
            // SAFETY: the buffers hold the sizes the product reads and writes (the caller's).
            unsafe {
                m.gemm(
                    s,
                    weight,
                    (qd, scd, pad),
                    (ptr(yd, s), false),
                    (out, tokens, inp),
                    0,
                )?
            };
            runs.push(s.clone_dtoh(yd).map_err(ctx.drv("y back", 0))?);
        }
        let (a, b) = (&runs[0][..tokens * out], &runs[1][..tokens * out]);
        if a.iter().zip(b).any(|(x, y)| x.to_bits() != y.to_bits()) {
            return Err(CudaError::Invalid(format!(
                "{out}x{tokens}x{inp}: the tensor-core kernel gave other bits on its second run"
            )));
        }
        Ok(runs.swap_remove(0))
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn block_scaled_gemm_matches_the_host_sums() -> Result<(), Box<dyn std::error::Error>> {
        require_gpus(1)?;
        let pool = ThreadRankPool::new(1)?;
        // (rows, tokens, inputs, first row): the first row of a tensor-parallel shard need not
        // start a block of scales (cuBLASLt's GEMM then does not take it)
        let shapes = [
            (256, 16, 512, 0),
            (384, 9, 640, 0),
            (128, 12, 256, 0),
            (4096, 64, 3584, 0),
            (512, 200, 768, 0),
            (3584, 33, 18944, 0),
            (256, 1, 512, 0),
            (256, 3, 512, 0),
            (256, 5, 512, 0),
            (200, 7, 384, 144),
            (1000, 41, 1152, 16),
            (4608, 8, 3584, 0),
        ];
        let report = pool.run(&|ctx| {
            let s = &ctx.compute;
            let k = Fp8Kernels::load(ctx)?;
            let lt = W8a8Gemm::new(ctx)?;
            let mut lines = Vec::new();
            for (i, &(out, tokens, inp, row0)) in shapes.iter().enumerate() {
                let rows = row0 + out;
                let w = values(rows * inp, inp, 11 + i as u64);
                let wq = quantize_blocks("w", &w, rows, inp)
                    .map_err(|e| CudaError::Invalid(e.to_string()))?;
                let x = values(tokens * inp, inp, 101 + i as u64);
                let (xs, joined) = split(&x);
                let qx = quantize_activation_groups(&joined, inp);
                let groups = qx.groups();
                let up = |what: &str| ctx.drv(what, 0);
                let wd = s.clone_htod(wq.data()).map_err(up("weights"))?;
                let wsd = s.clone_htod(wq.scale_inv()).map_err(up("weight scales"))?;
                let xd = s.clone_htod(&xs).map_err(up("activations"))?;
                let pad = padded_tokens(tokens);
                // SAFETY: each buffer is written below before it is read back.
                let (qd, scd, mut yd, x32) = unsafe {
                    (
                        alloc_device::<u8>(s, pad * inp, 0, "q")?,
                        alloc_device::<f32>(s, pad * groups, 0, "scales")?,
                        alloc_device::<f32>(s, 2 * tokens * out, 0, "y")?,
                        alloc_device::<f32>(s, GEMV_TOKENS * inp, 0, "x32")?,
                    )
                };
                let weight = Fp8Weight {
                    data: ptr(&wd, s),
                    scales: ptr(&wsd, s),
                    row0: row0 as u64,
                    cols: inp as u64,
                };
                let strides = act_scale_strides(tokens);
                let q = QuantOut {
                    q: Some(ptr(&qd, s)),
                    scales: Some((ptr(&scd, s), strides)),
                    deq: None,
                    zero: None,
                };
                // SAFETY: the buffers above hold the sizes each call reads and writes.
                unsafe {
                    let src = ActSrc::Split(ptr(&xd, s));
                    quantize(s, &k, src, (tokens, pad, inp), q, 0)?;
                }
                let got_q = s.clone_dtoh(&qd).map_err(up("q back"))?;
                let got_sc = s.clone_dtoh(&scd).map_err(up("scales back"))?;
                if got_q[..tokens * inp] != qx.data[..]
                    || got_q[tokens * inp..].iter().any(|&b| b != 0)
                {
                    return Err(CudaError::Invalid(format!(
                        "{out}x{tokens}x{inp}: the device's e4m3 activations differ from the host's"
                    )));
                }
                for t in 0..tokens {
                    for g in 0..groups {
                        let at = t * strides.0 as usize + g * strides.1 as usize;
                        if got_sc[at].to_bits() != qx.scale_inv[t * groups + g].to_bits() {
                            return Err(CudaError::Invalid(format!(
                                "{out}x{tokens}x{inp}: scale of token {t} group {g}: {} vs {}",
                                got_sc[at],
                                qx.scale_inv[t * groups + g]
                            )));
                        }
                    }
                }
                // the host sums in f64, and the sum of magnitudes that bounds their rounding
                let mut want = vec![0.0f64; tokens * out];
                let mut mag = vec![0.0f64; tokens * out];
                for t in 0..tokens {
                    for o in 0..out {
                        let (mut acc, mut m) = (0.0f64, 0.0f64);
                        for c in 0..inp {
                            let term = f64::from(e4m3_to_f32(qx.data[t * inp + c]))
                                * f64::from(qx.scale_inv[t * groups + c / 128])
                                * f64::from(wq.value(row0 + o, c));
                            acc += term;
                            m += term.abs();
                        }
                        want[t * out + o] = acc;
                        mag[t * out + o] = m;
                    }
                }
                let check = |y: &[f32], path: &str| -> Result<f64, CudaError> {
                    let mut worst = 0.0f64;
                    for (j, (&g, (&w, &m))) in y.iter().zip(want.iter().zip(&mag)).enumerate() {
                        let err = (f64::from(g) - w).abs();
                        if err > TOLERANCE * m + 1e-30 {
                            return Err(CudaError::Invalid(format!(
                                "{out}x{tokens}x{inp} from row {row0} {path}: output {j} \
                                 (token {}, row {}): {g} against {w} (Σ|terms| {m})",
                                j / out,
                                j % out
                            )));
                        }
                        worst = worst.max(err / m.max(1e-30));
                    }
                    Ok(worst)
                };
                let mut found = Vec::new();
                // cuBLASLt's block-scaled GEMM alone (2 tokens or more, rows from a block)
                if tokens >= 2 && lt_reads(&weight) {
                    // SAFETY: as above.
                    unsafe {
                        let xq = (ptr(&qd, s), ptr(&scd, s));
                        lt.gemm(s, &k, weight, xq, ptr(&yd, s), (out, tokens, inp), 0)?;
                    }
                    let y = s.clone_dtoh(&yd).map_err(up("y back"))?;
                    let worst = check(&y[..tokens * out], "block-scaled GEMM")?;
                    found.push(format!("cuBLASLt within {worst:.1e}"));
                }
                // the tensor-core kernel alone
                let mma = lt.mma.as_ref().filter(|_| tokens <= MMA_TOKENS);
                if let Some(m) = mma {
                    let y = mma_twice(
                        s,
                        m,
                        weight,
                        (ptr(&qd, s), ptr(&scd, s), pad),
                        &yd,
                        (out, tokens, inp),
                        ctx,
                    )?;
                    let worst = check(&y[..tokens * out], "tensor-core kernel")?;
                    found.push(format!("tensor-core kernel within {worst:.1e}"));
                }
                // the whole W8A8 product from the split activations, by every path that takes
                // it: lo rows zero
                let mut limits = vec![(W8a8Limits::default(), "default")];
                if tokens <= GEMV_TOKENS {
                    let l = W8a8Limits {
                        gemv: GEMV_TOKENS,
                        mma: 0,
                    };
                    limits.push((l, "weight streaming"));
                }
                if mma.is_some() {
                    limits.push((
                        W8a8Limits {
                            gemv: 0,
                            mma: MMA_TOKENS,
                        },
                        "tensor cores",
                    ));
                }
                let held = Cell::new(false);
                for ((limits, path), same_input) in
                    limits.into_iter().flat_map(|l| [(l, false), (l, true)])
                {
                    // the lo rows must be written by the product: garbage before it
                    s.memset_zeros(&mut yd).map_err(up("y"))?;
                    let nan = vec![f32::NAN; tokens * out];
                    s.memcpy_htod(&nan, &mut yd.slice_mut(tokens * out..))
                        .map_err(up("lo rows"))?;
                    let through = W8a8Through {
                        x32: Some(ptr(&x32, s)),
                        act: Some((ptr(&qd, s), ptr(&scd, s), &held)),
                        same_input,
                    };
                    // SAFETY: as above.
                    unsafe {
                        w8a8_gemm(
                            s,
                            &lt,
                            &k,
                            weight,
                            ptr(&xd, s),
                            ptr(&yd, s),
                            (out, 2 * tokens, inp),
                            through,
                            limits,
                            0,
                        )?;
                    }
                    let y = s.clone_dtoh(&yd).map_err(up("y back"))?;
                    let path = &*format!("{path}{}", if same_input { ", input again" } else { "" });
                    let worst = check(&y[..tokens * out], path)?;
                    if y[tokens * out..].iter().any(|&v| v != 0.0) {
                        return Err(CudaError::Invalid(format!(
                            "{out}x{tokens}x{inp} {path}: lo rows not zero"
                        )));
                    }
                    found.push(format!("W8A8 product ({path}) within {worst:.1e}"));
                }
                lines.push(format!(
                    "{out} x {tokens} x {inp} from row {row0}: quantisation bit-identical; {} \
                     of Σ|terms|",
                    found.join(", ")
                ));
            }
            Ok(lines)
        })?;
        for l in report.iter().flatten() {
            println!("{l}");
        }
        Ok(())
    }
}
