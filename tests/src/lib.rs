//! Integration and compile-fail tests live in `tests/`.
