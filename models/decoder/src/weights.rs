//! One tensor-parallel group's rollout weights, checked against the config and the layout, with
//! each rank's share of heads and kv heads worked out. This module reads the unfused layout (Hugging
//! Face names, `lifecycle_core` splits); `fused_weights` reads the Megatron backend's fused one
//! into the same views.

use half::bf16;
use lifecycle_layout::lora::{adapter_name, LoraConfig, LoraPart, LoraTarget};
use lifecycle_layout::{hf, Parallel, RolloutLayout, TensorSpec};
use lifecycle_layout::{RankRollout, RolloutTensor};

use crate::config::ModelConfig;
use crate::error::DecodeError;
use crate::heads::{layout_heads, HeadShare};
use crate::math::Mat;
use crate::spec_check::rollout_spec;

/// A weight that is either vocabulary-parallel (one slice per rank) or replicated.
#[derive(Debug, Clone)]
pub(crate) enum VocabWeight<'w> {
    /// Rank `r` holds rows `[r·P, (r+1)·P)` of the vocabulary, `P` rows per slice (`V/T`, or
    /// more when the layout pads the vocabulary: rows `≥ V` are padding, never read).
    Parallel(Vec<&'w [bf16]>),
    /// Every rank holds all rows; rank 0's copy is read.
    Replicated(&'w [bf16]),
}

/// A LoRA adapter's slices on one rank: `A` (`r × in`) and `B` (`out × r`) of its base's
/// slice there, bf16 (`lifecycle_layout::lora`'s split rules).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lora<'w> {
    pub a: &'w [bf16],
    pub b: &'w [bf16],
    pub rank: usize,
}

/// One rank's share of one layer.
#[derive(Debug, Clone)]
pub(crate) struct RankLayer<'w> {
    pub q_w: Mat<'w>,
    pub q_b: Option<&'w [bf16]>,
    /// Rows of this rank's kv heads only (`kv_heads` of them, starting at global `kv_base`).
    pub k_w: Mat<'w>,
    pub k_b: Option<&'w [bf16]>,
    pub v_w: Mat<'w>,
    pub v_b: Option<&'w [bf16]>,
    pub o_w: Mat<'w>,
    /// Adapters of q, k, v and o, where the rollout holds them.
    pub lora: [Option<Lora<'w>>; 4],
}

/// One SwiGLU MLP's share on one rank: `down · (silu(gate · x) ⊙ up · x)` over this rank's
/// intermediate rows (all of them when the MLP is not split).
#[derive(Debug, Clone)]
pub(crate) struct MlpPart<'w> {
    pub gate: Mat<'w>,
    pub up: Mat<'w>,
    pub down: Mat<'w>,
    /// Adapters of gate, up and down, where the rollout holds them.
    pub lora: [Option<Lora<'w>>; 3],
}

/// A layer's MLP: dense, or a mixture of experts.
#[derive(Debug, Clone)]
pub(crate) enum Mlp<'w> {
    /// One part per TP rank; the outputs are summed (the all-reduce).
    Dense(Vec<MlpPart<'w>>),
    /// The router `[experts, hidden]` and, per expert, its parts (one per rank when every expert
    /// is split by TP; the owner's whole expert when the experts are partitioned); the shared
    /// expert, if the model has one.
    Moe {
        router: &'w [bf16],
        experts: Vec<Vec<MlpPart<'w>>>,
        shared: Option<SharedExpert<'w>>,
    },
}

/// Qwen2-MoE's shared expert: every token goes through it (its parts split by TP like a dense
/// MLP), scaled by `sigmoid(gate · x)` with the replicated gate `[1, hidden]`.
#[derive(Debug, Clone)]
pub(crate) struct SharedExpert<'w> {
    pub parts: Vec<MlpPart<'w>>,
    pub gate: &'w [bf16],
}

/// One layer: replicated norms and every rank's share.
#[derive(Debug, Clone)]
pub(crate) struct Layer<'w> {
    pub input_norm: &'w [bf16],
    pub post_norm: &'w [bf16],
    /// Per-head RMSNorm weights of q and k (Qwen3), `[head_dim]`.
    pub qk_norm: Option<(&'w [bf16], &'w [bf16])>,
    pub ranks: Vec<RankLayer<'w>>,
    pub mlp: Mlp<'w>,
}

/// How a mixture-of-experts layer weighs its experts.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Routing {
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

/// The whole group's weights.
#[derive(Debug, Clone)]
pub(crate) struct GroupWeights<'w> {
    pub embed: VocabWeight<'w>,
    pub head: VocabWeight<'w>,
    pub final_norm: &'w [bf16],
    pub layers: Vec<Layer<'w>>,
    pub shares: Vec<HeadShare>,
    /// Query heads per rank.
    pub q_heads: usize,
    /// Routing of the MoE layers (unused by dense models).
    pub routing: Routing,
}

struct Reader<'a, 'w> {
    layout: &'a RolloutLayout,
    ranks: &'a [&'w RankRollout],
    shapes: Vec<(String, Vec<usize>)>,
}

impl<'w> Reader<'_, 'w> {
    /// The spec of `name`, checked to have the config's shape and one of `allowed` splits.
    fn spec(&self, name: &str, allowed: &[Parallel]) -> Result<&TensorSpec, DecodeError> {
        rollout_spec(self.layout, &self.shapes, name, allowed)
    }

    /// TP rank `rank`'s slice of `name`, checked against the layout.
    fn tensor(&self, spec: &TensorSpec, rank: usize) -> Result<&'w RolloutTensor, DecodeError> {
        let t = self.ranks[rank]
            .tensor(&spec.name)
            .ok_or_else(|| DecodeError::MissingTensor {
                name: spec.name.clone(),
                rank,
            })?;
        let expected = spec.slice_shape(self.layout.tp());
        let held = t.fp8.as_ref().map_or(t.data.len(), |q| q.data().len());
        if t.shape != expected || held != expected.iter().product::<usize>() {
            return Err(DecodeError::Shape {
                name: spec.name.clone(),
                rank,
                expected,
                found: t.shape.clone(),
            });
        }
        Ok(t)
    }

    /// A slice read in bf16 (norms, biases, embeddings, the router): an fp8 one is an error.
    fn slice(&self, spec: &TensorSpec, rank: usize) -> Result<&'w [bf16], DecodeError> {
        let t = self.tensor(spec, rank)?;
        if t.fp8.is_some() {
            return Err(DecodeError::Usage(format!(
                "`{}` on rank {rank} is fp8, but the decoder reads it in bf16: an fp8 rollout \
                 quantises matrix weights only (lifecycle_layout::fp8::keeps_bf16)",
                spec.name
            )));
        }
        Ok(&t.data)
    }

    /// A weight matrix, bf16 or fp8.
    fn matrix(&self, spec: &TensorSpec, rank: usize) -> Result<Mat<'w>, DecodeError> {
        let t = self.tensor(spec, rank)?;
        Ok(match &t.fp8 {
            Some(q) => Mat::fp8(q),
            None => Mat::Bf16(&t.data),
        })
    }

    /// The adapter of base matrix `base` on rank `rank`, where the layout holds one (its `A`
    /// and `B` both, bf16, of one rank `r`, sized for the base's slice there: `out × in`; with
    /// `rows`, only those rows of `B`, as the decoder keeps of a replicated k / v base).
    fn lora(
        &self,
        base: &str,
        rank: usize,
        (out, inp): (usize, usize),
        rows: Option<std::ops::Range<usize>>,
    ) -> Result<Option<Lora<'w>>, DecodeError> {
        let find = |part| {
            let name = adapter_name(base, part);
            self.layout.tensors().iter().find(|t| t.name == name)
        };
        let (a, b) = match (find(LoraPart::A), find(LoraPart::B)) {
            (None, None) => return Ok(None),
            (Some(a), Some(b)) => (a, b),
            (a, _) => {
                let missing = if a.is_none() {
                    LoraPart::A
                } else {
                    LoraPart::B
                };
                return Err(DecodeError::Usage(format!(
                    "the rollout layout holds one matrix of the adapter of `{base}` but not \
                     `{}`: an adapter needs its A and B",
                    adapter_name(base, missing)
                )));
            }
        };
        let (a, b) = (self.slice(a, rank)?, self.slice(b, rank)?);
        let r = a.len() / inp.max(1);
        let b = match rows {
            Some(rows) if r > 0 && b.len() == out * r => b.get(rows.start * r..rows.end * r),
            None if r > 0 && b.len() == out * r => Some(b),
            _ => None,
        };
        match b {
            Some(b) if a.len() == r * inp => Ok(Some(Lora { a, b, rank: r })),
            _ => Err(DecodeError::Usage(format!(
                "the adapter of `{base}` on rank {rank}: A holds {} values, which fit no rank r \
                 for a base slice of {out} × {inp} with B beside it",
                a.len()
            ))),
        }
    }

    fn get(
        &self,
        name: &str,
        allowed: &[Parallel],
        rank: usize,
    ) -> Result<&'w [bf16], DecodeError> {
        let spec = self.spec(name, allowed)?;
        self.slice(spec, rank)
    }

    fn get_matrix(
        &self,
        name: &str,
        allowed: &[Parallel],
        rank: usize,
    ) -> Result<Mat<'w>, DecodeError> {
        let spec = self.spec(name, allowed)?;
        self.matrix(spec, rank)
    }

    /// The parts of one SwiGLU MLP (`names` maps the gate, up and down suffixes to tensor
    /// names): one per rank when it is split by TP (gate and up column-parallel, down
    /// row-parallel), or the whole MLP from the one rank that holds it.
    fn mlp_parts(
        &self,
        names: impl Fn(&str) -> String,
        [gate, up, down]: [&str; 3],
    ) -> Result<Vec<MlpPart<'w>>, DecodeError> {
        let (gate, up, down) = (names(gate), names(up), names(down));
        let g = self.spec(&gate, &[Parallel::Column, Parallel::Owned { rank: 0 }])?;
        if g.parallel == Parallel::Column {
            let col = [Parallel::Column];
            // this rank's intermediate rows and the hidden size, for its adapters' slices
            let (f, h) = (g.slice_shape(self.layout.tp())[0], g.cols());
            return (0..self.ranks.len())
                .map(|rank| {
                    Ok(MlpPart {
                        gate: self.matrix(g, rank)?,
                        up: self.get_matrix(&up, &col, rank)?,
                        down: self.get_matrix(&down, &[Parallel::Row], rank)?,
                        lora: [
                            self.lora(&gate, rank, (f, h), None)?,
                            self.lora(&up, rank, (f, h), None)?,
                            self.lora(&down, rank, (h, f), None)?,
                        ],
                    })
                })
                .collect();
        }
        let own = [Parallel::Owned { rank: 0 }];
        let rank = self.layout.owner(&g.name).unwrap_or(0);
        let (u, d) = (self.spec(&up, &own)?, self.spec(&down, &own)?);
        for spec in [u, d] {
            if self.layout.owner(&spec.name) != Some(rank) {
                return Err(DecodeError::Usage(format!(
                    "`{}` and `{}` of one expert live on different ranks: the decoder needs an \
                     expert's gate, up and down projections on one rank",
                    g.name, spec.name
                )));
            }
        }
        Ok(vec![MlpPart {
            gate: self.matrix(g, rank)?,
            up: self.matrix(u, rank)?,
            down: self.matrix(d, rank)?,
            lora: [None; 3],
        }])
    }

    fn vocab(&self, name: &str) -> Result<VocabWeight<'w>, DecodeError> {
        let spec = self.spec(name, &[Parallel::Column, Parallel::Replicated])?;
        Ok(match spec.parallel {
            Parallel::Column => VocabWeight::Parallel(
                (0..self.ranks.len())
                    .map(|r| self.slice(spec, r))
                    .collect::<Result<_, _>>()?,
            ),
            _ => VocabWeight::Replicated(self.slice(spec, 0)?),
        })
    }
}

impl Routing {
    pub(crate) fn of(config: &ModelConfig) -> Self {
        config.model.moe.map_or(Routing::default(), |m| Routing {
            top_k: m.top_k,
            norm_topk_prob: m.norm_topk_prob,
        })
    }
}

impl GroupWeights<'_> {
    /// Every adapter slot of layer `l` (q, k, v, o, gate, up, down) with what each rank holds.
    fn lora_slots(&self, l: usize) -> Vec<(LoraTarget, Vec<Option<Lora<'_>>>)> {
        let layer = &self.layers[l];
        let mut out: Vec<(LoraTarget, Vec<Option<Lora<'_>>>)> =
            LoraTarget::ALL.iter().map(|&t| (t, Vec::new())).collect();
        for r in &layer.ranks {
            for (i, l) in r.lora.iter().enumerate() {
                out[i].1.push(*l);
            }
        }
        if let Mlp::Dense(parts) = &layer.mlp {
            for p in parts {
                for (i, l) in p.lora.iter().enumerate() {
                    out[4 + i].1.push(*l);
                }
            }
        }
        out
    }

    /// The adapters held are those of `lora` ([`crate::check_adapters`]; none without it).
    pub(crate) fn check_lora(&self, lora: Option<&LoraConfig>) -> Result<(), DecodeError> {
        let layers = self.layers.len();
        let dense = |l: usize| matches!(self.layers[l].mlp, Mlp::Dense(_));
        let held = |l: usize, t: LoraTarget| {
            let slots = self.lora_slots(l);
            slots
                .into_iter()
                .find(|(s, _)| *s == t)
                .map_or_else(Vec::new, |(_, ranks)| {
                    ranks.iter().map(|a| a.map(|a| a.rank)).collect()
                })
        };
        crate::check_adapters(layers, dense, lora, held, "CpuDecoder::new_lora")
    }
}

impl<'w> GroupWeights<'w> {
    /// Checks every tensor the config needs against the layout and the group's slices.
    pub(crate) fn new(
        config: &ModelConfig,
        layout: &RolloutLayout,
        ranks: &[&'w RankRollout],
    ) -> Result<Self, DecodeError> {
        let tp = layout.tp();
        if ranks.len() != tp {
            return Err(DecodeError::GroupSize {
                tp,
                found: ranks.len(),
            });
        }
        let degree = |reason: String| DecodeError::Degree { tp, reason };
        if !config.model.heads.is_multiple_of(tp) {
            return Err(degree(format!(
                "num_attention_heads {} is not divisible by T",
                config.model.heads
            )));
        }
        let r = Reader {
            layout,
            ranks,
            shapes: config.tensor_shapes(),
        };
        let d = config.model.head_dim;
        let h = config.model.hidden;
        let q_heads = config.model.heads / tp;
        let (kv_split, shares) = layout_heads(config, layout)?;
        let mut layers = Vec::with_capacity(config.model.layers);
        for l in 0..config.model.layers {
            let p = format!("model.layers.{l}");
            let col = [Parallel::Column];
            let kv = [kv_split];
            let mut rank_layers = Vec::with_capacity(tp);
            for (rank, share) in shares.iter().enumerate() {
                let bias =
                    |name: &str, allowed: &[Parallel]| -> Result<Option<&'w [bf16]>, DecodeError> {
                        if config.model.qkv_bias {
                            r.get(name, allowed, rank).map(Some)
                        } else {
                            Ok(None)
                        }
                    };
                // replicated k/v: keep only the rows of the kv heads this rank uses
                let kv_range = share.kv_base * d..(share.kv_base + share.kv_heads) * d;
                let kv_rows = |w: &'w [bf16], width: usize| -> &'w [bf16] {
                    if kv_split == Parallel::Column {
                        w
                    } else {
                        &w[kv_range.start * width..kv_range.end * width]
                    }
                };
                let kv_matrix = |w: Mat<'w>| -> Mat<'w> {
                    if kv_split == Parallel::Column {
                        w
                    } else {
                        w.rows(kv_range.clone(), h)
                    }
                };
                let (q_name, k_name, v_name, o_name) = (
                    hf::layer(l, hf::Q),
                    hf::layer(l, hf::K),
                    hf::layer(l, hf::V),
                    hf::layer(l, hf::O),
                );
                let k_w = r.get_matrix(&k_name, &kv, rank)?;
                let v_w = r.get_matrix(&v_name, &kv, rank)?;
                // adapters: q and o on this rank's heads, k and v on the kv heads it uses
                let q_rows = q_heads * d;
                let kv_out = if kv_split == Parallel::Column {
                    (share.kv_heads * d, None)
                } else {
                    (config.model.kv_rows(), Some(kv_range.clone()))
                };
                let lora = [
                    r.lora(&q_name, rank, (q_rows, h), None)?,
                    r.lora(&k_name, rank, (kv_out.0, h), kv_out.1.clone())?,
                    r.lora(&v_name, rank, (kv_out.0, h), kv_out.1.clone())?,
                    r.lora(&o_name, rank, (h, q_rows), None)?,
                ];
                let k_b = bias(&format!("{p}.self_attn.k_proj.bias"), &kv)?;
                let v_b = bias(&format!("{p}.self_attn.v_proj.bias"), &kv)?;
                rank_layers.push(RankLayer {
                    q_w: r.get_matrix(&q_name, &col, rank)?,
                    q_b: bias(&format!("{p}.self_attn.q_proj.bias"), &col)?,
                    k_w: kv_matrix(k_w),
                    k_b: k_b.map(|b| kv_rows(b, 1)),
                    v_w: kv_matrix(v_w),
                    v_b: v_b.map(|b| kv_rows(b, 1)),
                    o_w: r.get_matrix(&o_name, &[Parallel::Row], rank)?,
                    lora,
                });
            }
            let rep = [Parallel::Replicated];
            let qk_norm = if config.model.qk_norm {
                Some((
                    r.get(&hf::layer(l, hf::Q_NORM), &rep, 0)?,
                    r.get(&hf::layer(l, hf::K_NORM), &rep, 0)?,
                ))
            } else {
                None
            };
            let mlp = match config.model.moe {
                Some(moe) if config.model_spec(128).moe_layer(l) => Mlp::Moe {
                    shared: if moe.shared_ffn > 0 {
                        Some(SharedExpert {
                            parts: r.mlp_parts(
                                |s| hf::layer(l, s),
                                [hf::SHARED_GATE, hf::SHARED_UP, hf::SHARED_DOWN],
                            )?,
                            gate: r.get(&hf::layer(l, hf::SHARED_EXPERT_GATE), &rep, 0)?,
                        })
                    } else {
                        None
                    },
                    router: r.get(&hf::layer(l, hf::ROUTER), &rep, 0)?,
                    experts: (0..moe.experts)
                        .map(|e| {
                            r.mlp_parts(
                                |s| hf::expert(l, e, s),
                                [hf::EXPERT_GATE, hf::EXPERT_UP, hf::EXPERT_DOWN],
                            )
                        })
                        .collect::<Result<_, _>>()?,
                },
                _ => Mlp::Dense(r.mlp_parts(|s| hf::layer(l, s), [hf::GATE, hf::UP, hf::DOWN])?),
            };
            layers.push(Layer {
                input_norm: r.get(&format!("{p}.input_layernorm.weight"), &rep, 0)?,
                post_norm: r.get(&format!("{p}.post_attention_layernorm.weight"), &rep, 0)?,
                qk_norm,
                ranks: rank_layers,
                mlp,
            });
        }
        let embed = r.vocab("model.embed_tokens.weight")?;
        let head = if config.model.tied_embeddings {
            embed.clone()
        } else {
            r.vocab("lm_head.weight")?
        };
        Ok(GroupWeights {
            embed,
            head,
            final_norm: r.get("model.norm.weight", &[Parallel::Replicated], 0)?,
            layers,
            shares,
            q_heads,
            routing: Routing::of(config),
        })
    }
}
