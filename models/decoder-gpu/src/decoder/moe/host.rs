//! The host-routed path of a mixture-of-experts layer: the router's logits downloaded, each
//! row's top-k by [`lifecycle_decoder::route_top_k`], the row lists uploaded, then the experts.
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

use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::{CudaError, RankCtx};

use super::scratch::MoeScratch;
use super::steps::{expert_ffn, requantise, router_logits, Steps};
use crate::blas::batched_gemm;
use crate::decoder::rank::{Dims, RankState};
use crate::fp8::{fp8_gemv_table, fp8_join, GEMV_TOKENS};
use crate::kernels::{launch, ptr, Arg};
use crate::weights::{ExpertOffsets, MoeOffsets};
use lifecycle_layout::fp8::Fp8Compute;

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

/// The routed experts of one layer, routed on the host: the router's logits downloaded, each
/// row's top-k by [`lifecycle_decoder::route_top_k`], the row lists uploaded, then the grouped,
/// fp8 or per-expert path; the sum in `acc`.
pub(super) fn host_routed_experts(
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
