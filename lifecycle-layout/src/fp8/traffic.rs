//! What an fp8 rollout costs a rank of a plan against bf16 ([`fp8_rank_traffic`]).

use super::{Fp8Keep, FP8_BLOCK};
use crate::LayoutError;

/// What an fp8 rollout costs one destination rank of a plan, against the same plan in bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fp8Traffic {
    /// Bytes of its rollout weights (fp8 bytes, fp32 scales, bf16 for the exempt tensors).
    pub rollout_bytes: u64,
    /// The same tensors in bf16.
    pub rollout_bytes_bf16: u64,
    /// Bytes it receives from peers (fp8 rows and the scales of blocks it reads from peers).
    pub recv_bytes: u64,
    /// The same in bf16.
    pub recv_bytes_bf16: u64,
    /// Scale blocks of its slices whose rows live on more than one FSDP rank.
    pub shared_blocks: u64,
    /// Bytes of the amax messages those blocks need: each of a block's `k` source ranks sends
    /// its partial amax (4 bytes) to the other `k − 1` before quantising its rows, so the fp8
    /// bytes cross the links already scaled and no bf16 copy of the block is gathered.
    pub amax_bytes: u64,
}

/// The fp8 cost of rank `rank` of `plan` (the tensors `keep` leaves bf16 stay bf16): blocks are the
/// full tensor's 128 × 128 blocks of its 2-D view, so every rank's slice of a quantised tensor
/// must start and end on block boundaries; a split that cuts a block is
/// [`LayoutError::Fp8BlockSplit`], naming the tensor.
///
/// ```
/// use lifecycle_layout::fp8::{fp8_rank_traffic, Fp8Keep};
/// use lifecycle_layout::{plan_fsdp_to_tp, FsdpLayout, Parallel, RolloutLayout, TensorSpec};
/// let specs = vec![TensorSpec::new("model.layers.0.mlp.up_proj.weight", [512, 256], Parallel::Column)];
/// let train = FsdpLayout::new(2, specs.iter().map(|s| (s.name.clone(), s.shape.clone())))?;
/// let plan = plan_fsdp_to_tp(&train, &RolloutLayout::new(2, specs)?)?;
/// let t = fp8_rank_traffic(&plan, 0, Fp8Keep::default())?;
/// // 256 x 256 of fp8 and 2 x 2 scales, against 2 bytes per element
/// assert_eq!((t.rollout_bytes, t.rollout_bytes_bf16), (65536 + 16, 131072));
/// // W = T: each rank's rows are its own FSDP shard, nothing crosses a link
/// assert_eq!(t.recv_bytes, 0);
/// # Ok::<(), lifecycle_layout::LayoutError>(())
/// ```
pub fn fp8_rank_traffic(
    plan: &crate::ReshardPlan,
    rank: usize,
    keep: Fp8Keep,
) -> Result<Fp8Traffic, LayoutError> {
    let mut t = Fp8Traffic::default();
    let Some(rp) = plan.ranks.get(rank) else {
        return Ok(t);
    };
    for tp in &rp.tensors {
        let spec = &plan.tensors[tp.tensor];
        let n = tp.numel() as u64;
        let remote: u64 = tp
            .pieces
            .iter()
            .filter(|p| p.src_rank != rank)
            .map(|p| p.numel() as u64)
            .sum();
        t.rollout_bytes_bf16 += 2 * n;
        t.recv_bytes_bf16 += 2 * remote;
        if keep.keeps_bf16(&spec.name, &spec.shape) {
            t.rollout_bytes += 2 * n;
            t.recv_bytes += 2 * remote;
            continue;
        }
        let (full_rows, full_cols) = (spec.rows(), spec.cols());
        let aligned = |r: &std::ops::Range<usize>, full: usize| {
            r.start.is_multiple_of(FP8_BLOCK) && (r.end.is_multiple_of(FP8_BLOCK) || r.end == full)
        };
        if !aligned(&tp.rows, full_rows) || !aligned(&tp.cols, full_cols) {
            return Err(LayoutError::Fp8BlockSplit {
                name: spec.name.clone(),
                rows: tp.rows.clone(),
                cols: tp.cols.clone(),
            });
        }
        let row_blocks: Vec<std::ops::Range<usize>> = (tp.rows.start..tp.rows.end)
            .step_by(FP8_BLOCK)
            .map(|r| r..(r + FP8_BLOCK).min(tp.rows.end))
            .collect();
        let col_blocks = tp.cols.len().div_ceil(FP8_BLOCK) as u64;
        t.rollout_bytes += n + 4 * row_blocks.len() as u64 * col_blocks;
        t.recv_bytes += remote;
        for rows in &row_blocks {
            let sources: Vec<usize> = tp
                .pieces
                .iter()
                .filter(|p| p.rows.start < rows.end && rows.start < p.rows.end)
                .map(|p| p.src_rank)
                .collect();
            if sources.iter().any(|&s| s != rank) {
                // the block's scale comes from a peer
                t.recv_bytes += 4 * col_blocks;
            }
            let k = sources.len() as u64;
            if k > 1 {
                t.shared_blocks += col_blocks;
                t.amax_bytes += col_blocks * k * (k - 1) * 4;
            }
        }
    }
    Ok(t)
}

/// The plan-time fp8 checks of `plan` (`keep` choosing the bf16 tensors): the layers `keep` names
/// exist ([`Fp8Keep::check_layers`]), and every rank's slice of every quantised tensor starts and
/// ends on 128 × 128 block boundaries ([`LayoutError::Fp8BlockSplit`] otherwise, naming the
/// tensor, from [`fp8_rank_traffic`]).
pub fn check_fp8_plan(plan: &crate::ReshardPlan, keep: Fp8Keep) -> Result<(), LayoutError> {
    keep.check_layers(plan.tensors.iter().map(|t| t.name.as_str()))?;
    for r in 0..plan.world {
        fp8_rank_traffic(plan, r, keep)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(world: usize, tp: usize, shape: [usize; 2]) -> crate::ReshardPlan {
        use crate::{plan_fsdp_to_tp, FsdpLayout, Parallel, RolloutLayout, TensorSpec};
        let specs = vec![TensorSpec::new(
            "model.layers.0.self_attn.q_proj.weight",
            shape,
            Parallel::Column,
        )];
        let train = FsdpLayout::new(
            world,
            specs.iter().map(|s| (s.name.clone(), s.shape.clone())),
        )
        .unwrap();
        plan_fsdp_to_tp(&train, &RolloutLayout::new(tp, specs).unwrap()).unwrap()
    }

    #[test]
    fn blocks_across_fsdp_shards_agree_their_amax_and_split_blocks_are_refused() {
        // W = 3, T = 1, 256 rows: shards 0..86, 86..172, 172..256; blocks 0..128 (ranks 0, 1)
        // and 128..256 (ranks 1, 2) both span two shards
        let p = plan(3, 1, [256, 128]);
        let t = fp8_rank_traffic(&p, 0, Fp8Keep::default()).unwrap();
        assert_eq!(t.shared_blocks, 2);
        assert_eq!(t.amax_bytes, 2 * (2 * 4));
        // rank 0 receives rows 86..256 in fp8 and both scales
        assert_eq!(t.recv_bytes, (256 - 86) * 128 + 2 * 4);
        assert_eq!(t.recv_bytes_bf16, 2 * (256 - 86) * 128);
        // T = 2 over 200 rows: a slice of 100 rows cuts a block
        let err = fp8_rank_traffic(&plan(2, 2, [200, 128]), 1, Fp8Keep::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("q_proj") && err.contains("100..200"), "{err}");
    }

    #[test]
    fn the_plan_check_refuses_a_kept_layer_the_model_lacks() {
        let p = plan(2, 1, [256, 128]);
        assert!(check_fp8_plan(&p, "layer:0".parse().unwrap()).is_ok());
        let err = check_fp8_plan(&p, "attention,layer:1".parse().unwrap()).unwrap_err();
        assert_eq!(
            err,
            LayoutError::Fp8KeepLayer {
                layer: 1,
                layers: 1
            }
        );
        assert!(err
            .to_string()
            .contains("layer:1: the model's decoder layers are numbered 0 to 0"));
    }
}
