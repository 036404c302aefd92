//! GPU test of the fp8 quantisation kernel over a bf16 source (the Megatron backends' fp8
//! rollouts, staged or in one read of the parameters): run on a machine with an NVIDIA GPU with
//! `cargo test --release -p lifecycle-cuda --test gpu_quantise -- --ignored`. In CI (no GPU) it
//! is reported as ignored, not passed.

use half::bf16;
use lifecycle_cuda::testing::require_gpus;
use lifecycle_cuda::{quantise_staged, CudaError, RankExecutor, ThreadRankPool};
use lifecycle_layout::fp8::{block_scale_inv, e4m3_from_f32, FP8_BLOCK};
use lifecycle_layout::megatron::Fp8Rollout;
use lifecycle_layout::steps::Quantise;

type Res = Result<(), Box<dyn std::error::Error>>;

/// Values over many binades (e4m3 subnormals after scaling among them), from a splitmix64
/// stream, with zeros, and whole zero rows.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..n)
        .map(|i| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            if i % 97 == 0 {
                return 0.0;
            }
            let m = (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            m * 2f32.powi((z % 24) as i32 - 12)
        })
        .collect()
}

/// The bytes and scales of `q` over `x` as the host step runner writes them: per block the
/// amax (`f32::max`, which skips NaN as the kernel's `fmaxf` does), `block_scale_inv`, then
/// `e4m3(x / scale_inv)` per value.
fn expected(x: &[f32], q: &Quantise, out: &mut [u8]) {
    let (rows, cols) = (q.rows as usize, q.cols as usize);
    let b = FP8_BLOCK;
    let bc = cols.div_ceil(b);
    for br in 0..rows.div_ceil(b) {
        for bcol in 0..bc {
            let (r1, c1) = ((br * b + b).min(rows), (bcol * b + b).min(cols));
            let at = |r: usize, c: usize| q.src_off as usize + r * cols + c;
            let mut amax = 0.0f32;
            for r in br * b..r1 {
                for c in bcol * b..c1 {
                    amax = amax.max(x[at(r, c)].abs());
                }
            }
            let s = block_scale_inv(amax);
            for r in br * b..r1 {
                for c in bcol * b..c1 {
                    out[q.dst_byte as usize + r * cols + c] = e4m3_from_f32(x[at(r, c)] / s);
                }
            }
            let k = 4 * (q.scale as usize + br * bc + bcol);
            out[k..k + 4].copy_from_slice(&s.to_le_bytes());
        }
    }
}

/// Regions of whole and partial blocks read 8 values at a time (rows on 16 bytes), one whose
/// rows are not (the scalar path), blocks holding a NaN, an infinity or only zeros: every byte
/// and scale as the host's.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bf16_quantisation_matches_the_host_formula() -> Res {
    require_gpus(1)?;
    // (rows, cols, source element offset)
    let shapes = [
        (384usize, 256usize, 0usize),
        (200, 136, 0),
        (130, 130, 4),
        (256, 512, 0),
    ];
    let mut quantise = Vec::new();
    let (mut src, mut dst, mut scale_bytes) = (0usize, 0usize, 0usize);
    for &(rows, cols, skew) in &shapes {
        src += skew;
        quantise.push(Quantise {
            src_off: src as u64,
            dst_byte: dst as u64,
            scale: 0,
            rows: rows as u64,
            cols: cols as u64,
            src_ld: cols as u64,
        });
        src += rows * cols;
        dst += (rows * cols).next_multiple_of(16);
        scale_bytes += 4 * quantise.last().map_or(0, |q| q.blocks() as usize);
    }
    let mut at = dst / 4;
    for q in &mut quantise {
        q.scale = at as u64;
        at += q.blocks() as usize;
    }
    let len = (dst + scale_bytes).div_ceil(2);
    let mut x = values(5, src);
    // region 0: a NaN in block (1, 0), an infinity in block (2, 1), block (0, 1) all zeros
    x[130 * 256 + 7] = f32::NAN;
    x[300 * 256 + 200] = f32::INFINITY;
    for r in 0..128 {
        x[r * 256 + 128..r * 256 + 256].fill(0.0);
    }
    // region 3: -infinity in its last block
    let last = quantise[3].src_off as usize + 255 * 512 + 511;
    x[last] = f32::NEG_INFINITY;
    let staging: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let widened: Vec<f32> = staging.iter().map(|v| v.to_f32()).collect();
    let mut want = vec![0u8; 2 * len];
    for q in &quantise {
        expected(&widened, q, &mut want);
    }
    let f = Fp8Rollout {
        entries: Vec::new(),
        len,
        staging_len: staging.len(),
        copies: Vec::new(),
        quantise,
    };
    let pool = ThreadRankPool::on_devices(&[0])?;
    let got = pool.run(&|ctx| {
        let s = ctx
            .compute
            .clone_htod(&staging)
            .map_err(ctx.drv("uploading", 0))?;
        let mut r = ctx
            .compute
            .alloc_zeros::<bf16>(len)
            .map_err(ctx.drv("allocating", 0))?;
        quantise_staged(ctx, &f, &s, &mut r)?;
        let back: Vec<bf16> = ctx
            .compute
            .clone_dtoh(&r)
            .map_err(ctx.drv("downloading", 0))?;
        Ok::<_, CudaError>(back)
    })?;
    let bytes: Vec<u8> = got[0]
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .collect();
    // An infinity's own byte is e4m3(inf / inf), a NaN whose sign the platform picks (x86's
    // default NaN is negative, the GPU's positive): both must be NaN (0x7f or 0xff) there.
    let infinities = [300 * 256 + 200, last - f.quantise[3].src_off as usize];
    let nan_at = [
        f.quantise[0].dst_byte as usize + infinities[0],
        f.quantise[3].dst_byte as usize + infinities[1],
    ];
    for &i in &nan_at {
        assert_eq!(bytes[i] & 0x7f, 0x7f, "byte {i}: {:#x}", bytes[i]);
        assert_eq!(want[i] & 0x7f, 0x7f, "byte {i}: {:#x}", want[i]);
    }
    let first = bytes
        .iter()
        .zip(&want)
        .enumerate()
        .position(|(i, (a, b))| a != b && !nan_at.contains(&i));
    assert_eq!(first, None, "first differing byte (of {})", bytes.len());
    eprintln!("{} bytes of e4m3 and scales as the host's", bytes.len());
    Ok(())
}
