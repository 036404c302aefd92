//! Run-time behaviour of `#[sharded_rollout]`: how many switches N calls cost under each policy,
//! fresh weights after a training update, forced policies, async functions, methods, the explicit
//! entry points and error propagation.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use lifecycle_core::{
    sharded_rollout, Lifecycle, LifecycleConfig, LifecycleError, Mode, Reshard, RolloutView,
    SwitchContext, Switching,
};
use proptest::prelude::*;

/// Training state and rollout weights are the same `Vec<f32>`; counts its own switches.
#[derive(Default, Debug)]
struct Counting {
    enters: usize,
    refreshes: usize,
    exits: usize,
}

#[derive(Debug, PartialEq, Eq)]
struct EmptyWeights;

impl std::fmt::Display for EmptyWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the training state is empty")
    }
}

impl std::error::Error for EmptyWeights {}

impl Reshard for Counting {
    type TrainState = Vec<f32>;
    type Rollout = Vec<f32>;
    type Plan = ();
    type Error = EmptyWeights;

    fn plan(&self, state: &Vec<f32>) -> Result<(), EmptyWeights> {
        if state.is_empty() {
            Err(EmptyWeights)
        } else {
            Ok(())
        }
    }

    fn enter(
        &mut self,
        _: &(),
        state: &mut Vec<f32>,
        _: &mut SwitchContext<'_>,
    ) -> Result<Vec<f32>, EmptyWeights> {
        self.enters += 1;
        Ok(state.clone())
    }

    fn refresh(
        &mut self,
        _: &(),
        state: &mut Vec<f32>,
        rollout: &mut Vec<f32>,
        _: &mut SwitchContext<'_>,
    ) -> Result<(), EmptyWeights> {
        self.refreshes += 1;
        rollout.clone_from(state);
        Ok(())
    }

    fn exit(
        &mut self,
        _: &mut Vec<f32>,
        _: Option<Vec<f32>>,
        _: &mut SwitchContext<'_>,
    ) -> Result<(), EmptyWeights> {
        self.exits += 1;
        Ok(())
    }
}

type TestResult<T> = std::result::Result<T, LifecycleError<EmptyWeights>>;

fn lazy(weights: Vec<f32>) -> Lifecycle<Counting> {
    Lifecycle::new(Counting::default(), weights)
}

fn eager(weights: Vec<f32>) -> Lifecycle<Counting> {
    let config = LifecycleConfig {
        switching: Switching::Eager,
        ..LifecycleConfig::default()
    };
    Lifecycle::with_config(Counting::default(), weights, config).unwrap()
}

fn counts(lc: &Lifecycle<Counting>) -> (usize, usize) {
    (lc.backend().enters, lc.backend().exits)
}

/// The sum of the weights, scaled.
#[sharded_rollout]
fn weighted_sum(w: RolloutView<'_, Vec<f32>>, scale: f32) -> f32 {
    w.iter().sum::<f32>() * scale
}

/// The first weight, always leaving rollout mode after the call.
#[sharded_rollout(switching = "eager")]
fn first_eager(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

/// The first weight, always keeping the weights resident after the call.
#[sharded_rollout(switching = "lazy")]
fn first_lazy(w: RolloutView<'_, Vec<f32>>) -> f32 {
    w[0]
}

/// A body with its own `Result`, `?` and early `return`, and a pattern parameter.
#[sharded_rollout(weights = view)]
fn weight_at(view: RolloutView<'_, Vec<f32>>, (index, fallback): (usize, f32)) -> Option<f32> {
    if index == usize::MAX {
        return Some(fallback);
    }
    let w = view.as_slice().get(index)?;
    Some(*w)
}

/// Generic over the weights and with a type parameter only in the return type.
#[sharded_rollout]
fn count_as<T: From<u16>, W: AsRef<[f32]>>(w: RolloutView<'_, W>) -> T {
    T::from(w.as_ref().len() as u16)
}

/// Edition 2024: a returned `impl Trait` captures every lifetime in scope, the view's too,
/// unless its `use<..>` lists what it captures; listed, it may outlive the rollout session.
#[sharded_rollout]
fn scaled<'p>(
    prefix: &'p [f32],
    w: RolloutView<'_, Vec<f32>>,
) -> impl Iterator<Item = f32> + use<'p> {
    let s = w[0];
    prefix.iter().map(move |&x| x * s)
}

struct Scaler {
    bias: f32,
}

impl Scaler {
    /// The same as a method with a const parameter, the lifecycle left after each call.
    #[sharded_rollout(switching = "eager")]
    fn scaled<'p, const N: usize>(
        &self,
        prefix: &'p [f32; N],
        w: RolloutView<Vec<f32>>,
    ) -> Option<impl Iterator<Item = f32> + use<'p, N>> {
        let s = w[0] + self.bias;
        Some(prefix.iter().map(move |&x| x * s))
    }
}

#[test]
fn lazy_calls_in_a_row_enter_once() -> TestResult<()> {
    let mut lc = lazy(vec![1.0, 2.0]);
    for _ in 0..5 {
        assert_eq!(weighted_sum(&mut lc, 2.0)?, 6.0);
    }
    assert_eq!(counts(&lc), (1, 0));
    assert_eq!(lc.metrics().reuses, 4);
    assert_eq!(lc.mode(), Mode::Rollout);
    lc.train()?;
    assert_eq!(counts(&lc), (1, 1));
    Ok(())
}

#[test]
fn eager_calls_enter_and_exit_every_time() -> TestResult<()> {
    let mut lc = eager(vec![1.0, 2.0]);
    for n in 1..=4 {
        assert_eq!(weighted_sum(&mut lc, 1.0)?, 3.0);
        assert_eq!(counts(&lc), (n, n));
        assert_eq!(lc.mode(), Mode::Train);
    }
    Ok(())
}

#[test]
fn a_training_update_is_seen_by_the_next_call() -> TestResult<()> {
    let mut lc = lazy(vec![1.0, 2.0]);
    assert_eq!(weighted_sum(&mut lc, 1.0)?, 3.0);
    lc.train()?.state_mut()[0] = 10.0;
    assert_eq!(weighted_sum(&mut lc, 1.0)?, 12.0);
    assert_eq!(weighted_sum(&mut lc, 1.0)?, 12.0);
    lc.train()?.state_mut().push(0.5);
    assert_eq!(weighted_sum(&mut lc, 1.0)?, 12.5);
    assert_eq!(counts(&lc), (3, 2));
    Ok(())
}

#[test]
fn switching_eager_is_forced_on_a_lazy_lifecycle() -> TestResult<()> {
    let mut lc = lazy(vec![4.0]);
    for n in 1..=3 {
        assert_eq!(first_eager(&mut lc)?, 4.0);
        assert_eq!(counts(&lc), (n, n));
        assert_eq!(lc.mode(), Mode::Train);
    }
    // The lifecycle's own policy still applies to other functions.
    weighted_sum(&mut lc, 1.0)?;
    weighted_sum(&mut lc, 1.0)?;
    assert_eq!(counts(&lc), (4, 3));
    Ok(())
}

#[test]
fn switching_lazy_is_forced_on_an_eager_lifecycle() -> TestResult<()> {
    let mut lc = eager(vec![4.0]);
    for _ in 0..3 {
        assert_eq!(first_lazy(&mut lc)?, 4.0);
        assert_eq!(lc.mode(), Mode::Rollout);
    }
    assert_eq!(counts(&lc), (1, 0));
    // No exit was deferred: an inherit-policy call reuses the weights, then exits (eager).
    weighted_sum(&mut lc, 1.0)?;
    assert_eq!(counts(&lc), (1, 1));
    assert_eq!(lc.metrics().reuses, 3);
    Ok(())
}

#[test]
fn bodies_keep_return_question_mark_and_generics() -> TestResult<()> {
    let mut lc = lazy(vec![1.0, 2.0, 3.0]);
    assert_eq!(weight_at(&mut lc, (1, 0.0))?, Some(2.0));
    assert_eq!(weight_at(&mut lc, (7, 0.0))?, None);
    assert_eq!(weight_at(&mut lc, (usize::MAX, 9.0))?, Some(9.0));
    assert_eq!(count_as::<u64, _, _>(&mut lc)?, 3u64);
    let n: f64 = count_as(&mut lc)?;
    assert_eq!(n, 3.0);
    assert_eq!(counts(&lc), (1, 0));
    Ok(())
}

#[test]
fn enter_and_exit_entry_points() -> TestResult<()> {
    let mut lc = lazy(vec![1.0]);
    weighted_sum_enter(&mut lc)?;
    assert_eq!((counts(&lc), lc.mode()), ((1, 0), Mode::Rollout));
    weighted_sum_enter(&mut lc)?; // current weights resident: moves nothing
    weighted_sum(&mut lc, 1.0)?;
    assert_eq!(counts(&lc), (1, 0));
    weighted_sum_exit(&mut lc)?;
    assert_eq!((counts(&lc), lc.mode()), ((1, 1), Mode::Train));
    weighted_sum_exit(&mut lc)?; // nothing resident: no-op
    assert_eq!(counts(&lc), (1, 1));
    // Explicit entry under eager: the next call reuses, then exits.
    let mut lc = eager(vec![1.0]);
    first_lazy_enter(&mut lc)?;
    weighted_sum(&mut lc, 1.0)?;
    assert_eq!(counts(&lc), (1, 1));
    assert_eq!(lc.metrics().reuses, 1);
    Ok(())
}

#[test]
fn a_planning_error_propagates_as_plan() -> TestResult<()> {
    let mut lc = lazy(vec![1.0]);
    lc.train()?.state_mut().clear();
    match weighted_sum(&mut lc, 1.0) {
        Err(LifecycleError::Plan(EmptyWeights)) => {}
        other => panic!("expected a planning error, got {other:?}"),
    }
    assert!(matches!(
        weighted_sum_enter(&mut lc),
        Err(LifecycleError::Plan(EmptyWeights))
    ));
    assert_eq!(counts(&lc), (0, 0));
    assert_eq!(lc.mode(), Mode::Train);
    // Fixing the state makes the next call succeed.
    lc.train()?.state_mut().push(2.0);
    assert_eq!(weighted_sum(&mut lc, 1.0)?, 2.0);
    Ok(())
}

struct Sampler {
    temperature: f32,
    calls: usize,
}

impl Sampler {
    /// Reads the weights with `&self`.
    #[sharded_rollout]
    fn logit(&self, w: RolloutView<'_, Vec<f32>>, token: usize) -> f32 {
        w[token] / self.temperature
    }

    /// Counts its calls with `&mut self`, selecting the view with `#[weights]`.
    #[sharded_rollout(switching = "eager")]
    fn tally(&mut self, #[weights] w: RolloutView<'_, Vec<f32>>) -> usize {
        self.calls += 1;
        w.len()
    }
}

#[test]
fn methods_forward_the_receiver() -> TestResult<()> {
    let mut sampler = Sampler {
        temperature: 2.0,
        calls: 0,
    };
    let mut lc = lazy(vec![1.0, 3.0]);
    assert_eq!(sampler.logit(&mut lc, 1)?, 1.5);
    assert_eq!(sampler.logit(&mut lc, 0)?, 0.5);
    assert_eq!(counts(&lc), (1, 0));
    assert_eq!(sampler.tally(&mut lc)?, 2);
    assert_eq!(sampler.calls, 1);
    assert_eq!(counts(&lc), (1, 1));
    Sampler::logit_enter(&mut lc)?;
    Sampler::logit_exit(&mut lc)?;
    assert_eq!(counts(&lc), (2, 2));
    Ok(())
}

/// Pending once, then ready: makes the async bodies really suspend.
struct YieldOnce(bool);

impl Future for YieldOnce {
    type Output = ();
    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
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

/// An async rollout: the session stays open across the `.await`.
#[sharded_rollout]
async fn generate(w: RolloutView<'_, Vec<f32>>, steps: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for step in 0..steps {
        YieldOnce(false).await;
        out.push(w[step % w.len()]);
    }
    out
}

#[test]
fn async_functions_switch_like_sync_ones() -> TestResult<()> {
    let mut lc = lazy(vec![1.0, 2.0]);
    for _ in 0..3 {
        assert_eq!(block_on(generate(&mut lc, 3))?, vec![1.0, 2.0, 1.0]);
    }
    assert_eq!(counts(&lc), (1, 0));
    lc.train()?.state_mut()[1] = 7.0;
    assert_eq!(block_on(generate(&mut lc, 2))?, vec![1.0, 7.0]);
    assert_eq!(counts(&lc), (2, 1));

    let mut lc = eager(vec![5.0]);
    for n in 1..=3 {
        assert_eq!(block_on(generate(&mut lc, 1))?, vec![5.0]);
        assert_eq!(counts(&lc), (n, n));
    }
    Ok(())
}

#[derive(Debug, Clone)]
enum Op {
    Call,
    Update(f32),
    Train,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Call),
        1 => (-8i8..8).prop_map(|x| Op::Update(f32::from(x))),
        1 => Just(Op::Train),
    ]
}

proptest! {
    /// Under the lazy policy a call enters exactly when the weights changed (or were released)
    /// since the last call, and always returns the current weights.
    #[test]
    fn lazy_calls_enter_only_after_changes(ops in prop::collection::vec(op(), 0..40)) {
        let mut lc = lazy(vec![1.0]);
        let (mut state, mut resident_current, mut enters) = (1.0f32, false, 0usize);
        for op in ops {
            match op {
                Op::Call => {
                    prop_assert_eq!(weighted_sum(&mut lc, 1.0).unwrap(), state);
                    if !resident_current {
                        enters += 1;
                        resident_current = true;
                    }
                }
                Op::Update(x) => {
                    lc.train().unwrap().state_mut()[0] = x;
                    state = x;
                    resident_current = false;
                }
                Op::Train => {
                    lc.train().unwrap();
                    resident_current = false;
                }
            }
            prop_assert_eq!(lc.backend().enters, enters);
            prop_assert_eq!(lc.backend().refreshes, 0);
        }
    }
}

#[test]
fn a_returned_impl_trait_that_lists_its_captures_outlives_the_session() -> TestResult<()> {
    let mut lc = lazy(vec![2.0, 1.0]);
    let prefix = [1.0, 3.0];
    let out = scaled(&mut lc, &prefix)?;
    // the iterator borrows the prefix alone: the lifecycle trains meanwhile
    lc.train()?.state_mut()[0] = 4.0;
    assert_eq!(out.collect::<Vec<_>>(), [2.0, 6.0]);
    let it = Scaler { bias: 0.5 }.scaled(&mut lc, &[2.0])?;
    assert_eq!(lc.mode(), Mode::Train);
    assert_eq!(it.map(Iterator::collect::<Vec<_>>), Some(vec![9.0]));
    Ok(())
}
