//! On the GPU (`cargo test --release -p lifecycle-decoder-gpu --lib split -- --ignored
//! --nocapture`): a decode step's attention split over the cache (`attention_split*` then
//! `attention_join`) against the same attention in f64 on the host and against the kernel of a
//! block per row and query head, over f32, bf16 and fp8 caches, grouped-query heads (7 query
//! heads a kv head, as Qwen2.5-7B), a tensor-parallel rank's share of them, and lengths around
//! and across the chunks; every cache paged, its pages in another order than its positions.

use half::bf16;
use lifecycle_cuda::cudarc::driver::LaunchConfig;
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::{alloc_device, CudaError, RankCtx, RankExecutor, ThreadRankPool};
use lifecycle_decoder::KvDtype;
use lifecycle_layout::fp8::{e4m3_from_f32, e4m3_to_f32};

use crate::decoder::pages::KV_PAGE_POSITIONS;
use crate::kernels::{
    attention_shared_bytes, launch, ptr, Arg, DecoderKernels, SplitAttention, ATTENTION_THREADS,
};

/// One case: heads of this rank (`qh` from global head `q_base`, `kvh` from `kv_base`), the
/// global group, `head_dim`, the cache's capacity and each row's length.
struct Case {
    qh: usize,
    kvh: usize,
    group: usize,
    q_base: usize,
    kv_base: usize,
    d: usize,
    cap: usize,
    lens: Vec<usize>,
}

/// Deterministic values in about [-1, 1).
pub(super) fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A cache block `[slots × cap × kvh × d]` (positions in order, before [`paged`] pages it) of
/// `kv` as its bytes, and the values it holds.
pub(super) fn cache_of(kv: KvDtype, vals: &[f32], d: usize) -> (Vec<u8>, Vec<f32>) {
    match kv {
        KvDtype::F32 => (
            vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
            vals.to_vec(),
        ),
        KvDtype::Bf16 => {
            let b: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
            (
                b.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
                b.iter().map(|v| v.to_f32()).collect(),
            )
        }
        KvDtype::Fp8 => {
            // a record per (position, kv head): d e4m3 bytes, then the f32 scale
            let mut bytes = Vec::with_capacity(vals.len() / d * (d + 4));
            let mut held = Vec::with_capacity(vals.len());
            for head in vals.chunks_exact(d) {
                let amax = head.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
                for &v in head {
                    let b = e4m3_from_f32(v / s);
                    bytes.push(b);
                    held.push(e4m3_to_f32(b) * s);
                }
                bytes.extend(s.to_le_bytes());
            }
            (bytes, held)
        }
    }
}

/// softmax(q·k / √d) · v per (row, local query head) in f64, rows over slots 0, 1, ...
fn host(c: &Case, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f64> {
    let (d, qh, kvh) = (c.d, c.qh, c.kvh);
    let mut out = vec![0.0f64; c.lens.len() * qh * d];
    for (r, &len) in c.lens.iter().enumerate() {
        for j in 0..qh {
            let kv = (c.q_base + j) / c.group - c.kv_base;
            let at = |p: usize, t: usize| ((r * c.cap + p) * kvh + kv) * d + t;
            let qr = &q[(r * qh + j) * d..][..d];
            let scores: Vec<f64> = (0..len)
                .map(|p| {
                    (0..d)
                        .map(|t| qr[t] as f64 * k[at(p, t)] as f64)
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let tot: f64 = e.iter().sum();
            for t in 0..d {
                out[(r * qh + j) * d + t] =
                    (0..len).map(|p| e[p] * v[at(p, t)] as f64).sum::<f64>() / tot;
            }
        }
    }
    out
}

/// The cache of `rows` sequences of `cap` positions (`bytes`, positions in order) in pages of
/// [`KV_PAGE_POSITIONS`]: the pages in reverse of the order a grown cache lays them out, and the
/// page table `[rows][pps]` that finds them; and `pps`.
pub(super) fn paged(bytes: &[u8], rows: usize, cap: usize) -> (Vec<u8>, Vec<u32>, usize) {
    let pos = bytes.len() / (rows * cap);
    let pps = cap.div_ceil(KV_PAGE_POSITIONS);
    let pages = rows * pps;
    let table: Vec<u32> = (0..rows)
        .flat_map(|s| (0..pps).map(move |j| (pages - 1 - (j * rows + s)) as u32))
        .collect();
    let mut out = vec![0u8; pages * KV_PAGE_POSITIONS * pos];
    for s in 0..rows {
        for p in 0..cap {
            let page = table[s * pps + p / KV_PAGE_POSITIONS] as usize;
            let at = (page * KV_PAGE_POSITIONS + p % KV_PAGE_POSITIONS) * pos;
            out[at..at + pos].copy_from_slice(&bytes[(s * cap + p) * pos..][..pos]);
        }
    }
    (out, table, pps)
}

/// Both kernels' outputs (hi + lo) for `c` over a cache of `kv` (paged as [`paged`] lays it out): the split one (its query heads
/// shared by blocks as on a device of `sms` multiprocessors), then the one of a block per row
/// and query head.
fn on_device(
    ctx: &RankCtx,
    k: &DecoderKernels,
    c: &Case,
    kv: KvDtype,
    (q, kb, vb): (&[f32], &[u8], &[u8]),
    sms: usize,
) -> Result<[Vec<f32>; 2], CudaError> {
    let s = &ctx.compute;
    let up = |what: &str| ctx.drv(what, 0);
    let n = c.lens.len();
    let (qh, d) = (c.qh, c.d);
    let ((kb, table, pps), (vb, _, _)) = (paged(kb, n, c.cap), paged(vb, n, c.cap));
    let plan = SplitAttention::for_cache(pps * KV_PAGE_POSITIONS, d)
        .ok_or_else(|| CudaError::Invalid(format!("no split for head_dim {d}")))?;
    let qd = s.clone_htod(q).map_err(up("q"))?;
    let kd = s.clone_htod(&kb).map_err(up("k"))?;
    let vd = s.clone_htod(&vb).map_err(up("v"))?;
    let td = s.clone_htod(&table).map_err(up("page table"))?;
    let seqs: Vec<u32> = (0..n as u32).collect();
    let poss: Vec<u32> = c.lens.iter().map(|&l| l as u32 - 1).collect();
    let seqs = s.clone_htod(&seqs).map_err(up("seqs"))?;
    let poss = s.clone_htod(&poss).map_err(up("poss"))?;
    let heads = n * qh * plan.splits;
    // SAFETY: written by the kernels below before they are read (the join reads the chunks
    // each row's length covers, which the split kernel writes; every output element is written).
    let (po, pml, out_split, out_whole) = unsafe {
        (
            alloc_device::<f32>(s, heads * d, 0, "partial sums")?,
            alloc_device::<f32>(s, heads * 2, 0, "partial maxima")?,
            alloc_device::<u16>(s, 2 * n * qh * d, 0, "split output")?,
            alloc_device::<u16>(s, 2 * n * qh * d, 0, "whole output")?,
        )
    };
    let u = |v: usize| Arg::U32(v as u32);
    let place = [
        Arg::U64(ptr(&qd, s)),
        Arg::U64(ptr(&kd, s)),
        Arg::U64(ptr(&vd, s)),
        Arg::U64(ptr(&seqs, s)),
        Arg::U64(ptr(&poss, s)),
    ];
    let dims = [
        u(n),
        u(qh),
        u(c.kvh),
        u(d),
        Arg::U64(ptr(&td, s)),
        u(pps),
        u(c.q_base),
        u(c.group),
        u(c.kv_base),
        Arg::F32(1.0 / (d as f32).sqrt()),
    ];
    let no_quant = [Arg::U64(0), Arg::U64(0), u(0), u(0), u(0)];
    let (split, whole) = match kv {
        KvDtype::F32 => (&k.attention_split, &k.attention),
        KvDtype::Bf16 => (&k.attention_split_bf16, &k.attention_bf16),
        KvDtype::Fp8 => (&k.attention_split_fp8, &k.attention_fp8),
    };
    let args: Vec<Arg> = place
        .iter()
        .copied()
        .chain([Arg::U64(ptr(&po, s)), Arg::U64(ptr(&pml, s))])
        .chain(dims)
        .chain([u(plan.chunk), u(plan.splits)])
        .collect();
    let join = [
        Arg::U64(ptr(&po, s)),
        Arg::U64(ptr(&pml, s)),
        Arg::U64(ptr(&poss, s)),
        Arg::U64(ptr(&out_split, s)),
        u(n),
        u(qh),
        u(d),
        u(plan.chunk),
        u(plan.splits),
    ];
    let join: Vec<Arg> = join.into_iter().chain(no_quant).collect();
    let whole_args: Vec<Arg> = place
        .iter()
        .copied()
        .chain([Arg::U64(ptr(&out_whole, s))])
        .chain(dims)
        .chain(no_quant)
        .collect();
    let rows = LaunchConfig {
        grid_dim: ((n * qh) as u32, 1, 1),
        block_dim: (d.next_multiple_of(32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let whole_cfg = LaunchConfig {
        block_dim: (ATTENTION_THREADS as u32, 1, 1),
        shared_mem_bytes: attention_shared_bytes(pps * KV_PAGE_POSITIONS, d) as u32,
        ..rows
    };
    // SAFETY: the buffers above hold what each kernel's contract (kernels/decoder.cu) reads
    // and writes for these sizes.
    unsafe {
        let (cfg, heads) = plan.split_launch(n, c.kvh, c.group, d, sms);
        let args: Vec<Arg> = args
            .iter()
            .copied()
            .chain([u(heads as usize), u(sms)])
            .collect();
        launch(s, split, cfg, &args, 0, "attention_split")?;
        launch(s, &k.attention_join, rows, &join, 0, "attention_join")?;
        launch(s, whole, whole_cfg, &whole_args, 0, "attention")?;
    }
    let joined = |b: Vec<u16>| -> Vec<f32> {
        let half = b.len() / 2;
        (0..half)
            .map(|i| bf16::from_bits(b[i]).to_f32() + bf16::from_bits(b[half + i]).to_f32())
            .collect()
    };
    let a = s.clone_dtoh(&out_split).map_err(up("split output back"))?;
    let b = s.clone_dtoh(&out_whole).map_err(up("whole output back"))?;
    Ok([joined(a), joined(b)])
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn split_attention_matches_the_host_and_the_whole_kernel() -> Result<(), Box<dyn std::error::Error>>
{
    require_gpus(1)?;
    let pool = ThreadRankPool::new(1)?;
    let q7 = |q_base, qh, kv_base, kvh, cap, lens: &[usize]| Case {
        qh,
        kvh,
        group: 7,
        q_base,
        kv_base,
        d: 128,
        cap,
        lens: lens.to_vec(),
    };
    let cases = [
        // Qwen2.5-7B's heads, lengths around one and two chunks of 128 and across many
        q7(
            0,
            28,
            0,
            4,
            1024,
            &[1, 2, 127, 128, 129, 255, 256, 257, 1000],
        ),
        // a 12 k context in chunks of 192 (cap 12 288 → 64 chunks)
        q7(0, 28, 0, 4, 12288, &[12288, 7001]),
        // the second rank of two: global query heads 14..28, kv heads 2..4
        q7(14, 14, 2, 2, 2048, &[3, 1500]),
        // a capacity past 16 k: chunks of 320
        q7(0, 28, 0, 4, 20000, &[20000]),
        // small heads (the fixture models'), 2 query heads a kv head
        Case {
            qh: 4,
            kvh: 2,
            group: 2,
            q_base: 0,
            kv_base: 0,
            d: 8,
            cap: 700,
            lens: vec![1, 300, 700],
        },
        // 16 query heads a kv head: two blocks of 8 share it
        Case {
            qh: 16,
            kvh: 1,
            group: 16,
            q_base: 0,
            kv_base: 0,
            d: 64,
            cap: 600,
            lens: vec![599, 5],
        },
    ];
    let report = pool.run(&|ctx| {
        let k = DecoderKernels::load(ctx)?;
        let mut lines = Vec::new();
        for (i, c) in cases.iter().enumerate() {
            let n = c.lens.len();
            let q = values(n * c.qh * c.d, 7 + i as u64);
            // the cache's slots 0..n (scaled so that the softmax is not flat)
            let kv_len = n * c.cap * c.kvh * c.d;
            let kraw: Vec<f32> = values(kv_len, 100 + i as u64)
                .iter()
                .map(|x| 3.0 * x)
                .collect();
            let vraw = values(kv_len, 200 + i as u64);
            for kv in [KvDtype::F32, KvDtype::Bf16, KvDtype::Fp8] {
                let (kb, kh) = cache_of(kv, &kraw, c.d);
                let (vb, vh) = cache_of(kv, &vraw, c.d);
                let want = host(c, &q, &kh, &vh);
                let data = (&q[..], &kb[..], &vb[..]);
                let [split, whole] = on_device(ctx, &k, c, kv, data, k.sm_count as usize)?;
                // every query head of a kv head in one block, then one head a block: the same
                // bits (a head's sums do not depend on the heads beside it)
                for sms in [1, 1 << 20] {
                    let [other, _] = on_device(ctx, &k, c, kv, data, sms)?;
                    let same = other
                        .iter()
                        .zip(&split)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    if !same {
                        return Err(CudaError::Invalid(format!(
                            "case {i} {kv:?}: the split output changed with the heads a block \
                             takes (as for {sms} multiprocessors)"
                        )));
                    }
                }
                let err = |got: &[f32]| {
                    got.iter()
                        .zip(&want)
                        .map(|(&g, &w)| (g as f64 - w).abs())
                        .fold(0.0f64, f64::max)
                };
                let scale = want.iter().fold(0.0f64, |a, w| a.max(w.abs())).max(1e-3);
                let (es, ew) = (err(&split), err(&whole));
                let line = format!(
                    "case {i} ({} rows, d {}, cap {}) {kv:?}: split max |Δ| {es:.2e}, whole \
                     {ew:.2e} (outputs to {scale:.2e})",
                    n, c.d, c.cap
                );
                // hi + lo keeps ~16 bits: 1e-4 of the largest output covers both sums' rounding
                if es > 1e-4 * scale || ew > 1e-4 * scale {
                    return Err(CudaError::Invalid(format!("{line}: beyond 1e-4 of it")));
                }
                lines.push(line);
            }
        }
        Ok(lines)
    })?;
    for line in report.into_iter().flatten() {
        println!("{line}");
    }
    Ok(())
}
