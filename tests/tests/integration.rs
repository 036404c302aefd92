//! The crate's integration tests in one binary: one build and link instead of one per file
//! (`cargo test -p lifecycle-tests --test integration bad_input` runs one file's tests).

mod bad_input;
mod common;
mod engine;
mod faults;
mod host_reshard;
mod macro_lifecycle;
mod state_machine;
mod trace;
mod verify;
