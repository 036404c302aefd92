//! The training buffers a [`MegatronGpuBackend`](crate::MegatronGpuBackend) switches: its own
//! ([`MegatronGpuState`]) or a caller's, lent by address ([`LentMegatronState`]). One
//! [`Reshard`](lifecycle_core::Reshard) serves both (`reshard.rs`); what differs is said here.

use std::sync::Arc;

use lifecycle_cuda::driver::RankBuffers;
use lifecycle_layout::megatron::MegatronLayout;

use crate::lent::LentMegatronState;
use crate::state::{GpuRank, MegatronGpuState};

/// Training buffers a [`MegatronGpuBackend`](crate::MegatronGpuBackend) switches:
/// [`MegatronGpuState`] (the backend's own, the default) or [`LentMegatronState`] (a caller's,
/// by address: Megatron-Core's parameters where its DDP buffers keep them). Sealed: the two
/// kinds are the crate's.
pub trait MegatronBuffers: sealed::Buffers + Send {}

impl MegatronBuffers for MegatronGpuState {}
impl MegatronBuffers for LentMegatronState {}

pub(crate) mod sealed {
    use super::*;

    /// What a switch needs of a state's buffers (crate-private: [`MegatronBuffers`] is sealed).
    pub trait Buffers {
        /// One local rank's buffers.
        type Rank: RankBuffers + Sync;

        /// The training layout.
        fn train_layout(&self) -> &Arc<MegatronLayout>;

        /// The global ranks this process holds, in the pool's order.
        fn local_ranks(&self) -> Vec<usize>;

        /// Each local rank's buffers.
        fn ranks(&self) -> &[Self::Rank];

        /// As [`Buffers::ranks`], mutable.
        fn ranks_mut(&mut self) -> &mut [Self::Rank];

        /// Whether any buffer a switch reads is offloaded.
        fn offloaded(&mut self) -> bool;
    }

    impl Buffers for MegatronGpuState {
        type Rank = GpuRank;

        fn train_layout(&self) -> &Arc<MegatronLayout> {
            &self.layout
        }

        fn local_ranks(&self) -> Vec<usize> {
            MegatronGpuState::local_ranks(self)
        }

        fn ranks(&self) -> &[GpuRank] {
            &self.ranks
        }

        fn ranks_mut(&mut self) -> &mut [GpuRank] {
            &mut self.ranks
        }

        fn offloaded(&mut self) -> bool {
            self.is_offloaded()
        }
    }

    impl Buffers for LentMegatronState {
        type Rank = lifecycle_cuda::driver::LentRank;

        fn train_layout(&self) -> &Arc<MegatronLayout> {
            &self.layout
        }

        fn local_ranks(&self) -> Vec<usize> {
            self.locals.clone()
        }

        fn ranks(&self) -> &[Self::Rank] {
            &self.ranks
        }

        fn ranks_mut(&mut self) -> &mut [Self::Rank] {
            &mut self.ranks
        }

        fn offloaded(&mut self) -> bool {
            self.ranks.iter_mut().any(|r| r.any_offloaded())
        }
    }
}
