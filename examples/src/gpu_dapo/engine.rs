//! The rollout engine of the GPU runs, attached once per lifecycle: the GPU decoder's
//! persistent engine ([`GpuEngine`]) for both backends. It is built once (cuBLAS handles,
//! kernels, rotary tables per rank); at wake it binds the resident rollout weights (the FSDP
//! backend's unfused layout or the Megatron backend's fused one) and allocates its KV cache for
//! the run's gen batches; at sleep it frees the cache. With `--fork-prefill true` (the default) the samples of a
//! prompt share one prefill (forked KV). Every call serves one request per sample
//! ([`GpuEngine::run`]: continuous batching over the cache's slots, the device pick), and every
//! sample comes back with its per-token log-probabilities. [`PerCallGpuDecoder`] (a decoder
//! built in every call, what the loop did before) stays for comparisons: it serves the same
//! requests through the same [`Scheduler`] over [`StaticSlots`] (every request prefilled at
//! once, the host's reference pick on the downloaded logits), so both draw from the same
//! per-request generators.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lifecycle_core::{EngineBytes, PhaseScope, RolloutEngine, RolloutView};
use lifecycle_cuda::{RolloutBuffer, ThreadRankPool};
use lifecycle_decoder::{
    pick, DecodeError, Decoder, KvDtype, ModelConfig, PickArgs, Picked, PrefillLogits, Request,
    Sample, Scheduler, SlotDecoder,
};
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
    /// Serves the requests with the engine bound at wake ([`GpuEngine::run`]): no per-call setup
    /// (the setup time is zero).
    fn run_requests(
        &mut self,
        weights: RolloutView<'_, RolloutBuffer>,
        requests: Vec<Request>,
    ) -> Result<(Vec<Sample>, Duration, Duration), DapoGpuError> {
        let t = Instant::now();
        let out = self.run(weights, requests)?;
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
    /// Serves `requests` on the resident `weights`: one [`Sample`] per request, in request
    /// order, with its tokens and per-token log-probabilities; the per-call setup time and the
    /// generation time. A request draws from its own generator
    /// ([`SamplingParams::seed`](lifecycle_decoder::SamplingParams)), so every engine samples
    /// the same tokens from the same logits.
    fn run_requests(
        &mut self,
        weights: RolloutView<'_, RolloutBuffer>,
        requests: Vec<Request>,
    ) -> Result<(Vec<Sample>, Duration, Duration), DapoGpuError>;

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
    /// Builds the decoder, then serves the requests through a [`Scheduler`] over
    /// [`StaticSlots`] (one slot per request).
    fn run_requests(
        &mut self,
        weights: RolloutView<'_, RolloutBuffer>,
        requests: Vec<Request>,
    ) -> Result<(Vec<Sample>, Duration, Duration), DapoGpuError> {
        let t = Instant::now();
        let mut decoder =
            GpuDecoder::with_pool(&self.config, &self.layout, &self.pool, weights.get())?;
        decoder.set_fp8_compute(self.fp8)?;
        decoder.set_kv_dtype(self.kv)?;
        let setup = t.elapsed();
        let t = Instant::now();
        let positions = requests.iter().map(Request::positions).max().unwrap_or(1);
        let mut slots = StaticSlots::new(&mut decoder, requests.len(), positions);
        let out = Scheduler::new().run(&mut slots, requests)?;
        Ok((out, setup, t.elapsed()))
    }

    fn describe(&self) -> String {
        "GPU decoder built in every call (KV cache per call)".to_string()
    }
}

/// A static-batch [`Decoder`] as the [`Scheduler`]'s [`SlotDecoder`]: `slots` slots that the
/// scheduler fills with one prefill (all its requests at once: build it with a slot per
/// request), then one decode step per token for the whole batch; a row whose request finished
/// is fed its last token again and its logits are dropped. Each row's token is picked on the
/// host by [`lifecycle_decoder::pick`] (the reference pick, in f64) from the logits the decoder
/// returns, with the request's settings and draw, so a request's tokens and log-probabilities
/// follow its own generator as under the engine's continuous batching.
pub struct StaticSlots<'d, D: Decoder> {
    decoder: &'d mut D,
    slots: usize,
    positions: usize,
    /// The last token fed to each slot (what a finished row is fed again); empty before the
    /// prefill.
    last: Vec<u32>,
}

impl<D: Decoder> std::fmt::Debug for StaticSlots<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StaticSlots")
            .field("slots", &self.slots)
            .field("positions", &self.positions)
            .field("prefilled", &!self.last.is_empty())
            .finish()
    }
}

impl<'d, D: Decoder> StaticSlots<'d, D> {
    /// `decoder` as `slots` slots of `positions` positions each (what the scheduler checks a
    /// request against; the decoder's own cache decides what fits).
    ///
    /// ```
    /// use lifecycle_core::Lifecycle;
    /// use lifecycle_decoder::{random_tensors, CpuDecoder, ModelConfig, Request, SamplingParams, Scheduler};
    /// use lifecycle_examples::gpu_dapo::engine::StaticSlots;
    /// use lifecycle_host::{HostBackend, HostTrainState};
    ///
    /// let config = ModelConfig::from_json_str(r#"{"model_type": "qwen2", "vocab_size": 32,
    ///   "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    ///   "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}"#)?;
    /// let layout = config.rollout_layout(1)?;
    /// let state = HostTrainState::from_tensors(1, random_tensors(&config, 1))?;
    /// let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
    /// let session = lc.rollout()?;
    /// let weights = session.weights();
    /// let group: Vec<_> = weights.ranks.iter().collect();
    /// let mut decoder = CpuDecoder::new(&config, &layout, &group)?;
    /// let params = SamplingParams::new(4).with_temperature(1.0);
    /// let requests = vec![
    ///     Request::new(vec![1, 2], params.clone().with_seed(7)),
    ///     Request::new(vec![3], params.with_seed(8)),
    /// ];
    /// let mut slots = StaticSlots::new(&mut decoder, requests.len(), 8);
    /// let samples = Scheduler::new().run(&mut slots, requests)?;
    /// assert!(samples.iter().all(|s| s.tokens.len() == 4 && s.logprobs.len() == 4));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(decoder: &'d mut D, slots: usize, positions: usize) -> Self {
        StaticSlots {
            decoder,
            slots: slots.max(1),
            positions,
            last: Vec::new(),
        }
    }
}

/// Each row's pick from its logits.
fn pick_rows(logits: &[&[f32]], picks: &[PickArgs<'_>]) -> Vec<Picked> {
    logits
        .iter()
        .zip(picks)
        .map(|(l, a)| pick(l, a.params, a.uniform))
        .collect()
}

impl<D> SlotDecoder for StaticSlots<'_, D>
where
    D: Decoder,
    D::Error: From<DecodeError>,
{
    type Error = D::Error;

    fn vocab_size(&self) -> usize {
        self.decoder.vocab_size()
    }

    fn slots(&self) -> usize {
        self.slots
    }

    fn slot_positions(&self) -> usize {
        self.positions
    }

    /// The one prefill of the batch: every slot, in order.
    fn prefill_slots(
        &mut self,
        admitted: &[(usize, &[u32])],
        picks: &[PickArgs<'_>],
    ) -> Result<Vec<Picked>, D::Error> {
        let in_order = admitted.iter().enumerate().all(|(i, &(s, _))| i == s);
        if !self.last.is_empty() || !in_order || picks.len() != admitted.len() {
            return Err(DecodeError::Usage(format!(
                "a static batch admits all its requests in one prefill into slots 0.. in order \
                 (give it a slot per request); got slots {:?}{}",
                admitted.iter().map(|a| a.0).collect::<Vec<_>>(),
                if self.last.is_empty() {
                    ""
                } else {
                    " after its prefill"
                }
            ))
            .into());
        }
        let prompts: Vec<Vec<u32>> = admitted.iter().map(|(_, p)| p.to_vec()).collect();
        let logits = self.decoder.prefill(&prompts, PrefillLogits::Last)?;
        let rows: Vec<&[f32]> = logits.iter().map(Vec::as_slice).collect();
        let picked = pick_rows(&rows, picks);
        self.last = picked.iter().map(|p| p.token).collect();
        Ok(picked)
    }

    /// One decode step of the whole batch; the rows of `rows` are picked.
    fn decode_slots(
        &mut self,
        rows: &[(usize, u32)],
        picks: &[PickArgs<'_>],
    ) -> Result<Vec<Picked>, D::Error> {
        if let Some(&(s, _)) = rows.iter().find(|&&(s, _)| s >= self.last.len()) {
            return Err(DecodeError::Usage(format!(
                "slot {s} of a static batch of {} sequences",
                self.last.len()
            ))
            .into());
        }
        for &(s, t) in rows {
            self.last[s] = t;
        }
        let logits = self.decoder.decode_step(&self.last)?;
        let rows: Vec<&[f32]> = rows
            .iter()
            .filter_map(|&(s, _)| logits.get(s).map(Vec::as_slice))
            .collect();
        Ok(pick_rows(&rows, picks))
    }
}
