//! The mixture-of-experts MLP of one rank: the router's logits, then top-k routing, on the
//! device for passes of up to 256 rows and W8A8 fp8 experts' passes of any length (in chunks;
//! [`device`]: no host synchronisation), else on the host with the CPU decoder's rule ([`host`]:
//! [`lifecycle_decoder::route_top_k`], one device→host copy of `n × experts` floats), then the
//! experts this rank holds over the rows routed to them, and the rank's share of the shared
//! expert.
//!
//! Beneath both routes: [`table`] (the device routing's kernel and every layer's expert table,
//! made at bind), [`scratch`] (a pass's buffers) and [`steps`] (the kernels both routes launch:
//! the router's product, gather, SwiGLU, scatter, one expert's MLP).

mod device;
mod host;
mod scratch;
mod steps;
pub(super) mod table;

pub(super) use scratch::MoeScratch;
pub use table::DEVICE_ROWS;

use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::{CudaError, RankCtx};

use crate::blas::gemm;
use crate::decoder::rank::{Dims, RankState};
use crate::kernels::{launch, ptr, Arg};
use crate::weights::{MoeOffsets, SharedOffsets};
use device::device_moe_layer;
use host::host_routed_experts;
use steps::{expert_ffn, Steps};

/// Layer `l`'s mixture-of-experts MLP (`moe`) on this rank over the `n` rows of the split
/// activations at `xsp`: routed on the device when [`device_moe_layer`] takes the layer, else
/// the router's logits downloaded and routed on the host; then every expert this rank holds and
/// that received rows, their weighted outputs added into the scratch's `acc` (zeroed first), and
/// the rank's share of the shared expert. The caller adds `acc` to the residual and sums it over
/// the group, as for a row-parallel output. Whether the layer was routed on the host comes
/// back; with `host_ok` false (a pass being captured into a graph) a layer the device does not
/// route is an error, before anything is queued for it.
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_layer(
    ctx: &RankCtx,
    st: &RankState,
    z: &Dims,
    l: usize,
    moe: &MoeOffsets,
    scratch: &mut MoeScratch,
    xsp: u64,
    (base, host_ok): (u64, bool),
) -> Result<bool, CudaError> {
    let hosted = !device_moe_layer(ctx, st, z, l, moe, scratch, xsp, base)?;
    if hosted {
        if !host_ok {
            return Err(CudaError::Invalid(format!(
                "layer {l}'s experts would be routed on the host (a device→host copy) in a pass \
                 captured into a graph"
            )));
        }
        host_routed_experts(ctx, st, z, moe, scratch, xsp, base)?;
    }
    if let Some(shared) = &moe.shared {
        shared_expert(ctx, st, z, scratch, (xsp, base), shared)?;
    }
    Ok(hosted)
}

/// Qwen2-MoE's shared expert over all `n` rows, added into `acc` scaled per row by
/// `sigmoid(gate · x)`: gate and up GEMMs, SwiGLU, down GEMM, the gate's logits, one fused add.
fn shared_expert(
    ctx: &RankCtx,
    st: &RankState,
    z: &Dims,
    scratch: &mut MoeScratch,
    (xsp, base): (u64, u64),
    shared: &SharedOffsets,
) -> Result<(), CudaError> {
    let (s, rank, k) = (&ctx.compute, ctx.rank, &st.k);
    let (n, h) = (z.n, z.h);
    let e = shared.expert;
    let p = |b: &CudaSlice<f32>| ptr(b, s);
    let u32a = |v: usize| Arg::U32(v as u32);
    // SAFETY: the weights are offsets checked against this rank's rollout buffer; the scratch
    // holds `[2n × ffn]` products (its ffn counts the shared expert's), `[2n × h]` down products
    // and `[2n × experts]` router products, the first `2n` of which take the gate's logits; in
    // order on the compute stream.
    unsafe {
        expert_ffn(st, &Steps { s, k, rank }, base, e, (xsp, n, h), scratch)?;
        gemm(
            &st.blas,
            base + 2 * shared.gate,
            xsp,
            p(&scratch.router2),
            1,
            2 * n,
            h,
            rank,
        )?;
        launch(
            s,
            &k.add_gated_rows,
            k.elementwise((n * h) as u64),
            &[
                Arg::U64(p(&scratch.y2)),
                Arg::U64(p(&scratch.router2)),
                Arg::U64(p(&scratch.acc)),
                u32a(n),
                u32a(h),
            ],
            rank,
            "add_gated_rows",
        )?;
    }
    Ok(())
}
