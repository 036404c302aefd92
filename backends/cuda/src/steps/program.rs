//! A rank's steps compiled for the device ([`DeviceProgram`]: its program and the tables its
//! copies read, uploaded once), what a run reads ([`SourceBuf`]) and how ([`RunOptions`]), and
//! the slot that keeps a program across switches ([`ProgramSlot`]).

use std::ops::Range;

use cudarc::driver::CudaSlice;
use half::bf16;

use lifecycle_layout::steps::{
    compile, push_tiles, Buf, Engine, Op, Program, RankSteps, SourceType, Tile, TILE_BYTES,
};

use crate::agree::AgreedJobs;
use crate::quantise::QuantiseJobs;
use crate::{CastBatch, CudaError, RankCtx, TileKernel};

/// How one run of copies is launched.
#[derive(Debug, Clone)]
pub(super) struct Launch {
    pub(super) src: Buf,
    pub(super) dst: Buf,
    /// Descriptors `first .. first + count` of the cast batch, covering chunks `chunks`.
    pub(super) casts: Option<(usize, usize, Range<u64>)>,
    /// Copies cast by a launch of their own (regions the batched kernel does not take).
    pub(super) single_casts: Vec<usize>,
    /// Tiles of the tile table.
    pub(super) tiles: Range<usize>,
    /// Copies run by the driver.
    pub(super) driver: Vec<usize>,
}

/// A rank's compiled steps with their copy tables on the rank's device.
#[derive(Debug)]
pub struct DeviceProgram {
    pub(super) steps: RankSteps,
    pub(super) program: Program,
    pub(super) launches: Vec<Option<Launch>>,
    pub(super) descs: Option<CudaSlice<u64>>,
    pub(super) tiles: CudaSlice<u8>,
    pub(super) tile_kernel: TileKernel,
    pub(super) quantise: Option<QuantiseJobs>,
    pub(super) agreed: Option<AgreedJobs>,
}

/// The training buffer a rank's switch reads.
#[derive(Debug, Clone, Copy)]
pub enum SourceBuf<'a> {
    /// fp32 masters.
    F32(&'a CudaSlice<f32>),
    /// bf16 parameters.
    Bf16(&'a CudaSlice<bf16>),
}

impl SourceBuf<'_> {
    /// Elements of the buffer.
    pub fn len(&self) -> usize {
        match self {
            SourceBuf::F32(s) => s.len(),
            SourceBuf::Bf16(s) => s.len(),
        }
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(super) fn dtype(&self) -> SourceType {
        match self {
            SourceBuf::F32(_) => SourceType::F32,
            SourceBuf::Bf16(_) => SourceType::Bf16,
        }
    }
}

/// Launch settings of [`run_program`](super::run_program).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunOptions {
    /// Thread blocks per SM of the tile kernel for copies that share the GPU with network work
    /// (others use 8).
    pub overlap_blocks_per_sm: u32,
}

impl Default for RunOptions {
    /// 4 blocks per SM next to network work.
    fn default() -> Self {
        RunOptions {
            overlap_blocks_per_sm: 4,
        }
    }
}

impl DeviceProgram {
    /// Compiles `steps` and uploads their copy tables on this rank's compute stream. With
    /// `batched_casts`, fp32 casts go through the multi-tensor kernel (one launch per run of
    /// copies); otherwise each cast is a launch of its own.
    pub fn new(ctx: &RankCtx, steps: RankSteps, batched_casts: bool) -> Result<Self, CudaError> {
        let program = compile(&steps).map_err(|e| CudaError::Invalid(e.to_string()))?;
        let mut batch = CastBatch::default();
        let mut tiles: Vec<Tile> = Vec::new();
        let mut launches = Vec::with_capacity(program.ops().len());
        for op in program.ops() {
            let Op::Copies { copies, .. } = op else {
                launches.push(None);
                continue;
            };
            let Some(first) = steps.copies.get(copies.start) else {
                launches.push(None);
                continue;
            };
            let mut l = Launch {
                src: first.src,
                dst: first.dst,
                casts: None,
                single_casts: Vec::new(),
                tiles: 0..0,
                driver: Vec::new(),
            };
            let (d0, c0, t0) = (batch.len(), batch.chunks(), tiles.len());
            for i in copies.clone() {
                let c = &steps.copies[i];
                if (c.src, c.dst) != (l.src, l.dst) {
                    return Err(CudaError::Invalid(format!(
                        "rank {}: copies {copies:?} mix buffers ({:?} → {:?} and {:?} → {:?}); \
                         one run of copies reads one buffer and writes one",
                        steps.rank, l.src, l.dst, c.src, c.dst
                    )));
                }
                match c.engine {
                    Engine::Driver => l.driver.push(i),
                    Engine::Kernel if c.src == Buf::Source && steps.source == SourceType::F32 => {
                        if !(batched_casts && batch.push(c.src_off, c.dst_off, c.region)) {
                            l.single_casts.push(i);
                        }
                    }
                    Engine::Kernel => push_tiles(c.src_off, c.dst_off, c.region, &mut tiles),
                }
            }
            if batch.len() > d0 {
                l.casts = Some((d0, batch.len() - d0, c0..batch.chunks()));
            }
            l.tiles = t0..tiles.len();
            launches.push(Some(l));
        }
        let upload = |what: &str, n: u64| ctx.drv(what, n);
        let descs = if batch.is_empty() {
            None
        } else {
            let words = batch.words();
            Some(
                ctx.compute
                    .clone_htod(words)
                    .map_err(upload("uploading cast descriptors", 8 * words.len() as u64))?,
            )
        };
        let mut bytes = Vec::with_capacity(tiles.len().max(1) * TILE_BYTES);
        for t in &tiles {
            t.write_bytes(&mut bytes);
        }
        bytes.resize(bytes.len().max(TILE_BYTES), 0);
        let tiles = ctx
            .compute
            .clone_htod(&bytes)
            .map_err(upload("uploading the copy tiles", bytes.len() as u64))?;
        let quantise = QuantiseJobs::upload(ctx, &steps.quantise)?;
        let agreed = match &steps.agree {
            Some(a) => Some(AgreedJobs::upload(ctx, a)?),
            None => None,
        };
        Ok(DeviceProgram {
            steps,
            program,
            launches,
            descs,
            tiles,
            tile_kernel: TileKernel::load(ctx)?,
            quantise,
            agreed,
        })
    }

    /// The steps this program runs.
    pub fn steps(&self) -> &RankSteps {
        &self.steps
    }

    /// The compiled program.
    pub fn program(&self) -> &Program {
        &self.program
    }
}

/// A rank's step program kept while the plan it was built for is current (`K` names the plan:
/// an id, or a handle that compares by identity).
#[derive(Debug)]
pub struct ProgramSlot<K> {
    entry: Option<(K, DeviceProgram)>,
}

impl<K> Default for ProgramSlot<K> {
    fn default() -> Self {
        ProgramSlot { entry: None }
    }
}

impl<K: PartialEq> ProgramSlot<K> {
    /// The program built for `key`: the kept one, or a new one from `steps()` (compiled and
    /// uploaded on this rank, replacing the old one).
    pub fn get_or_build(
        &mut self,
        ctx: &RankCtx,
        key: K,
        batched_casts: bool,
        steps: impl FnOnce() -> Result<RankSteps, lifecycle_layout::LayoutError>,
    ) -> Result<&DeviceProgram, CudaError> {
        if !self.entry.as_ref().is_some_and(|(k, _)| *k == key) {
            self.entry = None;
            let steps = steps().map_err(|e| CudaError::Invalid(e.to_string()))?;
            self.entry = Some((key, DeviceProgram::new(ctx, steps, batched_casts)?));
        }
        match &self.entry {
            Some((_, program)) => Ok(program),
            None => Err(CudaError::Invalid(format!(
                "rank {}: no step program",
                ctx.rank
            ))),
        }
    }
}
