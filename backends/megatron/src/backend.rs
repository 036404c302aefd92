//! [`MegatronGpuBackend`]: its plan type, settings, construction and per-rank resources.

use crate::config::GpuConfig;
use std::marker::PhantomData;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use lifecycle_core::MemoryPolicy;
use lifecycle_cuda::{ProgramSlot, RankExecutor, ThreadRankPool, TileKernel};

use crate::buffers::MegatronBuffers;
use crate::error::MegatronGpuError;
use crate::state::{GpuRank, MegatronGpuState};
use lifecycle_cuda::PinnedPool;
use lifecycle_layout::fp8::Fp8Keep;
use lifecycle_layout::megatron::schedule::RankSchedule;
use lifecycle_layout::megatron::{Fp8Rollout, MegatronLayout, MegatronPlan};
use lifecycle_layout::settings::{Configure, Honours, SwitchOptions};
use lifecycle_layout::steps::Quantise;
use lifecycle_layout::RolloutLayout;

pub(crate) static NEXT_PLAN: AtomicU64 = AtomicU64::new(1);

/// What a rank's kept step program was built for: the plan's id and where each local rank's
/// parameters lie in its source (`None`: the state's own buffer, in the layout's order).
pub(crate) type ProgramKey = (u64, Vec<Option<Vec<u64>>>);

/// A validated plan and the schedules of this process's ranks.
#[derive(Debug)]
pub struct MegatronGpuPlan {
    pub(crate) id: u64,
    /// The training layout and the rollout layout the plan was made for, as the state and the
    /// backend hold them: [`MegatronGpuPlan::made_for`] matches them by identity first.
    pub(crate) layouts: (Arc<MegatronLayout>, Arc<RolloutLayout>),
    pub(crate) config: GpuConfig,
    pub(crate) peer_copy: bool,
    pub(crate) plan: MegatronPlan,
    pub(crate) offsets: Vec<usize>,
    /// Elements of the buffer the transfer writes (the rollout itself, or in a staged fp8
    /// rollout its bf16 staging buffer).
    pub(crate) len: usize,
    pub(crate) ranks: Vec<RankSchedule>,
    /// How an fp8 rollout is written from the bf16 staging buffer (`None`: a bf16 rollout).
    pub(crate) fp8: Option<Fp8Rollout>,
    /// An fp8 rollout written in one read of the parameters ([`fp8_one_read`]): per local
    /// rank the regions of its parameters quantised into its rollout buffer, the schedules
    /// then copying only the bf16 tensors, into the rollout buffer itself. `None`: staged.
    ///
    /// [`fp8_one_read`]: lifecycle_layout::megatron::fp8_one_read
    pub(crate) one_read: Option<Vec<Vec<Quantise>>>,
    /// With `one_read`: the slot ranges every rank zeroes first (`Fp8Rollout::gaps`).
    pub(crate) one_read_zero: Vec<std::ops::Range<u64>>,
    pub(crate) keep: Fp8Keep,
}

impl MegatronGpuPlan {
    /// Whether the plan moves `train` into `rollout`: the layouts it was made for (the same
    /// allocations, no walk over the tensors: ~30 ns a tensor, ~0.1 ms at 3k), or equal ones.
    pub(crate) fn made_for(
        &self,
        train: &Arc<MegatronLayout>,
        rollout: &Arc<RolloutLayout>,
    ) -> bool {
        let (t, r) = &self.layouts;
        (Arc::ptr_eq(t, train) || **t == **train) && (Arc::ptr_eq(r, rollout) || **r == **rollout)
    }

    /// The planner's plan (every rank).
    pub fn plan(&self) -> &MegatronPlan {
        &self.plan
    }

    /// The schedule of global rank `rank`, when this process drives it.
    pub fn schedule(&self, rank: usize) -> Option<&RankSchedule> {
        self.ranks.iter().find(|s| s.rank == rank)
    }

    /// Elements (two-byte slots) of one rank's rollout buffer: in an fp8 rollout its e4m3
    /// bytes and scales and its bf16 tensors ([`MegatronGpuPlan::fp8`]).
    pub fn rollout_len(&self) -> usize {
        self.fp8.as_ref().map_or(self.len, |f| f.len)
    }

    /// Elements of the buffer the transfer writes: the rollout buffer itself, or in a staged
    /// fp8 rollout the bf16 staging buffer it is quantised from.
    pub fn transfer_len(&self) -> usize {
        self.len
    }

    /// Whether the fp8 rollout is written in one read of the parameters (every rank holds the
    /// whole rows it quantises: quantised straight into the rollout buffer, no staging
    /// buffer), rather than staged in bf16 first; `false` for a bf16 rollout.
    pub fn fp8_one_read(&self) -> bool {
        self.one_read.is_some()
    }

    /// How an fp8 rollout is written from its bf16 staging buffer; `None` for a bf16 rollout.
    pub fn fp8(&self) -> Option<&Fp8Rollout> {
        self.fp8.as_ref()
    }

    /// Whether remote runs travel as peer copies (else as NCCL steps).
    pub fn peer_copy(&self) -> bool {
        self.peer_copy
    }
}

/// Reshards the Megatron training layout into the fused bf16 tensor-parallel rollout layout on
/// the GPUs of a [`ThreadRankPool`].
///
/// Enter runs the plan
/// ([`plan_megatron_to_tp`](lifecycle_layout::megatron::plan_megatron_to_tp)) as each rank's step
/// program, issued by the engine's step runner ([`lifecycle_cuda::run_program`]): each rank
/// copies the runs it holds itself from its parameter buffer into its rollout buffer (auxiliary
/// stream); the bytes of its fused slices it does not hold arrive by peer copies (every rank in
/// this process) or step by step, one NCCL group per step: large contiguous runs straight
/// between the parameter and rollout buffers, the rest packed by the sender into a send slot and
/// unpacked by the receiver from a receive slot (compute stream), with [`GpuConfig::in_flight`]
/// steps in flight. bf16 to bf16: no cast. Offload copies (pinned host memory from a
/// [`PinnedPool`] kept between switches) run on the copy stream meanwhile. Exit releases the
/// rollout and reloads.
///
/// ```no_run
/// use std::sync::Arc;
/// use lifecycle_core::Lifecycle;
/// use lifecycle_cuda::ThreadRankPool;
/// use lifecycle_layout::HostTensor;
/// use lifecycle_megatron::MegatronGpuBackend;
/// use lifecycle_layout::megatron::{MegatronLayout};
/// use lifecycle_layout::{RolloutLayout, RolloutVocab};
/// use lifecycle_layout::ModelSpec;
///
/// let pool = Arc::new(ThreadRankPool::new(2)?);
/// let model = ModelSpec::tiny();
/// let tensors = model.hf_tensors().into_iter().map(|(name, shape)| {
///     let n = shape.iter().product();
///     HostTensor::f32(name, shape, vec![0.5; n])
/// }).collect();
/// let backend = MegatronGpuBackend::new(pool, RolloutLayout::fused(2, RolloutVocab::PadToMultipleOf(1)))?;
/// let state = backend.state_from_hf(MegatronLayout::new(model, 1, 2, 1)?, tensors)?;
/// let mut lc = Lifecycle::new(backend, state);
/// let session = lc.rollout()?;
/// let host = session.backend().download_rollout(&session.weights())?;
/// assert_eq!(host.ranks.len(), 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct MegatronGpuBackend<S: MegatronBuffers = MegatronGpuState> {
    pub(crate) pool: Arc<ThreadRankPool>,
    pub(crate) rollout: Arc<RolloutLayout>,
    pub(crate) config: GpuConfig,
    pub(crate) pinned: Arc<PinnedPool>,
    /// Per local rank, the step program of the last plan (its copy tables uploaded once per
    /// plan), keyed by the plan's id and where the ranks' parameters lie.
    pub(crate) programs: Vec<ProgramSlot<ProgramKey>>,
    pub(crate) cached: Mutex<Option<Arc<MegatronGpuPlan>>>,
    /// The options every backend holds (dtype, fp8 exemptions, offload overlap; verification
    /// refused).
    pub(crate) options: SwitchOptions,
    /// Whose training buffers it switches ([`MegatronBuffers`]).
    pub(crate) buffers: PhantomData<fn() -> S>,
}

impl<S: MegatronBuffers> std::fmt::Debug for MegatronGpuBackend<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MegatronGpuBackend")
            .field("world", &self.pool.world())
            .field("rollout", &self.rollout)
            .field("config", &self.config)
            .field("options", &self.options)
            .finish()
    }
}

impl<S: MegatronBuffers> Configure for MegatronGpuBackend<S> {
    const NAME: &'static str = "the Megatron GPU backend";
    const HONOURS: Honours = Honours::OVERLAP_ONLY;

    fn options(&self) -> &SwitchOptions {
        &self.options
    }

    /// Replaces the options (a cached plan of other options is not reused). With
    /// [`RolloutDtype::Fp8`](lifecycle_layout::fp8::RolloutDtype::Fp8) every matrix
    /// ([`Fp8Keep::keeps_bf16`] false) is quantised to block-scaled e4m3 in its own 128 × 128 block
    /// grid, as the host backend (`MegatronHostBackend`) does and bit-identical to it. Where every
    /// rank holds what it quantises (no byte crosses a link, as with PP = 1 and T a multiple of TP)
    /// and its runs of rows fall on 128-row blocks, each rank quantises straight from its bf16
    /// parameters into its rollout buffer beside the copies of the bf16 tensors: one read of each
    /// parameter, one write of the rollout ([`lifecycle_layout::megatron::fp8_one_read`],
    /// [`MegatronGpuPlan::fp8_one_read`]). Otherwise the transfer writes the bf16 rollout into a
    /// staging buffer, then one pass per rank ([`lifecycle_cuda::quantise_staged`]) copies the bf16
    /// tensors and quantises the others into the rollout buffer
    /// ([`lifecycle_layout::megatron::Fp8Rollout`]), and the staging buffer is freed (peak memory:
    /// the staging buffer beside the fp8 rollout during a switch). A fused tensor (`qkv_proj`,
    /// `gate_up_proj`) whose parts do not end on 128-row boundaries, and non-finite bf16
    /// parameters, are refused by `plan`, naming the tensor, before anything moves.
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use lifecycle_cuda::ThreadRankPool;
    /// use lifecycle_layout::fp8::RolloutDtype;
    /// use lifecycle_layout::settings::Configure;
    /// use lifecycle_layout::{RolloutLayout, RolloutVocab};
    /// use lifecycle_megatron::MegatronGpuBackend;
    /// let pool = Arc::new(ThreadRankPool::new(1)?);
    /// let backend = MegatronGpuBackend::new(pool, RolloutLayout::fused(1, RolloutVocab::Unpadded))?
    ///     .with_rollout_dtype(RolloutDtype::Fp8);
    /// assert_eq!(backend.rollout_dtype(), RolloutDtype::Fp8);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn set_options(&mut self, options: SwitchOptions) {
        self.options = options;
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
            rollout: Arc::new(rollout),
            config: GpuConfig::default(),
            pinned: Arc::new(PinnedPool::default()),
            programs: loaded.iter().map(|()| ProgramSlot::default()).collect(),
            cached: Mutex::new(None),
            options: SwitchOptions::default(),
            buffers: PhantomData,
        })
    }
}

impl<S: MegatronBuffers> MegatronGpuBackend<S> {
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

    pub(crate) fn locals(&self) -> &[usize] {
        self.pool.local_ranks()
    }

    pub(crate) fn world_mismatch(
        &self,
        state_world: usize,
        state_local: usize,
    ) -> MegatronGpuError {
        MegatronGpuError::WorldMismatch {
            state: state_world,
            state_local,
            pool: self.pool.world(),
            pool_local: self.locals().len(),
        }
    }

    pub(crate) fn check_state(&self, state: &S) -> Result<(), MegatronGpuError> {
        let world = state.train_layout().world();
        let locals = state.local_ranks();
        if world != self.pool.world() || locals != self.locals() {
            return Err(self.world_mismatch(world, locals.len()));
        }
        Ok(())
    }

    pub(crate) fn check_plan(
        &self,
        plan: &MegatronGpuPlan,
        state: &S,
    ) -> Result<(), MegatronGpuError> {
        self.check_state(state)?;
        let ranks_match = plan
            .ranks
            .iter()
            .map(|s| s.rank)
            .eq(self.locals().iter().copied());
        if !plan.made_for(state.train_layout(), &self.rollout) || !ranks_match {
            return Err(MegatronGpuError::PlanMismatch);
        }
        Ok(())
    }

    /// Gives the device memory cached by each rank's stream-ordered pool (freed rollout weights,
    /// offloaded state, staging) back to the driver.
    pub fn trim_device_memory(&self) -> Result<(), MegatronGpuError> {
        self.pool.run(&|ctx| ctx.trim_pool())?;
        Ok(())
    }
}

impl MegatronGpuBackend {
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

    /// Starts pinning, in the background, the host memory offloads of `state` under `memory`
    /// take, so that the first switch does not wait for pinning
    /// ([`lifecycle_cuda::driver::reserve_in_background`]); [`Self::reserve_pinned`] is the
    /// blocking form.
    pub fn reserve_pinned_in_background(
        &self,
        state: &mut MegatronGpuState,
        memory: MemoryPolicy,
    ) -> Result<lifecycle_cuda::PinnedReservation, MegatronGpuError> {
        self.check_state(state)?;
        Ok(lifecycle_cuda::driver::reserve_in_background(
            &*self.pool,
            &self.pinned,
            &mut state.ranks,
            memory,
        )?)
    }
}

impl<S: MegatronBuffers> lifecycle_cuda::RolloutSource for MegatronGpuBackend<S> {
    fn rollout_layout(&self) -> &RolloutLayout {
        &self.rollout
    }

    fn rank_pool(&self) -> &Arc<ThreadRankPool> {
        &self.pool
    }
}
