//! [`FsdpBackend`]: the [`Reshard`] implementation on NVIDIA GPUs.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PinnedHostSlice};
use half::bf16;
use lifecycle_core::{Link, MemoryPolicy, Phase, Reshard, SwitchContext};
use lifecycle_cuda::{
    alloc_device, alloc_pinned, alloc_zeros, CastBatch, CudaError, RankCtx, RankExecutor,
    RankSpans, StreamTimeline, ThreadRankPool, Transport,
};
use lifecycle_host::{HostRollout, HostTrainState, RankRollout, RolloutTensor};
use lifecycle_layout::{plan_fsdp_to_tp, FsdpLayout, RolloutLayout};
use lifecycle_layout::{HostTensor, TensorData};

use crate::state::{FsdpTrainState, RankDump, RankTrain};
use crate::update::UpdateKernelCache;
use crate::verify::{self, Buffer, Mismatch};
use crate::FsdpError;
use lifecycle_layout::fsdp::{
    build_plan, BucketConfig, BucketOps, Buf, CastOp, FsdpPlan, ShardLayout,
};

/// One rollout tensor's place in a rank's flat rollout buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutEntry {
    /// Name.
    pub name: String,
    /// Shape of the rank's slice.
    pub shape: Vec<usize>,
    /// Element offset.
    pub offset: u64,
    /// Elements.
    pub numel: u64,
}

/// The rollout weights of every rank: one flat bf16 device buffer per rank, tensors at the plan's
/// offsets (the same on every rank).
pub struct FsdpRollout {
    pub(crate) ranks: Vec<CudaSlice<bf16>>,
    pub(crate) entries: Vec<RolloutEntry>,
    pub(crate) len: u64,
}

impl std::fmt::Debug for FsdpRollout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpRollout")
            .field("ranks", &self.ranks.len())
            .field("tensors", &self.entries.len())
            .field("elements_per_rank", &self.len)
            .finish()
    }
}

impl FsdpRollout {
    /// The tensors of each rank's buffer, in rollout order.
    pub fn entries(&self) -> &[RolloutEntry] {
        &self.entries
    }

    /// Bytes of rollout weights on each rank.
    pub fn bytes_per_rank(&self) -> u64 {
        self.len * 2
    }

    /// The device buffer of the `i`-th local rank (flat; see [`FsdpRollout::entries`]).
    pub fn rank_buffer(&self, rank: usize) -> Option<&CudaSlice<bf16>> {
        self.ranks.get(rank)
    }
}

/// Reshards FSDP training shards into bf16 tensor-parallel rollout weights on the GPUs of a
/// [`ThreadRankPool`], with bucketed, shard-aware NCCL transfers and overlapped offload.
///
/// # When a peer rank stalls or dies
/// Every wait on NCCL work is bounded by the pool's deadline
/// ([`ThreadRankPool::collective_timeout`], 10 minutes by default, env
/// `LIFECYCLE_NCCL_TIMEOUT_S`). A transfer whose collectives do not finish in time fails with
/// [`CudaError::CollectiveTimeout`] (rank, operation, deadline) after the waiting rank aborted
/// its communicator; the switch ends in `LifecycleError::Enter` / `Refresh` with
/// `AfterFailure::Restored`: the training state never left the devices (offloaded buffers are
/// freed only after the transfer), no rollout weights are resident, the lifecycle is in train
/// mode. The pool then refuses every collective at once with [`CudaError::CommAborted`]
/// ([`ThreadRankPool::comm_fault`] says why), so the next rollout fails fast the same way, while
/// work without collectives (reload, [`FsdpBackend::download_state`]) still runs. To go on,
/// take the state out (`Lifecycle::into_parts`) and put it into a lifecycle whose backend runs
/// on a new pool over the same GPUs: device buffers belong to each GPU's primary context, which
/// every pool of the process shares.
///
/// ```no_run
/// use std::sync::Arc;
/// use lifecycle_core::Lifecycle;
/// use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};
/// use lifecycle_cuda::ThreadRankPool;
/// use lifecycle_fsdp::FsdpBackend;
/// use lifecycle_layout::HostTensor;
///
/// let pool = Arc::new(ThreadRankPool::new(2)?);
/// let layout = RolloutLayout::new(2, vec![TensorSpec::new("w", [6, 4], Parallel::Column)])?;
/// let backend = FsdpBackend::new(pool, layout);
/// let state = backend.state_from_tensors(vec![HostTensor::f32("w", [6, 4], vec![0.5; 24])])?;
/// let mut lc = Lifecycle::new(backend, state);
/// let session = lc.rollout()?;
/// let host = session.backend().download_rollout(&session.weights())?;
/// assert_eq!(host.ranks[1].tensors[0].data.len(), 12);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct FsdpBackend {
    pool: Arc<ThreadRankPool>,
    layout: RolloutLayout,
    config: BucketConfig,
    batched_casts: bool,
    /// The last plan and the training layout it was made for: a switch of the same layout (every
    /// switch of a training run) reuses it instead of planning again.
    plan_cache: Mutex<Option<(FsdpLayout, Arc<FsdpPlan>)>>,
    /// The in-place update kernels, compiled and loaded on first use.
    pub(crate) update_kernels: UpdateKernelCache,
    verify: bool,
    /// Verification mode: hashes of the resident rollout weights.
    rollout_sums: Option<RolloutSums>,
    transport: Transport,
    offload_chunk_bytes: usize,
}

/// Hashes of the resident rollout weights, per local rank, per chunk of `table`.
struct RolloutSums {
    table: lifecycle_cuda::ChunkTable,
    names: Vec<String>,
    sums: Vec<Vec<u64>>,
}

impl std::fmt::Debug for FsdpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpBackend")
            .field("world", &self.pool.world())
            .field("tp", &self.layout.tp)
            .field("config", &self.config)
            .field("batched_casts", &self.batched_casts)
            .field("verify", &self.verify)
            .finish()
    }
}

fn ptr<T>(s: &CudaSlice<T>, ctx: &RankCtx) -> u64 {
    let (p, _sync) = s.device_ptr(&ctx.compute);
    p
}

pub(crate) fn ptr_mut<T>(s: &mut CudaSlice<T>, ctx: &RankCtx) -> u64 {
    let (p, _sync) = s.device_ptr_mut(&ctx.compute);
    p
}

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
    let base = ptr_mut(buf, ctx);
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

/// Statistics of one rank's transfer, and its device timeline (read once the offload copies
/// it also marks have finished).
#[derive(Default)]
struct RankMoved {
    recv: u64,
    local: u64,
    staging: u64,
    timeline: Option<StreamTimeline>,
}

impl FsdpBackend {
    /// A backend over `pool`'s GPUs producing `layout`, with default buckets
    /// ([`BucketConfig::default`]).
    pub fn new(pool: Arc<ThreadRankPool>, layout: RolloutLayout) -> Self {
        FsdpBackend {
            pool,
            layout,
            config: BucketConfig::default(),
            batched_casts: true,
            plan_cache: Mutex::new(None),
            update_kernels: UpdateKernelCache::default(),
            verify: false,
            rollout_sums: None,
            transport: Transport::Auto,
            offload_chunk_bytes: DEFAULT_OFFLOAD_CHUNK_BYTES,
        }
    }

    /// Cuts each offload copy (device → pinned host) into copies of at most `bytes` (`0`: one
    /// copy per buffer). Default [`DEFAULT_OFFLOAD_CHUNK_BYTES`].
    pub fn with_offload_chunk_bytes(mut self, bytes: usize) -> Self {
        self.offload_chunk_bytes = bytes;
        self
    }

    /// How bytes cross between ranks. [`Transport::Auto`] (the default): peer copies (each
    /// sender's copy engines write its pieces straight into the receivers' rollout buffers, no
    /// NCCL) when every rank lives in this process, every pair of GPUs has peer access and the
    /// plan's [`GatherMode`](lifecycle_layout::fsdp::GatherMode) places every piece in the rollout buffer
    /// (`SendRecv`, or `AllGather` at T > 1); NCCL otherwise. [`Transport::PeerCopy`] makes
    /// planning fail where that is impossible; [`Transport::Nccl`] always uses NCCL. A pool
    /// with ranks sharing a GPU has no NCCL: planning refuses `Nccl` and NCCL-only gather modes.
    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self.plan_cache = Mutex::new(None);
        self
    }

    /// The transport setting.
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// Whether casts are launched many per kernel (the default: one multi-tensor launch per
    /// bucket on each stream, which removes the per-launch gaps of ~400 small kernels) or one
    /// kernel per tensor piece. Both give bit-identical rollout weights; the switch exists to
    /// measure the difference.
    pub fn with_batched_casts(mut self, batched: bool) -> Self {
        self.batched_casts = batched;
        self.plan_cache = Mutex::new(None);
        self
    }

    /// Turns verification mode on or off (see the `verify` module's summary below). When on,
    /// computed on the GPUs:
    /// - `plan` rejects NaN or infinite master weights, naming the tensor, rank and element
    ///   ([`FsdpError::NonFinite`]), before anything moves;
    /// - every buffer offloaded (master, Adam m, v per the memory policy) is hashed per chunk of
    ///   each tensor's shard before its device→host copy and again after the reload; a mismatch
    ///   leaves that buffer offloaded and names the rank, tensor and buffer
    ///   ([`FsdpError::Corrupted`]);
    /// - the rollout weights are hashed per tensor after every transfer and checked before
    ///   release ([`FsdpError::RolloutCorrupted`]).
    ///
    /// Same semantics as the host backend's `HostBackend::with_verification`.
    pub fn with_verification(mut self, on: bool) -> Self {
        self.verify = on;
        self.rollout_sums = None;
        self
    }

    /// Whether verification mode is on.
    pub fn verifies(&self) -> bool {
        self.verify
    }

    /// Flips bit `bit` of element `index` of rollout tensor `tensor` on local rank `rank` (the
    /// global rank in the single-process mode), in device memory: fault injection for testing
    /// verification mode. Returns whether a bit was flipped (false when `rank` or `index` is out
    /// of range); an unknown tensor is an error.
    pub fn inject_rollout_bit_flip(
        &self,
        rollout: &mut FsdpRollout,
        rank: usize,
        tensor: &str,
        index: usize,
        bit: u32,
    ) -> Result<bool, FsdpError> {
        let entry = rollout
            .entries
            .iter()
            .find(|e| e.name == tensor)
            .ok_or_else(|| FsdpError::Tensor {
                name: tensor.to_string(),
                problem: "no such tensor in the rollout weights".into(),
            })?;
        if index as u64 >= entry.numel || rank >= rollout.ranks.len() {
            return Ok(false);
        }
        let at = (entry.offset as usize) + index;
        let mut items: Vec<(usize, &mut CudaSlice<bf16>)> =
            rollout.ranks.iter_mut().enumerate().collect();
        self.pool.run_each(&mut items, &|ctx, (i, buf)| {
            if *i != rank {
                return Ok(());
            }
            let mut one = buf.slice_mut(at..at + 1);
            let old = ctx
                .compute
                .clone_dtoh(&one)
                .map_err(ctx.drv("reading a rollout weight", 2))?;
            let flipped: Vec<bf16> = old
                .iter()
                .map(|x| bf16::from_bits(x.to_bits() ^ (1 << (bit % 16))))
                .collect();
            ctx.compute
                .memcpy_htod(&flipped, &mut one)
                .map_err(ctx.drv("writing a rollout weight", 2))?;
            ctx.compute
                .synchronize()
                .map_err(ctx.drv("synchronizing", 0))
        })?;
        Ok(true)
    }

    /// Verification mode: every master weight on the devices must be finite.
    fn check_finite(&self, state: &FsdpTrainState) -> Result<(), FsdpError> {
        let table = verify::shard_table(&state.shards);
        let mut items: Vec<&RankTrain> = state.ranks.iter().collect();
        let found = self
            .pool
            .run_each(&mut items, &|ctx, rt| match &rt.master {
                Some(m) => verify::first_nonfinite(ctx, m, &table),
                None => Ok(None),
            })?;
        for (i, f) in found.into_iter().enumerate() {
            if let Some((at, value)) = f {
                let slot = table
                    .segment_of(at)
                    .and_then(|t| state.shards.slots.get(t))
                    .ok_or_else(|| {
                        FsdpError::Config(format!(
                            "a non-finite value at element {at} lies outside every tensor"
                        ))
                    })?;
                return Err(FsdpError::NonFinite {
                    tensor: slot.name.clone(),
                    rank: self.pool.local_ranks()[i],
                    index: at - slot.offset,
                    value,
                });
            }
        }
        Ok(())
    }

    /// Verification mode: queues the hashes of the buffers `memory` offloads, on each rank's
    /// copy stream ahead of the offload copies.
    fn queue_offload_hashes(
        &self,
        state: &mut FsdpTrainState,
        memory: MemoryPolicy,
    ) -> Result<(), FsdpError> {
        let table = verify::shard_table(&state.shards);
        let mut items: Vec<&mut RankTrain> = state.ranks.iter_mut().collect();
        self.pool.run_each(&mut items, &|ctx, rt| {
            rt.sums.clear();
            for b in Buffer::ALL {
                let offloads = match b {
                    Buffer::Master => memory.offload_params,
                    Buffer::AdamM | Buffer::AdamV => memory.offload_optimizer,
                };
                if !offloads {
                    continue;
                }
                let (dev, sums) = match b {
                    Buffer::Master => (&rt.master, &mut rt.sums),
                    Buffer::AdamM => (&rt.m, &mut rt.sums),
                    Buffer::AdamV => (&rt.v, &mut rt.sums),
                };
                if let Some(d) = dev {
                    verify::queue_offload_hash(ctx, sums, b, d, &table)?;
                }
            }
            Ok(())
        })?;
        Ok(())
    }

    /// Verification mode: hashes the rollout weights just written.
    fn record_rollout_sums(
        &mut self,
        rolls: &[CudaSlice<bf16>],
        entries: &[RolloutEntry],
    ) -> Result<(), FsdpError> {
        let table = verify::rollout_table(entries);
        let mut items: Vec<&CudaSlice<bf16>> = rolls.iter().collect();
        let sums = self.pool.run_each(&mut items, &|ctx, buf| {
            verify::rollout_hashes(ctx, buf, &table)
        })?;
        self.rollout_sums = Some(RolloutSums {
            table,
            names: entries.iter().map(|e| e.name.clone()).collect(),
            sums,
        });
        Ok(())
    }

    /// Verification mode: checks the rollout weights about to be released against the hashes
    /// taken after their transfer (and forgets those).
    fn check_rollout_sums(&mut self, rollout: &FsdpRollout) -> Result<(), FsdpError> {
        let Some(rs) = self.rollout_sums.take() else {
            return Ok(());
        };
        if !self.verify || rs.sums.len() != rollout.ranks.len() {
            return Ok(());
        }
        let mut items: Vec<&CudaSlice<bf16>> = rollout.ranks.iter().collect();
        let table = &rs.table;
        let found = self.pool.run_each(&mut items, &|ctx, buf| {
            verify::rollout_hashes(ctx, buf, table)
        })?;
        for (i, (expected, found)) in rs.sums.iter().zip(&found).enumerate() {
            if let Some(m) = verify::first_mismatch(table, expected, found) {
                return Err(FsdpError::RolloutCorrupted {
                    rank: self.pool.local_ranks()[i],
                    tensor: rs.names.get(m.tensor).cloned().unwrap_or_default(),
                });
            }
        }
        Ok(())
    }

    /// Changes the bucket settings (checked: a budget of at least 1 MiB, at least 1 in flight).
    pub fn with_config(mut self, config: BucketConfig) -> Result<Self, FsdpError> {
        if config.bucket_bytes < (1 << 20) || config.in_flight == 0 {
            return Err(FsdpError::Config(format!(
                "bucket_bytes must be at least 1 MiB and in_flight at least 1 (2 or more to \
                 overlap casts with NCCL); found {} bytes, {} in flight",
                config.bucket_bytes, config.in_flight
            )));
        }
        self.config = config;
        self.plan_cache = Mutex::new(None);
        Ok(self)
    }

    /// The bucket settings.
    pub fn config(&self) -> BucketConfig {
        self.config
    }

    /// The rank pool.
    pub fn pool(&self) -> &Arc<ThreadRankPool> {
        &self.pool
    }

    /// The rollout layout.
    pub fn layout(&self) -> &RolloutLayout {
        &self.layout
    }

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
            rt.master = Some(master);
            rt.grads = Some(alloc_zeros(&ctx.compute, len, ctx.rank, "gradients")?);
            rt.m = Some(alloc_zeros(&ctx.compute, len, ctx.rank, "Adam m")?);
            rt.v = Some(alloc_zeros(&ctx.compute, len, ctx.rank, "Adam v")?);
            ctx.compute
                .synchronize()
                .map_err(ctx.drv("synchronizing", 0))?;
            Ok(())
        })?;
        Ok(FsdpTrainState {
            layout,
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
            .tensors
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
            let v = bufs.pop();
            let m = bufs.pop();
            rt.master = bufs.pop();
            rt.m = m;
            rt.v = v;
            rt.grads = Some(alloc_zeros(&ctx.compute, len, ctx.rank, "gradients")?);
            ctx.compute
                .synchronize()
                .map_err(ctx.drv("synchronizing", 0))?;
            Ok(())
        })?;
        Ok(FsdpTrainState {
            layout,
            shards,
            ranks: items,
            adam_steps: 0,
        })
    }

    /// Downloads the rollout weights of this process's ranks ([`RankExecutor::local_ranks`], all
    /// ranks in the single-process mode) to host memory (rollout order, same layout as the host
    /// backend's), for bit comparisons.
    pub fn download_rollout(&self, rollout: &FsdpRollout) -> Result<HostRollout, FsdpError> {
        let mut items: Vec<&CudaSlice<bf16>> = rollout.ranks.iter().collect();
        let flats = self.pool.run_each(&mut items, &|ctx, buf| {
            ctx.compute
                .synchronize()
                .map_err(ctx.drv("synchronizing", 0))?;
            ctx.compute
                .clone_dtoh(*buf)
                .map_err(ctx.drv("downloading rollout weights", 0))
        })?;
        let ranks = flats
            .into_iter()
            .map(|flat| RankRollout {
                tensors: rollout
                    .entries
                    .iter()
                    .map(|e| RolloutTensor {
                        name: e.name.clone(),
                        shape: e.shape.clone(),
                        data: flat[e.offset as usize..(e.offset + e.numel) as usize].to_vec(),
                    })
                    .collect(),
            })
            .collect();
        Ok(HostRollout { ranks })
    }

    /// Downloads the training buffers of this process's ranks (from the device, or from the pinned
    /// copies while offloaded), flat and padded, for round-trip checks.
    pub fn download_state(&self, state: &FsdpTrainState) -> Result<Vec<RankDump>, FsdpError> {
        let mut items: Vec<&RankTrain> = state.ranks.iter().collect();
        Ok(self.pool.run_each(&mut items, &|ctx, rt| {
            ctx.sync_all()?;
            let get = |dev: &Option<CudaSlice<f32>>,
                       host: &Option<PinnedHostSlice<f32>>,
                       what: &str|
             -> Result<Vec<f32>, CudaError> {
                match (dev, host) {
                    (Some(d), _) => ctx.compute.clone_dtoh(d).map_err(ctx.drv(what, 0)),
                    (None, Some(h)) => Ok(h.as_slice().map_err(ctx.drv(what, 0))?.to_vec()),
                    (None, None) => Err(CudaError::Invalid(format!(
                        "{what}: neither on the device nor on the host"
                    ))),
                }
            };
            Ok(RankDump {
                master: get(&rt.master, &rt.master_host, "downloading master")?,
                grads: match &rt.grads {
                    Some(g) => Some(
                        ctx.compute
                            .clone_dtoh(g)
                            .map_err(ctx.drv("downloading grads", 0))?,
                    ),
                    None => None,
                },
                m: get(&rt.m, &rt.m_host, "downloading Adam m")?,
                v: get(&rt.v, &rt.v_host, "downloading Adam v")?,
            })
        })?)
    }

    /// The full fp32 master tensor `name`, gathered from every rank's shard (single-process mode:
    /// a process that drives only some ranks gets an error).
    pub fn full_master(&self, state: &FsdpTrainState, name: &str) -> Result<Vec<f32>, FsdpError> {
        if self.pool.local_ranks().len() != self.pool.world() {
            return Err(FsdpError::Tensor {
                name: name.to_string(),
                problem: "gathering a full tensor needs every rank in this process; with one \
                          process per rank, download each rank's shard instead"
                    .into(),
            });
        }
        let i = state
            .layout
            .tensors
            .iter()
            .position(|(n, _)| n == name)
            .ok_or_else(|| FsdpError::Tensor {
                name: name.to_string(),
                problem: "no such tensor in the training state".into(),
            })?;
        let dumps = self.download_state(state)?;
        let slot = &state.shards.slots[i];
        let mut out = Vec::new();
        for (rank, d) in dumps.iter().enumerate() {
            let held = state.shards.held_rows(i, rank);
            let at = slot.offset as usize;
            out.extend_from_slice(&d.master[at..at + held.len() * slot.cols]);
        }
        Ok(out)
    }

    /// Every full fp32 master tensor, in training order, gathered from one download of every
    /// rank's shards (single-process mode, like [`FsdpBackend::full_master`]): the host twin of
    /// the state, e.g. for `HostTrainState::from_tensors` and `reference_rollout`.
    pub fn full_masters(&self, state: &FsdpTrainState) -> Result<Vec<HostTensor>, FsdpError> {
        if self.pool.local_ranks().len() != self.pool.world() {
            return Err(FsdpError::Config(
                "gathering full tensors needs every rank in this process; with one process per \
                 rank, download each rank's shard instead"
                    .into(),
            ));
        }
        let dumps = self.download_state(state)?;
        Ok(state
            .layout
            .tensors
            .iter()
            .zip(&state.shards.slots)
            .enumerate()
            .map(|(i, ((name, shape), slot))| {
                let mut data = Vec::with_capacity(shape.iter().product());
                for (rank, d) in dumps.iter().enumerate() {
                    let held = state.shards.held_rows(i, rank);
                    let at = slot.offset as usize;
                    data.extend_from_slice(&d.master[at..at + held.len() * slot.cols]);
                }
                HostTensor::f32(name.clone(), shape.clone(), data)
            })
            .collect())
    }

    /// Gives the device memory cached by each rank's stream-ordered pool (freed rollout weights,
    /// offloaded training state) back to the driver, e.g. before another process allocates a KV
    /// cache. The pools keep freed memory mapped by default, so switches reuse it.
    pub fn trim_device_memory(&self) -> Result<(), FsdpError> {
        self.pool.run(&|ctx| ctx.trim_pool())?;
        Ok(())
    }

    fn entries(plan: &FsdpPlan) -> Vec<RolloutEntry> {
        plan.core
            .ranks
            .first()
            .map(|r0| {
                r0.tensors
                    .iter()
                    .zip(&plan.roll_offsets)
                    .map(|(t, &offset)| RolloutEntry {
                        name: plan.core.tensors[t.tensor].name.clone(),
                        shape: t.shape.clone(),
                        offset,
                        numel: t.numel() as u64,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Runs the transfer into `rolls` (one per rank), starting the offload copies of `memory`
    /// first so they overlap it. Returns per-rank statistics.
    fn transfer(
        &self,
        plan: &FsdpPlan,
        state: &mut FsdpTrainState,
        rolls: &mut [CudaSlice<bf16>],
        memory: MemoryPolicy,
        tracing: bool,
    ) -> Result<Vec<RankMoved>, FsdpError> {
        // Peer copies write into every rank's rollout buffer: their addresses by global rank.
        let mut bases = vec![0u64; self.pool.world()];
        if plan.peer_copy {
            let got = self
                .pool
                .run_each(rolls, &|ctx, roll| Ok(ptr_mut(roll, ctx)))?;
            for (&r, b) in self.pool.local_ranks().iter().zip(got) {
                bases[r] = b;
            }
        }
        let bases = &bases;
        let mut items: Vec<(&mut RankTrain, &mut CudaSlice<bf16>)> =
            state.ranks.iter_mut().zip(rolls.iter_mut()).collect();
        let len = state.shards.rank_len as usize;
        let mode = CastMode {
            batched: self.batched_casts,
        };
        let chunk = self.offload_chunk_bytes;
        let moved = self.pool.run_each(&mut items, &|ctx, (rt, roll)| {
            // Pinned host buffers first (allocated once, reused): failing here changes nothing.
            if memory.offload_params && rt.master_host.is_none() {
                // SAFETY: written by the device→host copy below before anything reads it.
                rt.master_host =
                    Some(unsafe { alloc_pinned(&ctx.copy, len, ctx.rank, "offloaded master")? });
            }
            if memory.offload_optimizer {
                if rt.m_host.is_none() {
                    // SAFETY: as above.
                    rt.m_host = Some(unsafe {
                        alloc_pinned(&ctx.copy, len, ctx.rank, "offloaded Adam m")?
                    });
                }
                if rt.v_host.is_none() {
                    // SAFETY: as above.
                    rt.v_host = Some(unsafe {
                        alloc_pinned(&ctx.copy, len, ctx.rank, "offloaded Adam v")?
                    });
                }
            }
            let master = rt
                .master
                .as_ref()
                .ok_or_else(|| CudaError::Invalid("master weights are offloaded".into()))?;
            let mut tl = StreamTimeline::new(ctx, tracing)?;
            // Offload copies on the copy stream: they overlap the NVLink work below.
            let bytes = (len * 4) as u64;
            let opt = memory.offload_optimizer;
            let copies = [
                (opt, rt.m.as_ref(), rt.m_host.as_mut(), "Adam m"),
                (opt, rt.v.as_ref(), rt.v_host.as_mut(), "Adam v"),
                (
                    memory.offload_params,
                    Some(master),
                    rt.master_host.as_mut(),
                    "master",
                ),
            ];
            for (on, dev, host, what) in copies {
                let (true, Some(dev), Some(host)) = (on, dev, host) else {
                    continue;
                };
                let mark = tl.begin(ctx, &ctx.copy)?;
                offload_copy(ctx, dev, host, chunk, what)?;
                let (name, link) = (format!("offload {what}"), Some(Link::DeviceToHost));
                tl.end(
                    ctx,
                    &ctx.copy,
                    mark,
                    Phase::Offload,
                    name,
                    "copy",
                    bytes,
                    link,
                )?;
            }
            let mut moved = run_buckets(ctx, plan, master, roll, mode, bases, &mut tl)?;
            moved.timeline = Some(tl);
            Ok(moved)
        })?;
        Ok(moved)
    }

    fn record_transfer(ctx: &mut SwitchContext<'_>, moved: &[RankMoved], start: Instant) {
        let wall = start.elapsed();
        let mut sample = lifecycle_core::PhaseSample::default();
        for m in moved {
            sample.bytes.add(Link::DeviceToDevice, m.recv);
            sample.bytes.add(Link::Local, m.local);
            sample.peak_extra_bytes = sample.peak_extra_bytes.max(m.staging);
        }
        ctx.rec.record(Phase::Transfer, wall, sample);
        if let Some(trace) = ctx.rec.trace() {
            let b = sample.bytes;
            let bytes = b.moved() + b.local;
            trace.record_host(
                "transfer",
                Phase::Transfer,
                None,
                "switch",
                start,
                wall,
                bytes,
                None,
            );
        }
    }

    /// Waits for the offload copies, then frees what the policy moves out and the gradients.
    fn finish_offload(
        &self,
        state: &mut FsdpTrainState,
        ctx: &mut SwitchContext<'_>,
        moved: &mut [RankMoved],
    ) -> Result<(), FsdpError> {
        let memory = ctx.memory;
        let free_grads = !memory.keep_rollout_resident;
        let bytes_each = state.shards.rank_len * 4;
        let spans = ctx.rec.phase(Phase::Offload, |scope| {
            let mut items: Vec<(&mut RankTrain, Option<StreamTimeline>)> = state
                .ranks
                .iter_mut()
                .zip(moved.iter_mut().map(|m| m.timeline.take()))
                .collect();
            let copies = memory.offload_params || memory.offload_optimizer;
            let spans = self.pool.run_each(&mut items, &|ctx, (rt, tl)| {
                // The transfer waited for its own streams; only the offload copies (copy
                // stream) and the verification hashes queued before them may still run.
                if copies {
                    ctx.wait(&[&ctx.copy], "waiting for the offload copies")?;
                }
                verify::settle_offload_hashes(&mut rt.sums)?;
                let spans = match tl.take() {
                    Some(tl) => tl.finish()?,
                    None => RankSpans::default(),
                };
                if memory.offload_params {
                    rt.master = None;
                }
                if memory.offload_optimizer {
                    rt.m = None;
                    rt.v = None;
                }
                if free_grads {
                    rt.grads = None;
                }
                // Frees are stream-ordered: the memory returns to the pool without a wait.
                Ok(spans)
            })?;
            let per_rank =
                bytes_each * (memory.offload_params as u64 + 2 * memory.offload_optimizer as u64);
            scope.add_bytes(Link::DeviceToHost, per_rank * state.ranks.len() as u64);
            Ok::<Vec<RankSpans>, FsdpError>(spans)
        })?;
        self.record_spans(ctx, &spans);
        Ok(())
    }

    /// Adds per-rank device spans to the trace (when one is being recorded).
    fn record_spans(&self, ctx: &mut SwitchContext<'_>, spans: &[RankSpans]) {
        if let Some(trace) = ctx.rec.trace() {
            for (local, s) in spans.iter().enumerate() {
                let rank = self.pool.local_ranks().get(local).copied().unwrap_or(local);
                s.record_into(trace, rank);
            }
        }
    }
}

/// How a rank launches its casts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CastMode {
    /// Many casts per launch through the multi-tensor kernel (regions it cannot take fall back to
    /// one launch each).
    batched: bool,
}

/// One rank's casts sorted for launching: the batch of every cast the multi-tensor kernel takes
/// (all local casts first, then all staged ones, so each stream's work is one contiguous run of
/// descriptors), per bucket the descriptor and chunk ranges, and the casts that need a launch
/// of their own.
#[derive(Default)]
struct RankCasts<'p> {
    batch: CastBatch,
    local: Vec<BatchRange>,
    staged: Vec<BatchRange>,
    local_single: Vec<Vec<&'p CastOp>>,
    staged_single: Vec<Vec<&'p CastOp>>,
}

/// Descriptors `first .. first + count` of a [`CastBatch`], covering chunks `chunks`.
#[derive(Debug, Clone, Default)]
struct BatchRange {
    first: usize,
    count: usize,
    chunks: std::ops::Range<u64>,
}

impl BatchRange {
    /// The range from `self`'s start to `other`'s end (`other` follows `self` in the batch).
    fn through(&self, other: &BatchRange) -> BatchRange {
        BatchRange {
            first: self.first,
            count: other.first + other.count - self.first,
            chunks: self.chunks.start..other.chunks.end,
        }
    }
}

impl<'p> RankCasts<'p> {
    fn new(buckets: &'p [BucketOps], mode: CastMode) -> Self {
        let mut rc = RankCasts::default();
        for want in [Buf::Rollout, Buf::Staging] {
            for b in buckets {
                let (first, chunk0) = (rc.batch.len(), rc.batch.chunks());
                let mut single = Vec::new();
                for c in b.casts.iter().filter(|c| c.dst == want) {
                    if !(mode.batched && rc.batch.push(c.src_off, c.dst_off, c.region)) {
                        single.push(c);
                    }
                }
                let range = BatchRange {
                    first,
                    count: rc.batch.len() - first,
                    chunks: chunk0..rc.batch.chunks(),
                };
                match want {
                    Buf::Rollout => {
                        rc.local.push(range);
                        rc.local_single.push(single);
                    }
                    Buf::Staging => {
                        rc.staged.push(range);
                        rc.staged_single.push(single);
                    }
                }
            }
        }
        rc
    }
}

/// Whether bucket `b`'s NCCL work reads or writes rollout bytes that its local casts write (an
/// all-gather of the rank's own part, or a send straight from the rollout buffer).
fn needs_local(b: &BucketOps) -> bool {
    !b.gathers.is_empty() || b.sends.iter().any(|s| s.buf == Buf::Rollout)
}

/// The bucket loop of one rank. Local casts (into the rollout buffer) are queued first, all of
/// them, on the auxiliary stream, which never waits for the network: one multi-tensor launch per
/// run of buckets up to one whose NCCL work needs them, with an event after each run. Then per
/// bucket: staged casts on the compute stream (waiting for their staging slot to be free), and the
/// bucket's grouped NCCL sends / receives / all-gathers on the NCCL stream after its staged casts
/// (and, when it needs them, its local casts). Staging slots are reused round-robin.
fn run_buckets(
    ctx: &RankCtx,
    plan: &FsdpPlan,
    master: &CudaSlice<f32>,
    roll: &mut CudaSlice<bf16>,
    mode: CastMode,
    bases: &[u64],
    tl: &mut StreamTimeline,
) -> Result<RankMoved, CudaError> {
    let out = run_buckets_inner(ctx, plan, master, roll, mode, bases, tl);
    if out.is_err() {
        // Nothing may still read or write the rollout or staging buffers when they are freed
        // after an error part-way through: wait for every stream first.
        let _ = ctx.sync_all();
    }
    out
}

fn run_buckets_inner(
    ctx: &RankCtx,
    plan: &FsdpPlan,
    master: &CudaSlice<f32>,
    roll: &mut CudaSlice<bf16>,
    mode: CastMode,
    bases: &[u64],
    tl: &mut StreamTimeline,
) -> Result<RankMoved, CudaError> {
    let rank = ctx.rank;
    let buckets = &plan.ranks[rank];
    let casts = RankCasts::new(buckets, mode);
    let descs = if casts.batch.is_empty() {
        None
    } else {
        Some(
            ctx.compute
                .clone_htod(casts.batch.words())
                .map_err(ctx.drv("uploading cast descriptors", 0))?,
        )
    };
    let nslots = plan.staging_slots(rank);
    let mut staging: Vec<CudaSlice<bf16>> = Vec::with_capacity(nslots);
    for _ in 0..nslots {
        // SAFETY: every staging element read by a send is first written by a cast of the same
        // bucket (the plan places each staged send after its cast).
        staging.push(unsafe {
            alloc_device::<bf16>(
                &ctx.compute,
                plan.slot_elems as usize,
                rank,
                "staging bucket",
            )?
        });
    }
    let nrslots = plan.recv_staging_slots(rank);
    let mut rstaging: Vec<CudaSlice<bf16>> = Vec::with_capacity(nrslots);
    for _ in 0..nrslots {
        // SAFETY: every element an unpack reads is first written by the receive of its bucket.
        rstaging.push(unsafe {
            alloc_device::<bf16>(
                &ctx.compute,
                plan.recv_slot_elems as usize,
                rank,
                "receive staging bucket",
            )?
        });
    }
    let nccl = ctx.nccl_stream();
    // Allocations and the descriptor upload (stream-ordered on compute) and earlier writes are
    // visible to NCCL and to the auxiliary stream that runs the local casts.
    ctx.order(&ctx.compute, &nccl)?;
    ctx.order(&ctx.compute, &ctx.aux)?;
    let mbase = ptr(master, ctx);
    let rbase = ptr_mut(roll, ctx);
    let dbase = descs.as_ref().map_or(0, |d| ptr(d, ctx));
    let sbases: Vec<u64> = staging.iter_mut().map(|s| ptr_mut(s, ctx)).collect();
    let rsbases: Vec<u64> = rstaging.iter_mut().map(|s| ptr_mut(s, ctx)).collect();
    let mut moved = RankMoved {
        staging: (nslots as u64 * plan.slot_elems + nrslots as u64 * plan.recv_slot_elems) * 2,
        ..Default::default()
    };
    // Local casts, all queued now: runs of buckets end at a bucket whose NCCL work needs them.
    let mut local_done: Vec<Option<usize>> = vec![None; buckets.len()];
    let mut local_events = Vec::new();
    let mut run_start = 0usize;
    for k in 0..buckets.len() {
        if !(needs_local(&buckets[k]) || k + 1 == buckets.len()) {
            continue;
        }
        let range = casts.local[run_start].through(&casts.local[k]);
        let mut bytes = 0u64;
        let mark = tl.begin(ctx, &ctx.aux)?;
        // SAFETY: the plan keeps every region inside its buffer (master: rank_len f32, rollout:
        // roll_len bf16); the descriptors and both buffers outlive the final synchronisation
        // below; the NCCL stream touches these rollout bytes only after the event recorded next.
        unsafe {
            ctx.kernels.cast_multi(
                &ctx.aux,
                mbase,
                rbase,
                dbase,
                range.first,
                range.count,
                range.chunks.clone(),
                rank,
            )?;
        }
        for (bucket, single) in buckets[run_start..=k]
            .iter()
            .zip(&casts.local_single[run_start..=k])
        {
            bytes += bucket
                .casts
                .iter()
                .filter(|c| c.dst == Buf::Rollout)
                .map(|c| c.region.numel() * 2)
                .sum::<u64>();
            for c in single {
                // SAFETY: as above.
                unsafe {
                    ctx.kernels.cast_f32_bf16(
                        &ctx.aux,
                        mbase + 4 * c.src_off,
                        rbase + 2 * c.dst_off,
                        c.region,
                        rank,
                    )?;
                }
            }
        }
        moved.local += bytes;
        tl.end(
            ctx,
            &ctx.aux,
            mark,
            Phase::Transfer,
            format!("local casts b{run_start}..={k}"),
            "aux",
            bytes,
            Some(Link::Local),
        )?;
        let ev = ctx.event()?;
        ev.record(&ctx.aux)
            .map_err(ctx.drv("recording an event", 0))?;
        local_events.push(ev);
        for slot in local_done.iter_mut().take(k + 1).skip(run_start) {
            *slot = Some(local_events.len() - 1);
        }
        run_start = k + 1;
    }
    let mut net_done = Vec::with_capacity(buckets.len());
    for (k, b) in buckets.iter().enumerate() {
        let slot = if nslots > 0 { k % nslots } else { 0 };
        if b.staging_elems > 0 && k >= nslots {
            ctx.compute
                .wait(&net_done[k - nslots])
                .map_err(ctx.drv("waiting for a staging slot", 0))?;
        }
        let staged = &casts.staged[k];
        if staged.count > 0 || !casts.staged_single[k].is_empty() {
            let mark = tl.begin(ctx, &ctx.compute)?;
            // SAFETY: the plan keeps every staged region inside master (rank_len f32) and the
            // staging slot (slot_elems bf16); the slot was last read by the NCCL work of bucket
            // k - nslots, which the compute stream waited for above; all buffers outlive the
            // final synchronisation.
            unsafe {
                ctx.kernels.cast_multi(
                    &ctx.compute,
                    mbase,
                    sbases[slot],
                    dbase,
                    staged.first,
                    staged.count,
                    staged.chunks.clone(),
                    rank,
                )?;
                for c in &casts.staged_single[k] {
                    ctx.kernels.cast_f32_bf16(
                        &ctx.compute,
                        mbase + 4 * c.src_off,
                        sbases[slot] + 2 * c.dst_off,
                        c.region,
                        rank,
                    )?;
                }
            }
            tl.end(
                ctx,
                &ctx.compute,
                mark,
                Phase::Transfer,
                format!("staged casts b{k}"),
                "compute",
                b.staging_elems * 2,
                Some(Link::Local),
            )?;
        }
        // The NCCL work of this bucket starts after its staged casts (compute stream) and, when
        // it sends from or gathers into the rollout buffer, after its local casts (aux stream).
        let has_net = if plan.peer_copy {
            !b.sends.is_empty()
        } else {
            !b.sends.is_empty() || !b.recvs.is_empty() || !b.gathers.is_empty()
        };
        if has_net {
            let ev = ctx.event()?;
            ev.record(&ctx.compute)
                .map_err(ctx.drv("recording an event", 0))?;
            nccl.wait(&ev).map_err(ctx.drv("waiting on an event", 0))?;
            if needs_local(b) {
                if let Some(i) = local_done[k] {
                    nccl.wait(&local_events[i])
                        .map_err(ctx.drv("waiting on an event", 0))?;
                }
            }
        }
        let mut net_mark = if has_net { tl.begin(ctx, &nccl)? } else { None };
        let recv_before = moved.recv;
        if plan.peer_copy {
            let sent = peer_copies(ctx, &nccl, b, bases, rbase, sbases.get(slot).copied())?;
            moved.recv += b.recvs.iter().map(|r| r.count * 2).sum::<u64>();
            if has_net {
                tl.end(
                    ctx,
                    &nccl,
                    net_mark.take(),
                    Phase::Transfer,
                    format!("peer copies b{k}"),
                    "peer",
                    sent,
                    Some(Link::DeviceToDevice),
                )?;
            }
        } else if !b.sends.is_empty() || !b.recvs.is_empty() {
            ctx.group_start()?;
            let mut res = Ok(());
            for s in &b.sends {
                let (lo, hi) = (s.off as usize, (s.off + s.count) as usize);
                let r = match s.buf {
                    Buf::Rollout => ctx.comm.send(&roll.slice(lo..hi), s.peer as i32),
                    Buf::Staging => ctx.comm.send(&staging[slot].slice(lo..hi), s.peer as i32),
                };
                if let Err(e) = r {
                    res = Err(CudaError::nccl(rank, "ncclSend", e));
                    break;
                }
            }
            if res.is_ok() {
                for r in &b.recvs {
                    let (lo, hi) = (r.off as usize, (r.off + r.count) as usize);
                    let got = match r.into {
                        Buf::Rollout => {
                            moved.recv += r.count * 2;
                            ctx.comm.recv(&mut roll.slice_mut(lo..hi), r.peer as i32)
                        }
                        Buf::Staging => ctx.comm.recv(
                            &mut rstaging[k % nrslots.max(1)].slice_mut(lo..hi),
                            r.peer as i32,
                        ),
                    };
                    if let Err(e) = got {
                        res = Err(CudaError::nccl(rank, "ncclRecv", e));
                        break;
                    }
                }
            }
            let end = ctx.group_end();
            res?;
            end?;
        }
        for u in &b.unpacks {
            moved.recv += u.count * 2;
            let region = lifecycle_layout::Region2d {
                rows: 1,
                cols: u.count,
                src_ld: u.count,
                dst_ld: u.count,
            };
            // SAFETY: the plan keeps both runs inside their buffers (receive slot of
            // recv_slot_elems, rollout of roll_len); queued on the NCCL stream right after the
            // receive that fills the slot, and before the slot's next receive on the same stream.
            unsafe {
                ctx.kernels.copy_u16(
                    &nccl,
                    rsbases[k % nrslots.max(1)] + 2 * u.src_off,
                    rbase + 2 * u.dst_off,
                    region,
                    rank,
                )?;
            }
        }
        if !b.gathers.is_empty() {
            let w = ctx.world as u64;
            // SAFETY: an alias of the rollout buffer (same pointer and length) so the in-place
            // all-gather can name its send part (inside the receive range), which NCCL supports
            // when sendbuff == recvbuff + rank * count. It is leaked (not freed) right after the
            // group; the real buffer outlives the synchronisation below.
            let alias: CudaSlice<bf16> = unsafe {
                ctx.compute
                    .upgrade_device_ptr(rbase, plan.roll_len as usize)
            };
            let mut res = ctx.group_start();
            if res.is_ok() {
                for g in &b.gathers {
                    moved.recv += (w - 1) * g.count * 2;
                    let mine = (g.off + rank as u64 * g.count) as usize;
                    let send = alias.slice(mine..mine + g.count as usize);
                    let mut recv = roll.slice_mut(g.off as usize..(g.off + w * g.count) as usize);
                    if let Err(e) = ctx.comm.all_gather(&send, &mut recv) {
                        res = Err(CudaError::nccl(rank, "ncclAllGather", e));
                        break;
                    }
                }
            }
            let end = ctx.group_end();
            alias.leak();
            res?;
            end?;
        }
        if has_net && !plan.peer_copy {
            let what = if b.gathers.is_empty() {
                "send/recv"
            } else {
                "all-gather"
            };
            tl.end(
                ctx,
                &nccl,
                net_mark,
                Phase::Transfer,
                format!("{what} b{k}"),
                "nccl",
                moved.recv - recv_before,
                Some(Link::DeviceToDevice),
            )?;
        }
        let done = ctx.event()?;
        done.record(&nccl)
            .map_err(ctx.drv("recording an event", 0))?;
        net_done.push(done);
    }
    ctx.order(&nccl, &ctx.compute)?;
    ctx.order(&ctx.aux, &ctx.compute)?;
    // Deadline-aware: a peer that stalls or dies ends in a timeout, not a hang.
    ctx.wait(&[&ctx.compute, &nccl], "the transfer's NCCL work")?;
    drop(staging);
    drop(rstaging);
    drop(descs);
    ctx.compute
        .synchronize()
        .map_err(ctx.drv("freeing staging", 0))?;
    Ok(moved)
}

/// Default of [`FsdpBackend::with_offload_chunk_bytes`]: 1 GiB.
pub const DEFAULT_OFFLOAD_CHUNK_BYTES: usize = 1 << 30;

/// Queues the device → pinned host copy of `dev` into `host` on the copy stream, in copies of at
/// most `chunk` bytes (`0`: one copy).
fn offload_copy(
    ctx: &RankCtx,
    dev: &CudaSlice<f32>,
    host: &mut PinnedHostSlice<f32>,
    chunk: usize,
    what: &str,
) -> Result<(), CudaError> {
    let n = dev.len();
    let per = chunk / 4;
    if per == 0 || per >= n || host.len() < n {
        return ctx
            .copy
            .memcpy_dtoh(dev, host)
            .map_err(ctx.drv(&format!("offloading {what}"), (n * 4) as u64));
    }
    let hp = host
        .as_mut_ptr()
        .map_err(ctx.drv(&format!("offloading {what}"), 0))?;
    let (dp, _read) = dev.device_ptr(&ctx.copy);
    let mut off = 0;
    while off < n {
        let m = per.min(n - off);
        // SAFETY: `off + m <= n <= host.len()`, so the piece lies inside the pinned buffer, which
        // the caller keeps (and nothing else reads or writes) until the offload wait; the device
        // piece lies inside `dev`, alive and unwritten until then (the wait precedes its free).
        unsafe {
            let dst = std::slice::from_raw_parts_mut(hp.add(off), m);
            cudarc::driver::result::memcpy_dtoh_async(
                dst,
                dp + (off * 4) as u64,
                ctx.copy.cu_stream(),
            )
        }
        .map_err(ctx.drv(&format!("offloading {what}"), (m * 4) as u64))?;
        off += m;
    }
    Ok(())
}

/// Bucket `b`'s sends as peer copies on `stream`: each piece written by the copy engines from
/// this rank's rollout buffer (`rbase`) or staging slot (`staging`) straight to its place in the
/// receiver's rollout buffer (`bases`, by global rank). Returns the bytes sent.
fn peer_copies(
    ctx: &RankCtx,
    stream: &cudarc::driver::CudaStream,
    b: &BucketOps,
    bases: &[u64],
    rbase: u64,
    staging: Option<u64>,
) -> Result<u64, CudaError> {
    let mut sent = 0;
    for s in &b.sends {
        let missing = |what: &str| {
            CudaError::Invalid(format!(
                "peer copy from rank {} to rank {}: {what}",
                ctx.rank, s.peer
            ))
        };
        let dst_off = s
            .dst_off
            .ok_or_else(|| missing("the piece has no place in the receiver's rollout buffer"))?;
        let base = bases
            .get(s.peer)
            .copied()
            .filter(|&b| b != 0)
            .ok_or_else(|| missing("the receiver's rollout buffer is unknown"))?;
        let src = match s.buf {
            Buf::Rollout => rbase,
            Buf::Staging => staging.ok_or_else(|| missing("no staging slot"))?,
        };
        let bytes = (s.count * 2) as usize;
        // SAFETY: the plan keeps the piece inside this rank's rollout buffer or staging slot and
        // inside the receiver's rollout buffer (roll_len elements on every rank), whose address
        // came from the receiver; both stay alive until every rank synchronised at the end of
        // the transfer; peer access is enabled (plans with peer copies exist only then); no
        // other work writes these receiver elements.
        unsafe {
            lifecycle_cuda::copy_2d(
                ctx,
                stream,
                (base + 2 * dst_off, bytes),
                (src + 2 * s.off, bytes),
                bytes,
                1,
                "copying a piece into a peer's rollout buffer",
            )?
        };
        sent += bytes as u64;
    }
    Ok(sent)
}

impl Reshard for FsdpBackend {
    type TrainState = FsdpTrainState;
    type Rollout = FsdpRollout;
    /// Shared, so a cached plan is handed out without copying it.
    type Plan = Arc<FsdpPlan>;
    type Error = FsdpError;

    fn plan(&self, state: &FsdpTrainState) -> Result<Arc<FsdpPlan>, FsdpError> {
        if state.world() != self.pool.world() {
            return Err(FsdpError::WorldMismatch {
                state: state.world(),
                pool: self.pool.world(),
            });
        }
        let mut cache = self
            .plan_cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((layout, plan)) = cache.as_ref() {
            if *layout == state.layout {
                return Ok(plan.clone());
            }
        }
        let core = plan_fsdp_to_tp(&state.layout, &self.layout)?;
        let mut plan = build_plan(core, &state.layout, self.config);
        let peer = self.transport.resolve(&self.pool)?;
        if self.transport == Transport::PeerCopy && !plan.peer_copyable() {
            return Err(FsdpError::Config(format!(
                "transport PeerCopy needs every piece placed in the receivers' rollout buffers, \
                 which gather mode {:?} does not do at T = {}: use GatherMode::SendRecv or \
                 Transport::Auto",
                self.config.mode, plan.core.tp
            )));
        }
        plan.peer_copy = peer && plan.peer_copyable();
        if !plan.peer_copy {
            // This plan moves bytes with NCCL, which a pool with ranks on one GPU lacks.
            self.pool.require_nccl().map_err(|e| {
                FsdpError::Config(format!(
                    "gather mode {:?} at T = {} needs NCCL: {e}; GatherMode::SendRecv uses peer \
                     copies",
                    self.config.mode, plan.core.tp
                ))
            })?;
        }
        let plan = Arc::new(plan);
        if self.verify {
            self.check_finite(state)?;
        }
        *cache = Some((state.layout.clone(), plan.clone()));
        Ok(plan)
    }

    fn enter(
        &mut self,
        plan: &Arc<FsdpPlan>,
        state: &mut FsdpTrainState,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<FsdpRollout, FsdpError> {
        if state.master_offloaded() || state.optimizer_offloaded() {
            return Err(FsdpError::Offloaded {
                operation: "entering rollout mode",
            });
        }
        let len = plan.roll_len as usize;
        let peers_write = plan.peer_copy;
        let mut unit: Vec<()> = vec![(); self.pool.local_ranks().len()];
        // Rollout buffers first: an OOM here leaves the training state untouched.
        let mut rolls = self.pool.run_each(&mut unit, &|c, _| {
            // SAFETY: every element of the rollout buffer is written by a cast or a receive of
            // the plan (the pieces tile every slice exactly) before the buffer is handed out.
            let roll = unsafe { alloc_device::<bf16>(&c.compute, len, c.rank, "rollout weights") }?;
            if peers_write {
                // Peers may write into the buffer as soon as the transfer starts.
                c.compute
                    .synchronize()
                    .map_err(c.drv("allocating the rollout weights", (len * 2) as u64))?;
            }
            Ok(roll)
        })?;
        // The transfer phase's wall time starts after the rollout allocation (reported apart:
        // enter's total includes it).
        let start = Instant::now();
        let tracing = ctx.rec.tracing();
        if self.verify {
            self.queue_offload_hashes(state, ctx.memory)?;
        }
        let mut moved = self.transfer(plan, state, &mut rolls, ctx.memory, tracing)?;
        Self::record_transfer(ctx, &moved, start);
        let entries = Self::entries(plan);
        if self.verify {
            self.record_rollout_sums(&rolls, &entries)?;
        }
        self.finish_offload(state, ctx, &mut moved)?;
        Ok(FsdpRollout {
            ranks: rolls,
            entries,
            len: plan.roll_len,
        })
    }

    fn refresh(
        &mut self,
        plan: &Arc<FsdpPlan>,
        state: &mut FsdpTrainState,
        rollout: &mut FsdpRollout,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), FsdpError> {
        if state.master_offloaded() {
            return Err(FsdpError::Offloaded {
                operation: "refreshing rollout weights",
            });
        }
        if rollout.len != plan.roll_len || rollout.ranks.len() != self.pool.local_ranks().len() {
            return Err(FsdpError::RolloutMismatch {
                expected: plan.roll_len,
                found: rollout.len,
            });
        }
        let start = Instant::now();
        let tracing = ctx.rec.tracing();
        if self.verify {
            self.queue_offload_hashes(state, ctx.memory)?;
        }
        // The old hashes no longer describe the weights, whatever happens next.
        self.rollout_sums = None;
        let mut moved = self.transfer(plan, state, &mut rollout.ranks, ctx.memory, tracing)?;
        Self::record_transfer(ctx, &moved, start);
        if self.verify {
            self.record_rollout_sums(&rollout.ranks, &rollout.entries)?;
        }
        self.finish_offload(state, ctx, &mut moved)
    }

    fn exit(
        &mut self,
        state: &mut FsdpTrainState,
        rollout: Option<FsdpRollout>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), FsdpError> {
        let mut rollout_check = Ok(());
        if let Some(rollout) = rollout {
            rollout_check = self.check_rollout_sums(&rollout);
            ctx.rec.phase(Phase::Release, |_| {
                let mut items: Vec<Option<CudaSlice<bf16>>> =
                    rollout.ranks.into_iter().map(Some).collect();
                self.pool.run_each(&mut items, &|c, buf| {
                    drop(buf.take());
                    c.compute
                        .synchronize()
                        .map_err(c.drv("releasing rollout weights", 0))
                })?;
                Ok::<(), FsdpError>(())
            })?;
        }
        let len = state.shards.rank_len as usize;
        let bytes_each = state.shards.rank_len * 4;
        let tracing = ctx.rec.tracing();
        let verify_on = self.verify;
        let table = verify::shard_table(&state.shards);
        let local_ranks = self.pool.local_ranks().to_vec();
        let slots = &state.shards.slots;
        let out = ctx.rec.phase(Phase::Reload, |scope| {
            let mut items: Vec<&mut RankTrain> = state.ranks.iter_mut().collect();
            let moved = self.pool.run_each(&mut items, &|c, rt| {
                let mut h2d = 0u64;
                let mut tl = StreamTimeline::new(c, tracing)?;
                let offloaded = Buffer::ALL.map(|b| rt.device(b).is_none());
                let mut reload = |dev: &mut Option<CudaSlice<f32>>,
                                  host: &Option<PinnedHostSlice<f32>>,
                                  what: &str,
                                  h2d: &mut u64|
                 -> Result<(), CudaError> {
                    if dev.is_some() {
                        return Ok(());
                    }
                    let host = host.as_ref().ok_or_else(|| {
                        CudaError::Invalid(format!(
                            "{what} is neither on the device nor on the host"
                        ))
                    })?;
                    // SAFETY: fully written by the host→device copy right after.
                    let mut d = unsafe { alloc_device::<f32>(&c.copy, len, c.rank, what)? };
                    let mark = tl.begin(c, &c.copy)?;
                    c.copy.memcpy_htod(host, &mut d).map_err(c.drv(what, 0))?;
                    let h2d_link = Some(Link::HostToDevice);
                    tl.end(
                        c,
                        &c.copy,
                        mark,
                        Phase::Reload,
                        what,
                        "copy",
                        bytes_each,
                        h2d_link,
                    )?;
                    *h2d += bytes_each;
                    *dev = Some(d);
                    Ok(())
                };
                reload(
                    &mut rt.master,
                    &rt.master_host,
                    "reloading master",
                    &mut h2d,
                )?;
                reload(&mut rt.m, &rt.m_host, "reloading Adam m", &mut h2d)?;
                reload(&mut rt.v, &rt.v_host, "reloading Adam v", &mut h2d)?;
                if rt.grads.is_none() {
                    rt.grads = Some(alloc_zeros(&c.compute, len, c.rank, "gradients")?);
                }
                c.sync_all()?;
                let mut corrupted: Option<(Buffer, Mismatch)> = None;
                for b in Buffer::ALL {
                    if !(verify_on && offloaded[b.index()] && rt.sums.has(b)) {
                        continue;
                    }
                    let Some(d) = rt.device_slot(b).take() else {
                        continue;
                    };
                    match verify::check_reloaded(c, &mut rt.sums, b, &d, &table)? {
                        // The reloaded copy differs: it stays offloaded (its device copy is
                        // dropped) and keeps its hashes, so a retry fails the same way.
                        Some(m) => {
                            corrupted.get_or_insert((b, m));
                        }
                        None => *rt.device_slot(b) = Some(d),
                    }
                }
                Ok((h2d, corrupted, tl.finish()?))
            })?;
            scope.add_bytes(Link::HostToDevice, moved.iter().map(|m| m.0).sum());
            for (i, (_, corrupted, _)) in moved.iter().enumerate() {
                if let Some((b, m)) = corrupted {
                    return Err(FsdpError::Corrupted {
                        rank: local_ranks[i],
                        tensor: slots
                            .get(m.tensor)
                            .map(|s| s.name.clone())
                            .unwrap_or_default(),
                        buffer: b.name(),
                        expected: m.expected,
                        found: m.found,
                    });
                }
            }
            Ok::<Vec<RankSpans>, FsdpError>(moved.into_iter().map(|m| m.2).collect())
        })?;
        self.record_spans(ctx, &out);
        rollout_check
    }
}
