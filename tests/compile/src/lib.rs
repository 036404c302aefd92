//! Compile-fail and compile-pass tests (trybuild): see `tests/ui.rs`.
