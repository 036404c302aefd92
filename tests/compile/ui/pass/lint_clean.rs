//! Generated items are warning-free and documented; `crate = "..."` and `#[weights]` work.
#![deny(warnings, missing_docs, unused)]

use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

include!("../copying.rs");

// `crate::runtime`: the runtime re-exported at the root of tests/pass.rs
/// Public and generic, with a parameter named `lifecycle`.
#[sharded_rollout(crate = "crate::runtime", switching = "lazy")]
pub fn norm<W: AsRef<[f32]>, const P: usize>(
    #[weights] w: RolloutView<'_, W>,
    lifecycle: u8,
) -> f32 {
    let _ = lifecycle;
    w.as_ref().iter().map(|x| x.abs().powi(P as i32)).sum()
}

#[sharded_rollout]
fn private_no_return(_w: RolloutView<'_, Vec<f32>>) {}

/// Runs the case.
pub fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![-1.0, 2.0]);
    assert_eq!(norm::<Vec<f32>, 2, _>(&mut lc, 0)?, 5.0);
    private_no_return(&mut lc)?;
    Ok(())
}
