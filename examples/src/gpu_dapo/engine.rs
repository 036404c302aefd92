//! The rollout engine of the GPU runs, attached once per lifecycle: the GPU decoder's
//! persistent engine ([`GpuEngine`]) for both backends. It is built once (cuBLAS handles,
//! kernels, rotary tables per rank); at wake it binds the resident rollout weights (the FSDP
//! backend's unfused layout or the Megatron backend's fused one) and allocates its KV cache for
//! the run's gen batches; at sleep it frees the cache. With `--fork-prefill true` (the default) the samples of a
//! prompt share one prefill (forked KV). [`PerCallGpuDecoder`] (a decoder built in every call,
//! what the loop did before) stays for comparisons.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lifecycle_core::{EngineBytes, PhaseScope, RolloutEngine, RolloutView};
use lifecycle_cuda::{RolloutBuffer, ThreadRankPool};
use lifecycle_decoder::{Decoder, KvDtype, ModelConfig, Sampling};
use lifecycle_decoder_gpu::{EngineSettings, GpuDecoder, GpuEngine};
use lifecycle_layout::fp8::Fp8Compute;
use lifecycle_layout::RolloutLayout;

use super::DapoGpuError;

/// The engine of `--backend fsdp` and `--backend megatron`.
pub type RunEngine = GpuEngine;

/// How a run builds its engine (once per lifecycle).
pub trait ForRun: GpuGenerate + Sized {
    /// The engine for a run of `config` on `pool`'s GPUs, rollout layout `layout` (unfused or
    /// fused), as `settings` say (gen batches it holds, prefill per prompt, fp8 products, KV
    /// cache dtype).
    fn for_run(
        config: &ModelConfig,
        layout: &RolloutLayout,
        pool: &Arc<ThreadRankPool>,
        settings: &EngineSettings,
    ) -> Result<Self, DapoGpuError>;
}

impl ForRun for GpuEngine {
    fn for_run(
        config: &ModelConfig,
        layout: &RolloutLayout,
        pool: &Arc<ThreadRankPool>,
        settings: &EngineSettings,
    ) -> Result<Self, DapoGpuError> {
        Ok(GpuEngine::new(
            Arc::clone(pool),
            config,
            layout.clone(),
            *settings,
        )?)
    }
}

impl GpuGenerate for GpuEngine {
    /// Generates with the engine bound at wake: no per-call setup (the setup time is zero).
    fn generate_seqs(
        &mut self,
        weights: RolloutView<'_, RolloutBuffer>,
        seqs: &[Vec<u32>],
        sampling: &Sampling,
    ) -> Result<(Vec<Vec<u32>>, Duration, Duration), DapoGpuError> {
        let t = Instant::now();
        let out = self.generate(weights, seqs, sampling)?;
        Ok((out, Duration::ZERO, t.elapsed()))
    }

    fn describe(&self) -> String {
        let s = self.settings();
        format!(
            "GPU decoder engine, built once per lifecycle: KV cache for {} sequences x {} tokens \
             ({} K/V) allocated at wake, freed at sleep; fp8 products {}; {}",
            s.max_sequences,
            s.max_tokens,
            s.kv_dtype,
            s.fp8_compute,
            if s.fork_prefill {
                "one prefill per prompt, its KV forked to the group's samples"
            } else {
                "every sequence prefilled"
            }
        )
    }
}

/// What the GPU loop needs from an engine besides the wake / sleep contract.
pub trait GpuGenerate: RolloutEngine<RolloutBuffer> {
    /// Generates `seqs` on the resident `weights`: the new tokens of every sequence, the
    /// per-call setup time and the generation time.
    fn generate_seqs(
        &mut self,
        weights: RolloutView<'_, RolloutBuffer>,
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
    fp8: Fp8Compute,
    kv: KvDtype,
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

impl ForRun for PerCallGpuDecoder {
    fn for_run(
        config: &ModelConfig,
        layout: &RolloutLayout,
        pool: &Arc<ThreadRankPool>,
        settings: &EngineSettings,
    ) -> Result<Self, DapoGpuError> {
        Ok(PerCallGpuDecoder {
            config: config.clone(),
            layout: layout.clone(),
            pool: Arc::clone(pool),
            fp8: settings.fp8_compute,
            kv: settings.kv_dtype,
        })
    }
}

impl GpuGenerate for PerCallGpuDecoder {
    fn generate_seqs(
        &mut self,
        weights: RolloutView<'_, RolloutBuffer>,
        seqs: &[Vec<u32>],
        sampling: &Sampling,
    ) -> Result<(Vec<Vec<u32>>, Duration, Duration), DapoGpuError> {
        let t = Instant::now();
        let mut decoder =
            GpuDecoder::with_pool(&self.config, &self.layout, &self.pool, weights.get())?;
        decoder.set_fp8_compute(self.fp8)?;
        decoder.set_kv_dtype(self.kv)?;
        let setup = t.elapsed();
        let t = Instant::now();
        let out = decoder.generate(seqs, sampling)?;
        Ok((out, setup, t.elapsed()))
    }

    fn describe(&self) -> String {
        "GPU decoder built in every call (KV cache per call)".to_string()
    }
}
