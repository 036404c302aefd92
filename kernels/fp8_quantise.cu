// Block-scaled e4m3 quantisation of fp32 regions (fp8 rollout weights): the `Op::Quantise` step
// of the step IR (lifecycle_layout::steps::Quantise), run by lifecycle_cuda's step runner; and of
// bf16 regions of a staging buffer (the Megatron backends' fp8 rollout,
// lifecycle_layout::megatron::Fp8Rollout), run by lifecycle_cuda::quantise::quantise_staged.
//
// Launch contract (lifecycle_cuda::quantise::launch):
//   grid   one block per QUANTISE_TILES_PER_BLOCK consecutive 128 x 128 tiles of all jobs
//          (ceil(ntiles / 2) at the default), block 32 x (128 / QUANTISE_HELD)
//          threads (512 at the default QUANTISE_HELD of 8 float4 per thread); for
//          quantize_e4m3_jobs_bf16 32 x (128 / QUANTISE_HELD_BF16) (256 at the default 16);
//   master the rank's fp32 training buffer, or for quantize_e4m3_jobs_bf16 a bf16 staging buffer
//          (read only, the jobs' regions inside it);
//   jobs   7 u64 per job: (first source element, first e4m3 byte, first scale (f32 index),
//          rows, columns, first tile, source row pitch), jobs in order of their first tile;
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
// Consecutive tiles a block quantises (the launch's grid: ceil(ntiles / this)): the next tile of
// the same job needs no search for its job.
#ifndef QUANTISE_TILES_PER_BLOCK
#define QUANTISE_TILES_PER_BLOCK 2
#endif
// The same over bf16 sources (tile_bf16), whose loads are kept packed: 16 float4's worth of
// values (8 uint4 of 8 bf16) per thread, 256 threads a block.
#ifndef QUANTISE_HELD_BF16
#define QUANTISE_HELD_BF16 16
#endif
#define QUANTISE_ROWS_PER_PASS_BF16 (128 / QUANTISE_HELD_BF16)

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

// x / s (finite, |x / s| <= 448) as far as its e4m3 byte goes: the byte of the IEEE quotient,
// computed as x * inv (inv = 1 / s, rounded) where that cannot change it. The product is within
// 3 ulps of the rounded quotient; e4m3 keeps the top 3 of the 23 mantissa bits (in its normal
// range, |q| >= 2^-6), so the two give one byte unless the discarded 20 bits lie near the
// rounding midpoint 0x80000. Within 16 ulps of it, and below 2^-6 (e4m3 subnormals), the IEEE
// division decides: the division runs for about 3 in 10^5 weights, and the kernel at the rate of
// its multiply (the division alone bound the bf16 kernel at 1.7x its copy floor). The probe
// (bench quantise_probe) defines QUANTISE_DIVIDE_ALWAYS or, as a diagnostic that is not exact,
// QUANTISE_MULTIPLY_ONLY.
__device__ __forceinline__ float quotient(float x, float s, float inv) {
#if defined(QUANTISE_DIVIDE_ALWAYS)
    return x / s;
#elif defined(QUANTISE_MULTIPLY_ONLY)
    return x * inv;
#else
    float q = x * inv;
    u32 low = __float_as_uint(q) & 0xfffffu;
    bool near_midpoint = low + 16u - 0x80000u < 32u;
    if (near_midpoint || fabsf(q) < 0.0157f) q = x / s;
    return q;
#endif
}

// Four e4m3 bytes of v / s, little-endian (inv = 1 / s); `exact_only`: a block holding a
// non-finite value, converted by the integer path (the hardware's NaN is not the host's).
__device__ __forceinline__ u32 pack4(float4 v, float s, float inv, bool exact_only) {
    if (exact_only) {
        float a = v.x / s, b = v.y / s, c = v.z / s, d = v.w / s;
        return (u32)e4m3(a) | ((u32)e4m3(b) << 8) | ((u32)e4m3(c) << 16) | ((u32)e4m3(d) << 24);
    }
    float a = quotient(v.x, s, inv), b = quotient(v.y, s, inv);
    float c = quotient(v.z, s, inv), d = quotient(v.w, s, inv);
    return e4m3x2(b, a) | (e4m3x2(d, c) << 16);
}

// Blocks of 32 x (128 / QUANTISE_HELD) threads loop over the 128 x 128 scale blocks (tiles) of every job, all jobs in
// one launch. Job j is jobs[7j .. 7j + 7] = (master offset of its first element, byte offset of
// its first e4m3 byte, index of its first scale, rows, columns, its first tile, the source's row
// pitch); a tile's job is
// found by a search over the first tiles (find_job). amax over the block, scale_inv = amax / 448 (1 for
// an all-zero block) to scales, every element e4m3(x / scale_inv) to dst (row pitch: the
// columns; the source's: its own).
//
// One read of each block: where every row of the tile starts on 16 bytes (4 in the output) and
// holds whole float4s, thread (tx, ty) of 32 x R (R = 128 / QUANTISE_HELD) loads columns
// 4tx .. 4tx + 3 of rows ty, ty + R, ... into registers (QUANTISE_HELD float4), the block reduces
// their amax (warp shuffles, then one word per warp), and the thread casts and writes what it
// holds. Other tiles are read twice
// (the second read hits L2).
//
// The source is fp32 (`quantize_e4m3_jobs`: the masters) or bf16 (`quantize_e4m3_jobs_bf16`: a
// staging buffer of a bf16 rollout or the bf16 parameters, each value widened to f32 exactly),
// one loop for both. Over bf16 rows on 16 bytes a thread loads 8 columns of a row at a time
// (tile_bf16: columns 8 (tx mod 16) .., rows 2 ty + tx / 16, then 2 R further) and keeps them
// packed; other bf16 tiles take the scalar path.

// Four source values from 4 aligned elements, and one.
__device__ __forceinline__ float4 load4(const float* p) {
    return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ float load1(const float* p) { return *p; }
__device__ __forceinline__ float widen(unsigned short b) { return __uint_as_float((u32)b << 16); }
__device__ __forceinline__ float4 load4(const unsigned short* p) {
    uint2 w = *reinterpret_cast<const uint2*>(p);
    return make_float4(widen((unsigned short)(w.x & 0xffffu)), widen((unsigned short)(w.x >> 16)),
                       widen((unsigned short)(w.y & 0xffffu)), widen((unsigned short)(w.y >> 16)));
}
__device__ __forceinline__ float load1(const unsigned short* p) { return widen(*p); }

// Over bf16 rows on 16 bytes (vec8 below) a thread keeps its loads as loaded, 8 values a uint4
// (half the registers of widened values): the amax and the non-finite test are taken on the
// bf16 magnitudes as integers, two a word (for finite values their order is the values' order;
// NaN and infinity are the magnitudes from 0x7f80), and the cast widens each value as it
// converts it (bf16 to f32 is exact).
__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ u32 abs_max2(u32 m, u32 w) { return __vmaxu2(m, w & 0x7fff7fffu); }

// x / s as the IEEE division rounds it, for s >= 2^-60 (and inv = 1 / s, rounded): q0 = x * inv
// is within 2 ulps of the quotient, the residual x - q0 s is exact in one fused multiply-add,
// and q0 + residual * inv, rounded once, is the rounded quotient (Markstein's correction, the
// last step of the GPU's own division, here without its range checks: s >= 2^-60 keeps every
// operand and the residual normal wherever the e4m3 byte depends on the quotient's last bits).
// The sign is x's (a -0 stays -0). Three floating-point operations and no branch; checked
// against the division on the CPU (lifecycle_layout::fp8, `the_kernels_fma_quotient_...`).
__device__ __forceinline__ float corrected_quotient(float x, float s, float inv) {
    float q0 = x * inv;
    float r = fmaf(-q0, s, x);
    return copysignf(fmaf(r, inv, q0), x);
}

// Eight e4m3 bytes (little-endian) of the 8 bf16 values of `w` divided by s, as pack4 gives
// them: by corrected_quotient where s >= 2^-60 (a block-uniform test), by the division below.
__device__ __forceinline__ uint2 pack8(uint4 w, float s, float inv, bool exact_only) {
    float v[8] = {bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y),
                  bf16_lo(w.z), bf16_hi(w.z), bf16_lo(w.w), bf16_hi(w.w)};
    if (exact_only) {
        u32 b[2] = {0u, 0u};
#pragma unroll
        for (u32 k = 0; k < 8; ++k) b[k / 4] |= (u32)e4m3(v[k] / s) << (8 * (k % 4));
        return make_uint2(b[0], b[1]);
    }
    float q[8];
#if defined(QUANTISE_DIVIDE_ALWAYS) || defined(QUANTISE_MULTIPLY_ONLY)
#pragma unroll
    for (u32 k = 0; k < 8; ++k) q[k] = quotient(v[k], s, inv);
#else
    if (s >= 8.67361738e-19f) {  // 2^-60
#pragma unroll
        for (u32 k = 0; k < 8; ++k) q[k] = corrected_quotient(v[k], s, inv);
    } else {
#pragma unroll
        for (u32 k = 0; k < 8; ++k) q[k] = v[k] / s;
    }
#endif
    return make_uint2(e4m3x2(q[1], q[0]) | (e4m3x2(q[3], q[2]) << 16),
                      e4m3x2(q[5], q[4]) | (e4m3x2(q[7], q[6]) << 16));
}

// One tile of bf16 rows on 16 bytes (vec8): thread (tx, ty) loads columns 8 (tx mod 16) .. of
// rows 2 ty + tx / 16, then 2 R further (R = 128 / QUANTISE_HELD_BF16), QUANTISE_HELD_BF16 / 2
// loads (rows `sld` elements apart, the bytes' `ld`); `mine`: its columns lie in the tile. Returns the block's scale_inv after writing the bytes.
__device__ __forceinline__ float tile_bf16(const unsigned short* __restrict__ src,
                                           unsigned char* __restrict__ out, u64 sld, u64 ld,
                                           u32 h, u32 c, bool mine, u32* redu, float* red) {
    u32 tx = threadIdx.x & 31u, ty = threadIdx.x >> 5;
    uint4 raw[QUANTISE_HELD_BF16 / 2];
    u32 m2 = 0u;
#pragma unroll
    for (u32 i = 0; i < QUANTISE_HELD_BF16 / 2; ++i) {
        u32 r = 2 * ty + (tx >> 4) + 2 * QUANTISE_ROWS_PER_PASS_BF16 * i;
        raw[i] = (mine && r < h) ? *reinterpret_cast<const uint4*>(src + r * sld + c)
                                 : make_uint4(0u, 0u, 0u, 0u);
        m2 = abs_max2(abs_max2(m2, raw[i].x), raw[i].y);
        m2 = abs_max2(abs_max2(m2, raw[i].z), raw[i].w);
    }
    u32 m = max(m2 & 0xffffu, m2 >> 16);
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    __syncthreads();  // the previous tile's readers of redu are done
    if (tx == 0) redu[ty] = m;
    __syncthreads();
    u32 top = 0u;
    for (u32 q = 0; q < blockDim.x / 32u; ++q) top = max(top, redu[q]);
    bool exact_only = top >= 0x7f80u;  // a NaN or an infinity in the block (block-uniform)
    float amax = __uint_as_float(top << 16);
    if (exact_only) {
        // the fp32 path's amax (fmaxf: NaN ignored, infinity kept), from the held values
        float fm = 0.0f;
#pragma unroll
        for (u32 i = 0; i < QUANTISE_HELD_BF16 / 2; ++i) {
            u32 w[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
            for (u32 k = 0; k < 4; ++k) {
                fm = fmaxf(fm, fmaxf(fabsf(bf16_lo(w[k])), fabsf(bf16_hi(w[k]))));
            }
        }
        for (int o = 16; o > 0; o >>= 1) fm = fmaxf(fm, __shfl_xor_sync(0xffffffffu, fm, o));
        if (tx == 0) red[ty] = fm;
        __syncthreads();
        amax = 0.0f;
        for (u32 q = 0; q < blockDim.x / 32u; ++q) amax = fmaxf(amax, red[q]);
    }
    float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    float inv = 1.0f / s;
    if (mine) {
#pragma unroll
        for (u32 i = 0; i < QUANTISE_HELD_BF16 / 2; ++i) {
            u32 r = 2 * ty + (tx >> 4) + 2 * QUANTISE_ROWS_PER_PASS_BF16 * i;
            if (r < h) *reinterpret_cast<uint2*>(out + r * ld + c) = pack8(raw[i], s, inv, exact_only);
        }
    }
    return s;
}

// The job of `tile`: the last job whose first tile (word `field` of its `words`) is at most
// `tile`, jobs in order of their first tile. Searched by every warp at once, 32 candidates a
// round (a ballot), so ~3000 jobs take 3 dependent loads instead of a binary search's 12 (with
// the binary search the fp8 enter at 7.6B ran at 1.15x its floor, with this one at 1.11x: one
// block per tile, each waiting for its search). Every lane of the
// warp must be active (the tile loop is uniform per block).
__device__ __forceinline__ u32 find_job(const u64* __restrict__ jobs, u32 njobs, u32 tile,
                                        u32 words, u32 field) {
    u32 lane = threadIdx.x & 31u;
    u32 lo = 0, hi = njobs;  // jobs[lo] starts at or before `tile`, jobs from hi after it
    while (hi - lo > 1) {
        u32 step = (hi - lo + 31u) / 32u;
        u32 at = lo + lane * step;
        bool before = at < hi && jobs[(u64)words * at + field] <= tile;
        u32 mask = __ballot_sync(0xffffffffu, before);
        u32 last = 31u - (u32)__clz(mask);  // lane 0 (at = lo) always holds
        lo += last * step;
        hi = min(hi, lo + step);
    }
    return lo;
}

// Sets *flag to 1 (when flag is not null) for a tile holding a NaN or an infinity: the check
// rides on the quantisation's one read of the source, and the caller reads the flag once the
// run is done.
__device__ __forceinline__ void report_nonfinite(bool bad, u32* flag) {
    if (bad && flag) atomicOr(flag, 1u);
}

template <typename Src>
__device__ __forceinline__ void quantize_jobs(const Src* __restrict__ master,
                                              const u64* __restrict__ jobs, u32 njobs,
                                              u32 ntiles, unsigned char* __restrict__ dst,
                                              float* __restrict__ scales, u32* flag) {
    __shared__ float red[32];
    __shared__ u32 redu[32];
    u32 lo = 0, job_end = 0;  // the job of the previous tile (tiles ascend), and its end
    for (u32 base = blockIdx.x * QUANTISE_TILES_PER_BLOCK; base < ntiles;
         base += gridDim.x * QUANTISE_TILES_PER_BLOCK)
    for (u32 tile = base; tile < min(base + QUANTISE_TILES_PER_BLOCK, ntiles); ++tile) {
    if (tile >= job_end) {
        lo = find_job(jobs, njobs, tile, 7u, 5u);
        const u64* jj = jobs + 7ull * lo;
        job_end = (u32)(jj[5] + ((jj[3] + 127) / 128) * ((jj[4] + 127) / 128));
    }
    const u64* j = jobs + 7ull * lo;
    u64 k = tile - j[5];
    u64 ld = j[4];
    // a job's tiles and block columns fit 32 bits (the launch counts tiles in 32): a 32-bit
    // division, not the 64-bit one's long sequence, for every thread of every tile
    u32 bc = (u32)((ld + 127) / 128), kk = (u32)k;
    u64 r0 = (u64)(kk / bc) * 128, c0 = (u64)(kk % bc) * 128;
    u32 h = (u32)min(128ull, j[3] - r0), w = (u32)min(128ull, ld - c0);
    u64 sld = j[6];  // the source's row pitch
    u64 src_off = j[0] + r0 * sld + c0, dst_off = j[1] + r0 * ld + c0;
    const Src* src = master + src_off;
    unsigned char* out = dst + dst_off;
    // bf16 rows on 16 bytes: 8 values a load (a half-warp per row, two rows a warp)
    bool vec8 = sizeof(Src) == 2 && QUANTISE_HELD_BF16 >= 2 && (ld % 8 == 0) && (sld % 8 == 0) &&
                (w % 8 == 0) && (src_off % 8 == 0) && (dst_off % 8 == 0);
    u32 tx = threadIdx.x & 31u, ty = threadIdx.x >> 5;
    if (vec8) {
        u32 c = 8 * (tx & 15u);
        float s = tile_bf16(reinterpret_cast<const unsigned short*>(src), out, sld, ld, h, c,
                            c < w, redu, red);
        if (threadIdx.x == 0) scales[j[2] + k] = s;
        continue;
    }
    // fp32 rows on 16 bytes (other bf16 tiles take the scalar path, two reads)
    bool vec = sizeof(Src) == 4 && (ld % 4 == 0) && (sld % 4 == 0) && (w % 4 == 0) &&
               (src_off % 4 == 0) && (dst_off % 4 == 0);
    u32 c = 4 * tx;
    bool mine = vec && c < w;
    float4 held[QUANTISE_HELD];
    float m = 0.0f;
    bool bad = false;
    if (vec) {
#pragma unroll
        for (u32 i = 0; i < QUANTISE_HELD; ++i) {
            u32 r = ty + QUANTISE_ROWS_PER_PASS * i;
            held[i] = (mine && r < h) ? load4(src + r * sld + c)
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
            float a = fabsf(load1(src + r * sld + cc));
            m = fmaxf(m, a);
            bad |= !(a <= 3.402823466e38f);
        }
    }
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __syncthreads();  // the previous tile's readers of red are done
    if (tx == 0) red[ty] = m;
    bool exact_only = __syncthreads_or(bad) != 0;
    if (threadIdx.x == 0) report_nonfinite(exact_only, flag);
    float amax = 0.0f;
    for (u32 q = 0; q < (blockDim.x + 31u) / 32u; ++q) amax = fmaxf(amax, red[q]);
    float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    float inv = 1.0f / s;
    if (threadIdx.x == 0) scales[j[2] + k] = s;
    if (vec) {
        if (mine) {
#pragma unroll
            for (u32 i = 0; i < QUANTISE_HELD; ++i) {
                u32 r = ty + QUANTISE_ROWS_PER_PASS * i;
                if (r < h) *reinterpret_cast<u32*>(out + r * ld + c) = pack4(held[i], s, inv, exact_only);
            }
        }
    } else {
        for (u32 i = threadIdx.x; i < h * w; i += blockDim.x) {
            u32 r = i / w, cc = i - r * w;
            out[r * ld + cc] = e4m3(load1(src + r * sld + cc) / s);
        }
    }
    }
}

extern "C" __global__ void __launch_bounds__(32 * QUANTISE_ROWS_PER_PASS)
quantize_e4m3_jobs(const float* __restrict__ master, const u64* __restrict__ jobs, u32 njobs,
                   u32 ntiles, unsigned char* __restrict__ dst, float* __restrict__ scales,
                   u32* flag) {
    quantize_jobs(master, jobs, njobs, ntiles, dst, scales, flag);
}

extern "C" __global__ void __launch_bounds__(32 * QUANTISE_ROWS_PER_PASS_BF16)
quantize_e4m3_jobs_bf16(const unsigned short* __restrict__ staging, const u64* __restrict__ jobs,
                        u32 njobs, u32 ntiles, unsigned char* __restrict__ dst,
                        float* __restrict__ scales, u32* flag) {
    quantize_jobs(staging, jobs, njobs, ntiles, dst, scales, flag);
}

// ---------------------------------------------------------------------------------------------
// fp8 at W > 1 (lifecycle_layout::steps::Fp8Agree): block scales agreed across the ranks.
//
// Grid jobs, 11 u64 each: (first source element, source row pitch, rows, columns, grid index of
// the tensor's block (0, 0), blocks per grid row, tensor row of the first row, grid column of the
// first column, first byte written, 0: rollout / 1: stage, first tile), jobs in order of their
// first tile. A job's tiles are the blocks it touches: (block rows touched) x (column blocks),
// row-major; a tile covers the job's rows inside its block row and up to 128 columns.
// Launch: one block of GRID_THREADS threads per tile.
// ---------------------------------------------------------------------------------------------

#define GRID_JOB 11
#define GRID_THREADS 256

struct GridTile {
    const u64* j;
    u64 r_lo, c_lo;  // region-relative first row and column of the tile
    u32 h, w;        // rows and columns of the tile
    u64 entry;       // the block's grid index
};

__device__ __forceinline__ GridTile grid_tile(const u64* jobs, u32 njobs, u32 tile) {
    u32 lo = find_job(jobs, njobs, tile, GRID_JOB, 10u);
    GridTile t;
    t.j = jobs + (u64)GRID_JOB * lo;
    const u64* j = t.j;
    u64 k = tile - j[10];
    u64 rows = j[2], cols = j[3], row0 = j[6];
    u64 bc = (cols + 127) / 128;
    u64 gbr = row0 / 128 + k / bc, bcol = k % bc;
    u64 r_lo = max(gbr * 128, row0) - row0;
    u64 r_hi = min(gbr * 128 + 128, row0 + rows) - row0;
    t.r_lo = r_lo;
    t.c_lo = bcol * 128;
    t.h = (u32)(r_hi - r_lo);
    t.w = (u32)(min(t.c_lo + 128, cols) - t.c_lo);
    t.entry = j[4] + gbr * j[5] + j[7] + bcol;
    return t;
}

// The amax of each tile's values (the rows this rank holds of the block) into grid[entry].
extern "C" __global__ void __launch_bounds__(GRID_THREADS)
fp8_grid_amax(const float* __restrict__ master, const u64* __restrict__ jobs, u32 njobs,
              u32 ntiles, float* __restrict__ grid, u32* flag) {
    __shared__ float red[GRID_THREADS / 32];
    bool bad = false;
    for (u32 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        GridTile t = grid_tile(jobs, njobs, tile);
        const float* src = master + t.j[0] + t.r_lo * t.j[1] + t.c_lo;
        u64 ld = t.j[1];
        float m = 0.0f;
        for (u32 i = threadIdx.x; i < t.h * t.w; i += blockDim.x) {
            u32 r = i / t.w, c = i - r * t.w;
            float a = fabsf(src[r * ld + c]);
            m = fmaxf(m, a);
            bad |= !(a <= 3.402823466e38f);
        }
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        __syncthreads();  // the previous tile's readers of red are done
        if ((threadIdx.x & 31u) == 0) red[threadIdx.x >> 5] = m;
        __syncthreads();
        if (threadIdx.x == 0) {
            float a = 0.0f;
            for (u32 q = 0; q < blockDim.x / 32; ++q) a = fmaxf(a, red[q]);
            grid[t.entry] = a;
        }
    }
    report_nonfinite(bad, flag);
}

// Every value of each tile as e4m3(x / scale_inv), scale_inv the agreed grid entry of its block,
// into the job's bytes (row pitch: the job's columns) in the rollout buffer or the stage.
extern "C" __global__ void __launch_bounds__(GRID_THREADS)
fp8_grid_quantise(const float* __restrict__ master, const u64* __restrict__ jobs, u32 njobs,
                  u32 ntiles, const float* __restrict__ grid, unsigned char* __restrict__ rollout,
                  unsigned char* __restrict__ stage) {
    for (u32 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        GridTile t = grid_tile(jobs, njobs, tile);
        const u64* j = t.j;
        const float* src = master + j[0] + t.r_lo * j[1] + t.c_lo;
        unsigned char* out = (j[9] ? stage : rollout) + j[8] + t.r_lo * j[3] + t.c_lo;
        float s = grid[t.entry];
        u64 ld = j[1], pitch = j[3];
        for (u32 i = threadIdx.x; i < t.h * t.w; i += blockDim.x) {
            u32 r = i / t.w, c = i - r * t.w;
            out[r * pitch + c] = e4m3(src[r * ld + c] / s);
        }
    }
}

// The agreement's last move: out[i] = scale_inv(max over the `parts` partial grids of entry i)
// (amax / 448, or 1 for an all-zero block). `parts` holds `nparts` device addresses of grids of
// `n` floats; out may be the only part (in place, after an all-reduce by max).
extern "C" __global__ void fp8_grid_agree(const u64* __restrict__ parts, u32 nparts, u64 n,
                                          float* out) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        float m = 0.0f;
        for (u32 p = 0; p < nparts; ++p) m = fmaxf(m, reinterpret_cast<const float*>(parts[p])[i]);
        out[i] = m > 0.0f ? m / 448.0f : 1.0f;
    }
}
