//! Checking one rollout tensor of a layout against a model config.

use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};

use crate::error::DecodeError;

/// The spec of `name` in `layout`, checked to have the shape the config gives it (in
/// `config_shapes`, e.g. [`ModelConfig::tensor_shapes`](crate::ModelConfig::tensor_shapes)) and
/// one of the `allowed` kinds of split (any owner rank matches [`Parallel::Owned`]). Errors name
/// the tensor.
///
/// ```
/// use lifecycle_layout::{Parallel, RolloutLayout, TensorSpec};
/// use lifecycle_decoder::rollout_spec;
/// let layout = RolloutLayout::new(1, vec![TensorSpec::new("w", [4, 2], Parallel::Column)])?;
/// let shapes = vec![("w".to_string(), vec![4, 2])];
/// assert!(rollout_spec(&layout, &shapes, "w", &[Parallel::Column]).is_ok());
/// assert!(rollout_spec(&layout, &shapes, "w", &[Parallel::Row]).is_err());
/// assert!(rollout_spec(&layout, &shapes, "v", &[Parallel::Column]).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rollout_spec<'l>(
    layout: &'l RolloutLayout,
    config_shapes: &[(String, Vec<usize>)],
    name: &str,
    allowed: &[Parallel],
) -> Result<&'l TensorSpec, DecodeError> {
    let spec = layout
        .tensors()
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| DecodeError::MissingTensor {
            name: name.to_string(),
            rank: 0,
        })?;
    if let Some((_, shape)) = config_shapes.iter().find(|(n, _)| n == name)
        && &spec.shape != shape
    {
        return Err(DecodeError::Shape {
            name: name.to_string(),
            rank: 0,
            expected: shape.clone(),
            found: spec.shape.clone(),
        });
    }
    if !allowed.iter().any(|a| a.same_kind(spec.parallel)) {
        let expected = match allowed {
            [one] => one.name(),
            [Parallel::Column, Parallel::Owned { .. }] => "column-parallel or owned by one rank",
            _ => "column-parallel or replicated",
        };
        return Err(DecodeError::Split {
            name: name.to_string(),
            found: spec.parallel.name(),
            expected,
        });
    }
    Ok(spec)
}
