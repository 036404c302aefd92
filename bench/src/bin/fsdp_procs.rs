//! The FSDP backend with one process per GPU, launched like PyTorch (torchrun, Slurm or
//! `lifecycle-launch`), or — with no launcher variables — one process with a thread per GPU, so
//! the two modes can be compared on the same machine:
//!
//! 1. correctness: a small model with shapes not divisible by W, resharded at T = 1 and T = W;
//!    each rank compares its rollout slices with the host reference, bit for bit;
//! 2. speed: the Qwen2.5-7B-shaped model (synthetic weights made on the GPUs), resident enters at
//!    T = 1 (all-gather mode, 4 GiB groups) and T = W (send/receive, 256 MiB buckets).
//!
//! At W = 1 the two T are one: each check runs once.
//!
//! ```text
//! lifecycle-launch --nproc-per-node 2 -- fsdp_procs        # one process per GPU
//! fsdp_procs --world 2                                     # one process, a thread per GPU
//! cargo run --release -p lifecycle-bench --bin fsdp_procs -- --world 2 [--layers 28] [--iters 7]
//! ```

use std::error::Error;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use lifecycle_bench::cli::{exit_code, positive};
use lifecycle_bench::timing::median_duration;
use lifecycle_core::{Lifecycle, LifecycleConfig, MemoryPolicy};
use lifecycle_cuda::{RankExecutor, ThreadRankPool};
use lifecycle_dist::RankEnv;
use lifecycle_fsdp::{BucketConfig, FsdpBackend, GatherMode};
use lifecycle_host::{reference_rollout, HostTrainState};
use lifecycle_layout::HostTensor;
use lifecycle_layout::RolloutLayout;

/// The FSDP backend with one process per GPU (launched like PyTorch) or one process with a
/// thread per GPU: rollouts checked bit for bit against the host reference at T = 1 and T = W,
/// then resident enters of the Qwen2.5-7B-shaped model timed at both.
#[derive(Debug, Parser)]
#[command(name = "fsdp_procs")]
struct Cli {
    /// Ranks, one GPU each, with no launcher variables (under a launcher: its world size).
    #[arg(long, default_value_t = 2, value_parser = positive::<usize>)]
    world: usize,
    /// Decoder layers of the 7.6B-shaped model of the speed check.
    #[arg(long, default_value_t = 28, value_parser = positive::<usize>)]
    layers: usize,
    /// Timed enters of each speed figure; the median is reported.
    #[arg(long, default_value_t = 7, value_parser = positive::<usize>)]
    iters: usize,
}

/// The rollout degrees checked at W ranks: 1 and W, once each.
fn rollout_tps(world: usize) -> Vec<usize> {
    let mut tps = vec![1, world];
    tps.dedup();
    tps
}

/// Deterministic values with a spread of magnitudes (identical in every process).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * (1 << (s % 9)) as f32
        })
        .collect()
}

fn small_model() -> Vec<HostTensor> {
    [
        ("model.embed_tokens.weight", vec![98, 24]),
        ("model.layers.0.self_attn.q_proj.weight", vec![30, 24]),
        ("model.layers.0.self_attn.q_proj.bias", vec![30]),
        ("model.layers.0.self_attn.o_proj.weight", vec![24, 30]),
        ("model.layers.0.mlp.down_proj.weight", vec![23, 66]),
        ("model.layers.0.input_layernorm.weight", vec![24]),
        ("lm_head.weight", vec![98, 24]),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (name, shape))| {
        let n = shape.iter().product();
        HostTensor::f32(name, shape, values(i as u64 + 7, n))
    })
    .collect()
}

fn run(pool: Arc<ThreadRankPool>, args: &Cli) -> Result<bool, Box<dyn Error>> {
    let world = pool.world();
    let locals = pool.local_ranks().to_vec();
    let mut all_ok = true;

    // 1. correctness against the host reference
    let tensors = small_model();
    let host = HostTrainState::from_tensors(world, tensors.clone())?;
    for tp in rollout_tps(world) {
        let names = host.layout().tensors().to_vec();
        let layout = RolloutLayout::from_hf_names(tp, names)?;
        let expected = reference_rollout(&host, &layout)?;
        let backend = FsdpBackend::new(pool.clone(), layout);
        let state = backend.state_from_tensors(tensors.clone())?;
        let mut lc = Lifecycle::new(backend, state);
        let got = {
            let session = lc.rollout()?;
            let weights = session.weights();
            session.backend().download_rollout(&weights)?
        };
        for (i, &rank) in locals.iter().enumerate() {
            let same = got.ranks.get(i) == expected.ranks.get(rank);
            all_ok &= same;
            println!(
                "rank {rank}/{world}: T = {tp}: rollout {} the host reference",
                if same {
                    "bit-identical to"
                } else {
                    "DIFFERS from"
                }
            );
        }
    }

    // 2. speed on the 7.6B-shaped model
    let shapes = lifecycle_layout::ModelSpec::qwen2_5_7b(args.layers).hf_tensors();
    let first = FsdpBackend::new(
        pool.clone(),
        RolloutLayout::from_hf_names(1, shapes.clone())?,
    );
    let mut state = first.synthetic_state(&shapes, 1234, 0.02)?;
    for tp in rollout_tps(world) {
        let config = if tp == 1 {
            BucketConfig {
                bucket_bytes: 4 << 30,
                in_flight: 2,
                mode: GatherMode::AllGather,
            }
        } else {
            BucketConfig::default()
        };
        let backend = FsdpBackend::new(
            pool.clone(),
            RolloutLayout::from_hf_names(tp, shapes.clone())?,
        )
        .with_config(config)?;
        let config = LifecycleConfig {
            memory: MemoryPolicy::resident(),
            ..Default::default()
        };
        let mut lc = Lifecycle::with_config(backend, state, config)?;
        lc.enter()?; // warm-up
        lc.exit()?;
        let mut times = Vec::new();
        for _ in 0..args.iters {
            let t = Instant::now();
            lc.enter()?;
            times.push(t.elapsed());
            lc.exit()?;
        }
        let bytes = lc
            .metrics()
            .phase(lifecycle_core::Phase::Transfer)
            .bytes
            .device_to_device
            / lc.metrics()
                .phase(lifecycle_core::Phase::Transfer)
                .count
                .max(1);
        println!(
            "ranks {:?}/{world}: T = {tp} ({:?}, {} MiB buckets): enter median {:.2} ms over {} ({:.3} GB received per enter by these ranks)",
            locals,
            config_mode(tp),
            if tp == 1 { 4096 } else { 256 },
            median_duration(times).unwrap_or_default().as_secs_f64() * 1e3,
            args.iters,
            bytes as f64 / 1e9
        );
        state = lc.into_parts()?.1;
    }
    Ok(all_ok)
}

fn config_mode(tp: usize) -> GatherMode {
    if tp == 1 {
        GatherMode::AllGather
    } else {
        GatherMode::SendRecv
    }
}

fn main() -> ExitCode {
    let args = Cli::parse();
    let pool = match RankEnv::from_env() {
        Ok(Some(env)) => {
            println!(
                "process mode: rank {} of {} on local GPU {}",
                env.rank, env.world_size, env.local_rank
            );
            ThreadRankPool::for_process(&env, Duration::from_secs(120))
        }
        Ok(None) => {
            println!("thread mode: one process, {} ranks", args.world);
            ThreadRankPool::new(args.world)
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let pool = match pool {
        Ok(p) => Arc::new(p),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    exit_code(run(pool, &args))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lifecycle_bench::cli::{assert_parses, assert_refused};

    #[test]
    fn each_rollout_degree_once() {
        assert_eq!(rollout_tps(1), [1]);
        assert_eq!(rollout_tps(2), [1, 2]);
        assert_eq!(rollout_tps(4), [1, 4]);
    }

    #[test]
    fn documented_command_lines() {
        let [d, two, short] =
            assert_parses::<Cli, 3>(["", "--world 2", "--world 1 --layers 2 --iters 3"]);
        assert_eq!((d.world, d.layers, d.iters), (2, 28, 7));
        assert_eq!(two.world, 2);
        assert_eq!((short.world, short.layers, short.iters), (1, 2, 3));
        assert_refused::<Cli>(&["--world 0", "--iters", "--bogus"]);
    }
}
