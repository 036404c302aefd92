//! The typed error of the GPU plumbing.

use std::time::Duration;

use cudarc::driver::DriverError;
use cudarc::nccl::result::NcclError;

/// What the GPU plumbing can fail with. Every environment failure is a value, never a panic.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The CUDA driver library could not be loaded (no NVIDIA driver, or not on the loader path).
    #[error(
        "the CUDA driver library (libcuda.so / libcuda.so.1) could not be loaded: install the \
         NVIDIA driver, or put the folder holding libcuda.so.1 on LD_LIBRARY_PATH \
         (`ldconfig -p | grep libcuda` shows where it is)"
    )]
    NoDriver,
    /// The NCCL library could not be loaded.
    #[error(
        "the NCCL library could not be loaded: cudarc looks for `libnccl.so` (and `.so.13`, \
         `.so.12`, ...) but not `libnccl.so.2`, the name runtime-only packages and pip wheels ship. \
         Fix: `mkdir -p ~/.local/nccl && ln -s /path/to/libnccl.so.2 ~/.local/nccl/libnccl.so` and \
         `export LD_LIBRARY_PATH=~/.local/nccl:$LD_LIBRARY_PATH` (find the library with \
         `ldconfig -p | grep nccl` or `python -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))'`)"
    )]
    NoNccl,
    /// The NVRTC run-time compiler library could not be loaded.
    #[error(
        "the NVRTC library (libnvrtc.so) could not be loaded: install the CUDA toolkit's NVRTC \
         (package cuda-nvrtc-13-0 or the pip wheel nvidia-cuda-nvrtc) and put its folder on \
         LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    /// The driver loaded but reports no usable GPU.
    #[error(
        "the CUDA driver reports no GPU ({detail}): check `nvidia-smi` and CUDA_VISIBLE_DEVICES"
    )]
    NoDevice {
        /// What the driver said.
        detail: String,
    },
    /// Fewer GPUs than ranks asked for.
    #[error(
        "{requested} ranks need {requested} GPUs but only {available} are visible: use a world \
         size W <= {available}, or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
    )]
    TooFewGpus {
        /// W.
        requested: usize,
        /// GPUs the driver reports.
        available: usize,
    },
    /// A rank placed on a GPU the machine does not show ([`RankPlacement::check`]).
    ///
    /// [`RankPlacement::check`]: crate::RankPlacement::check
    #[error(
        "rank {rank} is placed on GPU {device}, but only {available} GPU(s) are visible \
         (indices 0..{available}): place the ranks on visible GPUs, or make more GPUs visible \
         (CUDA_VISIBLE_DEVICES)"
    )]
    NoSuchGpu {
        /// The first rank placed on a missing GPU.
        rank: usize,
        /// Its GPU index.
        device: usize,
        /// GPUs the driver reports.
        available: usize,
    },
    /// An NCCL operation (or [`Transport::Nccl`](crate::Transport::Nccl)) on a pool that places
    /// two ranks on one GPU: NCCL refuses that, so such a pool creates no communicators.
    #[error(
        "the NCCL transport needs one GPU per rank; this pool places ranks {first} and {second} \
         on GPU {device}: on such a pool ranks move bytes with peer copies only (Transport::Auto \
         or Transport::PeerCopy; between ranks on one GPU they are device-local copies), or \
         build the pool with one GPU per rank for NCCL"
    )]
    NcclNeedsOneGpuPerRank {
        /// The lower rank of the first pair on one GPU.
        first: usize,
        /// The higher rank of that pair.
        second: usize,
        /// The GPU they share.
        device: usize,
    },
    /// The multi-process rendezvous that shares the NCCL id failed.
    #[error("rank rendezvous failed: {0}")]
    Rendezvous(#[from] lifecycle_dist::DistError),
    /// A world size of zero.
    #[error("the world size W must be at least 1, found 0")]
    ZeroWorld,
    /// A device allocation failed for lack of memory.
    #[error(
        "out of device memory on rank {rank} while allocating {bytes} bytes for {what}: lower the \
         bucket budget, offload more training state, or use more GPUs"
    )]
    OutOfMemory {
        /// The rank (GPU) that ran out.
        rank: usize,
        /// Bytes asked for.
        bytes: u64,
        /// What the allocation was for.
        what: String,
    },
    /// A pinned host allocation failed.
    #[error("could not allocate {bytes} bytes of pinned host memory on rank {rank} for {what}: {detail}")]
    PinnedAlloc {
        /// The rank.
        rank: usize,
        /// Bytes asked for.
        bytes: u64,
        /// What the allocation was for.
        what: String,
        /// The driver's message.
        detail: String,
    },
    /// Any other CUDA driver error.
    #[error("CUDA driver error on rank {rank} during {op}: {detail}")]
    Driver {
        /// The rank.
        rank: usize,
        /// The operation.
        op: String,
        /// The driver's message.
        detail: String,
    },
    /// An NCCL error.
    #[error("NCCL error on rank {rank} during {op}: {detail}")]
    Nccl {
        /// The rank.
        rank: usize,
        /// The operation.
        op: String,
        /// NCCL's message.
        detail: String,
    },
    /// A run-time kernel compilation failed.
    #[error("NVRTC could not compile kernel module `{module}` (options {options:?}): {detail}")]
    Compile {
        /// The module.
        module: String,
        /// The options given to NVRTC.
        options: Vec<String>,
        /// The compiler's log.
        detail: String,
    },
    /// A rank's worker thread panicked or is gone.
    #[error("the worker thread of rank {rank} failed: {detail}")]
    Worker {
        /// The rank.
        rank: usize,
        /// What happened.
        detail: String,
    },
    /// A cast or quantisation of a program run read a NaN or an infinity in the training
    /// weights: the rollout weights it wrote are not to be used. Backends name the tensor
    /// (a scan of the source, run only after this report).
    #[error(
        "rank {rank}: the training weights hold a NaN or an infinity (found while casting them \
         for the rollout); the rollout weights written are not used"
    )]
    NonFinite {
        /// The rank whose source held it.
        rank: usize,
    },
    /// An argument the caller passed is inconsistent.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// NCCL work (or enqueueing it) did not finish within the collective deadline: a peer rank
    /// stalled or died. This rank's communicator was aborted.
    #[error(
        "rank {rank} waited {} for {op} without it finishing: a peer rank stalled or died. This \
         rank's NCCL communicator was aborted, so the rank pool can run no more collectives: \
         rebuild it (ThreadRankPool::new / for_process) and the backend on it (work without \
         collectives, such as reloading or downloading the training state, still runs). If the \
         work is legitimately that slow, raise the deadline (CollectiveSettings::timeout or the \
         environment variable LIFECYCLE_NCCL_TIMEOUT_S, in seconds)",
        seconds(*deadline)
    )]
    CollectiveTimeout {
        /// The rank that gave up waiting.
        rank: usize,
        /// What it was waiting for.
        op: String,
        /// The deadline that passed.
        deadline: Duration,
    },
    /// The pool's NCCL communicators were aborted earlier (a timeout or an NCCL error on some
    /// rank); no collective can run on them any more.
    #[error(
        "rank {rank} cannot run {op}: the rank pool's NCCL communicators were aborted ({cause}); \
         rebuild the rank pool (ThreadRankPool::new / for_process) and the backend on it (work \
         without collectives, such as reloading or downloading the training state, still runs)"
    )]
    CommAborted {
        /// The rank that refused the operation.
        rank: usize,
        /// The refused operation.
        op: String,
        /// Why the communicators were aborted.
        cause: String,
    },
}

/// A duration in seconds for messages (`"2.5 s"`).
fn seconds(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// A failure an NCCL call site turns into a [`CudaError`] with [`CudaError::nccl`]: a raw
/// [`NcclError`] of cudarc, or a [`CudaError`] that already names its rank and operation (what
/// the pool's communicator returns: a timeout, an aborted communicator), which passes through.
pub trait NcclFailure {
    /// The typed error for `op` on `rank`.
    fn into_cuda_error(self, rank: usize, op: String) -> CudaError;
}

impl NcclFailure for NcclError {
    fn into_cuda_error(self, rank: usize, op: String) -> CudaError {
        CudaError::Nccl {
            rank,
            op,
            detail: format!("{:?}", self.0),
        }
    }
}

impl NcclFailure for CudaError {
    fn into_cuda_error(self, _rank: usize, _op: String) -> CudaError {
        self
    }
}

impl CudaError {
    /// Maps a driver error, turning `CUDA_ERROR_OUT_OF_MEMORY` into [`CudaError::OutOfMemory`].
    pub fn driver(rank: usize, op: impl Into<String>, bytes: u64, e: DriverError) -> Self {
        let op = op.into();
        if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            CudaError::OutOfMemory {
                rank,
                bytes,
                what: op,
            }
        } else {
            CudaError::Driver {
                rank,
                op,
                detail: format!("{:?}", e.0),
            }
        }
    }

    /// Maps an NCCL failure: a raw [`NcclError`] becomes [`CudaError::Nccl`]; an error that is
    /// already typed (from the pool's communicator) is returned unchanged.
    pub fn nccl(rank: usize, op: impl Into<String>, e: impl NcclFailure) -> Self {
        e.into_cuda_error(rank, op.into())
    }

    /// Whether this error means the pool's communicators are gone (a collective timed out or
    /// was aborted): the pool must be rebuilt before the next collective.
    pub fn is_comm_lost(&self) -> bool {
        matches!(
            self,
            CudaError::CollectiveTimeout { .. } | CudaError::CommAborted { .. }
        )
    }

    /// Whether this is an out-of-memory error.
    pub fn is_oom(&self) -> bool {
        matches!(self, CudaError::OutOfMemory { .. })
    }
}
