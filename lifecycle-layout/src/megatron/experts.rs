//! Megatron-Core's expert layout: the parallel state of the mixture-of-experts layers and the
//! grouped-GEMM expert tensors each rank holds, in an expert buffer per rank whose fp32 copy and
//! Adam state the expert data-parallel group shards.
//!
//! Megatron-Core decomposes the same ranks twice ("MoE parallel folding"): the attention and
//! dense layers by TP × CP × DP × PP, the expert layers by ETP × EP × EDP × PP, both in the
//! order `tp-cp-ep-dp-pp` (the first varies fastest) and with the same pipeline groups. So an
//! expert layer's rank is `etp + ETP · (ep + EP · (edp + EDP · pp))`, with `EDP = W / (ETP · EP ·
//! PP)`; expert-parallel rank `ep` holds experts `[ep · E/EP, (ep + 1) · E/EP)`, each split
//! `ETP` ways as a dense MLP is split by TP: `linear_fc1.weight{i}` is `[gate rows; up rows]` of
//! this ETP rank's share of the intermediate size, `linear_fc2.weight{i}` its columns of `down`
//! (`{i}` the local expert index of the grouped GEMM). The router is replicated.
//! [`MegatronLayout::new_moe`](super::MegatronLayout::new_moe) puts
//! these tensors in the expert part of each rank's buffer.

use std::ops::Range;

use super::error::MegatronLayoutError;
use crate::model::MoeSpec;

/// Coordinates of one rank in the expert layers' decomposition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExpertCoords {
    /// Expert tensor-parallel rank.
    pub etp: usize,
    /// Expert-parallel rank.
    pub ep: usize,
    /// Expert data-parallel rank.
    pub edp: usize,
    /// Pipeline stage.
    pub pp: usize,
}

/// Which grouped-GEMM tensor of an expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertPart {
    /// `linear_fc1.weight{i}`: `[gate rows; up rows]` of the rank's intermediate share.
    Fc1,
    /// `linear_fc2.weight{i}`: the rank's columns of `down`.
    Fc2,
}

/// One expert tensor of one rank: its Megatron-Core name, shape, and where it comes from in the
/// Hugging Face per-expert tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertShard {
    /// `decoder.layers.{l}.mlp.experts.linear_fc{1,2}.weight{i}`.
    pub name: String,
    /// The layer `{l}`.
    pub layer: usize,
    /// The global expert.
    pub expert: usize,
    /// The local index `{i}`.
    pub local: usize,
    /// Which tensor.
    pub part: ExpertPart,
    /// Shape of this rank's tensor: `[2 · ffn/ETP, hidden]` (fc1) or `[hidden, ffn/ETP]` (fc2).
    pub shape: [usize; 2],
    /// The intermediate rows (fc1: of gate and of up) or columns (fc2: of down) it covers.
    pub ffn: Range<usize>,
    /// Element offset in the rank's expert buffer ([`ExpertParallel::stage_shards`]; within
    /// the layer for [`ExpertParallel::shards`]).
    pub offset: usize,
}

/// The expert layers' decomposition of `W` ranks: `ETP × EP × EDP × PP`.
///
/// ```
/// use lifecycle_layout::megatron::{ExpertCoords, ExpertParallel};
/// use lifecycle_layout::ModelSpec;
/// let moe = ModelSpec::tiny_moe().moe.unwrap(); // 4 experts of intermediate size 6
/// // W = 8, PP 2, EP 2, ETP 2: expert DP = 8 / (2 · 2 · 2) = 1
/// let ex = ExpertParallel::new(8, 2, 2, 2, moe)?;
/// assert_eq!(ex.edp(), 1);
/// assert_eq!(ex.coords(5), ExpertCoords { etp: 1, ep: 0, edp: 0, pp: 1 });
/// assert_eq!(ex.local_experts(1), 2..4);
/// let shards = ex.shards(3, 7, 16); // layer 3, rank 7 (etp 1, ep 1), hidden 16
/// assert_eq!(shards[0].name, "decoder.layers.3.mlp.experts.linear_fc1.weight0");
/// // expert 2 is rank 7's first: ETP rank 1 holds rows 3..6 of its gate and of its up
/// assert_eq!((shards[0].expert, shards[0].shape, shards[0].ffn.clone()), (2, [6, 16], 3..6));
/// assert_eq!(shards[1].shape, [16, 3]); // fc2 of expert 2: columns 3..6 of down
/// # Ok::<(), lifecycle_layout::megatron::MegatronLayoutError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertParallel {
    etp: usize,
    ep: usize,
    edp: usize,
    pp: usize,
    moe: MoeSpec,
}

impl ExpertParallel {
    /// The decomposition of `world` ranks with `pp` stages, expert parallelism `ep` and expert
    /// tensor parallelism `etp` (Megatron's `--expert-tensor-parallel-size`, which defaults to
    /// TP), for the experts of `moe`. Checked: every degree at least 1, `ETP · EP · PP` dividing
    /// `W`, `EP` dividing the experts, `ETP` dividing their intermediate size.
    pub fn new(
        world: usize,
        pp: usize,
        ep: usize,
        etp: usize,
        moe: MoeSpec,
    ) -> Result<Self, MegatronLayoutError> {
        for (what, v) in [
            ("world size", world),
            ("pipeline-parallel degree", pp),
            ("expert-parallel degree", ep),
            ("expert tensor-parallel degree", etp),
        ] {
            if v == 0 {
                return Err(MegatronLayoutError::ZeroSize { what });
            }
        }
        if !world.is_multiple_of(etp * ep * pp) {
            return Err(MegatronLayoutError::ExpertWorld { world, etp, ep, pp });
        }
        if !moe.experts.is_multiple_of(ep) {
            return Err(MegatronLayoutError::ExpertsNotDivisible {
                experts: moe.experts,
                ep,
            });
        }
        if !moe.ffn.is_multiple_of(etp) {
            return Err(MegatronLayoutError::NotDivisible {
                side: "expert",
                what: "moe_intermediate_size",
                size: moe.ffn,
                tp: etp,
                param: "mlp.experts.linear_fc1.weight{i}",
            });
        }
        Ok(ExpertParallel {
            etp,
            ep,
            edp: world / (etp * ep * pp),
            pp,
            moe,
        })
    }

    /// Expert tensor-parallel degree.
    pub fn etp(&self) -> usize {
        self.etp
    }

    /// Expert-parallel degree.
    pub fn ep(&self) -> usize {
        self.ep
    }

    /// Expert data-parallel degree, `W / (ETP · EP · PP)`.
    pub fn edp(&self) -> usize {
        self.edp
    }

    /// Ranks.
    pub fn world(&self) -> usize {
        self.etp * self.ep * self.edp * self.pp
    }

    /// Global rank of `c`: `etp + ETP · (ep + EP · (edp + EDP · pp))`.
    pub fn rank(&self, c: ExpertCoords) -> usize {
        c.etp + self.etp * (c.ep + self.ep * (c.edp + self.edp * c.pp))
    }

    /// Coordinates of global rank `rank`.
    pub fn coords(&self, rank: usize) -> ExpertCoords {
        ExpertCoords {
            etp: rank % self.etp,
            ep: (rank / self.etp) % self.ep,
            edp: (rank / (self.etp * self.ep)) % self.edp,
            pp: rank / (self.etp * self.ep * self.edp),
        }
    }

    /// The experts expert-parallel rank `ep` holds.
    pub fn local_experts(&self, ep: usize) -> Range<usize> {
        let per = self.moe.experts / self.ep;
        ep * per..(ep + 1) * per
    }

    /// The expert tensors of layer `layer` on global rank `rank` (`hidden` the model width), in
    /// grouped-GEMM order: per local expert, fc1 then fc2, densely packed from offset 0.
    pub fn shards(&self, layer: usize, rank: usize, hidden: usize) -> Vec<ExpertShard> {
        let c = self.coords(rank);
        let part = self.moe.ffn / self.etp;
        let ffn = c.etp * part..(c.etp + 1) * part;
        let per_expert = 3 * part * hidden;
        self.local_experts(c.ep)
            .enumerate()
            .flat_map(|(local, expert)| {
                let name = |fc: u8| {
                    format!("decoder.layers.{layer}.mlp.experts.linear_fc{fc}.weight{local}")
                };
                [
                    ExpertShard {
                        name: name(1),
                        layer,
                        expert,
                        local,
                        part: ExpertPart::Fc1,
                        shape: [2 * part, hidden],
                        ffn: ffn.clone(),
                        offset: local * per_expert,
                    },
                    ExpertShard {
                        name: name(2),
                        layer,
                        expert,
                        local,
                        part: ExpertPart::Fc2,
                        shape: [hidden, part],
                        ffn: ffn.clone(),
                        offset: local * per_expert + 2 * part * hidden,
                    },
                ]
            })
            .collect()
    }

    /// The expert buffer of global rank `rank` for the pipeline stage owning `layers` of
    /// `model`: the expert tensors of every mixture-of-experts layer among them, in layer order,
    /// densely packed. Megatron-Core keeps expert parameters in buffers of their own (their
    /// gradients reduce over the expert data-parallel group, not the dense one); the ranks of
    /// one expert data-parallel group hold the same buffer.
    ///
    /// ```
    /// use lifecycle_layout::megatron::ExpertParallel;
    /// use lifecycle_layout::ModelSpec;
    /// // 3 layers, the first dense: layers 1 and 2 hold 4 experts of intermediate size 6
    /// let model = ModelSpec { layers: 3, ..ModelSpec::tiny_moe() };
    /// let ex = ExpertParallel::new(4, 1, 2, 2, model.moe.unwrap())?;
    /// let shards = ex.stage_shards(&model, 0..3, 0);
    /// // per layer: 2 local experts x (fc1 [6, h] + fc2 [h, 3])
    /// let per_layer = 2 * 3 * 3 * model.hidden;
    /// assert_eq!((shards.len(), ex.stage_len(&model, 0..3)), (8, 2 * per_layer));
    /// assert_eq!(shards[4].name, "decoder.layers.2.mlp.experts.linear_fc1.weight0");
    /// assert_eq!(shards[4].offset, per_layer);
    /// # Ok::<(), lifecycle_layout::megatron::MegatronLayoutError>(())
    /// ```
    pub fn stage_shards(
        &self,
        model: &crate::ModelSpec,
        layers: Range<usize>,
        rank: usize,
    ) -> Vec<ExpertShard> {
        let mut base = 0;
        let mut out = Vec::new();
        for l in layers.filter(|&l| model.moe_layer(l)) {
            let shards = self.shards(l, rank, model.hidden);
            let len: usize = shards.iter().map(|s| s.shape[0] * s.shape[1]).sum();
            out.extend(shards.into_iter().map(|mut s| {
                s.offset += base;
                s
            }));
            base += len;
        }
        out
    }

    /// Elements of a rank's expert buffer for the stage owning `layers`.
    pub fn stage_len(&self, model: &crate::ModelSpec, layers: Range<usize>) -> usize {
        let part = self.moe.ffn / self.etp;
        let experts = self.moe.experts / self.ep;
        layers.filter(|&l| model.moe_layer(l)).count() * experts * 3 * part * model.hidden
    }

    /// The fp32 elements of an expert buffer of `len` elements that expert data-parallel rank
    /// `edp` owns (the distributed optimizer over the expert data-parallel group), as
    /// [`MegatronLayout::dp_shard`](super::MegatronLayout::dp_shard) splits the dense buffer.
    pub fn edp_shard(&self, len: usize, edp: usize) -> Range<usize> {
        let c = len.div_ceil(self.edp);
        (edp * c).min(len)..((edp + 1) * c).min(len)
    }

    /// The ranks of one expert-parallel group (fixed ETP rank, expert DP rank and stage): the
    /// ranks that exchange tokens in the MoE dispatch, in EP order.
    pub fn ep_group(&self, etp: usize, edp: usize, pp: usize) -> Vec<usize> {
        (0..self.ep)
            .map(|ep| self.rank(ExpertCoords { etp, ep, edp, pp }))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LayerSet;

    fn moe(experts: usize, ffn: usize) -> MoeSpec {
        MoeSpec {
            experts,
            top_k: 2,
            ffn,
            norm_topk_prob: true,
            sparse_step: 1,
            dense_layers: LayerSet::EMPTY,
            shared_ffn: 0,
        }
    }

    /// Megatron-Core's `RankGenerator` with order `tp-cp-ep-dp-pp`, written out: the ranks of
    /// the groups along one axis, every other coordinate fixed.
    fn megatron_groups(sizes: [usize; 4], axis: usize) -> Vec<Vec<usize>> {
        let world: usize = sizes.iter().product();
        let stride: usize = sizes[..axis].iter().product();
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for base in 0..world {
            if !(base / stride).is_multiple_of(sizes[axis]) {
                continue;
            }
            groups.push((0..sizes[axis]).map(|k| base + k * stride).collect());
        }
        groups
    }

    #[test]
    fn ranks_follow_megatron_cores_expert_order_and_pipeline_groups_match_the_dense_ones() {
        // W = 16: ETP 2, EP 2, PP 2 -> EDP 2
        let ex = ExpertParallel::new(16, 2, 2, 2, moe(8, 64)).unwrap();
        assert_eq!(ex.edp(), 2);
        for r in 0..16 {
            assert_eq!(ex.rank(ex.coords(r)), r);
        }
        // EP groups: [etp, ep, edp, pp] sizes, the EP axis
        let want = megatron_groups([2, 2, 2, 2], 1);
        let mut got: Vec<Vec<usize>> = Vec::new();
        for pp in 0..2 {
            for edp in 0..2 {
                for etp in 0..2 {
                    got.push(ex.ep_group(etp, edp, pp));
                }
            }
        }
        got.sort();
        let mut want_sorted = want.clone();
        want_sorted.sort();
        assert_eq!(got, want_sorted);
        assert!(got.contains(&vec![0, 2]) && got.contains(&vec![13, 15]));
        // the dense decomposition TP 2 x DP 4 x PP 2 has the same pipeline stage per rank
        for r in 0..16 {
            assert_eq!(ex.coords(r).pp, r / 8);
        }
    }

    #[test]
    fn shards_cover_every_expert_once_per_expert_dp_replica() {
        let ex = ExpertParallel::new(8, 1, 4, 2, moe(8, 48)).unwrap();
        let mut seen = vec![0usize; 8 * 2];
        for r in 0..8 {
            for s in ex.shards(0, r, 32) {
                if s.part == ExpertPart::Fc1 {
                    assert_eq!(s.shape, [48, 32]);
                    seen[s.expert * 2 + s.ffn.start / 24] += 1;
                }
            }
        }
        // EDP = 1: each (expert, ETP share) exactly once
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
    }

    #[test]
    fn expert_buffers_pack_the_stages_moe_layers_and_edp_shards_tile_them() {
        let model = crate::ModelSpec::tiny_moe();
        let m = model.moe.unwrap();
        // W = 8, PP 2, EP 2, ETP 1: EDP 2
        let ex = ExpertParallel::new(8, 2, 2, 1, m).unwrap();
        let stage1 = model.layers / 2..model.layers;
        for r in 0..8 {
            let shards = ex.stage_shards(&model, stage1.clone(), r);
            let len = ex.stage_len(&model, stage1.clone());
            let mut end = 0;
            for s in &shards {
                assert_eq!(s.offset, end, "rank {r} {}", s.name);
                end += s.shape[0] * s.shape[1];
            }
            assert_eq!(end, len);
            let (a, b) = (ex.edp_shard(len, 0), ex.edp_shard(len, 1));
            assert_eq!((a.start, a.end, b.end), (0, b.start, len));
        }
    }

    #[test]
    fn bad_degrees_are_named() {
        let err = |w, pp, ep, etp, m| {
            ExpertParallel::new(w, pp, ep, etp, m)
                .unwrap_err()
                .to_string()
        };
        let e = err(8, 1, 3, 1, moe(6, 16));
        assert!(e.contains("8") && e.contains("EP"), "{e}");
        let e = err(8, 1, 4, 1, moe(6, 16));
        assert!(e.contains("num_experts = 6") && e.contains("4"), "{e}");
        let e = err(8, 1, 2, 4, moe(8, 18));
        assert!(
            e.contains("moe_intermediate_size") && e.contains("18"),
            "{e}"
        );
        assert!(err(8, 1, 0, 1, moe(8, 16)).contains("expert-parallel degree"));
    }
}
