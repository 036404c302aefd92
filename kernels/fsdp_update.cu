// Launched by lifecycle_fsdp::UpdateKernels (backends/fsdp/src/update_kernels.rs): each launch's grid, block and argument contract is stated at its
// launcher there; the kernels below document what they read and write.
typedef unsigned long long u64;

__device__ __forceinline__ u64 mix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// g[i] = scale * (2u - 1), u = (top 24 bits of mix64(key + index_offset + i)) / 2^24.
extern "C" __global__ void synthetic_grads(float* __restrict__ g, u64 n, u64 key,
                                           u64 index_offset, float scale) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u64 x = mix64(key + index_offset + i);
        float u = (float)(x >> 40) * (1.0f / 16777216.0f);
        g[i] = scale * (2.0f * u - 1.0f);
    }
}

// One Adam step with bias corrections c1 = 1 - beta1^t, c2 = 1 - beta2^t, in the host's order:
//   m = beta1*m + (1-beta1)*g;  v = beta2*v + ((1-beta2)*g)*g;
//   w = w - (lr * (m/c1)) / (sqrt(v/c2) + eps)
extern "C" __global__ void adam_step(float* __restrict__ w, float* __restrict__ m,
                                     float* __restrict__ v, const float* __restrict__ g, u64 n,
                                     float beta1, float beta2, float one_minus_beta1,
                                     float one_minus_beta2, float c1, float c2, float lr,
                                     float eps) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float gi = g[i];
        float mi = beta1 * m[i] + one_minus_beta1 * gi;
        float vi = beta2 * v[i] + one_minus_beta2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float m_hat = mi / c1;
        float v_hat = vi / c2;
        w[i] = w[i] - lr * m_hat / (sqrtf(v_hat) + eps);
    }
}
