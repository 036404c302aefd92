//! The training state on the GPUs: per rank, flat fp32 buffers of padded FSDP shards (master,
//! grads, Adam m and v), and pinned host copies while offloaded.

use cudarc::driver::{CudaSlice, PinnedHostSlice};
use lifecycle_core::layout::FsdpLayout;

use crate::plan::ShardLayout;

/// One rank's training buffers. A buffer is on the device (`Some` device slice) or offloaded (the
/// pinned host copy is authoritative); pinned copies are kept after reload for the next offload.
#[derive(Default)]
pub struct RankTrain {
    pub(crate) master: Option<CudaSlice<f32>>,
    pub(crate) grads: Option<CudaSlice<f32>>,
    pub(crate) m: Option<CudaSlice<f32>>,
    pub(crate) v: Option<CudaSlice<f32>>,
    pub(crate) master_host: Option<PinnedHostSlice<f32>>,
    pub(crate) m_host: Option<PinnedHostSlice<f32>>,
    pub(crate) v_host: Option<PinnedHostSlice<f32>>,
}

/// The FSDP training state of all ranks, in device memory (or pinned host memory while
/// offloaded). Built by [`FsdpBackend`](crate::FsdpBackend)'s constructors.
pub struct FsdpTrainState {
    pub(crate) layout: FsdpLayout,
    pub(crate) shards: ShardLayout,
    pub(crate) ranks: Vec<RankTrain>,
    /// Adam steps applied so far (the bias corrections of the next step use `adam_steps + 1`).
    pub(crate) adam_steps: u64,
}

impl std::fmt::Debug for FsdpTrainState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpTrainState")
            .field("world", &self.layout.world)
            .field("tensors", &self.layout.tensors.len())
            .field("rank_len", &self.shards.rank_len)
            .field("master_offloaded", &self.master_offloaded())
            .field("optimizer_offloaded", &self.optimizer_offloaded())
            .field("adam_steps", &self.adam_steps)
            .finish()
    }
}

impl FsdpTrainState {
    /// W.
    pub fn world(&self) -> usize {
        self.layout.world
    }

    /// Names and full shapes, in training order.
    pub fn layout(&self) -> &FsdpLayout {
        &self.layout
    }

    /// The flat per-rank layout of the shards.
    pub fn shard_layout(&self) -> &ShardLayout {
        &self.shards
    }

    /// Whether the master weights are offloaded.
    pub fn master_offloaded(&self) -> bool {
        self.ranks.iter().any(|r| r.master.is_none())
    }

    /// Whether Adam m, v are offloaded.
    pub fn optimizer_offloaded(&self) -> bool {
        self.ranks.iter().any(|r| r.m.is_none() || r.v.is_none())
    }

    /// Whether gradients are allocated.
    pub fn has_grads(&self) -> bool {
        self.ranks.iter().all(|r| r.grads.is_some())
    }

    /// Adam steps applied to this state so far
    /// ([`FsdpBackend::adam_step`](crate::FsdpBackend::adam_step)).
    pub fn adam_steps(&self) -> u64 {
        self.adam_steps
    }

    /// Bytes of pinned host memory held for offloading by this process's ranks (allocated at the
    /// first offload, then reused by every later one).
    pub fn pinned_host_bytes(&self) -> u64 {
        self.ranks
            .iter()
            .flat_map(|r| [&r.master_host, &r.m_host, &r.v_host])
            .map(|h| h.as_ref().map_or(0, |h| h.len() as u64 * 4))
            .sum()
    }

    /// Bytes of one rank's fp32 buffer (one of master, grads, m, v).
    pub fn rank_buffer_bytes(&self) -> u64 {
        self.shards.rank_len * 4
    }
}

/// One rank's training buffers downloaded to host memory (flat, padded), for round-trip checks.
#[derive(Debug, Clone, PartialEq)]
pub struct RankDump {
    /// fp32 master shards.
    pub master: Vec<f32>,
    /// Gradients (`None` while freed).
    pub grads: Option<Vec<f32>>,
    /// Adam m.
    pub m: Vec<f32>,
    /// Adam v.
    pub v: Vec<f32>,
}

impl RankDump {
    /// Whether master, m and v are bit-identical to `other`'s (NaN payloads included).
    pub fn same_bits(&self, other: &RankDump) -> bool {
        let eq = |a: &[f32], b: &[f32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
        };
        eq(&self.master, &other.master) && eq(&self.m, &other.m) && eq(&self.v, &other.v)
    }
}
