//! Mixture-of-experts layers routed on the device: for passes of at most
//! [`DEVICE_ROWS`](super::table::DEVICE_ROWS) rows (every decode step of up to 256 sequences per
//! replica), the router's top-k, each expert's rows, each token's list of experts and the table of
//! expert products are computed by one kernel (`moe_route`, in `kernels/decoder_moe.cu`) and read
//! by the kernels after it, so the layer queues its work without waiting for the device: no
//! download of router logits, no upload of row lists. W8A8 fp8 experts are routed on the device in
//! longer passes too (prefill): in chunks of at most `DEVICE_ROWS` rows, each routed and run as a
//! pass of its own (a token's experts and sum depend on its row only).
//!
//! The experts' products run over that table in pieces of at most eight rows of one expert,
//! each reading an expert's weights once per piece: for W8A8 fp8 experts by the tensor-core
//! kernel `w8a8_mma_experts` ([`crate::w8a8`]; the layer's input rows quantised once, gate and
//! up in one launch, the SwiGLU quantised in its kernel), else by the weight-streaming table
//! kernels of [`crate::fp8`] (e4m3 or bf16 weights against f32 activations). The grid covers
//! the most pieces a routing can make (`min(experts, n · k) + n · k / 8`); pieces past the
//! routing's last have no rows and return at once. The experts' sum is added per token in
//! expert order by the host path's scatter kernel, as the CPU decoder adds it.

use std::sync::Arc;

use lifecycle_cuda::cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use lifecycle_cuda::{CudaError, RankCtx};

use super::scratch::MoeScratch;
use super::steps::{requantise, router_logits, Steps};
use super::table::EXPERT_WORDS;
use crate::decoder::rank::{fp8_weight, Dims, RankState};
use crate::fp8::{fp8_gemv_table, fp8_join, Fp8Kernels, GEMV_TOKENS};
use crate::kernels::{launch, ptr, Arg};
use crate::w8a8::{mma_reads, quantize, ActLayout, ActSrc, MmaKernels, QuantOut, W8a8Scratch};
use crate::weights::{ExpertOffsets, MoeOffsets};
use lifecycle_layout::fp8::Fp8Compute;

/// Layer `l`'s experts (`moe`) over the `n` rows of the split activations at `xsp`, routed on
/// the device (in chunks of the routing buffers' rows where `n` is more: W8A8 experts on the
/// tensor cores only), their weighted sum in the scratch's `acc`; `Ok(false)`, having queued
/// nothing, when the layer is not one the device routes: device routing off, no routing buffers
/// for this pass, the per-expert path chosen, held experts of different widths or dtypes, or a
/// pass longer than one routing whose experts are not on the tensor cores.
#[allow(clippy::too_many_arguments)]
pub(super) fn device_moe_layer(
    ctx: &RankCtx,
    st: &RankState,
    z: &Dims,
    l: usize,
    moe: &MoeOffsets,
    scratch: &mut MoeScratch,
    xsp: u64,
    base: u64,
) -> Result<bool, CudaError> {
    let (Some(dev), Some(r)) = (st.device_moe.as_ref(), scratch.route.as_ref()) else {
        return Ok(false);
    };
    let held: Vec<_> = moe.experts.iter().flatten().collect();
    let Some(first) = held.first() else {
        return Ok(false);
    };
    let (ffn, fp8) = (first.ffn, first.gate.fp8.is_some());
    let uniform = held.iter().all(|e| {
        e.ffn == ffn
            && [e.gate, e.up, e.down]
                .iter()
                .all(|m| m.fp8.is_some() == fp8)
    });
    let Some(x32) = scratch.x32.as_ref() else {
        return Ok(false);
    };
    let kf = &dev.kernels;
    if !st.device_routing || !st.grouped || !uniform || moe.experts.len() != dev.experts {
        return Ok(false);
    }
    let (s, rank) = (&ctx.compute, ctx.rank);
    let steps = Steps { s, k: &st.k, rank };
    let (n, h, f, k) = (z.n, z.h, ffn, z.top_k);
    // the rows of one piece: at most 8, and at most n (a token picks an expert once)
    let most = n.min(GEMV_TOKENS);
    // W8A8 for fp8 experts only
    let w8a8 = fp8 && st.fp8_compute == Fp8Compute::W8A8;
    let tensor_cores = if w8a8 && most > st.w8a8_limits.gemv.min(GEMV_TOKENS) {
        expert_mma(st, &held, (h, f), base).zip(scratch.w8a8.as_ref())
    } else {
        None
    };
    if n > r.rows && tensor_cores.is_none() {
        return Ok(false);
    }
    let p = |b: &CudaSlice<f32>| ptr(b, s);
    let (xg, act) = (ptr(&scratch.xg, s), ptr(&scratch.act, s));
    let (g2, u2, y2) = (p(&scratch.g2), p(&scratch.u2), p(&scratch.y2));
    let (logits, acc) = (p(&scratch.logits), p(&scratch.acc));
    let x32 = ptr(x32, s);
    let table = ptr(&r.table, s);
    let slot_tok = ptr(&r.slot_tok, s);
    let lists = (ptr(&r.csr, s), ptr(&r.pos, s), ptr(&r.wt, s));
    let experts_at = ptr(&dev.experts_table, s) + 8 * (l * dev.experts * EXPERT_WORDS) as u64;
    router_logits(ctx, st, z, moe, scratch, xsp, base)?;
    s.memset_zeros(&mut scratch.acc)
        .map_err(ctx.drv("zeroing the expert sums", 0))?;
    // one block of 32 warps (a warp per row at a time)
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    let entry = |i: usize| table + 8 * (i * 8 * r.problems) as u64;
    let u = |v: usize| Arg::U32(v as u32);
    for c0 in (0..n).step_by(r.rows) {
        // chunk c0.. of c rows (the whole pass where it fits one routing)
        let c = r.rows.min(n - c0);
        let cap = c * k;
        let rows_at = if c == n {
            xsp
        } else {
            // the chunk's hi and lo rows, split [2c × h], into the gather buffer (the tensor
            // cores' path reads no gathered rows)
            let bytes = 2 * c * h;
            for (from, to) in [(c0, 0), (n + c0, c)] {
                // SAFETY: xsp holds [2n × h] bf16 and the chunk's rows lie within it; xg holds
                // 2 · rows ≥ 2c rows of h; in order on the compute stream.
                unsafe {
                    lifecycle_cuda::cudarc::driver::result::memcpy_dtod_async(
                        xg + (2 * to * h) as u64,
                        xsp + (2 * from * h) as u64,
                        bytes,
                        s.cu_stream(),
                    )
                }
                .map_err(ctx.drv("copying a routing chunk's rows", bytes as u64))?;
            }
            xg
        };
        let args = [
            Arg::U64(logits + (4 * c0 * dev.experts) as u64),
            u(c),
            u(dev.experts),
            u(k),
            u(usize::from(z.norm_topk_prob)),
            Arg::U64(experts_at),
            u(h),
            u(f),
            u(cap),
            u(r.problems),
            Arg::U64(x32),
            Arg::U64(g2),
            Arg::U64(u2),
            Arg::U64(y2),
            Arg::U64(ptr(&r.picks, s)),
            Arg::U64(slot_tok),
            Arg::U64(lists.0),
            Arg::U64(lists.1),
            Arg::U64(lists.2),
            Arg::U64(table),
        ];
        // SAFETY: x32 holds `cap · max(h, ffn)` f32 (the scratch's routed rows are at least
        // `cap`).
        let requant = |dims| unsafe { requantise(s, kf, x32, dims, w8a8, rank) };
        let bf16 = !fp8;
        // SAFETY: the routing kernel's arguments: the chunk's router logits `[c × experts]`
        // just written, the layer's expert table (offsets checked against this rank's rollout
        // buffer at bind), the scratch's inputs and outputs of `cap ≤ rows` routed rows, the
        // routing buffers of `cap` slots and `problems` pieces (the most a routing of `c ≤
        // r.rows` rows makes). Every kernel after it reads what it wrote, in order on the
        // compute stream; the scatter adds the chunk's sums into its rows of `acc` ([n × h]).
        unsafe {
            launch(s, &dev.route, one, &args, rank, "moe_route")?;
            if let Some((mma, w8)) = tensor_cores {
                let pieces = (table, r.problems, x32);
                let rows = (rows_at, slot_tok, (g2, u2, act));
                tensor_core_experts(s, st, (mma, kf, w8), pieces, rows, (c, cap, h, f), rank)?;
            } else {
                steps.gather((rows_at, slot_tok, xg), (c, cap, h))?;
                fp8_join(s, kf, (xg, x32), (cap, h), rank)?;
                requant((cap, h))?;
                fp8_gemv_table(s, kf, entry(0), (r.problems, f, most), bf16, rank)?;
                fp8_gemv_table(s, kf, entry(1), (r.problems, f, most), bf16, rank)?;
                steps.swiglu((g2, u2, act), (cap, f))?;
                fp8_join(s, kf, (act, x32), (cap, f), rank)?;
                requant((cap, f))?;
                fp8_gemv_table(s, kf, entry(2), (r.problems, h, most), bf16, rank)?;
            }
            let acc_at = acc + (4 * c0 * h) as u64;
            steps.scatter((y2, acc_at), lists, (c, cap, h))?;
        }
    }
    Ok(true)
}

/// The mixture-of-experts kernels of the tensor cores for `held` (a layer's experts, `f` wide
/// over `h`, in the bound buffer at `base`): the `mma.sync` kernels where loaded and every
/// held expert's gate, up and down reads there ([`mma_reads`]); else `None`.
fn expert_mma<'s>(
    st: &'s RankState,
    held: &[&ExpertOffsets],
    (h, f): (usize, usize),
    base: u64,
) -> Option<&'s MmaKernels> {
    let mma = st.w8a8.as_ref()?.mma.as_ref()?;
    let reads = |m, inp| fp8_weight(base, m).is_some_and(|w| mma_reads(&w, inp));
    held.iter()
        .all(|e| reads(e.gate, h) && reads(e.up, h) && reads(e.down, f))
        .then_some(mma)
}

/// The routed experts of a W8A8 layer on the tensor cores: the layer's `n` input rows (split
/// at `xsp`) quantised once; gate and up of every piece in one launch of the experts kernel,
/// each piece reading its slots' tokens' rows (`slot_tok`); the SwiGLU of the `cap` slots split
/// into the scratch's `act` and quantised; down in a second launch over the slots' own rows.
/// The outputs go where moe_route's table (`pieces`: the table, its pieces per product, the f32
/// input rows its addresses count from) puts them.
///
/// # Safety
/// moe_route must have written the table and `slot_tok` on this stream for `cap` slots of `n`
/// rows of `h` inputs, experts `f` wide; `xsp` holds the split rows `[2n × h]`; the W8A8
/// scratch `w8` at least `cap` padded rows of `max(h, f)`.
#[allow(clippy::too_many_arguments)]
unsafe fn tensor_core_experts(
    s: &Arc<CudaStream>,
    st: &RankState,
    (mma, kf, w8): (&MmaKernels, &Fp8Kernels, &W8a8Scratch),
    (table, problems, x32): (u64, usize, u64),
    (xsp, slot_tok, (g2, u2, act)): (u64, u64, (u64, u64, u64)),
    (n, cap, h, f): (usize, usize, usize, usize),
    rank: usize,
) -> Result<(), CudaError> {
    let u32a = |v: usize, what: &str| {
        u32::try_from(v).map_err(|_| CudaError::Invalid(format!("W8A8 experts' {what} {v} > u32")))
    };
    let (q, sc) = (ptr(&w8.q, s), ptr(&w8.scales, s));
    let rows = ActLayout::Rows;
    // the products quantised here are no input the pass's products hold
    w8.held.set(None);
    let quantised = |tokens: usize| QuantOut {
        q: Some(q),
        scales: Some((sc, rows.scale_strides(tokens))),
        ..QuantOut::default()
    };
    let down = table + 8 * (2 * problems * 8) as u64;
    let (pad_n, pad_c) = (rows.padded(n), rows.padded(cap));
    let (tok, grp) = rows.scale_strides(cap);
    let swiglu = [
        Arg::U64(g2),
        Arg::U64(u2),
        Arg::U64(act),
        Arg::U32(u32a(cap, "slots")?),
        Arg::U32(u32a(pad_c, "padded slots")?),
        Arg::U32(u32a(f, "width")?),
        Arg::U64(q),
        Arg::U64(sc),
        Arg::U32(tok),
        Arg::U32(grp),
        Arg::U32(0),
        // the experts' lo rows (their zeros) read
        Arg::U32(1),
    ];
    // a warp per (slot, group of 128), 8 per block
    let warps = pad_c * f.div_ceil(128);
    let cfg = LaunchConfig {
        grid_dim: (u32a(warps.div_ceil(8).max(1), "SwiGLU blocks")?, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: per the caller: the n split rows at xsp quantised into the scratch (n padded rows
    // of h); the table's gate and up pieces (2 · problems from its start) read them through the
    // slots' tokens, below n; the SwiGLU reads their split products [2 cap × f] and writes `act`
    // and the quantisation of cap padded slots of f (the scratch's bytes: the gate and up
    // products, queued before, have read the earlier ones); down's pieces read the slots' rows.
    unsafe {
        quantize(s, kf, ActSrc::Split(xsp), (n, pad_n, h), quantised(n), rank)?;
        mma.experts(
            s,
            (table, 2 * problems, x32),
            (q, sc, pad_n, slot_tok),
            (f, h),
            rank,
        )?;
        launch(s, &st.k.swiglu_quant, cfg, &swiglu, rank, "swiglu_quant")?;
        mma.experts(s, (down, problems, x32), (q, sc, pad_c, 0), (h, f), rank)
    }
}
