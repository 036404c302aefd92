//! Rollout as RL uses it: requests with their own sampling settings
//! ([`Request`](request::Request), [`SamplingParams`](request::SamplingParams)), the reference
//! token pick with its log-probabilities ([`pick`](pick::pick)), continuous batching over a
//! decoder's KV slots ([`Scheduler`](scheduler::Scheduler),
//! [`SlotDecoder`](scheduler::SlotDecoder)) and pages ([`KvPages`](pages::KvPages)), DAPO's dynamic sampling streamed
//! ([`GroupStream`](groups::GroupStream)), and the CPU decoder as a slot decoder (the reference
//! the GPU engine is compared with). Every item is also at the crate's root.

mod cpu;
pub mod groups;
pub mod pages;
pub mod pick;
pub mod request;
pub mod scheduler;
