// Launched by lifecycle_decoder_gpu::DecoderKernels (models/decoder-gpu/src/kernels.rs): each launch's grid, block and argument contract is stated at its
// launcher there; the kernels below document what they read and write.
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float bf(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 f2bf(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (u16)(((x >> 16) | 0x0040u) & 0xFFFFu);
    if ((x & 0x8000u) != 0u && (x & 0x17FFFu) != 0u) return (u16)(((x >> 16) + 1u) & 0xFFFFu);
    return (u16)(x >> 16);
}

// v split into hi = bf16(v) at out[i] and lo = bf16(v - hi) at out[half_len + i]; returns what
// they hold joined again, hi + lo.
__device__ __forceinline__ float split_store(u16* out, u64 i, u64 half_len, float v) {
    u16 hi = f2bf(v), lo = f2bf(v - bf(hi));
    if (out != nullptr) {
        out[i] = hi;
        out[half_len + i] = lo;
    }
    return bf(hi) + bf(lo);
}

// The KV cache's element: f32, or bf16 (rounded to nearest even when stored).
__device__ __forceinline__ float kv_get(const float* c, u64 i) { return c[i]; }
__device__ __forceinline__ float kv_get(const u16* c, u64 i) { return bf(c[i]); }
__device__ __forceinline__ void kv_put(float* c, u64 i, float v) { c[i] = v; }
__device__ __forceinline__ void kv_put(u16* c, u64 i, float v) { c[i] = f2bf(v); }

__device__ float block_sum(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    u32 warps = (blockDim.x + 31u) >> 5;
    float t = 0.0f;
    for (u32 w = 0; w < warps; ++w) t += red[w];
    __syncthreads();
    return t;
}

__device__ float block_max(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    u32 warps = (blockDim.x + 31u) >> 5;
    float t = NEG_INF;
    for (u32 w = 0; w < warps; ++w) t = fmaxf(t, red[w]);
    __syncthreads();
    return t;
}

// x[r, c] = table[tokens[r] - lo, c] when the token is in [lo, lo + count), else 0.
extern "C" __global__ void embed(const u16* __restrict__ table, const u32* __restrict__ tokens,
                                 float* __restrict__ x, u32 n, u32 h, u32 lo, u32 count) {
    u64 total = (u64)n * h;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u32 r = (u32)(i / h), c = (u32)(i % h);
        u32 t = tokens[r];
        x[i] = (t >= lo && t - lo < count) ? bf(table[(u64)(t - lo) * h + c]) : 0.0f;
    }
}

// One block per output row r: RMSNorm of x[rows ? rows[r] : r] with weight w, split into
// out[r] (hi) and out[m + r] (lo).
// Elements of a row each thread of rms_norm_split holds in registers (rows up to 16 x its
// block's threads wide, 4096 for 256 threads; wider rows read the rest again, the sum in the
// same order). The loops are unrolled to it: kept short, the kernel's code stays small (it runs
// once per launch, its instructions fetched cold).
#define NORM_HELD 16

// Each thread's elements c = t, t + B, ... (ceil(h / B) of them, the same count in every thread:
// the loops stop there, not predicated over NORM_HELD) are loaded at once into registers
// (independent loads, not one round trip per element) and summed in that order, as one strided
// loop would.
// The RMSNorm of row xr [h] with weight w into row r of the split out (half_len m h); with
// `kept`, each value's hi + lo there too (kept[c]). The row's values and weights a thread holds
// are requested together, before the sum.
__device__ __forceinline__ void rms_norm_row(const float* __restrict__ xr,
                                             const u16* __restrict__ w, u16* __restrict__ out,
                                             u32 r, u32 m, u32 h, float eps, float* kept) {
    __shared__ float red[32];
    const u32 b = blockDim.x;
    const u32 per = (h + b - 1u) / b;
    float held[NORM_HELD];
    u16 wh[NORM_HELD];
#pragma unroll
    for (u32 i = 0; i < NORM_HELD; ++i) {
        if (i >= per) break;
        u32 c = threadIdx.x + i * b;
        held[i] = c < h ? xr[c] : 0.0f;
        wh[i] = c < h ? w[c] : (u16)0;
    }
    float s = 0.0f;
#pragma unroll
    for (u32 i = 0; i < NORM_HELD; ++i) {
        if (i >= per) break;
        if (threadIdx.x + i * b < h) s += held[i] * held[i];
    }
    for (u32 c = threadIdx.x + NORM_HELD * b; c < h; c += b) s += xr[c] * xr[c];
    s = block_sum(s, red);
    float inv = 1.0f / sqrtf(s / (float)h + eps);
    const u64 half_len = (u64)m * h;
#pragma unroll
    for (u32 i = 0; i < NORM_HELD; ++i) {
        if (i >= per) break;
        u32 c = threadIdx.x + i * b;
        if (c < h) {
            float v = bf(wh[i]) * (held[i] * inv);
            float j = split_store(out, (u64)r * h + c, half_len, v);
            if (kept) kept[c] = j;
        }
    }
    for (u32 c = threadIdx.x + NORM_HELD * b; c < h; c += b) {
        float v = bf(w[c]) * (xr[c] * inv);
        float j = split_store(out, (u64)r * h + c, half_len, v);
        if (kept) kept[c] = j;
    }
}

extern "C" __global__ void __launch_bounds__(512)
    rms_norm_split(const float* __restrict__ x, const u16* __restrict__ w,
                   const u32* __restrict__ rows, u16* __restrict__ out, u32 m, u32 h, float eps) {
    u32 r = blockIdx.x;
    u32 src = rows ? rows[r] : r;
    rms_norm_row(x + (u64)src * h, w, out, r, m, h, eps, nullptr);
}

// Lets the grid queued after this one start before this one ends, where that grid was launched
// with programmatic stream serialization (the W8A8 products, models/decoder-gpu/src/kernels.rs
// launch_early): its blocks request their weights into L2, then wait for this grid to complete
// (griddepcontrol.wait) before they read anything it writes. Without such a grid after it, and
// before sm_90, nothing.
__device__ __forceinline__ void let_next_grid_start() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Returns once the grid before this one completed and its writes are visible: the W8A8
// quantisations call it first thing (after letting the grid after them start), as they too are
// launched early where the device has it (the launch before them then overlaps the kernel
// before them). Where this grid was not launched early, at once.
__device__ __forceinline__ void wait_for_inputs() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A LoRA branch's middle: t = s (t2[hi] + t2[lo]) of [n x r], split into ts (hi rows, then lo
// rows), the input of its B product. t2 is [2n x r] (the A product of the split input).
extern "C" __global__ void lora_mid(const float* __restrict__ t2, u16* __restrict__ ts, u32 n,
                                    u32 r, float s) {
    const u64 total = (u64)n * r;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        split_store(ts, i, total, s * (t2[i] + t2[total + i]));
    }
}

// A LoRA adapter merged into its base matrix (the merged mode): w[i, j] = bf16(w[i, j] +
// s sum_c b[i, c] a[c, j]) for the bf16 w [out x inp] (row-major), a [r x inp] and b [out x r],
// the sum in f32 over c in order and rounded to nearest once. A thread per column j of a tile of
// LORA_MERGE_ROWS rows (blockIdx.y), r taken LORA_MERGE_R at a time through shared memory.
#define LORA_MERGE_ROWS 32
#define LORA_MERGE_R 16
extern "C" __global__ void lora_merge(u16* w, const u16* __restrict__ a, const u16* __restrict__ b,
                                      u32 out, u32 inp, u32 r, float s) {
    __shared__ float ash[LORA_MERGE_R][256];
    __shared__ float bsh[LORA_MERGE_ROWS][LORA_MERGE_R];
    const u32 t = threadIdx.x, j = blockIdx.x * 256u + t, i0 = blockIdx.y * LORA_MERGE_ROWS;
    float acc[LORA_MERGE_ROWS];
#pragma unroll
    for (int i = 0; i < LORA_MERGE_ROWS; ++i) acc[i] = 0.f;
    for (u32 c0 = 0; c0 < r; c0 += LORA_MERGE_R) {
#pragma unroll
        for (int k = 0; k < LORA_MERGE_R; ++k) {
            ash[k][t] = (c0 + k < r && j < inp) ? bf(a[(u64)(c0 + k) * inp + j]) : 0.f;
        }
        for (u32 e = t; e < LORA_MERGE_ROWS * LORA_MERGE_R; e += 256u) {
            const u32 i = e / LORA_MERGE_R, k = e % LORA_MERGE_R;
            bsh[i][k] = (i0 + i < out && c0 + k < r) ? bf(b[(u64)(i0 + i) * r + c0 + k]) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < LORA_MERGE_R; ++k) {
            const float av = ash[k][t];
#pragma unroll
            for (int i = 0; i < LORA_MERGE_ROWS; ++i) acc[i] = fmaf(bsh[i][k], av, acc[i]);
        }
        __syncthreads();
    }
    if (j >= inp) return;
#pragma unroll
    for (int i = 0; i < LORA_MERGE_ROWS; ++i) {
        if (i0 + i < out) {
            const u64 at = (u64)(i0 + i) * inp + j;
            w[at] = f2bf(bf(w[at]) + s * acc[i]);
        }
    }
}

// Whether this block is the last of the gridDim.z chunk blocks of its (blockIdx.x, blockIdx.y)
// to finish (its counter in counters, zero before: the last sets it back to zero), every block's
// writes before the call visible to it. The whole block calls it (it synchronises the block).
__device__ bool last_of_chunks(u32* counters) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* ctr = counters + blockIdx.y * gridDim.x + blockIdx.x;
        last = atomicAdd(ctr, 1u) == gridDim.z - 1;
        if (last) *ctr = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// A LoRA group's down products at few rows (see lora_b): t[m, g r + c] = s sum_k x[m, k] A_g[c, k]
// for the group's targets g < gridDim.y (A_g: a0, a1 or a2, each r x inp), x = hi + lo of the
// split input xs [2n x inp]. A warp per row c of A_g (blockIdx.x: rows of 8 warps), a block per
// chunk of k (blockIdx.z, chunk columns each): the chunks' sums go to part [z][n][R] (R =
// gridDim.y r), and the last block of a row group to finish adds them in chunk order, the same
// order whichever block it is, scaled, into t [n x R] (chunks <= 16). counters: one per (blockIdx.x, blockIdx.y),
// zero before a launch and after it (the last block resets its own).
extern "C" __global__ void lora_a(const u16* __restrict__ xs, u32 n, u32 inp, const u16* a0,
                                  const u16* a1, const u16* a2, u32 r, u32 chunk, float s,
                                  float* part, float* t, u32* counters) {
    // launched before the base product of the same input, which may start at once
    let_next_grid_start();
    const u32 g = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 rows = blockDim.x / 32, c = blockIdx.x * rows + warp;
    const u32 R = gridDim.y * r, z = blockIdx.z, chunks = gridDim.z;
    const u16* a = g == 0 ? a0 : (g == 1 ? a1 : a2);
    const u32 k0 = z * chunk, k1 = min(inp, k0 + chunk);
    const u64 half_len = (u64)n * inp;
    const bool vec = ((inp | chunk) % 8u) == 0u && (((u64)xs | (u64)a) % 16u) == 0u;
    if (c < r) {
        const u16* arow = a + (u64)c * inp;
        // 8 rows of x at a time: their loads requested together, A's read once for them
        for (u32 m0 = 0; m0 < n; m0 += 8) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            if (vec) {
                for (u32 k = k0 + lane * 8; k < k1; k += 256) {
                    const uint4 av = *reinterpret_cast<const uint4*>(arow + k);
                    const u32 aw[4] = {av.x, av.y, av.z, av.w};
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        if (m0 + i < n) {
                            const u16* hi = xs + (u64)(m0 + i) * inp;
                            const uint4 hv = *reinterpret_cast<const uint4*>(hi + k);
                            const uint4 lv = *reinterpret_cast<const uint4*>(hi + half_len + k);
                            const u32 hw[4] = {hv.x, hv.y, hv.z, hv.w};
                            const u32 lw[4] = {lv.x, lv.y, lv.z, lv.w};
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                acc[i] += bf((u16)(aw[e] & 0xFFFFu)) *
                                          (bf((u16)(hw[e] & 0xFFFFu)) + bf((u16)(lw[e] & 0xFFFFu)));
                                acc[i] += bf((u16)(aw[e] >> 16)) * (bf((u16)(hw[e] >> 16)) + bf((u16)(lw[e] >> 16)));
                            }
                        }
                    }
                }
            } else {
                for (u32 k = k0 + lane; k < k1; k += 32) {
                    const float av = bf(arow[k]);
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        if (m0 + i < n) {
                            const u16* hi = xs + (u64)(m0 + i) * inp;
                            acc[i] += av * (bf(hi[k]) + bf(hi[half_len + k]));
                        }
                    }
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], o);
            }
            if (lane == 0) {
                for (u32 i = 0; i < 8u && m0 + i < n; ++i) {
                    const u32 m = m0 + i;
                    if (chunks == 1) t[(u64)m * R + g * r + c] = s * acc[i];
                    else part[((u64)z * n + m) * R + g * r + c] = acc[i];
                }
            }
        }
    }
    if (chunks == 1 || !last_of_chunks(counters)) return;
    const u32 c0 = blockIdx.x * rows;
    for (u32 i = threadIdx.x; i < n * rows; i += blockDim.x) {
        const u32 m = i / rows, cc = c0 + i % rows;
        if (cc >= r) continue;
        // every chunk's load requested together (chunks <= 16), added in chunk order
        float pv[16];
#pragma unroll
        for (u32 q = 0; q < 16u; ++q) pv[q] = q < chunks ? __ldcg(part + ((u64)q * n + m) * R + g * r + cc) : 0.f;
        float v = 0.f;
#pragma unroll
        for (u32 q = 0; q < 16u; ++q) v += pv[q];
        t[(u64)m * R + g * r + cc] = s * v;
    }
}

// d += A (16 x 16 bf16, row) * B (16 x 8 bf16, col) in f32: lora_a_tiles's step (compute
// capability 8.0 on; the host launches it only there).
__device__ __forceinline__ void lora_mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// Two bf16 at p (4-byte aligned) as one word.
__device__ __forceinline__ u32 ld_pair(const u16* p) { return *reinterpret_cast<const u32*>(p); }

#define LORA_TILE_COLS 16
// lora_a's products at more rows (up to 64; see lora_a), on tensor cores: the split input's 2n rows
// (hi rows, then lo rows) times A_g^T. A block (256 threads) takes LORA_TILE_COLS rows of A_g
// (blockIdx.x) over one chunk of k (blockIdx.z, `chunk` columns, a multiple of 16): warp w takes
// the 16 split rows of tile w % mt (mt = ceil(2n / 16)) and every (8 / mt)-th step of 16
// columns from w / mt (warps past mt (8 / mt) idle); the k-groups' sums are added in order in
// shared memory, and the chunk's [2n x cols] go to part [z][2n][R], which the last block of the
// (blockIdx.x, g) to finish adds in chunk order (hi and lo rows of a chunk, then the next
// chunk), scaled, into t [n x R]. inp a multiple of 16, xs and A 4-byte aligned. counters as
// lora_a's.
extern "C" __global__ void lora_a_tiles(const u16* __restrict__ xs, u32 n, u32 inp, const u16* a0,
                                        const u16* a1, const u16* a2, u32 r, u32 chunk, float s,
                                        float* part, float* t, u32* counters) {
    // launched before the base product of the same input, which may start at once
    let_next_grid_start();
    __shared__ float red[8 * 16 * LORA_TILE_COLS];
    const u32 g = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 R = gridDim.y * r, z = blockIdx.z, chunks = gridDim.z, rows2 = 2 * n;
    const u32 mt = (rows2 + 15) / 16, kg = 8 / mt, tile = warp % mt, grp = warp / mt;
    const u16* a = g == 0 ? a0 : (g == 1 ? a1 : a2);
    const u32 c0 = blockIdx.x * LORA_TILE_COLS, k0 = z * chunk, k1 = min(inp, k0 + chunk);
    const u32 qr = lane / 4, qc = (lane % 4) * 2;
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    if (grp < kg) {
        // rows past the input or A read their last row (their sums are not kept)
        const u16* xa = xs + (u64)min(tile * 16 + qr, rows2 - 1) * inp + qc;
        const u16* xb = xs + (u64)min(tile * 16 + qr + 8, rows2 - 1) * inp + qc;
        const u16* ar0 = a + (u64)min(c0 + qr, r - 1) * inp + qc;
        const u16* ar1 = a + (u64)min(c0 + 8 + qr, r - 1) * inp + qc;
#pragma unroll 4
        for (u32 k = k0 + 16 * grp; k < k1; k += 16 * kg) {
            const u32 x0 = ld_pair(xa + k), x1 = ld_pair(xb + k), x2 = ld_pair(xa + k + 8),
                      x3 = ld_pair(xb + k + 8);
            lora_mma(acc[0], x0, x1, x2, x3, ld_pair(ar0 + k), ld_pair(ar0 + k + 8));
            lora_mma(acc[1], x0, x1, x2, x3, ld_pair(ar1 + k), ld_pair(ar1 + k + 8));
        }
    }
    // the k-groups' sums, in group order: red[grp][16 rows][cols] per tile, groups apart
    const u32 tile_len = 16 * LORA_TILE_COLS;
    for (u32 gg = 0; gg < kg; ++gg) {
        if (grp == gg) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const u32 row = qr + (e >= 2 ? 8u : 0u), col = j * 8 + qc + (e & 1);
                    float* at = red + tile * tile_len + row * LORA_TILE_COLS + col;
                    *at = gg == 0 ? acc[j][e] : *at + acc[j][e];
                }
            }
        }
        __syncthreads();
    }
    for (u32 i = threadIdx.x; i < rows2 * LORA_TILE_COLS; i += blockDim.x) {
        const u32 row = i / LORA_TILE_COLS, col = i % LORA_TILE_COLS;
        if (c0 + col < r) {
            part[((u64)z * rows2 + row) * R + g * r + c0 + col] =
                red[(row / 16) * tile_len + (row % 16) * LORA_TILE_COLS + col];
        }
    }
    if (!last_of_chunks(counters)) return;
    for (u32 i = threadIdx.x; i < n * LORA_TILE_COLS; i += blockDim.x) {
        const u32 m = i / LORA_TILE_COLS, cc = c0 + i % LORA_TILE_COLS;
        if (cc >= r) continue;
        // every chunk's hi and lo loads requested together (chunks <= 16), added in chunk order
        float ph[16], pl[16];
#pragma unroll
        for (u32 q = 0; q < 16u; ++q) {
            ph[q] = q < chunks ? __ldcg(part + ((u64)q * rows2 + m) * R + g * r + cc) : 0.f;
            pl[q] = q < chunks ? __ldcg(part + ((u64)q * rows2 + n + m) * R + g * r + cc) : 0.f;
        }
        float v = 0.f;
#pragma unroll
        for (u32 q = 0; q < 16u; ++q) v += ph[q] + pl[q];
        t[(u64)m * R + g * r + cc] = s * v;
    }
}

// A LoRA group's up products at few rows, added where the base product's output is: for
// target g = blockIdx.y (B_g: b0, b1 or b2 of w_g x r), dst_g[m ld_g + j] += sum_c s t_g[m, c]
// B_g[j, c] for m < n, j < w_g, with t_g[m, c] = t[g t_target + m t_row + c]: from lora_a or
// lora_a_tiles t [n x R] (R = gridDim.y r: t_row R, t_target r, s 1, as they scaled it), from
// the A products that rode the base product's launch each target's [n x r] (t_row r, s the
// adapters' scaling); the target's n x r of s t_g first copied into the block's dynamic shared
// memory (n r floats: every column of the block reads all of it). Lanes of a warp share a
// column, p of them (a power of two, p <= 32): lane l takes column 32 / p (warp of the grid) + l / p
// and, of its row of B, the 8 elements at c = 8 (l % p) + 8 p i (i = 0, 1, ...; with vec, 16-byte
// loads: a warp's loads read whole rows of B side by side), else the elements at c = l % p + p i;
// the p lanes' sums are added by shuffles in a fixed order, and the column's first lane adds them
// to dst.
extern "C" __global__ void lora_b(const float* __restrict__ t, u32 n, u32 r, const u16* b0,
                                  const u16* b1, const u16* b2, float* d0, float* d1, float* d2,
                                  u32 w0, u32 w1, u32 w2, u32 ld0, u32 ld1, u32 ld2, u32 p,
                                  float s, u32 t_row, u32 t_target) {
    const u32 g = blockIdx.y;
    const u16* b = g == 0 ? b0 : (g == 1 ? b1 : b2);
    float* d = g == 0 ? d0 : (g == 1 ? d1 : d2);
    const u32 w = g == 0 ? w0 : (g == 1 ? w1 : w2);
    const u32 ld = g == 0 ? ld0 : (g == 1 ? ld1 : ld2);
    const u32 lane = threadIdx.x % 32, per_warp = 32u / p;
    const u32 j = (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * per_warp + lane / p;
    const u32 q = lane % p;
    extern __shared__ float tsh[];
    for (u32 i = threadIdx.x; i < n * r; i += blockDim.x) {
        tsh[i] = s * t[(u64)g * t_target + (u64)(i / r) * t_row + i % r];
    }
    __syncthreads();
    // whole warps go on to the shuffles; a lane past the matrix sums nothing
    const bool live = j < w;
    const u16* brow = b + (u64)(live ? j : 0) * r;
    const bool vec = (r % 8u) == 0u && ((u64)b % 16u) == 0u;
    // 8 rows of t at a time
    for (u32 m0 = 0; m0 < n; m0 += 8) {
        const u32 rows = min(8u, n - m0);
        const float* tr = tsh + m0 * r;
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (vec) {
            for (u32 c = 8u * q; live && c < r; c += 8u * p) {
                const uint4 bv = *reinterpret_cast<const uint4*>(brow + c);
                const u32 bw[4] = {bv.x, bv.y, bv.z, bv.w};
                float bx[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) bx[e] = bf((u16)(e % 2 == 0 ? bw[e / 2] & 0xFFFFu : bw[e / 2] >> 16));
#pragma unroll
                for (int m = 0; m < 8; ++m) {
                    if ((u32)m < rows) {
                        const float4* tm = reinterpret_cast<const float4*>(tr + m * r + c);
                        const float4 u = tm[0], v = tm[1];
                        const float tv[8] = {u.x, u.y, u.z, u.w, v.x, v.y, v.z, v.w};
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[m] += tv[e] * bx[e];
                    }
                }
            }
        } else {
            for (u32 c = q; live && c < r; c += p) {
                const float bx = bf(brow[c]);
#pragma unroll
                for (int m = 0; m < 8; ++m) {
                    if ((u32)m < rows) acc[m] += tr[m * r + c] * bx;
                }
            }
        }
        for (u32 o = p / 2u; o > 0u; o >>= 1) {
#pragma unroll
            for (int m = 0; m < 8; ++m) acc[m] += __shfl_down_sync(0xffffffffu, acc[m], o);
        }
        if (live && q == 0u) {
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                if ((u32)m < rows) d[(u64)(m0 + m) * ld + j] += acc[m];
            }
        }
    }
}

// lora_b's products on tensor cores, for more rows (lora_b's arguments and meaning; p unused):
// a block of LORA_B_WARPS warps takes 8 columns of B_g a warp (blockIdx.x: LORA_B_WARPS 8 columns)
// for target g = blockIdx.y. The target's n x r of s t_g is split once a block into bf16 hi and
// lo rows in dynamic shared memory (hi rows, then lo rows, mt = ceil(n / 16) tiles of 16 rows
// each, rows of ceil(r / 16) 16 + 8 elements; zeros past n and r); each warp multiplies the hi and
// the lo tiles by its 8 columns' rows of B over 16-wide steps of r (mma.sync.m16n8k16, both into
// one f32 accumulator: hi + lo), each step's B fragment loaded once for every tile, and adds each
// (row, column) to dst once. n <= 64; r even and b 4-byte aligned (B's rows read in pairs).
#define LORA_B_WARPS 4
extern "C" __global__ void __launch_bounds__(32 * LORA_B_WARPS)
    lora_b_tiles(const float* __restrict__ t, u32 n, u32 r, const u16* b0, const u16* b1,
                 const u16* b2, float* d0, float* d1, float* d2, u32 w0, u32 w1, u32 w2, u32 ld0,
                 u32 ld1, u32 ld2, u32 p, float s, u32 t_row, u32 t_target) {
    const u32 g = blockIdx.y;
    const u16* b = g == 0 ? b0 : (g == 1 ? b1 : b2);
    float* d = g == 0 ? d0 : (g == 1 ? d1 : d2);
    const u32 w = g == 0 ? w0 : (g == 1 ? w1 : w2);
    const u32 ld = g == 0 ? ld0 : (g == 1 ? ld1 : ld2);
    const u32 mt = (n + 15u) / 16u, kt = (r + 15u) / 16u, rp = 16u * kt, st = rp + 8u;
    const u32 lo_at = mt * 16u * st;
    extern __shared__ u16 tsp[];
    for (u32 i = threadIdx.x; i < mt * 16u * rp; i += blockDim.x) {
        const u32 m = i / rp, c = i % rp;
        const float v = (m < n && c < r) ? s * t[(u64)g * t_target + (u64)m * t_row + c] : 0.f;
        const u16 hi = f2bf(v);
        tsp[m * st + c] = hi;
        tsp[lo_at + m * st + c] = f2bf(v - bf(hi));
    }
    __syncthreads();
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 qr = lane / 4, qc = (lane % 4) * 2;
    const u32 j0 = (blockIdx.x * LORA_B_WARPS + warp) * 8u;
    if (j0 >= w) return;
    // the lane's column of the fragment (rows of B past the matrix read its last row: their
    // sums are not kept)
    const u16* brow = b + (u64)min(j0 + qr, w - 1u) * r;
    float acc[4][4];
#pragma unroll
    for (u32 i = 0; i < 4; ++i)
#pragma unroll
        for (u32 e = 0; e < 4; ++e) acc[i][e] = 0.f;
    for (u32 k = 0; k < rp; k += 16u) {
        const u32 bk0 = k + qc < r ? ld_pair(brow + k + qc) : 0u;
        const u32 bk1 = k + qc + 8u < r ? ld_pair(brow + k + qc + 8u) : 0u;
#pragma unroll
        for (u32 mi = 0; mi < 4; ++mi) {
            if (mi < mt) {
                const u16* h0 = tsp + (mi * 16u + qr) * st + k + qc;
                const u16* h1 = h0 + 8u * st;
                lora_mma(acc[mi], ld_pair(h0), ld_pair(h1), ld_pair(h0 + 8), ld_pair(h1 + 8), bk0, bk1);
                const u16* l0 = h0 + lo_at;
                const u16* l1 = h1 + lo_at;
                lora_mma(acc[mi], ld_pair(l0), ld_pair(l1), ld_pair(l0 + 8), ld_pair(l1 + 8), bk0, bk1);
            }
        }
    }
#pragma unroll
    for (u32 mi = 0; mi < 4; ++mi) {
#pragma unroll
        for (u32 e = 0; e < 4; ++e) {
            const u32 row = mi * 16u + qr + (e >= 2 ? 8u : 0u), col = j0 + qc + (e & 1u);
            if (mi < mt && row < n && col < w) d[(u64)row * ld + col] += acc[mi][e];
        }
    }
}

// out[r, c] = y2[r, c] + y2[n + r, c] (+ bias[c]) (+ res[r, c]); y2 is [2n x m].
extern "C" __global__ void combine(const float* __restrict__ y2, const u16* __restrict__ bias,
                                   const float* res, float* out, u32 n, u32 m) {
    u64 total = (u64)n * m;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        float v = y2[i] + y2[total + i];
        if (bias) v += bf(bias[i % m]);
        if (res) v += res[i];
        out[i] = v;
    }
}

// out[r, c] = y2[r, col0 + c] + y2[n + r, col0 + c] (+ bias[c]); y2 is [2n x ld]: the columns
// [col0, col0 + width) of a fused product (q, k or v of [q; k; v]).
extern "C" __global__ void combine_cols(const float* __restrict__ y2, const u16* __restrict__ bias,
                                        float* __restrict__ out, u32 n, u32 ld, u32 col0, u32 width) {
    u64 total = (u64)n * width;
    u64 half_len = (u64)n * ld;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 r = i / width, c = i % width;
        u64 at = r * ld + col0 + c;
        float v = y2[at] + y2[half_len + at];
        if (bias) v += bf(bias[c]);
        out[i] = v;
    }
}

// SiLU(gate) * up of a fused [gate; up] product gu2 [2n x 2f] (hi/lo rows); out split [2n x f].
extern "C" __global__ void swiglu_fused_split(const float* __restrict__ gu2, u16* __restrict__ out,
                                              u32 n, u32 f) {
    u64 total = (u64)n * f;
    u64 ld = 2ull * f;
    u64 half_len = (u64)n * ld;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 r = i / f, c = i % f;
        u64 at = r * ld + c;
        float g = gu2[at] + gu2[half_len + at];
        float u = gu2[at + f] + gu2[half_len + at + f];
        split_store(out, i, total, g / (1.0f + expf(-g)) * u);
    }
}

// SiLU(gate) * up with gate, up given as [2n x f] hi/lo products; out split [2n x f].
extern "C" __global__ void swiglu_split(const float* __restrict__ g2, const float* __restrict__ u2,
                                        u16* __restrict__ out, u32 n, u32 f) {
    u64 total = (u64)n * f;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        float g = g2[i] + g2[total + i];
        float u = u2[i] + u2[total + i];
        split_store(out, i, total, g / (1.0f + expf(-g)) * u);
    }
}

// One block per head: RMSNorm over its d values of x (rows of d: [n x heads x d]) in place with
// weight w (Qwen3's q/k norms, before the rotary embedding).
extern "C" __global__ void head_norm(float* __restrict__ x, const u16* __restrict__ w, u32 d,
                                     float eps) {
    __shared__ float red[32];
    float* xr = x + (u64)blockIdx.x * d;
    float s = 0.0f;
    for (u32 c = threadIdx.x; c < d; c += blockDim.x) s += xr[c] * xr[c];
    s = block_sum(s, red);
    float inv = 1.0f / sqrtf(s / (float)d + eps);
    for (u32 c = threadIdx.x; c < d; c += blockDim.x) xr[c] = bf(w[c]) * (xr[c] * inv);
}

// Rows idx[0..r) of a split activation xs [2n x h] (hi rows 0..n, lo rows n..2n) into the split
// activation out [2r x h]: the tokens routed to one expert.
extern "C" __global__ void gather_split_rows(const u16* __restrict__ xs, const u32* __restrict__ idx,
                                             u16* __restrict__ out, u32 n, u32 r, u32 h) {
    u64 total = (u64)r * h;
    u64 lo = (u64)n * h;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 row = i / h, c = i % h;
        u64 src = (u64)idx[row] * h + c;
        out[i] = xs[src];
        out[total + i] = xs[lo + src];
    }
}

// acc[idx[i], c] += wt[i] * (y2[i, c] + y2[r + i, c]) for the r rows of one expert's output
// y2 [2r x h] (hi/lo products); the rows of one expert are distinct, so no two threads add to
// one element.
extern "C" __global__ void scatter_add_rows(const float* __restrict__ y2, const u32* __restrict__ idx,
                                            const float* __restrict__ wt, float* __restrict__ acc,
                                            u32 r, u32 h) {
    u64 total = (u64)r * h;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 row = i / h, c = i % h;
        acc[(u64)idx[row] * h + c] += wt[row] * (y2[i] + y2[total + i]);
    }
}

// acc[t, c] += wt[j] * (y2[pos[j], c] + y2[r + pos[j], c]) over the entries j of token t,
// [ptr[t], ptr[t+1]) in expert order, for the r rows of a block of experts' outputs y2
// [2r x h] (hi/lo products): each token adds its experts in the order the per-expert path does.
extern "C" __global__ void scatter_add_grouped(const float* __restrict__ y2, const u32* __restrict__ ptr,
                                               const u32* __restrict__ pos, const float* __restrict__ wt,
                                               float* __restrict__ acc, u32 n, u32 r, u32 h) {
    u64 total = (u64)n * h;
    u64 lo = (u64)r * h;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 t = i / h, c = i % h;
        for (u32 j = ptr[t]; j < ptr[t + 1]; j++) {
            u64 src = (u64)pos[j] * h + c;
            acc[i] += wt[j] * (y2[src] + y2[lo + src]);
        }
    }
}

// acc[t, c] += sigmoid(g[t] + g[n + t]) * (y2[t, c] + y2[n + t, c]) for n rows of h: a shared
// expert's output y2 [2n x h] and its gate's logits g [2n] (hi/lo products), Qwen2-MoE.
extern "C" __global__ void add_gated_rows(const float* __restrict__ y2, const float* __restrict__ g,
                                          float* __restrict__ acc, u32 n, u32 h) {
    u64 total = (u64)n * h;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 t = i / h;
        float s = 1.0f / (1.0f + expf(-(g[t] + g[n + t])));
        acc[i] += s * (y2[i] + y2[total + i]);
    }
}

// out[i] = a[i] (+ res[i]).
extern "C" __global__ void add_rows(const float* __restrict__ a, const float* res, float* out,
                                    u64 total) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        out[i] = res ? a[i] + res[i] : a[i];
    }
}

// ---- the paged KV cache ------------------------------------------------------------------------
//
// A layer's K (or V) cache is [pages][KV_PAGE][kvh][head] (a head's units as KvDtype keeps it).
// Sequence `seq` reads and writes its positions through row `seq` of the page table
// `pages [rows][pps]`: position p lives in page pages[seq * pps + p / KV_PAGE] at p % KV_PAGE.
// Rows share pages (a group's prompt) and every page a row names lies in the cache (the host's
// tables, crate::decoder::pages). Keep KV_PAGE the Rust side's KV_PAGE_POSITIONS.
#define KV_PAGE 64u
#define KV_PAGE_SHIFT 6u

// The cache position (page * KV_PAGE + offset) of position p of the sequence whose page-table
// row is `row`.
__device__ __forceinline__ u64 kv_at(const u32* __restrict__ row, u32 p) {
    return (u64)row[p >> KV_PAGE_SHIFT] * KV_PAGE + (p & (KV_PAGE - 1u));
}

// Rotary embedding (pairs (j, j + d/2)) of q [n x qh x d] in place; k rotated and v copied into
// the paged caches (elements T: float, or u16 holding bf16) at (seqs[r], poss[r]).
template <typename T>
__device__ void rope_store_t(float* __restrict__ q, const float* __restrict__ k,
                             const float* __restrict__ v, T* __restrict__ kc,
                             T* __restrict__ vc, const u32* __restrict__ seqs,
                             const u32* __restrict__ poss, const float* __restrict__ inv_freq,
                             u32 n, u32 qh, u32 kvh, u32 d, const u32* __restrict__ pages,
                             u32 pps) {
    u32 half = d / 2;
    u64 per_row = (u64)(qh + kvh) * half;
    u64 total = (u64)n * per_row;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u32 r = (u32)(i / per_row);
        u32 rem = (u32)(i % per_row);
        u32 head = rem / half, j = rem % half;
        u32 pos = poss[r];
        float s, c;
        sincosf((float)pos * inv_freq[j], &s, &c);
        if (head < qh) {
            float* p = q + ((u64)r * qh + head) * d;
            float a = p[j], b = p[j + half];
            p[j] = a * c - b * s;
            p[j + half] = b * c + a * s;
        } else {
            u32 kv = head - qh;
            const float* p = k + ((u64)r * kvh + kv) * d;
            u64 at = (kv_at(pages + (u64)seqs[r] * pps, pos) * kvh + kv) * d;
            float a = p[j], b = p[j + half];
            kv_put(kc, at + j, a * c - b * s);
            kv_put(kc, at + j + half, b * c + a * s);
            const float* pv = v + ((u64)r * kvh + kv) * d;
            kv_put(vc, at + j, pv[j]);
            kv_put(vc, at + j + half, pv[j + half]);
        }
    }
}

// The K (or V) rows of one sequence and kv head in a cache of elements T (as rope_store_t's):
// position p's element t.
// Rows: `page(j)` the first position of page j of the sequence (one page-table read), `get(pg,
// o, t)` element t of position o of that page.
template <typename T>
struct PlainRows {
    const T* base;
    u64 stride;
    const u32* row;
    __device__ __forceinline__ const T* page(u32 j) const {
        return base + (u64)row[j] * KV_PAGE * stride;
    }
    __device__ __forceinline__ float get(const T* pg, u32 o, u32 t) const {
        return kv_get(pg + o * stride, t);
    }
};

// Where an attention kernel quantises its output for the W8A8 product by o (the tensor-core
// kernel's layout, as fp8_quant_split would from the split output): with d = 128 a block's
// outputs (one token, one head) are one 128-wide group of that product's input. q null: none.
struct AttnQuant {
    unsigned char* q;
    float* sc;
    u32 sc_tok, sc_grp, tiles;
};
// (defined with the quantisations below)
__device__ void quant_head(float v, bool mine, u32 t, u32 row, u32 grp, u32 inp, AttnQuant qz);
__device__ void pad_head(u32 row, u32 grp, u32 inp, AttnQuant qz);

// One block per (row r, local query head j): softmax(q . k / sqrt(d)) over cache positions
// 0..len-1 of the rows k and v (Rows: PlainRows, Fp8Rows), times v; output split into out
// [2n x qh x d] at the block's row. Each warp takes a position at a time, its lanes the dot's
// elements (coalesced reads, a shuffle reduction); then the block's threads form G = blockDim / d
// groups of d (one group looping over the elements when d >= blockDim), group g summing the
// positions p = g mod G of each output element, and group 0 adding the others' sums in group
// order. Dynamic shared memory: max(d, blockDim) floats, the sequence's page-table row (pps
// words, filled by the caller: `rows_in_shared`), then len floats; blockDim a multiple of 32.
// With qz.q (d = 128, blockDim 256) the outputs are also quantised as group j of token r of the
// o product's input (qh d wide); out may then be null (no split output written).
template <typename Rows>
__device__ void attend(const float* __restrict__ q, Rows k, Rows v, u32 len, u32 pps,
                       u16* __restrict__ out, u32 n, u32 qh, u32 d, float scale, AttnQuant qz) {
    extern __shared__ float sm[];
    __shared__ float red[32];
    const u32 row = blockIdx.x;
    // qs, then the groups' sums, in the first max(d, blockDim) floats; the page row, then the
    // scores after them
    float* qs = sm;
    float* part = sm;
    float* sc = sm + (d > blockDim.x ? d : blockDim.x) + pps;
    for (u32 t = threadIdx.x; t < d; t += blockDim.x) qs[t] = q[(u64)row * d + t];
    __syncthreads();
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float mx = NEG_INF;
    // page by page (one page-table read a page and warp), a warp's positions warp, warp +
    // warps, ... of each (which warp scores a position changes no score)
    for (u32 j = 0; j * KV_PAGE < len; ++j) {
        const auto pk = k.page(j);
        const u32 lo = j * KV_PAGE, hi = min(len, lo + KV_PAGE);
        for (u32 p = lo + warp; p < hi; p += warps) {
            float s = 0.0f;
            for (u32 t = lane; t < d; t += 32) s += qs[t] * k.get(pk, p - lo, t);
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            s *= scale;
            if (lane == 0) sc[p] = s;
            mx = fmaxf(mx, s);
        }
    }
    // (block_max synchronises before it reads: every score is in shared memory after it)
    mx = block_max(mx, red);
    float tot = 0.0f;
    for (u32 p = threadIdx.x; p < len; p += blockDim.x) {
        float e = expf(sc[p] - mx);
        sc[p] = e;
        tot += e;
    }
    tot = block_sum(tot, red);
    for (u32 p = threadIdx.x; p < len; p += blockDim.x) sc[p] = sc[p] / tot;
    __syncthreads();
    u64 half_len = (u64)n * qh * d;
    if (d >= blockDim.x) {
        for (u32 t = threadIdx.x; t < d; t += blockDim.x) {
            float o = 0.0f;
            for (u32 j = 0; j * KV_PAGE < len; ++j) {
                const auto pv = v.page(j);
                const u32 end = min(len - j * KV_PAGE, KV_PAGE);
#pragma unroll 8
                for (u32 i = 0; i < end; ++i) o += sc[j * KV_PAGE + i] * v.get(pv, i, t);
            }
            split_store(out, (u64)row * d + t, half_len, o);
        }
        return;
    }
    const u32 groups = blockDim.x / d, g = threadIdx.x / d, t = threadIdx.x % d;
    float o = 0.0f;
    if (g < groups) {
        // the positions g, g + groups, ... in order, page by page (one page-table read a page)
        for (u32 j = 0; j * KV_PAGE < len; ++j) {
            const auto pv = v.page(j);
            const u32 lo = j * KV_PAGE, hi = min(len, lo + KV_PAGE);
            const u32 first = lo + (g + groups - lo % groups) % groups;
#pragma unroll 8
            for (u32 p = first; p < hi; p += groups) o += sc[p] * v.get(pv, p - lo, t);
        }
        if (g > 0) part[(g - 1) * d + t] = o;
    }
    __syncthreads();
    float joined = 0.0f;
    if (g == 0) {
        for (u32 k = 1; k < groups; ++k) o += part[(k - 1) * d + t];
        joined = split_store(out, (u64)row * d + t, half_len, o);
    }
    if (qz.q != nullptr) quant_head(joined, g == 0, t, row / qh, row % qh, qh * d, qz);
}

// The page-table row `row` (pps words) copied into the block's shared memory after its first
// `skip` floats (attend's layout); the copy, for Rows to read. Synchronises the block.
__device__ __forceinline__ const u32* row_in_shared(const u32* __restrict__ row, u32 pps, u32 skip) {
    extern __shared__ float sm[];
    u32* pg = reinterpret_cast<u32*>(sm + skip);
    for (u32 i = threadIdx.x; i < pps; i += blockDim.x) pg[i] = row[i];
    __syncthreads();
    return pg;
}

// attend over a cache of elements T: block (r, j) reads sequence seqs[r]'s positions
// 0..=poss[r] of the kv head query head q_base + j uses.
template <typename T>
__device__ void attention_t(const float* __restrict__ q, const T* __restrict__ kc,
                            const T* __restrict__ vc, const u32* __restrict__ seqs,
                            const u32* __restrict__ poss, u16* __restrict__ out,
                            u32 n, u32 qh, u32 kvh, u32 d, const u32* __restrict__ pages,
                            u32 pps, u32 q_base, u32 group, u32 kv_base, float scale,
                            AttnQuant qz) {
    u32 r = blockIdx.x / qh, j = blockIdx.x % qh;
    if (r >= n) {
        // a padded token of the quantised output (the grid covers them only with qz.q)
        pad_head(r, j, qh * d, qz);
        return;
    }
    u32 seq = seqs[r], len = poss[r] + 1;
    u32 kv = (q_base + j) / group - kv_base;
    u64 stride = (u64)kvh * d;
    u64 at = (u64)kv * d;
    const u32* row = row_in_shared(pages + (u64)seq * pps, pps, d > blockDim.x ? d : blockDim.x);
    attend(q, PlainRows<T>{kc + at, stride, row}, PlainRows<T>{vc + at, stride, row}, len, pps, out,
           n, qh, d, scale, qz);
}

#define ROPE_STORE(NAME, T)                                                                         \
    extern "C" __global__ void NAME(float* __restrict__ q, const float* __restrict__ k,             \
                                    const float* __restrict__ v, T* __restrict__ kc,                \
                                    T* __restrict__ vc, const u32* __restrict__ seqs,               \
                                    const u32* __restrict__ poss, const float* __restrict__ inv_freq, \
                                    u32 n, u32 qh, u32 kvh, u32 d, const u32* __restrict__ pages,   \
                                    u32 pps) {                                                      \
        rope_store_t<T>(q, k, v, kc, vc, seqs, poss, inv_freq, n, qh, kvh, d, pages, pps);          \
    }
ROPE_STORE(rope_store, float)
ROPE_STORE(rope_store_bf16, u16)

#define ATTENTION(NAME, T)                                                                          \
    extern "C" __global__ void NAME(const float* __restrict__ q, const T* __restrict__ kc,          \
                                    const T* __restrict__ vc, const u32* __restrict__ seqs,         \
                                    const u32* __restrict__ poss, u16* __restrict__ out,            \
                                    u32 n, u32 qh, u32 kvh, u32 d, const u32* __restrict__ pages,   \
                                    u32 pps, u32 q_base, u32 group, u32 kv_base, float scale,       \
                                    unsigned char* aq, float* asc, u32 sc_tok, u32 sc_grp,          \
                                    u32 tiles) {                                                    \
        attention_t<T>(q, kc, vc, seqs, poss, out, n, qh, kvh, d, pages, pps, q_base, group, kv_base, \
                       scale,                                                                       \
                       AttnQuant{aq, asc, sc_tok, sc_grp, tiles});                                  \
    }
ATTENTION(attention, float)
ATTENTION(attention_bf16, u16)

// ---- fp8 K/V: e4m3 with one f32 scale per position and kv head (KvDtype::store_head) ----------
//
// A cache record is one kv head at one position: d e4m3 bytes, then the f32 scale (d + 4 bytes;
// d a multiple of 4), records [pages][KV_PAGE][kvh] per layer block. The scale is amax / 448 of the
// head's d values (1 for an all-zero head), each value divided by it and rounded to the nearest
// e4m3 value, ties to even: the CPU decoder's formula, bit for bit on the same inputs.
typedef unsigned char u8;

// The e4m3 byte of x (lifecycle_layout::fp8::e4m3_from_f32: round to nearest even; from 480 on,
// and for infinities and NaN, NaN).
__device__ __forceinline__ u32 e4m3_of(float x) {
    const u32 nan_from = 1087u << 20, normal_from = 121u << 23;
    const u32 bits = __float_as_uint(x);
    const u32 sign = (bits >> 24) & 0x80u, mag = bits & 0x7fffffffu;
    u32 byte;
    if (mag >= nan_from) {
        byte = 0x7fu;
    } else if (mag < normal_from) {
        // adding 2^14 (f32 ulp 2^-9, the e4m3 subnormal step) rounds to nearest even
        const float sum = __uint_as_float(mag) + __uint_as_float(141u << 23);
        byte = (__float_as_uint(sum) - (141u << 23)) & 0xffu;
    } else {
        const u32 odd = (mag >> 20) & 1u;
        byte = ((mag + ((7u - 127u) << 23) + 0x7ffffu + odd) >> 20) & 0xffu;
    }
    return byte | sign;
}

// The value of an e4m3 byte (0x7f / 0xff: NaN).
__device__ __forceinline__ float e4m3_value(u32 b) {
    const u32 e = (b >> 3) & 15u, m = b & 7u;
    if ((b & 0x7fu) == 0x7fu) return __uint_as_float(0x7fc00000u);
    const float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
    return (b & 0x80u) ? -v : v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Rotary embedding of q in place, as rope_store_t; k rotated and v stored into the fp8 caches'
// records at (seqs[r], poss[r]). One warp per (row, head) over the qh + kvh heads of each row
// (blockDim.x a multiple of 32); d even, a multiple of 4 and at most 256.
extern "C" __global__ void rope_store_fp8(float* __restrict__ q, const float* __restrict__ k,
                                          const float* __restrict__ v, u8* __restrict__ kc,
                                          u8* __restrict__ vc, const u32* __restrict__ seqs,
                                          const u32* __restrict__ poss,
                                          const float* __restrict__ inv_freq, u32 n, u32 qh,
                                          u32 kvh, u32 d, const u32* __restrict__ pages,
                                          u32 pps) {
    const u32 lane = threadIdx.x & 31u, half = d / 2, rec = d + 4;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    const u64 items = (u64)n * (qh + kvh);
    for (u64 item = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; item < items;
         item += warps) {
        const u32 r = (u32)(item / (qh + kvh)), head = (u32)(item % (qh + kvh));
        const u32 pos = poss[r];
        if (head < qh) {
            float* p = q + ((u64)r * qh + head) * d;
            for (u32 j = lane; j < half; j += 32u) {
                float s, c;
                sincosf((float)pos * inv_freq[j], &s, &c);
                const float a = p[j], b = p[j + half];
                p[j] = a * c - b * s;
                p[j + half] = b * c + a * s;
            }
            continue;
        }
        const u32 kv = head - qh;
        const float* pk = k + ((u64)r * kvh + kv) * d;
        const float* pv = v + ((u64)r * kvh + kv) * d;
        float ka[4], kb[4];
        float kmax = 0.0f, vmax = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 j = lane + 32u * (u32)i;
            ka[i] = 0.0f;
            kb[i] = 0.0f;
            if (j < half) {
                float s, c;
                sincosf((float)pos * inv_freq[j], &s, &c);
                const float a = pk[j], b = pk[j + half];
                ka[i] = a * c - b * s;
                kb[i] = b * c + a * s;
                kmax = fmaxf(kmax, fmaxf(fabsf(ka[i]), fabsf(kb[i])));
                vmax = fmaxf(vmax, fmaxf(fabsf(pv[j]), fabsf(pv[j + half])));
            }
        }
        kmax = warp_max(kmax);
        vmax = warp_max(vmax);
        const float ks = kmax > 0.0f ? kmax / 448.0f : 1.0f;
        const float vs = vmax > 0.0f ? vmax / 448.0f : 1.0f;
        const u64 at = (kv_at(pages + (u64)seqs[r] * pps, pos) * kvh + kv) * rec;
        u8* kr = kc + at;
        u8* vr = vc + at;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 j = lane + 32u * (u32)i;
            if (j < half) {
                kr[j] = (u8)e4m3_of(ka[i] / ks);
                kr[j + half] = (u8)e4m3_of(kb[i] / ks);
                vr[j] = (u8)e4m3_of(pv[j] / vs);
                vr[j + half] = (u8)e4m3_of(pv[j + half] / vs);
            }
        }
        if (lane == 0) {
            *reinterpret_cast<float*>(kr + d) = ks;
            *reinterpret_cast<float*>(vr + d) = vs;
        }
    }
}

// The K (or V) records of one sequence and kv head in an fp8 cache: position p's element t as
// e4m3 x its record's scale (the CPU decoder's dequantised value).
struct Fp8Rows {
    const u8* base;
    u64 stride;
    u32 d;
    const u32* row;
    __device__ __forceinline__ const u8* page(u32 j) const {
        return base + (u64)row[j] * KV_PAGE * stride;
    }
    __device__ __forceinline__ float get(const u8* pg, u32 o, u32 t) const {
        const u8* rec = pg + o * stride;
        return e4m3_value(rec[t]) * *reinterpret_cast<const float*>(rec + d);
    }
};

// attention_t over the fp8 caches' records (d e4m3 bytes, then the f32 scale).
extern "C" __global__ void attention_fp8(const float* __restrict__ q, const u8* __restrict__ kc,
                                         const u8* __restrict__ vc, const u32* __restrict__ seqs,
                                         const u32* __restrict__ poss, u16* __restrict__ out,
                                         u32 n, u32 qh, u32 kvh, u32 d,
                                         const u32* __restrict__ pages, u32 pps, u32 q_base,
                                         u32 group, u32 kv_base, float scale,
                                         unsigned char* aq, float* asc, u32 sc_tok, u32 sc_grp,
                                         u32 tiles) {
    const u32 r = blockIdx.x / qh, j = blockIdx.x % qh;
    const AttnQuant qz{aq, asc, sc_tok, sc_grp, tiles};
    if (r >= n) {
        pad_head(r, j, qh * d, qz);
        return;
    }
    const u32 seq = seqs[r], len = poss[r] + 1;
    const u32 kv = (q_base + j) / group - kv_base;
    const u32 rec = d + 4;
    const u64 stride = (u64)kvh * rec;
    const u64 at = (u64)kv * rec;
    const u32* row = row_in_shared(pages + (u64)seq * pps, pps, d > blockDim.x ? d : blockDim.x);
    attend(q, Fp8Rows{kc + at, stride, d, row}, Fp8Rows{vc + at, stride, d, row}, len, pps, out, n,
           qh, d, scale, qz);
}

// ---- prefill attention in tiles of rows (online softmax) ---------------------------------------
//
// A prefill's rows come in runs of one sequence at consecutive positions; one block per (tile,
// local query head) takes up to TILE_ROWS such rows (tiles: [first row, rows] each, made by the
// host: prefill_tiles) and reads the K and V pages the tile's last row sees once for all of its
// rows, a page at a time into shared memory as f32: scores of every (row, position) of the page
// (masked past each row's own position), the rows' running maximum m and sum l of exp(score -
// m) (online softmax, pages in order), the output sums rescaled by exp(m_old - m_new) and added
// exp(score - m) v. A row's result depends only on its own query, cache and position (its sums
// run over its positions in order, whatever the rows beside it), so a prefill's tiling changes
// no output bit. Output as attend's: split into out at (row, head), or quantised (qz.q, d =
// 128); blocks past the tiles pad the quantised output's padded tokens n, n + 1, ... d <= 128.
// Dynamic shared memory (tile_shared_bytes): the page-table row (pps words), q of the tile's rows
// [TILE_ROWS][d], one page of K or V [KV_PAGE][d + 1], the page's scores [TILE_ROWS][KV_PAGE],
// then per row alpha, m and l. blockDim 256.
#define TILE_ROWS 16u
// a page's scores are a warp's two per lane
static_assert(KV_PAGE == 64u, "attend_tile takes pages of 64 positions");

// Positions 0 .. np of page pg of rows as f32 into kv (rows ld floats apart), the block's threads
// striding over them.
template <typename Rows, typename P>
__device__ __forceinline__ void page_to_shared(Rows rows, P pg, u32 np, u32 d, u32 ld,
                                               float* __restrict__ kv) {
    for (u32 i = threadIdx.x; i < np * d; i += blockDim.x) {
        const u32 c = i / d, t = i % d;
        kv[c * ld + t] = rows.get(pg, c, t);
    }
}

template <typename Rows>
__device__ void attend_tile(const float* __restrict__ q, Rows k, Rows v, u32 first, u32 cnt,
                            u32 pos0, u32 pps, u16* __restrict__ out, u32 n, u32 qh, u32 j, u32 d,
                            float scale, AttnQuant qz) {
    extern __shared__ float sm[];
    const u32 tid = threadIdx.x, nt = blockDim.x;
    const u32 lane = tid & 31u, warp = tid >> 5, warps = nt >> 5;
    const u32 ld = d + 1;
    float* qs = sm + pps;
    float* kv = qs + TILE_ROWS * d;
    float* p = kv + KV_PAGE * ld;
    float* alpha = p + TILE_ROWS * KV_PAGE;
    float* mrow = alpha + TILE_ROWS;
    float* lrow = mrow + TILE_ROWS;
    for (u32 i = tid; i < cnt * d; i += nt) {
        const u32 r = i / d, t = i % d;
        qs[i] = q[((u64)(first + r) * qh + j) * d + t];
    }
    if (tid < TILE_ROWS) {
        mrow[tid] = NEG_INF;
        lrow[tid] = 0.0f;
    }
    float acc[8];
#pragma unroll
    for (u32 i = 0; i < 8; ++i) acc[i] = 0.0f;
    const u32 last = pos0 + cnt - 1;
    for (u32 pj = 0; pj * KV_PAGE <= last; ++pj) {
        const u32 lo = pj * KV_PAGE, np = min(KV_PAGE, last + 1 - lo);
        __syncthreads();  // the page before fully read
        page_to_shared(k, k.page(pj), np, d, ld, kv);
        __syncthreads();
        for (u32 e = tid; e < TILE_ROWS * KV_PAGE; e += nt) {
            const u32 r = e / KV_PAGE, c = e % KV_PAGE;
            float sc = NEG_INF;
            if (r < cnt && c < np && lo + c <= pos0 + r) {
                float a = 0.0f;
                for (u32 t = 0; t < d; ++t) a += qs[r * d + t] * kv[c * ld + t];
                sc = a * scale;
            }
            p[e] = sc;
        }
        __syncthreads();
        for (u32 r = warp; r < cnt; r += warps) {
            const float s0 = p[r * KV_PAGE + lane], s1 = p[r * KV_PAGE + 32u + lane];
            const float mo = mrow[r];
            const float mn = fmaxf(mo, warp_max(fmaxf(s0, s1)));
            const float e0 = expf(s0 - mn), e1 = expf(s1 - mn);
            p[r * KV_PAGE + lane] = e0;
            p[r * KV_PAGE + 32u + lane] = e1;
            float sum = e0 + e1;
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == 0) {
                const float a = expf(mo - mn);
                alpha[r] = a;
                lrow[r] = lrow[r] * a + sum;
                mrow[r] = mn;
            }
        }
        __syncthreads();  // the scores and K read
        page_to_shared(v, v.page(pj), np, d, ld, kv);
        __syncthreads();
#pragma unroll
        for (u32 i = 0; i < 8; ++i) {
            const u32 idx = tid + nt * i, r = idx / d, t = idx % d;
            if (idx < TILE_ROWS * d && r < cnt) {
                float a = acc[i] * alpha[r];
                for (u32 c = 0; c < np; ++c) a += p[r * KV_PAGE + c] * kv[c * ld + t];
                acc[i] = a;
            }
        }
    }
    __syncthreads();
    const u64 half_len = (u64)n * qh * d;
#pragma unroll
    for (u32 i = 0; i < 8; ++i) {
        const u32 idx = tid + nt * i, r = idx / d, t = idx % d;
        if (idx < TILE_ROWS * d && r < cnt) {
            const float o = acc[i] / lrow[r];
            // the joined value kept for the quantisation (qs no longer read)
            qs[r * d + t] = split_store(out, ((u64)(first + r) * qh + j) * d + t, half_len, o);
        }
    }
    if (qz.q == nullptr) return;
    __syncthreads();
    for (u32 r = 0; r < cnt; ++r) {
        const float o = tid < d ? qs[r * d + tid] : 0.0f;
        quant_head(o, tid < d, tid, first + r, j, qh * d, qz);
        __syncthreads();
    }
}

// The tile of block (b, j): seqs and poss of its first row, and the sequence's page-table row in
// shared memory; padding blocks (b >= tiles) pad token n + b - tiles.
#define ATTENTION_TILED_PROLOGUE                                                                    \
    const u32 b = blockIdx.x / qh, j = blockIdx.x % qh;                                             \
    if (b >= tiles) {                                                                               \
        pad_head(n + b - tiles, j, qh * d, qz);                                                     \
        return;                                                                                     \
    }                                                                                               \
    const u32 first = tile_of[2 * b], cnt = tile_of[2 * b + 1];                                     \
    const u32 seq = seqs[first], pos0 = poss[first];                                                \
    const u32 kvi = (q_base + j) / group - kv_base;                                                 \
    const u32* row = row_in_shared(pages + (u64)seq * pps, pps, 0);

#define ATTENTION_TILED(NAME, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                         \
        const float* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,           \
        const u32* __restrict__ seqs, const u32* __restrict__ poss, u16* __restrict__ out, u32 n,  \
        u32 qh, u32 kvh, u32 d, const u32* __restrict__ pages, u32 pps, u32 q_base, u32 group,     \
        u32 kv_base, float scale, const u32* __restrict__ tile_of, u32 tiles, unsigned char* aq,   \
        float* asc, u32 sc_tok, u32 sc_grp, u32 qtiles) {                                          \
        const AttnQuant qz{aq, asc, sc_tok, sc_grp, qtiles};                                        \
        ATTENTION_TILED_PROLOGUE                                                                    \
        const u64 stride = (u64)kvh * d, at = (u64)kvi * d;                                         \
        attend_tile(q, PlainRows<T>{kc + at, stride, row}, PlainRows<T>{vc + at, stride, row},    \
                    first, cnt, pos0, pps, out, n, qh, j, d, scale, qz);                            \
    }
ATTENTION_TILED(attention_tiled, float)
ATTENTION_TILED(attention_tiled_bf16, u16)

// attention_tiled over the fp8 caches' records.
extern "C" __global__ void __launch_bounds__(256) attention_tiled_fp8(
    const float* __restrict__ q, const u8* __restrict__ kc, const u8* __restrict__ vc,
    const u32* __restrict__ seqs, const u32* __restrict__ poss, u16* __restrict__ out, u32 n,
    u32 qh, u32 kvh, u32 d, const u32* __restrict__ pages, u32 pps, u32 q_base, u32 group,
    u32 kv_base, float scale, const u32* __restrict__ tile_of, u32 tiles, unsigned char* aq,
    float* asc, u32 sc_tok, u32 sc_grp, u32 qtiles) {
    const AttnQuant qz{aq, asc, sc_tok, sc_grp, qtiles};
    ATTENTION_TILED_PROLOGUE
    const u32 rec = d + 4;
    const u64 stride = (u64)kvh * rec, at = (u64)kvi * rec;
    attend_tile(q, Fp8Rows{kc + at, stride, d, row}, Fp8Rows{vc + at, stride, d, row}, first, cnt,
                pos0, pps, out, n, qh, j, d, scale, qz);
}

// ---- decode attention split over the cache (flash-decoding) ------------------------------------
//
// A decode step's attention in two kernels: attention_split* take the cache in chunks of `chunk`
// positions, a block per (row, local kv head, chunk of up to SPLIT_HEADS of the query heads that
// read it, chunk of positions), so every K and V row a block reads serves all of its query heads
// (grouped-query attention reads the cache once, not once per query head) and a long context
// spreads over many blocks; attention_join then joins the chunks of each (row, query head) in
// chunk order. Each chunk's block writes, per query head, the chunk's score maximum m, its sum
// of exp(score - m) l and its unnormalised output sum of exp(score - m) v: part_o [n x qh x
// splits x d] and part_ml [n x qh x splits x 2] (splits the most chunks of a row, fixed by the
// longest row a page table holds). A row's result depends only on its own query, cache and length: the chunk
// size is the caller's and fixed for a cache, every sum runs in a fixed order.

#define SPLIT_THREADS 128
#define SPLIT_WARPS (SPLIT_THREADS / 32)
#define SPLIT_HEADS 8

// Four consecutive elements t = 4 qd .. 4 qd + 3 of position p's row, as floats.
__device__ __forceinline__ void kv_load4(const float* row, u32 qd, float* o) {
    const float4 x = *reinterpret_cast<const float4*>(row + 4u * qd);
    o[0] = x.x;
    o[1] = x.y;
    o[2] = x.z;
    o[3] = x.w;
}
__device__ __forceinline__ void kv_load4(const u16* row, u32 qd, float* o) {
    const uint2 x = *reinterpret_cast<const uint2*>(row + 4u * qd);
    o[0] = __uint_as_float(x.x << 16);
    o[1] = __uint_as_float(x.x & 0xffff0000u);
    o[2] = __uint_as_float(x.y << 16);
    o[3] = __uint_as_float(x.y & 0xffff0000u);
}

// The cache position of position p of a split chunk whose pages (from page `first` of its
// sequence) are `pg` (chunk_pages).
__device__ __forceinline__ u64 chunk_at(const u32* pg, u32 first, u32 p) {
    return (u64)pg[(p >> KV_PAGE_SHIFT) - first] * KV_PAGE + (p & (KV_PAGE - 1u));
}

template <typename T>
struct PlainQuads {
    const T* base;
    u64 stride;
    const u32* pg;
    u32 first;
    __device__ __forceinline__ void load4(u32 p, u32 qd, float* o) const {
        kv_load4(base + chunk_at(pg, first, p) * stride, qd, o);
    }
};

struct Fp8Quads {
    const u8* base;
    u64 stride;
    u32 d;
    const u32* pg;
    u32 first;
    __device__ __forceinline__ void load4(u32 p, u32 qd, float* o) const {
        const u8* rec = base + chunk_at(pg, first, p) * stride;
        const u32 x = *reinterpret_cast<const u32*>(rec + 4u * qd);
        const float s = *reinterpret_cast<const float*>(rec + d);
#pragma unroll
        for (u32 i = 0; i < 4; ++i) o[i] = e4m3_value((x >> (8u * i)) & 0xffu) * s;
    }
};

// The smallest power of two >= x, at most cap.
__device__ __forceinline__ u32 pow2_at_least(u32 x, u32 cap) {
    u32 p = 1u;
    while (p < x && p < cap) p <<= 1;
    return p;
}

// The most pages a split chunk spans (its positions, at most 1024, start at a page).
#define SPLIT_PAGES 16u

// The page-table entries of positions p0 .. p0 + cnt of `row` (p0 a multiple of KV_PAGE: page
// p0 / KV_PAGE first) in the block's static shared memory, for Quads (the caller's attend_chunk
// synchronises before any thread reads them).
__device__ __forceinline__ const u32* chunk_pages(const u32* __restrict__ row, u32 p0, u32 cnt) {
    __shared__ u32 pg[SPLIT_PAGES];
    const u32 first = p0 >> KV_PAGE_SHIFT, count = (cnt + KV_PAGE - 1u) >> KV_PAGE_SHIFT;
    for (u32 i = threadIdx.x; i < count && i < SPLIT_PAGES; i += blockDim.x) pg[i] = row[first + i];
    return pg;
}

// One block's chunk: positions p0 .. p0 + cnt of the rows k and v for `heads` query heads whose
// (unscaled) queries start at q (d each); writes each head's (m, l, o) at part_o + head * ho,
// part_ml + head * hm. Dynamic shared memory: SPLIT_HEADS d + max(SPLIT_HEADS chunk,
// SPLIT_WARPS SPLIT_HEADS d) floats. d a multiple of 4, at most 128 (QQ 4, VQ 1) or 256 (QQ 8,
// VQ 2); blockDim SPLIT_THREADS. Each warp requests the rows of several positions before it
// uses them (two groups of positions a score step, VU positions an output step: 8, or 4 for heads past 128), so a few
// blocks per multiprocessor keep enough reads in flight.
template <typename Rows, u32 QQ, u32 VQ, u32 VU>
__device__ void attend_chunk(const float* __restrict__ q, Rows k, Rows v, u32 p0, u32 cnt,
                             u32 chunk, u32 heads, u32 d, float scale, float* __restrict__ part_o,
                             float* __restrict__ part_ml, u64 ho, u64 hm) {
    extern __shared__ float sm[];
    __shared__ float head_m[SPLIT_HEADS], head_l[SPLIT_HEADS];
    float* qs = sm;
    float* sc = sm + SPLIT_HEADS * d;
    for (u32 i = threadIdx.x; i < heads * d; i += blockDim.x) qs[i] = q[i] * scale;
    __syncthreads();
    const u32 quads = d / 4u, lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    // scores: lp lanes a position, each a quad at a time (a shuffle sum over the lp lanes); a
    // warp takes two groups of per_warp positions a step
    const u32 lp = pow2_at_least(quads, 8u), per_warp = 32u / lp, sub = lane & (lp - 1u);
    for (u32 b = warp * 2u * per_warp; b < cnt; b += SPLIT_WARPS * 2u * per_warp) {
        float kk[2][QQ][4];
#pragma unroll
        for (u32 g = 0; g < 2; ++g) {
            const u32 i = b + g * per_warp + lane / lp;
#pragma unroll
            for (u32 u = 0; u < QQ; ++u) {
                const u32 qd = sub + u * lp;
                if (i < cnt && qd < quads) {
                    k.load4(p0 + i, qd, kk[g][u]);
                } else {
#pragma unroll
                    for (u32 e = 0; e < 4; ++e) kk[g][u][e] = 0.0f;
                }
            }
        }
#pragma unroll
        for (u32 g = 0; g < 2; ++g) {
            const u32 i = b + g * per_warp + lane / lp;
            float acc[SPLIT_HEADS];
#pragma unroll
            for (u32 h = 0; h < SPLIT_HEADS; ++h) {
                acc[h] = 0.0f;
                if (h < heads) {
#pragma unroll
                    for (u32 u = 0; u < QQ; ++u) {
                        const u32 qd = sub + u * lp;
                        if (qd < quads) {
                            const float4 qq = reinterpret_cast<const float4*>(qs + h * d)[qd];
                            acc[h] = fmaf(qq.w, kk[g][u][3],
                                          fmaf(qq.z, kk[g][u][2],
                                               fmaf(qq.y, kk[g][u][1], fmaf(qq.x, kk[g][u][0], acc[h]))));
                        }
                    }
                }
            }
#pragma unroll
            for (u32 h = 0; h < SPLIT_HEADS; ++h)
                if (h < heads)
                    for (u32 o = lp >> 1; o > 0; o >>= 1) acc[h] += __shfl_xor_sync(0xffffffffu, acc[h], o);
            if (i < cnt && sub == 0) {
#pragma unroll
                for (u32 h = 0; h < SPLIT_HEADS; ++h)
                    if (h < heads) sc[h * chunk + i] = acc[h];
            }
        }
    }
    __syncthreads();
    // each head's maximum and sum of exponentials: a warp per head
    for (u32 h = warp; h < heads; h += SPLIT_WARPS) {
        float mx = NEG_INF;
        for (u32 i = lane; i < cnt; i += 32u) mx = fmaxf(mx, sc[h * chunk + i]);
        mx = warp_max(mx);
        float tot = 0.0f;
        for (u32 i = lane; i < cnt; i += 32u) {
            const float e = expf(sc[h * chunk + i] - mx);
            sc[h * chunk + i] = e;
            tot += e;
        }
        for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
        if (lane == 0) {
            head_m[h] = mx;
            head_l[h] = tot;
        }
    }
    __syncthreads();
    // outputs: lv lanes a position (VQ quads each), VU positions a step; the warp's positions
    // summed by shuffles, then the warps' sums in warp order
    const u32 lv = pow2_at_least(quads, 32u), vper = 32u / lv, vsub = lane & (lv - 1u);
    const u32 vstep = SPLIT_WARPS * vper;
    float acc[SPLIT_HEADS][VQ][4];
#pragma unroll
    for (u32 h = 0; h < SPLIT_HEADS; ++h)
#pragma unroll
        for (u32 u = 0; u < VQ; ++u)
#pragma unroll
            for (u32 e = 0; e < 4; ++e) acc[h][u][e] = 0.0f;
    for (u32 i0 = warp * vper + lane / lv; i0 < cnt; i0 += VU * vstep) {
        float vv[VU][VQ][4];
#pragma unroll
        for (u32 x = 0; x < VU; ++x) {
            const u32 i = i0 + x * vstep;
#pragma unroll
            for (u32 u = 0; u < VQ; ++u) {
                const u32 qd = vsub + u * lv;
                if (i < cnt && qd < quads) {
                    v.load4(p0 + i, qd, vv[x][u]);
                } else {
#pragma unroll
                    for (u32 e = 0; e < 4; ++e) vv[x][u][e] = 0.0f;
                }
            }
        }
#pragma unroll
        for (u32 x = 0; x < VU; ++x) {
            const u32 i = i0 + x * vstep;
            if (i < cnt) {
#pragma unroll
                for (u32 h = 0; h < SPLIT_HEADS; ++h) {
                    if (h < heads) {
                        const float e = sc[h * chunk + i];
#pragma unroll
                        for (u32 u = 0; u < VQ; ++u)
#pragma unroll
                            for (u32 t = 0; t < 4; ++t) acc[h][u][t] = fmaf(e, vv[x][u][t], acc[h][u][t]);
                    }
                }
            }
        }
    }
    for (u32 o = 16; o >= lv; o >>= 1) {
#pragma unroll
        for (u32 h = 0; h < SPLIT_HEADS; ++h)
            if (h < heads)
#pragma unroll
            for (u32 u = 0; u < VQ; ++u)
#pragma unroll
                for (u32 t = 0; t < 4; ++t)
                    acc[h][u][t] += __shfl_xor_sync(0xffffffffu, acc[h][u][t], o);
    }
    __syncthreads();
    // the scores are read: their room takes each warp's sums [warp][head][d]
    if (lane < lv) {
#pragma unroll
        for (u32 h = 0; h < SPLIT_HEADS; ++h) {
            if (h < heads) {
#pragma unroll
                for (u32 u = 0; u < VQ; ++u) {
                    const u32 qd = vsub + u * lv;
                    if (qd < quads) {
#pragma unroll
                        for (u32 t = 0; t < 4; ++t) sc[(warp * heads + h) * d + 4u * qd + t] = acc[h][u][t];
                    }
                }
            }
        }
    }
    __syncthreads();
    for (u32 x = threadIdx.x; x < heads * d; x += blockDim.x) {
        const u32 h = x / d, t = x % d;
        float o = 0.0f;
        for (u32 w = 0; w < SPLIT_WARPS; ++w) o += sc[(w * heads + h) * d + t];
        part_o[h * ho + t] = o;
        if (t == 0) {
            part_ml[h * hm] = head_m[h];
            part_ml[h * hm + 1] = head_l[h];
        }
    }
}

// attend_chunk for heads of d: the registers of heads to 128 where they are.
template <typename Rows>
__device__ __forceinline__ void attend_chunk_d(const float* __restrict__ q, Rows k, Rows v, u32 p0,
                                               u32 cnt, u32 chunk, u32 heads, u32 d, float scale,
                                               float* __restrict__ part_o,
                                               float* __restrict__ part_ml, u64 ho, u64 hm) {
    if (d <= 128u) {
        attend_chunk<Rows, 4, 1, 8>(q, k, v, p0, cnt, chunk, heads, d, scale, part_o, part_ml, ho, hm);
    } else {
        attend_chunk<Rows, 8, 2, 4>(q, k, v, p0, cnt, chunk, heads, d, scale, part_o, part_ml, ho, hm);
    }
}

// Where a split block works: block x = (row r, local kv head, chunk c of hpb of its query heads,
// 1 <= hpb <= SPLIT_HEADS), block y = chunk of positions s; the query heads j0 .. j0 + heads
// (local) read that kv head. False for a block with no work (positions past the row's length,
// heads past the group's). A head's sums do not depend on hpb: the host takes fewer heads a block
// where few rows would leave most multiprocessors idle (`spread`: their count), and a row long
// enough to fill them with its chunks takes SPLIT_HEADS again.
struct SplitPlace {
    u32 r, kv, j0, heads, p0, cnt, s;
};
__device__ __forceinline__ bool split_place(const u32* poss, u32 n, u32 qh, u32 kvh, u32 chunk,
                                            u32 q_base, u32 group, u32 kv_base, u32 hpb,
                                            u32 spread, SplitPlace& at) {
    const u32 per = (group + hpb - 1u) / hpb;
    const u32 x = blockIdx.x;
    at.r = x / (kvh * per);
    at.kv = (x / per) % kvh;
    const u32 c = x % per;
    if (at.r >= n) return false;
    const u32 len = poss[at.r] + 1u;
    at.s = blockIdx.y;
    at.p0 = at.s * chunk;
    if (at.p0 >= len) return false;
    at.cnt = min(chunk, len - at.p0);
    // a row whose chunks alone give every multiprocessor a block (`spread` blocks, counted as
    // if every row were as long) takes up to SPLIT_HEADS heads a block, so each K / V row is
    // read once for them; the grid's other blocks of its kv head then have none
    const u32 used = (len + chunk - 1u) / chunk;
    const u32 take = (n * kvh * used >= spread) ? max(hpb, (u32)SPLIT_HEADS) : hpb;
    // the group's query heads (global), on this rank from q_base
    const u32 g0 = (at.kv + kv_base) * group + c * take;
    const u32 g1 = min((at.kv + kv_base) * group + group, g0 + take);
    const u32 lo = max(g0, q_base), hi = min(g1, q_base + qh);
    if (lo >= hi) return false;
    at.j0 = lo - q_base;
    at.heads = hi - lo;
    return true;
}

template <typename T>
__device__ void attention_split_t(const float* __restrict__ q, const T* __restrict__ kc,
                                  const T* __restrict__ vc, const u32* __restrict__ seqs,
                                  const u32* __restrict__ poss, float* __restrict__ part_o,
                                  float* __restrict__ part_ml, u32 n, u32 qh, u32 kvh, u32 d,
                                  const u32* __restrict__ pages, u32 pps, u32 q_base, u32 group,
                                  u32 kv_base, float scale, u32 chunk, u32 splits, u32 hpb,
                                  u32 spread) {
    SplitPlace at;
    if (!split_place(poss, n, qh, kvh, chunk, q_base, group, kv_base, hpb, spread, at)) return;
    const u64 stride = (u64)kvh * d;
    const u64 base = (u64)at.kv * d;
    const u32* pg = chunk_pages(pages + (u64)seqs[at.r] * pps, at.p0, at.cnt);
    const u32 first = at.p0 >> KV_PAGE_SHIFT;
    const u64 head0 = (u64)at.r * qh + at.j0;
    attend_chunk_d(q + head0 * d, PlainQuads<T>{kc + base, stride, pg, first},
                   PlainQuads<T>{vc + base, stride, pg, first},
                 at.p0, at.cnt, chunk, at.heads, d, scale,
                 part_o + (head0 * splits + at.s) * d, part_ml + (head0 * splits + at.s) * 2u,
                 (u64)splits * d, (u64)splits * 2u);
}

#define ATTENTION_SPLIT(NAME, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(SPLIT_THREADS) NAME(                               \
        const float* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,            \
        const u32* __restrict__ seqs, const u32* __restrict__ poss, float* __restrict__ part_o,     \
        float* __restrict__ part_ml, u32 n, u32 qh, u32 kvh, u32 d, const u32* __restrict__ pages,  \
        u32 pps, u32 q_base, u32 group, u32 kv_base, float scale, u32 chunk, u32 splits, u32 hpb,   \
        u32 spread) {                                                                               \
        attention_split_t<T>(q, kc, vc, seqs, poss, part_o, part_ml, n, qh, kvh, d, pages, pps,     \
                             q_base, group, kv_base, scale, chunk, splits, hpb, spread);            \
    }
ATTENTION_SPLIT(attention_split, float)
ATTENTION_SPLIT(attention_split_bf16, u16)

// attention_split over the fp8 caches' records (d e4m3 bytes, then the f32 scale).
extern "C" __global__ void __launch_bounds__(SPLIT_THREADS) attention_split_fp8(
    const float* __restrict__ q, const u8* __restrict__ kc, const u8* __restrict__ vc,
    const u32* __restrict__ seqs, const u32* __restrict__ poss, float* __restrict__ part_o,
    float* __restrict__ part_ml, u32 n, u32 qh, u32 kvh, u32 d, const u32* __restrict__ pages,
    u32 pps, u32 q_base, u32 group, u32 kv_base, float scale, u32 chunk, u32 splits, u32 hpb,
    u32 spread) {
    SplitPlace at;
    if (!split_place(poss, n, qh, kvh, chunk, q_base, group, kv_base, hpb, spread, at)) return;
    const u32 rec = d + 4u;
    const u64 stride = (u64)kvh * rec;
    const u64 base = (u64)at.kv * rec;
    const u32* pg = chunk_pages(pages + (u64)seqs[at.r] * pps, at.p0, at.cnt);
    const u32 first = at.p0 >> KV_PAGE_SHIFT;
    const u64 head0 = (u64)at.r * qh + at.j0;
    attend_chunk_d(q + head0 * d, Fp8Quads{kc + base, stride, d, pg, first},
                   Fp8Quads{vc + base, stride, d, pg, first},
                 at.p0, at.cnt, chunk, at.heads, d, scale,
                 part_o + (head0 * splits + at.s) * d, part_ml + (head0 * splits + at.s) * 2u,
                 (u64)splits * d, (u64)splits * 2u);
}

// One block per (row r, local query head j) (of the padded rows where quantising): joins the
// row's ceil(len / chunk) chunks of attention_split in chunk order, o = sum_s e_s o_s / sum_s
// e_s l_s with e_s = exp(m_s - max m), split into out [2n x qh x d] as attend's, and with qz.q
// (d = 128, blockDim 128) quantised for o's W8A8 product. blockDim: d rounded up to 32.
extern "C" __global__ void attention_join(const float* __restrict__ part_o,
                                          const float* __restrict__ part_ml,
                                          const u32* __restrict__ poss, u16* __restrict__ out,
                                          u32 n, u32 qh, u32 d, u32 chunk, u32 splits,
                                          unsigned char* aq, float* asc, u32 sc_tok, u32 sc_grp,
                                          u32 tiles) {
    const AttnQuant qz{aq, asc, sc_tok, sc_grp, tiles};
    const u32 row = blockIdx.x, r = row / qh, j = row % qh;
    if (r >= n) {
        pad_head(r, j, qh * d, qz);
        return;
    }
    const u32 len = poss[r] + 1u, used = (len + chunk - 1u) / chunk;
    const float* ml = part_ml + (u64)row * splits * 2u;
    float mx = NEG_INF;
    for (u32 s = 0; s < used; ++s) mx = fmaxf(mx, ml[2u * s]);
    float tot = 0.0f;
    for (u32 s = 0; s < used; ++s) tot += expf(ml[2u * s] - mx) * ml[2u * s + 1u];
    const u32 t = threadIdx.x;
    const bool mine = t < d;
    float joined = 0.0f;
    if (mine) {
        const float* po = part_o + (u64)row * splits * d + t;
        float o = 0.0f;
        for (u32 s = 0; s < used; ++s) o += expf(ml[2u * s] - mx) * po[(u64)s * d];
        joined = split_store(out, (u64)row * d + t, (u64)n * qh * d, o / tot);
    }
    if (qz.q != nullptr) quant_head(joined, mine, t, r, j, qh * d, qz);
}

// Copies blocks of old_block 2-byte units to a buffer with blocks of new_block units (cache
// growth; a unit is half an f32 element or one bf16 element).
extern "C" __global__ void grow_blocks(const u16* __restrict__ src, u16* __restrict__ dst,
                                       u64 blocks, u64 old_block, u64 new_block) {
    u64 total = blocks * old_block;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 b = i / old_block, e = i % old_block;
        dst[b * new_block + e] = src[i];
    }
}

extern "C" __global__ void argmax_rows(const float* __restrict__ x, u32* __restrict__ out, u32 cols) {
    __shared__ float bv[256];
    __shared__ u32 bi[256];
    const float* row = x + (u64)blockIdx.x * cols;
    float best = NEG_INF;
    u32 idx = 0;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = row[c];
        if (v > best) { best = v; idx = c; }
    }
    bv[threadIdx.x] = best;
    bi[threadIdx.x] = idx;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = bv[threadIdx.x + s];
            u32 oi = bi[threadIdx.x + s];
            if (ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bi[threadIdx.x])) {
                bv[threadIdx.x] = ov;
                bi[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = bi[0];
}

// out[i, r * part + c] = g[r, i, c]: vocabulary-parallel logits [T][m][part] -> [m][T * part].
extern "C" __global__ void unshard(const float* __restrict__ g, float* __restrict__ out,
                                   u32 tp, u32 m, u32 part) {
    u64 total = (u64)tp * m * part;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 c = i % part, rest = i / part;
        u64 row = rest % m, r = rest / m;
        out[row * ((u64)tp * part) + r * part + c] = g[i];
    }
}

// out[row, col] = g[col / part][row][col % part] for col < vocab: per-rank logits [T][m][part]
// whose rows past the real vocabulary are padding -> [m][vocab]. Padding columns are dropped, so
// they can never be picked (the host mirror is `vocab::gather_vocab`).
extern "C" __global__ void gather_vocab(const float* __restrict__ g, float* __restrict__ out,
                                        u32 m, u32 part, u32 vocab) {
    u64 total = (u64)m * vocab;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 row = i / vocab, col = i % vocab;
        u64 r = col / part, c = col % part;
        out[i] = g[(r * m + row) * part + c];
    }
}

// The paged KV cache [blocks][pages][KV_PAGE][width] in 2-byte units (block = layer x {k, v};
// a block block_units long; width in units): for each pair f, page pairs[2f] is copied to page
// pairs[2f + 1] in every block (a forked sequence's pages that it does not share with its
// leader; no page is both a source and a destination).
extern "C" __global__ void copy_pages(u16* __restrict__ cache, const u32* __restrict__ pairs,
                                      u32 count, u32 blocks, u64 block_units, u32 width) {
    const u64 per = (u64)KV_PAGE * width;
    const u64 total = (u64)count * blocks * per;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 f = i / ((u64)blocks * per);
        const u64 rem = i % ((u64)blocks * per);
        const u64 b = rem / per, e = rem % per;
        const u64 base = b * block_units;
        cache[base + (u64)pairs[2 * f + 1] * per + e] = cache[base + (u64)pairs[2 * f] * per + e];
    }
}

// The pick of lifecycle_decoder::pick (models/decoder/src/rollout/pick.rs) in f32, one block of
// PICK_THREADS threads per row. picks[4 r ..] = (temperature, top_k, top_p, uniform) of row r
// (f32 bits but top_k, a u32; 0 keeps every token); out[r] = the token, out[m + r], out[2m + r],
// out[3m + r] = the bits of its log-probabilities at the temperature, at T = 1 and in the
// truncated distribution. The kept set's thresholds are exact keys found by radix selection
// (four passes of 8 bits over order-preserving keys): top-k by counts, top-p by mass summed in
// 2^-44 fixed point (integer sums, so every run sums the same whatever the order of the
// atomics); the draw walks the kept tokens in index order (contiguous chunks per thread, then
// the chunk that holds u * the kept weight). Every sum is a fixed tree: a row's result depends
// only on its logits and its pick.
#define PICK_THREADS 512
#define MASS_ONE 17592186044416.0  // 2^44

__device__ __forceinline__ u32 order_key(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The key of the k-th largest of row's values whose key is at least `floor` (counts), or, with
// `w_scale` > 0, the key at which the running mass of the values from the largest down first
// reaches `target` (mass of value v: exp((v - mx) * w_scale) in fixed point).
__device__ u32 radix_select(const float* __restrict__ row, u32 cols, u32 floor, u64 target,
                            float mx, float t, bool by_mass, u64* hist, u32* shared_u) {
    u32 prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (u32 c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = row[c];
            u32 key = order_key(v);
            if (key >= floor && (key & mask) == prefix) {
                u64 add = by_mass ? (u64)((double)expf((v - mx) / t) * MASS_ONE) : 1ull;
                atomicAdd(&hist[(key >> shift) & 255u], add);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u32 digit = 0;
            for (int b = 255; b >= 0; --b) {
                if (hist[b] >= target) { digit = (u32)b; break; }
                target -= hist[b];
            }
            shared_u[0] = digit;
            // the remaining target rides in hist[256] (past the bins)
            hist[256] = target;
        }
        __syncthreads();
        prefix |= shared_u[0] << shift;
        mask |= 255u << shift;
        target = hist[256];
        __syncthreads();
    }
    return prefix;
}

extern "C" __global__ void __launch_bounds__(PICK_THREADS) pick_rows(
    const float* __restrict__ x, const u32* __restrict__ picks, u32* __restrict__ out, u32 cols,
    u32 m) {
    __shared__ float red[32];
    __shared__ float bv[PICK_THREADS];
    __shared__ u32 bi[PICK_THREADS];
    __shared__ u64 hist[257];
    __shared__ u32 shared_u[1];
    __shared__ float part[PICK_THREADS];
    const u32 r = blockIdx.x;
    const float* row = x + (u64)r * cols;
    const float temp = __uint_as_float(picks[4 * r]);
    const u32 top_k = picks[4 * r + 1];
    const float top_p = __uint_as_float(picks[4 * r + 2]);
    const float uni = __uint_as_float(picks[4 * r + 3]);
    // the largest value and its index (the lowest on ties)
    float best = NEG_INF;
    u32 idx = 0;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = row[c];
        if (v > best) { best = v; idx = c; }
    }
    bv[threadIdx.x] = best;
    bi[threadIdx.x] = idx;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = bv[threadIdx.x + s];
            u32 oi = bi[threadIdx.x + s];
            if (ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bi[threadIdx.x])) {
                bv[threadIdx.x] = ov;
                bi[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    const float mx = bv[0];
    const u32 am = bi[0];
    float s1 = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) s1 += expf(row[c] - mx);
    const float lse1 = mx + logf(block_sum(s1, red));
    if (!(temp > 0.0f)) {
        if (threadIdx.x == 0) {
            float lp = row[am] - lse1;
            out[r] = am;
            out[m + r] = __float_as_uint(lp);
            out[2 * m + r] = __float_as_uint(lp);
            out[3 * m + r] = __float_as_uint(0.0f);
        }
        return;
    }
    float st = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) st += expf((row[c] - mx) / temp);
    const float lse = logf(block_sum(st, red));
    u32 floor = 0;
    if (top_k > 0 && top_k < cols) {
        floor = radix_select(row, cols, 0, top_k, mx, temp, false, hist, shared_u);
    }
    if (top_p < 1.0f) {
        u64 mass = 0;
        // the candidates' mass in fixed point: per-thread sums, then a fixed order over threads
        for (u32 c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = row[c];
            if (order_key(v) >= floor) mass += (u64)((double)expf((v - mx) / temp) * MASS_ONE);
        }
        __shared__ u64 masses[PICK_THREADS];
        masses[threadIdx.x] = mass;
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 total = 0;
            for (u32 t = 0; t < blockDim.x; ++t) total += masses[t];
            u64 target = (u64)((double)top_p * (double)total);
            masses[0] = target > 0 ? target : 1;
        }
        __syncthreads();
        u64 target = masses[0];
        __syncthreads();
        u32 pk = radix_select(row, cols, floor, target, mx, temp, true, hist, shared_u);
        floor = max(floor, pk);
    }
    // the kept weight per thread's contiguous chunk, then the chunk that holds the draw
    const u32 chunk = (cols + blockDim.x - 1) / blockDim.x;
    const u32 lo = threadIdx.x * chunk, hi = min(cols, lo + chunk);
    float sum = 0.0f;
    for (u32 c = lo; c < hi; ++c) {
        float v = row[c];
        if (order_key(v) >= floor) sum += expf((v - mx) / temp);
    }
    part[threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (u32 t = 0; t < blockDim.x; ++t) total += part[t];
        float target = uni * total, run = 0.0f;
        // the argmax where rounding leaves nothing picked, else the chunk's last kept token
        u32 res = am;
        for (u32 t = 0; t < blockDim.x; ++t) {
            if (run + part[t] <= target) { run += part[t]; continue; }
            u32 a = t * chunk, b = min(cols, a + chunk);
            for (u32 c = a; c < b; ++c) {
                float v = row[c];
                if (order_key(v) < floor) continue;
                res = c;
                run += expf((v - mx) / temp);
                if (run > target) break;
            }
            break;
        }
        float z = (row[res] - mx) / temp;
        out[r] = res;
        out[m + r] = __float_as_uint(z - lse);
        out[2 * m + r] = __float_as_uint(row[res] - lse1);
        out[3 * m + r] = __float_as_uint(z - logf(total));
    }
}

// Copies n 32-bit words into dst, which may be mapped host memory: downloads written by the SMs
// never queue behind copy-engine work (the device-to-host copies of an offload running beside
// the rollout are served first come, first served).
extern "C" __global__ void copy_words(const u32* __restrict__ src, u32* __restrict__ dst, u64 n) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}

// ---- W8A8 activations (models/decoder-gpu/src/w8a8/quant.rs) --------------------------------
//
// Rows of n x inp values quantised per token in groups of 128 columns, as
// lifecycle_layout::fp8::quantize_activation_groups: scale_inv = amax / 448 (1 for an all-zero
// group, NaN once a value is not finite), byte = e4m3(v / scale_inv), the divisions IEEE-exact.
// The bytes go to q [n_pad x inp] (tokens n .. n_pad zero: bytes 0, scale 1), the scales to
// sc[t * sc_tok + g * sc_grp], and where deq is not null the dequantised values
// e4m3(byte) * scale_inv to deq [n x inp]. With tiles > 0 (n_pad = 8 tiles, inp a multiple of
// 128) the bytes lie as the warpgroup W8A8 kernel stages them (kernels/w8a8_mma.cu): per group,
// its 32 input words w as core matrix w & 7 of 8 tokens x 16 bytes, word w >> 3 of its row, the
// core matrices of the token tiles next to each other (tiled_offset). The quantisation kernels
// live here, in the exact module, so that the ones fused into the norm and the SwiGLU see the
// bits those kernels write.

// The value of an e4m3 byte (0x7f / 0xff, NaN, never appear in a quantised activation).
__device__ __forceinline__ float e4m3_val(u32 b) {
    u32 e = (b >> 3) & 15u, m = b & 7u;
    float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
    return (b & 0x80u) ? -v : v;
}

// The e4m3 byte of v (round to nearest even; |v| <= 448 after a group's scaling, NaN stays NaN):
// the hardware conversion on sm_89 and later, else by integers as lifecycle_layout's
// e4m3_from_f32.
__device__ __forceinline__ u32 e4m3_rn(float v) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
    return (u32)(r & 0xffu);
#else
    u32 bits = __float_as_uint(v), sign = (bits >> 24) & 0x80u, mag = bits & 0x7fffffffu, b;
    if (mag >= (1087u << 20)) {
        b = 0x7fu;
    } else if (mag < (121u << 23)) {
        b = (__float_as_uint(__uint_as_float(mag) + __uint_as_float(141u << 23)) - (141u << 23)) & 0xffu;
    } else {
        b = ((mag + (((u32)(7 - 127)) << 23) + 0x7ffffu + ((mag >> 20) & 1u)) >> 20) & 0xffu;
    }
    return b | sign;
#endif
}


// Byte c of group g of token t in the warpgroup kernel's layout of `tiles` token tiles.
__device__ __forceinline__ u64 tiled_offset(u32 t, u32 g, u32 c, u32 tiles) {
    const u32 word = c >> 2;
    return (u64)g * (1024u * tiles) + ((word & 7u) * tiles + (t >> 3)) * 128u + (t & 7u) * 16u +
           4u * (word >> 3) + (c & 3u);
}

// The group of columns g * 128 + 32 k + lane (k < 4) of token t a warp holds in v (0 where
// absent: past inp, or t >= n) quantised and stored.
__device__ __forceinline__ void quant_group(const float (&v)[4], u32 t, u32 g, u32 n, u32 inp,
                                            unsigned char* q, float* sc, u32 sc_tok, u32 sc_grp,
                                            float* deq, u32 tiles) {
    const u32 lane = threadIdx.x & 31u;
    float amax = 0.0f;
    bool bad = false;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        bad |= (__float_as_uint(v[k]) & 0x7f800000u) == 0x7f800000u;
        amax = fmaxf(amax, fabsf(v[k]));
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    bad = __any_sync(0xffffffffu, bad);
    float s = bad ? __int_as_float(0x7fc00000) : (amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f);
    if (sc && lane == 0) sc[(u64)t * sc_tok + (u64)g * sc_grp] = s;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 c = g * 128 + 32 * k + lane;
        if (c < inp) {
            u64 i = (u64)t * inp + c;
            u32 b = e4m3_rn(__fdiv_rn(v[k], s));
            if (q) q[tiles ? tiled_offset(t, g, c - g * 128, tiles) : i] = (unsigned char)b;
            if (deq && t < n) deq[i] = e4m3_val(b) * s;
        }
    }
}

// quant_group over the 128 values v of one attention block's threads 0 .. 127 (`mine`; every
// thread of the block calls it): group grp of token row of an input `inp` wide.
__device__ void quant_head(float v, bool mine, u32 t, u32 row, u32 grp, u32 inp, AttnQuant qz) {
    __shared__ float amaxes[32];
    __shared__ u32 bads[32];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    float a = mine ? fabsf(v) : 0.0f;
    bool bad = mine && (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, d));
    bad = __any_sync(0xffffffffu, bad);
    if (lane == 0) {
        amaxes[warp] = a;
        bads[warp] = bad ? 1u : 0u;
    }
    __syncthreads();
    if (!mine) return;
    float amax = 0.0f;
    u32 any_bad = 0u;
#pragma unroll
    for (u32 w = 0; w < 4; ++w) {
        amax = fmaxf(amax, amaxes[w]);
        any_bad |= bads[w];
    }
    const float s = any_bad ? __int_as_float(0x7fc00000) : (amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f);
    if (t == 0) qz.sc[(u64)row * qz.sc_tok + (u64)grp * qz.sc_grp] = s;
    const u64 at = qz.tiles ? tiled_offset(row, grp, t, qz.tiles) : (u64)row * inp + grp * 128u + t;
    qz.q[at] = (unsigned char)e4m3_rn(__fdiv_rn(v, s));
}

// A padded token's group grp, as quant_group writes it: zero bytes, unit scale.
__device__ void pad_head(u32 row, u32 grp, u32 inp, AttnQuant qz) {
    const u32 t = threadIdx.x;
    if (t < 128u) {
        const u64 at = qz.tiles ? tiled_offset(row, grp, t, qz.tiles) : (u64)row * inp + grp * 128u + t;
        qz.q[at] = 0;
    }
    if (t == 0) qz.sc[(u64)row * qz.sc_tok + (u64)grp * qz.sc_grp] = 1.0f;
}

// The quantised value of element i of the split bf16 rows (hi rows 0 .. n, lo rows from len).
struct SplitRows {
    const u16* xs;
    u64 len;
    __device__ __forceinline__ float at(u64 i) const { return bf(xs[i]) + bf(xs[len + i]); }
};

// ... of f32 rows.
struct F32Rows {
    const float* x;
    __device__ __forceinline__ float at(u64 i) const { return x[i]; }
};

// One warp per (token, group) of n_pad >= n tokens, lane l reading columns l, l + 32, l + 64,
// l + 96 of the group from `src`; zeros over zero[0 .. nzero] (the lo rows of the product's
// output, which the block-scaled GEMM does not write), grid-strided.
// Grid: ceil(n_pad * groups / 8) blocks of 256 threads.
template <class Src>
__device__ __forceinline__ void quant_groups(Src src, u32 n, u32 n_pad, u32 inp,
                                             unsigned char* q, float* sc, u32 sc_tok,
                                             u32 sc_grp, float* deq, float* zero, u64 nzero,
                                             u32 tiles) {
    if (zero) {
        for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < nzero; i += (u64)gridDim.x * blockDim.x) {
            zero[i] = 0.0f;
        }
    }
    u32 groups = (inp + 127) / 128;
    u64 wid = (blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5;
    u32 lane = threadIdx.x & 31u;
    if (wid >= (u64)n_pad * groups) return;
    u32 t = (u32)(wid / groups), g = (u32)(wid % groups);
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 c = g * 128 + 32 * k + lane;
        v[k] = (c < inp && t < n) ? src.at((u64)t * inp + c) : 0.0f;
    }
    quant_group(v, t, g, n, inp, q, sc, sc_tok, sc_grp, deq, tiles);
}

// From split bf16 rows xs [2n x inp].
extern "C" __global__ void __launch_bounds__(256) fp8_quant_split(
    const u16* __restrict__ xs, u32 n, u32 n_pad, u32 inp, unsigned char* q, float* sc,
    u32 sc_tok, u32 sc_grp, float* deq, float* zero, u64 nzero, u32 tiles) {
    let_next_grid_start();
    wait_for_inputs();
    quant_groups(SplitRows{xs, (u64)n * inp}, n, n_pad, inp, q, sc, sc_tok, sc_grp, deq, zero,
                 nzero, tiles);
}

// From f32 rows x [n x inp] (deq may be x itself).
extern "C" __global__ void __launch_bounds__(256) fp8_quant_f32(
    const float* x, u32 n, u32 n_pad, u32 inp, unsigned char* q, float* sc, u32 sc_tok,
    u32 sc_grp, float* deq, float* zero, u64 nzero, u32 tiles) {
    let_next_grid_start();
    wait_for_inputs();
    quant_groups(F32Rows{x}, n, n_pad, inp, q, sc, sc_tok, sc_grp, deq, zero, nzero, tiles);
}

// swiglu_split (out, split, [2n x f]) and the quantisation of its output (no deq, no zeros),
// in one launch of fp8_quant_split's grid (n_pad tokens of f columns). Without `lo` the lo rows
// of g2 and u2 are taken as zeros, unread (W8A8 products of gate and up leave them unwritten);
// without `out` (null) the split output is not written, only quantised (as if it were).
extern "C" __global__ void __launch_bounds__(256) swiglu_quant(
    const float* __restrict__ g2, const float* __restrict__ u2, u16* __restrict__ out, u32 n,
    u32 n_pad, u32 f, unsigned char* q, float* sc, u32 sc_tok, u32 sc_grp, u32 tiles, u32 lo) {
    let_next_grid_start();
    wait_for_inputs();
    // as quant_groups over SiLU(gate) * up of the split products g2, u2 [2n x f], each value
    // first split into out [2n x f] as swiglu_split writes it (its hi + lo quantised, as from
    // that output); every value's four loads are requested before the first value is stored
    // (value by value, a store that may alias the next value's loads made each value a round
    // trip of its own)
    const u32 groups = (f + 127) / 128;
    const u64 wid = (blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5;
    const u32 lane = threadIdx.x & 31u;
    if (wid >= (u64)n_pad * groups) return;
    const u32 t = (u32)(wid / groups), g = (u32)(wid % groups);
    const u64 len = (u64)n * f;
    float gh[4], gl[4], uh[4], ul[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const u32 c = g * 128 + 32 * k + lane;
        const bool ok = c < f && t < n;
        const u64 i = (u64)t * f + c;
        gh[k] = ok ? g2[i] : 0.0f;
        gl[k] = ok && lo ? g2[len + i] : 0.0f;
        uh[k] = ok ? u2[i] : 0.0f;
        ul[k] = ok && lo ? u2[len + i] : 0.0f;
    }
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const u32 c = g * 128 + 32 * k + lane;
        v[k] = 0.0f;
        if (c < f && t < n) {
            const float gv = gh[k] + gl[k];
            const float uv = uh[k] + ul[k];
            v[k] = split_store(out, (u64)t * f + c, len, gv / (1.0f + expf(-gv)) * uv);
        }
    }
    quant_group(v, t, g, n, f, q, sc, sc_tok, sc_grp, nullptr, tiles);
}

// rms_norm_split (rows r < m of out, as it writes them) and the quantisation of its output, in
// one launch of n_pad >= m blocks of 256 threads and 4 h bytes of dynamic shared memory
// (4 h <= 48 KiB): a block normalises its row, keeps each value's hi + lo in shared
// memory, then its warps quantise the row's groups; blocks from m on write the padded tokens'
// zero bytes and unit scales.
extern "C" __global__ void __launch_bounds__(256)
    rms_norm_quant(const float* __restrict__ x, const u16* __restrict__ w, u16* __restrict__ out,
                   u32 m, u32 n_pad, u32 h, float eps, unsigned char* q, float* sc, u32 sc_tok,
                   u32 sc_grp, u32 tiles) {
    let_next_grid_start();
    wait_for_inputs();
    extern __shared__ float row[];
    const u32 r = blockIdx.x;
    if (r < m) {
        rms_norm_row(x + (u64)r * h, w, out, r, m, h, eps, row);
        __syncthreads();
    }
    const u32 lane = threadIdx.x & 31u, warps = blockDim.x >> 5;
    for (u32 g = threadIdx.x >> 5; g < (h + 127) / 128; g += warps) {
        float v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            u32 c = g * 128 + 32 * k + lane;
            v[k] = (c < h && r < m) ? row[c] : 0.0f;
        }
        quant_group(v, r, g, m, h, q, sc, sc_tok, sc_grp, nullptr, tiles);
    }
}
