//! A switch over host arrays (numpy, CPU torch tensors), on the CPU reference backend: the
//! trainer's fp32 shards are copied into the reference state when they changed, then switched
//! as the Rust host backend switches its own. The oracle of the GPU path, and what CI tests.

use std::sync::Arc;

use lifecycle_core::{Lifecycle, LifecycleConfig, MemoryPolicy, Switching};
use lifecycle_host::HostBackend;
use lifecycle_layout::fp8::{Fp8Keep, RolloutDtype};
use lifecycle_layout::{ExpertPlacement, HostTensor};
use lifecycle_state::HostTrainState;

use crate::error::BridgeError;
use crate::model::ModelBinding;
use crate::shards::{check_shards, Shard};
use crate::switch::{Entered, SwitchStats};
use crate::views::{host_views, Leases, TensorView};

/// What a switch is asked to build (both backends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwitchSettings {
    /// FSDP world size W of the trainer.
    pub world: usize,
    /// Rollout tensor-parallel degree T.
    pub tp: usize,
    /// Rollout dtype.
    pub dtype: RolloutDtype,
    /// Which matrices an fp8 rollout keeps bf16 beyond the published exemptions.
    pub fp8_keep: Fp8Keep,
    /// Where the experts of a mixture-of-experts model go.
    pub experts: ExpertPlacement,
    /// What the switch moves out of device memory during rollout, and when it leaves rollout.
    pub lifecycle: LifecycleConfig,
}

impl SwitchSettings {
    /// W ranks → T, bf16, experts split by TP, lazy, nothing offloaded (the rollout weights
    /// refreshed in place when the trainer changed its shards).
    pub fn new(world: usize, tp: usize) -> Self {
        SwitchSettings {
            world,
            tp,
            dtype: RolloutDtype::Bf16,
            fp8_keep: Fp8Keep::default(),
            experts: ExpertPlacement::TensorParallel,
            lifecycle: LifecycleConfig {
                switching: Switching::Lazy,
                memory: MemoryPolicy {
                    keep_rollout_resident: true,
                    ..MemoryPolicy::resident()
                },
            },
        }
    }
}

/// A switch over host shards (see the [module docs](self)).
pub struct HostSwitch {
    lc: Lifecycle<HostBackend>,
    binding: ModelBinding,
    leases: Arc<Leases>,
    generation: u64,
    entered: bool,
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
        let rollout = binding.rollout_layout(settings.tp, settings.experts)?;
        let backend = HostBackend::new(rollout)
            .with_rollout_dtype(settings.dtype)
            .with_fp8_keep(settings.fp8_keep);
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

    /// Enters rollout mode: when `changed` (or at the first call), the shards
    /// (`shards[rank][tensor]`, every rank's) are checked, copied into the reference state, and
    /// switched; otherwise the resident weights are reused and nothing is read.
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
            return Ok(Entered::reused(self.generation));
        }
        let ranks: Vec<usize> = (0..self.lc.peek_state().world()).collect();
        check_shards(self.lc.peek_state().layout(), &ranks, shards)?;
        let held = self.leases.held();
        if !held.is_empty() {
            return Err(BridgeError::InUse {
                operation: "entering with changed weights",
                held,
            });
        }
        let start = std::time::Instant::now();
        {
            let mut train = self.lc.train().map_err(BridgeError::backend)?;
            train
                .state_mut()
                .for_each_shard_mut(|s| {
                    let (ptr, n) = shards[s.rank][s.tensor];
                    if n > 0 {
                        // SAFETY: the caller's promise; `n` equals the shard's length
                        // (check_shards), and the memory is the caller's, not the state's.
                        let src = unsafe { std::slice::from_raw_parts(ptr as *const f32, n) };
                        s.master.copy_from_slice(src);
                    }
                })
                .map_err(BridgeError::backend)?;
        }
        rollout_call(&mut self.lc)?;
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
        let held = self.leases.held();
        if !held.is_empty() {
            return Err(BridgeError::InUse {
                operation: "exit",
                held,
            });
        }
        self.lc.exit().map_err(BridgeError::backend)?;
        self.entered = false;
        Ok(())
    }

    /// Switch counts and times.
    pub fn stats(&self) -> SwitchStats {
        SwitchStats::of(self.lc.metrics(), self.generation)
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
