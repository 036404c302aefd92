// Launched by lifecycle_cuda::VerifyKernels (backends/cuda/src/verify.rs): each launch's grid, block and argument contract is stated at its
// launcher there; the kernels below document what they read and write.
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u64 fmix64(u64 x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

// One block per chunk (grid-stride over chunks); blockDim.x must be a multiple of 32, <= 1024.
template <typename W, int SHIFT>
__device__ void hash_chunks(const W* __restrict__ data, const u64* __restrict__ offs,
                            const u64* __restrict__ lens, u64 nchunks, u64* __restrict__ out) {
    __shared__ u64 part[32];
    for (u64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const W* p = data + offs[c];
        u64 n = lens[c];
        u64 acc = 0;
        for (u64 j = threadIdx.x; j < n; j += blockDim.x) acc += fmix64((j << SHIFT) | (u64)p[j]);
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
        if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
        __syncthreads();
        if (threadIdx.x < 32) {
            u64 v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0ull;
            for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
            if (threadIdx.x == 0) out[c] = fmix64(v ^ (n * 0x9E3779B97F4A7C15ull));
        }
        __syncthreads();
    }
}

extern "C" __global__ void hash_chunks_b32(const u32* data, const u64* offs, const u64* lens,
                                           u64 nchunks, u64* out) {
    hash_chunks<u32, 32>(data, offs, lens, nchunks, out);
}

extern "C" __global__ void hash_chunks_b16(const u16* data, const u64* offs, const u64* lens,
                                           u64 nchunks, u64* out) {
    hash_chunks<u16, 16>(data, offs, lens, nchunks, out);
}

// *out_min = the smallest word index (offs[c] + j) holding a NaN or an infinity (exponent bits
// all ones); left unchanged when there is none.
extern "C" __global__ void first_nonfinite_f32(const u32* __restrict__ data,
                                               const u64* __restrict__ offs,
                                               const u64* __restrict__ lens, u64 nchunks,
                                               u64* out_min) {
    for (u64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const u32* p = data + offs[c];
        u64 n = lens[c];
        for (u64 j = threadIdx.x; j < n; j += blockDim.x)
            if ((p[j] & 0x7F800000u) == 0x7F800000u) atomicMin(out_min, offs[c] + j);
    }
}

// As first_nonfinite_f32 over bf16 words.
extern "C" __global__ void first_nonfinite_bf16(const u16* __restrict__ data,
                                                const u64* __restrict__ offs,
                                                const u64* __restrict__ lens, u64 nchunks,
                                                u64* out_min) {
    for (u64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const u16* p = data + offs[c];
        u64 n = lens[c];
        for (u64 j = threadIdx.x; j < n; j += blockDim.x)
            if ((p[j] & 0x7F80u) == 0x7F80u) atomicMin(out_min, offs[c] + j);
    }
}
