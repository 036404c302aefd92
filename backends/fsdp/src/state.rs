//! The training state on the GPUs: per rank, flat fp32 buffers of padded FSDP shards (master,
//! grads, Adam m and v), and pinned host copies while offloaded.

use cudarc::driver::{CudaSlice, PinnedHostSlice};
use lifecycle_layout::FsdpLayout;

use crate::verify::{Buffer, OffloadSums};
use crate::FsdpError;
use lifecycle_layout::fsdp::ShardLayout;

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
    /// Verification mode: hashes of the offloaded buffers.
    pub(crate) sums: OffloadSums,
}

impl RankTrain {
    /// The device copy of `buffer` (`None` while offloaded).
    pub(crate) fn device(&self, buffer: Buffer) -> Option<&CudaSlice<f32>> {
        match buffer {
            Buffer::Master => self.master.as_ref(),
            Buffer::AdamM => self.m.as_ref(),
            Buffer::AdamV => self.v.as_ref(),
        }
        .map(|s| s as _)
    }

    /// The device slot of `buffer`.
    pub(crate) fn device_slot(&mut self, buffer: Buffer) -> &mut Option<CudaSlice<f32>> {
        match buffer {
            Buffer::Master => &mut self.master,
            Buffer::AdamM => &mut self.m,
            Buffer::AdamV => &mut self.v,
        }
    }

    fn host_mut(&mut self, buffer: Buffer) -> Option<&mut PinnedHostSlice<f32>> {
        match buffer {
            Buffer::Master => self.master_host.as_mut(),
            Buffer::AdamM => self.m_host.as_mut(),
            Buffer::AdamV => self.v_host.as_mut(),
        }
    }
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
        let b = Buffer::from_name(buffer).ok_or_else(|| {
            FsdpError::Config(format!(
                "buffer must be \"master\", \"adam_m\" or \"adam_v\", found {buffer:?}"
            ))
        })?;
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
        let Some(host) = rt.host_mut(b) else {
            return Ok(false);
        };
        let values = host.as_mut_slice().map_err(|e| {
            FsdpError::Cuda(lifecycle_cuda::CudaError::driver(
                rank,
                "reading an offloaded buffer",
                0,
                e,
            ))
        })?;
        match values.get_mut(at) {
            Some(v) => {
                *v = f32::from_bits(v.to_bits() ^ (1 << (bit % 32)));
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
