//! Rollout weights in host memory: what the CPU executors produce and what GPU rollouts are
//! downloaded into for bit comparisons.

use half::bf16;

use crate::fp8::BlockQuantized;
use crate::RolloutEntry;

/// One rollout tensor slice of one rank: bf16 values, or block-scaled e4m3 in an fp8 rollout
/// ([`RolloutDtype::Fp8`](crate::fp8::RolloutDtype)).
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutTensor {
    /// Name (as in the rollout layout).
    pub name: String,
    /// Shape of this rank's slice.
    pub shape: Vec<usize>,
    /// Row-major bf16 values; empty when the slice is held in fp8 (`fp8`).
    pub data: Vec<bf16>,
    /// The slice in block-scaled e4m3 (its 2-D view: the first dimension by the rest), when the
    /// rollout is fp8 and the tensor is quantised.
    pub fp8: Option<BlockQuantized>,
}

impl RolloutTensor {
    /// A bf16 slice.
    pub fn bf16(name: impl Into<String>, shape: Vec<usize>, data: Vec<bf16>) -> Self {
        RolloutTensor {
            name: name.into(),
            shape,
            data,
            fp8: None,
        }
    }

    /// An fp8 slice of shape `shape` (whose 2-D view `q` holds).
    pub fn fp8(name: impl Into<String>, shape: Vec<usize>, q: BlockQuantized) -> Self {
        RolloutTensor {
            name: name.into(),
            shape,
            data: Vec::new(),
            fp8: Some(q),
        }
    }

    /// Bytes of the slice as held: two per bf16 element, or the fp8 bytes and their scales.
    pub fn bytes(&self) -> u64 {
        self.fp8
            .as_ref()
            .map_or((self.data.len() * 2) as u64, BlockQuantized::bytes)
    }

    /// Elements of the slice.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Element `i` (row-major) as f32: the bf16 value, or the fp8 value dequantised.
    pub fn value(&self, i: usize) -> f32 {
        match &self.fp8 {
            Some(q) => q.value(i / q.cols(), i % q.cols()),
            None => self.data[i].to_f32(),
        }
    }
}

/// The rollout weights of one rank, in rollout-layout order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RankRollout {
    /// One slice per rollout tensor.
    pub tensors: Vec<RolloutTensor>,
}

impl RankRollout {
    /// A slice by name.
    pub fn tensor(&self, name: &str) -> Option<&RolloutTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Bytes of all slices.
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(RolloutTensor::bytes).sum()
    }
}

/// Rollout weights of every rank.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HostRollout {
    /// Indexed by rank.
    pub ranks: Vec<RankRollout>,
}

impl HostRollout {
    /// Cuts each rank's flat rollout buffer (downloaded from a device, in local-rank order) into
    /// its tensors at `entries`; `None` if a buffer is shorter than the entries need.
    ///
    /// ```
    /// use half::bf16;
    /// use lifecycle_layout::{HostRollout, RolloutEntry};
    /// let entries = [RolloutEntry::new("a", vec![2], 0), RolloutEntry::new("b", vec![1], 2)];
    /// let flat = vec![bf16::from_f32(1.0), bf16::from_f32(2.0), bf16::from_f32(3.0)];
    /// let r = HostRollout::from_flat(&entries, vec![flat]).unwrap();
    /// assert_eq!(r.ranks[0].tensor("b").unwrap().data[0].to_f32(), 3.0);
    /// ```
    pub fn from_flat(entries: &[RolloutEntry], flats: Vec<Vec<bf16>>) -> Option<HostRollout> {
        let per_rank = vec![entries; flats.len()];
        Self::from_rank_flats(&per_rank, flats)
    }

    /// As [`HostRollout::from_flat`] with each rank's own entries (`entries[r]` for `flats[r]`:
    /// layouts whose ranks hold different tensors, such as partitioned experts).
    pub fn from_rank_flats(
        entries: &[impl AsRef<[RolloutEntry]>],
        flats: Vec<Vec<bf16>>,
    ) -> Option<HostRollout> {
        if entries.len() != flats.len() {
            return None;
        }
        let ranks = flats
            .into_iter()
            .zip(entries)
            .map(|(flat, entries)| {
                let tensors = entries
                    .as_ref()
                    .iter()
                    .map(|e| {
                        Some(RolloutTensor::bf16(
                            e.name(),
                            e.shape().to_vec(),
                            flat.get(e.range())?.to_vec(),
                        ))
                    })
                    .collect::<Option<Vec<_>>>()?;
                Some(RankRollout { tensors })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(HostRollout { ranks })
    }

    /// Index of the first tensor whose bits differ between `self` and `other`, with its rank and
    /// name, or `None` if they are bit-identical.
    pub fn first_difference(&self, other: &HostRollout) -> Option<(usize, String)> {
        if self.ranks.len() != other.ranks.len() {
            return Some((
                self.ranks.len().min(other.ranks.len()),
                "<rank count>".into(),
            ));
        }
        for (rank, (a, b)) in self.ranks.iter().zip(&other.ranks).enumerate() {
            if a.tensors.len() != b.tensors.len() {
                return Some((rank, "<tensor count>".into()));
            }
            for (x, y) in a.tensors.iter().zip(&b.tensors) {
                let same = x.name == y.name
                    && x.shape == y.shape
                    && x.data.len() == y.data.len()
                    && x.data
                        .iter()
                        .zip(&y.data)
                        .all(|(p, q)| p.to_bits() == q.to_bits())
                    && x.fp8 == y.fp8;
                if !same {
                    return Some((rank, x.name.clone()));
                }
            }
        }
        None
    }
}
