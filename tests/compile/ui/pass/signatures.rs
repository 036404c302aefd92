// Kept signature shapes: generics, where clauses, `impl Trait`, async methods, `self: &Self`, cfg.
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

struct Policy<T> {
    bias: T,
    seen: Vec<f32>,
}

impl<T> Policy<T>
where
    T: Copy + Into<f32>,
{
    #[sharded_rollout]
    async fn sample_async(&mut self, w: RolloutView<'_, Vec<f32>>, at: usize) -> f32 {
        async {}.await;
        let x = w[at] + self.bias.into();
        self.seen.push(x);
        x
    }

    #[sharded_rollout]
    fn typed_receiver(self: &Self, w: RolloutView<'_, Vec<f32>>) -> f32 {
        w[0] * self.bias.into()
    }

    #[sharded_rollout]
    pub(crate) fn with_fn_generics<'p, U, const N: usize>(
        &self,
        prefix: &'p [U; N],
        w: RolloutView<Vec<f32>>,
    ) -> impl Iterator<Item = f32> + 'p
    where
        U: Copy + Into<f32>,
    {
        let scale = w[0];
        prefix.iter().map(move |&u| u.into() * scale)
    }
}

/// Raw identifiers, `impl Trait` arguments, `mut` patterns, `return` and a cfg'd twin.
#[sharded_rollout]
fn r#match(mut w: RolloutView<'_, Vec<f32>>, pick: impl Fn(&[f32]) -> f32, _: ()) -> Option<f32> {
    if w.is_empty() {
        return None;
    }
    let again = w;
    w = again;
    Some(pick(&w))
}

#[cfg(any())]
#[sharded_rollout]
fn compiled_out(w: RolloutView<'_, NotAType>) -> f32 {
    w.missing()
}

/// Generic weights: `_enter` / `_exit` cannot name `W`, so they take any backend.
#[sharded_rollout]
fn length<W: AsRef<[f32]>>(w: RolloutView<'_, W>) -> usize {
    w.as_ref().len()
}

pub fn main() -> LcResult {
    let mut lc = Lifecycle::new(Copying, vec![1.0, 2.0]);
    let mut policy = Policy {
        bias: 1u8,
        seen: Vec::new(),
    };
    assert_eq!(block_on(policy.sample_async(&mut lc, 1))?, 3.0);
    assert_eq!(policy.seen, [3.0]);
    assert_eq!(policy.typed_receiver(&mut lc)?, 1.0);
    let scaled: Vec<f32> = policy.with_fn_generics(&mut lc, &[2u8, 3])?.collect();
    assert_eq!(scaled, [2.0, 3.0]);
    assert_eq!(r#match(&mut lc, |w| w[1], ())?, Some(2.0));
    assert_eq!(match_enter(&mut lc).map(|()| 1)?, 1);
    assert_eq!(length(&mut lc)?, 2);
    length_exit(&mut lc)?;
    assert_eq!(lc.metrics().enters, 1);
    Ok(())
}
