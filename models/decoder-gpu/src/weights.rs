//! Where each weight of one TP rank lies in a flat rollout buffer, checked against the config and
//! the layout with the same rules (and errors) as the CPU decoder: the FSDP backend's unfused
//! layout (`q_proj`, `k_proj`, ...) or the Megatron backend's fused one (`qkv_proj` = `[q; k; v]`,
//! `gate_up_proj` = `[gate; up]`, vocabulary possibly padded).

use std::collections::HashMap;

use lifecycle_decoder::{
    head_shares, layout_heads, rollout_spec, DecodeError, HeadShare, ModelConfig,
    MEGATRON_VOCAB_MULTIPLE,
};
use lifecycle_layout::lora::{self, adapter_name, LoraPart, LoraTarget};
use lifecycle_layout::RolloutEntry;
use lifecycle_layout::RolloutLayout as FusedLayout;
use lifecycle_layout::{hf, Parallel, RolloutLayout, TensorSpec};

/// Where a weight matrix lies in a rank's buffer: bf16 from slot `off` (its first used row), or
/// fp8 ([`Fp8At`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct MatAt {
    /// Slot of the first used row (bf16), or of the stored matrix's first byte (fp8).
    pub off: u64,
    pub fp8: Option<Fp8At>,
}

/// An fp8 matrix's block scales (slot), the first row a product uses, and its columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fp8At {
    pub scales: u64,
    pub row0: u64,
    pub cols: u64,
}

impl MatAt {
    /// A bf16 matrix at slot `off`.
    pub fn bf16(off: u64) -> Self {
        MatAt { off, fp8: None }
    }

    /// The same matrix from row `rows` on, of `width` columns.
    pub fn skip_rows(self, rows: usize, width: usize) -> Self {
        match self.fp8 {
            None => MatAt::bf16(self.off + (rows * width) as u64),
            Some(f) => MatAt {
                off: self.off,
                fp8: Some(Fp8At {
                    row0: f.row0 + rows as u64,
                    ..f
                }),
            },
        }
    }
}

/// A LoRA adapter's matrices on one rank, bf16: `A` (`r × in`, the base's input slice) from
/// slot `a`, and `B` (`out × r`) from slot `b`, its first row the base's first used row (a
/// replicated k / v base: the rows of this rank's kv heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LoraAt {
    pub a: u64,
    pub b: u64,
    pub r: usize,
}

/// Element offsets (bf16) of one rank's share of one layer. In the fused layout `k_w` / `v_w`
/// point into `qkv_proj` right after the q / k rows, `up_w` into `gate_up_proj` after the gate
/// rows, so `[q_w, v_w + kv rows)` and `[gate_w, up_w + ffn rows)` are one matrix each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LayerOffsets {
    pub input_norm: u64,
    pub post_norm: u64,
    pub q_w: MatAt,
    pub q_b: Option<u64>,
    /// First row of this rank's kv heads (replicated k/v: offset into the full tensor).
    pub k_w: MatAt,
    pub k_b: Option<u64>,
    pub v_w: MatAt,
    pub v_b: Option<u64>,
    pub o_w: MatAt,
    /// Dense MLP weights (unused, 0, in a mixture-of-experts layer: see [`RankOffsets::moe`]).
    pub gate_w: MatAt,
    pub up_w: MatAt,
    pub down_w: MatAt,
    /// Per-head RMSNorm weights of q and k (Qwen3).
    pub qk_norm: Option<(u64, u64)>,
    /// LoRA adapters of q, k, v, o, gate, up and down (`LoraTarget::ALL`'s order), where the
    /// rollout holds them.
    pub lora: [Option<LoraAt>; 7],
}

/// One expert's share on one rank: gate, up (`[ffn × hidden]`) and down (`[hidden × ffn]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ExpertOffsets {
    pub gate: MatAt,
    pub up: MatAt,
    pub down: MatAt,
    /// Intermediate rows of this share (`moe_ffn / T` split by TP, `moe_ffn` whole).
    pub ffn: usize,
}

/// One rank's mixture-of-experts layer: the replicated router and the experts it holds (every
/// expert's TP share, or its own experts whole when they are partitioned), and its share of the
/// shared expert, if the model has one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MoeOffsets {
    pub router: u64,
    pub experts: Vec<Option<ExpertOffsets>>,
    pub shared: Option<SharedOffsets>,
}

/// A rank's TP share of Qwen2-MoE's shared expert and its replicated sigmoid gate `[1, hidden]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SharedOffsets {
    pub expert: ExpertOffsets,
    pub gate: u64,
}

/// One rank's weight offsets and head share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RankOffsets {
    pub embed: u64,
    pub head: u64,
    pub final_norm: u64,
    pub layers: Vec<LayerOffsets>,
    /// Per layer, its experts when it is a mixture-of-experts layer.
    pub moe: Vec<Option<MoeOffsets>>,
    pub share: HeadShare,
}

/// The whole group's plan.
#[derive(Debug, Clone)]
pub(crate) struct GroupOffsets {
    pub ranks: Vec<RankOffsets>,
    /// Query heads per rank.
    pub q_heads: usize,
    /// Intermediate rows per rank.
    pub ffn_part: usize,
    /// Whether embedding / head rows are split over the ranks.
    pub vocab_parallel: bool,
    /// Embedding / head rows each rank holds (`vocab / T` or `vocab` unfused; the padded
    /// vocabulary over `T` fused, rows at or past the real vocabulary being padding).
    pub vocab_part: usize,
    /// Whether q/k/v and gate/up are fused matrices (one GEMM each).
    pub fused: bool,
    /// Elements every rank's buffer must hold at least.
    pub min_len: u64,
    /// Elements of the largest fp8 matrix (0 without fp8 weights): the prefill products'
    /// dequantisation scratch holds twice as many bf16.
    pub fp8_max: u64,
    /// Columns of the widest fp8 matrix (0 without fp8 weights).
    pub fp8_max_cols: u64,
}

/// Which rollout layout a buffer's tensor names say it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayoutKind {
    /// Separate `q_proj` / `k_proj` / `v_proj`, `gate_proj` / `up_proj` (the FSDP backends).
    Unfused,
    /// `qkv_proj` = `[q; k; v]`, `gate_up_proj` = `[gate; up]` per rank (the Megatron backends).
    Fused,
}

impl LayoutKind {
    /// A short name for messages.
    pub fn name(self) -> &'static str {
        match self {
            LayoutKind::Unfused => "unfused (q_proj / k_proj / v_proj, gate_proj / up_proj)",
            LayoutKind::Fused => "fused (qkv_proj, gate_up_proj)",
        }
    }
}

/// The layout the names of `entries` belong to: fused when they hold a `self_attn.qkv_proj`
/// weight, unfused when they hold a `self_attn.q_proj` one; `None` when they hold neither (a
/// model without layers). Both at once is an error.
///
/// ```
/// use lifecycle_decoder_gpu::{detect_layout, LayoutKind};
/// use lifecycle_layout::RolloutEntry;
/// let fused = [RolloutEntry::new("model.layers.0.self_attn.qkv_proj.weight", vec![8, 4], 0)];
/// assert_eq!(detect_layout(&fused)?, Some(LayoutKind::Fused));
/// let unfused = [RolloutEntry::new("model.layers.0.self_attn.q_proj.weight", vec![4, 4], 0)];
/// assert_eq!(detect_layout(&unfused)?, Some(LayoutKind::Unfused));
/// # Ok::<(), lifecycle_decoder::DecodeError>(())
/// ```
pub fn detect_layout(entries: &[RolloutEntry]) -> Result<Option<LayoutKind>, DecodeError> {
    let has = |suffix: &str| entries.iter().any(|e| e.name().ends_with(suffix));
    match (
        has(".self_attn.qkv_proj.weight"),
        has(".self_attn.q_proj.weight"),
    ) {
        (true, true) => Err(DecodeError::Usage(
            "the rollout buffer holds both fused (qkv_proj) and unfused (q_proj) attention \
             weights: it must hold one rollout layout"
                .into(),
        )),
        (true, false) => Ok(Some(LayoutKind::Fused)),
        (false, true) => Ok(Some(LayoutKind::Unfused)),
        (false, false) => Ok(None),
    }
}

struct Reader<'a> {
    layout: &'a RolloutLayout,
    entries: &'a [RolloutEntry],
    shapes: Vec<(String, Vec<usize>)>,
    min_len: u64,
    fp8_max: u64,
    fp8_max_cols: u64,
}

impl<'a> Reader<'a> {
    fn spec(&self, name: &str, allowed: &[Parallel]) -> Result<&'a TensorSpec, DecodeError> {
        rollout_spec(self.layout, &self.shapes, name, allowed)
    }

    /// The entry of `name` in every rank's buffer (the same on every rank), shape-checked.
    fn entry(&mut self, name: &str, allowed: &[Parallel]) -> Result<&RolloutEntry, DecodeError> {
        let spec = self.spec(name, allowed)?;
        self.entry_of(spec)
    }

    /// The entry of the layout's tensor `spec`, shaped as the layout splits it.
    fn entry_of(&mut self, spec: &TensorSpec) -> Result<&RolloutEntry, DecodeError> {
        let name = &spec.name;
        let expected = spec.slice_shape(self.layout.tp());
        let e = self
            .entries
            .iter()
            .find(|e| e.name() == name)
            .ok_or_else(|| DecodeError::MissingTensor {
                name: name.to_string(),
                rank: 0,
            })?;
        let numel: usize = expected.iter().product();
        if e.shape() != expected.as_slice() || e.numel() != numel {
            return Err(DecodeError::Shape {
                name: name.to_string(),
                rank: 0,
                expected,
                found: e.shape().to_vec(),
            });
        }
        self.min_len = self.min_len.max(e.range().end as u64);
        Ok(e)
    }

    /// The offset of a tensor read in bf16 (norms, biases, embeddings, the router).
    fn offset(&mut self, name: &str, allowed: &[Parallel]) -> Result<u64, DecodeError> {
        let e = self.entry(name, allowed)?;
        if e.is_fp8() {
            return Err(DecodeError::Usage(format!(
                "`{name}` is fp8, but the decoder reads it in bf16: an fp8 rollout quantises \
                 matrix weights only (lifecycle_layout::fp8::keeps_bf16)"
            )));
        }
        Ok(e.offset() as u64)
    }

    /// Where a weight matrix lies, bf16 or fp8.
    fn matrix(&mut self, name: &str, allowed: &[Parallel]) -> Result<MatAt, DecodeError> {
        let e = self.entry(name, allowed)?;
        let (numel, at) = (
            e.numel() as u64,
            MatAt {
                off: e.offset() as u64,
                fp8: e.scale_offset().map(|scales| Fp8At {
                    scales: scales as u64,
                    row0: 0,
                    cols: e.matrix().1 as u64,
                }),
            },
        );
        if let Some(f) = at.fp8 {
            self.fp8_max = self.fp8_max.max(numel);
            self.fp8_max_cols = self.fp8_max_cols.max(f.cols);
        }
        Ok(at)
    }
}

impl Reader<'_> {
    /// The adapter of base matrix `base` (whose slice on a rank is `out × inp`), where the
    /// layout holds one: its `A` and `B` both, bf16, of one rank `r`, each entry shaped as the
    /// layout splits it.
    fn adapter(
        &mut self,
        base: &str,
        (out, inp): (usize, usize),
    ) -> Result<Option<LoraAt>, DecodeError> {
        let mut at = [None, None];
        for (i, part) in [LoraPart::A, LoraPart::B].into_iter().enumerate() {
            let name = adapter_name(base, part);
            let Some(spec) = self.layout.tensors().iter().find(|t| t.name == name) else {
                continue;
            };
            let tp = self.layout.tp();
            let e = self.entry_of(spec)?;
            if e.is_fp8() {
                return Err(DecodeError::Usage(format!(
                    "adapter `{name}` is fp8: the engine reads adapters in bf16 \
                     (lifecycle_layout::fp8::keeps_bf16 keeps them so)"
                )));
            }
            let expected = spec.slice_shape(tp);
            at[i] = Some((e.offset() as u64, expected));
        }
        match at {
            [None, None] => Ok(None),
            [Some((a, sa)), Some((b, sb))] => match (sa.as_slice(), sb.as_slice()) {
                (&[r, ai], &[bo, br]) if ai == inp && bo == out && br == r && r > 0 => {
                    Ok(Some(LoraAt { a, b, r }))
                }
                _ => Err(DecodeError::Usage(format!(
                    "the adapter of `{base}`: A of {sa:?} and B of {sb:?} on a rank, for a base \
                     slice of {out} × {inp} (A: r × {inp}, B: {out} × r)"
                ))),
            },
            [a, _] => {
                let missing = if a.is_none() {
                    LoraPart::A
                } else {
                    LoraPart::B
                };
                Err(DecodeError::Usage(format!(
                    "the rollout layout holds one matrix of the adapter of `{base}` but not \
                     `{}`: an adapter needs its A and B",
                    adapter_name(base, missing)
                )))
            }
        }
    }

    /// TP rank `t`'s share of expert `e` of layer `l`: its TP slices (gate and up
    /// column-parallel, down row-parallel), the whole expert when `t` owns it, or `None` when
    /// another rank owns it.
    fn expert(
        &mut self,
        l: usize,
        e: usize,
        t: usize,
        ffn: usize,
    ) -> Result<Option<ExpertOffsets>, DecodeError> {
        let name = |s: &str| hf::expert(l, e, s);
        let (g, u, d) = (
            name(hf::EXPERT_GATE),
            name(hf::EXPERT_UP),
            name(hf::EXPERT_DOWN),
        );
        let owned = [Parallel::Owned { rank: 0 }];
        match self
            .spec(&g, &[Parallel::Column, Parallel::Owned { rank: 0 }])?
            .parallel
        {
            Parallel::Owned { rank } => {
                for other in [&u, &d] {
                    if self.layout.owner(other) != Some(rank) {
                        return Err(DecodeError::Usage(format!(
                            "`{g}` and `{other}` of one expert live on different ranks: the \
                             decoder needs an expert's gate, up and down projections on one rank"
                        )));
                    }
                }
                if rank != t {
                    return Ok(None);
                }
                Ok(Some(ExpertOffsets {
                    gate: self.matrix(&g, &owned)?,
                    up: self.matrix(&u, &owned)?,
                    down: self.matrix(&d, &owned)?,
                    ffn,
                }))
            }
            _ => Ok(Some(ExpertOffsets {
                gate: self.matrix(&g, &[Parallel::Column])?,
                up: self.matrix(&u, &[Parallel::Column])?,
                down: self.matrix(&d, &[Parallel::Row])?,
                ffn: ffn / self.layout.tp(),
            })),
        }
    }
}

impl GroupOffsets {
    /// Checks every tensor the config needs against the layout and the rollout entries:
    /// `entries[t]` those of TP rank `t`, or one list standing for every rank when the layout
    /// places the same tensors on all of them.
    ///
    /// Long by design: one check per tensor family (embedding, each layer's attention, MLP or
    /// experts and norms, final norm, head), each refusing its tensor by name, over the entry
    /// tables built at the top.
    pub(crate) fn new(
        config: &ModelConfig,
        layout: &RolloutLayout,
        entries: &[&[RolloutEntry]],
    ) -> Result<Self, DecodeError> {
        let tp_ranks = layout.tp();
        let rank_entries = |t: usize| -> Result<&[RolloutEntry], DecodeError> {
            match entries {
                [one] => Ok(one),
                many => many.get(t).copied().ok_or_else(|| {
                    DecodeError::Usage(format!(
                        "rollout entries for {} ranks, the layout has T = {tp_ranks}",
                        many.len()
                    ))
                }),
            }
        };
        let entries = rank_entries(0)?;
        let tp = layout.tp();
        let degree = |reason: String| DecodeError::Degree { tp, reason };
        if tp == 0 {
            return Err(degree("T must be at least 1".into()));
        }
        if !config.model.heads.is_multiple_of(tp) {
            return Err(degree(format!(
                "num_attention_heads {} is not divisible by T",
                config.model.heads
            )));
        }
        let spec = config.model_spec(MEGATRON_VOCAB_MULTIPLE);
        let dense_layers = (0..config.model.layers).any(|l| !spec.moe_layer(l));
        if dense_layers && !config.model.ffn.is_multiple_of(tp) {
            return Err(degree(format!(
                "intermediate_size {} is not divisible by T",
                config.model.ffn
            )));
        }
        let mut r = Reader {
            layout,
            entries,
            shapes: config.tensor_shapes(),
            min_len: 0,
            fp8_max: 0,
            fp8_max_cols: 0,
        };
        let (d, h) = (config.model.head_dim, config.model.hidden);
        let q_heads = config.model.heads / tp;
        let (kv_split, shares) = layout_heads(config, layout)?;
        if shares.iter().any(|s| s.kv_heads != shares[0].kv_heads) {
            return Err(degree(
                "the ranks would compute different numbers of kv heads".into(),
            ));
        }
        let col = [Parallel::Column];
        let kv = [kv_split];
        let rep = [Parallel::Replicated];
        let row = [Parallel::Row];
        let mut per_layer = Vec::with_capacity(config.model.layers);
        let mut qk_norms = Vec::with_capacity(config.model.layers);
        let mut moe_layers = Vec::with_capacity(config.model.layers);
        let mut lora_layers = Vec::with_capacity(config.model.layers);
        for l in 0..config.model.layers {
            let p = format!("model.layers.{l}");
            let mut bias =
                |name: String, allowed: &[Parallel]| -> Result<Option<u64>, DecodeError> {
                    if config.model.qkv_bias {
                        r.offset(&name, allowed).map(Some)
                    } else {
                        Ok(None)
                    }
                };
            let q_b = bias(format!("{p}.self_attn.q_proj.bias"), &col)?;
            let k_b = bias(format!("{p}.self_attn.k_proj.bias"), &kv)?;
            let v_b = bias(format!("{p}.self_attn.v_proj.bias"), &kv)?;
            let qk_norm = if config.model.qk_norm {
                Some((
                    r.offset(&hf::layer(l, hf::Q_NORM), &rep)?,
                    r.offset(&hf::layer(l, hf::K_NORM), &rep)?,
                ))
            } else {
                None
            };
            qk_norms.push(qk_norm);
            let mlp = if spec.moe_layer(l) {
                moe_layers.push(Some(r.offset(&hf::layer(l, hf::ROUTER), &rep)?));
                (MatAt::default(), MatAt::default(), MatAt::default())
            } else {
                moe_layers.push(None);
                (
                    r.matrix(&format!("{p}.mlp.gate_proj.weight"), &col)?,
                    r.matrix(&format!("{p}.mlp.up_proj.weight"), &col)?,
                    r.matrix(&format!("{p}.mlp.down_proj.weight"), &row)?,
                )
            };
            // the layer's adapters, each sized for its base's slice on a rank
            let mut lora = [None; 7];
            for (i, t) in LoraTarget::ALL.into_iter().enumerate() {
                let base = t.base_name(l);
                if t.in_mlp() && spec.moe_layer(l) {
                    continue;
                }
                let Some(e) = r.entries.iter().find(|e| e.name() == base) else {
                    continue;
                };
                if let [out, inp] = *e.shape() {
                    lora[i] = r.adapter(&base, (out, inp))?;
                }
            }
            lora_layers.push(lora);
            per_layer.push((
                r.offset(&format!("{p}.input_layernorm.weight"), &rep)?,
                r.offset(&format!("{p}.post_attention_layernorm.weight"), &rep)?,
                r.matrix(&format!("{p}.self_attn.q_proj.weight"), &col)?,
                q_b,
                r.matrix(&format!("{p}.self_attn.k_proj.weight"), &kv)?,
                k_b,
                r.matrix(&format!("{p}.self_attn.v_proj.weight"), &kv)?,
                v_b,
                r.matrix(&format!("{p}.self_attn.o_proj.weight"), &row)?,
                mlp.0,
                mlp.1,
                mlp.2,
            ));
        }
        let vocab_spec = r.spec(
            "model.embed_tokens.weight",
            &[Parallel::Column, Parallel::Replicated],
        )?;
        let vocab_parallel = vocab_spec.parallel == Parallel::Column && tp > 1;
        let vocab_allowed = [Parallel::Column, Parallel::Replicated];
        let embed = r.offset("model.embed_tokens.weight", &vocab_allowed)?;
        let head = if config.model.tied_embeddings {
            embed
        } else {
            let head_spec = r.spec("lm_head.weight", &vocab_allowed)?;
            if (head_spec.parallel == Parallel::Column && tp > 1) != vocab_parallel {
                return Err(DecodeError::Split {
                    name: "lm_head.weight".into(),
                    found: head_spec.parallel.name(),
                    expected: "split like model.embed_tokens.weight (build the layout with ModelConfig::rollout_layout)",
                });
            }
            r.offset("lm_head.weight", &vocab_allowed)?
        };
        let final_norm = r.offset("model.norm.weight", &rep)?;
        // every rank's experts, from its own entries
        let mut moe_ranks = Vec::with_capacity(shares.len());
        for t in 0..shares.len() {
            let mut rr = Reader {
                layout,
                entries: rank_entries(t)?,
                shapes: std::mem::take(&mut r.shapes),
                min_len: r.min_len,
                fp8_max: r.fp8_max,
                fp8_max_cols: r.fp8_max_cols,
            };
            let layers = moe_layers
                .iter()
                .enumerate()
                .map(|(l, router)| match (router, config.model.moe) {
                    (Some(router), Some(m)) => Ok(Some(MoeOffsets {
                        router: *router,
                        experts: (0..m.experts)
                            .map(|e| rr.expert(l, e, t, m.ffn))
                            .collect::<Result<_, _>>()?,
                        shared: if m.shared_ffn > 0 {
                            let (col, row) = ([Parallel::Column], [Parallel::Row]);
                            Some(SharedOffsets {
                                expert: ExpertOffsets {
                                    gate: rr.matrix(&hf::layer(l, hf::SHARED_GATE), &col)?,
                                    up: rr.matrix(&hf::layer(l, hf::SHARED_UP), &col)?,
                                    down: rr.matrix(&hf::layer(l, hf::SHARED_DOWN), &row)?,
                                    ffn: m.shared_ffn / layout.tp(),
                                },
                                gate: rr.offset(
                                    &hf::layer(l, hf::SHARED_EXPERT_GATE),
                                    &[Parallel::Replicated],
                                )?,
                            })
                        } else {
                            None
                        },
                    })),
                    _ => Ok(None),
                })
                .collect::<Result<Vec<_>, DecodeError>>()?;
            r.shapes = rr.shapes;
            r.min_len = rr.min_len;
            r.fp8_max = rr.fp8_max;
            r.fp8_max_cols = rr.fp8_max_cols;
            moe_ranks.push(layers);
        }
        let ranks = shares
            .iter()
            .zip(moe_ranks)
            .map(|(&share, moe)| {
                // replicated k/v: start at the rows of the kv heads this rank uses
                let kv_shift = |off: u64, width: usize| -> u64 {
                    if kv_split == Parallel::Column {
                        off
                    } else {
                        off + (share.kv_base * d * width) as u64
                    }
                };
                let kv_rows = |w: MatAt| -> MatAt {
                    if kv_split == Parallel::Column {
                        w
                    } else {
                        w.skip_rows(share.kv_base * d, h)
                    }
                };
                RankOffsets {
                    embed,
                    head,
                    final_norm,
                    share,
                    moe,
                    layers: per_layer
                        .iter()
                        .zip(&qk_norms)
                        .zip(&lora_layers)
                        .map(
                            |(
                                (
                                    &(inn, post, q_w, q_b, k_w, k_b, v_w, v_b, o_w, g, u, dn),
                                    &qk_norm,
                                ),
                                &lora,
                            )| {
                                // a replicated k / v adapter's B from this rank's kv rows
                                let mut lora = lora;
                                for at in lora[1..3].iter_mut().flatten() {
                                    at.b = kv_shift(at.b, at.r);
                                }
                                LayerOffsets {
                                    input_norm: inn,
                                    post_norm: post,
                                    q_w,
                                    q_b,
                                    k_w: kv_rows(k_w),
                                    k_b: k_b.map(|b| kv_shift(b, 1)),
                                    v_w: kv_rows(v_w),
                                    v_b: v_b.map(|b| kv_shift(b, 1)),
                                    o_w,
                                    gate_w: g,
                                    up_w: u,
                                    down_w: dn,
                                    qk_norm,
                                    lora,
                                }
                            },
                        )
                        .collect(),
                }
            })
            .collect();
        let vocab_part = if vocab_parallel {
            config.model.vocab / tp
        } else {
            config.model.vocab
        };
        Ok(GroupOffsets {
            ranks,
            q_heads,
            ffn_part: config.model.ffn / tp,
            vocab_parallel,
            vocab_part,
            fused: false,
            min_len: r.min_len,
            fp8_max: r.fp8_max,
            fp8_max_cols: r.fp8_max_cols,
        })
    }

    /// The adapters held are those of `lora` ([`lifecycle_decoder::check_adapters`]: every
    /// target it lists on every rank of every layer, the MLP ones on dense layers, of its rank
    /// `r`; none without a configuration).
    pub(crate) fn check_lora(
        &self,
        config: &ModelConfig,
        lora: Option<&lifecycle_layout::lora::LoraConfig>,
    ) -> Result<(), DecodeError> {
        let spec = config.model_spec(MEGATRON_VOCAB_MULTIPLE);
        let held = |l: usize, t: LoraTarget| -> Vec<Option<usize>> {
            let Some(i) = LoraTarget::ALL.iter().position(|&x| x == t) else {
                return Vec::new();
            };
            self.ranks
                .iter()
                .map(|r| r.layers.get(l).and_then(|w| w.lora[i]).map(|a| a.r))
                .collect()
        };
        let layers = config.model.layers;
        let dense = |l: usize| !spec.moe_layer(l);
        let call = "GpuDecoder::new_lora, GpuEngine::with_lora";
        lifecycle_decoder::check_adapters(layers, dense, lora, held, call)
    }

    /// The largest adapter rank `r` a layer holds (0 without adapters).
    pub(crate) fn lora_rank(&self) -> usize {
        let layers = self.ranks.iter().flat_map(|r| &r.layers);
        layers
            .flat_map(|w| w.lora.iter().flatten())
            .map(|a| a.r)
            .max()
            .unwrap_or(0)
    }

    /// Checks every tensor of the fused rollout layout `layout` (Megatron's: per rank
    /// `qkv_proj` = `[q; k; v]` of its heads, `gate_up_proj` = `[gate; up]`, a vocabulary-parallel
    /// embedding and head whose rows may be padded) against the config and the rollout entries,
    /// with the CPU decoder's rules ([`lifecycle_decoder::CpuDecoder::new_fused`]).
    ///
    /// Long by design: as [`GroupOffsets::new`], one check per tensor family of the fused layout.
    pub(crate) fn fused(
        config: &ModelConfig,
        layout: &FusedLayout,
        entries: &[RolloutEntry],
    ) -> Result<Self, DecodeError> {
        let tp = layout.tp();
        let degree = |reason: String| DecodeError::Degree { tp, reason };
        if tp == 0 {
            return Err(degree("T must be at least 1".into()));
        }
        // the padding multiple of the training side plays no part in the rollout layout
        let model = config.model_spec(MEGATRON_VOCAB_MULTIPLE);
        if model.has_dense_mlp() && !config.model.ffn.is_multiple_of(tp) {
            return Err(degree(format!(
                "intermediate_size {} is not divisible by T",
                config.model.ffn
            )));
        }
        if let Some(t) = layout.tensors().iter().find(|t| lora::is_adapter(&t.name)) {
            return Err(DecodeError::Usage(format!(
                "the fused rollout layout holds LoRA adapter `{}`: the engine applies adapters \
                 in the unfused layout (the FSDP backends') only",
                t.name
            )));
        }
        let specs = layout.fused_tensors(&model)?;
        let by_name: HashMap<&str, &RolloutEntry> = entries.iter().map(|e| (e.name(), e)).collect();
        let mut offsets: HashMap<&str, u64> = HashMap::with_capacity(specs.len());
        // the fp8 matrices (block-scaled e4m3; a stack of experts in its (e · rows) × cols view)
        let mut fp8: HashMap<&str, Fp8At> = HashMap::new();
        let (mut fp8_max, mut fp8_max_cols) = (0u64, 0u64);
        let mut min_len = 0u64;
        for spec in &specs {
            let e = by_name
                .get(spec.name.as_str())
                .ok_or_else(|| DecodeError::MissingTensor {
                    name: spec.name.clone(),
                    rank: 0,
                })?;
            if let Some(scales) = e.scale_offset() {
                let cols = e.matrix().1 as u64;
                // one product reads one expert of a stack
                let stack = if e.shape().len() == 3 {
                    e.shape()[0]
                } else {
                    1
                };
                fp8_max = fp8_max.max((e.numel() / stack.max(1)) as u64);
                fp8_max_cols = fp8_max_cols.max(cols);
                fp8.insert(
                    e.name(),
                    Fp8At {
                        scales: scales as u64,
                        row0: 0,
                        cols,
                    },
                );
            }
            if e.shape() != spec.shape.as_slice() || e.numel() != spec.numel() {
                return Err(DecodeError::Shape {
                    name: spec.name.clone(),
                    rank: 0,
                    expected: spec.shape.clone(),
                    found: e.shape().to_vec(),
                });
            }
            min_len = min_len.max(e.range().end as u64);
            offsets.insert(e.name(), e.offset() as u64);
        }
        let offset = |name: &str| -> Result<u64, DecodeError> {
            offsets
                .get(name)
                .copied()
                .ok_or_else(|| DecodeError::MissingTensor {
                    name: name.to_string(),
                    rank: 0,
                })
        };
        // a tensor read in bf16 (norms, biases, embeddings, the router)
        let at = |name: &str| -> Result<u64, DecodeError> {
            if fp8.contains_key(name) {
                return Err(DecodeError::Usage(format!(
                    "`{name}` is fp8, but the decoder reads it in bf16: an fp8 rollout quantises \
                     matrix weights only (lifecycle_layout::fp8::keeps_bf16)"
                )));
            }
            offset(name)
        };
        // a weight matrix, bf16 or fp8
        let mat = |name: &str| -> Result<MatAt, DecodeError> {
            Ok(MatAt {
                off: offset(name)?,
                fp8: fp8.get(name).copied(),
            })
        };
        let kv_split = if config.model.query_groups.is_multiple_of(tp) {
            Parallel::Column
        } else {
            Parallel::Replicated
        };
        let shares = head_shares(config, tp, kv_split)?;
        if shares.iter().any(|s| s.kv_heads != shares[0].kv_heads) {
            return Err(degree(
                "the ranks would compute different numbers of kv heads".into(),
            ));
        }
        let (h, d) = (config.model.hidden, config.model.head_dim);
        let q_heads = config.model.heads / tp;
        let ffn_part = config.model.ffn / tp;
        let (q_rows, kv_rows) = (q_heads * d, shares[0].kv_heads * d);
        let mut layers = Vec::with_capacity(config.model.layers);
        for l in 0..config.model.layers {
            let qkv_name = hf::layer(l, hf::QKV);
            let rows = by_name
                .get(qkv_name.as_str())
                .and_then(|e| e.shape().first().copied())
                .unwrap_or(0);
            if rows != q_rows + 2 * kv_rows {
                // the layout's kv heads per rank differ from the decoder's head shares
                return Err(DecodeError::Shape {
                    name: qkv_name,
                    rank: 0,
                    expected: vec![q_rows + 2 * kv_rows, h],
                    found: vec![rows, h],
                });
            }
            let qkv = mat(&qkv_name)?;
            let bias = if config.model.qkv_bias {
                Some(at(&hf::layer(l, hf::QKV_BIAS))?)
            } else {
                None
            };
            // a mixture-of-experts layer has no dense MLP (its experts: `moe` below)
            let (gate_up, down) = if model.moe_layer(l) {
                (MatAt::default(), MatAt::default())
            } else {
                (
                    mat(&hf::layer(l, hf::GATE_UP))?,
                    mat(&hf::layer(l, hf::DOWN))?,
                )
            };
            layers.push(LayerOffsets {
                input_norm: at(&hf::layer(l, hf::INPUT_NORM))?,
                post_norm: at(&hf::layer(l, hf::POST_NORM))?,
                q_w: qkv,
                q_b: bias,
                k_w: qkv.skip_rows(q_rows, h),
                k_b: bias.map(|b| b + q_rows as u64),
                v_w: qkv.skip_rows(q_rows + kv_rows, h),
                v_b: bias.map(|b| b + (q_rows + kv_rows) as u64),
                o_w: mat(&hf::layer(l, hf::O))?,
                gate_w: gate_up,
                up_w: gate_up.skip_rows(ffn_part, h),
                down_w: down,
                qk_norm: if config.model.qk_norm {
                    Some((
                        at(&hf::layer(l, hf::Q_NORM))?,
                        at(&hf::layer(l, hf::K_NORM))?,
                    ))
                } else {
                    None
                },
                lora: [None; 7],
            });
        }
        let embed = at(hf::EMBED)?;
        let vocab_part = specs
            .iter()
            .find(|s| s.name == hf::EMBED)
            .and_then(|s| s.shape.first().copied())
            .unwrap_or(0);
        if vocab_part * tp < config.model.vocab {
            return Err(DecodeError::Shape {
                name: hf::EMBED.into(),
                rank: 0,
                expected: vec![config.model.vocab.div_ceil(tp), h],
                found: vec![vocab_part, h],
            });
        }
        let head = if config.model.tied_embeddings {
            embed
        } else {
            at(hf::LM_HEAD)?
        };
        let final_norm = at(hf::NORM)?;
        // every rank holds its experts at the same offsets: the stacks of its share
        let mut moe_ranks = Vec::with_capacity(tp);
        for t in 0..tp {
            let mut per_layer = Vec::with_capacity(config.model.layers);
            for l in 0..config.model.layers {
                per_layer.push(match (layout.expert_share(&model, t), model.moe) {
                    (Some(share), Some(m)) if model.moe_layer(l) => {
                        let (w13, w2) = (
                            mat(&hf::layer(l, hf::EXPERTS_W13))?,
                            mat(&hf::layer(l, hf::EXPERTS_W2))?,
                        );
                        let f = share.ffn.len();
                        let mut experts = vec![None; m.experts];
                        for (j, e) in share.experts.enumerate() {
                            // rows of the stacks' (experts · rows) × cols views
                            let gate = w13.skip_rows(j * 2 * f, h);
                            experts[e] = Some(ExpertOffsets {
                                gate,
                                up: gate.skip_rows(f, h),
                                down: w2.skip_rows(j * h, f),
                                ffn: f,
                            });
                        }
                        let shared = if m.shared_ffn > 0 {
                            let sf = m.shared_ffn / tp;
                            let gate = mat(&hf::layer(l, hf::SHARED_GATE_UP))?;
                            Some(SharedOffsets {
                                expert: ExpertOffsets {
                                    gate,
                                    up: gate.skip_rows(sf, h),
                                    down: mat(&hf::layer(l, hf::SHARED_DOWN))?,
                                    ffn: sf,
                                },
                                gate: at(&hf::layer(l, hf::SHARED_EXPERT_GATE))?,
                            })
                        } else {
                            None
                        };
                        Some(MoeOffsets {
                            router: at(&hf::layer(l, hf::ROUTER))?,
                            experts,
                            shared,
                        })
                    }
                    _ => None,
                });
            }
            moe_ranks.push(per_layer);
        }
        let ranks = shares
            .iter()
            .zip(moe_ranks)
            .map(|(&share, moe)| RankOffsets {
                embed,
                head,
                final_norm,
                share,
                layers: layers.clone(),
                moe,
            })
            .collect();
        Ok(GroupOffsets {
            ranks,
            q_heads,
            ffn_part,
            vocab_parallel: tp > 1,
            vocab_part,
            fused: true,
            min_len,
            fp8_max,
            fp8_max_cols,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lifecycle_layout::RolloutVocab;

    fn config(vocab: usize, kv: usize, bias: bool) -> ModelConfig {
        ModelConfig::from_json_str(&format!(
            r#"{{"model_type": "{}", "vocab_size": {vocab}, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": {kv}, "rope_theta": 10000.0,
            "tie_word_embeddings": false}}"#,
            // Qwen2 has q/k/v biases, Llama none
            if bias { "qwen2" } else { "llama" }
        ))
        .unwrap()
    }

    /// The entries of one rank of `layout`, packed in order.
    fn fused_entries(config: &ModelConfig, layout: &FusedLayout) -> Vec<RolloutEntry> {
        let specs = layout
            .fused_tensors(&config.model_spec(MEGATRON_VOCAB_MULTIPLE))
            .unwrap();
        let mut at = 0;
        specs
            .into_iter()
            .map(|s| {
                let e = RolloutEntry::new(s.name.clone(), s.shape.clone(), at);
                at += s.numel();
                e
            })
            .collect()
    }

    #[test]
    fn fused_offsets_split_qkv_and_gate_up_and_keep_the_padded_vocab() {
        // vocab 31 padded to 32 at T = 1; 4 q heads, 2 kv heads, head_dim 4
        let c = config(31, 2, true);
        let layout = FusedLayout::fused(1, RolloutVocab::PadToMultipleOf(8));
        let entries = fused_entries(&c, &layout);
        let plan = GroupOffsets::fused(&c, &layout, &entries).unwrap();
        assert!(plan.fused);
        assert!(!plan.vocab_parallel);
        assert_eq!(plan.vocab_part, 32);
        assert_eq!((plan.q_heads, plan.ffn_part), (4, 32));
        let find = |n: &str| entries.iter().find(|e| e.name() == n).unwrap().offset() as u64;
        let l = plan.ranks[0].layers[1];
        let qkv = find("model.layers.1.self_attn.qkv_proj.weight");
        let (q_rows, kv_rows, h) = (16u64, 8u64, 16u64);
        assert_eq!(l.q_w.off, qkv);
        assert_eq!(l.k_w.off, qkv + q_rows * h);
        assert_eq!(l.v_w.off, qkv + (q_rows + kv_rows) * h);
        let b = find("model.layers.1.self_attn.qkv_proj.bias");
        assert_eq!(
            (l.q_b, l.k_b, l.v_b),
            (Some(b), Some(b + q_rows), Some(b + 24))
        );
        let gu = find("model.layers.1.mlp.gate_up_proj.weight");
        assert_eq!((l.gate_w.off, l.up_w.off), (gu, gu + 32 * h));
        assert_eq!(plan.ranks[0].head, find("lm_head.weight"));
        let end = entries.iter().map(|e| e.range().end).max().unwrap() as u64;
        assert_eq!(plan.min_len, end);
    }

    #[test]
    fn fused_offsets_at_t2_are_vocab_parallel_with_replicated_kv() {
        // one kv head for T = 2: each rank holds a copy of it
        let c = config(31, 1, false);
        let layout = FusedLayout::fused(2, RolloutVocab::PadToMultipleOf(8));
        let entries = fused_entries(&c, &layout);
        let plan = GroupOffsets::fused(&c, &layout, &entries).unwrap();
        assert!(plan.vocab_parallel);
        assert_eq!(plan.vocab_part, 16);
        assert_eq!(plan.ranks.len(), 2);
        assert!(plan.ranks.iter().all(|r| r.share.kv_heads == 1));
        assert_eq!(plan.ranks[0].layers, plan.ranks[1].layers);
    }

    #[test]
    fn a_wrong_or_missing_fused_tensor_is_named() {
        let c = config(32, 2, false);
        let layout = FusedLayout::fused(1, RolloutVocab::Unpadded);
        let mut entries = fused_entries(&c, &layout);
        let i = entries
            .iter()
            .position(|e| e.name() == "model.layers.0.mlp.gate_up_proj.weight")
            .unwrap();
        let off = entries[i].offset();
        entries[i] = RolloutEntry::new("model.layers.0.mlp.gate_up_proj.weight", vec![32, 16], off);
        let msg = GroupOffsets::fused(&c, &layout, &entries)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("gate_up_proj"), "{msg}");
        entries.remove(i);
        match GroupOffsets::fused(&c, &layout, &entries) {
            Err(DecodeError::MissingTensor { name, .. }) => assert!(name.contains("gate_up")),
            other => panic!("expected MissingTensor, got {other:?}"),
        }
    }

    /// A shared base ([`crate::SharedBase`]): the adapters in a buffer, every base tensor in an
    /// allocation of its own (some below the buffer, some above it); the plan's offsets, counted
    /// from the lowest address, land on each tensor's own address, and the adapters' on theirs
    /// in the buffer.
    #[test]
    fn a_shared_base_is_addressed_where_each_tensor_lies() {
        use crate::{SharedBase, SharedTensor};
        use lifecycle_layout::lora::{with_adapters, LoraConfig, LoraTarget};
        let c = config(32, 2, true);
        let lora = LoraConfig::new(2, 4.0, vec![LoraTarget::Q, LoraTarget::Down]);
        let layout = with_adapters(&c.rollout_layout(1).unwrap(), &c.model, &lora).unwrap();
        let buffer = 0x40_0000u64;
        let (mut in_buffer, mut shared, mut next) = (Vec::new(), Vec::new(), 0usize);
        for (i, t) in layout.tensors().iter().enumerate() {
            if t.name.contains(".lora_") {
                in_buffer.push(RolloutEntry::new(t.name.clone(), t.shape.clone(), next));
                next += t.shape.iter().product::<usize>();
            } else {
                // alternately below and above the buffer, 4 KiB apart
                let address = if i % 2 == 0 {
                    0x1_0000 + 0x1000 * i as u64
                } else {
                    0x80_0000 + 0x1000 * i as u64
                };
                shared.push(SharedTensor {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    address,
                });
            }
        }
        let base = SharedBase::new(layout.clone(), shared.clone()).unwrap();
        let (at, entries) = base.entries(buffer, &in_buffer).unwrap();
        assert_eq!(at, shared.iter().map(|t| t.address).min().unwrap());
        let plan = GroupOffsets::new(&c, &layout, &[&entries[..]]).unwrap();
        plan.check_lora(&c, Some(&lora)).unwrap();
        let address = |name: &str| shared.iter().find(|t| t.name == name).unwrap().address;
        let addr = |slot: u64| at + 2 * slot;
        let w = &plan.ranks[0];
        assert_eq!(addr(w.embed), address("model.embed_tokens.weight"));
        assert_eq!(addr(w.head), address("lm_head.weight"));
        let l1 = &w.layers[1];
        assert_eq!(
            addr(l1.q_w.off),
            address("model.layers.1.self_attn.q_proj.weight")
        );
        assert_eq!(
            addr(l1.down_w.off),
            address("model.layers.1.mlp.down_proj.weight")
        );
        assert_eq!(
            addr(l1.q_b.unwrap()),
            address("model.layers.1.self_attn.q_proj.bias")
        );
        let slot = |name: &str| {
            in_buffer
                .iter()
                .find(|e| e.name() == name)
                .unwrap()
                .offset() as u64
        };
        let q = l1.lora[0].unwrap();
        assert_eq!(
            addr(q.a),
            buffer + 2 * slot("model.layers.1.self_attn.q_proj.lora_A.weight")
        );
        assert_eq!(
            addr(q.b),
            buffer + 2 * slot("model.layers.1.self_attn.q_proj.lora_B.weight")
        );
    }

    /// A rollout's adapters are read beside their bases (a replicated k / v adapter's B from
    /// the rank's kv rows) and checked against the configuration the engine is given: without
    /// one, or with another, refused by name (a LoRA model is never decoded on its base alone).
    #[test]
    fn a_rollouts_adapters_are_read_and_checked_by_name() {
        use lifecycle_layout::lora::{with_adapters, LoraConfig, LoraTarget};
        let c = config(32, 2, false);
        let lora = LoraConfig::new(2, 4.0, vec![LoraTarget::V, LoraTarget::Down]);
        for t in [1, 2, 4] {
            let layout = with_adapters(&c.rollout_layout(t).unwrap(), &c.model, &lora).unwrap();
            let mut at = 0;
            let entries: Vec<RolloutEntry> = layout
                .tensors()
                .iter()
                .map(|s| {
                    let shape = s.slice_shape(t);
                    let e = RolloutEntry::new(s.name.clone(), shape.clone(), at);
                    at += shape.iter().product::<usize>();
                    e
                })
                .collect();
            let plan = GroupOffsets::new(&c, &layout, &[&entries[..]]).unwrap();
            plan.check_lora(&c, Some(&lora)).unwrap();
            assert_eq!(plan.lora_rank(), 2);
            let offset = |name: &str| {
                let e = entries.iter().find(|e| e.name() == name).unwrap();
                e.offset() as u64
            };
            let v_b = offset("model.layers.1.self_attn.v_proj.lora_B.weight");
            for (rank, w) in plan.ranks.iter().enumerate() {
                let l1 = &w.layers[1];
                assert!(l1.lora[0].is_none() && l1.lora[3].is_none());
                let v = l1.lora[2].unwrap();
                assert_eq!(v.a, offset("model.layers.1.self_attn.v_proj.lora_A.weight"));
                // 2 kv heads of 4 rows: split at T = 1, 2, replicated at T = 4 (rank t reads
                // head t / 2)
                let kv_rows = if t == 4 { (rank / 2) * 4 } else { 0 };
                assert_eq!(v.b, v_b + (kv_rows * 2) as u64, "T = {t}, rank {rank}");
                let down = l1.lora[6].unwrap();
                assert_eq!(down.a, offset("model.layers.1.mlp.down_proj.lora_A.weight"));
            }
            let msg = plan.check_lora(&c, None).unwrap_err().to_string();
            assert!(
                msg.contains("model.layers.0.self_attn.v_proj.lora_A.weight"),
                "{msg}"
            );
            assert!(msg.contains("with_lora"), "{msg}");
            let other = LoraConfig::new(4, 4.0, vec![LoraTarget::V, LoraTarget::Down]);
            let msg = plan.check_lora(&c, Some(&other)).unwrap_err().to_string();
            assert!(msg.contains("r = 2"), "{msg}");
        }
    }

    #[test]
    fn layouts_are_told_apart_by_their_names() {
        let c = config(32, 2, false);
        let fused = fused_entries(&c, &FusedLayout::fused(1, RolloutVocab::Unpadded));
        assert_eq!(detect_layout(&fused).unwrap(), Some(LayoutKind::Fused));
        let unfused: Vec<RolloutEntry> = c
            .tensor_shapes()
            .into_iter()
            .map(|(n, s)| RolloutEntry::new(n, s, 0))
            .collect();
        assert_eq!(detect_layout(&unfused).unwrap(), Some(LayoutKind::Unfused));
        // the unfused names are not the fused layout
        assert!(
            GroupOffsets::fused(&c, &FusedLayout::fused(1, RolloutVocab::Unpadded), &unfused)
                .is_err()
        );
        let both: Vec<RolloutEntry> = fused.iter().chain(&unfused).cloned().collect();
        assert!(detect_layout(&both)
            .unwrap_err()
            .to_string()
            .contains("both"));
        assert_eq!(detect_layout(&[]).unwrap(), None);
    }
}
