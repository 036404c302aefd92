// Rollout functions that take the engine next to the weights view: by `EngineMut`, by a marked
// `&mut E`, by name, generic over the engine, as methods and `async`; functions without an engine
// run on a lifecycle with one.
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use lifecycle_core::{
    sharded_rollout, EngineMemory, EngineMut, EngineState, Lifecycle, Mode, RolloutEngine,
    RolloutView,
};

include!("../copying.rs");
include!("../engine.rs");

#[sharded_rollout]
fn decode(weights: RolloutView<'_, Vec<f32>>, mut kv: EngineMut<'_, Kv>, step: usize) -> f32 {
    kv.cache[step] += weights[step];
    kv.touch()
}

#[sharded_rollout]
fn by_reference(weights: RolloutView<'_, Vec<f32>>, #[engine] kv: &mut Kv) -> usize {
    kv.cache.len().min(weights.len())
}

#[sharded_rollout(engine = kv, switching = "lazy")]
fn by_name(kv: &mut Kv, weights: RolloutView<'_, Vec<f32>>) -> f32 {
    kv.touch() + weights[1]
}

#[sharded_rollout]
fn generic<E: RolloutEngine<Vec<f32>>>(
    weights: RolloutView<'_, Vec<f32>>,
    engine: EngineMut<'_, E>,
) -> u64 {
    engine.memory().device + weights.len() as u64
}

#[sharded_rollout]
fn without_engine(weights: RolloutView<'_, Vec<f32>>) -> f32 {
    weights[0]
}

struct Sampler {
    offset: f32,
}

impl Sampler {
    #[sharded_rollout]
    fn sample(&self, weights: RolloutView<'_, Vec<f32>>, kv: EngineMut<'_, Kv>) -> f32 {
        self.offset + weights[0] + kv.cache.len() as f32
    }

    #[sharded_rollout]
    async fn sample_async(
        &mut self,
        weights: RolloutView<'_, Vec<f32>>,
        mut kv: EngineMut<'_, Kv>,
    ) -> f32 {
        self.offset += 1.0;
        self.offset + weights[0] + kv.touch()
    }
}

fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
    }
}

pub fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]).with_engine(Kv::default());
    assert_eq!(decode(&mut lc, 0)?, 1.0);
    assert_eq!(decode(&mut lc, 0)?, 2.0); // the KV cache is kept across lazy calls
    assert_eq!(by_reference(&mut lc)?, 2);
    assert_eq!(by_name(&mut lc)?, 4.0);
    assert_eq!(generic(&mut lc)?, 10);
    assert_eq!(without_engine(&mut lc)?, 1.0);
    let mut sampler = Sampler { offset: 0.5 };
    assert_eq!(sampler.sample(&mut lc)?, 3.5);
    assert_eq!(block_on(sampler.sample_async(&mut lc))?, 4.5);
    assert_eq!(lc.metrics().engine.wakes, 1);

    decode_exit(&mut lc)?;
    assert_eq!(
        (lc.mode(), lc.engine_state()),
        (Mode::Train, EngineState::Asleep)
    );
    decode_enter(&mut lc)?;
    assert_eq!(
        (lc.mode(), lc.engine_state()),
        (Mode::Rollout, EngineState::Awake)
    );

    lc.set_engine_memory(EngineMemory::FreeEachCall);
    assert_eq!(decode(&mut lc, 1)?, 2.0); // a fresh cache
    assert_eq!(lc.engine_state(), EngineState::Asleep);

    // Functions without an engine still take a lifecycle without one.
    let mut plain = Lifecycle::new(Copying, vec![3.0]);
    assert_eq!(without_engine(&mut plain)?, 3.0);
    Ok(())
}
