//! fp8 rollout weights on the GPU, in the switch: the slices of an fp8 plan
//! ([`lifecycle_layout::fsdp::build_fp8_plan`]) quantised from the fp32 masters into the rank's
//! rollout buffer (e4m3 bytes, then one f32 `scale_inv` per 128 × 128 block), after the bucket
//! plan cast the bf16 tensors. One launch covers every slice: one thread block per scale block
//! finds its tensor in the job table, reads the block, agrees its amax, writes its scale and
//! its bytes; the amax is fused with the cast (the second read of the block hits L2).
//! Bit-identical to the host executor (`lifecycle_host::fp8::fp8_switch`), tested on one H200.
//!
//! So far at W = 1: every slice is a whole tensor of the rank's own master shard. At W > 1 a
//! slice's rows come from several ranks and their amax must be agreed before quantising
//! ([`lifecycle_layout::fp8::fp8_rank_traffic`] counts those messages); the backend refuses fp8
//! there at plan time.

use half::bf16;
use lifecycle_cuda::cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use lifecycle_cuda::{CudaError, KernelSet, RankCtx};
use lifecycle_layout::fp8::FP8_BLOCK;
use lifecycle_layout::fsdp::FsdpPlan;

/// CUDA C source of the fp8 kernels (no headers; e4m3 by integer arithmetic, as
/// `lifecycle_layout::fp8::e4m3_from_f32`).
pub const FP8_KERNEL_SRC: &str = r#"
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ unsigned char e4m3(float x) {
    u32 bits = __float_as_uint(x);
    u32 sign = (bits >> 24) & 0x80u;
    u32 mag = bits & 0x7fffffffu;
    u32 b;
    if (mag >= (1087u << 20)) {
        b = 0x7fu;
    } else if (mag < (121u << 23)) {
        float sum = __uint_as_float(mag) + __uint_as_float(141u << 23);
        b = (__float_as_uint(sum) - (141u << 23)) & 0xffu;
    } else {
        u32 odd = (mag >> 20) & 1u;
        u32 reb = mag + (((u32)(7 - 127)) << 23) + 0x7ffffu + odd;
        b = (reb >> 20) & 0xffu;
    }
    return (unsigned char)(b | sign);
}

// Blocks of 256 threads loop over the 128 x 128 scale blocks (tiles) of every job, all jobs in
// one launch. Job j
// is jobs[6j .. 6j + 6] = (master offset of its first element, byte offset of its first e4m3
// byte, index of its first scale, rows, columns, its first tile); a tile's block is
// found by binary search over the first tiles. amax over the block, scale_inv = amax / 448 (1 for
// an all-zero block) to scales, every element e4m3(x / scale_inv) to dst (row pitch: the
// columns, for the masters and the bytes alike).
extern "C" __global__ void quantize_e4m3_jobs(const float* __restrict__ master,
                                              const u64* __restrict__ jobs, u32 njobs,
                                              u32 ntiles, unsigned char* __restrict__ dst,
                                              float* __restrict__ scales) {
    __shared__ float red[8];
    for (u32 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    u32 lo = 0, hi = njobs;
    while (hi - lo > 1) {
        u32 mid = (lo + hi) / 2;
        if (jobs[6ull * mid + 5] <= tile) lo = mid; else hi = mid;
    }
    const u64* j = jobs + 6ull * lo;
    u64 k = tile - j[5];
    u64 ld = j[4];
    u64 bc = (ld + 127) / 128;
    u64 r0 = (k / bc) * 128, c0 = (k % bc) * 128;
    u32 h = (u32)min(128ull, j[3] - r0), w = (u32)min(128ull, ld - c0);
    u64 src_off = j[0] + r0 * ld + c0, dst_off = j[1] + r0 * ld + c0;
    const float* src = master + src_off;
    unsigned char* out = dst + dst_off;
    // vectorised when every row of the tile starts on 16 bytes (4 in the output) and holds whole
    // float4s: thread (tx, ty) of 32 x 8 reads columns 4tx .. 4tx + 3 of rows ty, ty + 8, ...
    bool vec = (ld % 4 == 0) && (w % 4 == 0) && (src_off % 4 == 0) && (dst_off % 4 == 0);
    u32 tx = threadIdx.x & 31u, ty = threadIdx.x >> 5;
    float m = 0.0f;
    if (vec) {
        for (u32 r = ty; r < h; r += 8) {
            for (u32 c = 4 * tx; c < w; c += 128) {
                float4 v = *reinterpret_cast<const float4*>(src + r * ld + c);
                m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
            }
        }
    } else {
        for (u32 i = threadIdx.x; i < h * w; i += blockDim.x) {
            u32 r = i / w, c = i - r * w;
            m = fmaxf(m, fabsf(src[r * ld + c]));
        }
    }
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __syncthreads();  // the previous tile's readers of red are done
    if (tx == 0) red[ty] = m;
    __syncthreads();
    float amax = 0.0f;
    for (u32 q = 0; q < (blockDim.x + 31u) / 32u; ++q) amax = fmaxf(amax, red[q]);
    float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    if (threadIdx.x == 0) scales[j[2] + k] = s;
    if (vec) {
        for (u32 r = ty; r < h; r += 8) {
            for (u32 c = 4 * tx; c < w; c += 128) {
                float4 v = *reinterpret_cast<const float4*>(src + r * ld + c);
                u32 packed = (u32)e4m3(v.x / s) | ((u32)e4m3(v.y / s) << 8)
                           | ((u32)e4m3(v.z / s) << 16) | ((u32)e4m3(v.w / s) << 24);
                *reinterpret_cast<u32*>(out + r * ld + c) = packed;
            }
        }
    } else {
        for (u32 i = threadIdx.x; i < h * w; i += blockDim.x) {
            u32 r = i / w, c = i - r * w;
            out[r * ld + c] = e4m3(src[r * ld + c] / s);
        }
    }
    }
}
"#;

/// [`FP8_KERNEL_SRC`] as a kernel set, IEEE-exact (the divisions round as the host's do).
pub const FP8_KERNELS: KernelSet =
    KernelSet::new("lifecycle_fsdp fp8 kernels", FP8_KERNEL_SRC).exact();

/// Rank `rank`'s quantisation jobs of `plan` (six words each, as the kernel reads them) and its
/// tile count; `None` when the rank has no fp8 slice. Each slice must be a whole tensor of the
/// rank's own master shard (W = 1), which the backend checked at plan time.
pub(crate) fn rank_jobs(plan: &FsdpPlan, rank: usize) -> Option<(Vec<u64>, u32)> {
    let slices = plan.fp8.get(rank).filter(|s| !s.is_empty())?;
    let mut jobs = Vec::with_capacity(6 * slices.len());
    let mut tiles = 0u64;
    let b = FP8_BLOCK as u64;
    for s in slices {
        let slot = &plan.shards.slots[s.tensor.train_index];
        let (rows, cols) = (s.tensor.rows.len() as u64, s.tensor.cols.len() as u64);
        let master = slot.offset + s.tensor.rows.start as u64 * slot.cols as u64;
        let scale = s.entry.scale_offset().unwrap_or(0) as u64 / 2;
        jobs.extend_from_slice(&[
            master,
            2 * s.entry.offset() as u64,
            scale,
            rows,
            cols,
            tiles,
        ]);
        tiles += rows.div_ceil(b) * cols.div_ceil(b);
    }
    Some((jobs, u32::try_from(tiles).ok()?))
}

/// Quantises rank `ctx.rank`'s fp8 slices of `plan` from `master` into `roll` on the compute
/// stream and waits for it; returns the bytes written.
pub(crate) fn quantise_rank(
    ctx: &RankCtx,
    plan: &FsdpPlan,
    master: &CudaSlice<f32>,
    roll: &mut CudaSlice<bf16>,
) -> Result<u64, CudaError> {
    let Some((jobs, tiles)) = rank_jobs(plan, ctx.rank) else {
        return Ok(0);
    };
    let s = &ctx.compute;
    let m = ctx.module(&FP8_KERNELS)?;
    let f = m.function("quantize_e4m3_jobs")?;
    let jobs_d = s
        .clone_htod(&jobs)
        .map_err(ctx.drv("uploading the fp8 jobs", 8 * jobs.len() as u64))?;
    let njobs = (jobs.len() / 6) as u32;
    let (base, _sync) = roll.device_ptr(s);
    // one block per tile: limiting the grid to keep the tiles in flight inside L2 measured
    // slower on an H200 (17.1 against 15.3 ms at 7.6B)
    let grid = tiles;
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = s.launch_builder(&f);
    b.arg(master)
        .arg(&jobs_d)
        .arg(&njobs)
        .arg(&tiles)
        .arg(&base)
        .arg(&base);
    // SAFETY: the rollout buffer is passed as both the byte and the scale pointer; every job
    // writes its bytes at 2 · entry offset and its scales at the entry's scale slots, inside the
    // buffer and disjoint from every other entry (the plan's entries tile it without overlap),
    // and reads its master rows inside the master shard (the slot's offset and pitch, W = 1);
    // the argument list matches the kernel's. The stream is synchronised below, before the
    // jobs' upload is dropped.
    unsafe { b.launch(cfg) }
        .map_err(|e| CudaError::driver(ctx.rank, "quantising the rollout weights to fp8", 0, e))?;
    s.synchronize()
        .map_err(ctx.drv("waiting for the fp8 quantisation", 0))?;
    Ok(plan.fp8[ctx.rank].iter().map(|x| x.entry.bytes()).sum())
}
