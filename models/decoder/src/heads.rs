//! Which attention heads each rank of a tensor-parallel group computes.

use lifecycle_layout::{Parallel, RolloutLayout};

use crate::config::ModelConfig;
use crate::error::DecodeError;
use crate::spec_check::rollout_spec;

/// The heads one TP rank computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShare {
    /// Global index of the rank's first query head.
    pub q_base: usize,
    /// Global index of the first kv head the rank computes.
    pub kv_base: usize,
    /// Kv heads the rank computes.
    pub kv_heads: usize,
}

/// The head shares of the `tp` ranks of a group: query heads split evenly; kv heads split evenly
/// when the layout splits k/v by column (which must not cut a head), otherwise (k/v replicated)
/// each rank computes the kv heads its query heads use — vLLM's rule when there are fewer kv
/// heads than ranks.
///
/// ```
/// use lifecycle_layout::{Parallel, RolloutLayout};
/// use lifecycle_decoder::{head_shares, ModelConfig};
/// let config = ModelConfig::from_json_str(r#"{"model_type": "qwen2", "vocab_size": 64, "rope_theta": 10000.0,
///     "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
///     "num_attention_heads": 4, "num_key_value_heads": 1}"#)?;
/// let shares = head_shares(&config, 2, Parallel::Replicated)?;
/// assert_eq!((shares[1].q_base, shares[1].kv_base, shares[1].kv_heads), (2, 0, 1));
/// assert!(head_shares(&config, 2, Parallel::Column).is_err()); // would cut the one kv head
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn head_shares(
    config: &ModelConfig,
    tp: usize,
    kv_split: Parallel,
) -> Result<Vec<HeadShare>, DecodeError> {
    if tp == 0 || !config.model.heads.is_multiple_of(tp) {
        return Err(DecodeError::Degree {
            tp,
            reason: format!(
                "num_attention_heads {} is not divisible by T",
                config.model.heads
            ),
        });
    }
    if kv_split == Parallel::Column && !config.model.query_groups.is_multiple_of(tp) {
        return Err(DecodeError::Split {
            name: "model.layers.0.self_attn.k_proj.weight".into(),
            found: "column-parallel",
            expected: "replicated when num_key_value_heads does not divide by T (a column split would cut a kv head in pieces; build the layout with ModelConfig::rollout_layout)",
        });
    }
    let q_heads = config.model.heads / tp;
    let group = config.model.heads / config.model.query_groups;
    Ok((0..tp)
        .map(|rank| {
            let q_base = rank * q_heads;
            match kv_split {
                Parallel::Column => HeadShare {
                    q_base,
                    kv_base: rank * config.model.query_groups / tp,
                    kv_heads: config.model.query_groups / tp,
                },
                _ => {
                    let first = q_base / group;
                    let last = (q_base + q_heads - 1) / group;
                    HeadShare {
                        q_base,
                        kv_base: first,
                        kv_heads: last - first + 1,
                    }
                }
            }
        })
        .collect())
}

/// How `layout` splits k/v (read from its first k projection, checked against `config`'s shapes:
/// column-parallel or replicated) and the head shares of its TP ranks ([`head_shares`]).
pub fn layout_heads(
    config: &ModelConfig,
    layout: &RolloutLayout,
) -> Result<(Parallel, Vec<HeadShare>), DecodeError> {
    let kv_split = if config.model.layers > 0 {
        rollout_spec(
            layout,
            &config.tensor_shapes(),
            "model.layers.0.self_attn.k_proj.weight",
            &[Parallel::Column, Parallel::Replicated],
        )?
        .parallel
    } else {
        Parallel::Column
    };
    Ok((kv_split, head_shares(config, layout.tp(), kv_split)?))
}
