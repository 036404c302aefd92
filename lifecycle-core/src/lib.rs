//! Lifecycle of a policy model's weights in colocated RL training.
//!
//! The same GPUs alternate between training (sharded weights plus optimizer state) and rollout
//! (inference-layout weights plus KV cache). This crate splits the switch into **enter** /
//! **rollout** (many times) / **exit** and makes rolling out on stale weights a compile error:
//!
//! - [`Reshard`] is the contract a backend implements (plan, enter, refresh, exit).
//! - [`Lifecycle`] owns the backend, the training state and the resident rollout weights, with a
//!   weight version bumped by every mutable access to the training state.
//! - [`RolloutSession`] / [`RolloutView`] and [`TrainSession`] are the only ways to reach the
//!   rollout weights and the training state; they borrow the lifecycle, so the borrow checker
//!   rejects a rollout view used across a training update or after exit.
//! - Switching is lazy by default: a rollout that finds current weights resident moves zero bytes.
//!   [`Switching::Eager`] exits after every call, for comparison with stacks that do.
//! - A [`RolloutEngine`] (the decoder) lives as long as the lifecycle
//!   ([`Lifecycle::with_engine`]); its rollout memory wakes after the backend's enter and sleeps
//!   before its exit, once per weight version under the lazy policy. [`RolloutSession::parts`]
//!   lends it next to the weights view; [`VersionedCache`] / [`PrefixCache`] keep KV across calls
//!   without ever serving another weight version.
//! - [`Metrics`] records count, time, bytes per link class and peak extra memory of each phase.
//! - The core knows no layout and no device: planners live in `lifecycle-layout`, executors in
//!   the backend crates.
//! - [`macro@sharded_rollout`] turns a rollout function into the enter / rollout / exit plumbing.
//! - [`testing`] holds a backend over a `Vec<f32>` ([`testing::CopyBackend`]) and a small engine
//!   ([`testing::KvEngine`]): every example of this crate runs on them, and so can yours.
//!
//! ```
//! use lifecycle_core::testing::{CopyBackend, CopyError};
//! use lifecycle_core::{Lifecycle, LifecycleError};
//!
//! fn main() -> Result<(), LifecycleError<CopyError>> {
//!     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0]);
//!     let session = lc.rollout()?;                 // enter: the rollout weights are built
//!     assert_eq!(session.weights()[1], 2.0);
//!     session.finish()?;                           // lazy: they stay resident
//!     lc.train()?.state_mut()[1] = 3.0;            // exit, then a training update
//!     assert_eq!(lc.rollout()?.weights()[1], 3.0); // the next rollout sees it
//!     Ok(())
//! }
//! ```
//!
//! Keeping a view across the update does not compile:
//!
//! ```compile_fail,E0499
//! use lifecycle_core::testing::{CopyBackend, CopyError};
//! use lifecycle_core::{Lifecycle, LifecycleError};
//!
//! fn main() -> Result<(), LifecycleError<CopyError>> {
//!     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0]);
//!     let session = lc.rollout()?;
//!     let weights = session.weights();
//!     lc.train()?.state_mut()[0] = 2.0; // error[E0499]: the view still borrows `lc`
//!     println!("{}", weights[0]);
//!     Ok(())
//! }
//! ```
//!
//! Every error the compiler gives on views, sessions and engines (E0499, E0502, E0505, E0597, …)
//! is listed with its fix on the compiler errors page, `docs/compiler-errors.md` at the root of
//! the repository, which quotes the compiler's own text; its examples are compiled with this
//! crate's doctests.
//!
//! # The attribute
//!
//! [`macro@sharded_rollout`] writes the session plumbing around a function that reads the rollout
//! weights. The function takes a `RolloutView<'_, W>`; the generated function of the same name
//! takes `&mut Lifecycle<B>` instead (for any backend with `Reshard<Rollout = W>`), enters rollout
//! mode only when needed, runs the body, applies the switching policy and returns the body's value
//! in a `Result`. `name_enter` and `name_exit` switch explicitly.
//!
//! ```
//! use lifecycle_core::testing::{CopyBackend, CopyError};
//! use lifecycle_core::{sharded_rollout, Lifecycle, LifecycleError, Mode, RolloutView, Switching};
//!
//! /// Scores a prompt with the current policy weights.
//! #[sharded_rollout]
//! fn score(weights: RolloutView<'_, Vec<f32>>, prompt: &[usize]) -> f32 {
//!     prompt.iter().map(|&token| weights[token]).sum()
//! }
//!
//! fn main() -> Result<(), LifecycleError<CopyError>> {
//!     let mut lc = Lifecycle::new(CopyBackend::new(), vec![0.5, 1.0, 2.0]);
//!     for _ in 0..3 {
//!         assert_eq!(score(&mut lc, &[0, 2])?, 2.5); // lazy: enters on the first call only
//!     }
//!     assert_eq!(lc.metrics().enters, 1);
//!
//!     lc.train()?.state_mut()[0] = 1.5; // a training update: exits, bumps the version
//!     assert_eq!(score(&mut lc, &[0, 2])?, 3.5); // the next call sees the new weights
//!     assert_eq!(lc.metrics().enters, 2);
//!
//!     lc.set_switching(Switching::Eager);
//!     score(&mut lc, &[1])?; // eager: leaves rollout mode after the call
//!     assert_eq!(lc.mode(), Mode::Train);
//!
//!     score_enter(&mut lc)?; // explicit switches
//!     assert_eq!(lc.mode(), Mode::Rollout);
//!     score_exit(&mut lc)?;
//!     assert_eq!(lc.mode(), Mode::Train);
//!     Ok(())
//! }
//! ```
//!
//! Methods (`&self` / `&mut self`) and `async` functions work the same way; the attribute takes
//! `switching = "eager" | "lazy"` to force a policy for one function, `weights = name` to select
//! the view, `engine = name` to select the engine and `crate = "path"` when `lifecycle_core` is
//! re-exported. When the attribute rejects a function, its errors are the only ones: in place of
//! the function it emits a stub with the signature it would have generated, so the function's
//! callers still type-check.
//!
//! A function may also take the lifecycle's engine, next to the view, as `EngineMut<'_, E>` (or a
//! `&mut E` marked `#[engine]`); the generated function then takes a `&mut Lifecycle<_, E>`:
//!
//! ```
//! use lifecycle_core::testing::{CopyBackend, CopyError};
//! use lifecycle_core::{sharded_rollout, EngineBytes, EngineMut, Lifecycle, LifecycleError};
//! use lifecycle_core::{PhaseScope, RolloutEngine, RolloutView};
//!
//! /// A running sum per position, allocated when the engine wakes.
//! #[derive(Default)]
//! struct Accumulator { kv: Vec<f32> }
//! impl RolloutEngine<Vec<f32>> for Accumulator {
//!     type Error = std::convert::Infallible;
//!     fn wake(&mut self, w: RolloutView<'_, Vec<f32>>, _: &mut PhaseScope)
//!         -> Result<(), Self::Error> {
//!         self.kv = vec![0.0; w.len()];
//!         Ok(())
//!     }
//!     fn sleep(&mut self, _: &mut PhaseScope) -> Result<(), Self::Error> {
//!         self.kv = Vec::new();
//!         Ok(())
//!     }
//!     fn memory(&self) -> EngineBytes { EngineBytes::device(4 * self.kv.len() as u64) }
//! }
//!
//! #[sharded_rollout]
//! fn step(weights: RolloutView<'_, Vec<f32>>, mut acc: EngineMut<'_, Accumulator>) -> f32 {
//!     for (kv, w) in acc.kv.iter_mut().zip(weights.iter()) {
//!         *kv += w;
//!     }
//!     acc.kv.iter().sum()
//! }
//!
//! fn main() -> Result<(), LifecycleError<CopyError>> {
//!     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0])
//!         .with_engine(Accumulator::default());
//!     assert_eq!(step(&mut lc)?, 3.0);
//!     assert_eq!(step(&mut lc)?, 6.0);             // the KV cache lives across lazy calls
//!     lc.train()?.state_mut()[0] = 0.0;            // sleep, exit: the cache is freed
//!     assert_eq!(step(&mut lc)?, 2.0);
//!     assert_eq!(lc.metrics().engine.wakes, 2);
//!     Ok(())
//! }
//! ```

#![warn(missing_docs)]

mod cache;
mod engine;
mod error;
mod fault;
mod injector;
mod lifecycle;
mod metrics;
mod phase;
mod policy;
mod recorder;
mod reshard;
mod room;
mod session;
pub mod testing;
mod trace;
mod view;

pub use cache::{CacheStats, PrefixCache, VersionedCache, WeightsVersion};
pub use engine::{EngineMemory, EngineState, RolloutEngine};
pub use error::{panic_message, AfterFailure, EngineAfter, EngineHook, LifecycleError, Operation};
pub use fault::{Fault, FaultAt, FaultHandle, FaultKind, InjectedFault};
pub use injector::{FaultError, FaultInjector};
pub use lifecycle::{Lifecycle, Mode};
pub use metrics::{
    Ceilings, EngineBytes, EngineStats, HumanBytes, HumanDuration, LinkBytes, Metrics, PhaseSample,
    PhaseStats,
};
pub use phase::{Link, Phase};
pub use policy::{LifecycleConfig, MemoryPolicy, Switching};
pub use recorder::{PhaseRecorder, PhaseScope};
pub use reshard::{Reshard, SwitchContext};
pub use room::{MemoryDecision, RoomRequest};
pub use session::{RolloutSession, TrainSession};
pub use trace::{Span, Trace};
pub use view::{Branded, EngineMut, RolloutView, Stamp};

/// See [the attribute](crate#the-attribute) in the crate documentation for a compiled example.
pub use lifecycle_macros::sharded_rollout;

/// The examples of `docs/compiler-errors.md`, compiled with the doctests so that the page keeps
/// saying what the compiler says.
#[cfg(doctest)]
#[doc = include_str!("../../docs/compiler-errors.md")]
pub struct CompilerErrorsPage;

#[doc(hidden)]
pub mod __private {
    pub use crate::engine::RolloutEngine;
    pub use crate::error::LifecycleError;
    pub use crate::lifecycle::Lifecycle;
    pub use crate::reshard::Reshard;
    pub use crate::session::RolloutSession;
    pub use crate::view::{EngineMut, RolloutView};
    pub use core::result::Result;

    /// Ends a rollout call keeping the weights resident, whatever the lifecycle's switching policy
    /// (`#[sharded_rollout(switching = "lazy")]`); the engine's memory policy still applies.
    pub fn finish_lazy<B: Reshard, E: RolloutEngine<B::Rollout>>(
        session: RolloutSession<'_, B, E>,
    ) -> Result<(), LifecycleError<B::Error>> {
        session.end(crate::Switching::Lazy)
    }
}
