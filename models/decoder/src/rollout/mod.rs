//! Rollout as RL uses it: requests with their own sampling settings ([`Request`],
//! [`SamplingParams`]), the reference token pick with its log-probabilities ([`pick`]),
//! continuous batching over a decoder's KV slots ([`Scheduler`], [`SlotDecoder`]), and the
//! CPU decoder as a slot decoder (the reference the GPU engine is compared with).

mod cpu;
pub(crate) mod groups;
pub(crate) mod pick;
pub(crate) mod request;
pub(crate) mod scheduler;
