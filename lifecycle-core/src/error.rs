//! Errors of the lifecycle itself, wrapping the backend's.

/// Why a lifecycle operation failed, and the state the lifecycle is left in.
#[derive(Debug, thiserror::Error)]
pub enum LifecycleError<E: std::error::Error + 'static> {
    /// The backend rejected the layouts. No data moved; the lifecycle is unchanged.
    #[error("planning the rollout layout failed: {0}")]
    Plan(#[source] E),
    /// Entering rollout mode failed. The backend restored the training state; the lifecycle is in
    /// train mode with no rollout weights resident.
    #[error(
        "entering rollout mode failed (training state restored, lifecycle in train mode): {0}"
    )]
    Enter(#[source] E),
    /// Refreshing resident rollout weights failed. The lifecycle is in train mode; the resident
    /// weights are marked stale and the next rollout refreshes them again.
    #[error("refreshing resident rollout weights failed (lifecycle in train mode, weights marked stale): {0}")]
    Refresh(#[source] E),
    /// Leaving rollout mode failed. The rollout weights are gone and the training state may not be
    /// back: the lifecycle is faulted and refuses further switches.
    #[error("leaving rollout mode failed; the lifecycle is faulted: {0}")]
    Exit(#[source] E),
    /// An earlier exit failed; the training state may be incomplete.
    #[error(
        "the lifecycle is faulted by an earlier failed exit: the training state may be incomplete; \
         rebuild the lifecycle from a checkpoint"
    )]
    Faulted,
    /// The configuration is inconsistent.
    #[error("invalid lifecycle configuration: {0}")]
    Config(String),
}
