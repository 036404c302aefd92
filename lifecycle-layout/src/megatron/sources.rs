//! Where each part of a rollout slice lives in the Megatron training buffers.
//!
//! A rollout slice is cut into [`Want`]s: 2-D regions (rows × columns) that are contiguous row
//! runs both in the slice and in every training buffer that holds them. Each want lists every
//! (stage, TP rank) location holding it; the DP replicas of each location hold it too.

use super::rollout::{RolloutKind, RolloutTensorSpec};
use super::train::{local_kv_heads, MegatronLayout, ParamKind};

/// A (stage, TP rank) buffer and an element offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    pub stage: usize,
    pub tp: usize,
    pub offset: usize,
}

/// One region of a rollout slice and the places it can be read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Want {
    pub dst_offset: usize,
    pub dst_pitch: usize,
    pub src_pitch: usize,
    pub rows: usize,
    pub cols: usize,
    pub locs: Vec<Loc>,
}

/// Overlap of two ranges as (start, len), if any.
fn overlap(a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> Option<(usize, usize)> {
    let s = a.start.max(b.start);
    let e = a.end.min(b.end);
    (s < e).then(|| (s, e - s))
}

/// Rows of a q head, a k head or a v head inside one TP rank's `linear_qkv`.
///
/// Megatron's fused order (`megatron/core/transformer/attention.py`,
/// `get_query_key_value_tensors`): the local part is viewed as `[groups_local, (heads_per_group +
/// 2) · head_dim, hidden]`, each group being its q heads, then its k head, then its v head. When
/// the groups are fewer than TP, each TP rank holds one group: its own `heads / TP` q heads and a
/// replica of the group's k and v heads (so `t` in `[g · TP/groups, (g+1) · TP/groups)` all hold
/// group `g`).
pub(crate) struct QkvRows {
    heads: usize,
    groups: usize,
    head_dim: usize,
    tp: usize,
}

impl QkvRows {
    pub(crate) fn new(layout: &MegatronLayout) -> Self {
        let m = layout.model();
        QkvRows {
            heads: m.heads,
            groups: m.query_groups,
            head_dim: m.head_dim,
            tp: layout.tp(),
        }
    }

    /// (TP rank, first row) of q head `h`.
    pub(crate) fn q(&self, h: usize) -> (usize, usize) {
        let qpg = self.heads / self.groups;
        if self.groups >= self.tp {
            let gl = self.groups / self.tp;
            let g = h / qpg;
            (g / gl, ((g % gl) * (qpg + 2) + h % qpg) * self.head_dim)
        } else {
            let hpr = self.heads / self.tp;
            (h / hpr, (h % hpr) * self.head_dim)
        }
    }

    /// Every (TP rank, first row) holding the k head of group `g` (`v`: the v head).
    pub(crate) fn kv(&self, g: usize, v: bool) -> Vec<(usize, usize)> {
        let qpg = self.heads / self.groups;
        let shift = usize::from(v) * self.head_dim;
        if self.groups >= self.tp {
            let gl = self.groups / self.tp;
            vec![(g / gl, ((g % gl) * (qpg + 2) + qpg) * self.head_dim + shift)]
        } else {
            let rpg = self.tp / self.groups;
            let row = (self.heads / self.tp) * self.head_dim + shift;
            (g * rpg..(g + 1) * rpg).map(|t| (t, row)).collect()
        }
    }
}

/// The wants of rollout TP rank `t` (of `rollout_tp`) for one rollout tensor.
pub(crate) fn wants(
    train: &MegatronLayout,
    spec: &RolloutTensorSpec,
    rollout_tp: usize,
    vocab_rows: usize,
    t: usize,
) -> Vec<Want> {
    let m = train.model();
    let (tp, pp) = (train.tp(), train.pp());
    let h = m.hidden;
    let slot_offset = |stage: usize, kind: ParamKind, layer: Option<usize>| {
        train
            .slot(stage, kind, layer)
            .map(|s| s.offset)
            .unwrap_or_default()
    };
    let layer_stage = spec.layer.map_or(pp - 1, |l| train.stage_of_layer(l));
    let mut out = Vec::new();
    match spec.kind {
        RolloutKind::Embedding | RolloutKind::LmHead => {
            let mut slots = Vec::new();
            if spec.kind == RolloutKind::Embedding {
                slots.push((0, slot_offset(0, ParamKind::WordEmbedding, None)));
            }
            if spec.kind == RolloutKind::LmHead || (m.tied_embeddings && pp > 1) {
                slots.push((pp - 1, slot_offset(pp - 1, ParamKind::OutputLayer, None)));
            }
            let per = vocab_rows / rollout_tp;
            let mine = (t * per).min(m.vocab)..((t + 1) * per).min(m.vocab);
            let tper = train.padded_vocab() / tp;
            for tau in 0..tp {
                if let Some((r0, n)) = overlap(mine.clone(), tau * tper..(tau + 1) * tper) {
                    out.push(Want {
                        dst_offset: (r0 - t * per) * h,
                        dst_pitch: h,
                        src_pitch: h,
                        rows: n,
                        cols: h,
                        locs: slots
                            .iter()
                            .map(|&(stage, off)| Loc {
                                stage,
                                tp: tau,
                                offset: off + (r0 - tau * tper) * h,
                            })
                            .collect(),
                    });
                }
            }
        }
        RolloutKind::InputNorm | RolloutKind::PostNorm | RolloutKind::Norm => {
            let kind = match spec.kind {
                RolloutKind::InputNorm => ParamKind::InputNorm,
                RolloutKind::PostNorm => ParamKind::PreMlpNorm,
                _ => ParamKind::FinalNorm,
            };
            let off = slot_offset(layer_stage, kind, spec.layer);
            out.push(Want {
                dst_offset: 0,
                dst_pitch: h,
                src_pitch: h,
                rows: 1,
                cols: h,
                locs: (0..tp)
                    .map(|tau| Loc {
                        stage: layer_stage,
                        tp: tau,
                        offset: off,
                    })
                    .collect(),
            });
        }
        RolloutKind::Qkv | RolloutKind::QkvBias => {
            let (kind, cols) = if spec.kind == RolloutKind::Qkv {
                (ParamKind::Qkv, h)
            } else {
                (ParamKind::QkvBias, 1)
            };
            let off = slot_offset(layer_stage, kind, spec.layer);
            let hd = m.head_dim;
            let rows = QkvRows::new(train);
            let head = |dst_row: usize, locs: Vec<(usize, usize)>| Want {
                dst_offset: dst_row * cols,
                dst_pitch: cols,
                src_pitch: cols,
                rows: hd,
                cols,
                locs: locs
                    .into_iter()
                    .map(|(tau, row)| Loc {
                        stage: layer_stage,
                        tp: tau,
                        offset: off + row * cols,
                    })
                    .collect(),
            };
            let qh = m.heads / rollout_tp;
            for j in 0..qh {
                out.push(head(j * hd, vec![rows.q(t * qh + j)]));
            }
            let kvl = local_kv_heads(m.query_groups, rollout_tp);
            let g0 = if m.query_groups >= rollout_tp {
                t * kvl
            } else {
                t / (rollout_tp / m.query_groups)
            };
            for j in 0..kvl {
                out.push(head((qh + j) * hd, rows.kv(g0 + j, false)));
            }
            for j in 0..kvl {
                out.push(head((qh + kvl + j) * hd, rows.kv(g0 + j, true)));
            }
        }
        RolloutKind::O | RolloutKind::Down => {
            let (kind, full) = if spec.kind == RolloutKind::O {
                (ParamKind::Proj, m.q_rows())
            } else {
                (ParamKind::Fc2, m.ffn)
            };
            let off = slot_offset(layer_stage, kind, spec.layer);
            let (per_t, per_tp) = (full / rollout_tp, full / tp);
            for tau in 0..tp {
                if let Some((c0, n)) =
                    overlap(t * per_t..(t + 1) * per_t, tau * per_tp..(tau + 1) * per_tp)
                {
                    out.push(Want {
                        dst_offset: c0 - t * per_t,
                        dst_pitch: per_t,
                        src_pitch: per_tp,
                        rows: h,
                        cols: n,
                        locs: vec![Loc {
                            stage: layer_stage,
                            tp: tau,
                            offset: off + (c0 - tau * per_tp),
                        }],
                    });
                }
            }
        }
        RolloutKind::GateUp => {
            let off = slot_offset(layer_stage, ParamKind::Fc1, spec.layer);
            let (per_t, per_tp) = (m.ffn / rollout_tp, m.ffn / tp);
            for up in [false, true] {
                for tau in 0..tp {
                    if let Some((r0, n)) =
                        overlap(t * per_t..(t + 1) * per_t, tau * per_tp..(tau + 1) * per_tp)
                    {
                        let dst_row = usize::from(up) * per_t + r0 - t * per_t;
                        let src_row = usize::from(up) * per_tp + r0 - tau * per_tp;
                        out.push(Want {
                            dst_offset: dst_row * h,
                            dst_pitch: h,
                            src_pitch: h,
                            rows: n,
                            cols: h,
                            locs: vec![Loc {
                                stage: layer_stage,
                                tp: tau,
                                offset: off + src_row * h,
                            }],
                        });
                    }
                }
            }
        }
    }
    out
}
