//! [`MegatronGpuBackend`]: the [`Reshard`] implementation on NVIDIA GPUs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{CudaSlice, DeviceRepr};
use half::bf16;
use lifecycle_core::{Link, MemoryPolicy, Phase, Reshard, SwitchContext};
use lifecycle_cuda::{
    alloc_device, alloc_rollout_buffers, alloc_zeros, peer_bases, record_spans, record_transfer,
    run_program, CudaError, DeviceProgram, OffloadBuffer, RankCtx, RankExecutor, RankMoved,
    RankSpans, RolloutBuffer, RunOptions, SourceBuf, StreamTimeline, ThreadRankPool, TileKernel,
    Transport,
};
use lifecycle_host::MemoryMeter;
use lifecycle_layout::{HostRollout, HostTensor, Region2d, RolloutEntry};

use crate::error::MegatronGpuError;
use crate::state::{GpuRank, MegatronGpuState};
use lifecycle_cuda::PinnedPool;
use lifecycle_host::megatron::{MegatronTrainState, RankTrain, Resident};
use lifecycle_layout::megatron::schedule::{
    build_rank, rollout_offsets, RankSchedule, ScheduleOptions,
};
use lifecycle_layout::megatron::{
    plan_megatron_to_tp, BucketConfig, MegatronLayout, MegatronPlan, ParamKind, ParamSlot,
    RolloutLayout, StepShape,
};

/// Settings of the GPU executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuConfig {
    /// How remote runs travel ([`Transport::Auto`]: peer copies where possible). The fields
    /// below on buckets, slots and messages apply to NCCL steps only.
    pub transport: Transport,
    /// The most bf16 bytes one rank receives from peers in one step: the plan's bucket budget
    /// ([`BucketConfig::bucket_bytes`]) and the size of a receive slot.
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

static NEXT_PLAN: AtomicU64 = AtomicU64::new(1);

/// A validated plan and the schedules of this process's ranks.
#[derive(Debug)]
pub struct MegatronGpuPlan {
    id: u64,
    config: GpuConfig,
    peer_copy: bool,
    plan: MegatronPlan,
    offsets: Vec<usize>,
    len: usize,
    ranks: Vec<RankSchedule>,
}

impl MegatronGpuPlan {
    /// The planner's plan (every rank).
    pub fn plan(&self) -> &MegatronPlan {
        &self.plan
    }

    /// The schedule of global rank `rank`, when this process drives it.
    pub fn schedule(&self, rank: usize) -> Option<&RankSchedule> {
        self.ranks.iter().find(|s| s.rank == rank)
    }

    /// Elements of one rank's rollout buffer.
    pub fn rollout_len(&self) -> usize {
        self.len
    }

    /// Whether remote runs travel as peer copies (else as NCCL steps).
    pub fn peer_copy(&self) -> bool {
        self.peer_copy
    }
}

/// Per-rank resources of the backend: the step program of the last plan (its copy tables
/// uploaded once per plan).
struct RankRes {
    program: Option<(u64, DeviceProgram)>,
}

/// Reshards the Megatron training layout into the fused bf16 tensor-parallel rollout layout on
/// the GPUs of a [`ThreadRankPool`].
///
/// Enter runs the plan ([`plan_megatron_to_tp`]): each rank copies the runs it holds itself from
/// its parameter buffer into its rollout buffer (auxiliary stream), and receives only the bytes
/// of its fused slices it does not hold, step by step, one NCCL group per step (NCCL stream):
/// large contiguous runs straight between the parameter and rollout buffers, the rest packed by
/// the sender into a send slot and unpacked by the receiver from a receive slot (compute stream);
/// steps overlap with [`GpuConfig::in_flight`] slots. bf16 to bf16: no cast. Offload copies (pinned host memory from a [`PinnedPool`] kept between switches)
/// run on the copy stream meanwhile. Exit releases the rollout and reloads.
///
/// ```no_run
/// use std::sync::Arc;
/// use lifecycle_core::Lifecycle;
/// use lifecycle_cuda::ThreadRankPool;
/// use lifecycle_layout::HostTensor;
/// use lifecycle_megatron::MegatronGpuBackend;
/// use lifecycle_layout::megatron::{MegatronLayout, RolloutLayout, RolloutVocab};
/// use lifecycle_layout::ModelSpec;
///
/// let pool = Arc::new(ThreadRankPool::new(2)?);
/// let model = ModelSpec::tiny();
/// let tensors = model.hf_tensors().into_iter().map(|(name, shape)| {
///     let n = shape.iter().product();
///     HostTensor::f32(name, shape, vec![0.5; n])
/// }).collect();
/// let backend = MegatronGpuBackend::new(pool, RolloutLayout::new(2, RolloutVocab::PadToMultipleOf(1)))?;
/// let state = backend.state_from_hf(MegatronLayout::new(model, 1, 2, 1)?, tensors)?;
/// let mut lc = Lifecycle::new(backend, state);
/// let session = lc.rollout()?;
/// let host = session.backend().download_rollout(&session.weights())?;
/// assert_eq!(host.ranks.len(), 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct MegatronGpuBackend {
    pool: Arc<ThreadRankPool>,
    rollout: RolloutLayout,
    config: GpuConfig,
    pinned: Arc<PinnedPool>,
    ranks: Vec<RankRes>,
    cached: Mutex<Option<Arc<MegatronGpuPlan>>>,
}

impl std::fmt::Debug for MegatronGpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MegatronGpuBackend")
            .field("world", &self.pool.world())
            .field("rollout", &self.rollout)
            .field("config", &self.config)
            .finish()
    }
}

impl MegatronGpuBackend {
    /// A backend over `pool`'s GPUs producing `rollout`, with [`GpuConfig::default`] and a fresh
    /// [`PinnedPool`]; compiles the copy kernel on every rank.
    pub fn new(
        pool: Arc<ThreadRankPool>,
        rollout: RolloutLayout,
    ) -> Result<Self, MegatronGpuError> {
        // Compiles (once per process) and loads the tile kernel now: a missing NVRTC or a bad
        // architecture shows here, not at the first switch.
        let loaded = pool.run(&|ctx| TileKernel::load(ctx).map(|_| ()))?;
        Ok(MegatronGpuBackend {
            pool,
            rollout,
            config: GpuConfig::default(),
            pinned: Arc::new(PinnedPool::default()),
            ranks: loaded.iter().map(|()| RankRes { program: None }).collect(),
            cached: Mutex::new(None),
        })
    }

    /// Changes the settings (checked: a budget of at least 2 bytes, at least 1 step in flight).
    pub fn with_config(mut self, config: GpuConfig) -> Result<Self, MegatronGpuError> {
        if config.bucket_bytes < 2 || config.in_flight == 0 || config.overlap_blocks_per_sm == 0 {
            return Err(MegatronGpuError::Config(format!(
                "bucket_bytes must be at least 2 (one bf16 element), in_flight at least 1 (2 or \
                 more to overlap packing with the network) and overlap_blocks_per_sm at least 1; \
                 found {} bytes, {} in flight, {} blocks per SM",
                config.bucket_bytes, config.in_flight, config.overlap_blocks_per_sm
            )));
        }
        self.config = config;
        Ok(self)
    }

    /// Uses `pinned` for offloaded state (share one pool between backends so they reuse the
    /// same pinned memory).
    pub fn with_pinned_pool(mut self, pinned: Arc<PinnedPool>) -> Self {
        self.pinned = pinned;
        self
    }

    /// The settings.
    pub fn config(&self) -> GpuConfig {
        self.config
    }

    /// The rollout layout.
    pub fn rollout_layout(&self) -> &RolloutLayout {
        &self.rollout
    }

    /// The rank pool.
    pub fn pool(&self) -> &Arc<ThreadRankPool> {
        &self.pool
    }

    /// The pinned host memory of offloads.
    pub fn pinned_pool(&self) -> &Arc<PinnedPool> {
        &self.pinned
    }

    fn locals(&self) -> &[usize] {
        self.pool.local_ranks()
    }

    fn world_mismatch(&self, state_world: usize, state_local: usize) -> MegatronGpuError {
        MegatronGpuError::WorldMismatch {
            state: state_world,
            state_local,
            pool: self.pool.world(),
            pool_local: self.locals().len(),
        }
    }

    fn check_state(&self, state: &MegatronGpuState) -> Result<(), MegatronGpuError> {
        if state.world() != self.pool.world() || state.local_ranks() != self.locals() {
            return Err(self.world_mismatch(state.world(), state.ranks.len()));
        }
        Ok(())
    }

    fn check_plan(
        &self,
        plan: &MegatronGpuPlan,
        state: &MegatronGpuState,
    ) -> Result<(), MegatronGpuError> {
        self.check_state(state)?;
        let ranks_match = plan
            .ranks
            .iter()
            .map(|s| s.rank)
            .eq(self.locals().iter().copied());
        if plan.plan.train != state.layout || plan.plan.rollout != self.rollout || !ranks_match {
            return Err(MegatronGpuError::PlanMismatch);
        }
        Ok(())
    }

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
            layout: host.layout().clone(),
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
    /// every parameter of a (stage, TP rank) buffer is filled by the counter-based hash of
    /// [`lifecycle_cuda::fill_uniform_value`] (seeded by parameter kind, layer and TP rank;
    /// norms the same on every TP rank, a tied output layer the same as the embedding), scaled
    /// by `scale`; main params are those values in fp32, bf16 params their rounding; Adam m and v
    /// hold small hash values too (so round trips check real bits); grads are zero. DP replicas
    /// are identical. Replicated kv heads (query groups < TP) are not made equal across TP ranks.
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
            let shard = l.dp_shard(c.pp, c.dp);
            let rank = ctx.rank;
            // The fp32 values are made in the grads buffer, which is zeroed at the end.
            let mut grads = alloc_zeros::<f32>(&ctx.compute, n, rank, "gradients")?;
            let gp = ctx.addr_mut(&mut grads);
            for slot in l.stage_slots(c.pp) {
                let s = slot_seed(seed, l, slot, c.tp);
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
            // SAFETY: both buffers hold n elements and live until the synchronisation below.
            unsafe { ctx.kernels.cast_f32_bf16(&ctx.compute, gp, pp, all, rank)? };
            let k = shard.len();
            // SAFETY: fully written by the copy right after (a zero-length shard is never read).
            let mut main = unsafe { alloc_device::<f32>(&ctx.compute, k, rank, "main params")? };
            if k > 0 {
                ctx.compute
                    .memcpy_dtod(&grads.slice(shard.clone()), &mut main.slice_mut(0..k))
                    .map_err(ctx.drv("copying main params", (k * 4) as u64))?;
            }
            let mut moments = Vec::new();
            for (i, what) in ["Adam m", "Adam v"].into_iter().enumerate() {
                let mut b = alloc_zeros::<f32>(&ctx.compute, k, rank, what)?;
                let bp = ctx.addr_mut(&mut b);
                let s = seed ^ (0xA5A5_0000 + i as u64) ^ ((c.pp * l.tp() + c.tp) as u64) << 32;
                // SAFETY: `b` holds k elements.
                unsafe {
                    ctx.kernels.fill_uniform(
                        &ctx.compute,
                        bp,
                        k as u64,
                        s,
                        shard.start as u64,
                        scale * 1e-3,
                        rank,
                    )?
                };
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
            layout,
            ranks: items.into_iter().flatten().collect(),
            adam_steps: 0,
        })
    }

    /// The training state downloaded into the CPU backend's state (single-process mode): bf16
    /// params, grads, main params and Adam moments bit for bit; buffers offloaded on the GPU side
    /// are offloaded in the copy too. For round-trip checks and comparisons with the CPU backend.
    pub fn download_state(
        &self,
        state: &MegatronGpuState,
    ) -> Result<MegatronTrainState, MegatronGpuError> {
        self.check_state(state)?;
        if self.locals().len() != self.pool.world() {
            return Err(MegatronGpuError::NotAllLocal {
                operation: "downloading the whole training state",
                world: self.pool.world(),
                local: self.locals().len(),
            });
        }
        let mut items: Vec<&GpuRank> = state.ranks.iter().collect();
        let ranks = self.pool.run_each(&mut items, &|ctx, r| {
            ctx.sync_all()?;
            let params = r.params.download(ctx, "downloading bf16 parameters")?;
            let main = r.main.download(ctx, "downloading main params")?;
            let m = r.adam_m.download(ctx, "downloading Adam m")?;
            let v = r.adam_v.download(ctx, "downloading Adam v")?;
            let grads = match &r.grads {
                Some(g) => {
                    let mut g = ctx
                        .compute
                        .clone_dtoh(g)
                        .map_err(ctx.drv("downloading grads", 0))?;
                    g.truncate(r.params.len());
                    Some(g)
                }
                None => None,
            };
            let mut current = grads.as_ref().map_or(0, |g| g.len() * 4);
            for (on, bytes) in [
                (!r.params.is_offloaded(), r.params.bytes()),
                (!r.main.is_offloaded(), r.main.bytes()),
                (!r.adam_m.is_offloaded(), r.adam_m.bytes()),
                (!r.adam_v.is_offloaded(), r.adam_v.bytes()),
            ] {
                if on {
                    current += bytes;
                }
            }
            Ok(RankTrain {
                params: resident(!r.params.is_offloaded(), params),
                grads,
                shard: r.shard.clone(),
                main: resident(!r.main.is_offloaded(), main),
                adam_m: resident(!r.adam_m.is_offloaded(), m),
                adam_v: resident(!r.adam_v.is_offloaded(), v),
                meter: MemoryMeter {
                    current: current as u64,
                    peak: current as u64,
                },
            })
        })?;
        Ok(MegatronTrainState::from_ranks(
            state.layout.clone(),
            ranks,
            state.adam_steps,
        )?)
    }

    /// Downloads the rollout weights of this process's ranks to host memory (rollout order,
    /// the CPU backend's layout), for bit comparisons.
    pub fn download_rollout(
        &self,
        rollout: &RolloutBuffer,
    ) -> Result<HostRollout, MegatronGpuError> {
        Ok(rollout.download(&*self.pool)?)
    }

    /// Allocates the pinned host memory an offload of `state` under `memory` needs, into the
    /// pinned pool (so the first switch does not pay for pinning). Returns the bytes the pool
    /// caches for this process's ranks afterwards.
    pub fn reserve_pinned(
        &self,
        state: &MegatronGpuState,
        memory: MemoryPolicy,
    ) -> Result<u64, MegatronGpuError> {
        self.check_state(state)?;
        let pinned = &*self.pinned;
        let mut items: Vec<&GpuRank> = state.ranks.iter().collect();
        let cached = self.pool.run_each(&mut items, &|ctx, r| {
            let mut sizes = Vec::new();
            if memory.offload_params {
                sizes.extend([r.params.bytes(), r.main.bytes()]);
            }
            if memory.offload_optimizer {
                sizes.extend([r.adam_m.bytes(), r.adam_v.bytes()]);
            }
            let mut taken = Vec::new();
            let mut failure = None;
            for n in sizes {
                match pinned.take(ctx, n, "reserved pinned memory") {
                    Ok(c) => taken.push(c),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
            for c in taken {
                pinned.give(ctx.rank, c);
            }
            match failure {
                Some(e) => Err(e),
                None => Ok(pinned.cached_bytes(ctx.rank)),
            }
        })?;
        Ok(cached.iter().sum())
    }

    /// Gives the device memory cached by each rank's stream-ordered pool (freed rollout weights,
    /// offloaded state, staging) back to the driver.
    pub fn trim_device_memory(&self) -> Result<(), MegatronGpuError> {
        self.pool.run(&|ctx| ctx.trim_pool())?;
        Ok(())
    }

    fn entries(plan: &MegatronGpuPlan) -> Vec<RolloutEntry> {
        plan.plan
            .tensors
            .iter()
            .zip(&plan.offsets)
            .map(|(t, &offset)| RolloutEntry::new(t.name.clone(), t.shape.clone(), offset))
            .collect()
    }

    /// Runs every local rank's schedule into `rolls`, starting the offload copies of `memory`
    /// first so they overlap it. With `tracing`, each rank's work is marked on a
    /// [`StreamTimeline`] (returned in its [`RankMoved`], read by [`Self::finish_offload`]).
    fn transfer(
        &mut self,
        plan: &MegatronGpuPlan,
        state: &mut MegatronGpuState,
        rolls: &mut [CudaSlice<bf16>],
        memory: MemoryPolicy,
        tracing: bool,
    ) -> Result<Vec<RankMoved>, MegatronGpuError> {
        let pinned = &*self.pinned;
        let config = plan.config;
        // Peer copies write into every rank's rollout buffer: their addresses by global rank.
        let bases = if plan
            .ranks
            .iter()
            .any(|s| !s.pushes.is_empty() || !s.peer_tiles.is_empty())
        {
            peer_bases(&*self.pool, rolls)?
        } else {
            vec![0u64; self.pool.world()]
        };
        let bases = &bases;
        let mut items: Vec<(
            &mut GpuRank,
            &mut RankRes,
            &mut CudaSlice<bf16>,
            &RankSchedule,
        )> = state
            .ranks
            .iter_mut()
            .zip(self.ranks.iter_mut())
            .zip(rolls.iter_mut())
            .zip(&plan.ranks)
            .map(|(((rt, res), roll), s)| (rt, res, roll, s))
            .collect();
        let id = plan.id;
        let moved = self.pool.run_each(&mut items, &|ctx, (rt, res, roll, s)| {
            let mut tl = StreamTimeline::new(ctx, tracing)?;
            ctx.order(&ctx.compute, &ctx.copy)?;
            // Offload copies first, on the copy stream: they overlap everything below.
            if memory.offload_optimizer {
                rt.adam_m
                    .start_offload(ctx, pinned, "offloading Adam m", &mut tl)?;
                rt.adam_v
                    .start_offload(ctx, pinned, "offloading Adam v", &mut tl)?;
            }
            if memory.offload_params {
                rt.main
                    .start_offload(ctx, pinned, "offloading main params", &mut tl)?;
                rt.params
                    .start_offload(ctx, pinned, "offloading bf16 parameters", &mut tl)?;
            }
            let Some(params) = rt.params.device() else {
                return Err(CudaError::Invalid(
                    "the bf16 parameters are offloaded: leave rollout mode first".into(),
                ));
            };
            if res.program.as_ref().map(|p| p.0) != Some(id) {
                res.program = None;
                let shape = StepShape {
                    world: ctx.world,
                    source_elems: params.len() as u64,
                    rollout_elems: plan.len as u64,
                    in_flight: config.in_flight,
                    peer_copy: plan.peer_copy,
                    split_local_bulk: config.split_local_bulk,
                };
                let steps = s
                    .rank_steps(shape)
                    .map_err(|e| CudaError::Invalid(e.to_string()))?;
                res.program = Some((id, DeviceProgram::new(ctx, steps, true)?));
            }
            let Some((_, program)) = res.program.as_ref() else {
                return Err(CudaError::Invalid("no step program".into()));
            };
            let opts = RunOptions {
                overlap_blocks_per_sm: config.overlap_blocks_per_sm,
            };
            let source = SourceBuf::Bf16(params);
            let out = run_program(ctx, program, source, roll, bases, opts, &mut tl);
            let mut moved = out?;
            moved.timeline = Some(tl);
            Ok(moved)
        })?;
        Ok(moved)
    }

    /// Records the transfer phase (metrics, and its host span when tracing) started at `start`.
    /// Waits for the offload copies, then frees what the policy moved out, and the grads; reads
    /// the transfer's device timelines (every stream is synchronised by then) into the trace.
    fn finish_offload(
        &self,
        state: &mut MegatronGpuState,
        ctx: &mut SwitchContext<'_>,
        moved: &mut [RankMoved],
    ) -> Result<(), MegatronGpuError> {
        let memory = ctx.memory;
        let spans = ctx.rec.phase(Phase::Offload, |scope| {
            let mut items: Vec<(&mut GpuRank, Option<StreamTimeline>)> = state
                .ranks
                .iter_mut()
                .zip(moved.iter_mut().map(|m| m.timeline.take()))
                .collect();
            let out = self.pool.run_each(&mut items, &|c, (rt, tl)| {
                c.sync_all()?;
                let spans = match tl.take() {
                    Some(tl) => tl.finish()?,
                    None => RankSpans::default(),
                };
                let mut bytes = 0;
                if memory.offload_params {
                    bytes += rt.params.drop_device() + rt.main.drop_device();
                }
                if memory.offload_optimizer {
                    bytes += rt.adam_m.drop_device() + rt.adam_v.drop_device();
                }
                rt.grads = None;
                c.sync_all()?;
                Ok((bytes, spans))
            })?;
            scope.add_bytes(Link::DeviceToHost, out.iter().map(|o| o.0).sum());
            Ok::<Vec<RankSpans>, MegatronGpuError>(out.into_iter().map(|o| o.1).collect())
        })?;
        record_spans(ctx, self.locals(), &spans);
        Ok(())
    }
}

/// `Resident::Device` or `Resident::Host` as the GPU buffer is.
fn resident<T>(on_device: bool, v: Vec<T>) -> Resident<T> {
    if on_device {
        Resident::Device(v)
    } else {
        Resident::Host(v.into_boxed_slice())
    }
}

/// Uploads `data` to a new device buffer on the compute stream.
fn upload<T: DeviceRepr>(ctx: &RankCtx, data: &[T], what: &str) -> Result<CudaSlice<T>, CudaError> {
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

/// The fill seed of a parameter: by kind, layer and TP rank (replicated norms: TP rank 0; a tied
/// output layer: the embedding's).
fn slot_seed(seed: u64, layout: &MegatronLayout, slot: &ParamSlot, tp: usize) -> u64 {
    let tied_head = slot.kind == ParamKind::OutputLayer && layout.model().tied_embeddings;
    let kind = if tied_head {
        ParamKind::WordEmbedding
    } else {
        slot.kind
    };
    let replicated = matches!(
        kind,
        ParamKind::InputNorm | ParamKind::PreMlpNorm | ParamKind::FinalNorm
    );
    let t = if replicated { 0 } else { tp as u64 };
    let layer = slot.layer.map_or(0xFFFF, |l| l as u64);
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ ((kind as u64) << 56) ^ (layer << 24) ^ (t << 8)
}

impl Reshard for MegatronGpuBackend {
    type TrainState = MegatronGpuState;
    type Rollout = RolloutBuffer;
    type Plan = Arc<MegatronGpuPlan>;
    type Error = MegatronGpuError;

    fn plan(&self, state: &MegatronGpuState) -> Result<Arc<MegatronGpuPlan>, MegatronGpuError> {
        self.check_state(state)?;
        let bucket = BucketConfig {
            bucket_bytes: self.config.bucket_bytes,
        };
        let mut cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = cached.as_ref() {
            let same = p.plan.train == state.layout
                && p.plan.rollout == self.rollout
                && p.config == self.config
                && p.ranks
                    .iter()
                    .map(|s| s.rank)
                    .eq(self.locals().iter().copied());
            if same {
                return Ok(p.clone());
            }
        }
        let peer_copy = self.config.transport.resolve(&self.pool)?;
        let plan = plan_megatron_to_tp(&state.layout, &self.rollout, bucket)?;
        let (offsets, len) = rollout_offsets(&plan);
        let opts = self.config.schedule_options(peer_copy);
        let ranks = self
            .locals()
            .iter()
            .map(|&r| build_rank(&plan, &offsets, r, opts))
            .collect();
        let p = Arc::new(MegatronGpuPlan {
            id: NEXT_PLAN.fetch_add(1, Ordering::Relaxed),
            config: self.config,
            peer_copy,
            plan,
            offsets,
            len,
            ranks,
        });
        *cached = Some(p.clone());
        Ok(p)
    }

    fn enter(
        &mut self,
        plan: &Arc<MegatronGpuPlan>,
        state: &mut MegatronGpuState,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<RolloutBuffer, MegatronGpuError> {
        self.check_plan(plan, state)?;
        if state.is_offloaded() {
            return Err(MegatronGpuError::Offloaded {
                operation: "entering rollout mode",
            });
        }
        let len = plan.len;
        let peers_write = plan
            .ranks
            .iter()
            .any(|s| !s.pushes.is_empty() || !s.peer_tiles.is_empty());
        // Rollout buffers first: an OOM here leaves the training state untouched.
        // SAFETY: the schedule's local and unpack tiles and the zeroed vocabulary padding cover
        // each buffer exactly, so every element is written before the buffers are handed out.
        let mut rolls = unsafe { alloc_rollout_buffers(&*self.pool, len, peers_write)? };
        let start = Instant::now();
        let tracing = ctx.rec.tracing();
        let mut moved = self.transfer(plan, state, &mut rolls, ctx.memory, tracing)?;
        record_transfer(ctx, &moved, start);
        self.finish_offload(state, ctx, &mut moved)?;
        Ok(RolloutBuffer::new(
            rolls,
            self.locals().to_vec(),
            Self::entries(plan),
            len,
        )?)
    }

    fn refresh(
        &mut self,
        plan: &Arc<MegatronGpuPlan>,
        state: &mut MegatronGpuState,
        rollout: &mut RolloutBuffer,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), MegatronGpuError> {
        self.check_plan(plan, state)?;
        if state.is_offloaded() {
            return Err(MegatronGpuError::Offloaded {
                operation: "refreshing rollout weights",
            });
        }
        if rollout.len_per_rank() != plan.len || rollout.local_ranks() != self.locals() {
            return Err(MegatronGpuError::RolloutMismatch {
                expected: plan.len,
                expected_ranks: self.locals().len(),
                found: rollout.len_per_rank(),
                found_ranks: rollout.local_ranks().len(),
            });
        }
        let start = Instant::now();
        let tracing = ctx.rec.tracing();
        let mut moved = self.transfer(plan, state, rollout.buffers_mut(), ctx.memory, tracing)?;
        record_transfer(ctx, &moved, start);
        self.finish_offload(state, ctx, &mut moved)
    }

    fn exit(
        &mut self,
        state: &mut MegatronGpuState,
        rollout: Option<RolloutBuffer>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), MegatronGpuError> {
        if let Some(rollout) = rollout {
            ctx.rec
                .phase(Phase::Release, |_| rollout.release(&*self.pool))?;
        }
        self.check_state(state)?;
        let pinned = &*self.pinned;
        let tracing = ctx.rec.tracing();
        let spans = ctx.rec.phase(Phase::Reload, |scope| {
            let mut items: Vec<&mut GpuRank> = state.ranks.iter_mut().collect();
            let moved = self.pool.run_each(&mut items, &|c, rt| {
                c.sync_all()?;
                let mut tl = StreamTimeline::new(c, tracing)?;
                let mut bytes = rt
                    .params
                    .start_reload(c, "reloading bf16 parameters", &mut tl)?;
                bytes += rt.main.start_reload(c, "reloading main params", &mut tl)?;
                bytes += rt.adam_m.start_reload(c, "reloading Adam m", &mut tl)?;
                bytes += rt.adam_v.start_reload(c, "reloading Adam v", &mut tl)?;
                if rt.grads.is_none() {
                    rt.grads = Some(alloc_zeros(
                        &c.compute,
                        rt.params.len(),
                        c.rank,
                        "gradients",
                    )?);
                }
                c.sync_all()?;
                rt.params.release_host(c.rank, pinned);
                rt.main.release_host(c.rank, pinned);
                rt.adam_m.release_host(c.rank, pinned);
                rt.adam_v.release_host(c.rank, pinned);
                Ok((bytes, tl.finish()?))
            })?;
            scope.add_bytes(Link::HostToDevice, moved.iter().map(|m| m.0).sum());
            Ok::<Vec<RankSpans>, MegatronGpuError>(moved.into_iter().map(|m| m.1).collect())
        })?;
        record_spans(ctx, self.locals(), &spans);
        Ok(())
    }
}
