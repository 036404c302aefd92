//! Where each rollout tensor sits in a rank's flat rollout buffer, whatever layout produced it.

/// One rollout tensor's place in a rank's flat rollout buffer: the same entries on every rank of
/// a layout (the slices of a tensor-parallel group have one shape).
///
/// ```
/// use lifecycle_layout::RolloutEntry;
/// let e = RolloutEntry::new("model.norm.weight", vec![64], 128);
/// assert_eq!(e.numel(), 64);
/// assert_eq!(e.range(), 128..192);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutEntry {
    name: String,
    shape: Vec<usize>,
    offset: usize,
    numel: usize,
}

impl RolloutEntry {
    /// The entry of tensor `name` (this rank's slice has `shape`) at element `offset`.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, offset: usize) -> Self {
        let numel = shape.iter().product();
        RolloutEntry {
            name: name.into(),
            shape,
            offset,
            numel,
        }
    }

    /// Tensor name (the rollout layout's: unfused Hugging Face names, or fused ones such as
    /// `model.layers.0.self_attn.qkv_proj.weight`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Shape of the rank's slice.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element offset in the rank's buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// The elements of the buffer it covers.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.numel
    }
}
