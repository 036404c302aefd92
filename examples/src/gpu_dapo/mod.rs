//! DAPO end to end on GPUs: dynamic sampling through the GPU decoder on the FSDP backend's
//! resharded rollout weights, an in-place Adam step on synthetic gradients between training
//! steps, and the lazy and eager lifecycles compared on the same seeds.
//!
//! The `dapo` example runs it with `--backend fsdp` (the same example runs the loop on the CPU
//! reference backend by default):
//!
//! ```text
//! dapo --backend fsdp --gpus 2 --tp 2 --synthetic 7b --lifecycle both   # Qwen2.5-7B shapes, random weights
//! dapo --backend fsdp --gpus 2 --tp 1 --synthetic 7b                    # 2 data-parallel decoder replicas
//! dapo --backend fsdp --gpus 1 --tp 1 --synthetic 7b                    # one GPU
//! dapo --backend fsdp --gpus 2 --tp 2 --checkpoint path/to/hf-model     # config.json + model.safetensors
//! lifecycle-launch --nproc-per-node 2 -- dapo --backend fsdp --gpus 2 --tp 2   # one process per GPU
//! dapo --help                                                            # every option
//! ```
//!
//! Per training step: gen batches of `--prompts-per-batch` prompts × `--group-size` samples are
//! generated with temperature sampling by the GPU decoder's engine
//! ([`GpuEngine::run`](lifecycle_decoder_gpu::GpuEngine::run): one request per sample, each with
//! its own seed, [`crate::dapo::sample_seed`]) on the resident rollout weights, each sample with
//! its per-token log-probabilities (kept in [`crate::dapo::Group::logprobs`]; the synthetic
//! update has no trainer forward pass to weigh them against); each sample is rewarded by a verifiable rule (1 if one of its generated
//! tokens `t` has `t mod M == target(prompt)`, `M = --reward-modulus`); groups whose rewards all
//! agree are dropped; gen batches continue until `--batch-groups` groups are kept (at most
//! `--max-gen-batches`, then [`DapoGpuError::BatchNotFilled`]). Then the update: seeded synthetic
//! gradients are written into the gradient shards on the GPUs and one Adam step is applied in
//! place to the fp32 master, m, v shards ([`FsdpBackend::fill_synthetic_grads`],
//! [`FsdpBackend::adam_step`]). It is an Adam step on synthetic gradients, not a learned update:
//! the gradients are noise, not the gradient of a loss of the samples. Nothing is reallocated,
//! and the pinned host memory of the offload is pinned in the background from setup (once the
//! memory policy is decided, beside the engine's setup) and reused by every switch.
//!
//! Launch: with launcher variables (torchrun, Slurm, `lifecycle-launch`) each process drives one
//! GPU (`--gpus` must equal `WORLD_SIZE`; only rank 0 prints the report, every rank prints its
//! errors); otherwise one process drives `--gpus` GPUs with a thread each. The decoder runs one
//! tensor-parallel group (`--gpus` = `--tp`), or, in one process at `--tp 1`, one data-parallel
//! replica per GPU. What is offloaded to pinned host memory during rollout is decided by need
//! (`--memory by-need`, the default: the least that makes room for the rollout); `--memory
//! offload` always moves master weights and Adam moments, `--memory resident` nothing.
//!
//! The settings are [`Options`], a `clap` argument group to flatten into a parser:
//!
//! ```
//! use clap::Parser;
//! use lifecycle_examples::gpu_dapo::{Options, SyntheticModel};
//!
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     options: Options,
//! }
//!
//! let cli = Cli::try_parse_from(["dapo", "--gpus", "2", "--tp", "2", "--synthetic", "7b"])?;
//! assert_eq!(cli.options.gpu.synthetic, Some(SyntheticModel::Qwen7b));
//! assert_eq!(cli.options.run.steps, Options::default().run.steps);
//! // lifecycle_examples::gpu_dapo::run(&cli.options)?;   // on a machine with 2 GPUs
//! # Ok::<(), clap::Error>(())
//! ```

use lifecycle_layout::settings::Configure;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lifecycle_core::{
    HumanBytes, HumanDuration, Lifecycle, LifecycleConfig, MemoryPolicy, Reshard, RolloutEngine,
    Switching,
};
use lifecycle_cuda::{check_environment, RolloutBuffer, ThreadRankPool};
use lifecycle_dist::RankEnv;
use lifecycle_fsdp::FsdpBackend;

use lifecycle_decoder_gpu::{decode_topology, DecodeTopology, EngineSettings};

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

pub mod engine;
mod error;
pub mod memory;
mod options;
mod policy;
mod report;
mod rollout;
mod source;

pub use engine::{ForRun, GpuGenerate, PerCallGpuDecoder, RunEngine};
pub use error::DapoGpuError;
pub use options::{GpuLayout, GpuOptions, LifecycleChoice, LoopOptions, Options, SyntheticModel};
pub(crate) use source::QWEN2_5_7B_CONFIG;

use crate::dapo::megatron::fused_layout;
use crate::prediction::qwen7b_switch;
use lifecycle_decoder::{DecodeError, MegatronConfig, MegatronParallel};
use lifecycle_megatron::MegatronGpuBackend;
use lifecycle_plan::TrainLayout;
use policy::{
    name, run_policy, FsdpTrainer, GpuDriver, MegatronSource, MegatronTrainer, PolicyReport,
};
use report::{compare, samples_digest, secs};
use rollout::{Ctx, Update};
use source::{Model, Source};

/// Runs DAPO on the GPUs with `options`: in one process with a thread per GPU, or, when the
/// launcher variables are set (torchrun, Slurm, `lifecycle-launch`), as one rank of a
/// one-process-per-GPU job. Prints the report (rank 0 only) on stdout.
///
/// Every setting is checked before any GPU work ([`Options::check`], the decoder topology, the
/// checkpoint); then the environment (driver, NCCL, NVRTC, `--gpus` GPUs), before anything is
/// printed: with no driver, NCCL or GPU the result is an error (`DapoGpuError::Cuda`), never a
/// panic.
///
/// ```no_run
/// use lifecycle_examples::gpu_dapo::{run, Options};
///
/// let mut options = Options::default();
/// options.gpu.gpus = 2;
/// options.run.tp = 2;
/// options.run.steps = 1;
/// run(&options)?;
/// # Ok::<(), lifecycle_examples::gpu_dapo::DapoGpuError>(())
/// ```
pub fn run(options: &Options) -> Result<(), DapoGpuError> {
    let env = RankEnv::from_env().map_err(DapoGpuError::Launcher)?;
    run_in(options, env)
}

/// [`run`] as a command-line tool runs it: on an error, prints `error: ...` (naming the rank in a
/// one-process-per-GPU job) on stderr and returns [`DapoGpuError::exit_code`].
pub fn run_cli(options: &Options) -> ExitCode {
    match run(options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let who = match RankEnv::from_env() {
                Ok(Some(env)) => format!(" (rank {} of {})", env.rank, env.world_size),
                _ => String::new(),
            };
            eprintln!("error{who}: {e}");
            ExitCode::from(e.exit_code())
        }
    }
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
fn check_launch(
    a: &Options,
    env: Option<RankEnv>,
) -> Result<(Launch, DecodeTopology), DapoGpuError> {
    a.check()?;
    let gpus = a.gpu.gpus;
    let (launch, local) = match env {
        None => (Launch::Threads, gpus),
        Some(env) => {
            if env.world_size != gpus {
                return Err(DapoGpuError::Usage(format!(
                    "--gpus {gpus} but the launcher started WORLD_SIZE = {} processes: with one \
                     process per GPU, --gpus must equal WORLD_SIZE",
                    env.world_size
                )));
            }
            (Launch::Process(env), 1)
        }
    };
    let topology = decode_topology(gpus, a.run.tp, local)?;
    Ok((launch, topology))
}

/// [`run`] with the launch given: `None` for one process with a thread per GPU.
///
/// Long by design: the run's setup in the order its header prints it (launch, model, rollout
/// layout, engine, backend and lifecycle per training layout), then the policies and the
/// comparison; the two training layouts share everything around their own lifecycle.
fn run_in(a: &Options, env: Option<RankEnv>) -> Result<(), DapoGpuError> {
    let (launch, topology) = check_launch(a, env)?;
    let root = match &launch {
        Launch::Threads => true,
        Launch::Process(env) => env.rank == 0,
    };
    let (r, g) = (&a.run, &a.gpu);
    let Model {
        config,
        source,
        what,
    } = Model::from_options(a)?;
    // Driver, NCCL, NVRTC and enough GPUs, before the report starts (an error, never a panic).
    check_environment(match &launch {
        Launch::Threads => g.gpus,
        Launch::Process(_) => 1,
    })?;
    let modulus = g
        .reward_modulus
        .min(u32::try_from(config.model.vocab).unwrap_or(u32::MAX))
        .max(1);
    let choice = if r.no_offload {
        memory::MemoryChoice::Resident
    } else {
        g.memory
    };
    let mode = match (&launch, topology) {
        (Launch::Process(env), _) => format!(
            "one process per GPU (rank {} of {}, local GPU {})",
            env.rank, env.world_size, env.local_rank
        ),
        (Launch::Threads, DecodeTopology::Group) => {
            "one process, a thread per GPU, one tensor-parallel decoder group".to_string()
        }
        (Launch::Threads, DecodeTopology::Replicas(n)) => {
            format!("one process, a thread per GPU, {n} data-parallel decoder replicas")
        }
    };
    say!(
        root,
        "DAPO on the {} backend: {what}: {:.3} B parameters, W = {}, T = {} ({mode}), memory {}",
        match a.layout {
            GpuLayout::Fsdp => "FSDP",
            GpuLayout::Megatron { .. } => "Megatron",
        },
        config.params() as f64 / 1e9,
        g.gpus,
        r.tp,
        match choice {
            memory::MemoryChoice::ByNeed => "by need (decided once the training state is built)",
            memory::MemoryChoice::Offload => "offload master + Adam at every enter",
            memory::MemoryChoice::Resident => "resident (nothing offloaded)",
        },
    );
    say!(
        root,
        "  per step: gen batches of {} prompts x {} samples, {} prompt + {} new tokens, \
         temperature {}, until {} groups with mixed rewards (at most {} gen batches); reward 1 if \
         a generated token t has t mod {} == target(prompt)",
        r.prompts_per_batch,
        r.group_size,
        g.prompt_len,
        r.tokens,
        r.temperature,
        r.batch_groups,
        r.max_gen_batches,
        modulus
    );
    let update = Update {
        params: a.adam_params(),
        grad_scale: g.grad_scale,
        seed: r.seed ^ 0x5EED_6AAD,
    };
    let policies: &[Switching] = match r.lifecycle {
        LifecycleChoice::Lazy => &[Switching::Lazy],
        LifecycleChoice::Eager => &[Switching::Eager],
        LifecycleChoice::Both => &[Switching::Lazy, Switching::Eager],
    };
    // the memory policy is decided in each branch, once the training state is built
    let lc_config = LifecycleConfig {
        switching: policies[0],
        memory: MemoryPolicy::default(),
    };
    let cx = Ctx {
        options: a,
        config: &config,
        modulus,
        root,
    };
    let t = Instant::now();
    let pool = Arc::new(match &launch {
        Launch::Threads => ThreadRankPool::new(g.gpus)?,
        Launch::Process(env) => ThreadRankPool::for_process(env, Duration::from_secs(120))?,
    });
    // The engine's KV cache holds one gen batch (or the warm-up call) of prompt + new tokens.
    let capacity = {
        let (sequences, tokens) = (
            (r.prompts_per_batch * r.group_size).max(1),
            g.prompt_len.max(3) + r.tokens.max(1),
        );
        // --kv-tokens: more sequence slots of the same length, so the room is allocated whole
        let asked = g.kv_tokens.map_or(0, |n| n.div_ceil(tokens));
        (sequences.max(asked), tokens)
    };
    let settings = EngineSettings::new(capacity.0, capacity.1)
        .with_fork_prefill(g.fork_prefill)
        .with_fp8_compute(r.fp8_compute)
        .with_kv_dtype(g.kv_dtype);
    let replicas = match topology {
        DecodeTopology::Group => 1,
        DecodeTopology::Replicas(n) => n,
    };
    let decide = |pool: &ThreadRankPool, layout: &lifecycle_layout::RolloutLayout| {
        let (memory, decision) = memory::resolve(
            choice,
            pool,
            &config,
            layout,
            &settings,
            replicas,
            (r.rollout_dtype, r.fp8_keep),
        )?;
        match &decision {
            Some(d) => say!(root, "  memory {d}"),
            None => say!(
                root,
                "  memory: offload master {} / Adam {}",
                if memory.offload_params { "on" } else { "off" },
                if memory.offload_optimizer {
                    "on"
                } else {
                    "off"
                }
            ),
        }
        let config = LifecycleConfig {
            memory,
            ..lc_config
        };
        Ok::<_, DapoGpuError>((config, decision))
    };
    let reports = match a.layout {
        GpuLayout::Fsdp => {
            let layout = config
                .rollout_layout_with(r.tp, r.experts)
                .map_err(DecodeError::from)?;
            let backend = FsdpBackend::new(Arc::clone(&pool), layout.clone())
                .with_rollout_dtype(r.rollout_dtype)
                .with_fp8_keep(r.fp8_keep)
                .with_offload_overlap(g.offload_overlap);
            let mut state = source.initial(&backend)?;
            let (lc_config, decision) = decide(&pool, &layout)?;
            // Pinning the offload's host memory runs from here, beside the engine's setup. The
            // engine is built after the by-need decision read the free memory: its static
            // allocations (cuBLAS workspaces, modules: ~70 MB at 7.6B on an H200) are inside
            // the decision's margin (MARGIN_BYTES).
            let pinning = backend.reserve_pinned_in_background(&mut state, lc_config.memory)?;
            let pinning = settle_pinning(pinning, g.wait_for_pinning, root)?;
            let engine = RunEngine::for_run(&config, &layout, &pool, &settings)?;
            let mut lc = Lifecycle::with_config(backend, state, lc_config)?.with_engine(engine);
            if let Some(d) = decision {
                lc.set_memory_decision(d)?;
            }
            let mut driver = GpuDriver {
                cx: &cx,
                trainer: FsdpTrainer {
                    update,
                    source: &source,
                },
            };
            let reports = run_policies(&mut lc, &mut driver, policies, t)?;
            lc.exit()?;
            say_engine_after_exit(&lc, root, g.offload_overlap);
            let state = lc.peek_state();
            say!(
                root,
                "  pinned host memory for the offload (this process's ranks): {}, {}; {} Adam \
                 steps applied since the last reset",
                HumanBytes(state.pinned_host_bytes()),
                pinned_at_setup(pinning)?,
                state.adam_steps()
            );
            reports
        }
        GpuLayout::Megatron { tp, pp, ep, etp } => {
            let parallel =
                MegatronParallel::new(tp, pp, g.gpus / (tp * pp).max(1)).with_experts(ep, etp);
            if parallel.world() != g.gpus {
                return Err(DapoGpuError::Usage(format!(
                    "--train-tp {tp} x --pp {pp} must divide --gpus {} (DP = GPUs / (TP x PP))",
                    g.gpus
                )));
            }
            let train_layout = config
                .megatron_layout(parallel)
                .map_err(|e| DapoGpuError::Usage(e.to_string()))?;
            config
                .rollout_layout_with(r.tp, r.experts)
                .map_err(|e| DapoGpuError::Usage(e.to_string()))?;
            let rollout = fused_layout(&config, r.tp, r.experts);
            let engine = RunEngine::for_run(&config, &rollout, &pool, &settings)?;
            let backend = MegatronGpuBackend::new(Arc::clone(&pool), rollout.clone())?
                .with_rollout_dtype(r.rollout_dtype)
                .with_fp8_keep(r.fp8_keep)
                .with_offload_overlap(g.offload_overlap);
            let trainer = MegatronTrainer {
                params: a.adam_params(),
                grad_scale: g.grad_scale,
                seed: r.seed ^ 0x5EED_6AAD,
                model: config.clone(),
                layout: train_layout,
                source: match &source {
                    Source::Synthetic { seed, scale, .. } => MegatronSource::Synthetic {
                        seed: *seed,
                        scale: *scale,
                    },
                    Source::Host { tensors } => MegatronSource::Host {
                        tensors: tensors.clone(),
                    },
                },
            };
            let mut state = trainer.initial(&backend)?;
            let (lc_config, decision) = decide(&pool, &rollout)?;
            let pinning = backend.reserve_pinned_in_background(&mut state, lc_config.memory)?;
            let pinning = settle_pinning(pinning, g.wait_for_pinning, root)?;
            let mut lc = Lifecycle::with_config(backend, state, lc_config)?.with_engine(engine);
            if let Some(d) = decision {
                lc.set_memory_decision(d)?;
            }
            say!(
                root,
                "  Megatron training layout TP {} x PP {} x DP {} -> fused rollout T = {}; rollout \
                 engine: {}",
                parallel.tp,
                parallel.pp,
                parallel.dp,
                r.tp,
                GpuGenerate::describe(lc.engine())
            );
            let mut driver = GpuDriver { cx: &cx, trainer };
            let reports = run_policies(&mut lc, &mut driver, policies, t)?;
            lc.exit()?;
            say_engine_after_exit(&lc, root, g.offload_overlap);
            say!(
                root,
                "  pinned host memory for the offload: {}",
                pinned_at_setup(pinning)?
            );
            reports
        }
    };
    for rep in &reports {
        say!(
            root,
            "[{}] total: {} steps, {} gen batches, rollout phase {:.3} s, switches {}, exits {}, \
             bytes {}, switch time {:.3} s, updates (synthetic gradients) {:.3} s",
            name(rep.run.switching),
            rep.run.steps.len(),
            rep.run.gen_batches(),
            secs(rep.sum(|s| s.rollout_time)),
            rep.switches(),
            rep.exits(),
            HumanBytes(rep.bytes()),
            secs(rep.sum(|s| s.switch_time)),
            secs(rep.sum(|s| s.update_apply)),
        );
    }
    if let ([lazy, eager], true) = (reports.as_slice(), root) {
        compare(lazy, eager);
    }
    if root {
        let train = match a.layout {
            GpuLayout::Fsdp => TrainLayout::Fsdp { world: g.gpus },
            GpuLayout::Megatron { tp, pp, .. } => TrainLayout::Megatron {
                tp,
                pp,
                dp: g.gpus / (tp * pp).max(1),
                ep: 1,
                etp: tp,
            },
        };
        match qwen7b_switch(train, r.tp, !r.no_offload) {
            Ok(p) => println!("{}", p.line()),
            Err(e) => println!("prediction (lifecycle-plan): not available for this layout: {e}"),
        }
    }
    if r.verbose && root {
        for rep in &reports {
            println!(
                "\n== {} lifecycle: per phase ==\n{}",
                name(rep.run.switching),
                rep.run.metrics.table()
            );
        }
    }
    if let (Some(base), true) = (&r.trace, root) {
        for rep in &reports {
            let path = format!("{base}.{}.json", name(rep.run.switching));
            match rep.run.trace.write_chrome(&path) {
                Ok(()) => println!("switch timeline: {path}"),
                Err(e) => eprintln!("warning: could not write the trace {path}: {e}"),
            }
        }
    }
    if g.samples_digest {
        let rank = match &launch {
            Launch::Threads => "the only process".to_string(),
            Launch::Process(env) => format!("rank {} of {}", env.rank, env.world_size),
        };
        for rep in &reports {
            let (digest, samples) = samples_digest(&rep.run.groups);
            println!(
                "[{}] {rank}: samples digest {digest:016x} over {samples} samples",
                name(rep.run.switching)
            );
        }
    }
    Ok(())
}

/// Runs every policy of `policies` on `lc` (the setup line first: `t` is when setup began).
fn run_policies<B, E, T>(
    lc: &mut Lifecycle<B, E>,
    driver: &mut GpuDriver<'_, T>,
    policies: &[Switching],
    t: Instant,
) -> Result<Vec<PolicyReport>, DapoGpuError>
where
    B: lifecycle_core::Reshard<Rollout = lifecycle_cuda::RolloutBuffer>,
    E: GpuGenerate,
    T: policy::Trainer<B>,
    DapoGpuError: From<lifecycle_core::LifecycleError<B::Error>>,
{
    let root = driver.cx.root;
    if driver.cx.options.run.trace.is_some() {
        lc.enable_trace();
    }
    say!(root, "  {}", lifecycle_examples_describe(driver));
    say!(
        root,
        "  rollout engine: {}; {} rollout weights; one request per sample, each sample with its \
         per-token log-probabilities (no trainer forward pass in this run: no truncated \
         importance sampling, no rollout / trainer mismatch to measure)",
        lc.engine().describe(),
        driver.cx.options.run.rollout_dtype
    );
    say!(
        root,
        "  setup (GPUs, NCCL, training state): {}",
        HumanDuration(t.elapsed())
    );
    let mut reports = Vec::new();
    for (i, &p) in policies.iter().enumerate() {
        reports.push(run_policy(lc, driver, p, i == 0)?);
    }
    Ok(reports)
}

/// The reservation of pinned memory started at setup, waited for when `wait` (and said so),
/// else left running.
fn settle_pinning(
    pinning: lifecycle_cuda::PinnedReservation,
    wait: bool,
    root: bool,
) -> Result<Pinning, DapoGpuError> {
    if !wait {
        return Ok(Pinning::Running(pinning));
    }
    let r = pinning.wait()?;
    say!(
        root,
        "  pinned host memory reserved before the first switch (--wait-for-pinning): {} in \
         {:.2} s",
        HumanBytes(r.bytes),
        r.seconds
    );
    Ok(Pinning::Done(r))
}

/// The pinned memory reserved at setup: still being pinned, or done.
enum Pinning {
    Running(lifecycle_cuda::PinnedReservation),
    Done(lifecycle_cuda::Reserved),
}

/// What the engine held after the run's exit, and how often its KV cache waited for an
/// overlapped offload's frees.
fn say_engine_after_exit<B: Reshard<Rollout = RolloutBuffer>>(
    lc: &Lifecycle<B, RunEngine>,
    root: bool,
    overlap: bool,
) {
    say!(
        root,
        "  rollout engine after exit: {} on the device (KV cache released; peak while awake {}), \
         {} wakes",
        HumanBytes(lc.engine().memory().device),
        HumanBytes(lc.metrics().peak_engine_bytes()),
        lc.metrics().engine.wakes
    );
    if overlap {
        say!(
            root,
            "  offload overlapped with the rollout: {} KV-cache allocations waited on the device \
             for the offload's frees",
            lc.engine().kv_waits_for_frees()
        );
    }
}

/// How the pinned memory reserved at setup went, for the run's summary.
fn pinned_at_setup(pinning: Pinning) -> Result<String, DapoGpuError> {
    let r = match pinning {
        Pinning::Running(p) => p.wait()?,
        Pinning::Done(r) => r,
    };
    Ok(if r.bytes == 0 {
        "nothing pinned at setup (the memory policy offloads nothing)".to_string()
    } else {
        format!(
            "{} pinned in the background from setup in {:.2} s ({:.1} GB/s), reused by every \
             switch",
            HumanBytes(r.bytes),
            r.seconds,
            r.bytes as f64 / r.seconds.max(1e-9) / 1e9
        )
    })
}

/// The update line of the header.
fn lifecycle_examples_describe<B: lifecycle_core::Reshard, T: policy::Trainer<B>>(
    driver: &GpuDriver<'_, T>,
) -> String {
    driver.trainer.describe()
}

#[cfg(test)]
mod tests;
