//! The Megatron-Core training state in host memory (TP × PP × DP, fused QKV and gate/up, padded
//! vocabulary, distributed optimizer; expert layouts for mixture-of-experts models).

mod error;
mod shard;
mod state;

pub use error::MegatronError;
pub use state::{MegatronTrainState, RankTrain, Resident};
