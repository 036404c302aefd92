// Launched by lifecycle_cuda::TileKernel (backends/cuda/src/tiles.rs): each launch's grid, block and argument contract is stated at its
// launcher there; the kernels below document what they read and write.
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

struct Tile { u64 src; u64 dst; u64 src_ld; u64 dst_ld; u32 rows; u32 cols; };

// For every tile t in [0, ntiles): dst[t.dst + r * t.dst_ld + c] = src[t.src + r * t.src_ld + c]
// for r < t.rows, c < t.cols (16-bit elements). Blocks stride over the tiles.
extern "C" __global__ void copy_tiles_u16(const Tile* __restrict__ tiles, u32 ntiles,
                                          const u16* __restrict__ src, u16* __restrict__ dst) {
    for (u32 t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const Tile d = tiles[t];
        const u32 rows = d.rows, cols = d.cols;
        const u32 bs = blockDim.x;
        if (((d.src | d.dst | d.src_ld | d.dst_ld | (u64)cols) & 7ull) == 0ull) {
            const uint4* s = (const uint4*)(src + d.src);
            uint4* o = (uint4*)(dst + d.dst);
            const u32 c = cols >> 3;
            const u64 sl = d.src_ld >> 3, dl = d.dst_ld >> 3;
            const u32 n = rows * c;
            if (rows == 1) {
                u32 i = threadIdx.x;
                for (; i + 3u * bs < n; i += 4u * bs) {
                    uint4 a = s[i], b = s[i + bs], e = s[i + 2u * bs], f = s[i + 3u * bs];
                    o[i] = a; o[i + bs] = b; o[i + 2u * bs] = e; o[i + 3u * bs] = f;
                }
                for (; i < n; i += bs) o[i] = s[i];
            } else {
                for (u32 i = threadIdx.x; i < n; i += bs) {
                    u32 r = i / c, k = i - r * c;
                    o[(u64)r * dl + k] = s[(u64)r * sl + k];
                }
            }
        } else {
            const u16* s = src + d.src;
            u16* o = dst + d.dst;
            const u32 n = rows * cols;
            for (u32 i = threadIdx.x; i < n; i += bs) {
                u32 r = i / cols, k = i - r * cols;
                o[(u64)r * d.dst_ld + k] = s[(u64)r * d.src_ld + k];
            }
        }
    }
}
