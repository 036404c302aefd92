//! The rollout engine as a resource of the lifecycle: the decoder (compiled kernels, library
//! handles, workspace) lives as long as the [`Lifecycle`](crate::Lifecycle); its rollout-only
//! memory (KV cache, ...) wakes after the switch into rollout and sleeps before the switch back.
//!
//! # Hook order
//!
//! ```text
//! rollout():  plan → backend enter / refresh → engine wake → the call runs
//! train():    engine sleep → backend exit (release rollout weights, reload training state)
//! ```
//!
//! Waking **after** the backend's enter means the training state has already been offloaded and
//! the rollout weights materialised when the KV cache is allocated; sleeping **before** the
//! backend's exit frees the KV cache before the training state comes back. Old weights, new
//! weights and KV cache are never on the device together, which is the out-of-memory at wake-up
//! that stacks running the three at once hit.

use std::convert::Infallible;

use crate::metrics::EngineBytes;
use crate::recorder::PhaseScope;
use crate::view::RolloutView;

/// A rollout engine (decoder) attached to a [`Lifecycle`](crate::Lifecycle) with
/// [`with_engine`](crate::Lifecycle::with_engine); `R` is the backend's
/// [`Reshard::Rollout`](crate::Reshard::Rollout).
///
/// The engine is created once, before it is attached, and lives as long as the lifecycle: build
/// its kernels, library handles and workspace in its constructor. What it needs only while rolling
/// out (the KV cache, per-call buffers) it allocates in [`wake`](RolloutEngine::wake) and frees
/// in [`sleep`](RolloutEngine::sleep).
///
/// # Contract
/// - `wake` runs after the backend's enter (or refresh, or a lazy reuse) has made the rollout
///   weights of the current version resident and offloaded training state; every call until the
///   next `sleep` sees the `weights` given here, so bind to them (pointers, CUDA graphs) here.
/// - `sleep` runs before the backend's exit brings training state back. It frees everything `wake`
///   allocated. It is also the **recovery path** after a `wake` that failed or panicked part way,
///   so it must be idempotent and cope with a half-woken engine.
/// - [`memory`](RolloutEngine::memory) reports what the engine holds now; the lifecycle reads it
///   after `wake`, before `sleep` and after every rollout call, for [`Metrics`](crate::Metrics).
/// - Under [`EngineMemory::KeepAcrossCalls`] (the default) the engine stays awake between the
///   rollout calls of one weight version; under [`EngineMemory::FreeEachCall`] it sleeps at the end
///   of every call and wakes at the start of the next.
///
/// Panics of `wake` and `sleep` are caught; errors and panics come back as
/// [`LifecycleError::Engine`](crate::LifecycleError::Engine) /
/// [`LifecycleError::EnginePanicked`](crate::LifecycleError::EnginePanicked), whose
/// [`EngineAfter`](crate::EngineAfter) says where the lifecycle stands.
///
/// # An engine with a KV cache
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{
///     EngineBytes, EngineMemory, Lifecycle, LifecycleError, PhaseScope, RolloutEngine,
///     RolloutView,
/// };
///
/// /// Keeps one KV slot of `f32` per position, allocated on wake.
/// struct Decoder {
///     max_positions: usize,
///     kv: Option<Vec<f32>>,
/// }
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("the KV cache needs {wanted} positions, the device has room for {room}")]
/// struct NoRoom { wanted: usize, room: usize }
///
/// impl RolloutEngine<Vec<f32>> for Decoder {
///     type Error = NoRoom;
///     fn wake(&mut self, _weights: RolloutView<'_, Vec<f32>>, scope: &mut PhaseScope)
///         -> Result<(), NoRoom> {
///         if self.max_positions > 1 << 20 {
///             return Err(NoRoom { wanted: self.max_positions, room: 1 << 20 });
///         }
///         self.kv = Some(vec![0.0; self.max_positions]);
///         scope.alloc_extra(4 * self.max_positions as u64);
///         Ok(())
///     }
///     fn sleep(&mut self, _scope: &mut PhaseScope) -> Result<(), NoRoom> {
///         self.kv = None; // idempotent: also fine after a half-done wake
///         Ok(())
///     }
///     fn memory(&self) -> EngineBytes {
///         EngineBytes::device(self.kv.as_ref().map_or(0, |kv| 4 * kv.len() as u64))
///     }
/// }
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let decoder = Decoder { max_positions: 256, kv: None };
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0]).with_engine(decoder);
///     for _ in 0..3 {
///         let mut session = lc.rollout()?;             // enter + wake on the first call only
///         let (weights, mut engine) = session.parts();
///         if let Some(kv) = engine.kv.as_mut() {
///             kv[0] = weights[1];
///         }
///         session.finish()?;
///     }
///     assert_eq!(lc.metrics().engine.wakes, 1);
///     assert_eq!(lc.engine().memory().device, 1024);  // kept across lazy calls
///     lc.train()?.state_mut()[0] = 3.0;               // sleep, then the backend's exit
///     assert_eq!(lc.engine().memory(), EngineBytes::default());
///
///     lc.set_engine_memory(EngineMemory::FreeEachCall);
///     lc.rollout()?.finish()?;                         // wake, call, sleep
///     assert_eq!(lc.engine().memory().device, 0);
///     assert_eq!(lc.metrics().engine.wakes, 2);
///     Ok(())
/// }
/// ```
///
/// A ready-made engine to try the API with is [`testing::KvEngine`](crate::testing::KvEngine).
pub trait RolloutEngine<R> {
    /// The engine's error type.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Whether the engine does nothing. `false` for every real engine; the no-op engine `()`
    /// (the default of [`Lifecycle`](crate::Lifecycle)) sets `true`, so a lifecycle without an
    /// engine records no wake / sleep phases.
    const IS_NOOP: bool = false;

    /// Allocates rollout-only memory (KV cache, per-call workspace) for rollouts on `weights`.
    /// Report transient allocations and bytes moved (for example a prefix cache brought back from
    /// host memory) through `scope`.
    fn wake(
        &mut self,
        weights: RolloutView<'_, R>,
        scope: &mut PhaseScope,
    ) -> Result<(), Self::Error>;

    /// Frees what [`wake`](RolloutEngine::wake) allocated. Idempotent; also called after a failed
    /// `wake`.
    fn sleep(&mut self, scope: &mut PhaseScope) -> Result<(), Self::Error>;

    /// The memory the engine holds now, beyond what lives as long as the engine when it is asleep
    /// (count the KV cache, not the compiled kernels).
    fn memory(&self) -> EngineBytes;
}

/// The no-op engine: what a [`Lifecycle`](crate::Lifecycle) without an engine holds.
impl<R> RolloutEngine<R> for () {
    type Error = Infallible;
    const IS_NOOP: bool = true;

    fn wake(&mut self, _: RolloutView<'_, R>, _: &mut PhaseScope) -> Result<(), Infallible> {
        Ok(())
    }

    fn sleep(&mut self, _: &mut PhaseScope) -> Result<(), Infallible> {
        Ok(())
    }

    fn memory(&self) -> EngineBytes {
        EngineBytes::default()
    }
}

/// When an engine's rollout memory is released ([`Lifecycle::set_engine_memory`]); parsed from
/// `keep-across-calls` / `keep` and `free-each-call` / `free`.
///
/// [`Lifecycle::set_engine_memory`]: crate::Lifecycle::set_engine_memory
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError, KvEngine};
/// use lifecycle_core::{EngineMemory, EngineState, Lifecycle, LifecycleError};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0]).with_engine(KvEngine::new());
///     assert_eq!(lc.engine_memory(), EngineMemory::KeepAcrossCalls);
///     lc.set_engine_memory("free-each-call".parse().map_err(LifecycleError::Config)?);
///     for _ in 0..2 {
///         lc.rollout()?.finish()?;                      // wakes, then sleeps at the end
///         assert_eq!(lc.engine_state(), EngineState::Asleep);
///     }
///     assert_eq!(lc.engine().wakes(), 2);
///     assert_eq!(lc.metrics().enters, 1);               // the weights stayed resident
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineMemory {
    /// Keep it across the rollout calls of one weight version; release it when the lifecycle
    /// leaves rollout mode. Lazy calls in a row wake once.
    #[default]
    KeepAcrossCalls,
    /// Release it at the end of every rollout call, as stacks that build the engine per call do.
    FreeEachCall,
}

impl std::str::FromStr for EngineMemory {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "keep" | "keep-across-calls" => Ok(EngineMemory::KeepAcrossCalls),
            "free" | "free-each-call" => Ok(EngineMemory::FreeEachCall),
            other => Err(format!(
                "unknown engine memory policy `{other}`: expected `keep-across-calls` or \
                 `free-each-call`"
            )),
        }
    }
}

/// Where an engine stands, as the lifecycle sees it ([`Lifecycle::engine_state`]).
///
/// [`Lifecycle::engine_state`]: crate::Lifecycle::engine_state
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError, KvEngine};
/// use lifecycle_core::{EngineState, Lifecycle, LifecycleError};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0]).with_engine(KvEngine::new());
///     assert_eq!(lc.engine_state(), EngineState::Asleep);
///     lc.enter()?;                                      // the backend's enter, then the wake
///     assert_eq!(lc.engine_state(), EngineState::Awake);
///     lc.exit()?;                                       // the sleep, then the backend's exit
///     assert_eq!(lc.engine_state(), EngineState::Asleep);
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineState {
    /// No rollout memory held (also the state after a failed wake whose recovery succeeded).
    Asleep,
    /// Woken for the resident weights: a rollout session can run.
    Awake,
    /// A sleep failed: the engine may still hold rollout memory. The next `rollout()`, `enter()`,
    /// `train()` or `exit()` retries the sleep before anything else; the backend's exit does not
    /// run until it succeeds.
    SleepFailed,
}
