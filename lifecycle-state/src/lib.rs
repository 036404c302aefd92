//! Training states in host memory, below every executor: the FSDP state ([`HostTrainState`]:
//! per rank the dim-0 shards of fp32 master weights, grads and Adam moments) and the Megatron
//! state ([`megatron::MegatronTrainState`]: per rank the bf16 parameter buffer of its stage and
//! TP rank, fp32 grads, and its distributed-optimizer shard), with their shard maths, Adam steps,
//! offload bookkeeping ([`MemoryMeter`]) and errors.
//!
//! The CPU executors (`lifecycle-host`) run switches over these states; the GPU backends build
//! their device states from them and download back into them; the decoders load checkpoints
//! into them. None of those import each other for it.
//!
//! ```
//! use lifecycle_layout::HostTensor;
//! use lifecycle_state::HostTrainState;
//! let state = HostTrainState::from_tensors(2, vec![HostTensor::f32("w", [3, 2], vec![1.0; 6])])?;
//! assert_eq!(state.world(), 2);
//! # Ok::<(), lifecycle_state::HostError>(())
//! ```

#![warn(missing_docs)]

mod cast;
mod checksum;
mod error;
mod fsdp;
pub mod megatron;

pub use cast::cast_f32_to_bf16;
pub use checksum::{checksum_bf16, checksum_f32, checksum_tensor};
pub use error::HostError;
pub use fsdp::{HostTrainState, MemoryMeter, RankState, Residence, Shard, ShardMut, TrainBuffer};
