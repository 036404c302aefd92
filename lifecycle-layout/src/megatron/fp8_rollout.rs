//! The device form of an fp8 rollout of the fused layout: the switch moves every tensor in bf16
//! into a staging buffer (the bf16 rollout's own layout, [`rollout_offsets`]), then one pass
//! writes the rollout buffer from it: the tensors kept bf16 copied, the others quantised to
//! block-scaled e4m3 in their own 128 × 128 block grid ([`check_fused_fp8`] says when that grid
//! is the one vLLM's fp8 loader builds). A quantised tensor's 2-D view is its last dimension by
//! the others (a stack of expert matrices `[e, rows, cols]` as `(e · rows) × cols`), as the host
//! backend quantises it, so the device rollout is bit-identical to the host's.
//!
//! [`rollout_offsets`]: super::schedule::rollout_offsets
//! [`check_fused_fp8`]: super::check_fused_fp8

use crate::fp8::Fp8Keep;
use crate::steps::Quantise;
use crate::RolloutEntry;

use super::RolloutTensorSpec;

/// Slots (bf16 elements) every quantised tensor's place is aligned to: 128 bytes.
const ALIGN_SLOTS: usize = 64;

fn align(x: usize) -> usize {
    x.div_ceil(ALIGN_SLOTS) * ALIGN_SLOTS
}

/// A run of bf16 elements copied from the staging buffer into the rollout buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedCopy {
    /// First element in the staging buffer.
    pub src: usize,
    /// First slot in the rollout buffer.
    pub dst: usize,
    /// Elements.
    pub len: usize,
}

/// How one rank's fp8 rollout buffer is written from its bf16 staging buffer (the same on every
/// rank: the fused layout gives every rank slices of one shape). Built by [`fp8_rollout`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8Rollout {
    /// One entry per rollout tensor, in rollout order: bf16 ones first in the buffer, packed,
    /// then the fp8 ones, each on 128 bytes.
    pub entries: Vec<RolloutEntry>,
    /// Slots of the rollout buffer.
    pub len: usize,
    /// Elements of the staging buffer (the bf16 rollout's length).
    pub staging_len: usize,
    /// The bf16 tensors' copies, adjacent tensors merged into one run.
    pub copies: Vec<StagedCopy>,
    /// The quantised tensors, `src_off` an element of the staging buffer.
    pub quantise: Vec<Quantise>,
}

impl Fp8Rollout {
    /// Slot ranges of the rollout buffer that neither the copies nor the quantisations write
    /// whole (the alignment gaps between tensors, the padding of the e4m3 bytes to 16, a slot
    /// holding a tensor's odd last byte): zeroed before the pass, they leave no slot of the
    /// buffer unwritten, so the buffer needs no zeroing of its own.
    ///
    /// ```
    /// use lifecycle_layout::megatron::{Fp8Rollout, StagedCopy};
    /// use lifecycle_layout::steps::Quantise;
    /// let f = Fp8Rollout {
    ///     entries: Vec::new(),
    ///     len: 100,
    ///     staging_len: 0,
    ///     copies: vec![StagedCopy { src: 0, dst: 0, len: 10 }],
    ///     // 3 × 3 bytes from byte 32 (slots 16 .. 20, the last one half), its scale at slot 40
    ///     quantise: vec![Quantise { src_off: 0, dst_byte: 32, scale: 20, rows: 3, cols: 3, src_ld: 3 }],
    /// };
    /// assert_eq!(f.gaps(), vec![10..16, 20..40, 42..100]);
    /// ```
    pub fn gaps(&self) -> Vec<std::ops::Range<usize>> {
        let mut written: Vec<std::ops::Range<usize>> =
            self.copies.iter().map(|c| c.dst..c.dst + c.len).collect();
        for q in &self.quantise {
            let (b, n) = (q.dst_byte as usize, (q.rows * q.cols) as usize);
            let s = 2 * q.scale as usize;
            written.push(b.div_ceil(2)..(b + n) / 2);
            written.push(s..s + 2 * q.blocks() as usize);
        }
        written.sort_by_key(|r| r.start);
        let mut gaps = Vec::new();
        let mut at = 0;
        for r in written.into_iter().filter(|r| !r.is_empty()) {
            if r.start > at {
                gaps.push(at..r.start.min(self.len));
            }
            at = at.max(r.end);
        }
        if at < self.len {
            gaps.push(at..self.len);
        }
        gaps
    }

    /// Bytes the pass writes into the rollout buffer.
    pub fn bytes(&self) -> u64 {
        let copied: usize = self.copies.iter().map(|c| c.len).sum();
        2 * copied as u64 + self.quantise.iter().map(Quantise::bytes).sum::<u64>()
    }
}

/// The fp8 rollout of `tensors` (one rank's slices, in rollout order) whose bf16 rollout places
/// them at `offsets` ([`rollout_offsets`](super::schedule::rollout_offsets)); `keep` chooses
/// the tensors that stay bf16. Pure: shapes are checked by [`check_fused_fp8`](super::check_fused_fp8).
///
/// ```
/// use lifecycle_layout::megatron::schedule::rollout_offsets;
/// use lifecycle_layout::megatron::{fp8_rollout, plan_megatron_to_tp, BucketConfig, MegatronLayout};
/// use lifecycle_layout::{ModelSpec, RolloutLayout, RolloutVocab};
/// let model = ModelSpec::tiny();
/// let train = MegatronLayout::from_world(model, 1, 1, 1)?;
/// let rollout = RolloutLayout::fused(1, RolloutVocab::Unpadded);
/// let plan = plan_megatron_to_tp(&train, &rollout, BucketConfig::default())?;
/// let (offsets, staging) = rollout_offsets(&plan);
/// let fp8 = fp8_rollout(&plan.tensors, &offsets, Default::default());
/// assert_eq!(fp8.staging_len, staging);
/// // every matrix but the embedding and the head is quantised
/// let quantised = fp8.entries.iter().filter(|e| e.is_fp8()).count();
/// assert_eq!(quantised, fp8.quantise.len());
/// assert!(quantised > 0 && fp8.entries.iter().any(|e| !e.is_fp8()));
/// # Ok::<(), lifecycle_layout::megatron::MegatronLayoutError>(())
/// ```
pub fn fp8_rollout(tensors: &[RolloutTensorSpec], offsets: &[usize], keep: Fp8Keep) -> Fp8Rollout {
    let kept = |t: &RolloutTensorSpec| keep.keeps_bf16(&t.name, &t.shape);
    let staging_len = tensors
        .iter()
        .zip(offsets)
        .map(|(t, &o)| o + t.numel())
        .max()
        .unwrap_or(0);
    let mut entries: Vec<Option<RolloutEntry>> = vec![None; tensors.len()];
    let mut copies: Vec<StagedCopy> = Vec::new();
    let mut at = 0;
    for (i, (t, &src)) in tensors.iter().zip(offsets).enumerate() {
        if !kept(t) {
            continue;
        }
        let len = t.numel();
        match copies.last_mut() {
            Some(c) if c.src + c.len == src && c.dst + c.len == at => c.len += len,
            _ => copies.push(StagedCopy { src, dst: at, len }),
        }
        entries[i] = Some(RolloutEntry::new(t.name.clone(), t.shape.clone(), at));
        at += len;
    }
    let mut quantise = Vec::new();
    for (i, (t, &src)) in tensors.iter().zip(offsets).enumerate() {
        if kept(t) {
            continue;
        }
        at = align(at);
        let e = RolloutEntry::fp8(t.name.clone(), t.shape.clone(), at);
        let (rows, cols) = e.matrix();
        quantise.push(Quantise {
            src_off: src as u64,
            dst_byte: 2 * at as u64,
            // the scales start on an even slot (16 bytes after the bytes): an f32 index
            scale: e.scale_offset().map_or(0, |s| s / 2) as u64,
            rows: rows as u64,
            cols: cols as u64,
            src_ld: cols as u64,
        });
        at += e.slots();
        entries[i] = Some(e);
    }
    Fp8Rollout {
        entries: entries.into_iter().flatten().collect(),
        len: align(at),
        staging_len,
        copies,
        quantise,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::fp8::{e4m3_from_f32, quantize_blocks};
    use crate::megatron::schedule::rollout_offsets;
    use crate::megatron::{plan_megatron_to_tp, BucketConfig, MegatronLayout};
    use crate::{HostRollout, LayerSet, ModelSpec, MoeSpec, RolloutLayout, RolloutVocab};
    use half::bf16;

    /// The pass on the host, as the device runs it: copies, then each region quantised with
    /// the host's block formula.
    fn apply(f: &Fp8Rollout, staging: &[bf16]) -> Vec<bf16> {
        let mut out = vec![bf16::ZERO; f.len];
        for c in &f.copies {
            out[c.dst..c.dst + c.len].copy_from_slice(&staging[c.src..c.src + c.len]);
        }
        let mut bytes = vec![0u8; 2 * f.len];
        for (i, v) in out.iter().enumerate() {
            bytes[2 * i..2 * i + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
        for q in &f.quantise {
            let (rows, cols) = (q.rows as usize, q.cols as usize);
            let src = q.src_off as usize;
            let x: Vec<f32> = staging[src..src + rows * cols]
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let b = quantize_blocks("t", &x, rows, cols).unwrap();
            let d = q.dst_byte as usize;
            bytes[d..d + rows * cols].copy_from_slice(b.data());
            for (k, s) in b.scale_inv().iter().enumerate() {
                let at = 4 * (q.scale as usize + k);
                bytes[at..at + 4].copy_from_slice(&s.to_le_bytes());
            }
        }
        bytes
            .chunks_exact(2)
            .map(|p| bf16::from_bits(u16::from_le_bytes([p[0], p[1]])))
            .collect()
    }

    /// A model whose fused parts keep whole 128-row blocks, with experts.
    pub(crate) fn moe_model() -> ModelSpec {
        ModelSpec {
            hidden: 256,
            heads: 4,
            query_groups: 2,
            head_dim: 128,
            ffn: 512,
            vocab: 96,
            layers: 2,
            qkv_bias: true,
            tied_embeddings: false,
            make_vocab_size_divisible_by: 1,
            qk_norm: true,
            moe: Some(MoeSpec {
                experts: 4,
                top_k: 2,
                ffn: 256,
                norm_topk_prob: true,
                sparse_step: 1,
                dense_layers: LayerSet::default(),
                shared_ffn: 128,
            }),
        }
    }

    #[test]
    fn the_pass_writes_every_entry_as_the_host_quantises_it() {
        let model = moe_model();
        for t in [1, 2] {
            let train = MegatronLayout::from_world(model, 2, 1, 2).unwrap();
            let rollout = RolloutLayout::fused(t, RolloutVocab::Unpadded);
            let plan = plan_megatron_to_tp(&train, &rollout, BucketConfig::default()).unwrap();
            let (offsets, len) = rollout_offsets(&plan);
            let f = fp8_rollout(&plan.tensors, &offsets, Fp8Keep::default());
            assert_eq!(f.staging_len, len);
            let staging: Vec<bf16> = (0..len)
                .map(|i| bf16::from_f32(((i * 7919 % 1013) as f32 - 506.0) / 97.0))
                .collect();
            let flat = apply(&f, &staging);
            let cut = HostRollout::from_flat(&f.entries, vec![flat]).unwrap();
            let mut stacked = 0;
            for (spec, &o) in plan.tensors.iter().zip(&offsets) {
                let got = cut.ranks[0].tensor(&spec.name).unwrap();
                let values = &staging[o..o + spec.numel()];
                match &got.fp8 {
                    None => {
                        assert!(Fp8Keep::default().keeps_bf16(&spec.name, &spec.shape));
                        assert_eq!(got.data, values, "{}", spec.name);
                    }
                    Some(q) => {
                        let cols = *spec.shape.last().unwrap();
                        let rows = spec.numel() / cols;
                        stacked += usize::from(spec.shape.len() == 3);
                        let x: Vec<f32> = values.iter().map(|v| v.to_f32()).collect();
                        let want = quantize_blocks(&spec.name, &x, rows, cols).unwrap();
                        assert_eq!((q.rows(), q.cols()), (rows, cols), "{}", spec.name);
                        assert_eq!(q.data(), want.data(), "{}", spec.name);
                        assert_eq!(q.scale_inv(), want.scale_inv(), "{}", spec.name);
                        // a spot check of the byte formula itself
                        let s = want.scale_inv()[0];
                        assert_eq!(q.data()[0], e4m3_from_f32(x[0] / s));
                    }
                }
            }
            assert!(stacked > 0, "the model's stacked experts are quantised");
            // the bf16 tensors are packed first, each quantised one on 128 bytes
            for e in &f.entries {
                assert!(e.range().end <= f.len, "{}", e.name());
                if e.is_fp8() {
                    assert_eq!(e.offset() % ALIGN_SLOTS, 0);
                }
            }
            let kept: usize = f.copies.iter().map(|c| c.len).sum();
            assert!(f.copies.len() < plan.tensors.len() - f.quantise.len());
            assert!(
                f.len < len,
                "fp8 rollout smaller than bf16: {} vs {len}",
                f.len
            );
            assert!(f.bytes() > 2 * kept as u64);
        }
    }

    #[test]
    fn keeping_every_tensor_bf16_is_one_copy() {
        let model = moe_model();
        let train = MegatronLayout::from_world(model, 1, 1, 1).unwrap();
        let rollout = RolloutLayout::fused(1, RolloutVocab::Unpadded);
        let plan = plan_megatron_to_tp(&train, &rollout, BucketConfig::default()).unwrap();
        let (offsets, len) = rollout_offsets(&plan);
        let keep: Fp8Keep = "attention,layer:0,layer:1".parse().unwrap();
        let f = fp8_rollout(&plan.tensors, &offsets, keep);
        assert!(f.quantise.is_empty());
        assert_eq!(
            f.copies,
            vec![StagedCopy {
                src: 0,
                dst: 0,
                len
            }]
        );
    }

    #[test]
    fn the_training_side_rule_quantises_what_the_rollout_side_rule_does() {
        let model = moe_model();
        let train = MegatronLayout::from_world(model, 1, 1, 1).unwrap();
        let rollout = RolloutLayout::fused(1, RolloutVocab::Unpadded);
        let plan = plan_megatron_to_tp(&train, &rollout, BucketConfig::default()).unwrap();
        for keep in ["none", "attention", "layer:1", "attention,layer:0"] {
            let keep: Fp8Keep = keep.parse().unwrap();
            let rollout_side: usize = plan
                .tensors
                .iter()
                .filter(|t| !keep.keeps_bf16(&t.name, &t.shape))
                .map(RolloutTensorSpec::numel)
                .sum();
            let train_side: usize = train
                .stage_slots(0)
                .iter()
                .filter(|s| crate::megatron::quantised_param(s, keep))
                .map(|s| s.shape.iter().product::<usize>())
                .sum();
            assert_eq!(train_side, rollout_side, "keep {keep}");
            assert!(rollout_side > 0, "keep {keep}");
        }
    }
}
