//! The [`Reshard`] trait: the contract every backend implements.

use crate::policy::MemoryPolicy;
use crate::recorder::PhaseRecorder;

/// Moves a policy model's weights between the training layout and the rollout layout.
///
/// A backend owns no weights itself: the [`Lifecycle`](crate::Lifecycle) owns the training state
/// and (while resident) the rollout weights, and hands them to the backend for each switch.
///
/// # Contract
/// - [`plan`](Reshard::plan) validates the mapping from the training layout to the rollout layout.
///   **Every** inconsistency (shapes, dtypes, world sizes, degrees) is reported here, before any
///   data moves; `plan` takes the state by shared reference and must not change it.
/// - [`enter`](Reshard::enter) materialises the rollout weights from a plan and offloads training
///   state as `ctx.memory` asks. If it fails, the training state must be as it was before the call.
/// - [`refresh`](Reshard::refresh) rewrites resident rollout weights in place from the current
///   training state (called only when the lifecycle kept them resident while training ran).
/// - [`exit`](Reshard::exit) releases the rollout weights (when given) and brings offloaded
///   training state back. It is also the **recovery path**: after an `enter` or `refresh` that
///   failed or panicked part way, and after a failed `exit`, the lifecycle calls `exit` (with
///   `None`, or with weights to release) and it must bring back whatever is offloaded — so it must
///   be idempotent and cope with a partly switched state.
///
/// The lifecycle catches panics of these methods: a panicking backend cannot lose the training
/// state as long as `exit` can still bring it back.
///
/// Backends report bytes, time and extra memory of each phase through `ctx.rec`.
///
/// # A backend outside this crate
/// ```
/// use lifecycle_core::{Reshard, SwitchContext, Phase, Link, Lifecycle};
///
/// /// Training state: one fp32 vector; rollout weights: the same values rounded to integers.
/// struct Rounding;
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("empty weights")]
/// struct Empty;
///
/// impl Reshard for Rounding {
///     type TrainState = Vec<f32>;
///     type Rollout = Vec<i32>;
///     type Plan = usize;
///     type Error = Empty;
///
///     fn plan(&self, state: &Vec<f32>) -> Result<usize, Empty> {
///         if state.is_empty() { Err(Empty) } else { Ok(state.len()) }
///     }
///     fn enter(&mut self, plan: &usize, state: &mut Vec<f32>, ctx: &mut SwitchContext<'_>)
///         -> Result<Vec<i32>, Empty> {
///         ctx.rec.phase(Phase::Transfer, |s| {
///             s.add_bytes(Link::Local, (*plan * 4) as u64);
///             Ok(state.iter().map(|x| x.round() as i32).collect())
///         })
///     }
///     fn refresh(&mut self, plan: &usize, state: &mut Vec<f32>, out: &mut Vec<i32>,
///         ctx: &mut SwitchContext<'_>) -> Result<(), Empty> {
///         *out = self.enter(plan, state, ctx)?;
///         Ok(())
///     }
///     fn exit(&mut self, _state: &mut Vec<f32>, rollout: Option<Vec<i32>>,
///         ctx: &mut SwitchContext<'_>) -> Result<(), Empty> {
///         ctx.rec.phase(Phase::Release, |_| { drop(rollout); Ok(()) })
///     }
/// }
///
/// fn main() -> Result<(), lifecycle_core::LifecycleError<Empty>> {
///     let mut lc = Lifecycle::new(Rounding, vec![1.4, 2.6]);
///     assert_eq!(*lc.rollout()?.weights(), vec![1, 3]);
///     lc.train()?.state_mut()[0] = 7.2;
///     assert_eq!(*lc.rollout()?.weights(), vec![7, 3]);
///     assert_eq!(lc.metrics().enters, 2);
///     Ok(())
/// }
/// ```
///
/// [`testing::CopyBackend`](crate::testing::CopyBackend) is a complete backend of this kind, with
/// the offload and reload phases.
pub trait Reshard {
    /// The training state of all ranks this backend drives (sharded weights, grads, optimizer state).
    type TrainState;
    /// The rollout weights of all ranks this backend drives, in the inference layout.
    type Rollout;
    /// A validated transfer plan.
    type Plan;
    /// The backend's error type.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Validates the layouts and computes the transfer plan. Moves no data.
    fn plan(&self, state: &Self::TrainState) -> Result<Self::Plan, Self::Error>;

    /// Materialises rollout weights and offloads training state as `ctx.memory` says.
    fn enter(
        &mut self,
        plan: &Self::Plan,
        state: &mut Self::TrainState,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<Self::Rollout, Self::Error>;

    /// Rewrites resident rollout weights in place from the current training state.
    fn refresh(
        &mut self,
        plan: &Self::Plan,
        state: &mut Self::TrainState,
        rollout: &mut Self::Rollout,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), Self::Error>;

    /// Releases `rollout` (when `Some`) and brings offloaded training state back.
    fn exit(
        &mut self,
        state: &mut Self::TrainState,
        rollout: Option<Self::Rollout>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), Self::Error>;
}

/// What a backend receives with each switch: the memory policy and the metrics recorder.
///
/// ```
/// use lifecycle_core::{Link, Metrics, MemoryPolicy, Phase, PhaseRecorder, SwitchContext};
///
/// /// The part of a backend's enter that offloads, as the policy asks.
/// fn offload(master: &[f32], ctx: &mut SwitchContext<'_>) -> Result<(), std::io::Error> {
///     if ctx.memory.offload_params {
///         ctx.rec.phase(Phase::Offload, |scope| {
///             scope.add_bytes(Link::DeviceToHost, 4 * master.len() as u64);
///             Ok::<(), std::io::Error>(())
///         })?;
///     }
///     Ok(())
/// }
///
/// fn main() -> Result<(), std::io::Error> {
///     let mut metrics = Metrics::default();
///     let mut ctx = SwitchContext {
///         memory: MemoryPolicy::default(),
///         rec: PhaseRecorder::new(&mut metrics),
///     };
///     offload(&[0.0; 8], &mut ctx)?;
///     assert_eq!(metrics.phase(Phase::Offload).bytes.device_to_host, 32);
///     Ok(())
/// }
/// ```
pub struct SwitchContext<'m> {
    /// What to offload while in rollout mode.
    pub memory: MemoryPolicy,
    /// Where phases are reported.
    pub rec: PhaseRecorder<'m>,
}
