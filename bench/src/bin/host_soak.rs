//! Soak of the host backend in verification mode: many enter / exit cycles (with an update every
//! few cycles), each rollout compared bit for bit with the direct reference and the master weights
//! and optimizer state compared before and after each cycle; then the same cycles without
//! verification, to measure its overhead.
//!
//! ```text
//! cargo run --release -p lifecycle-bench --bin host_soak -- --cycles 1000
//! ```

use lifecycle_layout::settings::Configure;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use lifecycle_bench::cli::exit_code;
use lifecycle_core::{HumanDuration, Lifecycle};
use lifecycle_examples::toy_policy::PolicyConfig;
use lifecycle_host::{reference_rollout, HostBackend, HostTrainState};

/// Host soak with checksums.
#[derive(Debug, Parser)]
#[command(name = "host_soak")]
struct Cli {
    /// Switch cycles per run.
    #[arg(long, default_value_t = 1000)]
    cycles: u64,
    /// Ranks.
    #[arg(long, default_value_t = 2)]
    world: usize,
    /// Rollout TP degree.
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Hidden size of the model (params grow with its square).
    #[arg(long, default_value_t = 256)]
    hidden: usize,
}

fn preserved(s: &HostTrainState) -> Vec<Vec<u32>> {
    s.snapshot()
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % 4 != 1)
        .map(|(_, v)| v)
        .collect()
}

/// Runs the cycles; returns (mismatches, switch time).
fn soak(
    args: &Cli,
    policy: &PolicyConfig,
    verify: bool,
) -> Result<(u64, Duration), Box<dyn std::error::Error>> {
    let layout = policy.rollout_layout(args.tp)?;
    let state = HostTrainState::from_tensors(args.world, policy.init(3))?;
    let mut lc = Lifecycle::new(
        HostBackend::new(layout.clone()).with_verification(verify),
        state,
    );
    let mut mismatches = 0;
    for cycle in 0..args.cycles {
        if cycle % 10 == 0 {
            lc.train()?.state_mut().for_each_shard_mut(|s| {
                s.master.iter_mut().for_each(|w| *w = -*w * 0.999);
            })?;
        }
        let before = preserved(lc.train()?.state());
        if verify {
            let expected = reference_rollout(lc.peek_state(), &layout)?;
            let s = lc.rollout()?;
            if s.weights().first_difference(&expected).is_some() {
                mismatches += 1;
            }
        } else {
            lc.enter()?;
        }
        let after = preserved(lc.train()?.state());
        if before != after {
            mismatches += 1;
        }
        if (cycle + 1) % 100 == 0 || cycle + 1 == args.cycles {
            eprintln!(
                "  {} cycle {}/{}: {} mismatches, switch time so far {}",
                if verify { "verified" } else { "plain" },
                cycle + 1,
                args.cycles,
                mismatches,
                HumanDuration(lc.metrics().switch_time())
            );
        }
    }
    Ok((mismatches, lc.metrics().switch_time()))
}

fn main() -> ExitCode {
    let args = Cli::parse();
    let policy = PolicyConfig {
        vocab: 64,
        hidden: args.hidden,
        ffn: 4 * args.hidden,
        layers: 2,
    };
    println!(
        "host soak: {} cycles, W = {}, T = {}, {} params, master + Adam offloaded each cycle",
        args.cycles,
        args.world,
        args.tp,
        policy.params()
    );
    let start = Instant::now();
    let verified = soak(&args, &policy, true);
    let plain = soak(&args, &policy, false);
    exit_code(verified.and_then(|(bad, t_on)| {
        let (_, t_off) = plain?;
        println!(
            "verification on: {} mismatches in {} cycles; switch time {} ({} per cycle)",
            bad,
            args.cycles,
            HumanDuration(t_on),
            HumanDuration(t_on / args.cycles.max(1) as u32)
        );
        println!(
            "verification off: switch time {} ({} per cycle); overhead of verification {:.1}%",
            HumanDuration(t_off),
            HumanDuration(t_off / args.cycles.max(1) as u32),
            100.0 * (t_on.as_secs_f64() / t_off.as_secs_f64() - 1.0)
        );
        println!("total {}", HumanDuration(start.elapsed()));
        Ok(bad == 0)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lifecycle_bench::cli::assert_parses;

    #[test]
    fn documented_command_lines() {
        let [d, long] = assert_parses::<Cli, 2>(["", "--cycles 1000 --hidden 128"]);
        assert_eq!((d.cycles, d.world, d.tp, d.hidden), (1000, 2, 2, 256));
        assert_eq!((long.cycles, long.hidden), (1000, 128));
    }
}
