//! Compile-fail cases: the borrow rules that keep rollout weights fresh, and every diagnostic of
//! `#[sharded_rollout]` (the compile-pass cases are `tests/pass.rs`). Regenerate the expected output with
//! `TRYBUILD=overwrite cargo test -p lifecycle-compile-tests --test ui`, then read each `.stderr`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("ui/fail/*.rs");
}
