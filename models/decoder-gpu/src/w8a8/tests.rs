//! On the GPU (`cargo test --release -p lifecycle-decoder-gpu --lib w8a8 -- --ignored
//! --nocapture`): the device quantisation against [`quantize_activation_groups`] bit for
//! bit, and the block-scaled GEMM (and the weight-streaming W8A8 path) against the same sums
//! in f64 on the host.
use super::mma::MmaKernels;
use super::quant::{padded_tokens, tiled_offset, wgmma_tiles};
use super::*;
use crate::kernels::ptr;
use half::bf16;
use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::{alloc_device, RankCtx};
use lifecycle_cuda::{RankExecutor, ThreadRankPool};
use lifecycle_layout::fp8::{e4m3_to_f32, quantize_activation_groups, quantize_blocks};

#[test]
fn the_paths_follow_the_limits_and_what_each_path_reads() {
    use W8a8Path::{CublasLt, Streaming, TensorCores, Warpgroup};
    let can = |mma, wgmma, lt| W8a8Readers {
        mma,
        wgmma,
        lt,
        small: false,
    };
    let all = can(true, true, true);
    // a small weight: the warpgroup kernel up to its 64 tokens, unless it is off
    let small = W8a8Readers { small: true, ..all };
    let d = W8a8Limits::default();
    assert_eq!(d.path(8, small), TensorCores);
    assert_eq!(d.path(33, small), Warpgroup);
    assert_eq!(d.path(64, small), Warpgroup);
    assert_eq!(d.path(65, small), CublasLt);
    let off = W8a8Limits {
        wgmma: 0,
        ..W8a8Limits::default()
    };
    assert_eq!(off.path(40, small), CublasLt);
    assert_eq!(
        d.path(
            40,
            W8a8Readers {
                wgmma: false,
                ..small
            }
        ),
        CublasLt
    );
    let d = W8a8Limits::default();
    // defaults: the mma.sync kernel up to 8 tokens, the warpgroup kernel to 64, cuBLASLt beyond
    assert_eq!(d.path(1, all), TensorCores);
    assert_eq!(d.path(8, all), TensorCores);
    assert_eq!(d.path(9, all), Warpgroup);
    assert_eq!(d.path(64, all), Warpgroup);
    assert_eq!(d.path(65, all), CublasLt);
    // the warpgroup kernel to 32: cuBLASLt beyond, but for a small weight
    let to32 = W8a8Limits {
        wgmma: 32,
        ..W8a8Limits::default()
    };
    assert_eq!(to32.path(32, all), Warpgroup);
    assert_eq!(to32.path(33, all), CublasLt);
    assert_eq!(to32.path(64, all), CublasLt);
    assert_eq!(to32.path(64, small), Warpgroup);
    let wg = W8a8Limits {
        wgmma: 64,
        ..W8a8Limits::default()
    };
    assert_eq!(wg.path(8, all), TensorCores);
    assert_eq!(wg.path(9, all), Warpgroup);
    assert_eq!(wg.path(64, all), Warpgroup);
    assert_eq!(wg.path(65, all), CublasLt);
    assert_eq!(d.path(200, all), CublasLt);
    // no warpgroup kernel: cuBLASLt beyond 8
    let sm89 = can(true, false, true);
    assert_eq!(d.path(9, sm89), CublasLt);
    assert_eq!(wg.path(8, sm89), TensorCores);
    assert_eq!(wg.path(9, sm89), CublasLt);
    // a weight cuBLASLt cannot read: the kernels up to their 64 tokens
    assert_eq!(d.path(41, can(true, true, false)), Warpgroup);
    assert_eq!(d.path(41, can(true, false, false)), TensorCores);
    assert_eq!(d.path(65, can(true, true, false)), CublasLt);
    // no kernel (or a weight it cannot read): one token streams, more go to cuBLASLt
    assert_eq!(d.path(1, can(false, true, true)), Streaming);
    assert_eq!(d.path(2, can(false, true, true)), CublasLt);
    // weight streaming as set, at most GEMV_TOKENS
    let s = W8a8Limits {
        gemv: 4,
        mma: 16,
        wgmma: 0,
    };
    assert_eq!(s.path(4, all), Streaming);
    assert_eq!(s.path(5, all), TensorCores);
    assert_eq!(s.path(17, all), CublasLt);
    let s = W8a8Limits {
        gemv: 100,
        mma: 0,
        wgmma: 0,
    };
    assert_eq!(s.path(GEMV_TOKENS, all), Streaming);
    assert_eq!(s.path(GEMV_TOKENS + 1, all), CublasLt);
    // the warpgroup kernel from the first token
    let wg = W8a8Limits {
        gemv: 0,
        mma: 0,
        wgmma: 64,
    };
    assert_eq!(wg.path(1, all), Warpgroup);
    assert_eq!(wg.path(1, sm89), TensorCores);
    // cuBLASLt alone takes no single token: a kernel, where one reads the weight
    let lt = W8a8Limits {
        gemv: 0,
        mma: 0,
        wgmma: 0,
    };
    assert_eq!(lt.path(1, all), Warpgroup);
    assert_eq!(lt.path(1, sm89), TensorCores);
    assert_eq!(lt.path(1, can(false, false, true)), Streaming);
    assert_eq!(lt.path(2, all), CublasLt);
}

#[test]
fn the_warpgroup_layout_places_every_byte_once_in_the_wgmma_order() {
    for tiles in [1, 2, 4, 8] {
        let tokens = 8 * tiles;
        let groups = 3;
        let mut seen = vec![false; groups * 128 * tokens];
        for t in 0..tokens {
            for g in 0..groups {
                for c in 0..128 {
                    let at = tiled_offset(t, g, c, tiles);
                    assert!(
                        !seen[at],
                        "tiles {tiles}: token {t} group {g} byte {c} twice"
                    );
                    seen[at] = true;
                    // a group's bytes are the group's 1024 · tiles, in core matrices of 8
                    // tokens by 16 bytes: the token's row of its tile's matrix
                    assert_eq!(at / (1024 * tiles), g);
                    let within = at % (1024 * tiles);
                    let (matrix, row) = (within / 128, within % 128 / 16);
                    assert_eq!((matrix % tiles, row), (t / 8, t % 8), "token {t}");
                    // core matrix 2 s + h of step s holds words 8 q + 2 s + h as its word q:
                    // the k order in which the weight fragments are loaded
                    let word = 8 * (within % 16 / 4) + matrix / tiles;
                    assert_eq!((word, within % 4), (c / 4, c % 4), "token {t} byte {c}");
                }
            }
        }
        assert!(
            seen.iter().all(|&b| b),
            "tiles {tiles}: a byte never written"
        );
    }
    assert_eq!(
        [1, 8, 9, 16, 17, 33, 64].map(wgmma_tiles),
        [1, 1, 2, 2, 4, 8, 8]
    );
    assert_eq!(ActLayout::Tiles(4).padded(17), 32);
    assert_eq!(ActLayout::Rows.padded(17), 20);
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

/// Prints every rank's report lines (a GPU test's measured figures).
pub(super) fn print_report(report: &[Vec<String>]) {
    for l in report.iter().flatten() {
        println!("{l}");
    }
}

/// The split rows of `x` (hi rows, then lo rows) and their sums in f32 (exact: hi + lo).
pub(super) fn split(x: &[f32]) -> (Vec<u16>, Vec<f32>) {
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

/// Runs the tensor-core kernel on `weight` and the quantised activations, twice (a split
/// product's sums do not depend on the order its blocks ran in: the second run gives the same
/// bits).
#[allow(clippy::too_many_arguments)]
fn mma_twice(
    s: &Arc<CudaStream>,
    m: &MmaKernels,
    weight: Fp8Weight,
    (qd, scd, layout): (u64, u64, ActLayout),
    yd: &CudaSlice<f32>,
    (out, tokens, inp): (usize, usize, usize),
    ctx: &RankCtx,
) -> Result<Vec<f32>, CudaError> {
    let wgmma = layout != ActLayout::Rows;
    let mut runs = Vec::new();
    for _ in 0..2 {
        // SAFETY: the buffers hold the sizes the product reads and writes (the caller's).
        unsafe {
            let p = MmaProduct {
                w: weight,
                out,
                y: ptr(yd, s),
                bias: 0,
                res: 0,
            };
            m.gemm(s, &[p], (qd, scd, layout), false, (tokens, inp), 0)?
        };
        runs.push(s.clone_dtoh(yd).map_err(ctx.drv("y back", 0))?);
    }
    let (a, b) = (&runs[0][..tokens * out], &runs[1][..tokens * out]);
    if a.iter().zip(b).any(|(x, y)| x.to_bits() != y.to_bits()) {
        return Err(CudaError::Invalid(format!(
            "{out}x{tokens}x{inp}: the tensor-core kernel (wgmma {wgmma}) gave other bits on \
             its second run"
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
        // past the warpgroup kernel's resident blocks on 132 SMs (264 of 128 rows): the row
        // blocks past the whole waves split, summed by w8a8_reduce at 64 tokens and by their
        // last block at 5, the last warp's rows ending inside it
        (364 * 128, 64, 640, 0),
        (270 * 128 - 40, 5, 1024, 16),
    ];
    let report = pool.run(&|ctx| {
        let s = &ctx.compute;
        let k = Fp8Kernels::load(ctx)?;
        let lt = W8a8Gemm::new(ctx)?;
        let (major, minor) = ctx
            .ctx
            .compute_capability()
            .map_err(ctx.drv("compute capability", 0))?;
        if lifecycle_cuda::arch_specific_target(major, minor).is_some()
            && !lt.mma.as_ref().is_some_and(|m| m.has_wgmma())
        {
            return Err(CudaError::Invalid(format!(
                "the warpgroup W8A8 kernels did not load on a device of compute capability \
                 {major}.{minor}"
            )));
        }
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
            // room for either layout (the warpgroup kernel's tiles pad further)
            let room = pad.max(8 * wgmma_tiles(tokens));
            // SAFETY: each buffer is written below before it is read back.
            let (qd, scd, mut yd, x32) = unsafe {
                (
                    alloc_device::<u8>(s, room * inp, 0, "q")?,
                    alloc_device::<f32>(s, room * groups, 0, "scales")?,
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
            let strides = ActLayout::Rows.scale_strides(tokens);
            let q = QuantOut {
                q: Some(ptr(&qd, s)),
                scales: Some((ptr(&scd, s), strides)),
                deq: None,
                zero: None,
                layout: ActLayout::Rows,
            };
            // SAFETY: the buffers above hold the sizes each call reads and writes.
            unsafe {
                let src = ActSrc::Split(ptr(&xd, s));
                quantize(s, &k, src, (tokens, pad, inp), q, 0)?;
            }
            let got_q = s.clone_dtoh(&qd).map_err(up("q back"))?;
            let got_sc = s.clone_dtoh(&scd).map_err(up("scales back"))?;
            let got_q = &got_q[..pad * inp];
            if got_q[..tokens * inp] != qx.data[..] || got_q[tokens * inp..].iter().any(|&b| b != 0)
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
            // the host sums in f64, and the sum of magnitudes that bounds their rounding (the
            // activations and weights decoded once, the tokens spread over the host's cores)
            let xv: Vec<f64> = (0..tokens * inp)
                .map(|i| {
                    f64::from(e4m3_to_f32(qx.data[i]))
                        * f64::from(qx.scale_inv[(i / inp) * groups + (i % inp) / 128])
                })
                .collect();
            let wv: Vec<f64> = (0..out * inp)
                .map(|i| f64::from(wq.value(row0 + i / inp, i % inp)))
                .collect();
            let mut want = vec![0.0f64; tokens * out];
            let mut mag = vec![0.0f64; tokens * out];
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let per = tokens.div_ceil(threads).max(1);
            std::thread::scope(|sc| {
                let parts = want.chunks_mut(per * out).zip(mag.chunks_mut(per * out));
                for (part, (want, mag)) in parts.enumerate() {
                    let (xv, wv) = (&xv, &wv);
                    sc.spawn(move || {
                        for (j, (w, m)) in want.iter_mut().zip(mag.iter_mut()).enumerate() {
                            let (t, o) = (part * per + j / out, j % out);
                            let x = &xv[t * inp..(t + 1) * inp];
                            let r = &wv[o * inp..(o + 1) * inp];
                            let (mut acc, mut abs) = (0.0f64, 0.0f64);
                            for (a, b) in x.iter().zip(r) {
                                let term = a * b;
                                acc += term;
                                abs += term.abs();
                            }
                            *w = acc;
                            *m = abs;
                        }
                    });
                }
            });
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
            // each tensor-core kernel alone, on the activations quantised in its layout (the
            // warpgroup kernel's checked byte for byte against the host's, moved)
            let mma = lt.mma.as_ref().filter(|_| tokens <= MMA_TOKENS);
            if let Some(m) = mma {
                let mut layouts = vec![ActLayout::Rows];
                if m.has_wgmma() {
                    layouts.push(ActLayout::of(tokens, true));
                }
                for layout in layouts {
                    let wgmma = layout != ActLayout::Rows;
                    eprintln!("  {out} x {tokens} x {inp}: the kernel alone (wgmma {wgmma})");
                    if let ActLayout::Tiles(tiles) = layout {
                        let tiled = QuantOut {
                            scales: Some((ptr(&scd, s), layout.scale_strides(tokens))),
                            layout,
                            ..q
                        };
                        let room = layout.padded(tokens);
                        // SAFETY: the buffers hold `room` tokens of bytes and scales.
                        unsafe {
                            let src = ActSrc::Split(ptr(&xd, s));
                            quantize(s, &k, src, (tokens, room, inp), tiled, 0)?;
                        }
                        let got_q = s.clone_dtoh(&qd).map_err(up("tiles back"))?;
                        let got_sc = s.clone_dtoh(&scd).map_err(up("tile scales back"))?;
                        for t in 0..room {
                            for c in 0..inp {
                                let want = if t < tokens { qx.data[t * inp + c] } else { 0 };
                                let at = tiled_offset(t, c / 128, c % 128, tiles);
                                if got_q[at] != want {
                                    return Err(CudaError::Invalid(format!(
                                        "{out}x{tokens}x{inp}: tiled byte of token {t} input \
                                         {c}: {} vs {want}",
                                        got_q[at]
                                    )));
                                }
                            }
                            for g in 0..groups {
                                let want = if t < tokens {
                                    qx.scale_inv[t * groups + g]
                                } else {
                                    1.0
                                };
                                if got_sc[g * room + t].to_bits() != want.to_bits() {
                                    return Err(CudaError::Invalid(format!(
                                        "{out}x{tokens}x{inp}: tiled scale of token {t} \
                                         group {g}: {} vs {want}",
                                        got_sc[g * room + t]
                                    )));
                                }
                            }
                        }
                    } else {
                        // SAFETY: as above (the rows layout again, after the tiles).
                        unsafe {
                            let src = ActSrc::Split(ptr(&xd, s));
                            quantize(s, &k, src, (tokens, pad, inp), q, 0)?;
                        }
                    }
                    let y = mma_twice(
                        s,
                        m,
                        weight,
                        (ptr(&qd, s), ptr(&scd, s), layout),
                        &yd,
                        (out, tokens, inp),
                        ctx,
                    )?;
                    let name = if wgmma {
                        "warpgroup kernel"
                    } else {
                        "mma.sync kernel"
                    };
                    let worst = check(&y[..tokens * out], name)?;
                    found.push(format!("{name} within {worst:.1e}"));
                }
            }
            // the whole W8A8 product from the split activations, by every path that takes
            // it: lo rows zero
            let mut limits = vec![(W8a8Limits::default(), "default")];
            if tokens <= GEMV_TOKENS {
                let l = W8a8Limits {
                    gemv: GEMV_TOKENS,
                    mma: 0,
                    wgmma: 0,
                };
                limits.push((l, "weight streaming"));
            }
            if let Some(m) = mma {
                limits.push((
                    W8a8Limits {
                        gemv: 0,
                        mma: MMA_TOKENS,
                        wgmma: 0,
                    },
                    "mma.sync",
                ));
                if m.has_wgmma() {
                    limits.push((
                        W8a8Limits {
                            gemv: 0,
                            mma: 0,
                            wgmma: MMA_TOKENS,
                        },
                        "warpgroup",
                    ));
                }
            }
            // a finished product's bias (bf16 per output) and output, and what reads the weight
            let bias: Vec<bf16> = (0..out)
                .map(|o| bf16::from_f32((o % 7) as f32 * 0.125 - 0.5))
                .collect();
            let bias_d = s.clone_htod(&bias).map_err(up("bias"))?;
            // SAFETY: written (the residual) before each product reads it.
            let mut fd = unsafe { alloc_device::<f32>(s, tokens * out, 0, "finished output")? };
            let readers = W8a8Readers {
                mma: lt.mma.is_some() && mma_reads(&weight, inp),
                wgmma: lt.mma.as_ref().is_some_and(|m| m.has_wgmma()),
                lt: lt_reads(&weight),
                small: out * inp <= SMALL_WEIGHT,
            };
            let held = Cell::new(None);
            for ((limits, path), same_input) in
                limits.into_iter().flat_map(|l| [(l, false), (l, true)])
            {
                eprintln!("  {out} x {tokens} x {inp}: {path} (input again {same_input})");
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
                let finished = unsafe {
                    w8a8_gemm(
                        s,
                        &lt,
                        &k,
                        weight,
                        ptr(&xd, s),
                        ptr(&yd, s),
                        (out, 2 * tokens, inp),
                        through,
                        None,
                        limits,
                        0,
                    )?
                };
                let y = s.clone_dtoh(&yd).map_err(up("y back"))?;
                let path = &*format!("{path}{}", if same_input { ", input again" } else { "" });
                if finished {
                    return Err(CudaError::Invalid(format!(
                        "{out}x{tokens}x{inp} {path}: finished without an output to finish"
                    )));
                }
                let worst = check(&y[..tokens * out], path)?;
                if y[tokens * out..].iter().any(|&v| v != 0.0) {
                    return Err(CudaError::Invalid(format!(
                        "{out}x{tokens}x{inp} {path}: lo rows not zero"
                    )));
                }
                // the same product writing its own output, a bias and a residual added (the
                // residual buffer is the output, as a layer's residual stream): (y + bias) +
                // residual bit for bit, where a tensor-core kernel takes it
                let res: Vec<f32> = (0..tokens * out)
                    .map(|i| (i % 23) as f32 * 0.25 - 2.0)
                    .collect();
                s.memcpy_htod(&res, &mut fd).map_err(up("residual"))?;
                let fin = Finish {
                    out: ptr(&fd, s),
                    bias: Some(ptr(&bias_d, s)),
                    res: Some(ptr(&fd, s)),
                };
                let through = W8a8Through {
                    x32: Some(ptr(&x32, s)),
                    act: Some((ptr(&qd, s), ptr(&scd, s), &held)),
                    same_input: true,
                };
                // SAFETY: as above; fd holds tokens · out f32, bias_d out bf16.
                let finished = unsafe {
                    w8a8_gemm(
                        s,
                        &lt,
                        &k,
                        weight,
                        ptr(&xd, s),
                        ptr(&yd, s),
                        (out, 2 * tokens, inp),
                        through,
                        Some(fin),
                        limits,
                        0,
                    )?
                };
                let tensor_cores = matches!(
                    limits.path(tokens, readers),
                    W8a8Path::TensorCores | W8a8Path::Warpgroup
                );
                if finished != tensor_cores {
                    return Err(CudaError::Invalid(format!(
                        "{out}x{tokens}x{inp} {path}: finished {finished}, by the tensor-core \
                         kernels {tensor_cores}"
                    )));
                }
                if finished {
                    let got = s.clone_dtoh(&fd).map_err(up("finished output back"))?;
                    for (i, &g) in got.iter().enumerate() {
                        let want = (y[i] + bias[i % out].to_f32()) + res[i];
                        if g.to_bits() != want.to_bits() {
                            return Err(CudaError::Invalid(format!(
                                "{out}x{tokens}x{inp} {path}: finished output {i}: {g}, the \
                                 product plus bias and residual {want}"
                            )));
                        }
                    }
                }
                found.push(format!(
                    "W8A8 product ({path}) within {worst:.1e}{}",
                    if finished {
                        ", finished in the kernel"
                    } else {
                        ""
                    }
                ));
            }
            let line = format!(
                "{out} x {tokens} x {inp} from row {row0}: quantisation bit-identical; {} \
                 of Σ|terms|",
                found.join(", ")
            );
            eprintln!("{line}");
            lines.push(line);
        }
        Ok(lines)
    })?;
    print_report(&report);
    Ok(())
}

/// The W8A8 quantisation fused into the norm (`rms_norm_quant`) and the SwiGLU (`swiglu_quant`)
/// writes what the two kernels it replaces write, bit for bit: the split output, the e4m3 bytes
/// and the scales of every padded token, in both layouts; `swiglu_quant` told that its inputs'
/// lo rows are zero (and not reading them: NaN here), its split output not written (as the
/// decoder runs it for W8A8 products of gate and up), the bytes and scales of the two kernels on
/// zero lo rows.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_fused_quantisations_write_the_two_kernels_bits() -> Result<(), Box<dyn std::error::Error>> {
    use crate::kernels::{launch, Arg, DecoderKernels};
    use lifecycle_cuda::cudarc::driver::LaunchConfig;
    require_gpus(1)?;
    let pool = ThreadRankPool::new(1)?;
    let report = pool.run(&|ctx| {
        let s = &ctx.compute;
        let k = Fp8Kernels::load(ctx)?;
        let dk = DecoderKernels::load(ctx)?;
        let up = |what: &str| ctx.drv(what, 0);
        let mut lines = Vec::new();
        // (tokens, inputs): whole and partial thread rows of the norm, a group cut short
        let shapes: [(usize, usize); 7] = [
            (1, 3584),
            (3, 640),
            (8, 3584),
            (9, 1152),
            (33, 2048),
            (64, 384),
            (5, 200),
        ];
        for (i, &(tokens, inp)) in shapes.iter().enumerate() {
            let groups = inp.div_ceil(128);
            let mut layouts = vec![ActLayout::Rows];
            if inp.is_multiple_of(128) {
                layouts.push(ActLayout::of(tokens, true));
            }
            for layout in layouts {
                let pad = layout.padded(tokens);
                // (kernel, inputs made, the two-kernel twin)
                for (fused, lo) in [
                    ("rms_norm_quant", true),
                    ("swiglu_quant", true),
                    ("swiglu_quant", false),
                ] {
                    let seed = 7 + i as u64;
                    let sentinel_q = vec![0xabu8; pad * inp];
                    let sentinel_sc = vec![-3.5f32; pad * groups];
                    let mut outs = Vec::new();
                    for one_launch in [false, true] {
                        let qd = s.clone_htod(&sentinel_q).map_err(up("q"))?;
                        let scd = s.clone_htod(&sentinel_sc).map_err(up("scales"))?;
                        let xs = s
                            .clone_htod(&vec![0x7fc1u16; 2 * tokens * inp])
                            .map_err(up("xs"))?;
                        let qi = QuantInto {
                            q: ptr(&qd, s),
                            scales: ptr(&scd, s),
                            layout,
                            tokens,
                        };
                        let [a_pad, a_q, a_sc, a_tok, a_grp, a_tiles] = qi.args(inp)?;
                        // the norm's input and weight, or the SwiGLU's split gate and up (lo
                        // rows unread: NaN for the fused kernel, zero for the two)
                        let lo_rows = |mut v: Vec<f32>| {
                            if !lo {
                                let fill = if one_launch { f32::NAN } else { 0.0 };
                                v[tokens * inp..].iter_mut().for_each(|x| *x = fill);
                            }
                            v
                        };
                        let a = s
                            .clone_htod(&lo_rows(values(2 * tokens * inp, inp, seed)))
                            .map_err(up("input"))?;
                        let b: Vec<u16> = values(inp, inp, seed + 1)
                            .iter()
                            .map(|v| bf16::from_f32(1.0 + v).to_bits())
                            .collect();
                        let wd = s.clone_htod(&b).map_err(up("norm weight"))?;
                        let u2 = s
                            .clone_htod(&lo_rows(values(2 * tokens * inp, inp, seed + 2)))
                            .map_err(up("up"))?;
                        let norm = fused == "rms_norm_quant";
                        // SAFETY: each buffer holds what the kernels' contracts read and write
                        // (xs 2 · tokens rows, q and scales `pad` tokens of the layout).
                        unsafe {
                            if one_launch && norm {
                                let args = [
                                    Arg::U64(ptr(&a, s)),
                                    Arg::U64(ptr(&wd, s)),
                                    Arg::U64(ptr(&xs, s)),
                                    Arg::U32(tokens as u32),
                                    a_pad,
                                    Arg::U32(inp as u32),
                                    Arg::F32(1e-6),
                                    a_q,
                                    a_sc,
                                    a_tok,
                                    a_grp,
                                    a_tiles,
                                ];
                                let cfg = LaunchConfig {
                                    grid_dim: (pad as u32, 1, 1),
                                    block_dim: (256, 1, 1),
                                    shared_mem_bytes: (4 * inp) as u32,
                                };
                                launch(s, &dk.rms_norm_quant, cfg, &args, 0, fused)?;
                            } else if one_launch {
                                let out = if lo { ptr(&xs, s) } else { 0 };
                                let args = [
                                    Arg::U64(ptr(&a, s)),
                                    Arg::U64(ptr(&u2, s)),
                                    Arg::U64(out),
                                    Arg::U32(tokens as u32),
                                    a_pad,
                                    Arg::U32(inp as u32),
                                    a_q,
                                    a_sc,
                                    a_tok,
                                    a_grp,
                                    a_tiles,
                                    Arg::U32(u32::from(lo)),
                                ];
                                let cfg = LaunchConfig {
                                    grid_dim: ((pad * groups).div_ceil(8) as u32, 1, 1),
                                    block_dim: (256, 1, 1),
                                    shared_mem_bytes: 0,
                                };
                                launch(s, &dk.swiglu_quant, cfg, &args, 0, fused)?;
                            } else {
                                if norm {
                                    let args = [
                                        Arg::U64(ptr(&a, s)),
                                        Arg::U64(ptr(&wd, s)),
                                        Arg::U64(0),
                                        Arg::U64(ptr(&xs, s)),
                                        Arg::U32(tokens as u32),
                                        Arg::U32(inp as u32),
                                        Arg::F32(1e-6),
                                    ];
                                    let cfg = LaunchConfig {
                                        grid_dim: (tokens as u32, 1, 1),
                                        block_dim: (256, 1, 1),
                                        shared_mem_bytes: 0,
                                    };
                                    launch(s, &dk.rms_norm_split, cfg, &args, 0, "norm")?;
                                } else {
                                    let args = [
                                        Arg::U64(ptr(&a, s)),
                                        Arg::U64(ptr(&u2, s)),
                                        Arg::U64(ptr(&xs, s)),
                                        Arg::U32(tokens as u32),
                                        Arg::U32(inp as u32),
                                    ];
                                    let cfg = LaunchConfig {
                                        grid_dim: (64, 1, 1),
                                        block_dim: (256, 1, 1),
                                        shared_mem_bytes: 0,
                                    };
                                    launch(s, &dk.swiglu_split, cfg, &args, 0, "swiglu")?;
                                }
                                let q = QuantOut {
                                    q: Some(qi.q),
                                    scales: Some((qi.scales, layout.scale_strides(tokens))),
                                    deq: None,
                                    zero: None,
                                    layout,
                                };
                                let src = ActSrc::Split(ptr(&xs, s));
                                quantize(s, &k, src, (tokens, pad, inp), q, 0)?;
                            }
                        }
                        outs.push((
                            s.clone_dtoh(&xs).map_err(up("xs back"))?,
                            s.clone_dtoh(&qd).map_err(up("q back"))?,
                            s.clone_dtoh(&scd).map_err(up("scales back"))?,
                        ));
                    }
                    let what = format!("{fused} of {tokens} x {inp} ({layout:?}, lo rows {lo})");
                    let (two, one) = (&outs[0], &outs[1]);
                    if lo && two.0 != one.0 {
                        return Err(CudaError::Invalid(format!("{what}: other split output")));
                    }
                    if !lo && one.0.iter().any(|&v| v != 0x7fc1) {
                        return Err(CudaError::Invalid(format!(
                            "{what}: a split output written"
                        )));
                    }
                    same_quantisation(&what, (&two.1, &two.2), (&one.1, &one.2))?;
                    lines.push(format!("{what}: the two kernels' bits"));
                }
            }
        }
        Ok(lines)
    })?;
    print_report(&report);
    Ok(())
}

/// A fused kernel's quantisation `one` (e4m3 bytes, scales) is bit for bit the two kernels'
/// `two`, and every scale was written (none left at the tests' -3.5 fill).
fn same_quantisation(
    what: &str,
    two: (&[u8], &[f32]),
    one: (&[u8], &[f32]),
) -> Result<(), CudaError> {
    if let Some(j) = (0..two.0.len()).find(|&j| two.0[j] != one.0[j]) {
        return Err(CudaError::Invalid(format!(
            "{what}: byte {j}: {} fused, {} by the two kernels",
            one.0[j], two.0[j]
        )));
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if bits(two.1) != bits(one.1) {
        return Err(CudaError::Invalid(format!("{what}: other scales")));
    }
    if two.1.contains(&-3.5) {
        return Err(CudaError::Invalid(format!("{what}: a scale not written")));
    }
    Ok(())
}

/// The attention kernels with their output quantised for o's tensor-core kernel (d = 128: a
/// head is a group) write, bit for bit, the bytes and scales the quantisation of their split
/// output writes (every padded token's group too), and no split output; in both layouts, every
/// K/V dtype, several sequences and heads of a kv head.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_attention_quantisation_is_the_two_kernels_bits() -> Result<(), Box<dyn std::error::Error>> {
    use crate::kernels::{launch, Arg, DecoderKernels};
    use lifecycle_cuda::cudarc::driver::LaunchConfig;
    require_gpus(1)?;
    let pool = ThreadRankPool::new(1)?;
    let report = pool.run(&|ctx| {
        let s = &ctx.compute;
        let k = Fp8Kernels::load(ctx)?;
        let dk = DecoderKernels::load(ctx)?;
        let up = |what: &str| ctx.drv(what, 0);
        let mut lines = Vec::new();
        // one KV page a sequence, the pages in reverse order
        let (d, qh, kvh, cap) = (128usize, 4usize, 2usize, crate::KV_PAGE_POSITIONS);
        let inp = qh * d;
        // (cache element bytes a position holds per kv head, kernel)
        let kinds = [
            ("f32", 4 * d, &dk.attention),
            ("bf16", 2 * d, &dk.attention_bf16),
            ("fp8", d + 4, &dk.attention_fp8),
        ];
        for tokens in [1usize, 5, 9, 33] {
            let q = s
                .clone_htod(&values(tokens * inp, inp, 40 + tokens as u64))
                .map_err(up("q"))?;
            let seqs: Vec<u32> = (0..tokens as u32)
                .map(|t| (t * 7) % tokens as u32)
                .collect();
            let poss: Vec<u32> = (0..tokens as u32).map(|t| (t * 5) % cap as u32).collect();
            let table: Vec<u32> = (0..tokens as u32).rev().collect();
            let (sd, pd, td) = (
                s.clone_htod(&seqs).map_err(up("seqs"))?,
                s.clone_htod(&poss).map_err(up("positions"))?,
                s.clone_htod(&table).map_err(up("page table"))?,
            );
            for (kind, rec, kernel) in kinds {
                // caches of `tokens` sequences: random bytes (fp8: finite e4m3 and unit scales)
                let bytes = tokens * cap * kvh * rec;
                let cache: Vec<u8> = match kind {
                    "f32" => values(bytes / 4, d, 3)
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect(),
                    "bf16" => values(bytes / 2, d, 3)
                        .iter()
                        .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
                        .collect(),
                    _ => (0..bytes)
                        .map(|i| {
                            if i % rec < d {
                                (i.wrapping_mul(37) % 0x7e) as u8 | ((i % 3 == 0) as u8) << 7
                            } else {
                                [0u8, 0, 0x80, 0x3f][i % rec - d]
                            }
                        })
                        .collect(),
                };
                let kc = s.clone_htod(&cache).map_err(up("k cache"))?;
                let vc = s.clone_htod(&cache).map_err(up("v cache"))?;
                for layout in [ActLayout::Rows, ActLayout::of(tokens, true)] {
                    let pad = layout.padded(tokens);
                    let mut outs = Vec::new();
                    for fused in [false, true] {
                        let qd = s.clone_htod(&vec![0xabu8; pad * inp]).map_err(up("q8"))?;
                        let scd = s
                            .clone_htod(&vec![-3.5f32; pad * qh])
                            .map_err(up("scales"))?;
                        let xs = s
                            .clone_htod(&vec![0x7fc1u16; 2 * tokens * inp])
                            .map_err(up("xs"))?;
                        let qi = QuantInto {
                            q: ptr(&qd, s),
                            scales: ptr(&scd, s),
                            layout,
                            tokens,
                        };
                        let [_, a_q, a_sc, a_tok, a_grp, a_tiles] = qi.args(inp)?;
                        let quant = if fused {
                            [a_q, a_sc, a_tok, a_grp, a_tiles]
                        } else {
                            [
                                Arg::U64(0),
                                Arg::U64(0),
                                Arg::U32(0),
                                Arg::U32(0),
                                Arg::U32(0),
                            ]
                        };
                        let rows = if fused { pad } else { tokens };
                        let [aq, asc, tok, grp, tiles] = quant;
                        let args = [
                            Arg::U64(ptr(&q, s)),
                            Arg::U64(ptr(&kc, s)),
                            Arg::U64(ptr(&vc, s)),
                            Arg::U64(ptr(&sd, s)),
                            Arg::U64(ptr(&pd, s)),
                            Arg::U64(if fused { 0 } else { ptr(&xs, s) }),
                            Arg::U32(tokens as u32),
                            Arg::U32(qh as u32),
                            Arg::U32(kvh as u32),
                            Arg::U32(d as u32),
                            Arg::U64(ptr(&td, s)),
                            Arg::U32(1),
                            Arg::U32(0),
                            Arg::U32((qh / kvh) as u32),
                            Arg::U32(0),
                            Arg::F32(1.0 / (d as f32).sqrt()),
                            aq,
                            asc,
                            tok,
                            grp,
                            tiles,
                        ];
                        let cfg = LaunchConfig {
                            grid_dim: ((rows * qh) as u32, 1, 1),
                            block_dim: (256, 1, 1),
                            shared_mem_bytes: crate::kernels::attention_shared_bytes(cap, d) as u32,
                        };
                        // SAFETY: q holds tokens × qh × d f32, the caches every sequence's cap
                        // positions, seqs and positions within them; xs 2 tokens × inp, the
                        // quantisation `pad` tokens in its layout.
                        unsafe {
                            launch(s, kernel, cfg, &args, 0, "attention")?;
                            if !fused {
                                let out = QuantOut {
                                    q: Some(qi.q),
                                    scales: Some((qi.scales, layout.scale_strides(tokens))),
                                    deq: None,
                                    zero: None,
                                    layout,
                                };
                                let src = ActSrc::Split(ptr(&xs, s));
                                quantize(s, &k, src, (tokens, pad, inp), out, 0)?;
                            }
                        }
                        outs.push((
                            s.clone_dtoh(&xs).map_err(up("xs back"))?,
                            s.clone_dtoh(&qd).map_err(up("q8 back"))?,
                            s.clone_dtoh(&scd).map_err(up("scales back"))?,
                        ));
                    }
                    let what = format!("attention ({kind} K/V) of {tokens} tokens ({layout:?})");
                    let (two, one) = (&outs[0], &outs[1]);
                    if one.0.iter().any(|&v| v != 0x7fc1) {
                        return Err(CudaError::Invalid(format!(
                            "{what}: a split output written"
                        )));
                    }
                    if two.0.iter().all(|&v| v == 0x7fc1) {
                        return Err(CudaError::Invalid(format!(
                            "{what}: no split output unfused"
                        )));
                    }
                    same_quantisation(&what, (&two.1, &two.2), (&one.1, &one.2))?;
                    lines.push(format!("{what}: the two kernels' bits"));
                }
            }
        }
        Ok(lines)
    })?;
    print_report(&report);
    Ok(())
}

/// The warpgroup kernel's split sums added in clusters through the blocks' shared memory are, bit
/// for bit, what the same slices added through device memory give (`w8a8_reduce` beyond 8 tokens,
/// the last block of each row range up to 8): shapes whose slices are one group each either way,
/// three products in one launch with bias, residual and zero lo rows. On a device without the
/// warpgroup kernel, nothing to compare.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_cluster_sums_are_the_device_memory_sums_bits() -> Result<(), Box<dyn std::error::Error>> {
    require_gpus(1)?;
    let pool = ThreadRankPool::new(1)?;
    let report = pool.run(&|ctx| {
        let s = &ctx.compute;
        let k = Fp8Kernels::load(ctx)?;
        let mut lt = W8a8Gemm::new(ctx)?;
        let up = |what: &str| ctx.drv(what, 0);
        let mut lines = Vec::new();
        let Some(m) = lt.mma.as_mut().filter(|m| m.has_wgmma()) else {
            lines.push("no warpgroup kernel on this device: nothing compared".to_string());
            return Ok(lines);
        };
        let room = m.clusters();
        if room == super::mma::ClusterRoom::default() {
            return Err(CudaError::Invalid(
                "the warpgroup kernel is loaded but no cluster of it fits (or the driver did not \
                 say)"
                    .into(),
            ));
        }
        // (rows of each product, inputs): 8 row blocks over 8 groups, 7 over 7, 3 products
        for (rows, inp) in [
            (vec![1024usize], 1024usize),
            (vec![896], 896),
            (vec![384, 256, 256], 1024),
        ] {
            let total: usize = rows.iter().sum();
            let w = values(total * inp, inp, 5 + total as u64);
            let wq = quantize_blocks("w", &w, total, inp)
                .map_err(|e| CudaError::Invalid(e.to_string()))?;
            let wd = s.clone_htod(wq.data()).map_err(up("weights"))?;
            let wsd = s.clone_htod(wq.scale_inv()).map_err(up("weight scales"))?;
            let bias: Vec<bf16> = (0..total)
                .map(|o| bf16::from_f32((o % 7) as f32 * 0.5 - 1.5))
                .collect();
            let bd = s.clone_htod(&bias).map_err(up("bias"))?;
            for tokens in [3usize, 8, 16, 64] {
                let shape = m.shape(&rows, tokens, inp, true);
                if !shape.cluster {
                    return Err(CudaError::Invalid(format!(
                        "{rows:?} x {tokens} x {inp}: not launched in clusters ({shape:?}, room \
                         {room:?})"
                    )));
                }
                let x = values(tokens * inp, inp, 300 + tokens as u64);
                let (xs, _) = split(&x);
                let xd = s.clone_htod(&xs).map_err(up("activations"))?;
                let layout = ActLayout::of(tokens, true);
                let padded = layout.padded(tokens);
                // SAFETY: written by the quantisation before any product reads them.
                let (qd, scd) = unsafe {
                    (
                        alloc_device::<u8>(s, padded * inp, 0, "q")?,
                        alloc_device::<f32>(s, padded * (inp / 128), 0, "scales")?,
                    )
                };
                let q = QuantOut {
                    q: Some(ptr(&qd, s)),
                    scales: Some((ptr(&scd, s), layout.scale_strides(tokens))),
                    deq: None,
                    zero: None,
                    layout,
                };
                // SAFETY: the buffers hold `padded` tokens of bytes and scales.
                unsafe {
                    quantize(
                        s,
                        &k,
                        ActSrc::Split(ptr(&xd, s)),
                        (tokens, padded, inp),
                        q,
                        0,
                    )?
                };
                let res: Vec<f32> = (0..2 * tokens * total)
                    .map(|j| (j % 11) as f32 * 0.25 - 1.0)
                    .collect();
                let mut runs = Vec::new();
                for clusters in [room, super::mma::ClusterRoom::default()] {
                    m.set_clusters(clusters);
                    // each product's y [2 tokens × rows] (the lo rows zeroed), residual in place
                    let ys = rows
                        .iter()
                        .scan(0, |col, &r| {
                            let part: Vec<f32> = (0..2 * tokens)
                                .flat_map(|t| res[t * total + *col..t * total + *col + r].to_vec())
                                .collect();
                            *col += r;
                            Some(s.clone_htod(&part).map_err(up("residual")))
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    let mut prods = Vec::new();
                    let mut row0 = 0u64;
                    for (r, y) in rows.iter().zip(&ys) {
                        prods.push(MmaProduct {
                            w: Fp8Weight {
                                data: ptr(&wd, s),
                                scales: ptr(&wsd, s),
                                row0,
                                cols: inp as u64,
                            },
                            out: *r,
                            y: ptr(y, s),
                            bias: ptr(&bd, s) + 2 * row0,
                            res: ptr(y, s),
                        });
                        row0 += *r as u64;
                    }
                    // SAFETY: each y holds 2 tokens × its rows, bias every row, the weights and
                    // activations their sizes.
                    unsafe {
                        m.gemm(
                            s,
                            &prods,
                            (ptr(&qd, s), ptr(&scd, s), layout),
                            true,
                            (tokens, inp),
                            0,
                        )?
                    };
                    let mut got = Vec::new();
                    for y in &ys {
                        got.extend(s.clone_dtoh(y).map_err(up("y back"))?);
                    }
                    runs.push(got);
                }
                m.set_clusters(room);
                let (a, b) = (&runs[0], &runs[1]);
                if let Some(j) = (0..a.len()).find(|&j| a[j].to_bits() != b[j].to_bits()) {
                    return Err(CudaError::Invalid(format!(
                        "{rows:?} x {tokens} x {inp}: output {j}: {} in clusters, {} through \
                         device memory",
                        a[j], b[j]
                    )));
                }
                lines.push(format!(
                    "{rows:?} x {tokens} x {inp}: clusters of {} give the device-memory sums' bits",
                    shape.splits
                ));
            }
        }
        Ok(lines)
    })?;
    print_report(&report);
    Ok(())
}

/// Products of one input in one launch of a tensor-core kernel ([`w8a8_gemm_group`], as q, k and
/// v run) write, bit for bit, what the one product by their matrices stacked writes (the same
/// row blocks, split and summed alike), each its own buffer with its bias and residual, or split
/// (its rows, then as many zeros: gate and up for the SwiGLU); and products the group does not
/// take are left to the caller.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn products_of_one_launch_are_the_stacked_products_bits() -> Result<(), Box<dyn std::error::Error>>
{
    require_gpus(1)?;
    let pool = ThreadRankPool::new(1)?;
    let report = pool.run(&|ctx| {
        let s = &ctx.compute;
        let k = Fp8Kernels::load(ctx)?;
        let lt = W8a8Gemm::new(ctx)?;
        let up = |what: &str| ctx.drv(what, 0);
        let mut lines = Vec::new();
        // rows of the three products (multiples of 128: the stacked matrix's scale blocks are
        // theirs), inputs
        for (i, &(rows, inp)) in [([256usize, 128, 128], 512usize), ([384, 128, 256], 1024)]
            .iter()
            .enumerate()
        {
            let total: usize = rows.iter().sum();
            let mats: Vec<_> = rows
                .iter()
                .enumerate()
                .map(|(j, &r)| {
                    quantize_blocks("w", &values(r * inp, inp, 31 + (3 * i + j) as u64), r, inp)
                })
                .collect::<Result<_, _>>()
                .map_err(|e| CudaError::Invalid(e.to_string()))?;
            let stacked_q: Vec<u8> = mats.iter().flat_map(|m| m.data().to_vec()).collect();
            let stacked_s: Vec<f32> = mats.iter().flat_map(|m| m.scale_inv().to_vec()).collect();
            let bias: Vec<bf16> = (0..total)
                .map(|o| bf16::from_f32((o % 9) as f32 * 0.25 - 1.0))
                .collect();
            let upload_w = |q: &[u8], sc: &[f32]| -> Result<_, CudaError> {
                Ok((
                    s.clone_htod(q).map_err(up("weights"))?,
                    s.clone_htod(sc).map_err(up("scales"))?,
                ))
            };
            let one = upload_w(&stacked_q, &stacked_s)?;
            let parts = mats
                .iter()
                .map(|m| upload_w(m.data(), m.scale_inv()))
                .collect::<Result<Vec<_>, _>>()?;
            let weight = |(d, sc): &(CudaSlice<u8>, CudaSlice<f32>)| Fp8Weight {
                data: ptr(d, s),
                scales: ptr(sc, s),
                row0: 0,
                cols: inp as u64,
            };
            for tokens in [1usize, 5, 8, 12, 33, 64] {
                let x = values(tokens * inp, inp, 77 + tokens as u64);
                let (xs, _) = split(&x);
                let xd = s.clone_htod(&xs).map_err(up("activations"))?;
                let room = padded_tokens(tokens).max(8 * wgmma_tiles(tokens));
                let groups = inp / 128;
                // SAFETY: written by the quantisation before any product reads them.
                let (qd, scd) = unsafe {
                    (
                        alloc_device::<u8>(s, room * inp, 0, "q")?,
                        alloc_device::<f32>(s, room * groups, 0, "scales")?,
                    )
                };
                let res: Vec<f32> = (0..tokens * total)
                    .map(|j| (j % 13) as f32 * 0.5 - 3.0)
                    .collect();
                let mut limits = vec![(
                    W8a8Limits {
                        gemv: 0,
                        mma: MMA_TOKENS,
                        wgmma: 0,
                    },
                    "mma.sync",
                )];
                if lt.mma.as_ref().is_some_and(|m| m.has_wgmma()) {
                    limits.push((
                        W8a8Limits {
                            gemv: 0,
                            mma: 0,
                            wgmma: MMA_TOKENS,
                        },
                        "warpgroup",
                    ));
                }
                for (limits, path) in limits {
                    let held = Cell::new(None);
                    let through = W8a8Through {
                        x32: None,
                        act: Some((ptr(&qd, s), ptr(&scd, s), &held)),
                        same_input: false,
                    };
                    // the stacked product: its output [tokens × total], bias and residual
                    let bias_d = s.clone_htod(&bias).map_err(up("bias"))?;
                    let yd = s.clone_htod(&res).map_err(up("residual"))?;
                    let fin = Finish {
                        out: ptr(&yd, s),
                        bias: Some(ptr(&bias_d, s)),
                        res: Some(ptr(&yd, s)),
                    };
                    // SAFETY: the buffers above hold the sizes each product reads and writes.
                    let stacked = unsafe {
                        w8a8_gemm_group(
                            s,
                            &lt,
                            &k,
                            &[(weight(&one), total, fin)],
                            ptr(&xd, s),
                            (2 * tokens, inp),
                            (through, false),
                            limits,
                            0,
                        )?
                    };
                    // the three products in one launch, each its own output, bias and residual
                    let mut outs = Vec::new();
                    let mut biases = Vec::new();
                    let mut prods = Vec::new();
                    let mut col = 0;
                    for (j, &r) in rows.iter().enumerate() {
                        let b: Vec<bf16> = bias[col..col + r].to_vec();
                        let rr: Vec<f32> = (0..tokens)
                            .flat_map(|t| res[t * total + col..t * total + col + r].to_vec())
                            .collect();
                        let bd = s.clone_htod(&b).map_err(up("bias"))?;
                        let od = s.clone_htod(&rr).map_err(up("residual"))?;
                        let f = Finish {
                            out: ptr(&od, s),
                            bias: Some(ptr(&bd, s)),
                            res: Some(ptr(&od, s)),
                        };
                        prods.push((weight(&parts[j]), r, f));
                        outs.push(od);
                        biases.push(bd);
                        col += r;
                    }
                    let through = W8a8Through {
                        same_input: true,
                        ..through
                    };
                    // SAFETY: as above.
                    let grouped = unsafe {
                        w8a8_gemm_group(
                            s,
                            &lt,
                            &k,
                            &prods,
                            ptr(&xd, s),
                            (2 * tokens, inp),
                            (through, false),
                            limits,
                            0,
                        )?
                    };
                    let what = format!("{rows:?} x {tokens} x {inp} ({path})");
                    if !(stacked && grouped) {
                        return Err(CudaError::Invalid(format!(
                            "{what}: the tensor-core kernels did not take the group \
                             (stacked {stacked}, grouped {grouped})"
                        )));
                    }
                    let want = s.clone_dtoh(&yd).map_err(up("stacked back"))?;
                    let mut col = 0;
                    for (j, &r) in rows.iter().enumerate() {
                        let got = s.clone_dtoh(&outs[j]).map_err(up("product back"))?;
                        for t in 0..tokens {
                            for c in 0..r {
                                let (g, w) = (got[t * r + c], want[t * total + col + c]);
                                if g.to_bits() != w.to_bits() {
                                    return Err(CudaError::Invalid(format!(
                                        "{what}: product {j} token {t} row {c}: {g} in one \
                                         launch, {w} stacked"
                                    )));
                                }
                            }
                        }
                        col += r;
                    }
                    // split outputs (gate and up for the SwiGLU): each product's rows, then as
                    // many zeros, the rows those of the stacked product without bias or residual
                    let plain = |out| Finish {
                        out,
                        bias: None,
                        res: None,
                    };
                    // SAFETY: written whole by the product below.
                    let y0 = unsafe { alloc_device::<f32>(s, tokens * total, 0, "stacked")? };
                    let mut split_outs = Vec::new();
                    for &r in &rows {
                        split_outs.push(
                            s.clone_htod(&vec![7.0f32; 2 * tokens * r])
                                .map_err(up("split output"))?,
                        );
                    }
                    let split_prods: Vec<_> = rows
                        .iter()
                        .enumerate()
                        .map(|(j, &r)| (weight(&parts[j]), r, plain(ptr(&split_outs[j], s))))
                        .collect();
                    // SAFETY: as above; each split output holds 2 · tokens rows.
                    let both = unsafe {
                        w8a8_gemm_group(
                            s,
                            &lt,
                            &k,
                            &[(weight(&one), total, plain(ptr(&y0, s)))],
                            ptr(&xd, s),
                            (2 * tokens, inp),
                            (through, false),
                            limits,
                            0,
                        )? && w8a8_gemm_group(
                            s,
                            &lt,
                            &k,
                            &split_prods,
                            ptr(&xd, s),
                            (2 * tokens, inp),
                            (through, true),
                            limits,
                            0,
                        )?
                    };
                    if !both {
                        return Err(CudaError::Invalid(format!(
                            "{what}: the tensor-core kernels did not take the split group"
                        )));
                    }
                    let want = s.clone_dtoh(&y0).map_err(up("stacked back"))?;
                    let mut col = 0;
                    for (j, &r) in rows.iter().enumerate() {
                        let got = s.clone_dtoh(&split_outs[j]).map_err(up("split back"))?;
                        for t in 0..tokens {
                            for c in 0..r {
                                let (g, w) = (got[t * r + c], want[t * total + col + c]);
                                let lo = got[(tokens + t) * r + c];
                                if g.to_bits() != w.to_bits() || lo.to_bits() != 0 {
                                    return Err(CudaError::Invalid(format!(
                                        "{what}: split product {j} token {t} row {c}: {g} \
                                         (lo {lo}) in one launch, {w} stacked (lo 0)"
                                    )));
                                }
                            }
                        }
                        col += r;
                    }
                    lines.push(format!(
                        "{what}: the stacked product's bits, with and without split outputs"
                    ));
                }
                // a product the tensor-core kernels do not take (weight streaming): the group
                // is left to the caller, nothing launched
                let held = Cell::new(Some(ActLayout::Rows));
                let through = W8a8Through {
                    x32: None,
                    act: Some((ptr(&qd, s), ptr(&scd, s), &held)),
                    same_input: false,
                };
                let streaming = W8a8Limits {
                    gemv: GEMV_TOKENS,
                    mma: 0,
                    wgmma: 0,
                };
                let f = Finish {
                    out: 0,
                    bias: None,
                    res: None,
                };
                if tokens <= GEMV_TOKENS {
                    // SAFETY: nothing is launched (checked: the result and the held layout).
                    let took = unsafe {
                        w8a8_gemm_group(
                            s,
                            &lt,
                            &k,
                            &[(weight(&one), total, f)],
                            ptr(&xd, s),
                            (2 * tokens, inp),
                            (through, false),
                            streaming,
                            0,
                        )?
                    };
                    if took || held.get() != Some(ActLayout::Rows) {
                        return Err(CudaError::Invalid(format!(
                            "{rows:?} x {tokens}: a weight-streaming group was taken"
                        )));
                    }
                }
            }
        }
        Ok(lines)
    })?;
    print_report(&report);
    Ok(())
}
