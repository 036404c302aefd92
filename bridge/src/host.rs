//! A switch over host arrays (numpy, CPU torch tensors), on the CPU reference backend: the
//! trainer's fp32 shards are copied into the reference state when they changed, then switched
//! as the Rust host backend switches its own. The oracle of the GPU path, and what CI tests.

use lifecycle_layout::settings::Configure;
use std::sync::Arc;

use lifecycle_core::{Lifecycle, Mode};
use lifecycle_host::HostBackend;
use lifecycle_layout::HostTensor;
use lifecycle_state::HostTrainState;

use crate::error::BridgeError;
use crate::model::ModelBinding;
use crate::settings::SwitchSettings;
use crate::shards::{check_shards, Shard};
use crate::switch::{Entered, SwitchStats, Tally};
use crate::views::{host_views, Leases, TensorView};

/// A switch over host shards (see the [module docs](self)).
pub struct HostSwitch {
    lc: Lifecycle<HostBackend>,
    binding: ModelBinding,
    leases: Arc<Leases>,
    generation: u64,
    entered: bool,
    tally: Tally,
}

impl std::fmt::Debug for HostSwitch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostSwitch")
            .field("mode", &self.lc.mode())
            .field("generation", &self.generation)
            .finish()
    }
}

impl HostSwitch {
    /// A switch for `binding`'s model over `settings.world` ranks, nothing read yet.
    pub fn new(binding: ModelBinding, settings: SwitchSettings) -> Result<Self, BridgeError> {
        let (_, rollout) = binding.layouts(settings.world, settings.tp, settings.experts)?;
        let backend = HostBackend::new(rollout).with_options(settings.options);
        let zeros = binding
            .names()
            .iter()
            .map(|(n, s)| HostTensor::f32(n.clone(), s.clone(), vec![0.0; s.iter().product()]))
            .collect();
        let state =
            HostTrainState::from_tensors(settings.world, zeros).map_err(BridgeError::backend)?;
        let lc = Lifecycle::with_config(backend, state, settings.lifecycle)
            .map_err(BridgeError::backend)?;
        Ok(HostSwitch {
            lc,
            binding,
            leases: Arc::new(Leases::default()),
            generation: 0,
            entered: false,
            tally: Tally::default(),
        })
    }

    /// The model binding.
    pub fn binding(&self) -> &ModelBinding {
        &self.binding
    }

    /// The leases on handed-out views.
    pub fn leases(&self) -> &Arc<Leases> {
        &self.leases
    }

    /// Checks `shards` (`shards[rank][tensor]`, every rank's) as [`enter`](HostSwitch::enter)
    /// does, without reading them.
    pub fn check_shards(&self, shards: &[Vec<Shard>]) -> Result<(), BridgeError> {
        let ranks: Vec<usize> = (0..self.lc.peek_state().world()).collect();
        check_shards(self.lc.peek_state().layout(), &ranks, shards)
    }

    /// Enters rollout mode: when `changed` (or at the first call), the shards
    /// (`shards[rank][tensor]`, every rank's) are checked, copied into the reference state
    /// (refusing a non-finite value in the same pass, [`BridgeError::NonFinite`]), and switched;
    /// otherwise the resident weights are reused and nothing is read. A refusal leaves the
    /// generation and the views as they were; the weights roll out again only after a
    /// successful enter.
    ///
    /// # Safety
    /// Each shard's address must point to that many fp32 values of host memory, readable for
    /// the duration of the call.
    pub unsafe fn enter(
        &mut self,
        shards: &[Vec<Shard>],
        changed: bool,
    ) -> Result<Entered, BridgeError> {
        if self.entered && !changed && self.lc.rollout_is_current() {
            rollout_call(&mut self.lc)?;
            self.tally.reused();
            return Ok(Entered::reused(self.generation));
        }
        self.check_shards(shards)?;
        let held = self.leases.held();
        if !held.is_empty() {
            return Err(BridgeError::InUse {
                operation: "entering with changed weights",
                held,
            });
        }
        let start = std::time::Instant::now();
        let before = self.lc.metrics().clone();
        let mut bad: Option<(usize, usize)> = None;
        {
            let mut train = self.lc.train().map_err(BridgeError::backend)?;
            train
                .state_mut()
                .for_each_shard_mut(|s| {
                    let (ptr, n) = shards[s.rank][s.tensor];
                    if n > 0 && bad.is_none() {
                        // SAFETY: the caller's promise; `n` equals the shard's length
                        // (check_shards), and the memory is the caller's, not the state's.
                        let src = unsafe { std::slice::from_raw_parts(ptr as *const f32, n) };
                        if !copy_finite(src, s.master) {
                            bad = Some((s.rank, s.tensor));
                        }
                    }
                })
                .map_err(BridgeError::backend)?;
        }
        // The state now differs from the resident weights (its version moved): they are not
        // current, so nothing rolls out until an enter succeeds.
        self.entered = false;
        if let Some((rank, tensor)) = bad {
            let (ptr, n) = shards[rank][tensor];
            // SAFETY: the caller's promise (this function's contract): the shard points to `n`
            // readable f32 of host memory for the call; `bad` names only a shard with n > 0, whose
            // address check_shards found non-null.
            let src = unsafe { std::slice::from_raw_parts(ptr as *const f32, n) };
            let name = &self.binding.names()[tensor].0;
            let world = self.lc.peek_state().world();
            return Err(non_finite(name, rank, world, src));
        }
        rollout_call(&mut self.lc)?;
        self.tally.switched(&self.lc.metrics().since(&before));
        self.generation += 1;
        self.entered = true;
        Ok(Entered::switched(self.generation, start.elapsed()))
    }

    /// A rollout call on the resident weights when they are current (nothing read, nothing
    /// moved); `None` when an [`enter`](HostSwitch::enter) with the shards is needed.
    pub fn reuse_current(&mut self) -> Result<Option<Entered>, BridgeError> {
        if !self.entered || !self.lc.rollout_is_current() {
            return Ok(None);
        }
        rollout_call(&mut self.lc)?;
        self.tally.reused();
        Ok(Some(Entered::reused(self.generation)))
    }

    /// The ranks of the reference backend: `0..T`, the rollout ranks whose views exist.
    pub fn rollout_ranks(&self) -> std::ops::Range<usize> {
        0..self.lc.backend().layout().tp()
    }

    /// The views of rollout rank `rank`'s weights (in rollout mode only).
    pub fn views(&mut self, rank: usize) -> Result<Vec<TensorView>, BridgeError> {
        if !self.entered || !self.lc.rollout_is_current() {
            return Err(not_entered());
        }
        if !self.rollout_ranks().contains(&rank) {
            return Err(BridgeError::Config(format!(
                "rollout rank {rank}: the rollout has T = {} ranks",
                self.rollout_ranks().end
            )));
        }
        let session = self.lc.rollout().map_err(BridgeError::backend)?;
        let views = host_views(&session.weights(), rank);
        session.finish().map_err(BridgeError::backend)?;
        Ok(views)
    }

    /// Leaves rollout mode (refused while a handed-out view is referenced).
    pub fn exit(&mut self) -> Result<(), BridgeError> {
        self.exit_for("exit")
    }

    /// [`exit`](HostSwitch::exit) on behalf of `operation` (named in a refusal).
    pub fn exit_for(&mut self, operation: &'static str) -> Result<(), BridgeError> {
        let held = self.leases.held();
        if !held.is_empty() {
            return Err(BridgeError::InUse { operation, held });
        }
        let before = self.lc.metrics().clone();
        let leaving = self.lc.mode() == Mode::Rollout;
        self.lc.exit().map_err(BridgeError::backend)?;
        if leaving {
            self.tally.exited(&self.lc.metrics().since(&before));
        }
        self.entered = false;
        Ok(())
    }

    /// Switch counts and times.
    pub fn stats(&self) -> SwitchStats {
        self.tally.stats(self.generation)
    }
}

/// Copies `src` into `dst` (the same length), and says whether every value was finite: one
/// pass, which the compiler vectorises.
fn copy_finite(src: &[f32], dst: &mut [f32]) -> bool {
    let mut finite = true;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s;
        finite &= s.is_finite();
    }
    finite
}

/// The refusal of a non-finite value in rank `rank`'s shard `src` of tensor `name`.
pub(crate) fn non_finite(name: &str, rank: usize, world: usize, src: &[f32]) -> BridgeError {
    let (index, value) = src
        .iter()
        .enumerate()
        .find(|(_, v)| !v.is_finite())
        .map_or((0, f32::NAN), |(i, v)| (i, *v));
    BridgeError::NonFinite {
        name: name.to_string(),
        detail: format!("{value} at element {index} of rank {rank}'s shard (of {world})"),
    }
}

fn rollout_call(lc: &mut Lifecycle<HostBackend>) -> Result<(), BridgeError> {
    let session = lc.rollout().map_err(BridgeError::backend)?;
    session.finish().map_err(BridgeError::backend)
}

pub(crate) fn not_entered() -> BridgeError {
    BridgeError::Stale {
        name: "session".into(),
        reason: "the switch is not in rollout mode (enter with `switch.rollout()` first)".into(),
    }
}
