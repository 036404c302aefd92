//! Code the benchmark, soak and probe programs of this crate share: the hardware ceilings they
//! measure in their own process ([`ceilings`]), enter / exit cycles of a lifecycle and their
//! metrics ([`cycles`]), traced switches and their per-stream summaries ([`trace`]), medians,
//! timed repetitions and report text ([`timing`]), and command-line value parsers ([`cli`]).
#![warn(missing_docs)]

pub mod ceilings;
pub mod cli;
pub mod cycles;
pub mod models;
pub mod timing;
pub mod trace;
