//! The `Op::Quantise` step on the device: a rank's [`Quantise`] regions of its fp32 training
//! buffer written into its rollout buffer as block-scaled e4m3, all regions in one launch
//! (`kernels/fp8_quantise.cu`, its launch contract at its top). One thread block per 128 × 128
//! block finds its region in the job table and reads the block once into registers, reduces its
//! amax with warp shuffles, and writes its scale and its bytes (converted by the hardware's e4m3
//! conversion on sm_89 and later, by integer arithmetic before, and for blocks holding a
//! non-finite value). Bit-identical to the host step runner's quantisation.

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use lifecycle_layout::steps::Quantise;

use crate::{CudaError, KernelSet, RankCtx};

/// The quantisation kernel, IEEE-exact (the divisions round as the host's do).
pub const QUANTISE_KERNELS: KernelSet = KernelSet::new(
    "lifecycle_cuda fp8 quantisation",
    include_str!("../../../kernels/fp8_quantise.cu"),
)
.exact();

/// Threads per block: 32 × (128 / `QUANTISE_HELD`) with the kernel's default of 8 float4 per
/// thread (`quantise_probe` on an H200 at 32768²: 8 per thread ran at 1.02× a device copy of the
/// same bytes, 16 at 1.29×, 4 at 1.68×).
const QUANTISE_THREADS: u32 = 512;

/// A rank's quantisations as the kernel reads them: six words per region and the tile count.
#[derive(Debug)]
pub(crate) struct QuantiseJobs {
    jobs: CudaSlice<u64>,
    count: u32,
    tiles: u32,
    bytes: u64,
}

impl QuantiseJobs {
    /// The job table of `regions`, uploaded on the rank's compute stream; `None` without regions.
    pub(crate) fn upload(
        ctx: &RankCtx,
        regions: &[Quantise],
    ) -> Result<Option<QuantiseJobs>, CudaError> {
        if regions.is_empty() {
            return Ok(None);
        }
        let mut table = Vec::with_capacity(6 * regions.len());
        let mut tiles = 0u64;
        for q in regions {
            table.extend_from_slice(&[q.src_off, q.dst_byte, q.scale, q.rows, q.cols, tiles]);
            tiles += q.blocks();
        }
        let invalid = || {
            CudaError::Invalid(format!(
                "rank {}: {tiles} fp8 blocks in one switch exceed one launch",
                ctx.rank
            ))
        };
        let tiles = u32::try_from(tiles).map_err(|_| invalid())?;
        let count = u32::try_from(regions.len()).map_err(|_| invalid())?;
        let jobs = ctx
            .compute
            .clone_htod(&table)
            .map_err(ctx.drv("uploading the fp8 jobs", 8 * table.len() as u64))?;
        Ok(Some(QuantiseJobs {
            jobs,
            count,
            tiles,
            bytes: regions.iter().map(Quantise::bytes).sum(),
        }))
    }

    /// Bytes the launch writes.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Queues the launch on `stream`: `source` is the rank's fp32 training buffer, `rollout` its
    /// rollout buffer (both device addresses).
    ///
    /// # Safety
    /// `source` and `rollout` must be the buffers the regions were validated against
    /// ([`RankSteps::validate`](lifecycle_layout::steps::RankSteps::validate)), alive until the
    /// stream ran the launch, the rollout bytes the regions write not used by other work
    /// meanwhile.
    pub(crate) unsafe fn launch(
        &self,
        ctx: &RankCtx,
        stream: &CudaStream,
        source: u64,
        rollout: u64,
    ) -> Result<(), CudaError> {
        let m = ctx.module(&QUANTISE_KERNELS)?;
        let f = m.function("quantize_e4m3_jobs")?;
        // one block per tile: limiting the grid to keep the tiles in flight inside L2 measured
        // slower on an H200 (17.1 against 15.3 ms at 7.6B, two-read kernel)
        let cfg = LaunchConfig {
            grid_dim: (self.tiles, 1, 1),
            block_dim: (QUANTISE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&f);
        b.arg(&source)
            .arg(&self.jobs)
            .arg(&self.count)
            .arg(&self.tiles)
            .arg(&rollout)
            .arg(&rollout);
        // SAFETY: the rollout buffer is passed as both the byte and the scale pointer; every job
        // reads its region inside the source and writes its bytes and scales inside the rollout
        // buffer, disjoint from every other job (validated steps; this function's contract); the
        // argument list matches the kernel's; the job table lives in `self`, which the program
        // keeps until the stream ran.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| CudaError::driver(ctx.rank, "quantising the rollout weights to fp8", 0, e))
    }
}
