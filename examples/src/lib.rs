//! Shared code of the examples.
