//! Building the training state: from the CPU backend's state, from Hugging Face tensors, or
//! synthetic on the devices.

use crate::backend::MegatronGpuBackend;

use half::bf16;
use lifecycle_cuda::cudarc::driver::{CudaSlice, DeviceRepr};
use lifecycle_cuda::{alloc_device, alloc_zeros, CudaError, OffloadBuffer, RankCtx, RankExecutor};
use lifecycle_layout::{HostTensor, Region2d};

use crate::error::MegatronGpuError;
use crate::state::{GpuRank, MegatronGpuState};
use lifecycle_layout::megatron::{MegatronLayout, ParamKind, ParamSlot};
use lifecycle_state::megatron::{MegatronTrainState, RankTrain, Resident};

impl MegatronGpuBackend {
    /// Builds the training state from the CPU backend's state (the same model on the same W):
    /// bf16 params, main params, Adam m, v and grads (zeros where the host freed them) of this
    /// process's ranks uploaded as they are, offloaded or not.
    pub fn state_from_host(
        &self,
        host: &MegatronTrainState,
    ) -> Result<MegatronGpuState, MegatronGpuError> {
        if host.world() != self.pool.world() {
            return Err(self.world_mismatch(host.world(), host.world()));
        }
        let mut items: Vec<(&RankTrain, usize, Option<GpuRank>)> = self
            .locals()
            .iter()
            .filter_map(|&r| Some((host.rank(r)?, r, None)))
            .collect();
        self.pool.run_each(&mut items, &|ctx, (src, rank, out)| {
            let n = src.params.values().len();
            let params = upload(ctx, src.params.values(), "bf16 parameters")?;
            let grads = match &src.grads {
                Some(g) => upload(ctx, g, "gradients")?,
                None => alloc_zeros(&ctx.compute, n, ctx.rank, "gradients")?,
            };
            let main = upload(ctx, src.main.values(), "fp32 main params")?;
            let m = upload(ctx, src.adam_m.values(), "Adam m")?;
            let v = upload(ctx, src.adam_v.values(), "Adam v")?;
            ctx.compute
                .synchronize()
                .map_err(ctx.drv("uploading the training state", 0))?;
            let k = src.shard.len();
            *out = Some(GpuRank {
                rank: *rank,
                params: OffloadBuffer::on_device(params, n),
                grads: Some(grads),
                shard: src.shard.clone(),
                main: OffloadBuffer::on_device(main, k),
                adam_m: OffloadBuffer::on_device(m, k),
                adam_v: OffloadBuffer::on_device(v, k),
            });
            Ok(())
        })?;
        Ok(MegatronGpuState {
            layout: std::sync::Arc::new(host.layout().clone()),
            ranks: items.into_iter().filter_map(|(_, _, r)| r).collect(),
            adam_steps: host.adam_steps(),
        })
    }

    /// Builds the training state from full Hugging Face tensors (checked and sharded as
    /// [`MegatronTrainState::from_hf`] does, then uploaded).
    pub fn state_from_hf(
        &self,
        layout: MegatronLayout,
        tensors: Vec<HostTensor>,
    ) -> Result<MegatronGpuState, MegatronGpuError> {
        if layout.world() != self.pool.world() {
            return Err(self.world_mismatch(layout.world(), layout.world()));
        }
        self.state_from_host(&MegatronTrainState::from_hf(layout, tensors)?)
    }

    /// Builds a synthetic training state directly on the GPUs (no host data), for benchmarks:
    /// every parameter of a rank's buffer is filled by the counter-based hash of
    /// [`lifecycle_cuda::fill_uniform_value`] (seeded by parameter kind, layer and TP rank, an
    /// expert tensor by its global expert and expert TP rank; norms and routers the same on every
    /// TP rank, a tied output layer the same as the embedding), scaled by `scale`; main params
    /// are those values in fp32, bf16 params their rounding; Adam m and v hold small hash values
    /// too (so round trips check real bits); grads are zero. DP (and expert DP) replicas are
    /// identical. Replicated kv heads (query groups < TP) are not made equal across TP ranks.
    pub fn synthetic_state(
        &self,
        layout: MegatronLayout,
        seed: u64,
        scale: f32,
    ) -> Result<MegatronGpuState, MegatronGpuError> {
        if layout.world() != self.pool.world() {
            return Err(self.world_mismatch(layout.world(), layout.world()));
        }
        let l = &layout;
        let mut items: Vec<Option<GpuRank>> = self.locals().iter().map(|_| None).collect();
        self.pool.run_each(&mut items, &|ctx, out| {
            let c = l.coords(ctx.rank);
            let n = l.stage_len(c.pp);
            let shard = l.optimizer_shard(ctx.rank);
            let rank = ctx.rank;
            // The fp32 values are made in the grads buffer, which is zeroed at the end.
            let mut grads = alloc_zeros::<f32>(&ctx.compute, n, rank, "gradients")?;
            let gp = ctx.addr_mut(&mut grads);
            for slot in l.stage_slots(c.pp) {
                let s = slot_seed(seed, l, slot, rank);
                // SAFETY: the slot lies inside the stage buffer of n elements.
                unsafe {
                    ctx.kernels.fill_uniform(
                        &ctx.compute,
                        gp + 4 * slot.offset as u64,
                        slot.numel() as u64,
                        s,
                        0,
                        scale,
                        rank,
                    )?
                };
            }
            // SAFETY: fully written by the cast right after.
            let mut params = unsafe { alloc_device::<bf16>(&ctx.compute, n, rank, "parameters")? };
            let pp = ctx.addr_mut(&mut params);
            let all = Region2d {
                rows: 1,
                cols: n as u64,
                src_ld: n as u64,
                dst_ld: n as u64,
            };
            // SAFETY: both buffers hold n elements and live until the synchronisation below (no
            // non-finite report: 0).
            unsafe {
                ctx.kernels
                    .cast_f32_bf16(&ctx.compute, gp, pp, all, 0, rank)?
            };
            let k = shard.len();
            // SAFETY: fully written by the copy right after (a zero-length shard is never read).
            let mut main = unsafe { alloc_device::<f32>(&ctx.compute, k, rank, "main params")? };
            for (range, at) in shard.parts() {
                if !range.is_empty() {
                    let len = range.len();
                    ctx.compute
                        .memcpy_dtod(&grads.slice(range), &mut main.slice_mut(at..at + len))
                        .map_err(ctx.drv("copying main params", (len * 4) as u64))?;
                }
            }
            let mut moments = Vec::new();
            for (i, what) in ["Adam m", "Adam v"].into_iter().enumerate() {
                let mut b = alloc_zeros::<f32>(&ctx.compute, k, rank, what)?;
                let bp = ctx.addr_mut(&mut b);
                let s = seed ^ (0xA5A5_0000 + i as u64) ^ ((c.pp * l.tp() + c.tp) as u64) << 32;
                for (range, at) in shard.parts() {
                    // SAFETY: `b` holds k elements, `at + range.len()` of them in this part.
                    unsafe {
                        ctx.kernels.fill_uniform(
                            &ctx.compute,
                            bp + 4 * at as u64,
                            range.len() as u64,
                            s,
                            range.start as u64,
                            scale * 1e-3,
                            rank,
                        )?
                    };
                }
                moments.push(b);
            }
            ctx.compute
                .memset_zeros(&mut grads)
                .map_err(ctx.drv("zeroing gradients", (n * 4) as u64))?;
            ctx.compute
                .synchronize()
                .map_err(ctx.drv("building the synthetic state", 0))?;
            let v = moments.pop();
            let m = moments.pop();
            let (Some(m), Some(v)) = (m, v) else {
                return Err(CudaError::Invalid("Adam moments were not built".into()));
            };
            *out = Some(GpuRank {
                rank,
                params: OffloadBuffer::on_device(params, n),
                grads: Some(grads),
                shard,
                main: OffloadBuffer::on_device(main, k),
                adam_m: OffloadBuffer::on_device(m, k),
                adam_v: OffloadBuffer::on_device(v, k),
            });
            Ok(())
        })?;
        Ok(MegatronGpuState {
            layout: std::sync::Arc::new(layout),
            ranks: items.into_iter().flatten().collect(),
            adam_steps: 0,
        })
    }
}

/// `Resident::Device` or `Resident::Host` as the GPU buffer is.
pub(crate) fn resident<T>(on_device: bool, v: Vec<T>) -> Resident<T> {
    if on_device {
        Resident::Device(v)
    } else {
        Resident::Host(v.into_boxed_slice())
    }
}

/// Uploads `data` to a new device buffer on the compute stream.
pub(crate) fn upload<T: DeviceRepr>(
    ctx: &RankCtx,
    data: &[T],
    what: &str,
) -> Result<CudaSlice<T>, CudaError> {
    let bytes = std::mem::size_of_val(data) as u64;
    // SAFETY: fully written by the copy right after (an empty buffer is never read).
    let mut d = unsafe { alloc_device::<T>(&ctx.compute, data.len(), ctx.rank, what)? };
    if !data.is_empty() {
        ctx.compute
            .memcpy_htod(data, &mut d.slice_mut(0..data.len()))
            .map_err(ctx.drv(what, bytes))?;
    }
    Ok(d)
}

/// The fill seed of a parameter of `rank`: by kind, layer and TP rank (replicated norms and
/// routers: TP rank 0; a tied output layer: the embedding's); an expert tensor by its global
/// expert and expert tensor-parallel rank, so its expert data-parallel replicas are equal.
pub(crate) fn slot_seed(seed: u64, layout: &MegatronLayout, slot: &ParamSlot, rank: usize) -> u64 {
    let tp = match (slot.expert, layout.expert_coords(rank)) {
        (Some(local), Some(c)) => layout.global_expert(rank, local) * 0x1_0000 + c.etp,
        _ => layout.coords(rank).tp,
    };
    let tied_head = slot.kind == ParamKind::OutputLayer && layout.model().tied_embeddings;
    let kind = if tied_head {
        ParamKind::WordEmbedding
    } else {
        slot.kind
    };
    let replicated = matches!(
        kind,
        ParamKind::InputNorm
            | ParamKind::PreMlpNorm
            | ParamKind::FinalNorm
            | ParamKind::QNorm
            | ParamKind::KNorm
            | ParamKind::Router
            | ParamKind::SharedGate
    );
    let t = if replicated { 0 } else { tp as u64 };
    let layer = slot.layer.map_or(0xFFFF, |l| l as u64);
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((kind as u64) << 56) ^ (layer << 24) ^ (t << 8)
}
