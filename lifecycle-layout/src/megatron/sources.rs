//! Where each part of a rollout slice lives in the Megatron training buffers.
//!
//! A rollout slice is cut into [`Want`]s: 2-D regions (rows × columns) that are contiguous row
//! runs both in the slice and in every training buffer that holds them. Each want lists every
//! (stage, TP rank) location holding it; the DP replicas of each location hold it too.

use super::rollout::{RolloutKind, RolloutTensorSpec};
use super::train::{local_kv_heads, qkv_head_row, MegatronLayout, ParamKind, QkvHead};
use crate::ModelSpec;

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

/// Rows of a q head, a k head or a v head inside the TP ranks' `linear_qkv`: each rank holds a
/// plain `1/TP` chunk of the full fused tensor ([`qkv_head_row`]), so a head may start on one
/// rank and end on the next (heads + 2 · groups not a multiple of TP).
pub(crate) struct QkvRows {
    model: ModelSpec,
    chunk: usize,
}

impl QkvRows {
    pub(crate) fn new(layout: &MegatronLayout) -> Self {
        QkvRows {
            model: *layout.model(),
            chunk: layout.qkv_local_rows(),
        }
    }

    /// The runs of `head`'s `head_dim` rows: (TP rank, first row there, first row of the
    /// head it covers, rows), in order; one run unless the head crosses a chunk boundary.
    pub(crate) fn runs(&self, head: QkvHead) -> Vec<(usize, usize, usize, usize)> {
        let hd = self.model.head_dim;
        let start = qkv_head_row(&self.model, head) * hd;
        let mut out = Vec::new();
        let mut row = start;
        while row < start + hd {
            let (tp, local) = (row / self.chunk, row % self.chunk);
            let len = (self.chunk - local).min(start + hd - row);
            out.push((tp, local, row - start, len));
            row += len;
        }
        out
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
        RolloutKind::InputNorm
        | RolloutKind::PostNorm
        | RolloutKind::Norm
        | RolloutKind::QNorm
        | RolloutKind::KNorm => {
            let (kind, width) = match spec.kind {
                RolloutKind::InputNorm => (ParamKind::InputNorm, h),
                RolloutKind::PostNorm => (ParamKind::PreMlpNorm, h),
                RolloutKind::QNorm => (ParamKind::QNorm, m.head_dim),
                RolloutKind::KNorm => (ParamKind::KNorm, m.head_dim),
                _ => (ParamKind::FinalNorm, h),
            };
            let off = slot_offset(layer_stage, kind, spec.layer);
            out.push(Want {
                dst_offset: 0,
                dst_pitch: width,
                src_pitch: width,
                rows: 1,
                cols: width,
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
            let mut head = |dst_row: usize, which: QkvHead| {
                for (tau, row, within, n) in rows.runs(which) {
                    out.push(Want {
                        dst_offset: (dst_row + within) * cols,
                        dst_pitch: cols,
                        src_pitch: cols,
                        rows: n,
                        cols,
                        locs: vec![Loc {
                            stage: layer_stage,
                            tp: tau,
                            offset: off + row * cols,
                        }],
                    });
                }
            };
            let qh = m.heads / rollout_tp;
            for j in 0..qh {
                head(j * hd, QkvHead::Q(t * qh + j));
            }
            let kvl = local_kv_heads(m.query_groups, rollout_tp);
            let g0 = if m.query_groups >= rollout_tp {
                t * kvl
            } else {
                t / (rollout_tp / m.query_groups)
            };
            for j in 0..kvl {
                head((qh + j) * hd, QkvHead::K(g0 + j));
            }
            for j in 0..kvl {
                head((qh + kvl + j) * hd, QkvHead::V(g0 + j));
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
