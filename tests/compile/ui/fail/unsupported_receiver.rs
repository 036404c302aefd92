// Methods take `&self` or `&mut self`: `self` by value, `mut self` and `self: Box<Self>` are rejected.
use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

struct Sampler;

impl Sampler {
    #[sharded_rollout]
    fn by_value(self, w: RolloutView<'_, Vec<f32>>) -> f32 {
        w[0]
    }

    #[sharded_rollout]
    fn by_mut_value(mut self, w: RolloutView<'_, Vec<f32>>) -> f32 {
        self = Sampler;
        let _ = self;
        w[0]
    }

    #[sharded_rollout]
    fn boxed(self: Box<Self>, w: RolloutView<'_, Vec<f32>>) -> f32 {
        w[0]
    }
}

// The callers below type-check against the signature the attribute would have generated: its
// errors are the only ones.
fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0]);
    let a: f32 = Sampler.by_value(&mut lc)?;
    let b: f32 = Sampler.by_mut_value(&mut lc)?;
    let c: f32 = Box::new(Sampler).boxed(&mut lc)?;
    println!("{}", a + b + c);
    Ok(())
}

include!("../copying.rs");
