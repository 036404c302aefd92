// Methods take `&self` or `&mut self`: `self` by value, `mut self` and `self: Box<Self>` are rejected.
use lifecycle_core::{sharded_rollout, RolloutView};

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

fn main() {}
