//! Per-rank Megatron training state with real offload accounting.

use std::collections::{HashMap, HashSet};

use crate::{cast_f32_to_bf16, MemoryMeter};
use half::bf16;
use lifecycle_layout::{AdamParams, HostTensor};

use super::error::MegatronError;
use super::shard::{rank_buffers, FullTensors};
use lifecycle_layout::megatron::{MegatronLayout, OptimizerShard, ParamKind};

/// Where a buffer of one rank lives, with its values.
#[derive(Debug, Clone)]
pub enum Resident<T> {
    /// In the rank's device memory (counted by its meter).
    Device(Vec<T>),
    /// Offloaded: a separate host allocation; the device original was freed.
    Host(Box<[T]>),
}

impl<T: Copy> Resident<T> {
    /// The values, wherever they live.
    pub fn values(&self) -> &[T] {
        match self {
            Resident::Device(v) => v,
            Resident::Host(v) => v,
        }
    }

    /// The values if they are in device memory; `None` while offloaded.
    pub fn on_device(&self) -> Option<&[T]> {
        match self {
            Resident::Device(v) => Some(v),
            Resident::Host(_) => None,
        }
    }

    fn bytes(&self) -> u64 {
        std::mem::size_of_val(self.values()) as u64
    }

    /// Copies a device buffer to a fresh host allocation and frees the original; the bytes moved.
    pub fn offload(&mut self, meter: &mut MemoryMeter) -> u64 {
        if let Resident::Device(v) = self {
            let host: Box<[T]> = v.as_slice().into();
            let bytes = self.bytes();
            *self = Resident::Host(host);
            meter.free(bytes);
            bytes
        } else {
            0
        }
    }

    /// Copies a host buffer back to a fresh device allocation; the bytes moved.
    pub fn reload(&mut self, meter: &mut MemoryMeter) -> u64 {
        if let Resident::Host(h) = self {
            let bytes = std::mem::size_of_val(&h[..]) as u64;
            meter.alloc(bytes);
            *self = Resident::Device(h.to_vec());
            bytes
        } else {
            0
        }
    }
}

/// Everything one training rank holds, as plain data: what an executor copies in with
/// [`MegatronTrainState::from_ranks`] (which checks it against the layout) or reads back with
/// [`MegatronTrainState::rank`].
#[derive(Debug, Clone)]
pub struct RankTrain {
    /// bf16 parameters of the rank, the whole buffer (dense part, then expert part).
    pub params: Resident<bf16>,
    /// fp32 grads of the whole buffer; freed in rollout mode.
    pub grads: Option<Vec<f32>>,
    /// Elements of the buffer this rank's optimizer owns
    /// ([`MegatronLayout::optimizer_shard`]).
    pub shard: OptimizerShard,
    /// fp32 main params of `shard`.
    pub main: Resident<f32>,
    /// Adam first moment of `shard`.
    pub adam_m: Resident<f32>,
    /// Adam second moment of `shard`.
    pub adam_v: Resident<f32>,
    /// Device-memory accounting of the rank.
    pub meter: MemoryMeter,
}

/// The training state of `W = TP × PP × DP` ranks in Megatron-Core's layout (see
/// [`MegatronLayout`]): per rank the bf16 parameters of its (stage, TP rank) in one contiguous
/// buffer and fp32 grads of the same length, plus its distributed-optimizer shard of the fp32
/// main params and Adam m, v. Every rank keeps a [`MemoryMeter`] of its device memory.
///
/// ```
/// use lifecycle_layout::megatron::MegatronLayout;
/// use lifecycle_layout::ModelSpec;
/// use lifecycle_state::megatron::MegatronTrainState;
/// use lifecycle_layout::HostTensor;
/// let model = ModelSpec::tiny();
/// let tensors: Vec<HostTensor> = model.hf_tensors().into_iter().map(|(name, shape)| {
///     let n = shape.iter().product();
///     HostTensor::f32(name, shape, vec![0.5; n])
/// }).collect();
/// let state = MegatronTrainState::from_hf(MegatronLayout::new(model, 2, 2, 1)?, tensors)?;
/// assert_eq!(state.world(), 4);
/// assert_eq!(state.params(0).unwrap()[0].to_f32(), 0.5);
/// # Ok::<(), lifecycle_state::megatron::MegatronError>(())
/// ```
#[derive(Debug, Clone)]
pub struct MegatronTrainState {
    layout: MegatronLayout,
    ranks: Vec<RankTrain>,
    adam_steps: u64,
}

impl MegatronTrainState {
    /// Shards full Hugging Face tensors into the Megatron layout: bf16 params are the fp32 main
    /// params rounded to nearest even; vocabulary padding rows are zero; grads and Adam moments
    /// start at zero. Checks every tensor (present, expected, unique, shape, float dtype, element
    /// count) before building anything.
    pub fn from_hf(
        layout: MegatronLayout,
        tensors: Vec<HostTensor>,
    ) -> Result<Self, MegatronError> {
        let values = check_hf(&layout, &tensors)?;
        let full: FullTensors<'_> = values
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        let buffers = rank_buffers(&layout, &full);
        let ranks = buffers
            .iter()
            .enumerate()
            .map(|(rank, buf)| {
                let shard = layout.optimizer_shard(rank);
                let mut params = vec![bf16::ZERO; buf.len()];
                cast_f32_to_bf16(buf, &mut params);
                let n = shard.len();
                let mut meter = MemoryMeter::default();
                meter.alloc((buf.len() * (2 + 4) + n * 4 * 3) as u64);
                RankTrain {
                    params: Resident::Device(params),
                    grads: Some(vec![0.0; buf.len()]),
                    main: Resident::Device(shard.indices().map(|i| buf[i]).collect()),
                    adam_m: Resident::Device(vec![0.0; n]),
                    adam_v: Resident::Device(vec![0.0; n]),
                    shard,
                    meter,
                }
            })
            .collect();
        Ok(MegatronTrainState {
            layout,
            ranks,
            adam_steps: 0,
        })
    }

    /// Assembles a state from every rank's buffers (rank order), as an executor that kept them
    /// elsewhere hands them back. Checks each rank against the layout: its stage buffer's length,
    /// its optimizer shard, and the lengths of grads, main params and Adam moments.
    pub fn from_ranks(
        layout: MegatronLayout,
        ranks: Vec<RankTrain>,
        adam_steps: u64,
    ) -> Result<Self, MegatronError> {
        if ranks.len() != layout.world() {
            return Err(MegatronError::Inconsistent {
                what: format!(
                    "{} ranks given for a layout of W = {}",
                    ranks.len(),
                    layout.world()
                ),
            });
        }
        for (rank, r) in ranks.iter().enumerate() {
            let c = layout.coords(rank);
            let (len, shard) = (layout.stage_len(c.pp), layout.optimizer_shard(rank));
            let bad = |what: &str, found: usize, expected: usize| MegatronError::Inconsistent {
                what: format!(
                    "rank {rank}: {what} has {found} elements, the layout needs {expected}"
                ),
            };
            if r.params.values().len() != len {
                return Err(bad(
                    "the bf16 parameter buffer",
                    r.params.values().len(),
                    len,
                ));
            }
            if let Some(g) = &r.grads
                && g.len() != len
            {
                return Err(bad("the grads", g.len(), len));
            }
            if r.shard != shard {
                return Err(MegatronError::Inconsistent {
                    what: format!(
                        "rank {rank}: optimizer shard {:?}, the layout gives {shard:?}",
                        r.shard
                    ),
                });
            }
            for (what, b) in [
                ("the main params", &r.main),
                ("Adam m", &r.adam_m),
                ("Adam v", &r.adam_v),
            ] {
                if b.values().len() != shard.len() {
                    return Err(bad(what, b.values().len(), shard.len()));
                }
            }
        }
        Ok(MegatronTrainState {
            layout,
            ranks,
            adam_steps,
        })
    }

    /// Every buffer of `rank`, read-only.
    pub fn rank(&self, rank: usize) -> Option<&RankTrain> {
        self.ranks.get(rank)
    }

    /// Every rank's buffers, in rank order: the executors' view of the state (the layout and the
    /// number of ranks cannot change through it).
    pub fn ranks(&self) -> &[RankTrain] {
        &self.ranks
    }

    /// Every rank's buffers, to offload, reload or rewrite in place.
    pub fn ranks_mut(&mut self) -> &mut [RankTrain] {
        &mut self.ranks
    }

    /// Adam steps taken so far.
    pub fn adam_steps(&self) -> u64 {
        self.adam_steps
    }

    /// The training layout.
    pub fn layout(&self) -> &MegatronLayout {
        &self.layout
    }

    /// W.
    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// The bf16 parameter buffer of `rank` (its (stage, TP rank)); `None` while offloaded.
    pub fn params(&self, rank: usize) -> Option<&[bf16]> {
        self.ranks.get(rank)?.params.on_device()
    }

    /// The bf16 parameter buffer of `rank`, offloaded or not.
    pub fn params_anywhere(&self, rank: usize) -> Option<&[bf16]> {
        Some(self.ranks.get(rank)?.params.values())
    }

    /// The fp32 main-param shard of `rank` and the buffer elements it covers; `None` while
    /// offloaded.
    pub fn main_shard(&self, rank: usize) -> Option<(OptimizerShard, &[f32])> {
        let r = self.ranks.get(rank)?;
        Some((r.shard.clone(), r.main.on_device()?))
    }

    /// Device-memory accounting of `rank`.
    pub fn memory(&self, rank: usize) -> Option<MemoryMeter> {
        self.ranks.get(rank).map(|r| r.meter)
    }

    /// Whether any params, main params or optimizer state are offloaded.
    pub fn is_offloaded(&self) -> bool {
        self.ranks.iter().any(|r| {
            r.params.on_device().is_none()
                || r.main.on_device().is_none()
                || r.adam_m.on_device().is_none()
                || r.adam_v.on_device().is_none()
        })
    }

    /// Calls `f(rank, grads)` on every rank's fp32 grad buffer (stage-buffer order). Fails if the
    /// grads are freed (rollout mode).
    pub fn for_each_grads_mut(
        &mut self,
        mut f: impl FnMut(usize, &mut [f32]),
    ) -> Result<(), MegatronError> {
        if self.ranks.iter().any(|r| r.grads.is_none()) {
            return Err(MegatronError::Offloaded {
                operation: "writing grads",
            });
        }
        for (rank, r) in self.ranks.iter_mut().enumerate() {
            if let Some(g) = r.grads.as_mut() {
                f(rank, g);
            }
        }
        Ok(())
    }

    /// Sets every rank's grads from full Hugging Face-named gradients (checked like
    /// [`MegatronTrainState::from_hf`]): each DP replica gets the same grads; with tied
    /// embeddings and PP > 1 the last stage's output-layer copy gets zeros (the full gradient is
    /// on the embedding, and the tied all-reduce in [`MegatronTrainState::adam_step`] sums them).
    pub fn set_grads_from_hf(&mut self, grads: Vec<HostTensor>) -> Result<(), MegatronError> {
        if self.ranks.iter().any(|r| r.grads.is_none()) {
            return Err(MegatronError::Offloaded {
                operation: "writing grads",
            });
        }
        let l = &self.layout;
        let values = check_hf(l, &grads)?;
        let full: FullTensors<'_> = values
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        let mut buffers = rank_buffers(l, &full);
        if l.model().tied_embeddings
            && l.pp() > 1
            && let Some(slot) = l.slot(l.pp() - 1, ParamKind::OutputLayer, None)
        {
            for (rank, b) in buffers.iter_mut().enumerate() {
                if l.coords(rank).pp == l.pp() - 1 {
                    b[slot.offset..slot.offset + slot.numel()].fill(0.0);
                }
            }
        }
        for (r, b) in self.ranks.iter_mut().zip(&buffers) {
            if let Some(g) = r.grads.as_mut() {
                g.copy_from_slice(b);
            }
        }
        Ok(())
    }

    /// Zeroes Adam's moments and its step count: a fresh optimizer on the current weights (the
    /// GPU backend's synthetic states hold round-trip test data in m and v, with negative v,
    /// which no Adam step may read).
    pub fn reset_optimizer(&mut self) -> Result<(), MegatronError> {
        if self.is_offloaded() {
            return Err(MegatronError::Offloaded {
                operation: "resetting the optimizer",
            });
        }
        for r in &mut self.ranks {
            for b in [&mut r.adam_m, &mut r.adam_v] {
                if let Resident::Device(v) = b {
                    v.fill(0.0);
                }
            }
        }
        self.adam_steps = 0;
        Ok(())
    }

    /// One optimizer step as Megatron runs it: tied-embedding grads all-reduced between the first
    /// and last stage (PP > 1), grads averaged into each rank's shard (reduce-scatter) over the
    /// DP group for the dense part and over the expert data-parallel group for the expert part,
    /// Adam with bias correction on the fp32 main shard, then the updated shards rounded to bf16
    /// and gathered into every replica's parameter buffer.
    pub fn adam_step(&mut self, p: AdamParams) -> Result<(), MegatronError> {
        if self.is_offloaded() || self.ranks.iter().any(|r| r.grads.is_none()) {
            return Err(MegatronError::Offloaded {
                operation: "the optimizer step",
            });
        }
        let l = self.layout.clone();
        if l.model().tied_embeddings && l.pp() > 1 {
            self.all_reduce_tied_grads(&l);
        }
        let t = (self.adam_steps + 1) as i32;
        let (c1, c2) = (1.0 - p.beta1.powi(t), 1.0 - p.beta2.powi(t));
        let groups: Vec<[Vec<usize>; 2]> = (0..self.ranks.len())
            .map(|rank| [l.dp_group(rank), l.expert_dp_group(rank)])
            .collect();
        let average = |ranks: &[RankTrain], group: &[usize], i: usize| -> f32 {
            let sum: f32 = group
                .iter()
                .map(|&o| ranks[o].grads.as_ref().map_or(0.0, |g| g[i]))
                .sum();
            sum / group.len() as f32
        };
        for (rank, [dense, experts]) in groups.iter().enumerate() {
            let shard = self.ranks[rank].shard.clone();
            let reduced: Vec<f32> = shard
                .dense()
                .map(|i| average(&self.ranks, dense, i))
                .chain(shard.experts().map(|i| average(&self.ranks, experts, i)))
                .collect();
            let r = &mut self.ranks[rank];
            let (Resident::Device(main), Resident::Device(m), Resident::Device(v)) =
                (&mut r.main, &mut r.adam_m, &mut r.adam_v)
            else {
                continue; // unreachable: checked above
            };
            for (i, g) in reduced.into_iter().enumerate() {
                m[i] = p.beta1 * m[i] + (1.0 - p.beta1) * g;
                v[i] = p.beta2 * v[i] + (1.0 - p.beta2) * g * g;
                main[i] -= p.lr * (m[i] / c1) / ((v[i] / c2).sqrt() + p.eps);
            }
        }
        // all-gather: every replica's buffer from the owners' updated shards
        let gathered: Vec<Vec<bf16>> = groups
            .iter()
            .enumerate()
            .map(|(rank, groups)| {
                let mut params = vec![bf16::ZERO; l.stage_len(l.coords(rank).pp)];
                for (part, group) in groups.iter().enumerate() {
                    for &owner in group {
                        let o = &self.ranks[owner];
                        let (range, at) = o.shard.parts()[part].clone();
                        cast_f32_to_bf16(
                            &o.main.values()[at..at + range.len()],
                            &mut params[range],
                        );
                    }
                }
                params
            })
            .collect();
        for (r, g) in self.ranks.iter_mut().zip(gathered) {
            r.params = Resident::Device(g);
        }
        self.adam_steps += 1;
        Ok(())
    }

    /// Sums the grads of the embedding (first stage) and its output-layer copy (last stage) so
    /// both copies stay identical, as Megatron's embedding group does.
    fn all_reduce_tied_grads(&mut self, l: &MegatronLayout) {
        let (Some(emb), Some(out)) = (
            l.slot(0, ParamKind::WordEmbedding, None),
            l.slot(l.pp() - 1, ParamKind::OutputLayer, None),
        ) else {
            return;
        };
        let (e, o, n) = (emb.offset, out.offset, emb.numel());
        for tp in 0..l.tp() {
            for d in 0..l.dp() {
                let (first, last) = (l.rank(tp, d, 0), l.rank(tp, d, l.pp() - 1));
                let a: Vec<f32> = self.ranks[first]
                    .grads
                    .as_ref()
                    .map_or_else(Vec::new, |g| g[e..e + n].to_vec());
                if let Some(g) = self.ranks[last].grads.as_mut() {
                    for (x, y) in g[o..o + n].iter_mut().zip(&a) {
                        *x += *y;
                    }
                    let sum = g[o..o + n].to_vec();
                    if let Some(g0) = self.ranks[first].grads.as_mut() {
                        g0[e..e + n].copy_from_slice(&sum);
                    }
                }
            }
        }
    }

    /// A bitwise snapshot of every buffer (params, grads, main, m, v) for round-trip tests.
    pub fn snapshot(&self) -> Vec<Vec<u32>> {
        self.ranks
            .iter()
            .flat_map(|r| {
                let params: Vec<u32> = r
                    .params
                    .values()
                    .iter()
                    .map(|x| x.to_bits().into())
                    .collect();
                let f = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                [
                    params,
                    f(r.grads.as_deref().unwrap_or(&[])),
                    f(r.main.values()),
                    f(r.adam_m.values()),
                    f(r.adam_v.values()),
                ]
            })
            .collect()
    }
}

/// Checks full Hugging Face tensors against the model (present, expected, unique, shape, float
/// dtype, element count) and widens them to fp32.
fn check_hf(
    layout: &MegatronLayout,
    tensors: &[HostTensor],
) -> Result<HashMap<String, Vec<f32>>, MegatronError> {
    let expected: HashMap<String, Vec<usize>> = layout.model().hf_tensors().into_iter().collect();
    let mut seen = HashSet::new();
    let mut values: HashMap<String, Vec<f32>> = HashMap::new();
    for t in tensors {
        let Some(shape) = expected.get(&t.name) else {
            return Err(MegatronError::UnexpectedTensor {
                name: t.name.clone(),
            });
        };
        if !seen.insert(t.name.as_str()) {
            return Err(MegatronError::DuplicateTensor {
                name: t.name.clone(),
            });
        }
        if *shape != t.shape {
            return Err(MegatronError::ShapeMismatch {
                name: t.name.clone(),
                expected: shape.clone(),
                found: t.shape.clone(),
            });
        }
        let n: usize = shape.iter().product();
        if t.data.len() != n {
            return Err(MegatronError::ElementCount {
                name: t.name.clone(),
                shape: t.shape.clone(),
                expected: n,
                found: t.data.len(),
            });
        }
        let Some(v) = t.data.to_f32() else {
            return Err(MegatronError::DType {
                name: t.name.clone(),
                found: t.data.dtype(),
            });
        };
        values.insert(t.name.clone(), v);
    }
    for (name, _) in layout.model().hf_tensors() {
        if !values.contains_key(&name) {
            return Err(MegatronError::MissingTensor { name });
        }
    }
    Ok(values)
}
