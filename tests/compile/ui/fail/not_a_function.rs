// #[sharded_rollout] applies to functions only.
use lifecycle_core::sharded_rollout;

#[sharded_rollout]
struct Sampler {
    temperature: f32,
}

fn main() {
    let _ = Sampler { temperature: 1.0 }.temperature;
}
