// When #[sharded_rollout] rejects a function, its errors are the only ones: callers type-check
// against the signature the attribute would have generated (the lifecycle instead of the view and
// the engine, the other parameters as written, the body's value in a `Result`), on free
// functions, methods and `async` functions, with `name_enter` / `name_exit`, and with a return
// type the attribute refuses (a borrow behind `impl Trait`).
use lifecycle_core::{sharded_rollout, EngineMut, Lifecycle, RolloutView};

#[sharded_rollout(switching = "sometimes")]
fn score(w: RolloutView<'_, Vec<f32>>, prompt: &[usize]) -> f32 {
    prompt.iter().map(|&t| w[t]).sum()
}

#[sharded_rollout]
fn weights<'a>(w: RolloutView<'a, Vec<f32>>) -> impl Iterator<Item = &f32> {
    w.get().iter()
}

#[sharded_rollout(retries = 2)]
async fn generate(w: RolloutView<'_, Vec<f32>>, n: usize) -> Vec<f32> {
    w.iter().take(n).copied().collect()
}

#[sharded_rollout(weights = policy)]
fn decode(w: RolloutView<'_, Vec<f32>>, mut kv: EngineMut<'_, Kv>) -> f32 {
    kv.touch() + w[0]
}

struct Sampler;

impl Sampler {
    #[sharded_rollout(switching = 1)]
    fn sample(&self, w: RolloutView<'_, Vec<f32>>) -> usize {
        w.len()
    }
}

fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]).with_engine(Kv::default());
    let total: f32 = score(&mut lc, &[0, 1])?;
    let first: Option<&f32> = weights(&mut lc)?.next();
    let _ = generate(&mut lc, 1);
    let decoded: f32 = decode(&mut lc)?;
    let n: usize = Sampler.sample(&mut lc)?;
    score_enter(&mut lc)?;
    score_exit(&mut lc)?;
    println!("{total} {first:?} {decoded} {n}");
    Ok(())
}

include!("../copying.rs");
include!("../engine.rs");
