//! Why a GPU DAPO run failed.

use lifecycle_core::LifecycleError;
use lifecycle_cuda::CudaError;
use lifecycle_decoder::{CheckpointError, DecodeError};
use lifecycle_dist::DistError;
use lifecycle_fsdp::FsdpError;

use lifecycle_decoder_gpu::GpuDecodeError;

/// Why a GPU DAPO run ([`run`](super::run)) failed. Settings are checked before any GPU work;
/// a missing driver, NCCL or GPU is a value (`Cuda` or `Gpu`), never a panic.
#[derive(Debug, thiserror::Error)]
pub enum DapoGpuError {
    /// A setting is out of range or does not fit another one (the message names the option).
    #[error("invalid setting: {0}")]
    Usage(String),
    /// The launcher variables (torchrun, Slurm, `lifecycle-launch`) are set but invalid.
    #[error("the launcher variables are invalid: {0}")]
    Launcher(DistError),
    /// The GPU decoder failed, or the decoder topology does not fit `--gpus` / `--tp`.
    #[error(transparent)]
    Gpu(#[from] GpuDecodeError),
    /// The FSDP backend failed.
    #[error(transparent)]
    Fsdp(#[from] FsdpError),
    /// The Megatron GPU backend failed.
    #[error(transparent)]
    Megatron(#[from] lifecycle_megatron::MegatronGpuError),
    /// The Megatron CPU executor (the update of `--backend megatron`) failed.
    #[error(transparent)]
    MegatronHost(#[from] lifecycle_host::megatron::MegatronError),
    /// A lifecycle operation of the Megatron backend failed (boxed: the error is large).
    #[error(transparent)]
    MegatronLifecycle(Box<LifecycleError<lifecycle_megatron::MegatronGpuError>>),
    /// A GPU, driver, NCCL or allocation failure (no driver is `Cuda(CudaError::NoDriver)`).
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A lifecycle operation failed (boxed: the lifecycle's error is large).
    #[error(transparent)]
    Lifecycle(Box<LifecycleError<FsdpError>>),
    /// The checkpoint could not be read.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The model config does not fit the layout, or a decoder call failed its checks.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// Dynamic sampling found no group with mixed rewards within `--max-gen-batches` (a step
    /// with some trains on those).
    #[error(
        "step {step}: {kept} of {needed} groups with mixed rewards after {gen_batches} gen batches \
         (the limit, --max-gen-batches), nothing to train on: raise the limit, or change \
         --reward-modulus so fewer groups have uniform rewards"
    )]
    BatchNotFilled {
        /// The training step (1-based).
        step: usize,
        /// Groups with mixed rewards found.
        kept: usize,
        /// Groups needed (`--batch-groups`).
        needed: usize,
        /// Gen batches generated (`--max-gen-batches`).
        gen_batches: usize,
    },
}

impl From<LifecycleError<FsdpError>> for DapoGpuError {
    fn from(e: LifecycleError<FsdpError>) -> Self {
        DapoGpuError::Lifecycle(Box::new(e))
    }
}

impl From<LifecycleError<lifecycle_megatron::MegatronGpuError>> for DapoGpuError {
    fn from(e: LifecycleError<lifecycle_megatron::MegatronGpuError>) -> Self {
        DapoGpuError::MegatronLifecycle(Box::new(e))
    }
}

impl From<crate::dapo::driver::StreamUnsupported> for DapoGpuError {
    fn from(e: crate::dapo::driver::StreamUnsupported) -> Self {
        DapoGpuError::Usage(format!("streamed dynamic sampling: {}", e.why))
    }
}

impl From<crate::dapo::BatchNotFilled> for DapoGpuError {
    fn from(b: crate::dapo::BatchNotFilled) -> Self {
        DapoGpuError::BatchNotFilled {
            step: b.step,
            kept: b.kept,
            needed: b.needed,
            gen_batches: b.gen_batches,
        }
    }
}

impl DapoGpuError {
    /// The exit status a command-line tool returns for this error: 2 for invalid launcher
    /// variables (nothing ran), 1 for every other error.
    pub fn exit_code(&self) -> u8 {
        match self {
            DapoGpuError::Launcher(_) => 2,
            _ => 1,
        }
    }
}
