//! On the GPU (`cargo test --release -p lifecycle-decoder-gpu --lib bf16_mma -- --ignored
//! --nocapture`): the bf16 products of the tensor-core kernel ([`MmaKernels::bf16`]) against
//! the same sums in f64 on the host and against cuBLAS's, each run twice for the same bits.
use super::mma::MmaKernels;
use super::tests::{print_report, split};
use super::*;
use crate::blas::{gemm, handle};
use crate::kernels::ptr;
use half::bf16;
use lifecycle_cuda::cudarc::driver::{CudaSlice, CudaStream};
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::{alloc_device, CudaError, RankCtx};
use lifecycle_cuda::{RankExecutor, ThreadRankPool};
use std::sync::Arc;

/// Deterministic values in ±`scale`.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Bound of the f32 sums against the f64 ones, relative to Σ|terms| (the split activations'
/// products are exact in f32; only the accumulation rounds).
const TOLERANCE: f64 = 1e-5;

/// One launch's outputs read back (each product's `2 · tokens · out` f32), after running it
/// twice: the second run must give the same bits.
fn bf16_twice(
    s: &Arc<CudaStream>,
    m: &MmaKernels,
    prods: &[MmaProduct],
    ys: &[&CudaSlice<f32>],
    x: u64,
    (zero_lo, tokens, inp): (bool, usize, usize),
    ctx: &RankCtx,
) -> Result<Vec<Vec<f32>>, CudaError> {
    let mut runs = Vec::new();
    for _ in 0..2 {
        // SAFETY: the buffers hold the sizes the products read and write (the caller's).
        unsafe { m.bf16(s, prods, x, zero_lo, (tokens, inp), 0)? };
        let got = ys
            .iter()
            .map(|y| s.clone_dtoh(*y).map_err(ctx.drv("y back", 0)))
            .collect::<Result<Vec<_>, _>>()?;
        runs.push(got);
    }
    let same = runs[0]
        .iter()
        .zip(&runs[1])
        .all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
    if !same {
        return Err(CudaError::Invalid(format!(
            "{tokens} tokens x {inp}: the bf16 kernel gave other bits on its second run"
        )));
    }
    Ok(runs.swap_remove(0))
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bf16_mma_matches_the_host_sums_and_cublas() -> Result<(), Box<dyn std::error::Error>> {
    require_gpus(1)?;
    let pool = ThreadRankPool::new(1)?;
    // (rows of each product, tokens, inputs): unsplit and split row blocks, sums added by the
    // last block (≤ 8 tokens) and by w8a8_reduce (more), rows ending inside a warp's tile, one
    // to six products a launch (a LoRA group's A matrices of 8 or 64 rows riding beside their
    // base products), every token count of a tile
    let shapes: [(&[usize], usize, usize); 13] = [
        (&[3584, 512, 512, 64, 64, 64], 2, 3584),
        (&[18944, 18944, 8, 8], 8, 3584),
        (&[3584, 64], 1, 18944),
        (&[3584], 1, 3584),
        (&[512, 512], 2, 3584),
        (&[3584, 512, 512], 3, 3584),
        (&[8192], 4, 3584),
        (&[3584], 5, 18944),
        (&[200], 7, 640),
        (&[4608], 9, 3584),
        (&[3584], 16, 18944),
        (&[1000, 24], 27, 1152),
        (&[64], 32, 64),
    ];
    let report = pool.run(&|ctx| {
        let s = &ctx.compute;
        let Some(m) = MmaKernels::load(ctx)? else {
            return Ok(vec![
                "the tensor-core kernels need compute capability 8.9".into()
            ]);
        };
        let blas = handle(s, 0)?;
        let up = |what: &str| ctx.drv(what, 0);
        let mut lines = Vec::new();
        for (i, &(outs, tokens, inp)) in shapes.iter().enumerate() {
            let seed = 7 + 13 * i as u64;
            let (bits, joined) = split(&values(tokens * inp, seed, 3.0));
            let joined: Vec<f64> = joined.into_iter().map(f64::from).collect();
            let xd = s.clone_htod(&bits).map_err(up("x"))?;
            let mut worst = 0.0f64;
            let mut vs_cublas = 0.0f64;
            let mut ws = Vec::new();
            let mut bs = Vec::new();
            let mut rs = Vec::new();
            let mut ys = Vec::new();
            let mut cs = Vec::new();
            for (j, &out) in outs.iter().enumerate() {
                let w: Vec<u16> = values(out * inp, seed + 1 + j as u64, 0.05)
                    .iter()
                    .map(|&v| bf16::from_f32(v).to_bits())
                    .collect();
                let bias: Vec<u16> = values(out, seed + 50 + j as u64, 1.0)
                    .iter()
                    .map(|&v| bf16::from_f32(v).to_bits())
                    .collect();
                let res = values(tokens * out, seed + 90 + j as u64, 2.0);
                ws.push((s.clone_htod(&w).map_err(up("w"))?, w));
                bs.push((s.clone_htod(&bias).map_err(up("bias"))?, bias));
                rs.push(res);
                // SAFETY: written by the products before read back.
                unsafe {
                    ys.push(alloc_device::<f32>(s, 2 * tokens * out, 0, "y")?);
                    cs.push(alloc_device::<f32>(s, 2 * tokens * out, 0, "cublas y")?);
                }
            }
            // the residual in y (the product adds it in place, as the decoder's row-parallel
            // products do) for the even products; the odd ones written split, no bias
            let mut prods = Vec::new();
            for (j, &out) in outs.iter().enumerate() {
                let with = j % 2 == 0;
                if with {
                    let mut init = rs[j].clone();
                    init.resize(2 * tokens * out, f32::NAN);
                    s.memcpy_htod(&init, &mut ys[j]).map_err(up("res"))?;
                }
                prods.push(MmaProduct {
                    w: Fp8Weight {
                        data: ptr(&ws[j].0, s),
                        scales: 0,
                        row0: 0,
                        cols: inp as u64,
                    },
                    out,
                    y: ptr(&ys[j], s),
                    bias: if with { ptr(&bs[j].0, s) } else { 0 },
                    res: if with { ptr(&ys[j], s) } else { 0 },
                });
            }
            // in place, the residual must be read once: run the products with residuals once,
            // then check determinism on copies without it
            // SAFETY: the buffers hold the sizes the products read and write.
            unsafe { m.bf16(s, &prods, ptr(&xd, s), true, (tokens, inp), 0)? };
            let first: Vec<Vec<f32>> = ys
                .iter()
                .map(|y| s.clone_dtoh(y).map_err(up("y back")))
                .collect::<Result<_, _>>()?;
            for (j, &out) in outs.iter().enumerate() {
                let with = j % 2 == 0;
                let w = &ws[j].1;
                for t in 0..tokens {
                    for o in 0..out {
                        let (mut acc, mut mag) = (0.0f64, 0.0f64);
                        for c in 0..inp {
                            let term = joined[t * inp + c]
                                * f64::from(bf16::from_bits(w[o * inp + c]).to_f32());
                            acc += term;
                            mag += term.abs();
                        }
                        let mut want = acc;
                        if with {
                            want += f64::from(bf16::from_bits(bs[j].1[o]).to_f32());
                            want += f64::from(rs[j][t * out + o]);
                        }
                        let got = f64::from(first[j][t * out + o]);
                        // the bias and residual add f32 roundings of their own
                        let err = (got - want).abs();
                        let bound = TOLERANCE * mag + 4.0 * f64::from(f32::EPSILON) * want.abs();
                        if err > bound || !got.is_finite() {
                            return Err(CudaError::Invalid(format!(
                                "{outs:?} x {tokens} x {inp}: product {j} token {t} row {o}: \
                                 {got} against {want} (Σ|terms| {mag})"
                            )));
                        }
                        worst = worst.max(err / mag.max(1e-30));
                        let lo_at = (tokens + t) * out + o;
                        if first[j][lo_at] != 0.0 {
                            return Err(CudaError::Invalid(format!(
                                "{outs:?} x {tokens} x {inp}: product {j}'s lo row {t} not \
                                 zero at {o}: {}",
                                first[j][lo_at]
                            )));
                        }
                    }
                }
                // cuBLAS's split product, joined on the host
                // SAFETY: w, x and the output hold the sizes the GEMM reads and writes.
                unsafe {
                    let (wd, cd) = (ptr(&ws[j].0, s), ptr(&cs[j], s));
                    gemm(&blas, wd, ptr(&xd, s), cd, out, 2 * tokens, inp, 0)?;
                }
                let c = s.clone_dtoh(&cs[j]).map_err(up("cublas back"))?;
                for t in 0..tokens {
                    for o in 0..out {
                        let mut v =
                            f64::from(c[t * out + o]) + f64::from(c[(tokens + t) * out + o]);
                        if with {
                            v += f64::from(bf16::from_bits(bs[j].1[o]).to_f32());
                            v += f64::from(rs[j][t * out + o]);
                        }
                        let d = (v - f64::from(first[j][t * out + o])).abs();
                        vs_cublas = vs_cublas.max(d / (v.abs() + 1e-3));
                    }
                }
            }
            // the same bits on two more runs (products without a residual in place)
            let plain: Vec<MmaProduct> =
                prods.iter().map(|p| MmaProduct { res: 0, ..*p }).collect();
            let ys_ref: Vec<&CudaSlice<f32>> = ys.iter().collect();
            bf16_twice(
                s,
                &m,
                &plain,
                &ys_ref,
                ptr(&xd, s),
                (true, tokens, inp),
                ctx,
            )?;
            let line = format!(
                "bf16 mma {outs:?} x {tokens} x {inp}: within {worst:.1e} of Σ|terms| of the \
                 f64 sums, {vs_cublas:.1e} (relative) of cuBLAS's, the same bits twice, lo \
                 rows zero"
            );
            eprintln!("{line}");
            lines.push(line);
        }
        Ok(lines)
    })?;
    print_report(&report);
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_rows_bf16_sums_do_not_depend_on_the_other_rows() -> Result<(), Box<dyn std::error::Error>> {
    require_gpus(1)?;
    let pool = ThreadRankPool::new(1)?;
    // (rows, inputs): split over the inputs (sums added by the last block to 8 tokens, by
    // w8a8_reduce beyond) and unsplit; the first token's row the same in every launch
    let shapes = [(3584usize, 18944usize), (37888, 3584)];
    let report = pool.run(&|ctx| {
        let s = &ctx.compute;
        let Some(m) = MmaKernels::load(ctx)? else {
            return Ok(vec![
                "the tensor-core kernels need compute capability 8.9".into()
            ]);
        };
        let up = |what: &str| ctx.drv(what, 0);
        let mut lines = Vec::new();
        for (i, &(out, inp)) in shapes.iter().enumerate() {
            let w: Vec<u16> = values(out * inp, 300 + i as u64, 0.05)
                .iter()
                .map(|&v| bf16::from_f32(v).to_bits())
                .collect();
            let wd = s.clone_htod(&w).map_err(up("w"))?;
            let mut first: Option<Vec<u32>> = None;
            for tokens in [1usize, 2, 5, 8, 13, 32] {
                // token 0 the same row every time, the others new
                let mut x = values(inp, 400 + i as u64, 3.0);
                x.extend(values((tokens - 1) * inp, 500 + tokens as u64, 3.0));
                let (bits, _) = split(&x);
                let xd = s.clone_htod(&bits).map_err(up("x"))?;
                // SAFETY: written by the product before it is read back.
                let yd = unsafe { alloc_device::<f32>(s, tokens * out, 0, "y")? };
                let p = MmaProduct {
                    w: Fp8Weight {
                        data: ptr(&wd, s),
                        scales: 0,
                        row0: 0,
                        cols: inp as u64,
                    },
                    out,
                    y: ptr(&yd, s),
                    bias: 0,
                    res: 0,
                };
                // SAFETY: the buffers hold the sizes the product reads and writes.
                unsafe { m.bf16(s, &[p], ptr(&xd, s), false, (tokens, inp), 0)? };
                let y = s.clone_dtoh(&yd).map_err(up("y back"))?;
                let row: Vec<u32> = y[..out].iter().map(|v| v.to_bits()).collect();
                match &first {
                    None => first = Some(row),
                    Some(f) => {
                        if let Some(o) = (0..out).find(|&o| f[o] != row[o]) {
                            return Err(CudaError::Invalid(format!(
                                "{out} x {inp}: token 0's output {o} is {} among {tokens} \
                                 tokens, {} alone",
                                f32::from_bits(row[o]),
                                f32::from_bits(f[o])
                            )));
                        }
                    }
                }
            }
            let line = format!(
                "bf16 mma {out} x {inp}: token 0's outputs the same bits among 1, 2, 5, 8, 13 \
                 and 32 tokens"
            );
            eprintln!("{line}");
            lines.push(line);
        }
        Ok(lines)
    })?;
    print_report(&report);
    Ok(())
}
