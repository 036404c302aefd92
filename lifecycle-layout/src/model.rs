//! The model description and its Hugging Face (Qwen2 / Llama) parameter names.

use crate::megatron::MegatronLayoutError;

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
        }
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
            out.push((hf::layer(i, hf::POST_NORM), vec![h]));
            out.push((hf::layer(i, hf::GATE), vec![self.ffn, h]));
            out.push((hf::layer(i, hf::UP), vec![self.ffn, h]));
            out.push((hf::layer(i, hf::DOWN), vec![h, self.ffn]));
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

    /// `model.layers.{i}.{suffix}`.
    pub fn layer(i: usize, suffix: &str) -> String {
        format!("model.layers.{i}.{suffix}")
    }
}
