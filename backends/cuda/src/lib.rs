//! Shared NVIDIA GPU plumbing for the GPU backends: environment checks, one thread per GPU with
//! its own NCCL communicator, streams, pinned host buffers and kernels compiled at run time.
//!
//! - [`check_environment`] finds missing libraries and too few GPUs **before** cudarc is used
//!   (cudarc panics when a library cannot be loaded); every failure is a [`CudaError`] that says
//!   how to fix it.
//! - [`ThreadRankPool`] starts one persistent thread per GPU; each creates its context, a compute,
//!   a copy and an NCCL stream, loads the [`Kernels`] and creates its own non-blocking
//!   [`NcclComm`] from one NCCL `Id`. Backends run per-rank closures through the [`RankExecutor`]
//!   seam, which a multi-process launcher can implement later.
//! - [`RankPlacement`]: several ranks may share one GPU ([`ThreadRankPool::on_devices`]); such a
//!   pool has no NCCL communicators and moves bytes with peer copies only, so the backends'
//!   multi-rank logic runs on a machine with fewer GPUs than ranks.
//! - [`testing`]: what every GPU test starts with ([`testing::require_gpus`]), so a test that
//!   needs more GPUs than the machine shows fails saying so.
//! - Peer copies ([`ThreadRankPool::peer_access`], [`copy_2d`], [`Transport`]): ranks of one
//!   process write straight into each other's device memory with the copy engines, faster than
//!   NCCL on NVLink and without SMs; [`peer_copy_rate`] measures that ceiling.
//! - Every wait on NCCL work has a deadline ([`CollectiveSettings`], env `LIFECYCLE_NCCL_TIMEOUT_S`):
//!   a peer that stalls or dies ends in [`CudaError::CollectiveTimeout`], not a hang.
//! - [`VerifyKernels`]: device hashes of buffers (chunk by chunk) and a non-finite scan, for the
//!   backends' verification modes.
//! - [`Kernels`]: fp32 → bf16 cast (round to nearest even, bit-identical to
//!   `half::bf16::from_f32`), strided 2-D cast and copy, deterministic pseudo-random fill.
//! - [`FreeingRoom`]: the memory an offload that overlaps the rollout frees in stream order, with
//!   the events a reader's allocations wait for ([`RolloutBuffer::freeing`]).
//! - [`alloc_device`] / [`alloc_pinned`] map allocation failures to typed errors
//!   ([`CudaError::OutOfMemory`]).
//!
//! ```
//! // Never panics, GPU or not.
//! let env = lifecycle_cuda::check_environment(1);
//! println!("{env:?}");
//! ```

#![warn(missing_docs)]

mod agree;
mod comm;
mod deadline;
pub mod driver;
mod entries;
mod env;
mod error;
mod freeing;
mod handoff;
mod kernels;
mod modules;
mod offload;
mod peer;
mod pinned;
mod placement;
mod pool;
mod ptx_cache;
mod quantise;
mod rollout;
mod steps;
pub mod testing;
mod tiles;
mod timeline;
mod transfer;
mod verify;

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, PinnedHostSlice, ValidAsZeroBits};

pub use agree::Rendezvous;
pub use comm::{
    parse_blocking, parse_timeout, CollectiveSettings, CommFault, NcclComm, BLOCKING_ENV,
    TIMEOUT_ENV,
};
pub use entries::EntryTable;
pub use env::{
    arch_candidates, arch_specific_target, check_environment, device_count, driver_present,
    find_cuda_include, include_candidates, nccl_present, nvrtc_present, Environment,
};
pub use error::{CudaError, NcclFailure};
pub use freeing::{frees_needed, FreeingRoom};
pub use kernels::{
    compile_kernels, fill_uniform_value, CastBatch, Kernels, CAST_CHUNK_ELEMS,
    DEFAULT_MULTI_BLOCKS_PER_SM, KERNEL_SRC, MAIN_KERNELS,
};
pub use modules::{compile, KernelSet, LoadedModule};
pub use offload::{FromLe, OffloadBuffer};
pub use peer::{copy_2d, memcpy_2d_desc, peer_copy_rate, Transport};
pub use pinned::{
    HostCopy, PinnedPool, PinnedReservation, RankReservation, Reserved, DEFAULT_CHUNK_BYTES,
};
pub use placement::{RankPlacement, SharedGpu};
pub use pool::{RankCtx, RankExecutor, RankFn, ThreadRankPool};
pub use quantise::{quantise_staged, QUANTISE_KERNELS};
pub use rollout::{RolloutBuffer, RolloutSource};
pub use steps::{run_program, DeviceProgram, Peers, ProgramSlot, RunOptions, SourceBuf};
pub use tiles::{TileKernel, TILE_KERNELS, TILE_KERNEL_SRC};
pub use timeline::{DeviceSpan, Mark, RankSpans, StreamTimeline};
pub use transfer::{
    alloc_rollout_buffers, finish_offload, finish_offload_with, peer_base, peer_bases,
    record_spans, record_transfer, FreeWith, RankMoved,
};
pub use verify::{
    chunk_hash_u16, chunk_hash_u32, ChunkTable, PendingHashes, VerifyKernels, WordSize,
    DEFAULT_CHUNK_WORDS, VERIFY_KERNELS, VERIFY_SRC,
};

/// Re-export of the cudarc version this crate is built against.
pub use cudarc;

/// Allocates `len` uninitialised elements on `stream` (stream-ordered), mapping OOM to
/// [`CudaError::OutOfMemory`].
///
/// # Safety
/// The memory is uninitialised: the caller must write it before reading it.
pub unsafe fn alloc_device<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    len: usize,
    rank: usize,
    what: &str,
) -> Result<CudaSlice<T>, CudaError> {
    let bytes = (len * std::mem::size_of::<T>()) as u64;
    // SAFETY: forwarded to the caller (uninitialised memory).
    unsafe { stream.alloc::<T>(len.max(1)) }.map_err(|e| CudaError::driver(rank, what, bytes, e))
}

/// Allocates `len` zeroed elements on `stream`, mapping OOM to [`CudaError::OutOfMemory`].
pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
    rank: usize,
    what: &str,
) -> Result<CudaSlice<T>, CudaError> {
    let bytes = (len * std::mem::size_of::<T>()) as u64;
    stream
        .alloc_zeros::<T>(len.max(1))
        .map_err(|e| CudaError::driver(rank, what, bytes, e))
}

/// Allocates `len` elements of page-locked host memory, cacheable (flags 0, not write-combined,
/// so the CPU can read it back at full speed).
///
/// # Safety
/// The memory is uninitialised: the caller must write it (for example with a device→host copy)
/// before reading it.
pub unsafe fn alloc_pinned<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    len: usize,
    rank: usize,
    what: &str,
) -> Result<PinnedHostSlice<T>, CudaError> {
    let bytes = (len * std::mem::size_of::<T>()) as u64;
    // SAFETY: forwarded to the caller (uninitialised memory); flags 0 is a valid flag set.
    unsafe { stream.context().alloc_pinned_with_flags::<T>(len.max(1), 0) }.map_err(|e| {
        CudaError::PinnedAlloc {
            rank,
            bytes,
            what: what.to_string(),
            detail: format!("{:?}", e.0),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_check_is_an_error_not_a_panic_without_gpu() {
        // On a machine with a working driver and GPUs this succeeds; elsewhere it must be a clear
        // error. Either way it must not panic.
        match check_environment(1) {
            Ok(env) => assert!(env.devices >= 1),
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.len() > 40, "{msg}");
                if !driver_present() {
                    assert!(matches!(e, CudaError::NoDriver), "{e:?}");
                    assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
                }
            }
        }
        if !nccl_present() {
            let msg = CudaError::NoNccl.to_string();
            assert!(
                msg.contains("libnccl.so.2") && msg.contains("ln -s"),
                "{msg}"
            );
        }
    }

    #[test]
    fn pool_without_gpu_is_a_typed_error() {
        if driver_present() {
            return;
        }
        match ThreadRankPool::new(2) {
            Err(CudaError::NoDriver) => {}
            other => panic!("expected NoDriver, got {other:?}"),
        }
        assert!(matches!(ThreadRankPool::new(0), Err(CudaError::ZeroWorld)));
        assert!(matches!(
            ThreadRankPool::on_devices(&[0, 0]),
            Err(CudaError::NoDriver)
        ));
        assert!(matches!(
            ThreadRankPool::on_devices(&[]),
            Err(CudaError::ZeroWorld)
        ));
    }

    #[test]
    fn host_fill_twin_is_in_range_and_deterministic() {
        let a: Vec<f32> = (0..1000).map(|i| fill_uniform_value(7, i, 0.5)).collect();
        let b: Vec<f32> = (0..1000).map(|i| fill_uniform_value(7, i, 0.5)).collect();
        assert_eq!(a, b);
        assert!(a.iter().all(|x| (-0.5..0.5).contains(x)));
        let mean: f32 = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.05, "{mean}");
    }
}
