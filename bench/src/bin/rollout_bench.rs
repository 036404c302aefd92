//! The rollout phase of DAPO steps on one GPU (W = T = 1, Qwen2.5-7B shapes at `--layers`
//! layers, an FSDP training state resident beside the rollout): continuous batching with DAPO's
//! dynamic sampling streamed ([`GroupStream`]: groups submitted as slots free up, scored as they
//! finish, the tail aborted or carried as partial rollouts) against static generation batches
//! (today's `generate`: a batch of whole groups steps every sequence until its longest ends,
//! then the groups are filtered).
//!
//! The requests are DAPO-shaped: groups of `--group` samples of one prompt, sampled at
//! temperature 1 with no stop token, each with its own `max_new_tokens` drawn lognormal (median
//! `--median`, log-sd `--sigma`), capped at `--max-new`. Which groups
//! are kept is a seeded coin per group that ignores length (probability `--keep`), so the
//! modes differ only in scheduling; every mode keeps `--kept-groups` groups per step and sees
//! the same groups in the same order. Reported per step: the rollout phase's time (the switch
//! and the update outside it), samples and tokens generated, and the mean length of kept
//! samples against every finished one (aborting favours short samples). A mode ending in
//! `+mixed` prefills the groups admitted as slots free up in the same pass as the running
//! requests' next tokens (one pass over the weights instead of two; not replayed from a graph).
//!
//! Then, with `--steady N`: `--slots` requests of N tokens each through the continuous engine
//! and through one static batch (decode tokens/s at the same batch); and prefix sharing's
//! saving: the groups' prefill with and without forking the prompt's KV.
//!
//! ```text
//! rollout_bench --layers 4 --kept-groups 8 --steps 2 --modes static,abort,partial --steady 256
//! ```

use lifecycle_layout::settings::Configure;
use std::error::Error;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use lifecycle_core::{Lifecycle, LifecycleConfig, MemoryPolicy, Switching};
use lifecycle_cuda::ThreadRankPool;
use lifecycle_decoder::{
    Filled, GroupStream, KvDtype, Leftovers, Request, Sample, Sampling, SamplingParams, SplitMix64,
};
use lifecycle_decoder_gpu::{EngineSettings, GpuEngine, KV_PAGE_POSITIONS, MAX_CONTEXT};
use lifecycle_fsdp::FsdpBackend;
use lifecycle_layout::fp8::{Fp8Compute, RolloutDtype};

/// The rollout phase of DAPO steps: continuous + streamed against static batches.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Decoder layers of the Qwen2.5-7B shape.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Samples per prompt group.
    #[arg(long, default_value_t = 16)]
    group: usize,
    /// Groups kept per DAPO step.
    #[arg(long, default_value_t = 8)]
    kept_groups: usize,
    /// KV slots (sequences decoded together at most); a static batch holds as many sequences
    /// of `--prompt` + `--max-new` positions as fit the KV cache, at most these.
    #[arg(long, default_value_t = 64)]
    slots: usize,
    /// KV cache positions (pages of `KV_PAGE_POSITIONS`), all sequences together; by default `--slots` ×
    /// (`--prompt` + `--max-new`). Under continuous batching each request holds the pages of
    /// its own length, so a cache smaller than the slots at their longest serves them.
    #[arg(long)]
    kv_tokens: Option<usize>,
    /// Prompt tokens.
    #[arg(long, default_value_t = 128)]
    prompt: usize,
    /// Median of the lognormal `max_new_tokens`.
    #[arg(long, default_value_t = 512.0)]
    median: f64,
    /// Log standard deviation of `max_new_tokens` (1.2: p99 ≈ 16 × the median).
    #[arg(long, default_value_t = 1.2)]
    sigma: f64,
    /// The most tokens a sample may draw (the KV slots hold the prompt and these).
    #[arg(long, default_value_t = 8192)]
    max_new: usize,
    /// Probability that a group is kept (a seeded coin that ignores length).
    #[arg(long, default_value_t = 0.5)]
    keep: f64,
    /// DAPO steps per mode.
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Modes, comma-separated: static, abort, partial; `+mixed` after abort or partial
    /// prefills admitted groups in the passes that feed the running requests (mixed steps)
    /// instead of in passes of their own.
    #[arg(long, default_value = "static,abort,partial", value_delimiter = ',')]
    modes: Vec<String>,
    /// Versions a partial rollout may lag the weights by.
    #[arg(long, default_value_t = 1)]
    max_staleness: u64,
    /// Rollout weights: bf16, or fp8 (W8A8).
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Tokens per request of the steady-state comparison and prefix sharing's (0: skip them).
    #[arg(long, default_value_t = 256)]
    steady: usize,
    /// Seed of the prompts, lengths, draws and coins.
    #[arg(long, default_value_t = 58)]
    seed: u64,
}

/// The requests of DAPO groups, the same for every mode.
struct Workload {
    seed: u64,
    group: usize,
    prompt: usize,
    vocab: u32,
    median: f64,
    sigma: f64,
    max_new: usize,
    keep: f64,
}

impl Workload {
    /// Group `g`'s requests: one prompt, each sample its own lognormal length and seed.
    fn requests(&self, g: u64) -> Vec<Request> {
        let mut p = SplitMix64::from_keys(&[self.seed, 1, g]);
        let prompt: Vec<u32> = (0..self.prompt)
            .map(|_| (p.next_u64() % u64::from(self.vocab)) as u32)
            .collect();
        (0..self.group as u64)
            .map(|j| {
                let mut r = SplitMix64::from_keys(&[self.seed, 2, g, j]);
                // Box–Muller from two uniforms in (0, 1]
                let (u1, u2) = (1.0 - r.next_f32() as f64, r.next_f32() as f64);
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                let len = (self.median * (self.sigma * z).exp()).round() as usize;
                let params = SamplingParams::new(len.clamp(1, self.max_new))
                    .with_temperature(1.0)
                    .with_seed(SamplingParams::seed_of(self.seed, g * 1000 + j));
                Request::new(prompt.clone(), params)
            })
            .collect()
    }

    /// Whether group `g` is kept.
    fn kept(&self, g: u64) -> bool {
        f64::from(SplitMix64::from_keys(&[self.seed, 3, g]).next_f32()) < self.keep
    }
}

/// One mode's step: what the report prints.
#[derive(Debug, Default, Clone)]
struct StepReport {
    secs: f64,
    generated: usize,
    tokens: usize,
    kept_mean: f64,
    finished_mean: f64,
    aborted: usize,
    carried: usize,
    stale: usize,
    passes: u64,
}

impl StepReport {
    fn of(f: &Filled, secs: f64) -> Self {
        StepReport {
            secs,
            generated: f.finished + f.aborted,
            tokens: f.finished_tokens + f.aborted_tokens,
            kept_mean: f.kept_mean_len(),
            finished_mean: f.finished_mean_len(),
            aborted: f.aborted,
            carried: f.carried,
            stale: f.stale,
            passes: f.steps,
        }
    }
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rollout_bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), Box<dyn Error>> {
    let config = lifecycle_bench::models::qwen25_7b(args.layers)?;
    let dtype = match args.dtype.as_str() {
        "bf16" => RolloutDtype::Bf16,
        "fp8" => RolloutDtype::Fp8,
        other => return Err(format!("--dtype {other}: expected bf16 or fp8").into()),
    };
    if args.group == 0 || args.slots < args.group || args.prompt == 0 {
        return Err(
            "--group must be at least 1, --slots at least --group, --prompt at least 1".into(),
        );
    }
    let max_tokens = args.prompt + args.max_new;
    if max_tokens > MAX_CONTEXT {
        return Err(format!("--prompt + --max-new is more than {MAX_CONTEXT} positions").into());
    }
    let kv_tokens = args.kv_tokens.unwrap_or(args.slots * max_tokens);
    // a static batch: whole groups of sequences at their longest, as many as the cache holds
    let static_rows = args
        .slots
        .min(kv_tokens / max_tokens.next_multiple_of(KV_PAGE_POSITIONS));
    if static_rows < args.group {
        return Err(format!(
            "--kv-tokens {kv_tokens} holds {static_rows} sequences of {max_tokens} positions: \
             fewer than a group of {}",
            args.group
        )
        .into());
    }
    let work = Workload {
        seed: args.seed,
        group: args.group,
        prompt: args.prompt,
        vocab: config.model.vocab as u32,
        median: args.median,
        sigma: args.sigma,
        max_new: args.max_new,
        keep: args.keep,
    };
    let mut lens: Vec<usize> = (0..64)
        .flat_map(|g| work.requests(g))
        .map(|r| r.params.max_new_tokens)
        .collect();
    lens.sort_unstable();
    let q = |p: f64| lens[((lens.len() - 1) as f64 * p) as usize];
    println!(
        "Qwen2.5-7B shape, {} layers, {} rollout, bf16 KV of {kv_tokens} positions, {} slots of up \
         to {max_tokens} positions; \
         groups of {} samples, {}-token prompts, max_new_tokens lognormal: median {}, p90 {}, \
         p99 {}, max {} (capped at {} by the slot); keep probability {}, {} groups kept per step",
        args.layers,
        args.dtype,
        args.slots,
        args.group,
        args.prompt,
        q(0.5),
        q(0.9),
        q(0.99),
        lens[lens.len() - 1],
        work.max_new,
        args.keep,
        args.kept_groups,
    );
    let pool = Arc::new(ThreadRankPool::new(1)?);
    let shapes = config.tensor_shapes();
    let backend =
        FsdpBackend::new(pool.clone(), config.rollout_layout(1)?).with_rollout_dtype(dtype);
    let state = backend.synthetic_state(&shapes, 7, 0.02)?;
    let settings = EngineSettings::new(args.slots, max_tokens)
        .with_kv_tokens(kv_tokens)
        .with_kv_dtype(KvDtype::Bf16)
        .with_fp8_compute(Fp8Compute::W8A8)
        .with_fork_prefill(true);
    let engine = GpuEngine::for_backend(&backend, &config, settings)?;
    let lc_config = LifecycleConfig {
        switching: Switching::Lazy,
        memory: MemoryPolicy::resident(),
    };
    let mut lc = Lifecycle::with_config(backend, state, lc_config)?.with_engine(engine);
    let mut summary = Vec::new();
    for mode in &args.modes {
        let mut reports = Vec::new();
        let mut next_group = 0u64;
        let (base, mixed) = match mode.strip_suffix("+mixed") {
            Some(base) => (base, true),
            None => (mode.as_str(), false),
        };
        let leftovers = match base {
            "static" if !mixed => None,
            "abort" => Some(Leftovers::Abort),
            "partial" => Some(Leftovers::Partial {
                max_staleness: args.max_staleness,
            }),
            _ => {
                return Err(format!(
                    "--modes {mode}: expected static, abort, partial, abort+mixed or \
                     partial+mixed"
                )
                .into())
            }
        };
        let mut stream = leftovers.map(|l| GroupStream::new(args.group, l).with_mixed_steps(mixed));
        for step in 0..args.steps {
            // an update between steps: the next rollout is on new weights
            lc.train()?.state_mut();
            let mut session = lc.rollout()?;
            let version = session.weights().version();
            let (weights, mut engine) = session.parts();
            let report = match stream.as_mut() {
                None => {
                    let static_groups = (static_rows / args.group).max(1);
                    let t = Instant::now();
                    let (mut kept, mut generated, mut tokens, mut passes) = (0, 0, 0, 0u64);
                    let (mut kept_tokens, mut kept_n) = (0usize, 0usize);
                    // each sample's own length (a static batch steps it to the longest, then
                    // it is cut to its max_new_tokens)
                    let mut own_tokens = 0usize;
                    while kept < args.kept_groups {
                        let groups: Vec<u64> =
                            (next_group..next_group + static_groups as u64).collect();
                        next_group += static_groups as u64;
                        let reqs: Vec<Request> =
                            groups.iter().flat_map(|&g| work.requests(g)).collect();
                        let longest = reqs
                            .iter()
                            .map(|r| r.params.max_new_tokens)
                            .max()
                            .unwrap_or(1);
                        let prompts: Vec<Vec<u32>> =
                            reqs.iter().map(|r| r.prompt.clone()).collect();
                        let sampling = Sampling {
                            temperature: 1.0,
                            max_new_tokens: longest,
                            seed: args.seed + step as u64,
                            stop_token: None,
                        };
                        let out = engine.generate(weights, &prompts, &sampling)?;
                        generated += out.len();
                        tokens += out.iter().map(Vec::len).sum::<usize>();
                        own_tokens += reqs.iter().map(|r| r.params.max_new_tokens).sum::<usize>();
                        passes += longest as u64;
                        for (i, &g) in groups.iter().enumerate() {
                            if work.kept(g) && kept < args.kept_groups {
                                kept += 1;
                                for r in &reqs[i * args.group..(i + 1) * args.group] {
                                    kept_tokens += r.params.max_new_tokens;
                                    kept_n += 1;
                                }
                            }
                        }
                    }
                    let secs = t.elapsed().as_secs_f64();
                    // a static batch's samples are cut to their own lengths after the fact
                    StepReport {
                        secs,
                        generated,
                        tokens,
                        kept_mean: kept_tokens as f64 / kept_n.max(1) as f64,
                        finished_mean: own_tokens as f64 / generated.max(1) as f64,
                        passes,
                        ..StepReport::default()
                    }
                }
                Some(stream) => {
                    stream.set_version(version)?;
                    let t = Instant::now();
                    let mut slots = engine.slots(&weights)?;
                    let filled = stream.fill(
                        &mut slots,
                        args.kept_groups,
                        |g| Ok(work.requests(g)),
                        |g, _: &[Sample]| Ok(work.kept(g)),
                    )?;
                    StepReport::of(&filled, t.elapsed().as_secs_f64())
                }
            };
            session.finish()?;
            println!(
                "{mode:>13} step {step} (weights v{version}): rollout {:.2} s, {} samples / {} \
                 tokens generated, {} decode passes; kept samples' mean length {:.0}, finished \
                 samples' {:.0}; {} aborted, {} carried, {} stale",
                report.secs,
                report.generated,
                report.tokens,
                report.passes,
                report.kept_mean,
                report.finished_mean,
                report.aborted,
                report.carried,
                report.stale,
            );
            reports.push(report);
        }
        let mean = reports.iter().map(|r| r.secs).sum::<f64>() / reports.len().max(1) as f64;
        summary.push((mode.clone(), mean));
    }
    if let Some(&(_, base)) = summary.iter().find(|(m, _)| m == "static") {
        for (mode, secs) in &summary {
            println!(
                "{mode:>13}: {secs:.2} s per step's rollout, {:.2}× static",
                secs / base
            );
        }
    }
    if args.steady > 0 {
        steady(&mut lc, &work, args)?;
    }
    Ok(())
}

/// Decode tokens/s of `--slots` requests of `--steady` tokens through the continuous engine and
/// through one static batch; then the groups' prefill with and without prefix sharing.
fn steady(
    lc: &mut Lifecycle<FsdpBackend, GpuEngine>,
    work: &Workload,
    args: &Args,
) -> Result<(), Box<dyn Error>> {
    let n = args.steady;
    let groups = (args.slots / args.group).max(1) as u64;
    let reqs: Vec<Request> = (0..groups)
        .flat_map(|g| work.requests(1_000_000 + g))
        .map(|mut r| {
            r.params.max_new_tokens = n;
            r
        })
        .collect();
    let prompts: Vec<Vec<u32>> = reqs.iter().map(|r| r.prompt.clone()).collect();
    let sampling = Sampling {
        temperature: 1.0,
        max_new_tokens: n,
        seed: args.seed,
        stop_token: None,
    };
    let mut session = lc.rollout()?;
    let (weights, mut engine) = session.parts();
    // warm: graphs captured for the batch's bucket
    engine.run(weights, reqs.clone())?;
    engine.generate(weights, &prompts, &sampling)?;
    let t = Instant::now();
    let cont = engine.run(weights, reqs.clone())?;
    let t_cont = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let stat = engine.generate(weights, &prompts, &sampling)?;
    let t_stat = t.elapsed().as_secs_f64();
    let tokens = |k: usize| (k * n) as f64;
    println!(
        "steady state, {} requests of {n} tokens: continuous {:.0} tokens/s, static batch {:.0} \
         tokens/s ({:.3}×; {} and {} tokens)",
        reqs.len(),
        tokens(cont.len()) / t_cont,
        tokens(stat.len()) / t_stat,
        t_stat / t_cont,
        cont.iter().map(|s| s.tokens.len()).sum::<usize>(),
        stat.iter().map(Vec::len).sum::<usize>(),
    );
    // prefix sharing: the groups' prefill (one token each) with and without forking
    let one: Vec<Request> = reqs
        .iter()
        .map(|r| Request::new(r.prompt.clone(), SamplingParams::new(1)))
        .collect();
    let mut times = Vec::new();
    for fork in [true, false, true, false] {
        engine.set_fork_prefill(fork);
        let t = Instant::now();
        engine.run(weights, one.clone())?;
        times.push((fork, t.elapsed().as_secs_f64()));
    }
    engine.set_fork_prefill(true);
    let best = |f: bool| {
        times
            .iter()
            .filter(|t| t.0 == f)
            .map(|t| t.1)
            .fold(f64::INFINITY, f64::min)
    };
    println!(
        "prefix sharing: {} prompts of {} tokens in groups of {}: prefill {:.2} ms forked, {:.2} \
         ms each prefilled ({:.2}× faster)",
        one.len(),
        args.prompt,
        args.group,
        best(true) * 1e3,
        best(false) * 1e3,
        best(false) / best(true)
    );
    session.finish()?;
    Ok(())
}
