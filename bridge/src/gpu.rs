//! A switch over GPU tensors a trainer owns, lent by address with the trainer's stream: PyTorch
//! FSDP2's per-parameter `to_local()` fp32 shards ([`Fsdp`]: [`LentFsdpBackend`] reads them in
//! place) or Megatron-Core's bf16 parameters where its DDP buffers keep them ([`Megatron`]:
//! [`LentMegatronBackend`]); what an offload moves is released and restored by its owner
//! ([`LentOffload`]). The tensors may move between switches (a restored storage gets a new
//! address): the switch lends them again when they did. One [`GpuSwitch`] serves both kinds
//! ([`Lending`] says what differs); the front holds either as a [`GpuFront`].

use lifecycle_layout::settings::Configure;
use std::sync::Arc;
use std::time::Instant;

use lifecycle_core::{
    AfterFailure, EngineBytes, Lifecycle, LifecycleConfig, LifecycleError, Mode, PhaseScope,
    Reshard, RolloutEngine, RolloutView,
};
use lifecycle_cuda::driver::{LentOffload, LentStream};
use lifecycle_cuda::{RankExecutor, RolloutBuffer, RolloutSource, ThreadRankPool};
use lifecycle_decoder::{DecodeError, Filled, GroupStream, Request, Sample};
use lifecycle_decoder_gpu::{
    EngineSettings, GpuDecodeError, GpuEngine, LoraMode, SharedBase, SharedTensor,
};
use lifecycle_fsdp::{FsdpError, LentFsdpBackend, LentFsdpState, LentMaster, LentParts};
use lifecycle_layout::fp8::RolloutDtype;
use lifecycle_layout::megatron::MegatronLayout;
use lifecycle_layout::FsdpLayout;
use lifecycle_megatron::{
    LentMegatronBackend, LentMegatronParts, LentMegatronState, MegatronGpuError,
};

use crate::error::BridgeError;
use crate::host::not_entered;
use crate::model::ModelBinding;
use crate::settings::SwitchSettings;
use crate::shards::{check_shards, Shard};
use crate::switch::{Entered, SwitchStats, Tally};
use crate::views::{buffer_views, Device, Leases, TensorView};

/// What a trainer lends for one local rank at an enter.
pub struct GpuRankParts {
    /// Its tensors, one per tensor of the training layout in its order: FSDP2's fp32 shards in
    /// the binding's order, or Megatron-Core's bf16 parameters of the rank's stage in the order
    /// of [`MegatronLayout::stage_slots`].
    pub shards: Vec<Shard>,
    /// What an offload may move (used only when the shards are lent anew).
    pub offload: Vec<LentOffload>,
    /// Where those buffers are, `(address, bytes)`: buffers that appeared or moved since the
    /// last lending (an optimizer's state, created at its first step) make the switch lend anew.
    pub offload_at: Vec<(u64, usize)>,
    /// The trainer's stream (`torch.cuda.current_stream().cuda_stream`).
    pub stream: Option<u64>,
}

/// The project's GPU engine, when one is attached: the lifecycle wakes and puts it to sleep
/// with the rollout weights.
#[derive(Default)]
pub struct EngineSlot(Option<GpuEngine>);

impl RolloutEngine<RolloutBuffer> for EngineSlot {
    type Error = GpuDecodeError;

    fn wake(
        &mut self,
        weights: RolloutView<'_, RolloutBuffer>,
        scope: &mut PhaseScope,
    ) -> Result<(), GpuDecodeError> {
        match &mut self.0 {
            Some(e) => e.wake(weights, scope),
            None => Ok(()),
        }
    }

    fn sleep(&mut self, scope: &mut PhaseScope) -> Result<(), GpuDecodeError> {
        match &mut self.0 {
            Some(e) => e.sleep(scope),
            None => Ok(()),
        }
    }

    fn memory(&self) -> EngineBytes {
        self.0
            .as_ref()
            .map_or_else(EngineBytes::default, GpuEngine::memory)
    }
}

/// What differs between the kinds of lent training tensors a [`GpuSwitch`] switches: the
/// backend that reads them, how they are checked and lent, and how a failed switch reads.
pub trait Lending: 'static {
    /// The lending backend.
    type Backend: Reshard<TrainState = Self::State, Rollout = RolloutBuffer, Error = Self::Error>
        + RolloutSource;
    /// Its lent training state.
    type State;
    /// Its error.
    type Error: std::error::Error + Send + Sync + 'static;
    /// The training layout the lent tensors follow.
    type Train: Clone;

    /// Checks `shards[local][tensor]` of the global `ranks` against `train` (count, sizes,
    /// addresses), reading nothing.
    fn check(
        train: &Self::Train,
        ranks: &[usize],
        shards: &[Vec<Shard>],
    ) -> Result<(), BridgeError>;

    /// The lent state of `parts` (checked by [`Lending::check`]).
    ///
    /// # Safety
    /// As [`GpuSwitch::enter`].
    unsafe fn lend(
        backend: &Self::Backend,
        train: &Self::Train,
        parts: Vec<GpuRankParts>,
    ) -> Result<Self::State, Self::Error>;

    /// A NaN or an infinity the switch found in the lent tensors: `(tensor, detail)`.
    fn nonfinite(e: &Self::Error) -> Option<(String, String)>;

    /// The names and shapes global rank `rank` lends, in the order [`GpuSwitch::enter`] takes
    /// them, where the kind lists them (Megatron: its stage's parameters); otherwise why not.
    fn parameters(train: &Self::Train, rank: usize) -> Result<Named, BridgeError>;

    /// Tells `state` that the lender wrote frozen tensor `name` since the last enter (where the
    /// kind holds a frozen base; the others never get one).
    fn mark_frozen_written(_state: &mut Self::State, _name: &str) {}
}

/// PyTorch FSDP2's fp32 shards ([`LentFsdpBackend`]).
pub struct Fsdp;

impl Lending for Fsdp {
    type Backend = LentFsdpBackend;
    type State = LentFsdpState;
    type Error = FsdpError;
    type Train = FsdpLayout;

    fn check(
        train: &FsdpLayout,
        ranks: &[usize],
        shards: &[Vec<Shard>],
    ) -> Result<(), BridgeError> {
        check_shards(train, ranks, shards)
    }

    unsafe fn lend(
        backend: &LentFsdpBackend,
        train: &FsdpLayout,
        parts: Vec<GpuRankParts>,
    ) -> Result<LentFsdpState, FsdpError> {
        let lent = parts
            .into_iter()
            .map(|p| LentParts {
                master: LentMaster::Shards(p.shards),
                offload: p.offload,
                stream: p.stream.map(LentStream),
            })
            .collect();
        // SAFETY: forwarded to the caller.
        unsafe { backend.lend(train.clone(), lent) }
    }

    fn nonfinite(e: &FsdpError) -> Option<(String, String)> {
        match e {
            FsdpError::NonFinite {
                tensor,
                rank,
                index,
                value,
            } => Some((
                tensor.clone(),
                format!("{value} at element {index} of rank {rank}'s shard"),
            )),
            _ => None,
        }
    }

    fn mark_frozen_written(state: &mut LentFsdpState, name: &str) {
        state.mark_frozen_written(name);
    }

    fn parameters(_train: &FsdpLayout, _rank: usize) -> Result<Named, BridgeError> {
        Err(BridgeError::Config(
            "parameters lists what a Megatron switch lends; an FSDP2 switch takes its shards in \
             the order of the names it was built with"
                .into(),
        ))
    }
}

/// Megatron-Core's bf16 parameters where its DDP buffers keep them ([`LentMegatronBackend`]).
pub struct Megatron;

impl Lending for Megatron {
    type Backend = LentMegatronBackend;
    type State = LentMegatronState;
    type Error = MegatronGpuError;
    type Train = MegatronLayout;

    fn check(
        train: &MegatronLayout,
        ranks: &[usize],
        shards: &[Vec<Shard>],
    ) -> Result<(), BridgeError> {
        crate::shards::check_parameters(train, ranks, shards)
    }

    unsafe fn lend(
        backend: &LentMegatronBackend,
        train: &MegatronLayout,
        parts: Vec<GpuRankParts>,
    ) -> Result<LentMegatronState, MegatronGpuError> {
        let lent = parts
            .into_iter()
            .map(|p| LentMegatronParts {
                params: p.shards,
                offload: p.offload,
                stream: p.stream.map(LentStream),
            })
            .collect();
        // SAFETY: forwarded to the caller.
        unsafe { backend.lend(train.clone(), lent) }
    }

    fn nonfinite(e: &MegatronGpuError) -> Option<(String, String)> {
        match e {
            MegatronGpuError::Host(lifecycle_state::megatron::MegatronError::NonFinite {
                name,
                rank,
                index,
            }) => Some((
                name.clone(),
                format!("a NaN or an infinity at element {index} of rank {rank}'s parameter"),
            )),
            _ => None,
        }
    }

    fn parameters(train: &MegatronLayout, rank: usize) -> Result<Named, BridgeError> {
        Ok(train
            .stage_slots(train.coords(rank).pp)
            .iter()
            .map(|s| (s.name.clone(), s.shape.clone()))
            .collect())
    }
}

type GpuLifecycle<L> = Lifecycle<<L as Lending>::Backend, EngineSlot>;

/// What a lending was made of, per local rank: the tensors, the stream, the offload buffers.
type LendKey = (Vec<Shard>, Option<u64>, Vec<(u64, usize)>);

enum Slot<L: Lending> {
    /// Nothing lent yet (or between lendings).
    Idle(Box<(L::Backend, EngineSlot)>),
    /// Lent, with the tensors' addresses and the stream they were lent with.
    Live(Box<GpuLifecycle<L>>, Vec<LendKey>),
    /// A re-lending failed part way: the switch cannot be used again.
    Broken,
}

/// A switch over lent GPU tensors of kind `L` (see the [module docs](self)).
pub struct GpuSwitch<L: Lending = Fsdp> {
    slot: Slot<L>,
    binding: ModelBinding,
    train: L::Train,
    config: LifecycleConfig,
    leases: Arc<Leases>,
    generation: u64,
    lendings: u64,
    tally: Tally,
    /// The frozen base tensors read in place ([`GpuSwitch::share_base`]), which an attached
    /// engine reads where they are.
    shared: Option<SharedBase>,
}

impl<L: Lending> std::fmt::Debug for GpuSwitch<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuSwitch")
            .field("generation", &self.generation)
            .field("lendings", &self.lendings)
            .finish()
    }
}

/// Checks that `pool` is the world `settings` name and the memory policy is sound.
fn check_world(settings: &SwitchSettings, pool: &ThreadRankPool) -> Result<(), BridgeError> {
    if pool.world() != settings.world {
        return Err(BridgeError::Config(format!(
            "world size {} given, the GPU ranks of this process form a world of {}",
            settings.world,
            pool.world()
        )));
    }
    settings
        .lifecycle
        .memory
        .validate()
        .map_err(BridgeError::Config)
}

impl GpuSwitch<Fsdp> {
    /// A switch of FSDP2 shards for `binding`'s model on the ranks of `pool` (W = the pool's
    /// world).
    pub fn new(
        binding: ModelBinding,
        settings: SwitchSettings,
        pool: Arc<ThreadRankPool>,
    ) -> Result<Self, BridgeError> {
        check_world(&settings, &pool)?;
        if let Some((name, _)) = binding.shared().first() {
            let (w, t, dtype) = (settings.world, settings.tp, settings.options.dtype);
            if w != 1 || t != 1 || dtype != RolloutDtype::Bf16 {
                return Err(BridgeError::tensor(
                    name,
                    format!(
                        "a bf16 frozen base is read in place by the rollout, on one GPU in \
                         bf16: W = 1, rollout_tp = 1 and dtype bf16 (found W = {w}, rollout_tp \
                         = {t}, dtype {dtype:?}): otherwise keep the base in fp32, which the \
                         switch casts"
                    ),
                ));
            }
        }
        let (train, rollout) = binding.layouts(settings.world, settings.tp, settings.experts)?;
        let backend = lifecycle_fsdp::FsdpBackend::new(pool, rollout)
            .with_verification(false)
            .with_options(settings.options)
            .lending()
            .map_err(BridgeError::backend)?;
        Ok(GpuSwitch::with_backend(
            binding,
            train,
            backend,
            settings.lifecycle,
        ))
    }
}

impl GpuSwitch<Megatron> {
    /// A switch of Megatron-Core parameters in the training layout `train` (TP × PP × DP = the
    /// pool's world) for `binding`'s model on the ranks of `pool`, into the fused rollout layout
    /// at `settings.tp`; checked against each other as a switch will plan them.
    pub fn megatron(
        binding: ModelBinding,
        train: MegatronLayout,
        settings: SwitchSettings,
        pool: Arc<ThreadRankPool>,
    ) -> Result<Self, BridgeError> {
        check_world(&settings, &pool)?;
        let rollout = lifecycle_layout::RolloutLayout::fused(
            settings.tp,
            lifecycle_layout::RolloutVocab::Unpadded,
        )
        .with_expert_placement(settings.experts);
        lifecycle_layout::megatron::plan_megatron_to_tp(
            &train,
            &rollout,
            lifecycle_layout::megatron::BucketConfig::default(),
        )
        .map_err(|e| BridgeError::Config(e.to_string()))?;
        let backend = lifecycle_megatron::MegatronGpuBackend::new(pool, rollout)
            .map_err(BridgeError::backend)?
            .with_options(settings.options)
            .lending();
        Ok(GpuSwitch::with_backend(
            binding,
            train,
            backend,
            settings.lifecycle,
        ))
    }
}

impl<L: Lending> GpuSwitch<L> {
    /// The names and shapes local rank `local` lends, in the order [`GpuSwitch::enter`] takes
    /// them ([`Lending::parameters`]: a Megatron switch's stage parameters; an FSDP2 switch
    /// refuses, its shards following the binding's names).
    pub fn parameters(&self, local: usize) -> Result<Named, BridgeError> {
        let ranks = self.local_ranks()?;
        let rank = *ranks.get(local).ok_or_else(|| {
            BridgeError::Config(format!(
                "local rank {local}: this switch drives {} ranks",
                ranks.len()
            ))
        })?;
        L::parameters(&self.train, rank)
    }

    fn with_backend(
        binding: ModelBinding,
        train: L::Train,
        backend: L::Backend,
        config: LifecycleConfig,
    ) -> Self {
        GpuSwitch {
            slot: Slot::Idle(Box::new((backend, EngineSlot::default()))),
            binding,
            train,
            config,
            leases: Arc::new(Leases::default()),
            generation: 0,
            lendings: 0,
            tally: Tally::default(),
            shared: None,
        }
    }

    /// Where the binding's shared tensors ([`ModelBinding::shared`]) are: `addresses[i]` the
    /// device address of the `i`-th, bf16 on this switch's GPU. An engine attached from now on
    /// reads them there ([`GpuEngine::share_base`]); checked by name first (count, alignment).
    ///
    /// # Safety
    /// Each address must be device memory of this switch's GPU holding its tensor's bf16
    /// elements, alive as long as an engine of this switch may run, and not written while one
    /// runs a call (a write between calls is the caller's to refuse: `Switch::check_shared`).
    pub unsafe fn share_base(&mut self, addresses: Vec<u64>) -> Result<(), BridgeError> {
        let shared = self.binding.shared();
        if shared.is_empty() || addresses.len() != shared.len() {
            return Err(BridgeError::Config(format!(
                "share_base: {} addresses for the binding's {} shared tensors",
                addresses.len(),
                shared.len()
            )));
        }
        let tensors = shared
            .iter()
            .zip(addresses)
            .map(|((name, shape), address)| SharedTensor {
                name: name.clone(),
                shape: shape.clone(),
                address,
            })
            .collect();
        let layout = self.binding.whole_rollout_layout()?;
        self.shared = Some(SharedBase::new(layout, tensors).map_err(BridgeError::backend)?);
        Ok(())
    }

    /// The model binding.
    pub fn binding(&self) -> &ModelBinding {
        &self.binding
    }

    /// The leases on handed-out views.
    pub fn leases(&self) -> &Arc<Leases> {
        &self.leases
    }

    /// Times the shards were lent (1 + the times they had moved at an enter).
    pub fn lendings(&self) -> u64 {
        self.lendings
    }

    fn backend(&self) -> Result<&L::Backend, BridgeError> {
        match &self.slot {
            Slot::Idle(idle) => Ok(&idle.0),
            Slot::Live(lc, _) => Ok(lc.backend()),
            Slot::Broken => Err(broken()),
        }
    }

    /// Global ranks this process drives.
    pub fn local_ranks(&self) -> Result<Vec<usize>, BridgeError> {
        Ok(self.backend()?.rank_pool().local_ranks().to_vec())
    }

    /// Attaches the project's GPU engine (leaving rollout mode first: the next enter wakes it);
    /// with LoRA adapters, the engine applies them as its settings' `lora_mode` says
    /// ([`GpuEngine::with_lora`]; unmerged beside the base by default).
    pub fn attach_engine(&mut self, settings: EngineSettings) -> Result<(), BridgeError> {
        if settings.lora_mode == LoraMode::Merged && self.binding.lora().is_none() {
            return Err(BridgeError::Config(
                "lora_mode: `merged` on a switch without LoRA adapters (from_peft, or lora=...)"
                    .into(),
            ));
        }
        self.exit()?;
        let backend = self.backend()?;
        let mut engine = GpuEngine::for_backend(backend, self.binding.config(), settings)
            .map_err(BridgeError::backend)?;
        if let Some(lora) = self.binding.lora() {
            engine = engine.with_lora(lora.clone());
        }
        if !self.binding.shared().is_empty() {
            let Some(base) = self.shared.clone() else {
                return Err(BridgeError::Config(
                    "the switch's shared base has no addresses yet (share_base)".into(),
                ));
            };
            // SAFETY: the addresses are the trainer's tensors as share_base's caller promised
            // (alive while an engine of this switch may run, unwritten while one runs a call).
            unsafe { engine.share_base(Some(base)) }.map_err(BridgeError::backend)?;
        }
        match &mut self.slot {
            Slot::Idle(idle) => idle.1 .0 = Some(engine),
            Slot::Live(lc, _) => lc.engine_mut().0 = Some(engine),
            Slot::Broken => return Err(broken()),
        }
        Ok(())
    }

    /// With LoRA adapters (a frozen base): the first frozen tensor whose versions moved between
    /// `seen` (the last enter's) and `versions` (the front's tuple of each tensor's versions,
    /// in the binding's order: [`version_items`]); `None` without adapters or where the
    /// versions are not a tuple of one item per tensor. [`GpuSwitch::enter`] passes it to the
    /// lent state, whose refresh then refuses it by name.
    pub fn frozen_written(&self, seen: &[u64], versions: &[u64]) -> Option<String> {
        let lora = self.binding.lora()?;
        first_frozen_written(self.binding.names(), &lora.trained, seen, versions)
    }

    /// Checks `shards` (`shards[local][tensor]`) as [`enter`](GpuSwitch::enter) does, without
    /// reading them.
    pub fn check_shards(&self, shards: &[Vec<Shard>]) -> Result<(), BridgeError> {
        L::check(&self.train, &self.local_ranks()?, shards)
    }

    /// Enters rollout mode: lends the shards anew if they moved (or at the first call), then
    /// switches when `changed` (or when nothing is resident); otherwise reuses the resident
    /// weights and moves nothing. `frozen_written` ([`GpuSwitch::frozen_written`]) names a
    /// frozen tensor the trainer wrote: a refresh refuses it, the enter after casts it.
    ///
    /// # Safety
    /// Every tensor's address must be device memory of its rank's GPU holding that many elements
    /// of the kind's type (fp32 shards, bf16 parameters), alive (and not written during a switch) until the
    /// next enter that lends anew or the switch is dropped, except what an offload's owner
    /// releases when asked; each stream a live stream of that device.
    pub unsafe fn enter(
        &mut self,
        parts: Vec<GpuRankParts>,
        changed: bool,
        frozen_written: Option<String>,
    ) -> Result<Entered, BridgeError> {
        let ranks = self.local_ranks()?;
        let shards: Vec<Vec<Shard>> = parts.iter().map(|p| p.shards.clone()).collect();
        L::check(&self.train, &ranks, &shards)?;
        let key: Vec<LendKey> = parts
            .iter()
            .map(|p| (p.shards.clone(), p.stream, p.offload_at.clone()))
            .collect();
        let moved = !matches!(&self.slot, Slot::Live(_, at) if *at == key);
        if let Slot::Live(lc, _) = &self.slot
            && !moved
            && !changed
            && lc.rollout_is_current()
        {
            return self.reuse();
        }
        let held = self.leases.held();
        if !held.is_empty() {
            return Err(BridgeError::InUse {
                operation: "entering with changed weights",
                held,
            });
        }
        let start = Instant::now();
        let before = if moved {
            // SAFETY: the caller's promise (this function's contract).
            unsafe { self.lend(parts, key)? };
            // a new lending's lifecycle starts with no metrics
            lifecycle_core::Metrics::default()
        } else {
            let before = self.metrics();
            if let Slot::Live(lc, _) = &mut self.slot {
                // mutable access to the training state marks the weights changed: the next
                // rollout refreshes them
                let mut train = lc.train().map_err(BridgeError::backend)?;
                let state = train.state_mut();
                if let Some(name) = &frozen_written {
                    L::mark_frozen_written(state, name);
                }
            }
            before
        };
        let Slot::Live(lc, _) = &mut self.slot else {
            return Err(broken());
        };
        rollout_call::<L>(lc)?;
        let delta = lc.metrics().since(&before);
        self.tally.switched(&delta);
        self.generation += 1;
        Ok(Entered::switched(self.generation, start.elapsed()))
    }

    /// A rollout call on the resident weights when they are current (nothing read, nothing
    /// moved); `None` when an [`enter`](GpuSwitch::enter) with the shards is needed.
    pub fn reuse_current(&mut self) -> Result<Option<Entered>, BridgeError> {
        match &self.slot {
            Slot::Live(lc, _) if lc.rollout_is_current() => self.reuse().map(Some),
            Slot::Broken => Err(broken()),
            _ => Ok(None),
        }
    }

    fn reuse(&mut self) -> Result<Entered, BridgeError> {
        let Slot::Live(lc, _) = &mut self.slot else {
            return Err(broken());
        };
        rollout_call::<L>(lc)?;
        self.tally.reused();
        Ok(Entered::reused(self.generation))
    }

    /// The current lending's metrics (empty between lendings).
    fn metrics(&self) -> lifecycle_core::Metrics {
        match &self.slot {
            Slot::Live(lc, _) => lc.metrics().clone(),
            _ => lifecycle_core::Metrics::default(),
        }
    }

    /// Lends `parts` (leaving rollout mode and dropping the previous lending first).
    ///
    /// # Safety
    /// As [`GpuSwitch::enter`].
    unsafe fn lend(
        &mut self,
        parts: Vec<GpuRankParts>,
        key: Vec<LendKey>,
    ) -> Result<(), BridgeError> {
        if let Slot::Live(lc, _) = &mut self.slot {
            lc.exit().map_err(BridgeError::backend)?;
        }
        let (backend, engine) = match std::mem::replace(&mut self.slot, Slot::Broken) {
            Slot::Idle(idle) => *idle,
            Slot::Live(lc, _) => {
                let (b, _old, e) = lc.into_parts_with_engine().map_err(BridgeError::backend)?;
                (b, e)
            }
            Slot::Broken => return Err(broken()),
        };
        // SAFETY: the caller's promise (GpuSwitch::enter's contract).
        let state = match unsafe { L::lend(&backend, &self.train, parts) } {
            Ok(s) => s,
            Err(e) => {
                self.slot = Slot::Idle(Box::new((backend, engine)));
                return Err(BridgeError::backend(e));
            }
        };
        let lc = Lifecycle::with_config(backend, state, self.config)
            .map_err(BridgeError::backend)?
            .with_engine(engine);
        self.slot = Slot::Live(Box::new(lc), key);
        self.lendings += 1;
        Ok(())
    }

    fn live(&mut self) -> Result<&mut GpuLifecycle<L>, BridgeError> {
        match &mut self.slot {
            Slot::Live(lc, _) if lc.rollout_is_current() => Ok(lc),
            Slot::Broken => Err(broken()),
            _ => Err(not_entered()),
        }
    }

    /// The views of local rank `local`'s rollout weights (in rollout mode only).
    pub fn views(&mut self, local: usize) -> Result<Vec<TensorView>, BridgeError> {
        let lc = self.live()?;
        let session = lc.rollout().map_err(BridgeError::backend)?;
        let weights = session.weights();
        let buffer = weights.get();
        let pool = session.backend().rank_pool().clone();
        let mut items: Vec<&lifecycle_cuda::cudarc::driver::CudaSlice<half::bf16>> =
            buffer.buffers().iter().collect();
        let bases = pool
            .run_each(&mut items, &|ctx, b| Ok((ctx.addr(*b), ctx.ctx.ordinal())))
            .map_err(BridgeError::backend)?;
        let Some(&(base, ordinal)) = bases.get(local) else {
            return Err(BridgeError::Config(format!(
                "local rank {local}: this switch drives {} ranks",
                bases.len()
            )));
        };
        let views = buffer_views(buffer.rank_entries(local), base, Device::Cuda(ordinal));
        session.finish().map_err(BridgeError::backend)?;
        Ok(views)
    }

    /// Runs `f` on the attached engine in a rollout session over the resident weights.
    fn with_engine<R>(
        &mut self,
        f: impl FnOnce(RolloutView<'_, RolloutBuffer>, &mut GpuEngine) -> Result<R, BridgeError>,
    ) -> Result<R, BridgeError> {
        let lc = self.live()?;
        let mut session = lc.rollout().map_err(BridgeError::backend)?;
        let (weights, mut engine) = session.parts();
        let Some(e) = engine.0.as_mut() else {
            return Err(BridgeError::Config(
                "no engine attached to this switch (lifecycle.Engine(switch, ...))".into(),
            ));
        };
        let out = f(weights, e)?;
        session.finish().map_err(BridgeError::backend)?;
        Ok(out)
    }

    /// Serves `requests` with the attached engine on the resident weights (continuous
    /// batching: [`GpuEngine::run`](lifecycle_decoder_gpu::GpuEngine::run)); a bad request is
    /// [`BridgeError::Config`] naming it and its field, before anything runs.
    pub fn run(&mut self, requests: Vec<Request>) -> Result<Vec<Sample>, BridgeError> {
        self.with_engine(|weights, e| e.run(weights, requests).map_err(request_error))
    }

    /// DAPO's dynamic sampling streamed through the attached engine on the resident weights
    /// ([`GroupStream::fill`]): the stream samples on the session's weight version (a partial
    /// rollout carried from an earlier fill continues on these weights, and one past its
    /// staleness bound is dropped).
    pub fn fill(
        &mut self,
        stream: &mut GroupStream,
        want: usize,
        group: impl FnMut(u64) -> Result<Vec<Request>, GpuDecodeError>,
        keep: impl FnMut(u64, &[Sample]) -> Result<bool, GpuDecodeError>,
    ) -> Result<Filled, BridgeError> {
        self.with_engine(|weights, e| {
            stream
                .set_version(weights.version())
                .map_err(BridgeError::backend)?;
            let mut slots = e.slots(&weights).map_err(BridgeError::backend)?;
            stream
                .fill(&mut slots, want, group, keep)
                .map_err(request_error)
        })
    }

    /// Leaves rollout mode, bringing back what was offloaded (refused while a handed-out view is
    /// referenced).
    pub fn exit(&mut self) -> Result<(), BridgeError> {
        self.exit_for("exit")
    }

    /// [`exit`](GpuSwitch::exit) on behalf of `operation` (named in a refusal).
    pub fn exit_for(&mut self, operation: &'static str) -> Result<(), BridgeError> {
        let held = self.leases.held();
        if !held.is_empty() {
            return Err(BridgeError::InUse { operation, held });
        }
        match &mut self.slot {
            Slot::Live(lc, _) => {
                let before = lc.metrics().clone();
                let leaving = lc.mode() == Mode::Rollout;
                lc.exit().map_err(BridgeError::backend)?;
                if leaving {
                    self.tally.exited(&lc.metrics().since(&before));
                }
                Ok(())
            }
            Slot::Idle(..) => Ok(()),
            Slot::Broken => Err(broken()),
        }
    }

    /// Switch counts and times (over every lending).
    pub fn stats(&self) -> SwitchStats {
        self.tally.stats(self.generation)
    }
}

/// The top-level items of the versions a front passes, flattened with tags (a tuple `2, len,
/// items…`, a counter `1, value`, none `0`: the Python front's `_flat`): one per tensor where
/// the front gives a tuple of each tensor's versions; `None` where `flat` is not a tuple.
///
/// ```
/// use lifecycle_bridge::gpu::version_items;
/// // ((1, None), 7): two tensors, the first with two counters
/// let flat = [2, 2, 2, 2, 1, 1, 0, 1, 7];
/// let items = version_items(&flat).unwrap();
/// assert_eq!(items, [&[2, 2, 1, 1, 0][..], &[1, 7][..]]);
/// assert!(version_items(&[1, 7]).is_none() && version_items(&[2, 3, 0]).is_none());
/// ```
pub fn version_items(flat: &[u64]) -> Option<Vec<&[u64]>> {
    // the end of the item that starts at `at`
    fn end(flat: &[u64], at: usize) -> Option<usize> {
        match *flat.get(at)? {
            0 => Some(at + 1),
            1 => flat.get(at + 1).map(|_| at + 2),
            2 => {
                let n = usize::try_from(*flat.get(at + 1)?).ok()?;
                let mut i = at + 2;
                for _ in 0..n {
                    i = end(flat, i)?;
                }
                Some(i)
            }
            _ => None,
        }
    }
    if *flat.first()? != 2 {
        return None;
    }
    let n = usize::try_from(*flat.get(1)?).ok()?;
    let (mut at, mut items) = (2, Vec::new());
    for _ in 0..n {
        let stop = end(flat, at)?;
        items.push(&flat[at..stop]);
        at = stop;
    }
    (at == flat.len()).then_some(items)
}

/// The first frozen tensor of `names` (one `trained` does not move: not a LoRA matrix, not a
/// whole tensor trained beside the adapters) whose item of `versions` differs from its item of
/// `seen` ([`version_items`]); `None` where neither is a tuple of one item per name.
///
/// ```
/// use lifecycle_bridge::gpu::first_frozen_written;
/// use lifecycle_layout::lora::Trained;
/// let names = [("q.weight".to_string(), vec![4, 4]), ("q.lora_A.weight".to_string(), vec![2, 4]),
///     ("lm_head.weight".to_string(), vec![8, 4])];
/// let seen = [2, 3, 1, 5, 1, 9, 1, 4];
/// let (adapter_moved, base_moved) = ([2, 3, 1, 5, 1, 10, 1, 4], [2, 3, 1, 6, 1, 9, 1, 4]);
/// let head_moved = [2, 3, 1, 5, 1, 9, 1, 7];
/// let adapters = Trained::default();
/// assert_eq!(first_frozen_written(&names, &adapters, &seen, &adapter_moved), None);
/// assert_eq!(first_frozen_written(&names, &adapters, &seen, &base_moved).as_deref(), Some("q.weight"));
/// assert_eq!(first_frozen_written(&names, &adapters, &seen, &head_moved).as_deref(), Some("lm_head.weight"));
/// // the head trained beside the adapters: its writes are the training's
/// let head = Trained::new(["lm_head.weight"]);
/// assert_eq!(first_frozen_written(&names, &head, &seen, &head_moved), None);
/// assert_eq!(first_frozen_written(&names, &head, &[1, 5], &[1, 6]), None); // not one item a tensor
/// ```
pub fn first_frozen_written(
    names: &[(String, Vec<usize>)],
    trained: &lifecycle_layout::lora::Trained,
    seen: &[u64],
    versions: &[u64],
) -> Option<String> {
    let (was, is) = (version_items(seen)?, version_items(versions)?);
    if was.len() != names.len() || is.len() != names.len() {
        return None;
    }
    names
        .iter()
        .zip(was.iter().zip(&is))
        .find(|((name, _), (was, is))| was != is && !trained.moves(name))
        .map(|((name, _), _)| name.clone())
}

/// One rollout call that switches if needed and ends at once.
fn rollout_call<L: Lending>(lc: &mut GpuLifecycle<L>) -> Result<(), BridgeError> {
    let session = lc.rollout().map_err(switch_error::<L>)?;
    session.finish().map_err(BridgeError::backend)
}

/// A failed switch as the bridge reports it: a NaN or an infinity in the trainer's tensors
/// (found by the switch's casts and quantisations, or its check before an fp8 plan) after which
/// the training state was restored is [`BridgeError::NonFinite`]; anything else says what the
/// lifecycle says.
fn switch_error<L: Lending>(e: LifecycleError<L::Error>) -> BridgeError {
    let (source, restored) = match &e {
        LifecycleError::Plan(source) => (source, true),
        LifecycleError::Enter { source, after } | LifecycleError::Refresh { source, after } => {
            (source, matches!(after, AfterFailure::Restored))
        }
        _ => return BridgeError::backend(e),
    };
    match L::nonfinite(source) {
        Some((name, detail)) if restored => BridgeError::NonFinite { name, detail },
        _ => BridgeError::backend(e),
    }
}

fn broken() -> BridgeError {
    BridgeError::Backend(
        "an earlier lending of the shards failed part way; build a new switch".into(),
    )
}

/// A bad request is the caller's [`BridgeError::Config`] (naming the request and its field);
/// anything else the backend's error.
fn request_error(e: GpuDecodeError) -> BridgeError {
    match e {
        GpuDecodeError::Decode(d @ DecodeError::Request { .. }) => {
            BridgeError::Config(d.to_string())
        }
        other => BridgeError::backend(other),
    }
}

/// Group prompts a fill draws: `group(g)` gives group `g`'s requests.
pub type GroupFn<'a> = dyn FnMut(u64) -> Result<Vec<Request>, GpuDecodeError> + 'a;
/// A fill's scorer: `keep(g, samples)` says whether finished group `g` is kept.
pub type KeepFn<'a> = dyn FnMut(u64, &[Sample]) -> Result<bool, GpuDecodeError> + 'a;

/// A [`GpuSwitch`] of either kind of lent tensors, as the front drives it (object-safe: the
/// front holds `Box<dyn GpuFront>`).
pub trait GpuFront: Send {
    /// The leases on handed-out views.
    fn leases(&self) -> &Arc<Leases>;
    /// Global ranks this process drives.
    fn local_ranks(&self) -> Result<Vec<usize>, BridgeError>;
    /// [`GpuSwitch::check_shards`].
    fn check_shards(&self, shards: &[Vec<Shard>]) -> Result<(), BridgeError>;
    /// [`GpuSwitch::enter`].
    ///
    /// # Safety
    /// As [`GpuSwitch::enter`].
    unsafe fn enter(
        &mut self,
        parts: Vec<GpuRankParts>,
        changed: bool,
        frozen_written: Option<String>,
    ) -> Result<Entered, BridgeError>;
    /// [`GpuSwitch::frozen_written`].
    fn frozen_written(&self, seen: &[u64], versions: &[u64]) -> Option<String>;
    /// [`GpuSwitch::reuse_current`].
    fn reuse_current(&mut self) -> Result<Option<Entered>, BridgeError>;
    /// [`GpuSwitch::views`].
    fn views(&mut self, local: usize) -> Result<Vec<TensorView>, BridgeError>;
    /// [`GpuSwitch::exit_for`].
    fn exit_for(&mut self, operation: &'static str) -> Result<(), BridgeError>;
    /// [`GpuSwitch::stats`].
    fn stats(&self) -> SwitchStats;
    /// [`GpuSwitch::attach_engine`].
    fn attach_engine(&mut self, settings: EngineSettings) -> Result<(), BridgeError>;
    /// [`GpuSwitch::share_base`].
    ///
    /// # Safety
    /// As [`GpuSwitch::share_base`].
    unsafe fn share_base(&mut self, addresses: Vec<u64>) -> Result<(), BridgeError>;
    /// [`GpuSwitch::run`].
    fn run(&mut self, requests: Vec<Request>) -> Result<Vec<Sample>, BridgeError>;
    /// [`GpuSwitch::fill`].
    fn fill(
        &mut self,
        stream: &mut GroupStream,
        want: usize,
        group: &mut GroupFn<'_>,
        keep: &mut KeepFn<'_>,
    ) -> Result<Filled, BridgeError>;
    /// The Megatron-Core names and shapes local rank `local` lends, in the order
    /// [`GpuFront::enter`] takes them (a switch of Megatron parameters; FSDP2 shards follow the
    /// binding's order, and this refuses).
    fn parameters(&self, local: usize) -> Result<Named, BridgeError>;
}

/// Names and shapes.
pub type Named = Vec<(String, Vec<usize>)>;

impl<L: Lending> GpuFront for GpuSwitch<L>
where
    GpuSwitch<L>: Send,
{
    fn leases(&self) -> &Arc<Leases> {
        GpuSwitch::leases(self)
    }

    fn local_ranks(&self) -> Result<Vec<usize>, BridgeError> {
        GpuSwitch::local_ranks(self)
    }

    fn check_shards(&self, shards: &[Vec<Shard>]) -> Result<(), BridgeError> {
        GpuSwitch::check_shards(self, shards)
    }

    unsafe fn enter(
        &mut self,
        parts: Vec<GpuRankParts>,
        changed: bool,
        frozen_written: Option<String>,
    ) -> Result<Entered, BridgeError> {
        // SAFETY: forwarded to the caller.
        unsafe { GpuSwitch::enter(self, parts, changed, frozen_written) }
    }

    fn frozen_written(&self, seen: &[u64], versions: &[u64]) -> Option<String> {
        GpuSwitch::frozen_written(self, seen, versions)
    }

    fn reuse_current(&mut self) -> Result<Option<Entered>, BridgeError> {
        GpuSwitch::reuse_current(self)
    }

    fn views(&mut self, local: usize) -> Result<Vec<TensorView>, BridgeError> {
        GpuSwitch::views(self, local)
    }

    fn exit_for(&mut self, operation: &'static str) -> Result<(), BridgeError> {
        GpuSwitch::exit_for(self, operation)
    }

    fn stats(&self) -> SwitchStats {
        GpuSwitch::stats(self)
    }

    fn attach_engine(&mut self, settings: EngineSettings) -> Result<(), BridgeError> {
        GpuSwitch::attach_engine(self, settings)
    }

    unsafe fn share_base(&mut self, addresses: Vec<u64>) -> Result<(), BridgeError> {
        // SAFETY: forwarded to the caller.
        unsafe { GpuSwitch::share_base(self, addresses) }
    }

    fn run(&mut self, requests: Vec<Request>) -> Result<Vec<Sample>, BridgeError> {
        GpuSwitch::run(self, requests)
    }

    fn fill(
        &mut self,
        stream: &mut GroupStream,
        want: usize,
        group: &mut GroupFn<'_>,
        keep: &mut KeepFn<'_>,
    ) -> Result<Filled, BridgeError> {
        GpuSwitch::fill(self, stream, want, group, keep)
    }

    fn parameters(&self, local: usize) -> Result<Named, BridgeError> {
        GpuSwitch::parameters(self, local)
    }
}
