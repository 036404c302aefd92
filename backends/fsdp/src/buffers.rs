//! The training buffers an [`FsdpBackend`](crate::FsdpBackend) switches: its own
//! ([`FsdpTrainState`]) or a caller's, lent by address ([`LentFsdpState`]). One
//! [`Reshard`](lifecycle_core::Reshard) serves both (`reshard.rs`); what differs is said here.

use std::sync::Arc;

use lifecycle_cuda::driver::{NoHooks, RankBuffers, SwitchHooks};
use lifecycle_layout::fsdp::ShardLayout;
use lifecycle_layout::FsdpLayout;

use crate::hooks::FsdpHooks;
use crate::lent::LentFsdpState;
use crate::state::{FsdpTrainState, RankTrain};
use crate::FsdpError;

/// Training buffers an [`FsdpBackend`](crate::FsdpBackend) switches: [`FsdpTrainState`] (the
/// backend's own, the default) or [`LentFsdpState`] (a caller's, by address). Sealed: the two
/// kinds are the crate's.
pub trait FsdpBuffers: sealed::Buffers + Send {}

impl FsdpBuffers for FsdpTrainState {}
impl FsdpBuffers for LentFsdpState {}

pub(crate) mod sealed {
    use super::*;

    /// What a switch needs of a state's buffers (crate-private: [`FsdpBuffers`] is sealed).
    pub trait Buffers {
        /// One local rank's buffers.
        type Rank: RankBuffers + Sync;
        /// The hooks of a switch of these buffers.
        type Hooks<'a>: SwitchHooks<Self::Rank>
        where
            Self: 'a;

        /// Names and full shapes, in training order.
        fn train_layout(&self) -> &Arc<FsdpLayout>;

        /// Each local rank's buffers and the flat layout their shards follow.
        fn parts(&self) -> (&[Self::Rank], &ShardLayout);

        /// As [`Buffers::parts`], the ranks mutable.
        fn parts_mut(&mut self) -> (&mut [Self::Rank], &ShardLayout);

        /// The hooks of a switch of a state of layout `shards` (`verify`: verification mode).
        fn hooks(shards: &ShardLayout, verify: bool) -> Self::Hooks<'_>;

        /// Refuses a switch that would read offloaded buffers (`entering`: an enter, which also
        /// needs the optimizer state back; else a refresh).
        fn on_device(&mut self, entering: bool) -> Result<(), FsdpError>;

        /// A frozen tensor its lender reported written since the last enter
        /// ([`LentFsdpState::mark_frozen_written`]); the backend's own state refuses such
        /// writes when they are made.
        fn frozen_written(&self) -> Option<&str> {
            None
        }

        /// Forgets [`Buffers::frozen_written`] (an enter casts every tensor again).
        fn clear_frozen_written(&mut self) {}
    }

    impl Buffers for FsdpTrainState {
        type Rank = RankTrain;
        type Hooks<'a> = FsdpHooks<'a>;

        fn train_layout(&self) -> &Arc<FsdpLayout> {
            &self.layout
        }

        fn parts(&self) -> (&[RankTrain], &ShardLayout) {
            (&self.ranks, &self.shards)
        }

        fn parts_mut(&mut self) -> (&mut [RankTrain], &ShardLayout) {
            (&mut self.ranks, &self.shards)
        }

        fn hooks(shards: &ShardLayout, verify: bool) -> FsdpHooks<'_> {
            FsdpHooks {
                verify: verify.then(|| crate::verify::shard_table(shards)),
                shards,
            }
        }

        fn on_device(&mut self, entering: bool) -> Result<(), FsdpError> {
            if self.master_offloaded() || (entering && self.optimizer_offloaded()) {
                return Err(FsdpError::Offloaded {
                    operation: operation(entering),
                });
            }
            Ok(())
        }
    }

    impl Buffers for LentFsdpState {
        type Rank = lifecycle_cuda::driver::LentRank;
        type Hooks<'a> = NoHooks;

        fn train_layout(&self) -> &Arc<FsdpLayout> {
            &self.layout
        }

        fn parts(&self) -> (&[Self::Rank], &ShardLayout) {
            (&self.ranks, &self.shards)
        }

        fn parts_mut(&mut self) -> (&mut [Self::Rank], &ShardLayout) {
            (&mut self.ranks, &self.shards)
        }

        fn hooks(_shards: &ShardLayout, _verify: bool) -> NoHooks {
            // verification is refused when lending (`FsdpBackend::lending`)
            NoHooks
        }

        fn on_device(&mut self, entering: bool) -> Result<(), FsdpError> {
            if self.offloaded() {
                return Err(FsdpError::Offloaded {
                    operation: operation(entering),
                });
            }
            Ok(())
        }

        fn frozen_written(&self) -> Option<&str> {
            self.frozen_written.as_deref()
        }

        fn clear_frozen_written(&mut self) {
            self.frozen_written = None;
        }
    }

    fn operation(entering: bool) -> &'static str {
        if entering {
            "entering rollout mode"
        } else {
            "refreshing rollout weights"
        }
    }
}
