//! The Megatron training state on the GPUs.

use half::bf16;
use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::OffloadBuffer;

use lifecycle_layout::megatron::{MegatronLayout, OptimizerShard};

/// One training rank's buffers on its GPU (the parts of a [`MegatronGpuState`]).
pub struct GpuRank {
    /// The global rank.
    pub(crate) rank: usize,
    /// bf16 parameters of the rank: the whole buffer (dense part, then expert part).
    pub(crate) params: OffloadBuffer<bf16>,
    /// fp32 grads of the buffer; freed in rollout mode.
    pub(crate) grads: Option<CudaSlice<f32>>,
    /// Elements of the buffer this rank's optimizer owns.
    pub(crate) shard: OptimizerShard,
    /// fp32 main params of `shard`.
    pub(crate) main: OffloadBuffer<f32>,
    /// Adam first moment of `shard`.
    pub(crate) adam_m: OffloadBuffer<f32>,
    /// Adam second moment of `shard`.
    pub(crate) adam_v: OffloadBuffer<f32>,
}

impl GpuRank {
    fn offloaded(&self) -> bool {
        self.params.is_offloaded()
            || self.main.is_offloaded()
            || self.adam_m.is_offloaded()
            || self.adam_v.is_offloaded()
    }
}

/// The Megatron training state of the ranks this process drives, on their GPUs: per rank the bf16
/// parameters of its (stage, TP rank) in one contiguous buffer and fp32 grads of the same length
/// (as Megatron's distributed optimizer keeps them), plus its DP shard of the fp32 main params
/// and Adam m, v. While offloaded, parameters, main params and Adam moments live in pinned host
/// memory. Built by [`MegatronGpuBackend`](super::MegatronGpuBackend)'s constructors.
pub struct MegatronGpuState {
    pub(crate) layout: std::sync::Arc<MegatronLayout>,
    pub(crate) ranks: Vec<GpuRank>,
    pub(crate) adam_steps: u64,
}

impl std::fmt::Debug for MegatronGpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MegatronGpuState")
            .field("tp", &self.layout.tp())
            .field("pp", &self.layout.pp())
            .field("dp", &self.layout.dp())
            .field("local_ranks", &self.local_ranks())
            .field("offloaded", &self.is_offloaded())
            .field("grads", &self.has_grads())
            .finish()
    }
}

impl MegatronGpuState {
    /// The training layout.
    pub fn layout(&self) -> &MegatronLayout {
        &self.layout
    }

    /// W.
    pub fn world(&self) -> usize {
        self.layout.world()
    }

    /// The global ranks this process holds, in the pool's order.
    pub fn local_ranks(&self) -> Vec<usize> {
        self.ranks.iter().map(|r| r.rank).collect()
    }

    /// Whether any parameters, main params or Adam moments are offloaded.
    pub fn is_offloaded(&self) -> bool {
        self.ranks.iter().any(GpuRank::offloaded)
    }

    /// Whether every rank's gradients are allocated.
    pub fn has_grads(&self) -> bool {
        self.ranks.iter().all(|r| r.grads.is_some())
    }

    /// Bytes of device memory the training state of `rank` takes when fully resident (bf16
    /// params, fp32 grads, main params, Adam m and v); `None` for a rank not in this process.
    pub fn rank_bytes(&self, rank: usize) -> Option<u64> {
        let r = self.ranks.iter().find(|r| r.rank == rank)?;
        Some((r.params.len() * (2 + 4) + r.shard.len() * 12) as u64)
    }

    /// Bytes `rank` moves to host memory when offloading parameters (bf16 params and fp32 main
    /// params) and optimizer state (Adam m, v): `(params, optimizer)`.
    pub fn offload_bytes(&self, rank: usize) -> Option<(u64, u64)> {
        let r = self.ranks.iter().find(|r| r.rank == rank)?;
        Some((
            (r.params.bytes() + r.main.bytes()) as u64,
            (r.adam_m.bytes() + r.adam_v.bytes()) as u64,
        ))
    }
}
