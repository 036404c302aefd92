// Block-scaled e4m3 quantisation of fp32 regions (fp8 rollout weights): the `Op::Quantise` step
// of the step IR (lifecycle_layout::steps::Quantise), run by lifecycle_cuda's step runner.
//
// Launch contract (lifecycle_cuda::quantise::launch):
//   grid   one block per 128 x 128 tile of all jobs (ntiles), block 32 x (128 / QUANTISE_HELD)
//          threads (512 at the default QUANTISE_HELD of 8 float4 per thread);
//   master the rank's fp32 training buffer (read only, the jobs' regions inside it);
//   jobs   6 u64 per job: (first source element, first e4m3 byte, first scale (f32 index),
//          rows, columns, first tile), jobs in order of their first tile;
//   dst    the rollout buffer as bytes, scales the same buffer as f32: each job writes its own
//          bytes and scales, disjoint from every other job's and every bf16 tensor's.
// No headers; e4m3 by integer arithmetic, as lifecycle_layout::fp8::e4m3_from_f32. Compiled
// IEEE-exact (KernelSet::exact): the divisions round as the host's do.

typedef unsigned int u32;
typedef unsigned long long u64;

// float4s of one column group a thread holds (a power of two, 1 to 32).
#ifndef QUANTISE_HELD
#define QUANTISE_HELD 8
#endif
#define QUANTISE_ROWS_PER_PASS (128 / QUANTISE_HELD)

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

// Two e4m3 bytes (hi << 8 | lo) of finite values; sm_89 and later convert in hardware (round to
// nearest even, as e4m3 above for every finite value: |x| <= 448 after the block's scaling, so
// saturation never applies), earlier GPUs by the integer path.
__device__ __forceinline__ u32 e4m3x2(float hi, float lo) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return (u32)r;
#else
    return ((u32)e4m3(hi) << 8) | (u32)e4m3(lo);
#endif
}

// Four e4m3 bytes of v / s, little-endian; `exact_only`: a block holding a non-finite value,
// converted by the integer path (the hardware's NaN is not the host's).
__device__ __forceinline__ u32 pack4(float4 v, float s, bool exact_only) {
    float a = v.x / s, b = v.y / s, c = v.z / s, d = v.w / s;
    if (exact_only) {
        return (u32)e4m3(a) | ((u32)e4m3(b) << 8) | ((u32)e4m3(c) << 16) | ((u32)e4m3(d) << 24);
    }
    return e4m3x2(b, a) | (e4m3x2(d, c) << 16);
}

// Blocks of 32 x (128 / QUANTISE_HELD) threads loop over the 128 x 128 scale blocks (tiles) of every job, all jobs in
// one launch. Job j is jobs[6j .. 6j + 6] = (master offset of its first element, byte offset of
// its first e4m3 byte, index of its first scale, rows, columns, its first tile); a tile's job is
// found by binary search over the first tiles. amax over the block, scale_inv = amax / 448 (1 for
// an all-zero block) to scales, every element e4m3(x / scale_inv) to dst (row pitch: the
// columns, for the masters and the bytes alike).
//
// One read of each block: where every row of the tile starts on 16 bytes (4 in the output) and
// holds whole float4s, thread (tx, ty) of 32 x R (R = 128 / QUANTISE_HELD) loads columns
// 4tx .. 4tx + 3 of rows ty, ty + R, ... into registers (QUANTISE_HELD float4), the block reduces
// their amax (warp shuffles, then one word per warp), and the thread casts and writes what it
// holds. Other tiles are read twice
// (the second read hits L2).
extern "C" __global__ void __launch_bounds__(32 * QUANTISE_ROWS_PER_PASS)
quantize_e4m3_jobs(const float* __restrict__ master, const u64* __restrict__ jobs, u32 njobs,
                   u32 ntiles, unsigned char* __restrict__ dst, float* __restrict__ scales) {
    __shared__ float red[32];
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
    bool vec = (ld % 4 == 0) && (w % 4 == 0) && (src_off % 4 == 0) && (dst_off % 4 == 0);
    u32 tx = threadIdx.x & 31u, ty = threadIdx.x >> 5;
    u32 c = 4 * tx;
    bool mine = vec && c < w;
    float4 held[QUANTISE_HELD];
    float m = 0.0f;
    bool bad = false;
    if (vec) {
#pragma unroll
        for (u32 i = 0; i < QUANTISE_HELD; ++i) {
            u32 r = ty + QUANTISE_ROWS_PER_PASS * i;
            held[i] = (mine && r < h) ? *reinterpret_cast<const float4*>(src + r * ld + c)
                                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            float4 v = held[i];
            m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
            // not (|x| <= max): NaN or infinity
            bad |= !(fabsf(v.x) <= 3.402823466e38f) || !(fabsf(v.y) <= 3.402823466e38f)
                || !(fabsf(v.z) <= 3.402823466e38f) || !(fabsf(v.w) <= 3.402823466e38f);
        }
    } else {
        for (u32 i = threadIdx.x; i < h * w; i += blockDim.x) {
            u32 r = i / w, cc = i - r * w;
            m = fmaxf(m, fabsf(src[r * ld + cc]));
        }
    }
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __syncthreads();  // the previous tile's readers of red are done
    if (tx == 0) red[ty] = m;
    bool exact_only = __syncthreads_or(bad) != 0;
    float amax = 0.0f;
    for (u32 q = 0; q < (blockDim.x + 31u) / 32u; ++q) amax = fmaxf(amax, red[q]);
    float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    if (threadIdx.x == 0) scales[j[2] + k] = s;
    if (vec) {
        if (mine) {
#pragma unroll
            for (u32 i = 0; i < QUANTISE_HELD; ++i) {
                u32 r = ty + QUANTISE_ROWS_PER_PASS * i;
                if (r < h) *reinterpret_cast<u32*>(out + r * ld + c) = pack4(held[i], s, exact_only);
            }
        }
    } else {
        for (u32 i = threadIdx.x; i < h * w; i += blockDim.x) {
            u32 r = i / w, cc = i - r * w;
            out[r * ld + cc] = e4m3(src[r * ld + cc] / s);
        }
    }
    }
}
