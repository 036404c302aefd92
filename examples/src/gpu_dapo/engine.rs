//! The rollout engines of the GPU runs, attached once per lifecycle.
//!
//! **Where the persistent GPU engine plugs in**: [`FsdpEngine`] below. Today it is
//! [`PerCallGpuDecoder`], which builds a [`GpuDecoder`] in every call (its setup time is
//! reported as "decoder setup"); a persistent engine that implements [`GpuGenerate`] replaces it
//! by changing that one type alias.
//!
//! The Megatron backend's fused rollout is not read by the GPU decoder yet:
//! [`MegatronEngine`] is [`FusedHostFallback`], which downloads the fused rollout weights to host
//! memory at wake and decodes with the CPU decoder, a labelled fallback (the report says so).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lifecycle_core::{EngineBytes, PhaseScope, RolloutEngine, RolloutView};
use lifecycle_cuda::{RolloutBuffer, ThreadRankPool};
use lifecycle_decoder::{Decoder, ModelConfig, Sampling};
use lifecycle_decoder_gpu::GpuDecoder;
use lifecycle_layout::RolloutLayout as FusedLayout;
use lifecycle_layout::{HostRollout, RolloutLayout};

use super::DapoGpuError;
use crate::dapo::DecoderLayout;

/// The engine of `--backend fsdp`: **the one line to change for a persistent GPU engine**.
pub type FsdpEngine = PerCallGpuDecoder;

/// The engine of `--backend megatron`: the GPU decoder does not read the fused layout yet, so
/// this is the CPU-decoder fallback.
pub type MegatronEngine = FusedHostFallback;

/// How the FSDP run builds its engine (once per lifecycle).
pub trait ForFsdpRun: GpuGenerate + Sized {
    /// The engine for a run of `config` on `pool`'s GPUs, rollout layout `layout`.
    fn for_run(
        config: &ModelConfig,
        layout: &RolloutLayout,
        pool: &Arc<ThreadRankPool>,
    ) -> Result<Self, DapoGpuError>;
}

/// What the GPU loop needs from an engine besides the wake / sleep contract.
pub trait GpuGenerate: RolloutEngine<RolloutBuffer> {
    /// Generates `seqs` on the resident `weights`: the new tokens of every sequence, the
    /// per-call setup time and the generation time.
    fn generate_seqs(
        &mut self,
        weights: &RolloutBuffer,
        seqs: &[Vec<u32>],
        sampling: &Sampling,
    ) -> Result<(Vec<Vec<u32>>, Duration, Duration), DapoGpuError>;

    /// What the engine is, for the report.
    fn describe(&self) -> String;
}

/// Today's GPU engine: a [`GpuDecoder`] built in every call on the resident rollout buffer
/// (kernels come from the process's module cache; cuBLAS handles and KV cache are per call).
pub struct PerCallGpuDecoder {
    config: ModelConfig,
    layout: RolloutLayout,
    pool: Arc<ThreadRankPool>,
}

impl RolloutEngine<RolloutBuffer> for PerCallGpuDecoder {
    type Error = Infallible;
    fn wake(
        &mut self,
        _: RolloutView<'_, RolloutBuffer>,
        _: &mut PhaseScope,
    ) -> Result<(), Infallible> {
        Ok(())
    }
    fn sleep(&mut self, _: &mut PhaseScope) -> Result<(), Infallible> {
        Ok(())
    }
    /// Nothing between calls: the per-call decoder allocates and frees its KV cache inside the
    /// call.
    fn memory(&self) -> EngineBytes {
        EngineBytes::default()
    }
}

impl ForFsdpRun for PerCallGpuDecoder {
    fn for_run(
        config: &ModelConfig,
        layout: &RolloutLayout,
        pool: &Arc<ThreadRankPool>,
    ) -> Result<Self, DapoGpuError> {
        Ok(PerCallGpuDecoder {
            config: config.clone(),
            layout: layout.clone(),
            pool: Arc::clone(pool),
        })
    }
}

impl GpuGenerate for PerCallGpuDecoder {
    fn generate_seqs(
        &mut self,
        weights: &RolloutBuffer,
        seqs: &[Vec<u32>],
        sampling: &Sampling,
    ) -> Result<(Vec<Vec<u32>>, Duration, Duration), DapoGpuError> {
        let t = Instant::now();
        let mut decoder = GpuDecoder::with_pool(&self.config, &self.layout, &self.pool, weights)?;
        let setup = t.elapsed();
        let t = Instant::now();
        let out = decoder.generate(seqs, sampling)?;
        Ok((out, setup, t.elapsed()))
    }

    fn describe(&self) -> String {
        "GPU decoder, built per call (persistent engine: not yet)".to_string()
    }
}

/// The Megatron fallback: at wake, the fused rollout weights are downloaded to host memory
/// (held until sleep, counted as host memory); calls decode with the CPU decoder on the first
/// replica's TP group. Clearly slower than a GPU decoder: a stand-in until the GPU decoder reads
/// the fused layout.
pub struct FusedHostFallback {
    config: ModelConfig,
    layout: FusedLayout,
    pool: Arc<ThreadRankPool>,
    host: Option<HostRollout>,
}

impl FusedHostFallback {
    /// The fallback for `config` on `pool`, fused rollout `layout`.
    pub fn new(config: &ModelConfig, layout: FusedLayout, pool: &Arc<ThreadRankPool>) -> Self {
        FusedHostFallback {
            config: config.clone(),
            layout,
            pool: Arc::clone(pool),
            host: None,
        }
    }
}

impl RolloutEngine<RolloutBuffer> for FusedHostFallback {
    type Error = lifecycle_cuda::CudaError;
    fn wake(
        &mut self,
        weights: RolloutView<'_, RolloutBuffer>,
        scope: &mut PhaseScope,
    ) -> Result<(), Self::Error> {
        let host = weights.get().download(&*self.pool)?;
        scope.alloc_extra(rollout_bytes(&host));
        self.host = Some(host);
        Ok(())
    }
    fn sleep(&mut self, _: &mut PhaseScope) -> Result<(), Self::Error> {
        self.host = None;
        Ok(())
    }
    fn memory(&self) -> EngineBytes {
        EngineBytes::host(self.host.as_ref().map_or(0, rollout_bytes))
    }
}

fn rollout_bytes(r: &HostRollout) -> u64 {
    r.ranks
        .iter()
        .flat_map(|rank| rank.tensors.iter())
        .map(|t| 2 * t.data.len() as u64)
        .sum()
}

impl GpuGenerate for FusedHostFallback {
    /// Generates on the host copy of the weights (CPU decoder, fused layout).
    fn generate_seqs(
        &mut self,
        _weights: &RolloutBuffer,
        seqs: &[Vec<u32>],
        sampling: &Sampling,
    ) -> Result<(Vec<Vec<u32>>, Duration, Duration), DapoGpuError> {
        let host = self.host.as_ref().ok_or_else(|| {
            DapoGpuError::Usage("the Megatron fallback engine was called asleep".to_string())
        })?;
        let tp = self.layout.tp();
        let group: Vec<_> = host.ranks.iter().take(tp).collect();
        let t = Instant::now();
        let mut decoder =
            DecoderLayout::Fused(self.layout.clone()).decoder(&self.config, &group)?;
        let setup = t.elapsed();
        let t = Instant::now();
        let out = decoder.generate(seqs, sampling)?;
        Ok((out, setup, t.elapsed()))
    }

    fn describe(&self) -> String {
        "FALLBACK: the GPU decoder does not read the fused layout yet; the fused rollout is \
         downloaded to host memory at wake and decoded by the CPU decoder"
            .to_string()
    }
}
