// Every mistake of one attribute is reported at once, each on its own tokens.
use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

#[sharded_rollout(switching = "never", retries = 3)]
fn first<'a>(w: RolloutView<'a, Vec<f32>>, scale: f32) -> &f32 {
    let _ = (w, scale);
    unimplemented!()
}

// The callers below type-check against the signature the attribute would have generated: its
// errors are the only ones.
fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0]);
    let x: f32 = *first(&mut lc, 2.0)?;
    println!("{x}");
    Ok(())
}

include!("../copying.rs");
