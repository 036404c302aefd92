//! The GPU executor's settings.

use lifecycle_cuda::Transport;

use lifecycle_layout::megatron::schedule::ScheduleOptions;

/// Settings of the GPU executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuConfig {
    /// How remote runs travel ([`Transport::Auto`]: peer copies where possible). The fields
    /// below on buckets, slots and messages apply to NCCL steps only.
    pub transport: Transport,
    /// The most bf16 bytes one rank receives from peers in one step: the plan's bucket budget
    /// ([`BucketConfig::bucket_bytes`](lifecycle_layout::megatron::BucketConfig::bucket_bytes)) and the size of a receive slot.
    pub bucket_bytes: u64,
    /// Steps in flight, i.e. send and receive slots per rank: with 2 or more, packing step
    /// `k + 1` and unpacking step `k - 1` overlap the network work of step `k`.
    pub in_flight: usize,
    /// Remote runs of at least this many bytes travel as their own NCCL message, straight from
    /// the sender's parameter buffer and into the receiver's rollout buffer where they are
    /// contiguous (see [`ScheduleOptions::direct_min`]); `u64::MAX` packs everything.
    pub direct_min_bytes: u64,
    /// Contiguous local runs of at least this many bytes are copied with the driver's
    /// device-to-device copy instead of the tile kernel; `u64::MAX`: tiles only.
    pub memcpy_min_bytes: u64,
    /// With peer copies, remote runs below this many bytes are written by one tile-kernel
    /// launch per peer instead of one copy-engine copy each (see
    /// [`ScheduleOptions::peer_tile_max`]); `0`: copy engines only.
    pub peer_tile_max_bytes: u64,
    /// With peer copies, the driver's copies of large local runs (`memcpy_min_bytes`) run on
    /// their own stream beside the tile kernel instead of after it.
    pub split_local_bulk: bool,
    /// Thread blocks per SM of the tile kernel while remote work runs (fewer leave the SMs and
    /// memory bandwidth to NCCL or the copy engines); a transfer without remote work uses 8.
    pub overlap_blocks_per_sm: u32,
}

impl GpuConfig {
    /// The schedule options these settings give, with peer copies or NCCL steps.
    pub fn schedule_options(&self, peer_copy: bool) -> ScheduleOptions {
        let elems = |b: u64| usize::try_from(b / 2).unwrap_or(usize::MAX);
        ScheduleOptions {
            direct_min: elems(self.direct_min_bytes),
            memcpy_min: elems(self.memcpy_min_bytes),
            peer_copy,
            peer_tile_max: elems(self.peer_tile_max_bytes),
        }
    }
}

impl Default for GpuConfig {
    /// Peer copies where possible; for NCCL steps 256 MiB buckets, 2 in flight, every remote
    /// run packed into the slots; 4 blocks per SM for local copies next to remote work;
    /// contiguous local runs from 16 MiB by the driver's copy, the rest by the tile kernel;
    /// remote runs under 1 MiB by the tile kernel, larger ones by the copy engines.
    /// Direct messages (`direct_min_bytes`, e.g. 4 MiB) are opt-in.
    fn default() -> Self {
        GpuConfig {
            transport: Transport::Auto,
            bucket_bytes: 256 << 20,
            in_flight: 2,
            direct_min_bytes: u64::MAX,
            memcpy_min_bytes: 16 << 20,
            peer_tile_max_bytes: 1 << 20,
            split_local_bulk: false,
            overlap_blocks_per_sm: 4,
        }
    }
}
