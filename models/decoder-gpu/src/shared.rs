//! A frozen base the rollout reads where the trainer keeps it ([`SharedBase`]): a LoRA model's
//! bf16 base matrices, read in place instead of from the rollout buffer, so the device holds the
//! base once. The decoder addresses every weight from one base address: with a shared base it is
//! the lowest of the buffer's and the shared tensors' addresses, and each entry's slot is counted
//! from there ([`SharedBase::entries`]).

use lifecycle_decoder::DecodeError;
use lifecycle_layout::{RolloutEntry, RolloutLayout};

use crate::GpuDecodeError;

/// The alignment, in bytes, a shared tensor's address must have: the products' 16-byte loads of
/// whole rows, and the 128-byte rows the tensor-core kernels stage, start on it as they do in a
/// rollout buffer.
pub const SHARED_ALIGN: u64 = 256;

/// One bf16 tensor of a shared base: its name in the rollout layout, its shape (the whole
/// tensor: a shared base is read at `T = 1`) and its device address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedTensor {
    /// Name in the rollout layout (Hugging Face's, as the rollout buffer's entries).
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Device address of its first element (bf16, row-major, contiguous).
    pub address: u64,
}

/// The tensors of a model a rollout reads in place, outside its rollout buffer (a frozen bf16
/// base the trainer holds), and the layout of the whole model they and the buffer's tensors
/// make ([`GpuEngine::share_base`](crate::GpuEngine::share_base)).
///
/// ```
/// use lifecycle_decoder_gpu::{SharedBase, SharedTensor};
/// use lifecycle_layout::{Parallel, RolloutEntry, RolloutLayout, TensorSpec};
/// let layout = RolloutLayout::new(1, vec![
///     TensorSpec::new("w", [4, 8], Parallel::Column),
///     TensorSpec::new("n", [8], Parallel::Replicated),
/// ])?;
/// let base = SharedBase::new(layout, vec![SharedTensor { name: "w".into(), shape: vec![4, 8], address: 0x1000 }])?;
/// // the buffer at 0x2000 holds `n`; `w` lies 0x1000 bytes (2048 slots) before it
/// let (at, entries) = base.entries(0x2000, &[RolloutEntry::new("n", vec![8], 0)])?;
/// assert_eq!(at, 0x1000);
/// assert_eq!(entries[0].offset(), 2048);
/// assert_eq!((entries[1].name(), entries[1].offset()), ("w", 0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct SharedBase {
    layout: RolloutLayout,
    tensors: Vec<SharedTensor>,
}

impl SharedBase {
    /// The shared `tensors` of the model of `layout` (its whole rollout layout, `T = 1`): each
    /// named once, with its layout shape, at an address aligned to [`SHARED_ALIGN`]; refused by
    /// name otherwise.
    pub fn new(layout: RolloutLayout, tensors: Vec<SharedTensor>) -> Result<Self, GpuDecodeError> {
        let bad = |name: &str, problem: String| -> GpuDecodeError {
            DecodeError::Usage(format!("shared base tensor `{name}`: {problem}")).into()
        };
        if layout.tp() != 1 {
            return Err(DecodeError::Usage(format!(
                "a shared base is read in place at T = 1; the layout has T = {}",
                layout.tp()
            ))
            .into());
        }
        let mut seen = std::collections::HashSet::new();
        for t in &tensors {
            let spec = layout
                .tensors()
                .iter()
                .find(|s| s.name == t.name)
                .ok_or_else(|| bad(&t.name, "not a tensor of the rollout layout".into()))?;
            if spec.shape != t.shape {
                return Err(bad(
                    &t.name,
                    format!("shape {:?}, the layout's is {:?}", t.shape, spec.shape),
                ));
            }
            if t.address == 0 || !t.address.is_multiple_of(SHARED_ALIGN) {
                return Err(bad(
                    &t.name,
                    format!(
                        "at {:#x}: read in place only from an address aligned to {SHARED_ALIGN} \
                         bytes (a tensor of its own allocation)",
                        t.address
                    ),
                ));
            }
            if !seen.insert(t.name.as_str()) {
                return Err(bad(&t.name, "given twice".into()));
            }
        }
        Ok(SharedBase { layout, tensors })
    }

    /// The whole model's rollout layout.
    pub fn layout(&self) -> &RolloutLayout {
        &self.layout
    }

    /// The shared tensors.
    pub fn tensors(&self) -> &[SharedTensor] {
        &self.tensors
    }

    /// The base address the decoder counts every slot from, for a rollout buffer at `buffer`
    /// holding `entries` (bf16 elements, two bytes a slot): the lowest address of all, and the
    /// entries of the buffer and of the shared tensors counted from it. A name in both is
    /// refused.
    pub fn entries(
        &self,
        buffer: u64,
        entries: &[RolloutEntry],
    ) -> Result<(u64, Vec<RolloutEntry>), GpuDecodeError> {
        if let Some(e) = entries
            .iter()
            .find(|e| self.tensors.iter().any(|t| t.name == e.name()))
        {
            return Err(DecodeError::Usage(format!(
                "tensor `{}`: both in the rollout buffer and in the shared base",
                e.name()
            ))
            .into());
        }
        let at = self
            .tensors
            .iter()
            .map(|t| t.address)
            .chain([buffer])
            .min()
            .unwrap_or(buffer);
        // the addresses are even (checked aligned; the buffer's bf16), so the slots are whole
        let slots = |address: u64| ((address - at) / 2) as usize;
        let mut out: Vec<RolloutEntry> = entries.iter().map(|e| e.moved(slots(buffer))).collect();
        out.extend(
            self.tensors
                .iter()
                .map(|t| RolloutEntry::new(t.name.clone(), t.shape.clone(), slots(t.address))),
        );
        Ok((at, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lifecycle_layout::{Parallel, TensorSpec};

    fn layout() -> RolloutLayout {
        RolloutLayout::new(
            1,
            vec![
                TensorSpec::new("a", [2, 128], Parallel::Column),
                TensorSpec::new("b", [128], Parallel::Replicated),
            ],
        )
        .unwrap()
    }

    fn at(name: &str, address: u64) -> SharedTensor {
        let shape = if name == "a" { vec![2, 128] } else { vec![128] };
        SharedTensor {
            name: name.into(),
            shape,
            address,
        }
    }

    #[test]
    fn shared_tensors_are_checked_by_name_and_counted_from_the_lowest_address() {
        let err = |t: Vec<SharedTensor>| SharedBase::new(layout(), t).unwrap_err().to_string();
        assert!(err(vec![at("c", 0x1000)]).contains("`c`: not a tensor"));
        let mut wrong = at("a", 0x1000);
        wrong.shape = vec![128, 2];
        assert!(err(vec![wrong]).contains("shape [128, 2]"));
        assert!(err(vec![at("a", 0x1080)]).contains("aligned to 256"));
        assert!(err(vec![at("a", 0x1000), at("a", 0x2000)]).contains("given twice"));
        let tp2 = RolloutLayout::new(2, layout().tensors().to_vec()).unwrap();
        assert!(SharedBase::new(tp2, vec![])
            .unwrap_err()
            .to_string()
            .contains("T = 1"));

        // the buffer below the shared tensor: counted from the buffer
        let base = SharedBase::new(layout(), vec![at("a", 0x9000)]).unwrap();
        let (from, e) = base
            .entries(0x1000, &[RolloutEntry::new("b", vec![128], 4)])
            .unwrap();
        assert_eq!(from, 0x1000);
        assert_eq!((e[0].offset(), e[1].offset()), (4, 0x4000));
        // a name in both is refused
        let both = base.entries(0x1000, &[RolloutEntry::new("a", vec![2, 128], 0)]);
        assert!(both.unwrap_err().to_string().contains("both"));
    }
}
