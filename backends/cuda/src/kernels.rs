//! Kernels compiled at run time with NVRTC: fp32 → bf16 cast (round to nearest even, bit-exact
//! with `half::bf16::from_f32`, NaN payloads included), strided 2-D slice cast and copy, and a
//! deterministic pseudo-random fill used to build synthetic models on the device.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use crate::env::{arch_candidates, find_cuda_include};
use crate::CudaError;

/// CUDA C source of the kernels. No header is included: bf16 rounding is done with integer
/// arithmetic exactly as `half` does it, so the module compiles without the toolkit's headers.
pub const KERNEL_SRC: &str = r#"
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 f2bf(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return ((x >> 16) | 0x0040u) & 0xFFFFu;
    if ((x & 0x8000u) != 0u && (x & 0x17FFFu) != 0u) return ((x >> 16) + 1u) & 0xFFFFu;
    return x >> 16;
}

// dst[r * dst_ld + c] = bf16(src[r * src_ld + c]) for r < rows, c < cols (element units).
extern "C" __global__ void cast_f32_bf16_2d(const float* __restrict__ src, u16* __restrict__ dst,
                                            u64 rows, u64 cols, u64 src_ld, u64 dst_ld) {
    u64 n = rows * cols;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (rows == 1) {
        for (; i < n; i += stride) dst[i] = (u16)f2bf(src[i]);
    } else {
        for (; i < n; i += stride) {
            u64 r = i / cols, c = i - r * cols;
            dst[r * dst_ld + c] = (u16)f2bf(src[r * src_ld + c]);
        }
    }
}

// The same in units of 4 elements: cols4, src_ld4, dst_ld4 count float4 / 4 x bf16; src must be
// 16-byte and dst 8-byte aligned.
extern "C" __global__ void cast_f32_bf16_2d_v4(const float4* __restrict__ src, uint2* __restrict__ dst,
                                               u64 rows, u64 cols4, u64 src_ld4, u64 dst_ld4) {
    u64 n = rows * cols4;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (rows == 1) {
        for (; i < n; i += stride) {
            float4 v = src[i];
            uint2 o; o.x = f2bf(v.x) | (f2bf(v.y) << 16); o.y = f2bf(v.z) | (f2bf(v.w) << 16);
            dst[i] = o;
        }
    } else if (n < 0xFFFFFFFFull) {
        u32 c4 = (u32)cols4;
        for (; i < n; i += stride) {
            u32 r = (u32)i / c4, c = (u32)i - r * c4;
            float4 v = src[(u64)r * src_ld4 + c];
            uint2 o; o.x = f2bf(v.x) | (f2bf(v.y) << 16); o.y = f2bf(v.z) | (f2bf(v.w) << 16);
            dst[(u64)r * dst_ld4 + c] = o;
        }
    } else {
        for (; i < n; i += stride) {
            u64 r = i / cols4, c = i - r * cols4;
            float4 v = src[r * src_ld4 + c];
            uint2 o; o.x = f2bf(v.x) | (f2bf(v.y) << 16); o.y = f2bf(v.z) | (f2bf(v.w) << 16);
            dst[r * dst_ld4 + c] = o;
        }
    }
}

// Strided 2-D copy of 16-bit elements (bf16 slices).
extern "C" __global__ void copy_u16_2d(const u16* __restrict__ src, u16* __restrict__ dst,
                                       u64 rows, u64 cols, u64 src_ld, u64 dst_ld) {
    u64 n = rows * cols;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u64 r = i / cols, c = i - r * cols;
        dst[r * dst_ld + c] = src[r * src_ld + c];
    }
}

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// dst[i] = scale * u with u uniform in [-1, 1), from splitmix64(seed + index_offset + i).
extern "C" __global__ void fill_uniform_f32(float* dst, u64 n, u64 seed, u64 index_offset, float scale) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u64 x = splitmix64(seed * 0x100000001B3ull + index_offset + i);
        float u = (float)(x >> 40) * (1.0f / 16777216.0f);
        dst[i] = scale * (2.0f * u - 1.0f);
    }
}
"#;

/// The host-side twin of the `fill_uniform_f32` kernel: the value at global index `i`.
pub fn fill_uniform_value(seed: u64, i: u64, scale: f32) -> f32 {
    let mut x = seed
        .wrapping_mul(0x100000001B3)
        .wrapping_add(i)
        .wrapping_add(0x9E3779B97F4A7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D049BB133111EB);
    x ^= x >> 31;
    let u = (x >> 40) as f32 * (1.0 / 16777216.0);
    scale * (2.0 * u - 1.0)
}

/// Compiles [`KERNEL_SRC`] for a device of compute capability (`major`, `minor`), trying the
/// architectures of [`arch_candidates`] in order; the error lists every attempt and the fix.
pub fn compile_kernels(major: i32, minor: i32) -> Result<Ptx, CudaError> {
    let include = find_cuda_include();
    let mut failures = Vec::new();
    let mut last_options = Vec::new();
    for arch in arch_candidates(major, minor) {
        let mut opts = CompileOptions {
            options: vec![format!("--gpu-architecture={arch}")],
            ..Default::default()
        };
        if let Some(p) = &include {
            opts.include_paths.push(p.display().to_string());
        }
        last_options = opts.options.clone();
        match compile_ptx_with_opts(KERNEL_SRC, opts) {
            Ok(ptx) => return Ok(ptx),
            Err(e) => failures.push(format!("{arch}: {e:?}")),
        }
    }
    Err(CudaError::Compile {
        module: "lifecycle_cuda kernels".into(),
        options: last_options,
        detail: format!(
            "{}; set LIFECYCLE_CUDA_ARCH (e.g. sm_90) to the GPU's architecture and \
             LIFECYCLE_CUDA_INCLUDE to the folder holding cuda_bf16.h if the defaults do not fit",
            failures.join("; ")
        ),
    })
}

/// The kernels loaded into one device's context.
#[derive(Debug, Clone)]
pub struct Kernels {
    _module: Arc<CudaModule>,
    cast: CudaFunction,
    cast_v4: CudaFunction,
    copy16: CudaFunction,
    fill: CudaFunction,
    sm_count: u32,
}

/// A strided 2-D region: `rows` × `cols` elements, row pitches `src_ld` / `dst_ld` in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region2d {
    /// Rows.
    pub rows: u64,
    /// Elements per row.
    pub cols: u64,
    /// Source row pitch in elements.
    pub src_ld: u64,
    /// Destination row pitch in elements.
    pub dst_ld: u64,
}

impl Region2d {
    /// Elements in the region.
    pub fn numel(&self) -> u64 {
        self.rows * self.cols
    }

    /// The same region as one row when both sides are dense (`src_ld == dst_ld == cols`).
    pub fn normalized(self) -> Region2d {
        if self.rows > 1 && self.src_ld == self.cols && self.dst_ld == self.cols {
            let n = self.rows * self.cols;
            Region2d {
                rows: 1,
                cols: n,
                src_ld: n,
                dst_ld: n,
            }
        } else {
            self
        }
    }
}

fn grid_for(units: u64, sm_count: u32) -> LaunchConfig {
    let blocks = units.div_ceil(256).clamp(1, sm_count as u64 * 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Kernels {
    /// Loads `ptx` into the context of `stream`.
    pub fn load(stream: &Arc<CudaStream>, ptx: Ptx, rank: usize) -> Result<Self, CudaError> {
        let ctx = stream.context();
        let module = ctx
            .load_module(ptx)
            .map_err(|e| CudaError::driver(rank, "loading the kernel module", 0, e))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| CudaError::driver(rank, format!("loading kernel {name}"), 0, e))
        };
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| CudaError::driver(rank, "reading the SM count", 0, e))?;
        Ok(Kernels {
            cast: f("cast_f32_bf16_2d")?,
            cast_v4: f("cast_f32_bf16_2d_v4")?,
            copy16: f("copy_u16_2d")?,
            fill: f("fill_uniform_f32")?,
            _module: module,
            sm_count: sm_count.max(1) as u32,
        })
    }

    /// Casts the fp32 region at device address `src` to bf16 at device address `dst` on
    /// `stream`, with the vectorised kernel when widths, pitches and addresses allow.
    ///
    /// # Safety
    /// `src` must point to at least `(rows - 1) · src_ld + cols` readable f32 and `dst` to as many
    /// writable bf16 (`(rows - 1) · dst_ld + cols`) of the stream's device, alive until the
    /// stream has run the kernel, and nothing else may write them meanwhile.
    pub unsafe fn cast_f32_bf16(
        &self,
        stream: &CudaStream,
        src: u64,
        dst: u64,
        region: Region2d,
        rank: usize,
    ) -> Result<(), CudaError> {
        let r = region.normalized();
        if r.numel() == 0 {
            return Ok(());
        }
        let vec_ok = r.cols.is_multiple_of(4)
            && r.src_ld.is_multiple_of(4)
            && r.dst_ld.is_multiple_of(4)
            && src.is_multiple_of(16)
            && dst.is_multiple_of(8);
        let (func, rows, cols, sld, dld) = if vec_ok {
            (
                &self.cast_v4,
                r.rows,
                r.cols / 4,
                r.src_ld / 4,
                r.dst_ld / 4,
            )
        } else {
            (&self.cast, r.rows, r.cols, r.src_ld, r.dst_ld)
        };
        let cfg = grid_for(rows * cols, self.sm_count);
        let mut b = stream.launch_builder(func);
        b.arg(&src)
            .arg(&dst)
            .arg(&rows)
            .arg(&cols)
            .arg(&sld)
            .arg(&dld);
        // SAFETY: the caller guarantees the regions are valid device memory of this stream's
        // context; the argument list matches the kernel's signature (2 pointers, 4 u64).
        b.launch(cfg)
            .map_err(|e| CudaError::driver(rank, "launching the cast kernel", 0, e))?;
        Ok(())
    }

    /// Copies a 2-D region of 16-bit elements from `src` to `dst` on `stream`.
    ///
    /// # Safety
    /// As for [`Kernels::cast_f32_bf16`], with 16-bit elements on both sides.
    pub unsafe fn copy_u16(
        &self,
        stream: &CudaStream,
        src: u64,
        dst: u64,
        region: Region2d,
        rank: usize,
    ) -> Result<(), CudaError> {
        let r = region.normalized();
        if r.numel() == 0 {
            return Ok(());
        }
        let cfg = grid_for(r.numel(), self.sm_count);
        let mut b = stream.launch_builder(&self.copy16);
        b.arg(&src)
            .arg(&dst)
            .arg(&r.rows)
            .arg(&r.cols)
            .arg(&r.src_ld)
            .arg(&r.dst_ld);
        // SAFETY: caller guarantees valid regions; arguments match the kernel's signature.
        b.launch(cfg)
            .map_err(|e| CudaError::driver(rank, "launching the copy kernel", 0, e))?;
        Ok(())
    }

    /// Fills `n` f32 at `dst` with `scale · u`, `u` uniform in [-1, 1) from a counter-based hash
    /// of (`seed`, `index_offset + i`); [`fill_uniform_value`] computes the same values on the host.
    ///
    /// # Safety
    /// `dst` must point to `n` writable f32 of the stream's device, alive until the kernel ran.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn fill_uniform(
        &self,
        stream: &CudaStream,
        dst: u64,
        n: u64,
        seed: u64,
        index_offset: u64,
        scale: f32,
        rank: usize,
    ) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        let cfg = grid_for(n, self.sm_count);
        let mut b = stream.launch_builder(&self.fill);
        b.arg(&dst)
            .arg(&n)
            .arg(&seed)
            .arg(&index_offset)
            .arg(&scale);
        // SAFETY: caller guarantees `dst` holds `n` f32; arguments match the kernel's signature.
        b.launch(cfg)
            .map_err(|e| CudaError::driver(rank, "launching the fill kernel", 0, e))?;
        Ok(())
    }
}
