use std::collections::HashMap;
use std::ops::Range;

use crate::spec::{FsdpLayout, Parallel, RolloutLayout, TensorSpec};
use crate::LayoutError;

/// A rectangle of one tensor (rows × columns of its 2-D view) that one source rank holds and one
/// destination rank needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The training rank holding these rows.
    pub src_rank: usize,
    /// Rows of the full tensor.
    pub rows: Range<usize>,
    /// Columns of the full tensor's 2-D view.
    pub cols: Range<usize>,
}

impl Piece {
    /// Elements in the piece.
    pub fn numel(&self) -> usize {
        self.rows.len() * self.cols.len()
    }
}

/// What one destination rank builds for one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorPlan {
    /// Index into [`ReshardPlan::tensors`] (the rollout layout's order).
    pub tensor: usize,
    /// Index of the tensor in the training state.
    pub train_index: usize,
    /// Rows of the full tensor this rank's slice covers.
    pub rows: Range<usize>,
    /// Columns of the full tensor's 2-D view this rank's slice covers.
    pub cols: Range<usize>,
    /// Shape of the slice.
    pub shape: Vec<usize>,
    /// Where the slice's rows come from, in row order; together they cover the slice exactly.
    pub pieces: Vec<Piece>,
}

impl TensorPlan {
    /// Elements of the slice.
    pub fn numel(&self) -> usize {
        self.rows.len() * self.cols.len()
    }

    /// Element offset of (`row`, `col`) of the full tensor inside this slice.
    pub fn dst_offset(&self, row: usize, col: usize) -> usize {
        (row - self.rows.start) * self.cols.len() + (col - self.cols.start)
    }
}

/// Everything one destination rank builds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlan {
    /// The rank.
    pub rank: usize,
    /// Its tensor-parallel rank in the rollout layout (`rank mod T`).
    pub tp_rank: usize,
    /// One entry per rollout tensor this rank holds (all of them, except the
    /// [`Parallel::Owned`] tensors of other TP ranks), in rollout order.
    pub tensors: Vec<TensorPlan>,
}

impl RankPlan {
    /// Elements this rank receives from other ranks.
    pub fn remote_elements(&self) -> usize {
        self.pieces()
            .filter(|p| p.src_rank != self.rank)
            .map(Piece::numel)
            .sum()
    }

    /// Elements this rank copies from its own shards.
    pub fn local_elements(&self) -> usize {
        self.pieces()
            .filter(|p| p.src_rank == self.rank)
            .map(Piece::numel)
            .sum()
    }

    /// Elements of all this rank's rollout tensors.
    pub fn total_elements(&self) -> usize {
        self.tensors.iter().map(TensorPlan::numel).sum()
    }

    fn pieces(&self) -> impl Iterator<Item = &Piece> {
        self.tensors.iter().flat_map(|t| t.pieces.iter())
    }
}

/// The validated plan from FSDP training shards to the tensor-parallel rollout layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReshardPlan {
    /// W.
    pub world: usize,
    /// T.
    pub tp: usize,
    /// Rollout tensors, in rollout order.
    pub tensors: Vec<TensorSpec>,
    /// One plan per destination rank, indexed by rank.
    pub ranks: Vec<RankPlan>,
}

impl ReshardPlan {
    /// Elements received from other ranks, summed over ranks.
    pub fn remote_elements(&self) -> usize {
        self.ranks.iter().map(RankPlan::remote_elements).sum()
    }

    /// Elements copied locally, summed over ranks.
    pub fn local_elements(&self) -> usize {
        self.ranks.iter().map(RankPlan::local_elements).sum()
    }
}

/// Plans the move from the FSDP training layout to the TP rollout layout.
///
/// Checks (each an error naming the tensor): `T` divides `W`; every rollout tensor exists in the
/// training state with the same shape; no training tensor is left unplaced; split dims divide by
/// `T` (already checked by [`RolloutLayout::new`]).
pub fn plan_fsdp_to_tp(
    train: &FsdpLayout,
    rollout: &RolloutLayout,
) -> Result<ReshardPlan, LayoutError> {
    let (world, tp) = (train.world(), rollout.tp());
    if rollout.format() != crate::RolloutFormat::Unfused {
        return Err(LayoutError::FusedLayout);
    }
    if world == 0 {
        return Err(LayoutError::ZeroDegree {
            what: "world size W",
        });
    }
    if tp == 0 {
        return Err(LayoutError::ZeroDegree {
            what: "rollout tensor-parallel degree T",
        });
    }
    if world % tp != 0 {
        let divisors: Vec<String> = (1..=world)
            .filter(|d| world % d == 0)
            .map(|d| d.to_string())
            .collect();
        return Err(LayoutError::TpNotDividingWorld {
            tp,
            world,
            divisors: divisors.join(", "),
        });
    }
    let train_index: HashMap<&str, usize> = train
        .tensors()
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (n.as_str(), i))
        .collect();
    let mut placed = vec![false; train.tensors().len()];
    let mut sources = Vec::with_capacity(rollout.tensors().len());
    for spec in rollout.tensors() {
        let Some(&i) = train_index.get(spec.name.as_str()) else {
            return Err(LayoutError::MissingTensor {
                name: spec.name.clone(),
            });
        };
        let train_shape = &train.tensors()[i].1;
        if *train_shape != spec.shape {
            return Err(LayoutError::ShapeMismatch {
                name: spec.name.clone(),
                train: train_shape.clone(),
                rollout: spec.shape.clone(),
            });
        }
        placed[i] = true;
        sources.push(i);
    }
    if let Some(i) = placed.iter().position(|p| !p) {
        return Err(LayoutError::ExtraTensor {
            name: train.tensors()[i].0.clone(),
        });
    }

    let ranks = (0..world)
        .map(|rank| {
            let tp_rank = rank % tp;
            let tensors = rollout
                .tensors()
                .iter()
                .zip(&sources)
                .enumerate()
                .filter(|(_, (spec, _))| spec.held_by(tp_rank))
                .map(|(tensor, (spec, &train_index))| {
                    plan_tensor(spec, tensor, train_index, world, tp, tp_rank)
                })
                .collect();
            RankPlan {
                rank,
                tp_rank,
                tensors,
            }
        })
        .collect();
    Ok(ReshardPlan {
        world,
        tp,
        tensors: rollout.tensors().to_vec(),
        ranks,
    })
}

fn plan_tensor(
    spec: &TensorSpec,
    tensor: usize,
    train_index: usize,
    world: usize,
    tp: usize,
    tp_rank: usize,
) -> TensorPlan {
    let (rows, cols) = spec.tp_slice(tp, tp_rank);
    let pieces = (0..world)
        .filter_map(|src| {
            let held = super::fsdp_rows(spec.rows(), world, src);
            let start = held.start.max(rows.start);
            let end = held.end.min(rows.end);
            (start < end).then(|| Piece {
                src_rank: src,
                rows: start..end,
                cols: cols.clone(),
            })
        })
        .collect();
    let shape = match spec.parallel {
        Parallel::Replicated | Parallel::Owned { .. } => spec.shape.clone(),
        _ => spec.slice_shape(tp),
    };
    TensorPlan {
        tensor,
        train_index,
        rows,
        cols,
        shape,
        pieces,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TensorSpec;

    fn layouts(
        world: usize,
        tp: usize,
        specs: Vec<TensorSpec>,
    ) -> Result<ReshardPlan, LayoutError> {
        let train = FsdpLayout::new(
            world,
            specs.iter().map(|s| (s.name.clone(), s.shape.clone())),
        )?;
        let rollout = RolloutLayout::new(tp, specs)?;
        plan_fsdp_to_tp(&train, &rollout)
    }

    #[test]
    fn pieces_tile_every_slice_exactly() {
        for world in [1, 2, 3, 4, 8] {
            for tp in (1..=world).filter(|t| world % t == 0) {
                let specs = vec![
                    TensorSpec::new("col", [8 * tp, 3], Parallel::Column),
                    TensorSpec::new("row", [7, 2 * tp], Parallel::Row),
                    TensorSpec::new("rep", [5], Parallel::Replicated),
                    TensorSpec::new("col3d", [tp, 3, 2], Parallel::Column),
                ];
                let plan = layouts(world, tp, specs).unwrap();
                for rank in &plan.ranks {
                    for t in &rank.tensors {
                        let covered: usize = t.pieces.iter().map(Piece::numel).sum();
                        assert_eq!(covered, t.numel());
                        let mut next = t.rows.start;
                        for p in &t.pieces {
                            assert_eq!(p.rows.start, next);
                            next = p.rows.end;
                            assert_eq!(p.cols, t.cols);
                        }
                        assert_eq!(next, t.rows.end);
                        assert_eq!(t.shape.iter().product::<usize>(), t.numel());
                    }
                }
            }
        }
    }

    #[test]
    fn column_slice_is_own_shard_when_w_equals_t() {
        let plan = layouts(2, 2, vec![TensorSpec::new("w", [8, 4], Parallel::Column)]).unwrap();
        assert_eq!(plan.remote_elements(), 0);
        let plan = layouts(2, 2, vec![TensorSpec::new("w", [8, 4], Parallel::Row)]).unwrap();
        // each rank needs half its columns from the peer's rows: a quarter of the tensor.
        assert_eq!(plan.ranks[0].remote_elements(), 8);
    }

    #[test]
    fn errors_name_the_tensor() {
        let err = layouts(4, 3, vec![TensorSpec::new("w", [6, 4], Parallel::Column)]).unwrap_err();
        assert!(err.to_string().contains("1, 2, 4"), "{err}");
        let err = layouts(2, 2, vec![TensorSpec::new("w", [5, 4], Parallel::Column)]).unwrap_err();
        assert!(err.to_string().contains("`w`"), "{err}");
        let train = FsdpLayout::new(2, [("a".to_string(), vec![2, 2])]).unwrap();
        let rollout =
            RolloutLayout::new(1, vec![TensorSpec::new("b", [2, 2], Parallel::Column)]).unwrap();
        let err = plan_fsdp_to_tp(&train, &rollout).unwrap_err();
        assert_eq!(err, LayoutError::MissingTensor { name: "b".into() });
        let rollout =
            RolloutLayout::new(1, vec![TensorSpec::new("a", [2, 3], Parallel::Column)]).unwrap();
        assert!(matches!(
            plan_fsdp_to_tp(&train, &rollout),
            Err(LayoutError::ShapeMismatch { .. })
        ));
    }
}
