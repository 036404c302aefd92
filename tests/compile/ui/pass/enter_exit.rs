// `name_enter` / `name_exit` switch explicitly; `switching = "eager"` exits after every call.
use lifecycle_core::{sharded_rollout, Lifecycle, Mode, RolloutView};

include!("../copying.rs");

#[sharded_rollout(switching = "eager")]
fn first(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

pub fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0]);
    first_enter(&mut lc)?;
    assert_eq!(lc.mode(), Mode::Rollout);
    first_exit(&mut lc)?;
    assert_eq!(lc.mode(), Mode::Train);
    assert_eq!(first(&mut lc)?, 1.0);
    assert_eq!(lc.mode(), Mode::Train);
    assert_eq!((lc.metrics().enters, lc.metrics().exits), (2, 2));
    Ok(())
}
