// Launched by the overlap probe (bench/src/bin/overlap_probe.rs): SM writes timed beside
// copy-engine work, and a pause on a stream. Grids and arguments are stated at the launches.

// dst[i] = i for i < n: a grid-stride loop of 256-thread blocks.
extern "C" __global__ void write_words(unsigned* dst, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * 256ull + threadIdx.x; i < n; i += gridDim.x * 256ull)
        dst[i] = (unsigned)i;
}

// Sleeps about `ns` nanoseconds (one thread): a pause on the stream it is queued on.
extern "C" __global__ void spin(unsigned ns) { __nanosleep(ns); }
