// Block-scaled e4m3 quantisation of fp32 regions (fp8 rollout weights): the `Op::Quantise` step
// of the step IR (lifecycle_layout::steps::Quantise), run by lifecycle_cuda's step runner.
//
// Launch contract (lifecycle_cuda::quantise::launch):
//   grid   one block per 128 x 128 tile of all jobs (ntiles), block 256 threads (32 x 8);
//   master the rank's fp32 training buffer (read only, the jobs' regions inside it);
//   jobs   6 u64 per job: (first source element, first e4m3 byte, first scale (f32 index),
//          rows, columns, first tile), jobs in order of their first tile;
//   dst    the rollout buffer as bytes, scales the same buffer as f32: each job writes its own
//          bytes and scales, disjoint from every other job's and every bf16 tensor's.
// No headers; e4m3 by integer arithmetic, as lifecycle_layout::fp8::e4m3_from_f32. Compiled
// IEEE-exact (KernelSet::exact): the divisions round as the host's do.

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
