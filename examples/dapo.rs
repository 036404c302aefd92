//! DAPO with dynamic sampling: several rollout calls per training step, one update that changes
//! every weight. Runs the lazy and the eager lifecycle on the same seed and compares them, on the
//! CPU reference backend (`--backend host`, the default) or on NVIDIA GPUs (`--backend fsdp`).
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
//! `--layers`), or with `--checkpoint DIR` (a Hugging Face `config.json` + `model.safetensors`,
//! Qwen2 or Llama) the training state is the checkpoint's weights and every rollout runs the Qwen2
//! / Llama decoder (`lifecycle-decoder`) on the resharded bf16 tensor-parallel slices; the
//! toy-policy size options are then ignored.
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
use lifecycle_examples::dapo::{self, DapoConfig, RunReport, StepReport};
use lifecycle_examples::gpu_dapo::{self as gpu_dapo, GpuOptions, LifecycleChoice, LoopOptions};
use lifecycle_examples::lm_policy::run_checkpoint;
use lifecycle_examples::toy_policy::PolicyConfig;

/// Where the loop runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// The CPU reference backend: ranks are threads, links are memory copies.
    Host,
    /// The FSDP backend on NVIDIA GPUs, rollouts by the GPU decoder.
    Fsdp,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Host => "host",
            Backend::Fsdp => "fsdp",
        })
    }
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
    /// A Hugging Face checkpoint folder (config.json + model.safetensors, Qwen2 or Llama): train
    /// its weights and roll out through the decoder (CPU decoder on host, GPU decoder on fsdp)
    /// instead of the toy policy / a synthetic model.
    #[arg(long, value_name = "PATH")]
    checkpoint: Option<PathBuf>,
    #[command(flatten, next_help_heading = "Host backend only (--backend host)")]
    host: HostOptions,
    #[command(flatten, next_help_heading = "FSDP backend only (--backend fsdp)")]
    fsdp: GpuOptions,
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
    /// Write the switch timeline of each run as a Chrome / Perfetto trace: PATH.lazy.json and
    /// PATH.eager.json (open them at ui.perfetto.dev).
    #[arg(long, value_name = "PATH")]
    trace: Option<String>,
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
    },
    /// The FSDP backend on GPUs.
    Fsdp(gpu_dapo::Options),
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
        let (host_only, fsdp_only) = (
            given(
                matches,
                HostOptions::augment_args(clap::Command::new("host")),
            ),
            given(
                matches,
                GpuOptions::augment_args(clap::Command::new("fsdp")),
            ),
        );
        match self.backend {
            Backend::Host if !fsdp_only.is_empty() => Err(ArgsError::WrongBackend {
                hint: if fsdp_only.iter().any(|o| o == "--gpus") {
                    " (the host backend's ranks are --world)"
                } else {
                    ""
                },
                options: fsdp_only,
                only: Backend::Fsdp,
                chosen: Backend::Host,
            }),
            Backend::Fsdp if !host_only.is_empty() => Err(ArgsError::WrongBackend {
                hint: if host_only.iter().any(|o| o == "--world") {
                    " (the FSDP backend's ranks are --gpus)"
                } else {
                    ""
                },
                options: host_only,
                only: Backend::Host,
                chosen: Backend::Fsdp,
            }),
            Backend::Host => Ok(self.host_plan()),
            Backend::Fsdp => Ok(Plan::Fsdp(self.fsdp_options())),
        }
    }

    fn host_plan(&self) -> Plan {
        let d = DapoConfig::default();
        let h = &self.host;
        let config = DapoConfig {
            steps: self.steps.unwrap_or(d.steps),
            world: h.world,
            tp: self.tp.unwrap_or(d.tp),
            prompts_per_batch: self.prompts_per_batch.unwrap_or(d.prompts_per_batch),
            group_size: self.group_size.unwrap_or(d.group_size),
            batch_groups: self.batch_groups.unwrap_or(d.batch_groups),
            max_gen_batches: self.max_gen_batches.unwrap_or(d.max_gen_batches),
            tokens: self.tokens.unwrap_or(d.tokens),
            temperature: self.temperature.unwrap_or(d.temperature),
            seed: self.seed.unwrap_or(d.seed),
            reward_modulus: d.reward_modulus,
            update: d.update,
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
            trace: h.trace.is_some(),
        };
        Plan::Host {
            config,
            lifecycle: self.lifecycle.unwrap_or(HOST_LIFECYCLE),
            checkpoint: self.checkpoint.clone(),
            trace: h.trace.clone(),
        }
    }

    fn fsdp_options(&self) -> gpu_dapo::Options {
        let d = LoopOptions::DEFAULTS;
        gpu_dapo::Options {
            gpu: self.fsdp.clone(),
            run: LoopOptions {
                tp: self.tp.unwrap_or(d.tp),
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
    match checkpoint {
        Some(ckpt) => run_checkpoint(config, ckpt, switching, on_step),
        None => dapo::run(config, switching, on_step),
    }
}

fn run_one(
    config: &DapoConfig,
    checkpoint: Option<&Checkpoint>,
    switching: Switching,
    trace: Option<&str>,
) -> Result<RunReport, dapo::DapoError> {
    let name = match switching {
        Switching::Lazy => "lazy",
        Switching::Eager => "eager",
    };
    println!("\n== {name} lifecycle ==");
    let report = run_dapo(config, checkpoint, switching, |s| {
        println!(
            "step {}: gen batches {}, kept {}/{} groups, mean reward {:.3}, switches {}, exits {}, \
             moved {} (d2d {}, d2h {}, h2d {}), rollout {}, switch {}, update {}",
            s.step,
            s.gen_batches,
            s.kept,
            s.groups,
            s.mean_reward,
            s.switches,
            s.exits,
            HumanBytes(s.bytes.moved()),
            HumanBytes(s.bytes.device_to_device),
            HumanBytes(s.bytes.device_to_host),
            HumanBytes(s.bytes.host_to_device),
            ms(s.rollout_time),
            ms(s.switch_time),
            ms(s.update_time),
        );
    })?;
    println!("{}", report.metrics.table());
    let rate = host_copy_rate();
    let ceilings = Ceilings {
        device_to_device_gbps: Some(rate),
        device_to_host_gbps: Some(rate),
        host_to_device_gbps: Some(rate),
        local_gbps: Some(rate),
    };
    println!(
        "per phase against this host's copy rate ({rate:.1} GB/s copied; for the host backend every link is a copy in one memory):\n{}",
        report.metrics.report(&ceilings)
    );
    if let Some(base) = trace {
        let path = format!("{base}.{name}.json");
        match report.trace.write_chrome(&path) {
            Ok(()) => println!(
                "switch timeline: {path} ({} spans; open it at ui.perfetto.dev)",
                report.trace.spans().len()
            ),
            Err(e) => eprintln!("warning: could not write the trace {path}: {e}"),
        }
    }
    Ok(report)
}

fn compare(lazy: &RunReport, eager: &RunReport) {
    println!("\n== lazy vs eager (same seed) ==");
    println!(
        "{:<6} {:>6} {:>11} {:>9} {:>6} {:>11} {:>12} {:>14} {:>10}",
        "policy",
        "steps",
        "gen batches",
        "switches",
        "exits",
        "bytes",
        "switch time",
        "rollout phase",
        "total"
    );
    for r in [lazy, eager] {
        let name = if r.switching == Switching::Lazy {
            "lazy"
        } else {
            "eager"
        };
        println!(
            "{:<6} {:>6} {:>11} {:>9} {:>6} {:>11} {:>12} {:>14} {:>10}",
            name,
            r.steps.len(),
            r.gen_batches(),
            r.metrics.switches(),
            r.metrics.exits,
            HumanBytes(r.metrics.bytes().moved()).to_string(),
            ms(r.metrics.switch_time()),
            ms(r.rollout_time()),
            ms(r.total_time),
        );
    }
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let per_step = lazy.metrics.switches() as f64 / lazy.steps.len() as f64;
    println!(
        "lazy: {per_step:.2} switches per training step; eager: {:.2} per step ({} gen batches over {} steps)",
        eager.metrics.switches() as f64 / eager.steps.len() as f64,
        eager.gen_batches(),
        eager.steps.len()
    );
    println!(
        "eager / lazy: switches {:.2}x, bytes {:.2}x, switch time {:.2}x, rollout phase {:.2}x",
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
        ratio(
            eager.rollout_time().as_secs_f64(),
            lazy.rollout_time().as_secs_f64()
        ),
    );
    let identical = lazy.groups == eager.groups;
    println!(
        "samples identical across policies: {}",
        if identical {
            "yes"
        } else {
            "NO (a lifecycle bug: both must see the same weights)"
        }
    );
}

/// The host backend's run: the toy policy or the checkpoint, one lifecycle or both compared.
fn run_host(
    config: DapoConfig,
    lifecycle: LifecycleChoice,
    checkpoint_path: Option<PathBuf>,
    trace: Option<String>,
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
    let offload = if config.memory == MemoryPolicy::resident() {
        "off"
    } else {
        "master + Adam"
    };
    match (&checkpoint, &checkpoint_path) {
        (Some(ckpt), Some(path)) => {
            let m = &ckpt.config;
            println!(
                "DAPO on the host backend: W = {}, T = {}, checkpoint {} ({:?}, {} params, {} layers, \
                 hidden {}, heads {}/{} kv, vocab {}, {} head), rollouts through the CPU decoder, \
                 {} prompts x {} samples per gen batch, {} groups per step, offload {offload}",
                config.world,
                config.tp,
                path.display(),
                m.architecture,
                m.params(),
                m.num_layers,
                m.hidden_size,
                m.num_heads,
                m.num_kv_heads,
                m.vocab_size,
                if m.tie_word_embeddings { "tied" } else { "untied" },
                config.prompts_per_batch,
                config.group_size,
                config.batch_groups,
            );
        }
        _ => println!(
            "DAPO on the host backend: W = {}, T = {}, policy {} params ({} layers, hidden {}, ffn {}, vocab {}), \
             {} prompts x {} samples per gen batch, {} groups per step, offload {offload}",
            config.world,
            config.tp,
            config.policy.params(),
            config.policy.layers,
            config.policy.hidden,
            config.policy.ffn,
            config.policy.vocab,
            config.prompts_per_batch,
            config.group_size,
            config.batch_groups,
        ),
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
    let result = match lifecycle {
        LifecycleChoice::Lazy => run_one(&config, ckpt, Switching::Lazy, trace).map(|_| ()),
        LifecycleChoice::Eager => run_one(&config, ckpt, Switching::Eager, trace).map(|_| ()),
        LifecycleChoice::Both => run_one(&config, ckpt, Switching::Lazy, trace).and_then(|lazy| {
            let eager = run_one(&config, ckpt, Switching::Eager, trace)?;
            compare(&lazy, &eager);
            Ok(())
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
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
        }) => run_host(config, lifecycle, checkpoint, trace),
        Ok(Plan::Fsdp(options)) => gpu_dapo::run_cli(&options),
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
            Ok(Plan::Fsdp(o)) => o,
            other => panic!("expected the fsdp backend, got {other:?}"),
        }
    }

    #[test]
    fn the_default_is_the_host_backend_with_its_defaults() {
        match plan(&[]).unwrap() {
            Plan::Host {
                config,
                lifecycle,
                checkpoint,
                trace,
            } => {
                assert_eq!(
                    format!("{config:?}"),
                    format!("{:?}", DapoConfig::default())
                );
                assert_eq!(lifecycle, LifecycleChoice::Both);
                assert!(checkpoint.is_none() && trace.is_none());
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
        ])
        .unwrap()
        {
            Plan::Host {
                config,
                lifecycle,
                trace,
                ..
            } => {
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
        let e = plan(&["--backend", "fsdp", "--vocab", "32", "--trace", "/tmp/t"]).unwrap_err();
        let ArgsError::WrongBackend {
            options,
            only,
            chosen,
            ..
        } = &e;
        assert_eq!(options, &["--vocab", "--trace"]);
        assert_eq!((*only, *chosen), (Backend::Host, Backend::Fsdp));
        let msg = e.to_string();
        assert!(
            msg.contains("--vocab, --trace only apply to --backend host")
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
