//! The fp8 rollout ([`RolloutDtype::Fp8`](lifecycle_layout::fp8::RolloutDtype)): the bf16
//! parameters checked finite when a plan is made, and each rank's rollout buffer written from
//! its bf16 staging buffer after the transfer ([`Fp8Rollout`]).

use crate::backend::MegatronGpuBackend;
use crate::error::MegatronGpuError;
use crate::state::{GpuRank, MegatronGpuState};

use half::bf16;
use lifecycle_cuda::cudarc::driver::{CudaSlice, DevicePtr};
use lifecycle_cuda::DEFAULT_CHUNK_WORDS;
use lifecycle_cuda::{alloc_zeros, quantise_staged, ChunkTable, CudaError, RankExecutor};
use lifecycle_layout::megatron::{quantised_param, Fp8Rollout, MegatronLayout};
use lifecycle_state::megatron::MegatronError;

impl MegatronGpuBackend {
    /// Every bf16 parameter that an fp8 rollout quantises ([`quantised_param`]) is finite on
    /// every local rank ([`MegatronError::NonFinite`] naming the parameter, the rank and the
    /// element otherwise), read on the devices.
    pub(crate) fn check_finite(&self, state: &MegatronGpuState) -> Result<(), MegatronGpuError> {
        let keep = self.options.fp8_keep;
        let segments: Vec<Vec<(u64, u64)>> = self
            .locals()
            .iter()
            .map(|&rank| {
                let stage = state.layout.coords(rank).pp;
                state
                    .layout
                    .stage_slots(stage)
                    .iter()
                    .filter(|s| quantised_param(s, keep))
                    .map(|s| (s.offset as u64, s.shape.iter().product::<usize>() as u64))
                    .collect()
            })
            .collect();
        let mut items: Vec<(&GpuRank, &Vec<(u64, u64)>)> =
            state.ranks.iter().zip(&segments).collect();
        let found = self.pool.run_each(&mut items, &|ctx, (r, segments)| {
            let params = r.params.device().ok_or_else(|| {
                CudaError::Invalid(format!(
                    "rank {}: the bf16 parameters are offloaded: leave rollout mode first",
                    ctx.rank
                ))
            })?;
            if segments.iter().any(|&(o, n)| o + n > params.len() as u64) {
                return Err(CudaError::Invalid(format!(
                    "rank {}: the layout's parameters end past the {} bf16 parameters held",
                    ctx.rank,
                    params.len()
                )));
            }
            let table = ChunkTable::new(segments.iter().copied(), DEFAULT_CHUNK_WORDS);
            let k = ctx.verify_kernels()?;
            let (p, _sync) = params.device_ptr(&ctx.compute);
            // SAFETY: the table lies inside `params` (checked above), alive and unwritten during the call
            // (which waits for the compute stream before returning).
            unsafe { k.first_nonfinite_bf16(&ctx.compute, p, &table, ctx.rank) }
        })?;
        for (&rank, at) in self.locals().iter().zip(found) {
            if let Some(at) = at {
                let (name, index) = param_at(&state.layout, rank, at as usize);
                return Err(MegatronError::NonFinite { name, rank, index }.into());
            }
        }
        Ok(())
    }

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

/// The Megatron-Core name of the parameter holding element `at` of `rank`'s bf16 parameter
/// buffer (its stage's slots) and the element's index in it; the buffer's own words when no
/// slot holds it.
fn param_at(layout: &MegatronLayout, rank: usize, at: usize) -> (String, usize) {
    let stage = layout.coords(rank).pp;
    layout
        .stage_slots(stage)
        .iter()
        .find(|s| (s.offset..s.offset + s.shape.iter().product::<usize>()).contains(&at))
        .map_or_else(
            || ("the bf16 parameter buffer".to_string(), at),
            |s| (s.name.clone(), at - s.offset),
        )
}
