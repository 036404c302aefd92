//! The step runner: one rank's [`RankSteps`], compiled into its [`Program`], issued on the rank's
//! streams. Every layout's switch runs here (FSDP buckets and Megatron schedules alike).
//!
//! [`DeviceProgram::new`] compiles the steps and uploads, once, the tables their copies need:
//! the multi-tensor cast descriptors for fp32 sources ([`CastBatch`]) and the tile table of the
//! bf16 copy kernel ([`TileKernel`]). [`run_program`] then walks the program's operations in
//! order: events become CUDA events, copies become kernel launches or driver copies, network
//! steps become grouped NCCL calls or peer copies, and each piece of work is marked on the
//! [`StreamTimeline`] of the stream that runs it. The final wait carries the pool's deadline, so a
//! stalled peer ends in a timeout error, not a hang.
//!
//! [`RankSteps`]: lifecycle_layout::steps::RankSteps
//! [`Program`]: lifecycle_layout::steps::Program
//! [`CastBatch`]: crate::CastBatch
//! [`TileKernel`]: crate::TileKernel
//! [`StreamTimeline`]: crate::StreamTimeline

mod issue;
mod program;
mod run;
mod scratch;

pub use program::{DeviceProgram, ProgramSlot, RunOptions, SourceBuf};
pub use run::{run_program, Peers};
