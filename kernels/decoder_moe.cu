// Launched by the device routing of the decoder's mixture-of-experts layers
// (models/decoder-gpu/src/decoder/moe/device.rs): each launch's grid, block and argument contract
// is stated at its launcher there; the kernels below document what they read and write.
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define NEG_INF (__int_as_float(0xff800000))

// The most rows, experts and picks per row moe_route takes (its shared arrays).
#define MOE_ROWS 256
#define MOE_EXPERTS 1024
#define MOE_TOP_K 16
// Rows of one expert per product piece (the table kernels' largest N).
#define MOE_PIECE 8


// Step 1 of moe_route for ne <= 32 PER experts: softmax and top-k, one warp per row, its
// probabilities in the lanes' registers (lane l holds experts l, l + 32, ...; `taken` marks the
// picked ones), each warp's picks of its current row in picked[warp].
template <int PER>
__device__ __forceinline__ void route_rows(const float* __restrict__ logits, u32 n, u32 ne,
                                           u32 k, u32 norm, u32* __restrict__ sel_e,
                                           float* __restrict__ sel_w,
                                           u32 (*picked)[MOE_TOP_K]) {
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (u32 t = warp; t < n; t += warps) {
        const float* l = logits + (u64)t * ne;
        float v[PER];
        float mx = NEG_INF;
#pragma unroll
        for (u32 i = 0; i < PER; ++i) {
            const u32 e = lane + 32u * i;
            v[i] = e < ne ? l[e] : 0.0f;
            if (e < ne) mx = fmaxf(mx, v[i]);
        }
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float tot = 0.0f;
#pragma unroll
        for (u32 i = 0; i < PER; ++i) {
            if (lane + 32u * i < ne) {
                v[i] = expf(v[i] - mx);
                tot += v[i];
            }
        }
        for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
#pragma unroll
        for (u32 i = 0; i < PER; ++i) {
            if (lane + 32u * i < ne) v[i] = v[i] / tot;
        }
        u32 taken = 0, mine_e = 0;
        float mine_w = 0.0f, sum = 0.0f;
        for (u32 j = 0; j < k; ++j) {
            float bv = NEG_INF;
            u32 bi = 0xffffffffu;
#pragma unroll
            for (u32 i = 0; i < PER; ++i) {
                const u32 e = lane + 32u * i;
                if (e < ne && ((taken >> i) & 1u) == 0u && (bi == 0xffffffffu || v[i] > bv)) {
                    bv = v[i];
                    bi = e;
                }
            }
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                u32 oi = __shfl_xor_sync(0xffffffffu, bi, o);
                bool better = oi != 0xffffffffu &&
                              (bi == 0xffffffffu || ov > bv || (ov == bv && oi < bi));
                if (better) {
                    bv = ov;
                    bi = oi;
                }
            }
            // lane 0's pick (with NaNs the lanes' merges may differ)
            bi = __shfl_sync(0xffffffffu, bi, 0);
            if (bi >= ne) {
                // only where every probability is NaN: the first expert not yet picked
                bi = 0;
                for (bool again = true; again;) {
                    again = false;
                    for (u32 i = 0; i < j; ++i) again |= picked[warp][i] == bi;
                    if (again) ++bi;
                }
            }
            // the pick's probability, from the lane that holds it
            float pv = 0.0f;
#pragma unroll
            for (u32 i = 0; i < PER; ++i) {
                if (i == bi / 32u) pv = v[i];
            }
            bv = __shfl_sync(0xffffffffu, pv, bi & 31u);
            if (lane == (bi & 31u)) taken |= 1u << (bi / 32u);
            if (lane == 0) picked[warp][j] = bi;
            if (lane == j) {
                mine_e = bi;
                mine_w = bv;
            }
            __syncwarp();
            sum += bv;
        }
        if (lane < k) {
            sel_e[t * k + lane] = mine_e;
            sel_w[t * k + lane] = norm ? mine_w / sum : mine_w;
        }
        __syncwarp();
    }
}

// One block of 1024 threads: the routing of n <= MOE_ROWS rows over ne <= MOE_EXPERTS experts,
// k <= MOE_TOP_K picks per row, on the device.
//
// 1. Per row (one warp each), the router logits [n x ne] become probabilities (softmax: the
//    max, exp(l - max), their sum, each divided by it; in registers) and the row's k experts are
//    picked, the larger probability first and the lower index among equals (route_top_k's
//    rule); with norm, each weight is divided by the sum of the k picked, summed in pick order.
// 2. The experts this rank holds (experts[10 e] != 0) get the routed rows as slots, expert
//    after expert (within one expert in the order the block's atomics give: each slot's products
//    are computed alone, so the order changes no result): slot_tok[q] is the token of slot q (0
//    from the last slot to cap, so a kernel over cap slots reads valid rows).
// 3. Per token, its slots in expert order with their weights, as scatter_add_grouped reads them:
//    csr [n + 1] offsets into pos (slots) and wt (weights).
// 4. The product table of the table kernels: for product i (gate, up, down) and piece p (at most
//    MOE_PIECE rows of one expert), 8 words at table[(i * problems + p) * 8] as the
//    weight-streaming table kernels of decoder_fp8.cu read them: w, scales (0 for bf16), row0,
//    inp, the piece's input rows, its row count, its output rows y, and its lo output rows ylo
//    (written 0). Entries past the last piece have 0 rows. problems must be at least
//    min(ne, n k) + n k / 8.
//
// experts holds 10 words per expert: held, then (w, scales, row0) for gate, up and down. The
// input x: f32 rows [cap x max(h, f)] (gate and up read h columns, down f); outputs g2, u2
// [2 cap x f] and y2 [2 cap x h] f32.
// picks is scratch of 3 n k words: each pick's expert, weight and slot.
extern "C" __global__ void __launch_bounds__(1024) moe_route(
    const float* __restrict__ logits, u32 n, u32 ne, u32 k, u32 norm,
    const u64* __restrict__ experts, u32 h, u32 f, u32 cap, u32 problems,
    u64 x, u64 g2, u64 u2, u64 y2, u32* __restrict__ picks,
    u32* __restrict__ slot_tok, u32* __restrict__ csr, u32* __restrict__ pos,
    float* __restrict__ wt, u64* __restrict__ table) {
    u32* sel_e = picks;
    float* sel_w = reinterpret_cast<float*>(picks + n * k);
    u32* sel_slot = picks + 2 * n * k;
    __shared__ u32 start[MOE_EXPERTS + 1];
    __shared__ u32 piece[MOE_EXPERTS];
    __shared__ u32 cur[MOE_EXPERTS];
    __shared__ u32 tok_at[MOE_ROWS + 1];
    __shared__ u32 totals[2];
    // each warp's picks of its current row
    __shared__ u32 picked[32][MOE_TOP_K];
    u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5, warps = blockDim.x >> 5;
    u32 nk = n * k;
    // 1. softmax and top-k, one warp per row
    if (ne <= 128) {
        route_rows<4>(logits, n, ne, k, norm, sel_e, sel_w, picked);
    } else if (ne <= 256) {
        route_rows<8>(logits, n, ne, k, norm, sel_e, sel_w, picked);
    } else if (ne <= 512) {
        route_rows<16>(logits, n, ne, k, norm, sel_e, sel_w, picked);
    } else {
        // (its registers spill: past 512 experts per layer)
        route_rows<MOE_EXPERTS / 32>(logits, n, ne, k, norm, sel_e, sel_w, picked);
    }
    __syncthreads();
    // 2. rows per held expert, then (one thread) their first slots and first pieces
    for (u32 e = tid; e < ne; e += blockDim.x) {
        start[e] = 0;
        cur[e] = 0;
    }
    __syncthreads();
    for (u32 q = tid; q < nk; q += blockDim.x) {
        u32 e = sel_e[q];
        if (experts[10 * (u64)e] != 0) atomicAdd(&start[e], 1u);
    }
    __syncthreads();
    if (tid == 0) {
        u32 s = 0, p = 0;
        for (u32 e = 0; e < ne; ++e) {
            u32 c = start[e];
            start[e] = s;
            piece[e] = p;
            s += c;
            p += (c + MOE_PIECE - 1) / MOE_PIECE;
        }
        start[ne] = s;
        totals[0] = s;
        totals[1] = p;
    }
    __syncthreads();
    // the slots of every pick
    for (u32 q = tid; q < nk; q += blockDim.x) {
        u32 e = sel_e[q], t = q / k;
        u32 slot = 0xffffffffu;
        if (experts[10 * (u64)e] != 0) {
            slot = start[e] + atomicAdd(&cur[e], 1u);
            slot_tok[slot] = t;
        }
        sel_slot[q] = slot;
    }
    for (u32 q = totals[0] + tid; q < cap; q += blockDim.x) slot_tok[q] = 0;
    // 4. the product table
    for (u32 e = tid; e < ne; e += blockDim.x) {
        u32 s0 = start[e], c = start[e + 1] - s0;
        const u64* ex = experts + 10 * (u64)e;
        for (u32 i = 0; MOE_PIECE * i < c; ++i) {
            u64 o = s0 + MOE_PIECE * i;
            u32 rows = min((u32)MOE_PIECE, c - MOE_PIECE * i);
            for (u32 prod = 0; prod < 3; ++prod) {
                u64 inp = prod < 2 ? h : f, out = prod < 2 ? f : h;
                u64 y = prod == 0 ? g2 : prod == 1 ? u2 : y2;
                u64* en = table + ((u64)prod * problems + piece[e] + i) * 8;
                en[0] = ex[1 + 3 * prod];
                en[1] = ex[2 + 3 * prod];
                en[2] = ex[3 + 3 * prod];
                en[3] = inp;
                en[4] = x + 4 * o * inp;
                en[5] = rows;
                en[6] = y + 4 * o * out;
                en[7] = y + 4 * ((u64)cap + o) * out;
            }
        }
    }
    for (u32 p = totals[1] + tid; p < problems; p += blockDim.x) {
        for (u32 prod = 0; prod < 3; ++prod) {
            u64* en = table + ((u64)prod * problems + p) * 8;
            for (u32 w = 0; w < 8; ++w) en[w] = 0;
        }
    }
    __syncthreads();
    // 3. per token, its held picks in expert order
    for (u32 t = tid; t < n; t += blockDim.x) {
        u32 c = 0;
        for (u32 j = 0; j < k; ++j) c += sel_slot[t * k + j] != 0xffffffffu;
        tok_at[t + 1] = c;
    }
    __syncthreads();
    if (tid == 0) {
        tok_at[0] = 0;
        for (u32 t = 0; t < n; ++t) tok_at[t + 1] += tok_at[t];
        for (u32 t = 0; t <= n; ++t) csr[t] = tok_at[t];
    }
    __syncthreads();
    for (u32 t = tid; t < n; t += blockDim.x) {
        u32 es[MOE_TOP_K], ss[MOE_TOP_K];
        float ws[MOE_TOP_K];
        u32 c = 0;
        for (u32 j = 0; j < k; ++j) {
            u32 q = t * k + j;
            if (sel_slot[q] == 0xffffffffu) continue;
            // insertion by expert index
            u32 i = c++;
            while (i > 0 && es[i - 1] > sel_e[q]) {
                es[i] = es[i - 1];
                ss[i] = ss[i - 1];
                ws[i] = ws[i - 1];
                --i;
            }
            es[i] = sel_e[q];
            ss[i] = sel_slot[q];
            ws[i] = sel_w[q];
        }
        for (u32 i = 0; i < c; ++i) {
            pos[tok_at[t] + i] = ss[i];
            wt[tok_at[t] + i] = ws[i];
        }
    }
}
