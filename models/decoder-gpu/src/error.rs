//! The GPU decoder's error type.

use lifecycle_core::LifecycleError;
use lifecycle_cuda::CudaError;
use lifecycle_decoder::{CheckpointError, DecodeError};
use lifecycle_fsdp::FsdpError;

/// Why the GPU decoder (or the model setup in [`GpuModel`](crate::GpuModel)) failed. Every
/// environment failure (no driver, no NCCL, no cuBLAS, too few GPUs) is a value, never a panic.
#[derive(Debug, thiserror::Error)]
pub enum GpuDecodeError {
    /// A GPU, driver, NCCL, cuBLAS, NVRTC or allocation failure.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The weights do not fit the config / layout, a token is out of range, or a call does not
    /// fit the decoder's state (the same checks and messages as the CPU decoder).
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The FSDP backend failed while building the model.
    #[error(transparent)]
    Fsdp(#[from] FsdpError),
    /// Entering rollout mode failed (boxed: the lifecycle's error is large).
    #[error(transparent)]
    Lifecycle(Box<LifecycleError<FsdpError>>),
    /// The checkpoint could not be read.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The cuBLAS library could not be loaded.
    #[error(
        "the cuBLAS library (libcublas.so / libcublasLt.so) could not be loaded: install the CUDA \
         toolkit's cuBLAS (package libcublas-13-0 or the pip wheel nvidia-cublas) and put its \
         folder on LD_LIBRARY_PATH"
    )]
    NoCublas,
    /// The rank pool and the layout's T do not fit a topology the decoder supports (see
    /// [`decode_topology`](crate::decode_topology)).
    #[error("the GPU decoder cannot run on W = {world} ranks with T = {tp}: {reason}")]
    Topology {
        /// W of the pool.
        world: usize,
        /// T of the layout.
        tp: usize,
        /// What does not fit, and what to do.
        reason: String,
    },
}

impl From<LifecycleError<FsdpError>> for GpuDecodeError {
    fn from(e: LifecycleError<FsdpError>) -> Self {
        GpuDecodeError::Lifecycle(Box::new(e))
    }
}
