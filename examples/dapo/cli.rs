//! The command line: the options of both backends, checked against each other, and the run
//! they plan ([`Plan`]).

use std::fmt::Display;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args as _, CommandFactory, FromArgMatches, Parser, ValueEnum};
use lifecycle_core::MemoryPolicy;
use lifecycle_decoder::Leftovers;
use lifecycle_examples::dapo::update::DEFAULT_TIS_CAP;
use lifecycle_examples::dapo::{DapoConfig, HostTrain, LoraModules, Objective, UpdateConfig};
use lifecycle_examples::gpu_dapo::{
    self as gpu_dapo, GpuLayout, GpuOptions, LifecycleChoice, LoopOptions,
};
use lifecycle_examples::toy_policy::PolicyConfig;
use lifecycle_layout::fp8::{Fp8Compute, Fp8Keep, RolloutDtype};
use lifecycle_layout::ExpertPlacement;

/// Where the loop runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Backend {
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
pub(crate) fn help(text: &str, host: impl Display, fsdp: impl Display) -> String {
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
pub(crate) struct Args {
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
    /// `w8a8` (the default and the fast mode: the activations quantised per token in 1 x 128
    /// groups as well, as vLLM's block-fp8 linear does; on the GPU, a tensor-core kernel up to
    /// 8 tokens a product, cuBLASLt's block-scaled fp8 GEMM beyond) or `weight-only` (the exact
    /// mode: e4m3 weights times the activations in f32).
    #[arg(long, default_value = "w8a8", value_parser = <Fp8Compute as std::str::FromStr>::from_str)]
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
    /// The toy policy's truncated importance sampling (verl's token-level TIS): each token's
    /// loss and gradient times min(exp(trainer log-prob - rollout log-prob), C) with C this cap;
    /// 0 turns it off (the mismatch between the two log-probabilities is measured either way).
    #[arg(long, value_name = "C", default_value_t = DEFAULT_TIS_CAP)]
    tis_cap: f32,
    /// Dynamic sampling: `batches` (whole gen batches of --prompts groups until enough have
    /// mixed rewards) or `stream` (groups submitted as the CPU decoder's KV slots free up, each
    /// scored as it finishes; --checkpoint or --train megatron runs: the toy policy has no KV
    /// slots).
    #[arg(long, value_enum, default_value_t = SamplingMode::Batches)]
    sampling: SamplingMode,
    /// With --sampling stream: the requests in flight once a step's groups are kept are
    /// aborted (which favours short samples) or carried as partial rollouts into the next step,
    /// on the updated weights.
    #[arg(long, value_enum, default_value_t = LeftoverMode::Abort)]
    leftovers: LeftoverMode,
    /// With --leftovers partial: the weight versions a partial rollout may lag (a sample older
    /// than that is dropped, never trained on).
    #[arg(long, default_value_t = 1)]
    max_staleness: u64,
    /// LoRA adapters of rank R on all seven linear types of the --checkpoint model (lora_alpha
    /// 2R; A drawn as PEFT's, B zero): the base frozen and cast into the rollout once, the
    /// synthetic update moving the adapters alone, the rollout weights kept resident (nothing
    /// offloaded) so that each refresh moves the adapters alone. 0: none.
    #[arg(long, value_name = "R", default_value_t = 0)]
    lora: usize,
    /// With --lora: the linear types adapted, `all` seven or the `attention`'s q / k / v / o (a
    /// mixture-of-experts model's experts take no adapters).
    #[arg(long, value_enum, default_value_t = LoraModulesArg::All)]
    lora_modules: LoraModulesArg,
}

/// `--lora-modules`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LoraModulesArg {
    All,
    Attention,
}

/// `--sampling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SamplingMode {
    Batches,
    Stream,
}

/// `--leftovers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LeftoverMode {
    Abort,
    Partial,
}

/// A command line that does not fit its backend.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ArgsError {
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
    /// Streamed dynamic sampling on the toy policy, whose engine holds no KV slots.
    #[error(
        "--sampling stream runs the CPU decoder's KV slots: pass --checkpoint DIR (or --train \
         megatron); the toy policy samples whole gen batches (--sampling batches)"
    )]
    StreamWithoutDecoder,
    /// Stream settings without --sampling stream.
    #[error("{0} only applies to --sampling stream")]
    StreamOnly(&'static str),
    /// LoRA settings without --lora.
    #[error("{0} only applies with --lora R")]
    LoraOnly(&'static str),
    /// LoRA adapters without a decoder model in the FSDP layout.
    #[error(
        "--lora adapts a decoder model's linear layers in the FSDP training layout: pass \
         --checkpoint DIR (and --train fsdp, the default)"
    )]
    LoraWithoutCheckpoint,
}

/// What a command line runs.
#[derive(Debug)]
pub(crate) enum Plan {
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
pub(crate) fn given(matches: &ArgMatches, group: clap::Command) -> Vec<String> {
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
    pub(crate) fn parse_command_line() -> Result<(Args, ArgMatches), clap::Error> {
        Args::with_matches(Args::command().try_get_matches()?)
    }

    /// Parses `argv` (the program name first), or returns clap's error.
    #[cfg(test)]
    pub(crate) fn parse_from_argv<I, T>(argv: I) -> Result<(Args, ArgMatches), clap::Error>
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
    pub(crate) fn plan(&self, matches: &ArgMatches) -> Result<Plan, ArgsError> {
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
            Backend::Host => {
                let h = &self.host;
                let toy = self.checkpoint.is_none() && h.train == Train::Fsdp;
                match h.sampling {
                    SamplingMode::Stream if toy => return Err(ArgsError::StreamWithoutDecoder),
                    SamplingMode::Batches if h.leftovers != LeftoverMode::Abort => {
                        return Err(ArgsError::StreamOnly("--leftovers"))
                    }
                    SamplingMode::Stream | SamplingMode::Batches => {}
                }
                if h.lora > 0 && (self.checkpoint.is_none() || h.train != Train::Fsdp) {
                    return Err(ArgsError::LoraWithoutCheckpoint);
                }
                if h.lora == 0 && h.lora_modules != LoraModulesArg::All {
                    return Err(ArgsError::LoraOnly("--lora-modules"));
                }
                if h.max_staleness != 1 && h.leftovers != LeftoverMode::Partial {
                    return Err(ArgsError::StreamOnly(
                        "--max-staleness (with --leftovers partial)",
                    ));
                }
                Ok(self.host_plan())
            }
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
                // 0 is off; anything else is checked by `dapo::validate` (finite, > 0)
                tis_cap: (h.tis_cap != 0.0).then_some(h.tis_cap),
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
            stream: (h.sampling == SamplingMode::Stream).then_some(match h.leftovers {
                LeftoverMode::Abort => Leftovers::Abort,
                LeftoverMode::Partial => Leftovers::Partial {
                    max_staleness: h.max_staleness,
                },
            }),
            lora: h.lora,
            lora_modules: match h.lora_modules {
                LoraModulesArg::All => LoraModules::All,
                LoraModulesArg::Attention => LoraModules::Attention,
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
