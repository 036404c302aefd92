//! Megatron switches over training buffers the backend does not own: each rank's bf16
//! parameters lent by a caller as device addresses, one per parameter of its stage (views into
//! Megatron-Core's DDP parameter buffers, in whatever order and padding they lie there), with the
//! caller's stream ([`lifecycle_cuda::driver::LentRank`]). The same plans, the same driver, the
//! same rollout buffers as [`MegatronGpuBackend`]'s own state.

use std::marker::PhantomData;
use std::sync::Arc;

use lifecycle_cuda::driver::{LentOffload, LentRank, LentSource, LentStream};
use lifecycle_cuda::RankExecutor;
use lifecycle_layout::megatron::MegatronLayout;

use crate::{MegatronGpuBackend, MegatronGpuError};

/// What a caller lends for one local rank: its stage's bf16 parameters (read in place), the
/// buffers an offload may move, and the stream the caller's work on them runs on.
pub struct LentMegatronParts {
    /// One `(address, elements)` per parameter of the rank's stage, in the order of
    /// [`MegatronLayout::stage_slots`] (each the rank's part: its TP shard, its local experts),
    /// bf16.
    pub params: Vec<(u64, usize)>,
    /// Buffers an offload may move (the fp32 main parameters, the Adam moments, the gradient
    /// buffer), in the order their copies are queued.
    pub offload: Vec<LentOffload>,
    /// The caller's stream, awaited before the switch reads and made to wait after it.
    pub stream: Option<LentStream>,
}

/// A Megatron training state of lent buffers: each local rank's bf16 parameters (and the
/// buffers an offload may move) as a caller's device addresses, with its stream ([`LentRank`]);
/// switched by [`LentMegatronBackend`] with the plans, driver and rollout buffers of
/// [`MegatronGpuBackend`]'s own state.
pub struct LentMegatronState {
    pub(crate) layout: Arc<MegatronLayout>,
    pub(crate) locals: Vec<usize>,
    pub(crate) ranks: Vec<LentRank>,
}

impl std::fmt::Debug for LentMegatronState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LentMegatronState")
            .field("tp", &self.layout.tp())
            .field("pp", &self.layout.pp())
            .field("dp", &self.layout.dp())
            .field("local_ranks", &self.locals)
            .finish()
    }
}

impl LentMegatronState {
    /// The training layout.
    pub fn layout(&self) -> &MegatronLayout {
        &self.layout
    }

    /// The global ranks this process holds, in the pool's order.
    pub fn local_ranks(&self) -> &[usize] {
        &self.locals
    }

    /// Whether any lent buffer is offloaded.
    pub fn offloaded(&mut self) -> bool {
        use lifecycle_cuda::driver::RankBuffers;
        self.ranks.iter_mut().any(|r| r.any_offloaded())
    }

    /// Each local rank's lent buffers (their current device addresses, pinned bytes held).
    pub fn ranks(&self) -> &[LentRank] {
        &self.ranks
    }
}

/// A [`MegatronGpuBackend`] that switches lent training buffers: its
/// [`Reshard`](lifecycle_core::Reshard) with [`LentMegatronState`] as the training state (the
/// same impl as for the backend's own buffers). Made by [`MegatronGpuBackend::lending`].
///
/// A trainer that keeps its own parameters (Megatron-Core: views into its DDP buffers) lends
/// their addresses and its stream; the rollout is read from them in place:
///
/// ```no_run
/// use std::sync::Arc;
/// use lifecycle_core::Lifecycle;
/// use lifecycle_cuda::driver::LentStream;
/// use lifecycle_cuda::ThreadRankPool;
/// use lifecycle_layout::megatron::MegatronLayout;
/// use lifecycle_layout::{ModelSpec, RolloutLayout, RolloutVocab};
/// use lifecycle_megatron::{LentMegatronParts, MegatronGpuBackend};
///
/// # fn param_address(_name: &str) -> u64 { 0 }
/// # fn trainer_stream() -> u64 { 0 }
/// let layout = MegatronLayout::new(ModelSpec::tiny(), 1, 1, 1)?;
/// let pool = Arc::new(ThreadRankPool::new(1)?);
/// let rollout = RolloutLayout::fused(1, RolloutVocab::Unpadded);
/// let backend = MegatronGpuBackend::new(pool, rollout)?.lending();
/// // each parameter of the stage where the trainer keeps it
/// let params = layout
///     .stage_slots(0)
///     .iter()
///     .map(|s| (param_address(&s.name), s.numel()))
///     .collect();
/// let parts = vec![LentMegatronParts {
///     params,
///     offload: Vec::new(),
///     stream: Some(LentStream(trainer_stream())),
/// }];
/// // SAFETY: the addresses are the trainer's live bf16 parameters on GPU 0, kept while lent.
/// let state = unsafe { backend.lend(layout, parts)? };
/// let mut lc = Lifecycle::new(backend, state);
/// let session = lc.rollout()?;
/// let host = session.backend().download_rollout(&session.weights())?;
/// assert_eq!(host.ranks.len(), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub type LentMegatronBackend = MegatronGpuBackend<LentMegatronState>;

impl MegatronGpuBackend {
    /// This backend, switching lent buffers ([`LentMegatronBackend`]): the same pool, rollout
    /// layout, settings, options and pinned pool; plans are made again for the lent state.
    pub fn lending(self) -> LentMegatronBackend {
        MegatronGpuBackend {
            pool: self.pool,
            rollout: self.rollout,
            config: self.config,
            pinned: self.pinned,
            programs: self.programs,
            cached: std::sync::Mutex::new(None),
            options: self.options,
            buffers: PhantomData,
        }
    }
}

impl LentMegatronBackend {
    /// The lent state of the training layout `layout` (W = the pool's), from each local rank's
    /// [`LentMegatronParts`] in `local_ranks()` order. Checked before anything is used: W, one
    /// part per local rank, one lent tensor per parameter of the rank's stage holding exactly
    /// the rank's part of it (named on a mismatch).
    ///
    /// # Safety
    /// Every address must be device memory of its rank's GPU of the stated size, alive until the
    /// state is dropped (the parameters not written by others during a switch), except what a
    /// [`LentOffload`]'s owner releases when asked; each stream a live stream of that device.
    pub unsafe fn lend(
        &self,
        layout: MegatronLayout,
        parts: Vec<LentMegatronParts>,
    ) -> Result<LentMegatronState, MegatronGpuError> {
        let locals = self.locals().to_vec();
        if layout.world() != self.pool.world() || parts.len() != locals.len() {
            return Err(self.world_mismatch(layout.world(), parts.len()));
        }
        for (p, &rank) in parts.iter().zip(&locals) {
            check_params(&layout, &p.params, rank)?;
        }
        let mut items: Vec<Option<LentMegatronParts>> = parts.into_iter().map(Some).collect();
        let ranks = self.pool.run_each(&mut items, &|ctx, p| {
            let p = p.take().ok_or_else(|| {
                lifecycle_cuda::CudaError::Invalid("lent parts used twice".into())
            })?;
            let source = LentSource::Bf16Tensors(p.params);
            // SAFETY: the caller's promise (this function's contract).
            unsafe { LentRank::new(ctx, source, p.offload, p.stream) }
        })?;
        Ok(LentMegatronState {
            layout: Arc::new(layout),
            locals,
            ranks,
        })
    }
}

/// The lent parameters of global rank `rank` must be its stage's, one per slot, each of the
/// slot's elements.
fn check_params(
    layout: &MegatronLayout,
    params: &[(u64, usize)],
    rank: usize,
) -> Result<(), MegatronGpuError> {
    let stage = layout.coords(rank).pp;
    let slots = layout.stage_slots(stage);
    if params.len() != slots.len() {
        return Err(MegatronGpuError::Config(format!(
            "lent parameters of rank {rank}: {} given, stage {stage} has {} (one per parameter, \
             in the order of MegatronLayout::stage_slots)",
            params.len(),
            slots.len()
        )));
    }
    for (slot, &(ptr, n)) in slots.iter().zip(params) {
        if n != slot.numel() {
            return Err(MegatronGpuError::Config(format!(
                "lent parameter {} of rank {rank}: its part has shape {:?} ({} elements), {n} \
                 lent",
                slot.name,
                slot.shape,
                slot.numel()
            )));
        }
        if ptr % 2 != 0 {
            return Err(MegatronGpuError::Config(format!(
                "lent parameter {} of rank {rank}: address {ptr:#x} is not 2-byte aligned (bf16)",
                slot.name
            )));
        }
    }
    Ok(())
}
