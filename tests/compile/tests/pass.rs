//! Compile-pass cases: code that must compile, warning-free where a case says so, and run: the
//! macro's signatures, methods, async and threads, explicit switches, the engine parameter. Each
//! case is a module of this test (built with the other tests, not by trybuild: a case that stops
//! compiling fails the build of this test) and its `main` runs as a test.

// The cases spell signatures as users may (bounds in two places, `self: &Self`, a view moved out
// and back): the macro must take them as written.
#![allow(
    clippy::multiple_bound_locations,
    clippy::needless_arbitrary_self_type,
    clippy::almost_swapped
)]

/// The runtime under another path (the `crate = "crate::runtime"` of `lint_clean`).
pub use lifecycle_core as runtime;

#[path = "../ui/pass/async_fn.rs"]
pub mod async_fn;
#[path = "../ui/pass/engine_param.rs"]
pub mod engine_param;
#[path = "../ui/pass/enter_exit.rs"]
pub mod enter_exit;
#[path = "../ui/pass/lint_clean.rs"]
pub mod lint_clean;
#[path = "../ui/pass/methods.rs"]
pub mod methods;
#[path = "../ui/pass/scoped_threads.rs"]
pub mod scoped_threads;
#[path = "../ui/pass/signatures.rs"]
pub mod signatures;
#[path = "../ui/pass/sync_calls_in_a_row.rs"]
pub mod sync_calls_in_a_row;
#[path = "../ui/pass/weights_argument.rs"]
pub mod weights_argument;

#[test]
fn async_fn_runs() {
    async_fn::main().expect("the case runs");
}

#[test]
fn engine_param_runs() {
    engine_param::main().expect("the case runs");
}

#[test]
fn enter_exit_runs() {
    enter_exit::main().expect("the case runs");
}

#[test]
fn lint_clean_runs() {
    lint_clean::main().expect("the case runs");
}

#[test]
fn methods_runs() {
    methods::main().expect("the case runs");
}

#[test]
fn scoped_threads_runs() {
    scoped_threads::main().expect("the case runs");
}

#[test]
fn signatures_runs() {
    signatures::main().expect("the case runs");
}

#[test]
fn sync_calls_in_a_row_runs() {
    sync_calls_in_a_row::main().expect("the case runs");
}

#[test]
fn weights_argument_runs() {
    weights_argument::main().expect("the case runs");
}
