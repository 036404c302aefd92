//! Soak of the FSDP backend on GPUs in verification mode: many enter / exit cycles with the
//! master weights and Adam m, v offloaded to pinned host memory and reloaded each cycle, every
//! offloaded buffer and the rollout weights hashed on the devices and checked; the first rollout
//! compared bit for bit with the host's `reference_rollout`, later ones with the first, and the
//! training state compared before and after. The same cycles without verification run first, to
//! measure its overhead (steady state: the first cycle, which allocates the pinned buffers and
//! compiles the verification kernels, is reported apart).
//!
//! Before the soak it measures what the non-blocking communicators cost per NCCL operation
//! (small all-reduces and grouped send/receive pairs, blocking vs non-blocking communicators).
//!
//! ```text
//! export NCCL_NVLS_ENABLE=0
//! cargo run --release -p lifecycle-bench --bin fsdp_soak -- [--cycles 100] [--layers 6]
//!     [--hidden 2048] [--world 2] [--tp W] [--skip-launch-bench]
//! ```
//!
//! The model is Qwen-shaped (hidden `h`, MLP `5.5 h`, kv `h / 8`, vocabulary 32 000, untied
//! head), generated on the GPUs (`FsdpBackend::synthetic_state`).

use lifecycle_layout::settings::Configure;
use std::error::Error;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use lifecycle_bench::cli::{exit_code, positive};
use lifecycle_core::{HumanDuration, Lifecycle};
use lifecycle_cuda::cudarc::nccl::ReduceOp;
use lifecycle_cuda::{
    alloc_zeros, check_environment, CollectiveSettings, RankExecutor, ThreadRankPool,
};
use lifecycle_fsdp::{FsdpBackend, FsdpTrainState, RankDump};
use lifecycle_host::{reference_rollout, HostTrainState};
use lifecycle_layout::RolloutLayout;

/// Soak of the FSDP backend on GPUs in verification mode: enter / exit cycles with the master
/// weights and Adam state offloaded and reloaded each cycle, the rollout weights and the
/// training state checked bit for bit, and the same cycles without verification to measure its
/// overhead.
#[derive(Debug, Parser)]
#[command(name = "fsdp_soak")]
struct Cli {
    /// Enter / exit cycles of each soak.
    #[arg(long, default_value_t = 100, value_parser = positive::<u64>)]
    cycles: u64,
    /// Decoder layers of the model.
    #[arg(long, default_value_t = 6, value_parser = positive::<usize>)]
    layers: usize,
    /// Hidden size of the model: a multiple of 64 (heads of 64, kv = hidden / 8).
    #[arg(long, default_value_t = 2048, value_parser = hidden_size)]
    hidden: usize,
    /// Ranks, one GPU each.
    #[arg(long, default_value_t = 2, value_parser = positive::<usize>)]
    world: usize,
    /// Rollout tensor-parallel degree [default: W].
    #[arg(long, value_name = "T", value_parser = positive::<usize>)]
    tp: Option<usize>,
    /// Skip the measurement of what the non-blocking communicators cost per NCCL operation.
    #[arg(long)]
    skip_launch_bench: bool,
}

impl Cli {
    /// The rollout tensor-parallel degree: `--tp`, or W.
    fn tp(&self) -> usize {
        self.tp.unwrap_or(self.world)
    }
}

/// Parses `--hidden`: a positive multiple of 64.
fn hidden_size(s: &str) -> Result<usize, String> {
    let h = positive::<usize>(s)?;
    if h.is_multiple_of(64) {
        Ok(h)
    } else {
        Err(format!(
            "must be a multiple of 64 (heads of 64, kv = hidden / 8), found {h}"
        ))
    }
}

/// Qwen-shaped parameter names and shapes: hidden `h` (a multiple of 64), MLP `11h / 2`, kv
/// width `h / 8`, vocabulary 32000, q/k/v biases, untied head.
fn model(layers: usize, h: usize) -> Vec<(String, Vec<usize>)> {
    lifecycle_layout::ModelSpec {
        hidden: h,
        heads: h / 8,
        query_groups: h / 64,
        head_dim: 8,
        ffn: h * 11 / 2,
        vocab: 32_000,
        layers,
        qkv_bias: true,
        tied_embeddings: false,
        make_vocab_size_divisible_by: 128,
        qk_norm: false,
        moe: None,
    }
    .hf_tensors()
}

fn host_twin(
    backend: &FsdpBackend,
    state: &FsdpTrainState,
) -> Result<HostTrainState, Box<dyn Error>> {
    Ok(HostTrainState::from_tensors(
        state.world(),
        backend.full_masters(state)?,
    )?)
}

fn same(a: &[RankDump], b: &[RankDump]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.same_bits(y))
}

struct Outcome {
    mismatches: u64,
    /// Switch time of the first cycle (pinned allocations, kernel compilation).
    first: Duration,
    /// Switch time of the other cycles.
    steady: Duration,
    summary: String,
}

impl Outcome {
    fn per_cycle(&self, cycles: u64) -> Duration {
        self.steady / cycles.saturating_sub(1).max(1) as u32
    }
}

fn soak(
    args: &Cli,
    pool: &Arc<ThreadRankPool>,
    layout: &RolloutLayout,
    shapes: &[(String, Vec<usize>)],
    verify: bool,
) -> Result<Outcome, Box<dyn Error>> {
    let label = if verify { "verified" } else { "plain" };
    let setup = Instant::now();
    let backend = FsdpBackend::new(pool.clone(), layout.clone()).with_verification(verify);
    let state = backend.synthetic_state(shapes, 17, 0.02)?;
    let mut mismatches = 0u64;
    let checks = if verify {
        let before = backend.download_state(&state)?;
        let reference = reference_rollout(&host_twin(&backend, &state)?, layout)?;
        Some((before, reference))
    } else {
        None
    };
    eprintln!(
        "  {label}: state{} ready in {}",
        if verify { " and host reference" } else { "" },
        HumanDuration(setup.elapsed())
    );
    // Default policy: lazy switching, master weights and Adam m, v offloaded during rollout.
    let mut lc = Lifecycle::new(backend, state);
    let mut first = None;
    let mut first_cycle = Duration::ZERO;
    for cycle in 0..args.cycles {
        let result = (|| -> Result<(), Box<dyn Error>> {
            let s = lc.rollout()?;
            if let Some((_, reference)) = &checks
                && (cycle % 25 == 0 || cycle + 1 == args.cycles)
            {
                let got = s.backend().download_rollout(&s.weights())?;
                let against = first.as_ref().unwrap_or(reference);
                if let Some((rank, tensor)) = got.first_difference(against) {
                    eprintln!("  cycle {cycle}: rollout differs on rank {rank}, {tensor}");
                    mismatches += 1;
                }
                first.get_or_insert(got);
            }
            drop(s);
            let t = lc.train()?;
            if t.state().master_offloaded() || t.state().optimizer_offloaded() {
                return Err("the training state is not back on the device after exit".into());
            }
            Ok(())
        })();
        if let Err(e) = result {
            eprintln!("  {label} cycle {cycle}: {e}");
            mismatches += 1;
            break;
        }
        if cycle == 0 {
            first_cycle = lc.metrics().switch_time();
        }
        if (cycle + 1) % 25 == 0 || cycle + 1 == args.cycles {
            eprintln!(
                "  {label} cycle {}/{}: {} mismatches, switch time so far {}",
                cycle + 1,
                args.cycles,
                mismatches,
                HumanDuration(lc.metrics().switch_time())
            );
        }
    }
    let switch_time = lc.metrics().switch_time();
    let summary = lc.metrics().summary_line();
    if let Some((before, _)) = &checks {
        let after = lc.backend().download_state(lc.peek_state())?;
        if !same(before, &after) {
            eprintln!("  the training state changed over the soak");
            mismatches += 1;
        }
    }
    Ok(Outcome {
        mismatches,
        first: first_cycle,
        steady: switch_time.saturating_sub(first_cycle),
        summary,
    })
}

/// Mean time per operation (slowest rank) of `ops` back-to-back small NCCL operations, enqueue
/// and completion: (all-reduce of 4 KB, grouped send + receive of 4 KB with the next rank).
fn launch_cost(world: usize, nonblocking: bool, ops: usize) -> Result<(f64, f64), Box<dyn Error>> {
    let settings = CollectiveSettings {
        nonblocking,
        ..CollectiveSettings::from_env()?
    };
    let pool = ThreadRankPool::with_settings(world, settings)?;
    let times = pool.run(&|ctx| {
        let mut a = alloc_zeros::<f32>(&ctx.compute, 1024, ctx.rank, "all-reduce buffer")?;
        let b = alloc_zeros::<f32>(&ctx.compute, 1024, ctx.rank, "send buffer")?;
        let mut c = alloc_zeros::<f32>(&ctx.compute, 1024, ctx.rank, "receive buffer")?;
        let nccl = ctx.nccl_stream();
        ctx.order(&ctx.compute, &nccl)?;
        let (next, prev) = ((ctx.rank + 1) % world, (ctx.rank + world - 1) % world);
        let pair = |b: &lifecycle_cuda::cudarc::driver::CudaSlice<f32>,
                    c: &mut lifecycle_cuda::cudarc::driver::CudaSlice<f32>|
         -> Result<(), lifecycle_cuda::CudaError> {
            ctx.group_start()?;
            let sent = ctx.comm.send(b, next as i32);
            let got = ctx.comm.recv(c, prev as i32);
            let end = ctx.group_end();
            sent?;
            got?;
            end
        };
        for _ in 0..20 {
            ctx.comm.all_reduce_in_place(&mut a, &ReduceOp::Sum)?;
            pair(&b, &mut c)?;
        }
        ctx.wait(&[&nccl], "warm-up")?;
        let t = Instant::now();
        for _ in 0..ops {
            ctx.comm.all_reduce_in_place(&mut a, &ReduceOp::Sum)?;
        }
        ctx.wait(&[&nccl], "all-reduces")?;
        let ar = t.elapsed().as_secs_f64() / ops as f64;
        let t = Instant::now();
        for _ in 0..ops {
            pair(&b, &mut c)?;
        }
        ctx.wait(&[&nccl], "send/receive pairs")?;
        let p2p = t.elapsed().as_secs_f64() / ops as f64;
        ctx.order(&nccl, &ctx.compute)?;
        Ok((ar, p2p))
    })?;
    Ok(times
        .iter()
        .fold((0.0, 0.0), |m, t| (f64::max(m.0, t.0), f64::max(m.1, t.1))))
}

fn run(args: &Cli) -> Result<bool, Box<dyn Error>> {
    check_environment(args.world)?;
    if !args.skip_launch_bench && args.world > 1 {
        let ops = 500;
        let blocking = launch_cost(args.world, false, ops)?;
        let nonblocking = launch_cost(args.world, true, ops)?;
        let us = |s: f64| s * 1e6;
        println!(
            "NCCL cost per operation, W = {}, 4 KB, {ops} back to back (enqueue + completion): \
             all-reduce {:.1} µs blocking vs {:.1} µs non-blocking; grouped send + receive \
             {:.1} µs vs {:.1} µs",
            args.world,
            us(blocking.0),
            us(nonblocking.0),
            us(blocking.1),
            us(nonblocking.1)
        );
    }
    let pool = Arc::new(ThreadRankPool::new(args.world)?);
    let shapes = model(args.layers, args.hidden);
    let layout = RolloutLayout::from_hf_names(args.tp(), shapes.clone())?;
    let params: usize = shapes
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let per_rank = params.div_ceil(args.world) as f64 * 4.0 / 1e9;
    println!(
        "fsdp soak: {} cycles, W = {}, T = {}, {} layers × hidden {}: {:.1} M params ({:.2} GB \
         fp32 per rank and buffer), master + Adam offloaded and reloaded each cycle; deadline {}",
        args.cycles,
        args.world,
        args.tp(),
        args.layers,
        args.hidden,
        params as f64 / 1e6,
        per_rank,
        HumanDuration(pool.collective_timeout())
    );
    let total = Instant::now();
    let c = args.cycles;
    let off = soak(args, &pool, &layout, &shapes, false)?;
    println!(
        "verification off: first cycle {}, then {} per cycle ({} for {} cycles)",
        HumanDuration(off.first),
        HumanDuration(off.per_cycle(c)),
        HumanDuration(off.steady),
        c.saturating_sub(1)
    );
    println!("  {}", off.summary);
    let on = soak(args, &pool, &layout, &shapes, true)?;
    println!(
        "verification on:  {} mismatches in {c} cycles; first cycle {}, then {} per cycle ({} for \
         {} cycles)",
        on.mismatches,
        HumanDuration(on.first),
        HumanDuration(on.per_cycle(c)),
        HumanDuration(on.steady),
        c.saturating_sub(1)
    );
    println!("  {}", on.summary);
    println!(
        "overhead of verification (switch time per cycle, steady state): {:+.1}%",
        100.0 * (on.per_cycle(c).as_secs_f64() / off.per_cycle(c).as_secs_f64() - 1.0)
    );
    println!("total {}", HumanDuration(total.elapsed()));
    Ok(on.mismatches == 0 && off.mismatches == 0)
}

fn main() -> ExitCode {
    exit_code(run(&Cli::parse()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lifecycle_bench::cli::{assert_parses, assert_refused};

    #[test]
    fn documented_command_lines() {
        let [d, soak, wide, one] = assert_parses::<Cli, 4>([
            "",
            "--cycles 100 --skip-launch-bench",
            "--world 4 --tp 2 --hidden 1024",
            "--world 1",
        ]);
        assert_eq!(
            (d.cycles, d.layers, d.hidden, d.world, d.tp()),
            (100, 6, 2048, 2, 2)
        );
        assert!(!d.skip_launch_bench && soak.skip_launch_bench);
        assert_eq!((wide.world, wide.tp(), wide.hidden), (4, 2, 1024));
        assert_eq!(one.tp(), 1);
        assert_refused::<Cli>(&[
            "--hidden 1000",
            "--hidden 0",
            "--cycles 0",
            "--tp 0",
            "--bogus",
        ]);
    }
}
