//! vLLM's runtime parameters of a model on one rank: their names and rank-local shapes, in
//! `named_parameters()` order (what its weight-transfer API copies by name with
//! `is_checkpoint_format=False`).
//!
//! The rules, read from vLLM's model source (`qwen2.py`, `qwen3.py`, `qwen3_moe.py`,
//! `QKVParallelLinear`, `MergedColumnParallelLinear`, `VocabParallelEmbedding`, `FusedMoE`;
//! `python/tests/fixtures/vllm_runtime_names.md` cites them): per layer `qkv_proj` (the rank's q
//! heads, then its kv heads' k and v, a kv head replicated on `T / kv` ranks when there are fewer
//! kv heads than ranks), its bias (Qwen2), `o_proj`, the q / k norms (Qwen3), the MLP
//! (`gate_up_proj` and `down_proj`, or the router `gate` and the experts' `w13_weight` /
//! `w2_weight`), then the two norms; the vocabulary padded to a multiple of
//! [`VLLM_VOCAB_PADDING`] and split evenly; a tied head not listed.
//!
//! fp8 rollouts come as vLLM's block-fp8 parameters (`Fp8Config`, `weight_block_size` [128,
//! 128], f32 scales): each quantised matrix's `weight` (e4m3), then its `weight_scale_inv`
//! `[ceil(N / 128), ceil(K / 128)]` (before a bias); FusedMoE's `w13_weight` and `w2_weight`,
//! then their scales. The embedding, the head and the router `mlp.gate` stay bf16, as the
//! rollout keeps them.

use crate::fp8::RolloutDtype;
use crate::{Architecture, ExpertPlacement, LayoutError, ModelConfig};

/// vLLM pads the vocabulary of the embedding and the head to a multiple of this.
pub const VLLM_VOCAB_PADDING: usize = 64;

/// Rows and columns of one fp8 scale block.
const BLOCK: usize = 128;

/// vLLM's runtime parameters of `config` on one rank at tensor-parallel degree `tp`, in
/// `named_parameters()` order: `(name, shape)`. [`ExpertPlacement::Partitioned`] places whole
/// experts on the ranks (`enable_expert_parallel`); [`RolloutDtype::Fp8`] lists vLLM's block-fp8
/// parameters, refusing the degrees vLLM's block checks refuse (a row-parallel input or an
/// expert's width per rank that is not a multiple of 128). Qwen2, Qwen3 and Qwen3-MoE only (the
/// models whose vLLM names are known).
///
/// ```
/// use lifecycle_layout::fp8::RolloutDtype;
/// use lifecycle_layout::vllm::vllm_names;
/// use lifecycle_layout::{ExpertPlacement, ModelConfig};
/// let c = ModelConfig::from_json_str(r#"{"model_type": "qwen2", "vocab_size": 100,
///   "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
///   "num_attention_heads": 4, "num_key_value_heads": 1, "rope_theta": 10000.0}"#)?;
/// let names = vllm_names(&c, 2, ExpertPlacement::TensorParallel, RolloutDtype::Bf16)?;
/// // the vocabulary padded to 128 and split; 2 q heads, the one kv head replicated
/// assert_eq!(names[0], ("model.embed_tokens.weight".to_string(), vec![64, 16]));
/// assert_eq!(names[1], ("model.layers.0.self_attn.qkv_proj.weight".to_string(), vec![16, 16]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn vllm_names(
    config: &ModelConfig,
    tp: usize,
    experts: ExpertPlacement,
    dtype: RolloutDtype,
) -> Result<Vec<(String, Vec<usize>)>, LayoutError> {
    let names = bf16_names(config, tp, experts)?;
    if dtype == RolloutDtype::Bf16 {
        return Ok(names);
    }
    let refuse = |m: String| LayoutError::Vllm(format!("vLLM fp8: {m}"));
    let blocks = |n: usize| n.div_ceil(BLOCK);
    let mut out = Vec::with_capacity(2 * names.len());
    let mut pending = Vec::new();
    for (name, shape) in names {
        out.push((name.clone(), shape.clone()));
        let w13 = name.ends_with("experts.w13_weight");
        let w2 = name.ends_with("experts.w2_weight");
        if w13 || w2 {
            let (e_local, rows, cols) = (shape[0], shape[1], shape[2]);
            let inner = if w2 { cols } else { rows / 2 };
            if !inner.is_multiple_of(BLOCK) {
                return Err(refuse(format!(
                    "{name}: an expert's width per rank {inner} is not a multiple of {BLOCK} at \
                     T={tp}, which vLLM's FusedMoE refuses"
                )));
            }
            pending.push((
                format!("{name}_scale_inv"),
                vec![e_local, blocks(rows), blocks(cols)],
            ));
            if w2 {
                out.append(&mut pending);
            }
        } else if quantised(&name, &shape) {
            let (rows, cols) = (shape[0], shape[1]);
            let row_parallel =
                name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight");
            if tp > 1 && row_parallel && !cols.is_multiple_of(BLOCK) {
                return Err(refuse(format!(
                    "{name}: a row-parallel input of {cols} per rank is not a multiple of {BLOCK} \
                     at T={tp}, which vLLM refuses"
                )));
            }
            let scale = match name.strip_suffix("weight") {
                Some(stem) => format!("{stem}weight_scale_inv"),
                None => format!("{name}_scale_inv"),
            };
            out.push((scale, vec![blocks(rows), blocks(cols)]));
        }
    }
    Ok(out)
}

/// Whether an fp8 rollout quantises vLLM's parameter `name`: the matrices but the embedding,
/// the head and the router (the rollout's exemptions).
fn quantised(name: &str, shape: &[usize]) -> bool {
    shape.len() >= 2
        && name != "model.embed_tokens.weight"
        && name != "lm_head.weight"
        && !name.ends_with("mlp.gate.weight")
}

/// The bf16 parameters ([`vllm_names`] with [`RolloutDtype::Bf16`]).
fn bf16_names(
    config: &ModelConfig,
    tp: usize,
    experts: ExpertPlacement,
) -> Result<Vec<(String, Vec<usize>)>, LayoutError> {
    let refuse = |m: String| LayoutError::Vllm(format!("vLLM names: {m}"));
    let kind = match config.architecture {
        Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => config.architecture,
        Architecture::Llama => return Err(refuse(unknown("llama"))),
        Architecture::Qwen2Moe => return Err(refuse(unknown("qwen2_moe"))),
    };
    if tp == 0 {
        return Err(LayoutError::ZeroDegree {
            what: "rollout tensor-parallel degree T",
        });
    }
    let m = &config.model;
    let (h, heads, kv) = (m.hidden, m.heads, m.query_groups);
    // vLLM's Qwen2 derives the head size from the width; Qwen3 reads it
    let hd = if kind == Architecture::Qwen2 {
        h / heads.max(1)
    } else {
        m.head_dim
    };
    if !heads.is_multiple_of(tp) {
        return Err(refuse(format!(
            "num_attention_heads {heads} is not divisible by T={tp}: choose a T that divides it"
        )));
    }
    if (kv >= tp && !kv.is_multiple_of(tp)) || (kv < tp && !tp.is_multiple_of(kv)) {
        return Err(refuse(format!(
            "num_key_value_heads {kv} and T={tp}: neither divides the other; choose a T that \
             divides it or that it divides"
        )));
    }
    let padded = m.vocab.div_ceil(VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING;
    if !padded.is_multiple_of(tp) {
        return Err(refuse(format!(
            "the padded vocabulary {padded} is not divisible by T={tp}: choose a T that divides \
             it"
        )));
    }
    let (q_local, kv_local, vocab_local) = (heads / tp, (kv / tp).max(1), padded / tp);
    let qkv = (q_local + 2 * kv_local) * hd;
    let spec = config.model_spec(128);
    let moe = m.moe.filter(|_| kind == Architecture::Qwen3Moe);
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![vocab_local, h],
    )];
    let mut push = |name: String, shape: Vec<usize>| out.push((name, shape));
    for i in 0..m.layers {
        let p = format!("model.layers.{i}.");
        push(format!("{p}self_attn.qkv_proj.weight"), vec![qkv, h]);
        if m.qkv_bias {
            push(format!("{p}self_attn.qkv_proj.bias"), vec![qkv]);
        }
        push(format!("{p}self_attn.o_proj.weight"), vec![h, q_local * hd]);
        if m.qk_norm {
            push(format!("{p}self_attn.q_norm.weight"), vec![hd]);
            push(format!("{p}self_attn.k_norm.weight"), vec![hd]);
        }
        match moe.filter(|_| spec.moe_layer(i)) {
            Some(e) => {
                let (e_local, f_local) = match experts {
                    ExpertPlacement::Partitioned => (e.experts / tp, e.ffn),
                    ExpertPlacement::TensorParallel => (e.experts, e.ffn / tp),
                };
                push(format!("{p}mlp.gate.weight"), vec![e.experts, h]);
                push(
                    format!("{p}mlp.experts.w13_weight"),
                    vec![e_local, 2 * f_local, h],
                );
                push(
                    format!("{p}mlp.experts.w2_weight"),
                    vec![e_local, h, f_local],
                );
            }
            None => {
                push(
                    format!("{p}mlp.gate_up_proj.weight"),
                    vec![2 * m.ffn / tp, h],
                );
                push(format!("{p}mlp.down_proj.weight"), vec![h, m.ffn / tp]);
            }
        }
        push(format!("{p}input_layernorm.weight"), vec![h]);
        push(format!("{p}post_attention_layernorm.weight"), vec![h]);
    }
    push("model.norm.weight".to_string(), vec![h]);
    if !m.tied_embeddings {
        push("lm_head.weight".to_string(), vec![vocab_local, h]);
    }
    Ok(out)
}

/// The refusal of a model type whose vLLM names are not known.
fn unknown(kind: &str) -> String {
    format!(
        "model_type `{kind}`: expected qwen2, qwen3 or qwen3_moe (the models whose vLLM names are \
         known); use format=\"hf\" for others"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> ModelConfig {
        let text = format!(
            r#"{{"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rope_theta": 10000.0, {extra}}}"#
        );
        ModelConfig::from_json_str(&text).unwrap()
    }

    #[test]
    fn fp8_lists_each_matrix_then_its_scales_and_refuses_what_vllm_refuses() {
        let c = config(r#""model_type": "qwen3", "head_dim": 64"#);
        let tp = ExpertPlacement::TensorParallel;
        let names = vllm_names(&c, 1, tp, RolloutDtype::Fp8).unwrap();
        let at = |n: &str| names.iter().position(|(x, _)| x == n).unwrap();
        let qkv = "model.layers.0.self_attn.qkv_proj.weight";
        assert_eq!(
            at("model.layers.0.self_attn.qkv_proj.weight_scale_inv"),
            at(qkv) + 1
        );
        assert_eq!(names[at(qkv) + 1].1, vec![4, 2]); // (4 + 2 + 2) × 64 = 512 rows, 256 columns
        assert!(!names
            .iter()
            .any(|(n, _)| n == "model.embed_tokens.weight_scale_inv"));
        // o_proj's 128 inputs per rank at T = 2 fill a block; at T = 4, 64 do not
        assert!(vllm_names(&c, 2, tp, RolloutDtype::Fp8).is_ok());
        let err = vllm_names(&c, 4, tp, RolloutDtype::Fp8)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("o_proj.weight") && err.contains("not a multiple of 128"),
            "{err}"
        );
    }

    #[test]
    fn unknown_models_and_degrees_are_refused_by_name() {
        let llama = config(r#""model_type": "llama""#);
        let err = vllm_names(
            &llama,
            1,
            ExpertPlacement::TensorParallel,
            RolloutDtype::Bf16,
        );
        assert!(err.unwrap_err().to_string().contains("model_type `llama`"));
        let c = config(r#""model_type": "qwen2""#);
        let err = vllm_names(&c, 3, ExpertPlacement::TensorParallel, RolloutDtype::Bf16);
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("num_attention_heads 4"));
    }
}
