//! DAPO end to end on GPUs: dynamic sampling through the GPU decoder on the FSDP backend's
//! resharded rollout weights, an in-place Adam step on synthetic gradients between training
//! steps, and the lazy and eager lifecycles compared on the same seeds.
//!
//! ```text
//! dapo_gpu --gpus 2 --tp 2 --synthetic 7b --lifecycle both    # Qwen2.5-7B shapes, random weights
//! dapo_gpu --gpus 2 --tp 1 --synthetic 7b                      # 2 data-parallel decoder replicas
//! dapo_gpu --gpus 2 --tp 2 --checkpoint path/to/hf-model       # config.json + model.safetensors
//! lifecycle-launch --nproc-per-node 2 -- dapo_gpu --gpus 2 --tp 2   # one process per GPU
//! dapo_gpu --help                                              # every option
//! ```
//!
//! Per training step: gen batches of `--prompts-per-batch` prompts × `--group-size` samples are
//! generated with temperature sampling by [`GpuDecoder`] on the resident rollout weights; each
//! sample is rewarded by a verifiable rule (1 if one of its generated tokens `t` has
//! `t mod M == target(prompt)`, `M = --reward-modulus`); groups whose rewards all agree are
//! dropped; gen batches continue until `--batch-groups` groups are kept (at most
//! `--max-gen-batches`, then a clear error). Then the update: seeded synthetic gradients are
//! written into the gradient shards on the GPUs and one Adam step is applied in place to the
//! fp32 master, m, v shards ([`FsdpBackend::fill_synthetic_grads`],
//! [`FsdpBackend::adam_step`]). It is an Adam step on synthetic gradients, not a learned update:
//! the gradients are noise, not the gradient of a loss of the samples. Nothing is reallocated,
//! and the pinned host buffers of the offload are allocated at the first switch and reused.
//!
//! Launch: with launcher variables (torchrun, Slurm, `lifecycle-launch`) each process drives one
//! GPU (`--gpus` must equal `WORLD_SIZE`; only rank 0 prints the report, every rank prints its
//! errors); otherwise one process drives `--gpus` GPUs with a thread each. The decoder runs one
//! tensor-parallel group (`--gpus` = `--tp`), or, in one process at `--tp 1`, one data-parallel
//! replica per GPU. Master weights and Adam moments are offloaded to pinned host memory during
//! rollout (`MemoryPolicy::default()`; `--no-offload` keeps them on the GPUs).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use lifecycle_core::{
    HumanBytes, HumanDuration, Lifecycle, LifecycleConfig, LifecycleError, LinkBytes, MemoryPolicy,
    Metrics, Switching,
};
use lifecycle_cuda::{CudaError, ThreadRankPool};
use lifecycle_decoder::{
    load_checkpoint, CheckpointError, DecodeError, Decoder, ModelConfig, Sampling,
};
use lifecycle_decoder_gpu::{decode_topology, DecodeTopology, GpuDecodeError, GpuDecoder};
use lifecycle_dist::{DistError, RankEnv};
use lifecycle_fsdp::{check_adam_params, FsdpBackend, FsdpError, FsdpTrainState};
use lifecycle_host::{AdamParams, HostTensor};

/// `println!` on the rank that reports (every rank but 0 is silent in process mode).
macro_rules! say {
    ($root:expr) => {
        if $root {
            println!();
        }
    };
    ($root:expr, $($arg:tt)*) => {
        if $root {
            println!($($arg)*);
        }
    };
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LifecycleArg {
    Lazy,
    Eager,
    Both,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SyntheticArg {
    /// Qwen2.5-7B shapes (7.6 B parameters), random weights made on the GPUs.
    #[value(name = "7b")]
    Qwen7b,
    /// A small Qwen2-style config (vocab 4096, hidden 256, 4 layers), random weights.
    Small,
}

/// DAPO on NVIDIA GPUs: FSDP training state, GPU decoder rollouts, lazy vs eager lifecycles.
#[derive(Debug, Parser)]
#[command(name = "dapo_gpu")]
struct Args {
    /// GPUs (W): equal to --tp (one tensor-parallel decoder group), or any W with --tp 1 (one
    /// data-parallel decoder replica per GPU, one process only). With one process per GPU
    /// (torchrun / lifecycle-launch) it must equal WORLD_SIZE.
    #[arg(long, default_value_t = 2)]
    gpus: usize,
    /// Rollout tensor-parallel degree (T).
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// A Hugging Face checkpoint folder (config.json + model.safetensors, Qwen2 or Llama).
    #[arg(long, conflicts_with = "synthetic")]
    checkpoint: Option<PathBuf>,
    /// A model with random weights made on the GPUs (default: small).
    #[arg(long, value_enum)]
    synthetic: Option<SyntheticArg>,
    /// Switching policy; `both` runs lazy then eager on the same seeds and compares them.
    #[arg(long, value_enum, default_value_t = LifecycleArg::Both)]
    lifecycle: LifecycleArg,
    /// Training steps per policy.
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Prompts per gen batch.
    #[arg(long, default_value_t = 8)]
    prompts_per_batch: usize,
    /// Samples per prompt (group size).
    #[arg(long, default_value_t = 4)]
    group_size: usize,
    /// Groups with mixed rewards a training batch needs.
    #[arg(long, default_value_t = 8)]
    batch_groups: usize,
    /// Most gen batches per step before giving up with an error.
    #[arg(long, default_value_t = 16)]
    max_gen_batches: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 8)]
    prompt_len: usize,
    /// New tokens per sample.
    #[arg(long, default_value_t = 16)]
    tokens: usize,
    /// Sampling temperature (> 0).
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// M of the reward rule (1 if a generated token t has t mod M == target(prompt); capped at
    /// the vocabulary size). With near-uniform tokens (random weights) and 16 new tokens, the
    /// default 200 leaves ~27 % of groups of 4 with mixed rewards: ~3-4 gen batches per step.
    #[arg(long, default_value_t = 200)]
    reward_modulus: u32,
    /// Seed of weights, prompts and sampling.
    #[arg(long, default_value_t = 2026)]
    seed: u64,
    /// Half-width of the uniform random weights of --synthetic models.
    #[arg(long, default_value_t = 0.05)]
    scale: f32,
    /// Keep master weights and Adam moments on the GPUs during rollout (default: offloaded).
    #[arg(long)]
    no_offload: bool,
    /// Learning rate of the Adam step (betas 0.9, 0.999, eps 1e-8).
    #[arg(long, default_value_t = 1e-4)]
    lr: f32,
    /// Half-width of the uniform synthetic gradients.
    #[arg(long, default_value_t = 1e-2)]
    grad_scale: f32,
    /// Every rank (not only rank 0) prints a digest of all the samples it generated, to check
    /// that the processes of a one-process-per-GPU run picked the same tokens.
    #[arg(long)]
    samples_digest: bool,
}

#[derive(Debug, thiserror::Error)]
enum DapoGpuError {
    #[error("invalid setting: {0}")]
    Usage(String),
    #[error(transparent)]
    Gpu(#[from] GpuDecodeError),
    #[error(transparent)]
    Fsdp(#[from] FsdpError),
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(transparent)]
    Lifecycle(Box<LifecycleError<FsdpError>>),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error(transparent)]
    Dist(#[from] DistError),
    #[error(
        "step {step}: {kept} of {needed} groups with mixed rewards after {gen_batches} gen batches \
         (the limit, --max-gen-batches): raise the limit, lower --batch-groups, or change \
         --reward-modulus so fewer groups have uniform rewards"
    )]
    BatchNotFilled {
        step: usize,
        kept: usize,
        needed: usize,
        gen_batches: usize,
    },
}

impl From<LifecycleError<FsdpError>> for DapoGpuError {
    fn from(e: LifecycleError<FsdpError>) -> Self {
        DapoGpuError::Lifecycle(Box::new(e))
    }
}

/// The Qwen2.5-7B config (the shapes of `lifecycle_fsdp::shapes::qwen2_5_7b(28)`).
const QWEN2_5_7B_CONFIG: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
  "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
  "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "vocab_size": 152064
}"#;

const SMALL_CONFIG: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
  "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
  "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
  "rope_theta": 10000.0, "tie_word_embeddings": false, "vocab_size": 4096
}"#;

/// Where the initial weights come from; a policy after the first starts again from them, put
/// back in place.
enum Source {
    /// Random weights made on the GPUs ([`FsdpBackend::synthetic_state`]).
    Synthetic {
        shapes: Vec<(String, Vec<usize>)>,
        seed: u64,
        scale: f32,
    },
    /// Checkpoint weights (fp32, kept in host memory to restore them).
    Host { tensors: Vec<HostTensor> },
}

impl Source {
    /// The training state of the initial weights, with a fresh optimizer (m, v, grads zero).
    fn initial(&self, backend: &FsdpBackend) -> Result<FsdpTrainState, DapoGpuError> {
        let mut state = match self {
            Source::Synthetic {
                shapes,
                seed,
                scale,
            } => backend.synthetic_state(shapes, *seed, *scale)?,
            Source::Host { tensors } => backend.state_from_tensors(tensors.clone())?,
        };
        backend.reset_optimizer(&mut state)?;
        Ok(state)
    }

    /// Puts the initial weights and a fresh optimizer back into `state`, in place.
    fn reset(&self, backend: &FsdpBackend, state: &mut FsdpTrainState) -> Result<(), DapoGpuError> {
        match self {
            Source::Synthetic { seed, scale, .. } => {
                backend.fill_synthetic_master(state, *seed, *scale)?
            }
            Source::Host { tensors } => backend.upload_master(state, tensors)?,
        }
        backend.reset_optimizer(state)?;
        Ok(())
    }
}

/// The update between training steps: synthetic gradients and one Adam step, in place.
#[derive(Debug, Clone, Copy)]
struct Update {
    params: AdamParams,
    grad_scale: f32,
    seed: u64,
}

impl Update {
    /// Fills the gradients of `step` (1-based) and applies the Adam step, on the GPUs.
    fn apply(
        &self,
        backend: &FsdpBackend,
        state: &mut FsdpTrainState,
        step: usize,
    ) -> Result<(), DapoGpuError> {
        let seed = self
            .seed
            .wrapping_add(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(step as u64));
        backend.fill_synthetic_grads(state, seed, self.grad_scale)?;
        backend.adam_step(state, self.params)?;
        Ok(())
    }

    /// What the update is, for the output.
    fn describe(&self) -> String {
        let p = self.params;
        format!(
            "update: Adam step on synthetic gradients, not a learned update: seeded uniform noise \
             in [-{}, {}) written into the gradient shards on the GPUs, then one Adam step (lr {}, \
             betas {} / {}, eps {}) in place on the fp32 master, m, v shards \
             (FsdpBackend::fill_synthetic_grads + adam_step); nothing reallocated, the pinned host \
             offload buffers reused",
            self.grad_scale, self.grad_scale, p.lr, p.beta1, p.beta2, p.eps
        )
    }
}

/// Prompt `id`'s tokens and its reward target.
fn prompt(id: u64, len: usize, vocab: usize, modulus: u32) -> (Vec<u32>, u32) {
    let v = vocab as u64;
    let tokens = (0..len as u64)
        .map(|k| ((id * 31 + k * 7 + 3) % v) as u32)
        .collect();
    (tokens, ((id * 13 + 5) % u64::from(modulus)) as u32)
}

/// The verifiable reward: 1 if a generated token `t` has `t mod modulus == target`.
fn reward(sample: &[u32], target: u32, modulus: u32) -> f32 {
    if sample.iter().any(|&t| t % modulus == target) {
        1.0
    } else {
        0.0
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Group {
    prompt: u64,
    samples: Vec<Vec<u32>>,
    rewards: Vec<f32>,
}

impl Group {
    fn uniform(&self) -> bool {
        self.rewards.windows(2).all(|w| w[0] == w[1])
    }
}

/// One gen batch: switch (if needed), decoder setup, generation, rewards.
struct Batch {
    groups: Vec<Group>,
    /// Time of the whole rollout call (switch, decoder setup, generation, eager exit).
    wall: Duration,
    /// Decoder setup (weight checks, cuBLAS handles, NVRTC kernels).
    setup: Duration,
    /// `generate` alone.
    generate: Duration,
    /// Switch time (enter, and the exit under eager) during the call.
    switch: Duration,
    switches: u64,
}

struct Ctx<'a> {
    args: &'a Args,
    config: &'a ModelConfig,
    /// M of the reward rule (`--reward-modulus` capped at the vocabulary size).
    modulus: u32,
    /// Whether this process prints the report (rank 0, or the only process).
    root: bool,
    update: Update,
}

fn rollout_batch(
    lc: &mut Lifecycle<FsdpBackend>,
    cx: &Ctx<'_>,
    ids: &[u64],
    seed: u64,
) -> Result<Batch, DapoGpuError> {
    let a = cx.args;
    let before = lc.metrics().clone();
    let start = Instant::now();
    let prompts: Vec<(Vec<u32>, u32)> = ids
        .iter()
        .map(|&id| prompt(id, a.prompt_len, cx.config.vocab_size, cx.modulus))
        .collect();
    let seqs: Vec<Vec<u32>> = prompts
        .iter()
        .flat_map(|(p, _)| std::iter::repeat_n(p.clone(), a.group_size))
        .collect();
    let sampling = Sampling {
        temperature: a.temperature,
        max_new_tokens: a.tokens,
        seed,
        stop_token: None,
    };
    let session = lc.rollout()?;
    let (out, setup, generate) = {
        let weights = session.weights();
        let t = Instant::now();
        let mut decoder = GpuDecoder::new(cx.config, session.backend(), weights.get())?;
        let setup = t.elapsed();
        let t = Instant::now();
        let out = decoder.generate(&seqs, &sampling)?;
        (out, setup, t.elapsed())
    };
    session.finish()?;
    let wall = start.elapsed();
    let delta = lc.metrics().since(&before);
    let groups = ids
        .iter()
        .zip(&prompts)
        .zip(out.chunks(a.group_size))
        .map(|((&id, (_, target)), samples)| Group {
            prompt: id,
            rewards: samples
                .iter()
                .map(|s| reward(s, *target, cx.modulus))
                .collect(),
            samples: samples.to_vec(),
        })
        .collect();
    Ok(Batch {
        groups,
        wall,
        setup,
        generate,
        switch: delta.switch_time(),
        switches: delta.switches(),
    })
}

struct StepReport {
    gen_batches: usize,
    kept_groups: usize,
    generated_groups: usize,
    mean_reward: f32,
    switches: u64,
    exits: u64,
    bytes: LinkBytes,
    rollout: Duration,
    generate: Duration,
    setup: Duration,
    switch: Duration,
    /// The update phase: `lc.train()` (lazy's exit) and the in-place step.
    update: Duration,
    /// The in-place step alone (synthetic gradients + Adam).
    adam: Duration,
    /// Switch time of each gen batch's rollout call.
    batch_switch: Vec<Duration>,
}

struct PolicyReport {
    switching: Switching,
    steps: Vec<StepReport>,
    groups: Vec<Group>,
    warmup: Duration,
}

impl PolicyReport {
    fn sum(&self, f: impl Fn(&StepReport) -> Duration) -> Duration {
        self.steps.iter().map(f).sum()
    }
    fn switches(&self) -> u64 {
        self.steps.iter().map(|s| s.switches).sum()
    }
    fn exits(&self) -> u64 {
        self.steps.iter().map(|s| s.exits).sum()
    }
    fn bytes(&self) -> u64 {
        self.steps.iter().map(|s| s.bytes.moved()).sum()
    }
}

fn name(s: Switching) -> &'static str {
    match s {
        Switching::Lazy => "lazy",
        Switching::Eager => "eager",
    }
}

fn run_policy(
    lc: &mut Lifecycle<FsdpBackend>,
    cx: &Ctx<'_>,
    source: &Source,
    switching: Switching,
    first: bool,
) -> Result<PolicyReport, DapoGpuError> {
    let a = cx.args;
    let root = cx.root;
    lc.set_switching(switching);
    if !first {
        // Back to the initial weights and a fresh optimizer, in place, so both policies see the
        // same weights at every step.
        let mut tr = lc.train()?;
        let (backend, state) = tr.backend_and_state_mut();
        source.reset(backend, state)?;
    }
    // Warm-up (not measured): one switch and a one-token generation, so host memory for the
    // offload is pinned (the first policy only: the buffers are kept) and the decoder's kernels,
    // cuBLAS and NCCL are initialised.
    let t = Instant::now();
    {
        let session = lc.rollout()?;
        {
            let w = session.weights();
            let mut decoder = GpuDecoder::new(cx.config, session.backend(), w.get())?;
            decoder.generate(&[vec![1, 2, 3]], &Sampling::greedy(1))?;
        }
        session.exit()?;
    }
    let warmup = t.elapsed();
    say!(
        root,
        "[{}] warm-up (switch + exit + 1-token generation, not measured): {}",
        name(switching),
        HumanDuration(warmup)
    );
    let mut next_prompt = 0u64;
    let mut steps = Vec::new();
    let mut all_groups = Vec::new();
    for step in 1..=a.steps {
        let before = lc.metrics().clone();
        let start = Instant::now();
        let mut kept: Vec<Group> = Vec::new();
        let (mut gen_batches, mut generated) = (0usize, 0usize);
        let (mut generate, mut setup) = (Duration::ZERO, Duration::ZERO);
        let mut batch_switch = Vec::new();
        while kept.len() < a.batch_groups {
            if gen_batches == a.max_gen_batches {
                return Err(DapoGpuError::BatchNotFilled {
                    step,
                    kept: kept.len(),
                    needed: a.batch_groups,
                    gen_batches,
                });
            }
            let ids: Vec<u64> = (next_prompt..next_prompt + a.prompts_per_batch as u64).collect();
            next_prompt += a.prompts_per_batch as u64;
            let seed = a.seed ^ ((step as u64) << 32) ^ ((gen_batches as u64) << 16);
            let b = rollout_batch(lc, cx, &ids, seed)?;
            gen_batches += 1;
            generated += b.groups.len();
            generate += b.generate;
            setup += b.setup;
            batch_switch.push(b.switch);
            let n_kept = b.groups.iter().filter(|g| !g.uniform()).count();
            say!(
                root,
                "[{}] step {step} gen batch {gen_batches}: {} sequences, {n_kept} of {} groups \
                 mixed, call {} (switch {} x{}, decoder setup {}, generate {})",
                name(switching),
                ids.len() * a.group_size,
                b.groups.len(),
                HumanDuration(b.wall),
                HumanDuration(b.switch),
                b.switches,
                HumanDuration(b.setup),
                HumanDuration(b.generate),
            );
            all_groups.extend(b.groups.iter().cloned());
            kept.extend(b.groups.into_iter().filter(|g| !g.uniform()));
        }
        let rollout = start.elapsed();
        kept.truncate(a.batch_groups);
        let mean_reward = kept.iter().flat_map(|g| &g.rewards).sum::<f32>()
            / (kept.len() * a.group_size).max(1) as f32;
        let t = Instant::now();
        let adam = {
            let mut tr = lc.train()?;
            let (backend, state) = tr.backend_and_state_mut();
            let t = Instant::now();
            cx.update.apply(backend, state, step)?;
            t.elapsed()
        };
        let update = t.elapsed();
        let delta: Metrics = lc.metrics().since(&before);
        let r = StepReport {
            gen_batches,
            kept_groups: kept.len(),
            generated_groups: generated,
            mean_reward,
            switches: delta.switches(),
            exits: delta.exits,
            bytes: delta.bytes(),
            rollout,
            generate,
            setup,
            switch: delta.switch_time(),
            update,
            adam,
            batch_switch,
        };
        say!(
            root,
            "[{}] step {step}: gen batches {}, groups {} generated / {} kept, mean reward {:.3}, \
             switches {}, exits {}, bytes {} (d2d {}, d2h {}, h2d {}), rollout phase {} (generate \
             {}, decoder setup {}), switch time {}, update {} (of which Adam step on synthetic \
             gradients {}; the rest is the exit under lazy)",
            name(switching),
            r.gen_batches,
            r.generated_groups,
            r.kept_groups,
            r.mean_reward,
            r.switches,
            r.exits,
            HumanBytes(r.bytes.moved()),
            HumanBytes(r.bytes.device_to_device),
            HumanBytes(r.bytes.device_to_host),
            HumanBytes(r.bytes.host_to_device),
            HumanDuration(r.rollout),
            HumanDuration(r.generate),
            HumanDuration(r.setup),
            HumanDuration(r.switch),
            HumanDuration(r.update),
            HumanDuration(r.adam),
        );
        steps.push(r);
    }
    Ok(PolicyReport {
        switching,
        steps,
        groups: all_groups,
        warmup,
    })
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn compare(lazy: &PolicyReport, eager: &PolicyReport) {
    let identical = lazy.groups == eager.groups;
    println!();
    println!(
        "lazy vs eager (same seeds; samples identical: {})",
        if identical { "yes" } else { "NO" }
    );
    let row = |what: &str, l: String, e: String| println!("  {what:<34} {l:>14} {e:>14}");
    row("", "lazy".into(), "eager".into());
    let gb = |p: &PolicyReport| {
        p.steps
            .iter()
            .map(|s| s.gen_batches.to_string())
            .collect::<Vec<_>>()
            .join("+")
    };
    row("gen batches (per step)", gb(lazy), gb(eager));
    let d =
        |p: &PolicyReport, f: &dyn Fn(&StepReport) -> Duration| format!("{:.3} s", secs(p.sum(f)));
    row(
        "rollout phase",
        d(lazy, &|s| s.rollout),
        d(eager, &|s| s.rollout),
    );
    row(
        "  of which generate",
        d(lazy, &|s| s.generate),
        d(eager, &|s| s.generate),
    );
    row(
        "  of which decoder setup",
        d(lazy, &|s| s.setup),
        d(eager, &|s| s.setup),
    );
    row(
        "update phase (incl. lazy's exit)",
        d(lazy, &|s| s.update),
        d(eager, &|s| s.update),
    );
    row(
        "  of which Adam step (synthetic g)",
        d(lazy, &|s| s.adam),
        d(eager, &|s| s.adam),
    );
    row(
        "rollout + update",
        d(lazy, &|s| s.rollout + s.update),
        d(eager, &|s| s.rollout + s.update),
    );
    row(
        "switches",
        lazy.switches().to_string(),
        eager.switches().to_string(),
    );
    row("exits", lazy.exits().to_string(), eager.exits().to_string());
    row(
        "bytes moved",
        HumanBytes(lazy.bytes()).to_string(),
        HumanBytes(eager.bytes()).to_string(),
    );
    row(
        "switch time (enter + exit)",
        d(lazy, &|s| s.switch),
        d(eager, &|s| s.switch),
    );
    let per = |p: &PolicyReport| {
        let n = p.switches().max(1) as f64;
        format!("{:.3} s", secs(p.sum(|s| s.switch)) / n)
    };
    row("time per switch", per(lazy), per(eager));
    // Eager's switch per rollout call (enter + exit): the updates are in place, so every call
    // does the same work (no host memory pinned anew after an update).
    let steady: Vec<Duration> = eager
        .steps
        .iter()
        .flat_map(|s| s.batch_switch.iter().copied())
        .collect();
    let steady_mean = if steady.is_empty() {
        None
    } else {
        Some(secs(steady.iter().sum::<Duration>()) / steady.len() as f64)
    };
    let saving_rollout = secs(eager.sum(|s| s.rollout)) - secs(lazy.sum(|s| s.rollout));
    let saving_step =
        secs(eager.sum(|s| s.rollout + s.update)) - secs(lazy.sum(|s| s.rollout + s.update));
    let extra: usize = lazy
        .steps
        .iter()
        .map(|s| s.gen_batches.saturating_sub(1))
        .sum();
    println!(
        "  warm-ups (not measured): lazy {:.3} s, eager {:.3} s",
        secs(lazy.warmup),
        secs(eager.warmup)
    );
    println!(
        "  measured saving, rollout phase: {saving_rollout:.3} s; rollout + update: \
         {saving_step:.3} s (lazy pays its exit in the update phase)"
    );
    match steady_mean {
        Some(t) => {
            let predicted = extra as f64 * t;
            println!(
                "  prediction (gen batches - 1) x switch time = {extra} x {t:.3} s (eager's mean \
                 enter + exit per rollout call, over {} calls) = {predicted:.3} s; measured / \
                 predicted: rollout phase {:.2}, rollout + update {:.2}",
                steady.len(),
                if predicted > 0.0 {
                    saving_rollout / predicted
                } else {
                    f64::NAN
                },
                if predicted > 0.0 {
                    saving_step / predicted
                } else {
                    f64::NAN
                },
            );
        }
        None => println!("  prediction: no step needed more than one gen batch"),
    }
}

/// FNV-1a of every group's prompt id and sample tokens, in order, and the number of samples.
fn samples_digest(groups: &[Group]) -> (u64, usize) {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3);
        }
    };
    let mut samples = 0;
    for g in groups {
        eat(g.prompt);
        for s in &g.samples {
            samples += 1;
            eat(s.len() as u64);
            s.iter().for_each(|&t| eat(u64::from(t)));
        }
    }
    (h, samples)
}

/// How this process was started.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Launch {
    /// One process, a thread per GPU.
    Threads,
    /// One process per GPU (torchrun, Slurm, `lifecycle-launch`).
    Process(RankEnv),
}

/// Checks the settings (and the launch) before any GPU work; the launch mode and the decoder's
/// topology.
fn check_args(a: &Args, env: Option<RankEnv>) -> Result<(Launch, DecodeTopology), DapoGpuError> {
    let checks = [
        (a.steps == 0, "--steps must be at least 1".to_string()),
        (
            a.gpus == 0 || a.tp == 0,
            "--gpus and --tp must be at least 1".to_string(),
        ),
        (
            a.group_size < 2,
            "--group-size must be at least 2 (DAPO compares rewards within a group)".to_string(),
        ),
        (
            a.prompts_per_batch == 0 || a.batch_groups == 0 || a.max_gen_batches == 0,
            "--prompts-per-batch, --batch-groups and --max-gen-batches must be at least 1"
                .to_string(),
        ),
        (
            a.tokens == 0 || a.prompt_len == 0,
            "--tokens and --prompt-len must be at least 1".to_string(),
        ),
        (
            !(a.temperature.is_finite() && a.temperature > 0.0),
            format!(
                "--temperature must be finite and > 0, found {}",
                a.temperature
            ),
        ),
        (
            a.reward_modulus == 0,
            "--reward-modulus must be at least 1".to_string(),
        ),
        (
            !(a.scale.is_finite() && a.scale > 0.0),
            format!("--scale must be finite and > 0, found {}", a.scale),
        ),
        (
            !(a.grad_scale.is_finite() && a.grad_scale > 0.0),
            format!(
                "--grad-scale must be finite and > 0, found {}",
                a.grad_scale
            ),
        ),
    ];
    if let Some((_, msg)) = checks.into_iter().find(|(bad, _)| *bad) {
        return Err(DapoGpuError::Usage(msg));
    }
    check_adam_params(&adam_params(a)).map_err(|e| DapoGpuError::Usage(format!("--lr: {e}")))?;
    let (launch, local) = match env {
        None => (Launch::Threads, a.gpus),
        Some(env) => {
            if env.world_size != a.gpus {
                return Err(DapoGpuError::Usage(format!(
                    "--gpus {} but the launcher started WORLD_SIZE = {} processes: with one \
                     process per GPU, --gpus must equal WORLD_SIZE",
                    a.gpus, env.world_size
                )));
            }
            (Launch::Process(env), 1)
        }
    };
    let topology = decode_topology(a.gpus, a.tp, local)?;
    Ok((launch, topology))
}

fn adam_params(a: &Args) -> AdamParams {
    AdamParams {
        lr: a.lr,
        ..AdamParams::default()
    }
}

fn run(args: &Args, env: Option<RankEnv>) -> Result<(), DapoGpuError> {
    let a = args;
    let (launch, topology) = check_args(a, env)?;
    let root = match &launch {
        Launch::Threads => true,
        Launch::Process(env) => env.rank == 0,
    };
    let (config, source, what) = match (&a.checkpoint, a.synthetic) {
        (Some(dir), _) => {
            let ckpt = load_checkpoint(dir)?;
            let base = ckpt
                .tensors
                .into_iter()
                .map(|t| {
                    let data = t.data.to_f32().ok_or_else(|| {
                        DapoGpuError::Usage(format!(
                            "checkpoint tensor {} is not floating point ({})",
                            t.name,
                            t.data.dtype()
                        ))
                    })?;
                    Ok(HostTensor::f32(t.name, t.shape, data))
                })
                .collect::<Result<Vec<_>, DapoGpuError>>()?;
            let what = format!("checkpoint {}", dir.display());
            (ckpt.config, Source::Host { tensors: base }, what)
        }
        (None, Some(SyntheticArg::Qwen7b)) => {
            let config = ModelConfig::from_json_str(QWEN2_5_7B_CONFIG)?;
            let shapes = lifecycle_fsdp::shapes::qwen2_5_7b(config.num_layers);
            if shapes != config.tensor_shapes() {
                return Err(DapoGpuError::Usage(
                    "the Qwen2.5-7B config does not give lifecycle_fsdp::shapes::qwen2_5_7b's \
                     tensors"
                        .into(),
                ));
            }
            let w = Source::Synthetic {
                shapes,
                seed: a.seed,
                scale: a.scale,
            };
            (
                config,
                w,
                "synthetic Qwen2.5-7B shapes, random weights".to_string(),
            )
        }
        (None, Some(SyntheticArg::Small) | None) => {
            let config = ModelConfig::from_json_str(SMALL_CONFIG)?;
            let w = Source::Synthetic {
                shapes: config.tensor_shapes(),
                seed: a.seed,
                scale: a.scale,
            };
            (
                config,
                w,
                "small synthetic Qwen2 config, random weights".to_string(),
            )
        }
    };
    let modulus = a
        .reward_modulus
        .min(u32::try_from(config.vocab_size).unwrap_or(u32::MAX))
        .max(1);
    let memory = if a.no_offload {
        MemoryPolicy {
            offload_params: false,
            offload_optimizer: false,
            keep_rollout_resident: false,
        }
    } else {
        MemoryPolicy::default()
    };
    let mode = match (&launch, topology) {
        (Launch::Process(env), _) => format!(
            "one process per GPU (rank {} of {}, local GPU {})",
            env.rank, env.world_size, env.local_rank
        ),
        (Launch::Threads, DecodeTopology::Group) => {
            "one process, a thread per GPU, one tensor-parallel decoder group".to_string()
        }
        (Launch::Threads, DecodeTopology::Replicas(r)) => {
            format!("one process, a thread per GPU, {r} data-parallel decoder replicas")
        }
    };
    say!(
        root,
        "dapo_gpu: {what}: {:.3} B parameters, W = {}, T = {} ({mode}), offload master {} / Adam {}",
        config.params() as f64 / 1e9,
        a.gpus,
        a.tp,
        if memory.offload_params { "on" } else { "off" },
        if memory.offload_optimizer {
            "on"
        } else {
            "off"
        },
    );
    say!(
        root,
        "  per step: gen batches of {} prompts x {} samples, {} prompt + {} new tokens, \
         temperature {}, until {} groups with mixed rewards (at most {} gen batches); reward 1 if \
         a generated token t has t mod {} == target(prompt)",
        a.prompts_per_batch,
        a.group_size,
        a.prompt_len,
        a.tokens,
        a.temperature,
        a.batch_groups,
        a.max_gen_batches,
        modulus
    );
    let update = Update {
        params: adam_params(a),
        grad_scale: a.grad_scale,
        seed: a.seed ^ 0x5EED_6AAD,
    };
    say!(root, "  {}", update.describe());
    let t = Instant::now();
    let layout = config.rollout_layout(a.tp)?;
    let pool = match &launch {
        Launch::Threads => ThreadRankPool::new(a.gpus)?,
        Launch::Process(env) => ThreadRankPool::for_process(env, Duration::from_secs(120))?,
    };
    let backend = FsdpBackend::new(Arc::new(pool), layout);
    let state = source.initial(&backend)?;
    let policies: &[Switching] = match a.lifecycle {
        LifecycleArg::Lazy => &[Switching::Lazy],
        LifecycleArg::Eager => &[Switching::Eager],
        LifecycleArg::Both => &[Switching::Lazy, Switching::Eager],
    };
    let mut lc = Lifecycle::with_config(
        backend,
        state,
        LifecycleConfig {
            switching: policies[0],
            memory,
        },
    )?;
    say!(
        root,
        "  setup (GPUs, NCCL, training state): {}",
        HumanDuration(t.elapsed())
    );
    let cx = Ctx {
        args: a,
        config: &config,
        modulus,
        root,
        update,
    };
    let mut reports = Vec::new();
    for (i, &p) in policies.iter().enumerate() {
        reports.push(run_policy(&mut lc, &cx, &source, p, i == 0)?);
    }
    for r in &reports {
        say!(
            root,
            "[{}] total: {} steps, {} gen batches, rollout phase {:.3} s, switches {}, exits {}, \
             bytes {}, switch time {:.3} s, Adam steps on synthetic gradients {:.3} s",
            name(r.switching),
            r.steps.len(),
            r.steps.iter().map(|s| s.gen_batches).sum::<usize>(),
            secs(r.sum(|s| s.rollout)),
            r.switches(),
            r.exits(),
            HumanBytes(r.bytes()),
            secs(r.sum(|s| s.switch)),
            secs(r.sum(|s| s.adam)),
        );
    }
    if let ([lazy, eager], true) = (reports.as_slice(), root) {
        compare(lazy, eager);
    }
    if a.samples_digest {
        let rank = match &launch {
            Launch::Threads => "the only process".to_string(),
            Launch::Process(env) => format!("rank {} of {}", env.rank, env.world_size),
        };
        for r in &reports {
            let (digest, samples) = samples_digest(&r.groups);
            println!(
                "[{}] {rank}: samples digest {digest:016x} over {samples} samples",
                name(r.switching)
            );
        }
    }
    lc.exit()?;
    let state = lc.peek_state();
    say!(
        root,
        "  pinned host memory for the offload (this process's ranks): {}, allocated at the first \
         switch and reused by every later one; {} Adam steps applied since the last reset",
        HumanBytes(state.pinned_host_bytes()),
        state.adam_steps()
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let env = match RankEnv::from_env() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("error: the launcher variables are invalid: {e}");
            return ExitCode::from(2);
        }
    };
    let who = env
        .as_ref()
        .map(|e| format!(" (rank {} of {})", e.rank, e.world_size))
        .unwrap_or_default();
    match run(&args, env) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error{who}: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seven_b_config_matches_the_fsdp_shapes() {
        let config = ModelConfig::from_json_str(QWEN2_5_7B_CONFIG).unwrap();
        assert_eq!(
            config.tensor_shapes(),
            lifecycle_fsdp::shapes::qwen2_5_7b(28)
        );
        assert_eq!(config.params(), 7_615_616_512);
        assert!(config.rollout_layout(2).is_ok());
        let small = ModelConfig::from_json_str(SMALL_CONFIG).unwrap();
        assert!(small.rollout_layout(1).is_ok() && small.rollout_layout(2).is_ok());
    }

    #[test]
    fn samples_digest_sees_every_token() {
        let g = |t: u32| Group {
            prompt: 1,
            samples: vec![vec![1, 2], vec![3, t]],
            rewards: vec![0.0, 1.0],
        };
        let (a, n) = samples_digest(&[g(4)]);
        assert_eq!(n, 2);
        assert_eq!(a, samples_digest(&[g(4)]).0);
        assert_ne!(a, samples_digest(&[g(5)]).0);
    }

    #[test]
    fn reward_rule_and_groups() {
        let (tokens, target) = prompt(3, 8, 4096, 150);
        assert_eq!(tokens.len(), 8);
        assert!(target < 150);
        assert_eq!(reward(&[target + 150, 7], target, 150), 1.0);
        assert_eq!(reward(&[(target + 1) % 150], target, 150), 0.0);
        let g = Group {
            prompt: 0,
            samples: vec![vec![], vec![]],
            rewards: vec![1.0, 0.0],
        };
        assert!(!g.uniform());
    }

    fn parse(extra: &[&str]) -> Args {
        let mut v = vec!["dapo_gpu"];
        v.extend_from_slice(extra);
        Args::try_parse_from(v).unwrap()
    }

    fn launcher(rank: usize, world: usize) -> RankEnv {
        let vars = [
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", world.to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", "29533".to_string()),
        ];
        RankEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()))
            .unwrap()
            .unwrap()
    }

    #[test]
    fn bad_settings_are_errors_before_any_gpu_work() {
        let e = run(&parse(&["--group-size", "1"]), None).unwrap_err();
        assert!(e.to_string().contains("--group-size"), "{e}");
        let e = run(&parse(&["--temperature", "0"]), None).unwrap_err();
        assert!(e.to_string().contains("--temperature"), "{e}");
        let e = run(&parse(&["--lr=-1"]), None).unwrap_err();
        assert!(
            e.to_string().contains("--lr") && e.to_string().contains("lr = -1"),
            "{e}"
        );
        let e = run(&parse(&["--grad-scale", "inf"]), None).unwrap_err();
        assert!(e.to_string().contains("--grad-scale"), "{e}");
        // several tensor-parallel groups: not supported
        let e = run(&parse(&["--gpus", "4", "--tp", "2"]), None).unwrap_err();
        assert!(
            matches!(e, DapoGpuError::Gpu(GpuDecodeError::Topology { .. })),
            "{e:?}"
        );
        assert!(e.to_string().contains("not supported"), "{e}");
        let e = run(&parse(&["--gpus", "1", "--tp", "2"]), None).unwrap_err();
        assert!(e.to_string().contains("at least T ranks"), "{e}");
    }

    #[test]
    fn launch_modes_are_checked_before_any_gpu_work() {
        // thread mode: one group, or replicas at T = 1
        let (launch, topo) = check_args(&parse(&["--gpus", "2", "--tp", "2"]), None).unwrap();
        assert_eq!((launch, topo), (Launch::Threads, DecodeTopology::Group));
        let (_, topo) = check_args(&parse(&["--gpus", "2", "--tp", "1"]), None).unwrap();
        assert_eq!(topo, DecodeTopology::Replicas(2));
        // process mode: --gpus must equal WORLD_SIZE
        let e = check_args(&parse(&["--gpus", "2", "--tp", "2"]), Some(launcher(1, 4)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("WORLD_SIZE = 4") && e.contains("--gpus 2"),
            "{e}"
        );
        let (launch, topo) =
            check_args(&parse(&["--gpus", "2", "--tp", "2"]), Some(launcher(1, 2))).unwrap();
        assert_eq!(launch, Launch::Process(launcher(1, 2)));
        assert_eq!(topo, DecodeTopology::Group);
        // process mode: replicas are not supported
        let e = check_args(&parse(&["--gpus", "2", "--tp", "1"]), Some(launcher(0, 2)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("one process per rank"), "{e}");
    }

    #[test]
    fn without_a_gpu_the_run_is_a_typed_error() {
        // On a machine with 2 GPUs this would run; in CI there is no driver: an error, no panic.
        let args = Args::try_parse_from(["dapo_gpu", "--steps", "1"]).unwrap();
        if let Err(e) = run(&args, None) {
            println!("no GPU here: {e}");
        }
    }
}
