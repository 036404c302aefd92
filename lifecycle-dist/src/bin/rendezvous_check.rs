//! Joins the rendezvous as the launcher says and prints the shared id: a check that every rank
//! of a job receives the same bytes. Rank 0 makes a 128-byte id (the size of an NCCL unique id).
//! Under torchrun the ranks meet in torchrun's agent store, otherwise rank 0 hosts the rendezvous.
//!
//! ```text
//! lifecycle-launch --nproc-per-node 4 -- rendezvous-check
//! torchrun --nproc_per_node=4 --no-python rendezvous-check
//! srun --ntasks=8 --ntasks-per-node=4 rendezvous-check --timeout-ms 60000
//! ```

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use lifecycle_dist::{share_from_root, RankEnv};

/// Joins the rendezvous as the launcher says and prints the id rank 0 shared: every rank of the
/// job must print the same digest.
#[derive(Debug, Parser)]
#[command(name = "rendezvous-check")]
struct Cli {
    /// How long a rank waits for the others, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    timeout_ms: u64,
}

fn main() -> ExitCode {
    let timeout_ms = Cli::parse().timeout_ms;
    let env = match RankEnv::from_env() {
        Ok(Some(env)) => env,
        Ok(None) => {
            eprintln!("no launcher variables: start under lifecycle-launch, torchrun or srun");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let make_id = || {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id());
        (0..128u64)
            .map(|i| (seed.rotate_left(i as u32 % 64) >> (i % 8)) as u8)
            .collect()
    };
    match share_from_root(&env, make_id, Duration::from_millis(timeout_ms)) {
        Ok(id) => {
            let digest = id.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
            });
            println!(
                "rank {}/{}: id {digest:016x} ({} bytes)",
                env.rank,
                env.world_size,
                id.len()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rank {}: error: {e}", env.rank);
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn command_line() {
        Cli::command().debug_assert();
        assert_eq!(Cli::parse_from(["rendezvous-check"]).timeout_ms, 30_000);
        let cli = Cli::parse_from(["rendezvous-check", "--timeout-ms", "60000"]);
        assert_eq!(cli.timeout_ms, 60_000);
    }
}
