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

use lifecycle_dist::{share_from_root, RankEnv};

fn main() -> ExitCode {
    let timeout_ms: u64 = std::env::args()
        .skip_while(|a| a != "--timeout-ms")
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(30_000);
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
