//! The crate's integration tests in one binary: one build and link instead of one per file
//! (`cargo test -p lifecycle-dist --test integration agent_store` runs one file's tests).

mod agent_store;
mod multiprocess;
