//! Building the FSDP training state on the devices: from full host tensors, from the CPU
//! executor's state, or synthetic for benchmarks.

use crate::backend::FsdpBackend;
use crate::FsdpError;
use lifecycle_layout::fsdp::ShardLayout;
use lifecycle_state::HostTrainState;

use lifecycle_cuda::cudarc::driver::CudaSlice;
use lifecycle_cuda::{alloc_zeros, CudaError, OffloadBuffer, RankCtx, RankExecutor};
use lifecycle_layout::{FsdpLayout, HostTensor, TensorData};

use crate::state::{FsdpTrainState, RankTrain};

/// Each local rank's flat fp32 master buffer (padded layout `shards`) cut from full host tensors
/// (in the layout's order; element counts and dtypes checked, floating point widened to fp32).
pub(crate) fn shard_host_tensors(
    locals: &[usize],
    shards: &ShardLayout,
    tensors: &[HostTensor],
) -> Result<Vec<Vec<f32>>, FsdpError> {
    let mut hosts: Vec<Vec<f32>> = vec![vec![0.0; shards.rank_len as usize]; locals.len()];
    for (i, t) in tensors.iter().enumerate() {
        let expected: usize = t.shape.iter().product();
        if t.data.len() != expected {
            return Err(FsdpError::Tensor {
                name: t.name.clone(),
                problem: format!(
                    "shape {:?} needs {expected} elements but the data has {}",
                    t.shape,
                    t.data.len()
                ),
            });
        }
        let full = t.data.to_f32().ok_or_else(|| FsdpError::Tensor {
            name: t.name.clone(),
            problem: format!(
                "dtype {} is not floating point: training weights must be f32, bf16 or f16",
                t.data.dtype()
            ),
        })?;
        let slot = shards.slots.get(i).ok_or_else(|| FsdpError::Tensor {
            name: t.name.clone(),
            problem: format!(
                "tensor {i} of {} given, the layout has {}",
                tensors.len(),
                shards.slots.len()
            ),
        })?;
        for (&rank, host) in locals.iter().zip(hosts.iter_mut()) {
            let held = shards.held_rows(i, rank);
            let src = &full[held.start * slot.cols..held.end * slot.cols];
            let at = slot.offset as usize;
            host[at..at + src.len()].copy_from_slice(src);
        }
    }
    Ok(hosts)
}

/// Fills every held shard of `buf` (a rank's flat fp32 buffer of layout `shards`) on the compute
/// stream: tensor `i`'s element at flat index `e` of the full tensor becomes
/// [`lifecycle_cuda::fill_uniform_value`]`(seed + i, e, scale)`; padding is left as it is.
pub(crate) fn fill_shards_uniform(
    ctx: &RankCtx,
    buf: &mut CudaSlice<f32>,
    shards: &ShardLayout,
    seed: u64,
    scale: f32,
) -> Result<(), CudaError> {
    if (buf.len() as u64) < shards.rank_len {
        return Err(CudaError::Invalid(format!(
            "a shard buffer of {} elements for a layout of {}",
            buf.len(),
            shards.rank_len
        )));
    }
    let base = ctx.addr_mut(buf);
    for (i, slot) in shards.slots.iter().enumerate() {
        let held = shards.held_rows(i, ctx.rank);
        let n = (held.len() * slot.cols) as u64;
        // SAFETY: the slot lies inside `buf` (rank_len elements, checked above), which the
        // caller keeps alive until the compute stream has run the kernel; the element count is
        // the held rows of the slot.
        unsafe {
            ctx.kernels.fill_uniform(
                &ctx.compute,
                base + 4 * slot.offset,
                n,
                seed + i as u64,
                (held.start * slot.cols) as u64,
                scale,
                ctx.rank,
            )?;
        }
    }
    Ok(())
}

impl FsdpBackend {
    /// Builds the training state from full host tensors (floating point; widened to fp32),
    /// sharded over the pool's W ranks (this process uploads the shards of its own ranks). Grads
    /// and Adam moments start at zero.
    pub fn state_from_tensors(
        &self,
        tensors: Vec<HostTensor>,
    ) -> Result<FsdpTrainState, FsdpError> {
        let world = self.pool.world();
        let layout = FsdpLayout::new(
            world,
            tensors.iter().map(|t| (t.name.clone(), t.shape.clone())),
        )?;
        let shards = ShardLayout::new(&layout);
        let hosts = shard_host_tensors(self.pool.local_ranks(), &shards, &tensors)?;
        let mut items: Vec<(Vec<f32>, RankTrain)> = hosts
            .into_iter()
            .map(|h| (h, RankTrain::default()))
            .collect();
        let len = shards.rank_len as usize;
        self.pool.run_each(&mut items, &|ctx, (host, rt)| {
            let mut master = alloc_zeros::<f32>(&ctx.compute, len, ctx.rank, "fp32 master shards")?;
            ctx.compute
                .memcpy_htod(host.as_slice(), &mut master)
                .map_err(ctx.drv("uploading master shards", 0))?;
            rt.master = OffloadBuffer::on_device(master, len);
            rt.grads = Some(alloc_zeros(&ctx.compute, len, ctx.rank, "gradients")?);
            rt.m =
                OffloadBuffer::on_device(alloc_zeros(&ctx.compute, len, ctx.rank, "Adam m")?, len);
            rt.v =
                OffloadBuffer::on_device(alloc_zeros(&ctx.compute, len, ctx.rank, "Adam v")?, len);
            ctx.compute
                .synchronize()
                .map_err(ctx.drv("synchronizing", 0))?;
            Ok(())
        })?;
        Ok(FsdpTrainState {
            layout: std::sync::Arc::new(layout),
            shards,
            ranks: items.into_iter().map(|(_, r)| r).collect(),
            adam_steps: 0,
        })
    }

    /// Builds the training state from the host backend's state: the same model (same fp32 master
    /// weights, same W), grads and Adam moments at zero.
    pub fn state_from_host(&self, host: &HostTrainState) -> Result<FsdpTrainState, FsdpError> {
        if host.world() != self.pool.world() {
            return Err(FsdpError::WorldMismatch {
                state: host.world(),
                pool: self.pool.world(),
            });
        }
        let tensors = host
            .layout()
            .tensors()
            .iter()
            .map(|(name, shape)| {
                Ok(HostTensor {
                    name: name.clone(),
                    shape: shape.clone(),
                    data: TensorData::F32(host.full_master(name)?),
                })
            })
            .collect::<Result<Vec<_>, FsdpError>>()?;
        self.state_from_tensors(tensors)
    }

    /// Builds a synthetic training state directly on the GPUs (no host data): tensor `i`'s element
    /// at flat index `e` is [`lifecycle_cuda::fill_uniform_value`]`(seed + i, e, scale)`; Adam m and
    /// v are filled the same way with seeds offset by 1 000 003 and 2 000 006 (non-zero, so round
    /// trips check real bits); grads are zero. Those m, v are round-trip test data, not an Adam
    /// state (v has negative values): call [`FsdpBackend::reset_optimizer`] before
    /// [`FsdpBackend::adam_step`].
    pub fn synthetic_state(
        &self,
        tensors: &[(String, Vec<usize>)],
        seed: u64,
        scale: f32,
    ) -> Result<FsdpTrainState, FsdpError> {
        let world = self.pool.world();
        let layout = FsdpLayout::new(world, tensors.iter().cloned())?;
        let shards = ShardLayout::new(&layout);
        let mut items: Vec<RankTrain> = self
            .pool
            .local_ranks()
            .iter()
            .map(|_| RankTrain::default())
            .collect();
        let len = shards.rank_len as usize;
        let sh = &shards;
        self.pool.run_each(&mut items, &|ctx, rt| {
            let mut bufs = Vec::new();
            for (k, what) in ["fp32 master shards", "Adam m", "Adam v"]
                .iter()
                .enumerate()
            {
                let mut b = alloc_zeros::<f32>(&ctx.compute, len, ctx.rank, what)?;
                fill_shards_uniform(
                    ctx,
                    &mut b,
                    sh,
                    seed + 1_000_003 * k as u64,
                    if k == 0 { scale } else { scale * 1e-3 },
                )?;
                bufs.push(b);
            }
            let mut take = |what: &str| {
                bufs.pop()
                    .map(|b| OffloadBuffer::on_device(b, len))
                    .ok_or_else(|| CudaError::Invalid(format!("no synthetic {what} buffer")))
            };
            rt.v = take("Adam v")?;
            rt.m = take("Adam m")?;
            rt.master = take("master")?;
            rt.grads = Some(alloc_zeros(&ctx.compute, len, ctx.rank, "gradients")?);
            ctx.compute
                .synchronize()
                .map_err(ctx.drv("synchronizing", 0))?;
            Ok(())
        })?;
        Ok(FsdpTrainState {
            layout: std::sync::Arc::new(layout),
            shards,
            ranks: items,
            adam_steps: 0,
        })
    }
}
