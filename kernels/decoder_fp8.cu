// Launched by the fp8 decoder kernels (models/decoder-gpu/src/fp8.rs): each launch's grid, block and argument contract is stated at its
// launcher there; the kernels below document what they read and write.
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// The value of an e4m3 byte (0x7f / 0xff, NaN, never appear in a quantised rollout).
__device__ __forceinline__ float e4m3_val(u32 b) {
    u32 e = (b >> 3) & 15u, m = b & 7u;
    float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
    return (b & 0x80u) ? -v : v;
}

__device__ __forceinline__ float bf(u16 h) { return __uint_as_float(((u32)h) << 16); }

// The four e4m3 bytes of word (lowest first) as f32: by the hardware conversion where there is
// one (sm_89 and later: two bytes to f16x2 per instruction, then to f32, all exact), else by
// e4m3_val.
__device__ __forceinline__ void e4m3x4(u32 word, float* v) {
#if __CUDA_ARCH__ >= 890
    u32 lo2, hi2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo2) : "h"((unsigned short)(word & 0xffffu)));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi2) : "h"((unsigned short)(word >> 16)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(v[0]) : "h"((unsigned short)(lo2 & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(v[1]) : "h"((unsigned short)(lo2 >> 16)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(v[2]) : "h"((unsigned short)(hi2 & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(v[3]) : "h"((unsigned short)(hi2 >> 16)));
#else
    #pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = e4m3_val((word >> (8 * k)) & 0xffu);
#endif
}

// round to nearest even
__device__ __forceinline__ u16 f2bf_rne(float f) {
    u32 x = __float_as_uint(f);
    return (u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// The split activations (hi rows 0 .. n, lo rows n .. 2n of xs, bf16 [2n x inp]) recombined in
// f32: x[t * inp + c] = hi + lo.
extern "C" __global__ void fp8_join_split(const u16* __restrict__ xs, u32 n, u32 inp,
                                          float* __restrict__ x) {
    u64 len = (u64)n * inp;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < len; i += (u64)gridDim.x * blockDim.x) {
        x[i] = bf(xs[i]) + bf(xs[len + i]);
    }
}

#define FP8_RO 4

// y[t * out + o] = sum_c x[t * inp + c] * w(row0 + o, c) for tokens t < n (n <= N), and 0 in the
// lo rows ylo[t * out + o] (the caller's combine adds the two halves). One block of 8 warps
// per 4 outputs, the columns split over its 256 threads 16 at a time (every activation load
// used by the 4 rows); each weight is dequantised (e4m3 x its block's scale) four at a time, so
// few registers stay live and many blocks share an SM. The partial sums are reduced per warp,
// then over the warps. w is row-major e4m3 [.. x inp] with one scale per 128 x 128 block; x f32.
template <int N>
__device__ __forceinline__ void fp8_gemv_body(const unsigned char* __restrict__ w,
                                              const float* __restrict__ scales, u32 row0,
                                              u32 out, u32 inp, const float* __restrict__ x,
                                              u32 n, float* __restrict__ y,
                                              float* __restrict__ ylo) {
    __shared__ float red[8][FP8_RO][N];
    u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    u32 o0 = blockIdx.x * FP8_RO;
    u64 bc = (inp + 127) / 128;
    float acc[FP8_RO][N];
    #pragma unroll
    for (int i = 0; i < FP8_RO; ++i) {
        #pragma unroll
        for (int t = 0; t < N; ++t) acc[i][t] = 0.0f;
    }
    if (inp % 16 == 0) {
        for (u32 c = 16 * threadIdx.x; c < inp; c += 16 * blockDim.x) {
            uint4 q[FP8_RO];
            float sc[FP8_RO];
            #pragma unroll
            for (int i = 0; i < FP8_RO; ++i) {
                u32 o = o0 + i;
                q[i] = make_uint4(0, 0, 0, 0);
                sc[i] = 0.0f;
                if (o < out) {
                    u64 r = (u64)row0 + o;
                    q[i] = *reinterpret_cast<const uint4*>(w + r * inp + c);
                    sc[i] = scales[(r / 128) * bc + c / 128];
                }
            }
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                float wq[FP8_RO][4];
                #pragma unroll
                for (int i = 0; i < FP8_RO; ++i) {
                    u32 word = j == 0 ? q[i].x : j == 1 ? q[i].y : j == 2 ? q[i].z : q[i].w;
                    e4m3x4(word, wq[i]);
                    #pragma unroll
                    for (int k = 0; k < 4; ++k) wq[i][k] *= sc[i];
                }
                #pragma unroll
                for (int t = 0; t < N; ++t) {
                    if (t < n) {
                        float4 xv = *reinterpret_cast<const float4*>(x + (u64)t * inp + c + 4 * j);
                        #pragma unroll
                        for (int i = 0; i < FP8_RO; ++i) {
                            float a = acc[i][t];
                            a = fmaf(wq[i][0], xv.x, a);
                            a = fmaf(wq[i][1], xv.y, a);
                            a = fmaf(wq[i][2], xv.z, a);
                            a = fmaf(wq[i][3], xv.w, a);
                            acc[i][t] = a;
                        }
                    }
                }
            }
        }
    } else {
        for (u32 c = threadIdx.x; c < inp; c += blockDim.x) {
            #pragma unroll
            for (int i = 0; i < FP8_RO; ++i) {
                u32 o = o0 + i;
                if (o < out) {
                    u64 r = (u64)row0 + o;
                    float wvs = e4m3_val(w[r * inp + c]) * scales[(r / 128) * bc + c / 128];
                    #pragma unroll
                    for (int t = 0; t < N; ++t) {
                        if (t < n) acc[i][t] = fmaf(wvs, x[(u64)t * inp + c], acc[i][t]);
                    }
                }
            }
        }
    }
    // n is the same for the whole block: only the tokens in use are reduced
    #pragma unroll
    for (int i = 0; i < FP8_RO; ++i) {
        #pragma unroll
        for (int t = 0; t < N; ++t) {
            if (t < n) {
                float v = acc[i][t];
                #pragma unroll
                for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
                if (lane == 0) red[warp][i][t] = v;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < FP8_RO * n) {
        u32 i = threadIdx.x / n, t = threadIdx.x % n;
        u32 o = o0 + i;
        if (o < out) {
            float v = 0.0f;
            for (u32 k = 0; k < (blockDim.x >> 5); ++k) v += red[k][i][t];
            y[(u64)t * out + o] = v;
            ylo[(u64)t * out + o] = 0.0f;
        }
    }
}

#define FP8_GEMV(N)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) fp8_gemv_##N(                            \
        const unsigned char* __restrict__ w, const float* __restrict__ scales, u32 row0,      \
        u32 out, u32 inp, const float* __restrict__ x, u32 n, float* __restrict__ y) {         \
        fp8_gemv_body<N>(w, scales, row0, out, inp, x, n, y, y + (u64)n * out);               \
    }
FP8_GEMV(1)
FP8_GEMV(2)
FP8_GEMV(4)
FP8_GEMV(8)

// The weight-streaming kernel of the product tables (a mixture-of-experts layer's experts):
// y[t * out + o] = sum_c x[t * inp + c] * w(row0 + o, c) for t < n <= N, 0 in ylo[t * out + o];
// w e4m3 with one scale per 128 x 128 block (FP8) or bf16, row-major [.. x inp]; x f32. A block
// of 8 warps computes 8 RO outputs, RO per warp: it stages the activations of 256 columns at a
// time in shared memory (read once per block, not once per output) and each lane reads 8
// consecutive weights of each of its warp's rows; the sums are reduced within the warp.
#define GV_WARPS 8
#define GV_CHUNK 256
template <int N, int RO, bool FP8>
__device__ __forceinline__ void gemv_tiled(const unsigned char* __restrict__ w,
                                           const float* __restrict__ scales, u32 row0, u32 out,
                                           u32 inp, const float* __restrict__ x, u32 n,
                                           float* __restrict__ y, float* __restrict__ ylo) {
    __shared__ __align__(16) float xs[N][GV_CHUNK];
    u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    u32 o0 = (blockIdx.x * GV_WARPS + warp) * RO;
    u64 bc = (inp + 127) / 128;
    const int wb = FP8 ? 1 : 2;  // bytes per weight
    bool vec = inp % 8 == 0 && ((u64)w & (FP8 ? 7u : 15u)) == 0;
    float acc[RO][N];
    #pragma unroll
    for (int i = 0; i < RO; ++i) {
        #pragma unroll
        for (int t = 0; t < N; ++t) acc[i][t] = 0.0f;
    }
    for (u32 c0 = 0; c0 < inp; c0 += GV_CHUNK) {
        u32 width = min((u32)GV_CHUNK, inp - c0);
        u32 j = 8 * lane;
        // this chunk's weights are requested before the activations are staged, so the two
        // loads overlap
        uint4 raw[RO];
        #pragma unroll
        for (int i = 0; i < RO; ++i) {
            raw[i] = make_uint4(0, 0, 0, 0);
            u32 o = o0 + i;
            if (vec && j < width && o < out) {
                const unsigned char* p = w + (((u64)row0 + o) * inp + c0 + j) * wb;
                if (FP8) {
                    uint2 q = *reinterpret_cast<const uint2*>(p);
                    raw[i].x = q.x;
                    raw[i].y = q.y;
                } else {
                    raw[i] = *reinterpret_cast<const uint4*>(p);
                }
            }
        }
        __syncthreads();
        #pragma unroll
        for (int t = 0; t < N; ++t) {
            if (t < n) {
                for (u32 i = threadIdx.x; i < width; i += blockDim.x) xs[t][i] = x[(u64)t * inp + c0 + i];
            }
        }
        __syncthreads();
        if (vec) {
            if (j < width) {
                u32 c = c0 + j;
                float wv[RO][8];
                #pragma unroll
                for (int i = 0; i < RO; ++i) {
                    if (FP8) {
                        e4m3x4(raw[i].x, wv[i]);
                        e4m3x4(raw[i].y, wv[i] + 4);
                        u32 o = o0 + i;
                        u64 r = (u64)row0 + (o < out ? o : 0);
                        float sc = o < out ? scales[(r / 128) * bc + c / 128] : 0.0f;
                        #pragma unroll
                        for (int k = 0; k < 8; ++k) wv[i][k] *= sc;
                    } else {
                        u32 words[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
                        #pragma unroll
                        for (int k = 0; k < 4; ++k) {
                            wv[i][2 * k] = __uint_as_float(words[k] << 16);
                            wv[i][2 * k + 1] = __uint_as_float(words[k] & 0xffff0000u);
                        }
                    }
                }
                #pragma unroll
                for (int t = 0; t < N; ++t) {
                    if (t < n) {
                        float4 a = *reinterpret_cast<const float4*>(&xs[t][j]);
                        float4 b = *reinterpret_cast<const float4*>(&xs[t][j + 4]);
                        float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                        #pragma unroll
                        for (int i = 0; i < RO; ++i) {
                            float sv = acc[i][t];
                            #pragma unroll
                            for (int k = 0; k < 8; ++k) sv = fmaf(wv[i][k], xv[k], sv);
                            acc[i][t] = sv;
                        }
                    }
                }
            }
        } else {
            for (u32 j = lane; j < width; j += 32) {
                u32 c = c0 + j;
                #pragma unroll
                for (int i = 0; i < RO; ++i) {
                    u32 o = o0 + i;
                    if (o < out) {
                        u64 r = (u64)row0 + o;
                        float wv = FP8 ? e4m3_val(w[r * inp + c]) * scales[(r / 128) * bc + c / 128]
                                       : bf(reinterpret_cast<const u16*>(w)[r * inp + c]);
                        #pragma unroll
                        for (int t = 0; t < N; ++t) {
                            if (t < n) acc[i][t] = fmaf(wv, xs[t][j], acc[i][t]);
                        }
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int i = 0; i < RO; ++i) {
        #pragma unroll
        for (int t = 0; t < N; ++t) {
            if (t < n) {
                float v = acc[i][t];
                #pragma unroll
                for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
                u32 o = o0 + i;
                if (lane == 0 && o < out) {
                    y[(u64)t * out + o] = v;
                    ylo[(u64)t * out + o] = 0.0f;
                }
            }
        }
    }
}

// Many products of one output size in one launch (a mixture-of-experts layer's experts):
// blockIdx.y picks the problem, whose 8 entries of table are w, scales (unused for bf16), row0,
// inp, x, n, y, ylo; a problem of n = 0 rows does nothing. Outputs per warp: 1 up to 2 rows,
// 4 from 4 (GV_RO(N)); the grid's x covers out / (8 GV_RO(N)) blocks.
#define GV_RO(N) ((N) <= 2 ? 1 : 4)
#define GEMV_TABLE(NAME, N, FP8)                                                               \
    extern "C" __global__ void __launch_bounds__(256) NAME##_##N(                              \
        const u64* __restrict__ table, u32 out) {                                              \
        const u64* e = table + 8 * (u64)blockIdx.y;                                            \
        if (e[5] == 0) return;                                                                 \
        gemv_tiled<N, GV_RO(N), FP8>((const unsigned char*)e[0], (const float*)e[1],           \
                                      (u32)e[2], out, (u32)e[3], (const float*)e[4],           \
                                      (u32)e[5], (float*)e[6], (float*)e[7]);                  \
    }
GEMV_TABLE(fp8_gemv_table, 1, true)
GEMV_TABLE(fp8_gemv_table, 2, true)
GEMV_TABLE(fp8_gemv_table, 4, true)
GEMV_TABLE(fp8_gemv_table, 8, true)
GEMV_TABLE(bf16_gemv_table, 1, false)
GEMV_TABLE(bf16_gemv_table, 2, false)
GEMV_TABLE(bf16_gemv_table, 4, false)
GEMV_TABLE(bf16_gemv_table, 8, false)

// Rows row0 .. row0 + out of an e4m3 matrix [.. x inp] dequantised into hi (bf16 of the value)
// and lo (bf16 of the rest), each [out x inp] row-major, hi first in dst.
extern "C" __global__ void fp8_dequant_split(const unsigned char* __restrict__ w,
                                             const float* __restrict__ scales, u32 row0, u32 out,
                                             u32 inp, u16* __restrict__ dst) {
    u64 n = (u64)out * inp;
    u64 bc = (inp + 127) / 128;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 o = i / inp, c = i - o * inp;
        u64 r = row0 + o;
        float v = e4m3_val(w[r * inp + c]) * scales[(r / 128) * bc + c / 128];
        u16 hi = f2bf_rne(v);
        dst[i] = hi;
        dst[n + i] = f2bf_rne(v - bf(hi));
    }
}

// dst[i] = the bf16 src[i] as f32 (a W8A8 product whose cuBLASLt output is bf16).
extern "C" __global__ void fp8_widen_bf16(const u16* __restrict__ src, float* __restrict__ dst, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        dst[i] = bf(src[i]);
    }
}

// The block scales of rows of 128 x 128 blocks, rows x bc, copied with a row pitch of ld >= bc
// (cuBLASLt reads a weight's scale rows on 16 bytes: ld a multiple of 4), the padding 0.
extern "C" __global__ void fp8_pad_scales(const float* __restrict__ src, float* __restrict__ dst,
                                          u32 rows, u32 bc, u32 ld) {
    u64 n = (u64)rows * ld;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 r = i / ld, c = i - r * ld;
        dst[i] = c < bc ? src[r * bc + c] : 0.0f;
    }
}
