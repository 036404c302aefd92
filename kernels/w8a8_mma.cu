// W8A8 block-fp8 products of a few tokens (decode steps, short prefills) on the tensor cores,
// launched by models/decoder-gpu/src/w8a8/mma.rs, which states each launch's grid, block, shared
// memory and argument contract.
//
//   y[t * out + o] = sum over the 128-wide input groups g of
//                    ws(row0 + o, g) * xs(t, g) * sum_{c in g} qw(row0 + o, c) * qx(t, c)
//
// qw: e4m3 weights, row-major [.. x inp] (inp a multiple of 128), one f32 scale per 128 x 128
// block (ws, row-major [.. x inp / 128]); qx: e4m3 activations [tokens x inp], one f32 scale per
// token and group at xsc[g * xs_grp + t]. Each group's sum is taken by four m16n8k32 e4m3 mma's
// into a fresh f32 fragment, then scaled and added to the accumulator (the promotion of
// DeepSeek-V3's fp8 GEMMs): the tensor cores never sum more than one group.
//
// A block of 4 warps computes 64 rows (16 per warp, the mma's M) for every token (8 per mma,
// NT mma's), over a slice of the input groups (Place below): it stages the slice's activations in
// shared memory a chunk of groups at a time, and each warp streams its rows' weights from device
// memory once, 128 bytes per row and group, the next group requested before the current one is
// multiplied. With several slices each block writes its partial sums, and the
// slices are added in their order: with `counters` by the last block of a row range to finish
// (counted there, reset by it; cheap for a few tokens), else by w8a8_reduce, launched next, every
// output by its own thread (one block adding a row range's 28 slices alone took ~44 us at 64
// tokens), or (the warpgroup kernel launched in clusters) by the cluster of the row range's
// slices through their shared memory, each block a share of the outputs. Every way the result
// does not depend on the order in which the blocks ran, and is the same. With
// zero_lo the n rows after y's (the lo rows of a split product) are written 0. With `bias` (bf16,
// one per row) and `res` (f32, as y: it may be y itself) each output is (sum + bias) + res, as
// the decoder's combine kernel would add them: the product then writes the layer's own buffer.
//
// The same kernel multiplies bf16 weights (bf16_mma_N below): a 128-byte group is then 64
// inputs, summed by four m16n8k16 bf16 mma's straight into the accumulator (no scales), and its
// activations are the decoder's split rows (x = hi + lo, each bf16: hi rows, then lo rows), staged
// as the mma's columns 2 t (token t's hi) and 2 t + 1 (its lo), so that a lane's two columns of a
// fragment are one token's halves: the kernel adds them (hi + lo) before anything is written.
// Every `inp` of the kernels below counts a row's bytes (a bf16 row's is twice its inputs).
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned char u8;
typedef unsigned short u16;

#define MMA_WARPS 4
#define MMA_ROWS (16 * MMA_WARPS)
// 16-byte units of activations a thread of the mma.sync kernel loads before it stores them
// (a block of 128 threads stages 8 a thread: 8 NT tokens of STAGE_BYTES / (2048 NT) groups)
#define STAGE_UNITS 4
// outputs a thread of a split product's last block adds at a time (8 tokens of a block's rows:
// 4 a thread in both kernels)
#define REDUCE_HELD 2

// The products of one launch (up to MAX_PRODS, of one input: q, k and v; gate and up; with
// bf16, a LoRA group's A matrices riding beside them): each its weight rows row0 .. row0 + out
// of w (scales wsc), output y [n x out] with bias and res as below, and `blocks` row blocks of
// the grid, the products' blocks one after the other along blockIdx.x
// (models/decoder-gpu/src/w8a8/mma.rs, ProdsArg, lays out the same struct).
#define MAX_PRODS 6
struct Prod {
    const u8* w;
    const float* wsc;
    float* y;
    const u16* bias;
    const float* res;
    u32 row0, out, blocks, pad;
};
struct Prods {
    Prod p[MAX_PRODS];
    u32 count, pad;
};

// Where a block works: row block `rb` of the launch, over slice `s` of the `splits` slices of
// its inputs; a split row block's partial sums and counter are the `pb`-th of the launch's
// (models/decoder-gpu/src/w8a8/mma.rs, MmaShape, lays the grids out so).
struct Place {
    u32 rb, pb, s, splits;
};

// The mma.sync kernels' grids: row block blockIdx.x, slice blockIdx.y of gridDim.y.
__device__ __forceinline__ Place place_2d() {
    return Place{blockIdx.x, blockIdx.x, blockIdx.y, gridDim.y};
}

// The warpgroup kernel's grid: the first `whole` blocks each a row block of its own over every
// input, then `splits` blocks for each row block after them, its slices in order (the row blocks
// that fill the SMs unsplit, the rest split so that their blocks fill them after).
__device__ __forceinline__ Place place_1d(u32 whole, u32 splits) {
    const u32 b = blockIdx.x;
    if (b < whole) return Place{b, 0u, 0u, 1u};
    const u32 j = b - whole, q = j / splits;
    return Place{whole + q, q, j - q * splits, splits};
}

// The product of row block b of the launch, and b's place among that product's row blocks.
__device__ __forceinline__ Prod pick(const Prods& ps, u64 b, u32& local) {
    Prod p = ps.p[0];
#pragma unroll
    for (u32 i = 1; i < MAX_PRODS; ++i) {
        if (i < ps.count && b >= p.blocks) {
            b -= p.blocks;
            p = ps.p[i];
        }
    }
    local = (u32)b;
    return p;
}

// d += A (16 x 32 e4m3, row) * B (32 x 8 e4m3, col) in f32. The host launches these kernels only
// on devices of compute capability 8.9 or later.
__device__ __forceinline__ void mma_e4m3(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
#if __CUDA_ARCH__ >= 890
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// d += A (16 x 16 bf16, row) * B (16 x 8 bf16, col) in f32 (compute capability 8.0 on).
__device__ __forceinline__ void mma_bf16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// One mma step of either kind: e4m3 (k 32) or, with BF16, bf16 (k 16) over the same registers.
template <bool BF16>
__device__ __forceinline__ void mma_step(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
    if (BF16) {
        mma_bf16(d, a0, a1, a2, a3, b0, b1);
    } else {
        mma_e4m3(d, a0, a1, a2, a3, b0, b1);
    }
}

// The 4 x 16 weight bytes lane (g, t) of a warp multiplies in one group: 32 consecutive bytes
// of row g of the tile and 32 of row g + 8, from byte 32 t of the group. The mma's k order is
// a permutation of the group's inputs (the same for the weights and the activations), so each
// lane reads consecutive bytes: step s takes bytes 8 s .. 8 s + 3 of a lane's 32 as the
// fragment's inputs 4 t .. 4 t + 3 and bytes 8 s + 4 .. 8 s + 7 as 16 + 4 t .. 16 + 4 t + 3.
// (bf16: step s takes a lane's inputs 4 s, 4 s + 1 as the fragment's 2 t, 2 t + 1 and 4 s + 2,
// 4 s + 3 as 8 + 2 t, 9 + 2 t: the same registers.)
struct Frag {
    uint4 lo0, lo1, hi0, hi1;
};

// 16 weight bytes, read once: not kept in L1.
__device__ __forceinline__ uint4 ld_stream(const u8* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ Frag load_frag(const u8* lo, const u8* hi, bool oklo, bool okhi) {
    Frag f;
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    f.lo0 = oklo ? ld_stream(lo) : z;
    f.lo1 = oklo ? ld_stream(lo + 16) : z;
    f.hi0 = okhi ? ld_stream(hi) : z;
    f.hi1 = okhi ? ld_stream(hi + 16) : z;
    return f;
}

// The warpgroup kernel's weights come through a ring in shared memory (WRing below): a warp has
// requested W_STAGES - 1 groups ahead of the one it multiplies (with 128-row blocks of up to 64
// tokens the loads of one group ahead in registers streamed at 1.3-2.2 TB/s on an H200); the ring
// takes W_STAGES x 2 KiB a warp of the block's dynamic shared memory, after the activations (the
// host counts it: WEIGHT_STAGES in models/decoder-gpu/src/w8a8/mma.rs). The mma.sync kernel
// loads its weights straight into registers (through the ring it was slower at 1-8 tokens).
#ifndef W_STAGES
#define W_STAGES 3
#endif

// 16 bytes from global to shared memory, asynchronously, bypassing L1 (zeros where !ok: no byte
// read). Compiled for compute capability 8.0 and later only (the host launches these kernels
// from 8.9).
__device__ __forceinline__ void cp_async16(u32 dst, const u8* src, bool ok) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(ok ? 16u : 0u)
                 : "memory");
#endif
}

// the same with the bytes to read given (16, or 0: zeros, no byte read)
__device__ __forceinline__ void cp_async_n(u32 dst, const u8* src, u32 bytes) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(bytes)
                 : "memory");
#endif
}

__device__ __forceinline__ void cp_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// this warp's copies but the last W_STAGES - 2 groups of them landed, visible to the whole warp
__device__ __forceinline__ void cp_wait_ring() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(W_STAGES - 2) : "memory");
#endif
    __syncwarp();
}

// a shared-memory address in the shared window
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{\n.reg .u64 t;\ncvta.to.shared.u64 t, %1;\ncvt.u32.u64 %0, t;\n}\n" : "=r"(a) : "l"(p));
    return a;
}

// a value the compiler must keep as computed (it cannot work it out again from its inputs)
__device__ __forceinline__ void opaque(u32& v) { asm volatile("" : "+r"(v)); }
__device__ __forceinline__ void opaque(const u8*& p) {
    u64 v = (u64)p;
    asm volatile("" : "+l"(v));
    p = (const u8*)v;
}

// 16 bytes of shared memory at a shared-window address
__device__ __forceinline__ uint4 ld_shared16(u32 a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(a)
                 : "memory");
    return v;
}

// ---- Early launch (sm_90) ------------------------------------------------------------------
//
// The products are launched with programmatic stream serialization where the device has it
// (models/decoder-gpu/src/kernels.rs, launch_early): their blocks may start while the kernel
// before them (the quantisation of their input: kernels/decoder.cu, let_next_grid_start) still
// runs. Until griddepcontrol.wait returns, that kernel may still be writing, so a block touches
// nothing but its weights, which no kernel of a pass writes: it requests the first
// PREFETCH_BYTES of each of its rows into L2 (and the warpgroup kernel its ring's first groups),
// then waits. Launched without the attribute (the experts' kernel, other devices) the wait
// returns at once.
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 512u
#endif

// the first PREFETCH_BYTES of groups [g0, g1) of the block's `rows` matrix rows from `first`
// (those before end) requested into L2, a row a thread
__device__ __forceinline__ void prefetch_rows(const u8* w, u32 first, u32 rows, u32 end, u32 inp,
                                              u32 g0, u32 g1) {
#if __CUDA_ARCH__ >= 900
    const u32 r = first + threadIdx.x;
    if (threadIdx.x < rows && r < end && g0 < g1) {
        const u32 bytes = min(PREFETCH_BYTES, (g1 - g0) * 128u);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(w + (u64)r * inp + (u64)g0 * 128u),
                     "r"(bytes)
                     : "memory");
    }
#endif
}

// returns once the grid before this one completed and its writes are visible (at once where
// this grid was not launched early)
__device__ __forceinline__ void wait_for_inputs() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The ring of a warp's weights: per group its 16 rows x 128 bytes (2 KiB) in each of W_STAGES
// slots of shared memory. The warp copies whole rows (copy j of lane l: row 4 j + l / 8, bytes
// 16 (l % 8) onwards, so each copy reads four 128-byte rows), and each lane then reads its
// fragment (32 bytes of rows g and g + 8 from byte 32 t, as the mma's take them); byte piece p
// (16 bytes) of row r lies at r 128 + 16 (p ^ (r % 8)), so that neither the copies nor the
// reads of a quarter warp meet on a bank. Every offset in a slot is worked out once per warp
// (recomputed per group they were a quarter of the loop's instructions): copy j of a lane lands
// at `put[j & 1] + 1024 (j >> 1)` (row 4 j + q, q = l / 8, has r % 8 = q + 4 (j & 1)).
struct WRing {
    u32 at;         // the warp's slot 0 (shared window)
    const u8* src;  // the warp's row l / 8, byte 16 (l % 8), of group 0
    u32 off1, off2, off3; // copy j's source from src (j rows4; 0 past the matrix)
    u32 sizes;      // byte j: copy j's bytes to read (16, or 0 past the matrix: zeros)
    u32 put0, put1; // where copies 0 and 1 of this lane land in a slot
    u32 get0, get1; // where this lane's fragment lies in a slot (row g; row g + 8 is 1 KiB on)

    __device__ __forceinline__ void issue(u32 group, u32 slot) const {
        const u32 base = at + slot * 2048u;
        const u8* p = src + (u64)group * 128u;
        cp_async_n(base + put0, p, sizes & 0xFFu);
        cp_async_n(base + put1, p + off1, (sizes >> 8) & 0xFFu);
        cp_async_n(base + put0 + 1024u, p + off2, (sizes >> 16) & 0xFFu);
        cp_async_n(base + put1 + 1024u, p + off3, sizes >> 24);
    }

    __device__ __forceinline__ Frag read(u32 slot) const {
        const u32 base = at + slot * 2048u;
        Frag f;
        f.lo0 = ld_shared16(base + get0);
        f.lo1 = ld_shared16(base + get1);
        f.hi0 = ld_shared16(base + get0 + 1024u);
        f.hi1 = ld_shared16(base + get1 + 1024u);
        return f;
    }
};

// The ring of the warp whose 16 rows start at matrix row `first` (of `out`), in the block's
// shared memory from `ring`; with `hold` its offsets are kept in registers through the loop.
__device__ __forceinline__ WRing ring_of(u8* ring, const u8* w, u32 first, u32 out, u32 inp,
                                         u32 warp, u32 lane, bool hold) {
    const u32 valid = first < out ? min(16u, out - first) : 0u;
    const u32 q = lane >> 3, c = lane & 7u;
    const u8* src = w + (u64)(q < valid ? first + q : 0u) * inp + 16u * c;
    u32 off[4], sizes = 0;
#pragma unroll
    for (u32 j = 0; j < 4; ++j) {
        const bool in = 4u * j + q < valid;
        off[j] = in ? j * 4u * inp : 0u;
        sizes |= (in ? 16u : 0u) << (8u * j);
    }
    const u32 g = lane >> 2, t = lane & 3u;
    WRing r{smem_addr(ring + warp * (W_STAGES * 2048u)),
            src,
            off[1],
            off[2],
            off[3],
            sizes,
            q * 128u + 16u * (c ^ q),
            (q + 4u) * 128u + 16u * (c ^ (q + 4u)),
            g * 128u + 16u * ((2u * t) ^ g),
            g * 128u + 16u * ((2u * t + 1u) ^ g)};
    // opaque from here: held in registers, not worked out again in the loop (at 64 tokens ptxas
    // did: a quarter of the loop's instructions; with fewer the registers are short: spills)
    if (!hold) return r;
    opaque(r.at);
    opaque(r.src);
    opaque(r.off1);
    opaque(r.off2);
    opaque(r.off3);
    opaque(r.sizes);
    opaque(r.put0);
    opaque(r.put1);
    opaque(r.get0);
    opaque(r.get1);
    return r;
}

// Requests the first W_STAGES - 1 groups of [g0, g1), one commit group each (empty past g1).
__device__ __forceinline__ void ring_start(const WRing& r, u32 g0, u32 g1) {
#pragma unroll
    for (u32 s = 0; s + 1 < W_STAGES; ++s) {
        if (g0 + s < g1) r.issue(g0 + s, s);
        cp_commit();
    }
}

// The fragment of group k of the block's range [g0, g1) (slot k mod W_STAGES, the ring's
// `slot`), after requesting group k + W_STAGES - 1 into the slot read at k - 1 (every lane's
// reads of it consumed there, before the warp met in cp_wait_ring); `slot` then moves on.
__device__ __forceinline__ Frag ring_next(const WRing& r, u32 g0, u32 g1, u32 k, u32& slot) {
    cp_wait_ring();
    const Frag f = r.read(slot);
    const u32 ahead = g0 + k + W_STAGES - 1;
    const u32 back = slot == 0 ? W_STAGES - 1 : slot - 1;
    if (ahead < g1) r.issue(ahead, back);
    cp_commit();
    slot = slot + 1 == W_STAGES ? 0 : slot + 1;
    return f;
}

// A bf16 value as f32.
__device__ __forceinline__ float bf(u16 h) { return __uint_as_float(((u32)h) << 16); }

// An output: its sum, the row's bias and the residual added in that order (either absent: 0).
__device__ __forceinline__ float finish(float v, const u16* bias, const float* res, u32 row,
                                        u64 at) {
    if (bias != nullptr) v += bf(bias[row]);
    if (res != nullptr) v += res[at];
    return v;
}

// A partial sum written by another block: read from L2, past this SM's L1.
__device__ __forceinline__ float ld_l2(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// A split product's partial sums of this block written (at part, T tokens a tile): with
// `counters`, the last block of the row range to finish adds every slice's in their order, then
// the bias and residual, into y (and 0 into ylo); without, w8a8_reduce does.
template <int ROWS>
__device__ __forceinline__ void add_slices(float* __restrict__ part, u32* __restrict__ counters,
                                           const Place& pl, u32 T, float* y,
                                           float* __restrict__ ylo, u32 out, u32 n,
                                           const u16* __restrict__ bias, const float* res,
                                           u32 bx) {
    __shared__ u32 last;
    const u32 splits = pl.splits;
    if (counters == nullptr) return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counters[pl.pb], 1u) == splits - 1 ? 1u : 0u;
    __syncthreads();
    if (last == 0) return;
    __threadfence();
    const float* all = part + (u64)pl.pb * splits * (ROWS * T);
    // REDUCE_HELD outputs a thread at a time, their bias and residual and every slice of them
    // requested before the first is added (one output after the other, each slice, bias and
    // residual took a round trip of its own: several us a product at 8 tokens); each output's
    // slices are added in their order, then its bias and residual, as before
    for (u32 i0 = 0; i0 < n * ROWS; i0 += REDUCE_HELD * blockDim.x) {
        float v[REDUCE_HELD], b[REDUCE_HELD], rv[REDUCE_HELD];
#pragma unroll
        for (u32 j = 0; j < REDUCE_HELD; ++j) {
            const u32 i = i0 + threadIdx.x + j * blockDim.x;
            const u32 tok = i / ROWS, row = bx * ROWS + (i - tok * ROWS);
            const bool ok = i < n * ROWS && row < out;
            v[j] = 0.0f;
            b[j] = ok && bias != nullptr ? bf(bias[row]) : 0.0f;
            rv[j] = ok && res != nullptr ? res[(u64)tok * out + row] : 0.0f;
        }
        for (u32 s = 0; s < splits; ++s) {
#pragma unroll
            for (u32 j = 0; j < REDUCE_HELD; ++j) {
                const u32 i = i0 + threadIdx.x + j * blockDim.x;
                if (i < n * ROWS) v[j] += ld_l2(all + (u64)s * (ROWS * T) + i);
            }
        }
#pragma unroll
        for (u32 j = 0; j < REDUCE_HELD; ++j) {
            const u32 i = i0 + threadIdx.x + j * blockDim.x;
            const u32 tok = i / ROWS, row = bx * ROWS + (i - tok * ROWS);
            if (i < n * ROWS && row < out) {
                const u64 at = (u64)tok * out + row;
                float o = v[j];
                if (bias != nullptr) o += b[j];
                if (res != nullptr) o += rv[j];
                y[at] = o;
                if (ylo != nullptr) ylo[at] = 0.0f;
            }
        }
    }
    if (threadIdx.x == 0) counters[pl.pb] = 0u;
}

// Writes the sums of a block of ROWS rows (fragment (g, t) of token tile nt: rows g and g + 8
// of the warp's tile, tokens 8 nt + 2 t and the next): unsplit straight to y (and 0 to ylo);
// split, its partial sums [token][row of the block], then with `counters` the last block of
// the row range adds the slices in their order (without, w8a8_reduce does). With PAIRS the
// fragment's two columns are one token's halves (bf16_mma: token 4 nt + t), added first: a
// tile then holds 4 tokens.
template <int NT, int ROWS, bool PAIRS>
__device__ __forceinline__ void store_acc(const float (&acc)[NT][4], float* y,
                                          float* __restrict__ ylo, float* __restrict__ part,
                                          u32* __restrict__ counters, u32 out, u32 n,
                                          const Place& pl, u32 tile, u32 g, u32 t, u32 warp,
                                          bool oklo, bool okhi, const u16* __restrict__ bias,
                                          const float* res, u32 bx) {
    const u32 rlo = tile + g, rhi = rlo + 8;
    if (PAIRS) {
        const u32 T = 4 * NT;
        if (pl.splits == 1) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const u32 k0 = (u32)nt * 4u + t;
                const u64 a0 = (u64)k0 * out;
                if (k0 < n) {
                    if (oklo) y[a0 + rlo] = finish(acc[nt][0] + acc[nt][1], bias, res, rlo, a0 + rlo);
                    if (okhi) y[a0 + rhi] = finish(acc[nt][2] + acc[nt][3], bias, res, rhi, a0 + rhi);
                    if (ylo != nullptr && oklo) ylo[a0 + rlo] = 0.0f;
                    if (ylo != nullptr && okhi) ylo[a0 + rhi] = 0.0f;
                }
            }
            return;
        }
        float* mine = part + ((u64)pl.pb * pl.splits + pl.s) * (ROWS * T);
        const u32 bl = warp * 16u + g, bh = bl + 8u;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            if ((u32)nt * 4u < n) {
                const u32 k0 = (u32)nt * 4u + t;
                mine[k0 * ROWS + bl] = acc[nt][0] + acc[nt][1];
                mine[k0 * ROWS + bh] = acc[nt][2] + acc[nt][3];
            }
        }
        add_slices<ROWS>(part, counters, pl, T, y, ylo, out, n, bias, res, bx);
        return;
    }
    const u32 T = 8 * NT;
    const u32 splits = pl.splits;
    if (splits == 1) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const u32 k0 = (u32)nt * 8u + 2u * t;
            const u64 a0 = (u64)k0 * out, a1 = a0 + out;
            if (oklo && k0 < n) y[a0 + rlo] = finish(acc[nt][0], bias, res, rlo, a0 + rlo);
            if (oklo && k0 + 1 < n) y[a1 + rlo] = finish(acc[nt][1], bias, res, rlo, a1 + rlo);
            if (okhi && k0 < n) y[a0 + rhi] = finish(acc[nt][2], bias, res, rhi, a0 + rhi);
            if (okhi && k0 + 1 < n) y[a1 + rhi] = finish(acc[nt][3], bias, res, rhi, a1 + rhi);
            if (ylo != nullptr) {
                if (oklo && k0 < n) ylo[(u64)k0 * out + rlo] = 0.0f;
                if (oklo && k0 + 1 < n) ylo[(u64)(k0 + 1) * out + rlo] = 0.0f;
                if (okhi && k0 < n) ylo[(u64)k0 * out + rhi] = 0.0f;
                if (okhi && k0 + 1 < n) ylo[(u64)(k0 + 1) * out + rhi] = 0.0f;
            }
        }
        return;
    }
    float* mine = part + ((u64)pl.pb * splits + pl.s) * (ROWS * T);
    const u32 bl = warp * 16u + g, bh = bl + 8u;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        if ((u32)nt * 8u < n) {
            const u32 k0 = (u32)nt * 8u + 2u * t;
            mine[k0 * ROWS + bl] = acc[nt][0];
            mine[(k0 + 1) * ROWS + bl] = acc[nt][1];
            mine[k0 * ROWS + bh] = acc[nt][2];
            mine[(k0 + 1) * ROWS + bh] = acc[nt][3];
        }
    }
    add_slices<ROWS>(part, counters, pl, T, y, ylo, out, n, bias, res, bx);
}


// The sums of split products from their partials (block (b, s) of `rows` rows and `tile_tokens`
// tokens at part + ((b - first) splits + s) rows tile_tokens, [token][row], b the launch's row
// block, the row blocks before `first` unsplit): one thread per output, the slices added in
// their order from 0, to each product's y [n x out] (and 0 to the n rows after it with
// zero_lo; with its bias and res added as the products add them). Grid: ceil(split row blocks x
// n x rows / 256) blocks of 256 threads.
extern "C" __global__ void __launch_bounds__(256)
    w8a8_reduce(const Prods ps, const float* __restrict__ part, u32 splits, u32 rows,
                u32 tile_tokens, u32 n, u32 zero_lo, u32 first) {
    // launched early like the products (its launch overlaps the product's end)
    wait_for_inputs();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 per_block = (u64)n * rows;
    const u64 pb = i / per_block, rem = i - pb * per_block, b = first + pb;
    const u32 tok = (u32)(rem / rows), r = (u32)(rem - (u64)tok * rows);
    u32 lb;
    const Prod pr = pick(ps, b, lb);
    const u64 row = (u64)lb * rows + r;
    if (lb >= pr.blocks || row >= pr.out) return;
    const u32 out = pr.out;
    float* y = pr.y;
    const u16* bias = pr.bias;
    const float* res = pr.res;
    const float* p = part + pb * splits * rows * tile_tokens + (u64)tok * rows + r;
    float v = 0.0f;
    for (u32 s = 0; s < splits; ++s) v += p[(u64)s * rows * tile_tokens];
    const u64 at = (u64)tok * out + row;
    y[at] = finish(v, bias, res, (u32)row, at);
    if (zero_lo) y[(u64)(n + tok) * out + row] = 0.0f;
}

// The activation row of a product's token t: row first + t, or with idx the row idx[first + t]
// (the token of a mixture-of-experts slot).
__device__ __forceinline__ u64 act_row(const u32* __restrict__ idx, u32 first, u32 t) {
    return idx != nullptr ? (u64)idx[first + t] : (u64)first + t;
}

// With BF16, bf16 weights and split activations (see the top): `inp` a row's bytes, no scales
// (wsc, xsc unused), the staged columns token t's hi then lo rows of xq (n tokens: rows t and
// n + t), each group's four mma's summed straight into the accumulator.
template <int NT, bool BF16 = false>
__device__ __forceinline__ void w8a8_mma_body(
    const u8* __restrict__ w, const float* __restrict__ wsc, u32 row0, u32 out, u32 inp,
    const u8* __restrict__ xq, const float* __restrict__ xsc, u32 xs_grp, u32 n, u32 slice,
    u32 chunk, float* y, float* __restrict__ ylo, float* __restrict__ part,
    u32* __restrict__ counters, const u16* __restrict__ bias, const float* res, u32 bx,
    const Place pl, const u32* __restrict__ idx, u32 first, bool early) {
    extern __shared__ __align__(16) u8 smem[];
    const u32 T = 8 * NT;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, t = lane & 3u;
    const u32 groups = inp >> 7;
    // a whole row block (splits 1) over every input, whatever the split rows' slice
    const u32 g0 = pl.s * slice, g1 = pl.splits == 1 ? groups : min(groups, g0 + slice);
    const u32 tile = bx * MMA_ROWS + warp * 16;
    const u32 rlo = tile + g, rhi = rlo + 8;
    const bool oklo = rlo < out, okhi = rhi < out, okt = tile < out;
    // the 16 rows of a tile lie in one 128-row block of scales (row0 is a multiple of 16)
    const float* wsr = BF16 ? nullptr : wsc + (u64)((row0 + (okt ? tile : 0u)) >> 7) * groups;
    // staged activations: token rows of `chunk` groups, 16 bytes more per row so that the 8
    // tokens an mma reads fall on different banks; then their scales [group][token]
    const u32 stride = chunk * 128u + 16u;
    u8* xb = smem;
    float* xsb = reinterpret_cast<float*>(smem + T * stride);
    const u8* wlo = w + (u64)(row0 + (oklo ? rlo : 0u)) * inp + 32u * t;
    const u8* whi = w + (u64)(row0 + (okhi ? rhi : 0u)) * inp + 32u * t;
    if (early) {
        prefetch_rows(w, row0 + bx * MMA_ROWS, MMA_ROWS, row0 + out, inp, g0, g1);
        wait_for_inputs();
    }
    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    }
    for (u32 c0 = g0; c0 < g1; c0 += chunk) {
        const u32 cg = min(chunk, g1 - c0);
        // this chunk's first weights are requested before the activations are staged
        Frag a = load_frag(wlo + (u64)c0 * 128u, whi + (u64)c0 * 128u, oklo, okhi);
        // and its weight scale, each requested with its group's weights (not in the group's
        // multiplication, where a round trip of its own stalled it)
        float wa = BF16 ? 1.0f : okt ? wsr[c0] : 0.0f;
        __syncthreads();  // the previous chunk is no longer read
        const u32 units = cg * 8u;  // 16-byte units per token row
        // STAGE_UNITS units a thread at a time, every load requested before the first store
        // (as one loop of loads and stores each unit took a round trip of its own: ~4 us a
        // chunk at 8 tokens)
        for (u32 i0 = 0; i0 < T * units; i0 += STAGE_UNITS * blockDim.x) {
            uint4 v[STAGE_UNITS];
#pragma unroll
            for (u32 j = 0; j < STAGE_UNITS; ++j) {
                const u32 i = i0 + threadIdx.x + j * blockDim.x;
                const u32 tok = i / units, u = i - tok * units;
                v[j] = make_uint4(0u, 0u, 0u, 0u);
                // (BF16: column tok is token tok / 2's hi or lo row)
                if (i < T * units && (BF16 ? tok < 2u * n : tok < n)) {
                    const u64 row = BF16 ? (u64)(tok & 1u) * n + (tok >> 1)
                                         : act_row(idx, first, tok);
                    v[j] = *reinterpret_cast<const uint4*>(xq + row * inp + (u64)c0 * 128u +
                                                           16u * u);
                }
            }
#pragma unroll
            for (u32 j = 0; j < STAGE_UNITS; ++j) {
                const u32 i = i0 + threadIdx.x + j * blockDim.x;
                const u32 tok = i / units, u = i - tok * units;
                if (i < T * units) *reinterpret_cast<uint4*>(xb + tok * stride + 16u * u) = v[j];
            }
        }
        for (u32 i = threadIdx.x; i < (BF16 ? 0u : T * cg); i += blockDim.x) {
            const u32 gi = i / T, tok = i - gi * T;
            xsb[i] = tok < n ? xsc[(u64)(c0 + gi) * xs_grp + act_row(idx, first, tok)] : 0.0f;
        }
        __syncthreads();
        for (u32 gi = 0; gi < cg; ++gi) {
            const Frag f = a;
            const float ws = wa;
            if (gi + 1 < cg) {
                const u64 next = (u64)(c0 + gi + 1) * 128u;
                a = load_frag(wlo + next, whi + next, oklo, okhi);
                wa = BF16 ? 1.0f : okt ? wsr[c0 + gi + 1] : 0.0f;
            }
            const u8* bg = xb + g * stride + gi * 128u + 32u * t;
            // the mma's of up to 4 token tiles interleaved (4 independent chains of 4 steps),
            // their inputs read from shared memory first
#pragma unroll
            for (int h = 0; h < NT; h += 4) {
                const int m = NT - h < 4 ? NT - h : 4;
                uint4 b[4];
                float d[4][4];
#pragma unroll
                for (int j = 0; j < m; ++j) {
                    b[j] = *reinterpret_cast<const uint4*>(bg + (u32)(h + j) * 8u * stride);
#pragma unroll
                    for (int e = 0; e < 4; ++e) d[j][e] = 0.0f;
                }
#pragma unroll
                for (int j = 0; j < m; ++j) mma_step<BF16>(d[j], f.lo0.x, f.hi0.x, f.lo0.y, f.hi0.y, b[j].x, b[j].y);
#pragma unroll
                for (int j = 0; j < m; ++j) mma_step<BF16>(d[j], f.lo0.z, f.hi0.z, f.lo0.w, f.hi0.w, b[j].z, b[j].w);
#pragma unroll
                for (int j = 0; j < m; ++j) {
                    b[j] = *reinterpret_cast<const uint4*>(bg + (u32)(h + j) * 8u * stride + 16u);
                }
#pragma unroll
                for (int j = 0; j < m; ++j) mma_step<BF16>(d[j], f.lo1.x, f.hi1.x, f.lo1.y, f.hi1.y, b[j].x, b[j].y);
#pragma unroll
                for (int j = 0; j < m; ++j) mma_step<BF16>(d[j], f.lo1.z, f.hi1.z, f.lo1.w, f.hi1.w, b[j].z, b[j].w);
#pragma unroll
                for (int j = 0; j < m; ++j) {
                    if (BF16) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[h + j][e] += d[j][e];
                        continue;
                    }
                    const float* sc = xsb + gi * T + (u32)(h + j) * 8u + 2u * t;
                    const float s0 = ws * sc[0], s1 = ws * sc[1];
                    acc[h + j][0] = fmaf(d[j][0], s0, acc[h + j][0]);
                    acc[h + j][1] = fmaf(d[j][1], s1, acc[h + j][1]);
                    acc[h + j][2] = fmaf(d[j][2], s0, acc[h + j][2]);
                    acc[h + j][3] = fmaf(d[j][3], s1, acc[h + j][3]);
                }
            }
        }
    }
    store_acc<NT, MMA_ROWS, BF16>(acc, y, ylo, part, counters, out, n, pl, tile, g, t, warp, oklo, okhi,
                            bias, res, bx);
}

// ---- The same products by Hopper's warpgroup mma (compiled for sm_90a only) ----------------
//
// A block is two warpgroups (8 warps, 128 rows: the staged activations serve twice the weight
// rows of the mma.sync kernel's block). Per 128-wide group, each warpgroup's four
// wgmma.m64n{8 NT}k32.e4m3 take its warps' weight fragments from registers (as loaded for
// mma.sync above: the same permuted k order) and every token's activations from shared memory,
// into a fresh f32 fragment (scale-d 0 on the first), which is then scaled and added as above.
// The fragment of token tile j is d[4 j .. 4 j + 3], laid out as mma.sync's.
//
// The activations come laid out as the wgmma reads them (the quantisation writes them so:
// fp8_quant_* with tiles = NT, kernels/decoder_fp8.cu): canonical K-major tiles without swizzle,
// per group, step s (32 inputs) and half h (16 of them), NT core matrices of 8 tokens x 16 bytes
// (128 contiguous bytes each, token tile after token tile). The core matrix of half h holds, in
// its 4-byte word q, the group's input word 8 q + 2 s + h: the permutation the weight fragments
// were loaded in. A group is then 1024 NT contiguous bytes, and its 8 NT scales follow each other
// (xs_grp = 8 NT): a chunk of groups is two bulk copies (cp.async.bulk, completing on an
// mbarrier), issued by one thread for the next chunk while the block multiplies the current one
// from the other of two buffers.

#define WG_WARPS 8
#define WG_ROWS (16 * WG_WARPS)

// ---- Split sums through the cluster's shared memory (sm_90a) ---------------------------------
//
// A product whose row blocks all split (none whole) may be launched in clusters of `splits`
// blocks, a row block's slices in order (models/decoder-gpu/src/w8a8/mma.rs, MmaShape::cluster:
// only where every cluster is resident at once). Each block then leaves its partial sums in its
// own shared memory ([token][row], rows padded by CL_PAD so that a warp's stores meet on no
// bank), the cluster meets, and block s adds its share of the outputs, the slices in their order
// from every block's shared memory, as w8a8_reduce would have from device memory: no partials
// in device memory and no second launch.
#define CL_PAD 4u

// every thread of every block of the cluster arrived: the shared memory each wrote before it
// is visible to all of them
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" :::
                     "memory");
#endif
}

// the f32 at shared-window address `a` of the cluster's block `rank`
__device__ __forceinline__ float ld_cluster(u32 a, u32 rank) {
    float v = 0.0f;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
    return v;
}

// The sums of a row block split over the `splits` blocks of this cluster (this one slice
// pl.s): as store_acc's split case with w8a8_reduce after it, through the blocks' shared memory
// (`smem`, free once the block's loop ended: at least (ROWS + CL_PAD) 8 NT floats).
template <int NT, int ROWS>
__device__ __forceinline__ void cluster_sums(const float (&acc)[NT][4], u8* smem, float* y,
                                             float* __restrict__ ylo, u32 out, u32 n,
                                             const Place& pl, u32 g, u32 t, u32 warp,
                                             const u16* __restrict__ bias, const float* res,
                                             u32 bx) {
    const u32 RS = ROWS + CL_PAD;
    float* mine = reinterpret_cast<float*>(smem);
    const u32 bl = warp * 16u + g, bh = bl + 8u;
    // every warp's reads of the ring and the activations are done: the space is free
    __syncthreads();
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const u32 k0 = (u32)nt * 8u + 2u * t;
        mine[k0 * RS + bl] = acc[nt][0];
        mine[(k0 + 1) * RS + bl] = acc[nt][1];
        mine[k0 * RS + bh] = acc[nt][2];
        mine[(k0 + 1) * RS + bh] = acc[nt][3];
    }
    cluster_sync();
    const u32 splits = pl.splits, total = n * ROWS;
    const u32 per = (total + splits - 1) / splits;
    const u32 i0 = pl.s * per, i1 = min(total, i0 + per);
    const u32 base = smem_addr(smem);
    for (u32 i = i0 + threadIdx.x; i < i1; i += REDUCE_HELD * blockDim.x) {
        float v[REDUCE_HELD];
        float p[REDUCE_HELD][8];
        // every slice of REDUCE_HELD outputs requested before the first is added
#pragma unroll
        for (u32 j = 0; j < REDUCE_HELD; ++j) {
            const u32 k = i + j * blockDim.x;
            const u32 tok = k / ROWS, r = k - tok * ROWS;
            const u32 a = base + 4u * (tok * RS + r);
#pragma unroll
            for (u32 s = 0; s < 8; ++s) p[j][s] = s < splits && k < i1 ? ld_cluster(a, s) : 0.0f;
        }
#pragma unroll
        for (u32 j = 0; j < REDUCE_HELD; ++j) {
            const u32 k = i + j * blockDim.x;
            const u32 tok = k / ROWS, row = bx * ROWS + (k - tok * ROWS);
            v[j] = 0.0f;
#pragma unroll
            for (u32 s = 0; s < 8; ++s) {
                if (s < splits) v[j] += p[j][s];
            }
            if (k < i1 && row < out) {
                const u64 at = (u64)tok * out + row;
                y[at] = finish(v[j], bias, res, row, at);
                if (ylo != nullptr) ylo[at] = 0.0f;
            }
        }
    }
    // no block leaves (its shared memory with it) before every block read it
    cluster_sync();
}

// the matrix descriptor of canonical K-major tiles without swizzle: the leading byte offset
// between the two core matrices of a step's 32 inputs, the stride byte offset between token
// tiles of 8
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lead, u32 stride) {
    return (u64)((addr >> 4) & 0x3FFFu) | ((u64)((lead >> 4) & 0x3FFFu) << 16) |
           ((u64)((stride >> 4) & 0x3FFFu) << 32);
}

__device__ __forceinline__ void wg_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wg_commit_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" :::
                     "memory");
#endif
}

// an mbarrier of `count` arrivals, visible to the async proxy (the bulk copies)
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// this thread's arrival on `bar`, which then waits for `bytes` of bulk copies
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                 "r"(bytes)
                 : "memory");
#endif
}

// `bytes` (a multiple of 16, both addresses on 16 bytes) from global to shared memory, counted
// on `bar` when they landed
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
            "r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
#endif
}

// waits for the phase of `bar` of this parity to complete
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    }
#endif
}

// keeps a register live and unmoved up to here (the wgmma reads and writes it asynchronously)
__device__ __forceinline__ void keep(float& v) { asm volatile("" : "+f"(v)::"memory"); }
__device__ __forceinline__ void keep(u32& v) { asm volatile("" : "+r"(v)::"memory"); }

__device__ __forceinline__ void wgmma_n8(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u64 desc,
                                          u32 acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(acc));
#else
    __trap();
#endif
}

__device__ __forceinline__ void wgmma_n16(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u64 desc,
                                          u32 acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(acc));
#else
    __trap();
#endif
}

__device__ __forceinline__ void wgmma_n32(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u64 desc,
                                          u32 acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(acc));
#else
    __trap();
#endif
}

__device__ __forceinline__ void wgmma_n64(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u64 desc,
                                          u32 acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(acc));
#else
    __trap();
#endif
}

template <int NT>
__device__ __forceinline__ void wgmma_step(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u64 desc,
                                           u32 acc) {
    if (NT == 1) wgmma_n8(d, a0, a1, a2, a3, desc, acc);
    else if (NT == 2) wgmma_n16(d, a0, a1, a2, a3, desc, acc);
    else if (NT == 4) wgmma_n32(d, a0, a1, a2, a3, desc, acc);
    else wgmma_n64(d, a0, a1, a2, a3, desc, acc);
}

template <int NT>
__device__ __forceinline__ void w8a8_wgmma_body(
    const u8* __restrict__ w, const float* __restrict__ wsc, u32 row0, u32 out, u32 inp,
    const u8* __restrict__ xq, const float* __restrict__ xsc, u32 xs_grp, u32 n, u32 slice,
    u32 chunk, float* y, float* __restrict__ ylo, float* __restrict__ part,
    u32* __restrict__ counters, const u16* __restrict__ bias, const float* res, u32 bx,
    const Place pl, bool cluster) {
    extern __shared__ __align__(128) u8 smem[];
    __shared__ __align__(8) u64 full[2];
    const u32 T = 8 * NT;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, t = lane & 3u;
    const u32 groups = inp >> 7;
    // a whole row block (splits 1) over every input, whatever the split rows' slice
    const u32 g0 = pl.s * slice, g1 = pl.splits == 1 ? groups : min(groups, g0 + slice);
    const u32 tile = bx * WG_ROWS + warp * 16;
    const u32 rlo = tile + g, rhi = rlo + 8;
    const bool oklo = rlo < out, okhi = rhi < out, okt = tile < out;
    const float* wsr = wsc + (u64)((row0 + (okt ? tile : 0u)) >> 7) * groups;
    // two buffers, each a chunk of groups (1024 NT bytes each), then their scales [group][token]
    const u32 group_bytes = 128u * T;
    const u32 buf_bytes = chunk * (group_bytes + 4u * T);
    const u32 base = smem_addr(smem);
    const u32 bar0 = smem_addr(&full[0]);
    const u32 chunks = (g1 - g0 + chunk - 1) / chunk;
    // the copies of chunk ci into buffer ci & 1 (one thread issues them)
    auto issue = [&](u32 ci) {
        const u32 c0 = g0 + ci * chunk, cg = min(chunk, g1 - c0);
        const u32 dst = base + (ci & 1u) * buf_bytes, bar = bar0 + 8u * (ci & 1u);
        mbar_expect(bar, cg * (group_bytes + 4u * T));
        bulk_copy(dst, xq + (u64)c0 * group_bytes, cg * group_bytes, bar);
        bulk_copy(dst + chunk * group_bytes, xsc + (u64)c0 * xs_grp, cg * 4u * T, bar);
    };
    // the weight ring after the two buffers: its first groups requested, and the groups after
    // them into L2, before the wait for the kernel that writes the activations
    const WRing ring = ring_of(smem + 2u * buf_bytes, w, row0 + tile, row0 + out, inp, warp, lane, NT >= 8);
    ring_start(ring, g0, g1);
    u32 slot = 0;
    // the weight scale of the next group, requested a group ahead (in the group's own
    // multiplication it took a round trip of its own)
    float wn = okt && g0 < g1 ? wsr[g0] : 0.0f;
    prefetch_rows(w, row0 + bx * WG_ROWS, WG_ROWS, row0 + out, inp, min(g1, g0 + W_STAGES - 1), g1);
    wait_for_inputs();
    if (threadIdx.x == 0) {
        mbar_init(bar0, 1);
        mbar_init(bar0 + 8u, 1);
    }
    __syncthreads();
    if (threadIdx.x == 0 && chunks > 0) issue(0);
    float acc[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    }
    for (u32 ci = 0; ci < chunks; ++ci) {
        const u32 c0 = g0 + ci * chunk, cg = min(chunk, g1 - c0);
        // the other buffer was last read by the chunk before, which every thread finished
        if (threadIdx.x == 0 && ci + 1 < chunks) issue(ci + 1);
        mbar_wait(bar0 + 8u * (ci & 1u), (ci >> 1) & 1u);
        const u32 xb_addr = base + (ci & 1u) * buf_bytes;
        const float* xsb = reinterpret_cast<const float*>(smem + (ci & 1u) * buf_bytes + chunk * group_bytes);
        for (u32 gi = 0; gi < cg; ++gi) {
            Frag f = ring_next(ring, g0, g1, c0 + gi - g0, slot);
            const float ws = wn;
            wn = okt && c0 + gi + 1 < g1 ? wsr[c0 + gi + 1] : 0.0f;
            const u32 ga = xb_addr + gi * group_bytes;
            const u32 lead = NT * 128u;
            float d[NT * 4];
#pragma unroll
            for (int e = 0; e < NT * 4; ++e) d[e] = 0.0f;
            wg_fence();
            wgmma_step<NT>(d, f.lo0.x, f.hi0.x, f.lo0.y, f.hi0.y, wg_desc(ga, lead, 128u), 0u);
            wgmma_step<NT>(d, f.lo0.z, f.hi0.z, f.lo0.w, f.hi0.w,
                           wg_desc(ga + 2u * lead, lead, 128u), 1u);
            wgmma_step<NT>(d, f.lo1.x, f.hi1.x, f.lo1.y, f.hi1.y,
                           wg_desc(ga + 4u * lead, lead, 128u), 1u);
            wgmma_step<NT>(d, f.lo1.z, f.hi1.z, f.lo1.w, f.hi1.w,
                           wg_desc(ga + 6u * lead, lead, 128u), 1u);
            wg_commit_wait();
#pragma unroll
            for (int e = 0; e < NT * 4; ++e) keep(d[e]);
            keep(f.lo0.x); keep(f.lo0.y); keep(f.lo0.z); keep(f.lo0.w);
            keep(f.lo1.x); keep(f.lo1.y); keep(f.lo1.z); keep(f.lo1.w);
            keep(f.hi0.x); keep(f.hi0.y); keep(f.hi0.z); keep(f.hi0.w);
            keep(f.hi1.x); keep(f.hi1.y); keep(f.hi1.z); keep(f.hi1.w);
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const float* sc = xsb + gi * T + (u32)j * 8u + 2u * t;
                const float s0 = ws * sc[0], s1 = ws * sc[1];
                acc[j][0] = fmaf(d[4 * j + 0], s0, acc[j][0]);
                acc[j][1] = fmaf(d[4 * j + 1], s1, acc[j][1]);
                acc[j][2] = fmaf(d[4 * j + 2], s0, acc[j][2]);
                acc[j][3] = fmaf(d[4 * j + 3], s1, acc[j][3]);
            }
        }
        __syncthreads();  // this buffer is no longer read: the chunk after next may land in it
    }
    if (cluster && pl.splits > 1) {
        cluster_sums<NT, WG_ROWS>(acc, smem, y, ylo, out, n, pl, g, t, warp, bias, res, bx);
        return;
    }
    store_acc<NT, WG_ROWS, false>(acc, y, ylo, part, counters, out, n, pl, tile, g, t, warp, oklo, okhi,
                           bias, res, bx);
}

// The kernels: the products `ps` of one input (row block blockIdx.x of the launch picks its
// product), with zero_lo the n rows after each product's y written 0. With `cluster` (no whole
// row blocks, launched in clusters of `splits` blocks) the split sums go through the cluster's
// shared memory (cluster_sums), else through `part`.
#define W8A8_WGMMA(NT)                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * WG_WARPS, NT <= 4 ? 3 : 2)              \
        w8a8_wgmma_##NT(const Prods ps, u32 inp, const u8* __restrict__ xq,                   \
                        const float* __restrict__ xsc, u32 xs_grp, u32 n, u32 slice,          \
                        u32 chunk, u32 zero_lo, float* __restrict__ part,                     \
                        u32* __restrict__ counters, u32 whole, u32 splits, u32 cluster) {     \
        const Place pl = place_1d(whole, splits);                                             \
        u32 bx;                                                                               \
        const Prod p = pick(ps, pl.rb, bx);                                                   \
        w8a8_wgmma_body<NT>(p.w, p.wsc, p.row0, p.out, inp, xq, xsc, xs_grp, n, slice, chunk, \
                            p.y, zero_lo ? p.y + (u64)n * p.out : nullptr, part, counters,    \
                            p.bias, p.res, bx, pl, cluster != 0u);                            \
    }

#define W8A8_MMA(NT)                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, NT <= 3 ? 4 : 2)              \
        w8a8_mma_##NT(const Prods ps, u32 inp, const u8* __restrict__ xq,                     \
                      const float* __restrict__ xsc, u32 xs_grp, u32 n, u32 slice, u32 chunk, \
                      u32 zero_lo, float* __restrict__ part, u32* __restrict__ counters) {    \
        u32 bx;                                                                               \
        const Prod p = pick(ps, blockIdx.x, bx);                                              \
        w8a8_mma_body<NT>(p.w, p.wsc, p.row0, p.out, inp, xq, xsc, xs_grp, n, slice, chunk,   \
                          p.y, zero_lo ? p.y + (u64)n * p.out : nullptr, part, counters,      \
                          p.bias, p.res, bx, place_2d(), nullptr, 0u, true);                  \
    }
// The bf16 products of the same launches: x the split activation rows (2 n rows of `inp`
// bytes: hi rows, then lo rows), NT tiles of 4 tokens.
#define BF16_MMA(NT)                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, NT <= 3 ? 4 : 2)              \
        bf16_mma_##NT(const Prods ps, u32 inp, const u8* __restrict__ x, u32 n, u32 slice,    \
                      u32 chunk, u32 zero_lo, float* __restrict__ part,                      \
                      u32* __restrict__ counters) {                                           \
        u32 bx;                                                                               \
        const Prod p = pick(ps, blockIdx.x, bx);                                              \
        w8a8_mma_body<NT, true>(p.w, nullptr, p.row0, p.out, inp, x, nullptr, 0u, n, slice,   \
                                chunk, p.y, zero_lo ? p.y + (u64)n * p.out : nullptr, part,   \
                                counters, p.bias, p.res, bx, place_2d(), nullptr, 0u, true);  \
    }
BF16_MMA(1)
BF16_MMA(2)
BF16_MMA(3)
BF16_MMA(4)
BF16_MMA(5)
BF16_MMA(6)
BF16_MMA(7)
BF16_MMA(8)

W8A8_MMA(1)
W8A8_MMA(2)
W8A8_MMA(3)
W8A8_MMA(4)
W8A8_MMA(5)
W8A8_MMA(6)
W8A8_MMA(7)
W8A8_MMA(8)

// The experts of a mixture-of-experts layer routed on the device: the pieces of one or more
// products in moe_route's table (kernels/decoder_moe.cu; 8 words a piece: w, scales, row0, inp,
// x, rows, y, ylo; a piece of 0 rows does nothing), each of at most 8 rows, `count` of them,
// each `out` rows of blocks of MMA_ROWS. Block x of the grid is row block x % row_blocks of
// piece x / row_blocks (so that the split sums' partials and counters are a row block's, as
// above), over slice blockIdx.y of its inputs. A piece's rows are activation rows of xq / xsc
// (token rows, the scales' groups xs_grp apart): from its first slot o, which its x address
// gives (x = x32 + 4 o inp, the f32 rows the weight-streaming kernels read instead), rows
// idx[o + t] with idx (the slots' tokens: the layer's input rows), else o + t (the slots' own
// rows). Its outputs go to its y (and 0 to its ylo).
// five blocks an SM (96 registers, no spills: without the bound it takes 101 and four)
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, 5)
    w8a8_mma_experts(const u64* __restrict__ table, u32 row_blocks, u32 out, u64 x32,
                     const u8* __restrict__ xq, const float* __restrict__ xsc, u32 xs_grp,
                     const u32* __restrict__ idx, u32 slice, u32 chunk,
                     float* __restrict__ part, u32* __restrict__ counters) {
    const u32 piece = blockIdx.x / row_blocks, bx = blockIdx.x - piece * row_blocks;
    const u64* e = table + 8 * (u64)piece;
    const u32 n = (u32)e[5];
    if (n == 0) return;
    const u32 inp = (u32)e[3];
    const u32 first = (u32)((e[4] - x32) / (4ull * inp));
    w8a8_mma_body<1>((const u8*)e[0], (const float*)e[1], (u32)e[2], out, inp, xq, xsc, xs_grp,
                     n, slice, chunk, (float*)e[6], (float*)e[7], part, counters, nullptr,
                     nullptr, bx, place_2d(), idx, first, false);
}

// the warpgroup kernels exist only where the source is compiled for sm_90a
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
W8A8_WGMMA(1)
W8A8_WGMMA(2)
W8A8_WGMMA(4)
W8A8_WGMMA(8)
#endif
