//! A backend written outside the project's crates, against `lifecycle-core`'s public API only:
//! the training state is a set of named fp32 tensors on one device, the rollout weights are int8
//! with one scale per tensor (a stand-in for fp8 rollout weights). The `#[sharded_rollout]`
//! attribute works with it unchanged.
//!
//! ```text
//! cargo run --release --example custom_backend
//! ```

use lifecycle_core::{
    sharded_rollout, Lifecycle, Link, Phase, Reshard, RolloutView, SwitchContext,
};

/// Training state: named fp32 tensors.
#[derive(Debug, Clone)]
struct Fp32Model {
    tensors: Vec<(String, Vec<f32>)>,
}

/// Rollout weights: int8 values and a scale per tensor.
#[derive(Debug)]
struct Int8Weights {
    tensors: Vec<(String, Vec<i8>, f32)>,
}

impl Int8Weights {
    fn dequant(&self, name: &str, i: usize) -> Option<f32> {
        let (_, q, scale) = self.tensors.iter().find(|(n, _, _)| n == name)?;
        Some(*q.get(i)? as f32 * scale)
    }
}

#[derive(Debug, thiserror::Error)]
enum QuantError {
    #[error(
        "tensor `{0}` has a non-finite value at index {1}: int8 quantization needs finite weights"
    )]
    NonFinite(String, usize),
    #[error("tensor `{0}` is empty")]
    Empty(String),
}

/// Quantizes on enter; nothing to offload (one device, small model).
struct Int8Backend;

impl Reshard for Int8Backend {
    type TrainState = Fp32Model;
    type Rollout = Int8Weights;
    type Plan = Vec<f32>; // one scale per tensor
    type Error = QuantError;

    fn plan(&self, state: &Fp32Model) -> Result<Vec<f32>, QuantError> {
        state
            .tensors
            .iter()
            .map(|(name, v)| {
                if v.is_empty() {
                    return Err(QuantError::Empty(name.clone()));
                }
                if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                    return Err(QuantError::NonFinite(name.clone(), i));
                }
                let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
                Ok(if max == 0.0 { 1.0 } else { max / 127.0 })
            })
            .collect()
    }

    fn enter(
        &mut self,
        plan: &Vec<f32>,
        state: &mut Fp32Model,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<Int8Weights, QuantError> {
        let mut out = Int8Weights {
            tensors: Vec::new(),
        };
        self.refresh(plan, state, &mut out, ctx)?;
        Ok(out)
    }

    fn refresh(
        &mut self,
        plan: &Vec<f32>,
        state: &mut Fp32Model,
        out: &mut Int8Weights,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), QuantError> {
        ctx.rec.phase(Phase::Transfer, |scope| {
            out.tensors = state
                .tensors
                .iter()
                .zip(plan)
                .map(|((name, v), &scale)| {
                    scope.add_bytes(Link::Local, v.len() as u64);
                    (
                        name.clone(),
                        v.iter().map(|x| (x / scale).round() as i8).collect(),
                        scale,
                    )
                })
                .collect();
            Ok(())
        })
    }

    fn exit(
        &mut self,
        _state: &mut Fp32Model,
        rollout: Option<Int8Weights>,
        ctx: &mut SwitchContext<'_>,
    ) -> Result<(), QuantError> {
        ctx.rec.phase(Phase::Release, |_| {
            drop(rollout);
            Ok(())
        })
    }
}

/// A "rollout": reads a few dequantized weights.
#[sharded_rollout]
fn score(weights: RolloutView<'_, Int8Weights>, name: &str) -> f32 {
    (0..4).filter_map(|i| weights.dequant(name, i)).sum()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = Fp32Model {
        tensors: vec![
            ("w".into(), vec![0.5, -1.0, 0.25, 2.0]),
            ("b".into(), vec![0.1; 4]),
        ],
    };
    let mut lc = Lifecycle::new(Int8Backend, model);
    for call in 0..3 {
        println!("call {call}: score(w) = {:.4}", score(&mut lc, "w")?);
    }
    lc.train()?.state_mut().tensors[0].1[3] = -2.0;
    println!("after update: score(w) = {:.4}", score(&mut lc, "w")?);
    println!("{}", lc.metrics().summary_line());
    assert_eq!(
        lc.metrics().enters,
        2,
        "3 calls on one version cost one enter"
    );
    Ok(())
}
