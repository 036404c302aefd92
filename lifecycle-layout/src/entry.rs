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
    /// Slots of the e4m3 bytes, when the slice is fp8 (its scales follow them).
    fp8_slots: Option<usize>,
}

/// Buffer slots (two bytes each) that `numel` e4m3 bytes take, rounded up to 8 slots so the
/// scales after them start on 16 bytes.
fn fp8_data_slots(numel: usize) -> usize {
    numel.div_ceil(2).div_ceil(8) * 8
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
            fp8_slots: None,
        }
    }

    /// The entry of an fp8 slice (block-scaled e4m3, [`crate::fp8`]) at slot `offset` of a
    /// rank's buffer (slots of two bytes, the buffer's bf16 elements): its e4m3 bytes, row-major,
    /// from byte `2 · offset`, then one f32 `scale_inv` per 128 × 128 block of its 2-D view
    /// ([`RolloutEntry::matrix`]) from slot [`RolloutEntry::scale_offset`].
    ///
    /// ```
    /// use lifecycle_layout::RolloutEntry;
    /// let e = RolloutEntry::fp8("model.layers.0.mlp.up_proj.weight", vec![256, 130], 64);
    /// assert_eq!((e.numel(), e.blocks()), (256 * 130, (2, 2)));
    /// // 33280 bytes in 16640 slots, then 4 scales of two slots each
    /// assert_eq!(e.scale_offset(), Some(64 + 16640));
    /// assert_eq!(e.range(), 64..64 + 16640 + 8);
    /// ```
    pub fn fp8(name: impl Into<String>, shape: Vec<usize>, offset: usize) -> Self {
        let numel = shape.iter().product();
        RolloutEntry {
            name: name.into(),
            shape,
            offset,
            numel,
            fp8_slots: Some(fp8_data_slots(numel)),
        }
    }

    /// Whether the slice is fp8.
    pub fn is_fp8(&self) -> bool {
        self.fp8_slots.is_some()
    }

    /// Rows and columns of the 2-D view: a matrix as it is, a vector as one column, and a
    /// stack of matrices (`[e, rows, cols]`, such as the fused layout's expert tensors) as
    /// `(e · rows) × cols`, the view vLLM's fused-MoE fp8 scales are laid out in.
    ///
    /// ```
    /// use lifecycle_layout::RolloutEntry;
    /// assert_eq!(RolloutEntry::new("w", vec![256, 130], 0).matrix(), (256, 130));
    /// assert_eq!(RolloutEntry::new("b", vec![130], 0).matrix(), (130, 1));
    /// assert_eq!(RolloutEntry::fp8("w13", vec![4, 256, 128], 0).matrix(), (1024, 128));
    /// ```
    pub fn matrix(&self) -> (usize, usize) {
        if self.shape.len() < 3 {
            let rows = self.shape.first().copied().unwrap_or(1);
            return (rows, self.numel / rows.max(1));
        }
        let cols = self.shape.last().copied().unwrap_or(1);
        (self.numel / cols.max(1), cols)
    }

    /// Scale blocks of an fp8 slice's 2-D view, `(⌈rows/128⌉, ⌈cols/128⌉)`; `(0, 0)` for bf16.
    pub fn blocks(&self) -> (usize, usize) {
        if !self.is_fp8() {
            return (0, 0);
        }
        let (rows, cols) = self.matrix();
        (
            rows.div_ceil(crate::fp8::FP8_BLOCK),
            cols.div_ceil(crate::fp8::FP8_BLOCK),
        )
    }

    /// Slot of an fp8 slice's first block scale (`None` for bf16).
    pub fn scale_offset(&self) -> Option<usize> {
        self.fp8_slots.map(|s| self.offset + s)
    }

    /// Buffer slots the slice takes: its elements in bf16; its bytes (rounded up to 16) and
    /// its scales in fp8.
    pub fn slots(&self) -> usize {
        match self.fp8_slots {
            Some(data) => {
                let (r, c) = self.blocks();
                data + 2 * r * c
            }
            None => self.numel,
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

    /// Element (slot) offset in the rank's buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Elements of the slice.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// The slots of the buffer it covers ([`RolloutEntry::slots`]).
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.slots()
    }

    /// The same slice `by` slots further on (the entry as seen from a base `by` slots before
    /// its buffer).
    ///
    /// ```
    /// use lifecycle_layout::RolloutEntry;
    /// let e = RolloutEntry::fp8("w", vec![128, 128], 64).moved(100);
    /// assert_eq!((e.offset(), e.scale_offset()), (164, Some(164 + 8192)));
    /// ```
    pub fn moved(&self, by: usize) -> Self {
        RolloutEntry {
            offset: self.offset + by,
            ..self.clone()
        }
    }

    /// Bytes of the slice as held.
    pub fn bytes(&self) -> u64 {
        match self.fp8_slots {
            Some(_) => {
                let (r, c) = self.blocks();
                (self.numel + 4 * r * c) as u64
            }
            None => 2 * self.numel as u64,
        }
    }
}
