//! One process per GPU, launched like PyTorch jobs.
//!
//! - [`RankEnv`] reads the rank, world size, local rank and rendezvous address from the variables
//!   torchrun sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//!   `MASTER_PORT`) or from Slurm's (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the first
//!   node of `SLURM_JOB_NODELIST`); no variables means the single-process mode. It also picks the
//!   [`Rendezvous`]: torchrun's agent store when torchrun advertises it
//!   (`TORCHELASTIC_USE_AGENT_STORE=True`), else one that rank 0 hosts.
//! - [`share_from_root`] is the rendezvous: rank 0 hands every rank the same bytes (the NCCL
//!   unique id), with a deadline, retries while rank 0 or the store comes up, and errors that name
//!   the rank and the fix (port in use, store unreachable or speaking another protocol, a rank or
//!   key that never arrives, mismatched world sizes).
//!   - Under torchrun the agent already listens at `MASTER_ADDR:MASTER_PORT` with a c10d
//!     `TCPStore`; every rank joins it as a client (the torch 2.x wire protocol, spoken natively,
//!     no Python) and rank 0 publishes the id under a key naming the run, the restart attempt and
//!     the exchange.
//!   - Under Slurm's `srun`, `lifecycle-launch`, or variables set by hand, rank 0 listens at
//!     `MASTER_ADDR:MASTER_PORT` and the other ranks connect to it.
//! - The `lifecycle-launch` binary starts `N` processes on one node for users without torchrun.
//!
//! ```no_run
//! use std::time::Duration;
//! use lifecycle_dist::{share_from_root, RankEnv, Rendezvous};
//!
//! let Some(env) = RankEnv::from_env()? else {
//!     println!("no launcher: single-process mode");
//!     return Ok(());
//! };
//! if let Rendezvous::AgentStore(store) = &env.rendezvous {
//!     println!("joining torchrun's store, keys under {}", store.key_prefix());
//! }
//! let id = share_from_root(&env, || vec![7u8; 128], Duration::from_secs(60))?;
//! assert_eq!(id.len(), 128);
//! # Ok::<(), lifecycle_dist::DistError>(())
//! ```

#![warn(missing_docs)]

mod agent;
mod env;
mod error;
mod rendezvous;
mod store;

pub use env::{first_host, AgentStore, Launcher, RankEnv, Rendezvous, DEFAULT_PORT};
pub use error::DistError;
pub use rendezvous::{share_from_root, share_from_root_named};
