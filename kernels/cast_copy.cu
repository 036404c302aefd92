// Launched by lifecycle_cuda::Kernels (backends/cuda/src/kernels.rs): each launch's grid, block and argument contract is stated at its
// launcher there; the kernels below document what they read and write.
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 f2bf(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return ((x >> 16) | 0x0040u) & 0xFFFFu;
    if ((x & 0x8000u) != 0u && (x & 0x17FFFu) != 0u) return ((x >> 16) + 1u) & 0xFFFFu;
    return x >> 16;
}

// 1 when f is NaN or an infinity (its exponent all ones).
__device__ __forceinline__ u32 nonfinite(float f) {
    return (__float_as_uint(f) & 0x7F800000u) == 0x7F800000u;
}

__device__ __forceinline__ u32 nonfinite4(float4 v) {
    return nonfinite(v.x) | nonfinite(v.y) | nonfinite(v.z) | nonfinite(v.w);
}

// Every cast below reports a non-finite source value by setting *flag to 1 (when flag is not
// null): the check rides on the cast's one read of the source, and the caller reads the flag
// once the run is done.
__device__ __forceinline__ void report(u32 bad, u32* flag) {
    if (bad && flag) atomicOr(flag, 1u);
}

// dst[r * dst_ld + c] = bf16(src[r * src_ld + c]) for r < rows, c < cols (element units).
extern "C" __global__ void cast_f32_bf16_2d(const float* __restrict__ src, u16* __restrict__ dst,
                                            u64 rows, u64 cols, u64 src_ld, u64 dst_ld,
                                            u32* flag) {
    u64 n = rows * cols;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 bad = 0;
    if (rows == 1) {
        for (; i < n; i += stride) {
            float v = src[i];
            bad |= nonfinite(v);
            dst[i] = (u16)f2bf(v);
        }
    } else {
        for (; i < n; i += stride) {
            u64 r = i / cols, c = i - r * cols;
            float v = src[r * src_ld + c];
            bad |= nonfinite(v);
            dst[r * dst_ld + c] = (u16)f2bf(v);
        }
    }
    report(bad, flag);
}

// The same in units of 4 elements: cols4, src_ld4, dst_ld4 count float4 / 4 x bf16; src must be
// 16-byte and dst 8-byte aligned.
extern "C" __global__ void cast_f32_bf16_2d_v4(const float4* __restrict__ src, uint2* __restrict__ dst,
                                               u64 rows, u64 cols4, u64 src_ld4, u64 dst_ld4,
                                               u32* flag) {
    u64 n = rows * cols4;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 bad = 0;
    if (rows == 1) {
        for (; i < n; i += stride) {
            float4 v = src[i];
            bad |= nonfinite4(v);
            uint2 o; o.x = f2bf(v.x) | (f2bf(v.y) << 16); o.y = f2bf(v.z) | (f2bf(v.w) << 16);
            dst[i] = o;
        }
    } else if (n < 0xFFFFFFFFull) {
        u32 c4 = (u32)cols4;
        for (; i < n; i += stride) {
            u32 r = (u32)i / c4, c = (u32)i - r * c4;
            float4 v = src[(u64)r * src_ld4 + c];
            bad |= nonfinite4(v);
            uint2 o; o.x = f2bf(v.x) | (f2bf(v.y) << 16); o.y = f2bf(v.z) | (f2bf(v.w) << 16);
            dst[(u64)r * dst_ld4 + c] = o;
        }
    } else {
        for (; i < n; i += stride) {
            u64 r = i / cols4, c = i - r * cols4;
            float4 v = src[r * src_ld4 + c];
            bad |= nonfinite4(v);
            uint2 o; o.x = f2bf(v.x) | (f2bf(v.y) << 16); o.y = f2bf(v.z) | (f2bf(v.w) << 16);
            dst[r * dst_ld4 + c] = o;
        }
    }
    report(bad, flag);
}

// Many casts in one launch. Each descriptor is five 64-bit words (see `CastBatch`): source and
// destination offsets in units of 4 elements, the first chunk of the descriptor, then rows, cols4,
// src_ld4 and dst_ld4 as 32-bit values. Work is cut into chunks of CAST_CHUNK4 units (4 per
// thread of a 256-thread block), numbered across the whole batch; a launch runs chunks
// [chunk_lo, chunk_end) of the `ndesc` descriptors at `descs`, finding each chunk's descriptor by
// binary search (the descriptors stay in L1). Blocks loop over chunks when the grid is capped
// (launch bounds: 4 blocks of 256 per SM fit); uncapped, each block does one chunk.
#define CAST_CHUNK4 1024u
struct CastDesc { u64 src4; u64 dst4; u64 chunk0; u32 rows; u32 cols4; u32 src_ld4; u32 dst_ld4; };
extern "C" __global__ void __launch_bounds__(256, 4)
cast_f32_bf16_multi(const float4* __restrict__ src, uint2* __restrict__ dst,
                    const CastDesc* __restrict__ descs, u32 ndesc, u64 chunk_lo, u64 chunk_end,
                    u32* flag) {
    u32 bad = 0;
    for (u64 c = chunk_lo + blockIdx.x; c < chunk_end; c += gridDim.x) {
        u32 lo = 0, hi = ndesc - 1;
        while (lo < hi) {
            u32 mid = (lo + hi + 1u) >> 1;
            if (__ldg(&descs[mid].chunk0) <= c) lo = mid; else hi = mid - 1u;
        }
        const CastDesc* dp = &descs[lo];
        const u32 rows = __ldg(&dp->rows), cols4 = __ldg(&dp->cols4);
        const u64 s4 = __ldg(&dp->src4), d4 = __ldg(&dp->dst4);
        const u64 n = (u64)rows * cols4;
        const u64 base = (c - __ldg(&dp->chunk0)) * CAST_CHUNK4 + threadIdx.x;
        if (rows == 1u) {
            float4 v[4];
            #pragma unroll
            for (int k = 0; k < 4; ++k) {
                u64 i = base + (u64)k * 256u;
                if (i < n) v[k] = src[s4 + i];
            }
            #pragma unroll
            for (int k = 0; k < 4; ++k) {
                u64 i = base + (u64)k * 256u;
                if (i < n) {
                    bad |= nonfinite4(v[k]);
                    uint2 o; o.x = f2bf(v[k].x) | (f2bf(v[k].y) << 16); o.y = f2bf(v[k].z) | (f2bf(v[k].w) << 16);
                    dst[d4 + i] = o;
                }
            }
        } else {
            const u64 sld = __ldg(&dp->src_ld4), dld = __ldg(&dp->dst_ld4);
            #pragma unroll
            for (int k = 0; k < 4; ++k) {
                u64 i = base + (u64)k * 256u;
                if (i < n) {
                    u64 r, col;
                    if (n < 0xFFFFFFFFull) { u32 rr = (u32)i / cols4; r = rr; col = (u32)i - rr * cols4; }
                    else { r = i / cols4; col = i - r * cols4; }
                    float4 v = src[s4 + r * sld + col];
                    bad |= nonfinite4(v);
                    uint2 o; o.x = f2bf(v.x) | (f2bf(v.y) << 16); o.y = f2bf(v.z) | (f2bf(v.w) << 16);
                    dst[d4 + r * dld + col] = o;
                }
            }
        }
    }
    report(bad, flag);
}

// Strided 2-D copy of 16-bit elements (bf16 slices).
extern "C" __global__ void copy_u16_2d(const u16* __restrict__ src, u16* __restrict__ dst,
                                       u64 rows, u64 cols, u64 src_ld, u64 dst_ld) {
    u64 n = rows * cols;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u64 r = i / cols, c = i - r * cols;
        dst[r * dst_ld + c] = src[r * src_ld + c];
    }
}

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// dst[i] = scale * u with u uniform in [-1, 1), from splitmix64(seed + index_offset + i).
extern "C" __global__ void fill_uniform_f32(float* dst, u64 n, u64 seed, u64 index_offset, float scale) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u64 x = splitmix64(seed * 0x100000001B3ull + index_offset + i);
        float u = (float)(x >> 40) * (1.0f / 16777216.0f);
        dst[i] = scale * (2.0f * u - 1.0f);
    }
}
