//! The settings of a GPU DAPO run, as command-line options (`clap`), and their checks.

use lifecycle_layout::fp8::{Fp8Compute, Fp8Keep, RolloutDtype};
use std::fmt;
use std::path::PathBuf;

use clap::ValueEnum;
use lifecycle_fsdp::check_adam_params;
use lifecycle_layout::{AdamParams, ExpertPlacement};

use super::DapoGpuError;

/// Which switching policies a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LifecycleChoice {
    /// The lazy lifecycle only.
    Lazy,
    /// The eager lifecycle only.
    Eager,
    /// Lazy, then eager on the same seeds, and a comparison.
    Both,
}

impl fmt::Display for LifecycleChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LifecycleChoice::Lazy => "lazy",
            LifecycleChoice::Eager => "eager",
            LifecycleChoice::Both => "both",
        })
    }
}

/// A model with random weights made on the GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SyntheticModel {
    /// Qwen2.5-7B shapes (7.6 B parameters), random weights made on the GPUs.
    #[value(name = "7b")]
    Qwen7b,
    /// A small Qwen2-style config (vocab 4096, hidden 256, 4 layers), random weights.
    Small,
}

/// The training layout of a GPU run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuLayout {
    /// FSDP shards ([`lifecycle_fsdp::FsdpBackend`]).
    #[default]
    Fsdp,
    /// Megatron-Core TP × PP × DP ([`lifecycle_megatron::MegatronGpuBackend`], DP = GPUs /
    /// (TP × PP)).
    Megatron {
        /// Training tensor-parallel degree.
        tp: usize,
        /// Pipeline stages.
        pp: usize,
        /// Expert-parallel degree of a mixture-of-experts model (1 for dense models).
        ep: usize,
        /// Expert tensor-parallel degree (Megatron's default: TP).
        etp: usize,
    },
}

/// Everything a GPU DAPO run takes: the settings any DAPO loop has ([`LoopOptions`]) and those of
/// the GPU run only ([`GpuOptions`]). Flatten it into a `clap` parser (`#[command(flatten)]`), or
/// start from [`Options::default`] and set fields.
#[derive(Debug, Clone, PartialEq, Default, clap::Args)]
pub struct Options {
    /// The training layout (the `dapo` example's `--backend fsdp | megatron`).
    #[arg(skip)]
    pub layout: GpuLayout,
    /// GPUs, model, update and reward settings of the GPU run.
    #[command(flatten)]
    pub gpu: GpuOptions,
    /// Settings of the DAPO loop (the host example's loop has the same ones).
    #[command(flatten)]
    pub run: LoopOptions,
}

/// The settings of the DAPO loop itself: a loop on another backend has the same ones (the
/// defaults are this run's, [`LoopOptions::DEFAULTS`]).
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct LoopOptions {
    /// Rollout tensor-parallel degree (T).
    #[arg(long, default_value_t = LoopOptions::DEFAULTS.tp)]
    pub tp: usize,
    /// A Hugging Face checkpoint folder (config.json + model.safetensors, Qwen2 or Llama).
    #[arg(long, value_name = "PATH")]
    pub checkpoint: Option<PathBuf>,
    /// Switching policy; `both` runs lazy then eager on the same seeds and compares them.
    #[arg(long, value_enum, default_value_t = LoopOptions::DEFAULTS.lifecycle)]
    pub lifecycle: LifecycleChoice,
    /// Training steps per policy.
    #[arg(long, default_value_t = LoopOptions::DEFAULTS.steps)]
    pub steps: usize,
    /// Prompts per gen batch.
    #[arg(long, default_value_t = LoopOptions::DEFAULTS.prompts_per_batch)]
    pub prompts_per_batch: usize,
    /// Samples per prompt (group size).
    #[arg(long, default_value_t = LoopOptions::DEFAULTS.group_size)]
    pub group_size: usize,
    /// Groups with mixed rewards a training batch needs.
    #[arg(long, default_value_t = LoopOptions::DEFAULTS.batch_groups)]
    pub batch_groups: usize,
    /// Most gen batches per step before giving up with an error.
    #[arg(long, default_value_t = LoopOptions::DEFAULTS.max_gen_batches)]
    pub max_gen_batches: usize,
    /// New tokens per sample.
    #[arg(long, default_value_t = LoopOptions::DEFAULTS.tokens)]
    pub tokens: usize,
    /// Sampling temperature (> 0).
    #[arg(long, default_value_t = LoopOptions::DEFAULTS.temperature)]
    pub temperature: f32,
    /// Seed of weights, prompts and sampling.
    #[arg(long, default_value_t = LoopOptions::DEFAULTS.seed)]
    pub seed: u64,
    /// Keep master weights and Adam moments on the GPUs during rollout (`--memory resident`).
    #[arg(long)]
    pub no_offload: bool,

    /// Per-phase detail after the report: each policy's metrics table.
    #[arg(long)]
    pub verbose: bool,
    /// Write each policy's switch timeline as a Chrome / Perfetto trace: PATH.lazy.json, ...
    #[arg(long, value_name = "PATH")]
    pub trace: Option<String>,
    /// Experts of a mixture-of-experts checkpoint: split by TP inside every expert, or
    /// partitioned over the rollout ranks.
    #[arg(skip)]
    pub experts: ExpertPlacement,
    /// The rollout weights' dtype (fp8: quantised in the switch, the block scales agreed across
    /// the ranks at W > 1; the FSDP layout).
    #[arg(skip)]
    pub rollout_dtype: RolloutDtype,
    /// Matrices an fp8 rollout keeps bf16 beyond the published exemptions.
    #[arg(skip)]
    pub fp8_keep: Fp8Keep,
    /// How the decoder computes with fp8 rollout weights: weight-only or W8A8.
    #[arg(skip)]
    pub fp8_compute: Fp8Compute,
}

impl LoopOptions {
    /// The defaults of the GPU run.
    pub const DEFAULTS: LoopOptions = LoopOptions {
        tp: 2,
        checkpoint: None,
        lifecycle: LifecycleChoice::Both,
        steps: 2,
        prompts_per_batch: 8,
        group_size: 4,
        batch_groups: 8,
        max_gen_batches: 16,
        tokens: 16,
        temperature: 1.0,
        seed: 2026,
        no_offload: false,
        verbose: false,
        trace: None,
        experts: ExpertPlacement::TensorParallel,
        rollout_dtype: RolloutDtype::Bf16,
        fp8_keep: Fp8Keep {
            attention: false,
            layers: lifecycle_layout::LayerSet::EMPTY,
        },
        fp8_compute: Fp8Compute::W8A8,
    };
}

impl Default for LoopOptions {
    fn default() -> Self {
        LoopOptions::DEFAULTS
    }
}

/// The settings only the GPU run has: GPUs, model source, prompts and reward rule, update.
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct GpuOptions {
    /// GPUs (W): equal to --tp (one tensor-parallel decoder group), or any W with --tp 1 (one
    /// data-parallel decoder replica per GPU, one process only). With one process per GPU
    /// (torchrun / lifecycle-launch) it must equal WORLD_SIZE.
    #[arg(long, default_value_t = GpuOptions::DEFAULTS.gpus)]
    pub gpus: usize,
    /// A model with random weights made on the GPUs (default: small; not with --checkpoint).
    #[arg(long, value_enum, conflicts_with = "checkpoint")]
    pub synthetic: Option<SyntheticModel>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = GpuOptions::DEFAULTS.prompt_len)]
    pub prompt_len: usize,
    /// M of the reward rule (1 if a generated token t has t mod M == target(prompt); capped at
    /// the vocabulary size). With near-uniform tokens (random weights) and 16 new tokens, the
    /// default 200 leaves ~27 % of groups of 4 with mixed rewards: ~3-4 gen batches per step.
    #[arg(long, default_value_t = GpuOptions::DEFAULTS.reward_modulus)]
    pub reward_modulus: u32,
    /// Half-width of the uniform random weights of --synthetic models.
    #[arg(long, default_value_t = GpuOptions::DEFAULTS.scale)]
    pub scale: f32,
    /// Learning rate of the Adam step (betas 0.9, 0.999, eps 1e-8).
    #[arg(long, default_value_t = GpuOptions::DEFAULTS.lr)]
    pub lr: f32,
    /// Half-width of the uniform synthetic gradients.
    #[arg(long, default_value_t = GpuOptions::DEFAULTS.grad_scale)]
    pub grad_scale: f32,
    /// Every rank (not only rank 0) prints a digest of all the samples it generated, to check
    /// that the processes of a one-process-per-GPU run picked the same tokens.
    #[arg(long)]
    pub samples_digest: bool,
    /// What a switch offloads: by need (the least that makes room for the rollout weights and
    /// the KV cache beside the training state; nothing when they fit), offload (master weights
    /// and Adam moments at every enter, verl's param_offload + optimizer_offload) or resident
    /// (as --no-offload).
    #[arg(long, value_enum, default_value_t = super::memory::MemoryChoice::ByNeed)]
    pub memory: super::memory::MemoryChoice,
    /// KV-cache room to allocate at wake, in tokens summed over the sequences (default: what
    /// one gen batch needs): a larger room makes offload by need move training state out.
    #[arg(long)]
    pub kv_tokens: Option<usize>,
    /// When a switch offloads, hand the rollout its weights with the offload copies still
    /// running (the KV cache then grows into the memory they free, each allocation waiting on
    /// the device only for the frees it needs); `false` waits for the whole offload first.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub offload_overlap: bool,
    /// Wait at setup until the offload's pinned host memory is reserved (it is pinned in the
    /// background from setup either way): the first switch then costs what later ones do, and
    /// setup what pinning costs.
    #[arg(long)]
    pub wait_for_pinning: bool,
    /// Prefix sharing: prefill each prompt of a gen batch once and fork its KV to the group's
    /// samples (`true`, the default: G times less prefill work), or prefill every sequence
    /// (`false`: the prompt GEMMs then run on all rows; forking can round differently, so at
    /// 7.6B shapes some samples differ from the per-sequence prefill's).
    #[arg(long, default_value_t = GpuOptions::DEFAULTS.fork_prefill, action = clap::ArgAction::Set)]
    pub fork_prefill: bool,
    /// The element type of the engine's KV cache: bf16 (half the bytes, as vLLM and SGLang keep
    /// it), f32 (the decoder's exact mode) or fp8 (e4m3 with one f32 scale per position and kv
    /// head: a quarter of f32's bytes and the scales).
    #[arg(long, default_value_t = GpuOptions::DEFAULTS.kv_dtype,
          value_parser = <lifecycle_decoder::KvDtype as std::str::FromStr>::from_str)]
    pub kv_dtype: lifecycle_decoder::KvDtype,
}

impl GpuOptions {
    /// The defaults.
    pub const DEFAULTS: GpuOptions = GpuOptions {
        gpus: 2,
        synthetic: None,
        prompt_len: 8,
        reward_modulus: 200,
        scale: 0.05,
        lr: 1e-4,
        grad_scale: 1e-2,
        samples_digest: false,
        memory: super::memory::MemoryChoice::ByNeed,
        kv_tokens: None,
        offload_overlap: true,
        wait_for_pinning: false,
        fork_prefill: true,
        kv_dtype: lifecycle_decoder::KvDtype::Bf16,
    };
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions::DEFAULTS
    }
}

impl Options {
    /// Checks every setting that needs no GPU and no launcher: counts at least 1, temperature,
    /// scales and learning rate finite and > 0. The error names the option.
    pub fn check(&self) -> Result<(), DapoGpuError> {
        let (r, g) = (&self.run, &self.gpu);
        let checks = [
            (r.steps == 0, "--steps must be at least 1".to_string()),
            (
                g.gpus == 0 || r.tp == 0,
                "--gpus and --tp must be at least 1".to_string(),
            ),
            (
                r.group_size < 2,
                "--group-size must be at least 2 (DAPO compares rewards within a group)"
                    .to_string(),
            ),
            (
                r.prompts_per_batch == 0 || r.batch_groups == 0 || r.max_gen_batches == 0,
                "--prompts-per-batch, --batch-groups and --max-gen-batches must be at least 1"
                    .to_string(),
            ),
            (
                r.tokens == 0 || g.prompt_len == 0,
                "--tokens and --prompt-len must be at least 1".to_string(),
            ),
            (
                !(r.temperature.is_finite() && r.temperature > 0.0),
                format!(
                    "--temperature must be finite and > 0, found {}",
                    r.temperature
                ),
            ),
            (
                g.reward_modulus == 0,
                "--reward-modulus must be at least 1".to_string(),
            ),
            (
                !(g.scale.is_finite() && g.scale > 0.0),
                format!("--scale must be finite and > 0, found {}", g.scale),
            ),
            (
                !(g.grad_scale.is_finite() && g.grad_scale > 0.0),
                format!(
                    "--grad-scale must be finite and > 0, found {}",
                    g.grad_scale
                ),
            ),
        ];
        if let Some((_, msg)) = checks.into_iter().find(|(bad, _)| *bad) {
            return Err(DapoGpuError::Usage(msg));
        }
        check_adam_params(&self.adam_params())
            .map_err(|e| DapoGpuError::Usage(format!("--lr: {e}")))
    }

    /// The Adam hyper-parameters of the update (`--lr`, the other ones at their defaults).
    pub(crate) fn adam_params(&self) -> AdamParams {
        AdamParams {
            lr: self.gpu.lr,
            ..AdamParams::default()
        }
    }
}
