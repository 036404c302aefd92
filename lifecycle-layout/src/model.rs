//! The model description and its Hugging Face (Qwen2 / Llama / Qwen3 / Qwen3-MoE) parameter
//! names.

use crate::megatron::MegatronLayoutError;

/// A set of layer indices below 128 (`mlp_only_layers`: the layers of a mixture-of-experts model
/// that keep a dense MLP). `Copy`, so [`ModelSpec`] stays a plain value.
///
/// ```
/// use lifecycle_layout::LayerSet;
/// let dense = LayerSet::from_layers(&[0, 3]).unwrap();
/// assert!(dense.contains(3) && !dense.contains(1));
/// assert!(LayerSet::from_layers(&[200]).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LayerSet(u128);

impl LayerSet {
    /// The empty set.
    pub const EMPTY: LayerSet = LayerSet(0);

    /// The set of `layers`; an index of 128 or more is refused (returned as the error).
    pub fn from_layers(layers: &[usize]) -> Result<Self, usize> {
        let mut bits = 0u128;
        for &l in layers {
            if l >= 128 {
                return Err(l);
            }
            bits |= 1 << l;
        }
        Ok(LayerSet(bits))
    }

    /// Whether layer `l` is in the set.
    pub fn contains(&self, l: usize) -> bool {
        l < 128 && self.0 & (1 << l) != 0
    }

    /// The layers in the set, ascending.
    pub fn layers(&self) -> Vec<usize> {
        (0..128).filter(|&l| self.contains(l)).collect()
    }
}

/// The mixture-of-experts MLP of a Qwen3-MoE style model: every MoE layer has a router
/// (`mlp.gate.weight`, `[experts, hidden]`) and `experts` SwiGLU experts of intermediate size
/// `ffn`, of which each token uses the `top_k` with the largest routing probability.
///
/// ```
/// use lifecycle_layout::{LayerSet, ModelSpec, MoeSpec};
/// let m = ModelSpec::qwen3_30b_a3b(48);
/// let moe = m.moe.unwrap();
/// assert_eq!((moe.experts, moe.top_k, moe.ffn), (128, 8, 768));
/// assert!(m.moe_layer(0) && m.moe_layer(47));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MoeSpec {
    /// Experts per MoE layer (`num_experts`).
    pub experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: usize,
    /// Intermediate size of one expert (`moe_intermediate_size`).
    pub ffn: usize,
    /// Whether the top-k routing weights are renormalised to sum to one (`norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Every `sparse_step`-th layer is a MoE layer (`decoder_sparse_step`; 1: all of them).
    pub sparse_step: usize,
    /// Layers that keep a dense MLP of size [`ModelSpec::ffn`] (`mlp_only_layers`).
    pub dense_layers: LayerSet,
    /// Intermediate size of the shared expert every token also goes through, scaled by a
    /// sigmoid gate (Qwen2-MoE's `shared_expert_intermediate_size`: `mlp.shared_expert.*` and
    /// `mlp.shared_expert_gate.weight` `[1, hidden]`); 0 for none (Qwen3-MoE).
    pub shared_ffn: usize,
}

/// Shape of a decoder-only transformer (Qwen2 / Llama family), independent of any layout.
///
/// ```
/// use lifecycle_layout::ModelSpec;
/// let m = ModelSpec::tiny();
/// let names: Vec<String> = m.hf_tensors().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names[0], "model.embed_tokens.weight");
/// assert!(names.contains(&"model.layers.1.self_attn.k_proj.weight".to_string()));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelSpec {
    /// Hidden size (model width).
    pub hidden: usize,
    /// Attention (query) heads.
    pub heads: usize,
    /// Query groups = key/value heads (`heads` for plain multi-head attention).
    pub query_groups: usize,
    /// Channels per head (`kv_channels` in Megatron).
    pub head_dim: usize,
    /// MLP intermediate size (`ffn_hidden_size`).
    pub ffn: usize,
    /// Vocabulary size of the tokenizer (unpadded; the Hugging Face embedding's rows).
    pub vocab: usize,
    /// Transformer layers.
    pub layers: usize,
    /// Whether q/k/v projections carry a bias (Qwen2: yes, Llama: no).
    pub qkv_bias: bool,
    /// Whether the output layer shares the input embedding (`tie_word_embeddings`).
    pub tied_embeddings: bool,
    /// Megatron's `--make-vocab-size-divisible-by` (128 by default).
    pub make_vocab_size_divisible_by: usize,
    /// Whether attention normalises every q and k head (RMSNorm over `head_dim`, weights
    /// `self_attn.q_norm.weight` / `k_norm.weight`, before the rotary embedding): Qwen3.
    pub qk_norm: bool,
    /// The mixture-of-experts MLP, if any (Qwen3-MoE); `None` for dense models.
    pub moe: Option<MoeSpec>,
}

impl ModelSpec {
    /// Qwen2.5-7B with `layers` decoder layers (28 make the real model, 7.615 B parameters):
    /// hidden 3584, MLP 18944, vocabulary 152064, 28 heads in 4 query groups of head dim 128,
    /// q/k/v biases, untied head.
    ///
    /// ```
    /// use lifecycle_layout::ModelSpec;
    /// let m = ModelSpec::qwen2_5_7b(28);
    /// let n: usize = m.hf_tensors().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    /// assert_eq!(n, 7_615_616_512);
    /// ```
    pub fn qwen2_5_7b(layers: usize) -> Self {
        ModelSpec {
            hidden: 3584,
            heads: 28,
            query_groups: 4,
            head_dim: 128,
            ffn: 18944,
            vocab: 152_064,
            layers,
            qkv_bias: true,
            tied_embeddings: false,
            make_vocab_size_divisible_by: 128,
            qk_norm: false,
            moe: None,
        }
    }

    /// Qwen3-30B-A3B with `layers` decoder layers (48 make the real model, 30.5 B parameters):
    /// hidden 2048, 32 heads in 4 query groups of head dim 128, q/k norms, 128 experts of
    /// intermediate size 768 in every layer, top-8 with renormalised weights, vocabulary 151936,
    /// untied head.
    ///
    /// ```
    /// use lifecycle_layout::ModelSpec;
    /// let m = ModelSpec::qwen3_30b_a3b(48);
    /// let n: usize = m.hf_tensors().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    /// assert_eq!(n, 30_532_122_624);
    /// ```
    pub fn qwen3_30b_a3b(layers: usize) -> Self {
        ModelSpec {
            hidden: 2048,
            heads: 32,
            query_groups: 4,
            head_dim: 128,
            ffn: 6144,
            vocab: 151_936,
            layers,
            qkv_bias: false,
            tied_embeddings: false,
            make_vocab_size_divisible_by: 128,
            qk_norm: true,
            moe: Some(MoeSpec {
                experts: 128,
                top_k: 8,
                ffn: 768,
                norm_topk_prob: true,
                sparse_step: 1,
                dense_layers: LayerSet::EMPTY,
                shared_ffn: 0,
            }),
        }
    }

    /// Qwen3-235B-A22B with `layers` decoder layers (94 make the real model, 235 B parameters):
    /// hidden 4096, 64 heads in 4 query groups of head dim 128, q/k norms, 128 experts of
    /// intermediate size 1536, top-8, vocabulary 151936, untied head.
    ///
    /// ```
    /// use lifecycle_layout::ModelSpec;
    /// let m = ModelSpec::qwen3_235b_a22b(94);
    /// let n: usize = m.hf_tensors().iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    /// assert_eq!(n, 235_093_634_560);
    /// ```
    pub fn qwen3_235b_a22b(layers: usize) -> Self {
        let base = Self::qwen3_30b_a3b(layers);
        ModelSpec {
            hidden: 4096,
            heads: 64,
            ffn: 12288,
            moe: base.moe.map(|m| MoeSpec { ffn: 1536, ..m }),
            ..base
        }
    }

    /// A small mixture-of-experts model for tests: [`ModelSpec::tiny`] with q/k norms and 4
    /// experts of intermediate size 6 (top-2) in layer 1; layer 0 dense.
    pub fn tiny_moe() -> Self {
        ModelSpec {
            qkv_bias: false,
            qk_norm: true,
            moe: Some(MoeSpec {
                experts: 4,
                top_k: 2,
                ffn: 6,
                norm_topk_prob: true,
                sparse_step: 1,
                dense_layers: LayerSet(1),
                shared_ffn: 0,
            }),
            ..Self::tiny()
        }
    }

    /// Whether layer `l` has a mixture-of-experts MLP (a MoE model, `l` not among its dense
    /// layers, and `(l + 1)` a multiple of the sparse step, as transformers decides).
    pub fn moe_layer(&self, l: usize) -> bool {
        self.moe.is_some_and(|m| {
            !m.dense_layers.contains(l)
                && m.sparse_step > 0
                && (l + 1).is_multiple_of(m.sparse_step)
        })
    }

    /// Whether any layer has a dense MLP of size [`ModelSpec::ffn`] (every layer of a dense
    /// model; the dense layers of a mixture-of-experts one).
    pub fn has_dense_mlp(&self) -> bool {
        (0..self.layers).any(|l| !self.moe_layer(l))
    }

    /// A small model for examples and tests: 2 layers, 8 heads in 2 groups, vocab 37.
    pub fn tiny() -> Self {
        ModelSpec {
            hidden: 16,
            heads: 8,
            query_groups: 2,
            head_dim: 2,
            ffn: 24,
            vocab: 37,
            layers: 2,
            qkv_bias: true,
            tied_embeddings: false,
            make_vocab_size_divisible_by: 4,
            qk_norm: false,
            moe: None,
        }
    }

    /// Checks sizes are non-zero and heads split evenly into query groups.
    pub fn validate(&self) -> Result<(), MegatronLayoutError> {
        let sizes = [
            ("hidden size", self.hidden),
            ("attention heads", self.heads),
            ("query groups", self.query_groups),
            ("head dim", self.head_dim),
            ("ffn hidden size", self.ffn),
            ("vocab size", self.vocab),
            ("layers", self.layers),
            (
                "make_vocab_size_divisible_by",
                self.make_vocab_size_divisible_by,
            ),
        ];
        for (what, size) in sizes {
            if size == 0 {
                return Err(MegatronLayoutError::ZeroSize { what });
            }
        }
        if !self.heads.is_multiple_of(self.query_groups) {
            return Err(MegatronLayoutError::HeadsNotDivisibleByGroups {
                heads: self.heads,
                groups: self.query_groups,
            });
        }
        if let Some(m) = self.moe {
            for (what, size) in [
                ("num_experts", m.experts),
                ("num_experts_per_tok (top-k)", m.top_k),
                ("moe_intermediate_size", m.ffn),
                ("decoder_sparse_step", m.sparse_step),
            ] {
                if size == 0 {
                    return Err(MegatronLayoutError::ZeroSize { what });
                }
            }
            if m.top_k > m.experts {
                return Err(MegatronLayoutError::TopK {
                    top_k: m.top_k,
                    experts: m.experts,
                });
            }
        }
        Ok(())
    }

    /// Query heads per query group.
    pub fn heads_per_group(&self) -> usize {
        self.heads / self.query_groups
    }

    /// Rows of the q projection (`heads · head_dim`).
    pub fn q_rows(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Rows of the k (and of the v) projection (`query_groups · head_dim`).
    pub fn kv_rows(&self) -> usize {
        self.query_groups * self.head_dim
    }

    /// Every Hugging Face parameter with its full shape, in checkpoint order (each projection's
    /// bias right after its weight, as `state_dict()` lists them).
    pub fn hf_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let h = self.hidden;
        let mut out = vec![(hf::EMBED.to_string(), vec![self.vocab, h])];
        for i in 0..self.layers {
            out.push((hf::layer(i, hf::INPUT_NORM), vec![h]));
            for (w, b, rows) in [
                (hf::Q, hf::Q_BIAS, self.q_rows()),
                (hf::K, hf::K_BIAS, self.kv_rows()),
                (hf::V, hf::V_BIAS, self.kv_rows()),
            ] {
                out.push((hf::layer(i, w), vec![rows, h]));
                if self.qkv_bias {
                    out.push((hf::layer(i, b), vec![rows]));
                }
            }
            out.push((hf::layer(i, hf::O), vec![h, self.q_rows()]));
            if self.qk_norm {
                out.push((hf::layer(i, hf::Q_NORM), vec![self.head_dim]));
                out.push((hf::layer(i, hf::K_NORM), vec![self.head_dim]));
            }
            out.push((hf::layer(i, hf::POST_NORM), vec![h]));
            match self.moe {
                Some(m) if self.moe_layer(i) => {
                    out.push((hf::layer(i, hf::ROUTER), vec![m.experts, h]));
                    for e in 0..m.experts {
                        out.push((hf::expert(i, e, hf::EXPERT_GATE), vec![m.ffn, h]));
                        out.push((hf::expert(i, e, hf::EXPERT_UP), vec![m.ffn, h]));
                        out.push((hf::expert(i, e, hf::EXPERT_DOWN), vec![h, m.ffn]));
                    }
                    if m.shared_ffn > 0 {
                        let s = m.shared_ffn;
                        out.push((hf::layer(i, hf::SHARED_GATE), vec![s, h]));
                        out.push((hf::layer(i, hf::SHARED_UP), vec![s, h]));
                        out.push((hf::layer(i, hf::SHARED_DOWN), vec![h, s]));
                        out.push((hf::layer(i, hf::SHARED_EXPERT_GATE), vec![1, h]));
                    }
                }
                _ => {
                    out.push((hf::layer(i, hf::GATE), vec![self.ffn, h]));
                    out.push((hf::layer(i, hf::UP), vec![self.ffn, h]));
                    out.push((hf::layer(i, hf::DOWN), vec![h, self.ffn]));
                }
            }
        }
        out.push((hf::NORM.to_string(), vec![h]));
        if !self.tied_embeddings {
            out.push((hf::LM_HEAD.to_string(), vec![self.vocab, h]));
        }
        out
    }
}

/// Hugging Face parameter names (Qwen2 / Llama) and the fused names of the rollout layout.
pub mod hf {
    /// Input embedding.
    pub const EMBED: &str = "model.embed_tokens.weight";
    /// Final norm.
    pub const NORM: &str = "model.norm.weight";
    /// Output layer (absent with tied embeddings).
    pub const LM_HEAD: &str = "lm_head.weight";
    /// Per-layer suffix: attention input norm.
    pub const INPUT_NORM: &str = "input_layernorm.weight";
    /// Per-layer suffix: q projection.
    pub const Q: &str = "self_attn.q_proj.weight";
    /// Per-layer suffix: k projection.
    pub const K: &str = "self_attn.k_proj.weight";
    /// Per-layer suffix: v projection.
    pub const V: &str = "self_attn.v_proj.weight";
    /// Per-layer suffix: q bias.
    pub const Q_BIAS: &str = "self_attn.q_proj.bias";
    /// Per-layer suffix: k bias.
    pub const K_BIAS: &str = "self_attn.k_proj.bias";
    /// Per-layer suffix: v bias.
    pub const V_BIAS: &str = "self_attn.v_proj.bias";
    /// Per-layer suffix: attention output projection.
    pub const O: &str = "self_attn.o_proj.weight";
    /// Per-layer suffix: MLP input norm.
    pub const POST_NORM: &str = "post_attention_layernorm.weight";
    /// Per-layer suffix: MLP gate projection.
    pub const GATE: &str = "mlp.gate_proj.weight";
    /// Per-layer suffix: MLP up projection.
    pub const UP: &str = "mlp.up_proj.weight";
    /// Per-layer suffix: MLP down projection.
    pub const DOWN: &str = "mlp.down_proj.weight";
    /// Per-layer suffix of the rollout layout: fused `[q; k; v]` weight.
    pub const QKV: &str = "self_attn.qkv_proj.weight";
    /// Per-layer suffix of the rollout layout: fused `[q; k; v]` bias.
    pub const QKV_BIAS: &str = "self_attn.qkv_proj.bias";
    /// Per-layer suffix of the rollout layout: fused `[gate; up]` weight.
    pub const GATE_UP: &str = "mlp.gate_up_proj.weight";

    /// Per-layer suffix (Qwen3): RMSNorm weight of every q head, `[head_dim]`.
    pub const Q_NORM: &str = "self_attn.q_norm.weight";
    /// Per-layer suffix (Qwen3): RMSNorm weight of every k head, `[head_dim]`.
    pub const K_NORM: &str = "self_attn.k_norm.weight";
    /// Per-layer suffix (MoE layers): the router, `[experts, hidden]`.
    pub const ROUTER: &str = "mlp.gate.weight";
    /// Per-layer suffix of the fused rollout layout (MoE layers): the rank's experts stacked,
    /// each `[gate rows; up rows]` of its share, `[local experts, 2 · moe_ffn share, hidden]`
    /// (vLLM's `FusedMoE.w13_weight`).
    pub const EXPERTS_W13: &str = "mlp.experts.w13_weight";
    /// Per-layer suffix of the fused rollout layout (MoE layers): the rank's experts' `down`
    /// columns stacked, `[local experts, hidden, moe_ffn share]` (vLLM's `FusedMoE.w2_weight`).
    pub const EXPERTS_W2: &str = "mlp.experts.w2_weight";
    /// Per-layer suffix (MoE layers with a shared expert): its gate projection,
    /// `[shared_ffn, hidden]`.
    pub const SHARED_GATE: &str = "mlp.shared_expert.gate_proj.weight";
    /// Per-layer suffix: the shared expert's up projection, `[shared_ffn, hidden]`.
    pub const SHARED_UP: &str = "mlp.shared_expert.up_proj.weight";
    /// Per-layer suffix: the shared expert's down projection, `[hidden, shared_ffn]`.
    pub const SHARED_DOWN: &str = "mlp.shared_expert.down_proj.weight";
    /// Per-layer suffix: the shared expert's sigmoid gate, `[1, hidden]` (replicated).
    pub const SHARED_EXPERT_GATE: &str = "mlp.shared_expert_gate.weight";
    /// Per-layer suffix of the fused rollout layout: the shared expert's `[gate; up]`.
    pub const SHARED_GATE_UP: &str = "mlp.shared_expert.gate_up_proj.weight";
    /// Per-expert suffix: gate projection, `[moe_ffn, hidden]`.
    pub const EXPERT_GATE: &str = "gate_proj.weight";
    /// Per-expert suffix: up projection, `[moe_ffn, hidden]`.
    pub const EXPERT_UP: &str = "up_proj.weight";
    /// Per-expert suffix: down projection, `[hidden, moe_ffn]`.
    pub const EXPERT_DOWN: &str = "down_proj.weight";

    /// `model.layers.{i}.{suffix}`.
    pub fn layer(i: usize, suffix: &str) -> String {
        format!("model.layers.{i}.{suffix}")
    }

    /// `model.layers.{i}.mlp.experts.{e}.{suffix}` (the published per-expert names).
    pub fn expert(i: usize, e: usize, suffix: &str) -> String {
        format!("model.layers.{i}.mlp.experts.{e}.{suffix}")
    }

    /// The layer and expert of a per-expert name (`model.layers.{i}.mlp.experts.{e}.…`).
    ///
    /// ```
    /// use lifecycle_layout::hf;
    /// assert_eq!(hf::parse_expert("model.layers.3.mlp.experts.17.up_proj.weight"), Some((3, 17)));
    /// assert_eq!(hf::parse_expert("model.layers.3.mlp.up_proj.weight"), None);
    /// ```
    pub fn parse_expert(name: &str) -> Option<(usize, usize)> {
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let rest = rest.strip_prefix("mlp.experts.")?;
        let (expert, _) = rest.split_once('.')?;
        Some((layer.parse().ok()?, expert.parse().ok()?))
    }
}
