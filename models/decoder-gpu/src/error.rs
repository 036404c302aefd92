//! The GPU decoder's error type.

use lifecycle_cuda::CudaError;
use lifecycle_decoder::{CheckpointError, DecodeError};

/// Why the GPU decoder or its rollout engine failed. Every
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
    /// A generate call does not fit the engine's KV cache ([`EngineSettings`](crate::EngineSettings)).
    #[error(
        "the KV cache holds {max_sequences} sequences of at most {max_tokens} tokens each \
         (EngineSettings); this call needs {sequences} sequences of up to {tokens} tokens \
         (longest prompt + max_new_tokens): raise EngineSettings::max_sequences / max_tokens or \
         split the call"
    )]
    KvCapacity {
        /// Sequences in the call.
        sequences: usize,
        /// Longest prompt + `max_new_tokens`.
        tokens: usize,
        /// [`EngineSettings::max_sequences`](crate::EngineSettings::max_sequences).
        max_sequences: usize,
        /// [`EngineSettings::max_tokens`](crate::EngineSettings::max_tokens).
        max_tokens: usize,
    },
    /// The engine's settings are not usable.
    #[error("invalid engine settings: {0}")]
    Settings(String),
    /// The engine is asleep: it has no weights bound and no KV cache.
    #[error(
        "the GPU engine is asleep: generate runs inside a rollout session of the lifecycle the \
         engine is attached to (Lifecycle::with_engine, then rollout() wakes it)"
    )]
    Asleep,
    /// `generate` was given other weights than the engine was woken for.
    #[error(
        "generate was given rollout weights of version {given} ({given_buffer}), the engine was \
         woken for version {bound} ({bound_buffer}): pass the view of the session the engine \
         was woken in (session.parts())"
    )]
    OtherWeights {
        /// The version the engine was woken for.
        bound: u64,
        /// The version of the view given.
        given: u64,
        /// Which buffer the engine is bound to.
        bound_buffer: String,
        /// Which buffer the view holds.
        given_buffer: String,
    },
    /// The rollout buffer's tensor names belong to another layout than the engine's.
    #[error(
        "the engine was built for the {configured} rollout layout, the rollout buffer holds the \
         {found} one: build the engine with the backend's layout (FsdpBackend::layout, \
         MegatronGpuBackend::rollout_layout)"
    )]
    LayoutMismatch {
        /// The engine's layout.
        configured: &'static str,
        /// What the buffer's names say.
        found: &'static str,
    },
}
