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
    /// The slice in block-scaled e4m3 (its 2-D view, [`RolloutEntry::matrix`]), when the
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

/// Entry `e` of a flat buffer: its bf16 values, or its e4m3 bytes (two per slot, low byte
/// first, as device memory holds them) and f32 block scales.
fn cut(e: &RolloutEntry, flat: &[bf16]) -> Option<RolloutTensor> {
    let Some(scale_at) = e.scale_offset() else {
        return Some(RolloutTensor::bf16(
            e.name(),
            e.shape().to_vec(),
            flat.get(e.range())?.to_vec(),
        ));
    };
    let slots = flat.get(e.range())?;
    let data: Vec<u8> = slots
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .take(e.numel())
        .collect();
    let (br, bc) = e.blocks();
    let scale_inv: Vec<f32> = flat
        .get(scale_at..scale_at + 2 * br * bc)?
        .chunks_exact(2)
        .map(|p| f32::from_bits(u32::from(p[0].to_bits()) | (u32::from(p[1].to_bits()) << 16)))
        .collect();
    let (rows, cols) = e.matrix();
    let q = BlockQuantized::from_parts(e.name(), rows, cols, data, scale_inv).ok()?;
    Some(RolloutTensor::fp8(e.name(), e.shape().to_vec(), q))
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
                    .map(|e| cut(e, &flat))
                    .collect::<Option<Vec<_>>>()?;
                Some(RankRollout { tensors })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(HostRollout { ranks })
    }

    /// Each rank's flat buffer of `len` slots with its tensors at `entries[r]`, the inverse of
    /// [`HostRollout::from_rank_flats`] (fp8 bytes two per slot, low byte first; scales as two
    /// slots, low half first); `None` if a tensor is missing, of another dtype than its entry,
    /// or does not fit.
    ///
    /// ```
    /// use half::bf16;
    /// use lifecycle_layout::fp8::quantize_blocks;
    /// use lifecycle_layout::{HostRollout, RankRollout, RolloutEntry, RolloutTensor};
    /// let q = quantize_blocks("w", &[1.0, -2.0, 0.5], 1, 3).unwrap();
    /// let r = HostRollout { ranks: vec![RankRollout { tensors: vec![
    ///     RolloutTensor::bf16("n", vec![2], vec![bf16::ONE; 2]),
    ///     RolloutTensor::fp8("w", vec![1, 3], q),
    /// ] }] };
    /// let entries = vec![vec![RolloutEntry::new("n", vec![2], 0), RolloutEntry::fp8("w", vec![1, 3], 64)]];
    /// let flats = r.to_rank_flats(&entries, 128).unwrap();
    /// assert_eq!(HostRollout::from_rank_flats(&entries, flats), Some(r));
    /// ```
    pub fn to_rank_flats(
        &self,
        entries: &[impl AsRef<[RolloutEntry]>],
        len: usize,
    ) -> Option<Vec<Vec<bf16>>> {
        if entries.len() != self.ranks.len() {
            return None;
        }
        self.ranks
            .iter()
            .zip(entries)
            .map(|(rank, entries)| {
                let mut flat = vec![bf16::ZERO; len];
                for e in entries.as_ref() {
                    let t = rank.tensor(e.name())?;
                    let dst = flat.get_mut(e.range())?;
                    match (&t.fp8, e.scale_offset()) {
                        (None, None) => dst.copy_from_slice(t.data.get(..e.numel())?),
                        (Some(q), Some(at)) => {
                            for (slot, pair) in dst.iter_mut().zip(q.data().chunks(2)) {
                                let hi = pair.get(1).copied().unwrap_or(0);
                                *slot = bf16::from_bits(u16::from_le_bytes([pair[0], hi]));
                            }
                            let scales = flat.get_mut(at..at + 2 * q.scale_inv().len())?;
                            for (pair, s) in scales.chunks_exact_mut(2).zip(q.scale_inv()) {
                                let bits = s.to_bits();
                                pair[0] = bf16::from_bits(bits as u16);
                                pair[1] = bf16::from_bits((bits >> 16) as u16);
                            }
                        }
                        _ => return None,
                    }
                }
                Some(flat)
            })
            .collect()
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
