// What an engine parameter may look like: `EngineMut<'_, E>` by value or `&mut E` (marked), with
// no named lifetime, and never also the weights view.
use lifecycle_core::{sharded_rollout, EngineMut, RolloutView};

struct Kv;

#[sharded_rollout]
fn shared(w: RolloutView<'_, Vec<f32>>, #[engine] e: &Kv) {
    let _ = (w, e);
}

#[sharded_rollout]
fn by_value(w: RolloutView<'_, Vec<f32>>, #[engine] e: Kv) {
    let _ = (w, e);
}

#[sharded_rollout]
fn reference_to_engine_mut(w: RolloutView<'_, Vec<f32>>, e: &mut EngineMut<'_, Kv>) {
    let _ = (w, e);
}

#[sharded_rollout]
fn named_lifetime<'a>(w: RolloutView<'_, Vec<f32>>, e: EngineMut<'a, Kv>) {
    let _ = (w, e);
}

#[sharded_rollout]
fn marker_with_arguments(w: RolloutView<'_, Vec<f32>>, #[engine(kv)] e: &mut Kv) {
    let _ = (w, e);
}

#[sharded_rollout]
fn both_markers(#[weights] #[engine] w: RolloutView<'_, Vec<f32>>) {
    let _ = w;
}

#[sharded_rollout(engine = decoder)]
fn engine_names_nothing(w: RolloutView<'_, Vec<f32>>, e: &mut Kv) {
    let _ = (w, e);
}

fn main() {}
