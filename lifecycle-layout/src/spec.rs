use std::collections::HashSet;
use std::fmt;
use std::ops::Range;

use crate::LayoutError;

/// Element types a training state may be built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16.
    BF16,
    /// IEEE binary16.
    F16,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// Unsigned byte.
    U8,
    /// Boolean.
    Bool,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
            DType::U8 | DType::Bool => 1,
        }
    }

    /// Whether weights of this type can be trained (floating point).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::U8 => "u8",
            DType::Bool => "bool",
        })
    }
}

/// How a tensor is split in the rollout layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Parallel {
    /// Split on dim 0 (q/k/v, gate/up, vocabulary-parallel embedding and head, their biases).
    Column,
    /// Split on dim 1 (attention output and MLP down projections); 2-D only.
    Row,
    /// Whole on every rank (norms, small tensors).
    Replicated,
    /// Whole on TP rank `rank` only (of every replica), absent from the others: the experts
    /// of a mixture-of-experts layer partitioned over the rollout ranks (expert parallelism).
    Owned {
        /// The TP rank that holds the tensor.
        rank: usize,
    },
}

impl Parallel {
    /// Human name used in messages.
    pub fn name(self) -> &'static str {
        match self {
            Parallel::Column => "column-parallel",
            Parallel::Row => "row-parallel",
            Parallel::Replicated => "replicated",
            Parallel::Owned { .. } => "owned by one rank",
        }
    }

    /// Whether `self` and `other` are the same kind of split (the owner rank of
    /// [`Parallel::Owned`] aside).
    pub fn same_kind(self, other: Parallel) -> bool {
        std::mem::discriminant(&self) == std::mem::discriminant(&other)
    }

    /// The usual split of a Hugging Face Qwen2 / Llama parameter name: q/k/v, gate/up, embedding and
    /// head column-parallel; o/down row-parallel; everything else (norms) replicated.
    pub fn for_hf_name(name: &str) -> Parallel {
        const COLUMN: [&str; 7] = [
            "q_proj",
            "k_proj",
            "v_proj",
            "gate_proj",
            "up_proj",
            "embed_tokens",
            "lm_head",
        ];
        const ROW: [&str; 2] = ["o_proj", "down_proj"];
        let parts: Vec<&str> = name.split('.').collect();
        if parts.iter().any(|p| ROW.contains(p)) && name.ends_with("weight") {
            Parallel::Row
        } else if parts.iter().any(|p| COLUMN.contains(p)) {
            Parallel::Column
        } else {
            Parallel::Replicated
        }
    }
}

impl fmt::Display for Parallel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor of the rollout layout: its name, full shape and split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Unique name (Hugging Face parameter names where they apply).
    pub name: String,
    /// Full (unsharded) shape.
    pub shape: Vec<usize>,
    /// Split in the rollout layout.
    pub parallel: Parallel,
}

impl TensorSpec {
    /// A spec from its parts.
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<usize>>, parallel: Parallel) -> Self {
        TensorSpec {
            name: name.into(),
            shape: shape.into(),
            parallel,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size of dim 0 (rows of the 2-D view).
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }

    /// Product of the trailing dims (columns of the 2-D view).
    pub fn cols(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    /// Shape of TP rank `tp_rank`'s slice for degree `t` (the spec must be validated for `t`).
    pub fn slice_shape(&self, t: usize) -> Vec<usize> {
        let mut shape = self.shape.clone();
        match self.parallel {
            Parallel::Column => shape[0] /= t,
            Parallel::Row => shape[1] /= t,
            Parallel::Replicated | Parallel::Owned { .. } => {}
        }
        shape
    }

    /// Whether TP rank `tp_rank` holds (a slice of) this tensor: every rank does, except for
    /// [`Parallel::Owned`] tensors, which only their owner holds.
    pub fn held_by(&self, tp_rank: usize) -> bool {
        match self.parallel {
            Parallel::Owned { rank } => rank == tp_rank,
            _ => true,
        }
    }

    /// Rows and columns (of the 2-D view) that TP rank `tp_rank` holds at degree `t`.
    pub fn tp_slice(&self, t: usize, tp_rank: usize) -> (Range<usize>, Range<usize>) {
        match self.parallel {
            Parallel::Column => (tp_range(self.rows(), t, tp_rank), 0..self.cols()),
            Parallel::Row => (0..self.rows(), tp_range(self.cols(), t, tp_rank)),
            Parallel::Replicated | Parallel::Owned { .. } => (0..self.rows(), 0..self.cols()),
        }
    }
}

/// Rows that FSDP rank `rank` of `world` holds of a dim of size `n`, by PyTorch FSDP2's rule:
/// `[r·c, min((r+1)·c, n))` with `c = ⌈n / W⌉` (trailing ranks may hold fewer rows or none).
///
/// ```
/// use lifecycle_layout::fsdp_rows;
/// assert_eq!(fsdp_rows(5, 4, 0), 0..2);
/// assert_eq!(fsdp_rows(5, 4, 2), 4..5);
/// assert_eq!(fsdp_rows(5, 4, 3), 5..5);
/// ```
pub fn fsdp_rows(n: usize, world: usize, rank: usize) -> Range<usize> {
    let c = n.div_ceil(world);
    let start = (rank * c).min(n);
    let end = ((rank + 1) * c).min(n);
    start..end
}

/// The even part `tp_rank` of `t` of a dim of size `n` (`t` must divide `n`).
pub fn tp_range(n: usize, t: usize, tp_rank: usize) -> Range<usize> {
    let part = n / t;
    tp_rank * part..(tp_rank + 1) * part
}

/// The training layout: every tensor split on dim 0 across `world` ranks (FSDP2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsdpLayout {
    world: usize,
    tensors: Vec<(String, Vec<usize>)>,
}

impl FsdpLayout {
    /// Checks names are unique and non-empty, shapes non-empty, `world ≥ 1`.
    pub fn new(
        world: usize,
        tensors: impl IntoIterator<Item = (String, Vec<usize>)>,
    ) -> Result<Self, LayoutError> {
        if world == 0 {
            return Err(LayoutError::ZeroDegree {
                what: "world size W",
            });
        }
        let tensors: Vec<_> = tensors.into_iter().collect();
        check_names(
            tensors.iter().map(|(n, s)| (n.as_str(), s.as_slice())),
            "training state",
        )?;
        Ok(FsdpLayout { world, tensors })
    }

    /// W: number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Tensors in training order: name and full shape.
    pub fn tensors(&self) -> &[(String, Vec<usize>)] {
        &self.tensors
    }

    /// Rows of tensor dim 0 that `rank` holds.
    pub fn shard_rows(&self, tensor: usize, rank: usize) -> Range<usize> {
        let rows = self.tensors[tensor].1.first().copied().unwrap_or(1);
        fsdp_rows(rows, self.world, rank)
    }
}

/// How a rollout layout places the experts of a mixture-of-experts model.
///
/// ```
/// use lifecycle_layout::{ExpertPlacement, ModelSpec, Parallel, RolloutLayout};
/// let m = ModelSpec::tiny_moe(); // 4 experts in layer 1
/// let specs = RolloutLayout::from_hf_names(1, m.hf_tensors())?.tensors().to_vec();
/// let ep = ExpertPlacement::Partitioned.apply(specs, 4, 2)?;
/// let owner = |n: &str| ep.iter().find(|t| t.name == n).unwrap().parallel;
/// assert_eq!(owner("model.layers.1.mlp.experts.1.up_proj.weight"), Parallel::Owned { rank: 0 });
/// assert_eq!(owner("model.layers.1.mlp.experts.2.down_proj.weight"), Parallel::Owned { rank: 1 });
/// assert_eq!(owner("model.layers.1.mlp.gate.weight"), Parallel::Replicated);
/// // 4 experts do not partition over 3 ranks
/// assert!(ExpertPlacement::Partitioned.apply(ep.clone(), 4, 3).is_err());
/// # Ok::<(), lifecycle_layout::LayoutError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertPlacement {
    /// Every expert split by tensor parallelism like a dense MLP (gate and up column-parallel,
    /// down row-parallel): each rank holds `1/T` of every expert (vLLM's default).
    #[default]
    TensorParallel,
    /// The experts partitioned over the rollout ranks (expert parallelism, EP = T): rank `r`
    /// holds experts `[r·E/T, (r+1)·E/T)` whole ([`Parallel::Owned`]) and none of the others.
    Partitioned,
}

impl std::str::FromStr for ExpertPlacement {
    type Err = String;

    /// `tp` or `ep`, as [`ExpertPlacement::name`] writes them (command lines).
    ///
    /// ```
    /// use lifecycle_layout::ExpertPlacement;
    /// assert_eq!("ep".parse::<ExpertPlacement>(), Ok(ExpertPlacement::Partitioned));
    /// assert!("both".parse::<ExpertPlacement>().unwrap_err().contains("tp or ep"));
    /// ```
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tp" => Ok(ExpertPlacement::TensorParallel),
            "ep" => Ok(ExpertPlacement::Partitioned),
            other => Err(format!("`{other}`: expected tp or ep")),
        }
    }
}

impl ExpertPlacement {
    /// Its name in messages and on command lines (`tp`, `ep`).
    pub fn name(self) -> &'static str {
        match self {
            ExpertPlacement::TensorParallel => "tp",
            ExpertPlacement::Partitioned => "ep",
        }
    }

    /// `specs` with the per-expert tensors (`model.layers.{l}.mlp.experts.{e}.…`) placed:
    /// unchanged for [`ExpertPlacement::TensorParallel`]; owned by rank `e / (E/T)` for
    /// [`ExpertPlacement::Partitioned`], which needs `T` to divide the `experts` per layer.
    pub fn apply(
        self,
        mut specs: Vec<TensorSpec>,
        experts: usize,
        tp: usize,
    ) -> Result<Vec<TensorSpec>, LayoutError> {
        if self == ExpertPlacement::TensorParallel {
            return Ok(specs);
        }
        if tp == 0 {
            return Err(LayoutError::ZeroDegree {
                what: "rollout tensor-parallel degree T",
            });
        }
        for spec in &mut specs {
            if let Some((layer, e)) = crate::hf::parse_expert(&spec.name) {
                if experts == 0 || !experts.is_multiple_of(tp) || e >= experts {
                    return Err(LayoutError::ExpertsNotDivisible {
                        layer,
                        experts,
                        t: tp,
                    });
                }
                spec.parallel = Parallel::Owned {
                    rank: e / (experts / tp),
                };
            }
        }
        Ok(specs)
    }
}

/// How the rollout side sizes the vocabulary of the embedding and the output layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RolloutVocab {
    /// Exactly `vocab` rows, split `T` ways (T must divide the vocabulary).
    #[default]
    Unpadded,
    /// Padded to a multiple of `multiple × T` (as Megatron pads), padding rows zero.
    PadToMultipleOf(usize),
}

/// How a rollout layout names and cuts its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RolloutFormat {
    /// One rollout tensor per training tensor, with its name, cut by its [`Parallel`] split
    /// (what the FSDP executors produce).
    #[default]
    Unfused,
    /// Fused as inference engines hold them (vLLM / SGLang): `qkv_proj` = `[q; k; v]` of the
    /// rank, `gate_up_proj` = `[gate; up]`, the vocabulary sized by a [`RolloutVocab`] (what the
    /// Megatron executors produce; the tensors follow from the model:
    /// [`RolloutLayout::fused_tensors`]).
    Fused,
}

/// The rollout layout: tensor parallel of degree `tp` over the listed tensors. Its fields are
/// read-only: what [`RolloutLayout::new`] checked (every split divisible by T) holds for as long
/// as the layout lives.
///
/// ```
/// use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};
/// let layout = RolloutLayout::new(1, vec![TensorSpec::new("lm_head.weight", [1001, 8], Parallel::Column)])?;
/// assert_eq!(layout.tp(), 1);
/// // The same tensors at T = 2 are refused: 1001 rows do not split in two.
/// assert!(RolloutLayout::new(2, layout.tensors().to_vec()).is_err());
/// # Ok::<(), lifecycle_layout::LayoutError>(())
/// ```
///
/// A checked layout cannot be changed afterwards (a layout valid at T = 1 given T = 2 would split
/// 1001 rows into two 500-row slices): its fields are private (E0616, the compiler-errors page).
///
/// ```compile_fail,E0616
/// use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};
/// let mut layout =
///     RolloutLayout::new(1, vec![TensorSpec::new("lm_head.weight", [1001, 8], Parallel::Column)])
///         .unwrap();
/// layout.tp = 2;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutLayout {
    tp: usize,
    format: RolloutFormat,
    vocab: RolloutVocab,
    experts: ExpertPlacement,
    tensors: Vec<TensorSpec>,
}

impl RolloutLayout {
    /// Checks names, shapes and that every split dim is divisible by `tp`.
    pub fn new(tp: usize, tensors: Vec<TensorSpec>) -> Result<Self, LayoutError> {
        if tp == 0 {
            return Err(LayoutError::ZeroDegree {
                what: "rollout tensor-parallel degree T",
            });
        }
        check_names(
            tensors
                .iter()
                .map(|t| (t.name.as_str(), t.shape.as_slice())),
            "rollout layout",
        )?;
        for t in &tensors {
            let (dim, size) = match t.parallel {
                Parallel::Replicated => continue,
                Parallel::Owned { rank } if rank < tp => continue,
                Parallel::Owned { rank } => {
                    return Err(LayoutError::OwnerOutOfRange {
                        name: t.name.clone(),
                        rank,
                        t: tp,
                    })
                }
                Parallel::Column => (0, t.shape[0]),
                Parallel::Row => {
                    if t.shape.len() != 2 {
                        return Err(LayoutError::RowParallelNot2d {
                            name: t.name.clone(),
                            shape: t.shape.clone(),
                        });
                    }
                    (1, t.shape[1])
                }
            };
            if size % tp != 0 {
                return Err(LayoutError::NotDivisible {
                    name: t.name.clone(),
                    parallel: t.parallel.name(),
                    shape: t.shape.clone(),
                    dim,
                    size,
                    t: tp,
                });
            }
        }
        Ok(RolloutLayout {
            tp,
            format: RolloutFormat::Unfused,
            vocab: RolloutVocab::Unpadded,
            experts: ExpertPlacement::TensorParallel,
            tensors,
        })
    }

    /// T: tensor-parallel degree.
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// Every tensor of an unfused layout (empty for a fused one: see
    /// [`RolloutLayout::fused_tensors`]).
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// The TP rank that holds tensor `name` when it is [`Parallel::Owned`]; `None` for tensors
    /// every rank holds a slice of, and for names not in the layout.
    pub fn owner(&self, name: &str) -> Option<usize> {
        match self.tensors.iter().find(|t| t.name == name)?.parallel {
            Parallel::Owned { rank } => Some(rank),
            _ => None,
        }
    }

    /// Unfused or fused.
    pub fn format(&self) -> RolloutFormat {
        self.format
    }

    /// How the vocabulary is sized ([`RolloutVocab::Unpadded`] for unfused layouts, whose
    /// shapes are given).
    pub fn vocab(&self) -> RolloutVocab {
        self.vocab
    }

    /// The same layout at another degree `tp`, checked again (unfused) or at plan time (fused).
    pub fn with_tp(&self, tp: usize) -> Result<Self, LayoutError> {
        match self.format {
            RolloutFormat::Unfused => RolloutLayout::new(tp, self.tensors.clone()),
            RolloutFormat::Fused => {
                Ok(RolloutLayout::fused(tp, self.vocab).with_expert_placement(self.experts))
            }
        }
    }

    /// The same tensors with Hugging Face default splits ([`Parallel::for_hf_name`]).
    pub fn from_hf_names(
        tp: usize,
        tensors: impl IntoIterator<Item = (String, Vec<usize>)>,
    ) -> Result<Self, LayoutError> {
        let specs = tensors
            .into_iter()
            .map(|(name, shape)| {
                let parallel = Parallel::for_hf_name(&name);
                TensorSpec {
                    name,
                    shape,
                    parallel,
                }
            })
            .collect();
        RolloutLayout::new(tp, specs)
    }

    /// The fused layout of degree `tp` with vocabulary sizing `vocab`; its tensors follow from
    /// the model ([`RolloutLayout::fused_tensors`]), checked against it (and `tp` against the
    /// world) when a plan is made.
    /// Experts, if the model has them, are split by tensor parallelism
    /// ([`RolloutLayout::with_expert_placement`] partitions them instead).
    pub fn fused(tp: usize, vocab: RolloutVocab) -> Self {
        RolloutLayout {
            tp,
            format: RolloutFormat::Fused,
            vocab,
            experts: ExpertPlacement::TensorParallel,
            tensors: Vec::new(),
        }
    }

    /// The fused layout with the experts of a mixture-of-experts model placed by `experts`
    /// (checked against the model when a plan is made). An unfused layout places its experts
    /// per tensor ([`ExpertPlacement::apply`]) and is returned unchanged.
    ///
    /// ```
    /// use lifecycle_layout::{ExpertPlacement, ModelSpec, RolloutLayout, RolloutVocab};
    /// let layout = RolloutLayout::fused(2, RolloutVocab::PadToMultipleOf(4))
    ///     .with_expert_placement(ExpertPlacement::Partitioned);
    /// let specs = layout.fused_tensors(&ModelSpec::tiny_moe())?;
    /// let w13 = specs.iter().find(|s| s.name == "model.layers.1.mlp.experts.w13_weight").unwrap();
    /// assert_eq!(w13.shape, vec![2, 2 * 6, 16]); // 2 of the 4 experts, whole
    /// # Ok::<(), lifecycle_layout::megatron::MegatronLayoutError>(())
    /// ```
    pub fn with_expert_placement(mut self, experts: ExpertPlacement) -> Self {
        if self.format == RolloutFormat::Fused {
            self.experts = experts;
        }
        self
    }

    /// How a fused layout places the experts ([`ExpertPlacement::TensorParallel`] for unfused
    /// layouts, whose tensors carry their own placement).
    pub fn expert_placement(&self) -> ExpertPlacement {
        self.experts
    }
}

fn check_names<'a>(
    tensors: impl Iterator<Item = (&'a str, &'a [usize])>,
    side: &'static str,
) -> Result<(), LayoutError> {
    let mut seen = HashSet::new();
    for (name, shape) in tensors {
        if name.is_empty() {
            return Err(LayoutError::EmptyName { side });
        }
        if !seen.insert(name) {
            return Err(LayoutError::DuplicateTensor {
                name: name.to_string(),
                side,
            });
        }
        if shape.is_empty() || shape.contains(&0) {
            return Err(LayoutError::EmptyTensor {
                name: name.to_string(),
                shape: shape.to_vec(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fsdp_rows_cover_every_row_once() {
        for n in 1..40 {
            for w in 1..10 {
                let mut next = 0;
                for r in 0..w {
                    let rows = fsdp_rows(n, w, r);
                    assert_eq!(rows.start, next.min(n));
                    next = rows.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn hf_names_get_their_usual_split() {
        assert_eq!(
            Parallel::for_hf_name("model.layers.0.self_attn.q_proj.weight"),
            Parallel::Column
        );
        assert_eq!(
            Parallel::for_hf_name("model.layers.0.self_attn.q_proj.bias"),
            Parallel::Column
        );
        assert_eq!(
            Parallel::for_hf_name("model.layers.3.mlp.down_proj.weight"),
            Parallel::Row
        );
        assert_eq!(
            Parallel::for_hf_name("model.layers.3.input_layernorm.weight"),
            Parallel::Replicated
        );
        assert_eq!(Parallel::for_hf_name("lm_head.weight"), Parallel::Column);
    }
}

#[cfg(test)]
mod rollout_format_tests {
    use super::*;
    use crate::{plan_fsdp_to_tp, LayoutError};

    #[test]
    fn each_planner_refuses_the_other_format() {
        let specs = vec![TensorSpec::new("w", [4, 2], Parallel::Column)];
        let train =
            FsdpLayout::new(2, specs.iter().map(|s| (s.name.clone(), s.shape.clone()))).unwrap();
        let fused = RolloutLayout::fused(2, RolloutVocab::PadToMultipleOf(4));
        assert_eq!(fused.format(), RolloutFormat::Fused);
        assert!(fused.tensors().is_empty());
        let err = plan_fsdp_to_tp(&train, &fused).unwrap_err();
        assert_eq!(err, LayoutError::FusedLayout);
        assert!(err.to_string().contains("RolloutLayout::new"), "{err}");
        let unfused = RolloutLayout::new(2, specs).unwrap();
        assert_eq!(unfused.vocab(), RolloutVocab::Unpadded);
        let err = unfused
            .fused_tensors(&crate::ModelSpec::tiny())
            .unwrap_err()
            .to_string();
        assert!(err.contains("RolloutLayout::fused"), "{err}");
    }

    #[test]
    fn with_tp_keeps_the_format() {
        let fused = RolloutLayout::fused(2, RolloutVocab::PadToMultipleOf(4));
        let four = fused.with_tp(4).unwrap();
        assert_eq!(
            (four.tp(), four.format(), four.vocab()),
            (4, RolloutFormat::Fused, fused.vocab())
        );
        let unfused =
            RolloutLayout::new(1, vec![TensorSpec::new("w", [3, 2], Parallel::Column)]).unwrap();
        assert!(unfused.with_tp(2).is_err(), "3 rows do not split 2 ways");
    }
}
