//! The mixture-of-experts MLP of one rank: the router's logits, then top-k routing, on the
//! device for passes of up to 256 rows and W8A8 fp8 experts' passes of any length (in chunks;
//! [`super::moe_device`]: no host synchronisation), else on the host with the CPU decoder's rule ([`lifecycle_decoder::route_top_k`], one device→host
//! copy of `n × experts` floats), then the experts this rank holds over the rows routed to them.
//! What follows is the host-routed path.
//!
//! bf16 experts run in blocks: the routed rows of consecutive experts are gathered into one
//! block (as many as the scratch holds: every routed row of a decode step), each expert padded to
//! the block's busiest, and each of gate, up and down is one batched cuBLAS GEMM over all of them
//! (`cublasGemmBatchedEx`; cuBLAS's grouped GEMM, `cublasGemmGroupedBatchedEx`, refuses bf16
//! inputs with f32 outputs, which the split activations need), the SwiGLU and the weighted
//! scatter one launch each. Every token adds its experts' outputs in expert order, as the
//! per-expert path does. fp8 experts with at most 64 routed rows each (decode steps) run the same
//! way through the weight-streaming e4m3 kernel over a table of products, pieces of at most eight
//! rows (one launch per product); with more rows (prefill), fp8 experts take the per-expert path:
//! one gather, three GEMMs over the dequantised weights, a SwiGLU and a scatter per expert.

use std::ops::Range;
use std::sync::Arc;

use lifecycle_cuda::cudarc::driver::{CudaSlice, CudaStream};
use lifecycle_cuda::{alloc_device, CudaError, RankCtx};

use super::moe_device::{device_moe_layer, RouteScratch};
use super::rank::{ptr, Dims, RankState};
use crate::blas::{batched_gemm, gemm};
use crate::fp8::{fp8_gemv_table, fp8_join, GEMV_TOKENS};
use crate::kernels::{launch, Arg, DecoderKernels};
use crate::w8a8::{quantize, ActSrc, QuantOut, W8a8Scratch};
use crate::weights::{ExpertOffsets, MoeOffsets, RankOffsets, SharedOffsets};
use lifecycle_layout::fp8::Fp8Compute;

/// The most bytes of down products (`[2 · rows × hidden]` f32) the grouped path's scratch may
/// take beyond what one expert's rows need: 64 MiB.
const GROUPED_SCRATCH_BYTES: usize = 64 << 20;

/// Device scratch of the mixture-of-experts layers of one pass (`None` for dense models), for
/// `rows` routed rows at once: at least every row reaching one expert (`n`), up to every routed
/// row (`n · top-k`) within [`GROUPED_SCRATCH_BYTES`].
pub(super) struct MoeScratch {
    /// Routed rows the buffers below hold.
    rows: usize,
    /// Router products `[2n × experts]` and router logits `[n × experts]`.
    router2: CudaSlice<f32>,
    pub(super) logits: CudaSlice<f32>,
    /// The routed rows, split `[2 · rows × h]`.
    pub(super) xg: CudaSlice<u16>,
    /// Gate and up products `[2 · rows × ffn]`, the SwiGLU output split `[2 · rows × ffn]`.
    pub(super) g2: CudaSlice<f32>,
    pub(super) u2: CudaSlice<f32>,
    pub(super) act: CudaSlice<u16>,
    /// Down products `[2 · rows × h]`.
    pub(super) y2: CudaSlice<f32>,
    /// The weighted sum of the experts' outputs `[n × h]`.
    pub(super) acc: CudaSlice<f32>,
    /// f32 activations of the weight-streaming expert products `[rows × max(h, ffn)]` (fp8
    /// experts, or a pass routed on the device).
    pub(super) x32: Option<CudaSlice<f32>>,
    /// The device routing's buffers, for a pass it routes ([`RouteScratch::new`]).
    pub(super) route: Option<RouteScratch>,
    /// The quantised activations of W8A8 expert products beyond the weight-streaming kernel's
    /// tokens (`[rows × max(h, ffn)]`).
    pub(super) w8a8: Option<W8a8Scratch>,
}

impl MoeScratch {
    pub(super) fn new(
        s: &Arc<CudaStream>,
        rank: usize,
        (n, h, top_k): (usize, usize, usize),
        w: &RankOffsets,
        (w8a8, device): (bool, bool),
    ) -> Result<Option<Self>, CudaError> {
        let layers: Vec<&MoeOffsets> = w.moe.iter().flatten().collect();
        let Some(first) = layers.first() else {
            return Ok(None);
        };
        let experts = first.experts.len();
        let ffn = layers
            .iter()
            .flat_map(|m| {
                m.experts
                    .iter()
                    .flatten()
                    .chain(m.shared.iter().map(|s| &s.expert))
            })
            .map(|e| e.ffn)
            .max()
            .unwrap_or(1)
            .max(1);
        let rows = (n * top_k.max(1))
            .min(GROUPED_SCRATCH_BYTES / (8 * h.max(1)))
            .max(n);
        let fp8 = layers
            .iter()
            .flat_map(|m| m.experts.iter().flatten())
            .any(|e| e.gate.fp8.is_some());
        let route = if device {
            // W8A8 fp8 experts (the tensor cores') are routed in chunks where the pass is longer
            RouteScratch::new(s, rank, (n, top_k, experts, rows), fp8 && w8a8)?
        } else {
            None
        };
        // SAFETY: each buffer is written (GEMM, kernel or memset) before it is read, in order on
        // this stream, in `moe_layer`.
        unsafe {
            Ok(Some(MoeScratch {
                rows,
                router2: alloc_device(s, 2 * n * experts, rank, "router products")?,
                logits: alloc_device(s, n * experts, rank, "router logits")?,
                xg: alloc_device(s, 2 * rows * h, rank, "routed rows")?,
                g2: alloc_device(s, 2 * rows * ffn, rank, "expert gate products")?,
                u2: alloc_device(s, 2 * rows * ffn, rank, "expert up products")?,
                act: alloc_device(s, 2 * rows * ffn, rank, "expert activations")?,
                y2: alloc_device(s, 2 * rows * h, rank, "expert down products")?,
                acc: alloc_device(s, n * h, rank, "expert sums")?,
                x32: if fp8 || route.is_some() {
                    Some(alloc_device(
                        s,
                        rows * h.max(ffn),
                        rank,
                        "fp8 expert activations",
                    )?)
                } else {
                    None
                },
                w8a8: if fp8 && w8a8 {
                    Some(W8a8Scratch::alloc(s, rows, h.max(ffn), rank)?)
                } else {
                    None
                },
                route,
            }))
        }
    }

    /// The weighted sum of the experts' outputs of the last layer, `[n × h]` f32.
    pub(super) fn acc(&self) -> &CudaSlice<f32> {
        &self.acc
    }
}

/// One expert's routed rows: `rows` entries of [`Routed`]'s lists from `start`.
#[derive(Clone, Copy)]
struct Run {
    expert: ExpertOffsets,
    start: usize,
    rows: usize,
}

/// A layer's routing on this rank: per held expert that received rows, in expert order, its run
/// of the token rows `idx` and their weights `wts`.
struct Routed {
    runs: Vec<Run>,
    idx: Vec<u32>,
    wts: Vec<f32>,
}

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

/// The routed experts of one layer, routed on the host: the router's logits downloaded, each
/// row's top-k by [`lifecycle_decoder::route_top_k`], the row lists uploaded, then the grouped,
/// fp8 or per-expert path; the sum in `acc`.
fn host_routed_experts(
    ctx: &RankCtx,
    st: &RankState,
    z: &Dims,
    moe: &MoeOffsets,
    scratch: &mut MoeScratch,
    xsp: u64,
    base: u64,
) -> Result<(), CudaError> {
    let s = &ctx.compute;
    let k = &st.k;
    let n = z.n;
    let experts = moe.experts.len();
    let p = |b: &CudaSlice<f32>| ptr(b, s);
    router_logits(ctx, st, z, moe, scratch, xsp, base)?;
    let mut logits: Vec<f32> = st
        .downloads
        .words(
            ctx,
            k,
            s,
            p(&scratch.logits),
            n * experts,
            st.downloads_through_sms(),
            "downloading router logits",
        )?
        .into_iter()
        .map(f32::from_bits)
        .collect();
    let mut routed: Vec<Vec<(u32, f32)>> = vec![Vec::new(); experts];
    for (row, l) in logits.chunks_exact_mut(experts).enumerate() {
        for (e, w) in lifecycle_decoder::route_top_k(l, z.top_k, z.norm_topk_prob) {
            routed[e].push((row as u32, w));
        }
    }
    let mut idx = Vec::new();
    let mut wts = Vec::new();
    let mut runs = Vec::new();
    for (e, rows) in routed.iter().enumerate() {
        if let (Some(expert), false) = (moe.experts[e], rows.is_empty()) {
            runs.push(Run {
                expert,
                start: idx.len(),
                rows: rows.len(),
            });
            idx.extend(rows.iter().map(|r| r.0));
            wts.extend(rows.iter().map(|r| r.1));
        }
    }
    s.memset_zeros(&mut scratch.acc)
        .map_err(ctx.drv("zeroing the expert sums", 0))?;
    if runs.is_empty() {
        // no held expert got rows: the sum stays zero
        return Ok(());
    }
    let ffn = runs[0].expert.ffn;
    let same = |r: &Run, fp8: bool| {
        let e = r.expert;
        e.ffn == ffn
            && [e.gate, e.up, e.down]
                .iter()
                .all(|m| m.fp8.is_some() == fp8)
    };
    let bf16 = st.grouped && runs.iter().all(|r| same(r, false));
    let fp8 = st.grouped
        && st.fp8.is_some()
        && scratch.x32.is_some()
        && runs
            .iter()
            .all(|r| same(r, true) && r.rows <= FP8_PIECES * GEMV_TOKENS);
    let routed = Routed { runs, idx, wts };
    if bf16 {
        grouped_experts(ctx, st, z, scratch, (xsp, base), &routed)?;
    } else if fp8 {
        fp8_experts(ctx, st, z, scratch, (xsp, base), &routed)?;
    } else {
        per_expert(ctx, st, z, scratch, (xsp, base), &routed)?;
    }
    Ok(())
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

/// One expert's SwiGLU MLP over `rows` split rows of width `h` at `x` (`[2 · rows × h]`): gate and up
/// products into the scratch's `g2` / `u2`, SwiGLU into `act`, the down product into `y2`.
///
/// # Safety
/// `e`'s matrices must lie in the bound rollout buffer at `base`, `x` hold the rows, and the
/// scratch at least `rows` rows of every product.
unsafe fn expert_ffn(
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

/// The experts one by one: gather, gate, up, SwiGLU, down, weighted scatter per expert.
fn per_expert(
    ctx: &RankCtx,
    st: &RankState,
    z: &Dims,
    scratch: &mut MoeScratch,
    (xsp, base): (u64, u64),
    routed: &Routed,
) -> Result<(), CudaError> {
    let (runs, idx, wts) = (&routed.runs, &routed.idx[..], &routed.wts[..]);
    let (s, rank, k) = (&ctx.compute, ctx.rank, &st.k);
    let steps = Steps { s, k, rank };
    let (n, h) = (z.n, z.h);
    let p = |b: &CudaSlice<f32>| ptr(b, s);
    let u32a = |v: usize| Arg::U32(v as u32);
    let idx_d = s
        .clone_htod(idx)
        .map_err(ctx.drv("uploading routed rows", 0))?;
    let wts_d = s
        .clone_htod(wts)
        .map_err(ctx.drv("uploading routing weights", 0))?;
    let (idxp, wtsp) = (ptr(&idx_d, s), ptr(&wts_d, s));
    let xg = ptr(&scratch.xg, s);
    for run in runs {
        let (e, r) = (run.expert, run.rows);
        let (ri, rw) = (idxp + 4 * run.start as u64, wtsp + 4 * run.start as u64);
        // SAFETY: the weights are offsets checked against this rank's rollout buffer; the
        // scratch holds `r ≤ n ≤ rows` routed rows of every product; `ri` / `rw` address `r`
        // entries of the uploads; in order on the compute stream.
        unsafe {
            steps.gather((xsp, ri, xg), (n, r, h))?;
            expert_ffn(st, &steps, base, e, (xg, r, h), scratch)?;
            launch(
                s,
                &k.scatter_add_rows,
                k.elementwise((r * h) as u64),
                &[
                    Arg::U64(p(&scratch.y2)),
                    Arg::U64(ri),
                    Arg::U64(rw),
                    Arg::U64(p(&scratch.acc)),
                    u32a(r),
                    u32a(h),
                ],
                rank,
                "scatter_add_rows",
            )?;
        }
    }
    // the uploads are freed stream-ordered after the kernels that read them
    drop((idx_d, wts_d));
    Ok(())
}

/// A block of consecutive runs processed at once, each padded to the block's largest: `runs`,
/// where its padded row list starts in the u32 upload (`list`), rows per expert slot (`slot`)
/// and in all (`rows`), where its
/// per-token lists (CSR offsets `n + 1`, then positions) in the u32 upload, its weights in the
/// f32 upload, its pointer arrays in the u64 upload.
struct Block {
    runs: Range<usize>,
    list: usize,
    slot: usize,
    rows: usize,
    csr: usize,
    pos: usize,
    wts: usize,
    ptrs: usize,
}

/// The experts in blocks: every expert of a block gets a slot of as many rows as the block's
/// busiest expert (the spare rows repeat a routed row and are never read back), so each of
/// gate, up and down is one batched GEMM over the block (`cublasGemmBatchedEx`, two problems
/// per expert: its hi and lo rows), beside one gather, one SwiGLU and one scatter that adds
/// each token's experts in expert order.
fn grouped_experts(
    ctx: &RankCtx,
    st: &RankState,
    z: &Dims,
    scratch: &mut MoeScratch,
    (xsp, base): (u64, u64),
    routed: &Routed,
) -> Result<(), CudaError> {
    let (runs, idx, wts) = (&routed.runs[..], &routed.idx[..], &routed.wts[..]);
    let (s, rank, k) = (&ctx.compute, ctx.rank, &st.k);
    let (n, h, f) = (z.n, z.h, runs[0].expert.ffn);
    let addr = |b: &CudaSlice<f32>| ptr(b, s);
    let (xg, act) = (ptr(&scratch.xg, s), ptr(&scratch.act, s));
    let (g2, u2, y2) = (addr(&scratch.g2), addr(&scratch.u2), addr(&scratch.y2));
    let (acc, steps) = (addr(&scratch.acc), Steps { s, k, rank });
    // the uploads: every block's padded row list and token lists; their weights; GEMM pointers
    let mut u32s: Vec<u32> = Vec::new();
    let mut f32s: Vec<f32> = Vec::new();
    let mut ptrs: Vec<u64> = Vec::new();
    let mut blocks = Vec::new();
    let mut a = 0;
    while a < runs.len() {
        // as many experts as fit the scratch with every slot as large as the busiest
        let (mut slot, mut b) = (runs[a].rows, a + 1);
        while b < runs.len() && (b - a + 1) * slot.max(runs[b].rows) <= scratch.rows {
            slot = slot.max(runs[b].rows);
            b += 1;
        }
        let g = b - a;
        let rows = g * slot;
        let rows_at = u32s.len();
        for run in &runs[a..b] {
            let mine = &idx[run.start..run.start + run.rows];
            u32s.extend_from_slice(mine);
            // spare rows: the expert's last routed row again
            let last = mine.last().copied().unwrap_or_default();
            u32s.extend(std::iter::repeat_n(last, slot - run.rows));
        }
        let entries = runs[a..b].iter().enumerate().flat_map(|(j, run)| {
            (0..run.rows).map(move |i| {
                let q = run.start + i;
                (idx[q], (j * slot + i) as u32, wts[q])
            })
        });
        let (csr, pos, wts_at) = push_token_lists(entries, n, &mut u32s, &mut f32s);
        // per product: A, B, C pointer arrays of 2g problems (hi rows of every expert, then lo)
        let ptrs_at = ptrs.len();
        for (weight, x, width_in, y, width_out) in
            [(0, xg, h, g2, f), (1, xg, h, u2, f), (2, act, f, y2, h)]
        {
            for _half in 0..2 {
                for run in &runs[a..b] {
                    let w = match weight {
                        0 => run.expert.gate,
                        1 => run.expert.up,
                        _ => run.expert.down,
                    };
                    ptrs.push(base + 2 * w.off);
                }
            }
            let row = |half: usize, j: usize| (half * rows + j * slot) as u64;
            for half in 0..2 {
                ptrs.extend((0..g).map(|j| x + 2 * row(half, j) * width_in as u64));
            }
            for half in 0..2 {
                ptrs.extend((0..g).map(|j| y + 4 * row(half, j) * width_out as u64));
            }
        }
        blocks.push(Block {
            runs: a..b,
            list: rows_at,
            slot,
            rows,
            csr,
            pos,
            wts: wts_at,
            ptrs: ptrs_at,
        });
        a = b;
    }
    let u32_d = s
        .clone_htod(&u32s)
        .map_err(ctx.drv("uploading routed rows", (u32s.len() * 4) as u64))?;
    let f32_d = s
        .clone_htod(&f32s)
        .map_err(ctx.drv("uploading routing weights", (f32s.len() * 4) as u64))?;
    let ptrs_d = s
        .clone_htod(&ptrs)
        .map_err(ctx.drv("uploading expert GEMM pointers", (ptrs.len() * 8) as u64))?;
    let (u32p, f32p, ptrp) = (ptr(&u32_d, s), ptr(&f32_d, s), ptr(&ptrs_d, s));
    for c in &blocks {
        let g = c.runs.len();
        // pointer arrays of product `i`: A, B, C of 2g entries each
        let arrays = |i: usize| {
            let at = ptrp + 8 * (c.ptrs + i * 6 * g) as u64;
            (at, at + 16 * g as u64, at + 32 * g as u64)
        };
        // SAFETY: the pointer arrays address the expert weights (offsets checked against this
        // rank's rollout buffer) and scratch rows below `2 · rows` (`rows ≤ scratch.rows`); the
        // row and token lists and weights are this block's entries of the uploads; in order on
        // the compute stream.
        unsafe {
            steps.gather((xsp, u32p + 4 * c.list as u64, xg), (n, c.rows, h))?;
            for i in 0..2 {
                batched_gemm(&st.blas, arrays(i), (f, c.slot, h), 2 * g, rank)?;
            }
            steps.swiglu((g2, u2, act), (c.rows, f))?;
            batched_gemm(&st.blas, arrays(2), (h, c.slot, f), 2 * g, rank)?;
            let lists = (
                u32p + 4 * c.csr as u64,
                u32p + 4 * c.pos as u64,
                f32p + 4 * c.wts as u64,
            );
            steps.scatter((y2, acc), lists, (n, c.rows, h))?;
        }
    }
    // the uploads are freed stream-ordered after the kernels that read them
    drop((u32_d, f32_d, ptrs_d));
    Ok(())
}

/// The most pieces of [`GEMV_TOKENS`] rows one fp8 expert is cut into on the weight-streaming
/// path (each piece reads the expert's weights again); an expert with more rows (prefill) sends
/// the layer to the per-expert path, which dequantises each expert once for cuBLAS.
const FP8_PIECES: usize = 8;

/// A block of the fp8 path: its problems (pieces of at most [`GEMV_TOKENS`] rows of one
/// expert) and rows, its first routed row, where its token lists (CSR offsets, positions) start
/// in the u32 upload, its weights in the f32 upload, its product tables in the u64 upload, and
/// the most rows of one problem.
struct Fp8Block {
    problems: usize,
    rows: usize,
    row0: usize,
    csr: usize,
    pos: usize,
    wts: usize,
    table: usize,
    most: usize,
}

/// The fp8 experts of a decode step in blocks (each expert's rows laid out one after another, cut
/// into pieces of at most [`GEMV_TOKENS`]): per block one gather, the activations joined to f32,
/// one weight-streaming launch each for gate, up and down over a table of every piece's product,
/// one SwiGLU and one scatter that adds each token's experts in expert order.
fn fp8_experts(
    ctx: &RankCtx,
    st: &RankState,
    z: &Dims,
    scratch: &mut MoeScratch,
    (xsp, base): (u64, u64),
    routed: &Routed,
) -> Result<(), CudaError> {
    let (runs, idx, wts) = (&routed.runs[..], &routed.idx[..], &routed.wts[..]);
    let (s, rank, k) = (&ctx.compute, ctx.rank, &st.k);
    let kf = st
        .fp8
        .as_ref()
        .ok_or_else(|| CudaError::Invalid("fp8 experts bound without the fp8 kernels".into()))?;
    let x32 = match &scratch.x32 {
        Some(b) => ptr(b, s),
        None => {
            return Err(CudaError::Invalid(
                "fp8 experts without their scratch".into(),
            ))
        }
    };
    let (n, h, f) = (z.n, z.h, runs[0].expert.ffn);
    let addr = |b: &CudaSlice<f32>| ptr(b, s);
    let (xg, act) = (ptr(&scratch.xg, s), ptr(&scratch.act, s));
    let (g2, u2, y2) = (addr(&scratch.g2), addr(&scratch.u2), addr(&scratch.y2));
    let (acc, steps) = (addr(&scratch.acc), Steps { s, k, rank });
    let mut u32s: Vec<u32> = idx.to_vec();
    let mut f32s: Vec<f32> = Vec::new();
    let mut table: Vec<u64> = Vec::new();
    let mut blocks: Vec<Fp8Block> = Vec::new();
    let mut a = 0;
    while a < runs.len() {
        let (row0, mut rows, mut b) = (runs[a].start, 0, a);
        while b < runs.len() && (b == a || rows + runs[b].rows <= scratch.rows) {
            rows += runs[b].rows;
            b += 1;
        }
        let entries = (row0..row0 + rows).map(|q| (idx[q], (q - row0) as u32, wts[q]));
        let (csr, pos, wts_at) = push_token_lists(entries, n, &mut u32s, &mut f32s);
        // per product, per expert: e4m3 matrix, scales, first row, columns, activations, rows,
        // hi outputs, lo outputs
        let table_at = table.len();
        // pieces: (expert's run, first row in the block, rows)
        let pieces: Vec<(&Run, usize, usize)> = runs[a..b]
            .iter()
            .flat_map(|run| {
                (0..run.rows)
                    .step_by(GEMV_TOKENS)
                    .map(move |c| (run, run.start - row0 + c, GEMV_TOKENS.min(run.rows - c)))
            })
            .collect();
        for (weight, inp, y, out) in [(0, h, g2, f), (1, h, u2, f), (2, f, y2, h)] {
            for &(run, o, k_rows) in &pieces {
                let w = match weight {
                    0 => run.expert.gate,
                    1 => run.expert.up,
                    _ => run.expert.down,
                };
                let q = w
                    .fp8
                    .ok_or_else(|| CudaError::Invalid("a bf16 expert among fp8".into()))?;
                let o = o as u64;
                table.extend([
                    base + 2 * w.off,
                    base + 2 * q.scales,
                    q.row0,
                    inp as u64,
                    x32 + 4 * o * inp as u64,
                    k_rows as u64,
                    y + 4 * o * out as u64,
                    y + 4 * (rows as u64 + o) * out as u64,
                ]);
            }
        }
        blocks.push(Fp8Block {
            problems: pieces.len(),
            rows,
            row0,
            csr,
            pos,
            wts: wts_at,
            table: table_at,
            most: pieces.iter().map(|p| p.2).max().unwrap_or(1),
        });
        a = b;
    }
    let u32_d = s
        .clone_htod(&u32s)
        .map_err(ctx.drv("uploading routed rows", (u32s.len() * 4) as u64))?;
    let f32_d = s
        .clone_htod(&f32s)
        .map_err(ctx.drv("uploading routing weights", (f32s.len() * 4) as u64))?;
    let table_d = s
        .clone_htod(&table)
        .map_err(ctx.drv("uploading the fp8 product table", (table.len() * 8) as u64))?;
    let (u32p, f32p, tp) = (ptr(&u32_d, s), ptr(&f32_d, s), ptr(&table_d, s));
    let w8a8 = st.fp8_compute == Fp8Compute::W8A8;
    // SAFETY: x32 holds the block's `rows · max(h, ffn)` f32.
    let requant = |dims| unsafe { requantise(s, kf, x32, dims, w8a8, rank) };
    for c in &blocks {
        let (g, rows, most) = (c.problems, c.rows, c.most);
        // the table of product `i`: 8 entries per problem
        let entry = |i: usize| tp + 8 * (c.table + i * 8 * g) as u64;
        // SAFETY: the table addresses the experts' e4m3 matrices and scales (offsets checked
        // against this rank's rollout buffer) and scratch rows below `2 · rows` (`rows ≤
        // scratch.rows`; the f32 activations hold `rows · max(h, ffn)`); the row and token lists
        // and weights are this block's entries of the uploads; in order on the compute stream.
        unsafe {
            steps.gather((xsp, u32p + 4 * c.row0 as u64, xg), (n, rows, h))?;
            fp8_join(s, kf, (xg, x32), (rows, h), rank)?;
            requant((rows, h))?;
            fp8_gemv_table(s, kf, entry(0), (g, f, most), false, rank)?;
            fp8_gemv_table(s, kf, entry(1), (g, f, most), false, rank)?;
            steps.swiglu((g2, u2, act), (rows, f))?;
            fp8_join(s, kf, (act, x32), (rows, f), rank)?;
            requant((rows, f))?;
            fp8_gemv_table(s, kf, entry(2), (g, h, most), false, rank)?;
            let lists = (
                u32p + 4 * c.csr as u64,
                u32p + 4 * c.pos as u64,
                f32p + 4 * c.wts as u64,
            );
            steps.scatter((y2, acc), lists, (n, rows, h))?;
        }
    }
    // the uploads are freed stream-ordered after the kernels that read them
    drop((u32_d, f32_d, table_d));
    Ok(())
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

/// Appends a block's per-token lists to the uploads: `n + 1` CSR offsets to `u32s`, then every
/// token's entries (position in the block, in expert order) to `u32s` and their weights to
/// `f32s`. `entries` are `(token, position, weight)` in expert order. Returns where the offsets,
/// the positions and the weights start.
fn push_token_lists(
    entries: impl Iterator<Item = (u32, u32, f32)>,
    n: usize,
    u32s: &mut Vec<u32>,
    f32s: &mut Vec<f32>,
) -> (usize, usize, usize) {
    let mut lists: Vec<Vec<(u32, f32)>> = vec![Vec::new(); n];
    for (t, q, w) in entries {
        lists[t as usize].push((q, w));
    }
    let (csr, wts) = (u32s.len(), f32s.len());
    let mut at = 0u32;
    u32s.push(0);
    for l in &lists {
        at += l.len() as u32;
        u32s.push(at);
    }
    let pos = u32s.len();
    for &(q, w) in lists.iter().flatten() {
        u32s.push(q);
        f32s.push(w);
    }
    (csr, pos, wts)
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
