// Launched by the read-rate probe of the decode benchmark (bench/src/bin/decode_bench.rs,
// `read_rate`): its grid, block and argument contract is stated at its launcher there; the kernel
// below documents what it reads and writes.
typedef unsigned long long u64;

// 16-byte loads each thread has in flight per trip of the main loop.
#define READ_UNROLL 8

// Reads the n 16-byte words of src once and writes one word per block: the sum over the block's
// threads of the words' lanes xor-ed together, to out[blockIdx.x] (gridDim.x words), so the loads
// cannot be dropped and the bytes written (4 per block) are nothing beside those read. A
// grid-stride loop takes any grid; blockDim.x must be a multiple of 32, at most 256. Each trip
// of the main loop issues READ_UNROLL non-coherent 16-byte loads one grid stride apart before it
// uses any of them (the warp's loads of one trip are 512 contiguous bytes each), so a thread
// keeps 128 bytes in flight.
extern "C" __global__ void __launch_bounds__(256)
read16(const uint4* __restrict__ src, u64 n, unsigned* __restrict__ out) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    unsigned acc = 0;
    for (; i + (READ_UNROLL - 1) * stride < n; i += READ_UNROLL * stride) {
        uint4 v[READ_UNROLL];
#pragma unroll
        for (int u = 0; u < READ_UNROLL; u++) v[u] = __ldg(src + i + u * stride);
#pragma unroll
        for (int u = 0; u < READ_UNROLL; u++) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) {
        uint4 v = __ldg(src + i);
        acc += v.x ^ v.y ^ v.z ^ v.w;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    __shared__ unsigned warps[8];
    if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned total = 0;
        for (unsigned w = 0; w < blockDim.x / 32; w++) total += warps[w];
        out[blockIdx.x] = total;
    }
}
