//! On the GPU (`cargo test --release -p lifecycle-decoder-gpu --lib tiled -- --ignored
//! --nocapture`): a prefill's attention in tiles of rows (`attention_tiled*`) against the same
//! attention in f64 on the host and against the kernel of a block per row and query head, over
//! f32, bf16 and fp8 caches whose pages lie in another order than their positions: prompts from
//! position 0 and continued after cached positions, runs longer than a tile, single rows beside
//! them, grouped-query heads; and its outputs quantised for the W8A8 o product (d = 128).

use half::bf16;
use lifecycle_cuda::cudarc::driver::LaunchConfig;
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::{alloc_device, CudaError, RankCtx, RankExecutor, ThreadRankPool};
use lifecycle_decoder::KvDtype;
use lifecycle_layout::fp8::e4m3_to_f32;

use super::split_tests::{cache_of, paged, values};
use super::tiles::prefill_tiles;
use crate::decoder::pages::KV_PAGE_POSITIONS;
use crate::kernels::{
    attention_shared_bytes, launch, ptr, tile_shared_bytes, Arg, DecoderKernels, ATTENTION_THREADS,
};

/// One case: `slots` sequences of `cap` positions; rows `(slot, position)` in pass order.
struct Case {
    qh: usize,
    kvh: usize,
    d: usize,
    slots: usize,
    cap: usize,
    rows: Vec<(usize, usize)>,
}

/// softmax(q·k / √d) · v per (row, query head) in f64 over positions 0..=position.
fn host(c: &Case, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f64> {
    let (d, qh, kvh) = (c.d, c.qh, c.kvh);
    let group = qh / kvh;
    let mut out = vec![0.0f64; c.rows.len() * qh * d];
    for (r, &(slot, pos)) in c.rows.iter().enumerate() {
        for j in 0..qh {
            let at = |p: usize, t: usize| ((slot * c.cap + p) * kvh + j / group) * d + t;
            let qr = &q[(r * qh + j) * d..][..d];
            let scores: Vec<f64> = (0..=pos)
                .map(|p| {
                    (0..d)
                        .map(|t| qr[t] as f64 * k[at(p, t)] as f64)
                        .sum::<f64>()
                })
                .map(|s| s / (d as f64).sqrt())
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let tot: f64 = e.iter().sum();
            for t in 0..d {
                out[(r * qh + j) * d + t] =
                    (0..=pos).map(|p| e[p] * v[at(p, t)] as f64).sum::<f64>() / tot;
            }
        }
    }
    out
}

/// What the kernels gave: the tiled kernel's and the whole kernel's outputs (hi + lo), and with
/// `quant` (d = 128) the tiled kernel's quantised outputs as values (`rows + 2` tokens: two
/// padded) and scales.
struct Outputs {
    tiled: Vec<f32>,
    whole: Vec<f32>,
    quant: Option<(Vec<f32>, Vec<f32>)>,
}

fn on_device(
    ctx: &RankCtx,
    k: &DecoderKernels,
    c: &Case,
    kv: KvDtype,
    (q, kb, vb): (&[f32], &[u8], &[u8]),
    quant: bool,
) -> Result<Outputs, CudaError> {
    let s = &ctx.compute;
    let up = |what: &str| ctx.drv(what, 0);
    let n = c.rows.len();
    let (qh, d) = (c.qh, c.d);
    let ((kb, table, pps), (vb, _, _)) = (paged(kb, c.slots, c.cap), paged(vb, c.slots, c.cap));
    let seqs: Vec<u32> = c.rows.iter().map(|r| r.0 as u32).collect();
    let poss: Vec<u32> = c.rows.iter().map(|r| r.1 as u32).collect();
    let tiles = prefill_tiles(&seqs, &poss);
    let count = tiles.len() / 2;
    let qd = s.clone_htod(q).map_err(up("q"))?;
    let kd = s.clone_htod(&kb).map_err(up("k"))?;
    let vd = s.clone_htod(&vb).map_err(up("v"))?;
    let td = s.clone_htod(&table).map_err(up("page table"))?;
    let tl = s.clone_htod(&tiles).map_err(up("tiles"))?;
    let seqs = s.clone_htod(&seqs).map_err(up("seqs"))?;
    let poss = s.clone_htod(&poss).map_err(up("poss"))?;
    let padded = n + 2;
    let width = qh * d;
    // SAFETY: written by the kernels below before they are read (every output element, and
    // every quantised token, padded ones included, is written).
    let (out_tiled, out_whole, aq, asc) = unsafe {
        (
            alloc_device::<u16>(s, 2 * n * width, 0, "tiled output")?,
            alloc_device::<u16>(s, 2 * n * width, 0, "whole output")?,
            alloc_device::<u8>(s, padded * width, 0, "quantised output")?,
            alloc_device::<f32>(s, padded * qh, 0, "quantised scales")?,
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
        u(0),
        u(qh / c.kvh),
        u(0),
        Arg::F32(1.0 / (d as f32).sqrt()),
    ];
    let no_quant = [Arg::U64(0), Arg::U64(0), u(0), u(0), u(0)];
    // the quantisation in row-major groups of 128: token r's group j at r · width + 128 j, its
    // scale at r · qh + j
    let with_quant = [
        Arg::U64(ptr(&aq, s)),
        Arg::U64(ptr(&asc, s)),
        u(qh),
        u(1),
        u(0),
    ];
    let (tiled, whole) = match kv {
        KvDtype::F32 => (&k.attention_tiled, &k.attention),
        KvDtype::Bf16 => (&k.attention_tiled_bf16, &k.attention_bf16),
        KvDtype::Fp8 => (&k.attention_tiled_fp8, &k.attention_fp8),
    };
    let tiled_args = |out: u64, q: [Arg; 5]| -> Vec<Arg> {
        place
            .iter()
            .copied()
            .chain([Arg::U64(out)])
            .chain(dims)
            .chain([Arg::U64(ptr(&tl, s)), u(count)])
            .chain(q)
            .collect()
    };
    let whole_args: Vec<Arg> = place
        .iter()
        .copied()
        .chain([Arg::U64(ptr(&out_whole, s))])
        .chain(dims)
        .chain(no_quant)
        .collect();
    let threads = (ATTENTION_THREADS as u32, 1, 1);
    let tiled_cfg = |blocks: usize| LaunchConfig {
        grid_dim: ((blocks * qh) as u32, 1, 1),
        block_dim: threads,
        shared_mem_bytes: tile_shared_bytes(pps * KV_PAGE_POSITIONS, d) as u32,
    };
    let whole_cfg = LaunchConfig {
        grid_dim: ((n * qh) as u32, 1, 1),
        block_dim: threads,
        shared_mem_bytes: attention_shared_bytes(pps * KV_PAGE_POSITIONS, d) as u32,
    };
    // SAFETY: the buffers above hold what each kernel's contract (kernels/decoder.cu) reads
    // and writes for these sizes.
    unsafe {
        let args = tiled_args(ptr(&out_tiled, s), no_quant);
        launch(s, tiled, tiled_cfg(count), &args, 0, "attention_tiled")?;
        launch(s, whole, whole_cfg, &whole_args, 0, "attention")?;
        if quant {
            let args = tiled_args(0, with_quant);
            launch(s, tiled, tiled_cfg(count + 2), &args, 0, "attention_tiled")?;
        }
    }
    let joined = |b: Vec<u16>| -> Vec<f32> {
        let half = b.len() / 2;
        (0..half)
            .map(|i| bf16::from_bits(b[i]).to_f32() + bf16::from_bits(b[half + i]).to_f32())
            .collect()
    };
    let quant = if quant {
        let bytes = s.clone_dtoh(&aq).map_err(up("quantised output back"))?;
        let scales = s.clone_dtoh(&asc).map_err(up("scales back"))?;
        let values = bytes
            .iter()
            .enumerate()
            .map(|(i, &b)| e4m3_to_f32(b) * scales[i / 128])
            .collect();
        Some((values, scales))
    } else {
        None
    };
    Ok(Outputs {
        tiled: joined(s.clone_dtoh(&out_tiled).map_err(up("tiled output back"))?),
        whole: joined(s.clone_dtoh(&out_whole).map_err(up("whole output back"))?),
        quant,
    })
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tiled_prefill_attention_matches_the_host_and_the_whole_kernel(
) -> Result<(), Box<dyn std::error::Error>> {
    require_gpus(1)?;
    let pool = ThreadRankPool::new(1)?;
    let prompt = |slot: usize, from: usize, to: usize| (from..to).map(move |p| (slot, p));
    let cases = [
        // Qwen2.5-7B's heads: a prompt of 150 from 0, one continued at 70 (cached 0..70), a
        // decode row of a third sequence, a prompt crossing two pages from 120
        Case {
            qh: 28,
            kvh: 4,
            d: 128,
            slots: 3,
            cap: 320,
            rows: prompt(0, 0, 150)
                .chain(prompt(1, 70, 90))
                .chain([(2, 300)])
                .chain(prompt(2, 120, 200))
                .collect(),
        },
        // small heads (the fixture models'), 2 query heads a kv head, single-row tiles
        Case {
            qh: 4,
            kvh: 2,
            d: 8,
            slots: 2,
            cap: 200,
            rows: prompt(0, 0, 37).chain([(1, 5), (1, 199)]).collect(),
        },
        // heads of 64, 16 query heads a kv head, a prompt of 3 pages
        Case {
            qh: 16,
            kvh: 1,
            d: 64,
            slots: 1,
            cap: 192,
            rows: prompt(0, 0, 192).collect(),
        },
    ];
    let report = pool.run(&|ctx| {
        let k = DecoderKernels::load(ctx)?;
        let mut lines = Vec::new();
        for (i, c) in cases.iter().enumerate() {
            let n = c.rows.len();
            let q = values(n * c.qh * c.d, 17 + i as u64);
            let kv_len = c.slots * c.cap * c.kvh * c.d;
            let kraw: Vec<f32> = values(kv_len, 300 + i as u64)
                .iter()
                .map(|x| 3.0 * x)
                .collect();
            let vraw = values(kv_len, 400 + i as u64);
            for kv in [KvDtype::F32, KvDtype::Bf16, KvDtype::Fp8] {
                let (kb, kh) = cache_of(kv, &kraw, c.d);
                let (vb, vh) = cache_of(kv, &vraw, c.d);
                let want = host(c, &q, &kh, &vh);
                let quant = c.d == 128;
                let got = on_device(ctx, &k, c, kv, (&q, &kb, &vb), quant)?;
                let err = |got: &[f32]| {
                    got.iter()
                        .zip(&want)
                        .map(|(&g, &w)| (g as f64 - w).abs())
                        .fold(0.0f64, f64::max)
                };
                let scale = want.iter().fold(0.0f64, |a, w| a.max(w.abs())).max(1e-3);
                let (et, ew) = (err(&got.tiled), err(&got.whole));
                let mut line = format!(
                    "case {i} ({n} rows, d {}, {} tiles) {kv:?}: tiled max |Δ| {et:.2e}, whole \
                     {ew:.2e} (outputs to {scale:.2e})",
                    c.d,
                    prefill_tiles(
                        &c.rows.iter().map(|r| r.0 as u32).collect::<Vec<_>>(),
                        &c.rows.iter().map(|r| r.1 as u32).collect::<Vec<_>>()
                    )
                    .len()
                        / 2
                );
                if et > 1e-4 * scale || ew > 1e-4 * scale {
                    return Err(CudaError::Invalid(format!("{line}: beyond 1e-4 of it")));
                }
                if let Some((values, scales)) = &got.quant {
                    // each group of 128 (one row and head) within half an e4m3 step (2^-4
                    // relative) of its largest value; the padded tokens zero with unit scales
                    let width = c.qh * c.d;
                    let mut worst = 0.0f64;
                    for (g, group) in values[..n * width].chunks(128).enumerate() {
                        let exact = &want[g * 128..][..128];
                        let amax = exact.iter().fold(0.0f64, |a, w| a.max(w.abs()));
                        for (v, w) in group.iter().zip(exact) {
                            worst = worst.max((*v as f64 - w).abs() / amax.max(1e-12));
                        }
                    }
                    let pads_zero = values[n * width..].iter().all(|&v| v == 0.0)
                        && scales[n * c.qh..].iter().all(|&s| s == 1.0);
                    line.push_str(&format!(
                        "; quantised within {worst:.2e} of each group's largest"
                    ));
                    if worst > 1.0 / 16.0 || !pads_zero {
                        return Err(CudaError::Invalid(format!(
                            "{line}: beyond 2^-4, or padded tokens not zero ({pads_zero})"
                        )));
                    }
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
