//! Views: what a rollout session lends, and what is tied to its lifetime.
//!
//! A [`RolloutSession`](crate::RolloutSession) lends the rollout weights as a [`RolloutView`] and
//! the awake engine as an [`EngineMut`]. Both carry the session's lifetime and the weight version
//! they serve, and so do the two values made from them: a [`Stamp`] (the version alone, a proof
//! for cache lookups) and a [`Branded`] value (a KV handle or a batch's blocks tied to the
//! session). None of them can outlive the session, so none can be used across a training update
//! or after exit.
//!
//! These types know nothing of the lifecycle, the backend or the engine contract: every other
//! part of the crate builds on them.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// A shared view of rollout weights, borrowed from a [`RolloutSession`](crate::RolloutSession).
///
/// It dereferences to the backend's rollout weights. It cannot outlive its session, so it cannot
/// be kept across a training update, used after exit, or sent to a thread that may outlive the
/// session (scoped threads inside the session are fine when the weights are `Sync`). It is `Copy`:
/// pass it by value.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError, RolloutView};
///
/// fn dot(weights: RolloutView<'_, Vec<f32>>, x: &[f32]) -> f32 {
///     weights.iter().zip(x).map(|(w, x)| w * x).sum()
/// }
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0]);
///     let session = lc.rollout()?;
///     let weights = session.weights();
///     assert_eq!(dot(weights, &[3.0, 4.0]), 11.0);
///     assert_eq!(weights.version(), 0);                  // built from version 0
///     std::thread::scope(|s| {
///         s.spawn(|| assert_eq!(weights[1], 2.0));       // scoped threads may read it
///     });
///     session.finish()
/// }
/// ```
pub struct RolloutView<'s, W> {
    weights: &'s W,
    version: u64,
}

impl<W> Clone for RolloutView<'_, W> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<W> Copy for RolloutView<'_, W> {}

impl<'s, W> RolloutView<'s, W> {
    pub(crate) fn new(weights: &'s W, version: u64) -> Self {
        RolloutView { weights, version }
    }

    /// The version of the training weights these rollout weights were built from.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The weights, with the view's lifetime.
    pub fn get(&self) -> &'s W {
        self.weights
    }

    /// A proof of this view's weight version for [`VersionedCache`](crate::VersionedCache)
    /// lookups, with the view's lifetime.
    pub fn stamp(&self) -> Stamp<'s> {
        Stamp::new(self.version)
    }

    /// Ties `value` (a KV handle, a batch's cache blocks) to this view: the result cannot outlive
    /// the session, so it cannot be used across a training update or after exit.
    pub fn brand<T>(&self, value: T) -> Branded<'s, T> {
        Branded::new(value, self.version)
    }
}

impl<W> Deref for RolloutView<'_, W> {
    type Target = W;
    fn deref(&self) -> &W {
        self.weights
    }
}

impl<W: fmt::Debug> fmt::Debug for RolloutView<'_, W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RolloutView")
            .field("version", &self.version)
            .field("weights", self.weights)
            .finish()
    }
}

/// Mutable access to the awake engine, borrowed from a
/// [`RolloutSession`](crate::RolloutSession) next to the weights view
/// ([`parts`](crate::RolloutSession::parts)).
///
/// It dereferences to the engine. Like the view, it cannot outlive its session: it cannot be kept
/// across a training update or used after the session ends.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError, KvEngine};
/// use lifecycle_core::{EngineMut, Lifecycle, LifecycleError, RolloutView};
///
/// /// Writes each weight, doubled, into its KV slot.
/// fn fill(weights: RolloutView<'_, Vec<f32>>, mut engine: EngineMut<'_, KvEngine>) {
///     for (slot, w) in engine.kv.iter_mut().zip(weights.iter()) {
///         *slot = 2.0 * w;
///     }
/// }
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let engine = KvEngine::new();
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0]).with_engine(engine);
///     let mut session = lc.rollout()?;
///     let (weights, mut engine) = session.parts();
///     assert_eq!(engine.version(), weights.version());   // woken for these weights
///     fill(weights, engine.reborrow());                  // lend it, keep it
///     assert_eq!(engine.kv, [2.0, 4.0]);
///     session.finish()?;
///     assert_eq!(lc.engine().kv, [2.0, 4.0]);            // still awake: lazy switching
///     Ok(())
/// }
/// ```
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

/// The weight version of a live session, without a borrow of the weights: from
/// [`RolloutView::stamp`] or [`EngineMut::stamp`]. It has the session's lifetime, so it cannot be
/// kept for a later version. It is what an engine hands its own caches while it holds itself
/// mutably.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError, PrefixCache};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0]);
///     let mut prefixes: PrefixCache<u32, usize> = PrefixCache::new();
///     let session = lc.rollout()?;
///     let stamp = session.weights().stamp();
///     assert_eq!(stamp.version(), session.version());
///     prefixes.insert(stamp, vec![1, 2], 2);              // a proof of the version, no borrow
///     assert_eq!(prefixes.get(stamp, &[1, 2][..]), Some(&2));
///     session.finish()
/// }
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Stamp<'s> {
    version: u64,
    _session: PhantomData<&'s ()>,
}

impl Stamp<'_> {
    pub(crate) fn new(version: u64) -> Self {
        Stamp {
            version,
            _session: PhantomData,
        }
    }

    /// The version.
    pub fn version(&self) -> u64 {
        self.version
    }
}

impl fmt::Debug for Stamp<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Stamp").field(&self.version).finish()
    }
}

/// A value tied to one rollout session: made by [`RolloutView::brand`], it cannot outlive the
/// view's session (so it cannot be used after a training update or after exit), and it remembers
/// the version it was made at. It dereferences to the value.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0, 2.0]);
///     let session = lc.rollout()?;
///     let weights = session.weights();
///     let mut kv = weights.brand(vec![0.0_f32; 2]);     // KV blocks of this session
///     kv[1] = weights[1];
///     let total = kv.map(|blocks| blocks.iter().sum::<f32>());
///     assert_eq!((*total, total.version()), (2.0, 0));
///     session.finish()
/// }
/// ```
///
/// Keeping it across a training update does not compile:
///
/// ```compile_fail,E0499
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0]);
///     let session = lc.rollout()?;
///     let kv = session.weights().brand(vec![0.5_f32; 4]); // KV blocks of this session
///     lc.train()?.state_mut()[0] = 2.0;                   // error[E0499]: `kv` still borrows `lc`
///     println!("{}", kv[0]);
///     Ok(())
/// }
/// ```
pub struct Branded<'s, T> {
    value: T,
    version: u64,
    _session: PhantomData<&'s ()>,
}

impl<'s, T> Branded<'s, T> {
    pub(crate) fn new(value: T, version: u64) -> Self {
        Branded {
            value,
            version,
            _session: PhantomData,
        }
    }

    /// The version of the weights the value was made for.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Applies `f` to the value, keeping the brand.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Branded<'s, U> {
        Branded::new(f(self.value), self.version)
    }
}

impl<T> Deref for Branded<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> DerefMut for Branded<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.value
    }
}

impl<T: fmt::Debug> fmt::Debug for Branded<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Branded")
            .field("version", &self.version)
            .field("value", &self.value)
            .finish()
    }
}
