//! [`FsdpBackend`]: the FSDP executor on NVIDIA GPUs, its settings and accessors.

use crate::update_kernels::UpdateKernelCache;
use crate::FsdpError;
use lifecycle_layout::settings::{Configure, Honours, SwitchOptions};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use crate::buffers::FsdpBuffers;
use crate::lent::LentFsdpState;

use crate::FsdpTrainState;
use lifecycle_core::MemoryPolicy;
use lifecycle_cuda::{
    PinnedPool, PinnedReservation, ProgramSlot, RankExecutor, ThreadRankPool, Transport,
};
use lifecycle_layout::{FsdpLayout, RolloutLayout};

use lifecycle_layout::fsdp::{BucketConfig, FsdpPlan};

/// A plan compared by identity: the key of a rank's kept step program (held, so the identity
/// cannot be reused by another plan).
#[derive(Debug, Clone)]
pub(crate) struct PlanRef(pub(crate) Arc<FsdpPlan>);

impl PartialEq for PlanRef {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A kept step program's identity: the plan and, per local rank, where its source's tensors are
/// when not where the plan's flat layout puts them (a lent rank's own shards:
/// [`RankBuffers::source_offsets`](lifecycle_cuda::driver::RankBuffers::source_offsets)).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ProgramKey {
    pub(crate) plan: PlanRef,
    pub(crate) at: Vec<Option<Vec<u64>>>,
}

/// Reshards FSDP training shards into bf16 tensor-parallel rollout weights on the GPUs of a
/// [`ThreadRankPool`], with bucketed, shard-aware NCCL transfers and overlapped offload.
///
/// # When a peer rank stalls or dies
/// Every wait on NCCL work is bounded by the pool's deadline
/// ([`ThreadRankPool::collective_timeout`], 10 minutes by default, env
/// `LIFECYCLE_NCCL_TIMEOUT_S`). A transfer whose collectives do not finish in time fails with
/// [`CudaError::CollectiveTimeout`](lifecycle_cuda::CudaError::CollectiveTimeout) (rank, operation, deadline) after the waiting rank aborted
/// its communicator; the switch ends in `LifecycleError::Enter` / `Refresh` with
/// `AfterFailure::Restored`: the training state never left the devices (offloaded buffers are
/// freed only after the transfer), no rollout weights are resident, the lifecycle is in train
/// mode. The pool then refuses every collective at once with [`CudaError::CommAborted`](lifecycle_cuda::CudaError::CommAborted)
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
pub struct FsdpBackend<S: FsdpBuffers = FsdpTrainState> {
    pub(crate) pool: Arc<ThreadRankPool>,
    pub(crate) layout: RolloutLayout,
    pub(crate) config: BucketConfig,
    pub(crate) batched_casts: bool,
    /// The last plan and the training layout it was made for: a switch of the same layout (every
    /// switch of a training run) reuses it instead of planning again.
    pub(crate) plan_cache: Mutex<Option<(Arc<FsdpLayout>, Arc<FsdpPlan>)>>,
    /// The in-place update kernels, compiled and loaded on first use.
    pub(crate) update_kernels: UpdateKernelCache,
    /// Verification mode: hashes of the resident rollout weights.
    pub(crate) rollout_sums: Option<RolloutSums>,
    pub(crate) transport: Transport,
    pub(crate) pinned: Arc<PinnedPool>,
    /// Per local rank, the step program of the last plan run (its copy tables uploaded once
    /// per plan; the plan is held so its identity cannot be reused).
    pub(crate) programs: Mutex<Vec<ProgramSlot<ProgramKey>>>,
    /// Each local rank's rollout entries of the last plan entered.
    pub(crate) entries_cache: Mutex<Option<(PlanRef, RankEntries)>>,
    /// The options every backend holds (dtype, fp8 exemptions, verification, offload overlap,
    /// a frozen base).
    pub(crate) options: SwitchOptions,
    /// With a frozen base: the plan of the trained tensors alone (the adapters and the whole
    /// tensors beside them), beside the whole plan it was made
    /// from ([`lifecycle_layout::fsdp::build_plan_of`]).
    pub(crate) adapter_plan: Mutex<Option<(Arc<FsdpPlan>, Arc<FsdpPlan>)>>,
    /// With a frozen base: whether a rollout holds its cast base (set by enter, cleared when
    /// exit releases the rollout), during which the master updates leave the base alone.
    pub(crate) base_cast: std::sync::atomic::AtomicBool,
    /// The kind of training buffers switched ([`FsdpBuffers`]).
    pub(crate) buffers: PhantomData<fn() -> S>,
}

/// Each local rank's rollout entries, shared by the rollouts of one plan.
pub(crate) type RankEntries = lifecycle_cuda::EntryTable;

/// Hashes of the resident rollout weights, per local rank, per chunk of that rank's table.
pub(crate) struct RolloutSums {
    pub(crate) tables: Vec<lifecycle_cuda::ChunkTable>,
    pub(crate) names: Vec<Vec<String>>,
    pub(crate) sums: Vec<Vec<u64>>,
}

impl<S: FsdpBuffers> std::fmt::Debug for FsdpBackend<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsdpBackend")
            .field("world", &self.pool.world())
            .field("tp", &self.layout.tp())
            .field("config", &self.config)
            .field("batched_casts", &self.batched_casts)
            .field("options", &self.options)
            .finish()
    }
}

impl<S: FsdpBuffers> Configure for FsdpBackend<S> {
    const NAME: &'static str = "the FSDP GPU backend";
    const HONOURS: Honours = Honours::ALL;

    fn options(&self) -> &SwitchOptions {
        &self.options
    }

    /// Replaces the options; the cached plan and the hashes of resident weights go with the
    /// old ones. Verification (computed on the GPUs) also hashes every offloaded buffer per
    /// chunk of each tensor's shard ([`FsdpError::Corrupted`] leaves a mismatched buffer
    /// offloaded) and the rollout weights per tensor ([`FsdpError::RolloutCorrupted`]); it
    /// waits for overlapped offload copies, as a traced switch and a lent state do. An fp8
    /// rollout at W > 1 agrees each block's scale first (partial amaxes, an all-reduce by max,
    /// or a meeting of the ranks sharing a GPU), so only e4m3 bytes cross the links.
    fn set_options(&mut self, options: SwitchOptions) {
        self.options = options;
        self.plan_cache = Mutex::new(None);
        self.adapter_plan = Mutex::new(None);
        self.rollout_sums = None;
    }
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
            programs: Mutex::new(Vec::new()),
            entries_cache: Mutex::new(None),
            options: SwitchOptions::default(),
            adapter_plan: Mutex::new(None),
            base_cast: Default::default(),
            buffers: PhantomData,
            update_kernels: UpdateKernelCache::default(),
            rollout_sums: None,
            transport: Transport::Auto,
            pinned: Arc::new(PinnedPool::new(
                DEFAULT_OFFLOAD_CHUNK_BYTES,
                PinnedPool::default_threads(),
            )),
        }
    }

    /// This backend, switching lent buffers instead of its own
    /// ([`LentFsdpBackend`](crate::LentFsdpBackend): its settings, plans and pinned pool kept;
    /// [`FsdpBackend::lend`] makes the state). Verification mode is refused: its hashes live
    /// beside buffers the backend owns.
    pub fn lending(self) -> Result<FsdpBackend<LentFsdpState>, FsdpError> {
        if self.options.verify {
            return Err(FsdpError::Config(
                "verification mode hashes the backend's own training buffers; lent buffers are \
                 switched without it (with_verification(false))"
                    .into(),
            ));
        }
        Ok(FsdpBackend {
            pool: self.pool,
            layout: self.layout,
            config: self.config,
            batched_casts: self.batched_casts,
            plan_cache: self.plan_cache,
            programs: Mutex::new(Vec::new()),
            entries_cache: self.entries_cache,
            options: self.options,
            adapter_plan: self.adapter_plan,
            base_cast: self.base_cast,
            buffers: PhantomData,
            update_kernels: self.update_kernels,
            rollout_sums: None,
            transport: self.transport,
            pinned: self.pinned,
        })
    }

    /// Starts pinning, in the background, the host memory offloads of `state` under `memory`
    /// take (its master weights and/or Adam moments), so that the first switch does not wait
    /// for pinning ([`lifecycle_cuda::driver::reserve_in_background`]). Call it at setup, once
    /// the memory policy is known; nothing moves, and the first offload of a rank waits only
    /// for what its reservation has not pinned yet.
    pub fn reserve_pinned_in_background(
        &self,
        state: &mut FsdpTrainState,
        memory: MemoryPolicy,
    ) -> Result<PinnedReservation, FsdpError> {
        self.check_state(state)?;
        Ok(lifecycle_cuda::driver::reserve_in_background(
            &*self.pool,
            &self.pinned,
            &mut state.ranks,
            memory,
        )?)
    }
}

impl<S: FsdpBuffers> FsdpBackend<S> {
    /// Cuts each offload copy (device → pinned host) into copies of at most `bytes` (`0`: one
    /// copy per buffer), with a pinned pool of chunks of that size of its own. Default
    /// [`DEFAULT_OFFLOAD_CHUNK_BYTES`].
    pub fn with_offload_chunk_bytes(mut self, bytes: usize) -> Self {
        let chunk = if bytes == 0 { usize::MAX } else { bytes };
        self.pinned = Arc::new(PinnedPool::new(chunk, PinnedPool::default_threads()));
        self
    }

    /// Offloads into the pinned chunks of `pinned` (shared with other backends of the process,
    /// e.g. a Megatron one: pinned memory is slow to allocate, so it is allocated once); offload
    /// copies are cut into pieces of its chunk size.
    pub fn with_pinned_pool(mut self, pinned: Arc<PinnedPool>) -> Self {
        self.pinned = pinned;
        self
    }

    /// The pinned pool offloads take their host memory from.
    pub fn pinned_pool(&self) -> &Arc<PinnedPool> {
        &self.pinned
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

    /// Gives the device memory cached by each rank's stream-ordered pool (freed rollout weights,
    /// offloaded training state) back to the driver, e.g. before another process allocates a KV
    /// cache. The pools keep freed memory mapped by default, so switches reuse it.
    pub fn trim_device_memory(&self) -> Result<(), FsdpError> {
        self.pool.run(&|ctx| ctx.trim_pool())?;
        Ok(())
    }
}

/// Default of [`FsdpBackend::with_offload_chunk_bytes`]: 1 GiB.
pub const DEFAULT_OFFLOAD_CHUNK_BYTES: usize = 1 << 30;

impl<S: FsdpBuffers> lifecycle_cuda::RolloutSource for FsdpBackend<S> {
    fn rollout_layout(&self) -> &RolloutLayout {
        &self.layout
    }

    fn rank_pool(&self) -> &Arc<ThreadRankPool> {
        &self.pool
    }
}
