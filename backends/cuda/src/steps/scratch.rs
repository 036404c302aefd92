//! The scratch of one run: the staging slots of the network steps and, for an fp8 switch at
//! W > 1, the scale grid and the fp8 stage.

use cudarc::driver::CudaSlice;
use half::bf16;

use lifecycle_layout::steps::RankSteps;

use crate::{alloc_device, alloc_zeros, CudaError, RankCtx};

pub(super) type Slots = Vec<CudaSlice<bf16>>;

/// The send and receive staging slots of the steps in flight.
pub(super) fn alloc_slots(ctx: &RankCtx, s: &RankSteps) -> Result<(Slots, Slots), CudaError> {
    let rank = ctx.rank;
    let slots = if s.steps.is_empty() { 0 } else { s.in_flight };
    let (mut sslots, mut rslots) = (Vec::new(), Vec::new());
    for _ in 0..slots {
        if s.send_slot_elems > 0 {
            // SAFETY: a step's sends read only slot elements its pack wrote first (the program
            // orders the network work after the pack).
            sslots.push(unsafe {
                alloc_device::<bf16>(
                    &ctx.compute,
                    s.send_slot_elems as usize,
                    rank,
                    "send staging",
                )?
            });
        }
        if s.recv_slot_elems > 0 {
            // SAFETY: a step's unpack reads only slot elements its receives wrote first.
            rslots.push(unsafe {
                alloc_device::<bf16>(
                    &ctx.compute,
                    s.recv_slot_elems as usize,
                    rank,
                    "receive staging",
                )?
            });
        }
    }
    Ok((sslots, rslots))
}

/// The device buffers of an agreed fp8 switch, for one run: the agreed scale grid, the fp8
/// stage and, on ranks without NCCL, the rank's partial grid and its copies of its peers'.
pub(super) struct Fp8Scratch {
    pub(super) grid: CudaSlice<f32>,
    pub(super) stage: CudaSlice<bf16>,
    /// Without NCCL: the rank's own partial amaxes (its peers read them) and the peers' copied
    /// next to each other.
    pub(super) meeting: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
}

impl Fp8Scratch {
    pub(super) fn alloc(ctx: &RankCtx, s: &RankSteps) -> Result<Option<Fp8Scratch>, CudaError> {
        let Some(a) = &s.agree else {
            return Ok(None);
        };
        let (rank, n) = (ctx.rank, a.grid_elems as usize);
        let grid = alloc_zeros::<f32>(&ctx.compute, n, rank, "the fp8 scale grid")?;
        // SAFETY: the stage's bytes are read (sent) only after the agreed quantisation wrote
        // them (the program orders the network step after it).
        let stage = unsafe {
            alloc_device::<bf16>(&ctx.compute, a.stage_elems as usize, rank, "the fp8 stage")?
        };
        let meeting = if ctx.comm.is_available() {
            None
        } else {
            let own = alloc_zeros::<f32>(&ctx.compute, n, rank, "the fp8 partial grid")?;
            let peers = ctx.world.saturating_sub(1).max(1) * n;
            let copies = alloc_zeros::<f32>(&ctx.compute, peers, rank, "the peers' fp8 grids")?;
            Some((own, copies))
        };
        Ok(Some(Fp8Scratch {
            grid,
            stage,
            meeting,
        }))
    }

    /// Bytes of the peers' copied grids (beyond [`RankSteps::staging_bytes`]).
    pub(super) fn gathered_bytes(&self) -> u64 {
        self.meeting
            .as_ref()
            .map_or(0, |(own, peers)| 4 * (own.len() + peers.len()) as u64)
    }
}
