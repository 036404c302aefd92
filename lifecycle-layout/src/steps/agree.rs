//! fp8 rollouts at W > 1: block scales agreed across the ranks before anything is quantised.
//!
//! A 128 × 128 block of a quantised tensor may hold rows of several FSDP shards. Its scale must
//! be the amax of the whole block, as if the tensor were quantised whole
//! ([`quantize_blocks`](crate::fp8::quantize_blocks)), yet no rank holds the block. The switch
//! agrees it in three moves, all in [`Fp8Agree`]:
//! 1. **partial amax** (auxiliary stream): each rank writes, for every block it holds rows of,
//!    the amax of those rows into its *scale grid* ([`Buf::Scales`]: one f32 per block of every
//!    quantised tensor, the same layout on every rank, zero where it holds nothing);
//! 2. **agreement** (network stream): one all-reduce by max of the grid, then every entry turned
//!    into its `scale_inv` ([`block_scale_inv`](crate::fp8::block_scale_inv)) — max is exact in
//!    any order, so every rank holds the full-tensor scales;
//! 3. **quantise with the agreed scales** (auxiliary stream): each piece a rank sends (or keeps)
//!    becomes e4m3 bytes in its own rollout buffer or in the *fp8 stage* ([`Buf::Fp8Stage`]),
//!    then the scale copies write each rank's rollout scales from its grid, and one network step
//!    moves the bytes (only fp8 crosses the links).

use std::ops::Range;

use super::Buf;
use crate::fp8::FP8_BLOCK;

const B: u64 = FP8_BLOCK as u64;

/// A region of the fp32 training buffer placed in its tensor's 128 × 128 block grid: `rows ×
/// cols` values (row pitch `src_ld`) from element `src_off`, whose first row is row `row0` of the
/// tensor and whose first column starts grid column `col_block0` (regions start on a block
/// column). Element (`i`, `c`) belongs to the block at grid index
/// `grid + ((row0 + i) / 128) · grid_cols + col_block0 + c / 128`.
///
/// ```
/// use lifecycle_layout::steps::GridRegion;
/// // rows 100..300 of a 2-block-wide tensor: block rows 0, 1 and 2
/// let r = GridRegion { src_off: 0, src_ld: 256, rows: 200, cols: 256, grid: 0, grid_cols: 2, row0: 100, col_block0: 0 };
/// assert_eq!((r.block_rows(), r.tiles()), (0..3, 6));
/// assert_eq!(r.grid_end(), 6);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GridRegion {
    /// First source element.
    pub src_off: u64,
    /// Source row pitch.
    pub src_ld: u64,
    /// Rows.
    pub rows: u64,
    /// Columns.
    pub cols: u64,
    /// f32 index, in the scale grid, of the tensor's block (0, 0).
    pub grid: u64,
    /// Blocks per row of the tensor's grid.
    pub grid_cols: u64,
    /// The tensor row of the region's first row.
    pub row0: u64,
    /// The grid column of the region's first column.
    pub col_block0: u64,
}

impl GridRegion {
    /// The tensor's block rows the region touches.
    pub fn block_rows(&self) -> Range<u64> {
        if self.rows == 0 {
            return 0..0;
        }
        self.row0 / B..(self.row0 + self.rows).div_ceil(B)
    }

    /// Block columns the region covers.
    pub fn block_cols(&self) -> u64 {
        self.cols.div_ceil(B)
    }

    /// Blocks (partly) inside the region: one thread block each on the GPU.
    pub fn tiles(&self) -> u64 {
        let r = self.block_rows();
        (r.end - r.start) * self.block_cols()
    }

    /// One past the last grid entry the region touches (0 when empty).
    pub fn grid_end(&self) -> u64 {
        let r = self.block_rows();
        if r.is_empty() || self.cols == 0 {
            return 0;
        }
        self.grid + (r.end - 1) * self.grid_cols + self.col_block0 + self.block_cols()
    }
}

/// A region quantised with the agreed scales: every value `e4m3(x / scale_inv)` of its block's
/// grid entry, into `rows × cols` bytes (row pitch `cols`) from byte `dst_byte` of `dst` (the
/// rank's [`Buf::Rollout`] or [`Buf::Fp8Stage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgreedQuantise {
    /// What is read, and where its scales are.
    pub region: GridRegion,
    /// The buffer written.
    pub dst: Buf,
    /// First byte written.
    pub dst_byte: u64,
}

impl AgreedQuantise {
    /// Bytes written.
    pub fn bytes(&self) -> u64 {
        self.region.rows * self.region.cols
    }
}

/// A rank's part in an fp8 switch at W > 1, where a 128 × 128 block may hold rows of several
/// FSDP shards: each rank writes the partial amax of the rows it holds into a scale grid (one
/// f32 per block, the same layout on every rank), the grids are agreed by one all-reduce by max
/// and turned into `scale_inv`s, then each rank quantises its pieces with the agreed scales, so
/// only e4m3 bytes cross the links.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fp8Agree {
    /// f32 entries of the scale grid (the same on every rank).
    pub grid_elems: u64,
    /// bf16-sized (2-byte) elements of the fp8 stage: bytes of pieces sent that the rank's
    /// rollout buffer does not hold.
    pub stage_elems: u64,
    /// Partial amaxes: the rows the rank holds of every quantised tensor.
    pub amax: Vec<GridRegion>,
    /// Pieces quantised with the agreed scales.
    pub quantise: Vec<AgreedQuantise>,
    /// Copies (a range of [`RankSteps::copies`](super::RankSteps::copies)) from the scale grid
    /// into the rollout buffer's scales, after the quantisation.
    pub scale_copies: Range<usize>,
    /// The network step (position) that moves the bytes: it waits for the quantisation.
    pub step: Option<usize>,
}

impl Fp8Agree {
    /// Bytes the quantisation writes.
    pub fn quantised_bytes(&self) -> u64 {
        self.quantise.iter().map(AgreedQuantise::bytes).sum()
    }

    /// Device bytes of the grid and the stage.
    pub fn scratch_bytes(&self) -> u64 {
        4 * self.grid_elems + 2 * self.stage_elems
    }
}
