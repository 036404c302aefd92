//! The CPU reference decoder: runs a TP group's rollout slices rank by rank, sums the row-parallel
//! partial outputs (the all-reduce), and keeps a KV cache per sequence and rank.

use lifecycle_layout::fp8::Fp8Compute;
use lifecycle_layout::RankRollout;
use lifecycle_layout::RolloutLayout;

use crate::config::ModelConfig;
use crate::decoder::{Decoder, PrefillLogits};
use crate::error::DecodeError;
use crate::math::{linear, rms_norm, route_top_k, softmax, swiglu, Rope};
use crate::weights::{GroupWeights, Lora, Mlp, MlpPart, Routing, SharedExpert, VocabWeight};
use crate::KvDtype;
use half::bf16;

/// Keys and values of one rank's kv heads for one layer, `[position][kv_heads · head_dim]`.
#[derive(Debug, Clone, Default)]
struct KvCache {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Sequences a [`CpuDecoder`] holds as a [`SlotDecoder`](crate::SlotDecoder) unless told.
pub const DEFAULT_SLOTS: usize = 64;

/// One sequence's cache: `layers[l][rank]`, and its length.
#[derive(Debug, Clone)]
struct SeqCache {
    len: usize,
    layers: Vec<Vec<KvCache>>,
}

/// The Qwen2 / Llama decoder on the CPU, reading one tensor-parallel group's rollout weights
/// directly: bf16, or block-scaled e4m3 (an fp8 rollout, each weight row dequantised once per
/// product as `e4m3 × scale_inv`); activations and accumulation in f32.
///
/// ```
/// use lifecycle_core::Lifecycle;
/// use lifecycle_decoder::{random_tensors, CpuDecoder, Decoder, ModelConfig, Sampling};
/// use lifecycle_host::{HostBackend, HostTrainState};
///
/// let config = ModelConfig::from_json_str(r#"{"model_type": "qwen2", "vocab_size": 32,
///   "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
///   "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}"#)?;
/// let layout = config.rollout_layout(2)?;
/// let state = HostTrainState::from_tensors(2, random_tensors(&config, 1))?;
/// let mut lc = Lifecycle::new(HostBackend::new(layout.clone()), state);
/// let session = lc.rollout()?;
/// let weights = session.weights();
/// let group: Vec<_> = weights.ranks.iter().collect();
/// let mut decoder = CpuDecoder::new(&config, &layout, &group)?;
/// let out = decoder.generate(&[vec![1, 2, 3], vec![4]], &Sampling::greedy(5))?;
/// assert_eq!(out.iter().map(Vec::len).collect::<Vec<_>>(), vec![5, 5]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct CpuDecoder<'w> {
    config: ModelConfig,
    w: GroupWeights<'w>,
    rope: Rope,
    seqs: Vec<SeqCache>,
    fp8: Fp8Compute,
    kv: KvDtype,
    /// The LoRA adapters' scaling `s` (`lifecycle_layout::lora::LoraConfig::scaling`; 1 and
    /// unused without adapters).
    lora_scaling: f32,
    /// KV slots and positions per slot as a [`SlotDecoder`](crate::SlotDecoder).
    pub(crate) slot_room: (usize, usize),
    /// As a paged [`SlotDecoder`](crate::SlotDecoder): the paging it reports and the positions
    /// each slot's mapped pages hold ([`CpuDecoder::with_kv_pages`]).
    pub(crate) paged: Option<(crate::KvPaging, Vec<usize>)>,
}

impl<'w> CpuDecoder<'w> {
    /// A decoder over `group`: the rollout weights of TP ranks `0..T` of one replica, in order,
    /// laid out as `layout` says. Every tensor is checked against `config` and `layout` here.
    pub fn new(
        config: &ModelConfig,
        layout: &RolloutLayout,
        group: &[&'w RankRollout],
    ) -> Result<Self, DecodeError> {
        let w = GroupWeights::new(config, layout, group)?;
        w.check_lora(None)?;
        Ok(Self::of(config, w))
    }

    /// A decoder over `group` (as [`CpuDecoder::new`]) whose rollout holds the LoRA adapters of
    /// `lora` beside their bases (`lifecycle_layout::lora::with_adapters`): every adapted linear
    /// computes `x·Wᵀ (+ bias) + s·(x·Aᵀ)·Bᵀ` on its rank's slices, unmerged, `s` the
    /// configuration's scaling, in f32 as PEFT adds it. Refused by name: an adapter of another
    /// rank `r`, a target the configuration lists that the rollout lacks, or one it holds that
    /// the configuration does not list.
    pub fn new_lora(
        config: &ModelConfig,
        layout: &RolloutLayout,
        group: &[&'w RankRollout],
        lora: &lifecycle_layout::lora::LoraConfig,
    ) -> Result<Self, DecodeError> {
        let w = GroupWeights::new(config, layout, group)?;
        w.check_lora(Some(lora))?;
        let mut d = Self::of(config, w);
        d.lora_scaling = lora.scaling() as f32;
        Ok(d)
    }

    fn of(config: &ModelConfig, w: GroupWeights<'w>) -> Self {
        CpuDecoder {
            config: config.clone(),
            w,
            rope: Rope::new(config.model.head_dim, config.rope_theta),
            seqs: Vec::new(),
            fp8: Fp8Compute::WeightOnly,
            kv: KvDtype::F32,
            lora_scaling: 1.0,
            slot_room: (DEFAULT_SLOTS, usize::MAX),
            paged: None,
        }
    }

    /// A decoder over `group` in the fused rollout layout of the Megatron backend
    /// (`lifecycle_host::megatron::MegatronHostBackend`): per rank `qkv_proj` = `[q; k; v]` of its
    /// heads, `gate_up_proj` = `[gate; up]`, a vocabulary-parallel embedding and head that may
    /// carry padding rows ([`RolloutVocab`](lifecycle_layout::RolloutVocab)), which are
    /// never read. `group` is TP ranks `0..T` of one replica, in order. Every tensor is checked
    /// against `config` and `layout` here; the fused tensors are viewed, not copied, as the q, k,
    /// v, gate and up weights [`CpuDecoder::new`] reads, so the logits are bit for bit those of
    /// the unfused layout holding the same bf16 weights.
    ///
    /// ```
    /// use lifecycle_core::Lifecycle;
    /// use lifecycle_decoder::{
    ///     random_tensors, CpuDecoder, Decoder, MegatronConfig, MegatronParallel, ModelConfig,
    ///     Sampling,
    /// };
    /// use lifecycle_layout::{RolloutLayout, RolloutVocab};
    /// use lifecycle_host::megatron::MegatronHostBackend;
    ///
    /// let config = ModelConfig::from_json_str(r#"{"model_type": "qwen2", "vocab_size": 31,
    ///   "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
    ///   "num_attention_heads": 4, "num_key_value_heads": 1, "rope_theta": 10000.0}"#)?;
    /// let state = config.megatron_state(random_tensors(&config, 1), MegatronParallel::new(2, 2, 1))?;
    /// // 31 rows padded to 32 for T = 2; the one kv head replicated on both ranks
    /// let layout = RolloutLayout::fused(2, RolloutVocab::PadToMultipleOf(8));
    /// let mut lc = Lifecycle::new(MegatronHostBackend::new(layout.clone()), state);
    /// let session = lc.rollout()?;
    /// let weights = session.weights();
    /// let group: Vec<_> = weights.ranks[2..].iter().collect(); // the second replica
    /// let mut decoder = CpuDecoder::new_fused(&config, &layout, &group)?;
    /// let out = decoder.generate(&[vec![1, 2, 3]], &Sampling::greedy(4))?;
    /// assert!(out[0].len() == 4 && out[0].iter().all(|&t| t < 31));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new_fused(
        config: &ModelConfig,
        layout: &lifecycle_layout::RolloutLayout,
        group: &[&'w RankRollout],
    ) -> Result<Self, DecodeError> {
        Ok(Self::of(
            config,
            GroupWeights::fused(config, layout, group)?,
        ))
    }

    /// The same decoder holding `slots` sequences of at most `positions` positions each as a
    /// [`SlotDecoder`](crate::SlotDecoder) (by default [`DEFAULT_SLOTS`] of any length: the
    /// CPU's KV grows as needed, so the bounds only shape the schedule, e.g. to match an
    /// engine's).
    ///
    /// ```
    /// use lifecycle_decoder::{CpuDecoder, SlotDecoder};
    /// fn four(d: CpuDecoder<'_>) -> CpuDecoder<'_> {
    ///     let d = d.with_slots(4, 1024);
    ///     assert_eq!((d.slots(), d.slot_positions()), (4, 1024));
    ///     d
    /// }
    /// ```
    pub fn with_slots(mut self, slots: usize, positions: usize) -> Self {
        self.slot_room = (slots.max(1), positions);
        if let Some((paging, _)) = self.paged {
            return self.with_kv_pages(paging.pages_per_group, paging.page_positions);
        }
        self
    }

    /// The same slot decoder paged as an engine's KV cache: `pages` pages of `page_positions`
    /// for all its slots, which the scheduler reserves at admission as it does an engine's
    /// ([`KvPages`](crate::KvPages)), a group's samples sharing their prompt's full pages. The
    /// CPU's KV is not paged (each slot grows its own): a slot only refuses positions past the
    /// pages mapped to it, so that runs compare with an engine's admission for admission.
    ///
    /// ```
    /// use lifecycle_decoder::{CpuDecoder, KvPaging, SlotDecoder};
    /// fn paged(d: CpuDecoder<'_>) -> CpuDecoder<'_> {
    ///     let d = d.with_slots(8, 256).with_kv_pages(20, 16);
    ///     let want = KvPaging { page_positions: 16, pages_per_group: 20, slots_per_group: 8 };
    ///     assert_eq!(d.paging(), Some(want));
    ///     d
    /// }
    /// ```
    pub fn with_kv_pages(mut self, pages: usize, page_positions: usize) -> Self {
        let paging = crate::KvPaging {
            page_positions: page_positions.max(1),
            pages_per_group: pages,
            slots_per_group: self.slot_room.0,
        };
        self.paged = Some((paging, vec![0; self.slot_room.0]));
        self
    }

    /// Positions slot `slot` may hold: its mapped pages' when paged.
    pub(crate) fn room_of(&self, slot: usize) -> usize {
        match &self.paged {
            Some((_, room)) => room.get(slot).map_or(0, |&r| r.min(self.slot_room.1)),
            None => self.slot_room.1,
        }
    }

    /// The model config.
    pub(crate) fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    /// Drops what slot `slot` holds (the slots grow to include it).
    pub(crate) fn reset_slot(&mut self, slot: usize) {
        let tp = self.w.shares.len();
        let empty = SeqCache {
            len: 0,
            layers: vec![vec![KvCache::default(); tp]; self.config.model.layers],
        };
        if self.seqs.len() <= slot {
            self.seqs.resize(slot + 1, empty.clone());
        }
        self.seqs[slot] = empty;
    }

    /// Tokens in slot `slot`'s cache (0 for a slot never filled).
    pub(crate) fn slot_len(&self, slot: usize) -> usize {
        self.seqs.get(slot).map_or(0, |s| s.len)
    }

    /// Tokens in each sequence's cache.
    pub fn lengths(&self) -> Vec<usize> {
        self.seqs.iter().map(|s| s.len).collect()
    }

    /// The same decoder computing its fp8 products as `compute` says (weight-only by default;
    /// bf16 weights are not affected).
    ///
    /// ```
    /// use lifecycle_decoder::CpuDecoder;
    /// use lifecycle_layout::fp8::Fp8Compute;
    ///
    /// fn w8a8(decoder: CpuDecoder<'_>) -> CpuDecoder<'_> {
    ///     let d = decoder.with_fp8_compute(Fp8Compute::W8A8);
    ///     assert_eq!(d.fp8_compute(), Fp8Compute::W8A8);
    ///     d
    /// }
    /// ```
    pub fn with_fp8_compute(mut self, compute: Fp8Compute) -> Self {
        self.fp8 = compute;
        self
    }

    /// Computes the fp8 products of the next passes as `compute` says (see
    /// [`CpuDecoder::with_fp8_compute`]).
    pub fn set_fp8_compute(&mut self, compute: Fp8Compute) {
        self.fp8 = compute;
    }

    /// How fp8 products are computed.
    pub fn fp8_compute(&self) -> Fp8Compute {
        self.fp8
    }

    /// Keeps the K and V of the positions stored from now on as `kv` says: f32 (the default,
    /// the exact mode the transformers oracles are matched in), bf16 (each element rounded to
    /// nearest even when stored, as a bf16 engine keeps it: the reference of the GPU decoder's
    /// bf16 cache) or fp8 (e4m3 with one scale per position and kv head,
    /// [`KvDtype::store_head`]). Set it before a prefill. Never fails today; the `Result` is
    /// kept for dtypes a decoder may refuse.
    ///
    /// ```
    /// use lifecycle_decoder::{CpuDecoder, KvDtype};
    ///
    /// fn fp8_cache(decoder: &mut CpuDecoder<'_>) -> Result<(), lifecycle_decoder::DecodeError> {
    ///     decoder.set_kv_dtype(KvDtype::Fp8)?;
    ///     assert_eq!(decoder.kv_dtype(), KvDtype::Fp8);
    ///     Ok(())
    /// }
    /// ```
    pub fn set_kv_dtype(&mut self, kv: KvDtype) -> Result<(), DecodeError> {
        self.kv = kv;
        Ok(())
    }

    /// The element type of the KV cache.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv
    }

    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let h = self.config.model.hidden;
        let mut x = Vec::with_capacity(tokens.len() * h);
        for &t in tokens {
            let t = t as usize;
            let row = match &self.w.embed {
                VocabWeight::Parallel(parts) => {
                    let part = parts[0].len() / h;
                    &parts[t / part][(t % part) * h..(t % part + 1) * h]
                }
                VocabWeight::Replicated(all) => &all[t * h..(t + 1) * h],
            };
            x.extend(row.iter().map(|v| v.to_f32()));
        }
        x
    }

    /// Runs `tokens` (row `i` is sequence `rows[i].0` at position `rows[i].1`, positions of one
    /// sequence consecutive and starting at its cache length) through every layer, appending to
    /// the caches; returns the final hidden states.
    pub(crate) fn forward(&mut self, rows: &[(usize, usize)], tokens: &[u32]) -> Vec<f32> {
        let c = &self.config;
        let (h, d, n) = (c.model.hidden, c.model.head_dim, rows.len());
        let eps = c.rms_norm_eps as f32;
        let group = c.model.heads / c.model.query_groups;
        let scale = 1.0 / (d as f32).sqrt();
        let qh = self.w.q_heads;
        let mut x = self.embed(tokens);
        let mut xn = vec![0.0f32; n * h];
        let mut acc = vec![0.0f32; n * h];
        let mut partial = vec![0.0f32; n * h];
        for (l, layer) in self.w.layers.iter().enumerate() {
            // attention
            rms_norm(&x, layer.input_norm, eps, &mut xn);
            acc.iter_mut().for_each(|v| *v = 0.0);
            for (rank, (rw, share)) in layer.ranks.iter().zip(&self.w.shares).enumerate() {
                let kvw = share.kv_heads * d;
                let mut q = vec![0.0f32; n * qh * d];
                let mut k = vec![0.0f32; n * kvw];
                let mut v = vec![0.0f32; n * kvw];
                let fp8 = self.fp8;
                let s = self.lora_scaling;
                linear(&xn, rw.q_w.with_compute(fp8), rw.q_b, h, &mut q);
                linear(&xn, rw.k_w.with_compute(fp8), rw.k_b, h, &mut k);
                linear(&xn, rw.v_w.with_compute(fp8), rw.v_b, h, &mut v);
                for (l, y) in rw.lora.iter().zip([&mut q, &mut k, &mut v]) {
                    add_lora(&xn, *l, s, h, y);
                }
                if let Some((qn, kn)) = layer.qk_norm {
                    head_norm(&mut q, qn, eps);
                    head_norm(&mut k, kn, eps);
                }
                for (i, &(seq, pos)) in rows.iter().enumerate() {
                    for head in q[i * qh * d..(i + 1) * qh * d].chunks_exact_mut(d) {
                        self.rope.apply(head, pos);
                    }
                    for head in k[i * kvw..(i + 1) * kvw].chunks_exact_mut(d) {
                        self.rope.apply(head, pos);
                    }
                    let kv = self.kv;
                    let cache = &mut self.seqs[seq].layers[l][rank];
                    for head in k[i * kvw..(i + 1) * kvw].chunks_exact(d) {
                        kv.store_head(head, &mut cache.k);
                    }
                    for head in v[i * kvw..(i + 1) * kvw].chunks_exact(d) {
                        kv.store_head(head, &mut cache.v);
                    }
                }
                let mut attn = vec![0.0f32; n * qh * d];
                for (i, &(seq, pos)) in rows.iter().enumerate() {
                    let cache = &self.seqs[seq].layers[l][rank];
                    let mut scores = vec![0.0f32; pos + 1];
                    for j in 0..qh {
                        let kv = (share.q_base + j) / group - share.kv_base;
                        let qv = &q[(i * qh + j) * d..(i * qh + j + 1) * d];
                        for (p, s) in scores.iter_mut().enumerate() {
                            let kp = &cache.k[p * kvw + kv * d..p * kvw + (kv + 1) * d];
                            *s = qv.iter().zip(kp).map(|(a, b)| a * b).sum::<f32>() * scale;
                        }
                        softmax(&mut scores);
                        let out = &mut attn[(i * qh + j) * d..(i * qh + j + 1) * d];
                        for (p, s) in scores.iter().enumerate() {
                            let vp = &cache.v[p * kvw + kv * d..p * kvw + (kv + 1) * d];
                            out.iter_mut().zip(vp).for_each(|(o, b)| *o += s * b);
                        }
                    }
                }
                linear(&attn, rw.o_w.with_compute(fp8), None, qh * d, &mut partial);
                add_lora(&attn, rw.lora[3], s, qh * d, &mut partial);
                // all-reduce (sum) of the row-parallel partial outputs
                acc.iter_mut().zip(&partial).for_each(|(a, p)| *a += p);
            }
            x.iter_mut().zip(&acc).for_each(|(a, b)| *a += b);
            // MLP
            rms_norm(&x, layer.post_norm, eps, &mut xn);
            let out = match &layer.mlp {
                Mlp::Dense(parts) => mlp(&xn, parts, h, self.fp8, self.lora_scaling),
                Mlp::Moe {
                    router,
                    experts,
                    shared,
                } => {
                    let mut out = moe(&xn, router, experts, h, &self.w.routing, self.fp8);
                    if let Some(s) = shared {
                        shared_expert(&xn, s, h, &mut out, self.fp8);
                    }
                    out
                }
            };
            x.iter_mut().zip(&out).for_each(|(a, b)| *a += b);
        }
        for &(seq, _) in rows {
            self.seqs[seq].len += 1;
        }
        x
    }

    /// Logits of hidden rows `x` (`[n × hidden]`), `[n × vocab]`.
    pub(crate) fn logits(&self, x: &[f32]) -> Vec<f32> {
        let (h, vocab) = (self.config.model.hidden, self.config.model.vocab);
        let n = x.len() / h;
        let mut xn = vec![0.0f32; x.len()];
        rms_norm(
            x,
            self.w.final_norm,
            self.config.rms_norm_eps as f32,
            &mut xn,
        );
        let mut out = vec![0.0f32; n * vocab];
        match &self.w.head {
            VocabWeight::Replicated(all) => linear(&xn, *all, None, h, &mut out),
            VocabWeight::Parallel(parts) => {
                let part = parts[0].len() / h;
                for (r, w) in parts.iter().enumerate() {
                    // rows of this slice inside the vocabulary (padding rows are skipped)
                    let first = (r * part).min(vocab);
                    let real = ((r + 1) * part).min(vocab) - first;
                    if real == 0 {
                        continue;
                    }
                    let mut y = vec![0.0f32; n * real];
                    linear(&xn, &w[..real * h], None, h, &mut y);
                    // all-gather of the vocabulary slices
                    for (row, yr) in y.chunks_exact(real).enumerate() {
                        out[row * vocab + first..row * vocab + first + real].copy_from_slice(yr);
                    }
                }
            }
        }
        out
    }
}

/// RMSNorm of every `head_dim`-sized head of `x`, in place (Qwen3's q/k norms).
fn head_norm(x: &mut [f32], w: &[bf16], eps: f32) {
    let src = x.to_vec();
    rms_norm(&src, w, eps, x);
}

/// `y += s·(x·Aᵀ)·Bᵀ` for rows `x` (`[n × inp]`) where `lora` is an adapter: PEFT's unmerged
/// LoRA term, added after the base product (and its bias), in f32.
fn add_lora(x: &[f32], lora: Option<Lora<'_>>, s: f32, inp: usize, y: &mut [f32]) {
    let Some(l) = lora else { return };
    let n = x.len() / inp;
    let mut t = vec![0.0f32; n * l.rank];
    linear(x, l.a, None, inp, &mut t);
    let mut u = vec![0.0f32; y.len()];
    linear(&t, l.b, None, l.rank, &mut u);
    y.iter_mut().zip(&u).for_each(|(y, u)| *y += s * u);
}

/// `Σ_parts down · (silu(gate · x) ⊙ up · x)` for rows `x` (`[n × h]`): one SwiGLU MLP whose
/// intermediate rows are split over `parts` (the row-parallel outputs summed, the all-reduce).
fn mlp(x: &[f32], parts: &[MlpPart<'_>], h: usize, fp8: Fp8Compute, s: f32) -> Vec<f32> {
    let n = x.len() / h;
    let mut acc = vec![0.0f32; n * h];
    let mut partial = vec![0.0f32; n * h];
    for p in parts {
        let f = p.gate.len() / h;
        let mut gate = vec![0.0f32; n * f];
        let mut up = vec![0.0f32; n * f];
        linear(x, p.gate.with_compute(fp8), None, h, &mut gate);
        add_lora(x, p.lora[0], s, h, &mut gate);
        linear(x, p.up.with_compute(fp8), None, h, &mut up);
        add_lora(x, p.lora[1], s, h, &mut up);
        swiglu(&mut gate, &up);
        linear(&gate, p.down.with_compute(fp8), None, f, &mut partial);
        add_lora(&gate, p.lora[2], s, f, &mut partial);
        acc.iter_mut().zip(&partial).for_each(|(a, b)| *a += b);
    }
    acc
}

/// A mixture-of-experts MLP over rows `x`: each row's router probabilities (softmax of
/// `router · x` in f32), its `top_k` experts (ties to the lower index), their weights
/// (renormalised to sum to one when `norm_topk_prob`), and the weighted sum of those experts'
/// outputs. Each expert runs once over the rows routed to it.
fn moe(
    x: &[f32],
    router: &[bf16],
    experts: &[Vec<MlpPart<'_>>],
    h: usize,
    routing: &Routing,
    fp8: Fp8Compute,
) -> Vec<f32> {
    let n = x.len() / h;
    let e_count = experts.len();
    let mut logits = vec![0.0f32; n * e_count];
    linear(x, router, None, h, &mut logits);
    // rows routed to each expert, with their weights
    let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e_count];
    for (row, l) in logits.chunks_exact_mut(e_count).enumerate() {
        for (e, w) in route_top_k(l, routing.top_k, routing.norm_topk_prob) {
            routed[e].push((row, w));
        }
    }
    let mut out = vec![0.0f32; n * h];
    for (parts, rows) in experts.iter().zip(&routed) {
        if rows.is_empty() {
            continue;
        }
        let xs: Vec<f32> = rows
            .iter()
            .flat_map(|&(r, _)| x[r * h..(r + 1) * h].iter().copied())
            .collect();
        let y = mlp(&xs, parts, h, fp8, 1.0);
        for (&(r, w), yr) in rows.iter().zip(y.chunks_exact(h)) {
            out[r * h..(r + 1) * h]
                .iter_mut()
                .zip(yr)
                .for_each(|(o, v)| *o += w * v);
        }
    }
    out
}

/// Adds the shared expert of the rows `x` (`[n × hidden]`) to `out`, scaled per row by
/// `sigmoid(gate · x)`, as Qwen2-MoE does.
fn shared_expert(x: &[f32], s: &SharedExpert<'_>, h: usize, out: &mut [f32], fp8: Fp8Compute) {
    let n = x.len() / h;
    let y = mlp(x, &s.parts, h, fp8, 1.0);
    let mut g = vec![0.0f32; n];
    linear(x, s.gate, None, h, &mut g);
    for ((o, yr), gr) in out.chunks_exact_mut(h).zip(y.chunks_exact(h)).zip(&g) {
        let scale = 1.0 / (1.0 + (-gr).exp());
        o.iter_mut().zip(yr).for_each(|(a, b)| *a += scale * b);
    }
}

impl Decoder for CpuDecoder<'_> {
    type Error = DecodeError;

    fn vocab_size(&self) -> usize {
        self.config.model.vocab
    }

    fn prefill(
        &mut self,
        prompts: &[Vec<u32>],
        which: PrefillLogits,
    ) -> Result<Vec<Vec<f32>>, DecodeError> {
        let mut rows = Vec::new();
        let mut tokens = Vec::new();
        for (s, p) in prompts.iter().enumerate() {
            if p.is_empty() {
                return Err(DecodeError::Usage(format!(
                    "prompt {s} is empty: every prompt needs at least one token"
                )));
            }
            for (pos, &t) in p.iter().enumerate() {
                crate::check_token(&self.config, s, t)?;
                rows.push((s, pos));
                tokens.push(t);
            }
        }
        let tp = self.w.shares.len();
        self.seqs = vec![
            SeqCache {
                len: 0,
                layers: vec![vec![KvCache::default(); tp]; self.config.model.layers],
            };
            prompts.len()
        ];
        let x = self.forward(&rows, &tokens);
        let (h, vocab) = (self.config.model.hidden, self.config.model.vocab);
        let mut out = Vec::with_capacity(prompts.len());
        let mut start = 0;
        for p in prompts {
            let end = start + p.len();
            let from = match which {
                PrefillLogits::All => start,
                PrefillLogits::Last => end - 1,
            };
            out.push(self.logits(&x[from * h..end * h]));
            start = end;
        }
        debug_assert!(out.iter().all(|l| l.len() % vocab == 0));
        Ok(out)
    }

    fn decode_step(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, DecodeError> {
        if tokens.len() != self.seqs.len() {
            return Err(DecodeError::Usage(format!(
                "decode_step got {} tokens for a batch of {} sequences (call prefill first)",
                tokens.len(),
                self.seqs.len()
            )));
        }
        for (s, &t) in tokens.iter().enumerate() {
            crate::check_token(&self.config, s, t)?;
        }
        let rows: Vec<(usize, usize)> = self
            .seqs
            .iter()
            .enumerate()
            .map(|(s, c)| (s, c.len))
            .collect();
        let x = self.forward(&rows, tokens);
        let logits = self.logits(&x);
        Ok(logits
            .chunks_exact(self.config.model.vocab)
            .map(<[f32]>::to_vec)
            .collect())
    }
}
