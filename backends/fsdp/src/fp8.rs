//! fp8 rollout weights on the GPU, so far at W = 1: every tensor that an fp8 rollout quantises
//! ([`lifecycle_layout::fp8::keeps_bf16`] false) cast from the fp32 masters into block-scaled
//! e4m3 ([`lifecycle_layout::fp8`]). One launch covers every tensor: one thread block per
//! 128 × 128 block reads the block, agrees its amax, writes its `scale_inv` and its bytes; the
//! amax is fused with the cast, so the masters are read from device memory once (the second read
//! hits L2). Bit-identical to the host
//! ([`lifecycle_host::fp8::fp8_switch`] at W = 1), tested on one H200.
//!
//! Not yet part of the switch: the rollout buffers the backend hands out stay bf16.

use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use lifecycle_cuda::{alloc_device, CudaError, KernelSet, RankExecutor};
use lifecycle_layout::fp8::{keeps_bf16, FP8_BLOCK};

use crate::backend::FsdpBackend;
use crate::state::{FsdpTrainState, RankTrain};
use crate::FsdpError;

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

// One block of 256 threads per 128 x 128 scale block, all tensors in one launch: tile t is
// tiles[5t .. 5t + 5] = (master offset of its first element, byte offset of its first output,
// its scale's index, the tensor's row pitch (its columns), rows << 32 | columns of the tile).
// amax over the tile, scale_inv = amax / 448 (1 for an all-zero tile) to scales, every element
// e4m3(x / scale_inv) to dst (row pitch: the tensor's columns).
extern "C" __global__ void quantize_e4m3_tiles(const float* __restrict__ master,
                                               const u64* __restrict__ tiles,
                                               unsigned char* __restrict__ dst,
                                               float* __restrict__ scales) {
    __shared__ float red[8];
    const u64* t = tiles + 5ull * blockIdx.x;
    const float* src = master + t[0];
    unsigned char* out = dst + t[1];
    u64 ld = t[3];
    u32 h = (u32)(t[4] >> 32), w = (u32)(t[4] & 0xffffffffull);
    // vectorised when every row of the tile starts on 16 bytes (4 in the output) and holds whole
    // float4s: thread (tx, ty) of 32 x 8 reads columns 4tx .. 4tx + 3 of rows ty, ty + 8, ...
    bool vec = (ld % 4 == 0) && (w % 4 == 0) && (t[0] % 4 == 0) && (t[1] % 4 == 0);
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
    if (tx == 0) red[ty] = m;
    __syncthreads();
    float amax = 0.0f;
    for (u32 k = 0; k < (blockDim.x + 31u) / 32u; ++k) amax = fmaxf(amax, red[k]);
    float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    if (threadIdx.x == 0) scales[t[2]] = s;
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
"#;

/// [`FP8_KERNEL_SRC`] as a kernel set, IEEE-exact (the divisions round as the host's do).
pub const FP8_KERNELS: KernelSet =
    KernelSet::new("lifecycle_fsdp fp8 kernels", FP8_KERNEL_SRC).exact();

/// One tensor of a GPU fp8 quantisation, downloaded: its e4m3 bytes (row-major) and one
/// `scale_inv` per 128 × 128 block (row-major over the blocks).
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Download {
    /// Tensor name.
    pub name: String,
    /// e4m3 bytes.
    pub data: Vec<u8>,
    /// Block scales.
    pub scale_inv: Vec<f32>,
}

/// One quantised tensor's place: master slot and output offsets.
struct Job {
    name: String,
    master_off: u64,
    rows: u64,
    cols: u64,
    data_off: u64,
    scale_off: u64,
    blocks: u64,
}

impl FsdpBackend {
    /// Quantises every fp8 tensor of `state` on the GPU (W = 1 only so far), `iters` times,
    /// and returns the tensors of the last run downloaded and the median wall time of one run
    /// (all kernels launched, then the stream synchronised). Non-finite masters are refused
    /// first, naming the tensor.
    pub fn fp8_quantize_w1(
        &self,
        state: &FsdpTrainState,
        iters: usize,
    ) -> Result<(Vec<Fp8Download>, Duration), FsdpError> {
        if self.pool.world() != 1 || self.pool.local_ranks().len() != 1 {
            return Err(FsdpError::Config(format!(
                "fp8 quantisation on the GPU runs at W = 1 so far (this pool has W = {})",
                self.pool.world()
            )));
        }
        if state.master_offloaded() {
            return Err(FsdpError::Offloaded {
                operation: "quantising rollout weights to fp8",
            });
        }
        self.check_finite(state)?;
        let mut jobs = Vec::new();
        let (mut data_len, mut scale_len) = (0u64, 0u64);
        for slot in &state.shards.slots {
            if keeps_bf16(&slot.name, &slot.shape) {
                continue;
            }
            let rows = slot.shape.first().copied().unwrap_or(1) as u64;
            let cols = slot.cols as u64;
            let blocks = rows.div_ceil(FP8_BLOCK as u64) * cols.div_ceil(FP8_BLOCK as u64);
            jobs.push(Job {
                name: slot.name.clone(),
                master_off: slot.offset,
                rows,
                cols,
                data_off: data_len,
                scale_off: scale_len,
                blocks,
            });
            data_len += rows * cols;
            scale_len += blocks;
        }
        // one tile per 128 x 128 block of every job
        let mut table: Vec<u64> = Vec::with_capacity(5 * scale_len as usize);
        let b = FP8_BLOCK as u64;
        for j in &jobs {
            let bc = j.cols.div_ceil(b);
            for k in 0..j.blocks {
                let (r0, c0) = ((k / bc) * b, (k % bc) * b);
                let (h, w) = ((j.rows - r0).min(b), (j.cols - c0).min(b));
                table.extend_from_slice(&[
                    j.master_off + r0 * j.cols + c0,
                    j.data_off + r0 * j.cols + c0,
                    j.scale_off + k,
                    j.cols,
                    (h << 32) | w,
                ]);
            }
        }
        let tiles = scale_len;
        if tiles > u64::from(u32::MAX >> 1) {
            return Err(FsdpError::Config(format!(
                "{tiles} fp8 blocks are more than one launch takes"
            )));
        }
        let table = &table;
        let mut items: Vec<&RankTrain> = state.ranks.iter().collect();
        let out = self.pool.run_each(&mut items, &|ctx, rt| {
            let s = &ctx.compute;
            let master = rt
                .master
                .device()
                .ok_or_else(|| CudaError::Invalid("the master weights are not resident".into()))?;
            let m = ctx.module(&FP8_KERNELS)?;
            let f = m.function("quantize_e4m3_tiles")?;
            let table_d = s
                .clone_htod(table)
                .map_err(ctx.drv("uploading the fp8 tile table", 8 * table.len() as u64))?;
            // SAFETY: every byte and scale is written by the kernels below before the
            // download reads them (the jobs tile both buffers exactly).
            let (mut data, mut scales): (CudaSlice<u8>, CudaSlice<f32>) = unsafe {
                (
                    alloc_device(s, data_len.max(1) as usize, ctx.rank, "fp8 rollout bytes")?,
                    alloc_device(s, scale_len.max(1) as usize, ctx.rank, "fp8 block scales")?,
                )
            };
            let mut times = Vec::with_capacity(iters.max(1));
            for _ in 0..iters.max(1) {
                s.synchronize().map_err(ctx.drv("synchronizing", 0))?;
                let start = Instant::now();
                if tiles > 0 {
                    let cfg = LaunchConfig {
                        grid_dim: (tiles as u32, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let mut b = s.launch_builder(&f);
                    b.arg(master).arg(&table_d).arg(&mut data).arg(&mut scales);
                    // SAFETY: each tile addresses its tensor's masters inside the master
                    // buffer (the slots' offsets, W = 1: whole tensors of pitch cols), its bytes
                    // inside `data` and its scale inside `scales` (the offsets above tile both
                    // exactly); the argument list matches the kernel's.
                    unsafe { b.launch(cfg) }.map_err(|e| {
                        CudaError::driver(ctx.rank, "quantising the rollout weights to fp8", 0, e)
                    })?;
                }
                s.synchronize().map_err(ctx.drv("synchronizing", 0))?;
                times.push(start.elapsed());
            }
            times.sort();
            let median = times[times.len() / 2];
            let bytes = s
                .clone_dtoh(&data)
                .map_err(ctx.drv("downloading fp8 bytes", data_len))?;
            let scale_host = s
                .clone_dtoh(&scales)
                .map_err(ctx.drv("downloading fp8 scales", 4 * scale_len))?;
            Ok((bytes, scale_host, median))
        })?;
        let (bytes, scales, median) = out
            .into_iter()
            .next()
            .ok_or_else(|| FsdpError::Config("no rank ran the fp8 quantisation".into()))?;
        let tensors = jobs
            .iter()
            .map(|j| Fp8Download {
                name: j.name.clone(),
                data: bytes[j.data_off as usize..(j.data_off + j.rows * j.cols) as usize].to_vec(),
                scale_inv: scales[j.scale_off as usize..(j.scale_off + j.blocks) as usize].to_vec(),
            })
            .collect();
        Ok((tensors, median))
    }
}
