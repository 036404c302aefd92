use half::bf16;
use lifecycle_layout::{plan_fsdp_to_tp, HostRollout, RankRollout, RolloutLayout, RolloutTensor};

use lifecycle_state::HostError;
use lifecycle_state::HostTrainState;

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
        .tensors()
        .iter()
        .map(|s| state.full_master(&s.name))
        .collect::<Result<_, _>>()?;
    let ranks = (0..state.world())
        .map(|rank| RankRollout {
            tensors: layout
                .tensors()
                .iter()
                .zip(&full)
                .filter(|(spec, _)| spec.held_by(rank % layout.tp()))
                .map(|(spec, values)| {
                    let (rows, cols) = spec.tp_slice(layout.tp(), rank % layout.tp());
                    let width = spec.cols();
                    let data = rows
                        .flat_map(|r| cols.clone().map(move |c| r * width + c))
                        .map(|i| bf16::from_f32(values[i]))
                        .collect();
                    RolloutTensor {
                        name: spec.name.clone(),
                        shape: spec.slice_shape(layout.tp()),
                        data,
                        fp8: None,
                    }
                })
                .collect(),
        })
        .collect();
    Ok(HostRollout { ranks })
}
