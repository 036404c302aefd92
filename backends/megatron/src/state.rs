//! The Megatron training state on the GPUs.

use std::ops::Range;

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};
use half::bf16;
use lifecycle_core::{Link, Phase};
use lifecycle_cuda::{alloc_device, CudaError, RankCtx, StreamTimeline};

use crate::pinned::{HostCopy, PinnedPool};
use lifecycle_layout::megatron::MegatronLayout;

/// One training buffer of a rank: on the device (`dev`, authoritative when present) and/or in
/// pinned host chunks (`host`: authoritative while `dev` is `None`; a stale copy otherwise, given
/// back at the next reload).
pub(crate) struct GpuBuffer<T> {
    pub(crate) len: usize,
    pub(crate) dev: Option<CudaSlice<T>>,
    pub(crate) host: Option<HostCopy>,
}

impl<T: DeviceRepr> GpuBuffer<T> {
    pub(crate) fn on_device(dev: CudaSlice<T>, len: usize) -> Self {
        GpuBuffer {
            len,
            dev: Some(dev),
            host: None,
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// Queues the device→host copy of this buffer on the copy stream (pinned chunks taken from
    /// `pinned` first), marked on `tl` as an offload span named `what`. Returns the bytes
    /// queued; 0 when already offloaded.
    pub(crate) fn start_offload(
        &mut self,
        ctx: &RankCtx,
        pinned: &PinnedPool,
        what: &str,
        tl: &mut StreamTimeline,
    ) -> Result<u64, CudaError> {
        let Some(dev) = self.dev.as_ref() else {
            return Ok(0);
        };
        if self.host.is_none() {
            self.host = Some(pinned.take(ctx, self.bytes(), what)?);
        }
        let (src, _sync) = dev.device_ptr(&ctx.copy);
        let bytes = self.bytes() as u64;
        if let Some(host) = self.host.as_mut() {
            // The mark starts after the pinned chunks are taken: the span is the copy alone.
            let mark = tl.begin(ctx, &ctx.copy)?;
            // SAFETY: `dev` holds at least `len` elements (= host.bytes()) and is only read until
            // the caller synchronises the copy stream (finish_offload) before freeing it.
            unsafe { host.download_from(src, &ctx.copy, ctx.rank, what)? };
            let link = Some(Link::DeviceToHost);
            tl.end(
                ctx,
                &ctx.copy,
                mark,
                Phase::Offload,
                what,
                "copy",
                bytes,
                link,
            )?;
        }
        Ok(bytes)
    }

    /// Frees the device copy (after the offload copies finished: the caller synchronised).
    pub(crate) fn drop_device(&mut self) -> u64 {
        if self.host.is_some() && self.dev.take().is_some() {
            self.bytes() as u64
        } else {
            0
        }
    }

    /// Queues the host→device copy of an offloaded buffer on the copy stream, marked on `tl` as
    /// a reload span named `what`. Returns the bytes.
    pub(crate) fn start_reload(
        &mut self,
        ctx: &RankCtx,
        what: &str,
        tl: &mut StreamTimeline,
    ) -> Result<u64, CudaError> {
        if self.dev.is_some() {
            return Ok(0);
        }
        let host = self.host.as_ref().ok_or_else(|| {
            CudaError::Invalid(format!(
                "{what} of rank {} is neither on the device nor on the host",
                ctx.rank
            ))
        })?;
        if host.bytes() != self.bytes() {
            return Err(CudaError::Invalid(format!(
                "{what} of rank {}: the host copy holds {} bytes, the buffer {}",
                ctx.rank,
                host.bytes(),
                self.bytes()
            )));
        }
        // SAFETY: fully written by the host→device copy queued right after on the same stream.
        let mut dev = unsafe { alloc_device::<T>(&ctx.copy, self.len, ctx.rank, what)? };
        let dst = {
            let (dst, _sync) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut dev, &ctx.copy);
            dst
        };
        let bytes = self.bytes() as u64;
        let mark = tl.begin(ctx, &ctx.copy)?;
        // SAFETY: `dev` holds `len` elements = host.bytes(); the chunks stay in `self.host` until
        // the caller synchronised the copy stream and gave them back.
        unsafe { host.upload_to(dst, &ctx.copy, ctx.rank, what)? };
        let link = Some(Link::HostToDevice);
        tl.end(
            ctx,
            &ctx.copy,
            mark,
            Phase::Reload,
            what,
            "copy",
            bytes,
            link,
        )?;
        self.dev = Some(dev);
        Ok(bytes)
    }

    /// Gives the host chunks back once the device copy is authoritative (streams synchronised).
    pub(crate) fn release_host(&mut self, rank: usize, pinned: &PinnedPool) {
        if self.dev.is_some() {
            if let Some(h) = self.host.take() {
                pinned.give(rank, h);
            }
        }
    }

    /// The buffer's elements on the host, from the device or from the pinned copy (streams
    /// synchronised by the caller).
    pub(crate) fn download(&self, ctx: &RankCtx, what: &str) -> Result<Vec<T>, CudaError>
    where
        T: Default + Copy + FromLe,
    {
        match (&self.dev, &self.host) {
            (Some(d), _) => {
                let mut v = ctx.compute.clone_dtoh(d).map_err(ctx.drv(what, 0))?;
                v.truncate(self.len);
                Ok(v)
            }
            (None, Some(h)) => {
                let bytes = h.read(ctx.rank, what)?;
                Ok(bytes
                    .chunks_exact(std::mem::size_of::<T>())
                    .map(T::from_le)
                    .collect())
            }
            (None, None) => Err(CudaError::Invalid(format!(
                "{what}: neither on the device nor on the host"
            ))),
        }
    }
}

/// Element types read back from little-endian bytes.
pub(crate) trait FromLe {
    fn from_le(b: &[u8]) -> Self;
}

impl FromLe for f32 {
    fn from_le(b: &[u8]) -> Self {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl FromLe for bf16 {
    fn from_le(b: &[u8]) -> Self {
        bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))
    }
}

/// One training rank on its GPU.
pub(crate) struct GpuRank {
    /// The global rank.
    pub(crate) rank: usize,
    /// bf16 parameters of its (stage, TP rank): the whole stage buffer.
    pub(crate) params: GpuBuffer<bf16>,
    /// fp32 grads of the stage buffer; freed in rollout mode.
    pub(crate) grads: Option<CudaSlice<f32>>,
    /// Elements of the stage buffer this DP rank's optimizer owns.
    pub(crate) shard: Range<usize>,
    /// fp32 main params of `shard`.
    pub(crate) main: GpuBuffer<f32>,
    /// Adam first moment of `shard`.
    pub(crate) adam_m: GpuBuffer<f32>,
    /// Adam second moment of `shard`.
    pub(crate) adam_v: GpuBuffer<f32>,
}

impl GpuRank {
    fn offloaded(&self) -> bool {
        self.params.dev.is_none()
            || self.main.dev.is_none()
            || self.adam_m.dev.is_none()
            || self.adam_v.dev.is_none()
    }
}

/// The Megatron training state of the ranks this process drives, on their GPUs: per rank the bf16
/// parameters of its (stage, TP rank) in one contiguous buffer and fp32 grads of the same length
/// (as Megatron's distributed optimizer keeps them), plus its DP shard of the fp32 main params
/// and Adam m, v. While offloaded, parameters, main params and Adam moments live in pinned host
/// memory. Built by [`MegatronGpuBackend`](super::MegatronGpuBackend)'s constructors.
pub struct MegatronGpuState {
    pub(crate) layout: MegatronLayout,
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
        Some((r.params.len * (2 + 4) + r.shard.len() * 12) as u64)
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
