//! What both routes of a mixture-of-experts layer launch: the router's product
//! ([`router_logits`]), the gather, SwiGLU and scatter kernels ([`Steps`]), one expert's MLP
//! ([`expert_ffn`]) and the W8A8 requantisation of the weight-streaming kernels' inputs
//! ([`requantise`]).

use std::sync::Arc;

use lifecycle_cuda::cudarc::driver::{CudaSlice, CudaStream};
use lifecycle_cuda::{CudaError, RankCtx};

use super::scratch::MoeScratch;
use crate::blas::gemm;
use crate::decoder::rank::{Dims, RankState};
use crate::kernels::{launch, ptr, Arg, DecoderKernels};
use crate::w8a8::{quantize, ActSrc, QuantOut};
use crate::weights::{ExpertOffsets, MoeOffsets};

/// The router's logits of the `n` rows at `xsp` into the scratch's `logits` (`[n × experts]`):
/// its product, then the hi and lo halves added.
pub(super) fn router_logits(
    ctx: &RankCtx,
    st: &RankState,
    z: &Dims,
    moe: &MoeOffsets,
    scratch: &MoeScratch,
    xsp: u64,
    base: u64,
) -> Result<(), CudaError> {
    let (s, rank, k) = (&ctx.compute, ctx.rank, &st.k);
    let n = z.n;
    let experts = moe.experts.len();
    let p = |b: &CudaSlice<f32>| ptr(b, s);
    let u32a = |v: usize| Arg::U32(v as u32);
    // SAFETY: the router's address is an offset checked against this rank's rollout buffer; the
    // scratch holds `[2n × experts]` products and `[n × experts]` logits; in order on the
    // compute stream.
    unsafe {
        gemm(
            &st.blas,
            base + 2 * moe.router,
            xsp,
            p(&scratch.router2),
            experts,
            2 * n,
            z.h,
            rank,
        )?;
        launch(
            s,
            &k.combine,
            k.elementwise((n * experts) as u64),
            &[
                Arg::U64(p(&scratch.router2)),
                Arg::U64(0),
                Arg::U64(0),
                Arg::U64(p(&scratch.logits)),
                u32a(n),
                u32a(experts),
            ],
            rank,
            "combine",
        )
    }
}

/// One expert's SwiGLU MLP over `rows` split rows of width `h` at `x` (`[2 · rows × h]`): gate and up
/// products into the scratch's `g2` / `u2`, SwiGLU into `act`, the down product into `y2`.
///
/// # Safety
/// `e`'s matrices must lie in the bound rollout buffer at `base`, `x` hold the rows, and the
/// scratch at least `rows` rows of every product.
pub(super) unsafe fn expert_ffn(
    st: &RankState,
    steps: &Steps<'_>,
    base: u64,
    e: ExpertOffsets,
    (x, rows, h): (u64, usize, usize),
    scratch: &MoeScratch,
) -> Result<(), CudaError> {
    let (s, rank) = (steps.s, steps.rank);
    let f = e.ffn;
    let p = |b: &CudaSlice<f32>| ptr(b, s);
    let (act, w8) = (ptr(&scratch.act, s), scratch.w8a8.as_ref());
    // SAFETY: forwarded to the caller; each product reads what the one before wrote, in order
    // on the compute stream.
    unsafe {
        st.wgemm(
            s,
            base,
            e.gate,
            x,
            p(&scratch.g2),
            (f, 2 * rows, h),
            (w8, false),
            rank,
        )?;
        let up = p(&scratch.u2);
        st.wgemm(s, base, e.up, x, up, (f, 2 * rows, h), (w8, true), rank)?;
        steps.swiglu((p(&scratch.g2), p(&scratch.u2), act), (rows, f))?;
        st.wgemm(
            s,
            base,
            e.down,
            act,
            p(&scratch.y2),
            (h, 2 * rows, f),
            (w8, false),
            rank,
        )
    }
}

/// W8A8 (`on`): the f32 activations at `x32` (`rows × inp`) quantised per token group and
/// dequantised in place, so the weight-streaming kernel multiplies the quantised values; nothing
/// when off.
///
/// # Safety
/// `x32` must hold `rows · inp` f32 of this context, alive until the stream ran the kernel.
pub(super) unsafe fn requantise(
    s: &Arc<CudaStream>,
    kf: &crate::fp8::Fp8Kernels,
    x32: u64,
    (rows, inp): (usize, usize),
    on: bool,
    rank: usize,
) -> Result<(), CudaError> {
    if !on {
        return Ok(());
    }
    let deq = QuantOut {
        deq: Some(x32),
        ..QuantOut::default()
    };
    // SAFETY: forwarded to the caller; quantised in place.
    unsafe { quantize(s, kf, ActSrc::F32(x32), (rows, rows, inp), deq, rank) }
}

/// The kernels every expert path launches, on one rank's compute stream.
pub(super) struct Steps<'a> {
    pub(super) s: &'a Arc<CudaStream>,
    pub(super) k: &'a DecoderKernels,
    pub(super) rank: usize,
}

impl Steps<'_> {
    /// `rows` rows of the split activations at `xsp` (`[2n × h]`), by the token indices at `idx`,
    /// into the split `[2 · rows × h]` at `out`.
    ///
    /// # Safety
    /// The addresses must hold those sizes, alive until the stream ran the kernel.
    pub(super) unsafe fn gather(
        &self,
        (xsp, idx, out): (u64, u64, u64),
        (n, rows, h): (usize, usize, usize),
    ) -> Result<(), CudaError> {
        let u = |v: usize| Arg::U32(v as u32);
        let args = [
            Arg::U64(xsp),
            Arg::U64(idx),
            Arg::U64(out),
            u(n),
            u(rows),
            u(h),
        ];
        // SAFETY: forwarded to the caller.
        unsafe {
            launch(
                self.s,
                &self.k.gather_split_rows,
                self.k.elementwise((rows * h) as u64),
                &args,
                self.rank,
                "gather_split_rows",
            )
        }
    }

    /// SwiGLU of the split gate and up products (`[2 · rows × f]` f32 each) into split bf16 `act`.
    ///
    /// # Safety
    /// As [`Steps::gather`].
    pub(super) unsafe fn swiglu(
        &self,
        (g2, u2, act): (u64, u64, u64),
        (rows, f): (usize, usize),
    ) -> Result<(), CudaError> {
        let u = |v: usize| Arg::U32(v as u32);
        let args = [Arg::U64(g2), Arg::U64(u2), Arg::U64(act), u(rows), u(f)];
        // SAFETY: forwarded to the caller.
        unsafe {
            launch(
                self.s,
                &self.k.swiglu_split,
                self.k.elementwise((rows * f) as u64),
                &args,
                self.rank,
                "swiglu_split",
            )
        }
    }

    /// Adds every token's weighted expert outputs of a block (`y2`, `[2 · rows × h]`) into `acc`
    /// (`[n × h]`), by the token lists at `lists` (CSR offsets, positions, weights).
    ///
    /// # Safety
    /// As [`Steps::gather`].
    pub(super) unsafe fn scatter(
        &self,
        (y2, acc): (u64, u64),
        (csr, pos, wts): (u64, u64, u64),
        (n, rows, h): (usize, usize, usize),
    ) -> Result<(), CudaError> {
        let u = |v: usize| Arg::U32(v as u32);
        let args = [
            Arg::U64(y2),
            Arg::U64(csr),
            Arg::U64(pos),
            Arg::U64(wts),
            Arg::U64(acc),
            u(n),
            u(rows),
            u(h),
        ];
        // SAFETY: forwarded to the caller.
        unsafe {
            launch(
                self.s,
                &self.k.scatter_add_grouped,
                self.k.elementwise((n * h) as u64),
                &args,
                self.rank,
                "scatter_add_grouped",
            )
        }
    }
}
