//! One process per GPU, launched like PyTorch jobs.
//!
//! - [`RankEnv`] reads the rank, world size, local rank and rendezvous address from the variables
//!   torchrun sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//!   `MASTER_PORT`) or from Slurm's (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the first
//!   node of `SLURM_JOB_NODELIST`); no variables means the single-process mode.
//! - [`share_from_root`] is the rendezvous: rank 0 hands every rank the same bytes (the NCCL
//!   unique id) over TCP, with a deadline, retries while rank 0 comes up, and errors that name
//!   the rank and the fix (port in use, a rank that never arrives, mismatched world sizes).
//! - The `lifecycle-launch` binary starts `N` processes on one node for users without torchrun.

#![warn(missing_docs)]

mod env;
mod error;
mod rendezvous;

pub use env::{first_host, Launcher, RankEnv, DEFAULT_PORT};
pub use error::DistError;
pub use rendezvous::share_from_root;
