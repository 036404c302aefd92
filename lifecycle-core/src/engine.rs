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
use std::fmt;
use std::ops::{Deref, DerefMut};

use crate::cache::Stamp;
use crate::recorder::PhaseScope;
use crate::session::RolloutView;

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
/// [`EngineAfter`] says where the lifecycle stands.
///
/// # An engine with a KV cache
/// ```
/// use lifecycle_core::{
///     EngineBytes, EngineMemory, Lifecycle, PhaseScope, RolloutEngine, RolloutView,
/// };
/// # use lifecycle_core::{Reshard, SwitchContext};
/// # struct Copying;
/// # impl Reshard for Copying {
/// #     type TrainState = Vec<f32>; type Rollout = Vec<f32>; type Plan = (); type Error = std::io::Error;
/// #     fn plan(&self, _: &Vec<f32>) -> std::io::Result<()> { Ok(()) }
/// #     fn enter(&mut self, _: &(), s: &mut Vec<f32>, _: &mut SwitchContext<'_>) -> std::io::Result<Vec<f32>> { Ok(s.clone()) }
/// #     fn refresh(&mut self, _: &(), s: &mut Vec<f32>, r: &mut Vec<f32>, _: &mut SwitchContext<'_>) -> std::io::Result<()> { r.clone_from(s); Ok(()) }
/// #     fn exit(&mut self, _: &mut Vec<f32>, _: Option<Vec<f32>>, _: &mut SwitchContext<'_>) -> std::io::Result<()> { Ok(()) }
/// # }
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
/// let decoder = Decoder { max_positions: 256, kv: None };
/// let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]).with_engine(decoder);
/// for _ in 0..3 {
///     let mut session = lc.rollout()?;              // enter + wake on the first call only
///     let (weights, mut engine) = session.parts();
///     engine.kv.as_mut().unwrap()[0] = weights[1];
///     session.finish()?;
/// }
/// assert_eq!(lc.metrics().engine.wakes, 1);
/// assert_eq!(lc.engine().memory().device, 1024);   // kept across lazy calls
/// lc.train()?.state_mut()[0] = 3.0;                // sleep, then the backend's exit
/// assert_eq!(lc.engine().memory(), EngineBytes::default());
///
/// lc.set_engine_memory(EngineMemory::FreeEachCall);
/// lc.rollout()?.finish()?;                          // wake, call, sleep
/// assert_eq!(lc.engine().memory().device, 0);
/// assert_eq!(lc.metrics().engine.wakes, 2);
/// # Ok::<(), lifecycle_core::LifecycleError<std::io::Error>>(())
/// ```
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

/// Memory an engine holds, in bytes: on the devices it drives (the largest of them for several)
/// and in host memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineBytes {
    /// Device memory (per device, the largest when the engine drives several).
    pub device: u64,
    /// Host memory (for example a prefix cache kept off the device, or a CPU decoder's KV cache).
    pub host: u64,
}

impl EngineBytes {
    /// `bytes` of device memory, no host memory.
    pub fn device(bytes: u64) -> Self {
        EngineBytes {
            device: bytes,
            host: 0,
        }
    }

    /// `bytes` of host memory, no device memory.
    pub fn host(bytes: u64) -> Self {
        EngineBytes {
            device: 0,
            host: bytes,
        }
    }
}

/// When an engine's rollout memory is released.
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

/// Where an engine stands, as the lifecycle sees it.
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

/// Which engine hook failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineHook {
    /// [`RolloutEngine::wake`].
    Wake,
    /// [`RolloutEngine::sleep`].
    Sleep,
}

impl fmt::Display for EngineHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EngineHook::Wake => "wake",
            EngineHook::Sleep => "sleep",
        })
    }
}

/// Where the lifecycle stands after an engine hook failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineAfter {
    /// The engine is asleep (a failed wake was undone by `sleep`); the lifecycle is in rollout
    /// mode with the current weights resident and the training state as the switch left it. The
    /// next `rollout()` retries the wake without switching again; `train()` and `exit()` work as
    /// usual.
    Asleep,
    /// The engine may still hold its rollout memory; the lifecycle stays in rollout mode (the
    /// backend's exit does not run while the KV cache may be on the device) and the next
    /// `rollout()`, `enter()`, `train()` or `exit()` retries the sleep first.
    SleepFailed {
        /// Why the engine could not be put to sleep, or that the retry is still to come.
        recovery: String,
    },
}

impl fmt::Display for EngineAfter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineAfter::Asleep => f.write_str(
                "the engine is asleep; the lifecycle stays in rollout mode with the current \
                 weights resident: the next rollout() retries the wake",
            ),
            EngineAfter::SleepFailed { recovery } => write!(
                f,
                "the engine may still hold its rollout memory ({recovery}); the lifecycle stays in \
                 rollout mode: the next rollout(), enter(), train() or exit() retries the sleep \
                 before the backend's exit"
            ),
        }
    }
}

/// Mutable access to the awake engine, borrowed from a
/// [`RolloutSession`](crate::RolloutSession) next to the weights view
/// ([`parts`](crate::RolloutSession::parts)).
///
/// It dereferences to the engine. Like the view, it cannot outlive its session: it cannot be kept
/// across a training update or used after the session ends.
pub struct EngineMut<'s, E> {
    engine: &'s mut E,
    version: u64,
}

impl<'s, E> EngineMut<'s, E> {
    pub(crate) fn new(engine: &'s mut E, version: u64) -> Self {
        EngineMut { engine, version }
    }

    /// The version of the weights the engine was woken for.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// A proof of the current weight version for [`VersionedCache`](crate::VersionedCache)
    /// lookups, valid while the session lives; it does not borrow this `EngineMut`, so it can be
    /// passed next to the engine's own fields.
    pub fn stamp(&self) -> Stamp<'s> {
        Stamp::new(self.version)
    }

    /// The engine, with the session's lifetime.
    pub fn into_inner(self) -> &'s mut E {
        self.engine
    }

    /// Reborrows for a shorter call (to pass on without giving this one up).
    pub fn reborrow(&mut self) -> EngineMut<'_, E> {
        EngineMut {
            engine: self.engine,
            version: self.version,
        }
    }
}

impl<E> Deref for EngineMut<'_, E> {
    type Target = E;
    fn deref(&self) -> &E {
        self.engine
    }
}

impl<E> DerefMut for EngineMut<'_, E> {
    fn deref_mut(&mut self) -> &mut E {
        self.engine
    }
}

impl<E> fmt::Debug for EngineMut<'_, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineMut")
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// Statistics of the attached engine's hooks and memory, in [`Metrics::engine`](crate::Metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Successful wakes.
    pub wakes: u64,
    /// Successful sleeps.
    pub sleeps: u64,
    /// Wakes that failed (error or panic).
    pub failed_wakes: u64,
    /// Sleeps that failed (error or panic).
    pub failed_sleeps: u64,
    /// Largest device memory the engine held while awake (after a wake, after a call, before a
    /// sleep).
    pub peak_device_bytes: u64,
    /// Largest host memory the engine held while awake.
    pub peak_host_bytes: u64,
}

impl EngineStats {
    pub(crate) fn observe(&mut self, bytes: EngineBytes) {
        self.peak_device_bytes = self.peak_device_bytes.max(bytes.device);
        self.peak_host_bytes = self.peak_host_bytes.max(bytes.host);
    }

    pub(crate) fn since(&self, earlier: &EngineStats) -> EngineStats {
        EngineStats {
            wakes: self.wakes - earlier.wakes.min(self.wakes),
            sleeps: self.sleeps - earlier.sleeps.min(self.sleeps),
            failed_wakes: self.failed_wakes - earlier.failed_wakes.min(self.failed_wakes),
            failed_sleeps: self.failed_sleeps - earlier.failed_sleeps.min(self.failed_sleeps),
            ..*self
        }
    }
}
