//! Kernels compiled at run time with NVRTC: fp32 → bf16 cast (round to nearest even, bit-exact
//! with `half::bf16::from_f32`, NaN payloads included), strided 2-D slice cast and copy, and a
//! deterministic pseudo-random fill used to build synthetic models on the device.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::modules::{compile, read_sm_count, KernelSet};
use crate::CudaError;
use lifecycle_layout::Region2d;

/// CUDA C source of the kernels. No header is included: bf16 rounding is done with integer
/// arithmetic exactly as `half` does it, so the module compiles without the toolkit's headers.
pub const KERNEL_SRC: &str = include_str!("../../../kernels/cast_copy.cu");

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

/// The cast, copy and fill kernels every rank loads at start ([`KERNEL_SRC`]).
pub const MAIN_KERNELS: KernelSet =
    KernelSet::new("lifecycle_cuda kernels", KERNEL_SRC).with_cuda_headers();

/// Compiles [`KERNEL_SRC`] for a device of compute capability (`major`, `minor`) (once per
/// process, see [`compile`]); the error lists every attempt and the fix.
pub fn compile_kernels(major: i32, minor: i32) -> Result<Ptx, CudaError> {
    compile(&MAIN_KERNELS, major, minor)
}

/// The kernels loaded into one device's context.
#[derive(Debug, Clone)]
pub struct Kernels {
    _module: Arc<CudaModule>,
    cast: CudaFunction,
    cast_v4: CudaFunction,
    copy16: CudaFunction,
    fill: CudaFunction,
    multi: CudaFunction,
    sm_count: u32,
    multi_blocks_per_sm: Arc<AtomicU32>,
}

/// Elements of one chunk of [`CastBatch`] work (the kernel's `CAST_CHUNK4` × 4).
pub const CAST_CHUNK_ELEMS: u64 = 1024 * 4;

/// Cap on the blocks per SM of a multi-cast launch unless [`Kernels::set_multi_blocks_per_sm`]
/// says otherwise; 0 (the default) means no cap: one short block per chunk (16 KB of fp32 read),
/// so whenever a higher-priority stream (staged casts, NCCL) has work, the block scheduler gives
/// it SMs within microseconds as local-cast blocks retire. Measured on an H200: 4.3 TB/s alone,
/// and the fastest T = 2 switch; a capped grid of long-lived looping blocks holds its SMs (and
/// their registers) until the whole launch is done, which starves the NCCL kernels.
pub const DEFAULT_MULTI_BLOCKS_PER_SM: u32 = 0;

/// Casts gathered for one launch of the multi-tensor cast kernel: each entry is a 2-D region of
/// fp32 at an element offset from a source base cast to bf16 at an element offset from a
/// destination base. Only regions the vectorised path can take are accepted (widths, pitches and
/// offsets multiples of 4 elements, sizes that fit the kernel's 32-bit fields); [`CastBatch::push`]
/// says `false` for the others so the caller casts them one by one.
///
/// ```
/// use lifecycle_cuda::CastBatch;
/// use lifecycle_layout::Region2d;
/// let mut batch = CastBatch::default();
/// assert!(batch.push(0, 0, Region2d { rows: 3, cols: 8, src_ld: 16, dst_ld: 8 }));
/// assert!(!batch.push(64, 32, Region2d { rows: 1, cols: 5, src_ld: 5, dst_ld: 5 })); // width 5
/// assert_eq!(batch.len(), 1);
/// assert_eq!(batch.chunks(), 1);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CastBatch {
    words: Vec<u64>,
    chunks: u64,
}

impl CastBatch {
    /// Words per descriptor in [`CastBatch::words`].
    pub const WORDS: usize = 5;

    /// Adds a cast; `false` (and nothing added) when the region does not fit the batched kernel.
    pub fn push(&mut self, src_off: u64, dst_off: u64, region: Region2d) -> bool {
        let r = region.normalized();
        if r.numel() == 0 {
            return true;
        }
        let fits32 = |x: u64| x <= u32::MAX as u64;
        let ok = r.cols.is_multiple_of(4)
            && r.src_ld.is_multiple_of(4)
            && r.dst_ld.is_multiple_of(4)
            && src_off.is_multiple_of(4)
            && dst_off.is_multiple_of(4)
            && fits32(r.rows)
            && fits32(r.cols / 4)
            && fits32(r.src_ld / 4)
            && fits32(r.dst_ld / 4);
        if !ok {
            return false;
        }
        let units = r.rows * (r.cols / 4);
        self.words.extend_from_slice(&[
            src_off / 4,
            dst_off / 4,
            self.chunks,
            r.rows | ((r.cols / 4) << 32),
            (r.src_ld / 4) | ((r.dst_ld / 4) << 32),
        ]);
        self.chunks += units.div_ceil(CAST_CHUNK_ELEMS / 4);
        true
    }

    /// Descriptors added.
    pub fn len(&self) -> usize {
        self.words.len() / Self::WORDS
    }

    /// Whether no descriptor was added.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// Chunks of work in all.
    pub fn chunks(&self) -> u64 {
        self.chunks
    }

    /// The descriptors as the kernel reads them (five little-endian words each).
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Appends `other`'s descriptors, renumbering its chunks after this batch's.
    pub fn extend(&mut self, other: &CastBatch) {
        for d in other.words.chunks_exact(Self::WORDS) {
            self.words
                .extend_from_slice(&[d[0], d[1], d[2] + self.chunks, d[3], d[4]]);
        }
        self.chunks += other.chunks;
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
    /// Streaming multiprocessors of the device.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

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
        let sm_count = read_sm_count(ctx, rank)?;
        Ok(Kernels {
            cast: f("cast_f32_bf16_2d")?,
            cast_v4: f("cast_f32_bf16_2d_v4")?,
            copy16: f("copy_u16_2d")?,
            fill: f("fill_uniform_f32")?,
            multi: f("cast_f32_bf16_multi")?,
            _module: module,
            sm_count,
            multi_blocks_per_sm: Arc::new(AtomicU32::new(DEFAULT_MULTI_BLOCKS_PER_SM)),
        })
    }

    /// Casts the fp32 region at device address `src` to bf16 at device address `dst` on
    /// `stream`, with the vectorised kernel when widths, pitches and addresses allow; a NaN or
    /// an infinity read sets the u32 at `nonfinite` to 1 (0: not reported).
    ///
    /// # Safety
    /// `src` must point to at least `(rows - 1) · src_ld + cols` readable f32 and `dst` to as many
    /// writable bf16 (`(rows - 1) · dst_ld + cols`) of the stream's device, alive until the
    /// stream has run the kernel, and nothing else may write them meanwhile; `nonfinite` 0 or a
    /// u32 of that device, alive as long.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn cast_f32_bf16(
        &self,
        stream: &CudaStream,
        src: u64,
        dst: u64,
        region: Region2d,
        nonfinite: u64,
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
            .arg(&dld)
            .arg(&nonfinite);
        // SAFETY: the caller guarantees the regions (and the flag) are valid device memory of
        // this stream's context; the argument list matches the kernel's signature (2 pointers,
        // 4 u64, the flag's pointer).
        unsafe { b.launch(cfg) }
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
        unsafe { b.launch(cfg) }
            .map_err(|e| CudaError::driver(rank, "launching the copy kernel", 0, e))?;
        Ok(())
    }

    /// Caps the blocks per SM of [`Kernels::cast_multi`] launches (0: one block per chunk, no
    /// cap; shared by clones).
    pub fn set_multi_blocks_per_sm(&self, blocks: u32) {
        self.multi_blocks_per_sm.store(blocks, Ordering::Relaxed);
    }

    /// Runs the casts of descriptors `first .. first + count` of a [`CastBatch`] whose words were
    /// uploaded to device address `descs`, in one launch: fp32 at `src` + each source offset to
    /// bf16 at `dst` + each destination offset. `chunk_lo .. chunk_hi` are those descriptors'
    /// chunks (from the batch they were pushed to).
    ///
    /// # Safety
    /// `descs` must hold the batch's words (alive until the kernel ran); every region of those
    /// descriptors must lie inside readable f32 memory at `src` (16-byte aligned) and writable
    /// bf16 memory at `dst` (8-byte aligned) of the stream's device, alive until the kernel ran,
    /// with no other writer meanwhile; `nonfinite` as for [`Kernels::cast_f32_bf16`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn cast_multi(
        &self,
        stream: &CudaStream,
        src: u64,
        dst: u64,
        descs: u64,
        first: usize,
        count: usize,
        chunks: std::ops::Range<u64>,
        nonfinite: u64,
        rank: usize,
    ) -> Result<(), CudaError> {
        if count == 0 || chunks.is_empty() {
            return Ok(());
        }
        if !src.is_multiple_of(16) || !dst.is_multiple_of(8) {
            return Err(CudaError::Invalid(format!(
                "multi-tensor cast: source {src:#x} must be 16-byte and destination {dst:#x} \
                 8-byte aligned"
            )));
        }
        // Chunk numbers are global to the batch: rebase them by shifting the descriptor pointer
        // and passing the chunk range's end; the kernel's binary search then starts at `first`.
        let d = descs + (first * CastBatch::WORDS * 8) as u64;
        let n = count as u32;
        let per_sm = self.multi_blocks_per_sm.load(Ordering::Relaxed) as u64;
        let total = chunks.end - chunks.start;
        let cap = if per_sm == 0 {
            i32::MAX as u64
        } else {
            self.sm_count as u64 * per_sm
        };
        let blocks = total.clamp(1, cap) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let lo = chunks.start;
        let end = chunks.end;
        let mut b = stream.launch_builder(&self.multi);
        b.arg(&src)
            .arg(&dst)
            .arg(&d)
            .arg(&n)
            .arg(&lo)
            .arg(&end)
            .arg(&nonfinite);
        // SAFETY: the caller guarantees the descriptors, every region they name and the flag
        // are valid device memory of this stream's context; the arguments match the kernel's
        // signature (3 pointers, u32, 2 u64, the flag's pointer).
        unsafe { b.launch(cfg) }
            .map_err(|e| CudaError::driver(rank, "launching the multi-tensor cast kernel", 0, e))?;
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
        unsafe { b.launch(cfg) }
            .map_err(|e| CudaError::driver(rank, "launching the fill kernel", 0, e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The multi-tensor kernel's indexing, step for step on the host: chunks `lo..end`, each
    /// thread's 4 units, the descriptor found by binary search over the words from `first`.
    fn emulate(
        words: &[u64],
        first: usize,
        count: usize,
        lo: u64,
        end: u64,
        src: &[f32],
        dst: &mut [u16],
    ) {
        let descs: Vec<&[u64]> = words
            .chunks_exact(CastBatch::WORDS)
            .skip(first)
            .take(count)
            .collect();
        for c in lo..end {
            let (mut a, mut b) = (0usize, descs.len() - 1);
            while a < b {
                let mid = (a + b).div_ceil(2);
                if descs[mid][2] <= c {
                    a = mid;
                } else {
                    b = mid - 1;
                }
            }
            let d = descs[a];
            let (rows, cols4) = (d[3] & 0xFFFF_FFFF, d[3] >> 32);
            let (sld4, dld4) = (d[4] & 0xFFFF_FFFF, d[4] >> 32);
            let n = rows * cols4;
            for t in 0..256u64 {
                for k in 0..4u64 {
                    let i = (c - d[2]) * 1024 + t + k * 256;
                    if i >= n {
                        continue;
                    }
                    let (r, col) = (i / cols4, i % cols4);
                    let s4 = d[0] + r * sld4 + col;
                    let d4 = d[1] + r * dld4 + col;
                    for e in 0..4 {
                        let v = src[(s4 * 4 + e) as usize];
                        dst[(d4 * 4 + e) as usize] = half::bf16::from_f32(v).to_bits();
                    }
                }
            }
        }
    }

    #[test]
    fn batch_descriptors_cover_every_region_once() {
        // Regions of several sizes (one spans many chunks), strided and dense, at scattered offsets.
        let regions = [
            (
                0u64,
                0u64,
                Region2d {
                    rows: 3,
                    cols: 8,
                    src_ld: 12,
                    dst_ld: 8,
                },
            ),
            (
                64,
                32,
                Region2d {
                    rows: 1,
                    cols: 20_000,
                    src_ld: 20_000,
                    dst_ld: 20_000,
                },
            ),
            (
                20_096,
                20_064,
                Region2d {
                    rows: 300,
                    cols: 64,
                    src_ld: 128,
                    dst_ld: 64,
                },
            ),
            (
                60_480,
                39_264,
                Region2d {
                    rows: 2,
                    cols: 4,
                    src_ld: 4,
                    dst_ld: 4,
                },
            ),
        ];
        let src: Vec<f32> = (0..61_000).map(|i| i as f32 * 0.37 - 9_000.0).collect();
        let mut want = vec![0u16; 40_000];
        let mut batch = CastBatch::default();
        for (so, d, r) in regions {
            assert!(batch.push(so, d, r));
            for row in 0..r.rows {
                for c in 0..r.cols {
                    let v = src[(so + row * r.src_ld + c) as usize];
                    want[(d + row * r.dst_ld + c) as usize] = half::bf16::from_f32(v).to_bits();
                }
            }
        }
        assert_eq!(batch.len(), 4);
        // One launch over everything, and two launches over the first two and the last two.
        let mut one = vec![0u16; 40_000];
        emulate(batch.words(), 0, 4, 0, batch.chunks(), &src, &mut one);
        assert_eq!(one, want);
        let mut two = vec![0u16; 40_000];
        let mid = batch.words()[2 * CastBatch::WORDS + 2];
        emulate(batch.words(), 0, 2, 0, mid, &src, &mut two);
        emulate(batch.words(), 2, 2, mid, batch.chunks(), &src, &mut two);
        assert_eq!(two, want);
    }

    #[test]
    fn batches_refuse_what_the_vector_path_cannot_take_and_extend_renumbers() {
        let mut b = CastBatch::default();
        let dense = |n| Region2d {
            rows: 1,
            cols: n,
            src_ld: n,
            dst_ld: n,
        };
        assert!(!b.push(2, 0, dense(8)), "source offset not a multiple of 4");
        assert!(
            !b.push(0, 6, dense(8)),
            "destination offset not a multiple of 4"
        );
        assert!(!b.push(
            0,
            0,
            Region2d {
                rows: 2,
                cols: 8,
                src_ld: 10,
                dst_ld: 8
            }
        ));
        assert!(
            b.push(0, 0, dense(0)),
            "empty regions are accepted and add nothing"
        );
        assert!(b.is_empty());
        assert!(b.push(0, 0, dense(CAST_CHUNK_ELEMS * 4 + 4)));
        assert_eq!(b.chunks(), 5);
        let mut c = CastBatch::default();
        assert!(c.push(16, 16, dense(4)));
        b.extend(&c);
        assert_eq!(b.len(), 2);
        assert_eq!(
            b.words()[CastBatch::WORDS + 2],
            5,
            "second batch's chunks follow the first's"
        );
        assert_eq!(b.chunks(), 6);
    }
}
