//! Rollout weights in host memory: what the CPU executors produce and what GPU rollouts are
//! downloaded into for bit comparisons.

use half::bf16;

use crate::RolloutEntry;

/// One rollout tensor slice of one rank, in bf16.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutTensor {
    /// Name (as in the rollout layout).
    pub name: String,
    /// Shape of this rank's slice.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<bf16>,
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
        self.tensors.iter().map(|t| (t.data.len() * 2) as u64).sum()
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
                        Some(RolloutTensor {
                            name: e.name().to_string(),
                            shape: e.shape().to_vec(),
                            data: flat.get(e.range())?.to_vec(),
                        })
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
                        .all(|(p, q)| p.to_bits() == q.to_bits());
                if !same {
                    return Some((rank, x.name.clone()));
                }
            }
        }
        None
    }
}
