//! Settings: when to switch back ([`Switching`]) and what to offload ([`MemoryPolicy`]).

/// When the lifecycle leaves rollout mode.
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
    /// Offload master weights and optimizer state; release rollout weights on exit.
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

/// All settings of a [`Lifecycle`](crate::Lifecycle).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LifecycleConfig {
    /// When to leave rollout mode.
    pub switching: Switching,
    /// What to offload during rollout.
    pub memory: MemoryPolicy,
}
