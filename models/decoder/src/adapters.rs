//! The LoRA adapters a rollout holds, checked against the configuration a decoder is given: the
//! one rule the CPU and GPU decoders both apply before they read an adapter.

use lifecycle_layout::lora::{adapter_name, LoraConfig, LoraPart, LoraTarget};

use crate::DecodeError;

/// Checks the adapters a rollout holds against `lora`, by name, before anything is read: with
/// a configuration, every target it lists is held on every rank of every layer (the MLP ones on
/// the `dense` layers only), of its rank `r`, and nothing else is; without one, no adapter is
/// held (a LoRA model is never decoded on its base alone: `constructor` names the call that
/// takes the configuration). `held(layer, target)` gives, per rank, the rank `r` of the adapter
/// held there (`None`: none).
///
/// ```
/// use lifecycle_decoder::check_adapters;
/// use lifecycle_layout::lora::{LoraConfig, LoraTarget};
///
/// let lora = LoraConfig::new(8, 16.0, vec![LoraTarget::Q]);
/// // two layers, one rank, q adapted everywhere with r = 8
/// let held = |_l: usize, t: LoraTarget| vec![(t == LoraTarget::Q).then_some(8)];
/// check_adapters(2, |_| true, Some(&lora), held, "new_lora")?;
/// // the same rollout decoded without the configuration: refused
/// let e = check_adapters(2, |_| true, None, held, "new_lora").unwrap_err();
/// assert!(e.to_string().contains("model.layers.0.self_attn.q_proj.lora_A.weight"));
/// # Ok::<(), lifecycle_decoder::DecodeError>(())
/// ```
pub fn check_adapters(
    layers: usize,
    dense: impl Fn(usize) -> bool,
    lora: Option<&LoraConfig>,
    held: impl Fn(usize, LoraTarget) -> Vec<Option<usize>>,
    constructor: &str,
) -> Result<(), DecodeError> {
    for l in 0..layers {
        for t in LoraTarget::ALL {
            let name = adapter_name(&t.base_name(l), LoraPart::A);
            let want = lora.is_some_and(|c| c.targets.contains(&t) && (dense(l) || !t.in_mlp()));
            for (rank, r) in held(l, t).into_iter().enumerate() {
                match (r, lora) {
                    (Some(_), None) => {
                        return Err(DecodeError::Usage(format!(
                            "the rollout holds LoRA adapters (`{name}` first): give their \
                             configuration ({constructor}), whose scaling the products need"
                        )));
                    }
                    (None, _) if want => {
                        return Err(DecodeError::MissingTensor { name, rank });
                    }
                    (Some(_), Some(_)) if !want => {
                        return Err(DecodeError::Usage(format!(
                            "the rollout holds adapter `{name}`, whose module `{t}` the LoRA \
                             configuration does not target"
                        )));
                    }
                    (Some(r), Some(c)) if r != c.rank => {
                        return Err(DecodeError::Usage(format!(
                            "adapter `{name}` on rank {rank} has rank r = {r}, the LoRA \
                             configuration {}",
                            c.rank
                        )));
                    }
                    _ => {}
                }
            }
        }
    }
    Ok(())
}
