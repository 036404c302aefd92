//! The `Op::Quantise` step on the device: a rank's [`Quantise`] regions of its fp32 training
//! buffer written into its rollout buffer as block-scaled e4m3, all regions in one launch
//! (`kernels/fp8_quantise.cu`, its launch contract at its top). One thread block per 128 × 128
//! block finds its region in the job table and reads the block once into registers, reduces its
//! amax with warp shuffles, and writes its scale and its bytes (converted by the hardware's e4m3
//! conversion on sm_89 and later, by integer arithmetic before, and for blocks holding a
//! non-finite value). Bit-identical to the host step runner's quantisation.
//!
//! The same kernel over a bf16 source writes a Megatron backend's fp8 rollout from its bf16
//! staging buffer ([`quantise_staged`]).

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use half::bf16;
use lifecycle_layout::megatron::Fp8Rollout;
use lifecycle_layout::steps::Quantise;

use crate::{CudaError, KernelSet, RankCtx};

/// The element type a quantisation reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QuantiseSource {
    /// fp32 (the masters of a training buffer).
    F32,
    /// bf16 (a staging buffer).
    Bf16,
}

impl QuantiseSource {
    fn kernel(self) -> &'static str {
        match self {
            QuantiseSource::F32 => "quantize_e4m3_jobs",
            QuantiseSource::Bf16 => "quantize_e4m3_jobs_bf16",
        }
    }

    /// Threads per block: 32 × (128 / values held per thread ÷ 4), with the kernel's defaults
    /// of 8 float4 per thread over fp32 and 16 float4's worth (8 uint4 of bf16) over bf16.
    /// `quantise_probe` on an H200 at 32768² (2026-12-02 / 12-04): over fp32 8 per thread ran at
    /// 1.00× a device copy of the same bytes, 16 at 1.29×, 4 at 1.61×; over bf16, loads kept
    /// packed and the quotient by its fused correction, 16 at 0.98×, 8 at 1.24×, 4 at 2.05×.
    fn threads(self) -> u32 {
        match self {
            QuantiseSource::F32 => 512,
            QuantiseSource::Bf16 => 256,
        }
    }
}

/// The quantisation kernel, IEEE-exact (the divisions round as the host's do).
pub const QUANTISE_KERNELS: KernelSet = KernelSet::new(
    "lifecycle_cuda fp8 quantisation",
    include_str!("../../../kernels/fp8_quantise.cu"),
)
.exact();

/// Consecutive tiles one block quantises (the kernel's `QUANTISE_TILES_PER_BLOCK`): the second
/// tile of a job needs no search for its job.
const QUANTISE_TILES_PER_BLOCK: u32 = 2;

/// A rank's quantisations as the kernel reads them: seven words per region and the tile count.
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
        let mut table = Vec::with_capacity(7 * regions.len());
        let mut tiles = 0u64;
        for q in regions {
            table.extend_from_slice(&[
                q.src_off, q.dst_byte, q.scale, q.rows, q.cols, tiles, q.src_ld,
            ]);
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

    /// Queues the launch on `stream`: `source` is the rank's training buffer (or a staging
    /// buffer) holding `kind` elements, `rollout` its rollout buffer (both device addresses); a
    /// block holding a NaN or an infinity sets the u32 at `nonfinite` to 1 (0: not reported).
    ///
    /// # Safety
    /// `source` and `rollout` must be the buffers the regions were validated against
    /// ([`RankSteps::validate`](lifecycle_layout::steps::RankSteps::validate)), alive until the
    /// stream ran the launch, the rollout bytes the regions write not used by other work
    /// meanwhile; `nonfinite` 0 or a u32 of the device, alive as long.
    pub(crate) unsafe fn launch(
        &self,
        ctx: &RankCtx,
        stream: &CudaStream,
        kind: QuantiseSource,
        (source, rollout): (u64, u64),
        nonfinite: u64,
    ) -> Result<(), CudaError> {
        let m = ctx.module(&QUANTISE_KERNELS)?;
        let f = m.function(kind.kernel())?;
        // two tiles a block (QUANTISE_TILES_PER_BLOCK); limiting the grid to keep the tiles in flight inside L2 measured
        // slower on an H200 (17.1 against 15.3 ms at 7.6B, two-read kernel)
        let cfg = LaunchConfig {
            grid_dim: (self.tiles.div_ceil(QUANTISE_TILES_PER_BLOCK), 1, 1),
            block_dim: (kind.threads(), 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&f);
        b.arg(&source)
            .arg(&self.jobs)
            .arg(&self.count)
            .arg(&self.tiles)
            .arg(&rollout)
            .arg(&rollout)
            .arg(&nonfinite);
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

/// Writes one rank's fp8 rollout buffer `rollout` from its bf16 staging buffer `staging` as `f`
/// says (the Megatron backends' fp8 rollout, [`Fp8Rollout`]): the bf16 tensors copied, the
/// others quantised to block-scaled e4m3 in one launch, bit-identical to the host's
/// [`quantize_blocks`](lifecycle_layout::fp8::quantize_blocks) of the same values. Queued on the
/// rank's compute stream, which is synchronised before it returns (the staging buffer may be
/// freed then); returns the bytes written.
///
/// The buffers are checked against `f` first (lengths, and every copy and region inside
/// them): [`CudaError::Invalid`] naming what does not fit, before anything is queued.
pub fn quantise_staged(
    ctx: &RankCtx,
    f: &Fp8Rollout,
    staging: &CudaSlice<bf16>,
    rollout: &mut CudaSlice<bf16>,
) -> Result<u64, CudaError> {
    check_staged(ctx.rank, f, staging.len(), rollout.len())?;
    for c in &f.copies {
        let src = staging.slice(c.src..c.src + c.len);
        let mut dst = rollout.slice_mut(c.dst..c.dst + c.len);
        ctx.compute
            .memcpy_dtod(&src, &mut dst)
            .map_err(ctx.drv("copying the bf16 rollout tensors", 2 * c.len as u64))?;
    }
    if let Some(jobs) = QuantiseJobs::upload(ctx, &f.quantise)? {
        let (source, roll) = (ctx.addr(staging), ctx.addr_mut(rollout));
        // SAFETY: `check_staged` put every region's source inside `staging` and its bytes and
        // scales inside `rollout` (disjoint by `Fp8Rollout`'s construction); both buffers and
        // the job table outlive the launch, as the compute stream is synchronised below; no
        // non-finite report (0: the Megatron backend checks its bf16 parameters at plan time).
        unsafe { jobs.launch(ctx, &ctx.compute, QuantiseSource::Bf16, (source, roll), 0)? };
        ctx.compute
            .synchronize()
            .map_err(ctx.drv("quantising the rollout weights to fp8", jobs.bytes()))?;
    } else {
        ctx.compute
            .synchronize()
            .map_err(ctx.drv("copying the bf16 rollout tensors", 0))?;
    }
    Ok(f.bytes())
}

/// Every copy and region of `f` inside a staging buffer of `staging` elements and a rollout
/// buffer of `rollout` slots.
fn check_staged(
    rank: usize,
    f: &Fp8Rollout,
    staging: usize,
    rollout: usize,
) -> Result<(), CudaError> {
    let bad = |what: String| CudaError::Invalid(format!("rank {rank}: fp8 rollout pass: {what}"));
    if staging < f.staging_len || rollout < f.len {
        return Err(bad(format!(
            "buffers of {staging} staging elements and {rollout} rollout slots, expected at \
             least {} and {}",
            f.staging_len, f.len
        )));
    }
    let (staging, bytes) = (staging as u64, 2 * rollout as u64);
    for c in &f.copies {
        if c.src + c.len > staging as usize || c.dst + c.len > rollout {
            return Err(bad(format!("the copy {c:?} ends outside a buffer")));
        }
    }
    for q in &f.quantise {
        let n = q.rows * q.cols;
        let src_end = q.src_span().and_then(|s| s.checked_add(q.src_off));
        let fits = src_end.is_some_and(|e| e <= staging)
            && (q.rows <= 1 || q.src_ld >= q.cols)
            && q.dst_byte + n <= bytes
            && 4 * (q.scale + q.blocks()) <= bytes
            && q.dst_byte % 4 == 0;
        if !fits {
            return Err(bad(format!("the region {q:?} ends outside a buffer")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lifecycle_layout::megatron::StagedCopy;

    #[test]
    fn a_pass_that_does_not_fit_its_buffers_is_refused_by_name() {
        let f = Fp8Rollout {
            entries: Vec::new(),
            len: 128,
            staging_len: 128,
            copies: vec![StagedCopy {
                src: 0,
                dst: 0,
                len: 8,
            }],
            quantise: vec![Quantise {
                src_off: 0,
                dst_byte: 64,
                scale: 40,
                rows: 4,
                cols: 16,
                src_ld: 16,
            }],
        };
        assert!(check_staged(0, &f, 128, 128).is_ok());
        let short = check_staged(3, &f, 100, 128).unwrap_err().to_string();
        assert!(
            short.contains("rank 3") && short.contains("at least 128"),
            "{short}"
        );
        let mut far = f.clone();
        far.quantise[0].scale = 64;
        let err = check_staged(0, &far, 128, 128).unwrap_err().to_string();
        assert!(err.contains("region"), "{err}");
        let mut long = f;
        long.copies[0].len = 129;
        assert!(check_staged(0, &long, 128, 128).is_err());
    }
}
