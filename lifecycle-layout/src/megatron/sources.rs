//! Where each part of a rollout slice lives in the Megatron training buffers.
//!
//! A rollout slice is cut into [`Want`]s: 2-D regions (rows × columns) that are contiguous row
//! runs both in the slice and in every training buffer that holds them. Each want lists every
//! location holding it: a (stage, TP rank) dense part, whose DP replicas hold it too, or a
//! (stage, ETP rank, EP rank) expert part, whose expert data-parallel replicas hold it too.

use super::experts::{ExpertCoords, ExpertPart};
use super::rollout::{RolloutKind, RolloutTensorSpec};
use super::train::{local_kv_heads, qkv_head_row, MegatronLayout, ParamKind, QkvHead};
use crate::{ModelSpec, RolloutLayout};

/// Which ranks' buffers hold a part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holder {
    /// The dense part of (stage, TP rank): its DP replicas.
    Dense { stage: usize, tp: usize },
    /// The expert part of (stage, ETP rank, EP rank): its expert data-parallel replicas.
    Expert { stage: usize, etp: usize, ep: usize },
}

impl Holder {
    /// The ranks holding it.
    pub(crate) fn ranks(self, train: &MegatronLayout) -> Vec<usize> {
        match self {
            Holder::Dense { stage, tp } => {
                (0..train.dp()).map(|d| train.rank(tp, d, stage)).collect()
            }
            Holder::Expert { stage, etp, ep } => match train.expert_parallel() {
                Some(ex) => (0..ex.edp())
                    .map(|edp| {
                        ex.rank(ExpertCoords {
                            etp,
                            ep,
                            edp,
                            pp: stage,
                        })
                    })
                    .collect(),
                None => Vec::new(),
            },
        }
    }
}

/// A part of some ranks' buffers and an element offset in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    pub holder: Holder,
    pub offset: usize,
}

impl Loc {
    fn dense(stage: usize, tp: usize, offset: usize) -> Self {
        Loc {
            holder: Holder::Dense { stage, tp },
            offset,
        }
    }
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
///
/// Long by design: one arm per kind of rollout tensor (fused q/k/v, fused gate/up, stacked
/// experts, vocabulary-parallel, replicated), each deriving the rows that kind takes.
pub(crate) fn wants(
    train: &MegatronLayout,
    rollout: &RolloutLayout,
    spec: &RolloutTensorSpec,
    vocab_rows: usize,
    t: usize,
) -> Vec<Want> {
    let rollout_tp = rollout.tp();
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
    let shared_ffn = m.moe.map_or(0, |moe| moe.shared_ffn);
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
                            .map(|&(stage, off)| {
                                Loc::dense(stage, tau, off + (r0 - tau * tper) * h)
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
        | RolloutKind::KNorm
        | RolloutKind::Router
        | RolloutKind::SharedGate => {
            let (kind, rows, width) = match spec.kind {
                RolloutKind::InputNorm => (ParamKind::InputNorm, 1, h),
                RolloutKind::PostNorm => (ParamKind::PreMlpNorm, 1, h),
                RolloutKind::QNorm => (ParamKind::QNorm, 1, m.head_dim),
                RolloutKind::KNorm => (ParamKind::KNorm, 1, m.head_dim),
                RolloutKind::Router => (ParamKind::Router, spec.shape[0], h),
                RolloutKind::SharedGate => (ParamKind::SharedGate, 1, h),
                _ => (ParamKind::FinalNorm, 1, h),
            };
            let off = slot_offset(layer_stage, kind, spec.layer);
            out.push(Want {
                dst_offset: 0,
                dst_pitch: width,
                src_pitch: width,
                rows,
                cols: width,
                locs: (0..tp)
                    .map(|tau| Loc::dense(layer_stage, tau, off))
                    .collect(),
            });
        }
        RolloutKind::ExpertsW13 | RolloutKind::ExpertsW2 => {
            expert_wants(train, rollout, spec, t, &mut out);
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
                        locs: vec![Loc::dense(layer_stage, tau, off + row * cols)],
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
        RolloutKind::O | RolloutKind::Down | RolloutKind::SharedDown => {
            let (kind, full) = match spec.kind {
                RolloutKind::O => (ParamKind::Proj, m.q_rows()),
                RolloutKind::Down => (ParamKind::Fc2, m.ffn),
                _ => (ParamKind::SharedFc2, shared_ffn),
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
                        locs: vec![Loc::dense(layer_stage, tau, off + (c0 - tau * per_tp))],
                    });
                }
            }
        }
        RolloutKind::GateUp | RolloutKind::SharedGateUp => {
            let (kind, full) = if spec.kind == RolloutKind::GateUp {
                (ParamKind::Fc1, m.ffn)
            } else {
                (ParamKind::SharedFc1, shared_ffn)
            };
            let off = slot_offset(layer_stage, kind, spec.layer);
            let (per_t, per_tp) = (full / rollout_tp, full / tp);
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
                            locs: vec![Loc::dense(layer_stage, tau, off + src_row * h)],
                        });
                    }
                }
            }
        }
    }
    out
}

/// The wants of rollout TP rank `t` for a stacked expert tensor: per expert of its share, per
/// expert tensor-parallel rank whose intermediate rows overlap the share's, the gate and up rows
/// (`w13`) or the down columns (`w2`) from the grouped-GEMM tensor of the expert-parallel rank
/// that owns the expert.
fn expert_wants(
    train: &MegatronLayout,
    rollout: &RolloutLayout,
    spec: &RolloutTensorSpec,
    t: usize,
    out: &mut Vec<Want>,
) {
    let m = train.model();
    let (Some(ex), Some(share), Some(layer)) = (
        train.expert_parallel(),
        rollout.expert_share(m, t),
        spec.layer,
    ) else {
        return;
    };
    let h = m.hidden;
    let stage = train.stage_of_layer(layer);
    let (f0, f) = (share.ffn.start, share.ffn.len());
    let per_etp = m.moe.map_or(0, |moe| moe.ffn) / ex.etp();
    let per_ep = m.moe.map_or(0, |moe| moe.experts) / ex.ep();
    let w13 = spec.kind == RolloutKind::ExpertsW13;
    for (j, e) in share.experts.clone().enumerate() {
        let (ep, local) = (e / per_ep, e % per_ep);
        let part = if w13 {
            ExpertPart::Fc1
        } else {
            ExpertPart::Fc2
        };
        let Some(slot) = train.expert_slot(layer, local, part) else {
            continue;
        };
        for etp in 0..ex.etp() {
            let Some((r0, n)) = overlap(share.ffn.clone(), etp * per_etp..(etp + 1) * per_etp)
            else {
                continue;
            };
            let holder = Holder::Expert { stage, etp, ep };
            let within = r0 - etp * per_etp;
            if w13 {
                for up in [false, true] {
                    let dst_row = usize::from(up) * f + r0 - f0;
                    let src_row = usize::from(up) * per_etp + within;
                    out.push(Want {
                        dst_offset: j * 2 * f * h + dst_row * h,
                        dst_pitch: h,
                        src_pitch: h,
                        rows: n,
                        cols: h,
                        locs: vec![Loc {
                            holder,
                            offset: slot.offset + src_row * h,
                        }],
                    });
                }
            } else {
                out.push(Want {
                    dst_offset: j * h * f + (r0 - f0),
                    dst_pitch: f,
                    src_pitch: per_etp,
                    rows: h,
                    cols: n,
                    locs: vec![Loc {
                        holder,
                        offset: slot.offset + within,
                    }],
                });
            }
        }
    }
}
