//! fp8 at W > 1 on the device ([`Fp8Agree`]): the partial amaxes, the agreement and the
//! quantisation with the agreed scales (`kernels/fp8_quantise.cu`, below its first kernel).
//!
//! The agreement runs on the network stream. With NCCL it is one all-reduce by max of the scale
//! grid, then every entry turned into its `scale_inv` in place. Ranks sharing one GPU have no
//! communicator: they meet at a [`Rendezvous`] instead. Each rank finishes its partial amaxes and
//! publishes its grid's address. It copies every peer's grid next to its own and reduces them
//! itself, then waits until every peer has copied its grid before that grid may be freed.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use lifecycle_layout::steps::{Buf, Fp8Agree, GridRegion};

use crate::quantise::QUANTISE_KERNELS;
use crate::{CudaError, RankCtx};

/// Threads per block of the grid kernels (`GRID_THREADS` in the kernel file).
const GRID_THREADS: u32 = 256;

/// One table of grid jobs (11 words each, `GRID_JOB` in the kernel file) and its tile count.
#[derive(Debug)]
struct GridJobs {
    jobs: CudaSlice<u64>,
    count: u32,
    tiles: u32,
}

impl GridJobs {
    /// The table of `regions` (with their destinations: `(byte, 0 rollout / 1 stage)`);
    /// `None` without regions.
    fn upload(
        ctx: &RankCtx,
        regions: impl Iterator<Item = (GridRegion, u64, u64)>,
        what: &str,
    ) -> Result<Option<GridJobs>, CudaError> {
        let mut table = Vec::new();
        let (mut tiles, mut count) = (0u64, 0u64);
        for (r, byte, dst) in regions {
            table.extend_from_slice(&[
                r.src_off,
                r.src_ld,
                r.rows,
                r.cols,
                r.grid,
                r.grid_cols,
                r.row0,
                r.col_block0,
                byte,
                dst,
                tiles,
            ]);
            tiles += r.tiles();
            count += 1;
        }
        if count == 0 {
            return Ok(None);
        }
        let invalid = || {
            CudaError::Invalid(format!(
                "rank {}: {tiles} fp8 blocks of {what} in one switch exceed one launch",
                ctx.rank
            ))
        };
        let jobs = ctx
            .compute
            .clone_htod(&table)
            .map_err(ctx.drv("uploading the fp8 grid jobs", 8 * table.len() as u64))?;
        Ok(Some(GridJobs {
            jobs,
            count: u32::try_from(count).map_err(|_| invalid())?,
            tiles: u32::try_from(tiles).map_err(|_| invalid())?,
        }))
    }

    fn config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.tiles, 1, 1),
            block_dim: (GRID_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// A rank's agreed fp8 jobs on its device: the partial amaxes and the quantisations.
#[derive(Debug)]
pub(crate) struct AgreedJobs {
    amax: Option<GridJobs>,
    quantise: Option<GridJobs>,
    grid_elems: u64,
    bytes: u64,
}

impl AgreedJobs {
    /// The tables of `agree`, uploaded on the rank's compute stream.
    pub(crate) fn upload(ctx: &RankCtx, agree: &Fp8Agree) -> Result<AgreedJobs, CudaError> {
        let amax = GridJobs::upload(ctx, agree.amax.iter().map(|r| (*r, 0, 0)), "amax")?;
        let quantise = GridJobs::upload(
            ctx,
            agree.quantise.iter().map(|q| {
                let stage = u64::from(q.dst == Buf::Fp8Stage);
                (q.region, q.dst_byte, stage)
            }),
            "quantisation",
        )?;
        Ok(AgreedJobs {
            amax,
            quantise,
            grid_elems: agree.grid_elems,
            bytes: agree.quantised_bytes(),
        })
    }

    /// Bytes the quantisation writes.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Entries of the scale grid.
    pub(crate) fn grid_elems(&self) -> u64 {
        self.grid_elems
    }

    /// Queues the zeroing of `grid` and the partial amaxes into it on `stream`; a NaN or an
    /// infinity read sets the u32 at `nonfinite` to 1 (0: not reported).
    ///
    /// # Safety
    /// `source` must be the fp32 training buffer the jobs were validated against and `grid` a
    /// buffer of at least [`AgreedJobs::grid_elems`] floats, both alive until the stream ran
    /// the launch, the grid used by no other work meanwhile; `nonfinite` 0 or a u32 of the
    /// device, alive as long.
    pub(crate) unsafe fn amax(
        &self,
        ctx: &RankCtx,
        stream: &Arc<CudaStream>,
        source: u64,
        grid: &mut CudaSlice<f32>,
        nonfinite: u64,
    ) -> Result<(), CudaError> {
        stream
            .memset_zeros(grid)
            .map_err(ctx.drv("zeroing the fp8 scale grid", 4 * self.grid_elems))?;
        let Some(jobs) = &self.amax else {
            return Ok(());
        };
        let f = ctx.module(&QUANTISE_KERNELS)?.function("fp8_grid_amax")?;
        let grid = ctx.addr_mut(grid);
        let mut b = stream.launch_builder(&f);
        b.arg(&source)
            .arg(&jobs.jobs)
            .arg(&jobs.count)
            .arg(&jobs.tiles)
            .arg(&grid)
            .arg(&nonfinite);
        // SAFETY: every job reads its region inside the training buffer and writes the grid
        // entries of its blocks, inside the grid (validated steps: the grid holds
        // `grid_elems` entries; this function's contract); no two jobs of a rank share an entry
        // (one job per tensor); the table lives in `self`, kept until the stream ran.
        unsafe { b.launch(jobs.config()) }
            .map(|_| ())
            .map_err(|e| CudaError::driver(ctx.rank, "the fp8 partial amaxes", 0, e))
    }

    /// Queues the quantisation with the agreed scales in `grid` on `stream`.
    ///
    /// # Safety
    /// `source`, `rollout` and `stage` must be the buffers the jobs were validated against
    /// (training buffer, rollout buffer, fp8 stage), `grid` the agreed grid, all alive until
    /// the stream ran the launch; the bytes written are used by no other work meanwhile.
    pub(crate) unsafe fn quantise(
        &self,
        ctx: &RankCtx,
        stream: &CudaStream,
        source: u64,
        grid: u64,
        (rollout, stage): (u64, u64),
    ) -> Result<(), CudaError> {
        let Some(jobs) = &self.quantise else {
            return Ok(());
        };
        let f = ctx
            .module(&QUANTISE_KERNELS)?
            .function("fp8_grid_quantise")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&source)
            .arg(&jobs.jobs)
            .arg(&jobs.count)
            .arg(&jobs.tiles)
            .arg(&grid)
            .arg(&rollout)
            .arg(&stage);
        // SAFETY: every job reads its region inside the training buffer and its blocks' entries
        // inside the grid, and writes its bytes inside the rollout buffer or the stage, disjoint
        // from every other job's (validated steps; this function's contract); the table lives
        // in `self`.
        unsafe { b.launch(jobs.config()) }
            .map(|_| ())
            .map_err(|e| CudaError::driver(ctx.rank, "quantising with the agreed fp8 scales", 0, e))
    }
}

/// Queues `out[i] = scale_inv(max over parts of entry i)` for the `n` entries on `stream`:
/// `parts` holds the device addresses of the partial grids (`out` itself after an
/// all-reduce).
///
/// # Safety
/// Every address in `parts` and `out` must hold `n` floats on this device, alive until the
/// stream ran the launch, written by no other work meanwhile.
pub(crate) unsafe fn agree_scales(
    ctx: &RankCtx,
    stream: &Arc<CudaStream>,
    parts: &[u64],
    n: u64,
    out: u64,
) -> Result<(), CudaError> {
    let table = stream
        .clone_htod(parts)
        .map_err(ctx.drv("uploading the fp8 grids' addresses", 8 * parts.len() as u64))?;
    let f = ctx.module(&QUANTISE_KERNELS)?.function("fp8_grid_agree")?;
    let count = u32::try_from(parts.len())
        .map_err(|_| CudaError::Invalid(format!("{} fp8 grids", parts.len())))?;
    let blocks = u32::try_from(n.div_ceil(256).clamp(1, 4096)).unwrap_or(4096);
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(&table).arg(&count).arg(&n).arg(&out);
    // SAFETY: the table holds `count` addresses of `n` floats each and `out` `n` floats (this
    // function's contract); each thread reads entry i of every part before writing entry i of
    // `out`, so `out` may be a part; the table is freed in stream order after the launch.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| CudaError::driver(ctx.rank, "agreeing the fp8 scales", 0, e))
}

/// Where the ranks of one process that share a GPU (no NCCL communicator) meet to agree their
/// fp8 scales: one per transfer.
#[derive(Debug)]
pub struct Rendezvous {
    world: usize,
    state: Mutex<Meeting>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Meeting {
    grids: Vec<Option<u64>>,
    copied: usize,
    abandoned: Option<String>,
}

impl Rendezvous {
    /// A meeting of `world` ranks.
    pub fn new(world: usize) -> Self {
        Rendezvous {
            world,
            state: Mutex::new(Meeting {
                grids: vec![None; world],
                ..Meeting::default()
            }),
            changed: Condvar::new(),
        }
    }

    /// Marks the meeting failed (rank `rank` stopped with `why`): every rank waiting or
    /// arriving later gets an error instead of waiting for it.
    pub fn abandon(&self, rank: usize, why: &str) {
        let mut m = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        m.abandoned
            .get_or_insert_with(|| format!("rank {rank} stopped: {why}"));
        self.changed.notify_all();
    }

    /// Waits (until `timeout` passed) for `done(meeting)`; errors name what rank `rank` waited
    /// for.
    fn wait_for(
        &self,
        rank: usize,
        timeout: Duration,
        op: &str,
        done: impl Fn(&Meeting) -> bool,
    ) -> Result<std::sync::MutexGuard<'_, Meeting>, CudaError> {
        let deadline = Instant::now() + timeout;
        let mut m = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(why) = &m.abandoned {
                return Err(CudaError::Invalid(format!(
                    "rank {rank}: {op}: the fp8 agreement was abandoned ({why})"
                )));
            }
            if done(&m) {
                return Ok(m);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CudaError::CollectiveTimeout {
                    rank,
                    op: op.into(),
                    deadline: timeout,
                });
            }
            m = self
                .changed
                .wait_timeout(m, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Publishes rank `rank`'s finished partial grid at `grid` and returns every rank's grid
    /// address, once all are published.
    pub(crate) fn publish(
        &self,
        rank: usize,
        grid: u64,
        timeout: Duration,
    ) -> Result<Vec<u64>, CudaError> {
        {
            let mut m = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match m.grids.get_mut(rank) {
                Some(slot) => *slot = Some(grid),
                None => {
                    return Err(CudaError::Invalid(format!(
                        "rank {rank} at an fp8 agreement of {} ranks",
                        self.world
                    )))
                }
            }
            self.changed.notify_all();
        }
        let m = self.wait_for(rank, timeout, "the peers' fp8 partial amaxes", |m| {
            m.grids.iter().all(Option::is_some)
        })?;
        Ok(m.grids.iter().map(|g| g.unwrap_or(0)).collect())
    }

    /// Says rank `rank` copied every peer's grid, and waits until every rank has: then no rank
    /// reads another's grid any more.
    pub(crate) fn copied(&self, rank: usize, timeout: Duration) -> Result<(), CudaError> {
        {
            let mut m = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            m.copied += 1;
            self.changed.notify_all();
        }
        let world = self.world;
        self.wait_for(rank, timeout, "the peers' copies of the fp8 grids", |m| {
            m.copied >= world
        })
        .map(|_| ())
    }
}
