//! Settings: when to switch back ([`Switching`]) and what to offload ([`MemoryPolicy`]).

/// When the lifecycle leaves rollout mode; parsed from `lazy` and `eager`.
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleError, Mode, Switching};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let mut lc = Lifecycle::new(CopyBackend::new(), vec![1.0]);
///     assert_eq!(lc.config().switching, Switching::Lazy);
///     lc.set_switching("eager".parse().map_err(LifecycleError::Config)?);
///     for _ in 0..2 {
///         lc.rollout()?.finish()?;                      // eager: exits after every call
///         assert_eq!(lc.mode(), Mode::Train);
///     }
///     assert_eq!(lc.metrics().enters, 2);
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Switching {
    /// Stay in rollout mode after a rollout call until training asks for its state; a rollout
    /// that finds current weights resident moves zero bytes.
    #[default]
    Lazy,
    /// Exit after every rollout call, as stacks that wrap each call in enter/exit do.
    Eager,
}

impl std::str::FromStr for Switching {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lazy" => Ok(Switching::Lazy),
            "eager" => Ok(Switching::Eager),
            other => Err(format!(
                "unknown switching policy `{other}`: expected `lazy` or `eager`"
            )),
        }
    }
}

/// What the backend moves out of device memory while the rollout weights are resident.
///
/// Names follow verl's knobs: `offload_params` moves the fp32 master weights, `offload_optimizer`
/// the optimizer state; gradients are always freed at enter, never copied.
///
/// The [default](MemoryPolicy::default) offloads both (`offload_params = true`,
/// `offload_optimizer = true`, `keep_rollout_resident = false`);
/// [`resident`](MemoryPolicy::resident) offloads nothing. Keeping the rollout weights resident
/// while training runs is valid only when nothing is offloaded
/// ([`validate`](MemoryPolicy::validate), which [`Lifecycle::with_config`] runs).
///
/// [`Lifecycle::with_config`]: crate::Lifecycle::with_config
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleConfig, LifecycleError, MemoryPolicy, Phase};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     // Keep everything on the device, and the rollout weights across training steps.
///     let memory = MemoryPolicy { keep_rollout_resident: true, ..MemoryPolicy::resident() };
///     let config = LifecycleConfig { memory, ..LifecycleConfig::default() };
///     let mut lc = Lifecycle::with_config(CopyBackend::new(), vec![1.0], config)?;
///     lc.rollout()?.finish()?;
///     lc.train()?.state_mut()[0] = 2.0;
///     assert_eq!(lc.rollout()?.weights()[0], 2.0);      // refreshed in place
///     assert_eq!((lc.metrics().enters, lc.metrics().refreshes), (1, 1));
///     assert_eq!(lc.metrics().phase(Phase::Offload).count, 0);
///
///     // Offloading while keeping the weights resident is refused up front.
///     let both = MemoryPolicy { keep_rollout_resident: true, ..MemoryPolicy::default() };
///     assert!(both.validate().is_err());
///     let config = LifecycleConfig { memory: both, ..LifecycleConfig::default() };
///     let refused = Lifecycle::with_config(CopyBackend::new(), vec![1.0], config);
///     assert!(matches!(refused, Err(LifecycleError::Config(_))));
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPolicy {
    /// Offload the master weights to host memory during rollout.
    pub offload_params: bool,
    /// Offload the optimizer state (Adam m, v) to host memory during rollout.
    pub offload_optimizer: bool,
    /// Keep rollout weights resident while training runs, so the next rollout refreshes them in
    /// place instead of allocating. Only valid when nothing is offloaded.
    pub keep_rollout_resident: bool,
}

impl Default for MemoryPolicy {
    /// Offload master weights and optimizer state; release rollout weights on exit:
    /// `offload_params = true`, `offload_optimizer = true`, `keep_rollout_resident = false`.
    ///
    /// ```
    /// use lifecycle_core::MemoryPolicy;
    ///
    /// let policy = MemoryPolicy::default();
    /// assert!(policy.offload_params && policy.offload_optimizer);
    /// assert!(!policy.keep_rollout_resident);
    /// ```
    fn default() -> Self {
        MemoryPolicy {
            offload_params: true,
            offload_optimizer: true,
            keep_rollout_resident: false,
        }
    }
}

impl MemoryPolicy {
    /// Keep everything on the device: no offload, rollout weights released on exit.
    pub fn resident() -> Self {
        MemoryPolicy {
            offload_params: false,
            offload_optimizer: false,
            keep_rollout_resident: false,
        }
    }

    /// Checks the policy is consistent.
    pub fn validate(&self) -> Result<(), String> {
        if self.keep_rollout_resident && (self.offload_params || self.offload_optimizer) {
            return Err(format!(
                "memory policy keeps rollout weights resident while training but also offloads \
                 (offload_params = {}, offload_optimizer = {}): set both offloads to false, or \
                 keep_rollout_resident to false",
                self.offload_params, self.offload_optimizer
            ));
        }
        Ok(())
    }
}

/// All settings of a [`Lifecycle`](crate::Lifecycle). The default switches lazily and uses the
/// default [`MemoryPolicy`] (master weights and optimizer state offloaded during rollout).
///
/// ```
/// use lifecycle_core::testing::{CopyBackend, CopyError};
/// use lifecycle_core::{Lifecycle, LifecycleConfig, LifecycleError, MemoryPolicy, Switching};
///
/// fn main() -> Result<(), LifecycleError<CopyError>> {
///     let config = LifecycleConfig {
///         switching: Switching::Eager,
///         memory: MemoryPolicy::resident(),
///     };
///     let lc = Lifecycle::with_config(CopyBackend::new(), vec![1.0], config)?;
///     assert_eq!(*lc.config(), config);
///     Ok(())
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LifecycleConfig {
    /// When to leave rollout mode.
    pub switching: Switching,
    /// What to offload during rollout.
    pub memory: MemoryPolicy,
}
