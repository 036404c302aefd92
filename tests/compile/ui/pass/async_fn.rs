// An async rollout function keeps the session open across `.await`; polled with a no-op waker.
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use lifecycle_core::{sharded_rollout, Lifecycle, RolloutView};

include!("../copying.rs");

fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
    }
}

async fn tick() {}

#[sharded_rollout]
async fn generate(w: RolloutView<'_, Vec<f32>>, steps: usize) -> Vec<f32> {
    let mut tokens = Vec::with_capacity(steps);
    for step in 0..steps {
        tick().await;
        tokens.push(w[step % w.len()]);
    }
    tokens
}

pub fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    assert_eq!(block_on(generate(&mut lc, 3))?, [1.0, 2.0, 1.0]);
    assert_eq!(block_on(generate(&mut lc, 1))?, [1.0]);
    assert_eq!(lc.metrics().enters, 1);
    Ok(())
}
