//! The training state on the GPUs: per rank, flat fp32 buffers of padded FSDP shards (master,
//! grads, Adam m and v), and pinned host copies while offloaded.

use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::OffloadBuffer;
use lifecycle_layout::FsdpLayout;

use crate::verify::{Buffer, OffloadSums};
use crate::FsdpError;
use lifecycle_layout::fsdp::ShardLayout;

/// The buffers in the order of [`RankTrain`]'s [`movable`](lifecycle_cuda::driver::RankBuffers::movable):
/// Adam state first, the master (which the plan reads) last.
pub(crate) const MOVABLE: [Buffer; 3] = [Buffer::AdamM, Buffer::AdamV, Buffer::Master];

/// One rank's training buffers. Master, Adam m and v are on the device or offloaded to pinned
/// chunks of the backend's [`PinnedPool`](lifecycle_cuda::PinnedPool) (given back at reload, so
/// the next offload reuses them); grads are freed in rollout mode.
#[derive(Default)]
pub struct RankTrain {
    pub(crate) master: OffloadBuffer<f32>,
    pub(crate) grads: Option<CudaSlice<f32>>,
    pub(crate) m: OffloadBuffer<f32>,
    pub(crate) v: OffloadBuffer<f32>,
    /// Verification mode: hashes of the offloaded buffers.
    pub(crate) sums: OffloadSums,
}

impl RankTrain {
    /// The device copy of `buffer` (`None` while offloaded).
    pub(crate) fn device(&self, buffer: Buffer) -> Option<&CudaSlice<f32>> {
        self.buffer(buffer).device()
    }

    /// `buffer` itself.
    pub(crate) fn buffer(&self, buffer: Buffer) -> &OffloadBuffer<f32> {
        match buffer {
            Buffer::Master => &self.master,
            Buffer::AdamM => &self.m,
            Buffer::AdamV => &self.v,
        }
    }

    /// `buffer` itself, to offload, reload or discard.
    pub(crate) fn buffer_mut(&mut self, buffer: Buffer) -> &mut OffloadBuffer<f32> {
        match buffer {
            Buffer::Master => &mut self.master,
            Buffer::AdamM => &mut self.m,
            Buffer::AdamV => &mut self.v,
        }
    }

    /// `buffer` and the verification hashes, borrowed together.
    pub(crate) fn buffer_and_sums(
        &mut self,
        buffer: Buffer,
    ) -> (&OffloadBuffer<f32>, &mut OffloadSums) {
        let b = match buffer {
            Buffer::Master => &self.master,
            Buffer::AdamM => &self.m,
            Buffer::AdamV => &self.v,
        };
        (b, &mut self.sums)
    }
}

/// The FSDP training state of all ranks, in device memory (or pinned host memory while
/// offloaded). Built by [`FsdpBackend`](crate::FsdpBackend)'s constructors.
pub struct FsdpTrainState {
    pub(crate) layout: std::sync::Arc<FsdpLayout>,
    pub(crate) shards: ShardLayout,
    pub(crate) ranks: Vec<RankTrain>,
    /// Adam steps applied so far (the bias corrections of the next step use `adam_steps + 1`).
    pub(crate) adam_steps: u64,
}

impl std::fmt::Debug for FsdpTrainState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpTrainState")
            .field("world", &self.layout.world())
            .field("tensors", &self.layout.tensors().len())
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
        self.layout.world()
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
        self.ranks.iter().any(|r| r.master.is_offloaded())
    }

    /// Whether Adam m, v are offloaded.
    pub fn optimizer_offloaded(&self) -> bool {
        self.ranks
            .iter()
            .any(|r| r.m.is_offloaded() || r.v.is_offloaded())
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

    /// Bytes of pinned host memory the offloaded buffers of this process's ranks hold (taken
    /// from the backend's pinned pool at offload, given back at reload; the pool pins each chunk
    /// once and reuses it).
    pub fn pinned_host_bytes(&self) -> u64 {
        self.ranks
            .iter()
            .flat_map(|r| [&r.master, &r.m, &r.v])
            .map(|b| b.host_bytes() as u64)
            .sum()
    }

    /// Bytes of one rank's fp32 buffer (one of master, grads, m, v).
    pub fn rank_buffer_bytes(&self) -> u64 {
        self.shards.rank_len * 4
    }

    /// Flips bit `bit` of element `index` of `tensor`'s shard in the **offloaded** copy of
    /// `buffer` (`"master"`, `"adam_m"` or `"adam_v"`) on local rank `rank` (the global rank in
    /// the single-process mode): fault injection for testing verification mode. Returns whether
    /// a bit was flipped (false when that buffer is on the device, or `rank` or `index` is out
    /// of range); an unknown tensor or buffer name is an error.
    pub fn inject_offloaded_bit_flip(
        &mut self,
        rank: usize,
        tensor: &str,
        buffer: &str,
        index: usize,
        bit: u32,
    ) -> Result<bool, FsdpError> {
        let slot = self
            .shards
            .slots
            .iter()
            .find(|s| s.name == tensor)
            .ok_or_else(|| FsdpError::Tensor {
                name: tensor.to_string(),
                problem: "no such tensor in the training state".into(),
            })?;
        let b = Buffer::parse(buffer).map_err(FsdpError::Config)?;
        if index >= slot.padded_rows * slot.cols {
            return Ok(false);
        }
        let at = slot.offset as usize + index;
        let Some(rt) = self.ranks.get_mut(rank) else {
            return Ok(false);
        };
        if rt.device(b).is_some() {
            return Ok(false);
        }
        let Some(host) = rt.buffer_mut(b).host_mut() else {
            return Ok(false);
        };
        let byte = at * 4 + (bit % 32) as usize / 8;
        match host.byte_mut(byte, rank)? {
            Some(v) => {
                *v ^= 1 << (bit % 8);
                Ok(true)
            }
            None => Ok(false),
        }
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
