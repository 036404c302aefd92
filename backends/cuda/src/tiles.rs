//! The tile copy kernel: one launch copies a list of [`Tile`](lifecycle_layout::steps::Tile)s between two
//! bf16 buffers, one thread block per tile, with 16-byte loads and stores when a tile's offsets,
//! pitches and width are multiples of 8 elements.

use std::sync::Arc;

use crate::{CudaError, KernelSet, RankCtx};
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use lifecycle_layout::steps::TILE_BYTES;

/// CUDA C source of the tile copy kernel (no header needed).
pub const TILE_KERNEL_SRC: &str = include_str!("../../../kernels/copy_tiles.cu");

/// [`TILE_KERNEL_SRC`] as a kernel set.
pub const TILE_KERNELS: KernelSet = KernelSet::new("lifecycle tile copy", TILE_KERNEL_SRC);

/// The copy kernel loaded on one rank's device.
#[derive(Debug, Clone)]
pub struct TileKernel {
    func: CudaFunction,
    sm_count: u32,
}

impl TileKernel {
    /// Loads [`TILE_KERNELS`] into this rank's context (compiled once per process).
    pub fn load(ctx: &RankCtx) -> Result<Self, CudaError> {
        let m = ctx.module(&TILE_KERNELS)?;
        Ok(TileKernel {
            func: m.function("copy_tiles_u16")?,
            sm_count: m.sm_count(),
        })
    }

    /// Copies tiles `range` of the tile table at device address `tiles` from the bf16 buffer at
    /// `src` to the one at `dst`, on `stream`, with at most `blocks_per_sm` blocks per SM.
    ///
    /// # Safety
    /// `tiles` must hold at least `range.end` tiles ([`TILE_BYTES`] each) on the stream's device;
    /// every tile of the range must lie inside both buffers; all of it must stay alive and
    /// unwritten by other work until the stream has run the kernel.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        stream: &Arc<CudaStream>,
        tiles: u64,
        range: std::ops::Range<usize>,
        src: u64,
        dst: u64,
        blocks_per_sm: u32,
        rank: usize,
    ) -> Result<(), CudaError> {
        let n = range.len();
        if n == 0 {
            return Ok(());
        }
        let first = tiles + (range.start * TILE_BYTES) as u64;
        let count = n as u32;
        let blocks = (n as u64).min(self.sm_count as u64 * blocks_per_sm.max(1) as u64) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&self.func);
        b.arg(&first).arg(&count).arg(&src).arg(&dst);
        // SAFETY: the caller guarantees the tile table and both buffers; the arguments match the
        // kernel's parameter list (pointer, u32, pointer, pointer).
        unsafe { b.launch(cfg) }
            .map_err(|e| CudaError::driver(rank, "launching the tile copy kernel", 0, e))?;
        Ok(())
    }
}
