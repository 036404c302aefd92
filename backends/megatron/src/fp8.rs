//! The fp8 rollout ([`RolloutDtype::Fp8`](lifecycle_layout::fp8::RolloutDtype)): the bf16
//! parameters checked finite when a plan is made, and each rank's rollout buffer written from
//! its bf16 staging buffer after the transfer ([`Fp8Rollout`]).

use crate::backend::MegatronGpuBackend;
use crate::buffers::MegatronBuffers;
use crate::error::MegatronGpuError;

use half::bf16;
use lifecycle_cuda::cudarc::driver::{CudaSlice, DevicePtr};
use lifecycle_cuda::driver::RankBuffers;
use lifecycle_cuda::DEFAULT_CHUNK_WORDS;
use lifecycle_cuda::{
    alloc_zeros, quantise_staged, ChunkTable, CudaError, RankExecutor, SourceBuf,
};
use lifecycle_layout::megatron::{quantised_param, Fp8Rollout, MegatronLayout};
use lifecycle_state::megatron::MegatronError;

/// A checked parameter of a rank: its slot index, where it starts in the rank's source, its
/// elements.
type Segment = (usize, u64, u64);

impl<S: MegatronBuffers> MegatronGpuBackend<S> {
    /// Every bf16 parameter that an fp8 rollout quantises ([`quantised_param`]) is finite on
    /// every local rank ([`MegatronError::NonFinite`] naming the parameter, the rank and the
    /// element otherwise), read on the devices where the state keeps them (a lent rank's
    /// tensors where they lie: [`RankBuffers::source_offsets`]).
    pub(crate) fn check_finite(&self, state: &S) -> Result<(), MegatronGpuError> {
        let keep = self.options.fp8_keep;
        let layout = state.train_layout();
        // per local rank: (slot index, where it starts in the source, elements)
        let segments: Vec<Vec<Segment>> = self
            .locals()
            .iter()
            .zip(state.ranks())
            .map(|(&rank, r)| {
                let at = r.source_offsets();
                layout
                    .stage_slots(layout.coords(rank).pp)
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| quantised_param(s, keep))
                    .map(|(i, s)| {
                        let start = at.and_then(|a| a.get(i)).copied();
                        (i, start.unwrap_or(s.offset as u64), s.numel() as u64)
                    })
                    .collect()
            })
            .collect();
        let mut items: Vec<(&S::Rank, &Vec<Segment>)> =
            state.ranks().iter().zip(&segments).collect();
        let found = self.pool.run_each(&mut items, &|ctx, (r, segments)| {
            let params = match r.source()? {
                SourceBuf::Bf16(p) => p,
                SourceBuf::F32(_) => {
                    return Err(CudaError::Invalid(format!(
                        "rank {}: a Megatron state's parameters are bf16, its source is fp32",
                        ctx.rank
                    )))
                }
            };
            if segments
                .iter()
                .any(|&(_, o, n)| o + n > params.len() as u64)
            {
                return Err(CudaError::Invalid(format!(
                    "rank {}: the layout's parameters end past the {} bf16 parameters held",
                    ctx.rank,
                    params.len()
                )));
            }
            let table = ChunkTable::new(
                segments.iter().map(|&(_, o, n)| (o, n)),
                DEFAULT_CHUNK_WORDS,
            );
            let k = ctx.verify_kernels()?;
            let (p, _sync) = params.device_ptr(&ctx.compute);
            // SAFETY: the table lies inside `params` (checked above), alive and unwritten during the call
            // (which waits for the compute stream before returning).
            unsafe { k.first_nonfinite_bf16(&ctx.compute, p, &table, ctx.rank) }
        })?;
        for ((&rank, at), segs) in self.locals().iter().zip(found).zip(&segments) {
            if let Some(at) = at {
                let (name, index) = param_at(layout, rank, segs, at);
                return Err(MegatronError::NonFinite { name, rank, index }.into());
            }
        }
        Ok(())
    }
}

impl<S: MegatronBuffers> MegatronGpuBackend<S> {
    /// Allocates each local rank's fp8 rollout buffer of `f.len` slots, zeroed (the alignment
    /// gaps between tensors included).
    pub(crate) fn alloc_fp8_rollouts(
        &self,
        f: &Fp8Rollout,
    ) -> Result<Vec<CudaSlice<bf16>>, MegatronGpuError> {
        Ok(self
            .pool
            .run(&|c| alloc_zeros::<bf16>(&c.compute, f.len, c.rank, "fp8 rollout weights"))?)
    }

    /// Writes every local rank's fp8 rollout buffer from its bf16 staging buffer; returns the
    /// bytes written per rank.
    pub(crate) fn quantise(
        &self,
        f: &Fp8Rollout,
        staging: &[CudaSlice<bf16>],
        rolls: &mut [CudaSlice<bf16>],
    ) -> Result<Vec<u64>, MegatronGpuError> {
        let mut items: Vec<(&CudaSlice<bf16>, &mut CudaSlice<bf16>)> =
            staging.iter().zip(rolls.iter_mut()).collect();
        if items.len() != self.locals().len() {
            return Err(CudaError::Invalid(format!(
                "the fp8 pass runs {} local ranks but was given {} buffers",
                self.locals().len(),
                items.len()
            ))
            .into());
        }
        Ok(self
            .pool
            .run_each(&mut items, &|ctx, (s, r)| quantise_staged(ctx, f, s, r))?)
    }
}

/// The Megatron-Core name of the parameter holding element `at` of `rank`'s source (one of its
/// checked `segments`: slot index, start in the source, elements) and the element's index in
/// it; the source's own words when no segment holds it.
fn param_at(
    layout: &MegatronLayout,
    rank: usize,
    segments: &[Segment],
    at: u64,
) -> (String, usize) {
    let slots = layout.stage_slots(layout.coords(rank).pp);
    segments
        .iter()
        .find(|&&(_, o, n)| (o..o + n).contains(&at))
        .and_then(|&(i, o, _)| slots.get(i).map(|s| (s.name.clone(), (at - o) as usize)))
        .unwrap_or_else(|| ("the bf16 parameters".to_string(), at as usize))
}
