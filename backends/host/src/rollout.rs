use half::bf16;
use lifecycle_layout::{plan_fsdp_to_tp, RolloutLayout};

use crate::error::HostError;
use crate::state::HostTrainState;

/// One rollout tensor slice of one rank, in bf16.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutTensor {
    /// Name (as in the rollout layout).
    pub name: String,
    /// Shape of this rank's slice.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<bf16>,
}

/// The rollout weights of one rank, in rollout-layout order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RankRollout {
    /// One slice per rollout tensor.
    pub tensors: Vec<RolloutTensor>,
}

impl RankRollout {
    /// A slice by name.
    pub fn tensor(&self, name: &str) -> Option<&RolloutTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Bytes of all slices.
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(|t| (t.data.len() * 2) as u64).sum()
    }
}

/// Rollout weights of every rank.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HostRollout {
    /// Indexed by rank.
    pub ranks: Vec<RankRollout>,
}

impl HostRollout {
    /// Index of the first tensor whose bits differ between `self` and `other`, with its rank and
    /// name, or `None` if they are bit-identical.
    pub fn first_difference(&self, other: &HostRollout) -> Option<(usize, String)> {
        if self.ranks.len() != other.ranks.len() {
            return Some((
                self.ranks.len().min(other.ranks.len()),
                "<rank count>".into(),
            ));
        }
        for (rank, (a, b)) in self.ranks.iter().zip(&other.ranks).enumerate() {
            if a.tensors.len() != b.tensors.len() {
                return Some((rank, "<tensor count>".into()));
            }
            for (x, y) in a.tensors.iter().zip(&b.tensors) {
                let same = x.name == y.name
                    && x.shape == y.shape
                    && x.data.len() == y.data.len()
                    && x.data
                        .iter()
                        .zip(&y.data)
                        .all(|(p, q)| p.to_bits() == q.to_bits());
                if !same {
                    return Some((rank, x.name.clone()));
                }
            }
        }
        None
    }
}

/// Rollout weights built the direct way: gather each full fp32 tensor, slice rank `r`'s TP part
/// (`r mod T`), round to bf16. Independent of the transfer plan; the reference every backend is
/// checked against.
pub fn reference_rollout(
    state: &HostTrainState,
    layout: &RolloutLayout,
) -> Result<HostRollout, HostError> {
    // Validation only: the same errors the backends report.
    plan_fsdp_to_tp(state.layout(), layout)?;
    let full: Vec<Vec<f32>> = layout
        .tensors
        .iter()
        .map(|s| state.full_master(&s.name))
        .collect::<Result<_, _>>()?;
    let ranks = (0..state.world())
        .map(|rank| RankRollout {
            tensors: layout
                .tensors
                .iter()
                .zip(&full)
                .map(|(spec, values)| {
                    let (rows, cols) = spec.tp_slice(layout.tp, rank % layout.tp);
                    let width = spec.cols();
                    let data = rows
                        .flat_map(|r| cols.clone().map(move |c| r * width + c))
                        .map(|i| bf16::from_f32(values[i]))
                        .collect();
                    RolloutTensor {
                        name: spec.name.clone(),
                        shape: spec.slice_shape(layout.tp),
                        data,
                    }
                })
                .collect(),
        })
        .collect();
    Ok(HostRollout { ranks })
}
