//! Code the benchmark, soak and probe programs of this crate share.
#![warn(missing_docs)]
