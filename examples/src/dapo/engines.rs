//! The rollout engines of the CPU runs, created once per lifecycle
//! ([`Lifecycle::with_engine`](lifecycle_core::Lifecycle::with_engine)):
//!
//! - [`ToyEngine`]: the toy policy over [`HostRollout`]. It holds nothing: the policy's TP
//!   groups are views of the resident weights, and a sequence's recurrent state lives inside
//!   the call that samples it.
//! - [`CpuDecoderEngine`]: the Qwen2 / Llama CPU decoder ([`CpuDecoder`]) over the FSDP
//!   backends' unfused layout (with LoRA adapters beside their bases or not) or Megatron's fused
//!   one, serving each call's samples as requests
//!   through the continuous-batching [`Scheduler`] (one request per sample, each with its own
//!   seed, [`super::sample_seed`]), so every sample comes back with its per-token
//!   log-probabilities. Its wake checks every replica's weights against the model (the
//!   decoder's own checks); its KV cache is allocated by the decoder in each call and freed at
//!   the end of it, so between calls it holds nothing ([`CpuDecoderEngine::kv_bytes_per_call`]
//!   says how much one call allocates).

use std::convert::Infallible;
use std::time::{Duration, Instant};

use lifecycle_core::{EngineBytes, PhaseScope, RolloutEngine, RolloutView};
use lifecycle_decoder::{
    CpuDecoder, DecodeError, Filled, GroupStream, ModelConfig, Request, SamplingParams, Scheduler,
};
use lifecycle_layout::fp8::Fp8Compute;
use lifecycle_layout::lora::LoraConfig;
use lifecycle_layout::RolloutLayout as FusedLayout;
use lifecycle_layout::{HostRollout, RankRollout, RolloutLayout};

use super::{prompt, rewarded_group, sample_gen_batch, sample_seed, GenJob, Group, RewardRule};

/// The toy policy's engine (see the module docs): nothing to allocate at wake, nothing held.
#[derive(Debug, Default, Clone, Copy)]
pub struct ToyEngine;

impl ToyEngine {
    /// Samples one gen batch on the resident weights (the toy policy's
    /// [`generate`](super::generate), without the switch).
    pub fn generate(&mut self, weights: RolloutView<'_, HostRollout>, job: &GenJob) -> Vec<Group> {
        sample_gen_batch(weights.get(), job)
    }
}

impl RolloutEngine<HostRollout> for ToyEngine {
    type Error = Infallible;

    fn wake(
        &mut self,
        _: RolloutView<'_, HostRollout>,
        _: &mut PhaseScope,
    ) -> Result<(), Infallible> {
        Ok(())
    }

    fn sleep(&mut self, _: &mut PhaseScope) -> Result<(), Infallible> {
        Ok(())
    }

    /// Nothing: a sequence's recurrent state (hidden-size floats) lives inside the call.
    fn memory(&self) -> EngineBytes {
        EngineBytes::default()
    }
}

/// The rollout layout the CPU decoder reads.
#[derive(Debug, Clone, PartialEq)]
pub enum DecoderLayout {
    /// The FSDP backends' unfused TP layout ([`CpuDecoder::new`]).
    Unfused(RolloutLayout),
    /// The Megatron backends' fused TP layout: `[q; k; v]`, `[gate; up]`
    /// ([`CpuDecoder::new_fused`]).
    Fused(FusedLayout),
    /// The unfused layout with LoRA adapters beside their bases, applied unmerged
    /// ([`CpuDecoder::new_lora`]).
    Lora(RolloutLayout, LoraConfig),
}

impl DecoderLayout {
    /// The rollout tensor-parallel degree.
    pub fn tp(&self) -> usize {
        match self {
            DecoderLayout::Unfused(l) | DecoderLayout::Lora(l, _) => l.tp(),
            DecoderLayout::Fused(l) => l.tp(),
        }
    }

    /// A decoder over one TP group's weights (checked against `model` and the layout).
    pub fn decoder<'w>(
        &self,
        model: &ModelConfig,
        group: &[&'w RankRollout],
    ) -> Result<CpuDecoder<'w>, DecodeError> {
        match self {
            DecoderLayout::Unfused(l) => CpuDecoder::new(model, l, group),
            DecoderLayout::Fused(l) => CpuDecoder::new_fused(model, l, group),
            DecoderLayout::Lora(l, lora) => CpuDecoder::new_lora(model, l, group, lora),
        }
    }
}

/// One gen batch for the CPU decoder.
#[derive(Debug, Clone)]
pub struct DecodeJob {
    /// Prompt ids.
    pub prompts: Vec<u64>,
    /// Samples per prompt.
    pub group_size: usize,
    /// Tokens generated per sample.
    pub tokens: usize,
    /// Temperature.
    pub temperature: f32,
    /// Sampling seed: sample `s` of prompt `id` draws with [`super::sample_seed`]`(seed, id, s)`.
    pub seed: u64,
    /// The reward rule.
    pub reward: RewardRule,
}

/// The CPU decoder as a rollout engine (see the module docs).
#[derive(Debug, Clone)]
pub struct CpuDecoderEngine {
    model: ModelConfig,
    layout: DecoderLayout,
    last_kv_bytes: u64,
    fp8: Fp8Compute,
}

/// One streamed fill of [`CpuDecoderEngine::fill`].
#[derive(Debug, Clone)]
pub struct StreamFill {
    /// The kept groups (all with mixed rewards), in the order they were kept.
    pub kept: Vec<Group>,
    /// What the fill cost.
    pub filled: Filled,
    /// The sum of the rewards of every group scored, kept or not.
    pub rewards: f64,
    /// Samples of the groups scored.
    pub scored: usize,
    /// Building the decoder.
    pub setup: Duration,
    /// Generating.
    pub generate: Duration,
}

/// Generated sequences of one replica: prompt id, tokens and their log-probabilities.
type Samples = Vec<(u64, Vec<u32>, Vec<f32>)>;

impl CpuDecoderEngine {
    /// An engine decoding `model` from weights laid out as `layout`.
    pub fn new(model: ModelConfig, layout: DecoderLayout) -> Self {
        CpuDecoderEngine {
            model,
            layout,
            last_kv_bytes: 0,
            fp8: Fp8Compute::WeightOnly,
        }
    }

    /// The same engine computing fp8 products as `compute` says (weight-only by default; an fp8
    /// rollout only: bf16 weights are not affected).
    pub fn with_fp8_compute(mut self, compute: Fp8Compute) -> Self {
        self.fp8 = compute;
        self
    }

    /// The model.
    pub fn model(&self) -> &ModelConfig {
        &self.model
    }

    /// The layout it reads.
    pub fn layout(&self) -> &DecoderLayout {
        &self.layout
    }

    /// The KV cache (fp32 keys and values of every position of every sequence, all layers, over
    /// the TP ranks of every replica) the last call allocated and freed; 0 before the first.
    pub fn kv_bytes_per_call(&self) -> u64 {
        self.last_kv_bytes
    }

    /// The KV bytes of `sequences` sequences of `positions` positions: per layer, keys and
    /// values of every kv head a TP rank holds (replicated heads counted on each rank).
    fn kv_bytes(&self, sequences: usize, positions: usize) -> u64 {
        let c = &self.model;
        let tp = self.layout.tp().max(1);
        let kv_heads_per_rank = c.model.query_groups.div_ceil(tp).max(1);
        (sequences * positions * c.model.layers * 2 * kv_heads_per_rank * tp * c.model.head_dim * 4)
            as u64
    }

    /// Decodes one gen batch on `weights`: prompt `i` goes to data-parallel replica
    /// `i mod (W / T)`; each replica serves its `prompts × group_size` samples as requests
    /// through a [`Scheduler`] over a decoder with a KV slot per sample (prefill together, then
    /// decode steps with the KV cache) on a thread of its own. Sample `s` of prompt `id` draws
    /// from its own seed, [`super::sample_seed`]`(job.seed, id, s)`, so its tokens do not depend
    /// on the replicas; each group carries its samples' log-probabilities
    /// ([`Group::logprobs`]). The time spent building the decoders (weight checks) and
    /// generating.
    pub fn generate(
        &mut self,
        weights: &HostRollout,
        job: &DecodeJob,
    ) -> Result<(Vec<Group>, Duration, Duration), DecodeError> {
        let tp = self.layout.tp();
        let replicas = weights.ranks.len() / tp.max(1);
        let vocab = self.model.model.vocab;
        let (model, layout, fp8) = (&self.model, &self.layout, self.fp8);
        let per_replica: Vec<Result<(Samples, Duration, Duration), DecodeError>> =
            std::thread::scope(|scope| {
                let handles: Vec<_> = (0..replicas)
                    .map(|d| {
                        let group: Vec<_> = weights.ranks[d * tp..(d + 1) * tp].iter().collect();
                        scope.spawn(move || {
                            let t = Instant::now();
                            let decoder = layout.decoder(model, &group)?.with_fp8_compute(fp8);
                            let setup = t.elapsed();
                            let ids: Vec<(u64, usize)> = job
                                .prompts
                                .iter()
                                .enumerate()
                                .filter(|(i, _)| i % replicas == d)
                                .flat_map(|(_, &id)| (0..job.group_size).map(move |s| (id, s)))
                                .collect();
                            let requests: Vec<Request> = ids
                                .iter()
                                .map(|&(id, s)| {
                                    let tokens = prompt(id, vocab).into_iter().map(|t| t as u32);
                                    let params = SamplingParams::new(job.tokens)
                                        .with_temperature(job.temperature)
                                        .with_seed(sample_seed(job.seed, id, s));
                                    Request::new(tokens.collect(), params)
                                })
                                .collect();
                            // a KV slot per sample, each as long as a whole sample
                            let positions = requests.iter().map(Request::positions).max();
                            let mut decoder =
                                decoder.with_slots(requests.len(), positions.unwrap_or(1));
                            let t = Instant::now();
                            let out = Scheduler::new().run(&mut decoder, requests)?;
                            let samples = ids
                                .into_iter()
                                .zip(out)
                                .map(|((id, _), s)| (id, s.tokens, s.logprobs))
                                .collect();
                            Ok((samples, setup, t.elapsed()))
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                    .collect()
            });
        let mut samples: Samples = Vec::new();
        let (mut setup, mut generate) = (Duration::ZERO, Duration::ZERO);
        for r in per_replica {
            let (s, a, b) = r?;
            samples.extend(s);
            // replicas run side by side: the slowest one is the call's
            setup = setup.max(a);
            generate = generate.max(b);
        }
        let positions = 4 + job.tokens;
        self.last_kv_bytes = self.kv_bytes(samples.len(), positions);
        let groups = job
            .prompts
            .iter()
            .map(|&id| {
                let (tokens, logprobs): (Vec<Vec<usize>>, Vec<Vec<f32>>) = samples
                    .iter()
                    .filter(|(p, _, _)| *p == id)
                    .map(|(_, t, lp)| (t.iter().map(|&x| x as usize).collect(), lp.clone()))
                    .unzip();
                rewarded_group(id, job.reward, tokens, logprobs)
            })
            .collect();
        Ok((groups, setup, generate))
    }
}

impl CpuDecoderEngine {
    /// DAPO's dynamic sampling streamed on `weights` ([`GroupStream::fill`]): on the first
    /// data-parallel replica's decoder with `slots` KV slots, group `g` is prompt `g`'s
    /// `job.group_size` samples (seeded [`super::sample_seed`]`(job.seed, g, s)`, so a group's
    /// samples do not depend on when it runs), scored by `job.reward` as it finishes and kept
    /// when its rewards are mixed, until `want` are kept: the kept groups in the order they were
    /// kept, what the fill cost, the rewards of every group scored, and the time spent building
    /// the decoder and generating ([`StreamFill`]).
    pub fn fill(
        &mut self,
        weights: &HostRollout,
        stream: &mut GroupStream,
        job: &DecodeJob,
        want: usize,
        slots: usize,
    ) -> Result<StreamFill, DecodeError> {
        let tp = self.layout.tp().max(1);
        let group: Vec<_> = weights.ranks.iter().take(tp).collect();
        let t = Instant::now();
        let decoder = self
            .layout
            .decoder(&self.model, &group)?
            .with_fp8_compute(self.fp8);
        let setup = t.elapsed();
        let vocab = self.model.model.vocab;
        let positions = 4 + job.tokens;
        let mut decoder = decoder.with_slots(slots.max(1), positions);
        let (mut kept, mut rewards, mut scored) = (Vec::new(), 0.0f64, 0usize);
        let t = Instant::now();
        let filled = stream.fill(
            &mut decoder,
            want,
            |g| {
                let tokens: Vec<u32> = prompt(g, vocab).into_iter().map(|t| t as u32).collect();
                Ok((0..job.group_size)
                    .map(|s| {
                        let params = SamplingParams::new(job.tokens)
                            .with_temperature(job.temperature)
                            .with_seed(sample_seed(job.seed, g, s));
                        Request::new(tokens.clone(), params)
                    })
                    .collect())
            },
            |g, samples| {
                let tokens = samples
                    .iter()
                    .map(|s| s.tokens.iter().map(|&t| t as usize).collect())
                    .collect();
                let logprobs = samples.iter().map(|s| s.logprobs.clone()).collect();
                let group = rewarded_group(g, job.reward, tokens, logprobs);
                rewards += group.rewards.iter().map(|&r| f64::from(r)).sum::<f64>();
                scored += group.rewards.len();
                let mixed = !group.uniform();
                if mixed {
                    kept.push(group);
                }
                Ok(mixed)
            },
        )?;
        kept.truncate(filled.kept.len());
        self.last_kv_bytes = self.kv_bytes(slots, positions);
        Ok(StreamFill {
            kept,
            filled,
            rewards,
            scored,
            setup,
            generate: t.elapsed(),
        })
    }
}

impl RolloutEngine<HostRollout> for CpuDecoderEngine {
    type Error = DecodeError;

    /// Checks every replica's weights against the model (present, shaped as the layout says).
    fn wake(
        &mut self,
        weights: RolloutView<'_, HostRollout>,
        _: &mut PhaseScope,
    ) -> Result<(), DecodeError> {
        let tp = self.layout.tp().max(1);
        for group in weights.get().ranks.chunks(tp) {
            let group: Vec<&RankRollout> = group.iter().collect();
            self.layout.decoder(&self.model, &group)?;
        }
        Ok(())
    }

    fn sleep(&mut self, _: &mut PhaseScope) -> Result<(), DecodeError> {
        Ok(())
    }

    /// Nothing between calls: the decoder allocates its KV cache inside each call and frees it
    /// at the end ([`CpuDecoderEngine::kv_bytes_per_call`]).
    fn memory(&self) -> EngineBytes {
        EngineBytes::default()
    }
}
