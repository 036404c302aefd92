//! The deterministic random number generator of the examples: the decoder's SplitMix64, so runs
//! are reproducible from a seed and identical across lifecycle policies.

pub use lifecycle_decoder::SplitMix64;
