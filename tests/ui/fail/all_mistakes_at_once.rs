// Every mistake of one attribute is reported at once, each on its own tokens.
use lifecycle_core::{sharded_rollout, RolloutView};

#[sharded_rollout(switching = "never", retries = 3)]
fn first<'a>(w: RolloutView<'a, Vec<f32>>, scale: f32) -> &f32 {
    let _ = (w, scale);
    unimplemented!()
}

fn main() {}
