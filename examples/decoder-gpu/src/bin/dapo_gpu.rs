//! DAPO end to end on GPUs: dynamic sampling through the GPU decoder on the FSDP backend's
//! resharded rollout weights, an update stand-in that changes every weight, and the lazy and eager
//! lifecycles compared on the same seeds.
//!
//! ```text
//! dapo_gpu --gpus 2 --tp 2 --synthetic 7b --lifecycle both    # Qwen2.5-7B shapes, random weights
//! dapo_gpu --gpus 2 --tp 2 --checkpoint path/to/hf-model       # config.json + model.safetensors
//! dapo_gpu --gpus 1 --tp 1                                     # a small random model
//! dapo_gpu --help                                              # every option
//! ```
//!
//! Per training step: gen batches of `--prompts-per-batch` prompts × `--group-size` samples are
//! generated with temperature sampling by [`GpuDecoder`] on the resident rollout weights; each
//! sample is rewarded by a verifiable rule (1 if one of its generated tokens `t` has
//! `t mod M == target(prompt)`, `M = --reward-modulus`); groups whose rewards all agree are
//! dropped; gen batches continue until `--batch-groups` groups are kept (at most
//! `--max-gen-batches`, then a clear error). Then the update stand-in runs (not an optimizer
//! step; see `--help` and the printed line), bumping the lifecycle's weight version.
//!
//! The GPU decoder runs one tensor-parallel group over the whole pool, so `--gpus` must equal
//! `--tp`. Master weights and Adam moments are offloaded to pinned host memory during rollout
//! (`MemoryPolicy::default()`; `--no-offload` keeps them on the GPUs).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use lifecycle_core::{
    HumanBytes, HumanDuration, Lifecycle, LifecycleConfig, LifecycleError, LinkBytes, MemoryPolicy,
    Metrics, Switching,
};
use lifecycle_cuda::{CudaError, RankExecutor, ThreadRankPool};
use lifecycle_decoder::{
    load_checkpoint, CheckpointError, DecodeError, Decoder, ModelConfig, Sampling, SplitMix64,
};
use lifecycle_decoder_gpu::{GpuDecodeError, GpuDecoder};
use lifecycle_fsdp::{FsdpBackend, FsdpError, FsdpTrainState};
use lifecycle_host::{HostTensor, TensorData};

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
    /// GPUs (W); must equal --tp (the GPU decoder runs one TP group over the whole pool).
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

/// Where the weights come from, and how the update stand-in changes them.
enum Weights {
    /// Random weights made on the GPUs; version `k` uses seed `seed + k · 10 000 019`.
    Synthetic {
        shapes: Vec<(String, Vec<usize>)>,
        seed: u64,
        scale: f32,
    },
    /// Checkpoint weights kept in host memory (fp32); the update scales and perturbs them and
    /// uploads the result.
    Host {
        base: Vec<HostTensor>,
        current: Vec<HostTensor>,
        seed: u64,
    },
}

impl Weights {
    /// The training state of the initial weights.
    fn initial(&mut self, backend: &FsdpBackend) -> Result<FsdpTrainState, DapoGpuError> {
        match self {
            Weights::Synthetic {
                shapes,
                seed,
                scale,
            } => Ok(backend.synthetic_state(shapes, *seed, *scale)?),
            Weights::Host { base, current, .. } => {
                *current = base.clone();
                Ok(backend.state_from_tensors(current.clone())?)
            }
        }
    }

    /// The training state after the update of `step` (1-based).
    fn updated(
        &mut self,
        backend: &FsdpBackend,
        step: usize,
    ) -> Result<FsdpTrainState, DapoGpuError> {
        match self {
            Weights::Synthetic {
                shapes,
                seed,
                scale,
            } => {
                let s = seed.wrapping_add(10_000_019u64.wrapping_mul(step as u64));
                Ok(backend.synthetic_state(shapes, s, *scale)?)
            }
            Weights::Host { current, seed, .. } => {
                for (i, t) in current.iter_mut().enumerate() {
                    if let TensorData::F32(v) = &mut t.data {
                        let mut rng = SplitMix64::from_keys(&[*seed, step as u64, i as u64]);
                        for x in v.iter_mut() {
                            *x = *x * (1.0 - 1e-3) + 1e-4 * rng.symmetric(1.0);
                        }
                    }
                }
                Ok(backend.state_from_tensors(current.clone())?)
            }
        }
    }

    /// What the update stand-in does, for the output.
    fn describe(&self) -> &'static str {
        match self {
            Weights::Synthetic { .. } => {
                "update stand-in (NOT an optimizer step): every fp32 master weight and Adam m, v \
                 regenerated on the GPUs from a new seed (FsdpBackend::synthetic_state, NVRTC \
                 fill_uniform kernel); the new training state's first offload pins host memory anew"
            }
            Weights::Host { .. } => {
                "update stand-in (NOT an optimizer step): every master weight w <- w*(1-1e-3) + \
                 1e-4*noise(seeded) on the host, the new training state uploaded to the GPUs"
            }
        }
    }
}

/// Replaces the lifecycle's training state (inside a train session, so the version is bumped)
/// with the one `make` builds, dropping the old state first so two never share the GPUs. If
/// `make` fails the state is a one-tensor placeholder the next rollout's plan rejects.
fn replace_state(
    backend: &FsdpBackend,
    state: &mut FsdpTrainState,
    make: impl FnOnce(&FsdpBackend) -> Result<FsdpTrainState, DapoGpuError>,
) -> Result<(), DapoGpuError> {
    let w = backend.pool().world();
    let placeholder = backend.state_from_tensors(vec![HostTensor::f32(
        "dapo_gpu.update_placeholder",
        vec![w],
        vec![0.0; w],
    )])?;
    drop(std::mem::replace(state, placeholder));
    *state = make(backend)?;
    Ok(())
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
    update: Duration,
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
    weights: &mut Weights,
    switching: Switching,
    first: bool,
) -> Result<PolicyReport, DapoGpuError> {
    let a = cx.args;
    lc.set_switching(switching);
    if !first {
        // Back to the initial weights, so both policies see the same weights at every step.
        let mut tr = lc.train()?;
        let (backend, state) = tr.backend_and_state_mut();
        replace_state(backend, state, |b| weights.initial(b))?;
    }
    // Warm-up (not measured): one switch and a one-token generation, so host memory for the
    // offload is pinned and the decoder's kernels, cuBLAS and NCCL are initialised.
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
    println!(
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
            println!(
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
        {
            let mut tr = lc.train()?;
            let (backend, state) = tr.backend_and_state_mut();
            replace_state(backend, state, |b| weights.updated(b, step))?;
        }
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
            batch_switch,
        };
        println!(
            "[{}] step {step}: gen batches {}, groups {} generated / {} kept, mean reward {:.3}, \
             switches {}, exits {}, bytes {} (d2d {}, d2h {}, h2d {}), rollout phase {} (generate \
             {}, decoder setup {}), switch time {}, update {} (incl. the exit)",
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
    // Steady switch: eager's switches that did not follow an update (gen batches 2.. of a step);
    // the first switch of a step after the first pins host memory for the new state.
    let steady: Vec<Duration> = eager
        .steps
        .iter()
        .flat_map(|s| s.batch_switch.iter().skip(1).copied())
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
                 switch not following an update, {} switches) = {predicted:.3} s; measured / \
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

fn run(args: &Args) -> Result<(), DapoGpuError> {
    let a = args;
    let checks = [
        (a.steps == 0, "--steps must be at least 1".to_string()),
        (
            a.gpus == 0 || a.tp == 0,
            "--gpus and --tp must be at least 1".to_string(),
        ),
        (
            a.gpus != a.tp,
            format!(
                "--gpus {} with --tp {}: the GPU decoder runs one tensor-parallel group over \
                 the whole pool, so W must equal T (data-parallel rollout replicas are not \
                 supported yet)",
                a.gpus, a.tp
            ),
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
    ];
    if let Some((_, msg)) = checks.into_iter().find(|(bad, _)| *bad) {
        return Err(DapoGpuError::Usage(msg));
    }
    let (config, mut weights, what) = match (&a.checkpoint, a.synthetic) {
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
            (
                ckpt.config,
                Weights::Host {
                    current: Vec::new(),
                    base,
                    seed: a.seed,
                },
                what,
            )
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
            let w = Weights::Synthetic {
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
            let w = Weights::Synthetic {
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
    println!(
        "dapo_gpu: {what}: {:.3} B parameters, W = {}, T = {}, offload master {} / Adam {}",
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
    println!(
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
    println!("  {}", weights.describe());
    let t = Instant::now();
    let layout = config.rollout_layout(a.tp)?;
    let pool = Arc::new(ThreadRankPool::new(a.gpus)?);
    let backend = FsdpBackend::new(pool, layout);
    let state = weights.initial(&backend)?;
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
    println!(
        "  setup (GPUs, NCCL, training state): {}",
        HumanDuration(t.elapsed())
    );
    let cx = Ctx {
        args: a,
        config: &config,
        modulus,
    };
    let mut reports = Vec::new();
    for (i, &p) in policies.iter().enumerate() {
        reports.push(run_policy(&mut lc, &cx, &mut weights, p, i == 0)?);
    }
    for r in &reports {
        println!(
            "[{}] total: {} steps, {} gen batches, rollout phase {:.3} s, switches {}, exits {}, \
             bytes {}, switch time {:.3} s",
            name(r.switching),
            r.steps.len(),
            r.steps.iter().map(|s| s.gen_batches).sum::<usize>(),
            secs(r.sum(|s| s.rollout)),
            r.switches(),
            r.exits(),
            HumanBytes(r.bytes()),
            secs(r.sum(|s| s.switch)),
        );
    }
    if let [lazy, eager] = reports.as_slice() {
        compare(lazy, eager);
    }
    lc.exit()?;
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
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

    #[test]
    fn bad_settings_are_errors_before_any_gpu_work() {
        let parse = |extra: &[&str]| {
            let mut v = vec!["dapo_gpu"];
            v.extend_from_slice(extra);
            Args::try_parse_from(v).unwrap()
        };
        let e = run(&parse(&["--gpus", "2", "--tp", "1"])).unwrap_err();
        assert!(e.to_string().contains("W must equal T"), "{e}");
        let e = run(&parse(&["--group-size", "1"])).unwrap_err();
        assert!(e.to_string().contains("--group-size"), "{e}");
        let e = run(&parse(&["--temperature", "0"])).unwrap_err();
        assert!(e.to_string().contains("--temperature"), "{e}");
    }

    #[test]
    fn without_a_gpu_the_run_is_a_typed_error() {
        // On a machine with 2 GPUs this would run; in CI there is no driver: an error, no panic.
        let args = Args::try_parse_from(["dapo_gpu", "--steps", "1"]).unwrap();
        if let Err(e) = run(&args) {
            println!("no GPU here: {e}");
        }
    }
}
