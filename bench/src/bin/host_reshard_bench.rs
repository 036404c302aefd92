//! Host reshard throughput vs a plain memcpy of the same bytes on this machine.
//!
//! The transfer phase writes every rank's bf16 rollout slices from fp32 master shards (reading 4
//! bytes and writing 2 per element). The baseline copies the same number of output bytes with
//! `copy_from_slice`, one thread per rank like the backend. Ratio = memcpy time / reshard time
//! (1.0 = as fast as memcpy of the output bytes).
//!
//! ```text
//! cargo run --release -p lifecycle-bench --bin host_reshard_bench -- --params 100000000 --world 2
//! ```

use std::time::{Duration, Instant};

use clap::Parser;
use lifecycle_core::{HumanBytes, HumanDuration, Lifecycle, LifecycleConfig, MemoryPolicy, Phase};
use lifecycle_examples::rng::SplitMix64;
use lifecycle_host::{HostBackend, HostTrainState};
use lifecycle_layout::HostTensor;
use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};

/// Host reshard throughput benchmark.
#[derive(Debug, Parser)]
#[command(name = "host_reshard_bench")]
struct Cli {
    /// Approximate parameter count of the synthetic model.
    #[arg(long, default_value_t = 64_000_000)]
    params: usize,
    /// Ranks (threads).
    #[arg(long, default_value_t = 2)]
    world: usize,
    /// Repetitions; the best is reported.
    #[arg(long, default_value_t = 10)]
    reps: usize,
}

/// Decoder-like tensors: blocks of column-parallel [4h, h], row-parallel [h, 4h] and a norm.
fn specs(params: usize, world: usize) -> Vec<TensorSpec> {
    let h = 1024;
    let blocks = (params / (8 * h * h)).max(1);
    let mut s = Vec::new();
    for b in 0..blocks {
        // h + 1 rows: shards are uneven
        s.push(TensorSpec::new(
            format!("b{b}.up"),
            [4 * h * world, h],
            Parallel::Column,
        ));
        s.push(TensorSpec::new(
            format!("b{b}.down"),
            [h + 1, 4 * h * world],
            Parallel::Row,
        ));
        s.push(TensorSpec::new(
            format!("b{b}.norm"),
            [h],
            Parallel::Replicated,
        ));
    }
    s
}

fn memcpy_time(bytes_per_rank: &[usize]) -> Duration {
    let src: Vec<Vec<u16>> = bytes_per_rank.iter().map(|b| vec![1u16; b / 2]).collect();
    let mut dst: Vec<Vec<u16>> = bytes_per_rank.iter().map(|b| vec![0u16; b / 2]).collect();
    // fault the destination pages in first: the reshard's in-place refresh writes warm buffers too
    dst.iter_mut().for_each(|d| d.fill(2));
    let start = Instant::now();
    std::thread::scope(|scope| {
        for (d, s) in dst.iter_mut().zip(&src) {
            scope.spawn(move || d.copy_from_slice(s));
        }
    });
    let t = start.elapsed();
    assert!(dst.iter().all(|d| d.first() == Some(&1)));
    t
}

fn main() {
    let args = Cli::parse();
    let specs = specs(args.params, args.world);
    let params: usize = specs.iter().map(TensorSpec::numel).sum();
    println!(
        "host reshard benchmark: {params} params, W = {}, {} threads available",
        args.world,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    let mut rng = SplitMix64::new(7);
    let tensors: Vec<HostTensor> = specs
        .iter()
        .map(|s| {
            HostTensor::f32(
                s.name.clone(),
                s.shape.clone(),
                (0..s.numel()).map(|_| rng.symmetric(1.0)).collect(),
            )
        })
        .collect();
    let state = match HostTrainState::from_tensors(args.world, tensors) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let mut state = Some(state);
    for tp in (1..=args.world).filter(|t| args.world % t == 0) {
        let layout = match RolloutLayout::new(tp, specs.clone()) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        };
        let config = LifecycleConfig {
            memory: MemoryPolicy {
                keep_rollout_resident: true,
                ..MemoryPolicy::resident()
            },
            ..Default::default()
        };
        let Some(s) = state.take() else { return };
        let mut lc = match Lifecycle::with_config(HostBackend::new(layout), s, config) {
            Ok(lc) => lc,
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        };
        // enter allocates the rollout buffers; each later round bumps the version and refreshes
        // them in place (the steady state of a training loop that keeps them resident)
        let mut enter = Duration::ZERO;
        let mut best = Duration::MAX;
        let mut copy = Duration::MAX;
        let mut out_bytes = Vec::new();
        for rep in 0..=args.reps {
            lc.reset_metrics();
            if rep > 0
                && let Ok(mut train) = lc.train()
            {
                let _ = train.state_mut();
            }
            if let Err(e) = lc.enter() {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
            let wall = lc.metrics().phase(Phase::Transfer).wall;
            if rep == 0 {
                enter = wall;
                out_bytes = lc
                    .rollout()
                    .map(|s| {
                        s.weights()
                            .ranks
                            .iter()
                            .map(|r| r.bytes() as usize)
                            .collect()
                    })
                    .unwrap_or_default();
            } else {
                best = best.min(wall);
                // the baseline runs between the reshard rounds, under the same machine load
                copy = copy.min(memcpy_time(&out_bytes));
            }
        }
        let total: usize = out_bytes.iter().sum();
        println!(
            "T = {tp}: enter (allocating) {}; in-place reshard {} of bf16 in {} ({:.2} GB/s written); \
             memcpy of the same bytes {} ({:.2} GB/s); ratio {:.2} (goal >= 0.5)",
            HumanDuration(enter),
            HumanBytes(total as u64),
            HumanDuration(best),
            total as f64 / best.as_secs_f64() / 1e9,
            HumanDuration(copy),
            total as f64 / copy.as_secs_f64() / 1e9,
            copy.as_secs_f64() / best.as_secs_f64(),
        );
        state = lc.into_parts().ok().map(|(_, s)| s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lifecycle_bench::cli::assert_parses;

    #[test]
    fn documented_command_lines() {
        let [d, big] = assert_parses::<Cli, 2>(["", "--params 100000000 --world 2"]);
        assert_eq!((d.params, d.world, d.reps), (64_000_000, 2, 10));
        assert_eq!((big.params, big.world), (100_000_000, 2));
    }
}
