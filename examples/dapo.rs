//! DAPO with dynamic sampling on the host backend: several rollout calls per training step, one
//! update that changes every weight. Runs the lazy and the eager lifecycle on the same seed and
//! compares them.
//!
//! ```text
//! cargo run --release --example dapo                 # lazy vs eager, default sizes
//! cargo run --release --example dapo -- --help       # every option
//! cargo run --release --example dapo -- --checkpoint examples/decoder/fixtures/gqa_untied
//! ```
//!
//! With `--checkpoint DIR` (a Hugging Face `config.json` + `model.safetensors`, Qwen2 or Llama) the
//! training state is the checkpoint's weights and every rollout runs the Qwen2 / Llama decoder
//! (`lifecycle-decoder`) on the resharded bf16 tensor-parallel slices; the toy-policy size options
//! are then ignored.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use lifecycle_core::{Ceilings, HumanBytes, HumanDuration, MemoryPolicy, Switching};
use lifecycle_decoder::{load_checkpoint, Checkpoint};
use lifecycle_examples::dapo::{self, DapoConfig, RunReport, StepReport};
use lifecycle_examples::lm_policy::run_checkpoint;
use lifecycle_examples::toy_policy::PolicyConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LifecycleArg {
    Lazy,
    Eager,
    Both,
}

/// DAPO-style RL loop on the CPU reference backend.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Which lifecycle to run; `both` runs lazy then eager on the same seed and compares them.
    #[arg(long, value_enum, default_value = "both")]
    lifecycle: LifecycleArg,
    /// Training steps.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Ranks (threads standing for GPUs).
    #[arg(long, default_value_t = 2)]
    world: usize,
    /// Rollout tensor-parallel degree (must divide --world).
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Prompts per rollout call.
    #[arg(long, default_value_t = 4)]
    prompts_per_batch: usize,
    /// Samples per prompt.
    #[arg(long, default_value_t = 8)]
    group_size: usize,
    /// Groups with mixed rewards per training batch.
    #[arg(long, default_value_t = 8)]
    batch_groups: usize,
    /// Most rollout calls per step before failing.
    #[arg(long, default_value_t = 16)]
    max_gen_batches: usize,
    /// Tokens generated per sample.
    #[arg(long, default_value_t = 12)]
    tokens: usize,
    /// Sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Seed of weights, prompts and sampling.
    #[arg(long, default_value_t = 2026)]
    seed: u64,
    /// Vocabulary size (divisible by --tp).
    #[arg(long, default_value_t = 64)]
    vocab: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// MLP intermediate size (divisible by --tp).
    #[arg(long, default_value_t = 1024)]
    ffn: usize,
    /// MLP blocks.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Keep master weights and optimizer state on the device during rollout.
    #[arg(long)]
    no_offload: bool,
    /// Write the switch timeline of each run as a Chrome / Perfetto trace: PATH.lazy.json and
    /// PATH.eager.json (open them at ui.perfetto.dev).
    #[arg(long, value_name = "PATH")]
    trace: Option<String>,
    /// A Hugging Face checkpoint folder (config.json + model.safetensors, Qwen2 or Llama): train
    /// its weights and roll out through the decoder instead of the toy policy.
    #[arg(long, value_name = "PATH")]
    checkpoint: Option<PathBuf>,
}

impl Args {
    fn config(&self) -> DapoConfig {
        DapoConfig {
            steps: self.steps,
            world: self.world,
            tp: self.tp,
            prompts_per_batch: self.prompts_per_batch,
            group_size: self.group_size,
            batch_groups: self.batch_groups,
            max_gen_batches: self.max_gen_batches,
            tokens: self.tokens,
            temperature: self.temperature,
            seed: self.seed,
            policy: PolicyConfig {
                vocab: self.vocab,
                hidden: self.hidden,
                ffn: self.ffn,
                layers: self.layers,
            },
            memory: if self.no_offload {
                MemoryPolicy::resident()
            } else {
                MemoryPolicy::default()
            },
            trace: self.trace.is_some(),
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

fn main() -> ExitCode {
    let args = Args::parse();
    let config = args.config();
    let checkpoint = match &args.checkpoint {
        None => None,
        Some(path) => match load_checkpoint(path) {
            Ok(ckpt) => Some(ckpt),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let offload = if args.no_offload {
        "off"
    } else {
        "master + Adam"
    };
    match (&checkpoint, &args.checkpoint) {
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
    let trace = args.trace.as_deref();
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
    let result = match args.lifecycle {
        LifecycleArg::Lazy => run_one(&config, ckpt, Switching::Lazy, trace).map(|_| ()),
        LifecycleArg::Eager => run_one(&config, ckpt, Switching::Eager, trace).map(|_| ()),
        LifecycleArg::Both => run_one(&config, ckpt, Switching::Lazy, trace).and_then(|lazy| {
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
