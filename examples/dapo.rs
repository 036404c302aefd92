//! DAPO with dynamic sampling: several rollout calls per training step, one update that changes
//! every weight. Runs the lazy and the eager lifecycle on the same seed and compares them, on the
//! CPU reference backend (`--backend host`, the default) or on NVIDIA GPUs (`--backend fsdp`).
//! On the host backend the report starts with what a newcomer looks for: switches per step,
//! bytes moved and switch time of each lifecycle (measured), the learning curve, and whether
//! lazy and eager agree (they must: a difference is an error); then one line per step;
//! `--verbose` adds the per-phase detail.
//!
//! ```text
//! cargo run --release --example dapo                 # host backend: lazy vs eager, default sizes
//! cargo run --release --example dapo -- --help       # every option
//! cargo run --release --example dapo -- --checkpoint models/decoder/fixtures/gqa_untied
//! cargo run --release --example dapo -- --backend fsdp --gpus 2 --tp 2 --steps 1
//! cargo run --release --example dapo -- --backend fsdp --gpus 2 --tp 2 --synthetic 7b
//! cargo run --release --example dapo -- --backend fsdp --gpus 2 --tp 2 --checkpoint path/to/hf-model
//! ```
//!
//! `--backend host`: ranks are threads, the policy is a toy MLP (`--vocab`, `--hidden`, `--ffn`,
//! `--layers`) trained by a real DAPO step (verl's objective by default, `--objective`: the
//! token-mean clipped loss with clip-higher and the dual clip, group-normalised advantages;
//! gradients by backpropagation, Adam on the FSDP shards: `lifecycle_examples::dapo::update`),
//! or with `--checkpoint DIR` (a Hugging Face `config.json` + safetensors, Qwen2, Llama, Qwen3
//! or Qwen3-MoE) the training state is the checkpoint's weights and every rollout runs the Qwen2
//! / Llama decoder (`lifecycle-decoder`) on the resharded bf16 tensor-parallel slices and the
//! update is a synthetic stand-in (no backward pass for checkpoint models); the toy-policy size
//! options are then ignored. The reward (token classes, `lifecycle_examples::dapo::reward`) hits
//! as often on any vocabulary.
//!
//! `--backend fsdp`: the FSDP backend on `--gpus` GPUs, rollouts by the GPU decoder, an in-place
//! Adam step on synthetic gradients between steps (`lifecycle_examples::gpu_dapo`).
//! `--synthetic 7b|small` picks a model with random weights when there is no
//! `--checkpoint`. Without a GPU it stops with an error saying what is missing.
//!
//! The loop options (`--lifecycle`, `--steps`, `--tp`, `--seed`, `--checkpoint`, ...) apply to
//! both backends, each with its own defaults; an option of one backend only is an error with the
//! other (e.g. `--vocab` with `--backend fsdp`, `--gpus` with `--backend host`).

use std::fmt::Display;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args as _, CommandFactory, FromArgMatches, Parser, ValueEnum};
use lifecycle_core::{Ceilings, HumanBytes, HumanDuration, MemoryPolicy, Switching};
use lifecycle_decoder::{load_checkpoint, Checkpoint};
use lifecycle_examples::dapo::megatron::{run_megatron, MegatronDriver};
use lifecycle_examples::dapo::{
    self, DapoBackend, DapoConfig, HostTrain, Objective, RunReport, StepReport, ToyDriver,
    UpdateConfig, UpdateOutcome,
};
use lifecycle_examples::gpu_dapo::{
    self as gpu_dapo, GpuLayout, GpuOptions, LifecycleChoice, LoopOptions,
};
use lifecycle_examples::lm_policy::{checkpoint_driver, run_checkpoint};
use lifecycle_examples::prediction;
use lifecycle_examples::toy_policy::PolicyConfig;
use lifecycle_layout::fp8::{Fp8Compute, Fp8Keep, RolloutDtype};
use lifecycle_layout::ExpertPlacement;

/// Where the loop runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// The CPU reference backend: ranks are threads, links are memory copies.
    Host,
    /// The FSDP backend on NVIDIA GPUs, rollouts by the GPU decoder.
    Fsdp,
    /// The Megatron backend on NVIDIA GPUs (TP x PP x DP -> fused TP rollout).
    Megatron,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Host => "host",
            Backend::Fsdp => "fsdp",
            Backend::Megatron => "megatron",
        })
    }
}

/// The training layout of the host backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Train {
    /// FSDP shards (the toy policy, or a checkpoint).
    Fsdp,
    /// Megatron-Core TP x PP x DP (a checkpoint, or a small random Qwen2 model).
    Megatron,
}

/// The host backend's lifecycle default (the others are `DapoConfig::default()`'s).
const HOST_LIFECYCLE: LifecycleChoice = LifecycleChoice::Both;

/// `text` and the default of each backend (one value when they agree).
fn help(text: &str, host: impl Display, fsdp: impl Display) -> String {
    let (host, fsdp) = (host.to_string(), fsdp.to_string());
    if host == fsdp {
        format!("{text} [default: {host}]")
    } else {
        format!("{text} [default: {host} on host, {fsdp} on fsdp]")
    }
}

/// DAPO-style RL loop on the CPU reference backend, or on NVIDIA GPUs with --backend fsdp.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Where the loop runs: `host` (CPU reference backend) or `fsdp` (NVIDIA GPUs).
    #[arg(long, value_enum, default_value_t = Backend::Host)]
    backend: Backend,
    // The loop options: both backends, each with its own defaults.
    #[arg(long, value_enum, help = help(
        "Which lifecycle to run; `both` runs lazy then eager on the same seed and compares them",
        HOST_LIFECYCLE, LoopOptions::DEFAULTS.lifecycle))]
    lifecycle: Option<LifecycleChoice>,
    #[arg(long, help = help("Training steps (per lifecycle)",
        DapoConfig::default().steps, LoopOptions::DEFAULTS.steps))]
    steps: Option<usize>,
    #[arg(long, help = help("Rollout tensor-parallel degree (T; on host it must divide --world)",
        DapoConfig::default().tp, LoopOptions::DEFAULTS.tp))]
    tp: Option<usize>,
    /// Experts of a mixture-of-experts checkpoint (Qwen3-MoE): `tp` splits every expert by
    /// tensor parallelism, `ep` partitions them over the rollout ranks.
    #[arg(long, default_value = "tp", value_parser = <ExpertPlacement as std::str::FromStr>::from_str)]
    experts: ExpertPlacement,
    /// The rollout weights' dtype: `bf16`, or `fp8` (block-scaled e4m3 quantised in the switch:
    /// from the fp32 masters in the FSDP layout, from the bf16 parameters in the Megatron
    /// layouts, whose fused q/k/v and gate/up parts must end on 128-row blocks; a decoder model:
    /// --checkpoint on the host backend).
    #[arg(long, default_value = "bf16", value_parser = <RolloutDtype as std::str::FromStr>::from_str)]
    rollout_dtype: RolloutDtype,
    /// With --rollout-dtype fp8: matrices kept bf16 beyond the embedding, head, norms and router
    /// (a comma-separated list of `attention` and `layer:N`, or `none`).
    #[arg(long, default_value = "none", value_parser = <Fp8Keep as std::str::FromStr>::from_str)]
    fp8_keep: Fp8Keep,
    /// With --rollout-dtype fp8: how the decoder (CPU or GPU) computes with the fp8 weights,
    /// `weight-only` (e4m3 weights times the activations in f32) or `w8a8` (the activations
    /// quantised per token in 1 x 128 groups as well, as vLLM's block-fp8 linear does; on the
    /// GPU, a tensor-core kernel up to 8 tokens a product, cuBLASLt's block-scaled fp8 GEMM
    /// beyond).
    #[arg(long, default_value = "weight-only", value_parser = <Fp8Compute as std::str::FromStr>::from_str)]
    fp8_compute: Fp8Compute,
    #[arg(long, help = help("Prompts per rollout call (gen batch)",
        DapoConfig::default().prompts_per_batch, LoopOptions::DEFAULTS.prompts_per_batch))]
    prompts_per_batch: Option<usize>,
    #[arg(long, help = help("Samples per prompt (group size)",
        DapoConfig::default().group_size, LoopOptions::DEFAULTS.group_size))]
    group_size: Option<usize>,
    #[arg(long, help = help("Groups with mixed rewards per training batch",
        DapoConfig::default().batch_groups, LoopOptions::DEFAULTS.batch_groups))]
    batch_groups: Option<usize>,
    #[arg(long, help = help("Most rollout calls per step before failing",
        DapoConfig::default().max_gen_batches, LoopOptions::DEFAULTS.max_gen_batches))]
    max_gen_batches: Option<usize>,
    #[arg(long, help = help("Tokens generated per sample",
        DapoConfig::default().tokens, LoopOptions::DEFAULTS.tokens))]
    tokens: Option<usize>,
    #[arg(long, help = help("Sampling temperature",
        DapoConfig::default().temperature, LoopOptions::DEFAULTS.temperature))]
    temperature: Option<f32>,
    #[arg(long, help = help("Seed of weights, prompts and sampling",
        DapoConfig::default().seed, LoopOptions::DEFAULTS.seed))]
    seed: Option<u64>,
    /// Keep master weights and optimizer state on the device during rollout.
    #[arg(long)]
    no_offload: bool,
    /// A Hugging Face checkpoint folder (config.json + safetensors, sharded or not; Qwen2, Llama,
    /// Qwen3 or Qwen3-MoE): train its weights and roll out through the decoder (CPU decoder on
    /// host, GPU decoder on fsdp) instead of the toy policy / a synthetic model.
    #[arg(long, value_name = "PATH")]
    checkpoint: Option<PathBuf>,
    /// Write the switch timeline of each run as a Chrome / Perfetto trace: PATH.lazy.json and
    /// PATH.eager.json (open them at ui.perfetto.dev).
    #[arg(long, value_name = "PATH")]
    trace: Option<String>,
    /// Per-phase detail after the report: each lifecycle's metrics table (plan, transfer,
    /// offload, release, reload, wake, sleep) and its phases against the link ceilings.
    #[arg(long)]
    verbose: bool,
    #[command(flatten, next_help_heading = "Host backend only (--backend host)")]
    host: HostOptions,
    #[command(
        flatten,
        next_help_heading = "Megatron training layout (--train megatron, --backend megatron)"
    )]
    megatron: MegatronOptions,
    #[command(
        flatten,
        next_help_heading = "GPU backends only (--backend fsdp, --backend megatron)"
    )]
    fsdp: GpuOptions,
}

/// The degrees of the Megatron training layout (DP = W / (TP x PP)).
#[derive(Debug, Clone, clap::Args)]
struct MegatronOptions {
    /// Megatron training tensor-parallel degree.
    #[arg(long, default_value_t = 1)]
    train_tp: usize,
    /// Megatron pipeline stages [default: 2, or 1 when the ranks do not make two stages of
    /// --train-tp ranks]
    #[arg(long)]
    pp: Option<usize>,
    /// Megatron expert-parallel degree of a mixture-of-experts checkpoint (Megatron-Core's
    /// --expert-model-parallel-size).
    #[arg(long, default_value_t = 1)]
    ep: usize,
    /// Megatron expert tensor-parallel degree [default: --train-tp, as Megatron-Core's
    /// --expert-tensor-parallel-size]
    #[arg(long)]
    etp: Option<usize>,
}

impl MegatronOptions {
    /// The expert tensor-parallel degree: as given, else --train-tp.
    fn etp(&self) -> usize {
        self.etp.unwrap_or(self.train_tp)
    }

    /// The pipeline stages for `world` ranks: as given, else 2 where `world` holds two stages
    /// of `train_tp` ranks, else 1.
    fn pp(&self, world: usize) -> usize {
        self.pp.unwrap_or(if world / self.train_tp.max(1) >= 2 {
            2
        } else {
            1
        })
    }
}

/// The options of the host backend only.
#[derive(Debug, Clone, clap::Args)]
struct HostOptions {
    /// Ranks (threads standing for GPUs).
    #[arg(long, default_value_t = DapoConfig::default().world)]
    world: usize,
    /// Vocabulary size (divisible by --tp).
    #[arg(long, default_value_t = DapoConfig::default().policy.vocab)]
    vocab: usize,
    /// Hidden size.
    #[arg(long, default_value_t = DapoConfig::default().policy.hidden)]
    hidden: usize,
    /// MLP intermediate size (divisible by --tp).
    #[arg(long, default_value_t = DapoConfig::default().policy.ffn)]
    ffn: usize,
    /// MLP blocks.
    #[arg(long, default_value_t = DapoConfig::default().policy.layers)]
    layers: usize,
    /// The training layout: `fsdp` (the toy policy or a checkpoint) or `megatron` (TP x PP x
    /// DP, --train-tp / --pp; a checkpoint or a small random Qwen2 model, rollouts by the CPU
    /// decoder reading the fused layout).
    #[arg(long, value_enum, default_value_t = Train::Fsdp)]
    train: Train,
    /// The toy policy's DAPO objective: `verl` (verl's GRPO advantages over the sample std, the
    /// token-mean loss with clip-higher, the dual clip at 3 and the log-ratio clamped to ±20) or
    /// `population` (advantages over the population std, no dual clip, no clamp).
    #[arg(long, value_enum, default_value_t = UpdateConfig::default().objective)]
    objective: Objective,
}

/// A command line that does not fit its backend.
#[derive(Debug, thiserror::Error)]
enum ArgsError {
    /// Options of one backend given with the other.
    #[error(
        "{} only appl{} to --backend {only}, and this run is --backend {chosen}: remove {}, or \
         choose --backend {only}{hint}",
        options.join(", "),
        if options.len() == 1 { "ies" } else { "y" },
        if options.len() == 1 { "it" } else { "them" },
    )]
    WrongBackend {
        /// The options, as typed (`--vocab`).
        options: Vec<String>,
        /// The backend they belong to.
        only: Backend,
        /// The backend chosen.
        chosen: Backend,
        /// Where the chosen backend's counterpart is, if any.
        hint: &'static str,
    },
    /// Megatron layout options without a Megatron layout.
    #[error(
        "{} only appl{} to the Megatron training layout (--backend host --train megatron, or \
         --backend megatron): add --train megatron, or remove {}",
        options.join(", "),
        if options.len() == 1 { "ies" } else { "y" },
        if options.len() == 1 { "it" } else { "them" },
    )]
    NotMegatron {
        /// The options, as typed.
        options: Vec<String>,
    },
}

/// What a command line runs.
#[derive(Debug)]
enum Plan {
    /// The host backend.
    Host {
        config: DapoConfig,
        lifecycle: LifecycleChoice,
        checkpoint: Option<PathBuf>,
        trace: Option<String>,
        verbose: bool,
    },
    /// A GPU backend (FSDP or Megatron: `options.layout`).
    Gpu(gpu_dapo::Options),
}

/// The options of `group` given on the command line, as `--name`.
fn given(matches: &ArgMatches, group: clap::Command) -> Vec<String> {
    group
        .get_arguments()
        .filter(|a| matches.value_source(a.get_id().as_str()) == Some(ValueSource::CommandLine))
        .map(|a| match a.get_long() {
            Some(long) => format!("--{long}"),
            None => a.get_id().to_string(),
        })
        .collect()
}

impl Args {
    /// Parses the process's command line, or returns clap's error (usage, --help, --version).
    fn parse_command_line() -> Result<(Args, ArgMatches), clap::Error> {
        Args::with_matches(Args::command().try_get_matches()?)
    }

    /// Parses `argv` (the program name first), or returns clap's error.
    #[cfg(test)]
    fn parse_from_argv<I, T>(argv: I) -> Result<(Args, ArgMatches), clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        Args::with_matches(Args::command().try_get_matches_from(argv)?)
    }

    /// The arguments `matches` holds, with the matches (which say what the command line gave).
    fn with_matches(matches: ArgMatches) -> Result<(Args, ArgMatches), clap::Error> {
        let args = Args::from_arg_matches(&matches)?;
        Ok((args, matches))
    }

    /// The run of the chosen backend, with its defaults for the loop options not given; an
    /// option of the other backend only is an error.
    fn plan(&self, matches: &ArgMatches) -> Result<Plan, ArgsError> {
        let (host_only, gpu_only, megatron_only) = (
            given(
                matches,
                HostOptions::augment_args(clap::Command::new("host")),
            ),
            given(
                matches,
                GpuOptions::augment_args(clap::Command::new("fsdp")),
            ),
            given(
                matches,
                MegatronOptions::augment_args(clap::Command::new("megatron")),
            ),
        );
        let megatron_layout = match self.backend {
            Backend::Host => self.host.train == Train::Megatron,
            Backend::Fsdp => false,
            Backend::Megatron => true,
        };
        if !megatron_layout && !megatron_only.is_empty() {
            return Err(ArgsError::NotMegatron {
                options: megatron_only,
            });
        }
        match self.backend {
            Backend::Host if !gpu_only.is_empty() => Err(ArgsError::WrongBackend {
                hint: if gpu_only.iter().any(|o| o == "--gpus") {
                    " or --backend megatron (the host backend's ranks are --world)"
                } else {
                    " or --backend megatron"
                },
                options: gpu_only,
                only: Backend::Fsdp,
                chosen: Backend::Host,
            }),
            gpu @ (Backend::Fsdp | Backend::Megatron) if !host_only.is_empty() => {
                Err(ArgsError::WrongBackend {
                    hint: if host_only.iter().any(|o| o == "--world") {
                        " (the GPU backends' ranks are --gpus)"
                    } else if host_only.iter().any(|o| o == "--train") {
                        " (the GPU Megatron layout is --backend megatron)"
                    } else {
                        ""
                    },
                    options: host_only,
                    only: Backend::Host,
                    chosen: gpu,
                })
            }
            Backend::Host => Ok(self.host_plan()),
            Backend::Fsdp | Backend::Megatron => Ok(Plan::Gpu(self.gpu_options())),
        }
    }

    fn host_plan(&self) -> Plan {
        let d = DapoConfig::default();
        let h = &self.host;
        let config = DapoConfig {
            steps: self.steps.unwrap_or(d.steps),
            world: h.world,
            tp: self.tp.unwrap_or(d.tp),
            experts: self.experts,
            rollout_dtype: self.rollout_dtype,
            fp8_keep: self.fp8_keep,
            fp8_compute: self.fp8_compute,
            prompts_per_batch: self.prompts_per_batch.unwrap_or(d.prompts_per_batch),
            group_size: self.group_size.unwrap_or(d.group_size),
            batch_groups: self.batch_groups.unwrap_or(d.batch_groups),
            max_gen_batches: self.max_gen_batches.unwrap_or(d.max_gen_batches),
            tokens: self.tokens.unwrap_or(d.tokens),
            temperature: self.temperature.unwrap_or(d.temperature),
            seed: self.seed.unwrap_or(d.seed),
            reward_modulus: d.reward_modulus,
            reward_quota: d.reward_quota,
            update: UpdateConfig {
                objective: h.objective,
                ..d.update
            },
            policy: PolicyConfig {
                vocab: h.vocab,
                hidden: h.hidden,
                ffn: h.ffn,
                layers: h.layers,
            },
            memory: if self.no_offload {
                MemoryPolicy::resident()
            } else {
                MemoryPolicy::default()
            },
            trace: self.trace.is_some(),
            train: match h.train {
                Train::Fsdp => HostTrain::Fsdp,
                Train::Megatron => HostTrain::Megatron {
                    tp: self.megatron.train_tp,
                    pp: self.megatron.pp(h.world),
                    ep: self.megatron.ep,
                    etp: self.megatron.etp(),
                },
            },
        };
        Plan::Host {
            config,
            lifecycle: self.lifecycle.unwrap_or(HOST_LIFECYCLE),
            checkpoint: self.checkpoint.clone(),
            trace: self.trace.clone(),
            verbose: self.verbose,
        }
    }

    fn gpu_options(&self) -> gpu_dapo::Options {
        let d = LoopOptions::DEFAULTS;
        gpu_dapo::Options {
            layout: match self.backend {
                Backend::Megatron => GpuLayout::Megatron {
                    tp: self.megatron.train_tp,
                    pp: self.megatron.pp(self.fsdp.gpus),
                    ep: self.megatron.ep,
                    etp: self.megatron.etp(),
                },
                Backend::Host | Backend::Fsdp => GpuLayout::Fsdp,
            },
            gpu: self.fsdp.clone(),
            run: LoopOptions {
                tp: self.tp.unwrap_or(d.tp),
                experts: self.experts,
                rollout_dtype: self.rollout_dtype,
                fp8_keep: self.fp8_keep,
                fp8_compute: self.fp8_compute,
                checkpoint: self.checkpoint.clone(),
                lifecycle: self.lifecycle.unwrap_or(d.lifecycle),
                steps: self.steps.unwrap_or(d.steps),
                prompts_per_batch: self.prompts_per_batch.unwrap_or(d.prompts_per_batch),
                group_size: self.group_size.unwrap_or(d.group_size),
                batch_groups: self.batch_groups.unwrap_or(d.batch_groups),
                max_gen_batches: self.max_gen_batches.unwrap_or(d.max_gen_batches),
                tokens: self.tokens.unwrap_or(d.tokens),
                temperature: self.temperature.unwrap_or(d.temperature),
                seed: self.seed.unwrap_or(d.seed),
                no_offload: self.no_offload,
                verbose: self.verbose,
                trace: self.trace.clone(),
            },
        }
    }
}

/// The host's memory copy rate (GB/s of bytes copied), the ceiling every host-backend link is
/// measured against: ranks are threads and "links" are copies in one memory.
fn host_copy_rate() -> f64 {
    let n = 32 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src); // fault the pages in
    let best = (0..5)
        .map(|_| {
            let t = std::time::Instant::now();
            dst.copy_from_slice(&src);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    std::hint::black_box(&dst);
    n as f64 / best / 1e9
}

fn ms(d: Duration) -> String {
    HumanDuration(d).to_string()
}

/// Runs one lifecycle on the toy policy, or on the checkpoint when there is one.
fn run_dapo(
    config: &DapoConfig,
    checkpoint: Option<&Checkpoint>,
    switching: Switching,
    on_step: impl FnMut(&StepReport),
) -> Result<RunReport, dapo::DapoError> {
    match (config.train, checkpoint) {
        (HostTrain::Megatron { .. }, ckpt) => run_megatron(config, ckpt, switching, on_step),
        (HostTrain::Fsdp, Some(ckpt)) => run_checkpoint(config, ckpt, switching, on_step),
        (HostTrain::Fsdp, None) => dapo::run(config, switching, on_step),
    }
}

fn name(switching: Switching) -> &'static str {
    match switching {
        Switching::Lazy => "lazy",
        Switching::Eager => "eager",
    }
}

/// Runs one lifecycle; returns its report and its per-phase detail (for `--verbose`).
fn run_one(
    config: &DapoConfig,
    checkpoint: Option<&Checkpoint>,
    switching: Switching,
    trace: Option<&str>,
) -> Result<(RunReport, String), dapo::DapoError> {
    let name = name(switching);
    eprint!("running the {name} lifecycle ({} steps):", config.steps);
    let report = run_dapo(config, checkpoint, switching, |s| eprint!(" {}", s.step))?;
    eprintln!(" done in {}", ms(report.total_time));
    let rate = host_copy_rate();
    let ceilings = Ceilings {
        device_to_device_gbps: Some(rate),
        device_to_host_gbps: Some(rate),
        host_to_device_gbps: Some(rate),
        local_gbps: Some(rate),
    };
    let mut detail = format!(
        "\n== {name} lifecycle: per phase ==\n{}\nagainst this host's copy rate ({rate:.1} GB/s \
         copied; for the host backend every link is a copy in one memory):\n{}",
        report.metrics.table(),
        report.metrics.report(&ceilings)
    );
    if let Some(base) = trace {
        let path = format!("{base}.{name}.json");
        match report.trace.write_chrome(&path) {
            Ok(()) => detail.push_str(&format!(
                "\nswitch timeline: {path} ({} spans; open it at ui.perfetto.dev)\n",
                report.trace.spans().len()
            )),
            Err(e) => eprintln!("warning: could not write the trace {path}: {e}"),
        }
    }
    Ok((report, detail))
}

/// Whether two runs have the same learning curve (bit for bit) and the same samples.
fn same_run(a: &RunReport, b: &RunReport) -> bool {
    let bits = |r: &RunReport| -> Vec<u32> { r.curve().iter().map(|x| x.to_bits()).collect() };
    bits(a) == bits(b) && a.groups == b.groups
}

/// The prediction line of a host run: the same switch at 7.6B on GPUs (`lifecycle-plan`).
fn prediction_line(config: &DapoConfig, checkpoint: Option<&Checkpoint>) -> Option<String> {
    let _ = checkpoint;
    let train = match config.train {
        HostTrain::Fsdp => lifecycle_plan::TrainLayout::Fsdp {
            world: config.world,
        },
        HostTrain::Megatron { tp, pp, .. } => lifecycle_plan::TrainLayout::Megatron {
            tp,
            pp,
            dp: config.world / (tp * pp).max(1),
            ep: 1,
            etp: tp,
        },
    };
    let offload = config.memory != MemoryPolicy::resident();
    match prediction::qwen7b_switch(train, config.tp, offload) {
        Ok(p) => Some(p.line()),
        Err(e) => Some(format!(
            "prediction (lifecycle-plan): not available for this layout: {e}"
        )),
    }
}

/// The report's first lines: per lifecycle, switches per step, bytes moved and switch time
/// (measured); then the learning curve.
fn summary(runs: &[&RunReport]) -> String {
    let mut out = String::new();
    let per_step = |r: &RunReport, x: f64| x / r.steps.len().max(1) as f64;
    let row = |label: &str, cell: &dyn Fn(&RunReport) -> String| {
        let mut line = format!("{label:<22}");
        for r in runs {
            line.push_str(&format!("{:>14}", cell(r)));
        }
        line.push('\n');
        line
    };
    out.push_str(&row("", &|r| name(r.switching).to_string()));
    out.push_str(&row("switches per step", &|r| {
        format!("{:.2}", per_step(r, r.metrics.switches() as f64))
    }));
    out.push_str(&row("gen batches per step", &|r| {
        format!("{:.2}", per_step(r, r.gen_batches() as f64))
    }));
    out.push_str(&row("bytes moved per step", &|r| {
        HumanBytes((per_step(r, r.metrics.bytes().moved() as f64)) as u64).to_string()
    }));
    out.push_str(&row("switch time per step", &|r| {
        ms(r.metrics.switch_time() / r.steps.len().max(1) as u32)
    }));
    out.push_str(&row("switch time, run", &|r| ms(r.metrics.switch_time())));
    out.push_str(&row("run time", &|r| ms(r.total_time)));
    if let [lazy, eager] = runs {
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        out.push_str(&format!(
            "eager / lazy: switches {:.2}x, bytes {:.2}x, switch time {:.2}x (measured on this \
             host: ranks are threads, links are memory copies)\n",
            ratio(
                eager.metrics.switches() as f64,
                lazy.metrics.switches() as f64
            ),
            ratio(
                eager.metrics.bytes().moved() as f64,
                lazy.metrics.bytes().moved() as f64
            ),
            ratio(
                eager.metrics.switch_time().as_secs_f64(),
                lazy.metrics.switch_time().as_secs_f64()
            ),
        ));
    }
    if let Some(first) = runs.first() {
        let curve = first.curve();
        let (early, late) = first.quarters();
        let q = (curve.len() / 4).max(1);
        out.push_str(&format!(
            "learning curve (mean reward of every sample generated, per step):\n  {}\n  first \
             quarter (steps 1-{q}) {early:.3} -> last quarter (steps {}-{}) {late:.3}\n",
            curve
                .iter()
                .map(|r| format!("{r:.3}"))
                .collect::<Vec<_>>()
                .join(" "),
            curve.len() - q + 1,
            curve.len(),
        ));
        if let Some(line) = first.short_steps() {
            out.push_str(&line);
            out.push('\n');
        }
        if first
            .steps
            .iter()
            .any(|s| matches!(s.update, UpdateOutcome::Synthetic))
        {
            out.push_str(
                "  (the update is synthetic — seeded noise, then Adam: there is no backward pass \
                 for checkpoint models, so this curve is not expected to rise)\n",
            );
        }
    }
    out
}

/// One line per step of `report`: sampling, the update and the switches of each lifecycle.
fn step_table(report: &RunReport, runs: &[&RunReport]) -> String {
    let mut out = format!(
        "{:>4} {:>5} {:>9} {:>7} {:>7} {:>8} {:>6} {:>7} {:>10}",
        "step", "gen", "kept/gen", "reward", "kept r", "loss", "clip", "|r-1|", "update"
    );
    for r in runs {
        out.push_str(&format!(
            " {:>13}",
            format!("{} sw/moved", name(r.switching))
        ));
    }
    out.push('\n');
    for (i, s) in report.steps.iter().enumerate() {
        let (loss, clip, ratio) = match &s.update {
            UpdateOutcome::Dapo(pg) => (
                format!("{:.4}", pg.loss),
                format!("{:.3}", pg.clip_fraction),
                format!("{:.3}", pg.max_ratio_deviation),
            ),
            UpdateOutcome::Synthetic => ("synth".to_string(), "-".to_string(), "-".to_string()),
        };
        out.push_str(&format!(
            "{:>4} {:>5} {:>9} {:>7.3} {:>7.3} {:>8} {:>6} {:>7} {:>10}",
            s.step,
            s.gen_batches,
            format!("{}/{}", s.kept, s.groups),
            s.mean_reward,
            s.kept_reward,
            loss,
            clip,
            ratio,
            ms(s.update_time),
        ));
        for r in runs {
            if let Some(t) = r.steps.get(i) {
                out.push_str(&format!(
                    " {:>13}",
                    format!("{} / {}", t.switches, HumanBytes(t.bytes.moved()))
                ));
            }
        }
        out.push('\n');
    }
    out
}

/// The host backend's run: the toy policy or the checkpoint, one lifecycle or both compared.
fn run_host(
    config: DapoConfig,
    lifecycle: LifecycleChoice,
    checkpoint_path: Option<PathBuf>,
    trace: Option<String>,
    verbose: bool,
) -> ExitCode {
    let checkpoint = match &checkpoint_path {
        None => None,
        Some(path) => match load_checkpoint(path) {
            Ok(ckpt) => Some(ckpt),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let header = match (config.train, &checkpoint, &checkpoint_path) {
        (HostTrain::Megatron { .. }, ckpt, path) => {
            let run = match (ckpt, path) {
                (Some(c), Some(p)) => Some((c, p.as_path())),
                _ => None,
            };
            match MegatronDriver::for_run(&config, run) {
                Ok(d) => DapoBackend::describe(&d),
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        (HostTrain::Fsdp, Some(ckpt), Some(path)) => {
            DapoBackend::describe(&checkpoint_driver(&config, ckpt, path))
        }
        _ => DapoBackend::describe(&ToyDriver::new(config)),
    };
    for line in header {
        println!("{line}");
    }
    let ckpt = checkpoint.as_ref();
    let trace = trace.as_deref();
    // Warm the allocator and caches once, untimed, so neither policy pays the first-touch cost.
    let warmup = DapoConfig {
        steps: 1,
        trace: false,
        ..config
    };
    if let Err(e) = run_dapo(&warmup, ckpt, Switching::Lazy, |_| {}) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    let choices: &[Switching] = match lifecycle {
        LifecycleChoice::Lazy => &[Switching::Lazy],
        LifecycleChoice::Eager => &[Switching::Eager],
        LifecycleChoice::Both => &[Switching::Lazy, Switching::Eager],
    };
    let mut runs = Vec::new();
    for &switching in choices {
        match run_one(&config, ckpt, switching, trace) {
            Ok(run) => runs.push(run),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let reports: Vec<&RunReport> = runs.iter().map(|(r, _)| r).collect();
    println!();
    print!("{}", summary(&reports));
    let identical = match reports.as_slice() {
        [lazy, eager] => {
            let same = same_run(lazy, eager);
            println!(
                "lazy vs eager on the same seed: {}",
                if same {
                    "identical learning curves and samples"
                } else {
                    "DIFFERENT learning curves or samples (a lifecycle bug: both must see the \
                     same weights)"
                }
            );
            same
        }
        _ => true,
    };
    if let Some(line) = prediction_line(&config, checkpoint.as_ref()) {
        println!("{line}");
    }
    if let Some(first) = reports.first() {
        println!("\nper step ({}):", name(first.switching));
        print!("{}", step_table(first, &reports));
    }
    if verbose {
        for (_, detail) in &runs {
            print!("{detail}");
        }
    }
    if identical {
        ExitCode::SUCCESS
    } else {
        eprintln!("error: the lazy and eager lifecycles gave different learning curves or samples");
        ExitCode::FAILURE
    }
}

fn main() -> ExitCode {
    let (args, matches) = match Args::parse_command_line() {
        Ok(parsed) => parsed,
        Err(e) => e.exit(),
    };
    match args.plan(&matches) {
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
        Ok(Plan::Host {
            config,
            lifecycle,
            checkpoint,
            trace,
            verbose,
        }) => run_host(config, lifecycle, checkpoint, trace, verbose),
        Ok(Plan::Gpu(options)) => gpu_dapo::run_cli(&options),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lifecycle_cuda::{driver_present, CudaError};
    use lifecycle_examples::gpu_dapo::{DapoGpuError, SyntheticModel};

    fn plan(argv: &[&str]) -> Result<Plan, ArgsError> {
        let (args, matches) =
            Args::parse_from_argv(std::iter::once("dapo").chain(argv.iter().copied())).unwrap();
        args.plan(&matches)
    }

    fn fsdp(argv: &[&str]) -> gpu_dapo::Options {
        match plan(argv) {
            Ok(Plan::Gpu(o)) => o,
            other => panic!("expected the fsdp backend, got {other:?}"),
        }
    }

    #[test]
    fn w8a8_reaches_every_backend() {
        match plan(&["--rollout-dtype", "fp8", "--fp8-compute", "w8a8"]) {
            Ok(Plan::Host { config, .. }) => assert_eq!(config.fp8_compute, Fp8Compute::W8A8),
            other => panic!("expected the host backend, got {other:?}"),
        }
        match plan(&[]) {
            Ok(Plan::Host { config, .. }) => {
                assert_eq!(config.fp8_compute, Fp8Compute::WeightOnly)
            }
            other => panic!("expected the host backend, got {other:?}"),
        }
        let o = fsdp(&[
            "--backend",
            "fsdp",
            "--rollout-dtype",
            "fp8",
            "--fp8-compute",
            "w8a8",
        ]);
        assert_eq!(o.run.fp8_compute, Fp8Compute::W8A8);
        assert_eq!(
            fsdp(&["--backend", "fsdp"]).run.fp8_compute,
            Fp8Compute::WeightOnly
        );
    }

    #[test]
    fn the_gpu_engine_keeps_bf16_kv_unless_told_otherwise() {
        use lifecycle_decoder::KvDtype;
        assert_eq!(fsdp(&["--backend", "fsdp"]).gpu.kv_dtype, KvDtype::Bf16);
        let o = fsdp(&["--backend", "megatron", "--kv-dtype", "f32"]);
        assert_eq!(o.gpu.kv_dtype, KvDtype::F32);
        assert!(o.check().is_ok());
        let fp8 = fsdp(&["--backend", "fsdp", "--kv-dtype", "fp8"]);
        assert_eq!(fp8.gpu.kv_dtype, KvDtype::Fp8);
        assert!(fp8.check().is_ok());
        // a GPU engine option on the host backend is refused by name
        match plan(&["--kv-dtype", "f32"]) {
            Err(e) => assert!(e.to_string().contains("--kv-dtype"), "{e}"),
            other => panic!("expected an error, got {other:?}"),
        }
        assert!(Args::parse_from_argv(["dapo", "--kv-dtype", "f16"]).is_err());
    }

    #[test]
    fn gpu_runs_offload_by_need_unless_told_otherwise() {
        use lifecycle_examples::gpu_dapo::memory::MemoryChoice;
        assert_eq!(
            fsdp(&["--backend", "fsdp"]).gpu.memory,
            MemoryChoice::ByNeed
        );
        let o = fsdp(&[
            "--backend",
            "fsdp",
            "--memory",
            "offload",
            "--kv-tokens",
            "500000",
        ]);
        assert_eq!(
            (o.gpu.memory, o.gpu.kv_tokens),
            (MemoryChoice::Offload, Some(500000))
        );
        assert!(fsdp(&["--backend", "fsdp"]).gpu.offload_overlap);
        let o = fsdp(&["--backend", "fsdp", "--offload-overlap", "false"]);
        assert!(!o.gpu.offload_overlap);
        let msg = plan(&["--memory", "resident"]).unwrap_err().to_string();
        assert!(
            msg.contains("--memory only applies to --backend fsdp"),
            "{msg}"
        );
    }

    #[test]
    fn the_default_is_the_host_backend_with_its_defaults() {
        match plan(&[]).unwrap() {
            Plan::Host {
                config,
                lifecycle,
                checkpoint,
                trace,
                verbose,
            } => {
                assert_eq!(
                    format!("{config:?}"),
                    format!("{:?}", DapoConfig::default())
                );
                assert_eq!(lifecycle, LifecycleChoice::Both);
                assert!(checkpoint.is_none() && trace.is_none() && !verbose);
            }
            other => panic!("expected the host backend, got {other:?}"),
        }
        // the loop options and the host-only ones reach the host config
        match plan(&[
            "--steps",
            "3",
            "--tp",
            "1",
            "--world",
            "3",
            "--vocab",
            "32",
            "--seed",
            "9",
            "--no-offload",
            "--lifecycle",
            "eager",
            "--trace",
            "/tmp/t",
            "--verbose",
            "--objective",
            "population",
        ])
        .unwrap()
        {
            Plan::Host {
                config,
                lifecycle,
                trace,
                verbose,
                ..
            } => {
                assert!(verbose);
                assert_eq!(config.update.objective, Objective::Population);
                assert_eq!((config.steps, config.tp, config.world), (3, 1, 3));
                assert_eq!((config.policy.vocab, config.seed), (32, 9));
                assert_eq!(config.memory, MemoryPolicy::resident());
                assert!(config.trace);
                assert_eq!(lifecycle, LifecycleChoice::Eager);
                assert_eq!(trace.as_deref(), Some("/tmp/t"));
            }
            other => panic!("expected the host backend, got {other:?}"),
        }
    }

    #[test]
    fn fsdp_takes_the_loop_options_and_its_own_defaults() {
        // nothing given: exactly the GPU run's defaults (not the host's)
        assert_eq!(fsdp(&["--backend", "fsdp"]), gpu_dapo::Options::default());
        let o = fsdp(&[
            "--backend",
            "fsdp",
            "--gpus",
            "2",
            "--tp",
            "2",
            "--steps",
            "1",
            "--checkpoint",
            "some/model",
            "--lifecycle",
            "lazy",
            "--seed",
            "7",
            "--group-size",
            "6",
            "--no-offload",
            "--lr",
            "0.001",
        ]);
        assert_eq!((o.gpu.gpus, o.run.tp, o.run.steps), (2, 2, 1));
        assert_eq!(o.run.checkpoint, Some(PathBuf::from("some/model")));
        assert_eq!(o.run.lifecycle, LifecycleChoice::Lazy);
        assert_eq!((o.run.seed, o.run.group_size), (7, 6));
        assert!(o.run.no_offload);
        assert_eq!(o.gpu.lr, 0.001);
        // the options not given keep the GPU run's defaults
        let d = gpu_dapo::Options::default();
        assert_eq!(o.run.tokens, d.run.tokens);
        assert_eq!(o.run.prompts_per_batch, d.run.prompts_per_batch);
        let o = fsdp(&["--backend", "fsdp", "--synthetic", "7b", "--tp", "1"]);
        assert_eq!(o.gpu.synthetic, Some(SyntheticModel::Qwen7b));
    }

    #[test]
    fn options_of_the_other_backend_are_errors() {
        let e = plan(&["--backend", "fsdp", "--vocab", "32", "--world", "3"]).unwrap_err();
        let ArgsError::WrongBackend {
            options,
            only,
            chosen,
            ..
        } = &e
        else {
            panic!("expected WrongBackend, got {e:?}");
        };
        assert_eq!(options, &["--world", "--vocab"]);
        assert_eq!((*only, *chosen), (Backend::Host, Backend::Fsdp));
        let msg = e.to_string();
        assert!(
            msg.contains("--world, --vocab only apply to --backend host")
                && msg.contains("this run is --backend fsdp"),
            "{msg}"
        );
        let msg = plan(&["--backend", "fsdp", "--world", "2"])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("--world only applies") && msg.contains("--gpus"),
            "{msg}"
        );
        // the objective is the host update's (the GPU backends' update is synthetic)
        let msg = plan(&["--backend", "fsdp", "--objective", "verl"])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("--objective only applies to --backend host"),
            "{msg}"
        );
        // the default backend is host: GPU-only options need --backend fsdp
        let msg = plan(&["--gpus", "2"]).unwrap_err().to_string();
        assert!(
            msg.contains("--gpus only applies to --backend fsdp") && msg.contains("--world"),
            "{msg}"
        );
        let msg = plan(&["--backend", "host", "--lr", "0.1", "--synthetic", "small"])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("--synthetic, --lr only apply to --backend fsdp"),
            "{msg}"
        );
        // a checkpoint and a synthetic model exclude each other (clap's own check)
        let e = Args::parse_from_argv([
            "dapo",
            "--backend",
            "fsdp",
            "--checkpoint",
            "x",
            "--synthetic",
            "7b",
        ])
        .unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{e}");
    }

    #[test]
    fn every_backend_parses_its_options() {
        // host, Megatron training layout: the degrees reach the config
        match plan(&[
            "--train",
            "megatron",
            "--train-tp",
            "2",
            "--pp",
            "1",
            "--verbose",
        ])
        .unwrap()
        {
            Plan::Host {
                config, verbose, ..
            } => {
                assert_eq!(
                    config.train,
                    HostTrain::Megatron {
                        tp: 2,
                        pp: 1,
                        ep: 1,
                        etp: 2
                    }
                );
                assert!(verbose);
            }
            other => panic!("expected the host backend, got {other:?}"),
        }
        // host default: FSDP layout, Megatron defaults unused
        match plan(&[]).unwrap() {
            Plan::Host { config, .. } => assert_eq!(config.train, HostTrain::Fsdp),
            other => panic!("expected the host backend, got {other:?}"),
        }
        // fsdp on GPUs
        let o = fsdp(&["--backend", "fsdp", "--verbose", "--trace", "/tmp/t"]);
        assert_eq!(o.layout, GpuLayout::Fsdp);
        assert!(o.run.verbose && o.run.trace.as_deref() == Some("/tmp/t"));
        // megatron on GPUs: its degrees, the GPU options, the loop options
        let o = fsdp(&[
            "--backend",
            "megatron",
            "--gpus",
            "2",
            "--train-tp",
            "1",
            "--pp",
            "2",
            "--tp",
            "2",
            "--steps",
            "1",
            "--lr",
            "0.001",
        ]);
        assert_eq!(
            o.layout,
            GpuLayout::Megatron {
                tp: 1,
                pp: 2,
                ep: 1,
                etp: 1
            }
        );
        assert_eq!(
            (o.gpu.gpus, o.run.tp, o.run.steps, o.gpu.lr),
            (2, 2, 1, 0.001)
        );
        let o = fsdp(&["--backend", "megatron"]);
        assert_eq!(
            o.layout,
            GpuLayout::Megatron {
                tp: 1,
                pp: 2,
                ep: 1,
                etp: 1
            }
        );
        assert_eq!(o.run, gpu_dapo::Options::default().run);
        // One GPU makes one stage unless told otherwise.
        let o = fsdp(&["--backend", "megatron", "--gpus", "1", "--tp", "1"]);
        assert_eq!(
            o.layout,
            GpuLayout::Megatron {
                tp: 1,
                pp: 1,
                ep: 1,
                etp: 1
            }
        );
        // Megatron degrees without a Megatron layout
        let msg = plan(&["--pp", "2"]).unwrap_err().to_string();
        assert!(
            msg.contains("--pp only applies to the Megatron training layout"),
            "{msg}"
        );
        let msg = plan(&["--backend", "fsdp", "--train-tp", "2"])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("--train-tp only applies"), "{msg}");
        // --train is the host's: on GPUs the layout is the backend
        let msg = plan(&["--backend", "megatron", "--train", "megatron"])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("--train only applies to --backend host"),
            "{msg}"
        );
        assert!(msg.contains("--backend megatron"), "{msg}");
        let msg = plan(&["--backend", "megatron", "--world", "2"])
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("--world only applies") && msg.contains("--gpus"),
            "{msg}"
        );
    }

    #[test]
    fn fsdp_without_a_gpu_is_a_typed_error() {
        let options = fsdp(&[
            "--backend",
            "fsdp",
            "--gpus",
            "2",
            "--tp",
            "2",
            "--steps",
            "1",
        ]);
        let result = gpu_dapo::run(&options);
        if driver_present() {
            // a GPU machine: it runs, or fails with a value (e.g. fewer than 2 GPUs)
            if let Err(e) = result {
                println!("on this machine: {e}");
            }
            return;
        }
        match result {
            Err(e @ DapoGpuError::Cuda(CudaError::NoDriver)) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("libcuda") && msg.contains("LD_LIBRARY_PATH"),
                    "{msg}"
                );
            }
            other => panic!("expected Cuda(NoDriver), got {other:?}"),
        }
        // settings are checked before the GPUs are looked for
        let options = fsdp(&["--backend", "fsdp", "--gpus", "1", "--tp", "2"]);
        assert!(matches!(
            gpu_dapo::run(&options),
            Err(DapoGpuError::Gpu(
                lifecycle_decoder_gpu::GpuDecodeError::Topology { .. }
            ))
        ));
    }
}
