//! Bad input gets a typed error whose text names the tensor (or argument) and the fix, and leaves
//! the training state untouched: nothing moves before validation passes.

use crate::common;

use half::bf16;
use lifecycle_core::{Lifecycle, LifecycleError, Mode};
use lifecycle_host::{HostBackend, HostError, HostTrainState};
use lifecycle_layout::{HostTensor, TensorData};
use lifecycle_layout::{LayoutError, Parallel, RolloutLayout, TensorSpec};

fn assert_mentions(err: &dyn std::error::Error, needles: &[&str]) {
    let text = err.to_string();
    for n in needles {
        assert!(
            text.contains(n),
            "error text {text:?} does not mention {n:?}"
        );
    }
}

/// Runs a rollout on a lifecycle whose layout is bad; checks the error and that nothing moved.
fn rollout_fails(
    world: usize,
    train_specs: &[TensorSpec],
    layout: RolloutLayout,
) -> LifecycleError<HostError> {
    let state = common::state(world, train_specs, 1);
    let before = state.snapshot();
    let mut lc = Lifecycle::new(HostBackend::new(layout), state);
    let err = lc.rollout().map(|_| ()).unwrap_err();
    assert!(matches!(err, LifecycleError::Plan(_)), "{err}");
    assert_eq!(lc.mode(), Mode::Train);
    assert_eq!(lc.metrics().bytes().moved() + lc.metrics().bytes().local, 0);
    assert!(!lc.peek_state().is_offloaded());
    assert_eq!(
        lc.train().unwrap().state().snapshot(),
        before,
        "training state changed"
    );
    err
}

#[test]
fn data_length_not_matching_shape() {
    let err =
        HostTrainState::from_tensors(2, vec![HostTensor::f32("model.w", [3, 5], vec![0.0; 12])])
            .unwrap_err();
    assert_eq!(
        err,
        HostError::ElementCount {
            name: "model.w".into(),
            shape: vec![3, 5],
            expected: 15,
            found: 12
        }
    );
    assert_mentions(&err, &["`model.w`", "12 elements", "[3, 5]", "15"]);
}

#[test]
fn integer_dtype_is_rejected() {
    let err = HostTrainState::from_tensors(
        2,
        vec![HostTensor {
            name: "ids".into(),
            shape: vec![4],
            data: TensorData::I64(vec![1, 2, 3, 4]),
        }],
    )
    .unwrap_err();
    assert_mentions(&err, &["`ids`", "i64", "floating point"]);
}

#[test]
fn bf16_input_is_accepted_exactly() {
    let data: Vec<bf16> = [1.5f32, -2.25, 3.0, 0.125]
        .iter()
        .map(|&x| bf16::from_f32(x))
        .collect();
    let state = HostTrainState::from_tensors(
        1,
        vec![HostTensor {
            name: "w".into(),
            shape: vec![2, 2],
            data: TensorData::BF16(data),
        }],
    )
    .unwrap();
    assert_eq!(
        state.full_master("w").unwrap(),
        vec![1.5, -2.25, 3.0, 0.125]
    );
}

#[test]
fn duplicate_name() {
    let err = HostTrainState::from_tensors(
        2,
        vec![
            HostTensor::f32("w", [2], vec![0.0; 2]),
            HostTensor::f32("w", [2], vec![0.0; 2]),
        ],
    )
    .unwrap_err();
    assert_mentions(&err, &["`w`", "twice", "unique"]);
    let err = RolloutLayout::new(
        1,
        vec![
            TensorSpec::new("w", [2], Parallel::Replicated),
            TensorSpec::new("w", [2], Parallel::Replicated),
        ],
    )
    .unwrap_err();
    assert_mentions(&err, &["`w`", "twice", "rollout layout"]);
}

#[test]
fn zero_sized_tensor_and_zero_world() {
    let err =
        HostTrainState::from_tensors(2, vec![HostTensor::f32("w", [0, 4], vec![])]).unwrap_err();
    assert_mentions(&err, &["`w`", "[0, 4]", "at least 1"]);
    let err =
        HostTrainState::from_tensors(0, vec![HostTensor::f32("w", [1], vec![0.0])]).unwrap_err();
    assert_mentions(&err, &["world size W", "at least 1"]);
}

#[test]
fn tp_not_dividing_world() {
    let specs = common::specs(3);
    let err = rollout_fails(4, &specs, common::layout(3, specs.clone()));
    assert_mentions(&err, &["T = 3", "W = 4", "1, 2, 4"]);
}

#[test]
fn column_split_not_divisible() {
    let err = RolloutLayout::new(
        2,
        vec![TensorSpec::new("lm_head.weight", [5, 4], Parallel::Column)],
    )
    .unwrap_err();
    assert!(matches!(
        err,
        LayoutError::NotDivisible {
            dim: 0,
            size: 5,
            t: 2,
            ..
        }
    ));
    assert_mentions(
        &err,
        &["`lm_head.weight`", "column-parallel", "T = 2", "replicated"],
    );
}

#[test]
fn row_parallel_must_be_2d_and_divisible() {
    let err =
        RolloutLayout::new(2, vec![TensorSpec::new("o", [4, 2, 2], Parallel::Row)]).unwrap_err();
    assert_mentions(&err, &["`o`", "2-D"]);
    let err = RolloutLayout::new(4, vec![TensorSpec::new("o", [4, 6], Parallel::Row)]).unwrap_err();
    assert_mentions(&err, &["`o`", "dim 1 = 6", "T = 4"]);
}

#[test]
fn missing_tensor() {
    let train = common::specs(2);
    let mut wanted = train.clone();
    wanted.push(TensorSpec::new(
        "model.lm_head.weight",
        [8, 6],
        Parallel::Column,
    ));
    let err = rollout_fails(2, &train, common::layout(2, wanted));
    assert_mentions(
        &err,
        &["`model.lm_head.weight`", "missing from the training state"],
    );
}

#[test]
fn extra_tensor() {
    let mut train = common::specs(2);
    train.push(TensorSpec::new("value_head", [4, 6], Parallel::Column));
    let err = rollout_fails(2, &train, common::layout(2, common::specs(2)));
    assert_mentions(&err, &["`value_head`", "no place in the rollout layout"]);
}

#[test]
fn shape_mismatch_between_layouts() {
    let train = common::specs(2);
    let mut wanted = train.clone();
    wanted[1].shape = vec![8, 7];
    let err = rollout_fails(2, &train, common::layout(2, wanted));
    assert_mentions(&err, &["`q`", "[6, 7]", "[8, 7]"]);
}

#[test]
fn updating_while_offloaded_is_refused() {
    let specs = common::specs(1);
    let mut state = common::state(1, &specs, 2);
    let backend = HostBackend::new(common::layout(1, specs));
    let mut lc = Lifecycle::new(backend, state.clone());
    lc.enter().unwrap();
    // a clone of an offloaded state cannot be updated either: the error says how to get back
    let offloaded = lc.peek_state().clone();
    let mut offloaded = offloaded;
    let err = offloaded.for_each_shard_mut(|_| {}).unwrap_err();
    assert_mentions(&err, &["offloaded", "lifecycle.train()"]);
    state.for_each_shard_mut(|_| {}).unwrap();
}

#[test]
fn a_layout_cannot_take_a_degree_its_tensors_do_not_split_at() {
    let head = TensorSpec::new("lm_head.weight", [1001, 8], Parallel::Column);
    let layout = RolloutLayout::new(1, vec![head]).unwrap();
    // The only way to another degree checks the tensors again.
    let err = layout.with_tp(2).unwrap_err();
    assert!(matches!(err, LayoutError::NotDivisible { .. }), "{err}");
    assert_mentions(&err, &["lm_head.weight", "1001"]);
    assert_eq!(layout.tp(), 1);
}
