// Launched by the peer-copy probe (bench/src/bin/peer_probe.rs): each launch's grid, block and argument contract is stated at its
// launcher there; the kernels below document what they read and write.
typedef unsigned long long u64;
extern "C" __global__ void copy16(const uint4* __restrict__ s, uint4* __restrict__ d, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) d[i] = s[i];
}
// rows x cols16 of 16-byte words; source rows spl words apart, destination rows dpl apart.
extern "C" __global__ void copy2d16(const uint4* __restrict__ s, uint4* __restrict__ d, u64 rows, u64 cols, u64 spl, u64 dpl) {
    u64 n = rows * cols;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 r = i / cols, c = i - r * cols;
        d[r * dpl + c] = s[r * spl + c];
    }
}
